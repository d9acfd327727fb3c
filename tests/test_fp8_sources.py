"""Sources that are already FP8 (the hub's FineGrainedFP8 releases, compressed-tensors FP8):
re-packed with their e4m3 codes untouched, loaded by transformers + compressed-tensors and by
runtime.load, and equal to the source dequantized; other schemes re-quantize and say so."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import mpsconvert
from mpsconvert.errors import SourceError
from mpsconvert.manifests.verify import verify_artifact

from .helpers import logits
from .models import group_quantized_activations, read_fine_grained_fp8, tiny, to_fine_grained_fp8

pytestmark = pytest.mark.core  # CI's floor lane runs these on the lowest torch and transformers

transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))


def _source(tmp_path, arch: str, block: int):
    bf16 = (
        tiny("qwen3", tmp_path / "bf16", dtype=torch.bfloat16, widen=0.08)
        if arch == "qwen3"
        else tiny("qwen3_moe", tmp_path / "bf16", dtype=torch.bfloat16, widen=0.08, vocab=128)
    )
    return to_fine_grained_fp8(bf16, tmp_path / "fp8-src", block)


def _raw(folder, key: str) -> bytes:
    """The stored bytes of one tensor, read from the safetensors file itself."""
    path = folder / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    info = json.loads(data[8 : 8 + n])[key]
    a, b = info["data_offsets"]
    return data[8 + n + a : 8 + n + b]


def _source_dequantized(src, block: int):
    """The source as transformers itself reads it: FineGrainedFP8 dequantized at load (CPU),
    then each Linear's and expert's input rounded per token and group as FP8_BLOCK says."""
    model = read_fine_grained_fp8(src, block)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        fp8_modules = {k[: -len(".weight")] for k in f.keys() if f.get_slice(k).get_dtype() == "F8_E4M3"}
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n in fp8_modules}
    return group_quantized_activations(model, linears, block), linears


@pytest.mark.extra("ct")
@pytest.mark.needs("accelerate")  # transformers loads the FineGrainedFP8 reference only with accelerate
@pytest.mark.parametrize("arch,block", [("qwen3", 32), ("qwen3", 128), ("qwen3_moe", 16)])
def test_fine_grained_fp8_source_keeps_its_codes_and_loads_everywhere(tmp_path, arch, block):
    src = _source(tmp_path, arch, block)
    out = tmp_path / "artifact"
    res = mpsconvert.quantize(src, out)
    man = res.manifest
    vllm = [
        w for w in res.warnings if w.startswith("vLLM")
    ]  # the tiny q/k/v rows are no multiple of a 128 block: vLLM would refuse it
    assert [w for w in res.warnings if w not in vllm] == [] and bool(vllm) == (block == 128 and arch == "qwen3")
    assert (man.recipe["name"], man.recipe["weights"], man.recipe["block_size"]) == ("fp8-dynamic", "block", block)
    assert man.source["fp8"]["layout"] == "fine-grained-fp8"
    assert (
        man.source["files"]["model.safetensors"] == hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest()
    )
    src_sd, out_sd = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    fp8_keys = [k for k, v in src_sd.items() if v.dtype == torch.float8_e4m3fn]
    assert len(fp8_keys) == (
        14 if arch == "qwen3" else 2 * (4 + 4 * 3)
    )  # q,k,v,o,gate,up,down / attention + 4 experts x 3
    for k in fp8_keys:
        raw = _raw(src, k)
        assert _raw(out, k) == raw  # the e4m3 codes, byte for byte
        assert man.tensors[k]["codes_sha256"] == hashlib.sha256(raw).hexdigest()
        assert man.tensors[k]["codes"].startswith("copied") and man.tensors[k]["source_scale"] == k + "_scale_inv"
        assert torch.equal(out_sd[k + "_scale"], src_sd[k + "_scale_inv"])
        assert k + "_scale_inv" not in out_sd
    # what the source kept in BF16 (lm_head, the router) stays BF16 and is ignored by name
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["config_groups"]["group_0"]["weights"][
        "block_structure"
    ] == [block, block]
    assert out_sd["lm_head.weight"].dtype == torch.bfloat16 and "lm_head" in qc["ignore"]
    if arch == "qwen3_moe":
        assert out_sd["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    assert verify_artifact(out).ok

    ref, linears = _source_dequantized(src, block)
    want = logits(ref, IDS)
    scale = want.abs().max()
    # transformers 5.24 cannot fold block scales into MoE experts (see test_block), and
    # compressed-tensors quantizes activations per group only where the group divides K (64 here)
    if arch == "qwen3" and 64 % block == 0:
        ct = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        got = logits(ct, IDS)
        assert (got - want).abs().max() <= 1e-4 * scale, float((got - want).abs().max() / scale)
    ours = mpsconvert.load(out, device="cpu", dtype=torch.float32)
    got = logits(ours, IDS)
    assert (got - want).abs().max() <= 1e-4 * scale, float((got - want).abs().max() / scale)


@pytest.mark.needs("accelerate")
def test_another_granularity_requantizes_and_says_it_rounds_twice(tmp_path):
    src = _source(tmp_path, "qwen3", 32)
    res = mpsconvert.quantize(src, tmp_path / "row", weights="row")
    assert len(res.warnings) == 1 and "rounds twice" in res.warnings[0] and "round-trip SQNR" in res.warnings[0]
    man = res.manifest
    assert man.recipe["weights"] == "row"
    sqnrs = [r["sqnr_db"] for r in man.tensors.values()]
    assert len(sqnrs) == 14 and all(25 < s < 60 for s in sqnrs)  # measured against the source's values, not exact
    assert f"worst {min(sqnrs):.1f} dB" in res.warnings[0]
    assert all("requantized_from" in r for r in man.tensors.values())
    out_sd = load_file(tmp_path / "row" / "model.safetensors")
    assert out_sd["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64, 1)
    # the row codes reproduce the source within one e4m3 rounding of its dequantized values
    ref, _ = _source_dequantized(src, 32)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        w = ref.get_submodule(name).weight.float()
        got = out_sd[name + ".weight"].float() * out_sd[name + ".weight_scale"]
        assert (got - w).abs().max() <= w.abs().amax(dim=1, keepdim=True).max() / 16
    mpsconvert.load(tmp_path / "row", device="cpu")  # and it loads


def test_a_compressed_tensors_fp8_source_is_repacked_as_it_is(tiny_models, tmp_path):
    first = tmp_path / "first"
    mpsconvert.quantize(tiny_models["llama"], first, weights="block", block_size=32)
    res = mpsconvert.quantize(first, tmp_path / "again")
    assert not res.warnings and res.manifest.source["fp8"]["layout"] == "compressed-tensors"
    a, b = load_file(first / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(
            a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
            b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k],
        )
    qa = json.loads((first / "config.json").read_text())["quantization_config"]
    qb = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert qa == qb


def test_sources_that_cannot_be_kept_are_refused_with_one_line(tmp_path):
    src = _source(tmp_path, "qwen3", 32)

    def variant(name, edit_config=None, edit_files=None):
        d = tmp_path / name
        shutil.copytree(src, d)
        cfg = json.loads((d / "config.json").read_text())
        if edit_config:
            edit_config(cfg["quantization_config"])
            (d / "config.json").write_text(json.dumps(cfg))
        if edit_files:
            edit_files(d)
        return d

    cases = {
        "gptq": (lambda qc: qc.update(quant_method="gptq"), None, "already quantized (gptq)"),
        "static": (lambda qc: qc.update(activation_scheme="static"), None, "'static' activations"),
        "non-square": (lambda qc: qc.update(weight_block_size=[128, 64]), None, "non-square"),
        "e8m0": (lambda qc: qc.update(scale_fmt="ue8m0"), None, "scale_fmt"),
        "pickle": (None, lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"), "pickle"),
        "wrong-block": (
            lambda qc: qc.update(weight_block_size=[16, 16]),
            None,
            "weight_scale_inv is F32[2, 4], but the source's block scales of a [64, 128] weight are [4, 8]",
        ),
    }
    for name, (cfg, files, message) in cases.items():
        with pytest.raises(SourceError, match=re.escape(message)):
            mpsconvert.quantize(variant(name, cfg, files), tmp_path / f"out-{name}")
        assert not (tmp_path / f"out-{name}").exists()
    with pytest.raises(mpsconvert.MpsconvertError, match="calibrate"):
        mpsconvert.quantize(src, tmp_path / "static-out", scheme="fp8")
