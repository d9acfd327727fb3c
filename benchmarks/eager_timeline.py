"""Who sets an eager prefill's pace, without a profiler (a diagnosis; CUDA): BF16 and ours,
Llama-3-8B-shaped, L layers, fresh process. Prints the wall time, the GPU time with three
prefills queued behind a GPU sleep (the host never in the way), where the forward synchronises
(torch.cuda sync debug mode, with the stack), a per-layer timeline (host clock and CUDA event at
each decoder layer's start: a GPU lag that grows layer after layer means the GPU, not the host,
sets the pace), and the wall time under gc.freeze() / gc.disable().

    python benchmarks/eager_timeline.py [L=32]    (checkpoints under /tmp/tlL)
"""
import gc, statistics, sys, time, traceback, warnings
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks")); sys.path.insert(0, str(ROOT / "src"))
import model_latency as ml
import torch, transformers
from mpsconvert.runtime import load
L = int(sys.argv[1]) if len(sys.argv) > 1 else 32
work = Path(f"/tmp/tl{L}"); src, art = work / "src", work / "art"
dev = torch.device("cuda")
if not (src / "config.json").exists():
    ml.build_checkpoint(ml.config_for("llama", L), src, dev)
    ml.quantize(src, art)
S = 2048


def walls(fn, n=20):
    xs = []
    for _ in range(n):
        torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize(); xs.append(time.perf_counter() - t)
    xs.sort()
    return f"median {statistics.median(xs)*1e3:.2f} min {xs[0]*1e3:.2f} max {xs[-1]*1e3:.2f} ms"


def gpu(fn, n=3):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(1.5e9))
    a.record()
    for _ in range(n):
        fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def timeline(model, fn):
    layers = model.model.layers
    hs, evs = [], []
    def pre(mod, args, kwargs):
        hs.append(time.perf_counter()); e = torch.cuda.Event(enable_timing=True); e.record(); evs.append(e)
    hooks = [l.register_forward_pre_hook(pre, with_kwargs=True) for l in layers]
    torch.cuda.synchronize()
    t0 = time.perf_counter(); e0 = torch.cuda.Event(enable_timing=True); e0.record()
    fn()
    t1 = time.perf_counter(); e1 = torch.cuda.Event(enable_timing=True); e1.record()
    torch.cuda.synchronize(); t2 = time.perf_counter()
    for h in hooks:
        h.remove()
    host = [round((h - t0) * 1e3, 2) for h in hs]
    dev_ = [round(e0.elapsed_time(e), 2) for e in evs]
    print("  host ms at layer starts", host[::4], "return", round((t1 - t0) * 1e3, 2), "wall", round((t2 - t0) * 1e3, 2))
    print("  gpu  ms at layer starts", dev_[::4], "end", round(e0.elapsed_time(e1), 2))
    print("  gpu-host lag per 4 layers", [round(d - h, 2) for d, h in zip(dev_[::4], host[::4])], flush=True)


def run(name, model):
    ids = torch.randint(0, 1000, (1, S), device=dev)
    def prefill():
        with torch.no_grad():
            return model(ids, use_cache=False, logits_to_keep=1).logits
    for _ in range(3):
        prefill()
    print(name, "wall", walls(prefill), "| gpu busy (queue full)", round(gpu(prefill), 2), "ms", flush=True)
    old = warnings.showwarning
    seen = []
    warnings.showwarning = lambda *a, **k: seen.append("".join(traceback.format_stack(limit=14)[:-3]))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        prefill()
        torch.cuda.set_sync_debug_mode(0)
    warnings.showwarning = old
    for s in seen[:2]:
        print("  SYNC at:\n" + s[-1800:], flush=True)
    timeline(model, prefill)
    timeline(model, prefill)
    gc.collect(); gc.freeze()
    print(name, "gc.freeze wall", walls(prefill), flush=True)
    gc.unfreeze(); gc.disable()
    print(name, "gc.disable wall", walls(prefill), flush=True)
    timeline(model, prefill)
    gc.enable()


print("torch", torch.__version__, "transformers", transformers.__version__, "layers", L, flush=True)
m = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, device_map="cuda")
run("bf16", m)
del m; gc.collect(); torch.cuda.empty_cache()
m = load(art, device="cuda")
print("ours", m.mpsconvert.seconds, flush=True)
run("ours", m)
