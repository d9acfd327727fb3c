"""MoE experts through `quantize`: the checkpoint's layout, vLLM / compressed-tensors names,
routers kept, manifest records; loaded back by transformers + compressed-tensors and by our
FP8 experts, against the BF16 model with the same (dequantized) weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mpsconvert.convert.quantize import quantize_snapshot
from mpsconvert.convert.quantize_options import Options
from mpsconvert.errors import QuantizationError
from mpsconvert.format import fp8
from mpsconvert.format.schemes import Scheme
from mpsconvert.runtime.ops.expert_loading import load_fp8_experts
from mpsconvert.runtime.ops.fp8_experts import FP8Experts
from mpsconvert.source.snapshot import resolve

from .helpers import logits
from .models import MOE_ARCHS, tiny

pytestmark = pytest.mark.core  # CI's floor lane runs these on the lowest torch and transformers

transformers = pytest.importorskip("transformers")


def _tensors(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _dequantized_checkpoint(src, artifact, out):
    """The source checkpoint with every quantized weight replaced by fp8 * scale (BF16): the
    reference an FP8 run should reproduce up to activation quantization."""
    art = _tensors(artifact)
    sd = {}
    for k, v in _tensors(src).items():
        q = art[k]
        if q.dtype == fp8.FP8_DTYPE:
            s = art[k + "_scale"]
            sd[k] = (
                fp8.fp8_to_float(q) * s.float().reshape(*s.shape[:-1], 1)
                if q.ndim == 3
                else fp8.dequantize(q, s, torch.float32)
            ).to(v.dtype)
        else:
            sd[k] = v
    out.mkdir()
    (out / "config.json").write_text((src / "config.json").read_text())
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()


IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.extra("ct")
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_per_expert_checkpoint_converts_and_loads_everywhere(tmp_path, arch):
    src = tiny(arch, tmp_path / "src", dtype=torch.bfloat16, widen=0.08, vocab=128)
    man = quantize_snapshot(resolve(str(src)), tmp_path / "fp8", Options(scheme=Scheme.make("fp8-dynamic")))
    art = _tensors(tmp_path / "fp8")
    E = 4
    experts = {k: r for k, r in man.tensors.items() if "experts_module" in r}
    # 2 layers x E experts x 3 projections, each an FP8 Linear weight with a row scale
    assert len(experts) == 2 * E * 3 and man.summary["expert_tensors_quantized"] == 2 * E * 3
    for k, r in experts.items():
        assert art[k].dtype == fp8.FP8_DTYPE and art[k].ndim == 2
        assert art[k + "_scale"].shape == (art[k].shape[0], 1)
        assert r["sqnr_db"] > 25 and 0 <= r["expert"] < E
    prefix = "model.layers.0.block_sparse_moe" if arch == "mixtral" else "model.layers.0.mlp"
    names = ("w1", "w2", "w3") if arch == "mixtral" else ("gate_proj", "down_proj", "up_proj")
    assert all(f"{prefix}.experts.3.{n}.weight_scale" in art for n in names)  # the names vLLM reads
    # the router (and Qwen2-MoE's shared-expert gate) stay BF16 and are ignored by name
    qc = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert art[f"{prefix}.gate.weight"].dtype == torch.bfloat16 and f"{prefix}.gate" in qc["ignore"]
    if arch == "qwen2_moe":
        assert art["model.layers.0.mlp.shared_expert_gate.weight"].dtype == torch.bfloat16
        assert "model.layers.0.mlp.shared_expert_gate" in qc["ignore"]
        assert art["model.layers.0.mlp.shared_expert.up_proj.weight"].dtype == fp8.FP8_DTYPE
    assert man.extra["moe"]["experts"]["model.layers.1.mlp.experts.gate_up_proj"]["layout"] == "per-expert"

    bf16 = logits(_load(src), IDS)
    ref_model = _load(_dequantized_checkpoint(src, tmp_path / "fp8", tmp_path / "deq"))
    ref = logits(ref_model, IDS)
    ct_model = _load(tmp_path / "fp8")  # transformers + compressed-tensors: dequantizes the experts at load
    for i in range(2):  # ... to exactly our fp8 * scale
        for p in ("gate_up_proj", "down_proj"):
            assert torch.equal(
                getattr(ct_model.model.layers[i].mlp.experts, p), getattr(ref_model.model.layers[i].mlp.experts, p)
            )
    ct = logits(ct_model, IDS)  # CT also fake-quantizes the Linears' activations per token
    scale = bf16.abs().max()
    print(arch, float((ct - ref).abs().max() / scale), float((ref - bf16).abs().max() / scale))
    assert (ct - ref).abs().max() <= 0.2 * scale  # OLMoE (QK-norm, sharp attention) is the widest
    assert (ref - bf16).abs().max() <= 0.12 * scale  # FP8 weights vs BF16
    report = load_fp8_experts(ct_model, tmp_path / "fp8", "cpu")
    assert set(report.replaced) == {f"model.layers.{i}.mlp.experts" for i in range(2)} and not report.skipped
    ours_mod = ct_model.model.layers[1].mlp.experts
    assert isinstance(ours_mod, FP8Experts)
    ours = logits(ct_model, IDS)  # + per-token FP8 activations in the experts
    print(arch, float((ours - ct).abs().max() / scale))
    assert (ours - ct).abs().max() <= 0.12 * scale
    # the experts alone: our FP8 module vs transformers' BF16 experts holding the dequantized weights
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(32)])
    w = torch.rand(32, 2).softmax(-1).to(torch.bfloat16)
    with torch.no_grad():
        a, b = ours_mod(x, idx, w).float(), ref_model.model.layers[1].mlp.experts(x, idx, w).float()
    print(arch, float((a - b).norm() / b.norm()))
    assert (a - b).norm() <= 0.08 * b.norm()


@pytest.mark.extra("ct")
@pytest.mark.parametrize("layout", ["per-expert", "checkpoint"])
def test_fused_checkpoint(tmp_path, layout):
    src = tiny("qwen3_moe", tmp_path / "src", dtype=torch.bfloat16, widen=0.08, vocab=128, fused=True)
    man = quantize_snapshot(
        resolve(str(src)), tmp_path / "fp8", Options(scheme=Scheme.make("fp8-dynamic", "tensor"), experts_layout=layout)
    )
    art = _tensors(tmp_path / "fp8")
    key = "model.layers.0.mlp.experts.gate_up_proj"
    if layout == "checkpoint":
        assert art[key].dtype == fp8.FP8_DTYPE and art[key].shape == (4, 64, 64)
        assert art[key + "_scale"].shape == (4, 1, 1)  # per expert, per tensor
        assert len(man.tensors[key]["experts_sqnr_db"]) == 4
    else:  # split into the names save_pretrained uses: loadable by transformers + CT and vLLM
        assert key not in art
        assert art["model.layers.0.mlp.experts.2.up_proj.weight"].dtype == fp8.FP8_DTYPE
        assert art["model.layers.0.mlp.experts.2.up_proj.weight_scale"].shape == (1,)
        ct = _load(tmp_path / "fp8")
        assert (logits(ct, IDS) - logits(_load(src), IDS)).abs().max() <= 0.15 * logits(_load(src), IDS).abs().max()
    model = _load(src)
    bf16 = logits(model, IDS)
    report = load_fp8_experts(model, tmp_path / "fp8", "cpu")
    assert {r["layout"] for r in report.replaced.values()} == {"fused" if layout == "checkpoint" else "per-expert"}
    assert (logits(model, IDS) - bf16).abs().max() <= 0.15 * bf16.abs().max()


def test_per_expert_fused_equivalence(tmp_path):
    """The same weights stored per expert and fused give bit-identical FP8 codes and scales."""
    a = tiny("mixtral", tmp_path / "a", dtype=torch.bfloat16, widen=0.08, vocab=128, seed=3)
    b = tiny("mixtral", tmp_path / "b", dtype=torch.bfloat16, widen=0.08, vocab=128, seed=3, fused=True)
    quantize_snapshot(resolve(str(a)), tmp_path / "qa", Options())
    quantize_snapshot(resolve(str(b)), tmp_path / "qb", Options(experts_layout="checkpoint"))
    ta, tb = _tensors(tmp_path / "qa"), _tensors(tmp_path / "qb")
    fused = tb["model.layers.1.mlp.experts.gate_up_proj"]
    w3 = ta["model.layers.1.block_sparse_moe.experts.2.w3.weight"]  # expert 2, up half (rows I..2I)
    assert torch.equal(fused[2, 96:].view(torch.uint8), w3.view(torch.uint8))
    assert torch.equal(
        tb["model.layers.1.mlp.experts.gate_up_proj_scale"][2, 96:],
        ta["model.layers.1.block_sparse_moe.experts.2.w3.weight_scale"],
    )


def test_static_scheme_needs_expert_scales(tmp_path):
    src = tiny("qwen3_moe", tmp_path / "src", dtype=torch.bfloat16, widen=0.08, vocab=128, layers=1)
    linears = {f"model.layers.0.self_attn.{p}": 0.01 for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    with pytest.raises(QuantizationError, match="input scale"):
        quantize_snapshot(resolve(str(src)), tmp_path / "x", Options(scheme=Scheme.make("fp8"), input_scales=linears))
    assert not (tmp_path / "x").exists()
    scales = dict(linears)
    scales["model.layers.0.mlp.experts.gate_up_proj"] = [0.01, 0.02, 0.03, 0.04]
    scales["model.layers.0.mlp.experts.down_proj"] = [0.001, 0.002, 0.003, 0.004]
    man = quantize_snapshot(
        resolve(str(src)), tmp_path / "fp8", Options(scheme=Scheme.make("fp8"), input_scales=scales)
    )
    art = _tensors(tmp_path / "fp8")
    assert float(art["model.layers.0.mlp.experts.2.up_proj.input_scale"]) == pytest.approx(0.03)
    assert float(art["model.layers.0.mlp.experts.3.down_proj.input_scale"]) == pytest.approx(0.004)
    assert man.tensors["model.layers.0.mlp.experts.1.gate_proj.weight"]["input_scale"] == pytest.approx(0.02)
    model = _load(src)
    report = load_fp8_experts(model, tmp_path / "fp8", "cpu")
    mod = model.model.layers[0].mlp.experts
    assert report.activations == "tensor"
    assert torch.allclose(mod.gate_up_input_scale, torch.tensor([0.01, 0.02, 0.03, 0.04]))
    assert torch.allclose(mod.down_input_scale, torch.tensor([0.001, 0.002, 0.003, 0.004]))


def test_cli_experts_layout(tmp_path):
    from click.testing import CliRunner

    from mpsconvert.cli import main

    src = tiny("mixtral", tmp_path / "src", dtype=torch.bfloat16, widen=0.08, vocab=128, fused=True, layers=1)
    r = CliRunner().invoke(
        main, ["quantize", str(src), "-o", str(tmp_path / "out"), "--experts-layout", "checkpoint", "--json"]
    )
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output[r.output.index("{") :])
    assert summary["expert_tensors_quantized"] == 2  # gate_up_proj and down_proj, fused
    assert "model.layers.0.mlp.experts.gate_up_proj_scale" in _tensors(tmp_path / "out")
    r = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "bad"), "--experts-layout", "nope"])
    assert r.exit_code == 2 and not (tmp_path / "bad").exists()
