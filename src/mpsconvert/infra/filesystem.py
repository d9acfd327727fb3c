"""What differs between the file systems a model folder can sit on, in one place.

- **AppleDouble files.** On volumes without native extended attributes (exFAT and FAT32 drives,
  SMB and NFS shares), macOS stores a file's metadata in a companion named `._<name>`: copying
  `model.safetensors` there also writes `._model.safetensors`, 4 KB of resource fork that is not
  a safetensors file. Every listing of a folder's files goes through `files` / `is_appledouble`,
  so that a `*.safetensors` listing never reads one as weights.
- **Case-insensitive names.** APFS and HFS+ (by default), exFAT and most SMB shares compare names
  without case: `-o Models/smol` *is* `models/Smol`. Whether a volume does is found out by
  stat-ing a case-swapped spelling of a name on it (`case_insensitive`), not guessed from the
  platform (a Linux machine can mount exFAT; a Mac can have a case-sensitive APFS volume), and
  paths on such a volume are compared folded (`same_or_inside`).
"""

from __future__ import annotations

import os
from pathlib import Path

APPLEDOUBLE_PREFIX = "._"


def cache_dir() -> Path:
    """mpsconvert's folder in the user's cache (what is measured or built once and reused: kernel
    timings, the BF16 baseline of a GGUF source): MPSCONVERT_CACHE_DIR, else
    $XDG_CACHE_HOME/mpsconvert, else ~/.cache/mpsconvert."""
    root = os.environ.get("MPSCONVERT_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mpsconvert"


def is_appledouble(name: str) -> bool:
    """Whether a file name is a macOS AppleDouble companion (`._<name>`), never a model file."""
    return name.startswith(APPLEDOUBLE_PREFIX)


def files(folder: Path, suffix: str = "") -> list[str]:
    """The names of the entries directly in `folder` that end with `suffix` and are not folders
    (a dangling link stays listed, for the reader to report), sorted, AppleDouble companions left
    out ([] when `folder` is not a folder)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(
        p.name for p in folder.iterdir() if p.name.endswith(suffix) and not is_appledouble(p.name) and not p.is_dir()
    )


def case_insensitive(path: Path) -> bool:
    """Whether the volume holding `path` compares names without case: the nearest existing part
    of `path` whose name has a cased letter is looked up under its case-swapped spelling, and the
    two must be the same file. False when no such part exists (nothing to tell by)."""
    p = Path(path).absolute()
    for q in (p, *p.parents):
        name = q.name
        if not name or name.swapcase() == name or not os.path.lexists(q):
            continue
        try:
            return os.path.samestat(os.lstat(q), os.lstat(q.with_name(name.swapcase())))
        except OSError:  # the swapped name is not there: names are case-sensitive here
            return False
    return False


def _key(p: Path, fold: bool) -> tuple[str, ...]:
    return tuple(part.casefold() for part in p.parts) if fold else p.parts


def same_or_inside(path: Path, other: Path) -> tuple[bool, bool]:
    """(`path` is `other`, `path` lies inside `other`) for two resolved absolute paths, compared
    without case where the volume holding `other` ignores it."""
    fold = case_insensitive(other)
    a, b = _key(Path(path), fold), _key(Path(other), fold)
    return a == b, len(a) > len(b) and a[: len(b)] == b
