"""DFlash / DFlash2 drafters (metrale.runtime.models.dflash): context injection worked out by hand,
the cached propose path against the masked training path, the stacked context K/V projection,
DFlash2's dynamic conv and candidate selector on hand-built examples."""

import pytest
import torch
from torch import nn

from metrale.runtime.models.configs import DecoderConfig, DFlashConfig
from metrale.runtime.models.dflash import CandidateSelector, DFlashDrafter, DynamicConv
from metrale.runtime.models.layers import RMSNorm

MASK = 9
THETA = 10000.0


def make_config(version: int = 1, *, hidden: int = 4, heads: int = 1, kv_heads: int = 1,
                layers: int = 1, vocab: int = 10, target_hidden: int = 4,
                block: int = 4) -> DFlashConfig:
    decoder = DecoderConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=4,
                            intermediate_size=2 * hidden, rms_norm_eps=1e-6, rope_theta=THETA,
                            max_position_embeddings=64)
    return DFlashConfig(decoder=decoder, block_size=block, target_layer_ids=(0, 1),
                        mask_token_id=MASK, target_hidden_size=target_hidden, version=version,
                        conv_groups=2 if version == 2 else 0, selector_dim=3 if version == 2 else 0)


def randomize(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for sub in module.modules():
            for name, p in sub.named_parameters(recurse=False):
                if isinstance(sub, RMSNorm):  # near 1, so the norms are exercised but tame
                    p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(0.4 * torch.randn(p.shape, generator=g))


# -- context injection by hand ----------------------------------------------------------------

def hat(v: torch.Tensor) -> torch.Tensor:
    """x̂ = x / rms(x) over the last dim (eps 1e-6 is below the tolerance)."""
    return v / v.pow(2).mean(-1, keepdim=True).sqrt()


def rope4(v: torch.Tensor, pos: int) -> torch.Tensor:
    """Rotate-half RoPE for head dim 4: pairs (0, 2) at frequency 1, (1, 3) at θ^(−1/2)."""
    ang = pos * torch.tensor([1.0, THETA ** -0.5])
    c, s = ang.cos(), ang.sin()
    return torch.cat([v[:2] * c - v[2:] * s, v[2:] * c + v[:2] * s])


def test_propose_attends_to_context_and_whole_block():
    """1 layer, hand weights: q = x̂, k = x̂·P (a permutation), v = D·x̂ (D diagonal), o = I,
    FFN 0, LM head ±one-hot rows. Context: c = hidden_norm(fc(taps)) with fc = [I | I]."""
    cfg = make_config()
    drafter = DFlashDrafter(cfg).eval()
    layer = drafter.layers[0]
    a = layer.self_attn
    perm = torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]])
    diag = torch.diag(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    lm = torch.zeros(10, 4)
    lm[:4], lm[4:8] = torch.eye(4), -torch.eye(4)  # token i: +dim i; token 4+i: −dim i
    embed = nn.Embedding(10, 4)
    with torch.no_grad():
        for sub in drafter.modules():
            if isinstance(sub, (RMSNorm, nn.Linear)):
                sub.weight.fill_(1.0 if isinstance(sub, RMSNorm) else 0.0)
        drafter.fc.weight.copy_(torch.cat([torch.eye(4), torch.eye(4)], dim=1))
        a.q_proj.weight.copy_(torch.eye(4))
        a.k_proj.weight.copy_(perm)
        a.v_proj.weight.copy_(diag)
        a.o_proj.weight.copy_(torch.eye(4))
        drafter.lm_head.weight.copy_(lm)
        embed.weight.zero_()
        embed.weight[3] = torch.tensor([1.0, 2.0, 0.0, -1.0])
        embed.weight[5] = torch.tensor([0.0, -1.0, 3.0, 1.0])
        embed.weight[MASK] = torch.tensor([0.5, -0.5, 1.5, 0.25])

    # context: 3 accepted positions (0, 1, 2) of two taps each, per sequence
    feats = torch.tensor([
        [[1.0, 0, 2, 0, 0, 1, 0, -1], [0, 3, 0, 1, 2, 0, 0, 0], [-1, 1, 1, 1, 0, 0, 2, 0]],
        [[0.0, 0, 1, 0, 1, 0, 0, 0], [2, 2, -2, 0, 0, 0, 0, 1], [0, 1, 0, 0, 0, -3, 0, 1]],
    ])
    cache = drafter.new_cache(2, 16, torch.float32)
    drafter.add_context(feats, cache)
    assert cache.length == 3  # the anchor sits at position 3

    captured = []
    hook = a.o_proj.register_forward_pre_hook(lambda mod, args: captured.append(args[0]))
    anchor = torch.tensor([3, 5])
    with torch.no_grad():
        proposal = drafter.propose(anchor, embed, cache, gamma=4)
    hook.remove()
    assert cache.length == 3  # a propose keeps no block K/V

    got_attn = captured[0]  # [B, γ, nh·hd]
    for b in range(2):
        ctx = [hat(feats[b, i, :4] + feats[b, i, 4:]) for i in range(3)]
        x = [embed.weight[int(t)] for t in (anchor[b], MASK, MASK, MASK)]  # slot 0 = anchor
        keys = [rope4(hat(perm @ c), i) for i, c in enumerate(ctx)]
        keys += [rope4(hat(perm @ hat(xj)), 3 + j) for j, xj in enumerate(x)]
        values = [diag @ c for c in ctx] + [diag @ hat(xj) for xj in x]
        k, v = torch.stack(keys), torch.stack(values)  # [3 + 4, 4]
        want_logits = []
        for j, xj in enumerate(x):
            q = rope4(hat(xj), 3 + j)
            p = torch.softmax(k @ q / 2.0, dim=0)  # every slot sees all 3 + 4 keys
            attn = p @ v
            assert torch.allclose(got_attn[b, j], attn, atol=1e-5), (b, j)
            want_logits.append(lm @ hat(xj + attn))  # o = I, FFN 0, final norm x̂
        want = torch.stack(want_logits)[1:]  # drafts are slots 1..γ−1
        assert torch.allclose(proposal.logits[b], want, atol=1e-5)
        assert proposal.tokens[b].tolist() == want.argmax(-1).tolist()
    assert proposal.tokens.shape == (2, 3)


# -- cached propose path == masked training path ---------------------------------------------

@pytest.mark.parametrize("version", [1, 2])
def test_add_context_then_block_equals_forward_train(version):
    cfg = make_config(version, hidden=8, heads=2, kv_heads=1, layers=2, vocab=16, target_hidden=6)
    drafter = DFlashDrafter(cfg).eval()
    randomize(drafter, 10 + version)
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(2, 8, 12, generator=g)  # [B, L, n·Ht], positions 0..7
    anchors = [2, 5]
    blocks = torch.randn(2, 2 * 4, 8, generator=g)  # two blocks of 4 slots
    with torch.no_grad():
        train_h, train_logits = drafter.forward_train(feats, blocks, anchors)
        for i, anchor in enumerate(anchors):
            cache = drafter.new_cache(2, 16, torch.float32)
            drafter.add_context(feats[:, :1], cache)  # context fed in two pieces
            drafter.add_context(feats[:, 1:anchor], cache)
            assert cache.length == anchor
            h, logits = drafter.forward_block(blocks[:, 4 * i:4 * i + 4], cache)
            assert cache.length == anchor
            assert (h - train_h[:, 4 * i:4 * i + 4]).abs().max().item() <= 1e-5
            assert (logits - train_logits[:, 4 * i:4 * i + 4]).abs().max().item() <= 1e-5
        # a rolled-back cache (stale entries past its length) reads only positions < length
        cache = drafter.new_cache(2, 16, torch.float32)
        drafter.add_context(feats[:, :anchors[0] + 2], cache)
        cache.length = anchors[0]
        h_rolled, _ = drafter.forward_block(blocks[:, :4], cache)
        # and the context matters: without it the first block comes out different
        h_bare, _ = drafter.forward_block(blocks[:, :4], drafter.new_cache(2, 16, torch.float32))
    assert (h_rolled - train_h[:, :4]).abs().max().item() <= 1e-5
    assert (h_bare - train_h[:, :4]).abs().max().item() > 1e-3


def test_stacked_context_kv_projection_matches_per_layer():
    cfg = make_config(hidden=8, heads=2, kv_heads=2, layers=2, vocab=16, target_hidden=6)
    drafter = DFlashDrafter(cfg).eval()
    randomize(drafter, 20)
    w = drafter.stacked_context_kv_weight()
    width = 2 * 4  # nkv·hd
    assert w.shape == (2 * 2 * width, 8)  # [L·2·nkv·hd, H]
    for i, layer in enumerate(drafter.layers):  # layer by layer, k rows then v rows
        assert torch.equal(w[2 * i * width:(2 * i + 1) * width], layer.self_attn.k_proj.weight)
        assert torch.equal(w[(2 * i + 1) * width:(2 * i + 2) * width], layer.self_attn.v_proj.weight)

    g = torch.Generator().manual_seed(5)
    feats = torch.randn(1, 5, 12, generator=g)
    block = torch.randn(1, 4, 8, generator=g)
    positions = torch.arange(5)
    with torch.no_grad():
        per_layer = drafter.context_kv(feats, positions)
        cache = drafter.new_cache(1, 16, torch.float32)
        drafter.add_context(feats, cache)
        want_h, _ = drafter.forward_block(block, cache)

        stacked = nn.Linear(8, w.shape[0], bias=False)
        stacked.weight.copy_(w)
        drafter.context_kv_proj = stacked
        fused = drafter.context_kv(feats, positions)
        cache = drafter.new_cache(1, 16, torch.float32)
        drafter.add_context(feats, cache)
        got_h, _ = drafter.forward_block(block, cache)
    for (k0, v0), (k1, v1) in zip(per_layer, fused):
        assert k0.shape == (1, 2, 5, 4)
        assert torch.allclose(k0, k1, atol=1e-6) and torch.allclose(v0, v1, atol=1e-6)
    assert not torch.allclose(per_layer[0][0], per_layer[1][0])  # layers really differ
    assert torch.allclose(want_h, got_h, atol=1e-6)


def test_gamma_below_block_size_feeds_a_shorter_block():
    cfg = make_config(hidden=8, heads=2, layers=2, vocab=16, target_hidden=6, block=4)
    drafter = DFlashDrafter(cfg).eval()
    randomize(drafter, 30)
    embed = nn.Embedding(16, 8)
    randomize(embed, 31)
    g = torch.Generator().manual_seed(6)
    cache = drafter.new_cache(2, 16, torch.float32)
    drafter.add_context(torch.randn(2, 3, 12, generator=g), cache)
    anchor = torch.tensor([1, 7])
    with torch.no_grad():
        short = drafter.propose(anchor, embed, cache, gamma=3)
        full = drafter.propose(anchor, embed, cache, gamma=4)
        ids = torch.tensor([[1, MASK, MASK], [7, MASK, MASK]])  # [anchor, MASK×(γ−1)]
        _, want = drafter.forward_block(embed(ids), cache)
    assert short.tokens.shape == (2, 2) and short.logits.shape == (2, 2, 16)
    assert full.tokens.shape == (2, 3)
    assert torch.allclose(short.logits, want[:, 1:], atol=1e-6)
    assert short.tokens.tolist() == want[:, 1:].argmax(-1).tolist()
    # non-causal block: the extra MASK slot of γ = 4 changes the earlier slots' logits
    assert (short.logits - full.logits[:, :2]).abs().max().item() > 1e-4


# -- DFlash2: dynamic conv ----------------------------------------------------------------------

def test_dynamic_conv_static_kernel_two_blocks():
    conv = DynamicConv(4, 2)  # group 0 = channels 0, 1; group 1 = channels 2, 3
    with torch.no_grad():
        conv.base_kernel.copy_(torch.tensor([[1.0, 0.5], [2.0, -1.0]]))  # (k0, k1) per group
        conv.kernel_projection.weight.zero_()
    x = torch.tensor([[[1.0, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12],  # block 0
                       [-1, -2, -3, -4], [0, 1, 0, 1], [2, 2, 2, 2]]])  # block 1
    with torch.no_grad():
        y = conv(x, block=3)
    # y[t] = k0·x[t] + k1·x[t−1] per group; x[t−1] = 0 at each block's slot 0
    want = torch.tensor([[[1.0, 2, 6, 8],  # slot 0: no predecessor
                          [5 + 0.5, 6 + 1, 14 - 3, 16 - 4],
                          [9 + 2.5, 10 + 3, 22 - 7, 24 - 8],
                          [-1, -2, -6, -8],  # block 1 slot 0: nothing from block 0's t=2
                          [0 - 0.5, 1 - 1, 0 + 3, 2 + 4],
                          [2 + 0, 2 + 0.5, 4 - 0, 4 - 1]]])
    assert torch.allclose(y, want)


def test_dynamic_conv_kernel_depends_on_the_slot():
    conv = DynamicConv(4, 2)
    with torch.no_grad():
        conv.base_kernel.copy_(torch.tensor([[1.0, 0.5], [2.0, -1.0]]))
        proj = torch.zeros(4, 4)  # rows: (g0,k0), (g0,k1), (g1,k0), (g1,k1)
        proj[0, 0] = 0.5  # g0's k0 += 0.5·x[t][0]
        proj[3, 3] = 0.25  # g1's k1 += 0.25·x[t][3]
        conv.kernel_projection.weight.copy_(proj)
    x = torch.tensor([[[2.0, 0, 0, 4], [1, 3, 2, 2]]])
    with torch.no_grad():
        y = conv(x, block=2)
    # t0: k = g0 (1 + 0.5·2, 0.5) = (2, 0.5), g1 (2, −1 + 0.25·4) = (2, 0)
    #     y0 = [2·2, 2·0, 2·0, 2·4]
    # t1: k = g0 (1 + 0.5·1, 0.5) = (1.5, 0.5), g1 (2, −1 + 0.25·2) = (2, −0.5)
    #     y1 = [1.5·1 + 0.5·2, 1.5·3 + 0.5·0, 2·2 − 0.5·0, 2·2 − 0.5·4]
    want = torch.tensor([[[4.0, 0, 0, 8], [2.5, 4.5, 4, 2]]])
    assert torch.allclose(y, want)


# -- DFlash2: candidate selector ----------------------------------------------------------------

def test_candidate_selector_rescoring_changes_the_choice():
    sel = CandidateSelector(hidden=2, vocab=20, dim=2, num_candidates=16)
    with torch.no_grad():
        sel.hidden_projection.weight.copy_(torch.eye(2))
        sel.predecessor_codebook.zero_()
        sel.successor_codebook.zero_()
        sel.predecessor_codebook[1] = torch.tensor([1.0, 0.0])
        sel.predecessor_codebook[6] = torch.tensor([0.0, 1.0])
        sel.successor_codebook[6] = torch.tensor([1.0, 0.0])
        sel.successor_codebook[8] = torch.tensor([0.0, 0.5])
    base = 0.01 * torch.arange(20.0) - 5.0  # low filler logits
    logits = base.repeat(2, 3, 1)  # [B, 3 slots, V]
    logits[:, 0, 5], logits[:, 0, 6] = 3.0, 2.5
    logits[:, 1, 7], logits[:, 1, 8] = 4.0, 3.8
    logits[:, 2, 8], logits[:, 2, 9] = 2.0, 1.2
    hidden = torch.zeros(2, 3, 2)
    hidden[:, 2] = torch.tensor([0.0, -2.0])
    with torch.no_grad():
        tokens = sel.select(hidden, logits, torch.tensor([1, 0]))
    # sequence 0, anchor 1:
    #   slot 1: z = pred[1] = [1,0]; 5 -> 3.0, 6 -> 2.5 + <z, succ[6]> = 3.5          => 6
    #   slot 2: z = pred[6] = [0,1]; 7 -> 4.0, 8 -> 3.8 + 0.5 = 4.3                    => 8
    #   slot 3: z = [0,-2] + pred[8] = [0,-2]; 8 -> 2.0 − 1.0 = 1.0, 9 -> 1.2           => 9
    # sequence 1, anchor 0 (pred[0] = 0): 5, then pred[5] = 0 so 7, then 8 -> 1.0 vs 9 -> 1.2
    assert tokens.tolist() == [[6, 8, 9], [5, 7, 9]]
    assert logits.argmax(-1).tolist() == [[5, 7, 8], [5, 7, 8]]  # plain argmax differs


@pytest.mark.parametrize("k, want", [(16, 4), (17, 3)])
def test_candidate_selector_only_rescores_the_top_k(k, want):
    sel = CandidateSelector(hidden=2, vocab=20, dim=2, num_candidates=k)
    with torch.no_grad():
        sel.hidden_projection.weight.zero_()
        sel.predecessor_codebook.zero_()
        sel.successor_codebook.zero_()
        sel.predecessor_codebook[0] = torch.tensor([1.0, 0.0])
        sel.successor_codebook[3] = torch.tensor([100.0, 0.0])  # logit rank 17
        sel.successor_codebook[4] = torch.tensor([5.0, 0.0])  # logit rank 16
    logits = 0.1 * torch.arange(20.0).view(1, 1, 20)  # top-16 = tokens 4..19
    with torch.no_grad():
        tokens = sel.select(torch.zeros(1, 1, 2), logits, torch.tensor([0]))
    # K = 16: token 3 is no candidate; 4 scores 0.4 + 5 = 5.4 > 1.9 (token 19). K = 17: 3 wins.
    assert tokens.tolist() == [[want]]


def test_dflash2_propose_selects_left_to_right_from_the_anchor():
    cfg = make_config(2, hidden=8, heads=2, layers=1, vocab=16, target_hidden=6)
    drafter = DFlashDrafter(cfg).eval()
    randomize(drafter, 40)
    embed = nn.Embedding(16, 8)
    randomize(embed, 41)
    sel = drafter.candidate_selector
    with torch.no_grad():
        sel.hidden_projection.weight.zero_()
        sel.predecessor_codebook.zero_()
        sel.successor_codebook.zero_()
        sel.predecessor_codebook[4] = torch.tensor([1.0, 0.0, 0.0])  # the anchor
        sel.predecessor_codebook[7] = torch.tensor([0.0, 1.0, 0.0])
        sel.predecessor_codebook[2] = torch.tensor([1.0, 0.0, 0.0])
        sel.successor_codebook[7] = torch.tensor([50.0, 0.0, 0.0])
        sel.successor_codebook[2] = torch.tensor([0.0, 50.0, 0.0])
    cache = drafter.new_cache(1, 16, torch.float32)
    drafter.add_context(torch.randn(1, 2, 12, generator=torch.Generator().manual_seed(7)), cache)
    with torch.no_grad():
        proposal = drafter.propose(torch.tensor([4]), embed, cache, gamma=4)
    # vocab 16 = K: every token is a candidate and the ±50 bonuses dwarf the logits.
    # anchor 4 -> z = [1,0,0] -> 7; prev 7 -> z = [0,1,0] -> 2; prev 2 -> z = [1,0,0] -> 7
    assert proposal.tokens.tolist() == [[7, 2, 7]]
    assert proposal.logits.abs().max().item() < 20
