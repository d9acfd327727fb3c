"""Folders of this process in the system temp dir (`mpsconvert-<kind>-<pid>-*`): a copy to load,
a GGUF unpacked, calibration's work; named for the process so that a later run can tell a killed
run's leftovers from a live one's and remove them."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

_TMPDIR_PREFIX = "mpsconvert-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_tempdirs(root: Path | None = None) -> list[Path]:
    """Remove the system-temp folders (`mpsconvert-<kind>-<pid>-*`) of runs that were killed:
    ours (same user) and whose process is gone. Returns what was removed."""
    root = Path(root or tempfile.gettempdir())
    gone = []
    for p in root.glob(f"{_TMPDIR_PREFIX}*-*-*"):
        parts = p.name.split("-")
        if len(parts) < 4 or not parts[2].isdigit():
            continue
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        if st.st_uid == os.getuid() and p.is_dir() and not p.is_symlink() and not _alive(int(parts[2])):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


@contextlib.contextmanager
def private_tempdir(kind: str, redirect: bool = False):
    """A folder in the system temp dir named for this process (`mpsconvert-<kind>-<pid>-*`), so
    that a later run can tell a killed run's leftovers from a live one's and remove them
    (`clean_stale_tempdirs`, called here first). `redirect`: also make it `tempfile`'s default
    for the block, so libraries' temporary files (coremltools' tmp*.mlpackage) land in it."""
    clean_stale_tempdirs()
    d = Path(tempfile.mkdtemp(prefix=f"{_TMPDIR_PREFIX}{kind}-{os.getpid()}-"))
    before = tempfile.tempdir
    if redirect:
        tempfile.tempdir = str(d)
    try:
        yield d
    finally:
        if redirect:
            tempfile.tempdir = before
        shutil.rmtree(d, ignore_errors=True)
