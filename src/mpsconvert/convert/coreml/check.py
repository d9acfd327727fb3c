"""Checks of an exported `model.mlpackage`: on every platform, and with Core ML itself on macOS.

`check_package` runs anywhere (Linux included) from the saved package alone: its spec (inputs,
outputs, dtypes, flexible ranges), op counts and weight bytes; the weights read back from
weight.bin and compared with the FP8 artifact; and a reference evaluation of the program
(`mil_eval`, coremltools' Python op definitions, NOT the Core ML runtime) on real text against
PyTorch running the same architecture with the artifact's dequantized weights in fp32.

`coreml_runtime_check` is the macOS part for `mpsconvert validate`: Core ML loads and runs the
package per compute unit, its outputs are compared with PyTorch within a tolerance, and latency
is measured beside PyTorch on MPS. Elsewhere it returns a "skipped: needs macOS" result.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from ...errors import ArtifactError
from ...manifests.layout import update_manifest
from ...manifests.manifest import Manifest
from ... import fp8, timing
from .export import PACKAGE_NAME, build_torch_model, e4m3_lut, fp8_safetensors_bytes, weight_bytes_of_package

REFERENCE_NAME = "pytorch fp32 (source architecture, the artifact's FP8 weights dequantized; activations not quantized)"
EVALUATOR_NAME = "MIL reference evaluation (numpy, coremltools op definitions): not the Core ML runtime"
# English sentences for the reference evaluation when no text is given (any real text works).
DEFAULT_TEXTS = (
    "The Eiffel Tower was built for the 1889 World's Fair in Paris and was at first criticised by many artists.",
    "Photosynthesis converts light energy into chemical energy that is stored in glucose and other sugars.",
    "In 1969 the Apollo 11 mission landed two astronauts on the Moon, and millions watched on television.",
)
# Agreement that counts as "the package computes the model" (fp16 compute vs fp32 reference).
MIN_COSINE = 0.99
MIN_TOP1 = 0.9
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "spiece.model")
_DTYPES = {65568: "fp32", 65552: "fp16", 131104: "int32", 131080: "int8"}


def _package(artifact: Path) -> Path:
    pkg = Path(artifact) / PACKAGE_NAME
    if not pkg.is_dir():
        raise ArtifactError(f"{artifact} has no {PACKAGE_NAME}", "run `mpsconvert export-coreml` first")
    return pkg


# --------------------------------------------------------------------------- spec


def _feature(f) -> dict:
    a = f.type.multiArrayType
    out = {"name": f.name, "dtype": _DTYPES.get(a.dataType, str(a.dataType)), "shape": list(a.shape)}
    if a.WhichOneof("ShapeFlexibility") == "shapeRange":
        out["range"] = [[r.lowerBound, r.upperBound] for r in a.shapeRange.sizeRanges]
    return out


def spec_summary(spec, prog) -> dict:
    ops = Counter(op.op_type for f in prog.functions.values() for op in f.operations)
    return {
        "specification_version": spec.specificationVersion,  # 9 = iOS18 / macOS15
        "inputs": [_feature(f) for f in spec.description.input],
        "outputs": [_feature(f) for f in spec.description.output],
        "ops": dict(sorted(ops.items())),
    }


# --------------------------------------------------------------------------- weights read back


def _op_by_name(prog) -> dict:
    return {op.name: op for f in prog.functions.values() for op in f.operations}


def _ulp_diff(a16: np.ndarray, b16: np.ndarray) -> int:
    """Largest distance in fp16 units in the last place (same-sign values)."""
    ai = a16.view(np.int16).astype(np.int32)
    bi = b16.view(np.int16).astype(np.int32)
    return int(np.abs(ai - bi).max()) if a16.size else 0


def check_weights(prog, record: dict, fp8_weights: dict) -> dict:
    """Read every FP8 weight back from the program and compare it with the artifact.

    fp8-lut: indices must be the FP8 bit patterns and the LUT the e4m3 values (x scale or 2**-k),
    bit for bit; the weight the program applies (LUT value x row scale) is compared with the
    artifact's dequantized weight in FP16. int8/fp16: the decoded weight is compared (error).
    """
    ops = _op_by_name(prog)
    base = e4m3_lut()
    rows = {}
    for name, enc in record["encoded_tensors"].items():
        q, s = fp8_weights[name]
        codes = q.view(torch.uint8).numpy()
        want16 = fp8.dequantize(q, s, torch.float16).numpy()
        r: dict = {}
        if record["weights"] == "fp8-lut":
            lut_op = ops.get(enc["lut"])
            if lut_op is None or lut_op.op_type != "constexpr_lut_to_dense":
                rows[name] = {"ok": False, "why": f"op {enc['lut']} not in the package"}
                continue
            idx = np.asarray(lut_op.indices.val)
            lut = np.asarray(lut_op.lut.val).reshape(-1)
            r["indices_bytes"] = int(idx.nbytes)
            r["indices_equal_fp8_codes"] = bool(idx.dtype == np.uint8 and idx.shape == codes.shape and np.array_equal(idx, codes))
            if enc["row_scale"] is None:
                want_lut = (base * s.numpy().reshape(())).astype(np.float16)
                got = lut[idx]
            else:
                want_lut = (base * np.float32(2.0 ** -enc["lut_exponent"])).astype(np.float16)
                row_op = ops.get(enc["row_scale"])
                row = np.asarray(row_op.outputs[0].val) if row_op is not None else None
                want_row = (s.numpy().reshape(-1) * np.float32(2.0 ** enc["lut_exponent"])).astype(np.float16)
                r["row_scale_equal"] = bool(row is not None and np.array_equal(row, want_row))
                # The applied weight: LUT value x fp16 row scale (exact in fp32), seen in FP16.
                got = (lut[idx].astype(np.float32) * (row if row is not None else want_row).astype(np.float32)[:, None]).astype(np.float16)
            r["lut_equal_e4m3"] = bool(np.array_equal(lut.view(np.uint16), want_lut.view(np.uint16)))
            r["weights_equal_fp16_dequant"] = float(np.mean(got.view(np.uint16) == want16.view(np.uint16)))
            r["max_ulp_diff"] = _ulp_diff(got, want16)
            # Per-tensor: the decoded weight must be the FP16 dequantization bit for bit. Per-row: the
            # codes, LUT and fp16 row scale are checked bit for bit; the applied weight may then
            # differ from the FP16 dequantization by the row scale's fp16 rounding (<= 1 ulp).
            exact = r["weights_equal_fp16_dequant"] == 1.0 if enc["row_scale"] is None else r["max_ulp_diff"] <= 1
            r["ok"] = bool(r["indices_equal_fp8_codes"] and r["lut_equal_e4m3"] and r.get("row_scale_equal", True) and exact)
        else:
            cand = [op for n, op in ops.items() if n == enc["op"] or (n.startswith(enc["op"]) and op.op_type.startswith("constexpr_"))]
            op = next((o for o in cand if o.op_type == "constexpr_blockwise_shift_scale"), cand[0] if cand else None)
            if op is None:
                rows[name] = {"ok": False, "why": f"op {enc['op']} not in the package"}
                continue
            got = op.materialized_val_inference() if op.op_type.startswith("constexpr_") else op.outputs[0].val
            got = np.asarray(got).astype(np.float16)
            if enc.get("transposed"):
                got = got.T
            err = got.astype(np.float64) - want16.astype(np.float64)
            sig = float(np.sum(want16.astype(np.float64) ** 2))
            r["stored_as"] = op.op_type
            r["weights_equal_fp16_dequant"] = float(np.mean(got.view(np.uint16) == want16.view(np.uint16)))
            r["sqnr_db_vs_fp8"] = None if not np.any(err) else round(float(10 * np.log10(sig / float(np.sum(err**2)))), 2)
            r["ok"] = bool(r["weights_equal_fp16_dequant"] == 1.0 if record["weights"] == "fp16" else r["sqnr_db_vs_fp8"] is None or r["sqnr_db_vs_fp8"] > 30)
        rows[name] = r
    missing = sorted(set(fp8_weights) - set(record["encoded_tensors"]))
    return {
        "tensors": rows,
        "checked": len(rows),
        "missing": missing,
        "all_ok": not missing and all(r.get("ok") for r in rows.values()),
        "codes_bit_exact": all(r.get("indices_equal_fp8_codes", False) for r in rows.values()) if record["weights"] == "fp8-lut" else None,
        "min_fraction_equal_fp16_dequant": min((r.get("weights_equal_fp16_dequant", 0.0) for r in rows.values()), default=None),
        "max_ulp_diff": max((r["max_ulp_diff"] for r in rows.values() if "max_ulp_diff" in r), default=None),
    }


# --------------------------------------------------------------------------- reference evaluation


def sample_inputs(artifact: Path, tm, seq: dict, texts=DEFAULT_TEXTS, n: int = 3) -> tuple[list[tuple[np.ndarray, ...]], str]:
    """Inputs shaped for the package, and what they are. Real text through the artifact's
    tokenizer: fixed length -> cut or padded (padding masked for encoders; LM text repeated to
    fill); a range -> natural lengths clipped to it. An artifact without a tokenizer (tiny test
    models) gets seeded random token ids, and the returned description says so."""
    from transformers import AutoTokenizer

    lo, hi = seq["min"], seq["max"]
    tok = None
    if any((Path(artifact) / f).is_file() for f in _TOKENIZER_FILES):
        tok = AutoTokenizer.from_pretrained(str(artifact))
    out = []
    rng = np.random.default_rng(0)
    vocab = int(getattr(tm.config, "vocab_size", 100))
    for i in range(n):
        if tok is None:
            length = hi if lo == hi else int(rng.integers(lo, hi + 1))
            ids = rng.integers(0, vocab, length).tolist()
        else:
            ids = tok(texts[i % len(texts)], add_special_tokens=tm.task == "encoder")["input_ids"]
        if tm.task == "causal-lm":
            while len(ids) < lo:
                ids = ids + ids
            out.append((np.array([ids[:hi]], dtype=np.int32),))
        else:
            ids = ids[:hi]
            mask = [1] * len(ids)
            pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
            while len(ids) < lo:
                ids.append(pad)
                mask.append(0)
            if tok is None and len(ids) > 2 and i % 2 == 1:  # exercise masking: pad the tail
                mask[-(len(ids) // 3):] = [0] * (len(ids) // 3)
            out.append((np.array([ids], dtype=np.int32), np.array([mask], dtype=np.int32)))
    what = f"{n} real text sample(s) through the artifact's tokenizer" if tok is not None else f"{n} seeded random token id sample(s) (the artifact has no tokenizer)"
    return out, what


def compare_outputs(task: str, got: np.ndarray, ref: np.ndarray) -> dict:
    got = got.astype(np.float64).reshape(-1, got.shape[-1])
    ref = ref.astype(np.float64).reshape(-1, ref.shape[-1])
    cos = (got * ref).sum(-1) / np.maximum(np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1), 1e-30)
    out = {"cosine_min": float(cos.min()), "cosine_mean": float(cos.mean()), "max_abs_diff": float(np.abs(got - ref).max()),
           "ref_max_abs": float(np.abs(ref).max())}
    if task == "causal-lm":
        out["top1_agreement"] = float(np.mean(got.argmax(-1) == ref.argmax(-1)))
        out["positions"] = int(got.shape[0])
    return out


def _merge(task: str, parts: list[dict]) -> dict:
    out = {"cosine_min": min(p["cosine_min"] for p in parts), "cosine_mean": float(np.mean([p["cosine_mean"] for p in parts])),
           "max_abs_diff": max(p["max_abs_diff"] for p in parts), "samples": len(parts)}
    if task == "causal-lm":
        n = sum(p["positions"] for p in parts)
        out["top1_agreement"] = sum(p["top1_agreement"] * p["positions"] for p in parts) / n
        out["positions"] = n
    out["ok"] = out["cosine_min"] >= MIN_COSINE and out.get("top1_agreement", 1.0) >= MIN_TOP1
    return out


def reference_eval(prog, tm, samples) -> dict:
    from . import mil_eval

    parts, how = [], Counter()
    for x in samples:
        outs, h = mil_eval.evaluate(prog, dict(zip(tm.input_names, x)))
        how.update(h)
        with torch.no_grad():
            ref = tm.module(*(torch.from_numpy(a.astype(np.int64)) for a in x)).float().numpy()
        parts.append(compare_outputs(tm.task, outs[tm.output_name], ref))
    res = _merge(tm.task, parts)
    res["evaluator"] = EVALUATOR_NAME
    res["reference"] = REFERENCE_NAME
    res["ops_by_implementation"] = {
        "coremltools": sum(v for k, v in how.items() if k.startswith("coremltools:")),
        "mpsconvert": sorted({k.split(":", 1)[1] for k in how if k.startswith("mpsconvert:")}),
    }
    return res


def check_package(artifact: Path, texts=DEFAULT_TEXTS, n_samples: int = 3, evaluate: bool = True) -> dict:
    """Every check that needs no Apple hardware. Returns a dict (also stored by `record_check`)."""
    from . import mil_eval

    artifact = Path(artifact)
    pkg = _package(artifact)
    manifest = Manifest.read(artifact)
    record = manifest.extra.get("coreml")
    if not record:
        raise ArtifactError(f"{artifact}/{PACKAGE_NAME} is not recorded in the manifest", "re-run `mpsconvert export-coreml --force`")
    prog, spec = mil_eval.load_program(pkg)
    tm = build_torch_model(artifact)
    res = {
        "package": PACKAGE_NAME,
        "spec": spec_summary(spec, prog),
        "weight_bytes": weight_bytes_of_package(pkg),
        "fp8_safetensors_bytes": fp8_safetensors_bytes(artifact),
        "weights": check_weights(prog, record, tm.fp8_weights),
    }
    res["size_ratio"] = round(res["weight_bytes"] / res["fp8_safetensors_bytes"], 4)
    if evaluate:
        samples, what = sample_inputs(artifact, tm, record["seq_len"], texts, n_samples)
        res["reference_eval"] = reference_eval(prog, tm, samples) | {"inputs": what}
    res["ok"] = res["weights"]["all_ok"] and res.get("reference_eval", {}).get("ok", True)
    return res


def record_check(artifact: Path, result: dict) -> None:
    """Keep the Linux-side check in manifest.extra["coreml"]["check"] (without per-tensor rows)."""
    slim = {k: v for k, v in result.items() if k != "weights"}
    slim["weights"] = {k: v for k, v in result["weights"].items() if k != "tensors"}
    with update_manifest(artifact) as m:
        m.extra.setdefault("coreml", {})["check"] = slim


# --------------------------------------------------------------------------- macOS: Core ML itself

COMPUTE_UNITS = ("all", "cpu_and_gpu", "cpu_and_ne")


def coreml_runtime_check(artifact: Path, compute_units=COMPUTE_UNITS, runs: int = 20, min_cosine: float = MIN_COSINE, texts=DEFAULT_TEXTS) -> dict:
    """Load the package with Core ML, compare with PyTorch, and time it per compute unit beside
    PyTorch on MPS. On anything but macOS: {"status": "skipped", ...}, never an error."""
    if sys.platform != "darwin":
        return {"status": "skipped", "reason": "needs macOS: Core ML loads and runs .mlpackage files only on Apple platforms",
                "platform": sys.platform}
    import coremltools as ct

    from ... import devices

    artifact = Path(artifact)
    pkg = _package(artifact)
    record = Manifest.read(artifact).extra.get("coreml") or {}
    tm = build_torch_model(artifact)
    samples, what = sample_inputs(artifact, tm, record.get("seq_len", {"min": 8, "max": 8}), texts, 1)
    x = samples[0]
    feeds = dict(zip(tm.input_names, x))
    with torch.no_grad():
        ref = tm.module(*(torch.from_numpy(a.astype(np.int64)) for a in x)).float().numpy()
    units = {"all": ct.ComputeUnit.ALL, "cpu_and_gpu": ct.ComputeUnit.CPU_AND_GPU, "cpu_and_ne": ct.ComputeUnit.CPU_AND_NE}
    rows = []
    for cu in compute_units:
        row = {"engine": f"coreml:{cu}"}
        try:
            t = time.perf_counter()
            ml = ct.models.MLModel(str(pkg), compute_units=units[cu])
            row["load_s"] = round(time.perf_counter() - t, 3)
            got = np.asarray(ml.predict(feeds)[tm.output_name])
            row.update(compare_outputs(tm.task, got, ref))
            row["ok"] = row["cosine_min"] >= min_cosine
            row["latency_ms"] = round(timing.median_ms(lambda: ml.predict(feeds), repeats=runs), 3)
        except Exception as e:  # one compute unit failing is a result, reported in its row
            row.update({"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
        rows.append(row)
    row = {"engine": "pytorch:mps fp16"}
    if devices.mps_available():
        dev = torch.device("mps")
        mod = tm.module.to(dev, torch.float16)
        xt = tuple(torch.from_numpy(a.astype(np.int64)).to(dev) for a in x)

        def run():
            with torch.no_grad():
                y = mod(*xt)
            devices.synchronize(dev)
            return y

        got = run().float().cpu().numpy()
        row.update(compare_outputs(tm.task, got, ref))
        row["latency_ms"] = round(timing.median_ms(run, repeats=runs), 3)
        row["ok"] = row["cosine_min"] >= min_cosine
    else:
        row.update({"ok": None, "error": "MPS is not available to this torch build"})
    rows.append(row)
    base = next((r["latency_ms"] for r in rows if r["engine"].startswith("pytorch") and "latency_ms" in r), None)
    for r in rows:
        if base and "latency_ms" in r:
            r["speedup_vs_pytorch_mps"] = round(base / r["latency_ms"], 3)
    return {"status": "ran", "reference": REFERENCE_NAME, "inputs": what, "seq_len": int(x[0].shape[1]), "rows": rows,
            "ok": all(r.get("ok") is not False for r in rows)}
