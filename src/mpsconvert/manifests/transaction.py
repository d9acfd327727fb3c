"""Changing an existing artifact: the one way every writer goes (validate's results, the Apple
exports and their checks, calibration written back, the hub repo an upload names).

    with transaction(artifact, verify=True) as t:     # the artifact's lock; its manifest read once
        rec = t.get(CoreMLExport)
        t.put(Validation(runs=...))                   # records, typed (manifests/records.py)
        pkg = t.folder / "model.mlpackage"             # files: written into a staged copy
        ...; t.add_files("model.mlpackage")
    # on leaving: the card (README.md) re-rendered from the new manifest, both written into the
    # staged copy (or earlier, by t.stage()), and the copy swapped in for the artifact: one step a
    # kill cannot split

Nothing of the artifact changes until the block ends without an error. The staged copy is a
folder of hard links (atomic.staged_copy: no space, made when the transaction first needs it)
or, for a writer that rewrites the weights (calibration), an empty folder it fills (`rebuild`).
A kill at any point leaves the old artifact or the new one, whole (the next run's recovery
removes the half-made copy or completes the swap), and the card always has the hash the manifest
records. `finish` is the last step of every artifact's first write too (convert/assemble.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, TypeVar

from ..errors import ArtifactError
from ..infra import atomic, tempdirs
from . import card, pin
from .hashing import folder_files, sha256_file
from .layout import MANIFEST_NAME, is_ours, unlisted
from .manifest import Manifest
from .records import Hub, Record

R = TypeVar("R", bound=Record)


def finish(folder: Path, manifest: Manifest, name: str, card_text: str | None, *, seal: bool = False) -> None:
    """The card rendered from `manifest` into `folder` (its sha256 recorded), then the manifest:
    the last writes of every artifact, new or changed. `name`: the artifact's folder name (the
    card's commands use it; `folder` may be a temporary name). `card_text`: the card now there
    (the source's own card, carried below ours). `seal`: a conversion (or a calibration, which
    rewrites the weights): the part a pin covers is what the manifest holds now (pin.seal)."""
    hub = manifest.get(Hub)
    card.write(folder, manifest, card_text, hub.repo if hub else None, name=name)
    atomic.kill_point("card-written")
    if seal:
        pin.seal(manifest)
    manifest.write(folder)


class Transaction:
    """An artifact being changed (see the module's docstring): its manifest, the records to
    write, and the staged folder that replaces the artifact when the transaction ends."""

    def __init__(self, artifact: Path, manifest: Manifest, stack: contextlib.ExitStack, drop: tuple[str, ...]):
        self.artifact = artifact
        self.manifest = manifest
        self._stack = stack
        self._drop = drop
        self._folder: Path | None = None
        self._rebuilt = False
        self._staged = False
        self._theirs: list[str] = []  # a rebuild's files that are not the artifact's, carried over as they are
        self._card = (
            (artifact / card.CARD_NAME).read_text(encoding="utf-8", errors="replace")
            if (artifact / card.CARD_NAME).is_file()
            else None
        )

    def get(self, kind: type[R]) -> R | None:
        return self.manifest.get(kind)

    def put(self, record: Record) -> None:
        self.manifest.put(record)

    def drop(self, kind: type[Record]) -> None:
        self.manifest.drop(kind)

    @property
    def folder(self) -> Path:
        """The staged copy of the artifact (hard links; `drop`ped names left out), made on first
        use: files written here are what the artifact holds once the transaction ends."""
        if self._folder is None:
            self._folder = self._stack.enter_context(atomic.staged_copy(self.artifact, drop=self._drop))
        return self._folder

    def rebuild(self) -> Path:
        """An empty folder that replaces the artifact instead of a staged copy: for a writer that
        rewrites the weights and carries (verified) what it keeps itself (calibration). Files the
        manifest does not list (a user's notes) are carried over untouched when it is staged, as a
        staged copy keeps them: a rebuild changes the artifact, never what is not the artifact's."""
        if self._folder is not None:
            raise RuntimeError("Transaction.rebuild() must come before any use of .folder")
        self._theirs = unlisted(self.artifact, set(self.manifest.files))
        self._folder = self._stack.enter_context(
            atomic.output_dir(self.artifact, force=True, is_ours=is_ours, held=True)
        )
        self._rebuilt = True  # new weights: the pin is sealed anew
        return self._folder

    def add_files(self, rel: str) -> None:
        """Record the files under `folder/rel` (a package folder or one file) in the manifest with
        their sha256, replacing what was listed under that name."""
        path = self.folder / rel
        files = {k: v for k, v in self.manifest.files.items() if k != rel and not k.startswith(rel + "/")}
        if path.is_dir():
            files.update(folder_files(path, self.folder))
        elif path.is_file():
            files[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
        else:
            raise ArtifactError(f"writing {rel} produced nothing", "report this: the writer wrote no file")
        self.manifest.files = dict(sorted(files.items()))

    def stage(self) -> Path:
        """Write the card and the manifest into the staged folder now and return it: the
        artifact as it will be, for a step that must succeed before anything local changes (an
        upload sends this folder; the swap follows only if it returns). Records put after this
        are not written."""
        if not self._staged:
            if self._rebuilt:
                atomic.carry(self.artifact, self.folder, self._theirs)
            finish(self.folder, self.manifest, self.artifact.name, self._card, seal=self._rebuilt)
            self._staged = True
        return self.folder

    def _commit(self) -> None:
        self.stage()


@contextlib.contextmanager
def transaction(
    artifact: Path,
    *,
    verify: bool = False,
    trust_remote_code: bool = False,
    drop: tuple[str, ...] = (),
    tempdir: str | None = None,
) -> Iterator[Transaction]:
    """Change the artifact at `artifact` as one step (see the module's docstring).

    Args:
        verify: check every hash and the artifact's structure first, before any of it is used
            (verify.check_before_use); an artifact that fails is not changed.
        trust_remote_code: with `verify`: config.json may name code in the artifact.
        drop: top-level names the staged copy leaves out (what the writer replaces: a package).
        tempdir: `kind` of a private system temp folder for the block, made `tempfile`'s default
            (libraries' temporary files, e.g. coremltools' tmp*.mlpackage, are removed with it).

    Raises:
        ArtifactError: no manifest, or (with `verify`) the artifact fails verification.
        MpsconvertError: another run is writing the artifact.
    """
    artifact = Path(artifact).absolute()
    with contextlib.ExitStack() as stack:
        stack.enter_context(atomic.writing(artifact))
        if tempdir is not None:
            stack.enter_context(tempdirs.private_tempdir(tempdir, redirect=True))
        if not (artifact / MANIFEST_NAME).is_file():
            raise ArtifactError(
                f"{artifact} has no {MANIFEST_NAME}", "is this an mpsconvert artifact? run `mpsconvert quantize` first"
            )
        manifest = Manifest.read(artifact)
        if verify:
            from .verify import check_before_use

            check_before_use(artifact, trust_remote_code, manifest=manifest)
        t = Transaction(artifact, manifest, stack, drop)
        yield t
        t._commit()
