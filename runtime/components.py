"""The component registry: one entry per kind of engine-directory component.

An engine directory's manifest names each component's `kind` (`target`, `mtp`, `dflash`); this
table maps a kind to the facts of its model, and to the step shape the rest of the runtime
works with:

- `shape`: the steps it runs (`StepShape`): the target's rows, a chain of one-entry links fed
  by the target's hidden states (an MTP head), or a block proposed at once from the target's
  taps (a DFlash drafter). Its `role` (where a loaded engine holds it) follows from it.
- `parse`: its config from the checkpoint's `config.json` (and its manifest entry).
- `module`: its torch module class (a drafter's takes a `TensorParallel`).
- `decoder`: its decoder config (layers, KV heads, head dim: the shape of its caches).
- `checkpoint`: its Hugging Face checkpoint loader, `(folder, target lm_head)`: the weights
  mapping from the checkpoint's tensor names to the module's.
- `tensor_sets`: its named sets of linears (module names, matched in full) that the build's
  quantization tiers choose from (`builder.quantize`).

Everything else is keyed by the shape, in the layer it belongs to: the exported step graph's
interface (`graph_io`, here), the builder's export adapters (`builder.onnx_export.ADAPTERS`),
each backend's faces (`backend_registry`), the decode loop's proposers and `metrale bench`'s
modes (`spec.shapes`). So a drafter kind with an existing shape is its entry here, its module
and its checkpoint mapping; DFlash2 is the `dflash` kind at `version` 2 (its config adds the
dynamic convs and the candidate selector; its graph adds `selector_query`).
"""

from __future__ import annotations

import enum
import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable

from metrale.runtime.errors import CheckpointError, EngineDirError
from metrale.runtime.models.configs import MTP_NAMINGS, DecoderConfig, DFlashConfig, MTPConfig
from metrale.runtime.models.dflash import DFlashDrafter
from metrale.runtime.models.loader import load_dflash, load_mtp, load_target
from metrale.runtime.models.mtp import MTPHead
from metrale.runtime.models.qwen3 import Qwen3ForCausalLM


class Role(enum.Enum):
    TARGET = "target"  # LoadedEngine.target
    HEAD = "head"  # LoadedEngine.mtp
    DRAFTER = "drafter"  # LoadedEngine.drafters[name]


class StepShape(enum.Enum):
    """The steps a component runs, which every layer above keys its part by."""

    TARGET = "target"  # rows [pending, drafts...] of a sequence, with taps and hidden states
    CHAIN = "chain"  # one head entry per link, fed the target's hidden states (MTP)
    BLOCK = "block"  # a block of drafts at once from the target's taps (DFlash)

    @property
    def role(self) -> Role:
        return {StepShape.TARGET: Role.TARGET, StepShape.CHAIN: Role.HEAD,
                StepShape.BLOCK: Role.DRAFTER}[self]


@dataclass(frozen=True)
class GraphIO:
    """A component graph's interface: names in order and dynamic axes (name -> {axis: label})."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dynamic: dict

    def axis_labels(self) -> set[str]:
        return {label for axes in self.dynamic.values() for label in axes.values()}


@dataclass(frozen=True)
class ComponentKind:
    name: str
    shape: StepShape
    # (config.json, where, its manifest entry or None at build time) -> config
    parse: Callable[[dict, str, Any], Any]
    module: type
    decoder: Callable[[Any], DecoderConfig]
    # (checkpoint folder[, the target's lm_head for a head or drafter]) -> the filled module
    checkpoint: Callable
    tensor_sets: tuple[tuple[str, str], ...] = ()

    @property
    def role(self) -> Role:
        return self.shape.role

    def graph_io(self, cfg, taps: tuple[int, ...]) -> GraphIO:
        """Its exported step graph's interface for `cfg` and the target's taps."""
        return _GRAPH_IO[self.shape](cfg, taps)

    def tensor_set(self, name: str) -> re.Pattern:
        """Its set `name` of linears as a pattern over module names."""
        return re.compile(dict(self.tensor_sets)[name])

    def build(self, cfg, tp=None):
        """Its torch module for `cfg` (a drafter's with `tp`, its tensor-parallel rank)."""
        return self.module(cfg, tp) if self.role is Role.DRAFTER else self.module(cfg)


def resolve(ref: str):
    """"package.module:Class" -> the class (a table of classes in a layer that imports them
    only when used)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


# -- the kinds -------------------------------------------------------------------------------

_KV = {3: "past"}


def _target_io(cfg, taps: tuple[int, ...]) -> GraphIO:
    outs = ("logits", "new_key", "new_value") + (("taps",) if taps else ()) + ("last_hidden",)
    dyn = {"input_ids": {1: "tokens"}, "past_key": _KV, "past_value": _KV,
           "tree_mask": {0: "tokens", 1: "tokens"}, "logits": {1: "tokens"},
           "new_key": {3: "tokens"}, "new_value": {3: "tokens"}, "last_hidden": {1: "tokens"}}
    if taps:
        dyn["taps"] = {1: "tokens"}
    # `tree_mask` [T, T] bool: which new rows each new row sees (`step_caches.StepKV`)
    return GraphIO(("input_ids", "past_key", "past_value", "position", "tree_mask"), outs, dyn)


def _mtp_io(cfg, taps: tuple[int, ...]) -> GraphIO:
    dyn = {"embeds": {1: "tokens"}, "hidden": {1: "tokens"}, "past_key": _KV, "past_value": _KV,
           "logits": {1: "tokens"}, "hidden_out": {1: "tokens"}, "new_key": {3: "tokens"},
           "new_value": {3: "tokens"}}
    return GraphIO(("embeds", "hidden", "past_key", "past_value", "position"),
                   ("logits", "hidden_out", "new_key", "new_value"), dyn)


def _dflash_io(cfg: DFlashConfig, taps: tuple[int, ...]) -> GraphIO:
    v2 = cfg.version == 2
    outs = ("new_key", "new_value", "hidden", "logits") + (("selector_query",) if v2 else ())
    dyn = {"context_features": {1: "context"}, "past_key": _KV, "past_value": _KV,
           "block_embeds": {1: "block"}, "new_key": {3: "context"}, "new_value": {3: "context"},
           "hidden": {1: "block"}, "logits": {1: "block"}}
    if v2:
        dyn["selector_query"] = {1: "block"}
    return GraphIO(("context_features", "past_key", "past_value", "position", "block_embeds"), outs, dyn)


def _mtp_config(cfg: dict, where: str, info) -> MTPConfig:
    naming = info.naming if info is not None else None
    if naming is None:
        raise CheckpointError(f"{where}: the MTP head's manifest entry records no naming "
                              f"(one of {', '.join(MTP_NAMINGS)})")
    if naming not in MTP_NAMINGS:
        raise CheckpointError(f"{where}: the MTP head's naming {naming!r} is not one metrale reads "
                              f"(expected one of {', '.join(MTP_NAMINGS)})")
    return MTPConfig(decoder=DecoderConfig.from_hf(cfg, where), naming=naming)


_GRAPH_IO = {StepShape.TARGET: _target_io, StepShape.CHAIN: _mtp_io, StepShape.BLOCK: _dflash_io}


KINDS: dict[str, ComponentKind] = {k.name: k for k in (
    ComponentKind(
        "target", StepShape.TARGET, lambda cfg, where, info: DecoderConfig.from_hf(cfg, where),
        Qwen3ForCausalLM, lambda cfg: cfg, load_target),
    ComponentKind(
        "mtp", StepShape.CHAIN, _mtp_config, MTPHead, lambda cfg: cfg.decoder, load_mtp,
        (("experts", r"layer\.mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj"),
         ("fp8", r"fc|layer\.self_attn\.[qkvo]_proj"
                 r"|layer\.mlp\.((experts\.\d+|shared_expert)\.)?(gate|up|down)_proj"))),
    ComponentKind(
        "dflash", StepShape.BLOCK, lambda cfg, where, info: DFlashConfig.from_hf(cfg, where),
        DFlashDrafter, lambda cfg: cfg.decoder, load_dflash,
        (("core", r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)|lm_head"),
         ("aux", r"fc|context_kv_proj|layers\.\d+\.(attention_conv|mlp_conv)\.kernel_projection"
                 r"|candidate_selector\.hidden_projection"))),
)}


def kind_named(kind: str) -> ComponentKind:
    try:
        return KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown component kind {kind!r} (allowed: {', '.join(KINDS)})") from None


def kind_of(info, where: str) -> ComponentKind:
    """A manifest entry's (`artifact.entries.ComponentEntry`) kind, or an EngineDirError naming
    the component's place."""
    if info.kind not in KINDS:
        raise EngineDirError(f"{where} has kind {info.kind!r}; expected one of {', '.join(KINDS)}")
    return KINDS[info.kind]


def names_with_role(components: dict, role: Role) -> list[str]:
    """The names of a manifest's components (name -> entry) of `role`, in manifest order."""
    return [n for n, info in components.items() if info.kind in KINDS and KINDS[info.kind].role is role]
