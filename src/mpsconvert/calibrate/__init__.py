"""Static FP8 activation scales from real text: data, observers, hooks, device runs, outputs.

`run.calibrate(model_dir, CalibOptions)` -> `Calibration` (module -> input scale, plus the record
kept in the manifest); `artifact` writes them into an artifact or a scales file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OBSERVERS = ("minmax", "percentile", "mse")
DEFAULT_PERCENTILE = 99.99


@dataclass
class CalibOptions:
    """How to calibrate. Defined here, torch-free: the CLI builds it before `quantize` has checked
    its output, which must come before torch loads."""

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
