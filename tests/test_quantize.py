"""End to end: tiny models of several architectures -> FP8 artifact -> transformers + compressed-tensors."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import mpsconvert
from mpsconvert.format import fp8
from mpsconvert.manifests.manifest import Manifest

pytestmark = pytest.mark.core  # CI's floor lane runs these on the lowest torch and transformers

CAUSAL = ["llama", "llama_bf16", "qwen2_tied", "mistral", "llama_sharded", "gpt2"]


def convert(src, out, scheme="fp8-dynamic", weights=None, **kw):
    return mpsconvert.quantize(src, out, scheme=scheme, weights=weights, **kw).manifest


def artifact_tensors(out):
    sd = {}
    for f in sorted(out.glob("*.safetensors")):
        sd.update(load_file(f))
    return sd


def reference_model(cls, src, out, dynamic: bool):
    """The source model with our dequantized weights put in (and, for the dynamic scheme, the
    inputs of each quantized Linear fake-quantized per token, as compressed-tensors does)."""
    ref = cls.from_pretrained(src)
    sd = artifact_tensors(out)
    quantized = {k[: -len(".weight_scale")] for k in sd if k.endswith(".weight_scale")}
    prefix = getattr(ref, "base_model_prefix", "")
    with torch.no_grad():
        for name, mod in ref.named_modules():
            key = name if name in quantized else name.removeprefix(prefix + ".")
            if key in quantized:
                mod.weight.copy_(fp8.dequantize(sd[key + ".weight"], sd[key + ".weight_scale"], mod.weight.dtype))
                if dynamic:
                    mod.register_forward_pre_hook(
                        lambda m, a: (fp8.fake_quantize(a[0], fp8.per_token_scale(a[0].float())),)
                    )
    return ref, quantized


@pytest.mark.extra("ct")
@pytest.mark.parametrize("arch", CAUSAL)
@pytest.mark.parametrize("scheme,weights", [("fp8-dynamic", "row"), ("fp8-weight-only", "tensor")])
def test_causal_lm_loads_with_transformers_and_matches_dequantized_reference(
    tiny_models, tmp_path, arch, scheme, weights
):
    from transformers import AutoModelForCausalLM

    src = tiny_models[arch]
    out = tmp_path / "fp8"
    man = convert(src, out, scheme, weights)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ref, quantized = reference_model(AutoModelForCausalLM, src, out, dynamic=scheme == "fp8-dynamic")
    if arch != "gpt2":
        assert len(quantized) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits.float(), ref.eval()(ids).logits.float()
    tol = 5e-2 if arch == "llama_bf16" else 2e-4  # bf16 rounding of the simulated activations
    assert (got - want).abs().max() <= tol * want.abs().max()
    assert man.summary["tensors_quantized"] == len(quantized)


def test_gpt2_conv1d_is_reported_as_skipped_not_silently_dropped(tiny_models, tmp_path):
    man = convert(tiny_models["gpt2"], tmp_path / "o")
    conv = {k: v for k, v in man.skipped.items() if "Conv1D" in v}
    assert "transformer.h.0.attn.c_attn" in conv and "transformer.h.1.mlp.c_proj" in conv
    assert man.tensors == {}  # GPT-2 has no nn.Linear besides the tied lm_head
    assert man.summary["modules_skipped"] >= 8


@pytest.mark.extra("ct")
def test_embeddings_are_never_quantized_and_tied_lm_head_stays_tied(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    src, out = tiny_models["qwen2_tied"], tmp_path / "o"
    man = convert(src, out)
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        emb = f.get_tensor("model.embed_tokens.weight")
    with safe_open(src / "model.safetensors", "pt") as f:
        assert torch.equal(emb, f.get_tensor("model.embed_tokens.weight"))  # copied bit for bit
    assert emb.dtype == torch.float32 and "model.embed_tokens.weight_scale" not in keys
    assert "lm_head.weight" not in keys
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "lm_head" in qc["ignore"]
    assert not any("embed" in k for k in man.tensors)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.model.embed_tokens.weight, emb)


@pytest.mark.extra("ct")
def test_bert_encoder_loads_and_matches(tiny_models, tmp_path):
    from transformers import AutoModel

    src, out = tiny_models["bert"], tmp_path / "o"
    man = convert(src, out, "fp8-weight-only")
    assert "pooler.dense.weight" in man.tensors and "encoder.layer.0.attention.self.query.weight" in man.tensors
    model = AutoModel.from_pretrained(out).eval()
    ref, _ = reference_model(AutoModel, src, out, dynamic=False)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).last_hidden_state, ref.eval()(ids).last_hidden_state
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_gives_sharded_artifact_with_index(tiny_models, tmp_path):
    src, out = tiny_models["llama_sharded"], tmp_path / "o"
    n_src = len(list(src.glob("*.safetensors")))
    assert n_src > 1
    convert(src, out)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == [f"model-{i:05d}-of-{n_src:05d}.safetensors" for i in range(1, n_src + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for name, shard in index["weight_map"].items():
        with safe_open(out / shard, "pt") as f:
            assert name in f.keys()
    assert index["metadata"]["total_size"] == sum((out / s).stat().st_size for s in shards)


def test_a_shard_is_awaited_one_shard_later_so_the_next_one_starts_meanwhile(tiny_models, tmp_path, monkeypatch):
    """The writer of shard i finishes (its last copies, its sha256) while shard i+1 is read and
    quantized: its digest is asked for only after shard i+1's writer was opened."""
    import threading

    from mpsconvert.infra import safetensors_writer

    events = []
    real_init, real_digest = safetensors_writer.ShardWriter.__init__, safetensors_writer.ShardWriter.digest

    def init(self, path, *a, **k):
        events.append(("open", path.name))
        real_init(self, path, *a, **k)

    def digest(self):  # asked for by the conversion's thread (the fsync thread waits on it from the start)
        if threading.current_thread() is threading.main_thread() and ("digest", self.path.name) not in events:
            events.append(("digest", self.path.name))
        return real_digest.fget(self)

    monkeypatch.setattr(safetensors_writer.ShardWriter, "__init__", init)
    monkeypatch.setattr(safetensors_writer.ShardWriter, "digest", property(digest))
    man = convert(tiny_models["llama_sharded"], tmp_path / "o")
    shards = [n for kind, n in events if kind == "open"]
    assert len(shards) >= 3 and sorted(shards) == sorted(f for f in man.files if f.endswith(".safetensors"))
    for a, b in zip(shards, shards[1:]):
        assert events.index(("open", b)) < events.index(("digest", a)), events


def test_max_shard_size_splits_output_and_every_split_loads(tiny_models, tmp_path):
    """A source shard whose output exceeds --max-shard-size becomes several files, each within the
    size (its tensors whole), indexed and hashed in the manifest, and the artifact loads equal to
    the one written as a single file."""
    import mpsconvert.runtime as rt
    from mpsconvert.errors import QuantizationError

    src = tiny_models["llama"]
    one, split = tmp_path / "one", tmp_path / "split"
    convert(src, one)
    man = convert(src, split, max_shard_size="60KB")
    shards = sorted(p.name for p in split.glob("*.safetensors"))
    assert len(shards) > 2 and [p.name for p in one.glob("*.safetensors")] == ["model.safetensors"]
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for name in shards:
        with safe_open(split / name, "pt") as f:
            payload = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
            # a file past the size holds one tensor (with its scales) that alone is larger
            assert payload <= 60_000 or len([k for k in f.keys() if not k.endswith("_scale")]) == 1, (name, payload)
        assert man.files[name]["size"] == (split / name).stat().st_size
    index = json.loads((split / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert artifact_tensors(split).keys() == artifact_tensors(one).keys()
    assert all(
        torch.equal(a.view(torch.uint8), artifact_tensors(one)[k].view(torch.uint8))
        for k, a in artifact_tensors(split).items()
    )
    a, b = rt.load(one, device="cpu"), rt.load(split, device="cpu")
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    # `verify` hashes the files on a thread each (up to one per core), and still catches a flipped byte
    import os
    import threading

    from mpsconvert.manifests import verify as vf

    names, real = set(), vf.hash_and_count  # the files' sha256 (and their FP8 codes' NaN count, in the same read)
    barrier = threading.Barrier(2, timeout=30)

    def hashing(path, *a, **kw):
        name = threading.current_thread().name
        if (
            name.startswith("mpsconvert-verify") and name not in names
        ):  # the files' hashes (the manifest's own is hashed first)
            names.add(name)
            if len(names) <= 2 and (os.cpu_count() or 1) >= 2:
                barrier.wait()  # two files are hashed at the same time, or this times out
        return real(path, *a, **kw)

    vf.hash_and_count = hashing
    try:
        assert mpsconvert.verify(split).ok
    finally:
        vf.hash_and_count = real
    assert len(names) >= min(2, os.cpu_count() or 1), names
    victim = split / shards[1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    assert not mpsconvert.verify(split).ok
    for bad in ("lots", "0GB", -5):
        with pytest.raises(QuantizationError, match="shard size"):
            convert(src, tmp_path / "bad", max_shard_size=bad)
    assert not (tmp_path / "bad").exists()


@pytest.mark.extra("ct")
def test_ct_config_parses_with_compressed_tensors(tiny_models, tmp_path):
    import compressed_tensors.quantization as ct

    for scheme in ("fp8-dynamic", "fp8-weight-only"):
        out = tmp_path / scheme
        convert(tiny_models["llama"], out, scheme)
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        parsed = ct.QuantizationConfig.model_validate(qc)
        g = parsed.config_groups["group_0"]
        assert g.weights.type == "float" and g.weights.num_bits == 8 and g.weights.strategy == "channel"
        assert (g.input_activations is None) == (scheme == "fp8-weight-only")


def test_manifest_records_source_recipe_tensors_and_outputs(tiny_models, tmp_path):
    from mpsconvert.manifests.hashing import sha256_file

    src, out = tiny_models["llama"], tmp_path / "o"
    convert(src, out, ignore=["mlp.down_proj"])
    m = Manifest.read(out)
    assert m.source["files"]["model.safetensors"] == sha256_file(src / "model.safetensors")
    assert m.recipe["name"] == "fp8-dynamic" and m.recipe["weights"] == "row"
    assert m.recipe["ignored_modules"]["model.layers.0.mlp.down_proj"] == "--ignore mlp.down_proj"
    assert len(m.tensors) == 12
    rec = m.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert rec["shape"] == [64, 64] and rec["weight_scale_shape"] == [64, 1] and rec["sqnr_db"] > 25
    for name, f in m.files.items():
        assert sha256_file(out / name) == f["sha256"], name
    assert {"torch", "transformers", "safetensors"} <= set(m.versions)
    worst = min(m.tensors.items(), key=lambda kv: kv[1]["sqnr_db"])
    assert m.summary["worst_sqnr_tensor"] == worst[0]


def test_non_weight_files_are_copied(tiny_models, tmp_path):
    src = tmp_path / "src"
    import shutil

    shutil.copytree(tiny_models["llama"], src)
    (src / "tokenizer_config.json").write_text("{}")
    (src / "sub").mkdir()
    (src / "sub" / "config.json").write_text('{"x": 1}')
    convert(src, tmp_path / "o")
    assert (tmp_path / "o" / "tokenizer_config.json").read_text() == "{}"
    assert (tmp_path / "o" / "generation_config.json").is_file()
    assert (tmp_path / "o" / "sub" / "config.json").read_text() == '{"x": 1}'
