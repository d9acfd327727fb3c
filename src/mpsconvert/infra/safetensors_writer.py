"""The streaming safetensors writer: a shard whose header is known before its data exists, its
tensors written in blocks or copied from a source file, the file's sha256 taken as the bytes go
by, the data sent to disk through O_DIRECT where the filesystem allows (`OutputFile`); and what
watches the bytes of a copy as they pass (`FiniteCheck`, `Digest`)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import mmap
import os
import struct
import sys
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from .atomic import Closing
from .safetensors_io import DTYPES, _read_exact

_COPY_BLOCK = 16 << 20  # ShardWriter.copy reads the source in blocks of this size


class _Background:
    """One worker thread for ordered, GIL-free work (sha256 updates, file writes) so that it
    overlaps the quantization math; at most `depth` jobs (and their buffers) wait at a time."""

    def __init__(self, depth: int = 2):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpsconvert-io")
        self._pending: deque[tuple[Future, bool]] = deque()
        self._depth = depth

    def submit(self, fn, *args, holds_buffer: bool = True) -> None:
        """Queue a job; jobs that hold a caller's buffer wait while `depth` of them are queued
        (jobs that hold none, such as a copy from a file, never make the caller wait)."""
        self._pending.append((self._pool.submit(fn, *args), holds_buffer))
        while sum(held for _, held in self._pending) > self._depth:
            self._pending.popleft()[0].result()
        while self._pending and self._pending[0][0].done():
            self._pending.popleft()[0].result()  # an error surfaces at the next submit

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft()[0].result()

    def shutdown(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)


class OutputFile:
    """A file written once, front to back, bypassing the page cache where the OS allows it.

    On Linux the data goes through O_DIRECT from page-aligned staging buffers (the disk DMAs
    them; a write costs no CPU and evicts nothing), double-buffered so that one buffer is
    written while the next fills. Buffered writes cost 1-3 ns per byte of kernel time on the
    machines benchmarks/convert.py ran on, as much as the quantization math. Where O_DIRECT
    is refused (tmpfs, some network and FUSE filesystems, macOS) it writes through the page
    cache; `mode` says which path ran. (Reserving the size up front with posix_fallocate made
    no difference to O_DIRECT here, and glibc emulates it byte by byte where a filesystem
    lacks fallocate; `atomic.output_dir` checks the free space before anything is written.)
    """

    ALIGN = 4096
    STAGE = 8 << 20

    def __init__(self, path: Path):
        self.path = Path(path)
        self.size = 0
        direct = getattr(os, "O_DIRECT", 0)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self._fd = -1
        self.mode = "direct" if direct else "buffered (no O_DIRECT on this OS)"
        if direct:
            try:
                self._fd = os.open(self.path, flags | direct, 0o666)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.mode = "buffered (O_DIRECT refused by the filesystem)"
        if self._fd < 0:
            self._fd = os.open(self.path, flags, 0o666)
        self._maps = [mmap.mmap(-1, self.STAGE) for _ in range(2)] if self.direct else []  # page-aligned
        self._stages = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]  # numpy copies release the GIL
        self._fill = 0  # bytes in the current stage
        self._cur = 0
        self._flushed = 0  # file offset of the current stage
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpsconvert-write") if self.direct else None
        self._inflight: list[Future | None] = [None, None]

    @property
    def direct(self) -> bool:
        return self.mode == "direct"

    def _pwrite_all(self, view, offset: int) -> None:
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(self._fd, view[done:], offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL or self.mode != "direct":
                    raise
                # Opened with O_DIRECT, but this filesystem refuses direct writes: go buffered.
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.mode = "buffered (O_DIRECT writes refused by the filesystem)"

    def _stage_out(self, nbytes: int) -> None:
        """Hand the current stage (padded to ALIGN) to the write thread; switch stages."""
        buf, off = self._stages[self._cur], self._flushed
        padded = -(-nbytes // self.ALIGN) * self.ALIGN
        buf[nbytes:padded] = 0
        self._inflight[self._cur] = self._io.submit(self._pwrite_all, memoryview(self._maps[self._cur])[:padded], off)
        self._cur ^= 1
        self._flushed += nbytes
        self._fill = 0
        job, self._inflight[self._cur] = self._inflight[self._cur], None
        if job is not None:
            job.result()  # that stage is free again (and its write error, if any, surfaces)

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        self.size += mv.nbytes
        if not self._stages:
            done = 0
            while done < mv.nbytes:
                done += os.write(self._fd, mv[done:])
            return
        src = np.frombuffer(mv, dtype=np.uint8)
        pos = 0
        while pos < mv.nbytes:
            n = min(self.STAGE - self._fill, mv.nbytes - pos)
            self._stages[self._cur][self._fill : self._fill + n] = src[pos : pos + n]
            self._fill += n
            pos += n
            if self._fill == self.STAGE:
                self._stage_out(self.STAGE)

    def finish(self) -> None:
        """Write what is staged; the file is then exactly the bytes written."""
        if self._stages:
            if self._fill:
                self._stage_out(self._fill)  # its padding is cut off below
            for job in self._inflight:
                if job is not None:
                    job.result()
            self._inflight = [None, None]
            self._io.shutdown(wait=True)
        os.ftruncate(self._fd, self.size)

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True, cancel_futures=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._stages = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view is still referenced somewhere; it goes with it
                pass
        self._maps = []


# The sha256 of each output shard on a thread of its own, beside the copy into the write stage,
# where there are cores for it: on the 16-core H100 host the one thread that hashed (1.2 GB/s)
# and copied each block in turn bounded a 16 GB conversion; on the 2-core VM, where every core is
# busy, the split made a 2.5 GB conversion 5% slower (9.90 vs 9.44 s, 5 of 5 rounds).
HASH_BESIDE_COPY = (os.cpu_count() or 1) >= 4


class ShardWriter(Closing):
    """Writes a safetensors file whose tensor list is known up front, data streamed in order.

    A tensor's bytes may come in several `write` calls (blocks of rows), or be copied from a
    source file by `copy`. The copies, the file writes and the sha256 run on a background thread
    (the sha256 beside them on one of its own where HASH_BESIDE_COPY); a block's `release`
    callback (a pooled buffer going back) is called once its bytes are written. `close` returns
    at once: the last writes and copies overlap whatever the caller does next (the next shard),
    `digest` waits for them, and `sync` makes the file durable.
    """

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict | None = None):
        self.path = Path(path)
        self._order = [e[0] for e in entries]
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        off = 0
        self._sizes = {}
        for name, dtype, shape in entries:
            nbytes = math.prod(shape) * DTYPES[dtype][0]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
            self._sizes[name] = nbytes
            off += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.size = 8 + len(raw) + off
        self._hash = hashlib.sha256()
        self._hasher = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpsconvert-sha256-out") if HASH_BESIDE_COPY else None
        )
        self._f = OutputFile(self.path)
        self._bg = _Background(depth=3)
        self._next = 0
        self._filled = 0  # bytes of tensor self._order[self._next] written so far
        self._copy_buf: np.ndarray | None = None
        self._closed = False
        self._digest: str | None = None
        self._digest_lock = threading.Lock()  # `sync` may wait for it on another thread
        self._emit(struct.pack("<Q", len(raw)) + raw)

    def _emit(self, data, release: Callable[[], None] | None = None) -> None:
        self._bg.submit(self._job, data, release)

    def _job(self, data, release) -> None:
        try:
            self._write(data)
        finally:
            if release is not None:
                release()

    def _write(self, data) -> None:
        if self._hasher is None:
            self._hash.update(data)
            self._f.write(data)
            return
        hashed = self._hasher.submit(self._hash.update, data)
        try:
            self._f.write(data)
        finally:
            hashed.result()

    def _advance(self, name: str, nbytes: int) -> None:
        if self._next >= len(self._order) or self._order[self._next] != name:
            raise RuntimeError(f"ShardWriter: {name!r} out of order")
        if self._filled + nbytes > self._sizes[name]:
            raise RuntimeError(f"ShardWriter: {name!r} got {self._filled + nbytes} bytes, declared {self._sizes[name]}")
        self._filled += nbytes
        if self._filled == self._sizes[name]:
            self._next += 1
            self._filled = 0

    def write(self, name: str, data, release: Callable[[], None] | None = None) -> None:
        """Append `data` (a bytes-like object or a CPU tensor) to tensor `name`: tensors in the
        declared order, each exactly its declared size in total. `data` must not change until
        `release` is called (or, without one, until `digest` returned)."""
        torch = sys.modules.get("torch")  # a tensor exists only once torch was imported
        if torch is not None and isinstance(data, torch.Tensor):
            data = data.contiguous().view(torch.uint8).numpy() if data.numel() else b""
        mv = memoryview(data).cast("B")
        self._advance(name, mv.nbytes)
        self._emit(mv, release)

    def copy(self, name: str, source: Path, start: int, nbytes: int, watch: tuple = ()) -> None:
        """Append bytes [start, start + nbytes) of the file `source` to tensor `name`, on the
        background thread (the caller does not wait for them). `watch`: objects that see the
        bytes as they pass (`update(block)`, then `done()`: a `FiniteCheck`, a `Digest`), so that
        what is checked or hashed about a copied tensor costs no read of its own."""
        self._advance(name, nbytes)
        self._bg.submit(self._copy_job, Path(source), start, nbytes, watch, holds_buffer=False)

    def _copy_job(self, source: Path, start: int, nbytes: int, watch: tuple = ()) -> None:
        if self._copy_buf is None:
            self._copy_buf = np.empty(_COPY_BLOCK, dtype=np.uint8)
        view = memoryview(self._copy_buf)
        fd = os.open(source, os.O_RDONLY)
        try:
            for off in range(0, nbytes, _COPY_BLOCK):
                part = view[: min(_COPY_BLOCK, nbytes - off)]
                _read_exact(fd, part, start + off, source)
                for w in watch:
                    w.update(part)
                self._write(part)
        finally:
            os.close(fd)
        for w in watch:
            w.done()

    def close(self) -> None:
        """Every tensor was given: queue the end of the file, without waiting for it."""
        if self._next != len(self._order):
            raise RuntimeError(f"ShardWriter: {len(self._order) - self._next} tensors never written")
        self._bg.submit(self._f.finish, holds_buffer=False)
        self._closed = True

    @property
    def digest(self) -> str:
        """The file's sha256, once everything queued is written (waits for it)."""
        with self._digest_lock:
            if self._digest is None:
                if not self._closed:
                    raise RuntimeError("ShardWriter.digest is known after close()")
                self._bg.shutdown()
                if self._hasher is not None:
                    self._hasher.shutdown()
                self._copy_buf = None
                self._digest = self._hash.hexdigest()
            return self._digest

    @property
    def write_mode(self) -> str:
        """How the bytes reached the disk: "direct" (O_DIRECT) or why they went "buffered"."""
        return self._f.mode

    def sync(self) -> None:
        """Wait for the writes, fsync and close the file: may run on another thread."""
        try:
            self.digest
            self._f.sync()
        finally:
            self._f.close()

    def abort(self) -> None:
        try:
            self._bg.shutdown()
        except Exception:  # the write that failed is what the caller is already handling
            pass
        if self._hasher is not None:
            self._hasher.shutdown()
        self._f.close()


# exponent bits of each float dtype: all ones means inf or NaN
# bits whose all-ones pattern is a NaN or inf; e4m3fn has no infinity and two NaN codes, 0x7F and 0xFF
_EXPONENT = {
    "F32": ("<u4", 0x7F800000),
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
    "F64": ("<u8", 0x7FF0000000000000),
    "F8_E4M3": ("u1", 0x7F),
}


class FiniteCheck:
    """NaN/inf values of a float tensor counted from its bits as its bytes pass by (a copy, a
    cast), in the thread that moves them; `done()` raises when there were any (a NaN in a copied
    norm or embedding is refused like one in a quantized weight, whose scale check catches it).
    An F8_E4M3 tensor's NaN codes (0x7F / 0xFF, which no quantizer writes) are counted too: a
    kept FP8 source weight holding them would fail `verify`. Integer tensors pass unchecked."""

    _scratch = threading.local()  # per thread: a bit-and buffer and a comparison buffer, reused

    def __init__(self, dtype: str, name: str, where: str):
        self.name, self.where, self.count = name, where, 0
        self._dt, self._mask = _EXPONENT.get(dtype, (None, 0))

    def update(self, block) -> None:
        if self._dt is None:
            return
        x = np.frombuffer(block, dtype=self._dt)
        sc = getattr(self._scratch, self._dt, None)
        if sc is None or sc[0].size < x.size:
            sc = (np.empty(x.size, dtype=self._dt), np.empty(x.size, dtype=bool))
            setattr(self._scratch, self._dt, sc)
        bits, hit = sc[0][: x.size], sc[1][: x.size]
        np.bitwise_and(x, self._mask, out=bits)  # all exponent bits set: inf or NaN
        np.equal(bits, self._mask, out=hit)
        self.count += int(np.count_nonzero(hit))

    def done(self) -> None:
        if self.count:
            from ..errors import QuantizationError

            what = "NaN code(s) (0x7F / 0xFF, which no quantizer writes)" if self._dt == "u1" else "NaN or inf value(s)"
            raise QuantizationError(
                f"tensor {self.name!r} in {self.where} contains {self.count} {what}", "fix the source checkpoint"
            )


class Digest:
    """sha256 of the bytes that pass by (a copy), handed to `sink(hexdigest)` when they are all through."""

    def __init__(self, sink: Callable[[str], None]):
        self._h, self._sink = hashlib.sha256(), sink

    def update(self, block) -> None:
        self._h.update(block)

    def done(self) -> None:
        self._sink(self._h.hexdigest())
