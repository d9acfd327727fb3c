"""The plan guessed from tensor names, so that writing starts while the real plan is built.

Why: the plan is read from the model's own definition (plan.py), and building it means importing
transformers' modeling code: 3 s on a 2-core VM, 12 s on the 16-core H100 host, as long as
writing a whole 16 GB checkpoint there. For the architectures below the Linear weights have fixed
names, so `quantize` writes with this guess while a child process builds the real plan
(plan_child.py), then compares the two before anything is published: the same tensors, each with
the same module, or the shards are written again with the real plan (the manifest's
`created.plan` says which happened). A guess never decides anything on its own.
"""

from __future__ import annotations

import re

from . import FLOAT_CODES

# model_type -> the stored names of its quantized Linear weights (every Linear but lm_head)
_LINEARS = re.compile(r"model\.layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight")
RULES = {"llama": _LINEARS, "mistral": _LINEARS, "qwen2": _LINEARS, "qwen3": _LINEARS}


def guess(config: dict, headers: dict, ignore: list[str]) -> dict[str, str] | None:
    """tensor name -> module for the weights the plan will quantize, or None where this
    architecture has no rule (then the conversion waits for the real plan)."""
    from ..model.plan import (
        matches,  # imports torch: not at the top, which plan_child.start_early reads before torch is imported
    )

    rule = RULES.get(config.get("model_type"))
    if rule is None:
        return None
    found = {}
    for h in headers.values():
        for name, info in h.tensors.items():
            if len(info.shape) == 3:  # fused MoE experts: the real plan decides their layout
                return None
            if rule.fullmatch(name) and len(info.shape) == 2 and info.dtype in FLOAT_CODES:
                mod = name[: -len(".weight")]
                if not matches(mod, ignore):
                    found[name] = mod
    return found or None
