"""Split-KV decode attention (flash-decoding) with grouped key/value heads, in one kernel, and its
custom op. How transformers' attention calls reach it: runtime/patches/attention.py.

The cache of each (sequence, key/value head) is split into chunks across programs so that every
SM has work; each program computes its chunk's partial softmax (accumulator, row max, row sum).
The partials are combined by the program that finishes its group last, not by a second kernel:
in a CUDA-graph decode step of a 32-layer Llama on an H100 the combine kernel took 1.7 us per
layer plus the gap before the next launch (~1 us): one launch per layer, 32 per step, fewer now
(not yet measured on a GPU: the last program reads the group's partials back itself). How the last program
knows it is last: every program stores its partials, then (one thread, after a CTA barrier so
that all the program's stores come first) adds 1 to its group's counter with acq_rel semantics
at GPU scope; the release makes the program's partials visible to whoever later acquires the
counter, so the program that reads S - 1 (all S of the group have stored) loads every partial,
writes the group's G x Lq output rows and sets the counter back to 0. Every counter is 0 again
when a launch ends: the buffer is allocated zeroed once per device and never reset by the host,
which is what lets CUDA-graph replays (and successive layers) reuse it. With one chunk per group
the program writes its output directly (no partials, no counter).

Under TRITON_INTERPRET=1 (the tests) programs run one after another, so the tests check the
combine's arithmetic and the counter's return to 0, not the ordering between concurrent
programs; that rests on the acq_rel atomic and the barrier before it.
"""

from __future__ import annotations

import torch

from .. import triton as tritonlib
from .launch import next_pow2
from . import INTERPRET, tl, triton

MAX_QUERY = 4  # queries per sequence the decode kernel takes (decode, speculative steps)
_BLOCK_KV = 64
_WAVES = 4  # programs per SM the cache is split into: fewer tiles each, less of a program's time waits on memory (H200:
# 7.9 us per Llama-3-8B layer at 2100 cached positions, 9.5 us with 2, 10.4 with 1; results/attn_micro_h200.log)
_COMBINE_TILE = 8192  # float32 partial-accumulator elements the last program loads per step of its combine loop (a
# guess: as many loads in flight as the registers allow at 4 warps; not tuned on a GPU)
_MIN_COUNTERS = 4096  # the counter buffer's first size: B * Hkv groups up to it never make it grow (see _counters)
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}  # device -> every counter buffer made there, the newest last


if triton is not None:

    @triton.jit
    def _combine(
        acc_ptr, m_ptr, l_ptr, o_ptr, bh, b, kvh, sob, sol, soh, G, Lq, S,
        RP: tl.constexpr, D: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, SB: tl.constexpr,
    ):  # fmt: skip
        # The S partial softmaxes of group bh rescaled to their common max: out = sum(acc w) / sum(l w),
        # w = exp(m - max m). The weights' max and denominator from all S at once ([SPLITS, RP] floats),
        # the accumulators SB chunks at a time ([SB, RP, D]).
        r = tl.arange(0, RP)
        r_ok = r < G * Lq
        s = tl.arange(0, SPLITS)
        ms = (bh * S + s[:, None]) * RP + r[None, :]
        ok = (s[:, None] < S) & r_ok[None, :]
        m = tl.load(m_ptr + ms, mask=ok, other=float("-inf"), cache_modifier=".cg")  # (L2: written by other SMs in this launch)
        l = tl.load(l_ptr + ms, mask=ok, other=0.0, cache_modifier=".cg")
        big = tl.max(m, axis=0)
        big = tl.where(big == float("-inf"), 0.0, big)
        den = tl.sum(tl.exp(m - big[None, :]) * l, axis=0)
        den = tl.where(r_ok, den, 1.0)  # the padding rows (not stored) without 0 / 0
        d = tl.arange(0, D)
        num = tl.zeros([RP, D], tl.float32)
        for s0 in range(0, S, SB):
            sb = s0 + tl.arange(0, SB)
            okb = (sb[:, None] < S) & r_ok[None, :]
            pb = (bh * S + sb[:, None]) * RP + r[None, :]
            w = tl.exp(tl.load(m_ptr + pb, mask=okb, other=float("-inf"), cache_modifier=".cg") - big[None, :])
            acc = tl.load(acc_ptr + pb[:, :, None] * D + d[None, None, :], mask=okb[:, :, None], other=0.0, cache_modifier=".cg")
            num += tl.sum(acc * w[:, :, None], axis=0)
        h = kvh * G + r // Lq
        o = o_ptr + b * sob + (r % Lq)[:, None] * sol + h[:, None] * soh + d[None, :]
        tl.store(o, (num / den[:, None]).to(o_ptr.dtype.element_ty), mask=r_ok[:, None] & (d < HEAD_DIM)[None, :])

    @triton.jit
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, acc_ptr, m_ptr, l_ptr, cnt_ptr,
        sqb, sqh, sql, skb, skh, skl, svb, svh, svl, smb, smh, sml, sob, sol, soh,
        Hkv, G, Lq, Lk, CHUNK, S, scale,
        HAS_MASK: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_KV: tl.constexpr,
        SPLIT: tl.constexpr, RP: tl.constexpr, SPLITS: tl.constexpr, SB: tl.constexpr, F32: tl.constexpr,
    ):  # fmt: skip
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
        q = tl.load(q_ptr + b * sqb + h[:, None] * sqh + ql[:, None] * sql + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
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
                mv = tl.load(mask_ptr + b * smb + h[:, None] * smh + ql[:, None] * sml + kpos[None, :], mask=allowed, other=0)
                allowed = allowed & (mv != 0)
            if tl.max(allowed.to(tl.int32)) > 0:  # a tile the mask excludes whole is not read
                k = tl.load(k_ptr + b * skb + kvh * skh + kpos[:, None] * skl + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
                # V's load issued with K's: one trip to memory per tile, not two in a row
                v = tl.load(v_ptr + b * svb + kvh * svh + kpos[:, None] * svl + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
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
        if SPLIT:
            # the partials of this chunk (its real rows only, RP of them per chunk), then the count
            part = bh * S + split
            tl.store(m_ptr + part * RP + r, m_i, mask=row_ok)
            tl.store(l_ptr + part * RP + r, l_i, mask=row_ok)
            tl.store(acc_ptr + (part * RP + r[:, None]) * D + d[None, :], acc, mask=row_ok[:, None])
            # Every thread's stores before the one thread's atomic: Triton issues a scalar atomic from a
            # single thread and puts no barrier before it; its release then covers the whole program's
            # stores (CUDA's grid sync: __syncthreads, then one thread's fence and atomic).
            tl.debug_barrier()
            if tl.atomic_add(cnt_ptr + bh, 1, sem="acq_rel", scope="gpu") == S - 1:
                # the last of its group: every partial is stored and, by the acquire, visible. (Triton
                # shares the atomic's result through shared memory behind a barrier; this one says so.)
                tl.debug_barrier()
                tl.store(cnt_ptr + bh, 0)  # no other program of this launch touches it again
                _combine(acc_ptr, m_ptr, l_ptr, o_ptr, bh, b, kvh, sob, sol, soh, G, Lq, S,
                         RP=RP, D=D, HEAD_DIM=HEAD_DIM, SPLITS=SPLITS, SB=SB)  # fmt: skip
        else:  # the whole cache in this program: its softmax is the output (what _combine gives for S = 1)
            o = o_ptr + b * sob + ql[:, None] * sol + h[:, None] * soh + d[None, :]
            den = tl.where(row_ok, l_i, 1.0)  # the padding rows (not stored) without 0 / 0
            tl.store(o, (acc / den[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _sms(device: torch.device) -> int:
    """Multiprocessors to spread the cache over (torch caches the device properties)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def _splits(B: int, Hkv: int, Lk: int, device: torch.device) -> tuple[int, int]:
    """(chunks, positions per chunk) the cache of each (sequence, key/value head) is split into."""
    tiles = triton.cdiv(Lk, _BLOCK_KV)
    splits = min(tiles, max(1, triton.cdiv(_WAVES * _sms(device), B * Hkv)))
    chunk = triton.cdiv(tiles, splits) * _BLOCK_KV
    return triton.cdiv(Lk, chunk), chunk


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """At least `n` int32 counters on `device`, all 0 (the kernel leaves them at 0 after every launch).

    Made once per device, on the first call that splits the cache, and kept: a CUDA graph that
    captured a launch holds the buffer's address, so a buffer is never freed, and one that grows
    (more than _MIN_COUNTERS groups) is added beside the old one. It cannot be made while a CUDA
    graph is being captured (its zeroing would only run at replay, and its memory would be the
    graph's): torch.compile's CUDA graphs and timing.per_call_us run the step eagerly first, so the
    first call comes before any capture. Shared by every stream of the device: two launches that
    run at once on different streams would share counters (nothing here does that)."""
    held = _COUNTERS.setdefault(device, [])
    if held and held[-1].numel() >= n:
        return held[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"decode attention: its counter buffer for {device} ({n} groups) would be made inside CUDA "
                           "graph capture; run one decode step eagerly before capturing")
    held.append(torch.zeros(max(_MIN_COUNTERS, next_pow2(n)), dtype=torch.int32, device=device))
    return held[-1]


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D], mask bool [B, 1|Hq, Lq, Lk] or None -> [B, Lq, Hq, D]."""
    B, Hq, Lq, hd = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if q.stride(-1) != 1:
        q = q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    rows = max(16, next_pow2(G * Lq))
    D = max(16, next_pow2(hd))
    splits, chunk = _splits(B, Hkv, Lk, q.device)
    out = torch.empty(B, Lq, Hq, hd, dtype=q.dtype, device=q.device)
    rp = next_pow2(G * Lq)  # the rows of a chunk's partial: the real ones, without tl.dot's padding
    if splits > 1:
        f32 = dict(dtype=torch.float32, device=q.device)
        acc = torch.empty(B * Hkv * splits * rp * D, **f32)
        m = torch.empty(B * Hkv * splits * rp, **f32)
        l = torch.empty(B * Hkv * splits * rp, **f32)
        cnt = _counters(q.device, B * Hkv)
        split_pow2 = next_pow2(splits)
        sb = min(split_pow2, 1 << max(0, (_COMBINE_TILE // (rp * D)).bit_length() - 1))  # a power of 2, at least 1
    else:  # one program per group writes its output: no partials, no counter (pointers never read)
        acc = m = l = cnt = out
        split_pow2 = sb = 1
    if mask is not None:
        mask = mask.expand(B, mask.shape[1], Lq, Lk)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        mview = mask.view(torch.uint8)
        smb, smh, sml = mask.stride(0), mask.stride(1) if mask.shape[1] > 1 else 0, mask.stride(2)
    else:
        mview, smb, smh, sml = q, 0, 0, 0
    _decode_kernel[(B * Hkv, splits)](
        q, k, v, mview, out, acc, m, l, cnt,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        smb, smh, sml, out.stride(0), out.stride(1), out.stride(2), Hkv, G, Lq, Lk, chunk, splits, scale,
        HAS_MASK=mask is not None, ROWS=rows, D=D, HEAD_DIM=hd, BLOCK_KV=_BLOCK_KV, SPLIT=splits > 1, RP=rp,
        SPLITS=split_pow2, SB=sb, F32=INTERPRET, num_warps=4,
    )  # fmt: skip
    return out


if triton is not None:

    @torch.library.custom_op("mpsconvert::decode_attention", mutates_args=())
    def decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """softmax(q k^T * scale + mask) v for a few queries per head, grouped key/value heads."""
        return _launch(q, k, v, mask, scale)

    @decode_attention_op.register_fake
    def _(q, k, v, mask, scale):
        return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])

else:
    decode_attention_op = None


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


def decode_attention(q, k, v, mask=None, scale: float | None = None) -> torch.Tensor:
    """The kernel in eager mode, the custom op under torch.compile; returns [B, Lq, Hq, D]."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if torch.compiler.is_compiling():
        return decode_attention_op(q, k, v, mask, scale)
    return _launch(q, k, v, mask, scale)
