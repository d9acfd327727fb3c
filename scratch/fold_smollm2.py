"""SmolLM2-135M's real weights (FP8 per row, the GEMV at decode, the patches as on CUDA; Triton
interpreter on CPU): greedy tokens of the compiled decode step with the graph pass against the
eager engine's, on a real prompt."""
import sys, time, warnings
import torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import _sources
import torch._inductor.config as config
from transformers import AutoModelForCausalLM, AutoTokenizer
from tests.models import fp8_layers
from mpsconvert.runtime import engine, patches

src = _sources.smollm2()
tok = AutoTokenizer.from_pretrained(src)
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval().requires_grad_(False)
keep = int(sys.argv[2]) if len(sys.argv) > 2 else 6  # the first layers only (real weights; the interpreter is slow)
model.model.layers = model.model.layers[:keep]
model.config.num_hidden_layers = keep
model.config.layer_types = model.config.layer_types[:keep] if getattr(model.config, "layer_types", None) else None
model = fp8_layers(model, decode="gemv")
model.config._attn_implementation = "sdpa"
ctx = patches.Context(torch.device("cuda"), torch.bfloat16)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    patches.apply(model, ctx, "modules")
    for g in model.modules():
        if type(g).__name__ == "SharedInput":
            g.inner.set_kernels("gemv", "scaled_mm_row")
    patches.apply(model, ctx, "forwards")
text = open("../shared/data/wiki_eval.jsonl").readline()
import json
text = json.loads(text)["text"][:400]
prompt = tok(text)["input_ids"][:16]
n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
t = time.time()
want = engine.generate_ids(engine.Engine(model, compile=False), prompt, engine.Sampling(max_tokens=n)).tokens
print("eager", want, f"{time.time() - t:.0f}s", flush=True)
t = time.time()
eng = engine.Engine(model, compile=True)
with config.patch(force_disable_caches=True):
    got = engine.generate_ids(eng, prompt, engine.Sampling(max_tokens=n)).tokens
print("compiled", got, eng.graph_fusion, eng.writes_at, f"{time.time() - t:.0f}s", flush=True)
print("same tokens:", got == want, "| prompt:", repr(tok.decode(prompt)[-80:]), "| eager:", repr(tok.decode(want)), "| compiled:", repr(tok.decode(got)))
