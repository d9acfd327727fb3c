"""Static input scales for MoE experts: per expert, from the router's own assignments.

A forward pre-hook on each fused experts module sees (hidden_states, top_k_index,
top_k_weights) exactly as the model routes them, and records per expert:
- the amax of the tokens routed to it (the gate_up projection's input), and
- the amax of act(gate) * up for those tokens (the down projection's input), computed from
  the module's own weights on the routed tokens only.

Experts the data never routes to get a scale that is still valid and safe (the fallback):
- gate_up input: every expert of a layer reads the same hidden states, so the amax over all
  tokens the layer saw is used;
- down input: a bounded sample of the layer's tokens (`sample_tokens`) is run through that
  expert's gate_up as if routed to it, and its amax is used.
Both are at least as wide as what the expert would have seen, so nothing clips; the experts
are listed in `ExpertScales.fallbacks` and a warning names them (llm-compressor's NaN scales
for never-routed experts are the failure this avoids).

Call pattern for a calibration runner:

    obs = ExpertObserver(model)
    with obs:
        for batch in data: model(**batch)
    scales = obs.scales()                     # ExpertScales
    opts.input_scales.update(scales.input_scales)   # "<experts module>.<param>" -> [E]
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from ..errors import QuantizationError
from ..format import fp8
from ..model import hf_compat
from ..model.moe_layout import experts_modules, unsupported_reason


@dataclass
class _Stats:
    num_experts: int
    gate_up_amax: torch.Tensor  # [E]
    down_amax: torch.Tensor  # [E]
    tokens: torch.Tensor  # [E] token-expert pairs seen
    layer_amax: torch.Tensor  # [] over every token the layer saw
    sample: list = field(default_factory=list)  # hidden states kept for the fallback
    sampled: int = 0


@dataclass
class ExpertScales:
    """Per-expert static input scales, ready for `convert.quantize.Options.input_scales`."""

    input_scales: dict[str, list[float]]  # "<module>.gate_up_proj" / ".down_proj" -> [E] dequant scales
    tokens: dict[str, list[int]]  # "<module>" -> token-expert pairs routed to each expert
    fallbacks: dict[str, list[int]]  # "<module>" -> experts that were never routed
    skipped: dict[str, str]  # experts modules not observed, and why

    def as_dict(self) -> dict:
        return {
            "experts_fallback": "never-routed experts: gate_up input = amax over all of the layer's tokens; "
            "down input = amax of act(gate)*up over a sample of the layer's tokens run through that expert",
            "tokens_per_expert": self.tokens,
            "never_routed": {m: e for m, e in self.fallbacks.items() if e},
            "skipped": self.skipped,
        }


class ExpertObserver:
    """Hooks every fused experts module of `model` (transformers 5 layout) while active."""

    def __init__(self, model, sample_tokens: int = 512):
        self.sample_tokens = sample_tokens
        self.modules: dict[str, torch.nn.Module] = {}
        self.skipped: dict[str, str] = {}
        for name, mod in experts_modules(model).items():
            why = unsupported_reason(mod)
            if why:
                self.skipped[name] = f"{why}: no per-expert input scales"
            else:
                self.modules[name] = mod
        self.stats: dict[str, _Stats] = {}
        self._handles = []

    def __enter__(self):
        for name, mod in self.modules.items():
            self._handles.append(mod.register_forward_pre_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(mod, args, kwargs):
            hidden, top_k_index, _ = _experts_args(args, kwargs)
            self.observe(name, mod, hidden, top_k_index)

        return hook

    @torch.no_grad()
    def observe(self, name: str, mod, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        E = mod.gate_up_proj.shape[0]
        st = self.stats.get(name)
        if st is None:
            z = torch.zeros(E, dtype=torch.float32, device=hidden.device)
            st = self.stats[name] = _Stats(
                E, z.clone(), z.clone(), torch.zeros(E, dtype=torch.int64, device=hidden.device), z.new_zeros(())
            )
        tok_amax = hidden.abs().amax(dim=-1).float()  # [T]
        st.layer_amax = torch.maximum(st.layer_amax, tok_amax.max())
        for j in range(top_k_index.shape[-1]):
            st.gate_up_amax.scatter_reduce_(0, top_k_index[:, j], tok_amax, reduce="amax")
        st.tokens += torch.bincount(top_k_index.reshape(-1), minlength=E)[:E]
        for e in torch.unique(top_k_index).tolist():
            rows = (top_k_index == e).any(dim=-1)
            st.down_amax[e] = torch.maximum(st.down_amax[e], _down_input(mod, e, hidden[rows]).abs().amax().float())
        if st.sampled < self.sample_tokens:
            take = hidden[: self.sample_tokens - st.sampled].detach()
            st.sample.append(take)
            st.sampled += take.shape[0]

    @torch.no_grad()
    def scales(self) -> ExpertScales:
        input_scales: dict[str, list[float]] = {}
        tokens, fallbacks = {}, {}
        for name, mod in self.modules.items():
            st = self.stats.get(name)
            if st is None:
                raise QuantizationError(
                    f"experts module {name} never ran during calibration",
                    "check that the calibration data reaches every layer (non-empty samples)",
                )
            never = [e for e in range(st.num_experts) if int(st.tokens[e]) == 0]
            gate_up = st.gate_up_amax.clone()
            down = st.down_amax.clone()
            if never:
                sample = torch.cat(st.sample)
                for e in never:
                    gate_up[e] = st.layer_amax
                    down[e] = _down_input(mod, e, sample).abs().amax().float()
            input_scales[f"{name}.gate_up_proj"] = fp8.scales_from_amax(gate_up).tolist()
            input_scales[f"{name}.down_proj"] = fp8.scales_from_amax(down).tolist()
            tokens[name] = st.tokens.tolist()
            fallbacks[name] = never
        listed = {m: e for m, e in fallbacks.items() if e}
        if listed:
            warnings.warn(
                "MoE experts never routed by the calibration data got fallback input scales "
                f"(layer-wide amax; see calibrate.experts): {listed}",
                stacklevel=2,
            )
        return ExpertScales(input_scales, tokens, fallbacks, dict(self.skipped))


def _experts_args(args, kwargs):
    names = ("hidden_states", "top_k_index", "top_k_weights")
    vals = list(args) + [kwargs[n] for n in names[len(args) :]]
    return vals[0], vals[1], vals[2]


def _down_input(mod, e: int, x: torch.Tensor) -> torch.Tensor:
    """act(gate) * up of expert e for rows x: what its down projection reads."""
    h = torch.nn.functional.linear(x.to(mod.gate_up_proj.dtype), mod.gate_up_proj[e])
    return hf_compat.expert_gate(mod, h)
