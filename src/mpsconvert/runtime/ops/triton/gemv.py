"""FP8-weight GEMV for decode (few tokens): e4m3 weights read once, dequantized in registers.

Why: at batch 1 a linear layer is bound by weight bytes. `torch._scaled_mm` row-wise at M=1 is
slower than BF16 on the H200 (41 us vs 34 us for 14336x4096), and quantizing the activation
costs extra launches. This kernel reads the FP8 weight (half the bytes of BF16), multiplies it by
the BF16 activations in float32, applies the per-row (or per-tensor) scale once per output, and
adds the bias: no activation quantization, so it is at least as accurate as the scheme.

`gemv` launches the kernel directly in eager mode (a custom op's dispatch costs host time on
every call) and through the custom op `mpsconvert::fp8_gemv` under torch.compile, which must see
an opaque op with a fake implementation. The autotuner's choice per shape is cached on disk
(Triton's cache), so a second process does not time the configurations again.

Triton is optional: on machines without it (CPU, MPS) `tritonlib.available()` is False and
nothing here runs; the kernel policy then never offers this candidate. TRITON_INTERPRET=1 runs
the kernel on CPU tensors with one fixed configuration (the tests).
"""

from __future__ import annotations

import math

import torch

from ....format.scales import scale_shape
from . import INTERPRET, compile_configs, custom_op, eager_or_op, tl, triton, tuned

OP_NAME = "mpsconvert::fp8_gemv"
# BLOCK_N, BLOCK_K, warps, stages: few enough that a cold start compiles and times them in seconds.
# The few-rows x long-K tiles (2-8 rows of 2048-4096 codes) put a whole row's loads in flight at
# once, which is what a GEMV bound by memory latency needs on the small shapes (o_proj 4096x4096).
# (2, 2048, 4, 3) and (4, 1024, 4, 3): down_proj 4096x14336 in 22.7-22.9 us against 24.9 for the
# autotuner's best of the others, timed as CUDA graphs on an H100 (results/gemv_designs_h100.log).
_CONFIGS = (
    (4, 1024, 4, 2),
    (8, 512, 4, 2),
    (8, 1024, 4, 2),
    (16, 256, 4, 2),
    (16, 512, 4, 2),
    (16, 512, 8, 2),
    (32, 256, 4, 2),
    (32, 512, 8, 2),
    (2, 4096, 4, 1),
    (4, 2048, 4, 2),
    (4, 4096, 8, 1),
    (8, 2048, 8, 2),
    (8, 1024, 4, 3),
    (16, 512, 4, 4),
    (2, 2048, 4, 3),
    (4, 1024, 4, 3),
)


def autotune(configs, key, **kw):
    """triton.autotune with its results cached on disk where this Triton can (3.2+)."""
    try:
        return triton.autotune(configs=configs, key=key, cache_results=True, warmup=5, rep=20, **kw)
    except TypeError:  # pragma: no cover - older Triton
        return triton.autotune(configs=configs, key=key, **kw)


def autotuned(kernel, configs, key, name: str, **kw):
    """`kernel` autotuned over `configs` (`autotune`), only the configuration recorded for this
    GPU and key where ops/triton/tuned.json has one (the policy's candidate `name`); under
    TRITON_INTERPRET=1 the kernel itself, which the tests launch with fixed blocks."""
    if INTERPRET:
        return kernel
    return autotune(configs, key, prune_configs_by={"early_config_prune": tuned.prune(name, key)}, **kw)(kernel)


def _block_configs(table) -> list:
    """triton.Configs of (BLOCK_N, BLOCK_K, warps, pipeline stages) rows."""
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st) for bn, bk, w, st in table]


if triton is not None:
    from .act_quant import (  # the gated form's epilogue: silu(gate) * up, rounded as the module rounds it
        _round_to,
        _silu_mul,
    )

    @triton.jit
    def _row_sums(
        x_ptr,
        w_rows,
        pair_offset,
        nw_ptr,
        s_row,
        K,
        n_mask,
        NORM: tl.constexpr,
        PAIRED: tl.constexpr,
        SCALE_BLOCK: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # The GEMV's one pass over K: (the BLOCK_N rows' products with x, with PAIRED those of the rows
        # `pair_offset` below them (0 otherwise), x's sum of squares). NORM: x is an RMSNorm's input and nw its
        # weight: the products are of nw * x (the caller multiplies by 1 / rms). SCALE_BLOCK: s_row is the tile's
        # row of block scales, applied to x, so that each x element is scaled once, not each weight.
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_pair = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            if NORM:
                sq += x * x
                x = x * tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            if SCALE_BLOCK:
                x = x * tl.load(s_row + offs_k // SCALE_BLOCK, mask=k_mask, other=0.0)
            mask = n_mask[:, None] & k_mask[None, :]
            # (the weights are read once: evicted first, so that x and the scales stay in cache)
            w = tl.load(w_rows + offs_k[None, :], mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            if PAIRED:
                wp = tl.load(
                    w_rows + pair_offset + offs_k[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
                )
                acc_pair += wp.to(tl.float32) * x[None, :]
            acc += w * x[None, :]
        return tl.sum(acc, axis=1), tl.sum(acc_pair, axis=1), tl.sum(sq, axis=0)

    @triton.jit
    def _scaled(y, rows, mask, rstd, s_ptr, b_ptr, NORM: tl.constexpr, SCALED: tl.constexpr, ROW_SCALE: tl.constexpr,
                HAS_BIAS: tl.constexpr):  # fmt: skip
        # `_row_sums`' sums for output `rows` finished: times the norm's 1 / rms (NORM), the weight's scale (SCALED:
        # per row, or one for the tensor; block scales were applied to x), plus the bias
        if NORM:
            y = y * rstd
        if SCALED:
            if ROW_SCALE:
                y = y * tl.load(s_ptr + rows, mask=mask, other=0.0)
            else:
                y = y * tl.load(s_ptr)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        return y

    @triton.jit
    def _fp8_gemv_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        b_ptr,
        y_ptr,
        nw_ptr,
        r_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        stride_sn,
        stride_rm,
        eps,
        HAS_BIAS: tl.constexpr,
        ROW_SCALE: tl.constexpr,
        SCALE_BLOCK: tl.constexpr,
        GATED: tl.constexpr,
        PRE_ROUND: tl.constexpr,
        NORM: tl.constexpr,
        RESIDUAL: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # GATED: w holds a gated MLP's [gate; up] rows (2N x K) and y[M, N] = silu(gate) * up, rounded as the module
        # rounds it (PRE_ROUND: every rounding to the output dtype by hand, where the interpreter's casts truncate).
        # NORM: x is an RMSNorm's input and nw its weight: the product is of nw * x, and the row's 1 / rms (its sum of
        # squares taken in the same loop, which reads all of x anyway) multiplies each sum once at the end. RESIDUAL: y
        # is added to r[M, N] (rounded as a dtype add rounds).
        pid_n = tl.program_id(0)
        m = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
        s_row = s_ptr
        if SCALE_BLOCK:  # block scales [ceil(N/B), ceil(K/B)]: a tile's BLOCK_N rows (BLOCK_N divides B) share a row
            s_row = s_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_sn
        x_row = x_ptr + m * stride_xm
        y, up, sq = _row_sums(
            x_row, w_rows, N * stride_wn, nw_ptr, s_row, K, n_mask, NORM, GATED, SCALE_BLOCK, BLOCK_N, BLOCK_K
        )
        rstd = 1.0
        if NORM:
            rstd = tl.math.rsqrt(sq / K + eps)
        y = _scaled(y, offs_n, n_mask, rstd, s_ptr, b_ptr, NORM, not SCALE_BLOCK, ROW_SCALE, HAS_BIAS)
        if GATED:  # the up rows, N below (never with block scales: `_args` refuses them)
            up = _scaled(up, N + offs_n, n_mask, rstd, s_ptr, b_ptr, NORM, True, ROW_SCALE, HAS_BIAS)
            y = _silu_mul(y, up, y_ptr.dtype.element_ty, PRE_ROUND)
        if RESIDUAL:
            y = _round_to(y, y_ptr.dtype.element_ty, PRE_ROUND) + tl.load(
                r_ptr + m * stride_rm + offs_n, mask=n_mask, other=0.0
            ).to(tl.float32)
        tl.store(
            y_ptr + m * stride_ym + offs_n,
            _round_to(y, y_ptr.dtype.element_ty, PRE_ROUND).to(y_ptr.dtype.element_ty),
            mask=n_mask,
        )

    _kernel = autotuned(
        _fp8_gemv_kernel, _block_configs(_CONFIGS), key=["N", "K", "M", "GATED", "NORM", "RESIDUAL"], name="gemv"
    )


# W8A8 decode: BLOCK_N, BLOCK_K, warps, pipeline stages (BLOCK_M is 16, the smallest tl.dot tile).
_DOT_CONFIGS = (
    (16, 256, 4, 4),
    (32, 128, 4, 4),
    (32, 256, 4, 3),
    (32, 512, 4, 2),
    (64, 128, 4, 4),
    (64, 256, 4, 3),
    (16, 512, 4, 3),
    (32, 512, 4, 4),
    (64, 512, 8, 3),
    (128, 256, 8, 3),
)

if triton is not None:

    @triton.jit
    def _fp8_dot_kernel(
        xq_ptr,
        xs_ptr,
        w_ptr,
        s_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        ROW_SCALE: tl.constexpr,
        GATED: tl.constexpr,
        PRE_ROUND: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # y[M, N] = (xq[M, K] @ w[N, K].T) * xs[M] * s[N]: e4m3 x e4m3 on the tensor cores, the
        # few rows of x padded to 16 (free: the step is bound by the weight bytes), so no weight
        # is converted element by element as the BF16-activation GEMV must.
        pid_n = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            a = tl.load(
                xq_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            )
            b = tl.load(w_cols + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if GATED:  # the up rows, N below the gate rows; both loads in flight before either product
                bu = tl.load(w_cols + N * stride_wn + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                acc_up = tl.dot(a, bu, acc_up)
            acc = tl.dot(a, b, acc)
        xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)
        if ROW_SCALE:
            ws = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
        else:
            ws = tl.load(s_ptr + offs_n * 0)
        y = acc * xs[:, None] * ws[None, :]
        if HAS_BIAS:
            y = y + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            if ROW_SCALE:
                wu = tl.load(s_ptr + N + offs_n, mask=n_ok, other=0.0)
            else:
                wu = tl.load(s_ptr + offs_n * 0)
            up = acc_up * xs[:, None] * wu[None, :]
            if HAS_BIAS:
                up = up + tl.load(b_ptr + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            y = _silu_mul(y, up, y_ptr.dtype.element_ty, PRE_ROUND)
        tl.store(
            y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
            _round_to(y, y_ptr.dtype.element_ty, PRE_ROUND).to(y_ptr.dtype.element_ty),
            mask=m_ok[:, None] & n_ok[None, :],
        )

    _dot_kernel = autotuned(
        _fp8_dot_kernel, _block_configs(_DOT_CONFIGS), key=["N", "K", "M", "GATED"], name="gemv_w8a8"
    )


def _launch_dot(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    gated: bool = False,
) -> torch.Tensor:
    """The W8A8 GEMV: y[M, N] = (xq @ weight.T) * xs * scale (+ bias), xq e4m3 [M <= 16, K] with row
    scales xs [M] or [M, 1]; with `gated` (the weight holds a gated MLP's [gate; up] rows), silu(gate) * up
    of the product's halves, [M, N / 2]."""
    if xq.shape[0] > 16:
        raise ValueError(f"the W8A8 GEMV takes at most 16 rows, got {xq.shape[0]}")
    n = _out_features(weight, gated)
    y = torch.empty(xq.shape[0], n, dtype=out_dtype, device=xq.device)
    args, kw = _dot_args(xq, xs.reshape(-1), weight, scale, bias, y, gated)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    fixed = {"BLOCK_N": 16, "BLOCK_K": 32} if INTERPRET else {}
    _dot_kernel[grid](*args, **kw, **fixed)
    return y


def _out_features(weight: torch.Tensor, gated: bool) -> int:
    """Outputs per row: the weight's rows, or with `gated` half of them (its [gate; up] pairs)."""
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated product needs [gate; up] rows of equal counts, got {weight.shape[0]} rows")
    return weight.shape[0] // 2 if gated else weight.shape[0]


def _dot_args(xq, xs, weight, scale, bias, y, gated: bool = False) -> tuple[tuple, dict]:
    """The W8A8 kernel's arguments, as its launch and `precompile` pass them."""
    (M, K), N = xq.shape, _out_features(weight, gated)
    return (
        (
            xq,
            xs,
            weight,
            scale,
            bias if bias is not None else scale,
            y,
            M,
            N,
            K,
            xq.stride(0),
            weight.stride(0),
            y.stride(0),
        ),
        {
            "HAS_BIAS": bias is not None,
            "ROW_SCALE": scale.numel() != 1,
            "GATED": gated,
            "PRE_ROUND": INTERPRET,
            "BLOCK_M": 16,
        },
    )


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block: int = 0,
    gated: bool = False,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The GEMV: y[M, N] = x[M, K] @ (weight[N, K] * scale).T + bias, x in BF16/FP16, weight e4m3,
    scale [N] (per row) or [1], or with `block` [ceil(N/block), ceil(K/block)] (per block, an edge
    `takes_block` takes); with `gated` (the weight holds a gated MLP's [gate; up] rows), silu(gate) * up
    of the product's halves, [M, N / 2]. `norm`, `eps`, `residual`: the RMSNorm before it (x is its
    input, `norm` its weight) and the residual add after it (+ residual [M, N]), folded in
    (ops/graph_fusion.py puts them there in a compiled decode step)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    n = _out_features(weight, gated)
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    args, kw = _args(x, weight, scale, bias, y, block, gated, norm, eps, residual)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), x.shape[0])  # noqa: E731
    fixed = {"BLOCK_N": 16, "BLOCK_K": 64} if INTERPRET else {}
    _kernel[grid](*args, **kw, **fixed)
    return y


# Block edges the GEMV takes block scales for are multiples of every config's BLOCK_N, so that a
# tile's rows share one row of block scales.
BLOCK_EDGE = math.lcm(*(bn for bn, *_ in _CONFIGS))


def takes_block(block: int | None) -> bool:
    """Whether the GEMV reads block scales of this edge."""
    return bool(block) and block % BLOCK_EDGE == 0


def _args(
    x,
    weight,
    scale,
    bias,
    y,
    block: int = 0,
    gated: bool = False,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
) -> tuple[tuple, dict]:
    """The GEMV kernel's arguments, as its launch and `precompile` pass them. `block`: `scale` is
    the weight's [ceil(N/block), ceil(K/block)] block scales (0: per row [N] or per tensor [1]).
    `gated`: the weight holds [gate; up] rows, and the output is silu(gate) * up. `norm` (an
    RMSNorm's weight [K]) and `eps`: x is the norm's input, and the product is of its output.
    `residual` [M, N]: added to the output."""
    (M, K), N = x.shape, _out_features(weight, gated)
    if norm is not None and tuple(norm.shape) != (K,):
        raise ValueError(f"an RMSNorm before a GEMV of {K} inputs has a weight of [{K}], got {list(norm.shape)}")
    if residual is not None and tuple(residual.shape) != (M, N):
        raise ValueError(f"the residual added to a GEMV's [{M}, {N}] output is [{M}, {N}], got {list(residual.shape)}")
    if block and gated:
        raise ValueError("the gated GEMV takes per-row or per-tensor scales, not block scales")
    if block and not takes_block(block):
        raise ValueError(f"the GEMV takes block scales of edges that are multiples of {BLOCK_EDGE}, not {block}")
    if block and (scale.dim() != 2 or scale.stride(1) != 1 or tuple(scale.shape) != scale_shape("block", N, K, block)):
        raise ValueError(
            f"block scales of a [{N}, {K}] weight in {block}-blocks are {list(scale_shape('block', N, K, block))}, "
            f"got {list(scale.shape)}"
        )
    return (
        (
            x,
            weight,
            scale,
            bias if bias is not None else scale,
            y,
            norm if norm is not None else scale,
            residual if residual is not None else y,
            M,
            N,
            K,
            x.stride(0),
            weight.stride(0),
            y.stride(0),
            scale.stride(0) if block else 0,
            residual.stride(0) if residual is not None else 0,
            float(eps),
        ),
        {
            "HAS_BIAS": bias is not None,
            "ROW_SCALE": not block and scale.numel() != 1,
            "SCALE_BLOCK": block,
            "GATED": gated,
            "PRE_ROUND": INTERPRET,
            "NORM": norm is not None,
            "RESIDUAL": residual is not None,
        },
    )


def precompile(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    dot: bool = False,
    block: int = 0,
    gated: bool = False,
    norm: bool = False,
    residual: bool = False,
) -> int:
    """Compile every configuration of the GEMV for arguments like these (x BF16 [M, K]; `block`:
    block scales; `gated`: silu(gate) * up of [gate; up] rows; `norm`, `residual`: its RMSNorm
    prologue, its residual epilogue), or with `dot` of the W8A8 GEMV for x quantized, several at
    once (ops/triton `compile_configs`), so that the autotuner's first call only times them.
    Returns how many were compiled."""
    if triton is None or INTERPRET:
        return 0
    y = torch.empty(x.shape[0], _out_features(weight, gated), dtype=x.dtype, device=x.device)
    if not dot:
        nw = torch.ones(x.shape[1], dtype=x.dtype, device=x.device) if norm else None
        args, kw = _args(x, weight, scale, bias, y, block, gated, nw, 1e-6, torch.zeros_like(y) if residual else None)
        return compile_configs(_kernel, *args, **kw)
    xq, xs = torch.zeros_like(x, dtype=weight.dtype), torch.ones(x.shape[0], device=x.device, dtype=torch.float32)
    args, kw = _dot_args(xq, xs, weight, scale, bias, y, gated)
    return compile_configs(_dot_kernel, *args, **kw)


def _gemv_fake(x, weight, scale, bias, block=0, gated=False, norm=None, eps=0.0, residual=None):
    return x.new_empty(x.shape[0], _out_features(weight, gated))


def _dot_fake(xq, xs, weight, scale, bias, out_dtype, gated=False):
    return xq.new_empty(xq.shape[0], _out_features(weight, gated), dtype=out_dtype)


fp8_gemv = custom_op(OP_NAME, _launch, _gemv_fake)
fp8_dot_gemv = custom_op("mpsconvert::fp8_dot_gemv", _launch_dot, _dot_fake)
gemv = eager_or_op(_launch, fp8_gemv)
dot_gemv = eager_or_op(_launch_dot, fp8_dot_gemv)
