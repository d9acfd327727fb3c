"""Every private transformers name the runtime touches, and nothing else: the one place to fix
when transformers renames one.

Why one module: the patches change a loaded transformers model (its attention function, its
rotary function, its packed-sequence check, its positions), and some of what they change or read
has no public name: `config._attn_implementation`, `_can_set_attn_implementation`, the modeling
module's `apply_rotary_pos_emb`, `masking_utils.find_packed_sequence_indices`, transformers'
`sdpa_attention_forward` and its SDPA mask function. Each is reached here, guarded: a name that
is gone answers None (or False), and the patch that needed it says so in its report and leaves
the model as transformers made it, never raising. tests/test_runtime_patches.py checks that no
other runtime module names them (imports from transformers' submodules, `_`-names on its
objects), and tests/test_runtime_patches.py runs on the oldest transformers pyproject allows.

It also reads the call conventions that moved between transformers versions (the cache's keyword,
whether a forward takes `cache_position`), since those are the same kind of knowledge.
"""

from __future__ import annotations

import inspect
import sys

import torch

ROTARY_FUNCTION = "apply_rotary_pos_emb"  # the modeling module's global that attention forwards call


# --------------------------------------------------------------------------- call conventions


def accepts(model, arg: str, default: bool = False) -> bool:
    """Whether the model's forward names `arg` (`default` where its signature cannot be read)."""
    try:
        return arg in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return default


def cache_kwarg(model, cache) -> dict:
    """The KV cache as the model's forward names it: `cache` (transformers >= 5.24, where
    `past_key_values` is deprecated with a FutureWarning) or `past_key_values`."""
    return {"cache": cache} if accepts(model, "cache") else {"past_key_values": cache}


def _static_layer():
    try:
        from transformers.cache_utils import StaticLayer
    except ImportError:  # pragma: no cover - a transformers without it
        return None
    return StaticLayer


def _positioned_update(self, key_states, value_states, *args, **kwargs):
    """StaticLayer.update (transformers 5.16-5.25) without advancing `cumulative_length`: the keys
    and values are written at the position the caller set there."""
    if not self.is_initialized:
        self.lazy_initialization(key_states, value_states)
    at = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
    try:
        self.keys.index_copy_(2, at, key_states)
        self.values.index_copy_(2, at, value_states)
    except NotImplementedError:  # devices without index_copy_ (MPS), as StaticLayer does
        self.keys[:, :, at] = key_states
        self.values[:, :, at] = value_states
    return self.keys, self.values


_POSITIONED: dict = {}  # StaticLayer -> its subclass that writes at the caller's position


def _plain(layer, base, capacity: int) -> bool:
    """Whether a StaticCache layer writes as a plain StaticLayer: one, or a sliding-window one
    whose window holds the whole cache (transformers makes it min(window, length) long, so it
    never fills, and its mask is the causal one)."""
    if not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
        return False
    if type(layer) is base:
        return True
    return isinstance(layer, base) and type(layer).__name__ == "StaticSlidingWindowLayer" and layer.max_cache_len >= capacity


def write_at(cache, position, capacity: int) -> bool:
    """Make every layer of a transformers StaticCache of `capacity` positions write at `position`
    (a 0-d long tensor on the cache's device, which the caller sets before each forward) instead
    of at a counter of its own.

    Why: StaticCache layers (5.16 on) write at a per-layer `cumulative_length` that every update
    advances in place: in a CUDA-graph decode step that is one more small kernel per layer per
    token (32 a step for Llama-3-8B, ~1.2 us each on the H100, plus a launch gap each), and a
    step taken back must be taken back in every layer's counter too. With one position tensor,
    shared by the layers and advanced by the caller outside the graph, the step writes nothing
    but the keys and values. A sliding-window layer also keeps a Python int, which a captured
    graph cannot follow (every step would compile anew); where its window holds the whole cache
    it is a plain layer and becomes one here. Every layer must be one of those; otherwise the
    cache is left as it is and False is returned."""
    base = _static_layer()
    layers = list(getattr(cache, "layers", ()))
    if base is None or not layers or not all(_plain(layer, base, capacity) for layer in layers):
        return False
    cls = _POSITIONED.get(base)
    if cls is None:
        cls = _POSITIONED[base] = type("PositionedStaticLayer", (base,), {"update": _positioned_update})
    for layer in layers:
        layer.__class__ = cls
        layer.cumulative_length = position  # read by get_seq_length (the mask's offset) and by the update above
    return True


def static_cache_compiles(cache) -> bool:
    """Whether a captured decode step can replay over this StaticCache: False where a layer keeps
    its length in a Python int (a sliding-window layer that can fill), which would make every
    step compile anew."""
    return not any(hasattr(layer, "cumulative_length_int") and type(layer) not in _POSITIONED.values()
                   for layer in getattr(cache, "layers", ()))  # fmt: skip


def rewind_cache(cache, steps: int) -> None:
    """Move a static cache's own write positions back by `steps`. transformers' StaticCache layers
    (5.16 on) write at a per-layer counter (`cumulative_length`), not at the positions a step
    passes, so a step the engine takes back must also be taken back there; layers that write at
    the caller's position (`write_at`) or where they are told need nothing."""
    for layer in getattr(cache, "layers", ()):
        n = getattr(layer, "cumulative_length", None)
        if hasattr(n, "sub_") and type(layer) not in _POSITIONED.values():  # a tensor, updated in place: a compiled step holds its address
            n.sub_(steps)


def takes_cache_position(model) -> bool:
    """Whether the model's forward names `cache_position` (transformers 4.x; 5.x derives the
    positions from the cache and would only pass it along unread)."""
    return accepts(model, "cache_position", default=True)


# --------------------------------------------------------------------------- attention


def attn_implementation(config) -> str | None:
    """The attention implementation a config selects (transformers keeps it private)."""
    return getattr(config, "_attn_implementation", None)


def can_set_attention(model) -> bool:
    """Whether the model can switch its attention implementation after it was built."""
    can = getattr(model, "_can_set_attn_implementation", None)
    return hasattr(model, "set_attn_implementation") and callable(can) and bool(can())


def sdpa_forward():
    """transformers' own SDPA attention function, or None where it moved."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as fn
    except ImportError:
        return None
    return fn


def register_attention(name: str, forward) -> bool:
    """Register `forward` as attention implementation `name`, with SDPA's mask function (the
    mask registry is private); False where either registry is missing."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:
        return False
    if "sdpa" not in ALL_MASK_ATTENTION_FUNCTIONS:
        return False
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return True


# --------------------------------------------------------------------------- rotary


def rotary_home(module, forward):
    """The modeling module whose `apply_rotary_pos_emb` `forward` (an attention module's own
    forward) calls by its global name, or None."""
    code = getattr(inspect.unwrap(forward), "__code__", None)
    if code is None or ROTARY_FUNCTION not in code.co_names:
        return None
    home = sys.modules.get(type(module).__module__)
    return home if callable(getattr(home, ROTARY_FUNCTION, None)) else None


def rotary_function(home):
    return getattr(home, ROTARY_FUNCTION)


def set_rotary_function(home, fn) -> None:
    setattr(home, ROTARY_FUNCTION, fn)


# --------------------------------------------------------------------------- masks


def _masking():
    try:
        import transformers.masking_utils as masking
    except ImportError:
        return None
    return masking


def packed_sequence_check():
    """transformers' `find_packed_sequence_indices` as it is now (ours once replaced), or None."""
    masking = _masking()
    return getattr(masking, "find_packed_sequence_indices", None) if masking is not None else None


def set_packed_sequence_check(fn) -> None:
    _masking().find_packed_sequence_indices = fn


# --------------------------------------------------------------------------- generate()


def generation_config(model, given, kwargs: dict):
    """(the generation config a `model.generate(generation_config=given, **kwargs)` call runs with,
    the keyword arguments it leaves for the model), resolved by transformers' own
    `_prepare_generation_config` (the call's settings, then the model's generation config, then
    transformers' defaults); a string saying why not where that method is gone or refuses the call
    (transformers' generate() then says the same to the caller)."""
    prepare = getattr(model, "_prepare_generation_config", None)
    if not callable(prepare):
        return "transformers has no _prepare_generation_config (hf_compat)"
    try:
        gc, rest = prepare(given, **kwargs)
    except Exception as e:  # the caller's settings are transformers' to judge
        return f"transformers refused the settings: {type(e).__name__}: {str(e)[:160]}"
    return gc, dict(rest)


def default_generation_config():
    """transformers' generation config with nothing set: its defaults (5.x keeps them apart, in
    `_get_default_generation_params`; 4.x in the constructor)."""
    from transformers import GenerationConfig

    gc = GenerationConfig()
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    if callable(defaults):
        gc.update(**defaults(), defaults_only=True)
    return gc


# --------------------------------------------------------------------------- names the scan knows

PRIVATE = ("_attn_implementation", "_can_set_attn_implementation", ROTARY_FUNCTION, "find_packed_sequence_indices",
           "sdpa_attention_forward", "ALL_MASK_ATTENTION_FUNCTIONS", "AttentionMaskInterface", "masking_utils",
           "_prepare_generation_config", "_get_default_generation_params")
