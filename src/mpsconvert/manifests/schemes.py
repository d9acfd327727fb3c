"""Quantization schemes as plain config objects (the compressed-tensors way).

A `Scheme` says what is stored (weight granularity) and how activations are treated at run
time (dynamic per token, static per tensor, or left in BF16). The manifest and the
compressed-tensors `quantization_config` are both derived from it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import MpsconvertError

SCHEMES = ("fp8-dynamic", "fp8", "fp8-weight-only")
WEIGHT_GRANULARITIES = ("tensor", "row")
# The default weight granularity of each scheme.
DEFAULT_WEIGHTS = {"fp8-dynamic": "row", "fp8": "tensor", "fp8-weight-only": "row"}


@dataclass(frozen=True)
class Scheme:
    name: str = "fp8-dynamic"
    weights: str = "row"  # "tensor" -> weight_scale [1]; "row" -> weight_scale [N, 1]

    def __post_init__(self):
        if self.name not in SCHEMES:
            raise MpsconvertError(f"unknown scheme {self.name!r}", f"use one of: {', '.join(SCHEMES)}")
        if self.weights not in WEIGHT_GRANULARITIES:
            raise MpsconvertError(
                f"unknown weight granularity {self.weights!r}", f"use one of: {', '.join(WEIGHT_GRANULARITIES)}"
            )

    @classmethod
    def make(cls, name: str, weights: str | None = None) -> "Scheme":
        if name not in SCHEMES:
            raise MpsconvertError(f"unknown scheme {name!r}", f"use one of: {', '.join(SCHEMES)}")
        return cls(name=name, weights=weights or DEFAULT_WEIGHTS[name])

    @property
    def activations(self) -> str | None:
        """'token' (dynamic), 'tensor' (static, calibrated) or None (weight-only)."""
        return {"fp8-dynamic": "token", "fp8": "tensor", "fp8-weight-only": None}[self.name]

    @property
    def needs_calibration(self) -> bool:
        return self.activations == "tensor"

    def as_dict(self) -> dict:
        return asdict(self) | {"activations": self.activations}
