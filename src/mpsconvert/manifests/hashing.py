"""sha256 of files, streamed, so that hashing a 5 GB shard costs no memory; and in the
background, so that hashing the source overlaps the seconds spent importing torch and
transformers and building the model's plan."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import stat
import threading
from concurrent.futures import Future
from pathlib import Path

from ..errors import ArtifactError
from ..infra.filesystem import is_appledouble
from ..infra.untrusted import open_regular

_BLOCK = 8 << 20
# Big reads for the background hasher: each block it reads and hashes without the GIL, then
# waits for the GIL (up to the 5 ms switch interval while the main thread imports modules).
_BG_BLOCK = 32 << 20


def sha256_file(path: Path, block: int = _BLOCK, stop: threading.Event | None = None) -> str:
    h = hashlib.sha256()
    with os.fdopen(
        open_regular(path, raw_oserror=True), "rb", buffering=0
    ) as f:  # a FIFO or device is refused, never read
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
        self._threads = [
            threading.Thread(target=self._run, name="mpsconvert-sha256", daemon=True)
            for _ in range(max(1, min(threads, len(self._queue))))
        ]
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


def open_unlinked(src: Path, name: str, fix: str, *, folder: Path | None = None) -> int:
    """A read-only descriptor of the regular file `src`, opened without following a symlink and
    without blocking on a fifo. With `folder`, `src` is a path relative to it and no part of it
    may be a link either (each folder opened with O_NOFOLLOW below the last): a folder of a
    package swapped for a link after a check cannot lead the read outside."""
    nofollow = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0)  # a fifo must not block the open
    fds: list[int] = []
    try:
        if folder is None:
            fd = os.open(src, nofollow)
        else:
            fds.append(os.open(folder, os.O_RDONLY | os.O_DIRECTORY))
            *dirs, leaf = Path(src).parts
            for d in dirs:
                fds.append(os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fds[-1]))
            fd = os.open(leaf, nofollow, dir_fd=fds[-1])
    except OSError as e:
        link = e.errno in (errno.ELOOP, errno.ENOTDIR)
        raise ArtifactError(f"{name} cannot be read ({e.strerror or e}{': a symlink' if link else ''})", fix) from None
    finally:
        for d in fds:
            os.close(d)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ArtifactError(f"{name} is not a regular file", fix)
    os.set_blocking(fd, True)
    return fd


def copy_verified(
    src: Path,
    dst: Path,
    want: dict,
    name: str,
    fix: str = "re-create the artifact; a file that fails its hash is never used",
) -> dict:
    """Copy `src` to `dst`, hashing the bytes as they are read, and refuse (`dst` removed) unless
    they have the size and sha256 `want` records: whoever reads `dst` then reads exactly the bytes
    that were checked (no window in which `src` can change). `src` is opened without following a
    symlink (without blocking on a fifo) and must be a regular file. Returns {"sha256", "size"}."""
    h, n = hashlib.sha256(), 0
    fd = open_unlinked(src, name, fix)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with os.fdopen(fd, "rb", buffering=0) as f:
        with open(dst, "wb") as out:
            while chunk := f.read(_BLOCK):
                h.update(chunk)
                out.write(chunk)
                n += len(chunk)
    if n != want.get("size") or h.hexdigest() != want.get("sha256"):
        dst.unlink()
        raise ArtifactError(f"{name} does not match the sha256 in mpsconvert.json (modified or corrupted)", fix)
    return {"sha256": h.hexdigest(), "size": n}


# Files up to this size are sent as the bytes that were hashed (a card, a config, a tokenizer);
# larger ones (weights) through `VerifiedReader`, so a shard never has to fit in memory.
SEND_AS_BYTES = 64 << 20


class VerifiedReader(io.BufferedIOBase):
    """A file handed to a library that reads it (huggingface_hub's upload) as the bytes that were
    verified: opened once (`open_unlinked`), hashed in full against `want` before it is handed
    over, and hashed again on every pass a reader makes from its start, which fails *before*
    the pass's last bytes are returned if they differ (a file rewritten in place after its check
    never reaches its end). A rename or a link put under the file's name later changes nothing:
    the descriptor is the file that was checked."""

    def __init__(self, fd: int, want: dict, name: str, fix: str):
        super().__init__()
        self._fd, self._want, self._name, self._fix = fd, want, name, fix
        self._pos = 0
        self._pass: "hashlib._Hash | None" = None
        self._done = 0  # bytes of the current pass hashed so far (it started at 0, read without gaps)
        while self.read(_BLOCK):  # the first pass: refused here, before anything is sent
            pass
        self.seek(0)

    def _check(self, final: bool) -> None:
        if (
            self._done > self._want.get("size", -1)
            or final
            and (self._done != self._want.get("size") or self._pass.hexdigest() != self._want.get("sha256"))
        ):
            self._pass = None
            raise ArtifactError(
                f"{self._name} does not match the sha256 in mpsconvert.json (changed after it was verified)", self._fix
            )

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: os.fstat(self._fd).st_size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = (
                max(0, os.fstat(self._fd).st_size - self._pos) + 1
            )  # to the end (one byte more shows a file that grew)
        data = os.pread(self._fd, size, self._pos)
        if self._pos == 0:
            self._pass, self._done = hashlib.sha256(), 0
        if self._pass is not None and self._pos == self._done:  # the pass goes on without a gap
            self._pass.update(data)
            self._done += len(data)
            self._check(
                final=not data or self._done >= self._want.get("size", 0)
            )  # checked before the last bytes go out
        self._pos += len(data)
        return data

    def read1(self, size: int = -1) -> bytes:
        return self.read(size)

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def read_verified(folder: Path, rel: str, want: dict, fix: str) -> "bytes | VerifiedReader":
    """The listed file `folder/rel` as what was verified: its bytes (small files), or a
    `VerifiedReader` (large ones), each opened once without following a link at any part of
    `rel`, and refused unless it has the size and sha256 `want` records."""
    fd = open_unlinked(Path(rel), rel, fix, folder=folder)
    if os.fstat(fd).st_size > SEND_AS_BYTES:
        return VerifiedReader(fd, want, rel, fix)
    with os.fdopen(fd, "rb", buffering=0) as f:
        raw = f.read(SEND_AS_BYTES + 1)
    if len(raw) != want.get("size") or hashlib.sha256(raw).hexdigest() != want.get("sha256"):
        raise ArtifactError(f"{rel} does not match the sha256 in mpsconvert.json (changed after it was verified)", fix)
    return raw
