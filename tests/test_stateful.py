"""The stateful decoder both Apple exports share (apple/stateful.py), in PyTorch alone: a prefill
and single-token steps through its cache buffers must give what the model gives over the whole
sequence, for every tiny architecture, sliding windows included. No converter needed."""

from __future__ import annotations

import pytest
import torch

from mpsconvert.apple import compare, stateful
from mpsconvert.errors import MpsconvertError

from .models import tiny_config


def _model(arch: str, **over):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab=128, max_positions=128)
    if arch == "llama":
        cfg = tiny_config(arch, **common, intermediate_size=96)
    elif arch == "qwen2":
        cfg = tiny_config(arch, **common, intermediate_size=96, tie=True)
    elif arch == "mistral":
        cfg = tiny_config(arch, **common, intermediate_size=96, sliding_window=over.pop("sliding_window", None))
    elif arch == "qwen3_moe":  # MLP 96, experts 32 wide, 4 of them, 2 a token, head_dim 16
        cfg = tiny_config(arch, **common)
    else:
        raise ValueError(arch)
    kw = {"experts_implementation": "batched_mm"} if arch.endswith("moe") else {}
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", **kw).eval()


def _full(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits[0]


@pytest.mark.parametrize("arch,window", [("llama", None), ("qwen2", None), ("mistral", 6), ("qwen3_moe", None)])
def test_prefill_then_decode_equals_the_whole_sequence(arch, window):
    model = _model(arch, sliding_window=window) if arch == "mistral" else _model(arch)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    want = _full(model, ids)
    w = stateful.StatefulCausalLM(model, max_len=32).eval()
    with torch.no_grad():
        got = [w(ids[:, :12].int(), torch.tensor([0], dtype=torch.int32))[0]]
        for p in range(12, 20):
            got.append(w(ids[:, p : p + 1].int(), torch.tensor([p], dtype=torch.int32))[0])
    got = torch.cat(got)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # a second conversation starts from zeroed caches and gives the same again
    w.reset()
    with torch.no_grad():
        again = w(ids[:, :12].int(), torch.tensor([0], dtype=torch.int32))[0]
    torch.testing.assert_close(again, want[:12], rtol=1e-4, atol=1e-4)


def test_sliding_window_is_applied():
    """Negative control for the mask: with a window of 6, the decode must differ from a model
    that attends to everything (else the window test above proves nothing)."""
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    slid, full = _model("mistral", sliding_window=6), _model("mistral")
    assert not torch.allclose(_full(slid, ids)[-1], _full(full, ids)[-1], atol=1e-3)


def test_states_are_named_and_shaped_as_documented():
    model = _model("qwen3_moe")
    w = stateful.StatefulCausalLM(model, max_len=40)
    specs = w.states()
    assert (
        [s.name for s in specs]
        == ["key_cache_0", "value_cache_0", "key_cache_1", "value_cache_1"]
        == stateful.state_names(2)
    )
    assert all(s.shape == (1, 2, 40, 16) for s in specs)
    # the cache is written at position + arange(T) and nowhere else
    with torch.no_grad():
        w(torch.tensor([[5, 6, 7]], dtype=torch.int32), torch.tensor([4], dtype=torch.int32))
    k = w.key_cache_0[0, 0, :, 0]
    assert (k[:4] == 0).all() and (k[4:7] != 0).all() and (k[7:] == 0).all()


def test_export_keeps_t_symbolic_and_mutates_only_the_caches():
    w = stateful.StatefulCausalLM(_model("llama"), max_len=16)
    ep = stateful.export_program(w)
    assert sorted(ep.graph_signature.buffers_to_mutate.values()) == sorted(stateful.state_names(2))
    ids = torch.zeros(1, 5, dtype=torch.int32)
    out = ep.module()(ids, torch.tensor([0], dtype=torch.int32))
    assert out.shape == (1, 5, 128)


def test_max_len_defaults_and_limits():
    cfg = _model("llama").config
    assert stateful.resolve_max_len(None, cfg) == 128  # 2048 capped at max_position_embeddings
    assert stateful.resolve_max_len(64, cfg) == 64
    for bad in (1, 129):
        with pytest.raises(MpsconvertError):
            stateful.resolve_max_len(bad, cfg)
    cfg.max_position_embeddings = 4096
    assert stateful.resolve_max_len(None, cfg) == 2048


def test_fit_to_cache():
    assert compare.fit_to_cache(64, 32, 4, 2048) == (64, 32)
    p, s = compare.fit_to_cache(64, 32, 4, 64)
    assert p + s <= 64 and p >= 16 and s > 0
    p, s = compare.fit_to_cache(64, 16, 4, 128)
    assert (p, s) == (64, 16)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_the_checks_generate_and_time_through_the_runtimes_engine(arch):
    """apple/compare.py's greedy reference is the runtime's engine over the fp32 model (one
    loop): its tokens are the whole-sequence greedy continuation; a stateful runner through
    the same loop (what a package's generation runs) gives them too; and the latency the checks
    report comes from that loop's timer, every asked-for step timed."""
    from types import SimpleNamespace

    model = _model(arch)
    prompt = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(2)).numpy().astype("int32")
    tm = SimpleNamespace(model=model)
    got = compare.greedy_reference(tm, prompt, 8)
    seq = [int(t) for t in prompt]
    for _ in range(8):
        seq.append(int(_full(model, torch.tensor([seq]))[-1].argmax()))
    assert got == seq[len(prompt) :]

    w = stateful.StatefulCausalLM(model, max_len=32).eval()

    def new_conversation():
        w.reset()

        def step(ids, position):
            with torch.no_grad():
                return w(torch.from_numpy(ids), torch.tensor([position], dtype=torch.int32))[0].numpy()

        return step

    assert compare.greedy(compare.runner(new_conversation), prompt, 8) == got
    t = compare.decode_timing(compare.torch_decoder(tm), prompt, tokens=4, warmup=1, prefill_repeats=2)
    assert (t["prefill_tokens"], t["prefill_runs"], t["decode_tokens"]) == (12, 2, 4) and t["decode_tokens_per_s"] > 0
    full = compare.runner(new_conversation)
    full.max_len = 14  # a package whose cache holds 14 tokens: the prompt and two more
    with pytest.raises(MpsconvertError, match="stopped after 2 tokens"):  # said, not timed short
        compare.decode_timing(full, prompt, 4, 1)
