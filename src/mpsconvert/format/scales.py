"""How FP8 scales are laid out: the granularities and the shape of a weight's scale.

Torch-free on purpose: the CLI lists the choices and the manifests check shapes without loading
torch. The FP8 math (fp8.py), the writer, the verifier and the runtime all take the shape rule
from here, so they cannot disagree.
"""

from __future__ import annotations

import math
import struct
from enum import Enum

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn magnitude (fp8.FP8_MAX)
F32_MAX = 3.4028234663852886e38


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


def scale_problem(value) -> str | None:
    """Why `value` is no usable FP8 dequant multiplier (None: it is one). Scales are stored as
    float32, so it must be finite and > 0 *as float32* (1e308 overflows to inf, 5e-324
    underflows to 0), and the largest value it dequantizes to, 448 x scale, finite in float32
    (a scale of 3e38 passes the first test and turns every code into inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is {type(value).__name__}, not a number"
    try:
        f32 = struct.unpack("<f", struct.pack("<f", float(value)))[0]
    except OverflowError:
        return f"is {value!r}, which overflows float32"
    if not math.isfinite(f32) or f32 <= 0:
        return f"is {value!r}, not a finite positive float32 (it is stored as {f32!r})"
    if f32 * E4M3_MAX > F32_MAX:
        return f"is {value!r}: 448 x scale overflows float32, so its codes would dequantize to inf"
    return None
