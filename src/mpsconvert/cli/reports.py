"""The results of each command as the CLI shows them: summaries and tables (quantize, calibrate,
inspect, verify, validate, the Apple exports and checks), generation statistics and uploads, or
their JSON with `--json`. Every name or number read from an artifact is `shown` or `num`
(render.py)."""

from __future__ import annotations

import functools
import json
import re

from rich.table import Table

from .. import api
from ..infra.units import human, num, speed
from .render import console, note, out, print_json, result, shown, warn


def _d(x) -> dict:
    return x if isinstance(x, dict) else {}


def json_or(show):
    """A report of one result, called `(res, as_json, ...)`: with `as_json` the result's `as_dict()` as JSON,
    else `show(res, ...)`."""

    @functools.wraps(show)
    def report(res, as_json: bool, *args, **kw) -> None:
        if as_json:
            print_json(res.as_dict())
        else:
            show(res, *args, **kw)

    return report


# --------------------------------------------------------------------------- quantize / calibrate


def calibration(cal) -> None:
    """Where calibration ran, how fast, and every warning (fallbacks included)."""
    r = cal.record
    data = r.get("data") or {}
    builtin = " of the built-in text" if data.get("kind") == "builtin" else ""
    if builtin and cal.short:
        builtin += " (all it gives at this --seq-len; --calib-data for more, or for text like the model's use)"
    note(
        f"calibrated on {r['device']} ({r['mode']}, observer {r['observer']}): {r['num_samples']} samples, "
        f"{r['tokens']} tokens{builtin} in {cal.seconds:.1f} s ({r['num_samples'] / max(cal.seconds, 1e-9):.2f} "
        "samples/s)"
    )
    for w in cal.warnings:
        warn(w)


def pin(artifact, sha256: str | None, why: str = "") -> None:
    """The artifact's pin, whole whatever the width or a pipe (it is copied), and how to use it."""
    if sha256:
        out.print(
            f"pin sha256 {sha256}  (pin it: mpsconvert verify {shown(artifact)} --manifest-sha256 <it>; covers the "
            f"conversion and lasts through validate, the exports and upload{'; ' + why if why else ''})",
            soft_wrap=True,
            highlight=False,
        )


def _grain(recipe: dict) -> str:
    """'row', 'tensor' or 'block (128x128)'."""
    b = recipe.get("block_size")
    return f"{recipe.get('weights')} ({b}x{b})" if b else str(recipe.get("weights"))


def _facts(title: str) -> Table:
    """A two-column table of label and value; a long value (a path, a tensor name) folds onto the
    next line rather than being cut with an ellipsis."""
    t = Table(title=title, show_header=False, box=None)
    t.add_column(no_wrap=True)
    t.add_column(overflow="fold")
    return t


@json_or
def quantize_summary(res) -> None:
    manifest, s = res.manifest, res.summary
    t = _facts(shown(res.output))
    t.add_row(
        "scheme",
        shown(
            f"{manifest.recipe['name']} (weights per {_grain(manifest.recipe)}, activations: "
            f"{manifest.recipe['activations'] or 'bf16'})"
            + (
                f"; unquantized tensors {manifest.recipe['unquantized_dtype']}"
                if manifest.recipe.get("unquantized_dtype")
                else ""
            )
        ),
    )
    if (fmt := manifest.recipe.get("format")) and manifest.recipe.get("family"):  # a diffusion artifact: where it goes
        t.add_row(
            "format",
            shown(
                f"{fmt} ({manifest.recipe['family_label']}): "
                + (
                    f"{manifest.recipe['file']} -> ComfyUI/models/diffusion_models/, Load Diffusion Model"
                    if fmt != "diffusers"
                    else "diffusers from_pretrained with the SDNQ backend (pip install sdnq)"
                )
            ),
        )
    if (src := manifest.source.get("fp8")) and all(
        r.get("codes", "").startswith("copied") for r in manifest.tensors.values()
    ):
        t.add_row("FP8 source", f"{src['layout']}: e4m3 codes kept byte for byte, scales renamed")
    t.add_row("weights", f"{human(s['weight_bytes_before'])} -> {human(s['weight_bytes_after'])} ({s['ratio']:.2f}x)")
    n_exp = s.get("expert_tensors_quantized", 0)
    t.add_row(
        "quantized",
        f"{s['tensors_quantized'] - n_exp} Linear weights" + (f", {n_exp} MoE expert tensors" if n_exp else ""),
    )
    kept = list(manifest.recipe["ignored_modules"])
    t.add_row(
        "kept (Linear)",
        shown(f"{len(kept)}: " + ", ".join(kept[:4]) + (" ..." if len(kept) > 4 else "")) if kept else "none",
    )
    if s["modules_skipped"]:
        kinds = sorted({r.split(":")[0] for r in manifest.skipped.values()})
        t.add_row("skipped", shown(f"{s['modules_skipped']} non-Linear modules ({'; '.join(kinds)})"))
    if s["worst_sqnr_db"] is not None:
        t.add_row("worst SQNR", f"{s['worst_sqnr_db']:.1f} dB at {shown(s['worst_sqnr_tensor'])}")
    out.print(t)
    if res.manifest_sha256:  # whole, whatever the width or a pipe: it is copied to pin the artifact
        out.print(
            f"manifest sha256 {res.manifest_sha256}  (the whole manifest as it is now)", soft_wrap=True, highlight=False
        )
    pin(res.output, getattr(res, "pin_sha256", None))
    for w in s.get("warnings") or []:
        warn(w)


# --------------------------------------------------------------------------- inspect / verify


def source_line(src: dict) -> str:
    """A hub source as id@commit (or @revision), a local one as its full path."""
    if src.get("kind") == "hub":
        ref = src.get("commit") or src.get("revision")
        return f"{src.get('id')}@{ref}" if ref else str(src.get("id"))
    where = src.get("path") or src.get("id")
    gguf = src.get("gguf")
    if isinstance(gguf, dict):  # one file, not a folder
        return (
            f"{where} (GGUF file" + (f", {gguf['file_type']}" if isinstance(gguf.get("file_type"), str) else "") + ")"
        )
    return (
        f"{where} (local folder"
        + (f", {src['id']}@{str(src['commit'])[:12]}" if src.get("commit") and src.get("id") != where else "")
        + ")"
    )


def inspect_table(artifact, m, show_tensors: bool) -> None:
    """The manifest as a table. Every field is untrusted here (inspect reads what it is given
    without verifying it): text is `shown`, numbers `num`, and a field of the wrong type is '?'."""
    t = _facts(shown(artifact))
    r, s = m.recipe, m.summary
    t.add_row("source", shown(source_line(m.source)))
    t.add_row(
        "scheme",
        shown(
            f"{r.get('name')}: weights per {_grain(r)}, activations {r.get('activations') or 'bf16'}"
            + (f"; unquantized tensors {r['unquantized_dtype']}" if r.get("unquantized_dtype") else "")
        ),
    )
    if cal := _d(r.get("calibration")):
        data = _d(cal.get("data"))
        t.add_row(
            "calibration",
            shown(
                f"{cal.get('observer')} on {cal.get('device')} ({cal.get('mode')}), {cal.get('num_samples')} x "
                f"{cal.get('seq_len')} tokens of {data.get('id')} (sha256 {str(data.get('sha256'))[:12]}), "
                f"{len(_d(cal.get('fallbacks')))} fallback(s)"
            ),
        )
    t.add_row("architecture", shown(s.get("architecture")))
    before, after = s.get("weight_bytes_before"), s.get("weight_bytes_after")
    t.add_row(
        "weights",
        f"{human(before) if isinstance(before, int) else '?'} -> {human(after) if isinstance(after, int) else '?'} "
        f"({num(s.get('ratio'), '.2f')}x)",
    )
    t.add_row(
        "tensors",
        f"{num(s.get('tensors_quantized'))} quantized, {num(s.get('linear_ignored'))} Linear kept, "
        f"{num(s.get('modules_skipped'))} other modules skipped",
    )
    if s.get("worst_sqnr_db") is not None:
        t.add_row("worst SQNR", f"{num(s['worst_sqnr_db'], '.1f')} dB at {shown(s.get('worst_sqnr_tensor'))}")
    t.add_row("files", f"{len(m.files)} ({human(sum(f['size'] for f in m.files.values()))})")
    if engine_line := api.engine_line(m):
        t.add_row("engines", shown(engine_line))
    v = m.versions
    t.add_row(
        "made with",
        shown(
            f"mpsconvert {v.get('mpsconvert')}, torch {v.get('torch')}, transformers "
            f"{v.get('transformers')} on {m.device}"
        ),
    )
    for label, text in m.inspect_rows():  # the records later steps added (validation, exports, ...), typed
        t.add_row(shown(label), _marked(text, "FAILED" not in text))
    out.print(t)
    if show_tensors:
        tt = Table("tensor", "shape", "scale", "SQNR dB")
        for name, rec in sorted(m.tensors.items(), key=lambda kv: natural_key(kv[0])):
            shape = "x".join(map(str, rec.get("shape"))) if isinstance(rec.get("shape"), list) else "?"
            scale = (
                "x".join(map(str, rec.get("weight_scale_shape")))
                if isinstance(rec.get("weight_scale_shape"), list)
                else "?"
            )
            sq = rec.get("sqnr_db")
            tt.add_row(
                shown(name),
                shown(shape),
                shown(scale),
                num(sq, ".1f") if sq is not None else "undefined (no signal)" if rec.get("sqnr_undefined") else "exact",
            )
        out.print(tt)


def natural_key(name: str) -> tuple:
    """Sort key that orders numbers by value: layers.2 before layers.10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


@json_or
def verify_report(report, artifact) -> None:
    bad = {f: v for f, v in report.files.items() if v != "ok"}
    result(
        f"{artifact}: {len(report.files)} files hashed, {len(bad)} wrong; {len(report.quantized)} FP8 modules "
        f"({report.scheme}, weights per {report.weights})"
        if report.hashes_checked
        else f"{artifact}: hashes not checked; {len(report.quantized)} FP8 modules"
    )
    for p in report.problems:
        out.print(f"  [red]problem:[/] {shown(p)}", highlight=False)
    for w in report.warnings:
        out.print(f"  [yellow]warning:[/] {shown(w)}", highlight=False)
    if report.manifest_sha256:
        out.print(f"  manifest sha256 {report.manifest_sha256}", highlight=False, soft_wrap=True)
    if report.pinned_sha256:
        out.print(
            f"  pin sha256 {report.pinned_sha256} (the part the conversion sealed)", highlight=False, soft_wrap=True
        )
    if report.pin:
        out.print(f"  the pin covers {shown(report.pin)}", highlight=False, soft_wrap=True)
    out.print("[bold green]ok[/]" if report.ok else f"[bold red]{len(report.problems)} problem(s)[/]")


# --------------------------------------------------------------------------- validate


@json_or
def validation(res, explain: bool = False) -> None:
    r = res.as_dict()
    a = r["accuracy"]
    t = Table(title=f"{r['scheme']} (weights per {r['weights']}) vs BF16 on {r['device_name']} ({r['device']})")
    t.add_column("metric")
    t.add_column("BF16", justify="right")
    t.add_column("FP8", justify="right")
    t.add_column("FP8 vs BF16", justify="right")
    if r["kind"] == "causal-lm":
        t.add_row(
            f"perplexity ({a['tokens']} tokens)",
            f"{a['perplexity_bf16']:.3f}",
            f"{a['perplexity_fp8']:.3f}",
            f"{a['perplexity_delta']:+.3f} ({a['perplexity_delta_pct']:+.2f}%)",
        )
        t.add_row("mean KL(bf16 || fp8)", "", "", f"{a['mean_kl']:.5f} nats")
        t.add_row("top-1 agreement", "", "", f"{100 * a['top1_agreement']:.2f}%")
    elif r["kind"] == "diffusion-step":
        t.add_row(
            f"one denoising step ({a['elements']} outputs)",
            "",
            "",
            f"relative error {a['rel_error']:.5f}, cosine {a['cosine']:.6f}",
        )
        t.add_row("max |error| (mean |BF16 output|)", "", "", f"{a['max_abs_error']:.5f} ({a['ref_abs_mean']:.5f})")
    else:
        t.add_row(
            f"embedding cosine ({a['sentences']} sentences)",
            "",
            "",
            f"mean {a['cosine_mean']:.5f}, min {a['cosine_min']:.5f}",
        )
    wb = r["weight_bytes"]
    t.add_row("weights in memory", human(wb["bf16"]), human(wb["fp8"]), f"{wb['fp8'] / wb['bf16']:.3f}x")
    lat = r.get("latency")
    if lat:
        b, f = lat["bf16"], lat["fp8"]
        if "step" in b:  # a diffusion transformer: one denoising step
            t.add_row(
                f"denoising step ({r['settings']['image_tokens']} image tokens), median (p95) ms",
                f"{b['step']['median_ms']:.2f} ({b['step']['p95_ms']:.2f})",
                f"{f['step']['median_ms']:.2f} ({f['step']['p95_ms']:.2f})",
                speed(r["verdict"]["step"]),
            )
        else:
            t.add_row(
                f"prefill {b['prefill']['tokens']} tok, median (p95) ms",
                f"{b['prefill']['median_ms']:.2f} ({b['prefill']['p95_ms']:.2f})",
                f"{f['prefill']['median_ms']:.2f} ({f['prefill']['p95_ms']:.2f})",
                speed(r["verdict"]["prefill"]),
            )
        if "decode" in b:
            t.add_row(
                f"decode tokens/s (median; p95 ms/token){' compiled' if r['settings']['compile'] else ''}",
                f"{b['decode']['tokens_per_s']:.1f} ({b['decode']['p95_ms']:.2f})",
                f"{f['decode']['tokens_per_s']:.1f} ({f['decode']['p95_ms']:.2f})",
                speed(r["verdict"]["decode"]),
            )
        if b.get("peak_memory_bytes") is not None:
            t.add_row(
                "peak device memory",
                human(b["peak_memory_bytes"]),
                human(f["peak_memory_bytes"]),
                f"{f['peak_memory_bytes'] / b['peak_memory_bytes']:.3f}x",
            )
    out.print(t)
    st = r.get("settings") or {}
    if st.get("defaults") == "cpu":
        lat_note = (
            f"; latency: prefill {st['prefill_len']} tokens, decode {st['decode_tokens']}, {st['rounds']} "
            f"rounds of {st['repeats']}"
            if st.get("latency")
            else ""
        )
        out.print(
            f"note: CPU's quick defaults: {st['max_samples']} accuracy samples of {st['seq_len']} tokens{lat_note} "
            "(--full: 8 of 512, prefill 512, decode 32, 3 rounds of 3)"
        )
    for d in r.get("dequantized_at_load") or []:
        out.print(f"note: {d}")
    if held_note := (r.get("weights_held") or {}).get("note"):
        out.print(f"note: {held_note}")
    if (ar := a.get("activations_rounded")) and ar["rounded"] < ar["layers"]:
        out.print(
            f"note: the accuracy pass ({ar['rows']} tokens a forward) ran {ar['layers'] - ar['rounded']} of "
            f"{ar['layers']} FP8 layers with BF16 activations ({', '.join(ar['bf16_activation_kernels'])}, as "
            "the kernel policy chose): weight-only arithmetic there, so these figures leave out part of the "
            "scheme's activation rounding (--explain lists the kernels)"
        )
    if explain:
        kernels(r["kernels"])
    if r.get("recorded"):
        out.print(f"recorded in {r['recorded']} and the model card (README.md)")
    apple_runtimes(r)


def apple_runtimes(r: dict) -> None:
    """Each Apple target's rows of validate (latency beside PyTorch), or why they did not run."""
    for key, target in api.targets().items():
        name = f"{target.name} {target.noun}"
        rt = r.get(key)
        if rt is None:
            continue
        if rt.get("status") == "failed":
            out.print(f"{name}: [red]failed[/] ({shown(str(rt.get('reason')))})", highlight=False)
            continue
        if rt.get("status") != "ran":
            result(f"{name}: not run here ({rt['reason']})")
            continue
        t = Table(title=f"{name}: latency beside PyTorch")
        for c in ("engine", "prefill ms", "decode median ms (p95)", "decode tokens/s", "vs PyTorch", "accuracy"):
            t.add_column(c, justify="left" if c in ("engine", "accuracy") else "right")
        for row in rt["rows"]:
            if "error" in row:
                t.add_row(row["engine"], "", "", "", "", f"[red]{shown(row['error'])}[/]")
                continue
            ratio = row.get(
                "decode_vs_pytorch_cpu", row.get("decode_vs_pytorch_mps", row.get("speedup_vs_pytorch_mps"))
            )
            acc = (
                f"prefill top-1 {row['prefill_top1']:.1%}, decode top-1 {row['decode_top1']:.1%}"
                if "prefill_top1" in row
                else f"cosine {row['cosine_min']:.5f}"
                if "cosine_min" in row
                else ""
            )
            dec = (
                f"{row['decode_median_ms']:.2f} ({row['decode_p95_ms']:.2f})"
                if "decode_median_ms" in row
                else f"{row['latency_ms']:.2f}"
                if "latency_ms" in row
                else ""
            )
            t.add_row(
                row["engine"],
                f"{row['prefill_ms']:.1f}" if "prefill_ms" in row else "",
                dec,
                f"{row['decode_tokens_per_s']:.1f}" if "decode_tokens_per_s" in row else "",
                f"{ratio:.3f}x" if ratio else "",
                acc,
            )
        out.print(t)
        result(f"  same prompt for every row: {rt.get('inputs', '')}")


def kernels(decisions: list) -> None:
    """One line per layer shape and bucket: the kernel, how it was decided, what was measured (fastest first)."""
    if any("timings_us" in d for d in decisions):
        out.print("[bold]kernel policy[/] (per layer shape and token bucket; us per call, fastest first)")
    else:
        out.print("[bold]how the FP8 layers ran[/]")
    notes: dict[str, list[str]] = {}
    for d in decisions:
        if "timings_us" not in d:  # a diffusion artifact's: the loader that ran its FP8 layers, no policy
            out.print("  " + ", ".join(f"{k}: {shown(str(v))}" for k, v in d.items()), highlight=False)
            continue
        ok = sorted((v, k) for k, v in d["timings_us"].items() if not isinstance(v, str))
        bad = [f"{k} ({v})" for k, v in d["timings_us"].items() if isinstance(v, str)]
        measured = " | ".join(f"{k} {v:.1f}" for v, k in ok) + (f"; cannot run: {', '.join(bad)}" if bad else "")
        out.print(
            f"  {d['shape'][0]}x{d['shape'][1]} ({d['layers']} layers) {d['bucket']} M={d['m'] or 'any'}: "
            f"[bold]{d['choice']}[/] \\[{d['source']}]" + (f"  {measured}" if measured else ""),
            highlight=False,
        )
        if d["note"]:
            notes.setdefault(d["note"], []).append(f"{d['shape'][0]}x{d['shape'][1]} {d['bucket']}")
    for note_, where in notes.items():
        out.print(f"  note ({', '.join(where)}): {note_}", highlight=False)


# --------------------------------------------------------------------------- Core ML and Core AI


def decoder_check(title: str, ev: dict) -> None:
    """Prefill, teacher-forced decode and greedy generation against PyTorch, one row each."""
    t = Table(title=title)
    for c in ("check", "positions", "top-1 agreement", "cosine min", ""):
        t.add_column(c, justify="left" if c in ("check", "") else "right")
    th, p, d, g = ev["thresholds"], ev["prefill"], ev["decode"], ev["generation"]

    def row(label: str, r: dict, need: float) -> None:  # prefill or decode: top-1 agreement and cosine as asked
        ok = r["top1_agreement"] >= need and r["cosine_min"] >= th["cosine"]
        mark = ("ok" if ok else "[red]FAILED[/]") + f" (>= {need:.0%})"
        t.add_row(label, str(r["positions"]), f"{r['top1_agreement']:.1%}", f"{r['cosine_min']:.6f}", mark)

    row(f"prefill, {ev['prompt_len']} tokens", p, th["prefill_top1"])
    row(f"teacher-forced decode, {ev['steps']} steps", d, th["decode_top1"])
    t.add_row(
        f"greedy generation, {len(g['tokens'])} tokens",
        str(len(g["tokens"])),
        f"{g['agreeing_prefix']}/{len(g['tokens'])} same",
        "",
        "same tokens as PyTorch" if g["agree"] else f"diverges at token {g['agreeing_prefix'] + 1}",
    )
    out.print(t)
    result(f"  {ev['inputs']}; vs {ev['reference']}")
    out.print(
        f"  [bold]{ev.get('evaluator') or ev.get('runtime')}[/]; decode step median "
        f"{ev['decode_step_ms']['median']:.1f} ms",
        highlight=False,
    )


def export_result(res, as_json: bool) -> None:
    """An Apple export: the line that says it was written, then its check (or, as JSON without a check, its record)."""
    note(api.targets()[res.target].written(res.record))
    if res.check is not None:
        check_result(res, as_json)
    elif as_json:
        print_json(res.record)


@json_or
def check_result(res) -> None:
    """An Apple package's check: the target's rows (a failure in red), then its decoder check as a table."""
    rows, decoder, title = api.targets()[res.target].rows(res.artifact, res.record, res.check)
    t = _facts(f"{res.artifact}/{res.package.name}")
    for label, text, ok in rows:
        t.add_row(shown(label), _marked(text, ok))
    out.print(t)
    if decoder is not None:
        decoder_check(title, decoder)


def _marked(text: str, ok: bool | None) -> str:
    return f"[red]{shown(text)}[/]" if ok is False else shown(text)


# --------------------------------------------------------------------------- generate / upload


def generation(res, as_json: bool, turn: bool = False) -> None:
    """After the streamed text: prompt and generation tokens/s, peak memory, device (mlx-lm's end
    lines); a chat `turn` gets one dim line of the rates, the device having been named at its start."""
    if as_json:  # one line per generation (JSON Lines: a chat prints one per turn)
        import sys

        sys.stdout.write(json.dumps(res.as_dict()) + "\n")
        sys.stdout.flush()
        return
    s = res.stats
    out.print("")
    gen = f"{s.generation_tps:.1f} tokens/s" if s.generation_tps is not None else "n/a (one token)"
    stopped = (
        " (stopped: end of sequence)"
        if s.stop == "eos"
        else " (stopped: the cache is full)"
        if s.stop == "cache_full"
        else ""
    )
    if turn:
        compiled = f", decode setup {s.compile_seconds:.1f} s" if s.compile_seconds is not None else ""
        console.print(
            f"[dim]\\[prompt {s.prompt_tokens} tokens at {s.prompt_tps:.1f} tokens/s, {s.generated_tokens} "
            f"generated at {gen}{compiled}{stopped}][/]",
            highlight=False,
        )
        return
    note("=" * 10)
    note(f"prompt: {s.prompt_tokens} tokens, {s.prompt_tps:.1f} tokens/s")
    note(f"generation: {s.generated_tokens} tokens, {gen}{stopped}")
    d = getattr(s, "decode", None)
    if d and d.get("fallback"):
        note(f"decode: {d['path']} (asked: {d['asked']}; {d['fallback']})")
    if s.compile_seconds is not None:
        how = {"graph": "the eager step captured as a CUDA graph", "compile": "torch.compile's CUDA graph"}.get(
            (d or {}).get("asked"), "the decode step set up"
        )
        note(f"decode setup: {s.compile_seconds:.1f} s ({how}; not in the rates above; --decode eager: none)")
    note(
        f"peak memory: {human(s.peak_memory_bytes) if s.peak_memory_bytes is not None else 'n/a'}, "
        f"{s.peak_memory_source}"
    )
    note(f"backend: {s.backend} on {s.device}")


@json_or
def uploaded(res) -> None:
    result(
        f"uploaded {len(res.files)} files to {res.url} ({'private' if res.private else 'public'} repo, revision "
        f"{res.revision}, commit {(res.commit or '?')[:12]}): {res.commit_message}"
    )
