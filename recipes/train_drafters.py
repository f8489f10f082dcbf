"""Distil the tiny target's greedy behaviour into an MTP head, a DFlash and a DFlash2 drafter.

Used by `train_tiny.py`. Labels are the target's own argmax at every position of sequences whose
continuations it produced greedily, which is exactly what a drafter must predict for greedy
speculative decoding to accept its drafts. With SOFT_LABELS > 0 the DFlash drafters also fit the
target's whole distribution there (a KL term of that weight; DFlash2's selector, the target's
distribution over its candidates): the argmax labels alone rank a drafter's first candidate,
while a draft tree also verifies its second and third, which then learn from the target's other
likely tokens.

MTP entry p pairs (embed(token_{p+1}), target hidden_p) and predicts token_{p+2}; the second
chain step feeds the head's own pre-norm output back. DFlash blocks anchor at a generated
position a and predict tokens a+1..a+B−1 from the target's tapped hidden states at positions < a.
"""

from __future__ import annotations

import math
import pathlib

import torch
import torch.nn.functional as F

from metrale.runtime.models.configs import DecoderConfig, DFlashConfig, MTPConfig
from metrale.runtime.models.dflash import DFlashDrafter
from metrale.runtime.models.mtp import MTPHead

PROMPT, GEN = 32, 96
BLOCK = 8
DRAFTER_STEPS = 2400
TAPS = (0, 1, 3)
SOFT_LABELS = 1.0  # weight of a KL to the target's distribution beside its argmax labels (--soft-labels)


def held_out_prompts(tok, docs: list[str], n: int) -> list[str]:
    """n prompts of ~PROMPT tokens from held-out documents, at deterministic offsets."""
    prompts, i = [], 0
    while len(prompts) < n and docs:
        ids = tok.encode(docs[i % len(docs)])
        if len(ids) > 4 * PROMPT:
            off = (len(prompts) * 977) % (len(ids) - 2 * PROMPT)
            prompts.append(tok.decode(ids[off:off + PROMPT]))
        i += 1
        if i > 50 * n:
            break
    return prompts


@torch.no_grad()
def greedy_sequences(target, prompts: torch.Tensor, gen: int) -> torch.Tensor:
    """prompts [N, P] -> [N, P+gen] with the target's greedy continuation (KV-cached, batched)."""
    out = []
    for chunk in prompts.split(128):
        cache = target.new_cache(chunk.shape[0], chunk.shape[1] + gen)
        logits = target(chunk, cache).logits[:, -1]
        seq = [chunk]
        for _ in range(gen):
            nxt = logits.argmax(-1, keepdim=True)
            seq.append(nxt)
            logits = target(nxt, cache).logits[:, -1]
        out.append(torch.cat(seq, dim=1))
    return torch.cat(out)


@torch.no_grad()
def distill_data(target, stream: torch.Tensor, n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - PROMPT, (n,), generator=g).tolist()
    ids = greedy_sequences(target, torch.stack([stream[s:s + PROMPT] for s in starts]), GEN)
    taps, hidden, greedy, logp = [], [], [], []
    for chunk in ids.split(128):
        o = target(chunk, taps=TAPS)
        taps.append(o.taps)
        hidden.append(o.last_hidden)
        greedy.append(o.logits.argmax(-1))
        if SOFT_LABELS:
            logp.append(o.logits.float().log_softmax(-1).to(torch.bfloat16))
    data = {"ids": ids, "taps": torch.cat(taps), "hidden": torch.cat(hidden), "greedy": torch.cat(greedy)}
    if SOFT_LABELS:
        data["logp"] = torch.cat(logp)
    return data


def _adamw(params, lr):
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, weight_decay=0.01,
                             betas=(0.9, 0.95))


def _cosine(opt, step, steps, peak):
    lr = peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
    for group in opt.param_groups:
        group["lr"] = lr


def optimizer_step(opt, module, loss, step: int, steps: int, log, what: str) -> None:
    """One clipped AdamW step, logged every 100 steps (shared by every training loop)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    if step % 100 == 0 or step == steps - 1:
        log(f"{what} step {step}/{steps} loss {loss.item():.3f}")


def _init(module):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 2 and "codebook" not in name:
                p.normal_(0.0, 0.02)


# -- MTP ---------------------------------------------------------------------------------------

def mtp_config(tcfg: DecoderConfig) -> MTPConfig:
    d = DecoderConfig(
        vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
        rms_norm_eps=1e-6, rope_theta=tcfg.rope_theta, max_position_embeddings=tcfg.max_position_embeddings,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
        shared_expert_intermediate_size=128, model_type="qwen3_next",
    )
    return MTPConfig(decoder=d, naming="qwen3_next")


def mtp_chain_logits(head, embed, ids, hidden, depth: int):
    """Teacher-forced chain: depth × logits [B, L−1−d, V] for entries p (token p+1, hidden p)."""
    outs, h = [], hidden[:, :-1]
    for d in range(depth):
        tokens = ids[:, 1 + d:]
        h = h[:, : tokens.shape[1]]
        logits, h = head(embed(tokens), h)
        outs.append(logits)
    return outs


def train_mtp(target, data, steps: int, log) -> MTPHead:
    torch.manual_seed(11)
    head = MTPHead(mtp_config(target.config))
    _init(head)
    head.lm_head.weight.data.copy_(target.lm_head.weight.data)
    head.lm_head.weight.requires_grad_(False)
    opt = _adamw(head.parameters(), 2e-3)
    g = torch.Generator().manual_seed(12)
    embed = target.model.embed_tokens
    for step in range(steps):
        _cosine(opt, step, steps, 2e-3)
        idx = torch.randint(0, data["ids"].shape[0], (16,), generator=g)
        ids, hidden, greedy = data["ids"][idx], data["hidden"][idx], data["greedy"][idx]
        loss = 0.0
        for d, logits in enumerate(mtp_chain_logits(head, embed, ids, hidden, 2)):
            labels = greedy[:, 1 + d: 1 + d + logits.shape[1]]  # target's prediction for p+2+d
            loss = loss + (0.5 ** d) * F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        optimizer_step(opt, head, loss, step, steps, log, "mtp")
    return head.eval()


def mtp_hf(head: MTPHead, tcfg: DecoderConfig):
    d = head.config.decoder
    state = {}
    for k, v in head.state_dict().items():
        if k.startswith("lm_head."):
            continue  # Qwen3-Next MTP heads share the target's LM head
        state[("mtp.layers.0." + k[len("layer."):]) if k.startswith("layer.") else "mtp." + k] = v
    config = {
        "architectures": ["Qwen3NextMTP"], "model_type": "qwen3_next_mtp", "mtp_num_hidden_layers": 1,
        "vocab_size": d.vocab_size, "hidden_size": d.hidden_size, "num_hidden_layers": 1,
        "num_attention_heads": d.num_attention_heads, "num_key_value_heads": d.num_key_value_heads,
        "head_dim": d.head_dim, "intermediate_size": d.intermediate_size, "num_experts": d.num_experts,
        "num_experts_per_tok": d.num_experts_per_tok, "moe_intermediate_size": d.moe_intermediate_size,
        "shared_expert_intermediate_size": d.shared_expert_intermediate_size,
        "norm_topk_prob": d.norm_topk_prob, "rms_norm_eps": d.rms_norm_eps, "rope_theta": d.rope_theta,
        "max_position_embeddings": d.max_position_embeddings, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "target_num_hidden_layers": tcfg.num_hidden_layers,
    }
    return state, config


# -- DFlash -------------------------------------------------------------------------------------

def dflash_config(tcfg: DecoderConfig, version: int, mask_id: int) -> DFlashConfig:
    d = DecoderConfig(
        vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
        rms_norm_eps=1e-6, rope_theta=tcfg.rope_theta, max_position_embeddings=tcfg.max_position_embeddings,
    )
    return DFlashConfig(decoder=d, block_size=BLOCK, target_layer_ids=TAPS, mask_token_id=mask_id,
                        target_hidden_size=tcfg.hidden_size, version=version,
                        conv_groups=8 if version == 2 else 0, selector_dim=32 if version == 2 else 0)


def dflash_batch(data, idx, anchors, mask_id):
    """-> (blocks [B, nb·Bs], labels [B, nb, Bs-1], the target's log-probabilities there
    [B, nb, Bs-1, V] where `data` keeps them, else None)."""
    ids, greedy = data["ids"][idx], data["greedy"][idx]
    a = torch.tensor(anchors)
    slots = a[:, None] + torch.arange(BLOCK)[None, :]  # [nb, Bs]
    block = ids[:, slots]  # [B, nb, Bs]
    block[:, :, 1:] = mask_id
    labels = greedy[:, slots[:, :-1]]  # [B, nb, Bs-1]: the target's prediction for slots 1..
    teacher = data["logp"][idx][:, slots[:, :-1]].float() if "logp" in data else None
    return block.reshape(len(idx), -1), labels, teacher


def train_dflash(target, data, version: int, mask_id: int, steps: int, log) -> DFlashDrafter:
    torch.manual_seed(20 + version)
    drafter = DFlashDrafter(dflash_config(target.config, version, mask_id))
    _init(drafter)
    drafter.lm_head.weight.data.copy_(target.lm_head.weight.data)
    drafter.lm_head.weight.requires_grad_(False)
    opt = _adamw(drafter.parameters(), 2e-3)
    g = torch.Generator().manual_seed(30 + version)
    embed = target.model.embed_tokens
    weights = torch.exp(-torch.arange(BLOCK - 1) / 4.0)  # later slots matter less (they are reached less)
    length = data["ids"].shape[1]
    for step in range(steps):
        _cosine(opt, step, steps, 2e-3)
        idx = torch.randint(0, data["ids"].shape[0], (16,), generator=g)
        anchors = sorted(torch.randint(PROMPT - 1, length - BLOCK, (8,), generator=g).tolist())
        block, labels, teacher = dflash_batch(data, idx, anchors, mask_id)
        hidden, logits = drafter.forward_train(data["taps"][idx], embed(block), anchors)
        b = len(idx)
        logits = logits.view(b, len(anchors), BLOCK, -1)[:, :, 1:]  # [B, nb, Bs-1, V]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        loss = (ce.view(b, len(anchors), BLOCK - 1) * weights).mean()
        if teacher is not None:
            kl = F.kl_div(logits.float().log_softmax(-1), teacher, log_target=True, reduction="none").sum(-1)
            loss = loss + SOFT_LABELS * (kl * weights).mean()
        if version == 2:
            loss = loss + selector_loss(drafter, hidden.view(b, len(anchors), BLOCK, -1)[:, :, 1:],
                                        logits, labels, block.view(b, len(anchors), BLOCK)[:, :, 0],
                                        teacher)
        optimizer_step(opt, drafter, loss, step, steps, log, f"dflash{version if version > 1 else ''}")
    return drafter.eval()


def selector_loss(drafter, hidden, logits, labels, anchor, teacher=None):
    """Cross-entropy over the top-K candidates, teacher-forced predecessors; slots whose label
    is not among the candidates are skipped. With `teacher` (the target's log-probabilities per
    slot), plus SOFT_LABELS × the cross-entropy to the target's distribution over the candidates."""
    sel = drafter.candidate_selector
    cand_logits, cand_ids = logits.detach().topk(sel.num_candidates, dim=-1)  # [B, nb, n, K]
    prev = torch.cat([anchor[..., None], labels[..., :-1]], dim=-1)  # [B, nb, n]
    scores = sel.scores(hidden, cand_ids, cand_logits, prev)
    hit = cand_ids == labels[..., None]
    valid = hit.any(-1)
    loss = F.cross_entropy(scores[valid], hit[valid].float().argmax(-1)) if valid.any() else scores.sum() * 0.0
    if teacher is not None:
        soft = teacher.gather(-1, cand_ids).softmax(-1)  # the target's, renormalised over the K
        loss = loss - SOFT_LABELS * (soft * scores.log_softmax(-1)).sum(-1).mean()
    return loss


def dflash_hf(drafter: DFlashDrafter, tcfg: DecoderConfig):
    cfg, d = drafter.config, drafter.config.decoder
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("lm_head.")}
    dcfg = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}
    if cfg.version == 2:
        dcfg.update(conv_groups=cfg.conv_groups, selector_dim=cfg.selector_dim, num_candidates=cfg.num_candidates)
    config = {
        "architectures": ["DFlashDraftModel" if cfg.version == 1 else "DFlash2DraftModel"],
        "model_type": "qwen3", "block_size": cfg.block_size, "num_target_layers": tcfg.num_hidden_layers,
        "dflash_config": dcfg, "vocab_size": d.vocab_size, "hidden_size": d.hidden_size,
        "num_hidden_layers": d.num_hidden_layers, "num_attention_heads": d.num_attention_heads,
        "num_key_value_heads": d.num_key_value_heads, "head_dim": d.head_dim,
        "intermediate_size": d.intermediate_size, "rms_norm_eps": d.rms_norm_eps, "rope_theta": d.rope_theta,
        "max_position_embeddings": d.max_position_embeddings, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    return state, config


# -- evaluation on held-out prompts ----------------------------------------------------------------

@torch.no_grad()
def agreement(target, tok, prompts, mtp, drafters) -> dict:
    """Greedy agreement with the target on held-out prompts, teacher-forced on its greedy text:
    MTP depth-1/2 top-1 agreement, and per drafter the mean accepted drafts per block (γ = B)."""
    rows = [torch.tensor(tok.encode(p)[:PROMPT]) for p in prompts]
    rows = [r for r in rows if r.numel() == PROMPT]
    if not rows:
        return {}
    data = distill_data_from(target, torch.stack(rows))
    embed = target.model.embed_tokens
    out = {"heldout_prompts": len(rows)}
    gen = slice(PROMPT - 1, None)
    for d, logits in enumerate(mtp_chain_logits(mtp, embed, data["ids"], data["hidden"], 2)):
        labels = data["greedy"][:, 1 + d: 1 + d + logits.shape[1]]
        agree = (logits.argmax(-1) == labels)[:, gen].float().mean().item()
        out[f"mtp_depth{d + 1}_agreement"] = round(agree, 4)
    for name, drafter in drafters.items():
        length = data["ids"].shape[1]
        anchors = list(range(PROMPT - 1, length - BLOCK, 4))
        block, labels, _ = dflash_batch(data, torch.arange(len(rows)), anchors, drafter.config.mask_token_id)
        hidden, logits = drafter.forward_train(data["taps"], embed(block), anchors)
        b = len(rows)
        hidden = hidden.view(b, len(anchors), BLOCK, -1)[:, :, 1:]
        logits = logits.view(b, len(anchors), BLOCK, -1)[:, :, 1:]
        if drafter.config.version == 2:
            anchor_tok = block.view(b, len(anchors), BLOCK)[:, :, 0].reshape(-1)
            drafts = drafter.candidate_selector.select(hidden.reshape(-1, BLOCK - 1, hidden.shape[-1]),
                                                       logits.reshape(-1, BLOCK - 1, logits.shape[-1]), anchor_tok)
            drafts = drafts.view(b, len(anchors), BLOCK - 1)
        else:
            drafts = logits.argmax(-1)
        match = (drafts == labels).long().cumprod(-1)  # accepted prefix
        out[f"{name}_first_draft_agreement"] = round((drafts[..., 0] == labels[..., 0]).float().mean().item(), 4)
        out[f"{name}_mean_accepted_per_block"] = round(match.sum(-1).float().mean().item(), 4)
    return out


@torch.no_grad()
def distill_data_from(target, prompts):
    ids = greedy_sequences(target, prompts, GEN)
    o = target(ids, taps=TAPS)
    return {"ids": ids, "taps": o.taps, "hidden": o.last_hidden, "greedy": o.logits.argmax(-1)}


def train_all(target, tok, stream, out: pathlib.Path, prompts, *, quick: bool, log,
              mtp: MTPHead | None = None) -> dict:
    """Distillation data, then the MTP head (unless `mtp`, an already trained one, is given) and
    both drafters; saves them under `out` and returns the training report."""
    from train_tiny import save_hf

    import time

    target.requires_grad_(False)
    mask_id = tok.mask_token_id
    t0 = time.time()
    data = distill_data(target, stream, 16 if quick else 1024, seed=7)
    log(f"distillation data: {tuple(data['ids'].shape)} ({time.time() - t0:.0f}s)")
    steps = 4 if quick else 800
    report = {}
    if mtp is None:
        t0 = time.time()
        mtp = train_mtp(target, data, steps, log)
        report["mtp_train_s"] = round(time.time() - t0, 1)
        save_hf(out / "mtp", *mtp_hf(mtp, target.config))
    drafters = {}
    for version, name in ((1, "dflash"), (2, "dflash2")):
        t0 = time.time()
        drafters[name] = train_dflash(target, data, version, mask_id, DRAFTER_STEPS if not quick else 4, log)
        report[f"{name}_train_s"] = round(time.time() - t0, 1)
        save_hf(out / name, *dflash_hf(drafters[name], target.config))
    for m in (mtp, *drafters.values()):  # evaluate what is shipped: bf16-rounded weights
        for p in m.parameters():
            p.data.copy_(p.data.to(torch.bfloat16).float())
    report.update(agreement(target, tok, prompts, mtp, drafters))
    report["drafter_steps"] = DRAFTER_STEPS if not quick else 4
    return report
