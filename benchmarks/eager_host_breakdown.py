"""Where the host time of an eager prefill goes, without a profiler (a diagnosis; CUDA): host
time to enqueue (a GPU sleep in front, so the host never waits) and GPU time (events) of the
whole prefill and of each piece of one decoder layer, BF16 and ours, Llama-3-8B-shaped, L layers.
A prefill that synchronises inside shows a host time of the sleep's length (transformers'
mask preamble does, without an attention mask and a cache).

    python benchmarks/eager_host_breakdown.py [L=8]    (checkpoints under /tmp/hb)
"""
import gc, statistics, sys, time, warnings
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks")); sys.path.insert(0, str(ROOT / "src"))
import model_latency as ml
import torch, transformers
from mpsconvert.runtime import load
L = int(sys.argv[1]) if len(sys.argv) > 1 else 8
work = Path("/tmp/hb"); src, art = work / "src", work / "art"
dev = torch.device("cuda")
if not (src / "config.json").exists():
    ml.build_checkpoint(ml.config_for("llama", L), src, dev)
    ml.quantize(src, art)
S = 2048


def host(fn, n):
    fn(); torch.cuda.synchronize()
    torch.cuda._sleep(int(1.5e9))  # ~0.75 s of GPU time in front: nothing below waits for the GPU
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return dt * 1e6


def gpu(fn, n):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(1.5e9))
    a.record()
    for _ in range(n):
        fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def wall(fn, n=10):
    xs = []
    for _ in range(n):
        torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize(); xs.append(time.perf_counter() - t)
    return statistics.median(xs) * 1e6


def run(name, model):
    ids = torch.randint(0, 1000, (1, S), device=dev)
    def prefill():
        with torch.no_grad():
            return model(ids, use_cache=False, logits_to_keep=1).logits
    for _ in range(3):
        prefill()
    torch.cuda.synchronize()
    row = {"wall": wall(prefill), "host": statistics.median(host(prefill, 1) for _ in range(5)), "gpu": gpu(prefill, 3)}
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        prefill()
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    row["syncs"] = [str(w.message)[:200] for w in ws][:6]
    print(name, "prefill us", {k: (round(v) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    layer = model.model.layers[1]
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, S, 4096, device=dev, dtype=torch.bfloat16, generator=g)
    pos = torch.arange(S, device=dev)[None]
    pe = model.model.rotary_emb(x, pos)
    at = layer.self_attn
    comps = {
        "layer": lambda: layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe),
        "input_layernorm": lambda: layer.input_layernorm(x),
        "self_attn": lambda: at(hidden_states=x, attention_mask=None, position_ids=pos, position_embeddings=pe),
        "q,k,v proj": lambda: (at.q_proj(x), at.k_proj(x), at.v_proj(x)),
        "o_proj": lambda: at.o_proj(x),
        "mlp": lambda: layer.mlp(x),
        "add": lambda: x + x,
        "empty": lambda: torch.empty(S, 4096, device=dev, dtype=torch.bfloat16),
        "model.norm": lambda: model.model.norm(x),
        "rotary_emb": lambda: model.model.rotary_emb(x, pos),
        "lm_head(1 row)": lambda: model.lm_head(x[:, -1:]),
    }
    with torch.no_grad():
        for k, fn in comps.items():
            try:
                print(f"  {name:5s} {k:16s} host {host(fn, 20):8.1f} us  gpu {gpu(fn, 20):8.1f} us", flush=True)
            except Exception as e:
                print(f"  {name:5s} {k:16s} failed {type(e).__name__}: {str(e)[:200]}", flush=True)


print("torch", torch.__version__, "transformers", transformers.__version__, "layers", L, flush=True)
m = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, device_map="cuda")
run("bf16", m)
del m; gc.collect(); torch.cuda.empty_cache()
m = load(art, device="cuda")
print("ours eager_fusion", m.mpsconvert.eager_fusion, flush=True)
run("ours", m)
