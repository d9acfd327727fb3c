"""`calibrate`: static FP8 input scales measured on real text (calibrate/artifact.py), written into
an artifact (its new manifest and pin returned) or into a scales file for `quantize`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..infra.progress import Progress
from ..manifests.manifest import Manifest

if TYPE_CHECKING:
    from ..calibrate import CalibOptions
    from ..calibrate.calibration import Calibration


@dataclass
class CalibrateResult:
    """Static input scales: the calibration and where its scales were written."""

    calibration: Calibration
    written_to: Path
    into_artifact: bool  # True: the artifact now has the static scheme; False: a scales file
    manifest: Manifest | None = None  # the artifact's new manifest, when written into one
    pin_sha256: str | None = None  # the artifact's new pin (the weights changed: a pin taken before no longer holds)


def calibrate(
    target: str | Path,
    output: str | Path | None,
    options: CalibOptions | None,
    *,
    revision: str | None,
    token: str | None,
    force: bool,
    progress: Progress | None,
) -> CalibrateResult:
    """See api.calibrate."""
    from ..calibrate import CalibOptions
    from ..calibrate.artifact import calibrate_target
    from ..manifests.manifest import read_once

    opts = options or CalibOptions()
    if opts.token is None and token is not None:
        opts = replace(opts, token=token)
    cal, written_to, manifest = calibrate_target(
        target, output, opts, revision=revision, force=force, progress=progress
    )
    return CalibrateResult(
        cal,
        written_to,
        into_artifact=manifest is not None,
        manifest=manifest,
        pin_sha256=read_once(written_to)[2] if manifest is not None else None,
    )
