"""transformers' `model.generate()` on a loaded model, fast by default: at batch 1 on CUDA the call
runs mpsconvert's engine (runtime/engine: a static KV cache, the decode step one CUDA graph, the
loop that starts a step before the host reads the last token), the loop `mpsconvert generate`
runs, so the two give the same tokens at the same speed. The call returns what transformers'
returns: the prompt's ids followed by the new ones, [1, prompt + new] on the prompt's device.

Why the engine and not transformers' own static-cache path: transformers' loop reads every token
on the host (its stopping criteria) before it starts the next step, so a step's host work (the
graph's launch and torch.compile's checks, ~1 ms on the H200 host against ~3 ms of device work
for a Llama-3-8B-shaped FP8 step) follows the device's work instead of overlapping it.

Which calls the engine takes is an allow-list (`engine_call`): one sequence of input ids (an
attention mask of ones, or none), greedy search or sampling with temperature, top-k and top-p,
the length from `max_new_tokens` or `max_length`, end-of-sequence ids, a streamer. The settings
are transformers' own, resolved as its generate() resolves them (the call's, then the model's
generation config, then transformers' defaults; hf_compat.generation_config). Any other setting
away from transformers' default (beams, a repetition penalty, a logits processor, scores in a
dict, ...) runs transformers' generate() itself, with a static cache which transformers compiles
(one CUDA graph per step); a caller's cache choice (`cache_implementation`, a cache object) runs
transformers' generate() as given. `model.mpsconvert_generate_path` says which path the last call
took and why, and a batch-1 call that leaves the engine for a setting is warned once per reason.
Sampling draws from torch's default generator on the device, as transformers' does
(`torch.manual_seed` makes it repeatable), but not the same draws: sampled tokens differ from
transformers' own, greedy ones do not. To turn it all off: `load(path, compile=False)`.
"""

from __future__ import annotations

import types
import warnings

import torch

from ...model import hf_compat
from ..engine import Engine, Sampling, generate_ids

_CALLER_CACHE = ("cache_implementation", "past_key_values", "cache")
# Settings the engine honours (they may differ from transformers' defaults), and the resolved
# config's bookkeeping; every other field must keep its default for the engine to take the call.
_ENGINE_SETTINGS = frozenset(
    {
        "max_new_tokens",
        "max_length",
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "eos_token_id",
        "pad_token_id",
        "bos_token_id",
        "decoder_start_token_id",
        "use_cache",
        "transformers_version",
        "_from_model_config",
        "_commit_hash",
        "_original_object_hash",
    }
)
_MODES = ("greedy_search", "sample")
ENGINE_DEVICES = ("cuda",)  # where the engine takes generate(): a CUDA graph and the pipelined loop pay there


class GenerateFallback(UserWarning):
    """A batch-1 `generate()` call ran transformers' loop instead of mpsconvert's engine."""


def static_by_default(device_type: str, batch: int | None, kwargs: dict, generation_config=None) -> bool:
    """Whether a call transformers runs gets a static cache: CUDA, batch 1, and the caller chose no
    cache (neither as an argument nor in the generation config passed)."""
    if device_type != "cuda" or batch != 1:
        return False
    if any(kwargs.get(k) is not None for k in _CALLER_CACHE):
        return False
    return getattr(generation_config, "cache_implementation", None) is None


def _off(v) -> bool:
    return v is None or v is False


def engine_call(model, ids, generation_config, kwargs: dict):
    """(Sampling, stop ids, streamer) for a call the engine computes as transformers would, or a
    string saying why it does not. Reads nothing on the device but the attention mask."""
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[0] != 1 or ids.dtype != torch.long:
        return "the input is not one sequence of token ids"
    if any(kwargs.get(k) is not None for k in _CALLER_CACHE) or getattr(
        generation_config, "cache_implementation", None
    ):
        return "the caller chose the cache"
    resolved = hf_compat.generation_config(model, generation_config, kwargs)
    if isinstance(resolved, str):
        return resolved
    gc, rest = resolved
    streamer, mask = rest.pop("streamer", None), rest.pop("attention_mask", None)
    others = sorted(
        k
        for k, v in rest.items()
        if not (_off(v) or (isinstance(v, (list, tuple)) and not v) or k == "use_model_defaults")
    )
    if others:
        return f"generate() was given {', '.join(others)}"
    if mask is not None and not (mask.shape == ids.shape and bool(mask.all())):
        return "the attention mask is not all ones"
    mode = getattr(gc.get_generation_mode(), "value", None)
    if mode not in _MODES:
        return f"the generation mode is {mode}"
    default, mine = hf_compat.default_generation_config().to_dict(), gc.to_dict()
    changed = sorted(
        k
        for k in set(mine) | set(default)
        if k not in _ENGINE_SETTINGS
        and not (mine.get(k) == default.get(k) or (_off(mine.get(k)) and _off(default.get(k))))
    )
    if changed:
        return f"the generation config sets {', '.join(changed)}"
    new = gc.max_new_tokens if gc.max_new_tokens is not None else (gc.max_length or 0) - ids.shape[1]
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if new < 1 or (limit and ids.shape[1] + new > limit):
        return (
            f"{new} new tokens after {ids.shape[1]} do not fit the model's {limit} positions"
            if new >= 1
            else "no new tokens asked for"
        )
    if gc.do_sample and not (gc.temperature or 0) > 0:
        return "sampling at temperature 0"
    if gc.do_sample and not 0 < (gc.top_p if gc.top_p is not None else 1.0) <= 1:
        return "top_p is outside (0, 1]"
    sampling = Sampling(
        max_tokens=new,
        seed=None,
        temp=float(gc.temperature or 1.0) if gc.do_sample else 0.0,
        top_p=float(gc.top_p if gc.top_p is not None else 1.0) if gc.do_sample else 1.0,
        top_k=int(gc.top_k or 0) if gc.do_sample else 0,
    )
    eos = gc.eos_token_id
    stops = (
        []
        if eos is None
        else (
            [int(eos)]
            if isinstance(eos, int)
            else [int(e) for e in (eos.tolist() if isinstance(eos, torch.Tensor) else eos)]
        )
    )
    return sampling, stops, streamer


def _engine(model) -> Engine:
    """The model's engine, made at its first generate() and kept (its compiled step with it)."""
    eng = model.__dict__.get("mpsconvert_engine")
    if eng is None:
        eng = model.__dict__["mpsconvert_engine"] = Engine(model)
    return eng


def _run_engine(model, ids: torch.Tensor, sampling: Sampling, stops: list[int], streamer) -> torch.Tensor:
    if streamer is not None:
        streamer.put(ids.cpu())
    put = (lambda t: streamer.put(torch.tensor([t]))) if streamer is not None else None
    stats = generate_ids(_engine(model), ids[0].tolist(), sampling, stop_ids=stops, on_token=put)
    if streamer is not None:
        if stats.stop == "eos":  # transformers streams the end-of-sequence token too; the loop's callback does not
            streamer.put(torch.tensor([stats.tokens[-1]]))
        streamer.end()
    return torch.cat([ids, torch.tensor([stats.tokens], dtype=ids.dtype, device=ids.device)], dim=1)


def _generate(self, inputs=None, generation_config=None, **kwargs):
    """The installed `generate`: the engine where `engine_call` takes the call, else
    transformers' own, with `cache_implementation="static"` where `static_by_default` says so."""
    ids = inputs if inputs is not None else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    batch = ids.shape[0] if getattr(ids, "ndim", 0) >= 1 else None
    why = f"batch {batch}" if batch != 1 else f"the model is on {self.mpsconvert_generate}"
    if self.mpsconvert_generate in ENGINE_DEVICES and batch == 1:
        call = engine_call(self, ids, generation_config, {k: v for k, v in kwargs.items() if k != "input_ids"})
        if not isinstance(call, str):
            self.mpsconvert_generate_path = "engine"
            return _run_engine(self, ids, *call)
        why = call
        if why not in self.__dict__.setdefault("mpsconvert_generate_warned", set()):
            self.mpsconvert_generate_warned.add(why)
            warnings.warn(
                f"mpsconvert: model.generate() runs transformers' loop, not mpsconvert's engine: {why}",
                GenerateFallback,
                stacklevel=2,
            )
    static = (
        static_by_default(self.mpsconvert_generate, batch, kwargs, generation_config)
        and getattr(self.generation_config, "cache_implementation", None) is None
    )
    if static:
        kwargs["cache_implementation"] = "static"
    self.mpsconvert_generate_path = f"transformers{' (static cache)' if static else ''}: {why}"
    return type(self).generate(self, inputs, generation_config=generation_config, **kwargs)


def install(model, device_type: str) -> None:
    """`model.generate` becomes `_generate` for this instance (the class keeps its own)."""
    model.mpsconvert_generate = device_type
    model.generate = types.MethodType(_generate, model)


def installed(model) -> bool:
    return getattr(getattr(model, "generate", None), "__func__", None) is _generate
