"""`quantize`'s decisions and their order: which source (a folder, a hub id, a GGUF file, a
diffusion model), which output and whether it may be written (said before any work: before
torch, a download or a GGUF unpacked), the scheme an FP8 source keeps, calibration, the
conversion (quantize.py, or diffusion/run.py).

The conversion package does not import the calibration or the Apple packages (they sit beside
it): `claimed` holds the claim on the output and yields a `Run` whose steps the caller
(workflows/quantize.py) calls in turn, putting its own steps between them (checking the Apple
extras, calibrating on the resolved source) and after them (the exports, an upload), all under
this one claim, so no other run can write the artifact between its conversion and its exports.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

from ..errors import MpsconvertError
from ..format.schemes import Scheme
from ..infra import atomic, output_rule
from ..infra.progress import Progress
from ..manifests import engines, layout
from ..manifests.manifest import Manifest
from ..manifests.records import GGUFSource, VLLMBlock
from ..source import snapshot as sources

# (input scales, the calibration's record, what the calibration returned for the caller to show,
# or None when the scales were read from a file)
Scales = tuple[dict, dict, Any]


@dataclass(frozen=True)
class QuantizeOptions:
    """What a conversion is asked for: api.quantize's conversion settings (its docstring says what each
    does), built once by the API and handed down as they are, through the workflow to `claimed` and the
    `Run` it yields."""

    scheme: str | None = None
    weights: str | None = None
    block_size: int | None = None
    revision: str | None = None
    token: str | None = None
    ignore: tuple[str, ...] = ()
    trust_remote_code: bool = False
    experts_layout: str = "per-expert"
    force: bool = False
    delete_unlisted: bool = False
    dtype: str | None = None
    max_shard_size: int | str = "1GB"
    format: str | None = None
    component: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "ignore", tuple(self.ignore))

    @classmethod
    def of(cls, params: dict[str, Any]) -> QuantizeOptions:
        """The options among `params` (a call's parameters by name, more than these included)."""
        return cls(**{f.name: params[f.name] for f in fields(cls)})


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


@dataclass
class Run:
    """A conversion whose output is claimed: its steps, called in turn by the caller (`resolve`,
    `prepare`, then `write` with the input scales when `needs_scales`)."""

    source: str | Path
    out: Path
    snap: Any  # the resolved source (sources.Snapshot); None for a hub id or a GGUF file until `resolve`
    gguf_file: Path | None
    sch: Scheme
    output_for: Any
    opts: QuantizeOptions
    claimed: contextlib.ExitStack
    calibration_given: dict[str, bool] = field(default_factory=dict)
    exports: tuple[str, ...] = ()
    progress: Progress | None = None
    shard_bytes: int = 0
    child: Any = None
    diffusion: bool = False

    def resolve(self) -> None:
        """The source as files: a GGUF unpacked, a hub id downloaded (an FP8 or diffusion hub
        source names its default output itself: that one is claimed and checked too)."""
        o = self.opts
        if self.gguf_file is not None:
            from .gguf import unpacked

            self.snap = self.claimed.enter_context(unpacked(self.gguf_file, o.dtype))
        elif self.snap is None:
            self.snap = sources.resolve(
                str(self.source), revision=o.revision, token=o.token, diffusion=True, component=o.component
            )
            if self.output_for(self.snap, self.snap.repo_id) != self.out:
                self.out = self.output_for(self.snap, self.snap.repo_id)
                self.claimed.enter_context(atomic.claim(self.out))
                output_rule.check_replaceable(
                    self.out, force=o.force, delete_unlisted=o.delete_unlisted, **layout.OUTPUT_RULES
                )
        self.diffusion = self.snap.diffusion is not None or o.format is not None
        if not self.diffusion and self.snap.fp8 is not None and o.scheme is None and o.weights is None:
            self.sch = self.snap.fp8.scheme  # the source's own: its e4m3 codes are kept as they are

    def prepare(self) -> None:
        """A language model: the source hashed and its plan started in a child process (before
        torch is imported here), and an FP8 source checked against the scheme."""
        if self.diffusion:
            return
        self.snap.start_hashing()  # overlaps the imports and planning below
        from . import plan_child

        self.child = plan_child.start_early(self.snap, self.sch, list(self.opts.ignore), self.opts.trust_remote_code)
        if self.child is not None:
            self.claimed.callback(self.child.kill)  # a run that failed before the writing
        from .quantize_plan import check_fp8_source

        check_fp8_source(self.snap, self.sch)

    @property
    def needs_scales(self) -> bool:
        """The scheme needs static input scales and the source brings none (a static FP8 source does)."""
        return (
            not self.diffusion
            and self.sch.needs_calibration
            and not (self.snap.fp8 is not None and self.sch == self.snap.fp8.scheme)
        )

    def write(self, scales: Scales | None = None) -> Converted:
        """The conversion itself: `scales` (see Scales) when `needs_scales`."""
        o = self.opts
        if self.diffusion:
            from .diffusion.quantize_diffusion import quantize_source

            llm_only = {
                "`scheme`": o.scheme,
                "`weights`": o.weights,
                **self.calibration_given,
                "`dtype`": o.dtype,
                "`experts_layout`": o.experts_layout != "per-expert",
                **{f"`exports={k}`": True for k in self.exports},
            }
            out, manifest = quantize_source(
                self.snap,
                self.out,
                o.format,
                ignore=list(o.ignore),
                force=o.force,
                max_shard_size=self.shard_bytes,
                llm_only=llm_only,
                progress=self.progress,
                delete_unlisted=o.delete_unlisted,
            )
            return Converted(out, manifest)
        try:
            return _convert_with(self.snap, self.out, self.sch, self.child, scales, o, self.shard_bytes, self.progress)
        finally:
            if self.child is not None:
                self.child.kill()


@contextlib.contextmanager
def claimed(
    source: str | Path,
    output: str | Path | None,
    opts: QuantizeOptions,
    *,
    calibration_given: dict[str, bool],
    exports: tuple[str, ...] = (),
    progress: Progress | None = None,
) -> Iterator[Run]:
    """Check the settings and claim the output of converting `source` (see api.quantize for every
    argument), before any work; the block runs under the claim. `calibration_given` says which of
    calibration data and a scales file were given ({"`data`": bool, "`scales_file`": bool}: only
    the fp8 scheme takes them), `exports` the Apple targets asked for (a diffusion model refuses
    them)."""
    scheme, weights, block_size = opts.scheme, opts.weights, opts.block_size
    if block_size is not None and weights != "block":
        raise MpsconvertError(
            f"`block_size={block_size}` applies to block weights only", "add `weights=block`, or drop `block_size`"
        )
    sch = Scheme.make(scheme or "fp8-dynamic", weights, block_size)
    if not sch.needs_calibration and any(calibration_given.values()):
        raise MpsconvertError(
            f"calibration data and scales only apply to `scheme=fp8` (got `scheme={sch.name}`)",
            "add `scheme=fp8`, or drop them",
        )
    # Where the output goes, and whether it may, before any work: a local folder is read now (a
    # config and an index), a hub id only named.
    path = sources.local_path(str(source))
    if path is not None:
        sources.no_revision(path, opts.revision)  # a GGUF file too: refused before the output is even named
    gguf_file = path if sources.is_gguf(path) else None
    snap = (
        sources.resolve(str(source), revision=opts.revision, token=opts.token, diffusion=True, component=opts.component)
        if path is not None and gguf_file is None
        else None
    )

    def output_for(snap, name: str) -> Path:
        """The output folder: -o, or the default name for this source (a diffusion model's own)."""
        if output is not None:
            return Path(output)
        if snap is not None and snap.diffusion is not None:
            from .diffusion.quantize_diffusion import default_format
            from .diffusion.quantize_diffusion import default_output as diffusion_output

            return diffusion_output(snap, opts.format or default_format(snap))
        own = (
            snap.fp8.scheme if snap is not None and snap.fp8 is not None and scheme is None and weights is None else sch
        )
        return default_output(name, own.name)

    out = output_for(snap, gguf_file.stem if gguf_file else snap.repo_id or snap.path.name if snap else str(source))
    with contextlib.ExitStack() as stack:
        stack.enter_context(atomic.claim(out))  # every step of the block (exports, upload) runs under this one lock
        output_rule.check_replaceable(
            out,
            force=opts.force,
            protect=(path,) if path is not None else (),
            delete_unlisted=opts.delete_unlisted,
            **layout.OUTPUT_RULES,
        )
        if snap is not None:
            snap.start_hashing()  # a local folder: hashed while torch and transformers load
        from . import shard_size_bytes

        run = Run(source, out, snap, gguf_file, sch, output_for, opts, stack, calibration_given, exports, progress)
        run.shard_bytes = shard_size_bytes(opts.max_shard_size)  # a bad size is said before anything is downloaded
        yield run


def _convert_with(
    snap, out: Path, sch: Scheme, child, scales: Scales | None, o: QuantizeOptions, shard_bytes: int, progress
) -> Converted:
    """A language model's conversion once its source is resolved, its output claimed and its
    plan started (`child`)."""
    from .quantize import quantize_snapshot
    from .quantize_options import Options

    opts = Options(
        scheme=sch,
        ignore=list(o.ignore),
        force=o.force,
        delete_unlisted=o.delete_unlisted,
        trust_remote_code=o.trust_remote_code,
        experts_layout=o.experts_layout,
        dtype=o.dtype,
        max_shard_size=shard_bytes,
    )
    cal = None
    if sch.needs_calibration and not (
        snap.fp8 is not None and sch == snap.fp8.scheme
    ):  # a static FP8 source brings its scales
        opts.input_scales, opts.calibration, cal = scales
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
        measured = (
            f"round-trip SQNR against the source: worst {sqnrs[0]:.1f} dB, median {sqnrs[len(sqnrs) // 2]:.1f} dB"
            if sqnrs
            else "round-trip SQNR: exact"
        )
        done.warnings.append(
            f"the source is already FP8 ({snap.fp8.layout}, {snap.fp8.scheme.weights} scales); {sch.name} with "
            f"{sch.weights} scales dequantized and re-quantized it, which rounds twice ({measured}); "
            "drop --scheme/--weights to keep its codes as they are"
        )
    return done
