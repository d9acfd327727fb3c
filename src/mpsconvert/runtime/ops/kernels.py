"""The candidate ways to compute one FP8 linear layer, per device. The policy picks among them.

Each kernel is a plain function `fn(mod, x)` of an FP8Linear `mod` (weight e4m3 [N, K], its
scales prepared once in the layouts the kernels take, optional input_scale [1], bias) and the
2-D activations `x [M, K]`, returning `[M, N]`. The layer stores the two functions it runs
(decode, prefill), so a call does no lookup, no reshape of a scale and no `.contiguous()`:

- ``scaled_mm_row`` / ``scaled_mm_tensor``: quantize the activations (per token for the dynamic
  scheme, with the calibrated scale for the static one; runtime/ops/triton/act_quant.py: one Triton kernel
  in eager mode, plain ops that Inductor fuses under torch.compile) and run `torch._scaled_mm`
  (CUDA) or `F.scaled_mm` (MPS, torch >= 2.10 API) with row-wise or tensor-wise scales.
- ``scaled_mm_block``: block-scaled weights (128 x 128) with the activations quantized per token
  and 128-feature group (FP8_BLOCK's 1 x 128), through `torch._scaled_mm`'s blockwise scaling
  (CUDA, Hopper and newer, recent torch; the scale layouts it demands are made once, in
  `blockwise_weight_scale`). Where the GPU or torch cannot run it, the policy records the error
  and chooses among ``dequant`` and ``bf16``.
- ``gemv``: the Triton FP8-weight GEMV (triton_gemv.py), BF16 activations, for decode.
- ``gemv_w8a8``: decode as the scheme computes it (activations quantized as for `_scaled_mm`),
  the e4m3 x e4m3 product on the tensor cores with the few rows padded to 16 (triton_gemv.py):
  no weight is converted element by element, which is what bounds the BF16-activation GEMV.
  Both GEMVs have a gated form for a gated MLP's fused [gate; up] layer (`GATED`), which
  returns silu(gate) * up (runtime/patches/eager_fusion.py runs it at decode).
- ``gemv_splitk``: the same product through the MoE decode kernel (moe_triton.py, one expert):
  split-K with atomic adds, which fills the GPU where few output rows leave programs idle.
- ``dequant``: dequantize the weight on every call, then a BF16 matmul (weights stay FP8 in
  memory; only worth it where the matmul dwarfs the dequantization, e.g. MPS prefill). It reads
  codes held as bytes too (fp8.fp8_to_float), so it and ``bf16`` are what a device without FP8
  matmul offers (MPS before torch 2.15: no float8, no scaled_mm).
- ``bf16``: a dense weight dequantized once at load (CPU for weight-only schemes; elsewhere only
  when it measured faster than every FP8 kernel, and then recorded as a fallback).
- ``dense_qact``: CPU for schemes that quantize activations: the dense weight, and the activations
  rounded through e4m3 with the scheme's scales (per token, or the static one) before a BF16
  matmul. That is the arithmetic of `_scaled_mm`, so accuracy measured on CPU is the scheme's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...format.fp8 import FP8_DTYPE, FP8_MAX, dequantize, fp8_to_float, per_group_scale
from . import triton as tritonlib
from .triton import act_quant
from .triton import gemv as triton_gemv
from .triton import moe_gemv as moe_triton

KERNELS = (
    "scaled_mm_row",
    "scaled_mm_tensor",
    "scaled_mm_block",
    "gemv",
    "gemv_w8a8",
    "gemv_splitk",
    "dequant",
    "bf16",
    "dense_qact",
)
DENSE = ("bf16", "dense_qact")  # kernels that read a dense weight made once at load
TRITON = ("gemv", "gemv_w8a8", "gemv_splitk")  # kernels that are our Triton kernels (compiled at first use)
# Kernels that round the activations through e4m3 as the scheme says (per token, per group, or the
# static scale). The others read BF16 activations: a layer they run under a scheme that quantizes
# activations computes weight-only arithmetic (closer to BF16 than the scheme; validate says where).
ROUNDING = ("scaled_mm_row", "scaled_mm_tensor", "scaled_mm_block", "gemv_w8a8", "dense_qact")


# The block edge torch._scaled_mm's blockwise scaling takes (1 x 128 activations, 128 x 128 weights).
SCALED_MM_BLOCK = 128


def static_scale(mod) -> torch.Tensor | None:
    """A layer's calibrated input scale under a static scheme; None where activations are per token."""
    return mod.input_scale if mod.activations == "tensor" else None


def quantize_acts(x: torch.Tensor, input_scale: torch.Tensor | None):
    """x [M, K] -> (e4m3 codes, float32 dequant scale [M, 1]): per token, or the static scale."""
    return act_quant.quantize(x, input_scale)


def _mm(xq, sa, w, sb, out_dtype, functional: bool | None = None):
    """The FP8 GEMM xq @ w.T with scales sa (rows of x, or 0-d) and sb ([1, N], or 0-d). MPS uses
    the public `F.scaled_mm` (ScalingType API, torch >= 2.10); CUDA the `torch._scaled_mm` that
    torch.compile and CUDA graphs handle today. `functional` forces one (tests run the MPS call
    form on CPU, where both exist)."""
    if functional if functional is not None else xq.device.type == "mps":
        if not hasattr(F, "scaled_mm"):
            raise RuntimeError(
                f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (torch >= 2.10 "
                "needed for FP8 matmul on MPS)"
            )
        kind = F.ScalingType.TensorWise if sa.ndim == 0 else F.ScalingType.RowWise
        return F.scaled_mm(xq, w.t(), sa, kind, sb, kind, output_dtype=out_dtype)
    # Fast accumulation, as torchao float8 inference uses: ~5-10% faster on Hopper at 2048 tokens;
    # its rounding is far below the e4m3 quantization error (validate measures the end result).
    return torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=True)


def scaled_mm_row(mod, x, quantized=None):
    xq, xs = quantized if quantized is not None else act_quant.quantize(x, static_scale(mod))
    y = _mm(xq, xs, mod.weight, mod.scale_row, x.dtype)
    return y + mod.bias if mod.bias is not None else y


def scaled_mm_tensor(mod, x, quantized=None):
    xq, _ = quantized if quantized is not None else act_quant.quantize(x, mod.input_scale)
    y = _mm(xq, mod.input_scale_0d, mod.weight, mod.scale_0d, x.dtype)
    return y + mod.bias if mod.bias is not None else y


def blockwise_weight_scale(ws: torch.Tensor) -> torch.Tensor:
    """A weight's block scale [ceil(N/128), ceil(K/128)] in the layout `F.scaled_mm`'s BlockWise128x128 takes for its
    second operand (w.T, [K, N]), as probed on an H200 with torch 2.11: [round_up(ceil(K/128), 4), ceil(N/128)],
    column-major (stride (1, rows)), the padding rows zero."""
    rn, rk = ws.shape
    buf = torch.zeros(rn, -(-rk // 4) * 4, dtype=torch.float32, device=ws.device)
    buf[:, :rk] = ws
    return buf.t()


def group_quantize(x: torch.Tensor, group: int):
    """x [M, K] -> (e4m3 codes, float32 scales [M, ceil(K/group)]): per token and group of K."""
    m, k = x.shape
    xs = per_group_scale(x, group)
    xf = x.float()
    if k % group:
        xf = F.pad(xf, (0, -k % group))
    xq = (xf.view(m, -1, group) / xs.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, -1)[:, :k]
    return xq, xs


def _group_dequantize(xq: torch.Tensor, xs: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    k = xq.shape[1]
    return (fp8_to_float(xq) * xs.repeat_interleave(group, dim=1)[:, :k]).to(dtype)


def _block_mm(
    xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale_blocks_t: torch.Tensor, out_dtype: torch.dtype
):
    return F.scaled_mm(
        xq,
        weight.t(),
        xs.t().contiguous().t(),
        F.ScalingType.BlockWise1x128,
        scale_blocks_t,
        F.ScalingType.BlockWise128x128,
        output_dtype=out_dtype,
    )


@torch.library.custom_op("mpsconvert::scaled_mm_block", mutates_args=())
def scaled_mm_block_op(
    xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale_blocks_t: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """The blockwise FP8 GEMM as one opaque op for torch.compile, as the FP8 GEMV is. On an H200
    with torch 2.11 each block-scaled layer breaks the compiled decode step (block decode runs at
    0.19x of row decode); torch 2.13 traces `F.scaled_mm` into `_scaled_mm_v2`, which dynamo
    may or may not keep in one graph per version and recipe. An op with a fake (shape-only)
    implementation is one node of the graph on every version."""
    return _block_mm(xq, xs, weight, scale_blocks_t, out_dtype)


@scaled_mm_block_op.register_fake
def _(xq, xs, weight, scale_blocks_t, out_dtype):
    return xq.new_empty(xq.shape[0], weight.shape[0], dtype=out_dtype)


def scaled_mm_block(mod, x, quantized=None):
    """FP8_BLOCK's GEMM: `F.scaled_mm` BlockWise1x128 (activations, scale [M, K/128]
    outer-dim-major) x BlockWise128x128 (weights, as `blockwise_weight_scale` lays them out);
    under torch.compile the custom op above. torch 2.11 refuses M=1 with these recipes, so a few
    rows are padded to 16 (zeros)."""
    m = x.shape[0]
    if m < 16:
        x = F.pad(x, (0, 0, 0, 16 - m))
    xq, xs = quantized if quantized is not None else group_quantize(x, SCALED_MM_BLOCK)
    mm = scaled_mm_block_op if torch.compiler.is_compiling() else _block_mm
    y = mm(xq, xs, mod.weight, mod.scale_blocks_t, x.dtype)[:m]
    return y + mod.bias if mod.bias is not None else y


QUANTIZING = (scaled_mm_row, scaled_mm_tensor)  # kernels that take an input quantized once for several layers


def gemv(mod, x):
    if mod.block:  # weight-only product with the block scales: activations as `dequant` takes them
        return triton_gemv.gemv(x, mod.weight, mod.weight_scale, mod.bias, mod.block)
    return triton_gemv.gemv(x, mod.weight, mod.scale_flat, mod.bias)


def gemv_w8a8(mod, x):
    xq, xs = act_quant.quantize(x, static_scale(mod))
    return triton_gemv.dot_gemv(xq, xs, mod.weight, mod.scale_flat, mod.bias, x.dtype)


def gemv_gated(mod, x):
    """`gemv` of a gated MLP's fused [gate; up] layer that returns silu(gate) * up [M, N / 2]."""
    return triton_gemv.gemv(x, mod.weight, mod.scale_flat, mod.bias, gated=True)


def gemv_w8a8_gated(mod, x):
    """`gemv_w8a8` of a gated MLP's fused [gate; up] layer that returns silu(gate) * up [M, N / 2]."""
    xq, xs = act_quant.quantize(x, static_scale(mod))
    return triton_gemv.dot_gemv(xq, xs, mod.weight, mod.scale_flat, mod.bias, x.dtype, gated=True)


# Decode kernels with a gated form: the gated MLP's SiLU * up computed where the fused gate/up
# product is (one launch per layer fewer, and the [M, 2I] product never written).
GATED = {gemv: gemv_gated, gemv_w8a8: gemv_w8a8_gated}


def gated_decode(mod):
    """The gated form of a fused [gate; up] layer's decode kernel (per-row or per-tensor scales),
    or None where it has none."""
    return None if mod.block else GATED.get(mod._decode_fn)


def gemv_splitk(mod, x):
    rows = torch.arange(x.shape[0], device=x.device, dtype=torch.int32)
    y = moe_triton.expert_gemv(x, rows, torch.zeros_like(rows), mod.weight.unsqueeze(0), mod.scale_row)
    return y + mod.bias if mod.bias is not None else y


def dequant(mod, x):
    return F.linear(x, dequantize(mod.weight, mod.weight_scale, x.dtype, mod.block), mod.bias)


def bf16(mod, x):
    return F.linear(x, mod.dense_weight, mod.bias)


def scheme_rounded(mod, x: torch.Tensor) -> torch.Tensor:
    """x as the layer's scheme rounds its activations before a FP8 x FP8 product (per token, or
    the static scale), in x's dtype: what `dense_qact` multiplies."""
    xq, xs = act_quant.torch_quantize(x, static_scale(mod))
    return fp8_to_float(xq).mul_(xs).to(x.dtype)


def dense_qact(mod, x):
    if mod.activations == "group":  # FP8_BLOCK's activations: per token and group of the block edge
        xq, xs = group_quantize(x, mod.block)
        return F.linear(_group_dequantize(xq, xs, mod.block, x.dtype), mod.dense_weight, mod.bias)
    return F.linear(scheme_rounded(mod, x), mod.dense_weight, mod.bias)


FNS = {
    "scaled_mm_row": scaled_mm_row,
    "scaled_mm_tensor": scaled_mm_tensor,
    "scaled_mm_block": scaled_mm_block,
    "gemv": gemv,
    "gemv_w8a8": gemv_w8a8,
    "gemv_splitk": gemv_splitk,
    "dequant": dequant,
    "bf16": bf16,
    "dense_qact": dense_qact,
}


def run(kernel: str, mod, x: torch.Tensor) -> torch.Tensor:
    fn = FNS.get(kernel)
    if fn is None:
        raise ValueError(f"unknown kernel {kernel!r}")
    return fn(mod, x)


def candidates(
    device_type: str,
    activations: str | None,
    weights: str,
    bucket: str,
    block: int | None = None,
    scaled_mm: bool = True,
) -> list[str]:
    """The kernels worth measuring for one layer on one device, for 'decode' or 'prefill'.
    `scaled_mm`: whether this device and torch run FP8 x FP8 matmuls (devices.capabilities,
    probed once per process); without, no scaled_mm kernel is offered, so none is timed and
    warned about per layer shape.

    Static per-tensor activations with per-tensor weights can use tensor-wise scaling; every
    other FP8 x FP8 combination is row-wise. Weight-only schemes keep BF16 activations, so they
    never quantize activations (no scaled_mm). Block-scaled weights: the blockwise scaled_mm
    (CUDA, 128 x 128 blocks, per-group activations), the GEMV at decode (block edges that are
    multiples of 32; it reads BF16 activations, as dequantizing does) or dequantizing; with
    static activations no GEMM takes per-tensor x per-block scales.
    """
    out: list[str] = []
    if device_type == "cpu":
        return ["bf16"] if activations is None else ["dense_qact"]
    if weights == "block":
        if device_type == "cuda" and scaled_mm and activations == "group" and block == SCALED_MM_BLOCK:
            out.append("scaled_mm_block")
        if device_type == "cuda" and bucket == "decode" and tritonlib.available() and triton_gemv.takes_block(block):
            out.append(
                "gemv"
            )  # reads the codes once, as for per-row scales (block decode ran at 0.66x of row's without it)
        return out + ["dequant", "bf16"]
    if activations is not None and scaled_mm:
        out.append("scaled_mm_tensor" if (activations == "tensor" and weights == "tensor") else "scaled_mm_row")
    if device_type == "cuda" and bucket == "decode" and tritonlib.available():
        out += ["gemv", "gemv_splitk"] + (["gemv_w8a8"] if activations is not None else [])
    if device_type == "mps" or bucket == "prefill" or not out:
        out.append("dequant")
    out.append("bf16")
    return out


def without_triton(cands: list[str]) -> str:
    """What a layer runs while our Triton kernels are held back (a machine's first run, until they
    are compiled: runtime/load/held.py): the first of `cands` that is an FP8 GEMM of torch's (its
    activations then quantized by torch ops), else dequantizing per call, never a dense copy."""
    return next((c for c in cands if c not in TRITON and c not in DENSE), "dequant")
