"""`quantize --scheme fp8`'s static scales, torch-free: the CLI and the API take this function
before quantize has checked its output (before torch loads); the work it hands back runs later.
A module of its own, not the package's __init__: the package face imports none of its modules
(tests/test_architecture.py's cycle check)."""

from __future__ import annotations

from pathlib import Path

from .options import CalibOptions


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
