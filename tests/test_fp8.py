import math

import pytest
import torch

from mpsconvert.errors import QuantizationError
from mpsconvert.format import fp8

pytestmark = pytest.mark.core  # CI's floor lane runs these on the lowest torch and transformers


@pytest.mark.parametrize("copies", [1, fp8.CAST_BELOW // 256 + 1])  # the cast of a few codes, the bit move of many
def test_fp8_to_float_is_exact_for_every_code(copies):
    codes = torch.arange(256, dtype=torch.uint8).repeat(copies).view(torch.float8_e4m3fn)
    ours = fp8.fp8_to_float(codes)
    ref = codes.float()
    finite = torch.isfinite(ref)
    assert torch.equal(ours[finite], ref[finite])
    assert finite.sum() == 254 * copies  # 0x7f and 0xff are NaN in e4m3fn


@pytest.mark.parametrize("gran", ["row", "tensor"])
def test_quantize_matches_reference_cast_and_scale(gran):
    torch.manual_seed(0)
    w = torch.randn(96, 80) * torch.linspace(0.01, 3, 96)[:, None]
    q, s, st = fp8.quantize(w, gran)
    amax = w.abs().amax(dim=1, keepdim=True) if gran == "row" else w.abs().amax().reshape(1)
    assert torch.equal(s, amax / 448)
    ref = (w / s.reshape(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
    # the largest value of each row (or of the tensor) maps onto +-448 exactly
    assert fp8.fp8_to_float(q).abs().max().item() == 448.0
    deq = fp8.dequantize(q, s, torch.float32)
    err = ((deq - w) ** 2).sum()
    assert math.isclose(st.sqnr_db, 10 * math.log10(float((w**2).sum() / err)), rel_tol=1e-6)
    # e4m3 has 3 mantissa bits: relative error of normal values at most 2**-4
    assert ((deq - w).abs() <= w.abs() * 2**-4 + s.reshape(-1, 1) * 2**-9).all()


def test_all_zero_rows_get_a_floor_scale_and_zero_codes():
    w = torch.randn(4, 32)
    w[2] = 0
    q, s, st = fp8.quantize(w, "row")
    assert s[2].item() == pytest.approx(fp8.SCALE_FLOOR)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert (fp8.fp8_to_float(q[2]) == 0).all()
    assert st.zero_rows == 1
    q, s, st = fp8.quantize(torch.zeros(8, 16), "tensor")
    assert s.item() == pytest.approx(fp8.SCALE_FLOOR) and math.isnan(st.sqnr_db)  # no signal: undefined, not "exact"


def test_values_beyond_448_saturate_instead_of_nan():
    w = torch.tensor([[1000.0, -2000.0, 1.0, 0.5]])
    s = torch.tensor([1.0])
    q, _, _ = fp8.quantize(w, "tensor", scale=s)
    assert fp8.fp8_to_float(q).tolist() == [[448.0, -448.0, 1.0, 0.5]]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_weight_names_the_tensor(bad):
    w = torch.randn(8, 16)
    w[3, 4] = bad
    with pytest.raises(QuantizationError, match="model.layers.0.mlp.up_proj.weight"):
        fp8.quantize(w, "row", name="model.layers.0.mlp.up_proj.weight")


def test_bf16_and_fp16_sources_quantize_like_their_float32_values():
    torch.manual_seed(1)
    w = torch.randn(64, 48).bfloat16()
    q1, s1, _ = fp8.quantize(w, "row")
    q2, s2, _ = fp8.quantize(w.float(), "row")
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
