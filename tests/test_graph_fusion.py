"""The compiled decode step's graph pass (runtime/ops/graph_fusion.py): the RMSNorm before a decode
GEMV and the residual add after it folded into the GEMV, on CPU through Inductor and the Triton
interpreter. What it rewrites is counted, the results stay the module's (the add bit for bit),
and a graph it cannot rewrite safely is left as it is."""

from __future__ import annotations

import pytest
import torch

from mpsconvert.runtime.ops import graph_fusion

from .models import fp8_gemv_model

K, N = 64, 48


def _rms(x, w, eps=1e-6):
    """transformers' LlamaRMSNorm.forward, op for op."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _compiled(fn, *args, fusion: bool = True):
    """fn compiled by Inductor with the pass (no caches: the pass runs on every compile)."""
    from mpsconvert.runtime.engine.decoder import inductor_options

    torch._dynamo.reset()
    graph_fusion.FUSION.reset()
    with inductor_options(
        {"post_grad_custom_pre_pass": graph_fusion.FUSION if fusion else None, "force_disable_caches": True}
    ):
        return torch.compile(fn, fullgraph=True)(*args)


def _operands(seed=0):
    from mpsconvert.format import fp8

    g = torch.Generator().manual_seed(seed)
    codes, s, _ = fp8.quantize(torch.randn(N, K, generator=g), "row")
    codes2, s2, _ = fp8.quantize(torch.randn(K, N, generator=g), "row")
    x = (torch.randn(1, 1, K, generator=g) * 3).to(torch.bfloat16)
    nw = (torch.rand(K, generator=g) + 0.5).to(torch.bfloat16)
    return x, nw, codes, s.reshape(-1), codes2, s2.reshape(-1)


@pytest.mark.slow  # 3 min on 2 cores
@pytest.mark.triton("interpret")
def test_a_norm_and_a_residual_add_around_decode_gemvs_are_folded_in():
    """norm -> GEMV -> GEMV -> + residual, as a decoder layer's attention traces at decode: one
    norm and one add folded (the pass counts them), the result within the norm's roundings of the
    eager one; with the norm's output also returned, the norm stays (it is read twice) and only
    the add is folded: bit for bit what the same compile without the pass gives."""
    from mpsconvert.format.fp8 import relative_error
    from mpsconvert.runtime.ops.triton import gemv

    x, nw, w1, s1, w2, s2 = _operands()

    def layer(x, nw, w1, s1, w2, s2):
        h = _rms(x, nw)
        y = gemv.gemv(h.reshape(-1, K), w1, s1, None).view(1, 1, N)
        return x + gemv.gemv(y.reshape(-1, N), w2, s2, None).view(1, 1, K)

    want = layer(x, nw, w1, s1, w2, s2)
    got = _compiled(layer, x, nw, w1, s1, w2, s2)
    assert graph_fusion.FUSION.counts == {"graphs": 1, "norms": 1, "residuals": 1}
    assert relative_error(got.float() - x.float(), want.float() - x.float()) < 2**-7

    def shared(x, nw, w1, s1, w2, s2):
        h = _rms(x, nw)
        y = gemv.gemv(h.reshape(-1, K), w1, s1, None).view(1, 1, N)
        return x + gemv.gemv(y.reshape(-1, N), w2, s2, None).view(1, 1, K), h

    got, h = _compiled(shared, x, nw, w1, s1, w2, s2)
    assert graph_fusion.FUSION.counts == {"graphs": 1, "norms": 0, "residuals": 1}
    plain, h0 = _compiled(shared, x, nw, w1, s1, w2, s2, fusion=False)
    assert graph_fusion.FUSION.counts == {"graphs": 0, "norms": 0, "residuals": 0}
    assert torch.equal(got, plain) and torch.equal(h, h0)


@pytest.mark.triton("interpret")
def test_what_is_not_the_pattern_is_left_alone():
    """A norm of another shape (LayerNorm-like: the mean subtracted), an add whose operands differ
    in dtype, are not rewritten: the result is the same compile's without the pass."""
    from mpsconvert.runtime.ops.triton import gemv

    x, nw, w1, s1, _, _ = _operands(1)

    def other(x, nw, w1, s1):
        h = x.to(torch.float32)
        h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        y = gemv.gemv((nw * h.to(x.dtype)).reshape(-1, K), w1, s1, None).view(1, 1, N)
        return y.float() + 1.0

    got = _compiled(other, x, nw, w1, s1)
    assert graph_fusion.FUSION.counts == {"graphs": 1, "norms": 0, "residuals": 0}
    assert torch.equal(got, _compiled(other, x, nw, w1, s1, fusion=False))


@pytest.mark.triton("interpret")
@pytest.mark.parametrize("arch,folds", [("llama", 4), ("qwen2", 4), ("mixtral", 2), ("qwen2_moe", 2)])
def test_the_engine_folds_every_layers_norms_and_adds_into_its_gemvs(arch, folds):
    """Through the engine's compile (what `mpsconvert generate` runs on CUDA): every decoder
    layer's two norms and two residual adds go into its GEMVs (Qwen2: q/k/v with a bias, which
    the GEMV adds after the norm's 1 / rms), and where an MoE block follows the post-attention
    norm (its experts are not a GEMV; Qwen2-MoE's shared expert and router read that norm too)
    that norm and the block's add stay. The greedy tokens are the eager engine's."""
    import torch._inductor.config as config

    from mpsconvert.runtime import engine

    model = fp8_gemv_model(arch)
    prompt = [5, 6, 7, 8]
    want = engine.generate_ids(engine.Engine(model, compile=False), prompt, engine.Sampling(max_tokens=6)).tokens
    eng = engine.Engine(model, compile=True)
    with config.patch(force_disable_caches=True):  # a graph from the cache on disk does not pass through the pass
        got = engine.generate_ids(eng, prompt, engine.Sampling(max_tokens=6))
    assert eng.graph_fusion == {"norms": folds, "residuals": folds}, eng.graph_fusion
    assert got.tokens == want
