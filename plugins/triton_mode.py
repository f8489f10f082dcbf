"""Triton's mode, and loading the kernels in it (what the op launchers and the compiler share).

Triton fixes its mode when it is imported: with `TRITON_INTERPRET=1` in the environment at that
moment, every `@triton.jit` function (its own standard library included) becomes an interpreter
function that runs on CPU tensors; otherwise they are JIT functions that compile for a GPU. One
process therefore runs the kernels either in the interpreter or compiled, never both.
`load_kernels(device)` returns `triton_kernels` after checking that the mode fits the device and
says which environment variable to set when it does not.
"""

from __future__ import annotations

from types import ModuleType


def import_triton():
    """Import triton or raise an ImportError naming the package that provides it."""
    try:
        import triton
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the Triton faces of metrale.plugins need triton (pip install 'triton==3.9.0')"
        ) from exc
    return triton


def triton_interprets() -> bool:
    """Whether triton was imported in interpreter mode (its `tl.zeros` is an interpreter function)."""
    import_triton()
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.zeros, InterpretedFunction)


def load_kernels(device: str = "cuda") -> ModuleType:
    """The `triton_kernels` module, after checking triton's mode suits tensors on `device`."""
    interprets = triton_interprets()
    on_cpu = str(device).startswith("cpu")
    if on_cpu and not interprets:
        raise RuntimeError(
            "Triton kernels run on CPU tensors only in the interpreter: set TRITON_INTERPRET=1 in "
            "the environment before triton is first imported"
        )
    if not on_cpu and interprets:
        raise RuntimeError(
            f"triton was imported with TRITON_INTERPRET=1, which runs kernels on CPU tensors "
            f"only; unset it to launch on {device}"
        )
    from metrale.plugins import triton_kernels

    return triton_kernels


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b: the grid rule's `cdiv`."""
    return -(-a // b)
