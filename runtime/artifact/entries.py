"""The typed entries of an engine directory's manifest: what `components[name]` holds.

Every component entry is parsed into `ComponentEntry` when the manifest is read (and when the
builder records it), so a field that is missing, of the wrong JSON type or unknown is refused
there, naming the component and the field, instead of being read back later with a default.
Readers use attributes; the JSON layout is the models' field names, a field at its default
left out (`to_json`).

What each component kind's entry holds:

- every kind: `kind`, `config`, `files` (its rank files first); `quantization` (ModelOpt's
  hf_quant_config layout) and `weight_bytes` where the builder quantized it; `declared`, the
  file of its weights before quantizing (kept for requantizing at load).
- the MTP head: `naming` (the checkpoint's tensor naming).
- a drafter: `version`, `tp_size`, `rank_weight_bytes`.
- with ONNX graphs: `onnx` (`onnx_ranks` for tensor-parallel ranks), `io`, `plugin_ops`,
  `profile`; the target's `taps` and a drafter's `tap_index`; `engines`, one TensorRT plan (or
  one per rank) per SM.
- with CPU packages: `cpu` (`CpuPackages`).

The models are torch-free (pydantic only) so manifest-only commands stay light.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator


class _Entry(BaseModel):
    # strict: JSON types as written ("1" is not 1); extra="forbid": an unknown key is refused
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    def to_json(self) -> dict[str, Any]:
        """The entry as the manifest writes it (fields at their defaults are left out)."""
        return self.model_dump(mode="json", exclude_defaults=True)


class QuantAlgo(_Entry):
    """`quantization.quantization`: the algorithm, the quantized and the excluded linears, and
    the format's own keys (`plugins.formats.Format.section`, checked at load)."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)
    quant_algo: str | None
    quantized_modules: list[str]
    exclude_modules: list[str]


class Producer(_Entry):
    name: str
    version: str


class QuantSection(_Entry):
    """A component's quantization section, in the layout of ModelOpt's hf_quant_config.json."""

    producer: Producer
    quantization: QuantAlgo


class GraphIOEntry(_Entry):
    inputs: list[str]
    outputs: list[str]
    dynamic: dict[str, dict[str, str]]  # input/output -> {axis: label}


class PlanFile(_Entry):
    file: str
    seconds: float
    bytes: int


class Plan(_Entry):
    """One SM's TensorRT plan: one file, or one per tensor-parallel rank (`ranks`), with the
    plugin layers it holds (op -> count) and their activation dtypes (op -> dtypes)."""

    file: str | None = None
    seconds: float | None = None
    bytes: int | None = None
    ranks: list[PlanFile] = []
    plugins: dict[str, int] | None = None
    plugin_acts: dict[str, list[str]] | None = None

    def plan_files(self) -> list[str]:
        return [self.file] if self.file is not None else [r.file for r in self.ranks]


class CpuPackage(_Entry):
    """One AOTInductor package: a step over `rows` rows (the target and the MTP head; any row
    count where `dynamic_rows`; many sequences per call where `batched`), or a drafter's propose
    over `feed` context rows and a `block` of drafts (with `distributions`, also each block's
    logits and hidden states, which draft trees are built from); a batched drafter package
    feeds up to `fed_rows` context rows a call, its sequences' together (unset: `feed` per
    sequence); a DFlash2 package with `selector_tables` also gives each block's candidates and
    its candidate selector's tables given each parent, a tree's children
    (`aoti_steps.BatchedDFlashStep`). A batched target package with `tree_rows` takes each row's
    hidden drafts besides: a draft tree's rows in one call."""

    file: str
    compile_s: float
    rows: int | None = None
    dynamic_rows: bool = False
    batched: bool = False
    feed: int | None = None
    fed_rows: int | None = None
    block: int | None = None
    distributions: bool = False
    selector_tables: bool = False
    tree_rows: bool = False


class CpuPackages(_Entry):
    """A component's AOTInductor packages and what they were built for: a package runs only in
    a process whose torch, ISA, machine, dtype and thread count match (`backends.aoti`)."""

    packages: list[CpuPackage]
    torch: str
    isa: str
    machine: str
    dtype: str
    threads: int
    max_slots: int
    linear: str
    check: dict[str, Any] = {}  # the build's comparison against one-row steps and eager models
    taps: list[int] = []
    build_s: float | None = None

    def fingerprint(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("torch", "isa", "machine", "dtype", "threads")}


class ComponentEntry(_Entry):
    kind: str
    files: list[str]
    config: str | None = None
    tp_size: int = 1
    version: int | None = None
    naming: str | None = None
    quantization: QuantSection | None = None
    weight_bytes: int | None = None
    rank_weight_bytes: list[int] | None = None
    declared: str | None = None
    onnx: str | None = None
    onnx_ranks: list[str] | None = None
    onnx_seconds: float | None = None
    io: GraphIOEntry | None = None
    plugin_ops: dict[str, int] | None = None
    profile: dict[str, list[int]] | None = None
    taps: list[int] | None = None
    tap_index: list[int] | None = None
    engines: dict[str, Plan] = {}
    cpu: CpuPackages | None = None

    @field_validator("cpu", mode="wrap")
    @classmethod
    def _cpu_layout(cls, value, handler):
        try:
            return handler(value)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"its CPU packages are of another layout ({where}: {err['msg']}; an "
                             "older metrale built them)") from None

    @property
    def quant_algo(self) -> QuantAlgo | None:
        """The quantization section's algorithm part (None: not quantized by the build)."""
        return self.quantization.quantization if self.quantization is not None else None

    def named_files(self) -> list[tuple[str, str]]:
        """(field, path) of each file the entry names besides its `files` list."""
        named = [("config", self.config), ("declared", self.declared), ("onnx", self.onnx),
                 *(("onnx_ranks", f) for f in self.onnx_ranks or ()),
                 *((f"engines[{sm!r}]", f) for sm, plan in self.engines.items() for f in plan.plan_files()),
                 *(("cpu.packages", p.file) for p in (self.cpu.packages if self.cpu is not None else ()))]
        return [(field, rel) for field, rel in named if rel is not None]

    def merged(self, **changes: Any) -> ComponentEntry:
        """This entry with `changes` (JSON values or entries), validated again."""
        data = self.to_json()
        data.update({k: v.to_json() if isinstance(v, _Entry) else v for k, v in changes.items()})
        return parse_entry(data, "the entry")


class EntryInvalid(ValueError):
    """A manifest entry that does not parse; the message names the field and what it holds."""


def parse_entry(data: Any, where: str) -> ComponentEntry:
    """`data` (a manifest's `components[name]`, or an entry) as a ComponentEntry."""
    if isinstance(data, ComponentEntry):
        return data
    if not isinstance(data, dict):
        raise EntryInvalid(f"{where} must be an object, got {data!r}")
    try:
        return ComponentEntry.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise EntryInvalid(f"{where} has an unknown field {field!r}") from None
        if err["type"] == "value_error":
            raise EntryInvalid(f"{where}: {err['msg'].removeprefix('Value error, ')}") from None
        if err["type"] == "missing":
            raise EntryInvalid(f"{where} lacks its field {field!r}") from None
        raise EntryInvalid(f"{where}: field {field!r} is {err.get('input')!r}: {err['msg']}") from None
