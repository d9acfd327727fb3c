"""q and k rotated by one Triton kernel (`rotary`), bit for bit transformers' `apply_rotary_pos_emb`
(each product, then the sum, rounded to the activation dtype; no FMA contraction). Where the
attention modules reach it: runtime/patches/rotary.py; a decode token's q/k/v GEMV rotates in its
epilogue instead where it writes a static cache (qkv_rotary.py).
"""

from __future__ import annotations

import torch

from .. import triton as tritonlib
from . import tl, triton
from .launch import launch, next_pow2

if triton is not None:
    from .act_quant import _round_to

    @triton.jit
    def _rotated(x, xp, c, s, sign, dt: tl.constexpr, PRE_ROUND: tl.constexpr):
        # x * cos + sign * partner * sin (rotate_half's: -x2 for the first half, x1 for the second) of float32 x
        # and partner xp holding dt values, each product and the sum rounded to dt, as the eager ops round them
        a = _round_to(x * c, dt, PRE_ROUND)
        b = _round_to(sign * xp * s, dt, PRE_ROUND)
        return _round_to(a + b, dt, PRE_ROUND)

    @triton.jit
    def _rotate(
        x_ptr,
        o_ptr,
        c,
        s,
        sign,
        d,
        partner,
        dmask,
        base_x,
        H,
        sxh,
        sxd,
        base_o,
        soh,
        BLOCK_H: tl.constexpr,
        PRE_ROUND: tl.constexpr,
    ):
        # one token's heads: x * cos + rotate_half(x) * sin, each product and the sum rounded
        h = tl.arange(0, BLOCK_H)[:, None]
        mask = (h < H) & dmask[None, :]
        x = tl.load(x_ptr + base_x + h * sxh + d[None, :] * sxd, mask=mask, other=0.0)
        xp = tl.load(x_ptr + base_x + h * sxh + partner[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
        y = _rotated(x.to(tl.float32), xp, c[None, :], s[None, :], sign[None, :], x.dtype, PRE_ROUND)
        tl.store(o_ptr + base_o + h * soh + d[None, :], y.to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(
        q_ptr,
        k_ptr,
        cos_ptr,
        sin_ptr,
        qo_ptr,
        ko_ptr,
        S,
        HQ,
        HK,
        sqb,
        sqh,
        sqs,
        sqd,
        skb,
        skh,
        sks,
        skd,
        scb,
        scs,
        scd,
        ssb,
        sss,
        ssd,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_HQ: tl.constexpr,
        BLOCK_HK: tl.constexpr,
        PRE_ROUND: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        b = t // S
        si = t % S
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        half = D // 2
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)  # rotate_half: (-x2, x1)
        c = tl.load(cos_ptr + b * scb + si * scs + d * scd, mask=dmask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + b * ssb + si * sss + d * ssd, mask=dmask, other=0.0).to(tl.float32)
        # outputs laid out [B, S, H, D] (viewed as [B, H, S, D]), as the eager ops lay them out
        _rotate(
            q_ptr,
            qo_ptr,
            c,
            s,
            sign,
            d,
            partner,
            dmask,
            b * sqb + si * sqs,
            HQ,
            sqh,
            sqd,
            t * HQ * D,
            D,
            BLOCK_HQ,
            PRE_ROUND,
        )
        _rotate(
            k_ptr,
            ko_ptr,
            c,
            s,
            sign,
            d,
            partner,
            dmask,
            b * skb + si * sks,
            HK,
            skh,
            skd,
            t * HK * D,
            D,
            BLOCK_HK,
            PRE_ROUND,
        )


def fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rotary` takes this call: eager on the Triton path, q [B, H, S, D] and k
    [B, Hk, S, D] with cos and sin [1 or B, S, D] (full-width rotary, even D), one dtype, no
    gradient."""
    if not tritonlib.eager_on(q) or q.ndim != 4 or k.ndim != 4 or cos.ndim != 3 or sin.shape != cos.shape:
        return False
    b, _, s, d = q.shape
    if k.shape[0] != b or k.shape[2:] != q.shape[2:] or cos.shape[1:] != (s, d) or cos.shape[0] not in (1, b) or d % 2:
        return False
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype) or not q.dtype.is_floating_point or k.device != q.device:
        return False
    return not (q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q * cos + rotate_half(q) * sin, the same for k), cos and sin broadcast over the heads, in
    one launch; the caller checks `fits` first."""
    b, hq, s, d = q.shape
    hk = k.shape[1]
    qo = torch.empty(b, s, hq, d, dtype=q.dtype, device=q.device)
    ko = torch.empty(b, s, hk, d, dtype=k.dtype, device=k.device)
    if b * s:
        cb = cos.stride(0) if cos.shape[0] > 1 else 0
        sb = sin.stride(0) if sin.shape[0] > 1 else 0
        block_d = next_pow2(d)
        args = (
            q,
            k,
            cos,
            sin,
            qo,
            ko,
            s,
            hq,
            hk,
            *q.stride(),
            *k.stride(),
            cb,
            cos.stride(1),
            cos.stride(2),
            sb,
            sin.stride(1),
            sin.stride(2),
            d,
            block_d,
            next_pow2(hq),
            next_pow2(hk),
            tritonlib.INTERPRET,
        )
        launch(_rope_kernel, (b * s,), args, num_warps=4, enable_fp_fusion=False)
    return qo.transpose(1, 2), ko.transpose(1, 2)
