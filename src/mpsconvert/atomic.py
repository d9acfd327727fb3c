"""Outputs appear whole or not at all: build under a temporary name beside the target, then rename."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from .errors import MpsconvertError

TMP_PREFIX = ".mpsconvert-tmp-"


def write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def output_dir(target: Path, force: bool = False):
    """Yield a fresh temporary folder beside `target`; on success it becomes `target`.

    On any error (or Ctrl-C) the temporary folder is removed and `target` is untouched.
    An existing `target` is replaced only with `force=True`, and only after the new one is
    complete.
    """
    target = Path(target).absolute()
    if target.exists() and not force:
        raise MpsconvertError(f"output {target} already exists", "pass --force to replace it, or choose another -o")
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-", dir=parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; a finished artifact gets normal permissions
    except OSError as e:
        raise MpsconvertError(f"cannot create the output folder in {parent}: {e.strerror}", "choose a writable -o") from e
    try:
        yield tmp
        if target.exists():
            old = parent / f"{TMP_PREFIX}{target.name}-old-{os.getpid()}"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
