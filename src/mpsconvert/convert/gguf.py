"""A GGUF file (llama.cpp's format) as a source: unpacked into a plain safetensors folder.

transformers reads GGUF files (`from_pretrained(folder, gguf_file=name)`), dequantizing every
tensor; the model, its config and its tokenizer are saved as an ordinary Hugging Face folder in
this run's own temporary folder, which the streaming pipeline then reads like any other source.
The GGUF file itself is the source file: hashed (from the start, on the snapshot's thread) and
recorded in the manifest's source with what it held, read from its header by the `gguf` package:
the file type, the quantization type of each tensor and the bits per weight. A GGUF whose weights
are below 8 bits (Q4_1: 5 bits per weight with its scales) already lost what FP8 could have
kept: the FP8 artifact sits on that coarser grid, and the summary and the model card say so.
validate compares with that GGUF dequantized to BF16, which takes minutes on a small CPU: it is
built once per GGUF (by its sha256) and transformers version, kept in the user's cache
(filesystem.cache_dir) with the sha256 of every file, and checked against those before each reuse.

Needs the `gguf` extra (gguf; and accelerate, which transformers >= 5.24 needs to load a GGUF).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import MpsconvertError, SourceError
from ..infra import atomic, tempdirs
from ..infra.extras import require
from ..infra.filesystem import cache_dir
from ..infra.progress import Progress, or_silent
from ..infra.untrusted import bounded, check_model_config, open_regular, printable
from ..source.snapshot import Snapshot, resolve

# The dtype the GGUF is unpacked to when quantize gets no --dtype: what validate's baseline runs in.
DEFAULT_DTYPE = "bfloat16"
_ACCELERATE_FROM = (5, 24)  # transformers loads GGUF files through accelerate from this version on


def requirements(what: str = "reading a GGUF file") -> None:
    """The `gguf` extra, or a one-line MissingExtraError naming it."""
    require("gguf", "gguf", what)
    if _transformers_version() >= _ACCELERATE_FROM:
        require("accelerate", "gguf", what)


def _transformers_version() -> tuple[int, ...]:
    from importlib import metadata

    parts = []
    for p in metadata.version("transformers").split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_BAD_GGUF = "check the file (a complete download? the model's own?), or pass a model folder"


class _Header:
    """What a GGUF's header says, read with every count bounded before it is used: the metadata
    (arrays kept as their length only, but tokens' and merges' count), and each tensor's dims."""

    def __init__(self):
        self.fields: dict[str, object] = {}
        self.tensors: dict[str, tuple[int, ...]] = {}


def read_header(path: Path) -> _Header:
    """Walk a GGUF header (magic, version, tensor and metadata counts, every key and value, every
    tensor's name, dims and type) without building anything, each count checked against
    untrusted.LIMITS and against the bytes left in the file before it is looped over or
    allocated: a declared 2^40-element array or 2^60 tensors is one line, not a long run or an
    allocation. The `gguf` package reads the file only after this passed.

    Raises:
        SourceError: not a GGUF, a count past its limit, or a header that runs past the file.
    """
    name = path.name
    fd = open_regular(path, what=str(path), error=SourceError, fix=_BAD_GGUF)
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise SourceError(
                f"{name} is not a GGUF file mpsconvert reads: {os.fstat(f.fileno()).st_size} bytes long", _BAD_GGUF
            )
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:  # only the header's pages are read
            return _walk(name, buf)


def _walk(name: str, buf) -> _Header:
    pos = 0

    def bad(why: str) -> SourceError:
        return SourceError(f"{name} is not a GGUF file mpsconvert reads: {why}", _BAD_GGUF)

    def take(n: int) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(buf):
            raise bad(f"its header runs past the end of the file (at byte {pos}, {n} more)")
        out = buf[pos : pos + n]
        pos += n
        return out

    def unpack(fmt: str):
        return struct.unpack(fmt, take(struct.calcsize(fmt)))[0]

    def count(limit: str, what: str, least_bytes: int) -> int:
        n = unpack("<Q")
        bounded(n, limit, what=f"{name}: {what}", error=SourceError, fix=_BAD_GGUF)
        if n * least_bytes > len(buf) - pos:
            raise bad(f"{what} ({n}) cannot fit in the {len(buf) - pos} bytes left of its header")
        return n

    def string(what: str) -> str:
        n = count("GGUF string bytes", f"a string of {what}", 1)
        return take(n).decode("utf-8", "replace")

    def value(t: int, what: str, depth: int = 0):
        if t in _SCALARS:
            return unpack(_SCALARS[t])
        if t == _STRING:
            return string(what)
        if t == _ARRAY and depth == 0:
            item = unpack("<I")
            if item not in _SCALARS and item not in (_STRING, _ARRAY):
                raise bad(f"{what} is an array of unknown type {item}")
            least = struct.calcsize(_SCALARS[item]) if item in _SCALARS else 8 if item == _STRING else 12
            n = count("GGUF array length", f"the length of {what}", least)
            if item in _SCALARS:
                take(n * least)  # numbers: only how many
                return _Length(n)
            for _ in range(n):
                value(item, what, depth + 1)
            return _Length(n)
        raise bad(f"{what} has " + ("an array inside an array" if t == _ARRAY else f"unknown value type {t}"))

    if take(4) != b"GGUF":
        raise bad("it does not start with GGUF")
    version = unpack("<I")
    if version not in (2, 3):
        raise bad(f"version {version} (mpsconvert reads versions 2 and 3)")
    n_tensors = count("GGUF tensors", "its tensor count", 24)
    n_kv = count("GGUF metadata keys", "its metadata key count", 12)
    head = _Header()
    for _ in range(n_kv):
        key = string("a metadata key")
        head.fields[key] = value(unpack("<I"), printable(key)[:80])
    for _ in range(n_tensors):
        tname = string("a tensor name")
        dims = unpack("<I")
        bounded(
            dims,
            "GGUF dimensions",
            what=f"{name}: the dimensions of {printable(tname)[:80]}",
            error=SourceError,
            fix=_BAD_GGUF,
        )
        shape = tuple(unpack("<Q") for _ in range(dims))
        elements = 1
        for d in shape:
            elements *= d
        bounded(
            elements,
            "GGUF tensor elements",
            what=f"{name}: the elements of {printable(tname)[:80]} {list(shape)}",
            error=SourceError,
            fix=_BAD_GGUF,
        )
        unpack("<I")
        unpack("<Q")
        head.tensors[tname] = shape
    return head


class _Length(int):
    """An array's length, standing for the array (its values are not kept)."""


# GGUF metadata (`<arch>.<key>`) -> the limit it falls under: what transformers builds the model's config from
_SIZES = {
    "block_count": "layers",
    "embedding_length": "hidden size",
    "feed_forward_length": "intermediate size",
    "attention.head_count": "attention heads",
    "attention.head_count_kv": "attention heads",
    "context_length": "positions",
    "vocab_size": "vocabulary",
    "expert_count": "experts",
    "attention.key_length": "head dim",
    "attention.value_length": "head dim",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def check_header(path: Path) -> _Header:
    """A GGUF's header, checked before transformers builds anything from it: counts bounded
    (read_header), the model's sizes in its metadata bounded, its blocks those the metadata
    counts (0 .. block_count-1, each present), and the embedding as wide as the metadata says.
    A GGUF without tensors or without the sizes would have transformers build its default model
    (32 layers x 4096) and fill it with random weights.

    Raises:
        SourceError: any of these, in one line.
    """
    head = read_header(path)
    name = path.name
    arch = head.fields.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise SourceError(f"{name} names no general.architecture", _BAD_GGUF)
    for key, limit in _SIZES.items():
        v = head.fields.get(f"{arch}.{key}")
        if v is not None:
            bounded(
                int(v) if isinstance(v, int) and not isinstance(v, bool) else v,
                limit,
                what=f"{name}: {arch}.{key}",
                error=SourceError,
                fix=_BAD_GGUF,
            )
    tokens = head.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        bounded(
            int(tokens), "vocabulary", what=f"{name}: tokenizer.ggml.tokens' length", error=SourceError, fix=_BAD_GGUF
        )
    for key in ("block_count", "embedding_length"):
        if not isinstance(head.fields.get(f"{arch}.{key}"), int):
            raise SourceError(
                f"{name} does not say its {arch}.{key}; without it transformers would build a default-size model",
                _BAD_GGUF,
            )
    layers = int(head.fields[f"{arch}.block_count"])
    blocks = {int(m.group(1)) for t in head.tensors if (m := _BLOCK.match(t))}
    if blocks != set(range(layers)):
        missing = sorted(set(range(layers)) - blocks)
        raise SourceError(
            f"{name} says {layers} blocks but holds tensors of "
            + (
                f"no block {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                if missing
                else f"block {max(blocks - set(range(layers)))}"
            ),
            _BAD_GGUF,
        )
    emb = head.tensors.get("token_embd.weight")
    if emb is None:
        raise SourceError(f"{name} holds no token_embd.weight (the token embedding)", _BAD_GGUF)
    if emb[0] != head.fields[f"{arch}.embedding_length"]:
        raise SourceError(
            f"{name}: token_embd.weight is {emb[0]} wide but {arch}.embedding_length says "
            f"{head.fields[f'{arch}.embedding_length']}",
            _BAD_GGUF,
        )
    return head


def describe(path: Path) -> dict:
    """What the GGUF holds, from its header: file type, tensors per quantization type, and the
    bits per weight of the quantized ones (scales included, as `gguf.GGML_QUANT_SIZES` gives
    them), with whether any weight is below 8 bits.

    Raises:
        SourceError: the file is not a GGUF file gguf can read.
    """
    import gguf

    check_header(path)  # every count bounded before gguf's reader loops over any of them
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # an untrusted file: whatever the reader trips on is a bad input, said in one line
        raise SourceError(
            f"{path} is not a GGUF file gguf can read ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:120] if str(e) else ''})",
            "check the file (a complete download?), or pass a model folder",
        ) from e
    types = Counter(t.tensor_type.name for t in reader.tensors)
    bits = {}
    for t in {t.tensor_type for t in reader.tensors}:
        block, size = gguf.GGML_QUANT_SIZES[t]
        bits[t.name] = round(8 * size / block, 4)
    file_type = None
    if (f := reader.fields.get("general.file_type")) is not None:
        try:
            file_type = gguf.LlamaFileType(int(f.contents())).name.removeprefix("MOSTLY_")
        except (ValueError, TypeError):
            file_type = str(f.contents())
    arch = reader.fields.get("general.architecture")
    below = sorted((n for n in types if bits[n] < 8), key=lambda n: bits[n])
    return {
        "file": path.name,
        "architecture": str(arch.contents()) if arch is not None else None,
        "file_type": file_type,
        "tensor_types": dict(sorted(types.items())),
        "bits_per_weight": dict(sorted(bits.items())),
        "below_8_bits": bool(below),
        "lowest": below[0] if below else None,
    }


@contextlib.contextmanager
def unpacked(path: Path, dtype: str | None = None) -> Iterator[Snapshot]:
    """The GGUF at `path` as a Snapshot of a plain safetensors folder (in this run's temporary
    folder, removed after), its provenance the GGUF file: `origin` (hashed as the source file)
    and `gguf` (what it held, and how it was unpacked).

    Args:
        path: the .gguf file.
        dtype: "bfloat16", "float16" or "float32": the dtype transformers dequantizes to
            [default: bfloat16].

    Raises:
        MissingExtraError: gguf (or accelerate) is not installed.
        SourceError: the file cannot be read, or transformers does not support its architecture.
    """
    path = Path(path).resolve()
    requirements(f"quantizing a GGUF file ({path.name})")
    from ..manifests.hashing import BackgroundHasher

    hasher = BackgroundHasher([path])  # the source file's sha256, while the GGUF is read and unpacked
    try:
        info = describe(path)
        with tempdirs.private_tempdir("gguf") as tmp:
            folder = tmp / path.stem
            info["dtype"] = dtype or DEFAULT_DTYPE
            info["unpacked"] = _unpack(path, folder, info["dtype"])  # says how (the summary and card read `gguf`)
            snap = resolve(str(folder))
            snap.origin, snap.gguf, snap._hasher = path, info, hasher
            yield snap
    finally:
        hasher.cancel()


def _unpack(path: Path, folder: Path, dtype: str) -> str:
    """Dequantize the GGUF with transformers and save it as a plain folder; returns how."""
    import torch
    import transformers

    torch_dtype = getattr(torch, dtype)
    kw = {}
    if hasattr(transformers, "GgufConfig"):  # newer transformers keep GGUF blocks packed unless asked to dequantize
        kw["quantization_config"] = transformers.GgufConfig(dequantize=True)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        check_model_config(config.to_dict(), what=f"the config of {path.name}", error=SourceError, fix=_BAD_GGUF)
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch_dtype, device_map="cpu", output_loading_info=True, **kw
        )
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (
        ValueError,
        KeyError,
        NotImplementedError,
        OSError,
        RuntimeError,
    ) as e:  # an architecture or type transformers cannot read
        raise SourceError(
            f"transformers {transformers.__version__} cannot load {path.name}: "
            f"{str(e).splitlines()[0][:160] if str(e) else type(e).__name__}",
            "use the model's safetensors repo or folder instead, or a transformers version that reads this GGUF",
        ) from e
    holes = sorted(info.get("missing_keys") or []) + sorted(k for k, *_ in info.get("mismatched_keys") or [])
    if holes:  # transformers filled them with its random init: a model that is not the file's
        raise SourceError(
            f"{path.name} does not hold {len(holes)} tensor(s) of {type(loaded).__name__} (e.g. {holes[0]}), "
            "which would be random weights",
            _BAD_GGUF,
        )
    config = loaded.config
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # dequantized on load: a plain model now
    with torch.device("meta"):
        plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    plain.load_state_dict(loaded.state_dict(), assign=True)  # the loaded tensors, not a copy
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    del loaded
    plain.save_pretrained(folder)
    tok.save_pretrained(folder)
    return f"dequantized to {dtype} by transformers {transformers.__version__} (gguf_file=)"


# validate's baseline of a GGUF source, built once per GGUF file (by its sha256), dtype and
# transformers version (which does the dequantizing), in the user's cache
BASELINES = "gguf-baselines"
RECORD = "mpsconvert-baseline.json"  # in a cached baseline: the GGUF it came from and every file's sha256


def baseline_folder(digest: str, dtype: str = DEFAULT_DTYPE) -> Path:
    """Where the cached baseline of the GGUF whose sha256 is `digest` lives."""
    from importlib import metadata

    return cache_dir() / BASELINES / f"{digest[:32]}-{dtype}-transformers-{metadata.version('transformers')}"


def _listing(folder: Path) -> dict[str, dict]:
    """Every file of a baseline folder (the record and atomic's marker left out): name -> sha256, size."""
    from ..manifests.hashing import sha256_file

    return {
        p.name: {"sha256": sha256_file(p), "size": p.stat().st_size}
        for p in sorted(folder.iterdir())
        if p.name != RECORD and not p.name.startswith(atomic.TMP_PREFIX)
    }


def stale(folder: Path, digest: str) -> str | None:
    """Why the cached baseline in `folder` cannot be used for the GGUF of sha256 `digest` (absent,
    another GGUF, a file changed, added or missing), or None: every file is the one recorded."""
    from ..infra.untrusted import read_json

    if not (folder / RECORD).is_file():
        return "not built yet"
    try:
        rec = read_json(folder / RECORD, what=RECORD)
    except MpsconvertError as e:
        return str(e)
    if rec.get("gguf_sha256") != digest:
        return "built from another GGUF"
    if _listing(folder) != rec.get("files"):
        return "its files are not the ones recorded"
    return None


def cached_baseline(path: Path, digest: str, progress: Progress | None = None) -> Path:
    """The GGUF at `path` (sha256 `digest`) dequantized to BF16, as a plain folder in the user's
    cache: built once (written whole or not at all, atomic.output_dir, with the sha256 of every
    file recorded), and every later run checks those hashes before using it (a few hundred MB
    hashed instead of minutes of dequantizing).

    Raises:
        SourceError: transformers cannot read the GGUF.
        MpsconvertError: the cache cannot be written (read-only, full, another run building it).
    """
    progress = or_silent(progress)
    target = baseline_folder(digest)
    progress("bf16 baseline", 0, 1, "checking the cached copy")
    if (why := stale(target, digest)) is None:
        progress("bf16 baseline", 1, 1, f"cached ({target})")
        return target
    requirements(f"validating against a GGUF file ({path.name})")
    progress("bf16 baseline", 0, 1, f"dequantizing {path.name} once ({why}); cached for the next runs")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise atomic.os_error(e, target.parent) from e
    with atomic.output_dir(target, force=True, is_ours=lambda p: (p / RECORD).is_file()) as tmp:
        how = _unpack(path, tmp, DEFAULT_DTYPE)
        record = {
            "gguf": path.name,
            "gguf_sha256": digest,
            "dtype": DEFAULT_DTYPE,
            "unpacked": how,
            "files": _listing(tmp),
        }
        atomic.write_text(tmp / RECORD, json.dumps(record, indent=2))
    progress("bf16 baseline", 1, 1, f"built ({target})")
    return target


@contextlib.contextmanager
def _baseline(path: Path, digest: str, progress: Progress | None):
    """The baseline folder for the block: the cached one, or where the cache cannot be written,
    one unpacked in this run's temporary folder (as quantize does)."""
    try:
        folder = cached_baseline(path, digest, progress)
    except SourceError:
        raise
    except MpsconvertError:
        folder = None
    if folder is not None:
        yield folder
        return
    with unpacked(path) as snap:
        yield snap.path


@dataclass(frozen=True)
class GGUFBaseline:
    """validate's baseline of an artifact made from a GGUF file: the BF16 folder to compare with,
    and how the result names it (the GGUF file, not the folder)."""

    folder: Path
    label: str


@contextlib.contextmanager
def validation_baseline(
    artifact: Path, baseline: str | None, progress: Progress | None = None
) -> Iterator[GGUFBaseline | None]:
    """validate's baseline of an artifact quantized from a GGUF file: that file, dequantized to
    BF16 as quantize dequantizes it, built once and kept in the user's cache (`cached_baseline`;
    a temporary folder for the block where the cache cannot be written). Yields None when the source is
    no GGUF or a `baseline` was given; else a GGUFBaseline: `folder` to pass as validate's
    baseline, `label` to name as the baseline in validate's result and its recorded run.

    Raises:
        SourceError: the GGUF is not where the manifest says, or is not the same file.
    """
    from ..manifests.hashing import sha256_file
    from ..manifests.layout import is_artifact
    from ..manifests.manifest import Manifest
    from ..manifests.records import GGUFSource

    m = Manifest.read(artifact) if baseline is None and is_artifact(artifact) else None
    g = m.get(GGUFSource) if m is not None else None
    if g is None:
        yield None
        return
    path = Path(str(m.source.get("path")))
    want = (m.source.get("files") or {}).get(path.name)
    if not path.is_file():
        raise SourceError(
            f"the GGUF this artifact was made from ({path}) is not here",
            "pass `baseline=<the GGUF's model folder or hub id>`",
        )
    digest = sha256_file(path)
    if want and digest != want:
        raise SourceError(
            f"{path} is not the GGUF this artifact was made from (its sha256 differs from the manifest's)",
            "pass `baseline=<the source model>`, or restore that file",
        )
    with _baseline(
        path, digest, progress
    ) as folder:  # validate's baseline runs in bfloat16 whatever quantize unpacked to
        yield GGUFBaseline(folder, f"{path} ({g.unpacked or 'dequantized'})")
