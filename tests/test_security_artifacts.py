"""Reading an artifact: verify says ok only about what it checked. JSON keys once, no NaN; the
manifest's shape required; config.json's structural numbers against the shards; configs that compute
garbage refused; special files never read. One trust boundary: loaders read only the files the
manifest lists, each the bytes that were hashed, and build the model from the config that was
verified; a pin lasts through the steps after the conversion and breaks when anything it covers
changes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mpsconvert
from mpsconvert.errors import ArtifactError, MpsconvertError
from mpsconvert.infra.untrusted import parse_json, read_json
from mpsconvert.manifests.layout import MANIFEST_NAME
from mpsconvert.manifests.records import Hub
from mpsconvert.manifests.transaction import transaction

from . import models
from .bounded import within
from .helpers import CHAT_TEMPLATE, COREML_PACKAGE, cli, one_line_error, run_generate


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


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda m: m.update(files={}), "lists no files"),
        (lambda m: m.update(tensors=None), "'tensors' is NoneType"),
        (lambda m: m.pop("tensors"), "has no 'tensors'"),
        (lambda m: m.update(files=None), "'files' is NoneType"),
        (lambda m: m.update(pinned=None), "the `pinned` record is NoneType, not an object"),
        (lambda m: m.update(tool="mpsconvert\u200b"), 'not "mpsconvert"'),
        (lambda m: m.pop("tool"), 'not "mpsconvert"'),
        (lambda m: m["tensors"].update({"x": {"dtype": "F8_E4M3", "shape": ["a"]}}), "shape of non-negative integers"),
    ],
    ids=[
        "files-empty",
        "tensors-null",
        "tensors-absent",
        "files-null",
        "pinned-null",
        "tool-lookalike",
        "tool-absent",
        "shape-text",
    ],
)
def test_a_manifest_of_the_wrong_shape_does_not_verify(art, edit, says):
    _edit_manifest(art, edit)
    _failed(art, says)
    one_line_error(cli("inspect", art), says)  # inspect's reader too: one line, no traceback


def test_a_key_twice_in_any_json_is_refused(art):
    """verify read the first "files", transformers' readers the last: two readers, two artifacts."""
    _edit_manifest(art, text=lambda t: t.replace('"files": {', '"files": {}, "files": {', 1))
    _failed(art, "has the key 'files' twice")
    with pytest.raises(
        ArtifactError, match="has the key 'b' twice"
    ):  # at any depth: every JSON reader goes through parse_json
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


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("num_hidden_layers", 3, "config.json's model has model.layers.2."),
        ("num_hidden_layers", 1, "layer(s) the model built from config.json does not have (model.layers.1"),
        (
            "vocab_size",
            512,
            "model.embed_tokens.weight is [256, 64] but the model built from config.json has [512, 64]",
        ),
        ("intermediate_size", 256, "but the model built from config.json has 256x64"),
    ],
)
def test_config_structural_numbers_are_checked_against_the_shards(art, key, value, says):
    """num_hidden_layers raised in config.json (re-hashed, so only this check stands in the way)
    verified, and `generate` then failed. The manifest vouches for the re-hashed config.json, so
    verify checks its numbers against the shards without building the model (no torch)."""
    cfg = json.loads((art / "config.json").read_text())
    cfg[key] = value
    (art / "config.json").write_text(json.dumps(cfg))
    models.resign(art, "config.json")
    _failed(art, says)


@pytest.mark.parametrize(
    "edit, says",
    [
        ({"rms_norm_eps": 1e400}, "rms_norm_eps is inf"),
        ({"max_position_embeddings": 0}, "max_position_embeddings is 0"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -5}}, "factor is -5"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, "holds NaN"),
    ],
)
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
    r = subprocess.run(
        [sys.executable, "-m", "mpsconvert.cli", "verify", str(art)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "config.json" in r.stdout + r.stderr
    with pytest.raises(ArtifactError, match="is a FIFO, not a regular file"):
        read_json(art / "config.json")
    one_line_error(cli("generate", art, "hi", "--device", "cpu"), "config.json")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_or_fifo_is_never_read_as_a_file(tmp_path):
    """Every reader of ours opens without blocking and reads only a regular file: JSON, a
    safetensors header, a hash (a device never ends; a FIFO's open waits for a writer)."""
    from mpsconvert.infra.safetensors_io import read_header
    from mpsconvert.manifests.hashing import sha256_file

    (tmp_path / "config.json").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(ArtifactError, match="is a device, not a regular file"):
        read_json(tmp_path / "config.json")
    with pytest.raises(ArtifactError, match="is a FIFO, not a regular file"):
        read_header(tmp_path / "model.safetensors")
    with pytest.raises(ArtifactError, match="is a device"):
        sha256_file(tmp_path / "config.json")


# -------------------------------------------------------- one trust boundary: loaders read only what the manifest lists


def test_loaders_read_only_the_files_the_manifest_lists(chat_art):
    """Unlisted files a transformers loader would read by their names (a named chat template, a
    special-tokens map, added tokens) change nothing: the loaders read a verified copy of the
    listed files, and each unlisted one is said ("ignored")."""
    import warnings

    from mpsconvert.manifests import loadable

    before = loadable.tokenizer(chat_art)
    (chat_art / "additional_chat_templates").mkdir()
    (chat_art / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'EVIL' }}")
    (chat_art / "added_tokens.json").write_text(json.dumps({"<evil>": 7}))
    (chat_art / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<evil>"}))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tok = loadable.tokenizer(chat_art)
    said = " ".join(str(w.message) for w in seen)
    for rel in ("additional_chat_templates/tool_use.jinja", "added_tokens.json", "special_tokens_map.json"):
        assert f"{rel} is not listed in {MANIFEST_NAME}: ignored" in said, said
    assert tok.chat_template == before.chat_template == CHAT_TEMPLATE and tok.eos_token == before.eos_token
    assert "<evil>" not in tok.get_vocab() and tok("Hello <evil>")["input_ids"] == before("Hello <evil>")["input_ids"]
    # a loader sees that copy, never the artifact: without the boundary the unlisted files are read
    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(str(chat_art))
    assert isinstance(raw.chat_template, dict) or "<evil>" in raw.get_vocab()
    # generate says it too (a UserWarning of mpsconvert's: printed by the CLI, recorded here by pytest), and runs as
    # before
    with pytest.warns(UserWarning, match="added_tokens.json is not listed"):
        res = run_generate(chat_art)
    assert res.exit_code == 0, res.output


def test_an_unlisted_generation_config_is_ignored_and_said(chat_art):
    from mpsconvert.manifests import loadable

    with transaction(chat_art) as t:  # an artifact without a generation config (the source had none)
        (t.folder / "generation_config.json").unlink()
        del t.manifest.files["generation_config.json"]
    assert loadable.generation_config(chat_art) is None
    (chat_art / "generation_config.json").write_text(
        json.dumps({"eos_token_id": list(range(512))})
    )  # every token ends the text
    with pytest.warns(UserWarning, match="generation_config.json is not listed"):
        assert loadable.generation_config(chat_art) is None


@pytest.mark.parametrize("attack", ["changed after verify", "a symlink to a copy", "not a regular file"])
def test_a_listed_file_is_read_once_and_must_match_its_hash(chat_art, attack):
    """What a loader reads is the bytes that were hashed: a file changed between `verify` and the
    load, a listed file swapped for a link (even to identical bytes) or a fifo is refused."""
    from mpsconvert.manifests import loadable

    assert mpsconvert.verify(chat_art).ok
    p = chat_art / "tokenizer_config.json"
    if attack == "changed after verify":
        p.write_text(p.read_text() + " ")
        says = "does not match the sha256"
    elif attack == "a symlink to a copy":
        shutil.copyfile(
            p, chat_art / "copy.json"
        )  # the same bytes, inside the artifact: a link is still not the listed file
        p.unlink()
        p.symlink_to("copy.json")
        says = "a symlink"
    else:
        p.unlink()
        os.mkfifo(p)
        says = "not a regular file"
    with within(60, attack), pytest.raises(ArtifactError, match=says):
        loadable.tokenizer(chat_art)
    with within(60, attack), pytest.raises(ArtifactError, match=says):
        loadable.generation_config(chat_art)


def test_a_folder_without_a_manifest_is_read_as_it_is(chat_llama):
    """A source (another tool's checkpoint) has nothing to verify against: loaders read it directly."""
    from mpsconvert.manifests import loadable

    assert loadable.tokenizer(chat_llama[0]).chat_template == CHAT_TEMPLATE


# --------------------------------------------------------------------------- a pin that lasts


def test_the_pin_lasts_through_the_steps_after_the_conversion_and_says_what_it_covers(chat_llama, tmp_path, text_data):
    from mpsconvert.runtime.evaluate.validate import ValidateOptions

    res = mpsconvert.quantize(chat_llama[0], tmp_path / "art")
    art, pin = res.output, res.pin_sha256
    assert len(pin) == 64 and pin != res.manifest_sha256
    rep = mpsconvert.verify(art, manifest_sha256=pin)
    assert rep.ok and rep.pinned_sha256 == pin and rep.pin.startswith("the conversion")
    whole = mpsconvert.verify(art, manifest_sha256=res.manifest_sha256)
    assert whole.ok and whole.pin.startswith("the whole manifest")
    # validate, an export's package with its record, upload's hub record: the manifest and the card change, the pin
    # holds
    mpsconvert.validate(
        art,
        options=ValidateOptions(
            device="cpu",
            max_samples=1,
            seq_len=32,
            prefill_len=16,
            decode_tokens=2,
            repeats=1,
            rounds=1,
            warmup=0,
            eval_data=str(text_data / "wiki_eval.jsonl"),
            kernel_cache=False,
        ),
    )
    with transaction(art, drop=(COREML_PACKAGE,)) as t:
        (t.folder / COREML_PACKAGE).mkdir()
        (t.folder / COREML_PACKAGE / "weights.bin").write_bytes(b"x" * 64)
        t.add_files(COREML_PACKAGE)
        t.put(Hub(repo="me/art-fp8"))
    assert not mpsconvert.verify(art, manifest_sha256=res.manifest_sha256).ok  # the whole-file pin did not last
    rep = mpsconvert.verify(art, manifest_sha256=pin)
    assert rep.ok, rep.problems
    assert (
        "validation" in rep.pin
        and "hub" in rep.pin
        and f"{COREML_PACKAGE}/weights.bin" in rep.pin
        and "not the card" in rep.pin
    )
    out = cli("verify", art, "--manifest-sha256", pin)
    assert out.exit_code == 0 and "the pin covers the conversion" in out.output, out.output


def test_calibrate_into_an_artifact_prints_the_new_pin(chat_art):
    """Calibration rewrites the weights, so a pin taken before breaks: the CLI prints the new one."""
    old = mpsconvert.verify(chat_art).pinned_sha256
    out = cli(
        "calibrate",
        chat_art,
        "--num-samples",
        "2",
        "--seq-len",
        "32",
        "--device",
        "cpu",
        "--calib-data",
        str(models.TEXT_DATA / "wiki_calib.jsonl"),
    )
    assert out.exit_code == 0, out.output
    new = re.search(r"pin sha256 ([0-9a-f]{64})", out.output).group(1)
    assert new != old and "no longer holds" in out.output
    assert cli("verify", chat_art, "--manifest-sha256", new).exit_code == 0
    assert cli("verify", chat_art, "--manifest-sha256", old).exit_code == 1


def test_the_manifest_is_read_once_so_a_swap_after_its_pin_check_is_not_used(chat_art, monkeypatch):
    """An attacker who swaps the manifest right after its sha256 was taken (and rewrote the
    tokenizer to match the swapped one) gains nothing: the files are checked against the bytes
    that were hashed, and `load` with the pin refuses the tokenizer."""
    from mpsconvert.manifests import manifest as verify_mod  # where the manifest is read (read_once)

    pin = mpsconvert.verify(chat_art).pinned_sha256
    genuine = (chat_art / MANIFEST_NAME).read_bytes()
    (chat_art / "tokenizer_config.json").write_text("{}")
    models.resign(chat_art, "tokenizer_config.json")
    swapped = (chat_art / MANIFEST_NAME).read_bytes()
    (chat_art / MANIFEST_NAME).write_bytes(genuine)
    real = verify_mod.read_bytes

    def then_swap(path, **kw):
        raw = real(path, **kw)
        if Path(path).name == MANIFEST_NAME:
            Path(path).write_bytes(swapped)
        return raw

    monkeypatch.setattr(verify_mod, "read_bytes", then_swap)
    rep = mpsconvert.verify(chat_art, manifest_sha256=pin)
    assert not rep.ok and any(p.startswith("tokenizer_config.json") for p in rep.problems), rep.problems
    (chat_art / MANIFEST_NAME).write_bytes(genuine)
    with pytest.raises(ArtifactError, match="tokenizer_config.json"):
        mpsconvert.load(chat_art, device="cpu", manifest_sha256=pin)


@pytest.mark.parametrize("when", ["after the manifest check", "after the verified copy"])
def test_load_builds_the_model_from_the_config_it_verified(chat_art, monkeypatch, when):
    """config.json changed after the manifest was checked is refused as it is copied; changed
    after that copy, it is not what the model is built from: `load` reads the verified copy."""
    import contextlib

    from mpsconvert.runtime.load import loader

    want = json.loads((chat_art / "config.json").read_text())["rms_norm_eps"]

    def edit():
        cfg = json.loads((chat_art / "config.json").read_text())
        (chat_art / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 0.5}))

    if when == "after the manifest check":
        real = loader._verify_before_use
        monkeypatch.setattr(loader, "_verify_before_use", lambda *a, **k: (real(*a, **k), edit())[0])
        with pytest.raises(ArtifactError, match="config.json does not match"):
            mpsconvert.load(chat_art, device="cpu")
        return
    real_verified = loader.loadable.verified

    @contextlib.contextmanager
    def then_edit(*a, **k):
        with real_verified(*a, **k) as copy:
            edit()
            yield copy

    monkeypatch.setattr(loader.loadable, "verified", then_edit)
    model = mpsconvert.load(chat_art, device="cpu")
    assert model.config.rms_norm_eps == want != 0.5


def _tamper_manifest(art, edit):
    m = json.loads((art / MANIFEST_NAME).read_text())
    edit(m)
    (art / MANIFEST_NAME).write_text(json.dumps(m, indent=2))


@pytest.mark.parametrize(
    "attack",
    [
        "a weight and its hash",
        "the tokenizer and its hash",
        "a tensor record",
        "the recipe",
        "a file dropped from the sealed list",
        "the sealed list removed",
        "a conversion version",
    ],
)
def test_the_pin_breaks_when_what_it_covers_changes(chat_art, attack):
    pin = mpsconvert.verify(chat_art).pinned_sha256
    if attack == "a weight and its hash":
        p = chat_art / "model.safetensors"
        b = bytearray(p.read_bytes())
        b[-1] ^= 1
        p.write_bytes(bytes(b))
        models.resign(chat_art, "model.safetensors")
    elif attack == "the tokenizer and its hash":
        (chat_art / "tokenizer_config.json").write_text((chat_art / "tokenizer_config.json").read_text() + " ")
        models.resign(chat_art, "tokenizer_config.json")
    elif attack == "a tensor record":
        _tamper_manifest(chat_art, lambda m: next(iter(m["tensors"].values())).update(scale_max=1.0))
    elif attack == "the recipe":
        _tamper_manifest(chat_art, lambda m: m["recipe"].update(ignore_patterns=["*"]))
    elif attack == "a file dropped from the sealed list":
        _tamper_manifest(chat_art, lambda m: m["pinned"]["files"].remove("tokenizer_config.json"))
    elif attack == "the sealed list removed":
        _tamper_manifest(chat_art, lambda m: m.pop("pinned"))
    else:
        _tamper_manifest(chat_art, lambda m: m["versions"].update(torch="0.0"))
    rep = mpsconvert.verify(chat_art, manifest_sha256=pin)
    assert not rep.ok and any("not the pinned" in p for p in rep.problems), rep.problems
    assert cli("verify", chat_art, "--manifest-sha256", pin, "--no-hashes").exit_code != 0
    with pytest.raises(MpsconvertError):
        mpsconvert.load(chat_art, device="cpu", manifest_sha256=pin)
