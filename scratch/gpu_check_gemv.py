"""GPU check of the decode GEMV's norm prologue and residual epilogue (Llama-3-8B shapes): against
the plain GEMV of the module's RMSNorm output / the plain GEMV + residual; and per-call times (CUDA
graphs, one weight, so L2-warm for the small shapes: explains, not a claim) of norm kernel + GEMV
against the fused GEMV. Not committed."""
import torch
from mpsconvert import timing
from mpsconvert.fp8 import relative_error
from mpsconvert.runtime.ops.triton import gemv as G

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)

def rms(x, w, eps=1e-5):
    h = x.float(); h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps); return w * h.to(x.dtype)

bad = 0
for n, k, what in [(6144, 4096, "norm"), (4096, 4096, "residual"), (28672, 4096, "gated norm"), (4096, 14336, "residual")]:
    w = (torch.randn(n, k, generator=g, device=dev) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(n, generator=g, device=dev) * 1e-3 + 1e-4
    x = (torch.randn(1, k, generator=g, device=dev) * 3).to(torch.bfloat16)
    nw = (torch.rand(k, generator=g, device=dev) + 0.5).to(torch.bfloat16)
    gated = what.startswith("gated")
    nout = n // 2 if gated else n
    r = torch.randn(1, nout, generator=g, device=dev).to(torch.bfloat16)
    if "norm" in what:
        want = G.gemv(rms(x, nw), w, s, None, gated=gated)
        got = G.gemv(x, w, s, None, gated=gated, norm=nw, eps=1e-5)
        err = relative_error(got.float(), want.float())
        ok = err < 2**-7
        t0 = timing.per_call_us(lambda: G.gemv(rms(x, nw), w, s, None, gated=gated), dev)
        t1 = timing.per_call_us(lambda: G.gemv(x, w, s, None, gated=gated, norm=nw, eps=1e-5), dev)
        tp = timing.per_call_us(lambda: G.gemv(x, w, s, None, gated=gated), dev)
    else:
        want = r + G.gemv(x, w, s, None)
        got = G.gemv(x, w, s, None, residual=r)
        err = relative_error(got.float(), want.float())
        ok = torch.equal(got, want)
        t0 = timing.per_call_us(lambda: r + G.gemv(x, w, s, None), dev)
        t1 = timing.per_call_us(lambda: G.gemv(x, w, s, None, residual=r), dev)
        tp = timing.per_call_us(lambda: G.gemv(x, w, s, None), dev)
    bad += not ok
    print(f"{n}x{k} {what}: rel err {err:.2e} {'ok' if ok else 'BAD'}; us per call: separate {t0:.2f}, fused {t1:.2f}, GEMV alone {tp:.2f}")
print("FAILURES:", bad)
