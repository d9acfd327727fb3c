"""Helpers the test modules share (a test module never imports from another one). What a test
builds from scratch lives in models.py (the tiny models, the artifacts quantized from them);
what it checks with, here."""

from __future__ import annotations

import torch
from click.testing import CliRunner
from torch import nn

COREAI_ASSET, COREML_PACKAGE = "model.aimodel", "model.mlpackage"  # the Apple targets' package names (apple/)
# a chat template for the tiny tokenizers (the conftest's `chat_llama` has it)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def cli(*args, **kw):
    """The `mpsconvert` command line in this process (click's runner); arguments made strings."""
    from mpsconvert.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], **kw)


def one_line_error(res, *says) -> None:
    """Exit 2 with one `error:` line that says each of `says`, and no traceback."""
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert "Traceback" not in res.output and len(lines) == 1 and lines[0].startswith("error:"), res.output
    for s in says:
        assert s in res.output, res.output


def one_error(res, *says) -> None:
    """Exit 2 with `error:` once in the output, which says each of `says`, and no traceback (other
    lines, a warning or a progress line, may come with it)."""
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and res.output.count("error:") == 1, res.output
    for s in says:
        assert s in res.output, res.output


def run_generate(art, *extra):
    """`mpsconvert generate ART "Hello there"` on the CPU, 3 tokens, through the CLI."""
    from mpsconvert.cli import main

    return CliRunner().invoke(
        main, [str(a) for a in ("generate", art, "Hello there", "--device", "cpu", "--max-tokens", "3", *extra)]
    )


def fp8_model(cls, cfg, act: str = "token"):
    """A tiny transformers model with every decoder Linear an FP8Linear on the row-wise scaled_mm
    kernels and sibling groups sharing their input: the eager path a CUDA load runs (for the
    tests that run it with Triton interpreted on CPU)."""
    from mpsconvert.format import fp8
    from mpsconvert.runtime.ops import fuse
    from mpsconvert.runtime.ops.fp8linear import FP8Linear

    torch.manual_seed(0)
    model = cls(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    for name, lin in list(model.model.layers.named_modules()):
        if isinstance(lin, nn.Linear):
            q, s, _ = fp8.quantize(lin.weight.float(), "row")
            new = FP8Linear.from_tensors(
                q, s, activations=act, input_scale=torch.tensor([0.02]) if act == "tensor" else None, bias=lin.bias
            )
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


def prefilled(engine, prompt: list[int], capacity: int = 32):
    """`engine` (runtime.engine.Engine) with a cache for `capacity` positions, reset, after a prefill
    of `prompt`: where a test's decode steps start."""
    engine.reserve(capacity)
    engine.reset()
    engine.prefill(prompt)
    return engine
