"""Scratch: host microseconds of the prefill attention call (Llama-3-8B heads, 512 tokens): SDPA as
transformers calls it (enable_gqa) against the aten flash op directly."""
import time, torch
import torch.nn.functional as F
q = torch.randn(1, 32, 512, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 8, 512, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
def host(fn, n=200):
    for _ in range(10): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    h = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize(); w = (time.perf_counter() - t) / n * 1e6
    return round(h, 1), round(w, 1)
print("sdpa enable_gqa host/wall us", host(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)))
try:
    fl = lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=128 ** -0.5)[0]
    print("aten flash direct host/wall us", host(fl), "max err", (fl() - ref).abs().max().item())
except Exception as e:
    print("aten flash direct failed:", type(e).__name__, str(e)[:300])
kk, vv = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
print("sdpa repeated kv host/wall us", host(lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=True)))
from torch.nn.attention import sdpa_kernel, SDPBackend
for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
    try:
        with sdpa_kernel(b):
            print(b, "host/wall us", host(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)))
    except Exception as e:
        print(b, "failed:", type(e).__name__, str(e)[:200])
