"""runtime.load and validate on MoE artifacts: tiny Mixtral, Qwen2-MoE and Qwen3-MoE, experts stored
per expert (the default) and fused (`--experts-layout checkpoint`), against a reference built
independently: the artifact dequantized into a BF16 checkpoint that transformers itself loads
(its own renaming and expert fusion), run with the scheme's activation rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from mpsconvert.convert.quantize import quantize_snapshot
from mpsconvert.convert.quantize_options import Options
from mpsconvert.format import fp8
from mpsconvert.format.schemes import Scheme
from mpsconvert.model.moe_layout import experts_modules
from mpsconvert.runtime.load.loader import load
from mpsconvert.runtime.ops.fp8_experts import FP8Experts
from mpsconvert.source.snapshot import resolve

from .models import TEXT_DATA, runtime_tokenizer, tiny

pytestmark = pytest.mark.core  # CI's floor lane runs these on the lowest torch and transformers

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-load")
    tok = runtime_tokenizer()
    out = {}
    for arch in ARCHS:
        per_expert_src = tiny(arch, root / f"{arch}-src", dtype=torch.bfloat16, widen=0.08, vocab=len(tok))
        fused_src = tiny(arch, root / f"{arch}-fused-src", dtype=torch.bfloat16, widen=0.08, vocab=len(tok), fused=True)
        for folder in (per_expert_src, fused_src):
            tok.save_pretrained(folder)
        for scheme in ("fp8-dynamic", "fp8-weight-only"):
            a = root / f"{arch}-{scheme}-per-expert"
            quantize_snapshot(resolve(str(per_expert_src)), a, Options(scheme=Scheme.make(scheme)))
            b = root / f"{arch}-{scheme}-fused"
            quantize_snapshot(
                resolve(str(fused_src)), b, Options(scheme=Scheme.make(scheme), experts_layout="checkpoint")
            )
            out[(arch, scheme, "per-expert")], out[(arch, scheme, "fused")] = (per_expert_src, a), (fused_src, b)
    return out


def _dequantized_checkpoint(art: Path, folder: Path) -> Path:
    """The artifact with every FP8 tensor replaced by codes x scale (BF16) and no quantization_config."""
    folder.mkdir()
    tensors = {}
    for f in sorted(art.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    out = {}
    for k, t in tensors.items():
        if k.endswith(("weight_scale", "_scale", "input_scale")):
            continue
        if t.dtype == fp8.FP8_DTYPE:
            s = tensors[k + "_scale"].float()  # <m>.weight -> <m>.weight_scale; fused <p> -> <p>_scale
            t = (fp8.fp8_to_float(t) * (s if t.ndim == 3 else s.reshape(-1, 1))).to(torch.bfloat16)
        out[k] = t.contiguous()
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((art / "config.json").read_text())
    cfg.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _fq(x):
    return fp8.fake_quantize(x, fp8.per_token_scale(x.float()))


def _reference(art: Path, tmp: Path, dynamic: bool):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        _dequantized_checkpoint(art, tmp), dtype=torch.bfloat16
    ).eval()
    model.config._experts_implementation = "eager"
    if dynamic:  # every quantized Linear rounds its input per token; the experts do it in their own loop below
        quantized = {
            k[: -len(".weight_scale")]
            for f in art.glob("*.safetensors")
            for k in safe_open(str(f), "pt").keys()
            if k.endswith(".weight_scale")
        }
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and (name in quantized or f"model.{name}" in quantized):
                mod.register_forward_pre_hook(lambda m, args: (_fq(args[0]),))
        for mod in experts_modules(model).values():
            mod.forward = _expert_loop.__get__(mod)
    return model


def _expert_loop(self, hidden, top_k_index, top_k_weights):
    """Each routed token through its expert, with the dynamic scheme's two roundings."""
    out = torch.zeros(hidden.shape[0], hidden.shape[1], dtype=torch.float32)
    for t in range(hidden.shape[0]):
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[t, j])
            gate, up = F.linear(_fq(hidden[t : t + 1]), self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(_fq(self.act_fn(gate) * up), self.down_proj[e])
            out[t] += top_k_weights[t, j].float() * y[0].float()
    return out.to(hidden.dtype)


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-weight-only"])
@pytest.mark.parametrize("arch", ARCHS)
def test_load_moe_equals_dequantized_reference(arts, tmp_path, arch, scheme, layout):
    src, art = arts[(arch, scheme, layout)]
    st = {k for f in art.glob("*.safetensors") for k in safe_open(str(f), "pt").keys()}
    assert any(k.endswith("experts.gate_up_proj") for k in st) == (layout == "fused")  # the layout asked for
    model = load(art, device="cpu")
    experts = {n: m for n, m in model.named_modules() if isinstance(m, FP8Experts)}
    assert len(experts) == 2 and set(model.mpsconvert.experts) == set(experts)
    assert {r["layout"] for r in model.mpsconvert.experts.values()} == {layout}
    assert {r["grouped"] for r in model.mpsconvert.experts.values()} == {"grouped_mm"}  # CPU: the documented fallback
    ref = _reference(art, tmp_path / "ref", dynamic=scheme == "fp8-dynamic")
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits.float(), ref(ids).logits.float()
    rel = float((got - want).norm() / want.norm())
    # bf16 summation order differs (grouped vs per token); with dynamic activations a tiny input
    # difference can flip an e4m3 rounding downstream, so the whole model gets a looser bound and
    # each experts module is compared on identical inputs below
    assert rel < (0.05 if scheme == "fp8-dynamic" else 0.02), rel
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
    seen = {}
    hooks = [
        mod.register_forward_hook(lambda mod, args, out, n=n: seen.__setitem__(n, (args, out)))
        for n, mod in experts_modules(ref).items()
    ]
    with torch.no_grad():
        ref(ids)
        for n, (args, out) in seen.items():
            mine = experts[n](*args).float()
            assert float((mine - out.float()).norm() / out.float().norm()) < 0.01, n
    for h in hooks:
        h.remove()
    # and the BF16 source itself is further away than rounding: FP8 really ran
    base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert float((base(ids).logits.float() - want).norm() / want.norm()) > 2 * rel


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_validate_moe_artifact(arts, tmp_path, layout):
    from mpsconvert.runtime.evaluate.validate import ValidateOptions, validate

    src, art = arts[("mixtral", "fp8-dynamic", layout)]
    opts = ValidateOptions(
        baseline=str(src),
        eval_data=str(TEXT_DATA / "wiki_eval.jsonl"),
        device="cpu",
        seq_len=32,
        max_samples=2,
        prefill_len=16,
        decode_tokens=2,
        repeats=2,
        rounds=1,
        warmup=1,
        write=False,
        kernel_cache=False,
    )
    r = validate(art, opts)
    assert r["kind"] == "causal-lm" and r["accuracy"]["tokens"] == 2 * 31
    assert 0 < r["accuracy"]["mean_kl"] < 0.1 and r["accuracy"]["top1_agreement"] > 0.8
    assert r["latency"]["fp8"]["decode"]["tokens"] == 2
