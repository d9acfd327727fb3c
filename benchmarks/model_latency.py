"""The user's path, timed: a whole transformers model loaded each way, with one routine, in one run.

Builds a checkpoint of a real architecture with random weights (Llama-3-8B-shaped by default:
hidden 4096, 32 q / 8 kv heads of 128, intermediate 14336, vocabulary 128256; `--layers N` of
its 32 layers; `--arch mixtral`: Mixtral-8x7B-shaped, 8 experts top-2, vocabulary 32000), saved
by transformers (`save_pretrained`, 5 GB shards, as the hub's checkpoints are), runs
`mpsconvert quantize` on it (the CLI, default fp8-dynamic), then times, in this one process:

  bf16      transformers `from_pretrained(..., dtype=bfloat16, device_map=cuda)` of the source
  ours      `mpsconvert.runtime.load(artifact)` (verification on), kernels measured cold; its
            files come from disk (`mpsconvert quantize` writes with O_DIRECT, past the page
            cache), while BF16's source was just written through it: compare loads with
            ours-warm (both from the page cache) and *-cold (both from disk)
  ours-sdpa the same, with transformers' SDPA at decode too (without runtime/patches/attention.py)
  ours-unfused  the same, with the model's own RMSNorm and MLP forwards (load(eager_fusion=False))
  ours-direct the same without the prefill's CUDA graphs: each layer's direct calls launched
            one by one (load(prefill_graphs=False); ours replays them, runtime/patches/prefill_graphs.py)
  ours-sharedquant  prefill siblings share one quantization, a GEMM each (fuse.PREFILL_SHARES)
  bf16-attn BF16 with our decode attention installed (to separate what attention contributes)
  ours-warm a second load: kernel cache and page cache warm (load time only)
  *-cold    bf16-cold / ours-cold: the page cache dropped first, files read from disk (load only)
  ct        transformers + compressed-tensors `from_pretrained(artifact)`
  ct-opt    the same with `CompressedTensorsConfig(use_optimized_inference=True)`

with the same routine for each: load time (to a synchronised device); eager prefill of
`--prefill` tokens (batch 1, `logits_to_keep=1` as `generate` asks; wall time, the host time
until the call returns and how far the GPU was behind the host at the last decoder layer (`lag`:
positive when the GPU, not the host, set the pace; `timeline`), and GPU busy time from the
profiler with where it goes; also with a fresh DynamicCache, as `generate` calls it: no
packed-sequence check, which synchronises the call without a cache, and the cache's writes);
compiled prefill (each decoder layer `torch.compile`d,
the regional compilation PyTorch recommends for compile time); compiled decode (the whole
forward under `torch.compile(mode="reduce-overhead")`, static KV cache, one token, host
synchronised per step with the argmax, as `validate` times it); peak device memory. Ratios are
to BF16 from this run; the decode bandwidth fraction is the bytes a step must read (weights
except the input embedding, plus the KV cache) over the step time and the device-to-device copy
bandwidth measured at the start of the run. Kernel, Triton and HF caches live in a fresh
folder of this run, so that nothing a warm machine kept can hide a cost. The CUDA profiles (GPU
busy time, where it goes, which op issued each memset) and `--host-profile`'s cProfile run in a
second pass, each variant loaded again, after every variant was timed.

Each variant (and each profile pass) runs in a process of its own, as a user's program loads one
model: nothing one variant leaves behind (compiled graphs, CUDA graph pools, allocator state, a
profiler) slows the host of the next. In one shared process ours' eager prefill took 28.7 ms of
host time after BF16's compiled phases had run, against 19.2 ms in a fresh process (H200, 32
layers). `--same-process` times every variant in this process, as before. The eager prefill
also gets `gpu_queued_ms`: the GPU's time per call with three calls queued behind a GPU sleep,
the host out of the way (the floor a perfect host would reach: kernels, the device's gaps
between them, and the model's own synchronisations, which drain the queue once per call; the
sleep lets the GPU's clock recover, so the first calls after it run at full clock where the
timed loop runs power-capped). GPU busy time is the mean of 5 calls profiled after the same
loop as the timed calls, so that both see the GPU in one state: the wall / busy line compares
them, and the wall of the profiled calls themselves. The profiler slows the host, though: where
its calls leave the GPU idle between kernels, the GPU's clock recovers and the busy time is
lower than in the timed calls. So a second line divides the wall by the GPU's time from the
first layer to the end of calls made right after the timed loop, measured with CUDA events only
(`timeline`), beside how far the host was ahead of the GPU.

    python benchmarks/model_latency.py [--arch llama|mixtral] [--layers 32] [--prefill 2048]
        [--variants bf16,ours,ct,ct-opt] [--weights row,block] [--work DIR] [--json out.json] [--budget SECONDS]

`--weights row,block` quantizes one artifact per weight granularity (`--weights block`: 128x128
block scales, FP8_BLOCK) and times each variant that reads the artifact on each of them: the
first granularity under the variant's own name, the others as `<variant>@<granularity>`.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# one cache folder for the whole run: the variants' processes inherit it (ours-warm reads what ours wrote)
RUN_CACHE = Path(os.environ.get("MPSCONVERT_BENCH_RUN_CACHE") or tempfile.mkdtemp(prefix="mpsconvert-bench-cache-"))
os.environ["MPSCONVERT_BENCH_RUN_CACHE"] = str(RUN_CACHE)
for var, sub in (
    ("MPSCONVERT_CACHE_DIR", "mpsconvert"),
    ("TRITON_CACHE_DIR", "triton"),
    ("HF_HOME", "hf"),
    ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
):
    os.environ[var] = str(RUN_CACHE / sub)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

T0 = time.perf_counter()
from mpsconvert.infra.timing import warm_guards  # noqa: E402
from mpsconvert.runtime.ops.fuse import PREFILL_SHARES as DEFAULT_SHARES  # noqa: E402
from mpsconvert.runtime.patches import prefill_graphs  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from _sources import build_checkpoint, config_for, copy_bandwidth, quantize  # noqa: E402


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_checks(device) -> dict:
    """Our Triton kernels on this GPU against the reference arithmetic, before anything is timed:
    activation quantization bit for bit, the GEMVs against float64."""
    from mpsconvert.format import fp8
    from mpsconvert.runtime.ops import kernels
    from mpsconvert.runtime.ops.fp8linear import FP8Linear
    from mpsconvert.runtime.ops.triton import act_quant

    out = {}
    g = torch.Generator(device=device).manual_seed(0)
    for k in (4096, 14336, 20000):
        x = (torch.randn(257, k, device=device, generator=g) * 3).to(torch.bfloat16)
        (q, s), (rq, rs) = act_quant.quantize(x), act_quant.torch_quantize(x)
        out[f"quantize K={k}: codes differing"] = int((q.view(torch.uint8) != rq.view(torch.uint8)).sum())
        out[f"quantize K={k}: scales equal"] = bool(torch.equal(s, rs))
        h = torch.randn(64, 2 * k, device=device, generator=g).to(torch.bfloat16)
        (q, s), (rq, rs) = act_quant.silu_mul_quantize(h), act_quant.torch_silu_mul_quantize(h)
        out[f"silu*up quantize K={k}: codes differing"] = int((q.view(torch.uint8) != rq.view(torch.uint8)).sum())
    for n, k in ((6144, 4096), (4096, 14336), (1024, 4096)):
        w = torch.randn(n, k, device=device, generator=g) / k**0.5
        qw, sw, _ = fp8.quantize(w, "row")
        lay = FP8Linear.from_tensors(qw, sw, activations="token")
        x = torch.randn(1, k, device=device, generator=g).to(torch.bfloat16)
        ref = x.double() @ (qw.double() * sw.double().reshape(-1, 1)).T
        for kern in ("gemv", "gemv_splitk"):
            y = kernels.run(kern, lay, x).double()
            out[f"{kern} {n}x{k}: rel err"] = float((y - ref).norm() / ref.norm())
        xq = fp8.fake_quantize(x.float(), fp8.per_token_scale(x.float())).double()  # W8A8: the scheme's rounding of x
        ref8 = xq @ (qw.double() * sw.double().reshape(-1, 1)).T
        try:
            y = kernels.run("gemv_w8a8", lay, x).double()
            out[f"gemv_w8a8 {n}x{k}: rel err"] = float((y - ref8).norm() / ref8.norm())
        except Exception as e:  # reported; the policy then never picks it (it records the same error)
            out[f"gemv_w8a8 {n}x{k}"] = f"{type(e).__name__}: {str(e)[:200]}"
    out.update(attention_check(device, g))
    out.update(moe_decode_check(device, g))
    log("kernel checks", out)
    return out


def moe_decode_check(device, g) -> dict:
    """The FP8 experts' decode path (gate/up GEMV, SiLU*up inside the down GEMV's load) at the
    Mixtral-8x7B shape against float64 arithmetic with the same bf16 roundings, one token, top-2."""
    import torch.nn.functional as F

    from mpsconvert.format import fp8
    from mpsconvert.runtime.ops.fp8_experts import FP8Experts

    E, H, I = 8, 4096, 14336
    w13, s13, _ = fp8.quantize(torch.randn(E * 2 * I, H, device=device, generator=g) / H**0.5, "row")
    w2, s2, _ = fp8.quantize(torch.randn(E * H, I, device=device, generator=g) / I**0.5, "row")
    mod = FP8Experts(
        w13.view(E, 2 * I, H), s13.view(E, -1), w2.view(E, H, I), s2.view(E, -1), F.silu, activations="token"
    )
    x = torch.randn(1, H, device=device, generator=g).to(torch.bfloat16)
    idx, wts = torch.tensor([[5, 2]], device=device), torch.tensor([[0.7, 0.3]], device=device)
    with torch.no_grad():
        y = mod(x, idx, wts).double()
    ref = torch.zeros(1, H, dtype=torch.float64, device=device)
    for e, w in zip(idx[0].tolist(), wts[0].tolist()):
        h = ((w13.view(E, 2 * I, H)[e].double() * s13.view(E, -1)[e, :, None].double()) @ x[0].double()).to(
            torch.bfloat16
        )
        a = (F.silu(h[:I]) * h[I:]).double()
        d = ((w2.view(E, H, I)[e].double() * s2.view(E, -1)[e, :, None].double()) @ a).to(torch.bfloat16)
        ref[0] += (d * torch.tensor(w, dtype=torch.bfloat16, device=device)).double()
    return {
        "moe decode (fp8 experts, silu in the down GEMV): rel err": float((y - ref).norm() / ref.norm()),
        "moe decode path": mod.decode_path,
    }


def attention_check(device, g) -> dict:
    """The decode attention kernel against SDPA at the Llama-3-8B shape (32 q / 8 kv heads of
    128, one query, a static cache of 2096 positions with 2050 valid), and the two timed under a
    CUDA graph: ours, and SDPA after `repeat_kv` as transformers runs it under torch.compile."""
    import torch.nn.functional as F

    from mpsconvert.runtime.patches import attention

    q = torch.randn(1, 32, 1, 128, device=device, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 8, 2096, 128, device=device, generator=g).to(torch.bfloat16) for _ in range(2))
    mask = torch.zeros(1, 1, 1, 2096, dtype=torch.bool, device=device)
    mask[..., :2050] = True
    ref = F.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1), attn_mask=mask
    ).transpose(1, 2)
    out = {
        "decode attention: max abs err vs SDPA (float32)": float(
            (attention.decode_attention(q, k, v, mask).float() - ref).abs().max()
        )
    }

    def sdpa():
        return F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask)

    from mpsconvert.infra.timing import per_call_us

    for label, fn in (("ours", lambda: attention.decode_attention(q, k, v, mask)), ("sdpa+repeat_kv", sdpa)):
        out[f"decode attention {label}: us per call (CUDA graph)"] = round(per_call_us(fn, device), 2)
    return out


def host_cost(device) -> dict:
    """Host microseconds per eager call of the matmuls the layers launch (100 calls queued, one
    synchronisation): what bounds an eager prefill when the GPU work per call is short."""
    from mpsconvert.format import fp8
    from mpsconvert.runtime.ops.triton import act_quant

    out = {}
    x = torch.randn(2048, 4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(1024, 4096, device=device, dtype=torch.bfloat16)
    qw, sw, _ = fp8.quantize(w, "row")
    xq, xs = act_quant.quantize(x)
    sb = sw.reshape(1, -1)
    calls = {
        "F.linear bf16": lambda: torch.nn.functional.linear(x, w),
        "_scaled_mm rowwise": lambda: torch._scaled_mm(
            xq, qw.t(), scale_a=xs, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True
        ),
        "act_quant (Triton)": lambda: act_quant.quantize(x),
    }
    for n, k in ((6144, 4096), (28672, 4096), (4096, 14336)):  # the Llama-3-8B layer's other GEMMs, 2048 tokens
        xk = torch.randn(2048, k, device=device, dtype=torch.bfloat16)
        xkq, xks = act_quant.quantize(xk)
        wk, swk, _ = fp8.quantize(torch.randn(n, k, device=device, dtype=torch.bfloat16), "row")
        calls[f"_scaled_mm rowwise {n}x{k}"] = (
            lambda a, sa, b, sb_: (
                lambda: torch._scaled_mm(
                    a, b.t(), scale_a=sa, scale_b=sb_, out_dtype=torch.bfloat16, use_fast_accum=True
                )
            )
        )(xkq, xks, wk, swk.reshape(1, -1))
    for name, fn in calls.items():
        for _ in range(5):
            fn()
        sync()
        t = time.perf_counter()
        for _ in range(100):
            fn()
        host = (time.perf_counter() - t) / 100
        sync()
        total = (time.perf_counter() - t) / 100
        out[name] = {"host_us": round(host * 1e6, 1), "wall_us": round(total * 1e6, 1)}
    from mpsconvert.runtime.ops.triton import launch as triton_launch

    out["triton launch"] = triton_launch.mode()
    log("host cost per call", out)
    return out


def samples(fn, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return out


PROFILED_CALLS = 5  # eager prefills per profile: GPU busy per call is their mean
SLEEP_CYCLES = int(1.5e9)  # GPU sleep queued in front: ~0.75 s on an H200, longer than a few calls take to enqueue


def queued_gpu_ms(fn, n: int = 3) -> float:
    """GPU time per call of `fn` with n calls queued behind a GPU sleep: what the call costs
    when the host is never what the GPU waits for (a synchronisation inside `fn` still drains
    the queue once per call, and that wait is counted: it is the model's own)."""
    fn()
    sync()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    sync()
    return a.elapsed_time(b) / n


def layer_marks(fn, layers) -> dict:
    """One call of `fn` with a forward pre-hook on each decoder layer that records the host clock
    and a CUDA event (no profiler): ms from the call's start until it returned and until the GPU
    finished, and at each layer's start the host's time and the GPU's."""
    marks: list = []

    def pre(mod, args):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append((time.perf_counter(), e))

    hooks = [layer.register_forward_pre_hook(pre) for layer in layers]
    try:
        sync()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        fn()
        t1 = time.perf_counter()
        e1.record()
        sync()
        t2 = time.perf_counter()
    finally:
        for h in hooks:
            h.remove()
    return {
        "host_return_ms": (t1 - t0) * 1e3,
        "wall_ms": (t2 - t0) * 1e3,
        "gpu_end_ms": e0.elapsed_time(e1),
        "host_at_layers_ms": [(h - t0) * 1e3 for h, _ in marks],
        "gpu_at_layers_ms": [e0.elapsed_time(e) for _, e in marks],
    }


def timeline(fn, layers, repeats: int = 3) -> dict:
    """Whether the host or the GPU sets an eager call's time (`layer_marks`, medians of `repeats`
    calls). host_ms: time until `fn` returns (a synchronisation inside waits only for what was
    queued before it); first_layer_gpu_ms: when the first layer's work began on the GPU (the
    model's preamble); gpu_lag_at_last_layer_ms: how far the GPU was behind the host when the last
    layer was called (positive: work was queued, the GPU, not the host, set the pace);
    gpu_from_first_layer_ms: the GPU's time from the first layer's start to the call's end, in
    these calls (CUDA events, no profiler: the GPU in the state the timed calls left it in; where
    the lag is positive throughout, kernels and the device's own gaps between them)."""
    if not torch.cuda.is_available() or not layers:
        return {}
    rows = []
    for _ in range(repeats):
        m = layer_marks(fn, layers)
        first = m["gpu_at_layers_ms"][0]
        rows.append(
            (
                m["host_return_ms"],
                first,
                m["gpu_at_layers_ms"][-1] - m["host_at_layers_ms"][-1],
                m["gpu_end_ms"] - first,
            )
        )
    med = [statistics.median(r[i] for r in rows) for i in range(4)]
    return {
        "host_ms": round(med[0], 3),
        "first_layer_gpu_ms": round(med[1], 3),
        "gpu_lag_at_last_layer_ms": round(med[2], 3),
        "gpu_from_first_layer_ms": round(med[3], 3),
    }


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    med = statistics.median(xs)
    return {
        "median_ms": round(med * 1e3, 3),
        "min_ms": round(xs[0] * 1e3, 3),
        "max_ms": round(xs[-1] * 1e3, 3),
        "spread": round((xs[-1] - xs[0]) / med, 4),
        "n": len(xs),
    }


CATEGORIES = (
    ("gemm", ("gemm", "cutlass", "cublas", "sm90_", "nvjet", "scaled_mm", "gemv", "xmma", "wgmma")),
    ("act quant (triton)", ("_quant_rows",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("copies/casts", ("copy", "memcpy", "to_copy", "catarray")),
    ("other", ("",)),
)
# (an elementwise kernel over strided tensors is `gpu_kernel_impl_nocast`: "other", not a cast)


def profile(fn, top: int = 14, queued: bool = False, calls: int = 1) -> dict:
    """GPU busy time of a call (union of kernel intervals) and the kernel time by category, per
    call of `calls` (each synchronised, as the wall time is measured). With `queued`, the calls
    are queued behind a GPU sleep (left out of the spans): the gaps are then the device's own,
    unless a call synchronises."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    fn()
    sync()
    with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        torch.cuda._sleep(SLEEP_CYCLES // 4) if queued else None
        t = time.perf_counter()
        for _ in range(calls):
            fn()
            None if queued else sync()
        sync()
        wall = (time.perf_counter() - t) / calls
    spans, cats, launches = [], {c: 0.0 for c, _ in CATEGORIES}, 0
    per_kernel: dict[str, list] = {}
    memsets: dict[str, int] = {}  # the op under which each memset was issued (the profiler's link)
    syncs = 0
    cpu_start = None
    for ev in p.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and "spin_kernel" in ev.name:
            continue  # the queued sleep
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            for k in getattr(ev, "kernels", None) or ():
                if "memset" in k.name.lower():
                    memsets[ev.name] = memsets.get(ev.name, 0) + 1
            if any(k in ev.name for k in ("Synchronize", "_local_scalar_dense", "DtoH")):
                syncs += 1
            cpu_start = ev.time_range.start if cpu_start is None else min(cpu_start, ev.time_range.start)
            continue
        k = per_kernel.setdefault(ev.name[:90], [0, 0.0])
        k[0] += 1
        k[1] += ev.time_range.end - ev.time_range.start
        start, dur = ev.time_range.start, ev.time_range.end - ev.time_range.start
        spans.append((start, start + dur, ev.name[:60]))
        launches += 1
        low = ev.name.lower()
        for c, keys in CATEGORIES:
            if any(k in low for k in keys):
                cats[c] += dur
                break
    spans.sort()
    busy, end, last, gaps = 0.0, None, "", []
    for s, e, name in spans:
        if end is None or s > end:
            if end is not None:
                gaps.append((s - end, last, name, s - spans[0][0]))
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
        last = name
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:top]
    idle = sum(g[0] for g in gaps)
    # where the GPU waited for the host: before the first kernel (the model's Python preamble),
    # between kernels (gaps of 20 us and more summed, the eight longest named), and in all; per
    # call (with several calls, the time between them counts as between kernels)
    busy, launches, idle = busy / calls, launches // calls, idle / calls
    for k in per_kernel.values():
        k[0], k[1] = k[0] // calls, k[1] / calls
    cats = {c: v / calls for c, v in cats.items()}
    return {
        "wall_ms": round(wall * 1e3, 2),
        "gpu_busy_ms": round(busy / 1e3, 2),
        "kernels": launches,
        "calls": calls,
        "by_category_ms": {c: round(v / 1e3, 2) for c, v in cats.items()},
        "host_syncs": syncs,
        "memsets_by_op": memsets,
        "top_kernels_ms": [[name, n, round(t / 1e3, 4)] for name, (n, t) in top],
        "idle": {
            "before_first_kernel_us": round(spans[0][0] - cpu_start, 1) if spans and cpu_start is not None else None,
            "between_kernels_us": round(idle, 1),
            "in_gaps_over_20us": round(sum(g[0] for g in gaps if g[0] >= 20) / calls, 1),
            "gaps_over_20us": sum(g[0] >= 20 for g in gaps) // calls,
            "longest": [[round(g[0], 1), g[1], g[2], round(g[3] / 1e3, 2)] for g in sorted(gaps, reverse=True)[:8]],
        },
    }


def host_profile(fn, steps: int, top: int = 30, synced: bool = False) -> list:
    """Where a step's host time goes: cProfile over `steps` calls, the functions with the most
    own time, as [function, calls per step, own ms per step, cumulative ms per step]. With
    `synced`, each call is followed by a synchronisation (as the wall time is measured; queued
    calls can block inside the second one's launches while the first runs)."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        fn()
        sync() if synced else None
    sync()
    pr.disable()
    stats = pstats.Stats(pr).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        [f"{Path(f).name}:{line}:{func}", round(nc / steps, 1), round(tt * 1e3 / steps, 4), round(ct * 1e3 / steps, 4)]
        for (f, line, func), (_cc, nc, tt, ct, _callers) in rows
    ]


def gemv_configs() -> dict:
    """The tile each GEMV kernel's autotuner chose, per (N, K, M, ...) key."""
    from mpsconvert.runtime.ops.triton import gemv as triton_gemv

    out = {}
    for label, kern in (
        ("gemv", getattr(triton_gemv, "_kernel", None)),
        ("w8a8", getattr(triton_gemv, "_dot_kernel", None)),
    ):
        for key, cfg in (getattr(kern, "cache", None) or {}).items():
            out[f"{label} {key[:3]}"] = str(cfg)
    return out


def decoder_layers(model):
    for name in ("model.layers", "model.decoder.layers", "transformer.h"):
        mod = model
        try:
            for part in name.split("."):
                mod = getattr(mod, part)
            return mod
        except AttributeError:
            continue
    raise RuntimeError("no decoder layers found")


def weight_bytes(model) -> tuple[int, int]:
    """(bytes of all parameters and buffers, bytes of the input embedding)."""
    from mpsconvert.runtime.load.load_report import model_bytes

    emb = model.get_input_embeddings().weight
    return model_bytes(model), emb.numel() * emb.element_size()


def time_model(name: str, load_fn, args, device, deadline: float, bw: float, profiling: bool = False) -> dict:
    """One variant, loaded fresh: its timings, or with `profiling` its profiles only (a second
    pass after every variant was timed: a process that ran the CUDA profiler keeps paying for it
    in host time, so no timing may follow a profile; an 8-layer Llama decode step on the H200 took
    0.26 ms of host time in a fresh process and 0.68 ms in this benchmark after its profiles)."""
    from transformers import DynamicCache, StaticCache

    row: dict = {}
    if name.partition("@")[0].endswith("-cold"):  # the files from disk, not the page cache (root on the device machine)
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            row["page_cache_dropped"] = True
        except OSError as e:
            row["page_cache_dropped"] = f"no: {e.strerror}"
    os.sync()  # no write-back of the files this run wrote competes with the timed host
    torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
    sync()
    t = time.perf_counter()
    model = load_fn()
    sync()
    info = getattr(model, "mpsconvert", None)
    if not profiling:
        row["load_s"] = round(time.perf_counter() - t, 2)
    if not profiling and info is not None:
        row["load_breakdown_s"] = info.seconds
        row["kernels"] = [
            f"{d['shape'][0]}x{d['shape'][1]} {d['bucket']}: {d['choice']} {d['timings_us']}" for d in info.kernels
        ]
        row["patches"] = info.patches
        row["experts"] = sorted({json.dumps(v, sort_keys=True) for v in info.experts.values()})
        row["prewarm"] = info.prewarm
        row["gemv_configs"] = gemv_configs()
    total, emb = weight_bytes(model)
    if not profiling:
        row["weight_bytes"] = total
        row["attention"] = getattr(model.config, "_attn_implementation", None)
        log(
            f"{name}: loaded in {row['load_s']} s, {total / 2**30:.2f} GiB",
            row.get("load_breakdown_s"),
            row.get("patches"),
        )
    if name.partition("@")[0].endswith(
        ("-warm", "-cold")
    ):  # a second load (caches warm) or one from disk: only the load matters
        model = None  # freed (the closures below hold the name)
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
        return row
    ids = torch.randint(
        0,
        model.config.vocab_size,
        (1, args.prefill),
        device=device,
        generator=torch.Generator(device=device).manual_seed(0),
    )

    def prefill():
        with torch.no_grad():
            return model(ids, use_cache=False, logits_to_keep=1).logits

    def prefill_cached():  # as `generate` calls it: a fresh DynamicCache (no packed-sequence check, cache writes)
        with torch.no_grad():
            return model(
                ids, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1
            ).logits

    try:
        if profiling:
            if device.type == "cuda" and args.profile:
                # profiled in the GPU state the timed calls ran in (the same loop first, then 5 calls
                # of it): at the FP8 prefill the H200 reaches its 700 W cap within a few calls and
                # lowers its clock from 1980 to ~1550 MHz, so a call profiled after an idle GPU ran
                # its kernels up to 9% faster than the timed calls did (results/eager_floor_h200_llama32_positions.log)
                samples(prefill, args.repeats, 2)
                row["eager_prefill_profile"] = profile(prefill, calls=PROFILED_CALLS)
                log(f"{name}: eager prefill profile", row["eager_prefill_profile"])
                samples(prefill_cached, args.repeats, 2)
                row["eager_prefill_cached_profile"] = profile(prefill_cached, calls=PROFILED_CALLS)
                log(f"{name}: eager prefill (with a cache) profile", row["eager_prefill_cached_profile"])
            if args.host_profile:
                row["eager_prefill_host_profile"] = host_profile(prefill, 2, top=45)
                log(f"{name}: eager prefill host profile (ms per call)", row["eager_prefill_host_profile"][:25])
        else:
            t0 = time.perf_counter()
            prefill()
            sync()
            first_ms = round(
                (time.perf_counter() - t0) * 1e3, 3
            )  # ours: includes capturing this length's prefill graphs
            layers = decoder_layers(model)
            row["eager_prefill"] = summary(samples(prefill, args.repeats, 2))
            row["eager_prefill"].update(timeline(prefill, layers), first_ms=first_ms)
            graphs = prefill_graphs.of(model)
            if graphs is not None:
                row["eager_prefill"]["prefill_graphs"] = graphs.report()
                log(f"{name}: prefill graphs", graphs.report())
            if device.type == "cuda":
                row["eager_prefill"]["gpu_queued_ms"] = round(
                    statistics.median(queued_gpu_ms(prefill) for _ in range(3)), 3
                )
            LOGITS[name] = {"eager": prefill()[0, -1].float().cpu()}
            log(f"{name}: eager prefill {row['eager_prefill']['median_ms']} ms")
            row["eager_prefill_cached"] = summary(samples(prefill_cached, args.repeats, 2))
            if device.type == "cuda":
                row["eager_prefill_cached"]["gpu_queued_ms"] = round(
                    statistics.median(queued_gpu_ms(prefill_cached) for _ in range(3)), 3
                )
            log(
                f"{name}: eager prefill with a cache, as generate calls it, "
                f"{row['eager_prefill_cached']['median_ms']} ms"
            )
    except Exception as e:
        row["eager_prefill_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    if not profiling and args.compile and time.perf_counter() < deadline:
        layers = decoder_layers(model)
        try:
            t = time.perf_counter()
            for layer in layers:
                layer.compile()
            first = samples(prefill, 1, 0)[0]
            row["compiled_prefill_compile_s"] = round(time.perf_counter() - t, 1)
            row["compiled_prefill"] = summary(samples(prefill, args.repeats, 2))
            LOGITS.setdefault(name, {})["compiled"] = prefill()[0, -1].float().cpu()
            log(f"{name}: compiled prefill {row['compiled_prefill']['median_ms']} ms (first call {first:.1f} s)")
        except Exception as e:
            row["compiled_prefill_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        for layer in layers:
            layer._compiled_call_impl = None
        torch._dynamo.reset()
    elif not profiling:
        row["compiled_prefill_skipped"] = "no --compile" if not args.compile else "time budget"
    if time.perf_counter() < deadline:
        try:
            # every step writes the next slot: transformers >= 5.x's StaticCache counts the tokens
            # written (cumulative_length) whatever cache_position says, so positions only go forward
            cache_len = args.prefill + 2 * args.decode + 24  # warm-up, two timed runs, the profiles' ten
            positions = itertools.count(args.prefill)
            cache = StaticCache(config=model.config, max_cache_len=cache_len)
            with torch.no_grad():
                model(
                    ids,
                    past_key_values=cache,
                    use_cache=True,
                    cache_position=torch.arange(args.prefill, device=device),
                    logits_to_keep=1,
                )
            step = torch.compile(model.forward, mode="reduce-overhead") if args.compile else model.forward
            state = {
                "tok": ids[:, -1:].clone(memory_format=torch.contiguous_format)
            }  # strides (1, 1), as every later token has: no recompile

            def one_step():
                position = torch.tensor([next(positions)], device=device)
                with torch.no_grad():
                    out = step(state["tok"], past_key_values=cache, use_cache=True, cache_position=position).logits
                    state["tok"] = out[:, -1:].argmax(-1).clone()

            host: list[float] = []  # the step's host time (until it returns, before the sync)

            def timed(steps: int) -> list[float]:
                per = []
                host.clear()
                for _ in range(steps):
                    sync()
                    t1 = time.perf_counter()
                    one_step()
                    host.append(time.perf_counter() - t1)
                    sync()
                    per.append(time.perf_counter() - t1)
                return per

            t = time.perf_counter()
            for _ in range(3):  # compile and capture the graph
                one_step()
            sync()
            if profiling:
                with warm_guards(args.compile):
                    if device.type == "cuda" and args.profile:
                        row["decode_profile"] = profile(one_step, top=40)
                        log(f"{name}: decode step profile", row["decode_profile"])
                    if args.host_profile:
                        row["decode_host_profile"] = host_profile(one_step, 8)
                        log(f"{name}: decode step host profile (ms per step)", row["decode_host_profile"][:12])
            else:
                row["compiled_decode_compile_s"] = round(time.perf_counter() - t, 1)
                row["decode_full_guards"] = summary(timed(args.decode))  # every guard of the forward, every step
                full_host = summary(host)["median_ms"]
                try:
                    with warm_guards(args.compile):  # validate's routine: the warm step's differentiating guards only
                        row["decode"] = summary(timed(args.decode))
                        row["decode"] |= {
                            "compiled": args.compile,
                            "guards": "warm (skip_guard_eval_unsafe)" if args.compile else "eager",
                            "host_ms": summary(host)["median_ms"],
                        }
                except (
                    RuntimeError
                ) as e:  # a model that recompiles in the warm stance (compressed-tensors' offload guard)
                    if "Recompilation" not in str(e):
                        raise
                    row["decode"] = row["decode_full_guards"] | {
                        "compiled": True,
                        "host_ms": full_host,
                        "guards": f"full: the warm stance recompiled ({str(e)[:120]})",
                    }
                cfg = model.config
                head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
                kv = (
                    2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * cache_len * 2
                )  # the static cache, read whole
                if getattr(cfg, "num_local_experts", None):  # MoE: a token reads top-k of the experts
                    frac = cfg.num_experts_per_tok / cfg.num_local_experts
                    ex = sum(
                        b.numel() * b.element_size()
                        for n, b in list(model.named_parameters()) + list(model.named_buffers())
                        if ".experts." in n and not n.endswith("_dense")
                    )
                    step_bytes = total - emb - ex * (1 - frac) + kv
                else:
                    step_bytes = total - emb + kv
                row["decode"]["bytes_per_step"] = int(step_bytes)
                row["decode"]["bandwidth_fraction"] = (
                    round(step_bytes / (row["decode"]["median_ms"] / 1e3) / bw, 3) if bw == bw else None
                )
                log(
                    f"{name}: decode {row['decode']['median_ms']} ms/token, "
                    f"{row['decode'].get('bandwidth_fraction')} of copy bandwidth"
                )
        except Exception as e:
            row["decode_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        torch._dynamo.reset()
    else:
        row["decode_skipped"] = "time budget"
    if not profiling:
        row["peak_memory_bytes"] = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    model = None  # freed (the closures above hold the name)
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return row


LOGITS: dict = {}  # variant -> {"eager"|"compiled": last-position logits of the prefill}


def agreement() -> dict:
    """Each variant's prefill logits against BF16's, ours-* against ours', and compiled against
    its own eager ones."""
    base = LOGITS.get("bf16", {}).get("eager")
    out = {}
    for name, d in LOGITS.items():
        row = {}
        if base is not None and "eager" in d:
            row["rel_err_vs_bf16"] = round(float((d["eager"] - base).norm() / base.norm()), 4)
            row["same_argmax_as_bf16"] = bool(d["eager"].argmax() == base.argmax())
        ours = LOGITS.get("ours", {}).get("eager")
        if (
            name.startswith("ours-") and ours is not None and "eager" in d
        ):  # e.g. ours-direct: the same kernels launched one by one
            row["rel_err_vs_ours"] = round(float((d["eager"] - ours).norm() / ours.norm()), 6)
        if "compiled" in d and "eager" in d:
            row["compiled_vs_eager_rel_err"] = round(float((d["compiled"] - d["eager"]).norm() / d["eager"].norm()), 4)
        out[name] = row
    return out


def loaders(name: str, src: Path, art: Path, device, args):
    import transformers

    if name in ("bf16", "bf16-cold", "bf16-attn"):

        def bf16():
            model = transformers.AutoModelForCausalLM.from_pretrained(
                src, dtype=torch.bfloat16, device_map=str(device)
            ).eval()
            if name == "bf16-attn":  # the same decode attention as ours, to separate its share of the speed-up
                from mpsconvert.runtime.patches import attention

                attention.install(model)
            return model

        return bf16
    name = name.partition("@")[0]  # the artifact is chosen by the caller
    if name in ("ours", "ours-warm", "ours-cold", "ours-sharedquant", "ours-sdpa", "ours-unfused", "ours-direct"):
        from mpsconvert.runtime import load
        from mpsconvert.runtime.ops import fuse

        fuse.PREFILL_SHARES = (
            "quantization" if name == "ours-sharedquant" else DEFAULT_SHARES
        )  # ours: the library's default
        return lambda: load(
            art,
            device=str(device),
            decode_attention=name != "ours-sdpa",
            eager_fusion=name != "ours-unfused",
            prefill_graphs=name != "ours-direct",
        )  # ours-unfused: the model's own norms and MLPs
    if name in ("ct", "ct-opt"):
        from transformers import CompressedTensorsConfig

        qc = CompressedTensorsConfig(use_optimized_inference=name == "ct-opt")
        return lambda: transformers.AutoModelForCausalLM.from_pretrained(
            art, dtype=torch.bfloat16, device_map=str(device), quantization_config=qc
        ).eval()
    raise SystemExit(f"unknown variant {name}")


def ratios(results: dict) -> dict:
    base = results.get("bf16", {})
    out = {}
    for name, r in results.items():
        row = {}
        for key in ("eager_prefill", "eager_prefill_cached", "compiled_prefill", "decode", "decode_full_guards"):
            if key in r and key in base:
                row[key] = round(base[key]["median_ms"] / r[key]["median_ms"], 3)
        if "load_s" in r and "load_s" in base:
            row["load_vs_bf16"] = round(r["load_s"] / base["load_s"], 2)
        cold = results.get("bf16-cold", {})
        if name.partition("@")[0].endswith("-cold") and "load_s" in r and "load_s" in cold:
            row["load_vs_bf16_cold"] = round(r["load_s"] / cold["load_s"], 2)  # like with like: both from disk
        out[name] = row
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 32 for llama, 4 for mixtral)")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=32, help="decode steps timed")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--variants", default="bf16,ours,ours-warm,ct-opt,ct")
    ap.add_argument(
        "--weights",
        default="row",
        help="weight granularities to quantize and time, comma-separated (row, tensor, block)",
    )
    ap.add_argument("--work", help="folder for the checkpoints (kept; reused when it holds them)")
    ap.add_argument("--json", help="write the results here (also after each variant)")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds after which compiled phases are skipped")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--no-profile",
        dest="profile",
        action="store_false",
        help="no CUDA profiles (GPU busy time; otherwise a second pass after all timings)",
    )
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="also cProfile two eager prefills and 8 warm decode steps (where the host time goes)",
    )
    ap.add_argument(
        "--same-process",
        dest="isolate",
        action="store_false",
        help="time every variant in this process (default: a process per variant and per profile pass)",
    )
    for flag in ("--child", "--child-art", "--child-out", "--child-bw"):  # one variant in this process, for the parent
        ap.add_argument(flag, help=argparse.SUPPRESS)
    ap.add_argument("--child-profiling", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    layers = args.layers or {"llama": 32, "mixtral": 4}.get(args.arch, 2)
    device = torch.device(args.device)
    deadline = T0 + args.budget
    work = Path(args.work or tempfile.mkdtemp(prefix="mpsconvert-bench-"))  # a child is always given the parent's
    src = work / f"{args.arch}-{layers}-bf16"
    if args.child:
        return child(args, device, deadline, src)
    grains = args.weights.split(",")
    arts = {w: work / (f"{args.arch}-{layers}-fp8" + ("" if w == "row" else f"-{w}")) for w in grains}
    art = arts[grains[0]]
    import transformers

    report = {
        "env": {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "arch": args.arch,
            "layers": layers,
            "prefill": args.prefill,
            "run_cache": str(RUN_CACHE),
        }
    }
    try:
        import compressed_tensors

        report["env"]["compressed_tensors"] = compressed_tensors.__version__
    except ImportError:
        pass
    log("env", report["env"])

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))

    if not (src / "config.json").is_file():
        report["build"] = build_checkpoint(config_for(args.arch, layers), src, device)
        log("built", report["build"])
    for w, a in arts.items():
        if not (a / "mpsconvert.json").is_file():
            report["quantize" if w == grains[0] else f"quantize@{w}"] = quantize(src, a, w)
            log(f"quantized ({w})", report["quantize" if w == grains[0] else f"quantize@{w}"])
    if device.type == "cuda":
        try:
            report["kernel_checks"] = kernel_checks(device)
            report["host_cost"] = host_cost(device)
        except Exception as e:
            report["kernel_checks"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            traceback.print_exc()
    report["copy_bandwidth_Bps"] = copy_bandwidth(device)
    log(f"device-to-device copy: {report['copy_bandwidth_Bps'] / 1e12:.2f} TB/s")
    save()
    results = report["results"] = {}
    runs = []
    for name in args.variants.split(","):
        on_artifact = name.startswith(("ours", "ct"))
        runs += (
            [(name if i == 0 else f"{name}@{w}", arts[w]) for i, w in enumerate(grains)]
            if on_artifact
            else [(name, art)]
        )

    def variant(name: str, variant_art: Path, profiling: bool = False) -> dict:
        if not args.isolate:
            return time_model(
                name,
                loaders(name, src, variant_art, device, args),
                args,
                device,
                deadline,
                report["copy_bandwidth_Bps"],
                profiling=profiling,
            )
        return in_child(name, variant_art, profiling, work, report["copy_bandwidth_Bps"], deadline, argv)

    for name, variant_art in runs:
        log(f"== {name}")
        try:
            results[name] = variant(name, variant_art)
        except Exception as e:  # one variant failing must not cost the others' numbers
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            gc.collect()
            torch.cuda.empty_cache() if device.type == "cuda" else None
        report["ratios_to_bf16"] = ratios(results)
        report["logits_agreement"] = agreement()
        save()
    if (args.profile and device.type == "cuda") or args.host_profile:  # the profiles, after every timing
        for name, variant_art in runs:
            if name.partition("@")[0].endswith(("-warm", "-cold")) or "error" in results.get(name, {}):
                continue
            log(f"== {name} (profiles)")
            try:
                results[name] |= variant(name, variant_art, profiling=True)
            except Exception as e:
                traceback.print_exc()
                results[name]["profile_error"] = f"{type(e).__name__}: {str(e)[:500]}"
                gc.collect()
                torch.cuda.empty_cache() if device.type == "cuda" else None
            save()
    print_table(report)
    print("logits:", json.dumps(report.get("logits_agreement")))
    save()


def in_child(name: str, art: Path, profiling: bool, work: Path, bw: float, deadline: float, argv) -> dict:
    """`time_model` for one variant in a fresh process of this script (see the module docstring):
    its row, and its prefill logits into LOGITS for the agreement check."""
    out = Path(tempfile.mkdtemp(prefix="mpsconvert-bench-variant-")) / "row.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        *(sys.argv[1:] if argv is None else argv),
        "--work",
        str(work),
        "--budget",
        str(max(0.0, deadline - time.perf_counter())),
        "--child",
        name,
        "--child-art",
        str(art),
        "--child-out",
        str(out),
        "--child-bw",
        repr(bw),
    ] + (["--child-profiling"] if profiling else [])
    r = subprocess.run(cmd)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"the process timing {name} exited with status {r.returncode}")
    logits = out.with_suffix(".pt")
    if logits.is_file():
        LOGITS[name] = LOGITS.get(name, {}) | torch.load(logits)
    return json.loads(out.read_text())


def child(args, device, deadline: float, src: Path) -> None:
    """The child side of `in_child`: one variant timed (or profiled) here, written to --child-out."""
    art = Path(args.child_art)
    import transformers  # the model's modeling module imported before the clock starts, as the shared process had it

    getattr(transformers, transformers.AutoConfig.from_pretrained(src).architectures[0])
    row = time_model(
        args.child,
        loaders(args.child, src, art, device, args),
        args,
        device,
        deadline,
        float(args.child_bw),
        profiling=args.child_profiling,
    )
    out = Path(args.child_out)
    if args.child in LOGITS:
        torch.save(LOGITS[args.child], out.with_suffix(".pt"))
    out.write_text(json.dumps(row))


def print_table(report):
    res, rat = report["results"], report.get("ratios_to_bf16", {})
    env = report["env"]
    print(
        f"\n{env['arch']} x{env['layers']} layers, prefill {env['prefill']} tokens, {env['device']}, torch "
        f"{env['torch']}, transformers {env['transformers']}; ratio = BF16 time / variant time (load: variant / "
        "BF16, -cold rows / bf16-cold)"
    )
    head = (
        f"{'variant':10s} {'load s':>7s} {'xBF16':>6s} {'eager ms':>9s} {'x':>5s} {'host ms':>7s} {'lag ms':>7s} "
        f"{'queued':>7s} {'busy ms':>8s} {'comp ms':>8s} {'x':>5s} {'dec ms':>7s} {'x':>5s} {'bw':>5s} "
        f"{'peak GiB':>8s}"
    )
    print(head)
    for name, r in res.items():
        if "error" in r:
            print(f"{name:10s} ERROR {r['error'][:150]}")
            continue
        q = rat.get(name, {})

        def cell(key, fmt="{:9.2f}"):
            return fmt.format(r[key]["median_ms"]) if key in r else fmt.format(float("nan"))

        busy = (r.get("eager_prefill_profile") or {}).get("gpu_busy_ms", float("nan"))
        ep = r.get("eager_prefill") or {}
        host, lag = ep.get("host_ms", float("nan")), ep.get("gpu_lag_at_last_layer_ms", float("nan"))
        queued = ep.get("gpu_queued_ms", float("nan"))
        bw = (r.get("decode") or {}).get("bandwidth_fraction") or float("nan")
        peak = (r.get("peak_memory_bytes") or 0) / 2**30
        print(
            f"{name:10s} {r.get('load_s', float('nan')):7.2f} "
            f"{q.get('load_vs_bf16_cold', q.get('load_vs_bf16', float('nan'))):6.2f} {cell('eager_prefill')} "
            f"{q.get('eager_prefill', float('nan')):5.2f} {host:7.2f} {lag:7.2f} {queued:7.2f} {busy:8.2f} "
            f"{cell('compiled_prefill', '{:8.2f}')} {q.get('compiled_prefill', float('nan')):5.2f} "
            f"{cell('decode', '{:7.2f}')} {q.get('decode', float('nan')):5.2f} {bw:5.2f} {peak:8.2f}"
        )
    print(
        "eager prefill, wall / GPU busy (without a cache, as timed above | with a fresh DynamicCache, as generate "
        f"calls it; busy per call of {PROFILED_CALLS} profiled after the timed loop, and the wall of those calls "
        "under the profiler):"
    )
    for name, r in res.items():
        parts = []
        for key in ("eager_prefill", "eager_prefill_cached"):
            prof = r.get(f"{key}_profile") or {}
            wall, busy, pwall = (r.get(key) or {}).get("median_ms"), prof.get("gpu_busy_ms"), prof.get("wall_ms")
            queued = (r.get(key) or {}).get("gpu_queued_ms")
            parts.append(
                f"{wall} ms / {busy} ms = {wall / busy:.3f}, profiled {pwall / busy:.3f} (queued {queued} ms)"
                if wall and busy and pwall
                else "-"
            )
        print(f"  {name:10s} " + " | ".join(parts))
    print(
        "eager prefill, wall / the GPU's time from the first layer to the end in calls right after the timed loop "
        "(CUDA events, no profiler), and how far the host was ahead of the GPU at the last layer:"
    )
    for name, r in res.items():
        ep = r.get("eager_prefill") or {}
        wall, span, lag = ep.get("median_ms"), ep.get("gpu_from_first_layer_ms"), ep.get("gpu_lag_at_last_layer_ms")
        if wall and span:
            print(f"  {name:10s} {wall} ms / {span} ms = {wall / span:.3f}, host ahead by {lag} ms")


if __name__ == "__main__":
    main()
