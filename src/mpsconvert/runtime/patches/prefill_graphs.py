"""A short prefill's decoder layers replayed as CUDA graphs, one per layer and padded length.

Why: a batch-1 prefill of a few hundred tokens is bound by the host, not the GPU. On an H100 our
FP8 Llama-3-8B layer's direct calls (eager_fusion._direct_layer: about 14 kernels) took 0.46 ms
of host time per layer at 512 tokens against 0.25 ms of GPU work, and the prefill ran at 1.45x
BF16's, which is bound by its GPU (docs/benchmarks.md). A graph replays a layer's kernels with
one launch. vLLM does the same ("piecewise" graphs around the attention); here the attention
(SDPA, causal) is inside the graph and only the cache update stays outside.

How: a prompt of s tokens (a prefill: more than DECODE_MAX_M, at most MAX_TOKENS; batch 1) is
padded to S, the next multiple of PAD, and each layer's graph for S runs the direct path's kernels
on fixed buffers: the residual stream x [1, S, hidden], cos / sin [1, S, d], and the layer's keys
and values [1, hk, S, d]. The padded rows only add work: every op is per row (norms, per-token
quantization, GEMMs, the rotary) except the causal attention, where a real row never reads a later
one. Outside the graph, per layer: the keys and values of the s real rows go to the DynamicCache
(which copies them), and the layer returns a copy of x's s rows (so a caller that keeps a layer's
output, an output recorder say, keeps it). The next layer's call finds its input is that copy,
unchanged, and skips copying it back in.

The graphs of a length are captured on its first prompt (all layers, after one warm-up pass of
the same calls), share one memory pool, and are kept; a capture that fails turns the graphs off
for the model with a warning (PatchFallback), and every later prefill runs the direct path.
Longer prompts run the direct path (GPU-bound there: no gain, and their buffers would be large).
`install` checks the first layer's graph against its direct path on a probe, bit for bit, the
cache included. On by default; `load(path, prefill_graphs=False)` turns it off. Measured on an
H100 (docs/benchmarks.md): a 512-token prefill 9.4 ms against the direct path's 18.9 ms, logits
equal bit for bit.
"""

from __future__ import annotations

import time
import warnings

import torch
from torch import nn
from transformers import DynamicCache

from ..ops.fuse import version
from . import eager_fusion, forwards
from .base import PatchFallback

PAD = 128  # prompt lengths are padded to a multiple of this: at most MAX_TOKENS / PAD lengths are captured
MAX_TOKENS = 1024  # longer prefills run the direct path
PROBE_TOKENS = 9  # the install check's prompt (padded to PAD: it captures that length's graphs)


class _Eager:
    """A layer's calls run as they would be recorded (no CUDA: the tests' interpreted runs)."""

    def __init__(self, fn):
        self.replay = fn


class Graphs:
    """One model's prefill graphs: the buffers they read and write, and per padded length one graph
    per layer (the layers whose whole prefill the direct path computes: a fused gated MLP)."""

    def __init__(self, layers: list[nn.Module], capture: bool = True):
        self.layers = layers
        self.index = {layer: i for i, layer in enumerate(layers)}
        plan = layers[0].mpsconvert_attention
        w = plan.o_proj.weight
        dev, dtype, hidden = w.device, plan.o_proj.dtype, plan.o_proj.out_features
        self.capture = capture
        self.x = torch.zeros(1, MAX_TOKENS, hidden, dtype=dtype, device=dev)
        self.cos = torch.zeros(1, MAX_TOKENS, plan.d, dtype=dtype, device=dev)
        self.sin = torch.zeros_like(self.cos)
        self.k = torch.zeros(1, plan.hk, MAX_TOKENS, plan.d, dtype=dtype, device=dev)
        self.v = torch.zeros_like(self.k)
        self.graphs: dict[int, list] = {}  # padded length -> one graph per layer
        self.seconds: dict[int, float] = {}  # padded length -> capture seconds (warm-up included)
        self.pool = None
        self.off: str | None = None  # why the graphs stopped (a failed capture); the direct path runs
        self.replays = 0
        self._held = None  # (tensor, version): the layer output whose s rows x holds
        self._pos = None  # (cos, sin, versions) copied into the buffers

    def takes(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether this call of a layer (that the direct path takes) replays a graph."""
        return (
            self.off is None
            and x.shape[0] == 1
            and x.shape[1] <= MAX_TOKENS
            and layer in self.index
            and not (self.capture and torch.cuda.is_current_stream_capturing())
        )

    def run(self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        """The layer's output for x [1, s, hidden], as `_direct_layer` computes it, with the keys and
        values of the s tokens added to `cache` (a DynamicCache empty for this layer, or None)."""
        s = x.shape[1]
        size = -(-s // PAD) * PAD
        graphs = self.graphs.get(size)
        if graphs is None:
            graphs = self._capture(size)
            if graphs is None:
                return eager_fusion._direct_layer(layer, layer.mpsconvert_attention, x, cos, sin, cache)
        plan = layer.mpsconvert_attention
        eager_fusion.take_handed_codes(
            layer, plan, x
        )  # a direct-path layer before may have handed them over: unused here
        held = self._held
        if held is None or held[0] is not x or held[1] != version(x):
            self.x[:, :s].copy_(x)
            self.x[:, s:size].zero_()
        pos = (cos, sin, version(cos), version(sin))
        if self._pos is None or self._pos[0] is not cos or self._pos[1] is not sin or self._pos[2:] != pos[2:]:
            self.cos[:, :s].copy_(cos)  # [1, s, d]: attention_prefill.takes checked it for batch 1
            self.sin[:, :s].copy_(sin)
            self._pos = pos
        graphs[self.index[layer]].replay()
        self.replays += 1
        plan.calls += 1
        if cache is not None:
            cache.update(self.k[:, :, :s], self.v[:, :, :s], plan.layer_idx)
        out = self.x[:, :s].clone()
        self._held = (out, version(out))
        return out

    def _body(self, layer: nn.Module, size: int) -> None:
        """One layer's direct calls on the buffers' first `size` rows (what a graph records)."""
        plan = layer.mpsconvert_attention
        x = self.x[:, :size]
        codes = eager_fusion._fused_norm(layer.mpsconvert_layer[0], x, store_y=False)[2]
        total, h = eager_fusion.layer_rest(
            layer,
            plan,
            x,
            codes,
            self.cos[:, :size],
            self.sin[:, :size],
            None,
            (self.k[:, :, :size], self.v[:, :, :size]),
        )
        torch.add(total, h, out=x)

    def _capture(self, size: int):
        """Every layer's graph for `size` rows (None, with the graphs off and a warning, where a
        capture failed)."""
        t0 = time.perf_counter()
        self._held = None  # the warm-up writes the buffers
        calls = [plan.calls for plan in (m.mpsconvert_attention for m in self.layers)]
        try:
            if not self.capture:
                graphs = [_Eager(lambda layer=layer: self._body(layer, size)) for layer in self.layers]
            else:
                graphs = self._record(size)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot be captured here: the direct path, said once
            self.off = f"capturing the {size}-token prefill failed ({type(e).__name__}: {str(e)[:160]})"
            warnings.warn(
                f"mpsconvert: prefills replay no CUDA graphs: {self.off}; they run the direct calls",
                PatchFallback,
                stacklevel=4,
            )
            return None
        finally:
            for plan, n in zip((m.mpsconvert_attention for m in self.layers), calls):
                plan.calls = n  # the warm-up and the recording are not calls
        self.graphs[size] = graphs
        self.seconds[size] = round(time.perf_counter() - t0, 4)
        return graphs

    def _record(self, size: int) -> list:
        dev = self.x.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up: cuBLAS's workspaces and Triton's compiled kernels for these shapes
            for layer in self.layers:
                self._body(layer, size)
        torch.cuda.current_stream(dev).wait_stream(side)
        graphs = []
        for layer in self.layers:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                g, pool=self.pool, capture_error_mode="thread_local"
            ):  # another thread's CUDA calls (a
                # warm-up thread of load) neither break nor join the capture
                self._body(layer, size)
            self.pool = self.pool if self.pool is not None else g.pool()
            graphs.append(g)
        torch.cuda.synchronize(dev)
        return graphs

    def report(self) -> dict:
        return {
            "layers": len(self.layers),
            "pad": PAD,
            "max_tokens": MAX_TOKENS,
            "captured_s": dict(self.seconds),
            "replays": self.replays,
            "mode": "CUDA graphs" if self.capture else "eager (no capture)",
            "off": self.off,
        }


def of(model: nn.Module) -> Graphs | None:
    """The model's prefill graphs (one object its layers share), or None where none are installed."""
    return next((g for m in model.modules() if (g := getattr(m, "mpsconvert_graphs", None)) is not None), None)


def _eligible(model: nn.Module) -> list[nn.Module]:
    """The decoder layers whose whole prefill the direct path computes, in the model's order."""
    return [
        m
        for m in model.modules()
        if forwards.installed(m, eager_fusion._layer_forward)
        and m.mpsconvert_attention is not None
        and m.mpsconvert_attention.fused_mlp
    ]


def _check(graphs: Graphs, layer: nn.Module) -> str | None:
    """None if the layer's graph gives, bit for bit, what its direct path gives for the same rows
    with zero rows appended up to PAD (its output and cache, the real rows), else why not. The
    direct path was checked against the module's own forward at its install; any rotary table
    does here."""
    plan = layer.mpsconvert_attention
    dev, dtype, n = graphs.x.device, graphs.x.dtype, PROBE_TOKENS
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, n, plan.o_proj.out_features, generator=g).to(device=dev, dtype=dtype)
    angle = torch.arange(PAD, dtype=torch.float32)[:, None] / 10 ** (torch.arange(plan.d, dtype=torch.float32) / plan.d)
    cos, sin = (f(angle)[None].to(device=dev, dtype=dtype) for f in (torch.cos, torch.sin))
    caches = [DynamicCache(config=plan.attn.config) for _ in range(2)]
    nxt = layer.mpsconvert_layer[4]
    try:
        want = eager_fusion._direct_layer(
            layer, plan, torch.cat([x, x.new_zeros(1, PAD - n, x.shape[-1])], dim=1), cos, sin, caches[0]
        )
        if nxt is not None:
            nxt.mpsconvert_hand.pre = None
        got = graphs.run(layer, x, cos[:, :n], sin[:, :n], caches[1])
    except Exception as e:  # noqa: BLE001 - the layers keep the direct path
        return f"its probe failed ({type(e).__name__}: {str(e)[:120]})"
    if graphs.off is not None:
        return graphs.off
    held = [caches[i].layers[plan.layer_idx] for i in range(2)]
    if not (
        torch.equal(got, want[:, :n])
        and torch.equal(held[1].keys, held[0].keys[:, :, :n])
        and torch.equal(held[1].values, held[0].values[:, :, :n])
    ):
        return "its graph's output or cache differs from the direct path's"
    if any(
        t.untyped_storage().data_ptr() in (graphs.k.untyped_storage().data_ptr(), graphs.v.untyped_storage().data_ptr())
        for t in (held[1].keys, held[1].values)
    ):
        return "the cache keeps the graph's buffers instead of copying them"
    return None


def install(model: nn.Module, capture: bool = True) -> dict:
    """Give the layers that eager_fusion runs as direct calls at prefill one `Graphs` (after
    eager_fusion.install), checked on the first layer (which captures the PAD-token graphs).
    `capture=False` runs the recorded calls eagerly (no CUDA: the tests' interpreted runs)."""
    layers = _eligible(model)
    if not layers:
        return {"installed": 0, "left": "no decoder layer runs its whole prefill as direct calls (eager_fusion)"}
    graphs = Graphs(layers, capture=capture)
    with torch.no_grad():
        why = _check(graphs, layers[0])
    if why:
        return {"installed": 0, "left": why}
    for layer in layers:
        object.__setattr__(layer, "mpsconvert_graphs", graphs)
    return {"installed": len(layers), **graphs.report()}
