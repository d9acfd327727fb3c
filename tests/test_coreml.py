"""Core ML export: spec, FP8 weights read back from the package, reference evaluation vs PyTorch,
and failures that leave the artifact as it was. Tiny random Llama and BERT models."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

import mpsconvert
from mpsconvert.apple.coreml import ExportOptions, mil_eval
from mpsconvert.apple.coreml import ops as coreml_ops
from mpsconvert.apple.coreml.coreml_check import check_package, coreml_runtime_check
from mpsconvert.apple.coreml.coreml_export import PACKAGE_NAME, SeqLen
from mpsconvert.apple.torch_model import read_artifact_weights
from mpsconvert.errors import (
    ExportError,
    MpsconvertError,
)
from mpsconvert.format import fp8
from mpsconvert.format.schemes import Scheme
from mpsconvert.manifests.hashing import sha256_file
from mpsconvert.manifests.manifest import Manifest

from .models import resign, tiny, tiny_artifact, tree_hashes

pytestmark = pytest.mark.extra("coreml")


@pytest.fixture(scope="module")
def llama(work):
    return tiny_artifact(work, "llama", partial(tiny, "llama", dtype=torch.bfloat16, tie=True))


@pytest.fixture(scope="module")
def bert(work):
    return tiny_artifact(work, "bert", partial(tiny, "bert"))


def _record(art: Path) -> dict:
    """The manifest's record of the package (what the check is given by apple/flow.py)."""
    return Manifest.read(art).extra["coreml"]


def _copy(art: Path, work: Path, name: str) -> Path:
    dst = work / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(art, dst)
    return dst


def test_seq_len_parsing():
    assert SeqLen.parse("128") == SeqLen(128, 128) and not SeqLen.parse("128").is_range
    r = SeqLen.parse("1:512")
    assert r.is_range and (r.lo, r.hi) == (1, 512) and 1 < r.example <= 512
    for bad in ("0", "8:4", "abc", "1:", ":5"):
        with pytest.raises(MpsconvertError):
            SeqLen.parse(bad)


def test_registered_converters_convert_and_compute_right():
    """diff (with prepend), new_ones, integer-free `&` and where(scalar) through both frontends."""
    import coremltools as ct

    added = coreml_ops.register()
    for op in ("diff", "new_ones", "alias", "__and__"):
        assert op in added

    class M(torch.nn.Module):
        def forward(self, x):
            d = torch.diff(x, dim=-1, prepend=x[:, :1] - 1)
            m = (d > 0) & (x > 0)
            ones = x.new_ones(x.shape)
            return torch.where(m, ones * d, 0.5) + torch.diff(x, n=2, dim=1).sum()

    x = torch.randn(2, 8)
    want = M()(x).numpy()
    for fe in ("torch.export", "torch.jit.trace"):
        if fe == "torch.export":
            src = torch.export.export(M(), (x,), strict=False).run_decompositions({})
            kw = {}
        else:
            src = torch.jit.trace(M(), (x,))
            kw = {"inputs": [ct.TensorType(name="x", shape=x.shape)]}
        ml = ct.convert(
            src,
            minimum_deployment_target=ct.target.iOS18,
            convert_to="mlprogram",
            compute_precision=ct.precision.FLOAT32,
            skip_model_load=True,
            **kw,
        )
        prog = ml._mil_program
        name = list(prog.functions["main"].inputs)[0]
        outs, _ = mil_eval.evaluate(prog, {name: x.numpy()})
        np.testing.assert_allclose(list(outs.values())[0], want, rtol=1e-5, atol=1e-5, err_msg=fe)


def test_llama_fixed_fp8_lut(llama, work):
    art = _copy(llama, work, "llama-fixed")
    rec = mpsconvert.export_coreml(art, kv_cache=False, seq_len="16", check=False).record
    assert rec["frontend"] in ("torch.export", "torch.jit.trace") and rec["task"] == "causal-lm"
    res = check_package(art, _record(art))
    spec = res["spec"]
    assert spec["specification_version"] >= 9  # iOS18 / macOS15
    assert spec["inputs"] == [{"name": "input_ids", "dtype": "int32", "shape": [1, 16]}]
    assert spec["outputs"][0]["name"] == "logits" and spec["outputs"][0]["dtype"] == "fp16"
    # every FP8 weight is a palette over its codes, no dense copy left
    _, quant = read_artifact_weights(art)
    assert spec["ops"]["constexpr_lut_to_dense"] == len(quant) == 14
    w = res["weights"]
    assert w["all_ok"] and w["codes_bit_exact"] and w["max_ulp_diff"] <= 1 and not w["missing"]
    assert res["size_ratio"] <= 1.1
    ev = res["reference_eval"]
    assert ev["ok"] and ev["cosine_min"] > 0.999 and ev["top1_agreement"] >= 0.95
    assert "not the Core ML runtime" in ev["evaluator"]
    # the manifest records the package with hashes that match the files
    m = Manifest.read(art)
    assert m.extra["coreml"]["weights"] == "fp8-lut"
    pkg_files = {k: v for k, v in m.files.items() if k.startswith(PACKAGE_NAME + "/")}
    assert pkg_files and all(sha256_file(art / k) == v["sha256"] for k, v in pkg_files.items())
    assert not [p for p in art.iterdir() if p.name.startswith(".mpsconvert-tmp")]


def test_fp8_lut_indices_are_the_fp8_bytes_independently(llama, work):
    """Decode one weight from the saved package by hand (no mpsconvert check code)."""
    art = _copy(llama, work, "llama-decode")
    rec = mpsconvert.export_coreml(art, kv_cache=False, seq_len="8", check=False).record
    prog, _ = mil_eval.load_program(art / PACKAGE_NAME)
    ops = {op.name: op for op in prog.functions["main"].operations}
    name = "model.layers.1.mlp.down_proj.weight"
    enc = rec["encoded_tensors"][name]
    _, quant = read_artifact_weights(art)
    q, s = quant[name]
    lut_op = ops[enc["lut"]]
    idx = lut_op.indices.val
    assert idx.dtype == np.uint8 and np.array_equal(idx, q.view(torch.uint8).numpy())
    lut = lut_op.lut.val.reshape(-1).astype(np.float32)
    row = ops[enc["row_scale"]].outputs[0].val.astype(np.float32)
    applied = lut[idx] * row[:, None]
    want = fp8.dequantize(q, s, torch.float32).numpy()
    np.testing.assert_allclose(applied, want, rtol=2**-11, atol=0)


@pytest.mark.slow  # 3.5 min on 2 cores
def test_per_tensor_scale_is_folded_and_bit_exact(work):
    art = tiny_artifact(
        work,
        "llama-tensor",
        lambda p: tiny("llama", p, dtype=torch.bfloat16, tie=True, seed=1),
        Scheme.make("fp8-weight-only", "tensor"),
    )
    art = _copy(art, work, "llama-tensor-export")
    mpsconvert.export_coreml(art, kv_cache=False, seq_len="8", check=False)
    res = check_package(art, _record(art), n_samples=2)
    w = res["weights"]
    assert w["all_ok"] and w["codes_bit_exact"]
    assert w["min_fraction_equal_fp16_dequant"] == 1.0 and w["max_ulp_diff"] == 0
    assert "constexpr_blockwise_shift_scale" not in res["spec"]["ops"]
    assert res["reference_eval"]["cosine_min"] > 0.999


def test_llama_range(llama, work):
    art = _copy(llama, work, "llama-range")
    rec = mpsconvert.export_coreml(art, kv_cache=False, seq_len="1:32", check=False).record
    assert rec["seq_len"] == {"min": 1, "max": 32, "flexible": True}
    res = check_package(art, _record(art))
    (inp,) = res["spec"]["inputs"]
    assert inp["name"] == "input_ids" and inp["range"] == [[1, 1], [1, 32]]
    assert res["weights"]["all_ok"] and res["reference_eval"]["ok"]


def test_bert_encoder_range(bert, work):
    art = _copy(bert, work, "bert-range")
    rec = mpsconvert.export_coreml(art, kv_cache=False, seq_len="2:32", check=False).record
    assert rec["task"] == "encoder" and rec["pooling"] == "mean"
    assert rec["fp8_tensors_not_exported"] == ["pooler.dense.weight"]  # BERT's pooler is not in the output
    res = check_package(art, _record(art), n_samples=4)  # odd samples have masked padding
    names = [f["name"] for f in res["spec"]["inputs"]]
    assert names == ["input_ids", "attention_mask"]
    assert all(f["range"] == [[1, 1], [2, 32]] for f in res["spec"]["inputs"])
    assert res["spec"]["outputs"][0]["name"] == "embeddings"
    assert res["weights"]["all_ok"] and res["weights"]["codes_bit_exact"]
    assert res["reference_eval"]["cosine_min"] > 0.999


def test_int8_and_fp16_modes(llama, work):
    sizes = {}
    for mode in ("fp16", "int8"):
        art = _copy(llama, work, f"llama-{mode}")
        mpsconvert.export_coreml(art, kv_cache=False, seq_len="8", weights=mode, check=False)
        res = check_package(art, _record(art), n_samples=1)
        assert res["weights"]["all_ok"] and res["reference_eval"]["ok"]
        sizes[mode] = res["weight_bytes"]
        if mode == "fp16":
            assert res["weights"]["min_fraction_equal_fp16_dequant"] == 1.0
            assert "constexpr_lut_to_dense" not in res["spec"]["ops"]
        else:
            assert res["spec"]["ops"].get("constexpr_blockwise_shift_scale", 0) >= 14
    assert sizes["int8"] < sizes["fp16"]


def test_jit_fallback_is_recorded(llama, work, monkeypatch):
    art = _copy(llama, work, "llama-fallback")

    def boom(*a, **k):
        raise RuntimeError("export refused for the test")

    monkeypatch.setattr(torch.export, "export", boom)
    rec = mpsconvert.export_coreml(art, kv_cache=False, seq_len="8", check=False).record
    assert rec["frontend"] == "torch.jit.trace"
    assert "export refused for the test" in rec["failed_frontends"]["torch.export"]
    assert Manifest.read(art).extra["coreml"]["frontend"] == "torch.jit.trace"


def test_unconvertible_op_names_it_and_leaves_artifact(llama, work, monkeypatch):
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY

    art = _copy(llama, work, "llama-badop")
    mpsconvert.export_coreml(art, kv_cache=False, seq_len="8", check=False)  # an existing package must survive too
    before = tree_hashes(art)
    table = dict(_TORCH_OPS_REGISTRY.name_to_func_mapping)
    table.pop("silu")
    monkeypatch.setattr(_TORCH_OPS_REGISTRY, "name_to_func_mapping", table)
    with pytest.raises(ExportError, match="silu"):
        mpsconvert.export_coreml(art, kv_cache=False, seq_len="8", force=True, check=False)
    assert tree_hashes(art) == before


def test_unsupported_architecture_names_it_and_leaves_artifact(llama, work):
    art = _copy(llama, work, "llama-arch")
    cfg = json.loads((art / "config.json").read_text())
    cfg["architectures"] = ["LlamaForSequenceClassification"]
    (art / "config.json").write_text(json.dumps(cfg))
    resign(art, "config.json")  # an edit the manifest knows of: else verification refuses it first
    before = tree_hashes(art)
    with pytest.raises(ExportError, match="LlamaForSequenceClassification"):
        mpsconvert.export_coreml(art, kv_cache=False, seq_len="8", check=False)
    assert tree_hashes(art) == before


def test_existing_package_needs_force(llama, work):
    art = _copy(llama, work, "llama-force")
    mpsconvert.export_coreml(art, kv_cache=False, seq_len="8", check=False)
    with pytest.raises(MpsconvertError, match="`force`"):  # the API's name (the CLI says --force)
        mpsconvert.export_coreml(art, kv_cache=False, seq_len="8", check=False)
    rec = mpsconvert.export_coreml(art, kv_cache=False, seq_len="12", force=True, check=False).record
    assert rec["seq_len"]["max"] == 12


def test_runtime_check_skips_off_macos(llama):
    import sys

    if sys.platform == "darwin":
        pytest.skip("runs Core ML for real on macOS")
    res = coreml_runtime_check(llama, {})
    assert res["status"] == "skipped" and "needs macOS" in res["reason"]


def test_cli_quantize_coreml_and_check_only(work):
    from click.testing import CliRunner

    from mpsconvert.cli import main

    src = work / "src-llama-cli"
    tiny("llama", src, dtype=torch.bfloat16, tie=True, seed=2)
    out = work / "art-llama-cli"
    r = CliRunner().invoke(main, ["quantize", str(src), "-o", str(out), "--coreml", "--max-len", "48"])
    assert r.exit_code == 0, r.output
    assert "not the Core ML runtime" in r.output and (out / PACKAGE_NAME).is_dir()
    assert Manifest.read(out).extra["coreml"]["check"]["ok"] is True
    assert Manifest.read(out).extra["coreml"]["kv_cache"] is True
    r = CliRunner().invoke(main, ["export-coreml", str(out), "--check-only", "--json", "--decode-steps", "4"])
    assert r.exit_code == 0, r.output
    body = json.loads(r.output)
    assert (
        body["check"]["weights"]["codes_bit_exact"] is True
        and body["check"]["reference_eval"]["decode"]["positions"] == 4
    )
    r = CliRunner().invoke(main, ["export-coreml", str(out)])
    assert r.exit_code == 2 and "--force" in r.output


def test_checks_catch_a_package_that_does_not_match_the_artifact(llama, work):
    """Negative control: change one row scale of the artifact after export; the weight check
    must name the tensor and the reference evaluation must see the logits move."""
    from safetensors.torch import load_file, save_file

    art = _copy(llama, work, "llama-tampered")
    mpsconvert.export_coreml(art, kv_cache=False, seq_len="8", check=False)
    assert check_package(art, _record(art), n_samples=1)["ok"]
    st = art / "model.safetensors"
    tensors = load_file(str(st))
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name + "_scale"] = tensors[name + "_scale"] * 4
    save_file(tensors, str(st), metadata={"format": "pt"})
    res = check_package(art, _record(art), n_samples=1)
    bad = [n for n, r in res["weights"]["tensors"].items() if not r["ok"]]
    assert bad == [name] and not res["weights"]["all_ok"] and not res["ok"]
    assert res["reference_eval"]["cosine_min"] < 0.9999


# ------------------------------------------------------------------------ the stateful decoder (default for causal LMs)

STATEFUL = {
    "llama-tied": partial(tiny, "llama", dtype=torch.bfloat16, tie=True),
    "qwen2-tied": partial(tiny, "qwen2", tie=True),
    "mistral": partial(tiny, "mistral"),
    "qwen3-moe": lambda p: tiny("qwen3_moe", p, dtype=torch.bfloat16, widen=0.08, vocab=128),
}


@pytest.fixture(scope="module")
def stateful_packages(work):
    out = {}
    for name, build in STATEFUL.items():
        art = _copy(tiny_artifact(work, f"sf-{name}", build), work, f"sf-{name}-export")
        rec = mpsconvert.export(art, "coreml", options=ExportOptions(max_len=48), check=False).record
        out[name] = (art, rec, check_package(art, _record(art), prompt_len=32, steps=8, generate=3))
    return out


@pytest.mark.parametrize("name", list(STATEFUL))
def test_stateful_decoder_declares_states_keeps_fp8_and_agrees(stateful_packages, name):
    art, rec, res = stateful_packages[name]
    assert rec["kv_cache"] is True and rec["max_len"] == 48 and rec["minimum_deployment_target"] == "iOS18 / macOS15"
    spec = res["spec"]
    assert [f["name"] for f in spec["inputs"]] == ["input_ids", "position"]
    assert spec["inputs"][0]["range"] == [[1, 1], [1, 48]] and spec["inputs"][1]["shape"] == [1]
    assert [f["name"] for f in spec["states"]] == [f"{k}_cache_{i}" for i in range(2) for k in ("key", "value")]
    assert all(f["dtype"] == "fp16" and f["shape"][0] == 1 and f["shape"][2] == 48 for f in spec["states"])
    assert spec["ops"]["read_state"] == 4 and spec["ops"]["coreml_update_state"] == 4
    w = res["weights"]
    assert w["all_ok"] and w["codes_bit_exact"] and w["max_ulp_diff"] <= 1 and not w["missing"]
    n_lut = rec["fp8_tensors"] + rec["fp8_expert_parameters"]
    assert spec["ops"]["constexpr_lut_to_dense"] == n_lut == w["checked"]
    assert (rec["fp8_expert_parameters"] > 0) == (name == "qwen3-moe")
    assert res["size_ratio"] <= 1.1
    ev = res["reference_eval"]
    assert (
        ev["ok"]
        and ev["prefill"]["top1_agreement"] >= 0.98
        and ev["decode"]["top1_agreement"] >= 0.95
        and ev["decode"]["positions"] == 8
    )
    assert ev["generation"]["agree"]
    assert "not the Core ML runtime" in ev["evaluator"]
    assert {"read_state", "coreml_update_state", "scatter_along_axis"} <= set(ev["ops_by_implementation"]["mpsconvert"])


def test_reference_decode_needs_the_states(stateful_packages):
    """Negative control: the same decode with fresh states at every call must fail the check."""
    from mpsconvert.apple import compare
    from mpsconvert.apple.coreml.coreml_check import mil_decoder
    from mpsconvert.apple.torch_model import build_torch_model

    art, _, _ = stateful_packages["llama-tied"]
    prog, _ = mil_eval.load_program(art / PACKAGE_NAME)
    tm = build_torch_model(art)
    ids, _ = compare.prompt_ids(art, tm, 40)
    run = mil_decoder(prog)

    def amnesiac():
        return lambda x, pos: run()(x, pos)

    bad = compare.check_decoder(amnesiac, tm, ids, 32, 8, 2)
    assert not bad["ok"] and bad["decode"]["cosine_min"] < 0.99
    with pytest.raises(MpsconvertError, match="KV cache"):
        run()(np.zeros((1, 4), dtype=np.int32), 46)


def test_mil_eval_states_persist_between_calls():
    import coremltools as ct

    class Acc(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("total", torch.zeros(1, 4))

        def forward(self, x):
            self.total.add_(x)
            return self.total * 2

    ep = torch.export.export(Acc(), (torch.zeros(1, 4),), strict=False).run_decompositions({})
    ml = ct.convert(
        ep,
        minimum_deployment_target=ct.target.iOS18,
        convert_to="mlprogram",
        skip_model_load=True,
        compute_precision=ct.precision.FLOAT32,
    )
    prog = ml._mil_program
    states = mil_eval.new_states(prog)
    assert list(states) == ["total"] and states["total"].dtype == np.float16
    name = [n for n in prog.functions["main"].inputs if n != "total"][0]
    for i in range(1, 4):
        outs, how = mil_eval.evaluate(prog, {name: np.ones((1, 4), np.float32)}, states=states)
        np.testing.assert_allclose(list(outs.values())[0], np.full((1, 4), 2.0 * i))
    assert np.all(states["total"] == 3) and how["mpsconvert:read_state"] >= 1
    with pytest.raises(MpsconvertError, match="state"):
        mil_eval.evaluate(prog, {name: np.ones((1, 4), np.float32)})


class _FakeMLModel:
    """Core ML's MLModel as the runtime check uses it (make_state, predict(..., state=)), run by
    the reference evaluator: the check's logic is exercised as on macOS."""

    loads: list = []

    def __init__(self, path, compute_units=None):
        if compute_units == "CPU_AND_NE":
            raise RuntimeError("the Neural Engine refused the model for the test")
        self.loads.append(compute_units)
        self.prog, _ = mil_eval.load_program(Path(path))
        self.cache = {}

    def make_state(self):
        return mil_eval.new_states(self.prog)

    def predict(self, inputs, state=None):
        return mil_eval.evaluate(self.prog, inputs, states=state, cache=self.cache)[0]


class _FakeCT:
    class models:
        MLModel = _FakeMLModel

    class ComputeUnit:
        ALL, CPU_AND_GPU, CPU_AND_NE, CPU_ONLY = "ALL", "CPU_AND_GPU", "CPU_AND_NE", "CPU_ONLY"


def test_coreml_runtime_check_on_macos_through_states_with_a_fake(stateful_packages):
    art, _, _ = stateful_packages["llama-tied"]
    _FakeMLModel.loads = []
    res = coreml_runtime_check(art, _record(art), prefill_len=16, decode_tokens=4, platform="darwin", ct=_FakeCT)
    assert res["status"] == "ran" and res["kind"] == "stateful decoder"
    rows = {r["engine"]: r for r in res["rows"]}
    assert _FakeMLModel.loads == ["ALL", "CPU_AND_GPU"]
    for cu in ("coreml:all", "coreml:cpu_and_gpu"):
        r = rows[cu]
        assert (
            r["ok"]
            and r["prefill_top1"] >= 0.98
            and r["decode_top1"] >= 0.95
            and r["decode_tokens"] == 4
            and r["decode_tokens_per_s"] > 0
        )
    assert "Neural Engine refused" in rows["coreml:cpu_and_ne"]["error"] and res["ok"] is False
    assert "pytorch:mps fp16" in rows


def test_failed_stateful_export_leaves_artifact(stateful_packages, work, monkeypatch):
    from mpsconvert.apple.coreml import coreml_export

    art = _copy(stateful_packages["mistral"][0], work, "sf-mistral-fail")
    before = tree_hashes(art)

    def boom(frontend, target):
        raise RuntimeError(f"{frontend} refused for the test")

    monkeypatch.setattr(coreml_export, "_convert_with", boom)
    with pytest.raises(ExportError, match="refused for the test"):
        mpsconvert.export(art, "coreml", options=ExportOptions(max_len=48, force=True))
    assert tree_hashes(art) == before


def test_cli_no_kv_cache_keeps_the_stateless_form(stateful_packages, work):
    from click.testing import CliRunner

    from mpsconvert.cli import main

    art = _copy(stateful_packages["qwen2-tied"][0], work, "sf-qwen2-stateless")
    r = CliRunner().invoke(main, ["export-coreml", str(art), "--force", "--no-kv-cache", "--seq-len", "8", "--json"])
    assert r.exit_code == 0, r.output
    body = json.loads(r.output[r.output.index("{") :])
    assert body["export"]["kv_cache"] is False and not body["check"]["spec"]["states"]
    assert [f["name"] for f in body["check"]["spec"]["inputs"]] == ["input_ids"]
