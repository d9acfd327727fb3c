"""Helpers the test modules share (a test module never imports from another one). What a test
builds from scratch lives in models.py (the tiny models, the artifacts quantized from them);
what it checks with, here."""

from __future__ import annotations

import torch
from torch import nn


def fp8_model(cls, cfg, act: str = "token"):
    """A tiny transformers model with every decoder Linear an FP8Linear on the row-wise scaled_mm
    kernels and sibling groups sharing their input: the eager path a CUDA load runs (for the
    tests that run it with Triton interpreted on CPU)."""
    from mpsconvert import fp8
    from mpsconvert.runtime import fuse
    from mpsconvert.runtime.fp8linear import FP8Linear

    torch.manual_seed(0)
    model = cls(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    for name, lin in list(model.model.layers.named_modules()):
        if isinstance(lin, nn.Linear):
            q, s, _ = fp8.quantize(lin.weight.float(), "row")
            new = FP8Linear.from_tensors(q, s, activations=act, input_scale=torch.tensor([0.02]) if act == "tensor" else None,
                                         bias=lin.bias)
            new.set_kernels("scaled_mm_row", "scaled_mm_row")
            parent, _, leaf = name.rpartition(".")
            setattr(model.model.layers.get_submodule(parent), leaf, new)
    for g in fuse.share_inputs(model):
        g.inner.set_kernels("scaled_mm_row", "scaled_mm_row")
    return model


def logits(model, ids) -> torch.Tensor:
    """A causal LM's float32 logits for `ids` [batch, tokens], without grad."""
    with torch.no_grad():
        return model(ids).logits.float()
