"""Reading an artifact (issue 53, classes 6, 8, 9): verify says ok only about what it checked. JSON
keys once, no NaN; the manifest's shape required; config.json's structural numbers against the
shards; configs that compute garbage refused; special files never read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

import mpsconvert
from mpsconvert.cli import main
from mpsconvert.errors import ArtifactError
from mpsconvert.manifests.layout import MANIFEST_NAME
from mpsconvert.untrusted import parse_json, read_json

from . import models


def cli(*args, **kw):
    return CliRunner().invoke(main, [str(a) for a in args], **kw)


def one_line_error(res, *says) -> None:
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert "Traceback" not in res.output and len(lines) == 1 and lines[0].startswith("error:"), res.output
    for s in says:
        assert s in res.output, res.output


@pytest.fixture
def art(llama_art, tmp_path):
    a = tmp_path / "art"
    shutil.copytree(llama_art, a)
    return a


def _failed(art, *says) -> None:
    """`verify` exits 1 naming each of `says` in its problems (and the API's report is not ok)."""
    res = cli("verify", art, "--json")
    assert res.exit_code == 1, res.output
    report = json.loads(res.stdout)
    assert not report["ok"]
    text = " ".join(report["problems"])
    for s in says:
        assert s in text, report["problems"]


def _edit_manifest(art, edit=None, text=None) -> None:
    body = json.loads((art / MANIFEST_NAME).read_text())
    if edit:
        edit(body)
    (art / MANIFEST_NAME).write_text(text(json.dumps(body, indent=2)) if text else json.dumps(body, indent=2))


# --------------------------------------------------------------------------- 9. the manifest's shape


@pytest.mark.parametrize("edit, says", [
    (lambda m: m.update(files={}), "lists no files"),
    (lambda m: m.update(tensors=None), "'tensors' is NoneType"),
    (lambda m: m.pop("tensors"), "has no 'tensors'"),
    (lambda m: m.update(files=None), "'files' is NoneType"),
    (lambda m: m.update(pinned=None), "the `pinned` record is NoneType, not an object"),
    (lambda m: m.update(tool="mpsconvert\u200b"), 'not "mpsconvert"'),
    (lambda m: m.pop("tool"), 'not "mpsconvert"'),
    (lambda m: m["tensors"].update({"x": {"dtype": "F8_E4M3", "shape": ["a"]}}), "shape of non-negative integers"),
], ids=["files-empty", "tensors-null", "tensors-absent", "files-null", "pinned-null", "tool-lookalike", "tool-absent", "shape-text"])
def test_a_manifest_of_the_wrong_shape_does_not_verify(art, edit, says):
    _edit_manifest(art, edit)
    _failed(art, says)
    one_line_error(cli("inspect", art), says)  # inspect's reader too: one line, no traceback


def test_a_key_twice_in_any_json_is_refused(art):
    """verify read the first "files", transformers' readers the last: two readers, two artifacts."""
    _edit_manifest(art, text=lambda t: t.replace('"files": {', '"files": {}, "files": {', 1))
    _failed(art, "has the key 'files' twice")
    with pytest.raises(ArtifactError, match="has the key 'b' twice"):  # at any depth: every JSON reader goes through parse_json
        parse_json('{"a": [{"b": 1, "b": 2}]}', what="x")


def test_a_config_json_key_twice_does_not_verify(art):
    text = (art / "config.json").read_text()
    (art / "config.json").write_text(text.replace('"hidden_size"', '"hidden_size": 128, "hidden_size"', 1))
    models.resign(art, "config.json")
    _failed(art, "has the key 'hidden_size' twice")


def test_a_manifest_holding_nan_is_one_line(art):
    _edit_manifest(art, text=lambda t: t.replace('"summary": {', '"summary": {"x": NaN, ', 1))
    _failed(art, "holds NaN")
    one_line_error(cli("inspect", art), "holds NaN")


# --------------------------------------------------------------------------- 9. config.json against the shards


@pytest.mark.parametrize("key, value, says", [
    ("num_hidden_layers", 3, "config.json's model has model.layers.2."),
    ("num_hidden_layers", 1, "layer(s) the model built from config.json does not have (model.layers.1"),
    ("vocab_size", 512, "model.embed_tokens.weight is [256, 64] but the model built from config.json has [512, 64]"),
    ("intermediate_size", 256, "but the model built from config.json has 256x64"),
])
def test_config_structural_numbers_are_checked_against_the_shards(art, key, value, says):
    """num_hidden_layers raised in config.json (re-hashed, so only this check stands in the way)
    verified, and `generate` then failed. The manifest vouches for the re-hashed config.json, so
    verify checks its numbers against the shards without building the model (no torch)."""
    cfg = json.loads((art / "config.json").read_text())
    cfg[key] = value
    (art / "config.json").write_text(json.dumps(cfg))
    models.resign(art, "config.json")
    _failed(art, says)


@pytest.mark.parametrize("edit, says", [
    ({"rms_norm_eps": 1e400}, "rms_norm_eps is inf"),
    ({"max_position_embeddings": 0}, "max_position_embeddings is 0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -5}}, "factor is -5"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, "holds NaN"),
])
def test_a_config_that_computes_garbage_does_not_verify_or_load(art, edit, says):
    cfg = json.loads((art / "config.json").read_text())
    cfg.update(edit)
    (art / "config.json").write_text(json.dumps(cfg).replace("Infinity", "1e400"))
    models.resign(art, "config.json")
    _failed(art, says)
    with pytest.raises(ArtifactError, match="failed verification"):
        mpsconvert.load(art, device="cpu")


# --------------------------------------------------------------------------- 6. special files are never read


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_at_config_json_does_not_block_verify(art):
    (art / "config.json").unlink()
    os.mkfifo(art / "config.json")
    r = subprocess.run([sys.executable, "-m", "mpsconvert.cli", "verify", str(art)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "config.json" in r.stdout + r.stderr
    with pytest.raises(ArtifactError, match="is a FIFO, not a regular file"):
        read_json(art / "config.json")
    one_line_error(cli("generate", art, "hi", "--device", "cpu"), "config.json")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_or_fifo_is_never_read_as_a_file(tmp_path):
    """Every reader of ours opens without blocking and reads only a regular file: JSON, a
    safetensors header, a hash (a device never ends; a FIFO's open waits for a writer)."""
    from mpsconvert.manifests.hashing import sha256_file
    from mpsconvert.safetensors_io import read_header

    (tmp_path / "config.json").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(ArtifactError, match="is a device, not a regular file"):
        read_json(tmp_path / "config.json")
    with pytest.raises(ArtifactError, match="is a FIFO, not a regular file"):
        read_header(tmp_path / "model.safetensors")
    with pytest.raises(ArtifactError, match="is a device"):
        sha256_file(tmp_path / "config.json")
