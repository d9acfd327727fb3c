"""validate: metrics against direct computation, then the whole command on tiny models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import mpsconvert
from mpsconvert.cli import main
from mpsconvert.infra import timing
from mpsconvert.manifests.manifest import Manifest
from mpsconvert.runtime.evaluate import metrics
from mpsconvert.runtime.evaluate.validate import ValidateOptions

from .models import TEXT_DATA, tiny

pytestmark = pytest.mark.core  # CI's floor lane runs these on the lowest torch and transformers


def _softmax(row):
    e = np.exp(row - row.max())
    return e / e.sum()


def test_causal_metrics_match_direct_computation():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 7, 11, generator=g) * 3
    test = base + torch.randn(2, 7, 11, generator=g) * 0.5
    ids = torch.randint(0, 11, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0  # padding at the end of the second row
    s = metrics.CausalLMScores()
    s.update(base, test, ids, mask)
    r = s.result()
    nll_b = nll_t = kl = agree = n = 0.0
    for b in range(2):
        for t in range(6):
            if not (mask[b, t] and mask[b, t + 1]):
                continue
            p, q = _softmax(base[b, t].double().numpy()), _softmax(test[b, t].double().numpy())
            y = int(ids[b, t + 1])
            nll_b -= math.log(p[y])
            nll_t -= math.log(q[y])
            kl += float((p * np.log(p / q)).sum())
            agree += int(p.argmax() == q.argmax())
            n += 1
    assert r["tokens"] == n == 6 + 4
    assert r["perplexity_bf16"] == pytest.approx(math.exp(nll_b / n), rel=1e-9)
    assert r["perplexity_fp8"] == pytest.approx(math.exp(nll_t / n), rel=1e-9)
    assert r["perplexity_delta"] == pytest.approx(math.exp(nll_t / n) - math.exp(nll_b / n), rel=1e-9)
    assert r["mean_kl"] == pytest.approx(kl / n, rel=1e-9)
    assert r["top1_agreement"] == pytest.approx(agree / n)
    same = metrics.CausalLMScores()
    same.update(base, base, ids)
    assert same.result()["mean_kl"] == pytest.approx(0.0, abs=1e-12) and same.result()["top1_agreement"] == 1.0


def test_mean_pool_cosine_and_latency_stats():
    h = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    pooled = metrics.mean_pool(h, m)
    assert torch.equal(pooled[0], (h[0, 0] + h[0, 1]) / 2) and torch.equal(pooled[1], h[1, 0])
    a, b = torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[0.0, 1.0], [2.0, 2.0]])
    assert metrics.cosine(a, b).tolist() == pytest.approx([0.0, 1.0])
    st = timing.stats([0.003, 0.001, 0.002, 0.010])
    assert st["median_ms"] == pytest.approx(2.5) and st["p95_ms"] == pytest.approx(10.0) and st["n"] == 4
    st = timing.stats([0.001 * i for i in range(1, 21)])  # nearest-rank p95 of 1..20 ms is 19 ms
    assert st["p95_ms"] == pytest.approx(19.0) and st["median_ms"] == pytest.approx(10.5)


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rt-val")
    llama = tiny("llama", root / "llama", tokenizer="bpe", dtype=torch.bfloat16, tie=True)
    bert = tiny("bert", root / "bert", tokenizer="bpe", dtype=torch.bfloat16)
    mpsconvert.quantize(llama, root / "llama-fp8")
    mpsconvert.quantize(bert, root / "bert-fp8")
    return root


def _direct_scores(arts, seq_len, n):
    """The same numbers computed here directly from the two models' logits."""
    import transformers

    from mpsconvert.runtime.load.loader import load

    tok = transformers.AutoTokenizer.from_pretrained(arts / "llama-fp8")
    base = transformers.AutoModelForCausalLM.from_pretrained(arts / "llama", dtype=torch.bfloat16)
    fp8m = load(arts / "llama-fp8", device="cpu")
    ids = []
    for line in (TEXT_DATA / "wiki_eval.jsonl").read_text().splitlines():
        ids += tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        if len(ids) >= seq_len * n:
            break
    x = torch.tensor(ids[: seq_len * n]).reshape(n, seq_len)
    with torch.no_grad():
        lb, lf = base(x).logits.double(), fp8m(x).logits.double()
    lpb, lpf = lb.log_softmax(-1)[:, :-1], lf.log_softmax(-1)[:, :-1]
    y = x[:, 1:, None]
    return {
        "perplexity_bf16": float((-lpb.gather(-1, y)).mean().exp()),
        "perplexity_fp8": float((-lpf.gather(-1, y)).mean().exp()),
        "mean_kl": float((lpb.exp() * (lpb - lpf)).sum(-1).mean()),
        "top1_agreement": float((lb.argmax(-1) == lf.argmax(-1))[:, :-1].double().mean()),
    }


def test_validate_causal_lm_against_direct_computation(arts, tmp_path):
    opts = ValidateOptions(
        baseline=str(arts / "llama"),
        eval_data=str(TEXT_DATA / "wiki_eval.jsonl"),
        device="cpu",
        seq_len=64,
        max_samples=3,
        prefill_len=32,
        decode_tokens=3,
        repeats=2,
        rounds=2,
        warmup=1,
        write=True,
        kernel_cache=False,
    )
    phases = []
    r = mpsconvert.validate(
        arts / "llama-fp8", options=opts, progress=lambda p, d, t, detail: phases.append(p)
    ).as_dict()
    direct = _direct_scores(arts, 64, 3)
    for k, v in direct.items():
        assert r["accuracy"][k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert r["accuracy"]["tokens"] == 3 * 63 and 0 < r["accuracy"]["mean_kl"] < 0.05
    lat = r["latency"]
    for name in ("bf16", "fp8"):
        assert lat[name]["prefill"]["n"] == 4 and lat[name]["prefill"]["tokens"] == 32  # 2 rounds of 2
        assert len(lat[name]["prefill"]["round_medians_ms"]) == 2 and lat[name]["prefill"]["spread"] >= 0
        assert lat[name]["decode"]["tokens"] == 6 and lat[name]["decode"]["median_ms"] <= lat[name]["decode"]["p95_ms"]
    v = r["verdict"]["decode"]
    assert v["ratio"] == pytest.approx(r["speedup"]["decode"]) and v["verdict"] in (
        "faster",
        "slower",
        "no clear difference",
    )
    assert (v["verdict"] == "no clear difference") == (1 / (1 + v["spread"]) <= v["ratio"] <= 1 + v["spread"])
    assert r["speedup"]["decode"] == pytest.approx(
        lat["bf16"]["decode"]["median_ms"] / lat["fp8"]["decode"]["median_ms"]
    )
    assert {"accuracy", "latency"} <= set(phases)
    recorded = Manifest.read(arts / "llama-fp8").extra["validation"]["CPU (cpu)"]
    assert (
        recorded["accuracy"] == r["accuracy"] and recorded["settings"]["seq_len"] == 64 and recorded["device"] == "cpu"
    )


def test_validate_records_everything_in_one_transaction(arts, monkeypatch):
    """The run and every Apple part are written together: one manifest transaction per validate."""
    import contextlib

    import mpsconvert.manifests.transaction as transaction

    opened, real = [], transaction.transaction

    @contextlib.contextmanager
    def counted(*a, **k):
        opened.append(a[0])
        with real(*a, **k) as t:
            yield t

    monkeypatch.setattr(transaction, "transaction", counted)
    opts = ValidateOptions(
        baseline=str(arts / "llama"),
        eval_data=str(TEXT_DATA / "wiki_eval.jsonl"),
        device="cpu",
        seq_len=32,
        max_samples=1,
        latency=False,
        kernel_cache=False,
    )
    r = mpsconvert.validate(arts / "llama-fp8", options=opts)
    assert len(opened) == 1 and r.recorded == str(arts / "llama-fp8" / "mpsconvert.json")
    assert Manifest.read(arts / "llama-fp8").extra["validation"]["CPU (cpu)"]["settings"]["seq_len"] == 32


def test_verdict_only_beyond_the_measured_spread():
    def timed(*rounds):
        return timing.round_stats([[x / 1e3 for x in r] for r in rounds])

    base = timed([10.0, 10.2], [10.1, 10.3], [9.9, 10.0])  # round medians 10.1, 10.2, 9.95: spread 2.5%
    assert base["round_medians_ms"] == pytest.approx([9.95, 10.1, 10.2]) and base["spread"] == pytest.approx(
        0.25 / 10.1
    )
    fast = timed([5.0], [5.05], [4.95])
    assert timing.verdict(base, fast)["verdict"] == "faster" and timing.verdict(fast, base)["verdict"] == "slower"
    noisy = timed([8.0], [14.0], [10.0])  # spread 60%: a 1.1x ratio says nothing
    v = timing.verdict(base, noisy)
    assert (
        v["verdict"] == "no clear difference"
        and v["spread"] == pytest.approx(0.6)
        and v["ratio"] == pytest.approx(1.01, abs=0.01)
    )
    assert timing.verdict(base, timed([10.05], [10.1], [10.0]))["verdict"] == "no clear difference"
    one = timing.round_stats([[0.010, 0.012, 0.011]])  # one round: its samples' range stands in
    assert one["spread"] == pytest.approx(0.002 / 0.011)


def test_validate_encoder_embedding_cosine(arts):
    import transformers

    from mpsconvert.runtime.load.loader import load

    opts = ValidateOptions(
        baseline=str(arts / "bert"),
        eval_data=str(TEXT_DATA / "wiki_eval.jsonl"),
        device="cpu",
        max_samples=1,
        latency=False,
        write=False,
    )
    r = mpsconvert.validate(arts / "bert-fp8", options=opts).as_dict()
    assert r["kind"] == "encoder" and r["accuracy"]["sentences"] == 8
    tok = transformers.AutoTokenizer.from_pretrained(arts / "bert-fp8")
    base = transformers.AutoModel.from_pretrained(arts / "bert", dtype=torch.bfloat16)
    fp8m = load(arts / "bert-fp8", device="cpu")
    texts = [json.loads(l)["text"] for l in (TEXT_DATA / "wiki_eval.jsonl").read_text().splitlines()]
    sents = [s.strip() for t in texts for s in t.split(". ") if len(s.strip()) > 20][:8]
    batch = tok(sents, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():

        def emb(m):
            h = m(**batch).last_hidden_state.double()
            w = batch["attention_mask"][..., None].double()
            return (h * w).sum(1) / w.sum(1)

        cos = torch.nn.functional.cosine_similarity(emb(base), emb(fp8m), dim=-1)
    assert r["accuracy"]["cosine_mean"] == pytest.approx(float(cos.mean()), abs=2e-3)
    assert 0.9 < r["accuracy"]["cosine_min"] <= r["accuracy"]["cosine_mean"] <= 1.0


def test_cli_validate_json_explain_and_errors(arts):
    runner = CliRunner()
    args = [
        "validate",
        str(arts / "llama-fp8"),
        "--baseline",
        str(arts / "llama"),
        "--eval-data",
        str(TEXT_DATA / "wiki_eval.jsonl"),
        "--device",
        "cpu",
        "--seq-len",
        "32",
        "--max-samples",
        "2",
        "--no-latency",
        "--no-write",
    ]
    res = runner.invoke(main, args + ["--json"])
    assert res.exit_code == 0, res.output
    body = json.loads(res.stdout)
    assert body["kind"] == "causal-lm" and body["accuracy"]["tokens"] == 62 and "latency" not in body
    res = runner.invoke(main, args + ["--explain"])
    assert res.exit_code == 0, res.output
    assert (
        "perplexity" in res.stdout
        and "top-1 agreement" in res.stdout
        and "kernel policy" in res.stdout
        and "dense_qact" in res.stdout
    )
    ar = body["accuracy"]["activations_rounded"]  # CPU's dense_qact rounds every layer's activations as the scheme says
    assert ar["rows"] == 32 and ar["layers"] == ar["rounded"] > 0 and ar["bf16_activation_kernels"] == []
    assert "with BF16 activations" not in res.stdout
    # on CPU the FP8 weights are held dequantized: the table's "weights in memory" (about 1x) is explained under it
    assert body["weights_held"]["e4m3"] == 0 and body["weights_held"]["dequantized"] > 0
    said = " ".join(res.stdout.split())
    assert (
        "note: CPU: every FP8 weight is dequantized to bfloat16 once at load" in said
        and "as much memory as bfloat16" in said
    )
    llmc = Path(__file__).parent / "data" / "llmc" / "oneshot"  # no manifest: its source is unknown
    res = runner.invoke(
        main, ["validate", str(llmc), "--device", "cpu", "--eval-data", str(TEXT_DATA / "wiki_eval.jsonl")]
    )
    assert res.exit_code == 2 and "pass --baseline" in res.output
    res = runner.invoke(main, args[:4] + ["--eval-data", "/nonexistent.jsonl", "--device", "cpu"])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_layers_run_without_activation_rounding_are_said(arts, monkeypatch):
    """A kernel that reads BF16 activations (dequant on a device without FP8 matmul; here CPU's
    `bf16` forced) computes weight-only arithmetic for a dynamic scheme: validate counts those
    layers beside its accuracy and says so under the table."""
    from mpsconvert.runtime.ops import kernels

    args = [
        "validate",
        str(arts / "llama-fp8"),
        "--baseline",
        str(arts / "llama"),
        "--eval-data",
        str(TEXT_DATA / "wiki_eval.jsonl"),
        "--device",
        "cpu",
        "--seq-len",
        "32",
        "--max-samples",
        "2",
        "--no-latency",
        "--no-write",
    ]
    rounded = json.loads(CliRunner().invoke(main, args + ["--json"]).stdout)["accuracy"]
    monkeypatch.setattr(kernels, "candidates", lambda *a, **k: ["bf16"])
    body = json.loads(CliRunner().invoke(main, args + ["--json"]).stdout)["accuracy"]
    ar = body["activations_rounded"]
    assert (
        ar["rounded"] == 0
        and ar["layers"] == rounded["activations_rounded"]["layers"]
        and ar["bf16_activation_kernels"] == ["bf16"]
    )
    assert body["mean_kl"] < rounded["mean_kl"]  # without the activations' rounding the model is closer to BF16
    said = " ".join(CliRunner().invoke(main, args).stdout.split())
    assert (
        f"ran {ar['layers']} of {ar['layers']} FP8 layers with BF16 activations (bf16, as the kernel policy chose)"
        in said
    )


def test_encoder_latency_is_one_sequence_of_prefill_len(arts):
    opts = ValidateOptions(
        baseline=str(arts / "bert"),
        eval_data=str(TEXT_DATA / "wiki_eval.jsonl"),
        device="cpu",
        max_samples=1,
        prefill_len=48,
        repeats=2,
        rounds=2,
        warmup=1,
        write=False,
        kernel_cache=False,
    )
    r = mpsconvert.validate(arts / "bert-fp8", options=opts).as_dict()
    for name in ("bf16", "fp8"):
        assert r["latency"][name]["prefill"]["tokens"] == 48 and r["latency"][name]["prefill"]["n"] == 4
    assert set(r["verdict"]) == {"prefill"} and r["verdict"]["prefill"]["ratio"] == pytest.approx(
        r["speedup"]["prefill"]
    )


def test_a_model_of_fewer_positions_than_prefill_len_times_a_shorter_prompt(arts):
    """The full --prefill-len (512) on a model of 256 positions: the engine's cache cannot hold
    it, so the timed prompt is cut to what fits beside the decode steps, and the result says how
    long it was (before this, `validate` with its defaults refused such a model)."""
    from transformers import AutoConfig

    positions = AutoConfig.from_pretrained(arts / "llama").max_position_embeddings
    opts = ValidateOptions(
        baseline=str(arts / "llama"),
        eval_data=str(TEXT_DATA / "wiki_eval.jsonl"),
        device="cpu",
        seq_len=64,
        max_samples=1,
        decode_tokens=3,
        repeats=1,
        rounds=1,
        warmup=1,
        write=False,
        kernel_cache=False,
        full=True,
    )
    assert 512 > positions
    r = mpsconvert.validate(arts / "llama-fp8", options=opts).as_dict()
    for name in ("bf16", "fp8"):
        assert r["latency"][name]["prefill"]["tokens"] == positions - (1 + 3 + 2)


def test_cpu_defaults_are_the_quick_ones_and_the_table_says_so(arts):
    """On CPU, options not given take the quick defaults (fewer, shorter samples); --full takes
    the GPU's sizes; an option given wins over either."""
    from mpsconvert.runtime.evaluate.validate import DEFAULTS, with_defaults

    quick = with_defaults(ValidateOptions(), gpu=False)
    assert (quick.seq_len, quick.max_samples, quick.prefill_len, quick.decode_tokens) == (256, 4, 128, 16)
    full = with_defaults(ValidateOptions(full=True, seq_len=64), gpu=False)
    assert (full.seq_len, full.max_samples, full.prefill_len, full.rounds) == (64, 8, 512, 3)
    assert with_defaults(ValidateOptions(), gpu=True).repeats == DEFAULTS["gpu"]["repeats"] == 10
    args = [
        "validate",
        str(arts / "llama-fp8"),
        "--baseline",
        str(arts / "llama"),
        "--eval-data",
        str(TEXT_DATA / "wiki_eval.jsonl"),
        "--device",
        "cpu",
        "--no-latency",
        "--no-write",
    ]
    res = CliRunner().invoke(main, args + ["--json"])
    assert res.exit_code == 0, res.output
    body = json.loads(res.stdout)
    assert (
        body["settings"]["defaults"] == "cpu"
        and body["settings"]["seq_len"] == 256
        and body["accuracy"]["tokens"] == 4 * 255
    )
    said = " ".join(CliRunner().invoke(main, args).stdout.split())
    assert "note: CPU's quick defaults: 4 accuracy samples of 256 tokens (--full: 8 of 512" in said
