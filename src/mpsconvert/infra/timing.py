"""Timing, in one place: wall-clock samples around device synchronisation, their median / p95,
and the per-call timer of the kernel policy (CUDA-graph replay on CUDA).

Why both: a user-facing latency (a prefill, a decode step, a Core ML `predict`) is what one
call costs from the host, launches included, so it is timed with the host clock after the
device has finished (`devices.synchronize`). A kernel's own cost, for choosing among kernels,
is timed without launch overhead where that is possible (a captured CUDA graph replayed),
since inside a compiled model or a CUDA graph that overhead is gone too.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from typing import Callable

from . import devices


def wall_samples(fn: Callable[[], object], device=None, repeats: int = 10, warmup: int = 3) -> list[float]:
    """Seconds per call of `fn`, `repeats` times after `warmup` untimed calls; the device (if
    given) is synchronised before and after every timed call."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if device is not None:
            devices.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device is not None:
            devices.synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def warm_guards(compiled: bool):
    """A context for timing a compiled step after its warm-up: dynamo then checks only the guards
    that tell its compiled versions apart (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`).

    Why: a decode step under torch.compile evaluates every guard of the whole model on every
    call, about as much host time as the GPU spends on a small model's step (docs/runtime-notes.md).
    Once the step has compiled and captured its graph with the inputs it keeps seeing (the static
    cache, one token, a position tensor), those guards cannot fail, which is the case this torch
    switch is documented for. Used for every model timed, BF16 and FP8 alike; a no-op when
    nothing is compiled or this torch has no set_stance."""
    import torch

    if compiled and hasattr(torch.compiler, "set_stance"):
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    return contextlib.nullcontext()


def stats(seconds: list[float]) -> dict:
    """Median and p95 (nearest rank) in milliseconds, and the sample count."""
    s = sorted(seconds)
    if not s:
        return {"median_ms": None, "p95_ms": None, "n": 0}
    p95 = s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)]
    mid = len(s) // 2
    median = s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])
    return {"median_ms": 1e3 * median, "p95_ms": 1e3 * p95, "n": len(s)}


def median_ms(fn: Callable[[], object], device=None, repeats: int = 20, warmup: int = 2) -> float:
    """The median of `wall_samples`, in milliseconds."""
    return stats(wall_samples(fn, device, repeats, warmup))["median_ms"]


def per_call_us(fn: Callable[[], object], device, reps: int = 20, rounds: int = 5) -> float:
    """Median microseconds per call of a kernel. CUDA: `reps` calls captured in a CUDA graph and
    replayed (launch overhead excluded, as under CUDA graphs); elsewhere the host clock around
    `reps` calls, synchronised."""
    for _ in range(3):
        fn()
    devices.synchronize(device)
    if device.type == "cuda":
        import torch

        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        times = []
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / reps)
        return statistics.median(times)
    samples = wall_samples(lambda: [fn() for _ in range(reps)], device, repeats=rounds, warmup=0)
    return statistics.median(samples) * 1e6 / reps


def round_stats(rounds: list[list[float]]) -> dict:
    """`stats` of all samples of a measurement taken in rounds, plus each round's median and the
    run-to-run spread: how far apart the round medians lie, relative to their median
    ((max - min) / median). With a single round the samples' own range stands in for it."""
    samples = [x for r in rounds for x in r]
    out = stats(samples)
    medians = sorted(stats(r)["median_ms"] for r in rounds if r)
    if len(medians) >= 2:
        mid = stats([m / 1e3 for m in medians])["median_ms"]
        spread = (medians[-1] - medians[0]) / mid if mid else None
    elif samples:
        spread = (max(samples) - min(samples)) / (out["median_ms"] / 1e3) if out["median_ms"] else None
    else:
        spread = None
    return out | {"round_medians_ms": medians, "spread": spread}


def verdict(base: dict, test: dict) -> dict:
    """Is `test` faster than `base` (two `round_stats`)? Only when the ratio of medians lies
    beyond the run-to-run spread measured in the same run (the larger of the two spreads): then
    'faster' or 'slower', otherwise 'no clear difference'. Two runs can then disagree only where
    one of them says there is no clear difference."""
    ratio = base["median_ms"] / test["median_ms"]
    spread = max(base.get("spread") or 0.0, test.get("spread") or 0.0)
    if ratio > 1 + spread:
        word = "faster"
    elif ratio < 1 / (1 + spread):
        word = "slower"
    else:
        word = "no clear difference"
    return {"ratio": ratio, "spread": spread, "verdict": word}
