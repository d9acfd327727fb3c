"""Upload publishes exactly what it verified, and only a successful upload changes the artifact.

Every attack runs against the local hub (tests/hub_server.py) through huggingface_hub's own
client: a listed file rewritten in place, renamed over or swapped for a link to a file outside
the artifact after the verification and before the commit is never published as it now is (the
verified bytes go up, or the upload is refused in one line); an upload that fails, at any point
before the hub took the commit, leaves the artifact byte for byte as it was."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mpsconvert
from mpsconvert.infra import atomic
from mpsconvert.manifests import hashing

from . import models
from .helpers import cli, one_error


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    work = tmp_path_factory.mktemp("sec-upload")
    src = models.tiny("llama", work / "src", tokenizer="bpe", dtype=torch.bfloat16, tie=True)
    return mpsconvert.quantize(src, work / "art").output


@pytest.fixture
def art(base, tmp_path):
    return Path(shutil.copytree(base, tmp_path / "box" / "art"))


def folder_tree(folder: Path) -> dict:
    """Every entry under `folder` (the artifact and whatever a run left beside it) with its bytes."""
    return {
        p.relative_to(folder).as_posix(): (
            p.read_bytes() if p.is_file() and not p.is_symlink() else str(os.readlink(p)) if p.is_symlink() else None
        )
        for p in sorted(folder.rglob("*"))
    }


def _staged(art: Path) -> list[Path]:
    return [p for p in art.parent.iterdir() if p.name.startswith(f"{atomic.TMP_PREFIX}{art.name}-")]


def _in_place(p: Path, outside: Path) -> None:
    with p.open("r+b") as f:
        f.write(b"\x00" * 8)


ATTACKS = {
    # each changes `rel` in the artifact and in the staged copy the upload is sent from
    "rewritten in place": _in_place,
    "renamed over": lambda p, outside: (
        p.with_name(p.name + ".new").write_bytes(outside.read_bytes()),
        os.replace(p.with_name(p.name + ".new"), p),
    ),
    "a link to a file outside": lambda p, outside: (p.unlink(), p.symlink_to(outside)),
}


@pytest.mark.parametrize("sent_as", ["bytes", "a verified reader"])
@pytest.mark.parametrize("rel", ["model.safetensors", "tokenizer.json"])
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_file_changed_after_verification_is_never_published_as_it_now_is(
    online, art, tmp_path, monkeypatch, attack, rel, sent_as
):
    import huggingface_hub as hf

    if sent_as == "a verified reader":  # weights-sized files: an open descriptor, hashed again as it is sent
        monkeypatch.setattr(hashing, "SEND_AS_BYTES", 0)
    verified = (art / rel).read_bytes()
    outside = tmp_path / "secret"
    outside.write_bytes(b"the user's private key " * 64)
    real_commit = hf.HfApi.create_commit

    def attacked(self, *a, **kw):  # after verification, after the files were read, before anything is sent
        for folder in (art, *_staged(art)):
            ATTACKS[attack](folder / rel, outside)
        return real_commit(self, *a, **kw)

    monkeypatch.setattr(hf.HfApi, "create_commit", attacked)
    # a send cut off before its last bytes is a broken request for the local hub: not its traceback in our output
    monkeypatch.setattr(online.server, "handle_error", lambda *a: None)
    res = cli("upload", art, "me/x")
    sent = [c["files"].get(rel) for c in online.commits]
    assert all(s == verified for s in sent), (attack, rel)  # the verified bytes, or nothing
    assert b"private key" not in b"".join(b for c in online.commits for b in c["files"].values())
    if res.exit_code != 0:  # in place, read again as it is sent: refused before its last bytes went out
        assert attack == "rewritten in place" and sent_as == "a verified reader", res.output
        one_error(res, f"{rel} does not match the sha256", "changed after it was verified")
        assert online.commits == []
    else:
        assert len(online.commits) == 1


def test_a_file_changed_before_the_upload_read_it_is_refused(online, art):
    """Changed between `verify` and the read that hashes it for sending: refused, nothing sent."""
    real = hashing.read_verified

    def late(folder, rel, want, fix):
        if rel == "tokenizer.json":
            _in_place(Path(folder) / rel, None)
        return real(folder, rel, want, fix)

    import mpsconvert.publish.hub as publish

    before = folder_tree(art.parent)
    publish.read_verified, saved = late, publish.read_verified
    try:
        res = cli("upload", art, "me/x")
    finally:
        publish.read_verified = saved
    one_error(res, "tokenizer.json does not match the sha256", "nothing was uploaded")
    assert online.commits == [] and set(folder_tree(art.parent)) == set(
        before
    )  # no card naming me/x, no staged copy left
    assert (art / "README.md").read_bytes() == before["art/README.md"]


def test_the_reader_refuses_a_pass_that_differs_before_returning_its_end(tmp_path):
    """The negative control of the reader: a pass over bytes that changed fails at the read that
    completes it (the rest of the file never leaves), while a pass over the verified bytes reads
    through, as many times as a client reads it."""
    import hashlib

    f = tmp_path / "w.bin"
    f.write_bytes(bytes(range(256)) * 64)
    want = {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "size": f.stat().st_size}
    r = hashing.VerifiedReader(
        hashing.open_unlinked(Path("w.bin"), "w.bin", "fix", folder=tmp_path), want, "w.bin", "fix"
    )
    assert r.read() == f.read_bytes() and (r.seek(0), r.read(100), r.read())[2] == f.read_bytes()[100:]
    r.seek(0)
    with f.open("r+b") as w:
        w.seek(5000)
        w.write(b"X")
    assert len(r.read(4096)) == 4096  # not yet at the end
    with pytest.raises(mpsconvert.errors.ArtifactError, match="changed after it was verified"):
        r.read(100000)
    bad = dict(want, sha256="0" * 64)
    with pytest.raises(mpsconvert.errors.ArtifactError):
        hashing.VerifiedReader(
            hashing.open_unlinked(Path("w.bin"), "w.bin", "fix", folder=tmp_path), bad, "w.bin", "fix"
        )
    (tmp_path / "d").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "d", target_is_directory=True)
    (tmp_path / "d" / "x").write_bytes(b"x")
    with pytest.raises(mpsconvert.errors.ArtifactError, match="a symlink"):  # a folder on the way swapped for a link
        hashing.open_unlinked(Path("link/x"), "link/x", "fix", folder=tmp_path)


FAILURES = {
    "unreachable hub": ("cannot reach",),
    "not a hub (404)": ("404 Not Found",),
    "a public repo with --private": ("already exists and is public",),
    "the hub refuses the commit": ("refused the upload",),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_failed_upload_changes_nothing_local(online, art, monkeypatch, failure):
    import huggingface_hub.constants as c

    args = ["upload", art, "me/x"]
    if failure == "unreachable hub":
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
        monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    elif failure == "not a hub (404)":
        monkeypatch.setenv("HF_ENDPOINT", online.url + "/not-a-hub")
    elif failure == "a public repo with --private":
        online.repos["me/x"] = {"name": "x", "visibility": "public"}
        args.append("--private")
    else:
        import huggingface_hub as hf
        from huggingface_hub.errors import HfHubHTTPError

        class Answer:
            status_code, headers, request, text = 403, {}, None, "forbidden"

            def json(self):
                return {"error": "forbidden"}

        def refuse(self, *a, **kw):
            raise HfHubHTTPError("403 Forbidden: no write access", response=Answer())

        monkeypatch.setattr(hf.HfApi, "create_commit", refuse)
    before = folder_tree(art.parent)
    one_error(cli(*args), *FAILURES[failure])
    assert folder_tree(art.parent) == before  # README.md and mpsconvert.json do not name me/x; nothing staged is left
    assert "me/x" not in (art / "README.md").read_text() and "me/x" not in (art / "mpsconvert.json").read_text()
    assert mpsconvert.verify(art).ok and online.commits == []


def test_a_successful_upload_then_names_the_repo_locally(online, art):
    res = cli("upload", art, "me/x")
    assert res.exit_code == 0, res.output
    (commit,) = online.commits
    assert 'from_pretrained("me/x"' in (art / "README.md").read_text()
    assert commit["files"]["README.md"] == (art / "README.md").read_bytes()
    assert commit["files"]["mpsconvert.json"] == (art / "mpsconvert.json").read_bytes()
    assert mpsconvert.verify(art).ok and not _staged(art)


@pytest.mark.parametrize("point,committed", [("card-written", False), ("between-renames", True)])
def test_a_killed_upload_leaves_the_old_artifact_or_the_new_one_and_the_rerun_completes(online, art, point, committed):
    """Killed before the commit: nothing sent, the artifact as it was. Killed after it (between
    the swap's renames): the hub has the commit, the artifact is the old one whole (a reader puts
    it back), and the rerun sends it again."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(mpsconvert.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
        "HF_ENDPOINT": online.url,
        "HF_TOKEN": "hf_local_test_token",
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_XET": "1",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    cmd = [sys.executable, "-m", "mpsconvert.cli", "upload", str(art), "me/x"]
    before = models.tree_hashes(art)
    r = subprocess.run(cmd, env={**env, atomic.KILL_ENV: point}, capture_output=True, timeout=300)
    assert r.returncode == -9, r.stderr.decode()[-1500:]
    assert mpsconvert.verify(art).ok and models.tree_hashes(art) == before
    assert len(online.commits) == int(committed)
    r = subprocess.run(cmd, env=env, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-1500:]
    assert (
        online.commits[-1]["files"]["README.md"] == (art / "README.md").read_bytes()
        and '"me/x"' in (art / "README.md").read_text()
    )
    assert mpsconvert.verify(art).ok and not _staged(art)
