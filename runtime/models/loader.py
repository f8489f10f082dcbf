"""Strict loading of Hugging Face checkpoints (config.json + safetensors) into metrale's models.

Every tensor in the checkpoint is consumed and every parameter is filled; a missing, unexpected
or mis-shaped tensor is refused with its checkpoint name. All renames between checkpoint names
and module names live in `RENAMES` (one ordered prefix table per layout). The draft LM heads of
the MTP head and the drafters are copies of the target's LM head unless the checkpoint has its own
(`shared_head.head` in the DeepSeek naming).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from metrale.runtime.models.configs import (
    DFLASH_ARCHITECTURES, DecoderConfig, DFlashConfig, MTPConfig, check_token_ids, read_config,
    target_config,
)
from metrale.runtime.models.dflash import DFlashDrafter
from metrale.runtime.errors import CheckpointError
from metrale.runtime.models.mtp import MTPHead
from metrale.runtime.models.qwen3 import Qwen3ForCausalLM

# Checkpoint prefix -> module prefix, first match wins. `None` drops a tensor after consuming it
# (a copy of a tensor the target already holds). `{N}` is the MTP layer index.
RENAMES: dict[str, list[tuple[str, str | None]]] = {
    "target": [],
    "dflash": [],
    "mtp.qwen3_next": [
        ("mtp.layers.0.", "layer."),
        ("mtp.", ""),
    ],
    "mtp.deepseek": [
        ("model.layers.{N}.embed_tokens.", None),
        ("model.layers.{N}.eh_proj.", "fc."),
        ("model.layers.{N}.enorm.", "pre_fc_norm_embedding."),
        ("model.layers.{N}.hnorm.", "pre_fc_norm_hidden."),
        ("model.layers.{N}.shared_head.norm.", "norm."),
        ("model.layers.{N}.shared_head.head.", "lm_head."),
        ("model.layers.{N}.mlp.shared_experts.", "layer.mlp.shared_expert."),
        ("model.layers.{N}.", "layer."),
    ],
}


# Tensors whose values are used as they are (never requantized): half or full precision only.
_FULL_PRECISION = (torch.float32, torch.float16, torch.bfloat16)
_PLAIN_ROLES = re.compile(r"(^|\.)(embed_tokens|lm_head|head|[a-z_]*norm|gate)\.weight$|bias$")


def check_tensor(name: str, t: torch.Tensor, where: str) -> None:
    """Refuse a tensor no metrale model can hold: not floating point, a low-precision dtype in
    a role that is never requantized (embeddings, LM heads, norms, routers, biases), or values
    that are NaN or infinite."""
    if not t.dtype.is_floating_point:
        raise CheckpointError(f"{where}: tensor {name} is {t.dtype}; weights must be floating "
                              "point (float32, float16, bfloat16, or FP8 for quantized linears)")
    if _PLAIN_ROLES.search(name) and t.dtype not in _FULL_PRECISION:
        raise CheckpointError(f"{where}: tensor {name} is {t.dtype}; this role needs float32, "
                              "float16 or bfloat16")
    if t.numel() and not bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all()):
        raise CheckpointError(f"{where}: tensor {name} holds NaN or infinite values")


def read_safetensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's *.safetensors files, each checked (`check_tensor`);
    an unreadable file is refused naming it."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint {folder}: no *.safetensors file found")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        where, names = f"checkpoint {folder}: {f.name}", []
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    if name in tensors:
                        raise CheckpointError(f"checkpoint {folder}: tensor {name} appears twice ({f.name})")
                    tensors[name] = handle.get_tensor(name)
                    names.append(name)
        except CheckpointError:
            raise
        except Exception as exc:  # SafetensorError, OSError, a dtype torch lacks: all unreadable
            raise CheckpointError(f"{where} cannot be read as safetensors ({exc})") from None
        for name in names:
            check_tensor(name, tensors[name], where)
    return tensors


def rename(tensors: dict[str, torch.Tensor], layout: str, n: int = 0) -> tuple[dict, dict]:
    """-> (module-named tensors, module name -> checkpoint name)."""
    table = [(src.replace("{N}", str(n)), dst) for src, dst in RENAMES[layout]]
    out, origin = {}, {}
    for name, t in tensors.items():
        new = name
        for src, dst in table:
            if name.startswith(src):
                new = None if dst is None else dst + name[len(src):]
                break
        if new is not None:
            out[new], origin[new] = t, name
    return out, origin


def checkpoint_name(name: str, layout: str, n: int = 0) -> str:
    """The checkpoint name that `rename` turns into module name `name` (for error messages)."""
    for src, dst in RENAMES[layout]:
        if dst is not None and name.startswith(dst):
            candidate = src.replace("{N}", str(n)) + name[len(dst):]
            if name in rename({candidate: None}, layout, n)[0]:
                return candidate
    return name


def strict_fill(module: nn.Module, tensors: dict[str, torch.Tensor], source: str,
                origin: dict[str, str] | None = None, dtype: torch.dtype | None = None) -> None:
    """Copy `tensors` into `module`'s parameters and buffers; refuse any mismatch by name."""
    expected = module.state_dict()
    check_tensors(expected, tensors, source, origin)
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(tensors[name].to(param.dtype))
    if dtype is not None:
        module.to(dtype)


def check_tensors(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], source: str,
                  origin: dict[str, str] | None = None) -> None:
    """Refuse a checkpoint whose tensors' names or shapes are not `expected`'s, naming the first
    that differs (`expected` may be a meta-device model's state: nothing allocated yet)."""
    origin = origin or {}
    for name in tensors:
        if name not in expected:
            raise CheckpointError(
                f"{source}: unexpected tensor {origin.get(name, name)} (the model has no {name})"
            )
    for name, param in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{source}: missing tensor {origin.get(name, name)}")
        t = tensors[name]
        if tuple(t.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{source}: tensor {origin.get(name, name)} has shape {list(t.shape)}, "
                f"expected {list(param.shape)}"
            )


def check_counts(cfg: DecoderConfig, tensors: dict, source: str, layered: bool = True,
                 routed: bool = True) -> None:
    """A config asking for more layers (`layered`: a model of `num_hidden_layers` layers, not
    an MTP head's one) or experts (`routed`: a model whose layers build them, not a DFlash
    drafter's) than the tensors hold is refused before a model of that many modules is built,
    even on the meta device (fewer: the tensors left over are named by `strict_fill`). Layers
    and experts are counted by their tensors' names (`layers.N.`, `experts.N.`), whatever comes
    before them."""
    layers, experts = set(), set()
    for name in tensors:
        if m := re.search(r"(?:^|\.)layers\.(\d+)\.", name):
            layers.add(int(m.group(1)))
        if m := re.search(r"(?:^|\.)experts\.(\d+)\.", name):
            experts.add(int(m.group(1)))
    if layered and cfg.num_hidden_layers > len(layers):
        raise CheckpointError(f"{source}: missing tensors of layer {len(layers)}: config num_hidden_layers "
                              f"is {cfg.num_hidden_layers}, the tensors hold {len(layers)} layers")
    moe = routed and (cfg.is_moe if not layered else
                      any(cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers)))
    if moe and cfg.num_experts > len(experts):
        raise CheckpointError(f"{source}: missing tensors of expert {len(experts)}: config num_experts is "
                              f"{cfg.num_experts}, the tensors hold {len(experts)} experts per layer")


def _drop_tied(tensors: dict, cfg: DecoderConfig) -> dict:
    if cfg.tie_word_embeddings:
        tensors = dict(tensors)
        tensors.setdefault("lm_head.weight", tensors.get("model.embed_tokens.weight"))
    return tensors


def load_target(folder: str | Path, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    cfg = target_config(folder)
    tensors, source = _drop_tied(read_safetensors(folder), cfg), f"checkpoint {folder}"
    check_counts(cfg, tensors, source)
    with torch.device("meta"):  # the config's sizes are checked against the tensors before any
        model = Qwen3ForCausalLM(cfg).to(dtype)  # allocation (num_experts 10**6: 200 GB)
    check_tensors(model.state_dict(), tensors, source)
    model = model.to_empty(device="cpu")
    strict_fill(model, tensors, source)
    return model.eval()


def mtp_layout(tensors: dict[str, torch.Tensor], source: str) -> tuple[str, int]:
    """Which MTP naming a checkpoint uses: ('qwen3_next', 0) or ('deepseek', N)."""
    if any(k.startswith("mtp.") for k in tensors):
        return "qwen3_next", 0
    layers = {int(m.group(1)) for k in tensors if (m := re.match(r"model\.layers\.(\d+)\.eh_proj\.", k))}
    if len(layers) == 1:
        return "deepseek", layers.pop()
    raise CheckpointError(
        f"{source}: no MTP head found (expected `mtp.*` tensors, Qwen3-Next naming, or one "
        "`model.layers.N.eh_proj` layer, DeepSeek/GLM naming)"
    )


def mtp_config(folder: str | Path, naming: str, layer_index: int) -> MTPConfig:
    raw = dict(read_config(folder))
    source = f"{Path(folder) / 'config.json'}"
    archs = raw.get("architectures")
    if isinstance(archs, list) and any(a in DFLASH_ARCHITECTURES for a in archs):
        raise CheckpointError(f"{source}: architectures {archs!r} name a DFlash drafter, not a "
                              "model with an MTP head")
    shared, inter = raw.get("n_shared_experts"), raw.get("moe_intermediate_size", 0)
    if shared is not None and "shared_expert_intermediate_size" not in raw:
        if type(shared) is not int or type(inter) is not int or shared < 0:
            raise CheckpointError(f"{source}: keys `n_shared_experts` and `moe_intermediate_size` "
                                  f"must be counts, got {shared!r} and {inter!r}")
        raw["shared_expert_intermediate_size"] = shared * inter
    decoder = DecoderConfig.from_hf(raw, source)
    check_token_ids(raw, source, decoder.vocab_size)
    return MTPConfig(decoder=decoder, naming=naming, layer_index=layer_index)


def load_mtp(folder: str | Path, target_lm_head: torch.Tensor,
             dtype: torch.dtype = torch.float32) -> MTPHead:
    source = f"checkpoint {folder}"
    raw = read_safetensors(folder)
    naming, n = mtp_layout(raw, source)
    cfg = mtp_config(folder, naming, n)
    tensors, origin = rename(raw, f"mtp.{naming}", n)
    tensors.setdefault("lm_head.weight", target_lm_head)
    check_counts(cfg.decoder, tensors, source, layered=False)
    head = MTPHead(cfg).to(dtype)
    for name in head.state_dict():  # a missing tensor is reported by its checkpoint name
        if name not in tensors:
            origin[name] = checkpoint_name(name, f"mtp.{naming}", n)
    strict_fill(head, tensors, source, origin)
    return head.eval()


def load_dflash(folder: str | Path, target_lm_head: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    source = f"checkpoint {folder}"
    cfg = DFlashConfig.from_hf(read_config(folder), f"{Path(folder) / 'config.json'}")
    tensors = dict(read_safetensors(folder))
    if "lm_head.weight" in tensors:
        raise CheckpointError(f"{source}: unexpected tensor lm_head.weight (DFlash drafters share the target's)")
    tensors["lm_head.weight"] = target_lm_head
    check_counts(cfg.decoder, tensors, source, routed=False)
    drafter = DFlashDrafter(cfg).to(dtype)
    strict_fill(drafter, tensors, source)
    return drafter.eval()
