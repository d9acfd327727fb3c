"""Outputs appear whole or not at all: build under a temporary name beside the target, then rename.

A lock beside the target stops two runs from writing the same output at once. Temporary
folders left by a run that was killed (SIGKILL cannot be caught) carry the `.mpsconvert-tmp-`
prefix, so they never look like a finished artifact, and the next run into that target removes
them. Disk-full and permission errors are reported as such, with the partial output removed.

Writers into an existing artifact (an Apple export, calibration written back, a result recorded
in the manifest) take the same lock (`writing`) and build the new state as a staged copy (hard
links of the unchanged files, `staged_copy`), swapped in by the same two renames: a kill at any
point leaves the old artifact or the new one, never a mix, and the next run (writer or reader,
`recover`) puts things right. `--force` replaces only what `check_replaceable` allows.
`kill_point` is the fault-injection hook the kill tests use (inert unless MPSCONVERT_KILL_AT
names the point).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import signal
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from .errors import MpsconvertError
from .filesystem import same_or_inside

TMP_PREFIX = ".mpsconvert-tmp-"
LOCK_PREFIX = ".mpsconvert-lock-"
# Set by the CLI's SIGINT/SIGTERM handlers. The KeyboardInterrupt they raise can be lost when it
# lands in a finalizer or a weakref callback (CPython ignores exceptions there), so the commit
# step checks this too: an output is never published after the user asked to stop.
stop_requested = threading.Event()
KILL_ENV = "MPSCONVERT_KILL_AT"
_held: dict[Path, tuple[int, bool]] = {}  # target -> (thread, joinable) of the lock this process holds (staged_copy and held=True require it)


def kill_point(name: str) -> None:
    """SIGKILL this process here if MPSCONVERT_KILL_AT names this point (the kill tests' hook:
    a kill between two exact steps, which polling for files from outside cannot hit)."""
    if os.environ.get(KILL_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path.parent)
    except OSError as e:
        raise os_error(e, path) from e
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        kill_point("text-temp-written")
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise os_error(e, path) from e
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


def _busy(target: Path) -> MpsconvertError:
    return MpsconvertError(f"another mpsconvert run is writing {target} right now", "wait for it to finish, or choose another -o")


@contextlib.contextmanager
def locked(target: Path, *, joinable: bool = False):
    """Hold an exclusive lock for `target` (a file beside it); a second holder fails at once.

    `joinable`: the lock of a whole command (`claim`), which the steps it calls in the same
    thread join instead of being refused; any other second holder, in this process or another,
    is refused."""
    target = Path(target).absolute()
    if target in _held:
        thread, open_to_steps = _held[target]
        if not (open_to_steps and thread == threading.get_ident()):
            raise _busy(target)
        yield  # a step of the command that holds it
        return
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
            raise _busy(target) from None
        except OSError as e:  # a volume that cannot lock (NFS without lockd: ENOLCK; some SMB/FUSE mounts: EOPNOTSUPP)
            os.close(fd)
            with contextlib.suppress(OSError):  # no run can lock it here either: nothing is left behind
                os.unlink(lock)
            raise MpsconvertError(
                f"cannot lock {target.parent} to write {target.name} ({e.strerror or e}): its file system does not support file locks",
                "choose an -o on a local disk (APFS, ext4), or mount the share with locking enabled",
            ) from e
        # The lock file may have been unlinked by the previous holder between open and flock.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    _held[target] = (threading.get_ident(), joinable)
    try:
        yield
    finally:
        _held.pop(target, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def _recover(target: Path) -> None:
    """Clean up after a killed run into `target` (we hold its lock, so nobody else is writing):
    put back the old output if a kill fell between the two renames of a swap, else remove the
    leftover `-old`; remove temporary folders beside it and temporary files inside it."""
    parent = target.parent
    old = _old(target)
    if os.path.lexists(old):
        if not os.path.lexists(target):
            os.replace(old, target)  # killed between the two renames: put the old one back
        else:
            _remove(old)  # killed after them: the new one is in place, the old one was going
    for p in parent.glob(f"{TMP_PREFIX}{target.name}-*"):
        _remove(p)
    if target.is_dir() and not target.is_symlink():
        for p in target.glob(f"{TMP_PREFIX}*"):  # a manifest write or a package of an older version, killed
            _remove(p)


@contextlib.contextmanager
def writing(target: Path):
    """Hold `target`'s lock and recover what a killed run left: what every writer into an
    existing artifact does first (a step of a command that `claim`ed it joins that lock, the
    recovery already done)."""
    target = Path(target).absolute()
    joining = target in _held  # locked() refuses unless it is this thread's claim
    with locked(target):
        if not joining:
            _recover(target)
        yield target


@contextlib.contextmanager
def claim(target: Path):
    """`writing(target)` for a whole command, taken before any of its work (a model load, an
    export, a validation run): a second run is refused at once rather than after the work, and
    the writers the command calls in this thread (an export, its check, the manifest and card
    updates) run under this one lock."""
    target = Path(target).absolute()
    made = [p for p in (target.parent, *target.parent.parents) if not p.exists()]  # the lock file goes beside the target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error(e, target.parent) from e
    joining = target in _held  # an export inside quantize's claim, say
    try:
        with locked(target, joinable=True):
            if not joining:
                _recover(target)
            yield target
    except BaseException:
        for p in made:  # a failed run leaves no empty folders behind
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


def recover(target: Path) -> None:
    """For readers: if a run was killed between the two renames of a swap (`target` gone, its
    `-old` there), put the old one back first. Raises MpsconvertError if a run is writing it."""
    target = Path(target).absolute()
    if not os.path.lexists(target) and os.path.lexists(_old(target)):
        with writing(target):
            pass


def check_replaceable(target: Path, *, force: bool, is_ours: Callable[[Path], bool] | None = None,
                      protect: tuple[Path, ...] = ()) -> None:
    """May an output at `target` be written? Only where nothing is, or (with `force`) over a
    folder `is_ours` recognises (our manifest) that neither is, holds nor lies inside a path in
    `protect` (the source). Everything else is refused in one line, with nothing touched."""
    target = Path(target).absolute()
    real = target.resolve()
    for p in protect:
        src = Path(p).resolve()
        same, holds = same_or_inside(src, real)  # without case where the volume ignores it (APFS, exFAT)
        if same or holds:
            raise MpsconvertError(f"output {target} {'is' if same else 'holds'} the source model {src}",
                                  "choose an -o outside the source folder")
        if os.path.lexists(target) and same_or_inside(real, src)[1]:
            raise MpsconvertError(f"output {target} lies inside the source model {src}", "choose an -o outside the source folder")
    if not os.path.lexists(target):
        return
    if target.is_symlink() or not target.is_dir():
        kind = "a symlink" if target.is_symlink() else "a file"
        raise MpsconvertError(f"output {target} is {kind}, not an mpsconvert artifact; mpsconvert never replaces it",
                              "remove it yourself, or choose another -o")
    if is_ours is not None and not is_ours(target):  # said first: --force would not replace it, so it is not the fix
        raise MpsconvertError(f"output {target} exists and is not an mpsconvert artifact (no manifest); --force replaces only those",
                              "choose another -o, or remove it yourself")
    if not force:
        raise MpsconvertError(f"output {target} already exists", "pass --force to replace it, or choose another -o")


def _old(target: Path) -> Path:
    """Where a swap parks the output it replaces, between its two renames."""
    return target.parent / f"{TMP_PREFIX}{target.name}-old"


def _swap(target: Path, tmp: Path) -> None:
    """Publish `tmp` as `target` (replacing an old one by two renames that `_recover` completes)."""
    if stop_requested.is_set():
        raise KeyboardInterrupt("stop requested before the output was published")
    if os.path.lexists(target):
        old = _old(target)
        os.replace(target, old)
        kill_point("between-renames")
        os.replace(tmp, target)
        kill_point("after-renames")
        _remove(old)
    else:
        os.replace(tmp, target)


def _new_tmp(target: Path) -> Path:
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-", dir=target.parent))
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; a finished artifact gets normal permissions
    except OSError as e:
        raise os_error(e, target.parent) from e
    return tmp


@contextlib.contextmanager
def _publishing(target: Path, tmp: Path):
    """On success swap `tmp` in; on any error remove it (OS errors as one line)."""
    try:
        yield tmp
        _swap(target, tmp)
    except OSError as e:
        _remove(tmp)
        raise os_error(e, target) from e
    except BaseException:
        _remove(tmp)
        raise


@contextlib.contextmanager
def staged_copy(target: Path, drop: tuple[str, ...] = ()):
    """A copy of the folder `target` to change (its files hard-linked, so it costs no space:
    nothing ever rewrites a file in place), swapped in for it on success. The caller holds
    `writing(target)`. `drop`: top-level names not carried over (what the caller replaces)."""
    target = Path(target).absolute()
    if target not in _held:
        raise RuntimeError("staged_copy needs the target's lock (atomic.writing)")
    tmp = _new_tmp(target)
    with _publishing(target, tmp):
        for dirpath, dirs, files in os.walk(target):
            here = Path(dirpath)
            rel = here.relative_to(target)
            if rel == Path("."):
                dirs[:] = [d for d in dirs if d not in drop and not d.startswith(TMP_PREFIX)]
                files = [f for f in files if f not in drop and not f.startswith(TMP_PREFIX)]
            (tmp / rel).mkdir(exist_ok=True)
            for d in dirs:
                if (here / d).is_symlink():
                    raise MpsconvertError(f"{here / d} is a symlink inside the artifact", "re-create the artifact")
            for f in files:
                src = here / f
                if src.is_symlink():
                    raise MpsconvertError(f"{src} is a symlink inside the artifact", "re-create the artifact")
                try:
                    os.link(src, tmp / rel / f)
                except OSError:  # a filesystem without hard links: a real copy (same result, more space)
                    shutil.copy2(src, tmp / rel / f)
        kill_point("staged")
        yield tmp
        kill_point("staged-written")


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


@contextlib.contextmanager
def output_dir(target: Path, force: bool = False, min_free: int = 0, *, is_ours: Callable[[Path], bool] | None = None,
               protect: tuple[Path, ...] = (), held: bool = False):
    """Yield a fresh temporary folder beside `target`; on success it becomes `target`.

    On any error (or Ctrl-C / SIGTERM) the temporary folder is removed and `target` is
    untouched. An existing `target` is replaced only with `force=True`, only if `is_ours`
    accepts it and it is not (inside) a `protect`ed path (check_replaceable), and only after the
    new one is complete. `min_free`: bytes the output needs, checked before anything is written.
    `held`: the caller already holds `writing(target)` (it verified what it rebuilds under it).
    """
    target = Path(target).absolute()
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error(e, parent) from e
    if held and target not in _held:
        raise RuntimeError("output_dir(held=True) needs the target's lock (atomic.writing)")
    with contextlib.nullcontext() if held else writing(target):
        check_replaceable(target, force=force, is_ours=is_ours, protect=protect)
        free = shutil.disk_usage(parent).free
        if min_free and free < min_free:
            raise MpsconvertError(
                f"not enough disk space for {target}: needs about {min_free / 1e9:.2f} GB, {free / 1e9:.2f} GB free",
                "free some space or choose another -o",
            )
        tmp = _new_tmp(target)
        with _publishing(target, tmp):
            yield tmp
