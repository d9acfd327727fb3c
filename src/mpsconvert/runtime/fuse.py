"""Fuse FP8 layers that read the same input (q/k/v, gate/up) into one FP8 GEMM.

Why: with dynamic activations each FP8 layer quantizes its input; three layers reading the same
hidden state would quantize it three times and launch three GEMMs. One fused layer quantizes
once and runs one larger GEMM (better tensor-core occupancy, and for decode one GEMV launch).
Concatenation is exact for row-wise scales; per-tensor scales that differ are expanded to rows
(still exact, but the layer then runs row-wise kernels). Static input scales must agree, since
the layers share one input.
"""

from __future__ import annotations

import torch
from torch import nn

from .fp8linear import FP8Linear


def fuse_fp8(layers: list[FP8Linear]) -> FP8Linear:
    first = layers[0]
    if any(l.in_features != first.in_features or l.activations != first.activations or l.dtype != first.dtype for l in layers):
        raise ValueError("only layers with the same input size, activation scheme and dtype can be fused")
    weight = torch.cat([l.weight for l in layers], dim=0)
    scales = [l.weight_scale.float() for l in layers]
    if all(s.numel() == 1 for s in scales) and all(bool(s == scales[0]) for s in scales):
        scale = scales[0].clone()
    else:
        scale = torch.cat([s.reshape(-1, 1).expand(l.out_features, 1) for s, l in zip(scales, layers)], dim=0)
    input_scale = None
    if first.activations == "tensor":
        vals = {float(l.input_scale) for l in layers}
        if len(vals) != 1:
            raise ValueError(f"static input scales differ ({sorted(vals)}); layers sharing an input cannot be fused")
        input_scale = first.input_scale
    biases = [l.bias for l in layers]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(l.out_features, dtype=first.dtype, device=weight.device)
                          for b, l in zip(biases, layers)])
    return FP8Linear.from_tensors(weight, scale, activations=first.activations, input_scale=input_scale, bias=bias, dtype=first.dtype)


class FusedFP8(nn.Module):
    """One FP8 GEMM whose output is split back into the original layers' outputs."""

    def __init__(self, layers: list[FP8Linear]):
        super().__init__()
        self.sizes = [l.out_features for l in layers]
        self.inner = fuse_fp8(layers)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.inner(x).split(self.sizes, dim=-1)
