"""The decode attention kernel (runtime/patches/attention.py), interpreted on CPU: against SDPA for
grouped heads, several queries, batches, masks of each form and tiles the mask skips, with the
cache in one chunk per head and in several (combined by the last program of each head); its
counters back at zero after every call; and inside a transformers model, where prefill must stay
SDPA's bit for bit and decode must give SDPA's tokens with static and dynamic caches. The
interpreter runs programs one after another: the order in which concurrent programs finish is
not exercised here."""

from __future__ import annotations

import pytest

from mpsconvert.runtime.patches import attention
from mpsconvert.runtime.ops import triton as tritonlib


def _ref(q, k, v, mask):
    """SDPA in float32 with every key/value head repeated for its query group: [B, Lq, Hq, D]."""
    import torch.nn.functional as F
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1),
                                          attn_mask=mask).transpose(1, 2)


def _qkv(g, B, Hq, Hkv, Lq, Lk, hd):
    import torch
    q = torch.randn(B, Lq, Hq, hd, generator=g).to(torch.bfloat16).transpose(1, 2)  # strided, as the model passes it
    k = torch.randn(B, Hkv, Lk, hd, generator=g).to(torch.bfloat16)
    v = torch.randn(B, Hkv, Lk, hd, generator=g).to(torch.bfloat16)
    return q, k, v


@pytest.mark.triton("interpret")
def test_decode_kernel_matches_sdpa(monkeypatch):
    import torch
    from mpsconvert.runtime.ops.triton import attention as A
    g = torch.Generator().manual_seed(0)
    splits = set()
    # (batch, q heads, kv heads, queries, cached positions, valid positions, left padding of the last sequence, head dim);
    # the interpreter's 8 "SMs" split these into 1, 3, 4, 5, 4 and 3 chunks per head; a valid length of 70 of 200 leaves
    # the last two chunks (of 64) masked whole, the padding of 130 the first two of the last sequence
    for B, Hq, Hkv, Lq, Lk, valid, pad, hd in [(1, 8, 2, 1, 37, 30, 3, 64), (2, 4, 4, 2, 130, 125, 3, 32),
                                               (1, 6, 2, 3, 200, 70, 3, 80), (1, 4, 1, 4, 300, 300, 3, 16),
                                               (3, 16, 2, 4, 400, 380, 130, 128), (2, 2, 2, 1, 150, 150, 3, 64)]:
        q, k, v = _qkv(g, B, Hq, Hkv, Lq, Lk, hd)
        splits.add(A._splits(B, Hkv, Lk, q.device)[0])
        causal = torch.zeros(B, 1, Lq, Lk, dtype=torch.bool)
        for i in range(Lq):
            causal[:, :, i, : valid - Lq + 1 + i] = True
        causal[-1, :, :, :pad] = False  # left padding of one sequence
        per_head = causal.expand(B, Hq, Lq, Lk).clone()
        per_head[:, 0, :, 5:9] = False
        for mask in (causal, per_head, None):
            out = A.decode_attention(q, k, v, mask)
            assert out.shape == (B, Lq, Hq, hd) and out.dtype == torch.bfloat16
            err = (out.float() - _ref(q, k, v, mask)).abs().max().item()
            assert err < 2e-2, (B, Hq, Hkv, Lq, Lk, hd, mask is None, err)
    assert {1, 3, 4, 5} <= splits, splits  # one program per head (writes its output itself) and several (combined)
    # many chunks per head, combined a few at a time (a last step of fewer): the last program's loop over them
    monkeypatch.setattr(A, "_sms", lambda device: 64)
    q, k, v = (torch.randn(1, 4, n, 32, generator=g).to(torch.bfloat16) for n in (1, 400, 400))
    k, v = k[:, :2], v[:, :2]
    for tile in (A._COMBINE_TILE, 2 * 32 * 2):  # all 7 chunks in one step; 2 a step (4 steps, the last half empty)
        monkeypatch.setattr(A, "_COMBINE_TILE", tile)
        assert A._splits(1, 2, 400, q.device)[0] == 7
        assert (A.decode_attention(q, k, v).float() - _ref(q, k, v, None)).abs().max() < 2e-2


@pytest.mark.triton("interpret")
def test_decode_kernel_leaves_its_counters_at_zero(monkeypatch):
    """The invariant CUDA-graph replays rely on: the last program of each (sequence, kv head) resets
    its counter, so the buffer, made once, is all zeros after every call and a call repeated gives
    the same output; a buffer that grows keeps the old one (a captured graph may hold its address)."""
    import torch
    from mpsconvert.runtime.ops.triton import attention as A
    monkeypatch.setattr(A, "_COUNTERS", {})
    g = torch.Generator().manual_seed(1)
    q, k, v = _qkv(g, 2, 8, 2, 1, 300, 64)
    mask = torch.ones(2, 1, 1, 300, dtype=torch.bool)
    mask[0, :, :, 250:] = False
    assert A._splits(2, 2, 300, q.device)[0] > 1
    first = A.decode_attention(q, k, v, mask)
    (buf,) = A._COUNTERS[q.device]
    assert buf.dtype == torch.int32 and buf.numel() >= A._MIN_COUNTERS and not buf.any()
    again = A.decode_attention(q, k, v, mask)
    assert torch.equal(first, again) and A._COUNTERS[q.device] == [buf] and not buf.any()
    assert (first.float() - _ref(q, k, v, mask)).abs().max() < 2e-2
    monkeypatch.setattr(A, "_MIN_COUNTERS", 2)
    monkeypatch.setattr(A, "_COUNTERS", {})
    small = A._counters(q.device, 2)
    big = A._counters(q.device, 3)
    assert big.numel() == 4 and A._COUNTERS[q.device] == [small, big] and A._counters(q.device, 4) is big
    q, k, v = _qkv(g, 3, 4, 1, 2, 200, 32)  # 3 groups: the grown buffer
    assert (A.decode_attention(q, k, v).float() - _ref(q, k, v, None)).abs().max() < 2e-2
    assert not big.any() and not small.any()


@pytest.mark.triton("interpret")
def test_model_decodes_like_sdpa_and_prefills_as_sdpa(monkeypatch):
    import copy, torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache
    from mpsconvert.runtime.patches import attention as A
    from mpsconvert.runtime.ops.triton import attention as K
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attn_implementation="sdpa")
    ref = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ours = copy.deepcopy(ref)
    assert A.install(ours) == A.NAME and ours.config._attn_implementation == A.NAME
    assert ref.config._attn_implementation == "sdpa"
    calls = []
    launch = K._launch
    monkeypatch.setattr(K, "_launch", lambda *a: calls.append(a[0].shape) or launch(*a))
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)  # prefill: SDPA itself
        assert not calls
        for make in (lambda m: StaticCache(config=m.config, max_cache_len=80), lambda m: DynamicCache(config=m.config)):
            outs = []
            for m in (ref, ours):
                cache = make(m)
                out = m(ids, past_key_values=cache, use_cache=True)
                tok, logits = out.logits[:, -1:].argmax(-1), []
                for _ in range(6):
                    out = m(tok, past_key_values=cache, use_cache=True)
                    logits.append(out.logits[0, -1].float())
                    tok = out.logits[:, -1:].argmax(-1)
                outs.append(torch.stack(logits))
            assert (outs[0] - outs[1]).abs().max() < 5e-2, (outs[0] - outs[1]).abs().max()
            assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))
    assert len(calls) == 2 * 2 * 6, len(calls)  # both caches, two layers, six steps: every decode step ran the kernel


def test_not_installed_where_it_cannot_run(tmp_path):
    """On a CPU without the interpreter nothing is switched, and load says nothing of attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    if tritonlib.available():
        pytest.skip("this machine can run the kernel")
    assert attention.install(model) is None and model.config._attn_implementation == "sdpa"
    import torch

    q = torch.zeros(1, 2, 1, 16, dtype=torch.bfloat16)
    assert not attention.takes(q, torch.zeros(1, 1, 8, 16, dtype=torch.bfloat16), None, 0.0)
