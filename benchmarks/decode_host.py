"""Host time of one compiled decode step, BF16 against ours, each in a state a user can be in.

A step's time under `validate`'s routine (synchronised per token) is its host time plus its GPU
time, so host time that BF16 does not pay caps our decode ratio. This times the step (40 steps,
median; `torch.compile(mode="reduce-overhead")`, static cache, warm guards) in one fresh process
with no profiler run before (the CUDA profiler raised later host times in model_latency.py), for:

  ours     `runtime.load` as it comes (eager fusion installed)
  bf16     transformers `from_pretrained`
  ours-after-prefill-compile   ours after per-layer compiled prefills (model_latency's order)
  ours-bare  ours with the installed eager forwards removed (what they cost under compile)

and prints each step's host and wall time and the functions with the most own host time.

    python benchmarks/decode_host.py [LAYERS]    (Llama-3-8B shape; checkpoint kept in /tmp)
"""
import cProfile, gc, itertools, os, pstats, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent)); sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import model_latency as ml  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import StaticCache  # noqa: E402

from mpsconvert.runtime import forwards, load  # noqa: E402
from mpsconvert.timing import warm_guards  # noqa: E402
L = int(sys.argv[1]) if len(sys.argv) > 1 else 8
work = Path(f"/tmp/mpsconvert-decode-host-{L}"); src, art = work / "src", work / "art"
if not (src / "config.json").exists():
    ml.build_checkpoint(ml.config_for("llama", L), src, torch.device("cuda"))
    ml.quantize(src, art)
dev = torch.device("cuda")
def decode(model, name):
    cache = StaticCache(config=model.config, max_cache_len=2048 + 200)
    ids = torch.randint(0, 1000, (1, 2048), device=dev)
    pos = itertools.count(2048)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(2048, device=dev), logits_to_keep=1)
    step = torch.compile(model.forward, mode="reduce-overhead")
    st = {"tok": ids[:, -1:].clone()}
    def one():
        p = torch.tensor([next(pos)], device=dev)
        with torch.no_grad():
            out = step(st["tok"], past_key_values=cache, use_cache=True, cache_position=p).logits
            st["tok"] = out[:, -1:].argmax(-1).clone()
    for _ in range(3): one()
    torch.cuda.synchronize()
    host, wall = [], []
    with warm_guards(True):
        for _ in range(40):
            torch.cuda.synchronize(); t = time.perf_counter(); one(); host.append(time.perf_counter() - t); torch.cuda.synchronize(); wall.append(time.perf_counter() - t)
        pr = cProfile.Profile(); pr.enable()
        for _ in range(8):
            torch.cuda.synchronize(); one()
        torch.cuda.synchronize(); pr.disable()
    rows = sorted(pstats.Stats(pr).stats.items(), key=lambda kv: -kv[1][2])[:5]
    host.sort(); wall.sort()
    print(f"{name:12s} host {host[20]*1e3:.3f} ms  wall {wall[20]*1e3:.3f} ms  top own:",
          [(f"{os.path.basename(f)}:{l}:{fn}", round(tt * 1e3 / 8, 3)) for (f, l, fn), (_, nc, tt, ct, _) in rows], flush=True)
    torch._dynamo.reset()

def strip(model):
    for m in model.modules():
        forwards.uninstall(m)

for name in ("ours", "bf16", "ours-after-prefill-compile", "ours-bare"):
    if name == "bf16":
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, device_map="cuda").eval()
    else:
        model = load(art, device="cuda", prefill_m=2048)
        if name == "ours-bare":
            strip(model)
    if name == "ours-after-prefill-compile":  # what model_latency does before its decode
        ids = torch.randint(0, 1000, (1, 2048), device=dev)
        for layer in model.model.layers:
            layer.compile()
        with torch.no_grad():
            for _ in range(3):
                model(ids, use_cache=False, logits_to_keep=1)
        for layer in model.model.layers:
            layer._compiled_call_impl = None
        torch._dynamo.reset()
    decode(model, name)
    del model; gc.collect(); torch.cuda.empty_cache()
