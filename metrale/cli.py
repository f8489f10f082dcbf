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
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from metrale import checks
from metrale import options as o
from metrale.console import app, err, out, say_warning, user_errors
from metrale.plugins.formats import DRAFT_TIERS
from metrale.runtime.errors import MetraleError
from metrale.runtime.spec.help import BUILD_HELP

# (a help text's "\\[default: ...]": rich reads a bare "[...]" as markup and drops it)
DWQ_HELP = BUILD_HELP["--draft-weight-quantization"]
MTP_NVFP4_HELP = BUILD_HELP["--mtp-experts-nvfp4"]


@app.command()
def build(
    recipe: Annotated[Optional[Path], typer.Option(help="Build recipe (TOML). Default: the embedded tiny recipe.")] = None,
    engine_dir: Annotated[Optional[str], typer.Option("--engine-dir", metavar="PATH", help="Output directory. Default: the recipe's engine_dir.")] = None,
    draft_weight_quantization: Annotated[Optional[str], typer.Option(
        metavar="|".join(DRAFT_TIERS), help=DWQ_HELP)] = None,
    mtp_quantization: Annotated[Optional[str], typer.Option(metavar="bf16|fp8", help="Precision of the MTP head's weights. \\[default: bf16]")] = None,
    mtp_experts_nvfp4: Annotated[Optional[bool], typer.Option("--mtp-experts-nvfp4/--no-mtp-experts-nvfp4", help=MTP_NVFP4_HELP)] = None,
    draft_tp_size: Annotated[Optional[str], typer.Option(metavar="N|auto", help=BUILD_HELP["--draft-tp-size"])] = None,
    trt_flavor: Annotated[Optional[str], typer.Option(metavar="auto|rtx|tensorrt|none", help="TensorRT flavour for engines (built from the ONNX graphs); none builds no engines.")] = None,
    trt_dtype: Annotated[Optional[str], typer.Option(metavar="bfloat16|float32", help="What the ONNX graphs and TensorRT engines compute in (activations and unquantized weights); --dtype auto serves them so. \\[default: bfloat16]")] = None,
    target_sm: Annotated[Optional[str], typer.Option(metavar="89,120", help="Comma-separated SM targets for engines and cubins.")] = None,
    onnx: Annotated[Optional[bool], typer.Option("--onnx/--no-onnx", help="Export each component's step to ONNX (<component>/rank0.onnx): the graphs TensorRT compiles and --backend onnxruntime runs. --no-onnx needs --trt-flavor none. \\[default: --onnx]")] = None,
    cpu_engines: Annotated[Optional[str], typer.Option(metavar="aoti|none", help="CPU engines: aoti compiles the decode loop's steps (the target's decode and verify steps, the MTP head's step, each one-rank drafter's propose with its context update) into AOTInductor packages for this machine's CPU (what --backend auto runs on a CPU); none skips them. \\[default: aoti]")] = None,
):
    """Build an engine directory from a recipe's Hugging Face checkpoints."""
    with user_errors():
        from metrale.builder.build import build_engine
        from metrale.builder.recipe import DEFAULT_RECIPE, load_recipe

        overrides = _build_overrides(draft_weight_quantization, mtp_quantization,
                                     mtp_experts_nvfp4, draft_tp_size, trt_flavor, target_sm,
                                     cpu_engines, trt_dtype, onnx)
        if engine_dir is not None:
            engine_dir = checks.output_dir("--engine-dir", engine_dir)
        r = load_recipe(recipe or DEFAULT_RECIPE)
        _check_build_flags(r.build, overrides, r.mtp is not None)
        r = r.with_build(**overrides)
        if engine_dir is None:
            checks.output_dir(f"the recipe's engine_dir (in {recipe or DEFAULT_RECIPE})", r.engine_dir)
        with _build_progress() as advance:
            report = build_engine(r, engine_dir, progress=advance)
        _print_build(report)


def _build_overrides(dwq, mtpq, nvfp4, tp, flavor, sms, cpu=None, trt_dtype=None, onnx=None) -> dict:
    """The build flags given, checked and worded as flags (the recipe's checks speak keys)."""
    from metrale.builder import recipe as rc

    def one_of(flag: str, value, allowed) -> None:
        if value is not None and value not in allowed:
            raise MetraleError(f"{flag} {value!r}: expected one of {', '.join(allowed)}")

    one_of("--draft-weight-quantization", dwq, rc.DRAFT_WEIGHT_QUANTIZATIONS)
    one_of("--mtp-quantization", mtpq, rc.MTP_QUANTIZATIONS)
    one_of("--trt-flavor", flavor, rc.TRT_FLAVORS)
    one_of("--cpu-engines", cpu, rc.CPU_ENGINES)
    one_of("--trt-dtype", trt_dtype, rc.TRT_DTYPES)
    return {"draft_weight_quantization": dwq, "mtp_quantization": mtpq, "mtp_experts_nvfp4": nvfp4,
            "trt_flavor": flavor, "cpu_engines": cpu, "trt_dtype": trt_dtype, "onnx": onnx,
            "draft_tp_size": None if tp is None else rc.parse_draft_tp_size(tp, "--draft-tp-size"),
            "target_sm": None if sms is None else rc.parse_target_sm(sms, "--target-sm")}


def _check_build_flags(base, overrides: dict, has_mtp: bool) -> None:
    """Cross-flag refusals in the words of the flags typed (recipe values named as such)."""
    from metrale.builder.recipe import MIN_TARGET_SM

    nvfp4 = overrides["mtp_experts_nvfp4"]
    mtpq = overrides["mtp_quantization"] or base.mtp_quantization
    if nvfp4 and mtpq != "bf16":
        given = (f"--mtp-quantization {mtpq}" if overrides["mtp_quantization"]
                 else f"the recipe's mtp_quantization {mtpq!r}")
        raise MetraleError(f"--mtp-experts-nvfp4 needs --mtp-quantization bf16 (the experts are "
                           f"requantized from BF16), got {given}")
    if nvfp4 and not has_mtp:
        raise MetraleError("--mtp-experts-nvfp4 needs an MTP head, and the recipe has no [mtp]")
    flavor = overrides["trt_flavor"] or base.trt_flavor
    if overrides["onnx"] is False and flavor != "none":
        given = f"--trt-flavor {flavor}" if overrides["trt_flavor"] else f"the recipe's trt_flavor {flavor!r}"
        raise MetraleError(f"--no-onnx: TensorRT builds its engines from the ONNX graphs, and {given} "
                           "asks for engines; add --trt-flavor none")
    sms = overrides["target_sm"]
    if sms is not None:
        if any(s < MIN_TARGET_SM for s in sms) or len(set(sms)) != len(sms):
            raise MetraleError(f"--target-sm {','.join(map(str, sms))}: expected distinct SM "
                               f"numbers of at least {MIN_TARGET_SM}, such as 89,120")


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

    from metrale.runtime.artifact.engine_dir import human_size
    from metrale.runtime.artifact.manifest_view import quant_cell

    m = report.manifest
    t = Table(title=Text(f"metrale build → {report.engine_dir}  ({report.seconds:.1f} s)"))
    for col in ("component", "kind", "quantization", "weight bytes"):
        t.add_column(col)
    for name, info in m.components.items():
        t.add_row(*map(Text, (name, info.kind, quant_cell(info),
                              human_size(info.weight_bytes) if info.weight_bytes else "")))
    out.print(t)
    if report.memory_estimate:
        est = Table(title="memory estimate: weight bytes per tier")
        est.add_column("component")
        est.add_column("tier → weight bytes")
        for name, per in report.memory_estimate.items():
            est.add_row(Text(name), Text("   ".join(f"{k} {human_size(v)}" for k, v in per.items())))
        out.print(est)


@app.command()
def inspect(engine_dir: o.EngineDir,
            as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False):
    """Show an engine directory's manifest (verifying every checksum and what loading checks)."""
    with user_errors():
        from rich.table import Table

        from metrale.runtime.artifact.engine import check_engine_dir
        from metrale.runtime.artifact.manifest_view import COMPONENT_COLUMNS, component_rows, manifest_rows

        m = check_engine_dir(engine_dir)
        if as_json:
            sys.stdout.write(m.to_json())
            return
        t = Table(title=Text(str(engine_dir)), show_header=False)
        t.add_column("key", style="bold")
        t.add_column("value")
        for k, v in manifest_rows(m):
            t.add_row(Text(k), Text(v))
        out.print(t)
        c = Table(title="components")
        for col in COMPONENT_COLUMNS:
            c.add_column(col)
        for row in component_rows(m):
            c.add_row(*map(Text, row))
        out.print(c)


NPROC_HELP = ("Run as N processes under torchrun (this command line, re-launched with "
              "`python -m torch.distributed.run --standalone --nproc-per-node N`), e.g. with "
              "--draft-tp-size auto. Default: 1, or the world size of an existing torchrun launch.")
Nproc = Annotated[Optional[int], typer.Option("--nproc", metavar="N", help=NPROC_HELP)]


def _relaunch(nproc: Optional[int], command: str) -> None:
    """Replace this process with torchrun running the same command line when --nproc asks for
    more than one process; refuse a count that contradicts a torchrun launch."""
    from metrale.runtime.errors import ConfigError
    from metrale.runtime.models.tp import env_count, torchrun_argv

    if nproc is None:
        return
    if nproc < 1:
        raise ConfigError(f"--nproc: expected a process count of at least 1, got {nproc}")
    most = max(os.cpu_count() or 1, 8)  # one machine (torchrun --standalone): one rank per core
    if nproc > most:
        raise ConfigError(f"--nproc: expected a process count of at most {most} (ranks run on "
                          f"this machine), got {nproc}")
    world = os.environ.get("WORLD_SIZE")
    if world is not None:
        if env_count("WORLD_SIZE", 1) != nproc:
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


def sampling_params(temperature: float, top_p: float, seed: Optional[int], max_tokens: int):
    """`SamplingParams` from the flags (their rules are the sampling fields' own); a refusal
    names the flag, its value and what is allowed."""
    from metrale.runtime.spec.sampling import SamplingError, SamplingParams

    try:
        return SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens)
    except SamplingError as exc:
        raise MetraleError(f"--{exc.field.replace('_', '-')} {exc.value!r}: expected {exc.allowed}") from None


def _load(engine_dir: Path, device: str, dtype: str, spec, backend: str = "auto"):
    from metrale.runtime.backends import Backend
    from metrale.runtime.artifact.engine_dir import load_manifest
    from metrale.runtime.serving.service import load_generator

    tiers = spec.draft_weight_quantization is not None or spec.mtp_experts_nvfp4 is not None
    if Backend.parse(backend).runs_graphs:  # the graphs hold the built tiers: refuse others
        from metrale.builder.requantize import check_plans

        check_plans(engine_dir, load_manifest(engine_dir), draft_tier=spec.draft_weight_quantization,
                    mtp_experts_nvfp4=spec.mtp_experts_nvfp4, dtype=dtype, backend=backend)
        return load_generator(engine_dir, spec, device=device, backend=backend)
    states = None
    if tiers:  # another tier than the built one: quantized at load from the declared weights
        from metrale.builder.requantize import states_for

        states = states_for(engine_dir, load_manifest(engine_dir), spec)
    return load_generator(engine_dir, spec, dtype=o.torch_dtype(dtype, device), device=device,
                          backend=backend, states=states)


def _resolved_backend(device, dtype, backend: str, nproc=None):
    """--device and --dtype checked, --backend resolved against them -> (Backend, device)."""
    from metrale.runtime.backends import resolve_backend

    checks.device(device)
    o.torch_dtype(dtype)
    return resolve_backend(backend, device, dtype, nproc)


def _load_leader(nproc, command: str, engine_dir, device, dtype, spec, backend: str = "auto"):
    """Check --backend against --device/--dtype/--nproc, relaunch under torchrun when asked,
    load, and on a follower rank serve the leader's proposes until it shuts down: returns the
    generator on the leader rank, None elsewhere."""
    backend, device = _resolved_backend(device, dtype, backend, nproc)
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
    device: o.Device = None, dtype: o.Dtype = "auto", backend: o.Backend = "auto",
    nproc: Nproc = None, spec=None,
):
    """Generate text for one prompt."""
    with user_errors():
        checks.text("--prompt", prompt)
        params = sampling_params(temperature, top_p, seed, max_tokens)
        context = checks.context_length(engine_dir)
        checks.max_tokens_fit(max_tokens, context)
        gen = _load_leader(nproc, "generate", engine_dir, device, dtype, spec, backend)
        if gen is None:
            return
        text_in = gen.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        ids = gen.tokenizer.encode(text_in)
        try:
            if not ids:
                raise MetraleError(f"--prompt {prompt!r}: encodes to no tokens")
            checks.max_tokens_fit(max_tokens, gen.max_context, len(ids))
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
                "mode": spec.mode.value, "backend": gen.engine.backend.name,
                "backend_note": gen.engine.backend_note}) + "\n")
        else:
            sys.stdout.write(text + "\n")


API_KEY_HELP = ("Require `Authorization: Bearer KEY` on every /v1/* request (/health and /metrics "
                "stay open). Read from METRALE_API_KEY when the flag is not given.")


@app.command()
@o.with_spec_flags(lambda: user_errors())
def serve(
    engine_dir: o.EngineDir,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(envvar="METRALE_API_KEY", show_envvar=False,
                                                   metavar="KEY", help=API_KEY_HELP)] = None,
    max_request_bytes: Annotated[Optional[int], typer.Option(
        metavar="N", help="Largest request body accepted (413 beyond). Default: 1 MiB plus 64 "
        "bytes per token of the model's context window.")] = None,
    max_queue: Annotated[int, typer.Option(
        metavar="N", help="Generation requests admitted at once, running or waiting for the "
        "model; beyond it a request gets 503 with Retry-After.")] = 64,
    max_connections: Annotated[int, typer.Option(
        metavar="N", help="Open connections served at once; beyond it 503.")] = 256,
    max_num_seqs: Annotated[int, typer.Option(
        metavar="N", help="Requests running at once: every iteration advances each of them by "
        "one decode step (speculative or not), their target rows in one batched forward, so a "
        "short request runs alongside a long one; the other admitted requests wait in arrival "
        "order. Each request keeps its own caches and sampling state and each row reads only "
        "its own sequence's cache, so its answer is the one it gets alone. 1 in a "
        "tensor-parallel world.")] = 64,
    speculative_disable_by_batch_size: Annotated[int, typer.Option(
        metavar="N", help="Speculation backs off under load: while N or more requests run, "
        "every step is a plain one (the drafters still follow the text, so drafting resumes "
        "once fewer than N have run for 0.1 s: clients in a closed loop leave the batch for "
        "moments between their requests). Greedy answers do not change; a seeded sampled request keeps "
        "drafting as if alone, so its samples do not depend on the load. With two or more "
        "requests running, DFlash draft counts come from --dflash-draft-ladder or γ: "
        "--dflash-adaptive-k applies to a stream that runs alone; the MTP draft chains of all "
        "drafting requests run as one head forward per link. The default, 2, drafts only "
        "for a request that runs alone: on a CPU each batched row costs about what it costs "
        "alone, so the verify rows of several streams cost more than their drafts save. "
        "1: never draft.")] = 2,
    prefix_cache_tokens: Annotated[int, typer.Option(
        metavar="N", help="Prefix caching: prompts' K/V and rows are kept, up to N prompt "
        "positions in all (least recently used evicted first), and a prompt that starts as a "
        "kept one reuses those positions, in whole blocks of 16 tokens (a prompt seen whole runs "
        "nothing), so only the rest of it is prefilled. Answers do not change: a row's bits "
        "depend only on its token, position and its sequence's cache. The aoti backend's; 0 "
        "turns it off (vLLM's --no-enable-prefix-caching). /metrics counts the positions "
        "looked up and reused.")] = 8192,
    engine_process: Annotated[bool, typer.Option(
        "--engine-process/--no-engine-process", help="Run the scheduler and the models in a "
        "process of their own, the HTTP server (parsing, tokenizing, responses) in this one, so "
        "neither waits for the other's interpreter lock (as vLLM's API server and engine core). "
        "A tensor-parallel world (--nproc) serves in one process.")] = True,
    device: o.Device = None, dtype: o.Dtype = "auto", backend: o.Backend = "auto",
    nproc: Nproc = None, spec=None,
):
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /metrics)."""
    with user_errors():
        from metrale.runtime.errors import ConfigError
        from metrale.runtime.serving.http_guard import ServerLimits
        from metrale.runtime.serving.server import serve as run_server

        checks.host(host)
        checks.port(port)
        if os.environ.get("METRALE_API_KEY") == "" and api_key is None:  # (read as unset)
            raise ConfigError("METRALE_API_KEY is set but empty; unset it to serve without a key, "
                              "or give the key")
        checks.int_range("--prefix-cache-tokens", prefix_cache_tokens, 0)
        limits = ServerLimits(max_request_bytes=max_request_bytes, max_queue=max_queue,
                              max_connections=max_connections, max_num_seqs=max_num_seqs,
                              speculative_disable_by_batch_size=speculative_disable_by_batch_size,
                              api_key=api_key)
        checks.bindable(host, port)
        if api_key is None and not checks.is_loopback(host):
            say_warning(f"--host {host} accepts connections from other machines and no --api-key "
                        "(or METRALE_API_KEY) is set: anyone who can reach it can use the model")
        if engine_process and not nproc:
            _serve_from_engine_process(engine_dir, device, dtype, spec, backend, host, port, limits,
                                       prefix_cache_tokens)
            return
        gen = _load_leader(nproc, "serve", engine_dir, device, dtype, spec, backend)
        if gen is None:
            return
        engine = gen.engine
        cached = bool(prefix_cache_tokens) and gen.cache_prefixes(prefix_cache_tokens) is not None
        _say_serving(engine_dir, spec, host, port, {
            "backend": engine.backend.name, "backend_note": engine.backend_note,
            "requantized": engine.requantized, "prefix_cache": cached},
            prefix_cache_tokens, gen.world.size)
        try:
            run_server(gen, host=host, port=port, limits=limits)
        finally:
            gen.shutdown()
        gen.world.close()


def _say_serving(engine_dir, spec, host: str, port: int, info: dict, prefix_cache_tokens: int,
                 ranks: int = 1) -> None:
    err.print(Text(f"serving {engine_dir} (speculation {spec.mode.value}, backend {info['backend']}) "
                   f"on http://{host}:{port}" + (f", {ranks} ranks" if ranks > 1 else "")))
    if info["backend_note"]:
        err.print(Text(info["backend_note"]))
    if prefix_cache_tokens and not info["prefix_cache"]:
        err.print(Text(f"prefix caching is the aoti backend's: on the {info['backend']} backend "
                       "every prompt is prefilled"))
    for name, source in info["requantized"].items():
        err.print(Text(f"{name}: {source}"))


def _serve_from_engine_process(engine_dir, device, dtype, spec, backend, host, port, limits,
                               prefix_cache_tokens: int) -> None:
    """`serve` with the models in the engine process (`serving.engine_process`)."""
    import functools

    import msgspec

    from metrale.runtime.serving.engine_process import EngineProcess, EngineProxy
    from metrale.runtime.serving.server import serve as run_server

    kind, device = _resolved_backend(device, dtype, backend)
    engine = EngineProcess(functools.partial(_load, engine_dir, device, dtype, spec, kind.value),
                           limits.max_num_seqs, limits.speculative_disable_by_batch_size,
                           prefix_cache_tokens)
    try:
        _say_serving(engine_dir, spec, host, port, msgspec.structs.asdict(engine.info), prefix_cache_tokens)
        run_server(EngineProxy(engine), host=host, port=port, limits=limits, engine=engine)
    finally:
        engine.close()


def main() -> None:  # pragma: no cover
    app()


from metrale import bench as _bench  # noqa: E402,F401  (registers `metrale bench`)
from metrale import calibrate as _calibrate  # noqa: E402,F401  (registers `metrale calibrate`)
