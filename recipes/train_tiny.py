"""Train the embedded tiny default: tokenizer, Qwen3-MoE target, MTP head, DFlash and DFlash2 drafters.

    python recipes/train_tiny.py [--out recipes/tiny] [--quick]
    python recipes/train_tiny.py --drafters-only --threads 1   # the DFlash drafters again, as shipped

Seeded and reproducible on one machine (fixed seeds, fixed thread count, sorted inputs); about
20-30 minutes on 2 CPU cores (the drafters alone, on one thread: about 8). The drafters read the target's taps
as transformers numbers them (the last layer's after the final norm) and train for 2,400 steps
each: at 800 steps on those taps they drafted worse than the earlier ones did. The text is what ships with CPython, so nothing is downloaded: the
language reference (`pydoc_data.topics`) and the standard library's top-level `.py` files. A
fixed 3 % of the documents (by a hash of their name) is held out; the held-out prompts are stored
in `prompts.json` for `metrale bench` and the tests.

The target is trained on the text. The MTP head and the drafters are then trained on the target's
own greedy behaviour — its argmax at every position of sequences whose continuations it generated
greedily — so the acceptance they reach when drafting for it is real. `--soft-labels W` (1) also
teaches the DFlash drafters the target's whole distribution at each slot (a KL term of weight W;
DFlash2's candidate selector, the target's distribution over its candidates): the argmax alone
teaches a drafter its first choice, and a draft tree verifies its next ones too. Checkpoints are
written in Hugging Face layouts with real tensor names, in bfloat16; the drafters learn from the target after
it has been rounded to bfloat16, i.e. from exactly the model that is shipped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_drafters  # noqa: E402  (sibling script module)

from metrale.runtime.models.configs import DecoderConfig  # noqa: E402
from metrale.runtime.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from metrale.runtime.artifact.tokenizer import train_bpe_tokenizer  # noqa: E402

SEED = 1234
VOCAB = 2048
SEQ = 128


def corpus() -> list[tuple[str, str]]:
    """(name, text) documents, sorted by name."""
    import pydoc_data.topics

    docs = [(f"topic:{k}", v) for k, v in pydoc_data.topics.topics.items()]
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(stdlib.glob("*.py")):
        docs.append((f"stdlib:{f.name}", f.read_text(encoding="utf-8", errors="replace")))
    return sorted(docs)


def held_out(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100 < 3


def target_config() -> DecoderConfig:
    return DecoderConfig(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=256, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=1024, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, norm_topk_prob=True, model_type="qwen3_moe",
    )


def hf_target_config(cfg: DecoderConfig, eos: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False,
        "attention_bias": False, "torch_dtype": "bfloat16", "eos_token_id": eos,
        "bos_token_id": None, "use_cache": True,
    }


def batches(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=gen)
        yield torch.stack([stream[s:s + seq + 1] for s in starts.tolist()])


def lr_at(step: int, steps: int, peak: float, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(frac * torch.pi)).item()))


def train_target(stream: torch.Tensor, steps: int, log) -> Qwen3ForCausalLM:
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(target_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    data = batches(stream, 32, SEQ, torch.Generator().manual_seed(SEED))
    model.train()
    for step in range(steps):
        x = next(data)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, 3e-3)
        logits = model(x[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        train_drafters.optimizer_step(opt, model, loss, step, steps, log, "target")
    return model.eval()


def round_bf16(model: torch.nn.Module) -> None:
    """Round the weights to bfloat16 in place (kept fp32 for training what follows)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def save_hf(folder: pathlib.Path, state: dict[str, torch.Tensor], config: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def retrain_drafters(out: pathlib.Path, train_docs: list[str], quick: bool, t_start: float, log) -> None:
    """The drafters again, from the shipped target (its bf16 weights are what it was trained to),
    tokenizer and MTP head; TRAINING.json keeps the other entries and gets the drafters' anew."""
    from metrale.runtime.models.loader import load_mtp, load_target
    from metrale.runtime.artifact.tokenizer import Tokenizer

    target = load_target(out / "target")
    tok = Tokenizer.from_dir(out / "target")
    mtp = load_mtp(out / "mtp", target.lm_head.weight)
    eos = tok.token_id("<|endoftext|>")
    stream = torch.cat([t for d in train_docs for t in (torch.tensor(tok.encode(d)), torch.tensor([eos]))])
    prompts = json.loads((out / "prompts.json").read_text())
    report = json.loads((out / "TRAINING.json").read_text())
    report.update(train_drafters.train_all(target, tok, stream, out, prompts, quick=quick, log=log, mtp=mtp))
    report.update(drafters_retrain_s=round(time.time() - t_start, 1), drafters_torch_threads=torch.get_num_threads(),
                  soft_labels=train_drafters.SOFT_LABELS)
    (out / "TRAINING.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    log(json.dumps(report, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "tiny"))
    ap.add_argument("--quick", action="store_true", help="a few steps of everything (smoke test)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (results depend on it)")
    ap.add_argument("--drafter-steps", type=int, default=train_drafters.DRAFTER_STEPS,
                    help="training steps of each DFlash drafter")
    ap.add_argument("--drafters-only", action="store_true",
                    help="retrain only the DFlash drafters against the target, tokenizer, prompts "
                         "and MTP head already in --out (the rest is kept byte for byte)")
    ap.add_argument("--soft-labels", type=float, default=train_drafters.SOFT_LABELS,
                    help="weight of the KL to the target's distribution in the DFlash drafters' loss")
    args = ap.parse_args()
    if not args.soft_labels >= 0:
        ap.error(f"--soft-labels {args.soft_labels}: the KL term's weight must be 0 (none) or more")
    train_drafters.DRAFTER_STEPS = args.drafter_steps
    train_drafters.SOFT_LABELS = args.soft_labels
    torch.set_num_threads(args.threads)
    out = pathlib.Path(args.out)
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    docs = corpus()
    train_docs = [t for n, t in docs if not held_out(n)]
    test_docs = [t for n, t in docs if held_out(n)]
    if args.quick:
        train_docs, test_docs = train_docs[:6], test_docs[:2]
    log(f"corpus: {len(train_docs)} train / {len(test_docs)} held-out documents")

    if args.drafters_only:
        retrain_drafters(out, train_docs, args.quick, t_start, log)
        return
    tok = train_bpe_tokenizer(train_docs, VOCAB, out / "target")
    eos = tok.token_id("<|endoftext|>")
    sep = torch.tensor([eos])
    stream = torch.cat([t for d in train_docs for t in (torch.tensor(tok.encode(d)), sep)])
    log(f"tokenizer: vocab {tok.vocab_size}; {stream.numel()} training tokens")

    steps = 4 if args.quick else 1500
    target = train_target(stream, steps, log)
    round_bf16(target)
    save_hf(out / "target", target.state_dict(), hf_target_config(target.config, eos))
    t_target = time.time() - t_start
    log(f"target saved ({t_target:.0f}s)")

    prompts = train_drafters.held_out_prompts(tok, test_docs, 24 if not args.quick else 4)
    (out / "prompts.json").write_text(json.dumps(prompts, indent=2) + "\n")
    report = train_drafters.train_all(target, tok, stream, out, prompts, quick=args.quick, log=log)
    report.update(target_steps=steps, target_train_s=round(t_target, 1),
                  total_train_s=round(time.time() - t_start, 1), seed=SEED,
                  torch_threads=torch.get_num_threads(), soft_labels=train_drafters.SOFT_LABELS)
    (out / "TRAINING.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    log(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
