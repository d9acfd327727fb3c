"""Fewer kernel launches per decoder layer in eager mode: RMSNorm fused with the quantization of
the layers it feeds, the gated MLP's SiLU * up fused with down_proj's quantization, the
rotary embedding of q and k in one kernel (runtime/patches/rotary.py), and each residual add of a
pre-norm decoder layer done by the norm that reads the sum.

Why: an eager prefill runs one Python call per op, and on the H200 hosts we measured even BF16's
own Llama-3-8B prefill is close to host-bound (42 kernels per layer; docs/runtime-notes.md). Our
FP8 layers do less GPU work than BF16's but had to launch more (45 per layer), so the host, not
the GPU, set the time. transformers' RMSNorm is seven eager kernels (cast, pow, mean, add, rsqrt,
mul, cast, mul) and the q/k/v group then quantizes its output in an eighth; here one Triton
program per row does all of it (act_quant.rms_norm_quantize) and hands the codes to the group
(`SharedInput.stash.pre`, used only for that very tensor, unmodified). The MLP's
`down_proj(act_fn(gate) * up)` is silu, mul, quantize, GEMM after the gate/up GEMM; here
`act_quant.silu_mul_quantize` reads the fused gate/up output once and writes down_proj's codes.
A pre-norm layer's `residual + hidden_states` is one more kernel and one more read and write of
the hidden states, twice per layer, each followed by a norm that reads the sum again; the
layer's installed forward makes the sum in the norm's kernel (`act_quant.add_rms_norm_quantize`,
rounded as the add rounds). The layer's last sum goes to the next layer's input norm (or the
model's final norm), found by the probe forward, and that norm's next call on exactly that sum
returns it (`mpsconvert_hand`). On the H200 this took 64 of 569 kernels out of a 2048-token
Llama-3-8B prefill (GPU work 26.4 -> 25.9 ms).

At decode (eager, and under torch.compile, where the decode step is one CUDA graph) a gated MLP
whose fused gate/up layer decodes with a Triton GEMV runs that GEMV's gated form
(kernels.GATED): the kernel computes the gate and up rows of its tile together and writes
silu(gate) * up, rounded as the module's own ops round it, so the [M, 2I] product is never
written and SiLU * up is not a kernel of its own (inductor's fused silu-mul was 1.2 us of GPU time
and one launch per layer of the H200's 3.2 ms Llama-3-8B decode step). It is checked at install
on a decode-sized probe against the module's own forward, as the prefill path is.

A decode step (batch 1, one token) of a Llama-style layer whose GEMVs have the fused forms runs as
direct calls with its norms and residual adds folded into its GEMVs (runtime/patches/direct_decode.py).

A prefill whose attention module is Llama-style runs the whole layer as direct calls
(`_direct_layer`, runtime/patches/attention_prefill.py): the same kernels, none of the modules' Python
between them, and norms that write only the codes their GEMMs read.

Nothing else about the model changes: the fused forwards run only in eager mode on the Triton
path (CUDA, or the interpreter in tests), with the shapes they take and inputs that need no
gradient (the kernels have no backward); otherwise, and always under
torch.compile (where Inductor fuses the module's own ops itself), each module runs its own
forward. Which norm feeds which group is found by one probe forward of the model (forward hooks:
the group's first member receives the norm's output tensor), not from module names. Every
installed forward is checked at install against the module's own forward on a probe input
(norm: within two units in the last place of the activation dtype on a few elements, what a
float32 sum in another order changes after two roundings; MLP: relative error far below FP8's;
decoder layer: bit for bit, with the modules' installed forwards, the handed-over norm output
included), and a module that differs keeps its own forward, with the reason in the report.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from transformers import DynamicCache

from ...format.fp8 import relative_error
from ...model import hf_compat
from ..ops import kernels
from ..ops import triton as tritonlib
from ..ops.fp8linear import DECODE_MAX_M, PROBE_ROWS, FP8Linear
from ..ops.fuse import SharedInput, Stash, group_name, lone_fp8, version
from ..ops.triton import act_quant
from ..ops.triton import launch as triton_launch
from . import attention_prefill, direct_decode, forwards, rotary

LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")  # a pre-norm decoder layer's modules
NORM_MAX_ULP_FRACTION = 1e-3  # elements of a checked norm allowed off by at most two ulps (summation order)
MLP_MAX_REL_ERR = 2**-8  # relative (Frobenius) error of a checked MLP against its own forward


def _eps(norm: nn.Module) -> float | None:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _is_rms_norm(mod: nn.Module) -> bool:
    w = getattr(mod, "weight", None)
    return (
        type(mod).__name__.endswith("RMSNorm") and isinstance(w, torch.Tensor) and w.ndim == 1 and _eps(mod) is not None
    )


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The installed forward of an RMSNorm (forwards.install)."""
    w = self.weight
    if (
        torch.compiler.is_compiling() or not act_quant.rms_norm_fits(x, w) or x.requires_grad or w.requires_grad
    ):  # no backward here
        return self.mpsconvert_base.forward(self, x)
    pre = _handed(self, x)
    if pre is not None and pre[2] is not None:  # the layer before computed this norm of exactly x with its residual add
        return pre[2]
    return _fused_norm(self, x)[1]


def _handed(norm: nn.Module, x: torch.Tensor):
    """What the layer before computed for this norm's call on exactly `x` (taken once): (x,
    version, the norm's output or None where only its codes were written, its codes or None)."""
    return norm.mpsconvert_hand.take_pre(x)


def _fused_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None, store_y: bool = True):
    """(residual + x or None, the norm of that, its codes or None) in one kernel. The codes go to
    the group the norm feeds (`stash.pre`, for exactly that output), where that group quantizes
    its input. Without `store_y` the norm's output is not written (None) where a group reads
    only its codes (the direct prefill path), and nothing is stashed."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    group = norm.mpsconvert_feeds
    quant = group is not None and group.quantizes(x2.shape[0])
    scale = group.static_scale if quant else None
    if residual is None:
        total, (y, q, s) = (
            None,
            act_quant.rms_norm_quantize(x2, norm.weight, norm.mpsconvert_eps, quant, scale, store_y),
        )
    else:
        total, y, q, s = act_quant.add_rms_norm_quantize(
            x2, residual.reshape(-1, k), norm.weight, norm.mpsconvert_eps, quant, scale, store_y
        )
        total = total.view(x.shape)
    y = y.view(x.shape) if y is not None else None
    if quant and y is not None:
        group.stash.pre = (y, version(y), (q, s))
    return total, y, (q, s) if quant else None


def _mlp_parts(mlp: nn.Module):
    """(gate/up group, down_proj) of a gated MLP whose gate/up share one FP8 GEMM, or None."""
    group = mlp._modules.get(group_name(("gate_proj", "up_proj")))
    down = mlp._modules.get("down_proj")
    act = getattr(mlp, "act_fn", None)
    if not isinstance(group, SharedInput) or not lone_fp8(down):
        return None
    if not isinstance(act, nn.SiLU) and type(act).__name__ != "SiLUActivation":
        return None
    return group, down


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The installed forward of a gated MLP (forwards.install): at prefill gate/up GEMM -> one
    silu*up quantization -> down_proj's GEMM; at decode (eager or compiled) the gated form of
    the gate/up kernel, which writes silu(gate) * up itself (`_gated_decode`) -> down_proj."""
    group, down = parts = self.mpsconvert_parts
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] <= DECODE_MAX_M:
        gated = _gated_decode(self, x2)
        return (
            self.mpsconvert_base.forward(self, x)
            if gated is None
            else down(gated(group.inner, x2).view(*x.shape[:-1], -1))
        )
    if (
        torch.compiler.is_compiling()
        or not tritonlib.eager_on(x)
        or not group.quantizes(x2.shape[0])
        or down.prefill_fn(x2.shape[0]) not in kernels.QUANTIZING
        or x2.dtype != down.dtype
        or x.requires_grad
    ):
        return self.mpsconvert_base.forward(self, x)
    return _mlp_prefill(parts, x2, group.quantized_input(x, x2)).view(*x.shape[:-1], down.out_features)


def _gated_decode(mlp: nn.Module, x2: torch.Tensor):
    """The gated decode kernel (kernels.gated_decode) for this call of the MLP, or None where the
    module's own forward runs: the install check did not switch it on (`mpsconvert_gated`), the
    group no longer fuses, the kernel has no gated form, or the input needs what it lacks."""
    group, down = mlp.mpsconvert_parts
    if not mlp.mpsconvert_gated or not group.shared or x2.dtype != down.dtype or x2.requires_grad:
        return None
    return kernels.gated_decode(group.inner)


def _mlp_prefill(parts, x: torch.Tensor, codes) -> torch.Tensor:
    """The gated MLP's output [M, hidden] for the codes of its input (codes[0]: [M, K]; x: the
    input, or where only the codes were written any tensor of its dtype: the GEMMs read only x's
    dtype, and the rows' kernel bucket is the codes')."""
    group, down = parts
    inner, rows = group.inner, codes[0].shape[0]
    h = inner.prefill_fn(rows)(inner, x, codes)
    return down.prefill_fn(rows)(down, h, act_quant.silu_mul_quantize(h, kernels.static_scale(down)))


def _add_norm(residual: torch.Tensor, x: torch.Tensor, norm: nn.Module, hand: bool = False):
    """(residual + x, norm of it) in one kernel, the norm's codes handed to the group it feeds as
    its own forward hands them. With `hand`, the norm's output is kept for the norm's next call
    (on exactly that sum) and only the sum is returned. Calls the kernel does not take run the
    eager ops."""
    if (
        x.shape != residual.shape
        or x.dtype != residual.dtype
        or not act_quant.rms_norm_fits(x, norm.weight)
        or x.requires_grad
        or residual.requires_grad
        or norm.weight.requires_grad
    ):  # fmt: skip (no backward here)
        total = residual + x
        return total if hand else (total, norm(total))
    total, y, codes = _fused_norm(norm, x, residual)
    if not hand:
        return total, y
    norm.mpsconvert_hand.pre = (total, version(total), y, codes)
    return total


def _layer_forward(self, hidden_states: torch.Tensor, *args, **kwargs):
    """The installed forward of a pre-norm decoder layer (forwards.install): its own calls in its
    own order (norm, attention, add, norm, MLP, add), each residual add done by the kernel of the
    norm that reads the sum: this layer's post-attention norm, and the next layer's input norm
    (or the model's final norm), whose forward then returns what was computed for it. A prefill
    that the direct attention path takes runs `_direct_layer`."""
    if torch.compiler.is_compiling() or args or hidden_states.requires_grad:
        return self.mpsconvert_base.forward(self, hidden_states, *args, **kwargs)
    decode = self.mpsconvert_decode
    if decode is not None and (call := direct_decode.takes(decode, hidden_states, kwargs)) is not None:
        return direct_decode.forward(decode, hidden_states, *call)
    plan = self.mpsconvert_attention
    if plan is not None:
        call = attention_prefill.takes(plan, hidden_states, kwargs)
        if call is not None:
            graphs = self.mpsconvert_graphs  # runtime/patches/prefill_graphs.py, where installed
            if graphs is not None and graphs.takes(self, hidden_states):
                return graphs.run(self, hidden_states, *call)
            return _direct_layer(self, plan, hidden_states, *call)
    in_norm, attn, post, mlp, nxt = self.mpsconvert_layer
    h, _ = attn(hidden_states=in_norm(hidden_states), **kwargs)
    residual, h = _add_norm(hidden_states, h, post)
    h = mlp(h)
    return residual + h if nxt is None else _add_norm(residual, h, nxt, hand=True)


def _direct_layer(layer: nn.Module, plan, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
    """The layer's prefill as direct calls (attention_prefill.takes checked the call, and that no
    module it skips has a hook): the same kernels in the same order as `_layer_forward`, but the
    norms write only the codes their groups read (no [M, hidden] output written and read back),
    and only an MLP that is not a fused gated one (an MoE block) is called as a module. The next
    layer's input norm gets the sum and codes (its own forward computes its output afresh if that
    layer takes the module path)."""
    in_norm, nxt = layer.mpsconvert_layer[0], layer.mpsconvert_layer[4]
    codes = take_handed_codes(layer, plan, x)
    if codes is None:
        codes = _fused_norm(in_norm, x, store_y=False)[2]
    total, h = layer_rest(layer, plan, x, codes, cos, sin, cache)
    if nxt is None:
        return total + h
    total, y, codes = _fused_norm(nxt, h, total, store_y=False)
    nxt.mpsconvert_hand.pre = (total, version(total), y, codes)
    return total


def take_handed_codes(layer: nn.Module, plan, x: torch.Tensor):
    """The codes of the layer's input norm of x that the layer before computed with its residual
    add (None if it handed none over), taken with whatever was stashed for them."""
    pre = _handed(layer.mpsconvert_layer[0], x)
    if pre is None or pre[3] is None:
        return None
    if pre[2] is not None:  # also stashed for the module path's call on that output: taken here
        plan.group.stash.pre = None
    return pre[3]


def layer_rest(
    layer: nn.Module, plan, x: torch.Tensor, codes, cos: torch.Tensor, sin: torch.Tensor, cache, kv_out=None
):
    """The layer after its input norm, as direct calls: (x + attention, the MLP's output), whose
    sum is the layer's output. `codes`: the input norm's codes of x; `kv_out`: buffers the keys
    and values are copied into (runtime/patches/prefill_graphs.py)."""
    _, _, post, mlp, _ = layer.mpsconvert_layer
    h = attention_prefill.forward(plan, x, codes, cos, sin, cache, kv_out)
    if plan.fused_mlp:  # the gated MLP from the post-attention norm's codes
        total, _, codes = _fused_norm(post, h, x, store_y=False)
        return total, _mlp_prefill(mlp.mpsconvert_parts, x, codes).view(x.shape)
    total, y, _ = _fused_norm(post, h, x)
    return total, mlp(y)


def _direct_plan(parts: list, nxt: nn.Module | None):
    """The attention's plan for `_direct_layer` (attention_prefill.plan) with what the rest of the
    layer needs on every call added, or why the layer cannot take that path."""
    in_norm, attn, post, mlp = parts
    plan = attention_prefill.plan(attn)
    if isinstance(plan, str):
        return plan
    if not forwards.installed(in_norm, _norm_forward) or in_norm.mpsconvert_feeds is not plan.group:
        return "its input norm does not feed the q/k/v GEMM through the fused norm"
    plan.skipped += (in_norm,)  # also called without its module
    mlp_parts = getattr(mlp, "mpsconvert_parts", None)
    if (
        forwards.installed(mlp, _mlp_forward) and post.mpsconvert_feeds is mlp_parts[0]
    ):  # else (an MoE block, say) called as a module
        plan.fused_mlp = True
        plan.skipped += (mlp,)
        plan.groups += (mlp_parts[0],)
        plan.layers += (mlp_parts[1],)
    plan.frozen = tuple(n.weight for n in (in_norm, post, nxt) if n is not None)
    return plan


def _is_layer(mod: nn.Module, norms: set) -> bool:
    """A pre-norm decoder layer made of exactly LAYER_PARTS (Llama, Mistral, Qwen2/3, their MoE
    variants), its norms RMSNorms; whether its forward is that sequence is checked at install."""
    return sorted(mod._modules) == sorted(LAYER_PARTS) and all(mod._modules[n] in norms for n in LAYER_PARTS[::2])


def _links(model: nn.Module, norms: list[nn.Module], layers: list[nn.Module]):
    """Seen in one probe forward: norm -> the SharedInput group its output goes to, decoder layer
    -> the norm its output goes to, and decoder layer -> the keyword arguments it was called with."""
    outputs: dict[int, tuple[torch.Tensor, nn.Module]] = {}
    layer_out: dict[int, tuple[torch.Tensor, nn.Module]] = {}
    firsts = {m.group: m for m in model.modules() if isinstance(m, FP8Linear) and m.group is not None and m.slot == 0}
    links: dict[nn.Module, SharedInput] = {}
    nexts: dict[nn.Module, nn.Module] = {}
    calls: dict[nn.Module, dict] = {}
    hooks = [n.register_forward_hook(lambda mod, args, out: outputs.__setitem__(id(out), (out, mod))) for n in norms]
    hooks += [
        m.register_forward_hook(lambda mod, args, out: layer_out.__setitem__(id(out), (out, mod))) for m in layers
    ]

    def called(layer, args, kwargs):
        if not args[1:] and "hidden_states" not in kwargs:
            calls.setdefault(layer, dict(kwargs))

    hooks += [m.register_forward_pre_hook(called, with_kwargs=True) for m in layers]

    def producer(made: dict, args):
        """The module whose output recorded in `made` is exactly this call's input, or None."""
        hit = made.get(id(args[0])) if args else None
        return hit[1] if hit is not None and hit[0] is args[0] else None

    def seen(group):
        def pre(mod, args):
            if (norm := producer(outputs, args)) is not None:
                links.setdefault(norm, group)

        return pre

    def reads(norm, args):
        if (layer := producer(layer_out, args)) is not None:
            nexts.setdefault(layer, norm)

    hooks += [first.register_forward_pre_hook(seen(g)) for g, first in firsts.items()]
    hooks += [n.register_forward_pre_hook(reads) for n in norms]
    try:
        dev = next(t.device for t in itertools.chain(model.parameters(), model.buffers()) if t.device.type != "meta")
        ids = torch.zeros(1, PROBE_ROWS, dtype=torch.long, device=dev)
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return links, nexts, calls


def _check_norm(norm: nn.Module, quant_scale) -> str | None:
    """None if the fused norm matches the module's own forward on a probe input, else why not."""
    w = norm.weight
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(PROBE_ROWS, w.shape[0], generator=g) * 4).to(device=w.device, dtype=w.dtype)
    if not act_quant.rms_norm_fits(x, w):
        return f"the fused norm does not take {w.dtype} rows of {w.shape[0]}"
    want = forwards.own_forward(norm)(norm, x)
    y, q, s = act_quant.rms_norm_quantize(x, w, norm.mpsconvert_eps, True, quant_scale)
    if want.dtype != y.dtype or want.shape != y.shape:
        return f"its forward returns {want.dtype} {list(want.shape)}"
    diff = (y.float() - want.float()).abs()
    ulp = torch.finfo(y.dtype).eps * want.float().abs().clamp(min=torch.finfo(y.dtype).tiny)
    off = diff > 0
    if bool((diff > 2 * ulp).any()) or float(off.float().mean()) > NORM_MAX_ULP_FRACTION:
        return (
            f"differs from its own forward (max abs {float(diff.max()):.3g}, {int(off.sum())} of {diff.numel()} "
            "elements)"
        )
    q2, s2 = act_quant.torch_quantize(y, quant_scale)
    if not (torch.equal(s, s2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))):
        return "its quantized output differs from act_quant.quantize of it"
    return None


def _check_mlp(mlp: nn.Module) -> str | None:
    """None if the installed MLP forward matches the module's own on a prefill-sized probe (its
    gated decode, off until then: `_check_gated`)."""
    group, down = mlp.mpsconvert_parts
    g = torch.Generator(device="cpu").manual_seed(0)
    k = group.inner.in_features
    x = torch.randn(PROBE_ROWS, k, generator=g).to(device=down.weight.device, dtype=down.dtype)
    if not group.quantizes(PROBE_ROWS) or not group.inner.prefill_quantizes or not down.prefill_quantizes:
        return "its layers' prefill kernels do not quantize activations"
    want = forwards.own_forward(mlp)(mlp, x).float()
    got = _mlp_forward(mlp, x).float()
    err = relative_error(got, want)
    return None if err <= MLP_MAX_REL_ERR else f"differs from its own forward (relative error {err:.3g})"


def _check_gated(mlp: nn.Module) -> str | None:
    """Switch the MLP's gated decode on (`mpsconvert_gated`) if its decode kernel has a gated form,
    its gate and up are as wide, and a decode-sized probe gives the module's own forward; returns
    why not where it has a form."""
    group, down = mlp.mpsconvert_parts
    if kernels.gated_decode(group.inner) is None or group.sizes[0] != group.sizes[1]:
        return None
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(1, 1, group.inner.in_features, generator=g).to(device=down.weight.device, dtype=down.dtype)
    try:
        want = forwards.own_forward(mlp)(mlp, x).float()
        object.__setattr__(mlp, "mpsconvert_gated", True)  # for the probe call
        got = _mlp_forward(mlp, x).float()
        err = relative_error(got, want)
        why = (
            None
            if got.shape == want.shape and err <= MLP_MAX_REL_ERR
            else f"its gated decode differs from its own forward (relative error {err:.3g})"
        )
    except Exception as e:  # a kernel this Triton or device cannot run: the module's decode
        why = f"its gated decode failed ({type(e).__name__}: {str(e)[:120]})"
    object.__setattr__(mlp, "mpsconvert_gated", why is None)
    return why


def _check_layer(layer: nn.Module, kwargs: dict) -> str | None:
    """None if the installed layer forward gives exactly the layer's own forward (with its
    modules' installed forwards) on probes, the next norm's handed-over output included: the
    call the probe forward made (no cache), and with a direct attention path (which that call
    must have taken) the same call over a fresh DynamicCache, the cache's contents included."""
    probes = [(kwargs, kwargs, None)]  # (the own forward's arguments, the installed forward's, their caches)
    plan = layer.mpsconvert_attention
    if plan is not None:
        name = hf_compat.cache_arg(kwargs)
        if name is not None:
            caches = [DynamicCache(config=plan.attn.config) for _ in range(2)]
            probes.append(tuple({**kwargs, name: c, "use_cache": True} for c in caches) + (caches,))
    for want_kw, got_kw, caches in probes:
        taken = plan.calls if plan is not None else 0
        why = _check_call(layer, want_kw, got_kw, caches)
        if why:
            return why
        if plan is not None and plan.calls == taken:
            return "its probe call did not take the direct attention path"
    return None


def _same_norm(norm: nn.Module, handed: tuple, ref: torch.Tensor) -> bool:
    """Whether what a layer handed to `norm` (its output, its codes: those written) equals the
    norm's own output `ref` and act_quant.quantize's codes of it."""
    _, _, y, codes = handed
    if y is not None and not torch.equal(y, ref):
        return False
    if codes is None:
        return y is not None and (
            norm.mpsconvert_feeds is None or not norm.mpsconvert_feeds.quantizes(ref.numel() // ref.shape[-1])
        )
    q, s = act_quant.quantize(ref.reshape(-1, ref.shape[-1]), norm.mpsconvert_feeds.static_scale)
    return torch.equal(codes[1], s) and torch.equal(codes[0].view(torch.uint8), q.view(torch.uint8))


def _check_call(layer: nn.Module, want_kw: dict, got_kw: dict, caches) -> str | None:
    nxt = layer.mpsconvert_layer[4]
    post = layer.mpsconvert_layer[2]
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, PROBE_ROWS, post.weight.shape[0], generator=g).to(
        device=post.weight.device, dtype=post.weight.dtype
    )
    try:
        want = forwards.own_forward(layer)(layer, x, **want_kw)
        got = _layer_forward(layer, x, **got_kw)
        handed = nxt.mpsconvert_hand.pre if nxt is not None else None
        if nxt is not None:
            nxt.mpsconvert_hand.pre = None
            ref = nxt(want)  # computed afresh from the layer's own output
    except Exception as e:  # a layer the probe cannot call this way: it keeps its own forward
        return f"its probe call failed ({type(e).__name__}: {str(e)[:120]})"
    finally:
        for norm in (post, nxt):
            if norm is not None and norm.mpsconvert_feeds is not None:
                norm.mpsconvert_feeds.stash.pre = None
    if not isinstance(want, torch.Tensor):
        return f"its forward returns {type(want).__name__}, not a tensor"
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.equal(got, want):
        return "the fused residual adds differ from its own forward"
    if nxt is not None and (handed is None or handed[0] is not got or not _same_norm(nxt, handed, ref)):
        return "the next norm's output computed with the residual add differs from the norm's own"
    if caches is not None:
        idx = layer.mpsconvert_attention.layer_idx
        held = [(c.layers[idx].keys, c.layers[idx].values) for c in caches]
        if not all(torch.equal(a, b) for a, b in zip(*held)):
            return "the keys and values it caches differ from its own forward's"
    return None


def install(model: nn.Module) -> dict:
    """Install the fused eager forwards into a loaded model (after share_inputs and the kernel
    policy, whose choices they read at call time); returns what was installed and what was not."""
    report = {
        "norms": 0,
        "norms_quantizing": 0,
        "mlps": 0,
        "mlps_gated_decode": 0,
        "layers": 0,
        "layers_direct_decode": 0,
        "attention": 0,
        "rotary": 0,
        "left": [],
    }
    if not tritonlib.available():
        report["left"].append("Triton is not available here")
        return report
    report["launch"] = triton_launch.mode()
    layer = next((m for m in model.modules() if isinstance(m, FP8Linear)), None)
    if layer is not None:  # the activations' dtype and device are the FP8 layers'
        rot = rotary.install(model, layer.dtype, next(layer.parameters()).device)
        report["rotary"], report["left"] = rot["attention"], report["left"] + rot["left"]
    norms = [m for m in model.modules() if _is_rms_norm(m)]
    mlps = [(m, parts) for m in model.modules() if (parts := _mlp_parts(m)) is not None]
    norm_set = set(norms)
    layers = [m for m in model.modules() if _is_layer(m, norm_set)]
    if not norms and not mlps:
        return report
    try:
        links, nexts, calls = _links(model, norms, layers)
    except Exception as e:  # a model the probe cannot run (needs other inputs): nothing installed
        report["left"].append(f"probe forward failed ({type(e).__name__}: {str(e)[:120]}); nothing fused")
        return report
    names = {m: n for n, m in model.named_modules()}

    def kept(module: nn.Module, why: str | None, count: str) -> bool:
        """Whether `module`'s installed forward passed its check (counted under `count`); else it is
        taken out again and why is said."""
        if why:
            forwards.uninstall(module)
            report["left"].append(f"{names[module]}: {why}")
            return False
        report[count] += 1
        return True

    for norm in norms:
        object.__setattr__(norm, "mpsconvert_eps", _eps(norm))
        group = links.get(norm)
        why = _check_norm(norm, group.static_scale if group is not None else None)
        if why:
            report["left"].append(f"{names[norm]}: {why}")
            continue
        object.__setattr__(norm, "mpsconvert_feeds", group)  # a reference, not a submodule
        object.__setattr__(norm, "mpsconvert_hand", Stash())  # what the layer before computed for it (_layer_forward)
        forwards.install(norm, _norm_forward)
        report["norms"] += 1
        report["norms_quantizing"] += group is not None
    for mlp, parts in mlps:
        object.__setattr__(mlp, "mpsconvert_parts", parts)
        object.__setattr__(mlp, "mpsconvert_gated", False)  # the gated decode: on once checked (_check_gated)
        forwards.install(mlp, _mlp_forward)  # checked installed (its fallbacks call the class's own forward)
        if not kept(mlp, _check_mlp(mlp), "mlps"):
            continue
        why = _check_gated(mlp)
        if why:
            report["left"].append(f"{names[mlp]}: {why}; its decode runs the module's forward")
        report["mlps_gated_decode"] += bool(mlp.mpsconvert_gated)
    fused = {m for m in norms if forwards.installed(m, _norm_forward)}
    for layer in layers:
        parts = [layer._modules[n] for n in LAYER_PARTS]
        if parts[2] not in fused or layer not in calls:
            continue
        nxt = nexts.get(layer)
        nxt = nxt if nxt in fused else None
        object.__setattr__(layer, "mpsconvert_layer", (*parts, nxt))
        plan = _direct_plan(parts, nxt)
        if isinstance(plan, str):
            report["left"].append(f"{names[parts[1]]}: {plan}; its prefill runs the module's forward")
            plan = None
        object.__setattr__(layer, "mpsconvert_attention", plan)
        object.__setattr__(layer, "mpsconvert_graphs", None)  # the prefill's CUDA graphs (prefill_graphs.install)
        object.__setattr__(layer, "mpsconvert_decode", None)  # the direct decode (direct_decode.py): on once checked
        forwards.install(layer, _layer_forward)
        why = _check_layer(layer, calls[layer])
        if why and plan is not None:  # the layer without the direct attention path
            object.__setattr__(layer, "mpsconvert_attention", None)
            why, direct = _check_layer(layer, calls[layer]), why
            if not why:  # the direct path was what differed
                report["left"].append(f"{names[parts[1]]}: {direct}; its prefill runs the module's forward")
        if not kept(layer, why, "layers"):
            continue
        report["attention"] += layer.mpsconvert_attention is not None
        # the direct decode where the layer's structure and the policy's kernels have its forms (else not
        # a finding: its decode step runs the modules, as before); said in `left` where its check fails
        dec = direct_decode.plan(parts) if parts[0] in fused else None
        if dec is not None and direct_decode.kernels_fit(dec):
            why = direct_decode.check(layer, dec, calls[layer], _layer_forward)
            if why:
                report["left"].append(f"{names[layer]}: {why}; its decode step runs the modules")
            else:
                object.__setattr__(layer, "mpsconvert_decode", dec)
                report["layers_direct_decode"] += 1
    return report
