"""Building blocks shared by the target, the MTP head and the drafters (PyTorch, CPU or GPU).

Conventions: B batch, T new tokens, S keys (cache + new), H hidden, nh query heads, nkv KV heads,
hd head dim, E experts. Norms compute in fp32 and return the input dtype, like transformers, so
the fp32 target matches transformers' Qwen3 to rounding. Linear layers are plain `nn.Linear`;
the loader swaps in quantized modules (`runtime.models.qlinear`) where an engine stores FP8/NVFP4
weights, so model code never branches on precision.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from metrale.plugins import step_kernels
from metrale.plugins.nvfp4_moe import dense_experts, nvfp4_moe_w4a16, routed_matvecs
from metrale.runtime.models.configs import DecoderConfig
from metrale.runtime.models.kv_cache import KVCache, causal_mask
from metrale.runtime.models.packing import fused_already, share_storage, stack_nvfp4_experts
from metrale.runtime.models.rotary import rope_at


def float_weight(linear: nn.Module) -> torch.Tensor:
    """The [out, in] floating-point weight a linear computes with (quantized ones dequantized)."""
    dense = getattr(linear, "dense_weight", None)
    return dense() if dense is not None else linear.weight.detach()


def pack_for_inference(module: nn.Module) -> nn.Module:
    """Call `pack()` on every submodule that has one: fused projections and stacked experts for
    the decode loop. Training and export use the unpacked modules."""
    stacked = {id(m) for sub in module.modules() if isinstance(sub, MoE) for m in sub.experts.modules()}
    for sub in module.modules():
        if hasattr(sub, "pack") and id(sub) not in stacked:  # routed experts run stacked
            sub.pack()
    return module


def capturable(module: nn.Module) -> nn.Module:
    """`module` with every MoE on its dense routed path, a fixed set of ops whatever the routing
    (on a CPU the eager path reads the routing to run each row's experts only; a GPU takes the
    dense path anyway): what a CUDA graph, or its stand-in on a CPU, captures. Returned."""
    for m in module.modules():
        if isinstance(m, MoE):
            m.row_invariant = True
    return module


def tracing() -> bool:
    """Inside a graph capture: torch.export / torch.compile, or the TorchScript tracer that the
    ONNX export runs. Captured graphs take the textbook formulas (inductor fuses them; the ONNX
    graph needs standard ops); eager inference takes the few-kernel forms below, because at
    these sizes an eager step costs its kernel count. (`torch.onnx.is_in_onnx_export` costs two
    imports per call, a measurable share of a decode step.)"""
    return torch._C._is_tracing() or torch.compiler.is_compiling()


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim. Eagerly in two kernels: LayerNorm of [x, −x] is RMSNorm of x
    (the mean is zero and the variance is mean(x²)); eager `F.rms_norm` runs about eight on a
    CPU, and this agrees with it within an ulp or two (float32). Captured, the textbook form."""
    if tracing():
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    h = x.shape[-1]
    return torch.layer_norm(torch.cat((x, x.neg()), -1), (2 * h,), None, None, eps).narrow(-1, 0, h)


class RMSNorm(nn.Module):
    """x̂·w (Qwen3, DeepSeek) or x̂·(1+w) (zero-centred, Qwen3-Next) with x̂ = x/rms(x)."""

    def __init__(self, dim: int, eps: float, zero_centred: bool = False):
        super().__init__()
        self.eps, self.zero_centred = eps, zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if x.is_cuda and not tracing():  # one fused kernel on a GPU (eagerly and in a CUDA graph)
            weight = 1.0 + self.weight if self.zero_centred else self.weight
            return F.rms_norm(x, (x.shape[-1],), weight.to(dtype), self.eps)
        if dtype == torch.float32:  # the same arithmetic, without the no-op casts
            weight = 1.0 + self.weight if self.zero_centred else self.weight
            return rms_normalize(x, self.eps) * weight
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centred:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, n, T, hd]; cos/sin [T, hd]."""
    half = x.shape[-1] // 2
    if not tracing():  # cat(−x2, x1)·sin = roll(x)·(sin with its first half negated): 4 kernels, not 7
        return torch.addcmul(x * cos, x.roll(half, -1), sin * _rope_sign(sin.shape[-1], sin.dtype, sin.device))
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@functools.lru_cache(maxsize=None)
def _rope_sign(hd: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[hd]: −1 over the first half, +1 over the second (a constant, made once per dtype/device)."""
    with torch.inference_mode(False):
        return torch.cat([torch.full((hd // 2,), -1.0), torch.ones(hd - hd // 2)]).to(dtype=dtype, device=device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, nh, T, hd], k/v [B, nkv, S, hd], mask [T, S] bool (True = may attend) -> [B, nh, T, hd]."""
    if tracing() and torch.onnx.is_in_onnx_export():  # the ONNX exporter has no grouped SDPA
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        # written out, so a bfloat16 graph stays bfloat16 (softmax in float32, as SDPA does)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(int(q.shape[-1])))
        if mask is not None:
            scores = torch.where(mask, scores, torch.full((), float("-inf"), dtype=scores.dtype))
        return torch.matmul(scores.float().softmax(-1).to(q.dtype), v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def fixed_length_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           positions: torch.Tensor) -> torch.Tensor:
    """q [B, nh, T, hd]; k/v [B, nkv, S, hd]: a whole cache, slot j visible to the row at
    position p iff j <= p -> [B, nh, T, hd]. Written as reductions over all S slots, so a row's
    bits depend on its position and the cache, never on how many rows the call has (SDPA's
    kernels block the queries and keys by the call's shapes)."""
    b, nh, t, hd = q.shape
    nkv, s = k.shape[1], k.shape[2]
    qg = q.view(b, nkv, nh // nkv, t, 1, hd)
    scores = (qg * k.view(b, nkv, 1, 1, s, hd)).sum(-1) * hd ** -0.5  # [B, nkv, g, T, S]
    visible = torch.arange(s, device=q.device)[None, :] <= positions[:, None]  # [T, S]
    probs = scores.masked_fill(~visible, float("-inf")).float().softmax(-1).to(q.dtype)
    out = (probs.unsqueeze(-1) * v.view(b, nkv, 1, 1, s, hd)).sum(-2)  # [B, nkv, g, T, hd]
    return out.view(b, nh, t, hd)


class Attention(nn.Module):
    """Qwen3 attention: per-head RMSNorm on q and k before RoPE, grouped-query KV.

    `row_invariant` (set by `LoadedEngine.pack` where the projections' GEMMs already are, see
    there): with a cache, attend over the cache's whole length with `fixed_length_attention`."""

    row_invariant = False

    def __init__(self, cfg: DecoderConfig, zero_centred_norm: bool = False):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qk_kernel = self.hd & (self.hd - 1) == 0  # a power-of-two head: `step_kernels.qk_norm_rope`
        self.theta = cfg.rope_theta
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps, zero_centred_norm)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps, zero_centred_norm)
        self.register_buffer("qkv_weight", None, persistent=False)  # [(nh+2nkv)·hd, H], see pack()
        self.register_buffer("qk_norm_weight", None, persistent=False)  # [nh+nkv, hd]
        self.qkv_kernel: nn.Module | None = None  # the fused projection through the CPU kernel

    def pack(self) -> None:
        """Fuse q/k/v into one GEMM for inference (plain float weights only; quantized
        projections keep their own op so their results stay the op's bits)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if self.qk_norm_weight is None:
            # q and k heads normed in one op: each head's multiplier, (1 + w) when zero-centred
            mult = [n.weight.detach() + (1.0 if n.zero_centred else 0.0) for n in (self.q_norm, self.k_norm)]
            self.qk_norm_weight = torch.cat([mult[0].expand(self.nh, -1), mult[1].expand(self.nkv, -1)])
        if fused_already(projs, self.qkv_weight):
            return
        if all(type(p) is nn.Linear and p.bias is None for p in projs):
            self.qkv_weight = torch.cat([p.weight.detach() for p in projs], dim=0)
            share_storage(projs, self.qkv_weight)

    def use_linear_kernel(self) -> None:
        """Run a compiled step's fused q/k/v projection through the CPU kernel
        (`plugins.cpu_linear`), its weight held in the kernel's panels (after `pack`)."""
        from metrale.plugins.cpu_linear import KernelLinear

        self.qkv_kernel = KernelLinear(self.qkv_weight)

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.qkv_weight) if self.qkv_kernel is None else self.qkv_kernel(x)

    def project_q(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.nh, self.hd)).transpose(1, 2)
        return apply_rope(q, cos, sin)  # [B, nh, T, hd]

    def kv_from_projected(self, k: torch.Tensor, v: torch.Tensor, cos, sin):
        """k/v [B, T, nkv*hd] straight from a projection -> normed, roped [B, nkv, T, hd] each."""
        b, t, _ = k.shape
        k = self.k_norm(k.view(b, t, self.nkv, self.hd)).transpose(1, 2)
        v = v.view(b, t, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def project_qkv(self, x: torch.Tensor, cos, sin):
        """x [B, T, H] -> q [B, nh, T, hd], k and v [B, nkv, T, hd] (q and k normed and roped):
        one GEMM when `pack` fused the projections."""
        b, t, _ = x.shape
        if self.qk_kernel and self.qk_norm_weight is not None and step_kernels.use(x):
            # a GPU: one launch normalises and ropes every q and k head (a power-of-two head size)
            nq, nk = self.nh * self.hd, self.nkv * self.hd
            if self.qkv_weight is not None:
                qkv = self._qkv(x)
                q_in, k_in, v = qkv, qkv[..., nq:], qkv[..., nq + nk:]
            else:
                q_in, k_in, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k = step_kernels.qk_norm_rope(q_in, k_in, self.qk_norm_weight, cos, sin, self.q_norm.eps,
                                             self.nh, self.nkv, self.hd)
            return q, k, v.reshape(b, t, self.nkv, self.hd).transpose(1, 2)
        if self.qkv_weight is not None and x.dtype == torch.float32:
            qk, v = self._qkv(x).split_with_sizes(
                [(self.nh + self.nkv) * self.hd, self.nkv * self.hd], dim=-1)
            qk = qk.view(b, t, self.nh + self.nkv, self.hd)  # q heads, then k heads
            qk = rms_normalize(qk, self.q_norm.eps) * self.qk_norm_weight
            qk = apply_rope(qk.transpose(1, 2), cos, sin)  # [B, nh+nkv, T, hd]
            q, k = qk.split_with_sizes([self.nh, self.nkv], dim=1)
            return q, k, v.view(b, t, self.nkv, self.hd).transpose(1, 2)
        if self.qkv_weight is not None:
            q, k, v = self._qkv(x).split(
                [self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
            q = apply_rope(self.q_norm(q.view(b, t, self.nh, self.hd)).transpose(1, 2), cos, sin)
        else:
            q, k, v = self.project_q(x, cos, sin), self.k_proj(x), self.v_proj(x)
        return (q, *self.kv_from_projected(k, v, cos, sin))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0, start: int = 0, rope=None) -> torch.Tensor:
        """Causal self-attention. x [B, T, H]; positions [T]; with a cache, keys 0..start-1 come
        from it. `rope` (cos, sin) [T, hd] when the caller has them for `positions` already."""
        b, t, _ = x.shape
        cos, sin = rope if rope is not None else rope_at(positions, self.hd, self.theta, x.dtype)
        q, k, v = self.project_qkv(x, cos, sin)
        if cache is not None:
            attend_own = getattr(cache, "attend", None)  # a step cache (`step_caches`): its own slots
            if attend_own is not None:
                cache.write(layer, start, k, v)
                return self.o_proj(attend_own(layer, q))
            k, v = cache.write(layer, start, k, v)
            if self.row_invariant and isinstance(cache, KVCache):
                out = fixed_length_attention(q, cache.k[layer], cache.v[layer], positions)
                return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))
            mask = cache.mask(t, start, x.device)
        else:
            mask = causal_mask(t, 0, x.device)
        out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)  # [2I, H], see pack()
        self.gate_up_kernel: nn.Module | None = None  # the fused projection through the CPU kernel

    def pack(self) -> None:
        """Fuse gate and up into one GEMM (plain float weights only)."""
        if fused_already((self.gate_proj, self.up_proj), self.gate_up_weight):
            return
        if type(self.gate_proj) is nn.Linear and type(self.up_proj) is nn.Linear:
            self.gate_up_weight = torch.cat([self.gate_proj.weight.detach(),
                                             self.up_proj.weight.detach()], dim=0)
            share_storage((self.gate_proj, self.up_proj), self.gate_up_weight)

    def use_linear_kernel(self) -> None:
        """Run a compiled step's fused gate/up projection through the CPU kernel
        (`plugins.cpu_linear`), its weight held in the kernel's panels (after `pack`)."""
        from metrale.plugins.cpu_linear import KernelLinear

        if self.gate_up_weight is None:
            raise ValueError("the kernel computes the fused gate/up projection: pack() the MLP first")
        self.gate_up_kernel = KernelLinear(self.gate_up_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_kernel is not None:
            gate, up = self.gate_up_kernel(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-k routed experts (softmax router, optional renormalisation of the top-k weights) plus an
    optional shared expert scaled by sigmoid(shared_expert_gate(x)) (a gate of 1 when absent)."""

    # set with the attention's (`LoadedEngine.pack`): every row count runs the dense experts,
    # whose rows do not depend on the row count there (the selected experts' GEMVs would give a
    # one-row step other bits than a verify's dense rows)
    row_invariant = False
    # set on a compiled step's layers where the CPU kernel serves (`plugins.cpu_moe`, the CPU
    # build): the routed experts are then one `metrale::routed_experts` node
    routed_kernel = False

    def __init__(self, cfg: DecoderConfig, shared_gate: bool = True):
        super().__init__()
        h = cfg.hidden_size
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(h, cfg.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            MLP(h, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)
        )
        inter = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(h, inter) if inter else None
        self.shared_expert_gate = nn.Linear(h, 1, bias=False) if inter and shared_gate else None
        self.register_buffer("experts_gate_up", None, persistent=False)  # [E·2I, H], see pack()
        self.register_buffer("experts_down", None, persistent=False)  # [E, I, H]
        self.nvfp4_stacked = None  # NVFP4 experts stacked for the grouped op, see pack()

    def route(self, x: torch.Tensor):
        """x [N, H] -> top-k weights [N, k] (x.dtype), expert ids [N, k]."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [N, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def pack(self) -> None:
        """Stack every routed expert's weights for the fixed-op-count inference path: gate and up
        of expert e are rows [e·2I, e·2I+I) and [e·2I+I, (e+1)·2I) of one [E·2I, H] matrix, the
        down projections one [E, I, H] batch. Quantized experts are dequantized here, once. NVFP4
        experts are stacked as they are stored instead (`nvfp4_stacked`), for the grouped op the
        forward runs them through, which holds their dequantized copy itself. Once stacked, a
        later call keeps the stacks (see `fused_already`)."""
        if self.experts_gate_up is not None or self.nvfp4_stacked is not None:
            return
        self.nvfp4_stacked = stack_nvfp4_experts(self.experts)
        if self.nvfp4_stacked is not None:
            return
        inter = self.experts[0].gate_proj.out_features if self.experts else 0
        gate_up, down = [], []
        for expert in self.experts:
            gate_up += [float_weight(expert.gate_proj), float_weight(expert.up_proj)]
            down.append(float_weight(expert.down_proj).t())
        self._stack(torch.cat(gate_up, dim=0), torch.stack(down))
        plain = [e for e in self.experts if all(type(lin) is nn.Linear for lin in
                                                 (e.gate_proj, e.up_proj, e.down_proj))]
        if len(plain) == len(self.experts) and self.experts_gate_up.dtype == self.gate.weight.dtype:
            for i, expert in enumerate(self.experts):  # one copy of the weights, two views
                share_storage((expert.gate_proj, expert.up_proj),
                              self.experts_gate_up[2 * i * inter:2 * (i + 1) * inter])
                expert.down_proj.weight.data = self.experts_down[i].t()

    def forward(self, x: torch.Tensor, nvfp4_experts: tuple | None = None) -> torch.Tensor:
        """`nvfp4_experts`: the stacked NVFP4 tensors to run the routed experts with (the ONNX
        export passes them as its graph's weights); by default the ones `pack()` stacked."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, H]
        if (self.experts_gate_up is not None and step_kernels.use(x) and type(self.gate) is nn.Linear
                and self.experts_gate_up.dtype == x.dtype):
            # a GPU: the router and the routed experts in three launches (`moe_experts`)
            routed = step_kernels.moe_experts(x, self.gate.weight.to(x.dtype), self.experts_gate_up,
                                              self.experts_down, self.top_k, self.norm_topk)
            if self.shared_expert is not None:
                routed = routed + self.shared(x)
            return routed.reshape(shape)
        weights, ids = self.route(x)
        stacked = nvfp4_experts if nvfp4_experts is not None else self.nvfp4_stacked
        if stacked is not None:  # NVFP4 experts: the grouped op (one node / plugin when exported)
            return (nvfp4_moe_w4a16(x, ids, weights, *stacked) + self.shared(x)).reshape(shape)
        if self.experts_gate_up is not None:
            if torch.compiler.is_compiling():  # a compiled step: only each row's experts are read
                routed = (self._kernel_experts if self.routed_kernel else self._gathered_experts)(x, weights, ids)
                return (routed + self.shared(x)).reshape(shape)
            few = (x.device.type == "cpu" and not self.row_invariant and not tracing()
                   and x.shape[0] * self.top_k <= self.experts_down.shape[0])
            routed = (self._selected_experts if few else self._dense_experts)(x, weights, ids)
            if self.shared_expert is not None:
                routed = routed + self.shared(x)
            return routed.reshape(shape)
        if tracing():  # an exported graph: every expert densely (no data-dependent routing)
            dense = x.new_zeros((x.shape[0], len(self.experts))).scatter(1, ids, weights)  # [N, E]
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                out = out + expert(x) * dense[:, e:e + 1]
            return (out + self.shared(x)).reshape(shape)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.nonzero(ids == e, as_tuple=True)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return (out + self.shared(x)).reshape(shape)

    def _gathered_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each row gathers its top-k experts' weights inside the reductions (compiled, an
        indirect load: only the selected experts are read, and a row's arithmetic depends on
        that row alone) and sums their outputs in slot order."""
        e, inter, hidden = self.experts_down.shape
        gate_up = self.experts_gate_up.view(e, 2 * inter, hidden)[ids]  # [N, k, 2I, H]
        gate, up = (x[:, None, None, :] * gate_up).sum(-1).chunk(2, dim=-1)  # [N, k, I]
        y = ((F.silu(gate) * up).unsqueeze(-1) * self.experts_down[ids]).sum(-2)  # [N, k, H]
        return (y * weights.unsqueeze(-1)).sum(1)  # [N, H]

    def use_routed_kernel(self) -> None:
        """Run a compiled step's routed experts through the CPU kernel (`plugins.cpu_moe`), its
        gate/up [E, H, 2I] and down [E, I, H] weights held in the kernel's panels (buffers, so
        the step's constants: computed in the graph, the copies would be made again at every
        call). Float32 experts whose every weight is a bfloat16 value (a bfloat16 checkpoint's,
        widened) are held as bfloat16: the kernel widens them back exactly, and a step streams
        half their bytes."""
        from metrale.plugins import cpu_moe
        from metrale.plugins.cpu_panels import pack_panels

        e, inter, hidden = self.experts_down.shape
        gate_up = self.experts_gate_up.view(e, 2 * inter, hidden).transpose(1, 2)
        gate_up, down = cpu_moe.narrowed(gate_up, self.experts_down)
        self.register_buffer("experts_gate_up_panels", pack_panels(gate_up), persistent=False)
        self.register_buffer("experts_down_panels", pack_panels(down), persistent=False)
        self.routed_kernel = True

    def _kernel_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.metrale.routed_experts(x.contiguous(), ids.contiguous(), weights.contiguous(),
                                                self.experts_gate_up_panels, self.experts_down_panels)

    def dequantize_experts(self) -> None:
        """Hold NVFP4 experts as stacked float weights (`pack`'s layout, from the grouped op's
        dequantized copy) in place of the packed ones: what a compiled step folds in as constants."""
        if self.nvfp4_stacked is None:
            return
        gate_up, down = dense_experts(*self.nvfp4_stacked)[:2]  # [E, 2I, H], [E, H, I]
        self._stack(gate_up.reshape(-1, gate_up.shape[-1]), down.transpose(1, 2))
        self.nvfp4_stacked = None

    def _stack(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Hold gate/up [E·2I, H] and down [E, I, H] in the router's dtype, and per expert views
        (no copies) of its [2I, H] gate/up rows and its [H, I] down weight."""
        dtype = self.gate.weight.dtype
        self.experts_gate_up = gate_up.to(dtype)
        self.experts_down = down.to(dtype).contiguous()
        self._expert_views = (list(self.experts_gate_up.chunk(len(self.experts))),
                              [d.t() for d in self.experts_down.unbind(0)])

    def _selected_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each row's top-k experts on views of the stacked weights (`nvfp4_moe.routed_matvecs`):
        only the selected experts' bytes are read (the dense path reads all E, which for one row
        is E/k times the memory traffic, and at these sizes a step is bound by it); the op count
        is fixed by rows × k, whatever the routing."""
        return routed_matvecs(x, ids, weights, *self._expert_views)

    def _dense_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every row, weighted by the (mostly zero) routing weights: a fixed
        number of ops whatever the routing, and each row's sum runs over the experts in id
        order with exact zeros for the unselected ones, as the per-expert loop sums them."""
        n, e = x.shape[0], self.experts_down.shape[0]
        dense = x.new_zeros(n, e).scatter_(1, ids, weights)  # [N, E]
        gate, up = F.linear(x, self.experts_gate_up).view(n, e, 2, -1).unbind(2)  # [N, E, I] each
        act = (F.silu(gate) * up).transpose(0, 1)  # [E, N, I]
        y = torch.bmm(act, self.experts_down)  # [E, N, H]
        return (y * dense.t().unsqueeze(-1)).sum(0)  # [N, H]

    def shared(self, x: torch.Tensor) -> torch.Tensor | float:
        """The shared expert's contribution for x [N, H] (0 without one)."""
        if self.shared_expert is None:
            return 0.0
        y = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            y = torch.sigmoid(self.shared_expert_gate(x)) * y
        return y


class DecoderLayer(nn.Module):
    """Pre-norm transformer layer: x + attn(ln1(x)), then x + ffn(ln2(x))."""

    def __init__(self, cfg: DecoderConfig, moe: bool, zero_centred_norm: bool = False,
                 shared_gate: bool = True):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, zero_centred_norm)
        self.self_attn = Attention(cfg, zero_centred_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, zero_centred_norm)
        self.mlp = MoE(cfg, shared_gate) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, positions, cache=None, layer=0, start=0, rope=None):
        x = x + self.self_attn(self.input_layernorm(x), positions, cache, layer, start, rope)
        return x + self.mlp(self.post_attention_layernorm(x))
