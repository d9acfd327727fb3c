"""The `mpsconvert.json` manifest: what went in, what was done, what came out, and checks since.

Everything in it is a pure function of the inputs and options except the `created` block
(timestamp, host), kept apart so that two identical runs give identical files otherwise. What
later steps add (validation, Apple exports and their checks, the hub repo, ...) are typed
records (manifests/records.py), read with `get(Record)` and set with `put(record)`; an existing
artifact's manifest is changed only inside a transaction (manifests/transaction.py), which
re-renders the card with it.
"""

from __future__ import annotations

import json
import platform
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ..errors import ArtifactError, MpsconvertError
from ..infra.atomic import write_text
from ..infra.untrusted import LIMITS, bad_relpath, bounded, parse_json, printable, read_bytes, read_json
from ..infra.untrusted import field as json_field
from ..version import __version__
from .hashing import sha256_file
from .layout import MANIFEST_NAME
from .pin import digest as pin_digest
from .records import Record, compact, kinds

REBUILD_FIX = "re-run `mpsconvert quantize` to rebuild it"

SCHEMA_VERSION = 1
MAX_FILES = int(LIMITS["manifest files"][1])  # a 1000-shard MoE with both Apple packages lists a few thousand
R = TypeVar("R", bound=Record)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def dist_versions(*dists: str) -> dict:
    """{distribution (with `_` for `-`): its installed version, or None}: read from package
    metadata, so that recording them imports nothing (coremltools is slow and noisy to import)."""
    from importlib import metadata

    out = {}
    for dist in dists:
        try:
            out[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist.replace("-", "_")] = None
    return out


def library_versions() -> dict:
    """Versions of the libraries that shape an artifact (None where not installed)."""
    return {
        "mpsconvert": __version__,
        "python": platform.python_version(),
        **dist_versions("torch", "transformers", "safetensors", "huggingface_hub", "compressed-tensors", "coremltools"),
    }


@dataclass
class Manifest:
    source: dict
    recipe: dict
    tensors: dict = field(default_factory=dict)  # name -> record (quantized weights and scales)
    skipped: dict = field(default_factory=dict)  # module -> reason it was left unquantized
    files: dict = field(default_factory=dict)  # output file -> {"sha256", "size"}
    device: str = "cpu"
    versions: dict = field(default_factory=library_versions)
    summary: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # later steps' records, as stored (get / put them typed)
    created: dict = field(default_factory=lambda: {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    schema_version: int = SCHEMA_VERSION

    def _section(self, kind: type[Record]) -> dict:
        return {None: self.extra, "source": self.source, "recipe": self.recipe}[kind.SECTION]

    def get(self, kind: type[R]) -> R | None:
        """The record of this kind, checked (None when there is none).

        Raises:
            ArtifactError: the record is malformed (named, with the step that rewrites it).
        """
        body = self._section(kind).get(kind.KEY)
        return None if body is None else kind.read(body, MANIFEST_NAME)

    def put(self, record: Record) -> None:
        """Set a record (replacing one of its kind); written with the manifest."""
        self._section(type(record))[record.KEY] = record.as_dict()

    def drop(self, kind: type[Record]) -> None:
        self._section(kind).pop(kind.KEY, None)

    def inspect_rows(self) -> list[tuple[str, str]]:
        """What `inspect` shows of the records after the conversion's own blocks, in the manifest's
        order: each record's rows, and a block no record type describes (another version's) as JSON."""
        known = {k.KEY: k for k in kinds() if k.SECTION is None}
        rows = []
        for key, body in self.extra.items():
            rows += self.get(known[key]).inspect_rows() if key in known else [(key, compact(body))]
        return rows

    def to_json(self) -> str:
        body = {
            "schema_version": self.schema_version,
            "tool": "mpsconvert",
            "versions": self.versions,
            "source": self.source,
            "recipe": self.recipe,
            "device": self.device,
            "summary": self.summary,
            "tensors": self.tensors,
            "skipped": self.skipped,
            "files": self.files,
            **self.extra,
            "created": self.created,
        }
        return json.dumps(body, indent=2, sort_keys=False, allow_nan=False) + "\n"

    def write(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_NAME
        write_text(path, self.to_json())
        return path

    @classmethod
    def read(cls, folder: Path) -> "Manifest":
        """The manifest of `folder`, every field it uses checked for type (it is untrusted).

        Raises:
            ArtifactError: no manifest, not JSON, too deep, another schema, or a field of the
                wrong type (a `files` entry that is not a plain relative path with a sha256 and
                a size included).
        """
        path = Path(folder) / MANIFEST_NAME
        if not path.is_file():
            raise ArtifactError(
                f"{folder} has no {MANIFEST_NAME}", "is this an mpsconvert artifact? run `mpsconvert quantize` first"
            )
        return cls.from_body(read_json(path, what=str(path), fix=REBUILD_FIX), path)

    @classmethod
    def from_body(cls, body: dict, path: Path) -> "Manifest":
        """The manifest in `body`, the parsed JSON of `path` (read once by a caller that also
        hashed its bytes: verify_artifact)."""
        fix = REBUILD_FIX
        if body.get("schema_version") != SCHEMA_VERSION:
            raise ArtifactError(
                f"{path} has schema_version {str(body.get('schema_version'))[:40]!r}, this mpsconvert reads "
                f"{SCHEMA_VERSION}",
                "upgrade mpsconvert or rebuild the artifact",
            )
        kw = dict(what=str(path), fix=fix)
        tampered = "the manifest was corrupted or tampered with; re-create the artifact"
        if body.get("tool") != "mpsconvert":  # exactly: a lookalike ("mpsconvert\u200b") is another tool's file
            raise ArtifactError(
                f'{path} says "tool": {printable(repr(body.get("tool")))[:60]}, not "mpsconvert"', tampered
            )
        # the shape every artifact's manifest has: a verify that reads an empty or null field as
        # "nothing to check" would say ok about what it never checked
        files = json_field(body, "files", dict, **kw)
        if not files:
            raise ArtifactError(f"{path} lists no files, so nothing of the artifact could be checked", tampered)
        if len(files) > MAX_FILES:
            raise ArtifactError(
                f"{path} lists {len(files)} files, more than the {MAX_FILES} an artifact can have (untrusted.LIMITS)",
                tampered,
            )
        for name, rec in files.items():
            why = bad_relpath(name)
            if why is not None:
                raise ArtifactError(
                    f"{path} lists a file {name[:80]!r}, which {why}",
                    "the manifest was corrupted or tampered with; re-create the artifact",
                )
            if not (
                isinstance(rec, dict)
                and isinstance(rec.get("sha256"), str)
                and _SHA256.match(rec["sha256"])
                and type(rec.get("size")) is int
                and rec["size"] >= 0
            ):
                raise ArtifactError(f"{path}: the record of {name!r} needs a sha256 (64 hex digits) and a size", fix)
        tensors = json_field(body, "tensors", dict, **kw)
        bounded(
            len(tensors),
            "manifest tensor records",
            what=f"{path} records {len(tensors)} tensors, and the count",
            error=ArtifactError,
            fix=tampered,
        )
        for name, r in tensors.items():
            if not (
                isinstance(r, dict)
                and isinstance(r.get("dtype", ""), str)
                and isinstance(r.get("shape", []), list)
                and all(type(d) is int and d >= 0 for d in r.get("shape", []))
            ):
                raise ArtifactError(
                    f"{path}: the record of tensor {printable(name)[:80]!r} must be an object with a dtype string "
                    "and a shape of non-negative integers",
                    fix,
                )
        for kind in kinds():  # a top-level record present must be an object: `"pinned": null` is not "no pin"
            section = body if kind.SECTION is None else {}
            if kind.KEY in section and not isinstance(section[kind.KEY], dict):
                raise ArtifactError(
                    f"{path}: the `{kind.path()}` record is {type(section[kind.KEY]).__name__}, not an object",
                    kind.FIX or tampered,
                )
        known = {
            "schema_version",
            "tool",
            "versions",
            "source",
            "recipe",
            "device",
            "summary",
            "tensors",
            "skipped",
            "files",
            "created",
        }
        return cls(
            source=json_field(body, "source", dict, **kw),
            recipe=json_field(body, "recipe", dict, **kw),
            tensors=tensors,
            skipped=json_field(body, "skipped", dict, default={}, **kw),
            files=files,
            device=json_field(body, "device", str, default="cpu", **kw),
            versions=json_field(body, "versions", dict, default={}, **kw),
            summary=json_field(body, "summary", dict, default={}, **kw),
            extra={k: v for k, v in body.items() if k not in known},
            created=json_field(body, "created", dict, default={}, **kw),
        )


def pinned_sha256(value: str) -> str:
    """A manifest sha256 the user pinned (`verify --manifest-sha256`, `load(manifest_sha256=)`),
    as 64 lowercase hex digits; anything else (a value cut short when it was copied, say) is bad
    input, said as such rather than as a changed manifest."""
    want = value.strip().lower() if isinstance(value, str) else value
    if not isinstance(want, str) or not _SHA256.match(want):
        shown = repr(value)[:80]
        raise MpsconvertError(
            f"`manifest_sha256={shown}` is not a sha256 (64 hex digits; got "
            f"{len(value) if isinstance(value, str) else type(value).__name__}"
            f"{' characters' if isinstance(value, str) else ''})",
            "copy the whole value `mpsconvert quantize` printed (`mpsconvert verify DIR --json` prints it too)",
        )
    return want


def read_once(folder: Path) -> tuple[Manifest, str, str | None]:
    """The manifest of `folder`, the sha256 of its file and its pin (`pin.digest`), all from one
    read of its bytes: what is hashed is what is parsed (a file swapped between two reads would
    pass a check on the first and be used from the second).

    Raises:
        ArtifactError: no manifest, or one that `Manifest.read` would refuse.
    """
    import hashlib

    manifest, raw, body = read_raw(folder)
    return manifest, hashlib.sha256(raw).hexdigest(), pin_digest(body)


def read_raw(folder: Path) -> tuple[Manifest, bytes, dict]:
    """The manifest of `folder`, the bytes it was parsed from and its parsed body, from one read
    (what is parsed is what a caller hashes or sends).

    Raises:
        ArtifactError: no manifest, or one that `Manifest.read` would refuse.
    """
    path = Path(folder) / MANIFEST_NAME
    raw = read_bytes(path, what=MANIFEST_NAME, fix="re-create the artifact")
    body = parse_json(raw, what=str(path), fix=REBUILD_FIX)
    return Manifest.from_body(body, path), raw, body


def manifest_sha256(folder: Path) -> str:
    """sha256 of the manifest file itself: what a user pins (`verify --manifest-sha256`) to make
    the whole artifact tamper-evident, since the manifest holds every other file's hash."""
    return sha256_file(Path(folder) / MANIFEST_NAME)
