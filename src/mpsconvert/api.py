"""The library's operations: what every command does, callable from Python.

    from mpsconvert import quantize, validate, load
    art = quantize("Qwen/Qwen2.5-0.5B", "qwen-fp8")          # -> QuantizeResult
    report = validate("qwen-fp8")                            # -> ValidationResult
    model = load("qwen-fp8", device="auto")                  # a transformers model with FP8 layers

Each function takes typed keyword arguments, returns a small dataclass, and raises an
`MpsconvertError` subclass (errors.py) for anything the caller can fix; the CLI is a thin layer
over these functions. This module is a facade: each function is its signature, its docstring
and a call into the package that does the work (convert/pipeline.py, calibrate/artifact.py,
runtime/, apple/flow.py, publish.py); where an operation spans two of those packages (quantize's
exports, validate's Apple part), the few lines that join them are here, since the packages do
not import each other. Importing this module is cheap (no torch): heavy imports happen inside the
calls, so `mpsconvert --help` stays fast and a conversion starts hashing its source before
torch loads.

The Apple targets (Core ML, Core AI) come from a registry (apple/registry.py): `export(artifact,
target)` and `check(artifact, target)` take any of them, `targets()` lists them, and the
per-target functions (`export_coreml`, `check_coreai`, ...) are aliases kept for their callers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .version import __version__  # noqa: F401  (re-exported for the CLI)
from .apple import flow
from .apple.coreai import COMPUTE_DTYPES as COREAI_COMPUTE_DTYPES  # noqa: F401
from .apple.coreai import CoreAIOptions
from .apple.coreml import FRONTENDS as COREML_FRONTENDS  # noqa: F401
from .apple.coreml import WEIGHT_MODES as COREML_WEIGHT_MODES  # noqa: F401
from .apple.coreml import ExportOptions, SeqLen
from .apple.flow import ExportResult
from .apple.target import Option, Target  # noqa: F401  (the CLI builds its Apple options from them)
from .infra.atomic import stop_requested  # noqa: F401  (the CLI's signal handlers set it)
from .calibrate import DEFAULT_PERCENTILE, OBSERVERS  # noqa: F401
from .convert import EXPERTS_LAYOUTS, UNQUANTIZED_DTYPES  # noqa: F401
from .manifests.layout import DIFFUSION_FORMATS  # noqa: F401  (quantize --format of a diffusion model)
from .manifests.manifest import Manifest
from .format.schemes import SCHEMES, WEIGHT_GRANULARITIES, Scheme  # noqa: F401
from .infra.progress import Progress
from .workflows import chat as chat_flow, publish as publish_flow, quantize as quantize_flow, validate as validate_flow
from .workflows.apple import targets  # noqa: F401
from .workflows.chat import Chat, GenerateResult, backends  # noqa: F401
from .workflows.publish import UploadResult
from .workflows.quantize import QuantizeResult
from .workflows.validate import ValidationResult

if TYPE_CHECKING:  # heavy modules, for annotations only
    import torch

    from .calibrate import CalibOptions
    from .calibrate.run import Calibration
    from .manifests.verify import VerifyReport
    from .runtime.evaluate.validate import ValidateOptions

__all__ = [
    "quantize", "calibrate", "validate", "verify", "inspect", "export", "check", "targets", "export_coreml", "check_coreml",
    "export_coreai", "check_coreai", "coreai_latency", "load", "generate", "chat", "upload",
    "QuantizeResult", "CalibrateResult", "GenerateResult", "Chat", "UploadResult", "ValidationResult", "ExportResult", "CoreMLResult",
    "CoreAIResult", "ExportOptions", "SeqLen", "CoreAIOptions", "calibration_options", "validate_options",
]

# The results of the Apple targets are one type; the names of the two first targets stay for their callers.
CoreMLResult = CoreAIResult = ExportResult


# --------------------------------------------------------------------------- results


@dataclass
class CalibrateResult:
    """Static input scales: the calibration and where its scales were written."""

    calibration: Calibration
    written_to: Path
    into_artifact: bool  # True: the artifact now has the static scheme; False: a scales file
    manifest: Manifest | None = None  # the artifact's new manifest, when written into one
    pin_sha256: str | None = None  # the artifact's new pin (the weights changed: a pin taken before no longer holds)


# --------------------------------------------------------------------------- options


def calibration_options(**kw: Any) -> CalibOptions:
    """Calibration settings (data, num_samples, seq_len, seed, observer, percentile, device,
    sequential, ignore, trust_remote_code, data_revision, token): `calibrate.CalibOptions` (no torch)."""
    from .calibrate import CalibOptions

    return CalibOptions(**kw)


def validate_options(**kw: Any) -> ValidateOptions:
    """Validation settings (baseline, eval_data, device, seq_len, max_samples, prefill_len,
    decode_tokens, repeats, rounds, warmup, full, latency, compile, write): `runtime.evaluate.validate.ValidateOptions`."""
    from .runtime.evaluate.validate import ValidateOptions

    return ValidateOptions(**kw)


# --------------------------------------------------------------------------- quantize


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
        force: replace an existing output (only once the new one is complete); an artifact of
            mpsconvert only, and one holding files its manifest does not list (a user's notes)
            only with `delete_unlisted`.
        delete_unlisted: with `force`, also delete the files of the old artifact its manifest
            does not list [default: refused, naming them].
        calibration: for scheme "fp8", how to calibrate [default: the built-in text, 128 x 512
            tokens, minmax]; ignored when `scales_file` is given.
        scales_file: for scheme "fp8", input scales written earlier by `calibrate(..., output=FILE)`.
        exports: also export into the artifact (and check) each Apple target named, {target key:
            its export options, or None for its defaults} (`targets()`).
        coreml: also export a Core ML package into the artifact (and check it): `exports={"coreml": coreml}`.
        coreai: also export a Core AI asset into the artifact (and check it): `exports={"coreai": coreai}`.
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
    return quantize_flow.quantize(source, output, scheme=scheme, weights=weights, block_size=block_size, revision=revision, token=token,
                             ignore=ignore, trust_remote_code=trust_remote_code, experts_layout=experts_layout, force=force,
                             delete_unlisted=delete_unlisted, calibration=calibration, scales_file=scales_file,
                             exports={**(exports or {}), **({"coreml": coreml} if coreml is not None else {}),
                                      **({"coreai": coreai} if coreai is not None else {})},
                             dtype=dtype, max_shard_size=max_shard_size, upload_repo=upload_repo, private=private, format=format,
                             component=component, progress=progress)


# --------------------------------------------------------------------------- calibrate


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
    from .calibrate.artifact import calibrate_target

    opts = options or calibration_options()
    if opts.token is None and token is not None:
        opts = replace(opts, token=token)
    from .manifests.manifest import read_once

    cal, written_to, manifest = calibrate_target(target, output, opts, revision=revision, force=force, progress=progress)
    return CalibrateResult(cal, written_to, into_artifact=manifest is not None, manifest=manifest,
                           pin_sha256=read_once(written_to)[2] if manifest is not None else None)


# --------------------------------------------------------------------------- check


def verify(artifact: str | Path, *, check_hashes: bool = True, trust_remote_code: bool = False,
           manifest_sha256: str | None = None, progress: Progress | None = None) -> VerifyReport:
    """Check an artifact: every file's sha256 against the manifest, and its consistency (every
    FP8 weight has its scale, shapes and dtypes as config.json's model says).

    An artifact with its manifest is checked from JSON and safetensors headers alone (no torch,
    no transformers: under a second); the model is built from config.json (weightless) only
    where the manifest does not vouch for that file: a checkpoint of another tool, or a
    config.json that is not the one recorded.

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
    return publish_flow.verify(artifact, check_hashes=check_hashes, trust_remote_code=trust_remote_code, manifest_sha256=manifest_sha256,
                          progress=progress)


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
    """Where the artifact of `manifest` loads and where not (vLLM GPU and CPU, transformers,
    mpsconvert, Core ML / Core AI), with how each is known: the line its model card says
    (manifests/engines.py decides it); None for a diffusion artifact."""
    from .manifests import engines

    return engines.line(manifest)


def validate(artifact: str | Path, *, options: ValidateOptions | None = None, progress: Progress | None = None) -> ValidationResult:
    """Accuracy and latency of an FP8 artifact against its BF16 baseline, on one device.

    Causal LMs: perplexity of both, mean KL and top-1 agreement; encoders: embedding cosine.
    Latency: prefill and decode (batch 1), median and p95, peak memory. Results are recorded in
    the manifest (`validation`) unless `options.write` is False; an artifact with a Core ML
    package also gets the Core ML runtime check (macOS only; elsewhere the result says why not).

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


# --------------------------------------------------------------------------- Apple targets


def export(artifact: str | Path, target: str, *, options: Any = None, check: Any = True, progress: Progress | None = None) -> ExportResult:
    """Export an FP8 artifact to an Apple target's package inside it (Core ML: `model.mlpackage`,
    Core AI: `model.aimodel`; `targets()` lists them), then check it.

    Under the artifact's lock the artifact is verified first (every hash, before any of it is
    used); the package is built and checked in a staged copy of the artifact, and the package,
    its record (with the check) and the model card replace the artifact in one swap: a failed
    export leaves the artifact as it was.

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


def check(artifact: str | Path, target: str, *, options: Any = None, verify: bool = True, progress: Progress | None = None) -> ExportResult:
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
    return flow.measure(Path(artifact), "coreai", write=write, prefill_len=prefill_len, decode_tokens=decode_tokens, warmup=warmup,
                        prefill_repeats=prefill_repeats, units=units)


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
) -> ExportResult:
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
    from .apple.coreml import CheckOptions

    opts = ExportOptions(seq_len=SeqLen.parse(seq_len), weights=weights, force=force, frontend=frontend, kv_cache=kv_cache, max_len=max_len)
    return export(artifact, "coreml", options=opts, check=check and CheckOptions(samples, decode_steps), progress=progress)


def check_coreml(artifact: str | Path, *, samples: int = 3, decode_steps: int = 16, progress: Progress | None = None,
                 verify: bool = True) -> ExportResult:
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
    from .apple.coreml import CheckOptions

    return check(artifact, "coreml", options=CheckOptions(samples, decode_steps), verify=verify, progress=progress)


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
) -> ExportResult:
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
        compute: "fp32" (default) or "fp16" (see apple/coreai/__init__.py for why fp32).
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
    from .apple.coreai import CheckOptions

    opts = CoreAIOptions(max_len=max_len, compute=compute, force=force)
    return export(artifact, "coreai", options=opts, check=check and CheckOptions(prompt_len, decode_steps), progress=progress)


def check_coreai(artifact: str | Path, *, prompt_len: int = 64, decode_steps: int = 32, generate: int = 4,
                 progress: Progress | None = None, verify: bool = True) -> ExportResult:
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
    from .apple.coreai import CheckOptions

    return check(artifact, "coreai", options=CheckOptions(prompt_len, decode_steps, generate), verify=verify, progress=progress)


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
        **kw: `kernel_cache`, `measure`, `trust_remote_code`, `progress`, `compile` (on CUDA, the
            model's generate() at batch 1 with a static cache, compiled by transformers; False: its default),
            `manifest_sha256` (the manifest file's pinned sha256), `prefill_graphs` (on CUDA, a
            prefill of up to 1024 tokens replays its layers as CUDA graphs; False: launched one
            by one) (see `runtime.load.loader.load`).

    Returns:
        The model; `model.mpsconvert` (LoadInfo) says what was verified and which kernel each
        layer shape runs.

    Raises:
        ArtifactError: the artifact fails verification or does not fit its config.
        DeviceError: the device is not available or cannot hold FP8 tensors.
    """
    import torch

    from .runtime.load import loader

    return loader.load(Path(path), device=device, dtype=dtype or torch.bfloat16, verify=verify, **kw)


# --------------------------------------------------------------------------- generate / chat


def chat(
    artifact: str | Path,
    *,
    backend: str = "torch",
    device: str = "auto",
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    system: str | None = None,
    progress: Progress | None = None,
    compile: bool | str | None = None,
) -> Chat:
    """Open an artifact for text generation: `with chat(dir) as c: c.say("hi", print)`.

    Args:
        artifact: the artifact folder (a causal LM with its tokenizer).
        backend: "torch" (runtime.load on `device`), "coreai" (model.aimodel on the Core AI
            runtime; on Linux the CPU runtime bundled in coreai-core) or "coreml"
            (model.mlpackage; macOS only).
        device: for torch: "auto" (mps > cuda > cpu), "mps", "cuda[:N]" or "cpu".
        max_tokens, temp, top_p, top_k, seed: sampling, as mlx-lm names it (temp 0: greedy; top_k 0:
            every token; top-k before top-p, as transformers orders them).
        system: a system message that starts the history.
        progress: `progress(phase, done, total, detail)` while loading.
        compile: torch backend: how the decode step runs (runtime/engine/decoder.py,
            `decode_path`). None: on CUDA the eager step captured as a CUDA graph (seconds), eager
            elsewhere; True or "compile": torch.compile's CUDA graph (~30 s per process, a few
            percent faster per token); "graph"; False or "eager": the eager loop (`--no-compile`).
            Set up before the first token is timed; `stats.decode` says which path ran and what
            it cost (`stats.compile_seconds` too).

    Returns:
        Chat: `say(message, on_text)` and `complete(prompt, on_text)` -> GenerateResult.

    Raises:
        ArtifactError: not a causal LM, no tokenizer, or the asked-for export is absent.
        MissingExtraError: the backend's extra is not installed.
        MpsconvertError: Core ML off macOS, bad sampling settings.
        DeviceError: the device is not available.
    """
    return chat_flow.open_chat(Path(artifact), backend=backend, device=device, max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k,
                           seed=seed, system=system, progress=progress, compile=compile)


def generate(artifact: str | Path, prompt: str, *, on_text=None, use_template: bool = True, **kw: Any) -> GenerateResult:
    """Generate text for one prompt, streaming it through `on_text(piece)` as tokens come.

    Args:
        artifact: the artifact folder.
        prompt: the text; wrapped in the tokenizer's chat template when it has one and
            `use_template` (as mlx_lm.generate does).
        on_text: called with each new piece of text.
        **kw: backend, device, max_tokens, temp, top_p, top_k, seed, system, progress (see `chat`).

    Returns:
        GenerateResult: the text and its stats (prompt / generation tokens/s, peak memory, device).

    Raises:
        As `chat`.
    """
    with chat(artifact, **kw) as c:
        return c.complete(prompt, on_text, use_template)


# --------------------------------------------------------------------------- upload


def upload(artifact: str | Path, repo: str, *, private: bool = False, token: str | None = None, revision: str | None = None,
           verify_first: bool = True, progress: Progress | None = None) -> UploadResult:
    """Publish an artifact to a Hugging Face hub model repo (created if absent).

    The artifact is verified first (every sha256 against the manifest); its model card,
    rewritten to name the repo (how to load it from there), and the manifest go into a staged
    copy; the listed files go up from it in one commit with huggingface_hub, as the bytes that
    were verified (never a path it would reopen), whose message names the scheme and the source
    commit; the staged copy replaces the artifact only once the commit succeeded (a failed
    upload changes nothing local).

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
        ArtifactError: not an artifact, it fails verification, or a file changed after it was
            verified (nothing is sent).
    """
    return publish_flow.upload(artifact, repo, private=private, token=token, revision=revision, verify_first=verify_first, progress=progress,
                          check=verify)
