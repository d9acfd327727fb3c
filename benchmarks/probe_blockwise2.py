"""Probe 2: F.scaled_mm BlockWise1x128 x BlockWise128x128 scale_b layouts (padded shapes)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mpsconvert import fp8  # noqa: E402
from mpsconvert.runtime import kernels  # noqa: E402

for m, n, k in ((256, 640, 384), (1, 640, 384), (2048, 4096, 14336)):
    w = torch.randn(n, k, device="cuda") * 0.02
    q, s, _ = fp8.quantize(w, "block", block=128)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = kernels.group_quantize(x, 128)
    want = kernels._group_dequantize(xq, xs, 128, torch.float64) @ fp8.dequantize(q, s, torch.float64, 128).T
    rn, rk = s.shape
    r4 = -(-rk // 4) * 4
    n4 = -(-rn // 4) * 4
    cands = {}
    b = torch.zeros(r4, rn, device="cuda"); b[:rk] = s.t(); cands["[rk4,rn] rowmajor"] = b
    cands["[rk4,rn] colmajor"] = b.t().contiguous().t()
    b = torch.zeros(rn, r4, device="cuda"); b[:, :rk] = s; cands["[rn,rk4] rowmajor"] = b
    cands["[rn,rk4] colmajor"] = b.t().contiguous().t()
    b = torch.zeros(n4, rk, device="cuda"); b[:rn] = s; cands["[rn4,rk]"] = b
    b = torch.zeros(rk, n4, device="cuda"); b[:, :rn] = s.t(); cands["[rk,rn4]"] = b
    cands["[rk,rn4] colmajor"] = b.t().contiguous().t()
    cands["[rk,rn] view"] = s.t()
    cands["[rn,rk]"] = s.contiguous()
    a = xs.t().contiguous().t()
    print("m n k", m, n, k, "rn rk", rn, rk)
    for name, b in cands.items():
        try:
            y = F.scaled_mm(xq, q.t(), a, F.ScalingType.BlockWise1x128, b, F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
            print(f"  OK {name} {tuple(b.shape)} {b.stride()} rel_err={float((y.double() - want).norm() / want.norm()):.2e}")
        except Exception as e:
            print(f"  no {name} {tuple(b.shape)} {b.stride()}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
