"""The component registry: one entry per kind of engine-directory component.

An engine directory's manifest names each component's `kind` (`target`, `mtp`, `dflash`); this
table is the one place that maps a kind to everything about it:

- `role`: where a loaded engine holds it (the target; the MTP head the target's hidden states
  feed; a drafter the target's taps feed, any number by name) — what the decode loop sees.
- `parse`: its config from the checkpoint's `config.json` (and its manifest entry).
- `module`: its torch module ("package.module:Class"; a drafter's takes a `TensorParallel`).
- `decoder`: its decoder config (layers, KV heads, head dim: the shape of its caches).
- `graph_io`: its exported step graph's inputs, outputs and dynamic axes.
- `adapter`: the module the builder traces to ONNX (`builder.onnx_export`), with its
  `example_inputs`.
- `graph_face` / `aoti_face`: what runs it over an exported graph (`backends.graph_steps`, the
  onnxruntime and tensorrt backends) or over its AOTInductor packages (`backends.aoti`).
- `proposer`: the drafts it makes for the decode loop (`spec`), for roles that propose.
- `bench_modes`: the speculative modes `metrale bench` runs with it.
- `checkpoint`: its Hugging Face checkpoint loader (`models.loader`), `(folder, target lm_head)`.
- `tensor_sets`: its named sets of linears (module names, matched in full) that the build's
  quantization tiers choose from (`builder.quantize`).

Classes of the layers above the models are named by "module:Class" strings and imported when
first used (`resolve`), so this table depends on the models only and every layer reads it.
DFlash2 is the `dflash` kind at `version` 2 (its config adds the dynamic convs and the candidate
selector; its graph adds `selector_query`). Adding a drafter kind is one entry here plus its
module, its export adapter and its face: see DESIGN's "adding a drafter".
"""

from __future__ import annotations

import enum
import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable

from metrale.runtime.errors import CheckpointError, EngineDirError
from metrale.runtime.models.configs import MTP_NAMINGS, DecoderConfig, DFlashConfig, MTPConfig


class Role(enum.Enum):
    TARGET = "target"  # LoadedEngine.target
    HEAD = "head"  # LoadedEngine.mtp
    DRAFTER = "drafter"  # LoadedEngine.drafters[name]


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
    role: Role
    # (config.json, where, its manifest entry or None at build time) -> config
    parse: Callable[[dict, str, Any], Any]
    module: str
    decoder: Callable[[Any], DecoderConfig]
    graph_io: Callable[[Any, tuple[int, ...]], GraphIO]  # (config, target taps) -> GraphIO
    adapter: str
    graph_face: str
    aoti_face: str
    proposer: str | None
    # (name, config, measured cost model or None) -> its `metrale bench` modes
    bench_modes: Callable[[str, Any, Any], list[tuple[str, dict]]]
    checkpoint: str = ""
    tensor_sets: tuple[tuple[str, str], ...] = ()

    def tensor_set(self, name: str) -> re.Pattern:
        """Its set `name` of linears as a pattern over module names."""
        return re.compile(dict(self.tensor_sets)[name])

    def build(self, cfg, tp=None):
        """Its torch module for `cfg` (a drafter's with `tp`, its tensor-parallel rank)."""
        cls = resolve(self.module)
        return cls(cfg, tp) if self.role is Role.DRAFTER else cls(cfg)


def resolve(ref: str):
    """"package.module:Class" -> the class."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


# -- the kinds -------------------------------------------------------------------------------

_KV = {3: "past"}


def _target_io(cfg, taps: tuple[int, ...]) -> GraphIO:
    outs = ("logits", "new_key", "new_value") + (("taps",) if taps else ()) + ("last_hidden",)
    dyn = {"input_ids": {1: "tokens"}, "past_key": _KV, "past_value": _KV, "logits": {1: "tokens"},
           "new_key": {3: "tokens"}, "new_value": {3: "tokens"}, "last_hidden": {1: "tokens"}}
    if taps:
        dyn["taps"] = {1: "tokens"}
    return GraphIO(("input_ids", "past_key", "past_value", "position"), outs, dyn)


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


def _mtp_modes(name: str, cfg, cost) -> list[tuple[str, dict]]:
    base = {"speculative": True}
    modes = [(f"mtp k={k}", {**base, "num_drafts": k}) for k in (1, 2, 3)]
    modes.append(("mtp k=3 stop=0.6", {**base, "num_drafts": 3, "draft_confidence_stop": "0.6"}))
    modes.append(("mtp k=3 stop=cum:0.5", {**base, "num_drafts": 3, "draft_confidence_stop": "cum:0.5"}))
    modes.append(("mtp k=3 exact", {**base, "num_drafts": 3, "exact_verify": True}))
    return modes


def _dflash_modes(name: str, cfg: DFlashConfig, cost) -> list[tuple[str, dict]]:
    base = {"dflash": True, "dflash_drafter": name}
    g = cfg.block_size
    rungs = ",".join(str(r) for r in (1, 3, 7) if r <= g - 1)
    modes = [(f"{name} γ={g}", base), (f"{name} γ={g} exact", {**base, "exact_verify": True}),
             (f"{name} γ=4", {**base, "dflash_gamma": 4}),
             (f"{name} ladder {rungs}", {**base, "dflash_draft_ladder": rungs})]
    if cost is not None:  # its measured CostModel, with its acceptance
        modes.append((f"{name} adaptive-k", {**base, "dflash_adaptive_k": cost}))
    return modes


KINDS: dict[str, ComponentKind] = {k.name: k for k in (
    ComponentKind(
        "target", Role.TARGET, lambda cfg, where, info: DecoderConfig.from_hf(cfg, where),
        "metrale.runtime.models.qwen3:Qwen3ForCausalLM", lambda cfg: cfg, _target_io,
        "metrale.builder.onnx_export:TargetStep", "metrale.runtime.backends.graph_steps:GraphTarget",
        "metrale.runtime.backends.aoti_batched:BatchedTarget", None, lambda name, cfg, cost: [],
        "metrale.runtime.models.loader:load_target"),
    ComponentKind(
        "mtp", Role.HEAD, _mtp_config, "metrale.runtime.models.mtp:MTPHead",
        lambda cfg: cfg.decoder, _mtp_io, "metrale.builder.onnx_export:MTPStep",
        "metrale.runtime.backends.graph_steps:GraphMTP", "metrale.runtime.backends.aoti_batched:BatchedMTP",
        "metrale.runtime.spec.mtp_proposer:MTPProposer", _mtp_modes,
        "metrale.runtime.models.loader:load_mtp",
        (("experts", r"layer\.mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj"),
         ("fp8", r"fc|layer\.self_attn\.[qkvo]_proj"
                 r"|layer\.mlp\.((experts\.\d+|shared_expert)\.)?(gate|up|down)_proj"))),
    ComponentKind(
        "dflash", Role.DRAFTER, lambda cfg, where, info: DFlashConfig.from_hf(cfg, where),
        "metrale.runtime.models.dflash:DFlashDrafter", lambda cfg: cfg.decoder, _dflash_io,
        "metrale.builder.onnx_export:DFlashPropose", "metrale.runtime.backends.graph_steps:GraphDrafter",
        "metrale.runtime.backends.aoti_batched:BatchedDFlash", "metrale.runtime.spec.dflash_proposer:DFlashProposer",
        _dflash_modes, "metrale.runtime.models.loader:load_dflash",
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
