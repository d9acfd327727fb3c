"""`quantize --scheme fp8`'s static scales, torch-free to import: read from a scales file, or
measured on the resolved source (workflows/quantize.py calls it between the conversion's steps).
A module of its own, not the package's __init__: the package face imports none of its modules
(tests/test_architecture.py's cycle check)."""

from __future__ import annotations

from pathlib import Path

from .options import CalibOptions


def for_quantize(scales_file: str | Path | None, options: CalibOptions, folder: Path, progress=None):
    """`quantize --scheme fp8`'s static scales (convert.pipeline.Scales): (input scales, their
    record, the calibration or None), read from `scales_file`, or measured on the snapshot
    `folder` with `options`."""
    if scales_file is not None:
        from .artifact import load_scales

        found, record = load_scales(Path(scales_file))
        return found, {**record, "scales_file": str(scales_file)}, None
    from .calibration import calibrate

    cal = calibrate(folder, options, progress)
    return cal.scales, cal.record, cal
