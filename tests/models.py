"""Builders for tiny random models used by the tests (each engineer adds functions with distinct names)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def tiny_moe_config(arch: str, num_experts: int = 4, layers: int = 2):
    """A tiny random MoE config of a transformers 5 architecture (hidden sizes multiples of 16)."""
    import transformers

    common = dict(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=128, num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
    if arch == "mixtral":
        return transformers.MixtralConfig(intermediate_size=96, num_local_experts=num_experts, **common)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                           num_experts=num_experts, decoder_sparse_step=1, **common)  # fmt: skip
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=num_experts,
                                           decoder_sparse_step=1, **common)  # fmt: skip
    if arch == "olmoe":
        return transformers.OlmoeConfig(intermediate_size=32, num_experts=num_experts, eos_token_id=1, pad_token_id=0, **common)
    raise ValueError(arch)


def tiny_moe_model(arch: str, seed: int = 0, **kw):
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(arch, **kw)).to(torch.bfloat16).eval()
    with torch.no_grad():  # random init is ~N(0, 0.02): widen it so FP8 error is visible in the logits
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.08)
    return model


def tiny_moe_checkpoint(folder: Path, arch: str, fused: bool = False, seed: int = 0, **kw) -> Path:
    """Save a tiny MoE model: `save_pretrained` (one 2-D tensor per expert, the hub layout) or,
    with `fused=True`, the model's own state dict (3-D `experts.gate_up_proj` / `down_proj`)."""
    from safetensors.torch import save_file

    model = tiny_moe_model(arch, seed, **kw)
    folder = Path(folder)
    if not fused:
        model.save_pretrained(folder)
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it
    model.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    json.loads((folder / "config.json").read_text())  # written and readable
    return folder
