"""What one whole iteration of serving's lanes costs, per mode, lane count and slot bucket:

    python scripts/lane_costs.py ENGINE_DIR OUT.json [--device cpu|cuda] [--lanes 1,32]
                                 [--max-tokens 64,900] [--prompt-tokens 32] [--replays 5]

Each case fills the lanes with greedy requests of a prompt of `--prompt-tokens` tokens and a
`max_tokens` (which picks their slot bucket: 64 puts a 32-token prompt in the 256-slot bucket,
900 in the whole context's) and replays the iteration of all of them. On a CUDA device the
iterations are CUDA graphs (`cuda_graphs.CudaGraphs`) and a case records the milliseconds per
replay (CUDA events); on a CPU they run on the capture stand-in (`EagerGraphs`, eager ops, one
thread) and a case also records the ops one iteration dispatches and the bytes of the tensors
they allocate (in-place writes not counted): the memory traffic a GPU's kernels would make.
The JSON is rewritten as each case ends.
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
         "mtp k=3": dict(speculative=True, num_drafts=3)}


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

    if device == "cuda":
        engine = load_engine(engine_dir, backend="torch", dtype=torch.bfloat16, device="cuda")
        use_cuda_graphs(engine)
        if engine.backend_note:
            raise SystemExit(f"CUDA graphs failed: {engine.backend_note}")
    else:
        engine = load_engine(engine_dir, backend="torch")
        use_cuda_graphs(engine, graphs=EagerGraphs())
    return engine


def case(engine, mode: str, lanes_n: int, prompt_tokens: int, max_tokens: int, replays: int) -> dict:
    from metrale.runtime.spec.config import SpecMode, SpeculativeConfig, resolve_dflash
    from metrale.runtime.spec.iteration_loop import LaneStep, lanes_for
    from metrale.runtime.spec.sampling import SamplingParams

    flags = MODES[mode]
    spec = SpeculativeConfig.from_flags(**flags)
    dflash = None
    if spec.mode is SpecMode.DFLASH:
        dflash = resolve_dflash(spec, engine.drafters[spec.dflash_drafter].config.block_size)
    lanes = lanes_for(engine, spec, dflash, engine.target.runner.graphs, lanes_n)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    vocab = engine.target.config.vocab_size
    for lane in range(lanes_n):  # distinct prompts: each lane drafts and accepts its own
        ids = [(7 + 31 * lane + 13 * i) % (vocab - 8) + 4 for i in range(prompt_tokens)]
        lanes.prefill(lanes.acquire(), ids, params, max_tokens)
    steps = [LaneStep(lanes, lane) for lane in range(lanes_n)]
    lanes.run(steps)
    out = {"mode": mode, "lanes": lanes_n, "slots": lanes.iteration.check_room(prompt_tokens, max_tokens),
           "rows": lanes.iteration.k + 1}
    cuda = lanes.iteration.device.type == "cuda"
    if not cuda:
        count = _Allocations()
        with count:
            lanes.run(steps)
        out.update(ops=count.ops, allocated_mb=round(count.bytes / 2**20, 2))
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        lanes.run(steps)
    out["ms_per_iteration"] = round((time.perf_counter() - start) / replays * 1e3, 3)
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
    results = []
    with torch.inference_mode():
        for mode in a.modes.split(","):
            for n in (int(x) for x in a.lanes.split(",")):
                for mt in (int(x) for x in a.max_tokens.split(",")):
                    results.append(case(engine, mode, n, a.prompt_tokens, mt, a.replays))
                    print(json.dumps(results[-1]), flush=True)
                    Path(a.out).write_text(json.dumps({"device": a.device, "cases": results}, indent=1))


if __name__ == "__main__":
    main()
