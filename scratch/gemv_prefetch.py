"""Scratch: the decode GEMV with the next K tile's codes loaded before the current tile is
multiplied (a register double buffer), so each thread keeps two tiles of loads in flight. Triton
does not pipeline this loop (num_stages gives the same SASS), so without it a thread waits for
every tile it loads."""
import sys
sys.path.insert(0, "src")
from mpsconvert.runtime.ops.triton import gemv as G, triton, tl


@triton.jit
def _pf_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEPTH: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    offs = tl.arange(0, BLOCK_K)
    w0 = tl.load(w_rows + offs[None, :], mask=n_mask[:, None] & (offs < K)[None, :], other=0.0, eviction_policy="evict_first")
    if DEPTH == 3:
        w1 = tl.load(w_rows + BLOCK_K + offs[None, :], mask=n_mask[:, None] & (BLOCK_K + offs < K)[None, :], other=0.0,
                     eviction_policy="evict_first")
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs
        x = tl.load(x_ptr + m * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        ahead = k0 + (DEPTH - 1) * BLOCK_K + offs
        wn = tl.load(w_rows + ahead[None, :], mask=n_mask[:, None] & (ahead < K)[None, :], other=0.0, eviction_policy="evict_first")
        acc += w0.to(tl.float32) * x[None, :]
        if DEPTH == 3:
            w0 = w1
            w1 = wn
        else:
            w0 = wn
    y = tl.sum(acc, axis=1) * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
    tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def launch(x, w, s, bn, bk, warps, depth=2):
    import torch
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    _pf_kernel[(triton.cdiv(w.shape[0], bn), x.shape[0])](x, w, s, y, x.shape[0], w.shape[0], x.shape[1], x.stride(0), w.stride(0),
                                                           y.stride(0), BLOCK_N=bn, BLOCK_K=bk, DEPTH=depth, num_warps=warps, num_stages=1)
    return y


def launch_plain(x, w, s, bn, bk, warps):
    import torch
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    args, kw = G._args(x, w, s, None, y)
    G._fp8_gemv_kernel[(triton.cdiv(w.shape[0], bn), x.shape[0])](*args, **kw, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1)
    return y
