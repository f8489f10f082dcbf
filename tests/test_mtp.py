"""The MTP head (metrale.runtime.models.mtp) on tiny hand-set weights, expectations worked out inline.

Hidden size 4, one head of dim 4, vocab 10. Norm inputs are chosen so that x̂ = x/rms(x) is a
vector of small integers; "unit" norm weights are 0 for the zero-centred Qwen3-Next norms
(x̂·(1+w)) and 1 for the DeepSeek ones (x̂·w).
"""

import math

import pytest
import torch

from metrale.runtime.models.configs import DecoderConfig, MTPConfig
from metrale.runtime.models.layers import RMSNorm
from metrale.runtime.models.mtp import MTPHead

NAMINGS = ("qwen3_next", "deepseek")


def make_head(naming: str, **decoder_overrides) -> MTPHead:
    base = dict(vocab_size=10, hidden_size=4, num_hidden_layers=1, num_attention_heads=1,
                num_key_value_heads=1, head_dim=4, intermediate_size=4, rms_norm_eps=1e-6,
                rope_theta=10000.0, max_position_embeddings=64)
    base.update(decoder_overrides)
    return MTPHead(MTPConfig(decoder=DecoderConfig(**base), naming=naming)).eval()


def unit(naming: str) -> float:
    """The norm weight that leaves x̂ unscaled in this naming."""
    return 0.0 if naming == "qwen3_next" else 1.0


def zero_everything(head: MTPHead, naming: str) -> None:
    """All projections 0 and all norms unit-scaled; tests then set the weights they exercise."""
    with torch.no_grad():
        for module in head.modules():
            if isinstance(module, (RMSNorm, torch.nn.Linear)):
                module.weight.fill_(unit(naming) if isinstance(module, RMSNorm) else 0.0)


def silu(v: float) -> float:
    return v / (1.0 + math.exp(-v))


@pytest.mark.parametrize("naming", NAMINGS)
def test_embedding_first_in_concat_and_norm_conventions(naming):
    head = make_head(naming)
    zero_everything(head, naming)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # attention and FFN live but contribute 0 (o_proj and down_proj are 0)
        for lin in (head.layer.self_attn.q_proj, head.layer.self_attn.k_proj,
                    head.layer.self_attn.v_proj, head.layer.mlp.gate_proj, head.layer.mlp.up_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))
        head.pre_fc_norm_embedding.weight.copy_(torch.tensor([1.0, 0.0, 1.0, 0.0]))
        head.pre_fc_norm_hidden.weight.copy_(torch.tensor([0.0, 1.0, 0.0, 1.0]))
        # fc [H, 2H] = [I | 2I]: x = norm_e(e) + 2·norm_h(h); swapping the halves gives 2·ne + nh
        head.fc.weight.copy_(torch.cat([torch.eye(4), 2 * torch.eye(4)], dim=1))
        head.norm.weight.fill_(1.0)  # zero-centred: 2·x̂; plain: x̂
        lm = torch.zeros(10, 4)
        lm[:4] = torch.eye(4)
        lm[4] = torch.tensor([1.0, 1.0, 0.0, 0.0])
        lm[5] = torch.tensor([0.0, -1.0, 0.0, 2.0])
        head.lm_head.weight.copy_(lm)

    embeds = torch.tensor([[[2.0, -2.0, 2.0, -2.0]]])  # x̂ = [1, -1, 1, -1]
    hidden = torch.tensor([[[3.0, 3.0, -3.0, -3.0]]])  # x̂ = [1, 1, -1, -1]
    with torch.no_grad():
        logits, h = head(embeds, hidden)

    if naming == "qwen3_next":
        # ne = [1,-1,1,-1]·(1+[1,0,1,0]) = [2,-1,2,-1]; nh = [1,1,-1,-1]·(1+[0,1,0,1]) = [1,2,-1,-2]
        # x = ne + 2·nh = [4, 3, 0, -5]   (swapped: 2·ne + nh = [5, 0, 3, -4])
        want_h = torch.tensor([4.0, 3.0, 0.0, -5.0])
        final = 2.0 * want_h / math.sqrt(50 / 4)  # x̂·(1+1)
    else:
        # ne = [1,-1,1,-1]·[1,0,1,0] = [1,0,1,0]; nh = [1,1,-1,-1]·[0,1,0,1] = [0,1,0,-1]
        # x = [1, 2, 1, -2]   (swapped: [2, 1, 2, -1])
        want_h = torch.tensor([1.0, 2.0, 1.0, -2.0])
        final = want_h / math.sqrt(10 / 4)  # x̂·1
    # h is the pre-norm output (what a chain feeds back): x + 0 + 0
    assert torch.allclose(h[0, 0], want_h, atol=1e-5)
    want_logits = torch.zeros(10)
    want_logits[:4] = final
    want_logits[4] = final[0] + final[1]
    want_logits[5] = -final[1] + 2 * final[3]
    assert torch.allclose(logits[0, 0], want_logits, atol=1e-5)


@pytest.mark.parametrize("naming", NAMINGS)
def test_lone_token_attention_is_o_of_v(naming):
    """One token at position 0: RoPE is the identity and softmax over one key is 1, so the
    attention output is o_proj(v_proj(ln1(x))) whatever q and k are."""
    head = make_head(naming)
    zero_everything(head, naming)
    g = torch.Generator().manual_seed(1)
    a = head.layer.self_attn
    with torch.no_grad():
        a.q_proj.weight.copy_(torch.randn(4, 4, generator=g))
        a.k_proj.weight.copy_(torch.randn(4, 4, generator=g))
        head.fc.weight[0, 0] = 1.0  # x = [ne[0], 0, 0, 0]
        # ln1 scales x̂ by 3: zero-centred w = 2, plain w = 3
        head.layer.input_layernorm.weight.fill_(2.0 if naming == "qwen3_next" else 3.0)
        a.v_proj.weight[:, 0] = torch.tensor([0.5, 1.0, 0.0, -1.0])
        a.o_proj.weight.copy_(torch.tensor([[0.0, 0.0, 0.0, 0.0],
                                            [1.0, 0.0, 0.0, 0.0],
                                            [0.0, 1.0, 0.0, 0.0],
                                            [0.0, 0.0, 0.0, 1.0]]))
    embeds = torch.tensor([[[2.0, 0.0, 0.0, 0.0]]])  # x̂ = [2,0,0,0] -> x = [2, 0, 0, 0]
    with torch.no_grad():
        _, h = head(embeds, torch.ones(1, 1, 4))
    # ln1(x) = 3·[2,0,0,0] = [6,0,0,0]; v = 6·[0.5, 1, 0, -1] = [3, 6, 0, -6]
    # o(v) = [0, 3, 6, -6]; h = x + o(v) (FFN is 0)
    assert torch.allclose(h[0, 0], torch.tensor([2.0, 3.0, 6.0, -6.0]), atol=1e-5)


@pytest.mark.parametrize("norm_topk", [True, False], ids=["renorm", "no_renorm"])
@pytest.mark.parametrize("naming", NAMINGS)
def test_moe_ffn_routing_and_shared_expert(naming, norm_topk):
    head = make_head(naming, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=1,
                     norm_topk_prob=norm_topk, shared_expert_intermediate_size=1)
    moe = head.layer.mlp
    # the DeepSeek naming's shared expert has no gate at all
    assert (moe.shared_expert_gate is None) == (naming == "deepseek")
    zero_everything(head, naming)
    with torch.no_grad():
        head.fc.weight[0, 0] = 1.0  # x = [2, 0, 0, 0], so ln2(x) = u = [2, 0, 0, 0]
        # router logits = 2·col0 = [0, ln2, ln5] -> softmax [1, 2, 5]/8 -> top-2: experts 2, 1
        moe.gate.weight[:, 0] = torch.tensor([0.0, math.log(2) / 2, math.log(5) / 2])
        for e, expert in enumerate(moe.experts):
            expert.gate_proj.weight[0, 0] = 0.5  # gate·u = 1
            expert.up_proj.weight[0, 0] = (e + 1) / 2  # up·u = e+1
            expert.down_proj.weight[e + 1, 0] = 1.0  # expert e writes dim e+1
        moe.shared_expert.gate_proj.weight[0, 0] = 0.5
        moe.shared_expert.up_proj.weight[0, 0] = 0.5
        moe.shared_expert.down_proj.weight[1, 0] = 1.0  # dim 1: the shared expert only
        if moe.shared_expert_gate is not None:
            moe.shared_expert_gate.weight[0, 0] = math.log(3) / 2  # sigmoid(ln 3) = 3/4
    embeds = torch.tensor([[[2.0, 0.0, 0.0, 0.0]]])
    with torch.no_grad():
        _, h = head(embeds, torch.ones(1, 1, 4))

    s = silu(1.0)
    w1, w2 = (2 / 7, 5 / 7) if norm_topk else (2 / 8, 5 / 8)  # renormalised over 7/8, or raw
    shared = (0.75 if naming == "qwen3_next" else 1.0) * s
    # expert 0 is not routed: dim 1 holds only the shared expert
    want = torch.tensor([2.0, shared, w1 * 2 * s, w2 * 3 * s])
    assert torch.allclose(h[0, 0], want, atol=1e-5)


def randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


@pytest.mark.parametrize("naming", NAMINGS)
def test_kv_cache_one_by_one_equals_all_at_once(naming):
    head = make_head(naming, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=4,
                     norm_topk_prob=True, shared_expert_intermediate_size=4,
                     num_attention_heads=2, hidden_size=8)
    randomize(head, 2)
    g = torch.Generator().manual_seed(3)
    embeds, hidden = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    with torch.no_grad():
        full_logits, full_h = head(embeds, hidden)
        cache = head.new_cache(2, 8, torch.float32)
        steps = [head(embeds[:, t:t + 1], hidden[:, t:t + 1], cache) for t in range(5)]
        assert cache.length == 5
        chunked = head.new_cache(2, 8, torch.float32)
        chunks = [head(embeds[:, :2], hidden[:, :2], chunked),
                  head(embeds[:, 2:], hidden[:, 2:], chunked)]
    for parts in (steps, chunks):
        logits = torch.cat([p[0] for p in parts], dim=1)
        h = torch.cat([p[1] for p in parts], dim=1)
        assert (logits - full_logits).abs().max().item() <= 1e-5
        assert (h - full_h).abs().max().item() <= 1e-5
    # the cache matters: the last token alone, without it, sees only itself
    with torch.no_grad():
        alone, _ = head(embeds[:, 4:], hidden[:, 4:], start=4)
    assert (alone - full_logits[:, 4:]).abs().max().item() > 1e-3
