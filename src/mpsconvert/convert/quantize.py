"""The data-free pipeline: snapshot -> plan -> shard-by-shard FP8 writer -> artifact + manifest.

Memory stays near one tensor: each source shard is read tensor by tensor in file order (hashed
as it passes), each tensor is quantized or copied byte for byte, and written straight into the
matching output shard. The artifact folder is built under a temporary name and renamed at the end.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import atomic
from ..errors import QuantizationError, SourceError
from ..manifests.ct_config import quantization_config
from ..manifests.hashing import sha256_file
from ..manifests.manifest import Manifest
from ..manifests.schemes import Scheme
from ..safetensors_io import ShardReader, ShardWriter, TensorInfo, as_tensor, read_header
from ..source import Snapshot
from . import fp8
from .targets import Plan, plan_for

INDEX_NAME = "model.safetensors.index.json"
Progress = Callable[[int, str], None]  # (bytes done since last call, tensor name)


@dataclass
class Options:
    scheme: Scheme = field(default_factory=Scheme)
    ignore: list[str] = field(default_factory=list)
    force: bool = False
    trust_remote_code: bool = False
    # Static activation scales (module -> dequant scale), required by the "fp8" scheme.
    input_scales: dict[str, float] | None = None
    calibration: dict | None = None  # what produced input_scales, for the manifest
    device: str = "cpu"


def output_shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _finalize_plan(plan: Plan, headers: dict) -> dict[str, str]:
    """tensor name -> module, for the quantized Linears actually present in the checkpoint.

    A planned Linear whose weight is not stored (tied, or saved under another key) is moved to
    the ignore list, so loaders never expect scales that do not exist.
    """
    found: dict[str, str] = {}
    for h in headers.values():
        for name, info in h.tensors.items():
            mod = plan.module_for_tensor(name)
            if mod is not None and len(info.shape) == 2 and info.dtype in ("F32", "F16", "BF16"):
                found[name] = mod
    present = set(found.values())
    for mod in list(plan.quantize):
        if mod not in present:
            del plan.quantize[mod]
            plan.ignored[mod] = "no float 2-D weight stored under this module's name in the checkpoint: kept as is"
    return found


def check_tensor_layout(snap: Snapshot, headers: dict) -> None:
    """No tensor stored twice, and the index (if any) agrees with what the shards hold."""
    seen: dict[str, str] = {}
    for f, h in headers.items():
        for name in h.tensors:
            if name in seen:
                raise SourceError(f"tensor {name!r} is stored in both {seen[name]} and {f}", "the checkpoint is corrupt; re-download it")
            seen[name] = f
    if snap.weight_map:
        for name, f in snap.weight_map.items():
            if seen.get(name) != f:
                where = f"in {seen[name]}" if name in seen else "in no shard"
                raise SourceError(f"{INDEX_NAME} puts {name!r} in {f}, but it is {where}", "the checkpoint is corrupt; re-download it")
        extra = sorted(set(seen) - set(snap.weight_map))
        if extra:
            raise SourceError(f"{len(extra)} stored tensors are missing from {INDEX_NAME} (e.g. {extra[0]!r})", "the checkpoint is corrupt; re-download it")


def estimate_output_bytes(headers: dict, tensor_module: dict, scheme: Scheme) -> int:
    """Bytes the artifact will take: FP8 weights, their scales, copied tensors, plus slack."""
    total = 1 << 20
    for h in headers.values():
        for name, info in h.tensors.items():
            if name in tensor_module:
                total += math.prod(info.shape) + 4 * info.shape[0] + 8  # 1-byte codes + F32 scales
            else:
                total += info.nbytes
        total += h.data_start
    return total


def quantize_snapshot(snap: Snapshot, out: Path, opts: Options, progress: Progress | None = None) -> Manifest:
    scheme = opts.scheme
    plan = plan_for(snap.path, opts.ignore, opts.trust_remote_code)
    headers = {f: read_header(snap.path / f) for f in snap.weight_files}
    check_tensor_layout(snap, headers)
    tensor_module = _finalize_plan(plan, headers)
    if scheme.needs_calibration:
        missing = sorted(set(tensor_module.values()) - set(opts.input_scales or {}))
        if missing:
            raise QuantizationError(
                f"scheme fp8 needs a calibrated input scale for every quantized Linear; {len(missing)} have none (e.g. {missing[0]})",
                "run calibration (`mpsconvert quantize --scheme fp8 --calib-data ...` or `mpsconvert calibrate`)",
            )
    progress = progress or (lambda n, name: None)
    names = output_shard_names(len(snap.weight_files))
    tensors: dict[str, dict] = {}
    weight_map: dict[str, str] = {}
    source_files: dict[str, str] = {}
    files: dict[str, dict] = {}
    total_in = total_out = 0

    with atomic.output_dir(out, force=opts.force, min_free=estimate_output_bytes(headers, tensor_module, scheme)) as tmp:
        for src_name, out_name in zip(snap.weight_files, names):
            header = headers[src_name]
            entries = []
            for name, info in header.tensors.items():
                if name in tensor_module:
                    entries.append((name, "F8_E4M3", info.shape))
                    scale_shape = (1,) if scheme.weights == "tensor" else (info.shape[0], 1)
                    entries.append((name + "_scale", "F32", scale_shape))
                    if scheme.needs_calibration:
                        entries.append((name[: -len("weight")] + "input_scale", "F32", (1,)))
                else:
                    entries.append((name, info.dtype, info.shape))
            writer = ShardWriter(tmp / out_name, entries, metadata={"format": "pt"})
            try:
                with ShardReader(header) as reader:
                    for name, info in header.tensors.items():
                        buf = reader.read(info)
                        if name in tensor_module:
                            tensors.update(_quantize_one(writer, name, info, buf, tensor_module[name], scheme, opts))
                        else:
                            writer.write(name, buf)
                        del buf
                        progress(info.nbytes, name)
                    source_files[src_name] = snap.known_sha256(src_name) or reader.sha256()
                digest = writer.close()
            except BaseException:
                writer.abort()
                raise
            for name, *_ in entries:
                weight_map[name] = out_name
            size = (tmp / out_name).stat().st_size
            files[out_name] = {"sha256": digest, "size": size}
            total_in += header.file_size
            total_out += size

        if len(names) > 1:
            index = {"metadata": {"total_size": sum(files[n]["size"] for n in names)}, "weight_map": dict(sorted(weight_map.items()))}
            atomic.write_text(tmp / INDEX_NAME, json.dumps(index, indent=2) + "\n")
            files[INDEX_NAME] = {"sha256": sha256_file(tmp / INDEX_NAME), "size": (tmp / INDEX_NAME).stat().st_size}

        config = dict(snap.config)
        ignore = sorted(plan.ignored)
        config["quantization_config"] = quantization_config(scheme, ignore)
        atomic.write_text(tmp / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
        files["config.json"] = {"sha256": sha256_file(tmp / "config.json"), "size": (tmp / "config.json").stat().st_size}
        source_files["config.json"] = sha256_file(snap.path / "config.json")
        for rel in snap.copy_files():
            dst = tmp / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(snap.path / rel, dst)
            digest = sha256_file(dst)
            files[rel] = {"sha256": digest, "size": dst.stat().st_size}
            source_files[rel] = digest

        manifest = Manifest(
            source=snap.as_dict() | {"files": dict(sorted(source_files.items()))},
            recipe={
                **scheme.as_dict(),
                "format": "compressed-tensors/float-quantized",
                "fp8_dtype": "float8_e4m3fn",
                "scale": "amax / 448 (dequant multiplier), floor %g, clamp to +-448 before the cast" % fp8.SCALE_FLOOR,
                "ignore_patterns": list(opts.ignore),
                "ignored_modules": dict(sorted(plan.ignored.items())),
                "calibration": opts.calibration,
            },
            tensors=dict(sorted(tensors.items())),
            skipped=dict(sorted(plan.skipped.items())),
            files=dict(sorted(files.items())),
            device=opts.device,
        )
        manifest.summary = summarize(manifest, plan, total_in, total_out)
        manifest.write(tmp)
    return manifest


def _quantize_one(writer: ShardWriter, name: str, info: TensorInfo, buf, module: str, scheme: Scheme, opts: Options) -> dict:
    w = as_tensor(buf, info)
    q, scale, stats = fp8.quantize(w, scheme.weights, name=name)
    writer.write(name, q)
    writer.write(name + "_scale", scale.contiguous())
    record = {
        "module": module,
        "shape": list(info.shape),
        "source_dtype": info.dtype,
        "dtype": "F8_E4M3",
        "weight_scale_shape": list(scale.shape),
        **stats.as_dict(),
    }
    if scheme.needs_calibration:
        s = float(opts.input_scales[module])
        if not (math.isfinite(s) and s > 0):
            raise QuantizationError(f"calibrated input scale of {module} is {s}", "re-run calibration")
        writer.write(name[: -len("weight")] + "input_scale", torch.tensor([s], dtype=torch.float32))
        record["input_scale"] = s
    return {name: record}


def summarize(manifest: Manifest, plan: Plan, bytes_in: int, bytes_out: int) -> dict:
    worst = None
    for name, rec in manifest.tensors.items():
        s = rec.get("sqnr_db")
        if s is not None and (worst is None or s < worst[1]):
            worst = (name, s)
    return {
        "architecture": plan.architecture,
        "weight_bytes_before": bytes_in,
        "weight_bytes_after": bytes_out,
        "ratio": round(bytes_out / bytes_in, 4) if bytes_in else None,
        "tensors_quantized": len(manifest.tensors),
        "linear_ignored": len(plan.ignored),
        "modules_skipped": len(plan.skipped),
        "worst_sqnr_db": None if worst is None else worst[1],
        "worst_sqnr_tensor": None if worst is None else worst[0],
    }
