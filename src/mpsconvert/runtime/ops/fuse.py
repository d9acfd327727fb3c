"""Layers that read the same input (q/k/v, gate/up) run as one FP8 GEMM, in the loaded model.

Why: with dynamic activations each FP8 layer quantizes its input; three layers reading the same
hidden state would quantize it three times and launch three GEMMs. One fused layer quantizes
once and runs one larger GEMM (better tensor-core occupancy, and for decode one GEMV launch).
Concatenation is exact for row-wise scales; per-tensor scales that differ are expanded to rows
(still exact, but the layer then runs row-wise kernels). Static input scales must agree, since
the layers share one input.

In a transformers model the three projections are called one after another by the model's own code (`self.q_proj(h)`,
`self.k_proj(h)`, `self.v_proj(h)`), which we do not change. So each member stays an FP8Linear whose weight is a view of
the fused weight, and `SharedInput` runs the fused GEMM on the first member's call and hands the other members their
slices when they are called with the very same tensor (same object, unmodified: `version`; the state lives in a plain
`Stash`). What is shared at prefill is a switch, measured (PREFILL_SHARES). A member called with another input gets its
own product, so the outputs are always the members' own; if the members of a group turn out not to share their input,
the group stops fusing (`shared = False`). The same hand-over is traced by torch.compile (dynamo records the stash as a
side effect and the graph holds one quantization and one GEMM per group; tests/test_runtime_fuse.py checks the generated
code, and that neither a whole-model nor a per-layer compile recompiles). Leaving the members separate under compile is
no substitute: Inductor does not merge three identical quantizations and GEMMs of one input (measured on its generated
code: three `_scaled_mm`).
"""

from __future__ import annotations

import torch
from torch import nn

from . import kernels
from .fp8linear import DECODE_MAX_M, FP8Linear, hold
from .triton import act_quant

# What siblings share at prefill: "gemm" (one quantization and one fused GEMM; the members get
# strided slices of its output) or "quantization" (one quantized input, a GEMM per member,
# contiguous outputs). Measured on the H200 in one run (benchmarks/model_latency.py, Llama-3-8B
# shape, 32 layers, 2048 tokens, eager): "gemm" 46.99 ms (GPU busy 43.26), "quantization"
# 49.12 ms (GPU busy 40.16 ms, but the host fell behind), BF16 60.03 ms; compiled, "gemm" was
# 1.59x BF16 and "quantization" 1.50x (two runs). Decode always shares the fused GEMV.
PREFILL_SHARES = "gemm"
# Sibling projections that read one input, by the names transformers gives them.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"))


def lone_fp8(m: nn.Module | None) -> bool:
    """Whether `m` is an FP8Linear that holds its weight and runs its own GEMM (no group's member)."""
    return isinstance(m, FP8Linear) and m.weight is not None and m.group is None


def version(t: torch.Tensor) -> int:
    """t's in-place version counter, by which a hand-over checks that its tensor was not changed
    since; -2 for an inference tensor (made under torch.inference_mode), which has none and
    raises on `_version`: such a tensor is matched by identity alone."""
    return -2 if t.is_inference() else t._version


def _unlike(layers: list[FP8Linear]) -> bool:
    """Whether these FP8 layers differ in input size, activation scheme or dtype: then no one GEMM computes them."""
    first = layers[0]
    return any(
        l.in_features != first.in_features or l.activations != first.activations or l.dtype != first.dtype
        for l in layers
    )


def fuse_fp8(layers: list[FP8Linear]) -> FP8Linear:
    first = layers[0]
    if _unlike(layers):
        raise ValueError("only layers with the same input size, activation scheme and dtype can be fused")
    weight = torch.cat([l.weight for l in layers], dim=0)
    scales = [l.weight_scale.float() for l in layers]
    if first.block:  # whole blocks of rows (find_siblings checks it): the block scales stack
        scale = torch.cat(scales, dim=0)
    elif all(s.numel() == 1 for s in scales) and all(bool(s == scales[0]) for s in scales):
        scale = scales[0].clone()
    else:
        scale = torch.cat([s.reshape(-1, 1).expand(l.out_features, 1) for s, l in zip(scales, layers)], dim=0)
    input_scale = None
    if first.activations == "tensor":
        vals = {float(l.input_scale) for l in layers}
        if len(vals) != 1:
            raise ValueError(f"static input scales differ ({sorted(vals)}); layers sharing an input cannot be fused")
        input_scale = first.input_scale
    biases = [l.bias for l in layers]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [
                b if b is not None else torch.zeros(l.out_features, dtype=first.dtype, device=weight.device)
                for b, l in zip(biases, layers)
            ]
        )
    return FP8Linear.from_tensors(
        weight,
        scale,
        activations=first.activations,
        input_scale=input_scale,
        bias=bias,
        dtype=first.dtype,
        block=first.block,
    )


class FusedFP8(nn.Module):
    """One FP8 GEMM whose output is split back into the original layers' outputs (a layer stack
    of our own, as benchmarks/runtime.py builds; loaded models use SharedInput)."""

    def __init__(self, layers: list[FP8Linear]):
        super().__init__()
        self.sizes = [l.out_features for l in layers]
        self.inner = fuse_fp8(layers)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.inner(x).split(self.sizes, dim=-1)


class Stash:
    """What a SharedInput hands over between its members' calls, in a plain object: setting an
    attribute of an nn.Module runs Module.__setattr__ (checks for parameters, buffers and
    submodules), which cost more host time per eager prefill than the q/k/v GEMM's launch
    (cProfile on the H200 host: 112 calls, 1.6 ms of an 8-layer Llama-3-8B prefill). The pending
    call is one attribute, so that a compiled frame writes back one value per group at its end
    (dynamo replays every attribute a traced call changed, even one it changed back)."""

    def __init__(self):
        # (x, x._version when computed (-1 traced), what it computed for all, bit i: member i
        # has not taken its share yet), or None
        self.cur = None
        self.pre = None  # (x, x._version, (codes, scale)): x quantized by the op that made it
        self.hits = self.misses = 0

    def take_pre(self, x: torch.Tensor):
        """`pre` where it was made for exactly `x`, unmodified since, else None; taken once either way."""
        pre = self.pre
        if pre is None:
            return None
        self.pre = None
        return pre if pre[0] is x and pre[1] == version(x) else None


class SharedInput(nn.Module):
    """Members that read one input: one quantization and one GEMM (`inner`) for all of them."""

    def __init__(self, members: list[FP8Linear], names: list[str]):
        super().__init__()
        self.inner = fuse_fp8(members)
        self.names = list(names)
        self.sizes = [m.out_features for m in members]
        self.shared = True
        self._all = (1 << len(members)) - 1
        self.stash = Stash()
        start = 0
        for slot, m in enumerate(members):
            stop = start + m.out_features
            hold(m, "weight", self.inner.weight[start:stop])  # a view: the fused weight is the only copy
            if m.block:
                hold(m, "weight_scale", self.inner.weight_scale[start // m.block : stop // m.block])
            elif self.inner.weight_scale.numel() != 1 and m.weight_scale.numel() != 1:
                hold(m, "weight_scale", self.inner.weight_scale[start:stop])
            m.prepare()
            object.__setattr__(m, "group", self)  # a reference, not a submodule (no cycle, no double state_dict)
            object.__setattr__(m, "slot", slot)
            start = stop

    def hold_dense(self, members: list[FP8Linear]) -> None:
        """Where the fused layer runs a dense kernel that rounds its input (`dense_qact`, CPU):
        each member's dense weight becomes a view of the fused one, so the model holds one dense
        copy and a member called alone computes what it would have unfused."""
        start = 0
        for m in members:
            hold(m, "dense_weight", self.inner.dense_weight[start : start + m.out_features])
            m.set_kernels(**self.inner.kernels)  # dense everywhere: drops the member's view of the FP8 codes
            start += m.out_features

    def _shared(self, member: FP8Linear, x: torch.Tensor):
        """What the first member computes for all: the fused GEMM's output, split (decode, and
        prefill by default), or with PREFILL_SHARES = "quantization" at prefill the quantized
        input, on which each member runs its own GEMM (contiguous outputs: the model's
        elementwise ops on them ran ~3 ms less GPU time per 2048-token Llama-8B prefill, but the
        three GEMM launches cost more host time than that saved; see PREFILL_SHARES)."""
        x2 = x.reshape(-1, x.shape[-1])
        inner = self.inner
        if x2.shape[0] <= DECODE_MAX_M or inner.prefill_fn(x2.shape[0]) not in kernels.QUANTIZING:
            return "out", inner.project(x).split(self.sizes, dim=-1)
        x2 = x2 if x2.dtype == inner.dtype else x2.to(inner.dtype)
        if PREFILL_SHARES == "gemm":
            return "out", self.prefill_gemm(x, x2).view(*x.shape[:-1], -1).split(self.sizes, dim=-1)
        return "q", self.quantized_input(x, x2)

    @property
    def static_scale(self) -> torch.Tensor | None:
        return kernels.static_scale(self.inner)

    def quantized_input(self, x: torch.Tensor, x2: torch.Tensor):
        """(codes, scale) of the shared input x (x2: its 2-D view): handed over by the op that
        made it (eager_fusion.py), else quantized here."""
        return self.take_prequantized(x) or act_quant.quantize(x2, self.static_scale)

    def prefill_gemm(self, x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """The fused GEMM of all members at prefill: [M, sum of their outputs]."""
        return self.inner.prefill_fn(x2.shape[0])(self.inner, x2, self.quantized_input(x, x2))

    def quantizes(self, rows: int) -> bool:
        """Whether a call with this many rows starts by quantizing its input (so that an op which
        produced the input can hand it over already quantized: eager_fusion.py)."""
        return self.shared and rows > DECODE_MAX_M and self.inner.prefill_fn(rows) in kernels.QUANTIZING

    def take_prequantized(self, x: torch.Tensor):
        """The (codes, scale) stashed for exactly this tensor, unmodified since, once; else None."""
        if torch.compiler.is_compiling():  # traced code never stashes (eager_fusion runs the module's own forward)
            return None
        pre = self.stash.take_pre(x)
        return pre[2] if pre is not None else None

    @staticmethod
    def _take(member: FP8Linear, kind: str, value, x: torch.Tensor, slot: int) -> torch.Tensor:
        if kind == "out":
            return value[slot]
        x2 = x.reshape(-1, x.shape[-1])
        return member.prefill_fn(x2.shape[0])(member, x2, value).view(*x.shape[:-1], member.out_features)

    def _traced(self, member: FP8Linear, x: torch.Tensor) -> torch.Tensor:
        """The same hand-over while dynamo traces: no counters and no `_version` (each would be a
        guard that changes on every call); the stash is empty again once the last member took
        its share, so the module's state at the end of a call is what it was at the start."""
        slot, st = member.slot, self.stash
        cur = st.cur
        if cur is not None and cur[0] is x and cur[3] >> slot & 1:
            pending = cur[3] & ~(1 << slot)
            st.cur = (x, -1, cur[2], pending) if pending else None
            return self._take(member, *cur[2], x, slot)
        out = self._shared(member, x)
        st.cur = (x, -1, out, self._all & ~(1 << slot))
        return self._take(member, *out, x, slot)

    def member_forward(self, member: FP8Linear, x: torch.Tensor) -> torch.Tensor:
        slot = member.slot
        if torch.compiler.is_compiling():
            return self._traced(member, x)
        st = self.stash
        cur = st.cur
        if cur is not None and cur[0] is x and cur[1] == version(x) and cur[3] >> slot & 1:
            pending = cur[3] & ~(1 << slot)
            st.cur = (x, cur[1], cur[2], pending) if pending else None
            st.hits += 1
            return self._take(member, *cur[2], x, slot)
        if cur is not None:  # another input came while members still waited for theirs
            st.misses += 1
            if st.misses > 2 * st.hits + 2:
                self.shared = False
        if not self.shared:
            st.cur = None
            return member.project(x)
        out = self._shared(member, x)
        st.cur = (x, version(x), out, self._all & ~(1 << slot))
        return self._take(member, *out, x, slot)


def find_siblings(model: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """(parent, member names) for every group of sibling FP8 layers that can share their input."""
    found = []
    for parent in model.modules():
        for names in SIBLINGS:
            mods = [parent._modules.get(n) for n in names]
            if not all(lone_fp8(m) for m in mods):
                continue
            first = mods[0]
            if _unlike(mods):
                continue
            if any(m.block != first.block or (m.block and m.out_features % m.block) for m in mods):
                continue  # block scales stack only in whole blocks of rows
            if first.activations == "tensor" and len({float(m.input_scale) for m in mods}) != 1:
                continue  # a static scheme needs one scale for the shared input
            found.append((parent, list(names)))
    return found


def group_name(names) -> str:
    """The attribute a group of these members is attached under on their parent."""
    return "fused_" + "_".join(names)


def share_inputs(model: nn.Module) -> list[SharedInput]:
    """Group every set of sibling FP8 layers of `model` (attached to their parent as
    `fused_<names>`); returns the groups."""
    groups = []
    for parent, names in find_siblings(model):
        group = SharedInput([parent._modules[n] for n in names], names)
        parent.add_module(group_name(names), group)
        groups.append(group)
    return groups


def unshare(parent: nn.Module, group: SharedInput) -> None:
    """Undo one group (its members keep their views of the fused weight and compute alone)."""
    for n in group.names:
        object.__setattr__(parent._modules[n], "group", None)
    del parent._modules[group_name(group.names)]
