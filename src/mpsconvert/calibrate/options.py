"""How to calibrate: torch-free, so that the CLI builds it before `quantize` has checked its
output (which must come before torch loads). Its own module so that the package's submodules
import it without importing the package (no cycle)."""

from __future__ import annotations

from dataclasses import dataclass, field

OBSERVERS = ("minmax", "percentile", "mse")
DEFAULT_PERCENTILE = 99.99


@dataclass
class CalibOptions:
    """How to calibrate (`mpsconvert calibrate --help` says what each field does)."""

    data: str | None = None  # file, folder or dataset repo id; None: the built-in set
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    observer: str = "minmax"
    percentile: float = DEFAULT_PERCENTILE
    device: str = "auto"
    sequential: bool = False
    ignore: list[str] = field(default_factory=list)
    trust_remote_code: bool = False
    data_revision: str | None = None
    token: str | None = None
