"""The one rule for every output path of every command: may an output be written at a path, and
may `--force` replace what is there (`check_replaceable`). Checked before any work, and again by
`atomic` under the output's lock just before the write."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable

from ..errors import MpsconvertError
from .filesystem import same_or_inside


def check_replaceable(
    target: Path,
    *,
    force: bool,
    is_ours: Callable[[Path], bool] | None = None,
    protect: tuple[Path, ...] = (),
    is_artifact: Callable[[Path], bool] | None = None,
    unlisted: Callable[[Path], list[str]] | None = None,
    delete_unlisted: bool = False,
    file: bool = False,
) -> None:
    """May an output at `target` be written? The one rule for every output path of every command
    (a folder: quantize's artifact, calibrate's rebuild; a `file`: calibrate's scales), checked
    before any work and again under the output's lock just before the write. Refused in one line,
    with nothing touched:

    - `target` lies inside a folder `is_artifact` recognises (an mpsconvert artifact): only the
      artifact's own transaction writes into one (manifests/transaction.py);
    - `target` is, holds or lies inside a path in `protect` (the source, or the artifact a
      command reads): an output never goes where its input is, and a new folder inside a source
      would be carried by its next conversion;
    - `target` exists and is a symlink, or not the kind asked for (a file for a folder output, a
      folder or a fifo for a file output);
    - `target` exists and `is_ours` does not recognise it (our manifest, parsed; our scales
      file): `--force` replaces only what mpsconvert made;
    - `target` exists and `force` is not given;
    - with `force`, `unlisted(target)` names files the output's manifest does not list (a user's
      notes in an artifact): they would be deleted, so they are listed and refused unless
      `delete_unlisted`.
    """
    target = Path(target).absolute()
    real_ = target.resolve()
    what = "the output file" if file else "output"
    if is_artifact is not None:
        for folder in real_.parents:
            if is_artifact(folder):
                raise MpsconvertError(
                    f"{what} {target} lies inside the mpsconvert artifact {folder}, which only mpsconvert's own steps "
                    "(export, validate, calibrate, upload) change",
                    "choose an -o outside the artifact",
                )
    for p in protect:
        src = Path(p).resolve()
        same, holds = same_or_inside(src, real_)  # without case where the volume ignores it (APFS, exFAT)
        if same or holds:
            raise MpsconvertError(
                f"{what} {target} {'is' if same else 'holds'} the source model {src}",
                "choose an -o outside the source folder",
            )
        if same_or_inside(real_, src)[1]:  # also a new folder there: the next conversion of that source would carry it
            raise MpsconvertError(
                f"{what} {target} lies inside the source model {src}", "choose an -o outside the source folder"
            )
    if not os.path.lexists(target):
        return
    st = os.lstat(target)
    if file:
        if not stat.S_ISREG(st.st_mode):
            kind = (
                "a symlink"
                if stat.S_ISLNK(st.st_mode)
                else "a folder"
                if stat.S_ISDIR(st.st_mode)
                else "not a regular file"
            )
            raise MpsconvertError(
                f"{what} {target} is {kind}; mpsconvert never replaces it", "remove it yourself, or choose another -o"
            )
    elif stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "a file"
        raise MpsconvertError(
            f"{what} {target} is {kind}, not an mpsconvert artifact; mpsconvert never replaces it",
            "remove it yourself, or choose another -o",
        )
    if is_ours is not None and not is_ours(target):  # said first: --force would not replace it, so it is not the fix
        ours = (
            "a file mpsconvert wrote"
            if file
            else "an mpsconvert artifact (no mpsconvert.json that parses and names mpsconvert)"
        )
        raise MpsconvertError(
            f"{what} {target} exists and is not {ours}; --force replaces only those",
            "choose another -o, or remove it yourself",
        )
    if not force:
        raise MpsconvertError(f"{what} {target} already exists", "pass --force to replace it, or choose another -o")
    if not file and unlisted is not None and not delete_unlisted and (theirs := unlisted(target)):
        shown = ", ".join(theirs[:5]) + (f" and {len(theirs) - 5} more" if len(theirs) > 5 else "")
        raise MpsconvertError(
            f"output {target} holds {len(theirs)} file{'s' if len(theirs) > 1 else ''} its manifest does not list "
            f"({shown}); --force would delete them with the old artifact",
            "move them out of it, or add --force-delete-unlisted to delete them too",
        )
