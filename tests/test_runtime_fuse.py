"""The eager fast path of FP8Linear on CPU: the Triton activation quantization (interpreted),
shared-input groups in eager mode and under torch.compile, and the streaming loader."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from torch import nn

from mpsconvert.format import fp8
from mpsconvert.runtime.ops.fp8linear import FP8Linear
from mpsconvert.runtime.ops.fuse import SharedInput, share_inputs

from .models import tiny_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # the Triton interpreter over many shapes: 6 min on 2 cores
@pytest.mark.triton("interpret")
def test_triton_activation_quantization_is_exactly_the_torch_arithmetic():
    import torch

    from mpsconvert.runtime.ops.triton import act_quant as aq

    g = torch.Generator().manual_seed(0)

    def same(a, b):
        assert torch.equal(a[1], b[1]), (a[1] - b[1]).abs().max()
        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)), (a[0].float() - b[0].float()).abs().max()

    for k in (64, 100, 4096):
        x = (torch.randn(5, k, generator=g) * 3).to(torch.bfloat16)
        x[1] = 0  # an all-zero row gets the floor scale
        rows = torch.rand(5, generator=g) * 0.02 + 1e-3
        for kw in ({}, {"scale": torch.tensor([0.01])}, {"rows_scale": rows}):
            same(aq.quantize(x, **kw), aq.torch_quantize(x, **kw))
        wide = torch.randn(4, 2 * k, generator=g).to(torch.bfloat16)
        same(aq.quantize(wide[:, :k]), aq.torch_quantize(wide[:, :k]))  # rows with a stride
        same(aq.silu_mul_quantize(wide), aq.torch_silu_mul_quantize(wide))
    aq._ONE_PASS_MAX = 64  # rows longer than the register block: two passes over x
    x = (torch.randn(3, 300, generator=g) * 3).to(torch.bfloat16)
    same(aq.quantize(x), aq.torch_quantize(x))
    h = torch.randn(3, 600, generator=g).to(torch.bfloat16)
    same(
        aq.silu_mul_quantize(h, rows_scale=torch.full((3,), 0.003)),
        aq.torch_silu_mul_quantize(h, rows_scale=torch.full((3,), 0.003)),
    )


@pytest.mark.triton("interpret")
def test_residual_add_fused_into_the_norm_is_the_add_then_the_norm_interpreted():
    """act_quant.add_rms_norm_quantize: the sum is bit for bit the eager `residual + x`, and the
    norm, codes and scales are those of rms_norm_quantize on that sum (rows with a stride too);
    with store_y=False the same codes, and no output."""
    import torch

    from mpsconvert.runtime.ops.triton import act_quant as aq

    g = torch.Generator().manual_seed(0)
    for dt in (torch.bfloat16, torch.float16):
        for k in (64, 100):
            x = (torch.randn(6, 2 * k, generator=g) * 3).to(dt)[:, :k]  # a strided view, as an attention output can be
            r = (torch.randn(6, k, generator=g) * 30).to(dt)
            w = (torch.rand(k, generator=g) + 0.5).to(dt)
            for quant, scale in ((True, None), (True, torch.tensor([0.05])), (False, None)):
                total, y, q, s = aq.add_rms_norm_quantize(x, r, w, 1e-6, quant, scale)
                assert torch.equal(total, r + x), (dt, k)
                y2, q2, s2 = aq.rms_norm_quantize(r + x, w, 1e-6, quant, scale)
                assert torch.equal(y, y2) and (q is None) == (not quant)
                if quant:
                    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
                # without store_y (codes only): the same sum, codes and scales, and no output written
                total3, y3, q3, s3 = aq.add_rms_norm_quantize(x, r, w, 1e-6, quant, scale, store_y=False)
                y4, q4, s4 = aq.rms_norm_quantize(r + x, w, 1e-6, quant, scale, store_y=False)
                assert torch.equal(total3, total) and (y3 is None and y4 is None) == quant
                if quant:
                    for qq, ss in ((q3, s3), (q4, s4)):
                        assert torch.equal(qq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ss, s)
                else:  # nothing but the output to write: it is written
                    assert torch.equal(y3, y) and torch.equal(y4, y)
                ref = aq.torch_rms_norm(r + x, w, 1e-6)
                assert (
                    float((y.float() - ref.float()).abs().max())
                    <= 2 * float(ref.float().abs().max()) * torch.finfo(dt).eps
                )


@pytest.mark.triton("interpret")
def test_eager_gpu_path_of_fp8linear_interpreted():
    """The kernels a CUDA layer runs in eager mode (Triton quantization + _scaled_mm, Triton
    GEMVs), here on CPU tensors, against the direct computation."""
    import torch

    from mpsconvert.format import fp8
    from mpsconvert.runtime.ops.fp8linear import FP8Linear

    g = torch.Generator().manual_seed(1)
    for gran, act, isc in (("row", "token", None), ("tensor", "tensor", 0.05), ("row", "tensor", 0.05)):
        w = torch.randn(48, 64, generator=g)
        q, s, _ = fp8.quantize(w, gran)
        lay = FP8Linear.from_tensors(
            q,
            s,
            activations=act,
            input_scale=torch.tensor([isc]) if isc else None,
            bias=torch.randn(48, generator=g).to(torch.bfloat16),
        )
        x = (torch.randn(2, 7, 64, generator=g) * 0.2).to(torch.bfloat16)
        wd = fp8.dequantize(lay.weight, lay.weight_scale, torch.float32)
        xf = x.float()
        xq = fp8.fake_quantize(xf, fp8.per_token_scale(xf) if act == "token" else torch.tensor(isc))
        want = xq @ wd.T + lay.bias.float()
        mm = "scaled_mm_tensor" if (gran, act) == ("tensor", "tensor") else "scaled_mm_row"
        lay.set_kernels("gemv", mm)
        got = lay(x).float()
        assert got.shape == (2, 7, 48) and torch.allclose(got, want, rtol=2e-2, atol=2e-2), (
            gran,
            act,
            (got - want).abs().max(),
        )
        x1 = x[:, :1]
        for dec in ("gemv", "gemv_splitk"):  # decode: BF16 activations against the FP8 weight
            lay.set_kernels(dec, mm)
            got = lay(x1).float()
            want1 = x1.float() @ wd.T + lay.bias.float()
            assert torch.allclose(got, want1, rtol=1e-2, atol=1e-2), (dec, (got - want1).abs().max())
        lay.set_kernels("gemv_w8a8", mm)  # decode on the tensor cores: the scheme's own rounding of x
        got = lay(x1).float()
        want8 = (
            fp8.fake_quantize(x1.float(), fp8.per_token_scale(x1.float()) if act == "token" else torch.tensor(isc))
            @ wd.T
            + lay.bias.float()
        )
        assert torch.allclose(got, want8, rtol=1e-2, atol=2e-2), ("gemv_w8a8", (got - want8).abs().max())


def _layer(n, k, seed, act="token", gran="row"):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, s, _ = fp8.quantize(w, gran)
    lay = FP8Linear.from_tensors(q, s, activations=act)
    lay.set_kernels("scaled_mm_row", "scaled_mm_row")  # torch._scaled_mm runs on CPU for small shapes
    return lay


class Attn(nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = _layer(64, 32, seed), _layer(32, 32, seed + 1), _layer(32, 32, seed + 2)

    def forward(self, x):
        return x + self.q_proj(x)[..., :32] * self.k_proj(x) + self.v_proj(x)


class Stack(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.layers = nn.ModuleList(Attn(3 * i) for i in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _shared(model):
    groups = share_inputs(model)
    for g in groups:
        g.inner.set_kernels("scaled_mm_row", "scaled_mm_row")
    return groups


def test_shared_input_is_one_gemm_and_the_same_outputs():
    model = Stack()
    x = (torch.randn(8, 32) * 0.1).to(torch.bfloat16)
    ref = model(x)
    weights = sum(m.weight.untyped_storage().nbytes() for m in model.modules() if isinstance(m, FP8Linear))
    groups = _shared(model)
    assert len(groups) == 3 and all(
        isinstance(g, SharedInput) and g.names == ["q_proj", "k_proj", "v_proj"] for g in groups
    )
    a = model.layers[0]
    assert a.q_proj.weight.data_ptr() == a.fused_q_proj_k_proj_v_proj.inner.weight.data_ptr()  # members are views
    storages = {m.weight.untyped_storage().data_ptr() for m in model.modules() if isinstance(m, FP8Linear)}
    assert (
        len(storages) == 3 and sum(g.inner.weight.untyped_storage().nbytes() for g in groups) == weights
    )  # no copy kept
    from mpsconvert.runtime.ops import fuse, kernels
    from mpsconvert.runtime.ops.triton import act_quant

    quantized, gemms = [], []
    real_quantize, real_mm = act_quant.quantize, kernels._mm
    act_quant.quantize = lambda *a, **k: (quantized.append(1), real_quantize(*a, **k))[1]
    kernels._mm = lambda xq, *a, **k: (gemms.append(xq.shape), real_mm(xq, *a, **k))[1]
    try:
        out = model(x)  # prefill (8 rows), the default: one quantization and one fused GEMM per group
        assert (
            torch.equal(out, ref) and len(quantized) == 3 and len(gemms) == 3 and all(g.stash.hits == 2 for g in groups)
        )
        quantized.clear(), gemms.clear()
        fuse.PREFILL_SHARES = "quantization"  # one quantization per group, each member its own GEMM
        assert torch.equal(model(x), ref) and len(quantized) == 3 and len(gemms) == 9
        x1 = x[:2]  # decode (2 rows): one fused GEMM per group either way
        want = Stack()(x1)
        gemms.clear()
        assert torch.equal(model(x1), want) and len(gemms) == 3
    finally:
        act_quant.quantize, kernels._mm = real_quantize, real_mm
        fuse.PREFILL_SHARES = "gemm"
    assert all(g.stash.cur is None for g in groups)  # nothing held after the last member took its share


def test_members_with_different_inputs_get_their_own_products():
    model = Attn(0)
    model.forward = lambda x: (model.q_proj(x)[..., :32], model.k_proj(x * 2), model.v_proj(x * 3))
    x = (torch.randn(4, 32) * 0.1).to(torch.bfloat16)
    ref = model.forward(x)
    (g,) = _shared(model)
    for _ in range(5):
        out = model.forward(x)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert not g.shared  # stopped fusing: the members do not share their input
    fresh = Attn(0)
    want = fresh.k_proj(x * 2)
    (g,) = _shared(fresh)
    y = x.clone()
    fresh.q_proj(y)
    y.mul_(2)  # changed in place after q_proj read it: k_proj must not get the stale slice
    assert torch.equal(fresh.k_proj(y), want) and g.shared and g.stash.hits == 0


def test_shared_input_under_torch_compile_one_frame_no_recompiles():
    from torch._dynamo.testing import CompileCounter

    model = Stack()
    x = (torch.randn(8, 32) * 0.1).to(torch.bfloat16)
    ref = model(x)
    _shared(model)
    torch._dynamo.reset()
    cnt = CompileCounter()
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    for i in range(4):
        compiled(x if i == 0 else (torch.randn(8, 32) * 0.1).to(torch.bfloat16))
    assert cnt.frame_count == 1 and torch.equal(compiled(x), ref)
    torch._dynamo.reset()
    cnt = CompileCounter()
    for layer in model.layers:  # per-layer (regional) compilation: one graph serves every layer
        layer.compile(backend=cnt, fullgraph=True)
    assert torch.equal(model(x), ref) and torch.equal(model(x), ref) and cnt.frame_count == 1
    torch._dynamo.reset()


def test_inductor_runs_one_gemm_per_group():
    from torch._inductor.utils import run_and_get_code

    from mpsconvert.runtime.ops import fuse

    model = Stack(2)
    _shared(model)
    try:
        for rows, mode, gemms in ((2, "gemm", 2), (8, "gemm", 2), (8, "quantization", 6)):
            fuse.PREFILL_SHARES = mode
            torch._dynamo.reset()
            with torch.no_grad():
                _, codes = run_and_get_code(torch.compile(model), (torch.randn(rows, 32) * 0.1).to(torch.bfloat16))
            assert "\n".join(codes).count("extern_kernels._scaled_mm(") == gemms, (rows, mode)
    finally:
        fuse.PREFILL_SHARES = "gemm"
        torch._dynamo.reset()


def test_stream_reads_each_shard_once_hashing_what_it_copies(tmp_path):
    from safetensors.torch import save_file

    from mpsconvert.infra.safetensors_io import read_header
    from mpsconvert.runtime.load import stream

    g = torch.Generator().manual_seed(0)
    files = []
    for i in range(3):
        tensors = {
            f"t{i}.a": torch.randn(1000, 7, generator=g),
            f"t{i}.b": torch.randn(33, generator=g).to(torch.bfloat16),
            f"t{i}.c": (torch.randn(50, 64, generator=g) * 10).to(fp8.FP8_DTYPE),
            f"t{i}.skip": torch.randn(5),
        }
        save_file(tensors, str(tmp_path / f"s{i}.safetensors"))
        files.append(tensors)
    (tmp_path / "config.json").write_text("{}")
    headers = [read_header(tmp_path / f"s{i}.safetensors") for i in range(3)]
    dests = {k: torch.empty_like(v) for f in files for k, v in f.items() if not k.endswith("skip")}
    dests["t0.a"] = torch.empty(2000, 7)[::2]  # not contiguous: refused
    with pytest.raises(ValueError, match="contiguous"):
        stream.read_shards(headers, dests, torch.device("cpu"))
    dests["t0.a"] = torch.empty(1000, 7)
    seen = []
    # blocks cut through tensors
    digests = stream.read_shards(
        headers,
        dests,
        torch.device("cpu"),
        extra_files={"config.json": tmp_path / "config.json"},
        block=1000,
        progress=lambda *a: seen.append(a),
    )
    for f in files:
        for k, v in f.items():
            if not k.endswith("skip"):
                assert torch.equal(dests[k].view(torch.uint8), v.view(torch.uint8)), k
    for i in range(3):
        assert digests[f"s{i}.safetensors"] == hashlib.sha256((tmp_path / f"s{i}.safetensors").read_bytes()).hexdigest()
    assert digests["config.json"] == hashlib.sha256(b"{}").hexdigest()
    assert seen[-1][0] == "load" and max(s[1] for s in seen) == sum(h.file_size for h in headers)
    assert stream.read_shards(headers, {}, torch.device("cpu"), hash_files=False) == {
        f"s{i}.safetensors": None for i in range(3)
    }


@pytest.mark.triton("interpret")
def test_eager_fusion_of_norms_and_mlp_interpreted():
    """runtime/patches/eager_fusion.py on a tiny Llama (Triton interpreted): each RMSNorm runs as one
    kernel and hands its quantized output to the q/k/v or gate/up group it feeds (linked by the
    probe forward, not by name), the MLP runs silu*up and down_proj's quantization in one
    kernel; the logits are those of the model's own forwards, and under torch.compile the
    modules' own forwards run. A norm whose arithmetic differs is left as it was, with the reason."""
    import torch
    from transformers import LlamaForCausalLM

    from mpsconvert.runtime.ops import fuse
    from mpsconvert.runtime.ops.triton import act_quant
    from mpsconvert.runtime.patches import eager_fusion, forwards

    from .helpers import fp8_model

    def fp8_llama(act):
        return fp8_model(LlamaForCausalLM, tiny_config("llama", vocab=128, intermediate_size=96), act)

    calls = {"quantize": 0, "rms_norm_quantize": 0, "add_rms_norm_quantize": 0, "silu_mul_quantize": 0}
    for fn in calls:
        real = getattr(act_quant, fn)
        setattr(
            act_quant,
            fn,
            (lambda fn, real: lambda *a, **k: (calls.__setitem__(fn, calls[fn] + 1), real(*a, **k))[1])(fn, real),
        )
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    for act in ("token", "tensor"):
        model = fp8_llama(act)
        with torch.no_grad():
            ref, ref1 = model(ids).logits, model(ids[:, :1]).logits
            report = eager_fusion.install(model)
            assert report == {
                "norms": 5,
                "norms_quantizing": 4,
                "mlps": 2,
                "mlps_gated_decode": 0,
                "layers": 2,
                "layers_direct_decode": 0,
                "attention": 2,
                "rotary": 2,
                "left": [],
                "launch": "kernel[grid] (the Triton interpreter)",
            }, report
            layer = model.model.layers[0]
            assert layer.input_layernorm.mpsconvert_feeds is layer.self_attn.fused_q_proj_k_proj_v_proj
            assert layer.post_attention_layernorm.mpsconvert_feeds is layer.mlp.fused_gate_proj_up_proj
            assert model.model.norm.mpsconvert_feeds is None  # feeds lm_head, which quantizes nothing
            # each layer's last residual add goes to the norm that reads the layer's output (linked by the probe)
            assert layer.mpsconvert_layer[4] is model.model.layers[1].input_layernorm
            assert model.model.layers[1].mpsconvert_layer[4] is model.model.norm
            assert type(layer).__name__ == "LlamaDecoderLayer"
            for k in calls:
                calls[k] = 0
            for m in model.model.layers:  # the layers' own forwards (with the fused norms, MLPs, rotary)
                forwards.uninstall(m)
            want = model(ids).logits
            assert calls == {
                "quantize": 2,
                "rms_norm_quantize": 5,
                "add_rms_norm_quantize": 0,
                "silu_mul_quantize": 2,
            }, calls  # o_proj alone quantizes
            for m in model.model.layers:
                forwards.install(m, eager_fusion._layer_forward)
            for k in calls:
                calls[k] = 0
            out = model(ids).logits  # prefill: 9 rows
            # the first norm on the embeddings; the other four each with the residual add before it
            assert calls == {
                "quantize": 2,
                "rms_norm_quantize": 1,
                "add_rms_norm_quantize": 4,
                "silu_mul_quantize": 2,
            }, calls
            assert torch.equal(out, want)  # the fused adds change no bit
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            assert err < 1e-2, (act, err)
            groups = [m for m in model.modules() if isinstance(m, fuse.SharedInput)]
            assert len(groups) == 4 and all(
                g.stash.pre is None and g.stash.cur is None for g in groups
            )  # every hand-over taken
            norms = [m for m in model.modules() if forwards.installed(m, eager_fusion._norm_forward)]
            assert all(n.mpsconvert_hand.pre is None for n in norms)
            seen = []  # a hook that replaces a layer's output: the next norm computes on what it gets
            h = model.model.layers[0].register_forward_hook(lambda m, a, o: seen.append(1) or o * 2)
            bumped = model(ids).logits
            h.remove()
            for m in model.model.layers:
                forwards.uninstall(m)
            h = model.model.layers[0].register_forward_hook(lambda m, a, o: o * 2)
            assert torch.equal(bumped, model(ids).logits) and seen
            h.remove()
            for m in model.model.layers:
                forwards.install(m, eager_fusion._layer_forward)
            out1 = model(ids[:, :1]).logits  # decode: the norm kernel without quantization, the MLP's own forward
            assert float((out1.float() - ref1.float()).norm() / ref1.float().norm()) < 1e-2
            for k in calls:
                calls[k] = 0
            compiled = torch.compile(model, backend="eager")(ids).logits
            assert calls["rms_norm_quantize"] == 0 and calls["silu_mul_quantize"] == 0, (
                calls
            )  # the modules' own forwards
            assert float((compiled.float() - ref.float()).norm() / ref.float().norm()) < 1e-2

    norms = [m for m in model.modules() if forwards.installed(m, eager_fusion._norm_forward)]
    for n in norms:  # norm weights that need gradients: their own forwards, which have a backward
        n.weight.requires_grad_(True)
    for k in calls:
        calls[k] = 0
    model(ids).logits.float().sum().backward()
    assert calls["rms_norm_quantize"] == 0 and calls["add_rms_norm_quantize"] == 0, calls
    assert model.model.norm.weight.grad is not None and bool(model.model.norm.weight.grad.abs().sum() > 0)
    for n in norms:
        n.weight.requires_grad_(False)

    class OffsetRMSNorm(type(model.model.norm)):  # Gemma's arithmetic: (1 + weight)
        def forward(self, x):
            h = x.float()
            return (
                h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1.0 + self.weight.float())
            ).to(x.dtype)

    model = fp8_llama("token")
    model.model.norm.__class__ = OffsetRMSNorm
    report = eager_fusion.install(model)
    assert report["norms"] == 4 and len(report["left"]) == 1 and report["left"][0].startswith("model.norm: differs"), (
        report
    )
    assert not forwards.installed(model.model.norm) and forwards.installed(model.model.layers[0].input_layernorm)
    assert (
        report["layers"] == 2 and model.model.layers[1].mpsconvert_layer[4] is None
    )  # its output goes to a norm of its own

    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class Doubled(LlamaDecoderLayer):  # another forward over the same four modules
        def forward(self, hidden_states, **kwargs):
            return 2 * super().forward(hidden_states, **kwargs)

    model = fp8_llama("token")
    model.model.layers[1].__class__ = Doubled
    report = eager_fusion.install(model)
    assert report["layers"] == 1 and report["left"] == [
        "model.layers.1: the fused residual adds differ from its own forward"
    ], report
    assert not forwards.installed(model.model.layers[1])


@pytest.mark.triton("interpret")
def test_fused_rotary_is_the_modeling_function_bit_for_bit_interpreted(monkeypatch):
    """runtime/patches/rotary.py (Triton interpreted): the kernel equals transformers' own
    apply_rotary_pos_emb exactly (values and memory layout) for GQA heads, head sizes that are
    and are not powers of two, bf16/fp16/fp32 and per-batch cos/sin; installed in a model, its
    attention modules run it (logits identical), while a model of the same class that was not
    installed, calls under torch.compile and calls it does not take run the original; an
    attention module whose modeling function differs is left with the reason."""
    import sys

    import torch
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama as ml

    from mpsconvert.runtime.patches import forwards, rotary

    g = torch.Generator().manual_seed(0)
    # the interpreted tests share one process: an earlier one may have installed the dispatch
    # (with its own counts) in transformers' module; this test starts from the plain function
    original = getattr(ml.apply_rotary_pos_emb, "original", ml.apply_rotary_pos_emb)
    monkeypatch.setattr(ml, "apply_rotary_pos_emb", original)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for b, hq, hk, s, d, cb in ((1, 4, 2, 7, 16, 1), (2, 6, 3, 5, 12, 2), (1, 8, 8, 3, 128, 1)):
            x = (torch.randn(b, s, (hq + 2 * hk) * d, generator=g) * 3).to(dt)
            q = x[..., : hq * d].view(b, s, hq, d).transpose(1, 2)
            k = x[..., hq * d : (hq + hk) * d].view(b, s, hk, d).transpose(1, 2)
            ang = torch.randn(cb, s, d, generator=g) * 5
            cos, sin = ang.cos().to(dt), ang.sin().to(dt)
            assert rotary.fits(q, k, cos, sin)
            for want, got in zip(original(q, k, cos, sin), rotary.rotary(q, k, cos, sin)):
                assert torch.equal(want, got) and want.stride() == got.stride(), (
                    dt,
                    d,
                    (want.float() - got.float()).abs().max(),
                )
    half = torch.zeros(1, 3, 8)  # partial rotary (cos narrower than the heads): not taken
    assert not rotary.fits(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), half, half)

    torch.manual_seed(0)
    cfg = tiny_config("llama", vocab=128, intermediate_size=96)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    other = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 128, (1, 9), generator=g)
    with torch.no_grad():
        ref, ref_other = model(ids).logits, other(ids).logits
        report = rotary.install(model, torch.bfloat16, "cpu")
        assert report == {"attention": 2, "left": []}, report
        fn = ml.apply_rotary_pos_emb
        assert isinstance(fn, rotary.Dispatch) and fn.original is original
        assert torch.equal(model(ids).logits, ref) and fn.fused == 2
        assert torch.equal(other(ids).logits, ref_other) and fn.fused == 2  # not installed: the original ran
        torch.compile(model, backend="eager")(ids)
        assert fn.fused == 2  # traced code runs the original
        assert (
            rotary.install(model, torch.bfloat16, "cpu")["attention"] == 2 and ml.apply_rotary_pos_emb is fn
        )  # once per module
    model(ids).logits.sum().backward()  # a gradient: the original, which has a backward
    assert fn.fused == 2

    # a modeling module of its own whose apply_rotary_pos_emb is another arithmetic (a global
    # its attention's forward names, as in transformers' modeling files)
    import types

    odd = types.ModuleType("odd_modeling")
    odd.Base = ml.LlamaAttention
    exec(
        "def apply_rotary_pos_emb(q, k, cos, sin):\n    return q * cos, k * sin\n\n"
        "class OddAttention(Base):\n    def forward(self, *a, **k):\n        apply_rotary_pos_emb  # noqa\n"
        "        return super().forward(*a, **k)\n",
        odd.__dict__,
    )
    monkeypatch.setitem(sys.modules, "odd_modeling", odd)
    OddAttention = odd.OddAttention
    fresh = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    fresh.model.layers[1].self_attn.__class__ = OddAttention
    report = rotary.install(fresh, torch.bfloat16, "cpu")
    assert report["attention"] == 1 and report["left"] == [
        "model.layers.1.self_attn: its apply_rotary_pos_emb differs from the fused kernel"
    ], report
    assert not forwards.installed(fresh.model.layers[1].self_attn) and forwards.installed(
        fresh.model.layers[0].self_attn
    )
    assert type(fresh.model.layers[0].self_attn).__name__ == "LlamaAttention"  # the class keeps its name and module


def test_triton_launch_reuses_the_compiled_kernel_only_for_the_same_specialization(monkeypatch):
    """runtime/ops/triton/launch.py's logic (the GPU half runs on the H200): the first call of a key
    goes through kernel[grid] (Triton compiles and launches), a later call with the same dtypes,
    alignments, scalars and options goes to that compiled kernel's launcher with every argument
    in order, and any difference in what Triton specializes on is a new key; with a launch hook
    set, or when the probe decided against it, every call takes kernel[grid]. Needs no Triton:
    the kernel and its compiled form are stand-ins."""
    from mpsconvert.runtime.ops.triton import launch as tlm

    launches, runs = [], []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *a):
            runs.append(a)

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **opts: (launches.append((grid, args, opts)), Compiled())[1]

    k = Kernel()
    monkeypatch.setattr(tlm, "_MODE", ["direct"])
    monkeypatch.setattr(tlm, "_CACHE", {})
    monkeypatch.setattr(tlm, "_stream", lambda device: f"stream{device}")
    base = torch.zeros(64)
    x, y = base[:16], base[16:32]  # 64-byte offsets: aligned
    tlm.launch(k, (4,), (x, y, 16, 0.5, True), num_warps=4)
    tlm.launch(k, (8, 2), (x, y, 16, 0.5, True), num_warps=4)  # same key, another grid
    assert len(launches) == 1 and runs == [(8, 2, 1, "streamNone", "fn", "meta", None, None, None, x, y, 16, 0.5, True)]
    for args, opts in (
        ((base[1:17], y, 16, 0.5, True), {"num_warps": 4}),  # x no longer 16-byte aligned
        ((x, y, 17, 0.5, True), {"num_warps": 4}),  # another scalar value
        ((x, y, 16, 0.5, 1), {"num_warps": 4}),  # an int where a bool was
        ((x.half(), y, 16, 0.5, True), {"num_warps": 4}),  # another dtype
        ((x, y, 16, 0.5, True), {"num_warps": 8}),
    ):  # another launch option
        tlm.launch(k, (4,), args, **opts)
    assert len(launches) == 6 and len(runs) == 1
    monkeypatch.setattr(tlm, "_hooks_set", lambda: True)
    tlm.launch(k, (4,), (x, y, 16, 0.5, True), num_warps=4)
    assert len(launches) == 7 and len(runs) == 1
    monkeypatch.setattr(tlm, "_hooks_set", lambda: False)
    monkeypatch.setattr(tlm, "_MODE", ["kernel[grid] (a direct launch failed: ...)"])
    tlm.launch(k, (4,), (x, y, 16, 0.5, True), num_warps=4)
    assert len(launches) == 8 and len(runs) == 1
    monkeypatch.setattr(tlm, "_MODE", [])
    assert (
        tlm.mode().startswith("kernel[grid] (") and tlm.mode() != "direct"
    )  # here: no CUDA device (or the interpreter)


def test_compiled_frame_checks_no_fp8_tensor_in_the_warm_guard_stance():
    """FP8 weights and scales are frozen parameters (fp8linear.hold): in torch.compile's
    warm-guard stance dynamo still checks every tensor that is not an nn.Parameter on every call
    (its "diff" guard set), which cost 1.4 ms per Llama-3-8B decode step on the H200 while they
    were buffers. The compiled decode frame of a shared-input FP8 Llama must check exactly what
    BF16's does (its inputs, the cache, the rotary table), nothing under an FP8 layer."""
    from transformers import LlamaForCausalLM, StaticCache

    from mpsconvert.format import fp8
    from mpsconvert.runtime.ops import fuse
    from mpsconvert.runtime.ops.fp8linear import FP8Linear

    entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if entries is None:
        pytest.skip(f"torch {torch.__version__} has no _debug_get_cache_entry_list to read the guard set from")

    def diff_sources(fp8_layers: bool) -> set[str]:
        torch.manual_seed(0)
        cfg = tiny_config("llama", vocab=128, intermediate_size=96)
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval().requires_grad_(False)
        if fp8_layers:
            for name, lin in list(model.model.layers.named_modules()):
                if isinstance(lin, nn.Linear):
                    q, s, _ = fp8.quantize(lin.weight.float(), "row")
                    new = FP8Linear.from_tensors(q, s, activations="token", bias=torch.zeros(lin.out_features))
                    new.set_kernels("dense_qact", "dense_qact")
                    parent, _, leaf = name.rpartition(".")
                    setattr(model.model.layers.get_submodule(parent), leaf, new)
            for g in fuse.share_inputs(model):
                g.inner.set_kernels("dense_qact", "dense_qact")
            fp8_mods = [m for m in model.modules() if isinstance(m, FP8Linear)]
            assert all(not m._buffers for m in fp8_mods)
            assert all(
                isinstance(t, nn.Parameter) and not t.requires_grad
                for m in fp8_mods
                for t in m._parameters.values()
                if t is not None
            )
        cache = StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            model(
                torch.zeros(1, 8, dtype=torch.long),
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.arange(8),
            )
            torch._dynamo.reset()
            torch.compile(model.forward, backend="eager")(
                torch.zeros(1, 1, dtype=torch.long),
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.tensor([8]),
            )
        found = set()
        fn = type(model).forward
        while fn is not None:
            for e in entries(fn.__code__):
                found |= set(e.guard_manager.diff_guard_sources)
            fn = getattr(fn, "__wrapped__", None)
        assert found, "no compiled frame found"
        return found

    bf16, ours = diff_sources(False), diff_sources(True)
    assert ours == bf16, sorted(ours ^ bf16)


def test_on_cpu_siblings_share_one_rounding_and_one_dense_weight(llama_art):
    """On CPU an fp8-dynamic layer rounds its input through e4m3 before its dense product
    (`dense_qact`): q/k/v and gate/up round their one input once and run one product, each member's
    dense weight a view of the group's (one copy in memory), and compute what they compute apart;
    also under torch.inference_mode, whose tensors have no version counter."""
    from mpsconvert import load
    from mpsconvert.runtime.load.load_report import model_bytes

    shared, apart = load(llama_art, device="cpu"), load(llama_art, device="cpu", share_inputs=False)
    groups = [m for m in shared.modules() if isinstance(m, SharedInput)]
    layers = shared.config.num_hidden_layers
    assert len(groups) == 2 * layers == shared.mpsconvert.patches["shared_inputs"]["installed"]
    assert not any(isinstance(m, SharedInput) for m in apart.modules())
    for g in groups:
        assert g.inner.kernels["decode"] == "dense_qact" and g.inner.weight is None
        parent = next(p for p in shared.modules() if any(c is g for c in p.children()))
        for n in g.names:
            m = parent._modules[n]
            assert (
                m.weight is None
                and m.dense_weight.untyped_storage().data_ptr() == g.inner.dense_weight.untyped_storage().data_ptr()
            )
    assert model_bytes(shared) == model_bytes(apart)  # the fused dense weights replace the members', no copy kept

    from .test_runtime_patches import _aten_ops

    ids = torch.randint(0, shared.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = apart(ids).logits
        got = shared(ids).logits
        rounds = {
            name: sum(op == "amax" for op, _ in _aten_ops(lambda: mod(ids)))
            for name, mod in (("shared", shared), ("apart", apart))
        }
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), (got - want).abs().max()
    assert rounds == {"shared": 4 * layers, "apart": 7 * layers}  # per-token amax: one per rounded input
    with torch.inference_mode():
        assert torch.equal(shared(ids).logits, got)
    assert all(g.shared and g.stash.hits > 0 for g in groups)
    assert torch.equal(
        shared.generate(ids, max_new_tokens=6, do_sample=False), apart.generate(ids, max_new_tokens=6, do_sample=False)
    )
