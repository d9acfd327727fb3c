"""Block-scaled FP8 in the Apple exports: Core AI keeps the block scales natively
(`blockwise_shift_scale` over f8E4M3FN codes), Core ML stores one 256-entry palette per block
(`constexpr_lut_to_dense`), both read back and checked against the artifact."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

import mpsconvert
from mpsconvert.apple.torch_model import read_artifact_weights
from mpsconvert.format import fp8
from mpsconvert.format.schemes import Scheme
from mpsconvert.manifests.manifest import Manifest

from .models import tiny, tiny_artifact

pytestmark = pytest.mark.extra("coreml")


@pytest.mark.parametrize("block", [16, 48])  # 48: partial edge blocks (64 and 128 are not multiples)
def test_artifact_weights_come_as_exact_tiles(work, block):
    art = tiny_artifact(
        work,
        f"llama-b{block}",
        partial(tiny, "llama", dtype=torch.bfloat16, tie=True),
        Scheme.make("fp8-dynamic", "block", block),
    )
    dense, quant = read_artifact_weights(art)
    from safetensors.torch import load_file

    sd = load_file(art / "model.safetensors")
    for name, (q, tiles) in quant.items():
        n, k = q.shape
        assert n % tiles.shape[0] == 0 and k % tiles.shape[1] == 0
        want = fp8.dequantize(sd[name], sd[name + "_scale"], torch.float32, block)
        assert torch.equal(fp8.dequantize_tiles(q, tiles, torch.float32), want) and torch.equal(dense[name], want)
    q, tiles = quant["model.layers.0.mlp.down_proj.weight"]  # [64, 128]
    assert tiles.shape == (4, 8)  # 16: the blocks; 48: tiles of gcd(64, 48) = gcd(128, 48) = 16


@pytest.mark.parametrize("block", [16, 48])
def test_core_ml_block_palettes_are_the_fp16_dequantization(work, block):
    art = tiny_artifact(
        work,
        f"llama-b{block}",
        partial(tiny, "llama", dtype=torch.bfloat16, tie=True),
        Scheme.make("fp8-dynamic", "block", block),
    )
    res = mpsconvert.export_coreml(art, kv_cache=False, seq_len="8", force=True)
    rec = res.record
    encs = rec["encoded_tensors"]
    assert encs and all(e["encoding"] == "lut per block (e4m3 x block scale, fp16)" for e in encs.values())
    from mpsconvert.apple.coreml.coreml_check import check_package

    chk = check_package(art, Manifest.read(art).extra["coreml"], n_samples=2)
    w = chk["weights"]
    assert (
        w["all_ok"] and w["codes_bit_exact"] and w["min_fraction_equal_fp16_dequant"] == 1.0 and w["max_ulp_diff"] == 0
    )
    assert chk["reference_eval"]["cosine_min"] > 0.999
    # size: codes (1 byte per weight) + one fp16 palette per block, against the FP8 safetensors
    _, quant = read_artifact_weights(art)
    palettes = sum(int(np.prod(t.shape)) * 256 * 2 for _, t in quant.values())
    codes = sum(q.numel() for q, _ in quant.values())
    assert chk["weight_bytes"] >= codes + palettes
    print(
        f"block {block}: package {chk['weight_bytes']} B, FP8 safetensors {chk['fp8_safetensors_bytes']} B, "
        f"ratio {chk['size_ratio']}, palettes {palettes} B for {codes} codes"
    )


@pytest.mark.extra("coreai")
@pytest.mark.parametrize("block", [16, 48])
def test_core_ai_keeps_block_scales_native(work, block):
    from mpsconvert.apple.coreai import CoreAIOptions
    from mpsconvert.apple.coreai.coreai_check import check_asset

    art = tiny_artifact(
        work,
        f"llama-b{block}",
        partial(tiny, "llama", dtype=torch.bfloat16, tie=True),
        Scheme.make("fp8-dynamic", "block", block),
    )
    rec = mpsconvert.export(
        art, "coreai", options=CoreAIOptions(max_len=32, compute="fp32", force=True), check=False
    ).record
    _, quant = read_artifact_weights(art)
    for name, e in rec["encoded_tensors"].items():
        assert e["scale_shape"] == list(quant[name][1].shape)  # the block scales (as exact tiles), not rows
    res = check_asset(art, Manifest.read(art).extra["coreai"], prompt_len=8, steps=4, generate=2)
    assert res["weights"]["codes_bit_exact"] and res["weights"]["scales_exact"] and res["weights"]["all_ok"]
    assert res["ok"]
