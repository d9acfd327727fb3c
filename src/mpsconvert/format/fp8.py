"""FP8 e4m3 math: scales, the clamp-then-cast, dequantization and error, on any float tensor.

Scales are dequantization multipliers (`w ~= fp8 * scale`, `scale = amax / 448`), as
compressed-tensors and vLLM read them. `torch.Tensor.to(float8_e4m3fn)` does not saturate, so
values are clamped to +-448 first. Work is done in row chunks that stay in cache, because on
CPU the conversion is memory-bound and a whole-tensor float32 copy would double peak memory.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass

import torch

from ..errors import QuantizationError
from ..infra import devices
from .scales import DEFAULT_BLOCK, Granularity, blocks

FP8_DTYPE = torch.float8_e4m3fn
# How e4m3 codes may be held: as float8, or as their bytes where the device has no float8 (MPS
# before torch 2.15: devices.Capabilities.code_dtype); fp8_to_float decodes both exactly.
CODE_DTYPES = (FP8_DTYPE, torch.uint8)
FP8_MAX = 448.0
# Floor for the scale of an all-zero row or tensor: its codes are all zero, and the scale
# stays a finite positive number that no reader divides by zero with.
SCALE_FLOOR = 1e-12
_SQNR_ELEMS = 1 << 20  # tensors up to this size get an exact SQNR, larger ones a row sample of it
_CHUNK_ELEMS = 1 << 20  # 4 MiB of float32 per work buffer: L3-resident, and few Python calls per block


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
        """The fields as JSON holds them: the SQNR rounded, null where it is not finite, and
        `sqnr_undefined` where it is NaN (an all-zero tensor: no signal, so no ratio)."""
        sqnr = round(self.sqnr_db, 4) if math.isfinite(self.sqnr_db) else None
        return (
            dataclasses.asdict(self)
            | {"sqnr_db": sqnr}
            | ({"sqnr_undefined": True} if math.isnan(self.sqnr_db) else {})
        )


# Fewer codes than this are cast on CPU too (a decode step's activations: 4 us against 23 us for
# 576 codes; 2 ns a code against 0.7 ns for the move above, so they meet near 14k codes)
CAST_BELOW = 16384


def fp8_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decode e4m3 codes (float8_e4m3fn, or their bytes as uint8) to float32 exactly.

    Bit by bit on CPU, where PyTorch's float8->float cast is ~3-5x slower than this bit move
    (except below CAST_BELOW codes, where its one op beats the move's six):
    e4m3's exponent and mantissa bits land in fp16's positions (s.eeee.mmm -> s.0eeee.mmm0000000),
    which reads as the e4m3 value times 2**-8, subnormals included. Also for codes held as bytes:
    a device where this torch has no float8 (MPS before torch 2.15: devices.Capabilities.code_dtype)
    runs only integer and fp16 ops here. A float8 tensor on a GPU is cast by the device. NaN codes
    (0x7f/0xff) never occur because we clamp before casting.
    """
    if codes.dtype == FP8_DTYPE and (codes.device.type != "cpu" or codes.numel() < CAST_BELOW):
        return codes.float()
    b = codes.view(torch.uint8).to(torch.int16)
    h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return h.view(torch.float16).float().mul_(256.0)


def codes_to(codes: torch.Tensor, device) -> torch.Tensor:
    """e4m3 codes (float8_e4m3fn or uint8 bytes) moved to `device`, held as that device holds them
    (devices.Capabilities.code_dtype): a float8 tensor cannot even be moved to an MPS device of a
    torch without float8, its bytes can."""
    device = torch.device(device)
    want = devices.capabilities(device).code_dtype
    if codes.dtype == want:
        return codes.to(device)
    return (
        codes.view(want).to(device) if want == torch.uint8 else codes.to(device).view(want)
    )  # reinterpreted where float8 exists


def _check_finite(amax: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(amax).all()):
        raise QuantizationError(
            f"tensor {name!r} contains NaN or inf values",
            "fix the source checkpoint, or pass `ignore` with this module to keep it unquantized",
        )


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """scale = amax / 448, floored so that all-zero rows get a valid positive scale."""
    return (amax.float() / FP8_MAX).clamp_(min=SCALE_FLOOR)


_scratch = threading.local()


def _scratch_buffers(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float32 [rows, K] work buffers of the calling thread, kept between tensors: fresh
    memory costs a page fault per 4 KiB, which on a VM is as dear as the math on it."""
    if getattr(_scratch, "shape", None) != (rows, k):
        _scratch.shape = (rows, k)
        _scratch.bufs = (torch.empty(rows, k, dtype=torch.float32), torch.empty(rows, k, dtype=torch.float32))
    return _scratch.bufs


class StreamQuantizer:
    """Quantizes one [N, K] weight fed as blocks of rows.

    Conversion reads a tensor block by block (the reader's buffers), so no whole tensor, let alone a float32 copy of
    one, is ever held. Blocks are given in order, or with their first row (`start`) from several threads at once: each
    block writes only its own rows' scales, and the error sums are kept per block and added in row order, so the result
    does not depend on which thread ran what. Per-row scales are computed in the same pass as the cast. A per-tensor
    scale needs the whole tensor's amax first: feed every block to `observe` (a first pass, in order) before `quantize`.
    Per-block scales ([ceil(N/b), ceil(K/b)]) come from the same pass too, which is why blocks of rows must then start
    on a multiple of `block` rows (the writer's reads are aligned so; the last block may be short). A given `scale`
    (broadcast to [N, 1]) is used as is, and values beyond +-448 are then clamped before the cast; with our own
    amax-derived scales |w / scale| <= 448 already (rounding stays below e4m3's 464 overflow threshold). The SQNR is
    exact up to 2**20 elements and measured on evenly spaced rows beyond that (about 2**20 elements): decoding every
    code again would double the cost of a conversion.
    """

    def __init__(
        self,
        n: int,
        k: int,
        granularity: str = "row",
        name: str = "tensor",
        scale: torch.Tensor | None = None,
        block: int = DEFAULT_BLOCK,
    ):
        self.n, self.k, self.name = n, k, name
        self.granularity = Granularity(granularity)
        self.block = block if self.granularity is Granularity.BLOCK else None
        self._given = scale is not None
        self._row_amax = torch.empty(n, 1, dtype=torch.float32)
        if scale is not None:
            scale = scale.float().cpu()
            if self.block:
                self._scale = scale.reshape(blocks(n, block), blocks(k, block))
            else:
                self._scale = scale.reshape(1) if scale.numel() == 1 else scale.reshape(n, 1)
        elif self.granularity is Granularity.ROW:
            self._scale = torch.empty(n, 1, dtype=torch.float32)
        elif self.block:
            self._scale = torch.empty(blocks(n, block), blocks(k, block), dtype=torch.float32)
        else:
            self._scale = None  # known once every block went through observe()
        self._observed = 0
        self._lock = threading.Lock()
        self._next = 0  # first row after the furthest block handed out
        self._done = 0  # rows quantized
        self._errors: dict[int, tuple[float, float, int]] = {}  # block start -> (signal, error, rows)
        self._stride = max(1, (n * k) // _SQNR_ELEMS)
        self._rows = max(1, _CHUNK_ELEMS // max(k, 1))
        if self.block:  # chunks of whole blocks of rows
            self._rows = max(1, self._rows // block) * block

    @property
    def needs_observe(self) -> bool:
        """True while a per-tensor scale still waits for the first pass over the tensor."""
        return self._scale is None

    def _chunks(self, block: torch.Tensor):
        f32, tmp = _scratch_buffers(self._rows, self.k)
        for i in range(0, block.shape[0], self._rows):
            c = block[i : i + self._rows]
            f = f32[: c.shape[0]]
            f.copy_(c)
            yield i, c.shape[0], f, tmp[: c.shape[0]]

    @staticmethod
    def _amax_rows(f: torch.Tensor, tmp: torch.Tensor, out: torch.Tensor) -> None:
        torch.abs(f, out=tmp)
        torch.amax(tmp, dim=1, keepdim=True, out=out)

    def observe(self, block: torch.Tensor) -> None:
        """First pass for a per-tensor scale: the rows' amax, block by block in order."""
        if self._scale is not None:
            raise RuntimeError("observe() is only needed for a per-tensor scale computed from the weight")
        start = self._observed
        for i, b, f, tmp in self._chunks(block):
            self._amax_rows(f, tmp, self._row_amax[start + i : start + i + b])
        self._observed += block.shape[0]
        _check_finite(self._row_amax[start : self._observed], self.name)
        if self._observed == self.n:
            self._scale = scales_from_amax(self._row_amax.amax().reshape(1))

    def quantize(self, block: torch.Tensor, out: torch.Tensor | None = None, start: int | None = None) -> torch.Tensor:
        """e4m3 codes of rows [start, start + b) of the weight (a float tensor [b, K]; by
        default the rows after the last block), into `out` if given."""
        if self._scale is None:
            raise RuntimeError("a per-tensor scale needs observe() over the whole tensor first")
        b = block.shape[0]
        with self._lock:
            start = self._next if start is None else start
            if block.ndim != 2 or block.shape[1] != self.k or start < 0 or start + b > self.n:
                raise RuntimeError(f"block {tuple(block.shape)} does not continue [{self.n}, {self.k}] at row {start}")
            self._next = max(self._next, start + b)
        if self.block and (start % self.block or (b % self.block and start + b != self.n)):
            raise RuntimeError(f"block of rows [{start}, {start + b}) is not aligned to {self.block}-row weight blocks")
        if out is None:
            out = torch.empty(block.shape, dtype=FP8_DTYPE)
        own_rows = self.granularity is Granularity.ROW and not self._given
        known_amax = self._observed == self.n
        for i, rows, f, t in self._chunks(block):
            r0 = start + i
            a = self._row_amax[r0 : r0 + rows]
            if not known_amax or self.block:
                self._amax_rows(f, t, a)
            if self.block:
                self._quantize_blocks(f, t, r0)
            elif own_rows:
                _check_finite(a, self.name)
                s = self._scale[r0 : r0 + rows]
                s.copy_(scales_from_amax(a))
            else:
                s = self._scale if self._scale.numel() == 1 else self._scale[r0 : r0 + rows]
            if not self.block:
                torch.div(f, s, out=t)
            if self._given:
                t.clamp_(-FP8_MAX, FP8_MAX)
            out[i : i + rows].copy_(t)
        err = self._sample_error(block, out, start)
        with self._lock:
            if start in self._errors:
                raise RuntimeError(f"{self.name}: rows from {start} quantized twice")
            self._errors[start] = err
            self._done += b
        return out

    def _quantize_blocks(self, f: torch.Tensor, t: torch.Tensor, r0: int) -> None:
        """Rows [r0, r0 + len(f)) (whole blocks of rows; `t` holds |f|): their blocks' scales
        (from the blocks' amax, unless given) and f / scale into `t`."""
        b = self.block
        for j in range(0, f.shape[0], b):
            i = (r0 + j) // b
            if not self._given:
                col = t[j : j + b].amax(dim=0)  # [K]: each column's amax over the block's rows
                if self.k % b:
                    col = torch.nn.functional.pad(col, (0, -self.k % b))
                amax = col.view(-1, b).amax(dim=1)
                _check_finite(amax, self.name)
                self._scale[i].copy_(scales_from_amax(amax))
            torch.div(f[j : j + b], self._scale[i].repeat_interleave(b)[: self.k], out=t[j : j + b])

    def _row_scales(self, first: int, count: int, stride: int = 1) -> torch.Tensor:
        """The scales of rows first, first + stride, ... (count of them), broadcastable to [count, K]."""
        if self._scale.numel() == 1:
            return self._scale
        if self.block:
            idx = torch.arange(first, first + count * stride, stride)[:count] // self.block
            return self._scale[idx].repeat_interleave(self.block, dim=1)[:, : self.k]
        return self._scale[first::stride][:count]

    def _sample_error(self, block: torch.Tensor, codes: torch.Tensor, start: int) -> tuple[float, float, int]:
        first = -start % self._stride
        if first >= block.shape[0]:
            return 0.0, 0.0, 0
        rows = slice(first, None, self._stride)
        wf = block[rows].float().contiguous()
        s = self._row_scales(start + first, wf.shape[0], self._stride)
        d = fp8_to_float(codes[rows]).mul_(s).sub_(wf)
        return float(torch.dot(wf.view(-1), wf.view(-1))), float(torch.dot(d.view(-1), d.view(-1))), wf.shape[0]

    def finish(self) -> tuple[torch.Tensor, QuantStats]:
        """The dequant scale ([1], [N, 1] or [ceil(N/b), ceil(K/b)]) and the error stats, once
        every row was quantized."""
        if self._done != self.n:
            raise RuntimeError(f"{self.name}: {self.n - self._done} rows never quantized")
        _check_finite(self._row_amax, self.name)
        sig = err = 0.0
        sampled = 0
        for start in sorted(self._errors):  # row order: the same sums whatever ran where
            s_, e_, r_ = self._errors[start]
            sig, err, sampled = sig + s_, err + e_, sampled + r_
        if err == 0.0 and sig == 0.0:
            sqnr = math.nan  # an all-zero (or all-underflowing) tensor: no signal, the ratio is undefined, not "exact"
        elif err == 0.0:
            sqnr = math.inf
        elif sig == 0.0:
            sqnr = -math.inf
        else:
            sqnr = 10.0 * math.log10(sig / err)
        scale = self._scale
        stats = QuantStats(
            amax=float(self._row_amax.max()) if self.n else 0.0,
            scale_min=float(scale.min()),
            scale_max=float(scale.max()),
            sqnr_db=sqnr,
            zero_rows=int((self._row_amax == 0).sum()),
            sqnr_rows=sampled,
        )
        return scale, stats


def quantize(
    w: torch.Tensor,
    granularity: str = "row",
    name: str = "tensor",
    scale: torch.Tensor | None = None,
    block: int = DEFAULT_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, QuantStats]:
    """Quantize a 2-D float weight [N, K] to e4m3 codes plus its dequant scale, with error stats.

    `scale` may be given (e.g. a calibrated or shared scale); it must broadcast to [N, 1], or be
    [ceil(N/b), ceil(K/b)] for block granularity.
    """
    if w.ndim != 2:
        raise QuantizationError(f"tensor {name!r} has shape {tuple(w.shape)}, expected 2-D [out, in]")
    if not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise QuantizationError(f"tensor {name!r} has dtype {w.dtype}, expected a float weight")
    device = w.device
    w = w.cpu()
    qz = StreamQuantizer(*w.shape, granularity=granularity, name=name, scale=scale, block=block)
    if qz.needs_observe:
        qz.observe(w)
    q = qz.quantize(w)
    s, stats = qz.finish()
    return q.to(device), s.to(device), stats


def is_block_scale(scale: torch.Tensor, n: int) -> bool:
    """Whether a weight scale of an [N, K] weight is per block (not [1], [N], [N, 1])."""
    return scale.numel() != 1 and not (scale.numel() == n and (scale.ndim == 1 or scale.shape[-1] == 1))


def expand_block_scale(scale: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """A [ceil(N/b), ceil(K/b)] block scale as the [N, K] multiplier of every weight (float32)."""
    s = scale.float()
    if s.shape != (blocks(n, block), blocks(k, block)):
        raise ValueError(f"block scale {list(s.shape)} does not fit a {n}x{k} weight with {block}x{block} blocks")
    return s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16, block: int | None = None
) -> torch.Tensor:
    """fp8 codes [N, K] times scale ([1], [N, 1], or [ceil(N/b), ceil(K/b)] with `block` b) ->
    dense weight in `dtype`. A block scale without its block edge is refused: the edge cannot
    be told from the shapes when a block is partial.

    On CPU a large weight is done in blocks of rows into the output (`_dequantize_rows`): whole,
    it makes ~10 bytes per weight of int16 and float32 temporaries beside the 2 it keeps (590 MB
    for one 14336 x 4096 layer), on the machine with the least memory to spare."""
    if q.device.type == "cpu" and q.ndim == 2 and q.numel() > _CHUNK_ELEMS:
        return _dequantize_rows(q, scale, dtype, block)
    return _dequantize(q, scale, dtype, block)


def _dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int | None) -> torch.Tensor:
    n, k = q.shape
    out = torch.empty(n, k, dtype=dtype)
    per_block = is_block_scale(scale, n)
    if per_block and block is None:
        raise ValueError(f"a {list(scale.shape)} block scale of a {n}x{k} weight needs its block size to dequantize")
    rows = max(1, _CHUNK_ELEMS // max(k, 1))
    if per_block:
        rows = max(1, rows // block) * block  # whole blocks of rows: each chunk takes its rows of the block scale
        s = scale.float().reshape(blocks(n, block), blocks(k, block))
    else:
        s = scale.float().reshape(-1, 1)
    for r in range(0, n, rows):
        part = s[r // block : -(-min(r + rows, n) // block)] if per_block else s if s.shape[0] == 1 else s[r : r + rows]
        out[r : r + rows] = _dequantize(q[r : r + rows], part, dtype, block)
    return out


def _dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int | None) -> torch.Tensor:
    if q.ndim != 2 or not is_block_scale(scale, q.shape[0]):  # per tensor / per row (any rank, as before)
        return (fp8_to_float(q) * scale.float().reshape(-1, 1)).to(dtype)
    n, k = q.shape
    if block is None:
        raise ValueError(f"a {list(scale.shape)} block scale of a {n}x{k} weight needs its block size to dequantize")
    w = fp8_to_float(q)
    if n % block == 0 and k % block == 0:  # whole blocks: one broadcast multiply, no [N, K] scale
        w.view(n // block, block, k // block, block).mul_(scale.float().view(n // block, 1, k // block, 1))
        return w.to(dtype)
    return w.mul_(expand_block_scale(scale, n, k, block)).to(dtype)


def tile_scale(scale: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """A block scale [ceil(N/b), ceil(K/b)] as tiles that divide the weight exactly: [N/gn, K/gk]
    with gn = gcd(N, b), gk = gcd(K, b) (the scale itself when b divides both). Exporters that
    need a scale tiling the weight (Core AI's blockwise_shift_scale, per-tile LUTs) take this:
    the same multiplier for every weight, partial edge blocks included."""
    gn, gk = math.gcd(n, block), math.gcd(k, block)
    s = scale.float().reshape(blocks(n, block), blocks(k, block))
    if gn == block and gk == block:
        return s
    return s.repeat_interleave(block // gn, 0)[: n // gn].repeat_interleave(block // gk, 1)[:, : k // gk].contiguous()


def dequantize_tiles(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp8 codes [N, K] times a scale that tiles them exactly ([1], [N, 1], or [N/tn, K/tk] as
    `tile_scale` gives): unambiguous without a block size, unlike a block scale with partial edges."""
    if q.ndim != 2 or not is_block_scale(scale, q.shape[0]):
        return dequantize(q, scale, dtype)
    n, k = q.shape
    rn, rk = scale.shape
    if n % rn or k % rk:
        raise ValueError(f"a {list(scale.shape)} scale does not tile a {n}x{k} weight")
    w = fp8_to_float(q)
    w.view(rn, n // rn, rk, k // rk).mul_(scale.float().view(rn, 1, rk, 1))
    return w.to(dtype)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float32 (NaN where got holds one): how far a kernel's or a fused
    forward's output is from its reference, in the checks made at load and in validation."""
    g, w = got.float(), want.float()
    return float((g - w).norm() / w.norm().clamp_min(1e-30))


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, as float32: what
    `v.to(float8_e4m3fn).float()` gives, without a float8 op (for a device whose torch has none).

    Normal range (|v| >= 2**-6): the float32 bits keep 3 of 23 mantissa bits, rounded to nearest
    even by adding 0x7FFFF plus the lowest kept bit before masking (a carry moves into the
    exponent, as rounding up to the next power of two must). Below, e4m3's subnormals are the
    multiples of 2**-9: `round(v * 512) / 512` (exact scalings; torch.round is half to even).
    """
    b = v.view(torch.int32)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000).view(
        torch.float32
    )  # -0x100000 == 0xFFF00000: sign, exponent, 3 bits
    return torch.where(v.abs() < 2.0**-6, torch.round(v * 512.0) / 512.0, normal)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round-trip x through e4m3 with a given dequant scale (for simulated activations); on a
    device without float8 (devices.Capabilities.fp8_tensors) through `round_to_e4m3`, exactly."""
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX)
    q = q.to(FP8_DTYPE).float() if devices.capabilities(q.device).fp8_tensors else round_to_e4m3(q)
    return (q * scale).to(x.dtype)


def per_token_scale(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token activation scale: amax over the last dim / 448, floored."""
    return scales_from_amax(x.abs().amax(dim=-1, keepdim=True))


def per_group_scale(x: torch.Tensor, group: int) -> torch.Tensor:
    """Dynamic per-token, per-group activation scale (FP8_BLOCK's 1 x group): [..., ceil(K/g)]."""
    k = x.shape[-1]
    a = x.abs().float()
    if k % group:
        a = torch.nn.functional.pad(a, (0, -k % group))
    return scales_from_amax(a.view(*x.shape[:-1], -1, group).amax(dim=-1))
