"""Build the tiny engine directories with no GPU (TensorRT-RTX, SM89 and SM120, every drafter
tier) under engines/ci/<tier> and check each one: the manifest loads and every checksum holds,
every component has an engine per SM, and the plugin layers are the expected ones — NVFP4
drafter GEMMs become metrale plugin layers on SM89 (no native FP4 below SM100) and native FP4
dequantize on SM120; FP8 is native on both; DFlash2's dynamic convs (two per layer) are plugin
layers on both; the directory holds exactly the cubins its plugin layers launch (per kernel, SM
and activation dtype, in the engines' dtype, bf16 by default: the NVFP4 GEMM for SM89 and the
dynamic conv for both)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from metrale.plugins.formats import DRAFT_TIER_FORMATS, DRAFT_TIERS, FORMATS
from metrale.plugins.trt_plugin import GEMM_OPS
from metrale.runtime.artifact.engine_dir import load_manifest

TIERS = DRAFT_TIERS
SMS = (89, 120)


def expected_plugins(tier: str, component: str, sm: int, quantized: int, convs: int) -> dict[str, int]:
    """A drafter's quantized linears stay plugin layers where its tier's format is not native;
    DFlash2's dynamic convs are plugin layers on every SM."""
    fmt = FORMATS.get(DRAFT_TIER_FORMATS[tier] or "")
    want = {"DFlash2DynamicConv": convs} if convs else {}
    if component in ("dflash", "dflash2") and fmt is not None and not fmt.native(sm):
        want[fmt.onnx_op] = quantized
    return want


def dynamic_convs(engine_dir: Path, config: str) -> int:
    """Two per layer of a DFlash2 drafter (its architecture names it), none otherwise."""
    cfg = json.loads((engine_dir / config).read_text())
    return 2 * cfg["num_hidden_layers"] if "DFlash2DraftModel" in cfg.get("architectures", []) else 0


def check(engine_dir: Path, tier: str) -> list[str]:
    m = load_manifest(engine_dir)  # verifies every file's sha256 and size
    problems = []
    assert m.build["trt_flavor"] == "rtx", m.build
    for name, info in m.components.items():
        quantized = len(info.quant_algo.quantized_modules) if info.quant_algo is not None else 0
        convs = dynamic_convs(engine_dir, info.config)
        for sm in SMS:
            eng = info.engines.get(str(sm))
            if eng is None:
                problems.append(f"{engine_dir}: {name} has no SM{sm} engine")
                continue
            want = expected_plugins(tier, name, sm, quantized, convs)
            if eng.plugins != want:
                problems.append(f"{engine_dir}: {name} SM{sm} plugin layers {eng.plugins}, expected {want}")
    # exactly the cubins the plugin layers launch: per kernel, SM and activation dtype
    cubins = sorted(f for f in m.files if f.startswith("plugins/") and f.endswith(".cubin"))
    act = {"bfloat16": "bf16", "float32": "fp32"}[m.build.get("trt_dtype", "float32")]
    fmt = FORMATS.get(DRAFT_TIER_FORMATS[tier] or "")
    want = sorted({f"plugins/{GEMM_OPS[fmt.onnx_op].kernel}.sm{sm}.{act}.cubin"
                   for sm in SMS if not fmt.native(sm)} if fmt is not None else set())
    want = sorted({*want, *(f"plugins/dflash2_dynamic_conv.sm{sm}.{act}.cubin" for sm in SMS)})
    if cubins != want:
        problems.append(f"{engine_dir}: cubins {cubins}, expected {want}")
    return problems


def main() -> int:
    root = Path("engines/ci")
    problems = []
    for tier in TIERS:
        out = root / tier
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "metrale", "build", "--engine-dir", str(out),
                        "--trt-flavor", "rtx", "--target-sm", ",".join(map(str, SMS)),
                        "--draft-weight-quantization", tier, "--cpu-engines", "none"], check=True)
        problems += check(out, tier)
        print(f"engines/ci/{tier}: built and checked in {time.time() - t0:.1f} s")
    for p in problems:
        print("FAIL:", p)
    print(f"engine checks: {len(TIERS) * 4 * len(SMS) - len(problems)} ok, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
