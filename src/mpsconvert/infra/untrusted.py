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
  (`parse_yaml`: its composer recurses, and its scanner is quadratic in flow depth);
- a JSON object has each key once (`parse_json`: the json module keeps the last of two, other
  readers the first, so a duplicate is two readers seeing two files), and no NaN / Infinity;
- a file is read only if it is a regular file (`open_regular`: a FIFO would block the reader
  forever, a device never end);
- every number read from a file or the command line that work or memory scales with (layers,
  hidden sizes, vocabularies, GGUF header counts, manifest records, validate's lengths and
  repeats, export decode steps, sampling settings) is checked against one table, `LIMITS`, by
  `bounded`, before anything is built from it; the error names the limit.

Why by hand: the json module bounds neither depth nor size, and pathlib's `is_relative_to` is
lexical; no library says "this name from a file may be opened inside this folder".
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

from ..errors import ArtifactError, MpsconvertError, PromptError

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
    return _UNPRINTABLE.sub(
        lambda m: named.get(
            m.group(), f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}"
        ),
        str(text),
    )


_UNSHOWN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")


def shown_text(text: Any) -> str:
    """Text a model generated, for a terminal: line breaks and tabs kept (it is prose), every
    other control character shown as an escape as `printable` does, so an `ESC]0;...BEL` or
    `ESC[2J` in a vocabulary entry is printed, never acted on."""
    return _UNSHOWN.sub(
        lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", str(text)
    )


def is_panic(e: BaseException) -> bool:
    """Whether `e` is a Rust panic surfaced by pyo3 (`pyo3_runtime.PanicException`, a
    BaseException that `except Exception` misses): a tokenizer's regex past Onig's backtracking
    limit raises one. Caused by the input, so a bad input, not a bug of ours."""
    return type(e).__name__ == "PanicException"


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


def inside(
    folder: Path,
    rel: Any,
    *,
    what: str,
    error: type[MpsconvertError] = ArtifactError,
    root: Path | None = None,
    fix: str = "the file was corrupted or tampered with; re-create it",
) -> Path:
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
        raise error(
            f"{what} names {str(rel)[:80]!r}, which {why}; only plain relative paths inside the folder are allowed", fix
        )
    p = Path(folder) / rel
    real = p.resolve()
    base = Path(root or folder).resolve()
    if not real.is_relative_to(base):
        raise error(
            f"{what} names {rel!r}, a link to {real}, outside the model folder {folder}",
            "remove the link or copy the real file into the folder",
        )
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


class _Duplicate(ValueError):
    pass


class _NotANumber(ValueError):
    pass


def _once(pairs: list) -> dict:
    """An object's pairs as a dict, refusing a key given twice."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise _Duplicate(k)
            seen.add(k)
    return d


def _no_constant(name: str):
    raise _NotANumber(name)


def parse_json(
    text: str | bytes,
    *,
    what: str,
    error: type[MpsconvertError] = ArtifactError,
    expect: type = dict,
    fix: str = "re-create the file",
    nonfinite: bool = False,
) -> Any:
    """JSON text -> a value of type `expect`, bounded in depth, each object's keys once; any
    problem is one `error` line. NaN / Infinity (not JSON, though Python's json reads them) are
    refused unless `nonfinite`: a reader that checks every value itself names the bad one better."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})", fix) from None
    if not _depth_ok(text, MAX_JSON_DEPTH):
        raise error(f"{what} nests deeper than {MAX_JSON_DEPTH} levels", fix)
    try:
        body = json.loads(text, object_pairs_hook=_once, **({} if nonfinite else {"parse_constant": _no_constant}))
    except _Duplicate as e:
        raise error(
            f"{what} has the key {printable(e.args[0])[:80]!r} twice (readers disagree on which one counts)", fix
        ) from None
    except _NotANumber as e:
        raise error(f"{what} holds {e.args[0]}, which is not a number JSON allows", fix) from None
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise error(f"{what} is not valid JSON ({str(e).splitlines()[0][:120]})", fix) from None
    if expect is not None and not isinstance(body, expect):
        raise error(f"{what} is a JSON {type(body).__name__}, not {_json_type(expect)}", fix)
    return body


def open_regular(
    path: Path,
    *,
    what: str | None = None,
    error: type[MpsconvertError] = ArtifactError,
    fix: str = "re-create the file",
    nofollow: bool = False,
    raw_oserror: bool = False,
) -> int:
    """A read-only descriptor of `path`, refused unless it is a regular file: opened without
    blocking (a FIFO's open waits for a writer forever), then checked with fstat on what was
    opened (not on the name, which could be swapped between a check and the open). `nofollow`:
    a symlink is refused too. `raw_oserror`: a missing or unreadable file raises its OSError as it
    is (for callers that handle those themselves); only a file that is not regular is `error`."""
    what = what or str(path)
    flags = (
        os.O_RDONLY
        | getattr(os, "O_NONBLOCK", 0)
        | getattr(os, "O_CLOEXEC", 0)
        | (getattr(os, "O_NOFOLLOW", 0) if nofollow else 0)
    )
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if raw_oserror:
            raise
        if isinstance(e, FileNotFoundError):
            raise error(f"{what} does not exist", fix) from None
        if nofollow and os.path.islink(path):
            raise error(f"{what} is a symlink, which is never followed here", fix) from None
        raise error(f"cannot read {what}: {e.strerror or e}", fix) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a folder"
                if stat.S_ISDIR(mode)
                else "a FIFO"
                if stat.S_ISFIFO(mode)
                else "a socket"
                if stat.S_ISSOCK(mode)
                else "a device"
                if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "not a regular file"
            )
            raise error(f"{what} is {kind}, not a regular file; it is not read", fix)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(
    path: Path,
    *,
    what: str | None = None,
    error: type[MpsconvertError] = ArtifactError,
    fix: str = "re-create the file",
    max_bytes: int = MAX_JSON_BYTES,
) -> bytes:
    """A small file's bytes, read once (what is hashed and what is parsed must be the same bytes:
    a file swapped between two reads would pass a check on the first and be used from the second)."""
    path = Path(path)
    what = what or str(path)
    fd = open_regular(path, what=what, error=error, fix=fix)
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"cannot read {what}: {e.strerror or e}", fix) from None
    if len(raw) > max_bytes:
        raise error(f"{what} is larger than {max_bytes >> 20} MiB", fix)
    return raw


def read_json(
    path: Path,
    *,
    what: str | None = None,
    error: type[MpsconvertError] = ArtifactError,
    expect: type = dict,
    fix: str = "re-create the file",
    max_bytes: int = MAX_JSON_BYTES,
    nonfinite: bool = False,
) -> Any:
    """Read and `parse_json` a file (a missing or unreadable file is `error` too)."""
    what = what or str(path)
    raw = read_bytes(path, what=what, error=error, fix=fix, max_bytes=max_bytes)
    return parse_json(raw, what=what, error=error, expect=expect, fix=fix, nonfinite=nonfinite)


def _json_type(t) -> str:
    ts = t if isinstance(t, tuple) else (t,)
    names = {
        dict: "an object",
        list: "an array",
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "true/false",
        type(None): "null",
    }
    return " or ".join(names.get(x, x.__name__) for x in ts)


def field(
    body: dict,
    key: str,
    types,
    *,
    what: str,
    error: type[MpsconvertError] = ArtifactError,
    default: Any = ...,
    fix: str = "re-create the file",
) -> Any:
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
        raise error(
            f"{what} is not valid YAML ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})", fix
        ) from None


# --------------------------------------------------------------------------- bounded numbers

# Every number read from a file or the command line that time or memory scales with: the one
# table, name -> (lowest, highest). Built models cost time per module even on the meta device
# (1024 Llama layers: 0.3 s; 10^7 kept quantize busy for minutes); the largest public models have
# ~130 layers, 384 experts, a hidden size of 16384 and vocabularies of 256k.
LIMITS: dict[str, tuple[float, float]] = {
    # a model's structure (config.json, a GGUF's metadata, a diffusion component's config)
    "layers": (0, 1024),
    "experts": (0, 4096),
    "hidden size": (1, 65536),
    "intermediate size": (1, 1 << 20),
    "attention heads": (1, 4096),
    "head dim": (1, 16384),
    "vocabulary": (1, 1 << 22),
    "positions": (1, 1 << 24),
    # a GGUF header (llama.cpp: GGML_MAX_DIMS is 4)
    "GGUF tensors": (1, 1 << 20),
    "GGUF metadata keys": (0, 1 << 16),
    "GGUF array length": (0, 1 << 24),
    "GGUF string bytes": (0, 64 << 20),
    "GGUF dimensions": (1, 4),
    "GGUF tensor elements": (1, 1 << 40),
    # a manifest
    "manifest files": (0, 100_000),
    "manifest tensor records": (0, 1 << 20),
    # the API's options (named by their API names; the CLI says the flag)
    "seq_len": (2, 1 << 17),  # a sample scores next-token predictions: two tokens at least
    "max_samples": (1, 1 << 16),
    "prefill_len": (1, 1 << 17),
    "decode_tokens": (1, 1 << 16),
    "repeats": (1, 10_000),
    "rounds": (1, 1_000),
    "warmup": (0, 10_000),
    "decode_steps": (1, 1 << 16),
    "prompt_len": (1, 1 << 17),
    "samples": (1, 10_000),
    "max_len": (1, 1 << 20),
    "max_tokens": (1, 1 << 20),
    "seed": (0, (1 << 64) - 1),
    "temp": (0, 1e4),
    "top_p": (0, 1),
    # text a person typed or piped (characters)
    "prompt characters": (0, 4 << 20),
}


def bounded(
    value: Any,
    limit: str,
    *,
    what: str | None = None,
    error: type[MpsconvertError] = MpsconvertError,
    fix: str | None = None,
    integer: bool = True,
) -> Any:
    """`value` if it is a number (an int where `integer`; a finite number otherwise; never a
    bool) within `LIMITS[limit]`, else one `error` line naming the limit. `what`: where the
    number was read ("config.json num_hidden_layers"; default the limit's own name, an API
    option's in backticks, which the CLI prints as its flag)."""
    lo, hi = LIMITS[limit]
    what = what or (f"`{limit}`" if limit.isidentifier() else limit)
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        raise error(
            f"{what} is {printable(repr(value))[:60]}, not {'an integer' if integer else 'a number'}",
            fix or f"give {'an integer' if integer else 'a number'} in {_span(lo, hi)}",
        )
    if not integer and not math.isfinite(value) or not lo <= value <= hi:
        raise error(
            f"{what} is {printable(repr(value))[:60]}, outside "
            f"{_span(lo, hi)}{'' if what in (limit, f'`{limit}`') else f' (the limit on {limit})'}",
            fix or f"give a value in {_span(lo, hi)}",
        )
    return value


def prompt_length(text: str, what: str, fix: str) -> None:
    """Refuse (one PromptError line) text a person typed or piped that is longer than the limit on
    prompt characters; `what` names it ("the message"), `fix` says what to do instead."""
    limit = int(LIMITS["prompt characters"][1])
    if len(text) > limit:
        raise PromptError(
            f"{what} is {len(text):,} characters, more than {limit:,} (the limit on prompt characters)", fix
        )


def _span(lo, hi) -> str:
    def n(x):
        return f"{int(x):,}" if float(x).is_integer() else str(x)

    return f"{n(lo)}..{n(hi)}"


# A model config's numbers (config.json of a model, a diffusers component, or one built from a
# GGUF's metadata): the keys that size what is built, by the limit they fall under
_SIZE_KEYS = {
    "layers": (
        "num_hidden_layers",
        "num_layers",
        "n_layer",
        "n_layers",
        "num_decoder_layers",
        "decoder_layers",
        "encoder_layers",
        "num_single_layers",
        "layers_per_block",
    ),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
    "hidden size": (
        "hidden_size",
        "n_embd",
        "d_model",
        "joint_attention_dim",
        "in_channels",
        "out_channels",
        "cross_attention_dim",
        "pooled_projection_dim",
        "caption_channels",
    ),
    "intermediate size": (
        "intermediate_size",
        "n_inner",
        "ffn_dim",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
    ),
    "attention heads": (
        "num_attention_heads",
        "n_head",
        "num_key_value_heads",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "num_heads",
    ),
    "head dim": ("head_dim", "attention_head_dim"),
    "vocabulary": ("vocab_size",),
    "positions": ("max_position_embeddings", "n_positions", "original_max_position_embeddings", "n_ctx"),
}
# values a forward pass divides by or raises to: finite, and in a range that computes numbers
MAX_LIST = 4096  # entries of a per-layer list in a config
_EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")
_POSITIVE_KEYS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor")
_NONNEGATIVE_KEYS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
_ROPE_KEYS = ("rope_scaling", "rope_parameters")
# each rule: the keys, the range their (finite, non-bool) numbers must lie in, and that range in words
_NUMBER_RULES = (
    (_EPS_KEYS, lambda v: 0 <= v < 1, "a finite number in [0, 1)"),
    (_POSITIVE_KEYS, lambda v: v > 0, "a finite positive number"),
    (_NONNEGATIVE_KEYS, lambda v: v >= 0, "a finite number >= 0"),
    (("partial_rotary_factor",), lambda v: 0 < v <= 1, "in (0, 1]"),
)


def _given(d: dict, keys) -> list[tuple[str, Any]]:
    """(key, value) for each of `keys` that `d` holds with a value other than None, in `keys`' order."""
    return [(key, d[key]) for key in keys if d.get(key) is not None]


def check_model_config(
    body: dict,
    *,
    what: str = "config.json",
    error: type[MpsconvertError] = MpsconvertError,
    fix: str = "fix config.json (is it the model's own?)",
) -> dict:
    """Refuse a model config whose values would build something no model is (LIMITS: layers,
    experts, hidden and intermediate sizes, heads, head dim, vocabulary, positions) or make the
    model compute garbage (a NaN or negative norm epsilon, a rope factor or theta that is not a
    finite positive number, 0 positions), or whose `model_type` is not a string; sub-configs
    (`text_config`, ...) and rope settings are checked the same way. Before anything is built;
    returns `body`."""
    todo = [(what, body)]
    while todo:
        where, d = todo.pop()
        mt = d.get("model_type")
        if mt is not None and not isinstance(mt, str):
            raise error(f"{where}: model_type is {printable(repr(mt))[:60]}, not a string", fix)
        for limit, keys in _SIZE_KEYS.items():
            for key, v in _given(d, keys):
                for x in (
                    v if isinstance(v, list) and len(v) <= MAX_LIST else [v]
                ):  # per block / per layer lists (diffusers' UNets, some LMs)
                    bounded(x, limit, what=f"{where}: {key}", error=error, fix=fix)
        for keys, ok, want in _NUMBER_RULES:
            for key, v in _given(d, keys):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v) or not math.isfinite(v):
                    raise error(f"{where}: {key} is {printable(repr(v))[:60]}, not {want}", fix)
        for key, rope in _given(d, _ROPE_KEYS):
            if not isinstance(rope, dict):
                raise error(f"{where}: {key} is {type(rope).__name__}, not an object", fix)
            todo.append(
                (
                    f"{where} {key}",
                    {
                        k: v
                        for k, v in rope.items()
                        if k in _POSITIVE_KEYS + _NONNEGATIVE_KEYS or k in _SIZE_KEYS["positions"]
                    },
                )
            )
        todo += [
            (f"{where} {k}", v)
            for k, v in d.items()
            if isinstance(v, dict) and k.endswith("config") and k != "quantization_config"
        ]
    return body
