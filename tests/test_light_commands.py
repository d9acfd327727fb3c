"""Commands that run no model import no model code: `inspect`, `verify` (with and without
hashes), `upload`, `--help` and `--version` read JSON and safetensors headers, so each runs in
a fresh interpreter without torch or transformers (seconds to import on a small machine: the
command itself takes well under one). `python -m mpsconvert` is the program."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mpsconvert

from . import models

pytestmark = pytest.mark.core

SRC = Path(__file__).resolve().parents[1] / "src"
HEAVY = ("torch", "transformers")
# Runs the program as `python -m mpsconvert` does, then writes the modules it imported: the
# program ends in os._exit after the atexit handlers, so the list is taken by one of them.
_PROBE = """
import atexit, json, runpy, sys
out = sys.argv[1]
def _record():
    with open(out, "w") as f:
        json.dump(sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r}), f)
atexit.register(_record)
sys.argv = ["mpsconvert", *sys.argv[2:]]
runpy.run_module("mpsconvert", run_name="__main__", alter_sys=True)
"""


def run(tmp_path, *args, env=None):
    """`python -m mpsconvert ARGS` in a fresh interpreter: (completed process, heavy modules it imported)."""
    seen = tmp_path / f"modules-{len(list(tmp_path.glob('modules-*')))}.json"
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    r = subprocess.run(
        [sys.executable, "-c", _PROBE.format(heavy=set(HEAVY)), str(seen), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
    )
    return r, json.loads(seen.read_text()) if seen.is_file() else None


@pytest.fixture(scope="module")
def art(work):
    return models.tiny_artifact(work, "llama", lambda p: models.tiny("llama", p, tokenizer="bpe"))


@pytest.mark.parametrize(
    "args", [["--help"], ["--version"], ["verify", "--help"], ["quantize", "--help"]], ids=" ".join
)
def test_help_and_version_import_no_model_code(tmp_path, args):
    r, heavy = run(tmp_path, *args)
    assert r.returncode == 0, r.stderr
    assert heavy == [], f"{' '.join(args)} imported {heavy}"
    assert ("mpsconvert, version" in r.stdout) if args == ["--version"] else ("Usage:" in r.stdout)


@pytest.mark.parametrize(
    "args",
    [["verify", "--no-hashes"], ["verify"], ["verify", "--json"], ["inspect"], ["inspect", "--json"]],
    ids=" ".join,
)
def test_inspect_and_verify_of_an_artifact_import_no_model_code(art, tmp_path, args):
    r, heavy = run(tmp_path, *args, art)
    assert r.returncode == 0, r.stderr
    assert heavy == [], f"{' '.join(args)} imported {heavy}"
    if args == ["verify", "--json"]:
        assert json.loads(r.stdout)["ok"] and json.loads(r.stdout)["hashes_checked"]


def test_upload_imports_no_model_code(art, tmp_path, online):
    copy = shutil.copytree(art, tmp_path / "art")
    r, heavy = run(tmp_path, "upload", copy, "me/light", env={"HF_HUB_DISABLE_XET": "1"})
    assert r.returncode == 0, r.stderr
    assert heavy == [], f"upload imported {heavy}"
    assert [c["repo"] for c in online.commits] == ["me/light"]


def test_a_config_the_manifest_does_not_vouch_for_is_checked_against_the_model(art, tmp_path):
    """Where config.json is not the one recorded (edited after the conversion; --no-hashes
    skips only the weights' hashes), verify builds the model from it and compares shapes."""
    copy = shutil.copytree(art, tmp_path / "art")
    cfg = json.loads((copy / "config.json").read_text())
    cfg["intermediate_size"] = 2 * cfg["intermediate_size"]
    (copy / "config.json").write_text(json.dumps(cfg))
    problems = mpsconvert.verify(copy, check_hashes=False).problems
    assert any("but the model built from config.json has" in p for p in problems), problems
    assert mpsconvert.verify(art, check_hashes=False).ok


def test_a_damaged_weight_file_is_still_caught_without_the_model(art, tmp_path):
    copy = shutil.copytree(art, tmp_path / "art")
    with open(copy / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\0\0\0\1")
    r, heavy = run(tmp_path, "verify", copy)
    assert r.returncode == 1 and "does not match the sha256" in r.stdout + r.stderr, r.stdout + r.stderr
    assert heavy == []
