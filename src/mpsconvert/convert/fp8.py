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

    def as_dict(self) -> dict:
        return {
            "amax": self.amax,
            "scale_min": self.scale_min,
            "scale_max": self.scale_max,
            "sqnr_db": None if math.isinf(self.sqnr_db) else round(self.sqnr_db, 4),
            "zero_rows": self.zero_rows,
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


def compute_scale(w: torch.Tensor, granularity: str, name: str = "tensor") -> torch.Tensor:
    """The dequant scale of a 2-D weight: shape [1] for 'tensor', [N, 1] for 'row'."""
    return compute_scale_from_rows(row_amax(w, name), granularity)


def quantize(
    w: torch.Tensor, granularity: str = "row", name: str = "tensor", scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, QuantStats]:
    """Quantize a 2-D float weight [N, K] to e4m3 codes plus its dequant scale, with error stats.

    `scale` may be given (e.g. a calibrated or shared scale); it must broadcast to [N, 1].
    """
    if w.ndim != 2:
        raise QuantizationError(f"tensor {name!r} has shape {tuple(w.shape)}, expected 2-D [out, in]")
    if not w.is_floating_point() or w.dtype == FP8_DTYPE:
        raise QuantizationError(f"tensor {name!r} has dtype {w.dtype}, expected a float weight")
    n, k = w.shape
    amax_rows = row_amax(w, name)
    if scale is None:
        scale = compute_scale_from_rows(amax_rows, granularity)
    scale = scale.float().to(w.device)
    row_scale = scale.reshape(-1, 1).expand(n, 1) if scale.numel() == 1 else scale.reshape(n, 1)
    q = torch.empty(n, k, dtype=FP8_DTYPE, device=w.device)
    sig = torch.zeros((), dtype=torch.float64, device=w.device)
    err = torch.zeros((), dtype=torch.float64, device=w.device)
    step = max(1, _CHUNK_ELEMS // max(k, 1))
    for i in range(0, n, step):
        wf = w[i : i + step].float()
        s = row_scale[i : i + step]
        t = wf / s
        t.clamp_(-FP8_MAX, FP8_MAX)
        codes = t.to(FP8_DTYPE)
        q[i : i + step] = codes
        flat = wf.view(-1)
        sig += torch.dot(flat, flat).double()
        d = fp8_to_float(codes).mul_(s).sub_(wf).view(-1)
        err += torch.dot(d, d).double()
    sig_f, err_f = float(sig), float(err)
    if err_f == 0.0:
        sqnr = math.inf
    elif sig_f == 0.0:
        sqnr = -math.inf
    else:
        sqnr = 10.0 * math.log10(sig_f / err_f)
    stats = QuantStats(
        amax=float(amax_rows.max()) if n else 0.0,
        scale_min=float(scale.min()),
        scale_max=float(scale.max()),
        sqnr_db=sqnr,
        zero_rows=int((amax_rows == 0).sum()),
    )
    return q, scale.reshape(1) if scale.numel() == 1 else scale.reshape(n, 1), stats


def compute_scale_from_rows(amax_rows: torch.Tensor, granularity: str) -> torch.Tensor:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "tensor":
        return scales_from_amax(amax_rows.amax().reshape(1))
    return scales_from_amax(amax_rows)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp8 codes [N, K] times scale ([1] or [N, 1]) -> dense weight in `dtype`."""
    return (fp8_to_float(q) * scale.float().reshape(-1, 1)).to(dtype)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round-trip x through e4m3 with a given dequant scale (for simulated activations)."""
    return ((x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale).to(x.dtype)


def per_token_scale(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token activation scale: amax over the last dim / 448, floored."""
    return scales_from_amax(x.abs().amax(dim=-1, keepdim=True))
