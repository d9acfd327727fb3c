"""FP8Linear: an nn.Linear replacement that keeps e4m3 weights and runs the kernel chosen for it.

Why a module of our own: transformers' compressed-tensors path needs the compressed-tensors
package (absent on many GPU stacks) and runs one kernel for every shape. Here the weight stays
FP8 in device memory (half of BF16), and each layer runs the kernel the policy measured fastest
for its shape: one for decode (few tokens, `M <= DECODE_MAX_M`) and one per prefill length bucket
(`PREFILL_BUCKETS`: a call of M rows runs the kernel measured at the smallest bucket >= M), so
that no caller has to say which prompt length to tune for.
On CPU the weight is dequantized once at load and the layer runs BF16 (FP8 matmul on CPU is
orders of magnitude slower), and then no FP8 copy is kept. On a device where this torch has no
float8 (MPS before torch 2.15) the codes are held as their bytes (uint8) and only the kernels that
decode them bit by bit are offered (dequant, bf16: kernels.candidates).

A call costs little host time, because eager prefill runs one Python call per layer: the kernel
functions are stored on the layer (no lookup by name), and every scale is prepared once
in the layout its kernel takes (`scale_row` [1, N], `scale_flat`, 0-d views for tensor-wise
scaling), so nothing is reshaped, expanded or made contiguous per call. Layers that read the
same input (q/k/v, gate/up) can share one quantization and one GEMM: see fuse.py.
"""

from __future__ import annotations

import torch
from torch import nn

from ...format.fp8 import CODE_DTYPES, FP8_DTYPE, dequantize, is_block_scale
from ...format.scales import DEFAULT_BLOCK, scale_shape
from . import kernels

# Activations with at most this many rows (tokens x batch) use the decode kernel.
DECODE_MAX_M = 4
PROBE_ROWS = 2 * DECODE_MAX_M + 1  # a prefill-sized call (rows > DECODE_MAX_M), small: the load's checks and warm-up
# Prefill buckets, by the most rows each takes; longer calls take the last. The policy measures
# each bucket at its bound: the fastest kernel changes with M (on the H200 a default load tuned
# for 512 rows lost a third of the FP8 speed-up at 2048; docs/benchmarks.md).
PREFILL_BUCKETS = (16, 128, 512, 2048, 8192)
BUCKETS = ("decode", "prefill")


def bucket_index(rows: int) -> int:
    """The prefill bucket a call of `rows` rows (> DECODE_MAX_M) falls in."""
    for i, bound in enumerate(PREFILL_BUCKETS):
        if rows <= bound:
            return i
    return len(PREFILL_BUCKETS) - 1


def hold(mod: nn.Module, name: str, t: torch.Tensor | None) -> None:
    """Keep `t` as mod's `name`: a frozen nn.Parameter (requires_grad=False), not a buffer.

    Why: torch.compile's warm-guard stance (`skip_guard_eval_unsafe`, what validate and the benchmarks time decode
    under) still checks, on every call, the metadata of every tensor the graph reads that is not an nn.Parameter. As
    buffers, the e4m3 weights and scales of a Llama-3-8B are ~450 such checks per decode step: 1.4 ms of host time on
    an H200 host where BF16's whole step takes 0.46 ms (benchmarks/results/decode_host_h200_llama32.log); on CPU a
    32-layer compiled frame costs ~690 us per call with buffers, ~250 with parameters (BF16: 108). Parameters keep
    their address under CUDA graphs, as buffers do."""
    if name in mod._buffers:
        del mod._buffers[name]
        mod._non_persistent_buffers_set.discard(name)
    mod._parameters[name] = (
        None if t is None else t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)
    )


def signature(n: int, k: int, weights: str, activations: str | None, block: int | None) -> tuple:
    """The kernel policy's key for layers of this shape and scheme (FP8Linear.signature; the load's
    warm-up child asks the policy's cache with it before any layer exists)."""
    return (n, k, f"block{block}" if block else weights, activations)


class FP8Linear(nn.Module):
    """y = x @ (weight * weight_scale).T + bias, with weight e4m3 codes (float8_e4m3fn, or uint8 bytes)."""

    group = None  # fuse.SharedInput this layer belongs to (set there, not a submodule)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        weights: str,
        activations: str | None,
        bias: bool,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        block: int | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weights, self.activations, self.dtype = weights, activations, dtype
        self.block = (block or DEFAULT_BLOCK) if weights == "block" else None
        hold(self, "weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device))
        hold(
            self,
            "weight_scale",
            torch.ones(
                scale_shape(weights, out_features, in_features, self.block or DEFAULT_BLOCK),
                dtype=torch.float32,
                device=device,
            ),
        )
        hold(
            self, "input_scale", torch.ones(1, dtype=torch.float32, device=device) if activations == "tensor" else None
        )
        hold(self, "bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        hold(self, "dense_weight", None)  # a BF16 copy made once, only where a dense kernel runs
        self.kernels = {"decode": "dequant", "prefill": "dequant"}
        self._decode_fn, self._prefill_fns = kernels.dequant, (kernels.dequant,) * len(PREFILL_BUCKETS)
        self.prepare()

    @classmethod
    def from_tensors(
        cls,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        *,
        activations: str | None,
        input_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
        block: int | None = None,
    ) -> "FP8Linear":
        """Wrap loaded tensors (already on their device) without copying the FP8 weight (e4m3 codes,
        as float8_e4m3fn or as their uint8 bytes); `block`: the block edge of a block scale
        [ceil(N/b), ceil(K/b)]."""
        if weight.dtype not in CODE_DTYPES:
            raise TypeError(
                f"FP8Linear needs e4m3 codes (float8_e4m3fn, or their uint8 bytes) as weight, got {weight.dtype}"
            )
        n, k = weight.shape
        if is_block_scale(weight_scale, n) and block is None:
            raise ValueError(f"a {list(weight_scale.shape)} block scale needs its block size")
        # with `block`, a [1, 1] scale is still one block (and its activations are per group)
        weights = "block" if block else "tensor" if weight_scale.numel() == 1 else "row"
        mod = cls(
            k,
            n,
            weights=weights,
            activations=activations,
            bias=bias is not None,
            dtype=dtype,
            device="meta",
            block=block,
        )
        hold(mod, "weight", weight)
        hold(mod, "weight_scale", weight_scale.float().reshape(mod.weight_scale.shape).contiguous())
        if activations == "tensor":
            if input_scale is None:
                raise ValueError("the static scheme needs an input_scale")
            hold(mod, "input_scale", input_scale.float().reshape(1).to(weight.device))
        hold(mod, "bias", None if bias is None else bias.to(device=weight.device, dtype=dtype))
        mod.prepare()
        return mod

    def prepare(self) -> None:
        """Derive the scale layouts the kernels take (views where the layout allows), once. They
        are parameters too (`hold`), so they are in state_dict beside the stored tensors."""
        ws = self.weight_scale
        if self.block:  # per-block: no row or tensor view; the blockwise GEMM's layout instead
            hold(self, "scale_blocks_t", kernels.blockwise_weight_scale(ws))
            return
        row = (
            ws.reshape(1, -1)
            if ws.numel() == self.out_features
            else ws.reshape(1, 1).expand(1, self.out_features).contiguous()
        )
        for name, value in (
            ("scale_row", row),
            ("scale_flat", ws.reshape(-1)),
            ("scale_0d", ws.reshape(-1)[0] if ws.numel() == 1 else None),
            ("input_scale_0d", self.input_scale.reshape(()) if self.input_scale is not None else None),
        ):
            hold(self, name, value)

    @property
    def signature(self) -> tuple:
        """What determines the kernel choice: shape, scale granularity (and block), activation scheme."""
        return signature(self.out_features, self.in_features, self.weights, self.activations, self.block)

    def set_kernels(self, decode: str, prefill: str | dict) -> None:
        """Install the chosen kernels: `prefill` one kernel for every prefill length, or
        {bucket bound: kernel} for each of PREFILL_BUCKETS. 'bf16' everywhere replaces the FP8
        weight by a dense one."""
        per = [prefill] * len(PREFILL_BUCKETS) if isinstance(prefill, str) else [prefill[b] for b in PREFILL_BUCKETS]
        for k in (decode, *per):
            if k not in kernels.KERNELS:
                raise ValueError(f"unknown kernel {k!r}")
        if decode in kernels.DENSE and all(k in kernels.DENSE for k in per):
            if self.dense_weight is None:
                hold(self, "dense_weight", dequantize(self.weight, self.weight_scale, self.dtype, self.block))
            self.weight = None  # no FP8 copy kept beside the dense one
        elif decode in kernels.DENSE or any(k in kernels.DENSE for k in per):
            raise ValueError(
                "bf16 for some buckets only would keep two copies of the weight; choose FP8 kernels or bf16 for all"
            )
        elif self.weight is None:
            raise ValueError("this layer's FP8 weight was already replaced by a dense BF16 one")
        self.kernels = {"decode": decode, "prefill": per[0] if len(set(per)) == 1 else dict(zip(PREFILL_BUCKETS, per))}
        self._decode_fn, self._prefill_fns = kernels.FNS[decode], tuple(kernels.FNS[k] for k in per)

    def prefill_fn(self, rows: int):
        """The kernel of a prefill-sized call of `rows` rows."""
        return self._prefill_fns[bucket_index(rows)]

    @property
    def prefill_quantizes(self) -> bool:
        """Whether every prefill bucket's kernel takes an input quantized once for several layers."""
        return all(f in kernels.QUANTIZING for f in self._prefill_fns)

    def weight_bytes(self) -> int:
        tensors = [self.weight, self.weight_scale, self.input_scale, self.bias, self.dense_weight]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            return self.group.member_forward(self, x)
        return self.project(x)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """This layer's own product, with the kernel of the bucket x's row count falls in."""
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        rows = x2.shape[0]
        fn = self._decode_fn if rows <= DECODE_MAX_M else self._prefill_fns[bucket_index(rows)]
        return fn(self, x2).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, weights={self.weights}, "
            f"activations={self.activations}, decode={self.kernels['decode']}, prefill={self.kernels['prefill']}"
        )
