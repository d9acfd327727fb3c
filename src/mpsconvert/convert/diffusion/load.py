"""A diffusion artifact back in PyTorch through its own loader's library, beside its BF16 source:
what `validate` runs one denoising step of (runtime/evaluate/validate_diffusion.py).

- diffusers format: `from_pretrained` of the folder, which diffusers routes to its SDNQ backend
  (the weights stay e4m3 in memory and are dequantized per call).
- ComfyUI format: the file read the way ComfyUI's loader reads it (comfy/utils.py
  `convert_old_quants` for the legacy layout and the header's `_quantization_metadata`, then
  comfy/ops.py: a `comfy_quant` layer's weight becomes comfy-kitchen's `QuantizedTensor` with a
  `TensorCoreFP8Layout` and its `weight_scale`), dequantized by comfy-kitchen, and put back in
  diffusers' names by the inverse of keymap.py (ComfyUI's own Flux, Wan, ... modules are not a
  pip package; their key names are what keymap.py writes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...errors import ArtifactError, SourceError
from ...infra.extras import require
from ...infra.untrusted import field as json_field
from ...infra.untrusted import parse_json, read_json
from ...manifests.manifest import Manifest
from ...source.snapshot import resolve
from .families import BY_NAME
from .keymap import to_original
from .write import LEGACY_MARKER


@dataclass
class Pair:
    bf16: torch.nn.Module
    fp8: torch.nn.Module
    family: str  # families.Family.name: which inputs a step takes
    config: dict
    baseline: str
    how: dict = field(default_factory=dict)  # how the FP8 weights were loaded, for the result


def _diffusers_class(name: str):
    diffusers = require("diffusers", "diffusion", "validating a diffusion artifact")
    return getattr(diffusers, name)


def baseline_path(artifact: Path, manifest: Manifest, baseline: str | None) -> Path:
    """The BF16 component validate compares with: --baseline, else the manifest's source."""
    src = manifest.source
    d = src.get("diffusion") or {}
    if d.get("layout") == "single-file" and baseline is None:
        raise SourceError(
            f"{artifact} was converted from a single original-repo file, which diffusers cannot build "
            "without its config",
            "pass `baseline` with the diffusers folder or repo of the same model",
        )
    cand = baseline or (src["id"] if src.get("kind") == "hub" else src.get("path"))
    if not cand:
        raise SourceError(f"the manifest of {artifact} names no source", "pass `baseline=<diffusers folder or repo>`")
    # a local pipeline is recorded by its component's folder; a hub one by the pipeline's id
    comp = d.get("component") if d.get("layout") == "pipeline" and not (Path(cand) / "config.json").is_file() else None
    snap = resolve(
        str(cand),
        revision=None if baseline else src.get("commit") or src.get("revision"),
        diffusion=True,
        component=comp,
    )
    if snap.diffusion is None:
        raise SourceError(f"the baseline {cand} is not a diffusers model", "pass `baseline=<diffusers folder or repo>`")
    return snap.path


def comfy_state_dict(path: Path, dtype: torch.dtype = torch.bfloat16) -> tuple[dict, dict]:
    """The ComfyUI file as ComfyUI's loader sees it: every `comfy_quant` layer a comfy-kitchen
    QuantizedTensor, dequantized by comfy-kitchen. Returns (name -> tensor, what was read)."""
    from safetensors import safe_open

    require("comfy_kitchen", "diffusion", "reading a ComfyUI FP8 file")
    from comfy_kitchen.tensor import QuantizedTensor, TensorCoreFP8Layout

    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata() or {}
        sd = {k: fh.get_tensor(k) for k in fh.keys()}
    # comfy/utils.py convert_old_quants: the header's list, else the legacy marker's renames
    if "_quantization_metadata" in meta:
        layers = json_field(
            parse_json(meta["_quantization_metadata"], what=f"{path.name}: _quantization_metadata"),
            "layers",
            dict,
            what=f"{path.name}: _quantization_metadata",
        )
    elif LEGACY_MARKER in sd:
        full = sd.pop(LEGACY_MARKER).numel() == 2
        layers = {}
        for k in [k for k in sd if k.endswith(".scale_weight")]:
            mod = k[: -len(".scale_weight")]
            sd[mod + ".weight_scale"] = sd.pop(k)
            layers[mod] = {"format": "float8_e4m3fn", **({"full_precision_matrix_mult": True} if full else {})}
    else:
        layers = {}
    for mod, conf in layers.items():
        sd[mod + ".comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    out, n = {}, 0
    for k in list(sd):
        if not k.endswith(".comfy_quant"):
            continue
        mod = k[: -len(".comfy_quant")]
        conf = parse_json(bytes(sd.pop(k).tolist()), what=f"{path.name}: {k}")
        if conf.get("format") != "float8_e4m3fn":
            raise ArtifactError(
                f"{path.name}: layer {mod} has format {conf.get('format')!r}", "only float8_e4m3fn layers are read"
            )
        w, scale = sd.pop(mod + ".weight"), sd.pop(mod + ".weight_scale")
        qt = QuantizedTensor(
            w.to(torch.float8_e4m3fn),
            "TensorCoreFP8Layout",
            TensorCoreFP8Layout.Params(scale=scale, orig_dtype=dtype, orig_shape=tuple(w.shape)),
        )
        out[mod + ".weight"] = qt.dequantize()
        n += 1
    out.update(sd)
    return out, {
        "fp8_layers": n,
        "layers_in_header": len(layers),
        "reader": "comfy-kitchen QuantizedTensor(TensorCoreFP8Layout).dequantize()",
    }


def to_diffusers(family: str, original: dict, model: torch.nn.Module) -> dict:
    """Original-layout tensors -> the diffusers model's names (keymap.py's pieces, read back:
    each piece's rows go to their source tensor, in row order, so swaps and fusions undo)."""
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    parts: dict[str, list] = {}
    for o in to_original(BY_NAME[family], shapes):
        if o.name not in original:
            raise ArtifactError(f"the ComfyUI file has no {o.name}", "re-create the artifact")
        t, row = original.pop(o.name), 0
        for pc in o.pieces:
            n = pc.row1 - pc.row0
            parts.setdefault(pc.key, []).append((pc.row0, t[row : row + n] if t.dim() else t))
            row += n
    return {
        k: torch.cat([t for _, t in sorted(v, key=lambda x: x[0])]) if v[0][1].dim() else v[0][1]
        for k, v in parts.items()
    }


def load_pair(artifact: Path, manifest: Manifest, device: torch.device, baseline: str | None) -> Pair:
    """The BF16 source and the FP8 artifact as diffusers transformers on `device`."""
    from accelerate import init_empty_weights

    r = manifest.recipe
    base_dir = baseline_path(artifact, manifest, baseline)
    cls = _diffusers_class(
        json_field(
            read_json(base_dir / "config.json", error=SourceError),
            "_class_name",
            str,
            what=f"{base_dir}/config.json",
            error=SourceError,
        )
    )
    bf16 = cls.from_pretrained(str(base_dir), torch_dtype=torch.bfloat16).to(device).eval()
    config = dict(bf16.config)
    if r["format"] == "diffusers":
        require("sdnq", "diffusion", "loading an SDNQ (diffusers format) artifact")
        where = artifact / r.get("weights_dir", ".")
        fp8 = cls.from_pretrained(str(where), torch_dtype=torch.bfloat16).to(device).eval()
        how = {
            "loader": f"diffusers {cls.__name__}.from_pretrained (SDNQ backend)",
            "fp8_layers": sum(1 for m in fp8.modules() if type(m).__name__.startswith("SDNQ")),
        }
    else:
        sd, how = comfy_state_dict(artifact / r["file"])
        with init_empty_weights():
            fp8 = cls.from_config(config)
        fp8.load_state_dict(to_diffusers(r["family"], sd, fp8), strict=True, assign=True)
        fp8 = fp8.to(device=device, dtype=torch.bfloat16).eval()
        how["loader"] = "the ComfyUI file read as ComfyUI does, dequantized at load by comfy-kitchen"
    return Pair(bf16, fp8, r["family"], config, str(base_dir), how)
