"""Weight quantization of the drafters (DFlash drafter, MTP head) through NVIDIA ModelOpt.

ModelOpt computes every stored byte; this module chooses which tensors to quantize, checks
that a request can be honoured before any work, and writes ModelOpt's export names:

- FP8 per row (`quantize_fp8`): `weight` float8_e4m3fn [out, in], `weight_scale` float32 [out]
  = row amax / 448, produced by `mtq.quantize` with a per-channel (axis 0) E4M3 weight
  quantizer and ModelOpt's export helpers, as `export_hf_checkpoint` writes a Linear. An
  all-zero row gets ModelOpt's export substitute, scale 1.0 (its bytes are 0 either way).
- NVFP4 (`quantize_nvfp4`): `weight` uint8 [out, in/2] (element 2i in the low nibble),
  `weight_scale` float8_e4m3fn [out, in/16], `weight_scale_2` float32 [] = amax / (6 * 448),
  produced by `NVFP4QTensor.quantize`. The global scale can be given: quantizing a row shard
  with the whole tensor's global scale gives exactly the whole tensor's bytes for those rows.

Tiers (`--draft-weight-quantization`, DFlash drafter, engine tensor names):
  declared: nothing; fp8: every layer's q/k/v/o/gate/up/down and `lm_head` as FP8;
  fp8-aux: fp8 plus `fc`, `context_kv_proj`, every `kernel_projection` and
  `candidate_selector.hidden_projection`; nvfp4: NVFP4 copies of exactly the fp8-aux set.
Norms, DFlash2 base kernels and codebooks are never quantized. MTP head (`quantize_mtp`):
`--mtp-experts-nvfp4` makes the routed and shared experts NVFP4; `--mtp-quantization fp8`
makes FP8 copies of attention, fc and FFN linears; routers and the shared-expert gate stay.

Invariants: the input state is never modified; every tier starts from the same BF16 weights
(unquantized floating tensors are stored as bfloat16, scales keep their float32); a module is
either quantized with all its scale tensors or left as it was.
ModelOpt is imported lazily (it costs seconds), and only when something is quantized.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.metadata
import io
import logging
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from metrale.plugins import formats
from metrale.plugins.formats import NVFP4_BLOCK
from metrale.runtime.components import KINDS
from metrale.runtime.errors import ConfigError, QuantizationError

log = logging.getLogger(__name__)

# ModelOpt's per-channel FP8 weight quantizer in the list-style config (0.47 drops a dict-style
# config whose "default" entry comes last); no activation quantizer: W8A16.
_FP8_PER_ROW_CFG = {
    "quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": (4, 3), "axis": 0}},
    ],
    "algorithm": "max",
}
_FP8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
# Tensors that already carry a quantized weight's scales: stored as they are.
_SCALE_LEAVES = ("weight_scale", "weight_scale_2", "input_scale")


class DraftWeightQuantization(enum.Enum):
    """`--draft-weight-quantization`: the format of the DFlash drafter's GEMM weights."""

    DECLARED = "declared"
    FP8 = "fp8"
    FP8_AUX = "fp8-aux"
    NVFP4 = "nvfp4"

    @classmethod
    def parse(cls, s: str) -> DraftWeightQuantization:
        for tier in cls:
            if tier.value == s:
                return tier
        allowed = ", ".join(t.value for t in cls)
        raise ConfigError(f'expected one of {allowed}, got "{s}"')

    @property
    def format(self) -> str | None:
        """The format of the tier's copies: None (the checkpoint's weights), "fp8" or "nvfp4"."""
        return formats.DRAFT_TIER_FORMATS[self.value]

    def __str__(self) -> str:
        return self.value


DRAFT_TIERS = tuple(t.value for t in DraftWeightQuantization)  # names, in the flag's order
assert DRAFT_TIERS == formats.DRAFT_TIERS  # the tiers are the format table's

# Module names (tensor name without `.weight`) of each set, matched in full.
# the components' quantizable sets (`components.KINDS`): a drafter's core GEMMs (every tier) and
# auxiliary projections (fp8-aux), the MTP head's experts and its FP8 linears
_DRAFT_CORE, _DRAFT_AUX = KINDS["dflash"].tensor_set("core"), KINDS["dflash"].tensor_set("aux")
_MTP_EXPERTS, _MTP_FP8 = KINDS["mtp"].tensor_set("experts"), KINDS["mtp"].tensor_set("fp8")
MTP_QUANTIZATIONS = formats.MTP_QUANTIZATIONS
FFN_KINDS = ("dense", "moe")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep ModelOpt's own prints and expected warnings out of the build's output."""
    sink = io.StringIO()
    with warnings.catch_warnings():
        # A zero row's amax is replaced by ModelOpt at export (that is the intended scale 1.0).
        warnings.filterwarnings("ignore", message=r".*amax entries.*")
        warnings.filterwarnings("ignore", message=r".*not tested with current version of modelopt")
        with contextlib.redirect_stdout(sink):
            yield
    if sink.getvalue().strip():
        log.debug("modelopt: %s", sink.getvalue().strip())


def _check_weight(name: str, w: torch.Tensor, fmt: str) -> None:
    """Refuse a tensor ModelOpt cannot quantize to `fmt` into the stored layout."""
    if w.dim() != 2:
        raise QuantizationError(
            f"{name}: only 2-D [out, in] weights are quantized, got {list(w.shape)}"
        )
    if not w.dtype.is_floating_point or w.dtype in _FP8_DTYPES:
        raise QuantizationError(
            f"{name}: cannot quantize a {w.dtype} weight to {fmt}; it needs a BF16/FP16/FP32 weight"
        )
    unit = formats.FORMATS[fmt].col_unit if fmt in formats.FORMATS else 1
    if w.shape[1] % unit:
        raise QuantizationError(
            f"{name}: {fmt.upper()} needs the input size to be a multiple of {unit}, "
            f"got {w.shape[1]}"
        )
    if not bool(torch.isfinite(w).all()):
        raise QuantizationError(f"{name}: weight holds NaN or infinite values")


def _fp8_copies(weights: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """ModelOpt's FP8 per-row export of checked weights, all in one `mtq.quantize` pass."""
    with _quiet():
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import quant_utils

        linears = nn.ModuleList()
        for w in weights:
            linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            linear.weight = nn.Parameter(w.detach(), requires_grad=False)  # shares w's storage
            linears.append(linear)
        # Weight amax comes from the weights themselves: no calibration data needed.
        mtq.quantize(linears, _FP8_PER_ROW_CFG)
        out = []
        for linear in linears:
            fmt = quant_utils.get_quantization_format(linear)
            # float32 [out]: row amax / 448, a zero row's amax replaced by 448 (scale 1.0).
            scale = quant_utils.get_weight_scaling_factor(linear).reshape(-1).float()
            q = quant_utils.to_quantized_weight(linear.weight.detach(), scale, fmt)
            assert q.dtype == torch.float8_e4m3fn and q.shape == linear.weight.shape, fmt
            out.append({"weight": q.contiguous(), "weight_scale": scale.contiguous()})
    return out


def quantize_fp8_many(weights: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """FP8 per-row copies of several weights with one ModelOpt pass (see `quantize_fp8`)."""
    for i, w in enumerate(weights):
        _check_weight(f"weight {i}", w, "fp8")
    return _fp8_copies(weights)


def quantize_fp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """FP8 E4M3 per-row copy of w [out, in].

    Returns {"weight": float8_e4m3fn [out, in], "weight_scale": float32 [out]}.
    """
    return quantize_fp8_many([w])[0]


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """float32 []: amax(w) / (6 * 448), ModelOpt's NVFP4 global (second-level) scale.

    An all-zero tensor gets ModelOpt's export substitute for a zero amax (the maximum E2M1
    magnitude, so 1/448): a zero global scale would make every block scale 0/0.
    """
    with _quiet():
        from modelopt.torch.quantization.qtensor import NVFP4QTensor

        g = NVFP4QTensor.get_weights_scaling_factor_2(w).float().reshape(())
    if g == 0:
        g = torch.tensor(1.0 / 448.0, dtype=torch.float32, device=w.device)
    return g


def _nvfp4_copy(w: torch.Tensor, global_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """ModelOpt's NVFP4 quantization of a checked weight."""
    if global_scale is None:
        global_scale = nvfp4_global_scale(w)
    global_scale = global_scale.detach().float().reshape(()).to(w.device)
    if not bool(torch.isfinite(global_scale)) or global_scale <= 0:
        raise QuantizationError(
            f"NVFP4 global scale must be positive and finite, got {global_scale.item()}"
        )
    with _quiet():
        from modelopt.torch.quantization.qtensor import NVFP4QTensor

        packed, block_scale, _ = NVFP4QTensor.quantize(
            w.detach(), NVFP4_BLOCK, weights_scaling_factor_2=global_scale
        )
    return {
        "weight": packed._quantized_data.contiguous(),  # uint8 [out, in/2]
        "weight_scale": block_scale.contiguous(),  # float8_e4m3fn [out, in/16]
        "weight_scale_2": global_scale.clone(),  # float32 []
    }


def quantize_nvfp4(
    w: torch.Tensor, global_scale: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """NVFP4 copy of w [out, in] (in a multiple of 16).

    Returns {"weight": uint8 [out, in/2], "weight_scale": float8_e4m3fn [out, in/16],
    "weight_scale_2": float32 []}. `global_scale` defaults to `nvfp4_global_scale(w)`; pass the
    whole tensor's to quantize a row shard of it.
    """
    _check_weight("weight", w, "nvfp4")
    return _nvfp4_copy(w, global_scale)


def _modules(names: Iterable[str]) -> list[str]:
    return sorted(n[: -len(".weight")] for n in names if n.endswith(".weight"))


def draft_tier_modules(names: Iterable[str], tier: DraftWeightQuantization | str) -> list[str]:
    """The drafter modules (tensor names without `.weight`, sorted) that `tier` quantizes."""
    tier = _as_tier(tier)
    if tier is DraftWeightQuantization.DECLARED:
        return []
    aux = tier is not DraftWeightQuantization.FP8
    return [
        m for m in _modules(names)
        if _DRAFT_CORE.fullmatch(m) or (aux and _DRAFT_AUX.fullmatch(m))
    ]


def _as_tier(tier: DraftWeightQuantization | str) -> DraftWeightQuantization:
    if isinstance(tier, DraftWeightQuantization):
        return tier
    return DraftWeightQuantization.parse(tier)


def _storage_dtype(name: str, t: torch.Tensor) -> torch.dtype:
    """How an unquantized tensor is stored: floating weights as bfloat16, scales as they are."""
    keep = name.rsplit(".", 1)[-1] in _SCALE_LEAVES or t.dtype in _FP8_DTYPES
    return t.dtype if keep or not t.dtype.is_floating_point else torch.bfloat16


def _storage(name: str, t: torch.Tensor) -> torch.Tensor:
    return t.to(_storage_dtype(name, t))


def _quantize_modules(
    state: Mapping[str, torch.Tensor], modules: Sequence[str], fmt: str | None
) -> tuple[dict[str, torch.Tensor], dict]:
    """Replace each `{m}.weight` of `modules` by its `fmt` copy; store the rest as `_storage`.

    Every module is checked before the first one is quantized.
    """
    for m in modules:
        if f"{m}.weight_scale" in state:
            raise QuantizationError(f"{m}: weight is already quantized (has {m}.weight_scale)")
        _check_weight(f"{m}.weight", state[f"{m}.weight"], fmt or "")
    stored = {name: _storage(name, t) for name, t in state.items()}
    # Quantize the BF16 copy, so every tier is derived from the same weights as `declared`.
    weights = [stored[f"{m}.weight"] for m in modules]
    if fmt is None:
        assert not modules, "modules to quantize without a format"
    quantized = _QUANTIZERS[fmt](weights) if fmt is not None else []
    by_weight = {f"{m}.weight": (m, q) for m, q in zip(modules, quantized)}
    out: dict[str, torch.Tensor] = {}
    for name, t in stored.items():
        if name in by_weight:
            m, q = by_weight[name]
            out.update({f"{m}.{leaf}": v for leaf, v in q.items()})
        else:
            out[name] = t
    chosen = set(modules)
    excluded = [m for m in _modules(state) if m not in chosen and state[f"{m}.weight"].dim() == 2]
    return out, quantization_section(fmt, sorted(chosen), excluded)


# ModelOpt's quantizer per format of the table: [BF16 weight] -> [{leaf: tensor}]
_QUANTIZERS = {"fp8": _fp8_copies,
               "nvfp4": lambda weights: [_nvfp4_copy(w, None) for w in weights]}
assert set(_QUANTIZERS) == set(formats.FORMATS)  # a new format names its quantizer here


def quantization_section(
    fmt: str | None, quantized: Sequence[str], excluded: Sequence[str]
) -> dict:
    """The quantization section in the style of ModelOpt's hf_quant_config.json."""
    f = formats.FORMATS.get(fmt) if fmt is not None else None
    quant: dict = {"quant_algo": f.quant_algo if f is not None else None,
                   **dict(f.section if f is not None else (("per_channel", False),))}
    quant["quantized_modules"] = list(quantized)
    quant["exclude_modules"] = list(excluded)
    return {
        "producer": {"name": "modelopt", "version": importlib.metadata.version("nvidia-modelopt")},
        "quantization": quant,
    }


def quantize_drafter(
    state: Mapping[str, torch.Tensor], tier: DraftWeightQuantization | str
) -> tuple[dict[str, torch.Tensor], dict]:
    """The DFlash drafter's state at `tier` (engine names) and its quantization section."""
    tier = _as_tier(tier)
    modules = draft_tier_modules(state, tier)
    log.info("drafter: %s quantizes %d modules", tier.value, len(modules))
    return _quantize_modules(state, modules, tier.format)


def check_mtp_request(
    state: Mapping[str, torch.Tensor], *, experts_nvfp4: bool, mtp_quantization: str, ffn_kind: str
) -> list[str]:
    """Refuse a `--mtp-experts-nvfp4` / `--mtp-quantization` request the head cannot honour
    (the builder calls this before any work); returns the expert modules to requantize."""
    if mtp_quantization not in MTP_QUANTIZATIONS:
        allowed = ", ".join(MTP_QUANTIZATIONS)
        raise ConfigError(
            f'--mtp-quantization: expected one of {allowed}, got "{mtp_quantization}"'
        )
    if ffn_kind not in FFN_KINDS:
        allowed = ", ".join(FFN_KINDS)
        raise ConfigError(f'MTP head FFN kind: expected one of {allowed}, got "{ffn_kind}"')
    modules = _modules(state)
    if experts_nvfp4:
        if ffn_kind == "dense":
            raise QuantizationError(
                "--mtp-experts-nvfp4 needs a MoE MTP head; this head's FFN is dense"
            )
        experts = [m for m in modules if _MTP_EXPERTS.fullmatch(m)]
        fp8 = [m for m in experts if state[f"{m}.weight"].dtype in _FP8_DTYPES]
        if fp8:
            raise QuantizationError(
                "--mtp-experts-nvfp4 requantizes BF16 experts; this head's experts are stored "
                f"as FP8 ({fp8[0]}.weight is {state[fp8[0] + '.weight'].dtype})"
            )
        if mtp_quantization != "bf16":
            raise QuantizationError(
                f'--mtp-experts-nvfp4 needs --mtp-quantization bf16, got "{mtp_quantization}"'
            )
        if not experts:
            raise QuantizationError(
                "--mtp-experts-nvfp4: the MoE MTP head has no routed or shared expert weights "
                "(layer.mlp.experts.E.* / layer.mlp.shared_expert.*)"
            )
        return experts
    return []


def quantize_mtp(
    state: Mapping[str, torch.Tensor], *, experts_nvfp4: bool, mtp_quantization: str, ffn_kind: str
) -> tuple[dict[str, torch.Tensor], dict]:
    """The MTP head's state for `--mtp-experts-nvfp4` / `--mtp-quantization`, and its section.

    Every refusal is raised before any tensor is converted.
    """
    experts = check_mtp_request(state, experts_nvfp4=experts_nvfp4,
                                mtp_quantization=mtp_quantization, ffn_kind=ffn_kind)
    modules = _modules(state)
    if experts_nvfp4:
        return _quantize_modules(state, experts, "nvfp4")
    if mtp_quantization == "fp8":
        return _quantize_modules(state, [m for m in modules if _MTP_FP8.fullmatch(m)], "fp8")
    return _quantize_modules(state, [], None)


def weight_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes the tensors of `state` occupy (sum of nbytes)."""
    return sum(t.nbytes for t in state.values())


def memory_estimate(state_by_tier: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, int]:
    """{tier name: weight bytes} for the build's memory estimate, in the order given."""
    return {str(tier): weight_bytes(state) for tier, state in state_by_tier.items()}


def _predicted_bytes(
    state: Mapping[str, torch.Tensor], modules: Iterable[str], fmt: str | None
) -> int:
    """`weight_bytes` of `_quantize_modules(state, modules, fmt)`, from the shapes alone."""
    chosen = {f"{m}.weight" for m in modules}
    total = 0
    for name, t in state.items():
        if name not in chosen:
            total += t.numel() * _storage_dtype(name, t).itemsize
        else:  # the format's weight and scales
            total += formats.FORMATS[fmt].stored_bytes(t.shape[0], t.shape[1])
    return total


def estimate_bytes(state: Mapping[str, torch.Tensor], tier: DraftWeightQuantization | str) -> int:
    """The drafter's weight bytes at `tier` without quantizing (equals `weight_bytes` of
    `quantize_drafter(state, tier)[0]`), for the memory estimate of every tier."""
    tier = _as_tier(tier)
    return _predicted_bytes(state, draft_tier_modules(state, tier), tier.format)


def estimate_mtp_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """The MTP head's weight bytes with `--mtp-experts-nvfp4`, without quantizing."""
    experts = [m for m in _modules(state) if _MTP_EXPERTS.fullmatch(m)]
    return _predicted_bytes(state, experts, "nvfp4")
