"""How FP8 scales are laid out: the granularities and the shape of a weight's scale.

Torch-free on purpose: the CLI lists the choices and the manifests check shapes without loading
torch. The FP8 math (fp8.py), the writer, the verifier and the runtime all take the shape rule
from here, so they cannot disagree.
"""

from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    """An enum whose members are their string values (in f-strings, JSON and comparisons), so
    that typed options and the strings in manifests and configs are one and the same."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Granularity(StrEnum):
    """How many weight scales: one per tensor, or one per output row."""

    TENSOR = "tensor"
    ROW = "row"


def scale_shape(granularity: str, n: int, k: int) -> tuple[int, ...]:
    """The stored shape of the dequant scale of an [N, K] weight: [1] per tensor, [N, 1] per row
    (compressed-tensors' `weight_scale`)."""
    g = Granularity(granularity)
    return (1,) if g is Granularity.TENSOR else (n, 1)
