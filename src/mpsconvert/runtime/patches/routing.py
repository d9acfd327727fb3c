"""An MoE layer's top-k routing in one kernel at decode (CUDA): router GEMV, softmax, top-k,
renormalization.

Why: at batch 1 transformers' router (`MixtralTopKRouter`, `Qwen2MoeTopKRouter`, ...) is a BF16
GEMM of 8-128 rows that cuBLAS runs split-K (two kernels), a softmax, and `torch.topk`, which
Inductor leaves to ATen (a gather kernel and a bitonic sort): on the H200 about 21 us per layer
of a compiled Mixtral decode step whose experts take ~100 us, for ~64 KB of router weights. Here
one program per token reads its hidden state and the router weights once, and writes the
logits, the top-k weights and the expert indices: one launch.

Which routers: a module with a 2-D `weight` [experts, hidden], an integer `top_k`, no bias, whose
forward maps [tokens, hidden] to (logits, weights, indices) with
`weights = topk(softmax(logits.float()))`, then divided by their sum or not, then cast to the
logits' dtype or not. Which of those it does is not read from its attributes: each variant is
compared with the module's own forward on probe inputs at install, and the one that matches is
installed (`MAX_TOKENS` rows or fewer, eager or compiled). A router that matches none (sigmoid
scores, grouped top-k, biases: DeepSeek, GPT-OSS) keeps its own forward, and so does every
call with more rows (prefill, where cuBLAS's GEMM is the better kernel) or an input needing
gradients.

The numbers: logits are float32 sums of the BF16 products rounded to the logits' dtype as
F.linear rounds them; the softmax is float32 (Triton's exp, within an ulp or two of torch's);
ties go to the lower expert index. The check at install allows exactly that: logits within one
unit in the last place, the same experts except where two probabilities tie within rounding,
weights within 1e-5.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import triton as tritonlib
from ..ops.triton.launch import TL_DTYPES
from ..ops.triton.routing_kernel import MAX_EXPERTS, MAX_TOKENS, route_topk
from . import forwards


def _router_forward(self, hidden_states):
    """The installed forward of a router (install): the kernel for a few rows, its own otherwise."""
    w = self.weight
    x = hidden_states
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)  # the kernel has no backward
    if x.ndim != 2 or x.shape[0] > MAX_TOKENS or x.dtype != w.dtype or x.device != w.device or needs_grad:
        return self.mpsconvert_base.forward(self, hidden_states)
    renorm, score_dtype = self.mpsconvert_route
    return route_topk(x, w, self.top_k, renorm, score_dtype)


def _candidate(mod: nn.Module) -> bool:
    w = getattr(mod, "weight", None)
    k = getattr(mod, "top_k", None)
    return (
        isinstance(w, torch.Tensor)
        and w.ndim == 2
        and isinstance(k, int)
        and 0 < k <= w.shape[0] <= MAX_EXPERTS
        and getattr(mod, "bias", None) is None
        and w.dtype in TL_DTYPES
        and not isinstance(mod, nn.Linear)
    )


def _matches(x, w, got, want, exact: bool) -> str | None:
    """None if the kernel's (logits, weights, indices) are the module's own: logits within one
    unit in the last place; with `exact` logits (probes whose products need no rounding) also the
    same experts, up to ties, and weights within 1e-5 (float32) or one unit in the last place."""
    if not (isinstance(want, tuple) and len(want) == 3 and all(isinstance(t, torch.Tensor) for t in want)):
        return "its forward does not return (logits, weights, indices)"
    for name, a, b in zip(("logits", "weights", "indices"), got, want):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"its {name} are {b.dtype} {list(b.shape)}"
    logits, scores, idx = got
    # one unit in the last place of the logits' dtype, plus what another float32 summation order changes
    tol = torch.finfo(logits.dtype).eps * want[0].float().abs() + 1e-5 * (x.float().abs() @ w.float().abs().T)
    if bool(((logits.float() - want[0].float()).abs() > tol).any()):
        return "its logits differ by more than one unit in the last place"
    if not exact:
        return None
    probs = torch.softmax(want[0].float(), dim=-1)
    if not torch.equal(idx, want[2]) and not torch.equal(probs.gather(1, idx), probs.gather(1, want[2])):
        return "it chooses other experts"  # another expert is fine only where the two probabilities tie
    diff = (scores.float() - want[1].float()).abs()
    rel = 1e-5 if scores.dtype == torch.float32 else torch.finfo(scores.dtype).eps
    if bool((diff > rel * want[1].float().abs() + 1e-7).any()):
        return "its weights differ"
    return None


def _check(mod: nn.Module) -> tuple[tuple[bool, torch.dtype] | None, str]:
    """The (renorm, score dtype) variant that matches the module's own forward, or why none does.

    Two kinds of probe: rows of one power of two at one position each, whose logits are exact in
    any summation order, so that the softmax, the choice and the weights compare nearly bit for
    bit; and random rows, whose logits check the kernel's sums."""
    w = mod.weight
    H = w.shape[1]
    exact = torch.zeros(4, H)
    for j in range(4):
        exact[j, (j * 37 + 5) % H] = 2.0 ** (j % 3)
    g = torch.Generator(device="cpu").manual_seed(0)
    probes = [(exact, True), (torch.randn(1, H, generator=g) * 4, False), (torch.randn(3, H, generator=g) * 4, False)]
    probes = [(x.to(device=w.device, dtype=w.dtype), ex) for x, ex in probes]
    why = ""
    try:
        with torch.no_grad():
            wants = [forwards.own_forward(mod)(mod, x) for x, _ in probes]
            for renorm in (True, False):
                for score_dtype in dict.fromkeys((torch.float32, w.dtype)):
                    fails = [
                        _matches(x, w, route_topk(x, w, mod.top_k, renorm, score_dtype), want, ex)
                        for (x, ex), want in zip(probes, wants)
                    ]
                    if not any(fails):
                        return (renorm, score_dtype), ""
                    why = why or next(f for f in fails if f)
    except Exception as e:  # a router the probe cannot call this way keeps its own forward
        return None, f"its probe call failed ({type(e).__name__}: {str(e)[:120]})"
    return None, why


def install(model: nn.Module) -> dict:
    """Route the model's softmax top-k routers through the kernel at decode; returns how many,
    and which were left with their own forward and why."""
    report = {"routers": 0, "left": []}
    if not tritonlib.available():
        return report
    for name, mod in model.named_modules():
        if not _candidate(mod) or not tritonlib.runs_on(mod.weight):
            continue
        variant, why = _check(mod)
        if variant is None:
            report["left"].append(f"{name}: {why}")
            continue
        object.__setattr__(mod, "mpsconvert_route", variant)
        forwards.install(mod, _router_forward)
        report["routers"] += 1
    return report
