"""Decode-time MoE GEMV in Triton: y[p] = (W[ids[p]] @ x[tok[p]]) * scale[ids[p]].

At batch 1 only the top-k experts run, each a matrix-vector product that is bound by how fast
the weights stream from memory. This kernel reads just the routed experts' FP8 rows (half the
bytes of BF16), converts them in registers and multiplies by BF16 activations, so no weight is
ever dequantized to memory and no activation quantization kernel runs.

A decode step is a few hundred tiny kernels, so launches count as much as bytes: the gate/up
GEMV can hand its float32 sums straight to the down GEMV (`out_dtype=torch.float32`: no cast
kernel), which computes `silu(gate) * up` while it loads its input (`silu_dtype`: no SiLU*up
kernel), rounded as the expert's `act_fn(gate) * up` rounds it in that dtype.
Used where `tritonlib.available()`; imports without Triton (the kernel is then not defined).
"""

from __future__ import annotations

import torch

from . import INTERPRET, compile_configs, custom_op, eager_or_op, tl, triton
from .gemv import autotuned
from .launch import TL_DTYPES

# BLOCK_N, BLOCK_K, SPLIT_K, warps. Split-K gives the down projection (N=4096, K=14336 at
# Mixtral size, 2 pairs) enough programs to fill the GPU; the autotuner picks per (N, K).
_CONFIGS = (
    (16, 256, 1, 4),
    (32, 256, 1, 4),
    (64, 128, 1, 4),
    (8, 512, 1, 4),
    (16, 512, 1, 4),
    (16, 256, 2, 4),
    (16, 256, 4, 4),
    (32, 256, 4, 4),
    (8, 512, 4, 4),
    (16, 512, 8, 4),
    (64, 256, 2, 8),
)
# TRITON_INTERPRET=1 runs the kernel on CPU tensors (tests) with one configuration: the autotuner
# needs a GPU driver. The interpreter's casts round wrongly, so there the kernel rounds by hand.
if triton is not None:
    from .act_quant import _silu_mul

    @triton.jit
    def _expert_gemv_kernel(
        x_ptr,
        tok_ptr,
        ids_ptr,
        w_ptr,
        s_ptr,
        y_ptr,
        N,
        K,
        stride_xm,
        stride_we,
        stride_wn,
        stride_se,
        stride_ym,
        SILU: tl.constexpr,
        ACT: tl.constexpr,
        PRE_ROUND: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):
        pid_s = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        t = tl.load(tok_ptr + pid_s).to(tl.int64)
        e = tl.load(ids_ptr + pid_s).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        w_rows = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(x_ptr + t * stride_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            if SILU:  # x is the gate half of a fused gate/up row, the up half follows at +K
                x = _silu_mul(
                    x, tl.load(x_ptr + t * stride_xm + K + offs_k, mask=k_ok, other=0.0).to(tl.float32), ACT, PRE_ROUND
                )
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        s = tl.load(s_ptr + e * stride_se + offs_n, mask=n_ok, other=0.0)
        # y is a zeroed float32 buffer: the K splits add their partial sums
        tl.atomic_add(y_ptr + pid_s * stride_ym + offs_n, acc * s, mask=n_ok)

    _kernel = autotuned(
        _expert_gemv_kernel,
        [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=w) for bn, bk, sk, w in _CONFIGS],
        key=["N", "K"],
        name="gemv_splitk",
        reset_to_zero=["y_ptr"],
    )


def _args(x, tok, ids, codes, scale, y, silu_dtype) -> tuple:
    """The kernel's arguments, as its launch and `precompile` pass them."""
    _, N, K = codes.shape
    return (
        x,
        tok,
        ids,
        codes,
        scale,
        y,
        N,
        K,
        x.stride(0),
        codes.stride(0),
        codes.stride(1),
        scale.stride(0),
        y.stride(0),
        silu_dtype is not None,
        getattr(tl, TL_DTYPES[silu_dtype or torch.float32]),
        INTERPRET,
    )


def precompile(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, silu_dtype: torch.dtype | None = None) -> int:
    """Compile every configuration for a call like `expert_gemv(x, tok, ids, codes, scale,
    silu_dtype=...)`, several at once (ops/triton `compile_configs`). Returns how many."""
    if triton is None or INTERPRET:
        return 0
    rows = torch.zeros(1, dtype=torch.int32, device=x.device)
    y = torch.zeros(1, codes.shape[1], dtype=torch.float32, device=x.device)
    return compile_configs(_kernel, *_args(x.contiguous(), rows, rows, codes, scale, y, silu_dtype))


def _out_dtype(x: torch.Tensor, out_dtype, silu_dtype) -> torch.dtype:
    """y's dtype when the caller names none: the SiLU input's rounding dtype, else x's."""
    if silu_dtype is not None and silu_dtype not in TL_DTYPES:
        raise ValueError(f"silu_dtype must be one of {list(TL_DTYPES)}, got {silu_dtype}")
    return out_dtype or silu_dtype or x.dtype


def _launch(
    x: torch.Tensor,
    tok: torch.Tensor,
    ids: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    silu_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """For each pair p: x[tok[p]] [K] times expert ids[p]'s FP8 weight [N, K] (row scales
    scale[E, N]) -> y [P, N] in `out_dtype` (default x's dtype; float32 leaves out the cast).

    silu_dtype: x [*, 2K] holds fused gate/up rows (e.g. this function's float32 output), and
    the product is taken with `silu(gate) * up`, each step rounded to silu_dtype as the
    expert's `act_fn(gate) * up` on a silu_dtype tensor rounds it."""
    out_dtype = _out_dtype(x, out_dtype, silu_dtype)
    P = ids.numel()
    E, N, K = codes.shape
    x = x.contiguous()
    y = torch.zeros(P, N, dtype=torch.float32, device=x.device)
    grid = lambda meta: (P, triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
    fixed = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2} if INTERPRET else {}
    _kernel[grid](*_args(x, tok, ids, codes, scale, y, silu_dtype), **fixed)
    return y if out_dtype == torch.float32 else y.to(out_dtype)


def _fake(x, tok, ids, codes, scale, out_dtype=None, silu_dtype=None):
    return x.new_empty(ids.numel(), codes.shape[1], dtype=_out_dtype(x, out_dtype, silu_dtype))


# The kernel itself in eager mode; under torch.compile the custom op `mpsconvert::expert_gemv`.
expert_gemv = eager_or_op(_launch, custom_op("mpsconvert::expert_gemv", _launch, _fake))
