"""A softmax top-k MoE router in one Triton kernel: router GEMV, float32 softmax, top-k and
renormalization, one program per token. Which routers take it: runtime/patches/routing.py.
"""

from __future__ import annotations

import torch

from . import tl, triton
from .launch import TL_DTYPES, next_pow2

MAX_TOKENS = 16  # rows per call the kernel takes: decode and speculative steps
MAX_EXPERTS = 1024  # a program holds every expert's logit in registers
_TILE = 32768  # router weights per loop step of a program

if triton is not None:

    @triton.jit
    def _route_kernel(
        x_ptr,
        w_ptr,
        logits_ptr,
        scores_ptr,
        idx_ptr,
        H,
        NE,
        stride_xm,
        stride_wn,
        LOGIT_DT: tl.constexpr,
        SCORE_DT: tl.constexpr,
        TOP_K: tl.constexpr,
        RENORM: tl.constexpr,
        E: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, E)
        e_ok = e < NE
        acc = tl.zeros((E,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):  # one or a few tiles: their loads are in flight together
            offs = h0 + tl.arange(0, BLOCK_H)
            h_ok = offs < H
            x = tl.load(x_ptr + t * stride_xm + offs, mask=h_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + e[:, None] * stride_wn + offs[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        logit = acc.to(LOGIT_DT)  # F.linear's output, rounded to its dtype
        tl.store(logits_ptr + t * NE + e, logit, mask=e_ok)
        lf = tl.where(e_ok, logit.to(tl.float32), float("-inf"))
        p = tl.exp(lf - tl.max(lf, axis=0))
        p = p / tl.sum(p, axis=0)
        p = tl.where(e_ok, p, -1.0)  # padding is never chosen (probabilities are >= 0)
        total = 0.0
        left = p
        for j in tl.static_range(TOP_K):  # the k largest, in order, ties to the lower index
            best = tl.max(left, axis=0)
            i = tl.min(tl.where(left == best, e, E), axis=0)
            tl.store(idx_ptr + t * TOP_K + j, i.to(tl.int64))
            total += best
            left = tl.where(e == i, -1.0, left)
        left = p
        for j in tl.static_range(TOP_K):
            best = tl.max(left, axis=0)
            i = tl.min(tl.where(left == best, e, E), axis=0)
            v = best / total if RENORM else best
            tl.store(scores_ptr + t * TOP_K + j, v.to(SCORE_DT))
            left = tl.where(e == i, -1.0, left)


def _launch(x: torch.Tensor, weight: torch.Tensor, top_k: int, renorm: bool, score_dtype: torch.dtype):
    T, H = x.shape
    NE = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    logits = torch.empty(T, NE, dtype=x.dtype, device=x.device)
    scores = torch.empty(T, top_k, dtype=score_dtype, device=x.device)
    idx = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    E = max(2, next_pow2(NE))
    # up to 32768 weights per tile (Mixtral's whole router, 8 x 4096, in one), 64 per thread
    block = max(16, min(next_pow2(H), _TILE // E))
    _route_kernel[(T,)](
        x,
        weight,
        logits,
        scores,
        idx,
        H,
        NE,
        x.stride(0),
        weight.stride(0),
        getattr(tl, TL_DTYPES[x.dtype]),
        getattr(tl, TL_DTYPES[score_dtype]),
        top_k,
        renorm,
        E,
        block,
        num_warps=max(1, min(16, E * block // 2048)),
    )
    return logits, scores, idx


if triton is not None:

    @torch.library.custom_op("mpsconvert::route_topk", mutates_args=())
    def route_topk_op(
        x: torch.Tensor, weight: torch.Tensor, top_k: int, renorm: bool, score_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, top-k weights, expert indices) of a softmax top-k router for rows of x."""
        return _launch(x, weight, top_k, renorm, score_dtype)

    @route_topk_op.register_fake
    def _(x, weight, top_k, renorm, score_dtype):
        T = x.shape[0]
        return (
            x.new_empty(T, weight.shape[0]),
            x.new_empty(T, top_k, dtype=score_dtype),
            x.new_empty(T, top_k, dtype=torch.int64),
        )

else:
    route_topk_op = None


def route_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, renorm: bool, score_dtype: torch.dtype):
    """The kernel in eager mode, the custom op under torch.compile."""
    if torch.compiler.is_compiling():
        return route_topk_op(x, weight, top_k, renorm, score_dtype)
    return _launch(x, weight, top_k, renorm, score_dtype)
