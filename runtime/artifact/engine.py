"""Load an engine directory into the torch backend's models.

The engine directory (see `engine_dir`) holds, per component, the HF `config.json` it was built
from and `rank{r}.safetensors` in module naming, quantized linears in ModelOpt's export names
(`weight` + `weight_scale` [+ `weight_scale_2`]). Loading verifies every checksum first, then
fills each model strictly: quantized linears become `qlinear` modules that run the plugins'
reference ops (dequantize exactly as the kernels do), every other tensor fills its parameter.

Components: `target` (always), `mtp` (optional), and drafters (any other name, kind `dflash`).
The drafters and the head embed with the target's embedding; they hold their own draft LM head.

A drafter built with `--draft-tp-size N` has N rank files (its manifest entry's `tp_size`).
Loaded with a `TensorParallel` of N ranks, each rank reads its own file; loaded without one,
the rank files are merged back into the whole drafter (their bytes are the one-rank bytes).
The target and the MTP head are single-rank (rank0 files) and every rank loads them whole.
"""

from __future__ import annotations

import contextlib
import logging

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from metrale.plugins import formats
from metrale.runtime.backend_registry import BACKENDS, BackendEntry
from metrale.runtime.components import KINDS, Role
from metrale.runtime.models.configs import DFlashConfig
from metrale.runtime.models.dflash import DFlashDrafter
from metrale.runtime.artifact.engine_check import REBUILD, check_files, component_config, read_json
from metrale.runtime.artifact.engine_dir import Manifest
from metrale.runtime.artifact.entries import ComponentEntry
from metrale.runtime.errors import CheckpointError, EngineDirError
from metrale.runtime.models.layers import Attention, MoE, pack_for_inference
from metrale.runtime.models.loader import check_counts, strict_fill
from metrale.runtime.models.row_probe import PROBE_MOST, probe_rows, rows_invariant as probe_invariant
from metrale.runtime.artifact.tokenizer import Tokenizer
from metrale.runtime.models.tp import (TensorParallel, check_drafter_split, cut_tensor, drafter_cut,
                                merge_drafter_state)

log = logging.getLogger(__name__)


def quantized_prefixes(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale"))


def fill_engine_state(module: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> nn.Module:
    """Swap quantized linears in, then fill every parameter strictly (names and shapes)."""
    from metrale.runtime.models import qlinear

    device = next(module.parameters()).device

    def linear_from_tensors(prefix, tensors):
        return qlinear.linear_from_tensors(prefix, tensors).to(device)

    if "context_kv_proj.weight" in tensors and isinstance(module, DFlashDrafter):
        module.context_kv_proj = linear_from_tensors("context_kv_proj", tensors)  # engine-only
    for prefix in quantized_prefixes(tensors):
        try:
            module.get_submodule(prefix)
        except AttributeError:
            raise EngineDirError(f"{source}: unexpected quantized tensor {prefix}.weight_scale") from None
        module.set_submodule(prefix, linear_from_tensors(prefix, tensors))
    strict_fill(module, tensors, source)
    return module.eval()




def check_formats(tensors: dict[str, torch.Tensor], info: ComponentEntry, source: str) -> None:
    """A component's stored linears against its manifest entry's quantization section: the
    quantized ones are exactly its `quantized_modules`, each in its `quant_algo`'s format (so a
    directory whose weights and manifest disagree is refused, never run at another tier). An
    entry without a section (the target) is not checked."""
    from metrale.runtime.models import qlinear

    section = info.quant_algo
    if section is None:
        return
    algo = section.quant_algo
    try:
        fmt = formats.format_of_algo(algo)
    except StopIteration:
        known = ", ".join(f.quant_algo for f in formats.FORMATS.values())
        raise EngineDirError(f"{source}: the manifest's quant_algo {algo!r} is not one metrale runs "
                             f"(expected {known} or null); {REBUILD}") from None
    want = sorted(section.quantized_modules)
    have = quantized_prefixes(tensors)
    if have != want:
        extra, missing = sorted(set(have) - set(want)), sorted(set(want) - set(have))
        raise EngineDirError(f"{source}: its quantized linears do not match the manifest's "
                             f"quantization section (stored but not listed: {extra or 'none'}; "
                             f"listed but not stored: {missing or 'none'}); {REBUILD}")
    kind = fmt.name if fmt is not None else None
    for prefix in have:
        got = qlinear.quantized_kind(tensors, prefix)
        if got != kind:
            raise EngineDirError(f"{source}: {prefix} is stored as {got}, but the manifest's "
                                 f"quant_algo is {algo}; {REBUILD}")
    extra_keys = dict(section.model_extra or {})
    if fmt is not None and extra_keys != dict(fmt.section):
        raise EngineDirError(f"{source}: the manifest's quantization section records "
                             f"{extra_keys or 'nothing'} besides the algorithm; {algo} records "
                             f"{dict(fmt.section)}; {REBUILD}")


def _meta_tensors(path: str) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors as meta tensors: names, shapes, dtypes; no data read."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        out = {}
        for name in handle.keys():
            part = handle.get_slice(name)
            out[name] = torch.empty(part.get_shape(), dtype=_DTYPES[part.get_dtype()], device="meta")
        return out


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
           "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _component_files(engine_dir: Path, name: str, rank: int = 0, meta: bool = False):
    rel = f"{name}/rank{rank}.safetensors"
    cfg = read_json(engine_dir / name / "config.json", str(engine_dir), f"{name}/config.json")
    try:
        tensors = _meta_tensors(str(engine_dir / rel)) if meta else load_file(str(engine_dir / rel))
    except Exception as exc:  # SafetensorError, OSError, a dtype torch lacks: not usable
        raise EngineDirError(f"engine directory {engine_dir}: {rel} cannot be read ({exc})") from None
    return cfg, tensors, f"engine directory {engine_dir}: {rel}"


@dataclass
class LoadedEngine:
    """One engine directory loaded for one rank: each component's face (its torch module, or
    what its backend runs it with: `backends.TargetSteps`, `MTPSteps`, `DrafterSteps`)."""

    path: Path
    manifest: Manifest
    tokenizer: Tokenizer
    target: object  # backends.TargetSteps
    mtp: object | None = None  # backends.MTPSteps
    drafters: dict[str, object] = field(default_factory=dict)  # name -> backends.DrafterSteps
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    packed: bool = False
    eager_invariant: bool | None = None  # measured by `pack` (`eager_rows_invariant`)
    backend: BackendEntry = BACKENDS["torch"]  # what runs its steps (`backend_registry`)
    backend_note: str = ""  # why auto runs eager torch where it would have run something else
    requantized: dict[str, str] = field(default_factory=dict)  # component -> its weights' source

    @property
    def model_id(self) -> str:
        return self.path.name

    def place(self, name: str, role, model) -> None:
        """Hold `model` as component `name` of `role` (`components.Role`): the MTP head or a
        drafter (the target is the engine's first argument)."""
        if role is Role.HEAD:
            self.mtp = model
        elif role is Role.DRAFTER:
            self.drafters[name] = model
        else:
            raise ValueError(f"component {name}: a loaded engine holds one target")

    def component(self, name: str):
        """The model (or face) of component `name` of the manifest, None when not loaded."""
        info = self.manifest.components.get(name)
        role = KINDS[info.kind].role if info is not None else None
        return {Role.TARGET: self.target, Role.HEAD: self.mtp}.get(role, self.drafters.get(name))

    def models(self) -> dict[str, nn.Module]:
        target = getattr(self.target, "model_ref", self.target)  # the eager model behind packages
        return {"target": target, **({"mtp": self.mtp} if self.mtp is not None else {}),
                **self.drafters}

    def pack(self) -> "LoadedEngine":
        """Ready the models for the decode loop, once: quantized weights dequantized (bit-identical
        results, see `qlinear`), target q/k/v and gate/up fused, routed experts stacked; where
        the eager target's rows can be made batch-invariant (`rows_invariant`), its attention
        runs over whole caches."""
        if not self.packed:
            for model in self.models().values():
                if isinstance(model, nn.Module):  # engine-backed faces hold their own weights
                    pack_for_inference(model)
            if self.backend.eager and self.dtype == torch.bfloat16 and self.device.type == "cpu":
                # every row count a verify, a tree or a catch-up runs, a drafter's whole block too
                most = max([PROBE_MOST, *(d.config.block_size for d in self.drafters.values())])
                self._row_invariant_modules(True)
                try:
                    self.eager_invariant = probe_invariant(self.target, probe_rows(most))
                finally:  # (off again where the probe failed or raised)
                    self._row_invariant_modules(self.eager_invariant is True)
                if not self.eager_invariant:
                    log.warning("%s: in bfloat16 on this CPU (torch %s) a forward of several rows "
                                "does not give each row its one-row step's bits, so chunkwise "
                                "verify is not plain decoding's bits here (--exact-verify is)",
                                self.path.name, torch.__version__)
            self.packed = True
        return self

    def withdraw_rows_invariance(self, why: str) -> None:
        """Take back `pack`'s measured claim (`eager_rows_invariant`), and the whole-cache
        attention and dense experts that went with it, for the reason `why` gives."""
        if self.eager_invariant:
            self.eager_invariant = False
            self._row_invariant_modules(False)
            log.warning("%s: chunkwise verify is not taken as plain decoding's bits here "
                        "(--exact-verify is): %s", self.path.name, why)

    def _row_invariant_modules(self, on: bool) -> None:
        for module in self.target.modules():
            if isinstance(module, (Attention, MoE)):
                module.row_invariant = on

    @property
    def eager_rows_invariant(self) -> bool:
        """Does every row of the eager target's verify forward equal the one-row step at its
        position, bit for bit? Where torch's GEMMs give each row the bits a one-row GEMM gives it
        and attention runs over whole caches: measured by `pack` (`row_probe`), and only asked
        of bfloat16 on a CPU (in float32 MKL picks other kernels below four rows); False
        before `pack`."""
        return self.eager_invariant is True

    def block_distributions(self, drafter: str) -> bool:
        """Does drafter `drafter`'s face give its blocks' distributions (what a draft tree is
        built from)? Every face but those built before draft trees (`distributions`): a CPU
        package that gives drafts only, rank graphs that gather no normalizer."""
        return getattr(self.drafters[drafter], "distributions", True) is True

    def no_distributions(self, drafter: str) -> str:
        """Why drafter `drafter` gives no blocks' distributions, in words naming the drafter and
        the directory (what a refused `--dflash-tree-budget` quotes)."""
        what = getattr(self.drafters[drafter], "without_distributions", "face gives drafts only")
        return f"drafter {drafter!r}'s {what}, engine directory {self.path}"

    @property
    def tree_attention(self) -> bool:
        """Does its target run a draft tree's rows in one forward (`Forward.tree`)? Its backend's
        (`BackendEntry.tree_attention`), or its target face's: a CPU package built with tree rows
        (`aoti_batched.BatchedTarget.tree_rows`), an exported target graph with a `tree_mask`
        input whose profile takes the largest tree's rows (`graph_steps.GraphTarget.tree_rows`),
        the CUDA-graph target. Elsewhere trees are verified along their paths."""
        return self.backend.tree_attention or getattr(self.target, "tree_rows", False) is True

    @property
    def rows_invariant(self) -> bool:
        """Does chunkwise verify emit plain greedy decoding's tokens (rows batch-invariant)?"""
        return self.backend.row_invariant or (self.backend.eager and self.eager_rows_invariant)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes held per model: parameters and every buffer, packed copies included."""
        out = {}
        for name, model in self.models().items():
            if not isinstance(model, nn.Module):
                continue
            seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*model.parameters(), *model.buffers())}  # views counted once
            out[name] = sum(seen.values())
        return out


def _drafter_tensors(path: Path, name: str, info: ComponentEntry, cfg: DFlashConfig,
                     tp: TensorParallel | None, meta: bool = False, given=None):
    """The drafter's tensors for this process: its rank's file, all rank files merged, or its
    shard cut at load from the one-rank state (a one-rank build, or `given`: the state
    requantized at load, with its source)."""
    built = info.tp_size
    if given is None and (tp is None or built != tp.size):
        if built == 1:
            given = _component_files(path, name, 0, meta)[1:]
        elif tp is None:
            shards = [_component_files(path, name, r, meta)[1] for r in range(built)]
            given = (merge_drafter_state(shards, cfg), f"engine directory {path}: {name}/rank*.safetensors")
        else:
            raise EngineDirError(
                f"engine directory {path}: drafter {name} was built with --draft-tp-size {built}, "
                f"so it runs on 1 or {built} ranks, not {tp.size}; rebuild with --draft-tp-size 1 "
                f"(any rank count, cut at load) or {tp.size}")
    if given is None:
        return _component_files(path, name, tp.rank, meta)[1:]
    tensors, source = given
    if tp is None or tp.size == 1:
        return tensors, source
    check_drafter_split(cfg, tp.size)
    cut = {n: cut_tensor(n, t, drafter_cut(n, cfg), tp.rank, tp.size) for n, t in tensors.items()}
    return cut, f"{source}, rank {tp.rank} of {tp.size} cut at load"


def check_engine_dir(engine_dir: str | Path, verify: bool = True) -> Manifest:
    """`engine_check.check_files`, then loading itself as a dry run on the meta device
    (tokenizer, every model built and filled by name, shape and dtype from the files' headers,
    no weights read): what `metrale inspect` and `load_engine` both run."""
    root, shown = Path(engine_dir), str(engine_dir)
    manifest = check_files(root, verify=verify)
    try:
        build_models(root, manifest, torch.float32, torch.device("meta"))
    except CheckpointError as exc:
        text = str(exc)
        where = "" if text.startswith("engine directory") else f"engine directory {shown}: "
        raise EngineDirError(f"{where}{text}; {REBUILD}") from None
    return manifest


def load_models(engine_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", components: tuple[str, ...] | None = None,
                tp: TensorParallel | None = None,
                states: dict[str, tuple[dict, str]] | None = None) -> LoadedEngine:
    """Verify and load the torch models. `components` limits which optional parts are loaded
    (target always); `tp` makes every drafter this rank's tensor-parallel shard. `states`: a
    component's one-rank weights to use instead of its files, with their source (weights
    requantized at load to another tier, see `builder.requantize`). What runs them is
    `backends.load_engine`'s choice."""
    path = Path(engine_dir)
    manifest = check_engine_dir(path)
    return build_models(path, manifest, dtype, torch.device(device), components, tp, states)


def build_models(path: Path, manifest: Manifest, dtype: torch.dtype, device: torch.device,
                 components: tuple[str, ...] | None = None, tp: TensorParallel | None = None,
                 states: dict[str, tuple[dict, str]] | None = None) -> LoadedEngine:
    """Every component's model filled from its rank files. On the meta device only the files'
    headers are read: a dry run of loading (names, shapes, dtypes) that builds no weights."""
    meta = device.type == "meta"
    states = states or {}
    tokenizer = Tokenizer.from_dir(path / "tokenizer")
    engine = None
    # the target first: the engine holds the others
    for name, info in sorted(manifest.components.items(), key=lambda item: item[0] != "target"):
        kind = KINDS[info.kind]  # known: check_files refused any other
        if name != "target" and components is not None and name not in components:
            continue
        cfg = component_config(path, str(path), name, info)
        if kind.role is Role.DRAFTER:  # its rank's shard, or the whole drafter
            tensors, source = _drafter_tensors(path, name, info, cfg, tp, meta, states.get(name))
        else:
            tensors, source = states.get(name) or _component_files(path, name, 0, meta)[1:]
        if name not in states:  # weights requantized at load follow their own tier
            check_formats(tensors, info, source)
        check_counts(cfg if kind.role is Role.TARGET else cfg.decoder, tensors, source,
                     layered=kind.role is not Role.HEAD, routed=kind.role is not Role.DRAFTER)
        with torch.device("meta") if meta else contextlib.nullcontext():
            module = kind.build(cfg, tp).to(dtype=dtype, device=device)
        module = fill_engine_state(module, tensors, source)
        if kind.role is Role.TARGET:
            engine = LoadedEngine(path, manifest, tokenizer, module, dtype=dtype, device=device,
                                  requantized={n: source for n, (_, source) in states.items()})
        else:
            engine.place(name, kind.role, module)
    return engine
