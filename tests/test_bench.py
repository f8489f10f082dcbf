"""`metrale bench`: the JSON record per mode (tok/s, τ, speedup, bound, e, rows per token, time
split), the costs it is bounded by, and the transformers reference row."""

import json

import pytest
from typer.testing import CliRunner

from metrale.bench_costs import host_ms, interpolate, mode_bound
from metrale.cli import app


def test_bound_by_hand():
    costs = {1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5}
    assert interpolate(costs, 2.5) == 1.75 and interpolate(costs, 0.9) == 1.0 and interpolate(costs, 9) == 2.5
    # chunkwise: 3 rows per step cost c(3) = 2 ms, 1 ms of drafting; τ = 2.4 -> 2.4·1/(2+1) = 0.8
    row = {"steps": 10, "verify_rows": 30, "draft_s": 0.010, "drafts_proposed": 70, "tau": 2.4,
           "speedup": 0.72}
    b = mode_bound(row, costs, exact=False)
    assert b["bound"] == 0.8 and b["e"] == 0.3 and b["of_bound"] == 0.9
    # exact: the same rows one forward each: 3 · c(1) = 3 ms
    assert mode_bound(row, costs, exact=True)["bound"] == pytest.approx(2.4 / 4, abs=1e-3)
    plain = {"steps": 10, "verify_rows": 10, "draft_s": 0.001, "drafts_proposed": 0, "tau": 1.0,
             "speedup": 1.0}
    assert mode_bound(plain, costs, exact=False)["bound"] == 1.0  # no drafter: no draft cost
    # every prompt ended at its first token: no step, no bound (not a division by zero)
    none = {"steps": 0, "verify_rows": 0, "draft_s": 0.0, "drafts_proposed": 0, "tau": None, "speedup": 1.0}
    assert mode_bound(none, costs, exact=True)["bound"] is None
    # host work h: plain took 1.5 ms per step (h = 0.5); each step pays it once:
    # 2.4 · (1 + 0.5) / (2 + 1 + 0.5)
    h = host_ms({"seconds": 0.015, "steps": 10}, costs)
    assert h == pytest.approx(0.5)
    with_host = mode_bound(row, costs, exact=False, host=h)
    assert with_host["bound"] == 0.8  # the model-time bound does not see h
    assert with_host["bound_host"] == pytest.approx(2.4 * 1.5 / 3.5, abs=1e-3)
    assert with_host["of_bound_host"] == pytest.approx(0.72 / (2.4 * 1.5 / 3.5), abs=1e-3)
    assert with_host["bound_host"] > with_host["bound"]  # stricter where bound < 1
    assert mode_bound(plain, costs, exact=False, host=h)["bound_host"] == 1.0


def test_bench_json(tiny_engine_dir, tmp_path):
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, ["bench", "--engine-dir", str(tiny_engine_dir), "--num-prompts", "2",
                                   "--max-tokens", "8", "--repeats", "1", "--threads", "1",
                                   "--modes", "mtp k=2,dflash γ=8", "--json", str(out)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["backend"] == "torch" and data["backend_note"] == "" and data["threads"] == 1
    assert sorted(map(int, data["target_rows_ms"])) == list(range(1, 9))
    modes = {r["mode"]: r for r in data["modes"]}
    assert {"plain", "mtp k=2", "dflash γ=8", "transformers generate"} <= set(modes)
    for name in ("plain", "mtp k=2", "dflash γ=8"):
        r = modes[name]
        for key in ("tokens_per_s", "tau", "speedup", "bound", "bound_host", "e", "verify_rows_per_token",
                    "c_verify_ms", "c_draft_ms"):
            assert r[key] >= 0, (name, key)
        assert sum(r["time_split"].values()) == pytest.approx(1.0, abs=0.01)
    assert modes["plain"]["tau"] == 1.0 and modes["plain"]["bound"] == 1.0
    # what a step costs in ops and host reads: the decode loop reads the device at every step
    for name in ("plain", "mtp k=2", "dflash γ=8"):
        assert modes[name]["steps_run_as"] == "decode loop" and modes[name]["ops_per_step"] > 50
        assert modes[name]["host_reads_per_step"] >= 1, name
    assert modes["dflash γ=8"]["ops_per_step"] > modes["plain"]["ops_per_step"]
    assert modes["mtp k=2"]["tau"] > 1.0 and modes["mtp k=2"]["identical_to_plain"] == 2
    # the reference decodes the same weights greedily: the same text as plain decoding
    assert modes["transformers generate"]["identical_to_plain"] == 2


SMALL_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["n"], "additionalProperties": False}


def test_bench_under_a_json_schema(tiny_engine_dir, tmp_path):
    """`--json-schema`: every mode decodes under the schema's mask (each answer a document of it),
    its answers compared with plain constrained decoding's; no transformers row."""
    import jsonschema

    from metrale.bench import run_modes
    from metrale.runtime.backends import load_engine

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SMALL_SCHEMA))
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, ["bench", "--engine-dir", str(tiny_engine_dir), "--num-prompts", "2",
                                   "--max-tokens", "16", "--repeats", "1", "--threads", "1",
                                   "--modes", "mtp k=2,dflash γ=8 exact", "--json-schema", str(schema),
                                   "--json", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["json_schema"] == str(schema)
    modes = {r["mode"]: r for r in data["modes"]}
    assert set(modes) == {"plain", "mtp k=2", "dflash γ=8 exact"}  # (no transformers row)
    assert modes["mtp k=2"]["identical_to_plain"] == 2 and modes["dflash γ=8 exact"]["identical_to_plain"] == 2
    engine = load_engine(tiny_engine_dir, backend="torch")
    tok = engine.tokenizer
    prompts = [tok.encode(t) for t in ("def f(", "x = ")]
    runs = run_modes(engine, [("plain", {}), ("mtp", dict(speculative=True, num_drafts=2))], prompts, 16, 1,
                     json_schema=json.dumps(SMALL_SCHEMA))
    for name, per_prompt in runs.items():
        for (res,) in per_prompt:
            assert res.token_ids[-1] in tok.eos_token_ids, name  # a whole document, then the end
            jsonschema.validate(json.loads(tok.decode(res.token_ids[:-1])), SMALL_SCHEMA)


@pytest.mark.parametrize("text,words", [
    ("{", "not a readable JSON file"),
    (json.dumps({"type": "object", "not": {}}), "$.not"),
    (json.dumps({"type": "object", "minProperties": 2}), "minProperties is greater"),  # xgrammar's refusal
])
def test_bench_refuses_a_bad_json_schema(tiny_engine_dir, tmp_path, text, words):
    schema = tmp_path / "schema.json"
    schema.write_text(text)
    res = CliRunner().invoke(app, ["bench", "--engine-dir", str(tiny_engine_dir), "--num-prompts", "1",
                                   "--max-tokens", "4", "--repeats", "1", "--modes", "mtp k=1",
                                   "--no-transformers", "--json-schema", str(schema)])
    assert res.exit_code != 0 and "--json-schema" in res.output and str(schema) in res.output.replace("\n", "")
    assert words in res.output.replace("\n", ""), res.output
    assert "Traceback" not in res.output
