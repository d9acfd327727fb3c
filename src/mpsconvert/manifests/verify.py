"""Is an artifact what its manifest says, and is it internally consistent? (`mpsconvert verify`)

Two kinds of check, both reported (never raised) so a caller can print every problem at once:

- integrity: every file the manifest lists is a plain path inside the folder (untrusted.inside)
  and exists with the recorded size and sha256 (a flipped byte or a truncated shard is caught);
  files present but not listed are reported, and a listed-nowhere `.py` (code) is a problem.
  With `manifest_sha256` the manifest itself must have that hash (what makes the whole artifact
  tamper-evident: without a pinned hash, whoever can rewrite files can rewrite the manifest too).
  Checkpoints made by other tools (llm-compressor) have no manifest: then nothing can be
  verified, which is a problem ("cannot verify"), and the consistency checks still run.
- values (manifests/values.py): every `*_scale` tensor is finite and > 0, and no F8_E4M3 tensor
  holds a NaN code (0x7F / 0xFF: e4m3fn has no infinities, those two are its NaNs); the codes are
  counted in the same read that hashes the files.
- consistency: config.json carries a compressed-tensors FP8 `quantization_config`; every shard
  has a valid safetensors header (and the index maps only to existing tensors); every F8_E4M3
  `<m>.weight` is 2-D with a float `<m>.weight_scale` of shape [1] (tensor) or [N, 1] (channel)
  as the config's strategy says, and `<m>.input_scale` [1] when activations are static; the
  manifest's tensor records match the files' shapes and dtypes; and, when `shapes` is given
  (module -> (out, in), from the model built from config.json), every FP8 weight has its
  Linear's shape and no ignored module is quantized. Building that model takes torch and
  transformers (seconds to import), so `mpsconvert verify` does it only where the manifest does
  not vouch for config.json (`VerifyReport.needs_model`); else the records are those shapes.

`check_artifact` raises the first problem as an ArtifactError, for loaders.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ArtifactError, MpsconvertError
from ..format.ct_config import scheme_from_config
from ..infra.atomic import TMP_PREFIX
from ..infra.progress import Progress, or_silent
from ..infra.safetensors_io import Header, read_header
from ..infra.untrusted import check_model_config, inside, read_json
from . import layout
from .hashing import sha256_file
from .layout import CONFIG_NAME, INDEX_NAME, MANIFEST_NAME
from .manifest import Manifest, pinned_sha256, read_once
from .pin import CARD as CARD_NAME
from .pin import Pin
from .values import check_records, check_values, fp8_ranges, hash_and_count

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
    linears: set = field(
        default_factory=set, repr=False
    )  # the Linear modules of the model built from config.json (not reported)
    shards: list = field(default_factory=list)
    headers: dict = field(default_factory=dict, repr=False)  # shard -> validated Header (not reported)
    unlisted: list = field(default_factory=list)  # files present that the manifest does not list
    warnings: list = field(default_factory=list)  # worth saying, not a failure
    manifest_sha256: str | None = None
    pinned_sha256: str | None = None  # of the part the conversion sealed (manifests/pin.py): the pin that lasts
    pin: str | None = None  # what the pin given to verify covered
    format: str | None = (
        None  # a diffusion artifact's format ("comfyui", "comfyui-legacy", "diffusers"); None: compressed-tensors
    )
    manifest: Manifest | None = field(default=None, repr=False)  # parsed from the bytes that were hashed (not reported)
    # config.json is the one the manifest recorded (its sha256 checked, also without check_hashes:
    # a few KB): the records' shapes then already are the model's, and nothing needs building
    config_recorded: bool = field(default=False, repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def needs_model(self) -> bool:
        """Whether the shapes still need checking against the model config.json builds (torch
        and transformers, seconds to import): a compressed-tensors checkpoint whose config.json
        the manifest does not vouch for. Where it does, the manifest's records, checked against
        the files' headers, are the shapes of the model the conversion built from that config."""
        return self.scheme is not None and not self.format and not self.config_recorded

    def as_dict(self) -> dict:
        return {
            "path": self.path,
            "ok": self.ok,
            "hashes_checked": self.hashes_checked,
            "scheme": self.scheme,
            "weights": self.weights,
            "quantized_modules": len(self.quantized),
            "files": self.files,
            "problems": self.problems,
            "unlisted": self.unlisted,
            "warnings": self.warnings,
            "manifest_sha256": self.manifest_sha256,
            "pinned_sha256": self.pinned_sha256,
            **({"pin": self.pin} if self.pin else {}),
            **({"format": self.format} if self.format else {}),
        }


def _problem(report: VerifyReport, msg: str) -> None:
    report.problems.append(msg)


def check_sizes(folder: Path, manifest: Manifest, report: VerifyReport) -> list[str]:
    """Every file the manifest lists exists with its recorded size (a stat each, no reading);
    returns the names whose contents still need their sha256 checked."""
    present = []
    for name, rec in sorted(manifest.files.items()):
        try:
            p = inside(folder, name, what=f"{MANIFEST_NAME} files")
        except ArtifactError as e:
            report.files[name] = "outside the folder"
            _problem(report, e.problem)
            continue
        if not p.is_file():
            report.files[name] = "missing"
            _problem(report, f"{name} is listed in {MANIFEST_NAME} but missing")
            continue
        size = p.stat().st_size
        if size != rec.get("size"):
            report.files[name] = f"size {size}, manifest says {rec.get('size')}"
            _problem(
                report, f"{name} is {size} bytes but {MANIFEST_NAME} records {rec.get('size')} (truncated or replaced)"
            )
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


def unlisted(folder: Path, manifest: Manifest) -> list[str]:
    """Files (and links) in the folder that the manifest does not list, sorted (macOS's
    AppleDouble companions left out: metadata on exFAT/SMB, not part of the artifact)."""
    return layout.unlisted(folder, set(manifest.files), temporary=True)


def check_unlisted(folder: Path, manifest: Manifest, report: VerifyReport) -> None:
    """Files (and links) in the folder that the manifest does not list: reported; a `.py` among
    them is a problem (code added to an artifact after it was made is never imported)."""
    for rel in unlisted(folder, manifest):
        name = rel.rsplit("/", 1)[-1]
        report.unlisted.append(rel)
        if name.startswith(TMP_PREFIX):
            report.warnings.append(
                f"{rel} was left by an interrupted run (the next write into the artifact removes it)"
            )
        elif name.endswith(".py"):
            _problem(
                report,
                f"{rel} is code that {MANIFEST_NAME} does not list (added after the artifact was made); "
                "it is never imported",
            )
        else:
            report.warnings.append(f"{rel} is not listed in {MANIFEST_NAME} (not verified, not used)")


def check_manifest_sha256(folder: Path, want: str, report: VerifyReport, manifest: Manifest | None = None) -> None:
    """The pin the user gave against the manifest: the sha256 of the whole file (pins everything
    as it is now) or of the part the conversion sealed (pin.py: lasts through the steps after it);
    `report.pin` says which part it covers."""
    got = report.manifest_sha256  # of the bytes verify_artifact read and parsed: the file is not read again
    want = pinned_sha256(want)
    if want == got:
        report.pin = "the whole manifest: every file, record and the card, as they are now"
    elif want == report.pinned_sha256 and manifest is not None:
        sealed = manifest.get(Pin)
        later = sorted(set(manifest.extra) - set(sealed.keys) - {Pin.KEY})
        added = sorted(set(manifest.files) - set(sealed.files) - {CARD_NAME})
        report.pin = (
            f"the conversion: {len(sealed.files)} files and the manifest's {', '.join(sealed.keys)}; not the card"
            + (f", the records added since ({', '.join(later)})" if later else "")
            + (
                f" or the {len(added)} files added since ({', '.join(added[:3])}{', ...' if len(added) > 3 else ''})"
                if added
                else ""
            )
            + ", which are checked against the manifest's hashes only"
        )
    else:
        _problem(
            report,
            f"{MANIFEST_NAME} is not the pinned one (the manifest was changed, or what the conversion sealed in it; "
            f"calibrate rewrites the weights: pin the new value verify prints): pinned {want}, the whole manifest's "
            f"sha256 is {got}, its sealed part's {report.pinned_sha256 or 'none'}",
        )


def _check_hashes(
    folder: Path, manifest: Manifest, report: VerifyReport, progress: Progress | None = None, codes: bool = False
) -> dict[str, dict[str, int]]:
    """Every listed file's sha256, a thread per file up to one per core (sha256 of one file is one
    core's work; hashlib releases the GIL), compared with the manifest. With `codes`, the NaN
    codes of every F8_E4M3 tensor of the safetensors files are counted in the same read; returns
    them (file -> {tensor: NaN codes}) for values.check_values."""
    from concurrent.futures import ThreadPoolExecutor

    progress = or_silent(progress)
    total = sum(int(rec.get("size") or 0) for rec in manifest.files.values())
    digests, counted, done = {}, {}, 0
    names = check_sizes(folder, manifest, report)
    ranges = {name: _fp8_ranges(folder / name) for name in names if codes and name.endswith(".safetensors")}
    with ThreadPoolExecutor(
        max_workers=max(1, min(len(names), os.cpu_count() or 2)), thread_name_prefix="mpsconvert-verify"
    ) as pool:
        futures = {name: pool.submit(hash_and_count, folder / name, ranges.get(name) or ()) for name in names}
        for name, fut in futures.items():
            digests[name], found = fut.result()
            if ranges.get(name) is not None:
                counted[name] = found
            done += int(manifest.files[name].get("size") or 0)
            progress("verify", done, total, name)
    check_digests(manifest, report, digests)
    return counted


def _is_recorded(folder: Path, manifest: Manifest, name: str, report: VerifyReport) -> bool:
    """Is the small file `name` the one the manifest lists, byte for byte? The hash already
    computed when every file was hashed, else its own (a config is a few KB)."""
    rec = manifest.files.get(name) or {}
    if name in report.files:
        return report.files[name] == "ok"
    try:
        p = inside(folder, name, what=f"{MANIFEST_NAME} files")
        return (
            bool(rec.get("sha256"))
            and p.is_file()
            and p.stat().st_size == rec.get("size")
            and sha256_file(p) == rec["sha256"]
        )
    except (OSError, MpsconvertError):
        return False


def _fp8_ranges(path: Path) -> list | None:
    """The F8_E4M3 byte ranges of a safetensors file, or None where its header does not read (the
    structural checks say why, and scan its codes on their own)."""
    try:
        return fp8_ranges(read_header(path))
    except MpsconvertError:
        return None


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


def verify_artifact(
    path,
    *,
    check_hashes: bool = True,
    shapes: dict | None = None,
    ignored: set | None = None,
    progress=None,
    manifest_sha256: str | None = None,
    check_codes: bool = True,
    manifest: Manifest | None = None,
    config: dict | None = None,
) -> VerifyReport:
    """Check an artifact folder; returns a report listing every problem found (empty when sound).

    `manifest_sha256`: the manifest file must have this sha256. `check_codes`: scan every FP8
    code for NaNs (one read of the weights; the loader checks them on the device instead).
    `manifest`: the folder's manifest, when the caller read it already (under the artifact's lock
    or pinned). `config`: its config.json, when the caller read it from a verified copy."""
    folder = Path(path)
    if manifest_sha256 is not None:
        manifest_sha256 = pinned_sha256(manifest_sha256)  # a malformed pin is bad input, before any hashing
    report = VerifyReport(path=str(folder))
    if not folder.is_dir():
        _problem(report, f"{folder} is not a folder")
        return report
    if (folder / MANIFEST_NAME).is_file():
        try:  # read once: the bytes hashed (the pin) are the bytes parsed and checked against
            parsed, report.manifest_sha256, report.pinned_sha256 = read_once(folder)
            manifest = manifest or parsed
        except MpsconvertError as e:
            _problem(report, e.problem)
    else:
        manifest = None
        _problem(
            report,
            f"cannot verify: {folder} has no {MANIFEST_NAME}, so there are no hashes to check the files against "
            "(made by another tool, or the manifest was deleted)",
        )
    report.manifest = manifest
    if manifest_sha256 is not None and report.manifest_sha256 is not None:
        check_manifest_sha256(folder, manifest_sha256, report, manifest)
    counted = {}  # NaN codes counted while hashing: file -> {tensor: count}
    if manifest is not None:
        check_unlisted(folder, manifest, report)
        if check_hashes:
            counted = _check_hashes(folder, manifest, report, progress, codes=check_codes)
        report.config_recorded = _is_recorded(folder, manifest, CONFIG_NAME, report)
        if layout.diffusion_format(manifest):
            from .diffusion import verify_diffusion

            verify_diffusion(folder, manifest, report, check_codes, counted)
            return report
    try:
        config = config if config is not None else read_json(folder / CONFIG_NAME, what=CONFIG_NAME)
        check_model_config(config, what=CONFIG_NAME, error=ArtifactError)  # values that would build or compute garbage
        scheme = scheme_from_config(config.get("quantization_config"))
        report.scheme, report.weights = scheme.name, scheme.weights
    except MpsconvertError as e:
        if not (folder / CONFIG_NAME).exists():
            _problem(report, "config.json is missing")
        else:
            _problem(report, str(e) if str(e).startswith(CONFIG_NAME) else f"config.json: {e}")
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
        elif (
            sc.dtype not in FLOAT_SCALE_DTYPES
            or list(sc.shape) != want
            and not (want == [1] and math.prod(sc.shape) == 1)
        ):
            _problem(
                report,
                f"{mod}.weight_scale is {sc.dtype}{list(sc.shape)}, the config's {scheme.weights} "
                f"strategy needs a float {want}",
            )
        if scheme.activations == "tensor":
            isc = tensors.get(mod + ".input_scale")
            if isc is None or math.prod(isc.shape) != 1 or isc.dtype not in FLOAT_SCALE_DTYPES:
                _problem(report, f"{mod} has no float [1] input_scale, which the static scheme needs")
    if not report.quantized and headers:
        _problem(report, "no F8_E4M3 weights found: this is not an FP8 checkpoint")
    check_model_shapes(report, shapes, ignored)
    if report.config_recorded and isinstance(config, dict):
        check_config_numbers(report, config, tensors)
    check_values(headers, report, codes=check_codes, counted=counted)
    if manifest is not None:
        check_records(manifest, tensors, report)
    return report


def check_model_shapes(report: VerifyReport, shapes: dict | None, ignored: set | None) -> None:
    """Every FP8 weight has its Linear's shape in the model built from config.json (module ->
    (out, in)), and no module the config ignores is quantized."""
    for mod, (n, k) in sorted(report.quantized.items()):
        if shapes is not None and mod in shapes and list(shapes[mod]) != [n, k]:
            _problem(
                report,
                f"{mod}.weight is {n}x{k} but the model built from config.json has {shapes[mod][0]}x{shapes[mod][1]}",
            )
        if ignored and mod in ignored:
            _problem(report, f"{mod} is quantized but the quantization_config ignores it")


_LAYER = re.compile(r"^(.*?(?:^|\.)(?:layers|layer|h|blocks)\.\d+)\.")
_EMBED = re.compile(r"(?:^|\.)(?:embed_tokens|wte|word_embeddings)\.weight$")
_MLP = {"gate_proj": 0, "up_proj": 0, "down_proj": 1}  # the intermediate size's axis in a gated MLP's weights
_MLP_WEIGHT = re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")


def check_config_numbers(report: VerifyReport, config: dict, tensors: dict) -> None:
    """config.json's structural numbers against the shards without building the model: what verify
    runs where the manifest vouches for config.json (so no torch is imported), since a config.json
    edited and re-hashed into an unpinned manifest describes other weights than the shards hold.
    Checked where the names say what they are: the decoder layers stored are exactly
    0..num_hidden_layers-1 (one stack of layers), the input embedding is [vocab_size, hidden_size],
    and a gated MLP's gate / up / down projections have intermediate_size on their inner axis.
    A config whose model the names do not show (several stacks, other names) is checked in full
    where the model is built (runtime/load/model_check.check_built_model)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    found = []
    stacks: dict[str, set[int]] = {}
    for name in tensors:
        if m := _LAYER.match(name):
            prefix, _, idx = m.group(1).rpartition(".")
            stacks.setdefault(prefix, set()).add(int(idx))
    n = text.get("num_hidden_layers")
    if type(n) is int and len(stacks) == 1:
        ((prefix, held),) = stacks.items()
        lo = min(held)
        if missing := sorted(set(range(n)) - held):
            like = sorted(t for t in tensors if t.startswith(f"{prefix}.{lo}.") and tensors[t].dtype == "F8_E4M3")
            what = (
                like[0].replace(f"{prefix}.{lo}.", f"{prefix}.{missing[0]}.", 1) if like else f"{prefix}.{missing[0]}"
            )
            found.append(
                f"config.json's model has {what}, which no shard holds ({len(missing)} layer(s) missing): "
                "config.json does not describe these weights"
            )
        if extra := sorted(held - set(range(n))):
            found.append(
                f"the shards hold {len(extra)} layer(s) the model built from config.json does not have "
                f"({prefix}.{extra[0]}, ...): config.json does not describe these weights"
            )
    vocab, hidden, inner = (text.get(k) for k in ("vocab_size", "hidden_size", "intermediate_size"))
    for name, info in sorted(tensors.items()):
        shape = list(info.shape)
        if _EMBED.search(name) and info.dtype != "F8_E4M3" and len(shape) == 2:
            want = [vocab if type(vocab) is int else shape[0], hidden if type(hidden) is int else shape[1]]
            if shape != want:
                found.append(f"{name} is {shape} but the model built from config.json has {want}")
        m = _MLP_WEIGHT.search(
            name
        )  # the dense MLP's own projections (not a shared expert's or an expert's: their sizes are others)
        proj = m.group(1) if m else None
        if proj in _MLP and type(inner) is int and len(shape) == 2 and shape[_MLP[proj]] != inner:
            want = list(shape)
            want[_MLP[proj]] = inner
            found.append(
                f"{name} is {shape[0]}x{shape[1]} but the model built from config.json has {want[0]}x{want[1]}"
            )
    report.problems += found[:20]
    if len(found) > 20:
        report.problems.append(f"... and {len(found) - 20} more differences between config.json's model and the shards")


def check_model_structure(report: VerifyReport, params: dict, modules: set) -> None:
    """config.json's structural numbers (num_hidden_layers, hidden_size, vocab_size, ...) against
    the shards: every Linear weight and every parameter the model built from config.json has (its
    canonical name: a tied weight once) that is stored under its own name has that parameter's
    shape, no Linear weight of the model is missing from the shards, and no shard holds a layer the
    model does not have. `params`: name -> shape of the built model's parameters; `modules`: the
    names of its modules. A raised num_hidden_layers (missing layers), a lowered one (layers the
    model never reads), or another vocab or hidden size are each a problem, not a later crash."""
    tensors = {name: info for h in report.headers.values() for name, info in h.tensors.items()}
    if not tensors or not any(f"{m}.weight" in tensors for m in report.linears):
        # the checkpoint names its tensors otherwise than the model its modules (a conversion mapping): nothing to match
        return
    found = []
    for name, shape in params.items():
        info = tensors.get(name)
        if info is None:
            mod = name.rpartition(".")[0]
            if name.endswith(".weight") and mod in report.linears:
                found.append(
                    f"config.json's model has {name}, which no shard holds (config.json does not describe "
                    "these weights)"
                )
            continue
        if info.dtype != "F8_E4M3" and list(info.shape) != list(shape):
            found.append(f"{name} is {list(info.shape)} but the model built from config.json has {list(shape)}")
    extra = sorted({m.group(1) for n in tensors if (m := _LAYER.match(n)) and m.group(1) not in modules})
    if extra:
        found.append(
            f"the shards hold {len(extra)} layer(s) the model built from config.json does not have ({extra[0]}, ...): "
            "config.json does not describe these weights"
        )
    report.problems += found[:20]
    if len(found) > 20:
        report.problems.append(f"... and {len(found) - 20} more differences between config.json's model and the shards")


def check_artifact(path, **kw) -> VerifyReport:
    """verify_artifact, raising the problems as one ArtifactError (what a loader wants)."""
    return raise_problems(path, verify_artifact(path, **kw))


def check_before_use(path, trust_remote_code: bool = False, manifest: Manifest | None = None) -> VerifyReport:
    """What every command that reads an artifact does first, before any of its code or data is
    used: every hash and structural check (check_artifact), then config.json read by
    transformers (code in the artifact is imported only now, after it matched its hash).
    `manifest`: the artifact's manifest, when the caller read it already."""
    from ..model import definition

    report = check_artifact(path, check_hashes=True, manifest=manifest)
    definition.load_config(path, trust_remote_code)
    return report


def failed(path, problem: str) -> ArtifactError:
    """The one error of an artifact that failed verification (a load, a check before use)."""
    return ArtifactError(
        f"artifact {path} failed verification: {problem}",
        "re-download or re-create it (`mpsconvert quantize ... --force`); from Python, "
        "`mpsconvert.load(path, verify=False)` skips the check, only for files you trust",
    )


def raise_problems(path, report: VerifyReport) -> VerifyReport:
    """The report if sound, else its problems as one ArtifactError."""
    if not report.ok:
        more = f" (and {len(report.problems) - 1} more problem(s))" if len(report.problems) > 1 else ""
        raise failed(path, f"{report.problems[0]}{more}")
    return report
