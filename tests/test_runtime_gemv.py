"""The Triton decode GEMV (runtime/ops/triton/gemv.py), interpreted on CPU: per-row, per-tensor
and per-block weight scales give the product of the dequantized weight, ragged edges included."""

from __future__ import annotations

import pytest
import torch

from mpsconvert.runtime.ops.triton import gemv as triton_gemv


def _weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn), g


@pytest.mark.triton("interpret")
@pytest.mark.parametrize("n,k,block", [(200, 300, 128), (96, 160, 32), (256, 256, 64)])
def test_block_scaled_gemv_is_the_dequantized_product(n, k, block):
    from mpsconvert.format import fp8

    codes, g = _weight(n, k)
    scale = torch.rand(-(-n // block), -(-k // block), generator=g) + 0.05  # every block its own scale
    x = torch.randn(3, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    ref = x.float() @ fp8.dequantize(codes, scale, torch.float32, block).T + bias.float()
    y = triton_gemv.gemv(x, codes, scale, bias, block).float()
    assert y.shape == (3, n)
    assert (y - ref).abs().max() <= 1e-2 * ref.abs().max(), (y - ref).abs().max()
    # the scales of a block are where they belong: a block of the grid made 0 zeroes its rows' share
    scale[0, -1] = 0
    ref0 = x.float() @ fp8.dequantize(codes, scale, torch.float32, block).T + bias.float()
    y0 = triton_gemv.gemv(x, codes, scale, bias, block).float()
    assert (y0 - ref0).abs().max() <= 1e-2 * ref0.abs().max()
    assert (y0[:, :block] - y[:, :block]).abs().max() > 1e-2 * ref.abs().max() and torch.equal(
        y0[:, block:], y[:, block:]
    )


@pytest.mark.triton("interpret")
@pytest.mark.parametrize("per_row", [True, False])
def test_row_and_tensor_scaled_gemv_is_the_dequantized_product(per_row):
    codes, g = _weight(72, 136, seed=1)
    scale = torch.rand(72 if per_row else 1, generator=g) + 0.05
    x = torch.randn(2, 136, generator=g).to(torch.bfloat16)
    ref = x.float() @ (codes.float() * scale[:, None]).T
    y = triton_gemv.gemv(x, codes, scale, None).float()
    assert (y - ref).abs().max() <= 1e-2 * ref.abs().max(), (y - ref).abs().max()


def test_block_scales_the_gemv_cannot_read_are_refused():
    assert triton_gemv.takes_block(128) and triton_gemv.takes_block(32)
    assert not triton_gemv.takes_block(16) and not triton_gemv.takes_block(None) and not triton_gemv.takes_block(48)
    codes, _ = _weight(64, 64)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    y = torch.empty(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 32"):
        triton_gemv._args(x, codes, torch.ones(4, 4), None, y, block=16)
    with pytest.raises(ValueError, match=r"are \[1, 1\], got \[2, 1\]"):
        triton_gemv._args(x, codes, torch.ones(2, 1), None, y, block=128)


@pytest.mark.triton("interpret")
@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("per_row,bias", [(True, False), (False, True)])
def test_gated_decode_is_silu_gate_times_up_of_the_plain_product(dot, per_row, bias):
    """The gated form of the decode GEMVs (a gated MLP's [gate; up] rows in one weight) returns
    what the module computes from the plain kernel's output: silu(gate) * up, each rounded to the
    activation dtype, for per-row and per-tensor scales, with a bias, ragged edges included."""
    from mpsconvert.runtime.ops.triton import act_quant

    n, k = 40, 136  # 40 gate rows and 40 up rows: the last tile of each half ragged
    codes, g = _weight(2 * n, k, seed=2)
    scale = torch.rand(2 * n if per_row else 1, generator=g) + 0.05
    b = (torch.randn(2 * n, generator=g) * 4).to(torch.bfloat16) if bias else None
    x = torch.randn(3, k, generator=g).to(torch.bfloat16)
    if dot:  # the plain product in float32 (the same sums in the same order, unrounded)
        xq, xs = act_quant.quantize(x)
        plain = triton_gemv.dot_gemv(xq, xs, codes, scale, b, torch.float32)
        got = triton_gemv.dot_gemv(xq, xs, codes, scale, b, torch.bfloat16, gated=True)
    else:
        plain = triton_gemv.gemv(x.float(), codes, scale, None if b is None else b.float())
        got = triton_gemv.gemv(x, codes, scale, b, gated=True)
    gate, up = plain.bfloat16().split(n, dim=-1)  # the projections' outputs, as the layers return them
    want = torch.nn.functional.silu(gate) * up  # the module's own ops on bfloat16 tensors
    assert got.shape == (3, n) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)  # the same sums, then the module's roundings
    with pytest.raises(ValueError, match="equal counts"):
        triton_gemv.gemv(x, codes[:-1], scale[:-1] if per_row else scale, None, gated=True)
    with pytest.raises(ValueError, match="not block scales"):
        triton_gemv._args(
            x, codes, torch.ones(1, 2), None, torch.empty(3, n, dtype=torch.bfloat16), block=128, gated=True
        )


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Llama's), op for op, on x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.triton("interpret")
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("per_row,bias", [(True, False), (False, True)])
def test_the_norm_folded_into_the_gemv_is_the_gemv_of_the_norm(gated, per_row, bias):
    """With `norm`, the GEMV reads an RMSNorm's input and computes the product of its output: the
    weight's columns times the norm's weight, each sum times the row's 1 / rms at the end. It
    skips the norm output's two roundings to the activation dtype, so against the float64
    product it is at least as close as the plain GEMV of the module's norm output, and it stays
    within a few of those roundings of that GEMV; a wrong eps, weight or row fails."""
    from mpsconvert.format.fp8 import relative_error

    n, k, eps = 40, 136, 1e-5
    codes, g = _weight(2 * n if gated else n, k, seed=3)
    scale = torch.rand(codes.shape[0] if per_row else 1, generator=g) + 0.05
    b = (torch.randn(codes.shape[0], generator=g) * 4).to(torch.bfloat16) if bias else None
    x = (torch.randn(3, k, generator=g) * 8).to(torch.bfloat16)
    x[1] *= 50  # rows of other scales: each its own rms
    nw = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16)
    got = triton_gemv.gemv(x, codes, scale, b, gated=gated, norm=nw, eps=eps).float()
    want = triton_gemv.gemv(_rms_norm(x, nw, eps), codes, scale, b, gated=gated).float()
    assert got.shape == want.shape == (3, n)
    h = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps) * nw.double()
    exact = h @ (codes.double() * scale.double()[:, None]).T + (0 if b is None else b.double())
    if gated:
        exact = torch.nn.functional.silu(exact[:, :n]) * exact[:, n:]
    assert relative_error(got.double(), exact) <= relative_error(want.double(), exact) * 1.05
    assert relative_error(got, want) < 2**-7
    other = triton_gemv.gemv(x, codes, scale, b, gated=gated, norm=nw, eps=100.0).float()
    assert relative_error(other, want) > 2**-6  # eps is read
    with pytest.raises(ValueError, match=r"weight of \[136\]"):
        triton_gemv.gemv(x, codes, scale, b, gated=gated, norm=nw[:-1], eps=eps)


@pytest.mark.triton("interpret")
@pytest.mark.parametrize("gated", [False, True])
def test_the_residual_folded_into_the_gemv_is_the_add_bit_for_bit(gated):
    """With `residual`, the GEMV's output is added to it in the kernel, rounded as the eager
    `residual + y` on bfloat16 tensors rounds: equal bit for bit (the add is a decoder layer's
    residual stream, so it must not drift)."""
    n, k = 40, 136
    codes, g = _weight(2 * n if gated else n, k, seed=4)
    scale = torch.rand(codes.shape[0], generator=g) + 0.05
    x = torch.randn(3, k, generator=g).to(torch.bfloat16)
    r = (torch.randn(3, n, generator=g) * 30).to(torch.bfloat16)
    plain = triton_gemv.gemv(x, codes, scale, None, gated=gated)
    got = triton_gemv.gemv(x, codes, scale, None, gated=gated, residual=r)
    assert torch.equal(got, r + plain)
    nw = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16)  # both folded: the norm's product, then the add
    both = triton_gemv.gemv(x, codes, scale, None, gated=gated, norm=nw, eps=1e-6, residual=r)
    assert torch.equal(both, r + triton_gemv.gemv(x, codes, scale, None, gated=gated, norm=nw, eps=1e-6))
    with pytest.raises(ValueError, match=r"is \[3, 40\], got \[3, 39\]"):
        triton_gemv.gemv(x, codes, scale, None, gated=gated, residual=r[:, :-1])
