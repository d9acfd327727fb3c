"""MoE layer stack: BF16 (transformers' loop and grouped_mm) vs FP8 (our grouped and a per-expert loop).

A Mixtral-shaped stack of sparse-MoE blocks (router + experts, residual; no attention:
experts are where MoE weights and time are), random weights, hidden 4096, intermediate
14336, 8 experts, top-2, `--layers` of them (default 2). Measured in one run, so every
ratio is against a baseline from the same process:

  bf16_loop     transformers MixtralExperts, eager (per-expert Python loop)
  bf16_grouped  transformers MixtralExperts, experts_implementation="grouped_mm"
  fp8_grouped   mpsconvert FP8Experts: torch._scaled_grouped_mm (prefill), and at batch 1 the
                Triton FP8-weight GEMV (decode), per-token dynamic activations (fp8-dynamic)
  fp8_grouped_nogemv  the same with the GEMV off (scaled_grouped_mm at batch 1 too)
  fp8_loop      per-expert loop of torch._scaled_mm (row-wise), same FP8 weights

Prefill: `--tokens` tokens (default 2048); decode: 1 token. Eager timings, plus CUDA-graph
timings for the graph-capturable (sync-free) variants. `--tiny` runs small shapes on CPU to
check the script (CPU numbers say nothing about speed).

    python benchmarks/moe.py [--tiny] [--layers 2] [--tokens 2048] [--out results.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mpsconvert.format import fp8  # noqa: E402
from mpsconvert.runtime.ops.fp8_experts import FP8Experts, quantize_rows  # noqa: E402


def build_stack(hidden, inter, experts, top_k, layers, device, seed=0):
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = transformers.MixtralConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        router_jitter_noise=0.0,
    )
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        with torch.device("meta"):
            b = MixtralSparseMoeBlock(cfg)
        b = b.to_empty(device=device).to(torch.bfloat16).eval()
        with torch.no_grad():
            for p in b.parameters():
                p.normal_(0, 0.02)
        blocks.append(b)
    return cfg, blocks


def fp8_block(block, device):
    """The same block with FP8Experts holding the block's own weights quantized per row."""
    new = copy.copy(block)
    new._modules = dict(block._modules)
    ex = block.experts

    def q(w):
        codes, scales = zip(*[fp8.quantize(w[e], "row")[:2] for e in range(w.shape[0])])
        return torch.stack(codes), torch.stack(scales)

    with torch.no_grad():
        c13, s13 = q(ex.gate_up_proj.data)
        c2, s2 = q(ex.down_proj.data)
    new._modules["experts"] = FP8Experts(c13, s13, c2, s2, ex.act_fn, "token", dtype=torch.bfloat16)
    return new


class FP8LoopExperts(torch.nn.Module):
    """Per-expert loop of row-wise `torch._scaled_mm` on the FP8Experts' weights."""

    def __init__(self, mod: FP8Experts):
        super().__init__()
        self.m = mod

    def forward(self, x, idx, w):
        m = self.m
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            h = _smm(x[tok], m.gate_up_codes[e], m.gate_up_scale[e])
            g, u = h.chunk(2, dim=-1)
            y = _smm(m.act_fn(g) * u, m.down_codes[e], m.down_scale[e])
            out.index_add_(0, tok, (y * w[tok, slot, None]).to(out.dtype))
        return out


def _smm(x, codes, row_scale):
    if x.device.type != "cuda":  # CPU check run: same numerics, dequantized
        return (fp8.fake_quantize(x, fp8.per_token_scale(x)).float() @ (codes.float() * row_scale[:, None]).T).to(
            x.dtype
        )
    q, s = quantize_rows(x, None)
    return torch._scaled_mm(q, codes.T, scale_a=s[:, None], scale_b=row_scale[None, :], out_dtype=torch.bfloat16)


def stack_fn(blocks):
    def run(x):  # x: [1, tokens, hidden], as the decoder layer passes it
        for b in blocks:
            x = x + b(x)
        return x

    return run


def timeit(fn, x, device, iters, warmup=3):
    for _ in range(warmup):
        fn(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(x)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return statistics.median(times)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def graph_time(fn, x, device, iters):
    """Median microseconds of a CUDA-graph replay of fn(x) (None + reason if it cannot be captured)."""
    if device.type != "cuda":
        return None, "cpu"
    try:
        static_x = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn(static_x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(static_x)
        return timeit(lambda _: g.replay(), static_x, device, iters), None
    except Exception as e:  # reported in the results, never hidden
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def kernel_only(mod: FP8Experts, bf16_experts, S: int, device, iters: int) -> dict:
    """The grouped matmuls alone (gate_up and down, S rows split evenly over the experts):
    separates the kernels from routing, activation quantization and gathers."""
    from mpsconvert.runtime.ops.fp8_experts import grouped_mm_fn

    E = mod.num_experts
    offs = torch.linspace(S // E, S, E, device=device).round().to(torch.int32)
    out = {}
    with torch.no_grad():
        for which, w16 in (("gate_up", bf16_experts.gate_up_proj), ("down", bf16_experts.down_proj)):
            K = w16.shape[2]
            x = torch.randn(S, K, device=device).to(torch.bfloat16)
            q, sa = quantize_rows(x, None)
            codes, sb = getattr(mod, f"{which}_codes"), getattr(mod, f"{which}_scale")
            t16 = timeit(lambda _: grouped_mm_fn()(x, w16.transpose(-2, -1), offs=offs), x, device, iters)
            t8 = timeit(
                lambda _: torch._scaled_grouped_mm(
                    q, codes.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
                ),
                x,
                device,
                iters,
            )
            tq = timeit(lambda _: quantize_rows(x, None), x, device, iters)
            out[which] = {
                "bf16_grouped_mm": round(t16, 1),
                "fp8_scaled_grouped_mm": round(t8, 1),
                "act_quant": round(tq, 1),
                "speedup": round(t16 / t8, 3),
            }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small shapes on CPU: checks the script, not speed")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.tiny:
        device, H, I, E, k, T = torch.device("cpu"), 64, 96, 8, 2, 64
    else:
        device, H, I, E, k, T = torch.device("cuda"), 4096, 14336, 8, 2, args.tokens
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg, blocks = build_stack(H, I, E, k, args.layers, device)
    f8 = [fp8_block(b, device) for b in blocks]
    paths = f8[0].experts.paths

    def with_impl(impl):
        out = []
        for b in blocks:
            c = copy.copy(b)
            c._modules = dict(b._modules)
            ex = copy.copy(b.experts)
            ex.config = copy.copy(b.experts.config)
            ex.config._experts_implementation = impl
            c._modules["experts"] = ex
            out.append(c)
        return out

    def f8_variant(gemv: bool, loop: bool = False):
        out = []
        for b in f8:
            c = copy.copy(b)
            c._modules = dict(b._modules)
            ex = copy.copy(b.experts)
            if not gemv:
                ex.decode_path = None
            c._modules["experts"] = FP8LoopExperts(ex) if loop else ex
            out.append(c)
        return out

    variants = {
        "bf16_loop": (with_impl("eager"), False),
        "bf16_grouped": (with_impl("grouped_mm"), True),
        "fp8_grouped": (f8_variant(True), True),
        "fp8_grouped_nogemv": (f8_variant(False), True),
        "fp8_loop": (f8_variant(False, loop=True), False),
    }
    bytes_bf16 = sum(p.numel() * p.element_size() for b in blocks for p in b.experts.parameters())
    bytes_fp8 = sum(
        b.numel() * b.element_size() for blk in f8 for n, b in blk.experts.named_buffers() if not n.endswith("_dense")
    )
    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"hidden": H, "intermediate": I, "experts": E, "top_k": k, "layers": args.layers, "prefill_tokens": T},
        "fp8_paths": paths,
        "expert_weight_bytes": {"bf16": bytes_bf16, "fp8": bytes_fp8},
        "timings_us": {},
        "graph_errors": {},
        "rel_error_vs_bf16": {},  # ||y - y_bf16_loop|| / ||y_bf16_loop||, first block's output
    }
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = {
        "prefill": torch.randn(1, T, H, device=device, generator=gen).to(torch.bfloat16),
        "decode": torch.randn(1, 1, H, device=device, generator=gen).to(torch.bfloat16),
    }
    with torch.no_grad():
        for phase, x in inputs.items():
            ref = variants["bf16_loop"][0][0](x).float()  # first block's MoE output, same input for all
            for name, (bl, graphable) in variants.items():
                fn = stack_fn(bl)
                try:
                    y = bl[0](x).float()
                    fn(x)
                except Exception as e:  # a path this build/device cannot run: recorded, the rest still runs
                    results["timings_us"][f"{phase}/{name}/eager"] = None
                    results["graph_errors"][f"{phase}/{name}"] = f"eager failed: {type(e).__name__}: {str(e)[:200]}"
                    print(phase, name, "FAILED", e, flush=True)
                    continue
                results["rel_error_vs_bf16"][f"{phase}/{name}"] = round(float((y - ref).norm() / ref.norm()), 5)
                iters = max(3, args.iters // (4 if phase == "prefill" and "loop" in name else 1))
                results["timings_us"][f"{phase}/{name}/eager"] = round(timeit(fn, x, device, iters), 1)
                if graphable:
                    t, err = graph_time(fn, x, device, args.iters)
                    if t is not None:
                        results["timings_us"][f"{phase}/{name}/graph"] = round(t, 1)
                    elif err != "cpu":
                        results["graph_errors"][f"{phase}/{name}"] = err
                print(
                    f"{phase:8s} {name:20s} "
                    + "  ".join(
                        f"{m}={results['timings_us'].get(f'{phase}/{name}/{m}', '-')}" for m in ("eager", "graph")
                    ),
                    flush=True,
                )
    if device.type == "cuda":
        try:
            results["kernel_only_us"] = kernel_only(f8[0].experts, blocks[0].experts, T * k, device, args.iters)
        except Exception as e:  # recorded; the stack results above still stand
            results["kernel_only_us"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    ratios = {}
    tm = results["timings_us"]
    pairs = [(n, b) for n in ("fp8_grouped", "fp8_grouped_nogemv", "fp8_loop") for b in ("bf16_grouped", "bf16_loop")]
    pairs += [("fp8_grouped", "fp8_loop"), ("bf16_grouped", "bf16_loop")]
    for phase in inputs:
        for mode in ("eager", "graph"):
            for name, base in pairs:
                t = tm.get(f"{phase}/{name}/{mode}")
                b = tm.get(f"{phase}/{base}/{mode}") or tm.get(f"{phase}/{base}/eager")  # loops have no graph
                if t and b:
                    ratios[f"{phase}/{mode}: {name} vs {base}"] = round(b / t, 3)  # >1: faster than the baseline
    results["speedup"] = ratios
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
