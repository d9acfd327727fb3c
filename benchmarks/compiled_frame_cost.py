"""Host time a compiled decode step spends outside its graph, BF16 against our FP8 layers (CPU).

Why: under `validate`'s routine a decode step's time is its host time plus its GPU time, and
on the H200 our compiled step took 1.4 ms more host time than BF16's (benchmarks/decode_host.py).
That time is dynamo's: the guards it still evaluates in the warm stance, the graph inputs it
gathers, the side effects it replays. It does not depend on the device, so it is measured here
on CPU, on a Llama of the real depth with tiny widths, by a backend whose "graph" returns the
outputs of its first run: what is left per call is the frame's own cost.

    python benchmarks/compiled_frame_cost.py [--layers 32]

Variants: bf16 (the model as built), shared (FP8 layers with q/k/v and gate/up sharing one
GEMM, runtime/fuse.py), all (that and the eager forwards, runtime/eager_fusion.py). Prints the
median per call over 200 calls and the ratio to bf16, measured in this run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # eager_fusion installs on CPU tensors through the interpreter
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402


def build(variant: str, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from mpsconvert import fp8
    from mpsconvert.runtime import eager_fusion, fuse
    from mpsconvert.runtime.fp8linear import FP8Linear

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)  # fmt: skip
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    if variant == "bf16":
        return model
    for name, lin in list(model.model.layers.named_modules()):
        if isinstance(lin, nn.Linear):
            q, s, _ = fp8.quantize(lin.weight.float(), "row")
            new = FP8Linear.from_tensors(q, s, activations="token")
            new.set_kernels("scaled_mm_row", "scaled_mm_row")
            parent, _, leaf = name.rpartition(".")
            setattr(model.model.layers.get_submodule(parent), leaf, new)
    for g in fuse.share_inputs(model):
        g.inner.set_kernels("scaled_mm_row", "scaled_mm_row")
    if variant == "all":
        eager_fusion.install(model)
    return model


def frame_cost_us(variant: str, layers: int, calls: int = 200) -> float:
    from transformers import StaticCache

    from mpsconvert.timing import warm_guards

    model = build(variant, layers)
    cache = StaticCache(config=model.config, max_cache_len=64)
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long), past_key_values=cache, use_cache=True, cache_position=torch.arange(8))

    def backend(gm, inputs):  # the graph, run once; later calls return its outputs
        out = gm(*inputs)
        return lambda *a: out

    torch._dynamo.reset()
    step = torch.compile(model.forward, backend=backend)
    tok, pos = torch.zeros(1, 1, dtype=torch.long), torch.tensor([9])

    def one():
        with torch.no_grad():
            step(tok, past_key_values=cache, use_cache=True, cache_position=pos)

    for _ in range(3):
        one()
    times = []
    with warm_guards(True):
        for _ in range(calls):
            t = time.perf_counter()
            one()
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args(argv)
    base = None
    for variant in ("bf16", "shared", "all"):
        us = frame_cost_us(variant, args.layers)
        base = base or us
        print(f"{variant:7s} {args.layers} layers: {us:8.1f} us per compiled call outside the graph   x{us / base:5.2f} of bf16", flush=True)


if __name__ == "__main__":
    main()
