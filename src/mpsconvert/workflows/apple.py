"""Where the Apple targets meet the other packages: results readable per target, the exports a
conversion asked for (under its lock, each failure said as "written, but"), and validate's Apple
part (measured beside the PyTorch rows, its records put into validate's one transaction).
apple/flow.py is what every target goes through on its own (export, check, measure, decoder).
The per-target functions of the API (`export_coreml`, `check_coreai`, `coreai_latency`, ...) are
here: each names its target's options as keywords, then calls apple/flow.py."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..apple import flow, registry
from ..apple.coreai import CoreAIOptions
from ..apple.coreml import ExportOptions, SeqLen
from ..apple.flow import ExportResult
from ..apple.protocol import Target
from ..errors import ExportError, MpsconvertError
from ..infra.progress import Progress


def targets() -> dict[str, Target]:
    """The Apple export targets by key ("coreml", "coreai", and any registered since)."""
    return dict(registry.TARGETS)


class ByTarget:
    """Results that hold one entry per Apple target (`apple`), also readable as attributes named
    by the target's key (`result.coreml`), whatever targets are registered."""

    def __getattr__(self, name: str):
        if name != "apple" and name in registry.TARGETS:
            return self.apple.get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


@contextlib.contextmanager
def written_but(out: Path, what: str, retry: str, error: type[MpsconvertError]):
    """A step after the artifact was written that failed: said as such (the artifact stands)."""
    try:
        yield
    except MpsconvertError as e:
        raise error(f"{out} was written, but {what} failed: {e.problem}", e.fix or retry) from e


def export_into(out: Path, exports: dict[str, Any], progress: Progress | None) -> dict[str, ExportResult]:
    """The exports a conversion asked for ({target key: its options, or None for its defaults}),
    each into the artifact just written at `out` and checked (replacing a package the old
    artifact had: the conversion was allowed to replace it)."""
    done = {}
    for key, opts in exports.items():
        t = registry.get(key)
        with written_but(out, f"its {t.name} export", f"run `mpsconvert export-{key}` on it to retry", ExportError):
            done[key] = flow.export(out, key, replace(opts or t.options(), force=True), True, progress)
    return done


def validation_part(artifact: Path, settings: dict, progress: Progress | None) -> tuple[dict, list, Exception | None]:
    """validate's Apple part, with the settings the PyTorch rows were measured with: ({target key:
    its result, or None without a package}, the records to put into validate's transaction, the
    first failure to raise once everything is recorded)."""
    results, failure = flow.latency(artifact, settings, progress)
    return results, flow.runtime_records(results), failure


# --------------------------------------------------------------------------- the API's per-target functions


def coreai_latency(
    artifact: str | Path,
    *,
    prefill_len: int = 64,
    decode_tokens: int = 16,
    warmup: int = 2,
    prefill_repeats: int = 3,
    units: list[str] | None = None,
    write: bool = True,
) -> dict:
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
    return flow.measure(
        Path(artifact),
        "coreai",
        write=write,
        prefill_len=prefill_len,
        decode_tokens=decode_tokens,
        warmup=warmup,
        prefill_repeats=prefill_repeats,
        units=units,
    )


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
    from ..apple.coreml import CheckOptions

    opts = ExportOptions(
        seq_len=SeqLen.parse(seq_len),
        weights=weights,
        force=force,
        frontend=frontend,
        kv_cache=kv_cache,
        max_len=max_len,
    )
    return flow.export(Path(artifact), "coreml", opts, check and CheckOptions(samples, decode_steps), progress)


def check_coreml(
    artifact: str | Path,
    *,
    samples: int = 3,
    decode_steps: int = 16,
    progress: Progress | None = None,
    verify: bool = True,
) -> ExportResult:
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
    from ..apple.coreml import CheckOptions

    return flow.check(Path(artifact), "coreml", CheckOptions(samples, decode_steps), verify=verify, progress=progress)


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
    from ..apple.coreai import CheckOptions

    opts = CoreAIOptions(max_len=max_len, compute=compute, force=force)
    return flow.export(Path(artifact), "coreai", opts, check and CheckOptions(prompt_len, decode_steps), progress)


def check_coreai(
    artifact: str | Path,
    *,
    prompt_len: int = 64,
    decode_steps: int = 32,
    generate: int = 4,
    progress: Progress | None = None,
    verify: bool = True,
) -> ExportResult:
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
    from ..apple.coreai import CheckOptions

    return flow.check(
        Path(artifact), "coreai", CheckOptions(prompt_len, decode_steps, generate), verify=verify, progress=progress
    )
