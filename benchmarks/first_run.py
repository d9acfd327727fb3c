"""The first minute: a one-shot `mpsconvert generate` against the BF16 transformers
script a user would write, each the wall time of a whole fresh process, in one run.

What runs, each in a process of its own (what a user starts), in this order:
  ours #1    `mpsconvert generate ART PROMPT -m 256 --json` with defaults, on caches made empty
             for this run (Triton's, Inductor's, mpsconvert's kernel policy): a fresh machine's
             first command, except that the files are in the page cache (just written)
  ours #2    the same again: a machine that has run it once
  bf16 #1/#2 `from_pretrained(dtype=bfloat16).to("cuda")`, `apply_chat_template`, default
             `generate(max_new_tokens=256)` and `decode`: what a transformers user writes
  steady     in one process: `mpsconvert.load`, the time from load() returning to the first token
             of a 256-token chat generation (the decode step's setup, tokenization and prefill
             included), then a 2048-token generation (no stop token): its steady tokens/s as a
             fraction of the device's copy bandwidth (weights and the KV cache at the midpoint per
             step, as benchmarks/generate.py counts them)
  compile    (`--compile-too`) the same with `--decode compile` (torch.compile), for comparison
  fresh load `mpsconvert.load` on empty caches, timed as the BF16 script times `from_pretrained`
             (after `import torch` and transformers' auto classes, whose import is timed apart); it
             returns with our Triton kernels held while they compile (runtime/load/held.py), and the
             row also says how long after it returned the model had them
  warm load  the same on this run's caches (filled by the commands before it)

Ratios against BF16 come from the same run; targets (CUDA): ours #2 / bf16 #2 <= 0.6,
ours #1 / bf16 #1 <= 1.0, TTFT after load <= 1.5 s, steady decode >= 0.75 of copy bandwidth,
fresh load / bf16 #1's `from_pretrained` <= 1.5.
The model is benchmarks/generate.py's Llama-3-8B shape (`_sources.config_for("llama", 32)`) with
random weights and a 32k-token byte-level BPE with a ChatML template (benchmarks/chat_template.py).

Checked on CPU only (`--layers 2 --device cpu`); its first GPU run decides whether the graph path
becomes the CUDA default (runtime/engine/decoder.py, CUDA_DEFAULT).

    python benchmarks/first_run.py --work /tmp/fr --ours-decode graph --compile-too   # the graph path, against compile
    python benchmarks/first_run.py --work /tmp/fr [--compile-too]                     # defaults
    python benchmarks/first_run.py --layers 2 --device cpu --tokens 8 --long 16   # the script's own check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

PROMPT = "Tell me about the history of Paris."
VOCAB = 32000

BF16_SCRIPT = """
import time
t = time.perf_counter()
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
src, prompt, n, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
print("IMPORTED", time.perf_counter() - t)
t = time.perf_counter()
tok = AutoTokenizer.from_pretrained(src)
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).to(device)
print("LOADED", time.perf_counter() - t)
messages = [{"role": "user", "content": prompt}]
enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**enc.to(device), max_new_tokens=n)
text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
print("GENERATED", out.shape[1] - enc["input_ids"].shape[1])
"""


def steady(art: Path, args) -> dict:
    """In this process: open the artifact with the public API (`mpsconvert.chat`: the model's
    load, its tokenizer), the time from that returning to the first token of an n-token chat
    generation (the template's render, the decode step's setup and the prefill, each also timed
    on its own), then a long generation's steady tokens/s."""
    import torch

    import mpsconvert
    from mpsconvert.runtime import engine
    from mpsconvert.runtime.load.load_report import model_bytes

    t = time.perf_counter()
    chat = mpsconvert.chat(art, device=args.device, max_tokens=args.tokens, compile=args.decode)
    conv, eng = chat._conv, chat._conv.decoder
    model = eng.model
    out = {"load_s": round(time.perf_counter() - t, 3), "load_seconds": model.mpsconvert.seconds}
    t0 = time.perf_counter()
    ids = conv.encode(PROMPT, True)
    t1 = time.perf_counter()
    eng.reserve(len(ids) + args.tokens)
    t2 = time.perf_counter()
    first: list[float] = []
    st = engine.generate_ids(
        eng, ids, engine.Sampling(max_tokens=args.tokens), on_token=lambda _: first or first.append(time.perf_counter())
    )
    out["ttft_after_load_s"] = round(first[0] - t0, 3)
    out["ttft_parts_s"] = {
        "render_and_tokenize": round(t1 - t0, 3),
        "decode_setup": round(t2 - t1, 3),
        "prefill_and_first_token": round(first[0] - t2, 3),
    }
    out["first"] = {
        "decode": eng.decode_report,
        "prompt_tokens": st.prompt_tokens,
        "prompt_s": round(st.prompt_seconds, 4),
        "tokens_per_s": round(st.generation_tps or 0, 2),
    }
    long = engine.generate_ids(eng, ids, engine.Sampling(max_tokens=args.long))
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    kv = (
        2 * cfg.num_hidden_layers * (len(ids) + args.long // 2) * kv_heads * head_dim * 2
    )  # K and V, bf16, at the midpoint
    out["long"] = {
        "decode": long.decode,
        "tokens": long.generated_tokens,
        "tokens_per_s": round(long.generation_tps, 2),
        "step_bytes": model_bytes(model) + kv,
    }
    if args.device == "cuda":
        out["device_name"] = torch.cuda.get_device_name()
    return out


def fresh_load(art: Path, args) -> dict:
    """In this process, on the caches the parent gives it (empty: a fresh machine's): `mpsconvert.load`,
    timed as the BF16 script times `from_pretrained` (torch and transformers' auto classes imported
    before the clock starts, their import timed apart), its seconds by step, what its warm-up did,
    and what the autotuners and the kernel policy chose (the tuning a fresh machine of this GPU pays for)."""
    t = time.perf_counter()
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import mpsconvert

    imports = time.perf_counter() - t
    t = time.perf_counter()
    model = mpsconvert.load(art, device=args.device)
    info = model.mpsconvert
    out = {"load_s": round(time.perf_counter() - t, 3), "load_seconds": dict(info.seconds)}
    from mpsconvert.runtime.load import held

    t = time.perf_counter()
    if held.finish(model):  # a first run's kernels, held while they compiled: how long until the model has them
        out["held"] = {"ready_after_load_s": round(time.perf_counter() - t, 3), "seconds": info.seconds["held"]}
    out["prewarm"] = info.prewarm
    out["imports_s"] = round(imports, 3)
    out["tuning"] = {"autotuned": autotuned_choices(), "decisions": info.kernels}
    return out


def autotuned_choices() -> dict:
    """What each autotuned decode kernel chose, per autotuning key (its names, then the values)."""
    from mpsconvert.runtime.ops.triton import gemv, moe_gemv

    out = {}
    for name, fn in (("gemv", gemv._kernel), ("gemv_w8a8", gemv._dot_kernel), ("gemv_splitk", moe_gemv._kernel)):
        out[name] = {
            "keys": list(getattr(fn, "keys", [])),
            "best": [
                [[str(v) for v in key], {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}]
                for key, cfg in getattr(fn, "cache", {}).items()
            ],
        }
    return out


def fresh_load_child(art: Path, args, env: dict, work: Path, warm: bool = False, **extra) -> dict:
    """`fresh_load` in a child process on caches made empty for it, or with `warm` on the run's own
    (filled by the commands before it) (`extra`: more environment)."""
    fresh = Path(tempfile.mkdtemp(prefix="caches-", dir=work))
    env = dict(
        env,
        **(
            {}
            if warm
            else {
                "TRITON_CACHE_DIR": str(fresh / "triton"),
                "TORCHINDUCTOR_CACHE_DIR": str(fresh / "inductor"),
                "MPSCONVERT_CACHE_DIR": str(fresh / "mpsconvert"),
            }
        ),
        **extra,
    )
    _, out, _ = run([sys.executable, __file__, "--child", str(art), "--device", args.device, "--fresh-load"], env)
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[len("RESULT ") :])


def record_tuning(body: dict, device_name: str, torch_version: str, triton_version: str | None) -> dict:
    """runtime/ops/triton/tuned.json's entry for this GPU from a fresh load measured with the table
    off (MPSCONVERT_TUNED=0): the kernel policy's timings and each autotuner's choice per key."""
    from mpsconvert.runtime.ops.triton import tuned

    policy = {}
    for d in body["tuning"]["decisions"]:
        sig = (*d["shape"], d["weights"], d["activations"])
        policy[tuned.policy_key(sig, d["bucket"], d["m"])] = d["timings_us"]
    autotune = {
        name: {tuned.autotune_key(v["keys"], dict(zip(v["keys"], key))): cfg for key, cfg in v["best"]}
        for name, v in body["tuning"]["autotuned"].items()
    }
    when = time.strftime("%Y-%m-%d", time.gmtime())
    measured = f"{when}, benchmarks/first_run.py --record-tuning, torch {torch_version}, Triton {triton_version}"
    table = json.loads(tuned.FILE.read_text()) if tuned.FILE.is_file() else {}
    table[device_name] = {"measured": measured, "policy": policy, "autotune": autotune}
    tuned.FILE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return table[device_name]


def run(argv: list[str], env: dict) -> tuple[float, str, str]:
    t = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])}... failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return wall, r.stdout, r.stderr


def last_json(stdout: str) -> dict:
    return json.loads([ln for ln in stdout.splitlines() if ln.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--work", help="folder for the checkpoint, the artifact and the caches (kept); default: a temporary one"
    )
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=256, help="-m of the one-shot commands")
    ap.add_argument("--long", type=int, default=2048, help="tokens of the steady-decode generation")
    ap.add_argument(
        "--compile-too", action="store_true", help="also the steady run with --decode compile (torch.compile)"
    )
    ap.add_argument(
        "--ours-decode",
        default="auto",
        choices=("auto", "graph", "compile", "eager"),
        help="generate's --decode for ours and the steady run (auto: the default, what the targets are about)",
    )
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: the steady run in this process, of this artifact
    ap.add_argument("--decode", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--record-tuning",
        action="store_true",
        help="first measure a fresh load with runtime/ops/triton/tuned.json off and write this GPU's entry there",
    )
    ap.add_argument("--fresh-load", action="store_true", help=argparse.SUPPRESS)  # internal: the child loads only
    args = ap.parse_args()
    if args.child:
        body = fresh_load(Path(args.child), args) if args.fresh_load else steady(Path(args.child), args)
        print("RESULT " + json.dumps(body, default=str), flush=True)
        return

    work = Path(args.work or tempfile.mkdtemp(prefix="mpsconvert-first-run-"))
    work.mkdir(parents=True, exist_ok=True)
    caches = Path(tempfile.mkdtemp(prefix="caches-", dir=work))  # empty: this run's first command is a fresh machine's
    env = dict(
        os.environ,
        TRITON_CACHE_DIR=str(caches / "triton"),
        TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
        MPSCONVERT_CACHE_DIR=str(caches / "mpsconvert"),
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    os.environ.update({k: env[k] for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "MPSCONVERT_CACHE_DIR")})
    import _sources
    import chat_template
    import torch

    report: dict = {
        "device": args.device,
        "ours_decode": args.ours_decode,
        "torch": torch.__version__,
        "prompt": PROMPT,
        "tokens": args.tokens,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": "in the page cache (written by this run)",
    }
    report["device_name"] = torch.cuda.get_device_name() if args.device == "cuda" else f"{os.cpu_count()} CPU cores"
    src, art = work / "src", work / "art"
    if not (src / "config.json").is_file():
        tok, _ = chat_template.tokenizer(VOCAB)
        cfg = _sources.config_for("llama" if args.layers > 2 or args.device == "cuda" else "tiny", args.layers)
        cfg.vocab_size = VOCAB if args.device == "cuda" else len(tok)
        cfg.bos_token_id, cfg.eos_token_id = tok.bos_token_id, tok.eos_token_id
        report["build"] = _sources.build_checkpoint(cfg, src, args.device)
        tok.save_pretrained(src)
    if not (art / "mpsconvert.json").is_file():
        report["quantize"] = _sources.quantize(src, art)
    bw = report["copy_bandwidth_Bps"] = _sources.copy_bandwidth(torch.device(args.device))
    if args.device == "cuda":
        torch.cuda.empty_cache()
    print(
        f"{report['device_name']}: copy bandwidth {bw / 1e9:.1f} GB/s; caches {caches} (empty at the start)", flush=True
    )

    if args.record_tuning:  # measured with the table off, on caches of its own; the runs below start cold again
        from mpsconvert.runtime.ops import triton as tritonlib

        body = fresh_load_child(art, args, env, work, MPSCONVERT_TUNED="0")
        entry = record_tuning(body, report["device_name"], torch.__version__, tritonlib.version())
        report["recorded_tuning"] = {"load_s": body["load_s"], "policy_entries": len(entry["policy"])}
        print(f"recorded tuning for {report['device_name']}: {report['recorded_tuning']}", flush=True)

    ours_argv = [
        sys.executable,
        "-m",
        "mpsconvert.cli",
        "generate",
        str(art),
        PROMPT,
        "-m",
        str(args.tokens),
        "--device",
        args.device,
        "--json",
        "--decode",
        args.ours_decode,
    ]
    rows = {}
    for name in ("ours #1", "ours #2"):
        wall, out, err = run(ours_argv, env)
        if "Warning" in err or "warning" in err:  # a fallback is said on stderr: shown here too
            print(f"{name} stderr: {err[-1500:]}", flush=True)
        body = last_json(out)
        rows[name] = {
            "wall_s": round(wall, 2),
            "decode": body.get("decode"),
            "load_seconds": body.get("load_seconds"),
            "generated": body["generated_tokens"],
            "prompt_tokens": body["prompt_tokens"],
            "tokens_per_s": body.get("generation_tokens_per_s"),
            "prompt_s": round(body["prompt_seconds"], 4),
        }
        print(f"{name}: {wall:.2f} s wall, {rows[name]}", flush=True)
    for name in ("bf16 #1", "bf16 #2"):
        wall, out, _ = run([sys.executable, "-c", BF16_SCRIPT, str(src), PROMPT, str(args.tokens), args.device], env)
        gen = next((int(ln.split()[1]) for ln in out.splitlines() if ln.startswith("GENERATED")), None)
        loaded, imported = (
            next((float(ln.split()[1]) for ln in out.splitlines() if ln.startswith(word)), None)
            for word in ("LOADED", "IMPORTED")
        )
        rows[name] = {"wall_s": round(wall, 2), "generated": gen, "load_s": round(loaded, 3), "imports_s": imported}
        print(f"{name}: {wall:.2f} s wall, {gen} tokens", flush=True)
    for name, decode in (
        ("steady", None if args.ours_decode == "auto" else args.ours_decode),
        *((("steady compile", "compile"),) if args.compile_too else ()),
    ):
        argv = [
            sys.executable,
            __file__,
            "--child",
            str(art),
            "--device",
            args.device,
            "--tokens",
            str(args.tokens),
            "--long",
            str(args.long),
            *(["--decode", decode] if decode else []),
        ]
        wall, out, _ = run(argv, env)
        r = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[len("RESULT ") :])
        r["wall_s"] = round(wall, 2)
        r["long"]["bandwidth_fraction"] = round(r["long"]["step_bytes"] * r["long"]["tokens_per_s"] / bw, 4)
        rows[name] = r
        print(f"{name}: {r}", flush=True)
    rows["fresh load"] = fresh_load_child(art, args, env, work)
    rows["warm load"] = fresh_load_child(art, args, env, work, warm=True)
    for name in ("fresh load", "warm load"):
        r = rows[name]
        print(f"{name}: {r['load_s']} s (imports before it {r['imports_s']} s), {r['load_seconds']}", flush=True)
        if "held" in r:
            print(f"  {name}: our kernels held; the model had them {r['held']}", flush=True)
    report["runs"] = rows
    ratios = {
        "ours #2 / bf16 #2 wall (target <= 0.6)": rows["ours #2"]["wall_s"] / rows["bf16 #2"]["wall_s"],
        "ours #1 / bf16 #1 wall (target <= 1.0)": rows["ours #1"]["wall_s"] / rows["bf16 #1"]["wall_s"],
        "TTFT after load() s (target <= 1.5)": rows["steady"]["ttft_after_load_s"],
        "first load() on fresh caches / bf16 #1 from_pretrained (target <= 1.5)": rows["fresh load"]["load_s"]
        / rows["bf16 #1"]["load_s"],
        "load() on this run's caches / bf16 #2 from_pretrained": rows["warm load"]["load_s"]
        / rows["bf16 #2"]["load_s"],
        f"steady decode -m {args.long}, fraction of copy bandwidth (target >= 0.75)": rows["steady"]["long"][
            "bandwidth_fraction"
        ],
    }
    if "steady compile" in rows:
        ratios[f"torch.compile: steady decode -m {args.long}, fraction of copy bandwidth"] = rows["steady compile"][
            "long"
        ]["bandwidth_fraction"]
    report["ratios"] = {k: round(v, 3) for k, v in ratios.items()}
    for k, v in report["ratios"].items():
        print(f"  {k}: {v}", flush=True)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"first_run_{args.device}_llama{args.layers}.json")
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
