"""The data-free pipeline: snapshot -> plan -> shard-by-shard FP8 writer -> artifact + manifest.

Memory stays at a few 16 MiB blocks whatever the model: each tensor is read in blocks of rows
into pooled buffers, quantized on `QUANT_THREADS` threads (or copied byte for byte by the
writer's thread), and streamed into the matching output shard, which goes to disk through
O_DIRECT where the filesystem allows (`safetensors_io`). The source files are hashed on their
own thread from the start of the run, while torch and transformers load. The artifact folder
is built under a temporary name and renamed at the end. Where the time goes, and what each of
these choices saved, is measured by benchmarks/convert.py (see the README).

MoE experts are quantized in the layout the checkpoint has (see `moe_layout`): one 2-D tensor
per expert and projection is quantized exactly like a Linear weight (`<m>.weight` F8 +
`<m>.weight_scale` [N, 1] or [1] + `<m>.input_scale` [1]: the names vLLM's and transformers'
compressed-tensors MoE loaders read). A fused 3-D tensor `<p>` [E, N, K] is by default
written as those same per-expert tensors, under the names transformers' save mapping gives
them (`experts_layout="per-expert"`): transformers + compressed-tensors and vLLM load only
per-expert FP8 experts (transformers would read fused FP8 codes as BF16 values, ignoring the
scales). `experts_layout="checkpoint"` keeps it fused: `<p>` F8 [E, N, K] with `<p>_scale`
[E, N, 1] (row) or [E, 1, 1] (tensor) and `<p>_input_scale` [E]; mpsconvert's runtime loads both.
"""

from __future__ import annotations

import functools
import math
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import atomic
from ..errors import QuantizationError, SourceError
from ..manifests import layout
from ..manifests.layout import INDEX_NAME
from ..manifests.manifest import Manifest
from ..manifests.schemes import Scheme
from ..moe_layout import ExpertParam, find_layout
from ..safetensors_io import BufferPool, ShardReader, ShardWriter, TensorInfo, read_header
from ..source import Snapshot
from .. import fp8
from ..progress import Progress, or_silent
from ..targets import Plan, plan_for
from . import EXPERTS_LAYOUTS
from .assemble import Shards, assemble

# Tensors are read, quantized and written in blocks of this size (whole rows): a few of them in
# flight bound the memory a conversion needs beyond the runtime itself, whatever the model.
BLOCK_BYTES = 16 << 20
# Threads that quantize blocks, each with one torch thread: block-level parallelism beats
# intra-op threads on 1M-element chunks. Two on 2 cores (0.1-0.2 s faster than one there, the
# writer thread taking the rest); beyond 4 the single sha256-and-write thread is the limit.
QUANT_THREADS = max(1, min(4, os.cpu_count() or 2))


@dataclass
class Options:
    scheme: Scheme = field(default_factory=Scheme)
    ignore: list[str] = field(default_factory=list)
    force: bool = False
    trust_remote_code: bool = False
    # Static activation scales (module -> dequant scale), required by the "fp8" scheme. MoE
    # experts: "<experts module>.<param>" -> one scale per expert (calibrate.experts).
    input_scales: dict[str, float | list[float]] | None = None
    calibration: dict | None = None  # what produced input_scales, for the manifest
    device: str = "cpu"
    # Fused 3-D experts in the checkpoint: "per-expert" (write them split, loadable everywhere)
    # or "checkpoint" (keep them fused: only mpsconvert's runtime loads that).
    experts_layout: str = "per-expert"

    def __post_init__(self):
        if self.experts_layout not in EXPERTS_LAYOUTS:
            raise QuantizationError(f"unknown experts layout {self.experts_layout!r}", f"use one of: {', '.join(EXPERTS_LAYOUTS)}")

    def expert_input_scale(self, ep: ExpertParam, expert: int, module: str | None = None) -> float | None:
        """A calibrated input scale of one expert: `input_scales[<experts module>.<param>]`
        ([E] values, as `calibrate.experts` writes them) or a per-module float."""
        scales = self.input_scales or {}
        if ep.name in scales:
            return float(scales[ep.name][expert])
        if module is not None and module in scales:
            return float(scales[module])
        return None


@dataclass(frozen=True)
class ExpertTensor:
    """A checkpoint tensor holding MoE expert weights: one expert's rows, or a fused [E, N, K]."""

    param: ExpertParam
    expert: int | None  # None: the fused tensor of all experts
    split: tuple = ()  # fused tensor written as these per-expert slices (moe_layout.Slice)

    @property
    def module(self) -> str:
        return self.param.name


def _expert_tensors(plan: Plan, headers: dict, experts_layout: str) -> dict[str, ExpertTensor]:
    """checkpoint key -> the expert weight it holds, for every experts module we can quantize;
    the others go to `plan.skipped` with the reason."""
    if not plan.experts:
        return {}
    stored = {name: tuple(info.shape) for h in headers.values() for name, info in h.tensors.items() if info.dtype in ("F32", "F16", "BF16")}
    found: dict[str, ExpertTensor] = {}
    plan.expert_layout = find_layout(plan.meta_model, stored)
    for ep in plan.expert_layout.values():
        if ep.layout == "fused":
            found[ep.key] = ExpertTensor(ep, None, tuple(ep.split) if experts_layout == "per-expert" else ())
        elif ep.layout == "per-expert":
            for sl in ep.slices:
                found[sl.key] = ExpertTensor(ep, sl.expert)
        else:
            plan.skipped[ep.name] = f"MoE experts ({ep.layout}): {ep.why}"
    return found


def _finalize_plan(plan: Plan, headers: dict) -> dict[str, str]:
    """tensor name -> module, for the quantized Linears actually present in the checkpoint.

    A planned Linear whose weight is not stored (tied, or saved under another key) is moved to
    the ignore list, so loaders never expect scales that do not exist.
    """
    found: dict[str, str] = {}
    for h in headers.values():
        for name, info in h.tensors.items():
            mod = plan.module_for_tensor(name)
            if mod is not None and len(info.shape) == 2 and info.dtype in ("F32", "F16", "BF16"):
                found[name] = mod
    present = set(found.values())
    for mod in list(plan.quantize):
        if mod not in present:
            del plan.quantize[mod]
            plan.ignored[mod] = "no float 2-D weight stored under this module's name in the checkpoint: kept as is"
    return found


def check_tensor_layout(snap: Snapshot, headers: dict) -> None:
    """No tensor stored twice, and the index (if any) agrees with what the shards hold."""
    seen: dict[str, str] = {}
    for f, h in headers.items():
        for name in h.tensors:
            if name in seen:
                raise SourceError(f"tensor {name!r} is stored in both {seen[name]} and {f}", "the checkpoint is corrupt; re-download it")
            seen[name] = f
    if snap.weight_map:
        for name, f in snap.weight_map.items():
            if seen.get(name) != f:
                where = f"in {seen[name]}" if name in seen else "in no shard"
                raise SourceError(f"{INDEX_NAME} puts {name!r} in {f}, but it is {where}", "the checkpoint is corrupt; re-download it")
        extra = sorted(set(seen) - set(snap.weight_map))
        if extra:
            raise SourceError(f"{len(extra)} stored tensors are missing from {INDEX_NAME} (e.g. {extra[0]!r})", "the checkpoint is corrupt; re-download it")


def estimate_output_bytes(headers: dict, tensor_module: dict, scheme: Scheme) -> int:
    """Bytes the artifact will take: FP8 weights, their scales, copied tensors, plus slack."""
    total = 1 << 20
    for h in headers.values():
        for name, info in h.tensors.items():
            if name in tensor_module:
                total += math.prod(info.shape) + 4 * math.prod(scheme.scale_shape(*info.shape[-2:])) + 8  # 1-byte codes + F32 scales
            else:
                total += info.nbytes
        total += h.data_start
    return total


def quantize_snapshot(snap: Snapshot, out: Path, opts: Options, progress: Progress | None = None) -> Manifest:
    """Write the FP8 artifact of `snap` to `out` (atomically) and return its manifest."""
    # One torch thread per quantizing thread (QUANT_THREADS of them): the cores left hash and
    # write, and oversubscribed intra-op threads made a whole conversion ~15% slower on 2 cores
    # (benchmarks/convert.py).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    snap.start_hashing()  # if the caller did not already: overlaps the planning below
    try:
        return _quantize_snapshot(snap, out, opts, progress)
    except BaseException:
        snap.stop_hashing()
        raise
    finally:
        torch.set_num_threads(threads)


def _quantize_snapshot(snap: Snapshot, out: Path, opts: Options, progress: Progress | None = None) -> Manifest:
    plan, headers, tensor_module, expert_tensors = _prepare(snap, opts)
    pool = BufferPool(count=2 * QUANT_THREADS + 8, nbytes=BLOCK_BYTES)
    with (
        atomic.output_dir(out, force=opts.force, min_free=estimate_output_bytes(headers, tensor_module, opts.scheme)) as tmp,
        atomic.BackgroundSync() as syncs,
        ThreadPoolExecutor(max_workers=QUANT_THREADS, thread_name_prefix="mpsconvert-quant") as workers,
    ):
        shards = _write_shards(snap, headers, tensor_module, expert_tensors, opts, tmp, pool, workers, syncs, or_silent(progress))
        return assemble(tmp, snap, plan, opts, shards)


def _prepare(snap: Snapshot, opts: Options):
    """The plan, the checked shard headers, and which checkpoint tensors get quantized how."""
    plan = plan_for(snap.path, opts.ignore, opts.trust_remote_code)
    headers = {f: read_header(snap.path / f) for f in snap.weight_files}
    check_tensor_layout(snap, headers)
    tensor_module = _finalize_plan(plan, headers)
    expert_tensors = _expert_tensors(plan, headers, opts.experts_layout)
    if opts.scheme.needs_calibration:
        missing = sorted(set(tensor_module.values()) - set(opts.input_scales or {}))
        missing += sorted({et.module for key, et in expert_tensors.items() if not _has_input_scales(opts, key, et)})
        if missing:
            raise QuantizationError(
                f"scheme fp8 needs a calibrated input scale for every quantized Linear and expert; {len(missing)} have none (e.g. {missing[0]})",
                "run calibration (`mpsconvert quantize --scheme fp8 --calib-data ...` or `mpsconvert calibrate`)",
            )
    return plan, headers, tensor_module, expert_tensors


def _write_shards(snap: Snapshot, headers: dict, tensor_module: dict, expert_tensors: dict, opts: Options, tmp: Path,
                  pool: BufferPool, workers: ThreadPoolExecutor, syncs, progress) -> Shards:
    """Stream every source shard into its output shard: quantized tensors first, then the ones
    copied as they are (the writer thread copies those, an embedding is half a GB, while this
    thread goes on to the next shard)."""
    scheme = opts.scheme
    out = Shards()
    total = sum(h.file_size for h in headers.values())
    done = [0]

    def advance(nbytes: int, name: str) -> None:
        done[0] += nbytes
        progress("quantize", done[0], total, name)

    for src_name, out_name in zip(snap.weight_files, layout.shard_names(len(snap.weight_files))):
        header = headers[src_name]
        work = [n for n in header.tensors if n in tensor_module or n in expert_tensors]
        work += [n for n in header.tensors if n not in tensor_module and n not in expert_tensors]
        entries = []
        for name in work:
            info = header.tensors[name]
            if name in tensor_module:
                entries += _linear_entries(name, tuple(info.shape), scheme)
            elif name in expert_tensors:
                entries += _expert_entries(name, info, expert_tensors[name], scheme)
            else:
                entries.append((name, info.dtype, info.shape))
        with ShardReader(header, pool) as reader, ShardWriter(tmp / out_name, entries, metadata={"format": "pt"}) as writer:
            sh = _Shard(reader, writer, workers, QUANT_THREADS + 1, out.tensors)
            try:
                for name in work:
                    info = header.tensors[name]
                    if name in tensor_module:
                        _quantize_one(sh, name, info, tensor_module[name], scheme, opts)
                    elif name in expert_tensors:
                        _quantize_expert(sh, name, info, expert_tensors[name], scheme, opts)
                    else:
                        sh.then(writer.copy, name, header.path, info.start, info.nbytes)
                    sh.then(advance, info.nbytes, name)
                sh.pump(0)
            except BaseException:
                sh.abandon()
                raise
        syncs.add(writer.sync)
        for name, *_ in entries:
            out.weight_map[name] = out_name
        out.files[out_name] = {"sha256": writer.digest, "size": writer.size}
        out.write_modes.add(writer.write_mode)
        out.bytes_in += header.file_size
        out.bytes_out += writer.size
    return out


@dataclass
class _Shard:
    """The ordered pipeline of one shard: blocks are quantized on the worker threads, up to
    `parallel` steps ahead, across tensor boundaries (most Linear weights are one or two
    blocks), while writes and the steps that need a finished tensor (its scale, its record)
    run here, in the order they were queued."""

    reader: ShardReader
    writer: ShardWriter
    workers: ThreadPoolExecutor
    parallel: int
    records: dict  # tensor name -> manifest record, filled as tensors finish
    pending: deque = field(default_factory=deque)

    def block(self, out_name: str, fn, *args) -> None:
        """Run `fn(*args) -> (codes, release)` on a worker; its codes are appended to `out_name`."""
        self.pending.append((out_name, self.workers.submit(fn, *args)))
        self.pump(self.parallel)

    def then(self, fn, *args) -> None:
        """Run `fn(*args)` here once everything queued before it is written."""
        self.pending.append((None, functools.partial(fn, *args)))
        self.pump(self.parallel)

    def pump(self, limit: int) -> None:
        while self.pending and (len(self.pending) > limit or self.pending[0][0] is None or self.pending[0][1].done()):
            out_name, job = self.pending.popleft()
            if out_name is None:
                job()
            else:
                self.writer.write(out_name, *job.result())

    def abandon(self) -> None:
        """After an error: let the workers finish with their buffers, drop what is queued."""
        for out_name, job in self.pending:
            if out_name is not None and not job.cancel():
                job.exception()
        self.pending.clear()


def _quantize_one(
    sh: _Shard, name: str, info: TensorInfo, module: str, scheme: Scheme, opts: Options, input_scale: float | None = None,
    **extra,
) -> None:
    n, k = info.shape
    _quantize_rows(sh, name, info, 0, n, k, module, scheme, opts, input_scale, **extra)


def _quantize_matrix(sh: _Shard, out_name: str, info: TensorInfo, first_row: int, n: int, k: int, scheme: Scheme, name: str,
                     done: Callable[[torch.Tensor, fp8.QuantStats], None]) -> None:
    """Rows [first_row, first_row + n) of a float tensor seen as [rows, K] -> e4m3 codes appended
    to `out_name`, block by block (pooled buffers, so memory stays at a few blocks; for block
    scales each read is whole blocks of rows); then `done(scale, stats)`, in order."""
    elem = info.nbytes // max(1, math.prod(info.shape))
    row_bytes = k * elem
    start, nbytes = info.start + first_row * row_bytes, n * row_bytes
    qz = fp8.StreamQuantizer(n, k, scheme.weights, name, block=scheme.block_size)
    align = row_bytes * (scheme.block or 1)

    def rows(buf: torch.Tensor) -> torch.Tensor:
        return buf.view(info.torch_dtype).view(-1, k)

    def quantize_block(buf: torch.Tensor, release, out: torch.Tensor, give_back, row: int):
        try:
            return qz.quantize(rows(buf), out=out.view(fp8.FP8_DTYPE).view(-1, k), start=row), give_back
        finally:
            release()

    blocks = sh.reader.blocks(start, nbytes, align)
    if qz.needs_observe and nbytes <= sh.reader.pool.nbytes:  # one block: read it once
        blocks = list(blocks)
        qz.observe(rows(blocks[0][0]))
    elif qz.needs_observe:  # per-tensor scale: a first pass for the amax (page-cache reads)
        for buf, release in blocks:
            try:
                qz.observe(rows(buf))
            finally:
                release()
        blocks = sh.reader.blocks(start, nbytes, align)
    row = 0
    for buf, release in blocks:
        # The code buffer is taken here, not on the worker: only this thread ever waits for the
        # pool, and what it waits for (workers, the writer) never waits for it.
        out, give_back = sh.reader.pool.acquire(buf.numel() // elem)  # one byte per weight
        sh.block(out_name, quantize_block, buf, release, out, give_back, row)
        row += buf.numel() // row_bytes
    sh.then(lambda: done(*qz.finish()))


def _quantize_rows(
    sh: _Shard, out_name: str, info: TensorInfo, first_row: int, n: int, k: int, module: str,
    scheme: Scheme, opts: Options, input_scale: float | None, **extra,
) -> None:
    """One 2-D weight (or rows of a fused one) -> `<m>.weight` codes, `<m>.weight_scale`
    (+ `<m>.input_scale`), and its record (with `extra` fields) in `sh.records`."""
    if scheme.needs_calibration:  # checked before any work is queued
        input_scale = _check_input_scale(input_scale if input_scale is not None else float(opts.input_scales[module]), module)

    def done(scale: torch.Tensor, stats: fp8.QuantStats) -> None:
        sh.writer.write(out_name + "_scale", scale.contiguous())
        record = {
            "module": module,
            "shape": [n, k],
            "source_dtype": info.dtype,
            "dtype": "F8_E4M3",
            "weight_scale_shape": list(scale.shape),
            **stats.as_dict(),
            **extra,
        }
        if scheme.needs_calibration:
            sh.writer.write(out_name[: -len("weight")] + "input_scale", torch.tensor([input_scale], dtype=torch.float32))
            record["input_scale"] = input_scale
        sh.records[out_name] = record

    _quantize_matrix(sh, out_name, info, first_row, n, k, scheme, out_name, done)


def _expert_entries(name: str, info: TensorInfo, et: ExpertTensor, scheme: Scheme) -> list:
    """Header entries written in place of one expert checkpoint tensor."""
    if et.expert is not None:  # one expert's 2-D rows: exactly a Linear weight
        return _linear_entries(name, tuple(info.shape), scheme)
    E, N, K = info.shape
    if et.split:
        return [e for sl in et.split for e in _linear_entries(sl.key, (sl.stop - sl.start, K), scheme)]
    entries = [(name, "F8_E4M3", info.shape), (name + "_scale", "F32", scheme.experts_scale_shape(E, N, K))]
    if scheme.needs_calibration:
        entries.append((name + "_input_scale", "F32", (E,)))
    return entries


def _has_input_scales(opts: Options, key: str, et: ExpertTensor) -> bool:
    if et.expert is not None:
        return opts.expert_input_scale(et.param, et.expert, key[: -len(".weight")]) is not None
    if et.split:
        return all(opts.expert_input_scale(et.param, sl.expert, sl.key[: -len(".weight")]) is not None for sl in et.split)
    return all(opts.expert_input_scale(et.param, e) is not None for e in range(et.param.num_experts))


def _linear_entries(name: str, shape: tuple, scheme: Scheme) -> list:
    """Header entries of one quantized 2-D weight: codes, weight_scale (+ input_scale)."""
    entries = [(name, "F8_E4M3", shape), (name + "_scale", "F32", scheme.scale_shape(*shape))]
    if scheme.needs_calibration:
        entries.append((name[: -len("weight")] + "input_scale", "F32", (1,)))
    return entries


def _quantize_expert(sh: _Shard, name: str, info: TensorInfo, et: ExpertTensor, scheme: Scheme, opts: Options) -> None:
    if et.expert is not None:
        module = name[: -len(".weight")]
        _quantize_one(sh, name, info, module, scheme, opts, input_scale=opts.expert_input_scale(et.param, et.expert, module),
                      experts_module=et.param.module, param=et.param.param, expert=et.expert)
        return
    E, N, K = info.shape
    if et.split:  # write the fused tensor as per-expert Linear weights
        for sl in et.split:
            module = sl.key[: -len(".weight")]
            _quantize_rows(sh, sl.key, info, sl.expert * N + sl.start, sl.stop - sl.start, K, module, scheme, opts,
                           opts.expert_input_scale(et.param, sl.expert, module),
                           experts_module=et.param.module, param=et.param.param, expert=sl.expert, split_from=name)
        return
    vals = [opts.expert_input_scale(et.param, e) for e in range(E)] if scheme.needs_calibration else []
    for e, v in enumerate(vals):
        _check_input_scale(v, f"{et.module}[expert {e}]")
    scales, per_expert = [], []

    def expert_done(scale: torch.Tensor, stats: fp8.QuantStats) -> None:
        scales.append(scale if scheme.block else scale.reshape(-1, 1))
        per_expert.append(stats)

    for e in range(E):
        _quantize_matrix(sh, name, info, e * N, N, K, scheme, f"{name}[{e}]", expert_done)

    def done() -> None:
        sh.writer.write(name + "_scale", torch.stack(scales).contiguous())
        sqnrs = [s.sqnr_db for s in per_expert]
        record = {
            "module": et.module,
            "experts_module": et.param.module,
            "param": et.param.param,
            "shape": list(info.shape),
            "source_dtype": info.dtype,
            "dtype": "F8_E4M3",
            "weight_scale_shape": list(scheme.experts_scale_shape(E, N, K)),
            "amax": max(s.amax for s in per_expert),
            "scale_min": min(s.scale_min for s in per_expert),
            "scale_max": max(s.scale_max for s in per_expert),
            # the worst expert stands for the tensor, each expert's own figure is listed
            "sqnr_db": None if all(math.isinf(x) for x in sqnrs) else round(min(sqnrs), 4),
            "experts_sqnr_db": [None if math.isinf(x) else round(x, 4) for x in sqnrs],
            "zero_rows": sum(s.zero_rows for s in per_expert),
        }
        if scheme.needs_calibration:
            sh.writer.write(name + "_input_scale", torch.tensor(vals, dtype=torch.float32))
            record["input_scale"] = vals
        sh.records[name] = record

    sh.then(done)


def _check_input_scale(s: float | None, what: str) -> float:
    if s is None or not (math.isfinite(s) and s > 0):
        raise QuantizationError(f"calibrated input scale of {what} is {s}", "re-run calibration")
    return s
