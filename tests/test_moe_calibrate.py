"""Per-expert static input scales from the router's assignments, with a never-routed expert."""

from __future__ import annotations

import math

import pytest
import torch

from mpsconvert.calibrate.expert_scales import ExpertObserver
from mpsconvert.convert.quantize import quantize_snapshot
from mpsconvert.convert.quantize_options import Options
from mpsconvert.format.schemes import Scheme
from mpsconvert.runtime.ops.expert_loading import load_fp8_experts
from mpsconvert.source.snapshot import resolve

from .models import tiny, tiny_moe_model

NEVER = 3


def _never_route(model, expert=NEVER):
    """Bias every router so `expert` never gets a token (its logit is pushed to -1e9)."""

    def hook(mod, args, out):
        logits, _, _ = out
        logits = logits.clone()
        logits[:, expert] = -1e9
        p = logits.float().softmax(-1)
        v, i = p.topk(mod.top_k, dim=-1)
        return logits, (v / v.sum(-1, keepdim=True)).to(out[1].dtype), i

    return [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_never_routed_expert_gets_a_valid_scale(arch):
    model = tiny_moe_model(arch)
    _never_route(model)
    seen = {}
    # what each expert really receives, straight from the experts' inputs
    handles = [
        layer.mlp.experts.register_forward_pre_hook(lambda m, a, i=i: seen.setdefault(i, []).append((a[0], a[1])))
        for i, layer in enumerate(model.model.layers)
    ]
    obs = ExpertObserver(model)
    with obs, torch.no_grad():
        model(torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(0)))
    for h in handles:
        h.remove()
    with pytest.warns(UserWarning, match=r"never routed.*\[3\]"):
        sc = obs.scales()
    for i in range(2):
        name = f"model.layers.{i}.mlp.experts"
        assert sc.fallbacks[name] == [NEVER] and sc.tokens[name][NEVER] == 0
        assert sum(sc.tokens[name]) == 3 * 40 * 2
        gu, dn = sc.input_scales[f"{name}.gate_up_proj"], sc.input_scales[f"{name}.down_proj"]
        assert all(math.isfinite(v) and v > 1e-8 for v in gu + dn)
        x = torch.cat([a for a, _ in seen[i]])
        idx = torch.cat([b for _, b in seen[i]])
        for e in range(4):
            if e == NEVER:  # fallback: the layer-wide amax, as wide as any expert's
                assert gu[e] == pytest.approx(float(x.abs().max()) / 448, rel=1e-3)
                assert gu[e] >= max(gu[j] for j in range(4) if j != NEVER) * (1 - 1e-6)
            else:  # observed: exactly the amax of the tokens routed to it
                rows = (idx == e).any(-1)
                assert gu[e] == pytest.approx(float(x[rows].abs().max()) / 448, rel=1e-3)
                mod = model.model.layers[i].mlp.experts
                with torch.no_grad():
                    g, u = torch.nn.functional.linear(x[rows], mod.gate_up_proj[e]).chunk(2, -1)
                assert dn[e] == pytest.approx(float((mod.act_fn(g) * u).abs().max()) / 448, rel=2e-2)


def test_static_artifact_from_expert_calibration(tmp_path):
    """Calibrate -> quantize --scheme fp8 -> load: every expert (the never-routed one too)
    has a positive finite input scale, and the static FP8 model tracks BF16."""
    src = tiny("qwen3_moe", tmp_path / "src", dtype=torch.bfloat16, widen=0.08, vocab=128, layers=1)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).eval()
    _never_route(model)
    amax = {}
    lin = [
        (
            n,
            m.register_forward_pre_hook(
                lambda m, a, n=n: amax.__setitem__(n, max(amax.get(n, 0.0), float(a[0].abs().max())))
            ),
        )
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.endswith("_proj")
    ]
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    obs = ExpertObserver(model)
    with obs, torch.no_grad():
        bf16 = model(ids).logits.float()
    for _, h in lin:
        h.remove()
    with pytest.warns(UserWarning):
        sc = obs.scales()
    scales = {n: a / 448 for n, a in amax.items()} | sc.input_scales
    man = quantize_snapshot(
        resolve(str(src)),
        tmp_path / "fp8",
        Options(scheme=Scheme.make("fp8"), input_scales=scales, calibration=sc.as_dict()),
    )
    assert man.recipe["calibration"]["never_routed"] == {"model.layers.0.mlp.experts": [NEVER]}
    rec = man.tensors[f"model.layers.0.mlp.experts.{NEVER}.down_proj.weight"]
    assert math.isfinite(rec["input_scale"]) and rec["input_scale"] > 0
    fresh = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).eval()
    report = load_fp8_experts(fresh, tmp_path / "fp8", "cpu")
    assert report.activations == "tensor"
    assert bool(torch.isfinite(fresh.model.layers[0].mlp.experts.down_input_scale).all())
    _never_route(fresh)
    with torch.no_grad():
        ours = fresh(ids).logits.float()
    assert (ours - bf16).abs().max() <= 0.12 * bf16.abs().max()
