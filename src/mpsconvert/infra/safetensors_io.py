"""Strict safetensors header reading, and reading tensors' bytes in blocks.

The safetensors library reads and writes whole dicts of tensors; conversion needs to read one
tensor's bytes at a time (hashing them as they pass), so that peak memory is one block rather
than one shard. The format is small: an 8-byte little-endian header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the data. Every header is validated before any offset
in it is used. The streaming writer of such files is in safetensors_writer.py.
"""

from __future__ import annotations

import functools
import math
import os
import queue
import struct
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import ArtifactError
from .untrusted import open_regular, parse_json

if TYPE_CHECKING:
    import torch


# safetensors dtype -> (bytes per element, torch dtype's name). Names, not torch dtypes: reading a
# header (verify, inspect) is JSON and must not import torch (seconds on a small machine);
# `torch_dtype` resolves a name where a tensor is made.
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "I16": (2, "int16"),
    "U16": (2, "uint16"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I32": (4, "int32"),
    "U32": (4, "uint32"),
    "F32": (4, "float32"),
    "F64": (8, "float64"),
    "I64": (8, "int64"),
    "U64": (8, "uint64"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
}


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (a key of DTYPES)."""
    import torch

    return getattr(torch, DTYPES[dtype][1])


MAX_HEADER = 100 << 20  # the safetensors library's own limit
MAX_TENSORS = 1 << 18  # tensors in one file: a whole 671B MoE holds ~92k, in 163 files


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
        return torch_dtype(self.dtype)


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
        fd = open_regular(
            path, what=path.name, fix="re-download or regenerate it", raw_oserror=True
        )  # a FIFO or device: refused
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"only {len(head)} bytes long")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or n + 8 > size:
                raise bad(f"header length {n} does not fit in a file of {size} bytes")
            raw = f.read(n)
    except OSError as e:
        raise ArtifactError(f"cannot read {path}: {e.strerror}", "check the file's permissions") from e
    body = parse_json(
        raw,
        what=f"{path.name} is not a valid safetensors file: its header",
        expect=dict,
        fix="re-download or regenerate it",
    )
    if len(body) > MAX_TENSORS:
        raise bad(f"its header lists {len(body)} tensors, more than the {MAX_TENSORS} any model file has")
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
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise bad(f"tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
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


def _nothing() -> None:
    pass


class BufferPool:
    """Reusable byte buffers for reading and writing blocks, made on first need, `count` at most.

    Freshly allocated memory costs a page fault per 4 KiB on first touch, which on the machines
    we measured cost a third of the quantization math itself (benchmarks/convert.py); pooled
    buffers are touched once. `acquire` blocks while all `count` are in use, so the blocks in
    flight (being filled, quantized, queued for writing) and with them peak memory are bounded.
    """

    def __init__(self, count: int = 6, nbytes: int = 16 << 20):
        self.nbytes = nbytes
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._left = count  # buffers not made yet
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """A uint8 tensor of `nbytes` and the callback that gives it back (a no-op for a block
        larger than the pool's buffers, which gets memory of its own)."""
        import torch

        if nbytes > self.nbytes:
            return torch.empty(nbytes, dtype=torch.uint8), _nothing
        try:
            buf = self._free.get_nowait()
        except queue.Empty:
            with self._lock:
                make = self._left > 0
                self._left -= make
            buf = torch.empty(self.nbytes, dtype=torch.uint8) if make else self._free.get()
        return buf[:nbytes], functools.partial(self._free.put, buf)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read into `view` from `offset`; returns the bytes read (0 at the end of the file).
    os.preadv where the platform has it (Linux; macOS builds against a recent SDK), else a seek
    and readv (the fd is then used by one thread at a time, as every caller here does)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return os.readv(fd, [view])


def _read_exact(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill `view` from `offset`; a file that ends early was changed under us."""
    done = 0
    while done < view.nbytes:
        n = _pread_into(fd, view[done:], offset + done)
        if n == 0:
            raise ArtifactError(
                f"{Path(path).name} became shorter while it was being read",
                "do not modify the source during a conversion",
            )
        done += n


class ShardReader:
    """Reads the tensors of one validated file with positional reads into pooled buffers.

    Plain reads cost a third of what touching a memory map does (one page fault per 4 KiB,
    measured in benchmarks/convert.py), and a tensor can be read in blocks of rows, so that
    memory stays at a few blocks whatever the tensor's size. The file's sha256 is not computed
    here: `Snapshot.sha256` hashes source files on its own thread, from the start of a run.
    """

    def __init__(self, header: Header, pool: BufferPool | None = None):
        self.header = header
        self.pool = pool or BufferPool(count=2)
        self._fd = os.open(header.path, os.O_RDONLY)

    def read_into(self, buf: torch.Tensor, offset: int) -> torch.Tensor:
        """Fill the uint8 tensor `buf` with the file's bytes from `offset` (absolute)."""
        _read_exact(self._fd, memoryview(buf.numpy()).cast("B"), offset, self.header.path)
        return buf

    def read(self, info: TensorInfo) -> memoryview:
        """A whole tensor's bytes, in a buffer of its own."""
        import torch

        return memoryview(self.read_into(torch.empty(info.nbytes, dtype=torch.uint8), info.start).numpy()).cast("B")

    def blocks(self, start: int, nbytes: int, align: int = 1):
        """(pooled uint8 tensor, release callback) for consecutive blocks of [start, start + nbytes),
        each a multiple of `align` bytes (whole rows) unless a single unit exceeds the pool's buffers."""
        step = max(align, self.pool.nbytes // align * align)
        for off in range(0, nbytes, step):
            n = min(step, nbytes - off)
            buf, release = self.pool.acquire(n)
            try:
                self.read_into(buf, start + off)
            except BaseException:
                release()
                raise
            yield buf, release

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def as_tensor(buf, info: TensorInfo) -> torch.Tensor:
    """Zero-copy, read-only view of raw little-endian bytes as a torch tensor (never written to)."""
    import torch

    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=info.torch_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": we only read it
        return torch.frombuffer(buf, dtype=info.torch_dtype).reshape(info.shape)
