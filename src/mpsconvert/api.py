"""The library's operations: what every command does, callable from Python.

    from mpsconvert import quantize, validate, load
    art = quantize("Qwen/Qwen2.5-0.5B", "qwen-fp8")          # -> QuantizeResult
    report = validate("qwen-fp8")                            # -> ValidationResult
    model = load("qwen-fp8", device="auto")                  # a transformers model with FP8 layers

Each function takes typed keyword arguments, returns a small dataclass, and raises an
`MpsconvertError` subclass (errors.py) for anything the caller can fix; the CLI is a thin layer
over these functions. Every decision about *what* to do lives here or below (which output
name, whether to calibrate or read scales, artifact or source, what to record); the modules
below do the work. Importing this module is cheap (no torch): heavy imports happen inside the
calls, so `mpsconvert --help` stays fast and a conversion starts hashing its source before
torch loads.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__  # noqa: F401  (re-exported for the CLI)
from . import atomic
from .atomic import stop_requested  # noqa: F401  (the CLI's signal handlers set it)
from .calibrate import DEFAULT_PERCENTILE, OBSERVERS  # noqa: F401
from .convert import EXPERTS_LAYOUTS, UNQUANTIZED_DTYPES  # noqa: F401
from .convert.coreml import FRONTENDS as COREML_FRONTENDS  # noqa: F401
from .convert.coreml import WEIGHT_MODES as COREML_WEIGHT_MODES  # noqa: F401
from .convert.coreai import COMPUTE_DTYPES as COREAI_COMPUTE_DTYPES  # noqa: F401
from .convert.coreai import CoreAIOptions
from .convert.coreml import ExportOptions, SeqLen
from .errors import ArtifactError, ExportError, MpsconvertError, UploadError
from .manifests import layout
from .manifests.manifest import Manifest
from .manifests.layout import DIFFUSION_FORMATS  # noqa: F401  (quantize --format of a diffusion model)
from .manifests.schemes import SCHEMES, WEIGHT_GRANULARITIES, Scheme  # noqa: F401
from .progress import Progress

if TYPE_CHECKING:  # heavy modules, for annotations only
    import torch

    from .calibrate import CalibOptions
    from .calibrate.run import Calibration
    from .manifests.verify import VerifyReport
    from .runtime.validate import ValidateOptions

__all__ = [
    "quantize", "calibrate", "validate", "verify", "inspect", "export_coreml", "check_coreml", "export_coreai", "check_coreai",
    "coreai_latency", "load", "generate", "chat", "upload",
    "QuantizeResult", "CalibrateResult", "GenerateResult", "Chat", "UploadResult", "ValidationResult", "CoreMLResult", "CoreAIResult", "ExportOptions", "SeqLen", "CoreAIOptions",
    "calibration_options", "validate_options",
]


# --------------------------------------------------------------------------- results


@dataclass
class CoreMLResult:
    """A Core ML package in an artifact: the manifest's `coreml` record and, when checked, the
    checks that run anywhere (spec, weights read back, reference evaluation)."""

    artifact: Path
    package: Path
    record: dict
    check: dict | None = None

    @property
    def ok(self) -> bool:
        return self.check is None or bool(self.check.get("ok"))

    def as_dict(self) -> dict:
        return {"export": self.record, "check": self.check}


class CoreAIResult(CoreMLResult):
    """A Core AI asset in an artifact: the manifest's `coreai` record and, when checked, the
    checks (interface, f8E4M3FN weights read back, the Core AI runtime against PyTorch);
    `package` is the asset (also `asset`)."""

    @property
    def asset(self) -> Path:
        return self.package


@dataclass
class QuantizeResult:
    """A written artifact: where it is and its manifest (with the summary `quantize` prints)."""

    output: Path
    manifest: Manifest
    calibration: Calibration | None = None  # when the fp8 scheme was calibrated in this call
    coreml: CoreMLResult | None = None  # when a Core ML package was exported too
    coreai: CoreAIResult | None = None  # when a Core AI asset was exported too
    manifest_sha256: str | None = None  # of the manifest file as written: pin it (`verify --manifest-sha256`)
    upload: UploadResult | None = None  # when it was published to the hub too
    warnings: list[str] = field(default_factory=list)  # e.g. an FP8 source quantized a second time

    @property
    def summary(self) -> dict:
        return self.manifest.summary

    def as_dict(self) -> dict:
        return {"output": str(self.output), **self.summary, "manifest_sha256": self.manifest_sha256,
                **({"warnings": self.warnings} if self.warnings else {})}


@dataclass
class CalibrateResult:
    """Static input scales: the calibration and where its scales were written."""

    calibration: Calibration
    written_to: Path
    into_artifact: bool  # True: the artifact now has the static scheme; False: a scales file
    manifest: Manifest | None = None  # the artifact's new manifest, when written into one


@dataclass
class ValidationResult:
    """What `validate` measured: accuracy and latency of the FP8 artifact against its BF16
    baseline on one device, with the settings and kernel decisions; `as_dict()` is what is
    recorded in the manifest's `validation` block (plus the Core ML part)."""

    kind: str  # "causal-lm" | "encoder" | "diffusion-step"
    device: str
    device_name: str
    scheme: str
    weights: str
    accuracy: dict
    weight_bytes: dict
    settings: dict
    baseline: str
    eval_data: str
    torch: str
    measured_at: str
    kernels: list = field(default_factory=list)
    dequantized_at_load: list = field(default_factory=list)
    latency: dict | None = None
    speedup: dict | None = None  # BF16 median / FP8 median per phase
    verdict: dict | None = None  # per phase: ratio, run-to-run spread, "faster" | "slower" | "no clear difference"
    recorded: str | None = None  # the manifest written, None when the checkpoint has none
    coreml: dict | None = None  # Core ML runtime check (macOS) or why it was skipped; None without a package
    coreai: dict | None = None  # Core AI latency beside PyTorch (Linux CPU runtime, or per unit on macOS); None without an asset

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None or k in ("recorded", "coreml", "coreai")}


# --------------------------------------------------------------------------- options


def calibration_options(**kw: Any) -> CalibOptions:
    """Calibration settings (data, num_samples, seq_len, seed, observer, percentile, device,
    sequential, ignore, trust_remote_code, data_revision, token): `calibrate.CalibOptions` (no torch)."""
    from .calibrate import CalibOptions

    return CalibOptions(**kw)


def validate_options(**kw: Any) -> ValidateOptions:
    """Validation settings (baseline, eval_data, device, seq_len, max_samples, prefill_len,
    decode_tokens, repeats, rounds, warmup, latency, compile, write): `runtime.validate.ValidateOptions`."""
    from .runtime.validate import ValidateOptions

    return ValidateOptions(**kw)


# --------------------------------------------------------------------------- quantize


def default_output(source_name: str, scheme: str) -> Path:
    """`<last part of the repo id or folder name>-<scheme>`, in the current folder."""
    return Path(f"{source_name.split('/')[-1]}-{scheme}")


def quantize(
    source: str | Path,
    output: str | Path | None = None,
    *,
    scheme: str | None = None,
    weights: str | None = None,
    block_size: int | None = None,
    revision: str | None = None,
    token: str | None = None,
    ignore: list[str] | tuple[str, ...] = (),
    trust_remote_code: bool = False,
    experts_layout: str = "per-expert",
    force: bool = False,
    calibration: CalibOptions | None = None,
    scales_file: str | Path | None = None,
    coreml: ExportOptions | None = None,
    coreai: CoreAIOptions | None = None,
    dtype: str | None = None,
    max_shard_size: int | str = "1GB",
    upload_repo: str | None = None,
    private: bool = False,
    format: str | None = None,
    component: str | None = None,
    progress: Progress | None = None,
) -> QuantizeResult:
    """Quantize a Hugging Face model to an FP8 compressed-tensors artifact, or a diffusion
    transformer to FP8 for ComfyUI or diffusers (docs/diffusion.md).

    Args:
        source: a hub repo id (downloaded with huggingface_hub into its cache) or a local folder.
        output: the artifact folder [default: `<name>-<scheme>` in the current folder].
        scheme: "fp8-dynamic" (per-token activations at run time), "fp8" (static activation
            scales from calibration) or "fp8-weight-only" [default: fp8-dynamic; for an FP8
            source (FineGrainedFP8 or compressed-tensors), the source's own, its codes kept].
        weights: weight scale granularity, "row", "tensor" or "block" [default: the scheme's;
            for an FP8 source, the source's own, so its e4m3 codes are kept as they are].
        block_size: the edge of square weight blocks for `weights="block"` [default: 128].
        revision: branch, tag or commit of a hub repo.
        token: Hugging Face token for gated or private repos (also for a calibration dataset).
        ignore: Linear modules kept unquantized (globs, `re:` regexes or name suffixes).
        trust_remote_code: allow an architecture defined by code in the repo.
        experts_layout: fused MoE experts written "per-expert" (loads everywhere) or as in the
            "checkpoint" (fused; only mpsconvert's runtime loads it).
        force: replace an existing output (only once the new one is complete).
        calibration: for scheme "fp8", how to calibrate [default: the built-in text, 128 x 512
            tokens, minmax]; ignored when `scales_file` is given.
        scales_file: for scheme "fp8", input scales written earlier by `calibrate(..., output=FILE)`.
        coreml: also export a Core ML package into the artifact (and check it).
        coreai: also export a Core AI asset into the artifact (and check it).
        dtype: "bfloat16", "float16" or "float32" for the tensors that stay unquantized
            (embeddings, lm_head, norms) [default: copied bit for bit in the source's dtype].
        max_shard_size: the largest weight file, bytes or "1GB" / "500MB" / "2GiB" (as
            `save_pretrained` reads it) [default: 1GB]: `runtime.load` hashes the files on a
            thread each, so smaller shards verify faster.
        upload_repo: then publish the artifact to this hub repo (`upload`), with `token`.
        private: create `upload_repo` private.
        format: for a diffusion model (a diffusers pipeline or component, or an original-repo
            `.safetensors` file): "comfyui" (one file for ComfyUI, per-tensor scales),
            "comfyui-legacy" (its older `scaled_fp8` layout) or "diffusers" (a folder that
            diffusers loads through SDNQ, per-row scales) [default: diffusers; comfyui for a
            single file]. Language models take no format (compressed-tensors).
        component: the pipeline component to quantize [default: transformer].
        progress: `progress(phase, done, total, detail)` (phases "calibrate", "quantize", "coreml export",
            "coreai export", "decode check").

    Returns:
        QuantizeResult: the output folder and its manifest (and the manifest file's sha256, to
        pin); the calibration when one ran here; the Core ML package when asked for; the upload
        when asked for.

    Raises:
        SourceError: the source cannot be found, downloaded or used (pickles, already quantized, ...).
        QuantizationError: a tensor cannot be quantized (NaN/inf) or fp8 scales are missing.
        ExportError: the artifact was written but its Core ML or Core AI export failed (the message says so).
        UploadError: the artifact was written but its upload failed (the message says so), or
            offline mode is on (checked before converting).
        MpsconvertError: any other problem the caller can fix (output exists, disk full, ...).
    """
    from . import source as sources

    if upload_repo is not None:  # a bad repo id or offline mode: said before the conversion, not after
        from . import publish

        publish.check_repo_id(upload_repo)
        if publish.offline():
            raise UploadError(f"--upload-repo {upload_repo} needs the hub, and Hugging Face offline mode is on (HF_HUB_OFFLINE)",
                              "unset HF_HUB_OFFLINE, or drop --upload-repo and run `mpsconvert upload` later")

    if block_size is not None and weights != "block":
        raise MpsconvertError(f"--block-size {block_size} applies to block weights only", "add --weights block, or drop --block-size")
    sch = Scheme.make(scheme or "fp8-dynamic", weights, block_size)
    if not sch.needs_calibration and (scales_file is not None or (calibration is not None and calibration.data is not None)):
        raise MpsconvertError(f"calibration data and scales only apply to --scheme fp8 (got --scheme {sch.name})", "add --scheme fp8, or drop them")
    # Where the output goes, and whether it may, before any work (torch, a download, a GGUF unpacked):
    # a local folder is read now (a config and an index), a hub id only named.
    path = sources.local_path(str(source))
    gguf_file = path if sources.is_gguf(path) else None
    snap = (sources.resolve(str(source), revision=revision, token=token, diffusion=True, component=component)
            if path is not None and gguf_file is None else None)

    def output_for(snap, name: str) -> Path:
        """The output folder: -o, or the default name for this source (a diffusion model's own)."""
        if output is not None:
            return Path(output)
        if snap is not None and snap.diffusion is not None:
            from .convert.diffusion.run import default_format, default_output as diffusion_output

            return diffusion_output(snap, format or default_format(snap))
        own = snap.fp8.scheme if snap is not None and snap.fp8 is not None and scheme is None and weights is None else sch
        return default_output(name, own.name)

    out = output_for(snap, gguf_file.stem if gguf_file else snap.repo_id or snap.path.name if snap else str(source))
    with contextlib.ExitStack() as claimed:
        claimed.enter_context(atomic.claim(out))  # every step below (exports, upload) runs under this one lock
        atomic.check_replaceable(out, force=force, is_ours=layout.is_ours, protect=(path,) if path is not None else ())
        if snap is not None:
            snap.start_hashing()  # a local folder: hashed while torch and transformers load
        from .convert.quantize import shard_size_bytes

        shard_bytes = shard_size_bytes(max_shard_size)  # a bad size is said before anything is downloaded
        from .extras import require

        if coreml is not None:  # a missing extra is said before the conversion, not after it
            require("coremltools", "coreml", "Core ML export (--coreml)")
        if coreai is not None:
            require("coreai.authoring", "coreai", "Core AI export (--coreai)")
        if gguf_file is not None:
            from .convert.gguf import unpacked

            snap = claimed.enter_context(unpacked(gguf_file, dtype))
        elif snap is None:
            snap = sources.resolve(str(source), revision=revision, token=token, diffusion=True, component=component)
            if output_for(snap, snap.repo_id) != out:  # an FP8 or diffusion hub source names its default output itself
                out = output_for(snap, snap.repo_id)
                claimed.enter_context(atomic.claim(out))
                atomic.check_replaceable(out, force=force, is_ours=layout.is_ours)
        if snap.diffusion is not None or format is not None:
            from .convert.diffusion.run import quantize_source

            llm_only = {"--scheme": scheme, "--weights": weights, "--scales": scales_file, "--coreml": coreml, "--coreai": coreai,
                        "--dtype": dtype, "--calib-data": calibration is not None and calibration.data is not None,
                        "--experts-layout": experts_layout != "per-expert"}
            out, manifest = quantize_source(snap, out, format, ignore=list(ignore), force=force, max_shard_size=shard_bytes,
                                            llm_only=llm_only, progress=progress)
            return _published(QuantizeResult(output=out, manifest=manifest), upload_repo, private, token, progress)
        if snap.fp8 is not None and scheme is None and weights is None:
            sch = snap.fp8.scheme  # the source's own: its e4m3 codes are kept as they are
        return _quantize_claimed(snap, out, sch, ignore=ignore, trust_remote_code=trust_remote_code, experts_layout=experts_layout,
                                 force=force, calibration=calibration, scales_file=scales_file, coreml=coreml, coreai=coreai, dtype=dtype,
                                 shard_bytes=shard_bytes, upload_repo=upload_repo, private=private, token=token, progress=progress)


def _quantize_claimed(snap, out: Path, sch: Scheme, *, ignore, trust_remote_code, experts_layout, force, calibration, scales_file,
                      coreml, coreai, dtype, shard_bytes, upload_repo, private, token, progress) -> QuantizeResult:
    """`quantize` of a language model once its source is resolved and its output claimed (atomic.claim)."""
    snap.start_hashing()  # overlaps the imports and planning below
    from .convert.quantize import Options, check_fp8_source, quantize_snapshot

    check_fp8_source(snap, sch)
    opts = Options(scheme=sch, ignore=list(ignore), force=force, trust_remote_code=trust_remote_code, experts_layout=experts_layout,
                   dtype=dtype, max_shard_size=shard_bytes)
    cal = None
    if sch.needs_calibration and not (snap.fp8 is not None and sch == snap.fp8.scheme):  # a static FP8 source brings its scales
        if scales_file is not None:
            from .calibrate.artifact import load_scales

            opts.input_scales, record = load_scales(Path(scales_file))
            opts.calibration = {**record, "scales_file": str(scales_file)}
        else:
            copts = replace(calibration or calibration_options(), ignore=list(ignore), trust_remote_code=trust_remote_code)
            if copts.token is None:
                copts = replace(copts, token=token)
            cal = _calibrate_folder(snap.path, copts, progress)
            opts.input_scales, opts.calibration = cal.scales, cal.record
        opts.device = opts.calibration.get("device", opts.device)
    manifest = quantize_snapshot(snap, out, opts, progress)
    result = QuantizeResult(output=out, manifest=manifest, calibration=cal)
    from .manifests.card import source_precision_note

    if note := source_precision_note(manifest.source):  # a GGUF below 8 bits: said in the summary, as in the card
        result.warnings.append(note)
    if snap.fp8 is not None and sch != snap.fp8.scheme:
        sqnrs = sorted(r["sqnr_db"] for r in manifest.tensors.values() if r.get("sqnr_db") is not None)
        measured = (f"round-trip SQNR against the source: worst {sqnrs[0]:.1f} dB, median {sqnrs[len(sqnrs) // 2]:.1f} dB"
                    if sqnrs else "round-trip SQNR: exact")
        result.warnings.append(f"the source is already FP8 ({snap.fp8.layout}, {snap.fp8.scheme.weights} scales); {sch.name} with "
                               f"{sch.weights} scales dequantized and re-quantized it, which rounds twice ({measured}); "
                               "drop --scheme/--weights to keep its codes as they are")
    if coreml is not None:
        try:
            result.coreml = export_coreml(out, seq_len=str(coreml.seq_len), weights=coreml.weights, frontend=coreml.frontend,
                                          kv_cache=coreml.kv_cache, max_len=coreml.max_len, force=True, progress=progress)
        except MpsconvertError as e:
            raise ExportError(f"{out} was written, but its Core ML export failed: {e.problem}",
                              e.fix or "run `mpsconvert export-coreml` on it to retry") from e
    if coreai is not None:
        try:
            result.coreai = export_coreai(out, max_len=coreai.max_len, compute=coreai.compute, force=True, progress=progress)
        except MpsconvertError as e:
            raise ExportError(f"{out} was written, but its Core AI export failed: {e.problem}",
                              e.fix or "run `mpsconvert export-coreai` on it to retry") from e
    return _published(result, upload_repo, private, token, progress)


def _published(result: QuantizeResult, upload_repo: str | None, private: bool, token: str | None,
               progress: Progress | None) -> QuantizeResult:
    """The end of every quantize: the upload when asked for, and the manifest's sha256 to pin."""
    from .manifests.manifest import manifest_sha256

    out = result.output
    if upload_repo is not None:
        try:
            result.upload = upload(out, upload_repo, private=private, token=token, progress=progress)
        except MpsconvertError as e:
            raise UploadError(f"{out} was written, but its upload failed: {e.problem}",
                              e.fix or f"run `mpsconvert upload {out} {upload_repo}` to retry") from e
        result.manifest = Manifest.read(out)
    result.manifest_sha256 = manifest_sha256(out)
    return result


# --------------------------------------------------------------------------- calibrate


def _calibrate_folder(model_dir: Path, opts: CalibOptions, progress: Progress | None) -> Calibration:
    from .calibrate.run import calibrate as run

    return run(model_dir, opts, progress)


def calibrate(
    target: str | Path,
    output: str | Path | None = None,
    *,
    options: CalibOptions | None = None,
    revision: str | None = None,
    token: str | None = None,
    progress: Progress | None = None,
) -> CalibrateResult:
    """Measure static FP8 input scales on real text.

    Args:
        target: an FP8 artifact folder (calibrated as it will run, from its FP8 weights), or a
            source model (hub id or folder).
        output: a scales file to write (for `quantize(..., scheme="fp8", scales_file=...)`);
            required for a source; for an artifact, omit it to write the scales into the artifact.
        options: how to calibrate (`calibration_options(...)`); an artifact's own ignore
            patterns are used for it.
        revision, token: for a hub source (and the token for a calibration dataset).
        progress: `progress("calibrate", done, total, detail)`.

    Returns:
        CalibrateResult: the calibration (scales, record, warnings) and where it was written.

    Raises:
        SourceError, DataError, QuantizationError, DeviceError, ArtifactError: as the inputs warrant.
        MpsconvertError: a source given without `output`.
    """
    from .calibrate.artifact import dequantized_snapshot, save_scales, write_into_artifact
    from .manifests.verify import check_before_use
    from .source import resolve

    opts = options or calibration_options()
    if opts.token is None and token is not None:
        opts = replace(opts, token=token)
    path = Path(target).expanduser()
    atomic.recover(path)
    if layout.is_artifact(path):
        # Written into: under the artifact's lock from before any work to the card. Verified first,
        # every hash, before any of its config, code or weights is used (and never re-hashed unverified).
        with atomic.claim(path) if output is None else contextlib.nullcontext():
            check_before_use(path, opts.trust_remote_code)
            ignore = Manifest.read(path).recipe.get("ignore_patterns")
            if ignore is not None and not (isinstance(ignore, list) and all(isinstance(x, str) for x in ignore)):
                raise ArtifactError(f"{path}/{layout.MANIFEST_NAME}: recipe.ignore_patterns is not a list of patterns", "re-create the artifact")
            opts = replace(opts, ignore=list(ignore or opts.ignore))
            with dequantized_snapshot(path) as snap_dir:
                cal = _calibrate_folder(snap_dir, opts, progress)
            cal.record["weights"] = "the artifact's FP8 weights, dequantized"
            if output is not None:
                save_scales(Path(output), cal)
                return CalibrateResult(cal, Path(output), into_artifact=False)
            write_into_artifact(path, cal)
            _refresh_card(path)
        return CalibrateResult(cal, path, into_artifact=True, manifest=Manifest.read(path))
    if output is None:
        raise MpsconvertError(f"{target} is a source model, not an mpsconvert artifact", "pass -o scales.json, or point at an artifact folder")
    snap = resolve(str(target), revision=revision, token=token)
    cal = _calibrate_folder(snap.path, opts, progress)
    save_scales(Path(output), cal)
    return CalibrateResult(cal, Path(output), into_artifact=False)


# --------------------------------------------------------------------------- check


def verify(artifact: str | Path, *, check_hashes: bool = True, trust_remote_code: bool = False,
           manifest_sha256: str | None = None, progress: Progress | None = None) -> VerifyReport:
    """Check an artifact: every file's sha256 against the manifest, and its consistency (every
    FP8 weight has its scale, shapes and dtypes as config.json's model says).

    Args:
        artifact: the artifact folder (or any compressed-tensors FP8 checkpoint: then only the
            structural checks run, and the report says hashes were not checked).
        check_hashes: hash every file (False: structure only, much faster on big artifacts).
        trust_remote_code: allow building an architecture defined by code in the artifact (only
            once every file, that code included, matched its hash).
        manifest_sha256: the sha256 the manifest file itself must have (printed by `quantize`):
            pins the whole artifact, since the manifest holds every other file's hash.
        progress: `progress("verify", bytes_done, bytes_total, file)`.

    Returns:
        VerifyReport: every problem found (`report.ok` when there are none; no manifest is a
        problem: nothing can be verified), files present but unlisted (`report.unlisted`) and
        warnings; never raises for a bad artifact.
    """
    from .runtime.loader import verify as run

    return run(Path(artifact), check_hashes=check_hashes, trust_remote_code=trust_remote_code, progress=progress,
               manifest_sha256=manifest_sha256)


def inspect(artifact: str | Path) -> Manifest:
    """The artifact's manifest: source, recipe, per-tensor records, files, and later checks.

    Raises:
        ArtifactError: no manifest, or one this version cannot read.
    """
    return Manifest.read(Path(artifact))


def validate(artifact: str | Path, *, options: ValidateOptions | None = None, progress: Progress | None = None) -> ValidationResult:
    """Accuracy and latency of an FP8 artifact against its BF16 baseline, on one device.

    Causal LMs: perplexity of both, mean KL and top-1 agreement; encoders: embedding cosine.
    Latency: prefill and decode (batch 1), median and p95, peak memory. Results are recorded in
    the manifest (`validation`) unless `options.write` is False; an artifact with a Core ML
    package also gets the Core ML runtime check (macOS only; elsewhere the result says why not).

    Args:
        artifact: the artifact folder.
        options: `validate_options(...)` [default: the bundled text, 8 x 512 tokens, auto device].
        progress: `progress(phase, done, total, detail)` (phases "load fp8", "load bf16",
            "accuracy", "latency").

    Returns:
        ValidationResult.

    Raises:
        SourceError: the baseline is unknown or unavailable (pass `options.baseline`).
        DataError: the eval text cannot be read or is too short.
        DeviceError: the device is not there, or ran out of memory.
        ArtifactError: the artifact fails verification.
    """
    from .runtime.validate import validate as run

    opts = options or validate_options()
    artifact = Path(artifact)
    writes = opts.write and layout.is_artifact(artifact)
    # The lock before any work: a second writer is refused now, not after a 48-minute run.
    with atomic.claim(artifact) if writes else contextlib.nullcontext(), contextlib.ExitStack() as stack:
        if layout.is_artifact(artifact) and layout.diffusion_format(Manifest.read(artifact)):  # one denoising step (docs/diffusion.md)
            from .convert.diffusion.load import load_pair
            from .runtime.validate_diffusion import validate as run_step

            result = ValidationResult(**run_step(artifact, opts, load_pair, progress))
            if result.recorded:
                _refresh_card(artifact)
            return result
        gguf = _gguf_baseline(artifact, opts, stack)
        if gguf is not None:
            opts = replace(opts, baseline=str(gguf[1]))
        result = ValidationResult(**run(artifact, opts, progress))
        if gguf is not None:
            _name_gguf_baseline(artifact, result, gguf)
        # The Apple parts run with the settings the PyTorch rows were measured with (their defaults
        # resolved by the run, recorded in `settings`); a failure in one is said beside the recorded
        # validation, never instead of it.
        failure = None
        for key, name, part in (("coreml", "Core ML", lambda: _coreml_runtime(artifact, result.settings)),
                                ("coreai", "Core AI", lambda: _coreai_runtime(artifact, result.settings, progress))):
            try:
                setattr(result, key, part())
            except MpsconvertError as e:
                setattr(result, key, {"status": "failed", "reason": str(e)})
                failure = failure or ExportError(f"validation results for {artifact} are recorded, but its {name} part failed: {e.problem}",
                                                 e.fix or f"run `mpsconvert validate {artifact}` again once that is fixed")
            except Exception as e:  # a bug: its traceback is kept, once the results are recorded and shown
                setattr(result, key, {"status": "failed", "reason": f"{type(e).__name__}: {e}"})
                failure = failure or e
        if result.recorded:
            _refresh_card(artifact)
    if failure is not None:
        failure.result = result  # what was measured, for the caller to show
        raise failure
    return result


def _gguf_baseline(artifact: Path, opts: ValidateOptions, stack: contextlib.ExitStack) -> tuple[dict, Path] | None:
    """An artifact quantized from a GGUF file is compared with that file, dequantized as quantize
    dequantized it (convert/gguf.py): (the manifest's source, the unpacked folder), or None when
    the source is not a GGUF or a baseline was given."""
    if opts.baseline is not None or not layout.is_artifact(artifact):
        return None
    src = Manifest.read(artifact).source
    if not isinstance(src.get("gguf"), dict):
        return None
    from .errors import SourceError
    from .manifests.hashing import sha256_file

    path = Path(str(src.get("path")))
    want = (src.get("files") or {}).get(path.name)
    if not path.is_file():
        raise SourceError(f"the GGUF this artifact was made from ({path}) is not here", "pass --baseline <the GGUF's model folder or hub id>")
    if want and sha256_file(path) != want:
        raise SourceError(f"{path} is not the GGUF this artifact was made from (its sha256 differs from the manifest's)",
                          "pass --baseline <the source model>, or restore that file")
    from .convert.gguf import unpacked

    snap = stack.enter_context(unpacked(path))  # validate's baseline runs in bfloat16 whatever quantize unpacked to
    return src, snap.path


def _name_gguf_baseline(artifact: Path, result: ValidationResult, gguf: tuple[dict, Path]) -> None:
    """The baseline is the GGUF file (dequantized in a temporary folder): say so in the result and
    in its record, not the temporary folder's name."""
    src, _ = gguf
    result.baseline = f"{src['path']} ({src['gguf'].get('unpacked', 'dequantized')})"
    if result.recorded:
        with layout.update_manifest(artifact) as m:
            m.extra["validation"][f"{result.device_name} ({result.device})"]["baseline"] = result.baseline


def _refresh_card(artifact: Path) -> None:
    """The model card says what the manifest now says (validation, exports, calibration)."""
    from .manifests import card

    card.refresh(artifact)


def _coreml_runtime(artifact: Path, settings: dict) -> dict | None:
    """The Core ML part of validate: only for artifacts with a package; on macOS only (else
    'skipped'). Stateful decoders: prefill of `prefill_len` and `decode_tokens` steps through
    `make_state()` states per compute unit, beside PyTorch on MPS. `settings`: those the
    validation ran with (`ValidationResult.settings`, every default resolved)."""
    if not layout.is_artifact(artifact) or "coreml" not in Manifest.read(artifact).extra:
        return None
    from .convert.coreml.check import coreml_runtime_check

    res = coreml_runtime_check(artifact, prefill_len=settings["prefill_len"], decode_tokens=settings["decode_tokens"])
    if settings["write"] and res.get("status") != "skipped":
        with layout.update_manifest(artifact) as m:
            m.extra["coreml_runtime"] = res
    return res


def _coreai_runtime(artifact: Path, settings: dict, progress: Progress | None) -> dict | None:
    """The Core AI part of validate (only for artifacts with an asset): `coreai_latency`, or why
    it was skipped (no latency asked for, the coreai extra missing). `settings`: those the
    validation ran with (`ValidationResult.settings`: warmup and repeats resolved for the device)."""
    if not layout.is_artifact(artifact) or "coreai" not in Manifest.read(artifact).extra:
        return None
    if not settings["latency"]:
        return {"status": "skipped", "reason": "latency not asked for (--no-latency)"}
    from .extras import require

    try:
        require("coreai.authoring", "coreai", "the Core AI latency check")
    except MpsconvertError as e:
        return {"status": "skipped", "reason": str(e)}
    if progress:
        progress("coreai latency", 0, None, "Core AI runtime beside PyTorch")
    # at most 3 timed prefills: on the Linux CPU runtime one prefill of 512 tokens takes tens of seconds
    return coreai_latency(artifact, prefill_len=settings["prefill_len"], decode_tokens=settings["decode_tokens"],
                          warmup=min(settings["warmup"], 2), prefill_repeats=min(settings["repeats"], 3), write=settings["write"])


def coreai_latency(artifact: str | Path, *, prefill_len: int = 64, decode_tokens: int = 16, warmup: int = 2,
                   prefill_repeats: int = 3, units: list[str] | None = None, write: bool = True) -> dict:
    """Prefill time and decode tokens/s of the artifact's Core AI asset beside PyTorch on the CPU,
    same prompt (real text), same number of tokens.

    On Linux the rows are "Core AI runtime, Linux CPU" (the runtime bundled in coreai-core) and
    PyTorch CPU; on macOS 27+ one row per compute unit (`units`: cpu, gpu, neural_engine) through
    the OS runtime. Recorded in the manifest's `coreai_runtime` unless `write` is False.

    Args:
        artifact: the artifact folder (with model.aimodel).
        prefill_len: prompt tokens (shortened to fit the asset's cache).
        decode_tokens: single-token steps timed after the prompt (median and p95).
        warmup: untimed steps (and one untimed prefill) first.
        prefill_repeats: timed prefills, each in a fresh conversation (median and p95).
        units: macOS compute units [default: all three].
        write: record the result in the manifest.

    Returns:
        {"status": "ran", "inputs", "rows": [...]} or {"status": "skipped", "reason"}.

    Raises:
        MissingExtraError: coreai-core is not installed.
        ArtifactError: there is no asset.
    """
    from .extras import require

    require("coreai.authoring", "coreai", "the Core AI latency check")
    from .convert.coreai.check import coreai_latency as run

    artifact = Path(artifact)
    res = run(artifact, prefill_len=prefill_len, decode_tokens=decode_tokens, warmup=warmup, units=units, prefill_repeats=prefill_repeats)
    if write and res.get("status") == "ran":
        with layout.update_manifest(artifact) as m:
            m.extra["coreai_runtime"] = res
    return res


# --------------------------------------------------------------------------- Core ML


def export_coreml(
    artifact: str | Path,
    *,
    seq_len: str | int = "128",
    weights: str = "fp8-lut",
    frontend: str = "auto",
    kv_cache: bool = True,
    max_len: int | None = None,
    force: bool = False,
    check: bool = True,
    samples: int = 3,
    decode_steps: int = 16,
    progress: Progress | None = None,
) -> CoreMLResult:
    """Export an FP8 artifact to a Core ML ML program (`<artifact>/model.mlpackage`), then check it.

    Causal LMs: the stateful decoder (macOS 15 / iOS 18): `main(input_ids int32 [1, T], position
    int32 [1]) -> logits [1, T, vocab]`, the KV cache in states `key_cache_i` / `value_cache_i`;
    with `kv_cache=False` the stateless input_ids -> logits. Encoders: input_ids, attention_mask
    -> embeddings. The package is built under a temporary name and renamed; a failed export
    leaves the artifact as it was.

    Args:
        artifact: the artifact folder.
        seq_len: encoders and stateless packages: a fixed length ("128") or a range ("1:512").
        kv_cache: causal LMs as the stateful decoder (default) or stateless.
        max_len: the stateful decoder's cache length [default: 2048, or the model's
            max_position_embeddings when smaller].
        decode_steps: stateful decoders: teacher-forced decode steps in the reference evaluation.
        weights: "fp8-lut" (FP8 codes as an 8-bit palette, one byte per weight), "int8" or "fp16".
        frontend: "auto" (torch.export, then torch.jit.trace), "torch.export" or "torch.jit.trace".
        force: replace an existing package.
        check: run the checks that work anywhere after the export (recorded in the manifest).
        samples: text samples for the reference evaluation.
        progress: `progress("coreml export", step, steps, message)`.

    Returns:
        CoreMLResult: the manifest's record of the package, and the check results.

    Raises:
        MissingExtraError: coremltools is not installed (`pip install 'mpsconvert[coreml]'`).
        ExportError: the architecture or an op cannot be converted, or the package failed its checks.
        MpsconvertError: the package exists (pass force), or the settings are invalid.
    """
    from .extras import require

    require("coremltools", "coreml", "Core ML export")
    from .convert.coreml.export import export_coreml as run

    artifact = Path(artifact)
    opts = ExportOptions(seq_len=SeqLen.parse(seq_len), weights=weights, force=force, frontend=frontend, kv_cache=kv_cache, max_len=max_len)
    with atomic.claim(artifact):  # export, card and check under one lock: a second export is refused before any work
        record = run(artifact, opts, progress)
        _refresh_card(artifact)
        result = CoreMLResult(artifact, artifact / record["package"], record)
        if check:
            result = check_coreml(artifact, samples=samples, decode_steps=decode_steps, progress=progress, verify=False)
    return result


def check_coreml(artifact: str | Path, *, samples: int = 3, decode_steps: int = 16, progress: Progress | None = None,
                 verify: bool = True) -> CoreMLResult:
    """Check the Core ML package already in an artifact (no Apple hardware needed): its spec,
    every FP8 weight read back bit for bit, and a reference evaluation of the program (NOT the
    Core ML runtime) against PyTorch; the result is recorded in the manifest.

    Args:
        artifact: the artifact folder holding `model.mlpackage`.
        samples: text samples for the reference evaluation.
        progress: `progress("coreml check", 0, None, message)`.
        verify: check the artifact's hashes first (False: it was verified just now, by the export).

    Returns:
        CoreMLResult: the package's manifest record and the check results (`result.ok`).

    Raises:
        MissingExtraError: coremltools is not installed.
        ArtifactError: there is no package, or it is not recorded in the manifest.
        ExportError: the package failed its checks (recorded in the manifest first; the
            exception's `result` holds the CoreMLResult).
    """
    from .extras import require

    require("coremltools", "coreml", "checking a Core ML package")
    from .convert.coreml.check import check_package, record_check

    artifact = Path(artifact)
    with atomic.claim(artifact):  # the check is recorded: the lock is taken before it runs, not after
        if verify:
            from .manifests.verify import check_before_use

            check_before_use(artifact)
        if progress:
            progress("coreml check", 0, None, "reference evaluation, not the Core ML runtime")
        res = check_package(artifact, n_samples=samples, steps=decode_steps, progress=progress)
        record_check(artifact, res)
        result = CoreMLResult(artifact, artifact / res["package"], Manifest.read(artifact).extra.get("coreml", {}), res)
    if not result.ok:
        err = ExportError(f"the Core ML package in {artifact} failed its checks: {_failed_checks(res)}",
                          "re-export with --coreml-weights fp16 to compare, or report the model")
        err.result = result  # what was checked, for the caller to show
        raise err
    return result


def _failed_checks(res: dict) -> str:
    bad = []
    if res.get("interface") and not res["interface"]["ok"]:
        bad.append("; ".join(res["interface"]["problems"]))
    if not res["weights"]["all_ok"]:
        bad.append(f"weights read back differ ({sum(1 for r in res['weights']['tensors'].values() if not r.get('ok'))} tensors)")
    ev = res.get("reference_eval") or res.get("runtime_eval")
    if ev and not ev["ok"]:
        if "prefill" in ev:
            bad.append(f"prefill top-1 {ev['prefill']['top1_agreement']:.1%}, decode top-1 {ev['decode']['top1_agreement']:.1%}, "
                       f"cosine min {min(ev['prefill']['cosine_min'], ev['decode']['cosine_min']):.4f}")
        else:
            bad.append(f"cosine min {ev['cosine_min']:.4f}" + (f", top-1 {ev['top1_agreement']:.1%}" if "top1_agreement" in ev else ""))
    return "; ".join(bad) or "see the recorded check"


# --------------------------------------------------------------------------- Core AI


def export_coreai(
    artifact: str | Path,
    *,
    max_len: int | None = None,
    compute: str = "fp32",
    force: bool = False,
    check: bool = True,
    prompt_len: int = 64,
    decode_steps: int = 32,
    progress: Progress | None = None,
) -> CoreAIResult:
    """Export an FP8 artifact to a Core AI asset (`<artifact>/model.aimodel`), then check it.

    Core AI (macOS / iOS 27+) stores the FP8 weights natively: f8E4M3FN constants (the
    artifact's bytes) with their per-tensor / per-row scales. Causal LMs get the stateful decoder
    that Core ML packages have too; encoders the embeddings interface. Other tensors keep the
    artifact's dtype. The asset is written under a temporary name and renamed; a failed export
    leaves the artifact as it was.

    Args:
        artifact: the artifact folder.
        max_len: causal LMs: the KV cache length; encoders: the longest input [default: 2048,
            or the model's max_position_embeddings when smaller].
        compute: "fp32" (default) or "fp16" (see convert/coreai/__init__.py for why fp32).
        force: replace an existing asset.
        check: run the checks after the export (recorded in the manifest).
        prompt_len: tokens of real text in the checked prefill.
        decode_steps: teacher-forced decode steps checked through the states.
        progress: `progress(phase, done, total, detail)` ("coreai export", "decode check").

    Returns:
        CoreAIResult: the manifest's record of the asset, and the check results.

    Raises:
        MissingExtraError: coreai-core / coreai-torch are not installed (`pip install 'mpsconvert[coreai]'`).
        ExportError: the architecture, an op or a weight cannot be converted, or the asset failed its checks.
        MpsconvertError: the asset exists (pass force), or the settings do not fit the model.
    """
    from .extras import require

    require("coreai.authoring", "coreai", "Core AI export")
    from .convert.coreai.export import export_coreai as run

    artifact = Path(artifact)
    with atomic.claim(artifact):  # export, card and check under one lock: a second export is refused before any work
        record = run(artifact, CoreAIOptions(max_len=max_len, compute=compute, force=force), progress)
        _refresh_card(artifact)
        result = CoreAIResult(artifact, artifact / record["asset"], record)
        if check:
            result = check_coreai(artifact, prompt_len=prompt_len, decode_steps=decode_steps, progress=progress, verify=False)
    return result


def check_coreai(artifact: str | Path, *, prompt_len: int = 64, decode_steps: int = 32, generate: int = 4,
                 progress: Progress | None = None, verify: bool = True) -> CoreAIResult:
    """Check the Core AI asset already in an artifact: its interface, every f8E4M3FN weight read
    back against the artifact, and the Core AI runtime bundled in coreai-core (on Linux: "Core AI
    runtime, Linux CPU") against PyTorch on the same dequantized weights: prefill, teacher-forced
    decode through the states, greedy generation. Recorded in the manifest (`coreai.check`).

    Args:
        artifact: the artifact folder.
        prompt_len: tokens of real text in the prefill.
        decode_steps: teacher-forced decode steps.
        generate: greedy tokens compared with PyTorch's.
        progress: `progress("decode check", done, total, detail)`.
        verify: check the artifact's hashes first (False: it was verified just now, by the export).

    Returns:
        CoreAIResult with `check`.

    Raises:
        MissingExtraError: coreai-core is not installed.
        ArtifactError: there is no asset, or it is not recorded in the manifest.
        ExportError: the asset failed its checks (recorded first; the exception's `result` holds
            the CoreAIResult).
    """
    from .extras import require

    require("coreai.authoring", "coreai", "checking a Core AI asset")
    from .convert.coreai.check import check_asset, record_check

    artifact = Path(artifact)
    with atomic.claim(artifact):  # the check is recorded: the lock is taken before it runs, not after
        if verify:
            from .manifests.verify import check_before_use

            check_before_use(artifact)
        res = check_asset(artifact, prompt_len=prompt_len, steps=decode_steps, generate=generate, progress=progress)
        record_check(artifact, res)
        result = CoreAIResult(artifact, artifact / res["asset"], Manifest.read(artifact).extra.get("coreai", {}), res)
    if not result.ok:
        err = ExportError(f"the Core AI asset in {artifact} failed its checks: {_failed_checks(res)}",
                          "re-export with --compute fp32 to compare, or report the model")
        err.result = result
        raise err
    return result


# --------------------------------------------------------------------------- runtime


def load(path: str | Path, device: str = "auto", dtype: torch.dtype | None = None, verify: bool = True, **kw: Any):
    """Load an FP8 artifact as a transformers model in eval mode, with FP8 layers on GPUs.

    Args:
        path: the artifact folder (ours, or any compressed-tensors FP8 checkpoint).
        device: "auto" (mps > cuda > cpu), "mps", "cuda", "cuda:N" or "cpu"; an unavailable
            device is an error, never a fallback.
        dtype: the compute dtype of unquantized tensors and activations [default: bfloat16].
        verify: check every file's sha256 against the manifest (code and config before they are
            used, the weights as they are read, all before the model is returned).
        **kw: `prefill_m`, `kernel_cache`, `measure`, `trust_remote_code`, `progress`,
            `manifest_sha256` (the manifest file's pinned sha256) (see `runtime.loader.load`).

    Returns:
        The model; `model.mpsconvert` (LoadInfo) says what was verified and which kernel each
        layer shape runs.

    Raises:
        ArtifactError: the artifact fails verification or does not fit its config.
        DeviceError: the device is not available or cannot hold FP8 tensors.
    """
    import torch

    from .runtime.loader import load as run

    return run(Path(path), device=device, dtype=dtype or torch.bfloat16, verify=verify, **kw)


# --------------------------------------------------------------------------- generate / chat

BACKENDS = ("torch", "coreai", "coreml")


@dataclass
class GenerateResult:
    """One generation: the text (without the prompt) and how it ran (`stats`: prompt and
    generation tokens/s, peak memory, device, the token ids, why it stopped)."""

    text: str
    stats: Any  # runtime.generate.GenerationStats

    def as_dict(self) -> dict:
        return {"text": self.text, **self.stats.as_dict()}


class Chat:
    """An open model for a conversation (a context manager: closes the Apple runtime session).
    `say(message, on_text)` -> GenerateResult, the history kept in `history`."""

    def __init__(self, conversation, closer):
        self._conv, self._closer = conversation, closer

    @property
    def history(self) -> list[dict]:
        return self._conv.history

    @property
    def backend(self) -> str:
        return self._conv.decoder.backend

    @property
    def device(self) -> str:
        return self._conv.decoder.device

    def say(self, message: str, on_text=None) -> GenerateResult:
        text, stats = self._conv.say(message, on_text)
        return GenerateResult(text, stats)

    def complete(self, prompt: str, on_text=None, use_template: bool = True) -> GenerateResult:
        """A prompt on its own (no history): what `generate` runs."""
        text, stats = self._conv.complete(self._conv.encode(prompt, use_template), on_text)
        return GenerateResult(text, stats)

    def reset(self) -> None:
        """Forget the conversation (a system message stays)."""
        self._conv.history[:] = [m for m in self._conv.history if m["role"] == "system"]

    def close(self) -> None:
        self._closer.close()

    def __enter__(self) -> "Chat":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _apple_record(artifact: Path, key: str, command: str) -> tuple[dict, Path]:
    """The manifest's record of a stateful Apple export and the package's path, after the whole
    artifact (the package included) verified: a runtime never opens an unchecked package."""
    from .manifests.verify import check_before_use
    from .untrusted import inside

    rec = Manifest.read(artifact).extra.get(key) if layout.is_artifact(artifact) else None
    if not rec:
        raise ArtifactError(f"{artifact} has no {'Core AI asset' if key == 'coreai' else 'Core ML package'}",
                            f"run `mpsconvert {command} {artifact}` first, or use --backend torch")
    if rec.get("task") != "causal-lm" or not rec.get("kv_cache", key == "coreai"):
        raise ArtifactError(f"the {key} export in {artifact} is not a stateful decoder (task {rec.get('task')})",
                            f"re-export it with `mpsconvert {command}` (the default is the stateful decoder)")
    check_before_use(artifact)
    return rec, inside(artifact, rec.get("asset" if key == "coreai" else "package"), what=f"the {key} export")


def _open_decoder(artifact: Path, backend: str, device: str, stack, progress: Progress | None):
    """The decoder for `backend`: the PyTorch model (runtime.load on `device`), the Core AI
    asset on its runtime, or the Core ML package (macOS only)."""
    import sys

    from .runtime import generate as gen

    if backend == "torch":
        from .runtime.validate import _is_causal

        model = load(artifact, device=device, progress=progress)
        if not _is_causal(model.config):
            raise ArtifactError(f"{artifact} is not a causal LM ({', '.join(model.config.architectures or ['?'])})",
                                "generate and chat need a text-generation model; use `mpsconvert validate` for encoders")
        return gen.TorchDecoder(model), model.config
    if backend == "coreai":
        from .extras import require

        require("coreai.authoring", "coreai", "running the Core AI asset")  # first: exporting one needs it too
        rec, asset = _apple_record(artifact, "coreai", "export-coreai")
        from .convert.coreai.check import decoder_runner
        from .convert.coreai.run import Session, quiet

        with quiet():
            session = Session(asset)
        stack.enter_context(session)
        runtime = "Core AI runtime, macOS" if sys.platform == "darwin" else "Core AI runtime, Linux CPU"
        return gen.RunnerDecoder(decoder_runner(session), rec["max_len"], "coreai", runtime), None
    if backend == "coreml":
        if sys.platform != "darwin":  # first: before it sends anyone to export a package this machine cannot run
            raise MpsconvertError("Core ML runs .mlpackage files only on macOS (coremltools cannot predict on this platform)",
                                  "use --backend coreai (runs on Linux) or --backend torch here")
        from .extras import require

        ct = require("coremltools", "coreml", "running the Core ML package")
        rec, package = _apple_record(artifact, "coreml", "export-coreml")
        from .convert.coreml.check import coreml_decoder

        ml = ct.models.MLModel(str(package), compute_units=ct.ComputeUnit.ALL)
        return gen.RunnerDecoder(coreml_decoder(ml), rec["max_len"], "coreml", "Core ML (compute units: all)"), None
    raise MpsconvertError(f"unknown backend {backend!r}", f"use one of: {', '.join(BACKENDS)}")


def chat(
    artifact: str | Path,
    *,
    backend: str = "torch",
    device: str = "auto",
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    system: str | None = None,
    progress: Progress | None = None,
) -> Chat:
    """Open an artifact for text generation: `with chat(dir) as c: c.say("hi", print)`.

    Args:
        artifact: the artifact folder (a causal LM with its tokenizer).
        backend: "torch" (runtime.load on `device`), "coreai" (model.aimodel on the Core AI
            runtime; on Linux the CPU runtime bundled in coreai-core) or "coreml"
            (model.mlpackage; macOS only).
        device: for torch: "auto" (mps > cuda > cpu), "mps", "cuda[:N]" or "cpu".
        max_tokens, temp, top_p, seed: sampling, as mlx-lm names it (temp 0: greedy).
        system: a system message that starts the history.
        progress: `progress(phase, done, total, detail)` while loading.

    Returns:
        Chat: `say(message, on_text)` and `complete(prompt, on_text)` -> GenerateResult.

    Raises:
        ArtifactError: not a causal LM, no tokenizer, or the asked-for export is absent.
        MissingExtraError: the backend's extra is not installed.
        MpsconvertError: Core ML off macOS, bad sampling settings.
        DeviceError: the device is not available.
    """
    import contextlib

    from .runtime import generate as gen

    artifact = Path(artifact)
    sampling = gen.Sampling(max_tokens=max_tokens, temp=temp, top_p=top_p, seed=seed)
    stack = contextlib.ExitStack()
    try:
        tok = gen.load_tokenizer(artifact)
        decoder, config = _open_decoder(artifact, backend, device, stack, progress)
        if config is None:
            from .modeldef import load_config

            config = load_config(artifact, False)
        conv = gen.Conversation(decoder, tok, gen.eos_ids(config, gen.load_generation_config(artifact), tok), sampling, system)
    except BaseException:
        stack.close()
        raise
    return Chat(conv, stack)


def generate(artifact: str | Path, prompt: str, *, on_text=None, use_template: bool = True, **kw: Any) -> GenerateResult:
    """Generate text for one prompt, streaming it through `on_text(piece)` as tokens come.

    Args:
        artifact: the artifact folder.
        prompt: the text; wrapped in the tokenizer's chat template when it has one and
            `use_template` (as mlx_lm.generate does).
        on_text: called with each new piece of text.
        **kw: backend, device, max_tokens, temp, top_p, seed, system, progress (see `chat`).

    Returns:
        GenerateResult: the text and its stats (prompt / generation tokens/s, peak memory, device).

    Raises:
        As `chat`.
    """
    with chat(artifact, **kw) as c:
        return c.complete(prompt, on_text, use_template)


# --------------------------------------------------------------------------- upload


@dataclass
class UploadResult:
    """What went to the hub: repo, its URL, the commit and its message, every file sent."""

    repo: str
    url: str
    revision: str
    commit: str | None
    commit_message: str
    private: bool  # the repo's visibility as the hub reports it after the upload
    endpoint: str
    files: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def upload(artifact: str | Path, repo: str, *, private: bool = False, token: str | None = None, revision: str | None = None,
           verify_first: bool = True, progress: Progress | None = None) -> UploadResult:
    """Publish an artifact to a Hugging Face hub model repo (created if absent).

    The artifact is verified first (every sha256 against the manifest), its model card is
    rewritten to name the repo (how to load it from there), then the whole folder goes up in
    one commit with huggingface_hub, whose message names the scheme and the source commit.

    Args:
        artifact: the artifact folder.
        repo: `org/name` (or `name` under the token's user).
        private: create the repo private. An existing repo keeps its visibility: a public one
            with `private=True` is refused before anything is sent.
        token: a write token [default: HF_TOKEN, else huggingface_hub's stored login].
        revision: the branch to commit to [default: main].
        verify_first: check every file's sha256 before uploading.
        progress: `progress("verify", done, total, file)`.

    Returns:
        UploadResult.

    Raises:
        UploadError: offline mode, the hub unreachable (HF_ENDPOINT), no write rights, a bad repo id.
        ArtifactError: not an artifact, or it fails verification.
    """
    from . import publish
    from .manifests import card

    artifact = Path(artifact)
    publish.check_repo_id(repo)
    if not layout.is_artifact(artifact):
        raise ArtifactError(f"{artifact} is not an mpsconvert artifact (no {layout.MANIFEST_NAME})", "pass the folder `mpsconvert quantize` wrote")
    if publish.offline():  # before any work
        raise UploadError(f"cannot upload to {repo}: Hugging Face offline mode is on (HF_HUB_OFFLINE)",
                          "unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) to upload")
    with atomic.claim(artifact):  # nothing changes the artifact between its check and the commit
        if verify_first:
            report = verify(artifact, progress=progress)
            if not report.ok:
                raise ArtifactError(f"{artifact} fails verification ({report.problems[0]}{' ...' if len(report.problems) > 1 else ''})",
                                    "re-create the artifact; a damaged one is never uploaded")
        card.refresh(artifact, repo=repo)
        up = publish.upload_folder(artifact, repo, private=private, token=token, revision=revision)
    return UploadResult(**up)
