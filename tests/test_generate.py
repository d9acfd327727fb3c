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
from .helpers import prefilled

pytestmark = pytest.mark.core  # CI's floor lane runs these on the lowest torch and transformers

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def art(work, text_data):
    """A tiny Llama artifact whose tokenizer has a chat template."""

    src = models.with_chat_template(
        models.tiny("llama", work / "src", tokenizer="bpe", dtype=torch.bfloat16, tie=False), TEMPLATE
    )
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
        out = ref.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    return out[0, len(ids) :].tolist()


def test_greedy_tokens_equal_transformers_generate(art):
    pieces = []
    res = mpsconvert.generate(
        art, models.runtime_texts(1)[0][:200], device="cpu", max_tokens=24, use_template=False, on_text=pieces.append
    )
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
    res = CliRunner().invoke(
        main,
        [
            "generate",
            str(art),
            "The river",
            "--temp",
            "1.5",
            "--top-k",
            "1",
            "--seed",
            "5",
            "--max-tokens",
            "12",
            "--device",
            "cpu",
            "--ignore-chat-template",
            "--json",
        ],
        catch_exceptions=False,
    )
    k1 = mpsconvert.generate(art, "The river", temp=1.5, top_k=1, seed=5, **kw).stats.tokens
    free = mpsconvert.generate(art, "The river", temp=1.5, seed=5, **kw).stats.tokens
    assert (
        res.exit_code == 0 and json.loads(res.output.strip().splitlines()[-1])["tokens"] == k1 != free
    )  # --top-k reaches the sampler
    bad = CliRunner().invoke(main, ["generate", str(art), "The river", "--top-k", "-1"])
    assert bad.exit_code == 2 and "--top-k" in bad.output


def test_generate_cli_streams_and_reports_speed(art):
    res = CliRunner().invoke(
        main, ["generate", str(art), "The river", "--max-tokens", "8", "--device", "cpu"], catch_exceptions=False
    )
    assert res.exit_code == 0, res.output
    for key in ("prompt:", "tokens/s", "generation:", "peak memory:", "backend: torch on cpu"):
        assert key in res.output, res.output


def test_generate_reads_the_prompt_from_stdin_with_a_dash(art):
    args = ["generate", str(art), "--max-tokens", "4", "--device", "cpu", "--ignore-chat-template", "--json"]
    piped = CliRunner().invoke(main, args[:2] + ["-"] + args[2:], input="The river\n", catch_exceptions=False)
    given = CliRunner().invoke(main, args[:2] + ["The river\n"] + args[2:], catch_exceptions=False)
    assert piped.exit_code == 0 and given.exit_code == 0, piped.output
    body = json.loads(piped.stdout.strip().splitlines()[-1])
    assert (
        body["prompt_ids"] == json.loads(given.stdout.strip().splitlines()[-1])["prompt_ids"]
        and len(body["prompt_ids"]) > 2
    )


@pytest.mark.slow  # 3.3 min on 2 cores
def test_chat_runs_a_scripted_two_turn_session(art):
    script = "Forget this.\n/reset\nTell me about rivers.\n/quiet\n/help\nAnd mountains?\n/quit\nnever read\n"
    res = CliRunner().invoke(
        main, ["chat", str(art), "--max-tokens", "6", "--device", "cpu", "--json"], input=script, catch_exceptions=False
    )
    assert res.exit_code == 0, res.output
    turns = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    turns = turns[1:]  # the turn before /reset
    assert len(turns) == 2  # /quit ended it: the line after was never read; /quiet and /help were not sent
    said = " ".join(res.output.split())  # the console wraps its notes
    assert "unknown command /quiet" in said and said.count("/reset forgets the history") == 2
    # the second prompt is the whole history through the template: turn 1's prompt, its reply, the new message
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(art))
    first = [{"role": "user", "content": "Tell me about rivers."}]
    second = first + [{"role": "assistant", "content": turns[0]["text"]}, {"role": "user", "content": "And mountains?"}]
    enc = lambda msgs: list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])  # noqa: E731
    assert turns[0]["prompt_tokens"] == len(enc(first)) and turns[1]["prompt_tokens"] == len(enc(second))


def test_chat_without_a_template_fails_before_the_prompt(work):
    plain = work / "plain-art"
    if not plain.is_dir():
        mpsconvert.quantize(
            models.tiny("llama", work / "plain-src", tokenizer="bpe", dtype=torch.bfloat16, tie=False), plain
        )
    res = CliRunner().invoke(main, ["chat", str(plain), "--device", "cpu"], input="hello\n")
    assert res.exit_code == 2 and "has no chat template" in res.output and "use `mpsconvert generate`" in res.output
    assert ">>" not in res.output and "chatting with" not in res.output  # no prompt shown, no message read


def test_chat_prints_one_line_of_rates_a_turn(art):
    res = CliRunner().invoke(
        main, ["chat", str(art), "--max-tokens", "3", "--device", "cpu"], input="Hello\nAgain\n", catch_exceptions=False
    )
    assert res.exit_code == 0, res.output
    lines = [line for line in res.output.splitlines() if line.startswith("[prompt ")]
    assert len(lines) == 2 and all(" generated at " in line for line in lines)
    assert "peak memory" not in res.output and "==========" not in res.output  # generate's end block, not a chat turn's


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
    enc = mpsconvert.quantize(
        models.tiny("bert", tmp_path / "bert", tokenizer="bpe", dtype=torch.bfloat16), tmp_path / "bert-art"
    ).output
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
    res = CliRunner().invoke(
        main,
        ["generate", str(a), text, "--backend", "coreai", "--max-tokens", "8", "--ignore-chat-template", "--json"],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert (
        out["backend"] == "coreai"
        and out["device"] == "Core AI runtime, Linux CPU"
        and out["prompt_tokens"] == len(ids)
    )
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


def test_json_has_prompt_ids_and_replaying_them_through_model_generate_gives_the_tokens(art):
    """`generate --json` prints the prompt's token ids beside the generated ones, and transformers'
    generate() on the loaded model, fed those ids, makes the same greedy tokens."""
    res = CliRunner().invoke(
        main,
        ["generate", str(art), "The river", "--max-tokens", "10", "--device", "cpu", "--json"],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    body = json.loads(res.output.strip().splitlines()[-1])
    assert body["prompt_ids"] and len(body["prompt_ids"]) == body["prompt_tokens"] and body["compile_seconds"] is None
    # which decode path ran and what it cost; where the load's time went
    assert body["decode"] == {
        "path": "eager",
        "asked": "eager",
        "seconds": None,
        "fallback": None,
    }  # no check: nothing captured
    assert body["load_seconds"] and all(isinstance(v, (int, float)) for v in body["load_seconds"].values())
    model = mpsconvert.load(art, device="cpu")
    ids = torch.tensor([body["prompt_ids"]])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(body["tokens"]), do_sample=False
        )
    assert out[0, ids.shape[1] :].tolist() == body["tokens"]


def _tiny_causal(**kw):
    return models.tiny_model("llama", max_positions=512, dtype=torch.bfloat16, **kw)


def test_the_compiled_path_is_chosen_on_cuda_only():
    """The engine compiles its decode step by default on CUDA only (model.generate() through it:
    tests/test_model_generate.py)."""
    from mpsconvert.runtime import engine

    assert engine.compiles_by_default(torch.device("cuda")) and not engine.compiles_by_default(torch.device("cpu"))
    assert not engine.compiles_by_default(torch.device("mps"))
    model = _tiny_causal()
    assert not engine.Engine(model).compiled and engine.Engine(model, compile=True).compiled


@pytest.mark.slow
def test_the_compiled_decode_step_gives_the_eager_tokens():
    """torch.compile of the engine's decode step (Inductor on CPU here; a CUDA graph on CUDA):
    compiled once in reserve(), timed apart, the same greedy tokens as the eager loop and as
    transformers' generate()."""
    from mpsconvert.runtime import engine

    model = _tiny_causal()
    prompt = [5, 6, 7, 8, 9, 10]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[
            0, 6:
        ].tolist()
    eng = engine.Engine(model, compile=True)
    first = engine.generate_ids(eng, prompt, engine.Sampling(max_tokens=16))
    again = engine.generate_ids(eng, prompt, engine.Sampling(max_tokens=16))
    assert first.tokens == again.tokens == want
    assert first.compile_seconds > 0 and again.compile_seconds is None  # the same cache: nothing compiled twice


def test_the_static_cache_engine_gives_transformers_tokens():
    """The engine's static-cache path (what a CUDA graph replays) run eagerly on CPU: the prompt
    prefilled over a DynamicCache and written into the static cache, then steps over it; the
    greedy tokens are transformers' generate()'s, over several generations of one cache."""
    from mpsconvert.runtime import engine

    model = _tiny_causal()
    eng = engine.Engine(model, static=True)
    for prompt in ([5, 6, 7, 8, 9, 10], [11, 12, 13]):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        got = engine.generate_ids(eng, prompt, engine.Sampling(max_tokens=12))
        assert got.tokens == want[0, len(prompt) :].tolist() and type(eng.cache).__name__ == "StaticCache"


def test_the_static_cache_is_made_before_the_decode_step_is_compiled(monkeypatch):
    """transformers' StaticCache makes its key/value tensors at its first update. Made inside the
    captured step they would live in the CUDA graph's memory pool, and the next prefill's eager
    writes find them overwritten (what the H200 showed: "accessing tensor output of CUDAGraphs that
    has been overwritten by a subsequent run"). So reserve() runs one eager step first: every layer
    of the cache exists when torch.compile is called, and the tokens stay the eager loop's."""
    from mpsconvert.runtime import engine

    model = _tiny_causal()
    eng = engine.Engine(model, compile=True)
    made_at_compile = []

    def compile_spy(fn, **kw):
        made_at_compile.append([layer.is_initialized for layer in eng.cache.layers])
        return fn  # the step runs eager here: what is checked is the order, not Inductor

    monkeypatch.setattr(torch, "compile", compile_spy)
    prompt = [5, 6, 7, 8, 9, 10]
    got = engine.generate_ids(eng, prompt, engine.Sampling(max_tokens=8))
    want = engine.generate_ids(engine.Engine(model, compile=False), prompt, engine.Sampling(max_tokens=8))
    assert made_at_compile and all(made_at_compile[0]) and len(made_at_compile[0]) == model.config.num_hidden_layers
    assert got.tokens == want.tokens


def test_the_decode_step_compiles_with_the_engines_inductor_options(monkeypatch):
    """Inductor reads its options when the step is first called (compiled): that call, and the
    captures after it, run under INDUCTOR_OPTIONS (combo kernels, the decode GEMVs' norm and
    residual folding: fewer launches per step)."""
    import torch._inductor.config as config

    from mpsconvert.runtime import engine
    from mpsconvert.runtime.engine import decoder

    model = _tiny_causal()
    eng = engine.Engine(model, compile=True)
    seen = []

    def compile_spy(fn, **kw):
        def step(*a):
            seen.append({k: getattr(config, k) for k in decoder.INDUCTOR_OPTIONS})
            return fn(*a)

        return step

    monkeypatch.setattr(torch, "compile", compile_spy)
    assert decoder.INDUCTOR_OPTIONS == {"combo_kernels": True, "post_grad_custom_pre_pass": decoder.FUSION}
    assert config.combo_kernels is False and config.post_grad_custom_pre_pass is None  # not torch's defaults
    engine.generate_ids(eng, [5, 6, 7], engine.Sampling(max_tokens=4))
    assert len(seen) >= decoder.WARM_STEPS and all(s == decoder.INDUCTOR_OPTIONS for s in seen[: decoder.WARM_STEPS])
    assert (
        config.combo_kernels is False and config.post_grad_custom_pre_pass is None
    )  # only the engine's compile sees them
    assert eng.inductor_options == decoder.INDUCTOR_OPTIONS


def test_a_step_that_fails_to_compile_with_the_options_compiles_without_them_and_says_so(monkeypatch):
    """Combo kernels are not Inductor's default: where compiling with them fails, the step is
    compiled with torch's defaults, a warning names the options and the error, the engine records
    what it ran with, and the tokens are the eager loop's. A failure without the options raises."""
    import torch._inductor.config as config

    from mpsconvert.runtime import engine

    def compile_spy(fn, **kw):
        def step(*a):
            if config.combo_kernels:
                raise RuntimeError("CUDA driver error: invalid argument")
            return fn(*a)

        return step

    monkeypatch.setattr(torch, "compile", compile_spy)
    model = _tiny_causal()
    eng = engine.Engine(model, compile=True)
    prompt = [5, 6, 7, 8, 9, 10]
    with pytest.warns(UserWarning, match=r"combo_kernels.*RuntimeError: CUDA driver error.*torch's defaults"):
        got = engine.generate_ids(eng, prompt, engine.Sampling(max_tokens=8))
    assert eng.inductor_options == {} and got.compile_seconds > 0
    assert (
        got.tokens
        == engine.generate_ids(engine.Engine(model, compile=False), prompt, engine.Sampling(max_tokens=8)).tokens
    )

    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: lambda *a: (_ for _ in ()).throw(RuntimeError("no compiler"))
    )
    with pytest.warns(UserWarning, match="no compiler"), pytest.raises(RuntimeError, match="no compiler"):
        engine.generate_ids(engine.Engine(model, compile=True), prompt, engine.Sampling(max_tokens=8))


class _Pipelined:
    """The static-cache engine with the pipelined loop turned on off CUDA (where the copy to the
    host is synchronous and no event is waited for: the order of the steps is what is tested)."""

    def __new__(cls, model):
        from mpsconvert.runtime import engine

        class Eng(engine.Engine):
            pipelined = True

        return Eng(model, static=True)


@pytest.mark.parametrize("sampling", [dict(), dict(temp=0.8, top_p=0.9, seed=3)], ids=["greedy", "top-p"])
def test_the_pipelined_loop_gives_the_plain_loops_tokens_and_takes_back_a_step_past_eos(sampling):
    """The loop that starts each step before the host reads the last token (CUDA's, engine/loop.py)
    gives the plain loop's tokens, greedy and sampled with a seed; it stops at max_tokens, at a
    full cache and at an end-of-sequence token, where the step it had started past that token is
    taken back: the next turn of the conversation continues as the plain loop's does."""
    from mpsconvert.runtime import engine

    model = _tiny_causal()
    prompt = [5, 6, 7, 8, 9, 10]
    plain, piped = engine.Engine(model, static=True), _Pipelined(model)
    assert not plain.pipelined and piped.pipelined
    full = engine.generate_ids(plain, prompt, engine.Sampling(max_tokens=12, **sampling))
    got = engine.generate_ids(piped, prompt, engine.Sampling(max_tokens=12, **sampling))
    assert got.tokens == full.tokens and got.stop == full.stop == "max_tokens" and piped.pos == plain.pos
    for n in (1, 2):
        assert engine.generate_ids(piped, prompt, engine.Sampling(max_tokens=n, **sampling)).tokens == full.tokens[:n]
    eos = full.tokens[4]
    stops = [
        engine.generate_ids(e, prompt, engine.Sampling(max_tokens=12, **sampling), stop_ids=[eos])
        for e in (plain, piped)
    ]
    assert stops[0].tokens == stops[1].tokens == full.tokens[: full.tokens.index(eos) + 1] and stops[1].stop == "eos"
    assert piped.pos == plain.pos == len(prompt) + len(stops[0].tokens) - 1
    turn = [engine.generate_ids(e, [11, 12], engine.Sampling(max_tokens=6, **sampling)) for e in (plain, piped)]
    assert turn[0].tokens == turn[1].tokens
    streamed = []
    short = engine.generate_ids(piped, prompt, engine.Sampling(max_tokens=12, **sampling), on_token=streamed.append)
    assert streamed == short.tokens == full.tokens


def test_the_pipelined_loop_stops_at_a_full_cache():
    from mpsconvert.runtime import engine

    model = _tiny_causal()
    plain, piped = engine.Engine(model, static=True), _Pipelined(model)
    for e in (plain, piped):
        e.max_len = 10
    prompt = [5, 6, 7, 8, 9, 10]
    a, b = (engine.generate_ids(e, prompt, engine.Sampling(max_tokens=12)) for e in (plain, piped))
    assert a.tokens == b.tokens and len(a.tokens) == 4 and a.stop == b.stop == "cache_full"


@pytest.mark.parametrize("writes", ["position", "counter"])
def test_a_rewound_step_is_forgotten_by_the_static_cache(writes, monkeypatch):
    """A step taken back (`rewind`, what the pipelined loop does past an end-of-sequence token)
    leaves the static cache as if it never ran: the conversation's next prompt and step give the
    logits of an engine that never took it. The engine's static cache writes at the engine's
    position (hf_compat.write_at); where it cannot (`counter`: transformers' own StaticCache
    layers, 5.16 on, write at a counter of their own, `cumulative_length`), the counters move
    back with the engine's position."""
    from mpsconvert.runtime import engine
    from mpsconvert.runtime.engine import decoder

    if writes == "counter":
        monkeypatch.setattr(decoder, "write_at", lambda *a: False)
    model = _tiny_causal()
    a, b = engine.Engine(model, static=True), engine.Engine(model, static=True)
    for e in (a, b):
        prefilled(e, [5, 6, 7, 8])
        assert e.writes_at == writes
        assert all((layer.cumulative_length is e.pos_t) == (writes == "position") for layer in e.cache.layers)
    a.step(9)
    a.rewind(1)
    assert torch.equal(a.prefill([11, 12]), b.prefill([11, 12])) and a.pos == b.pos == 6
    assert torch.equal(a.step(13), b.step(13))


def test_a_static_step_writes_its_token_at_the_engine_position():
    """A decode step over the static cache writes its one token's keys and values at the engine's
    position (hf_compat.write_at: the position tensor itself is the index) and nowhere else: its
    logits are those of a step over a dynamic cache, and the cache past the last step is empty."""
    from mpsconvert.runtime import engine

    model = _tiny_causal()
    s, d = engine.Engine(model, static=True), engine.Engine(model, static=False)
    for e in (s, d):
        prefilled(e, [5, 6, 7, 8])
    assert s.writes_at == "position"
    for t in (9, 10, 11):
        torch.testing.assert_close(s.step(t), d.step(t))
    keys = s.cache.layers[0].keys
    assert bool(keys[:, :, 4:7].abs().sum(-1).all()) and not keys[:, :, 7:].any()


@pytest.mark.parametrize("window", [4096, 5])
def test_the_compiled_engine_decodes_a_sliding_window_model(window):
    """Mistral-style models declare a sliding window; transformers' StaticCache then makes
    sliding-window layers, which keep their length in a Python int, so a compiled step would
    compile anew at every token (it raised under the engine's warm guards). Where the window holds
    the whole cache the layers are plain ones (the engine's position writes them); where it does
    not, the engine says so and decodes eagerly. Either way the tokens are the eager loop's."""
    from mpsconvert.runtime import engine

    from .models import tiny_model

    model = tiny_model("mistral", dtype=torch.bfloat16, sliding_window=window)
    prompt = [5, 6, 7, 8, 9, 10]
    want = engine.generate_ids(engine.Engine(model, compile=False), prompt, engine.Sampling(max_tokens=10)).tokens
    eng = engine.Engine(model, compile=True)
    if window >= 256:
        got = engine.generate_ids(eng, prompt, engine.Sampling(max_tokens=10))
        assert eng.writes_at == "position" and eng.compiled and got.compile_seconds > 0
    else:
        with pytest.warns(UserWarning, match="decode step runs eagerly"):
            got = engine.generate_ids(eng, prompt, engine.Sampling(max_tokens=10))
        assert eng.writes_at == "counter" and not eng.compiled and got.compile_seconds is None
    assert got.tokens == want


# --------------------------------------------------------------------------- the decode paths


def test_the_decode_path_is_a_cuda_graph_on_cuda_and_eager_elsewhere():
    """On CUDA the default is the captured eager step (CUDA_DEFAULT: seconds to set up, where
    torch.compile costs ~30 s a process); each path is chosen where asked; the eager loop off CUDA."""
    from mpsconvert.errors import MpsconvertError
    from mpsconvert.runtime import engine
    from mpsconvert.runtime.engine import decoder

    cuda, cpu, mps = torch.device("cuda"), torch.device("cpu"), torch.device("mps")
    assert engine.decode_path(cuda) == engine.decode_path(cuda, "auto") == decoder.CUDA_DEFAULT == "graph"
    assert engine.decode_path(cuda, "graph") == "graph"
    assert engine.decode_path(cpu) == engine.decode_path(mps) == "eager"
    assert engine.decode_path(cuda, True) == engine.decode_path(cpu, "compile") == "compile"
    assert engine.decode_path(cuda, False) == engine.decode_path(cuda, "eager") == "eager"
    assert engine.decode_path(cpu, "graph") == "graph"  # asked for: its capture refuses off CUDA, said so (below)
    with pytest.raises(MpsconvertError, match="unknown decode path"):
        engine.decode_path(cuda, "fast")
    model = _tiny_causal()
    assert engine.Engine(model, compile="graph").compiled and engine.Engine(model).decode_report["path"] == "eager"


class _EagerGraph:
    """A stand-in for CapturedStep on CPU: the recorded step run again at each replay (what a
    faithful CUDA graph does)."""

    made = 0

    def __init__(self, fn, dev, warm=3):
        type(self).made += 1
        self.fn = fn
        self.out = fn()

    def replay(self):
        self.out = self.fn()
        return self.out


def test_the_captured_step_gives_the_eager_tokens_and_says_what_ran(monkeypatch):
    """The graph path (its capture stood in for on CPU): captured once per cache in reserve(),
    checked, the eager loop's greedy tokens; stats.decode names the path and its seconds."""
    from mpsconvert.runtime import engine
    from mpsconvert.runtime.engine import decoder

    monkeypatch.setattr(decoder, "CapturedStep", _EagerGraph)
    model = _tiny_causal()
    prompt = [5, 6, 7, 8, 9, 10]
    want = engine.generate_ids(engine.Engine(model, compile=False), prompt, engine.Sampling(max_tokens=12)).tokens
    eng = engine.Engine(model, compile="graph")
    first = engine.generate_ids(eng, prompt, engine.Sampling(max_tokens=12))
    again = engine.generate_ids(eng, prompt, engine.Sampling(max_tokens=12))
    assert first.tokens == again.tokens == want and _EagerGraph.made == 1 and eng._graph is not None
    assert first.decode["path"] == "graph" and first.decode["fallback"] is None and first.decode["seconds"] > 0
    assert first.decode["check"]["rms_diff"] == 0 and first.decode["check"]["rms_logits"] > 0
    assert again.decode["seconds"] is None and again.compile_seconds is None  # the same cache: nothing captured twice
    assert json.loads(json.dumps(first.as_dict()))["decode"]["path"] == "graph"


class _FrozenGraph(_EagerGraph):
    """A graph that froze the position it was captured at (what a host-side read of the position
    would record): each replay runs at that position, whatever the engine set."""

    engine = None

    def __init__(self, fn, dev, warm=3):
        self.at = self.engine.pos_t.clone()
        super().__init__(fn, dev, warm)

    def replay(self):
        now = self.engine.pos_t.clone()
        self.engine.pos_t.copy_(self.at)
        try:
            return super().replay()
        finally:
            self.engine.pos_t.copy_(now)


def test_a_graph_that_differs_from_the_eager_step_is_not_used_and_the_warning_says_what_runs(monkeypatch):
    """The check at a position the capture never saw catches a graph that froze its position: it
    is dropped, a warning says the step runs eagerly and why, stats.decode keeps the fallback, and
    the tokens are the eager loop's. Never a silent fallback."""
    from mpsconvert.runtime import engine
    from mpsconvert.runtime.engine import decoder

    monkeypatch.setattr(decoder, "CapturedStep", _FrozenGraph)
    model = _tiny_causal(
        initializer_range=0.2
    )  # attention that moves the logits (at 0.02 a position moved them by 1% RMS)
    prompt = [5, 6, 7, 8, 9, 10]
    want = engine.generate_ids(engine.Engine(model, compile=False), prompt, engine.Sampling(max_tokens=12)).tokens
    eng = _FrozenGraph.engine = engine.Engine(model, compile="graph")
    with pytest.warns(UserWarning, match="the decode step runs eagerly .*replay differs from the eager step"):
        got = engine.generate_ids(eng, prompt, engine.Sampling(max_tokens=12))
    assert got.tokens == want and eng._graph is None and not eng.compiled
    assert (
        got.decode["path"] == "eager"
        and got.decode["asked"] == "graph"
        and got.decode["fallback"].startswith("graph: its replay")
    )
    assert got.decode["check"]["rms_diff"] > 0.1 * got.decode["check"]["rms_logits"]  # far past the tolerance
    assert got.decode["seconds"] > 0  # what the failed capture cost is still said


def test_a_capture_that_fails_falls_back_to_the_eager_step_with_a_warning():
    """Off CUDA the real capture refuses: the eager loop runs, said in a warning and in stats.decode."""
    from mpsconvert.runtime import engine

    model = _tiny_causal()
    with pytest.warns(UserWarning, match="the decode step runs eagerly .*capturing it failed .*needs a CUDA device"):
        got = engine.generate_ids(engine.Engine(model, compile="graph"), [5, 6, 7], engine.Sampling(max_tokens=4))
    assert got.decode["path"] == "eager" and "CUDA device" in got.decode["fallback"] and len(got.tokens) == 4


def test_no_compile_contradicting_decode_is_a_usage_error(art):
    res = CliRunner().invoke(main, ["generate", str(art), "x", "--device", "cpu", "--no-compile", "--decode", "graph"])
    assert res.exit_code == 2 and "--no-compile" in res.output and "--decode graph" in res.output, res.output


def test_chat_starts_the_template_renderer_before_the_model_loads(art, work, monkeypatch):
    """The renderer's worker (a process importing transformers) starts while the model loads, not after it."""
    from mpsconvert.model import templates
    from mpsconvert.runtime.load import loader

    order = []
    real_warm, real_load = templates.warm, loader.load
    monkeypatch.setattr(templates, "warm", lambda: (order.append("renderer"), real_warm())[1])
    monkeypatch.setattr(loader, "load", lambda *a, **k: (order.append("model"), real_load(*a, **k))[1])
    with mpsconvert.chat(art, device="cpu", max_tokens=2):
        pass
    assert order[:2] == ["renderer", "model"]
    plain = work / "plain-art"  # no chat template: no worker started for it
    if plain.is_dir():
        from mpsconvert.manifests import loadable

        order.clear()
        assert loadable.start_renderer(plain) is False and order == []
