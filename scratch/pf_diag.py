"""Probe: where a 512-token eager prefill of the 32-layer Llama-3-8B shape spends its time, ours
(a default mpsconvert.load) and BF16 (from_pretrained), as `model(ids, logits_to_keep=1)`.

python scratch/pf_diag.py /tmp/w [ours|bf16|both]
"""
import cProfile, io, json, os, pstats, statistics, sys, time, types
from pathlib import Path

sys.path[:0] = ["src", "benchmarks"]
import torch, transformers
import torch.nn.functional as F
import mpsconvert

W = Path(sys.argv[1])
WHICH = sys.argv[2] if len(sys.argv) > 2 else "both"
N = int(os.environ.get("PF_TOKENS", "512"))
DEV = os.environ.get("PF_DEVICE", "cuda")
ids = torch.randint(3, 500, (1, N), device=DEV)
R = {}


def pf(m):
    with torch.no_grad():
        return m(ids, logits_to_keep=1).logits


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def queued(m, n=15):
    sync(); t = time.perf_counter()
    for _ in range(n):
        pf(m)
    sync(); return (time.perf_counter() - t) / n * 1e3


def single(m, n=10):
    lat, host = [], []
    for _ in range(n):
        sync(); t = time.perf_counter()
        pf(m)
        h = time.perf_counter()
        sync(); e = time.perf_counter()
        lat.append((e - t) * 1e3); host.append((h - t) * 1e3)
    return statistics.median(lat), statistics.median(host)


def gpu_busy(m, n=3):
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            pf(m)
        sync()
    ev = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in ev) / n / 1e3
    by = {}
    for e in ev:
        k = e.name[:70]
        c, t = by.get(k, (0, 0.0)); by[k] = (c + 1, t + e.device_time)
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:14]
    return busy, len(ev) / n, [(k, c / n, round(t / n / 1e3, 3)) for k, (c, t) in top]


def cpu_ops(m, n=3):
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(n):
            pf(m)
        sync()
    rows = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)[:22]
    return [(e.key[:60], e.count / n, round(e.self_cpu_time_total / n / 1e3, 3)) for e in rows]


def cprof(m, n=4):
    pr = cProfile.Profile()
    for _ in range(n):
        sync(); pr.enable(); pf(m); pr.disable()
    sync()
    st = pstats.Stats(pr)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:30]
    return [(f"{Path(f).name}:{l}:{fn}"[:70], cc / n, round(tt / n * 1e3, 3), round(ct / n * 1e3, 3)) for (f, l, fn), (cc, nc, tt, ct, _) in rows]


def report(label, m):
    for _ in range(3):
        pf(m)
    queued(m)
    out = {}
    out["queued_ms"] = [round(queued(m), 3) for _ in range(3)]
    out["single_ms"], out["host_issue_ms"] = (round(x, 3) for x in single(m))
    if label == "ours":  # before any profiler ran in this process
        sdpa_variants(m)
    busy, kernels, top = gpu_busy(m) if DEV == "cuda" else (0, 0, [])
    out["gpu_busy_ms"], out["kernels_per_call"], out["kernel_top"] = round(busy, 3), kernels, top
    out["cpu_ops"] = cpu_ops(m)
    out["cprofile_tottime"] = cprof(m)
    R[label] = out
    Path(os.environ.get("OUT", "/tmp"), f"pf_diag_{N}.json").write_text(json.dumps(R, indent=1))
    print(label, json.dumps({k: v for k, v in out.items() if k not in ("kernel_top", "cpu_ops", "cprofile_tottime")}), flush=True)
    for k in ("kernel_top", "cpu_ops", "cprofile_tottime"):
        print(f"  {label} {k}:", flush=True)
        for row in out[k]:
            print("    ", row, flush=True)


def sdpa_variants(m):
    """SDPA in the direct prefill path: its host cost on the in-model q/k/v, and the prefill with
    q/k/v made contiguous first, with SDPA skipped (output = q), with the flash backend only."""
    from mpsconvert.runtime.patches import attention_prefill as ap
    real = F.scaled_dot_product_attention
    seen = []

    def grab(q, k, v, **kw):
        if not seen:
            seen.append((q, k, v, kw))
        return real(q, k, v, **kw)

    def contig(q, k, v, **kw):
        return real(q.contiguous(), k.contiguous(), v.contiguous(), **kw)

    def skip(q, k, v, **kw):
        return q

    out = {}
    for name, fn in (("grab", grab), ("contiguous", contig), ("skip_sdpa", skip)):
        ap.F = types.SimpleNamespace(scaled_dot_product_attention=fn)
        for _ in range(3):
            pf(m)
        out[name] = {"queued_ms": round(min(queued(m) for _ in range(3)), 3), "single_host": [round(x, 3) for x in single(m)]}
    ap.F = F
    from torch.nn.attention import sdpa_kernel, SDPBackend
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(3):
            pf(m)
        out["flash_only"] = {"queued_ms": round(min(queued(m) for _ in range(3)), 3), "single_host": [round(x, 3) for x in single(m)]}
    out["default_again"] = {"queued_ms": round(min(queued(m) for _ in range(3)), 3)}
    if not seen:
        print("sdpa_variants: the direct path never called SDPA", json.dumps(out), flush=True)
        return
    q, k, v, kw = seen[0]
    out["layouts"] = {n: (list(t.shape), list(t.stride()), t.is_contiguous()) for n, t in (("q", q), ("k", k), ("v", v))}
    out["kwargs"] = {a: str(b) for a, b in kw.items()}
    try:
        out["fused_sdp_choice in-model / contiguous"] = (
            int(torch._fused_sdp_choice(q, k, v, is_causal=True, scale=kw.get("scale"), enable_gqa=kw.get("enable_gqa", False))),
            int(torch._fused_sdp_choice(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True, scale=kw.get("scale"),
                                        enable_gqa=kw.get("enable_gqa", False))))
    except Exception as e:
        out["fused_sdp_choice"] = repr(e)[:200]

    def host_us(fn, n=200):
        for _ in range(5):
            fn()
        sync(); t = time.perf_counter()
        for _ in range(n):
            fn()
        h = time.perf_counter(); sync(); e = time.perf_counter()
        return round((h - t) / n * 1e6, 1), round((e - t) / n * 1e6, 1)

    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    out["sdpa alone in-model layout host/wall us"] = host_us(lambda: real(q, k, v, **kw))
    out["sdpa alone contiguous host/wall us"] = host_us(lambda: real(qc, kc, vc, **kw))
    out["contiguous() x3 + sdpa host/wall us"] = host_us(lambda: real(q.contiguous(), k.contiguous(), v.contiguous(), **kw))
    R["sdpa_variants"] = out
    print("sdpa_variants", json.dumps(out), flush=True)


if WHICH in ("ours", "both"):
    art = W / "art"
    t = time.perf_counter(); m = mpsconvert.load(art, device=DEV); print("ours loaded", round(time.perf_counter() - t, 1), flush=True)
    report("ours", m)
    del m; torch.cuda.empty_cache() if DEV == "cuda" else None
if WHICH in ("bf16", "both"):
    b = transformers.AutoModelForCausalLM.from_pretrained(W / "src", dtype=torch.bfloat16).to(DEV).eval()
    report("bf16", b)
    del b; torch.cuda.empty_cache() if DEV == "cuda" else None
Path(os.environ.get("OUT", "/tmp"), f"pf_diag_{N}.json").write_text(json.dumps(R, indent=1))
