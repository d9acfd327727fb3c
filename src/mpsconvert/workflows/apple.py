"""Where the Apple targets meet the other packages: results readable per target, the exports a
conversion asked for (under its lock, each failure said as "written, but"), and validate's Apple
part (measured beside the PyTorch rows, its records put into validate's one transaction).
apple/flow.py is what every target goes through on its own (export, check, measure, decoder)."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..apple import flow, registry
from ..apple.flow import ExportResult
from ..apple.target import Target
from ..errors import ExportError, MpsconvertError
from ..infra.progress import Progress


def targets() -> dict[str, Target]:
    """The Apple export targets by key ("coreml", "coreai", and any registered since)."""
    return dict(registry.TARGETS)


class ByTarget:
    """Results that hold one entry per Apple target (`apple`), also readable as attributes named
    by the target's key (`result.coreml`), whatever targets are registered."""

    def __getattr__(self, name: str):
        if name != "apple" and name in registry.TARGETS:
            return self.apple.get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


@contextlib.contextmanager
def written_but(out: Path, what: str, retry: str, error: type[MpsconvertError]):
    """A step after the artifact was written that failed: said as such (the artifact stands)."""
    try:
        yield
    except MpsconvertError as e:
        raise error(f"{out} was written, but {what} failed: {e.problem}", e.fix or retry) from e


def export_into(out: Path, exports: dict[str, Any], progress: Progress | None) -> dict[str, ExportResult]:
    """The exports a conversion asked for ({target key: its options, or None for its defaults}),
    each into the artifact just written at `out` and checked (replacing a package the old
    artifact had: the conversion was allowed to replace it)."""
    done = {}
    for key, opts in exports.items():
        t = registry.get(key)
        with written_but(out, f"its {t.name} export", f"run `mpsconvert export-{key}` on it to retry", ExportError):
            done[key] = flow.export(out, key, replace(opts or t.options(), force=True), True, progress)
    return done


def validation_part(artifact: Path, settings: dict, progress: Progress | None) -> tuple[dict, list, Exception | None]:
    """validate's Apple part, with the settings the PyTorch rows were measured with: ({target key:
    its result, or None without a package}, the records to put into validate's transaction, the
    first failure to raise once everything is recorded)."""
    results, failure = flow.latency(artifact, settings, progress)
    return results, flow.runtime_records(results), failure
