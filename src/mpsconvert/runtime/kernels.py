"""The candidate ways to compute one FP8 linear layer, per device. The policy picks among them.

Each kernel takes the 2-D activations `x [M, K]` and an FP8Linear `mod` (weight e4m3 [N, K],
weight_scale [1] or [N, 1], optional input_scale [1], bias) and returns `[M, N]`:

- ``scaled_mm_row`` / ``scaled_mm_tensor``: quantize the activations (per token for the dynamic
  scheme, with the calibrated scale for the static one) and run `torch._scaled_mm` (CUDA) or
  `F.scaled_mm` (MPS, torch >= 2.10 API) with row-wise or tensor-wise scales. On CUDA the
  activation quantization is one torch.compile'd function, so amax/divide/clamp/cast fuse into
  one pass instead of four eager kernels (which alone made the FP8 stack slower than BF16).
- ``gemv``: the Triton FP8-weight GEMV (triton_gemv.py), BF16 activations, for decode.
- ``dequant``: dequantize the weight on every call, then a BF16 matmul (weights stay FP8 in
  memory; only worth it where the matmul dwarfs the dequantization, e.g. MPS prefill).
- ``bf16``: a dense weight dequantized once at load (CPU for weight-only schemes; elsewhere only
  when it measured faster than every FP8 kernel, and then recorded as a fallback).
- ``dense_qact``: CPU for schemes that quantize activations: the dense weight, and the activations
  rounded through e4m3 with the scheme's scales (per token, or the static one) before a BF16
  matmul. That is the arithmetic of `_scaled_mm`, so accuracy measured on CPU is the scheme's.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..fp8 import FP8_DTYPE, FP8_MAX, dequantize, per_token_scale
from . import triton_gemv

KERNELS = ("scaled_mm_row", "scaled_mm_tensor", "gemv", "dequant", "bf16", "dense_qact")
DENSE = ("bf16", "dense_qact")  # kernels that read a dense weight made once at load


def _quantize_acts(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes, dequant scale [M, 1] per token, or the static [1, 1])."""
    if input_scale is None:
        scale = per_token_scale(x)
    else:
        scale = input_scale.float().reshape(1, 1)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


@functools.lru_cache(maxsize=None)
def _compiled_quantize():
    return torch.compile(_quantize_acts, dynamic=True, fullgraph=True)


def quantize_acts(x: torch.Tensor, input_scale: torch.Tensor | None):
    """Fused on CUDA (torch.compile), plain ops elsewhere (MPS/CPU have no Inductor GPU backend we rely on)."""
    if x.device.type == "cuda" and not torch.compiler.is_compiling():  # inside a compiled model Inductor fuses it anyway
        return _compiled_quantize()(x, input_scale)
    return _quantize_acts(x, input_scale)


def _mm(xq, x_scale, mod, rowwise: bool, out_dtype, functional: bool | None = None):
    """The FP8 GEMM. MPS uses the public `F.scaled_mm` (ScalingType API, torch >= 2.10); CUDA the
    `torch._scaled_mm` that torch.compile and CUDA graphs handle today. `functional` forces one
    (tests run the MPS call form on CPU, where both exist)."""
    w = mod.weight
    ws = mod.weight_scale.float()
    n = w.shape[0]
    if rowwise:
        sa = x_scale.expand(xq.shape[0], 1).contiguous() if x_scale.numel() == 1 else x_scale
        sb = ws.reshape(1, -1).expand(1, n).contiguous() if ws.numel() == 1 else ws.reshape(1, n)
    else:
        sa, sb = x_scale.reshape(()), ws.reshape(())
    if functional if functional is not None else xq.device.type == "mps":
        if not hasattr(F, "scaled_mm"):
            raise RuntimeError(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (torch >= 2.10 needed for FP8 matmul on MPS)")
        kind = F.ScalingType.RowWise if rowwise else F.ScalingType.TensorWise
        return F.scaled_mm(xq, w.t(), sa, kind, sb, kind, output_dtype=out_dtype)
    # Fast accumulation, as torchao float8 inference uses: ~5-10% faster on Hopper at 2048 tokens;
    # its rounding is far below the e4m3 quantization error (validate measures the end result).
    return torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=True)


def scaled_mm(mod, x: torch.Tensor, rowwise: bool) -> torch.Tensor:
    xq, xs = quantize_acts(x, mod.input_scale if mod.activations == "tensor" else None)
    y = _mm(xq, xs, mod, rowwise, x.dtype)
    return y + mod.bias if mod.bias is not None else y


def run(kernel: str, mod, x: torch.Tensor) -> torch.Tensor:
    if kernel == "bf16":
        return F.linear(x, mod.dense_weight, mod.bias)
    if kernel == "dense_qact":
        xq, xs = _quantize_acts(x, mod.input_scale if mod.activations == "tensor" else None)
        return F.linear((xq.float() * xs).to(x.dtype), mod.dense_weight, mod.bias)
    if kernel == "gemv":
        return triton_gemv.fp8_gemv(x, mod.weight, mod.weight_scale.float(), mod.bias)
    if kernel == "scaled_mm_row":
        return scaled_mm(mod, x, rowwise=True)
    if kernel == "scaled_mm_tensor":
        return scaled_mm(mod, x, rowwise=False)
    if kernel == "dequant":
        return F.linear(x, dequantize(mod.weight, mod.weight_scale, x.dtype), mod.bias)
    raise ValueError(f"unknown kernel {kernel!r}")


def candidates(device_type: str, activations: str | None, weights: str, bucket: str) -> list[str]:
    """The kernels worth measuring for one layer on one device, for 'decode' or 'prefill'.

    Static per-tensor activations with per-tensor weights can use tensor-wise scaling; every
    other FP8 x FP8 combination is row-wise. Weight-only schemes keep BF16 activations, so they
    never quantize activations (no scaled_mm).
    """
    out: list[str] = []
    if device_type == "cpu":
        return ["bf16"] if activations is None else ["dense_qact"]
    if activations is not None:
        out.append("scaled_mm_tensor" if (activations == "tensor" and weights == "tensor") else "scaled_mm_row")
    if device_type == "cuda" and bucket == "decode" and triton_gemv.available():
        out.append("gemv")
    if device_type == "mps" or bucket == "prefill" or not out:
        out.append("dequant")
    out.append("bf16")
    return out
