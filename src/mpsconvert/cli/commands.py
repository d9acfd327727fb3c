"""The commands: each parses its options, makes one API call, and renders the result."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import click

from .. import api
from ..errors import ExportError
from . import render
from .app import friendly_errors, main


def calibration_options(fn):
    """The options shared by `quantize --scheme fp8` and `calibrate`."""
    opts = [
        click.option("--calib-data", metavar="FILE|DIR|DATASET",
                     help="Calibration text: a .txt file (documents separated by blank lines), a .jsonl/.json/.parquet file "
                          "with a 'text' field, a folder of those, or a Hugging Face dataset repo id "
                          "[default: the small built-in set of prose, code and dialogue]."),
        click.option("--num-samples", type=click.IntRange(min=1), default=128, show_default=True, help="Token windows to calibrate on."),
        click.option("--seq-len", type=click.IntRange(min=16), default=512, show_default=True, help="Tokens per window."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of the (deterministic) document shuffle."),
        click.option("--observer", type=click.Choice(api.OBSERVERS), default="minmax", show_default=True,
                     help="minmax: the true maximum |x| (best measured on SmolLM2 and MiniLM). percentile: the --percentile of |x| "
                          "(clips outlier activations, which LLMs need: it hurts them badly). "
                          "mse: the clip that minimises the FP8 error on the observed activations."),
        click.option("--percentile", type=float, default=api.DEFAULT_PERCENTILE, show_default=True, help="For --observer percentile."),
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


@contextlib.contextmanager
def _showing_failed_checks(show, as_json: bool):
    """An export or check whose checks ran and failed raises ExportError with the result: show
    what the checks found before the one-line error."""
    try:
        yield
    except ExportError as e:
        if getattr(e, "result", None) is not None:
            show(e.result, as_json)
        raise


def _calibration(calib_data, num_samples, seq_len, seed, observer, percentile, device, sequential, data_revision, **kw):
    return api.calibration_options(data=calib_data, num_samples=num_samples, seq_len=seq_len, seed=seed, observer=observer,
                                   percentile=percentile, device=device, sequential=sequential, data_revision=data_revision, **kw)


@main.command()
@click.argument("source")
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), help="Output folder [default: <name>-<scheme>].")
@click.option("--scheme", type=click.Choice(api.SCHEMES), default=None,
              help="fp8-dynamic: FP8 weights, activations quantized per token at run time. "
                   "fp8: static per-tensor activation scales from calibration. "
                   "fp8-weight-only: activations stay BF16. [default: fp8-dynamic; for an FP8 source, its own scheme, "
                   "its codes kept as they are]")
@click.option("--weights", type=click.Choice(api.WEIGHT_GRANULARITIES), default=None,
              help="Weight scale granularity: per row, per tensor, or per block (FP8_BLOCK, as the hub's FP8 releases) "
                   "[default: row for fp8-dynamic/fp8-weight-only, tensor for fp8; an FP8 source's own].")
@click.option("--block-size", type=click.IntRange(1, 4096), default=None,
              help="With --weights block: the edge of the square weight blocks [default: 128].")
@click.option("--revision", help="Branch, tag or commit of a hub repo [default: main].")
@click.option("--token", envvar="HF_TOKEN", show_envvar=True, help="Hugging Face token for gated or private repos.")
@click.option("--ignore", multiple=True, metavar="PATTERN",
              help="Keep matching Linear modules unquantized (glob, `re:` regex, or a name suffix such as mlp.down_proj). Repeatable.")
@click.option("--trust-remote-code", is_flag=True, help="Allow building an architecture defined by code in the repo.")
@click.option("--experts-layout", type=click.Choice(api.EXPERTS_LAYOUTS), default="per-expert", show_default=True,
              help="MoE checkpoints that store experts fused (3-D): per-expert writes one FP8 tensor per expert and projection "
                   "(loads in transformers + compressed-tensors and vLLM); checkpoint keeps them fused (loads only in mpsconvert's runtime).")
@click.option("--force", is_flag=True, help="Replace an existing output folder (only once the new one is complete).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@click.option("--scales", "scales_file", type=click.Path(path_type=Path, dir_okay=False),
              help="For --scheme fp8: use the input scales from `mpsconvert calibrate -o FILE` instead of calibrating.")
@calibration_options
@click.option("--coreml", is_flag=True, help="Also export a Core ML package (model.mlpackage) into the artifact; see `export-coreml`.")
@click.option("--coreml-weights", type=click.Choice(api.COREML_WEIGHT_MODES), default="fp8-lut", show_default=True,
              help="With --coreml: how the FP8 weights are stored in the package.")
@click.option("--coreml-seq-len", default="128", show_default=True, metavar="N|LO:HI",
              help="With --coreml: sequence length or range of encoders and of --no-kv-cache packages.")
@click.option("--coreai", is_flag=True, help="Also export a Core AI asset (model.aimodel) into the artifact; see `export-coreai`.")
@click.option("--coreai-compute", type=click.Choice(api.COREAI_COMPUTE_DTYPES), default="fp32", show_default=True,
              help="With --coreai: compute dtype.")
@click.option("--max-len", type=click.IntRange(min=2), default=None,
              help="With --coreml / --coreai: KV cache length of the stateful decoder (causal LMs); encoders (Core AI): longest "
                   "input [default: 2048, or the model's max_position_embeddings if smaller].")
@click.option("--no-kv-cache", is_flag=True, help="With --coreml: the stateless input_ids -> logits form (no states).")
@click.option("--dtype", type=click.Choice(list(api.UNQUANTIZED_DTYPES)), default=None,
              help="Dtype of the tensors that stay unquantized (embeddings, lm_head, norms) [default: the source's, bit for bit]. "
                   "An FP32 source with --dtype bfloat16 halves them.")
@click.option("--max-shard-size", default="1GB", show_default=True, metavar="SIZE",
              help="Largest weight file written (e.g. 500MB, 2GiB; save_pretrained's units). Loading with verification hashes the "
                   "files in parallel, one thread each, so smaller shards load faster.")
@click.option("--upload-repo", metavar="REPO", help="Then upload the artifact to this Hugging Face repo (created if absent; see `upload`).")
@click.option("--private", is_flag=True, help="With --upload-repo: create the repo private.")
@click.option("--format", "fmt", type=click.Choice(api.DIFFUSION_FORMATS), default=None,
              help="Diffusion models (Flux.1, Wan 2.x, Qwen-Image, SD3.5, Z-Image): comfyui writes one file for ComfyUI's "
                   "models/diffusion_models/ (per-tensor scales), comfyui-legacy its older scaled_fp8 layout, diffusers a folder "
                   "that diffusers loads through SDNQ (per-row scales) [default: diffusers; comfyui for a single .safetensors file]. "
                   "Language models take none.")
@click.option("--component", metavar="NAME", help="The diffusers pipeline component to quantize [default: transformer].")
@friendly_errors
def quantize(source, output, scheme, weights, block_size, revision, token, ignore, trust_remote_code, experts_layout, force, as_json,
             scales_file, coreml, coreml_weights, coreml_seq_len, coreai, coreai_compute, max_len, no_kv_cache, dtype, max_shard_size,
             upload_repo, private, fmt, component, **calib):
    """Quantize SOURCE (a hub repo id or a local folder) to an FP8 compressed-tensors artifact; a
    diffusers pipeline, component or original .safetensors file to FP8 for ComfyUI or diffusers.

    The artifact's README.md is a model card (front matter, what was done, how to load it, the
    source's own card below); `validate` adds its results to it."""
    coreml_opts = api.ExportOptions(seq_len=api.SeqLen.parse(coreml_seq_len), weights=coreml_weights, kv_cache=not no_kv_cache,
                                    max_len=max_len) if coreml else None
    coreai_opts = api.CoreAIOptions(max_len=max_len, compute=coreai_compute) if coreai else None
    with render.progress_bars() as progress:
        res = api.quantize(source, output, scheme=scheme, weights=weights, block_size=block_size, revision=revision, token=token, ignore=list(ignore),
                           trust_remote_code=trust_remote_code, experts_layout=experts_layout, force=force,
                           calibration=_calibration(**calib), scales_file=scales_file, coreml=coreml_opts, coreai=coreai_opts,
                           dtype=dtype, max_shard_size=max_shard_size, upload_repo=upload_repo, private=private, format=fmt,
                           component=component, progress=progress)
    if res.calibration is not None:
        render.calibration(res.calibration)
    for w in res.warnings:
        render.warn(w)
    render.quantize_summary(res, as_json)
    if res.coreml is not None:
        render.coreml_export(res.coreml, as_json)
    if res.coreai is not None:
        render.coreai_export(res.coreai, as_json)
    if res.upload is not None:
        render.uploaded(res.upload, as_json)


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
def calibrate(target, output, revision, token, ignore, trust_remote_code, **calib):
    """Measure static FP8 input scales for TARGET on real text.

    \b
    TARGET an FP8 artifact folder: calibrate the model as it will run (its FP8 weights) and write
           <m>.input_scale into it (atomically; config and manifest become the static scheme).
    TARGET a source (hub id or folder): needs -o FILE; `quantize SRC --scheme fp8 --scales FILE` uses it.
    """
    opts = _calibration(**calib, ignore=list(ignore), trust_remote_code=trust_remote_code, token=token)
    with render.progress_bars() as progress:
        res = api.calibrate(target, output, options=opts, revision=revision, token=token, progress=progress)
    render.calibration(res.calibration)
    n = len(res.calibration.scales)
    if res.into_artifact:
        render.result(f"wrote {n} input scales into {res.written_to} (scheme fp8, static per-tensor activations)")
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
        render.inspect_table(artifact, m, show_tensors)


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
    opts = api.validate_options(baseline=baseline, eval_data=eval_data, device=device, seq_len=seq_len, max_samples=max_samples,
                                prefill_len=prefill_len, decode_tokens=decode_tokens, repeats=repeats, rounds=rounds,
                                warmup=warmup, latency=not no_latency, compile=compile_mode, write=not no_write)
    with render.progress_bars() as progress:
        res = api.validate(artifact, options=opts, progress=progress)
    if as_json:
        render.print_json(res.as_dict())
    else:
        render.validation(res, explain)


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--no-hashes", is_flag=True, help="Skip the sha256 check (structure only; much faster on big artifacts).")
@click.option("--trust-remote-code", is_flag=True, help="Allow building an architecture defined by code in the artifact (only once every file verified).")
@click.option("--manifest-sha256", metavar="HEX", help="The sha256 the manifest itself must have (printed by quantize): pins the whole artifact.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@friendly_errors
def verify(artifact, no_hashes, trust_remote_code, manifest_sha256, as_json):
    """Check every file of ARTIFACT against its manifest's sha256, and its internal consistency
    (every FP8 weight has its scale; shapes and dtypes as config.json says). Exit 1 on any problem."""
    with render.progress_bars() as progress:
        report = api.verify(artifact, check_hashes=not no_hashes, trust_remote_code=trust_remote_code,
                            manifest_sha256=manifest_sha256, progress=progress)
    render.verify_report(artifact, report, as_json)
    if not report.ok:
        sys.exit(1)


@main.command("export-coreml")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--max-len", type=click.IntRange(min=2), default=None,
              help="Causal LMs: KV cache length of the stateful decoder (input_ids of 1..N tokens, position + T <= N) "
                   "[default: 2048, or the model's max_position_embeddings if smaller].")
@click.option("--no-kv-cache", is_flag=True, help="Causal LMs: the stateless input_ids -> logits form (no states).")
@click.option("--seq-len", default="128", show_default=True, metavar="N|LO:HI",
              help="Encoders and --no-kv-cache: fixed sequence length (128) or a flexible range (1:512, a Core ML RangeDim).")
@click.option("--coreml-weights", type=click.Choice(api.COREML_WEIGHT_MODES), default="fp8-lut", show_default=True,
              help="fp8-lut: the FP8 codes as an 8-bit palette of the e4m3 values (one byte per weight). "
                   "int8: coremltools linear quantization. fp16: dense.")
@click.option("--frontend", type=click.Choice(("auto", *api.COREML_FRONTENDS)), default="auto", show_default=True,
              help="auto: torch.export, then torch.jit.trace where that fails (the one that ran is printed and recorded).")
@click.option("--force", is_flag=True, help="Replace an existing model.mlpackage.")
@click.option("--check-only", is_flag=True, help="Do not export: check the package already in ARTIFACT.")
@click.option("--no-check", is_flag=True, help="Skip the checks that follow the export.")
@click.option("--samples", default=3, show_default=True, help="Text samples for the reference evaluation (encoders, --no-kv-cache).")
@click.option("--decode-steps", type=click.IntRange(min=1), default=16, show_default=True,
              help="Stateful decoders: teacher-forced decode steps of the reference evaluation.")
@click.option("--json", "as_json", is_flag=True, help="Print the export record and check results as JSON.")
@friendly_errors
def export_coreml(artifact, max_len, no_kv_cache, seq_len, coreml_weights, frontend, force, check_only, no_check, samples,
                  decode_steps, as_json):
    """Export an FP8 ARTIFACT to a Core ML ML program (ARTIFACT/model.mlpackage), then check it.

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
    with render.progress_bars() as progress, _showing_failed_checks(render.coreml_check, as_json):
        if check_only:
            res = api.check_coreml(artifact, samples=samples, decode_steps=decode_steps, progress=progress)
        else:
            res = api.export_coreml(artifact, seq_len=seq_len, weights=coreml_weights, frontend=frontend, force=force,
                                    kv_cache=not no_kv_cache, max_len=max_len, check=not no_check, samples=samples,
                                    decode_steps=decode_steps, progress=progress)
    if check_only:
        render.coreml_check(res, as_json)
    else:
        render.coreml_export(res, as_json)


@main.command("export-coreai")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--max-len", type=click.IntRange(min=2), default=None,
              help="Causal LMs: KV cache length (input_ids of 1..N tokens, position + T <= N). Encoders: longest input "
                   "[default: 2048, or the model's max_position_embeddings if smaller].")
@click.option("--compute", type=click.Choice(api.COREAI_COMPUTE_DTYPES), default="fp32", show_default=True,
              help="Compute dtype. FP8 weights stay f8E4M3FN and other tensors keep the artifact's dtype either way.")
@click.option("--force", is_flag=True, help="Replace an existing model.aimodel.")
@click.option("--check-only", is_flag=True, help="Do not export: check the asset already in ARTIFACT.")
@click.option("--no-check", is_flag=True, help="Skip the checks that follow the export.")
@click.option("--prompt-len", type=click.IntRange(min=1), default=64, show_default=True, help="Tokens of real text in the checked prefill.")
@click.option("--decode-steps", type=click.IntRange(min=1), default=32, show_default=True, help="Teacher-forced decode steps checked.")
@click.option("--json", "as_json", is_flag=True, help="Print the export record and check results as JSON.")
@friendly_errors
def export_coreai(artifact, max_len, compute, force, check_only, no_check, prompt_len, decode_steps, as_json):
    """Export an FP8 ARTIFACT to a Core AI asset (ARTIFACT/model.aimodel), then check it.

    \b
    Core AI is Apple's successor of Core ML (macOS / iOS 27 and later). FP8 weights are stored
    natively as f8E4M3FN constants with their per-tensor / per-row scales (one byte per weight).
    Causal LMs: the same stateful decoder as export-coreml (main(input_ids, position) -> logits,
    the KV cache in states key_cache_i / value_cache_i). Encoders: input_ids, attention_mask ->
    embeddings. The checks run the asset with the Core AI runtime bundled in coreai-core (Linux:
    CPU) against PyTorch on the same dequantized weights: prefill, teacher-forced decode through
    the states, greedy generation. Needs `pip install 'mpsconvert[coreai]'`.
    """
    with render.progress_bars() as progress, _showing_failed_checks(render.coreai_check, as_json):
        if check_only:
            res = api.check_coreai(artifact, prompt_len=prompt_len, decode_steps=decode_steps, progress=progress)
        else:
            res = api.export_coreai(artifact, max_len=max_len, compute=compute, force=force, check=not no_check,
                                    prompt_len=prompt_len, decode_steps=decode_steps, progress=progress)
    if check_only:
        render.coreai_check(res, as_json)
    else:
        render.coreai_export(res, as_json)


def _sampling(fn):
    """The options `generate` and `chat` share (mlx-lm's names)."""
    opts = [
        click.option("--backend", type=click.Choice(api.BACKENDS), default="torch", show_default=True,
                     help="torch: the FP8 model in PyTorch (runtime.load). coreai: the artifact's model.aimodel on the Core AI runtime "
                          "(on Linux the CPU runtime in coreai-core). coreml: model.mlpackage (macOS only)."),
        click.option("--device", default="auto", show_default=True, metavar="auto|mps|cuda[:N]|cpu",
                     help="With --backend torch: where it runs (auto: mps, then cuda, then cpu; a missing device is an error)."),
        click.option("--max-tokens", "-m", type=click.IntRange(min=1), default=256, show_default=True, help="Most tokens to generate."),
        click.option("--temp", type=click.FloatRange(min=0), default=0.0, show_default=True, help="Sampling temperature (0: greedy)."),
        click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True,
                     help="Nucleus sampling: keep the most likely tokens up to this total probability."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampler."),
        click.option("--system", "system_prompt", metavar="TEXT", help="A system message first."),
        click.option("--json", "as_json", is_flag=True, help="Print the text and its stats as JSON on stdout (no streaming)."),
        click.option("--no-compile", is_flag=True, help="With --backend torch on CUDA: the eager decode loop, not the CUDA graph."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("prompt")
@_sampling
@click.option("--ignore-chat-template", is_flag=True, help="Feed PROMPT as it is, not wrapped in the tokenizer's chat template.")
@friendly_errors
def generate(artifact, prompt, backend, device, max_tokens, temp, top_p, seed, system_prompt, as_json, no_compile, ignore_chat_template):
    """Generate text from ARTIFACT for PROMPT, streamed as it comes, then tokens/s, peak memory and device.

    \b
    PROMPT is wrapped in the tokenizer's chat template when it has one (as mlx_lm.generate does).
    """
    with render.progress_bars() as progress:
        c = api.chat(artifact, backend=backend, device=device, max_tokens=max_tokens, temp=temp, top_p=top_p, seed=seed,
                     system=system_prompt, progress=progress,
                     compile=False if no_compile else None)
    with c:
        res = c.complete(prompt, None if as_json else render.stream, use_template=not ignore_chat_template)
    render.generation(res, as_json)


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@_sampling
@friendly_errors
def chat(artifact, backend, device, max_tokens, temp, top_p, seed, system_prompt, as_json, no_compile):
    """Chat with ARTIFACT: the tokenizer's chat template, the history kept; `/exit` (or end of input) ends, `/reset` forgets."""
    with render.progress_bars() as progress:
        c = api.chat(artifact, backend=backend, device=device, max_tokens=max_tokens, temp=temp, top_p=top_p, seed=seed,
                     system=system_prompt, progress=progress,
                     compile=False if no_compile else None)
    with c:
        render.note(f"chatting with {artifact} ({c.backend} on {c.device}); /exit to end, /reset to forget the history")
        while True:
            line = render.ask()
            if line is None or line.strip() == "/exit":
                break
            if line.strip() == "/reset":
                c.reset()
                render.note("history cleared")
                continue
            if not line.strip():
                continue
            res = c.say(line, None if as_json else render.stream)
            render.generation(res, as_json)


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("repo")
@click.option("--private", is_flag=True, help="Create the repo private (an existing repo keeps its visibility).")
@click.option("--token", envvar="HF_TOKEN", show_envvar=True, help="A Hugging Face write token [default: your stored login].")
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
    with render.progress_bars() as progress:
        res = api.upload(artifact, repo, private=private, token=token, revision=revision, progress=progress)
    render.uploaded(res, as_json)
