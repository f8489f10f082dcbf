"""`metrale calibrate`: measure the step costs `--dflash-adaptive-k auto` decides with.

For each drafter of the engine directory, the median ms of a greedy decode step that verifies
exactly k drafts (k = 0..γ−1, k = 0 being a plain step; with `--tree-budget N`, also draft trees
of k = γ..N nodes, which `--dflash-adaptive-k auto` then chooses among under
`--dflash-tree-budget`), over held-out prompts and repeats, on
the backend, dtype and thread count given (those of the serve that will use it), and the
drafter's per-position acceptance over those steps. The table goes
into the engine directory's `calibration.json` (see `runtime.spec.calibration`), checksummed in the
manifest; an entry for the same setting is replaced.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Optional

import typer

from metrale import checks
from metrale import options as o
from metrale.runtime.steps import MAX_TREE_NODES
from metrale.console import app, out, user_errors


@app.command()
def calibrate(
    engine_dir: o.EngineDir,
    prompts_file: Annotated[Optional[Path], typer.Option("--prompts", help="JSON list of prompt strings. Default: the tiny recipe's held-out prompts.")] = None,
    num_prompts: Annotated[Optional[int], typer.Option(help="How many prompts to decode per measurement (default: 4, or all of a shorter --prompts file).", show_default=False)] = None,
    max_tokens: Annotated[int, typer.Option(min=2, help="Tokens generated per prompt.")] = 48,
    repeats: Annotated[int, typer.Option(min=1, help="Measurements per draft count; the median is stored.")] = 5,
    threads: Annotated[int, typer.Option(min=1, help="torch CPU threads, as the serve will run.")] = 1,
    tree_budget: Annotated[int, typer.Option("--tree-budget", help=(
        "Also measure draft trees of γ..N nodes, for --dflash-adaptive-k auto with "
        "--dflash-tree-budget up to N. 0: chains only."))] = 0,
    dtype: o.Dtype = "auto", backend: o.Backend = "auto",
):
    """Measure the cost of a decode step by draft count and store it for --dflash-adaptive-k auto."""
    with user_errors():
        import torch

        from metrale.bench import DEFAULT_PROMPTS, measure_costs
        from metrale.runtime.spec import calibration
        from metrale.runtime.backends import load_engine, resolve_backend
        from metrale.runtime.artifact.engine_dir import add_files
        from metrale.runtime.errors import ConfigError

        if not 0 <= tree_budget <= MAX_TREE_NODES:
            raise ConfigError(f"--tree-budget: got {tree_budget}; expected 0 (chains only) to "
                              f"{MAX_TREE_NODES} (the most nodes a draft tree holds)")
        kind, device = resolve_backend(backend, None, dtype)
        if kind.runs_graphs:
            raise ConfigError(f"--backend {kind.value}: calibrate measures the torch models' backends "
                              "(auto, torch, aoti)")
        path = prompts_file or DEFAULT_PROMPTS
        texts = checks.first_prompts("--num-prompts", num_prompts, checks.prompt_texts("--prompts", path),
                                     path, default=4)
        checks.max_tokens_fit(max_tokens, checks.context_length(engine_dir))
        # the table is stored in the engine directory: refused before minutes of measuring
        checks.updatable_dir("--engine-dir", engine_dir, f"calibrate stores {calibration.FILE} in it")
        torch.set_num_threads(threads)
        engine = load_engine(engine_dir, dtype=o.torch_dtype(dtype, device), device=device, backend=kind.value)
        if not engine.drafters:
            raise ConfigError(f"engine directory {engine_dir} has no DFlash drafter to calibrate")
        for name, d in sorted(engine.drafters.items()):
            g = d.config.block_size
            if 0 < tree_budget < g:
                raise ConfigError(f"--tree-budget {tree_budget}: drafter {name!r} prices chains of up to "
                                  f"γ − 1 = {g - 1} drafts already; trees are measured from γ = {g} nodes "
                                  f"on: expected 0 or at least {g}")
            if tree_budget and not engine.block_distributions(name):
                raise ConfigError(f"--tree-budget {tree_budget}: {engine.no_distributions(name)}: "
                                  "expected 0, or build the engine again")
        prompts = [engine.tokenizer.encode(t) for t in texts]
        checks.prompts_fit(prompts, max_tokens, engine.target.config.max_position_embeddings)
        dtype_name = str(engine.dtype).removeprefix("torch.")
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        entries = []
        for name in sorted(engine.drafters):
            t0 = time.time()
            table = measure_costs(engine, prompts, max_tokens, name, repeats, tree_budget)
            entries.append({**calibration.setting(name, engine.backend.name, dtype_name, threads),
                            "table": str(table), "acceptance": table.acceptance,
                            "repeats": repeats, "prompts": len(prompts),
                            "max_tokens": max_tokens, "measured": now})
            out.print(f"{name} ({engine.backend}, {dtype_name}, {threads} thread(s)): {table}, "
                      f"acceptance {table.acceptance}  "
                      f"[{time.time() - t0:.1f} s]")
        add_files(engine_dir, {calibration.FILE: calibration.merged(Path(engine_dir), entries)})
        out.print(f"stored in {Path(engine_dir) / calibration.FILE}; serve with --dflash-adaptive-k auto")
