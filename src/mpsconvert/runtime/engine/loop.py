"""The one generation loop: prefill, then one token per step from any decoder (the engine over a
transformers model, or an Apple export's stateful runner), with one timer (prompt and generation
apart, compile time on its own) and one peak-memory reading.

Why our own loop rather than `model.generate`: the user sees every token as it comes, the prompt
and the generation are timed apart (prompt tokens/s, generation tokens/s, as mlx-lm prints
them), and the same loop drives the PyTorch model and the Apple exports (their stateful decoder:
`main(input_ids, position) -> logits`, the KV cache in its states). `generate`, `chat`,
validate's decode latency and the benchmarks all run it.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import torch

from ...errors import MpsconvertError
from ...infra import devices
from .sampling import Draws, Sampling, choose


@dataclass
class GenerationStats:
    """What one generation did and how fast; `as_dict()` is what `--json` prints."""

    backend: str
    device: str
    prompt_tokens: int
    prompt_seconds: float
    generated_tokens: int
    generation_seconds: float
    peak_memory_bytes: int | None
    peak_memory_source: str
    stop: str  # "eos" | "max_tokens" | "cache_full"
    tokens: list = field(default_factory=list)
    prompt_ids: list = field(default_factory=list)  # the prompt as token ids: replayable through model.generate()
    compile_seconds: float | None = (
        None  # capturing the decode step (CUDA graph) before the timer started; None: nothing set up now
    )
    # which decode path ran and what setting it up cost in this generation (Engine.decode_report): {"path": "graph" |
    # "compile" | "eager", "asked", "seconds", "fallback": why the asked path did not run, or None}; None for a decoder
    # that has no paths
    decode: dict | None = None
    # each decode step, the device synchronised (only when asked: time_steps)
    step_seconds: list = field(default_factory=list)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else float("inf")

    @property
    def generation_tps(self) -> float | None:
        """Tokens per second after the first (which comes out of the prefill)."""
        n = self.generated_tokens - 1
        return n / self.generation_seconds if n > 0 and self.generation_seconds > 0 else None

    def as_dict(self) -> dict:
        return {
            **{k: v for k, v in self.__dict__.items() if k != "step_seconds"},
            "prompt_tokens_per_s": round(self.prompt_tps, 2),
            "generation_tokens_per_s": None if self.generation_tps is None else round(self.generation_tps, 2),
        }


class Decoder(Protocol):
    """One conversation with a model: `prefill(ids)` then `step(token)`, each -> last logits [V]."""

    backend: str
    device: str
    max_len: int | None  # tokens the cache holds (None: unbounded)

    def reserve(self, tokens: int) -> float | None:
        """Make room for `tokens` (prompt + generation) before the timer starts; returns the
        seconds spent compiling the decode step, None where nothing was compiled."""

    def reset(self) -> None: ...
    def prefill(self, ids: list[int]) -> torch.Tensor: ...
    def step(self, token: int) -> torch.Tensor: ...
    def sync(self) -> None: ...

    # Optional (engine.Engine on CUDA): `pipelined` True, `step_chosen(token tensor)` and
    # `rewind(steps)`, so the loop can start a step before reading the last token (_pipelined).


class RunnerDecoder:
    """A stateful Apple decoder (Core AI asset or Core ML package) given as the
    `new_conversation() -> step(ids int32 [1, T], position) -> logits [T, V]` runner that
    apple/coreai/coreai_check.py and apple/coreml/coreml_check.py build: one runner call is one conversation."""

    def __init__(self, new_conversation, max_len: int, backend: str, device: str):
        self.new_conversation, self.max_len, self.backend, self.device = new_conversation, max_len, backend, device
        self.reset()

    def reserve(self, tokens: int) -> None:
        return None  # the package's states are sized at export (max_len)

    def reset(self) -> None:
        self.fn = self.new_conversation()
        self.pos = 0

    def _run(self, ids: list[int]) -> torch.Tensor:
        import numpy as np

        out = self.fn(np.asarray([ids], dtype=np.int32), self.pos)
        self.pos += len(ids)
        return torch.from_numpy(np.asarray(out)[-1].astype(np.float32))

    def prefill(self, ids: list[int]) -> torch.Tensor:
        return self._run(ids)

    def step(self, token: int) -> torch.Tensor:
        return self._run([token])

    def sync(self) -> None:
        pass


def peak_memory(dev_name: str) -> tuple[int | None, str]:
    """The device's peak where it has a counter (CUDA), else the process's peak RSS."""
    dev = torch.device(dev_name) if dev_name in ("cpu", "mps") or dev_name.startswith("cuda") else torch.device("cpu")
    m = devices.memory(dev)
    if m.get("peak_allocated") is not None:
        return m["peak_allocated"], "device peak allocated (torch.cuda.max_memory_allocated)"
    if m.get("driver_allocated") is not None:
        return m["driver_allocated"], "MPS driver allocated (no peak counter on MPS)"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "process peak RSS (getrusage)"


def generate_ids(
    decoder: Decoder,
    prompt: list[int],
    sampling: Sampling,
    stop_ids: Iterable[int] = (),
    on_token: Callable[[int], None] | None = None,
    time_steps: bool = False,
) -> GenerationStats:
    """Prefill `prompt`, then sample up to `sampling.max_tokens` tokens (the first from the
    prefill's logits), calling `on_token` with each as soon as it is chosen. Stops at an id in
    `stop_ids` (not counted as text but counted as generated) or when the cache is full.
    `time_steps`: also time every decode step on its own, the device synchronised after each
    (validate's per-token latency; a generation leaves the device running ahead)."""
    if not prompt:
        raise MpsconvertError("the prompt is empty after tokenization", "pass some text")
    if decoder.max_len is not None and len(prompt) >= decoder.max_len:
        raise MpsconvertError(
            f"the prompt is {len(prompt)} tokens, the {decoder.backend} model holds {decoder.max_len}",
            "shorten the prompt, or re-export with a larger `max_len`",
        )
    stop_ids = set(stop_ids)
    gen = Draws(sampling.seed)
    compile_s = decoder.reserve(len(prompt) + sampling.max_tokens)
    report = getattr(decoder, "decode_report", None)
    decode = None if report is None else {**report, "seconds": None if compile_s is None else round(compile_s, 3)}
    decoder.reset()
    if decoder.device.startswith("cuda"):
        devices.reset_peak(torch.device(decoder.device))
    t0 = time.perf_counter()
    chosen = choose(decoder.prefill(prompt), sampling, gen)
    tok = int(chosen)
    decoder.sync()
    t1 = time.perf_counter()
    tokens: list[int] = []
    steps: list[float] = []
    room = lambda n: n < sampling.max_tokens and (decoder.max_len is None or len(prompt) + n < decoder.max_len)  # noqa: E731

    def take(tok: int) -> str | None:
        """Record a chosen token; why the generation stops after it, or None where a step follows."""
        tokens.append(tok)
        if tok in stop_ids:
            return "eos"
        if on_token:
            on_token(tok)
        if room(len(tokens)):
            return None
        return "max_tokens" if len(tokens) >= sampling.max_tokens else "cache_full"

    if getattr(decoder, "pipelined", False) and not time_steps:
        stop = _pipelined(decoder, sampling, gen, chosen, tok, take, room)
    else:
        while (stop := take(tok)) is None:
            s = time.perf_counter()
            tok = int(choose(decoder.step(tok), sampling, gen))
            if time_steps:
                decoder.sync()
                steps.append(time.perf_counter() - s)
    decoder.sync()
    t2 = time.perf_counter()
    peak, source = peak_memory(decoder.device if decoder.backend == "torch" else "cpu")
    return GenerationStats(
        backend=decoder.backend,
        device=decoder.device,
        prompt_tokens=len(prompt),
        prompt_seconds=t1 - t0,
        generated_tokens=len(tokens),
        generation_seconds=t2 - t1,
        peak_memory_bytes=peak,
        peak_memory_source=source,
        stop=stop,
        tokens=tokens,
        prompt_ids=list(prompt),
        compile_seconds=compile_s,
        step_seconds=steps,
        decode=decode,
    )


def _pipelined(decoder, sampling: Sampling, gen: Draws, chosen: torch.Tensor, tok: int, take, room) -> str:
    """The decode loop with the next step started before the host reads the last token.

    Why: a step's host work (on CUDA the graph launch and torch.compile's per-call checks, ~1 ms
    on the H200 host against ~3 ms of device work for a Llama-3-8B-shaped FP8 step) otherwise
    waits for the previous token to reach the host, so the two add up. Here each step takes the
    last step's choice as a device tensor (`step_chosen`), its token is copied into pinned host
    memory behind it, and the host reads it (an event wait) only after it has started the step
    that follows. That step is started only where `room` says the plain loop would step after
    the token in flight, so only an end-of-sequence token can find a step started past it, which
    is taken back (`rewind`). `take` and `room` are generate_ids' own bookkeeping; the tokens are
    the plain loop's (the same operations on the device, in the same order)."""
    cuda = torch.device(decoder.device).type == "cuda"
    host = torch.empty(2, dtype=torch.long, pin_memory=cuda)
    events = [torch.cuda.Event() if cuda else None for _ in range(2)]

    def start(prev: torch.Tensor, slot: int) -> torch.Tensor:
        nxt = choose(decoder.step_chosen(prev), sampling, gen)
        host[slot].copy_(nxt, non_blocking=cuda)
        if cuda:
            events[slot].record()
        return nxt

    if (stop := take(tok)) is not None:
        return stop
    n, slot, cur = 1, 0, start(chosen, 0)  # n: tokens taken; the step in flight gives token n + 1
    while True:
        nxt = start(cur, 1 - slot) if room(n + 1) else None
        if cuda:
            events[slot].synchronize()
        n += 1
        if (stop := take(int(host[slot]))) is not None:
            if nxt is not None:  # past an end-of-sequence token
                decoder.rewind(1)
            return stop
        slot, cur = 1 - slot, nxt
