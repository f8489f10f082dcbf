"""Build recipes: which checkpoints `metrale build` turns into an engine directory, and how.

A recipe is a TOML file::

    [recipe]                 name, and engine_dir (the default output, relative to the
                             current working directory; "engines/<name>" when absent)
    [target]                 checkpoint = a Hugging Face folder (config.json, *.safetensors,
                             tokenizer files)
    [mtp]                    optional: the MTP head's checkpoint
    [drafters.<name>]        zero or more drafters; the table name is the component name;
                             `kind` (default "dflash") names its component kind
    [build]                  defaults for the build flags (`BuildOptions`); CLI flags override

Invariants:
- Every table and key is known: anything else is refused naming the key and the file.
- Checkpoint paths are relative to the recipe file's folder, resolved at load, and must be
  folders holding config.json.
- `BuildOptions` and `Recipe` are frozen and validated on construction; `replace` revalidates,
  so an object of either type always holds allowed values. Errors are `ConfigError`s.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from metrale.plugins import formats
from metrale.runtime.artifact.engine_dir import COMPONENT_NAME_RULE, is_component_name
from metrale.runtime.errors import ConfigError

# The embedded tiny recipe, used when `metrale build` gets no --recipe.
DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny.toml"

DRAFT_WEIGHT_QUANTIZATIONS, MTP_QUANTIZATIONS = formats.DRAFT_TIERS, formats.MTP_QUANTIZATIONS
TRT_FLAVORS = ("auto", "rtx", "tensorrt", "none")
TRT_DTYPES = ("bfloat16", "float32")
CPU_ENGINES = ("aoti", "none")
# SM75 (Turing) is the oldest architecture either TensorRT flavour builds for.
MIN_TARGET_SM = 75


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_of(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} = {value!r} is not allowed; expected one of {', '.join(allowed)}")


def parse_draft_tp_size(text: str, name: str = "draft_tp_size") -> int | str:
    """`auto` or a rank count of at least 1, as the CLI writes `--draft-tp-size`; `name` is
    what errors call the value (the flag, when it came from one)."""
    if text == "auto":
        return "auto"
    n = int(text) if text.isascii() and text.isdigit() and len(text) < 10 else 0  # not "1_0", " 2"
    if n < 1:
        raise ConfigError(f"{name}: expected `auto` or a rank count of at least 1, got {text!r}")
    return n


def parse_target_sm(text: str, name: str = "target_sm") -> tuple[int, ...]:
    """A comma-separated SM list as the CLI writes `--target-sm`: "89,120" -> (89, 120)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(
            f"{name}: expected comma-separated SM numbers such as 89,120, got {text!r}"
        ) from None


@dataclass(frozen=True)
class BuildOptions:
    """The build flags. Field names are the recipe's [build] keys and the CLI's flags
    (`draft_weight_quantization` <-> `--draft-weight-quantization`)."""

    draft_weight_quantization: str = "fp8"  # the DFlash drafters' weight tier
    mtp_quantization: str = "bf16"  # the MTP head's own precision
    mtp_experts_nvfp4: bool = False  # requantize the head's experts to NVFP4
    draft_tp_size: int | str = 1  # rank count, or "auto": the serve's world size
    trt_flavor: str = "auto"  # auto: the builder picks a flavour that is installed
    target_sm: tuple[int, ...] = (89, 120)  # SM numbers the engines and cubins are built for
    cpu_engines: str = "aoti"  # aoti: the target's steps as AOTInductor packages for this CPU
    trt_dtype: str = "bfloat16"  # what the ONNX graphs and TensorRT engines compute in
    onnx: bool = True  # each component's step as an ONNX graph (what TensorRT compiles and
    # the onnxruntime backend runs)

    def __post_init__(self) -> None:
        _one_of("cpu_engines", self.cpu_engines, CPU_ENGINES)
        _one_of("draft_weight_quantization", self.draft_weight_quantization,
                DRAFT_WEIGHT_QUANTIZATIONS)
        _one_of("mtp_quantization", self.mtp_quantization, MTP_QUANTIZATIONS)
        _one_of("trt_flavor", self.trt_flavor, TRT_FLAVORS)
        _one_of("trt_dtype", self.trt_dtype, TRT_DTYPES)
        for key in ("mtp_experts_nvfp4", "onnx"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} = {getattr(self, key)!r} is not allowed; expected true or false")
        if not self.onnx and self.trt_flavor != "none":
            raise ConfigError(f"onnx = false with trt_flavor = {self.trt_flavor!r}: TensorRT builds its "
                              "engines from the ONNX graphs; set trt_flavor = \"none\" or onnx = true")
        if self.mtp_experts_nvfp4 and self.mtp_quantization != "bf16":
            # The experts are requantized from BF16: an FP8 head has no BF16 experts to start from.
            raise ConfigError(
                f"mtp_experts_nvfp4 = true needs mtp_quantization = \"bf16\", got "
                f"{self.mtp_quantization!r}"
            )
        tp = self.draft_tp_size
        if tp != "auto" and not (_is_int(tp) and tp >= 1):
            raise ConfigError(
                f"draft_tp_size = {tp!r} is not allowed; expected \"auto\" or a rank count of "
                "at least 1"
            )
        sms = self.target_sm
        if isinstance(sms, list):
            sms = tuple(sms)
            object.__setattr__(self, "target_sm", sms)
        if not isinstance(sms, tuple) or not sms or not all(_is_int(s) for s in sms):
            raise ConfigError(
                f"target_sm = {self.target_sm!r} is not allowed; expected a non-empty list of "
                "integer SM numbers such as [89, 120]"
            )
        bad = [s for s in sms if s < MIN_TARGET_SM]
        if bad:
            raise ConfigError(
                f"target_sm = {list(sms)!r}: SM {bad[0]} is not allowed; expected SM numbers of "
                f"at least {MIN_TARGET_SM} such as 89 or 120"
            )
        if len(set(sms)) != len(sms):
            raise ConfigError(f"target_sm = {list(sms)!r} lists an SM twice")

    def replace(self, **overrides: Any) -> BuildOptions:
        """A copy with `overrides` applied and revalidated; None values are ignored (an unset
        CLI flag leaves the recipe's value)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(
                f"unknown build option {unknown[0]!r}; allowed: {', '.join(sorted(known))}"
            )
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    @classmethod
    def from_table(cls, table: Mapping[str, Any], source: str) -> BuildOptions:
        """From a recipe's [build] table; `source` names the file in errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        _refuse_unknown(table, known, "[build]", source)
        try:
            return cls(**table)
        except ConfigError as e:
            raise ConfigError(f"{source}: [build] {e}") from None


@dataclass(frozen=True)
class ComponentSource:
    """One component of a recipe: its name (its engine-dir folder) and checkpoint folder."""

    name: str
    checkpoint: Path  # absolute, resolved against the recipe's folder
    kind: str = ""  # a drafter's component kind (`runtime.components.KINDS`, role drafter)

    def __post_init__(self) -> None:
        if not is_component_name(self.name):
            raise ConfigError(f"component name {self.name!r} is not {COMPONENT_NAME_RULE}")
        cp = Path(self.checkpoint)
        object.__setattr__(self, "checkpoint", cp)
        if not cp.is_dir():
            state = "is not a folder" if cp.exists() else "does not exist"
            raise ConfigError(f"checkpoint {str(cp)!r} of component {self.name} {state}")
        if not (cp / "config.json").is_file():
            raise ConfigError(
                f"checkpoint {str(cp)!r} of component {self.name} has no config.json; expected a "
                "Hugging Face checkpoint folder"
            )


@dataclass(frozen=True)
class Recipe:
    """A parsed recipe. `drafters` maps component name -> source, in the file's order."""

    name: str
    engine_dir: Path  # relative to the current working directory unless absolute
    target: ComponentSource
    base_dir: Path  # the recipe file's folder
    mtp: ComponentSource | None = None
    drafters: dict[str, ComponentSource] = field(default_factory=dict)
    build: BuildOptions = field(default_factory=BuildOptions)

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and self.name.strip()):
            raise ConfigError(
                f"recipe name {self.name!r} is not allowed; expected a non-empty string")
        names = [c.name for c in self.components]
        for name in names:
            if names.count(name) > 1:
                raise ConfigError(f"component name {name!r} is used twice; each names a folder")
        for key, source in self.drafters.items():
            if key != source.name:
                raise ConfigError(f"drafters[{key!r}] holds component {source.name!r}")
        if self.build.mtp_experts_nvfp4 and self.mtp is None:
            raise ConfigError(
                "mtp_experts_nvfp4 = true needs an MTP head, and the recipe has no [mtp]")

    @property
    def components(self) -> list[ComponentSource]:
        """Target, then MTP head (if any), then drafters in the file's order."""
        return [self.target] + ([self.mtp] if self.mtp else []) + list(self.drafters.values())

    def with_build(self, **overrides: Any) -> Recipe:
        """A copy whose build options have `overrides` applied (see `BuildOptions.replace`)."""
        return dataclasses.replace(self, build=self.build.replace(**overrides))


def _refuse_unknown(table: Mapping[str, Any], known: set[str], where: str, source: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(
            f"{source}: unknown key {unknown[0]!r} in {where}; allowed: {', '.join(sorted(known))}"
        )


def _table(data: Mapping[str, Any], key: str, where: str, source: str) -> dict[str, Any]:
    value = data[key]
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {where} must be a table, got {value!r}")
    return value


def drafter_kinds() -> list[str]:
    """The component kinds a [drafters.<name>] table may name (the registry's drafters)."""
    from metrale.runtime.components import KINDS, Role

    return [name for name, k in KINDS.items() if k.role is Role.DRAFTER]


def _component(table: Mapping[str, Any], name: str, where: str, source: str,
               base: Path, drafter: bool = False) -> ComponentSource:
    _refuse_unknown(table, {"checkpoint", "kind"} if drafter else {"checkpoint"}, where, source)
    checkpoint = table.get("checkpoint")
    if not isinstance(checkpoint, str) or not checkpoint:
        raise ConfigError(f"{source}: {where} needs checkpoint = \"<folder>\", got {checkpoint!r}")
    kind = ""
    if drafter:
        kind = table.get("kind", "dflash")
        if kind not in drafter_kinds():
            raise ConfigError(f"{source}: {where} kind = {kind!r}: expected one of "
                              f"{', '.join(drafter_kinds())}")
    try:
        return ComponentSource(name, (base / checkpoint).resolve(), kind)
    except ConfigError as e:
        raise ConfigError(f"{source}: {where} checkpoint = {checkpoint!r}: {e}") from None


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Read and validate a recipe file; every problem is a ConfigError naming the file and key."""
    file = Path(path)
    source = os.fspath(path)
    try:
        with open(file, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"recipe {source} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"recipe {source} cannot be read as TOML ({e})") from None
    base = file.resolve().parent
    _refuse_unknown(data, {"recipe", "target", "mtp", "drafters", "build"}, "the top level", source)
    for required in ("recipe", "target"):
        if required not in data:
            raise ConfigError(f"{source}: missing table [{required}]")

    head = _table(data, "recipe", "[recipe]", source)
    _refuse_unknown(head, {"name", "engine_dir"}, "[recipe]", source)
    name = head.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{source}: [recipe] name must be a non-empty string, got {name!r}")
    engine_dir = head.get("engine_dir", f"engines/{name}")
    if not isinstance(engine_dir, str) or not engine_dir:
        raise ConfigError(
            f"{source}: [recipe] engine_dir must be a path string, got {engine_dir!r}")

    target = _component(_table(data, "target", "[target]", source), "target", "[target]", source,
                        base)
    mtp = None
    if "mtp" in data:
        mtp = _component(_table(data, "mtp", "[mtp]", source), "mtp", "[mtp]", source, base)
    drafters: dict[str, ComponentSource] = {}
    if "drafters" in data:
        for dname, table in _table(data, "drafters", "[drafters]", source).items():
            where = f"[drafters.{dname}]"
            if not isinstance(table, dict):
                raise ConfigError(f"{source}: {where} must be a table, got {table!r}")
            if not is_component_name(dname) or dname in ("target", "mtp"):
                raise ConfigError(f"{source}: drafter name {dname!r} in {where} is not "
                                  f"{COMPONENT_NAME_RULE}; 'target' and 'mtp' are taken too")
            drafters[dname] = _component(table, dname, where, source, base, drafter=True)

    build = BuildOptions()
    if "build" in data:
        build = BuildOptions.from_table(_table(data, "build", "[build]", source), source)
    try:
        return Recipe(name=name, engine_dir=Path(engine_dir), target=target, base_dir=base,
                      mtp=mtp, drafters=drafters, build=build)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
