"""runtime/patches/positions.py on CPU: a call without positions and cache gets the model's own as a view of
a buffer, the rotary module then reads its tables and transformers' packed-sequence check answers
without the device; outputs equal the model's own forward bit for bit, every other call runs the
model's own code, and what cannot be known stays with the model."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers.masking_utils as masking

from mpsconvert.runtime.patches import forwards
from mpsconvert.runtime.patches import positions as P

from .models import tiny_model, tiny_moe_model


def _llama(**kw):
    return tiny_model("llama", max_positions=64, **kw)


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3_moe"])
def test_own_positions_give_the_models_own_outputs(arch):
    ref = _llama() if arch == "llama" else tiny_moe_model(arch)
    ours = copy.deepcopy(ref)
    report = P.install(ours)
    assert report["installed"], report
    base, rot = ours.base_model, ours.base_model.rotary_emb
    assert forwards.installed(base, P._model_forward) and forwards.installed(rot, P._rotary_forward)
    assert isinstance(masking.find_packed_sequence_indices, P.Dispatch)
    outs = []
    rot.register_forward_hook(lambda m, a, out: outs.append(out))
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(11)[None]
    with torch.no_grad():
        want = ref(ids, use_cache=False).logits
        skipped = masking.find_packed_sequence_indices.skipped
        assert torch.equal(ours(ids, use_cache=False).logits, want)
        # answered here (batch 2: transformers expands the positions, a view of the buffer still), tables read
        assert masking.find_packed_sequence_indices.skipped == skipped + 1
        assert outs[-1][0].data_ptr() == rot.mpsconvert_tables[0].data_ptr()
        assert torch.equal(
            ours(ids).logits, ref(ids).logits
        )  # a cache made inside (use_cache): own positions, no check
        assert outs[-1][0].data_ptr() == rot.mpsconvert_tables[0].data_ptr()
        # positions given by the caller: the model's own code throughout, the original check
        assert torch.equal(ours(ids, position_ids=pos, use_cache=False).logits, want)
        assert masking.find_packed_sequence_indices.skipped == skipped + 1
        assert outs[-1][0].data_ptr() != rot.mpsconvert_tables[0].data_ptr()
        # a prefill and eager decode steps over a DynamicCache: positions after what it holds, tables read
        from transformers import DynamicCache

        from mpsconvert.model.hf_compat import cache_kwarg

        mine, theirs = (
            cache_kwarg(ours, DynamicCache(config=ours.config)),
            cache_kwarg(ref, DynamicCache(config=ref.config)),
        )
        steps = [ids[:, :9]] + [ids[:, i : i + 1] for i in range(9, 11)]
        for i, part in enumerate(steps):
            got, want_step = ours(part, **mine).logits, ref(part, **theirs).logits
            assert torch.equal(got, want_step), i
            held = 0 if i == 0 else 8 + i
            assert outs[-1][0].data_ptr() == rot.mpsconvert_tables[0][:, held:].data_ptr(), i
        if arch == "llama":  # longer than the tables (max_position_embeddings 64): the model's own code
            long = torch.randint(0, 100, (1, 70), generator=torch.Generator().manual_seed(2))
            assert torch.equal(ours(long, use_cache=False).logits, ref(long, use_cache=False).logits)
            assert masking.find_packed_sequence_indices.skipped == skipped + 1


def test_start_is_read_from_views_of_the_unwritten_buffer_only():
    buf = torch.arange(8)[None].clone()
    buf.mpsconvert_positions = buf._version
    assert P.start(buf[:, :5]) == 0 and P.start(buf[:, :5].expand(3, -1)) == 0 and P.start(buf[:, :8]) == 0
    assert P.start(buf[:, 3:5]) == 3 and P.start(buf[:, 7:8]) == 7
    for other in (buf[:, ::2], buf[:, :5].clone(), torch.arange(5)[None], buf[:, :5].t(), buf[0, :5]):
        assert P.start(other) is None
    buf[0, 0] = 3  # written: its views no longer say P .. P+S-1
    assert P.start(buf[:, 2:5]) is None


def test_packed_sequences_still_get_the_original_check():
    P.install(_llama())
    packed = torch.tensor([[0, 1, 2, 0, 1]])
    assert torch.equal(masking.find_packed_sequence_indices(packed), torch.tensor([[0, 0, 0, 1, 1]]))
    assert masking.find_packed_sequence_indices(torch.arange(5)[None]) is None  # not ours: computed, same answer


def test_length_dependent_rotary_and_models_without_one_keep_their_own():
    dynamic = _llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    report = P.install(dynamic)
    assert not report["installed"] and "dynamic" in report["left"], report
    assert not forwards.installed(dynamic.base_model)

    bert = tiny_model("bert", vocab=64, layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64)
    assert P.install(bert) == {"installed": False, "left": "no model-level rotary module"}


def test_a_model_that_fails_the_probe_keeps_its_own_forwards_and_no_tables(monkeypatch):
    model = _llama()
    monkeypatch.setattr(P, "_check_model", lambda base, caches: "its output with its own positions differs")
    assert P.install(model) == {"installed": False, "left": "its output with its own positions differs"}
    base = model.base_model
    assert not forwards.installed(base) and not forwards.installed(base.rotary_emb)
    assert not hasattr(base, "mpsconvert_positions") and not hasattr(base.rotary_emb, "mpsconvert_tables")


def test_generate_steps_take_the_models_own_positions():
    from mpsconvert.model.hf_compat import takes_cache_position
    from mpsconvert.runtime.engine import Engine

    ref = _llama()
    ours = copy.deepcopy(ref)
    assert P.install(ours)["installed"]
    assert not takes_cache_position(ours)  # transformers 5.x: positions come from the cache
    rot = ours.base_model.rotary_emb
    outs = []
    rot.register_forward_hook(lambda m, a, out: outs.append(out[0].data_ptr()))
    a, b = Engine(ours), Engine(ref)
    assert torch.equal(a.prefill([5, 6, 7, 8]), b.prefill([5, 6, 7, 8]))
    for i, tok in enumerate((9, 10)):
        assert torch.equal(a.step(tok), b.step(tok))
        assert outs[-1] == rot.mpsconvert_tables[0][:, 4 + i :].data_ptr()  # the tables, from the cache's length on
