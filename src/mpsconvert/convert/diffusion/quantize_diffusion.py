"""`quantize` of a diffusion source: the decisions (which format, which output name, which
options apply), then the run: plan and streamed writes (write.py), then configs, manifest and
card (assemble.py). api.quantize calls `quantize_source`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import MpsconvertError
from ...infra.progress import Progress, or_silent
from ...manifests.manifest import Manifest
from ...source.snapshot import Snapshot
from . import COMFYUI_FORMATS, FORMATS

if TYPE_CHECKING:  # torch and the writers load when a conversion runs, not when its output is named
    from .write import DiffusionOptions


def default_format(snap: Snapshot) -> str:
    """An original-repo single file becomes a ComfyUI file; a diffusers model stays diffusers."""
    return "comfyui" if snap.diffusion.layout == "single-file" else "diffusers"


def default_output(snap: Snapshot, fmt: str) -> Path:
    """`<name>-fp8-<format>` in the current folder (the file's stem for a single file)."""
    name = (
        Path(snap.weight_files[0]).stem
        if snap.diffusion.layout == "single-file"
        else (snap.repo_id or snap.diffusion.root.name)
    )
    return Path(f"{name.split('/')[-1]}-fp8-{fmt}")


def check_options(llm_only: dict) -> None:
    """LLM options given for a diffusion model are refused, not ignored."""
    given = [k for k, v in llm_only.items() if v]
    if given:
        raise MpsconvertError(
            f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to language models, not to a diffusion model",
            "drop them: a diffusion transformer is converted weight-only (`format=comfyui` or diffusers)",
        )


def quantize_source(
    snap: Snapshot,
    output: str | Path | None,
    fmt: str | None,
    *,
    ignore: list[str],
    force: bool,
    max_shard_size: int,
    llm_only: dict,
    progress: Progress | None,
    delete_unlisted: bool = False,
) -> tuple[Path, Manifest]:
    """Convert the diffusion transformer of `snap`; returns the output folder and its manifest."""
    if snap.diffusion is None:
        raise MpsconvertError(
            f"`format={fmt}` is for diffusion models, and {snap.repo_id or snap.path} is a transformers model "
            f"({', '.join(snap.config.get('architectures') or ['no architecture'])})",
            "drop `format`: a language model becomes a compressed-tensors artifact",
        )
    from .write import DiffusionOptions

    check_options(llm_only)
    fmt = fmt or default_format(snap)
    if fmt not in FORMATS:
        raise MpsconvertError(f"unknown format {fmt!r}", f"use one of: {', '.join(FORMATS)}")
    out = Path(output) if output is not None else default_output(snap, fmt)
    opts = DiffusionOptions(
        format=fmt, ignore=list(ignore), force=force, max_shard_size=max_shard_size, delete_unlisted=delete_unlisted
    )
    return out, quantize(snap, out, opts, progress)


def quantize(snap: Snapshot, out: Path, opts: DiffusionOptions, progress: Progress | None = None) -> Manifest:
    """Write the FP8 artifact of a diffusion source to `out` (atomically); return its manifest."""
    from ..quantize import _write_shards, converting, writing
    from ..quantize_options import Options
    from .assemble_diffusion import assemble
    from .write import WEIGHT_ONLY_ROW, comfy_file_name, diffusers_shard_names, estimate_bytes, plan, write_comfyui

    with converting(snap):  # one torch thread per quantizing thread; the source hashed from the start
        p = plan(snap, opts)
        # a single file is the source, not the folder it sits in: an output beside it is fine
        protect = (
            (snap.path / snap.weight_files[0],)
            if snap.diffusion.layout == "single-file"
            else (snap.path, snap.diffusion.root)
        )
        with writing(out, opts, estimate_bytes(p), protect) as w:
            if opts.format in COMFYUI_FORMATS:
                shards = write_comfyui(snap, p, opts, w.tmp / comfy_file_name(out), w, or_silent(progress))
            else:
                where = w.tmp / snap.diffusion.component if snap.diffusion.layout == "pipeline" else w.tmp
                where.mkdir(parents=True, exist_ok=True)
                o = Options(scheme=WEIGHT_ONLY_ROW, scale_leaf="scale", max_shard_size=opts.max_shard_size)
                shards = _write_shards(
                    snap,
                    p.headers,
                    p.quantize,
                    {},
                    o,
                    where,
                    w,
                    or_silent(progress),
                    shard_names=diffusers_shard_names,
                )
            return assemble(w.tmp, snap, p, opts, shards, Path(out).absolute().name)
