"""τ of DFlash draft trees against the chain, per drafter, as the README publishes it:

    python scripts/tree_tau.py --engine-dir engines/tiny [--drafters dflash,dflash2]
                               [--budgets 16,32] [--max-tokens 128] [--prompts N]
                               [--marginal] [--threads 1] [--json FILE]

For each drafter, greedy speculative decoding's τ (tokens per verify) with its blocks verified
as the chain and as best-first trees of each budget, over the tiny recipe's held-out prompts
(all of them unless `--prompts N`), `--max-tokens` of plain decoding's tokens each
(`runtime/spec/tree_acceptance.py`: the decode loop's greedy acceptance, without its verifies).
Beside τ, the ratio to the chain's and the share of steps that accepted the whole block, where
no tree of that block can add a token. `--marginal` also reads DFlash2's blocks as DFlash's
(each slot's argmax, children from each position's own distribution, no candidate selector).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

PROMPTS = Path(__file__).resolve().parent.parent / "recipes" / "tiny" / "prompts.json"


def _counts(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        sys.exit(f"{flag} {text!r}: a comma-separated list of positive whole numbers, e.g. 16,32")
    return values


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-dir", type=Path, required=True)
    ap.add_argument("--drafters", default="dflash,dflash2")
    ap.add_argument("--budgets", default="16,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=0, help="the first N held-out prompts (0: all)")
    ap.add_argument("--marginal", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    budgets = _counts(args.budgets, "--budgets")
    if args.max_tokens < 2:
        sys.exit(f"--max-tokens {args.max_tokens}: at least 2 (a verify needs a token after its anchor)")
    if args.prompts < 0:
        sys.exit(f"--prompts {args.prompts}: 0 (all) or a positive count")

    from metrale.runtime.backends import load_engine
    from metrale.runtime.spec.tree_acceptance import block_steps

    torch.set_num_threads(args.threads)
    engine = load_engine(args.engine_dir)
    names = [n for n in args.drafters.split(",") if n]
    unknown = [n for n in names if n not in engine.drafters]
    if not names or unknown:
        sys.exit(f"--drafters {args.drafters!r}: the engine's drafters are {', '.join(sorted(engine.drafters)) or 'none'}")
    texts = json.loads(PROMPTS.read_text())
    texts = texts[:args.prompts] if args.prompts else texts
    prompts = [ids for ids in (engine.tokenizer.encode(t) for t in texts) if ids]
    if not prompts:
        sys.exit(f"{PROMPTS}: no prompt to measure")

    readings = [(n, False) for n in names]
    if args.marginal:
        readings += [(n, True) for n in names if engine.drafters[n].config.version == 2]
    report = {"prompts": len(prompts), "max_tokens": args.max_tokens, "rows": []}
    print(f"{len(prompts)} prompts x {args.max_tokens} tokens")
    print(f"{'drafter':<20} {'policy':<8} {'tau':>6} {'x chain':>8} {'whole block':>12}")
    for name, marginal in readings:
        whole = engine.drafters[name].config.block_size - 1
        got = block_steps(engine, name, prompts, args.max_tokens, budgets, marginal=marginal)
        label = f"{name} (marginal)" if marginal else name
        chain = got["chain"]
        for policy, a in got.items():
            row = {"drafter": name, "marginal": marginal, "policy": policy, "tau": a.tau,
                   "ratio": round(a.emitted * chain.steps / (a.steps * chain.emitted), 3),
                   "whole_block_share": round(a.accepted[whole] / a.steps, 3)}
            report["rows"].append(row)
            print(f"{label:<20} {policy:<8} {row['tau']:>6.3f} {row['ratio']:>7.3f}x {row['whole_block_share']:>12.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
