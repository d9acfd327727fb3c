"""The direct attention path of an eager prefill (runtime/patches/attention_prefill.py), interpreted on
CPU inside transformers models: the calls it takes give the module's own logits and cache bit for
bit, and every call it must not take (a mask, a cache that holds tokens, a hook, decode) runs the
module's forward."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.triton


@pytest.mark.triton("interpret")
def test_direct_attention_gives_the_modules_own_logits_interpreted():
    import torch
    from transformers import DynamicCache, LlamaForCausalLM, Qwen3ForCausalLM

    from mpsconvert.runtime.patches import eager_fusion, forwards

    from .helpers import fp8_model
    from .models import tiny_config

    SMALL = dict(vocab=128, intermediate_size=96)  # tiny_config's model with a narrower MLP and vocabulary

    model = fp8_model(LlamaForCausalLM, tiny_config("llama", **SMALL, attention_bias=True))
    with torch.no_grad():
        report = eager_fusion.install(model)
    assert report["layers"] == 2 and report["attention"] == 2 and report["left"] == [], report
    layers = list(model.model.layers)
    plans = [m.mpsconvert_attention for m in layers]

    def direct_calls():
        return [p.calls for p in plans]

    def both(fn):
        """fn() with the installed layers, then with the layers' own forwards (the reference), and
        how many layers took the direct path in the first."""
        before = direct_calls()
        got = fn()
        taken = [a - b for a, b in zip(direct_calls(), before)]
        for m in layers:
            forwards.uninstall(m)
        try:
            want = fn()
        finally:
            for m in layers:
                forwards.install(m, eager_fusion._layer_forward)
        return got, want, taken

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 9), generator=g)
    with torch.no_grad():
        got, want, taken = both(lambda: model(ids, use_cache=False).logits)
        assert taken == [1, 1] and torch.equal(got, want)

        emb = model.model.embed_tokens(ids)
        strided = torch.cat([emb, emb], dim=-1)[..., ::2]  # embeddings passed as a non-contiguous view
        assert not strided.is_contiguous()
        got, want, taken = both(lambda: model(inputs_embeds=strided, use_cache=False).logits)
        assert taken == [1, 1] and torch.equal(got, want)

        def generated():  # a prefill over a DynamicCache, then three decode steps
            cache = DynamicCache(config=model.config)
            out = [model(ids, past_key_values=cache, use_cache=True).logits]
            for _ in range(3):
                out.append(model(out[-1][:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits)
            return out + [cache.layers[i].keys for i in range(2)] + [cache.layers[i].values for i in range(2)]

        got, want, taken = both(generated)
        assert taken == [1, 1], taken  # the prefill only
        assert all(torch.equal(a, b) for a, b in zip(got, want))

        mask = torch.ones(2, 9, dtype=torch.long)
        mask[0, :3] = 0  # left padding: transformers passes a mask, SDPA runs without is_causal
        got, want, taken = both(lambda: model(ids, attention_mask=mask, use_cache=False).logits)
        assert taken == [0, 0] and torch.equal(got, want)

        def chunked():  # a second prefill over a cache that holds the first
            cache = DynamicCache(config=model.config)
            first = model(ids[:, :5], past_key_values=cache, use_cache=True).logits
            return first, model(ids[:, 5:], past_key_values=cache, use_cache=True).logits

        got, want, taken = both(chunked)
        assert taken == [1, 1] and all(torch.equal(a, b) for a, b in zip(got, want))  # the first chunk only

        seen = []  # a hook on a module the direct path skips: that layer runs the module's forward, and the hook
        h = layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, o: seen.append(o.shape))
        got, want, taken = both(lambda: model(ids, use_cache=False).logits)
        h.remove()
        assert taken == [0, 1] and torch.equal(got, want) and len(seen) == 2, (taken, seen)

        # the other way round: layer 0 hands layer 1's input norm only its codes, and layer 1's
        # module path computes that norm's output afresh
        h = layers[1].self_attn.q_proj.register_forward_hook(lambda m, a, o: seen.append(o.shape))
        got, want, taken = both(lambda: model(ids, use_cache=False).logits)
        h.remove()
        assert taken == [1, 0] and torch.equal(got, want) and len(seen) == 4, (taken, seen)

        model.model.layers[0].self_attn.train()  # training mode (dropout): the module's forward
        got, want, taken = both(lambda: model(ids, use_cache=False).logits)
        model.model.layers[0].self_attn.eval()
        assert taken == [0, 1] and torch.equal(got, want)

        # under torch.compile the layers' own forwards run
        before = direct_calls()
        compiled = torch.compile(model, backend="eager")(ids, use_cache=False).logits
        assert direct_calls() == before and float((compiled.float() - want.float()).norm() / want.float().norm()) < 1e-2

    # Qwen3's q/k norms: its attention keeps the module's forward, the rest of the layer is fused
    qwen = fp8_model(Qwen3ForCausalLM, tiny_config("qwen3", **SMALL))  # head_dim 16
    with torch.no_grad():
        report = eager_fusion.install(qwen)
    assert report["layers"] == 2 and report["attention"] == 0, report
    assert report["left"] == [
        f"model.layers.{i}.self_attn: it has modules the direct path does not run (k_norm, q_norm); "
        "its prefill runs the module's forward"
        for i in range(2)
    ], report

    # Mixtral: the direct attention, the MoE block called as a module on the post-attention norm's output
    from transformers import MixtralForCausalLM

    moe = fp8_model(MixtralForCausalLM, tiny_config("mixtral", **SMALL, experts=4, top_k=2))
    with torch.no_grad():
        report = eager_fusion.install(moe)
        assert report["layers"] == 2 and report["attention"] == 2 and report["left"] == [], report
        assert not any(m.mpsconvert_attention.fused_mlp for m in moe.model.layers)
        got = moe(ids, use_cache=False).logits
        for m in moe.model.layers:
            forwards.uninstall(m)
        assert torch.equal(got, moe(ids, use_cache=False).logits)
        assert [m.mpsconvert_attention.calls for m in moe.model.layers] == [3, 3]  # two install probes, then this call

    # an attention whose output differs from what the direct path computes: found by the install check
    from transformers.models.llama.modeling_llama import LlamaAttention

    class Scaled(LlamaAttention):
        def forward(self, *args, **kwargs):
            out, w = super().forward(*args, **kwargs)
            return out * 2, w

    model = fp8_model(LlamaForCausalLM, tiny_config("llama", **SMALL))
    model.model.layers[1].self_attn.__class__ = Scaled
    with torch.no_grad():
        report = eager_fusion.install(model)
    assert report["layers"] == 2 and report["attention"] == 1, report
    assert report["left"] == [
        "model.layers.1.self_attn: the fused residual adds differ from its own forward; its prefill runs "
        "the module's forward"
    ], report
    assert model.model.layers[1].mpsconvert_attention is None and forwards.installed(model.model.layers[1])
