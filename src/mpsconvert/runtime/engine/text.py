"""Text around the engine: token ids streamed as printable text, the end-of-sequence ids, the
artifact's tokenizer and generation config, and a conversation (chat turns or one prompt) over
any decoder."""

from __future__ import annotations

from typing import Callable

from ...errors import MpsconvertError, PromptError
from ...infra.untrusted import prompt_length
from ...manifests import loadable
from .loop import Decoder, GenerationStats, generate_ids
from .sampling import Sampling


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
        piece, self.shown = text[self.shown :], len(text)
        return piece

    def flush(self) -> str:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        piece, self.shown = text[self.shown :], len(text)
        return piece


def eos_ids(model_config, generation_config=None, tokenizer=None) -> set[int]:
    """Every end-of-sequence id the generation config, model config or tokenizer names."""
    out: set[int] = set()
    for src in (generation_config, model_config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        out.update([e] if isinstance(e, int) else list(e or []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        out.add(int(tokenizer.eos_token_id))
    return out


def load_tokenizer(artifact):
    """The artifact's tokenizer (copied from the source by quantize), or a one-line error
    (manifests.loadable: only the files the manifest lists and hashes, read through the bounded readers)."""
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
        self.dropped = 0  # messages the last turn dropped from the history to fit the context
        self._longest = None

    def _check_text(self, text: str, what: str) -> None:
        """Refuse `text` before it is rendered or tokenized when it cannot be used: longer than the
        limit on prompt characters, or more bytes than the model's context could hold even at the
        vocabulary's longest token per position (a 5 MB line is not tokenized to find out)."""
        if not isinstance(text, str):
            raise PromptError(f"{what} is {type(text).__name__}, not text", "pass a string")
        prompt_length(text, what, "pass a shorter text")
        cap = self.decoder.max_len
        if cap:
            if self._longest is None:
                self._longest = (
                    max((len(t.encode("utf-8", "surrogatepass")) for t in self.tok.get_vocab()), default=1) or 1
                )
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > cap * self._longest:
                raise PromptError(
                    f"{what} is {size:,} bytes and the {self.decoder.backend} model holds {cap:,} tokens, of at most "
                    f"{self._longest} bytes each: it cannot fit",
                    "pass a shorter text",
                )

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def _template(self, messages: list[dict]) -> list[int]:
        return loadable.chat_ids(self.tok, messages)  # apply_chat_template's ids, the template rendered with bounds

    def encode(self, prompt: str, use_template: bool) -> list[int]:
        self._check_text(prompt, "the prompt")
        if use_template and self.has_template:
            return self._template(self.history + [{"role": "user", "content": prompt}])
        return loadable.encode(self.tok, prompt, add_special_tokens=True)

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

    def require_template(self) -> None:
        """Raise the one-line error of a tokenizer that cannot chat (no chat template)."""
        if not self.has_template:
            raise MpsconvertError(
                "the artifact's tokenizer has no chat template", "use `mpsconvert generate` for plain text completion"
            )

    def say(self, message: str, on_text: Callable[[str], None] | None = None) -> tuple[str, GenerationStats]:
        """One chat turn: the user's message, the model's reply (kept in the history)."""
        self.require_template()
        self._check_text(message, "the message")
        msgs = self.history + [{"role": "user", "content": message}]
        ids, self.dropped = self._template(msgs), 0
        cap = self.decoder.max_len
        if cap:  # the history outgrew the context: the oldest turns go (a system message stays), said by the caller
            room = min(self.sampling.max_tokens, max(1, cap // 4))
            while len(ids) + room > cap and (old := [i for i, m in enumerate(msgs[:-1]) if m["role"] != "system"]):
                turn = [old[0]] + ([old[1]] if len(old) > 1 and msgs[old[1]]["role"] == "assistant" else [])
                msgs = [m for i, m in enumerate(msgs) if i not in turn]
                self.dropped += len(turn)
                ids = self._template(msgs)
            if len(ids) >= cap:
                raise PromptError(
                    f"the message is {len(ids):,} tokens with the chat template, the model holds {cap:,}",
                    "send a shorter message",
                )
        text, stats = self.complete(ids, on_text)
        self.history = msgs + [{"role": "assistant", "content": text}]
        return text, stats
