"""The one progress signature every long operation reports through.

`progress(phase, done, total, detail)`: `phase` names the step ("quantize", "calibrate",
"verify", "accuracy", ...), `done` counts what is finished so far in that phase (bytes or
items, cumulative), `total` is the phase's size (None while unknown), `detail` says what is
being worked on (a tensor name, a status message). The CLI draws one bar per phase; a library
caller may pass any callable, or nothing.
"""

from __future__ import annotations

from typing import Callable, Optional

Progress = Callable[[str, int, Optional[int], str], None]


def silent(phase: str, done: int, total: int | None, detail: str = "") -> None:
    """A progress callback that reports nothing (the default)."""


def or_silent(progress: Progress | None) -> Progress:
    return progress or silent
