"""Forward hooks that feed observers, and nothing else: they hold no reference to any activation.

`observing` puts a forward pre-hook on each targeted nn.Linear (its input is what the static
input_scale quantizes). Fused MoE experts (transformers 5 keeps all experts of a layer in one
module with 3-D `gate_up_proj` / `down_proj` parameters, no nn.Linear per expert) get a forward
hook that splits the layer's input by the router's choice and observes, per expert, the input of
gate_up_proj and the input of down_proj (act(gate) * up, recomputed from the module's own
weights), so per-expert static scales exist for when fused experts are quantized.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch

from .observers import Observer


class _LastInput:
    """q/k/v (and gate/up) read the same tensor: summarise it once, feed every observer.

    Holds only a weak reference to the last input, so no activation outlives its forward."""

    def __init__(self):
        self.ref = None
        self.stats = None

    def stats_for(self, obs: Observer, x: torch.Tensor):
        last = self.ref() if self.ref is not None else None
        if last is not x or self.stats is None or self.stats[:2] != (type(obs), x._version):
            self.ref = weakref.ref(x)
            self.stats = (type(obs), x._version, obs.summarize(x))
        return self.stats[2]


def linear_hook(obs: Observer, memo: _LastInput):
    def hook(_module, args):
        if args:
            obs.accumulate(memo.stats_for(obs, args[0]))

    return hook


class ExpertsObserver:
    """Per-expert observers for one fused experts module (created as experts get tokens)."""

    def __init__(self, module: torch.nn.Module, make: Callable[[], Observer]):
        w = getattr(module, "gate_up_proj", None)
        self.num_experts = int(getattr(module, "num_experts", 0) or (w.shape[0] if w is not None else 0))
        self.make = make
        self.inputs: dict[int, Observer] = {}  # expert -> observer of gate_up_proj's input
        self.down_inputs: dict[int, Observer] = {}  # expert -> observer of down_proj's input
        self.tokens = [0] * self.num_experts
        self.observes_down = (
            w is not None
            and w.ndim == 3
            and getattr(module, "down_proj", None) is not None
            and callable(getattr(module, "act_fn", None))
            and getattr(module, "has_gate", True)
            and getattr(module, "is_concatenated", True)
            and not getattr(module, "has_bias", False)
        )

    def hook(self, module, args, kwargs, _output):
        hidden = args[0] if args else kwargs.get("hidden_states")
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        if hidden is None or index is None:
            return
        hidden = hidden.detach().reshape(-1, hidden.shape[-1])
        index = index.detach().reshape(hidden.shape[0], -1)
        for e in torch.unique(index).tolist():
            if not 0 <= e < self.num_experts:
                continue
            rows = (index == e).any(dim=-1)
            x = hidden[rows]
            self.tokens[e] += int(x.shape[0])
            self.inputs.setdefault(e, self.make()).update(x)
            if self.observes_down:
                w_gu = module.gate_up_proj[e]
                gu = x @ w_gu if getattr(module, "is_transposed", False) else torch.nn.functional.linear(x, w_gu)
                gate, up = gu.chunk(2, dim=-1)
                self.down_inputs.setdefault(e, self.make()).update(module.act_fn(gate) * up)


def fused_experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Modules holding all experts of a layer as 3-D parameters (gate_up_proj / down_proj)."""
    out = {}
    for name, mod in model.named_modules():
        w = getattr(mod, "gate_up_proj", None)
        if isinstance(w, torch.nn.Parameter) and w.ndim == 3:
            out[name] = mod
    return out


@contextlib.contextmanager
def observing(model: torch.nn.Module, linears: list[str], make: Callable[[], Observer]):
    """Attach observers for the duration of the block; yields (linear observers, experts observers)."""
    modules = dict(model.named_modules())
    handles = []
    obs: dict[str, Observer] = {}
    experts: dict[str, ExpertsObserver] = {}
    memo = _LastInput()
    try:
        for name in linears:
            if name in modules:
                obs[name] = make()
                handles.append(modules[name].register_forward_pre_hook(linear_hook(obs[name], memo)))
        for name, mod in fused_experts(model).items():
            experts[name] = ExpertsObserver(mod, make)
            handles.append(mod.register_forward_hook(experts[name].hook, with_kwargs=True))
        yield obs, experts
    finally:
        for h in handles:
            h.remove()
