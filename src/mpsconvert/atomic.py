"""Outputs appear whole or not at all: build under a temporary name beside the target, then rename.

A lock beside the target stops two runs from writing the same output at once. Temporary
folders left by a run that was killed (SIGKILL cannot be caught) carry the `.mpsconvert-tmp-`
prefix, so they never look like a finished artifact, and the next run into that target removes
them. Disk-full and permission errors are reported as such, with the partial output removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from .errors import MpsconvertError

TMP_PREFIX = ".mpsconvert-tmp-"
LOCK_PREFIX = ".mpsconvert-lock-"
# Set by the CLI's SIGINT/SIGTERM handlers. The KeyboardInterrupt they raise can be lost when it
# lands in a finalizer or a weakref callback (CPython ignores exceptions there), so the commit
# step checks this too: an output is never published after the user asked to stop.
stop_requested = threading.Event()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class BackgroundSync:
    """Runs fsyncs on a thread of their own, so that one file's flush to disk overlaps the work
    on the next; `wait` (before the rename that publishes them) re-raises any failure."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpsconvert-fsync")
        self._jobs: list[Future] = []

    def add(self, fn: Callable[[], None]) -> None:
        self._jobs.append(self._pool.submit(fn))

    def wait(self) -> None:
        try:
            for job in self._jobs:
                job.result()
        finally:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> "BackgroundSync":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.wait()
        else:  # the error being raised matters more than a failed flush of a file about to go
            self._pool.shutdown(wait=True, cancel_futures=True)


def os_error(e: OSError, where: Path) -> MpsconvertError:
    """A clear message for the OS errors a user can act on."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return MpsconvertError(f"the disk holding {where} is full (partial output removed)", "free some space or choose another -o")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return MpsconvertError(f"cannot write to {where}: {e.strerror}", "choose a writable -o")
    return MpsconvertError(f"writing {where} failed: {e.strerror or e}", "check the output location and retry")


@contextlib.contextmanager
def locked(target: Path):
    """Hold an exclusive lock for `target` (a file beside it); a second holder fails at once."""
    lock = target.parent / f"{LOCK_PREFIX}{target.name}"
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise os_error(e, target.parent) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise MpsconvertError(
                f"another mpsconvert run is writing {target} right now", "wait for it to finish, or choose another -o"
            ) from None
        # The lock file may have been unlinked by the previous holder between open and flock.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


def _recover(target: Path) -> None:
    """Clean up after a killed run into `target` (we hold its lock, so nobody else is writing)."""
    parent = target.parent
    for p in parent.glob(f"{TMP_PREFIX}{target.name}-*"):
        if p.name.endswith("-old") and not target.exists():
            os.replace(p, target)  # killed between the two renames of a --force: put the old one back
        elif p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def output_dir(target: Path, force: bool = False, min_free: int = 0):
    """Yield a fresh temporary folder beside `target`; on success it becomes `target`.

    On any error (or Ctrl-C / SIGTERM) the temporary folder is removed and `target` is
    untouched. An existing `target` is replaced only with `force=True`, and only after the new
    one is complete. `min_free`: bytes the output needs, checked before anything is written.
    """
    target = Path(target).absolute()
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error(e, parent) from e
    with locked(target):
        _recover(target)
        if target.exists() and not force:
            raise MpsconvertError(f"output {target} already exists", "pass --force to replace it, or choose another -o")
        free = shutil.disk_usage(parent).free
        if min_free and free < min_free:
            raise MpsconvertError(
                f"not enough disk space for {target}: needs about {min_free / 1e9:.2f} GB, {free / 1e9:.2f} GB free",
                "free some space or choose another -o",
            )
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-", dir=parent))
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; a finished artifact gets normal permissions
        except OSError as e:
            raise os_error(e, parent) from e
        try:
            yield tmp
            if stop_requested.is_set():
                raise KeyboardInterrupt("stop requested before the output was published")
            if target.exists():
                old = parent / f"{TMP_PREFIX}{target.name}-old"
                os.replace(target, old)
                os.replace(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, target)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise os_error(e, target) from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def publish_folder(target: Path, write: Callable[[Path], None], force: bool = False) -> Path:
    """Write a folder-shaped package (an .mlpackage, an .aimodel) whole or not at all.

    `write(path)` creates the package at `path`, a temporary path with the target's own name
    (savers check the suffix); it then replaces `target` by rename. A failure, Ctrl-C or
    SIGTERM leaves `target` (and an old package there) as it was.
    """
    target = Path(target).absolute()
    with output_dir(target, force=force) as tmp:
        inner = tmp / target.name
        write(inner)
        if not inner.is_dir():
            raise MpsconvertError(f"writing {target.name} produced no folder", "report this: the saver wrote nothing")
        for p in inner.iterdir():
            os.replace(p, tmp / p.name)
        inner.rmdir()
    return target
