"""Activation quantization for FP8 x FP8 matmuls: one pass per row, in one kernel.

Why a kernel of our own: quantizing an activation per token is amax -> divide -> clamp -> cast. As eager PyTorch ops
that is four or five kernels and as many trips through memory; through a `torch.compile`d function it is one kernel, but
every call then pays dynamo's guard checks on the host (about 0.4 ms per Linear in a loaded 8B model, which left the GPU
idle two thirds of an eager prefill). One Triton program per row reads the row once, takes its amax, and writes the e4m3
codes and the row's dequant scale: one launch, one read, one write, a few microseconds of host time
(runtime/ops/triton/launch.py). Inside a compiled model the same arithmetic runs as plain torch ops instead, so that
Inductor can fuse it into the op that produces the activation (RMSNorm, SiLU * up).

The numbers are exactly those of `fp8.per_token_scale` + clamp + cast (`torch_quantize` below):
scale = max(amax / 448, 1e-12), codes = e4m3(clamp(x / scale, +-448)) with round-to-nearest-even.
`silu_mul_quantize` quantizes `silu(g) * u` of a fused gate/up output, rounding `silu(g)` and the
product to the activation dtype first, as the unfused `act_fn(gate) * up` does (MoE experts).

`rms_norm_quantize` is transformers' RMSNorm (Llama's arithmetic: float32 mean of squares,
rsqrt, the normalized row rounded to the activation dtype, times the weight, rounded again) with
the quantization of its output in the same program, for the layers that read the norm's output
(runtime/patches/eager_fusion.py): one launch where eager PyTorch runs seven, and one read of the row.

Triton is optional: without it (CPU, MPS) or inside torch.compile, the torch ops run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ....format.fp8 import FP8_DTYPE, FP8_MAX, SCALE_FLOOR
from . import INTERPRET, eager_on, tl, triton
from .launch import launch, next_pow2

# Under TRITON_INTERPRET=1 (the tests) the interpreter's float32 -> e4m3 cast rounds wrongly where
# rounding carries into the exponent (126.9 -> 64), so in that mode the kernel rounds to the e4m3
# grid itself first (exact, checked against torch's cast) and the cast has nothing left to round.
# On a GPU the hardware cast (round to nearest even) does it.
_ONE_PASS_MAX = 16384  # rows up to this many elements are held in registers: one read of x


# -- the reference arithmetic (and what runs inside torch.compile, on CPU and MPS) -------------------


def torch_quantize(x: torch.Tensor, scale: torch.Tensor | None = None, rows_scale: torch.Tensor | None = None):
    """x [M, K] -> (e4m3 codes [M, K], float32 dequant scale [M, 1]).

    scale: a static [1] scale for every row; rows_scale: a static scale per row [M]; neither:
    dynamic per-token scales (amax / 448, floored)."""
    xf = x.float()
    if rows_scale is not None:
        s = rows_scale.float().reshape(-1, 1)
    elif scale is not None:
        s = (
            scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
        )  # _scaled_mm takes contiguous row scales only
    else:
        s = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=SCALE_FLOOR)
    q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, s


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [M, 2I] gate/up output, in h's dtype (as `act_fn(gate) * up`)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_silu_mul_quantize(h: torch.Tensor, scale=None, rows_scale=None):
    return torch_quantize(silu_mul(h), scale, rows_scale)


# -- Triton ------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _to_e4m3_grid(v):
        # Round float32 v (|v| <= 448) to the nearest e4m3 value, ties to even: Veltkamp's split
        # keeps 4 significant bits of a normal number; below e4m3's smallest normal (2**-6) the
        # grid is fixed-point 2**-9, rounded by adding and removing 1.5 * 2**14.
        c = v * 1048577.0
        hi = c - (c - v)
        a = tl.abs(v)
        fixed = (a + 24576.0) - 24576.0
        fixed = tl.where(v < 0, -fixed, fixed)  # keeps the sign of values that round to zero (-0)
        return tl.where(a < 0.015625, fixed, hi)

    @triton.jit
    def _round_to(v, dt: tl.constexpr, PRE_ROUND: tl.constexpr):
        # float32 v rounded to the activation dtype, returned as float32. The interpreter's
        # float32 -> bf16 cast truncates, so there bf16 is rounded to nearest even by hand.
        if PRE_ROUND and dt == tl.bfloat16:
            b = v.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            return b.to(tl.float32, bitcast=True)
        else:
            return v.to(dt).to(tl.float32)

    @triton.jit
    def _silu_mul(g, u, dt: tl.constexpr, PRE_ROUND: tl.constexpr):
        # silu(g) * u of float32 g and u as a gated MLP's `act_fn(gate) * up` on dt tensors rounds
        # it: g and u in dt, silu of g rounded to dt, the product rounded to dt (as float32)
        g = _round_to(g, dt, PRE_ROUND)
        act = _round_to(g / (1.0 + tl.exp(-g)), dt, PRE_ROUND)
        return _round_to(act * _round_to(u, dt, PRE_ROUND), dt, PRE_ROUND)

    @triton.jit
    def _encode(v, s, PRE_ROUND: tl.constexpr):
        # float32 v divided by its scale, clamped to e4m3's range and (interpreter) put on its grid
        q = tl.clamp(tl.math.div_rn(v, s), -448.0, 448.0)
        if PRE_ROUND:
            q = _to_e4m3_grid(q)
        return q

    @triton.jit
    def _load_row(x_ptr, offs, mask, I, SILU: tl.constexpr, PRE_ROUND: tl.constexpr):
        if SILU:
            g = tl.load(x_ptr + offs, mask=mask, other=0.0)
            u = tl.load(x_ptr + I + offs, mask=mask, other=0.0)
            return _silu_mul(g.to(tl.float32), u.to(tl.float32), g.dtype, PRE_ROUND)
        else:
            return tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _quant_rows_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        static_ptr,
        K,
        stride_xm,
        stride_qm,
        MODE: tl.constexpr,  # 0 dynamic per row, 1 one static scale, 2 a static scale per row
        SILU: tl.constexpr,
        ONE_PASS: tl.constexpr,
        PRE_ROUND: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        m = tl.program_id(0).to(tl.int64)
        xrow = x_ptr + m * stride_xm
        qrow = q_ptr + m * stride_qm
        offs0 = tl.arange(0, BLOCK)
        if MODE == 1:
            s = tl.load(static_ptr).to(tl.float32)
        elif MODE == 2:
            s = tl.load(static_ptr + m).to(tl.float32)
        if ONE_PASS:
            mask = offs0 < K
            v = _load_row(xrow, offs0, mask, K, SILU, PRE_ROUND)
            if MODE == 0:
                s = tl.maximum(tl.max(tl.abs(v), axis=0) / 448.0, 1e-12)
            tl.store(qrow + offs0, _encode(v, s, PRE_ROUND).to(q_ptr.dtype.element_ty), mask=mask)
        else:
            if MODE == 0:
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for k0 in range(0, K, BLOCK):
                    offs = k0 + offs0
                    acc = tl.maximum(acc, tl.abs(_load_row(xrow, offs, offs < K, K, SILU, PRE_ROUND)))
                s = tl.maximum(tl.max(acc, axis=0) / 448.0, 1e-12)
            for k0 in range(0, K, BLOCK):
                offs = k0 + offs0
                mask = offs < K
                q = _encode(_load_row(xrow, offs, mask, K, SILU, PRE_ROUND), s, PRE_ROUND)
                tl.store(qrow + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + m, s)

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        r_ptr,
        w_ptr,
        sum_ptr,
        y_ptr,
        q_ptr,
        s_ptr,
        static_ptr,
        K,
        eps,
        stride_xm,
        stride_rm,
        stride_sum,
        stride_ym,
        stride_qm,
        RESIDUAL: tl.constexpr,
        QUANT: tl.constexpr,
        STATIC: tl.constexpr,
        STORE_Y: tl.constexpr,
        PRE_ROUND: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        m = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + m * stride_xm + offs, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        if RESIDUAL:  # the decoder layer's `residual + hidden_states` first, rounded as the eager add rounds
            rf = tl.load(r_ptr + m * stride_rm + offs, mask=mask, other=0.0).to(tl.float32)
            xf = _round_to(xf + rf, x.dtype, PRE_ROUND)
            tl.store(sum_ptr + m * stride_sum + offs, xf.to(sum_ptr.dtype.element_ty), mask=mask)
        r = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)  # libdevice rsqrtf, as torch.rsqrt on CUDA
        h = _round_to(xf * r, x.dtype, PRE_ROUND)  # hidden_states.to(input_dtype)
        y = _round_to(
            tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * h, x.dtype, PRE_ROUND
        )  # weight * that
        if STORE_Y:  # off where only the codes are read (a prefill's direct path: runtime/patches/eager_fusion.py)
            tl.store(y_ptr + m * stride_ym + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
        if QUANT:
            if STATIC:
                s = tl.load(static_ptr).to(tl.float32)
            else:
                s = tl.maximum(tl.max(tl.abs(y), axis=0) / 448.0, 1e-12)
            tl.store(q_ptr + m * stride_qm + offs, _encode(y, s, PRE_ROUND).to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(s_ptr + m, s)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def _launch(x: torch.Tensor, k: int, scale, rows_scale, silu: bool):
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if rows_scale is not None:
        mode, static = 2, rows_scale
    elif scale is not None:
        mode, static = 1, scale
    else:
        mode, static = 0, s
    one_pass = k <= _ONE_PASS_MAX
    block = next_pow2(k) if one_pass else 4096
    warps = _warps(block)
    if m:  # arguments in the kernel's order: x, q, s, static, K, strides, MODE, SILU, ONE_PASS, PRE_ROUND, BLOCK
        launch(
            _quant_rows_kernel,
            (m,),
            (x, q, s, static, k, x.stride(0), q.stride(0), mode, silu, one_pass, INTERPRET, block),
            num_warps=warps,
        )
    return q, s


def quantize(x: torch.Tensor, scale: torch.Tensor | None = None, rows_scale: torch.Tensor | None = None):
    """x [M, K] -> (e4m3 codes [M, K], float32 scale [M, 1]); see torch_quantize for the arguments."""
    if eager_on(x):
        return _launch(x, x.shape[-1], scale, rows_scale, silu=False)
    return torch_quantize(x, scale, rows_scale)


def silu_mul_quantize(h: torch.Tensor, scale: torch.Tensor | None = None, rows_scale: torch.Tensor | None = None):
    """quantize(silu(gate) * up) of a fused gate/up output h [M, 2I], without writing the product."""
    if eager_on(h):
        return _launch(h, h.shape[-1] // 2, scale, rows_scale, silu=True)
    return torch_silu_mul_quantize(h, scale, rows_scale)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's forward, op for op (the reference `rms_norm_quantize` is checked against)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm_quantize` takes this call: the Triton path, a row held in registers,
    weight and activations of one floating dtype (so the output's dtype is theirs)."""
    return eager_on(x) and x.shape[-1] <= _ONE_PASS_MAX and weight.dtype == x.dtype and x.dtype.is_floating_point


def rms_norm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    quantize: bool,
    scale: torch.Tensor | None = None,
    store_y: bool = True,
):
    """RMSNorm of x [M, K] (`torch_rms_norm`'s arithmetic) -> (y [M, K] in x's dtype, and with
    `quantize` y's e4m3 codes and float32 dequant scale [M, 1] as `quantize(y, scale)` gives them,
    else None, None). One Triton program per row; the caller checks `rms_norm_fits` first. With
    `quantize` and not `store_y`, y is not written (None): for a caller that reads only the codes."""
    return _norm(x, None, weight, eps, quantize, scale, store_y)[1:]


def add_rms_norm_quantize(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    quantize: bool,
    scale: torch.Tensor | None = None,
    store_y: bool = True,
):
    """`rms_norm_quantize(residual + x, ...)` with the sum in the same program: (residual + x
    [M, K] rounded to x's dtype as the eager add rounds it, y, codes, scale). A decoder layer's
    residual add followed by the next norm, one launch and one read of each row instead of two
    (runtime/patches/eager_fusion.py); the caller checks `rms_norm_fits` and that both are [M, K] of one dtype."""
    return _norm(x, residual, weight, eps, quantize, scale, store_y)


def _norm(x, residual, weight, eps, quantize, scale, store_y=True):
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    store_y = store_y or not quantize
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device) if quantize else None
    y = torch.empty(m, k, dtype=x.dtype, device=x.device) if store_y else None
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device) if quantize else None
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        total = torch.empty(m, k, dtype=x.dtype, device=x.device)
    yp = y if store_y else q  # unwritten where STORE_Y is off
    qp, sp = (q, s) if quantize else (yp, yp)  # unwritten where QUANT is off
    r, t = (residual, total) if residual is not None else (x, yp)  # unread where RESIDUAL is off
    block = next_pow2(k)
    if m:  # x, r, w, sum, y, q, s, static, K, eps, strides, RESIDUAL, QUANT, STATIC, STORE_Y, PRE_ROUND, BLOCK
        launch(
            _rms_norm_kernel,
            (m,),
            (
                x,
                r,
                weight,
                t,
                yp,
                qp,
                sp,
                scale if scale is not None else sp,
                k,
                float(eps),
                x.stride(0),
                r.stride(0),
                t.stride(0),
                yp.stride(0),
                qp.stride(0),
                residual is not None,
                quantize,
                scale is not None,
                store_y,
                INTERPRET,
                block,
            ),
            num_warps=_warps(block),
        )
    return (total if residual is not None else None, y, q, s)
