"""`quantize` of a diffusion source: the decisions (which format, which output name, which
options apply) before the conversion runs (write.py). api.quantize calls `quantize_source`."""

from __future__ import annotations

from pathlib import Path

from ...errors import MpsconvertError
from ...manifests.manifest import Manifest
from ...progress import Progress
from ...source import Snapshot
from . import FORMATS


def default_format(snap: Snapshot) -> str:
    """An original-repo single file becomes a ComfyUI file; a diffusers model stays diffusers."""
    return "comfyui" if snap.diffusion.layout == "single-file" else "diffusers"


def default_output(snap: Snapshot, fmt: str) -> Path:
    """`<name>-fp8-<format>` in the current folder (the file's stem for a single file)."""
    name = Path(snap.weight_files[0]).stem if snap.diffusion.layout == "single-file" else (snap.repo_id or snap.diffusion.root.name)
    return Path(f"{name.split('/')[-1]}-fp8-{fmt}")


def check_options(llm_only: dict) -> None:
    """LLM options given for a diffusion model are refused, not ignored."""
    given = [k for k, v in llm_only.items() if v]
    if given:
        raise MpsconvertError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to language models, not to a diffusion model",
                              "drop them: a diffusion transformer is converted weight-only (--format comfyui or diffusers)")


def quantize_source(snap: Snapshot, output: str | Path | None, fmt: str | None, *, ignore: list[str], force: bool,
                    max_shard_size: int, llm_only: dict, progress: Progress | None) -> tuple[Path, Manifest]:
    """Convert the diffusion transformer of `snap`; returns the output folder and its manifest."""
    from .write import DiffusionOptions, quantize

    if snap.diffusion is None:
        raise MpsconvertError(f"--format {fmt} is for diffusion models, and {snap.repo_id or snap.path} is a transformers model "
                              f"({', '.join(snap.config.get('architectures') or ['no architecture'])})",
                              "drop --format: a language model becomes a compressed-tensors artifact")
    check_options(llm_only)
    fmt = fmt or default_format(snap)
    if fmt not in FORMATS:
        raise MpsconvertError(f"unknown format {fmt!r}", f"use one of: {', '.join(FORMATS)}")
    out = Path(output) if output is not None else default_output(snap, fmt)
    opts = DiffusionOptions(format=fmt, ignore=list(ignore), force=force, max_shard_size=max_shard_size)
    return out, quantize(snap, out, opts, progress)
