"""A decoder layer's eager decode step (one token) as direct calls, its RMSNorms and residual adds
folded into the GEMVs around them: what ops/graph_fusion.py does to the compiled step, for the
eager step that the engine captures as a CUDA graph (its default on CUDA).

Why: the captured eager step ran about 12 kernels a layer (Llama-3-8B shape, H100): the input
norm (with the previous layer's residual add), q/k/v, rotary, two cache writes, attention's two,
o_proj, the post-attention add + norm + quantization, gate/up, its activations' quantization and
down_proj. The norms, the quantization and the launch gap after each were ~0.3 ms of a 3.85 ms
step. Here a layer is:

    qkv  = gemv(x, norm=input_layernorm)            the norm as the GEMV's prologue
    q, k = rotary(q, k); K, V = cache.update(k, v)
    h    = gemv(attention(q, K, V), residual=x)     o_proj, the residual add as its epilogue
    g    = gated gate/up of post_attention_layernorm(h)
    out  = gemv(g, residual=h)                      down_proj, the residual add as its epilogue

The gate/up product is the one the kernel policy chose for it: the BF16-activation GEMV takes the
norm as its prologue; the W8A8 GEMV takes the codes of the norm's output, written by one norm +
quantize kernel (act_quant.rms_norm_quantize, the codes `act_quant.quantize` gives of it). The
layer's output is its residual sum, which the next layer's q/k/v GEMV normalizes itself: no norm
is handed on (eager_fusion's `_add_norm`), and the model's final norm computes its own.

Numbers: the residual epilogues are the adds bit for bit, and the gate/up product is the module
path's. The q/k/v prologue (and the gate/up one where it is the BF16 GEMV) multiplies in float32
without the norm output's two roundings to the activation dtype, as the compiled step's does: at
least as close to the exact product as the module's, not equal to it. Checked at install on a
decode probe over a DynamicCache against the layer's own forward (`check`).

Which calls: eager on the Triton path, batch 1 and one token, no gradient, a cache, a boolean
mask or none, the keyword arguments the direct prefill path takes, no hooks on the modules it
skips, and every GEMV's decode kernel one with those forms (the policy's choice, read per call).
Every other call runs the layer's forward as before.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import DynamicCache

from ...format.fp8 import relative_error
from ..ops import kernels
from ..ops.fp8linear import PROBE_ROWS
from ..ops.fuse import SharedInput, group_name, lone_fp8
from ..ops.triton import act_quant
from ..ops.triton import gemv as triton_gemv
from . import attention, attention_prefill, forwards, rotary

MAX_REL_ERR = 2**-8  # relative (Frobenius) error of the layer's output and cached keys against its own forward
PROMPT_ROWS = PROBE_ROWS - 1  # the check's prompt: its decode step is the install probe's last position


class Plan:
    """What a layer's direct decode reads, looked up once at install."""

    __slots__ = (
        "attn",
        "qkv",
        "o_proj",
        "gate_up",
        "down",
        "in_norm",
        "post",
        "hq",
        "hk",
        "d",
        "scaling",
        "layer_idx",
        "skipped",
        "calls",
    )

    def __init__(self, parts, qkv: SharedInput, gate_up: SharedInput, down, heads):
        self.in_norm, self.attn, self.post, mlp = parts
        self.qkv, self.o_proj, self.gate_up, self.down = qkv, self.attn.o_proj, gate_up, down
        self.hq, self.hk, self.d = heads
        self.scaling = float(self.attn.scaling)
        self.layer_idx = self.attn.layer_idx
        mods = (self.in_norm, self.attn, self.post, mlp, qkv, gate_up, self.o_proj, down)
        self.skipped = mods + tuple(self.attn._modules[n] for n in attention_prefill.QKV)
        self.calls = 0  # calls the direct decode ran (the check and the tests read it)


def plan(parts: list) -> Plan | str:
    """The direct decode's plan for a decoder layer of LAYER_PARTS (input norm, attention,
    post-attention norm, MLP) whose norms and MLP eager_fusion installed, or why it has none."""
    in_norm, attn, post, mlp = parts
    qkv, o_proj = attn._modules.get(group_name(attention_prefill.QKV)), attn._modules.get("o_proj")
    if not isinstance(qkv, SharedInput) or not lone_fp8(o_proj):
        return "its q/k/v do not share one FP8 GEMM, or o_proj is not FP8"
    if sorted(set(attn._modules) - {*attention_prefill.QKV, "o_proj", group_name(attention_prefill.QKV)}):
        return "its attention has modules the direct decode does not run"
    mlp_parts = getattr(mlp, "mpsconvert_parts", None)
    if mlp_parts is None or not getattr(mlp, "mpsconvert_gated", False):
        return "its MLP has no gated decode"
    if any(getattr(n, "mpsconvert_eps", None) is None for n in (in_norm, post)):
        return "its norms are not fused ones"
    heads = rotary._heads(attn)
    if heads is None or not isinstance(getattr(attn, "scaling", None), (int, float)):
        return "no head counts or scaling"
    hq, hk, d = heads
    if qkv.sizes != [hq * d, hk * d, hk * d] or o_proj.in_features != hq * d:
        return f"its projections are not {hq} + 2 x {hk} heads of {d}"
    return Plan(parts, qkv, mlp_parts[0], mlp_parts[1], heads)


def kernels_fit(p: Plan) -> bool:
    """Whether the layers' decode kernels (the policy's choice, which a later policy may change) have
    the forms this path runs: the BF16-activation GEMV for q/k/v, o_proj and down_proj (prologue,
    epilogue), either GEMV for the gated gate/up; per-row or per-tensor scales."""
    plain = (p.qkv.inner, p.o_proj, p.down)
    if any(m._decode_fn is not kernels.gemv or m.block for m in plain) or p.gate_up.inner.block:
        return False
    return p.qkv.shared and p.gate_up.shared and p.gate_up.inner._decode_fn in (kernels.gemv, kernels.gemv_w8a8)


def takes(p: Plan, x: torch.Tensor, kwargs: dict):
    """(cos, sin, mask, cache) if the direct decode computes this call of the layer, else None."""
    if x.ndim != 3 or x.shape[0] != 1 or x.shape[1] != 1 or x.requires_grad or torch.compiler.is_compiling():
        return None
    if not kwargs.keys() <= attention_prefill.KWARGS or not act_quant.rms_norm_fits(x, p.in_norm.weight):
        return None
    pe = kwargs.get("position_embeddings")
    cache = kwargs.get("past_key_values")
    cache = cache if cache is not None else kwargs.get("cache")
    mask = kwargs.get("attention_mask")
    if not isinstance(pe, tuple) or len(pe) != 2 or cache is None or not hasattr(cache, "update"):
        return None
    cos, sin = pe
    if cos.shape != (1, 1, p.d) or sin.shape != cos.shape or cos.dtype != x.dtype or sin.dtype != x.dtype:
        return None
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.ndim != 4):
        return None
    if x.dtype != p.o_proj.dtype or not kernels_fit(p) or attention_prefill._hooked(p.skipped):
        return None
    return cos, sin, mask, cache


def forward(p: Plan, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask, cache) -> torch.Tensor:
    """The layer's output [1, 1, hidden] for its input x [1, 1, hidden] (`takes` checked the call)."""
    p.calls += 1
    x2 = x.view(1, -1)
    inner, d = p.qkv.inner, p.d
    qkv = triton_gemv.gemv(
        x2, inner.weight, inner.scale_flat, inner.bias, norm=p.in_norm.weight, eps=p.in_norm.mpsconvert_eps
    )
    q = qkv[:, : p.hq * d].view(1, 1, p.hq, d).transpose(1, 2)  # as the module's view + transpose make them
    k = qkv[:, p.hq * d : (p.hq + p.hk) * d].view(1, 1, p.hk, d).transpose(1, 2)
    v = qkv[:, (p.hq + p.hk) * d :].view(1, 1, p.hk, d).transpose(1, 2)
    q, k = rotary.rotary(q, k, cos, sin)
    keys, values = cache.update(k, v, p.layer_idx)
    o, _ = attention.attention_forward(p.attn, q, keys, values, mask, scaling=p.scaling)
    o_proj = p.o_proj
    h = triton_gemv.gemv(o.reshape(1, -1), o_proj.weight, o_proj.scale_flat, o_proj.bias, residual=x2)
    gu, post = p.gate_up.inner, p.post
    if gu._decode_fn is kernels.gemv:
        g = triton_gemv.gemv(
            h, gu.weight, gu.scale_flat, gu.bias, gated=True, norm=post.weight, eps=post.mpsconvert_eps
        )
    else:  # the W8A8 GEMV, from the codes of the norm's output
        _, codes, scale = act_quant.rms_norm_quantize(
            h, post.weight, post.mpsconvert_eps, True, kernels.static_scale(gu), store_y=False
        )
        g = triton_gemv.dot_gemv(codes, scale, gu.weight, gu.scale_flat, gu.bias, h.dtype, gated=True)
    down = p.down
    return triton_gemv.gemv(g, down.weight, down.scale_flat, down.bias, residual=h).view(x.shape)


def check(layer: nn.Module, p: Plan, kwargs: dict, layer_forward) -> str | None:
    """None if the direct decode of one token after a prompt gives the layer's own forward (its
    modules' installed forwards) within MAX_REL_ERR, with the keys and values it caches; else why
    not. `kwargs`: the layer's call in the install's probe forward; `layer_forward`: the installed
    forward, which must take this path for the call. Leaves the layer's `mpsconvert_decode` None."""
    name = next((k for k in ("past_key_values", "cache") if k in kwargs), None)
    pe = kwargs.get("position_embeddings")
    if name is None or not isinstance(pe, tuple) or pe[0].shape[1] < PROMPT_ROWS + 1:
        return "its probe call has no cache argument or position embeddings"
    w = p.post.weight
    g = torch.Generator(device="cpu").manual_seed(2)
    x = (torch.randn(1, PROMPT_ROWS + 1, w.shape[0], generator=g) * 2).to(device=w.device, dtype=w.dtype)
    own = forwards.own_forward(layer)
    # no mask: the prompt is causal (SDPA's is_causal), the step's one query attends to every cached position
    prompt = {**kwargs, "position_embeddings": tuple(t[:, :PROMPT_ROWS] for t in pe), "attention_mask": None}
    step = {**kwargs, "position_embeddings": tuple(t[:, PROMPT_ROWS : PROMPT_ROWS + 1] for t in pe)}
    step["attention_mask"] = None
    try:
        cache = DynamicCache(config=p.attn.config)
        own(layer, x[:, :PROMPT_ROWS], **{**prompt, name: cache, "use_cache": True})
        caches = [cache, copy.deepcopy(cache)]
        want = own(layer, x[:, PROMPT_ROWS:], **{**step, name: caches[0], "use_cache": True})
        taken = p.calls
        object.__setattr__(layer, "mpsconvert_decode", p)  # for the probe call
        got = layer_forward(layer, x[:, PROMPT_ROWS:], **{**step, name: caches[1], "use_cache": True})
    except Exception as e:  # a layer the probe cannot call this way: it keeps the module path
        return f"its decode probe failed ({type(e).__name__}: {str(e)[:120]})"
    finally:
        object.__setattr__(layer, "mpsconvert_decode", None)  # the caller switches it on once checked
        for n in (p.in_norm, p.post):
            if getattr(n, "mpsconvert_feeds", None) is not None:
                n.mpsconvert_feeds.stash.pre = None
    if p.calls == taken:
        return "its decode probe did not take the direct decode"
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return "its direct decode returns another shape"
    held = [(c.layers[p.layer_idx].keys, c.layers[p.layer_idx].values) for c in caches]
    errs = [relative_error(got.float(), want.float())] + [relative_error(a.float(), b.float()) for a, b in zip(*held)]
    if max(errs) > MAX_REL_ERR:
        return f"its direct decode differs from its own forward (relative error {max(errs):.3g})"
    return None
