"""Read an artifact's shards once each: hash the bytes as they arrive and copy every tensor's
bytes straight to its place on the device.

Why by hand: hashing every file (one pass over 9 GB for an 8B model), then reading it again
through safetensors, tensor by tensor, into pageable memory, casting it and copying it to the GPU
synchronously takes 11x BF16's `from_pretrained` on an H200. Here each shard is read on a
thread of its own, sequentially, in blocks, into a small ring of pinned buffers; each block goes
into the file's sha256 (hashlib releases the GIL) and, where it holds tensor bytes that the
model needs, is copied asynchronously (a CUDA stream per thread) into the destination tensor,
which the caller allocated on the device in its final shape. A file is read exactly once, and
the hash is of the very bytes that were loaded. sha256 of one file is sequential, so the
shards' hashes run in parallel and the largest shard bounds the time.

Destinations are contiguous tensors of any dtype; their bytes are filled as stored (dtype
conversions, scale layouts, expert assembly are the caller's, after this). On CPU the blocks are
plain memory and the copies are memcpys.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ...infra.safetensors_io import Header, _read_exact

BLOCK = 16 << 20  # bytes per read: large enough for the disk and hashlib, small enough to pin cheaply
RING = 3  # pinned buffers per shard thread: one being read and hashed while earlier ones copy


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("stream destinations must be contiguous")
    return t.reshape(-1).view(torch.uint8)


class _Progress:
    def __init__(self, progress, total: int):
        self.progress, self.total, self.done = progress, total, 0
        self._lock = threading.Lock()

    def add(self, n: int, detail: str) -> None:
        if self.progress is None:
            return
        with self._lock:
            self.done += n
            self.progress("load", self.done, self.total, detail)


def _read_shard(
    header: Header, dests: dict[str, torch.Tensor], device: torch.device, hash_it: bool, block: int, prog: _Progress
) -> str | None:
    spans = sorted((header.tensors[n].start, header.tensors[n].end, _bytes(t)) for n, t in dests.items())
    cuda = device.type == "cuda"
    size = header.file_size
    block = max(1, min(block, size))
    bufs = [torch.empty(block, dtype=torch.uint8, pin_memory=cuda) for _ in range(RING if cuda else 1)]
    events = [None] * len(bufs)
    stream = torch.cuda.Stream(device) if cuda else None
    h = hashlib.sha256() if hash_it else None
    fd = os.open(header.path, os.O_RDONLY)
    try:
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            pos, i, k = 0, 0, 0
            while pos < size:
                n = min(block, size - pos)
                slot = k % len(bufs)
                if events[slot] is not None:
                    events[slot].synchronize()  # the copies out of this buffer are done
                buf = bufs[slot]
                view = memoryview(buf.numpy())[:n]
                _read_exact(fd, view, pos, header.path)
                if h is not None:
                    h.update(view)
                end = pos + n
                while i < len(spans) and spans[i][1] <= pos:
                    i += 1
                j = i
                while j < len(spans) and spans[j][0] < end:
                    s, e, dst = spans[j]
                    a, b = max(s, pos), min(e, end)
                    if b > a:
                        dst[a - s : b - s].copy_(buf[a - pos : b - pos], non_blocking=cuda)
                    j += 1
                if cuda:
                    events[slot] = torch.cuda.Event()
                    events[slot].record(stream)
                prog.add(n, header.path.name)
                pos, k = end, k + 1
            if cuda:
                stream.synchronize()
    finally:
        os.close(fd)
    return h.hexdigest() if h is not None else None


def read_shards(
    headers: list[Header],
    dests: dict[str, torch.Tensor],
    device: torch.device,
    *,
    hash_files: bool = True,
    extra_files: dict[str, Path] | None = None,
    block: int = BLOCK,
    threads: int | None = None,
    progress=None,
) -> dict[str, str | None]:
    """Fill `dests` (checkpoint key -> contiguous tensor on `device`) from the shards, each read
    once on its own thread; returns {file name: sha256} for every shard (and every file of
    `extra_files`, name -> path, hashed beside them), or None per file when `hash_files` is False."""
    extra_files = extra_files or {}
    by_shard = []
    for hd in headers:
        mine = {n: dests[n] for n in hd.tensors if n in dests}
        for n, t in mine.items():
            if t.numel() * t.element_size() != hd.tensors[n].nbytes:
                raise ValueError(
                    f"destination of {n} holds {t.numel() * t.element_size()} bytes, the file {hd.tensors[n].nbytes}"
                )
        by_shard.append((hd, mine))
    prog = _Progress(progress, sum(hd.file_size for hd in headers))
    workers = threads or max(
        1, min(len(headers), os.cpu_count() or 2)
    )  # sha256 of one file is one core's work: a thread per file
    out: dict[str, str | None] = {}
    with ThreadPoolExecutor(
        max_workers=workers + (1 if extra_files else 0), thread_name_prefix="mpsconvert-load"
    ) as pool:
        futs = {
            hd.path.name: pool.submit(_read_shard, hd, mine, device, hash_files, block, prog) for hd, mine in by_shard
        }
        extra = None
        if extra_files and hash_files:
            from ...manifests.hashing import sha256_file

            extra = pool.submit(lambda: {name: sha256_file(Path(p)) for name, p in extra_files.items()})
        for name, fut in futs.items():
            out[name] = fut.result()
        out.update(extra.result() if extra is not None else dict.fromkeys(extra_files))
    return out
