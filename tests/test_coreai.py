"""Core AI export: native f8E4M3FN weights, the stateful decoder, checks on the Core AI runtime
that coreai-core bundles (Linux CPU here), failures that leave the artifact as it was, and the
macOS-only parts through fakes. Tiny random Llama, Qwen2 (tied), Mistral, Qwen3-MoE and BERT."""

from __future__ import annotations

import json
import shutil
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from mpsconvert.apple.coreai import weights as cw
from mpsconvert.apple.coreai.session import parse_signature, specialization
from mpsconvert.errors import ExportError, MpsconvertError

from .models import tiny, tiny_artifact, tree_hashes

# --------------------------------------------------------------------------- no coreai needed


def test_blockwise_scale_is_a_function_of_the_scale_shape():
    assert cw.blockwise_scale(torch.tensor([0.5]), (8, 4)).shape == (1, 1)
    assert cw.blockwise_scale(torch.tensor(0.5), (8, 4)).shape == (1, 1)
    assert cw.blockwise_scale(torch.ones(8, 1), (8, 4)).shape == (8, 1)
    assert cw.blockwise_scale(torch.ones(2, 2), (256, 256)).shape == (2, 2)  # 128x128 blocks
    assert cw.blockwise_scale(torch.ones(3, 8, 1), (3, 8, 4)).shape == (3, 8, 1)  # fused MoE experts
    for bad, shape in ((torch.ones(3, 1), (8, 4)), (torch.ones(8), (8, 4)), (torch.ones(3, 3), (256, 256))):
        with pytest.raises(ExportError, match="does not tile"):
            cw.blockwise_scale(bad, shape)


def test_fp16_shift_keeps_small_scales_normal():
    assert cw.fp16_shift(torch.tensor([[1e-3], [2e-2]])) == 0
    k = cw.fp16_shift(torch.tensor([[1e-6], [1e-3], [1e-12]]))  # 1e-12: an all-zero row's floor, ignored
    assert 1e-6 * 2**k >= 2**-14 and 1e-3 * 448 * 2**k < 2**15
    with pytest.raises(ExportError, match="fp32"):
        cw.fp16_shift(torch.tensor([[1e-9], [10.0]]))


def test_parse_signature():
    assert parse_signature("NDArray (Float16, 1 × 2 × 64 × 16)") == ("float16", [1, 2, 64, 16])
    assert parse_signature("NDArray (Int32, 1 × ?)") == ("int32", [1, None])
    with pytest.raises(ExportError):
        parse_signature("Image (RGBA)")


class _FakeKind:
    @classmethod
    def cpu(cls):
        return "kind:cpu"

    @classmethod
    def gpu(cls):
        return "kind:gpu"

    @classmethod
    def neural_engine(cls):
        return "kind:ane"


class _FakeOptions:
    supported = True

    @staticmethod
    def is_supported():
        return _FakeOptions.supported

    @classmethod
    def from_preferred_compute_unit_kind(cls, kind):
        return ("options", kind)


class _FakeRuntime:
    ComputeUnitKind = _FakeKind
    SpecializationOptions = _FakeOptions


def test_specialization_options_follow_the_public_api():
    rt = _FakeRuntime()
    assert specialization(None, rt, platform="linux") is None
    assert specialization("gpu", rt, platform="darwin") == ("options", "kind:gpu")
    assert specialization("neural_engine", rt, platform="darwin") == ("options", "kind:ane")
    with pytest.raises(ExportError, match="macOS"):
        specialization("gpu", rt, platform="linux")
    with pytest.raises(ExportError, match="compute unit"):
        specialization("tpu", rt, platform="darwin")
    _FakeOptions.supported = False
    try:
        with pytest.raises(ExportError, match="USE_OS_COREAI"):
            specialization("cpu", rt, platform="darwin")
    finally:
        _FakeOptions.supported = True


def test_export_coreai_without_the_extra_is_one_line(tmp_path, monkeypatch):
    """No coreai-core: `export-coreai` names the pip line, exit 2, no traceback."""
    from click.testing import CliRunner

    from mpsconvert.cli import main

    from .models import hide_modules

    hide_modules(monkeypatch, "coreai")
    r = CliRunner().invoke(main, ["export-coreai", str(tmp_path)])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'mpsconvert[coreai]'" in lines[0] and "Traceback" not in r.output


# --------------------------------------------------------------------------- with coreai-core / coreai-torch

# Every test below runs coreai-core's runtime or coreai-torch's converter: marked extra("coreai").

import mpsconvert  # noqa: E402
from mpsconvert.apple.coreai import ASSET_NAME, CoreAIOptions  # noqa: E402
from mpsconvert.apple.coreai.coreai_check import check_asset, coreai_latency, decoder_runner, read_fp8_constants  # noqa: E402
from mpsconvert.apple.coreai.session import Session  # noqa: E402
from mpsconvert.format.schemes import Scheme  # noqa: E402
from mpsconvert.manifests.hashing import sha256_file  # noqa: E402
from mpsconvert.manifests.manifest import Manifest  # noqa: E402
from mpsconvert.manifests.records import Validation  # noqa: E402
from mpsconvert.manifests.transaction import transaction  # noqa: E402


def _record(art: Path) -> dict:
    """The manifest's record of the asset (what the check is given by apple/flow.py)."""
    return Manifest.read(art).extra["coreai"]


def export_coreai(art: Path, opts: CoreAIOptions) -> dict:
    """The export alone (its check is run by each test, with its own settings)."""
    return mpsconvert.export(art, "coreai", options=opts, check=False).record


BUILDERS = {
    "llama": lambda p: tiny(
        "llama", p, tokenizer="bpe", dtype=torch.bfloat16, tie=False
    ),  # with a tokenizer: the checks run on real text
    "qwen2-tied": partial(tiny, "qwen2", tie=True),
    "mistral": partial(tiny, "mistral"),
    "qwen3-moe": lambda p: tiny("qwen3_moe", p, dtype=torch.bfloat16, widen=0.08, vocab=128),
}


@pytest.fixture(scope="module")
def exported(work):
    """Every architecture quantized (fp8-dynamic) and exported once, with its check."""
    out = {}
    for name, build in BUILDERS.items():
        art = tiny_artifact(work, name, build)
        rec = export_coreai(art, CoreAIOptions(max_len=64))
        out[name] = (art, rec, check_asset(art, _record(art), prompt_len=40, steps=16, generate=4))
    return out


@pytest.mark.extra("coreai")
@pytest.mark.parametrize("name", list(BUILDERS))
def test_architectures_export_with_native_fp8_and_agree_through_the_states(exported, name):
    art, rec, res = exported[name]
    assert rec["task"] == "causal-lm" and rec["compute"] == "fp32" and rec["max_len"] == 64
    iface = rec["interface"]
    assert [(i["name"], i["dtype"], i["shape"]) for i in iface["inputs"]] == [
        ("input_ids", "int32", [1, None]),
        ("position", "int32", [1]),
    ]
    assert iface["outputs"][0]["name"] == "logits" and iface["outputs"][0]["shape"][:2] == [1, None]
    states = [s["name"] for s in iface["states"]]
    assert states == [f"{k}_cache_{i}" for i in range(2) for k in ("key", "value")]
    assert all(s["shape"][2] == 64 for s in iface["states"])
    assert res["interface"]["ok"], res["interface"]["problems"]
    w = res["weights"]
    assert w["codes_bit_exact"] and w["scales_exact"] and w["all_ok"]
    assert w["checked"] == rec["fp8_tensors"] + rec["fp8_expert_parameters"] == len(rec["encoded_tensors"])
    assert (rec["fp8_expert_parameters"] > 0) == (name == "qwen3-moe")
    # the asset's own summary lists f8E4M3FN, at least one stored value per FP8 weight of the artifact
    assert res["storage"]["storage_types"]["Float8E4M3FN"] >= w["fp8_values_in_artifact"] > 0
    assert "Float8E4M3FN" in res["storage"]["compute_types"]
    ev = res["runtime_eval"]
    assert ev["runtime"] == "Core AI runtime, Linux CPU" or not sys.platform.startswith("linux")
    assert ev["ok"] and ev["prefill"]["top1_agreement"] >= 0.98 and ev["decode"]["top1_agreement"] >= 0.95
    assert ev["decode"]["positions"] == 16 and ev["generation"]["agree"]
    assert res["ok"]


@pytest.mark.extra("coreai")
def test_real_text_and_dense_tensors_keep_their_dtype(exported):
    art, rec, res = exported["llama"]
    assert "real text" in res["runtime_eval"]["inputs"]
    # the artifact's BF16 tensors (embeddings, norms, lm_head) are stored as BF16, computed in fp32
    kept = rec["dense_tensors"]["stored_as_in_artifact"]
    assert kept["model.embed_tokens.weight"] == "bfloat16" and kept["lm_head.weight"] == "bfloat16"
    assert res["storage"]["storage_types"].get("BFloat16", 0) > 0


@pytest.mark.extra("coreai")
def test_tied_embeddings_are_stored_once(exported):
    art, rec, res = exported["qwen2-tied"]
    emb = 256 * 64
    st = res["storage"]["storage_types"]
    dense = sum(st.get(k, 0) for k in ("BFloat16", "Float16", "Float32"))
    assert emb < dense < 2 * emb  # not once for embed_tokens and again for lm_head


@pytest.mark.extra("coreai")
def test_manifest_records_the_asset_with_hashes(exported):
    art, rec, _ = exported["mistral"]
    m = Manifest.read(art)
    assert m.extra["coreai"]["asset"] == ASSET_NAME and m.versions.get("coreai_core")
    files = {k: v for k, v in m.files.items() if k.startswith(ASSET_NAME + "/")}
    assert files and all(sha256_file(art / k) == v["sha256"] for k, v in files.items())
    assert {Path(k).name for k in files} >= {"metadata.json"}
    assert not [p for p in art.iterdir() if p.name.startswith(".mpsconvert-")]


@pytest.mark.extra("coreai")
def test_fp8_bytes_in_the_asset_are_the_artifacts_codes_independently(exported):
    """Read one weight's bytes from the saved program by hand and compare with the safetensors."""
    from safetensors import safe_open

    art, _, _ = exported["mistral"]
    with safe_open(str(art / "model.safetensors"), framework="pt") as f:
        codes = f.get_tensor("model.layers.1.mlp.down_proj.weight")
    found = [
        c
        for c in read_fp8_constants(art / ASSET_NAME)
        if c["shape"] == list(codes.shape) and c["bytes"] == codes.view(torch.uint8).numpy().tobytes()
    ]
    assert len(found) == 1


@pytest.mark.extra("coreai")
def test_states_carry_the_cache_between_calls(exported):
    """Negative control: the same decode with fresh states at every step must disagree, so the
    agreement above comes from the states."""
    art, _, _ = exported["llama"]
    from mpsconvert.apple import compare
    from mpsconvert.apple.torch_model import build_torch_model

    tm = build_torch_model(art)
    ids, _ = compare.prompt_ids(art, tm, 48)
    with Session(art / ASSET_NAME) as s:
        run = decoder_runner(s)
        good = compare.check_decoder(run, tm, ids, 32, 16, 2)

        def amnesiac():
            def step(x, pos):
                return run()(x, pos)  # a new conversation (zeroed states) for every call

            return step

        bad = compare.check_decoder(amnesiac, tm, ids, 32, 16, 2)
        with pytest.raises(MpsconvertError, match="KV cache"):
            run()(np.zeros((1, 8), dtype=np.int32), 60)  # past the cache: refused before the runtime sees it
    assert good["ok"] and good["decode"]["cosine_min"] > 0.9999
    assert not bad["ok"] and bad["decode"]["cosine_min"] < 0.99


@pytest.mark.extra("coreai")
def test_fp16_compute_and_per_tensor_scales(work):
    art = tiny_artifact(
        work,
        "llama-tensor",
        lambda p: tiny("llama", p, dtype=torch.bfloat16, tie=True, seed=3),
        Scheme.make("fp8-weight-only", "tensor"),
    )
    rec = export_coreai(art, CoreAIOptions(max_len=32, compute="fp16"))
    assert all(e["scale_shape"] == [1, 1] and e["scale_dtype"] == "float16" for e in rec["encoded_tensors"].values())
    res = check_asset(art, _record(art), prompt_len=16, steps=8, generate=2)
    assert res["weights"]["codes_bit_exact"] and res["weights"]["scales_exact"]
    assert res["runtime_eval"]["decode"]["cosine_min"] > 0.999
    assert res["ok"]


@pytest.mark.extra("coreai")
def test_encoder_keeps_the_embeddings_interface(work):
    art = tiny_artifact(work, "bert", partial(tiny, "bert"))
    rec = export_coreai(art, CoreAIOptions(max_len=32))
    assert rec["task"] == "encoder" and not rec["interface"]["states"]
    assert [i["name"] for i in rec["interface"]["inputs"]] == ["input_ids", "attention_mask"]
    res = check_asset(art, _record(art), samples=2)
    assert res["ok"] and res["runtime_eval"]["cosine_min"] > 0.999 and res["weights"]["codes_bit_exact"]


@pytest.mark.extra("coreai")
def test_checks_catch_an_asset_that_does_not_match_the_artifact(exported, work):
    """Change one row scale of the artifact after export: the weight check names it and the
    runtime's logits move away from the (new) reference."""
    from safetensors.torch import load_file, save_file

    src, _, _ = exported["mistral"]
    art = work / "mistral-tampered"
    shutil.copytree(src, art)
    st = art / "model.safetensors"
    tensors = load_file(str(st))
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name + "_scale"] = tensors[name + "_scale"] * 4
    save_file(tensors, str(st), metadata={"format": "pt"})
    res = check_asset(art, _record(art), prompt_len=16, steps=4, generate=2)
    bad = [n for n, r in res["weights"]["tensors"].items() if not r["ok"]]
    assert bad == [name] and res["weights"]["codes_bit_exact"] and not res["weights"]["scales_exact"] and not res["ok"]


@pytest.mark.extra("coreai")
def test_failed_export_leaves_the_artifact_as_it_was(exported, work, monkeypatch):
    import coreai_torch

    src, _, _ = exported["qwen2-tied"]
    art = work / "qwen2-fail"
    shutil.copytree(src, art)
    before = tree_hashes(art)

    def boom(self, *a, **k):
        raise RuntimeError("no lowering for aten.frobnicate for the test")

    monkeypatch.setattr(coreai_torch.TorchConverter, "to_coreai", boom)
    with pytest.raises(ExportError, match="frobnicate"):
        export_coreai(art, CoreAIOptions(max_len=64, force=True))
    assert tree_hashes(art) == before
    with pytest.raises(MpsconvertError, match="`force`"):  # an existing asset needs force (--force)
        export_coreai(art, CoreAIOptions(max_len=64))
    with pytest.raises(MpsconvertError, match="max_position_embeddings"):
        export_coreai(art, CoreAIOptions(max_len=100000, force=True))
    assert tree_hashes(art) == before


@pytest.mark.extra("coreai")
def test_latency_on_linux_is_labelled_beside_pytorch_cpu(exported):
    art, _, _ = exported["llama"]
    res = coreai_latency(art, _record(art), prefill_len=16, decode_tokens=4, warmup=1)
    assert res["status"] == "ran"
    engines = [r["engine"] for r in res["rows"]]
    if sys.platform.startswith("linux"):
        assert engines[0] == "Core AI runtime, Linux CPU"
    assert engines[-1].startswith("PyTorch") and "CPU" in engines[-1]
    for r in res["rows"]:
        assert r["decode_tokens"] == 4 and r["decode_tokens_per_s"] > 0 and r["prefill_tokens"] == 16
        assert r["decode_p95_ms"] >= r["decode_median_ms"] > 0


@pytest.mark.extra("coreai")
def test_latency_on_macos_runs_one_row_per_compute_unit(exported, monkeypatch):
    """The macOS path, with a fake Session: one row per unit, a failing unit is a row with its error."""
    from mpsconvert.apple.coreai import coreai_check as cc

    art, _, _ = exported["llama"]
    seen = []

    class FakeSession:
        def __init__(self, path, unit=None):
            if unit == "neural_engine":
                raise ExportError("the Neural Engine refused the model for the test")
            seen.append(unit)
            self.signature = {"states": {"key_cache_0": ("float32", [1, 2, 64, 16])}}

        def __enter__(self):
            return self

        def __exit__(self, *a):
            pass

        def new_state(self):
            return {}

        def run(self, inputs, state):
            return {"logits": np.zeros((1, inputs["input_ids"].shape[1], 8), dtype=np.float32)}

    monkeypatch.setattr(cc, "Session", FakeSession)
    res = coreai_latency(art, _record(art), prefill_len=8, decode_tokens=2, warmup=0, platform="darwin")
    assert seen == ["cpu", "gpu"]
    rows = {r["engine"]: r for r in res["rows"]}
    assert "decode_tokens_per_s" in rows["Core AI runtime, gpu (macOS)"]
    assert "Neural Engine refused" in rows["Core AI runtime, neural_engine (macOS)"]["error"]


@pytest.mark.extra("coreai")
def test_cli_quantize_coreai_and_check_only(work):
    from click.testing import CliRunner

    from mpsconvert.cli import main

    src = work / "src-llama-cli"
    tiny("llama", src, tokenizer="bpe", dtype=torch.bfloat16, tie=True, seed=4)
    out = work / "art-llama-cli"
    r = CliRunner().invoke(main, ["quantize", str(src), "-o", str(out), "--coreai", "--max-len", "96"])
    assert r.exit_code == 0, r.output
    assert "Core AI runtime, Linux CPU" in r.output or not sys.platform.startswith("linux")
    assert (out / ASSET_NAME).is_dir() and Manifest.read(out).extra["coreai"]["check"]["ok"] is True
    r = CliRunner().invoke(main, ["export-coreai", str(out), "--check-only", "--json", "--decode-steps", "8"])
    assert r.exit_code == 0, r.output
    body = json.loads(r.output)
    assert (
        body["check"]["weights"]["codes_bit_exact"] is True
        and body["check"]["runtime_eval"]["decode"]["positions"] == 8
    )
    r = CliRunner().invoke(main, ["export-coreai", str(out)])
    assert r.exit_code == 2 and "--force" in r.output


@pytest.mark.extra("coreai")
def test_validate_runs_the_core_ai_latency_beside_pytorch(exported, work):
    """`validate` on an artifact with an asset: the Core AI rows come with the PyTorch ones, are
    recorded, and the CLI prints them (on macOS the Core ML part would run; here it says why not)."""
    from click.testing import CliRunner

    import mpsconvert
    from mpsconvert.cli import main

    art, _, _ = exported["llama"]
    opts = mpsconvert.validate_options(
        baseline=str(work / "src-llama"),
        device="cpu",
        seq_len=32,
        max_samples=1,
        prefill_len=16,
        decode_tokens=4,
        repeats=2,
        warmup=1,
    )
    res = mpsconvert.validate(art, options=opts)
    assert res.coreai["status"] == "ran" and res.coreml is None
    engines = [r["engine"] for r in res.coreai["rows"]]
    assert engines[-1].startswith("PyTorch") and (
        engines[0] == "Core AI runtime, Linux CPU" or not sys.platform.startswith("linux")
    )
    assert all(r["decode_tokens"] == 4 for r in res.coreai["rows"])
    assert Manifest.read(art).extra["coreai_runtime"]["rows"][0]["engine"] == engines[0]
    r = CliRunner().invoke(
        main,
        [
            "validate",
            str(art),
            "--baseline",
            str(work / "src-llama"),
            "--device",
            "cpu",
            "--seq-len",
            "32",
            "--max-samples",
            "1",
            "--prefill-len",
            "16",
            "--decode-tokens",
            "2",
            "--repeats",
            "1",
            "--warmup",
            "1",
            "--no-write",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "Core AI asset: latency beside PyTorch" in r.output and "same prompt for every row" in r.output


@pytest.mark.extra("coreai")
def test_validate_without_warmup_or_repeats_gives_the_core_ai_part_the_runs_own_settings(exported, work, monkeypatch):
    """Without --warmup and --repeats (their defaults depend on the device), the Core AI part used
    to get None and crash after the whole PyTorch run; it now gets what the run resolved."""
    from click.testing import CliRunner

    import mpsconvert.apple.coreai.coreai_check as check
    from mpsconvert.cli import main

    art, _, _ = exported["llama"]
    seen, real = [], check.coreai_latency

    def spy(*a, **k):
        seen.append(k)
        return real(*a, **k)

    monkeypatch.setattr(check, "coreai_latency", spy)
    r = CliRunner().invoke(
        main,
        [
            "validate",
            str(art),
            "--baseline",
            str(work / "src-llama"),
            "--device",
            "cpu",
            "--seq-len",
            "32",
            "--max-samples",
            "1",
            "--prefill-len",
            "16",
            "--decode-tokens",
            "2",
            "--rounds",
            "1",
            "--json",
        ],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["settings"]["warmup"] == 1 and res["settings"]["repeats"] == 2  # CPU defaults, resolved by the run
    assert seen[0]["warmup"] == 1 and seen[0]["prefill_repeats"] == 2 and res["coreai"]["status"] == "ran"


@pytest.mark.extra("coreai")
def test_a_failing_core_ai_part_keeps_the_validation_recorded_and_shown(exported, work, monkeypatch):
    from click.testing import CliRunner

    import mpsconvert
    import mpsconvert.apple.coreai.coreai_check as check
    from mpsconvert.cli import main

    art, _, _ = exported["llama"]
    args = [
        "validate",
        str(art),
        "--baseline",
        str(work / "src-llama"),
        "--device",
        "cpu",
        "--seq-len",
        "32",
        "--max-samples",
        "1",
        "--prefill-len",
        "16",
        "--decode-tokens",
        "2",
        "--rounds",
        "1",
        "--repeats",
        "1",
        "--warmup",
        "0",
    ]
    with transaction(art) as t:
        t.drop(Validation)

    def broken(*a, **k):
        raise ExportError("the Core AI runtime refused the asset", "re-export it")

    monkeypatch.setattr(check, "coreai_latency", broken)
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert "perplexity" in r.output and "recorded in" in r.output  # the PyTorch table came first
    assert (
        r.output.strip().splitlines()[-1].startswith("error: validation results for")
        and "Core AI part failed" in r.output
    )
    m = Manifest.read(art)
    assert (
        m.extra["validation"] and "Not validated yet" not in (art / "README.md").read_text()
    )  # recorded, card refreshed
    assert mpsconvert.verify(art).ok

    def bug(*a, **k):
        raise ZeroDivisionError("a bug in the Core AI part")

    monkeypatch.setattr(check, "coreai_latency", bug)
    with transaction(art) as t:
        t.drop(Validation)
    r = CliRunner().invoke(main, args)
    assert isinstance(r.exception, ZeroDivisionError)  # a bug keeps its traceback...
    assert (
        "perplexity" in r.output and Manifest.read(art).extra["validation"]
    )  # ...after the results were recorded and shown
