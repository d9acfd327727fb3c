"""transformers' `model.generate()` on a loaded model, fast by default: at batch 1 on CUDA it runs
with a static KV cache, with which transformers compiles its decode step itself
(`torch.compile(mode="reduce-overhead")`: one CUDA graph per step), the path `mpsconvert
generate` takes too, so both give the same greedy tokens.

Why a patch of `generate` and not of the generation config: a static cache is a win at batch 1
(the user's case: one prompt), while a batch of padded prompts keeps transformers' default; the
choice is made per call, from the call's own inputs. What the caller asks for wins: any
`cache_implementation`, cache object or generation config that names a cache is passed on as
given. To turn it off: `load(path, compile=False)`, or pass `cache_implementation="dynamic"` to
`generate()`.
"""

from __future__ import annotations

import types

_CALLER_CACHE = ("cache_implementation", "past_key_values", "cache")


def static_by_default(device_type: str, batch: int | None, kwargs: dict, generation_config=None) -> bool:
    """Whether this `generate()` call gets a static cache: CUDA, batch 1, and the caller chose no
    cache (neither as an argument nor in the generation config passed)."""
    if device_type != "cuda" or batch != 1:
        return False
    if any(kwargs.get(k) is not None for k in _CALLER_CACHE):
        return False
    return getattr(generation_config, "cache_implementation", None) is None


def _generate(self, inputs=None, generation_config=None, **kwargs):
    """The installed `generate`: transformers' own, with `cache_implementation="static"` added
    where `static_by_default` says so."""
    ids = inputs if inputs is not None else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    batch = ids.shape[0] if getattr(ids, "ndim", 0) >= 1 else None
    if static_by_default(self.mpsconvert_generate, batch, kwargs, generation_config) and \
            getattr(self.generation_config, "cache_implementation", None) is None:
        kwargs["cache_implementation"] = "static"
    return type(self).generate(self, inputs, generation_config=generation_config, **kwargs)


def install(model, device_type: str) -> None:
    """`model.generate` becomes `_generate` for this instance (the class keeps its own)."""
    model.mpsconvert_generate = device_type
    model.generate = types.MethodType(_generate, model)


def installed(model) -> bool:
    return getattr(getattr(model, "generate", None), "__func__", None) is _generate
