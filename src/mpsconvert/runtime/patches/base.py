"""The one shape every change to a loaded transformers model takes: a `Patch` (match, install,
check, report) and its `Report`.

Why one shape: every change (a fused forward, a kernel behind a transformers function, positions
known on the host) is installed, checked and reported the same way, so nothing a patch left alone
goes unsaid. `load()` asks each patch in one
order whether it applies (`match`: device, options, Triton), lets it install (`install`: per
module, each checked against the module's own computation first), asks whether what it
installed is still in place once every later patch ran (`check`), and records one `Report` per
patch; every module or call a patch left with transformers' own code is warned once, with the
module and the reason. A patch never raises out of `install`: a failure becomes a report that
says the model runs transformers' own code there.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn


class PatchFallback(UserWarning):
    """A patch left a module (or the whole model) with transformers' own code; the model is
    correct, only not as fast as it could be."""


@dataclass(frozen=True)
class Context:
    """What a patch may base its decisions on: where the model runs, and load()'s options."""

    device: torch.device
    dtype: torch.dtype
    options: dict = field(default_factory=dict)  # load()'s switches: share_inputs, decode_attention, eager_fusion
    # our Triton kernels are held back until they are compiled (a machine's first run: runtime/load/held.py)
    held: bool = False

    def on(self, option: str) -> bool:
        return bool(self.options.get(option, True))


@dataclass
class Report:
    """What one patch did to one model: installed on `installed` modules (or 1 for a model-level
    patch), left `left` ("module: why", each with transformers' own code), or did not apply at all
    (`skipped`: why). `details` holds the patch's own figures (e.g. layers with the direct path)."""

    patch: str
    installed: int = 0
    left: list = field(default_factory=list)
    skipped: str | None = None
    details: dict = field(default_factory=dict)

    @property
    def applied(self) -> bool:
        return self.skipped is None and self.installed > 0

    def as_dict(self) -> dict:
        return {
            "patch": self.patch,
            "applied": self.applied,
            "installed": self.installed,
            "left": list(self.left),
            "skipped": self.skipped,
            **({"details": self.details} if self.details else {}),
        }


class Patch(Protocol):
    """A change to a loaded transformers model, applied by `patches.apply` in registry order."""

    name: str
    phase: str  # "modules": before the kernel policy (it changes which layers exist); "forwards": after it

    def match(self, model: nn.Module, ctx: Context) -> str | None:
        """None where the patch applies to this model here; else why not (one line)."""

    # Optional, for a patch that works around a limitation of torch itself:
    #   def not_needed(self, model, ctx) -> str | None: why this torch does not need it (probed), or None.

    def install(self, model: nn.Module, ctx: Context) -> Report:
        """Install where the patch computes exactly what transformers does; report the rest."""

    def check(self, model: nn.Module, ctx: Context, report: Report) -> list[str]:
        """After every patch ran: problems with what this one installed (empty: all in place)."""


_WARNED: set = set()


def warn_left(report: Report) -> None:
    """One warning per patch and reason, naming the modules (once per process: a second load of
    the same model says nothing new)."""
    by_reason: dict[str, list[str]] = {}
    for entry in report.left:
        where, sep, why = entry.partition(": ")
        if not sep:
            where, why = "the model", entry
        by_reason.setdefault(why, []).append(where)
    for why, where in by_reason.items():
        key = (report.patch, why, tuple(where))
        if key in _WARNED:
            continue
        _WARNED.add(key)
        shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
        warnings.warn(
            f"mpsconvert patch {report.patch!r} left {shown} with transformers' own code: {why}",
            PatchFallback,
            stacklevel=4,
        )
