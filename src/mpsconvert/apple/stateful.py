"""The stateful decoder that Core ML and Core AI packages of a causal LM share: one torch module.

The contract an app codes against (docs/apple.md, "the stateful decoder interface"):

- one function `main`;
- inputs `input_ids` int32 `[1, T]` (T from 1 to `max_len`) and `position` int32 `[1]`, the
  position of the first of the T tokens, i.e. how many tokens the cache already holds;
- states `key_cache_{i}` and `value_cache_{i}` for every decoder layer i, each
  `[1, kv_heads, max_len, head_dim]`, zero-filled by the app (Core ML's `make_state()` does it);
- output `logits` `[1, T, vocab]`.

Prefill is one call with the prompt at position 0; each decode step is one call with one token at
the next position. The caller keeps `position + T <= max_len`.

`StatefulCausalLM` registers the caches as buffers and writes the new keys and values into them
with `scatter` at `position + arange(T)` (no data-dependent shapes, so torch.export keeps T
symbolic and both converters turn the buffer writes into state updates). Attention runs over the
whole cache with an additive mask built from `position` (keys past the last written position are
masked, as are keys outside a sliding window), so every call has the same shapes apart from T.
The transformers model itself runs unchanged: it is handed position ids, the 4-D mask (or one
per layer type) and a `Cache` whose layers are these buffers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import ExportError
from ..model import hf_compat

INPUT_NAMES = ("input_ids", "position")
OUTPUT_NAME = "logits"
MASK_TYPES = ("full_attention", "sliding_attention")


DEFAULT_MAX_LEN = 2048


def resolve_max_len(requested: int | None, config) -> int:
    """The cache length: `requested`, or 2048 capped at the model's max_position_embeddings.

    Raises:
        MpsconvertError: `requested` is above the model's max_position_embeddings, or below 2.
    """
    from ..errors import MpsconvertError

    max_pos = getattr(config, "max_position_embeddings", None)
    if requested is None:
        return min(DEFAULT_MAX_LEN, max_pos) if max_pos else DEFAULT_MAX_LEN
    if requested < 2:
        raise MpsconvertError(f"`max_len={requested}` is too short", "use at least 2 (default 2048)")
    if max_pos and requested > max_pos:
        raise MpsconvertError(
            f"`max_len={requested}` exceeds the model's max_position_embeddings ({max_pos})", f"use at most {max_pos}"
        )
    return int(requested)


def state_names(layers: int) -> list[str]:
    """The states of a model with `layers` decoder layers, in the order they are declared."""
    return [f"{kind}_cache_{i}" for i in range(layers) for kind in ("key", "value")]


@dataclass(frozen=True)
class StateSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def as_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": str(self.dtype).replace("torch.", "")}


def _kv_shapes(model) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(key shape, value shape) per layer for one token, read from a forward pass with
    transformers' own DynamicCache: whatever the architecture's head counts and head dims are."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    p = next(model.parameters())
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=p.device), cache=cache, use_cache=True)
    out = []
    for layer in cache.layers:
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if k is None or v is None or k.ndim != 4 or v.ndim != 4:
            raise ExportError(
                f"{type(model).__name__} keeps a cache layer that is not keys and values ({type(layer).__name__})",
                "stateful export supports attention KV caches only; use `kv_cache=False` for Core ML",
            )
        out.append((tuple(k.shape), tuple(v.shape)))
    return out


def _layer_types(config) -> list[str] | None:
    types = getattr(config, "layer_types", None)
    if types is None:
        return None
    bad = sorted(set(types) - set(MASK_TYPES))
    if bad:
        raise ExportError(
            f"layers of type {', '.join(bad)} have no stateful export", "use `kv_cache=False` for Core ML"
        )
    return list(types)


class _StateLayer:
    """One layer of the cache: writes keys and values into the wrapper's buffers at the
    positions of this call and returns the whole buffers (attention masks what is unwritten)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: "StatefulCausalLM", index: int, positions: torch.Tensor):
        self.positions = positions  # [T] int64: where this call's tokens go
        self.keys = getattr(owner, f"key_cache_{index}")
        self.values = getattr(owner, f"value_cache_{index}")
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        pos = self.positions
        t = key_states.shape[2]
        # Broadcast by adding zeros of the buffers' static sizes, not by expand(): coremltools
        # makes every dimension of an expand with one symbolic size symbolic, and MIL's scatter
        # then cannot check the index shape against the cache's.
        kb, kh, _, kd = self.keys.shape
        vb, vh, _, vd = self.values.shape
        # (int32 arithmetic, then one cast to the int64 torch's scatter wants: coremltools keeps
        # the cast, where an int64 sum would reach it as fp32.)
        p32 = pos.to(torch.int32).view(1, 1, t, 1)
        k_idx = (p32 + torch.zeros(kb, kh, 1, kd, dtype=torch.int32, device=pos.device)).to(torch.long)
        v_idx = (p32 + torch.zeros(vb, vh, 1, vd, dtype=torch.int32, device=pos.device)).to(torch.long)
        self.keys.scatter_(2, k_idx, key_states.to(self.keys.dtype))
        self.values.scatter_(2, v_idx, value_states.to(self.values.dtype))
        return self.keys.to(key_states.dtype), self.values.to(value_states.dtype)

    # what transformers asks of a cache layer (never on the exported path's hot loop)
    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]

    def get_max_cache_shape(self) -> int:
        return self.keys.shape[2]

    def get_mask_sizes(self, *args, **kwargs):
        return self.keys.shape[2], 0

    def lazy_initialization(self, *args, **kwargs) -> None:
        pass


@functools.lru_cache(maxsize=None)
def _cache_class():
    """A transformers Cache whose layers are `_StateLayer`s (built lazily: transformers is heavy)."""
    return hf_compat.cache_classes(_StateLayer, "StateLayer")


class StatefulCausalLM(torch.nn.Module):
    """(input_ids [1, T], position [1]) -> logits [1, T, vocab], the KV cache in buffers
    `key_cache_{i}` / `value_cache_{i}` that become the package's states.

    Args:
        model: a transformers causal LM (eval mode).
        max_len: cache length: the most tokens one conversation can hold.
        cache_dtype: dtype of the cache buffers [default: the model's]. Core ML states are fp16.
    """

    def __init__(self, model, max_len: int, cache_dtype: torch.dtype | None = None):
        super().__init__()
        self.model = model
        self.max_len = int(max_len)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.layer_types = _layer_types(config)
        self.sliding_window = (
            getattr(config, "sliding_window", None)
            if getattr(config, "use_sliding_window", True) is not False
            else None
        )
        dtype = cache_dtype or next(model.parameters()).dtype
        self.shapes = _kv_shapes(model)
        for i, (ks, vs) in enumerate(self.shapes):
            self.register_buffer(
                f"key_cache_{i}", torch.zeros(ks[0], ks[1], self.max_len, ks[3], dtype=dtype), persistent=False
            )
            self.register_buffer(
                f"value_cache_{i}", torch.zeros(vs[0], vs[1], self.max_len, vs[3], dtype=dtype), persistent=False
            )

    @property
    def num_layers(self) -> int:
        return len(self.shapes)

    def states(self) -> list[StateSpec]:
        return [
            StateSpec(n, tuple(getattr(self, n).shape), getattr(self, n).dtype) for n in state_names(self.num_layers)
        ]

    def reset(self) -> None:
        """Zero every cache (a new conversation), as an app does with fresh states."""
        for n in state_names(self.num_layers):
            getattr(self, n).zero_()

    def _mask(self, positions: torch.Tensor, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        kv = torch.arange(self.max_len, device=positions.device)
        allowed = kv[None, :] <= positions[:, None]
        if window is not None:
            allowed = allowed & (kv[None, :] > positions[:, None] - window)
        zero = torch.zeros((), dtype=dtype, device=positions.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]

    def forward(self, input_ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        positions = position.to(torch.long).reshape(1) + torch.arange(t, device=input_ids.device)
        dtype = self.model.get_input_embeddings().weight.dtype
        if self.layer_types is not None:
            mask = {
                kind: self._mask(positions, self.sliding_window if kind == "sliding_attention" else None, dtype)
                for kind in sorted(set(self.layer_types))
            }
        else:
            mask = self._mask(positions, self.sliding_window, dtype)
        # Built per call: the layers hold the buffers themselves, which .to() would replace.
        Cache, layer_cls = _cache_class()
        cache = Cache(layers=[layer_cls(self, i, positions) for i in range(self.num_layers)])
        out = self.model(
            input_ids=input_ids.to(torch.long),
            position_ids=positions[None],
            attention_mask=mask,
            cache=cache,
            use_cache=True,
        )
        return out.logits


def export_program(wrapper: StatefulCausalLM, example_len: int = 8, decompositions=None):
    """torch.export of the wrapper with T symbolic in 1..max_len (traced at `example_len`, not 1:
    torch.export specializes a dimension traced at 1). The caches are zeroed before and after."""
    example_len = max(2, min(example_len, wrapper.max_len))
    ids = torch.zeros(1, example_len, dtype=torch.int32)
    pos = torch.zeros(1, dtype=torch.int32)
    seq = torch.export.Dim("seq_len", min=1, max=wrapper.max_len)
    wrapper.reset()
    with torch.no_grad():
        ep = torch.export.export(
            wrapper, (ids, pos), dynamic_shapes={"input_ids": {1: seq}, "position": None}, strict=False
        )
    wrapper.reset()
    return ep.run_decompositions(decompositions if decompositions is not None else {})
