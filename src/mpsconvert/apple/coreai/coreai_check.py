"""Checks of an exported `model.aimodel`, run with the Core AI runtime that coreai-core bundles.

`check_asset` (any platform with the wheel: Linux x86_64 included):
- the interface: function `main`, its inputs, outputs and states as the decoder contract says;
- storage: the asset's own summary (`AIModelAsset.summary().storage_types`) lists f8E4M3FN, as
  many values as the artifact has FP8 weights, and the asset's size against the FP8 safetensors;
- weights read back: every f8E4M3FN constant of the saved program is compared byte for byte
  with the artifact's codes, and the scale that feeds it with the artifact's scale;
- the runtime's outputs against PyTorch on the same dequantized weights (`compare.py`):
  decoders prefill + teacher-forced decode + greedy generation, encoders the embeddings. These
  run on "Core AI runtime, Linux CPU" on Linux (the label says which ran).

`coreai_latency` is the latency part for `validate`: decode tokens/s and prefill time of the
asset beside PyTorch on the CPU (Linux), or per compute unit (macOS 27+, the OS runtime).
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import numpy as np
import torch

from .. import compare, stateful
from ..protocol import package_in
from ..torch_model import build_torch_model, fp8_safetensors_bytes
from . import RUNTIME_LABEL
from .coreai_export import ASSET_NAME, TORCH_DTYPES, asset_bytes, storage_summary
from .session import Session, coreai, quiet
from .weights import blockwise_scale

_NP_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": None}


def runtime_label(unit: str | None = None, platform: str = sys.platform) -> str:
    if unit is not None:
        return f"Core AI runtime, {unit} (macOS)"
    return RUNTIME_LABEL if platform.startswith("linux") else f"Core AI runtime bundled in coreai-core ({platform})"


def _asset(artifact: Path) -> Path:
    return package_in(artifact, ASSET_NAME, "coreai")


# --------------------------------------------------------------------------- interface


def check_interface(record: dict, tm, max_len: int) -> dict:
    """The asset's function against the contract (stateful decoder or encoder embeddings)."""
    iface = record["interface"]
    got = {kind: {e["name"]: (e["dtype"], e["shape"]) for e in iface[kind]} for kind in ("inputs", "outputs", "states")}
    problems = []
    if tm.task == "causal-lm":
        vocab = int(tm.config.vocab_size)
        want_in = {"input_ids": ("int32", [1, None]), "position": ("int32", [1])}
        want_out = {stateful.OUTPUT_NAME: (None, [1, None, vocab])}
        names = [e["name"] for e in iface["states"]]
        if names != stateful.state_names(len(names) // 2) or not names:
            problems.append(f"states are {names[:4]}..., not key_cache_i / value_cache_i for every layer")
        for n, (_, shape) in got["states"].items():
            if len(shape) != 4 or shape[0] != 1 or shape[2] != max_len:
                problems.append(f"state {n} has shape {shape}, not [1, kv_heads, {max_len}, head_dim]")
    else:
        want_in = {n: ("int32", [1, None]) for n in tm.input_names}
        want_out = {tm.output_name: (None, [1, int(tm.config.hidden_size)])}
        if got["states"]:
            problems.append("an encoder asset has states")
    for kind, want in (("inputs", want_in), ("outputs", want_out)):
        if list(got[kind]) != list(want):
            problems.append(f"{kind} are {list(got[kind])}, not {list(want)}")
            continue
        for n, (dt, shape) in want.items():
            gdt, gshape = got[kind][n]
            if (dt and gdt != dt) or gshape != shape:
                problems.append(f"{kind[:-1]} {n} is {gdt} {gshape}, not {dt or 'float'} {shape}")
    return {"ok": not problems, "problems": problems, "states": len(got["states"])}


# --------------------------------------------------------------------------- weights read back


_CONST = re.compile(r"^\s*(%\w+) = coreai\.constant (dense_resource<(\w+)>|dense<(.*?)>) : tensor<([^>]*)>\s*$")
_BSS = re.compile(r"^\s*%\w+ = coreai\.blockwise_shift_scale (%\w+), (%\w+),")
_RESOURCE = re.compile(r'^\s*(\w+): "0x([0-9A-Fa-f]*)"')


def _tensor_type(text: str) -> tuple[list[int], str]:
    *dims, dt = text.split("x")
    return [int(d) for d in dims], dt


def _dense_values(body: str, shape: list[int], dt: str) -> np.ndarray | None:
    """The values of a printed `dense<...>` attribute (hex blob, nested list or splat)."""
    np_dt = _NP_DTYPES.get(dt)
    if np_dt is None:
        return None
    if body.startswith('"0x'):
        return np.frombuffer(bytes.fromhex(body[3:-1]), dtype=np_dt).reshape(shape)
    nums = re.findall(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan", body)
    vals = np.array([float(x) for x in nums], dtype=np.float64).astype(np_dt)
    return np.full(shape, vals[0], dtype=np_dt) if vals.size == 1 else vals.reshape(shape)


def read_fp8_constants(asset_dir: Path) -> list[dict]:
    """Every f8E4M3FN constant of the saved program: its bytes (as stored, from the program's
    resource blobs) and the scale constant that dequantizes it (blockwise_shift_scale's operand)."""
    coreai()
    from coreai.authoring import AIModelAsset

    text = AIModelAsset.load(Path(asset_dir)).program._module.as_string()
    consts: dict[str, dict] = {}
    scale_of: dict[str, str] = {}
    blobs: dict[str, bytes] = {}
    in_resources = False
    for line in text.splitlines():
        if in_resources:
            m = _RESOURCE.match(line)
            if m:
                raw = bytes.fromhex(m.group(2))
                blobs[m.group(1)] = raw[4:]  # the blob's first 4 bytes are its alignment
            continue
        if "dialect_resources" in line:
            in_resources = True
            continue
        m = _CONST.match(line)
        if m:
            shape, dt = _tensor_type(m.group(5))
            consts[m.group(1)] = {"resource": m.group(3), "dense": m.group(4), "shape": shape, "dtype": dt}
            continue
        m = _BSS.match(line)
        if m:
            scale_of[m.group(1)] = m.group(2)
    out = []
    for var, c in consts.items():
        if c["dtype"] != "f8E4M3FN" or c["resource"] is None or var not in scale_of:
            continue
        s = consts.get(scale_of[var])
        scale = None
        if s and s["dense"] is not None:
            scale = _dense_values(s["dense"], s["shape"], s["dtype"])
        elif (
            s and s["resource"] in blobs and _NP_DTYPES.get(s["dtype"]) is not None
        ):  # a large scale is a resource blob too
            scale = np.frombuffer(blobs[s["resource"]], dtype=_NP_DTYPES[s["dtype"]]).reshape(s["shape"])
        out.append(
            {
                "shape": c["shape"],
                "bytes": blobs.get(c["resource"], b""),
                "scale": scale,
                "scale_dtype": s["dtype"] if s else None,
            }
        )
    return out


def check_weights(asset_dir: Path, tm, record: dict) -> dict:
    """Each FP8 weight of the artifact must be one f8E4M3FN constant of the asset with exactly its
    bytes, dequantized with exactly its scale (in the stored layout and dtype, times 2**shift)."""
    found = read_fp8_constants(asset_dir)
    by_digest: dict[tuple, list[dict]] = {}
    for c in found:
        by_digest.setdefault((tuple(c["shape"]), hashlib.sha256(c["bytes"]).hexdigest()), []).append(c)
    dtype = TORCH_DTYPES[record["compute"]]
    rows = {}
    tensors = {**tm.fp8_weights, **{n: (c, s) for n, (c, s, _) in tm.fp8_experts.items()}}
    for name, (codes, scale) in tensors.items():
        enc = record["encoded_tensors"].get(name, {})
        key = (tuple(codes.shape), hashlib.sha256(codes.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
        cands = by_digest.get(key, [])
        want = (blockwise_scale(scale.float(), tuple(codes.shape)) * 2.0 ** enc.get("fp16_shift", 0)).to(dtype).numpy()
        scale_ok = any(
            c["scale"] is not None and c["scale"].shape == want.shape and c["scale"].tobytes() == want.tobytes()
            for c in cands
        )
        rows[name] = {"codes_equal": bool(cands), "scale_equal": scale_ok, "ok": bool(cands) and scale_ok}
    n_values = sum(int(c.numel()) for c, _ in tensors.values())
    stored = record.get("storage", {}).get("storage_types", {})
    return {
        "tensors": rows,
        "checked": len(rows),
        "fp8_constants_in_asset": len(found),
        "fp8_values_in_artifact": n_values,
        "f8E4M3FN_values_stored": stored.get("Float8E4M3FN", 0),
        "codes_bit_exact": all(r["codes_equal"] for r in rows.values()),
        "scales_exact": all(r["scale_equal"] for r in rows.values()),
        "all_ok": all(r["ok"] for r in rows.values()) and stored.get("Float8E4M3FN", 0) >= n_values,
    }


# --------------------------------------------------------------------------- the runtime


def decoder_runner(session: Session):
    """`new_conversation()` for compare.check_decoder over a Core AI session."""

    shapes = [shape for _, shape in session.signature["states"].values()]
    return compare.stateful_runner(
        session.new_state,
        session.run,
        min(shape[2] for shape in shapes) if shapes else 0,
        fix="re-export with a larger `max_len`, or use fewer tokens",
    )


def runtime_eval(
    artifact: Path,
    tm,
    max_len: int,
    decode: compare.DecodeCheck,
    unit: str | None = None,
    samples: int = 3,
    progress=None,
) -> dict:
    """Run the asset with the Core AI runtime and compare it with PyTorch (see compare.py):
    a decoder through `decode`, an encoder on `samples` one-pass samples."""
    with quiet():
        session = Session(_asset(artifact), unit=unit)
    with session:
        if tm.task == "causal-lm":
            res = decode.run(decoder_runner(session), artifact, tm, max_len, progress)
        else:
            hi = min(max_len, 64)
            xs, what = compare.sample_inputs(artifact, tm, {"min": 1, "max": hi}, n=samples)
            parts = []
            for x in xs:
                got = session.run(dict(zip(tm.input_names, x)))[tm.output_name]
                with torch.no_grad():
                    ref = tm.module(*(torch.from_numpy(a.astype(np.int64)) for a in x)).float().numpy()
                parts.append(compare.compare_outputs(tm.task, got, ref))
            res = compare.merge_parts(tm.task, parts) | {"inputs": what}
    return res | {"runtime": runtime_label(unit), "reference": compare.REFERENCE_NAME}


def check_asset(
    artifact: Path,
    record: dict,
    texts=None,
    prompt_len: int = compare.PROMPT_LEN,
    steps: int = compare.DECODE_STEPS,
    generate: int = compare.GENERATE,
    samples: int = 3,
    evaluate: bool = True,
    progress=None,
) -> dict:
    """Every check that needs no Apple hardware of the asset in `artifact` that `record` (the
    manifest's `coreai` record) describes. Returns a dict (recorded, slimmed, by apple/flow.py)."""
    artifact = Path(artifact)
    asset = _asset(artifact)
    tm = build_torch_model(artifact)
    res = {
        "asset": ASSET_NAME,
        "interface": check_interface(record, tm, record["max_len"]),
        "storage": storage_summary(asset),
        "asset_bytes": asset_bytes(asset),
        "fp8_safetensors_bytes": fp8_safetensors_bytes(artifact),
    }
    res["size_ratio"] = round(res["asset_bytes"] / res["fp8_safetensors_bytes"], 4)
    res["weights"] = check_weights(asset, tm, {**record, "storage": res["storage"]})
    if evaluate:
        decode = compare.DecodeCheck(prompt_len, steps, generate, texts)
        res["runtime_eval"] = runtime_eval(artifact, tm, record["max_len"], decode, samples=samples, progress=progress)
    res["ok"] = bool(
        res["interface"]["ok"] and res["weights"]["all_ok"] and res.get("runtime_eval", {}).get("ok", True)
    )
    return res


# --------------------------------------------------------------------------- latency (validate)


def coreai_latency(
    artifact: Path,
    record: dict,
    prefill_len: int = 64,
    decode_tokens: int = 16,
    warmup: int = 2,
    units=None,
    platform: str = sys.platform,
    texts=None,
    prefill_repeats: int = 3,
) -> dict:
    """Prefill time and decode tokens/s of the asset beside PyTorch on the CPU, same prompt, same
    number of tokens (compare.decode_timing). Linux: the bundled CPU runtime (labelled). macOS: one row per compute unit
    (`units`, default cpu / gpu / neural_engine) through the OS runtime; a unit that fails is a
    row with its error. Encoders and assets without a stateful decoder: skipped, with why."""
    artifact = Path(artifact)
    rec = record
    if rec.get("task") != "causal-lm":
        return {"status": "skipped", "reason": "latency is measured for stateful decoders (causal LMs)"}
    _asset(artifact)
    tm = build_torch_model(artifact)
    if prefill_len + decode_tokens + warmup > rec["max_len"]:
        prefill_len = max(1, rec["max_len"] - decode_tokens - warmup)
    ids, what = compare.prompt_ids(artifact, tm, prefill_len, texts)
    rows = []
    for unit in list(units or ("cpu", "gpu", "neural_engine")) if platform == "darwin" else [None]:
        row = {"engine": runtime_label(unit, platform)}
        try:
            with quiet():
                session = Session(_asset(artifact), unit=unit)
            with session:
                row.update(
                    compare.decode_timing(
                        compare.runner(decoder_runner(session), "coreai"), ids, decode_tokens, warmup, prefill_repeats
                    )
                )
        except Exception as e:  # one compute unit failing is a result, reported in its row
            row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        rows.append(row)
    torch_row = {
        "engine": f"PyTorch {torch.__version__} CPU, fp32 (dequantized weights, the runtime engine eager "
        "over a DynamicCache)",
        **compare.decode_timing(compare.torch_decoder(tm), ids, decode_tokens, warmup, prefill_repeats),
    }
    rows.append(torch_row)
    for r in rows:
        if "decode_tokens_per_s" in r:
            r["decode_vs_pytorch_cpu"] = round(r["decode_tokens_per_s"] / torch_row["decode_tokens_per_s"], 4)
    return {"status": "ran", "inputs": what, "threads": torch.get_num_threads(), "rows": rows}
