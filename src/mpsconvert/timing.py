"""Timing, in one place: wall-clock samples around device synchronisation, their median / p95,
and the per-call timer of the kernel policy (CUDA-graph replay on CUDA).

Why both: a user-facing latency (a prefill, a decode step, a Core ML `predict`) is what one
call costs from the host, launches included, so it is timed with the host clock after the
device has finished (`devices.synchronize`). A kernel's own cost, for choosing among kernels,
is timed without launch overhead where that is possible (a captured CUDA graph replayed),
since inside a compiled model or a CUDA graph that overhead is gone too.
"""

from __future__ import annotations

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
