"""The prefill's per-layer graphs (runtime/patches/prefill_graphs.py), with their recorded calls
run eagerly (no CUDA here: Triton interpreted on CPU): the same logits and cache as the direct
path (bit for bit where no row is padded), a layer's output kept by its caller unchanged by the
layers after it, the calls the graphs must not take, and a failed capture that falls back and
says so. The CUDA capture itself runs on the GPU (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.triton

SMALL = dict(vocab=128, intermediate_size=96)  # tiny_config's model with a narrower MLP and vocabulary


@pytest.fixture(autouse=True)
def _small_lengths(monkeypatch):
    """Lengths padded to 16 and graphs up to 64 tokens: the interpreter's time grows with the rows."""
    from mpsconvert.runtime.patches import prefill_graphs

    monkeypatch.setattr(prefill_graphs, "PAD", 16)
    monkeypatch.setattr(prefill_graphs, "MAX_TOKENS", 64)


def _model():
    import torch
    from transformers import LlamaForCausalLM

    from mpsconvert.runtime.patches import eager_fusion

    from .helpers import fp8_model
    from .models import tiny_config

    model = fp8_model(LlamaForCausalLM, tiny_config("llama", **SMALL, max_positions=512))
    with torch.no_grad():
        assert eager_fusion.install(model)["attention"] == 2
    return model


def _off(model):
    """The model with its graphs detached (the direct path), and a function that puts them back."""
    layers = list(model.model.layers)
    graphs = layers[0].mpsconvert_graphs
    for m in layers:
        object.__setattr__(m, "mpsconvert_graphs", None)

    def back():
        for m in layers:
            object.__setattr__(m, "mpsconvert_graphs", graphs)

    return back


@pytest.mark.triton("interpret")
def test_prefill_graphs_give_the_direct_paths_logits_and_cache_interpreted():
    import torch
    from transformers import DynamicCache

    from mpsconvert.runtime.patches import prefill_graphs

    model = _model()
    report = prefill_graphs.install(model, capture=False)
    assert report["installed"] == 2 and report["off"] is None and report["mode"] == "eager (no capture)", report
    graphs = model.model.layers[0].mpsconvert_graphs
    assert (
        prefill_graphs.of(model) is graphs is model.model.layers[1].mpsconvert_graphs
    )  # one object, found from the model
    assert list(graphs.graphs) == [prefill_graphs.PAD]  # the install check recorded the PAD-token length
    g = torch.Generator().manual_seed(1)

    def prefill_and_decode(ids):
        cache = DynamicCache(config=model.config)
        out = [model(ids, past_key_values=cache, use_cache=True).logits]
        for _ in range(2):
            out.append(model(out[-1][:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits)
        return out + [cache.layers[i].keys for i in range(2)] + [cache.layers[i].values for i in range(2)]

    def prefill(emb):
        cache = DynamicCache(config=model.config)
        out = model(inputs_embeds=emb, past_key_values=cache, use_cache=True).logits
        return [out] + [cache.layers[i].keys for i in range(2)] + [cache.layers[i].values for i in range(2)]

    with torch.no_grad():
        ids = torch.randint(0, 128, (1, prefill_graphs.PAD), generator=g)  # no padded row: a prefill, then decode steps
        before = graphs.replays
        got = prefill_and_decode(ids)
        assert graphs.replays - before == 2  # the prefill's two layers; decode steps are not prefills
        back = _off(model)
        want = prefill_and_decode(ids)
        back()
        assert all(torch.equal(a, b) for a, b in zip(got, want))

        # padded: the real rows are the direct path's rows of the prompt with zero rows appended
        # (the padded rows' own values never reach a real row: every op is per row but the causal attention)
        for n in (11, prefill_graphs.PAD + 3):
            emb = model.model.embed_tokens(torch.randint(0, 128, (1, n), generator=g))
            size = -(-n // prefill_graphs.PAD) * prefill_graphs.PAD
            got = prefill(emb)
            back = _off(model)
            want = prefill(torch.cat([emb, emb.new_zeros(1, size - n, emb.shape[-1])], dim=1))
            back()
            assert got[0].shape[1] == n and got[1].shape[2] == n
            assert torch.equal(got[0], want[0][:, :n]) and all(
                torch.equal(a, b[:, :, :n]) for a, b in zip(got[1:], want[1:])
            ), n
        assert sorted(graphs.graphs) == [prefill_graphs.PAD, 2 * prefill_graphs.PAD]

        # each layer's output, as a caller keeps it (hidden states), is its own
        emb = model.model.embed_tokens(torch.randint(0, 128, (1, 21), generator=g))
        got = model(inputs_embeds=emb, use_cache=False, output_hidden_states=True).hidden_states
        back = _off(model)
        want = model(
            inputs_embeds=torch.cat([emb, emb.new_zeros(1, 11, emb.shape[-1])], dim=1),
            use_cache=False,
            output_hidden_states=True,
        ).hidden_states
        back()
        assert len(got) == 3 and all(torch.equal(a, b[:, :21]) for a, b in zip(got, want))

        # calls the graphs do not take: batch 2, and more tokens than MAX_TOKENS (the direct path)
        before = graphs.replays
        model(torch.randint(0, 128, (2, 9), generator=g), use_cache=False)
        model(torch.randint(0, 128, (1, prefill_graphs.MAX_TOKENS + 1), generator=g), use_cache=False)
        assert graphs.replays == before


@pytest.mark.triton("interpret")
def test_a_failed_capture_turns_the_graphs_off_with_a_warning_interpreted(monkeypatch):
    import torch

    from mpsconvert.runtime.patches import PatchFallback, prefill_graphs

    model = _model()
    assert prefill_graphs.install(model, capture=False)["installed"] == 2
    graphs = model.model.layers[0].mpsconvert_graphs
    assert graphs.x.shape[1] == prefill_graphs.MAX_TOKENS
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        before = graphs.replays

        def broken(size):
            raise RuntimeError("operation not permitted when stream is capturing")

        graphs.capture = True
        monkeypatch.setattr(graphs, "_record", broken)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        ids = torch.randint(0, 128, (1, 2 * prefill_graphs.PAD - 5), generator=g)  # a length not recorded yet
        with pytest.warns(PatchFallback, match="not permitted when stream is capturing"):
            got = model(ids, use_cache=False).logits
        assert graphs.off is not None and graphs.replays == before
        back = _off(model)
        want = model(ids, use_cache=False).logits
        back()
        assert torch.equal(got, want)  # the direct path ran


@pytest.mark.triton("interpret")
def test_the_install_check_refuses_a_graph_that_differs_interpreted(monkeypatch):
    """Negative control for the install check: a recorded layer whose output is off is not installed."""
    from mpsconvert.runtime.patches import prefill_graphs

    body = prefill_graphs.Graphs._body

    def off_by_a_bit(self, layer, size):
        body(self, layer, size)
        self.x[:, :size].mul_(1.01)

    monkeypatch.setattr(prefill_graphs.Graphs, "_body", off_by_a_bit)
    model = _model()
    r = prefill_graphs.install(model, capture=False)
    assert r == {"installed": 0, "left": "its graph's output or cache differs from the direct path's"}, r
    assert all(m.mpsconvert_graphs is None for m in model.model.layers)
    assert prefill_graphs.of(model) is None  # eager_fusion's None on every layer is not a Graphs
