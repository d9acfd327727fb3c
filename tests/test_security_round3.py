"""Issue 33 (security round 3): the folder around an artifact, sources checked before anything is
written, bounded parsing, cards and terminal output as text, one trust boundary for what loaders
read, upload of exactly the verified files, a pin that lasts, and card + manifest in one swap.
Each attack is reproduced as a user would meet it and must end in one clean line or a correct
result, with nothing written outside, nothing lost and nothing unverified used."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import mpsconvert
from mpsconvert import atomic
from mpsconvert.cli import main
from mpsconvert.errors import ArtifactError, MpsconvertError
from mpsconvert.manifests import layout
from mpsconvert.manifests.manifest import MANIFEST_NAME, Manifest
from mpsconvert.manifests.records import Hub
from mpsconvert.manifests.transaction import transaction

from . import models
from .bounded import within

COREAI_ASSET, COREML_PACKAGE = "model.aimodel", "model.mlpackage"  # the Apple targets' package names (apple/)
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
    src = models.tiny("llama", work / "src", tokenizer="bpe", dtype=torch.bfloat16)
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
        with transaction(art):
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
    with transaction(art) as t:  # a writer: recovers what killed runs of ours left, only that
        t.put(Hub(repo="me/x"))
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
    user = art / COREAI_ASSET
    user.mkdir()
    (user / "my-notes.txt").write_text("mine")

    with pytest.raises(ArtifactError, match="not a package mpsconvert wrote"):
        layout.check_package_slot(art, COREAI_ASSET, Manifest.read(art).files, force=True)
    assert (user / "my-notes.txt").read_text() == "mine"
    # a package mpsconvert wrote (listed) is replaced with force, and refused without
    shutil.rmtree(user)
    with transaction(art, drop=(COREAI_ASSET,)) as t:
        (t.folder / COREAI_ASSET).mkdir()
        (t.folder / COREAI_ASSET / "weights.bin").write_bytes(b"x")
        t.add_files(COREAI_ASSET)
    with pytest.raises(MpsconvertError, match="already exists"):
        layout.check_package_slot(art, COREAI_ASSET, Manifest.read(art).files, force=False)
    layout.check_package_slot(art, COREAI_ASSET, Manifest.read(art).files, force=True)


@pytest.mark.extra("coreai")
def test_export_coreai_force_refuses_a_user_folder_named_like_its_asset(art):
    user = art / COREAI_ASSET
    user.mkdir()
    (user / "my-notes.txt").write_text("mine")
    res = cli("export-coreai", art, "--force")
    one_line_error(res, "not a package mpsconvert wrote")
    assert (user / "my-notes.txt").read_text() == "mine"


def test_a_symlinked_artifact_is_written_through_its_target(art, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(art, target_is_directory=True)
    with transaction(link) as t:
        t.put(Hub(repo="me/through-the-link"))
    with transaction(link, drop=(COREML_PACKAGE,)) as t:
        (t.folder / COREML_PACKAGE).mkdir()
        (t.folder / COREML_PACKAGE / "weights.bin").write_bytes(b"x" * 100)
        t.add_files(COREML_PACKAGE)
    assert link.is_symlink() and link.resolve() == art.resolve()
    m = Manifest.read(art)
    assert m.get(Hub).repo == "me/through-the-link" and (art / COREML_PACKAGE / "weights.bin").is_file()
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


# --------------------------------------------------------------------------- 7. sources checked before anything is written


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory):
    """A FineGrainedFP8 source with 32 x 32 blocks: gate_proj [128, 64] has [4, 2] scales."""
    import torch

    work = tmp_path_factory.mktemp("fp8src")
    return models.to_fine_grained_fp8(models.tiny("qwen3", work / "bf16", dtype=torch.float32), work / "fp8", 32)


GATE = "model.layers.0.mlp.gate_proj.weight"


def _edited(src: Path, dst: Path, edit, cfg_edit=None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if cfg_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _nan_code(sd, code=0x7F):
    import torch

    w = sd[GATE].view(torch.uint8).clone()
    w[3, 5] = code
    sd[GATE] = w.view(torch.float8_e4m3fn)


def _set(key, fn):
    def edit(sd):
        sd[key] = fn(sd[key])
    return edit


FP8_SOURCE_ATTACKS = {
    "scale 3e38 (finite, but 448 x it is inf)": (_set(GATE + "_scale_inv", lambda s: s.fill_(3e38)), "dequantize past float32"),
    "scale transposed [2, 4] for [4, 2]": (_set(GATE + "_scale_inv", lambda s: s.t().contiguous()), "are [4, 2]"),
    "scale flat [8]": (_set(GATE + "_scale_inv", lambda s: s.reshape(-1).contiguous()), "are [4, 2]"),
    "scale negative": (_set(GATE + "_scale_inv", lambda s: -s), "not finite positive"),
    "NaN code 0x7F": (_nan_code, "NaN code"),
    "NaN code 0xFF": (lambda sd: _nan_code(sd, 0xFF), "NaN code"),
    "3-D FP8 tensor": (lambda sd: sd.__setitem__("model.extra.weight", sd[GATE].reshape(2, 64, 64).clone()), "2-D FP8 weights"),
}


@pytest.mark.parametrize("attack", sorted(FP8_SOURCE_ATTACKS))
def test_an_fp8_source_that_verify_would_reject_is_refused_at_quantize(fp8_source, tmp_path, attack):
    edit, says = FP8_SOURCE_ATTACKS[attack]
    src = _edited(fp8_source, tmp_path / "src", edit)
    one_line_error(cli("quantize", src, "-o", tmp_path / "out"), says)
    assert not (tmp_path / "out").exists()


def test_a_negative_static_input_scale_of_an_fp8_source_is_refused(base, tmp_path):
    """A compressed-tensors static FP8 source (ours, calibrated) whose input_scale is negative."""
    from safetensors.torch import load_file

    static = tmp_path / "static"
    mpsconvert.quantize(base[0], static, scheme="fp8", calibration=mpsconvert.calibration_options(num_samples=1, seq_len=16))
    key = next(k for k in load_file(str(static / "model.safetensors")) if k.endswith("input_scale"))
    src = _edited(static, tmp_path / "src", _set(key, lambda s: -s))
    (src / MANIFEST_NAME).unlink()
    one_line_error(cli("quantize", src, "-o", tmp_path / "out"), "input scale", key)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [1e308, 5e-324, 3e38, -1.0, float("nan")])
def test_a_scales_file_with_values_float32_cannot_hold_is_refused(base, tmp_path, value):
    from mpsconvert.calibrate.artifact import SCALES_FORMAT, SCALES_VERSION

    mods = {r["module"] for r in Manifest.read(base[1]).tensors.values()}
    scales = tmp_path / "scales.json"
    body = {"format": SCALES_FORMAT, "version": SCALES_VERSION, "input_scales": {m: 0.01 for m in mods}, "calibration": {}}
    body["input_scales"][sorted(mods)[0]] = value
    scales.write_text(json.dumps(body))
    one_line_error(cli("quantize", base[0], "-o", tmp_path / "out", "--scheme", "fp8", "--scales", scales), "input scale")
    assert not (tmp_path / "out").exists()


def test_dtype_float16_that_overflows_a_tensor_is_an_error_naming_it(base, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(base[0], src)
    sd = load_file(str(src / "model.safetensors"))
    sd["model.norm.weight"] = sd["model.norm.weight"].clone()
    sd["model.norm.weight"][7] = 1e6  # fine in bfloat16, inf in float16
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    one_line_error(cli("quantize", src, "-o", tmp_path / "out", "--dtype", "float16"), "model.norm.weight", "inf")
    assert not (tmp_path / "out").exists()
    assert cli("quantize", src, "-o", tmp_path / "out", "--dtype", "bfloat16").exit_code == 0


@pytest.mark.parametrize("pattern,says", [("re:[", "not a valid regular expression"), ("re:(a|aa)+$", None),
                                          ("re:(.*){1,32000}[bc]", "catastrophic backtracking"), ("re:" + "x" * 2000, "characters long")])
def test_ignore_patterns_are_compiled_and_matched_with_a_time_bound(base, tmp_path, pattern, says):
    with within(60, f"quantize --ignore {pattern[:20]}"):
        res = cli("quantize", base[0], "-o", tmp_path / "out", "--ignore", pattern)
    if says is None:  # a pattern that backtracks only on a long run of a's: matches nothing here, fine
        assert res.exit_code == 0, res.output
    else:
        one_line_error(res, says)
        assert not (tmp_path / "out").exists()


def test_counts_are_bounded_layers_files_tensors(base, tmp_path):
    from mpsconvert import safetensors_io

    src = tmp_path / "src"
    shutil.copytree(base[0], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = 10**7
    (src / "config.json").write_text(json.dumps(cfg))
    one_line_error(cli("quantize", src, "-o", tmp_path / "out"), "num_hidden_layers is 10000000")
    art = tmp_path / "art"
    shutil.copytree(base[1], art)
    m = json.loads((art / MANIFEST_NAME).read_text())
    m["files"].update({f"f{i}": {"sha256": "0" * 64, "size": 0} for i in range(10**6)})
    (art / MANIFEST_NAME).write_text(json.dumps(m))
    res = cli("verify", art)
    assert res.exit_code == 1 and "more than the 100000" in res.output, res.output
    many = tmp_path / "many.safetensors"
    header = json.dumps({f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(safetensors_io.MAX_TENSORS + 1)})
    header += " " * (-len(header) % 8)
    many.write_bytes(len(header).to_bytes(8, "little") + header.encode())
    with pytest.raises(ArtifactError, match="tensors, more than"):
        safetensors_io.read_header(many)


# --------------------------------------------------------------------------- 1. one trust boundary


def test_loaders_read_only_the_files_the_manifest_lists(art):
    """Unlisted files a transformers loader would read by their names (a named chat template, a
    special-tokens map, added tokens) change nothing: the loaders read a verified copy of the
    listed files, and each unlisted one is said ("ignored")."""
    import warnings

    from mpsconvert.manifests import loadable

    before = loadable.tokenizer(art)
    (art / "additional_chat_templates").mkdir()
    (art / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'EVIL' }}")
    (art / "added_tokens.json").write_text(json.dumps({"<evil>": 7}))
    (art / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<evil>"}))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tok = loadable.tokenizer(art)
    said = " ".join(str(w.message) for w in seen)
    for rel in ("additional_chat_templates/tool_use.jinja", "added_tokens.json", "special_tokens_map.json"):
        assert f"{rel} is not listed in {MANIFEST_NAME}: ignored" in said, said
    assert tok.chat_template == before.chat_template == TEMPLATE and tok.eos_token == before.eos_token
    assert "<evil>" not in tok.get_vocab() and tok("Hello <evil>")["input_ids"] == before("Hello <evil>")["input_ids"]
    # a loader sees that copy, never the artifact: without the boundary the unlisted files are read
    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(str(art))
    assert isinstance(raw.chat_template, dict) or "<evil>" in raw.get_vocab()
    # generate says it too (a UserWarning of mpsconvert's: printed by the CLI, recorded here by pytest), and runs as before
    with pytest.warns(UserWarning, match="added_tokens.json is not listed"):
        res = _gen(art)
    assert res.exit_code == 0, res.output


def test_an_unlisted_generation_config_is_ignored_and_said(art):
    from mpsconvert.manifests import loadable

    with transaction(art) as t:  # an artifact without a generation config (the source had none)
        (t.folder / "generation_config.json").unlink()
        del t.manifest.files["generation_config.json"]
    assert loadable.generation_config(art) is None
    (art / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(512))}))  # every token ends the text
    with pytest.warns(UserWarning, match="generation_config.json is not listed"):
        assert loadable.generation_config(art) is None


@pytest.mark.parametrize("attack", ["changed after verify", "a symlink to a copy", "not a regular file"])
def test_a_listed_file_is_read_once_and_must_match_its_hash(art, attack):
    """What a loader reads is the bytes that were hashed: a file changed between `verify` and the
    load, a listed file swapped for a link (even to identical bytes) or a fifo is refused."""
    from mpsconvert.manifests import loadable

    assert mpsconvert.verify(art).ok
    p = art / "tokenizer_config.json"
    if attack == "changed after verify":
        p.write_text(p.read_text() + " ")
        says = "does not match the sha256"
    elif attack == "a symlink to a copy":
        shutil.copyfile(p, art / "copy.json")  # the same bytes, inside the artifact: a link is still not the listed file
        p.unlink()
        p.symlink_to("copy.json")
        says = "a symlink"
    else:
        p.unlink()
        os.mkfifo(p)
        says = "not a regular file"
    with within(60, attack), pytest.raises(ArtifactError, match=says):
        loadable.tokenizer(art)
    with within(60, attack), pytest.raises(ArtifactError, match=says):
        loadable.generation_config(art)


def test_a_folder_without_a_manifest_is_read_as_it_is(base):
    """A source (another tool's checkpoint) has nothing to verify against: loaders read it directly."""
    from mpsconvert.manifests import loadable

    assert loadable.tokenizer(base[0]).chat_template == TEMPLATE


# --------------------------------------------------------------------------- 2. a pin that lasts


def test_the_pin_lasts_through_the_steps_after_the_conversion_and_says_what_it_covers(base, tmp_path, text_data):
    from mpsconvert.runtime.evaluate.validate import ValidateOptions

    res = mpsconvert.quantize(base[0], tmp_path / "art")
    art, pin = res.output, res.pin_sha256
    assert len(pin) == 64 and pin != res.manifest_sha256
    rep = mpsconvert.verify(art, manifest_sha256=pin)
    assert rep.ok and rep.pinned_sha256 == pin and rep.pin.startswith("the conversion")
    whole = mpsconvert.verify(art, manifest_sha256=res.manifest_sha256)
    assert whole.ok and whole.pin.startswith("the whole manifest")
    # validate, an export's package with its record, upload's hub record: the manifest and the card change, the pin holds
    mpsconvert.validate(art, options=ValidateOptions(device="cpu", max_samples=1, seq_len=32, prefill_len=16, decode_tokens=2,
                                                     repeats=1, rounds=1, warmup=0, eval_data=str(text_data / "wiki_eval.jsonl"),
                                                     kernel_cache=False))
    with transaction(art, drop=(COREML_PACKAGE,)) as t:
        (t.folder / COREML_PACKAGE).mkdir()
        (t.folder / COREML_PACKAGE / "weights.bin").write_bytes(b"x" * 64)
        t.add_files(COREML_PACKAGE)
        t.put(Hub(repo="me/art-fp8"))
    assert not mpsconvert.verify(art, manifest_sha256=res.manifest_sha256).ok  # the whole-file pin did not last
    rep = mpsconvert.verify(art, manifest_sha256=pin)
    assert rep.ok, rep.problems
    assert "validation" in rep.pin and "hub" in rep.pin and f"{COREML_PACKAGE}/weights.bin" in rep.pin and "not the card" in rep.pin
    out = cli("verify", art, "--manifest-sha256", pin)
    assert out.exit_code == 0 and "the pin covers the conversion" in out.output, out.output


def test_calibrate_into_an_artifact_prints_the_new_pin(art):
    """Calibration rewrites the weights, so a pin taken before breaks: the CLI prints the new one."""
    old = mpsconvert.verify(art).pinned_sha256
    out = cli("calibrate", art, "--num-samples", "2", "--seq-len", "32", "--device", "cpu",
              "--calib-data", str(models.TEXT_DATA / "wiki_calib.jsonl"))
    assert out.exit_code == 0, out.output
    new = re.search(r"pin sha256 ([0-9a-f]{64})", out.output).group(1)
    assert new != old and "no longer holds" in out.output
    assert cli("verify", art, "--manifest-sha256", new).exit_code == 0
    assert cli("verify", art, "--manifest-sha256", old).exit_code == 1


def test_the_manifest_is_read_once_so_a_swap_after_its_pin_check_is_not_used(art, monkeypatch):
    """An attacker who swaps the manifest right after its sha256 was taken (and rewrote the
    tokenizer to match the swapped one) gains nothing: the files are checked against the bytes
    that were hashed, and `load` with the pin refuses the tokenizer."""
    from mpsconvert.manifests import manifest as verify_mod  # where the manifest is read (read_once)

    pin = mpsconvert.verify(art).pinned_sha256
    genuine = (art / MANIFEST_NAME).read_bytes()
    (art / "tokenizer_config.json").write_text("{}")
    models.resign(art, "tokenizer_config.json")
    swapped = (art / MANIFEST_NAME).read_bytes()
    (art / MANIFEST_NAME).write_bytes(genuine)
    real = verify_mod.read_bytes

    def then_swap(path, **kw):
        raw = real(path, **kw)
        if Path(path).name == MANIFEST_NAME:
            Path(path).write_bytes(swapped)
        return raw

    monkeypatch.setattr(verify_mod, "read_bytes", then_swap)
    rep = mpsconvert.verify(art, manifest_sha256=pin)
    assert not rep.ok and any(p.startswith("tokenizer_config.json") for p in rep.problems), rep.problems
    (art / MANIFEST_NAME).write_bytes(genuine)
    with pytest.raises(ArtifactError, match="tokenizer_config.json"):
        mpsconvert.load(art, device="cpu", manifest_sha256=pin)


@pytest.mark.parametrize("when", ["after the manifest check", "after the verified copy"])
def test_load_builds_the_model_from_the_config_it_verified(art, monkeypatch, when):
    """config.json changed after the manifest was checked is refused as it is copied; changed
    after that copy, it is not what the model is built from: `load` reads the verified copy."""
    import contextlib

    from mpsconvert.runtime.load import loader

    want = json.loads((art / "config.json").read_text())["rms_norm_eps"]

    def edit():
        cfg = json.loads((art / "config.json").read_text())
        (art / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 0.5}))

    if when == "after the manifest check":
        real = loader._verify_before_use
        monkeypatch.setattr(loader, "_verify_before_use", lambda *a, **k: (real(*a, **k), edit())[0])
        with pytest.raises(ArtifactError, match="config.json does not match"):
            mpsconvert.load(art, device="cpu")
        return
    real_verified = loader.loadable.verified

    @contextlib.contextmanager
    def then_edit(*a, **k):
        with real_verified(*a, **k) as copy:
            edit()
            yield copy

    monkeypatch.setattr(loader.loadable, "verified", then_edit)
    model = mpsconvert.load(art, device="cpu")
    assert model.config.rms_norm_eps == want != 0.5


def _tamper_manifest(art, edit):
    m = json.loads((art / MANIFEST_NAME).read_text())
    edit(m)
    (art / MANIFEST_NAME).write_text(json.dumps(m, indent=2))


@pytest.mark.parametrize("attack", ["a weight and its hash", "the tokenizer and its hash", "a tensor record", "the recipe",
                                    "a file dropped from the sealed list", "the sealed list removed", "a conversion version"])
def test_the_pin_breaks_when_what_it_covers_changes(art, attack):
    pin = mpsconvert.verify(art).pinned_sha256
    if attack == "a weight and its hash":
        p = art / "model.safetensors"
        b = bytearray(p.read_bytes())
        b[-1] ^= 1
        p.write_bytes(bytes(b))
        models.resign(art, "model.safetensors")
    elif attack == "the tokenizer and its hash":
        (art / "tokenizer_config.json").write_text((art / "tokenizer_config.json").read_text() + " ")
        models.resign(art, "tokenizer_config.json")
    elif attack == "a tensor record":
        _tamper_manifest(art, lambda m: next(iter(m["tensors"].values())).update(scale_max=1.0))
    elif attack == "the recipe":
        _tamper_manifest(art, lambda m: m["recipe"].update(ignore_patterns=["*"]))
    elif attack == "a file dropped from the sealed list":
        _tamper_manifest(art, lambda m: m["pinned"]["files"].remove("tokenizer_config.json"))
    elif attack == "the sealed list removed":
        _tamper_manifest(art, lambda m: m.pop("pinned"))
    else:
        _tamper_manifest(art, lambda m: m["versions"].update(torch="0.0"))
    rep = mpsconvert.verify(art, manifest_sha256=pin)
    assert not rep.ok and any("not the pinned" in p for p in rep.problems), rep.problems
    assert cli("verify", art, "--manifest-sha256", pin, "--no-hashes").exit_code != 0
    with pytest.raises(MpsconvertError):
        mpsconvert.load(art, device="cpu", manifest_sha256=pin)


# --------------------------------------------------------------------------- 4. card + manifest in one swap, per command


# each command that changes an artifact, as a user runs it; what its change leaves in the card
COMMANDS = {
    "validate": (["validate", "{art}", "--device", "cpu", "--max-samples", "1", "--seq-len", "32", "--prefill-len", "16",
                  "--decode-tokens", "2", "--repeats", "1", "--rounds", "1", "--warmup", "0", "--eval-data", "{text}"], "| CPU"),
    "calibrate": (["calibrate", "{art}", "--num-samples", "2", "--seq-len", "16"], "| calibration | 2 x 16 tokens"),
    "export-coreml": (["export-coreml", "{art}", "--no-kv-cache", "--seq-len", "8", "--no-check"], "Core ML: `model.mlpackage`"),
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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(mpsconvert.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    return [sys.executable, "-m", "mpsconvert.cli", *args], env


# upload commits to the hub before its local swap, so a kill between them leaves a commit and the old
# artifact: tests/test_security_upload.py kills it at its own points
@pytest.mark.slow  # a real process killed at every step: CI runs it in the slow lane
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.extra(n.split("-")[1])] if n.startswith("export") else [])
                                  for n in COMMANDS])
def test_each_command_killed_where_card_and_manifest_could_part_leaves_them_together(art, text_data, request, name):
    """The real command, SIGKILLed at each step of its transaction where the card and the
    manifest could part: the artifact verifies (the card has the sha256 the manifest records) and
    is the one before the command, whole; the rerun completes, the card says what it recorded,
    and nothing is left behind."""
    import subprocess

    cmd, env = _command(name, art, text_data)
    before = models.tree_hashes(art)
    for point in REBUILD_POINTS if name == "calibrate" else SPLIT_POINTS:
        r = subprocess.run(cmd, env={**env, atomic.KILL_ENV: point}, capture_output=True, timeout=600)
        assert r.returncode == -9, (point, r.stderr.decode()[-1500:])  # the kill point was reached
        report = mpsconvert.verify(art)  # a reader recovers a swap cut in two
        assert report.ok, (point, report.problems)
        assert models.tree_hashes(art) == before, point
    r = subprocess.run(cmd, env=env, capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode()[-1500:]
    assert mpsconvert.verify(art).ok and COMMANDS[name][1] in (art / "README.md").read_text()
    assert not [p for p in list(art.iterdir()) + list(art.parent.iterdir()) if p.name.startswith(atomic.TMP_PREFIX)]


# --------------------------------------------------------------------------- 3. bounded parsing


def _gen(art, *extra):
    return cli("generate", art, "Hello there", "--device", "cpu", "--max-tokens", "3", *extra)


def _escape_marker() -> Path:
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"mpsconvert-escape-{os.getpid()}"


HOSTILE_TEMPLATES = {
    "sandbox escape through __class__": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "sandbox escape through cycler's globals": "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "sandbox escape through lipsum's globals": "{{ lipsum.__globals__['os'].system('touch MARKER') }}",
    "sandbox escape through the template context": "{{ self._TemplateReference__context.joiner.__init__.__globals__.os.system('touch MARKER') }}",
    "raise_exception": "{{ raise_exception('this template refuses') }}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "200 MB of output": "{{ 'x' * 200000000 }}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops with output": "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
    "not Jinja": "{% for %}",
    "undefined": "{{ messages.nope.nope }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_a_hostile_chat_template_is_one_line_naming_its_file(art, monkeypatch, name):
    from mpsconvert import templates

    monkeypatch.setattr(templates, "RENDER_SECONDS", 4.0)
    marker = _escape_marker()
    (art / "chat_template.jinja").write_text(HOSTILE_TEMPLATES[name].replace("MARKER", str(marker)))
    models.resign(art, "chat_template.jinja")  # an attacker who rewrote the manifest too: the bounds are what is left
    with within(120, f"generate with the template {name!r}"):
        res = _gen(art)
    one_line_error(res, "chat_template.jinja")
    assert not marker.exists()
    with within(120, "the next render, after a killed worker"):  # the renderer recovers: a sound template renders again
        (art / "chat_template.jinja").write_text(TEMPLATE)
        models.resign(art, "chat_template.jinja")
        assert _gen(art).exit_code == 0


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name,body,says", [
    ("tokenizer.json", DEEP, "nests deeper"),
    ("tokenizer_config.json", DEEP, "nests deeper"),
    ("special_tokens_map.json", DEEP, "nests deeper"),
    ("added_tokens.json", DEEP, "nests deeper"),
    ("generation_config.json", DEEP, "nests deeper"),
    ("chat_template.json", DEEP, "nests deeper"),
    ("tokenizer_config.json", json.dumps({"added_tokens_decoder": [1, 2]}), "added_tokens_decoder"),
    ("tokenizer_config.json", json.dumps({"eos_token": ["<eos>", 3]}), "eos_token is list"),
    ("tokenizer_config.json", json.dumps({"chat_template": 5}), "chat_template is neither"),
    ("generation_config.json", json.dumps({"eos_token_id": "x"}), "eos_token_id"),
    ("generation_config.json", json.dumps({"eos_token_id": [1, [2]]}), "eos_token_id"),
    ("added_tokens.json", json.dumps({"<evil>": 600}), "past the model's vocabulary of 512"),
    ("tokenizer.json", "\xff not json", "not valid JSON"),
])
def test_tokenizer_and_generation_files_are_read_with_bounds(art, name, body, says):
    (art / name).write_text(body)
    models.resign(art, name)
    with within(120, f"generate with a hostile {name}"):
        res = _gen(art)
    one_line_error(res, name if "vocabulary" not in says else "", says)


def test_a_deep_front_matter_in_the_source_card_is_ignored_not_a_traceback(base, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(base[0], src)
    (src / "README.md").write_text("---\nlicense: mit\ndeep: " + DEEP + "\n---\n# the source's card\n")
    with within(120, "quantize with a deep card"):
        res = cli("quantize", src, "-o", tmp_path / "out")
    assert res.exit_code == 0, res.output
    from mpsconvert.manifests.card import split_front_matter

    meta, _ = split_front_matter((tmp_path / "out" / "README.md").read_text())
    assert "mpsconvert" in meta and "license" not in meta  # ours; nothing carried from front matter that was refused
    assert mpsconvert.verify(tmp_path / "out").ok


# --------------------------------------------------------------------------- 6. cards and terminal output are text


HOSTILE_NAME = "evil\n# Heading\n<img src=x onerror=alert(1)> $(touch PWNED) `tick` | pipe [link](javascript:x) \x1b[31mred"


def _markdown_tokens(text: str):
    from markdown_it import MarkdownIt

    tokens, todo = [], MarkdownIt("commonmark").enable("table").parse(text)
    while todo:
        t = todo.pop(0)
        tokens.append(t)
        todo[:0] = t.children or []
    return tokens


def test_a_hostile_source_folder_name_is_text_in_the_card_and_its_commands(base, tmp_path, monkeypatch):
    import shlex

    import yaml

    from mpsconvert.untrusted import printable

    src = tmp_path / HOSTILE_NAME
    shutil.copytree(base[0], src)
    monkeypatch.chdir(tmp_path)
    res = mpsconvert.quantize(src)  # the default output is named for the source: the hostile name again
    art = res.output
    text = (art / "README.md").read_text()
    meta = yaml.safe_load(text.split("---\n")[1])
    assert meta["mpsconvert"]["source"] == HOSTILE_NAME and "base_model" not in meta  # YAML carries it exactly, quoted
    body = text.split("---\n", 2)[2]
    tokens = _markdown_tokens(body)
    assert not [t for t in tokens if t.type in ("html_inline", "html_block")], "HTML from a name reached the card"
    assert not [t for t in tokens if t.type == "link_open"], "a link from a name reached the card"
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert not any("Heading" in h for h in headings if not h.startswith(("FP8", "evil"))), headings
    assert "\x1b" not in text and "PWNED" in text  # shown, escaped, never run
    runs = [shlex.split(line) for t in tokens if t.type == "fence" for line in t.content.splitlines()
            if line.startswith("mpsconvert ")]
    assert runs and all(argv[2] == printable(art.name) for argv in runs), runs  # one argument, quoted
    assert mpsconvert.verify(art).ok


def test_commit_messages_are_one_line_without_control_characters(art):
    from mpsconvert.publish import commit_message

    m = Manifest.read(art)
    m.source["id"] = "org/x\n\nSigned-off-by: someone else\x1b[2J\x00"
    msg = commit_message(m)
    assert "\n" not in msg and "\x1b" not in msg and "\x00" not in msg and "Signed-off-by: someone else" in msg


def test_markup_and_escape_sequences_in_names_are_printed_literally(art, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    evil = "[bold red]boom[/] \x1b]0;pwned\x07 \x1b[2J [link=file:///etc/passwd]x[/link]"
    (art / f"notes {evil[:30].replace('/', '_')}.txt").write_text("unlisted")
    m = json.loads((art / MANIFEST_NAME).read_text())
    name, rec = next(iter(m["tensors"].items()))
    m["tensors"][evil] = m["tensors"].pop(name)
    m["summary"]["worst_sqnr_tensor"] = evil
    m["summary"]["ratio"] = "not a number"
    m["recipe"]["calibration"] = {"data": {"id": evil}, "observer": [1, 2]}
    # a record of the right types whose untyped figures are not numbers: shown as '?'
    m["validation"] = {evil: {"kind": "causal-lm", "device": evil, "accuracy": {"mean_kl": "x", "perplexity_bf16": [1]},
                              "verdict": {"decode": 5}}}
    (art / MANIFEST_NAME).write_text(json.dumps(m))
    for cmd in (("verify", art), ("inspect", art, "--tensors")):
        res = cli(*cmd)
        assert "Traceback" not in res.output and res.exception is None or isinstance(res.exception, SystemExit), res.output
        assert "\x1b" not in res.output and "\x07" not in res.output, repr(res.output[:400])
    res = cli("inspect", art, "--tensors")
    assert res.exit_code == 0 and "[bold red]boom[/]" in res.output and "\\x1b]0;pwned\\x07" in res.output, res.output
    # a malformed record (manifests/records.py) is one error line, exit 2, its key shown literally too
    m["validation"][evil]["speedup"] = {"decode": "fast"}
    (art / MANIFEST_NAME).write_text(json.dumps(m))
    res = cli("inspect", art)
    one_line_error(res, "[bold red]boom[/]", "\\x1b]0;pwned\\x07", "speedup")
    assert "\x1b" not in res.output and "\x07" not in res.output
