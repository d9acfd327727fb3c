"""Quantities as people read them (1.5 GiB; "1.42x faster (spread 6%)"): one formatter each for
the CLI's tables, inspect's rows and the model card, which live in layers that cannot import
each other."""

from __future__ import annotations


def human(n: float | None) -> str:
    """`n` bytes in B / KiB / MiB / GiB / TiB (powers of 1024); None counts as 0."""
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def num(x, spec: str = "") -> str:
    """A number read from a manifest (untrusted), formatted; anything else as '?'."""
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "?"


def speed(v: dict) -> str:
    """A timing verdict (timing.verdict): '1.42x faster (spread 6%)', or 'no clear difference
    (0.97x, spread 12%)': a verdict only where the difference exceeds the run-to-run spread
    measured in the same run. Read from a manifest: a field that is not a number shows as '?'."""
    spread = f"spread {num(v.get('spread'), '.0%')}"
    if v.get("verdict") == "no clear difference":
        return f"no clear difference ({num(v.get('ratio'), '.2f')}x, {spread})"
    return f"{num(v.get('ratio'), '.2f')}x {v.get('verdict')} ({spread})"
