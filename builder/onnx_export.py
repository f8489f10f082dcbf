"""ONNX export of every engine component (one rank), and its lowering for a target SM.

Each component's graph is its runtime forward, traced: the target's and the MTP head's `forward`
run over a `step_caches.StepKV` (the step's explicit past K/V, masked from `position` on, with the new
K/V returned instead of written back), the drafter's `context_kv` and `_blocks` (what its
`add_context` and `propose` run) over the past plus the new context. The adapters below only map
graph inputs to those calls and their results to graph outputs, so the graph has dynamic sequence
and past lengths and no second implementation of a forward. Graph I/O (all float tensors in the model's dtype, ids/positions int64):

- target step: `input_ids` [1, T], `past_key`/`past_value` [L, 1, nkv, P, hd], `position` [1],
  `tree_mask` [T, T] bool (new row i sees new row j: the causal mask for a chain, a draft tree's
  ancestors for its rows, each then at `position` + its depth) -> `logits` [1, T, V], `new_key`/`new_value` [L, 1, nkv, T, hd], `taps` [1, T, n·H] (the
  hidden states of the tapped layer ids as transformers numbers them — the last layer's after the
  final norm — concatenated in order; only with taps),
  `last_hidden` [1, T, H].
- MTP step: `embeds`, `hidden` [1, T, H], `past_key`/`past_value` [1, 1, nkv, P, hd], `position` ->
  `logits`, `hidden_out` [1, T, H] (pre-norm, fed back in a chain), `new_key`/`new_value`.
- DFlash propose: `context_features` [1, C, n·Ht] (taps of the C newly accepted positions),
  `past_key`/`past_value` [L, 1, nkv, P, hd] (context K/V so far), `position` [1], `block_embeds`
  [1, G, H] -> `new_key`/`new_value` [L, 1, nkv, C, hd] (the new context's K/V), `hidden` [1, G, H]
  (normed), `logits` [1, G, V], and for DFlash2 `selector_query` [1, G, D] (=
  hidden_projection(hidden); the runtime adds the predecessor codebook and scores candidates).

`position` is the absolute position of the first new token (context feature for the drafter) and
the number of valid past entries: past slots at or after it are masked out, so a preallocated
cache can be passed whole. Only the new K/V come out; the caller writes them at `position`.
TensorRT profiles need P ≥ 1: a first step passes one dummy past slot with position 0.

Quantized linears (`qlinear.Fp8Linear`, `Nvfp4Linear`) export as `metrale`-domain nodes (opset
`metrale` 1): `Fp8W8A16Gemm(x, w FLOAT8E4M3FN [N, K], scale f32 [N])` and
`NvFp4W4A16Gemm(x, packed uint8 [N, K/2], block_scale FLOAT8E4M3FN [N, K/16], global_scale f32 [])`.
That portable graph is what the engine directory stores; `plugins.onnx_lowering` rewrites it for
the runtime executing it (`lower_for_sm`: one SM's TensorRT engine; `lower_for_onnxruntime`: the
onnxruntime backend).

MoE layers trace densely (`layers.MoE` under tracing): every expert on every token, weighted by
the router's top-k weights scattered into [N, E] (the per-token sum plus exact zeros); a MoE of
NVFP4 experts exports as one `NvFp4MoeW4A16(x, expert_ids, weights, <stacked experts>)` node
(`plugins.nvfp4_moe`) instead. DFlash2's dynamic convs export as `DFlash2DynamicConv(x, kernel)`
nodes (attribute `block`).
"""

from __future__ import annotations

import contextlib
import io

import onnx
import torch
from torch import nn

from metrale.plugins.formats import FORMATS
from metrale.plugins.onnx_lowering import CONV_OP, DOMAIN, FP8_OP, MOE_OP, NVFP4_OP, lower_for_sm
from metrale.runtime.components import GraphIO, StepShape, kind_named
from metrale.runtime.models import qlinear
from metrale.runtime.models.dflash import DFlashDrafter, DynamicConv
from metrale.runtime.models.layers import MoE
from metrale.runtime.models.packing import stack_nvfp4_experts
from metrale.runtime.models.step_caches import StepKV
from metrale.runtime.models.mtp import MTPHead
from metrale.runtime.models.qwen3 import Qwen3ForCausalLM

DOMAIN_VERSION = 1
EXPORT_OPSET = 20  # the legacy exporter's ceiling; FP8 DequantizeLinear needs 19


# -- quantized linears as metrale nodes ------------------------------------------------------


def _typed_like(out, x, n: int):
    """Give a custom node's output x's element type and shape [..., n] (ONNX cannot infer it)."""
    from torch.onnx import symbolic_helper

    sizes = symbolic_helper._get_tensor_sizes(x)
    out.setType(x.type() if sizes is None else x.type().with_sizes(list(sizes[:-1]) + [n]))
    return out


class _Fp8Gemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, scale):  # x [..., K], w fp8 [N, K], scale f32 [N] -> [..., N]
        return torch.ops.metrale.fp8_w8a16_gemm(x, w, scale)

    @staticmethod
    def symbolic(g, x, w, scale):
        n = w.type().sizes()[0]
        return _typed_like(g.op(f"{DOMAIN}::{FP8_OP}", x, w, scale), x, n)


class _Nvfp4Gemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, block_scale, global_scale):  # -> [..., N]
        return torch.ops.metrale.nvfp4_w4a16_gemm(x, packed, block_scale, global_scale)

    @staticmethod
    def symbolic(g, x, packed, block_scale, global_scale):
        n = packed.type().sizes()[0]
        return _typed_like(g.op(f"{DOMAIN}::{NVFP4_OP}", x, packed, block_scale, global_scale), x, n)


def _dynamic_conv_symbolic(g, x, kernel, block):
    """`metrale::dflash2_dynamic_conv` (what `dflash.DynamicConv` calls) as its node."""
    from torch.onnx import symbolic_helper

    block = symbolic_helper._get_const(block, "i", "block")
    out = g.op(f"{DOMAIN}::{CONV_OP}", x, kernel, block_i=block)
    out.setType(x.type())
    return out


def _moe_symbolic(g, x, expert_ids, weights, *experts):
    """`metrale::nvfp4_moe_w4a16` (what `layers.MoE` runs NVFP4 experts through) as its node."""
    out = g.op(f"{DOMAIN}::{MOE_OP}", x, expert_ids, weights, *experts)
    out.setType(x.type())
    return out


# Custom ops the runtime's forwards call themselves, and the symbolic that exports each as its
# metrale node (the TorchScript tracer records a torch.library op under its qualified name).
_OP_SYMBOLICS = {"metrale::dflash2_dynamic_conv": _dynamic_conv_symbolic,
                 "metrale::nvfp4_moe_w4a16": _moe_symbolic}


def _register_op_symbolics() -> None:
    for name, fn in _OP_SYMBOLICS.items():
        torch.onnx.register_custom_op_symbolic(name, fn, DOMAIN_VERSION)


_GEMMS = {FP8_OP: _Fp8Gemm, NVFP4_OP: _Nvfp4Gemm}  # ONNX node -> what traces as it
assert {f.onnx_op for f in FORMATS.values()} <= set(_GEMMS)  # every format of the table exports


class _ExportLinear(nn.Module):
    """Stands in for a quantized linear while tracing; shares its tensors (no copies)."""

    def __init__(self, inner: qlinear._StoredLinear):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        m = self.inner
        fmt = FORMATS.get(m.kind)
        gemm = _GEMMS.get(fmt.onnx_op) if fmt is not None else None  # its node, fed its stored tensors
        if gemm is None:
            raise ValueError(f"a {m.kind!r} linear has no metrale ONNX node; the export knows "
                             f"{', '.join(f.name for f in FORMATS.values() if f.onnx_op in _GEMMS)}")
        return m._add_bias(gemm.apply(x, *(getattr(m, name) for name in m._FORMAT_BUFFERS)))


class _ExportGroupedMoE(nn.Module):
    """Stands in for a MoE of NVFP4 experts while tracing: its stacked expert tensors are this
    module's buffers (graph initializers), and the MoE's own forward runs them through the
    grouped op, which exports as one `NvFp4MoeW4A16` node."""

    def __init__(self, inner: MoE, stacked: tuple[torch.Tensor, ...]):
        super().__init__()
        self.inner = inner
        self.names = [f"experts_{i}" for i in range(len(stacked))]
        for name, t in zip(self.names, stacked):
            self.register_buffer(name, t)

    def forward(self, x):
        return self.inner(x, nvfp4_experts=tuple(getattr(self, n) for n in self.names))


@contextlib.contextmanager
def _metrale_nodes(root: nn.Module):
    """Swap every quantized linear under `root` for its exporting stand-in, and every MoE of
    NVFP4 experts for its grouped one; restore on exit."""
    grouped = [(name, mod, stack_nvfp4_experts(mod.experts)) for name, mod in root.named_modules()
               if isinstance(mod, MoE)]
    grouped = [(name, mod, stacked) for name, mod, stacked in grouped if stacked is not None]
    for name, mod, stacked in grouped:
        root.set_submodule(name, _ExportGroupedMoE(mod, stacked))
    try:
        with _linear_nodes(root):
            yield
    finally:
        for name, mod, _ in grouped:
            root.set_submodule(name, mod)


@contextlib.contextmanager
def _linear_nodes(root: nn.Module):
    """Swap every quantized linear under `root` for its exporting stand-in; restore on exit."""
    swapped = [(name, mod) for name, mod in root.named_modules() if _quantized(mod)]
    for name, mod in swapped:
        root.set_submodule(name, _ExportLinear(mod))
    try:
        yield
    finally:
        for name, mod in swapped:
            root.set_submodule(name, mod)


def _quantized(mod: nn.Module) -> bool:
    return isinstance(mod, (qlinear.Fp8Linear, qlinear.Nvfp4Linear))


# -- shared step pieces --------------------------------------------------------------------


def _past_mask(past_len: int, position: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, P] bool: past slot j is valid iff j < position."""
    return (torch.arange(past_len, device=position.device)[None, :] < position).expand(rows, past_len)


# -- adapters ------------------------------------------------------------------------------


class TargetStep(nn.Module):
    """The target's forward over a `StepKV`: the graph the torch backend's own forward traces to."""

    def __init__(self, model: Qwen3ForCausalLM, taps: tuple[int, ...] = ()):
        super().__init__()
        self.model, self.taps = model, tuple(taps)

    @staticmethod
    def example_inputs(model, rand, gen, t, past, pos, context):
        cfg = model.config
        kv = _kv_shape(cfg.num_hidden_layers, cfg, past)
        ids = torch.randint(0, cfg.vocab_size, (1, t), generator=gen)
        return ids, rand(*kv), rand(*kv), pos, torch.ones(t, t, dtype=torch.bool).tril()

    def forward(self, input_ids, past_key, past_value, position, tree_mask):
        cache = StepKV(past_key, past_value, position, tree_mask)
        out = self.model(input_ids, cache, start=position, taps=self.taps)
        outs = [out.logits, *cache.new_kv()]
        if self.taps:
            outs.append(out.taps)
        return (*outs, out.last_hidden)


class MTPStep(nn.Module):
    """The MTP head's forward over a `StepKV`."""

    def __init__(self, head: MTPHead, taps: tuple[int, ...] = ()):
        super().__init__()
        self.head = head

    @staticmethod
    def example_inputs(head, rand, gen, t, past, pos, context):
        cfg = head.config.decoder
        kv = _kv_shape(1, cfg, past)
        return rand(1, t, cfg.hidden_size), rand(1, t, cfg.hidden_size), rand(*kv), rand(*kv), pos

    def forward(self, embeds, hidden, past_key, past_value, position):
        cache = StepKV(past_key, past_value, position)
        logits, h = self.head(embeds, hidden, cache, start=position)
        return (logits, h, *cache.new_kv())


class DFlashPropose(nn.Module):
    def __init__(self, drafter: DFlashDrafter, taps: tuple[int, ...] = ()):
        super().__init__()
        self.drafter = drafter

    @staticmethod
    def example_inputs(drafter, rand, gen, t, past, pos, context):
        dc, cfg = drafter.config, drafter.config.decoder
        kv = _kv_shape(cfg.num_hidden_layers, cfg, past)
        feats = rand(1, context, dc.num_context_features * dc.target_hidden_size)
        return feats, rand(*kv), rand(*kv), pos, rand(1, dc.block_size, cfg.hidden_size)

    def forward(self, context_features, past_key, past_value, position, block_embeds):
        d = self.drafter
        c, g, p = context_features.shape[1], block_embeds.shape[1], past_key.shape[3]
        dev = block_embeds.device
        kv = d.context_kv(context_features, position + torch.arange(c, device=dev))
        block_pos = position + c + torch.arange(g, device=dev)  # [G]
        rows = torch.arange(g, device=dev)[:, None]
        cols = torch.arange(c + g, device=dev)[None, :]
        visible = (rows >= 0) & (cols >= 0)  # [G, C+G]: new context and the whole block
        mask = torch.cat([_past_mask(p, position, g), visible], dim=1)  # [G, P+C+G]
        # the drafter's own block forward (`_blocks`, what `propose` runs) over past + new context
        context = [(torch.cat([past_key[i], k], 2), torch.cat([past_value[i], v], 2))
                   for i, (k, v) in enumerate(kv)]
        hidden = d._blocks(block_embeds, block_pos, context, mask, g)
        outs = [torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv]), hidden,
                d.lm_head(hidden)]
        if d.config.version == 2:
            outs.append(d.candidate_selector.hidden_projection(hidden))
        return tuple(outs)


# The module the export traces for each step shape (`components.StepShape`).
ADAPTERS = {StepShape.TARGET: TargetStep, StepShape.CHAIN: MTPStep, StepShape.BLOCK: DFlashPropose}


# -- export --------------------------------------------------------------------------------


def _kv_shape(layers: int, cfg, past: int):
    return (layers, 1, cfg.num_key_value_heads, past, cfg.head_dim)


def example_inputs(kind: str, module: nn.Module, *, t: int = 3, past: int = 4, position: int = 2,
                   context: int = 2, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Inputs for one step of a component (also what tracing sees): random, seeded."""
    gen = torch.Generator().manual_seed(seed)
    dtype = next(module.parameters()).dtype
    pos = torch.tensor([position], dtype=torch.int64)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return ADAPTERS[kind_named(kind).shape].example_inputs(module, rand, gen, t, past, pos, context)


def graph_io(kind: str, module: nn.Module, taps: tuple[int, ...] = ()) -> GraphIO:
    return kind_named(kind).graph_io(module.config, taps)


def adapter(kind: str, module: nn.Module, taps: tuple[int, ...] = ()) -> nn.Module:
    """The step module of a component of `kind` that the export traces."""
    return ADAPTERS[kind_named(kind).shape](module, taps)


def export_component(kind: str, module: nn.Module, *, taps: tuple[int, ...] = (),
                     sm: int | None = None) -> onnx.ModelProto:
    """Trace one component's step to ONNX: the portable graph, or lowered for `sm` when given."""
    model = export_module(adapter(kind, module, taps), example_inputs(kind, module),
                          graph_io(kind, module, taps))
    return lower_for_sm(model, sm) if sm is not None else model


def export_module(step: nn.Module, inputs: tuple[torch.Tensor, ...], gio: GraphIO, *,
                  custom_domain: bool = False) -> onnx.ModelProto:
    """Trace `step(*inputs)` with the legacy exporter, quantized linears as metrale nodes
    (`custom_domain`: `step` emits other metrale nodes itself, e.g. `tp_export`'s collectives)."""
    quantized = custom_domain or any(_quantized(m) or isinstance(m, DynamicConv)
                                     for m in step.modules())
    _register_op_symbolics()
    buf = io.BytesIO()
    with _metrale_nodes(step), torch.no_grad(), _quiet_export():
        torch.onnx.export(step.eval(), inputs, buf, dynamo=False, opset_version=EXPORT_OPSET,
                          custom_opsets={DOMAIN: DOMAIN_VERSION} if quantized else None,
                          input_names=list(gio.inputs), output_names=list(gio.outputs),
                          dynamic_axes=gio.dynamic, do_constant_folding=True)
    model = onnx.load_from_string(buf.getvalue())
    model.producer_name = "metrale"
    return model


@contextlib.contextmanager
def _quiet_export():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)  # the legacy exporter
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        # "Only steps=1 can be constant folded": the strided slice stays a node, as it should.
        warnings.filterwarnings("ignore", message="Constant folding")
        yield
