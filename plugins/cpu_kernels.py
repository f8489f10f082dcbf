"""metrale's C++ kernels for the CPU packages, compiled into one static library that AOTInductor
links into a package: `cpu_moe.cpp` (`metrale::routed_experts`), `cpu_linear.cpp`
(`metrale::linear_rows`) and `cpu_attention.cpp` (`metrale::pooled_attention` and
`pooled_tree_attention`), with the vector helpers they share (`cpu_simd.h`) and the register tiles of the first two (`cpu_tiles.h`, which
read weights held in panels: `cpu_panels`).

`static_library()` compiles every source (each with its C shim, `aoti_torch_cpu_<op>`) into
lib<LIBRARY>.a, cached by the sources, compiler, flags and torch version; `inductor_configs()`
is what `aoti_compile_and_package` needs to call the ops a step holds: their shims'
declarations and the library, linked into the package, which then needs nothing more at run
time. `shared_library()` is the same code as a shared library, for tests calling the kernels
over ctypes. The kernels are float32, for x86 CPUs with AVX-512 or with AVX2 and FMA
(`available`): the library is compiled for the ISA torch's own CPU kernels use on this machine
(`FLAGS`), 16-float vectors with AVX-512, 8-float ones with AVX2, and a row's bits are the same
with either. Elsewhere the compiled steps keep inductor's code.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = (HERE / "cpu_moe.cpp", HERE / "cpu_linear.cpp", HERE / "cpu_attention.cpp")
HEADERS = (HERE / "cpu_simd.h", HERE / "cpu_tiles.h")
LIBRARY = "metrale_cpu_kernels"  # lib<LIBRARY>.a
# the compiler's flags for each CPU capability torch reports that the kernels take
ISA_FLAGS = {
    "AVX512": ["-O3", "-mavx512f", "-mavx512dq", "-mfma", "-fPIC", "-std=c++17"],
    "AVX2": ["-O3", "-mavx2", "-mfma", "-fPIC", "-std=c++17"],
}
ISA = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", or one the kernels do not take
FLAGS = ISA_FLAGS.get(ISA, [])  # this machine's (none: the kernels are not available here)


def available(dtype: torch.dtype) -> bool:
    """Whether packages of `dtype` can use the kernels on this machine."""
    return dtype == torch.float32 and ISA in ISA_FLAGS


def digest() -> str:
    """The kernels' sources and headers, hashed (what a compiled package depends on)."""
    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(path.read_bytes())
    return h.hexdigest()


def _compiler() -> str:
    from torch._inductor.cpp_builder import get_cpp_compiler

    return get_cpp_compiler()


def static_library(cache: Path) -> Path:
    """lib<LIBRARY>.a under `cache`, compiled for this machine's ISA (`FLAGS`) once per sources,
    compiler and flags; returns its folder."""
    from torch.utils.cpp_extension import include_paths

    if not FLAGS:
        raise RuntimeError(f"metrale's CPU kernels need AVX-512 or AVX2 with FMA; this CPU's capability is {ISA}")
    cxx = _compiler()
    key = hashlib.sha256(repr((digest(), cxx, FLAGS, torch.__version__)).encode()).hexdigest()[:16]
    folder = cache / f"cpu_kernels-{key}"
    lib = folder / f"lib{LIBRARY}.a"
    if lib.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{p}" for p in include_paths()] + [f"-I{HERE}"]
    objects = []
    for source in SOURCES:
        obj = folder / f"{source.stem}.{os.getpid()}.o"
        _run([cxx, *FLAGS, *includes, "-c", str(source), "-o", str(obj)])
        objects.append(obj)
    tmp = folder / f"lib{LIBRARY}.{os.getpid()}.a"
    _run(["ar", "rcs", str(tmp), *map(str, objects)])
    os.replace(tmp, lib)
    for obj in objects:
        obj.unlink()
    return folder


def shared_library(cache: Path) -> Path:
    """The kernels as a shared library (for tests: `metrale_<op>` called over ctypes)."""
    folder = static_library(cache)
    so = folder / "shared" / f"lib{LIBRARY}.so"  # not beside the archive: -l would link it
    if not so.is_file():
        so.parent.mkdir(exist_ok=True)
        tmp = so.parent / f"lib{LIBRARY}.{os.getpid()}.so"
        from torch.utils.cpp_extension import library_paths

        torch_lib = library_paths()[0]  # the shims' aoti_torch_* functions
        _run([_compiler(), "-shared", "-o", str(tmp), "-Wl,--whole-archive", str(folder / f"lib{LIBRARY}.a"),
              "-Wl,--no-whole-archive", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-ltorch_cpu", "-lc10"])
        os.replace(tmp, so)
    return so


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling metrale's CPU kernels failed: {' '.join(cmd)}\n{done.stderr[-2000:]}")


def inductor_configs(cache: Path) -> dict:
    """The `aoti_compile_and_package` configs that link the kernels into a package and call the
    shim of each of metrale's ops the step holds (the linker finds the library through
    LIBRARY_PATH, which this sets for the compiling process)."""
    from metrale.plugins import cpu_attention, cpu_linear, cpu_moe

    folder = static_library(cache)
    os.environ["LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(folder), os.environ.get("LIBRARY_PATH", "")) if p)
    return {"aot_inductor.custom_ops_to_c_shims": {torch.ops.metrale.routed_experts.default: [cpu_moe.SHIM],
                                                   torch.ops.metrale.linear_rows.default: [cpu_linear.SHIM],
                                                   torch.ops.metrale.pooled_attention.default: [cpu_attention.SHIM],
                                                   torch.ops.metrale.pooled_tree_attention.default:
                                                       [cpu_attention.TREE_SHIM]},
            "aot_inductor.custom_op_libs": [LIBRARY]}
