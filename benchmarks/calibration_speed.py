"""Calibration speed and peak memory: mpsconvert against llm-compressor's `oneshot`, one run.

    python benchmarks/calibration_speed.py [--num-samples 32] [--seq-len 512] [--model smollm2|minilm]

Both calibrate the same model (SmolLM2-135M-Instruct as BF16 safetensors) on the same token
windows (drawn by mpsconvert from ../shared/data/wiki_calib.jsonl and handed to llm-compressor
as a tokenized dataset), for static FP8: ours = `calibrate()` (minmax observer, whole model,
then sequential), theirs = `oneshot(recipe=QuantizationModifier(targets="Linear", scheme="FP8",
ignore=["lm_head"]))` without saving. Each runs in its own child process so that peak RSS
(ru_maxrss, CPU) is its own; time counts model loading plus calibration. Ratios are ours/theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _sources  # noqa: E402


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _samples(src: Path, n: int, seq: int):
    from transformers import AutoTokenizer

    from mpsconvert.calibrate import data

    tok = AutoTokenizer.from_pretrained(str(src))
    return data.draw(data.load(str(_sources.CALIB_FILE)), tok, n, seq, seed=0)


def child(which: str, src: Path, n: int, seq: int, threads: int | None) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    samples = _samples(src, n, seq)
    base = _rss_mb()
    if which.startswith("ours"):
        from mpsconvert.calibrate.run import CalibOptions, calibrate

        t0 = time.perf_counter()
        cal = calibrate(src, CalibOptions(data=str(_sources.CALIB_FILE), num_samples=n, seq_len=seq, device="cpu", sequential=which == "ours-sequential"))
        secs = time.perf_counter() - t0
        got = len(cal.scales)
    else:
        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from transformers import AutoModelForCausalLM

        ds = Dataset.from_dict({"input_ids": samples.input_ids, "attention_mask": [[1] * len(s) for s in samples.input_ids]})
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
        recipe = QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head"])
        torch.set_grad_enabled(True)  # oneshot manages its own no_grad
        oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(samples.input_ids), max_seq_length=seq,
                shuffle_calibration_samples=False)
        secs = time.perf_counter() - t0
        got = sum(1 for _, m in model.named_modules() if hasattr(m, "input_scale"))
    return {"which": which, "seconds": secs, "samples": len(samples.input_ids), "samples_per_s": len(samples.input_ids) / secs,
            "peak_rss_mb": _rss_mb(), "rss_before_mb": base, "scales": got}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--child")
    ap.add_argument("--threads", type=int, help="torch CPU threads in both children (1 is fastest on a busy shared machine)")
    args = ap.parse_args()
    src = _sources.smollm2()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, src, args.num_samples, args.seq_len, args.threads)), flush=True)
        return
    env = dict(os.environ, TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error")
    rows = {}
    for which in ("ours", "ours-sequential", "llm-compressor"):
        p = subprocess.run([sys.executable, __file__, "--child", which, "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len)]
                           + (["--threads", str(args.threads)] if args.threads else []),
                           capture_output=True, text=True, env=env)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not line:
            print(f"{which} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
            continue
        rows[which] = json.loads(line[-1][7:])
        r = rows[which]
        print(f"{which:16} {r['samples_per_s']:6.2f} samples/s ({r['seconds']:.1f} s for {r['samples']} x {args.seq_len} tokens), "
              f"peak RSS {r['peak_rss_mb']:.0f} MiB (before calibration {r['rss_before_mb']:.0f} MiB), {r['scales']} input scales", flush=True)
    base = rows.get("llm-compressor")
    if base:
        for which in ("ours", "ours-sequential"):
            if which in rows:
                r = rows[which]
                print(f"{which} / llm-compressor: speed {r['samples_per_s'] / base['samples_per_s']:.2f}x, "
                      f"peak RSS {r['peak_rss_mb'] / base['peak_rss_mb']:.2f}x")
    print(f"device: cpu, threads {args.threads or 'torch default'} (SmolLM2-135M-Instruct BF16; minmax observer for ours)")


if __name__ == "__main__":
    main()
