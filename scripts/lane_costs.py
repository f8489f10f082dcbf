"""What one whole iteration of serving's lanes costs, per mode, lane count and slot bucket:

    python scripts/lane_costs.py ENGINE_DIR OUT.json [--device cpu|cuda] [--lanes 1,32]
                                 [--max-tokens 64,900] [--prompt-tokens 32] [--replays 5]

Each case fills the lanes with greedy requests of a prompt of `--prompt-tokens` tokens and a
`max_tokens` (which picks their slot bucket: 64 puts a 32-token prompt in the 256-slot bucket,
900 in the whole context's) and runs the iteration of all of them (`IterationLanes.run`: the
replay, the copy of the tokens to the host and its wait), refilling the lanes whenever their
requests reach their budget; a case records the wall milliseconds per iteration. On a CUDA
device the iterations are CUDA graphs (`cuda_graphs.CudaGraphs`); on a CPU they run on the
capture stand-in (`EagerGraphs`, eager ops, one thread) and a case also records the ops one
iteration dispatches and the bytes of the tensors they allocate (in-place writes not counted):
the memory traffic a GPU's kernels would make. First it checks `LaneKV`'s attention against
`PooledKV`'s on the device in bfloat16 (exit status 1 past its rounding). The JSON is
rewritten as each case ends.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MODES = {"plain": {}, "dflash": dict(dflash=True), "dflash2": dict(dflash=True, dflash_drafter="dflash2"),
         "mtp k=3": dict(speculative=True, num_drafts=3),
         "dflash2 tree 16": dict(dflash=True, dflash_drafter="dflash2", dflash_tree_budget=16)}


class _Allocations(TorchDispatchMode):
    """Counts the ops dispatched and the bytes of the new tensors they return."""

    def __init__(self):
        super().__init__()
        self.ops, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.bytes += t.numel() * t.element_size()
        return out


def _engine(engine_dir: str, device: str):
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import EagerGraphs, use_cuda_graphs

    if device == "cuda":  # as `--device cuda` loads it: the step kernels checked, the target's graphs
        engine = load_engine(engine_dir, backend="auto", dtype=torch.bfloat16, device="cuda")
        if engine.backend.name != "cuda-graphs":
            raise SystemExit(f"CUDA graphs failed: {engine.backend_note}")
        if engine.backend_note:
            print(f"note: {engine.backend_note}")
    else:
        engine = load_engine(engine_dir, backend="torch")
        use_cuda_graphs(engine, graphs=EagerGraphs(check=False))  # timed: replays unchecked
    return engine


def lane_attention_error(device: str) -> float:
    """`LaneKV`'s attention against `PooledKV`'s on `device` in bfloat16 (4 lanes of 8 rows over
    the first 256 slots of 300; the head sizes of the tiny target): the largest difference,
    relative to the outputs' largest magnitude."""
    from metrale.runtime.models.step_caches import LaneKV, PooledKV

    g = torch.Generator().manual_seed(0)
    b, r, nkv, nh, hd, s = 4, 8, 2, 4, 32, 300
    k, v = torch.randn(b, nkv, hd, s, generator=g), torch.randn(b, s, nkv, hd, generator=g)
    q = torch.randn(1, nh, b * r, hd, generator=g)
    pos = (torch.randint(0, 240, (b, 1), generator=g) + torch.arange(r)).reshape(-1)
    seq = torch.arange(b).repeat_interleave(r)
    put = dict(device=device, dtype=torch.bfloat16)
    ref = PooledKV([k.to(**put)[..., :256], v.to(**put)[:, :256]], seq.to(device), pos.to(device)).attend(0, q.to(**put))
    lane = LaneKV([k.to(**put)[..., :256], v.transpose(1, 2).contiguous().to(**put)[:, :, :256]],
                  seq.to(device), pos.to(device)).attend(0, q.to(**put))
    return float((lane.float() - ref.float()).abs().max() / ref.float().abs().max())


def _lanes(engine, mode: str, n: int):
    """Serving's lanes for `mode`: `n` lanes, captured once for every case."""
    from metrale.runtime.spec.config import SpecMode, SpeculativeConfig, resolve_dflash
    from metrale.runtime.spec.iteration_loop import lanes_for

    spec = SpeculativeConfig.from_flags(**MODES[mode])
    dflash = None
    if spec.mode is SpecMode.DFLASH:
        dflash = resolve_dflash(spec, engine.drafters[spec.dflash_drafter].config.block_size)
    return lanes_for(engine, spec, dflash, engine.target.runner.graphs, n)


def case(lanes, mode: str, prompt_tokens: int, max_tokens: int, replays: int) -> dict:
    """One case on `lanes` (`IterationLanes`, every lane filled with a fresh request of
    `max_tokens` whenever the last ones have run the iterations their budget allows)."""
    from metrale.runtime.spec.iteration_loop import LaneStep
    from metrale.runtime.spec.sampling import SamplingParams

    it = lanes.iteration
    n = it.lanes
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    vocab = it.vocab_size
    rows = it.k + 1
    per_round = max(1, (max_tokens - 1) // it.emitted_rows())  # iterations a request runs within its budget

    held: list[int] = []

    def fill() -> None:
        while held:
            lanes.release(held.pop())
        for i in range(n):  # distinct prompts: each lane drafts and accepts its own
            ids = [(7 + 31 * i + 13 * j) % (vocab - 8) + 4 for j in range(prompt_tokens)]
            held.append(lanes.acquire())
            lanes.prefill(held[-1], ids, params, max_tokens)

    steps = [LaneStep(lanes, lane) for lane in range(n)]
    fill()
    lanes.run(steps)
    used = 1
    out = {"mode": mode, "lanes": n, "slots": it.check_room(prompt_tokens, max_tokens), "rows": rows}
    cuda = it.device.type == "cuda"
    if not cuda:
        count = _Allocations()
        with count:
            lanes.run(steps)
        used += 1
        out.update(ops=count.ops, allocated_mb=round(count.bytes / 2**20, 2))
    elapsed = 0.0
    for _ in range(replays):
        if used >= per_round:
            fill()
            used = 0
        start = time.perf_counter()
        lanes.run(steps)
        elapsed += time.perf_counter() - start
        used += 1
    out["ms_per_iteration"] = round(elapsed / replays * 1e3, 3)
    while held:
        lanes.release(held.pop())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine_dir")
    ap.add_argument("out")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--lanes", default="1,32")
    ap.add_argument("--max-tokens", default="64,900")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES))
    a = ap.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(1)
    engine = _engine(a.engine_dir, a.device)
    results = {"device": a.device, "lane_attention_error": lane_attention_error(a.device), "cases": []}
    print(f"LaneKV vs PooledKV, bfloat16: {results['lane_attention_error']:.2e} of the largest output")
    with torch.inference_mode():
        for mode in a.modes.split(","):
            for n in (int(x) for x in a.lanes.split(",")):
                lanes = _lanes(engine, mode, n)
                for mt in (int(x) for x in a.max_tokens.split(",")):
                    results["cases"].append(case(lanes, mode, a.prompt_tokens, mt, a.replays))
                    print(json.dumps(results["cases"][-1]), flush=True)
                    Path(a.out).write_text(json.dumps(results, indent=1))
    if results["lane_attention_error"] > 2e-2:
        raise SystemExit("LaneKV's attention differs from PooledKV's past bfloat16's rounding")

if __name__ == "__main__":
    main()
