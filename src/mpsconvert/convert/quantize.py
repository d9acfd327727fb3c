"""The data-free pipeline: snapshot -> plan -> shard-by-shard FP8 writer -> artifact + manifest.

Memory stays at a few 16 MiB blocks whatever the model: each tensor is read in blocks of rows
into pooled buffers, quantized on `QUANT_THREADS` threads (or copied byte for byte by the
writer's thread), and streamed into the matching output shard, which goes to disk through
O_DIRECT where the filesystem allows (`safetensors_writer`). The source files are hashed on their
own thread from the start of the run, while torch and transformers load. The artifact folder
is built under a temporary name and renamed at the end. Where the time goes, and what each of
these choices saved, is measured by benchmarks/convert.py (see docs/benchmarks.md).

Which tensors are quantized how is decided in quantize_plan.py, the per-tensor work is in
quantize_tensors.py, the options in quantize_options.py.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..infra import atomic
from ..infra.progress import Progress, or_silent
from ..infra.safetensors_io import DTYPES, BufferPool, ShardReader, read_header
from ..infra.safetensors_writer import FiniteCheck, ShardWriter
from ..manifests import layout
from ..manifests.manifest import Manifest
from ..source.snapshot import Snapshot
from . import guess, plan_child
from .assemble import Shards, assemble
from .quantize_options import Options
from .quantize_plan import estimate_output_bytes, prepare, source_keys
from .quantize_tensors import (
    Shard,
    convert_copy,
    copied_dtype,
    expert_entries,
    linear_entries,
    quantize_expert,
    quantize_one,
)

# Tensors are read, quantized and written in blocks of this size (whole rows): a few of them in
# flight bound the memory a conversion needs beyond the runtime itself, whatever the model.
BLOCK_BYTES = 16 << 20
# Threads that quantize blocks, each with one torch thread: block-level parallelism beats
# intra-op threads on 1M-element chunks. Two on 2 cores (0.1-0.2 s faster than one there, the
# writer thread taking the rest); beyond 4 the single sha256-and-write thread is the limit.
QUANT_THREADS = max(1, min(4, os.cpu_count() or 2))


@contextlib.contextmanager
def converting(snap: Snapshot):
    """The frame of a conversion: one torch thread per quantizing thread (QUANT_THREADS of them:
    the cores left hash and write, and oversubscribed intra-op threads made a whole conversion
    ~15% slower on 2 cores, benchmarks/convert.py); the source hashed from the start, if the
    caller did not start it (it overlaps the planning), and that hashing stopped on a failure."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    snap.start_hashing()
    try:
        yield
    except BaseException:
        snap.stop_hashing()
        raise
    finally:
        torch.set_num_threads(threads)


def quantize_snapshot(
    snap: Snapshot,
    out: Path,
    opts: Options,
    progress: Progress | None = None,
    child: plan_child.PlanChild | None = None,
) -> Manifest:
    """Write the FP8 artifact of `snap` to `out` (atomically) and return its manifest. `child`:
    the plan's child process where the caller started it early (plan_child.start_early)."""
    children = [child] if child is not None else []  # and the one _quantize_snapshot starts, if it does
    try:
        with converting(snap):
            return _quantize_snapshot(snap, out, opts, progress, children)
    finally:
        for c in children:
            c.kill()  # done by now, or not needed (no guess), or the run failed


class _GuessDiffers(Exception):
    """The plan, once built, quantizes other tensors than the guess the shards were written with."""


def _quantize_snapshot(snap: Snapshot, out: Path, opts: Options, progress: Progress | None, children: list) -> Manifest:
    headers = {f: read_header(snap.path / f) for f in snap.weight_files}
    guessed = (
        guess.guess(snap.config, headers, opts.ignore)
        if plan_child.wanted(snap, opts.scheme, opts.trust_remote_code)
        else None
    )
    if guessed is None:
        plan, headers, tensor_module, expert_tensors = prepare(snap, opts, headers)
    else:  # the plan is built by a child process (it imports transformers: seconds) while the shards are written
        if not children:
            children.append(plan_child.PlanChild(snap.path, opts.ignore, snap.weight_files))
        child = children[0]
        prepared = _in_background(lambda: prepare(snap, opts, headers, plan=child.result()))
    min_free = estimate_output_bytes(headers, guessed or tensor_module, opts.scheme)
    with writing(out, opts, min_free, protect=(snap.path,)) as w:
        write = functools.partial(
            _write_shards,
            snap,
            headers,
            opts=opts,
            folder=w.tmp,
            w=w,
            progress=or_silent(progress),
            consumed=source_keys(snap, opts) if snap.fp8 else set(),
        )
        if guessed is None:
            shards = write(tensor_module, expert_tensors)
        else:

            def differs() -> None:  # between shards: a plan built by now that disagrees stops the writing
                if prepared.done() and prepared.result()[2:] != (guessed, {}):
                    raise _GuessDiffers

            try:
                shards = write(guessed, {}, between=differs)
                plan, headers, tensor_module, expert_tensors = prepared.result()
                differs()
                shards.plan_source = (
                    f"guessed from the tensor names while {child.built_by} read the model definition; the two agreed"
                )
            except _GuessDiffers:
                plan, headers, tensor_module, expert_tensors = prepared.result()
                for f in w.tmp.glob("*.safetensors"):
                    f.unlink()
                shards = write(tensor_module, expert_tensors)
                shards.plan_source = (
                    f"the model definition, read by {child.built_by} (the guess from the tensor "
                    "names differed: shards written again)"
                )
        return assemble(w.tmp, snap, plan, opts, shards, Path(out).absolute().name)


@dataclass(frozen=True)
class Writing:
    """What a conversion writes with: the output folder, written atomically (`tmp`, swapped in when
    the block ends cleanly), the pooled read buffers, the shards' background syncs and the
    quantizing threads."""

    tmp: Path
    pool: BufferPool
    syncs: atomic.BackgroundSync
    workers: ThreadPoolExecutor


@contextlib.contextmanager
def writing(out: Path, opts, min_free: int, protect: tuple):
    """The `Writing` of a conversion into `out` (`opts.force` and `opts.delete_unlisted` say what it
    may replace), for the block's length."""
    pool = BufferPool(count=2 * QUANT_THREADS + 8, nbytes=BLOCK_BYTES)
    with (
        atomic.output_dir(
            out,
            force=opts.force,
            min_free=min_free,
            protect=protect,
            delete_unlisted=opts.delete_unlisted,
            **layout.OUTPUT_RULES,
        ) as tmp,
        atomic.BackgroundSync() as syncs,
        ThreadPoolExecutor(max_workers=QUANT_THREADS, thread_name_prefix="mpsconvert-quant") as workers,
    ):
        yield Writing(tmp, pool, syncs, workers)


def _in_background(fn) -> Future:
    """`fn()` on a daemon thread (a failed or interrupted run exits without waiting for it)."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # delivered to whoever asks for the result
            fut.set_exception(e)

    threading.Thread(target=run, name="mpsconvert-plan", daemon=True).start()
    return fut


def _write_shards(
    snap: Snapshot,
    headers: dict,
    tensor_module: dict,
    expert_tensors: dict,
    opts: Options,
    folder: Path,
    w: Writing,
    progress,
    consumed: set = frozenset(),
    shard_names: Callable[[int], list[str]] = layout.shard_names,
    between: Callable[[], None] = lambda: None,
) -> Shards:
    """Stream every source shard into its output shards in `folder` (more than one where its output would
    exceed `opts.max_shard_size`, named by `shard_names`): quantized tensors first, then the ones
    copied as they are (the writer thread copies those, an embedding is half a GB, while this
    thread goes on)."""
    scheme = opts.scheme
    out = Shards()
    total = out.bytes_in = sum(h.file_size for h in headers.values())
    done = [0]

    def advance(nbytes: int, name: str) -> None:
        done[0] += nbytes
        progress("quantize", done[0], total, name)

    groups = []  # (source shard, its tensors that go into one output shard, their header entries)
    for src_name in snap.weight_files:
        header = headers[src_name]
        work = [n for n in header.tensors if n in tensor_module or n in expert_tensors]
        work += [n for n in header.tensors if n not in tensor_module and n not in expert_tensors and n not in consumed]
        start = len(groups)
        names, entries, size = [], [], 0
        for name in work:
            info = header.tensors[name]
            if name in tensor_module:
                mine = linear_entries(name, tuple(info.shape), scheme, opts.scale_leaf)
            elif name in expert_tensors:
                mine = expert_entries(name, info, expert_tensors[name], scheme)
            else:
                mine = [(name, copied_dtype(info, opts), info.shape)]
            nbytes = sum(DTYPES[code][0] * math.prod(shape) for _, code, shape in mine)
            if names and size + nbytes > opts.max_shard_size:
                groups.append((src_name, names, entries))
                names, entries, size = [], [], 0
            names.append(name)
            entries += mine
            size += nbytes
        if names or len(groups) == start:  # a source shard with nothing left to write still gets its (empty) file
            groups.append((src_name, names, entries))
    behind: deque = deque()  # (name, writer) of shards whose last copies and writes are still running

    def finished(out_name: str, writer: ShardWriter) -> None:
        out.files[out_name] = {"sha256": writer.digest, "size": writer.size}  # waits for that writer
        out.write_modes.add(writer.write_mode)

    for (src_name, work, entries), out_name in zip(groups, shard_names(len(groups))):
        between()
        while len(behind) > 1:  # one shard's writer may finish (its embedding copy) while the next one starts
            finished(*behind.popleft())
        header = headers[src_name]
        with (
            ShardReader(header, w.pool) as reader,
            ShardWriter(folder / out_name, entries, metadata={"format": "pt"}) as writer,
        ):
            with Shard(reader, writer, w.workers, QUANT_THREADS + 1, out.tensors).running() as sh:
                for name in work:
                    info = header.tensors[name]
                    if name in tensor_module:
                        quantize_one(sh, name, info, tensor_module[name], scheme, opts)
                    elif name in expert_tensors:
                        quantize_expert(sh, name, info, expert_tensors[name], scheme, opts)
                    elif copied_dtype(info, opts) != info.dtype:
                        convert_copy(sh, name, info, opts.dtype_code, FiniteCheck(info.dtype, name, src_name))
                    else:  # NaN/inf in a tensor copied as it is is refused, counted as it is copied
                        sh.then(
                            writer.copy,
                            name,
                            header.path,
                            info.start,
                            info.nbytes,
                            (FiniteCheck(info.dtype, name, src_name),),
                        )
                    sh.then(advance, info.nbytes, name)
        w.syncs.add(writer.sync)
        for name, *_ in entries:
            out.weight_map[name] = out_name
        behind.append((out_name, writer))
        out.bytes_out += writer.size
    while behind:
        finished(*behind.popleft())
    return out
