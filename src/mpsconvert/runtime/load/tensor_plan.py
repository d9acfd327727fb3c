"""Where every checkpoint tensor goes and what it becomes: `TensorPlan` maps each stored tensor to
a destination allocated on the device (the bytes stream.read_shards copies into), then installs
them as parameters, FP8Linear layers and FP8Experts. Kept apart from the load driver (loader.py):
this is the model surgery, the driver the order of checks, reads and patches around it.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import ArtifactError
from ...format.fp8 import CODE_DTYPES, dequantize
from ...infra import devices
from ...infra.safetensors_io import torch_dtype
from ..ops.fp8linear import FP8Linear
from .load_report import LoadInfo

_FP8_PARTS = ("weight", "weight_scale", "input_scale", "bias")


def _resolver(model: nn.Module, renamed: dict[str, str] | None = None):
    """checkpoint key -> model key, allowing for a saved-with/without base_model_prefix and for
    the names transformers changes on save (`renamed`: stored key -> model key; a renamed
    `<m>.weight` renames its module's FP8 parts too)."""
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    modules = {n for n, _ in model.named_modules()}
    prefix = getattr(model, "base_model_prefix", "") or ""
    renamed = renamed or {}
    mod_renames = {k.rpartition(".")[0]: v.rpartition(".")[0] for k, v in renamed.items() if k.endswith(".weight")}

    def resolve(key: str) -> str | None:
        mod, _, leaf = key.rpartition(".")
        if key in renamed:
            key = renamed[key]
        elif mod in mod_renames and leaf in _FP8_PARTS:
            key = f"{mod_renames[mod]}.{leaf}"
        mod = key.rpartition(".")[0]
        for cand in (key, f"{prefix}.{key}", key[len(prefix) + 1 :] if key.startswith(prefix + ".") else None):
            if cand and (cand in names or (leaf in _FP8_PARTS and cand.rpartition(".")[0] in modules)):
                return cand
        return None

    return resolve


def _set_tensor(model: nn.Module, key: str, value: torch.Tensor) -> None:
    mod_name, _, leaf = key.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if leaf in mod._parameters:
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    elif leaf in mod._buffers:
        mod._buffers[leaf] = value
    else:
        raise ArtifactError(
            f"checkpoint tensor {key} has no place in {type(model).__name__}",
            "is config.json the one this checkpoint was made with?",
        )


class TensorPlan:
    """Where every checkpoint tensor goes: a destination on the device for its bytes, and what
    becomes of it once filled (a parameter, an FP8Linear part, rows of an FP8Experts)."""

    def __init__(self, model: nn.Module, report, dtype: torch.dtype, dev: torch.device):
        from ...model.moe_layout import experts_modules, find_layout, saved_names
        from ..ops.expert_loading import scale_keys

        self.dtype, self.dev = dtype, dev
        self.code_dtype = devices.capabilities(dev).code_dtype  # float8_e4m3fn, or uint8 where the device has no float8
        stored = {k: info for h in report.headers.values() for k, info in h.tensors.items()}
        self.codes = [
            k for k, info in stored.items() if info.dtype == "F8_E4M3"
        ]  # e4m3 codes: checked for NaN codes once read
        self.dests: dict[str, torch.Tensor] = {}
        self.params: dict[str, str] = {}  # model key -> checkpoint key
        self.fp8: dict[str, dict[str, str]] = {}  # Linear module -> {part: checkpoint key}
        self.experts: dict[str, dict] = {}  # experts module -> {param: (ExpertParam, codes)}
        self.dense_experts: list = []  # (ExpertParam, 3-D parameter, pieces) of experts stored unquantized
        claimed: set[str] = set()
        expert_params = set()
        if experts_modules(model):
            for ep in find_layout(model, {k: i.shape for k, i in stored.items()}).values():
                expert_params.add(ep.name)
                if ep.layout not in ("fused", "per-expert"):
                    raise ArtifactError(
                        f"the experts {ep.name} cannot be loaded: {ep.why or ep.layout}",
                        "re-create the artifact with mpsconvert quantize",
                    )
                pieces = [(ep.key, None)] if ep.layout == "fused" else [(sl.key, sl) for sl in ep.slices]
                if all(stored[k].dtype == "F8_E4M3" for k, _ in pieces):
                    codes = torch.empty(ep.shape, dtype=self.code_dtype, device=dev)
                    for k, sl in pieces:
                        self.dests[k] = codes if sl is None else codes[sl.expert, sl.start : sl.stop]
                    for k in scale_keys(ep):
                        if k in stored:
                            self.dests[k] = self._alloc(stored[k])
                            claimed.add(k)
                    self.experts.setdefault(ep.module, {})[ep.param] = (ep, codes)
                else:  # experts kept in full precision: assembled into the model's own 3-D parameter
                    param = torch.empty(ep.shape, dtype=dtype, device=dev)
                    for k, sl in pieces:
                        dst = param if sl is None else param[sl.expert, sl.start : sl.stop]
                        self.dests[k] = dst if stored[k].torch_dtype == dtype else self._alloc(stored[k])
                    self.dense_experts.append((ep, param, pieces))
                claimed.update(k for k, _ in pieces)
        names = [n for n, _ in model.named_parameters() if n not in expert_params]
        resolve = _resolver(model, saved_names(model, names))
        fp8_modules = {t.rpartition(".")[0] for m in report.quantized if (t := resolve(m + ".weight"))}
        unexpected = []
        for key, info in stored.items():
            if key in claimed:
                continue
            target = resolve(key)
            if target is None:
                unexpected.append(key)
                continue
            mod, _, leaf = target.rpartition(".")
            self.dests[key] = self._alloc(info)
            if mod in fp8_modules and leaf in _FP8_PARTS:
                self.fp8.setdefault(mod, {})[leaf] = key
            else:
                self.params[target] = key
        self.codes = [k for k in self.codes if k in self.dests]
        if unexpected:
            raise ArtifactError(
                f"{len(unexpected)} checkpoint tensors have no place in {type(model).__name__} (e.g. {unexpected[0]})",
                "is config.json the one this checkpoint was made with?",
            )

    def _alloc(self, info) -> torch.Tensor:
        dtype = self.code_dtype if info.dtype == "F8_E4M3" else torch_dtype(info.dtype)
        return torch.empty(info.shape, dtype=dtype, device=self.dev)

    def install(self, model: nn.Module, activations, info: LoadInfo, block: int | None = None) -> None:
        from ..ops.expert_loading import _fp8_param
        from ..ops.fp8_experts import FP8Experts

        for target, key in self.params.items():
            t = self.dests[key]
            _set_tensor(model, target, t.to(self.dtype) if t.is_floating_point() and t.dtype != self.dtype else t)
        for mod_name, parts in self.fp8.items():
            _install(
                model,
                mod_name,
                {leaf: self.dests[k] for leaf, k in parts.items()},
                activations,
                self.dev,
                self.dtype,
                info,
                block,
            )
        for ep, param, pieces in self.dense_experts:
            for k, sl in pieces:
                dst = param if sl is None else param[sl.expert, sl.start : sl.stop]
                if self.dests[k].data_ptr() != dst.data_ptr():  # stored in another dtype: converted here
                    dst.copy_(self.dests[k])
            _set_tensor(model, ep.name, param)
        for mod_name, params in self.experts.items():
            if set(params) != {"gate_up_proj", "down_proj"}:
                raise ArtifactError(
                    f"{mod_name} has FP8 {sorted(params)} only", "re-create the artifact with mpsconvert quantize"
                )
            (ep13, c13), (ep2, c2) = params["gate_up_proj"], params["down_proj"]
            w13, s13, i13 = _fp8_param(ep13, self.dests, self.dev, codes=c13, block=block)
            w2, s2, i2 = _fp8_param(ep2, self.dests, self.dev, codes=c2, block=block)
            old = model.get_submodule(mod_name)
            new = FP8Experts(w13, s13, w2, s2, old.act_fn, activations, i13, i2, dtype=self.dtype, block=block)
            parent, _, leaf = mod_name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, new)
            info.experts[mod_name] = {"layout": ep13.layout, **new.paths, "experts": new.num_experts}
        self.dests.clear()


def _install(model, mod_name: str, p: dict, activations, dev, dtype, info: LoadInfo, block: int | None = None) -> None:
    mod = model.get_submodule(mod_name)
    w, scale = p.get("weight"), p.get("weight_scale")
    if w is None or scale is None or w.dtype not in CODE_DTYPES:
        raise ArtifactError(
            f"{mod_name} has an incomplete FP8 weight (weight and weight_scale needed)", "re-create the checkpoint"
        )
    if not isinstance(mod, nn.Linear):  # no FP8 kernel for this module type: dense once, and say so
        _set_tensor(model, mod_name + ".weight", dequantize(w, scale.float(), dtype, block).to(dev))
        if "bias" in p:
            _set_tensor(model, mod_name + ".bias", p["bias"].to(dev, dtype))
        info.dequantized.append(
            f"{mod_name} ({type(mod).__name__}: no FP8 kernel, dequantized to {info.dtype} at load)"
        )
        return
    layer = FP8Linear.from_tensors(
        w.to(dev),
        scale.float().to(dev),
        activations=activations,
        input_scale=p["input_scale"].float() if "input_scale" in p else None,
        bias=p["bias"] if "bias" in p else None,
        dtype=dtype,
        block=block,
    )
    parent_name, _, leaf = mod_name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, layer)
