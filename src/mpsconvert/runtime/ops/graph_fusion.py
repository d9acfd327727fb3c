"""An Inductor graph pass for the compiled decode step: each RMSNorm that feeds only a decode GEMV
becomes that GEMV's prologue, and each residual add of a GEMV's output becomes its epilogue.

Why: in the CUDA-graph decode step of a pre-norm decoder (Llama-3-8B shape, 32 layers, H100)
Inductor fuses every residual add with the RMSNorm that reads the sum into one reduction kernel,
two per layer: 64 launches of ~2-3 us a step, each one program over a 4096-wide row, plus a
launch gap each (docs/runtime-notes.md). The GEMV after the norm reads all of the row anyway:
with `norm` it multiplies each input by the norm's weight and each output by the row's 1 / rms,
whose sum of squares it takes in the same loop (ops/triton/gemv.py). The residual add after
o_proj and down_proj is one load and one add in the GEMV's epilogue (`residual`), rounded as
the add rounds. A layer whose GEMVs all read BF16 activations then runs no kernel of its own
between them; a norm that feeds the W8A8 GEMV (quantize, then e4m3 x e4m3) keeps Inductor's
fused add + norm + quantize kernel, since that GEMV needs the row's codes before its first
product.

Numbers: the residual epilogue is the add bit for bit. The norm prologue skips the norm
output's two roundings to the activation dtype (it multiplies in float32), so its product is at
least as close to the exact one as the module's, not equal to it (tests/test_runtime_gemv.py).

Why a graph pass, not a module rewrite: the pattern is the one transformers' RMSNorm forward and
`residual + hidden_states` trace to after Inductor's decompositions (convert to float32, pow 2,
mean over the last dim, + eps, rsqrt, mul, convert back, mul by the weight), matched node by
node here; a model whose norm or add traces otherwise is left as it is (nothing to match, no
error), and no module's Python changes. The engine compiles its decode step with this pass
(engine/decoder.py `INDUCTOR_OPTIONS`), and `FUSION.counts` says what it rewrote.
"""

from __future__ import annotations

import torch
from torch import fx

try:
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
except ImportError:  # pragma: no cover - a torch without custom graph passes: the engine's options skip it
    CustomGraphPass, get_hash_for_files = object, None

aten, prims = torch.ops.aten, torch.ops.prims
_RESHAPES = (aten.reshape.default, aten.view.default)
ARGS = ("x", "weight", "scale", "bias", "block", "gated", "norm", "eps", "residual")  # the GEMV op's schema, in order
DEFAULTS = {"block": 0, "gated": False, "norm": None, "eps": 0.0, "residual": None}


def _gemv_op():
    """The decode GEMV's custom op (registered only where Triton is), or None."""
    ns = getattr(torch.ops, "mpsconvert", None)
    try:
        return ns.fp8_gemv.default if ns is not None else None
    except AttributeError:  # not registered: no Triton here
        return None


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _is(n, *targets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _args(g: fx.Node) -> dict:
    """The GEMV node's arguments by name, defaults filled in."""
    out = dict(DEFAULTS)
    out.update(zip(ARGS, g.args))
    out.update(g.kwargs)
    return out


def _through_reshapes(n: fx.Node) -> fx.Node:
    """The node a chain of single-use reshapes starts from."""
    while _is(n, *_RESHAPES) and len(n.users) == 1:
        n = n.args[0]
    return n


def _rms_norm(y: fx.Node):
    """(x, weight, eps) if `y` is transformers' RMSNorm of x as traced (weight * (x32 * rsqrt(mean(x32 ** 2, -1) +
    eps)).to(x.dtype), x32 = x.to(float32)), else None."""
    if not _is(y, aten.mul.Tensor) or len(y.args) != 2:
        return None
    for w, c in (y.args, y.args[::-1]):
        if not _is(c, prims.convert_element_type.default) or not isinstance(w, fx.Node):
            continue
        m = c.args[0]
        if not _is(m, aten.mul.Tensor) or len(m.args) != 2:
            continue
        for x32, r in (m.args, m.args[::-1]):
            if not (
                _is(r, aten.rsqrt.default)
                and _is(x32, prims.convert_element_type.default)
                and x32.args[1] == torch.float32
            ):
                continue
            a = r.args[0]
            if not _is(a, aten.add.Tensor) or not isinstance(a.args[1], float) or "alpha" in a.kwargs:
                continue
            mean = a.args[0]
            if (
                not _is(mean, aten.mean.dim)
                or list(mean.args[1]) not in ([-1],)
                or not (len(mean.args) > 2 and mean.args[2])
            ):
                continue
            p = mean.args[0]
            if not (_is(p, aten.pow.Tensor_Scalar) and p.args[0] is x32 and p.args[1] == 2) or set(x32.users) != {p, m}:
                continue
            x = x32.args[0]
            xv, wv, cv = _val(x), _val(w), _val(c)
            if (
                xv is None
                or wv is None
                or cv is None
                or cv.dtype != xv.dtype
                or xv.dtype not in (torch.bfloat16, torch.float16)
            ):
                continue
            if wv.dim() != 1 or wv.shape[0] != xv.shape[-1] or wv.dtype != xv.dtype:
                continue
            if any(len(n.users) != 1 for n in (c, m, r, a, mean, p)):
                continue
            return x, w, float(a.args[1])
    return None


def _fake(target, args):
    """The output's fake value, for the node's meta (Inductor's lowering reads it)."""
    vals = [_val(a) if isinstance(a, fx.Node) else a for a in args]
    mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with mode:
        return target(*vals)


def _call(graph: fx.Graph, target, args: tuple) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = _fake(target, args)
    return node


def _gemv(graph: fx.Graph, op, a: dict) -> fx.Node:
    return _call(graph, op, tuple(a[k] for k in ARGS))


def _fold_residuals(graph: fx.Graph, op) -> int:
    """residual + reshape(gemv(...)) -> reshape(gemv(..., residual=residual)). Returns how many."""
    done = 0
    for add in list(graph.nodes):
        if not _is(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs:
            continue
        for v, r in (add.args, add.args[::-1]):
            g = v.args[0] if _is(v, *_RESHAPES) and len(v.users) == 1 else None
            if not _is(g, op) or len(g.users) != 1 or not isinstance(r, fx.Node):
                continue
            a = _args(g)
            gv, vv, rv, av = _val(g), _val(v), _val(r), _val(add)
            if (
                a["residual"] is not None
                or None in (gv, vv, rv, av)
                or rv.shape != vv.shape
                or not (rv.dtype == gv.dtype == av.dtype)
            ):
                continue
            with graph.inserting_before(add):
                a["residual"] = _call(graph, aten.reshape.default, (r, list(gv.shape)))
                new = _gemv(graph, op, a)
                out = _call(graph, aten.reshape.default, (new, list(vv.shape)))
            add.replace_all_uses_with(out)
            done += 1
            break
    return done


def _fold_norms(graph: fx.Graph, op) -> int:
    """gemv(reshape(rms_norm(x))) -> gemv(reshape(x), norm=weight, eps=eps). Returns how many."""
    done = 0
    for g in list(graph.nodes):
        if not _is(g, op):
            continue
        a = _args(g)
        y = _through_reshapes(a["x"])
        found = _rms_norm(y) if a["norm"] is None and len(y.users) == 1 else None
        if found is None:
            continue
        x, w, eps = found
        with graph.inserting_before(g):
            a.update(x=_call(graph, aten.reshape.default, (x, [-1, _val(x).shape[-1]])), norm=w, eps=eps)
            new = _gemv(graph, op, a)
        g.replace_all_uses_with(new)
        done += 1
    return done


class DecodeFusion(CustomGraphPass):
    """The pass (Inductor's `post_grad_custom_pre_pass`): residual adds first, then norms (a norm
    whose input is a GEMV's sum matches the same after its add moved into that GEMV). `counts`
    adds up what it rewrote over the graphs it saw since `reset()` (a graph Inductor loads from
    its cache on disk is not passed through it again)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.counts = {"graphs": 0, "norms": 0, "residuals": 0}

    def __call__(self, graph: fx.Graph) -> None:
        op = _gemv_op()
        self.counts["graphs"] += 1
        if op is None:
            return
        residuals = _fold_residuals(graph, op)
        norms = _fold_norms(graph, op)
        self.counts["residuals"] += residuals
        self.counts["norms"] += norms
        if residuals or norms:
            graph.eliminate_dead_code()
            graph.lint()

    def uuid(self):
        return get_hash_for_files((__file__,)) if get_hash_for_files is not None else None


FUSION = DecodeFusion()
