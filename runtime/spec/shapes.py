"""What the decode loop does with each step shape (`components.StepShape`): the proposer that
drafts with a component of that shape, the speculative mode that runs it, and the modes
`metrale bench` measures with it. A component kind reaches all of them through its shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from metrale.runtime.components import StepShape
from metrale.runtime.models.configs import DFlashConfig
from metrale.runtime.spec.config import SpecMode
from metrale.runtime.spec.dflash_proposer import DFlashProposer
from metrale.runtime.spec.mtp_proposer import MTPProposer
from metrale.runtime.spec.proposer import Proposer


def _chain_modes(name: str, cfg, cost) -> list[tuple[str, dict]]:
    base = {"speculative": True}
    modes = [(f"mtp k={k}", {**base, "num_drafts": k}) for k in (1, 2, 3)]
    modes.append(("mtp k=3 stop=0.6", {**base, "num_drafts": 3, "draft_confidence_stop": "0.6"}))
    modes.append(("mtp k=3 stop=cum:0.5", {**base, "num_drafts": 3, "draft_confidence_stop": "cum:0.5"}))
    modes.append(("mtp k=3 exact", {**base, "num_drafts": 3, "exact_verify": True}))
    return modes


def _block_modes(name: str, cfg: DFlashConfig, cost) -> list[tuple[str, dict]]:
    base = {"dflash": True, "dflash_drafter": name}
    g = cfg.block_size
    rungs = ",".join(str(r) for r in (1, 3, 7) if r <= g - 1)
    modes = [(f"{name} γ={g}", base), (f"{name} γ={g} exact", {**base, "exact_verify": True}),
             (f"{name} γ=4", {**base, "dflash_gamma": 4}),
             (f"{name} ladder {rungs}", {**base, "dflash_draft_ladder": rungs})]
    if cost is not None:  # its measured CostModel, with its acceptance (chains: its counts up to γ − 1)
        modes.append((f"{name} adaptive-k", {**base, "dflash_adaptive_k": cost.up_to(g - 1)}))
    for budget in TREE_BUDGETS:  # draft trees
        modes.append((f"{name} tree {budget}", {**base, "dflash_tree_budget": budget}))
    # (bench drops it where the target has no tree mask)
    modes.append((f"{name} tree {TREE_BUDGETS[0]} forward",
                  {**base, "dflash_tree_budget": TREE_BUDGETS[0], "dflash_tree_verify": "forward"}))
    if cost is not None and cost.max_count >= TREE_BUDGETS[0]:  # each tree's budget chosen
        modes.append((f"{name} tree {TREE_BUDGETS[0]} adaptive-k", {**base, "dflash_tree_budget": TREE_BUDGETS[0],
                                                                     "dflash_adaptive_k": cost.up_to(TREE_BUDGETS[0])}))
    modes.append((f"{name} tree {TREE_BUDGETS[0]} exact",
                  {**base, "dflash_tree_budget": TREE_BUDGETS[0], "exact_verify": True}))
    return modes


TREE_BUDGETS = (16, 32)  # the draft-tree budgets bench measures


@dataclass(frozen=True)
class ShapeSpec:
    mode: SpecMode  # the speculative mode that drafts with it
    proposer: type[Proposer]  # its `for_spec(face, embed, spec, settings, max_len)` makes one
    # (component name, config, measured cost model or None) -> its `metrale bench` modes
    bench_modes: Callable[[str, Any, Any], list[tuple[str, dict]]]


SHAPES: dict[StepShape, ShapeSpec] = {
    StepShape.CHAIN: ShapeSpec(SpecMode.MTP, MTPProposer, _chain_modes),
    StepShape.BLOCK: ShapeSpec(SpecMode.DFLASH, DFlashProposer, _block_modes),
}


def bench_modes(shape: StepShape, name: str, cfg, cost) -> list[tuple[str, dict]]:
    """The modes bench runs with a component of `shape` (none for the target)."""
    spec = SHAPES.get(shape)
    return spec.bench_modes(name, cfg, cost) if spec is not None else []
