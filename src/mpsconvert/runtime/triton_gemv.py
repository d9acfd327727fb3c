"""FP8-weight GEMV for decode (few tokens): e4m3 weights read once, dequantized in registers.

Why: at batch 1 a linear layer is bound by weight bytes. `torch._scaled_mm` row-wise at M=1 is
slower than BF16 on the H200 (41 us vs 34 us for 14336x4096), and quantizing the activation
costs extra launches. This kernel reads the FP8 weight (half the bytes of BF16), multiplies it by
the BF16 activations in float32, applies the per-row (or per-tensor) scale once per output, and
adds the bias: no activation quantization, so it is at least as accurate as the scheme.

Triton is optional: on machines without it (CPU, MPS) `available()` is False and nothing here
runs; the kernel policy then never offers this candidate.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

OP_NAME = "mpsconvert::fp8_gemv"


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    def _configs():
        out = []
        for bn in (4, 8, 16, 32):
            for bk in (256, 512, 1024):
                for w in (4, 8):
                    if bn * bk <= 16384:
                        out.append(triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=2))
        return out

    @triton.autotune(configs=_configs(), key=["N", "K", "M"])
    @triton.jit
    def _fp8_gemv_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
        M, N, K,
        stride_xm, stride_wn, stride_ym,
        HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        m = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            x = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                mask=n_mask[:, None] & k_mask[None, :],
                other=0.0,
                eviction_policy="evict_first",
            ).to(tl.float32)
            acc += w * x[None, :]
        y = tl.sum(acc, axis=1)
        if ROW_SCALE:
            y = y * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
        else:
            y = y * tl.load(s_ptr)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)

    @torch.library.custom_op(OP_NAME, mutates_args=())
    def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y[M, N] = x[M, K] @ (weight[N, K] * scale).T + bias, x in BF16/FP16, weight e4m3."""
        M, K = x.shape
        N = weight.shape[0]
        x = x.contiguous()
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
        s = scale.reshape(-1).contiguous()
        grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), M)  # noqa: E731
        _fp8_gemv_kernel[grid](
            x, weight, s, bias if bias is not None else s, y,
            M, N, K,
            x.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, ROW_SCALE=s.numel() != 1,
        )
        return y

    @fp8_gemv.register_fake
    def _(x, weight, scale, bias):
        return x.new_empty(x.shape[0], weight.shape[0])

else:
    fp8_gemv = None
