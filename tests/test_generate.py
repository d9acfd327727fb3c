"""`generate` and `chat`: the decode loop over a KV cache gives what transformers gives."""

import importlib.util
import json
import sys

import pytest
import torch
from click.testing import CliRunner

import mpsconvert
from mpsconvert.cli import main

from . import models

pytestmark = pytest.mark.core  # CI's floor lane runs these on the lowest torch and transformers

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def art(work, text_data):
    """A tiny Llama artifact whose tokenizer has a chat template."""
    from transformers import AutoTokenizer

    src = models.tiny("llama", work / "src", tokenizer="bpe", dtype=torch.bfloat16, tie=False)
    tok = AutoTokenizer.from_pretrained(str(src))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(src))
    out = work / "art"
    mpsconvert.quantize(src, out)
    return out


def reference_greedy(art, ids, n, dtype=torch.bfloat16):
    """transformers' own generate on the artifact's dequantized weights (no mpsconvert runtime)."""
    from transformers import AutoModelForCausalLM

    from mpsconvert.calibrate.artifact import dequantized_snapshot
    from mpsconvert.manifests.manifest import Manifest

    with dequantized_snapshot(art, Manifest.read(art)) as d:
        ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype).eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def test_greedy_tokens_equal_transformers_generate(art):
    pieces = []
    res = mpsconvert.generate(art, models.runtime_texts(1)[0][:200], device="cpu", max_tokens=24, use_template=False,
                              on_text=pieces.append)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(art))(models.runtime_texts(1)[0][:200])["input_ids"]
    want = reference_greedy(art, ids, 24)
    assert res.stats.tokens == want[: len(res.stats.tokens)] and len(res.stats.tokens) == len(want)
    assert len(set(want)) > 1  # not a degenerate repetition that any bug would also produce
    assert "".join(pieces) == res.text  # what was streamed is the text
    s = res.stats
    assert s.prompt_tokens == len(ids) and s.generated_tokens == 24 and s.device == "cpu" and s.backend == "torch"
    assert s.prompt_tps > 0 and s.generation_tps > 0 and s.peak_memory_bytes > 0


def test_sampling_is_seeded_and_top_p_small_is_greedy(art):
    kw = dict(device="cpu", max_tokens=12, use_template=False)
    a = mpsconvert.generate(art, "The river", temp=1.5, seed=3, **kw).stats.tokens
    b = mpsconvert.generate(art, "The river", temp=1.5, seed=3, **kw).stats.tokens
    c = mpsconvert.generate(art, "The river", temp=1.5, seed=4, **kw).stats.tokens
    greedy = mpsconvert.generate(art, "The river", **kw).stats.tokens
    nucleus = mpsconvert.generate(art, "The river", temp=1.5, top_p=1e-6, seed=5, **kw).stats.tokens
    assert a == b and a != c and nucleus == greedy


def test_generate_cli_streams_and_reports_speed(art):
    res = CliRunner().invoke(main, ["generate", str(art), "The river", "--max-tokens", "8", "--device", "cpu"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    for key in ("prompt:", "tokens/s", "generation:", "peak memory:", "backend: torch on cpu"):
        assert key in res.output, res.output


def test_chat_runs_a_scripted_two_turn_session(art):
    script = "Forget this.\n/reset\nTell me about rivers.\nAnd mountains?\n/exit\nnever read\n"
    res = CliRunner().invoke(main, ["chat", str(art), "--max-tokens", "6", "--device", "cpu", "--json"], input=script,
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    turns = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    turns = turns[1:]  # the turn before /reset
    assert len(turns) == 2  # /exit ended it: the line after was never read
    # the second prompt is the whole history through the template: turn 1's prompt, its reply, the new message
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(art))
    first = [{"role": "user", "content": "Tell me about rivers."}]
    second = first + [{"role": "assistant", "content": turns[0]["text"]}, {"role": "user", "content": "And mountains?"}]
    enc = lambda msgs: list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])  # noqa: E731
    assert turns[0]["prompt_tokens"] == len(enc(first)) and turns[1]["prompt_tokens"] == len(enc(second))


def test_chat_api_keeps_the_history(art):
    with mpsconvert.chat(art, device="cpu", max_tokens=4, system="Be brief.") as c:
        r1 = c.say("Hello")
        r2 = c.say("Again")
    assert [m["role"] for m in c.history] == ["system", "user", "assistant", "user", "assistant"]
    assert c.history[2]["content"] == r1.text and c.history[4]["content"] == r2.text


def test_backends_say_what_is_missing(art, tmp_path):
    res = CliRunner().invoke(main, ["generate", str(art), "hi", "--backend", "coreai"])
    if importlib.util.find_spec("coreai") is None:  # the extra first: exporting the asset would need it too
        assert res.exit_code == 2 and "pip install 'mpsconvert[coreai]'" in res.output
    else:
        assert res.exit_code == 2 and "has no Core AI asset" in res.output and "export-coreai" in res.output
    res = CliRunner().invoke(main, ["generate", str(art), "hi", "--backend", "coreml"])
    # off macOS the platform is said first (not "export a package", which could not run here anyway)
    assert res.exit_code == 2 and ("Core ML package" if sys.platform == "darwin" else "only on macOS") in res.output
    enc = mpsconvert.quantize(models.tiny("bert", tmp_path / "bert", tokenizer="bpe", dtype=torch.bfloat16), tmp_path / "bert-art").output
    res = CliRunner().invoke(main, ["generate", str(enc), "hi", "--device", "cpu"])
    assert res.exit_code == 2 and "not a causal LM" in res.output, res.output


@pytest.mark.extra("coreai")
def test_coreai_backend_generates_what_transformers_does(art, tmp_path):
    """The exported asset on the Core AI runtime (Linux: coreai-core's CPU runtime, fp32 compute)
    gives transformers' greedy tokens on the same dequantized weights in fp32."""
    import shutil

    from transformers import AutoTokenizer

    a = tmp_path / "art"
    shutil.copytree(art, a)
    mpsconvert.export_coreai(a, max_len=48, check=False)
    text = models.runtime_texts(1)[0][:60]
    ids = AutoTokenizer.from_pretrained(str(a))(text)["input_ids"]
    res = CliRunner().invoke(main, ["generate", str(a), text, "--backend", "coreai", "--max-tokens", "8", "--ignore-chat-template",
                                    "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["backend"] == "coreai" and out["device"] == "Core AI runtime, Linux CPU" and out["prompt_tokens"] == len(ids)
    assert out["tokens"] == reference_greedy(a, ids, 8, dtype=torch.float32)  # both stop at the same eos, if one comes
    assert len(set(out["tokens"])) > 2
    long = " ".join([text] * 10)  # more tokens than the asset's cache holds: one line, before the runtime is called
    res = CliRunner().invoke(main, ["generate", str(a), long, "--backend", "coreai", "--ignore-chat-template"])
    assert res.exit_code == 2 and "holds 48" in res.output, res.output
    # a tampered asset is refused by the hash check before the runtime opens it
    weights = max((p for p in (a / "model.aimodel").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    res = CliRunner().invoke(main, ["generate", str(a), text, "--backend", "coreai", "--ignore-chat-template"])
    assert res.exit_code == 2 and "model.aimodel" in res.output and "sha256" in res.output.lower(), res.output
