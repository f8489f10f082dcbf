"""The `metrale` command line: build, inspect, generate, serve, bench.

Flags are kebab-case and map one-to-one onto config fields (`BuildOptions`,
`SpeculativeConfig`, `SamplingParams`); every value is validated there, before any model loads.
A `MetraleError` is printed as one line naming the flag or file — never a traceback.
`generate` and `serve` run as one process or as every rank of a `torchrun` launch (`--nproc N`
re-runs the same command line under torchrun); only rank 0 prints and serves.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from metrale import options as o
from metrale.runtime.errors import MetraleError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Ahead-of-time engine builder and serving runtime for speculative decoding.")
err = Console(stderr=True)
out = Console()


@contextlib.contextmanager
def user_errors():
    try:
        yield
    except MetraleError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


DWQ_HELP = (
    "Format of the DFlash drafters' GEMM weights; activations stay BF16 at every tier and only "
    "the drafts move (the target verifies every token). declared: the checkpoint's own weights. "
    "fp8: FP8 E4M3 copies, one scale per row, of each layer's q/k/v/o/gate/up/down and of the "
    "draft LM head. fp8-aux: fp8 plus FP8 copies of the context fc and K/V projections and the "
    "DFlash2 conv and selector projections. nvfp4: NVFP4 copies (4-bit E2M1, one FP8 scale per "
    "16 weights) of everything fp8-aux copies, run as W4A16; each tensor's scale comes from the "
    "whole unsharded tensor, so --draft-tp-size ranks hold exactly the one-rank drafter's bytes."
)
MTP_NVFP4_HELP = (
    "Draft on NVFP4 copies of a BF16 MoE MTP head's experts. The head's routed and shared experts "
    "are requantized from BF16 to NVFP4; the router, attention, fc and draft LM head keep the "
    "head's precision. Draft-only: the target verifies every drafted token, so only how many "
    "drafts are accepted moves. Under --exact-verify greedy output is byte-identical with it on "
    "or off; under the default chunkwise verify, like any change in acceptance, it can move "
    "greedy text. Refused on any other head (dense FFN, FP8 experts, or --mtp-quantization other "
    "than bf16)."
)


@app.command()
def build(
    recipe: Annotated[Optional[Path], typer.Option(help="Build recipe (TOML). Default: the embedded tiny recipe.")] = None,
    engine_dir: Annotated[Optional[Path], typer.Option("--engine-dir", help="Output directory. Default: the recipe's engine_dir.")] = None,
    draft_weight_quantization: Annotated[Optional[str], typer.Option(
        metavar="declared|fp8|fp8-aux|nvfp4", help=DWQ_HELP + " [default: fp8]")] = None,
    mtp_quantization: Annotated[Optional[str], typer.Option(metavar="bf16|fp8", help="Precision of the MTP head's weights. [default: bf16]")] = None,
    mtp_experts_nvfp4: Annotated[Optional[bool], typer.Option("--mtp-experts-nvfp4/--no-mtp-experts-nvfp4", help=MTP_NVFP4_HELP + " [default: off]")] = None,
    draft_tp_size: Annotated[Optional[str], typer.Option(metavar="auto|N", help="Tensor-parallel shards of the drafters: auto (1 at build time) or a rank count.")] = None,
    trt_flavor: Annotated[Optional[str], typer.Option(metavar="auto|rtx|tensorrt|none", help="TensorRT flavour for engines; none writes weights only.")] = None,
    target_sm: Annotated[Optional[str], typer.Option(metavar="89,120", help="Comma-separated SM targets for engines and cubins.")] = None,
    cpu_engines: Annotated[Optional[str], typer.Option(metavar="aoti|none", help="CPU engines: aoti compiles the target's decode and verify steps into AOTInductor packages for this machine's CPU (what --backend auto runs on a CPU); none skips them. [default: aoti]")] = None,
):
    """Build an engine directory from a recipe's Hugging Face checkpoints."""
    with user_errors():
        from metrale.builder.build import build_engine
        from metrale.builder.recipe import DEFAULT_RECIPE, load_recipe, parse_draft_tp_size, parse_target_sm

        r = load_recipe(recipe or DEFAULT_RECIPE)
        r = r.with_build(
            draft_weight_quantization=draft_weight_quantization, mtp_quantization=mtp_quantization,
            mtp_experts_nvfp4=mtp_experts_nvfp4,
            draft_tp_size=None if draft_tp_size is None else parse_draft_tp_size(draft_tp_size),
            trt_flavor=trt_flavor, target_sm=None if target_sm is None else parse_target_sm(target_sm),
            cpu_engines=cpu_engines)
        with _build_progress() as advance:
            report = build_engine(r, engine_dir, progress=advance)
        _print_build(report)


@contextlib.contextmanager
def _build_progress():
    """A rich progress bar over the build's steps; yields the builder's `progress` callback."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                  TextColumn("{task.completed} steps"), TimeElapsedColumn(), console=err,
                  transient=True) as bar:
        task = bar.add_task("building", total=None)

        def advance(message: str) -> None:
            bar.update(task, description=message, advance=1)

        yield advance


def _print_build(report) -> None:
    from rich.table import Table

    from metrale.runtime.engine_dir import human_size
    from metrale.runtime.manifest_view import quant_cell

    m = report.manifest
    t = Table(title=f"metrale build → {report.engine_dir}  ({report.seconds:.1f} s)")
    for col in ("component", "kind", "quantization", "weight bytes"):
        t.add_column(col)
    for name, info in m.components.items():
        t.add_row(name, info.get("kind", ""), quant_cell(info.get("quantization")),
                  human_size(info.get("weight_bytes", 0)) if info.get("weight_bytes") else "")
    out.print(t)
    if report.memory_estimate:
        est = Table(title="memory estimate: weight bytes per tier")
        est.add_column("component")
        est.add_column("tier → weight bytes")
        for name, per in report.memory_estimate.items():
            est.add_row(name, "   ".join(f"{k} {human_size(v)}" for k, v in per.items()))
        out.print(est)


@app.command()
def inspect(engine_dir: o.EngineDir,
            as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False):
    """Show an engine directory's manifest (verifying every checksum)."""
    with user_errors():
        from rich.table import Table

        from metrale.runtime.engine_dir import load_manifest
        from metrale.runtime.manifest_view import COMPONENT_COLUMNS, component_rows, manifest_rows

        m = load_manifest(engine_dir)
        if as_json:
            sys.stdout.write(m.to_json())
            return
        t = Table(title=str(engine_dir), show_header=False)
        t.add_column("key", style="bold")
        t.add_column("value")
        for k, v in manifest_rows(m):
            t.add_row(k, v)
        out.print(t)
        c = Table(title="components")
        for col in COMPONENT_COLUMNS:
            c.add_column(col)
        for row in component_rows(m):
            c.add_row(*row)
        out.print(c)


NPROC_HELP = ("Run as N processes under torchrun (this command line, re-launched with "
              "`python -m torch.distributed.run --standalone --nproc-per-node N`), e.g. with "
              "--draft-tp-size auto. Default: 1, or the world size of an existing torchrun launch.")
Nproc = Annotated[Optional[int], typer.Option("--nproc", metavar="N", help=NPROC_HELP)]


def _relaunch(nproc: Optional[int], command: str) -> None:
    """Replace this process with torchrun running the same command line when --nproc asks for
    more than one process; refuse a count that contradicts a torchrun launch."""
    import os

    from metrale.runtime.errors import ConfigError
    from metrale.runtime.tp import torchrun_argv

    if nproc is None:
        return
    if nproc < 1:
        raise ConfigError(f"--nproc: expected a process count of at least 1, got {nproc}")
    world = os.environ.get("WORLD_SIZE")
    if world is not None:
        if int(world) != nproc:
            raise ConfigError(f"--nproc {nproc}: this process is one of {world} launched by torchrun; "
                              f"expected --nproc {world} or none")
        return
    if nproc == 1:
        return
    argv = sys.argv[1:]
    if not argv or argv[0] != command:
        raise ConfigError(f"--nproc re-runs the command line, which must start with {command!r}")
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            kept.append(arg)
    cmd = torchrun_argv(nproc, kept)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)  # torchrun takes this process's place: signals reach it directly


def _load(engine_dir: Path, device: str, dtype: str, spec, backend: str = "auto"):
    if backend == "tensorrt":
        from metrale.runtime.trt_backend import load_trt_generator

        return load_trt_generator(engine_dir, spec, device=device)
    from metrale.runtime.service import load_generator

    return load_generator(engine_dir, spec, dtype=o.torch_dtype(dtype), device=device, backend=backend)


def _load_leader(nproc, command: str, engine_dir, device, dtype, spec, backend: str = "auto"):
    """Check --backend against --device/--dtype/--nproc, relaunch under torchrun when asked,
    load, and on a follower rank serve the leader's proposes until it shuts down: returns the
    generator on the leader rank, None elsewhere."""
    from metrale.runtime.trt_backend import resolve_backend

    backend, device = resolve_backend(backend, device, dtype, nproc)
    _relaunch(nproc, command)
    gen = _load(engine_dir, device, dtype, spec, backend.value)
    if gen.world.leader:
        return gen
    gen.follow()
    gen.world.close()
    return None


@app.command()
@o.with_spec_flags(lambda: user_errors())
def generate(
    engine_dir: o.EngineDir,
    prompt: Annotated[str, typer.Option(help="The prompt text.")],
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass, 0 < P <= 1.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for sampling.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the tokenizer's chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON line: text, token ids, per-step accepted counts, tau, tokens/s.")] = False,
    device: o.Device = None, dtype: o.Dtype = "float32", backend: o.Backend = "auto",
    nproc: Nproc = None, spec=None,
):
    """Generate text for one prompt."""
    with user_errors():
        from metrale.runtime.sampling import SamplingParams

        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens)
        gen = _load_leader(nproc, "generate", engine_dir, device, dtype, spec, backend)
        if gen is None:
            return
        text_in = gen.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        ids = gen.tokenizer.encode(text_in)
        try:
            result = gen.generate(ids, params)
        finally:
            gen.shutdown()
        gen.world.close()
        text = gen.tokenizer.decode(result.token_ids)
        if as_json:
            m = result.metrics
            sys.stdout.write(json.dumps({
                "text": text, "prompt_token_ids": ids, "token_ids": result.token_ids,
                "finish_reason": result.finish_reason, "accepted_per_step": [s.accepted for s in result.steps],
                "drafted_per_step": [s.drafted for s in result.steps], "steps": m.steps, "tau": m.tau,
                "tokens_per_s": round(result.tokens_per_s, 2), "seconds": round(result.seconds, 4),
                "mode": spec.mode.value, "backend": getattr(gen.engine, "backend", backend),
                "backend_note": getattr(gen.engine, "backend_note", "")}) + "\n")
        else:
            sys.stdout.write(text + "\n")


@app.command()
@o.with_spec_flags(lambda: user_errors())
def serve(
    engine_dir: o.EngineDir,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8000,
    device: o.Device = None, dtype: o.Dtype = "float32", backend: o.Backend = "auto",
    nproc: Nproc = None, spec=None,
):
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /metrics)."""
    with user_errors():
        from metrale.runtime.server import serve as run_server

        gen = _load_leader(nproc, "serve", engine_dir, device, dtype, spec, backend)
        if gen is None:
            return
        err.print(f"serving {engine_dir} ({spec.mode.value}) on http://{host}:{port}"
                  + (f", {gen.world.size} ranks" if gen.world.size > 1 else ""))
        try:
            run_server(gen, host=host, port=port)
        finally:
            gen.shutdown()
        gen.world.close()


def main() -> None:  # pragma: no cover
    app()


from metrale import bench as _bench  # noqa: E402,F401  (registers `metrale bench`)
from metrale import calibrate as _calibrate  # noqa: E402,F401  (registers `metrale calibrate`)
