"""Observers: bounded summaries of a Linear's input activations, turned into one clip value.

An observer never keeps an activation: `minmax` keeps a running maximum (a 0-d tensor on the
device, so no host sync per batch), `percentile` and `mse` keep a fixed-size histogram of
|x| in log2 space (64 bins per octave over 2**-32 .. 2**32, plus a zero bin). Log-spaced bins
match FP8's own log-spaced grid: every bin is ~1.1% wide, finer than e4m3's 6-12% steps, so
the quantization error of the observed distribution can be evaluated from the histogram alone.

The clip `c` becomes the static dequant scale `c / 448` (see fp8.scales_from_amax).
"""

from __future__ import annotations

import math

import torch

from ..errors import QuantizationError
from ..format import fp8
from .options import DEFAULT_PERCENTILE, OBSERVERS

BINS_PER_OCTAVE = 64
LOG2_LO, LOG2_HI = -32, 32
NBINS = (LOG2_HI - LOG2_LO) * BINS_PER_OCTAVE  # + 1 zero bin in front
_CHUNK = 1 << 22  # elements per histogram update, so the transient index tensor stays small
# MSE search: clips amax * 2**(-k/32) for k = 0..MSE_STEPS-1 (down to amax / 256).
MSE_STEPS_PER_OCTAVE = 32
MSE_STEPS = 8 * MSE_STEPS_PER_OCTAVE + 1
MSE_POINTS_PER_BIN = 4


class Observer:
    """Running |x| maximum and element count; subclasses add what their clip needs."""

    kind = "minmax"

    def __init__(self):
        self.amax_t: torch.Tensor | None = None
        self.count = 0

    def update(self, x: torch.Tensor) -> None:
        self.accumulate(self.summarize(x))

    def summarize(self, x: torch.Tensor):
        """What one batch contributes (reusable by every observer of the same input tensor)."""
        x = x.detach()
        if x.numel() == 0:
            return 0, None
        # One pass, no |x| temporary: the inf-norm is the absolute maximum.
        return x.numel(), torch.linalg.vector_norm(x, float("inf")).float()

    def accumulate(self, stats) -> None:
        n, m = stats
        self.count += n
        if m is not None:
            self.amax_t = m if self.amax_t is None else torch.maximum(self.amax_t, m)

    @property
    def amax(self) -> float:
        return 0.0 if self.amax_t is None else float(self.amax_t)

    def clip(self) -> float:
        """The activation magnitude mapped to FP8's 448."""
        return self.amax

    def check(self, name: str) -> None:
        if not math.isfinite(self.amax):
            raise QuantizationError(
                f"the inputs of {name} reached {self.amax} during calibration (overflow in the model's dtype)",
                f"check the calibration data, or pass `ignore={name}` to keep it unquantized",
            )

    def describe(self) -> dict:
        return {"observer": self.kind}


class LogHistogram(Observer):
    """Counts of |x| in log2-spaced bins; bin 0 holds exact zeros and values below 2**-32."""

    def __init__(self):
        super().__init__()
        self.counts: torch.Tensor | None = None

    def summarize(self, x: torch.Tensor):
        n, m = super().summarize(x)
        flat = x.detach().reshape(-1)
        counts = torch.zeros(NBINS + 1, dtype=torch.int64, device=x.device)
        for i in range(0, flat.numel(), _CHUNK):
            a = flat[i : i + _CHUNK].abs().float()
            idx = torch.log2(a).sub_(LOG2_LO).mul_(BINS_PER_OCTAVE).floor_()
            idx = torch.nan_to_num_(idx, nan=0.0, neginf=-1.0).clamp_(-1, NBINS - 1).long().add_(1)
            counts += torch.bincount(idx, minlength=NBINS + 1)
        return n, m, counts

    def accumulate(self, stats) -> None:
        n, m, counts = stats
        super().accumulate((n, m))
        self.counts = counts if self.counts is None else self.counts + counts

    def bins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts [NBINS+1] float64 on CPU, lower edges [NBINS] of the non-zero bins). The int64
        counts go to the CPU first and become float64 there: MPS has no float64, and 4097
        integers cost nothing to move once per clip."""
        counts = self.counts.cpu().double()
        edges = torch.pow(2.0, LOG2_LO + torch.arange(NBINS, dtype=torch.float64) / BINS_PER_OCTAVE)
        return counts, edges


class Percentile(LogHistogram):
    kind = "percentile"

    def __init__(self, q: float = DEFAULT_PERCENTILE):
        if not 0 < q <= 100:
            raise QuantizationError(
                f"percentile {q} is outside (0, 100]", "pass `percentile` between 0 and 100, e.g. 99.99"
            )
        super().__init__()
        self.q = q

    def clip(self) -> float:
        if self.counts is None:
            return 0.0
        counts, _ = self.bins()
        total = float(counts.sum())
        target = self.q / 100.0 * total
        cum = torch.cumsum(counts, 0)
        b = int(torch.searchsorted(cum, torch.tensor([target], dtype=torch.float64)).clamp(max=NBINS))
        if b == 0:
            return 0.0
        before = float(cum[b - 1])
        frac = (target - before) / float(counts[b]) if counts[b] > 0 else 1.0
        # Geometric interpolation inside the bin; never beyond the true maximum.
        value = 2.0 ** (LOG2_LO + (b - 1 + min(max(frac, 0.0), 1.0)) / BINS_PER_OCTAVE)
        return min(value, self.amax)

    def describe(self) -> dict:
        return {"observer": self.kind, "percentile": self.q}


class MSE(LogHistogram):
    """The clip <= amax that minimises the summed squared FP8 error over the observed values.

    Each non-empty bin is represented by MSE_POINTS_PER_BIN log-spaced points carrying its count;
    each candidate clip is evaluated with the real e4m3 round trip (fp8.fake_quantize),
    clipping included. Ties go to the largest clip (minmax)."""

    kind = "mse"

    def candidates(self) -> torch.Tensor:
        k = torch.arange(MSE_STEPS, dtype=torch.float64)
        return self.amax * torch.pow(2.0, -k / MSE_STEPS_PER_OCTAVE)

    def errors(self, clips: torch.Tensor) -> torch.Tensor:
        """Estimated summed squared error of each candidate clip."""
        counts, _ = self.bins()
        nz = torch.nonzero(counts[1:] > 0).reshape(-1)
        t = (torch.arange(MSE_POINTS_PER_BIN, dtype=torch.float64) + 0.5) / MSE_POINTS_PER_BIN
        pts = torch.pow(2.0, LOG2_LO + (nz.double()[:, None] + t[None, :]) / BINS_PER_OCTAVE).reshape(-1)
        pts = pts.clamp(max=self.amax).float()
        w = (counts[1:][nz] / MSE_POINTS_PER_BIN).repeat_interleave(MSE_POINTS_PER_BIN)
        scales = fp8.scales_from_amax(clips.float())[:, None]  # [K, 1] against points [1, M]
        d = (fp8.fake_quantize(pts[None, :].expand(len(clips), -1), scales) - pts[None, :]).double()
        return (d * d * w[None, :]).sum(1)

    def clip(self) -> float:
        if self.counts is None or self.amax == 0.0:
            return self.amax
        clips = self.candidates()
        err = self.errors(clips)
        best = int(torch.argmin(err))  # first minimum: the largest clip among ties
        return float(clips[best])


def make(kind: str, percentile: float = DEFAULT_PERCENTILE):
    """A factory of fresh observers of one kind."""
    if kind == "minmax":
        return Observer
    if kind == "percentile":
        Percentile(percentile)  # validate now, not at the first hook call
        return lambda: Percentile(percentile)
    if kind == "mse":
        return MSE
    raise QuantizationError(f"unknown observer {kind!r}", f"use one of: {', '.join(OBSERVERS)}")
