"""Static FP8 activation scales from real text: data, observers, hooks, device runs, outputs.

`run.calibrate(model_dir, CalibOptions)` -> `Calibration` (module -> input scale, plus the record
kept in the manifest); `artifact` writes them into an artifact or a scales file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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


def for_quantize(scales_file: str | Path | None, options: CalibOptions, progress=None):
    """`quantize --scheme fp8`'s static scales (convert.pipeline.Scales): the snapshot folder ->
    (input scales, their record, the calibration or None), read from `scales_file`, or measured on
    the snapshot with `options`."""

    def scales(folder: Path):
        if scales_file is not None:
            from .artifact import load_scales

            found, record = load_scales(Path(scales_file))
            return found, {**record, "scales_file": str(scales_file)}, None
        from .run import calibrate

        cal = calibrate(folder, options, progress)
        return cal.scales, cal.record, cal

    return scales
