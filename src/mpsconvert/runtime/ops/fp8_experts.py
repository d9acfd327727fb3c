"""FP8 MoE experts that run every expert of a layer in one grouped matmul.

`FP8Experts` stands in for a transformers 5 experts module (`forward(hidden, top_k_index,
top_k_weights)`), holding the layer's expert weights as e4m3 codes `[E, N, K]` plus per-expert
scales. Token-expert pairs are sorted by expert and the group offsets (a cumulative histogram)
stay on the device, so one kernel covers all experts without a host sync or a Python loop.

Paths, chosen once per module from the device and the torch build, and reported:
- "scaled_grouped_mm": CUDA SM90+ with `torch._scaled_grouped_mm`; FP8 x FP8 with row-wise
  scales (activations: per token dynamic, or the expert's static scale per row).
- "triton_gemv" (decode, CUDA + triton, at most `decode_pairs` token-expert pairs): one
  kernel reads only the routed experts' FP8 rows and dequantizes them in registers against
  BF16 activations (no activation quantization: it is the memory-bound case).
- "grouped_mm": elsewhere (CPU, MPS, CUDA without the FP8 kernel, weight-only scheme): the
  weights are dequantized once at load, activations are fake-quantized exactly as the FP8
  path would, and `F.grouped_mm` / `torch._grouped_mm` runs the groups; a per-expert loop
  only where the build has no grouped matmul for the device ("loop").

One copy of the weights: on those two paths the dense weights replace the codes (CPU, MPS: as
much memory as BF16 experts, not codes plus dense, 1.5x), except where the decode GEMV still
reads the codes (CUDA with Triton and no FP8 grouped GEMM, e.g. the weight-only scheme), which
keeps both; `paths["weights"]` says which. Codes may be held as uint8 bytes (a device without
float8: devices.Capabilities.code_dtype); dequantizing them decodes bit by bit.

Block-scaled experts (FP8_BLOCK, DeepSeek / Qwen3-MoE FP8 releases) take the "grouped_mm" path on
every device: no grouped FP8 kernel takes block scales (`_scaled_grouped_mm` is row-wise only),
so their weights are dequantized once at load, and activations are fake-quantized per token and
group of the block edge, as the format says. Their scales are kept expanded along the rows
([E, N, ceil(K/b)]), so gate and up slices of any size assemble into one fused tensor.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ArtifactError
from ...format import fp8
from . import triton as tritonlib
from .fp8linear import hold
from .triton import act_quant

FP8 = fp8.FP8_DTYPE
DECODE_PAIRS = 16  # token-expert pairs at or below which the GEMV kernel beats a grouped GEMM


def grouped_mm_fn():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a grouped matmul runs on this device for this dtype (probed, not assumed)."""
    fn = grouped_mm_fn()
    if fn is None:
        return False
    try:
        a = torch.zeros(4, 16, dtype=dtype, device=device)
        b = torch.zeros(2, 16, 16, dtype=dtype, device=device)
        fn(a, b, offs=torch.tensor([2, 4], dtype=torch.int32, device=device))
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def scaled_grouped_mm_available(device: torch.device) -> bool:
    """FP8 x FP8 grouped matmul with row-wise scales: CUDA SM90+ builds (probed once)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    if torch.cuda.get_device_capability(device) < (9, 0):
        return False
    key = str(device)
    if key not in _PROBED:
        try:
            a = torch.zeros(32, 32, dtype=FP8, device=device)
            b = torch.zeros(2, 32, 32, dtype=FP8, device=device).transpose(-2, -1)
            offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
            torch._scaled_grouped_mm(
                a,
                b,
                torch.ones(32, device=device),
                torch.ones(2, 32, device=device),
                offs=offs,
                out_dtype=torch.bfloat16,
            )
            _PROBED[key] = True
        except (RuntimeError, NotImplementedError, TypeError) as e:
            _PROBED[key] = False
            warnings.warn(
                f"torch._scaled_grouped_mm is present but failed on {device} "
                f"({str(e).splitlines()[0][:120]}): FP8 experts run the dequantized grouped_mm path",
                stacklevel=2,
            )
    return _PROBED[key]


_PROBED: dict[str, bool] = {}


def quantize_rows(x: torch.Tensor, scale: torch.Tensor | None):
    """BF16 rows -> (e4m3 codes, float32 row scale [S]): per token (scale None) or the given
    per-row static scale (act_quant: one Triton kernel on CUDA in eager mode)."""
    q, s = act_quant.quantize(x, rows_scale=scale)
    return q, s.reshape(-1)


def _is_silu(fn) -> bool:
    return fn is F.silu or isinstance(fn, nn.SiLU)


def fake_quantize_rows(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The values the FP8 path multiplies: x through e4m3 with its row scale."""
    return fp8.fake_quantize(x, fp8.per_token_scale(x) if scale is None else scale[:, None])


def fake_quantize_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x through e4m3 per token and group of `group` features (FP8_BLOCK activations)."""
    k = x.shape[-1]
    s = fp8.per_group_scale(x, group).repeat_interleave(group, dim=-1)[..., :k]
    return fp8.fake_quantize(x, s)


@dataclass
class Route:
    """Token-expert pairs sorted by expert, with device-side group offsets."""

    expert_ids: torch.Tensor  # [S] sorted
    token_ids: torch.Tensor  # [S] token of each sorted pair
    weights: torch.Tensor  # [S] routing weight of each sorted pair
    perm: torch.Tensor  # [S] position in the flattened [T*k] order
    offsets: torch.Tensor  # [E] int32 cumulative counts

    @classmethod
    def make(cls, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int) -> "Route":
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        expert_ids, perm = torch.sort(flat, stable=True)
        hist_in = expert_ids.float() if flat.device.type in ("cpu", "mps") else expert_ids.int()
        counts = torch.histc(hist_in, bins=num_experts, min=0, max=num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return cls(expert_ids, perm // k, top_k_weights.reshape(-1)[perm], perm, offsets)


class FP8Experts(nn.Module):
    """All experts of one MoE layer in FP8: gate_up [E, 2I, H] and down [E, H, I] codes.

    path / decode_path: forced where given (tests), else chosen from the device ("auto")."""

    def __init__(
        self,
        gate_up: torch.Tensor,
        gate_up_scale: torch.Tensor,
        down: torch.Tensor,
        down_scale: torch.Tensor,
        act_fn,
        activations: str | None = "token",
        gate_up_input_scale: torch.Tensor | None = None,
        down_input_scale: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
        path: str | None = None,
        decode_pairs: int = DECODE_PAIRS,
        decode_path: str | None = "auto",
        block: int | None = None,
    ):
        super().__init__()
        if activations not in ("token", "tensor", None) and not (block and activations == "group"):
            raise ValueError(
                f"activations must be 'token', 'tensor' or None ('group' with block scales), got {activations!r}"
            )
        if activations == "tensor" and (gate_up_input_scale is None or down_input_scale is None):
            raise ArtifactError(
                "static FP8 experts need gate_up and down input scales", "re-run calibration for the experts"
            )
        self.num_experts, n13, self.hidden_dim = gate_up.shape
        self.intermediate_dim = n13 // 2
        self.act_fn = act_fn
        self.activations = activations
        self.dtype = dtype
        self.decode_pairs = decode_pairs
        device = gate_up.device
        E = self.num_experts
        self.block = block
        hold(self, "gate_up_codes", gate_up.contiguous())  # frozen parameters, not buffers: fp8linear.hold says why
        hold(self, "down_codes", down.contiguous())
        if block:  # [E, N, ceil(K/b)]: block scales expanded along the rows (see the module docstring)
            hold(self, "gate_up_scale", gate_up_scale.float().reshape(E, n13, -1).contiguous())
            hold(self, "down_scale", down_scale.float().reshape(E, self.hidden_dim, -1).contiguous())
        else:  # Row scales [E, N] (a per-tensor scale is expanded: one layout for every kernel).
            hold(self, "gate_up_scale", gate_up_scale.float().reshape(E, -1).expand(E, n13).contiguous())
            hold(self, "down_scale", down_scale.float().reshape(E, -1).expand(E, self.hidden_dim).contiguous())
        for name, s in (("gate_up_input_scale", gate_up_input_scale), ("down_input_scale", down_input_scale)):
            hold(self, name, None if s is None else s.float().reshape(E).to(device).contiguous())
        if block and path not in (None, "grouped_mm", "loop"):
            raise ValueError(f"block-scaled experts run the dequantized grouped_mm path, not {path!r}")
        self.path = path or (
            ("grouped_mm" if grouped_mm_available(device, dtype) else "loop") if block else self.choose_path(device)
        )
        self.decode_path = None if block else self._choose_decode_path(device) if decode_path == "auto" else decode_path
        dense = self.path in ("grouped_mm", "loop")
        for which in ("gate_up", "down"):
            # Dequantize once: the device has no FP8 grouped kernel (or the scheme keeps BF16
            # activations), and dequantizing on every call would cost more than BF16. The codes
            # go then, unless the decode GEMV reads them.
            hold(
                self,
                f"{which}_dense",
                self._dense(getattr(self, f"{which}_codes"), getattr(self, f"{which}_scale")) if dense else None,
            )
            if dense and self.decode_path is None:
                hold(self, f"{which}_codes", None)

    def dequantized(self, which: str) -> torch.Tensor:
        """The dense [E, N, K] weight of "gate_up" or "down": the one held, or made from the codes."""
        dense = getattr(self, f"{which}_dense")
        return (
            dense
            if dense is not None
            else self._dense(getattr(self, f"{which}_codes"), getattr(self, f"{which}_scale"))
        )

    def _dense(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """codes [E, N, K] x their scales -> [E, N, K] in self.dtype, one expert at a time: the
        float32 temporaries of all experts at once were ~10 bytes per weight (fp8.dequantize)."""
        out = torch.empty(codes.shape, dtype=self.dtype, device=codes.device)
        k = codes.shape[-1]
        for e in range(codes.shape[0]):
            s = scale[e].repeat_interleave(self.block, dim=-1)[:, :k] if self.block else scale[e][:, None]
            out[e] = fp8.fp8_to_float(codes[e]) * s
        return out

    def fake_quantize(self, x: torch.Tensor, row_scale: torch.Tensor | None) -> torch.Tensor:
        """The activations the FP8 path multiplies: per token, per group (block scales) or static."""
        if self.activations == "group":
            return fake_quantize_groups(x, self.block)
        return fake_quantize_rows(x, row_scale)

    def choose_path(self, device: torch.device) -> str:
        if self.activations is not None and scaled_grouped_mm_available(device):
            return "scaled_grouped_mm"
        return "grouped_mm" if grouped_mm_available(device, self.dtype) else "loop"

    def _choose_decode_path(self, device: torch.device) -> str | None:
        return "triton_gemv" if device.type == "cuda" and tritonlib.available() else None

    @property
    def paths(self) -> dict:
        held = (
            [f"e4m3 codes ({str(self.gate_up_codes.dtype).replace('torch.', '')})"]
            if self.gate_up_codes is not None
            else []
        )
        held += (
            [f"{str(self.dtype).replace('torch.', '')} (dequantized at load)"] if self.gate_up_dense is not None else []
        )
        return {
            "grouped": self.path,
            "decode": self.decode_path,
            "decode_pairs": self.decode_pairs if self.decode_path else None,
            "weights": " + ".join(held),
        }

    # -- forward ------------------------------------------------------------------------------

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        T, H = hidden_states.shape
        k = top_k_index.shape[-1]
        x = hidden_states.to(self.dtype)
        if self.decode_path and T * k <= self.decode_pairs and not tritonlib.held():
            return self._forward_gemv(x, top_k_index, top_k_weights).to(hidden_states.dtype)
        route = Route.make(top_k_index, top_k_weights, self.num_experts)
        if self.path == "scaled_grouped_mm":
            y = self._forward_fp8(x, route)
        else:
            h = self._project(x[route.token_ids], route, "gate_up")
            gate, up = h.chunk(2, dim=-1)
            y = self._project(self.act_fn(gate) * up, route, "down")
        y = y * route.weights[:, None].to(y.dtype)
        out = torch.zeros(T * k, H, dtype=y.dtype, device=y.device)
        out[route.perm] = y
        return out.view(T, k, H).sum(dim=1).to(hidden_states.dtype)

    def _forward_fp8(self, x: torch.Tensor, route: Route) -> torch.Tensor:
        """FP8 x FP8 grouped GEMMs. Dynamic activations are quantized per token before the
        gather (each token once, not once per expert it is routed to, and the gather then moves
        codes instead of BF16), and SiLU(gate) * up is quantized in the same kernel that computes
        it, so the product never goes to memory in BF16."""
        static = self.activations == "tensor"
        if static:  # each expert has its own input scale: quantized after the gather
            q, s = act_quant.quantize(x[route.token_ids], rows_scale=self.gate_up_input_scale[route.expert_ids])
        else:
            q, s = act_quant.quantize(x)
            q, s = q[route.token_ids], s[route.token_ids]
        h = self._scaled_grouped_mm(q, s, route, "gate_up")
        rows = self.down_input_scale[route.expert_ids] if static else None
        if _is_silu(self.act_fn):
            q, s = act_quant.silu_mul_quantize(h, rows_scale=rows)
        else:
            gate, up = h.chunk(2, dim=-1)
            q, s = act_quant.quantize(self.act_fn(gate) * up, rows_scale=rows)
        return self._scaled_grouped_mm(q, s, route, "down")

    def _scaled_grouped_mm(self, q: torch.Tensor, s: torch.Tensor, route: Route, which: str) -> torch.Tensor:
        """e4m3 rows q (row scales s, grouped by expert as `route` orders them) times `which`'s
        ("gate_up" or "down") expert codes, in the module's dtype."""
        return torch._scaled_grouped_mm(
            q,
            getattr(self, f"{which}_codes").transpose(-2, -1),
            s.reshape(-1),
            getattr(self, f"{which}_scale"),
            offs=route.offsets,
            out_dtype=self.dtype,
            use_fast_accum=True,
        )

    def _project(self, x: torch.Tensor, route: Route, which: str) -> torch.Tensor:
        in_scale = getattr(self, f"{which}_input_scale")
        row_scale = in_scale[route.expert_ids] if self.activations == "tensor" else None
        if self.activations is not None:
            x = self.fake_quantize(x, row_scale)
        w = getattr(self, f"{which}_dense")
        if self.path == "grouped_mm":
            return grouped_mm_fn()(x, w.transpose(-2, -1), offs=route.offsets)
        return _loop_mm(x, w, route)

    def _forward_gemv(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        from .triton import moe_gemv as moe_triton

        T, H = x.shape
        k = top_k_index.shape[-1]
        ids = top_k_index.reshape(-1).to(torch.int32)
        tok = torch.arange(T, device=x.device, dtype=torch.int32).repeat_interleave(k)
        pair = torch.arange(T * k, device=x.device, dtype=torch.int32)
        if _is_silu(self.act_fn):  # SiLU * up inside the down GEMV's load: no product kernel, no cast between the GEMVs
            h = moe_triton.expert_gemv(x, tok, ids, self.gate_up_codes, self.gate_up_scale, out_dtype=torch.float32)
            y = moe_triton.expert_gemv(
                h, pair, ids, self.down_codes, self.down_scale, torch.float32, silu_dtype=self.dtype
            )
            y = y.to(self.dtype)  # outside the op: Inductor folds the cast into the weighted sum below
        else:
            gate, up = moe_triton.expert_gemv(x, tok, ids, self.gate_up_codes, self.gate_up_scale).chunk(2, dim=-1)
            y = moe_triton.expert_gemv(
                (self.act_fn(gate) * up).to(self.dtype), pair, ids, self.down_codes, self.down_scale
            )
        y = y.view(T, k, H) * top_k_weights.view(T, k, 1).to(y.dtype)
        return y.sum(dim=1)


def _loop_mm(x: torch.Tensor, w: torch.Tensor, route: Route) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, stop in enumerate(route.offsets.tolist()):
        if stop > start:
            out[start:stop] = x[start:stop] @ w[e].T
        start = stop
    return out


def reference_forward(
    mod: FP8Experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
):
    """The per-expert Python loop with the same numerics (dequantized weights, the same
    activation quantization): what the grouped path must reproduce."""
    x = hidden_states.to(mod.dtype)
    out = torch.zeros(x.shape[0], mod.hidden_dim, dtype=torch.float32, device=x.device)
    w13, w2 = mod.dequantized("gate_up"), mod.dequantized("down")
    for e in range(mod.num_experts):
        tok, slot = torch.where(top_k_index == e)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        if mod.activations is not None:
            s = mod.gate_up_input_scale[e].expand(tok.numel()) if mod.activations == "tensor" else None
            xe = mod.fake_quantize(xe, s)
        gate, up = (xe @ w13[e].T).chunk(2, dim=-1)
        h = mod.act_fn(gate) * up
        if mod.activations is not None:
            s = mod.down_input_scale[e].expand(tok.numel()) if mod.activations == "tensor" else None
            h = mod.fake_quantize(h, s)
        y = h @ w2[e].T
        out.index_add_(0, tok, (y * top_k_weights[tok, slot, None].to(y.dtype)).float())
    return out.to(hidden_states.dtype)


def expert_bytes(mod: FP8Experts) -> int:
    """Bytes the experts hold: codes, scales and dense weights, whichever are kept."""
    return sum(b.numel() * b.element_size() for b in mod.parameters())


__all__ = [
    "FP8Experts",
    "reference_forward",
    "grouped_mm_available",
    "scaled_grouped_mm_available",
]
