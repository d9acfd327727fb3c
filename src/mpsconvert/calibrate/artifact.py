"""Calibration results on disk: a scales file, or written into an existing FP8 artifact; and
the `calibrate` command's flow (`calibrate_target`) and `quantize --scheme fp8`'s scales
(`scales.for_quantize`).

An artifact is calibrated as it will run: its FP8 weights are dequantized (codes * scale, in
the source dtype) into a temporary safetensors snapshot that transformers loads like any source,
so the activations observed are those of the quantized model. Writing the scales back rebuilds
the artifact under a temporary name (atomic.output_dir) with `<m>.input_scale` added after each
`<m>.weight_scale`, the index, config (static input_activations), manifest recipe, per-tensor
records and file hashes updated, then swaps it in: a failure leaves the artifact as it was.

Nothing unverified is carried over: the artifact is verified first (its transaction does it),
the snapshot and the rebuild read only files the manifest lists (each a plain path inside the
artifact, untrusted.inside), and every file copied as it is must still have the sha256 the
manifest records (else the rebuild would launder a tampered file into a fresh manifest). The
rebuild is the artifact's transaction (manifests/transaction.py): the card is re-rendered and the
manifest written in the rebuilt folder before the one swap.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from pathlib import Path

import torch

from ..errors import ArtifactError, MpsconvertError
from ..format import fp8
from ..format.ct_config import quantization_config, scheme_from_config
from ..format.scales import scale_problem
from ..format.schemes import Scheme
from ..infra import atomic, output_rule, tempdirs
from ..infra.progress import Progress
from ..infra.safetensors_io import ShardReader, read_header
from ..infra.safetensors_writer import ShardWriter
from ..infra.untrusted import inside, read_json
from ..manifests import hashing
from ..manifests.hashing import sha256_file
from ..manifests.layout import CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, is_artifact, read_weight_map, weight_files
from ..manifests.manifest import Manifest
from ..manifests.records import CalibrationRecord, ExpertCalibration
from ..manifests.transaction import Transaction, transaction
from .calibration import Calibration, calibrate
from .options import CalibOptions

SCALES_FORMAT = "mpsconvert-input-scales"
SCALES_VERSION = 1


def is_scales_file(path: Path) -> bool:
    """Whether `path` is a scales file mpsconvert wrote (what `calibrate -o FILE --force` may replace)."""
    try:
        body = read_json(path, what=str(path), max_bytes=64 << 20)
    except MpsconvertError:
        return False
    return body.get("format") == SCALES_FORMAT


def check_scales_output(path: Path, *, force: bool, protect: tuple[Path, ...] = ()) -> None:
    """`calibrate -o FILE` may write FILE (output_rule.check_replaceable, the one output rule): said
    before any work, and again when the file is written."""
    output_rule.check_replaceable(
        Path(path), file=True, force=force, is_ours=is_scales_file, protect=protect, is_artifact=is_artifact
    )


def save_scales(path: Path, cal: Calibration, *, force: bool = False, protect: tuple[Path, ...] = ()) -> None:
    """Write the scales file `path` whole, as the output rule allows (`check_scales_output`)."""
    path = Path(path)
    body = {
        "format": SCALES_FORMAT,
        "version": SCALES_VERSION,
        "input_scales": cal.scales,
        "expert_input_scales": cal.expert_scales,
        "calibration": cal.record,
    }
    atomic.write_file(
        path,
        json.dumps(body, indent=1, sort_keys=True, allow_nan=False) + "\n",
        force=force,
        is_ours=is_scales_file,
        protect=protect,
        is_artifact=is_artifact,
    )


def load_scales(path: Path) -> tuple[dict[str, float], dict]:
    """(module -> input scale, calibration record) from a scales file written by `calibrate -o`."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"scales file {path} does not exist", "run `mpsconvert calibrate SRC -o scales.json` first")
    body = read_json(
        path, fix="re-run `mpsconvert calibrate ... -o` to rebuild it", nonfinite=True
    )  # each scale is checked, by name
    if body.get("format") != SCALES_FORMAT or body.get("version") != SCALES_VERSION:
        raise ArtifactError(
            f"{path} is not an mpsconvert scales file (version {SCALES_VERSION})",
            "write one with `mpsconvert calibrate SRC -o FILE`",
        )
    scales = body.get("input_scales")
    if not isinstance(scales, dict):
        raise ArtifactError(
            f"{path}: input_scales must map module names to finite positive numbers", "re-run calibration"
        )
    for module, v in scales.items():
        if (
            why := scale_problem(v)
        ) is not None:  # as float32, as the artifact stores it: 1e308 and 5e-324 are not scales
            raise ArtifactError(f"{path}: the input scale of {module[:80]!r} {why}", "re-run calibration")
    record = body.get("calibration") or {}
    if not isinstance(record, dict):
        raise ArtifactError(f"{path}: 'calibration' must be an object", "re-run calibration")
    return {k: float(v) for k, v in scales.items()}, record


def carried_files(artifact: Path, manifest: Manifest, packages: bool = True) -> list[str]:
    """The listed files a rebuild carries over as they are (tokenizer, generation config, the
    card, Apple packages unless `packages` is False: everything in a folder of a language model's
    artifact is an export's package): not the weights, config, index or manifest (rebuilt), each
    checked to be a plain path inside the artifact."""
    weights = set(weight_files(artifact))
    out = []
    for rel in sorted(manifest.files):
        if rel in weights or rel in (CONFIG_NAME, INDEX_NAME, MANIFEST_NAME) or not packages and "/" in rel:
            continue
        inside(artifact, rel, what=f"{MANIFEST_NAME} files")
        out.append(rel)
    return out


def copy_verified(src: Path, dst: Path, rec: dict, rel: str) -> dict:
    """Copy a listed file, checking the bytes copied against the sha256 the manifest records."""
    return hashing.copy_verified(
        src,
        dst,
        rec,
        rel,
        "it is not carried into a new manifest: restore the artifact "
        "(`mpsconvert quantize ... --force`), then calibrate",
    )


@contextlib.contextmanager
def dequantized_snapshot(artifact: Path, manifest: Manifest):
    """A temporary source-dtype snapshot of an FP8 artifact (in this run's own folder of the
    system temp dir, removed on exit, or by the next run after a kill); `manifest`: its manifest."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    artifact = Path(artifact)
    dtypes = {name: rec.get("source_dtype", "BF16") for name, rec in manifest.tensors.items()}
    block = scheme_from_config(
        read_json(artifact / CONFIG_NAME, what=CONFIG_NAME).get("quantization_config") or {}
    ).block
    st_dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    with tempdirs.private_tempdir("calib") as tmp:
        for f in weight_files(artifact):
            tensors = {}
            with safe_open(str(inside(artifact, f, what="weights")), framework="pt") as sf:
                keys = set(sf.keys())
                for k in keys:
                    if k.endswith(".input_scale") or (k.endswith(".weight_scale") and k[: -len("_scale")] in keys):
                        continue
                    t = sf.get_tensor(k)
                    if t.dtype == fp8.FP8_DTYPE and k + "_scale" in keys:
                        t = fp8.dequantize(
                            t, sf.get_tensor(k + "_scale"), st_dtype.get(dtypes.get(k, "BF16"), torch.bfloat16), block
                        )
                    tensors[k] = t
            save_file(tensors, str(tmp / f), metadata={"format": "pt"})
        if (artifact / INDEX_NAME).is_file():
            body = read_json(artifact / INDEX_NAME, what=INDEX_NAME)
            body["weight_map"] = {
                k: v for k, v in read_weight_map(artifact).items() if not k.endswith(("weight_scale", "input_scale"))
            }
            (tmp / INDEX_NAME).write_text(json.dumps(body), encoding="utf-8")
        config = read_json(artifact / CONFIG_NAME, what=CONFIG_NAME)
        config.pop("quantization_config", None)
        (tmp / CONFIG_NAME).write_text(json.dumps(config), encoding="utf-8")
        for rel in carried_files(artifact, manifest, packages=False):
            copy_verified(artifact / rel, tmp / rel, manifest.files[rel], rel)
        yield tmp


def write_into_artifact(t: Transaction, cal: Calibration) -> Manifest:
    """Add (or replace) `<m>.input_scale` for every quantized Linear and mark the artifact static,
    in the (verified) artifact's transaction `t`: the rebuilt folder replaces it when `t` ends."""
    artifact, manifest = t.artifact, t.manifest
    config = read_json(artifact / CONFIG_NAME, what=CONFIG_NAME)
    qc = config.get("quantization_config") or {}
    old = scheme_from_config(qc)
    scheme = Scheme(name="fp8", weights=old.weights, block_size=old.block_size)  # block weights stay blocks
    weight_of = {name: rec["module"] for name, rec in manifest.tensors.items() if isinstance(rec.get("module"), str)}
    missing = sorted(set(weight_of.values()) - set(cal.scales))
    if missing:
        raise ArtifactError(
            f"calibration has no input scale for {len(missing)} quantized Linear(s) of {artifact} (e.g. {missing[0]})",
            "calibrate with the same --ignore patterns the artifact was made with",
        )
    files = weight_files(artifact)
    weight_map: dict[str, str] = {}
    tmp = t.rebuild()  # the new artifact: every file written here or carried over, verified
    for f in files:
        if f not in manifest.files or sha256_file(inside(artifact, f, what="weights")) != manifest.files[f]["sha256"]:
            raise ArtifactError(
                f"{f} does not match the sha256 in {MANIFEST_NAME} (modified or corrupted); it is "
                "not carried into a new manifest",
                "restore the artifact (`mpsconvert quantize ... --force`), then calibrate",
            )
        header = read_header(artifact / f)
        entries = []
        for name, info in header.tensors.items():
            if name.endswith("input_scale") and name[: -len("input_scale")] + "weight" in weight_of:
                continue  # replaced below
            entries.append((name, info.dtype, info.shape))
            if name.endswith(".weight_scale") and name[: -len("_scale")] in weight_of:
                entries.append((name[: -len("weight_scale")] + "input_scale", "F32", (1,)))
        with (
            ShardReader(header) as reader,
            ShardWriter(tmp / f, entries, metadata=header.metadata or {"format": "pt"}) as writer,
        ):
            for name, info in header.tensors.items():
                buf = reader.read(info)
                if name.endswith("input_scale") and name[: -len("input_scale")] + "weight" in weight_of:
                    continue
                writer.write(name, buf)
                if name.endswith(".weight_scale") and (w := name[: -len("_scale")]) in weight_of:
                    s = cal.scales[weight_of[w]]
                    writer.write(name[: -len("weight_scale")] + "input_scale", torch.tensor([s], dtype=torch.float32))
                    manifest.tensors[w]["input_scale"] = s
        writer.sync()
        digest = writer.digest
        for name, *_ in entries:
            weight_map[name] = f
        manifest.files[f] = {"sha256": digest, "size": (tmp / f).stat().st_size}
    if (artifact / INDEX_NAME).is_file():
        body = read_json(artifact / INDEX_NAME, what=INDEX_NAME)
        body["weight_map"] = dict(sorted(weight_map.items()))
        if not isinstance(body.get("metadata"), dict):
            body["metadata"] = {}
        body["metadata"]["total_size"] = sum(manifest.files[f]["size"] for f in files)
        atomic.write_text(tmp / INDEX_NAME, json.dumps(body, indent=2) + "\n")
    config["quantization_config"] = quantization_config(
        scheme, qc.get("ignore", []), qc.get("config_groups", {}).get("group_0", {}).get("targets")
    )
    atomic.write_text(tmp / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    kept = carried_files(artifact, manifest)
    for rel in kept:
        manifest.files[rel] = copy_verified(artifact / rel, tmp / rel, manifest.files[rel], rel)
    for rel in (CONFIG_NAME, INDEX_NAME):
        if (tmp / rel).is_file():
            manifest.files[rel] = {"sha256": sha256_file(tmp / rel), "size": (tmp / rel).stat().st_size}
    manifest.files = {k: v for k, v in sorted(manifest.files.items()) if (tmp / k).is_file()}
    manifest.recipe.update(scheme.as_dict())
    manifest.put(CalibrationRecord.read(cal.record, "the calibration"))
    if cal.expert_scales:
        manifest.put(ExpertCalibration(scales=cal.expert_scales))
    atomic.kill_point("rebuilt")  # the card and the manifest follow, written by the transaction
    return manifest


def calibrate_target(
    target: str | Path,
    output: str | Path | None,
    options: CalibOptions,
    *,
    revision: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> tuple[Calibration, Path, Manifest | None]:
    """The `calibrate` command: an artifact (calibrated as it will run, from its FP8 weights) gets
    its scales written into it unless `output` names a scales file; a source needs `output`.
    Returns (the calibration, where it was written, the artifact's new manifest or None)."""
    from ..manifests.verify import check_before_use
    from ..source.snapshot import no_revision, resolve

    path = Path(target).expanduser()
    atomic.recover(path)
    local = path.exists()
    if local:
        no_revision(path, revision)
    if output is not None:  # before any work: a file mpsconvert may not replace, or one inside what it reads
        check_scales_output(output, force=force, protect=(path,) if local else ())
    if is_artifact(path):
        # Written into: one transaction from before any work to the card (verified first, every
        # hash, before any of its config, code or weights is used). Into a file: verified, read.
        with (
            transaction(path, verify=True, trust_remote_code=options.trust_remote_code)
            if output is None
            else contextlib.nullcontext() as t
        ):
            manifest = t.manifest if t is not None else Manifest.read(path)
            if t is None:
                check_before_use(path, options.trust_remote_code, manifest=manifest)
            ignore = manifest.recipe.get("ignore_patterns")
            if ignore is not None and not (isinstance(ignore, list) and all(isinstance(x, str) for x in ignore)):
                raise ArtifactError(
                    f"{path}/{MANIFEST_NAME}: recipe.ignore_patterns is not a list of patterns",
                    "re-create the artifact",
                )
            with dequantized_snapshot(path, manifest) as snap_dir:
                cal = calibrate(snap_dir, replace(options, ignore=list(ignore or options.ignore)), progress)
            cal.record["weights"] = "the artifact's FP8 weights, dequantized"
            if t is None:
                save_scales(Path(output), cal, force=force, protect=(path,))
                return cal, Path(output), None
            manifest = write_into_artifact(t, cal)
        return cal, path, manifest
    if output is None:
        raise MpsconvertError(
            f"{target} is a source model, not an mpsconvert artifact",
            "pass -o scales.json, or point at an artifact folder",
        )
    snap = resolve(str(target), revision=revision, token=options.token)
    check_scales_output(output, force=force, protect=(snap.path,))  # a hub source: its snapshot, now known
    cal = calibrate(snap.path, options, progress)
    save_scales(Path(output), cal, force=force, protect=(snap.path,))
    return cal, Path(output), None
