"""Costs `metrale bench` and `metrale calibrate` measure, and the bound a speculative mode can reach.

Terms (all times are medians over repeated calls, in milliseconds):
- c(r): one target forward of r rows (the pending token plus r − 1 drafts) at the position that
  follows a held-out prompt, with the drafters' taps, on the backend under test; `bench` sweeps
  every r before each prompt's turn of the modes and takes the median over the sweeps, so the
  costs are measured over the same stretch of a shared machine as the modes they bound.
- c_plain = c(1): a plain decode step's model time.
- c_verify: what a mode's verification costs per step — c(r̄) for its mean verify rows r̄ per
  step when chunkwise (one forward; c interpolated between row counts), r̄·c(1) when exact.
- c_draft: the mode's own drafter time per step.
- h: the host work of one decode step (the loop, token decisions, bookkeeping), measured as
  plain decoding's time per step in the same run minus c_plain; every step pays it once.
- bound = τ · c_plain / (c_verify + c_draft): the speedup over plain decoding if every step
  cost only its model time, plain decoding's and a speculative step's alike (a mode near its
  bound wastes nothing of its own); of_bound = speedup / bound.
- bound_host = τ · (c_plain + h) / (c_verify + c_draft + h): the same with the host work of a
  plain step added to both; where a speculative step costs more model time than a plain one
  (bound < 1) it lies above `bound`, so it is the stricter target (of_bound_host).
- e = speedup / τ, the fraction of each accepted token's saving kept. c_draft is measured in
  the loop, its own host work included; c(r) alone, with the target's weights hot in the
  caches, so a mode whose drafter evicts them pays for that beyond either bound.

The transformers reference decodes the same target weights with transformers' eager greedy
`generate` (no speculation), timed as (t(N tokens) − t(1 token)) / (N − 1) so prefill is left
out as it is for metrale's rows.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch


def all_taps(engine) -> tuple[int, ...]:
    return tuple(dict.fromkeys(i for d in engine.drafters.values() for i in d.config.target_layer_ids))


@torch.inference_mode()
def target_row_costs(engine, prompt: list[int], max_rows: int = 8, calls: int = 5) -> dict[int, float]:
    """One sweep of c(r) for r = 1..max_rows (see the module docstring): per row count the
    median of `calls` forwards in a row (as a decode loop repeats its step), after a warm-up."""
    target, taps = engine.target, all_taps(engine)
    device = target.model.embed_tokens.weight.device
    ids = torch.tensor([prompt], device=device)
    cache = target.new_cache(1, len(prompt) + max_rows + 32)
    target(ids, cache, taps=taps)
    base = cache.length
    rows = torch.tensor([(prompt * max_rows)[:max_rows]], device=device)  # [1, max_rows]

    def step(r: int) -> float:
        t0 = time.perf_counter()
        target(rows[:, :r], cache, start=base, taps=taps)
        if device.type == "cuda":  # the step's kernels, not only their launches
            torch.cuda.synchronize(device)
        cache.length = base
        return time.perf_counter() - t0

    costs = {}
    for r in range(1, max_rows + 1):
        for _ in range(3):  # warm-up
            step(r)
        costs[r] = round(1000 * statistics.median(step(r) for _ in range(calls)), 4)
    return costs


def interpolate(costs: dict[int, float], rows: float) -> float:
    lo = max(1, min(int(rows), max(costs)))
    hi = min(lo + 1, max(costs))
    frac = min(max(rows - lo, 0.0), 1.0) if hi > lo else 0.0
    return costs[lo] + frac * (costs[hi] - costs[lo])


def host_ms(plain_row: dict, costs: dict[int, float]) -> float:
    """h: plain decoding's time per step in the run beyond the model's c(1)."""
    return max(0.0, 1000 * plain_row["seconds"] / max(1, plain_row["steps"]) - costs[1])


def mode_bound(row: dict, costs: dict[int, float], exact: bool, host: float = 0.0) -> dict:
    """bound, e and the per-step costs for one bench row (see the module docstring)."""
    steps = max(1, row["steps"])
    rows_per_step = row["verify_rows"] / steps
    c_verify = rows_per_step * costs[1] if exact else interpolate(costs, rows_per_step)
    c_draft = 1000 * row["draft_s"] / steps if row["drafts_proposed"] else 0.0  # plain: no drafter
    tau = row["tau"] or 1.0
    cost = c_verify + c_draft  # 0 when no verify step ran (every prompt ended at its first token)
    bound = tau * costs[1] / cost if cost > 0 else None
    with_host = tau * (costs[1] + host) / (cost + host) if cost > 0 else None
    of = lambda b: None if b is None else round(row["speedup"] / b, 3)  # noqa: E731
    return {"c_verify_ms": round(c_verify, 4), "c_draft_ms": round(c_draft, 4), "host_ms": round(host, 4),
            "bound": bound and round(bound, 3), "of_bound": of(bound),
            "bound_host": with_host and round(with_host, 3), "of_bound_host": of(with_host),
            "e": round(row["speedup"] / tau, 3)}


def transformers_reference(engine, prompts: list[list[int]], max_tokens: int, repeats: int) -> dict | None:
    """tok/s of transformers' eager greedy `generate` on the engine's target weights, and how
    many prompts' greedy text (up to metrale's length) it shares; None when not installed."""
    try:
        import transformers
    except ImportError:
        return None
    target_dir = Path(engine.path) / "target"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_bytes((target_dir / "config.json").read_bytes())
        (Path(tmp) / "model.safetensors").symlink_to((target_dir / "rank0.safetensors").resolve())
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=engine.dtype).eval()
    tokens_out, seconds = [], 0.0
    n = max(2, max_tokens)

    def run(ids, new):
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0)

    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            full = statistics.median(_timed(lambda: run(ids, n)) for _ in range(repeats))
            first = statistics.median(_timed(lambda: run(ids, 1)) for _ in range(repeats))
            seconds += max(full - first, 1e-9)
            tokens_out.append(run(ids, n)[0, len(p):].tolist())
    return {"tokens_per_s": round(len(prompts) * (n - 1) / seconds, 2), "outputs": tokens_out}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def step_counts(gen, prompt: list[int], max_tokens: int = 16) -> dict:
    """Per decode step of one greedy request on `gen` (an `EngineGenerator`): the ops that run
    (`ops_per_step`: each a kernel launch when run eagerly, a graph node when captured) and the
    host reads among them (`host_reads_per_step`: each a sync on a GPU), and what ran the steps
    (`steps_run_as`). The decode loop's are counted over the request's steps; whole-iteration
    graphs' are one iteration's ops and none inside it (the host waits once per iteration, on
    the copy of its tokens)."""
    from metrale.runtime.backends.host_reads import OpCount
    from metrale.runtime.spec.iteration_loop import IterationDecoder
    from metrale.runtime.spec.sampling import SamplingParams

    decoder = gen.decoder()
    if isinstance(decoder, IterationDecoder):
        it = decoder.loop.iteration
        with torch.inference_mode():
            it.check_room(len(prompt), max_tokens)
            it.prefill(0, prompt)
            with OpCount() as count:
                it()
        return {"ops_per_step": count.ops, "host_reads_per_step": count.host_reads,
                "steps_run_as": "iteration graph"}
    counts = []
    for n in (1, max_tokens):  # the prompt alone, then with the steps: their difference
        with OpCount() as count:
            res = gen.decoder().generate(prompt, SamplingParams(temperature=0.0, max_tokens=n))
        counts.append(count)
    steps = max(1, len(res.steps))
    return {"ops_per_step": round((counts[1].ops - counts[0].ops) / steps, 1),
            "host_reads_per_step": round((counts[1].host_reads - counts[0].host_reads) / steps, 2),
            "steps_run_as": "decode loop"}
