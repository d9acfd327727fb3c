"""Static FP8 activation scales from real text: data, observers, hooks, device runs, outputs.

`run.calibrate(model_dir, CalibOptions)` -> `Calibration` (module -> input scale, plus the record
kept in the manifest); `artifact` writes them into an artifact or a scales file.
"""

from __future__ import annotations

from pathlib import Path

from .options import DEFAULT_PERCENTILE, OBSERVERS, CalibOptions  # noqa: F401  (the package's public names)


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
