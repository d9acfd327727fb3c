"""The data-free pipeline: snapshot -> plan -> shard-by-shard FP8 writer -> artifact + manifest.

Memory stays at a few 16 MiB blocks whatever the model: each tensor is read in blocks of rows
into pooled buffers, quantized on `QUANT_THREADS` threads (or copied byte for byte by the
writer's thread), and streamed into the matching output shard, which goes to disk through
O_DIRECT where the filesystem allows (`safetensors_io`). The source files are hashed on their
own thread from the start of the run, while torch and transformers load. The artifact folder
is built under a temporary name and renamed at the end. Where the time goes, and what each of
these choices saved, is measured by benchmarks/convert.py (see docs/benchmarks.md).

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
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from ..infra import atomic
from ..errors import QuantizationError, SourceError
from ..manifests import layout
from ..manifests.layout import INDEX_NAME
from ..manifests.manifest import Manifest
from ..format.schemes import Scheme
from ..model.moe_layout import ExpertParam, find_layout
from ..infra.safetensors_io import DTYPES, torch_dtype, BufferPool, Digest, FiniteCheck, ShardReader, ShardWriter, TensorInfo, read_header
from ..format.scales import E4M3_MAX, scale_problem, scale_shape
from ..source.snapshot import Snapshot
from ..format import fp8
from ..infra.progress import Progress, or_silent
from ..model.plan import Plan, check_against_model, matches, plan_for
from . import EXPERTS_LAYOUTS, FLOAT_CODES, UNQUANTIZED_DTYPES, guess, shard_size_bytes
from .assemble import Shards, assemble
from . import plan_child

# Tensors are read, quantized and written in blocks of this size (whole rows): a few of them in
# flight bound the memory a conversion needs beyond the runtime itself, whatever the model.
BLOCK_BYTES = 16 << 20
# Threads that quantize blocks, each with one torch thread: block-level parallelism beats
# intra-op threads on 1M-element chunks. Two on 2 cores (0.1-0.2 s faster than one there, the
# writer thread taking the rest); beyond 4 the single sha256-and-write thread is the limit.
QUANT_THREADS = max(1, min(4, os.cpu_count() or 2))


DEFAULT_MAX_SHARD_SIZE = 10**9  # "1GB": an 8B model in 9 files, verified on 9 threads at load


@dataclass
class Options:
    scheme: Scheme = field(default_factory=Scheme)
    ignore: list[str] = field(default_factory=list)
    force: bool = False
    delete_unlisted: bool = False  # with force: also delete files the old artifact's manifest does not list
    trust_remote_code: bool = False
    # Static activation scales (module -> dequant scale), required by the "fp8" scheme. MoE
    # experts: "<experts module>.<param>" -> one scale per expert (calibrate.experts).
    input_scales: dict[str, float | list[float]] | None = None
    calibration: dict | None = None  # what produced input_scales, for the manifest
    device: str = "cpu"
    # Fused 3-D experts in the checkpoint: "per-expert" (write them split, loadable everywhere)
    # or "checkpoint" (keep them fused: only mpsconvert's runtime loads that).
    experts_layout: str = "per-expert"
    # The tensors that stay unquantized (embeddings, lm_head, norms): "bfloat16" | "float16" |
    # "float32", or None to copy them bit for bit in the source's dtype (as mlx-lm's --dtype).
    dtype: str | None = None
    # Output shards hold at most this many bytes (one tensor larger than that goes alone): a load
    # with verification hashes each file on its own thread (sha256 cannot be split), ~0.8 GB/s
    # per thread on the H200 host, so the largest shard bounds how fast the artifact loads.
    # Bytes, or a size such as "1GB" (made bytes by shard_size_bytes).
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    # FP8 source tensors (weight key -> SourceTensor), filled by _prepare for an FP8 source
    fp8_tensors: dict = field(default_factory=dict)
    source_scheme: Scheme | None = None  # the scheme an FP8 source's codes and scales are in
    repack: bool = False  # an FP8 source whose codes are kept (the scheme asked for is its own)
    notes: list[str] = field(default_factory=list)  # what the conversion says about the source (tensors the model does not define)
    # The leaf name of a weight's scale: compressed-tensors' `<m>.weight_scale`, or another
    # loader's (diffusers' SDNQ backend reads `<m>.scale`).
    scale_leaf: str = "weight_scale"

    def __post_init__(self):
        if self.experts_layout not in EXPERTS_LAYOUTS:
            raise QuantizationError(f"unknown experts layout {self.experts_layout!r}", f"use one of: {', '.join(EXPERTS_LAYOUTS)}")
        self.max_shard_size = shard_size_bytes(self.max_shard_size)
        if self.dtype is not None and self.dtype not in UNQUANTIZED_DTYPES:
            raise QuantizationError(f"unknown dtype {self.dtype!r} for the unquantized tensors", f"use one of: {', '.join(UNQUANTIZED_DTYPES)}")

    @property
    def dtype_code(self) -> str | None:
        """The safetensors dtype of converted float tensors (None: copied as they are)."""
        return UNQUANTIZED_DTYPES.get(self.dtype) if self.dtype else None

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
class SourceTensor:
    """One FP8 weight of an FP8 source: its scale (float32, as stored) and static input scale."""

    scale: torch.Tensor
    input_scale: torch.Tensor | None
    scale_key: str

    def decode(self, codes: torch.Tensor, row: int, source: Scheme) -> torch.Tensor:
        """float32 rows [row, row + len(codes)) of the source weight (row on a source block)."""
        s, b = self.scale, source.block
        if s.numel() > 1:
            s = s[row // b : -(-(row + codes.shape[0]) // b)] if b else s.reshape(-1, 1)[row : row + codes.shape[0]]
        return fp8.dequantize(codes, s, torch.float32, b)


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
    kinds = FLOAT_CODES + ("F8_E4M3",)
    stored = {name: tuple(info.shape) for h in headers.values() for name, info in h.tensors.items() if info.dtype in kinds}
    found: dict[str, ExpertTensor] = {}
    plan.expert_layout = find_layout(plan.meta_model, stored)
    for ep in plan.expert_layout.values():
        if ep.layout == "fused" and any(h.tensors[ep.key].dtype == "F8_E4M3" for h in headers.values() if ep.key in h.tensors):
            raise SourceError(f"the FP8 source stores the experts {ep.key} fused in 3-D", "only per-expert FP8 expert weights (the hub's layout) can be kept")
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
            if mod is not None and len(info.shape) == 2 and info.dtype in FLOAT_CODES:
                found[name] = mod
    present = set(found.values())
    for mod in list(plan.quantize):
        if mod not in present:
            del plan.quantize[mod]
            plan.ignored[mod] = "no float 2-D weight stored under this module's name in the checkpoint: kept as is"
    return found


def _finalize_fp8_plan(plan: Plan, headers: dict, snap: Snapshot, opts: Options) -> dict[str, str]:
    """_finalize_plan for an FP8 source: the modules it stores in FP8 are the quantized ones
    (their codes are the source's), the others stay as the source keeps them; and every FP8
    weight's scale is read (a few floats per 128x128 block) and checked."""
    src = snap.fp8
    found: dict[str, str] = {}
    fp8_keys = {name: (f, info) for f, h in headers.items() for name, info in h.tensors.items() if info.dtype == "F8_E4M3"}
    all_infos = {name: (f, info) for f, h in headers.items() for name, info in h.tensors.items()}
    for name, (f, info) in fp8_keys.items():
        if not name.endswith(".weight") or len(info.shape) != 2:
            if len(info.shape) == 3 and plan.experts:
                continue  # fused experts: _expert_tensors says why they cannot be kept
            raise SourceError(f"the FP8 source stores {name} as F8_E4M3 {list(info.shape)}", "only 2-D FP8 weights with a scale can be kept")
        mod = plan.module_for_tensor(name)
        if mod is None:
            key = name[: -len(".weight")]
            mod = next((m for m in plan.ignored if m == key or m == f"{plan.prefix}.{key}" or key == f"{plan.prefix}.{m}"), None)
            if mod is not None:
                if matches(mod, opts.ignore):
                    raise SourceError(f"--ignore {matches(mod, opts.ignore)!r} names {mod}, which the FP8 source stores in FP8",
                                      "its codes can only be kept as they are: drop that --ignore pattern")
                plan.quantize[mod] = tuple(info.shape)
                del plan.ignored[mod]
        if mod is not None:
            found[name] = mod
        scale_key = src.scale_key(name)
        if scale_key not in all_infos:
            raise SourceError(f"the FP8 source has {name} but no {scale_key}", "the checkpoint is incomplete; re-download it")
        sf, sinfo = all_infos[scale_key]
        want = scale_shape(src.scheme.weights, *info.shape, src.scheme.block_size)
        # the exact shape the format requires (one value per tensor may be stored as [] or [1]): a
        # transposed [2, 4] for [4, 2] blocks, or a flat [8], has the right count and the wrong meaning
        exact = tuple(sinfo.shape) == tuple(want) or (tuple(want) == (1,) and tuple(sinfo.shape) in ((), (1,), (1, 1)))
        if sinfo.dtype not in FLOAT_CODES or not exact:
            raise SourceError(f"{scale_key} is {sinfo.dtype}{list(sinfo.shape)}, but the source's {src.scheme.weights} scales of a "
                              f"{list(info.shape)} weight are {list(want)} (float)", "the checkpoint is corrupt or not the layout its config says")
        ins_key = src.input_scale_key(name)
        with safe_open(str(snap.path / sf), "pt") as fh:
            scale = fh.get_tensor(scale_key).float().reshape(want)
        ins = None
        if ins_key in all_infos:
            if math.prod(all_infos[ins_key][1].shape) != 1 or all_infos[ins_key][1].dtype not in FLOAT_CODES:
                raise SourceError(f"{ins_key} is {all_infos[ins_key][1].dtype}{list(all_infos[ins_key][1].shape)}, not one float",
                                  "the checkpoint is corrupt or not the layout its config says")
            with safe_open(str(snap.path / all_infos[ins_key][0]), "pt") as fh:
                ins = fh.get_tensor(ins_key).float().reshape(-1)
            if (why := scale_problem(float(ins[0]))) is not None:
                raise SourceError(f"the static input scale {ins_key} {why}", "the checkpoint is corrupt; re-download it")
        # finite and > 0, and what the largest code dequantizes to (448 x scale) finite: a 3e38 scale passes the first
        bad = ~(torch.isfinite(scale) & (scale > 0) & torch.isfinite(scale * E4M3_MAX))
        if bool(bad.any()):
            raise SourceError(f"{scale_key} holds {int(bad.sum())} scale(s) that are not finite positive or dequantize past float32 "
                              f"(e.g. {float(scale[bad][0])!r})", "the checkpoint is corrupt; re-download it")
        opts.fp8_tensors[name] = SourceTensor(scale, ins, scale_key)
    for mod in list(plan.quantize):
        if mod not in set(found.values()):
            del plan.quantize[mod]
            plan.ignored[mod] = "kept in full precision, as the FP8 source stores it"
    return found


def source_keys(snap: Snapshot, opts: Options) -> set[str]:
    """Keys of an FP8 source that the writer consumes (scales, input scales), not copied."""
    src = snap.fp8
    return {k for name, t in opts.fp8_tensors.items() for k in (t.scale_key, src.input_scale_key(name))}


def check_fp8_source(snap: Snapshot, scheme: Scheme) -> None:
    """Refuse calibrating a re-quantized FP8 source: calibration would run on another model
    (the source's, not the one written); calibrating the re-packed artifact is the way."""
    if snap.fp8 is not None and scheme != snap.fp8.scheme and scheme.needs_calibration:
        raise QuantizationError("--scheme fp8 from an FP8 source would calibrate a model that is not the one written",
                                "quantize it with the defaults (its codes kept), then `mpsconvert calibrate` the artifact")


def repacks(snap: Snapshot, opts: Options) -> bool:
    """Whether an FP8 source is re-packed (codes kept): the scheme asked for is its own."""
    return snap.fp8 is not None and opts.scheme == snap.fp8.scheme


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


def quantize_snapshot(snap: Snapshot, out: Path, opts: Options, progress: Progress | None = None,
                      child: plan_child.PlanChild | None = None) -> Manifest:
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
    guessed = guess.guess(snap.config, headers, opts.ignore) if plan_child.wanted(snap, opts.scheme, opts.trust_remote_code) else None
    if guessed is None:
        plan, headers, tensor_module, expert_tensors = _prepare(snap, opts, headers)
    else:  # the plan is built by a child process (it imports transformers: seconds) while the shards are written
        if not children:
            children.append(plan_child.PlanChild(snap.path, opts.ignore, snap.weight_files))
        child = children[0]
        prepared = _in_background(lambda: _prepare(snap, opts, headers, plan=child.result()))
    pool = BufferPool(count=2 * QUANT_THREADS + 8, nbytes=BLOCK_BYTES)
    with (
        atomic.output_dir(out, force=opts.force, min_free=estimate_output_bytes(headers, guessed or tensor_module, opts.scheme),
                          protect=(snap.path,), delete_unlisted=opts.delete_unlisted, **layout.OUTPUT_RULES) as tmp,
        atomic.BackgroundSync() as syncs,
        ThreadPoolExecutor(max_workers=QUANT_THREADS, thread_name_prefix="mpsconvert-quant") as workers,
    ):
        write = functools.partial(_write_shards, snap, headers, opts=opts, tmp=tmp, pool=pool, workers=workers, syncs=syncs,
                                  progress=or_silent(progress), consumed=source_keys(snap, opts) if snap.fp8 else set())
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
                shards.plan_source = f"guessed from the tensor names while {child.built_by} read the model definition; the two agreed"
            except _GuessDiffers:
                plan, headers, tensor_module, expert_tensors = prepared.result()
                for f in tmp.glob("*.safetensors"):
                    f.unlink()
                shards = write(tensor_module, expert_tensors)
                shards.plan_source = f"the model definition, read by {child.built_by} (the guess from the tensor " "names differed: shards written again)"
        return assemble(tmp, snap, plan, opts, shards, Path(out).absolute().name)


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


def _prepare(snap: Snapshot, opts: Options, headers: dict | None = None, plan: Plan | None = None):
    """The plan (`plan` where a child process built it and checked the shapes against its model:
    plan_child.py; built here where None), the checked shard headers, and which checkpoint
    tensors get quantized how."""
    plan = plan if plan is not None else plan_for(snap.path, opts.ignore, opts.trust_remote_code)
    headers = headers or {f: read_header(snap.path / f) for f in snap.weight_files}
    check_tensor_layout(snap, headers)
    check_against_model(plan, headers, fp8_source=snap.fp8 is not None)
    if plan.unknown:
        shown = ", ".join(repr(n[:80]) for n in plan.unknown[:3]) + (f" and {len(plan.unknown) - 3} more" if len(plan.unknown) > 3 else "")
        opts.notes.append(f"the source stores {len(plan.unknown)} tensor{'s' if len(plan.unknown) > 1 else ''} that the model "
                          f"({plan.architecture}) does not define ({shown}): copied into the artifact as "
                          f"{'they are' if len(plan.unknown) > 1 else 'it is'}; transformers ignores them when it loads it")
    tensor_module = _finalize_fp8_plan(plan, headers, snap, opts) if snap.fp8 else _finalize_plan(plan, headers)
    expert_tensors = _expert_tensors(plan, headers, opts.experts_layout)
    # an error unless the plan names layers it keeps on purpose (GPT-2's Conv1D, MoE experts it cannot read)
    if not tensor_module and not expert_tensors and not any(not r.startswith("embedding") for r in plan.skipped.values()):
        raise QuantizationError(
            f"nothing to quantize in {snap.path}: no float 2-D Linear weight stored that the plan would quantize "
            f"({len(plan.ignored)} Linear(s) ignored, architecture {plan.architecture})",
            "check config.json (0 layers?) and the --ignore patterns",
        )
    if snap.fp8:
        opts.source_scheme, opts.repack = snap.fp8.scheme, repacks(snap, opts)
        for name in [n for n in opts.fp8_tensors if n not in tensor_module and n not in expert_tensors]:
            # an FP8 weight of no Linear or expert (llm-compressor's model-free path quantizes embed_tokens)
            if snap.fp8.layout != "compressed-tensors":
                raise SourceError(f"the FP8 source stores {name}, which is no Linear or expert weight, in FP8",
                                  "only FP8 Linear and expert weights can be kept")
            del opts.fp8_tensors[name]  # codes and scale copied as they are (compressed-tensors' names); loaders dequantize it
    check_fp8_source(snap, opts.scheme)
    if snap.fp8 and repacks(snap, opts) and opts.scheme.needs_calibration:
        missing = sorted(n for n, t in opts.fp8_tensors.items() if t.input_scale is None)
        if missing:
            raise SourceError(f"the static FP8 source has no input_scale for {len(missing)} weights (e.g. {missing[0]})",
                              "the checkpoint is incomplete; re-download it")
    elif opts.scheme.needs_calibration:
        missing = sorted(set(tensor_module.values()) - set(opts.input_scales or {}))
        missing += sorted({et.module for key, et in expert_tensors.items() if not _has_input_scales(opts, key, et)})
        if missing:
            raise QuantizationError(
                f"scheme fp8 needs a calibrated input scale for every quantized Linear and expert; {len(missing)} "
                f"have none (e.g. {missing[0]})",
                "run calibration (`mpsconvert quantize --scheme fp8 --calib-data ...` or `mpsconvert calibrate`)",
            )
    return plan, headers, tensor_module, expert_tensors


def _write_shards(snap: Snapshot, headers: dict, tensor_module: dict, expert_tensors: dict, opts: Options, tmp: Path,
                  pool: BufferPool, workers: ThreadPoolExecutor, syncs, progress, consumed: set = frozenset(),
                  shard_names: Callable[[int], list[str]] = layout.shard_names, between: Callable[[], None] = lambda: None) -> Shards:
    """Stream every source shard into its output shards (more than one where its output would
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
                mine = _linear_entries(name, tuple(info.shape), scheme, opts.scale_leaf)
            elif name in expert_tensors:
                mine = _expert_entries(name, info, expert_tensors[name], scheme)
            else:
                mine = [(name, _copied_dtype(info, opts), info.shape)]
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
        with ShardReader(header, pool) as reader, ShardWriter(tmp / out_name, entries, metadata={"format": "pt"}) as writer:
            sh = _Shard(reader, writer, workers, QUANT_THREADS + 1, out.tensors)
            try:
                for name in work:
                    info = header.tensors[name]
                    if name in tensor_module:
                        _quantize_one(sh, name, info, tensor_module[name], scheme, opts)
                    elif name in expert_tensors:
                        _quantize_expert(sh, name, info, expert_tensors[name], scheme, opts)
                    elif _copied_dtype(info, opts) != info.dtype:
                        _convert_copy(sh, name, info, opts.dtype_code, FiniteCheck(info.dtype, name, src_name))
                    else:  # NaN/inf in a tensor copied as it is is refused, counted as it is copied
                        sh.then(writer.copy, name, header.path, info.start, info.nbytes, (FiniteCheck(info.dtype, name, src_name),))
                    sh.then(advance, info.nbytes, name)
                sh.pump(0)
            except BaseException:
                sh.abandon()
                raise
        syncs.add(writer.sync)
        for name, *_ in entries:
            out.weight_map[name] = out_name
        behind.append((out_name, writer))
        out.bytes_out += writer.size
    while behind:
        finished(*behind.popleft())
    return out


def _copied_dtype(info: TensorInfo, opts: Options) -> str:
    """The stored dtype of a tensor that is not quantized: --dtype for float tensors, else its own."""
    return opts.dtype_code if opts.dtype_code and info.dtype in FLOAT_CODES else info.dtype


def _convert_copy(sh: "_Shard", name: str, info: TensorInfo, code: str, check: FiniteCheck) -> None:
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
                raise QuantizationError(f"tensor {name!r} holds values up to {big:.4g}, which --dtype {target} turns into inf",
                                        "use --dtype bfloat16 (float32's range), or leave --dtype out to copy it as it is")
        finally:
            release()
        sh.then(sh.writer.write, name, out)
    check.done()


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
    src = opts.fp8_tensors.get(name) if info.dtype == "F8_E4M3" else None
    if src is not None and opts.repack:
        _repack_one(sh, name, info, module, scheme, src, **extra)
        return
    if src is not None:  # another scheme than the source's: dequantize its rows, quantize again
        decode = functools.partial(src.decode, source=opts.source_scheme)
        extra = {**extra, "requantized_from": f"FP8 source ({opts.source_scheme.weights} scales); sqnr_db is the round trip's"}
        input_scale = None
        _quantize_rows(sh, name, info, 0, n, k, module, scheme, opts, input_scale, decode=decode, **extra)
        return
    _quantize_rows(sh, name, info, 0, n, k, module, scheme, opts, input_scale, **extra)


def _repack_one(sh: _Shard, name: str, info: TensorInfo, module: str, scheme: Scheme, src: SourceTensor, **extra) -> None:
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
    sh.then(sh.writer.copy, name, sh.reader.header.path, info.start, info.nbytes, (Digest(lambda d: rec.__setitem__("codes_sha256", d)),
                                                                                    FiniteCheck(info.dtype, name, sh.reader.header.path.name)))
    sh.then(sh.writer.write, name + "_scale", scale)
    if scheme.needs_calibration:
        sh.then(sh.writer.write, name[: -len("weight")] + "input_scale", src.input_scale.reshape(1).contiguous())


def _quantize_matrix(sh: _Shard, out_name: str, info: TensorInfo, first_row: int, n: int, k: int, scheme: Scheme, name: str,
                     done: Callable[[torch.Tensor, fp8.QuantStats], None], decode: Callable | None = None,
                     spans: list | None = None) -> None:
    """Rows [first_row, first_row + n) of a float tensor seen as [rows, K] -> e4m3 codes appended
    to `out_name`, block by block (pooled buffers, so memory stays at a few blocks; for block
    scales each read is whole blocks of rows); then `done(scale, stats)`, in order. `spans`
    ((reader, byte start, nbytes), ...) reads the n rows from several places instead, one after
    the other (a tensor fused from row ranges of others: Flux's qkv for ComfyUI)."""
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
        sh.block(out_name, quantize_block, buf, release, out, give_back, row)
        row += buf.numel() // row_bytes
    sh.then(lambda: done(*qz.finish()))


def _quantize_rows(
    sh: _Shard, out_name: str, info: TensorInfo, first_row: int, n: int, k: int, module: str,
    scheme: Scheme, opts: Options, input_scale: float | None, decode: Callable | None = None, **extra,
) -> None:
    """One 2-D weight (or rows of a fused one) -> `<m>.weight` codes, `<m>.weight_scale`
    (+ `<m>.input_scale`), and its record (with `extra` fields) in `sh.records`."""
    if scheme.needs_calibration:  # checked before any work is queued
        input_scale = _check_input_scale(input_scale if input_scale is not None else float(opts.input_scales[module]), module)

    def done(scale: torch.Tensor, stats: fp8.QuantStats) -> None:
        sh.writer.write(scale_name(out_name, opts.scale_leaf), scale.contiguous())
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

    _quantize_matrix(sh, out_name, info, first_row, n, k, scheme, out_name, done, decode)


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


def scale_name(weight_key: str, leaf: str = "weight_scale") -> str:
    """`<m>.weight` -> `<m>.<leaf>`: where a quantized weight's scale is stored."""
    return weight_key[: -len("weight")] + leaf


def _linear_entries(name: str, shape: tuple, scheme: Scheme, scale_leaf: str = "weight_scale") -> list:
    """Header entries of one quantized 2-D weight: codes, its scale (+ input_scale)."""
    entries = [(name, "F8_E4M3", shape), (scale_name(name, scale_leaf), "F32", scheme.scale_shape(*shape))]
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
            "sqnr_db": None if not any(math.isfinite(x) for x in sqnrs) else round(min(x for x in sqnrs if math.isfinite(x)), 4),
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
