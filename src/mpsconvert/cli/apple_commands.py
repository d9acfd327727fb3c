"""The commands made from the registry of Apple targets (`api.targets()`, each target's settings declared as data:
apple/protocol.py's `Option`): `export-<key>` per target and `quantize` with each target's `--<key>` and options,
by `generated()`, which the command group asks when it lists or runs commands."""

from __future__ import annotations

from pathlib import Path

import click

from .. import api
from . import reports
from .app import friendly_errors
from .check_commands import showing_failed_checks
from .convert_commands import quantize
from .options import click_option, quantize_options
from .progress_bars import progress_bars


def _export_command(key: str, t) -> click.Command:
    """`export-<key>`: export ARTIFACT to the target's package and check it (or only check it)."""

    @friendly_errors
    def run(artifact, force, check_only, no_check, as_json, **kw):
        checks = t.check_options(**{o.name: kw.pop(o.name) for o in t.check_flags})
        with progress_bars() as progress, showing_failed_checks(reports.check_result, as_json):
            if check_only:
                res = api.check(artifact, key, options=checks, progress=progress)
            else:
                res = api.export(
                    artifact,
                    key,
                    options=t.make_options(force=force, **kw),
                    check=False if no_check else checks,
                    progress=progress,
                )
        if check_only:
            reports.check_result(res, as_json)
        else:
            reports.export_result(res, as_json)

    params = [
        click.Argument(["artifact"], type=click.Path(path_type=Path)),
        *(click_option(o) for o in t.export_flags),
        click.Option(["--force"], is_flag=True, help=f"Replace an existing {t.package}."),
        click.Option(["--check-only"], is_flag=True, help=f"Do not export: check the {t.noun} already in ARTIFACT."),
        click.Option(["--no-check"], is_flag=True, help="Skip the checks that follow the export."),
        *(click_option(o) for o in t.check_flags),
        click.Option(["--json", "as_json"], is_flag=True, help="Print the export record and check results as JSON."),
    ]
    return click.Command(f"export-{key}", callback=run, params=params, help=t.help)


_made: dict = {}


def generated() -> dict[str, click.Command]:
    """The commands made from the registry of Apple targets (remade when a target is registered)."""
    now = tuple(api.targets().items())
    if _made.get("for") != now:
        full = click.Command(
            "quantize", callback=quantize.callback, params=[*quantize.params, *quantize_options()], help=quantize.help
        )
        _made.update(
            {"for": now, "commands": {"quantize": full, **{f"export-{k}": _export_command(k, t) for k, t in now}}}
        )
    return _made["commands"]
