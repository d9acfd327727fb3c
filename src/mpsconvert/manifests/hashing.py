"""sha256 of files, streamed, so that hashing a 5 GB shard costs no memory; and in the
background, so that hashing the source overlaps the seconds spent importing torch and
transformers and building the model's plan."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
from concurrent.futures import Future
from pathlib import Path

from ..errors import ArtifactError
from ..filesystem import is_appledouble
from ..untrusted import open_regular

_BLOCK = 8 << 20
# Big reads for the background hasher: each block it reads and hashes without the GIL, then
# waits for the GIL (up to the 5 ms switch interval while the main thread imports modules).
_BG_BLOCK = 32 << 20


def sha256_file(path: Path, block: int = _BLOCK, stop: threading.Event | None = None) -> str:
    h = hashlib.sha256()
    with os.fdopen(open_regular(path, raw_oserror=True), "rb", buffering=0) as f:  # a FIFO or device is refused, never read
        buf = bytearray(max(1, min(block, os.fstat(f.fileno()).st_size)))  # a config.json needs no 8 MiB
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            if stop is not None and stop.is_set():
                raise InterruptedError(f"hashing {path} was cancelled")
    return h.hexdigest()


class BackgroundHasher:
    """sha256 of a list of files on daemon threads started at once, one file per thread at a time.

    One thread per 4 cores (at least one): a sha256 stream is one core's work (1.2-1.6 GB/s on
    the machines we measured), so a 16 GB source took 13 s on one thread, longer than the rest of
    a conversion on a 16-core host; the other cores are left to the quantizing threads and the
    writers. Daemon threads, so that a run that fails or is interrupted exits at once rather than
    waiting for gigabytes to be hashed; `cancel` stops them between blocks.
    """

    def __init__(self, paths: list[Path], threads: int | None = None):
        self._futures: dict[Path, Future] = {Path(p): Future() for p in paths}
        self._stop = threading.Event()
        self._queue = list(self._futures.items())
        self._lock = threading.Lock()
        threads = threads or max(1, (os.cpu_count() or 1) // 4)
        self._threads = [threading.Thread(target=self._run, name="mpsconvert-sha256", daemon=True)
                         for _ in range(max(1, min(threads, len(self._queue))))]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                path, fut = self._queue.pop(0)
            if self._stop.is_set():
                fut.cancel()
                continue
            try:
                fut.set_result(sha256_file(path, _BG_BLOCK, self._stop))
            except BaseException as e:  # delivered to whoever asks for this file's hash
                fut.set_exception(e)

    def sha256(self, path: Path) -> str:
        """The file's sha256 (waits for it); a read error surfaces here, as raised."""
        return self._futures[Path(path)].result()

    def cancel(self) -> None:
        self._stop.set()


def folder_files(folder: Path, root: Path) -> dict[str, dict]:
    """Every file under `folder` -> {"sha256", "size"}, keyed by its path relative to `root`
    (how the manifest lists a package inside an artifact)."""
    out = {}
    root = Path(root).resolve()  # the package may come as an absolute path, the artifact as a relative one
    for p in sorted(Path(folder).resolve().rglob("*")):
        if p.is_file() and not is_appledouble(p.name):  # macOS's `._*` metadata companions are not package files
            out[p.relative_to(root).as_posix()] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return out


def copy_verified(src: Path, dst: Path, want: dict, name: str, fix: str = "re-create the artifact; a file that fails its hash is never used") -> dict:
    """Copy `src` to `dst`, hashing the bytes as they are read, and refuse (`dst` removed) unless
    they have the size and sha256 `want` records: whoever reads `dst` then reads exactly the bytes
    that were checked (no window in which `src` can change). `src` is opened without following a
    symlink (without blocking on a fifo) and must be a regular file. Returns {"sha256", "size"}."""
    h, n = hashlib.sha256(), 0
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))  # a fifo must not block the open
    except OSError as e:
        raise ArtifactError(f"{name} cannot be read ({e.strerror or e}{': a symlink' if e.errno == errno.ELOOP else ''})", fix) from None
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with os.fdopen(fd, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ArtifactError(f"{name} is not a regular file", fix)
        os.set_blocking(f.fileno(), True)
        with open(dst, "wb") as out:
            while chunk := f.read(_BLOCK):
                h.update(chunk)
                out.write(chunk)
                n += len(chunk)
    if n != want.get("size") or h.hexdigest() != want.get("sha256"):
        dst.unlink()
        raise ArtifactError(f"{name} does not match the sha256 in mpsconvert.json (modified or corrupted)", fix)
    return {"sha256": h.hexdigest(), "size": n}
