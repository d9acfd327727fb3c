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
    from mpsconvert import fp8

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
    assert (y0[:, :block] - y[:, :block]).abs().max() > 1e-2 * ref.abs().max() and torch.equal(y0[:, block:], y[:, block:])


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
        triton_gemv._args(x, codes, torch.ones(1, 2), None, torch.empty(3, n, dtype=torch.bfloat16), block=128, gated=True)
