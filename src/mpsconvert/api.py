"""The library's operations: what every command does, callable from Python.

    from mpsconvert import quantize, validate, load
    art = quantize("Qwen/Qwen2.5-0.5B", "qwen-fp8")          # -> QuantizeResult
    report = validate("qwen-fp8")                            # -> ValidationResult
    model = load("qwen-fp8", device="auto")                  # a transformers model with FP8 layers

A facade: each function is its typed signature, its docstring and one call into a workflow
(workflows/: what joins the packages, under one lock) or a package; each returns a small dataclass
and raises an `MpsconvertError` subclass (errors.py) for anything the caller can fix. Importing it
loads no torch (heavy imports happen inside the calls), so `mpsconvert --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .apple import flow
from .apple.coreai import COMPUTE_DTYPES as COREAI_COMPUTE_DTYPES  # noqa: F401
from .apple.coreai import CoreAIOptions
from .apple.coreml import FRONTENDS as COREML_FRONTENDS  # noqa: F401
from .apple.coreml import ExportOptions, SeqLen  # noqa: F401  (re-exported: __all__)
from .apple.flow import ExportResult
from .apple.protocol import Option, Target  # noqa: F401  (the CLI builds its Apple options from them)
from .calibrate import DEFAULT_PERCENTILE, OBSERVERS  # noqa: F401
from .convert import EXPERTS_LAYOUTS, UNQUANTIZED_DTYPES  # noqa: F401
from .format.schemes import SCHEMES, WEIGHT_GRANULARITIES, Scheme  # noqa: F401
from .infra.atomic import stop_requested  # noqa: F401  (the CLI's signal handlers set it)
from .infra.progress import Progress
from .manifests.layout import DIFFUSION_FORMATS  # noqa: F401  (quantize --format of a diffusion model)
from .manifests.manifest import Manifest
from .version import __version__  # noqa: F401  (re-exported for the CLI)
from .workflows import calibrate as calibrate_flow
from .workflows import publish as publish_flow
from .workflows import quantize as quantize_flow
from .workflows import validate as validate_flow
from .workflows.apple import check_coreai, check_coreml, coreai_latency, export_coreai, export_coreml, targets  # noqa: F401
from .workflows.calibrate import CalibrateResult
from .workflows.chat import Chat, GenerateResult, backends, chat, generate  # noqa: F401
from .workflows.publish import UploadOptions, UploadResult, VerifyOptions
from .workflows.quantize import QuantizeOptions, QuantizeResult
from .workflows.validate import ValidationResult

if TYPE_CHECKING:  # heavy modules, for annotations only
    import torch

    from .calibrate import CalibOptions
    from .manifests.verify import VerifyReport
    from .runtime.evaluate.validate import ValidateOptions

__all__ = """
quantize calibrate validate verify inspect export check targets export_coreml check_coreml export_coreai
check_coreai coreai_latency load generate chat upload QuantizeResult CalibrateResult GenerateResult Chat
UploadResult ValidationResult ExportResult CoreMLResult CoreAIResult ExportOptions SeqLen CoreAIOptions
calibration_options validate_options
""".split()

# One result type for every Apple target; the first two targets' names stay for their callers.
CoreMLResult = CoreAIResult = ExportResult


def calibration_options(**kw: Any) -> CalibOptions:
    """Calibration settings (data, num_samples, seq_len, seed, observer, percentile, device,
    sequential, ignore, trust_remote_code, data_revision, token): `calibrate.CalibOptions` (no torch)."""
    from .calibrate import CalibOptions

    return CalibOptions(**kw)


def validate_options(**kw: Any) -> ValidateOptions:
    """Validation settings (baseline, eval_data, device, seq_len, max_samples, prefill_len, decode_tokens,
    repeats, rounds, warmup, full, latency, compile, write): `runtime.evaluate.validate.ValidateOptions`."""
    from .runtime.evaluate.validate import ValidateOptions

    return ValidateOptions(**kw)


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
    delete_unlisted: bool = False,
    calibration: CalibOptions | None = None,
    scales_file: str | Path | None = None,
    exports: dict[str, Any] | None = None,
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
        force: replace an existing output of mpsconvert (once the new one is complete).
        delete_unlisted: with `force`, also delete files the old artifact's manifest does not list
            (a user's notes) [default: refused, naming them].
        calibration: for scheme "fp8", how to calibrate [default: the built-in text, 128 x 512
            tokens, minmax]; ignored when `scales_file` is given.
        scales_file: for scheme "fp8", input scales written earlier by `calibrate(..., output=FILE)`.
        exports: also export into the artifact (and check) each Apple target named, {target key:
            its export options, or None for its defaults} (`targets()`).
        coreml, coreai: shorthands of `exports={"coreml": coreml}`, `exports={"coreai": coreai}`.
        dtype: "bfloat16", "float16" or "float32" for the tensors that stay unquantized
            (embeddings, lm_head, norms) [default: copied bit for bit in the source's dtype].
        max_shard_size: the largest weight file, bytes or "1GB" / "500MB" / "2GiB" [default: 1GB;
            `runtime.load` hashes the files on a thread each, so smaller shards verify faster].
        upload_repo: then publish the artifact to this hub repo (`upload`), with `token`.
        private: create `upload_repo` private.
        format: for a diffusion model (a diffusers pipeline or component, or an original-repo `.safetensors` file):
            "comfyui" (one file for ComfyUI, per-tensor scales), "comfyui-legacy" (its older `scaled_fp8` layout)
            or "diffusers" (a folder that diffusers loads through SDNQ, per-row scales) [default: diffusers;
            comfyui for a single file]. Language models take no format (compressed-tensors).
        component: the pipeline component to quantize [default: transformer].
        progress: `progress(phase, done, total, detail)` (phases "calibrate", "quantize", "coreml export",
            "coreai export", "decode check").

    Returns:
        QuantizeResult: the output folder and its manifest (and the manifest file's sha256, to pin); the
        calibration when one ran here; the Core ML package when asked for; the upload when asked for.

    Raises:
        SourceError: the source cannot be found, downloaded or used (pickles, already quantized, ...).
        QuantizationError: a tensor cannot be quantized (NaN/inf) or fp8 scales are missing.
        ExportError: the artifact was written but its Core ML or Core AI export failed (the message says so).
        UploadError: the artifact was written but its upload failed (the message says so), or
            offline mode is on (checked before converting).
        MpsconvertError: any other problem the caller can fix (output exists, disk full, ...).
    """
    exports = {**(exports or {}), **{k: v for k, v in (("coreml", coreml), ("coreai", coreai)) if v is not None}}
    to = UploadOptions(upload_repo, private=private, token=token) if upload_repo is not None else None
    steps = dict(calibration=calibration, scales_file=scales_file, exports=exports, upload_to=to, progress=progress)
    return quantize_flow.quantize(source, output, QuantizeOptions.of(locals()), **steps)


def calibrate(
    target: str | Path,
    output: str | Path | None = None,
    *,
    options: CalibOptions | None = None,
    revision: str | None = None,
    token: str | None = None,
    force: bool = False,
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
        force: replace an existing `output` (a scales file mpsconvert wrote; any other file, and
            any path inside the source or an artifact, is refused, with or without it).
        progress: `progress("calibrate", done, total, detail)`.

    Returns:
        CalibrateResult: the calibration (scales, record, warnings) and where it was written.

    Raises:
        SourceError, DataError, QuantizationError, DeviceError, ArtifactError: as the inputs warrant.
        MpsconvertError: a source given without `output`.
    """
    return calibrate_flow.calibrate(
        target, output, options, revision=revision, token=token, force=force, progress=progress
    )


def verify(
    artifact: str | Path,
    *,
    check_hashes: bool = True,
    trust_remote_code: bool = False,
    manifest_sha256: str | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check an artifact: every file's sha256 against the manifest, and its consistency (every
    FP8 weight has its scale, shapes and dtypes as config.json's model says).

    An artifact with its manifest is checked from JSON and safetensors headers alone (no torch:
    under a second); the model is built weightless only where the manifest does not vouch for config.json.

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
    return publish_flow.verify(artifact, VerifyOptions(check_hashes, trust_remote_code, manifest_sha256), progress)


def inspect(artifact: str | Path) -> Manifest:
    """The artifact's manifest: source, recipe, per-tensor records, files, and later checks.

    Raises:
        ArtifactError: no manifest, or one this version cannot read.
        MpsconvertError: a symlink planted under a name mpsconvert reserves beside it.
    """
    from .infra import atomic

    atomic.recover(Path(artifact))  # what a killed run left, as every command does first
    return Manifest.read(Path(artifact))


def engine_line(manifest: Manifest) -> str | None:
    """Which engines load the artifact of `manifest` and which not, as its model card says
    (manifests/engines.py decides it); None for a diffusion artifact."""
    from .manifests import engines

    return engines.line(manifest)


def validate(
    artifact: str | Path, *, options: ValidateOptions | None = None, progress: Progress | None = None
) -> ValidationResult:
    """Accuracy and latency of an FP8 artifact against its BF16 baseline, on one device.

    Causal LMs: perplexity of both, mean KL and top-1 agreement; encoders: embedding cosine.
    Latency: prefill and decode (batch 1), median and p95, peak memory. Recorded in the manifest
    (`validation`) unless `options.write` is False, with each Apple package's runtime check.

    Args:
        artifact: the artifact folder.
        options: `validate_options(...)` [default: the bundled text, auto device; 8 samples of 512 tokens on a
            GPU, 4 of 256 on CPU (`full=True`: 8 of 512 there too); runtime.evaluate.validate.DEFAULTS].
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
    return validate_flow.validate(Path(artifact), options or validate_options(), progress)


def export(
    artifact: str | Path, target: str, *, options: Any = None, check: Any = True, progress: Progress | None = None
) -> ExportResult:
    """Export an FP8 artifact to an Apple target's package inside it (Core ML: `model.mlpackage`,
    Core AI: `model.aimodel`; `targets()` lists them), then check it.

    The artifact is verified first, under its lock; the package is built and checked in a staged
    copy, which replaces the artifact in one swap: a failed export leaves the artifact as it was.

    Args:
        artifact: the artifact folder.
        target: the target's key ("coreml", "coreai").
        options: the target's export options (`targets()[key].options`: `ExportOptions`,
            `CoreAIOptions`) [default: its defaults].
        check: True (the target's default check), the target's check options
            (`targets()[key].check_options`), or False (no check).
        progress: `progress(phase, done, total, detail)`.

    Returns:
        ExportResult: the manifest's record of the package, and the check results (`result.ok`).

    Raises:
        MissingExtraError: the target's extra is not installed.
        ExportError: the architecture or an op cannot be converted, or the package failed its
            checks (recorded first; the exception's `result` holds the ExportResult).
        MpsconvertError: the package exists (pass force in the options), or the settings are invalid.
    """
    return flow.export(Path(artifact), target, options, check, progress)


def check(
    artifact: str | Path, target: str, *, options: Any = None, verify: bool = True, progress: Progress | None = None
) -> ExportResult:
    """Check the package of an Apple target already in an artifact (no Apple hardware needed) and
    record the check in the manifest.

    Args:
        artifact: the artifact folder.
        target: the target's key ("coreml", "coreai").
        options: the target's check options [default: its defaults].
        verify: check the artifact's hashes first.
        progress: `progress(phase, done, total, detail)`.

    Returns:
        ExportResult with `check`.

    Raises:
        MissingExtraError: the target's extra is not installed.
        ArtifactError: there is no package, or it is not recorded in the manifest.
        ExportError: the package failed its checks (recorded first; the exception's `result`
            holds the ExportResult).
    """
    return flow.check(Path(artifact), target, options, verify=verify, progress=progress)


def load(path: str | Path, device: str = "auto", dtype: torch.dtype | None = None, verify: bool = True, **kw: Any):
    """Load an FP8 artifact as a transformers model in eval mode, with FP8 layers on GPUs.

    Args:
        path: the artifact folder (ours, or any compressed-tensors FP8 checkpoint).
        device: "auto" (mps > cuda > cpu), "mps", "cuda", "cuda:N" or "cpu"; an unavailable
            device is an error, never a fallback.
        dtype: the compute dtype of unquantized tensors and activations [default: bfloat16].
        verify: check every file's sha256 against the manifest (code and config before they are
            used, the weights as they are read, all before the model is returned).
        **kw: `kernel_cache`, `measure`, `trust_remote_code`, `progress`, `compile`, `manifest_sha256`,
            `prefill_graphs` (`runtime.load.loader.load` says what each does).

    Returns:
        The model; `model.mpsconvert` (LoadInfo) says what was verified and which kernel each
        layer shape runs (on a CUDA machine's first run: torch's until ours compile; runtime/load/held.py).

    Raises:
        ArtifactError: the artifact fails verification or does not fit its config.
        DeviceError: the device is not available or cannot hold FP8 tensors.
    """
    import torch

    from .runtime.load import loader

    return loader.load(Path(path), device=device, dtype=dtype or torch.bfloat16, verify=verify, **kw)


def upload(
    artifact: str | Path,
    repo: str,
    *,
    private: bool = False,
    token: str | None = None,
    revision: str | None = None,
    verify_first: bool = True,
    progress: Progress | None = None,
) -> UploadResult:
    """Publish an artifact to a Hugging Face hub model repo (created if absent).

    The artifact is verified first; its card (naming the repo) and manifest go into a staged copy;
    the listed files go up in one commit, as the bytes that were verified; the staged copy replaces
    the artifact only once the commit succeeded (a failed upload changes nothing local).

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
        ArtifactError: not an artifact, it fails verification, or a file changed once verified (nothing is sent).
    """
    to = UploadOptions(repo, private=private, token=token, revision=revision)
    return publish_flow.upload(artifact, to, progress, check=verify if verify_first else None)
