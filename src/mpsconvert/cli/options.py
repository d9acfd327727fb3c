"""The options that several commands share, and their translation into the API's settings.

`calibration_options` (quantize --scheme fp8 and calibrate), `source_options` (how quantize and calibrate read a
source), `sampling_options` (generate and chat), the flags many commands spell alike (`json_option`, `device_option`,
`token_option`), and the options declared as data by the Apple targets (apple/protocol.py's `Option`): one click
option each, quantize's `--<key>` flags and the export options they carry, read back by `apple_exports`.

A command's parameters are named as the API's keywords (the exceptions are the CLI's own: `as_json`, the negated
`no_*` flags), so a command hands what it does not read itself on to the API as it is."""

from __future__ import annotations

import click

from .. import api


def stacked(*options):
    """One decorator applying `options` (click decorators) in the order given, as if written one above the other."""

    def apply(fn):
        for o in reversed(options):
            fn = o(fn)
        return fn

    return apply


def json_option(help: str):
    """--json: the command's result as JSON on stdout (`as_json`)."""
    return click.option("--json", "as_json", is_flag=True, help=help)


def device_option(help: str, **kw):
    """--device: where the work runs, "auto" by default (`kw`: the command's `type` or `metavar` for it)."""
    return click.option("--device", default="auto", help=help, **kw)


DEVICE_METAVAR = "auto|mps|cuda[:N]|cpu"


def token_option(help: str):
    """--token: a Hugging Face token, also read from HF_TOKEN."""
    return click.option("--token", envvar="HF_TOKEN", show_envvar=True, help=help)


def source_options(revision: str, token: str, ignore: str):
    """How quantize and calibrate read a source (each command with its own help of the first three):
    --revision, --token, --ignore and --trust-remote-code."""
    return stacked(
        click.option("--revision", help=revision),
        token_option(token),
        click.option("--ignore", multiple=True, metavar="PATTERN", help=ignore),
        click.option(
            "--trust-remote-code", is_flag=True, help="Allow building an architecture defined by code in the repo."
        ),
    )


# The parameters `calibration_options` adds: the API's calibration settings of the same names.
CALIBRATION = "data num_samples seq_len seed observer percentile device sequential data_revision".split()

calibration_options = stacked(  # the options shared by `quantize --scheme fp8` and `calibrate`
    click.option(
        "--calib-data",
        "data",
        metavar="FILE|DIR|DATASET",
        help="Calibration text: a .txt file (documents separated by blank lines), a .jsonl/.json/.parquet file "
        "with a 'text' field, a folder of those, or a Hugging Face dataset repo id "
        "[default: the small built-in set of prose, code and dialogue].",
    ),
    click.option("--num-samples", type=click.IntRange(min=1), default=128, help="Token windows to calibrate on."),
    click.option("--seq-len", type=click.IntRange(min=16), default=512, help="Tokens per window."),
    click.option("--seed", type=int, default=0, help="Seed of the (deterministic) document shuffle."),
    click.option(
        "--observer",
        type=click.Choice(api.OBSERVERS),
        default="minmax",
        help="minmax: the true maximum |x| (best measured on SmolLM2 and MiniLM). percentile: the "
        "--percentile of |x| (clips the largest activations; LLMs rely on those outliers, so it "
        "hurts them badly). mse: the clip that minimises the FP8 error on the observed "
        "activations.",
    ),
    click.option("--percentile", type=float, default=api.DEFAULT_PERCENTILE, help="For --observer percentile."),
    device_option(
        "Where calibration runs (auto: mps, then cuda, then cpu; a missing device is an error).",
        metavar=DEVICE_METAVAR,
    ),
    click.option(
        "--sequential",
        is_flag=True,
        help="Layer by layer: load one block's weights at a time from the safetensors (peak memory ~ one block "
        "plus activations), for models larger than memory. Same scales as the whole-model run.",
    ),
    click.option("--data-revision", help="Revision of a --calib-data dataset repo [default: main]."),
)


def calibration(params: dict, **kw):
    """`api.calibration_options` from the `calibration_options` among a command's `params` (taken out of
    them), with `kw`."""
    return api.calibration_options(**{k: params.pop(k) for k in CALIBRATION}, **kw)


APPLE_PREFIX = "apple__"  # the prefix of quantize's parameters that its Apple options fill


def _apple_param(spelling: str) -> str:
    """quantize's parameter that the Apple option spelled `spelling` (`--coreml-seq-len`) fills."""
    return f"{APPLE_PREFIX}{spelling.lstrip('-').replace('-', '_')}"


def click_option(
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
            show_default=False,  # a negated flag's default (True) reads as the opposite of what it does
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
        metavar=o.metavar,
        help=help or o.help,
    )


def quantize_options() -> list[click.Option]:
    """quantize's `--<key>` flag per target, and the targets' options it offers (`Option.quantize`),
    one per spelling: targets that spell an option alike share it (`--max-len`)."""
    params, shared = [], {}
    for key, t in api.targets().items():
        params.append(click.Option([f"--{key}", f"{APPLE_PREFIX}{key}"], is_flag=True, help=t.quantize_help))
        for o in t.export_flags:
            if o.quantize:
                shared.setdefault(o.quantize, (o, []))[1].append(key)
    for spelling, (o, keys) in shared.items():
        text = f"With {' / '.join('--' + k for k in keys)}: {o.help}"
        params.append(click_option(o, spelling, _apple_param(spelling), text))
    return params


def apple_exports(values: dict) -> dict:
    """quantize's Apple parameters -> {target key: its export options} for the targets asked for."""
    out = {}
    for key, t in api.targets().items():
        if values.get(f"{APPLE_PREFIX}{key}"):
            out[key] = t.make_options(
                **{o.name: values[_apple_param(o.quantize)] for o in t.export_flags if o.quantize}
            )
    return out


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


sampling_options = stacked(  # the options `generate` and `chat` share (mlx-lm's names)
    click.option(
        "--backend",
        type=_Backends(),
        default="torch",
        help="torch: the FP8 model in PyTorch (runtime.load). "
        + " ".join(f"{key}: {t.backend_help}." for key, t in api.targets().items()),
    ),
    device_option(
        "With --backend torch: where it runs (auto: mps, then cuda, then cpu; a missing device is an error).",
        metavar=DEVICE_METAVAR,
    ),
    click.option("--max-tokens", "-m", type=click.IntRange(min=1), default=256, help="Most tokens to generate."),
    click.option("--temp", type=click.FloatRange(min=0), default=0.0, help="Sampling temperature (0: greedy)."),
    click.option(
        "--top-p",
        type=click.FloatRange(min=0, max=1, min_open=True),
        default=1.0,
        help="Nucleus sampling: keep the most likely tokens up to this total probability.",
    ),
    click.option(
        "--top-k",
        type=click.IntRange(min=0),
        default=0,
        help="Sample among the K most likely tokens only (0: all; applied before --top-p).",
    ),
    click.option("--seed", type=int, default=0, help="Seed of the sampler."),
    click.option("--system", metavar="TEXT", help="A system message first."),
    json_option("Print the text and its stats as JSON on stdout (no streaming)."),
    click.option(
        "--decode",
        "decode",
        type=click.Choice(["auto", "graph", "compile", "eager"]),
        default="auto",
        help="With --backend torch: how each token's step runs. auto: the graph on CUDA, eager "
        "elsewhere; graph: the eager step captured as a CUDA graph (seconds); "
        "compile: torch.compile (~30 s per process); eager: no graph. --json says which ran and "
        "what it cost.",
    ),
    click.option(
        "--no-compile", is_flag=True, help="With --backend torch on CUDA: the eager decode loop (--decode eager)."
    ),
)
