"""CPU engines: the decode loop's steps compiled ahead of time into AOTInductor packages.

Per component (see `backends.aoti_steps`): the target's batched step (`BatchedTreeTargetStep`: 1
to `TARGET_ROWS` rows of any number of sequences, over cache pools, draft trees' rows among them), the MTP head's (`BatchedMTPStep`:
1 to `MTP_ROWS` rows of any number of draft chains, likewise), and one feed-and-propose step per
DFlash/DFlash2 drafter (`BatchedDFlashStep`: the blocks of up to `DRAFT_BLOCKS` sequences) (tensor-
parallel drafters keep running eagerly): four packages for the tiny default. Each is built over
the staged model (loaded back exactly as serve loads it, then packed), exported with
`torch.export` with the caches' slot count as a dynamic dimension (and, for the target and the
head, the row count: one package for every row count, as fast per call as one of fixed rows,
with no padding rows), and compiled with `torch._inductor.aoti_compile_and_package`:
inductor `freezing` (weights are constants, so its CPU code is specialised to them) and
max-autotune with its C++ micro-GEMM templates for the projections (the drafters' steps
without them); on an x86 machine with AVX-512 or AVX2 (float32) the target's and the head's
routed experts, every step's projections and every batched step's attention are metrale's own
kernels (`plugins.cpu_moe`, `plugins.cpu_linear`, `plugins.cpu_attention`), linked into the
package. Packages compile in parallel worker processes,
one thread each.

After compiling, the build checks what the runtime relies on, on random prompts: each row of
a target call over several sequences (prefills, verifies and plain steps, chunked differently,
in two pools) is bit-identical to the same sequence's one-row steps run alone;
the target's and the MTP head's outputs match the eager models within 1e-4; the drafters'
proposals from the packages equal the eager drafters' (the share that does is recorded; below
0.9 the build is refused). Where the target's GEMM templates give rows that differ between row
counts, its packages are compiled again with every projection written as a reduction
(`linear="rowwise"`, row-invariant by construction); a failure then refuses the build.

Compiled packages are cached by content (the component's staged weights, the package's
shape, the torch/ISA/dtype fingerprint and the source of the modules it is compiled from), so
rebuilding an unchanged engine copies them instead of compiling again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path

import torch

from metrale.builder.cpu_check import check_packages, load_packed
from metrale.plugins import cpu_attention, cpu_kernels, cpu_linear, cpu_moe, cpu_panels
from metrale.plugins.dynamic_conv import inductor_decompositions
from metrale.runtime.artifact.entries import ComponentEntry, CpuPackages
from metrale.runtime.components import Role, kind_named, kind_of

log = logging.getLogger(__name__)

TARGET_ROWS = 64  # most rows of a target step: every running sequence's rows, prompt chunks
MAX_POOL = 4096  # most sequences one cache pool of the batched target step holds
MTP_ROWS = 64  # most rows of a head step: every drafting sequence's chain step, kept rows, prompts
FEED_ROWS = 8  # context rows a propose feeds at once, per sequence
DRAFT_BLOCKS = 64  # most sequences' blocks one drafter call proposes
FED_ROWS = FEED_ROWS * DRAFT_BLOCKS  # most context rows one drafter call feeds, its sequences' together
THREADS = 1
# Both: a pointwise result read by a reduction is computed once, not inlined into the
# reduction's loop (inductor's default derives the normed, roped queries again for every cache
# slot, several times the attention's own work), and indirect indices are not bounds-checked
# inside the loops (the faces check every position against its cache, and token ids are checked
# on entry).
_LOOPS = {"realize_reads_threshold": 1, "assert_indirect_indexing": False}
# The drafters' batched step is compiled without the micro-GEMM templates (with them it gives
# wrong drafts, then crashes, for more blocks than its example has): "kernel", its projections
# metrale's kernel (`uses_linear_kernel`) where the kernels build, else "extern", the GEMM
# library's (not row-invariant across row counts; a drafter's package only moves drafts).
_NO_TEMPLATES = {"freezing": True, **_LOOPS}
INDUCTOR = {"gemm": {**_NO_TEMPLATES, "max_autotune": True, "max_autotune_gemm_backends": "CPP"},
            "rowwise": _NO_TEMPLATES, "kernel": _NO_TEMPLATES, "extern": _NO_TEMPLATES}
# the projections `uses_linear_kernel` swaps for the kernel where they are plain bias-free
# linears: attention outputs, LM heads, the MTP head's and the drafters' context projections,
# the drafters' stacked context K/V, DFlash2's conv kernels and selector query
KERNEL_LINEARS = ("o_proj", "lm_head", "fc", "context_kv_proj", "kernel_projection", "hidden_projection")


def cache_dir() -> Path:
    base = os.environ.get("METRALE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "metrale")
    return Path(base) / "aoti"


def max_slots(target_config) -> int:
    """The most cache slots a request may use: its context, a drafter's chain or block past it
    and a padded step, rounded up (see `backends.aoti.slots_for`)."""
    from metrale.runtime.backends.aoti import SLOT_ALIGN

    need = target_config.max_position_embeddings + 192
    return -(-need // SLOT_ALIGN) * SLOT_ALIGN


@dataclass(frozen=True)
class Job:
    """One package: component `name` of manifest kind `kind` (`components.KINDS`), `rows`
    (target, head) or the feed rows (drafter), written to `rel` in the engine directory;
    `tables`: a DFlash2 drafter's propose that also gives its selector's tables (a draft
    tree's, which a chain's propose does not pay for)."""

    name: str
    kind: str
    rows: int
    rel: str
    linear: str = "gemm"
    tables: bool = False


def _sources_digest() -> str:
    import metrale.plugins.dynamic_conv as conv
    import metrale.runtime.backends.aoti_steps as steps
    import metrale.runtime.models.dflash as dflash
    import metrale.runtime.models.layers as layers
    import metrale.runtime.models.mtp as mtp
    import metrale.runtime.models.qwen3 as qwen3
    import metrale.runtime.models.step_caches as caches

    h = hashlib.sha256()
    for mod in (steps, caches, layers, qwen3, mtp, dflash, conv, cpu_moe, cpu_linear, cpu_panels, cpu_attention, cpu_kernels):
        h.update(Path(mod.__file__).read_bytes())
    h.update(cpu_kernels.digest().encode())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def step_and_example(job: Job, staged, taps: tuple[int, ...], slots: int, example_slots: int = 128):
    """The step module of `job` and example inputs with their dynamic shapes: every package is
    batched, over cache pools (per layer K [B, nkv, hd, S], V [B, S, nkv, hd]) whose sequence and
    slot counts are dynamic, as are its row (or block) counts."""
    from metrale.runtime.backends.aoti_steps import BatchedDFlashStep, BatchedMTPStep, BatchedTreeTargetStep

    target = staged.target
    dtype = target.dtype
    positions = slots + 64
    S = torch.export.Dim("slots", min=16, max=slots)
    B = torch.export.Dim("seqs", min=1, max=MAX_POOL)
    R = torch.export.Dim("rows", min=1, max=job.rows)  # target and head: any row count up to rows

    def pools(d):
        """Example pools of a decoder's layers (two sequences) and their dynamic shapes."""
        k = torch.zeros(2, d.num_key_value_heads, d.head_dim, example_slots, dtype=dtype)
        v = torch.zeros(2, example_slots, d.num_key_value_heads, d.head_dim, dtype=dtype)
        n = d.num_hidden_layers
        return [t.clone() for _ in range(n) for t in (k, v)], tuple(x for _ in range(n) for x in ({0: B, 3: S}, {0: B, 1: S}))

    role = kind_named(job.kind).role
    rows = torch.zeros(job.rows, dtype=torch.long)
    if role is Role.TARGET:
        step = BatchedTreeTargetStep(target, taps, job.linear, positions)
        kv, kv_dyn = pools(target.config)
        M = torch.export.Dim("logit_rows", min=1, max=job.rows)
        args = (rows, rows.clone(), rows.clone(), torch.arange(job.rows), rows.clone(), *kv)
        dyn = ({0: R}, {0: R}, {0: R}, {0: M}, {0: R}, kv_dyn)
    elif role is Role.HEAD:
        d = staged.mtp.config.decoder
        step = BatchedMTPStep(staged.mtp, positions)
        hid = torch.zeros(job.rows, d.hidden_size, dtype=dtype)
        (k, v), kv_dyn = pools(replace(d, num_hidden_layers=1))  # the head's one layer
        args = (hid, hid.clone(), rows, rows.clone(), k, v)
        dyn = ({0: R}, {0: R}, {0: R}, {0: R}, *kv_dyn)
    else:
        drafter = staged.drafters[job.name]
        cfg = drafter.config
        step = BatchedDFlashStep(drafter, target.model.embed_tokens, job.rows, positions, distributions=True,
                                 tables=job.tables)
        fed, blocks = 2 * job.rows, 3  # example sizes; both dynamic
        feats = torch.zeros(fed, cfg.num_context_features * cfg.target_hidden_size, dtype=dtype)
        per_block = torch.zeros(blocks, dtype=torch.long)
        kv, kv_dyn = pools(cfg.decoder)
        NF = torch.export.Dim("fed_rows", min=1, max=job.rows * DRAFT_BLOCKS)
        Q = torch.export.Dim("blocks", min=1, max=DRAFT_BLOCKS)
        args = (feats, torch.zeros(fed, dtype=torch.long), torch.zeros(fed, dtype=torch.long),
                torch.zeros(blocks, cfg.block_size, dtype=torch.long), per_block, per_block.clone(),
                per_block + cfg.block_size, *kv)
        dyn = ({0: NF}, {0: NF}, {0: NF}, {0: Q}, {0: Q}, {0: Q}, {0: Q}, kv_dyn)
    return step.eval(), args, dyn


def uses_moe_kernel(job: Job, step: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether `job`'s step runs its routed experts through the CPU kernel (`plugins.cpu_moe`):
    a target or head step of float32 where the kernels build (`cpu_kernels.available`), whose
    experts' sizes are whole vectors (`cpu_moe.fits`); its MoE layers are marked so."""
    from metrale.runtime.models.layers import MoE

    layers = [m for m in step.modules() if isinstance(m, MoE) and m.experts_gate_up is not None]
    use = (bool(layers) and job.linear != "extern" and cpu_kernels.available(dtype)
           and all(cpu_moe.fits(*m.experts_down.shape[1:]) for m in layers))
    if use:
        for m in layers:
            m.use_routed_kernel()
    return use


def uses_linear_kernel(job: Job, step: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether `job`'s step computes its projections through the CPU kernel
    (`plugins.cpu_linear`): any step of float32 where the kernels build, but a drafter's
    compiled with the GEMM library's (`linear="extern"`). Then every fused q/k/v projection
    (`Attention.use_linear_kernel`), every dense MLP's fused gate/up projection
    (`MLP.use_linear_kernel`; a MoE's experts have their own kernel) and every bias-free linear
    of `KERNEL_LINEARS` or an MLP's `down_proj` whose outputs are whole panels
    (`cpu_linear.fits`) goes through it, and so does every MoE router, its few columns padded to
    a panel (so narrow a matrix is a slow shape for inductor's GEMM)."""
    from metrale.runtime.models.layers import MLP, Attention, MoE

    if job.linear == "extern" or not cpu_kernels.available(dtype):
        return False
    experts = {id(m) for moe in step.modules() if isinstance(moe, MoE) for m in moe.experts.modules()}
    used = False
    for mod in list(step.modules()):
        if id(mod) in experts:
            continue
        if isinstance(mod, Attention) and mod.qkv_weight is not None and cpu_linear.fits(*mod.qkv_weight.shape[::-1]):
            mod.use_linear_kernel()
            used = True
        if isinstance(mod, MLP) and mod.gate_up_weight is not None and cpu_linear.fits(*mod.gate_up_weight.shape[::-1]):
            mod.use_linear_kernel()
            used = True
        for name in (*KERNEL_LINEARS, *(("down_proj",) if isinstance(mod, MLP) else ())):
            lin = getattr(mod, name, None)
            if type(lin) is torch.nn.Linear and lin.bias is None and cpu_linear.fits(lin.in_features, lin.out_features):
                setattr(mod, name, cpu_linear.KernelLinear.of(lin))
                used = True
        if isinstance(mod, MoE) and type(mod.gate) is torch.nn.Linear and mod.gate.bias is None:
            mod.gate = cpu_linear.KernelLinear.of(mod.gate, pad=True)
            used = True
    return used


def uses_attention_kernel(step: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether `step` (a batched step, its attention's sizes in `step.decoder`) attends through
    the CPU kernel (`plugins.cpu_attention`): float32 where the kernels build, heads of whole
    vectors (`cpu_attention.fits`); the step is marked so."""
    d = getattr(step, "decoder", None)
    use = (hasattr(step, "attention_kernel") and cpu_kernels.available(dtype)
           and cpu_attention.fits(d.head_dim, d.num_attention_heads, d.num_key_value_heads))
    if use:
        step.attention_kernel = True
    return use


def _compile_one(root: str, job: Job, kinds: dict[str, ComponentEntry], taps: tuple[int, ...], slots: int,
                 out: str, dtype_name: str) -> float:
    """Worker: export and compile one package to `out`; returns the seconds it took."""
    import torch._inductor

    torch.set_num_threads(THREADS)
    t0 = time.time()
    dtype = getattr(torch, dtype_name)
    staged = load_packed(Path(root), kinds, dtype)
    step, args, dyn = step_and_example(job, staged, taps, slots)
    configs = dict(INDUCTOR[job.linear])
    moe = uses_moe_kernel(job, step, dtype)
    projections = uses_linear_kernel(job, step, dtype)
    if uses_attention_kernel(step, dtype) or moe or projections:
        configs.update(cpu_kernels.inductor_configs(cache_dir() / "kernels"))
    with torch.inference_mode():
        ep = torch.export.export(step, args, dynamic_shapes=dyn)
        ep = ep.run_decompositions(inductor_decompositions())  # DFlash2's conv op, as its math
    torch._inductor.aoti_compile_and_package(ep, package_path=out, inductor_configs=configs)
    return time.time() - t0


def build_cpu_packages(w, components: dict[str, ComponentEntry], taps: tuple[int, ...], progress,
                       dtype: torch.dtype = torch.float32, workers: int = 2) -> dict[str, CpuPackages]:
    """Compile (or take from the cache) every package into `<component>/cpu/` of the staging
    directory `w.path`; returns each component's manifest `cpu` entry. `components` maps the
    names written so far to their manifest entries."""
    from metrale.runtime.backends.aoti import build_fingerprint
    from metrale.runtime.errors import EngineDirError

    root = Path(w.path)
    kinds, roles = {}, {}  # name -> manifest entry, name -> role (the target's entry is `kinds`' first)
    kinds["target"] = components["target"]
    for name, info in components.items():
        role = kind_of(info, f"component {name}").role
        if role is Role.TARGET:
            continue
        if role is Role.DRAFTER and info.tp_size != 1:
            log.info("drafter %s is tensor-parallel: it runs eagerly on the aoti backend", name)
            continue
        kinds[name] = info
        roles[name] = role
    fingerprint = build_fingerprint(dtype, THREADS)
    staged = load_packed(root, {"target": kinds["target"]}, dtype)
    slots = max_slots(staged.target.config)
    t0 = time.time()
    jobs = [Job("target", "target", TARGET_ROWS, "target/cpu/steps.pt2")]
    drafters = {name: drafter_config(root, name) for name, role in roles.items() if role is Role.DRAFTER}
    for name, role in roles.items():
        if role is Role.HEAD:
            jobs.append(Job(name, kinds[name].kind, MTP_ROWS, f"{name}/cpu/steps.pt2"))
        else:
            linear = "kernel" if cpu_kernels.available(dtype) else "extern"
            jobs.append(Job(name, kinds[name].kind, FEED_ROWS, f"{name}/cpu/propose.pt2", linear))
            if drafters[name].version == 2:
                jobs.append(Job(name, kinds[name].kind, FEED_ROWS, f"{name}/cpu/propose_tree.pt2", linear,
                                tables=True))
    compiled = _compile_all(root, jobs, kinds, taps, slots, fingerprint, dtype, workers, progress)
    progress("checking the CPU packages against one-row steps and the eager models")
    check = check_packages(root, jobs, kinds, taps, slots, dtype, FED_ROWS)
    if not check["target"]["rows_bit_identical"]:
        log.info("CPU packages (gemm projections): target rows differ from one-row steps; "
                 "compiling row-wise projections")
        jobs = [replace(j, linear="rowwise") if j.name == "target" else j for j in jobs]
        compiled.update(_compile_all(root, [j for j in jobs if j.name == "target"], kinds, taps, slots,
                                     fingerprint, dtype, workers, progress))
        check = check_packages(root, jobs, kinds, taps, slots, dtype, FED_ROWS)
        if not check["target"]["rows_bit_identical"]:
            raise EngineDirError("CPU packages: the rows of a multi-row target step differ from "
                                 "one-row steps even with row-wise projections; build with "
                                 "--cpu-engines none")
    for name, c in check.items():
        if c.get("max_abs_diff_vs_eager", 0.0) > 1e-4:
            raise EngineDirError(f"CPU packages: {name}'s outputs differ from the eager model by "
                                 f"{c['max_abs_diff_vs_eager']:.2e} (> 1e-4)")
        if c.get("drafts_equal", 1.0) < 0.9:
            raise EngineDirError(f"CPU packages: {name}'s package proposes the eager drafter's "
                                 f"drafts only {c['drafts_equal']:.0%} of the time (< 90%)")
        if c.get("tables_trees_equal", 1.0) < 0.9:
            raise EngineDirError(f"CPU packages: {name}'s package's selector tables build the host's "
                                 f"draft trees only {c['tables_trees_equal']:.0%} of the time (< 90%)")
        if c.get("batched_equal_alone", 1.0) < 0.9:
            raise EngineDirError(f"CPU packages: {name}'s package proposes, for sequences run "
                                 f"together, their drafts alone only {c['batched_equal_alone']:.0%} "
                                 "of the time (< 90%)")
    out = {}
    for name in kinds:
        mine = [j for j in jobs if j.name == name]
        entries = [{"file": j.rel, "compile_s": compiled[j.rel], "batched": True,
                    **({"feed": j.rows, "fed_rows": FED_ROWS, "block": drafters[name].block_size,
                        "distributions": True, "selector_tables": j.tables}
                       if roles.get(name) is Role.DRAFTER
                       else {"rows": j.rows, "dynamic_rows": True, "tree_rows": name == "target"})}
                   for j in mine]
        out[name] = CpuPackages.model_validate(
            {"packages": entries, **fingerprint, "max_slots": slots, "linear": mine[0].linear,
             "check": check[name], **({"taps": list(taps), "build_s": round(time.time() - t0, 1)}
                                      if name == "target" else {})})
    return out


def drafter_config(root: Path, name: str):
    """The staged drafter `name`'s `DFlashConfig`."""
    from metrale.runtime.models.configs import DFlashConfig, read_config

    return DFlashConfig.from_hf(read_config(root / name), f"{name}/config.json")


def _compile_all(root: Path, jobs: list[Job], kinds, taps, slots: int, fingerprint: dict, dtype,
                 workers: int, progress) -> dict[str, float]:
    """Compile (or copy from the cache) each job's package; returns seconds per file."""
    base = repr((sorted(fingerprint.items()), taps, slots, _sources_digest()))
    weights = {name: _file_digest(root / name / "rank0.safetensors") for name in kinds}
    todo, seconds = [], {}
    for job in jobs:
        key = hashlib.sha256(repr((base, job, weights["target"], weights[job.name])).encode()).hexdigest()[:32]
        cached = cache_dir() / f"{key}.pt2"
        dest = root / job.rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if cached.is_file():
            shutil.copyfile(cached, dest)
            seconds[job.rel] = 0.0
        else:
            todo.append((job, dest, cached))
    if not todo:
        return seconds
    progress(f"compiling {len(todo)} CPU packages (AOTInductor, {min(workers, len(todo))} at a time)")
    dtype_name = str(dtype).removeprefix("torch.")
    relevant = lambda job: {"target": kinds["target"], job.name: kinds[job.name]}  # noqa: E731
    with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=get_context("spawn")) as pool:
        futures = [(job, dest, cached, pool.submit(_compile_one, str(root), job, relevant(job), taps, slots,
                                                   str(dest), dtype_name))
                   for job, dest, cached in todo]
        for job, dest, cached, fut in futures:
            seconds[job.rel] = round(fut.result(), 1)
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".tmp{os.getpid()}")
            shutil.copyfile(dest, tmp)
            os.replace(tmp, cached)  # a concurrent build may cache the same bytes: last wins
    return seconds
