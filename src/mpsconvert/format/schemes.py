"""Quantization schemes as typed config objects (the compressed-tensors way).

A `Scheme` says what is stored (the weight scale granularity) and how activations are treated
at run time (quantized per token at run time, static per tensor from calibration, or left in
BF16). The manifest's recipe and the compressed-tensors `quantization_config` are both derived
from it, and `scale_shape` is the one rule for the shape of a weight's scale.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MpsconvertError
from .scales import DEFAULT_BLOCK, Granularity, StrEnum, scale_shape


class Activations(StrEnum):
    """How a quantized Linear's input is treated: per token at run time, or one calibrated scale."""

    TOKEN = "token"  # dynamic, per token
    GROUP = "group"  # dynamic, per token and group of `block` input features (FP8_BLOCK's 1 x 128)
    TENSOR = "tensor"  # static, per tensor (calibrated)


SCHEMES = ("fp8-dynamic", "fp8", "fp8-weight-only")
WEIGHT_GRANULARITIES = tuple(g.value for g in Granularity)
# What each scheme does to activations (None: they stay BF16), and its default weight granularity.
_ACTIVATIONS = {"fp8-dynamic": Activations.TOKEN, "fp8": Activations.TENSOR, "fp8-weight-only": None}
DEFAULT_WEIGHTS = {"fp8-dynamic": Granularity.ROW, "fp8": Granularity.TENSOR, "fp8-weight-only": Granularity.ROW}


def _unknown_scheme(name) -> MpsconvertError:
    return MpsconvertError(f"unknown scheme {name!r}", f"use one of: {', '.join(SCHEMES)}")


@dataclass(frozen=True)
class Scheme:
    """An FP8 scheme: `name` (fp8-dynamic | fp8 | fp8-weight-only), the weight granularity and,
    for block weights, the block edge (square blocks, as compressed-tensors' FP8_BLOCK)."""

    name: str = "fp8-dynamic"
    weights: Granularity = Granularity.ROW
    block_size: int = DEFAULT_BLOCK

    def __post_init__(self):
        if self.name not in SCHEMES:
            raise _unknown_scheme(self.name)
        try:
            object.__setattr__(self, "weights", Granularity(self.weights))
        except ValueError:
            raise MpsconvertError(
                f"unknown weight granularity {self.weights!r}", f"use one of: {', '.join(WEIGHT_GRANULARITIES)}"
            ) from None
        if (
            not isinstance(self.block_size, int)
            or isinstance(self.block_size, bool)
            or not 1 <= self.block_size <= 4096
        ):
            raise MpsconvertError(
                f"block size {self.block_size!r} is not a whole number from 1 to 4096",
                f"pass `block_size={DEFAULT_BLOCK}` (the hub's FP8 releases) or a smaller square size",
            )

    @classmethod
    def make(cls, name: str, weights: str | None = None, block_size: int | None = None) -> "Scheme":
        """The scheme `name` with `weights` granularity, or the scheme's default one."""
        if name not in SCHEMES:
            raise _unknown_scheme(name)
        return cls(
            name=name,
            weights=weights or DEFAULT_WEIGHTS[name],
            block_size=DEFAULT_BLOCK if block_size is None else block_size,
        )

    @property
    def block(self) -> int | None:
        """The block edge of block-scaled weights, None for the other granularities."""
        return self.block_size if self.weights is Granularity.BLOCK else None

    @property
    def activations(self) -> Activations | None:
        """TOKEN (dynamic), GROUP (dynamic, per token and block of K: block weights), TENSOR
        (static, calibrated) or None (weight-only)."""
        acts = _ACTIVATIONS[self.name]
        return Activations.GROUP if acts is Activations.TOKEN and self.block else acts

    @property
    def needs_calibration(self) -> bool:
        return self.activations is Activations.TENSOR

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        """The shape of `<m>.weight_scale` for an [N, K] weight."""
        return scale_shape(self.weights, n, k, self.block_size)

    def experts_scale_shape(self, e: int, n: int, k: int) -> tuple[int, ...]:
        """The shape of `<p>_scale` for fused experts [E, N, K]: [E, 1, 1], [E, N, 1] or
        [E, ceil(N/b), ceil(K/b)]."""
        s = self.scale_shape(n, k)
        return (e, *s) if len(s) == 2 else (e, 1, 1)

    def as_dict(self) -> dict:
        d = {
            "name": self.name,
            "weights": self.weights.value,
            "activations": self.activations.value if self.activations else None,
        }
        if self.block:
            d["block_size"] = self.block
        return d
