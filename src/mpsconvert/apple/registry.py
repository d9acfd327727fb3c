"""The Apple export targets, by key: what the API's `export` / `check`, the CLI's `export-<key>`
commands and `quantize --<key>` options, `--backend`, validate's Apple part, the card and inspect
are generated from. A new target is a module (apple/<key>/, a `Target` subclass) and one line
in `TARGETS` (or `register(target)` from outside the package)."""

from __future__ import annotations

from ..errors import MpsconvertError
from ..manifests import records
from .coreai.coreai_target import CoreAI
from .coreml.coreml_target import CoreML
from .protocol import Target

TARGETS: dict[str, Target] = {}


def register(target: Target) -> Target:
    """Add a target (its records become known to the card and inspect); returns it."""
    if target.key in TARGETS and type(TARGETS[target.key]) is not type(target):
        raise MpsconvertError(
            f"an export target {target.key!r} is registered already ({TARGETS[target.key]!r})",
            "give the new target another key",
        )
    TARGETS[target.key] = target
    records.register(target.record)
    records.register(target.runtime_record)
    return target


def unregister(key: str) -> None:
    """Remove a target registered by `register` (tests that add one take it away after)."""
    t = TARGETS.pop(key, None)
    if t is not None:
        records.unregister(t.record)
        records.unregister(t.runtime_record)


def get(key) -> Target:
    """The target named `key` (a Target is passed through)."""
    if isinstance(key, Target):
        return key
    if key not in TARGETS:
        raise MpsconvertError(f"unknown export target {key!r}", f"use one of: {', '.join(TARGETS)}")
    return TARGETS[key]


for _target in (CoreML(), CoreAI()):
    register(_target)
