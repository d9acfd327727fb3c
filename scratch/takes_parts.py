import sys, timeit
import torch; torch.set_num_threads(1)
sys.path.insert(0, ".")
from tests.test_graph_fusion import _fp8_model
from mpsconvert.runtime.patches import attention_prefill as ap
from mpsconvert.runtime import hf_compat
from mpsconvert.runtime.ops import kernels
from transformers import DynamicCache
model = _fp8_model("llama")
layer = model.model.layers[0]
p = layer.mpsconvert_attention
seen = {}
orig = ap.takes
def spy(pl, x, kw):
    seen.setdefault("a", (pl, x, dict(kw)))
    return orig(pl, x, kw)
ap.takes = spy
with torch.no_grad():
    model(torch.arange(1, 65)[None] % 200, logits_to_keep=1)
pl, x, kw = seen["a"]
b, s, _ = x.shape
cache = kw.get("past_key_values")
attn = pl.attn
tests = {
 "whole takes": lambda: orig(pl, x, kw),
 "kwargs keys": lambda: kw.keys() <= ap.KWARGS,
 "group dtype": lambda: x.dtype != pl.group.inner.dtype,
 "quantizes": lambda: all(g.quantizes(b * s) for g in pl.groups),
 "cos checks": lambda: (kw["position_embeddings"][0].ndim, kw["position_embeddings"][0].shape[1], kw["position_embeddings"][0].dtype),
 "cache seq len": lambda: DynamicCache(config=attn.config).get_seq_length(pl.layer_idx) if cache is None else cache.get_seq_length(pl.layer_idx),
 "training": lambda: attn.training,
 "attn_impl": lambda: hf_compat.attn_implementation(attn.config),
 "hooked": lambda: ap._hooked(pl.skipped),
 "prefill_fn": lambda: any(m.prefill_fn(b * s) not in kernels.QUANTIZING for m in pl.layers),
 "frozen": lambda: any(w.requires_grad for w in pl.frozen),
}
for k, f in tests.items():
    n = 20000
    t = min(timeit.repeat(f, number=n, repeat=5)) / n
    print(f"{k:15s} {t * 1e6:6.2f} us")
print(type(cache).__name__)
