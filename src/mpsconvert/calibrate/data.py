"""Calibration text: where it comes from, and which token windows are drawn from it.

Sources: a text file (documents separated by blank lines), a JSONL/JSON/parquet file with a
`text` field, a Hugging Face dataset repo id (downloaded with huggingface_hub into its cache,
so HF_HUB_OFFLINE and HF_HUB_CACHE apply), or the small built-in set shipped with the package.
Drawing is a pure function of (documents, tokenizer, num_samples, seq_len, seed), and what was
drawn is recorded so that a run can be repeated and audited from the manifest alone.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataError
from ..infra.texts import BUILTIN, READABLE, read_documents
from ..manifests.hashing import sha256_file

DATASET_PATTERNS = ["*" + s for s in READABLE]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
# A window shorter than this carries too little context to be worth a forward pass.
MIN_WINDOW_TOKENS = 16


@dataclass
class Corpus:
    texts: list[str]
    source: dict  # kind, where, files with sha256, combined sha256, documents


@dataclass
class Samples:
    input_ids: list[list[int]]
    drawn: list[dict] = field(default_factory=list)  # {"doc", "start", "tokens"} per sample

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.input_ids)


def _combined_sha256(files: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name, digest in sorted(files.items()):
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()


def _dataset_files(root: Path, what: str, fix: str) -> list[Path]:
    """The readable files of a dataset folder (its training split where it has splits); none is
    one DataError: "`what` holds no ... files", then `fix`."""
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in READABLE and not p.name.startswith(".")
    )
    files = [p for p in files if p.name.lower() not in ("dataset_infos.json", "dataset_info.json", "state.json")]
    # A dataset with splits: calibrate on the training split only, never on its test data.
    train = [p for p in files if "train" in p.relative_to(root).as_posix().lower()]
    if not files:
        raise DataError(f"{what} holds no .parquet/.jsonl/.json/.txt files", fix)
    return train or files


def load(spec: str | None, revision: str | None = None, token: str | None = None) -> Corpus:
    """Read the documents of a calibration source (None: the built-in set)."""
    if spec is None:
        return _from_files("builtin", "mpsconvert/data/builtin.jsonl", BUILTIN.parent, [BUILTIN])
    path = Path(spec).expanduser()
    if path.is_file():
        return _from_files("file", str(path.resolve()), path.parent, [path])
    if path.is_dir():
        files = _dataset_files(path, str(path), "point `data` at a file or a dataset folder")
        return _from_files("folder", str(path.resolve()), path, files)
    if not _REPO_ID.match(spec):
        raise DataError(
            f"`data={spec!r}` is neither a file, a folder nor a dataset repo id",
            "give a .txt/.jsonl/.parquet file or an id like org/name",
        )
    return _from_dataset(spec, revision, token)


def _from_dataset(repo_id: str, revision: str | None, token: str | None) -> Corpus:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        root = Path(
            snapshot_download(
                repo_id, repo_type="dataset", revision=revision, token=token, allow_patterns=DATASET_PATTERNS
            )
        )
    except RepositoryNotFoundError as e:
        raise DataError(
            f"dataset {repo_id!r} not found on the hub (or it is private)", "check the id, or pass `token`"
        ) from e
    except LocalEntryNotFoundError as e:
        raise DataError(
            f"dataset {repo_id!r} is not in the local Hugging Face cache and the hub cannot be reached",
            "connect to the internet, unset HF_HUB_OFFLINE, or give a local file",
        ) from e
    except HfHubHTTPError as e:
        raise DataError(
            f"downloading dataset {repo_id!r} failed: {str(e).splitlines()[0]}", "check the id and your network"
        ) from e
    files = _dataset_files(root, f"dataset {repo_id!r}", "choose a dataset with a 'text' column")
    corpus = _from_files("dataset", repo_id, root, files)
    corpus.source["commit"] = root.name if re.fullmatch(r"[0-9a-f]{40}", root.name) else None
    corpus.source["revision"] = revision
    return corpus


def _from_files(kind: str, where: str, root: Path, files: list[Path]) -> Corpus:
    texts: list[str] = []
    hashes: dict[str, str] = {}
    for f in files:
        texts.extend(t for t in read_documents(f) if t.strip())
        hashes[f.relative_to(root).as_posix()] = sha256_file(f)
    if not texts:
        raise DataError(f"calibration data {where} holds no non-empty text", "give a file with some text in it")
    source = {"kind": kind, "id": where, "files": hashes, "sha256": _combined_sha256(hashes), "documents": len(texts)}
    return Corpus(texts=texts, source=source)


def draw(corpus: Corpus, tokenizer, num_samples: int, seq_len: int, seed: int) -> Samples:
    """Deterministic token windows: the first `num_samples` documents of a seeded shuffle, taken
    round-robin (window 0 of each, then window 1 of each, ...), so every drawn document is used
    before any document gives a second window, and a large corpus costs only N tokenizations."""
    if num_samples < 1 or seq_len < MIN_WINDOW_TOKENS:
        raise DataError(f"`num_samples` must be >= 1 and `seq_len` >= {MIN_WINDOW_TOKENS}", "pass larger values")
    order = list(range(len(corpus.texts)))
    random.Random(seed).shuffle(order)
    docs = [
        (d, tokenizer(corpus.texts[d], add_special_tokens=True, verbose=False)["input_ids"])
        for d in order[:num_samples]
    ]
    samples = Samples(input_ids=[])
    w = 0
    while docs:
        kept = []
        for doc, ids in docs:
            window = ids[w * seq_len : (w + 1) * seq_len]
            if len(window) < min(MIN_WINDOW_TOKENS, seq_len) or (w > 0 and len(window) < seq_len // 4):
                continue  # this document has no (further) window worth a forward pass
            kept.append((doc, ids))
            samples.input_ids.append(list(window))
            samples.drawn.append({"doc": doc, "start": w * seq_len, "tokens": len(window)})
            if len(samples.input_ids) == num_samples:
                return samples
        docs, w = kept, w + 1
    if not samples.input_ids:
        raise DataError(
            "no calibration document is long enough to tokenize into a window",
            f"give documents of at least {MIN_WINDOW_TOKENS} tokens",
        )
    return samples


def short(samples: Samples, num_samples: int, seq_len: int) -> bool:
    """Whether the text fell short of what was asked: fewer windows than --num-samples, or
    windows so short (documents shorter than --seq-len) that under half the tokens were seen."""
    return len(samples.input_ids) < num_samples or samples.tokens < num_samples * seq_len // 2


def short_text(samples: Samples, num_samples: int, seq_len: int, source: dict) -> str | None:
    """The warning for the user's own calibration text that fell `short`: scales from little text
    can miss activations that other text makes. None where it sufficed, and for the built-in set,
    which is small by design (18 documents, ~2,600 tokens: every default run would warn) and
    measured enough for SmolLM2 (docs/calibration.md); calibrate's summary line says what it gave."""
    if source.get("kind") == "builtin" or not short(samples, num_samples, seq_len):
        return None
    return (
        f"the calibration text gave {len(samples.input_ids)} windows of the {num_samples} asked for and "
        f"{samples.tokens} tokens of the {num_samples * seq_len} ({source.get('documents')} documents in "
        f"{source.get('id')}, windows of up to {seq_len} tokens); scales from little text can miss activations "
        "that other text makes: give more (text like the model's use) with --calib-data (a file, folder or "
        "dataset id), or ask for fewer --num-samples"
    )
