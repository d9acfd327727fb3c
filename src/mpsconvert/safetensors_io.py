"""Strict safetensors header reading and a streaming writer.

The safetensors library reads and writes whole dicts of tensors; conversion needs to read one
tensor's bytes at a time (hashing them as they pass) and write a shard whose header is known
before its data exists, so that peak memory is one tensor rather than one shard. The format is
small: an 8-byte little-endian header length, a JSON header of {name: {dtype, shape,
data_offsets}}, then the data. Every header is validated before any offset in it is used.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import warnings
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ArtifactError

DTYPES: dict[str, tuple[int, torch.dtype | None]] = {
    "BOOL": (1, torch.bool),
    "U8": (1, torch.uint8),
    "I8": (1, torch.int8),
    "I16": (2, torch.int16),
    "U16": (2, getattr(torch, "uint16", None)),
    "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16),
    "I32": (4, torch.int32),
    "U32": (4, getattr(torch, "uint32", None)),
    "F32": (4, torch.float32),
    "F64": (8, torch.float64),
    "I64": (8, torch.int64),
    "U64": (8, getattr(torch, "uint64", None)),
    "F8_E4M3": (1, torch.float8_e4m3fn),
    "F8_E5M2": (1, torch.float8_e5m2),
}
TORCH_TO_ST = {v[1]: k for k, v in DTYPES.items() if v[1] is not None}
MAX_HEADER = 100 << 20  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][1]


@dataclass
class Header:
    path: Path
    tensors: dict[str, TensorInfo]  # in file-offset order
    metadata: dict[str, str]
    data_start: int
    file_size: int


def read_header(path: Path) -> Header:
    """Parse and validate a safetensors header. Raises ArtifactError naming the file."""
    path = Path(path)

    def bad(why: str) -> ArtifactError:
        return ArtifactError(f"{path.name} is not a valid safetensors file: {why}", "re-download or regenerate it")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"only {len(head)} bytes long")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or n + 8 > size:
                raise bad(f"header length {n} does not fit in a file of {size} bytes")
            raw = f.read(n)
    except OSError as e:
        raise ArtifactError(f"cannot read {path}: {e.strerror}", "check the file's permissions") from e
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not JSON ({e})") from e
    if not isinstance(body, dict):
        raise bad("header is not a JSON object")
    meta = body.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise bad("__metadata__ must map strings to strings")
    data_start = 8 + n
    spans = []
    tensors = {}
    for name, info in body.items():
        if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"}:
            raise bad(f"entry {name!r} is malformed")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPES or DTYPES[dtype][1] is None:
            raise bad(f"tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise bad(f"tensor {name!r} has an invalid shape {shape!r}")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1]
        ):
            raise bad(f"tensor {name!r} has invalid data_offsets {offs!r}")
        expected = math.prod(shape) * DTYPES[dtype][0]
        if offs[1] - offs[0] != expected:
            raise bad(f"tensor {name!r} spans {offs[1] - offs[0]} bytes but {dtype}{shape} needs {expected}")
        spans.append((offs[0], offs[1], name))
        tensors[name] = TensorInfo(name, dtype, tuple(shape), data_start + offs[0], data_start + offs[1])
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            raise bad(f"tensor {name!r} starts at {begin}, expected {pos} (gap or overlap)")
        pos = end
    if data_start + pos != size:
        raise bad(f"data is {size - data_start} bytes but the header accounts for {pos}")
    ordered = {name: tensors[name] for _, _, name in spans}
    return Header(path=path, tensors=ordered, metadata=meta, data_start=data_start, file_size=size)


class _Background:
    """One worker thread for ordered, GIL-free work (sha256 updates, file writes) so that it
    overlaps the quantization math; at most `depth` jobs (and their buffers) wait at a time."""

    def __init__(self, depth: int = 2):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpsconvert-io")
        self._pending: deque[Future] = deque()
        self._depth = depth

    def submit(self, fn, *args) -> None:
        self._pending.append(self._pool.submit(fn, *args))
        while len(self._pending) > self._depth:
            self._pending.popleft().result()

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def shutdown(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)


class ShardReader:
    """Reads tensors of one validated file, in offset order, hashing every byte as it passes.

    The file is memory-mapped: tensors are views of the page cache (no copy), and each range is
    dropped from this process's memory (madvise DONTNEED) once hashed, so resident memory stays
    near one tensor plus what is queued. Reading in offset order means the running sha256
    equals the whole file's hash at the end, without a second pass over the file.
    """

    def __init__(self, header: Header):
        self.header = header
        self._f = open(header.path, "rb", buffering=0)
        self._map = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if header.file_size else None
        self._view = memoryview(self._map) if self._map is not None else memoryview(b"")
        self._hash = hashlib.sha256()
        self._bg = _Background()
        self._pos = 0
        self._feed(header.data_start)

    def _hash_and_drop(self, start: int, end: int) -> None:
        self._hash.update(self._view[start:end])
        page = mmap.PAGESIZE
        lo, hi = (start + page - 1) // page * page, end // page * page
        if hi > lo and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)  # later reads refault from the page cache

    def _feed(self, upto: int) -> memoryview:
        start, self._pos = self._pos, upto
        self._bg.submit(self._hash_and_drop, start, upto)
        return self._view[start:upto]

    def read(self, info: TensorInfo) -> memoryview:
        if info.start != self._pos:
            raise RuntimeError("ShardReader.read must follow file order")
        return self._feed(info.end)

    def sha256(self) -> str:
        if self._pos != self.header.file_size:
            raise RuntimeError("sha256 is only known after the whole file was read")
        self._bg.drain()
        return self._hash.hexdigest()

    def close(self) -> None:
        try:
            self._bg.shutdown()
        finally:
            self._view.release()
            if self._map is not None:
                try:
                    self._map.close()
                except BufferError:  # a tensor view is still alive; the mapping goes with it
                    pass
            self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def as_tensor(buf, info: TensorInfo) -> torch.Tensor:
    """Zero-copy, read-only view of raw little-endian bytes as a torch tensor (never written to)."""
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=info.torch_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": we only read it
        return torch.frombuffer(buf, dtype=info.torch_dtype).reshape(info.shape)


class ShardWriter:
    """Writes a safetensors file whose tensor list is known up front, data streamed in order."""

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
        self._hash = hashlib.sha256()
        self._f = open(self.path, "wb")
        self._bg = _Background()
        self._next = 0
        self._emit(struct.pack("<Q", len(raw)) + raw)

    def _emit(self, data) -> None:
        self._bg.submit(self._write, data)

    def _write(self, data) -> None:
        self._hash.update(data)
        self._f.write(data)

    def write(self, name: str, data) -> None:
        """`data`: a bytes-like object or a CPU tensor, exactly the declared size, in order."""
        if self._next >= len(self._order) or self._order[self._next] != name:
            raise RuntimeError(f"ShardWriter: {name!r} out of order")
        if isinstance(data, torch.Tensor):
            data = data.contiguous().view(torch.uint8).numpy() if data.numel() else b""
        mv = memoryview(data).cast("B")
        if mv.nbytes != self._sizes[name]:
            raise RuntimeError(f"ShardWriter: {name!r} has {mv.nbytes} bytes, declared {self._sizes[name]}")
        self._emit(mv)
        self._next += 1

    def close(self) -> str:
        """Finish the file (fsync) and return its sha256."""
        if self._next != len(self._order):
            raise RuntimeError(f"ShardWriter: {len(self._order) - self._next} tensors never written")
        self._bg.shutdown()
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return self._hash.hexdigest()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Finish the file on success (its sha256 in `.digest`); on any error, abort."""
        if exc_type is None:
            self.digest = self.close()
        else:
            self.abort()

    def abort(self) -> None:
        try:
            self._bg.shutdown()
        except Exception:  # the write that failed is what the caller is already handling
            pass
        self._f.close()
