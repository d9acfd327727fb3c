"""How the next token is chosen, mlx-lm's options: `temp` 0 is greedy (argmax), otherwise softmax
at that temperature, then the `top_k` most likely tokens, then nucleus (`top_p`) filtering (the
order of transformers' warpers), seeded: the same seed gives the same tokens on the same device
and torch. The draw uses a generator on the logits' own device (`torch.multinomial` refuses a CPU
generator for MPS or CUDA probabilities), made at the first draw, so a seed's draws are
reproducible per device, not across devices; seed None draws from the device's default
generator, as transformers' generate() does (`torch.manual_seed` repeats it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import MpsconvertError


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (mlx-lm's names): temp 0 = greedy."""

    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    seed: int | None = 0
    top_k: int = 0  # 0: every token

    def __post_init__(self):
        from ...infra.untrusted import bounded

        bounded(self.max_tokens, "max_tokens", fix=_FIXES["max_tokens"])
        bounded(self.temp, "temp", integer=False, fix=_FIXES["temp"])
        bounded(self.top_p, "top_p", integer=False, fix=_FIXES["top_p"])
        if self.seed is not None:
            bounded(self.seed, "seed")
        for name, wrong, want in (
            ("max_tokens", self.max_tokens < 1, "at least 1"),
            ("temp", self.temp < 0, ">= 0"),
            ("top_p", not 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k < 0, ">= 0"),
        ):
            if wrong:
                raise MpsconvertError(f"`{name}` must be {want} (got {getattr(self, name)})", _FIXES[name])


_FIXES = {  # what to pass instead of an option's value out of range
    "max_tokens": "pass `max_tokens=1` or more",
    "temp": "pass `temp=0` for greedy decoding",
    "top_p": "pass `top_p=1.0` to keep every token",
    "top_k": "pass `top_k=0` to keep every token",
}


class Draws:
    """The seeded random source of one generation: a torch.Generator on the device of the
    probabilities it draws from (made at the first draw, with `seed`), as `torch.multinomial`
    requires. None of it is made for greedy decoding."""

    def __init__(self, seed: int | None):
        self.seed, self.gen = seed, None

    def on(self, device: torch.device) -> torch.Generator | None:
        """The generator, made on `device` at the first draw (one generation stays on one device);
        None (the device's default generator) for seed None."""
        if self.gen is None and self.seed is not None:
            self.gen = torch.Generator(device=device).manual_seed(self.seed)
        return self.gen


def next_token(logits: torch.Tensor, sampling: Sampling, draws: Draws | None) -> int:
    """argmax at temp 0; else a draw from softmax(logits / temp) restricted to the top_k most
    likely tokens, then to the smallest set of those whose probability reaches top_p, with
    `draws`' generator on the logits' device."""
    return int(choose(logits, sampling, draws))


def choose(logits: torch.Tensor, sampling: Sampling, draws: Draws | None) -> torch.Tensor:
    """`next_token`'s choice as a 0-d tensor on the logits' device, with no wait for the device:
    the loop can start the next step with it before the host has read it (engine/loop.py)."""
    if sampling.temp == 0:
        return logits.argmax()
    probs = torch.softmax(logits.float() / sampling.temp, dim=-1)
    if 0 < sampling.top_k < probs.numel():  # ties with the k-th are kept, as transformers' top-k keeps them
        probs = torch.where(probs >= probs.topk(sampling.top_k).values[-1], probs, 0.0)
        probs = probs / probs.sum()  # top-p then reads the renormalised distribution, as transformers' warpers do
    if sampling.top_p < 1:
        p, idx = probs.sort(descending=True, stable=True)  # ties in index order, as argmax breaks them
        keep = p.cumsum(0) - p < sampling.top_p  # always keeps the first
        probs = torch.zeros_like(probs).scatter_(0, idx, p * keep)  # no boolean indexing: it would wait for the device
    return torch.multinomial(probs, 1, generator=draws.on(probs.device) if draws is not None else None).reshape(())
