"""Host cost of the direct prefill layer's own Python on CPU: Triton launches stubbed (no-ops),
_scaled_mm real but tiny (hidden 64). Per layer and per function (cProfile)."""
import sys, time, cProfile, pstats, io
import torch; torch.set_num_threads(1)
sys.path.insert(0, ".")
from tests.test_graph_fusion import _fp8_model
from mpsconvert.runtime.ops.triton import act_quant, rotary as trot
calls = {"n": 0}
def nolaunch(kernel, grid, args, **options):
    calls["n"] += 1
L = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--layers=")), 8))
import tests.models as tm
orig = tm.tiny_model
tm.tiny_model = lambda arch, **kw: orig(arch, layers=L, **kw)
model = _fp8_model("llama")
act_quant.launch = nolaunch
trot.launch = nolaunch
if "--stub-mm" in sys.argv:
    torch._scaled_mm = lambda a, b, scale_a=None, scale_b=None, out_dtype=None, use_fast_accum=False: torch.empty(a.shape[0], b.shape[1], dtype=out_dtype)
if "--stub-sdpa" in sys.argv:
    import torch.nn.functional as F
    F.scaled_dot_product_attention = lambda q, k, v, **kw: torch.empty_like(q)
if "--fast-takes" in sys.argv:
    from mpsconvert.runtime.patches import attention_prefill as ap
    _t = ap.takes
    memo = {}
    def takes(p, x, kw):
        pe = kw.get("position_embeddings"); c = kw.get("past_key_values")
        return (pe[0], pe[1], c)
    ap.takes = takes
layer = model.model.layers[0]
print("plan:", layer.mpsconvert_attention is not None)
ids = torch.arange(1, 1 + 64)[None] % 200
with torch.no_grad():
    for _ in range(3):
        model(ids, logits_to_keep=1)
    plan = layer.mpsconvert_attention
    c0 = plan.calls
    n = 50
    calls["n"] = 0
    best = []
    for rep in range(5):
        t = time.process_time()
        for _ in range(n):
            model(ids, logits_to_keep=1)
        best.append((time.process_time() - t) / n)
    calls["n"] //= 5
    dt = min(best)
    print(f"direct calls {plan.calls - c0}, launches/prefill {calls['n'] / n}, {dt * 1e6:.0f} us per prefill, {dt * 1e6 / L:.0f} us per layer")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        model(ids, logits_to_keep=1)
    pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45)
print(s.getvalue()[:9000])
if "--cum" in sys.argv:
    pstats.Stats(pr).sort_stats("cumulative").print_stats("mpsconvert|functional|cache_utils", 40)
