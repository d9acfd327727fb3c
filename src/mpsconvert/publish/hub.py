"""An artifact -> a Hugging Face hub repo, with huggingface_hub (`create_repo`, `create_commit`).

Where a model goes, as source.py is where it comes from. The artifact is verified first (every
sha256 against the manifest: a damaged artifact is never published), the repo is created if it
is not there (`private` as asked), and the listed files go up in one commit whose message names
the scheme and the source commit. What is sent is what was verified: each file is opened once
(no link followed), hashed as it is read and handed to huggingface_hub as those bytes (or, for a
weight file, as that open file, hashed again as it is sent: `hashing.VerifiedReader`), never as
a path it would open again. The card and the manifest that name the repo are written into a
staged copy of the artifact, the upload is sent from it, and it replaces the artifact only once
the hub took the commit: a failed upload changes nothing local. `HF_TOKEN` and `HF_ENDPOINT`
are read when the upload runs (not when huggingface_hub was imported), and offline mode
(`HF_HUB_OFFLINE`) is a one-line error before any request.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import MpsconvertError, UploadError
from ..infra.untrusted import one_line
from ..manifests.hashing import read_verified
from ..manifests.manifest import MANIFEST_NAME, Manifest, read_raw
from ..version import __version__

_TRUE = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class UploadOptions:
    """Where an artifact goes (see api.upload): the hub repo, whether it is created private, the write
    token [default: HF_TOKEN, else the stored login] and the branch [default: main]; built once by the
    API and handed down to the commit."""

    repo: str
    private: bool = False
    token: str | None = None
    revision: str | None = None


_REPO_ID = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.\-]*/)?[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def commit_message(manifest: Manifest) -> str:
    """'FP8 fp8-dynamic (weights per row) of org/name@<commit>, by mpsconvert 0.1.0': one line,
    control characters removed (the source's id is a folder name or a repo id: untrusted)."""
    src, r = manifest.source, manifest.recipe
    where = str(src.get("id") or "a local model")
    where += (
        f"@{src['commit']}"
        if src.get("commit")
        else (f"@{src['revision']}" if src.get("revision") else " (local, no commit)")
    )
    return one_line(f"FP8 {r.get('name')} (weights per {r.get('weights')}) of {where}, by mpsconvert {__version__}")


_CHANGED = "nothing was uploaded; verify the artifact, and upload again once nothing else writes it"


def sendable(folder: Path) -> tuple[Manifest, list]:
    """(the manifest, one `CommitOperationAdd` per file it lists and for itself) for `folder`:
    the manifest's bytes read once, parsed and sent as read; every listed file opened once
    without following a link (`hashing.read_verified`) and refused unless it matches its sha256
    there. Unlisted files (a user's notes, a link planted in the folder) are never sent."""
    import huggingface_hub as hf

    folder = Path(folder)
    manifest, raw, _ = read_raw(folder)
    ops = [hf.CommitOperationAdd(path_in_repo=MANIFEST_NAME, path_or_fileobj=raw)]
    try:
        for rel in sorted(manifest.files):
            want = manifest.files[rel]
            data = read_verified(folder, rel, want, _CHANGED)
            op = hf.CommitOperationAdd(path_in_repo=rel, path_or_fileobj=data)
            ops.append(op)
            if op.upload_info.sha256.hex() != want["sha256"]:  # what huggingface_hub will announce to the hub
                raise UploadError(
                    f"{rel} does not match the sha256 in {MANIFEST_NAME} (changed after it was verified)", _CHANGED
                )
    except BaseException:
        for op in ops:
            if hasattr(op.path_or_fileobj, "close"):
                op.path_or_fileobj.close()
        raise
    return manifest, ops


def upload_folder(folder: Path, to: UploadOptions) -> dict:
    """Create `to.repo` (if absent) and upload the files the artifact's manifest lists, and the
    manifest, in one commit, as the bytes `sendable` verified (the caller holds the artifact's
    lock); returns what api.UploadResult holds (repo, url, revision, commit, commit_message,
    private, endpoint, files).

    Raises:
        UploadError: offline mode, no network, no (write) token, the hub refused it.
        ArtifactError: `folder` is not an artifact, or a file does not match its sha256.
    """
    folder = Path(folder)
    _not_offline(to.repo)
    import huggingface_hub as hf
    from huggingface_hub import errors as hf_errors

    endpoint = (os.environ.get("HF_ENDPOINT") or hf.constants.ENDPOINT).rstrip("/")
    api = hf.HfApi(endpoint=endpoint, token=to.token or os.environ.get("HF_TOKEN") or None)
    manifest, ops = sendable(folder)
    msg = commit_message(manifest)
    files = sorted(op.path_in_repo for op in ops)
    try:
        return _send(api, ops, to, msg, files, endpoint=endpoint, hf_errors=hf_errors)
    finally:
        for op in ops:
            if hasattr(op.path_or_fileobj, "close"):
                op.path_or_fileobj.close()


def _send(api, ops: list, to: UploadOptions, msg: str, files: list[str], *, endpoint: str, hf_errors) -> dict:
    """Create the repo and send the commit; the hub's and the network's failures as one line."""
    repo, private, revision = to.repo, to.private, to.revision
    try:
        url = api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
        # An existing repo keeps its visibility (create_repo leaves it as it is): what it really
        # is gets reported, and --private never sends an artifact into a public repo.
        is_private = bool(api.model_info(repo, expand=["private"]).private)
        if private and not is_private:
            raise UploadError(
                f"{repo} already exists and is public, so `private` does not apply to it; nothing was uploaded",
                "make the repo private on the hub first (its Settings), or upload without `private`",
            )
        info = api.create_commit(repo_id=repo, repo_type="model", revision=revision, commit_message=msg, operations=ops)
    except hf_errors.OfflineModeIsEnabled as e:
        raise _offline_error(repo) from e
    except hf_errors.HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        url_ = str(getattr(getattr(e.response, "request", None), "url", "") or "")
        raise http_failure(status, str(e).splitlines()[0][:160], url_, endpoint, repo) from e
    except MpsconvertError:
        raise
    except Exception as e:
        if (
            ours := _ours_in(e)
        ) is not None:  # a file that changed while it was sent, wrapped by huggingface_hub's workers
            raise ours from e
        if not _is_transport_error(e):
            raise
        # hf_xet reports an HTTP answer as a "network error": an answer is not an unreachable hub
        if m := _HTTP_IN_MESSAGE.search(str(e)):
            raise http_failure(int(m.group(1)), f"{m.group(1)} {m.group(2)}", m.group(3) or "", endpoint, repo) from e
        raise UploadError(
            f"cannot reach {endpoint} to upload {repo} ({type(e).__name__}: {str(e)[:120]})",
            "check the network, or HF_ENDPOINT",
        ) from e
    return dict(
        repo=repo,
        url=str(url),
        revision=revision or "main",
        commit=getattr(info, "oid", None),
        commit_message=msg,
        private=is_private,
        endpoint=endpoint,
        files=files,
    )


# "HTTP status client error (404 Not Found), domain: http://host/api/models/me/x/xet-write-token/main"
_HTTP_IN_MESSAGE = re.compile(r"HTTP status [a-z ]*error \((\d{3}) ([^)]*)\)(?:.*?(https?://\S+))?")


def http_failure(status: int | None, detail: str, url: str, endpoint: str, repo: str) -> UploadError:
    """What an HTTP answer of the hub means for this upload, as one line and its fix."""
    where = f" ({url.removeprefix(endpoint)})" if url.startswith(endpoint) else ""
    if status in (401, 403):
        return UploadError(
            f"the hub at {endpoint} refused the upload to {repo} ({status}: {detail}){where}",
            "pass a write token (`token` or HF_TOKEN) that may write to that repo or organization",
        )
    if status == 404 and "xet" in url:
        return UploadError(
            f"the hub at {endpoint} does not serve Xet storage (404 for its write token{where}), which huggingface_hub "
            "uploads through by default",
            "set HF_HUB_DISABLE_XET=1 to upload through the LFS path this hub speaks",
        )
    if status == 404:
        return UploadError(
            f"the hub at {endpoint} answered 404 Not Found{where}: it has no such repo or endpoint for {repo}",
            "check the repo name and your rights on it, and that HF_ENDPOINT is a Hugging Face hub",
        )
    if status == 409:
        return UploadError(
            f"the hub at {endpoint} refused the upload to {repo}: a conflict (409: {detail}){where}",
            "check the repo name and `revision`",
        )
    return UploadError(
        f"the hub at {endpoint} refused the upload to {repo} ({status}: {detail}){where}",
        "retry, or check the hub's status",
    )


def _ours_in(e: BaseException) -> MpsconvertError | None:
    """An MpsconvertError that `e` was raised from (its causes and contexts), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, MpsconvertError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _is_transport_error(e: BaseException) -> bool:
    """A network failure (DNS, refused connection, TLS, timeout) from whichever HTTP client
    huggingface_hub uses (its versions moved from requests to httpx and on): judged by the
    exception's classes, not by importing a client."""
    names = {c.__name__ for c in type(e).__mro__}
    return isinstance(e, (OSError, ConnectionError)) or bool(
        names & {"TransportError", "ConnectError", "TimeoutException", "NetworkError", "ConnectionError", "Timeout"}
    )


def _offline_error(repo: str) -> UploadError:
    """Offline mode as the one-line error of an upload to `repo`: said before any request
    (`_not_offline`), and where huggingface_hub refuses a request for it."""
    return UploadError(
        f"cannot upload to {repo}: Hugging Face offline mode is on (HF_HUB_OFFLINE)",
        "unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) to upload",
    )


def _not_offline(repo: str) -> None:
    """Offline mode (`offline`) as the one-line error of an upload to `repo`, before any request."""
    if offline():
        raise _offline_error(repo)


def check_repo_id(repo: str) -> str:
    """`name` or `org/name` as the hub accepts it, else a one-line error (before any work)."""
    if not isinstance(repo, str) or not _REPO_ID.match(repo) or len(repo) > 96 or ".." in repo:
        raise UploadError(f"{repo!r} is not a hub repo id", "use org/name (or your-user-name/name)")
    return repo


def check_upload(repo: str, what: str = "`upload_repo`") -> None:
    """Said before any work: a repo id the hub would refuse, or offline mode (then nothing can go up)."""
    check_repo_id(repo)
    if offline():
        raise UploadError(
            f"{what} {repo} needs the hub, and Hugging Face offline mode is on (HF_HUB_OFFLINE)",
            "unset HF_HUB_OFFLINE, or drop `upload_repo` and run `mpsconvert upload` later",
        )


def upload(artifact: Path, to: UploadOptions, *, verify: Callable[[Path], object] | None = None) -> dict:
    """Publish an artifact (see api.upload): under its lock, `verify(artifact)` (a report with
    `ok` and `problems`: a damaged artifact is never uploaded); in one transaction, the card
    rewritten to name the repo (the manifest's `hub` record) in the staged copy, the staged copy
    sent in one commit, and swapped in only once the commit succeeded. Returns what
    `upload_folder` returns."""
    from ..errors import ArtifactError
    from ..infra import atomic
    from ..manifests import layout
    from ..manifests.records import Hub
    from ..manifests.transaction import transaction

    artifact = Path(artifact)
    check_repo_id(to.repo)
    if not layout.is_artifact(artifact):
        raise ArtifactError(
            f"{artifact} is not an mpsconvert artifact (no {layout.MANIFEST_NAME})",
            "pass the folder `mpsconvert quantize` wrote",
        )
    _not_offline(to.repo)  # before any work
    with atomic.claim(artifact):  # nothing changes the artifact between its check and the commit
        if verify is not None:
            report = verify(artifact)
            if not report.ok:
                raise ArtifactError(
                    f"{artifact} fails verification ({report.problems[0]}{' ...' if len(report.problems) > 1 else ''})",
                    "re-create the artifact; a damaged one is never uploaded",
                )
        with transaction(artifact) as t:
            t.put(Hub(repo=to.repo))
            # The card and the manifest naming the repo go into the staged copy, the upload is
            # sent from it, and it replaces the artifact only if the hub took the commit.
            return upload_folder(t.stage(), to)
