"""Real weights and real activations (SmolLM2-135M-Instruct, a wiki paragraph, 6 tokens, layers 0, 1, 10, 20, 29): for every
layer, the q/k/v GEMV and the gated gate/up GEMV with the RMSNorm folded in (norm=) against the
plain GEMV of the module's own norm output, each against the float64 product of the same FP8 weights
(the Triton interpreter on CPU: the kernel's arithmetic)."""
import sys, json, time
sys.path.insert(0, "benchmarks")
import torch
import _sources
from transformers import AutoModelForCausalLM, AutoTokenizer
from mpsconvert import fp8
from mpsconvert.fp8 import relative_error
from mpsconvert.runtime.ops.triton import gemv as G

src = _sources.smollm2()
tok = AutoTokenizer.from_pretrained(str(src))
m = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).eval().requires_grad_(False)
text = json.loads(open("../shared/data/wiki_eval.jsonl").readline())["text"]
ids = torch.tensor([tok(text)["input_ids"][:6]])
seen = {}
hooks = [l.input_layernorm.register_forward_pre_hook(lambda mod, a, i=i: seen.__setitem__((i, "in"), a[0][0].clone())) for i, l in enumerate(m.model.layers)]
hooks += [l.post_attention_layernorm.register_forward_pre_hook(lambda mod, a, i=i: seen.__setitem__((i, "post"), a[0][0].clone())) for i, l in enumerate(m.model.layers)]
with torch.no_grad():
    m(ids)
rows = []
t = time.time()
for i, layer in [(j, m.model.layers[j]) for j in (0, 1, 10, 20, 29)]:
    a, mlp = layer.self_attn, layer.mlp
    for kind, norm, ws, gated in (("qkv", layer.input_layernorm, [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], False),
                                  ("gate/up", layer.post_attention_layernorm, [mlp.gate_proj.weight, mlp.up_proj.weight], True)):
        x = seen[(i, "in" if kind == "qkv" else "post")]
        w = torch.cat(ws).float()
        q, s, _ = fp8.quantize(w, "row")
        s = s.reshape(-1)
        eps = norm.variance_epsilon
        fused = G.gemv(x, q, s, None, gated=gated, norm=norm.weight, eps=eps).double()
        plain = G.gemv(norm(x), q, s, None, gated=gated).double()
        h = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps) * norm.weight.double()
        exact = h @ (q.double() * s.double()[:, None]).T
        if gated:
            n = exact.shape[1] // 2
            exact = torch.nn.functional.silu(exact[:, :n]) * exact[:, n:]
        rows.append((i, kind, relative_error(fused, exact), relative_error(plain, exact), relative_error(fused, plain), float(x.abs().max())))
print(f"{time.time() - t:.0f} s; layer kind | fused vs exact | module path vs exact | fused vs module path | max |x|")
for r in rows:
    print(f"{r[0]:2d} {r[1]:8s} {r[2]:.2e} {r[3]:.2e} {r[4]:.2e} {r[5]:.1f}")
import statistics as st
for kind in ("qkv", "gate/up"):
    f = [r[2] for r in rows if r[1] == kind]; p = [r[3] for r in rows if r[1] == kind]; d = [r[4] for r in rows if r[1] == kind]
    print(f"{kind}: fused vs exact median {st.median(f):.2e} max {max(f):.2e}; module path vs exact median {st.median(p):.2e} max {max(p):.2e}; "
          f"fused vs module median {st.median(d):.2e} max {max(d):.2e}; fused closer in {sum(a <= b for a, b in zip(f, p))} of {len(f)} layers")
