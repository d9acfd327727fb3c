"""`quantize`: the conversion (convert/pipeline.py), its static input scales (calibrate), the
Apple exports asked for (apple/flow.py) and an upload (publish/hub.py), called in turn under the
one claim the conversion takes on its output: no other run can write the artifact between its
conversion and what follows it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..convert.pipeline import QuantizeOptions
from ..errors import UploadError
from ..infra.progress import Progress
from ..manifests.manifest import Manifest
from .apple import ByTarget, ExportResult, export_into, written_but
from .publish import UploadOptions, UploadResult, upload

if TYPE_CHECKING:
    from ..calibrate import CalibOptions
    from ..calibrate.calibration import Calibration


@dataclass
class QuantizeResult(ByTarget):
    """A written artifact: where it is and its manifest (with the summary `quantize` prints)."""

    output: Path
    manifest: Manifest
    calibration: Calibration | None = None  # when the fp8 scheme was calibrated in this call
    # target key -> the export asked for (also `result.<key>`)
    apple: dict[str, ExportResult] = field(default_factory=dict)
    # of the manifest file as written: pins everything, until the next step changes it
    manifest_sha256: str | None = None
    pin_sha256: str | None = None  # of the part the conversion sealed: the pin that lasts (`verify --manifest-sha256`)
    upload: UploadResult | None = None  # when it was published to the hub too
    warnings: list[str] = field(default_factory=list)  # e.g. an FP8 source quantized a second time

    @property
    def summary(self) -> dict:
        return self.manifest.summary

    def as_dict(self) -> dict:
        return {
            "output": str(self.output),
            **self.summary,
            "manifest_sha256": self.manifest_sha256,
            "pin_sha256": self.pin_sha256,
            **({"warnings": self.warnings} if self.warnings else {}),
        }


def quantize(
    source: str | Path,
    output: str | Path | None,
    opts: QuantizeOptions,
    *,
    calibration: CalibOptions | None,
    scales_file: str | Path | None,
    exports: dict[str, Any],
    upload_to: UploadOptions | None,
    progress: Progress | None,
) -> QuantizeResult:
    """See api.quantize (`opts`: its conversion settings; `upload_to`: its upload, when asked for)."""
    from ..apple import flow
    from ..calibrate import CalibOptions
    from ..convert import pipeline
    from ..manifests.manifest import read_once

    if upload_to is not None:  # a bad repo id or offline mode: said before the conversion, not after
        from ..publish import hub

        hub.check_upload(upload_to.repo)
    copts = replace(
        calibration or CalibOptions(),
        ignore=list(opts.ignore),
        trust_remote_code=opts.trust_remote_code,
        token=(calibration.token if calibration is not None else None) or opts.token,
    )
    given = {
        "`data`": calibration is not None and calibration.data is not None,  # the settings only scheme fp8 takes
        "`scales_file`": scales_file is not None,
    }
    uploaded = None
    with pipeline.claimed(
        source, output, opts, calibration_given=given, exports=tuple(exports), progress=progress
    ) as run:
        flow.require_all(exports)  # the extras the exports need, before any work
        run.resolve()
        run.prepare()
        scales = None
        if run.needs_scales:
            from ..calibrate.static_scales import for_quantize

            scales = for_quantize(scales_file, copts, run.snap.path, progress)
        done = run.write(scales)
        apple = export_into(done.output, exports, progress)
        if upload_to is not None:
            retry = f"run `mpsconvert upload {done.output} {upload_to.repo}` to retry"
            with written_but(done.output, "its upload", retry, UploadError):
                uploaded = upload(done.output, upload_to, progress=progress)
    done.manifest, sha, pinned = read_once(done.output)  # as the exports and the upload left it
    # what the conversion wrote (output, manifest, calibration, warnings), and what followed it
    return QuantizeResult(**vars(done), apple=apple, manifest_sha256=sha, pin_sha256=pinned, upload=uploaded)
