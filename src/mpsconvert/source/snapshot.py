"""Model id / folder / revision -> a local snapshot we can convert, without running any code.

Hub repos are fetched with huggingface_hub (its cache, token and offline mode), and only the
files conversion needs. Pickle checkpoints (.bin, .pt, ...) are never downloaded or opened.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SourceError
from ..format.fp8_source import SourceFP8, source_fp8
from ..infra import filesystem
from ..infra.untrusted import check_model_config, inside, one_line, read_json
from ..manifests.hashing import BackgroundHasher
from ..manifests.layout import CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, MODEL_INDEX, SINGLE_FILE, is_plain_shard_name

# What conversion needs from a repo: weights, their index, configs, tokenizer and chat files.
ALLOW_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "*.json",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.jinja",
    "*.py",  # only used when the user passes --trust-remote-code
    "*.md",
]
# AppleDouble companions (`._*`) that a repo uploaded from a Mac's external drive may carry: not model files.
IGNORE_PATTERNS = ["._*", "*/._*"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Non-weight files copied into the artifact as they are.
COPY_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".md", ".py")
SKIP_COPY = {CONFIG_NAME, INDEX_NAME, MANIFEST_NAME}
DIFFUSERS_WEIGHTS = (
    "diffusion_pytorch_model.safetensors"  # a diffusers component's weights (+ ".index.json" when sharded)
)
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class DiffusionSource:
    """Where a diffusion model's transformer is: a pipeline's component folder, a component
    folder given on its own, or one original-repo `.safetensors` file (its family is read from
    its keys by convert/diffusion/families.py)."""

    layout: str  # "pipeline" | "component" | "single-file"
    root: Path  # the pipeline folder, else the component's folder / the file's folder
    component: str | None  # the pipeline's component quantized ("transformer")
    class_name: str | None  # the component config's `_class_name` (None for a single file)

    def as_dict(self) -> dict:
        return {"layout": self.layout, "component": self.component, "class_name": self.class_name}


@dataclass
class Snapshot:
    """A model on local disk, with where it came from."""

    path: Path
    kind: str  # "hub" or "local"
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None
    weight_files: list[str] = field(default_factory=list)  # safetensors files, in order
    weight_map: dict[str, str] = field(default_factory=dict)  # tensor name -> file
    config: dict = field(default_factory=dict)
    fp8: SourceFP8 | None = None  # the layout of a source that is already FP8
    diffusion: DiffusionSource | None = None  # a diffusers model or an original-repo diffusion file
    # A folder made from one file (a GGUF, unpacked by convert/gguf.py): that file is the source,
    # hashed and recorded as such; `gguf` says what it held (its quantization types).
    origin: Path | None = None
    gguf: dict | None = None
    _hasher: BackgroundHasher | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def total_weight_bytes(self) -> int:
        return sum((self.path / f).stat().st_size for f in self.weight_files)

    def copy_files(self) -> list[str]:
        """Non-weight files to carry into the artifact (tokenizer, generation config, ...)."""
        out = []
        for p in sorted(self.path.rglob("*")):
            rel = p.relative_to(self.path).as_posix()
            if p.is_dir() or rel in SKIP_COPY or any(part.startswith(".") for part in rel.split("/")):
                continue
            if p.suffix in COPY_SUFFIXES and not rel.endswith(".safetensors.index.json"):
                check_inside(self, rel)
                out.append(rel)
        return out

    def known_sha256(self, name: str) -> str | None:
        """The sha256 the HF cache already knows (LFS blobs are named by it), else None."""
        p = self.path / name
        if p.is_symlink():
            blob = Path(os.readlink(p)).name
            if _SHA256.match(blob):
                return blob
        return None

    def start_hashing(self) -> None:
        """Start hashing the weight files whose sha256 the cache does not already know, on a
        background thread (idempotent): a conversion's first seconds are imports and planning,
        during which a second core is otherwise idle."""
        if self._hasher is None:
            self._hasher = BackgroundHasher(
                [self.origin]
                if self.origin is not None
                else [self.path / f for f in self.weight_files if self.known_sha256(f) is None]
            )

    def sha256(self, name: str) -> str:
        """A weight file's sha256: the cache's, or the background hasher's (started if needed)."""
        known = self.known_sha256(name)
        if known is not None:
            return known
        self.start_hashing()
        return self._hasher.sha256(self.path / name)

    def source_files(self) -> dict[str, str]:
        """sha256 of the files the weights came from: the weight files, or the one file the
        folder was made from (`origin`)."""
        if self.origin is not None:
            self.start_hashing()
            return {self.origin.name: self._hasher.sha256(self.origin)}
        return {f: self.sha256(f) for f in self.weight_files}

    def stop_hashing(self) -> None:
        if self._hasher is not None:
            self._hasher.cancel()

    def as_dict(self) -> dict:
        if self.origin is not None:
            return {
                "kind": "local",
                "id": self.origin.name,
                "revision": None,
                "commit": None,
                "path": str(self.origin),
                **({"gguf": self.gguf} if self.gguf else {}),
            }
        return {
            "kind": self.kind,
            "id": self.repo_id or self.path.name,
            "revision": self.revision,
            "commit": self.commit,
            "path": str(self.path) if self.kind == "local" else None,
            **({"fp8": self.fp8.as_dict()} if self.fp8 else {}),
            **({"diffusion": self.diffusion.as_dict()} if self.diffusion else {}),
        }


GGUF_SUFFIX = ".gguf"


def local_path(src: str) -> Path | None:
    """The local path `src` names, or None for a hub repo id (no file access beyond a stat: this
    is how a command knows, before any work, whether it has a folder or must go to the hub).

    Raises:
        SourceError: `src` looks like a path (or exists) but is not there.
    """
    path = Path(src).expanduser()
    if path.exists() or src.startswith((".", "/", "~")) or os.sep in src.strip("/").replace("/", "", 1):
        if not path.exists():
            raise SourceError(f"model folder {src} does not exist", "check the path, or pass a Hugging Face repo id")
        return path
    return None


def is_gguf(path: Path | None) -> bool:
    """A single GGUF file (llama.cpp's format), which `quantize` unpacks (convert/gguf.py)."""
    return path is not None and path.is_file() and path.suffix.lower() == GGUF_SUFFIX


def resolve(
    src: str,
    revision: str | None = None,
    token: str | None = None,
    *,
    diffusion: bool = False,
    component: str | None = None,
) -> Snapshot:
    """A repo id or a folder -> a checked Snapshot. Raises SourceError with a fix on any problem.

    With `diffusion`, a diffusers model (a pipeline with model_index.json, a component folder
    whose config names a diffusers class, or one `.safetensors` file) is resolved too:
    `Snapshot.diffusion` says which, and the snapshot is the component's folder (`component`
    of a pipeline [default: transformer])."""
    path = local_path(src)
    if path is not None:
        no_revision(path, revision)
        if is_gguf(path):
            raise SourceError(
                f"{src} is a GGUF file; only `mpsconvert quantize` reads GGUF files",
                "quantize it first (`mpsconvert quantize FILE.gguf`), then use the artifact, or pass a model folder",
            )
        if diffusion and path.is_file() and path.suffix == ".safetensors":
            return _single_file(path.resolve(), revision)
        if not path.is_dir():
            raise SourceError(
                f"{src} is a file, not a model folder",
                "pass the folder that holds config.json"
                + (", a .safetensors diffusion checkpoint" if diffusion else "")
                + " or a .gguf file to quantize",
            )
        snap = Snapshot(path=path.resolve(), kind="local", revision=revision)
        _from_cache_layout(snap)
    else:
        if not _REPO_ID.match(src):
            raise SourceError(f"{src!r} is neither an existing folder nor a valid repo id", "use org/name or a path")
        snap = _download(src, revision, token)
    if diffusion and is_diffusers_folder(snap.path):
        return _inventory_diffusion(snap, component)
    if component is not None:
        raise SourceError(
            f"`component={component}` applies to a diffusers pipeline, and {src} has no {MODEL_INDEX}",
            "drop `component`, or pass a diffusers pipeline folder or repo",
        )
    return _inventory(snap)


def no_revision(path: Path, revision: str | None) -> None:
    """A local file or folder has no revisions to pick from: `--revision` with one is refused, not
    ignored (it would also be recorded as the source's revision in the manifest and the card)."""
    if revision is not None:
        raise SourceError(
            f"`revision={one_line(revision, 80)}` applies to a hub repo, and {path} is a local "
            f"{'folder' if Path(path).is_dir() else 'file'}",
            "drop `revision` (check that revision out into the folder yourself), or pass the hub repo id",
        )


def is_diffusers_folder(path: Path) -> bool:
    """A diffusers pipeline (model_index.json) or component (config.json naming a diffusers class)."""
    if (path / MODEL_INDEX).is_file():
        return True
    cfg = path / CONFIG_NAME
    if not cfg.is_file():
        return False
    try:
        body = read_json(cfg, what=str(cfg), error=SourceError)
    except SourceError:
        return False
    return isinstance(body.get("_class_name"), str) and "_diffusers_version" in body


def _single_file(path: Path, revision: str | None) -> Snapshot:
    snap = Snapshot(path=path.parent, kind="local", revision=revision, weight_files=[path.name])
    snap.diffusion = DiffusionSource("single-file", path.parent, None, None)
    check_inside(snap, path.name)
    return snap


def _inventory_diffusion(snap: Snapshot, component: str | None) -> Snapshot:
    """A diffusers pipeline or component -> the snapshot of the component to quantize."""
    root = snap.path
    if (root / MODEL_INDEX).is_file():
        index = read_json(
            root / MODEL_INDEX, what=str(root / MODEL_INDEX), error=SourceError, fix=f"fix or re-download {MODEL_INDEX}"
        )
        comps = {
            k: v for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and len(v) == 2 and v[0]
        }
        name = component or ("transformer" if "transformer" in comps else None)
        if name is None or name not in comps:
            have = ", ".join(sorted(comps)) or "none"
            what = f"no component {component!r}" if component else "no transformer"
            raise SourceError(
                f"the pipeline {snap.repo_id or root} has {what} (its components: {have})",
                "pass `component=NAME` of a diffusion transformer (Flux, Wan, Qwen-Image, SD3.5, Z-Image)",
            )
        check_inside(snap, name)
        path = root / name
        if not (path / CONFIG_NAME).is_file():
            raise SourceError(
                f"component {name} of {snap.repo_id or root} has no config.json", "re-download the pipeline"
            )
        layout = "pipeline"
    else:
        if component is not None:
            raise SourceError(
                f"`component={component}` applies to a diffusers pipeline, and {root} is one component",
                "drop `component`",
            )
        name, path, layout = None, root, "component"
    comp = Snapshot(
        path=path.resolve(), kind=snap.kind, repo_id=snap.repo_id, revision=snap.revision, commit=snap.commit
    )
    comp.config = _read_config(path / CONFIG_NAME)
    if "quantization_config" in comp.config:
        raise SourceError(
            f"{path} is already quantized ({str(comp.config['quantization_config'])[:60]})",
            "convert the model's BF16 / FP16 release",
        )
    if not _weights_from_index(comp, path / (DIFFUSERS_WEIGHTS + ".index.json")):
        comp.weight_files = filesystem.files(path, ".safetensors")  # AppleDouble `._*` companions left out
    if not comp.weight_files:
        raise SourceError(f"{path} has no *.safetensors weights", "pass a diffusers model with safetensors weights")
    _check_weight_files(comp, path)
    class_name = comp.config.get("_class_name")
    comp.diffusion = DiffusionSource(layout, root.resolve(), name, class_name if isinstance(class_name, str) else None)
    return comp


def _from_cache_layout(snap: Snapshot) -> None:
    """A snapshot inside huggingface_hub's own cache (HF_HUB_CACHE/models--org--name/snapshots/
    <commit>) keeps its provenance, as a download into it would. A folder merely laid out like
    one elsewhere is a plain local folder: its name is no provenance mpsconvert resolved, and
    the card would otherwise claim a hub model and commit it never saw."""
    from huggingface_hub import constants

    parts = snap.path.parts
    try:
        in_cache = snap.path.is_relative_to(Path(constants.HF_HUB_CACHE).resolve())
    except (OSError, TypeError, ValueError):
        in_cache = False
    if (
        in_cache
        and len(parts) >= 3
        and parts[-2] == "snapshots"
        and parts[-3].startswith("models--")
        and re.fullmatch(r"[0-9a-f]{40}", parts[-1])
    ):
        snap.repo_id = parts[-3][len("models--") :].replace("--", "/")
        snap.commit = parts[-1]


def _download(repo_id: str, revision: str | None, token: str | None) -> Snapshot:
    from huggingface_hub import errors as hf_errors
    from huggingface_hub import snapshot_download

    token = token or os.environ.get("HF_TOKEN") or None
    rev = revision or "main"
    try:
        local = snapshot_download(
            repo_id, revision=revision, token=token, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS
        )
    except hf_errors.GatedRepoError as e:
        raise SourceError(
            f"{repo_id} is gated: your account has not been granted access",
            "accept its terms on huggingface.co, then pass `token` or set HF_TOKEN",
        ) from e
    except hf_errors.RepositoryNotFoundError as e:
        raise SourceError(
            f"{repo_id} was not found on the Hugging Face hub (or it is private)",
            "check the id; for a private repo pass `token` or set HF_TOKEN",
        ) from e
    except hf_errors.RevisionNotFoundError as e:
        raise SourceError(f"{repo_id} has no revision {rev!r}", "check `revision` (a branch, tag or commit)") from e
    except (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled) as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise SourceError(
            f"{repo_id}@{rev} is not in the local Hugging Face cache and {why}",
            "connect and retry, download it first with `hf download`, or pass a local folder",
        ) from e
    except hf_errors.HfHubHTTPError as e:
        raise SourceError(
            f"downloading {repo_id} failed: {str(e).splitlines()[0]}", "retry, or pass a local folder"
        ) from e
    except OSError as e:
        raise SourceError(f"downloading {repo_id} failed: {e}", "check disk space and HF_HOME, then retry") from e
    snap = Snapshot(path=Path(local), kind="hub", repo_id=repo_id, revision=rev)
    snap.commit = Path(local).name
    return snap


def _inventory(snap: Snapshot) -> Snapshot:
    p = snap.path
    cfg = p / CONFIG_NAME
    files = filesystem.files(p)  # macOS's AppleDouble `._*` companions are not model files
    if not cfg.is_file():
        raise SourceError(
            f"{p} has no config.json, so it is not a Hugging Face model folder",
            "pass the folder that holds config.json and *.safetensors",
        )
    check_inside(snap, CONFIG_NAME)
    snap.config = _read_config(cfg)
    if "quantization_config" in snap.config:
        snap.fp8 = source_fp8(
            snap.config["quantization_config"], str(snap.repo_id or p)
        )  # FP8 kept as it is, others refused

    if not _weights_from_index(snap, p / INDEX_NAME):
        st = sorted(f for f in files if f.endswith(".safetensors"))
        if SINGLE_FILE in st:
            st = [SINGLE_FILE]
        snap.weight_files = st
    if not snap.weight_files:
        pickles = sorted(f for f in files if f.endswith(PICKLE_SUFFIXES))
        if not pickles and snap.kind == "hub":
            pickles = _remote_pickles(snap)
        if pickles:
            raise SourceError(
                f"{snap.repo_id or p} has only pickle weights ({', '.join(pickles[:3])}); "
                "mpsconvert never unpickles, since loading a pickle can run arbitrary code",
                "convert them to safetensors first in a trusted environment (e.g. `save_pretrained(..., "
                "safe_serialization=True)`) or use a repo that ships *.safetensors",
            )
        raise SourceError(f"{p} has no *.safetensors weights", "pass a folder or repo with safetensors weights")
    _check_weight_files(snap, p)
    return snap


def _check_weight_files(snap: Snapshot, folder: Path) -> None:
    """Every weight file the snapshot lists is there, inside it (no link out)."""
    for f in snap.weight_files:
        if not (folder / f).is_file():
            raise SourceError(f"weight file {f} listed in {folder.name} is missing", "re-download the model")
        check_inside(snap, f)


def allowed_root(snap: Snapshot) -> Path:
    """Files may live in the snapshot folder, or (HF cache) in its repo folder's blobs; a
    pipeline's component folder (snapshots/<commit>/transformer) is inside such a snapshot."""
    for p in (snap.path, *snap.path.parents[:1]):
        parts = p.parts
        if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith(("models--", "datasets--")):
            return p.parent.parent.resolve()
    return snap.path.resolve()


def check_inside(snap: Snapshot, rel: str) -> Path:
    """Resolve `rel` and refuse odd names and symlinks that lead out of the snapshot (e.g. to
    ~/.ssh): the one path rule (untrusted.inside), with the HF cache's blobs allowed."""
    inside(snap.path, rel, what=f"the model folder {snap.path}", error=SourceError, root=allowed_root(snap))
    return (snap.path / rel).resolve()


def _read_config(cfg: Path) -> dict:
    """A model folder's config.json, checked (check_model_config)."""
    body = read_json(cfg, what=str(cfg), error=SourceError, fix="fix or re-download config.json")
    return check_model_config(body, what=str(cfg), error=SourceError)


def _weights_from_index(snap: Snapshot, index: Path) -> bool:
    """Set the snapshot's weight map and files from its safetensors index; False where it has none."""
    if not index.is_file():
        return False
    snap.weight_map = _read_index(index)
    snap.weight_files = sorted(set(snap.weight_map.values()))
    return True


def _read_index(index: Path) -> dict[str, str]:
    body = read_json(index, what=str(index), error=SourceError, expect=None, fix=f"re-download {INDEX_NAME}")
    wm = body.get("weight_map") if isinstance(body, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise SourceError(f"{index} has no weight_map", f"re-download {INDEX_NAME}")
    for name, f in wm.items():
        if not is_plain_shard_name(f):
            raise SourceError(
                f"{index} maps {name!r} to {f!r}, which is not a plain .safetensors file name in the snapshot",
                "the index is corrupt or malicious; re-download it",
            )
    return wm


def _remote_pickles(snap: Snapshot) -> list[str]:
    """Ask the hub which weight files a repo has, to explain a pickle-only repo (best effort)."""
    try:
        from huggingface_hub import HfApi

        names = HfApi().list_repo_files(snap.repo_id, revision=snap.commit)
    except Exception:  # offline or unreachable: the generic "no safetensors" error follows
        return []
    return sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
