"""`metrale::routed_experts`: a MoE layer's routed experts as one op, with a C++ kernel that the
CPU packages (AOTInductor) call directly.

    y [N, H] = sum_j weights[:, j] * D_e (silu(g) * u),  [g; u] = GU_e x,  e = ids[:, j]

with gate_up [E, H, 2I] (gate columns [0, I), up [I, 2I)) and down [E, I, H]. Eagerly the op is
its math in torch ops (`routed_math`); in a package it is `cpu_moe.cpp`: the (row, slot) pairs
grouped by expert, each expert's weights read once per call for all of its pairs, eight
accumulators to a register tile (four pairs x 32 columns down to one pair x 128), every output
one in-order chain of fused multiply-adds, so a row's bits never depend on the other rows of
the call or the tile's shape. Inductor's own code for the same math reads each
pair's expert weights anew and keeps one accumulator per loop. Measured single-threaded on
the tiny target's layer (E = 8, H = I = 128, top-2), the layer alone (inductor's code for
the same math -> the kernel): 1 row 42 -> 8 us, 16 rows 150 -> 60 us, 32 rows 260 -> 116 us;
the whole target package step (4 layers, best of 7, one after the other): 1 row 104 -> 98 us,
8 rows 497 -> 434 us, 16 rows 1,333 -> 1,124 us, 32 rows 3,185 -> 2,559 us.

`static_library()` compiles the kernel (with its C shim, `aoti_torch_cpu_routed_experts`) into a
static library, cached by its source, compiler and flags; `inductor_configs()` is what
`aoti_compile_and_package` needs to call it: the shim's declaration and the library, linked
into the package, which then needs nothing more at run time. The kernel is float32 and AVX-512
only (`available`); elsewhere the compiled step keeps inductor's code.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

OP_NAME = "metrale::routed_experts"
SOURCE = Path(__file__).with_name("cpu_moe.cpp")
LIBRARY = "metrale_cpu_moe"  # lib<LIBRARY>.a
SHIM = ("AOTITorchError aoti_torch_cpu_routed_experts(AtenTensorHandle x, AtenTensorHandle ids, "
        "AtenTensorHandle weights, AtenTensorHandle gate_up, AtenTensorHandle down, AtenTensorHandle* ret0)")
FLAGS = ["-O3", "-mavx512f", "-mavx512dq", "-mfma", "-fPIC", "-std=c++17"]


@torch.library.custom_op(OP_NAME, mutates_args=())
def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """x [N, H], ids/weights [N, k], gate_up [E, H, 2I], down [E, I, H] -> y [N, H]."""
    return routed_math(x, ids, weights, gate_up, down)


@routed_experts.register_fake
def _(x, ids, weights, gate_up, down):
    return x.new_empty(x.shape)


def routed_math(x, ids, weights, gate_up, down) -> torch.Tensor:
    """The op in torch ops: each pair's expert on its row, the pairs summed in slot order."""
    gate, up = torch.einsum("nh,nkhj->nkj", x, gate_up[ids]).chunk(2, dim=-1)  # [N, k, I]
    y = torch.einsum("nki,nkih->nkh", F.silu(gate) * up, down[ids])  # [N, k, H]
    return (y * weights.unsqueeze(-1)).sum(1)


def available(dtype: torch.dtype) -> bool:
    """Whether packages of `dtype` can use the kernel on this machine."""
    return dtype == torch.float32 and torch.backends.cpu.get_cpu_capability() == "AVX512"


def fits(intermediate: int, hidden: int) -> bool:
    """Whether the kernel takes experts of these sizes: whole 16-float vectors."""
    return intermediate % 16 == 0 and hidden % 16 == 0


def _compiler() -> str:
    from torch._inductor.cpp_builder import get_cpp_compiler

    return get_cpp_compiler()


def static_library(cache: Path) -> Path:
    """lib<LIBRARY>.a under `cache`, compiled once per source, compiler and flags; returns its
    folder."""
    from torch.utils.cpp_extension import include_paths

    cxx = _compiler()
    key = hashlib.sha256(repr((SOURCE.read_bytes(), cxx, FLAGS, torch.__version__)).encode()).hexdigest()[:16]
    folder = cache / f"cpu_moe-{key}"
    lib = folder / f"lib{LIBRARY}.a"
    if lib.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    obj = folder / f"cpu_moe.{os.getpid()}.o"
    includes = [f"-I{p}" for p in include_paths()]
    _run([cxx, *FLAGS, *includes, "-c", str(SOURCE), "-o", str(obj)])
    tmp = folder / f"lib{LIBRARY}.{os.getpid()}.a"
    _run(["ar", "rcs", str(tmp), str(obj)])
    os.replace(tmp, lib)
    obj.unlink()
    return folder


def shared_library(cache: Path) -> Path:
    """The kernel as a shared library (for tests: `metrale_routed_experts` called over ctypes)."""
    folder = static_library(cache)
    so = folder / "shared" / f"lib{LIBRARY}.so"  # not beside the archive: -l would link it
    if not so.is_file():
        so.parent.mkdir(exist_ok=True)
        tmp = so.parent / f"lib{LIBRARY}.{os.getpid()}.so"
        from torch.utils.cpp_extension import library_paths

        torch_lib = library_paths()[0]  # the shim's aoti_torch_* functions
        _run([_compiler(), "-shared", "-o", str(tmp), "-Wl,--whole-archive", str(folder / f"lib{LIBRARY}.a"),
              "-Wl,--no-whole-archive", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-ltorch_cpu", "-lc10"])
        os.replace(tmp, so)
    return so


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling the CPU MoE kernel failed: {' '.join(cmd)}\n{done.stderr[-2000:]}")


def inductor_configs(cache: Path) -> dict:
    """The `aoti_compile_and_package` configs that link the kernel into a package (the linker
    finds the library through LIBRARY_PATH, which this sets for the compiling process)."""
    folder = static_library(cache)
    os.environ["LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(folder), os.environ.get("LIBRARY_PATH", "")) if p)
    return {"aot_inductor.custom_ops_to_c_shims": {torch.ops.metrale.routed_experts.default: [SHIM]},
            "aot_inductor.custom_op_libs": [LIBRARY]}
