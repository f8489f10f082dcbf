"""The target model against transformers' own Qwen3 / Qwen3-MoE (the oracle), fp32 on CPU."""

import pytest
import torch

from metrale.runtime.models.layers import pack_for_inference
from metrale.runtime.models.loader import load_target

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rope_theta=10000.0,
              tie_word_embeddings=False)


def _save(tmp_path, moe: bool):
    torch.manual_seed(0)
    if moe:
        cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24,
                                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**COMMON, intermediate_size=48)
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1 so they are actually exercised
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.eval().save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_logits_match_transformers(tmp_path, moe):
    ref = _save(tmp_path, moe)
    ours = load_target(tmp_path)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids, output_hidden_states=True)
        got = ours(ids, taps=(2, 0, 1))
    assert (got.logits - want.logits).abs().max().item() <= 1e-4
    # taps: layer id l is transformers' hidden_states[l+1], in the order asked for; for the
    # last layer (l = 2 of 3) that entry is after the final norm
    assert len(want.hidden_states) == 4
    expect_taps = torch.cat([want.hidden_states[3], want.hidden_states[1], want.hidden_states[2]], dim=-1)
    assert (got.taps - expect_taps).abs().max().item() <= 1e-5
    # ...and not the pre-norm output of the last layer, which is what last_hidden carries
    assert (got.taps[..., :32] - got.last_hidden).abs().max().item() > 1e-2


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_kv_cache_decode_matches_full_forward(tmp_path, moe):
    _save(tmp_path, moe)
    model = load_target(tmp_path)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(1, 16)
        parts = [model(ids[:, :5], cache).logits]
        parts += [model(ids[:, i:i + 1], cache).logits for i in range(5, 9)]
    assert cache.length == 9
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-5


def test_shipped_tiny_target_matches_transformers(tiny_recipe):
    """The embedded tiny checkpoint itself, read by transformers from its own files."""
    path = tiny_recipe.target.checkpoint
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_target(path)
    assert type(ref).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.randint(0, ours.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (ours(ids).logits - ref(ids).logits).abs().max().item()
    assert diff <= 1e-4


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_packed_inference_path_matches_transformers(tmp_path, moe):
    """Fused q/k/v and gate/up, stacked experts (fixed op count) against transformers, prefill
    and KV-cached decode; the packed model keeps the checkpoint's state_dict."""
    ref = _save(tmp_path, moe)
    model = load_target(tmp_path)
    keys = set(model.state_dict())
    pack_for_inference(model)
    assert set(model.state_dict()) == keys
    assert model.model.layers[0].self_attn.qkv_weight is not None
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    if moe:
        mlp = model.model.layers[0].mlp
        assert mlp.experts_gate_up.shape == (4 * 2 * 24, 32)
        # one copy of the expert weights: the modules' weights are views of the stacked ones
        assert mlp.experts[3].up_proj.weight.untyped_storage().data_ptr() == \
            mlp.experts_gate_up.untyped_storage().data_ptr()
        assert mlp.experts[3].down_proj.weight.untyped_storage().data_ptr() == \
            mlp.experts_down.untyped_storage().data_ptr()
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(ids).logits
        cache = model.new_cache(1, 16)
        parts = [model(ids[:, :7], cache).logits] + [model(ids[:, i:i + 1], cache).logits
                                                     for i in range(7, 12)]
    assert (torch.cat(parts, dim=1) - want).abs().max().item() <= 1e-4
