"""runtime/patches/direct_decode.py through the Triton interpreter: a decoder layer's decode step
as direct calls with its norms and residual adds folded into the GEMVs."""

from __future__ import annotations

import pytest
import torch

from mpsconvert.format.fp8 import relative_error

from .helpers import prefilled
from .models import fp8_gemv_model

pytestmark = pytest.mark.triton("interpret")


def _plans(model):
    return [layer.mpsconvert_decode for layer in model.model.layers]


@pytest.mark.parametrize("arch,gate_up", [("llama", "gemv"), ("llama", "gemv_w8a8"), ("qwen2", "gemv")])
def test_the_direct_decode_is_the_layers_own_decode_over_the_static_cache(arch, gate_up, monkeypatch):
    """Every layer of a model whose GEMVs have the forms takes the direct decode (checked at
    install); the engine's steps over its static cache then run it (each layer once a step, its key
    and value written by the rotary kernel) and give the logits of the modules' own decode (the
    same kernels, the gate/up on the BF16 GEMV where the policy chose the W8A8 one, each norm and
    add on its own) within the norm prologue's rounding, and the same greedy tokens. Qwen2's q/k/v
    carry a bias."""
    from mpsconvert.runtime import engine

    model = fp8_gemv_model(arch, gate_up)
    details = model.reports["eager_fusion"].details
    plans = _plans(model)
    assert details["layers_direct_decode"] == len(plans) and all(p is not None for p in plans), details
    prompt = [5, 6, 7, 8, 9]

    def run():
        e = prefilled(engine.Engine(model, static=True), prompt)
        assert e.writes_at == "position"
        return [e.step(t) for t in (10, 11, 12)]

    from mpsconvert.runtime.ops.triton import qkv_rotary

    stored, real = [], qkv_rotary.qkv_rotary
    monkeypatch.setattr(qkv_rotary, "qkv_rotary", lambda *a: stored.append(1) or real(*a))
    calls = [p.calls for p in plans]
    got = run()
    assert [p.calls for p in plans] == [c + 3 for c in calls]  # the prefill takes the other path
    assert len(stored) == 3 * len(plans)  # the engine's static cache: written by the q/k/v GEMV
    for layer in model.model.layers:  # the modules, their gate/up on the BF16 GEMV the direct decode runs
        object.__setattr__(layer, "mpsconvert_decode", None)
        layer.mlp.fused_gate_proj_up_proj.inner.set_kernels("gemv", "scaled_mm_row")
    want = run()
    for g, w in zip(got, want):
        assert relative_error(g, w) < 2**-7, relative_error(g, w)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_a_call_it_does_not_take_runs_the_modules():
    """Two rows, a gradient, a hook on a skipped module, or a policy that moved a layer off the
    GEMV: the layer's decode runs its modules (the plan stays; the next fitting call takes it)."""
    from mpsconvert.runtime.patches import direct_decode

    model = fp8_gemv_model("llama")
    layer = model.model.layers[0]
    p = layer.mpsconvert_decode
    d = p.d
    x = torch.randn(1, 1, model.config.hidden_size, dtype=torch.bfloat16)
    kw = {"position_embeddings": (torch.ones(1, 1, d, dtype=x.dtype),) * 2, "past_key_values": object()}
    assert direct_decode.takes(p, x, kw) is None  # a cache without update
    from transformers import DynamicCache

    kw["past_key_values"] = DynamicCache(config=model.config)
    assert direct_decode.takes(p, x, kw) is not None
    assert direct_decode.takes(p, torch.cat([x, x]), kw) is None  # batch 2
    assert direct_decode.takes(p, x.requires_grad_(True), kw) is None
    x = x.detach()
    h = p.o_proj.register_forward_hook(lambda *a: None)
    assert direct_decode.takes(p, x, kw) is None
    h.remove()
    p.o_proj.set_kernels("scaled_mm_row", "scaled_mm_row")
    assert direct_decode.takes(p, x, kw) is None
    p.o_proj.set_kernels("gemv", "scaled_mm_row")
    assert direct_decode.takes(p, x, {**kw, "output_attentions": True}) is None


def test_a_layer_whose_direct_decode_differs_keeps_its_modules(monkeypatch):
    """The install check compares one decode step after a prompt with the layer's own forward: a
    direct decode that computes something else is not switched on, and the report says why."""
    from mpsconvert.runtime.patches import direct_decode

    real = direct_decode.forward
    monkeypatch.setattr(direct_decode, "forward", lambda p, x, *a: real(p, x, *a) * 1.5)
    model = fp8_gemv_model("llama")
    details = model.reports["eager_fusion"].details
    assert details["layers_direct_decode"] == 0 and all(p is None for p in _plans(model))
    left = model.reports["eager_fusion"].left
    assert any("its direct decode differs from its own forward" in why for why in left), left


@pytest.mark.parametrize("bias,per_tensor", [(False, False), (True, False), (False, True)])
def test_the_qkv_rotary_gemv_writes_what_the_gemv_rotary_and_cache_update_write(bias, per_tensor):
    """ops/triton/qkv_rotary (interpreted): q as the normed GEMV then `rotary` give it, bit for bit,
    and the cache rows at the device-held position what `rotary` then `index_copy_` write; the other
    rows untouched. With a bias (Qwen2's q/k/v) and with one scale for the tensor."""
    from mpsconvert.format.fp8 import quantize
    from mpsconvert.runtime.ops.triton import gemv, qkv_rotary, rotary_kernel

    g = torch.Generator().manual_seed(0)
    hq, hk, d, cap, hidden = 4, 2, 16, 6, 96
    w, scale, _ = quantize(torch.randn((hq + 2 * hk) * d, hidden, generator=g), "tensor" if per_tensor else "row")
    scale = scale.reshape(-1).float()
    b = (torch.randn(w.shape[0], generator=g) * 0.1).to(torch.bfloat16) if bias else None
    x = (torch.randn(1, hidden, generator=g) * 3).to(torch.bfloat16)
    norm = (1 + torch.randn(hidden, generator=g) * 0.1).to(torch.bfloat16)
    angle = torch.randn(1, 1, d, generator=g) * 4
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    keys, values = (torch.randn(1, hk, cap, d, generator=g).to(torch.bfloat16) for _ in range(2))
    want_k, want_v = keys.clone(), values.clone()
    at = torch.tensor(3)
    qkv = gemv.gemv(x, w, scale, b, norm=norm, eps=1e-5).view(1, 1, -1)
    q, k, v = (t.view(1, 1, -1, d).transpose(1, 2) for t in qkv.split([hq * d, hk * d, hk * d], -1))
    want_q, rk = rotary_kernel.rotary(q, k, cos, sin)
    want_k.index_copy_(2, at.view(1), rk)
    want_v.index_copy_(2, at.view(1), v)
    assert qkv_rotary.fits(x, w, scale, (hq, hk, d), keys, values)
    got_q = qkv_rotary.qkv_rotary(x, w, scale, b, norm, 1e-5, cos, sin, keys, values, at, (hq, hk, d))
    assert torch.equal(got_q, want_q) and got_q.shape == q.shape
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    assert not qkv_rotary.fits(x, w, scale, (hq, hk, d), keys[:, :1], values)  # caches of other heads
    assert not qkv_rotary.fits(x, w[:-d], scale[:-d], (hq, hk, d), keys, values)  # not [q; k; v] of these heads
