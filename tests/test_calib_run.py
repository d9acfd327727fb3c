"""Calibration runs end to end: sequential == whole model, MoE experts, the static artifact."""

import json
import math
from functools import partial

import pytest
import torch
from click.testing import CliRunner

import mpsconvert
from mpsconvert.calibrate.calibration import CalibOptions, calibrate
from mpsconvert.cli import main
from mpsconvert.model.plan import plan_for

from .models import TEXT_DATA, tiny

pytestmark = pytest.mark.core  # CI's floor lane runs these on the lowest torch and transformers

CALIB = str(TEXT_DATA / "wiki_calib.jsonl")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # Sharded and with tied embeddings: the sequential loader has to find tensors across files.
    return tiny("llama", tmp_path_factory.mktemp("m") / "llama", tokenizer="minilm", max_shard_size="2MB", tie=True)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return tiny("bert", tmp_path_factory.mktemp("m") / "bert", tokenizer="minilm", max_positions=128)


@pytest.mark.parametrize("observer", ["minmax", "mse"])
@pytest.mark.parametrize("which", ["llama", "bert"])
def test_sequential_gives_the_same_scales_as_the_whole_model(request, which, observer):
    path = request.getfixturevalue(which)
    opts = dict(data=CALIB, num_samples=6, seq_len=48, observer=observer, device="cpu")
    whole = calibrate(path, CalibOptions(**opts))
    seq = calibrate(path, CalibOptions(sequential=True, **opts))
    assert whole.record["mode"] == "whole-model" and seq.record["mode"] == "sequential"
    assert seq.record["weights_loader"] == ["direct"]  # names match: no conversion path
    assert set(whole.scales) == set(plan_for(path).quantize)  # every quantized Linear has a scale
    assert seq.scales == whole.scales  # bit for bit: same inputs, same ops
    assert {m: r["values"] for m, r in seq.record["modules"].items()} == {
        m: r["values"] for m, r in whole.record["modules"].items()
    }
    if which == "bert":
        assert "pooler.dense" in seq.scales  # observed in the replay pass after the blocks


def test_sequential_peak_is_about_one_block(llama, monkeypatch):
    """Only one block's weights are ever materialised at a time."""
    from mpsconvert.calibrate import calibration as run

    live, peak = set(), [0]
    real_mat, real_unload = run._materialize, run._unload

    def mat(module, prefix, *a, **k):
        live.add(prefix)
        peak[0] = max(peak[0], len(live))
        return real_mat(module, prefix, *a, **k)

    def unload(module):
        live.clear()
        return real_unload(module)

    monkeypatch.setattr(run, "_materialize", mat)
    monkeypatch.setattr(run, "_unload", unload)
    cal = calibrate(llama, CalibOptions(data=CALIB, num_samples=2, seq_len=32, sequential=True, device="cpu"))
    assert peak[0] == 1 and len(cal.scales) == 14


@pytest.mark.parametrize(
    "builder",
    [
        partial(tiny, "mixtral", tokenizer="minilm", experts=16, top_k=1),
        partial(tiny, "qwen2_moe", tokenizer="minilm", experts=16, top_k=1),
    ],
)
def test_moe_never_routed_experts_get_valid_scales_and_a_warning(tmp_path, builder, caplog):
    path = builder(tmp_path / "moe", experts=16)
    # One short sample, top-1 routing over 16 experts: most experts never see a token.
    cal = calibrate(path, CalibOptions(data=CALIB, num_samples=1, seq_len=16, device="cpu", observer="mse"))
    plan = plan_for(path)
    assert set(cal.scales) == set(plan.quantize)
    assert all(math.isfinite(s) and s > 0 for s in cal.scales.values())
    assert cal.record["experts"], "the fused experts modules were observed"
    for name, rec in cal.record["experts"].items():
        never = rec["never_routed"]
        assert never and sum(rec["tokens_per_expert"]) == 16  # top-1: each token goes to one expert
        for proj in ("gate_up_proj", "down_proj"):
            per = cal.expert_scales[name][proj]
            assert len(per) == 16 and all(math.isfinite(s) and s > 0 for s in per)
            routed = [per[e] for e in range(16) if e not in never]
            assert all(per[e] == max(routed) for e in never)  # the documented fallback
        assert any(name in w and str(never) in w for w in cal.warnings)
    json.dumps(cal.record, allow_nan=False)  # no NaN anywhere in what the manifest records
    # transformers 5 stores experts per expert in the checkpoint and fuses them on load: the
    # sequential loader goes through transformers' conversion and still matches bit for bit.
    seq = calibrate(
        path, CalibOptions(data=CALIB, num_samples=1, seq_len=16, device="cpu", observer="mse", sequential=True)
    )
    assert seq.record["weights_loader"] == ["transformers-conversion"]
    assert seq.scales == cal.scales and seq.expert_scales == cal.expert_scales


def test_unobserved_expert_linear_falls_back_to_its_siblings():
    from mpsconvert.calibrate import observers
    from mpsconvert.calibrate.calibration import _finalize
    from mpsconvert.model.plan import Plan

    plan = Plan(
        "X",
        quantize={f"m.layers.0.mlp.experts.{e}.w1": (4, 4) for e in range(3)}
        | {"m.layers.0.attn.q": (4, 4), "m.unused": (4, 4)},
    )
    obs = {}
    for name, v in (
        ("m.layers.0.mlp.experts.0.w1", 2.0),
        ("m.layers.0.mlp.experts.1.w1", 3.0),
        ("m.layers.0.attn.q", 5.0),
    ):
        obs[name] = observers.Observer()
        obs[name].update(torch.tensor([v]))
    obs["m.unused"] = observers.Observer()  # hooked, never called
    scales, modules, fallbacks = _finalize(plan, obs)
    assert scales["m.layers.0.mlp.experts.2.w1"] == pytest.approx(3.0 / 448)  # max over sibling experts
    assert scales["m.unused"] == pytest.approx(5.0 / 448)  # max over every observed Linear
    assert set(fallbacks) == {"m.layers.0.mlp.experts.2.w1", "m.unused"}


def _run(args):
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    return r


def _files(folder):
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            b = p.read_bytes()
            if p.name == "mpsconvert.json":
                body = json.loads(b)
                body.pop("created")
                b = json.dumps(body).encode()
            out[p.relative_to(folder).as_posix()] = b
    return out


@pytest.mark.extra("ct")
def test_static_artifact_is_deterministic_loads_with_compressed_tensors_and_matches(llama, tmp_path):
    calibration = mpsconvert.calibration_options(data=CALIB, num_samples=4, seq_len=64, observer="mse")
    for out in ("a", "b/a"):  # folders of the same name: the card's commands name it
        res = mpsconvert.quantize(llama, tmp_path / out, scheme="fp8", calibration=calibration, force=True)
        assert res.calibration.record["observer"] == "mse" and res.output == tmp_path / out
    assert _files(tmp_path / "a") == _files(tmp_path / "b" / "a")  # same seed, same bytes

    m = json.loads((tmp_path / "a" / "mpsconvert.json").read_text())
    cal = m["recipe"]["calibration"]
    assert cal["device"] == "cpu" and cal["observer"] == "mse" and cal["num_samples"] == 4 and len(cal["drawn"]) == 4
    assert len(cal["data"]["sha256"]) == 64 and m["device"] == "cpu"
    qc = json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert qc["input_activations"]["strategy"] == "tensor" and qc["input_activations"]["dynamic"] is False
    assert qc["weights"]["strategy"] == "tensor"

    from transformers import AutoModelForCausalLM

    from mpsconvert.format import fp8

    ids = torch.randint(0, 30000, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = AutoModelForCausalLM.from_pretrained(str(llama)).eval()
    q = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a")).eval()
    lin = q.model.layers[0].self_attn.q_proj
    assert float(lin.input_scale.detach()) == pytest.approx(
        m["tensors"]["model.layers.0.self_attn.q_proj.weight"]["input_scale"]
    )
    with torch.no_grad():
        a, b = ref(ids).logits, q(ids).logits
        # Our own simulation of W8A8 static (FP8 weights, inputs round-tripped through e4m3 at the
        # stored scale) must agree with what compressed-tensors ran: it did apply the scales.
        handles = []
        sim = AutoModelForCausalLM.from_pretrained(str(llama)).eval()
        from safetensors.torch import load_file

        st = {}
        for f in (tmp_path / "a").glob("*.safetensors"):
            st.update(load_file(str(f)))
        for name, mod in sim.named_modules():
            if name + ".input_scale" in st:
                mod.weight.copy_(fp8.dequantize(st[name + ".weight"], st[name + ".weight_scale"], torch.float32))
                s = st[name + ".input_scale"]
                handles.append(mod.register_forward_pre_hook(lambda _m, args, s=s: (fp8.fake_quantize(args[0], s),)))
        c = sim(ids).logits
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cos > 0.995  # matches the source closely
    assert torch.allclose(b, c, atol=1e-4, rtol=1e-4)


def test_calibrate_into_an_artifact_and_via_a_scales_file(llama, tmp_path):
    dyn = tmp_path / "dyn"
    mpsconvert.quantize(llama, dyn)
    before = json.loads((dyn / "mpsconvert.json").read_text())
    res = mpsconvert.calibrate(dyn, options=mpsconvert.calibration_options(data=CALIB, num_samples=3, seq_len=32))
    assert res.into_artifact and res.written_to == dyn
    after = json.loads((dyn / "mpsconvert.json").read_text())
    assert after["recipe"]["name"] == "fp8" and after["recipe"]["weights"] == "row"
    assert after["recipe"]["calibration"]["weights"] == "the artifact's FP8 weights, dequantized"
    from mpsconvert.infra.safetensors_io import read_header
    from mpsconvert.manifests.hashing import sha256_file

    for f, rec in after["files"].items():
        assert sha256_file(dyn / f) == rec["sha256"]  # every hash updated
    names = set()
    for f in dyn.glob("*.safetensors"):
        names |= set(read_header(f).tensors)
    for t in before["tensors"]:
        assert t[: -len("weight")] + "input_scale" in names
    index = json.loads((dyn / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == names
    qc = json.loads((dyn / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert qc["input_activations"]["dynamic"] is False and qc["weights"]["strategy"] == "channel"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mpsconvert-tmp")]

    scales = tmp_path / "scales.json"
    mpsconvert.calibrate(
        llama, scales, options=mpsconvert.calibration_options(data=CALIB, num_samples=3, seq_len=32, sequential=True)
    )
    body = json.loads(scales.read_text())
    mpsconvert.quantize(llama, tmp_path / "s", scheme="fp8", scales_file=scales)
    m = json.loads((tmp_path / "s" / "mpsconvert.json").read_text())
    assert m["recipe"]["calibration"]["mode"] == "sequential"
    assert {rec["module"]: rec["input_scale"] for rec in m["tensors"].values()} == body["input_scales"]


def test_builtin_default_and_cli_errors(bert, tmp_path):
    r = _run(
        ["quantize", str(bert), "--scheme", "fp8", "--num-samples", "2", "--seq-len", "32", "-o", str(tmp_path / "o")]
    )
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "o" / "mpsconvert.json").read_text())
    assert m["recipe"]["calibration"]["data"]["kind"] == "builtin"
    said = " ".join(r.output.split())
    assert "tokens of the built-in text in" in said and "warning" not in said  # 2 windows of 32: the text sufficed
    r = _run(["calibrate", str(bert), "-o", str(tmp_path / "big.json"), "--num-samples", "500", "--seq-len", "128"])
    said = " ".join(r.output.split())  # more than the built-in set holds: said on the summary line, not warned
    assert r.exit_code == 0 and "of the built-in text (all it gives at this --seq-len; --calib-data for more" in said
    assert "warning" not in said
    r = _run(["quantize", str(bert), "--calib-data", CALIB, "-o", str(tmp_path / "x")])
    assert r.exit_code == 2 and "only apply to --scheme fp8" in r.output
    r = _run(["calibrate", str(bert)])
    assert r.exit_code == 2 and "pass -o scales.json" in r.output
    r = _run(["calibrate", str(bert), "-o", str(tmp_path / "s.json"), "--device", "mps"])
    assert r.exit_code == 2 and "mps" in r.output
    r = _run(["calibrate", str(bert), "-o", str(tmp_path / "s.json"), "--seq-len", "4096"])
    assert r.exit_code == 2 and "--seq-len 128 or less" in r.output
    assert not (tmp_path / "s.json").exists() and not (tmp_path / "x").exists()
