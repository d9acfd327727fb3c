"""A pin that lasts: the sha256 a user pins covers what the conversion made, not what later steps add.

The manifest holds every file's hash, so pinning its sha256 pins the whole artifact. But the
steps after the conversion (validate, the Apple exports and their checks, upload) add records,
packages and a re-rendered card to it, and a pin of the whole file broke at the first of them.
So the conversion seals its part (`seal`, the last step of every conversion and of calibration,
which rewrites the weights): the `pinned` record lists the top-level keys, library versions and
files the manifest held then (every file but the card), and `digest` is the sha256 of exactly
that part, as canonical JSON. A later step adds keys, versions and files outside the list; a
change to any listed one (a weight, the tokenizer, the recipe, a tensor record, the list itself)
changes the digest. What the pin does not cover (the card, later records, export packages) is
still checked against the manifest's hashes, as `verify` says.

A manifest without a `pinned` record has only the whole-file pin.
"""

from __future__ import annotations

import hashlib
import json

from .records import AppleExport, Pin, kinds

CARD = "README.md"  # card.CARD_NAME (card imports records; this module is below it)


def seal(manifest) -> None:
    """Record, in `manifest`, the part a pin covers: what it holds now (the conversion's state),
    except the card, the records steps after the conversion write (`Record.AFTER`) and the
    files of the export packages they record (a calibration keeps them)."""
    after = {k.KEY for k in kinds() if k.AFTER and k.SECTION is None}
    packages = [r.package_name + "/" for k in kinds(AppleExport) if (r := manifest.get(k)) is not None]
    body = json.loads(manifest.to_json())
    manifest.put(
        Pin(
            keys=sorted(k for k in body if k not in ("files", "versions", Pin.KEY) and k not in after),
            versions=sorted(manifest.versions),
            files=sorted(f for f in manifest.files if f != CARD and not f.startswith(tuple(packages))),
        )
    )


def digest(body: dict) -> str | None:
    """sha256 of the sealed part of a manifest (its parsed JSON `body`), None when it has no
    `pinned` record. Raises ArtifactError when that record is malformed."""
    if body.get(Pin.KEY) is None:
        return None
    pin = Pin.read(body[Pin.KEY], "mpsconvert.json")
    files = body.get("files") if isinstance(body.get("files"), dict) else {}
    versions = body.get("versions") if isinstance(body.get("versions"), dict) else {}
    part = {
        Pin.KEY: body[Pin.KEY],
        **{k: body.get(k) for k in pin.keys},
        "versions": {k: versions.get(k) for k in pin.versions},
        "files": {f: files.get(f) for f in pin.files},
    }
    text = json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()
