"""Scratch: does the eager prefill's SDPA call block the host? 2-layer Llama-3-8B-shaped FP8 model,
512 tokens: sync-debug mode (error at the first synchronizing op), cProfile of synced prefills,
wall per prefill with each SDPA backend allowed."""
import sys, time, tempfile, traceback, cProfile, pstats
from pathlib import Path
sys.path.insert(0, "src"); sys.path.insert(0, "benchmarks")
import torch
import _sources, mpsconvert
from torch.nn.attention import sdpa_kernel, SDPBackend
w = Path(tempfile.mkdtemp())
_sources.build_checkpoint(_sources.config_for("llama", 2), w / "src", torch.device("cuda"))
_sources.quantize(w / "src", w / "art")
m = mpsconvert.load(w / "art", device="cuda")
ids = torch.randint(3, 1000, (1, 512), device="cuda")
def pf():
    with torch.no_grad():
        return m(ids, logits_to_keep=1).logits
for _ in range(3): pf()
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
try:
    pf(); print("no synchronizing op in a prefill")
except Exception as e:
    print("SYNC:", str(e)[:200]); traceback.print_exc(limit=-8)
torch.cuda.set_sync_debug_mode(0)
torch.cuda.synchronize()
def wall(n=20):
    pf(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): pf()
    torch.cuda.synchronize(); return round((time.perf_counter() - t) / n * 1e3, 3)
def host(n=20):
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n):
        pf(); torch.cuda._sleep(0) if False else None
    h = time.perf_counter() - t; torch.cuda.synchronize(); return round(h / n * 1e3, 3)
print("prefill wall ms (default backends)", wall(), "host ms unsynced", host())
for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
    try:
        with sdpa_kernel(b):
            print(b, "wall ms", wall(), "host ms", host())
    except Exception as e:
        print(b, "failed", type(e).__name__, str(e)[:150])
pr = cProfile.Profile(); pr.enable()
for _ in range(5):
    pf(); torch.cuda.synchronize()
pr.disable()
rows = sorted(pstats.Stats(pr).stats.items(), key=lambda kv: -kv[1][2])[:12]
for (f, line, fn), (cc, nc, tt, ct, _) in rows:
    print(f"{Path(f).name}:{line}:{fn} calls/pf {nc/5:.1f} own ms/pf {tt*1e3/5:.3f} cum {ct*1e3/5:.3f}")
print(torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled())
