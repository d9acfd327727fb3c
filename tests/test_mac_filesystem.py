"""What a Mac's file systems do that Linux's usually do not, simulated here: AppleDouble `._*`
companions on exFAT/SMB drives, case-insensitive names (APFS), and volumes that cannot lock."""

import errno
import fcntl
import json
import shutil

import pytest
from click.testing import CliRunner

import mpsconvert
from mpsconvert.cli import main
from mpsconvert.errors import MpsconvertError
from mpsconvert.infra import filesystem, output_rule
from mpsconvert.manifests import layout
from mpsconvert.manifests.hashing import folder_files
from mpsconvert.source import snapshot as source

from . import models

# What macOS writes beside a file on exFAT: a resource fork header, not a safetensors file.
APPLEDOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + b"\x00" * 4000


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_line_error(res, match):
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], res.output


@pytest.fixture
def apple_source(tiny_models, tmp_path):
    """A model folder copied to an exFAT drive by a Mac: every file has its `._` companion."""
    d = tmp_path / "exfat" / "llama"
    shutil.copytree(tiny_models["llama"], d)
    for p in list(d.iterdir()):
        (d / f"._{p.name}").write_bytes(APPLEDOUBLE)
    return d


def test_appledouble_files_are_not_weights_of_a_source(apple_source, tmp_path):
    snap = source.resolve(str(apple_source))
    assert snap.weight_files == ["model.safetensors"]
    assert filesystem.files(apple_source, ".safetensors") == ["model.safetensors"]
    assert layout.weight_files(apple_source) == ["model.safetensors"]
    # a folder of shards without an index (the glob path): the companion is not a second shard
    (apple_source / "model.safetensors").rename(apple_source / "weights.safetensors")
    assert source.resolve(str(apple_source)).weight_files == ["weights.safetensors"]
    assert layout.weight_files(apple_source) == ["weights.safetensors"]


def test_quantize_verify_and_calibrate_ignore_appledouble_files(apple_source, tmp_path):
    res = cli("quantize", apple_source, "-o", tmp_path / "out")
    assert res.exit_code == 0, res.output
    art = tmp_path / "out"
    m = mpsconvert.inspect(art)
    assert not any(n.startswith("._") for n in m.files) and not any(n.startswith("._") for n in m.source["files"])
    # the artifact copied back to the drive: macOS adds companions to the artifact too
    for p in list(art.iterdir()):
        (art / f"._{p.name}").write_bytes(APPLEDOUBLE)
    (art / "._model.py").write_bytes(APPLEDOUBLE)  # a `.py` name, which verify treats as added code otherwise
    report = mpsconvert.verify(art)
    assert report.ok and report.warnings == [] and report.unlisted == [], report.as_dict()
    assert layout.weight_files(art) == ["model.safetensors"]
    # calibration reads every *.safetensors of the folder it calibrates
    from mpsconvert.calibrate.calibration import Weights

    assert sorted(Weights(apple_source, "model").files) == ["model.safetensors"]
    # a package's files as the manifest lists them
    pkg = tmp_path / "pkg.mlpackage"
    (pkg / "Data").mkdir(parents=True)
    (pkg / "Data" / "weight.bin").write_bytes(b"w")
    (pkg / "Data" / "._weight.bin").write_bytes(APPLEDOUBLE)
    assert list(folder_files(pkg, tmp_path)) == ["pkg.mlpackage/Data/weight.bin"]


def test_case_insensitive_volumes_are_detected_by_stat_not_by_platform(tmp_path, monkeypatch):
    f = tmp_path / "Model.txt"
    f.write_text("x")
    assert filesystem.case_insensitive(f) is False  # Linux tmp: another spelling is another name
    # what stat says on APFS: both spellings are the same file (a hard link gives the same answer here)
    (tmp_path / "mODEL.TXT").hardlink_to(f)
    assert filesystem.case_insensitive(f) is True
    monkeypatch.setattr("sys.platform", "darwin")  # the platform is not what decides
    (tmp_path / "mODEL.TXT").unlink()
    assert filesystem.case_insensitive(f) is False


def test_output_that_is_the_source_on_a_case_insensitive_volume_is_refused(tiny_models, tmp_path, monkeypatch):
    src = tmp_path / "Models" / "Llama"
    shutil.copytree(tiny_models["llama"], src)
    monkeypatch.setattr(filesystem, "case_insensitive", lambda path: True)  # as on APFS
    before = models.tree_hashes(tmp_path)
    for out, says in ((tmp_path / "models" / "llama", "is the source"), (tmp_path / "MODELS", "holds the source")):
        res = cli("quantize", src, "-o", out, "--force")
        one_line_error(res, says)
        assert models.tree_hashes(tmp_path) == before and not out.exists()
    # an existing artifact inside the source, the source spelt another way: refused too
    inside = tmp_path / "Models" / "Llama" / "fp8"
    mpsconvert.quantize(tiny_models["llama"], inside)
    with pytest.raises(MpsconvertError, match="inside the source"):
        output_rule.check_replaceable(
            inside, force=True, is_ours=layout.is_artifact, protect=(tmp_path / "MODELS" / "LLAMA",)
        )
    # on a case-sensitive volume the other spelling is another folder, and the conversion goes there
    monkeypatch.setattr(filesystem, "case_insensitive", lambda path: False)
    assert cli("quantize", src, "-o", tmp_path / "models" / "llama").exit_code == 0
    assert (tmp_path / "models" / "llama" / "mpsconvert.json").is_file()


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_volume_that_cannot_lock_is_one_line(tiny_models, tmp_path, monkeypatch, code):
    real = fcntl.flock

    def flock(fd, op):
        if op & fcntl.LOCK_EX:
            raise OSError(code, "simulated: " + errno.errorcode[code])
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    res = cli("quantize", tiny_models["llama"], "-o", tmp_path / "share" / "out")
    one_line_error(res, f"cannot lock {tmp_path / 'share'}")
    assert "local disk" in res.output  # the fix
    assert not (tmp_path / "share").exists()  # nothing left, not even the folder made for the lock


def test_hub_downloads_leave_appledouble_files_out(monkeypatch, tiny_models, tmp_path):
    seen = {}

    def fake(repo_id, **kw):
        seen.update(kw)
        return str(tiny_models["llama"])

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake)
    source.resolve("org/model")
    assert "._*" in seen["ignore_patterns"] and json.dumps(seen["allow_patterns"])
