"""What an artifact's tensors hold, checked the same way for every format (manifests/verify.py
for compressed-tensors, manifests/diffusion.py for ComfyUI and diffusers files): every scale
finite and > 0, no e4m3fn NaN code (0x7F / 0xFF: no quantizer writes one), and the manifest's
tensor records matching the files.

The NaN-code scan rides on the sha256 reader when verify hashes the files (`hash_and_count`:
one read of the weights for both); without hashes it reads the codes on its own (`check_values`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from ..infra.safetensors_io import Header
from ..infra.untrusted import open_regular
from .layout import MANIFEST_NAME

_SCALE_NP = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
_BLOCK = 8 << 20


def floats(path: Path, info) -> np.ndarray:
    """A small float tensor's values as float32 (BF16 widened by its bits: numpy has no bf16)."""
    if info.dtype == "BF16":
        raw = np.fromfile(path, dtype="<u2", count=info.nbytes // 2, offset=info.start)
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return np.fromfile(
        path,
        dtype=np.dtype(_SCALE_NP[info.dtype]).newbyteorder("<"),
        count=info.nbytes // np.dtype(_SCALE_NP[info.dtype]).itemsize,
        offset=info.start,
    ).astype(np.float32)


def nan_codes(codes: np.ndarray) -> int:
    """How many e4m3fn NaN codes (0x7F, 0xFF) a uint8 array holds."""
    return int(np.count_nonzero((codes & 0x7F) == 0x7F))


def fp8_ranges(header: Header) -> list[tuple[str, int, int]]:
    """(tensor, first byte, end byte) in the file of every F8_E4M3 tensor: what `hash_and_count` scans."""
    return sorted(
        ((n, i.start, i.start + i.nbytes) for n, i in header.tensors.items() if i.dtype == "F8_E4M3" and i.nbytes),
        key=lambda r: r[1],
    )


def hash_and_count(
    path: Path, ranges: list[tuple[str, int, int]] = (), block: int = _BLOCK
) -> tuple[str, dict[str, int]]:
    """The file's sha256 and, in the same read, the NaN codes of each range (`fp8_ranges`):
    (hex digest, {tensor: NaN codes}). Without ranges it is a plain streamed sha256."""
    h = hashlib.sha256()
    counts = {name: 0 for name, _, _ in ranges}
    with os.fdopen(
        open_regular(path, raw_oserror=True), "rb", buffering=0
    ) as f:  # a FIFO or device is refused, never read
        buf = bytearray(max(1, min(block, os.fstat(f.fileno()).st_size)))
        view = memoryview(buf)
        arr = np.frombuffer(buf, dtype=np.uint8)
        pos, first = 0, 0  # bytes read so far; the first range that may still overlap
        while n := f.readinto(buf):
            h.update(view[:n])
            end = pos + n
            while first < len(ranges) and ranges[first][2] <= pos:
                first += 1
            for name, lo, hi in ranges[first:]:
                if lo >= end:
                    break
                a, b = max(lo, pos) - pos, min(hi, end) - pos
                counts[name] += nan_codes(arr[a:b])
            pos = end
    return h.hexdigest(), counts


def check_values(
    headers: dict[str, Header], report, codes: bool = True, counted: dict[str, dict[str, int]] | None = None
) -> None:
    """Every `*_scale` tensor finite and > 0; with `codes`, no NaN code in any F8_E4M3 tensor:
    counted while the files were hashed (`counted`: shard -> {tensor: NaN codes}), else here, in
    blocks of a memory map."""
    counted = counted or {}
    for shard, h in headers.items():
        for name, info in h.tensors.items():
            if name.endswith("_scale") and info.dtype in ("F32", "F16", "BF16", "F64") and info.nbytes <= 64 << 20:
                v = floats(h.path, info)
                bad = ~(np.isfinite(v) & (v > 0))
                if bad.any():
                    report.problems.append(
                        f"{name} in {shard} has {int(bad.sum())} value(s) that are not finite "
                        f"positive scales (e.g. {v[bad][0]})"
                    )
            elif codes and info.dtype == "F8_E4M3" and info.nbytes:
                if shard in counted:
                    n = counted[shard].get(name, 0)
                else:
                    mm = np.memmap(h.path, dtype=np.uint8, mode="r", offset=info.start, shape=(info.nbytes,))
                    n = sum(nan_codes(mm[i : i + (64 << 20)]) for i in range(0, info.nbytes, 64 << 20))
                    del mm
                if n:
                    report.problems.append(
                        f"{name} in {shard} holds {n} NaN code(s) (0x7F/0xFF), which no quantizer writes"
                    )


def check_records(manifest, tensors: dict, report) -> None:
    """The manifest's tensor records against the files: every recorded tensor stored, with its dtype
    and shape. At most `MAX_SAID` of them are said one by one, then how many more (200,000 bogus
    records are one problem too many, not 200,000 lines)."""
    found = []
    for name, rec in manifest.tensors.items():
        info = tensors.get(name)
        if info is None:
            found.append(f"{MANIFEST_NAME} records {name}, which no shard holds")
        elif info.dtype != rec.get("dtype", info.dtype) or list(info.shape) != rec.get("shape", list(info.shape)):
            found.append(
                f"{name} is {info.dtype}{list(info.shape)} but {MANIFEST_NAME} records "
                f"{rec.get('dtype')}{rec.get('shape')}"
            )
    report.problems += found[:MAX_SAID]
    if len(found) > MAX_SAID:
        report.problems.append(
            f"... and {len(found) - MAX_SAID} more tensor records of {MANIFEST_NAME} that the shards do not match"
        )


MAX_SAID = 20  # problems of one kind said one by one
