"""Which tensors are quantized: decided from the model definition, not from names."""

import json
import shutil

import pytest

from mpsconvert.errors import SourceError
from mpsconvert.model.plan import matches, plan_for

from . import models


def test_llama_plan_from_meta_model(tiny_models):
    plan = plan_for(tiny_models["llama"])
    assert len(plan.quantize) == 14 and plan.quantize["model.layers.0.mlp.down_proj"] == (64, 128)
    assert list(plan.ignored) == ["lm_head"] and "output embedding" in plan.ignored["lm_head"]
    assert "model.embed_tokens" in plan.skipped


def test_ignore_patterns_glob_regex_and_suffix(tiny_models):
    plan = plan_for(
        tiny_models["llama"], ignore=["*.layers.0.*", "re:layers\\.1\\.self_attn\\.(q|k)_proj$", "mlp.up_proj"]
    )
    assert "model.layers.0.self_attn.v_proj" in plan.ignored
    assert plan.ignored["model.layers.1.self_attn.q_proj"].startswith("--ignore re:")
    assert "model.layers.1.mlp.up_proj" in plan.ignored and "model.layers.1.mlp.gate_proj" in plan.quantize
    assert sorted(plan.quantize) == [
        "model.layers.1.mlp.down_proj",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.self_attn.o_proj",
        "model.layers.1.self_attn.v_proj",
    ]


def test_matches_is_not_a_substring_match():
    assert matches("model.layers.0.mlp.gate", ["mlp.gate"]) == "mlp.gate"
    assert matches("model.layers.0.mlp.gate_proj", ["mlp.gate"]) is None


def test_moe_router_is_found_by_role(tmp_path):
    models.tiny("mixtral", tmp_path / "mx", vocab=128, layers=1, intermediate_size=64)
    plan = plan_for(tmp_path / "mx")
    # transformers 5 makes the router its own module type (not nn.Linear): reported, never quantized
    routers = [m for m, why in {**plan.ignored, **plan.skipped}.items() if why.startswith("MoE router")]
    assert routers == ["model.layers.0.mlp.gate"]
    assert not any("gate" in m and "proj" not in m for m in plan.quantize)


def test_remote_code_architecture_needs_explicit_trust(tmp_path, tiny_models):
    d = tmp_path / "remote"
    shutil.copytree(tiny_models["llama"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="my_secret_arch", auto_map={"AutoConfig": "modeling_x.MyConfig"}, architectures=["MyModel"])
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "modeling_x.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(SourceError, match="`trust_remote_code`"):
        plan_for(d)


def test_config_without_architectures_still_keeps_lm_head(tmp_path, tiny_models):
    d = tmp_path / "noarch"
    shutil.copytree(tiny_models["llama"], d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["architectures"]
    (d / "config.json").write_text(json.dumps(cfg))
    plan = plan_for(d)
    assert "lm_head" in plan.ignored and len(plan.quantize) == 14
