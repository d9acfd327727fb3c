"""The last step of a conversion: everything in the artifact that is not a weight shard.

Once the shards are written (convert/quantize.py), the artifact gets the shard index, the
source's config.json with our compressed-tensors `quantization_config`, the tokenizer and other
non-weight files copied as they are, and the manifest that records all of it with sha256s.
Kept apart from the streaming writer because it is the part every artifact-producing path
shares and the part a reader checks first.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..format import fp8
from ..format.ct_config import quantization_config
from ..infra import atomic
from ..manifests import card, engines
from ..manifests.hashing import sha256_file
from ..manifests.layout import CONFIG_NAME, INDEX_NAME
from ..manifests.manifest import Manifest
from ..manifests.records import Experts
from ..manifests.transaction import finish
from ..model.plan import Plan
from ..source.snapshot import Snapshot


@dataclass
class Shards:
    """What the streaming writer produced: files, where each tensor went, and the records."""

    files: dict[str, dict] = field(default_factory=dict)  # shard -> {"sha256", "size"}
    weight_map: dict[str, str] = field(default_factory=dict)  # tensor -> shard
    tensors: dict[str, dict] = field(default_factory=dict)  # quantized tensor -> manifest record
    bytes_in: int = 0
    bytes_out: int = 0
    write_modes: set = field(default_factory=set)  # how the shards reached the disk
    plan_source: str | None = None  # how the tensors to quantize were known while writing (convert/guess.py)


def _record_file(files: dict, folder: Path, rel: str) -> str:
    digest = sha256_file(folder / rel)
    files[rel] = {"sha256": digest, "size": (folder / rel).stat().st_size}
    return digest


def write_index(shards: Shards, tmp: Path, rel: str, files: dict) -> None:
    """The weights' index (`rel` inside `tmp`: total size, tensor -> file) when they are in more
    than one file, recorded in `files`."""
    if len(shards.files) > 1:
        index = {
            "metadata": {"total_size": sum(f["size"] for f in shards.files.values())},
            "weight_map": dict(sorted(shards.weight_map.items())),
        }
        atomic.write_text(tmp / rel, json.dumps(index, indent=2) + "\n")
        _record_file(files, tmp, rel)


def assemble(tmp: Path, snap: Snapshot, plan: Plan, opts, shards: Shards, name: str) -> Manifest:
    """Write the index, config, copied files, model card and manifest of the artifact being
    built in `tmp`, to be published as the folder `name`."""
    scheme = opts.scheme
    files = dict(shards.files)
    source_files = snap.source_files()  # hashed on the snapshot's thread meanwhile
    write_index(shards, tmp, INDEX_NAME, files)

    config = dict(snap.config)
    config["quantization_config"] = quantization_config(scheme, sorted(plan.ignored))
    if opts.dtype:  # the unquantized tensors now have this dtype (transformers 5 says "dtype", 4 "torch_dtype")
        config["torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"] = opts.dtype
    atomic.write_text(tmp / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
    _record_file(files, tmp, CONFIG_NAME)
    if snap.origin is None:  # (a GGUF's config and tokenizer were derived from it: the GGUF is the source file)
        source_files[CONFIG_NAME] = sha256_file(snap.path / CONFIG_NAME)
    for rel in snap.copy_files():
        dst = tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(snap.path / rel, dst)
        digest = _record_file(files, tmp, rel)
        if snap.origin is None:
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
            "unquantized_dtype": opts.dtype,
        },
        tensors=dict(sorted(shards.tensors.items())),
        skipped=dict(sorted(plan.skipped.items())),
        files=dict(sorted(files.items())),
        device=opts.device,
    )
    if scheme.block:  # which merged layers vLLM would refuse: the card and inspect say it (manifests/engines.py)
        manifest.put(engines.vllm_block_check(manifest.tensors, scheme.block))
    if plan.expert_layout:
        manifest.put(
            Experts(
                experts_layout=opts.experts_layout,
                experts={n: ep.as_dict() for n, ep in sorted(plan.expert_layout.items())},
                scales="per-expert tensors: like Linear (<m>.weight_scale [N,1]|[1], <m>.input_scale [1]); "
                "fused: <p>_scale [E,N,1]|[E,1,1], <p>_input_scale [E]",
            )
        )
    # How the shards reached the disk (O_DIRECT or the page cache, and why): it depends on the
    # filesystem, not on the inputs, so it lives in the block that differs between runs.
    manifest.created["shard_writes"] = ", ".join(sorted(shards.write_modes))
    if shards.plan_source:
        manifest.created["plan"] = shards.plan_source
    manifest.summary = summarize(manifest, plan, shards.bytes_in, shards.bytes_out)
    src_card = snap.path / card.CARD_NAME
    finish(
        tmp,
        manifest,
        name,
        src_card.read_text(encoding="utf-8", errors="replace") if src_card.is_file() else None,
        seal=True,
    )
    return manifest


def summarize(manifest: Manifest, plan: Plan, bytes_in: int, bytes_out: int) -> dict:
    """The summary block: sizes, counts and the worst SQNR (what `quantize` prints)."""
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
        "expert_tensors_quantized": sum(1 for r in manifest.tensors.values() if "experts_module" in r),
        "linear_ignored": len(plan.ignored),
        "modules_skipped": len(plan.skipped),
        "worst_sqnr_db": None if worst is None else worst[1],
        "worst_sqnr_tensor": None if worst is None else worst[0],
        "warnings": subnormal_warnings(manifest.tensors),
    }


# the smallest normal value of each source float dtype: a weight entirely below it is all subnormal
_NORMAL_MIN = {"F32": 1.1754944e-38, "BF16": 1.1754944e-38, "F16": 6.1035156e-05, "F64": 2.2250738585072014e-308}


def subnormal_warnings(tensors: dict) -> list[str]:
    """Weights whose every value is subnormal in the source dtype (not zero): almost certainly a
    broken checkpoint, and their FP8 codes carry little of them; said, not refused."""
    out = []
    for name, rec in tensors.items():
        amax, tiny = rec.get("amax"), _NORMAL_MIN.get(rec.get("source_dtype"))
        if isinstance(amax, (int, float)) and tiny and 0 < amax < tiny:
            out.append(
                f"{name}: every value is subnormal in {rec['source_dtype']} (max |w| {amax:.3g}); is the "
                "checkpoint broken?"
            )
    return out
