"""`chat` and `generate`: the decoder a backend names (the PyTorch model through the runtime's
loader, or an Apple target's stateful package on its runtime, apple/flow.py), the artifact's
tokenizer and generation config, and the runtime's one generation engine (runtime/engine)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..apple import flow, registry
from ..errors import ArtifactError, MpsconvertError
from ..infra.progress import Progress
from ..manifests import loadable


@dataclass
class GenerateResult:
    """One generation: the text (without the prompt) and how it ran (`stats`: prompt and
    generation tokens/s, peak memory, device, the token ids, why it stopped)."""

    text: str
    stats: Any  # runtime.engine.GenerationStats
    load: dict | None = (
        None  # the load's seconds by step (LoadInfo.seconds) where this generation's model was loaded by `load`
    )
    dropped: int = 0  # chat: the oldest messages dropped from the history so that it fits the model's context

    def as_dict(self) -> dict:
        return {
            "text": self.text,
            **self.stats.as_dict(),
            **({"load_seconds": self.load} if self.load is not None else {}),
            **({"dropped_messages": self.dropped} if self.dropped else {}),
        }


class Chat:
    """An open model for a conversation (a context manager: closes the Apple runtime session).
    `say(message, on_text)` -> GenerateResult, the history kept in `history`."""

    def __init__(self, conversation, closer):
        self._conv, self._closer = conversation, closer

    @property
    def history(self) -> list[dict]:
        return self._conv.history

    @property
    def backend(self) -> str:
        return self._conv.decoder.backend

    @property
    def device(self) -> str:
        return self._conv.decoder.device

    @property
    def kernels_held(self) -> bool:
        """Whether the model still runs torch's kernels while this machine's first compile of
        mpsconvert's GPU kernels runs (runtime/load/held.py): closing then waits for it."""
        from ..runtime.load import held

        return held.held(getattr(self._conv.decoder, "model", None)) is not None

    def require_template(self) -> None:
        """Raises MpsconvertError where the tokenizer has no chat template (`say` would, at the first message)."""
        self._conv.require_template()

    def _load_seconds(self) -> dict | None:
        info = getattr(getattr(self._conv.decoder, "model", None), "mpsconvert", None)
        return dict(info.seconds) if info is not None and isinstance(getattr(info, "seconds", None), dict) else None

    def say(self, message: str, on_text=None) -> GenerateResult:
        text, stats = self._conv.say(message, on_text)
        return GenerateResult(text, stats, self._load_seconds(), self._conv.dropped)

    def complete(self, prompt: str, on_text=None, use_template: bool = True) -> GenerateResult:
        """A prompt on its own (no history): what `generate` runs."""
        text, stats = self._conv.complete(self._conv.encode(prompt, use_template), on_text)
        return GenerateResult(text, stats, self._load_seconds())

    def reset(self) -> None:
        """Forget the conversation (a system message stays)."""
        self._conv.history[:] = [m for m in self._conv.history if m["role"] == "system"]

    def close(self) -> None:
        """Close the Apple runtime session; on a machine's first run with the torch backend, first
        wait for the GPU kernels still compiling, so that the next process loads with them
        (runtime/load/held.py)."""
        self._closer.close()

    def __enter__(self) -> "Chat":
        return self

    def __exit__(self, *exc) -> None:
        self._closer.__exit__(*exc)


def backends() -> tuple[str, ...]:
    """What generate and chat run on: "torch" (runtime.load), or an Apple target's package."""
    return ("torch", *registry.TARGETS)


def open_decoder(
    artifact: Path,
    backend: str,
    device: str,
    stack: contextlib.ExitStack,
    progress: Progress | None,
    compile: bool | str | None = None,
):
    """(the decoder of `backend`, the model's config or None): the PyTorch model on `device`, or
    an Apple target's stateful package on its runtime (apple/flow.py's `decoder`)."""
    from ..runtime import engine as gen

    if backend == "torch":
        import torch

        from ..model.definition import is_causal_lm
        from ..runtime.load import held, loader

        model = loader.load(artifact, device=device, dtype=torch.bfloat16, verify=True, progress=progress)

        def finish_held(kind, *_) -> bool:  # a machine's first run: its GPU kernels, for the next process
            if kind is None:  # nothing is waited for after an error (Ctrl-C too)
                held.finish(model)
            return False

        stack.push(finish_held)
        if not is_causal_lm(model.config):
            raise ArtifactError(
                f"{artifact} is not a causal LM ({', '.join(model.config.architectures or ['?'])})",
                "generate and chat need a text-generation model; use `mpsconvert validate` for encoders",
            )
        return gen.Engine(model, compile=compile), model.config
    if backend not in registry.TARGETS:
        raise MpsconvertError(f"unknown backend {backend!r}", f"use one of: {', '.join(backends())}")
    new_conversation, max_len, runs_on = flow.decoder(artifact, backend, stack)
    return gen.RunnerDecoder(new_conversation, max_len, backend, runs_on), None


def chat(
    artifact: str | Path,
    *,
    backend: str = "torch",
    device: str = "auto",
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    system: str | None = None,
    progress: Progress | None = None,
    compile: bool | str | None = None,
) -> Chat:
    """Open an artifact for text generation: `with chat(dir) as c: c.say("hi", print)`.

    Args:
        artifact: the artifact folder (a causal LM with its tokenizer).
        backend: "torch" (runtime.load on `device`), "coreai" (model.aimodel on the Core AI
            runtime; on Linux the CPU runtime bundled in coreai-core) or "coreml"
            (model.mlpackage; macOS only).
        device: for torch: "auto" (mps > cuda > cpu), "mps", "cuda[:N]" or "cpu".
        max_tokens, temp, top_p, top_k, seed: sampling, as mlx-lm names it (temp 0: greedy; top_k 0:
            every token; top-k before top-p, as transformers orders them).
        system: a system message that starts the history.
        progress: `progress(phase, done, total, detail)` while loading.
        compile: torch backend: how the decode step runs (runtime/engine/decoder.py,
            `decode_path`). None: on CUDA the eager step captured as a CUDA graph (seconds), eager
            elsewhere; True or "compile": torch.compile's CUDA graph (~30 s per process, a few
            percent faster per token); "graph"; False or "eager": the eager loop (`--no-compile`).
            Set up before the first token is timed; `stats.decode` says which path ran and what
            it cost (`stats.compile_seconds` too).

    Returns:
        Chat: `say(message, on_text)` and `complete(prompt, on_text)` -> GenerateResult.

    Raises:
        ArtifactError: not a causal LM, no tokenizer, or the asked-for export is absent.
        MissingExtraError: the backend's extra is not installed.
        MpsconvertError: Core ML off macOS, bad sampling settings.
        DeviceError: the device is not available.
    """
    from ..model.definition import load_config
    from ..runtime import engine as gen

    artifact = Path(artifact)
    sampling = gen.Sampling(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, seed=seed)
    stack = contextlib.ExitStack()
    loadable.start_renderer(artifact)  # its worker starts while the model loads, not before the first token
    try:
        decoder, config = open_decoder(
            artifact, backend, device, stack, progress, compile
        )  # the backend's own checks, then the artifact verified
        tok = gen.load_tokenizer(artifact)  # after: a verified copy of the listed files (manifests/loadable.verified)
        config = config or load_config(artifact, False)
        conv = gen.Conversation(
            decoder, tok, gen.eos_ids(config, gen.load_generation_config(artifact), tok), sampling, system
        )
    except BaseException:
        stack.close()
        raise
    return Chat(conv, stack)


def generate(
    artifact: str | Path, prompt: str, *, on_text=None, use_template: bool = True, **kw: Any
) -> GenerateResult:
    """Generate text for one prompt, streaming it through `on_text(piece)` as tokens come.

    Args:
        artifact: the artifact folder.
        prompt: the text; wrapped in the tokenizer's chat template when it has one and
            `use_template` (as mlx_lm.generate does).
        on_text: called with each new piece of text.
        **kw: backend, device, max_tokens, temp, top_p, top_k, seed, system, progress (see `chat`).

    Returns:
        GenerateResult: the text and its stats (prompt / generation tokens/s, peak memory, device).

    Raises:
        As `chat`.
    """
    with chat(artifact, **kw) as c:
        return c.complete(prompt, on_text, use_template)
