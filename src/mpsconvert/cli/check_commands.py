"""The checking and publishing commands: inspect (what an artifact holds), validate (accuracy and latency against
the baseline), verify (files against the manifest) and upload (to the Hugging Face hub)."""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

import click

from .. import api
from . import render, reports
from .app import friendly_errors
from .options import device_option, json_option, stacked, token_option
from .progress_bars import progress_bars


@contextlib.contextmanager
def showing_failed_checks(show, as_json: bool):
    """An export or check whose checks ran and failed raises ExportError with the result, and
    validate whose Apple part failed raises with what it measured: show that before the
    one-line error (or, for a bug, its traceback)."""
    try:
        yield
    except Exception as e:
        if getattr(e, "result", None) is not None:
            show(e.result, as_json)
        raise


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@json_option("Print the whole manifest as JSON.")
@click.option("--tensors", "show_tensors", is_flag=True, help="List every quantized tensor with its SQNR.")
@friendly_errors
def inspect(artifact, as_json, show_tensors):
    """Show what an FP8 artifact holds: source, recipe, sizes, error stats and later checks."""
    m = api.inspect(artifact)
    if as_json:
        render.out.print_json(m.to_json())
    else:
        reports.inspect_table(artifact, m, show_tensors)


# validate's sizes: counts and lengths whose defaults depend on the device (runtime.evaluate.validate.DEFAULTS)
_VALIDATE_SIZES = {
    "--seq-len": "Tokens per accuracy sample [default: 512; on CPU 256].",
    "--max-samples": "Accuracy samples (of --seq-len tokens) [default: 8; on CPU 4].",
    "--prefill-len": "Tokens of the one sequence (batch 1) timed for prefill; encoders too [default: 512; on CPU 128].",
    "--decode-tokens": "Tokens timed for decode (batch 1) [default: 32; on CPU 16].",
    "--repeats": "Timed prefill runs per round, after --warmup [default: 10 on a GPU, 2 on CPU].",
    "--rounds": "Rounds of timing, alternating BF16 and FP8; their spread decides whether a difference is clear "
    "[default: 3; on CPU 2].",
    "--warmup": "Untimed runs before the first round [default: 3 on a GPU, 1 on CPU].",
}


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--baseline",
    metavar="SRC",
    help="BF16 model to compare against (hub id or folder) [default: the manifest's source].",
)
@click.option(
    "--eval-data",
    "eval_data",
    type=click.Path(dir_okay=False),
    help="Eval text: .jsonl with a 'text' field per line, or .txt.",
)
@device_option(
    "Where both models run; an unavailable device is an error, never a fallback.",
    type=click.Choice(["auto", "mps", "cuda", "cpu"]),
)
@stacked(*(click.option(flag, type=int, default=None, help=text) for flag, text in _VALIDATE_SIZES.items()))
@click.option(
    "--full",
    is_flag=True,
    help="On CPU too, the full run: 8 samples of 512 tokens, prefill 512, decode 32, 3 rounds of 3 (about 5x the CPU "
    "defaults' time); options given still win.",
)
@click.option("--no-latency", is_flag=True, help="Accuracy only.")
@click.option(
    "--compile",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    help="torch.compile + CUDA graphs for decode (auto: on CUDA).",
)
@click.option("--no-write", is_flag=True, help="Do not record the results in the artifact's manifest.")
@json_option("Print the results as JSON on stdout.")
@click.option(
    "--explain", is_flag=True, help="Also print the kernel chosen for every layer shape, with the timings behind it."
)
@friendly_errors
def validate(artifact, no_latency, no_write, as_json, explain, **settings):
    """Check ARTIFACT against its BF16 baseline: accuracy (perplexity, KL, top-1 / embedding cosine) and latency.

    On CPU the defaults are fewer and shorter samples (a few minutes for a 135M model on 2 cores;
    the table says so); --full runs the GPU's sizes there too."""
    opts = api.validate_options(latency=not no_latency, write=not no_write, **settings)

    show = functools.partial(reports.validation, explain=explain)
    with progress_bars() as progress, showing_failed_checks(show, as_json):
        res = api.validate(artifact, options=opts, progress=progress)
    show(res, as_json)


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--no-hashes", is_flag=True, help="Skip the sha256 check (structure only; much faster on big artifacts).")
@click.option(
    "--trust-remote-code",
    is_flag=True,
    help="Allow building an architecture defined by code in the artifact (only once every file verified).",
)
@click.option(
    "--manifest-sha256",
    metavar="HEX",
    help="The sha256 the manifest itself must have (printed by quantize): pins the whole artifact.",
)
@json_option("Print the report as JSON.")
@friendly_errors
def verify(artifact, no_hashes, trust_remote_code, manifest_sha256, as_json):
    """Check every file of ARTIFACT against its manifest's sha256, and its internal consistency
    (every FP8 weight has its scale; shapes and dtypes as config.json says). Exit 1 on any problem."""
    with progress_bars() as progress:
        report = api.verify(
            artifact,
            check_hashes=not no_hashes,
            trust_remote_code=trust_remote_code,
            manifest_sha256=manifest_sha256,
            progress=progress,
        )
    reports.verify_report(report, as_json, artifact)
    if not report.ok:
        sys.exit(1)


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("repo")
@click.option(
    "--private",
    is_flag=True,
    help="Create the repo private. An existing repo keeps its visibility; a public one is refused with --private.",
)
@token_option("A Hugging Face write token [default: your stored login].")
@click.option("--revision", help="The branch to commit to [default: main].")
@json_option("Print what was uploaded as JSON.")
@friendly_errors
def upload(artifact, repo, private, token, revision, as_json):
    """Upload ARTIFACT to the Hugging Face repo REPO (org/name) in one commit, after verifying it.

    \b
    The repo is created if absent; the model card is rewritten to load from REPO; the commit
    message names the scheme and the source commit. HF_ENDPOINT picks another hub; offline mode
    (HF_HUB_OFFLINE=1) is an error.
    """
    with progress_bars() as progress:
        res = api.upload(artifact, repo, private=private, token=token, revision=revision, progress=progress)
    reports.uploaded(res, as_json)
