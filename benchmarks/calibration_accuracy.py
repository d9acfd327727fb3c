"""Accuracy of static FP8 activation scales on real weights, against BF16, weight-only and dynamic.

    python benchmarks/calibration_accuracy.py [--windows 32] [--models smollm2,minilm]

SmolLM2-135M-Instruct (its weights sit on a 4-bit grid: the GGUF is Q4_1) and all-MiniLM-L6-v2,
calibrated on ../shared/data/wiki_calib.jsonl, evaluated on wiki_eval.jsonl. Every artifact is
written by mpsconvert and loaded back through transformers + compressed-tensors, which simulates
the FP8 weights and the activation quantization (per token for fp8-dynamic, the stored static
input_scale for fp8). SmolLM2: perplexity over the first --windows non-overlapping 512-token
windows of the eval text (to keep CPU time reasonable). MiniLM: cosine of mean-pooled
embeddings against the FP32 source, over the first --windows 128-token eval windows.

"naive minmax" is the reference recipe: minmax over 32 calibration documents (the first 512 tokens
of each). Ours: --num-samples (default 64) windows of 512 tokens (all 44 documents, then second
windows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).parent))
import _sources  # noqa: E402

import mpsconvert  # noqa: E402
from mpsconvert import calibration_options as CalibOptions  # noqa: E402


def variants(num_samples: int, seq_len: int):
    """(label, scheme, weights, calibration options or None)."""
    calib = str(_sources.CALIB_FILE)
    ours = dict(data=calib, num_samples=num_samples, seq_len=seq_len, device="cpu")
    return [
        ("fp8-weight-only (row)", "fp8-weight-only", "row", None),
        ("fp8-dynamic (row)", "fp8-dynamic", "row", None),
        (
            "fp8 naive minmax, 32 docs",
            "fp8",
            "tensor",
            CalibOptions(data=calib, num_samples=32, seq_len=seq_len, observer="minmax", device="cpu"),
        ),
        ("fp8 minmax", "fp8", "tensor", CalibOptions(observer="minmax", **ours)),
        ("fp8 percentile 99.99", "fp8", "tensor", CalibOptions(observer="percentile", **ours)),
        ("fp8 mse", "fp8", "tensor", CalibOptions(observer="mse", **ours)),
        (
            "fp8 naive minmax, 32 docs (row)",
            "fp8",
            "row",
            CalibOptions(data=calib, num_samples=32, seq_len=seq_len, observer="minmax", device="cpu"),
        ),
        ("fp8 minmax (row)", "fp8", "row", CalibOptions(observer="minmax", **ours)),
        ("fp8 mse (row)", "fp8", "row", CalibOptions(observer="mse", **ours)),
    ]


def build(src: Path, work: Path, label: str, scheme: str, weights: str, copts, cache: dict) -> tuple[Path, float]:
    """The user's path: `calibrate SRC -o scales.json` once per observer setting, then
    `quantize SRC --scheme fp8 --scales scales.json` (or a data-free scheme)."""
    t0 = time.perf_counter()
    scales = None
    if copts is not None:
        key = (copts.observer, copts.num_samples)
        scales = work / f"scales-{copts.observer}-{copts.num_samples}.json"
        if key not in cache:
            cache[key] = mpsconvert.calibrate(src, scales, options=copts)
    out = work / label.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
    mpsconvert.quantize(src, out, scheme=scheme, weights=weights, scales_file=scales, force=True)
    return out, time.perf_counter() - t0


def lm_windows(tok, windows: int, seq: int = 512) -> list[torch.Tensor]:
    ids = tok("\n\n".join(_sources.eval_texts()))["input_ids"]
    return [torch.tensor([ids[i : i + seq]]) for i in range(0, min(len(ids) - seq, windows * seq), seq)]


def perplexity(path: Path | torch.nn.Module, wins) -> float:
    """Perplexity over the windows, of a model folder (transformers, BF16) or a loaded model."""
    from transformers import AutoModelForCausalLM

    model = (
        path
        if isinstance(path, torch.nn.Module)
        else AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    )
    nll = n = 0.0
    with torch.no_grad():
        for x in wins:
            logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
            nll += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
            n += x.shape[1] - 1
    return math.exp(nll / n)


def embeddings(path: Path, wins) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path)).eval()
    out = []
    with torch.no_grad():
        for x in wins:
            h = model(input_ids=x).last_hidden_state[0].float()
            out.append(torch.nn.functional.normalize(h.mean(0), dim=0))
    return torch.stack(out)


def run_model(name: str, src: Path, work: Path, windows: int, num_samples: int, only: str | None = None) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    seq = 512 if name == "smollm2" else 128
    calib_seq = 512 if name == "smollm2" else 256
    wins = lm_windows(tok, windows, seq)
    rows = []
    if name == "smollm2":
        base = perplexity(src, wins)
        rows.append({"model": name, "variant": "bf16 (source)", "ppl": base, "delta_pct": 0.0})
    else:
        ref = embeddings(src, wins)
        rows.append({"model": name, "variant": "fp32 (source)", "cos_mean": 1.0, "cos_min": 1.0})
    cache: dict = {}
    for label, scheme, weights, copts in variants(num_samples, calib_seq):
        if only and label not in only.split(";"):
            continue
        art, secs = build(src, work / name, label, scheme, weights, copts, cache)
        if name == "smollm2":
            ppl = perplexity(art, wins)
            rows.append(
                {"model": name, "variant": label, "ppl": ppl, "delta_pct": 100 * (ppl / base - 1), "build_s": secs}
            )
        else:
            cos = (embeddings(art, wins) * ref).sum(1)
            rows.append(
                {
                    "model": name,
                    "variant": label,
                    "cos_mean": float(cos.mean()),
                    "cos_min": float(cos.min()),
                    "build_s": secs,
                }
            )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,minilm")
    ap.add_argument("--windows", type=int, default=32, help="eval windows (first N)")
    ap.add_argument("--num-samples", type=int, default=64, help="calibration windows for our observers")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--variants", help="only these variants, ';'-separated labels (the source is always measured)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (1 is fastest on a busy shared machine)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="calib-acc-") as work:
        for name in args.models.split(","):
            src = _sources.smollm2() if name == "smollm2" else _sources.minilm()
            rows += run_model(name, src, Path(work), args.windows, args.num_samples, args.variants)
    print(f"\n{'model':8} {'variant':34} {'metric':>22}")
    for r in rows:
        if "ppl" in r:
            m = f"ppl {r['ppl']:.3f} ({r['delta_pct']:+.2f}%)"
        else:
            m = f"cos {r['cos_mean']:.5f} (min {r['cos_min']:.4f})"
        print(f"{r['model']:8} {r['variant']:34} {m:>22}")
    by = {(r["model"], r["variant"]): r for r in rows}
    for w in ("", " (row)"):
        naive = by.get(("smollm2", f"fp8 naive minmax, 32 docs{w}"))
        ours = [
            r
            for r in rows
            if r["model"] == "smollm2"
            and r["variant"].startswith("fp8 ")
            and "naive" not in r["variant"]
            and r["variant"].endswith("(row)") == bool(w)
        ]
        if naive and ours:
            best = min(ours, key=lambda r: r["ppl"])
            print(
                f"smollm2 static, weights per {'row' if w else 'tensor'}: best ours '{best['variant']}' "
                f"{best['delta_pct']:+.2f}% vs naive minmax {naive['delta_pct']:+.2f}% -> "
                f"{naive['delta_pct'] - best['delta_pct']:+.2f} percentage points"
            )
    print(
        f"total {time.perf_counter() - t0:.0f} s on cpu, {torch.get_num_threads()} thread(s) (eval windows: first "
        f"{args.windows}; calibration windows: naive 32, ours {args.num_samples})"
    )
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
