"""The Core ML target (apple/protocol.py's protocol): what apple/flow.py, the API, the CLI
and validate call; each method imports the heavy modules (torch, coremltools) it needs when called."""

from __future__ import annotations

import sys
from pathlib import Path

from ...errors import MpsconvertError
from ...infra.units import human
from ..protocol import Option, Target, feature_text, max_len_option, states_rows
from . import FRONTENDS, PACKAGE_NAME, WEIGHT_MODES, CheckOptions, CoreMLExport, CoreMLRuntime, ExportOptions, SeqLen


class CoreML(Target):
    package = PACKAGE_NAME
    noun = "package"
    module = "coremltools"
    extra = "coreml"
    record = CoreMLExport
    runtime_record = CoreMLRuntime
    options = ExportOptions
    check_options = CheckOptions
    check_fix = "re-export with --coreml-weights fp16 to compare, or report the model"
    export_flags = (
        max_len_option(
            "Causal LMs: KV cache length of the stateful decoder (input_ids of 1..N tokens, position + T <= N) "
            "[default: 2048, or the model's max_position_embeddings if smaller].",
        ),
        Option(
            "kv_cache",
            "--no-kv-cache",
            "Causal LMs: the stateless input_ids -> logits form (no states).",
            kind="flag",
            default=True,
            negate=True,
            quantize="--no-kv-cache",
        ),
        Option(
            "seq_len",
            "--seq-len",
            "Encoders and --no-kv-cache: fixed sequence length (128) or a flexible range (1:512, a Core ML RangeDim).",
            default="128",
            quantize="--coreml-seq-len",
            metavar="N|LO:HI",
        ),
        Option(
            "weights",
            "--coreml-weights",
            "fp8-lut: the FP8 codes as an 8-bit palette of the e4m3 values (one byte per weight). "
            "int8: coremltools linear quantization. fp16: dense.",
            kind=WEIGHT_MODES,
            default="fp8-lut",
            quantize="--coreml-weights",
        ),
        Option(
            "frontend",
            "--frontend",
            "auto: torch.export, then torch.jit.trace where that fails (the one that ran is printed and recorded).",
            kind=("auto", *FRONTENDS),
            default="auto",
        ),
    )
    check_flags = (
        Option(
            "samples",
            "--samples",
            "Text samples for the reference evaluation (encoders, --no-kv-cache).",
            kind="int",
            default=3,
        ),
        Option(
            "decode_steps",
            "--decode-steps",
            "Stateful decoders: teacher-forced decode steps of the reference evaluation.",
            kind="int",
            default=16,
            minimum=1,
        ),
    )
    backend_help = "model.mlpackage (macOS only)"
    quantize_help = "Also export a Core ML package (model.mlpackage) into the artifact; see `export-coreml`."
    help = """Export an FP8 ARTIFACT to a Core ML ML program (ARTIFACT/model.mlpackage), then check it.

    \b
    Causal LMs: the stateful decoder, main(input_ids int32 [1, T], position int32 [1]) ->
    logits [1, T, vocab], the KV cache in states key_cache_i / value_cache_i (docs/apple.md: "The
    stateful decoder interface"); --no-kv-cache: input_ids -> logits, no states.
    Encoders: input_ids, attention_mask -> embeddings (mean-pooled last hidden state,
    L2-normalized if the model's modules.json says so).
    Minimum target macOS 15 / iOS 18, FP16 compute; activations are not FP8-quantized.
    The checks run anywhere: spec, op counts, weights read back from the package, and a reference
    evaluation of the program with coremltools' Python op definitions (NOT the Core ML runtime)
    against PyTorch with the artifact's dequantized weights; decoders: prefill, teacher-forced
    decode through the states, greedy generation.
    """

    def make_options(self, **kw) -> ExportOptions:
        if "seq_len" in kw:
            kw["seq_len"] = SeqLen.parse(kw["seq_len"])
        return ExportOptions(**kw)

    def build(self, folder, manifest, opts, progress):
        from .coreml_export import build

        return CoreMLExport.read(build(folder, manifest, opts, progress), "the Core ML export")

    def check(self, folder, record, opts, progress):
        from .coreml_check import check_package

        progress("coreml check", 0, None, "reference evaluation, not the Core ML runtime")
        return check_package(
            folder, record.as_dict(), n_samples=opts.samples, steps=opts.decode_steps, progress=progress
        )

    def runnable(self) -> None:
        if sys.platform != "darwin":
            raise MpsconvertError(
                "Core ML runs .mlpackage files only on macOS (coremltools cannot predict on this platform)",
                "use `backend=coreai` (runs on Linux) or `backend=torch` here",
            )
        super().runnable()

    def open_decoder(self, package, record, close):
        import coremltools as ct

        from .coreml_check import coreml_decoder

        return coreml_decoder(
            ct.models.MLModel(str(package), compute_units=ct.ComputeUnit.ALL)
        ), "Core ML (compute units: all)"

    def latency(self, artifact, record, settings, progress):
        from .coreml_check import coreml_runtime_check

        return coreml_runtime_check(
            artifact, record.as_dict(), prefill_len=settings["prefill_len"], decode_tokens=settings["decode_tokens"]
        )

    def written(self, record: dict) -> str:
        failed = "; ".join(f"{k} failed ({v})" for k, v in (record.get("failed_frontends") or {}).items())
        return (
            f"Core ML: {record['package']} written with {record.get('frontend')}"
            + (" (stateful decoder)" if record.get("kv_cache") else "")
            + (f" ({failed})" if failed else "")
        )

    def rows(self, artifact: Path, rec: dict, chk: dict):
        kind = " stateful decoder" if rec.get("kv_cache") else (" stateless" if rec.get("task") == "causal-lm" else "")
        spec, w = chk["spec"], chk["weights"]
        rows = [
            (
                "task",
                f"{rec.get('task')}{kind}: {', '.join(rec.get('inputs', []))} -> {rec.get('output')}"
                + (f" ({rec['pooling']} pooling)" if rec.get("pooling") else ""),
                None,
            ),
            (
                "converted with",
                f"{rec.get('frontend')}, coremltools {rec.get('coremltools')}, target "
                f"{rec.get('minimum_deployment_target')}, {rec.get('compute_precision')}",
                None,
            ),
            ("inputs", "; ".join(feature_text(f) for f in spec["inputs"]), None),
            ("outputs", "; ".join(feature_text(f) for f in spec["outputs"]), None),
        ]
        rows += states_rows(spec)
        rows.append(
            (
                "ops",
                ", ".join(f"{k} {v}" for k, v in sorted(spec["ops"].items(), key=lambda kv: -kv[1]) if k != "const")[
                    :160
                ],
                None,
            )
        )
        rows.append(
            (
                "weights",
                f"{rec.get('weights')}: {human(chk['weight_bytes'])} in the package vs "
                f"{human(chk['fp8_safetensors_bytes'])} FP8 safetensors ({chk['size_ratio']:.3f}x)",
                None,
            )
        )
        line = f"{w['checked']} FP8 tensors read back from weight.bin: " + ("all ok" if w["all_ok"] else "MISMATCH")
        if w["codes_bit_exact"] is not None:
            line += (
                f"; codes bit-exact: {w['codes_bit_exact']}; equal to FP16 dequant: >= "
                f"{w['min_fraction_equal_fp16_dequant']:.1%} of values, max {w['max_ulp_diff']} ulp"
            )
        elif w["min_fraction_equal_fp16_dequant"] is not None:
            line += f"; equal to FP16 dequant: >= {w['min_fraction_equal_fp16_dequant']:.1%} of values"
        rows.append(("weight check", line, w["all_ok"]))
        ev = chk.get("reference_eval")
        if ev and "prefill" not in ev:
            line = (
                f"cosine min {ev['cosine_min']:.7f} (mean {ev['cosine_mean']:.7f}), max |diff| {ev['max_abs_diff']:.3g}"
            )
            if "top1_agreement" in ev:
                line += f", top-1 agreement {ev['top1_agreement']:.1%} over {ev['positions']} positions"
            rows += [
                ("reference eval", line + (" ok" if ev["ok"] else " FAILED"), ev["ok"]),
                ("", f"{ev['inputs']}; vs {ev['reference']}", None),
                (
                    "",
                    f"{ev['evaluator']}; ops run by mpsconvert: "
                    f"{', '.join(ev['ops_by_implementation']['mpsconvert']) or 'none'}",
                    None,
                ),
            ]
        return rows, (ev if ev and "prefill" in ev else None), "reference evaluation, not the Core ML runtime"
