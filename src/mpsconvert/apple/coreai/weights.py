"""FP8 weights as Core AI stores them natively: `f8E4M3FN` constants and their scales.

Each FP8 Linear of the artifact becomes `Fp8Linear`: its codes (float8_e4m3fn, the artifact's
bytes) and scale are buffers, and the weight is `coreai::constexpr_blockwise_shift_scale(codes,
scale)` (coreai-torch's custom op, lowered to `coreai.blockwise_shift_scale`), so the asset holds
one byte per weight and the dequantization is the runtime's. The scale only has to have the
weight's rank with every dimension dividing the weight's: per tensor `[1, 1]`, per row `[N, 1]`,
per block `[N / bn, K / bk]`, so `blockwise_scale` is the one place that knows about scale
shapes here and block scales plug in through it.

The Core AI runtime wants the scale in the dtype the weight is dequantized to (an fp32 scale
with an fp16 result gives NaNs or aborts the process in coreai-core 1.0.0b3). With fp16 compute
the scale is stored in fp16: a relative rounding of at most 2**-11, far below e4m3's own 2**-4.
A scale too small for a normal fp16 (< 2**-14, where fp16 loses precision) is stored times 2**k
(exact: a power of two) and the Linear's output is multiplied by 2**-k.
"""

from __future__ import annotations

import math

import torch

from ...errors import ExportError

_FP16_MIN_NORMAL = 2.0**-14
# |e4m3| <= 448: a shifted fp16 weight must stay well inside fp16's 65504.
_FP16_MAX_WEIGHT = 2.0**15


def blockwise_scale(scale: torch.Tensor, weight_shape: tuple[int, ...]) -> torch.Tensor:
    """The artifact's `weight_scale` in the layout `blockwise_shift_scale` takes: the weight's
    rank, each dimension dividing the weight's. `[1]` or `[]` -> `[1, 1]`; `[N, 1]` as is; a 2-D
    block scale `[ceil(N/bn), ceil(K/bk)]` as is when the blocks tile the weight exactly.

    Raises:
        ExportError: the scale's shape does not tile the weight.
    """
    rank = len(weight_shape)
    s = scale.reshape([1] * rank) if scale.numel() == 1 else scale
    if s.ndim != rank or any(w % d for w, d in zip(weight_shape, s.shape)):
        raise ExportError(
            f"a weight scale of shape {list(scale.shape)} does not tile the weight {list(weight_shape)}",
            "Core AI needs per-tensor, per-row or whole-block scales; re-quantize with `weights=row` or tensor",
        )
    return s


def fp16_shift(scale: torch.Tensor) -> int:
    """k such that scale x 2**k is a normal fp16 number for every row that is not all zero
    (0 when no shift is needed), while the largest weight x 2**k stays below 2**15."""
    s = scale.float().flatten()
    live = s[s > 1e-11]  # all-zero rows carry the 1e-12 floor: their codes are 0 whatever the scale
    if live.numel() == 0:
        return 0
    lo, hi = float(live.min()), float(live.max())
    if lo >= _FP16_MIN_NORMAL:
        return 0
    k = math.ceil(math.log2(_FP16_MIN_NORMAL / lo))
    if hi * 448.0 * 2.0**k > _FP16_MAX_WEIGHT:
        raise ExportError(
            f"the weight scales span {lo:.3g}..{hi:.3g}, too wide for fp16",
            "export with `compute=fp32`",
        )
    return k


class Fp8Linear(torch.nn.Module):
    """A Linear whose weight is the artifact's FP8 codes x scale, dequantized by Core AI.

    Args:
        linear: the nn.Linear it replaces (its bias is kept, in `dtype`).
        codes: float8_e4m3fn [N, K], the artifact's bytes.
        scale: the artifact's fp32 weight_scale.
        dtype: the compute dtype (torch.float16 or torch.float32).
    """

    def __init__(self, linear: torch.nn.Linear, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        s = blockwise_scale(scale.float(), tuple(codes.shape))
        self.shift = fp16_shift(s) if dtype == torch.float16 else 0
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scale", (s * 2.0**self.shift).to(dtype).contiguous())
        self.bias = (
            None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)
        )
        self.dtype = dtype
        self.in_features, self.out_features = codes.shape[1], codes.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.ops.coreai.constexpr_blockwise_shift_scale(self.codes, self.scale, None, None, None, self.dtype)
        y = torch.nn.functional.linear(x, w)
        if self.shift:
            y = y * (2.0**-self.shift)
        return y if self.bias is None else y + self.bias


def swap_fp8_linears(model: torch.nn.Module, fp8_weights: dict, dtype: torch.dtype) -> dict[str, dict]:
    """Replace every nn.Linear whose weight is an FP8 tensor of the artifact with `Fp8Linear`.

    Returns:
        tensor name -> how it is stored (scale shape and dtype, the fp16 shift).

    Raises:
        ExportError: an FP8 tensor is not the weight of an nn.Linear of the model (e.g. fused
            MoE experts, which transformers keeps as 3-D parameters).
    """
    from .session import coreai_torch

    coreai_torch()
    import coreai_torch._compression.custom_layers  # noqa: F401, F811  (registers the coreai:: custom ops)

    modules = dict(model.named_modules())
    prefix = getattr(model, "base_model_prefix", "") or ""
    record: dict[str, dict] = {}
    for name, (codes, scale) in fp8_weights.items():
        mname = name[: -len(".weight")] if name.endswith(".weight") else None
        cands = [mname, f"{prefix}.{mname}" if mname and prefix else None]
        if mname and prefix and mname.startswith(prefix + "."):
            cands.append(mname[len(prefix) + 1 :])
        target = next((c for c in cands if c and isinstance(modules.get(c), torch.nn.Linear)), None)
        if target is None:
            raise ExportError(
                f"FP8 tensor {name} is not the weight of an nn.Linear of {type(model).__name__}",
                "Core AI export keeps FP8 weights of Linear layers; this architecture stores them differently",
            )
        parent, _, child = target.rpartition(".")
        layer = Fp8Linear(modules[target], codes, scale, dtype)
        setattr(modules[parent] if parent else model, child, layer)
        record[name] = {
            "module": target,
            "scale_shape": list(layer.scale.shape),
            "scale_dtype": str(dtype).replace("torch.", ""),
            "fp16_shift": layer.shift,
        }
    return record


def _dequantized(param: str):
    def get(self):
        return torch.ops.coreai.constexpr_blockwise_shift_scale(
            getattr(self, f"{param}_codes"), getattr(self, f"{param}_scale"), None, None, None, self.fp8_dtype
        )

    return property(get)


_EXPERT_CLASSES: dict[type, type] = {}


def _fp8_experts_class(cls: type) -> type:
    """`cls` with its fused expert parameters read as Core AI dequantizations of FP8 buffers."""
    if cls not in _EXPERT_CLASSES:
        _EXPERT_CLASSES[cls] = type(
            f"Fp8{cls.__name__}",
            (cls,),
            {"gate_up_proj": _dequantized("gate_up_proj"), "down_proj": _dequantized("down_proj")},
        )
    return _EXPERT_CLASSES[cls]


def swap_fp8_experts(model: torch.nn.Module, fp8_experts: dict, dtype: torch.dtype) -> dict[str, dict]:
    """Fused MoE experts (transformers 5's `experts.gate_up_proj [E, 2I, H]` / `down_proj`) read
    their weights from FP8 codes [E, N, K] and per-row scales [E, N, 1] through
    `blockwise_shift_scale` (3-D works as 2-D does), so they too stay f8E4M3FN in the asset.

    Returns:
        parameter name -> how it is stored.
    """
    from .session import coreai_torch

    coreai_torch()
    import coreai_torch._compression.custom_layers  # noqa: F401, F811  (registers the coreai:: custom ops)

    record = {}
    by_module: dict[str, dict] = {}
    for name, (codes, scale, keys) in fp8_experts.items():
        mod_name, _, param = name.rpartition(".")
        by_module.setdefault(mod_name, {})[param] = (codes, scale, keys)
    for mod_name, params in by_module.items():
        mod = model.get_submodule(mod_name)
        if set(params) != {"gate_up_proj", "down_proj"}:
            raise ExportError(
                f"MoE experts {mod_name} have FP8 weights for {sorted(params)} only",
                "Core AI export needs both gate_up_proj and down_proj in FP8, or neither",
            )
        for param, (codes, scale, keys) in params.items():
            s = blockwise_scale(scale.float(), tuple(codes.shape))
            shift = fp16_shift(s) if dtype == torch.float16 else 0
            if shift:
                raise ExportError(
                    f"MoE experts {mod_name}.{param} have scales below fp16's normal range",
                    "export with `compute=fp32`",
                )
            del mod._parameters[param]
            mod.register_buffer(f"{param}_codes", codes.contiguous())
            mod.register_buffer(f"{param}_scale", s.to(dtype).contiguous())
            record[f"{mod_name}.{param}"] = {
                "module": mod_name,
                "scale_shape": list(s.shape),
                "scale_dtype": str(dtype).replace("torch.", ""),
                "fp16_shift": 0,
                "artifact_tensors": len(keys),
            }
        mod.fp8_dtype = dtype
        mod.__class__ = _fp8_experts_class(type(mod))
    return record
