"""FP8 runtime vs BF16 vs torchao float8 on a Llama-3-8B-shaped linear stack (CUDA; the H200).

Each layer is what a Llama-3-8B decoder layer does with its Linears (hidden 4096, 32 q heads and
8 kv heads of 128, intermediate 14336): q 4096x4096, k/v 1024x4096, o 4096x4096, gate/up
14336x4096, down 4096x14336, random weights (std 1/sqrt(K)), with the cheap glue between them
(a GQA-style stand-in for attention, SiLU-gated MLP, residuals). `--layers` of them (default 2,
fewer than the real 32: each torch.compile of a big stack costs minutes; ratios are per layer).

Variants, all torch.compile'd and run under a CUDA graph (the way users run decode):
  bf16          separate q/k/v/gate/up Linears, as transformers runs a model (the baseline)
  bf16-fused    q/k/v and gate/up fused into one GEMM each (reference: fusion alone)
  fp8-row       ours: row-wise FP8 weights, dynamic per-token activations, q/k/v and gate/up
                fused, kernels chosen by mpsconvert's policy (measured here)
  fp8-tensor    ours: per-tensor FP8 weights, static per-tensor activation scale (calibrated on
                a random batch), same fusion and policy
  torchao-row / torchao-tensor   torchao float8 dynamic activations, PerRow / PerTensor

Prefill: --prefill tokens (default 2048) in one call. Decode: one token (batch 1).
Weight memory: CUDA bytes allocated by each variant's weights. All ratios come from one run.

  python benchmarks/runtime.py [--layers 2] [--prefill 2048] [--json out.json] [--check]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

from mpsconvert.format import fp8
from mpsconvert.infra.timing import per_call_us
from mpsconvert.runtime.load.policy import KernelPolicy
from mpsconvert.runtime.ops import triton as tritonlib
from mpsconvert.runtime.ops.fp8linear import FP8Linear
from mpsconvert.runtime.ops.fuse import FusedFP8
from mpsconvert.runtime.ops.triton import gemv as triton_gemv

SHAPES = {
    "q": (4096, 4096),
    "k": (1024, 4096),
    "v": (1024, 4096),
    "o": (4096, 4096),
    "gate": (14336, 4096),
    "up": (14336, 4096),
    "down": (4096, 14336),
}
DEV = torch.device("cuda")


def log(*a):
    print(*a, flush=True)


class Layer(nn.Module):
    """A decoder layer's Linears and glue; `proj` maps names to modules (Linear or FP8)."""

    def __init__(self, proj: dict[str, nn.Module], fused: dict[str, nn.Module] | None = None):
        super().__init__()
        self.proj = nn.ModuleDict(proj)
        self.fused = nn.ModuleDict(fused or {})

    def forward(self, x):
        if "qkv" in self.fused:
            q, k, v = self.fused["qkv"](x)
        else:
            q, k, v = self.proj["q"](x), self.proj["k"](x), self.proj["v"](x)
        a = q * torch.sigmoid((k + v).repeat(1, 4))  # attention stand-in: uses q, k and v
        x = x + self.proj["o"](a)
        if "gate_up" in self.fused:
            g, u = self.fused["gate_up"](x)
        else:
            g, u = self.proj["gate"](x), self.proj["up"](x)
        return x + self.proj["down"](F.silu(g) * u)


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def master_weights(n_layers: int, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [
        {
            n: (torch.randn(s, generator=g, device=DEV, dtype=torch.float32) / math.sqrt(s[1])).to(torch.bfloat16)
            for n, s in SHAPES.items()
        }
        for _ in range(n_layers)
    ]


def linear(w):
    m = nn.Linear(w.shape[1], w.shape[0], bias=False, device=DEV, dtype=torch.bfloat16)
    m.weight.data.copy_(w)
    return m.requires_grad_(False)


def build_bf16(master, fused: bool):
    layers = []
    for ws in master:
        if not fused:
            layers.append(Layer({n: linear(w) for n, w in ws.items()}))
            continue
        qkv, gu = linear(torch.cat([ws["q"], ws["k"], ws["v"]])), linear(torch.cat([ws["gate"], ws["up"]]))
        sizes = {"qkv": [4096, 1024, 1024], "gate_up": [14336, 14336]}

        class Split(nn.Module):
            def __init__(self, lin, s):
                super().__init__()
                self.lin, self.s = lin, s

            def forward(self, x):
                return self.lin(x).split(self.s, dim=-1)

        layers.append(
            Layer(
                {"o": linear(ws["o"]), "down": linear(ws["down"])},
                {"qkv": Split(qkv, sizes["qkv"]), "gate_up": Split(gu, sizes["gate_up"])},
            )
        )
    return Stack(layers).eval()


def calibrate_input_scales(master, x):
    """Static per-tensor scales: amax of each Linear's input on a random batch / 448 (through BF16)."""
    scales = []
    ref = build_bf16(master, fused=False)
    with torch.no_grad():
        for layer in ref.layers:
            seen = {}
            hooks = [
                m.register_forward_pre_hook(lambda mod, inp, n=n: seen.__setitem__(n, float(inp[0].abs().amax())))
                for n, m in layer.proj.items()
            ]
            x = layer(x)
            for h in hooks:
                h.remove()
            scales.append({n: a / fp8.FP8_MAX for n, a in seen.items()})
    del ref
    return scales


def build_fp8(master, granularity: str, activations: str, input_scales=None):
    layers = []
    for i, ws in enumerate(master):
        mods = {}
        for n, w in ws.items():
            q, s, _ = fp8.quantize(w, granularity, name=n)
            isc = torch.tensor([input_scales[i][n]], device=DEV) if activations == "tensor" else None
            mods[n] = FP8Linear.from_tensors(q, s, activations=activations, input_scale=isc)
        if activations == "tensor":  # q/k/v (and gate/up) read one input: one calibrated scale
            for group in (("q", "k", "v"), ("gate", "up")):
                shared = max(float(mods[n].input_scale) for n in group)
                for n in group:
                    mods[n].input_scale.fill_(shared)
        fused = {
            "qkv": FusedFP8([mods.pop("q"), mods.pop("k"), mods.pop("v")]),
            "gate_up": FusedFP8([mods.pop("gate"), mods.pop("up")]),
        }
        layers.append(Layer(mods, fused))
    return Stack(layers).eval()


def build_torchao(master, granularity: str):
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

    model = build_bf16(master, fused=False)
    quantize_(
        model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow() if granularity == "row" else PerTensor())
    )
    return model


def run_variant(name, build, xs, ref_out, results, policy_out):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    model = build()
    torch.cuda.synchronize()
    weight_bytes = torch.cuda.memory_allocated() - before
    row = {"weight_bytes": weight_bytes, "build_s": round(time.perf_counter() - t0, 1)}
    if any(isinstance(m, FP8Linear) for m in model.modules()):
        pol = KernelPolicy(DEV, decode_m=1, cache=False)  # every prefill bucket measured, the prompt's own among them
        pol.apply(model)
        policy_out[name] = pol.explain()
        for d in pol.decisions:
            log(
                f"   policy {name}: {d.shape[0]}x{d.shape[1]} {d.bucket:7s} M={d.m:<5d} -> {d.choice:16s} "
                f"{d.timings_us}"
            )
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        for bucket, x in xs.items():
            t0 = time.perf_counter()
            y = compiled(x)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            err = ((y.float() - ref_out[bucket].float()).norm() / ref_out[bucket].float().norm()).item()
            us = per_call_us(lambda: compiled(x), DEV, reps=10 if bucket == "prefill" else 50, rounds=7)
            row[bucket] = {"us": round(us, 2), "rel_err_vs_bf16_eager": round(err, 5), "compile_s": round(compile_s, 1)}
            log(f"   {name:15s} {bucket:7s} {us:10.1f} us   rel.err {err:.4f}   (compile {compile_s:.0f}s)")
    results[name] = row
    model = compiled = None  # freed (a closure above holds the name)
    torch._dynamo.reset()


def check_gemv():
    """Correctness of the Triton FP8 GEMV against a float64 reference, several shapes and M."""
    out = []
    for (n, k), m, gran, bias in [
        ((4096, 4096), 1, "row", False),
        ((6144, 4096), 1, "tensor", True),
        ((4096, 14336), 1, "row", False),
        ((1000, 4000), 3, "row", True),
        ((28672, 4096), 2, "row", False),
    ]:
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / math.sqrt(k)
        q, s, _ = fp8.quantize(w, gran)
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        b = torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None
        y = triton_gemv.fp8_gemv(x, q, s, b).double()
        ref = x.double() @ (q.double() * s.double().reshape(-1, 1)).T + (b.double() if bias else 0)
        rel = ((y - ref).norm() / ref.norm()).item()
        out.append({"shape": [n, k], "m": m, "weights": gran, "bias": bias, "rel_err": rel})
        log(f"   gemv {n}x{k} M={m} {gran} bias={bias}: rel.err vs float64 {rel:.2e}")
        assert rel < 1e-2, rel
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--variants", default="bf16,bf16-fused,fp8-row,fp8-tensor,torchao-row,torchao-tensor")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--check", action="store_true", help="only check the GEMV kernel and time the policy's candidates")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/runtime.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    info = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": tritonlib.version(),
        "layers": args.layers,
        "prefill_tokens": args.prefill,
    }
    log("env:", info)
    report = {"info": info, "gemv_check": check_gemv()}
    if args.check:
        if args.json:
            open(args.json, "w").write(json.dumps(report, indent=1))
        return
    master = master_weights(args.layers)
    xs = {
        "prefill": torch.randn(args.prefill, 4096, device=DEV, dtype=torch.bfloat16),
        "decode": torch.randn(1, 4096, device=DEV, dtype=torch.bfloat16),
    }
    with torch.no_grad():
        ref = build_bf16(master, fused=False)
        ref_out = {b: ref(x) for b, x in xs.items()}
        del ref
    iscales = calibrate_input_scales(master, xs["prefill"])
    builders = {
        "bf16": lambda: build_bf16(master, fused=False),
        "bf16-fused": lambda: build_bf16(master, fused=True),
        "fp8-row": lambda: build_fp8(master, "row", "token"),
        "fp8-tensor": lambda: build_fp8(master, "tensor", "tensor", iscales),
        "torchao-row": lambda: build_torchao(master, "row"),
        "torchao-tensor": lambda: build_torchao(master, "tensor"),
    }
    results, policy = {}, {}
    for name in args.variants.split(","):
        log(f"== {name}")
        try:
            run_variant(name, builders[name], xs, ref_out, results, policy)
        except Exception as e:  # one broken variant must not hide the others' numbers; it is printed
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    base = results.get("bf16", {})
    log(
        f"\nH200 linear stack, {args.layers} Llama-3-8B-shaped layers, prefill {args.prefill} tokens, decode batch 1, "
        f"torch.compile + CUDA graph; ratio = BF16 time / variant time (higher is faster)"
    )
    log(
        f"{'variant':15s} {'prefill us':>11s} {'x bf16':>7s} {'decode us':>10s} {'x bf16':>7s} {'weights MiB':>12s} "
        f"{'x bf16':>7s}"
    )
    for name, r in results.items():
        if "error" in r:
            log(f"{name:15s} ERROR {r['error'][:100]}")
            continue
        cells = []
        for b in ("prefill", "decode"):
            ratio = base[b]["us"] / r[b]["us"] if "prefill" in base else float("nan")
            r[b]["speedup_vs_bf16"] = round(ratio, 3)
            cells += [f"{r[b]['us']:11.1f}", f"{ratio:7.2f}"]
        mem = r["weight_bytes"] / base["weight_bytes"] if "weight_bytes" in base else float("nan")
        r["weight_ratio_vs_bf16"] = round(mem, 4)
        log(f"{name:15s} {cells[0]} {cells[1]} {cells[2]:>10s} {cells[3]} {r['weight_bytes'] / 2**20:12.1f} {mem:7.3f}")
    report |= {"results": results, "policy": policy}
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
