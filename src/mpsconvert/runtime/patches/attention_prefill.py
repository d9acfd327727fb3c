"""A decoder layer's self-attention at eager prefill as direct calls: the fused q/k/v GEMM, the
rotary kernel, SDPA and o_proj, without the attention module's Python around them.

Why: on the H200, our FP8 Llama-3-8B layer does ~0.85 ms of GPU work at a 2048-token prefill, and
its eager forward needed ~0.6 ms of host time on a fast host and 1.2-1.5 ms on the slow hosts
some runs land on (benchmarks/results/eager_floor_h200_llama32_slowhost.log): there the GPU waited
for Python, and the wall time exceeded the GPU's busy time by 20-36%. About half of a layer's host
time was the attention module: the module calls of q, k, v and o (each through the shared-input
hand-over of fuse.py), views and transposes, the rotary dispatch and its context variable,
transformers' attention-interface lookup and `sdpa_attention_forward`. The kernels stay the same
(`kernels`' GEMMs, `rotary.rotary`, `F.scaled_dot_product_attention` with the arguments
transformers passes it); only the calls between them go. With this path (and eager_fusion's
`_direct_layer` around it) the host finished a 32-layer prefill 7-15 ms before the GPU in every
run measured (docs/benchmarks.md).

Which calls: eager, the Triton path, a prefill (the q/k/v group quantizes its input: more than
DECODE_MAX_M rows), no attention mask (transformers passes None for a causal prefill without
padding and runs SDPA with `is_causal`), no cache or a DynamicCache that holds nothing for this
layer yet, no hooks on the modules skipped, keyword arguments the attention reads as those here
do, and SDPA as the attention implementation. Every other call runs the module's own forward.

Which modules: a Llama-style attention (`q_proj`, `k_proj`, `v_proj` sharing one FP8 GEMM,
`o_proj` FP8, nothing else: Qwen3's q/k norms, for example, keep the module's forward), checked
at install (runtime/patches/eager_fusion.py) bit for bit against the module's own forward, in the
decoder layer, with and without a DynamicCache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module
from transformers import DynamicCache

from ...model import hf_compat
from ..ops import kernels
from ..ops.fp8linear import FP8Linear
from ..ops.fuse import SharedInput, group_name, lone_fp8
from . import rotary

QKV = ("q_proj", "k_proj", "v_proj")
# The decoder layer's keyword arguments this path reads or that the attention does not read at
# prefill (anything else, e.g. output_attentions or a flash-attention argument, takes the module's forward).
# output_router_logits: MoE layers pass it on, for their router (called as a module here).
KWARGS = hf_compat.POSITION_AND_CACHE_KWARGS | {"attention_mask", "output_router_logits"}
SDPA = ("sdpa", "mpsconvert_sdpa")  # attention implementations whose prefill is transformers' sdpa_attention_forward


class Plan:
    """What the direct path reads of one attention module, looked up once."""

    __slots__ = (
        "attn",
        "group",
        "o_proj",
        "hq",
        "hk",
        "d",
        "scaling",
        "gqa",
        "layer_idx",
        "skipped",
        "groups",
        "layers",
        "frozen",
        "fused_mlp",
        "calls",
    )

    def __init__(self, attn: nn.Module, group: SharedInput, o_proj: FP8Linear, hq: int, hk: int, d: int):
        self.attn, self.group, self.o_proj = attn, group, o_proj
        self.hq, self.hk, self.d = hq, hk, d
        self.scaling = float(attn.scaling)
        self.gqa = {"enable_gqa": True} if hq != hk else {}  # what sdpa_attention_forward passes without a mask on CUDA
        self.layer_idx = attn.layer_idx
        # What a call must find, checked on every call (the caller, runtime/patches/eager_fusion.py, adds
        # the rest of its decoder layer): modules whose calls (and so hooks) the path skips, groups
        # that must quantize their input, FP8 layers whose prefill kernel must take codes, and
        # weights that must need no gradient (the kernels have no backward).
        self.skipped = tuple(attn._modules[n] for n in QKV) + (o_proj, attn)
        self.groups, self.layers, self.frozen = (group,), (o_proj,), ()
        self.fused_mlp = False  # whether the caller runs the layer's MLP from the codes of its input (eager_fusion)
        self.calls = 0  # calls the direct path ran (the install check and the tests read it)


def llama_attention(attn: nn.Module):
    """(its q/k/v group, o_proj, (query heads, key/value heads, head size)) of a Llama-style attention
    module (q/k/v sharing one FP8 GEMM, o_proj FP8, nothing else; its head counts, scaling and layer
    index known), or why it is not one. The direct prefill and the direct decode read it alike."""
    group = attn._modules.get(group_name(QKV))
    o_proj = attn._modules.get("o_proj")
    if not isinstance(group, SharedInput) or not lone_fp8(o_proj):
        return "its q/k/v do not share one FP8 GEMM, or o_proj is not FP8"
    extra = sorted(set(attn._modules) - {*QKV, "o_proj", group_name(QKV)})
    if extra:
        return f"it has modules the direct path does not run ({', '.join(extra)})"
    heads = rotary._heads(attn)
    scaling, idx = getattr(attn, "scaling", None), getattr(attn, "layer_idx", None)
    if heads is None or not isinstance(scaling, (int, float)) or not isinstance(idx, int):
        return "no head counts, scaling or layer index"
    hq, hk, d = heads
    if group.sizes != [hq * d, hk * d, hk * d] or o_proj.in_features != hq * d:
        return f"its projections are not {hq} + 2 x {hk} heads of {d}"
    return group, o_proj, heads


def plan(attn: nn.Module) -> Plan | str:
    """The direct path's plan for an attention module, or why it has none."""
    found = llama_attention(attn)
    if isinstance(found, str):
        return found
    group, o_proj, heads = found
    if not o_proj.prefill_quantizes or not group.inner.prefill_quantizes:
        return "its prefill kernels do not quantize activations"
    return Plan(attn, group, o_proj, *heads)


def _hooked(mods) -> bool:
    """Whether a call of any of these modules would run a hook (which the direct path would skip)."""
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in mods)


def takes(p: Plan, x: torch.Tensor, kwargs: dict):
    """(cos, sin, cache) if the direct path computes this call of the decoder layer whose input
    norm made `x` (its output, [B, S, hidden]), else None."""
    if x.ndim != 3 or x.shape[1] < 2:  # first: an eager decode step (one row per sequence) leaves here
        return None
    if not kwargs.keys() <= KWARGS or kwargs.get("attention_mask") is not None or x.dtype != p.group.inner.dtype:
        return None
    pe = kwargs.get("position_embeddings")
    if not isinstance(pe, tuple) or len(pe) != 2:
        return None
    cos, sin = pe
    b, s, _ = x.shape
    if (
        not all(g.quantizes(b * s) for g in p.groups)
        or cos.ndim != 3
        or cos.shape[1] != s
        or cos.shape[-1] != p.d
        or cos.shape[0] not in (1, b)
        or sin.shape != cos.shape
        or cos.dtype != x.dtype
        or sin.dtype != x.dtype
    ):
        return None
    cache = hf_compat.passed_cache(kwargs)
    if cache is not None and (type(cache) is not DynamicCache or cache.get_seq_length(p.layer_idx) != 0):
        return None
    attn = p.attn
    if attn.training or hf_compat.attn_implementation(attn.config) not in SDPA or _hooked(p.skipped):
        return None
    if any(m.prefill_fn(b * s) not in kernels.QUANTIZING for m in p.layers) or any(w.requires_grad for w in p.frozen):
        return None
    return cos, sin, cache


def forward(p: Plan, x: torch.Tensor, codes, cos: torch.Tensor, sin: torch.Tensor, cache, kv_out=None) -> torch.Tensor:
    """The attention module's output [B, S, hidden] for the input norm's output, given as its codes
    (`codes`, what the q/k/v GEMM reads) for the layer input x [B, S, hidden] (read for its
    shape and dtype): what the module's own forward computes, op for op. `kv_out`: two
    [B, hk, S, d] tensors the keys (after the rotary) and values are copied into."""
    p.calls += 1
    b, s, _ = x.shape
    inner = p.group.inner
    qkv = inner.prefill_fn(b * s)(inner, x, codes)  # [B*S, (hq + 2 hk) d]
    n, d, off = qkv.shape[1], p.d, qkv.storage_offset()
    st = (s * n, d, n, 1)  # [B, H, S, D] views of the heads, as `.view(B, S, -1, D).transpose(1, 2)` makes them
    q = qkv.as_strided((b, p.hq, s, d), st, off)
    k = qkv.as_strided((b, p.hk, s, d), st, off + p.hq * d)
    v = qkv.as_strided((b, p.hk, s, d), st, off + (p.hq + p.hk) * d)
    q, k = rotary.rotary(q, k, cos, sin)
    if kv_out is not None:
        kv_out[0].copy_(k)
        kv_out[1].copy_(v)
    if cache is not None:
        k, v = cache.update(k, v, p.layer_idx)
    o = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=p.scaling, is_causal=True, **p.gqa)
    return p.o_proj.prefill_fn(b * s)(p.o_proj, o.transpose(1, 2).reshape(b * s, -1)).view(b, s, -1)
