"""What `load` did, and what the loaded model holds: `LoadInfo` (attached to the model as
`model.mpsconvert`), how its FP8 weights are held (e4m3 codes or dequantized) and its bytes counted
once per storage. Kept apart from the load driver (loader.py) so that the report can be read, and
a model measured, without the loading code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...infra import devices
from ..ops.fp8linear import FP8Linear


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
    experts: dict = field(default_factory=dict)  # experts module -> how it is stored and which paths it runs
    # patch name -> its report (runtime/patches: what each changed, left, or skipped)
    patches: dict = field(default_factory=dict)
    prewarm: dict = field(default_factory=dict)  # first-use calls made while the shards were read (CUDA)
    # how the FP8 weights are held once loaded: e4m3 codes, or dequantized, and why
    weights_held: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)  # where the load's time went

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def weights_held(model: nn.Module, dev: torch.device, dtype: torch.dtype) -> dict:
    """How the loaded FP8 weights are held: as e4m3 codes (1 byte per weight) or dequantized
    (2 bytes, as BF16), counted over Linears and MoE experts, and in words where the device
    saves no memory over BF16 (the user must not think otherwise)."""
    from ..ops.fp8_experts import FP8Experts

    linears = [
        m for m in model.modules() if isinstance(m, FP8Linear) and m.group is None
    ]  # a fused group's members are views of its layer
    experts = [m for m in model.modules() if isinstance(m, FP8Experts)]
    out = {
        "e4m3": sum(m.weight is not None for m in linears) + sum(m.gate_up_codes is not None for m in experts),
        "dequantized": sum(m.dense_weight is not None for m in linears)
        + sum(m.gate_up_dense is not None for m in experts),
        "code_dtype": str(devices.capabilities(dev).code_dtype).replace("torch.", ""),
    }
    name = str(dtype).replace("torch.", "")
    if out["dequantized"] and not out["e4m3"] and dev.type == "cpu":
        out["note"] = (
            f"CPU: every FP8 weight is dequantized to {name} once at load (FP8 matmul on CPU is orders of magnitude "
            f"slower), so the model takes as much memory as {name} (more while loading: the codes are read first) and "
            f"runs no faster than it (slower where the scheme rounds activations through e4m3); docs/runtime.md"
        )
    elif out["dequantized"] and not out["e4m3"]:
        out["note"] = (
            f"every FP8 weight is held dequantized in {name} (measured faster here): no memory is saved over {name}"
        )
    elif out["dequantized"]:
        out["note"] = (
            f"{out['dequantized']} of {out['e4m3'] + out['dequantized']} weight groups are held dequantized in {name}"
        )
    return out


def model_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers, each storage counted once (tied tensors, and the
    views fused layers keep of one weight)."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [m.dense_weight for m in model.modules() if isinstance(m, FP8Linear) and m.dense_weight is not None]
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
