"""Hostile artifacts and careless use. Each attack is reproduced and must be refused, with nothing
written outside, nothing lost, nothing laundered and no code run."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import mpsconvert
from mpsconvert.cli import main
from mpsconvert.convert.quantize import quantize_snapshot
from mpsconvert.convert.quantize_options import Options
from mpsconvert.errors import ArtifactError, DataError, MpsconvertError, QuantizationError, SourceError
from mpsconvert.infra import atomic, tempdirs
from mpsconvert.infra.untrusted import MAX_JSON_DEPTH, bad_relpath, inside, parse_json
from mpsconvert.manifests.manifest import MANIFEST_NAME, Manifest
from mpsconvert.manifests.verify import verify_artifact
from mpsconvert.source import snapshot as source

from .models import resign, tiny, tiny_artifact, tree_hashes


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def base(work):
    """A tiny Llama with a tokenizer (so calibrate can run) and its fp8-dynamic artifact."""
    art = tiny_artifact(work, "llama", partial(tiny, "llama", tokenizer="minilm"))
    return work / "src-llama", art


@pytest.fixture
def art(base, tmp_path):
    dst = tmp_path / "box" / "art"
    shutil.copytree(base[1], dst)
    return dst


def _outside_tree(root: Path, art: Path) -> dict:
    """Every file under root except the artifact's own (what "nothing written outside" compares)."""
    return {k: v for k, v in tree_hashes(root).items() if not (root / k).is_relative_to(art)}


def _shard_bytes(art: Path) -> tuple[Path, dict, int]:
    p = art / "model.safetensors"
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return p, json.loads(raw[8 : 8 + n]), 8 + n


def _patch_tensor(art: Path, name: str, values: bytes, at: int = 0) -> None:
    """Overwrite bytes of one tensor in place and re-record the shard's hash (an attacker or a
    bug that also rewrote the manifest: only the value checks stand in the way)."""
    p, header, start = _shard_bytes(art)
    data = bytearray(p.read_bytes())
    off = start + header[name]["data_offsets"][0] + at
    data[off : off + len(values)] = values
    p.write_bytes(bytes(data))
    resign(art, "model.safetensors")


# --------------------------------------------------------------------------- 1. one rule for paths


@pytest.mark.parametrize(
    "rel,why",
    [
        ("/etc/passwd", "absolute"),
        ("a/../../x", "'..'"),
        ("./a", "'.'"),
        ("a//b", "empty"),
        (".ssh/id", "hidden"),
        ("a\\b", "backslash"),
        ("c:x", "colon"),
        ("a\x00b", "control"),
        ("", "non-empty"),
        (5, "non-empty"),
    ],
)
def test_the_path_rule_refuses_odd_names(rel, why, tmp_path):
    assert why in bad_relpath(rel)
    with pytest.raises(ArtifactError, match="only plain relative paths"):
        inside(tmp_path, rel, what="test")
    assert bad_relpath("tokenizer.json") is None and bad_relpath("model.mlpackage/Data/x.bin") is None


def test_attack1_calibrate_cannot_write_outside_through_a_symlinked_folder(art, tmp_path):
    """`files` names a path through a link inside the artifact: refused before anything is written."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (art / "linkdir").symlink_to(outside)
    (outside / "payload").write_text("attacker's bytes")
    for entry in ("linkdir/../../pwned", "linkdir/payload"):
        m = json.loads((art / MANIFEST_NAME).read_text())
        m["files"][entry] = {"sha256": "0" * 64, "size": 16}
        (art / MANIFEST_NAME).write_text(json.dumps(m))
        before = _outside_tree(tmp_path, art)
        res = cli("calibrate", art, "--num-samples", "2", "--seq-len", "16")
        assert res.exit_code == 2 and "error:" in res.output and "Traceback" not in res.output, res.output
        assert "linkdir" in res.output and ("'..' part" in res.output or "outside the model folder" in res.output)
        assert _outside_tree(tmp_path, art) == before
        assert not (tmp_path / "pwned").exists() and not (tmp_path / "box" / "pwned").exists()
        m["files"].pop(entry)
        (art / MANIFEST_NAME).write_text(json.dumps(m))


def test_config_that_is_a_symlink_out_of_the_source_is_refused(base, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(base[0], d)
    real = tmp_path / "elsewhere.json"
    shutil.move(d / "config.json", real)
    (d / "config.json").symlink_to(real)
    with pytest.raises(SourceError, match="outside the model folder"):
        source.resolve(str(d))


# --------------------------------------------------------------------------- 2. verify before use, no laundering


@pytest.mark.parametrize("victim", ["model.safetensors", "tokenizer.json"])
def test_attack2_calibrate_does_not_launder_a_tampered_file(art, victim):
    p = art / victim
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    assert cli("verify", art).exit_code == 1
    before = tree_hashes(art)
    res = cli("calibrate", art, "--num-samples", "2", "--seq-len", "16")
    assert res.exit_code == 2 and "does not match the sha256" in res.output, res.output
    assert tree_hashes(art) == before  # nothing rewritten
    assert cli("verify", art).exit_code == 1  # still caught


def test_rebuild_refuses_a_file_changed_after_verification(art):
    """Even past the first check (a file swapped while calibration ran), the rebuild re-checks
    every file it carries over against the old manifest before hashing it into the new one."""
    from mpsconvert.calibrate.artifact import write_into_artifact
    from mpsconvert.calibrate.calibration import Calibration
    from mpsconvert.manifests.transaction import transaction

    m = Manifest.read(art)
    cal = Calibration(scales={r["module"]: 0.01 for r in m.tensors.values()}, expert_scales={}, record={})
    (art / "tokenizer.json").write_text("{}")
    before = tree_hashes(art)
    with pytest.raises(ArtifactError, match="tokenizer.json does not match"):
        with transaction(art) as t:
            write_into_artifact(t, cal)
    assert tree_hashes(art) == before


def _evil_code(art: Path, marker: Path, listed: bool) -> None:
    cfg = json.loads((art / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig"}
    (art / "config.json").write_text(json.dumps(cfg))
    (art / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import LlamaConfig as EvilConfig\n"
    )
    resign(art, "config.json")  # the attacker rewrote the manifest's config entry too
    if listed:  # listed, then changed
        resign(art, "evil.py")
        (art / "evil.py").write_text((art / "evil.py").read_text() + "# changed\n")


@pytest.mark.parametrize("listed", [False, True])
def test_attack4_artifact_code_never_runs_before_verification(art, tmp_path, listed):
    marker = tmp_path / "code-ran"
    _evil_code(art, marker, listed)
    report = mpsconvert.verify(art, trust_remote_code=True)
    assert not report.ok and any("evil.py" in p for p in report.problems), report.problems
    with pytest.raises(ArtifactError, match="evil.py"):
        mpsconvert.load(art, device="cpu", trust_remote_code=True)
    res = cli("verify", art, "--trust-remote-code")
    assert res.exit_code == 1 and "evil.py" in res.output
    assert not marker.exists()


# --------------------------------------------------------------------------- 3. --force replaces only our artifacts


def _q(src, out, force=True):
    return quantize_snapshot(source.resolve(str(src)), Path(out), Options(force=force))


def test_attack3_force_never_replaces_the_source_or_what_holds_it(base, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(base[0], src)
    before = tree_hashes(tmp_path)
    with pytest.raises(MpsconvertError, match="source model"):
        _q(src, src)
    outer = tmp_path / "OUT"
    shutil.copytree(base[1], outer)  # even an mpsconvert artifact holding the source
    shutil.copytree(base[0], outer / "src")
    before = tree_hashes(tmp_path)
    with pytest.raises(MpsconvertError, match="holds the source model"):
        _q(outer / "src", outer)
    assert tree_hashes(tmp_path) == before


def test_attack3_force_into_a_folder_of_other_files_is_refused(base, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "thesis.tex").write_text("years of work")
    monkeypatch.chdir(work)
    res = cli("quantize", base[0], "-o", ".", "--force")
    assert res.exit_code == 2 and "not an mpsconvert artifact" in res.output
    assert (work / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_attack3_force_onto_a_file_or_symlink_is_refused_and_leaves_nothing(base, tmp_path, kind):
    target = tmp_path / "out"
    if kind == "file":
        target.write_text("a file")
    else:
        (tmp_path / "real").mkdir()
        target.symlink_to(tmp_path / "real")
    for _ in range(2):  # the second --force fails the same way (no `-old` left behind)
        with pytest.raises(MpsconvertError, match=f"is a {kind}"):
            _q(base[0], target)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(atomic.TMP_PREFIX)]
    assert target.is_symlink() if kind == "symlink" else target.read_text() == "a file"
    _q(base[0], tmp_path / "fine")  # and a proper output still works
    _q(base[0], tmp_path / "fine")
    assert verify_artifact(tmp_path / "fine").ok


def test_a_leftover_old_output_never_blocks_force(base, tmp_path):
    out = tmp_path / "out"
    _q(base[0], out, force=False)
    old = tmp_path / f"{atomic.TMP_PREFIX}out-old"
    old.write_text("left by an older version")  # a plain file under the parked name must not block --force
    _q(base[0], out)
    # not ours (no marker naming `out` inside), so never removed; a swap parks under a fresh name
    assert old.read_text() == "left by an older version" and verify_artifact(out).ok
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(atomic.TMP_PREFIX) and p != old]


# --------------------------------------------------------------------------- 4. locked, kill-safe writers


_PUBLISH = """
import sys
from pathlib import Path
from mpsconvert.infra import atomic
from mpsconvert.manifests.records import Validation, ValidationRun
from mpsconvert.manifests.transaction import transaction
art = Path(sys.argv[1]).absolute()
if sys.argv[2] == "record":  # what validate's, the checks' and upload's records do: a record and the card
    with transaction(art) as t:
        acc = {"tokens": 64, "perplexity_bf16": 10.0, "perplexity_fp8": 10.1, "perplexity_delta_pct": 1.0,
               "mean_kl": 0.01, "top1_agreement": 0.9}
        t.put(Validation(runs={"CPU (cpu)": ValidationRun(kind="causal-lm", device="cpu", accuracy=acc)}))
else:  # what the Apple exports do: a package, its files' hashes, its record and the card
    with transaction(art, drop=("model.mlpackage",)) as t:
        pkg = t.folder / "model.mlpackage"
        pkg.mkdir(); (pkg / "weights.bin").write_bytes(bytes(range(256)) * 64)
        t.add_files("model.mlpackage")
        atomic.kill_point("package-written")
        t.manifest.extra["test_package"] = {"package": pkg.name}
"""

# every step of a transaction, in order: the staged copy, the package, the card's and the
# manifest's temporary files, the card written (the manifest not yet), both written, the swap
PUBLISH_POINTS = [
    "staged",
    "package-written",
    "text-temp-written",
    "card-written",
    "staged-written",
    "between-renames",
    "after-renames",
]


def _run_killed(point, *args):
    env = {**os.environ, atomic.KILL_ENV: point}
    return subprocess.run([sys.executable, "-c", _PUBLISH, *map(str, args)], env=env, capture_output=True, timeout=120)


@pytest.mark.slow  # a real process killed at every step: CI runs it in the slow lane
@pytest.mark.parametrize("mode", ["package", "record"])
@pytest.mark.parametrize("point", PUBLISH_POINTS)
def test_records_packages_and_the_card_appear_together_whatever_the_kill_point(art, tmp_path, point, mode):
    """A transaction killed at any of its steps leaves the artifact as it was (killed before the
    second rename) or as the transaction made it (after): never a card whose hash the manifest
    lacks, never a package without its record; the next reader recovers a swap cut in two."""
    if mode == "record" and point == "package-written":
        pytest.skip("a record-only transaction writes no package")
    work = tmp_path / "art"
    shutil.copytree(art, work)
    before = tree_hashes(work)
    r = _run_killed(point, work, mode)
    assert r.returncode == -9, r.stderr.decode()[-800:]  # the kill point was reached
    report = mpsconvert.verify(work)  # a reader recovers a swap cut in two
    assert report.ok, report.problems
    after = Manifest.read(work)
    changed = "test_package" in after.extra if mode == "package" else "validation" in after.extra
    assert changed == (point == "after-renames")
    if changed:  # the card was rendered from the new manifest, in the same swap
        assert mode == "package" or "| CPU (cpu) |" in (work / "README.md").read_text()
    else:
        assert tree_hashes(work) == before
    r = subprocess.run(
        [sys.executable, "-c", _PUBLISH, str(work), mode], capture_output=True, timeout=120
    )  # the rerun completes, cleans up
    assert r.returncode == 0, r.stderr.decode()[-800:]
    assert mpsconvert.verify(work).ok
    assert not [p for p in list(work.iterdir()) + list(work.parent.iterdir()) if p.name.startswith(atomic.TMP_PREFIX)]


@pytest.mark.extra("coreml")
def test_a_second_writer_is_refused_while_one_holds_the_artifact(art):
    with atomic.writing(art.absolute()):
        with pytest.raises(MpsconvertError, match="another mpsconvert run is writing"):
            mpsconvert.export_coreml(art, check=False)
        with pytest.raises(MpsconvertError, match="another mpsconvert run is writing"):
            mpsconvert.calibrate(art)
    assert not (art / "model.mlpackage").exists()


def test_stale_system_temp_folders_of_killed_runs_are_removed():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    root = Path(tempfile.gettempdir())
    dead = root / f"mpsconvert-calib-{p.pid}-zzz"
    live = root / f"mpsconvert-calib-{os.getpid()}-zzz"
    for d in (dead, live):
        d.mkdir(exist_ok=True)
        (d / "model.safetensors").write_bytes(b"x")
    try:
        with tempdirs.private_tempdir("calib") as mine:
            assert mine.name.startswith(f"mpsconvert-calib-{os.getpid()}-")
            assert not dead.exists() and live.exists()
        assert not mine.exists()
    finally:
        shutil.rmtree(live, ignore_errors=True)
        shutil.rmtree(dead, ignore_errors=True)


# --------------------------------------------------------------------------- 5. honest verify


def test_no_manifest_means_cannot_verify(art):
    (art / MANIFEST_NAME).unlink()
    p = art / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[-5] ^= 0x01
    p.write_bytes(bytes(data))
    res = cli("verify", art)
    assert res.exit_code == 1 and "cannot verify" in res.output


def test_unlisted_files_are_reported_and_unlisted_code_fails(art):
    (art / "notes.txt").write_text("hi")
    report = mpsconvert.verify(art)
    assert report.ok and report.unlisted == ["notes.txt"] and any("notes.txt" in w for w in report.warnings)
    (art / "sub").mkdir()
    (art / "sub" / "hook.py").write_text("print('hi')")
    report = mpsconvert.verify(art)
    assert not report.ok and "sub/hook.py" in report.unlisted and any("sub/hook.py" in p for p in report.problems)


@pytest.mark.parametrize("value", [float("nan"), -0.5, 0.0, float("inf")])
def test_bad_scale_values_are_caught_by_verify_and_load(art, value):
    _patch_tensor(art, "model.layers.0.mlp.up_proj.weight_scale", struct.pack("<f", value))
    report = mpsconvert.verify(art)
    assert not report.ok and any("not finite positive scales" in p for p in report.problems), report.problems
    with pytest.raises(ArtifactError, match="not finite positive"):
        mpsconvert.load(art, device="cpu")


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_nan_codes_are_caught_by_verify_and_load(art, code, monkeypatch):
    from mpsconvert.manifests import values

    _patch_tensor(art, "model.layers.1.self_attn.q_proj.weight", bytes([code]), at=7)
    for hashes in (True, False):  # counted in the read that hashes the files, or (structure only) on their own
        report = mpsconvert.verify(art, check_hashes=hashes)
        assert not report.ok and [p for p in report.problems if "NaN code" in p] == [
            "model.layers.1.self_attn.q_proj.weight in model.safetensors holds 1 NaN code(s) (0x7F/0xFF), which no "
            "quantizer writes"
        ]
    with pytest.raises(ArtifactError, match="NaN codes"):
        mpsconvert.load(art, device="cpu")

    def no_second_read(*a, **k):
        raise AssertionError("the codes were read again after hashing")

    monkeypatch.setattr(values.np, "memmap", no_second_read)
    assert not mpsconvert.verify(art).ok  # found in the hashing read alone


def test_the_manifest_sha256_pins_the_artifact(base, tmp_path):
    out = tmp_path / "pinned"
    res = mpsconvert.quantize(base[0], out)
    pin = res.manifest_sha256
    assert len(pin) == 64 and pin == mpsconvert.verify(out).manifest_sha256
    assert cli("verify", out, "--manifest-sha256", pin).exit_code == 0
    mpsconvert.load(out, device="cpu", manifest_sha256=pin)
    # the attacker rewrites a file and its manifest entry: only the pin catches it
    (out / "tokenizer_config.json").write_text("{}")
    resign(out, "tokenizer_config.json")
    assert mpsconvert.verify(out).ok
    res = cli("verify", out, "--manifest-sha256", pin)
    assert res.exit_code == 1 and "not the pinned" in res.output
    with pytest.raises(ArtifactError, match="not the pinned"):
        mpsconvert.load(out, device="cpu", manifest_sha256=pin)
    assert "manifest sha256" in cli("quantize", base[0], "-o", tmp_path / "shown").output


# --------------------------------------------------------------------------- 6. the source checked at quantize


def _edit_source(base, tmp_path, fn) -> Path:
    d = tmp_path / "edited"
    shutil.copytree(base[0], d)
    sd = load_file(d / "model.safetensors")
    fn(sd)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("dtype", [None, "bfloat16"])  # copied as it is (the writer's copy), or cast (block by block)
@pytest.mark.parametrize("tensor", ["model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"])
def test_nan_in_a_copied_tensor_is_refused(base, tmp_path, tensor, dtype):
    d = _edit_source(
        base,
        tmp_path,
        lambda sd: sd[tensor].view(-1).__setitem__(3 if tensor != "model.norm.weight" else -1, float("inf")),
    )
    with pytest.raises(QuantizationError, match=f"tensor '{tensor}' in model.safetensors contains 1 NaN or inf"):
        quantize_snapshot(source.resolve(str(d)), tmp_path / "out", Options(dtype=dtype))
    assert not (tmp_path / "out").exists() and not [
        p for p in tmp_path.iterdir() if p.name.startswith(atomic.TMP_PREFIX)
    ]


@pytest.mark.parametrize("how", ["shape", "rank", "dtype"])
def test_a_weight_that_does_not_fit_its_config_is_refused(base, tmp_path, how):
    key = "model.layers.0.mlp.down_proj.weight"

    def edit(sd):
        w = sd[key]
        sd[key] = {"shape": w[:, :-16].contiguous(), "rank": w.reshape(-1), "dtype": w.to(torch.int32)}[how]

    d = _edit_source(base, tmp_path, edit)
    with pytest.raises(SourceError, match="down_proj.weight"):
        _q(d, tmp_path / "out", force=False)
    assert not (tmp_path / "out").exists()


def test_a_plan_that_quantizes_nothing_is_an_error(base, tmp_path):
    d = tmp_path / "empty"
    shutil.copytree(base[0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 0
    (d / "config.json").write_text(json.dumps(cfg))
    sd = {k: v for k, v in load_file(d / "model.safetensors").items() if ".layers." not in k}
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QuantizationError, match="nothing to quantize"):
        _q(d, tmp_path / "out", force=False)


# --------------------------------------------------------------------------- 7. no tracebacks on bad data


def _deep(n=10_000) -> str:
    return "[" * n + "]" * n


def test_deep_json_is_one_clear_error_everywhere(art, tmp_path):
    with pytest.raises(ArtifactError, match=f"deeper than {MAX_JSON_DEPTH}"):
        parse_json(_deep(), what="x")
    (art / MANIFEST_NAME).write_text('{"a": ' + _deep() + "}")
    assert any("deeper" in p for p in mpsconvert.verify(art).problems)
    with pytest.raises(ArtifactError, match="deeper"):
        mpsconvert.load(art, device="cpu")
    data = tmp_path / "calib.json"
    data.write_text(_deep())
    from mpsconvert.infra.texts import read_documents

    with pytest.raises(DataError, match="deeper"):
        read_documents(data)
    st = tmp_path / "x.safetensors"
    raw = ('{"a": ' + _deep(200) + "}").encode()
    st.write_bytes(struct.pack("<Q", len(raw)) + raw)
    from mpsconvert.infra.safetensors_io import read_header

    with pytest.raises(ArtifactError, match="x.safetensors"):
        read_header(st)


@pytest.mark.parametrize(
    "where,edit",
    [
        ("config.json", lambda b: b.update(quantization_config=[1])),
        ("config.json", lambda b: b["quantization_config"].update(config_groups=7)),
        ("config.json", lambda b: b["quantization_config"].update(ignore={"a": 1})),
        (MANIFEST_NAME, lambda b: b.update(files=[1, 2])),
        (MANIFEST_NAME, lambda b: b.update(source="x")),
        (MANIFEST_NAME, lambda b: b["files"].update({"config.json": {"sha256": 5, "size": "big"}})),
        (MANIFEST_NAME, lambda b: b.update(tensors={"a": 3})),
        (MANIFEST_NAME, lambda b: b.pop("recipe")),
    ],
)
def test_wrong_json_types_are_one_clear_error(art, where, edit):
    body = json.loads((art / where).read_text())
    edit(body)
    (art / where).write_text(json.dumps(body))
    report = mpsconvert.verify(art)
    assert not report.ok
    with pytest.raises(ArtifactError):
        mpsconvert.load(art, device="cpu")
    res = cli("calibrate", art, "--num-samples", "2")
    assert (
        res.exit_code == 2
        and "Traceback" not in res.output
        and res.exception is None
        or isinstance(res.exception, SystemExit)
    )


def test_a_missing_shard_is_a_clear_error_for_calibrate(base, tmp_path):
    from .models import tiny

    src = tiny("llama", tmp_path / "sharded-src", tokenizer="minilm", max_shard_size="2MB")
    art = tmp_path / "sharded"
    mpsconvert.quantize(src, art)
    next(art.glob("model-00002-*.safetensors")).unlink()
    res = cli("calibrate", art, "--num-samples", "2")
    assert (
        res.exit_code == 2
        and "missing" in res.output
        and res.exception is None
        or isinstance(res.exception, SystemExit)
    )


def test_disk_full_in_every_manifest_or_scales_write_is_one_line(art, tmp_path, monkeypatch):
    import errno

    real = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    from mpsconvert.calibrate.artifact import save_scales
    from mpsconvert.calibrate.calibration import Calibration
    from mpsconvert.manifests.records import Validation
    from mpsconvert.manifests.transaction import transaction

    monkeypatch.setattr(atomic.os, "fsync", full)
    with pytest.raises(MpsconvertError, match="is full"):
        with transaction(art) as t:  # what validate's and the checks' records do
            t.put(Validation())
    with pytest.raises(MpsconvertError, match="is full"):
        save_scales(tmp_path / "scales.json", Calibration(scales={"a": 1.0}, expert_scales={}, record={}))
    monkeypatch.setattr(atomic.os, "fsync", real)
    assert mpsconvert.verify(art).ok and not (tmp_path / "scales.json").exists()
    assert not [p for p in art.iterdir() if p.name.startswith(atomic.TMP_PREFIX)]


# --------------------------------------------------------------------------- Apple exports: kill-safe, reproducible


@pytest.fixture(scope="module")
def coreml_art(tmp_path_factory):
    from .models import tiny, tiny_artifact

    return tiny_artifact(
        tmp_path_factory.mktemp("sec-coreml"), "llama", partial(tiny, "llama", dtype=torch.bfloat16, tie=True)
    )


@pytest.mark.slow  # a real process killed at every step: CI runs it in the slow lane
@pytest.mark.extra("coreml")
def test_export_coreml_killed_between_its_steps_then_rerun(coreml_art, tmp_path):
    """The real command, SIGKILLed after the package is written and between the two renames of
    its --force swap: the artifact always verifies and loads; the rerun completes and cleans up."""
    art = tmp_path / "art"
    shutil.copytree(coreml_art, art)
    cmd = [
        sys.executable,
        "-m",
        "mpsconvert.cli",
        "export-coreml",
        str(art),
        "--no-kv-cache",
        "--seq-len",
        "8",
        "--no-check",
    ]
    assert subprocess.run(cmd, capture_output=True, timeout=600).returncode == 0
    first = tree_hashes(art)
    for point in ("package-written", "between-renames"):
        r = subprocess.run(
            [*cmd, "--force"], env={**os.environ, atomic.KILL_ENV: point}, capture_output=True, timeout=600
        )
        assert r.returncode == -9, r.stderr.decode()[-1500:]
        assert mpsconvert.verify(art).ok  # recovered by the reader if the kill fell between the renames
        assert tree_hashes(art) == first
    r = subprocess.run([*cmd, "--force"], capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode()[-1500:]
    assert mpsconvert.verify(art).ok
    assert tree_hashes(art) == first  # byte-identical to the first export (reproducible)
    assert not [p for p in list(art.iterdir()) + list(tmp_path.iterdir()) if p.name.startswith(atomic.TMP_PREFIX)]
    # the killed runs' own temp folders (coremltools' tmp*.mlpackage inside) were removed by the next run
    assert not [
        p
        for p in Path(tempfile.gettempdir()).glob("mpsconvert-coreml-*")
        if p.name.split("-")[2].isdigit() and not tempdirs._alive(int(p.name.split("-")[2]))
    ]


def test_an_all_zero_weight_has_an_undefined_sqnr_not_an_exact_one(base, tmp_path):
    d = _edit_source(base, tmp_path, lambda sd: sd["model.layers.0.mlp.up_proj.weight"].zero_())
    _q(d, tmp_path / "out", force=False)
    rec = Manifest.read(tmp_path / "out").tensors["model.layers.0.mlp.up_proj.weight"]
    assert rec["sqnr_db"] is None and rec["sqnr_undefined"] is True
    assert "exact" not in cli("inspect", tmp_path / "out", "--tensors").output.split("up_proj")[1].splitlines()[0]


def test_disk_full_while_a_package_is_written_is_one_line_and_changes_nothing(art):
    """What export-coreml / export-coreai do when the disk fills while saving the package."""
    import errno

    from mpsconvert.manifests.transaction import transaction

    def write(p):
        p.mkdir()
        raise OSError(errno.ENOSPC, "No space left on device")

    before = tree_hashes(art)
    with pytest.raises(MpsconvertError, match="is full"):
        with transaction(art, drop=("model.mlpackage",)) as t:
            write(t.folder / "model.mlpackage")
    assert tree_hashes(art) == before
    assert not [p for p in art.parent.iterdir() if p.name.startswith(atomic.TMP_PREFIX)]


def test_all_subnormal_weights_give_a_warning(base, tmp_path):
    key = "model.layers.0.mlp.up_proj.weight"
    d = _edit_source(base, tmp_path, lambda sd: sd[key].mul_(1e-39 / float(sd[key].abs().max())))
    res = cli("quantize", d, "-o", tmp_path / "out")
    assert res.exit_code == 0 and "every value is subnormal" in res.output and key in res.output
    assert any(key in w for w in Manifest.read(tmp_path / "out").summary["warnings"])
