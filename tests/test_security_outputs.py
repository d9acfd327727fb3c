"""Outputs: what each command may write, and what it leaves behind.

One rule for every output path (output_rule.check_replaceable): never at or inside the source, never
inside an artifact (only its transaction writes there), an existing file or folder replaced only
with --force and only when mpsconvert made it, and never a user's file deleted without a word
(files an artifact's manifest does not list are named and refused unless
--force-delete-unlisted; a rebuild carries them over). What a killed run leaves beside an
artifact is removed by the next command, reader or writer, when it is provably ours and stale;
a symlink under a reserved name is an error for every command, and folders of the user's or of
another artifact that share the reserved prefix are left alone. Each writing command, killed where
the card and the manifest could part, leaves them together. Each attack ends in one line (exit 2)
with nothing lost or half-written, or in the right result."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mpsconvert
from mpsconvert.errors import ArtifactError, MpsconvertError
from mpsconvert.infra import atomic
from mpsconvert.manifests import layout
from mpsconvert.manifests.layout import MANIFEST_NAME
from mpsconvert.manifests.manifest import Manifest
from mpsconvert.manifests.records import Hub
from mpsconvert.manifests.transaction import transaction

from . import models
from .helpers import COREAI_ASSET, COREML_PACKAGE, cli, one_error

CALIB = ("--num-samples", "1", "--seq-len", "16")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama with a tokenizer (calibration runs on text), and its artifact."""
    work = tmp_path_factory.mktemp("sec-outputs")
    src = models.tiny("llama", work / "src", tokenizer="bpe", dtype=torch.bfloat16)
    return src, mpsconvert.quantize(src, work / "art").output


@pytest.fixture
def box(base, tmp_path):
    """Copies of the source and the artifact side by side, for one test to attack."""
    src = Path(shutil.copytree(base[0], tmp_path / "src"))
    art = Path(shutil.copytree(base[1], tmp_path / "art"))
    return src, art


def tree(root: Path) -> dict:
    """Every entry under `root`: a file's bytes, a link's target, None for a folder."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[p.relative_to(root).as_posix()] = (
            f"-> {os.readlink(p)}" if p.is_symlink() else p.read_bytes() if p.is_file() else None
        )
    return out


# --------------------------------------------------------------------------- 4. outputs that overwrite


def _targets(src: Path, art: Path, tmp: Path) -> dict:
    (tmp / "mine.json").write_text('{"mine": true}')
    (tmp / "dir.json").mkdir()
    (tmp / "link.json").symlink_to(tmp / "mine.json")
    os.mkfifo(tmp / "fifo.json")
    return {  # -o FILE -> what the one line says
        "the source's own weights": (src / "model.safetensors", "the source model"),
        "a new file inside the source": (src / "scales.json", "inside the source model"),
        "an artifact's config.json": (art / "config.json", "inside the mpsconvert artifact"),
        "a new file inside an artifact": (art / "sub" / "scales.json", "inside the mpsconvert artifact"),
        "a file of the user's": (tmp / "mine.json", "not a file mpsconvert wrote"),
        "a folder": (tmp / "dir.json", "is a folder"),
        "a symlink": (tmp / "link.json", "is a symlink"),
        "a fifo": (tmp / "fifo.json", "not a regular file"),
    }


@pytest.mark.parametrize("target", ["the source", "the artifact"])
def test_calibrate_o_never_overwrites_or_writes_inside_what_it_reads(box, tmp_path, target):
    src, art = box
    (art / "sub").mkdir()
    outs = _targets(src, art, tmp_path)
    before = tree(tmp_path)
    if (
        target == "the artifact"
    ):  # the source is no input here: its weights are a file mpsconvert did not write, a new file there is fine
        outs["the source's own weights"] = (src / "model.safetensors", "not a file mpsconvert wrote")
        del outs["a new file inside the source"]
    for name, (out, says) in outs.items():
        one_error(cli("calibrate", src if target == "the source" else art, "-o", out, *CALIB), says)
        with_force = cli("calibrate", src if target == "the source" else art, "-o", out, "--force", *CALIB)
        one_error(with_force, says)
        assert tree(tmp_path) == before, name
    assert mpsconvert.verify(art).ok


def test_calibrate_o_replaces_its_own_scales_file_only_with_force(box, tmp_path):
    src, _ = box
    out = tmp_path / "scales.json"
    assert cli("calibrate", src, "-o", out, *CALIB).exit_code == 0
    first = out.read_bytes()
    assert json.loads(first)["format"] == "mpsconvert-input-scales"
    one_error(cli("calibrate", src, "-o", out, *CALIB), "already exists", "--force")
    assert out.read_bytes() == first
    res = cli("calibrate", src, "-o", out, "--force", "--num-samples", "1", "--seq-len", "24")
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_bytes())["calibration"] != json.loads(first)["calibration"]


def test_an_output_file_that_appears_during_the_work_is_not_overwritten(box, tmp_path, monkeypatch):
    """Checked before the work and again under the lock, just before the write."""
    from mpsconvert.calibrate import artifact as calib

    src, _ = box
    out = tmp_path / "scales.json"
    real = calib.calibrate

    def slow(*a, **kw):
        out.write_text("written by someone else meanwhile")
        return real(*a, **kw)

    monkeypatch.setattr(calib, "calibrate", slow)
    one_error(cli("calibrate", src, "-o", out, *CALIB), "exists and is not a file mpsconvert wrote")
    assert out.read_text() == "written by someone else meanwhile"


def test_quantize_o_never_writes_inside_an_artifact(box, tmp_path):
    src, art = box
    before = tree(tmp_path)
    for out in (art / "fp8", art / "deeper" / "fp8"):
        for extra in ((), ("--force",)):
            one_error(cli("quantize", src, "-o", out, *extra), "inside the mpsconvert artifact")
    with pytest.raises(MpsconvertError, match="inside the mpsconvert artifact"):
        mpsconvert.quantize(src, art / "fp8")
    assert tree(tmp_path) == before and mpsconvert.verify(art).ok


# --------------------------------------------------------------------------- 5. --force and the user's files


def test_force_refuses_to_delete_files_the_manifest_does_not_list_and_names_them(box, tmp_path):
    src, art = box
    (art / "notes.txt").write_text("my notes")
    (art / "eval").mkdir()
    (art / "eval" / "results.csv").write_text("1,2,3")
    before = tree(tmp_path)
    res = cli("quantize", src, "-o", art, "--force")
    one_error(res, "2 files its manifest does not list", "eval/results.csv", "notes.txt", "--force-delete-unlisted")
    with pytest.raises(MpsconvertError, match="does not list"):
        mpsconvert.quantize(src, art, force=True)
    assert tree(tmp_path) == before
    res = cli("quantize", src, "-o", art, "--force", "--force-delete-unlisted")
    assert res.exit_code == 0, res.output
    assert not (art / "notes.txt").exists() and not (art / "eval").exists() and mpsconvert.verify(art).ok


def test_a_folder_with_a_copied_manifest_is_not_replaced_with_the_users_files(box, tmp_path):
    src, art = box
    folder = tmp_path / "mine"
    folder.mkdir()
    shutil.copy(art / "mpsconvert.json", folder)
    shutil.copy(art / "config.json", folder)
    (folder / "notes.txt").write_text("years of work")
    before = tree(tmp_path)
    one_error(cli("quantize", src, "-o", folder, "--force"), "notes.txt", "does not list")
    assert tree(tmp_path) == before


def test_an_artifact_holding_only_its_own_files_is_replaced_with_force(box, tmp_path):
    src, art = box
    (art / "._model.safetensors").write_bytes(b"\0" * 16)  # macOS metadata on exFAT: not the user's file
    res = cli("quantize", src, "-o", art, "--force")
    assert res.exit_code == 0, res.output
    assert mpsconvert.verify(art).ok


def test_calibrate_into_an_artifact_keeps_the_users_files(box):
    _, art = box
    (art / "notes.txt").write_text("my notes")
    (art / "eval").mkdir()
    (art / "eval" / "results.csv").write_text("1,2,3")
    res = cli("calibrate", art, *CALIB)
    assert res.exit_code == 0, res.output
    assert (art / "notes.txt").read_text() == "my notes" and (art / "eval" / "results.csv").read_text() == "1,2,3"
    report = mpsconvert.verify(art)
    assert report.ok and sorted(report.unlisted) == ["eval/results.csv", "notes.txt"]
    assert mpsconvert.inspect(art).recipe["name"] == "fp8"


# --------------------------------------------------------------------------- 10. leftovers and planted links


def _run(*args, kill: str | None = None):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(mpsconvert.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    if kill:
        env[atomic.KILL_ENV] = kill
    return subprocess.run(
        [sys.executable, "-m", "mpsconvert.cli", *map(str, args)], env=env, capture_output=True, timeout=300
    )


def _reserved(art: Path) -> list[Path]:
    return sorted(p for p in art.parent.iterdir() if p.name.startswith(f"{atomic.TMP_PREFIX}{art.name}-"))


READERS = {
    "verify": lambda art: mpsconvert.verify(art),
    "inspect": lambda art: mpsconvert.inspect(art),
    "load": lambda art: mpsconvert.load(art, device="cpu"),
}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("point", ["between-renames", "after-renames"])
def test_a_killed_quantize_force_leaves_nothing_the_next_reader_does_not_remove(box, reader, point):
    src, art = box
    r = _run("quantize", src, "-o", art, "--force", kill=point)
    assert r.returncode == -9, r.stderr.decode()[-1500:]
    left = _reserved(art)
    assert (
        left and sum(f.stat().st_size for p in left for f in p.rglob("*") if f.is_file()) > 10_000
    )  # full-size leftovers
    READERS[reader](art)
    assert _reserved(art) == [] and not [p for p in art.iterdir() if p.name.startswith(atomic.TMP_PREFIX)]
    assert mpsconvert.verify(art).ok


def test_a_live_writers_temporary_folder_is_left_alone(box):
    """Ours but not stale: another process holds the artifact's lock while its folder is there."""
    _, art = box
    code = (
        "import sys, time; from pathlib import Path; from mpsconvert.infra import atomic\nt = "
        f"Path({str(art)!r})\nwith atomic.writing(t):\n    tmp = atomic._new_tmp(t); (tmp / "
        "'w.bin').write_bytes(b'in progress'); print(tmp, flush=True); time.sleep(60)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(mpsconvert.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    writer = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        tmp = Path(writer.stdout.readline().strip())
        assert mpsconvert.verify(art).ok and (tmp / "w.bin").read_bytes() == b"in progress"
        mpsconvert.inspect(art)
        assert (tmp / "w.bin").is_file()
    finally:
        writer.kill()
        writer.wait()
    mpsconvert.verify(art)  # now stale: removed
    assert not tmp.exists()


@pytest.mark.parametrize("name", ["lock", "tmp"])
def test_a_planted_symlink_under_a_reserved_name_is_an_error_for_readers_too(box, tmp_path, name):
    _, art = box
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = art.parent / (
        f"{atomic.LOCK_PREFIX}{art.name}" if name == "lock" else f"{atomic.TMP_PREFIX}{art.name}-old-0123"
    )
    planted.symlink_to(outside, target_is_directory=True)
    before = tree(tmp_path)
    for args in (("verify", art), ("inspect", art), ("generate", art, "hi", "--device", "cpu", "-m", "1")):
        one_error(cli(*args), "symlink under a name mpsconvert reserves", "never followed")
    with pytest.raises(MpsconvertError, match="never followed"):
        mpsconvert.load(art, device="cpu")
    assert tree(tmp_path) == before


# ------------------------------------------------------------------- smaller items: what quantize says about its source


def _with_extra_tensor(src: Path) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.backdoor.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    return src


@pytest.mark.parametrize("planned_in", ["a child process", "this process"])
def test_a_tensor_the_model_does_not_define_is_said_not_copied_silently(box, tmp_path, monkeypatch, planned_in):
    from mpsconvert.convert import plan_child

    src = _with_extra_tensor(box[0])
    if planned_in == "this process":
        monkeypatch.setattr(plan_child, "wanted", lambda *a, **k: False)
    res = cli("quantize", src, "-o", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert "warning:" in res.output and "does not define ('model.backdoor.weight')" in res.output, res.output
    assert "copied into the artifact as it is" in res.output
    out = mpsconvert.quantize(src, tmp_path / "out2")
    assert any("model.backdoor.weight" in w for w in out.warnings)


@pytest.mark.parametrize(
    "arch,kw", [("llama", {}), ("qwen2", {"tie": True}), ("qwen3_moe", {}), ("bert", {}), ("gpt2", {})]
)
def test_a_source_whose_tensors_the_model_defines_gets_no_such_note(tmp_path, arch, kw):
    src = models.tiny(arch, tmp_path / "src", **kw)
    res = mpsconvert.quantize(src, tmp_path / "out")
    assert not [w for w in res.warnings if "does not define" in w], res.warnings


def test_revision_with_a_local_source_is_refused_not_ignored(box, tmp_path):
    src, art = box
    before = tree(tmp_path)
    one_error(
        cli("quantize", src, "--revision", "v2", "-o", tmp_path / "out"),
        "--revision v2 applies to a hub repo",
        "is a local folder",
    )
    one_error(cli("calibrate", src, "--revision", "v2", "-o", tmp_path / "s.json", *CALIB), "applies to a hub repo")
    one_error(cli("calibrate", art, "--revision", "v2", *CALIB), "applies to a hub repo")
    assert tree(tmp_path) == before


# --------------------------------------------------------------------------- the folder around an artifact


def test_a_planted_lock_symlink_is_an_error_and_creates_nothing_outside(chat_art, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    lock = chat_art.parent / f"{atomic.LOCK_PREFIX}{chat_art.name}"
    lock.symlink_to(outside / "created-by-the-lock")  # dangling: O_CREAT through it would make a file outside
    res = cli("calibrate", chat_art, "--num-samples", "1", "--seq-len", "16")
    one_error(res, "symlink under a name mpsconvert reserves", "never followed")
    assert not (outside / "created-by-the-lock").exists() and lock.is_symlink()
    with pytest.raises(MpsconvertError, match="never followed"):
        with transaction(chat_art):
            pass
    lock.unlink()
    assert mpsconvert.verify(chat_art).ok


@pytest.mark.parametrize("name", ["old", "old-0123456789ab", "x"])
def test_a_planted_old_symlink_is_never_restored(chat_art, tmp_path, name):
    """The artifact is gone and a link under the reserved `-old` name points outside: a reader must
    not rename it into place (the artifact path would then lead outside)."""
    outside = tmp_path / "outside"
    shutil.copytree(chat_art, outside)
    before = models.tree_hashes(outside)
    shutil.rmtree(chat_art)
    planted = chat_art.parent / f"{atomic.TMP_PREFIX}{chat_art.name}-{name}"
    planted.symlink_to(outside, target_is_directory=True)
    for cmd in (("verify", chat_art), ("inspect", chat_art)):
        res = cli(*cmd)
        assert res.exit_code != 0 and "Traceback" not in res.output, res.output
        assert not os.path.lexists(chat_art), cmd
    with pytest.raises(MpsconvertError, match="never followed"):
        mpsconvert.load(chat_art, device="cpu")
    assert planted.is_symlink() and not os.path.lexists(chat_art) and models.tree_hashes(outside) == before


def test_user_folders_under_the_reserved_prefix_are_never_deleted_or_restored(chat_art):
    mine = chat_art.parent / f"{atomic.TMP_PREFIX}{chat_art.name}-mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    parked = chat_art.parent / f"{atomic.TMP_PREFIX}{chat_art.name}-old"  # an older version's name, or a user's folder
    parked.mkdir()
    (parked / "notes.txt").write_text("mine too")
    with transaction(chat_art) as t:  # a writer: recovers what killed runs of ours left, only that
        t.put(Hub(repo="me/x"))
    assert mpsconvert.verify(chat_art).ok
    assert (mine / "thesis.tex").read_text() == "years of work" and (parked / "notes.txt").read_text() == "mine too"
    # the artifact gone: a folder that is not ours is not "put back" as it
    shutil.rmtree(chat_art)
    assert cli("verify", chat_art).exit_code != 0
    assert not chat_art.exists() and (parked / "notes.txt").read_text() == "mine too"


def test_another_artifacts_temp_folder_sharing_a_prefix_is_left_alone(chat_art):
    """`.mpsconvert-tmp-art-b-*` is the temp folder of artifact `art-b` (another lock): recovering
    `art` must not take it for its own."""
    other = chat_art.parent / "art-b"
    other_tmp = atomic._new_tmp(other.absolute())
    (other_tmp / "model.safetensors").write_bytes(b"in progress")
    with atomic.writing(chat_art):
        pass
    assert (other_tmp / "model.safetensors").read_bytes() == b"in progress"
    with atomic.writing(other):  # its own writer does remove it
        pass
    assert not other_tmp.exists()


def test_force_replaces_only_a_folder_whose_manifest_parses_and_is_ours(chat_llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST_NAME).write_text("not json at all")
    (out / "config.json").write_text("{}")
    (out / "thesis.tex").write_text("years of work")
    before = models.tree_hashes(tmp_path)
    one_error(cli("quantize", chat_llama[0], "-o", out, "--force"), "not an mpsconvert artifact")
    (out / MANIFEST_NAME).write_text(json.dumps({"tool": "something else", "schema_version": 1}))
    before = models.tree_hashes(tmp_path)
    one_error(cli("quantize", chat_llama[0], "-o", out, "--force"), "not an mpsconvert artifact")
    assert models.tree_hashes(tmp_path) == before


def test_an_unlisted_folder_under_a_package_name_is_never_replaced(chat_art):
    user = chat_art / COREAI_ASSET
    user.mkdir()
    (user / "my-notes.txt").write_text("mine")

    with pytest.raises(ArtifactError, match="not a package mpsconvert wrote"):
        layout.check_package_slot(chat_art, COREAI_ASSET, Manifest.read(chat_art).files, force=True)
    assert (user / "my-notes.txt").read_text() == "mine"
    # a package mpsconvert wrote (listed) is replaced with force, and refused without
    shutil.rmtree(user)
    with transaction(chat_art, drop=(COREAI_ASSET,)) as t:
        (t.folder / COREAI_ASSET).mkdir()
        (t.folder / COREAI_ASSET / "weights.bin").write_bytes(b"x")
        t.add_files(COREAI_ASSET)
    with pytest.raises(MpsconvertError, match="already exists"):
        layout.check_package_slot(chat_art, COREAI_ASSET, Manifest.read(chat_art).files, force=False)
    layout.check_package_slot(chat_art, COREAI_ASSET, Manifest.read(chat_art).files, force=True)


@pytest.mark.extra("coreai")
def test_export_coreai_force_refuses_a_user_folder_named_like_its_asset(chat_art):
    user = chat_art / COREAI_ASSET
    user.mkdir()
    (user / "my-notes.txt").write_text("mine")
    res = cli("export-coreai", chat_art, "--force")
    one_error(res, "not a package mpsconvert wrote")
    assert (user / "my-notes.txt").read_text() == "mine"


def test_a_symlinked_artifact_is_written_through_its_target(chat_art, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(chat_art, target_is_directory=True)
    with transaction(link) as t:
        t.put(Hub(repo="me/through-the-link"))
    with transaction(link, drop=(COREML_PACKAGE,)) as t:
        (t.folder / COREML_PACKAGE).mkdir()
        (t.folder / COREML_PACKAGE / "weights.bin").write_bytes(b"x" * 100)
        t.add_files(COREML_PACKAGE)
    assert link.is_symlink() and link.resolve() == chat_art.resolve()
    m = Manifest.read(chat_art)
    assert m.get(Hub).repo == "me/through-the-link" and (chat_art / COREML_PACKAGE / "weights.bin").is_file()
    assert mpsconvert.verify(link).ok and mpsconvert.verify(chat_art).ok
    assert not [
        p for p in list(tmp_path.iterdir()) + list(chat_art.parent.iterdir()) if p.name.startswith(atomic.TMP_PREFIX)
    ]


def test_o_an_existing_file_or_a_new_folder_inside_the_source_is_refused(chat_llama, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(chat_llama[0], src)
    f = tmp_path / "a-file"
    f.write_text("mine")
    before = models.tree_hashes(tmp_path)
    one_error(cli("quantize", src, "-o", f), "is a file")
    one_error(cli("quantize", src, "-o", src / "fp8"), "inside the source")
    one_error(cli("quantize", src, "-o", src / "sub" / "fp8", "--force"), "inside the source")
    assert models.tree_hashes(tmp_path) == before and not (src / "fp8").exists() and not (src / "sub").exists()


# ------------------------------------------------ card + manifest in one swap: each writer killed where they could part


# each command that changes an artifact, as a user runs it; what its change leaves in the card
COMMANDS = {
    "validate": (
        [
            "validate",
            "{art}",
            "--device",
            "cpu",
            "--max-samples",
            "1",
            "--seq-len",
            "32",
            "--prefill-len",
            "16",
            "--decode-tokens",
            "2",
            "--repeats",
            "1",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--eval-data",
            "{text}",
        ],
        "| CPU",
    ),
    "calibrate": (["calibrate", "{art}", "--num-samples", "2", "--seq-len", "16"], "| calibration | 2 x 16 tokens"),
    "export-coreml": (
        ["export-coreml", "{art}", "--no-kv-cache", "--seq-len", "8", "--no-check"],
        "Core ML: `model.mlpackage`",
    ),
    "export-coreai": (["export-coreai", "{art}", "--max-len", "16", "--no-check"], "Core AI: `model.aimodel`"),
}
# the transaction's steps where the card and the manifest could part: the card written (the
# manifest not yet), both written in the staged copy (calibrate rebuilds the folder instead: its
# weights rewritten, the card not yet), between the swap's two renames
SPLIT_POINTS = ["card-written", "staged-written", "between-renames"]
REBUILD_POINTS = ["rebuilt", "card-written", "between-renames"]


def _command(name, art, text_data):
    import sys

    args = [a.format(art=art, text=text_data / "wiki_eval.jsonl") for a in COMMANDS[name][0]]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(mpsconvert.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    return [sys.executable, "-m", "mpsconvert.cli", *args], env


# upload commits to the hub before its local swap, so a kill between them leaves a commit and the old
# artifact: tests/test_security_upload.py kills it at its own points
@pytest.mark.slow  # a real process killed at every step: CI runs it in the slow lane
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[pytest.mark.extra(n.split("-")[1])] if n.startswith("export") else []) for n in COMMANDS],
)
def test_each_command_killed_where_card_and_manifest_could_part_leaves_them_together(
    chat_art, text_data, request, name
):
    """The real command, SIGKILLed at each step of its transaction where the card and the
    manifest could part: the artifact verifies (the card has the sha256 the manifest records) and
    is the one before the command, whole; the rerun completes, the card says what it recorded,
    and nothing is left behind."""
    import subprocess

    cmd, env = _command(name, chat_art, text_data)
    before = models.tree_hashes(chat_art)
    for point in REBUILD_POINTS if name == "calibrate" else SPLIT_POINTS:
        r = subprocess.run(cmd, env={**env, atomic.KILL_ENV: point}, capture_output=True, timeout=600)
        assert r.returncode == -9, (point, r.stderr.decode()[-1500:])  # the kill point was reached
        report = mpsconvert.verify(chat_art)  # a reader recovers a swap cut in two
        assert report.ok, (point, report.problems)
        assert models.tree_hashes(chat_art) == before, point
    r = subprocess.run(cmd, env=env, capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode()[-1500:]
    assert mpsconvert.verify(chat_art).ok and COMMANDS[name][1] in (chat_art / "README.md").read_text()
    assert not [
        p for p in list(chat_art.iterdir()) + list(chat_art.parent.iterdir()) if p.name.startswith(atomic.TMP_PREFIX)
    ]
