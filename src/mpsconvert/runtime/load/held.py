"""A loaded model whose Triton kernels are still compiling: what `load` returns on a machine's
first run (CUDA), and how the model takes its kernels once they are ready.

Why: on a fresh H100 host the first `load()` waited 3.7 s for the warm-up's Triton compiles and
2.6 s for those of the install checks, 7.9 s against the 1.8 s of BF16's `from_pretrained`
(benchmarks/results/first_run_direct_decode_h100.log); a load on the same machine's caches took
2.4 s. Only the first run pays them, and nothing about the model needs them to be correct. So where
the kernel policy has no record of this machine running the model's kernels
(`policy.decided_before`), `load` holds them back: it returns once the weights are in place and
checked, the model computing with kernels that need no compile (torch's FP8 GEMMs with
activations quantized by torch ops, transformers' own norms, rotary and SDPA: `kernels.without_triton`,
`tritonlib.holding`, the patches' `Context.held`), while the warm-up thread (and its child
process) compile ours. Then:

- the engine asks `take_if_ready` before each generation sets up its decode step: once the
  warm-up is done the held patches and the kernel policy are installed, as `load` installs them
  on a warm machine, each checked the same way, and the step is captured again;
- closing a chat, or the end of a one-shot `generate`, calls `finish`, which waits for them: so
  the machine's next process finds them compiled and recorded, and loads with them at once.

`model.mpsconvert.seconds["held"]` says what the switch cost, `model.mpsconvert_held` is None
once it is done, and the engine's decode report says while it is not (`kernels`).
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import torch

from ..ops import triton as tritonlib


class HeldKernels:
    """The held state of one loaded model: `ready()`, `take_if_ready()`, `finish()`. `install` is
    the loader's installation of what was held (the held patches, the kernel policy, their checks);
    `warm` the load's warm-up, whose compiles it waits for."""

    # what the engine's decode report says of the kernels while they are held (its `kernels` entry)
    NOTE = "torch's, while this machine's first compile of mpsconvert's Triton kernels runs (runtime/load/held.py)"

    def __init__(self, model: torch.nn.Module, warm, install: Callable[[], dict]):
        self.model, self.warm, self._install = model, warm, install
        self._t0 = time.perf_counter()
        own = model.__dict__.get("forward")  # an instance forward set before us, restored by `_release`
        self._own_forward = own
        inner = own if own is not None else model.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            if torch.compiler.is_compiling():  # torch.compile runs the torch ops anyway (tritonlib.eager_on)
                return inner(*args, **kwargs)
            with tritonlib.holding():
                return inner(*args, **kwargs)

        model.forward = forward
        model.mpsconvert_held = self

    def ready(self) -> bool:
        """Whether the warm-up is done, so that `finish` would not wait for it."""
        return self.warm is None or self.warm.done()

    def take_if_ready(self) -> bool:
        """Install the held kernels where the warm-up is done; whether it did (the model's
        captured steps then need capturing again)."""
        if not self.ready():
            return False
        self.finish()
        return True

    def finish(self) -> None:
        """Wait for the warm-up, then install what was held; the model then computes as on a warm
        machine. Idempotent."""
        if self.model.__dict__.get("mpsconvert_held") is not self:
            return
        t = time.perf_counter()
        try:
            seconds = self._install()
        finally:
            self._release()
        seconds["after_load_s"] = round(t - self._t0, 3)  # how long the model ran with torch's kernels
        seconds["total"] = round(time.perf_counter() - t, 3)
        self.model.mpsconvert.seconds["held"] = seconds
        self.model.__dict__.pop("mpsconvert_engine", None)  # model.generate()'s engine: captured with torch's kernels

    def _release(self) -> None:
        if self._own_forward is not None:
            self.model.forward = self._own_forward
        else:
            self.model.__dict__.pop("forward", None)
        self.model.mpsconvert_held = None


def held(model) -> HeldKernels | None:
    """The model's held kernels (a load's first run on this machine), or None."""
    return getattr(model, "__dict__", {}).get("mpsconvert_held")


def finish(model) -> bool:
    """Wait for and install the model's held kernels, if any; whether there were any."""
    h = held(model)
    if h is None:
        return False
    h.finish()
    return True
