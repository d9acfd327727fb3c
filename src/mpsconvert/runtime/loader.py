"""Load an FP8 compressed-tensors checkpoint (ours or llm-compressor's) as a ready transformers model.

How, and why this way:
- The artifact is verified first (manifests/verify.py: sha256 against the manifest, scales and
  shapes against config.json); a tampered or truncated file is refused with an ArtifactError.
  `verify=False` skips the hashing (the structural checks a load needs still run).
- The architecture is built from config.json with its parameters on the meta device (no memory,
  no random init) but its buffers real (rotary tables and position ids are computed in
  `__init__` and are not in checkpoints). Tensors are then read with safetensors, one at a time,
  straight to the target device in `dtype`.
- Every Linear whose weight is stored as F8_E4M3 becomes an FP8Linear holding the e4m3 codes and
  scales on the device (no BF16 copy). On CPU each is dequantized once to `dtype` instead, since
  FP8 matmul on CPU is orders of magnitude slower. An FP8 tensor that belongs to a module we have
  no FP8 kernel for (llm-compressor's model-free path also quantizes `embed_tokens`) is
  dequantized once at load, and listed in `model.mpsconvert.dequantized`.
- Kernels are then chosen per layer shape by runtime/policy.py (measured, cached).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .. import devices, modeldef
from ..fp8 import FP8_DTYPE, dequantize
from ..errors import MpsconvertError, ArtifactError
from ..manifests import layout
from ..manifests.ct_config import scheme_from_config
from ..manifests.verify import check_artifact
from .fp8linear import FP8Linear
from .policy import KernelPolicy

_FP8_PARTS = ("weight", "weight_scale", "input_scale", "bias")


@dataclass
class LoadInfo:
    """What `load` did, attached to the model as `model.mpsconvert`."""

    path: str
    device: str
    dtype: str
    scheme: str
    weights: str
    verify: dict
    fp8_layers: int = 0
    dequantized: list = field(default_factory=list)  # FP8 tensors of non-Linear modules, made dense
    kernels: list = field(default_factory=list)  # policy decisions
    weight_bytes: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _resolver(model: nn.Module):
    """checkpoint key -> model key, allowing for a saved-with/without base_model_prefix."""
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    modules = {n for n, _ in model.named_modules()}
    prefix = getattr(model, "base_model_prefix", "") or ""

    def resolve(key: str) -> str | None:
        mod, _, leaf = key.rpartition(".")
        for cand in (key, f"{prefix}.{key}", key[len(prefix) + 1:] if key.startswith(prefix + ".") else None):
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
        raise ArtifactError(f"checkpoint tensor {key} has no place in {type(model).__name__}", "is config.json the one this checkpoint was made with?")


def load(path, device: str = "auto", dtype: torch.dtype = torch.bfloat16, verify: bool = True, *,
         prefill_m: int = 512, kernel_cache=None, measure=None, trust_remote_code: bool = False, progress=None):
    """Load an FP8 artifact as a transformers model in eval mode; `model.mpsconvert` says how.

    device: 'auto' | 'cuda' | 'cuda:N' | 'mps' | 'cpu' (devices.choose: an unavailable device is an
    error, never a fallback). verify: check every file's sha256 against the manifest.
    kernel_cache / measure: passed to KernelPolicy (cache file or False; injected timer).
    """
    from safetensors import safe_open

    path = Path(path)
    dev = devices.choose(device)
    if dev.type == "mps" and not devices.capabilities(dev).fp8_tensors:
        from ..errors import DeviceError

        raise DeviceError(f"this torch ({torch.__version__}) cannot hold float8_e4m3fn tensors on MPS",
                          "upgrade torch (FP8 on MPS needs a recent release), or pass device='cpu'")
    config_path = path / layout.CONFIG_NAME
    if not config_path.is_file():
        raise ArtifactError(f"{path} has no config.json", "pass the folder that `mpsconvert quantize` wrote")
    try:
        qc = json.loads(config_path.read_text(encoding="utf-8")).get("quantization_config")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        if verify:  # a damaged config.json: say what the manifest says about it
            check_artifact(path, check_hashes=True, progress=progress)
        raise ArtifactError(f"{config_path} is not a valid JSON object ({e})", "re-create the artifact") from e
    if not qc:
        raise ArtifactError(f"{path}/config.json has no quantization_config", "this is not an FP8 compressed-tensors checkpoint")
    scheme = scheme_from_config(qc)
    config, model = modeldef.build_from(path, buffers="real", trust_remote_code=trust_remote_code)
    linears, ignored = _linear_layout(model, qc)
    report = check_artifact(path, check_hashes=verify, shapes=linears, ignored=ignored, progress=progress)
    info = LoadInfo(path=str(path), device=str(dev), dtype=str(dtype).replace("torch.", ""), scheme=scheme.name,
                    weights=scheme.weights, verify=report.as_dict())

    resolve = _resolver(model)
    fp8_modules = {resolve(m + ".weight").rpartition(".")[0] for m in report.quantized if resolve(m + ".weight")}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    unexpected, loaded = [], set()
    with devices.oom_hint(dev, "loading the model"):
        for fname in layout.weight_files(path):
            with safe_open(str(path / fname), framework="pt", device="cpu") as f:
                for key in f.keys():
                    target = resolve(key)
                    if target is None:
                        unexpected.append(key)
                        continue
                    t = f.get_tensor(key)
                    mod_name, _, leaf = target.rpartition(".")
                    if mod_name in fp8_modules and leaf in _FP8_PARTS:
                        parts.setdefault(mod_name, {})[leaf] = t
                        continue
                    if t.is_floating_point():
                        t = t.to(dtype)
                    _set_tensor(model, target, t.to(dev))
                    loaded.add(target)
        if unexpected:
            raise ArtifactError(
                f"{len(unexpected)} checkpoint tensors have no place in {type(model).__name__} (e.g. {unexpected[0]})",
                "is config.json the one this checkpoint was made with? (architectures whose keys transformers renames at load are not supported)",
            )
        for mod_name, p in parts.items():
            _install(model, mod_name, p, scheme.activations, dev, dtype, info)
    model.tie_weights()
    for mod in model.modules():  # buffers made at __init__ on CPU (rotary tables, position ids)
        for name, buf in mod._buffers.items():
            if buf is not None and buf.device != dev and buf.device.type != "meta":
                mod._buffers[name] = buf.to(dev)
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if missing:
        raise ArtifactError(f"{len(missing)} tensors of {type(model).__name__} are not in the checkpoint (e.g. {missing[0]})",
                            "the checkpoint is incomplete; re-create it")
    model.eval().requires_grad_(False)
    policy = KernelPolicy(dev, prefill_m=prefill_m, measure=measure, cache=kernel_cache)
    info.kernels = [d.as_dict() for d in policy.apply(model, progress)]
    info.fp8_layers = sum(isinstance(m, FP8Linear) for m in model.modules())
    info.weight_bytes = model_bytes(model)
    model.mpsconvert = info
    return model


def _install(model, mod_name: str, p: dict, activations, dev, dtype, info: LoadInfo) -> None:
    mod = model.get_submodule(mod_name)
    w, scale = p.get("weight"), p.get("weight_scale")
    if w is None or scale is None or w.dtype != FP8_DTYPE:
        raise ArtifactError(f"{mod_name} has an incomplete FP8 weight (weight and weight_scale needed)", "re-create the checkpoint")
    if not isinstance(mod, nn.Linear):  # no FP8 kernel for this module type: dense once, and say so
        _set_tensor(model, mod_name + ".weight", dequantize(w, scale.float(), dtype).to(dev))
        if "bias" in p:
            _set_tensor(model, mod_name + ".bias", p["bias"].to(dev, dtype))
        info.dequantized.append(f"{mod_name} ({type(mod).__name__}: no FP8 kernel, dequantized to {info.dtype} at load)")
        return
    layer = FP8Linear.from_tensors(
        w.to(dev), scale.float().to(dev), activations=activations,
        input_scale=p["input_scale"].float() if "input_scale" in p else None,
        bias=p["bias"] if "bias" in p else None, dtype=dtype,
    )
    parent_name, _, leaf = mod_name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, layer)


def model_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers (tied tensors counted once)."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [m.dense_weight for m in model.modules() if isinstance(m, FP8Linear) and m.dense_weight is not None]
    for t in tensors:
        if t is None or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def _linear_layout(model, qc: dict) -> tuple[dict, set]:
    """The Linear shapes of the model built from config, and which of them the config ignores."""
    from ..targets import matches

    linears = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return linears, {n for n in linears if matches(n, list(qc.get("ignore") or []))}


def verify(path, check_hashes: bool = True, trust_remote_code: bool = False, progress=None):
    """What `mpsconvert verify` checks: every file's sha256 against the manifest, and the
    artifact's consistency with the model its config.json builds. Returns the report."""
    from ..manifests.verify import verify_artifact

    path = Path(path)
    try:
        qc = json.loads((path / layout.CONFIG_NAME).read_text(encoding="utf-8")).get("quantization_config") or {}
        _, model = modeldef.build_from(path, buffers="real", trust_remote_code=trust_remote_code)
        linears, ignored = _linear_layout(model, qc)
    except (OSError, ValueError, MpsconvertError):  # config missing or unreadable: verify_artifact says which
        linears, ignored = None, None
    return verify_artifact(path, check_hashes=check_hashes, shapes=linears, ignored=ignored, progress=progress)
