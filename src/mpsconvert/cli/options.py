"""The options that several commands share, and their translation into the API's settings.

`calibration_options` (quantize --scheme fp8 and calibrate), `sampling_options` (generate and chat), and the options
declared as data by the Apple targets (apple/protocol.py's `Option`): one click option each, quantize's
`--<key>` flags and the export options they carry, read back by `apple_exports`."""

from __future__ import annotations

import click

from .. import api


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


def calibration(calib_data, num_samples, seq_len, seed, observer, percentile, device, sequential, data_revision, **kw):
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


APPLE_PREFIX = "apple__"  # the prefix of quantize's parameters that its Apple options fill


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
        name = f"{APPLE_PREFIX}{spelling.lstrip('-').replace('-', '_')}"
        params.append(click_option(o, spelling, name, f"With {' / '.join('--' + k for k in keys)}: {o.help}"))
    return params


def apple_exports(values: dict) -> dict:
    """quantize's Apple parameters -> {target key: its export options} for the targets asked for."""
    out = {}
    for key, t in api.targets().items():
        if values.get(f"{APPLE_PREFIX}{key}"):
            out[key] = t.make_options(
                **{
                    o.name: values[f"{APPLE_PREFIX}{o.quantize.lstrip('-').replace('-', '_')}"]
                    for o in t.export_flags
                    if o.quantize
                }
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


def sampling_options(fn):
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
