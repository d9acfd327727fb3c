"""FP8 e4m3 math: scales, the clamp-then-cast, dequantization and error, on any float tensor.

Scales are dequantization multipliers (`w ~= fp8 * scale`, `scale = amax / 448`), as
compressed-tensors and vLLM read them. `torch.Tensor.to(float8_e4m3fn)` does not saturate, so
values are clamped to +-448 first. Work is done in row chunks that stay in cache, because on
CPU the conversion is memory-bound and a whole-tensor float32 copy would double peak memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import QuantizationError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Floor for the scale of an all-zero row or tensor: its codes are all zero, and the scale
# stays a finite positive number that no reader divides by zero with.
SCALE_FLOOR = 1e-12
_CHUNK_ELEMS = 1 << 18

GRANULARITIES = ("tensor", "row")


@dataclass(frozen=True)
class QuantStats:
    """What one tensor's quantization did: recorded in the manifest and the summary."""

    amax: float
    scale_min: float
    scale_max: float
    sqnr_db: float  # signal-to-quantization-noise ratio; inf for an exactly representable tensor
    zero_rows: int
    sqnr_rows: int  # rows the SQNR was measured on (all rows up to 2**20 elements)

    def as_dict(self) -> dict:
        return {
            "amax": self.amax,
            "scale_min": self.scale_min,
            "scale_max": self.scale_max,
            "sqnr_db": None if math.isinf(self.sqnr_db) else round(self.sqnr_db, 4),
            "zero_rows": self.zero_rows,
            "sqnr_rows": self.sqnr_rows,
        }


def fp8_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decode e4m3 codes to float32 exactly.

    PyTorch's CPU float8->float cast is ~5x slower than this bit move: e4m3's exponent and
    mantissa bits land in fp16's positions (s.eeee.mmm -> s.0eeee.mmm0000000), which reads as
    the e4m3 value times 2**-8, subnormals included. NaN codes (0x7f/0xff) never occur because
    we clamp before casting.
    """
    if codes.device.type != "cpu":
        return codes.float()
    b = codes.view(torch.uint8).to(torch.int16)
    h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return h.view(torch.float16).float().mul_(256.0)


def _check_finite(amax: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(amax).all()):
        raise QuantizationError(
            f"tensor {name!r} contains NaN or inf values",
            "fix the source checkpoint, or pass --ignore with this module to keep it unquantized",
        )


def row_amax(w: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """Per-row absolute maximum of a 2-D tensor as float32 [N, 1], chunked."""
    n, k = w.shape
    out = torch.empty(n, 1, dtype=torch.float32, device=w.device)
    step = max(1, _CHUNK_ELEMS // max(k, 1))
    for i in range(0, n, step):
        out[i : i + step] = w[i : i + step].abs().amax(dim=1, keepdim=True).float()
    _check_finite(out, name)
    return out


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """scale = amax / 448, floored so that all-zero rows get a valid positive scale."""
    return (amax.float() / FP8_MAX).clamp_(min=SCALE_FLOOR)


def quantize(
    w: torch.Tensor, granularity: str = "row", name: str = "tensor", scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, QuantStats]:
    """Quantize a 2-D float weight [N, K] to e4m3 codes plus its dequant scale, with error stats.

    `scale` may be given (e.g. a calibrated or shared scale); it must broadcast to [N, 1].
    Row scales are computed chunk by chunk in the same pass as the cast. The SQNR is exact for
    tensors up to 2**20 elements and measured on evenly spaced rows (about 2**20 elements)
    beyond that: decoding every code again would double the cost of a conversion on CPU.
    """
    if w.ndim != 2:
        raise QuantizationError(f"tensor {name!r} has shape {tuple(w.shape)}, expected 2-D [out, in]")
    if not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise QuantizationError(f"tensor {name!r} has dtype {w.dtype}, expected a float weight")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    n, k = w.shape
    fused_amax = scale is None and granularity == "row"
    rows_amax = row_amax(w, name) if scale is None and granularity == "tensor" else None
    if rows_amax is not None:
        scale = scales_from_amax(rows_amax.amax().reshape(1))
    if scale is not None:
        scale = scale.float().to(w.device)
        row_scale = scale.reshape(-1, 1).expand(n, 1) if scale.numel() == 1 else scale.reshape(n, 1)
    else:
        scale = row_scale = torch.empty(n, 1, dtype=torch.float32, device=w.device)
    q = torch.empty(n, k, dtype=FP8_DTYPE, device=w.device)
    step = max(1, _CHUNK_ELEMS // max(k, 1))
    amax_max = torch.zeros((), dtype=torch.float32, device=w.device)
    zero_rows = 0
    for i in range(0, n, step):
        wf = w[i : i + step].float()
        a = rows_amax[i : i + step] if rows_amax is not None else wf.abs().amax(dim=1, keepdim=True)
        if fused_amax:
            _check_finite(a, name)
            row_scale[i : i + step] = scales_from_amax(a)
        amax_max = torch.maximum(amax_max, a.max())
        zero_rows += int((a == 0).sum())
        t = wf / row_scale[i : i + step]
        t.clamp_(-FP8_MAX, FP8_MAX)
        q[i : i + step] = t.to(FP8_DTYPE)
    _check_finite(amax_max, name)
    sqnr, sampled = _sqnr(w, q, row_scale)
    stats = QuantStats(
        amax=float(amax_max),
        scale_min=float(scale.min()),
        scale_max=float(scale.max()),
        sqnr_db=sqnr,
        zero_rows=zero_rows,
        sqnr_rows=sampled,
    )
    return q, scale.reshape(1) if scale.numel() == 1 else scale.reshape(n, 1), stats


_SQNR_ELEMS = 1 << 20


def _sqnr(w: torch.Tensor, q: torch.Tensor, row_scale: torch.Tensor) -> tuple[float, int]:
    """10*log10(|w|^2 / |w - dequant(q)|^2) over all rows, or evenly spaced rows of a large tensor."""
    n, k = w.shape
    stride = max(1, (n * k) // _SQNR_ELEMS)
    if stride > 1:
        w, q, row_scale = w[::stride], q[::stride], row_scale[::stride]
    wf = w.float()
    d = fp8_to_float(q).mul_(row_scale).sub_(wf)
    sig = float(torch.dot(wf.view(-1), wf.view(-1)))
    err = float(torch.dot(d.view(-1), d.view(-1)))
    if err == 0.0:
        return math.inf, w.shape[0]
    if sig == 0.0:
        return -math.inf, w.shape[0]
    return 10.0 * math.log10(sig / err), w.shape[0]


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp8 codes [N, K] times scale ([1] or [N, 1]) -> dense weight in `dtype`."""
    return (fp8_to_float(q) * scale.float().reshape(-1, 1)).to(dtype)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round-trip x through e4m3 with a given dequant scale (for simulated activations)."""
    return ((x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale).to(x.dtype)


def per_token_scale(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token activation scale: amax over the last dim / 448, floored."""
    return scales_from_amax(x.abs().amax(dim=-1, keepdim=True))
