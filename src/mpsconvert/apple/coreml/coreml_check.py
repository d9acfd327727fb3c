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

from ...format import fp8
from ...infra import timing
from .. import compare
from ..compare import DEFAULT_TEXTS, MIN_COSINE, REFERENCE_NAME, compare_outputs, merge_parts, sample_inputs
from ..protocol import package_in
from ..torch_model import build_torch_model, fp8_safetensors_bytes
from .coreml_export import PACKAGE_NAME, e4m3_lut, weight_bytes_of_package

EVALUATOR_NAME = "MIL reference evaluation (numpy, coremltools op definitions): not the Core ML runtime"
_DTYPES = {65568: "fp32", 65552: "fp16", 131104: "int32", 131080: "int8"}


def _package(artifact: Path) -> Path:
    return package_in(artifact, PACKAGE_NAME, "coreml")


# --------------------------------------------------------------------------- spec


def _feature(f) -> dict:
    a = f.type.stateType.arrayType if f.type.WhichOneof("Type") == "stateType" else f.type.multiArrayType
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
        "states": [_feature(f) for f in spec.description.state],
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
    consts_2d = {}
    for op in ops.values():
        if op.op_type == "const" and isinstance(op.outputs[0].val, np.ndarray) and op.outputs[0].val.ndim == 2:
            consts_2d.setdefault(op.outputs[0].val.shape, []).append(op.outputs[0].val)
    for name, enc in record["encoded_tensors"].items():
        q, s = fp8_weights[name]
        if "experts_lut_exponent" in enc:  # fused MoE experts: LUT of e4m3 x 2^-k, row scale x 2^k after the matmul
            k = enc["experts_lut_exponent"]
            want_row = (s.float().reshape(s.shape[0], -1) * 2.0**k).to(torch.float16).numpy()
            s = torch.tensor([2.0**-k])
        codes = q.view(torch.uint8).numpy()
        want16 = fp8.dequantize_tiles(q, s, torch.float16).numpy()
        r: dict = {}
        if record["weights"] == "fp8-lut":
            lut_op = ops.get(enc["lut"])
            if lut_op is None or lut_op.op_type != "constexpr_lut_to_dense":
                rows[name] = {"ok": False, "why": f"op {enc['lut']} not in the package"}
                continue
            idx = np.asarray(lut_op.indices.val)
            lut = np.asarray(lut_op.lut.val).reshape(-1)
            r["indices_bytes"] = int(idx.nbytes)
            r["indices_equal_fp8_codes"] = bool(
                idx.dtype == np.uint8 and idx.shape == codes.shape and np.array_equal(idx, codes)
            )
            if enc.get("lut_blocks"):  # one palette per block: decoded by coremltools' own op definition
                want_lut = (s.numpy().astype(np.float32)[:, :, None] * base[None, None, :]).astype(np.float16)
                if enc.get("transposed"):
                    want_lut, idx = want_lut.transpose(1, 0, 2), idx.T
                    r["indices_equal_fp8_codes"] = bool(
                        idx.dtype == np.uint8 and idx.shape == codes.shape and np.array_equal(idx, codes)
                    )
                want_lut = want_lut.reshape(-1)
                got = np.asarray(lut_op.materialized_val_inference()).astype(np.float16)
                got = got.T if enc.get("transposed") else got
            elif enc["row_scale"] is None:
                want_lut = (base * s.numpy().reshape(())).astype(np.float16)
                got = lut[idx]
            else:
                want_lut = (base * np.float32(2.0 ** -enc["lut_exponent"])).astype(np.float16)
                row_op = ops.get(enc["row_scale"])
                row = np.asarray(row_op.outputs[0].val) if row_op is not None else None
                want_row = (s.numpy().reshape(-1) * np.float32(2.0 ** enc["lut_exponent"])).astype(np.float16)
                r["row_scale_equal"] = bool(row is not None and np.array_equal(row, want_row))
                # The applied weight: LUT value x fp16 row scale (exact in fp32), seen in FP16.
                got = (
                    lut[idx].astype(np.float32) * (row if row is not None else want_row).astype(np.float32)[:, None]
                ).astype(np.float16)
            r["lut_equal_e4m3"] = bool(np.array_equal(lut.view(np.uint16), want_lut.view(np.uint16)))
            r["weights_equal_fp16_dequant"] = float(np.mean(got.view(np.uint16) == want16.view(np.uint16)))
            r["max_ulp_diff"] = _ulp_diff(got, want16)
            # Per-tensor: the decoded weight must be the FP16 dequantization bit for bit. Per-row: the
            # codes, LUT and fp16 row scale are checked bit for bit; the applied weight may then
            # differ from the FP16 dequantization by the row scale's fp16 rounding (<= 1 ulp).
            exact = r["weights_equal_fp16_dequant"] == 1.0 if enc["row_scale"] is None else r["max_ulp_diff"] <= 1
            if "experts_lut_exponent" in enc:
                r["row_scale_equal"] = any(
                    np.array_equal(c.astype(np.float16), want_row) for c in consts_2d.get(want_row.shape, [])
                )
            r["ok"] = bool(
                r["indices_equal_fp8_codes"] and r["lut_equal_e4m3"] and r.get("row_scale_equal", True) and exact
            )
        else:
            cand = [
                op
                for n, op in ops.items()
                if n == enc["op"] or (n.startswith(enc["op"]) and op.op_type.startswith("constexpr_"))
            ]
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
            r["sqnr_db_vs_fp8"] = (
                None if not np.any(err) else round(float(10 * np.log10(sig / float(np.sum(err**2)))), 2)
            )
            r["ok"] = bool(
                r["weights_equal_fp16_dequant"] == 1.0
                if record["weights"] == "fp16"
                else r["sqnr_db_vs_fp8"] is None or r["sqnr_db_vs_fp8"] > 30
            )
        rows[name] = r
    missing = sorted(set(fp8_weights) - set(record["encoded_tensors"]))
    return {
        "tensors": rows,
        "checked": len(rows),
        "missing": missing,
        "all_ok": not missing and all(r.get("ok") for r in rows.values()),
        "codes_bit_exact": all(r.get("indices_equal_fp8_codes", False) for r in rows.values())
        if record["weights"] == "fp8-lut"
        else None,
        "min_fraction_equal_fp16_dequant": min(
            (r.get("weights_equal_fp16_dequant", 0.0) for r in rows.values()), default=None
        ),
        "max_ulp_diff": max((r["max_ulp_diff"] for r in rows.values() if "max_ulp_diff" in r), default=None),
    }


# --------------------------------------------------------------------------- reference evaluation


def reference_eval(prog, tm, samples) -> dict:
    from . import mil_eval

    parts, how = [], Counter()
    for x in samples:
        outs, h = mil_eval.evaluate(prog, dict(zip(tm.input_names, x)))
        how.update(h)
        with torch.no_grad():
            ref = tm.module(*(torch.from_numpy(a.astype(np.int64)) for a in x)).float().numpy()
        parts.append(compare_outputs(tm.task, outs[tm.output_name], ref))
    res = merge_parts(tm.task, parts)
    res["evaluator"] = EVALUATOR_NAME
    res["reference"] = REFERENCE_NAME
    res["ops_by_implementation"] = {
        "coremltools": sum(v for k, v in how.items() if k.startswith("coremltools:")),
        "mpsconvert": sorted({k.split(":", 1)[1] for k in how if k.startswith("mpsconvert:")}),
    }
    return res


def mil_decoder(prog, how: Counter | None = None):
    """`new_conversation()` for compare.check_decoder over the reference evaluator: states are
    numpy arrays kept between calls, decoded weights are kept for the whole check."""
    from . import mil_eval

    cache: dict = {}
    how = how if how is not None else Counter()
    declared = mil_eval.state_inputs(prog)
    max_len = min(shape[2] for shape, _ in declared.values())

    def run(inputs: dict, states) -> dict:
        outs, h = mil_eval.evaluate(prog, inputs, states=states, cache=cache)
        how.update(h)
        return outs

    return compare.stateful_runner(lambda: mil_eval.new_states(prog), run, max_len)


def reference_decode(
    prog,
    tm,
    artifact: Path,
    max_len: int,
    decode: compare.DecodeCheck,
    progress=None,
) -> dict:
    """The stateful package through the reference evaluator: prefill, teacher-forced decode
    through its states and greedy generation against PyTorch (compare.DecodeCheck)."""
    how: Counter = Counter()
    res = decode.run(mil_decoder(prog, how), artifact, tm, max_len, progress)
    return res | {
        "evaluator": EVALUATOR_NAME,
        "reference": REFERENCE_NAME,
        "ops_by_implementation": {
            "coremltools": sum(v for k, v in how.items() if k.startswith("coremltools:")),
            "mpsconvert": sorted({k.split(":", 1)[1] for k in how if k.startswith("mpsconvert:")}),
        },
    }


def check_package(
    artifact: Path,
    record: dict,
    texts=None,
    n_samples: int = 3,
    evaluate: bool = True,
    prompt_len: int = compare.PROMPT_LEN,
    steps: int = 16,
    generate: int = compare.GENERATE,
    progress=None,
) -> dict:
    """Every check that needs no Apple hardware of the package in `artifact` that `record` (the
    manifest's `coreml` record) describes. Returns a dict (recorded, slimmed, by apple/flow.py).

    Stateful decoders: prefill + `steps` teacher-forced decode steps + `generate` greedy tokens
    through the reference evaluator; stateless packages and encoders: `n_samples` one-pass samples."""
    from . import mil_eval

    artifact = Path(artifact)
    pkg = _package(artifact)
    prog, spec = mil_eval.load_program(pkg)
    tm = build_torch_model(artifact)
    res = {
        "package": PACKAGE_NAME,
        "spec": spec_summary(spec, prog),
        "weight_bytes": weight_bytes_of_package(pkg),
        "fp8_safetensors_bytes": fp8_safetensors_bytes(artifact),
        "weights": check_weights(
            prog, record, {**tm.fp8_weights, **{n: (c, sc) for n, (c, sc, _) in tm.fp8_experts.items()}}
        ),
    }
    res["size_ratio"] = round(res["weight_bytes"] / res["fp8_safetensors_bytes"], 4)
    if evaluate and record.get("kv_cache"):
        decode = compare.DecodeCheck(prompt_len, steps, generate, texts)
        res["reference_eval"] = reference_decode(prog, tm, artifact, record["max_len"], decode, progress)
    elif evaluate:
        samples, what = sample_inputs(artifact, tm, record["seq_len"], texts or DEFAULT_TEXTS, n_samples)
        res["reference_eval"] = reference_eval(prog, tm, samples) | {"inputs": what}
    res["ok"] = res["weights"]["all_ok"] and res.get("reference_eval", {}).get("ok", True)
    return res


# --------------------------------------------------------------------------- macOS: Core ML itself

COMPUTE_UNITS = ("all", "cpu_and_gpu", "cpu_and_ne")
_UNIT_NAMES = {"all": "ALL", "cpu_and_gpu": "CPU_AND_GPU", "cpu_and_ne": "CPU_AND_NE", "cpu_only": "CPU_ONLY"}


def coreml_decoder(ml):
    """`new_conversation()` over a loaded stateful MLModel: `make_state()` per conversation,
    `predict(inputs, state=state)` per call (the Core ML API for iOS18 / macOS15 states)."""
    return compare.stateful_runner(ml.make_state, lambda inputs, state: ml.predict(inputs, state=state))


def _load(ct, pkg: Path, unit: str, row: dict):
    """The package loaded by Core ML for one compute unit; the load time goes into `row`."""
    t = time.perf_counter()
    ml = ct.models.MLModel(str(pkg), compute_units=getattr(ct.ComputeUnit, _UNIT_NAMES[unit]))
    row["load_s"] = round(time.perf_counter() - t, 3)
    return ml


def _unit_failed(row: dict, e: Exception) -> None:
    row.update({"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})


def _mps_row(tm, fn) -> dict:
    from ...infra import devices

    if not devices.mps_available():
        return {"engine": "pytorch:mps fp16", "ok": None, "error": "MPS is not available to this torch build"}
    return {"engine": "pytorch:mps fp16", **fn()}


def _unit_rows(ct, pkg: Path, compute_units, measure) -> list[dict]:
    """A row per compute unit: the package loaded with it, then `measure(model, row)` fills the
    row; one unit failing is a result, reported in its row."""
    rows = []
    for cu in compute_units:
        row = {"engine": f"coreml:{cu}"}
        try:
            measure(_load(ct, pkg, cu, row), row)
        except Exception as e:
            _unit_failed(row, e)
        rows.append(row)
    return rows


def coreml_runtime_check(
    artifact: Path,
    record: dict,
    compute_units=COMPUTE_UNITS,
    runs: int = 20,
    min_cosine: float = MIN_COSINE,
    texts=None,
    prefill_len: int = 64,
    decode_tokens: int = 16,
    platform: str = sys.platform,
    ct=None,
) -> dict:
    """Load the package with Core ML, compare with PyTorch, and time it per compute unit beside
    PyTorch on MPS. Stateful decoders: prefill of `prefill_len` tokens and `decode_tokens`
    single-token steps through `make_state()` states (median / p95, tokens/s), checked with
    compare.check_decoder; stateless packages: one predict. On anything but macOS:
    {"status": "skipped", ...}, never an error. `ct` is coremltools (a fake in tests)."""
    if platform != "darwin":
        return {
            "status": "skipped",
            "reason": "needs macOS: Core ML loads and runs .mlpackage files only on Apple platforms",
            "platform": platform,
        }
    if ct is None:
        import coremltools as ct

    artifact = Path(artifact)
    pkg = _package(artifact)
    tm = build_torch_model(artifact)
    if record.get("kv_cache"):
        prompt, steps = compare.fit_to_cache(prefill_len, decode_tokens, 2, record["max_len"])
        ids, what = compare.prompt_ids(artifact, tm, prompt + steps, texts)

        def decoder(ml, row):
            acc = compare.check_decoder(coreml_decoder(ml), tm, ids, prompt, steps, generate=2)
            row.update(
                {
                    "prefill_top1": acc["prefill"]["top1_agreement"],
                    "decode_top1": acc["decode"]["top1_agreement"],
                    "cosine_min": min(acc["prefill"]["cosine_min"], acc["decode"]["cosine_min"]),
                    "ok": acc["ok"],
                }
            )
            run = compare.runner(coreml_decoder(ml), "coreml")
            row.update(compare.decode_timing(run, ids[:prompt], steps, warmup=2))

        rows = _unit_rows(ct, pkg, compute_units, decoder)
        rows.append(
            _mps_row(
                tm,
                lambda: compare.decode_timing(compare.torch_decoder(tm, "mps", torch.float16), ids[:prompt], steps, 2),
            )
        )
        base = next(
            (
                r.get("decode_tokens_per_s")
                for r in rows
                if r["engine"].startswith("pytorch") and r.get("decode_tokens_per_s")
            ),
            None,
        )
        for r in rows:
            if base and r.get("decode_tokens_per_s"):
                r["decode_vs_pytorch_mps"] = round(r["decode_tokens_per_s"] / base, 3)
        return {
            "status": "ran",
            "kind": "stateful decoder",
            "reference": REFERENCE_NAME,
            "inputs": what,
            "prefill_tokens": prompt,
            "decode_tokens": steps,
            "rows": rows,
            "ok": all(r.get("ok") is not False for r in rows),
        }
    samples, what = sample_inputs(artifact, tm, record.get("seq_len", {"min": 8, "max": 8}), texts or DEFAULT_TEXTS, 1)
    x = samples[0]
    feeds = dict(zip(tm.input_names, x))
    with torch.no_grad():
        ref = tm.module(*(torch.from_numpy(a.astype(np.int64)) for a in x)).float().numpy()

    def one_pass(ml, row):
        got = np.asarray(ml.predict(feeds)[tm.output_name])
        row.update(compare_outputs(tm.task, got, ref))
        row["ok"] = row["cosine_min"] >= min_cosine
        row["latency_ms"] = round(timing.median_ms(lambda: ml.predict(feeds), repeats=runs), 3)

    rows = _unit_rows(ct, pkg, compute_units, one_pass)

    def mps():
        dev = torch.device("mps")
        mod = tm.module.to(dev, torch.float16)
        xt = tuple(torch.from_numpy(a.astype(np.int64)).to(dev) for a in x)

        def run():
            with torch.no_grad():
                return mod(*xt)

        got = run().float().cpu().numpy()
        r = compare_outputs(tm.task, got, ref)
        r["latency_ms"] = round(timing.median_ms(run, device=dev, repeats=runs), 3)
        r["ok"] = r["cosine_min"] >= min_cosine
        return r

    rows.append(_mps_row(tm, mps))
    base = next((r["latency_ms"] for r in rows if r["engine"].startswith("pytorch") and "latency_ms" in r), None)
    for r in rows:
        if base and "latency_ms" in r:
            r["speedup_vs_pytorch_mps"] = round(base / r["latency_ms"], 3)
    return {
        "status": "ran",
        "kind": "one pass",
        "reference": REFERENCE_NAME,
        "inputs": what,
        "seq_len": int(x[0].shape[1]),
        "rows": rows,
        "ok": all(r.get("ok") is not False for r in rows),
    }
