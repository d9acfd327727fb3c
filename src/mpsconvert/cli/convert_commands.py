"""The conversion commands: quantize (a source to an FP8 artifact, GGUF and diffusion sources included, with
the Apple exports it may chain) and calibrate (static FP8 input scales). quantize's options for the Apple
targets are added by `apple_commands.generated()`."""

from __future__ import annotations

from pathlib import Path

import click

from .. import api
from . import render, reports
from .app import friendly_errors
from .options import APPLE_PREFIX, apple_exports, calibration, calibration_options, json_option, source_options
from .progress_bars import progress_bars


@click.command("quantize")
@click.argument("source")
@click.option(
    "-o", "--output", "output", type=click.Path(path_type=Path), help="Output folder [default: <name>-<scheme>]."
)
@click.option(
    "--scheme",
    type=click.Choice(api.SCHEMES),
    default=None,
    help="fp8-dynamic: FP8 weights, activations quantized per token at run time. "
    "fp8: static per-tensor activation scales from calibration. "
    "fp8-weight-only: activations stay BF16. [default: fp8-dynamic; for an FP8 source, its own scheme, "
    "its codes kept as they are]",
)
@click.option(
    "--weights",
    type=click.Choice(api.WEIGHT_GRANULARITIES),
    default=None,
    help="Weight scale granularity: per row, per tensor, or per block (FP8_BLOCK, as the hub's FP8 releases) "
    "[default: row for fp8-dynamic/fp8-weight-only, tensor for fp8; an FP8 source's own].",
)
@click.option(
    "--block-size",
    type=click.IntRange(1, 4096),
    default=None,
    help="With --weights block: the edge of the square weight blocks [default: 128].",
)
@source_options(
    revision="Branch, tag or commit of a hub repo [default: main].",
    token="Hugging Face token for gated or private repos.",
    ignore="Keep matching Linear modules unquantized (glob, `re:` regex, or a name suffix such as mlp.down_proj). "
    "Repeatable.",
)
@click.option(
    "--experts-layout",
    type=click.Choice(api.EXPERTS_LAYOUTS),
    default="per-expert",
    help="MoE checkpoints that store experts fused (3-D): per-expert writes one FP8 tensor per expert and "
    "projection (loads in transformers + compressed-tensors and vLLM); checkpoint keeps them fused "
    "(loads only in mpsconvert's runtime).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace an existing output folder (only once the new one is complete): an mpsconvert artifact only, and "
    "one holding files its manifest does not list (your notes) is refused, naming them.",
)
@click.option(
    "--force-delete-unlisted",
    "delete_unlisted",
    is_flag=True,
    help="With --force: also delete the files in the old output that its manifest does not list.",
)
@json_option("Print the summary as JSON on stdout.")
@click.option(
    "--scales",
    "scales_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="For --scheme fp8: use the input scales from `mpsconvert calibrate -o FILE` instead of calibrating.",
)
@calibration_options
@click.option(
    "--dtype",
    type=click.Choice(list(api.UNQUANTIZED_DTYPES)),
    default=None,
    help="Dtype of the tensors that stay unquantized (embeddings, lm_head, norms) [default: the source's, "
    "bit for bit]. An FP32 source with --dtype bfloat16 halves them.",
)
@click.option(
    "--max-shard-size",
    default="1GB",
    metavar="SIZE",
    help="Largest weight file written (e.g. 500MB, 2GiB; save_pretrained's units). Loading with "
    "verification hashes the files in parallel, one thread each, so smaller shards load faster.",
)
@click.option(
    "--upload-repo",
    metavar="REPO",
    help="Then upload the artifact to this Hugging Face repo (created if absent; see `upload`).",
)
@click.option(
    "--private", is_flag=True, help="With --upload-repo: create the repo private (an existing public repo is refused)."
)
@click.option(
    "--format",
    type=click.Choice(api.DIFFUSION_FORMATS),
    default=None,
    help="Diffusion models (Flux.1, Wan 2.x, Qwen-Image, SD3.5, Z-Image): comfyui writes one file for ComfyUI's "
    "models/diffusion_models/ (per-tensor scales), comfyui-legacy its older scaled_fp8 layout, diffusers a folder "
    "that diffusers loads through SDNQ (per-row scales) [default: diffusers; comfyui for a single .safetensors file]. "
    "Language models take none.",
)
@click.option(
    "--component", metavar="NAME", help="The diffusers pipeline component to quantize [default: transformer]."
)
@friendly_errors
def quantize(source, output, as_json, **params):
    """Quantize SOURCE (a hub repo id, a local folder or a .gguf file) to an FP8 compressed-tensors artifact; a
    diffusers pipeline, component or original .safetensors file to FP8 for ComfyUI or diffusers.

    The artifact's README.md is a model card (front matter, what was done, how to load it, the
    source's own card below); `validate` adds its results to it."""
    exports = apple_exports({k: params.pop(k) for k in list(params) if k.startswith(APPLE_PREFIX)})
    calib = calibration(params)
    with progress_bars() as progress:  # the rest of `params`: api.quantize's keywords, as given
        res = api.quantize(source, output, calibration=calib, exports=exports, progress=progress, **params)
    if res.calibration is not None:
        reports.calibration(res.calibration)
    for w in res.warnings:
        render.warn(w)
    reports.quantize_summary(res, as_json)
    for exported in res.apple.values():
        reports.export_result(exported, as_json)
    if res.upload is not None:
        reports.uploaded(res.upload, as_json)


@click.command()
@click.argument("target")
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(path_type=Path),
    help="Write the scales to this JSON file (for `quantize --scheme fp8 --scales FILE`) instead of into the artifact. "
    "Never inside the source or an artifact.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace an existing -o FILE (a scales file mpsconvert wrote; any other file is refused).",
)
@source_options(
    revision="Branch, tag or commit of a hub model repo [default: main].",
    token="Hugging Face token for gated or private repos and datasets.",
    ignore="Linear modules left unquantized (as given to quantize). Repeatable.",
)
@calibration_options
@friendly_errors
def calibrate(target, output, force, revision, token, ignore, trust_remote_code, **calib):
    """Measure static FP8 input scales for TARGET on real text.

    \b
    TARGET an FP8 artifact folder: calibrate the model as it will run (its FP8 weights) and write
           <m>.input_scale into it (atomically; config and manifest become the static scheme).
    TARGET a source (hub id or folder): needs -o FILE; `quantize SRC --scheme fp8 --scales FILE` uses it.
    """
    opts = calibration(calib, ignore=list(ignore), trust_remote_code=trust_remote_code, token=token)
    with progress_bars() as progress:
        res = api.calibrate(
            target, output, options=opts, revision=revision, token=token, force=force, progress=progress
        )
    reports.calibration(res.calibration)
    n = len(res.calibration.scales)
    if res.into_artifact:
        render.result(f"wrote {n} input scales into {res.written_to} (scheme fp8, static per-tensor activations)")
        reports.pin(
            res.written_to, res.pin_sha256, "a pin taken before calibration no longer holds: the weights changed"
        )
    else:
        render.result(f"wrote {n} input scales to {res.written_to}")
