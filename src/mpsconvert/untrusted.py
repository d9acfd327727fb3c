"""Reading what an artifact or a source says about itself: its paths and its JSON.

Everything read from a model folder (a manifest's `files`, an index's shards, a config's
references, any JSON file) may have been written by someone else, so it is checked here, in
one place that every reader uses:

- a path is a plain relative name ("a/b.json": no absolute path, no `..` or `.` part, no empty
  part, no leading dot, no backslash, colon or control character) and, resolved with every
  symlink followed, still lies inside the folder (`inside`);
- a JSON file is at most `MAX_JSON_BYTES`, nested at most `MAX_JSON_DEPTH` deep (the json module
  ends deeper documents in RecursionError), of the top-level type the reader expects
  (`read_json`), and the fields a reader uses have the types it needs (`field`);
- text shown to a person (a terminal line, a model card) has its control characters escaped
  (`printable`): a name can carry ANSI / OSC escape sequences or a line break;
- YAML (a model card's front matter) is at most `MAX_YAML_BYTES`, nested at most `MAX_JSON_DEPTH`
  deep and without aliases, checked on PyYAML's event stream before anything is built
  (`parse_yaml`: its composer recurses, and its scanner is quadratic in flow depth).

Why by hand: the json module bounds neither depth nor size, and pathlib's `is_relative_to` is
lexical; no library says "this name from a file may be opened inside this folder".
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .errors import ArtifactError, MpsconvertError

MAX_JSON_DEPTH = 64
MAX_JSON_BYTES = 256 << 20  # a manifest of a 1000-shard MoE is a few MB; a config a few KB
_ODD = re.compile(r"[\x00-\x1f\x7f\\:]")


# C0 and C1 controls (ESC and CSI start terminal escape sequences), DEL, and the Unicode marks that
# reorder or hide text (bidi overrides and isolates, zero-width characters, the byte-order mark)
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")


def printable(text: Any) -> str:
    """`text` (anything: it is untrusted) as a string whose control characters are shown as
    escapes (`\\x1b`, `\\n`, `\\u202e`): a name read from an artifact or a source is printed as what
    it is, never acted on by a terminal or split across lines."""
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return _UNPRINTABLE.sub(lambda m: named.get(m.group(), f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}"),
                            str(text))


def one_line(text: Any, limit: int = 300) -> str:
    """`text` as one line of plain text (a commit message): control characters removed, runs of
    whitespace made one space, at most `limit` characters."""
    return " ".join(_UNPRINTABLE.sub(" ", str(text)).split())[:limit]


def bad_relpath(rel: Any) -> str | None:
    """Why `rel` is not a plain relative path (None when it is one). Lexical only."""
    if not isinstance(rel, str) or not rel:
        return "is not a non-empty string"
    if len(rel) > 1024:
        return "is longer than 1024 characters"
    if rel.startswith("/"):
        return "is an absolute path"
    if _ODD.search(rel):
        return "has a backslash, colon or control character"
    for part in rel.split("/"):
        if part in ("", ".", ".."):
            return f"has a {part or 'empty'!r} part" if part else "has an empty part"
        if part.startswith("."):
            return f"has a hidden part {part!r}"
    return None


def inside(folder: Path, rel: Any, *, what: str, error: type[MpsconvertError] = ArtifactError, root: Path | None = None,
           fix: str = "the file was corrupted or tampered with; re-create it") -> Path:
    """`folder / rel`, after checking that `rel` is a plain relative path which, with symlinks
    followed, stays inside `root` (default `folder`; the HF cache keeps blobs beside a snapshot).

    Args:
        folder: the folder the path is relative to.
        rel: the path as read from a file (any type: it is untrusted).
        what: where it was read, for the message ("mpsconvert.json files").
        error: the error type to raise.

    Returns:
        The path (not resolved: callers open it through the folder).

    Raises:
        `error`: the name is not plain, or it leads outside the folder.
    """
    why = bad_relpath(rel)
    if why is not None:
        raise error(f"{what} names {str(rel)[:80]!r}, which {why}; only plain relative paths inside the folder are allowed", fix)
    p = Path(folder) / rel
    real = p.resolve()
    base = Path(root or folder).resolve()
    if not real.is_relative_to(base):
        raise error(f"{what} names {rel!r}, a link to {real}, outside the model folder {folder}", "remove the link or copy the real file into the folder")
    return p


def _depth_ok(text: str, limit: int) -> bool:
    """Whether brackets nest at most `limit` deep (strings skipped), without parsing."""
    depth, in_str, esc = 0, False, False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def parse_json(text: str | bytes, *, what: str, error: type[MpsconvertError] = ArtifactError, expect: type = dict,
               fix: str = "re-create the file") -> Any:
    """JSON text -> a value of type `expect`, bounded in depth; any problem is one `error` line."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})", fix) from None
    if not _depth_ok(text, MAX_JSON_DEPTH):
        raise error(f"{what} nests deeper than {MAX_JSON_DEPTH} levels", fix)
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise error(f"{what} is not valid JSON ({str(e).splitlines()[0][:120]})", fix) from None
    if expect is not None and not isinstance(body, expect):
        raise error(f"{what} is a JSON {type(body).__name__}, not {_json_type(expect)}", fix)
    return body


def read_bytes(path: Path, *, what: str | None = None, error: type[MpsconvertError] = ArtifactError,
               fix: str = "re-create the file", max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """A small file's bytes, read once (what is hashed and what is parsed must be the same bytes:
    a file swapped between two reads would pass a check on the first and be used from the second)."""
    path = Path(path)
    what = what or str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise error(f"{what} does not exist", fix) from None
    except OSError as e:
        raise error(f"cannot read {what}: {e.strerror or e}", fix) from None
    if len(raw) > max_bytes:
        raise error(f"{what} is larger than {max_bytes >> 20} MiB", fix)
    return raw


def read_json(path: Path, *, what: str | None = None, error: type[MpsconvertError] = ArtifactError, expect: type = dict,
              fix: str = "re-create the file", max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Read and `parse_json` a file (a missing or unreadable file is `error` too)."""
    what = what or str(path)
    raw = read_bytes(path, what=what, error=error, fix=fix, max_bytes=max_bytes)
    return parse_json(raw, what=what, error=error, expect=expect, fix=fix)


def _json_type(t) -> str:
    ts = t if isinstance(t, tuple) else (t,)
    names = {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number", bool: "true/false",
             type(None): "null"}
    return " or ".join(names.get(x, x.__name__) for x in ts)


def field(body: dict, key: str, types, *, what: str, error: type[MpsconvertError] = ArtifactError, default: Any = ...,
          fix: str = "re-create the file") -> Any:
    """`body[key]` if it has one of `types` (bool is not an int here); `default` when absent
    (no default: absent is an error too)."""
    ts = types if isinstance(types, tuple) else (types,)
    v = body.get(key)
    if key not in body or v is None and type(None) not in ts and default is not ...:
        if default is ...:
            raise error(f"{what} has no {key!r}", fix)
        return default
    if isinstance(v, bool) and bool not in ts or not isinstance(v, ts):
        raise error(f"{what}: {key!r} is {type(v).__name__}, expected {_json_type(types)}", fix)
    return v


MAX_YAML_BYTES = 64 << 10  # a model card's front matter is a few KB


def parse_yaml(text: str, *, what: str, error: type[MpsconvertError] = ArtifactError, fix: str = "fix the file") -> Any:
    """YAML text -> a value (`yaml.safe_load`), bounded in size and depth, aliases refused; any
    problem is one `error` line."""
    import yaml

    if len(text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES:
        raise error(f"{what} is larger than {MAX_YAML_BYTES >> 10} KiB of YAML", fix)
    opens, closes = (yaml.SequenceStartEvent, yaml.MappingStartEvent), (yaml.SequenceEndEvent, yaml.MappingEndEvent)
    depth = 0
    try:
        for ev in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(ev, opens):
                depth += 1
                if depth > MAX_JSON_DEPTH:
                    raise error(f"{what} nests deeper than {MAX_JSON_DEPTH} levels", fix)
            elif isinstance(ev, closes):
                depth -= 1
            elif isinstance(ev, yaml.AliasEvent):
                raise error(f"{what} uses a YAML alias (*{str(ev.anchor)[:40]}), which mpsconvert does not expand", fix)
        return yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError, ValueError) as e:
        raise error(f"{what} is not valid YAML ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})", fix) from None
