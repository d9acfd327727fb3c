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
import inspect
import sys

import torch
from torch import nn

from . import forwards, tritonlib
from .triton_launch import launch, next_pow2
from .tritonlib import tl, triton

NAME = "apply_rotary_pos_emb"
PROBE_TOKENS = 9
_ACTIVE = contextvars.ContextVar("mpsconvert_rotary", default=False)

if triton is not None:
    from .act_quant import _round_to

    @triton.jit
    def _rotate(x_ptr, o_ptr, c, s, sign, d, partner, dmask, base_x, H, sxh, sxd, base_o, soh,
                BLOCK_H: tl.constexpr, PRE_ROUND: tl.constexpr):  # fmt: skip
        # one token's heads: x * cos + rotate_half(x) * sin, each product and the sum rounded
        h = tl.arange(0, BLOCK_H)[:, None]
        mask = (h < H) & dmask[None, :]
        x = tl.load(x_ptr + base_x + h * sxh + d[None, :] * sxd, mask=mask, other=0.0)
        xp = tl.load(x_ptr + base_x + h * sxh + partner[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
        a = _round_to(x.to(tl.float32) * c[None, :], x.dtype, PRE_ROUND)
        b = _round_to(sign[None, :] * xp * s[None, :], x.dtype, PRE_ROUND)
        y = _round_to(a + b, x.dtype, PRE_ROUND)
        tl.store(o_ptr + base_o + h * soh + d[None, :], y.to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
        S, HQ, HK,
        sqb, sqh, sqs, sqd, skb, skh, sks, skd, scb, scs, scd, ssb, sss, ssd,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, PRE_ROUND: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        b = t // S
        si = t % S
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        half = D // 2
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)  # rotate_half: (-x2, x1)
        c = tl.load(cos_ptr + b * scb + si * scs + d * scd, mask=dmask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + b * ssb + si * sss + d * ssd, mask=dmask, other=0.0).to(tl.float32)
        # outputs laid out [B, S, H, D] (viewed as [B, H, S, D]), as the eager ops lay them out
        _rotate(q_ptr, qo_ptr, c, s, sign, d, partner, dmask, b * sqb + si * sqs, HQ, sqh, sqd, t * HQ * D, D, BLOCK_HQ, PRE_ROUND)
        _rotate(k_ptr, ko_ptr, c, s, sign, d, partner, dmask, b * skb + si * sks, HK, skh, skd, t * HK * D, D, BLOCK_HK, PRE_ROUND)


def fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rotary` takes this call: eager on the Triton path, q [B, H, S, D] and k
    [B, Hk, S, D] with cos and sin [1 or B, S, D] (full-width rotary, even D), one dtype, no
    gradient."""
    if not tritonlib.eager_on(q) or q.ndim != 4 or k.ndim != 4 or cos.ndim != 3 or sin.shape != cos.shape:
        return False
    b, _, s, d = q.shape
    if k.shape[0] != b or k.shape[2:] != q.shape[2:] or cos.shape[1:] != (s, d) or cos.shape[0] not in (1, b) or d % 2:
        return False
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype) or not q.dtype.is_floating_point or k.device != q.device:
        return False
    return not (q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q * cos + rotate_half(q) * sin, the same for k), cos and sin broadcast over the heads, in
    one launch; the caller checks `fits` first."""
    b, hq, s, d = q.shape
    hk = k.shape[1]
    qo = torch.empty(b, s, hq, d, dtype=q.dtype, device=q.device)
    ko = torch.empty(b, s, hk, d, dtype=k.dtype, device=k.device)
    if b * s:
        cb = cos.stride(0) if cos.shape[0] > 1 else 0
        sb = sin.stride(0) if sin.shape[0] > 1 else 0
        block_d = next_pow2(d)
        args = (q, k, cos, sin, qo, ko, s, hq, hk, *q.stride(), *k.stride(), cb, cos.stride(1), cos.stride(2), sb, sin.stride(1),
                sin.stride(2), d, block_d, next_pow2(hq), next_pow2(hk), tritonlib.INTERPRET)  # fmt: skip
        launch(_rope_kernel, (b * s,), args, num_warps=4, enable_fp_fusion=False)
    return qo.transpose(1, 2), ko.transpose(1, 2)


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
    fwd = inspect.unwrap(forwards.own_forward(mod))
    code = getattr(fwd, "__code__", None)
    if code is None or NAME not in code.co_names:
        return None
    home = sys.modules.get(type(mod).__module__)
    return home if callable(getattr(home, NAME, None)) else None


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
        fn = getattr(home, NAME)
        original = fn.original if isinstance(fn, Dispatch) else fn
        key = (home.__name__, heads)
        if key not in checked:
            checked[key] = _check(original, heads, dtype, device)
        if checked[key]:
            report["left"].append(f"{name}: {checked[key]}")
            continue
        if not isinstance(fn, Dispatch):
            setattr(home, NAME, Dispatch(original))
        forwards.install(mod, _attention_forward)
        report["attention"] += 1
    return report
