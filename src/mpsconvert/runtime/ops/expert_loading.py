"""Building `FP8Experts` from an artifact: reading each expert parameter's e4m3 codes and scales and swapping
a model's fused-experts modules for FP8 ones.

Kept apart from the module's forward (fp8_experts.py) because it is about the artifact's layout, not about
running: fused or per-expert tensors (model.moe_layout), per-channel or block scales, static input scales
(the larger of gate's and up's per expert), and the scheme read from the model's quantization_config. The
streaming loader (runtime/load/tensor_plan.py) reuses `_fp8_param` and `scale_keys` on codes it assembles.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...errors import ArtifactError
from ...format import fp8
from ...infra import devices
from ...infra.untrusted import read_json
from ...model.moe_layout import ExpertParam, find_layout
from .fp8_experts import FP8, FP8Experts


@dataclass
class MoEReport:
    """What `replace_moe_experts` did, for the caller to print or put in the manifest."""

    replaced: dict[str, dict] = field(default_factory=dict)  # module -> {layout, path, ...}
    skipped: dict[str, str] = field(default_factory=dict)  # module -> why it kept its weights
    activations: str | None = None

    def as_dict(self) -> dict:
        return {"replaced": self.replaced, "skipped": self.skipped, "activations": self.activations}


def _codes(tensors, key: str, device) -> torch.Tensor | None:
    """An artifact's e4m3 codes on `device`, held as the device holds codes (bytes where it has
    no float8: fp8.codes_to); a tensor of another dtype as it is, for the caller to refuse."""
    t = tensors[key] if key in tensors else None
    return None if t is None else fp8.codes_to(t, device) if t.dtype == FP8 else t.to(device)


def _fp8_param(
    ep: ExpertParam, tensors, device, codes: torch.Tensor | None = None, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes [E, N, K], scale [E, N] or [E, 1] (block: [E, N, ceil(K/b)]), input scale [E] or
    None) from the artifact. `codes`: the experts' codes already assembled on the device (the
    loader streams each per-expert tensor into its rows), so only the scales are read from `tensors`."""
    E, N, K = ep.shape
    if block:
        return _fp8_block_param(ep, tensors, device, codes, block)

    def get(key):
        t = tensors[key] if key in tensors else None
        return None if t is None else t.to(device)

    if ep.layout == "fused":
        codes = codes if codes is not None else _codes(tensors, ep.key, device)
        scale, ins = get(ep.key + "_scale"), get(ep.key + "_input_scale")
        if codes is None or codes.dtype not in fp8.CODE_DTYPES or scale is None:
            raise ArtifactError(
                f"{ep.key} is not stored as FP8 with a {ep.key}_scale",
                "re-create the artifact with mpsconvert quantize",
            )
        return codes, scale.float().reshape(E, -1), ins
    assembled = codes is not None
    codes = (
        codes
        if assembled
        else torch.empty(E, N, K, dtype=devices.capabilities(torch.device(device)).code_dtype, device=device)
    )
    scale = torch.empty(E, N, dtype=torch.float32, device=device)
    ins = [None] * E
    for sl in ep.slices:
        w = None if assembled else _codes(tensors, sl.key, device)
        s = get(sl.key + "_scale")
        if (not assembled and (w is None or w.dtype != codes.dtype)) or s is None:
            raise ArtifactError(
                f"{sl.key} is not stored as FP8 with a weight_scale", "re-create the artifact with mpsconvert quantize"
            )
        if not assembled:
            codes[sl.expert, sl.start : sl.stop] = w
        scale[sl.expert, sl.start : sl.stop] = s.float().reshape(-1).expand(sl.stop - sl.start)
        _take_input_scale(ins, sl.expert, get(sl.key[: -len("weight")] + "input_scale"))
    return codes, scale, _stacked(ins)


def _fp8_block_param(ep: ExpertParam, tensors, device, codes, block: int):
    """_fp8_param for block scales: each stored [ceil(n/b), ceil(K/b)] scale expanded along its rows."""
    E, N, K = ep.shape

    def get(key):
        return tensors[key].to(device) if key in tensors else None

    code_dtype = devices.capabilities(torch.device(device)).code_dtype
    assembled = codes is not None
    pieces = [(ep.key, None)] if ep.layout == "fused" else [(sl.key, sl) for sl in ep.slices]
    if not assembled:
        codes = (
            _codes(tensors, ep.key, device)
            if ep.layout == "fused"
            else torch.empty(E, N, K, dtype=code_dtype, device=device)
        )
    scale = torch.empty(E, N, -(-K // block), dtype=torch.float32, device=device)
    ins = [None] * E
    for key, sl in pieces:
        s, w = get(key + "_scale"), None if assembled or sl is None else _codes(tensors, key, device)
        if (
            s is None
            or codes is None
            or codes.dtype != code_dtype
            or (sl is not None and not assembled and (w is None or w.dtype != code_dtype))
        ):
            raise ArtifactError(
                f"{key} is not stored as FP8 with a {key}_scale", "re-create the artifact with mpsconvert quantize"
            )
        s = s.float().repeat_interleave(block, dim=-2)
        if sl is None:
            scale.copy_(s[:, :N])
            i = get(key + "_input_scale")
            ins = list(i.float().reshape(E)) if i is not None else ins
            continue
        scale[sl.expert, sl.start : sl.stop] = s[: sl.stop - sl.start]
        if w is not None:
            codes[sl.expert, sl.start : sl.stop] = w
        _take_input_scale(ins, sl.expert, get(sl.key[: -len("weight")] + "input_scale"))
    return codes, scale, _stacked(ins)


def _take_input_scale(ins: list, expert: int, i: torch.Tensor | None) -> None:
    """One slice's stored input scale `i` into `ins[expert]`: w1 and w3 (gate and up) of one expert read the
    same input, so the expert keeps the larger of theirs."""
    if i is not None:
        i = i.float().reshape(())
        ins[expert] = i if ins[expert] is None else torch.maximum(ins[expert], i)


def _stacked(ins: list) -> torch.Tensor | None:
    """The experts' input scales [E], or None when one of them has none (the activations are not static)."""
    return torch.stack(ins) if all(v is not None for v in ins) else None


def scale_keys(ep: ExpertParam) -> list[str]:
    """The checkpoint keys of one expert parameter's scales (weight and, when stored, input)."""
    if ep.layout == "fused":
        return [ep.key + "_scale", ep.key + "_input_scale"]
    return [k for sl in ep.slices for k in (sl.key + "_scale", sl.key[: -len("weight")] + "input_scale")]


def _activations_from(model, qc=None) -> str | None:
    return _scheme_from(model, qc).activations


def _scheme_from(model, qc=None):
    from ...format.ct_config import scheme_from_config

    qc = qc if qc is not None else getattr(model.config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else None
    if isinstance(qc, dict) and "quantization_config" in qc and "config_groups" not in qc:
        qc = qc["quantization_config"]  # transformers' CompressedTensorsConfig.to_dict() nests it
    if isinstance(qc, dict) and qc.get("config_groups"):
        return scheme_from_config(qc)
    raise ArtifactError(
        "cannot tell how the experts' activations are quantized: the model config has no compressed-tensors "
        "quantization_config",
        "pass activations='token' | 'tensor' | None to replace_moe_experts",
    )


FROM_CONFIG = "from-config"


def replace_moe_experts(
    model, tensors, device, activations: str | None = FROM_CONFIG, dtype=torch.bfloat16
) -> MoEReport:
    """Swap every transformers fused-experts module of `model` for an `FP8Experts` built from
    the artifact's `tensors` (name -> tensor, e.g. a safetensors `safe_open` handle or dict).

    `activations`: 'token' (dynamic), 'tensor' (static, needs input scales) or None (weight
    only); by default read from `model.config.quantization_config`. Modules whose experts are
    not FP8 in the artifact are listed in `report.skipped` and keep their weights.
    """
    device = torch.device(device)
    block = None
    if activations == FROM_CONFIG:
        scheme = _scheme_from(model)
        activations, block = scheme.activations, scheme.block
    keys = _keys(tensors)
    stored = {k: tuple(_shape(tensors, k)) for k in keys}
    layout = find_layout(model, stored)
    report = MoEReport(activations=activations)
    modules = dict(model.named_modules())
    by_module: dict[str, dict[str, ExpertParam]] = {}
    for ep in layout.values():
        by_module.setdefault(ep.module, {})[ep.param] = ep
    for name, eps in by_module.items():
        bad = [ep for ep in eps.values() if ep.layout not in ("fused", "per-expert")]
        if bad:
            report.skipped[name] = "; ".join(f"{ep.param}: {ep.why}" for ep in bad)
            continue
        old = modules[name]
        w13, s13, i13 = _fp8_param(eps["gate_up_proj"], tensors, device, block=block)
        w2, s2, i2 = _fp8_param(eps["down_proj"], tensors, device, block=block)
        new = FP8Experts(w13, s13, w2, s2, old.act_fn, activations, i13, i2, dtype=dtype, block=block)
        parent, _, leaf = name.rpartition(".")
        setattr(modules[parent] if parent else model, leaf, new)
        report.replaced[name] = {"layout": eps["gate_up_proj"].layout, **new.paths, "experts": new.num_experts}
    return report


def _keys(tensors) -> list[str]:
    return list(tensors.keys())


def _shape(tensors, key):
    if hasattr(tensors, "get_slice"):
        return tensors.get_slice(key).get_shape()
    return tensors[key].shape


class ArtifactTensors:
    """All tensors of an artifact's shards behind one mapping, read lazily (safetensors)."""

    def __init__(self, folder):
        from pathlib import Path

        from safetensors import safe_open

        folder = Path(folder)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ArtifactError(f"{folder} has no .safetensors files", "point at an mpsconvert artifact folder")
        self._handles = [safe_open(str(f), "pt") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def keys(self):
        return self._where.keys()

    def __contains__(self, key):
        return key in self._where

    def __getitem__(self, key):
        return self._where[key].get_tensor(key)

    def get_slice(self, key):
        return self._where[key].get_slice(key)


def load_fp8_experts(model, artifact_dir, device, activations: str | None = FROM_CONFIG) -> MoEReport:
    """Entry point for `runtime.load`: swap `model`'s experts for FP8 ones read from the
    artifact folder (the model may hold BF16 experts, e.g. loaded through transformers +
    compressed-tensors, or be empty)."""
    from pathlib import Path

    if activations == FROM_CONFIG:
        config = read_json(Path(artifact_dir) / "config.json", what="config.json")
        activations = _activations_from(model, config.get("quantization_config") or {})
    return replace_moe_experts(model, ArtifactTensors(artifact_dir), device, activations)


__all__ = [
    "MoEReport",
    "replace_moe_experts",
    "load_fp8_experts",
]
