"""runtime.load: our artifacts and llm-compressor's, the tamper check, what ends up in memory."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

from mpsconvert.convert.quantize import quantize_snapshot
from mpsconvert.convert.quantize_options import Options
from mpsconvert.errors import ArtifactError, DeviceError
from mpsconvert.format import fp8
from mpsconvert.format.schemes import Scheme
from mpsconvert.manifests.verify import verify_artifact
from mpsconvert.runtime.load.loader import load
from mpsconvert.runtime.ops.fp8linear import FP8Linear
from mpsconvert.source.snapshot import resolve

from . import models

pytestmark = pytest.mark.core  # CI's floor lane runs these on the lowest torch and transformers

LLMC = Path(__file__).parent / "data" / "llmc"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("rt-load")
    src = models.tiny("llama", root / "bf16", tokenizer="bpe", dtype=torch.bfloat16, tie=False)
    arts = {}
    for name, weights in (("fp8-dynamic", "row"), ("fp8-weight-only", "row"), ("fp8", "tensor")):
        opts = Options(scheme=Scheme.make(name, weights), force=True)
        if name == "fp8":
            opts.input_scales = {
                f"model.layers.{i}.{m}": 0.02
                for i in range(2)
                for m in (
                    "self_attn.q_proj",
                    "self_attn.k_proj",
                    "self_attn.v_proj",
                    "self_attn.o_proj",
                    "mlp.gate_proj",
                    "mlp.up_proj",
                    "mlp.down_proj",
                )
            }
        arts[name] = root / name
        quantize_snapshot(resolve(str(src)), arts[name], opts)
    return src, arts


def _ids(vocab, n=24, seed=0):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _expected(layer_src: torch.Tensor, x: torch.Tensor, granularity: str, act: str | None, input_scale=None):
    """Direct computation: quantize the BF16 weight ourselves, round x as the scheme says."""
    q, s, _ = fp8.quantize(layer_src, granularity)
    w = fp8.dequantize(q, s, torch.float32)
    xf = x.float()
    if act == "token":
        xf = fp8.fake_quantize(xf, fp8.per_token_scale(xf))
    elif act == "tensor":
        xf = fp8.fake_quantize(xf, torch.tensor(input_scale))
    return xf @ w.T


@pytest.mark.parametrize(
    "scheme,gran,act", [("fp8-dynamic", "row", "token"), ("fp8-weight-only", "row", None), ("fp8", "tensor", "tensor")]
)
def test_load_our_artifact_layers_compute_the_scheme(tiny, scheme, gran, act):
    src, arts = tiny
    model = load(arts[scheme], device="cpu")
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    layers = {
        n: m for n, m in model.named_modules() if isinstance(m, FP8Linear) and not n.endswith(".inner")
    }  # the checkpoint's layers, not a group's fused one
    assert len(layers) == 14 and model.mpsconvert.fp8_layers == 14
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, FP8Linear)
    assert model.mpsconvert.verify["hashes_checked"] and model.mpsconvert.scheme == scheme
    # CPU policy: dense weight made once, no FP8 copy kept; activations rounded through e4m3 when the scheme says so
    for layer in layers.values():
        assert layer.weight is None and layer.dense_weight.dtype == torch.bfloat16
        assert layer.kernels["prefill"] == ("bf16" if act is None else "dense_qact")
    name = "model.layers.1.mlp.down_proj"
    x = torch.randn(5, layers[name].in_features).to(torch.bfloat16)
    got = layers[name](x).float()
    want = _expected(ref.get_submodule(name).weight.data, x, gran, act, 0.02)
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2), (got - want).abs().max()
    with torch.no_grad():
        a, b = model(_ids(model.config.vocab_size)).logits.float(), ref(_ids(model.config.vocab_size)).logits.float()
    assert ((a - b).norm() / b.norm()) < 0.1


def test_load_sharded_artifact(tmp_path):
    src = models.tiny("llama", tmp_path / "src", tokenizer="bpe", dtype=torch.bfloat16, tie=True)
    m = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    m.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    shutil.copy(src / "tokenizer.json", tmp_path / "sharded")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    quantize_snapshot(resolve(str(tmp_path / "sharded")), tmp_path / "art", Options())
    model = load(tmp_path / "art", device="cpu")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, loaded once
    assert (
        model.model.rotary_emb.inv_freq.device.type == "cpu" and torch.isfinite(model.model.rotary_emb.inv_freq).all()
    )
    with torch.no_grad():
        a, b = model(_ids(m.config.vocab_size)).logits.float(), m(_ids(m.config.vocab_size)).logits.float()
    assert ((a - b).norm() / b.norm()) < 0.1


@pytest.mark.parametrize("kind", ["oneshot", "model_free"])
def test_load_llm_compressor_checkpoint(kind):
    model = load(LLMC / kind, device="cpu")
    ref = transformers.AutoModelForCausalLM.from_pretrained(LLMC / "bf16", dtype=torch.bfloat16)
    assert model.mpsconvert.fp8_layers == 14 and model.mpsconvert.scheme == "fp8-dynamic"
    assert not model.mpsconvert.verify["hashes_checked"]  # no manifest: only structural checks, and it says so
    if kind == "model_free":  # llm-compressor's model-free path also quantizes the embedding
        assert model.mpsconvert.dequantized and "embed_tokens" in model.mpsconvert.dequantized[0]
    with torch.no_grad():
        a, b = model(_ids(256)).logits.float(), ref(_ids(256)).logits.float()
    assert ((a - b).norm() / b.norm()) < 0.1
    # the same layer computed directly from llm-compressor's stored codes and (BF16) scales
    from safetensors import safe_open

    files = sorted((LLMC / kind).glob("*.safetensors"))
    with safe_open(str(files[0]), "pt") as f:
        w = f.get_tensor("model.layers.0.mlp.up_proj.weight")
        s = f.get_tensor("model.layers.0.mlp.up_proj.weight_scale")
    x = torch.randn(3, 64).to(torch.bfloat16)
    xf = fp8.fake_quantize(x.float(), fp8.per_token_scale(x.float()))
    want = xf @ (w.float() * s.float()).T
    got = model.model.layers[0].mlp.up_proj(x).float()
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2)


def _flip_byte(path: Path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_tampered_file_is_refused_and_verify_false_loads(tiny, tmp_path):
    _, arts = tiny
    art = tmp_path / "art"
    shutil.copytree(arts["fp8-dynamic"], art)
    _flip_byte(art / "model.safetensors")
    with pytest.raises(ArtifactError, match="model.safetensors does not match the sha256"):
        load(art, device="cpu")
    report = verify_artifact(art)
    assert not report.ok and report.files["model.safetensors"] == "sha256 mismatch"
    model = load(art, device="cpu", verify=False)  # the flipped byte is inside tensor data: structurally fine
    assert model.mpsconvert.fp8_layers == 14 and not model.mpsconvert.verify["hashes_checked"]


def test_truncated_and_missing_files_are_refused(tiny, tmp_path):
    _, arts = tiny
    art = tmp_path / "art"
    shutil.copytree(arts["fp8-dynamic"], art)
    p = art / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-64])
    with pytest.raises(ArtifactError, match="truncated"):
        load(art, device="cpu")
    with pytest.raises(ArtifactError, match="not a valid safetensors file"):  # even unverified, a cut file never loads
        load(art, device="cpu", verify=False)
    (art / "tokenizer.json").unlink()
    assert "tokenizer.json is listed in mpsconvert.json but missing" in verify_artifact(art).problems


def test_verify_catches_missing_scale_and_wrong_shape(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    _, arts = tiny
    art = tmp_path / "art"
    shutil.copytree(arts["fp8-dynamic"], art)
    sd = load_file(art / "model.safetensors")
    del sd["model.layers.0.self_attn.q_proj.weight_scale"]
    sd["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(3, 1)
    save_file(sd, art / "model.safetensors", metadata={"format": "pt"})
    probs = verify_artifact(art, check_hashes=False).problems
    assert "model.layers.0.self_attn.q_proj.weight has no model.layers.0.self_attn.q_proj.weight_scale" in probs
    assert any("up_proj.weight_scale is F32[3, 1]" in p for p in probs)
    probs = verify_artifact(art, check_hashes=False, shapes={"model.layers.0.mlp.down_proj": (64, 64)}).problems
    assert any("down_proj.weight is 64x128 but the model built from config.json has 64x64" in p for p in probs)
    with pytest.raises(ArtifactError, match="failed verification"):
        load(art, device="cpu", verify=False)


def test_unavailable_device_is_an_error_not_a_fallback(tiny):
    _, arts = tiny
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(DeviceError, match="CUDA is not available"):
        load(arts["fp8-dynamic"], device="cuda")


def test_verify_catches_quantized_ignored_module_and_manifest_mismatch(tiny, tmp_path):
    import json

    _, arts = tiny
    art = tmp_path / "art"
    shutil.copytree(arts["fp8-dynamic"], art)
    assert verify_artifact(art).ok
    probs = verify_artifact(art, ignored={"model.layers.0.mlp.up_proj"}).problems
    assert probs == ["model.layers.0.mlp.up_proj is quantized but the quantization_config ignores it"]
    m = json.loads((art / "mpsconvert.json").read_text())
    m["tensors"]["model.layers.0.mlp.up_proj.weight"]["shape"] = [64, 64]
    (art / "mpsconvert.json").write_text(json.dumps(m))
    assert any("records F8_E4M3[64, 64]" in p for p in verify_artifact(art).problems)
    cfg = json.loads((art / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    (art / "config.json").write_text(json.dumps(cfg))
    assert any("only FP8" in p for p in verify_artifact(art, check_hashes=False).problems)
