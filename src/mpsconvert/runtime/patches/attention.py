"""Decode attention for the loaded model: split-KV (flash-decoding) with grouped heads, on CUDA.

Why a kernel of our own: at decode a transformers model calls SDPA with one query per head
against the whole static cache. Under torch.compile transformers first repeats every key/value
head for its query group (`repeat_kv`: the cache of a Llama-3-8B layer, 8.6 MB, copied into
34 MB), then SDPA runs one program per head (32 of the H200's 132 SMs busy). On the H200 that is
six kernels and ~29 us per layer, ~0.9 ms of a 5.4 ms FP8 decode step (32 layers, 2096 cached
positions; docs/runtime-notes.md). Here one program reads one key/value tile once for all
query heads of its group (no repeat), the cache is split across programs so that every SM has
work, and a second kernel combines the partial softmaxes: two kernels per layer. Tiles the mask
excludes entirely (the unused tail of a static cache) are not read at all.

`install(model)` registers the function under `NAME` with transformers' AttentionInterface and
switches a model that uses SDPA to it. Every call the kernel cannot take (prefill: more than
`MAX_QUERY` queries; CPU / MPS; head sizes it does not take; soft-capping, sinks, dropout, a
float mask) runs transformers' own `sdpa_attention_forward` unchanged, and its mask is built by
transformers' own SDPA mask function, so prefill is exactly what SDPA computes.

The numbers: scores and the softmax in float32, probabilities rounded to the value dtype before
the product with V (as flash attention does); tests compare with SDPA (TRITON_INTERPRET=1 on CPU).
"""

from __future__ import annotations

from ...model import hf_compat
from ..ops import triton as tritonlib
from ..ops.triton.attention_kernel import decode_attention, takes

NAME = "mpsconvert_sdpa"  # contains "sdpa": transformers runs its SDPA checks for it


# What transformers' attention modules pass besides q, k, v and the mask that leaves the decode
# kernel's result unchanged: the layer's own arguments, passed along unread by SDPA too
# (`sliding_window` is in the boolean mask already). Anything else set (soft-capping, sinks,
# attention biases, a future argument) runs SDPA: an allow-list, so what is new is never ignored.
ACCEPTED = hf_compat.POSITION_AND_CACHE_KWARGS | {"sliding_window", "is_causal", "output_attentions", "layer_idx"}


def accepts(kwargs: dict) -> bool:
    """Whether every argument set in `kwargs` is one the decode kernel may ignore."""
    return all(k in ACCEPTED or v is None or v is False for k, v in kwargs.items())


def attention_forward(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs
):
    """transformers' attention-function signature: the decode kernel where it applies, SDPA otherwise."""
    if accepts(kwargs) and takes(query, key, attention_mask, dropout):
        return decode_attention(query, key, value, attention_mask, scaling), None
    return _SDPA(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


_SDPA = hf_compat.sdpa_forward()  # transformers' own SDPA: every call the kernel does not take


def register() -> bool:
    """Make NAME known to transformers: our attention function, SDPA's mask."""
    return _SDPA is not None and hf_compat.register_attention(NAME, attention_forward)


def install(model) -> str | None:
    """Switch a model that runs SDPA to NAME (decode kernel + SDPA); returns what it runs now, or
    None where it was left alone (another attention was chosen, or the model cannot switch)."""
    if not tritonlib.available() or hf_compat.attn_implementation(model.config) != "sdpa":
        return None
    if not hf_compat.can_set_attention(model) or not register():
        return None
    model.set_attn_implementation(NAME)
    return NAME if hf_compat.attn_implementation(model.config) == NAME else None
