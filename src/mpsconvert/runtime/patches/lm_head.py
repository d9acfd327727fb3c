"""The output head (`lm_head`) of a loaded model reads the last tokens' hidden states as one matrix.

Why: transformers computes the logits as `lm_head(hidden_states[:, -k:, :])` (`logits_to_keep`,
which `generate()`, the engine's prefill and validate pass). That slice is a 3-D view whose batch
stride is the whole prompt's, and torch's `matmul` folds a 3-D input into one matrix product
only where its leading dimensions are laid out one after another, or where the weight requires
grad (it does in a model from `from_pretrained`, not in a loaded one, whose parameters never
do). Otherwise it runs a batched product over the weight expanded to the batch, which on CPU
copies the whole weight first: SmolLM2-135M's 49152 x 576 head took 70-150 ms per prefill
instead of 2.7 ms (torch 2.13, this project's 2-core VM), half of a 512-token FP8 prefill. Here
the head flattens its input's leading dimensions itself (a view for the slice of one sequence;
a copy of B rows of hidden state where rows of several sequences are apart) and runs the one
matrix product transformers' model gets from `from_pretrained`: the same numbers, checked on a
probe at install.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import forwards

_COPIES: dict[tuple[str, torch.dtype], bool] = {}


def _head_forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.dim() <= 2:
        return F.linear(x, self.weight, self.bias)
    return F.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias).view(*x.shape[:-1], -1)


def copies_weight(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch runs `F.linear` on the last token of each of two sequences (a 3-D slice
    whose batch stride is the sequence's) as a batched product over the weight expanded to the
    batch, the path that copies the whole weight; probed once per device type and dtype by
    recording the aten ops a small product of that shape dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    key = (torch.device(device).type, dtype)
    if key not in _COPIES:
        seen: list[str] = []

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        w = torch.zeros(8, 16, device=device, dtype=dtype)
        x = torch.zeros(2, 3, 16, device=device, dtype=dtype)[:, -1:, :]
        with torch.no_grad(), Record():
            F.linear(x, w)
        _COPIES[key] = "bmm" in seen
    return _COPIES[key]


def not_needed(model: nn.Module) -> str | None:
    """Why the patch is not needed with this torch (one line), or None where it is."""
    mod = head(model)
    if mod is None or copies_weight(mod.weight.device, mod.weight.dtype):
        return None
    return (
        f"torch {torch.__version__} computes the kept tokens' logits as one matrix product on {mod.weight.device.type} "
        "(probed): the model's own head runs"
    )


def head(model: nn.Module) -> nn.Module | None:
    """The model's output head where it is a plain nn.Linear (its class under an installed forward)."""
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    return out if out is not None and forwards._base(out) is nn.Linear else None


def install(model: nn.Module) -> dict:
    """Install the flattening forward on the model's head after a probe of two sequences' last
    tokens gave the head's own output bit for bit; {"installed": bool, "left": why or None}."""
    mod = head(model)
    if mod is None:
        return {"installed": False, "left": "the model has no plain nn.Linear output head"}
    w = mod.weight
    probe = torch.randn(2, 3, mod.in_features, generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)[
        :, -1:, :
    ]
    with torch.no_grad():
        want = F.linear(probe.contiguous(), w, mod.bias)  # the folded product transformers' own model computes
        got = _head_forward(mod, probe)
    if got.shape != want.shape or not torch.equal(got, want):
        return {"installed": False, "left": "the flattened product differed from the head's own on a probe"}
    forwards.install(mod, _head_forward)
    return {"installed": True, "left": None}


def installed(model: nn.Module) -> bool:
    mod = head(model)
    return mod is not None and forwards.installed(mod, _head_forward)
