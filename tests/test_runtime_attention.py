"""The decode attention kernel (runtime/patches/attention.py), interpreted on CPU: against SDPA for
grouped heads, several queries, masks of each form and tiles the mask skips; and inside a
transformers model, where prefill must stay SDPA's bit for bit and decode must give SDPA's
tokens with static and dynamic caches."""

from __future__ import annotations

import pytest

from mpsconvert.runtime.ops import triton as tritonlib
from mpsconvert.runtime.patches import attention


@pytest.mark.triton("interpret")
def test_decode_kernel_matches_sdpa():
    import torch
    import torch.nn.functional as F

    from mpsconvert.runtime.ops.triton import attention_kernel as A

    g = torch.Generator().manual_seed(0)

    def ref(q, k, v, mask):
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            q.float(), k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1), attn_mask=mask
        ).transpose(1, 2)

    # (batch, q heads, kv heads, queries, cached positions, valid positions, head dim)
    for B, Hq, Hkv, Lq, Lk, valid, hd in [
        (1, 8, 2, 1, 37, 30, 64),
        (2, 4, 4, 2, 130, 125, 32),
        (1, 6, 2, 3, 200, 70, 80),
        (1, 4, 1, 4, 300, 300, 16),
    ]:
        q = (
            torch.randn(B, Lq, Hq, hd, generator=g).to(torch.bfloat16).transpose(1, 2)
        )  # strided, as the model passes it
        k = torch.randn(B, Hkv, Lk, hd, generator=g).to(torch.bfloat16)
        v = torch.randn(B, Hkv, Lk, hd, generator=g).to(torch.bfloat16)
        causal = torch.zeros(B, 1, Lq, Lk, dtype=torch.bool)
        for i in range(Lq):
            causal[:, :, i, : valid - Lq + 1 + i] = True
        causal[-1, :, :, :3] = False  # left padding of one sequence
        per_head = causal.expand(B, Hq, Lq, Lk).clone()
        per_head[:, 0, :, 5:9] = False
        for mask in (causal, per_head, None):
            out = A.decode_attention(q, k, v, mask)
            assert out.shape == (B, Lq, Hq, hd) and out.dtype == torch.bfloat16
            err = (out.float() - ref(q, k, v, mask)).abs().max().item()
            assert err < 2e-2, (B, Hq, Hkv, Lq, Lk, hd, mask is None, err)
    # several chunks per head: the combine kernel rescales their partial softmaxes
    A._sms = lambda device: 64
    q, k, v = (torch.randn(1, 4, n, 32, generator=g).to(torch.bfloat16) for n in (1, 500, 500))
    k, v = k[:, :2], v[:, :2]
    assert (A.decode_attention(q, k, v).float() - ref(q, k, v, None)).abs().max() < 2e-2


@pytest.mark.triton("interpret")
def test_model_decodes_like_sdpa_and_prefills_as_sdpa():
    import copy

    import torch
    from transformers import DynamicCache, StaticCache

    from mpsconvert.runtime.patches import attention as A

    from .models import tiny_model

    ref = tiny_model("llama", vocab=128, dtype=torch.bfloat16, attn_implementation="sdpa")
    ours = copy.deepcopy(ref)
    assert A.install(ours) == A.NAME and ours.config._attn_implementation == A.NAME
    assert ref.config._attn_implementation == "sdpa"
    calls = []
    launch = A.decode_attention  # eager: the kernel itself
    A.decode_attention = lambda *a: calls.append(a[0].shape) or launch(*a)
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
    from .models import tiny_model

    model = tiny_model(
        "llama", vocab=64, layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1
    )
    if tritonlib.available():
        pytest.skip("this machine can run the kernel")
    assert attention.install(model) is None and model.config._attn_implementation == "sdpa"
    import torch

    q = torch.zeros(1, 2, 1, 16, dtype=torch.bfloat16)
    assert not attention.takes(q, torch.zeros(1, 1, 8, 16, dtype=torch.bfloat16), None, 0.0)
