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
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

from .. import atomic
from ..errors import MpsconvertError, SourceError
from ..extras import require
from ..filesystem import cache_dir
from ..progress import Progress, or_silent
from ..source import Snapshot, resolve

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


def describe(path: Path) -> dict:
    """What the GGUF holds, from its header: file type, tensors per quantization type, and the
    bits per weight of the quantized ones (scales included, as `gguf.GGML_QUANT_SIZES` gives
    them), with whether any weight is below 8 bits.

    Raises:
        SourceError: the file is not a GGUF file gguf can read.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # an untrusted file: whatever the reader trips on is a bad input, said in one line
        raise SourceError(f"{path} is not a GGUF file gguf can read ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})",
                          "check the file (a complete download?), or pass a model folder") from e
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
        with atomic.private_tempdir("gguf") as tmp:
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
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype,
                                                                   device_map="cpu", **kw)
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError, OSError, RuntimeError) as e:  # an architecture or type transformers cannot read
        raise SourceError(f"transformers {transformers.__version__} cannot load {path.name}: {str(e).splitlines()[0][:160] if str(e) else type(e).__name__}",
                          "use the model's safetensors repo or folder instead, or a transformers version that reads this GGUF") from e
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

    return {p.name: {"sha256": sha256_file(p), "size": p.stat().st_size} for p in sorted(folder.iterdir())
            if p.name != RECORD and not p.name.startswith(atomic.TMP_PREFIX)}


def stale(folder: Path, digest: str) -> str | None:
    """Why the cached baseline in `folder` cannot be used for the GGUF of sha256 `digest` (absent,
    another GGUF, a file changed, added or missing), or None: every file is the one recorded."""
    from ..untrusted import read_json

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
        record = {"gguf": path.name, "gguf_sha256": digest, "dtype": DEFAULT_DTYPE, "unpacked": how, "files": _listing(tmp)}
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


@contextlib.contextmanager
def validation_baseline(artifact: Path, baseline: str | None, progress: Progress | None = None) -> Iterator[Callable[[dict], None] | None]:
    """validate's baseline of an artifact quantized from a GGUF file: that file, dequantized to
    BF16 as quantize dequantizes it, built once and kept in the user's cache (`cached_baseline`;
    a temporary folder for the block where the cache cannot be written). Yields None when the source is
    no GGUF or a `baseline` was given; else `name(result)`, which names the GGUF file (not the
    temporary folder) as the baseline in validate's `result` and its recorded run; `name.folder`
    is the folder to pass as validate's baseline.

    Raises:
        SourceError: the GGUF is not where the manifest says, or is not the same file.
    """
    from ..manifests.hashing import sha256_file
    from ..manifests.layout import is_artifact
    from ..manifests.manifest import Manifest
    from ..manifests.records import GGUFSource, Validation
    from ..manifests.transaction import transaction

    m = Manifest.read(artifact) if baseline is None and is_artifact(artifact) else None
    g = m.get(GGUFSource) if m is not None else None
    if g is None:
        yield None
        return
    path = Path(str(m.source.get("path")))
    want = (m.source.get("files") or {}).get(path.name)
    if not path.is_file():
        raise SourceError(f"the GGUF this artifact was made from ({path}) is not here", "pass --baseline <the GGUF's model folder or hub id>")
    digest = sha256_file(path)
    if want and digest != want:
        raise SourceError(f"{path} is not the GGUF this artifact was made from (its sha256 differs from the manifest's)",
                          "pass --baseline <the source model>, or restore that file")
    label = f"{path} ({g.unpacked or 'dequantized'})"
    with _baseline(path, digest, progress) as folder:  # validate's baseline runs in bfloat16 whatever quantize unpacked to

        def name(result: dict) -> None:
            result["baseline"] = label
            if result.get("recorded"):
                with transaction(artifact) as t:
                    rec = t.get(Validation)
                    rec.runs[f"{result['device_name']} ({result['device']})"].baseline = label
                    t.put(rec)

        name.folder = folder
        yield name
