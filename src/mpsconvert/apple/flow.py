"""What every Apple target goes through, whatever it is (apple/protocol.py's protocol).

- export: under the artifact's lock, the artifact verified (every hash) before any of it is
  used, the target builds its package into a staged copy of the artifact, the package is checked
  there (without Apple hardware), and the package, its files' sha256, its record with the check
  and the re-rendered card replace the artifact in one swap (manifests/transaction.py): the
  manifest is read once and written once, and a kill at any step leaves an artifact that verifies.
- check: the package already in an artifact, checked and its check recorded (one transaction).
- latency: validate's part, for every target whose package the artifact holds (recorded by the
  caller, with the validation, in one transaction: `runtime_records`).
- decoder: a verified stateful package opened for generate / chat.

A check that ran and failed is recorded first, then raised as an ExportError that carries the
result (the CLI shows it above the one-line error).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import ArtifactError, ExportError, MpsconvertError
from ..infra import atomic
from ..infra.extras import require
from ..infra.progress import Progress, or_silent
from ..manifests import layout
from ..manifests.manifest import Manifest
from ..manifests.records import AppleExport, ExportCheck
from ..manifests.transaction import transaction
from . import registry
from .protocol import Target, check_numbers, package_in


@dataclass
class ExportResult:
    """An Apple package in an artifact: the target, the manifest's record of it and, when
    checked, the checks that run anywhere (`check["ok"]`)."""

    artifact: Path
    package: Path
    record: dict
    check: dict | None = None
    target: str = ""

    @property
    def ok(self) -> bool:
        return self.check is None or bool(self.check.get("ok"))

    @property
    def asset(self) -> Path:  # what Core AI calls its package
        return self.package

    def as_dict(self) -> dict:
        return {"export": self.record, "check": self.check}


def _put(t, rec: AppleExport, check: dict | None) -> None:
    """Record `rec` in the transaction `t`, with its check when one ran, as recorded: without the
    per-tensor rows of the weights read back."""
    if check is not None:
        body = {k: v for k, v in check.items() if k != "weights"}
        body["weights"] = {k: v for k, v in check["weights"].items() if k != "tensors"}
        rec.check = ExportCheck.from_dict(body, "the check")
    t.put(rec)


def _result(artifact: Path, target: Target, rec: AppleExport, check: dict | None) -> ExportResult:
    """The export (and its check) as returned; a check that failed (recorded already) is raised,
    carrying the result for the caller to show."""
    result = ExportResult(artifact, artifact / target.package, rec.as_dict(), check, target.key)
    if not result.ok:
        err = ExportError(
            f"the {target.name} {target.noun} in {artifact} failed its checks: {target.failed(check)}", target.check_fix
        )
        err.result = result
        raise err
    return result


def require_all(keys) -> None:
    """Each named target's extra is installed (said before a conversion whose exports would need them)."""
    for key in keys:
        target = registry.get(key)
        require(target.module, target.extra, f"{target.name} export (--{target.key})")


def export(
    artifact: Path, target: str | Target, opts=None, check=None, progress: Progress | None = None
) -> ExportResult:
    """Export `artifact` to `target`'s package inside it, then (unless `check` is False) check it;
    `opts`: the target's options [default: its defaults]; `check`: its check options, True for
    the defaults, or False. See the module's docstring for how; raises ExportError when the
    checks fail (recorded first)."""
    target = registry.get(target)
    opts = opts if opts is not None else target.options()
    check = target.check_options() if check is True else check or None
    check_numbers(opts, target.export_flags)
    if check is not None:
        check_numbers(check, target.check_flags)
    require(target.module, target.extra, f"{target.name} export")
    progress = or_silent(progress)
    artifact = Path(artifact)
    with transaction(artifact, verify=True, drop=(target.package,), tempdir=target.key) as t:
        layout.check_package_slot(
            t.artifact, target.package, t.manifest.files, opts.force
        )  # someone else's folder: never replaced
        rec = target.build(t.folder, t.manifest, opts, progress)
        t.add_files(target.package)
        atomic.kill_point("package-written")
        res = target.check(t.folder, rec, check, progress) if check is not None else None
        _put(t, rec, res)
    return _result(artifact, target, rec, res)


def check(
    artifact: Path, target: str | Target, opts=None, *, verify: bool = True, progress: Progress | None = None
) -> ExportResult:
    """Check the package of `target` already in `artifact` and record the check (one
    transaction); `verify`: check the artifact's hashes first. Raises ExportError when it fails."""
    target = registry.get(target)
    opts = opts if opts is not None else target.check_options()
    check_numbers(opts, target.check_flags)
    require(target.module, target.extra, f"checking a {target.name} {target.noun}")
    artifact = Path(artifact)
    with transaction(artifact, verify=verify) as t:  # the check is recorded: the lock is taken before it runs
        package_in(t.artifact, target.package, target.key)
        rec = t.get(target.record)
        if rec is None:
            raise ArtifactError(
                f"{artifact / target.package} is not recorded in the manifest",
                f"re-run `mpsconvert export-{target.key} --force`",
            )
        res = target.check(t.artifact, rec, opts, or_silent(progress))
        _put(t, rec, res)
    return _result(artifact, target, rec, res)


def latency(
    artifact: Path, settings: dict, progress: Progress | None = None
) -> tuple[dict[str, dict | None], Exception | None]:
    """validate's Apple part: every target whose package the artifact holds, measured with the
    settings the PyTorch rows were measured with (`ValidationResult.settings`, defaults
    resolved); nothing is recorded here (`runtime_records` gives what to record, for the caller's
    transaction). A failure of one target is its result ({"status": "failed", "reason"}), never
    instead of the others'; the first is returned beside them, for the caller to raise once
    everything is recorded. Returns ({target key: result, or None without a package}, failure)."""
    artifact = Path(artifact)
    progress = or_silent(progress)
    found = Manifest.read(artifact) if layout.is_artifact(artifact) else None
    out: dict[str, dict | None] = {}
    failure = None
    for key, target in registry.TARGETS.items():
        rec = found.get(target.record) if found is not None else None
        if rec is None:
            out[key] = None
            continue
        try:
            out[key] = target.latency(artifact, rec, settings, progress)
        except MpsconvertError as e:
            out[key] = {"status": "failed", "reason": str(e)}
            failure = failure or ExportError(
                f"validation results for {artifact} are recorded, but its {target.name} part failed: {e.problem}",
                e.fix or f"run `mpsconvert validate {artifact}` again once that is fixed",
            )
        except Exception as e:  # a bug: its traceback is kept, once the results are recorded and shown
            out[key] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
            failure = failure or e
    return out, failure


def runtime_records(results: dict[str, dict | None]) -> list:
    """The manifest records of `latency`'s results that ran (one per target)."""
    return [
        registry.TARGETS[key].runtime_record.read(r, f"the {key} runtime result")
        for key, r in results.items()
        if r is not None and r.get("status") == "ran"
    ]


def measure(artifact: Path, target: str | Target, *, write: bool = True, **kw) -> dict:
    """A target's latency beside PyTorch with explicit settings (`Target.measure`, e.g. Core AI's
    prefill_len, decode_tokens, warmup, prefill_repeats, units), recorded unless `write` is False."""
    target = registry.get(target)
    artifact = Path(artifact)
    rec = Manifest.read(artifact).get(target.record)
    if rec is None:
        raise ArtifactError(f"{artifact} has no {target.package}", f"run `mpsconvert export-{target.key}` first")
    res = target.measure(artifact, rec, **kw)
    if write and res.get("status") == "ran":
        with transaction(artifact) as t:
            t.put(target.runtime_record.read(res, f"the {target.key} runtime result"))
    return res


def decoder(artifact: Path, backend: str, stack: contextlib.ExitStack) -> tuple[object, int, str]:
    """The stateful package of target `backend` as (new_conversation, its cache length, what runs
    it), after the whole artifact (the package included) verified: a runtime never opens an
    unchecked package. Contexts to close at the end go onto `stack`."""
    from ..infra.untrusted import inside
    from ..manifests.verify import check_before_use

    target = registry.get(backend)
    target.runnable()  # first: before anyone is sent to export a package this machine cannot run
    m = Manifest.read(artifact) if layout.is_artifact(artifact) else None
    rec: AppleExport | None = m.get(target.record) if m is not None else None
    if rec is None:
        raise ArtifactError(
            f"{artifact} has no {target.name} {target.noun}",
            f"run `mpsconvert export-{target.key} {artifact}` first, or use `backend=torch`",
        )
    if not rec.stateful:
        raise ArtifactError(
            f"the {target.key} export in {artifact} is not a stateful decoder (task {rec.task})",
            f"re-export it with `mpsconvert export-{target.key}` (the default is the stateful decoder)",
        )
    check_before_use(artifact, manifest=m)
    package = inside(artifact, rec.package_name, what=f"the {target.key} export")
    new_conversation, runs_on = target.open_decoder(package, rec, stack.enter_context)
    return new_conversation, rec.max_len, runs_on
