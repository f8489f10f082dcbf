"""`metrale bench`: plain decoding and every speculative mode over held-out prompts, one process.

All modes run the same prompts, greedy, with the same token budget, in one process, so their
ratios are comparable even on a shared, noisy machine (absolute tokens/s are not). Per mode:
tokens/s, τ (accepted + bonus per step), speedup over plain, verify rows per emitted token,
drafter time share, per-position acceptance, and how many prompts produced exactly plain
decoding's tokens (all of them, under --exact-verify).

The cost model for adaptive k is measured here first: the mean wall time of a decode step that
verifies k drafts (propose + verify), for k = 0..γ−1, on the first prompt.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from metrale import checks
from metrale import options as o
from metrale.console import app, out, user_errors
from metrale.runtime.spec.config import check_draft_tier

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "recipes" / "tiny" / "prompts.json"


def mode_table(engine, gamma_costs: dict | None) -> list[tuple[str, dict]]:
    """(name, flags) for every mode the engine directory can run: plain, then each loaded
    component's modes as its step shape names them (`spec.shapes`), the measured cost models
    `gamma_costs` (drafter name -> CostModel) adding adaptive k."""
    from metrale.runtime.components import KINDS

    loaded = {n: (KINDS[i.kind], engine.component(n)) for n, i in engine.manifest.components.items()}
    modes = _modes({n: (k, m.config) for n, (k, m) in loaded.items() if m is not None}, gamma_costs)
    # a tree's rows in one forward where the target has a tree mask only; trees where the
    # drafter gives its blocks' distributions only
    return [(n, f) for n, f in modes
            if (engine.tree_attention or f.get("dflash_tree_verify") != "forward")
            and (not f.get("dflash_tree_budget") or engine.block_distributions(f["dflash_drafter"]))]


def _modes(components: dict, gamma_costs: dict | None) -> list[tuple[str, dict]]:
    from metrale.runtime.spec.shapes import bench_modes

    modes: list[tuple[str, dict]] = [("plain", {})]
    for name, (kind, cfg) in components.items():
        modes += bench_modes(kind.shape, name, cfg, (gamma_costs or {}).get(name))
    return modes


def measure_costs(engine, prompts: list[list[int]], max_tokens: int, drafter: str, repeats: int,
                  tree_budget: int = 0):
    """The cost model `--dflash-adaptive-k` decides with, measured: for k = 0..γ−1 the step time
    with a fixed draft count k (a one-rung ladder), and for k = γ..`tree_budget` that of a draft
    tree of k nodes (`--dflash-tree-budget k`, verified as a serve without a table verifies it),
    the median over `repeats` runs of the mean step time over `prompts`, the counts run as
    `run_modes` runs modes (interleaved per prompt); and the drafter's per-position acceptance
    over the chains' steps (`AcceptanceEstimator`'s pooled rate). -> CostModel with
    `acceptance`."""
    from metrale.runtime.spec.adaptive_k import AcceptanceEstimator
    from metrale.runtime.spec.cost_model import CostModel

    g = engine.drafters[drafter].config.block_size
    table = [(str(k), {} if k == 0 else {"dflash": True, "dflash_drafter": drafter,
                                         "dflash_draft_ladder": str(k)}) for k in range(g)]
    table += [(str(k), {"dflash": True, "dflash_drafter": drafter, "dflash_tree_budget": k})
              for k in range(g, tree_budget + 1)]
    runs = run_modes(engine, table, prompts, max_tokens, repeats)
    est = AcceptanceEstimator()
    for name, _ in table[:g]:  # a chain's drafts are positions; a tree's nodes are not
        for prompt_runs in runs[name]:
            for s in prompt_runs[0].steps:  # greedy: every repeat verifies the same drafts
                est.update(s.drafted, s.accepted)
    ms = []
    for name, _ in table:  # per repeat, the mean step time over the prompts
        per_step = [sum(p[r].seconds - p[r].prefill_s for p in runs[name])
                    / max(1, sum(len(p[r].steps) for p in runs[name])) for r in range(repeats)]
        ms.append(round(1000 * statistics.median(per_step), 3))
    return CostModel(first=0, ms=tuple(ms), acceptance=round(est.pooled(), 4))


def run_modes(engine, table: list[tuple[str, dict]], prompts: list[list[int]], max_tokens: int,
              repeats: int, between=None, generators: dict | None = None,
              json_schema: str | None = None) -> dict[str, list[list]]:
    """Every mode of `table` over the prompts, `repeats` times, interleaved per prompt: each
    prompt is decoded by every mode in turn before the next, so a slow stretch of a shared
    machine (they last seconds here) lands on all modes alike instead of on the ones that
    happened to run during it; `between()`, when given, runs before each prompt's turn (the
    bench's cost sweeps, spread over the same stretch); `generators`, when given, receives each
    mode's `EngineGenerator`; `json_schema`, when given, constrains every answer to it (as a
    request's `response_format`). -> {mode: per prompt, its runs' DecodeResults}."""
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, json_schema=json_schema)
    gens = [(name, EngineGenerator(engine, SpeculativeConfig.from_flags(**flags))) for name, flags in table]
    if generators is not None:
        generators.update(gens)
    runs = {name: [[] for _ in prompts] for name, _ in table}
    for _ in range(repeats):
        for i, ids in enumerate(prompts):
            if between is not None:
                between()
            for name, gen in gens:
                runs[name][i].append(gen.decoder(params if json_schema else None).generate(ids, params))
    return runs


def summarize(runs: list[list], plain_tokens=None) -> tuple[dict, list[list[int]]]:
    """One mode's row: per prompt the run of median decode time counts (greedy: every run emits
    the same tokens)."""
    from metrale.runtime.spec.metrics import SpecMetrics

    total = SpecMetrics()
    tokens, seconds, outputs = 0, 0.0, []
    for prompt_runs in runs:
        ordered = sorted(prompt_runs, key=lambda r: r.seconds - r.prefill_s)
        res = ordered[(len(ordered) - 1) // 2]
        total.merge(res.metrics)
        tokens += len(res.token_ids)
        seconds += res.seconds - res.prefill_s
        outputs.append(res.token_ids)
    work = total.draft_s + total.verify_s
    row = {"tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 2),
           "tau": round(total.tau or 0.0, 4), "steps": total.steps,
           "verify_rows": total.verify_rows,
           "verify_rows_per_token": round(total.verify_rows / max(1, tokens), 4),
           "draft_s": round(total.draft_s, 5), "verify_s": round(total.verify_s, 5),
           "host_s": round(max(0.0, seconds - work), 5),
           "time_split": {"draft": round(total.draft_s / seconds, 4),
                          "verify": round(total.verify_s / seconds, 4),
                          "host": round(max(0.0, seconds - work) / seconds, 4)},
           "drafter_time_share": round(total.draft_s / max(1e-9, work), 4),
           "acceptance_per_position": [round(a, 4) for a in total.acceptance_per_position()],
           "drafts_proposed": total.drafts_proposed, "drafts_verified": total.drafts_verified}
    if plain_tokens is not None:
        row["identical_to_plain"] = sum(a == b for a, b in zip(outputs, plain_tokens))
    return row, outputs


def _compiles(schema: str, path: Path) -> None:
    """`--json-schema`'s schema compiles and lets a document start,
    as the server checks a request's (ConfigError naming the flag and file)."""
    from metrale.runtime.errors import ConfigError
    from metrale.runtime.spec.grammar import check_schema

    try:
        check_schema(schema)
    except ConfigError as exc:
        raise ConfigError(f"--json-schema {str(path)!r}: {exc}") from None


def _wanted_modes(modes: str | None) -> list[str] | None:
    """`--modes`: comma-separated, non-empty substrings (matched against the engine's modes)."""
    if modes is None:
        return None
    wanted = [w.strip() for w in modes.split(",")]
    if not all(wanted):
        from metrale.runtime.errors import ConfigError

        raise ConfigError(f"--modes {modes!r}: expected comma-separated, non-empty parts of mode "
                          "names, such as mtp,dflash")
    return wanted


def _engine_modes(engine_dir: Path) -> list[tuple[str, dict]]:
    """The (name, flags) `mode_table` gives an engine directory, read from its manifest and
    component configs without loading a model; [] when they cannot be read (loading then says
    why)."""
    from metrale.runtime.artifact.entries import parse_entry
    from metrale.runtime.components import KINDS
    from metrale.runtime.errors import MetraleError

    root = Path(engine_dir)
    try:
        manifest = json.loads((root / "config.json").read_text(encoding="utf-8"))
        comps = {}
        for n, info in manifest["components"].items():
            entry = parse_entry(info, n)
            kind = KINDS[entry.kind]
            cfg = json.loads((root / n / "config.json").read_text(encoding="utf-8"))
            comps[n] = (kind, kind.parse(cfg, f"{n}/config.json", entry))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, MetraleError):
        return []
    from metrale.runtime.spec.cost_model import CostModel
    from metrale.runtime.spec.shapes import TREE_BUDGETS

    priced = CostModel(first=0, ms=(1.0,) * (TREE_BUDGETS[0] + 1))  # a stand-in: the names only
    return _modes(comps, {n: priced for n in comps})


def _mode_names(engine_dir: Path) -> list[str]:
    """The names of `_engine_modes`."""
    return [name for name, _ in _engine_modes(engine_dir)]


def _check_tier_flags(engine_dir: Path, all_modes: list[tuple[str, dict]], wanted: list[str] | None,
                      modes: str | None, draft_tier: str | None, mtp_nvfp4: bool | None) -> None:
    """Refuse a weight-tier flag that no mode of this run reads. Bench has no --speculative or
    --dflash: `--mtp-experts-nvfp4` applies to every MTP mode it runs, `--draft-weight-quantization`
    to every drafter (its cost model is measured whatever --modes selects)."""
    from metrale.runtime.errors import ConfigError

    if not all_modes:  # the engine directory cannot be read: loading says why
        return
    if draft_tier is not None and not any(f.get("dflash") for _, f in all_modes):
        raise ConfigError(f"--draft-weight-quantization {draft_tier}: engine directory {engine_dir} "
                          "has no DFlash drafter for it to set; leave it out")
    if mtp_nvfp4 is None:
        return
    given = "--mtp-experts-nvfp4" if mtp_nvfp4 else "--no-mtp-experts-nvfp4"
    mtp = [n for n, f in all_modes if f.get("speculative")]
    if not mtp:
        raise ConfigError(f"{given}: engine directory {engine_dir} has no MTP head, so no mode "
                          "reads it; leave it out")
    if wanted and not any(w in n for w in wanted for n in mtp):
        raise ConfigError(f"{given} with --modes {modes!r}: it sets the MTP modes' head, and "
                          f"--modes selects none of them ({', '.join(mtp)}); add one or leave it out")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _load_engine(engine_dir, device, dtype, backend_kind, draft_tier, mtp_nvfp4):
    """The engine every mode runs on; the weight-tier flags apply to every drafter and the head."""
    from metrale.builder.requantize import check_plans, requantized_states
    from metrale.runtime.backends import load_engine
    from metrale.runtime.components import Role, names_with_role
    from metrale.runtime.artifact.engine_dir import load_manifest

    manifest = load_manifest(engine_dir)
    if backend_kind.runs_graphs:
        check_plans(engine_dir, manifest, draft_tier=draft_tier, mtp_experts_nvfp4=mtp_nvfp4,
                    dtype=dtype, backend=backend_kind.value)
        return load_engine(engine_dir, backend=backend_kind, device=device)
    drafters = tuple(names_with_role(manifest.components, Role.DRAFTER))
    states = requantized_states(engine_dir, manifest, draft_tier=draft_tier, drafters=drafters,
                                mtp_experts_nvfp4=mtp_nvfp4 if "mtp" in manifest.components else None)
    return load_engine(engine_dir, dtype=o.torch_dtype(dtype, device), device=device,
                       backend=backend_kind, states=states)


@app.command()
def bench(
    engine_dir: o.EngineDir,
    json_file: Annotated[Optional[Path], typer.Option("--json", help="Also write the results as JSON to FILE.")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option("--prompts", help="JSON list of prompt strings. Default: the tiny recipe's held-out prompts.")] = None,
    num_prompts: Annotated[Optional[int], typer.Option(help="How many prompts to use (default: 8, or all of a shorter --prompts file).", show_default=False)] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt.")] = 48,
    modes: Annotated[Optional[str], typer.Option(help="Comma-separated substrings: run only modes whose name contains one.")] = None,
    repeats: Annotated[int, typer.Option(help="Runs per prompt and mode, in rounds over all modes; the median counts (stalls of a shared machine move it little and land on every mode alike).")] = 3,
    reference: Annotated[bool, typer.Option("--transformers/--no-transformers", help="Add a row for transformers' eager greedy generate on the same target weights (when transformers is installed).")] = True,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads (default: torch's choice).")] = None,
    device: o.Device = None, dtype: o.Dtype = "auto", backend: o.Backend = "auto",
    draft_weight_quantization: o.BenchDraftTier = None, mtp_experts_nvfp4: o.BenchMtpNvfp4 = None,
    schema_file: Annotated[Optional[Path], typer.Option(
        "--json-schema", metavar="FILE",
        help="A JSON schema every answer is constrained to, as a request's response_format "
             "json_schema constrains it (checked as the server checks one): each mode decodes "
             "under the schema's token mask, its answers compared with plain constrained "
             "decoding's. The cost tables stay unconstrained; no transformers row.")] = None,
):
    """Benchmark plain decoding against every speculative mode on held-out prompts."""
    with user_errors():
        from rich.table import Table

        from metrale.bench_costs import host_ms, mode_bound, step_counts, target_row_costs, transformers_reference
        from metrale.runtime.errors import ConfigError
        from metrale.runtime.backends import resolve_backend

        checks.int_range("--max-tokens", max_tokens, 1)
        checks.int_range("--repeats", repeats, 1)
        if threads is not None:
            checks.int_range("--threads", threads, 1, 1024)
        if json_file is not None:
            checks.output_file("--json", json_file)
        schema = checks.json_schema("--json-schema", schema_file) if schema_file is not None else None
        if schema is not None:  # (needs no model: its grammar is compiled over the bytes)
            _compiles(schema, schema_file)
        wanted = _wanted_modes(modes)
        check_draft_tier(draft_weight_quantization)
        checks.device(device)
        o.torch_dtype(dtype)
        backend_kind, device = resolve_backend(backend, device, dtype)
        path = prompts_file or DEFAULT_PROMPTS
        texts = checks.first_prompts("--num-prompts", num_prompts, checks.prompt_texts("--prompts", path),
                                     path, default=8)
        all_modes = _engine_modes(engine_dir)
        names = [name for name, _ in all_modes]
        if wanted and names and not any(w in name for w in wanted for name in names):
            raise ConfigError(f"--modes {modes!r}: no mode of this engine directory matches; "
                              f"its modes: {', '.join(names)}")
        _check_tier_flags(engine_dir, all_modes, wanted, modes, draft_weight_quantization,
                          mtp_experts_nvfp4)
        checks.max_tokens_fit(max_tokens, checks.context_length(engine_dir))
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        engine = _load_engine(engine_dir, device, dtype, backend_kind, draft_weight_quantization,
                              mtp_experts_nvfp4)
        prompts = [engine.tokenizer.encode(t) for t in texts]
        checks.prompts_fit(prompts, max_tokens, engine.target.config.max_position_embeddings)
        t0 = time.time()
        from metrale.runtime.spec.shapes import TREE_BUDGETS

        wanted = [w.strip() for w in modes.split(",")] if modes else None
        # tree budgets are priced only for a mode that chooses them
        trees = TREE_BUDGETS[0] if not wanted or any(
            w in n for w in wanted for n in names if "tree" in n and "adaptive" in n) else 0
        costs = {name: measure_costs(engine, prompts[:2], max_tokens, name, repeats,
                                     trees if engine.block_distributions(name) else 0)
                 for name in sorted(engine.drafters)} or None
        rows, plain_tokens, plain_tps = [], None, None
        table = [(name, flags) for name, flags in mode_table(engine, costs)
                 if not wanted or name == "plain" or any(w in name for w in wanted)]
        sweeps: list[dict[int, float]] = []  # c(r), one sweep before each prompt's turn
        gens: dict = {}
        runs = run_modes(engine, table, prompts, max_tokens, repeats,
                         between=lambda: sweeps.append(target_row_costs(engine, prompts[0])), generators=gens,
                         json_schema=schema)
        row_costs = {r: round(statistics.median(s[r] for s in sweeps), 4) for r in sweeps[0]}
        for name, flags in table:
            row, outputs = summarize(runs[name], plain_tokens)
            if name == "plain":
                plain_tokens, plain_tps = outputs, row["tokens_per_s"]
                host = host_ms(row, row_costs)
            row["speedup"] = round(row["tokens_per_s"] / plain_tps, 3)
            row.update(mode_bound(row, row_costs, exact=bool(flags.get("exact_verify")), host=host))
            row.update(step_counts(gens[name], prompts[0]))
            shown = {k: str(v) if k == "dflash_adaptive_k" else v for k, v in flags.items()}
            rows.append({"mode": name, "flags": shown, **row})
        ref = transformers_reference(engine, prompts, max_tokens, repeats) if reference and schema is None else None
        if ref is not None:
            same = sum(o[:len(p)] == p for o, p in zip(ref["outputs"], plain_tokens))
            rows.append({"mode": "transformers generate", "tokens_per_s": ref["tokens_per_s"],
                         "speedup": round(ref["tokens_per_s"] / plain_tps, 3),
                         "identical_to_plain": same})
        result = {"engine_dir": str(engine_dir), "prompts": len(prompts), "max_tokens": max_tokens,
                  "backend": engine.backend.name, "backend_note": engine.backend_note, "device": device,
                  "dtype": str(engine.dtype).removeprefix("torch."),
                  "cost_model_ms": {n: str(c) for n, c in (costs or {}).items()} or None,
                  "acceptance": {n: c.acceptance for n, c in (costs or {}).items()} or None,
                  "target_rows_ms": row_costs, "repeats": repeats,
                  "json_schema": None if schema_file is None else str(schema_file),
                  "threads": torch_threads(),
                  "quantization": engine.manifest.build.get("draft_weight_quantization"),
                  "bench_seconds": round(time.time() - t0, 1), "modes": rows}
        if backend_kind.runs_graphs:  # how each graph ran: eager calls, graph replays
            from metrale.runtime.backends.graph_steps import runner_stats

            result["graph_runners"] = runner_stats(engine)
        under = "" if schema_file is None else f", under the JSON schema {schema_file}"
        t = Table(title=Text(f"metrale bench {engine_dir}  ({len(prompts)} prompts × {max_tokens} tokens{under})"))
        for col in ("mode", "tok/s", "τ", "speedup", "bound", "of bound (+h)", "e", "rows/tok",
                    "draft/verify/host", "=plain"):
            t.add_column(col, justify="right" if col != "mode" else "left")
        for r in rows:
            if "tau" not in r:  # the reference row
                t.add_row(r["mode"], f"{r['tokens_per_s']:.1f}", "", f"{r['speedup']:.2f}×", "", "", "", "", "",
                          str(r["identical_to_plain"]))
                continue
            split = r["time_split"]
            t.add_row(r["mode"], f"{r['tokens_per_s']:.1f}", f"{r['tau']:.2f}", f"{r['speedup']:.2f}×",
                      "—" if r["bound"] is None else f"{r['bound']:.2f}×",
                      "—" if r["bound"] is None else f"{r['of_bound']:.2f} ({r['of_bound_host']:.2f})",
                      f"{r['e']:.2f}", f"{r['verify_rows_per_token']:.2f}",
                      f"{split['draft']:.0%}/{split['verify']:.0%}/{split['host']:.0%}",
                      str(r.get("identical_to_plain", "")))
        out.print(t)
        if result["backend_note"]:
            out.print(result["backend_note"])
        out.print(f"backend {result['backend']}; target forward by rows (ms): "
                  + ", ".join(f"{r}:{c:.3f}" for r, c in row_costs.items()))
        for name, cost in (costs or {}).items():
            out.print(Text(f"measured cost model of {name} (ms per step by draft count): {cost}; "
                           f"acceptance per position {cost.acceptance}"))
        if json_file:
            Path(json_file).write_text(json.dumps(result, indent=2) + "\n")
