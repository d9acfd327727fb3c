"""Print the dependency floor CI's third lane installs: `torch==X transformers==Y`, the lowest
versions pyproject.toml allows (its `>=` bounds), so that the floor stated there is the one tested.

    python .ci/floor.py        # -> torch==2.13.0 transformers==5.16.0
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PINNED = ("torch", "transformers")  # the floors that matter: the APIs the code uses come from these


def floors(pyproject: str) -> dict[str, str]:
    """name -> the version of its `>=` bound in [project] dependencies."""
    deps = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.S | re.M)
    if deps is None:
        raise SystemExit("pyproject.toml has no [project] dependencies list")
    out = {}
    for spec in re.findall(r'"([^"]+)"', deps.group(1)):
        m = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)", spec)
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def main() -> None:
    found = floors((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    missing = [p for p in PINNED if p not in found]
    if missing:
        raise SystemExit(f"pyproject.toml states no '>=' floor for {', '.join(missing)}")
    print(" ".join(f"{p}=={found[p]}" for p in PINNED))


if __name__ == "__main__":
    sys.exit(main())
