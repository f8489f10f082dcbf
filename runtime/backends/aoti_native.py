"""Running an AOTInductor package's model library without holding the GIL.

torch's package loader (`torch._inductor.aoti_load_package`) keeps the interpreter lock for the
whole of a call: while the model thread computes a batched step, the server's event loop (HTTP
parsing, tokenization, streaming) cannot run on another core, so under load the host's work and
the model's are serialised (a Python thread beside a looping batched step barely runs). A
package is a zip holding one shared library of the model, its
weights inside (`freezing`); `NativeRunner` opens that library with `ctypes` (whose foreign
calls release the lock) and drives AOTInductor's C interface: a model container of one model,
`AOTInductorModelContainerRun` over the inputs' tensor handles. The outputs are the loader's,
bit for bit (tested).

`load_runner(path)` gives a `NativeRunner` where a package has that shape, else the loader's
own entry point, so an archive of another layout still runs (holding the lock).
"""

from __future__ import annotations

import _ctypes
import ctypes
import logging
import os
import tempfile
import zipfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_MODEL_DIR = "/data/aotinductor/model/"  # inside the archive's top folder

_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_pointer, _capsule = _api.PyCapsule_GetPointer, _api.PyCapsule_New
_to_handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors
_from_handles = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs


def model_library(archive: zipfile.ZipFile) -> str | None:
    """The archive's one model library, when the package is one library and its metadata
    (no weights stored beside it, no second model), else None."""
    data = [n for n in archive.namelist() if "/data/" in n and not n.endswith("/")]
    libraries = [n for n in data if _MODEL_DIR in n and n.endswith(".so")]
    beside = [n for n in data if _MODEL_DIR not in n or not n.endswith((".so", ".cpp", ".json"))]
    return libraries[0] if len(libraries) == 1 and not beside else None


class NativeRunner:
    """One package's model, called with the GIL released: `runner(inputs)` -> outputs, as the
    loader's `boxed_run`."""

    def __init__(self, path: str | Path, member: str, lanes: int = 1):
        with tempfile.TemporaryDirectory(prefix="metrale-aoti-") as tmp, zipfile.ZipFile(path) as z:
            # the library is mapped once opened: its file may go with the folder
            self._lib = ctypes.CDLL(z.extract(member, tmp))
        lib = self._lib
        self._check(lib.AOTInductorModelContainerCreateWithDevice, "create its model", path,
                    ctypes.byref(handle := ctypes.c_void_p()), ctypes.c_size_t(lanes), b"cpu", None)
        self._handle, self.lanes = handle, lanes  # models in the container: calls at once
        outputs = ctypes.c_size_t()
        self._check(lib.AOTInductorModelContainerGetNumOutputs, "count its outputs", path, handle,
                    ctypes.byref(outputs))
        self.outputs = outputs.value
        run = lib.AOTInductorModelContainerRun
        run.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                        ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]
        self._run, self.path = run, str(path)

    @staticmethod
    def _check(fn, what: str, path, *args) -> None:
        if fn(*args) != 0:
            raise RuntimeError(f"AOTInductor package {path}: could not {what}")

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        handles = _to_handles(inputs)  # new handles, stolen by the run
        n = len(handles)
        ins = (ctypes.c_void_p * n)(*[_pointer(h, None) for h in handles])
        outs = (ctypes.c_void_p * self.outputs)()
        if self._run(self._handle, ins, n, outs, self.outputs, None, None) != 0:
            raise RuntimeError(f"AOTInductor package {self.path}: its run failed (see the message above)")
        return _from_handles([_capsule(p, None, None) for p in outs])

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle is not None and handle.value:
            self._lib.AOTInductorModelContainerDelete(handle)
            self._handle = None
        lib = getattr(self, "_lib", None)
        if lib is not None:  # ctypes never unloads a library: each load's copy would stay mapped
            _ctypes.dlclose(lib._handle)
            self._lib = None


class _LoaderRunner:
    """torch's package loader, one call at a time, holding the GIL."""

    lanes = 1

    def __init__(self, path: str | Path):
        import torch._inductor

        self._run = torch._inductor.aoti_load_package(str(path)).loader.boxed_run

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._run(inputs)


def load_runner(path: str | Path, lanes: int = 1):
    """The package at `path` as a callable over a list of inputs with `lanes`, the calls it can
    run at once: a `NativeRunner` of `lanes` models (no GIL held while one computes) where the
    archive is one model library, else torch's loader (one lane)."""
    with zipfile.ZipFile(path) as z:
        member = model_library(z)
    if member is not None and os.name == "posix":
        return NativeRunner(path, member, lanes)
    log.info("%s: not one model library; it runs through torch's package loader", path)
    return _LoaderRunner(path)


MIN_LANE_ROWS = 4  # a call is split only where each lane gets at least this many rows: a smaller
# share saves less than the extra call costs (each call streams every weight)


class Lanes:
    """Runs the package calls of one batched step on `n` threads at once: the step's sequences
    split into `n` parts of about equal rows (`split`), each part one call on its own thread
    (the calls release the GIL, `NativeRunner`, and each is single-threaded as compiled). A
    row's bits do not depend on which call it is in (the batched steps' contract), so splitting
    changes no result."""

    def __init__(self, n: int):
        self.n = max(1, n)
        self._pool = None

    def split(self, members: list[int], rows: list[int]) -> list[list[int]]:
        """`members` (in order, `rows` each) cut into at most n contiguous parts of about equal
        rows, each at least MIN_LANE_ROWS; one part where that is not worth it."""
        total = sum(rows)
        parts = min(self.n, len(members), total // MIN_LANE_ROWS)
        if parts < 2:
            return [members]
        out, cur, acc, k = [], [], 0, 1
        for m, r in zip(members, rows):
            if cur and acc >= total * k / parts and len(out) < parts - 1:
                out.append(cur)
                cur, k = [], k + 1
            cur.append(m)
            acc += r
        return [*out, cur]

    def map(self, fn, items: list) -> list:
        """[fn(item) for item in items], lane j taking items j, j+n, ... (lane 0 on this
        thread); returns once all have finished, raising the first failure."""
        if len(items) <= 1 or self.n == 1:
            return [fn(item) for item in items]
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.n - 1, thread_name_prefix="metrale-lane")
        lanes = [items[j::self.n] for j in range(min(self.n, len(items)))]
        futures = [self._pool.submit(_in_inference_mode, fn, mine) for mine in lanes[1:]]
        error, results = None, [None] * len(lanes)
        try:
            results[0] = [fn(item) for item in lanes[0]]
        except BaseException as e:  # noqa: BLE001 - raised once every lane has finished
            error = e
        for j, f in enumerate(futures, 1):
            try:
                results[j] = f.result()
            except BaseException as e:  # noqa: BLE001
                error = error or e
        if error is not None:
            raise error
        out = [None] * len(items)
        for j, mine in enumerate(results):
            out[j::self.n] = mine
        return out


def _in_inference_mode(fn, items):
    with torch.inference_mode():
        return [fn(item) for item in items]
