"""Model configs read from Hugging Face `config.json` files.

Each config is a frozen dataclass built by `from_hf(dict, source)`; a missing required key or a
value of the wrong kind is refused with a `CheckpointError` naming the file and the key. Keys
that transformers writes but metrale does not need are ignored (HF configs carry many), but every
key that changes the math is read here and nowhere else.

Both spellings that real checkpoints use are accepted where they differ: `rope_theta` (Qwen3
releases) or `rope_parameters.rope_theta` (transformers 5), `num_experts` or `num_local_experts`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metrale.runtime.errors import CheckpointError


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"checkpoint {folder}: config.json not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint {folder}: config.json is not valid JSON ({exc})") from None


class _Reader:
    """Typed access to an HF config dict with errors that name the file and key."""

    def __init__(self, cfg: dict[str, Any], source: str):
        self.cfg, self.source = cfg, source

    def get(self, key: str, kind: type, default: Any = ..., *aliases: str) -> Any:
        for k in (key, *aliases):
            if k in self.cfg and self.cfg[k] is not None:
                value = self.cfg[k]
                break
        else:
            if default is ...:
                raise CheckpointError(f"{self.source}: required key `{key}` is missing")
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise CheckpointError(
                f"{self.source}: key `{key}` must be {kind.__name__}, got {value!r}"
            )
        return value

    def rope_theta(self) -> float:
        rope = self.cfg.get("rope_parameters") or {}
        if "rope_theta" in self.cfg and self.cfg["rope_theta"] is not None:
            return float(self.cfg["rope_theta"])
        if isinstance(rope, dict) and "rope_theta" in rope:
            rope_type = rope.get("rope_type", "default")
            if rope_type != "default":
                raise CheckpointError(
                    f"{self.source}: rope_type {rope_type!r} is not supported (allowed: default)"
                )
            return float(rope["rope_theta"])
        return 10000.0


@dataclass(frozen=True)
class DecoderConfig:
    """The attention + FFN shape shared by targets, the MTP head and drafters."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    # MoE (num_experts == 0: dense FFN)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    model_type: str = "qwen3"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str) -> "DecoderConfig":
        r = _Reader(cfg, source)
        hidden = r.get("hidden_size", int)
        heads = r.get("num_attention_heads", int)
        num_experts = r.get("num_experts", int, 0, "num_local_experts", "n_routed_experts")
        return cls(
            vocab_size=r.get("vocab_size", int),
            hidden_size=hidden,
            num_hidden_layers=r.get("num_hidden_layers", int),
            num_attention_heads=heads,
            num_key_value_heads=r.get("num_key_value_heads", int, heads),
            head_dim=r.get("head_dim", int, hidden // heads),
            intermediate_size=r.get("intermediate_size", int, 0),
            rms_norm_eps=r.get("rms_norm_eps", float, 1e-6),
            rope_theta=r.rope_theta(),
            max_position_embeddings=r.get("max_position_embeddings", int, 32768),
            tie_word_embeddings=r.get("tie_word_embeddings", bool, False),
            num_experts=num_experts,
            num_experts_per_tok=r.get("num_experts_per_tok", int, 0) if num_experts else 0,
            moe_intermediate_size=r.get("moe_intermediate_size", int, 0) if num_experts else 0,
            norm_topk_prob=r.get("norm_topk_prob", bool, False),
            decoder_sparse_step=r.get("decoder_sparse_step", int, 1),
            mlp_only_layers=tuple(r.get("mlp_only_layers", list, [])),
            shared_expert_intermediate_size=r.get("shared_expert_intermediate_size", int, 0),
            model_type=r.get("model_type", str, "qwen3"),
        )


TARGET_TYPES = ("qwen3", "qwen3_moe")


def target_config(folder: str | Path) -> DecoderConfig:
    cfg = read_config(folder)
    source = f"{Path(folder) / 'config.json'}"
    model_type = cfg.get("model_type")
    if model_type not in TARGET_TYPES:
        raise CheckpointError(
            f"{source}: model_type {model_type!r} is not a supported target "
            f"(allowed: {', '.join(TARGET_TYPES)})"
        )
    return DecoderConfig.from_hf(cfg, source)


@dataclass(frozen=True)
class DFlashConfig:
    """A z-lab DFlash drafter (`DFlashDraftModel`) or a DFlash2 drafter (`DFlash2DraftModel`)."""

    decoder: DecoderConfig
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    target_hidden_size: int
    version: int = 1  # 2: DFlash2 (grouped dynamic convs + candidate selector)
    conv_groups: int = 0
    selector_dim: int = 0
    num_candidates: int = 16

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str) -> "DFlashConfig":
        archs = cfg.get("architectures") or []
        if "DFlashDraftModel" in archs:
            version = 1
        elif "DFlash2DraftModel" in archs:
            version = 2
        else:
            raise CheckpointError(
                f"{source}: architectures {archs!r} name no DFlash drafter "
                "(allowed: DFlashDraftModel, DFlash2DraftModel)"
            )
        r = _Reader(cfg, source)
        dcfg = cfg.get("dflash_config")
        if not isinstance(dcfg, dict):
            raise CheckpointError(f"{source}: required key `dflash_config` is missing")
        d = _Reader(dcfg, f"{source} dflash_config")
        decoder = DecoderConfig.from_hf(cfg, source)
        layer_ids = tuple(d.get("target_layer_ids", list))
        if not layer_ids or not all(isinstance(i, int) and i >= 0 for i in layer_ids):
            raise CheckpointError(f"{source}: dflash_config.target_layer_ids must be layer ids")
        n_target = r.get("num_target_layers", int, None)
        if n_target is not None and max(layer_ids) >= n_target:
            raise CheckpointError(
                f"{source}: target_layer_ids {list(layer_ids)} exceed num_target_layers {n_target}"
            )
        block = r.get("block_size", int)
        if block < 2:
            raise CheckpointError(f"{source}: block_size must be at least 2, got {block}")
        return cls(
            decoder=decoder,
            block_size=block,
            target_layer_ids=layer_ids,
            mask_token_id=d.get("mask_token_id", int),
            target_hidden_size=r.get("target_hidden_size", int, decoder.hidden_size),
            version=version,
            conv_groups=d.get("conv_groups", int, 0) if version == 2 else 0,
            selector_dim=d.get("selector_dim", int, 0) if version == 2 else 0,
            num_candidates=d.get("num_candidates", int, 16),
        )


MTP_NAMINGS = ("qwen3_next", "deepseek")


@dataclass(frozen=True)
class MTPConfig:
    """One MTP head. `naming` says which checkpoint layout it came from (DESIGN.md)."""

    decoder: DecoderConfig
    naming: str  # qwen3_next: `mtp.*`; deepseek: `model.layers.{N}.*`
    layer_index: int = 0  # N for the deepseek naming
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def zero_centred_norm(self) -> bool:
        """Qwen3-Next norms compute x̂·(1+w); DeepSeek/GLM norms x̂·w."""
        return self.naming == "qwen3_next"

    @property
    def ffn_kind(self) -> str:
        return "moe" if self.decoder.is_moe else "dense"
