"""Checking an artifact and publishing it: `verify` (the manifest's hashes and structure, and the
model built weightless where the manifest does not vouch for config.json: the runtime's loader)
and `upload` (publish/hub.py, the artifact verified first)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..infra.progress import Progress
from ..publish.hub import UploadOptions

if TYPE_CHECKING:
    from ..manifests.verify import VerifyReport


@dataclass(frozen=True)
class VerifyOptions:
    """How an artifact is checked (see api.verify): every file hashed or the structure only, whether code in
    it may build its model, and the sha256 its manifest must have."""

    check_hashes: bool = True
    trust_remote_code: bool = False
    manifest_sha256: str | None = None


def verify(
    artifact: str | Path, opts: VerifyOptions = VerifyOptions(), progress: Progress | None = None
) -> VerifyReport:
    """See api.verify."""
    from ..infra import atomic
    from ..manifests.verify import verify_artifact

    artifact = Path(artifact)
    atomic.recover(artifact)
    report = verify_artifact(
        artifact, check_hashes=opts.check_hashes, progress=progress, manifest_sha256=opts.manifest_sha256
    )
    # only then torch and transformers: an artifact whose manifest vouches for it is JSON and headers
    if report.needs_model:
        from ..runtime.load.model_check import check_built_model

        check_built_model(artifact, report, trust_remote_code=opts.trust_remote_code)
    return report


@dataclass
class UploadResult:
    """What went to the hub: repo, its URL, the commit and its message, every file sent."""

    repo: str
    url: str
    revision: str
    commit: str | None
    commit_message: str
    private: bool  # the repo's visibility as the hub reports it after the upload
    endpoint: str
    files: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def upload(
    artifact: str | Path, to: UploadOptions, progress: Progress | None = None, check: Callable | None = verify
) -> UploadResult:
    """See api.upload; `check`: how the artifact is verified first (`verify`; None: it is not)."""
    from ..publish import hub

    up = hub.upload(Path(artifact), to, verify=(lambda a: check(a, progress=progress)) if check else None)
    return UploadResult(**up)
