"""The `mpsconvert` command line: options -> library calls -> progress and results.

Every user-fixable problem is an MpsconvertError, printed as one line (`error: ...`) with a
non-zero exit; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import json
import sys
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


def friendly_errors(fn):
    """Turn MpsconvertError into `error: <problem>; <fix>` and exit code 2; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MpsconvertError as e:
            console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            console.print("[bold red]interrupted[/]: nothing was written")
            sys.exit(130)

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
@click.option("--force", is_flag=True, help="Replace an existing output folder (only once the new one is complete).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@click.option("--coreml", is_flag=True, help="Also export a Core ML package (model.mlpackage) into the artifact; see `export-coreml`.")
@click.option("--coreml-weights", type=click.Choice(("fp8-lut", "int8", "fp16")), default="fp8-lut", show_default=True,
              help="With --coreml: how the FP8 weights are stored in the package.")
@click.option("--coreml-seq-len", default="128", show_default=True, metavar="N|LO:HI", help="With --coreml: sequence length or range.")
@friendly_errors
def quantize(source, output, scheme, weights, revision, token, ignore, trust_remote_code, force, as_json, coreml, coreml_weights, coreml_seq_len):
    """Quantize SOURCE (a hub repo id or a local folder) to an FP8 compressed-tensors artifact."""
    from .convert.quantize import Options, quantize_snapshot
    from .manifests.schemes import Scheme
    from .source import resolve

    sch = Scheme.make(scheme, weights)
    snap = resolve(source, revision=revision, token=token)
    output = output or Path(f"{(snap.repo_id or snap.path.name).split('/')[-1]}-{scheme}")
    opts = Options(scheme=sch, ignore=list(ignore), force=force, trust_remote_code=trust_remote_code)
    if sch.needs_calibration:
        raise MpsconvertError("scheme fp8 needs calibration data", "use --scheme fp8-dynamic, or calibrate first")
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
    t.add_row("quantized", f"{s['tensors_quantized']} Linear weights")
    t.add_row("kept (Linear)", f"{s['linear_ignored']}: " + ", ".join(list(manifest.recipe["ignored_modules"])[:4]) + (" ..." if s["linear_ignored"] > 4 else ""))
    if s["modules_skipped"]:
        kinds = sorted({r.split(":")[0] for r in manifest.skipped.values()})
        t.add_row("skipped", f"{s['modules_skipped']} non-Linear modules ({'; '.join(kinds)})")
    if s["worst_sqnr_db"] is not None:
        t.add_row("worst SQNR", f"{s['worst_sqnr_db']:.1f} dB at {s['worst_sqnr_tensor']}")
    out.print(t)


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


if __name__ == "__main__":
    main()
