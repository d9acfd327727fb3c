"""Where each MoE expert weight lives on disk, for a model whose experts are fused 3-D parameters.

transformers 5 builds a layer's experts as one module holding `gate_up_proj [E, 2I, H]` and
`down_proj [E, H, I]`, but `save_pretrained` (and the hub's Mixtral / Qwen-MoE / OLMoE
checkpoints) store one 2-D tensor per expert and projection, under the model's legacy names
(`block_sparse_moe.experts.3.w1.weight`, `mlp.experts.3.gate_proj.weight`, ...). Other
checkpoints store the fused 3-D tensors themselves. Which checkpoint key feeds which rows of
which expert is not guessed from names here: it is read from transformers' own weight
conversion mapping, by running its save-direction (`revert_weight_conversion`) on label
tensors whose values are global row numbers. Convert (to quantize) and the runtime (to
assemble FP8 experts) both use this one answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Slice:
    """One checkpoint tensor = rows [start, stop) of expert `expert` of a fused parameter."""

    key: str
    expert: int
    start: int
    stop: int


@dataclass
class ExpertParam:
    """One fused expert parameter of the model and how the checkpoint stores it."""

    module: str  # experts module path in the model, e.g. model.layers.0.mlp.experts
    param: str  # gate_up_proj | down_proj
    shape: tuple[int, int, int]  # (E, N, K) as the model holds it
    layout: str = "missing"  # "per-expert" | "fused" | "missing" | "unsupported"
    key: str | None = None  # checkpoint key, fused layout
    slices: list[Slice] = field(default_factory=list)  # per-expert layout, in (expert, row) order
    why: str = ""  # for "missing" / "unsupported"

    @property
    def name(self) -> str:
        return f"{self.module}.{self.param}"

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    def as_dict(self) -> dict:
        d = {"module": self.module, "param": self.param, "shape": list(self.shape), "layout": self.layout}
        if self.key:
            d["key"] = self.key
        if self.slices:
            d["checkpoint_tensors"] = len(self.slices)
            d["example_key"] = self.slices[0].key
        if self.why:
            d["why"] = self.why
        return d


def experts_modules(model) -> dict[str, torch.nn.Module]:
    """Modules holding fused 3-D expert weights (gate_up_proj / down_proj), by path."""
    found = {}
    for name, mod in model.named_modules():
        params = dict(mod.named_parameters(recurse=False))
        if "down_proj" in params and params["down_proj"].ndim == 3 and (
            "gate_up_proj" in params and params["gate_up_proj"].ndim == 3
        ):
            found[name] = mod
    return found


def unsupported_reason(mod) -> str | None:
    """Why our FP8 experts cannot stand in for this module (None: they can)."""
    if getattr(mod, "has_bias", False) or any(n.endswith("_bias") for n, _ in mod.named_parameters(recurse=False)):
        return "experts with biases"
    if getattr(mod, "is_transposed", False):
        return "experts stored transposed ([E, in, out])"
    if getattr(mod, "is_concatenated", True) is False:
        return "interleaved gate/up rows"
    if getattr(mod, "has_gate", True) is False:
        return "experts without a gate projection"
    if type(mod)._apply_gate is not _default_gate_impl():
        return f"a custom gating function ({type(mod).__name__}._apply_gate)"
    return None


def _default_gate_impl():
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # older transformers: no experts interface, plain act(gate) * up
        return None
    return _default_apply_gate


def checkpoint_names(model, name: str, shape: tuple[int, ...]) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint keys transformers' save path writes for one fused parameter, each with
    the global row labels (expert * N + row) it holds.

    The parameter gets label values 0..E*N-1; the reverse conversion splits and renames them
    exactly as `save_pretrained` would.
    """
    from transformers.core_model_loading import revert_weight_conversion

    labels = {name: torch.arange(shape[0] * shape[1], dtype=torch.float64).reshape(shape[0], shape[1], 1)}
    out = revert_weight_conversion(_Unloaded(model), labels)
    return [(key, t.reshape(-1)) for key, t in out.items()]


def checkpoint_module_name(model, module: str) -> str:
    """The name a module's `weight` is saved under (e.g. Mixtral's `mlp.gate` is stored as
    `block_sparse_moe.gate`), by the same reverse conversion."""
    from transformers.core_model_loading import revert_weight_conversion

    try:
        out = revert_weight_conversion(_Unloaded(model), {f"{module}.weight": torch.zeros(1)})
    except Exception:  # no mapping that applies: the model's name is the checkpoint's
        return module
    keys = [k for k in out if k.endswith(".weight")]
    return keys[0][: -len(".weight")] if len(keys) == 1 else module


def _strip_or_add_prefix(key: str, stored: dict, prefix: str) -> str | None:
    if key in stored:
        return key
    if prefix:
        if f"{prefix}.{key}" in stored:
            return f"{prefix}.{key}"
        if key.startswith(prefix + ".") and key[len(prefix) + 1 :] in stored:
            return key[len(prefix) + 1 :]
    return None


def find_layout(model, stored: dict[str, tuple[int, ...]]) -> dict[str, ExpertParam]:
    """For every fused expert parameter of `model`: how the checkpoint (`stored`: key ->
    shape) holds it. Parameters are keyed by `<module>.<param>`."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    result: dict[str, ExpertParam] = {}
    for mod_name, mod in experts_modules(model).items():
        params = {}
        for p in EXPERT_PARAMS:
            t = getattr(mod, p)
            ep = ExpertParam(mod_name, p, tuple(t.shape))
            result[ep.name] = ep
            why = unsupported_reason(mod)
            if why:
                ep.layout, ep.why = "unsupported", f"{why}: kept as is"
                continue
            key = _strip_or_add_prefix(ep.name, stored, prefix)
            if key is not None:
                if tuple(stored[key]) == ep.shape:
                    ep.layout, ep.key = "fused", key
                else:
                    ep.layout = "unsupported"
                    ep.why = f"checkpoint stores {key} as {list(stored[key])}, the model holds {list(ep.shape)}: kept as is"
                continue
            params[ep.name] = ep.shape
        for pname, shape in params.items():
            ep = result[pname]
            E, N, K = shape
            slices, covered = [], 0
            for key, lab in checkpoint_names(model, pname, shape):
                skey = _strip_or_add_prefix(key, stored, prefix)
                first = int(lab[0])
                e, start = divmod(first, N)
                stop = start + lab.numel()
                expected = torch.arange(first, first + lab.numel(), dtype=lab.dtype)
                if skey is None or stop > N or not torch.equal(lab, expected) or tuple(stored[skey]) != (stop - start, K):
                    ep.why = f"checkpoint has no 2-D tensor {key} of shape [{stop - start}, {K}]"
                    break
                slices.append(Slice(skey, e, start, stop))
                covered += stop - start
            if not ep.why and covered == E * N:
                ep.layout = "per-expert"
                ep.slices = sorted(slices, key=lambda s: (s.expert, s.start))
            else:
                ep.why = (ep.why or f"checkpoint tensors cover {covered} of {E * N} expert rows") + ": kept as is"
    return result


class _Unloaded:
    """The model without its load history: a model loaded through a quantizer carries
    conversions (e.g. compressed-tensors' DecompressExperts) that have no reverse; the
    architecture's own mapping is what names the checkpoint's tensors."""

    _weight_conversions = None

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)
