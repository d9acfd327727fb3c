"""A decode token's q/k/v GEMV with the rotary and the cache write as its epilogue: the RMSNorm'd
token times the [q; k; v] FP8 weight, q and k rotated, q returned, k and v written into a static
cache's row at the position held on the device (runtime/patches/direct_decode.py).

Why: as a GEMV, then a rotary kernel that writes the cache, a layer's decode launched one more
kernel that read back what the GEMV had just written (Llama-3-8B shape, H100: 2.2 us and a launch
gap a layer, 32 a step). Rotating in the GEMV needs each output and its rotary partner (the rows
`d` and `d + D/2` of a head) in one program: a program takes BLOCK_N / 2 rows from the first
halves of heads and the rows D/2 below them, the GEMV's paired load (`gemv._row_sums`, as its
gated form pairs gate and up rows), so its tile reads as many weight bytes as the plain GEMV's
and takes the plain GEMV's recorded configuration (the autotuning key is the plain GEMV's).

Numbers: each output is rounded to the activation dtype (the GEMV's store), then rotated as
`rotary_kernel` rotates (each product and the sum rounded): bit for bit the GEMV, then the rotary
and the cache's `index_copy_`.
"""

from __future__ import annotations

import torch

from . import INTERPRET, compile_configs, tl, triton
from . import gemv as plain

# The GEMV's configurations whose BLOCK_N makes pairs: BLOCK_N / 2 rows and their partners, at least 2 of each
_CONFIGS = tuple(c for c in plain._CONFIGS if c[0] >= 4)

if triton is not None:
    from .act_quant import _round_to
    from .gemv import _row_sums, _scaled  # the GEMV's loop over K, its scales, norm and bias
    from .rotary_kernel import _rotated  # the rotary's arithmetic and roundings

    @triton.jit
    def _store_rows(rows, y, NQ, NK, qo_ptr, kc_ptr, vc_ptr, k_base, v_base, skch, svch, mask, D: tl.constexpr):
        # rows [0, NQ) into qo, [NQ, NQ + NK) into the key cache's row, the rest into the value cache's row
        kr = rows - NQ
        vr = kr - NK
        dt = qo_ptr.dtype.element_ty
        tl.store(qo_ptr + rows, y.to(dt), mask=mask & (rows < NQ))
        tl.store(kc_ptr + k_base + (kr // D) * skch + kr % D, y.to(dt), mask=mask & (kr >= 0) & (kr < NK))
        tl.store(vc_ptr + v_base + (vr // D) * svch + vr % D, y.to(dt), mask=mask & (vr >= 0))

    @triton.jit
    def _qkv_rotary_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        b_ptr,
        nw_ptr,
        cos_ptr,
        sin_ptr,
        qo_ptr,
        kc_ptr,
        vc_ptr,
        pos_ptr,
        M,
        N,
        K,
        NQ,
        NK,
        stride_wn,
        scd,
        ssd,
        skch,
        skcp,
        svch,
        svcp,
        eps,
        HAS_BIAS: tl.constexpr,
        ROW_SCALE: tl.constexpr,
        GATED: tl.constexpr,
        NORM: tl.constexpr,
        RESIDUAL: tl.constexpr,
        PRE_ROUND: tl.constexpr,
        D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # w [N, K] holds the q rows [0, NQ), the k rows [NQ, NQ + NK) and the v rows, in heads of D; x [1, K].
        # Program p takes the first-half rows `lo` (the p-th BLOCK_N / 2 of them, counted over all heads) and
        # their partners lo + D / 2. M, GATED and RESIDUAL (1, False, False) complete the plain GEMV's key.
        j = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        mask = j < N // 2
        d = j % (D // 2)
        lo = (j // (D // 2)) * D + d
        hi = lo + D // 2
        w_rows = w_ptr + lo[:, None].to(tl.int64) * stride_wn
        pair = (D // 2) * stride_wn
        y, yp, sq = _row_sums(x_ptr, w_rows, pair, nw_ptr, s_ptr, K, mask, NORM, True, 0, BLOCK_N // 2, BLOCK_K)
        rstd = 1.0
        if NORM:
            rstd = tl.math.rsqrt(sq / K + eps)
        dt = qo_ptr.dtype.element_ty  # each output as the GEMV would store it:
        y = _round_to(_scaled(y, lo, mask, rstd, s_ptr, b_ptr, NORM, True, ROW_SCALE, HAS_BIAS), dt, PRE_ROUND)
        yp = _round_to(_scaled(yp, hi, mask, rstd, s_ptr, b_ptr, NORM, True, ROW_SCALE, HAS_BIAS), dt, PRE_ROUND)
        c_lo = tl.load(cos_ptr + d * scd, mask=mask, other=0.0).to(tl.float32)
        s_lo = tl.load(sin_ptr + d * ssd, mask=mask, other=0.0).to(tl.float32)
        c_hi = tl.load(cos_ptr + (d + D // 2) * scd, mask=mask, other=0.0).to(tl.float32)
        s_hi = tl.load(sin_ptr + (d + D // 2) * ssd, mask=mask, other=0.0).to(tl.float32)
        rotate = lo < NQ + NK  # q and k; v as it is
        out_lo = tl.where(rotate, _rotated(y, yp, c_lo, s_lo, -1.0, dt, PRE_ROUND), y)
        out_hi = tl.where(rotate, _rotated(yp, y, c_hi, s_hi, 1.0, dt, PRE_ROUND), yp)
        pos = tl.load(pos_ptr).to(tl.int64)
        k_base, v_base = pos * skcp, pos * svcp
        _store_rows(lo, out_lo, NQ, NK, qo_ptr, kc_ptr, vc_ptr, k_base, v_base, skch, svch, mask, D)
        _store_rows(hi, out_hi, NQ, NK, qo_ptr, kc_ptr, vc_ptr, k_base, v_base, skch, svch, mask, D)

    _kernel = plain.autotuned(
        _qkv_rotary_kernel,
        plain._block_configs(_CONFIGS),
        key=["N", "K", "M", "GATED", "NORM", "RESIDUAL"],
        name="gemv",
    )


def fits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, heads: tuple, keys, values) -> bool:
    """Whether `qkv_rotary` takes this call: one token x [1, K] in the caches' dtype, a [q; k; v]
    weight of (hq + 2 hk) * d rows with per-row or per-tensor scales, caches [1, hk, L, d] with rows
    of contiguous d on x's device, d even."""
    hq, hk, d = heads
    if x.shape[0] != 1 or d % 2 or weight.shape[0] != (hq + 2 * hk) * d or scale.numel() not in (1, weight.shape[0]):
        return False
    want = torch.Size((1, hk, keys.shape[2], d))
    return (
        keys.shape == values.shape == want
        and keys.dtype == values.dtype == x.dtype
        and keys.stride(-1) == values.stride(-1) == 1
        and keys.device == values.device == x.device
    )


def qkv_rotary(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    norm: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    heads: tuple,
) -> torch.Tensor:
    """For one token x [1, K] (the RMSNorm's input, `norm` its weight): q, k, v = the GEMV of the
    normed x with the [q; k; v] weight (`gemv.gemv(..., norm=norm)`), q and k rotated by cos and
    sin [1, 1, d] (`rotary_kernel.rotary`), k and v written into `keys` and `values` at
    `position` (a 0-d or [1] integer tensor on the device, read by the kernel, so a captured step
    follows it). Returns q, [1, hq, 1, d]. `heads`: (hq, hk, d); the caller checks `fits` first."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    qo = torch.empty(1, 1, heads[0], heads[2], dtype=x.dtype, device=x.device)
    args, kw = _args(x, weight, scale, bias, norm, eps, cos, sin, qo, keys, values, position, heads)
    grid = lambda meta: (triton.cdiv(weight.shape[0] // 2, meta["BLOCK_N"] // 2),)  # noqa: E731
    fixed = {"BLOCK_N": 16, "BLOCK_K": 64} if INTERPRET else {}
    _kernel[grid](*args, **kw, **fixed)
    return qo.transpose(1, 2)


def _args(x, weight, scale, bias, norm, eps, cos, sin, qo, keys, values, position, heads) -> tuple[tuple, dict]:
    """The kernel's arguments, as `qkv_rotary` and `precompile` pass them."""
    hq, hk, d = heads
    n, k = weight.shape
    args = (
        x,
        weight,
        scale,
        bias if bias is not None else scale,
        norm,
        cos,
        sin,
        qo,
        keys,
        values,
        position,
        1,
        n,
        k,
        hq * d,
        hk * d,
        weight.stride(0),
        cos.stride(-1),
        sin.stride(-1),
        keys.stride(1),
        keys.stride(2),
        values.stride(1),
        values.stride(2),
        float(eps),
    )
    kw = {
        "HAS_BIAS": bias is not None,
        "ROW_SCALE": scale.numel() != 1,
        "GATED": False,
        "NORM": True,
        "RESIDUAL": False,
        "PRE_ROUND": INTERPRET,
        "D": d,
    }
    return args, kw


def precompile(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, heads: tuple) -> int:
    """Compile the kernel's configurations for a [q; k; v] weight like this one (x [1, K] in the
    activation dtype; `heads` (hq, hk, d)) and call it once on scratch tensors, so that its
    autotuner's choice is on disk for the load's own first call (runtime/load/prewarm.py).
    Returns how many were compiled."""
    if triton is None or INTERPRET:
        return 0
    hq, hk, d = heads
    cos = torch.ones(1, 1, d, dtype=x.dtype, device=x.device)
    cache = [torch.zeros(1, hk, 1, d, dtype=x.dtype, device=x.device) for _ in range(2)]
    norm, position = (
        torch.ones(x.shape[1], dtype=x.dtype, device=x.device),
        torch.zeros((), dtype=torch.long, device=x.device),
    )
    qo = torch.empty(1, 1, hq, d, dtype=x.dtype, device=x.device)
    args, kw = _args(x, weight, scale, None, norm, 1e-6, cos, cos, qo, *cache, position, heads)
    compiled = compile_configs(_kernel, *args, **kw)
    qkv_rotary(x, weight, scale, None, norm, 1e-6, cos, cos, *cache, position, heads)
    return compiled
