"""FP8Experts: the grouped path against a per-expert reference loop on CPU (exact routing,
close outputs), the decode GEMV kernel (Triton, interpreted on CPU), and the swap entry point."""

from __future__ import annotations

import pytest
import torch

from mpsconvert.errors import ArtifactError
from mpsconvert.format import fp8
from mpsconvert.runtime.ops.expert_loading import replace_moe_experts
from mpsconvert.runtime.ops.fp8_experts import (
    FP8Experts,
    Route,
    grouped_mm_available,
    reference_forward,
)

E, H, I = 8, 64, 48


def _experts(activations="token", granularity="row", seed=0, path=None, decode_path="auto"):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.1
    w2 = torch.randn(E, H, I, generator=g) * 0.1
    q13, s13 = zip(*[fp8.quantize(w13[e], granularity)[:2] for e in range(E)])
    q2, s2 = zip(*[fp8.quantize(w2[e], granularity)[:2] for e in range(E)])
    ins = (
        (torch.rand(E, generator=g) * 0.01 + 0.005, torch.rand(E, generator=g) * 0.001 + 0.0005)
        if activations == "tensor"
        else (None, None)
    )
    return FP8Experts(
        torch.stack(q13),
        torch.stack(s13),
        torch.stack(q2),
        torch.stack(s2),
        torch.nn.functional.silu,
        activations,
        *ins,
        path=path,
        decode_path=decode_path,
    )


def _routing(T, k=2, skip=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    logits[:, list(skip)] = -1e9
    w, idx = logits.softmax(-1).topk(k, dim=-1)
    return torch.randn(T, H, generator=g).to(torch.bfloat16), idx, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)


def test_route_groups_pairs_by_expert_exactly():
    _, idx, w = _routing(37, skip=(2, 5))
    r = Route.make(idx, w, E)
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    assert torch.equal(r.offsets, torch.cumsum(counts, 0).to(torch.int32))
    assert counts[2] == 0 and counts[5] == 0  # empty groups stay in the offsets
    assert torch.equal(r.expert_ids, idx.reshape(-1)[r.perm])
    assert torch.equal(idx[r.token_ids, r.perm % 2], r.expert_ids)  # each sorted pair is a real (token, slot)
    assert torch.equal(w.reshape(-1)[r.perm], r.weights)


@pytest.mark.parametrize("activations", ["token", "tensor", None])
@pytest.mark.parametrize("T", [1, 3, 64])
def test_grouped_matches_per_expert_loop(activations, T):
    assert grouped_mm_available(torch.device("cpu"), torch.bfloat16)
    mod = _experts(activations)
    assert mod.path == "grouped_mm"
    x, idx, w = _routing(T, skip=(6,))
    with torch.no_grad():
        got, ref = mod(x, idx, w).float(), reference_forward(mod, x, idx, w).float()
    assert got.shape == (T, H)
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-6


def test_loop_path_matches_grouped():
    x, idx, w = _routing(50)
    with torch.no_grad():
        a = _experts(path="grouped_mm")(x, idx, w)
        b = _experts(path="loop")(x, idx, w)
    assert torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2)


def test_fp8_experts_close_to_bf16_experts():
    """Against the exact BF16 math on the same dequantized weights: only the activation
    quantization differs (per token, e4m3)."""
    mod = _experts("token", "tensor")
    x, idx, w = _routing(40)
    w13, w2 = mod.dequantized("gate_up").float(), mod.dequantized("down").float()
    ref = torch.zeros(40, H)
    for t in range(40):
        for j in range(2):
            e = idx[t, j]
            g, u = (w13[e] @ x[t].float()).chunk(2)
            ref[t] += w[t, j].float() * (w2[e] @ (torch.nn.functional.silu(g) * u))
    with torch.no_grad():
        got = mod(x, idx, w).float()
    assert (got - ref).norm() <= 0.06 * ref.norm()


def test_static_scale_clips_like_fp8():
    """A static scale is applied per expert: a tiny scale saturates at 448 * scale."""
    mod = _experts("tensor")
    mod.gate_up_input_scale.fill_(1e-5)
    x, idx, w = _routing(8)
    with torch.no_grad():
        clipped = mod(x, idx, w)
    mod.gate_up_input_scale.fill_(0.05)
    with torch.no_grad():
        fine = mod(x, idx, w)
    assert not torch.allclose(clipped.float(), fine.float(), atol=1e-3)


@pytest.mark.triton("interpret")
def test_triton_decode_gemv_interpreted():
    import torch

    from mpsconvert.runtime.ops.fp8_experts import reference_forward
    from mpsconvert.runtime.ops.triton import moe_gemv as moe_triton

    E, N, K = 4, 48, 96
    g = torch.Generator().manual_seed(0)
    codes = (torch.randn(E, N, K, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(E, N, generator=g) + 0.1
    x = torch.randn(2, K, generator=g).to(torch.bfloat16)
    tok = torch.tensor([0, 1, 1], dtype=torch.int32)
    ids = torch.tensor([3, 0, 2], dtype=torch.int32)
    y = moe_triton.expert_gemv(x, tok, ids, codes, scale).float()
    ref = torch.stack([(codes[ids[p]].float() * scale[ids[p], :, None]) @ x[tok[p]].float() for p in range(3)])
    assert (y - ref).abs().max() <= 0.01 * ref.abs().max(), (y - ref).abs().max()
    # SiLU * up taken while the down GEMV loads its input: the float32 gate/up sums, rounded to
    # bf16, silu, product, as act_fn(gate) * up on the bf16 tensor does
    codes2 = (torch.randn(E, K, N // 2, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale2 = torch.rand(E, K, generator=g) + 0.1
    h = moe_triton.expert_gemv(x, tok, ids, codes, scale, out_dtype=torch.float32)
    assert h.dtype == torch.float32 and torch.equal(
        h.to(torch.bfloat16), moe_triton.expert_gemv(x, tok, ids, codes, scale)
    )
    gate, up = h.to(torch.bfloat16).chunk(2, dim=-1)
    pair = torch.arange(3, dtype=torch.int32)
    want = moe_triton.expert_gemv(torch.nn.functional.silu(gate) * up, pair, ids, codes2, scale2)
    got = moe_triton.expert_gemv(h, pair, ids, codes2, scale2, silu_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == (3, K)
    assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max(), (
        (got.float() - want.float()).abs().max()
    )
    assert (got != want).float().mean() < 0.05, (got != want).float().mean()
    mod = _experts(
        None, decode_path="triton_gemv"
    )  # weight-only: the GEMV reads BF16 activations, as the decode path does
    assert (
        mod.gate_up_codes is not None and mod.gate_up_dense is not None
    )  # the GEMV reads the codes, the grouped path the dense copy
    xx, idx, w = _routing(2)
    with torch.no_grad():
        a = mod(xx, idx, w).float()
        b = reference_forward(mod, xx, idx, w).float()
    assert (a - b).abs().max() <= 0.02 * b.abs().max(), (a - b).abs().max()
    mod.act_fn = torch.nn.functional.gelu  # not SiLU: the product is made between the two GEMVs
    with torch.no_grad():
        a = mod(xx, idx, w).float()
        b = reference_forward(mod, xx, idx, w).float()
    assert (a - b).abs().max() <= 0.02 * b.abs().max(), (a - b).abs().max()


def test_replace_refuses_experts_without_scales(tmp_path):
    from .models import tiny_moe_model

    model = tiny_moe_model("qwen3_moe", layers=1)
    tensors = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 64, 64, dtype=fp8.FP8_DTYPE),
        "model.layers.0.mlp.experts.down_proj": torch.zeros(4, 64, 32, dtype=fp8.FP8_DTYPE),
    }
    with pytest.raises(ArtifactError, match="gate_up_proj_scale"):
        replace_moe_experts(model, tensors, "cpu", activations="token")
    with pytest.raises(ArtifactError, match="quantization_config"):
        replace_moe_experts(model, tensors, "cpu")
    report = replace_moe_experts(model, {}, "cpu", activations="token")  # nothing stored: kept, and said so
    assert not report.replaced and "model.layers.0.mlp.experts" in report.skipped


def _emulated_scaled_grouped_mm(q, w, sa, sb, offs, out_dtype, use_fast_accum=False):
    """torch._scaled_grouped_mm's arithmetic (CUDA SM90 only) on CPU: group g is rows
    [offs[g-1], offs[g]) of q against w[g] ([K, N] column-major), row scales on both sides."""
    out = torch.empty(q.shape[0], w.shape[-1], dtype=torch.float32)
    start = 0
    for g, stop in enumerate(offs.tolist()):
        out[start:stop] = (q[start:stop].float() * sa[start:stop, None]) @ (w[g].float() * sb[g][None, :])
        start = stop
    return out.to(out_dtype)


@pytest.mark.parametrize("activations", ["token", "tensor"])
def test_fp8_grouped_path_quantizes_once_per_token_and_fuses_silu(monkeypatch, activations):
    """The scaled_grouped_mm path's plumbing (quantize before the gather, SiLU * up quantized in
    one step, offsets and scales) against the per-expert reference, with the GEMM emulated."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_scaled_grouped_mm, raising=False)
    mod = _experts(activations, path="scaled_grouped_mm")
    for name in ("gate_up_scale", "down_scale"):  # powers of two: the reference's BF16 weights are then exact
        getattr(mod, name).copy_(torch.exp2(torch.log2(getattr(mod, name)).round()))
    x, idx, w = _routing(33, skip=(4,))
    with torch.no_grad():
        got, ref = mod(x, idx, w).float(), reference_forward(mod, x, idx, w).float()
    # 1-2%: where the two differ by a BF16 rounding an e4m3 rounding can flip, a step of ~6% for
    # that value; a wrong expert, scale or token costs an error of the outputs' own size
    assert (got - ref).norm() <= 0.03 * ref.norm()
