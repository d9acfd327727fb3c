"""The per-tensor work of the streaming writer: the ordered pipeline of one output shard (`Shard`),
a weight quantized block by block (or an FP8 source's codes re-packed), MoE experts, and tensors
copied or cast; plus the header entries each of them takes in the output shard.

MoE experts are quantized in the layout the checkpoint has (see `moe_layout`): one 2-D tensor
per expert and projection is quantized exactly like a Linear weight (`<m>.weight` F8 +
`<m>.weight_scale` [N, 1] or [1] + `<m>.input_scale` [1]: the names vLLM's and transformers'
compressed-tensors MoE loaders read). A fused 3-D tensor `<p>` [E, N, K] is by default
written as those same per-expert tensors, under the names transformers' save mapping gives
them (`experts_layout="per-expert"`): transformers + compressed-tensors and vLLM load only
per-expert FP8 experts (transformers would read fused FP8 codes as BF16 values, ignoring the
scales). `experts_layout="checkpoint"` keeps it fused: `<p>` F8 [E, N, K] with `<p>_scale`
[E, N, 1] (row) or [E, 1, 1] (tensor) and `<p>_input_scale` [E]; mpsconvert's runtime loads both.

A source that is already FP8 (`Snapshot.fp8`: FineGrainedFP8 or compressed-tensors) is re-packed
by default: its e4m3 codes are copied byte for byte (their sha256 recorded per tensor), its
scales renamed and reshaped into compressed-tensors' `<m>.weight_scale`. Only the modules the
source stores in FP8 are quantized; what it kept in full precision stays so. Another scheme or
granularity dequantizes each block of rows with the source's scales and quantizes it again
(rounding twice; the manifest's SQNR is then that of the round trip against the source).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import QuantizationError
from ..format import fp8
from ..format.scales import scale_problem
from ..format.schemes import Scheme
from ..infra.safetensors_io import DTYPES, ShardReader, TensorInfo, torch_dtype
from ..infra.safetensors_writer import Digest, FiniteCheck, ShardWriter
from . import FLOAT_CODES
from .quantize_options import ExpertTensor, Options, SourceTensor


def copied_dtype(info: TensorInfo, opts: Options) -> str:
    """The stored dtype of a tensor that is not quantized: --dtype for float tensors, else its own."""
    return opts.dtype_code if opts.dtype_code and info.dtype in FLOAT_CODES else info.dtype


def convert_copy(sh: "Shard", name: str, info: TensorInfo, code: str, check: FiniteCheck) -> None:
    """An unquantized float tensor cast to `code`, block by block (whole elements per block), its
    values checked for NaN/inf on the way (`check`)."""
    src_size, target = DTYPES[info.dtype][0], torch_dtype(code)
    for buf, release in sh.reader.blocks(info.start, info.nbytes, src_size):
        try:
            check.update(buf.numpy())
            src = buf.view(info.torch_dtype)
            out = src.to(target)  # a new tensor: the pooled buffer goes back at once
            if not check.count and not bool(torch.isfinite(out).all()):  # a finite source: the cast overflowed
                big = float(src.float().abs().max())
                raise QuantizationError(
                    f"tensor {name!r} holds values up to {big:.4g}, which --dtype {target} turns into inf",
                    "use --dtype bfloat16 (float32's range), or leave --dtype out to copy it as it is",
                )
        finally:
            release()
        sh.then(sh.writer.write, name, out)
    check.done()


@dataclass
class Shard:
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

    @contextlib.contextmanager
    def running(self):
        """The block that queues this shard's work: leaving it runs what is still queued; an error abandons it."""
        try:
            yield self
            self.pump(0)
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """After an error: let the workers finish with their buffers, drop what is queued."""
        for out_name, job in self.pending:
            if out_name is not None and not job.cancel():
                job.exception()
        self.pending.clear()


def quantize_one(
    sh: Shard,
    name: str,
    info: TensorInfo,
    module: str,
    scheme: Scheme,
    opts: Options,
    input_scale: float | None = None,
    **extra,
) -> None:
    n, k = info.shape
    src = opts.fp8_tensors.get(name) if info.dtype == "F8_E4M3" else None
    if src is not None and opts.repack:
        _repack_one(sh, name, info, module, scheme, src, **extra)
        return
    if src is not None:  # another scheme than the source's: dequantize its rows, quantize again
        decode = functools.partial(src.decode, source=opts.source_scheme)
        extra = {
            **extra,
            "requantized_from": f"FP8 source ({opts.source_scheme.weights} scales); sqnr_db is the round trip's",
        }
        input_scale = None
        _quantize_rows(sh, Rows(name, info, 0, n, k), module, scheme, opts, input_scale, decode=decode, **extra)
        return
    _quantize_rows(sh, Rows(name, info, 0, n, k), module, scheme, opts, input_scale, **extra)


def _repack_one(
    sh: Shard, name: str, info: TensorInfo, module: str, scheme: Scheme, src: SourceTensor, **extra
) -> None:
    """An FP8 source weight kept as it is: its codes copied byte for byte (their sha256, for the
    manifest, taken in the same read: the writer fills it in once the copy is through, before the
    shard's digest), its scale written as `<m>.weight_scale` (float32, compressed-tensors' shape)."""
    n, k = info.shape
    scale = src.scale.reshape(scheme.scale_shape(n, k)).contiguous()
    rec = sh.records[name] = {
        "module": module,
        "shape": [n, k],
        "source_dtype": "F8_E4M3",
        "dtype": "F8_E4M3",
        "weight_scale_shape": list(scale.shape),
        "codes": "copied from the source, byte for byte",
        "codes_sha256": None,  # filled by the copy
        "source_scale": src.scale_key,
        "scale_min": float(scale.min()),
        "scale_max": float(scale.max()),
        "sqnr_db": None,  # exact: the source's own values
        **({"input_scale": float(src.input_scale.reshape(()))} if scheme.needs_calibration else {}),
        **extra,
    }
    sh.then(
        sh.writer.copy,
        name,
        sh.reader.header.path,
        info.start,
        info.nbytes,
        (
            Digest(lambda d: rec.__setitem__("codes_sha256", d)),
            FiniteCheck(info.dtype, name, sh.reader.header.path.name),
        ),
    )
    sh.then(sh.writer.write, name + "_scale", scale)
    if scheme.needs_calibration:
        sh.then(sh.writer.write, name[: -len("weight")] + "input_scale", src.input_scale.reshape(1).contiguous())


@dataclass(frozen=True)
class Rows:
    """Rows [first, first + n) of `info`'s tensor seen as [rows, k], written as the tensor `out`."""

    out: str
    info: TensorInfo
    first: int
    n: int
    k: int


def quantize_matrix(
    sh: Shard,
    part: Rows,
    scheme: Scheme,
    name: str,
    done: Callable[[torch.Tensor, fp8.QuantStats], None],
    decode: Callable | None = None,
    spans: list | None = None,
) -> None:
    """`part`'s rows of a float tensor -> e4m3 codes appended to `part.out`, block by block
    (pooled buffers, so memory stays at a few blocks; for block scales each read is whole blocks
    of rows); then `done(scale, stats)`, in order. `spans`
    ((reader, byte start, nbytes), ...) reads the n rows from several places instead, one after
    the other (a tensor fused from row ranges of others: Flux's qkv for ComfyUI)."""
    info, first_row, n, k = part.info, part.first, part.n, part.k
    elem = info.nbytes // max(1, math.prod(info.shape))
    row_bytes = k * elem
    if spans is None:
        spans = [(sh.reader, info.start + first_row * row_bytes, n * row_bytes)]
    nbytes = sum(s[2] for s in spans)
    qz = fp8.StreamQuantizer(n, k, scheme.weights, name, block=scheme.block_size)
    # reads of whole blocks of rows: of the target's blocks, and of an FP8 source's (to decode)
    align = row_bytes * math.lcm(scheme.block or 1, (decode.keywords["source"].block or 1) if decode else 1)

    def rows(buf: torch.Tensor, row: int) -> torch.Tensor:
        r = buf.view(info.torch_dtype).view(-1, k)
        return r if decode is None else decode(r, first_row + row)

    def quantize_block(buf: torch.Tensor, release, out: torch.Tensor, give_back, row: int):
        try:
            return qz.quantize(rows(buf, row), out=out.view(fp8.FP8_DTYPE).view(-1, k), start=row), give_back
        finally:
            release()

    def read():
        for reader, start, size in spans:
            yield from reader.blocks(start, size, align)

    blocks = read()
    if qz.needs_observe and len(spans) == 1 and nbytes <= spans[0][0].pool.nbytes:  # one block: read it once
        blocks = list(blocks)
        qz.observe(rows(blocks[0][0], 0))
    elif qz.needs_observe:  # per-tensor scale: a first pass for the amax (page-cache reads)
        seen = 0
        for buf, release in blocks:
            try:
                qz.observe(rows(buf, seen))
                seen += buf.numel() // row_bytes
            finally:
                release()
        blocks = read()
    row = 0
    for buf, release in blocks:
        # The code buffer is taken here, not on the worker: only this thread ever waits for the
        # pool, and what it waits for (workers, the writer) never waits for it.
        out, give_back = spans[0][0].pool.acquire(buf.numel() // elem)  # one byte per weight
        sh.block(part.out, quantize_block, buf, release, out, give_back, row)
        row += buf.numel() // row_bytes
    sh.then(lambda: done(*qz.finish()))


def _quantize_rows(
    sh: Shard,
    part: Rows,
    module: str,
    scheme: Scheme,
    opts: Options,
    input_scale: float | None,
    decode: Callable | None = None,
    **extra,
) -> None:
    """One 2-D weight (or rows of a fused one) -> `<m>.weight` codes, `<m>.weight_scale`
    (+ `<m>.input_scale`), and its record (with `extra` fields) in `sh.records`."""
    if scheme.needs_calibration:  # checked before any work is queued
        input_scale = _check_input_scale(
            input_scale if input_scale is not None else float(opts.input_scales[module]), module
        )

    def done(scale: torch.Tensor, stats: fp8.QuantStats) -> None:
        sh.writer.write(scale_name(part.out, opts.scale_leaf), scale.contiguous())
        record = {
            "module": module,
            "shape": [part.n, part.k],
            "source_dtype": part.info.dtype,
            "dtype": "F8_E4M3",
            "weight_scale_shape": list(scale.shape),
            **stats.as_dict(),
            **extra,
        }
        if scheme.needs_calibration:
            sh.writer.write(
                part.out[: -len("weight")] + "input_scale", torch.tensor([input_scale], dtype=torch.float32)
            )
            record["input_scale"] = input_scale
        sh.records[part.out] = record

    quantize_matrix(sh, part, scheme, part.out, done, decode)


def expert_entries(name: str, info: TensorInfo, et: ExpertTensor, scheme: Scheme) -> list:
    """Header entries written in place of one expert checkpoint tensor."""
    if et.expert is not None:  # one expert's 2-D rows: exactly a Linear weight
        return linear_entries(name, tuple(info.shape), scheme)
    E, N, K = info.shape
    if et.split:
        return [e for sl in et.split for e in linear_entries(sl.key, (sl.stop - sl.start, K), scheme)]
    entries = [(name, "F8_E4M3", info.shape), (name + "_scale", "F32", scheme.experts_scale_shape(E, N, K))]
    if scheme.needs_calibration:
        entries.append((name + "_input_scale", "F32", (E,)))
    return entries


def scale_name(weight_key: str, leaf: str = "weight_scale") -> str:
    """`<m>.weight` -> `<m>.<leaf>`: where a quantized weight's scale is stored."""
    return weight_key[: -len("weight")] + leaf


def linear_entries(name: str, shape: tuple, scheme: Scheme, scale_leaf: str = "weight_scale") -> list:
    """Header entries of one quantized 2-D weight: codes, its scale (+ input_scale)."""
    entries = [(name, "F8_E4M3", shape), (scale_name(name, scale_leaf), "F32", scheme.scale_shape(*shape))]
    if scheme.needs_calibration:
        entries.append((name[: -len("weight")] + "input_scale", "F32", (1,)))
    return entries


def quantize_expert(sh: Shard, name: str, info: TensorInfo, et: ExpertTensor, scheme: Scheme, opts: Options) -> None:
    if et.expert is not None:
        module = name[: -len(".weight")]
        quantize_one(
            sh,
            name,
            info,
            module,
            scheme,
            opts,
            input_scale=opts.expert_input_scale(et.param, et.expert, module),
            experts_module=et.param.module,
            param=et.param.param,
            expert=et.expert,
        )
        return
    E, N, K = info.shape
    if et.split:  # write the fused tensor as per-expert Linear weights
        for sl in et.split:
            module = sl.key[: -len(".weight")]
            _quantize_rows(
                sh,
                Rows(sl.key, info, sl.expert * N + sl.start, sl.stop - sl.start, K),
                module,
                scheme,
                opts,
                opts.expert_input_scale(et.param, sl.expert, module),
                experts_module=et.param.module,
                param=et.param.param,
                expert=sl.expert,
                split_from=name,
            )
        return
    vals = [opts.expert_input_scale(et.param, e) for e in range(E)] if scheme.needs_calibration else []
    for e, v in enumerate(vals):
        _check_input_scale(v, f"{et.module}[expert {e}]")
    scales, per_expert = [], []

    def expert_done(scale: torch.Tensor, stats: fp8.QuantStats) -> None:
        scales.append(scale if scheme.block else scale.reshape(-1, 1))
        per_expert.append(stats)

    for e in range(E):
        quantize_matrix(sh, Rows(name, info, e * N, N, K), scheme, f"{name}[{e}]", expert_done)

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
            "sqnr_db": None
            if not any(math.isfinite(x) for x in sqnrs)
            else round(min(x for x in sqnrs if math.isfinite(x)), 4),
            "experts_sqnr_db": [None if not math.isfinite(x) else round(x, 4) for x in sqnrs],
            "zero_rows": sum(s.zero_rows for s in per_expert),
        }
        if scheme.needs_calibration:
            sh.writer.write(name + "_input_scale", torch.tensor(vals, dtype=torch.float32))
            record["input_scale"] = vals
        sh.records[name] = record

    sh.then(done)


def _check_input_scale(s: float | None, what: str) -> float:
    why = "is missing" if s is None else scale_problem(s)
    if why is not None:
        raise QuantizationError(f"the calibrated input scale of {what} {why}", "re-run calibration")
    return s
