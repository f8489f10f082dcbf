"""The `--help` text of every speculative flag, shared by `generate`, `serve` and `bench`.

The seeds' flag definitions are the authority: these texts are theirs, changed only where
metrale's behaviour differs. `specconfig` parses and checks the flags these texts describe.
"""

from __future__ import annotations

HELP: dict[str, str] = {
    "--speculative": (
        "Speculative decoding with the engine's MTP head (default: off). Each step the head "
        "drafts a chain of up to --num-drafts tokens and the target model verifies the chain in "
        "one forward. Verification is lossless: greedy output follows the target's argmax and "
        "sampled output the target's distribution. Not with --dflash."
    ),
    "--num-drafts": (
        "Longest MTP draft chain per step (default: 3). At least 1. Requires --speculative."
    ),
    "--draft-confidence-stop": (
        "Confidence stop for MTP draft chains (default: off). With TAU, the drafter extends a "
        "chain past a draft only while that draft's top-1 probability is at least TAU, so a "
        "chain of up to --num-drafts ends with its first draft below TAU, and that draft is "
        "still verified. With cum:TAU, it extends the chain only while the running product of "
        "the chain's top-1 probabilities so far is at least TAU. Unconfident chains cost fewer "
        "drafter steps and fewer verify rows; confident ones run to full depth. It changes "
        "which drafts are verified, never the emitted tokens. 0 < TAU < 1. Requires "
        "--speculative; not with --dflash."
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
        "count, as drafts:ms pairs over consecutive counts from 0 (the plain decode step) or 1, "
        "e.g. 0:32,1:44,2:50,3:56. At concurrency 1 each step then verifies the count with the "
        "most expected tokens per ms at the sequence's measured acceptance, capped by the "
        "ladder rung (or γ − 1); with a 0: entry it suspends speculation where plain decoding "
        "pays more, until the next re-probe (see --dflash-reprobe-interval). Counts above "
        "γ − 1 are refused. `auto` takes the table `metrale calibrate` measured and stored in "
        "the engine directory for this drafter, backend, dtype and thread count, with the "
        "drafter's acceptance measured there as each stream's starting estimate. Unset (the "
        "default): the ladder or γ decides. Requires --dflash."
    ),
    "--dflash-reprobe-interval": (
        "While --dflash-adaptive-k has suspended speculation, run one speculative step after "
        "every N plain steps to measure acceptance again (default: 16). A probe that leaves "
        "the stream suspended doubles N for it (up to 64 times the value; resuming resets it), "
        "and no probe runs while no draft count could beat a plain step even at an optimistic "
        "acceptance (the measured one two standard errors up; each count judged at the largest "
        "cost listed up to it). The drafter keeps reading the context while suspended, "
        "so a probe drafts from all of it. At least 1. Requires --dflash-adaptive-k."
    ),
    "--exact-verify": (
        "Compute the verification rows so that greedy output is byte-identical to plain "
        "decoding with speculation off (default: off). The default chunkwise verify scores all "
        "of a step's rows in one forward: faster, but like any change in acceptance "
        "(--num-drafts included) it can move greedy text. Requires --speculative or --dflash."
    ),
    "--draft-tp-size": (
        "Tensor-parallel degree of the DFlash drafter: auto (the serve's world size) or a rank "
        "count. Above 1 every rank holds a slice of the drafter (its KV heads with their query "
        "groups, a slice of the MLP intermediate and of the shared LM head's rows) and each "
        "propose runs on all ranks at once: two all-reduces per drafter layer and one "
        "all-gather of the top-16 candidates, the drafts equal to one rank's up to the "
        "all-reduce summation order. 1 runs the whole drafter unsharded (each rank of a "
        "multi-process launch then holds all of it). The drafter's collectives span every rank, "
        "so the value must be 1 or the world size, and the drafter's KV heads must divide "
        "evenly among the ranks; startup refuses anything else. Set the same value on every "
        "rank. Unset (the default): 1. Requires --dflash."
    ),
    "--dflash-drafter": (
        "Which DFlash drafter component of the engine directory to run, by name, e.g. dflash "
        "or dflash2 (default: dflash). Requires --dflash."
    ),
}
