"""How a draft tree's verify runs, step by step: its rows in one target forward (a tree attention
mask) or along its paths (a chain forward from the root along the best children, and one more
each time the target takes a child off the chain run last; `decode.Decoder._tree_step`).

One forward runs every node's row; the walk runs the best chain's rows, and a chain forward more
for every switch. Where a target's rows run in parallel (a GPU) the forward's extra rows cost
next to nothing, and it wins. On a CPU every row costs its share, so a 16-node tree's forward
costs more than its few-row best chain plus the occasional switch. With a cost table (ms of a
step verifying k drafts in one chain, k up to γ − 1: `--dflash-adaptive-k`'s chain counts), the
two differ by the forward's rows off the best chain, (nodes − chain) · `CostModel.row_ms`,
against the walk's extra chains, switches · (a one-row step + chain · row_ms), switches being
the decayed mean of what the walk would have run again on this stream's trees; each step takes
the cheaper. Without a table: the forward where rows run in parallel, the walk elsewhere.
`--dflash-tree-verify forward` or `paths` fixes the route instead. On the CPU packages both give
the same rows' bits (the forward's kernel reads a node's context and
ancestors in its chain's order), so there the choice moves time only.
"""

from __future__ import annotations

from metrale.runtime.spec.cost_model import CostModel
from metrale.runtime.spec.ddtree import Tree


def best_chain(tree: Tree, kids: list[dict[int, int]] | None = None, start: tuple[int, ...] = (0,)) -> list[int]:
    """The nodes `start` (the root, or a path from it) then along each node's best child (its
    first, in the order the tree took them): the walk's chain through `start`. `kids`: the
    tree's `children()`, where the caller has them."""
    kids = tree.children() if kids is None else kids
    nodes = list(start)
    while kids[nodes[-1]]:
        nodes.append(next(iter(kids[nodes[-1]].values())))
    return nodes


def switches(tree: Tree, path: list[int], kids: list[dict[int, int]] | None = None) -> int:
    """Chains the walk runs after its first for an accepted `path` (nodes past the root): one for
    each node of it that is not its parent's best child."""
    kids = tree.children() if kids is None else kids
    return sum(1 for n in path if next(iter(kids[tree.parents[n]].values())) != n)


class TreeVerifyChoice:
    """One stream's choice of how each tree is verified (see the module docstring)."""

    def __init__(self, cost: CostModel | None, rows_in_parallel: bool, mode: str = "auto", decay: float = 0.9):
        self.rows_in_parallel, self.decay = rows_in_parallel, decay
        self.mode = mode  # `--dflash-tree-verify`: auto, or forward / paths always
        self.switches = 0.0  # the walk's extra chains per tree, decayed mean
        self.row_ms = self.step_ms = 0.0
        self.priced = cost is not None
        if cost is not None:  # a row's cost, and a one-row step's (the table's first, less its rows)
            self.row_ms = cost.row_ms
            self.step_ms = max(0.0, cost.cost(cost.first) - cost.first * self.row_ms)

    @property
    def measures(self) -> bool:
        """Whether the walk's switches decide anything (auto, under a cost table)."""
        return self.mode == "auto" and self.priced

    def one_forward(self, tree: Tree, kids: list[dict[int, int]] | None = None) -> bool:
        """Whether `tree`'s rows run in one forward (else along its paths)."""
        if self.mode != "auto":
            return self.mode == "forward"
        if not self.priced:
            return self.rows_in_parallel
        chain = len(best_chain(tree, kids)) - 1
        extra_rows = (tree.size - chain) * self.row_ms
        return extra_rows <= self.switches * (self.step_ms + chain * self.row_ms)

    def observe(self, tree: Tree, path: list[int], kids: list[dict[int, int]] | None = None) -> None:
        """A verified tree's accepted path: what the walk would have run again."""
        if self.measures:
            self.switches = self.decay * self.switches + (1.0 - self.decay) * switches(tree, path, kids)
