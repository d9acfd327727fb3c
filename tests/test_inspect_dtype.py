"""`inspect` reads as a summary (validation and export rows, the source as id@commit or its
path); `quantize --dtype` converts the tensors that stay unquantized."""

import json

import torch
from click.testing import CliRunner
from safetensors import safe_open

import mpsconvert
from mpsconvert.cli import main
from mpsconvert.runtime.evaluate.validate import ValidateOptions

from . import models


def test_inspect_summarises_validation_and_names_the_source(tmp_path, text_data, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setenv("COLUMNS", "400")  # one table row per line, for the assertions
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))  # a snapshot in huggingface_hub's cache keeps its provenance
    src = models.tiny(
        "llama",
        tmp_path / "models--org--tiny" / "snapshots" / ("ab" * 20),
        tokenizer="bpe",
        dtype=torch.bfloat16,
        tie=True,
    )
    art = mpsconvert.quantize(src, tmp_path / "a").output
    opts = ValidateOptions(
        device="cpu",
        max_samples=1,
        seq_len=64,
        prefill_len=16,
        decode_tokens=2,
        repeats=1,
        rounds=1,
        warmup=0,
        eval_data=str(text_data / "wiki_eval.jsonl"),
        kernel_cache=False,
    )
    r = mpsconvert.validate(art, options=opts)
    res = CliRunner().invoke(main, ["inspect", str(art)])
    assert res.exit_code == 0, res.output
    assert f"{src} (local folder, org/tiny@abababababab)" in res.output
    (line,) = [ln for ln in res.output.splitlines() if ln.strip().startswith("validation")]
    a = r.accuracy
    assert f"ppl {a['perplexity_bf16']:.3f} -> {a['perplexity_fp8']:.3f}" in line and f"KL {a['mean_kl']:.5f}" in line
    v = r.verdict["decode"]  # the run's verdict, not the bare ratio (which may lie inside the noise)
    said = (
        f"decode no clear difference ({v['ratio']:.2f}x"
        if v["verdict"] == "no clear difference"
        else f"decode {v['ratio']:.2f}x {v['verdict']}"
    )
    assert f"top-1 {100 * a['top1_agreement']:.2f}%" in line and said in line and "cpu" in line
    assert '{"' not in res.output  # no raw JSON cut off mid-string


def test_dtype_converts_the_unquantized_tensors(tmp_path):
    src = models.tiny("llama", tmp_path / "src")  # float32 safetensors
    full = mpsconvert.quantize(src, tmp_path / "as-is")
    res = CliRunner().invoke(
        main, ["quantize", str(src), "-o", str(tmp_path / "bf16"), "--dtype", "bfloat16", "--json"]
    )
    assert res.exit_code == 0, res.output
    small = json.loads(res.output)
    assert small["weight_bytes_after"] < full.summary["weight_bytes_after"]
    with (
        safe_open(str(src / "model.safetensors"), "pt") as s,
        safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as d,
    ):
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            got = d.get_tensor(name)
            assert got.dtype == torch.bfloat16 and torch.equal(got, s.get_tensor(name).to(torch.bfloat16)), name
        assert d.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == torch.float8_e4m3fn
        assert d.get_tensor("model.layers.0.mlp.down_proj.weight_scale").dtype == torch.float32  # scales stay F32
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    m = mpsconvert.inspect(tmp_path / "bf16")
    assert m.recipe["unquantized_dtype"] == "bfloat16" and mpsconvert.verify(tmp_path / "bf16").ok
    model = mpsconvert.load(tmp_path / "bf16", device="cpu")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    res = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "x"), "--dtype", "int8"])
    assert res.exit_code == 2 and "int8" in res.output
