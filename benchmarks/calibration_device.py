"""Calibration on an accelerator: whole model vs --sequential, samples/s and peak device memory.

    python benchmarks/calibration_device.py --device cuda --arch DIR [--num-samples 32] [--seq-len 512]

DIR holds a config.json and tokenizer files (e.g. SmolLM2-135M's); the weights are random (a
machine without the real weights can still show the device path, the speed and the memory of
both modes on the real architecture's shapes). Prints whether both modes gave identical scales.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from mpsconvert import devices
from mpsconvert.calibrate.run import CalibOptions, calibrate


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--arch", type=Path, required=True)
    ap.add_argument("--calib-data", default=None)
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--observer", default="minmax")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    dev = devices.choose(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "model"
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(str(args.arch))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(src)
        del model
        for f in args.arch.iterdir():
            if f.is_file() and f.name not in ("config.json",) and not f.name.endswith(".safetensors"):
                shutil.copyfile(f, src / f.name)
        rows = {}
        for mode in ("whole-model", "sequential", "whole-model"):  # the first run warms the device up
            devices.empty_cache(dev)
            cal = calibrate(src, CalibOptions(data=args.calib_data, num_samples=args.num_samples, seq_len=args.seq_len,
                                              device=args.device, sequential=mode == "sequential", observer=args.observer))
            rows[mode] = cal
            mem = cal.peak_memory.get("peak_allocated")
            print(f"{mode:12} {args.observer:7} on {cal.record['device']}: {cal.record['num_samples'] / cal.seconds:7.2f} samples/s "
                  f"({cal.seconds:.2f} s, {cal.record['tokens']} tokens), peak allocated "
                  f"{'n/a' if mem is None else f'{mem / 2**20:.0f} MiB'}", flush=True)
        a, b = rows["whole-model"].scales, rows["sequential"].scales
        worst = max(abs(a[k] - b[k]) / a[k] for k in a)
        print(json.dumps({"device": str(dev), "name": devices.capabilities(dev).name, "observer": args.observer, "scales": len(a),
                          "identical": a == b, "max_rel_diff": worst}))


if __name__ == "__main__":
    sys.exit(main())
