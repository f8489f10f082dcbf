"""τ of DFlash draft trees against the chain, per drafter, as the README publishes it:

    python scripts/tree_tau.py --engine-dir engines/tiny [--drafters dflash,dflash2]
                               [--budgets 16,32] [--max-tokens 128] [--prompts N]
                               [--prompts-file FILE | --unseen] [--marginal] [--threads 1]
                               [--json FILE]

For each drafter, greedy speculative decoding's τ (tokens per verify) with its blocks verified
as the chain and as best-first trees of each budget, over the tiny recipe's held-out prompts
(all of them unless `--prompts N`; or the JSON list of strings in `--prompts-file`; or, with
`--unseen`, one prompt from each standard-library package's largest module, text the tiny
recipe never trains on, as it reads only the library's top-level modules), `--max-tokens` of
plain decoding's tokens each
(`runtime/spec/tree_acceptance.py`: the decode loop's greedy acceptance, without its verifies).
Beside τ, the ratio to the chain's and the share of steps that accepted the whole block, where
no tree of that block can add a token. `--marginal` also reads DFlash2's blocks as DFlash's
(each slot's argmax, children from each position's own distribution, no candidate selector).
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import torch

PROMPTS = Path(__file__).resolve().parent.parent / "recipes" / "tiny" / "prompts.json"
PROMPT_TOKENS = 32  # as the recipe's held-out prompts


def unseen_prompts(tokenizer) -> list[str]:
    """A prompt of PROMPT_TOKENS tokens from each standard-library package's largest module (the
    tests, IDLE and installed packages left out), at an offset that moves from one to the next,
    as the recipe picks its held-out prompts."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for pkg in sorted(d for d in stdlib.iterdir() if (d / "__init__.py").exists()):
        modules = [f for f in pkg.glob("*.py") if f.name != "__init__.py"]
        if pkg.name in ("test", "idlelib", "site-packages") or not modules:
            continue
        ids = tokenizer.encode(max(modules, key=lambda f: (f.stat().st_size, f.name)).read_text(errors="replace"))
        if len(ids) > 4 * PROMPT_TOKENS:
            at = (len(prompts) * 977) % (len(ids) - 2 * PROMPT_TOKENS)
            prompts.append(tokenizer.decode(ids[at:at + PROMPT_TOKENS]))
    return prompts


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
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--prompts-file", type=Path, default=PROMPTS)
    source.add_argument("--unseen", action="store_true")
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
    if args.unseen:
        texts = unseen_prompts(engine.tokenizer)
    else:
        try:
            texts = json.loads(args.prompts_file.read_text())
        except (OSError, ValueError) as e:
            sys.exit(f"--prompts-file {args.prompts_file}: cannot be read as JSON ({e})")
        if not (isinstance(texts, list) and all(isinstance(t, str) for t in texts)):
            sys.exit(f"--prompts-file {args.prompts_file}: a JSON list of strings, as recipes/tiny/prompts.json")
    texts = texts[:args.prompts] if args.prompts else texts
    prompts = [ids for ids in (engine.tokenizer.encode(t) for t in texts) if ids]
    if not prompts:
        sys.exit("no prompt to measure: " + ("the standard library has no package module long enough"
                                              if args.unseen else f"--prompts-file {args.prompts_file} is empty"))

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
