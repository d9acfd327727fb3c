"""Numbers read from a file or the command line: one table bounds them all (`untrusted.LIMITS`,
checked by `untrusted.bounded`), before any work scales with them; the error names the limit. 0, -5,
10^9, NaN and 2^70 are one line and exit 2, never a traceback or a run that does not end. What is
parsed from an artifact or a source is parsed with bounds: layers, files and tensors counted; a chat
template sandboxed and timed; tokenizer and generation files bounded in depth and checked for type;
a card's front matter."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

import mpsconvert
from mpsconvert.errors import ArtifactError, MpsconvertError, SourceError
from mpsconvert.infra import untrusted
from mpsconvert.manifests.layout import MANIFEST_NAME

from . import models
from .bounded import within
from .helpers import CHAT_TEMPLATE, cli, one_error, one_line_error, run_generate


def test_bounded_names_the_limit_and_refuses_what_is_not_a_number():
    assert untrusted.bounded(5, "seq_len") == 5
    for bad, says in [
        (0, "`seq_len` is 0, outside 2..131,072"),
        (10**9, "outside 2..131,072"),
        (True, "not an integer"),
        (1e3, "not an integer"),
        ("8", "not an integer"),
    ]:
        with pytest.raises(MpsconvertError, match=None) as e:
            untrusted.bounded(bad, "seq_len")
        assert says in str(e.value), str(e.value)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(MpsconvertError, match="outside 0..10,000"):
            untrusted.bounded(bad, "temp", integer=False)
    with pytest.raises(SourceError, match=r"config.json: n is 2000, outside 0..1,024 \(the limit on layers\)"):
        untrusted.bounded(2000, "layers", what="config.json: n", error=SourceError)


@pytest.mark.parametrize(
    "args, says",
    [
        (["--seq-len", "0"], "--seq-len is 0"),
        (["--seq-len", "-5"], "--seq-len is -5"),
        (["--rounds", "-1"], "--rounds is -1"),
        (["--warmup", "-1"], "--warmup is -1"),
        (["--repeats", "1000000000"], "--repeats is 1000000000, outside 1..10,000"),
        (["--prefill-len", "1000000000"], "--prefill-len is 1000000000"),
        (["--decode-tokens", "1000000000"], "--decode-tokens is 1000000000"),
        (["--max-samples", "0"], "--max-samples is 0"),
    ],
)
def test_validate_numbers_are_bounded_before_anything_loads(tmp_path, args, says):
    t = time.monotonic()
    one_line_error(cli("validate", tmp_path, *args), says)
    assert time.monotonic() - t < 30


@pytest.mark.parametrize(
    "args, says",
    [
        (["--temp", "nan"], "--temp is nan"),
        (["--temp", "inf"], "--temp is inf"),
        (["--seed", str(2**70)], "--seed is 1180591620717411303424, outside 0..18,446,744,073,709,551,615"),
        (["--seed", "-1"], "--seed is -1"),
        (["--max-tokens", str(10**9)], "--max-tokens is 1000000000"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_sampling_numbers_are_bounded(tmp_path, command, args, says):
    one_line_error(cli(command, tmp_path, *(["hi"] if command == "generate" else []), *args, "--device", "cpu"), says)


@pytest.mark.extra("coreml")
def test_export_decode_steps_are_bounded(llama_art, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(llama_art, art)
    before = models.tree_hashes(art)
    one_line_error(cli("export-coreml", art, "--decode-steps", "1000000000"), "--decode-steps is 1000000000")
    assert models.tree_hashes(art) == before


def test_a_manifest_with_200000_bogus_tensor_records_is_a_few_lines(llama_art, tmp_path):
    """verify said each of them (200,000 lines); a manifest past the limit is one line."""
    art = tmp_path / "art"
    shutil.copytree(llama_art, art)
    m = json.loads((art / MANIFEST_NAME).read_text())
    m["tensors"].update({f"bogus.{i}.weight": {"dtype": "F8_E4M3", "shape": [16, 16]} for i in range(200_000)})
    (art / MANIFEST_NAME).write_text(json.dumps(m))
    res = cli("verify", art)
    assert res.exit_code == 1 and "and 199980 more tensor records" in res.output, res.output[-2000:]
    assert len(res.output.splitlines()) < 80
    m["tensors"].update({f"more.{i}": {} for i in range(untrusted.LIMITS["manifest tensor records"][1])})
    (art / MANIFEST_NAME).write_text(json.dumps(m))
    res = cli("verify", art)
    assert res.exit_code == 1 and "the limit on manifest tensor records" in res.output, res.output[-2000:]


@pytest.mark.parametrize(
    "edit, says",
    [
        ({"num_layers": 1000000}, "num_layers is 1000000, outside 0..1,024"),
        ({"attention_head_dim": 1e9}, "attention_head_dim is 1000000000.0, not an integer"),
        ({"num_attention_heads": 10**8}, "num_attention_heads is 100000000"),
        ({"joint_attention_dim": -4}, "joint_attention_dim is -4"),
    ],
)
def test_a_diffusion_component_config_is_bounded_before_a_model_is_built(tmp_path, edit, says):
    """A component config (num_layers: 1000000) built a meta model of that size or died in the
    allocator; its numbers go through the same table as a language model's."""
    from mpsconvert.source import snapshot as source

    comp = tmp_path / "transformer"
    comp.mkdir()
    cfg = {
        "_class_name": "FluxTransformer2DModel",
        "_diffusers_version": "0.36.0",
        "num_layers": 2,
        "num_single_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 64,
        "in_channels": 16,
    }
    cfg.update(edit)
    (comp / "config.json").write_text(json.dumps(cfg))
    (comp / "diffusion_pytorch_model.safetensors").write_bytes(b"\x02\0\0\0\0\0\0\0{}")
    with pytest.raises(SourceError, match=None) as e:
        source.resolve(str(comp))
    assert says in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "key, value",
    [
        ("num_hidden_layers", 10**7),
        ("hidden_size", 1 << 20),
        ("vocab_size", 1 << 30),
        ("intermediate_size", 1 << 30),
        ("num_attention_heads", 10**6),
        ("head_dim", 10**6),
    ],
)
def test_a_source_config_sizes_are_bounded_before_a_model_is_built(llama_art, work, tmp_path, key, value):
    s = tmp_path / "s"
    shutil.copytree(work / "src-llama", s)
    cfg = json.loads((s / "config.json").read_text())
    cfg[key] = value
    (s / "config.json").write_text(json.dumps(cfg))
    t = time.monotonic()
    one_line_error(cli("quantize", s, "-o", tmp_path / "out"), f"{key} is {value}, outside")
    assert time.monotonic() - t < 30 and not (tmp_path / "out").exists()


# -------------------------------------------------------------------- counts in a source, a manifest and a shard header


def test_counts_are_bounded_layers_files_tensors(chat_llama, tmp_path):
    from mpsconvert.infra import safetensors_io

    src = tmp_path / "src"
    shutil.copytree(chat_llama[0], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = 10**7
    (src / "config.json").write_text(json.dumps(cfg))
    one_error(cli("quantize", src, "-o", tmp_path / "out"), "num_hidden_layers is 10000000")
    art = tmp_path / "art"
    shutil.copytree(chat_llama[1], art)
    m = json.loads((art / MANIFEST_NAME).read_text())
    m["files"].update({f"f{i}": {"sha256": "0" * 64, "size": 0} for i in range(10**6)})
    (art / MANIFEST_NAME).write_text(json.dumps(m))
    res = cli("verify", art)
    assert res.exit_code == 1 and "more than the 100000" in res.output, res.output
    many = tmp_path / "many.safetensors"
    header = json.dumps(
        {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(safetensors_io.MAX_TENSORS + 1)}
    )
    header += " " * (-len(header) % 8)
    many.write_bytes(len(header).to_bytes(8, "little") + header.encode())
    with pytest.raises(ArtifactError, match="tensors, more than"):
        safetensors_io.read_header(many)


# ------------------------------------ bounded parsing: templates, tokenizer and generation files, a card's front matter


def _escape_marker() -> Path:
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"mpsconvert-escape-{os.getpid()}"


HOSTILE_TEMPLATES = {
    "sandbox escape through __class__": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "sandbox escape through cycler's globals": "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "sandbox escape through lipsum's globals": "{{ lipsum.__globals__['os'].system('touch MARKER') }}",
    "sandbox escape through the template context": "{{ "
    "self._TemplateReference__context.joiner.__init__.__globals__.os.system('touch MARKER') }}",
    "raise_exception": "{{ raise_exception('this template refuses') }}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "200 MB of output": "{{ 'x' * 200000000 }}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops with output": "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% "
    "endfor %}",
    "not Jinja": "{% for %}",
    "undefined": "{{ messages.nope.nope }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_a_hostile_chat_template_is_one_line_naming_its_file(chat_art, monkeypatch, name):
    from mpsconvert.model import templates

    monkeypatch.setattr(templates, "RENDER_SECONDS", 4.0)
    marker = _escape_marker()
    (chat_art / "chat_template.jinja").write_text(HOSTILE_TEMPLATES[name].replace("MARKER", str(marker)))
    models.resign(
        chat_art, "chat_template.jinja"
    )  # an attacker who rewrote the manifest too: the bounds are what is left
    with within(120, f"generate with the template {name!r}"):
        res = run_generate(chat_art)
    one_error(res, "chat_template.jinja")
    assert not marker.exists()
    with within(120, "the next render, after a killed worker"):  # the renderer recovers: a sound template renders again
        (chat_art / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        models.resign(chat_art, "chat_template.jinja")
        assert run_generate(chat_art).exit_code == 0


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    "name,body,says",
    [
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
    ],
)
def test_tokenizer_and_generation_files_are_read_with_bounds(chat_art, name, body, says):
    (chat_art / name).write_text(body)
    models.resign(chat_art, name)
    with within(120, f"generate with a hostile {name}"):
        res = run_generate(chat_art)
    one_error(res, name if "vocabulary" not in says else "", says)


def test_a_deep_front_matter_in_the_source_card_is_ignored_not_a_traceback(chat_llama, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(chat_llama[0], src)
    (src / "README.md").write_text("---\nlicense: mit\ndeep: " + DEEP + "\n---\n# the source's card\n")
    with within(120, "quantize with a deep card"):
        res = cli("quantize", src, "-o", tmp_path / "out")
    assert res.exit_code == 0, res.output
    from mpsconvert.manifests.card import split_front_matter

    meta, _ = split_front_matter((tmp_path / "out" / "README.md").read_text())
    assert "mpsconvert" in meta and "license" not in meta  # ours; nothing carried from front matter that was refused
    assert mpsconvert.verify(tmp_path / "out").ok
