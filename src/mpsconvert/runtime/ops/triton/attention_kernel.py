"""Split-KV decode attention (flash-decoding) with grouped key/value heads: the Triton kernel and its
custom op. How transformers' attention calls reach it: runtime/patches/attention.py.
"""

from __future__ import annotations

import torch

from .. import triton as tritonlib
from . import INTERPRET, custom_op, eager_or_op, tl, triton
from .launch import next_pow2

MAX_QUERY = 4  # queries per sequence the decode kernel takes (decode, speculative steps)
_BLOCK_KV = 64
_WAVES = 4  # programs per SM the cache is split into: fewer tiles each, less of a program's time waits on memory (H200:
# 7.9 us per Llama-3-8B layer at 2100 cached positions, 9.5 us with 2, 10.4 with 1; results/attn_micro_h200.log)


if triton is not None:

    @triton.jit
    def _kv_tile(ptr, b, kvh, sb, sh, sl, kpos, k_ok, d, d_ok):
        # The key or value tile [BLOCK_KV, D] of sequence b's key/value head kvh at cache positions kpos (strides sb,
        # sh, sl of a [B, Hkv, Lk, D] cache), zero past the cache's end and the head's width.
        return tl.load(
            ptr + b * sb + kvh * sh + kpos[:, None] * sl + d[None, :],
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )

    @triton.jit
    def _split_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        mask_ptr,
        acc_ptr,
        m_ptr,
        l_ptr,
        sqb,
        sqh,
        sql,
        skb,
        skh,
        skl,
        svb,
        svh,
        svl,
        smb,
        smh,
        sml,
        Hkv,
        G,
        Lq,
        Lk,
        CHUNK,
        S,
        scale,
        HAS_MASK: tl.constexpr,
        ROWS: tl.constexpr,
        D: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_KV: tl.constexpr,
        F32: tl.constexpr,
    ):
        # One program: one (batch, key/value head) and one chunk of the cache, for the G query
        # heads x Lq queries that read this key/value head (rows padded to ROWS >= 16 for tl.dot).
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // Hkv
        kvh = bh % Hkv
        r = tl.arange(0, ROWS)
        row_ok = r < G * Lq
        h = kvh * G + r // Lq
        ql = r % Lq
        d = tl.arange(0, D)
        d_ok = d < HEAD_DIM
        q = tl.load(
            q_ptr + b * sqb + h[:, None] * sqh + ql[:, None] * sql + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if F32:  # the interpreter's tl.dot multiplies bf16 as raw integers: float32 there
            q = q.to(tl.float32)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        start = split * CHUNK
        for t in range(0, CHUNK, BLOCK_KV):
            kpos = start + t + tl.arange(0, BLOCK_KV)
            k_ok = kpos < Lk
            allowed = row_ok[:, None] & k_ok[None, :]
            if HAS_MASK:
                mv = tl.load(
                    mask_ptr + b * smb + h[:, None] * smh + ql[:, None] * sml + kpos[None, :], mask=allowed, other=0
                )
                allowed = allowed & (mv != 0)
            if tl.max(allowed.to(tl.int32)) > 0:  # a tile the mask excludes whole is not read
                k = _kv_tile(k_ptr, b, kvh, skb, skh, skl, kpos, k_ok, d, d_ok)
                # V's load issued with K's: one trip to memory per tile, not two in a row
                v = _kv_tile(v_ptr, b, kvh, svb, svh, svl, kpos, k_ok, d, d_ok)
                if F32:
                    k = k.to(tl.float32)
                s = tl.dot(q, tl.trans(k)) * scale
                s = tl.where(allowed, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                pv = p.to(v.dtype)
                if F32:
                    pv, v = pv.to(tl.float32), v.to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(pv, v)
                m_i = m_new
        part = bh * S + split
        tl.store(m_ptr + part * ROWS + r, m_i)
        tl.store(l_ptr + part * ROWS + r, l_i)
        tl.store(acc_ptr + (part * ROWS + r[:, None]) * D + d[None, :], acc)

    @triton.jit
    def _combine_kernel(
        acc_ptr,
        m_ptr,
        l_ptr,
        o_ptr,
        sob,
        sol,
        soh,
        Hkv,
        G,
        Lq,
        S,
        ROWS: tl.constexpr,
        D: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        # One program per output row: the chunks' partial softmaxes rescaled to their common max.
        pid = tl.program_id(0)
        bh = pid // (G * Lq)
        r = pid % (G * Lq)
        s = tl.arange(0, SPLITS)
        s_ok = s < S
        part = bh * S + s
        m = tl.load(m_ptr + part * ROWS + r, mask=s_ok, other=float("-inf"))
        l = tl.load(l_ptr + part * ROWS + r, mask=s_ok, other=0.0)
        big = tl.max(m, axis=0)
        w = tl.exp(m - tl.where(big == float("-inf"), 0.0, big))
        d = tl.arange(0, D)
        acc = tl.load(acc_ptr + (part[:, None] * ROWS + r) * D + d[None, :], mask=s_ok[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(w * l, axis=0)
        b = bh // Hkv
        h = (bh % Hkv) * G + r // Lq
        tl.store(o_ptr + b * sob + (r % Lq) * sol + h * soh + d, out.to(o_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _sms(device: torch.device) -> int:
    """Multiprocessors to spread the cache over (torch caches the device properties)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def _launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, scale: float | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for a few queries per head, grouped key/value heads: q [B, Hq, Lq, D],
    k/v [B, Hkv, Lk, D], mask bool [B, 1|Hq, Lq, Lk] or None, scale (default D ** -0.5) -> [B, Lq, Hq, D]."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    B, Hq, Lq, hd = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if q.stride(-1) != 1:
        q = q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    rows = max(16, next_pow2(G * Lq))
    D = max(16, next_pow2(hd))
    tiles = triton.cdiv(Lk, _BLOCK_KV)
    splits = min(tiles, max(1, triton.cdiv(_WAVES * _sms(q.device), B * Hkv)))
    chunk = triton.cdiv(tiles, splits) * _BLOCK_KV
    splits = triton.cdiv(Lk, chunk)
    f32 = dict(dtype=torch.float32, device=q.device)
    acc = torch.empty(B * Hkv * splits * rows * D, **f32)
    m = torch.empty(B * Hkv * splits * rows, **f32)
    l = torch.empty(B * Hkv * splits * rows, **f32)
    out = torch.empty(B, Lq, Hq, hd, dtype=q.dtype, device=q.device)
    if mask is not None:
        mask = mask.expand(B, mask.shape[1], Lq, Lk)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        mview = mask.view(torch.uint8)
        smb, smh, sml = mask.stride(0), mask.stride(1) if mask.shape[1] > 1 else 0, mask.stride(2)
    else:
        mview, smb, smh, sml = q, 0, 0, 0
    tile = {"ROWS": rows, "D": D, "HEAD_DIM": hd, "num_warps": 4}  # both kernels' rows, head width and warps
    _split_kernel[(B * Hkv, splits)](
        q,
        k,
        v,
        mview,
        acc,
        m,
        l,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        smb,
        smh,
        sml,
        Hkv,
        G,
        Lq,
        Lk,
        chunk,
        splits,
        scale,
        HAS_MASK=mask is not None,
        BLOCK_KV=_BLOCK_KV,
        F32=INTERPRET,
        **tile,
    )
    _combine_kernel[(B * Hkv * G * Lq,)](
        acc,
        m,
        l,
        out,
        *out.stride()[:3],
        Hkv,
        G,
        Lq,
        splits,
        SPLITS=next_pow2(splits),
        **tile,
    )
    return out


def _fake(q, k, v, mask=None, scale=None):
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])


decode_attention_op = custom_op("mpsconvert::decode_attention", _launch, _fake)
# The kernel in eager mode, the custom op under torch.compile.
decode_attention = eager_or_op(_launch, decode_attention_op)


def takes(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, dropout: float) -> bool:
    """Whether the decode kernel computes this call: its device, shapes, dtypes and mask (which
    other arguments a caller may pass is the caller's allow-list: runtime/patches/attention.py)."""
    if not tritonlib.runs_on(query):
        return False
    _, Hq, Lq, hd = query.shape
    if Lq > MAX_QUERY or dropout or Hq % key.shape[1] or not 16 <= hd <= 256 or key.shape[-1] != hd:
        return False
    if query.dtype not in (torch.bfloat16, torch.float16) or key.dtype != query.dtype:
        return False
    return mask is None or (mask.dtype == torch.bool and mask.ndim == 4)
