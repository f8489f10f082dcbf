"""Flag parsing: every refusal names the flag, the value and what is allowed."""

import dataclasses
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale.runtime.errors import ConfigError
from metrale.runtime.spec.config import (
    HELP,
    DraftStop,
    DraftTpSize,
    SpecMode,
    SpeculativeConfig,
    parse_ladder,
    resolve_dflash,
    resolve_draft_tp_size,
)
from metrale.runtime.spec.cost_model import CostModel

FLAGS = [
    "--speculative", "--num-drafts", "--draft-confidence-stop", "--dflash", "--dflash-gamma",
    "--dflash-draft-ladder", "--dflash-adaptive-k", "--dflash-reprobe-interval", "--exact-verify",
    "--draft-tp-size", "--dflash-drafter", "--draft-weight-quantization", "--mtp-experts-nvfp4",
    "--dflash-tree-budget", "--dflash-tree-verify",
]

# Sentences of the seeds' flag definitions (their `///` text is the --help text), which the help
# keeps word for word; metrale's additions follow them.
SEED_SENTENCES = {
    "--draft-confidence-stop": [
        "With cum:TAU, it extends the chain only while the product of the chain's top-1 "
        "probabilities so far is at least TAU.",
        "It changes which drafts are verified, never the emitted tokens. 0 < TAU < 1. Requires "
        "`--speculative`; not with `--dflash`."],
    "--dflash-adaptive-k": [
        "Each C = 1 step then verifies the count with the most expected tokens per ms at the "
        "sequence's measured acceptance, capped by the ladder rung (or γ - 1), and with a `0:` "
        "entry suspends speculation (until the re-probe) where plain decode pays more.",
        "Unset (the default): the ladder or the γ resolver decides."],
    "--draft-tp-size": [
        "1 runs the whole drafter on rank 0.",
        "so the value must be 1 or the world size, and the drafter's KV heads must cover every "
        "rank; startup refuses anything else. Set the same value on every rank. Unset (the "
        "default): 1."],
    "--draft-weight-quantization": [
        "`nvfp4`: NVFP4 copies (4-bit E2M1, one FP8 scale per 16 weights) of everything "
        "`fp8-aux` copies, run as W4A16; each tensor's scale comes from the whole unsharded "
        "tensor, so `--draft-tp-size` ranks hold exactly the one-rank drafter's bytes."],
    "--mtp-experts-nvfp4": [
        "The head's routed and shared experts are requantized from BF16 to NVFP4 at load",
        "Refused on any other head (dense FFN, FP8 experts, or --mtp-quantization other than "
        "bf16)."],
}


def refused(match: str, **flags) -> None:
    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig.from_flags(**flags)


# --- help text -------------------------------------------------------------------------------


def test_help_covers_every_flag_without_dates_or_foreign_names():
    assert sorted(HELP) == sorted(FLAGS)
    for flag, text in HELP.items():
        assert not re.search(r"\d{4}-\d{2}-\d{2}", text), flag
        assert "::" not in text and "_args" not in text and ".rs" not in text, flag
    for flag, sentences in SEED_SENTENCES.items():
        for sentence in sentences:
            assert sentence in HELP[flag], (flag, sentence)


def test_help_states_the_bounds_parsing_enforces():
    from metrale.runtime.spec.config import MAX_NUM_DRAFTS

    assert f"At least 1. Requires --speculative. (metrale: at most {MAX_NUM_DRAFTS}.)" in HELP["--num-drafts"]
    refused(f"at most {MAX_NUM_DRAFTS}", speculative=True, num_drafts=MAX_NUM_DRAFTS + 1)
    assert SpeculativeConfig.from_flags(speculative=True, num_drafts=MAX_NUM_DRAFTS).num_drafts == 32
    # each tier flag says which mode reads it (generate and serve; bench has its own texts)
    assert HELP["--mtp-experts-nvfp4"].endswith("Requires --speculative.")
    assert HELP["--draft-weight-quantization"].endswith("Requires --dflash.")


def test_confidence_stop_help_keeps_every_point_of_the_seed():
    text = HELP["--draft-confidence-stop"]
    for point in ["top-1 probability is at least TAU", "still verified", "cum:TAU", "product",
                  "never the emitted tokens", "0 < TAU < 1", "Requires `--speculative`",
                  "not with `--dflash`"]:
        assert point in text, point


# --- DraftStop -------------------------------------------------------------------------------


def test_draft_stop_parses_both_forms():
    assert DraftStop.parse("0.6") == DraftStop(cumulative=False, tau=0.6)
    assert DraftStop.parse("cum:0.25") == DraftStop(cumulative=True, tau=0.25)
    assert DraftStop.parse("5e-1") == DraftStop(cumulative=False, tau=0.5)


@pytest.mark.parametrize("bad", ["0", "1", "1.5", "-0.1", "nan", "NaN", "inf", "cum:", "abc",
                                 "cum:abc", "cum:cum:0.5", "", " 0.5", "0_5", "CUM:0.5", "cum:1"])
def test_draft_stop_refuses(bad):
    with pytest.raises(ConfigError, match="--draft-confidence-stop.*0 < TAU < 1"):
        DraftStop.parse(bad)


@given(st.booleans(), st.floats(min_value=0.0, max_value=1.0, exclude_min=True, exclude_max=True))
def test_draft_stop_round_trips(cumulative, tau):
    stop = DraftStop(cumulative, tau)
    assert DraftStop.parse(str(stop)) == stop


@given(st.text(max_size=12))
def test_draft_stop_parse_accepts_only_tau_in_the_open_interval(s):
    try:
        stop = DraftStop.parse(s)
    except ConfigError:
        return
    assert 0.0 < stop.tau < 1.0 and stop.cumulative == s.startswith("cum:")


# --- CostModel -------------------------------------------------------------------------------


def test_cost_model_parses_the_seed_example():
    m = CostModel.parse("0:32,1:44,2:50,3:56")
    assert m.first == 0 and m.ms == (32.0, 44.0, 50.0, 56.0)
    assert list(m.counts) == [0, 1, 2, 3] and m.max_count == 3 and m.cost(2) == 50.0
    assert CostModel.parse(" 1:4.5 , 2:6 ").pairs() == [(1, 4.5), (2, 6.0)]


@pytest.mark.parametrize(
    "bad, why",
    [
        ("0:32,2:50", "consecutive"),
        ("1:44,0:32", "consecutive"),
        ("2:50,3:56", "start at 2"),
        ("0:32,0:33", "twice"),
        ("0:32,1:0", "above 0"),
        ("0:32,1:-4", "above 0"),
        ("0:32,1:1e999", "finite"),
        ("0:32,1:nan", "malformed"),
        ("0:32,1", "malformed"),
        ("0=32", "malformed"),
        ("", "malformed"),
        ("a:1", "malformed"),
        ("1.5:3", "malformed"),
        ("-1:3,0:4", "malformed"),
        ("0:32", "at least one draft count"),
    ],
)
def test_cost_model_refuses(bad, why):
    with pytest.raises(ConfigError, match=rf"--dflash-adaptive-k.*{re.escape(why)}"):
        CostModel.parse(bad)


@given(st.integers(0, 1), st.lists(st.floats(0.001, 1e4), min_size=1, max_size=8))
def test_cost_model_round_trips(first, ms):
    if first == 0 and len(ms) == 1:
        ms = ms + [1.0]  # a model needs at least one draft count
    m = CostModel(first, tuple(ms))
    assert CostModel.parse(str(m)) == m


@given(st.text(alphabet="0123456789:,.-e ", max_size=20))
def test_cost_model_parse_yields_only_valid_models(s):
    try:
        m = CostModel.parse(s)
    except ConfigError:
        return
    assert m.first in (0, 1) and m.max_count >= 1
    assert all(math.isfinite(x) and x > 0 for x in m.ms)


# --- ladder ----------------------------------------------------------------------------------


def test_ladder_parses():
    assert parse_ladder("1,3,7") == (1, 3, 7)
    assert parse_ladder("2") == (2,)


@pytest.mark.parametrize("bad", ["", "0,1", "3,3", "3,1", "1,,3", "1;3", "a", "-1,2", "1.0"])
def test_ladder_refuses(bad):
    with pytest.raises(ConfigError, match="--dflash-draft-ladder.*strictly ascending"):
        parse_ladder(bad)


@given(st.lists(st.integers(1, 64), min_size=1, max_size=6, unique=True))
def test_ladder_round_trips_sorted_and_refuses_unsorted(counts):
    s = ",".join(map(str, counts))
    if counts == sorted(counts):
        assert parse_ladder(s) == tuple(counts)
    else:
        with pytest.raises(ConfigError):
            parse_ladder(s)


# --- draft tp size ---------------------------------------------------------------------------


def test_draft_tp_size_parse():
    assert DraftTpSize.parse("auto").ranks_on(4) == 4
    assert DraftTpSize.parse("2").ranks_on(4) == 2
    assert DraftTpSize.parse(1) == DraftTpSize(1)


@pytest.mark.parametrize("bad", ["0", 0, "-1", "two", "", "1.0", True])
def test_draft_tp_size_refuses_with_the_seed_message(bad):
    with pytest.raises(ConfigError) as e:
        DraftTpSize.parse(bad)
    assert "--draft-tp-size: expected `auto` or a rank count of at least 1, got" in str(e.value)
    if bad == "0":
        assert str(e.value).endswith('got "0"')


# --- SpeculativeConfig.from_flags ------------------------------------------------------------


def test_defaults_per_mode():
    off = SpeculativeConfig.from_flags()
    assert off.mode is SpecMode.OFF and off.num_drafts is None and off.dflash_drafter is None
    mtp = SpeculativeConfig.from_flags(speculative=True)
    assert mtp.mode is SpecMode.MTP and mtp.num_drafts == 3 and mtp.draft_stop is None
    df = SpeculativeConfig.from_flags(dflash=True)
    assert df.mode is SpecMode.DFLASH and df.dflash_drafter == "dflash"
    assert df.draft_tp_size == DraftTpSize(1) and df.dflash_reprobe_interval is None
    ak = SpeculativeConfig.from_flags(dflash=True, dflash_adaptive_k="0:32,1:44")
    assert ak.dflash_reprobe_interval == 16


def test_full_flag_sets():
    mtp = SpeculativeConfig.from_flags(
        speculative=True, num_drafts=5, draft_confidence_stop="cum:0.3", exact_verify=True
    )
    assert (mtp.num_drafts, mtp.draft_stop, mtp.exact_verify) == (5, DraftStop(True, 0.3), True)
    df = SpeculativeConfig.from_flags(
        dflash=True, dflash_gamma=8, dflash_draft_ladder="1,3,7",
        dflash_adaptive_k="0:32,1:44,2:50,3:56", dflash_reprobe_interval=4,
        draft_tp_size="auto", dflash_drafter="dflash2",
    )
    assert df.dflash_draft_ladder == (1, 3, 7) and df.dflash_adaptive_k.max_count == 3
    assert df.dflash_reprobe_interval == 4 and df.draft_tp_size.ranks is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        df.dflash_gamma = 4


DFLASH = dict(dflash=True)
MTP = dict(speculative=True)
AK = dict(dflash=True, dflash_adaptive_k="0:1,1:2")


@pytest.mark.parametrize(
    "flags, match",
    [
        (dict(MTP, dflash=True), "--speculative and --dflash exclude"),
        (dict(draft_confidence_stop="0.5"), '--draft-confidence-stop "0.5" requires --speculative'),
        (dict(draft_confidence_stop="abc"), '--draft-confidence-stop "abc" requires --speculative'),
        (dict(DFLASH, draft_confidence_stop="0.5"), "requires --speculative; not with --dflash"),
        (dict(MTP, draft_confidence_stop="1.0"), '--draft-confidence-stop.*"1.0"'),
        (dict(MTP, draft_confidence_stop="cum:"), '--draft-confidence-stop.*"cum:"'),
        (dict(MTP, num_drafts=0), '--num-drafts: got "0"; expected an integer of at least 1'),
        (dict(num_drafts=2), '--num-drafts "2" requires --speculative'),
        (dict(DFLASH, num_drafts=2), "--num-drafts.*requires --speculative"),
        (dict(exact_verify=True), "--exact-verify requires --speculative or --dflash"),
        (dict(mtp_experts_nvfp4=True), r"--mtp-experts-nvfp4 requires --speculative \("),
        (dict(mtp_experts_nvfp4=False), r"--no-mtp-experts-nvfp4 requires --speculative \("),
        (dict(DFLASH, mtp_experts_nvfp4=True), "--mtp-experts-nvfp4 requires --speculative.*; not "
                                               "with --dflash"),
        (dict(dflash_gamma=4), '--dflash-gamma "4" requires --dflash'),
        (dict(MTP, dflash_draft_ladder="1,3"), '--dflash-draft-ladder "1,3" requires --dflash'),
        (dict(dflash_adaptive_k="0:1,1:2"), "--dflash-adaptive-k .* requires --dflash"),
        (dict(draft_tp_size="2"), '--draft-tp-size "2" requires --dflash'),
        (dict(dflash_drafter="dflash2"), '--dflash-drafter "dflash2" requires --dflash'),
        (dict(DFLASH, dflash_gamma=1), '--dflash-gamma: got "1"; expected an integer of at least 2'),
        (dict(DFLASH, dflash_reprobe_interval=4), "--dflash-reprobe-interval.*--dflash-adaptive-k"),
        (dict(AK, dflash_reprobe_interval=0), '--dflash-reprobe-interval: got "0"; expected an'),
        (dict(DFLASH, draft_tp_size="0"), '--draft-tp-size: expected `auto` or a rank count of at '
                                          'least 1, got "0"'),
        (dict(DFLASH, dflash_drafter="../x"), '--dflash-drafter: got "../x"'),
        (dict(DFLASH, dflash_draft_ladder="3,2"), "--dflash-draft-ladder.*rung 2 after 3"),
        (dict(DFLASH, dflash_gamma=4, dflash_draft_ladder="1,4"),
         r"--dflash-draft-ladder: rung 4 .*γ − 1 = 3 \(--dflash-gamma 4\)"),
        (dict(DFLASH, dflash_gamma=3, dflash_adaptive_k="0:1,1:2,2:3,3:4"),
         r"--dflash-adaptive-k: count 3 .*γ − 1 = 2"),
        (dict(dflash_tree_budget=16), '--dflash-tree-budget "16" requires --dflash'),
        (dict(DFLASH, dflash_tree_budget=-1), '--dflash-tree-budget: got "-1"; expected an integer of at least 0'),
        (dict(DFLASH, dflash_tree_budget=65), '--dflash-tree-budget: got "65"; expected .* at most 64'),
        (dict(dflash_tree_verify="paths"), '--dflash-tree-verify "paths" requires --dflash'),
        (dict(DFLASH, dflash_tree_verify="paths"), '--dflash-tree-verify "paths" requires --dflash-tree-budget'),
        (dict(DFLASH, dflash_tree_budget=8, dflash_tree_verify="tree"),
         '--dflash-tree-verify: got "tree"; expected one of auto, forward, paths'),
        (dict(DFLASH, dflash_tree_budget=8, dflash_draft_ladder="1,3"),
         "--dflash-tree-budget 8 and --dflash-draft-ladder exclude each other"),
        (dict(DFLASH, dflash_gamma=4, dflash_tree_budget=3, dflash_adaptive_k="1:1,2:2,3:3,4:4"),
         "--dflash-adaptive-k: count 4 is a tree of more nodes than --dflash-tree-budget 3"),
    ],
)
def test_from_flags_refuses(flags, match):
    refused(match, **flags)


def test_direct_construction_is_validated_like_flags():
    with pytest.raises(ConfigError, match="--num-drafts"):
        SpeculativeConfig(mode=SpecMode.MTP, num_drafts=0)
    cfg = SpeculativeConfig.from_flags(speculative=True)
    with pytest.raises(ConfigError, match="--dflash-drafter.*requires --dflash"):
        dataclasses.replace(cfg, dflash_drafter="dflash")


# --- resolve against the drafter -------------------------------------------------------------


def test_resolve_gamma_defaults_to_block_size_and_may_be_lowered():
    r = resolve_dflash(SpeculativeConfig.from_flags(dflash=True), block_size=16)
    assert (r.gamma, r.max_drafts, r.drafter) == (16, 15, "dflash")
    r = resolve_dflash(SpeculativeConfig.from_flags(dflash=True, dflash_gamma=8), block_size=16)
    assert (r.gamma, r.max_drafts) == (8, 7)
    r = resolve_dflash(SpeculativeConfig.from_flags(dflash=True, dflash_gamma=16), block_size=16)
    assert r.gamma == 16


def test_resolve_refusals_name_the_flag_and_the_block_size():
    msg = r"--dflash-gamma: got 17, above .*block size 16; expected 2 <= γ <= 16"
    with pytest.raises(ConfigError, match=msg):
        resolve_dflash(SpeculativeConfig.from_flags(dflash=True, dflash_gamma=17), block_size=16)
    cfg = SpeculativeConfig.from_flags(dflash=True, dflash_draft_ladder="1,3,8")
    assert resolve_dflash(cfg, block_size=9).ladder == (1, 3, 8)  # 8 = γ − 1: allowed
    msg = r'--dflash-draft-ladder: rung 8 .*γ − 1 = 7 \(the drafter "dflash"\'s block size 8\)'
    with pytest.raises(ConfigError, match=msg):
        resolve_dflash(cfg, block_size=8)
    cfg = SpeculativeConfig.from_flags(dflash=True, dflash_adaptive_k="1:5,2:6,3:7,4:8")
    with pytest.raises(ConfigError, match="--dflash-adaptive-k: count 4 .*γ − 1 = 3"):
        resolve_dflash(cfg, block_size=4)
    with pytest.raises(ConfigError, match="block_size"):
        resolve_dflash(SpeculativeConfig.from_flags(dflash=True), block_size=1)
    with pytest.raises(ConfigError, match="needs --dflash"):
        resolve_dflash(SpeculativeConfig.from_flags(speculative=True), block_size=16)


def test_resolve_draft_tp_size():
    cfg = SpeculativeConfig.from_flags(dflash=True, draft_tp_size="auto")
    assert resolve_draft_tp_size(cfg, world_size=4, num_kv_heads=8) == 4
    assert resolve_draft_tp_size(SpeculativeConfig.from_flags(dflash=True), 4, 8) == 1
    msg = "--draft-tp-size: got 2 on a serve of 4 ranks.*expected 1 or 4"
    with pytest.raises(ConfigError, match=msg):
        resolve_draft_tp_size(SpeculativeConfig.from_flags(dflash=True, draft_tp_size="2"), 4, 8)
    # the seed's rule: the KV heads cover every rank (6 over 4 split 2, 2, 1, 1)
    assert resolve_draft_tp_size(cfg, world_size=4, num_kv_heads=6) == 4
    assert resolve_draft_tp_size(cfg, world_size=3, num_kv_heads=4) == 3
    with pytest.raises(ConfigError, match="--draft-tp-size: got 4, but the drafter's 3 KV heads "
                                          "do not cover 4 ranks; expected 1 or at most 3 ranks"):
        resolve_draft_tp_size(cfg, world_size=4, num_kv_heads=3)


def test_adaptive_k_prices_tree_budgets_up_to_the_trees():
    table = ",".join(f"{k}:{k + 1}" for k in range(13))
    cfg = SpeculativeConfig.from_flags(dflash=True, dflash_tree_budget=16, dflash_adaptive_k=table)
    assert resolve_dflash(cfg, 8).adaptive_k.max_count == 12  # past γ − 1 = 7: trees of 12 nodes


def test_a_tree_budget_resolves_with_the_block():
    cfg = SpeculativeConfig.from_flags(dflash=True, dflash_tree_budget=16)
    assert resolve_dflash(cfg, 8).tree_budget == 16
    assert resolve_dflash(SpeculativeConfig.from_flags(dflash=True), 8).tree_budget == 0
    assert resolve_dflash(SpeculativeConfig.from_flags(dflash=True, dflash_tree_budget=0,
                                                       dflash_draft_ladder="1,3"), 8).tree_budget == 0
