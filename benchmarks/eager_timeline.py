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

With --floor, instead: the wall time as users run it against the GPU's own floor (the
packed-sequence check and the rotary tables patched out, the call queued behind a GPU sleep,
a CUDA graph replay), the preamble's host time step by step, and GPU busy profiled in the GPU's
state after a timed loop (this FP8 prefill power-caps the H200); see `floor`.

    python benchmarks/eager_timeline.py [--layers 32] [--pieces | --floor | --direct] [--variants bf16,ours]
        (checkpoints under /tmp/tl<L>)

With --direct (ours only): an A/B of the direct prefill path in one process (see `direct`).
results/eager_direct_ab_h200_llama4.log is `--layers 4 --direct`; ..._llama8.log and
..._llama8_first.log (the path's first form, before its norms wrote codes only) are the same A/B
at 8 layers, run from a scratch copy of `direct` before it was added here.

results/eager_floor_h200_llama32.log is `--floor` before runtime/positions.py, ..._positions.log
(with nvidia-smi's clocks in ..._positions_smi.csv) after it, ..._slowhost.log `--floor
--variants ours` on a host-slow machine.

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


def preamble(model, fn, n: int = 20) -> dict:
    """Host microseconds from the call's start to each step of the model's preamble (median of
    `n` calls, forward hooks and a wrapper of the modeling module's create_causal_mask)."""
    import sys as _sys

    home = _sys.modules[type(model.model).__module__]
    marks: dict = {}

    def mark(key):
        def hook(*a):  # returns None: a hook's value would replace the module's inputs or output
            marks.setdefault(key, time.perf_counter())

        return hook

    base = model.model
    hooks = [base.register_forward_pre_hook(mark("model")), base.embed_tokens.register_forward_pre_hook(mark("embed")),
             base.embed_tokens.register_forward_hook(mark("embed done")), base.rotary_emb.register_forward_pre_hook(mark("rotary")),
             base.rotary_emb.register_forward_hook(mark("rotary done")), base.layers[0].register_forward_pre_hook(mark("layer 0"))]  # fmt: skip
    own = home.create_causal_mask

    def wrapped(*a, **k):
        marks.setdefault("mask", time.perf_counter())
        out = own(*a, **k)
        marks.setdefault("mask done", time.perf_counter())
        return out

    home.create_causal_mask = wrapped
    rows = []
    try:
        for _ in range(n):
            ml.sync()
            marks.clear()
            t = time.perf_counter()
            fn()
            rows.append({k: (v - t) * 1e6 for k, v in marks.items()})
            ml.sync()
    finally:
        home.create_causal_mask = own
        for h in hooks:
            h.remove()
    return {k: round(statistics.median(r[k] for r in rows), 1) for k in sorted(rows[0], key=rows[0].get)}


def table_rotary(model):
    """The rotary module's forward as a gather from cos / sin tables of its own forward at every
    position up to max_position_embeddings (a diagnostic: what the tables save; checked equal)."""
    import torch.nn.functional as F

    rot, dev = model.model.rotary_emb, model.device
    n = model.config.max_position_embeddings
    x = torch.zeros(1, 1, 1, device=dev, dtype=torch.bfloat16)
    cos, sin = rot(x, torch.arange(n, device=dev)[None])
    cos, sin = cos[0].contiguous(), sin[0].contiguous()
    pos = torch.arange(S, device=dev)[None]
    want = rot(x, pos)
    got = (F.embedding(pos, cos), F.embedding(pos, sin))
    assert all(torch.equal(a, b) for a, b in zip(want, got)), "tables differ from the module's forward"
    return lambda x, position_ids: (F.embedding(position_ids, cos), F.embedding(position_ids, sin))


def floor(name: str, model, prefill) -> None:
    """The eager prefill against the GPU's own floor: the wall time as users run it, without
    transformers' packed-sequence check (it synchronises; patched to return None, what it returns
    for one sequence), with the rotary tables gathered as well; the GPU time of the same kernels
    replayed from a CUDA graph (no host at all); the preamble's host time; then (a process that
    ran the profiler keeps paying for it in host time, so after every timing) the profiler's busy
    time and gaps of each, the eager ones also with the call queued behind a GPU sleep."""
    import transformers.masking_utils as mu

    def prof(tag, fn, queued=False, calls=1):
        p = ml.profile(fn, top=6, queued=queued, calls=calls)
        idle = p["idle"]
        print(f"  {name:5s} {tag:36s} {time.strftime('%H:%M:%S')} busy {p['gpu_busy_ms']:6.2f} ms, {p['kernels']} kernels, between kernels {idle['between_kernels_us'] / 1e3:5.2f} ms "
              f"({idle['gaps_over_20us']} gaps >= 20 us: {idle['in_gaps_over_20us'] / 1e3:5.2f} ms), before the first {idle['before_first_kernel_us']} us, syncs {p['host_syncs']}", flush=True)  # fmt: skip
        print("      top", [[k[:28], n, t] for k, n, t in p["top_kernels_ms"]], flush=True)

    def timed(tag):
        print(f"  {name:5s} {tag:36s} {time.strftime('%H:%M:%S')} wall {walls(prefill)}, queued {ml.queued_gpu_ms(prefill, 3):.2f} ms", flush=True)
        print(f"  {name:5s} {tag:36s} preamble host us", preamble(model, prefill), flush=True)

    own, rot = mu.find_packed_sequence_indices, model.model.rotary_emb
    x = torch.zeros(1, 1, 1, device=model.device, dtype=torch.bfloat16)
    pos = torch.arange(S, device=model.device)[None]

    def patch(packed: bool, tables: bool):
        mu.find_packed_sequence_indices = (lambda position_ids: None) if packed else own
        rot.__dict__.pop("forward", None)
        if tables:
            rot.forward = table_rotary(model)

    try:
        timed("as users run it")
        timeline(model, prefill)
        if (getattr(model, "mpsconvert", None) and model.mpsconvert.positions.get("installed")):
            from mpsconvert.runtime import forwards, positions

            forwards.uninstall(model.model)  # the load without runtime/positions.py, for comparison
            forwards.uninstall(rot)
            timed("without runtime/positions.py")
            forwards.install(rot, positions._rotary_forward)
            forwards.install(model.model, positions._model_forward)
        patch(True, False)
        timed("no packed check")
        print(f"  {name:5s} rotary module host {host_us(lambda: rot(x, pos), 50):.1f} us", flush=True)
        patch(True, True)
        print(f"  {name:5s} rotary tables host {host_us(lambda: rot(x, pos), 50):.1f} us", flush=True)
        timed("no packed check, rotary tables")
        timeline(model, prefill)
        graph = captured(name, prefill)
        if graph is not None:
            print(f"  {name:5s} CUDA graph replay: {walls(graph.replay)}", flush=True)
        patch(False, False)
        prof("eager", prefill)
        prof("eager, 5 calls", prefill, calls=5)
        prof("eager, queued behind a sleep", prefill, queued=True)
        prof("eager, 3 calls queued", prefill, queued=True, calls=3)
        patch(True, True)
        prof("no packed check, rotary tables, queued", prefill, queued=True)
        if graph is not None:
            prof("CUDA graph replay", graph.replay)
    finally:
        patch(False, False)


def captured(name: str, prefill):
    """The prefill captured in a CUDA graph (its replay: the GPU's time with no host in the
    way), or None with the reason printed."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                prefill()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):  # captured on the warmed stream: cuBLASLt keeps its workspace and choices
            prefill()
        return graph
    except Exception as e:  # a diagnostic: say why, keep the rest
        print(f"  {name:5s} CUDA graph capture failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None


def direct(model) -> None:
    """A/B of the direct prefill path (runtime/attention_prefill.py, eager_fusion._direct_layer)
    in one process: the layers' plans removed and restored in turn, two rounds, the eager wall
    at 2048 tokens and at 128 (where the host alone sets the time), the logits of both (equal bit
    for bit), the per-layer timeline of each, and a cProfile of the direct path at 128 tokens."""
    layers = list(model.model.layers)
    plans = [layer.mpsconvert_attention for layer in layers]

    def use(on: bool) -> None:
        for layer, plan in zip(layers, plans):
            object.__setattr__(layer, "mpsconvert_attention", plan if on else None)

    fns = {}
    for n in (S, 128):
        ids = torch.randint(0, 1000, (1, n), device="cuda")
        fns[n] = (lambda ids: lambda: model(ids, use_cache=False, logits_to_keep=1).logits)(ids)
    outs: dict = {}
    try:
        with torch.no_grad():
            for rnd in range(2):
                for on in (False, True):
                    use(on)
                    for n, fn in fns.items():
                        for _ in range(3):
                            out = fn()
                        outs.setdefault(n, {})[on] = out
                        print(f"round {rnd} direct={on} S={n} wall {walls(fn, 30)}, direct calls of layer 0 so far {plans[0].calls}", flush=True)
            for n in fns:
                print("S", n, "logits equal with and without the direct path:", torch.equal(outs[n][False], outs[n][True]), flush=True)
            for on in (False, True):
                use(on)
                print(f"direct={on}", flush=True)
                timeline(model, fns[S])
            use(True)
            print("direct path, cProfile of 20 synchronised calls at 128 tokens ([function, calls, own ms, cumulative ms] per call):", flush=True)
            for row in ml.host_profile(fns[128], 20, top=40, synced=True):
                print("  ", row, flush=True)
    finally:
        use(True)


def run(name: str, model, args) -> None:
    ids = torch.randint(0, 1000, (1, S), device="cuda")

    def prefill():
        with torch.no_grad():
            return model(ids, use_cache=False, logits_to_keep=1).logits

    for _ in range(3):
        prefill()
    if args.direct:
        return direct(model)
    if args.floor:
        return floor(name, model, prefill)
    if args.host:
        print(f"{name} eager prefill wall {walls(prefill)}; host time per call by function (cProfile, 5 synchronised calls;"
              " [function, calls, own ms, cumulative ms]):", flush=True)
        for row in ml.host_profile(prefill, 5, top=40, synced=True):
            print("  ", row, flush=True)
        return
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
    ap.add_argument("--variants", default="bf16,ours", help="which of bf16,ours to run")
    ap.add_argument("--host", action="store_true", help="only the wall time and a cProfile of 5 synchronised calls")
    ap.add_argument("--floor", action="store_true", help="only the wall against the GPU's floor (see floor())")
    ap.add_argument("--direct", action="store_true", help="ours only: A/B of the direct prefill path (see direct())")
    args = ap.parse_args()
    work = Path(f"/tmp/tl{args.layers}")
    src, art = work / "src", work / "art"
    if not (src / "config.json").exists():
        ml.build_checkpoint(ml.config_for("llama", args.layers), src, torch.device("cuda"))
        ml.quantize(src, art)
    print("torch", torch.__version__, "transformers", transformers.__version__, "layers", args.layers, flush=True)
    variants = ["ours"] if args.direct else args.variants.split(",")
    if "bf16" in variants:
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, device_map="cuda")
        run("bf16", model, args)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if "ours" not in variants:
        return
    model = load(art, device="cuda")
    print("ours", model.mpsconvert.seconds, model.mpsconvert.eager_fusion, model.mpsconvert.positions, flush=True)
    run("ours", model, args)


if __name__ == "__main__":
    main()
