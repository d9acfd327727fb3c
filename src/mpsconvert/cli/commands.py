"""The commands: each parses its options, makes one API call, and renders the result.

The Apple targets' commands and options are made from their registry (`api.targets()`, each
target's settings declared as data: apple/protocol.py's `Option`): `export-<key>` per target and
`quantize --<key>` with the target's options, by `generated()`, which the command group asks when
it lists or runs commands."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import click

from .. import api
from ..errors import PromptError
from . import render, reports
from .app import friendly_errors, main
from .flags import as_flags
from .progress_bars import progress_bars


def calibration_options(fn):
    """The options shared by `quantize --scheme fp8` and `calibrate`."""
    opts = [
        click.option(
            "--calib-data",
            metavar="FILE|DIR|DATASET",
            help="Calibration text: a .txt file (documents separated by blank lines), a .jsonl/.json/.parquet file "
            "with a 'text' field, a folder of those, or a Hugging Face dataset repo id "
            "[default: the small built-in set of prose, code and dialogue].",
        ),
        click.option(
            "--num-samples",
            type=click.IntRange(min=1),
            default=128,
            show_default=True,
            help="Token windows to calibrate on.",
        ),
        click.option(
            "--seq-len", type=click.IntRange(min=16), default=512, show_default=True, help="Tokens per window."
        ),
        click.option(
            "--seed", type=int, default=0, show_default=True, help="Seed of the (deterministic) document shuffle."
        ),
        click.option(
            "--observer",
            type=click.Choice(api.OBSERVERS),
            default="minmax",
            show_default=True,
            help="minmax: the true maximum |x| (best measured on SmolLM2 and MiniLM). percentile: the "
            "--percentile of |x| (clips the largest activations; LLMs rely on those outliers, so it "
            "hurts them badly). mse: the clip that minimises the FP8 error on the observed "
            "activations.",
        ),
        click.option(
            "--percentile",
            type=float,
            default=api.DEFAULT_PERCENTILE,
            show_default=True,
            help="For --observer percentile.",
        ),
        click.option(
            "--device",
            default="auto",
            show_default=True,
            metavar="auto|mps|cuda[:N]|cpu",
            help="Where calibration runs (auto: mps, then cuda, then cpu; a missing device is an error).",
        ),
        click.option(
            "--sequential",
            is_flag=True,
            help="Layer by layer: load one block's weights at a time from the safetensors (peak memory ~ one block "
            "plus activations), for models larger than memory. Same scales as the whole-model run.",
        ),
        click.option("--data-revision", help="Revision of a --calib-data dataset repo [default: main]."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


@contextlib.contextmanager
def _showing_failed_checks(show, as_json: bool):
    """An export or check whose checks ran and failed raises ExportError with the result, and
    validate whose Apple part failed raises with what it measured: show that before the
    one-line error (or, for a bug, its traceback)."""
    try:
        yield
    except Exception as e:
        if getattr(e, "result", None) is not None:
            show(e.result, as_json)
        raise


def _calibration(calib_data, num_samples, seq_len, seed, observer, percentile, device, sequential, data_revision, **kw):
    return api.calibration_options(
        data=calib_data,
        num_samples=num_samples,
        seq_len=seq_len,
        seed=seed,
        observer=observer,
        percentile=percentile,
        device=device,
        sequential=sequential,
        data_revision=data_revision,
        **kw,
    )


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
@click.option("--revision", help="Branch, tag or commit of a hub repo [default: main].")
@click.option("--token", envvar="HF_TOKEN", show_envvar=True, help="Hugging Face token for gated or private repos.")
@click.option(
    "--ignore",
    multiple=True,
    metavar="PATTERN",
    help="Keep matching Linear modules unquantized (glob, `re:` regex, or a name suffix such as "
    "mlp.down_proj). Repeatable.",
)
@click.option("--trust-remote-code", is_flag=True, help="Allow building an architecture defined by code in the repo.")
@click.option(
    "--experts-layout",
    type=click.Choice(api.EXPERTS_LAYOUTS),
    default="per-expert",
    show_default=True,
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
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
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
    show_default=True,
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
    "fmt",
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
def quantize(
    source,
    output,
    scheme,
    weights,
    block_size,
    revision,
    token,
    ignore,
    trust_remote_code,
    experts_layout,
    force,
    delete_unlisted,
    as_json,
    scales_file,
    dtype,
    max_shard_size,
    upload_repo,
    private,
    fmt,
    component,
    **rest,
):
    """Quantize SOURCE (a hub repo id, a local folder or a .gguf file) to an FP8 compressed-tensors artifact; a
    diffusers pipeline, component or original .safetensors file to FP8 for ComfyUI or diffusers.

    The artifact's README.md is a model card (front matter, what was done, how to load it, the
    source's own card below); `validate` adds its results to it."""
    exports = _exports({k: rest.pop(k) for k in list(rest) if k.startswith(_APPLE)})
    with progress_bars() as progress:
        res = api.quantize(
            source,
            output,
            scheme=scheme,
            weights=weights,
            block_size=block_size,
            revision=revision,
            token=token,
            ignore=list(ignore),
            trust_remote_code=trust_remote_code,
            experts_layout=experts_layout,
            force=force,
            delete_unlisted=delete_unlisted,
            calibration=_calibration(**rest),
            scales_file=scales_file,
            exports=exports,
            dtype=dtype,
            max_shard_size=max_shard_size,
            upload_repo=upload_repo,
            private=private,
            format=fmt,
            component=component,
            progress=progress,
        )
    if res.calibration is not None:
        reports.calibration(res.calibration)
    for w in res.warnings:
        render.warn(w)
    reports.quantize_summary(res, as_json)
    for exported in res.apple.values():
        reports.export_result(exported, as_json)
    if res.upload is not None:
        reports.uploaded(res.upload, as_json)


# --------------------------------------------------------------------------- generated from the Apple targets

_APPLE = "apple__"  # the prefix of quantize's parameters that its Apple options fill


def _click_option(
    o: api.Option, flag: str | None = None, name: str | None = None, help: str | None = None
) -> click.Option:
    """A click option from a target's declared setting (apple/protocol.py's Option)."""
    name = name or o.name
    if o.kind == "flag":
        return click.Option(
            [flag or o.flag, name],
            is_flag=True,
            flag_value=not o.default if o.negate else True,
            default=o.default if o.negate else False,
            help=help or o.help,
        )
    kind = (
        (click.IntRange(min=o.minimum) if o.minimum is not None else int)
        if o.kind == "int"
        else (click.Choice(o.kind) if isinstance(o.kind, tuple) else str)
    )
    return click.Option(
        [flag or o.flag, name],
        type=kind,
        default=o.default,
        show_default=o.default is not None,
        metavar=o.metavar,
        help=help or o.help,
    )


def _quantize_options() -> list[click.Option]:
    """quantize's `--<key>` flag per target, and the targets' options it offers (`Option.quantize`),
    one per spelling: targets that spell an option alike share it (`--max-len`)."""
    params, shared = [], {}
    for key, t in api.targets().items():
        params.append(click.Option([f"--{key}", f"{_APPLE}{key}"], is_flag=True, help=t.quantize_help))
        for o in t.export_flags:
            if o.quantize:
                shared.setdefault(o.quantize, (o, []))[1].append(key)
    for spelling, (o, keys) in shared.items():
        name = f"{_APPLE}{spelling.lstrip('-').replace('-', '_')}"
        params.append(_click_option(o, spelling, name, f"With {' / '.join('--' + k for k in keys)}: {o.help}"))
    return params


def _exports(values: dict) -> dict:
    """quantize's Apple parameters -> {target key: its export options} for the targets asked for."""
    out = {}
    for key, t in api.targets().items():
        if values.get(f"{_APPLE}{key}"):
            out[key] = t.make_options(
                **{
                    o.name: values[f"{_APPLE}{o.quantize.lstrip('-').replace('-', '_')}"]
                    for o in t.export_flags
                    if o.quantize
                }
            )
    return out


def _export_command(key: str, t) -> click.Command:
    """`export-<key>`: export ARTIFACT to the target's package and check it (or only check it)."""

    @friendly_errors
    def run(artifact, force, check_only, no_check, as_json, **kw):
        checks = t.check_options(**{o.name: kw.pop(o.name) for o in t.check_flags})
        with progress_bars() as progress, _showing_failed_checks(reports.check_result, as_json):
            if check_only:
                res = api.check(artifact, key, options=checks, progress=progress)
            else:
                res = api.export(
                    artifact,
                    key,
                    options=t.make_options(force=force, **kw),
                    check=False if no_check else checks,
                    progress=progress,
                )
        if check_only:
            reports.check_result(res, as_json)
        else:
            reports.export_result(res, as_json)

    params = [
        click.Argument(["artifact"], type=click.Path(path_type=Path)),
        *(_click_option(o) for o in t.export_flags),
        click.Option(["--force"], is_flag=True, help=f"Replace an existing {t.package}."),
        click.Option(["--check-only"], is_flag=True, help=f"Do not export: check the {t.noun} already in ARTIFACT."),
        click.Option(["--no-check"], is_flag=True, help="Skip the checks that follow the export."),
        *(_click_option(o) for o in t.check_flags),
        click.Option(["--json", "as_json"], is_flag=True, help="Print the export record and check results as JSON."),
    ]
    return click.Command(f"export-{key}", callback=run, params=params, help=t.help)


_made: dict = {}


def generated() -> dict[str, click.Command]:
    """The commands made from the registry of Apple targets (remade when a target is registered)."""
    now = tuple(api.targets().items())
    if _made.get("for") != now:
        full = click.Command(
            "quantize", callback=quantize.callback, params=[*quantize.params, *_quantize_options()], help=quantize.help
        )
        _made.update(
            {"for": now, "commands": {"quantize": full, **{f"export-{k}": _export_command(k, t) for k, t in now}}}
        )
    return _made["commands"]


main.generate = generated


@main.command()
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
@click.option("--revision", help="Branch, tag or commit of a hub model repo [default: main].")
@click.option(
    "--token", envvar="HF_TOKEN", show_envvar=True, help="Hugging Face token for gated or private repos and datasets."
)
@click.option(
    "--ignore",
    multiple=True,
    metavar="PATTERN",
    help="Linear modules left unquantized (as given to quantize). Repeatable.",
)
@click.option("--trust-remote-code", is_flag=True, help="Allow building an architecture defined by code in the repo.")
@calibration_options
@friendly_errors
def calibrate(target, output, force, revision, token, ignore, trust_remote_code, **calib):
    """Measure static FP8 input scales for TARGET on real text.

    \b
    TARGET an FP8 artifact folder: calibrate the model as it will run (its FP8 weights) and write
           <m>.input_scale into it (atomically; config and manifest become the static scheme).
    TARGET a source (hub id or folder): needs -o FILE; `quantize SRC --scheme fp8 --scales FILE` uses it.
    """
    opts = _calibration(**calib, ignore=list(ignore), trust_remote_code=trust_remote_code, token=token)
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


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@click.option("--tensors", "show_tensors", is_flag=True, help="List every quantized tensor with its SQNR.")
@friendly_errors
def inspect(artifact, as_json, show_tensors):
    """Show what an FP8 artifact holds: source, recipe, sizes, error stats and later checks."""
    m = api.inspect(artifact)
    if as_json:
        render.out.print_json(m.to_json())
    else:
        reports.inspect_table(artifact, m, show_tensors)


@main.command()
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
@click.option(
    "--device",
    type=click.Choice(["auto", "mps", "cuda", "cpu"]),
    default="auto",
    show_default=True,
    help="Where both models run; an unavailable device is an error, never a fallback.",
)
@click.option("--seq-len", type=int, default=None, help="Tokens per accuracy sample [default: 512; on CPU 256].")
@click.option(
    "--max-samples", type=int, default=None, help="Accuracy samples (of --seq-len tokens) [default: 8; on CPU 4]."
)
@click.option(
    "--prefill-len",
    type=int,
    default=None,
    help="Tokens of the one sequence (batch 1) timed for prefill; encoders too [default: 512; on CPU 128].",
)
@click.option(
    "--decode-tokens", type=int, default=None, help="Tokens timed for decode (batch 1) [default: 32; on CPU 16]."
)
@click.option(
    "--repeats",
    type=int,
    default=None,
    help="Timed prefill runs per round, after --warmup [default: 10 on a GPU, 2 on CPU].",
)
@click.option(
    "--rounds",
    type=int,
    default=None,
    help="Rounds of timing, alternating BF16 and FP8; their spread decides whether a difference is clear "
    "[default: 3; on CPU 2].",
)
@click.option(
    "--warmup", type=int, default=None, help="Untimed runs before the first round [default: 3 on a GPU, 1 on CPU]."
)
@click.option(
    "--full",
    is_flag=True,
    help="On CPU too, the full run: 8 samples of 512 tokens, prefill 512, decode 32, 3 rounds of 3 (about 5x the CPU "
    "defaults' time); options given still win.",
)
@click.option("--no-latency", is_flag=True, help="Accuracy only.")
@click.option(
    "--compile",
    "compile_mode",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="torch.compile + CUDA graphs for decode (auto: on CUDA).",
)
@click.option("--no-write", is_flag=True, help="Do not record the results in the artifact's manifest.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
@click.option(
    "--explain", is_flag=True, help="Also print the kernel chosen for every layer shape, with the timings behind it."
)
@friendly_errors
def validate(
    artifact,
    baseline,
    eval_data,
    device,
    seq_len,
    max_samples,
    prefill_len,
    decode_tokens,
    repeats,
    rounds,
    warmup,
    full,
    no_latency,
    compile_mode,
    no_write,
    as_json,
    explain,
):
    """Check ARTIFACT against its BF16 baseline: accuracy (perplexity, KL, top-1 / embedding cosine) and latency.

    On CPU the defaults are fewer and shorter samples (a few minutes for a 135M model on 2 cores;
    the table says so); --full runs the GPU's sizes there too."""
    opts = api.validate_options(
        baseline=baseline,
        eval_data=eval_data,
        device=device,
        seq_len=seq_len,
        max_samples=max_samples,
        prefill_len=prefill_len,
        decode_tokens=decode_tokens,
        repeats=repeats,
        rounds=rounds,
        warmup=warmup,
        full=full,
        latency=not no_latency,
        compile=compile_mode,
        write=not no_write,
    )

    def show(res, as_json: bool) -> None:
        if as_json:
            render.print_json(res.as_dict())
        else:
            reports.validation(res, explain)

    with progress_bars() as progress, _showing_failed_checks(show, as_json):
        res = api.validate(artifact, options=opts, progress=progress)
    show(res, as_json)


@main.command()
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
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
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
    reports.verify_report(artifact, report, as_json)
    if not report.ok:
        sys.exit(1)


class _Backends(click.Choice):
    """--backend's choices: torch and the registered Apple targets, read when the option is used."""

    def __init__(self):
        super().__init__(api.backends())

    @property
    def choices(self):
        return api.backends()

    @choices.setter
    def choices(self, value):  # click sets them once; they are read from the registry instead
        pass


def _sampling(fn):
    """The options `generate` and `chat` share (mlx-lm's names)."""
    opts = [
        click.option(
            "--backend",
            type=_Backends(),
            default="torch",
            show_default=True,
            help="torch: the FP8 model in PyTorch (runtime.load). "
            + " ".join(f"{key}: {t.backend_help}." for key, t in api.targets().items()),
        ),
        click.option(
            "--device",
            default="auto",
            show_default=True,
            metavar="auto|mps|cuda[:N]|cpu",
            help="With --backend torch: where it runs (auto: mps, then cuda, then cpu; a missing device is an error).",
        ),
        click.option(
            "--max-tokens",
            "-m",
            type=click.IntRange(min=1),
            default=256,
            show_default=True,
            help="Most tokens to generate.",
        ),
        click.option(
            "--temp",
            type=click.FloatRange(min=0),
            default=0.0,
            show_default=True,
            help="Sampling temperature (0: greedy).",
        ),
        click.option(
            "--top-p",
            type=click.FloatRange(min=0, max=1, min_open=True),
            default=1.0,
            show_default=True,
            help="Nucleus sampling: keep the most likely tokens up to this total probability.",
        ),
        click.option(
            "--top-k",
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            help="Sample among the K most likely tokens only (0: all; applied before --top-p).",
        ),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampler."),
        click.option("--system", "system_prompt", metavar="TEXT", help="A system message first."),
        click.option(
            "--json", "as_json", is_flag=True, help="Print the text and its stats as JSON on stdout (no streaming)."
        ),
        click.option(
            "--decode",
            "decode",
            type=click.Choice(["auto", "graph", "compile", "eager"]),
            default="auto",
            show_default=True,
            help="With --backend torch: how each token's step runs. auto: the graph on CUDA, eager "
            "elsewhere; graph: the eager step captured as a CUDA graph (seconds); "
            "compile: torch.compile (~30 s per process); eager: no graph. --json says which ran and "
            "what it cost.",
        ),
        click.option(
            "--no-compile", is_flag=True, help="With --backend torch on CUDA: the eager decode loop (--decode eager)."
        ),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _decode_arg(decode: str, no_compile: bool):
    """`compile` for api.chat from --decode and --no-compile (which asks the eager loop)."""
    if no_compile and decode not in ("auto", "eager"):
        raise click.UsageError(f"--no-compile asks the eager loop; it contradicts --decode {decode}")
    return "eager" if no_compile else None if decode == "auto" else decode


def _open_chat(artifact, backend, device, max_tokens, temp, top_p, top_k, seed, system_prompt, decode, no_compile):
    """The loaded chat session that generate and chat drive, from their shared sampling options (`_sampling`)."""
    with progress_bars() as progress:
        return api.chat(
            artifact,
            backend=backend,
            device=device,
            max_tokens=max_tokens,
            temp=temp,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            system=system_prompt,
            progress=progress,
            compile=_decode_arg(decode, no_compile),
        )


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("prompt")
@_sampling
@click.option(
    "--ignore-chat-template", is_flag=True, help="Feed PROMPT as it is, not wrapped in the tokenizer's chat template."
)
@friendly_errors
def generate(
    artifact,
    prompt,
    backend,
    device,
    max_tokens,
    temp,
    top_p,
    top_k,
    seed,
    system_prompt,
    as_json,
    decode,
    no_compile,
    ignore_chat_template,
):
    """Generate text from ARTIFACT for PROMPT, streamed as it comes, then tokens/s, peak memory and device.

    \b
    PROMPT is wrapped in the tokenizer's chat template when it has one (as mlx_lm.generate does);
    `-` reads it from standard input (`cat notes.txt | mpsconvert generate DIR -`).
    """
    if prompt == "-":
        prompt = render.read_prompt()
    c = _open_chat(artifact, backend, device, max_tokens, temp, top_p, top_k, seed, system_prompt, decode, no_compile)
    with c:
        res = c.complete(prompt, None if as_json else render.stream, use_template=not ignore_chat_template)
    reports.generation(res, as_json)


# chat's commands: a line of one word starting with "/" that is none of these is not sent to the model
CHAT_COMMANDS = {"end": ("/exit", "/quit", "/bye"), "reset": ("/reset", "/clear"), "help": ("/help", "/?")}
CHAT_HELP = (
    "/exit (or /quit, end of input) ends, /reset forgets the history; a message may start with / where it has a space"
)


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@_sampling
@friendly_errors
def chat(artifact, backend, device, max_tokens, temp, top_p, top_k, seed, system_prompt, as_json, decode, no_compile):
    """Chat with ARTIFACT: the tokenizer's chat template, the history kept; `/exit` (or `/quit`, or end
    of input) ends, `/reset` forgets, `/help` lists these."""
    c = _open_chat(artifact, backend, device, max_tokens, temp, top_p, top_k, seed, system_prompt, decode, no_compile)
    with c:
        c.require_template()  # before the prompt, not at the first message
        render.note(
            f"chatting with {artifact} ({c.backend} on {c.device}); /exit to end, /reset to forget the history, /help"
        )
        while True:
            try:
                line = render.ask()
            except PromptError as e:  # a message that cannot be sent: said, and the chat goes on
                render.error(as_flags(str(e)))
                continue
            command = line.strip() if line is not None else "/exit"
            if command in CHAT_COMMANDS["end"]:
                break
            if command in CHAT_COMMANDS["reset"]:
                c.reset()
                render.note("history cleared")
                continue
            if not command:
                continue
            if command.startswith("/") and not any(
                ch.isspace() for ch in command
            ):  # one word: meant as a command, not a message
                known = command in CHAT_COMMANDS["help"]
                render.note(("" if known else f"unknown command {command}: ") + CHAT_HELP)
                continue
            try:
                res = c.say(line, None if as_json else render.stream)
            except PromptError as e:  # too long for the model even alone: said, and the chat goes on
                render.error(as_flags(str(e)))
                continue
            if res.dropped:
                render.warn(
                    f"the history outgrew the model's context: the {res.dropped} oldest message(s) were dropped"
                )
            reports.generation(res, as_json, turn=True)


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("repo")
@click.option(
    "--private",
    is_flag=True,
    help="Create the repo private. An existing repo keeps its visibility; a public one is refused with --private.",
)
@click.option(
    "--token", envvar="HF_TOKEN", show_envvar=True, help="A Hugging Face write token [default: your stored login]."
)
@click.option("--revision", help="The branch to commit to [default: main].")
@click.option("--json", "as_json", is_flag=True, help="Print what was uploaded as JSON.")
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
