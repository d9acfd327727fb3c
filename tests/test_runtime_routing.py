"""The MoE routing kernel (runtime/patches/routing.py), interpreted on CPU: installed on the softmax
top-k routers of Mixtral (weights renormalized, float32), Qwen2-MoE and Qwen3-MoE (each as its
config says, cast to BF16), giving their own forward's logits, experts and weights; whole models
decode the same tokens; a router of other arithmetic keeps its own forward."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.triton


@pytest.mark.triton("interpret")
def test_routers_match_their_own_forward_and_models_decode_alike():
    import copy

    import torch
    from transformers import DynamicCache

    from mpsconvert.runtime.ops.triton import routing_kernel as K
    from mpsconvert.runtime.patches import forwards
    from mpsconvert.runtime.patches import routing as R
    from tests.models import tiny_moe_model

    g = torch.Generator().manual_seed(0)
    calls = []
    launch = K._launch
    K._launch = lambda *a: calls.append(a[0].shape[0]) or launch(*a)
    for arch, kw, want in [
        ("mixtral", {}, (True, torch.float32)),
        ("qwen2_moe", {}, None),
        ("qwen3_moe", {"num_experts": 12}, None),
    ]:
        ref = tiny_moe_model(arch, **kw)
        ours = copy.deepcopy(ref)
        routers = [m for m in ours.modules() if type(m).__name__.endswith("TopKRouter")]
        if arch != "mixtral":
            for m in routers:  # one layer renormalizes, the other does not: each finds its own variant
                m.norm_topk_prob = m is routers[0]
        report = R.install(ours)
        assert report == {"routers": len(routers), "left": []}, report
        for m in routers:
            assert forwards.installed(m, R._router_forward)
            variant = m.mpsconvert_route
            if want is not None:
                assert variant == want, variant
            else:
                assert variant == (m.norm_topk_prob, torch.bfloat16), (variant, m.norm_topk_prob)
            x = torch.randn(3, m.weight.shape[1], generator=g).to(torch.bfloat16)
            got, own = m(x), forwards.own_forward(m)(m, x)
            assert torch.equal(got[2], own[2]), (got[2], own[2])
            assert torch.allclose(got[1].float(), own[1].float(), rtol=1e-2, atol=1e-5)
            assert got[1].dtype == own[1].dtype and got[0].dtype == own[0].dtype
            if want is not None:  # renormalized float32 weights sum to one
                assert torch.allclose(got[1].sum(-1), torch.ones(3))
            big = torch.randn(R.MAX_TOKENS + 1, m.weight.shape[1]).to(torch.bfloat16)
            n = len(calls)
            assert all(
                torch.equal(a, b) for a, b in zip(m(big), forwards.own_forward(m)(m, big))
            )  # prefill: its own forward
            assert len(calls) == n
        if arch == "mixtral":  # under torch.compile: the custom op, opaque to dynamo, with its fake
            x = torch.randn(2, routers[0].weight.shape[1], generator=g).to(torch.bfloat16)
            n = len(calls)
            with torch.no_grad():
                compiled = torch.compile(routers[0], fullgraph=True)(x)
                assert len(calls) > n and all(torch.equal(a, b) for a, b in zip(compiled, routers[0](x)))
        ids = torch.randint(0, 128, (1, R.MAX_TOKENS + 4), generator=g)  # a prefill longer than the kernel takes
        # whole models in float32 (BF16 logits an ulp apart can swap two near-tied experts): five
        # decode steps of both fed ref's tokens give the same logits up to float32 rounding
        ref, ours = ref.float(), copy.deepcopy(ref).float()
        assert R.install(ours)["routers"] == len(routers)
        n = len(calls)
        with torch.no_grad():
            toks = ref.generate(ids, max_new_tokens=6, do_sample=False)
            caches = [DynamicCache(config=m.config) for m in (ref, ours)]
            outs = [m(ids, past_key_values=c, use_cache=True).logits for m, c in zip((ref, ours), caches)]
            for i in range(ids.shape[1], toks.shape[1] - 1):
                outs = [
                    m(toks[:, i : i + 1], past_key_values=c, use_cache=True).logits for m, c in zip((ref, ours), caches)
                ]
                err = (outs[0] - outs[1]).abs().max() / outs[0].abs().max()
                assert err < 1e-4, (arch, i, err)
        assert len(calls) - n == 5 * len(routers), len(calls) - n  # the five decode steps, not the prefill


@pytest.mark.triton("interpret")
def test_router_of_other_arithmetic_keeps_its_own_forward():
    import torch
    from torch import nn

    from mpsconvert.runtime.patches import forwards
    from mpsconvert.runtime.patches import routing as R

    class SigmoidRouter(nn.Module):  # sigmoid scores, as DeepSeek's: not a softmax top-k
        def __init__(self):
            super().__init__()
            self.top_k = 2
            self.weight = nn.Parameter(torch.randn(8, 32).to(torch.bfloat16))

        def forward(self, x):
            logits = nn.functional.linear(x, self.weight)
            v, i = torch.topk(logits.float().sigmoid(), self.top_k, dim=-1)
            return logits, v, i

    m = nn.Sequential(SigmoidRouter())
    report = R.install(m)
    assert report["routers"] == 0 and "0: its weights differ" in report["left"], report
    assert not forwards.installed(m[0])
