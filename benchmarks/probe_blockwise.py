"""Which scale layouts torch's blockwise FP8 GEMM accepts on this GPU (1x128 activations x
128x128 weights), and whether each gives the right product: a probe for kernels.scaled_mm_block."""
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mpsconvert import fp8  # noqa: E402
from mpsconvert.runtime import kernels  # noqa: E402

dev = "cuda"
m, n, k = 256, 512, 384
w = torch.randn(n, k, device=dev) * 0.02
q, s, _ = fp8.quantize(w, "block", block=128)
x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
xq, xs = kernels.group_quantize(x, 128)
want = kernels._group_dequantize(xq, xs, 128, torch.float64) @ fp8.dequantize(q, s, torch.float64, 128).T
rn, rk = s.shape


def pad_rows(t, mult=4):
    r, c = t.shape
    buf = torch.zeros(r, -(-c // mult) * mult, device=t.device)
    buf[:, :c] = t
    return buf[:, :c]


A = {"a_outer": xs.t().contiguous().t(), "a_contig": xs.contiguous()}
B = {"b_t_view": s.t(), "b_t_padded": pad_rows(s.t().contiguous()), "b_t_contig": s.t().contiguous(), "b_plain": s.contiguous(),
     "b_plain_padded": pad_rows(s.contiguous()), "b_plain_outer": s.t().contiguous().t()}
try:
    torch._scaled_mm(xq, q.t(), scale_a=A["a_outer"], scale_b=B["b_t_padded"], out_dtype=torch.bfloat16)
except Exception as e:
    print("FULL ERROR:", str(e)[:3000])
for (an, a), (bn, b) in itertools.product(A.items(), B.items()):
    for api in ("_scaled_mm", "F.scaled_mm"):
        try:
            if api == "_scaled_mm":
                y = torch._scaled_mm(xq, q.t(), scale_a=a, scale_b=b, out_dtype=torch.bfloat16)
            else:
                y = F.scaled_mm(xq, q.t(), a, F.ScalingType.BlockWise1x128, b, F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
            err = float((y.double() - want).norm() / want.norm())
            print(f"OK {api} {an} {bn} shape_a={tuple(a.shape)} stride_a={a.stride()} shape_b={tuple(b.shape)} stride_b={b.stride()} rel_err={err:.2e}")
        except Exception as e:
            print(f"no {api} {an} {bn}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
print(torch.__version__, torch.version.cuda)
