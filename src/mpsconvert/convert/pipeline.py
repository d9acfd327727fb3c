"""`quantize`'s decisions and their order: which source (a folder, a hub id, a GGUF file, a
diffusion model), which output and whether it may be written (said before any work: before
torch, a download or a GGUF unpacked), the scheme an FP8 source keeps, calibration, the
conversion (quantize.py, or diffusion/run.py), and what follows it under the same lock.

The conversion package does not import the calibration or the Apple packages (they sit beside
it): the caller passes calibration as `scales` and the follow-ups (Apple exports, an upload) as
`then`, and they run inside this run's claim on the output, so no other run can write the
artifact between its conversion and its exports.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..infra import atomic, output_rule
from ..source import snapshot as sources
from ..errors import MpsconvertError
from ..manifests import layout
from ..manifests.manifest import Manifest
from ..manifests import engines
from ..manifests.records import GGUFSource, VLLMBlock
from ..format.schemes import Scheme
from ..infra.progress import Progress

# (the snapshot folder to calibrate on) -> (input scales, the calibration's record, what the
# calibration returned for the caller to show, or None when the scales were read from a file)
Scales = Callable[[Path], tuple[dict, dict, Any]]


@dataclass
class Converted:
    """A written artifact: where, its manifest, the calibration run for it (if any), and what to
    say about it (an FP8 source quantized a second time, a GGUF below 8 bits)."""

    output: Path
    manifest: Manifest
    calibration: Any = None
    warnings: list[str] = field(default_factory=list)


def default_output(source_name: str, scheme: str) -> Path:
    """`<last part of the repo id or folder name>-<scheme>`, in the current folder."""
    return Path(f"{source_name.split('/')[-1]}-{scheme}")


def quantize(source: str | Path, output: str | Path | None, *, scheme: str | None, weights: str | None, block_size: int | None,
             revision: str | None, token: str | None, ignore, trust_remote_code: bool, experts_layout: str, force: bool,
             calibration_given: dict[str, bool], scales: Scales | None, dtype: str | None, max_shard_size, format: str | None, component: str | None,
             exports: tuple[str, ...] = (), before: Callable[[], None] | None = None, delete_unlisted: bool = False,
             then: Callable[[Converted], None] | None = None, progress: Progress | None = None) -> Converted:
    """Convert `source` (see api.quantize for every argument): `calibration_given` says which of
    calibration data and a scales file were given ({"--calib-data": bool, "--scales": bool}: only
    the fp8 scheme takes them), `scales` how to
    get static input scales when the scheme needs them, `exports` the Apple targets asked for
    (a diffusion model refuses them), `before()` runs once the output is claimed and before any
    work (the caller's checks of what it needs), `then(converted)` after the conversion, under
    the same lock."""
    if block_size is not None and weights != "block":
        raise MpsconvertError(f"--block-size {block_size} applies to block weights only", "add --weights block, or drop --block-size")
    sch = Scheme.make(scheme or "fp8-dynamic", weights, block_size)
    if not sch.needs_calibration and any(calibration_given.values()):
        raise MpsconvertError(f"calibration data and scales only apply to --scheme fp8 (got --scheme {sch.name})", "add --scheme fp8, or drop them")
    # Where the output goes, and whether it may, before any work: a local folder is read now (a
    # config and an index), a hub id only named.
    path = sources.local_path(str(source))
    if path is not None:
        sources.no_revision(path, revision)  # a GGUF file too: refused before the output is even named
    gguf_file = path if sources.is_gguf(path) else None
    snap = (sources.resolve(str(source), revision=revision, token=token, diffusion=True, component=component)
            if path is not None and gguf_file is None else None)

    def output_for(snap, name: str) -> Path:
        """The output folder: -o, or the default name for this source (a diffusion model's own)."""
        if output is not None:
            return Path(output)
        if snap is not None and snap.diffusion is not None:
            from .diffusion.run import default_format, default_output as diffusion_output

            return diffusion_output(snap, format or default_format(snap))
        own = snap.fp8.scheme if snap is not None and snap.fp8 is not None and scheme is None and weights is None else sch
        return default_output(name, own.name)

    out = output_for(snap, gguf_file.stem if gguf_file else snap.repo_id or snap.path.name if snap else str(source))
    with contextlib.ExitStack() as claimed:
        claimed.enter_context(atomic.claim(out))  # every step below (exports, upload) runs under this one lock
        output_rule.check_replaceable(out, force=force, protect=(path,) if path is not None else (),
                                      delete_unlisted=delete_unlisted, **layout.OUTPUT_RULES)
        if snap is not None:
            snap.start_hashing()  # a local folder: hashed while torch and transformers load
        from . import shard_size_bytes

        shard_bytes = shard_size_bytes(max_shard_size)  # a bad size is said before anything is downloaded
        if before is not None:
            before()
        if gguf_file is not None:
            from .gguf import unpacked

            snap = claimed.enter_context(unpacked(gguf_file, dtype))
        elif snap is None:
            snap = sources.resolve(str(source), revision=revision, token=token, diffusion=True, component=component)
            if output_for(snap, snap.repo_id) != out:  # an FP8 or diffusion hub source names its default output itself
                out = output_for(snap, snap.repo_id)
                claimed.enter_context(atomic.claim(out))
                output_rule.check_replaceable(out, force=force, delete_unlisted=delete_unlisted, **layout.OUTPUT_RULES)
        if snap.diffusion is not None or format is not None:
            from .diffusion.run import quantize_source

            llm_only = {"--scheme": scheme, "--weights": weights, **calibration_given, "--dtype": dtype,
                        "--experts-layout": experts_layout != "per-expert", **{f"--{k}": True for k in exports}}
            out, manifest = quantize_source(snap, out, format, ignore=list(ignore), force=force, max_shard_size=shard_bytes,
                                            llm_only=llm_only, progress=progress, delete_unlisted=delete_unlisted)
            done = Converted(out, manifest)
        else:
            if snap.fp8 is not None and scheme is None and weights is None:
                sch = snap.fp8.scheme  # the source's own: its e4m3 codes are kept as they are
            done = _convert(snap, out, sch, ignore=ignore, trust_remote_code=trust_remote_code, experts_layout=experts_layout,
                            force=force, delete_unlisted=delete_unlisted, scales=scales, dtype=dtype, shard_bytes=shard_bytes, progress=progress)
        if then is not None:
            then(done)
        return done


def _convert(snap, out: Path, sch: Scheme, *, ignore, trust_remote_code, experts_layout, force, delete_unlisted, scales, dtype,
             shard_bytes, progress) -> Converted:
    """A language model's conversion once its source is resolved and its output claimed."""
    snap.start_hashing()  # overlaps the imports and planning below
    from . import plan_child

    child = plan_child.start_early(snap, sch, list(ignore), trust_remote_code)  # before torch is imported here
    try:
        return _convert_with(snap, out, sch, child, ignore=ignore, trust_remote_code=trust_remote_code,
                             experts_layout=experts_layout, force=force, delete_unlisted=delete_unlisted, scales=scales, dtype=dtype,
                             shard_bytes=shard_bytes, progress=progress)
    finally:
        if child is not None:
            child.kill()  # a run that failed before the writing


def _convert_with(snap, out: Path, sch: Scheme, child, *, ignore, trust_remote_code, experts_layout, force, delete_unlisted, scales,
                  dtype, shard_bytes, progress) -> Converted:
    from .quantize import quantize_snapshot
    from .quantize_options import Options
    from .quantize_plan import check_fp8_source

    check_fp8_source(snap, sch)
    opts = Options(scheme=sch, ignore=list(ignore), force=force, delete_unlisted=delete_unlisted, trust_remote_code=trust_remote_code,
                   experts_layout=experts_layout, dtype=dtype, max_shard_size=shard_bytes)
    cal = None
    if sch.needs_calibration and not (snap.fp8 is not None and sch == snap.fp8.scheme):  # a static FP8 source brings its scales
        opts.input_scales, opts.calibration, cal = scales(snap.path)
        opts.device = opts.calibration.get("device", opts.device)
    manifest = quantize_snapshot(snap, out, opts, progress, child)
    done = Converted(out, manifest, cal, warnings=list(opts.notes))
    g = manifest.get(GGUFSource)
    if g is not None and (note := g.precision_note()):  # a GGUF below 8 bits: said in the summary, as in the card
        done.warnings.append(note)
    if sch.block and (w := engines.warning(manifest.get(VLLMBlock), static=sch.needs_calibration)):
        done.warnings.append(w)  # the mpsconvert runtime still runs it; vLLM users hear it now, not at `vllm serve`
    if snap.fp8 is not None and sch != snap.fp8.scheme:
        sqnrs = sorted(r["sqnr_db"] for r in manifest.tensors.values() if r.get("sqnr_db") is not None)
        measured = (f"round-trip SQNR against the source: worst {sqnrs[0]:.1f} dB, median {sqnrs[len(sqnrs) // 2]:.1f} dB"
                    if sqnrs else "round-trip SQNR: exact")
        done.warnings.append(f"the source is already FP8 ({snap.fp8.layout}, {snap.fp8.scheme.weights} scales); {sch.name} with "
                             f"{sch.weights} scales dequantized and re-quantized it, which rounds twice ({measured}); "
                             "drop --scheme/--weights to keep its codes as they are")
    return done
