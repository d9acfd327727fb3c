"""Who sets an eager prefill's pace, without a profiler (a diagnosis; CUDA): BF16 and ours,
Llama-3-8B-shaped, L layers, fresh process.

Prints, per model: the wall time of a 2048-token prefill; the GPU time with three prefills queued
behind a GPU sleep (the host never in the way: the GPU's own floor, kernels plus the device's
gaps between them); where the forward synchronises (torch.cuda sync debug mode, with the stack);
a per-layer timeline (host clock and CUDA event at each decoder layer's start: a GPU lag that
grows layer after layer means the GPU, not the host, sets the pace); the wall time under
gc.freeze() and gc.disable(). With --pieces, also the host time to enqueue (GPU sleep in front)
and the GPU time of each piece of one decoder layer (norm, attention, q/k/v, o_proj, MLP, add)
and of the model's preamble and head.

    python benchmarks/eager_timeline.py [--layers 32] [--pieces]    (checkpoints under /tmp/tl<L>)

benchmarks/results/eager_timeline_h200_llama32.log is `--layers 32`, and
eager_host_breakdown_h200_llama8.log `--layers 8 --pieces` in this script's first form (commit
7871a68, two scripts).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

import model_latency as ml  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from mpsconvert.runtime import load  # noqa: E402

S = 2048


def walls(fn, n=20) -> str:
    xs = sorted(ml.samples(fn, n, 0))
    return f"median {statistics.median(xs) * 1e3:.2f} min {xs[0] * 1e3:.2f} max {xs[-1] * 1e3:.2f} ms"


def host_us(fn, n: int) -> float:
    """Host time per call of `fn` to enqueue its work, the GPU busy with a sleep meanwhile."""
    fn()
    ml.sync()
    torch.cuda._sleep(ml.SLEEP_CYCLES)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n
    ml.sync()
    return dt * 1e6


def timeline(model, fn) -> None:
    m = ml.layer_marks(fn, model.model.layers)
    host = [round(t, 2) for t in m["host_at_layers_ms"]]
    dev = [round(t, 2) for t in m["gpu_at_layers_ms"]]
    print("  host ms at layer starts", host[::4], "return", round(m["host_return_ms"], 2), "wall", round(m["wall_ms"], 2))
    print("  gpu  ms at layer starts", dev[::4], "end", round(m["gpu_end_ms"], 2))
    print("  gpu-host lag per 4 layers", [round(d - h, 2) for d, h in zip(dev[::4], host[::4])], flush=True)


def syncs(fn) -> list[str]:
    """The stacks of the synchronising calls in one `fn()` (torch.cuda sync debug mode)."""
    old, seen = warnings.showwarning, []
    warnings.showwarning = lambda *a, **k: seen.append("".join(traceback.format_stack(limit=14)[:-3]))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            fn()
            torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = old
    return seen


def pieces(name: str, model) -> None:
    layer, at = model.model.layers[1], model.model.layers[1].self_attn
    x = torch.randn(1, S, model.config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(0))
    pos = torch.arange(S, device="cuda")[None]
    pe = model.model.rotary_emb(x, pos)
    parts = {
        "layer": lambda: layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe),
        "input_layernorm": lambda: layer.input_layernorm(x),
        "self_attn": lambda: at(hidden_states=x, attention_mask=None, position_ids=pos, position_embeddings=pe),
        "q,k,v proj": lambda: (at.q_proj(x), at.k_proj(x), at.v_proj(x)),
        "o_proj": lambda: at.o_proj(x),
        "mlp": lambda: layer.mlp(x),
        "add": lambda: x + x,
        "model.norm": lambda: model.model.norm(x),
        "rotary_emb": lambda: model.model.rotary_emb(x, pos),
        "lm_head(1 row)": lambda: model.lm_head(x[:, -1:]),
    }
    with torch.no_grad():
        for k, fn in parts.items():
            print(f"  {name:5s} {k:16s} host {host_us(fn, 20):8.1f} us  gpu {ml.queued_gpu_ms(fn, 20) * 1e3:8.1f} us", flush=True)


def run(name: str, model, args) -> None:
    ids = torch.randint(0, 1000, (1, S), device="cuda")

    def prefill():
        with torch.no_grad():
            return model(ids, use_cache=False, logits_to_keep=1).logits

    for _ in range(3):
        prefill()
    print(name, "wall", walls(prefill), "| gpu with the queue full", round(ml.queued_gpu_ms(prefill, 3), 2), "ms", flush=True)
    for s in syncs(prefill)[:2]:
        print("  SYNC at:\n" + s[-1800:], flush=True)
    timeline(model, prefill)
    timeline(model, prefill)
    gc.collect()
    gc.freeze()
    print(name, "gc.freeze wall", walls(prefill), flush=True)
    gc.unfreeze()
    gc.disable()
    print(name, "gc.disable wall", walls(prefill), flush=True)
    timeline(model, prefill)
    gc.enable()
    if args.pieces:
        pieces(name, model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pieces", action="store_true", help="also host and GPU time of each piece of one layer")
    args = ap.parse_args()
    work = Path(f"/tmp/tl{args.layers}")
    src, art = work / "src", work / "art"
    if not (src / "config.json").exists():
        ml.build_checkpoint(ml.config_for("llama", args.layers), src, torch.device("cuda"))
        ml.quantize(src, art)
    print("torch", torch.__version__, "transformers", transformers.__version__, "layers", args.layers, flush=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, device_map="cuda")
    run("bf16", model, args)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    model = load(art, device="cuda")
    print("ours", model.mpsconvert.seconds, model.mpsconvert.eager_fusion, flush=True)
    run("ours", model, args)


if __name__ == "__main__":
    main()
