import sys, time, glob
from pathlib import Path
sys.path.insert(0, "src"); sys.path.insert(0, "benchmarks")
import torch, transformers, mpsconvert
from torch.nn.attention import sdpa_kernel, SDPBackend
w = Path("/tmp/w")
print(sorted(p.name for p in w.iterdir()))
ids = torch.randint(3, 1000, (1, 512), device="cuda")
def run(m, label):
    def pf():
        with torch.no_grad():
            return m(ids, logits_to_keep=1).logits
    def wall(n=10):
        for _ in range(3): pf()
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(n): pf()
        torch.cuda.synchronize(); return round((time.perf_counter() - t) / n * 1e3, 3)
    wall(); wall()
    rows = {"default": [], "flash": []}
    for _ in range(5):
        rows["default"].append(wall(15))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            rows["flash"].append(wall(15))
    print(label, "prefill 512 ms per round", rows, "median", {k: sorted(v)[2] for k, v in rows.items()}, flush=True)
arts = [p for p in w.iterdir() if (p / "mpsconvert.json").exists() or "art" in p.name]
srcs = [p for p in w.iterdir() if (p / "config.json").exists() and p not in arts]
print("arts", arts, "srcs", srcs)
m = mpsconvert.load(arts[0], device="cuda"); run(m, "ours"); del m; torch.cuda.empty_cache()
b = transformers.AutoModelForCausalLM.from_pretrained(srcs[0], dtype=torch.bfloat16).cuda().eval(); run(b, "bf16")
