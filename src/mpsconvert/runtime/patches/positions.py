"""A loaded model's own positions, known on the host: the rotary tables read, not recomputed, and
transformers' packed-sequence check answered without a synchronisation.

Why: before its first decoder layer, a transformers decoder called without `position_ids` (a prefill, `model(ids)`)
makes `arange(S)` on the device, hands it to `create_causal_mask`, which without an attention mask and a cache runs
`find_packed_sequence_indices` on it (diff, compare, cumsum, then `.all()` on the host: a synchronisation that drains
the GPU's queue), and to the rotary module, which computes cos and sin of every position afresh (a float32 matmul, a
concatenation, cos, sin, two scalings, two casts). On an H200 that preamble takes 1.16 ms of host time before the GPU
received its first layer's work (Llama-3-8B shape, 2048 tokens; the packed check 0.39 ms of it, the rotary tables 0.33
ms), during which the GPU idles; without both, 0.48 ms (benchmarks/results/eager_floor_h200_llama32.log).

What changes: the base model's installed forward passes, for a call without positions (and
without a cache, or with a DynamicCache, whose length the host knows), a view of a position
buffer made at load (`0 .. N-1`, never written) as `position_ids`: the values the model would
make, `P .. P+S-1` after the P tokens the cache holds. A view of that buffer with unit stride
along the tokens holds consecutive positions from its offset in every row, which the code below
can tell without reading it:

- the rotary module returns slices of tables of its own forward at positions `0 .. N-1`, made
  at load (for that input dtype and device only; another call runs its own forward): a prefill
  and every eager decode step skip its arithmetic;
- `masking_utils.find_packed_sequence_indices` (replaced in transformers' module by `Dispatch`,
  which calls the original for every other tensor) returns None, what it returns for
  consecutive positions.

Checked at install: the tables equal the module's forward at several lengths and offsets, the
original check returns None for such positions, and the model's output with the installed
forward equals its own forward's bit for bit on probes (no cache; a prefill and a decode step
over a DynamicCache); a model that fails a check keeps its own forwards, with the reason in the
report. Under torch.compile everything runs the model's own code.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import DynamicCache

from ...model import hf_compat
from ..ops.fuse import version
from . import forwards

MAX_POSITIONS = (
    32768  # the longest call with tables: 16 MB of cos / sin for 128-wide bf16 heads (Llama-3-8B, 8192: 4 MB)
)
PROBE_LENGTHS = (1, 7)
# The calls that get the model's own positions: these arguments set, any other one unset (None or
# False). An allow-list: positions or a cache position of the caller's, or an argument this code
# does not know (a future one), run the model's own forward.
ACCEPTED = frozenset(
    {
        "input_ids",
        "inputs_embeds",
        "attention_mask",
        "past_key_values",
        "cache",
        "use_cache",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "logits_to_keep",
    }
)


def start(position_ids) -> int | None:
    """P if `position_ids` is a view of a loaded model's position buffer that holds P .. P+S-1 in
    every row (unit stride along the tokens, rows the same), else None."""
    if not isinstance(position_ids, torch.Tensor):
        return None
    base = position_ids._base
    if (
        base is None
        or getattr(base, "mpsconvert_positions", None) != version(base)
        or position_ids.ndim != 2
        or position_ids.stride(-1) != 1
        or (position_ids.shape[0] != 1 and position_ids.stride(0) != 0)
    ):
        return None
    return position_ids.storage_offset()


class Dispatch:
    """What transformers' `masking_utils.find_packed_sequence_indices` becomes: None for a
    loaded model's own positions (one sequence per row: the original's answer, without its
    synchronisation), the original for every other call."""

    def __init__(self, original):
        self.original = original
        self.skipped = 0  # calls answered here (the tests read it)
        self.__wrapped__ = original

    def __call__(self, position_ids, *args, **kwargs):
        if not torch.compiler.is_compiling() and not args and not kwargs and start(position_ids) is not None:
            self.skipped += 1
            return None
        return self.original(position_ids, *args, **kwargs)


def _model_forward(self, *args, **kwargs):
    """The installed forward of the base model: its own, given its own positions as a view of
    the buffer when the call has none (the values the model would make: 0 .. S-1 after what a
    DynamicCache holds, none without a cache)."""
    fwd = self.mpsconvert_base.forward
    if (
        torch.compiler.is_compiling()
        or len(args) > 1
        or not all(k in ACCEPTED or v is None or v is False for k, v in kwargs.items())
    ):
        return fwd(self, *args, **kwargs)
    ids = args[0] if args else kwargs.get("input_ids")
    x = ids if ids is not None else kwargs.get("inputs_embeds")
    buf = self.mpsconvert_positions
    n = None if x is None or x.ndim < 2 else (x.shape[-1] if ids is not None else x.shape[-2])
    past = _held(hf_compat.passed_cache(kwargs))
    if not n or past is None or past + n > buf.shape[-1] or x.device != buf.device:
        return fwd(self, *args, **kwargs)
    kwargs["position_ids"] = buf[:, past : past + n]
    return fwd(self, *args, **kwargs)


def _held(cache) -> int | None:
    """Tokens a cache holds, where the host knows it (none, or a DynamicCache: the count the
    model itself reads for its positions); None for any other cache (its count may live on the
    device)."""
    if cache is None:
        return 0
    if not isinstance(cache, DynamicCache):
        return None
    held = cache.get_seq_length()
    return held if type(held) is int else None


def _rotary_forward(self, x, position_ids, *args, **kwargs):
    """The installed forward of the rotary module: slices of its tables for own positions."""
    cos, sin = self.mpsconvert_tables
    if (
        not torch.compiler.is_compiling()
        and not args
        and not kwargs
        and x.dtype == cos.dtype
        and x.device == cos.device
    ):
        p = start(position_ids)
        if p is not None:
            n = position_ids.shape[-1]
            return cos[:, p : p + n], sin[:, p : p + n]
    return self.mpsconvert_base.forward(self, x, position_ids, *args, **kwargs)


def _base_model(model: nn.Module):
    """(base model, its rotary module) of a transformers decoder whose base model makes its own
    positions and computes them once for all layers, or (None, why not)."""
    base = getattr(model, "base_model", None)
    rot = getattr(base, "rotary_emb", None) if isinstance(base, nn.Module) else None
    if not isinstance(rot, nn.Module):
        return None, "no model-level rotary module"
    params = inspect.signature(forwards.own_forward(base)).parameters
    if "position_ids" not in params or not (set(hf_compat.CACHE_ARGS) & set(params)):
        return None, f"{type(base).__name__}.forward takes no position_ids or cache"
    if getattr(rot, "rope_type", "default") in ("dynamic", "longrope"):  # inv_freq changes with the length
        return None, f"its rotary embedding is {rot.rope_type} (frequencies depend on the length)"
    return (base, rot), None


def _tables(rot: nn.Module, n: int, dtype: torch.dtype, device) -> tuple:
    """The rotary forward's (cos, sin) for positions 0 .. n-1, from its second call: on CPU (torch
    2.13) a process's first call rounded differently from every later one in about 1 fresh
    process in 6 (54 of 4096 elements one BF16 ulp apart), and the tables must equal what the
    forward gives from then on (`_check_tables`)."""
    x = torch.zeros(1, 1, 1, dtype=dtype, device=device)
    fwd = forwards.own_forward(rot)
    fwd(rot, x, torch.arange(n, device=device)[None])
    cos, sin = fwd(rot, x, torch.arange(n, device=device)[None])
    return cos.contiguous(), sin.contiguous()


def _check_tables(rot: nn.Module, tables, buf) -> str | None:
    x = torch.zeros(1, 1, 1, dtype=tables[0].dtype, device=buf.device)
    end = buf.shape[-1]
    for p, n in ((0, 1), (0, max(PROBE_LENGTHS)), (0, end), (max(PROBE_LENGTHS), 1), (end - 3, 3)):
        want = forwards.own_forward(rot)(rot, x, torch.arange(p, p + n, device=buf.device)[None])
        got = _rotary_forward(rot, x, buf[:, p : p + n])
        if any(a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b) for a, b in zip(want, got)):
            return f"its tables differ from its forward at positions {p} .. {p + n - 1}"
    return None


def install(model: nn.Module) -> dict:
    """Install the own-positions forwards into a loaded model (after every other install: the
    probe runs the model as it will run); returns what was installed, or why not."""
    found, why = _base_model(model)
    if found is None:
        return {"installed": False, "left": why}
    base, rot = found
    emb = model.get_input_embeddings()
    dtype, device = emb.weight.dtype, emb.weight.device
    n = min(int(getattr(model.config, "max_position_embeddings", 0) or 0), MAX_POSITIONS)
    if n < max(PROBE_LENGTHS):
        return {"installed": False, "left": f"max_position_embeddings {n} is too short"}
    buf = torch.arange(n, device=device)[None].clone()  # not a view: its views' _base is this tensor
    buf.mpsconvert_positions = version(buf)  # marks the buffer; a write to it would change its version
    original = hf_compat.packed_sequence_check()
    original = getattr(original, "original", original)
    if original is None:
        return {"installed": False, "left": "transformers has no packed-sequence check by that name (hf_compat)"}
    if original(buf[:, : max(PROBE_LENGTHS)]) is not None:
        return {"installed": False, "left": "transformers' packed-sequence check does not return None for one sequence"}
    with torch.no_grad():
        tables = _tables(rot, n, dtype, device)
        object.__setattr__(rot, "mpsconvert_tables", tables)
        object.__setattr__(base, "mpsconvert_positions", buf)
        forwards.install(rot, _rotary_forward)
        why = _check_tables(rot, tables, buf)
        if why is None:
            if not isinstance(hf_compat.packed_sequence_check(), Dispatch):
                hf_compat.set_packed_sequence_check(Dispatch(original))
            caches = [
                hf_compat.cache_kwarg(base, DynamicCache(config=base.config)) for _ in range(2)
            ]  # named by its own forward
            forwards.install(base, _model_forward)
            why = _check_model(base, caches)
    if why is not None:  # the model's own code, and nothing of ours kept alive
        forwards.uninstall(rot)
        forwards.uninstall(base)
        del rot.mpsconvert_tables, base.mpsconvert_positions
        return {"installed": False, "left": why}
    return {"installed": True, "positions": n, "tables_bytes": 2 * tables[0].numel() * tables[0].element_size()}


def _check_model(base: nn.Module, caches: list[dict]) -> str | None:
    """None if the base model with its installed forward gives its own forward's output bit for
    bit on probe calls without positions: without a cache, and a prefill then a decode step over
    a DynamicCache (`caches`: two fresh ones as keyword arguments; the model's rotary module
    installed)."""
    s = max(PROBE_LENGTHS)
    ids = torch.arange(1, s + 2, device=base.mpsconvert_positions.device)[None] % max(
        base.get_input_embeddings().num_embeddings, 1
    )
    own = forwards.own_forward(base)
    try:
        calls = [(own(base, input_ids=ids[:, :s], use_cache=False), base(input_ids=ids[:, :s], use_cache=False))]
        for part in (ids[:, :s], ids[:, s:]):
            calls.append(
                (
                    own(base, input_ids=part, use_cache=True, **caches[0]),
                    base(input_ids=part, use_cache=True, **caches[1]),
                )
            )
    except Exception as e:  # a model the probe cannot call this way keeps its own forward
        return f"its probe call failed ({type(e).__name__}: {str(e)[:120]})"
    for want, got in calls:
        want, got = want.last_hidden_state, got.last_hidden_state
        if want.shape != got.shape or not torch.equal(want, got):
            return "its output with its own positions differs"
    return None
