"""The onnxruntime backend: the engine directory's exported ONNX graphs drive the whole
speculative loop on a CPU.

The lowering for onnxruntime (standard ops only, float32) against hand-worked values; the loaded
engine against the torch backend (float32, the same weights): logits, and the greedy output of
every mode `bench` runs, for the FP8 build and for an NVFP4 build whose MTP experts are NVFP4
too; and the flags' refusals, named.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn
from typer.testing import CliRunner

from metrale.bench import mode_table
from metrale.builder import onnx_export as ox
from metrale.plugins import onnx_lowering as lw
from metrale.runtime.models import qlinear
from metrale.runtime.backends import load_engine
from metrale.runtime.errors import ConfigError, EngineDirError
from metrale.runtime.spec.sampling import SamplingParams
from metrale.runtime.serving.service import EngineGenerator
from metrale.runtime.spec.config import SpeculativeConfig

IO = ox.GraphIO(("x",), ("y",), {"x": {1: "t"}, "y": {1: "t"}})


def plain_text(s: str) -> str:
    return re.sub(r"[\s│╭╮╰╯─]+", " ", re.sub(r"\x1b\[[0-9;]*m", "", s))


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


class TwoLinears(nn.Module):
    def __init__(self, fp8, nvfp4):
        super().__init__()
        self.a, self.b = fp8, nvfp4

    def forward(self, x):
        return self.b(self.a(x))


def _types(model: onnx.ModelProto) -> set[int]:
    g = model.graph
    return ({t.data_type for t in g.initializer}
            | {v.type.tensor_type.elem_type for v in (*g.input, *g.output, *g.value_info)})


def test_lowering_for_onnxruntime_by_hand():
    # fp8: W = 2·I (16×16), row scales 0.5 -> the identity. nvfp4: row 0 codes (2, 9, 7, 0...)
    # = (1.0, −0.5, 6.0, 0...), block scale 2 × global 0.25; row 1 all 0.5 at block scale 4 × 0.25.
    fp8 = qlinear.Fp8Linear((2 * torch.eye(16)).to(torch.float8_e4m3fn), torch.full((16,), 0.5), None)
    packed = torch.zeros(2, 8, dtype=torch.uint8)
    packed[0, 0], packed[0, 1], packed[1, :] = 0x92, 0x07, 0x11
    nvfp4 = qlinear.Nvfp4Linear(packed, torch.tensor([[2.0], [4.0]]).to(torch.float8_e4m3fn),
                                torch.tensor(0.25), None)
    model = ox.export_module(TwoLinears(fp8, nvfp4).to(torch.bfloat16), (torch.ones(1, 3, 16, dtype=torch.bfloat16),), IO)
    assert lw.metrale_ops(model) == {"Fp8W8A16Gemm": 1, "NvFp4W4A16Gemm": 1}
    assert TensorProto.BFLOAT16 in _types(model)
    low = lw.lower_for_onnxruntime(model)
    assert lw.metrale_ops(low) == {} and all(o.domain != "metrale" for o in low.opset_import)
    assert TensorProto.BFLOAT16 not in _types(low)  # widened: onnxruntime has no bf16 math here
    x = np.zeros((1, 2, 16), dtype=np.float32)
    x[0, 0, :3] = (1.0, 2.0, 4.0)
    x[0, 1] = 1.0
    (y,) = _session(low).run(None, {"x": x})
    # row 0: (1·1 − 0.5·2 + 6·4)·0.5 = 12, 16 ones·0.5·1 -> (1 + 2 + 4)·0.5 = 3.5
    np.testing.assert_array_equal(y, [[[12.0, 3.5], [3.25, 8.0]]])
    with pytest.raises(ValueError, match="AllReduce node has no onnxruntime lowering"):
        bad = onnx.ModelProto()
        bad.CopyFrom(low)
        bad.graph.node.append(helper.make_node("AllReduce", ["y"], ["z"], domain="metrale"))
        lw.lower_for_onnxruntime(bad)


def test_widening_is_exact():
    vals = torch.tensor([1.0, -3.140625, 1e-30, 65504.0, 3.0e38]).to(torch.bfloat16)
    t = helper.make_tensor("w", TensorProto.BFLOAT16, [5], vals.view(torch.int16).numpy().tobytes(), raw=True)
    cast = helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16)
    add = helper.make_node("Add", ["xb", "w"], ["y"])
    g = helper.make_graph([cast, add], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5])],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [5])], [t])
    wide = lw.widen_to_float32(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]))
    np.testing.assert_array_equal(numpy_helper.to_array(wide.graph.initializer[0]), vals.float().numpy())
    assert wide.graph.node[0].attribute[0].i == TensorProto.FLOAT
    (y,) = _session(wide).run(None, {"x": np.zeros(5, dtype=np.float32)})
    assert y.dtype == np.float32 and np.array_equal(y, vals.float().numpy())


# -- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ort_engines(engine_factory):
    """{build: (onnxruntime engine, torch float32 engine)} for the FP8 build and an NVFP4 one."""
    out = {}
    for name, kwargs in (("fp8", dict(tier="fp8")), ("nvfp4", dict(tier="nvfp4", mtp_experts_nvfp4=True))):
        d = engine_factory(onnx=True, **kwargs)
        out[name] = (load_engine(d, backend="onnxruntime"), load_engine(d, backend="torch"))
    return out


def test_graphs_match_the_torch_target(ort_engines, tiny_prompts):
    engine, ref = ort_engines["fp8"]
    assert engine.backend.name == "onnxruntime" and engine.dtype == torch.float32
    ids = torch.tensor([tiny_prompts[0][:12]])
    a = engine.target(ids, engine.target.new_cache(1, 64), taps=(0, 1, 3))
    b = ref.target(ids, ref.target.new_cache(1, 64), taps=(0, 1, 3))
    # other kernels, other summation orders: within 1e-3 of logits up to ~15 (float32 both)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(a.taps, b.taps, rtol=1e-3, atol=1e-3)
    assert a.logits.argmax(-1).tolist() == b.logits.argmax(-1).tolist()


def _decode(engine, prompts, flags, params):
    gen = EngineGenerator(engine, SpeculativeConfig.from_flags(**flags))
    return [gen.decoder().generate(p, params) for p in prompts]


@pytest.mark.parametrize("build", ["fp8", "nvfp4"])
def test_every_mode_is_greedy_equal_to_the_torch_backend(ort_engines, tiny_prompts, build):
    engine, ref = ort_engines[build]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    prompts = tiny_prompts[:3]
    plain = [r.token_ids for r in _decode(ref, prompts, {}, params)]
    modes = mode_table(engine, None)
    assert len(modes) >= 15  # plain, six MTP modes, four per drafter
    for name, flags in modes:
        got = _decode(engine, prompts, flags, params)
        want = plain if flags.get("exact_verify") or not flags else \
            [r.token_ids for r in _decode(ref, prompts, flags, params)]
        assert [r.token_ids for r in got] == want, name
        if flags:
            assert sum(s.accepted for r in got for s in r.steps) > 0, name  # it did speculate
    # the caches grew past their first size within one sequence: 40 tokens after the prompt
    assert engine.target.sizes.pools[0].shape[3] == 64 and len(engine.target.sizes.pools) > 1


def test_seeded_sampling_is_reproducible(ort_engines, tiny_prompts):
    engine, _ = ort_engines["fp8"]
    params = SamplingParams(temperature=0.8, max_tokens=16, seed=7)
    a, b = (_decode(engine, tiny_prompts[:1], dict(dflash=True), params)[0].token_ids for _ in range(2))
    assert a == b


def test_refusals_name_the_flag(engine_factory, tmp_path):
    from metrale.cli import app
    from metrale.runtime.backends import resolve_backend

    with pytest.raises(ConfigError, match="--backend onnxruntime computes in float32.*--dtype bfloat16"):
        resolve_backend("onnxruntime", None, "bfloat16")
    with pytest.raises(ConfigError, match="--device cuda is not a CPU"):
        resolve_backend("onnxruntime", "cuda")
    with pytest.raises(EngineDirError, match="built with onnx = false"):
        load_engine(engine_factory("fp8"), backend="onnxruntime")  # the suite's builds skip ONNX
    d = str(engine_factory("fp8", onnx=True))
    r = CliRunner().invoke(app, ["generate", "--engine-dir", d, "--prompt", "x", "--backend", "onnxruntime",
                                 "--dflash", "--draft-weight-quantization", "nvfp4"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "--draft-weight-quantization nvfp4: the ONNX graphs" in plain_text(r.output)
    r = CliRunner().invoke(app, ["generate", "--engine-dir", d, "--prompt", "def main(", "--max-tokens", "8",
                                 "--backend", "onnxruntime", "--speculative", "--json"])
    assert r.exit_code == 0, r.output
    assert '"backend": "onnxruntime"' in r.output
