"""Text generation from an artifact: a decode loop over a KV cache, streamed token by token.

Why our own loop rather than `model.generate`: the user sees every token as it comes (with a
text decoder that never splits a UTF-8 character), the prompt and the generation are timed
apart (prompt tokens/s, generation tokens/s, as mlx-lm prints them), and the same loop drives
the PyTorch model (transformers' `DynamicCache` passed to the model's forward) and
the Apple exports (their stateful decoder: `main(input_ids, position) -> logits`, the KV cache in
its states). Sampling follows mlx-lm's options: `temp` 0 is greedy (argmax), otherwise softmax
at that temperature with nucleus (`top_p`) filtering, seeded: the same seed gives the same
tokens on the same device and torch. The draw uses a generator on the logits' own device
(`torch.multinomial` refuses a CPU generator for MPS or CUDA probabilities), made at the first
draw, so a seed's draws are reproducible per device, not across devices.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import torch

from .. import devices
from ..errors import MpsconvertError
from ..manifests import loadable


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (mlx-lm's names): temp 0 = greedy."""

    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.max_tokens < 1:
            raise MpsconvertError(f"--max-tokens must be at least 1 (got {self.max_tokens})", "pass --max-tokens 1 or more")
        if self.temp < 0:
            raise MpsconvertError(f"--temp must be >= 0 (got {self.temp})", "pass --temp 0 for greedy decoding")
        if not 0 < self.top_p <= 1:
            raise MpsconvertError(f"--top-p must be in (0, 1] (got {self.top_p})", "pass --top-p 1.0 to keep every token")


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

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else float("inf")

    @property
    def generation_tps(self) -> float | None:
        """Tokens per second after the first (which comes out of the prefill)."""
        n = self.generated_tokens - 1
        return n / self.generation_seconds if n > 0 and self.generation_seconds > 0 else None

    def as_dict(self) -> dict:
        return {**{k: v for k, v in self.__dict__.items()}, "prompt_tokens_per_s": round(self.prompt_tps, 2),
                "generation_tokens_per_s": None if self.generation_tps is None else round(self.generation_tps, 2)}


class Decoder(Protocol):
    """One conversation with a model: `prefill(ids)` then `step(token)`, each -> last logits [V]."""

    backend: str
    device: str
    max_len: int | None  # tokens the cache holds (None: unbounded)

    def reset(self) -> None: ...
    def prefill(self, ids: list[int]) -> torch.Tensor: ...
    def step(self, token: int) -> torch.Tensor: ...
    def sync(self) -> None: ...


def accepts(model, arg: str, default: bool = False) -> bool:
    """Whether the model's forward names `arg` (`default` where its signature cannot be read)."""
    import inspect

    try:
        return arg in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return default


def cache_kwarg(model, cache) -> dict:
    """The KV cache as the model's forward names it: `cache` (transformers >= 5.24, where
    `past_key_values` is deprecated with a FutureWarning) or `past_key_values`."""
    return {"cache": cache} if accepts(model, "cache") else {"past_key_values": cache}


def takes_cache_position(model) -> bool:
    """Whether the model's forward names `cache_position` (transformers 4.x; 5.x derives the
    positions from the cache and would only pass it along unread). Where it does not, a call
    without it lets the loaded model use its own positions (runtime/positions.py)."""
    return accepts(model, "cache_position", default=True)


class TorchDecoder:
    """A transformers causal LM (as `runtime.load` returns it) over a DynamicCache."""

    backend = "torch"

    def __init__(self, model):
        self.model = model
        self.dev = next(model.parameters()).device
        self.device = str(self.dev)
        self.max_len = None
        self.cache_position = takes_cache_position(model)
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.cache_kw = cache_kwarg(self.model, self.cache)  # the forward's signature read once, not every step
        self.pos = 0

    def _run(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.dev)
        kw = dict(self.cache_kw)
        if self.cache_position:
            kw["cache_position"] = torch.arange(self.pos, self.pos + len(ids), device=self.dev)
        with torch.no_grad():
            out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **kw)
        self.pos += len(ids)
        return out.logits[0, -1].float()

    def prefill(self, ids: list[int]) -> torch.Tensor:
        return self._run(ids)

    def step(self, token: int) -> torch.Tensor:
        return self._run([token])

    def sync(self) -> None:
        devices.synchronize(self.dev)


class RunnerDecoder:
    """A stateful Apple decoder (Core AI asset or Core ML package) given as the
    `new_conversation() -> step(ids int32 [1, T], position) -> logits [T, V]` runner that
    apple/coreai/check.py and apple/coreml/check.py build: one runner call is one conversation."""

    def __init__(self, new_conversation, max_len: int, backend: str, device: str):
        self.new_conversation, self.max_len, self.backend, self.device = new_conversation, max_len, backend, device
        self.reset()

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


class Draws:
    """The seeded random source of one generation: a torch.Generator on the device of the
    probabilities it draws from (made at the first draw, with `seed`), as `torch.multinomial`
    requires. None of it is made for greedy decoding."""

    def __init__(self, seed: int):
        self.seed, self.gen = seed, None

    def on(self, device: torch.device) -> torch.Generator:
        """The generator, made on `device` at the first draw (one generation stays on one device)."""
        if self.gen is None:
            self.gen = torch.Generator(device=device).manual_seed(self.seed)
        return self.gen


def next_token(logits: torch.Tensor, sampling: Sampling, draws: Draws | None) -> int:
    """argmax at temp 0; else a draw from softmax(logits / temp) restricted to the smallest set
    of tokens whose probability reaches top_p, with `draws`' generator on the logits' device."""
    if sampling.temp == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / sampling.temp, dim=-1)
    if sampling.top_p < 1:
        p, idx = probs.sort(descending=True, stable=True)  # ties in index order, as argmax breaks them
        keep = p.cumsum(0) - p < sampling.top_p  # always keeps the first
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], p[keep])
    return int(torch.multinomial(probs, 1, generator=draws.on(probs.device) if draws is not None else None))


class TextStream:
    """Token ids -> text pieces as they can be printed: decodes everything so far and emits
    what is new, holding back a trailing partial UTF-8 character (shown as U+FFFD)."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.shown = tokenizer, [], 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        piece, self.shown = text[self.shown:], len(text)
        return piece

    def flush(self) -> str:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        piece, self.shown = text[self.shown:], len(text)
        return piece


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


def eos_ids(model_config, generation_config=None, tokenizer=None) -> set[int]:
    """Every end-of-sequence id the generation config, model config or tokenizer names."""
    out: set[int] = set()
    for src in (generation_config, model_config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        out.update([e] if isinstance(e, int) else list(e or []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        out.add(int(tokenizer.eos_token_id))
    return out


def generate_ids(decoder: Decoder, prompt: list[int], sampling: Sampling, stop_ids: Iterable[int] = (),
                 on_token: Callable[[int], None] | None = None) -> GenerationStats:
    """Prefill `prompt`, then sample up to `sampling.max_tokens` tokens (the first from the
    prefill's logits), calling `on_token` with each as soon as it is chosen. Stops at an id in
    `stop_ids` (not counted as text but counted as generated) or when the cache is full."""
    if not prompt:
        raise MpsconvertError("the prompt is empty after tokenization", "pass some text")
    if decoder.max_len is not None and len(prompt) >= decoder.max_len:
        raise MpsconvertError(f"the prompt is {len(prompt)} tokens, the {decoder.backend} model holds {decoder.max_len}",
                              "shorten the prompt, or re-export with a larger --max-len")
    stop_ids = set(stop_ids)
    gen = Draws(sampling.seed)
    decoder.reset()
    if decoder.device.startswith("cuda"):
        devices.reset_peak(torch.device(decoder.device))
    t0 = time.perf_counter()
    logits = decoder.prefill(prompt)
    tok = next_token(logits, sampling, gen)
    decoder.sync()
    t1 = time.perf_counter()
    tokens, stop = [], "max_tokens"
    while True:
        tokens.append(tok)
        if tok in stop_ids:
            stop = "eos"
            break
        if on_token:
            on_token(tok)
        if len(tokens) >= sampling.max_tokens:
            break
        if decoder.max_len is not None and len(prompt) + len(tokens) >= decoder.max_len:
            stop = "cache_full"
            break
        tok = next_token(decoder.step(tok), sampling, gen)
    decoder.sync()
    t2 = time.perf_counter()
    peak, source = peak_memory(decoder.device if decoder.backend == "torch" else "cpu")
    return GenerationStats(backend=decoder.backend, device=decoder.device, prompt_tokens=len(prompt), prompt_seconds=t1 - t0,
                           generated_tokens=len(tokens), generation_seconds=t2 - t1, peak_memory_bytes=peak,
                           peak_memory_source=source, stop=stop, tokens=tokens)


def load_tokenizer(artifact):
    """The artifact's tokenizer (copied from the source by quantize), or a one-line error
    (manifests.loadable: its files read through the bounded readers)."""
    return loadable.tokenizer(artifact)


def load_generation_config(artifact):
    return loadable.generation_config(artifact)


class Conversation:
    """Turns of a chat (or one prompt) over one decoder: the tokenizer's chat template renders
    the history each turn (re-prefilled: simple and exact; the prefill is the fast phase),
    tokens are streamed as text through `on_text`."""

    def __init__(self, decoder: Decoder, tokenizer, stop_ids: set[int], sampling: Sampling, system: str | None = None):
        self.decoder, self.tok, self.stop_ids, self.sampling = decoder, tokenizer, stop_ids, sampling
        self.history: list[dict] = [{"role": "system", "content": system}] if system else []

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def _template(self, messages: list[dict]) -> list[int]:
        return loadable.chat_ids(self.tok, messages)  # apply_chat_template's ids, the template rendered with bounds

    def encode(self, prompt: str, use_template: bool) -> list[int]:
        if use_template and self.has_template:
            return self._template(self.history + [{"role": "user", "content": prompt}])
        return list(self.tok(prompt, add_special_tokens=True)["input_ids"])

    def complete(self, ids: list[int], on_text: Callable[[str], None] | None = None) -> tuple[str, GenerationStats]:
        stream = TextStream(self.tok)

        def emit(token: int) -> None:
            piece = stream.add(token)
            if piece and on_text:
                on_text(piece)

        stats = generate_ids(self.decoder, ids, self.sampling, self.stop_ids, emit)
        rest = stream.flush()
        if rest and on_text:
            on_text(rest)
        return self.tok.decode([t for t in stats.tokens if t not in self.stop_ids], skip_special_tokens=True), stats

    def say(self, message: str, on_text: Callable[[str], None] | None = None) -> tuple[str, GenerationStats]:
        """One chat turn: the user's message, the model's reply (kept in the history)."""
        if not self.has_template:
            raise MpsconvertError("the artifact's tokenizer has no chat template", "use `mpsconvert generate` for plain text completion")
        msgs = self.history + [{"role": "user", "content": message}]
        text, stats = self.complete(self._template(msgs), on_text)
        self.history = msgs + [{"role": "assistant", "content": text}]
        return text, stats
