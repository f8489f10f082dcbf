"""Weight tiers chosen at serve time: `--draft-weight-quantization` and `--mtp-experts-nvfp4`.

An engine directory keeps each drafter's and the MTP head's declared weights (BF16, engine
tensor names) in the file its manifest entry names as `declared`. When `generate`, `serve` or
`bench` asks for a tier other than the one the engine was built with, those weights are
quantized again here with ModelOpt, through the same functions `metrale build` uses, so the
bytes equal a build at that tier; the loader then takes them instead of the rank files (and
cuts a tensor-parallel rank's shard from them). Unset flags keep the built tier.

Refusals (before any weights load): a tier for a drafter or head the engine directory lacks; a
tier the declared weights cannot take (`--mtp-experts-nvfp4` on a dense head, on FP8 experts or
with `--mtp-quantization fp8`); an engine directory that keeps no declared weights (an older
metrale built it). TensorRT plans hold the weights of their build: `check_plans` refuses
another tier there, naming both.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from metrale.builder import quantize as q
from metrale.plugins.formats import DRAFT_TIER_FORMATS, FORMATS
from metrale.runtime.models.configs import DecoderConfig, read_config
from metrale.runtime.artifact.engine_dir import Manifest
from metrale.runtime.components import Role, names_with_role
from metrale.runtime.errors import ConfigError, EngineDirError
from metrale.runtime.spec.config import SpecMode, SpeculativeConfig

State = dict[str, torch.Tensor]


def built_tiers(manifest: Manifest) -> tuple[str, bool]:
    """(drafter tier, MTP experts in NVFP4) the engine directory was built with: its build
    record, checked against what each drafter's weights are (a record that says otherwise would
    skip the requantization a tier asks for)."""
    b = manifest.build
    tier = b.get("draft_weight_quantization", "fp8")
    if tier not in DRAFT_TIER_FORMATS:
        raise EngineDirError(f"config.json: build.draft_weight_quantization {tier!r} is not one of "
                             f"{', '.join(DRAFT_TIER_FORMATS)}; rebuild it with metrale build")
    fmt = DRAFT_TIER_FORMATS[tier]
    want = FORMATS[fmt].quant_algo if fmt is not None else None
    for name in names_with_role(manifest.components, Role.DRAFTER):
        algo = manifest.components[name].quant_algo
        got = algo.quant_algo if algo is not None else None
        if got != want:
            raise EngineDirError(f"config.json: build.draft_weight_quantization is {tier}, but drafter "
                                 f"{name}'s weights are {got or 'not quantized'}; rebuild it with "
                                 "metrale build")
    return tier, bool(b.get("mtp_experts_nvfp4", False))


def _mtp_name(manifest: Manifest) -> str | None:
    return next(iter(names_with_role(manifest.components, Role.HEAD)), None)


def _declared(engine_dir: Path, name: str, info, flag: str) -> tuple[State, str]:
    rel = info.declared
    if rel is None:
        raise EngineDirError(f"{flag}: engine directory {engine_dir} keeps no declared weights for "
                             f"{name} (an older metrale built it); rebuild it with metrale build")
    try:
        return load_file(str(engine_dir / rel)), rel
    except Exception as exc:  # SafetensorError, OSError: the checksum check ran before this
        raise EngineDirError(f"engine directory {engine_dir}: {rel} cannot be read ({exc})") from None


def requantized_states(engine_dir: str | Path, manifest: Manifest, *, draft_tier: str | None = None,
                       drafters: tuple[str, ...] = (), mtp_experts_nvfp4: bool | None = None
                       ) -> dict[str, tuple[State, str]]:
    """{component: (one-rank engine state, its source)} for every component asked for at a
    tier other than its built one: the named drafters at `draft_tier`, the MTP head with
    `mtp_experts_nvfp4`. Empty when the built tiers serve. A drafter the engine directory lacks
    is skipped (the mode's own check names it)."""
    engine_dir = Path(engine_dir)
    tier, nvfp4 = built_tiers(manifest)
    out: dict[str, tuple[State, str]] = {}
    for name in drafters if draft_tier not in (None, tier) else ():
        info = manifest.components.get(name)
        if name in names_with_role(manifest.components, Role.DRAFTER):
            declared, rel = _declared(engine_dir, name, info, f"--draft-weight-quantization {draft_tier}")
            state, _ = q.quantize_drafter(declared, draft_tier)
            out[name] = (state, f"engine directory {engine_dir}: {rel} quantized at load to "
                                f"{draft_tier} (built: {tier}), {q.weight_bytes(state):,} weight bytes")
    if mtp_experts_nvfp4 is None:
        return out
    want = mtp_experts_nvfp4
    flag = "--mtp-experts-nvfp4" if want else "--no-mtp-experts-nvfp4"
    name = _mtp_name(manifest)
    if name is None:
        raise ConfigError(f"{flag}: engine directory {engine_dir} has no MTP head")
    info = manifest.components[name]
    declared, rel = _declared(engine_dir, name, info, flag)
    cfg = DecoderConfig.from_hf(read_config(engine_dir / name), f"{name}/config.json")
    kind = "moe" if cfg.is_moe else "dense"
    mtpq = manifest.build.get("mtp_quantization", "bf16")
    try:
        q.check_mtp_request(declared, experts_nvfp4=want, mtp_quantization=mtpq, ffn_kind=kind)
    except ConfigError as exc:
        raise type(exc)(f"engine directory {engine_dir}: {exc}") from None
    if want != nvfp4:
        state, _ = q.quantize_mtp(declared, experts_nvfp4=want, mtp_quantization=mtpq, ffn_kind=kind)
        done = "experts quantized at load to NVFP4" if want else "BF16 experts"
        out[name] = (state, f"engine directory {engine_dir}: {rel}, {done} (built: "
                            f"{'NVFP4' if nvfp4 else 'BF16'} experts), {q.weight_bytes(state):,} weight bytes")
    return out


def states_for(engine_dir: str | Path, manifest: Manifest,
               spec: SpeculativeConfig) -> dict[str, tuple[State, str]]:
    """`requantized_states` for what one speculative mode runs."""
    dflash = spec.mode is SpecMode.DFLASH
    return requantized_states(
        engine_dir, manifest, draft_tier=spec.draft_weight_quantization if dflash else None,
        drafters=(spec.dflash_drafter,) if dflash else (),
        mtp_experts_nvfp4=spec.mtp_experts_nvfp4 if spec.mode is SpecMode.MTP else None)


def check_plans(engine_dir: str | Path, manifest: Manifest, *, draft_tier: str | None = None,
                mtp_experts_nvfp4: bool | None = None, dtype: str | None = None,
                backend: str = "tensorrt") -> None:
    """A graph backend's graphs (TensorRT plans, or the ONNX graphs onnxruntime runs) hold their
    build's weights: refuse another tier by name, and for TensorRT another explicit --dtype
    (`dtype` as given on the command line; auto takes theirs)."""
    what = "TensorRT plans" if backend == "tensorrt" else "ONNX graphs"
    built = manifest.build.get("trt_dtype", "float32")
    wanted = {"fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype)
    if backend == "tensorrt" and wanted not in (None, "auto", built):
        raise ConfigError(f"--dtype {dtype}: the TensorRT plans of engine directory {engine_dir} "
                          f"compute in {built}; use --dtype auto or {built}, or rebuild with "
                          f"--trt-dtype {wanted}")
    tier, nvfp4 = built_tiers(manifest)
    if draft_tier not in (None, tier):
        raise ConfigError(f"--draft-weight-quantization {draft_tier}: the {what} of engine "
                          f"directory {engine_dir} were built with drafter weights at {tier}; "
                          f"serve them at {tier}, run another backend, or rebuild with "
                          f"--draft-weight-quantization {draft_tier}")
    if mtp_experts_nvfp4 not in (None, nvfp4):
        flag = "--mtp-experts-nvfp4" if mtp_experts_nvfp4 else "--no-mtp-experts-nvfp4"
        raise ConfigError(f"{flag}: the {what} of engine directory {engine_dir} were built "
                          f"with the MTP head's experts {'in NVFP4' if nvfp4 else 'in BF16'}; "
                          "serve them so, run another backend, or rebuild")
