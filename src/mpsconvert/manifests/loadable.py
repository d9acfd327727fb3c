"""What transformers' loaders may read from a model folder: for an artifact, only the files its
manifest lists and hashes (one trust boundary); for any folder, through the bounded readers.

**The boundary.** transformers' loaders read whatever files of a folder they know by name: an
unlisted `chat_template.jinja`, `additional_chat_templates/*.jinja`, `chat_template.json`,
`generation_config.json` (every token EOS), `added_tokens.json` or `special_tokens_map.json`
changed what `generate` does while a pinned `verify` passed. So no loader is pointed at an
artifact: `verified(artifact)` copies the files the manifest lists (all but the weights, which
the runtime streams and hashes itself, the Apple packages and the card) into a private folder,
each read once from the artifact without following a symlink, hashed as it is copied and
compared with the manifest (hashing.copy_verified); loaders read that folder. What they read is
then exactly what was verified, and an unlisted file is never read: each one a loader would
have read is named in a warning ("ignored"). A folder without a manifest (another tool's
checkpoint, a source) is read as it is; `runtime.load` already says it cannot be verified.

**Bounds.** transformers reads these files with the json module (a file nested 100,000 deep ends
in RecursionError), takes their fields as they come (a list where a dict belongs ends in
AttributeError deep inside it), renders the chat template unbounded, and accepts token ids past
the model's embedding (an IndexError at the first such token). So, before and after it reads:

- every JSON file it may read is parsed by `untrusted.read_json` first (size, depth, UTF-8);
- the fields mpsconvert relies on are type-checked (`eos_token_id`, special tokens, added tokens);
- the tokenizer's largest id must fit the model's vocabulary (config.json's `vocab_size`);
- the chat template is rendered by `templates.render` (time, output and memory bounds).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

from ..errors import ArtifactError, MpsconvertError
from ..infra import atomic, tempdirs
from ..infra.untrusted import inside, is_panic, read_json
from ..model import templates
from .hashing import copy_verified
from .layout import CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, weight_files

TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
# where transformers finds a chat template, first match wins (transformers 5: the .jinja file,
# then chat_template.json, then the tokenizer config's `chat_template`)
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", TOKENIZER_CONFIG)
_OWN_JSON = {INDEX_NAME, MANIFEST_NAME}  # read by mpsconvert's own readers, never by a transformers loader
_LOADER_FOLDERS = ("additional_chat_templates",)  # the one subfolder transformers' loaders read (named chat templates)


def loader_files(artifact: Path, manifest) -> list[str]:
    """The listed files of `artifact` a loader may read: the top-level files (and named chat
    templates) the manifest lists, except the weights (the runtime streams and hashes them), the
    index, the manifest and the card. Packages (folders: the Apple exports) are for their own
    runtimes, which verify them."""
    skip = set(weight_files(artifact)) | _OWN_JSON | {"README.md"}
    return [
        rel
        for rel in sorted(manifest.files)
        if rel not in skip and not rel.endswith(".safetensors") and _for_loaders(rel)
    ]


def _for_loaders(rel: str) -> bool:
    """A path transformers' loaders may read: a top-level file, or a named chat template."""
    return "/" not in rel or rel.split("/")[0] in _LOADER_FOLDERS and rel.count("/") == 1


@contextlib.contextmanager
def verified(artifact: Path, manifest=None):
    """A private folder holding the files of `artifact` a transformers loader may read, each
    verified as it was copied (see the module's docstring); `artifact` itself when it has no
    manifest. Every unlisted file is named in a warning: ignored, never read. `manifest`: the one
    the caller verified (a pinned one: used as it is, not read again from the folder)."""
    from .manifest import Manifest
    from .verify import unlisted

    artifact = Path(artifact)
    if manifest is None and not (artifact / MANIFEST_NAME).is_file():
        yield artifact
        return
    manifest = manifest or Manifest.read(artifact)
    with tempdirs.private_tempdir("load") as tmp:
        for rel in loader_files(artifact, manifest):
            copy_verified(
                inside(artifact, rel, what=f"{MANIFEST_NAME} files"),
                tmp / rel,
                manifest.files[rel],
                f"{artifact}/{rel}",
            )
        for rel in unlisted(artifact, manifest):
            if _for_loaders(rel) and not rel.rsplit("/", 1)[-1].startswith(
                atomic.TMP_PREFIX
            ):  # one a loader would have read: said
                warnings.warn(
                    f"{artifact}/{rel} is not listed in {MANIFEST_NAME}: ignored (not verified, never read by a loader)"
                )
        yield tmp


def check_json(folder: Path, where: str, error: type[MpsconvertError] = ArtifactError) -> None:
    """Every JSON file of `folder` that a transformers loader may read, through the bounded reader
    first: too large, too deep, not UTF-8 or not JSON is one line naming the file."""
    for p in sorted(Path(folder).glob("*.json")):
        if p.name not in _OWN_JSON and p.is_file():
            read_json(p, what=f"{where}/{p.name}", error=error, expect=None, fix="re-create the file, or remove it")


def _ids_ok(v) -> bool:
    return (
        v is None
        or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)
        or (isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v))
    )


def _check_fields(folder: Path, where: str, error: type[MpsconvertError]) -> None:
    """The fields of the tokenizer and generation files that transformers takes as they come."""
    fix = "fix the file, or remove it"

    def body(name):
        p = folder / name
        return read_json(p, what=f"{where}/{name}", error=error, expect=dict, fix=fix) if p.is_file() else {}

    tc = body(TOKENIZER_CONFIG)
    bad = None
    if not isinstance(tc.get("added_tokens_decoder", {}), dict) or not all(
        isinstance(v, dict) and isinstance(v.get("content"), str) for v in tc.get("added_tokens_decoder", {}).values()
    ):
        bad = "added_tokens_decoder is not a map of token ids to {content: ...} records"
    elif not all(isinstance(k, str) and k.isdigit() for k in tc.get("added_tokens_decoder", {})):
        bad = "added_tokens_decoder has a key that is not a token id"
    elif not isinstance(tc.get("chat_template"), (str, list, type(None))):
        bad = "chat_template is neither text nor a list of named templates"
    elif not isinstance(tc.get("model_max_length", 0), (int, float)) or isinstance(tc.get("model_max_length"), bool):
        bad = "model_max_length is not a number"
    else:
        for k in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
            if not isinstance(tc.get(k), (str, dict, type(None))):
                bad = f"{k} is {type(tc.get(k)).__name__}, not a token"
    if bad:
        raise error(f"{where}/{TOKENIZER_CONFIG}: {bad}", fix)
    added = body("added_tokens.json")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in added.values()):
        raise error(f"{where}/added_tokens.json: every token must map to a token id", fix)
    stm = body("special_tokens_map.json")
    if not all(isinstance(v, (str, dict, list, type(None))) for v in stm.values()):
        raise error(f"{where}/special_tokens_map.json: a special token is neither text nor a token record", fix)
    gc = body(GENERATION_CONFIG)
    for k in ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id"):
        if not _ids_ok(gc.get(k)):
            raise error(
                f"{where}/{GENERATION_CONFIG}: {k} is {str(gc.get(k))[:40]!r}, not a token id or a list of them", fix
            )


def vocab_size(folder: Path, where: str, error: type[MpsconvertError] = ArtifactError) -> int | None:
    """config.json's `vocab_size` (its text_config's for a multimodal model), None when it has none."""
    p = Path(folder) / CONFIG_NAME
    if not p.is_file():
        return None
    cfg = read_json(p, what=f"{where}/{CONFIG_NAME}", error=error)
    for c in (cfg, cfg.get("text_config")):
        if isinstance(c, dict) and isinstance(c.get("vocab_size"), int) and not isinstance(c.get("vocab_size"), bool):
            return c["vocab_size"]
    return None


def tokenizer(
    folder: Path,
    where: str | None = None,
    *,
    error: type[MpsconvertError] = ArtifactError,
    trust_remote_code: bool = False,
    check_vocab: bool = True,
):
    """The tokenizer in `folder` (AutoTokenizer): of an artifact, read from its verified files
    only (`verified`); its files read through the bounded readers first; any failure is one
    `error` line naming the files. `where`: the folder as the user knows it (the artifact, when
    `folder` is the copy of its verified files)."""
    folder = Path(folder)
    if where is None and (folder / MANIFEST_NAME).is_file():  # an artifact: its verified files only
        with verified(folder) as view:
            return tokenizer(
                view, str(folder), error=error, trust_remote_code=trust_remote_code, check_vocab=check_vocab
            )
    from transformers import AutoTokenizer

    where = where or str(folder)
    check_json(folder, where, error)
    _check_fields(folder, where, error)
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except MpsconvertError:
        raise
    except (
        BaseException
    ) as e:  # a tokenizer file of the wrong shape: transformers' TypeError, ValueError, KeyError, a Rust panic ...
        if not isinstance(e, Exception) and not is_panic(e):  # Ctrl-C, SystemExit
            raise
        files = ", ".join(
            sorted(
                p.name
                for p in folder.iterdir()
                if p.name.startswith(
                    ("tokenizer", "special_tokens", "added_tokens", "vocab", "merges", "chat_template")
                )
            )
        )
        raise error(
            f"{where} has no usable tokenizer ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}; "
            f"read from {files or 'no tokenizer files'})",
            "quantize a source that ships its tokenizer files, or copy them into the artifact",
        ) from None
    n = vocab_size(folder, where, error) if check_vocab else None
    if n is not None:
        vocab = tok.get_vocab()
        top = max(vocab.values(), default=-1)
        if top >= n:
            token = next(t for t, i in vocab.items() if i == top)
            raise error(
                f"{where}: the tokenizer has token {token[:40]!r} with id {top}, past the model's vocabulary of {n} "
                f"({CONFIG_NAME} vocab_size): the model has no embedding for it",
                "fix the tokenizer files (added tokens)",
            )
    tok._mpsconvert_template_file = (
        f"{where}/{next((f for f in TEMPLATE_FILES if (folder / f).is_file()), TOKENIZER_CONFIG)}"
    )
    if getattr(tok, "chat_template", None):
        templates.warm()  # the renderer's start overlaps the model's load
    return tok


def start_renderer(folder: Path) -> bool:
    """Start the chat template renderer's worker now where `folder` (an artifact) ships a chat
    template, so that its start (a Python process importing transformers: seconds on a GPU host)
    overlaps the model's load rather than delaying the first token. Reads only whether a template
    file is there (tokenizer_config.json through the bounded reader); the tokenizer's own load
    checks the files. Returns whether it started one."""
    folder = Path(folder)
    has = any((folder / f).is_file() for f in TEMPLATE_FILES[:2])
    if not has and (folder / TOKENIZER_CONFIG).is_file():
        try:
            has = bool(read_json(folder / TOKENIZER_CONFIG, what=TOKENIZER_CONFIG).get("chat_template"))
        except (MpsconvertError, AttributeError):
            return False  # the tokenizer's load says what is wrong with the file
    if has:
        templates.warm()
    return has


def generation_config(folder: Path, where: str | None = None, *, error: type[MpsconvertError] = ArtifactError):
    """transformers' GenerationConfig of `folder` (of an artifact: from its verified files only;
    None when it has no generation_config.json), read through the bounded reader and
    type-checked first."""
    folder = Path(folder)
    if where is None and (folder / MANIFEST_NAME).is_file():  # an artifact: its verified files only
        with verified(folder) as view:
            return generation_config(view, str(folder), error=error)
    from transformers import GenerationConfig

    where = where or str(folder)
    if not (folder / GENERATION_CONFIG).is_file():
        return None
    check_json(folder, where, error)
    _check_fields(folder, where, error)
    try:
        return GenerationConfig.from_pretrained(str(folder))
    except Exception as e:
        raise error(
            f"{where}/{GENERATION_CONFIG} cannot be read ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:120] if str(e) else ''})",
            "fix the file, or remove it",
        ) from None


def chat_ids(tok, messages: list[dict]) -> list[int]:
    """The token ids of `messages` in the tokenizer's chat template, as `apply_chat_template(...,
    add_generation_prompt=True, tokenize=True)` gives them, the template rendered with bounds
    (templates.render)."""
    where = getattr(tok, "_mpsconvert_template_file", "the tokenizer")
    try:
        template = tok.get_chat_template()
    except Exception as e:  # a template name that is not there, a list of templates without "default"
        raise ArtifactError(
            f"the chat template in {where} cannot be used "
            f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})",
            "fix the chat template, or pass `use_template=False`",
        ) from None
    text = templates.render(template, messages, where, add_generation_prompt=True, **tok.special_tokens_map)
    return encode(tok, text, add_special_tokens=False)


def encode(tok, text: str, **kw) -> list[int]:
    """`tok(text, **kw)`'s input ids; a Rust panic of the tokenizer (a pre-tokenizer regex that
    backtracks past Onig's limit on this text: `pyo3_runtime.PanicException`, which `except
    Exception` misses) is one line naming the tokenizer."""
    try:
        return list(tok(text, **kw)["input_ids"])
    except BaseException as e:
        if not is_panic(e):
            raise
        raise ArtifactError(
            "the tokenizer failed on this text (its Rust code panicked: "
            f"{str(e).splitlines()[0][:120] if str(e) else 'no message'})",
            "a pre-tokenizer regex in tokenizer.json backtracks too much on it: fix tokenizer.json, or change the text",
        ) from None
