"""Everything in a diffusion artifact that is not the FP8 weights: configs, the rest of the
pipeline copied as it is, the manifest (every file with its sha256) and the model card.

Layouts (docs/diffusion.md):
- comfyui: `<name>.safetensors` (the file for ComfyUI's models/diffusion_models/), the source
  component's config.json (what `validate` builds the model from), mpsconvert.json, README.md.
- diffusers: the source's own layout: a pipeline (model_index.json, every other component
  copied, `<component>/` with the FP8 weights and a config.json whose `quantization_config` is
  SDNQ's) or one component folder; plus mpsconvert.json and README.md at the top.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ...format import fp8
from ...infra import atomic
from ...manifests import card
from ...manifests.hashing import sha256_file
from ...manifests.layout import CONFIG_NAME, MANIFEST_NAME
from ...manifests.manifest import Manifest
from ...manifests.transaction import finish
from ...source.snapshot import DIFFUSERS_WEIGHTS, Snapshot, check_inside
from ..assemble import Shards, _record_file, summarize, write_index
from . import COMFYUI_FORMATS
from .write import COMFY_LAYER, DiffusionOptions, DiffusionPlan

INDEX = DIFFUSERS_WEIGHTS + ".index.json"


def sdnq_config(p: DiffusionPlan) -> dict:
    """The `quantization_config` diffusers' SDNQ backend reads (sdnq.SDNQConfig's fields): FP8
    e4m3 weights, one scale per output row (group_size -1), dequantized to the compute dtype
    before a 16-bit matmul (use_quantized_matmul off: works on every device); every Linear kept
    in high precision is named in `modules_to_not_convert` as `<module>.weight` (pre-quantized
    loading replaces every other Linear; SDNQ matches a bare name against every component of a
    module's path, so `proj_out` would also keep Flux's single blocks' proj_out), and no skip
    keys are added at load."""
    return {
        "quant_method": "sdnq",
        "weights_dtype": "float8_e4m3fn",
        "group_size": -1,
        "use_svd": False,
        "use_quantized_matmul": False,
        "dequantize_fp32": True,
        "add_skip_keys": False,
        "modules_to_not_convert": sorted(f"{m}.weight" for m in p.ignored),
        "modules_dtype_dict": {},
        "quant_conv": False,
        "quant_embedding": False,
    }


def assemble(
    tmp: Path, snap: Snapshot, p: DiffusionPlan, opts: DiffusionOptions, shards: Shards, name: str
) -> Manifest:
    d = snap.diffusion
    comfy = opts.format in COMFYUI_FORMATS
    pipeline = d.layout == "pipeline" and not comfy
    sub = f"{d.component}/" if pipeline else ""
    files = {sub + k: v for k, v in shards.files.items()}
    source_files = {f: snap.sha256(f) for f in snap.weight_files}
    where = tmp / d.component if pipeline else tmp

    config = (
        dict(snap.config)
        if snap.config
        else {
            "_class_name": p.family.classes[0],
            "_mpsconvert_note": "converted from a single original-repo file: no diffusers config",
        }
    )
    if not comfy:
        config["quantization_config"] = sdnq_config(p)
        write_index(shards, tmp, sub + INDEX, files)
    atomic.write_text(where / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
    _record_file(files, tmp, sub + CONFIG_NAME)
    if snap.config:
        source_files[CONFIG_NAME] = sha256_file(snap.path / CONFIG_NAME)
    if pipeline:  # every other file of the pipeline, as it is (text encoders, VAE, scheduler, tokenizers)
        root = d.root
        mine = {f"{d.component}/{n}" for n in (*snap.weight_files, INDEX, CONFIG_NAME)}
        for src in sorted(root.rglob("*")):
            rel = src.relative_to(root).as_posix()
            if (
                src.is_dir()
                or rel in mine
                or any(part.startswith(".") for part in rel.split("/"))
                or rel in (MANIFEST_NAME, card.CARD_NAME)
            ):
                continue
            inside_snap = Snapshot(path=root, kind=snap.kind)
            check_inside(inside_snap, rel)
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, tmp / rel)
            source_files[rel] = _record_file(files, tmp, rel)

    recipe = {
        "name": "fp8-weight-only",
        "weights": "tensor" if comfy else "row",
        "activations": None,
        "format": opts.format,
        "family": p.family.name,
        "family_label": p.family.label,
        "component": d.component,
        "fp8_dtype": "float8_e4m3fn",
        "scale": "amax / 448 (dequant multiplier), floor %g, clamp to +-448 before the cast" % fp8.SCALE_FLOOR,
        "high_precision": {"rule": p.keep.source, "patterns": list(p.keep.patterns)},
        "ignore_patterns": list(opts.ignore),
        "ignored_modules": dict(sorted(p.ignored.items())),
    }
    if comfy:
        recipe |= {
            "file": next(iter(shards.files)),
            "loader": "ComfyUI: models/diffusion_models/ + Load Diffusion Model",
            "layer_config": COMFY_LAYER,
            "key_names": "original repo (converted from diffusers names)"
            if d.layout != "single-file"
            else "original repo (as the source file)",
        }
    else:
        recipe |= {
            "backend": "sdnq",
            "loader": "diffusers from_pretrained (SDNQ backend: pip install sdnq)",
            "weights_dir": d.component if pipeline else ".",
        }
    manifest = Manifest(
        source=snap.as_dict() | {"files": dict(sorted(source_files.items()))},
        recipe=recipe,
        tensors=dict(sorted(shards.tensors.items())),
        skipped=dict(sorted(p.skipped.items())),
        files=dict(sorted(files.items())),
        device="cpu",
    )
    manifest.versions |= _diffusion_versions()
    manifest.created["shard_writes"] = ", ".join(sorted(shards.write_modes))
    manifest.summary = summarize(manifest, p.as_plan(), shards.bytes_in, shards.bytes_out)
    finish(tmp, manifest, name, None, seal=True)  # the card's commands name the folder being published
    return manifest


def _diffusion_versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("diffusers", "sdnq", "accelerate"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out
