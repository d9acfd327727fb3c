"""The terminal is an output too, and standard input an input: generated text on a terminal goes
through the shown-text filter (piped or `--json`, it is data); stdin that is not UTF-8 or too long
is one line, named as such; a tokenizer's Rust panic is one line; chat drops its oldest turns when
the history outgrows the context. Names are text wherever they are shown: a hostile folder name in
the card, its YAML and its commands, a source id in a commit message, markup and escape sequences in
verify and inspect."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

import mpsconvert
from mpsconvert import api
from mpsconvert.cli import render
from mpsconvert.errors import ArtifactError
from mpsconvert.manifests.layout import MANIFEST_NAME
from mpsconvert.manifests.manifest import Manifest

from . import models
from .helpers import CHAT_TEMPLATE, cli, one_error

HOSTILE = "ok\x1b]0;pwned\x07\x1b[2J\r\u202eend\n\tnext"


def one_line_error(res, *says) -> None:
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert "Traceback" not in res.output and len(errors) == 1, res.output
    for s in says:
        assert s in errors[0], res.output


class _Said:
    """A stand-in for an open model (api.Chat) whose reply is `reply`, streamed in pieces, or
    `fails` raised from it: what the CLI does with the text is under test, not the model."""

    backend, device, history = "torch", "cpu", []
    kernels_held = False  # api.Chat's: no GPU kernels compiling for the next run

    def __init__(self, reply: str = HOSTILE, fails: BaseException | None = None):
        self.reply, self.fails = reply, fails

    def _result(self, on_text):
        if self.fails is not None:
            raise self.fails
        for i in range(0, len(self.reply), 3):  # an escape sequence split across pieces too
            if on_text:
                on_text(self.reply[i : i + 3])
        stats = SimpleNamespace(
            prompt_tokens=1,
            prompt_tps=1.0,
            generation_tps=1.0,
            generated_tokens=1,
            stop="eos",
            compile_seconds=None,
            peak_memory_bytes=None,
            peak_memory_source="n/a",
            backend="torch",
            device="cpu",
            as_dict=lambda: {"generated_tokens": 1},
        )
        return api.GenerateResult(self.reply, stats)

    def complete(self, prompt, on_text=None, use_template=True):
        return self._result(on_text)

    def say(self, message, on_text=None):
        return self._result(on_text)

    def require_template(self):
        pass

    def reset(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def said(monkeypatch):
    def use(**kw):
        monkeypatch.setattr(api, "chat", lambda *a, **k: _Said(**kw))

    return use


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generated_text_on_a_terminal_is_shown_not_acted_on(said, monkeypatch, tmp_path, command):
    """A vocabulary entry carrying ESC]0;...BEL / ESC[2J (in a verified, even pinned, artifact)
    retitled and cleared the user's terminal."""
    said()
    args = [command, tmp_path, *(["hi"] if command == "generate" else [])]
    monkeypatch.setattr(render, "_is_terminal", lambda stream: True)
    res = cli(*args, input="hi\n/exit\n")
    assert res.exit_code == 0, res.output
    assert (
        "\x1b" not in res.stdout and "\x07" not in res.stdout and "\u202e" not in res.stdout and "\r" not in res.stdout
    )
    assert "ok\\x1b]0;pwned\\x07\\x1b[2J\\x0d\\u202eend\n\tnext" in res.stdout  # shown, line breaks and tabs kept
    monkeypatch.setattr(render, "_is_terminal", lambda stream: False)  # piped: the text is data, as the model made it
    assert HOSTILE in cli(*args, input="hi\n/exit\n").stdout
    res = cli(*args, "--json", input="hi\n/exit\n")  # JSON: escaped by the encoder, read back exactly
    assert "\x1b" not in res.stdout and json.loads(res.stdout.strip().splitlines()[-1])["text"] == HOSTILE


def test_the_filter_keeps_prose_and_escapes_controls():
    from mpsconvert.infra.untrusted import shown_text

    assert shown_text("a\nb\tc é 漢字") == "a\nb\tc é 漢字"
    assert shown_text("\x1b[31mred\x9b\x00") == "\\x1b[31mred\\x9b\\x00"


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_stdin_that_is_not_utf8_is_one_line(said, tmp_path, command):
    said()
    res = cli(command, tmp_path, *(["-"] if command == "generate" else []), input=b"caf\xe9 \xff\n")
    if command == "generate":
        one_line_error(res, "standard input is not UTF-8 text")
    else:  # chat says it and goes on; end of input ends it
        assert res.exit_code == 0 and "the message is not UTF-8 text" in res.output and "Traceback" not in res.output, (
            res.output
        )


def test_a_huge_stdin_prompt_is_named_not_blamed_on_the_template(said, tmp_path):
    said()
    one_line_error(
        cli("generate", tmp_path, "-", input="x" * (20 << 20)), "standard input holds more than 4,194,304 characters"
    )


def test_a_huge_chat_line_is_refused_and_the_chat_goes_on(said, tmp_path):
    said(reply="fine")
    res = cli("chat", tmp_path, input="x" * (5 << 20) + "\nhello\n")
    assert res.exit_code == 0 and "the message is 5,242,880 characters, more than 4,194,304" in res.output, res.output[
        -2000:
    ]
    assert "fine" in res.stdout


def test_a_rust_panic_is_one_line(said, tmp_path):
    """pyo3's PanicException is a BaseException: `except Exception` (the CLI's catch-all) missed it."""
    panic = type("PanicException", (BaseException,), {})("Onig: Regex search error: retry-limit-in-match over")
    said(fails=panic)
    one_line_error(cli("generate", tmp_path, "hi"), "Rust code panicked", "retry-limit-in-match")


# --------------------------------------------------------------------------- with a real model


@pytest.fixture(scope="module")
def art(work):
    """A tiny Llama artifact whose tokenizer has a chat template; 128 positions."""

    src = models.with_chat_template(
        models.tiny("llama", work / "src", tokenizer="bpe", dtype=torch.bfloat16, max_positions=128), CHAT_TEMPLATE
    )
    out = work / "art"
    mpsconvert.quantize(src, out)
    return out


def test_a_tokenizer_regex_that_panics_is_one_line(art, tmp_path):
    """A real one: a pre-tokenizer Split regex that backtracks past Onig's retry limit."""
    import shutil

    a = tmp_path / "art"
    shutil.copytree(art, a)
    tj = json.loads((a / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated", "invert": False}
    (a / "tokenizer.json").write_text(json.dumps(tj))
    models.resign(a, "tokenizer.json")
    one_line_error(
        cli("generate", a, "a" * 40 + "!", "--device", "cpu", "--ignore-chat-template", "--max-tokens", "2"),
        "the tokenizer failed on this text",
        "retry-limit-in-match",
    )
    from mpsconvert.manifests import loadable

    tok = loadable.tokenizer(a)
    with pytest.raises(ArtifactError, match="Rust code panicked"):
        loadable.encode(tok, "a" * 40 + "!")


def test_chat_drops_the_oldest_turns_when_the_history_outgrows_the_context(art):
    """After a few long turns the prompt would outgrow the cache: the oldest turns go, and chat says so."""
    line = "The river runs through the old town and past the mill. "
    script = "".join(f"{line * 3} {i}\n" for i in range(6))
    res = cli("chat", art, "--max-tokens", "8", "--device", "cpu", "--json", input=script)
    assert res.exit_code == 0, res.output[-3000:]
    turns = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert len(turns) == 6, res.output[-3000:]
    said = " ".join(res.output.split())
    assert "the history outgrew the model's context" in said and "oldest message(s) were dropped" in said
    assert any(t.get("dropped_messages") for t in turns) and all(t["prompt_tokens"] < 128 for t in turns)


def test_a_chat_line_too_long_for_the_context_is_refused_before_tokenizing(art, monkeypatch):
    """A line that cannot fit the context even at the vocabulary's longest token per position is
    refused on its length: it is never rendered or tokenized (a 5 MB line took the tokenizer's time)."""
    from mpsconvert.manifests import loadable

    calls = []
    real = loadable.chat_ids
    monkeypatch.setattr(
        loadable, "chat_ids", lambda tok, msgs: calls.append(sum(len(m["content"]) for m in msgs)) or real(tok, msgs)
    )
    res = cli("chat", art, "--max-tokens", "4", "--device", "cpu", input="y" * 200_000 + "\nhello\n")
    assert res.exit_code == 0 and "and the torch model holds 128 tokens, of at most" in " ".join(res.output.split()), (
        res.output[-2000:]
    )
    assert calls and max(calls) < 1000  # only "hello" was rendered


# ------------------------------------------------------------------ cards, commit messages and terminal output are text


HOSTILE_NAME = (
    "evil\n# Heading\n<img src=x onerror=alert(1)> $(touch PWNED) `tick` | pipe [link](javascript:x) \x1b[31mred"
)


def _markdown_tokens(text: str):
    from markdown_it import MarkdownIt

    tokens, todo = [], MarkdownIt("commonmark").enable("table").parse(text)
    while todo:
        t = todo.pop(0)
        tokens.append(t)
        todo[:0] = t.children or []
    return tokens


def test_a_hostile_source_folder_name_is_text_in_the_card_and_its_commands(chat_llama, tmp_path, monkeypatch):
    import shlex

    import yaml

    from mpsconvert.infra.untrusted import printable

    src = tmp_path / HOSTILE_NAME
    shutil.copytree(chat_llama[0], src)
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
    runs = [
        shlex.split(line)
        for t in tokens
        if t.type == "fence"
        for line in t.content.splitlines()
        if line.startswith("mpsconvert ")
    ]
    assert runs and all(argv[2] == printable(art.name) for argv in runs), runs  # one argument, quoted
    assert mpsconvert.verify(art).ok


def test_commit_messages_are_one_line_without_control_characters(chat_art):
    from mpsconvert.publish.hub import commit_message

    m = Manifest.read(chat_art)
    m.source["id"] = "org/x\n\nSigned-off-by: someone else\x1b[2J\x00"
    msg = commit_message(m)
    assert "\n" not in msg and "\x1b" not in msg and "\x00" not in msg and "Signed-off-by: someone else" in msg


def test_markup_and_escape_sequences_in_names_are_printed_literally(chat_art, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    evil = "[bold red]boom[/] \x1b]0;pwned\x07 \x1b[2J [link=file:///etc/passwd]x[/link]"
    (chat_art / f"notes {evil[:30].replace('/', '_')}.txt").write_text("unlisted")
    m = json.loads((chat_art / MANIFEST_NAME).read_text())
    name, rec = next(iter(m["tensors"].items()))
    m["tensors"][evil] = m["tensors"].pop(name)
    m["summary"]["worst_sqnr_tensor"] = evil
    m["summary"]["ratio"] = "not a number"
    m["recipe"]["calibration"] = {"data": {"id": evil}, "observer": [1, 2]}
    # a record of the right types whose untyped figures are not numbers: shown as '?'
    m["validation"] = {
        evil: {
            "kind": "causal-lm",
            "device": evil,
            "accuracy": {"mean_kl": "x", "perplexity_bf16": [1]},
            "verdict": {"decode": 5},
        }
    }
    (chat_art / MANIFEST_NAME).write_text(json.dumps(m))
    for cmd in (("verify", chat_art), ("inspect", chat_art, "--tensors")):
        res = cli(*cmd)
        assert "Traceback" not in res.output and res.exception is None or isinstance(res.exception, SystemExit), (
            res.output
        )
        assert "\x1b" not in res.output and "\x07" not in res.output, repr(res.output[:400])
    res = cli("inspect", chat_art, "--tensors")
    assert res.exit_code == 0 and "[bold red]boom[/]" in res.output and "\\x1b]0;pwned\\x07" in res.output, res.output
    # a malformed record (manifests/records.py) is one error line, exit 2, its key shown literally too
    m["validation"][evil]["speedup"] = {"decode": "fast"}
    (chat_art / MANIFEST_NAME).write_text(json.dumps(m))
    res = cli("inspect", chat_art)
    one_error(res, "[bold red]boom[/]", "\\x1b]0;pwned\\x07", "speedup")
    assert "\x1b" not in res.output and "\x07" not in res.output


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_first_run_says_why_it_waits_after_the_answer(monkeypatch, tmp_path, command):
    """On a machine's first run closing waits for the GPU kernels still compiling (api.Chat.close):
    the CLI says so after the answer, so that the wait is not taken for a hang; not otherwise."""
    for held in (True, False):
        chat = _Said(reply="the answer")
        chat.kernels_held = held
        monkeypatch.setattr(api, "chat", lambda *a, _c=chat, **k: _c)
        res = cli(command, tmp_path, *(["hi"] if command == "generate" else []), input="hi\n/exit\n")
        assert res.exit_code == 0, res.output
        said = "compiling this machine's GPU kernels for the next run" in res.output
        assert said == held, res.output
        if held:
            assert res.output.index("the answer") < res.output.index("compiling this machine's GPU kernels")
