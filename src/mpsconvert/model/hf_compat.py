"""Every private or internal transformers name mpsconvert touches, and nothing else: the one
place to fix when transformers renames one.

Why one module: the runtime patches change a loaded transformers model (its attention function,
its rotary function, its packed-sequence check, its positions), and some of what they change or
read has no public name: `config._attn_implementation`, `_can_set_attn_implementation`, the
modeling module's `apply_rotary_pos_emb`, `masking_utils.find_packed_sequence_indices`,
transformers' `sdpa_attention_forward` and its SDPA mask function. Each is reached here, guarded:
a name that is gone answers None (or False), and the patch that needed it says so in its report
and leaves the model as transformers made it, never raising.

The rest of the package needs more of the same kind: which model types have a causal-LM class,
how fused MoE experts gate, transformers' weight conversion between checkpoint and model names
(in both directions), the base class of a cache layer, the function that renders chat templates.
Each is one named function or constant here, its docstring saying what it relies on.
tests/test_runtime_patches.py checks that no other module of src/mpsconvert names them (imports
from transformers' submodules, the names in `PRIVATE`), and runs on the oldest transformers
pyproject allows.

It also reads the call conventions that moved between transformers versions (the cache's keyword,
whether a forward takes `cache_position`), since those are the same kind of knowledge.
"""

from __future__ import annotations

import importlib
import inspect
import sys

import torch

# What transformers' decoder layers pass on to their attention besides its input: the positions and the KV cache
# (under either of its names, `past_key_values` and `cache`).
POSITION_AND_CACHE_KWARGS = frozenset(
    {"position_ids", "past_key_values", "cache", "use_cache", "cache_position", "position_embeddings"}
)
ROTARY_FUNCTION = "apply_rotary_pos_emb"  # the modeling module's global that attention forwards call
CACHE_ARGS = ("past_key_values", "cache")  # the KV cache's keyword names, the older first (`cache`: 5.24 on)


# --------------------------------------------------------------------------- call conventions


def accepts(model, arg: str, default: bool = False) -> bool:
    """Whether the model's forward names `arg` (`default` where its signature cannot be read)."""
    try:
        return arg in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return default


def passed_cache(kwargs: dict):
    """The KV cache a forward was called with, under either of its names (None where none was)."""
    return next((kwargs[k] for k in CACHE_ARGS if kwargs.get(k) is not None), None)


def cache_arg(kwargs: dict) -> str | None:
    """The name a call's KV cache argument has in `kwargs` (set or None), or None where it has none."""
    return next((k for k in CACHE_ARGS if k in kwargs), None)


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
    and values are written at the position the caller set there. One token (a decode step) is
    written at that position tensor itself, viewed as an index: no arange and no add, two kernels
    a layer fewer in every captured step."""
    if not self.is_initialized:
        self.lazy_initialization(key_states, value_states)
    n = key_states.shape[-2]
    at = self.cumulative_length.view(1) if n == 1 else torch.arange(n, device=self.device) + self.cumulative_length
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
    return (
        isinstance(layer, base)
        and type(layer).__name__ == "StaticSlidingWindowLayer"
        and layer.max_cache_len >= capacity
    )


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


def positioned_slot(cache, layer_idx: int):
    """(keys, values, position) of a cache layer that `write_at` made write at the caller's position,
    once it holds its tensors, for a caller that writes a decode token there itself; else None."""
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if isinstance(layers, list) and 0 <= layer_idx < len(layers) else None
    if type(layer) not in _POSITIONED.values() or not layer.is_initialized:
        return None
    return layer.keys, layer.values, layer.cumulative_length


def static_cache_compiles(cache) -> bool:
    """Whether a captured decode step can replay over this StaticCache: False where a layer keeps
    its length in a Python int (a sliding-window layer that can fill), which would make every
    step compile anew."""
    return not any(
        hasattr(layer, "cumulative_length_int") and type(layer) not in _POSITIONED.values()
        for layer in getattr(cache, "layers", ())
    )


def rewind_cache(cache, steps: int) -> None:
    """Move a static cache's own write positions back by `steps`. transformers' StaticCache layers
    (5.16 on) write at a per-layer counter (`cumulative_length`), not at the positions a step
    passes, so a step the engine takes back must also be taken back there; layers that write at
    the caller's position (`write_at`) or where they are told need nothing."""
    for layer in getattr(cache, "layers", ()):
        n = getattr(layer, "cumulative_length", None)
        if (
            hasattr(n, "sub_") and type(layer) not in _POSITIONED.values()
        ):  # a tensor, updated in place: a compiled step holds its address
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


# --------------------------------------------------------------------------- model classes


def has_causal_lm_class(model_type) -> bool:
    """Whether transformers' AutoModelForCausalLM knows `model_type` (its private name table
    `models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def experts_kwargs(implementation: str) -> dict:
    """The `from_config` / `from_pretrained` keyword that picks the forward of fused MoE experts
    (transformers 5's experts interface, e.g. "batched_mm": every token's experts gathered and
    multiplied at once, no data-dependent loop)."""
    return {"experts_implementation": implementation}


# --------------------------------------------------------------------------- MoE experts


def expert_gate(mod, h):
    """act(gate) * up of a fused experts module for its gate_up rows `h`, as the module computes
    it: its own `_apply_gate` (transformers 5's experts interface, which a model may override),
    else `act_fn` of the first half times the second (transformers without that interface)."""
    if hasattr(mod, "_apply_gate"):
        return mod._apply_gate(h)
    gate, up = h.chunk(2, dim=-1)
    return mod.act_fn(gate) * up


def _default_gate_impl():
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # older transformers: no experts interface, plain act(gate) * up
        return None
    return _default_apply_gate


def has_default_gate(mod) -> bool:
    """Whether a fused experts module gates as transformers' experts interface does by default
    (`integrations.moe._default_apply_gate`: act(gate) * up over concatenated halves), not by a
    `_apply_gate` of its own; on a transformers without that interface, whether it defines none."""
    return getattr(type(mod), "_apply_gate", None) is _default_gate_impl()


# --------------------------------------------------------------------------- weight conversion


class _Unloaded:
    """The model without its load history: a model loaded through a quantizer carries
    conversions (e.g. compressed-tensors' DecompressExperts, in the private
    `_weight_conversions`) that have no reverse; the architecture's own mapping is what names
    the checkpoint's tensors."""

    _weight_conversions = None

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)


def _has(api: dict[str, list[str]]) -> bool:
    """Whether every module of `api` imports and holds each of its names (a `from module import name` that works)."""
    try:
        return all(hasattr(importlib.import_module(m), n) for m, names in api.items() for n in names)
    except ImportError:
        return False


def has_weight_conversion() -> bool:
    """Whether this transformers converts weights between checkpoint and model names and
    layouts (`core_model_loading`, transformers 5); older ones load checkpoints by the model's
    own names."""
    return _has({"transformers.core_model_loading": ["revert_weight_conversion"]})


def saved_form(model, tensors: dict) -> dict:
    """`tensors` (model parameter names -> tensors) as `save_pretrained` would write them:
    transformers' weight conversion mapping run in its save direction
    (`core_model_loading.revert_weight_conversion`) on the architecture's own mapping. Fused
    3-D experts come back split per expert and renamed to the checkpoint's legacy names; names
    no mapping touches come back as they are.

    Raises:
        ImportError: this transformers has no weight conversion (see `has_weight_conversion`).
        Whatever the conversion raises where no mapping applies to these tensors.
    """
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(_Unloaded(model), tensors)


def can_load_converted() -> bool:
    """Whether this transformers has the API `load_converted` uses (transformers 5)."""
    return _has(
        {
            "transformers.conversion_mapping": ["get_model_conversion_mapping"],
            "transformers.core_model_loading": ["convert_and_load_state_dict_in_model"],
            "transformers.modeling_utils": ["LoadStateDictConfig"],
        }
    )


def load_converted(model, state: dict, model_dir, device, dtype) -> None:
    """Load checkpoint tensors `state` (checkpoint names -> tensors or safetensors slices) into
    `model` through transformers' load-time weight conversion, as `from_pretrained` would
    (per-expert MoE weights fused into 3-D parameters, renamed modules): the model's
    `conversion_mapping.get_model_conversion_mapping`, run by
    `core_model_loading.convert_and_load_state_dict_in_model` with a
    `modeling_utils.LoadStateDictConfig`.

    Raises:
        ImportError: this transformers has no such API (see `can_load_converted`).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    config = LoadStateDictConfig(
        pretrained_model_name_or_path=str(model_dir),
        device_map={"": device},
        dtype=dtype,
        weight_mapping=get_model_conversion_mapping(model),
    )
    convert_and_load_state_dict_in_model(model=model, state_dict=state, load_config=config)


# --------------------------------------------------------------------------- cache classes


def cache_classes(layer_base: type, name: str):
    """(transformers' `Cache`, a cache layer class `name` made of `layer_base` and transformers'
    `cache_utils.CacheLayerMixin`), for a cache whose layers are ours: `layer_base` implements
    what a layer does; the mixin makes transformers accept it. The mixin's abstract methods
    are declared answered (`__abstractmethods__` emptied), since `layer_base` defines what is
    called of them."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    layer_cls = type(name, (layer_base, CacheLayerMixin), {"__init__": layer_base.__init__})
    layer_cls.__abstractmethods__ = frozenset()
    return Cache, layer_cls


# --------------------------------------------------------------------------- chat templates

# The module and function `apply_chat_template` renders a chat template with (private). The
# render worker of model/templates.py imports them in a process of its own.
CHAT_TEMPLATE_RENDERER = ("transformers.utils.chat_template_utils", "render_jinja_template")


# --------------------------------------------------------------------------- names the scan knows

PRIVATE = (
    "_attn_implementation",
    "_can_set_attn_implementation",
    ROTARY_FUNCTION,
    "find_packed_sequence_indices",
    "sdpa_attention_forward",
    "ALL_MASK_ATTENTION_FUNCTIONS",
    "AttentionMaskInterface",
    "masking_utils",
    "_prepare_generation_config",
    "_get_default_generation_params",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "experts_implementation",
    "_apply_gate",
    "_default_apply_gate",
    "_weight_conversions",
    "revert_weight_conversion",
    "get_model_conversion_mapping",
    "convert_and_load_state_dict_in_model",
    "LoadStateDictConfig",
    "CacheLayerMixin",
    "__abstractmethods__",
    "chat_template_utils",
    "render_jinja_template",
)
