"""The backend registry: one entry per thing that can run a loaded engine's steps.

`--backend` (`backends.Backend`) says what the user asked for; `LoadedEngine.backend` is the
entry that runs the engine once loaded (auto resolves to one of them, and a backend that cannot
run here falls back to another, saying why in `backend_note`). Each entry declares:

- `faces`: per step shape (`components.StepShape`), the class that runs a component of that
  shape ("module:Class" in `backends`, imported when first used); a shape it does not name runs
  the component's own torch module.
- its capabilities, which the decode loop and serving ask instead of looking at the objects:
  `row_invariant` (each row's bits do not depend on the forward's other rows, so chunkwise
  verify emits plain decoding's tokens and a busy batch's rows can be run again later),
  `eager` (it runs the eager torch target, whose rows are made invariant where torch's kernels
  allow: `LoadedEngine.rows_invariant`), `prefix_cache` (its target can keep prompts' rows for
  reuse), `split_steps` (its batched steps can be split over threads, leaving cores to another
  process) and `iteration_graphs` (whole speculative iterations replay as graphs,
  `spec.iteration_loop`).

Adding a backend is its entry here, its faces and its loader (`backends.load_engine`).
"""

from __future__ import annotations

from dataclasses import dataclass

from metrale.runtime.components import StepShape, resolve


@dataclass(frozen=True)
class BackendEntry:
    name: str  # what bench, calibration and the engine's logs record
    runs: str  # what it runs, in words
    faces: tuple[tuple[StepShape, str], ...] = ()
    eager: bool = False
    row_invariant: bool = False
    prefix_cache: bool = False
    split_steps: bool = False
    iteration_graphs: bool = False
    # its target runs a draft tree's rows in one forward (a tree attention mask, `Forward.tree`);
    # elsewhere a tree is verified along its paths, a chain forward each (`Decoder._tree_step`)
    tree_attention: bool = False

    def face(self, shape: StepShape):
        """The class that runs a component of `shape`, or None: its torch module does."""
        ref = dict(self.faces).get(shape)
        return resolve(ref) if ref is not None else None

    def __str__(self) -> str:
        return self.name


_GRAPH_FACES = ((StepShape.TARGET, "metrale.runtime.backends.graph_steps:GraphTarget"),
                (StepShape.CHAIN, "metrale.runtime.backends.graph_steps:GraphMTP"),
                (StepShape.BLOCK, "metrale.runtime.backends.graph_steps:GraphDrafter"))
_CAPTURED_TARGET = ((StepShape.TARGET, "metrale.runtime.backends.cuda_graphs:GraphTarget"),)

BACKENDS: dict[str, BackendEntry] = {e.name: e for e in (
    BackendEntry("torch", "the eager models, on a CPU or a GPU", eager=True, tree_attention=True),
    BackendEntry("aoti", "the CPU packages (AOTInductor .pt2)",
                 ((StepShape.TARGET, "metrale.runtime.backends.aoti_batched:BatchedTarget"),
                  (StepShape.CHAIN, "metrale.runtime.backends.aoti_batched:BatchedMTP"),
                  (StepShape.BLOCK, "metrale.runtime.backends.aoti_dflash:BatchedDFlash")),
                 row_invariant=True, prefix_cache=True, split_steps=True),
    BackendEntry("cuda-graphs", "the eager target's steps captured as CUDA graphs",
                 _CAPTURED_TARGET, iteration_graphs=True),
    # the capture stand-in on a machine without CUDA (`cuda_graphs.EagerGraphs`): what tests run
    BackendEntry("eager-graphs", "the eager target's steps through the capture stand-in",
                 _CAPTURED_TARGET, iteration_graphs=True),
    BackendEntry("onnxruntime", "the exported ONNX graphs, on a CPU", _GRAPH_FACES),
    BackendEntry("tensorrt", "the TensorRT plans, on a GPU", _GRAPH_FACES),
)}


def backend_named(name: str) -> BackendEntry:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r} (allowed: {', '.join(BACKENDS)})") from None
