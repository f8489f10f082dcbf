"""Importing TensorRT: the two flavours, chosen by `--trt-flavor`, and the TensorRT-RTX wheel fix.

Flavours (`TrtFlavor`):
- `rtx`: TensorRT for RTX (`import tensorrt_rtx`), installable from the package index. Its builder
  runs with no GPU and targets the compute capabilities in `trt.ComputeCapability`
  (SM75, SM80, SM86, SM89, SM120, SM121 in 1.7; no SM90/SM100).
- `tensorrt`: full TensorRT (`import tensorrt`): data-centre GPUs, needs a GPU to build, and builds
  for the GPU it runs on only.
- `auto`: `rtx` when installed, else `tensorrt` when installed and a GPU is visible, else `none`.
- `none`: no engines (the torch backend runs the safetensors).

The TensorRT-RTX wheel quirk: the ONNX parser dlopens `libtensorrt_rtx.so` when it meets a node
that maps to a plugin, but the libs wheel ships only `libtensorrt_rtx.so.1`; the failed dlopen
ends the process (`terminate called without an active exception`), no Python exception.
`ensure_rtx_soname_link` creates the missing `libtensorrt_rtx.so -> libtensorrt_rtx.so.1` symlink
in the `tensorrt_rtx_libs` package folder (idempotent) and is run before the first import, so a
parse can never reach the abort. A folder we cannot write to is an error that says what to run.

Invariant: nothing here imports TensorRT at module import time; `load_trt` does it on demand.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from metrale.runtime.errors import FlagChoice, MetraleError

log = logging.getLogger(__name__)

RTX_LIB = "libtensorrt_rtx.so"
RTX_LIB_VERSIONED = "libtensorrt_rtx.so.1"
RTX_INSTALL_HINT = "pip install tensorrt-rtx-cu13==1.7.1.116"


class TrtFlavor(FlagChoice):
    AUTO = "auto"
    RTX = "rtx"
    TENSORRT = "tensorrt"
    NONE = "none"

    @classmethod
    def flag(cls) -> str:
        return "--trt-flavor"


class TrtUnavailable(MetraleError):
    """The requested TensorRT flavour cannot be imported or cannot build here."""


@dataclass(frozen=True)
class TrtModule:
    """An imported TensorRT flavour: `trt` is the module (`tensorrt_rtx` or `tensorrt`)."""

    flavor: TrtFlavor  # RTX or TENSORRT, never AUTO/NONE
    trt: ModuleType

    @property
    def version(self) -> str:
        return str(self.trt.__version__)

    def supported_sms(self) -> tuple[int, ...]:
        """SMs this flavour can build for from here (RTX: any listed; full TensorRT: the local GPU)."""
        if self.flavor is TrtFlavor.RTX:
            return tuple(sorted(rtx_compute_capabilities(self.trt)))
        sm = local_gpu_sm()
        return (sm,) if sm is not None else ()


def rtx_compute_capabilities(trt: ModuleType) -> dict[int, object]:
    """SM number -> `trt.ComputeCapability` member (`SM89` -> 89); `CURRENT`-like members skipped."""
    out = {}
    for name, member in trt.ComputeCapability.__members__.items():
        if name.startswith("SM") and name[2:].isdigit():
            out[int(name[2:])] = member
    return out


def local_gpu_sm() -> int | None:
    """The first visible CUDA device's SM (89 for 8.9), or None without a GPU (torch decides)."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return major * 10 + minor


def rtx_libs_folder() -> Path | None:
    """The `tensorrt_rtx_libs` package folder (None when the libs wheel is not installed)."""
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def ensure_rtx_soname_link(folder: Path | None = None) -> Path | None:
    """Create `libtensorrt_rtx.so -> libtensorrt_rtx.so.1` in `folder` (default: the libs
    package folder) if missing. Returns the link's path, or None when there is nothing to link
    (no libs package, or no `.so.1` in it). The link is relative, so it survives moving the
    environment.
    """
    folder = folder if folder is not None else rtx_libs_folder()
    if folder is None:
        return None
    link, versioned = folder / RTX_LIB, folder / RTX_LIB_VERSIONED
    if not versioned.exists():
        # Another packaging (a system install) that names its library differently: leave it.
        log.debug("%s not in %s; not adding the soname link", RTX_LIB_VERSIONED, folder)
        return None
    if link.exists():
        return link
    if link.is_symlink():  # dangling: replace it
        link.unlink()
    try:
        os.symlink(RTX_LIB_VERSIONED, link)
    except FileExistsError:  # created concurrently by another build
        pass
    except OSError as exc:
        raise TrtUnavailable(
            f"TensorRT-RTX: {link} is missing and cannot be created ({exc}); without it parsing a "
            f"plugin node aborts the process. Create it once with: ln -s {RTX_LIB_VERSIONED} {link}"
        ) from None
    log.info("created %s -> %s (TensorRT-RTX wheel fix)", link, RTX_LIB_VERSIONED)
    return link


def _import_rtx() -> TrtModule | None:
    if importlib.util.find_spec("tensorrt_rtx") is None:
        return None
    ensure_rtx_soname_link()
    return TrtModule(TrtFlavor.RTX, importlib.import_module("tensorrt_rtx"))


def _import_tensorrt() -> TrtModule | None:
    if importlib.util.find_spec("tensorrt") is None:
        return None
    try:
        return TrtModule(TrtFlavor.TENSORRT, importlib.import_module("tensorrt"))
    except (ImportError, OSError) as exc:  # a stub wheel whose libs never downloaded
        log.warning("tensorrt is installed but does not import: %s", exc)
        return None


def load_trt(flavor: TrtFlavor | str) -> TrtModule | None:
    """Import the flavour asked for; None for `none` (and for `auto` with nothing usable).

    An explicit `rtx`/`tensorrt` that cannot be imported (or, for full TensorRT, has no GPU to
    build on) raises `TrtUnavailable` naming the flag and the package to install.
    """
    flavor = TrtFlavor.parse(flavor) if isinstance(flavor, str) else flavor
    if flavor is TrtFlavor.NONE:
        return None
    if flavor in (TrtFlavor.RTX, TrtFlavor.AUTO):
        mod = _import_rtx()
        if mod is not None:
            return mod
        if flavor is TrtFlavor.RTX:
            raise TrtUnavailable(f"--trt-flavor rtx: tensorrt_rtx is not installed ({RTX_INSTALL_HINT})")
    mod = _import_tensorrt()
    has_gpu = local_gpu_sm() is not None
    if flavor is TrtFlavor.TENSORRT:
        if mod is None:
            raise TrtUnavailable("--trt-flavor tensorrt: the tensorrt package is not installed "
                                 "(it needs NVIDIA's index and a GPU); use --trt-flavor rtx to "
                                 "build without a GPU")
        if not has_gpu:
            raise TrtUnavailable("--trt-flavor tensorrt: full TensorRT builds only on a GPU and "
                                 "none is visible; use --trt-flavor rtx to build without a GPU")
        return mod
    return mod if (mod is not None and has_gpu) else None
