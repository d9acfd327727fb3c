"""The artifact's file layout, in one place: what each file is called and which files hold the
weights (names only: how an artifact is changed is manifests/transaction.py).

An artifact is a Hugging Face model folder (config.json, safetensors weights, tokenizer files)
plus our manifest. Weights are one `model.safetensors`, or shards named
`model-0000i-of-0000N.safetensors` listed by `model.safetensors.index.json`. Apple exports live
inside the artifact (each target names its package: apple/coreml, apple/coreai) and are listed
in the manifest too.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ArtifactError, MpsconvertError
from ..infra import filesystem
from ..infra.atomic import TMP_PREFIX
from ..infra.untrusted import inside, read_json

MANIFEST_NAME = "mpsconvert.json"
CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MODEL_INDEX = "model_index.json"  # a diffusers pipeline's top-level file
DIFFUSION_FORMATS = ("comfyui", "comfyui-legacy", "diffusers")  # convert/diffusion's FORMATS, as recorded in a manifest


def shard_names(n: int) -> list[str]:
    """The weight file names of an artifact with `n` shards (transformers' own naming)."""
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def is_plain_shard_name(name) -> bool:
    """A `.safetensors` file name with no folder part, no `..` and no leading dot: the only kind
    of name an index may point to (anything else could reach outside the folder)."""
    return (
        isinstance(name, str)
        and name.endswith(".safetensors")
        and "/" not in name
        and "\\" not in name
        and not name.startswith(".")
        and name not in (".", "..")
    )


def read_weight_map(folder: Path) -> dict[str, str] | None:
    """tensor -> shard from the folder's index (None when there is none), every shard a plain name.

    Raises:
        ArtifactError: the index is not valid JSON, has no weight_map, or names a file that is
            not a plain `.safetensors` name.
    """
    index = Path(folder) / INDEX_NAME
    if not index.is_file():
        return None
    body = read_json(index, what=INDEX_NAME, fix="re-create the artifact")
    wm = body.get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(k, str) for k in wm):
        raise ArtifactError(f"{INDEX_NAME} has no weight_map", "re-create the artifact")
    bad = next((f for f in wm.values() if not is_plain_shard_name(f)), None)
    if bad is not None:
        raise ArtifactError(
            f"{INDEX_NAME} names {bad!r}, which is not a plain .safetensors file name in the folder",
            "the index is corrupt or was tampered with; re-create the artifact",
        )
    for f in set(wm.values()):
        inside(folder, f, what=INDEX_NAME)  # a shard that is a symlink out of the folder
    return wm


def weight_files(folder: Path) -> list[str]:
    """The safetensors files holding a model's weights: the index's shards, else
    `model.safetensors`, else every `*.safetensors` in the folder (sorted; AppleDouble `._*`
    files are not weights)."""
    folder = Path(folder)
    wm = read_weight_map(folder)
    if wm is not None:
        return sorted(set(wm.values()))
    if (folder / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    return filesystem.files(folder, ".safetensors")  # macOS's `._*.safetensors` companions left out


def is_artifact(folder: Path) -> bool:
    """Whether `folder` is an mpsconvert artifact (it has our manifest and a config: a model's
    config.json, or a diffusers pipeline's model_index.json)."""
    folder = Path(folder)
    return (folder / MANIFEST_NAME).is_file() and ((folder / CONFIG_NAME).is_file() or (folder / MODEL_INDEX).is_file())


def is_ours(folder: Path) -> bool:
    """Whether `folder` is an artifact `--force` may replace: `is_artifact`, and its manifest a
    regular file (not a link) that parses and says mpsconvert wrote it. Two file names alone
    (an `mpsconvert.json` that is not even JSON) are not enough."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    if not is_artifact(folder) or path.is_symlink():
        return False
    try:
        body = read_json(path, what=str(path))
    except ArtifactError:
        return False
    return body.get("tool") == "mpsconvert" and type(body.get("schema_version")) is int


def unlisted(
    folder: Path, listed: set[str] | None = None, limit: int | None = None, temporary: bool = False
) -> list[str]:
    """Files (and links) in `folder` that its manifest does not list (`listed`: the names it
    lists, else read from the folder's manifest; an unreadable one lists nothing), sorted; macOS's
    AppleDouble companions left out, and a killed run's temporary files unless `temporary`.
    `limit`: stop after that many (enough to refuse a folder that is mostly someone else's)."""
    folder = Path(folder)
    if listed is None:
        try:
            files = read_json(folder / MANIFEST_NAME, what=MANIFEST_NAME).get("files")
        except ArtifactError:
            files = None
        listed = set(files) if isinstance(files, dict) else set()
    listed = set(listed) | {MANIFEST_NAME}
    out = []
    for dirpath, dirs, files in os.walk(folder):  # links are listed, never followed
        here = Path(dirpath).relative_to(folder)
        for name in files + [d for d in dirs if (Path(dirpath) / d).is_symlink()]:
            rel = (here / name).as_posix()
            if (
                rel not in listed
                and not filesystem.is_appledouble(name)
                and (temporary or not (here == Path(".") and name.startswith(TMP_PREFIX)))
            ):
                out.append(rel)
                if limit is not None and len(out) >= limit:
                    return sorted(out)
    return sorted(out)


# What the one output rule (output_rule.check_replaceable) needs to know about mpsconvert's own
# folders: which one `--force` may replace, which files in it are not the artifact's, and that
# nothing but an artifact's own transaction writes inside one.
OUTPUT_RULES = dict(is_ours=is_ours, is_artifact=is_artifact, unlisted=lambda folder: unlisted(folder, limit=1000))


def diffusion_format(manifest) -> str | None:
    """The diffusion format of an artifact ("comfyui" | "comfyui-legacy" | "diffusers"), None for an LLM's."""
    fmt = manifest.recipe.get("format")
    return fmt if fmt in DIFFUSION_FORMATS else None


def check_package_slot(artifact: Path, name: str, files: dict, force: bool) -> None:
    """May an export write the package `name` into the artifact whose manifest lists `files`?
    Where nothing is, or (with `force`) over a package the manifest lists. A folder, file or link
    of someone else's under that name (the manifest lists nothing in it) is never replaced, with
    or without `force`."""
    p = Path(artifact) / name
    if not os.path.lexists(p):
        return
    if p.is_symlink() or not any(k.startswith(name + "/") for k in files):
        raise ArtifactError(
            f"{p} is not a package mpsconvert wrote "
            f"({'a symlink' if p.is_symlink() else 'the manifest lists nothing in it'}), so it is "
            "never replaced",
            "move it out of the artifact, then export again",
        )
    if not force:
        raise MpsconvertError(f"{p} already exists", "pass `force` to replace it")
