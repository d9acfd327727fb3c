"""Sizes as people read them (1.5 GiB): one formatter for the CLI's tables and the model card,
which live in layers that cannot import each other."""

from __future__ import annotations


def human(n: float | None) -> str:
    """`n` bytes in B / KiB / MiB / GiB / TiB (powers of 1024); None counts as 0."""
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)
