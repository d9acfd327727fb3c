"""Accuracy and latency statistics for `validate`: small pure functions, float64 where it matters.

Causal LMs are compared on next-token distributions at every position that has a next token:
perplexity of each model on the eval text, mean KL(baseline || fp8) (how much information the
FP8 model loses about the baseline's prediction) and top-1 agreement (how often both pick the
same next token). Encoders are compared on sentence embeddings, mean-pooled over the attention
mask as sentence-transformers does for all-MiniLM-L6-v2.

Where float64 matters it is computed on the CPU (`cpu64`), never on the device: MPS has no
float64 at all, and float32 is not exact enough. The KL of an FP8 model against its baseline is
often 1e-4 nats per token, a sum over the vocabulary of differences of log-probabilities of
magnitude ~10, where float32's rounding (~1e-6 each) is a visible share of the result. The
logits cross in their own dtype (BF16: half of float32's bytes), a bounded number of positions
at a time (`CausalLMScores`), which is small beside the two forwards that produced them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_CHUNK_ELEMS = 1 << 23  # logits per float64 block on the CPU (64 MB): positions x vocabulary


def cpu64(t: torch.Tensor) -> torch.Tensor:
    """t on the CPU as float64: moved first (in its own dtype), converted there."""
    return t.detach().cpu().double()


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().cpu()


def token_nll(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-position negative log-likelihood of `labels` (already shifted), float64 on the CPU, masked positions
    dropped."""
    logp = F.log_softmax(cpu64(logits), dim=-1)
    nll = -logp.gather(-1, _cpu(labels).unsqueeze(-1)).squeeze(-1)
    return nll[_cpu(mask).bool()] if mask is not None else nll.reshape(-1)


def kl_divergence(
    base_logits: torch.Tensor, test_logits: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-position KL(base || test) in nats, float64 on the CPU."""
    lp = F.log_softmax(cpu64(base_logits), dim=-1)
    lq = F.log_softmax(cpu64(test_logits), dim=-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return kl[_cpu(mask).bool()] if mask is not None else kl.reshape(-1)


def top1_agree(base_logits: torch.Tensor, test_logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    same = base_logits.argmax(-1) == test_logits.argmax(-1)
    return same[mask.bool()] if mask is not None else same.reshape(-1)


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """sentence-transformers' mean pooling: average of the token embeddings where mask == 1."""
    m = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity, float64 on the CPU."""
    return F.cosine_similarity(cpu64(a), cpu64(b), dim=-1)


@dataclass
class CausalLMScores:
    """Running sums over batches; `result()` gives the reported numbers."""

    tokens: int = 0
    nll_base: float = 0.0
    nll_test: float = 0.0
    kl: float = 0.0
    agree: int = 0

    def update(self, base_logits, test_logits, input_ids, attention_mask=None) -> None:
        """Logits [B, T, V] of both models on the same `input_ids` [B, T]; position t predicts t+1.
        Positions go to the CPU in blocks of at most `_CHUNK_ELEMS` logits (module docstring)."""
        vocab = base_logits.shape[-1]
        b, t = base_logits[:, :-1].reshape(-1, vocab), test_logits[:, :-1].reshape(-1, vocab)
        labels = input_ids[:, 1:].reshape(-1)
        mask = (attention_mask[:, 1:] * attention_mask[:, :-1]).reshape(-1) if attention_mask is not None else None
        step = max(1, _CHUNK_ELEMS // vocab)
        for i in range(0, b.shape[0], step):
            bb, tt, ll = cpu64(b[i : i + step]), cpu64(t[i : i + step]), _cpu(labels[i : i + step])
            mm = _cpu(mask[i : i + step]) if mask is not None else None
            self.nll_base += float(token_nll(bb, ll, mm).sum())
            self.nll_test += float(token_nll(tt, ll, mm).sum())
            self.kl += float(kl_divergence(bb, tt, mm).sum())
            agree = top1_agree(bb, tt, mm)
            self.agree += int(agree.sum())
            self.tokens += int(agree.numel())

    def result(self) -> dict:
        n = max(self.tokens, 1)
        ppl_b, ppl_t = math.exp(self.nll_base / n), math.exp(self.nll_test / n)
        return {
            "tokens": self.tokens,
            "perplexity_bf16": ppl_b,
            "perplexity_fp8": ppl_t,
            "perplexity_delta": ppl_t - ppl_b,
            "perplexity_delta_pct": 100.0 * (ppl_t - ppl_b) / ppl_b,
            "mean_kl": self.kl / n,
            "top1_agreement": self.agree / n,
        }
