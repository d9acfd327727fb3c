"""The rotary position embedding of q and k in one kernel, in the attention modules of a loaded model.

Why: transformers applies it as `apply_rotary_pos_emb(q, k, cos, sin)`, a function of the model's
modeling module: `q * cos + rotate_half(q) * sin` and the same for k, which is two unsqueezes,
four slices, two negations, two concatenations, four products and two sums per layer. In an eager
prefill each of them is a Python call and most a kernel launch, and on the H200 host that was
the largest block of host time left per decoder layer after eager_fusion.py (cProfile of an
8-layer Llama-3-8B prefill: 3.0 ms of 25, more than the q/k/v, o, gate/up and down GEMMs
together). Here one Triton program per token reads its q and k heads once, writes both
results, and rounds as the eager ops do (each product, then the sum, to the activation dtype):
the output is bit for bit the function's, in the same memory layout. It is compiled without
floating-point contraction: with it, Triton fused the product and the sum into one FMA across
the rounding in between (H200: a quarter of the elements one bf16 step off).

How it is hooked in: the attention module's forward calls the name `apply_rotary_pos_emb` of its
modeling module, and there is no per-instance hook for it. So `install` replaces that module
global by `Dispatch`, which runs the original function unless an attention module that was
installed here is running (a context variable its installed forward sets) and the call is one
the kernel takes (eager, CUDA or the interpreter, no gradient, the default `unsqueeze_dim`, one
dtype, a full-width rotary); every other model of that class, in this process too, keeps the
original. Each module is installed only after the kernel gave bit-identical results to that
modeling module's own function on a probe of the module's head counts and size.
"""

from __future__ import annotations

import contextvars

import torch
from torch import nn

from ...model import hf_compat
from ..ops.triton.rotary_kernel import fits, rotary
from . import forwards

NAME = hf_compat.ROTARY_FUNCTION
PROBE_TOKENS = 9
_ACTIVE = contextvars.ContextVar("mpsconvert_rotary", default=False)


class Dispatch:
    """What a modeling module's `apply_rotary_pos_emb` becomes: the original function, except
    inside an installed attention module's forward for calls `rotary` takes."""

    def __init__(self, original):
        self.original = original
        self.fused = 0  # calls the kernel ran (the tests read it)
        self.__wrapped__ = original

    def __call__(self, q, k, cos, sin, *args, **kwargs):
        # is_compiling first: under dynamo the rest is never traced (no graph break on the context variable)
        if not torch.compiler.is_compiling() and _ACTIVE.get() and not args and not kwargs and fits(q, k, cos, sin):
            self.fused += 1
            return rotary(q, k, cos, sin)
        return self.original(q, k, cos, sin, *args, **kwargs)


def _attention_forward(self, *args, **kwargs):
    """The installed forward of an attention module (forwards.install): its own forward,
    with the fused rotary on for the calls inside it."""
    own = self.mpsconvert_base.forward
    if torch.compiler.is_compiling():
        return own(self, *args, **kwargs)
    token = _ACTIVE.set(True)
    try:
        return own(self, *args, **kwargs)
    finally:
        _ACTIVE.reset(token)


def _calls_rotary(mod: nn.Module):
    """The modeling module of an attention module whose forward calls its `apply_rotary_pos_emb`."""
    return hf_compat.rotary_home(mod, forwards.own_forward(mod))


def _heads(mod: nn.Module):
    """(query heads, key/value heads, head size) of an attention module, from its config."""
    cfg = getattr(mod, "config", None)
    hq = getattr(cfg, "num_attention_heads", None)
    hk = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(mod, "head_dim", None) or (getattr(cfg, "hidden_size", 0) // hq if hq else None)
    return (hq, hk, d) if isinstance(hq, int) and isinstance(hk, int) and isinstance(d, int) and d > 0 else None


def _check(fn, heads, dtype, device) -> str | None:
    """None if the kernel equals `fn` bit for bit on a probe shaped as the module's inputs."""
    hq, hk, d = heads
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(1, PROBE_TOKENS, (hq + 2 * hk) * d, generator=g) * 3).to(device=device, dtype=dtype)
    q = x[..., : hq * d].view(1, PROBE_TOKENS, hq, d).transpose(1, 2)  # as the attention module makes them
    k = x[..., hq * d : (hq + hk) * d].view(1, PROBE_TOKENS, hk, d).transpose(1, 2)
    angle = torch.randn(1, PROBE_TOKENS, d, generator=g) * 4
    cos, sin = angle.cos().to(device=device, dtype=dtype), angle.sin().to(device=device, dtype=dtype)
    if not fits(q, k, cos, sin):
        return f"the kernel does not take {dtype} heads of {d}"
    want_q, want_k = fn(q, k, cos, sin)
    got_q, got_k = rotary(q, k, cos, sin)
    for want, got in ((want_q, got_q), (want_k, got_k)):
        if want.dtype != got.dtype or want.shape != got.shape or not torch.equal(want, got):
            return f"its {NAME} differs from the fused kernel"
    return None


def install(model: nn.Module, dtype: torch.dtype, device) -> dict:
    """Install the fused rotary in every attention module of `model` it equals; returns
    {"attention": installed, "left": [why not, ...]}."""
    report: dict = {"attention": 0, "left": []}
    checked: dict = {}  # modeling module -> None (equal) or why not, checked once per module and shape
    for name, mod in model.named_modules():
        if forwards.installed(mod, _attention_forward):  # installed before (a second install)
            report["attention"] += 1
            continue
        home = _calls_rotary(mod)
        if home is None:
            continue
        heads = _heads(mod)
        if heads is None:
            report["left"].append(f"{name}: no head counts in its config")
            continue
        fn = hf_compat.rotary_function(home)
        original = fn.original if isinstance(fn, Dispatch) else fn
        key = (home.__name__, heads)
        if key not in checked:
            checked[key] = _check(original, heads, dtype, device)
        if checked[key]:
            report["left"].append(f"{name}: {checked[key]}")
            continue
        if not isinstance(fn, Dispatch):
            hf_compat.set_rotary_function(home, Dispatch(original))
        forwards.install(mod, _attention_forward)
        report["attention"] += 1
    return report
