"""Strict checkpoint loading (metrale.runtime.models.loader) on tiny checkpoints written here.

Tensor names are spelled out as the Hugging Face layouts spell them (not derived from the
modules), so a rename that drifts from the real layouts fails here.
"""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from metrale.runtime.errors import CheckpointError
from metrale.runtime.models.loader import load_dflash, load_mtp, load_target

H, NH, NKV, HD, INTER, V = 8, 2, 1, 4, 12, 12
E, MOE_INTER = 3, 4

ATTN = {  # per decoder layer, relative to the layer prefix
    "input_layernorm.weight": [H],
    "post_attention_layernorm.weight": [H],
    "self_attn.q_proj.weight": [NH * HD, H],
    "self_attn.k_proj.weight": [NKV * HD, H],
    "self_attn.v_proj.weight": [NKV * HD, H],
    "self_attn.o_proj.weight": [H, NH * HD],
    "self_attn.q_norm.weight": [HD],
    "self_attn.k_norm.weight": [HD],
}
DENSE_MLP = {"mlp.gate_proj.weight": [INTER, H], "mlp.up_proj.weight": [INTER, H],
             "mlp.down_proj.weight": [H, INTER]}


def expert(prefix: str, inter: int) -> dict:
    return {f"{prefix}.gate_proj.weight": [inter, H], f"{prefix}.up_proj.weight": [inter, H],
            f"{prefix}.down_proj.weight": [H, inter]}


def moe_mlp(shared: str) -> dict:
    out = {"mlp.gate.weight": [E, H]}
    for e in range(E):
        out |= expert(f"mlp.experts.{e}", MOE_INTER)
    return out | expert(f"mlp.{shared}", MOE_INTER)


DECODER_CFG = {
    "vocab_size": V, "hidden_size": H, "num_attention_heads": NH, "num_key_value_heads": NKV,
    "head_dim": HD, "intermediate_size": INTER, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 64, "tie_word_embeddings": False,
}
# what transformers 5 writes for a Qwen3Config (rope under rope_parameters)
TARGET_CFG = DECODER_CFG | {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 2,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "hidden_act": "silu",
    "attention_bias": False, "torch_dtype": "float32", "transformers_version": "5.24.0",
}
QWEN3_NEXT_CFG = DECODER_CFG | {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_hidden_layers": 2,
    "rope_theta": 10000.0, "num_experts": E, "num_experts_per_tok": 2,
    "moe_intermediate_size": MOE_INTER, "shared_expert_intermediate_size": MOE_INTER,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
}
GLM_CFG = DECODER_CFG | {  # DeepSeek/GLM naming: the MTP layer is model.layers.{num_hidden_layers}
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "num_hidden_layers": 2,
    "rope_theta": 10000.0, "n_routed_experts": E, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "moe_intermediate_size": MOE_INTER, "norm_topk_prob": True, "num_nextn_predict_layers": 1,
}
ZLAB_CFG = DECODER_CFG | {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_hidden_layers": 1,
    "rope_theta": 10000.0, "block_size": 4, "num_target_layers": 3,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "dflash_config": {"mask_token_id": 11, "target_layer_ids": [0, 2]},
}


def target_shapes(layers: int = 2) -> dict:
    out = {"model.embed_tokens.weight": [V, H], "model.norm.weight": [H], "lm_head.weight": [V, H]}
    for i in range(layers):
        out |= {f"model.layers.{i}.{k}": s for k, s in (ATTN | DENSE_MLP).items()}
    return out


def qwen3_next_mtp_shapes() -> dict:
    out = {"mtp.fc.weight": [H, 2 * H], "mtp.pre_fc_norm_embedding.weight": [H],
           "mtp.pre_fc_norm_hidden.weight": [H], "mtp.norm.weight": [H],
           "mtp.layers.0.mlp.shared_expert_gate.weight": [1, H]}
    return out | {f"mtp.layers.0.{k}": s for k, s in (ATTN | moe_mlp("shared_expert")).items()}


def deepseek_mtp_shapes(n: int = 2) -> dict:
    p = f"model.layers.{n}"
    out = {f"{p}.eh_proj.weight": [H, 2 * H], f"{p}.enorm.weight": [H], f"{p}.hnorm.weight": [H],
           f"{p}.shared_head.norm.weight": [H], f"{p}.shared_head.head.weight": [V, H],
           f"{p}.embed_tokens.weight": [V, H]}
    return out | {f"{p}.{k}": s for k, s in (ATTN | moe_mlp("shared_experts")).items()}


def dflash_shapes(version: int = 1) -> dict:
    out = {"fc.weight": [H, 2 * H], "hidden_norm.weight": [H], "norm.weight": [H]}
    out |= {f"layers.0.{k}": s for k, s in (ATTN | DENSE_MLP).items()}
    if version == 2:
        for conv in ("attention_conv", "mlp_conv"):
            out |= {f"layers.0.{conv}.base_kernel": [2, 2],
                    f"layers.0.{conv}.kernel_projection.weight": [4, H]}
        out |= {"candidate_selector.predecessor_codebook": [V, 3],
                "candidate_selector.successor_codebook": [V, 3],
                "candidate_selector.hidden_projection.weight": [3, H]}
    return out


def random_tensors(shapes: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {name: 0.3 * torch.randn(shape, generator=g) for name, shape in shapes.items()}


def write(folder, config: dict, tensors: dict, shards: int = 1):
    """config.json plus the tensors split over `shards` safetensors files."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    for s in range(shards):
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(folder / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"))
    return folder


# -- round trips --------------------------------------------------------------------------------

def test_target_round_trip_loads_every_tensor(tmp_path):
    tensors = random_tensors(target_shapes(), 0)
    model = load_target(write(tmp_path, TARGET_CFG, tensors, shards=2))
    state = model.state_dict()
    assert set(state) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(state[name], t), name
    assert model.config.rope_theta == 500000.0  # transformers 5's rope_parameters spelling
    assert model.config.num_key_value_heads == NKV


def test_tied_target_takes_lm_head_from_embeddings(tmp_path):
    tensors = random_tensors(target_shapes(), 1)
    del tensors["lm_head.weight"]
    model = load_target(write(tmp_path, TARGET_CFG | {"tie_word_embeddings": True}, tensors))
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_qwen3_next_mtp_round_trip(tmp_path):
    tensors = random_tensors(qwen3_next_mtp_shapes(), 2)
    lm_head = torch.randn(V, H)
    head = load_mtp(write(tmp_path, QWEN3_NEXT_CFG, tensors), lm_head)
    assert head.config.naming == "qwen3_next" and head.config.zero_centred_norm
    state = head.state_dict()
    assert len(state) == len(tensors) + 1  # + the draft LM head, the target's copy
    assert torch.equal(state["lm_head.weight"], lm_head)
    for name, t in tensors.items():
        module_name = name.replace("mtp.layers.0.", "layer.").replace("mtp.", "")
        assert torch.equal(state[module_name], t), name


def test_deepseek_mtp_round_trip(tmp_path):
    tensors = random_tensors(deepseek_mtp_shapes(), 3)
    head = load_mtp(write(tmp_path, GLM_CFG, tensors), torch.randn(V, H))
    assert head.config.naming == "deepseek" and head.config.layer_index == 2
    assert not head.config.zero_centred_norm
    assert head.layer.mlp.shared_expert_gate is None
    renames = {"eh_proj.": "fc.", "enorm.": "pre_fc_norm_embedding.",
               "hnorm.": "pre_fc_norm_hidden.", "shared_head.norm.": "norm.",
               "shared_head.head.": "lm_head.", "mlp.shared_experts.": "layer.mlp.shared_expert."}
    state = head.state_dict()
    assert len(state) == len(tensors) - 1  # the layer's embed_tokens copy is dropped
    for name, t in tensors.items():
        rest = name[len("model.layers.2."):]
        if rest.startswith("embed_tokens."):
            continue
        src = next((s for s in renames if rest.startswith(s)), None)
        module_name = renames[src] + rest[len(src):] if src else "layer." + rest
        assert torch.equal(state[module_name], t), name


@pytest.mark.parametrize("version", [1, 2])
def test_dflash_round_trip(tmp_path, version):
    tensors = random_tensors(dflash_shapes(version), 4)
    cfg = ZLAB_CFG
    if version == 2:
        cfg = cfg | {"architectures": ["DFlash2DraftModel"],
                     "dflash_config": cfg["dflash_config"] | {"conv_groups": 2, "selector_dim": 3}}
    lm_head = torch.randn(V, H)
    drafter = load_dflash(write(tmp_path, cfg, tensors), lm_head)
    c = drafter.config
    assert (c.version, c.block_size, c.target_layer_ids, c.mask_token_id) == (version, 4, (0, 2), 11)
    state = drafter.state_dict()
    assert set(state) == set(tensors) | {"lm_head.weight"}
    assert torch.equal(state["lm_head.weight"], lm_head)
    for name, t in tensors.items():
        assert torch.equal(state[name], t), name


def test_both_mtp_namings_give_the_same_head(tmp_path):
    """The same head written in both namings: DeepSeek norms hold 1 + w where Qwen3-Next's
    zero-centred norms hold w, and the DeepSeek shared expert (no gate) has its down
    projection halved where the Qwen3-Next gate is 0 (sigmoid 0 = 1/2)."""
    qn = random_tensors(qwen3_next_mtp_shapes(), 5)
    qn["mtp.layers.0.mlp.shared_expert_gate.weight"].zero_()
    lm_head = torch.randn(V, H)
    ds = {"model.layers.2.shared_head.head.weight": lm_head.clone(),
          "model.layers.2.embed_tokens.weight": torch.randn(V, H)}
    top = {"mtp.fc.": "eh_proj.", "mtp.pre_fc_norm_embedding.": "enorm.",
           "mtp.pre_fc_norm_hidden.": "hnorm.", "mtp.norm.": "shared_head.norm."}
    for name, t in qn.items():
        if name.endswith("shared_expert_gate.weight"):
            continue
        src = next((s for s in top if name.startswith(s)), None)
        rest = top[src] + name[len(src):] if src else name[len("mtp.layers.0."):]
        rest = rest.replace("mlp.shared_expert.", "mlp.shared_experts.")
        if "norm" in rest:
            t = 1.0 + t
        if rest == "mlp.shared_experts.down_proj.weight":
            t = 0.5 * t
        ds[f"model.layers.2.{rest}"] = t
    a = load_mtp(write(tmp_path / "qwen3_next", QWEN3_NEXT_CFG, qn), lm_head)
    b = load_mtp(write(tmp_path / "deepseek", GLM_CFG, ds), lm_head)
    assert type(a) is type(b)
    assert torch.equal(a.fc.weight, b.fc.weight)
    assert torch.equal(a.layer.mlp.experts[1].up_proj.weight, b.layer.mlp.experts[1].up_proj.weight)
    g = torch.Generator().manual_seed(6)
    embeds, hidden = torch.randn(2, 4, H, generator=g), torch.randn(2, 4, H, generator=g)
    with torch.no_grad():
        la, ha = a(embeds, hidden)
        lb, hb = b(embeds, hidden)
    assert (la - lb).abs().max().item() <= 1e-5
    assert (ha - hb).abs().max().item() <= 1e-5


# -- refusals -----------------------------------------------------------------------------------

def _target(tmp_path, tensors, cfg=TARGET_CFG):
    return load_target(write(tmp_path, cfg, tensors))


def _qwen3_next(tmp_path, tensors, cfg=QWEN3_NEXT_CFG):
    return load_mtp(write(tmp_path, cfg, tensors), torch.zeros(V, H))


def _deepseek(tmp_path, tensors, cfg=GLM_CFG):
    return load_mtp(write(tmp_path, cfg, tensors), torch.zeros(V, H))


def _dflash(tmp_path, tensors, cfg=ZLAB_CFG):
    return load_dflash(write(tmp_path, cfg, tensors), torch.zeros(V, H))


KINDS = {
    "target": (target_shapes, _target),
    "qwen3_next": (qwen3_next_mtp_shapes, _qwen3_next),
    "deepseek": (deepseek_mtp_shapes, _deepseek),
    "dflash": (dflash_shapes, _dflash),
}


@pytest.mark.parametrize("kind, name", [
    ("target", "model.layers.1.mlp.down_proj.weight"),
    ("target", "model.norm.weight"),
    ("qwen3_next", "mtp.layers.0.mlp.experts.1.up_proj.weight"),
    ("qwen3_next", "mtp.pre_fc_norm_hidden.weight"),
    ("deepseek", "model.layers.2.mlp.shared_experts.down_proj.weight"),
    ("deepseek", "model.layers.2.enorm.weight"),
    ("dflash", "hidden_norm.weight"),
    ("dflash", "layers.0.self_attn.k_norm.weight"),
])
def test_missing_tensor_is_refused_by_its_checkpoint_name(tmp_path, kind, name):
    shapes, load = KINDS[kind]
    tensors = random_tensors(shapes(), 7)
    del tensors[name]
    with pytest.raises(CheckpointError, match=rf"missing tensor {re.escape(name)}$"):
        load(tmp_path, tensors)


@pytest.mark.parametrize("kind, name", [
    ("target", "model.layers.2.mlp.down_proj.weight"),
    ("qwen3_next", "mtp.layers.0.mlp.experts.3.up_proj.weight"),
    ("qwen3_next", "model.layers.0.mlp.gate.weight"),
    ("deepseek", "model.layers.2.mlp.experts.3.gate_proj.weight"),
    ("dflash", "layers.1.mlp.up_proj.weight"),
    ("dflash", "lm_head.weight"),  # drafters share the target's LM head
])
def test_extra_tensor_is_refused_by_name(tmp_path, kind, name):
    shapes, load = KINDS[kind]
    tensors = random_tensors(shapes(), 8)
    tensors[name] = torch.zeros(V, H)
    with pytest.raises(CheckpointError, match=rf"unexpected tensor {re.escape(name)}\b"):
        load(tmp_path, tensors)


@pytest.mark.parametrize("kind, name, shape, want", [
    ("target", "model.layers.0.self_attn.k_proj.weight", [5, H], [4, 8]),
    ("qwen3_next", "mtp.fc.weight", [H, H], [8, 16]),
    ("deepseek", "model.layers.2.eh_proj.weight", [H, 2 * H - 1], [8, 16]),
    ("deepseek", "model.layers.2.mlp.gate.weight", [E + 1, H], [3, 8]),
    ("dflash", "fc.weight", [H, 3 * H], [8, 16]),  # one target layer too many
])
def test_misshaped_tensor_is_refused_with_both_shapes(tmp_path, kind, name, shape, want):
    shapes, load = KINDS[kind]
    tensors = random_tensors(shapes(), 9)
    tensors[name] = torch.zeros(shape)
    msg = rf"tensor {re.escape(name)} has shape {re.escape(str(shape))}, expected {re.escape(str(want))}"
    with pytest.raises(CheckpointError, match=msg):
        load(tmp_path, tensors)


@pytest.mark.parametrize("kind, cfg, pattern", [
    ("dflash", ZLAB_CFG | {"architectures": ["Qwen3ForCausalLM"]},
     r"config\.json: architectures \['Qwen3ForCausalLM'\] name no DFlash drafter"),
    ("dflash", {k: v for k, v in ZLAB_CFG.items() if k != "dflash_config"},
     r"config\.json: required key `dflash_config` is missing"),
    ("dflash", ZLAB_CFG | {"dflash_config": {"target_layer_ids": [0, 2]}},
     r"config\.json dflash_config: required key `mask_token_id` is missing"),
    ("dflash", ZLAB_CFG | {"dflash_config": {"mask_token_id": 11, "target_layer_ids": [0, 3]}},
     r"config\.json: target_layer_ids \[0, 3\] exceed num_target_layers 3"),
    ("dflash", ZLAB_CFG | {"block_size": 1}, r"config\.json: block_size must be at least 2"),
    ("target", TARGET_CFG | {"model_type": "llama"},
     r"config\.json: model_type 'llama' is not a supported target"),
    ("target", TARGET_CFG | {"hidden_size": "8"}, r"config\.json: key `hidden_size` must be int"),
    ("target", TARGET_CFG | {"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn"}},
     r"config\.json: rope_type 'yarn' is not supported"),
])
def test_bad_config_is_refused_naming_file_and_key(tmp_path, kind, cfg, pattern):
    shapes, load = KINDS[kind]
    with pytest.raises(CheckpointError, match=pattern):
        load(tmp_path, random_tensors(shapes(), 10), cfg)


def test_missing_files_are_refused_by_name(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        load_target(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(TARGET_CFG))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors file found"):
        load_target(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no MTP head found"):
        load_mtp(write(tmp_path / "no_mtp", GLM_CFG, random_tensors(target_shapes(), 11)),
                 torch.zeros(V, H))
