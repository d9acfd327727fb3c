"""Where each MoE expert weight lives on disk, for a model whose experts are fused 3-D parameters.

transformers 5 builds a layer's experts as one module holding `gate_up_proj [E, 2I, H]` and
`down_proj [E, H, I]`, but `save_pretrained` (and the hub's Mixtral / Qwen-MoE / OLMoE
checkpoints) store one 2-D tensor per expert and projection, under the model's legacy names
(`block_sparse_moe.experts.3.w1.weight`, `mlp.experts.3.gate_proj.weight`, ...). Other
checkpoints store the fused 3-D tensors themselves. Which checkpoint key feeds which rows of
which expert is not guessed from names here: it is read from transformers' own weight
conversion mapping, by running its save direction (`hf_compat.saved_form`) on label
tensors whose values are global row numbers. Convert (to quantize) and the runtime (to
assemble FP8 experts) both use this one answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import hf_compat

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
    split: list[Slice] = field(default_factory=list)  # fused layout: the per-expert tensors transformers would save
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
        if self.split:
            d["split_into"] = len(self.split)
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
        if (
            "down_proj" in params
            and params["down_proj"].ndim == 3
            and ("gate_up_proj" in params and params["gate_up_proj"].ndim == 3)
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
    if not hf_compat.has_default_gate(mod):
        return f"a custom gating function ({type(mod).__name__}._apply_gate)"
    return None


def save_slices(model, name: str, shape: tuple[int, int, int]) -> list[Slice] | None:
    """The per-expert 2-D tensors transformers' save path writes for one fused parameter
    (None when it writes the parameter fused).

    The parameter gets label values 0..E*N-1 (expert * N + row); the reverse conversion
    splits and renames them exactly as `save_pretrained` would, and each output's labels say
    which expert rows it holds.
    """
    E, N, _ = shape
    labels = {name: torch.arange(E * N, dtype=torch.float64).reshape(E, N, 1)}
    out = hf_compat.saved_form(model, labels)
    slices = []
    for key, lab in out.items():
        lab = lab.reshape(-1)
        first = int(lab[0])
        e, start = divmod(first, N)
        stop = start + lab.numel()
        if (
            key == name
            or not key.endswith(".weight")
            or stop > N
            or not torch.equal(lab, torch.arange(first, first + lab.numel(), dtype=lab.dtype))
        ):
            return None  # saved fused, or not as row blocks of single experts
        slices.append(Slice(key, e, start, stop))
    if sum(sl.stop - sl.start for sl in slices) != E * N:
        return None
    return sorted(slices, key=lambda sl: (sl.expert, sl.start))


def checkpoint_module_name(model, module: str) -> str:
    """The name a module's `weight` is saved under (e.g. Mixtral's `mlp.gate` is stored as
    `block_sparse_moe.gate`), by the same reverse conversion."""
    try:
        out = hf_compat.saved_form(model, {f"{module}.weight": torch.zeros(1)})
    except (ValueError, KeyError, RuntimeError, AttributeError):  # no mapping applies: the names agree
        return module
    keys = [k for k in out if k.endswith(".weight")]
    return keys[0][: -len(".weight")] if len(keys) == 1 else module


def saved_names(model, names: list[str]) -> dict[str, str]:
    """{name a checkpoint stores it under: model name} for parameters that transformers renames
    on save (Mixtral's `mlp.gate.weight` is stored as `block_sparse_moe.gate.weight`), by one
    run of the reverse conversion on labels (the value i marks names[i]). Names it keeps are
    left out; so is everything when this transformers has no conversion API or it cannot run on
    these parameters (then each module is asked on its own, by `checkpoint_module_name`)."""
    if not hf_compat.has_weight_conversion():  # older transformers: checkpoints carry the model's own names
        return {}
    labels = {n: torch.tensor([float(i)]) for i, n in enumerate(names)}
    try:
        out = hf_compat.saved_form(model, labels)
    except (ValueError, KeyError, RuntimeError, AttributeError, IndexError):
        out = {}
        for mod in {n.rpartition(".")[0] for n in names}:
            stored = checkpoint_module_name(model, mod)
            if stored != mod:
                out.update(
                    {
                        stored + n[len(mod) :]: torch.tensor([float(i)])
                        for i, n in enumerate(names)
                        if n.rpartition(".")[0] == mod
                    }
                )
    renamed = {}
    for key, lab in out.items():
        if lab.numel() == 1 and float(lab) == int(lab) and 0 <= int(lab) < len(names) and names[int(lab)] != key:
            renamed[key] = names[int(lab)]
    return renamed


def _like(key: str, model_name: str, stored_name: str) -> str:
    """Rename `key` the way the checkpoint renamed `model_name` to `stored_name` (base prefix)."""
    if stored_name.endswith(model_name):  # checkpoint adds a prefix
        return stored_name[: len(stored_name) - len(model_name)] + key
    cut = len(model_name) - len(stored_name)  # checkpoint drops one
    return key[cut:]


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
        for p in EXPERT_PARAMS:
            t = getattr(mod, p)
            ep = ExpertParam(mod_name, p, tuple(t.shape))
            result[ep.name] = ep
            why = unsupported_reason(mod)
            if why:
                ep.layout, ep.why = "unsupported", f"{why}: kept as is"
                continue
            key = _strip_or_add_prefix(ep.name, stored, prefix)
            split = save_slices(model, ep.name, ep.shape)
            if key is not None:
                if tuple(stored[key]) == ep.shape:
                    ep.layout, ep.key = "fused", key
                    if split and key != ep.name:  # the checkpoint drops/adds the base prefix: so do the split names
                        split = [Slice(_like(sl.key, ep.name, key), sl.expert, sl.start, sl.stop) for sl in split]
                    ep.split = split or []
                else:
                    ep.layout = "unsupported"
                    ep.why = (
                        f"checkpoint stores {key} as {list(stored[key])}, the model holds {list(ep.shape)}: kept as is"
                    )
                continue
            if split is None:
                ep.why = f"no checkpoint tensor {ep.name}, and transformers saves it fused: kept as is"
                continue
            found = []
            for sl in split:
                skey = _strip_or_add_prefix(sl.key, stored, prefix)
                if skey is None or tuple(stored[skey]) != (sl.stop - sl.start, ep.shape[2]):
                    ep.why = (
                        f"checkpoint has no 2-D tensor {sl.key} of shape [{sl.stop - sl.start}, {ep.shape[2]}]: "
                        "kept as is"
                    )
                    break
                found.append(Slice(skey, sl.expert, sl.start, sl.stop))
            else:
                ep.layout, ep.slices = "per-expert", found
    return result
