"""How a draft tree's verify runs, step by step: its rows in one target forward (a tree attention
mask) or along its paths (a chain forward from the root along the best children, and one more
each time the target takes a child off the chain run last; `decode.Decoder._tree_step`).

One forward runs every node's row; the walk runs the best chain's rows, again for every switch.
Where a target's rows run in parallel (a GPU) the forward costs about one row, and it wins. On a
CPU every row costs its share, so a 16-node tree's forward costs more than its 9-row chain plus
the occasional switch. With a cost table (`--dflash-adaptive-k`'s, ms per verify of k drafts,
priced past its last count at `CostModel.row_ms` a row), each step takes the cheaper of
cost(tree nodes) and cost(chain nodes) · (1 + switches), switches being the decayed mean of what
the walk would have run again on this stream's trees; without one, the forward where rows run
in parallel and the walk elsewhere. Both give the same rows' bits where the target has tree
rows (the forward's kernel reads a node's context and ancestors in its chain's order), so the
choice moves time only.
"""

from __future__ import annotations

from metrale.runtime.spec.config import CostModel
from metrale.runtime.spec.ddtree import Tree


def best_chain(tree: Tree) -> list[int]:
    """The nodes from the root along each node's best child (the first taken): the walk's first
    chain."""
    kids = tree.children()
    nodes = [0]
    while kids[nodes[-1]]:
        nodes.append(next(iter(kids[nodes[-1]].values())))
    return nodes


def switches(tree: Tree, path: list[int]) -> int:
    """Chains the walk runs after its first for an accepted `path` (nodes past the root): one for
    each node of it that is not its parent's best child."""
    best: dict[int, int] = {}
    for i in range(1, len(tree.tokens)):
        best.setdefault(tree.parents[i], i)
    return sum(1 for n in path if best[tree.parents[n]] != n)


class TreeVerifyChoice:
    """One stream's choice of how each tree is verified (see the module docstring)."""

    def __init__(self, cost: CostModel | None, rows_in_parallel: bool, decay: float = 0.9):
        self.cost, self.rows_in_parallel, self.decay = cost, rows_in_parallel, decay
        self.switches = 0.0  # the walk's extra chains per tree, decayed mean

    def _price(self, drafts: int) -> float:
        c = self.cost
        if drafts <= c.max_count:
            return c.cost(max(drafts, c.first))
        return c.cost(c.max_count) + (drafts - c.max_count) * c.row_ms

    def one_forward(self, tree: Tree) -> bool:
        """Whether `tree`'s rows run in one forward (else along its paths)."""
        if self.cost is None:
            return self.rows_in_parallel
        chain = len(best_chain(tree)) - 1
        return self._price(tree.size) <= self._price(chain) * (1.0 + self.switches)

    def observe(self, tree: Tree, path: list[int]) -> None:
        """A verified tree's accepted path: what the walk would have run again."""
        self.switches = self.decay * self.switches + (1.0 - self.decay) * switches(tree, path)
