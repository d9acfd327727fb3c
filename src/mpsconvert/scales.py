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
    """How many weight scales: one per tensor, one per output row, or one per square block of
    `block` x `block` weights (the layout of the hub's FP8 releases, DeepSeek-V3, Qwen3-FP8)."""

    TENSOR = "tensor"
    ROW = "row"
    BLOCK = "block"


# The block edge of the hub's block-scaled FP8 checkpoints and of compressed-tensors' FP8_BLOCK.
DEFAULT_BLOCK = 128


def blocks(n: int, block: int) -> int:
    """How many blocks of `block` cover `n` (the last one partial when `block` does not divide it)."""
    return -(-n // block)


def scale_shape(granularity: str, n: int, k: int, block: int = DEFAULT_BLOCK) -> tuple[int, ...]:
    """The stored shape of the dequant scale of an [N, K] weight: [1] per tensor, [N, 1] per row,
    [ceil(N/b), ceil(K/b)] per block (compressed-tensors' `weight_scale`; edge blocks are partial)."""
    g = Granularity(granularity)
    if g is Granularity.TENSOR:
        return (1,)
    if g is Granularity.ROW:
        return (n, 1)
    return (blocks(n, block), blocks(k, block))
