"""Outputs appear whole or not at all: build under a temporary name beside the target, then rename.

A lock beside the target stops two runs from writing the same output at once. Temporary
folders left by a run that was killed (SIGKILL cannot be caught) carry the `.mpsconvert-tmp-`
prefix, so they never look like a finished artifact, and the next run into that target removes
them. Disk-full and permission errors are reported as such, with the partial output removed.

Writers into an existing artifact (an Apple export, calibration written back, a result recorded
in the manifest) take the same lock (`writing`) and build the new state as a staged copy (hard
links of the unchanged files, `staged_copy`), swapped in by the same two renames: a kill at any
point leaves the old artifact or the new one, never a mix, and the next run (writer or reader,
`recover`) puts things right. `--force` replaces only what `output_rule.check_replaceable` allows.
`kill_point` is the fault-injection hook the kill tests use (inert unless MPSCONVERT_KILL_AT
names the point).

The folder around an artifact is untrusted too: the reserved names beside it (`.mpsconvert-lock-
<name>`, `.mpsconvert-tmp-<name>-*`) are opened without following symlinks, a symlink planted
under one is an error (never followed, never "restored" into place), and a folder under a
reserved name is removed or put back only when it is ours: it holds `MARKER`, a file naming the
target it was made for (a user's folder that happens to match the prefix, or the temp folder of
another artifact whose name shares a prefix, is left alone). An ARTIFACT that is a symlink is
resolved once (`real`): its lock, staged copies and swaps go beside the folder it points to, so
the link keeps pointing at the new state.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import secrets
import shutil
import signal
import stat
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from ..errors import MpsconvertError
from .output_rule import check_replaceable

TMP_PREFIX = ".mpsconvert-tmp-"
LOCK_PREFIX = ".mpsconvert-lock-"
# Inside a folder of ours under a reserved name (a temp folder, a parked `-old`): the name of the
# target it belongs to. Without it a reserved name is not ours, and nothing removes or restores it.
MARKER = f"{TMP_PREFIX}owner"
# Set by the CLI's SIGINT/SIGTERM handlers. The KeyboardInterrupt they raise can be lost when it
# lands in a finalizer or a weakref callback (CPython ignores exceptions there), so the commit
# step checks this too: an output is never published after the user asked to stop.
stop_requested = threading.Event()
KILL_ENV = "MPSCONVERT_KILL_AT"
_held: dict[
    Path, tuple[int, bool]
] = {}  # target -> (thread, joinable) of the lock this process holds (staged_copy and held=True require it)


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


class Closing:
    """A with-block over work that must end one way or the other: `close()` when the block ends
    well, `abort()` when it raises (the error being raised matters more than the work left); a
    subclass defines both."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class BackgroundSync(Closing):
    """Runs fsyncs on a thread of their own, so that one file's flush to disk overlaps the work
    on the next; `close` (before the rename that publishes them) re-raises any failure."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpsconvert-fsync")
        self._jobs: list[Future] = []

    def add(self, fn: Callable[[], None]) -> None:
        self._jobs.append(self._pool.submit(fn))

    def close(self) -> None:
        try:
            for job in self._jobs:
                job.result()
        finally:
            self._pool.shutdown(wait=True)

    def abort(self) -> None:
        """Drop the fsyncs not started yet: a failed flush of a file about to go matters less."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def os_error(e: OSError, where: Path) -> MpsconvertError:
    """A clear message for the OS errors a user can act on."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return MpsconvertError(
            f"the disk holding {where} is full (partial output removed)", "free some space or choose another -o"
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return MpsconvertError(f"cannot write to {where}: {e.strerror}", "choose a writable -o")
    return MpsconvertError(f"writing {where} failed: {e.strerror or e}", "check the output location and retry")


def _busy(target: Path) -> MpsconvertError:
    return MpsconvertError(
        f"another mpsconvert run is writing {target} right now", "wait for it to finish, or choose another -o"
    )


@contextlib.contextmanager
def locked(target: Path, *, joinable: bool = False):
    """Hold an exclusive lock for `target` (a file beside it); a second holder fails at once.

    `joinable`: the lock of a whole command (`claim`), which the steps it calls in the same
    thread join instead of being refused; any other second holder, in this process or another,
    is refused. The lock file is opened without following a symlink: a link planted under its
    name is an error, never a way to create or lock a file elsewhere."""
    target = real(target)
    if target in _held:
        thread, open_to_steps = _held[target]
        if not (open_to_steps and thread == threading.get_ident()):
            raise _busy(target)
        yield  # a step of the command that holds it
        return
    lock = target.parent / f"{LOCK_PREFIX}{target.name}"
    while True:
        fd = _open_lock(lock)
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
                f"cannot lock {target.parent} to write {target.name} ({e.strerror or e}): its file system does not "
                "support file locks",
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


def real(target: Path) -> Path:
    """The path writers use for `target`: absolute, and an ARTIFACT that is a symlink resolved
    once to the folder it points to (so a swap replaces that folder and the link stays a link)."""
    p = Path(target).absolute()
    return p.resolve() if p.is_symlink() else p


def _planted(p: Path) -> MpsconvertError:
    return MpsconvertError(
        f"{p} is a symlink under a name mpsconvert reserves beside its outputs; it is never followed",
        "remove that link (nothing made it but someone else)",
    )


def _open_lock(lock: Path) -> int:
    """The lock file, opened (created if absent) without following a symlink, and a regular file."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _planted(lock) from None
        raise os_error(e, lock.parent) from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise MpsconvertError(f"{lock} is not a regular file (a name mpsconvert reserves for its lock)", "remove it")
    return fd


def _mark(folder: Path, target: Path) -> None:
    """Make `folder` (a real folder under a reserved name, or the target about to be parked) ours."""
    fd = os.open(folder / MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(os.fsencode(target.name))


def _ours(p: Path, target: Path) -> bool:
    """Whether `p` (a reserved name beside `target`) is a real folder we made for `target`: its
    marker names `target`. Checked on lstat: a symlink is never ours."""
    try:
        if not stat.S_ISDIR(os.lstat(p).st_mode):
            return False
        if set(os.listdir(p)) <= {MARKER} and (not os.path.lexists(p / MARKER) or os.lstat(p / MARKER).st_size == 0):
            return True  # killed between mkdtemp and its marker: empty, so nothing of anyone's is lost by removing it
        fd = os.open(p / MARKER, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        return f.read(4096) == os.fsencode(target.name)


def _remove(p: Path) -> None:
    """Remove `p` without following it: a folder's tree (links inside are unlinked, not followed),
    or a file or link."""
    if stat.S_ISDIR(os.lstat(p).st_mode) if os.path.lexists(p) else False:
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def leftovers(target: Path) -> list[Path]:
    """Reserved names beside `target` (`.mpsconvert-tmp-<name>-*`): temp folders and parked `-old`
    folders of killed runs, or names someone else put there. A symlink among them is an error."""
    target = Path(target)
    found = sorted(target.parent.glob(glob.escape(f"{TMP_PREFIX}{target.name}-") + "*"))
    for p in found:
        if p.is_symlink():
            raise _planted(p)
    return found


def _recover(target: Path) -> None:
    """Clean up after a killed run into `target` (we hold its lock, so nobody else is writing):
    put back the old output if a kill fell between the two renames of a swap, else remove the
    leftover `-old`; remove temporary folders beside it and temporary files inside it. Only what
    is ours (`_ours`) is removed or put back; a planted symlink is an error."""
    found = [p for p in leftovers(target) if _ours(p, target)]
    olds = [p for p in found if p.name.startswith(f"{TMP_PREFIX}{target.name}-old-")]
    if olds and not os.path.lexists(target):
        os.replace(olds[0], target)  # killed between the two renames: put the old one back
        found.remove(olds[0])
        with contextlib.suppress(FileNotFoundError):
            (target / MARKER).unlink()
    for p in found:  # killed after them (the old one was going), or a temp folder of a killed run
        _remove(p)
    if stat.S_ISDIR(os.lstat(target).st_mode) if os.path.lexists(target) else False:
        for p in target.glob(glob.escape(TMP_PREFIX) + "*"):  # inside our artifact: a killed manifest write, a marker
            _remove(p)


@contextlib.contextmanager
def writing(target: Path):
    """Hold `target`'s lock and recover what a killed run left: what every writer into an
    existing artifact does first (a step of a command that `claim`ed it joins that lock, the
    recovery already done)."""
    target = real(target)
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
    target = real(target)
    made = [
        p for p in (target.parent, *target.parent.parents) if not p.exists()
    ]  # the lock file goes beside the target
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
    """For readers: what a killed run left is repaired, as a writer does first: a swap cut
    between its two renames completed backwards (`target` gone, its `-old` of ours put back), and
    the temporary folders beside `target` and files inside it removed, when they are provably
    ours (`_ours`: their marker names `target`) and stale (this reader takes the lock, which every
    run holds while its temporary folders exist). Where the lock is held (a run is writing it
    now) or cannot be taken (a read-only volume), they are left to a later run, unless `target`
    is gone (then nothing can be read: the error says why). A symlink under a reserved name
    beside `target` (the lock's, a temporary folder's) is an error, never followed."""
    target = real(target)
    lock = target.parent / f"{LOCK_PREFIX}{target.name}"
    if os.path.islink(lock):
        raise _planted(lock)
    mine = [p for p in leftovers(target) if _ours(p, target)]  # leftovers: a planted link is an error
    inside = (stat.S_ISDIR(os.lstat(target).st_mode) if os.path.lexists(target) else False) and next(
        iter(target.glob(glob.escape(TMP_PREFIX) + "*")), None
    ) is not None
    if not (mine or inside) or target in _held:  # nothing left, or this process is writing it (a step of its command)
        return
    try:
        with writing(target):
            pass
    except MpsconvertError:
        if not os.path.lexists(target):
            raise


def write_file(target: Path, text: str, **rule) -> None:
    """Write a file output (calibrate's scales) whole: under its lock (a claim of the command
    joined), `check_replaceable(target, file=True, **rule)` once more (the file may have appeared
    while the command worked), then `write_text`."""
    target = Path(target).absolute()
    if not target.parent.is_dir():
        raise MpsconvertError(
            f"cannot write {target}: folder {target.parent} does not exist", "create it, or choose another -o"
        )
    with locked(target):
        check_replaceable(target, file=True, **rule)
        write_text(target, text)


def carry(src: Path, dst: Path, rels: list[str]) -> None:
    """Put the files `rels` of the folder `src` into `dst` as they are (hard links; a copy where
    the file system has none), for a rebuild that keeps what it does not know (a user's notes in
    an artifact). A link or a special file among them is refused, as in `staged_copy`."""
    for rel in rels:
        s, d = Path(src) / rel, Path(dst) / rel
        if os.path.lexists(d):
            continue
        if not stat.S_ISREG(os.lstat(s).st_mode):
            raise MpsconvertError(
                f"{s} is {'a symlink' if s.is_symlink() else 'not a regular file'} inside the artifact",
                "move it out of the artifact, then run the command again",
            )
        d.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)


def _old(target: Path) -> Path:
    """Where a swap parks the output it replaces, between its two renames: a fresh name (a name
    someone else put there is never renamed over)."""
    return target.parent / f"{TMP_PREFIX}{target.name}-old-{secrets.token_hex(6)}"


def _swap(target: Path, tmp: Path) -> None:
    """Publish `tmp` as `target` (replacing an old one by two renames that `_recover` completes:
    the old one is marked ours first, so that only it is ever put back)."""
    if stop_requested.is_set():
        raise KeyboardInterrupt("stop requested before the output was published")
    if os.path.lexists(target):
        old = _old(target)
        _mark(target, target)
        os.replace(target, old)
        kill_point("between-renames")
        os.replace(tmp, target)
        kill_point("after-renames")
        _remove(old)
    else:
        os.replace(tmp, target)
    with contextlib.suppress(FileNotFoundError):  # a kill before this leaves it inside: the next run removes it
        (target / MARKER).unlink()


def _new_tmp(target: Path) -> Path:
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-", dir=target.parent))
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; a finished artifact gets normal permissions
        _mark(tmp, target)
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
    target = real(target)
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


@contextlib.contextmanager
def output_dir(
    target: Path,
    force: bool = False,
    min_free: int = 0,
    *,
    is_ours: Callable[[Path], bool] | None = None,
    protect: tuple[Path, ...] = (),
    held: bool = False,
    is_artifact: Callable[[Path], bool] | None = None,
    unlisted: Callable[[Path], list[str]] | None = None,
    delete_unlisted: bool = False,
):
    """Yield a fresh temporary folder beside `target`; on success it becomes `target`.

    On any error (or Ctrl-C / SIGTERM) the temporary folder is removed and `target` is
    untouched. An existing `target` is replaced only as `check_replaceable` allows (with
    `force=True`, over a folder `is_ours` accepts, not (inside) a `protect`ed path or an
    artifact, holding no file `unlisted` names unless `delete_unlisted`), and only after the new
    one is complete. `min_free`: bytes the output needs, checked before anything is written.
    `held`: the caller already holds `writing(target)` (it verified what it rebuilds under it).
    """
    target = Path(target).absolute()
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error(e, parent) from e
    if held:
        target = real(target)  # a rebuild of an artifact reached through a symlink goes beside its folder
    if held and target not in _held:
        raise RuntimeError("output_dir(held=True) needs the target's lock (atomic.writing)")
    with contextlib.nullcontext() if held else writing(target):
        check_replaceable(
            target,
            force=force,
            is_ours=is_ours,
            protect=protect,
            is_artifact=is_artifact,
            unlisted=unlisted,
            delete_unlisted=delete_unlisted,
        )
        free = shutil.disk_usage(parent).free
        if min_free and free < min_free:
            raise MpsconvertError(
                f"not enough disk space for {target}: needs about {min_free / 1e9:.2f} GB, {free / 1e9:.2f} GB free",
                "free some space or choose another -o",
            )
        tmp = _new_tmp(target)
        with _publishing(target, tmp):
            yield tmp
