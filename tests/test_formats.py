"""The weight-format table (`plugins.formats.FORMATS`): each format's facts against what ModelOpt
writes and what the runtime loads, and every reader failing loudly where a format is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from metrale.builder import quantize as q
from metrale.plugins import formats
from metrale.runtime.models import qlinear


@pytest.mark.parametrize("name", list(formats.FORMATS))
def test_a_formats_facts_hold_for_modelopts_output(name):
    fmt = formats.FORMATS[name]
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    state, section = q._quantize_modules({"lin.weight": w}, ["lin"], name)
    assert set(state) == {f"lin.{leaf}" for leaf in fmt.leaves}  # exactly its leaves
    assert state["lin.weight"].dtype == fmt.weight_dtype
    assert formats.detect(state, "lin") is fmt and formats.detect({"lin.weight": w}, "lin") is None
    assert sum(t.nbytes for t in state.values()) == fmt.stored_bytes(32, 64)
    assert section["quantization"]["quant_algo"] == fmt.quant_algo
    assert formats.format_of_algo(fmt.quant_algo) is fmt
    lin = qlinear.linear_from_tensors("lin", state)
    assert type(lin).__name__ == fmt.linear.rpartition(":")[2] and lin.kind == name
    torch.testing.assert_close(lin.dense_weight(), fmt.dequantize(*(state[f"lin.{leaf}"] for leaf in fmt.leaves)))
    with pytest.raises(ValueError):  # a stored weight missing one of its scales
        formats.detect({k: v for k, v in state.items() if k != f"lin.{fmt.leaves[-1]}"}, "lin")


def test_tiers_are_data_over_the_formats():
    assert formats.DRAFT_TIERS == tuple(t.value for t in q.DraftWeightQuantization)
    for tier, fmt in formats.DRAFT_TIER_FORMATS.items():
        assert q.DraftWeightQuantization.parse(tier).format == fmt
        assert fmt is None or fmt in formats.FORMATS


def test_a_format_without_its_linear_is_refused_at_import():
    """A format entered in the table alone: the runtime's linears, ModelOpt's quantizers, the
    TensorRT plugins and the ONNX export each refuse to import until they cover it."""
    code = (
        "import dataclasses\n"
        "from metrale.plugins import formats\n"
        "f = formats.FORMATS['fp8']\n"
        "formats.FORMATS['mxfp8'] = dataclasses.replace(f, name='mxfp8', quant_algo='MXFP8', onnx_op='MxFp8Gemm')\n"
        "import importlib, sys\n"
        "mod = sys.argv[1]\n"
        "try:\n"
        "    importlib.import_module(mod)\n"
        "except AssertionError:\n"
        "    print('refused')\n")
    for mod in ("metrale.runtime.models.qlinear", "metrale.builder.quantize", "metrale.plugins.trt_plugin",
                "metrale.builder.onnx_export"):
        out = subprocess.run([sys.executable, "-c", code, mod], capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "refused", (mod, out.stdout, out.stderr[-2000:])
