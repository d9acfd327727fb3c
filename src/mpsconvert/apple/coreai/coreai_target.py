"""The Core AI target (apple/protocol.py's protocol): what apple/flow.py, the API, the CLI
and validate call; each method imports the heavy modules (torch, coreai) it needs when called."""

from __future__ import annotations

import sys
from pathlib import Path

from ...errors import MpsconvertError
from ...infra.units import human
from ..protocol import Option, Target, feature_text, max_len_option, states_rows
from . import ASSET_NAME, COMPUTE_DTYPES, RUNTIME_LABEL, CheckOptions, CoreAIExport, CoreAIOptions, CoreAIRuntime


class CoreAI(Target):
    package = ASSET_NAME
    noun = "asset"
    module = "coreai.authoring"
    extra = "coreai"
    record = CoreAIExport
    runtime_record = CoreAIRuntime
    options = CoreAIOptions
    check_options = CheckOptions
    check_fix = "re-export with `compute=fp32` to compare, or report the model"
    export_flags = (
        max_len_option(
            "Causal LMs: KV cache length (input_ids of 1..N tokens, position + T <= N). Encoders: longest input "
            "[default: 2048, or the model's max_position_embeddings if smaller].",
        ),
        Option(
            "compute",
            "--compute",
            "Compute dtype. FP8 weights stay f8E4M3FN and other tensors keep the artifact's dtype either way.",
            kind=COMPUTE_DTYPES,
            default="fp32",
            quantize="--coreai-compute",
        ),
    )
    check_flags = (
        Option(
            "prompt_len",
            "--prompt-len",
            "Tokens of real text in the checked prefill.",
            kind="int",
            default=64,
            minimum=1,
        ),
        Option(
            "decode_steps", "--decode-steps", "Teacher-forced decode steps checked.", kind="int", default=32, minimum=1
        ),
    )
    backend_help = "the artifact's model.aimodel on the Core AI runtime (on Linux the CPU runtime in coreai-core)"
    quantize_help = "Also export a Core AI asset (model.aimodel) into the artifact; see `export-coreai`."
    help = """Export an FP8 ARTIFACT to a Core AI asset (ARTIFACT/model.aimodel), then check it.

    \b
    Core AI is Apple's successor of Core ML (macOS / iOS 27 and later). FP8 weights are stored
    natively as f8E4M3FN constants with their per-tensor / per-row scales (one byte per weight).
    Causal LMs: the same stateful decoder as export-coreml (main(input_ids, position) -> logits,
    the KV cache in states key_cache_i / value_cache_i). Encoders: input_ids, attention_mask ->
    embeddings. The checks run the asset with the Core AI runtime bundled in coreai-core (Linux:
    CPU) against PyTorch on the same dequantized weights: prefill, teacher-forced decode through
    the states, greedy generation. Needs `pip install 'mpsconvert[coreai]'`.
    """

    def build(self, folder, manifest, opts, progress):
        from .coreai_export import build

        return CoreAIExport.read(build(folder, manifest, opts, progress), "the Core AI export")

    def check(self, folder, record, opts, progress):
        from .coreai_check import check_asset

        return check_asset(
            folder,
            record.as_dict(),
            prompt_len=opts.prompt_len,
            steps=opts.decode_steps,
            generate=opts.generate,
            progress=progress,
        )

    def open_decoder(self, package, record, close):
        from .coreai_check import decoder_runner
        from .session import Session, quiet

        with quiet():
            session = Session(package)
        close(session)
        return decoder_runner(session), "Core AI runtime, macOS" if sys.platform == "darwin" else RUNTIME_LABEL

    def measure(self, artifact, record, **settings):
        """Prefill time and decode tokens/s of the asset beside PyTorch on the CPU: coreai_check.coreai_latency
        with `settings` (prefill_len, decode_tokens, warmup, prefill_repeats, units), its defaults for the rest."""
        from ...infra.extras import require

        require(self.module, self.extra, "the Core AI latency check")
        from .coreai_check import coreai_latency

        return coreai_latency(artifact, record.as_dict(), **settings)

    def latency(self, artifact, record, settings, progress):
        if not settings["latency"]:
            return {"status": "skipped", "reason": "latency not asked for (--no-latency)"}
        from ...infra.extras import require

        try:
            require(self.module, self.extra, "the Core AI latency check")
        except MpsconvertError as e:
            return {"status": "skipped", "reason": str(e)}
        progress("coreai latency", 0, None, "Core AI runtime beside PyTorch")
        # at most 3 timed prefills: on the Linux CPU runtime one prefill of 512 tokens takes tens of seconds
        return self.measure(
            artifact,
            record,
            prefill_len=settings["prefill_len"],
            decode_tokens=settings["decode_tokens"],
            warmup=min(settings["warmup"], 2),
            prefill_repeats=min(settings["repeats"], 3),
        )

    def written(self, record: dict) -> str:
        return (
            f"Core AI: {record['asset']} written ({record['task']}"
            + (", stateful decoder" if record["task"] == "causal-lm" else "")
            + f", {record['compute']} compute)"
        )

    def rows(self, artifact: Path, rec: dict, chk: dict):
        iface = rec.get("interface", {})
        rows = [
            (
                "task",
                f"{rec.get('task')}"
                + (" stateful decoder" if rec.get("task") == "causal-lm" else f" ({rec.get('pooling')} pooling)"),
                None,
            ),
            (
                "function main",
                "; ".join(feature_text(f) for f in iface.get("inputs", []))
                + " -> "
                + "; ".join(feature_text(f) for f in iface.get("outputs", [])),
                None,
            ),
        ]
        rows += states_rows(iface)
        rows.append(
            (
                "interface",
                "as the decoder contract says" if chk["interface"]["ok"] else "; ".join(chk["interface"]["problems"]),
                chk["interface"]["ok"],
            )
        )
        v = rec.get("versions", {})
        rows.append(
            (
                "converted with",
                f"coreai-torch {v.get('coreai_torch')}, coreai-core {v.get('coreai_core')}; "
                f"compute {rec.get('compute')}; needs {rec.get('minimum_os')}",
                None,
            )
        )
        st = chk["storage"]["storage_types"]
        rows.append(
            (
                "storage",
                ", ".join(f"{k} {n:,}" for k, n in sorted(st.items(), key=lambda kv: -kv[1]) if n > 1000) or str(st),
                None,
            )
        )
        rows.append(
            (
                "size",
                f"{human(chk['asset_bytes'])} asset vs {human(chk['fp8_safetensors_bytes'])} FP8 "
                f"safetensors ({chk['size_ratio']:.3f}x)",
                None,
            )
        )
        w = chk["weights"]
        rows.append(
            (
                "weight check",
                f"{w['checked']} FP8 tensors read back from the program: codes bit-exact "
                f"{w['codes_bit_exact']}, scales exact {w['scales_exact']}; "
                f"{w['f8E4M3FN_values_stored']:,} f8E4M3FN values stored for "
                f"{w['fp8_values_in_artifact']:,} in the artifact" + ("" if w["all_ok"] else " MISMATCH"),
                w["all_ok"],
            )
        )
        ev = chk.get("runtime_eval")
        if ev and "prefill" not in ev:
            rows.append(
                (
                    ev["runtime"],
                    f"embedding cosine min {ev['cosine_min']:.6f} over {ev['samples']} samples ({ev['inputs']})"
                    + (" ok" if ev["ok"] else " FAILED"),
                    ev["ok"],
                )
            )
        return rows, (ev if ev and "prefill" in ev else None), (ev or {}).get("runtime", "")
