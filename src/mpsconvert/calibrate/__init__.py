"""Static FP8 activation scales from real text: data, observers, hooks, device runs, outputs.

`run.calibrate(model_dir, CalibOptions)` -> `Calibration` (module -> input scale, plus the record
kept in the manifest); `artifact` writes them into an artifact or a scales file.
"""

from __future__ import annotations

from .options import DEFAULT_PERCENTILE, OBSERVERS, CalibOptions  # noqa: F401  (the package's public names)
