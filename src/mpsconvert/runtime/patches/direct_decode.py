"""A decoder layer's eager decode step (one token) as direct calls, its RMSNorms and residual adds
folded into the GEMVs around them (what ops/graph_fusion.py does to the compiled step), and its
key and value rotated and written into the engine's static cache by the q/k/v GEMV: for the eager step
that the engine captures as a CUDA graph (its default on CUDA).

Why: the captured eager step ran about 12 kernels a layer (Llama-3-8B shape, H100): the input
norm (with the previous layer's residual add), q/k/v, rotary, two cache writes, attention's two,
o_proj, the post-attention add + norm + quantization, gate/up, its activations' quantization and
down_proj. The norms, the quantization, the cache writes and the launch gap after each were
~0.5 ms of a 3.8 ms step. Here a layer is six kernels:

    q    = gemv(x, norm=input_layernorm, rotary)       the norm as the GEMV's prologue; rotary, and k and v
                                                        into the cache's row, as its epilogue (qkv_rotary.py;
                                                        other caches: the GEMV, rotary, then their update)
    h    = gemv(attention(q, K, V), residual=x)         o_proj (attention: two kernels)
    g    = gemv(h, gated, norm=post_attention_layernorm) silu(gate) * up of the normed h
    out  = gemv(g, residual=h)                          down_proj

The layer's output is its residual sum, which the next layer's q/k/v normalizes itself: no norm
is handed on (eager_fusion's `_add_norm`), and the model's final norm computes its own. The gated
gate/up is the BF16-activation GEMV even where the kernel policy chose the W8A8 one for the
layer alone: that one needs the codes of the norm's output, one norm + quantize kernel before it,
and the two time about the same alone (H100: 45.2 against 44.0 us, runtime/ops/triton/tuned.json).

Numbers: the residual epilogues are the adds bit for bit, and the cache row is what the module's
rotary and the cache's update write. The norm prologues multiply in float32 without the norm
output's two roundings to the activation dtype (as the compiled step's do): at least as close to
the exact product as the module's, not equal to it. Checked at install on a decode step after a
prompt, over a DynamicCache, against the layer's own forward with its gate/up on the same kernel
(`check`; within MAX_REL_ERR).

Which calls: eager on the Triton path, batch 1 and one token, no gradient, a cache, a boolean
mask or none, the keyword arguments the direct prefill path takes, no hooks on the modules it
skips, and a GEMV as every layer's decode kernel (the policy's choice, read per call). Every
other call runs the layer's forward as before.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, StaticCache

from ...format.fp8 import relative_error
from ...model import hf_compat
from ..ops import kernels
from ..ops.fp8linear import PROBE_ROWS
from ..ops.fuse import SharedInput
from ..ops.triton import act_quant, qkv_rotary, rotary_kernel
from ..ops.triton import gemv as triton_gemv
from . import attention, attention_prefill, forwards

# Relative (Frobenius) error of the layer's output and cached keys against its own forward: a few BF16 roundings
# (unit roundoff 2^-8) of the norm outputs the prologues skip, carried through the layer (H100, Llama-3-8B shape:
# 0.0055); a wrong sum, scale or norm is off by far more
MAX_REL_ERR = 2**-6
PROMPT_ROWS = PROBE_ROWS - 1  # the check's prompt: its decode step is the install probe's last position


class Plan:
    """What a layer's direct decode reads, looked up once at install."""

    def __init__(self, parts, qkv: SharedInput, gate_up: SharedInput, down, heads):
        self.in_norm, self.attn, self.post, mlp = parts
        self.qkv, self.o_proj, self.gate_up, self.down = qkv, self.attn.o_proj, gate_up, down
        self.hq, self.hk, self.d = heads
        self.scaling = float(self.attn.scaling)
        self.layer_idx = self.attn.layer_idx
        mods = (self.in_norm, self.attn, self.post, mlp, qkv, gate_up, self.o_proj, down)
        self.skipped = mods + tuple(self.attn._modules[n] for n in attention_prefill.QKV)
        self.calls = 0  # calls the direct decode ran (the check and the tests read it)


def plan(parts: list) -> Plan | None:
    """The direct decode's plan for a decoder layer of LAYER_PARTS (input norm, attention,
    post-attention norm, MLP) whose norms and MLP eager_fusion installed, or None where the layer
    is not of that structure (a Llama-style attention, a gated MLP with its gated decode on, fused
    norms): not a finding, its decode runs the modules as before."""
    in_norm, attn, post, mlp = parts
    found = attention_prefill.llama_attention(attn)
    mlp_parts = getattr(mlp, "mpsconvert_parts", None)
    if isinstance(found, str) or mlp_parts is None or not getattr(mlp, "mpsconvert_gated", False):
        return None
    if any(getattr(n, "mpsconvert_eps", None) is None for n in (in_norm, post)):
        return None
    qkv, _, heads = found
    return Plan(parts, qkv, mlp_parts[0], mlp_parts[1], heads)


def kernels_fit(p: Plan) -> bool:
    """Whether the layers' decode kernels (the policy's choice, which a later policy may change) have
    the forms this path runs: the BF16-activation GEMV for q/k/v, o_proj and down_proj (prologue,
    epilogue), either GEMV for the gated gate/up (which runs the BF16 one); per-row or per-tensor scales."""
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
    cache = hf_compat.passed_cache(kwargs)
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
    heads, norm, eps = (p.hq, p.hk, d), p.in_norm.weight, p.in_norm.mpsconvert_eps
    slot = hf_compat.positioned_slot(cache, p.layer_idx)
    if slot is not None and qkv_rotary.fits(x2, inner.weight, inner.scale_flat, heads, slot[0], slot[1]):
        keys, values, position = slot  # the engine's static cache, written by the q/k/v GEMV
        q = qkv_rotary.qkv_rotary(
            x2, inner.weight, inner.scale_flat, inner.bias, norm, eps, cos, sin, keys, values, position, heads
        )
    else:
        qkv = triton_gemv.gemv(x2, inner.weight, inner.scale_flat, inner.bias, norm=norm, eps=eps)
        q = qkv[:, : p.hq * d].view(1, 1, p.hq, d).transpose(1, 2)  # as the module's view + transpose make them
        k = qkv[:, p.hq * d : (p.hq + p.hk) * d].view(1, 1, p.hk, d).transpose(1, 2)
        v = qkv[:, (p.hq + p.hk) * d :].view(1, 1, p.hk, d).transpose(1, 2)
        q, k = rotary_kernel.rotary(q, k, cos, sin)
        keys, values = cache.update(k, v, p.layer_idx)
    o, _ = attention.attention_forward(p.attn, q, keys, values, mask, scaling=p.scaling)
    o_proj, gu, post, down = p.o_proj, p.gate_up.inner, p.post, p.down
    h = triton_gemv.gemv(o.reshape(1, -1), o_proj.weight, o_proj.scale_flat, o_proj.bias, residual=x2)
    g = triton_gemv.gemv(h, gu.weight, gu.scale_flat, gu.bias, gated=True, norm=post.weight, eps=post.mpsconvert_eps)
    return triton_gemv.gemv(g, down.weight, down.scale_flat, down.bias, residual=h).view(x.shape)


def check(layer: nn.Module, p: Plan, kwargs: dict, layer_forward) -> str | None:
    """None if the direct decode of one token after a prompt gives the layer's own forward (its
    modules' installed forwards, its gate/up on the kernel this path runs) within MAX_REL_ERR, with
    the keys and values it caches, over a DynamicCache and over a static cache that writes at the
    caller's position (the engine's, which the q/k/v GEMV writes); else why not. `kwargs`: the
    layer's call in the install's probe forward; `layer_forward`: the installed forward, which
    must take this path for the call. Leaves the layer's `mpsconvert_decode` None."""
    name = hf_compat.cache_arg(kwargs)
    pe = kwargs.get("position_embeddings")
    if name is None or not isinstance(pe, tuple) or pe[0].shape[1] < PROMPT_ROWS + 1:
        return "its probe call has no cache argument or position embeddings"
    w = p.post.weight
    g = torch.Generator(device="cpu").manual_seed(2)
    x = (torch.randn(1, PROMPT_ROWS + 1, w.shape[0], generator=g) * 2).to(device=w.device, dtype=w.dtype)
    # no mask: the prompt is causal (SDPA's is_causal), the step's one query attends to every cached position
    # (the static cache holds exactly the prompt and the step)
    prompt = {**kwargs, "position_embeddings": tuple(t[:, :PROMPT_ROWS] for t in pe), "attention_mask": None}
    step = {**kwargs, "position_embeddings": tuple(t[:, PROMPT_ROWS : PROMPT_ROWS + 1] for t in pe)}
    step["attention_mask"] = None
    position = torch.zeros((), dtype=torch.long, device=w.device)

    def static():
        cache = StaticCache(config=p.attn.config, max_cache_len=PROMPT_ROWS + 1)
        return cache if hf_compat.write_at(cache, position, PROMPT_ROWS + 1) else None

    for make in (lambda: DynamicCache(config=p.attn.config), static):
        position.zero_()
        try:
            caches = [make() for _ in range(2)]
            if caches[0] is None:
                continue  # (a transformers whose StaticCache cannot write at a position: the update path runs)
            why = _probe(layer, p, x, {**prompt, "use_cache": True}, {**step, "use_cache": True}, name, caches,
                         position, layer_forward)  # fmt: skip
        except Exception as e:  # a layer the probe cannot call this way: it keeps the module path
            why = f"its decode probe failed ({type(e).__name__}: {str(e)[:120]})"
        finally:
            object.__setattr__(layer, "mpsconvert_decode", None)  # the caller switches it on once checked
            for n in (p.in_norm, p.post):
                if getattr(n, "mpsconvert_feeds", None) is not None:
                    n.mpsconvert_feeds.stash.pre = None
        if why:
            return why
    return None


def _probe(layer, p: Plan, x, prompt: dict, step: dict, name: str, caches: list, position, layer_forward):
    """One `check` over a pair of fresh caches: the prompt into both by the layer's own forward, then
    the step by its own forward (into the first) and the direct decode (the second); why they differ."""
    own = forwards.own_forward(layer)
    for cache in caches:
        own(layer, x[:, :PROMPT_ROWS], **{**prompt, name: cache})
    position.fill_(PROMPT_ROWS)
    gu = p.gate_up.inner
    chosen = dict(gu.kernels)
    gu.set_kernels("gemv", chosen["prefill"])
    try:
        want = own(layer, x[:, PROMPT_ROWS:], **{**step, name: caches[0]})
    finally:
        gu.set_kernels(**chosen)
    taken = p.calls
    object.__setattr__(layer, "mpsconvert_decode", p)  # for the probe call
    got = layer_forward(layer, x[:, PROMPT_ROWS:], **{**step, name: caches[1]})
    if p.calls == taken:
        return "its decode probe did not take the direct decode"
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return "its direct decode returns another shape"
    held = [(c.layers[p.layer_idx].keys, c.layers[p.layer_idx].values) for c in caches]
    errs = [relative_error(got.float(), want.float())] + [relative_error(a.float(), b.float()) for a, b in zip(*held)]
    if max(errs) > MAX_REL_ERR:
        return f"its direct decode differs from its own forward (relative error {max(errs):.3g})"
    return None
