"""sha256 of files, streamed, so that hashing a 5 GB shard costs no memory."""

from __future__ import annotations

import hashlib
from pathlib import Path

_BLOCK = 8 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_BLOCK):
            h.update(chunk)
    return h.hexdigest()
