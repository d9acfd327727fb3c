"""transformers' `generate()` on a loaded model (runtime/patches/generate.py): at batch 1 on CUDA
it runs mpsconvert's engine and returns what transformers' own generate() returns; settings the
engine lacks run transformers' loop, said and warned. The device is faked here (the patch's
context says CUDA, the model stays on CPU, where the engine runs eager): what is checked is the
choice of path and that the engine's answer is transformers' answer."""

import warnings

import pytest
import torch

from mpsconvert.runtime import patches
from mpsconvert.runtime.patches import generate as hf_generate

from . import models

pytestmark = pytest.mark.core


def _model():
    """A tiny BF16 Llama with the generate patch installed as on CUDA (the device faked)."""
    model = models.tiny_model("llama", vocab=256, max_positions=512, dtype=torch.bfloat16).requires_grad_(False)
    reports = patches.apply(
        model, patches.Context(torch.device("cuda"), torch.bfloat16, {"eager_fusion": False}), "forwards"
    )
    assert reports["generate"].installed == 1 and hf_generate.installed(model)
    return model


PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


@pytest.fixture
def spy(monkeypatch):
    """The cache_implementation of every call that reached transformers' own generate()."""
    from transformers import LlamaForCausalLM

    seen, own = [], LlamaForCausalLM.generate

    def spy(self, *a, **kw):
        seen.append(kw.get("cache_implementation"))
        return own(self, *a, **kw)

    monkeypatch.setattr(LlamaForCausalLM, "generate", spy)
    return seen


@pytest.mark.parametrize(
    "kw",
    [dict(max_new_tokens=12, do_sample=False), dict(max_length=15), dict(max_new_tokens=9, eos_token_id=None)],
    ids=["max_new_tokens", "max_length", "no-eos"],
)
def test_batch_one_runs_the_engine_and_returns_transformers_tokens(spy, kw):
    model = _model()
    want = type(model).generate(model, PROMPT, **kw)  # transformers' own loop, before the spy counts
    spy.clear()
    with torch.no_grad():
        got = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), **kw)
    assert spy == [] and model.mpsconvert_generate_path == "engine"
    assert got.dtype == torch.long and torch.equal(got, want), (got, want)
    assert len(set(got[0, PROMPT.shape[1] :].tolist())) > 1


def test_an_end_of_sequence_token_stops_as_in_transformers(spy):
    model = _model()
    free = (
        type(model)
        .generate(model, PROMPT, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, PROMPT.shape[1] :]
        .tolist()
    )
    eos = free[4]  # a token the greedy run makes: both loops must stop at its first appearance, keeping it
    want = type(model).generate(model, PROMPT, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    spy.clear()
    got = model.generate(PROMPT, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    assert spy == [] and torch.equal(got, want) and got[0, -1].item() == eos and got.shape[1] <= PROMPT.shape[1] + 5


def test_the_streamer_sees_what_transformers_streams():
    from transformers.generation.streamers import BaseStreamer

    class Record(BaseStreamer):
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    model = _model()
    eos = (
        type(model)
        .generate(model, PROMPT, max_new_tokens=8, do_sample=False, eos_token_id=None)[0, PROMPT.shape[1] + 3]
        .item()
    )
    out, theirs = {}, {}
    for name, fn in (("ours", model.generate), ("transformers", lambda *a, **k: type(model).generate(model, *a, **k))):
        rec = Record()
        res = fn(
            PROMPT, max_new_tokens=8, do_sample=False, streamer=rec, eos_token_id=eos
        )  # the end-of-sequence token streamed too
        out[name], theirs[name] = res, (rec.puts, rec.ended)
    assert model.mpsconvert_generate_path == "engine"
    assert torch.equal(out["ours"], out["transformers"]) and theirs["ours"] == theirs["transformers"]
    assert theirs["ours"][0][0] == PROMPT[0].tolist() and theirs["ours"][0][-1] == [eos] and theirs["ours"][1]


def test_sampling_runs_the_engine_repeatably_within_top_k():
    """Sampling with top-k draws from torch's default generator (torch.manual_seed repeats it) and
    never leaves the k most likely tokens; without top-k the near-flat logits of a random model
    would leave them at once."""
    model = _model()
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(
            model.generate(PROMPT, max_new_tokens=24, do_sample=True, top_k=3, temperature=1.0, eos_token_id=None)
        )
    assert model.mpsconvert_generate_path == "engine" and torch.equal(*runs)
    seq = runs[0]
    with torch.no_grad():
        logits = model(seq).logits[0, PROMPT.shape[1] - 1 : -1].float()
    top = logits.topk(3, dim=-1).values[:, -1:]
    new = seq[0, PROMPT.shape[1] :]
    assert bool((logits.gather(1, new[:, None]) >= top).all()), "a token outside the top 3 was drawn"
    torch.manual_seed(11)
    wide = model.generate(PROMPT, max_new_tokens=24, do_sample=True, top_k=0, temperature=1.0, eos_token_id=None)
    with torch.no_grad():
        wl = model(wide).logits[0, PROMPT.shape[1] - 1 : -1].float()
    assert not bool((wl.gather(1, wide[0, PROMPT.shape[1] :, None]) >= wl.topk(3, dim=-1).values[:, -1:]).all())


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(repetition_penalty=1.3), "the generation config sets repetition_penalty"),
        (dict(num_beams=2), "the generation mode is beam_search"),
        (
            dict(return_dict_in_generate=True, output_scores=True),
            "the generation config sets output_scores, return_dict_in_generate",
        ),
        (dict(min_new_tokens=4), "the generation config sets min_new_tokens"),
    ],
    ids=["repetition_penalty", "beams", "scores", "min_new_tokens"],
)
def test_settings_the_engine_lacks_run_transformers_static_path_and_say_so(spy, kw, why):
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(PROMPT, max_new_tokens=5, **kw)
        model.generate(PROMPT, max_new_tokens=5, **kw)
    assert spy == ["static", "static"]
    assert model.mpsconvert_generate_path == f"transformers (static cache): {why}"
    said = [str(w.message) for w in caught if issubclass(w.category, hf_generate.GenerateFallback)]
    assert said == [
        f"mpsconvert: model.generate() runs transformers' loop, not mpsconvert's engine: {why}"
    ]  # once per reason


def test_a_batch_a_padded_mask_a_logits_processor_or_a_caller_cache_go_to_transformers(spy):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    model = _model()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        model.generate(torch.cat([PROMPT, PROMPT]), max_new_tokens=2, do_sample=False)
        assert model.mpsconvert_generate_path == "transformers: batch 2"
        mask = torch.ones_like(PROMPT)
        mask[0, 0] = 0
        model.generate(PROMPT, attention_mask=mask, max_new_tokens=2, do_sample=False)
        assert model.mpsconvert_generate_path.endswith("the attention mask is not all ones")
        model.generate(PROMPT, max_new_tokens=2, logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)]))
        assert model.mpsconvert_generate_path.endswith("generate() was given logits_processor")
        model.generate(PROMPT, max_new_tokens=2, cache_implementation="dynamic")
        assert model.mpsconvert_generate_path == "transformers: the caller chose the cache"
    assert spy == [None, "static", "static", "dynamic"]


def test_off_cuda_and_with_compile_off_generate_is_transformers_own():
    cpu_model = models.tiny_model("llama", vocab=256, dtype=torch.bfloat16)
    cpu = patches.apply(cpu_model, patches.Context(torch.device("cpu"), torch.bfloat16), "forwards")
    assert (
        cpu["generate"].skipped.startswith("mpsconvert's engine takes generate() on CUDA only")
        and "generate" not in cpu_model.__dict__
    )
    off = patches.apply(
        models.tiny_model("llama", vocab=256),
        patches.Context(torch.device("cuda"), torch.bfloat16, {"compile": False}),
        "forwards",
    )
    assert off["generate"].skipped == "turned off (compile=False)"


def test_sampling_top_k_then_top_p_reads_the_renormalised_distribution():
    """probabilities 0.5 / 0.3 / 0.2: top-k 2 leaves 0.625 / 0.375, so top-p 0.6 keeps the first
    only (read before renormalising, 0.5 < 0.6 would keep the second too)."""
    from mpsconvert.runtime.engine import Draws, Sampling
    from mpsconvert.runtime.engine.sampling import choose

    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    draws = Draws(0)
    assert {int(choose(logits, Sampling(temp=1.0, top_k=2, top_p=0.6), draws)) for _ in range(200)} == {0}
    assert {int(choose(logits, Sampling(temp=1.0, top_k=2), draws)) for _ in range(200)} == {0, 1}
    with pytest.raises(Exception, match="`top_k` must be >= 0"):
        Sampling(top_k=-1)
