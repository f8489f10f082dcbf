"""Tests for metrale.builder.recipe: recipe TOML parsing and build-option validation."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.builder.recipe import (
    DEFAULT_RECIPE,
    BuildOptions,
    load_recipe,
    parse_draft_tp_size,
    parse_target_sm,
)
from metrale.runtime.errors import ConfigError

FULL = """
[recipe]
name = "tiny"
engine_dir = "engines/tiny"

[target]
checkpoint = "tiny/target"

[mtp]
checkpoint = "tiny/mtp"

[drafters.dflash]
checkpoint = "tiny/dflash"
[drafters.dflash2]
checkpoint = "tiny/dflash2"

[build]
draft_weight_quantization = "nvfp4"
mtp_quantization = "bf16"
mtp_experts_nvfp4 = true
draft_tp_size = 2
trt_flavor = "none"
target_sm = [89, 120]
"""

MINIMAL = """
[recipe]
name = "small"
[target]
checkpoint = "tiny/target"
"""


def _checkpoints(root: Path, names=("target", "mtp", "dflash", "dflash2")) -> None:
    for name in names:
        (root / "tiny" / name).mkdir(parents=True)
        (root / "tiny" / name / "config.json").write_text("{}")


def _recipe(root: Path, text: str) -> Path:
    path = root / "recipes" / "r.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def tree(tmp_path):
    # The recipe lives in tmp_path/recipes, its checkpoints in tmp_path/recipes/tiny.
    _checkpoints(tmp_path / "recipes")
    return tmp_path


def test_full_recipe(tree):
    r = load_recipe(_recipe(tree, FULL))
    base = (tree / "recipes").resolve()
    assert r.name == "tiny"
    assert r.engine_dir == Path("engines/tiny")  # stays relative: resolved against the CWD later
    assert r.base_dir == base
    assert r.target.name == "target" and r.target.checkpoint == base / "tiny" / "target"
    assert r.mtp is not None and r.mtp.checkpoint == base / "tiny" / "mtp"
    assert list(r.drafters) == ["dflash", "dflash2"]
    assert r.drafters["dflash2"].checkpoint == base / "tiny" / "dflash2"
    assert [c.name for c in r.components] == ["target", "mtp", "dflash", "dflash2"]
    assert r.build == BuildOptions(draft_weight_quantization="nvfp4", mtp_quantization="bf16",
                                   mtp_experts_nvfp4=True, draft_tp_size=2, trt_flavor="none",
                                   target_sm=(89, 120))


def test_minimal_recipe_takes_defaults(tree):
    r = load_recipe(_recipe(tree, MINIMAL))
    assert r.engine_dir == Path("engines/small")
    assert r.mtp is None and r.drafters == {}
    assert r.build == BuildOptions()
    assert (r.build.draft_weight_quantization, r.build.mtp_quantization) == ("fp8", "bf16")
    assert (r.build.draft_tp_size, r.build.target_sm) == (1, (89, 120))
    assert r.build.mtp_experts_nvfp4 is False


def test_default_recipe_path_points_at_the_repo_recipes_folder():
    import metrale.builder.recipe as mod

    assert DEFAULT_RECIPE == Path(mod.__file__).resolve().parent.parent / "recipes" / "tiny.toml"
    assert DEFAULT_RECIPE.parent.name == "recipes"


@pytest.mark.parametrize("text, match", [
    (FULL + "\nextra = 1\n", "unknown key 'extra' in \\[build\\]"),
    (FULL.replace('name = "tiny"', 'name = "tiny"\nversion = 2'),
     "unknown key 'version' in \\[recipe\\]"),
    (FULL.replace('checkpoint = "tiny/mtp"', 'checkpoint = "tiny/mtp"\nquant = 1'),
     "unknown key 'quant' in \\[mtp\\]"),
    (FULL.replace('checkpoint = "tiny/dflash"\n', 'checkpoint = "tiny/dflash"\nkind = "x"\n'),
     "\\[drafters.dflash\\] kind = 'x': expected one of dflash"),
    (FULL.replace('checkpoint = "tiny/mtp"', 'checkpoint = "tiny/mtp"\nkind = "dflash"'),
     "unknown key 'kind' in \\[mtp\\]"),
    ("[servers]\n" + MINIMAL, "unknown key 'servers' in the top level"),
])
def test_unknown_keys_refused_naming_key_and_file(tree, text, match):
    path = _recipe(tree, text)
    with pytest.raises(ConfigError, match=match) as e:
        load_recipe(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("line, match", [
    ('draft_weight_quantization = "int4"',
     "draft_weight_quantization = 'int4' is not allowed; expected one of declared, fp8, "
     "fp8-aux, nvfp4"),
    ('mtp_quantization = "nvfp4"',
     "mtp_quantization = 'nvfp4' is not allowed; expected one of bf16, fp8"),
    ('trt_flavor = "onnx"', "trt_flavor = 'onnx' is not allowed; expected one of auto, rtx"),
    ("draft_tp_size = 0", "draft_tp_size = 0 is not allowed; expected \"auto\" or a rank count"),
    ('draft_tp_size = "2"', "draft_tp_size = '2' is not allowed"),
    ('target_sm = ["89"]',
     "target_sm = \\('89',\\) is not allowed; expected a non-empty list of integer"),
    ("target_sm = 89", "target_sm = 89 is not allowed"),
    ("target_sm = []", "target_sm = \\(\\) is not allowed"),
    ("target_sm = [61]", "SM 61 is not allowed; expected SM numbers of at least 75"),
    ("target_sm = [89, 89]", "lists an SM twice"),
    ('mtp_experts_nvfp4 = "yes"',
     "mtp_experts_nvfp4 = 'yes' is not allowed; expected true or false"),
])
def test_bad_build_values_refused(tree, line, match):
    path = _recipe(tree, MINIMAL + "[build]\n" + line + "\n")
    with pytest.raises(ConfigError, match=match) as e:
        load_recipe(path)
    assert str(e.value).startswith(f"{path}: [build] ")


def test_experts_nvfp4_needs_bf16_head_and_an_mtp_table(tree):
    text = FULL.replace('mtp_quantization = "bf16"', 'mtp_quantization = "fp8"')
    with pytest.raises(ConfigError, match='experts_nvfp4 = true needs mtp_quantization = "bf16"'):
        load_recipe(_recipe(tree, text))
    text = MINIMAL + "[build]\nmtp_experts_nvfp4 = true\n"
    with pytest.raises(ConfigError, match="needs an MTP head, and the recipe has no \\[mtp\\]"):
        load_recipe(_recipe(tree, text))


def test_missing_checkpoint_refused_naming_key_and_path(tree):
    text = FULL.replace("tiny/dflash2", "tiny/nowhere")
    with pytest.raises(ConfigError, match=r"\[drafters.dflash2\] checkpoint = 'tiny/nowhere'.*"
                                          r"does not exist"):
        load_recipe(_recipe(tree, text))


def test_checkpoint_that_is_a_file_refused(tree):
    (tree / "recipes" / "tiny" / "weights.bin").write_bytes(b"x")
    text = FULL.replace('"tiny/target"', '"tiny/weights.bin"')
    with pytest.raises(ConfigError, match=r"\[target\] checkpoint = 'tiny/weights.bin'.*"
                                          r"is not a folder"):
        load_recipe(_recipe(tree, text))


def test_checkpoint_without_config_json_refused(tree):
    (tree / "recipes" / "tiny" / "mtp" / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"\[mtp\] checkpoint = 'tiny/mtp'.*has no config.json"):
        load_recipe(_recipe(tree, FULL))


@pytest.mark.parametrize("text, match", [
    ("[target]\ncheckpoint = \"tiny/target\"\n", "missing table \\[recipe\\]"),
    ("[recipe]\nname = \"x\"\n", "missing table \\[target\\]"),
    ("[recipe]\nname = \"\"\n[target]\ncheckpoint = \"tiny/target\"\n", "name must be a non-empty"),
    ("[recipe]\nname = \"x\"\n[target]\n", "\\[target\\] needs checkpoint"),
    ("[recipe]\nname = \"x\"\nengine_dir = 3\n[target]\ncheckpoint = \"tiny/target\"\n",
     "engine_dir must be a path string"),
    (MINIMAL + "[drafters.mtp]\ncheckpoint = \"tiny/dflash\"\n", "drafter name 'mtp'"),
    (MINIMAL + "[drafters.plugins]\ncheckpoint = \"tiny/dflash\"\n", "drafter name 'plugins'"),
    (MINIMAL + "[drafters]\ndflash = \"tiny/dflash\"\n", "\\[drafters.dflash\\] must be a table"),
    ("[recipe\nname=", "cannot be read as TOML"),
])
def test_malformed_recipes_refused(tree, text, match):
    with pytest.raises(ConfigError, match=match):
        load_recipe(_recipe(tree, text))


def test_missing_recipe_file_refused(tmp_path):
    with pytest.raises(ConfigError, match="recipe .*nope.toml does not exist"):
        load_recipe(tmp_path / "nope.toml")


def test_replace_overrides_and_revalidates(tree):
    r = load_recipe(_recipe(tree, FULL))
    opts = r.build.replace(draft_weight_quantization="fp8-aux", trt_flavor=None)
    assert opts.draft_weight_quantization == "fp8-aux"
    assert opts.trt_flavor == "none"  # None: an unset flag keeps the recipe's value
    assert r.build.draft_weight_quantization == "nvfp4"  # the original is unchanged
    assert opts.replace(target_sm=[120]).target_sm == (120,)
    with pytest.raises(ConfigError, match="draft_tp_size = -1 is not allowed"):
        opts.replace(draft_tp_size=-1)
    with pytest.raises(ConfigError, match="unknown build option 'draft_quant'"):
        opts.replace(draft_quant="fp8")
    with pytest.raises(ConfigError, match="needs mtp_quantization"):
        r.with_build(mtp_quantization="fp8")  # the recipe turns mtp_experts_nvfp4 on
    assert r.with_build(draft_tp_size="auto").build.draft_tp_size == "auto"


def test_cli_value_parsers():
    assert parse_draft_tp_size("auto") == "auto"
    assert parse_draft_tp_size("3") == 3
    for bad in ("0", "-2", "two", ""):
        with pytest.raises(ConfigError, match=f"got {bad!r}"):
            parse_draft_tp_size(bad)
    assert parse_target_sm("89,120") == (89, 120)
    with pytest.raises(ConfigError, match="comma-separated"):
        parse_target_sm("89;120")


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=-10**6, max_value=10**6))
def test_draft_tp_size_accepts_exactly_positive_counts(n):
    if n >= 1:
        assert BuildOptions(draft_tp_size=n).draft_tp_size == n
    else:
        with pytest.raises(ConfigError, match=f"draft_tp_size = {n} is not allowed"):
            BuildOptions(draft_tp_size=n)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=5))
def test_target_sm_accepts_distinct_sms_from_75(sms):
    ok = all(s >= 75 for s in sms) and len(set(sms)) == len(sms)
    if ok:
        assert BuildOptions(target_sm=sms).target_sm == tuple(sms)
    else:
        with pytest.raises(ConfigError, match="target_sm"):
            BuildOptions(target_sm=sms)
