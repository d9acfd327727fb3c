"""Upload: every artifact file reaches a (local) hub with the right repo, revision and commit
message, through huggingface_hub's own client; offline mode is one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import mpsconvert
from mpsconvert.cli import main

from . import models


@pytest.fixture(scope="module")
def src(work):
    """The tiny chat model every test uploads, built once."""
    return models.tiny("llama", work / "src", tokenizer="bpe", dtype=torch.bfloat16, tie=True)


@pytest.fixture(scope="module")
def quantized(src, work):
    return mpsconvert.quantize(src, work / "llama-fp8").output


@pytest.fixture
def art(quantized, tmp_path):
    """A copy of the module's artifact for one test (an upload rewrites its card)."""
    return Path(shutil.copytree(quantized, tmp_path / "llama-fp8"))


def artifact_files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_upload_sends_every_file_in_one_commit(online, art):
    res = CliRunner().invoke(main, ["upload", str(art), "me/llama-fp8", "--private", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert online.unknown == []
    assert online.repos["me/llama-fp8"]["visibility"] == "private"
    assert online.auth == {"Bearer hf_local_test_token"}
    (commit,) = online.commits
    assert commit["repo"] == "me/llama-fp8" and commit["revision"] == "main"
    msg = commit["header"]["summary"]
    assert msg == out["commit_message"] and "fp8-dynamic" in msg and "weights per row" in msg and "src" in msg
    local = artifact_files(art)  # after the card was rewritten for the repo
    assert commit["files"] == local and sorted(out["files"]) == sorted(local)
    assert "model.safetensors" in local and "mpsconvert.json" in local and "README.md" in local
    assert 'from_pretrained("me/llama-fp8"' in local["README.md"].decode()
    assert mpsconvert.verify(art).ok  # the rewritten card is in the manifest with its new sha256
    assert mpsconvert.inspect(art).extra["hub"] == {
        "repo": "me/llama-fp8"
    }  # later card rewrites keep loading from the repo


def test_quantize_upload_repo_and_existing_repo(online, src, tmp_path):
    online.repos["me/again"] = {"name": "again"}  # already there: create_repo(exist_ok) carries on
    res = CliRunner().invoke(
        main, ["quantize", str(src), "-o", str(tmp_path / "a"), "--upload-repo", "me/again"], catch_exceptions=False
    )
    assert res.exit_code == 0, res.output
    (commit,) = online.commits
    assert commit["repo"] == "me/again" and set(commit["files"]) == set(artifact_files(tmp_path / "a"))
    assert "uploaded" in res.output


def test_offline_is_one_line_before_any_work(src, art, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "a"), "--upload-repo", "me/x"])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "offline mode" in res.output, res.output
    assert not (tmp_path / "a").exists()
    res = CliRunner().invoke(main, ["upload", str(art), "me/x"])
    assert res.exit_code == 2 and "HF_HUB_OFFLINE" in res.output and res.output.count("\n") == 1, res.output
    res = CliRunner().invoke(main, ["upload", str(art), "not a repo!"])
    assert res.exit_code == 2 and "not a hub repo id" in res.output


def test_a_damaged_artifact_is_not_uploaded(art, online):
    with open(art / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\0\0\0\1")
    res = CliRunner().invoke(main, ["upload", str(art), "me/broken"])
    assert res.exit_code == 2 and "fails verification" in res.output, res.output
    assert online.commits == [] and online.repos == {}


def test_an_unreachable_hub_is_one_line(art, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    res = CliRunner().invoke(main, ["upload", str(art), "me/x"])
    assert res.exit_code == 2 and "cannot reach http://127.0.0.1:9" in res.output and res.output.count("\n") == 1, (
        res.output
    )


def test_an_existing_repo_keeps_its_visibility_and_is_reported_as_it_is(art, online):
    """`--private` only makes a new repo private: an existing public one is refused before anything
    is sent (never an artifact meant to be private in a public repo), and the visibility reported is
    the hub's, not the flag's."""
    online.repos["me/public"] = {"name": "public", "visibility": "public"}
    res = CliRunner().invoke(main, ["upload", str(art), "me/public", "--private"])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "me/public already exists and is public" in res.output and "nothing was uploaded" in res.output
    assert online.commits == [] and online.repos["me/public"]["visibility"] == "public"
    res = CliRunner().invoke(main, ["upload", str(art), "me/public", "--json"], catch_exceptions=False)
    assert res.exit_code == 0 and json.loads(res.stdout)["private"] is False
    online.repos["me/secret"] = {"name": "secret", "visibility": "private"}
    res = CliRunner().invoke(
        main, ["upload", str(art), "me/secret"], catch_exceptions=False
    )  # no --private: it stays private
    assert res.exit_code == 0 and "(private repo," in res.output, res.output
    assert [c["repo"] for c in online.commits] == ["me/public", "me/secret"]


def test_a_hub_without_xet_storage_is_not_unreachable(art, online, monkeypatch):
    """huggingface_hub uploads through Xet by default; a hub that does not serve it answers 404,
    which hf_xet reports as a network error: said as what it is, with the switch that helps."""
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_DISABLE_XET", False)
    res = CliRunner().invoke(main, ["upload", str(art), "me/x"])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "does not serve Xet storage (404" in res.output and "HF_HUB_DISABLE_XET=1" in res.output
    assert "cannot reach" not in res.output and online.commits == []


def test_a_404_from_the_hub_says_what_was_not_found(art, online, monkeypatch):
    import mpsconvert.publish.hub as publish

    monkeypatch.setenv("HF_ENDPOINT", online.url + "/not-a-hub")  # a server, but no hub API under that path
    res = CliRunner().invoke(main, ["upload", str(art), "me/x"])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert (
        "answered 404 Not Found (/api/repos/create)" in res.output and "HF_ENDPOINT is a Hugging Face hub" in res.output
    )
    assert publish.http_failure(403, "Forbidden", "", "http://h", "me/x").fix.startswith("pass a write token")
