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
    """A checkpoint's config.json as a dict; any way the file can be unusable names it."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"checkpoint {folder}: config.json not found")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint {folder}: config.json is not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"checkpoint {folder}: config.json must hold a JSON object, got "
                              f"{type(cfg).__name__}")
    return cfg


def check_architectures(cfg: dict[str, Any], source: str, allowed: tuple[str, ...],
                        what: str) -> None:
    """`architectures`, when present, must be a list naming one of `allowed`."""
    archs = cfg.get("architectures")
    if archs is None:
        return
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise CheckpointError(f"{source}: key `architectures` must be a list of names, got {archs!r}")
    if not any(a in allowed for a in archs):
        raise CheckpointError(f"{source}: architectures {archs!r} name no {what} "
                              f"(allowed: {', '.join(allowed)})")


SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def check_token_ids(cfg: dict[str, Any], source: str, vocab_size: int,
                    keys: tuple[str, ...] = SPECIAL_TOKEN_KEYS) -> None:
    """Special token ids (an id, a list of ids, or null) must lie in [0, vocab_size)."""
    for key in keys:
        value = cfg.get(key)
        ids = value if isinstance(value, list) else [] if value is None else [value]
        for i in ids:
            if type(i) is not int or not 0 <= i < vocab_size:
                raise CheckpointError(f"{source}: {key} {value!r} is not a token id of the "
                                      f"vocabulary (0 to {vocab_size - 1})")


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

    def count(self, key: str, default: Any = ..., *aliases: str, least: int = 1) -> int:
        """An integer key that counts something: at least `least`."""
        value = self.get(key, int, default, *aliases)
        if value is not None and value < least:
            raise CheckpointError(f"{self.source}: key `{key}` must be at least {least}, got {value}")
        return value

    def rope_theta(self) -> float:
        rope = self.cfg.get("rope_parameters") or {}
        if "rope_theta" in self.cfg and self.cfg["rope_theta"] is not None:
            return self._positive("rope_theta", self.cfg["rope_theta"])
        if isinstance(rope, dict) and "rope_theta" in rope:
            rope_type = rope.get("rope_type", "default")
            if rope_type != "default":
                raise CheckpointError(
                    f"{self.source}: rope_type {rope_type!r} is not supported (allowed: default)"
                )
            return self._positive("rope_parameters.rope_theta", rope["rope_theta"])
        return 10000.0

    def _positive(self, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise CheckpointError(f"{self.source}: key `{key}` must be a positive number, got {value!r}")
        return float(value)


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
        if self.is_moe and self.num_experts_per_tok > self.num_experts:
            raise CheckpointError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                                  f"num_experts ({self.num_experts})")
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
        hidden = r.count("hidden_size")
        heads = r.count("num_attention_heads")
        num_experts = r.count("num_experts", 0, "num_local_experts", "n_routed_experts", least=0)
        only = r.get("mlp_only_layers", list, [])
        if not all(type(i) is int and i >= 0 for i in only):
            raise CheckpointError(f"{source}: key `mlp_only_layers` must list layer ids, got {only!r}")
        eps = r.get("rms_norm_eps", float, 1e-6)
        if not 0 < eps < 1:
            raise CheckpointError(f"{source}: key `rms_norm_eps` must lie in (0, 1), got {eps!r}")
        try:
            return cls(
                vocab_size=r.count("vocab_size"),
                hidden_size=hidden,
                num_hidden_layers=r.count("num_hidden_layers"),
                num_attention_heads=heads,
                num_key_value_heads=r.count("num_key_value_heads", heads),
                head_dim=r.count("head_dim", max(1, hidden // heads)),
                intermediate_size=r.count("intermediate_size", 0, least=0),
                rms_norm_eps=eps,
                rope_theta=r.rope_theta(),
                max_position_embeddings=r.count("max_position_embeddings", 32768, least=2),
                tie_word_embeddings=r.get("tie_word_embeddings", bool, False),
                num_experts=num_experts,
                num_experts_per_tok=r.count("num_experts_per_tok", 0, least=1) if num_experts else 0,
                moe_intermediate_size=r.count("moe_intermediate_size", 0, least=1) if num_experts else 0,
                norm_topk_prob=r.get("norm_topk_prob", bool, False),
                decoder_sparse_step=r.count("decoder_sparse_step", 1),
                mlp_only_layers=tuple(only),
                shared_expert_intermediate_size=r.count("shared_expert_intermediate_size", 0, least=0),
                model_type=r.get("model_type", str, "qwen3"),
            )
        except CheckpointError as exc:  # __post_init__'s cross-key checks: name the file too
            if str(exc).startswith(source):
                raise
            raise CheckpointError(f"{source}: {exc}") from None


TARGET_TYPES = ("qwen3", "qwen3_moe")
TARGET_ARCHITECTURES = {"qwen3": ("Qwen3ForCausalLM",), "qwen3_moe": ("Qwen3MoeForCausalLM",)}
DFLASH_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


def target_config(folder: str | Path) -> DecoderConfig:
    cfg = read_config(folder)
    source = f"{Path(folder) / 'config.json'}"
    model_type = cfg.get("model_type")
    if model_type not in TARGET_TYPES:
        raise CheckpointError(
            f"{source}: model_type {model_type!r} is not a supported target "
            f"(allowed: {', '.join(TARGET_TYPES)})"
        )
    check_architectures(cfg, source, TARGET_ARCHITECTURES[model_type], f"{model_type} target")
    decoder = DecoderConfig.from_hf(cfg, source)
    check_token_ids(cfg, source, decoder.vocab_size)
    return decoder


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
        check_architectures(cfg, source, DFLASH_ARCHITECTURES, "DFlash drafter")
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
        check_token_ids(dcfg, f"{source} dflash_config", decoder.vocab_size, ("mask_token_id",))
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
        groups = d.count("conv_groups", 0) if version == 2 else 0
        if version == 2 and decoder.hidden_size % groups:
            raise CheckpointError(f"{source}: hidden_size {decoder.hidden_size} is not divisible "
                                  f"by dflash_config.conv_groups {groups}")
        return cls(
            decoder=decoder,
            block_size=block,
            target_layer_ids=layer_ids,
            mask_token_id=d.get("mask_token_id", int),
            target_hidden_size=r.count("target_hidden_size", decoder.hidden_size),
            version=version,
            conv_groups=groups,
            selector_dim=d.count("selector_dim", 0) if version == 2 else 0,
            num_candidates=d.count("num_candidates", 16),
        )


MTP_NAMINGS = ("qwen3_next", "deepseek")


@dataclass(frozen=True)
class MTPConfig:
    """One MTP head. `naming` says which checkpoint layout it came from (`loader.RENAMES`)."""

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
