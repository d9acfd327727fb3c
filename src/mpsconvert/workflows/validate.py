"""`validate`: the FP8 artifact against its baseline (runtime/evaluate), a GGUF source's baseline
built as quantize unpacked it (convert/gguf.py), a diffusion artifact's transformers loaded by
the conversion package (convert/diffusion/load.py), and every Apple package's runtime beside
PyTorch (apple/flow.py), all under one lock on the artifact and recorded in one manifest
transaction at the end."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..apple import registry
from ..infra.progress import Progress, or_silent
from ..manifests.manifest import Manifest
from .apple import ByTarget, validation_part


@dataclass
class ValidationResult(ByTarget):
    """What `validate` measured: accuracy and latency of the FP8 artifact against its BF16
    baseline on one device, with the settings and kernel decisions; `as_dict()` is what is
    recorded in the manifest's `validation` block, plus each Apple target's part (`apple`: by
    target key, also `result.coreml`, `result.coreai`: its runtime beside PyTorch, or why it
    did not run; None without a package)."""

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
    # e4m3 codes or dequantized on this device, and a note where no memory is saved
    weights_held: dict = field(default_factory=dict)
    latency: dict | None = None
    speedup: dict | None = None  # BF16 median / FP8 median per phase
    verdict: dict | None = None  # per phase: ratio, run-to-run spread, "faster" | "slower" | "no clear difference"
    recorded: str | None = None  # the manifest written, None when the checkpoint has none
    apple: dict[str, dict | None] = field(default_factory=dict)

    def as_dict(self) -> dict:
        body = {k: v for k, v in asdict(self).items() if k != "apple" and (v is not None or k == "recorded")}
        return body | {key: self.apple.get(key) for key in registry.TARGETS}


def validate(artifact: Path, opts, progress: Progress | None = None) -> ValidationResult:
    """See api.validate. The lock is taken before any work (a second writer is refused now, not
    after a 48-minute run); what was measured is recorded once, at the end, and a failure of an
    Apple part is raised after it (carrying the result)."""
    from ..infra import atomic
    from ..manifests import layout

    artifact = Path(artifact)
    found = layout.is_artifact(artifact)
    write = opts.write and found
    with atomic.claim(artifact) if write else contextlib.nullcontext():
        manifest = Manifest.read(artifact) if found else None
        if manifest is not None and layout.diffusion_format(manifest):  # one denoising step (docs/diffusion.md)
            body, apple, records, failure = _diffusion(artifact, manifest, opts, progress), {}, [], None
        else:
            body = _torch(artifact, opts, progress)
            # The Apple parts run with the settings the PyTorch rows were measured with (their
            # defaults resolved by the run); a failure in one is said beside the recorded
            # validation, never instead of it.
            apple, records, failure = validation_part(artifact, body["settings"], progress)
        body["recorded"] = _record(artifact, body, records) if opts.write else None
        result = ValidationResult(**body)
        result.apple = apple
    if failure is not None:
        failure.result = result  # what was measured, for the caller to show
        raise failure
    return result


def _torch(artifact: Path, opts, progress: Progress | None) -> dict:
    """A language model (or encoder) against its baseline; a GGUF source's baseline is that GGUF,
    named as the baseline in the result."""
    from ..convert.gguf import validation_baseline
    from ..runtime.evaluate import validate as validation

    with validation_baseline(artifact, opts.baseline, progress) as gguf:
        measured = replace(opts, baseline=str(gguf.folder)) if gguf else opts
        body = validation.validate(artifact, measured, progress, record=False)
    if gguf:
        body["baseline"] = gguf.label
    return body


def _diffusion(artifact: Path, manifest: Manifest, opts, progress: Progress | None) -> dict:
    """One denoising step of a diffusion artifact's transformer against its BF16 source, both
    loaded by the conversion package."""
    from ..convert.diffusion.load import load_pair
    from ..infra import devices
    from ..runtime.evaluate import validate_diffusion

    progress = or_silent(progress)
    dev = devices.choose(opts.device)
    progress("load", 0, 2, "BF16 source and FP8 artifact")
    with devices.oom_hint(dev, "loading the two transformers"):
        pair = load_pair(artifact, manifest, dev, opts.baseline)
    progress("load", 2, 2, "")
    return validate_diffusion.validate(artifact, manifest, opts, pair, dev, progress, record=False)


def _record(artifact: Path, body: dict, records: list) -> str | None:
    """The run and the Apple parts' records in one transaction; the manifest's path, or None for
    a checkpoint of another tool (nothing to write into)."""
    from ..manifests.layout import MANIFEST_NAME
    from ..manifests.transaction import transaction
    from ..runtime.evaluate.validate import put_run

    if not (artifact / MANIFEST_NAME).is_file():
        return None
    with transaction(artifact) as t:
        put_run(t, {k: v for k, v in body.items() if k != "recorded"})
        for rec in records:
            t.put(rec)
    return str(artifact / MANIFEST_NAME)
