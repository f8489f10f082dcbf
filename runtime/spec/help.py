"""The `--help` text of every speculative flag, shared by `generate`, `serve` and `bench`.

The seeds' flag definitions are the authority: these texts are theirs, changed only where
metrale's behaviour differs. `spec.config` parses and checks the flags these texts describe.
"""

from __future__ import annotations

# The two weight-tier flags exist on `build` and at load (`generate`, `serve`, `bench`): one
# definition from the seeds, then what each command does with it.
DRAFT_TIER_TEXT = (
    "Format of the DFlash drafter's GEMM weights; activations stay at the --dtype at every tier "
    "(BF16 on a GPU; float32 on a CPU, where it measured faster), and only the drafts move (the "
    "target verifies every token). `declared`: the checkpoint's own weights (BF16). `fp8`: FP8 "
    "E4M3 copies, one scale per row, of each layer's q/k/v/o/gate/up/down and of the LM head. "
    "`fp8-aux`: `fp8` plus FP8 copies of the context `fc` and K/V projections and the DFlash2 "
    "conv and selector projections (GLM-5.3 drafter, rank 0 of 3 at C = 1, GB10: 4.1 ms per "
    "propose against 6.5 ms). `nvfp4`: NVFP4 copies (4-bit E2M1, one FP8 scale per 16 weights) "
    "of everything `fp8-aux` copies, run as W4A16; each tensor's scale comes from the whole "
    "unsharded tensor, so `--draft-tp-size` ranks hold exactly the one-rank drafter's bytes."
)
MTP_NVFP4_TEXT = (
    "Draft on NVFP4 copies of a BF16 MoE MTP head's experts. The head's routed and shared "
    "experts are requantized from BF16 to NVFP4 and run as W4A16 GEMMs, one per expert (a "
    "grouped NVFP4 tensor-core decode is not wired in yet); the router, attention, "
    "fc and draft LM head keep the head's precision. Draft-only: the target model verifies "
    "every drafted token, so only how many drafts are accepted moves. Under --exact-verify "
    "greedy output is byte-identical with it on or off; under the default chunkwise verify, like "
    "any change in acceptance (--num-drafts included), it can move greedy text. Refused on any "
    "other head (dense FFN, FP8 experts, or --mtp-quantization other than bf16)."
)
DRAFT_TP_TEXT = (
    "Tensor-parallel degree of the DFlash drafter: `auto` (the serve's world size) or a rank "
    "count. Above 1 every rank holds a slice of the drafter (its KV heads with their query "
    "groups, a slice of the MLP intermediate and of the LM-head rows) and each propose runs on "
    "all ranks at once: two all-reduces per drafter layer and one all-gather of the top-16 "
    "candidates, the drafts equal to one rank's up to the all-reduce summation order. 1 runs "
    "the whole drafter on rank 0. The drafter's collectives span the whole communicator, so the "
    "value must be 1 or the world size, and the drafter's KV heads must cover every rank; "
    "startup refuses anything else. Set the same value on every rank. Unset (the default): 1."
)
BUILD_HELP: dict[str, str] = {
    "--draft-tp-size": DRAFT_TP_TEXT + (
        " (metrale build: how many rank files to cut each drafter into, after quantizing; "
        "`auto` writes one, and a serve of any world size cuts its shards from it at load.)"),
    "--draft-weight-quantization": DRAFT_TIER_TEXT + (
        " (metrale build: the tier the engine directory stores, quantized with ModelOpt; the "
        "declared weights are kept beside it, so generate, serve and bench can take another "
        "tier at load.) \\[default: fp8]"),
    "--mtp-experts-nvfp4": MTP_NVFP4_TEXT + (
        " (metrale build: quantized with ModelOpt into the engine directory, which keeps the "
        "head's BF16 weights too.) \\[default: off]"),
}
# The two weight-tier flags at load (`generate`, `serve`, `bench`): the seeds' definition, then
# how loading takes a value other than the built one. Which mode reads them differs per command.
DRAFT_TIER_LOAD_TEXT = DRAFT_TIER_TEXT + (
    " Default: the tier the engine directory was built with (metrale build's default is "
    "fp8). Another tier is quantized at load with ModelOpt from the declared weights the "
    "engine directory keeps, to the bytes a build at that tier writes; a drafter with CPU "
    "packages then runs in eager PyTorch, and TensorRT plans refuse it, naming both tiers."
)
MTP_NVFP4_LOAD_TEXT = MTP_NVFP4_TEXT.replace(
    "experts are requantized from BF16 to NVFP4", "experts are requantized from BF16 to NVFP4 at load") + (
    " Default: as the engine directory was built (metrale build's default is off). The "
    "engine directory keeps the head's BF16 weights for this, quantized with ModelOpt as "
    "metrale build does; --no-mtp-experts-nvfp4 runs the BF16 experts. TensorRT plans hold "
    "their build's experts: there another value is refused."
)
# `metrale bench` has no --speculative or --dflash: it runs every mode, each with its own flags,
# so a tier flag applies to every mode that reads it and is refused where none of them runs.
BENCH_HELP: dict[str, str] = {
    "--draft-weight-quantization": DRAFT_TIER_LOAD_TEXT + (
        " (metrale bench: every DFlash mode, and the drafters' cost models measured first, run at "
        "this tier; refused on an engine directory without a DFlash drafter.)"),
    "--mtp-experts-nvfp4": MTP_NVFP4_LOAD_TEXT + (
        " (metrale bench: every MTP mode drafts with it; refused where no MTP mode runs: an "
        "engine directory without an MTP head, or --modes selecting none.)"),
}

HELP: dict[str, str] = {
    "--speculative": (
        "Speculative decoding with the engine's MTP head (default: off). Each step the head "
        "drafts a chain of up to --num-drafts tokens and the target model verifies the chain in "
        "one forward. Verification is lossless: greedy output follows the target's argmax and "
        "sampled output the target's distribution. Not with --dflash."
    ),
    "--num-drafts": (
        "Longest MTP draft chain per step (default: 3). At least 1. Requires --speculative. "
"(metrale: at most 32.)"
    ),
    "--draft-confidence-stop": (
        "Confidence stop for MTP draft chains (default: off). With TAU, the drafter extends a "
        "chain past a draft only while that draft's top-1 probability is at least TAU, so a "
        "chain of up to `--num-drafts` ends with its first draft below TAU (still verified). "
        "With cum:TAU, it extends the chain only while the product of the chain's top-1 "
        "probabilities so far is at least TAU. Unconfident chains cost fewer drafter steps and "
        "fewer verify rows; confident ones run to full depth. It changes which drafts are "
        "verified, never the emitted tokens. 0 < TAU < 1. Requires `--speculative`; not with "
        "`--dflash`. (metrale: the emitted tokens stay put wherever verify rows are "
        "batch-invariant — the aoti backend, and torch in bfloat16 on a CPU where loading "
        "measures them so — and everywhere "
        "under --exact-verify.)"
    ),
    "--dflash": (
        "Speculative decoding with the engine's DFlash drafter (default: off). One drafter "
        "forward proposes a block of drafts, of which the target verifies up to γ − 1 per step "
        "(see --dflash-gamma). Verification is lossless. Not with --speculative."
    ),
    "--dflash-gamma": (
        "DFlash block length γ: the anchor token plus up to γ − 1 drafts per step. Default: "
        "the drafter's block size; a value may lower it, never raise it. At least 2. "
        "Requires --dflash."
    ),
    "--dflash-draft-ladder": (
        "Draft counts a sequence moves between, strictly ascending, each at least 1 and at "
        "most γ − 1 (e.g. 1,3,7). A sequence starts on the lowest rung; a step that accepts all "
        "of its drafts moves it up one rung, and a step that accepts fewer drafts than the rung "
        "below moves it down one. Unset (the default): every step drafts γ − 1. "
        "Requires --dflash."
    ),
    "--dflash-adaptive-k": (
        "Adaptive DFlash draft count for a single stream: the measured step cost in ms by draft "
        "count, `drafts:ms` pairs over consecutive counts from 0 (the plain decode step) or 1, "
        "e.g. `0:32,1:44,2:50,3:56`. Each C = 1 step then verifies the count with the most "
        "expected tokens per ms at the sequence's measured acceptance, capped by the ladder "
        "rung (or γ - 1), and with a `0:` entry suspends speculation (until the re-probe) where "
        "plain decode pays more. Unset (the default): the ladder or the γ resolver decides. "
        "(metrale: `auto` takes the table `metrale calibrate` stored in the engine directory "
        "for this drafter, backend, dtype and thread count, and the drafter's acceptance "
        "measured with it as each stream's starting estimate; counts above γ - 1 are refused.)"
    ),
    "--dflash-reprobe-interval": (
        "While --dflash-adaptive-k has suspended speculation, run one speculative step after "
        "every N plain steps to measure acceptance again (default: 16). A probe that leaves "
        "the stream suspended doubles N for it (up to 64 times the value; resuming resets it), "
        "and no probe runs while no draft count could beat a plain step even at an optimistic "
        "acceptance (the measured one two standard errors up; each count judged at the largest "
        "cost listed up to it). Probes are also spaced so that their expected cost (the "
        "probe's step less the plain steps its expected tokens replace) stays within 1% of "
        "the plain steps' time between them. The drafter keeps reading the context while "
        "suspended, so a probe drafts from all of it: on a target whose rows do not depend on "
        "the rest of the forward (the CPU packages) the plain steps keep nothing and their "
        "rows run again before the probe, which counts against that 1% too; where a row costs "
        "more than it, the stream decodes plainly to its end. At least 1. Requires "
        "--dflash-adaptive-k."
    ),
    "--dflash-tree-budget": (
        "(metrale.) Verify each DFlash block as a draft tree of N nodes instead of its chain "
        "(DDTree): the nodes of highest path probability under the block's per-position "
        "distributions (DFlash2: its candidate selector's distribution given each node's "
        "token), best first, all verified in one target forward with a tree attention mask; the "
        "longest path the target accepts is kept and its K/V moved into place. Greedy verify "
        "keeps the path of the target's argmax; sampling accepts each node's children in turn "
        "with their probability under what is left of the target's distribution, so the "
        "output is distributed exactly as plain sampling's. 0 or unset (the default): the "
        "chain. At most 64; excludes --dflash-draft-ladder. With --dflash-adaptive-k a stream "
        "alone verifies the first b nodes of each tree (best first, so the tree of budget b), "
        "b the table's count (1..N) with the most expected tokens per ms: the drafter's path "
        "probabilities summed over those nodes, scaled by how the target has accepted its "
        "trees; the table's counts are then tree budgets, up to N, and plain steps where no "
        "tree pays (on a CUDA-graph target where its whole iterations run, b is picked before "
        "each iteration among the table's powers of two and its largest, from the path "
        "probabilities of the last iterations' trees, for every running request at once). "
        "Runs on every backend and world: where the target has no tree mask (an "
        "engine built before tree rows, a target graph profile of fewer than 65 rows) or where it "
        "costs less (--dflash-tree-verify) the tree is verified along its paths, one chain forward from the root along each node's best "
        "child and one more through each child the target takes off it. A --draft-tp-size N "
        "build's rank engines draw each position's nodes from the top candidates they gather "
        "(16, or DFlash2's candidate count if larger, with their normalizer), so a node there has "
        "at most that many children. With --exact-verify "
        "the accepted path's rows run one per forward, so greedy output is plain decoding's. "
        "Requires --dflash."
    ),
    "--dflash-tree-verify": (
        "(metrale.) How each draft tree is verified: forward, every node's row in one target "
        "forward with a tree attention mask (the torch models, the CUDA-graph target, the CPU "
        "packages and the exported target graphs, onnxruntime and tensorrt, whose profile takes "
        "65 rows); paths, along its paths, a chain forward from the root "
        "along each node's best child and one more through each child the target takes off it; "
        "auto (the default), each step the cheaper of the two under the --dflash-adaptive-k "
        "table (the forward's rows off the best chain against the walk's extra chains, as "
        "measured on the stream's trees), without a table the forward on a GPU, whose rows run "
        "in parallel, and the paths on a CPU, where every row costs its share; the paths where "
        "the target has no tree mask. The emitted tokens are the same either way. Requires "
        "--dflash-tree-budget."
    ),
    "--exact-verify": (
        "Compute the verification rows so that greedy output is byte-identical to plain "
        "decoding with speculation off (default: off). The default chunkwise verify scores all "
        "of a step's rows in one forward: faster, but like any change in acceptance "
        "(--num-drafts included) it can move greedy text. Requires --speculative or --dflash."
    ),
    "--draft-tp-size": DRAFT_TP_TEXT + (
        " (metrale: the world is a torchrun launch or --nproc; each rank's shard is read from "
        "an engine directory built with that many ranks, or cut at load from a one-rank one.) "
        "Requires --dflash."
    ),
    "--draft-weight-quantization": DRAFT_TIER_LOAD_TEXT + " Requires --dflash.",
    "--mtp-experts-nvfp4": MTP_NVFP4_LOAD_TEXT + " Requires --speculative.",
    "--dflash-drafter": (
        "Which DFlash drafter component of the engine directory to run, by name, e.g. dflash "
        "or dflash2 (default: dflash). Requires --dflash."
    ),
}
