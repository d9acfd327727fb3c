"""The `mpsconvert` command line: options -> library calls -> progress and results.

Every user-fixable problem is an MpsconvertError, printed as one line (`error: ...`) with a
non-zero exit; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import signal
import sys
import threading
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn
from rich.table import Table

from . import __version__
from .errors import MpsconvertError
from .manifests.schemes import SCHEMES, WEIGHT_GRANULARITIES

console = Console(stderr=True)
out = Console()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that cleanup (temporary outputs) runs as for Ctrl-C."""


_caught: list[int] = []  # signals received during the current command


def _on_signal(signum, frame):
    from .atomic import stop_requested

    _caught.append(signum)
    stop_requested.set()
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def friendly_errors(fn):
    """Turn MpsconvertError into `error: <problem>; <fix>` and exit code 2; Ctrl-C into exit 130,
    SIGTERM into 143, after the partial output is removed."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from .atomic import stop_requested

        stop_requested.clear()
        _caught.clear()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _on_signal)
            signal.signal(signal.SIGINT, _on_signal)
        try:
            result = fn(*args, **kwargs)
        except MpsconvertError as e:
            console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt as e:
            console.print("[bold red]interrupted[/]: partial output removed")
            sys.exit(143 if isinstance(e, Terminated) else 130)
        if stop_requested.is_set():  # the signal came after the output was complete (or its exception was lost)
            console.print("[bold red]interrupted[/] after the output was complete")
            sys.exit(143 if signal.SIGTERM in _caught else 130)
        return result

    return wrapper


def byte_progress(total: int, label: str):
    """A rich progress bar over bytes, on stderr, hidden when stderr is not a terminal."""
    return Progress(
        TextColumn(f"[bold]{label}[/]"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    )


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mpsconvert")
def main():
    """Convert Hugging Face models to FP8 (float8_e4m3fn) for Apple Silicon and Core ML, and check them.

    \b
    Typical use:
      mpsconvert quantize Qwen/Qwen2.5-0.5B -o qwen-fp8      # data-free, dynamic activations
      mpsconvert inspect qwen-fp8
    """


def calibration_options(fn):
    """The options shared by `quantize --scheme fp8` and `calibrate`."""
    from .calibrate import DEFAULT_PERCENTILE, OBSERVERS  # torch-free, so --help stays fast

    opts = [
        click.option("--calib-data", metavar="FILE|DIR|DATASET",
                     help="Calibration text: a .txt file (documents separated by blank lines), a .jsonl/.json/.parquet file "
                          "with a 'text' field, a folder of those, or a Hugging Face dataset repo id "
                          "[default: the small built-in set of prose, code and dialogue]."),
        click.option("--num-samples", type=click.IntRange(min=1), default=128, show_default=True, help="Token windows to calibrate on."),
        click.option("--seq-len", type=click.IntRange(min=16), default=512, show_default=True, help="Tokens per window."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of the (deterministic) document shuffle."),
        click.option("--observer", type=click.Choice(OBSERVERS), default="minmax", show_default=True,
                     help="minmax: the true maximum |x| (best measured on SmolLM2 and MiniLM). percentile: the --percentile of |x| "
                          "(clips outlier activations, which LLMs need: it hurts them badly). "
                          "mse: the clip that minimises the FP8 error on the observed activations."),
        click.option("--percentile", type=float, default=DEFAULT_PERCENTILE, show_default=True, help="For --observer percentile."),
        click.option("--device", default="auto", show_default=True, metavar="auto|mps|cuda[:N]|cpu",
                     help="Where calibration runs (auto: mps, then cuda, then cpu; a missing device is an error)."),
        click.option("--sequential", is_flag=True,
                     help="Layer by layer: load one block's weights at a time from the safetensors (peak memory ~ one block "
                          "plus activations), for models larger than memory. Same scales as the whole-model run."),
        click.option("--data-revision", help="Revision of a --calib-data dataset repo [default: main]."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _calib_opts(calib_data, num_samples, seq_len, seed, observer, percentile, device, sequential, data_revision, ignore=(), trust_remote_code=False, token=None):
    from .calibrate.run import CalibOptions

    return CalibOptions(data=calib_data, num_samples=num_samples, seq_len=seq_len, seed=seed, observer=observer,
                        percentile=percentile, device=device, sequential=sequential, ignore=list(ignore),
                        trust_remote_code=trust_remote_code, data_revision=data_revision, token=token)


def run_calibration(model_dir: Path, copts):
    """Calibrate with a progress bar; print where it ran and every warning (fallbacks included)."""
    from rich.progress import MofNCompleteColumn

    from .calibrate.run import calibrate

    with Progress(TextColumn("[bold]calibrate[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, disable=not console.is_terminal) as prog:
        task = prog.add_task("", total=None)
        cal = calibrate(model_dir, copts, progress=lambda done, total, label: prog.update(task, completed=done, total=total, description=label))
    r = cal.record
    console.print(f"calibrated on {r['device']} ({r['mode']}, observer {r['observer']}): {r['num_samples']} samples, "
                  f"{r['tokens']} tokens in {cal.seconds:.1f} s ({r['num_samples'] / max(cal.seconds, 1e-9):.2f} samples/s)", highlight=False)
    for w in cal.warnings:
        console.print(f"[yellow]warning:[/] {w}", highlight=False, soft_wrap=True)
    return cal


@main.command()
@click.argument("source")
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), help="Output folder [default: <name>-<scheme>].")
@click.option("--scheme", type=click.Choice(SCHEMES), default="fp8-dynamic", show_default=True,
              help="fp8-dynamic: FP8 weights, activations quantized per token at run time. "
                   "fp8: static per-tensor activation scales from calibration. "
                   "fp8-weight-only: activations stay BF16.")
@click.option("--weights", type=click.Choice(WEIGHT_GRANULARITIES), default=None,
              help="Weight scale granularity [default: row for fp8-dynamic/fp8-weight-only, tensor for fp8].")
@click.option("--revision", help="Branch, tag or commit of a hub repo [default: main].")
@click.option("--token", envvar="HF_TOKEN", show_envvar=True, help="Hugging Face token for gated or private repos.")
@click.option("--ignore", multiple=True, metavar="PATTERN",
              help="Keep matching Linear modules unquantized (glob, `re:` regex, or a name suffix such as mlp.down_proj). Repeatable.")
@click.option("--trust-remote-code", is_flag=True, help="Allow building an architecture defined by code in the repo.")
@click.option("--experts-layout", type=click.Choice(["per-expert", "checkpoint"]), default="per-expert", show_default=True,
              help="MoE checkpoints that store experts fused (3-D): per-expert writes one FP8 tensor per expert and projection "
                   "(loads in transformers + compressed-tensors and vLLM); checkpoint keeps them fused (loads only in mpsconvert's runtime).")
@click.option("--force", is_flag=True, help="Replace an existing output folder (only once the new one is complete).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@click.option("--scales", "scales_file", type=click.Path(path_type=Path, dir_okay=False),
              help="For --scheme fp8: use the input scales from `mpsconvert calibrate -o FILE` instead of calibrating.")
@calibration_options
@click.option("--coreml", is_flag=True, help="Also export a Core ML package (model.mlpackage) into the artifact; see `export-coreml`.")
@click.option("--coreml-weights", type=click.Choice(("fp8-lut", "int8", "fp16")), default="fp8-lut", show_default=True,
              help="With --coreml: how the FP8 weights are stored in the package.")
@click.option("--coreml-seq-len", default="128", show_default=True, metavar="N|LO:HI", help="With --coreml: sequence length or range.")
@friendly_errors
def quantize(source, output, scheme, weights, revision, token, ignore, trust_remote_code, experts_layout, force, as_json,
             scales_file, calib_data, num_samples, seq_len, seed, observer, percentile, device, sequential, data_revision,
             coreml, coreml_weights, coreml_seq_len):
    """Quantize SOURCE (a hub repo id or a local folder) to an FP8 compressed-tensors artifact."""
    from .manifests.schemes import Scheme
    from .source import resolve

    sch = Scheme.make(scheme, weights)
    snap = resolve(source, revision=revision, token=token)
    snap.start_hashing()  # before torch and transformers load: the hashing overlaps those seconds
    from .convert.quantize import Options, quantize_snapshot

    output = output or Path(f"{(snap.repo_id or snap.path.name).split('/')[-1]}-{scheme}")
    opts = Options(scheme=sch, ignore=list(ignore), force=force, trust_remote_code=trust_remote_code, experts_layout=experts_layout)
    if sch.needs_calibration:
        if scales_file is not None:
            from .calibrate.artifact import load_scales

            opts.input_scales, opts.calibration = load_scales(scales_file)
            opts.calibration = {**opts.calibration, "scales_file": str(scales_file)}
        else:
            cal = run_calibration(snap.path, _calib_opts(calib_data, num_samples, seq_len, seed, observer, percentile, device,
                                                         sequential, data_revision, ignore, trust_remote_code, token))
            opts.input_scales, opts.calibration = cal.scales, cal.record
        opts.device = opts.calibration.get("device", opts.device)
    elif scales_file is not None or calib_data is not None:
        raise MpsconvertError(f"--calib-data/--scales only apply to --scheme fp8 (got --scheme {scheme})", "add --scheme fp8, or drop them")
    total = snap.total_weight_bytes
    with byte_progress(total, "quantize") as prog:
        task = prog.add_task("", total=total)
        manifest = quantize_snapshot(snap, output, opts, progress=lambda n, name: prog.update(task, advance=n, description=name[-48:]))
    print_summary(manifest, output, as_json)
    if coreml:
        _export_coreml(output, coreml_seq_len, coreml_weights, force=True, frontend="auto", check=True, samples=3, as_json=as_json)


def print_summary(manifest, output: Path, as_json: bool) -> None:
    s = manifest.summary
    if as_json:
        out.print_json(json.dumps({"output": str(output), **s}))
        return
    t = Table(title=f"{output}", show_header=False, box=None)
    t.add_row("scheme", f"{manifest.recipe['name']} (weights per {manifest.recipe['weights']}, activations: {manifest.recipe['activations'] or 'bf16'})")
    t.add_row("weights", f"{_human(s['weight_bytes_before'])} -> {_human(s['weight_bytes_after'])} ({s['ratio']:.2f}x)")
    n_exp = s.get("expert_tensors_quantized", 0)
    t.add_row("quantized", f"{s['tensors_quantized'] - n_exp} Linear weights" + (f", {n_exp} MoE expert tensors" if n_exp else ""))
    kept = list(manifest.recipe["ignored_modules"])
    t.add_row("kept (Linear)", f"{len(kept)}: " + ", ".join(kept[:4]) + (" ..." if len(kept) > 4 else "") if kept else "none")
    if s["modules_skipped"]:
        kinds = sorted({r.split(":")[0] for r in manifest.skipped.values()})
        t.add_row("skipped", f"{s['modules_skipped']} non-Linear modules ({'; '.join(kinds)})")
    if s["worst_sqnr_db"] is not None:
        t.add_row("worst SQNR", f"{s['worst_sqnr_db']:.1f} dB at {s['worst_sqnr_tensor']}")
    out.print(t)


@main.command()
@click.argument("target")
@click.option("-o", "--output", "output", type=click.Path(path_type=Path, dir_okay=False),
              help="Write the scales to this JSON file (for `quantize --scheme fp8 --scales FILE`) instead of into the artifact.")
@click.option("--revision", help="Branch, tag or commit of a hub model repo [default: main].")
@click.option("--token", envvar="HF_TOKEN", show_envvar=True, help="Hugging Face token for gated or private repos and datasets.")
@click.option("--ignore", multiple=True, metavar="PATTERN", help="Linear modules left unquantized (as given to quantize). Repeatable.")
@click.option("--trust-remote-code", is_flag=True, help="Allow building an architecture defined by code in the repo.")
@calibration_options
@friendly_errors
def calibrate(target, output, revision, token, ignore, trust_remote_code,
              calib_data, num_samples, seq_len, seed, observer, percentile, device, sequential, data_revision):
    """Measure static FP8 input scales for TARGET on real text.

    \b
    TARGET an FP8 artifact folder: calibrate the model as it will run (its FP8 weights) and write
           <m>.input_scale into it (atomically; config and manifest become the static scheme).
    TARGET a source (hub id or folder): needs -o FILE; `quantize SRC --scheme fp8 --scales FILE` uses it.
    """
    from .calibrate.artifact import dequantized_snapshot, is_artifact, save_scales, write_into_artifact

    copts = _calib_opts(calib_data, num_samples, seq_len, seed, observer, percentile, device, sequential,
                        data_revision, ignore, trust_remote_code, token)
    path = Path(target).expanduser()
    if is_artifact(path):
        from .manifests.manifest import Manifest

        recipe = Manifest.read(path).recipe
        copts.ignore = list(recipe.get("ignore_patterns") or copts.ignore)
        with dequantized_snapshot(path) as snap_dir:
            cal = run_calibration(snap_dir, copts)
        cal.record["weights"] = "the artifact's FP8 weights, dequantized"
        if output is not None:
            save_scales(output, cal)
            out.print(f"wrote {len(cal.scales)} input scales to {output}")
            return
        write_into_artifact(path, cal)
        out.print(f"wrote {len(cal.scales)} input scales into {path} (scheme fp8, static per-tensor activations)")
        return
    if output is None:
        raise MpsconvertError(f"{target} is a source model, not an mpsconvert artifact", "pass -o scales.json, or point at an artifact folder")
    from .source import resolve

    snap = resolve(target, revision=revision, token=token)
    cal = run_calibration(snap.path, copts)
    save_scales(output, cal)
    out.print(f"wrote {len(cal.scales)} input scales to {output}")


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@click.option("--tensors", "show_tensors", is_flag=True, help="List every quantized tensor with its SQNR.")
@friendly_errors
def inspect(artifact, as_json, show_tensors):
    """Show what an FP8 artifact holds: source, recipe, sizes, error stats and later checks."""
    from .manifests.manifest import Manifest

    m = Manifest.read(artifact)
    if as_json:
        out.print_json(m.to_json())
        return
    src = m.source
    t = Table(title=str(artifact), show_header=False, box=None)
    t.add_row("source", f"{src.get('id')} ({src.get('kind')}" + (f", commit {src['commit'][:12]}" if src.get("commit") else "") + ")")
    t.add_row("scheme", f"{m.recipe['name']}: weights per {m.recipe['weights']}, activations {m.recipe['activations'] or 'bf16'}")
    if cal := m.recipe.get("calibration"):
        t.add_row("calibration", f"{cal.get('observer')} on {cal.get('device')} ({cal.get('mode')}), {cal.get('num_samples')} x {cal.get('seq_len')} tokens "
                  f"of {(cal.get('data') or {}).get('id')} (sha256 {str((cal.get('data') or {}).get('sha256'))[:12]}), {len(cal.get('fallbacks') or {})} fallback(s)")
    s = m.summary
    t.add_row("architecture", str(s.get("architecture")))
    t.add_row("weights", f"{_human(s['weight_bytes_before'])} -> {_human(s['weight_bytes_after'])} ({s['ratio']:.2f}x)")
    t.add_row("tensors", f"{s['tensors_quantized']} quantized, {s['linear_ignored']} Linear kept, {s['modules_skipped']} other modules skipped")
    if s.get("worst_sqnr_db") is not None:
        t.add_row("worst SQNR", f"{s['worst_sqnr_db']:.1f} dB at {s['worst_sqnr_tensor']}")
    t.add_row("files", f"{len(m.files)} ({_human(sum(f['size'] for f in m.files.values()))})")
    t.add_row("made with", f"mpsconvert {m.versions.get('mpsconvert')}, torch {m.versions.get('torch')}, transformers {m.versions.get('transformers')} on {m.device}")
    for key, val in m.extra.items():
        t.add_row(key, json.dumps(val)[:120])
    out.print(t)
    if show_tensors:
        tt = Table("tensor", "shape", "scale", "SQNR dB")
        for name, r in m.tensors.items():
            tt.add_row(name, "x".join(map(str, r["shape"])), "x".join(map(str, r["weight_scale_shape"])), f"{r['sqnr_db']:.1f}" if r["sqnr_db"] is not None else "exact")
        out.print(tt)


# --- validate (runtime) -------------------------------------------------------------------------
@main.command()
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--baseline", metavar="SRC", help="BF16 model to compare against (hub id or folder) [default: the manifest's source].")
@click.option("--eval-data", "eval_data", type=click.Path(dir_okay=False), help="Eval text: .jsonl with a 'text' field per line, or .txt.")
@click.option("--device", type=click.Choice(["auto", "mps", "cuda", "cpu"]), default="auto", show_default=True,
              help="Where both models run; an unavailable device is an error, never a fallback.")
@click.option("--seq-len", type=int, default=512, show_default=True, help="Tokens per accuracy sample.")
@click.option("--max-samples", type=int, default=8, show_default=True, help="Accuracy samples (of --seq-len tokens).")
@click.option("--prefill-len", type=int, default=512, show_default=True, help="Tokens of the one sequence (batch 1) timed for prefill; encoders too.")
@click.option("--decode-tokens", type=int, default=32, show_default=True, help="Tokens timed for decode (batch 1).")
@click.option("--repeats", type=int, default=None, help="Timed prefill runs per round, after --warmup [default: 10 on a GPU, 3 on CPU].")
@click.option("--rounds", type=int, default=3, show_default=True,
              help="Rounds of timing, alternating BF16 and FP8; their spread decides whether a difference is clear.")
@click.option("--warmup", type=int, default=None, help="Untimed runs before the first round [default: 3 on a GPU, 1 on CPU].")
@click.option("--no-latency", is_flag=True, help="Accuracy only.")
@click.option("--compile", "compile_mode", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="torch.compile + CUDA graphs for decode (auto: on CUDA).")
@click.option("--no-write", is_flag=True, help="Do not record the results in the artifact's manifest.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
@click.option("--explain", is_flag=True, help="Also print the kernel chosen for every layer shape, with the timings behind it.")
@friendly_errors
def validate(artifact, baseline, eval_data, device, seq_len, max_samples, prefill_len, decode_tokens, repeats, rounds, warmup,
             no_latency, compile_mode, no_write, as_json, explain):
    """Check ARTIFACT against its BF16 baseline: accuracy (perplexity, KL, top-1 / embedding cosine) and latency."""
    from rich.progress import MofNCompleteColumn

    from .runtime.validate import ValidateOptions
    from .runtime.validate import validate as run_validate

    opts = ValidateOptions(baseline=baseline, eval_data=eval_data, device=device, seq_len=seq_len, max_samples=max_samples,
                           prefill_len=prefill_len, decode_tokens=decode_tokens, repeats=repeats, rounds=rounds, warmup=warmup,
                           latency=not no_latency, compile=compile_mode, write=not no_write)
    with Progress(TextColumn("[bold]{task.description}[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not console.is_terminal) as prog:
        tasks: dict = {}

        def progress(phase, done, total):
            if phase not in tasks:
                tasks[phase] = prog.add_task(phase, total=total)
            prog.update(tasks[phase], completed=done, total=total)

        result = run_validate(artifact, opts, progress)
    result["coreml"] = _coreml_runtime(artifact, record=not no_write)
    if as_json:
        out.print_json(json.dumps(result))
        return
    print_validation(result, explain)
    cm = result["coreml"]
    if cm is not None:
        if cm.get("status") == "skipped":
            out.print(f"Core ML package: not run here ({cm['reason']})", highlight=False)
        else:
            out.print_json(json.dumps(cm))


def _coreml_runtime(artifact: Path, record: bool) -> dict | None:
    """The Core ML part of validate: only for artifacts with a package; on macOS only (else 'skipped')."""
    from .manifests.manifest import Manifest

    m = Manifest.read(artifact) if (artifact / "mpsconvert.json").is_file() else None
    if m is None or "coreml" not in m.extra:
        return None
    from .convert.coreml_check import coreml_runtime_check

    res = coreml_runtime_check(artifact)
    if record and res.get("status") != "skipped":
        m = Manifest.read(artifact)
        m.extra["coreml_runtime"] = res
        m.write(artifact)
    return res


def _speed(v: dict) -> str:
    """'1.42x faster (spread 6%)', or 'no clear difference (0.97x, spread 12%)': a verdict only
    where the difference exceeds the run-to-run spread measured in the same run."""
    spread = f"spread {100 * v['spread']:.0f}%"
    if v["verdict"] == "no clear difference":
        return f"no clear difference ({v['ratio']:.2f}x, {spread})"
    return f"{v['ratio']:.2f}x {v['verdict']} ({spread})"


def print_validation(r: dict, explain: bool = False) -> None:
    a = r["accuracy"]
    t = Table(title=f"{r['scheme']} (weights per {r['weights']}) vs BF16 on {r['device_name']} ({r['device']})")
    t.add_column("metric")
    t.add_column("BF16", justify="right")
    t.add_column("FP8", justify="right")
    t.add_column("FP8 vs BF16", justify="right")
    if r["kind"] == "causal-lm":
        t.add_row(f"perplexity ({a['tokens']} tokens)", f"{a['perplexity_bf16']:.3f}", f"{a['perplexity_fp8']:.3f}",
                  f"{a['perplexity_delta']:+.3f} ({a['perplexity_delta_pct']:+.2f}%)")
        t.add_row("mean KL(bf16 || fp8)", "", "", f"{a['mean_kl']:.5f} nats")
        t.add_row("top-1 agreement", "", "", f"{100 * a['top1_agreement']:.2f}%")
    else:
        t.add_row(f"embedding cosine ({a['sentences']} sentences)", "", "", f"mean {a['cosine_mean']:.5f}, min {a['cosine_min']:.5f}")
    wb = r["weight_bytes"]
    t.add_row("weights in memory", _human(wb["bf16"]), _human(wb["fp8"]), f"{wb['fp8'] / wb['bf16']:.3f}x")
    lat = r.get("latency")
    if lat:
        b, f = lat["bf16"], lat["fp8"]
        t.add_row(f"prefill {b['prefill']['tokens']} tok, median (p95) ms", f"{b['prefill']['median_ms']:.2f} ({b['prefill']['p95_ms']:.2f})",
                  f"{f['prefill']['median_ms']:.2f} ({f['prefill']['p95_ms']:.2f})", _speed(r['verdict']['prefill']))
        if "decode" in b:
            t.add_row(f"decode tokens/s (median; p95 ms/token){' compiled' if r['settings']['compile'] else ''}",
                      f"{b['decode']['tokens_per_s']:.1f} ({b['decode']['p95_ms']:.2f})", f"{f['decode']['tokens_per_s']:.1f} ({f['decode']['p95_ms']:.2f})",
                      _speed(r['verdict']['decode']))
        if b.get("peak_memory_bytes") is not None:
            t.add_row("peak device memory", _human(b["peak_memory_bytes"]), _human(f["peak_memory_bytes"]),
                      f"{f['peak_memory_bytes'] / b['peak_memory_bytes']:.3f}x")
    out.print(t)
    for d in r.get("dequantized_at_load") or []:
        out.print(f"note: {d}")
    if explain:
        print_kernels(r["kernels"])
    if r.get("recorded"):
        out.print(f"recorded in {r['recorded']}")


def print_kernels(decisions: list) -> None:
    """One line per layer shape and bucket: the kernel, how it was decided, what was measured (fastest first)."""
    out.print("[bold]kernel policy[/] (per layer shape and token bucket; us per call, fastest first)")
    notes: dict[str, list[str]] = {}
    for d in decisions:
        ok = sorted((v, k) for k, v in d["timings_us"].items() if not isinstance(v, str))
        bad = [f"{k} ({v})" for k, v in d["timings_us"].items() if isinstance(v, str)]
        measured = " | ".join(f"{k} {v:.1f}" for v, k in ok) + (f"; cannot run: {', '.join(bad)}" if bad else "")
        out.print(f"  {d['shape'][0]}x{d['shape'][1]} ({d['layers']} layers) {d['bucket']} M={d['m']}: [bold]{d['choice']}[/] "
                  f"\\[{d['source']}]" + (f"  {measured}" if measured else ""), highlight=False)
        if d["note"]:
            notes.setdefault(d["note"], []).append(f"{d['shape'][0]}x{d['shape'][1]} {d['bucket']}")
    for note, where in notes.items():
        out.print(f"  note ({', '.join(where)}): {note}", highlight=False)
# --------------------------------------------------------------------------- Core ML (issue 5)


def _export_coreml(artifact, seq_len, weights, force, frontend, check, samples, as_json):
    from .convert.coreml_export import ExportOptions, SeqLen, export_coreml

    opts = ExportOptions(seq_len=SeqLen.parse(seq_len), weights=weights, force=force, frontend=frontend)
    with console.status("Core ML export") as st:
        rec = export_coreml(artifact, opts, status=lambda msg: st.update(f"Core ML export: {msg}"))
    failed = "; ".join(f"{k} failed ({v})" for k, v in rec["failed_frontends"].items())
    console.print(f"Core ML: {rec['package']} written with {rec['frontend']}" + (f" ({failed})" if failed else ""), highlight=False)
    if check:
        _check_coreml(artifact, samples, as_json, export_record=rec)
    elif as_json:
        out.print_json(json.dumps(rec))


def _check_coreml(artifact, samples, as_json, export_record=None):
    from .convert.coreml_check import check_package, record_check

    with console.status("checking the Core ML package (reference evaluation, not the Core ML runtime)"):
        res = check_package(artifact, n_samples=samples)
    record_check(artifact, res)
    if as_json:
        out.print_json(json.dumps({"export": export_record, "check": res}))
    else:
        print_coreml_check(artifact, res)
    if not res["ok"]:
        raise MpsconvertError(f"the Core ML package in {artifact} failed its checks (see above)", "re-export with --coreml-weights fp16 to compare, or report the model")


def print_coreml_check(artifact, res: dict) -> None:
    from .manifests.manifest import Manifest

    rec = Manifest.read(artifact).extra.get("coreml", {})
    t = Table(title=f"{artifact}/{res['package']}", show_header=False, box=None)

    def feat(f):
        rng = f" range {f['range']}" if f.get("range") else ""
        return f"{f['name']} {f['dtype']} {f['shape'] or '?'}{rng}"

    t.add_row("task", f"{rec.get('task')}: {', '.join(rec.get('inputs', []))} -> {rec.get('output')}" + (f" ({rec['pooling']} pooling)" if rec.get("pooling") else ""))
    t.add_row("converted with", f"{rec.get('frontend')}, coremltools {rec.get('coremltools')}, target {rec.get('minimum_deployment_target')}, {rec.get('compute_precision')}")
    t.add_row("inputs", "; ".join(feat(f) for f in res["spec"]["inputs"]))
    t.add_row("outputs", "; ".join(feat(f) for f in res["spec"]["outputs"]))
    ops = res["spec"]["ops"]
    t.add_row("ops", ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1]) if k != "const")[:160])
    t.add_row("weights", f"{rec.get('weights')}: {_human(res['weight_bytes'])} in the package vs {_human(res['fp8_safetensors_bytes'])} FP8 safetensors ({res['size_ratio']:.3f}x)")
    w = res["weights"]
    line = f"{w['checked']} FP8 tensors read back from weight.bin: " + ("all ok" if w["all_ok"] else "MISMATCH")
    if w["codes_bit_exact"] is not None:
        line += f"; codes bit-exact: {w['codes_bit_exact']}; equal to FP16 dequant: >= {w['min_fraction_equal_fp16_dequant']:.1%} of values, max {w['max_ulp_diff']} ulp"
    elif w["min_fraction_equal_fp16_dequant"] is not None:
        line += f"; equal to FP16 dequant: >= {w['min_fraction_equal_fp16_dequant']:.1%} of values"
    t.add_row("weight check", line)
    ev = res.get("reference_eval")
    if ev:
        line = f"cosine min {ev['cosine_min']:.7f} (mean {ev['cosine_mean']:.7f}), max |diff| {ev['max_abs_diff']:.3g}"
        if "top1_agreement" in ev:
            line += f", top-1 agreement {ev['top1_agreement']:.1%} over {ev['positions']} positions"
        t.add_row("reference eval", line + (" ok" if ev["ok"] else " FAILED"))
        t.add_row("", f"{ev['inputs']}; vs {ev['reference']}")
        t.add_row("", f"[bold]{ev['evaluator']}[/]; ops run by mpsconvert: {', '.join(ev['ops_by_implementation']['mpsconvert']) or 'none'}")
    out.print(t)


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--no-hashes", is_flag=True, help="Skip the sha256 check (structure only; much faster on big artifacts).")
@click.option("--trust-remote-code", is_flag=True, help="Allow building an architecture defined by code in the artifact.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@friendly_errors
def verify(artifact, no_hashes, trust_remote_code, as_json):
    """Check every file of ARTIFACT against its manifest's sha256, and its internal consistency
    (every FP8 weight has its scale; shapes and dtypes as config.json says). Exit 1 on any problem."""
    from .runtime.loader import verify as verify_artifact

    report = verify_artifact(artifact, check_hashes=not no_hashes, trust_remote_code=trust_remote_code)
    if as_json:
        out.print_json(json.dumps(report.as_dict()))
    else:
        bad = {f: v for f, v in report.files.items() if v != "ok"}
        out.print(f"{artifact}: {len(report.files)} files hashed, {len(bad)} wrong; {len(report.quantized)} FP8 modules "
                  f"({report.scheme}, weights per {report.weights})" if report.hashes_checked
                  else f"{artifact}: hashes not checked; {len(report.quantized)} FP8 modules", highlight=False)
        for p in report.problems:
            out.print(f"  [red]problem:[/] {p}", highlight=False)
        out.print("[bold green]ok[/]" if report.ok else f"[bold red]{len(report.problems)} problem(s)[/]")
    if not report.ok:
        sys.exit(1)


@main.command("export-coreml")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--seq-len", default="128", show_default=True, metavar="N|LO:HI",
              help="Fixed sequence length (128) or a flexible range (1:512, a Core ML RangeDim).")
@click.option("--coreml-weights", type=click.Choice(("fp8-lut", "int8", "fp16")), default="fp8-lut", show_default=True,
              help="fp8-lut: the FP8 codes as an 8-bit palette of the e4m3 values (one byte per weight). "
                   "int8: coremltools linear quantization. fp16: dense.")
@click.option("--frontend", type=click.Choice(("auto", "torch.export", "torch.jit.trace")), default="auto", show_default=True,
              help="auto: torch.export, then torch.jit.trace where that fails (the one that ran is printed and recorded).")
@click.option("--force", is_flag=True, help="Replace an existing model.mlpackage.")
@click.option("--check-only", is_flag=True, help="Do not export: check the package already in ARTIFACT.")
@click.option("--no-check", is_flag=True, help="Skip the checks that follow the export.")
@click.option("--samples", default=3, show_default=True, help="Text samples for the reference evaluation.")
@click.option("--json", "as_json", is_flag=True, help="Print the export record and check results as JSON.")
@friendly_errors
def export_coreml_cmd(artifact, seq_len, coreml_weights, frontend, force, check_only, no_check, samples, as_json):
    """Export an FP8 ARTIFACT to a Core ML ML program (ARTIFACT/model.mlpackage), then check it.

    \b
    Causal LMs: input_ids -> logits. Encoders: input_ids, attention_mask -> embeddings
    (mean-pooled last hidden state, L2-normalized if the model's modules.json says so).
    Minimum target macOS 15 / iOS 18, FP16 compute; activations are not FP8-quantized.
    The checks run anywhere: spec, op counts, weights read back from the package, and a reference
    evaluation of the program with coremltools' Python op definitions (NOT the Core ML runtime)
    against PyTorch with the artifact's dequantized weights.
    """
    if check_only:
        _check_coreml(artifact, samples, as_json)
        return
    _export_coreml(artifact, seq_len, coreml_weights, force, frontend, not no_check, samples, as_json)


def entry() -> None:
    """The `mpsconvert` program: run the command, then exit without unloading the interpreter.

    Tearing down torch and transformers module by module at exit takes about a second on 2
    cores (a third of a small conversion, and the delay between Ctrl-C and the prompt coming
    back). Nothing needs it: every output is written, synced and closed before a command
    returns; atexit handlers still run and the streams are flushed.
    """
    try:
        main()  # click's standalone mode: always ends in SystemExit
        code = 0
    except SystemExit as e:
        code = e.code
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
