"""Issue 33 (security round 3): the folder around an artifact, sources checked before anything is
written, bounded parsing, cards and terminal output as text, one trust boundary for what loaders
read, upload of exactly the verified files, a pin that lasts, and card + manifest in one swap.
Each attack is reproduced as a user would meet it and must end in one clean line or a correct
result, with nothing written outside, nothing lost and nothing unverified used."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import mpsconvert
from mpsconvert import atomic
from mpsconvert.cli import main
from mpsconvert.errors import ArtifactError, MpsconvertError
from mpsconvert.manifests import layout
from mpsconvert.manifests.manifest import MANIFEST_NAME, Manifest

from . import models

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(res, *says) -> None:
    """Exit 2 with one `error:` line that says each of `says`, and no traceback."""
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and res.output.count("error:") == 1, res.output
    for s in says:
        assert s in res.output, res.output


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama with a byte-level tokenizer that has a chat template, and its artifact."""
    from transformers import AutoTokenizer

    work = tmp_path_factory.mktemp("sec3")
    src = models.runtime_tiny_llama(work / "src", tie=False)
    tok = AutoTokenizer.from_pretrained(str(src))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(src))
    art = work / "art"
    mpsconvert.quantize(src, art)
    return src, art


@pytest.fixture
def art(base, tmp_path):
    dst = tmp_path / "box" / "art"
    shutil.copytree(base[1], dst)
    return dst


def outside_tree(root: Path, *mine: Path) -> dict:
    """Every file under `root` except those under `mine` (what "nothing written outside" compares)."""
    return {k: v for k, v in models.tree_hashes(root).items() if not any((root / k).is_relative_to(m) for m in mine)}


# --------------------------------------------------------------------------- 5. the folder around an artifact


def test_a_planted_lock_symlink_is_an_error_and_creates_nothing_outside(art, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    lock = art.parent / f"{atomic.LOCK_PREFIX}{art.name}"
    lock.symlink_to(outside / "created-by-the-lock")  # dangling: O_CREAT through it would make a file outside
    res = cli("calibrate", art, "--num-samples", "1", "--seq-len", "16")
    one_line_error(res, "symlink under a name mpsconvert reserves", "never followed")
    assert not (outside / "created-by-the-lock").exists() and lock.is_symlink()
    with pytest.raises(MpsconvertError, match="never followed"):
        with layout.update_manifest(art):
            pass
    lock.unlink()
    assert mpsconvert.verify(art).ok


@pytest.mark.parametrize("name", ["old", "old-0123456789ab", "x"])
def test_a_planted_old_symlink_is_never_restored(art, tmp_path, name):
    """The artifact is gone and a link under the reserved `-old` name points outside: a reader must
    not rename it into place (the artifact path would then lead outside)."""
    outside = tmp_path / "outside"
    shutil.copytree(art, outside)
    before = models.tree_hashes(outside)
    shutil.rmtree(art)
    planted = art.parent / f"{atomic.TMP_PREFIX}{art.name}-{name}"
    planted.symlink_to(outside, target_is_directory=True)
    for cmd in (("verify", art), ("inspect", art)):
        res = cli(*cmd)
        assert res.exit_code != 0 and "Traceback" not in res.output, res.output
        assert not os.path.lexists(art), cmd
    with pytest.raises(MpsconvertError, match="never followed"):
        mpsconvert.load(art, device="cpu")
    assert planted.is_symlink() and not os.path.lexists(art) and models.tree_hashes(outside) == before


def test_user_folders_under_the_reserved_prefix_are_never_deleted_or_restored(art):
    mine = art.parent / f"{atomic.TMP_PREFIX}{art.name}-mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    parked = art.parent / f"{atomic.TMP_PREFIX}{art.name}-old"  # an older version's name, or a user's folder
    parked.mkdir()
    (parked / "notes.txt").write_text("mine too")
    with layout.update_manifest(art) as m:  # a writer: recovers what killed runs of ours left, only that
        m.extra["validation"] = {"run": "x"}
    assert mpsconvert.verify(art).ok
    assert (mine / "thesis.tex").read_text() == "years of work" and (parked / "notes.txt").read_text() == "mine too"
    # the artifact gone: a folder that is not ours is not "put back" as it
    shutil.rmtree(art)
    assert cli("verify", art).exit_code != 0
    assert not art.exists() and (parked / "notes.txt").read_text() == "mine too"


def test_another_artifacts_temp_folder_sharing_a_prefix_is_left_alone(art):
    """`.mpsconvert-tmp-art-b-*` is the temp folder of artifact `art-b` (another lock): recovering
    `art` must not take it for its own."""
    other = art.parent / "art-b"
    other_tmp = atomic._new_tmp(other.absolute())
    (other_tmp / "model.safetensors").write_bytes(b"in progress")
    with atomic.writing(art):
        pass
    assert (other_tmp / "model.safetensors").read_bytes() == b"in progress"
    with atomic.writing(other):  # its own writer does remove it
        pass
    assert not other_tmp.exists()


def test_force_replaces_only_a_folder_whose_manifest_parses_and_is_ours(base, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST_NAME).write_text("not json at all")
    (out / "config.json").write_text("{}")
    (out / "thesis.tex").write_text("years of work")
    before = models.tree_hashes(tmp_path)
    one_line_error(cli("quantize", base[0], "-o", out, "--force"), "not an mpsconvert artifact")
    (out / MANIFEST_NAME).write_text(json.dumps({"tool": "something else", "schema_version": 1}))
    before = models.tree_hashes(tmp_path)
    one_line_error(cli("quantize", base[0], "-o", out, "--force"), "not an mpsconvert artifact")
    assert models.tree_hashes(tmp_path) == before


def test_an_unlisted_folder_under_a_package_name_is_never_replaced(art):
    user = art / layout.COREAI_ASSET
    user.mkdir()
    (user / "my-notes.txt").write_text("mine")

    def write(p):
        p.mkdir()
        (p / "weights.bin").write_bytes(b"x")

    with pytest.raises(ArtifactError, match="not a package mpsconvert wrote"):
        layout.check_package_slot(art, layout.COREAI_ASSET, force=True)
    with atomic.writing(art), pytest.raises(ArtifactError, match="not a package mpsconvert wrote"):
        layout.publish_package(art, layout.COREAI_ASSET, write, lambda m, p: None)
    assert (user / "my-notes.txt").read_text() == "mine"
    # a package mpsconvert wrote (listed) is replaced with force, and refused without
    shutil.rmtree(user)
    with atomic.writing(art):
        layout.publish_package(art, layout.COREAI_ASSET, write, lambda m, p: m.extra.update(coreai={"asset": p.name}))
    with pytest.raises(MpsconvertError, match="already exists"):
        layout.check_package_slot(art, layout.COREAI_ASSET, force=False)
    layout.check_package_slot(art, layout.COREAI_ASSET, force=True)


@pytest.mark.extra("coreai")
def test_export_coreai_force_refuses_a_user_folder_named_like_its_asset(art):
    user = art / layout.COREAI_ASSET
    user.mkdir()
    (user / "my-notes.txt").write_text("mine")
    res = cli("export-coreai", art, "--force")
    one_line_error(res, "not a package mpsconvert wrote")
    assert (user / "my-notes.txt").read_text() == "mine"


def test_a_symlinked_artifact_is_written_through_its_target(art, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(art, target_is_directory=True)
    with layout.update_manifest(link) as m:
        m.extra["validation"] = {"run": "through the link"}

    def write(p):
        p.mkdir()
        (p / "weights.bin").write_bytes(b"x" * 100)

    with atomic.writing(link):
        layout.publish_package(link, layout.COREML_PACKAGE, write, lambda m, p: m.extra.update(coreml={"package": p.name}))
    assert link.is_symlink() and link.resolve() == art.resolve()
    m = Manifest.read(art)
    assert m.extra["validation"] == {"run": "through the link"} and (art / layout.COREML_PACKAGE / "weights.bin").is_file()
    assert mpsconvert.verify(link).ok and mpsconvert.verify(art).ok
    assert not [p for p in list(tmp_path.iterdir()) + list(art.parent.iterdir()) if p.name.startswith(atomic.TMP_PREFIX)]


def test_o_an_existing_file_or_a_new_folder_inside_the_source_is_refused(base, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(base[0], src)
    f = tmp_path / "a-file"
    f.write_text("mine")
    before = models.tree_hashes(tmp_path)
    one_line_error(cli("quantize", src, "-o", f), "is a file")
    one_line_error(cli("quantize", src, "-o", src / "fp8"), "inside the source")
    one_line_error(cli("quantize", src, "-o", src / "sub" / "fp8", "--force"), "inside the source")
    assert models.tree_hashes(tmp_path) == before and not (src / "fp8").exists() and not (src / "sub").exists()
