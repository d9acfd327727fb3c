"""Is an artifact what its manifest says, and is it internally consistent? (`mpsconvert verify`)

Two kinds of check, both reported (never raised) so a caller can print every problem at once:

- integrity: every file the manifest lists exists with the recorded size and sha256 (a flipped
  byte or a truncated shard is caught). Checkpoints made by other tools (llm-compressor) have no
  manifest; then only the consistency checks run, and the report says hashes were not checked.
- consistency: config.json carries a compressed-tensors FP8 `quantization_config`; every shard
  has a valid safetensors header (and the index maps only to existing tensors); every F8_E4M3
  `<m>.weight` is 2-D with a float `<m>.weight_scale` of shape [1] (tensor) or [N, 1] (channel)
  as the config's strategy says, and `<m>.input_scale` [1] when activations are static; the
  manifest's tensor records match the files' shapes and dtypes; and, when `shapes` is given
  (module -> (out, in), from the model built from config.json), every FP8 weight has its
  Linear's shape and no ignored module is quantized.

`check_artifact` raises the first problem as an ArtifactError, for loaders.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ArtifactError, MpsconvertError
from ..safetensors_io import Header, read_header
from .ct_config import scheme_from_config
from .hashing import sha256_file
from . import layout
from ..progress import Progress, or_silent
from .layout import CONFIG_NAME, INDEX_NAME, MANIFEST_NAME
from .manifest import Manifest

FLOAT_SCALE_DTYPES = ("F32", "BF16", "F16")


@dataclass
class VerifyReport:
    path: str
    hashes_checked: bool = False
    files: dict = field(default_factory=dict)  # file -> "ok" | what is wrong
    problems: list = field(default_factory=list)
    scheme: str | None = None
    weights: str | None = None
    quantized: dict = field(default_factory=dict)  # module -> [N, K]
    shards: list = field(default_factory=list)
    headers: dict = field(default_factory=dict, repr=False)  # shard -> validated Header (not reported)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {"path": self.path, "ok": self.ok, "hashes_checked": self.hashes_checked, "scheme": self.scheme,
                "weights": self.weights, "quantized_modules": len(self.quantized), "files": self.files, "problems": self.problems}


def _problem(report: VerifyReport, msg: str) -> None:
    report.problems.append(msg)


def check_sizes(folder: Path, manifest: Manifest, report: VerifyReport) -> list[str]:
    """Every file the manifest lists exists with its recorded size (a stat each, no reading);
    returns the names whose contents still need their sha256 checked."""
    present = []
    for name, rec in sorted(manifest.files.items()):
        p = folder / name
        if not p.is_file():
            report.files[name] = "missing"
            _problem(report, f"{name} is listed in {MANIFEST_NAME} but missing")
            continue
        size = p.stat().st_size
        if size != rec.get("size"):
            report.files[name] = f"size {size}, manifest says {rec.get('size')}"
            _problem(report, f"{name} is {size} bytes but {MANIFEST_NAME} records {rec.get('size')} (truncated or replaced)")
        else:
            present.append(name)
    return present


def check_digests(manifest: Manifest, report: VerifyReport, sha256: dict[str, str]) -> None:
    """The sha256 of each file (computed by the caller, e.g. while loading it) against the manifest."""
    report.hashes_checked = True
    for name, digest in sorted(sha256.items()):
        if digest != manifest.files[name].get("sha256"):
            report.files[name] = "sha256 mismatch"
            _problem(report, f"{name} does not match the sha256 in {MANIFEST_NAME} (modified or corrupted)")
        else:
            report.files[name] = "ok"


def _check_hashes(folder: Path, manifest: Manifest, report: VerifyReport, progress: Progress | None = None) -> None:
    progress = or_silent(progress)
    total = sum(int(rec.get("size") or 0) for rec in manifest.files.values())
    digests, done = {}, 0
    for name in check_sizes(folder, manifest, report):
        digests[name] = sha256_file(folder / name)
        done += int(manifest.files[name].get("size") or 0)
        progress("verify", done, total, name)
    check_digests(manifest, report, digests)


def _shards(folder: Path, report: VerifyReport) -> dict[str, Header]:
    try:
        weight_map = layout.read_weight_map(folder)
        names = layout.weight_files(folder)
    except ArtifactError as e:
        _problem(report, e.problem)
        return {}
    if not names:
        _problem(report, "no *.safetensors weights in the folder")
    headers = {}
    for n in names:
        if not (folder / n).is_file():
            _problem(report, f"weight file {n!r} is missing")
            continue
        try:
            headers[n] = read_header(folder / n)
        except ArtifactError as e:
            _problem(report, e.problem)
    if weight_map:
        for tensor, shard in weight_map.items():
            if shard in headers and tensor not in headers[shard].tensors:
                _problem(report, f"{INDEX_NAME} puts {tensor} in {shard}, which does not hold it")
    report.shards = sorted(headers)
    report.headers = headers
    return headers


def verify_artifact(path, *, check_hashes: bool = True, shapes: dict | None = None, ignored: set | None = None,
                    progress=None) -> VerifyReport:
    """Check an artifact folder; returns a report listing every problem found (empty when sound)."""
    folder = Path(path)
    report = VerifyReport(path=str(folder))
    if not folder.is_dir():
        _problem(report, f"{folder} is not a folder")
        return report
    manifest = None
    if (folder / MANIFEST_NAME).is_file():
        try:
            manifest = Manifest.read(folder)
        except MpsconvertError as e:
            _problem(report, e.problem)
    if manifest is not None and check_hashes:
        _check_hashes(folder, manifest, report, progress)
    try:
        config = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
        qc = config["quantization_config"]
        scheme = scheme_from_config(qc)
        report.scheme, report.weights = scheme.name, scheme.weights
    except FileNotFoundError:
        _problem(report, "config.json is missing")
        return report
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        _problem(report, f"config.json has no readable quantization_config ({type(e).__name__}: {e})")
        return report
    except MpsconvertError as e:
        _problem(report, f"config.json: {e}")
        return report

    headers = _shards(folder, report)
    tensors = {name: info for h in headers.values() for name, info in h.tensors.items()}
    for name, info in tensors.items():
        if info.dtype != "F8_E4M3" or not name.endswith(".weight"):
            continue
        mod = name[: -len(".weight")]
        if len(info.shape) != 2:
            _problem(report, f"{name} is F8_E4M3 with shape {list(info.shape)}, expected 2-D [out, in]")
            continue
        n, k = info.shape
        report.quantized[mod] = [n, k]
        sc = tensors.get(mod + ".weight_scale")
        want = list(scheme.scale_shape(n, k))
        if sc is None:
            _problem(report, f"{name} has no {mod}.weight_scale")
        elif sc.dtype not in FLOAT_SCALE_DTYPES or list(sc.shape) != want and not (want == [1] and math.prod(sc.shape) == 1):
            _problem(report, f"{mod}.weight_scale is {sc.dtype}{list(sc.shape)}, the config's {scheme.weights} strategy needs a float {want}")
        if scheme.activations == "tensor":
            isc = tensors.get(mod + ".input_scale")
            if isc is None or math.prod(isc.shape) != 1 or isc.dtype not in FLOAT_SCALE_DTYPES:
                _problem(report, f"{mod} has no float [1] input_scale, which the static scheme needs")
        if shapes is not None:
            if mod in shapes and list(shapes[mod]) != [n, k]:
                _problem(report, f"{name} is {n}x{k} but the model built from config.json has {shapes[mod][0]}x{shapes[mod][1]}")
        if ignored and mod in ignored:
            _problem(report, f"{mod} is quantized but the quantization_config ignores it")
    if not report.quantized and headers:
        _problem(report, "no F8_E4M3 weights found: this is not an FP8 checkpoint")
    if manifest is not None:
        for name, rec in manifest.tensors.items():
            info = tensors.get(name)
            if info is None:
                _problem(report, f"{MANIFEST_NAME} records {name}, which no shard holds")
            elif info.dtype != rec.get("dtype", info.dtype) or list(info.shape) != list(rec.get("shape", info.shape)):
                _problem(report, f"{name} is {info.dtype}{list(info.shape)} but {MANIFEST_NAME} records {rec.get('dtype')}{rec.get('shape')}")
    return report


def check_artifact(path, **kw) -> VerifyReport:
    """verify_artifact, raising the problems as one ArtifactError (what a loader wants)."""
    return raise_problems(path, verify_artifact(path, **kw))


def raise_problems(path, report: VerifyReport) -> VerifyReport:
    """The report if sound, else its problems as one ArtifactError."""
    if not report.ok:
        more = f" (and {len(report.problems) - 1} more problem(s))" if len(report.problems) > 1 else ""
        raise ArtifactError(
            f"artifact {path} failed verification: {report.problems[0]}{more}",
            "re-download or re-create it (`mpsconvert quantize ... --force`); pass verify=False only if you trust the files",
        )
    return report
