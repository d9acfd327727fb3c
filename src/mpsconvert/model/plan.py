"""Which tensors to quantize, read from the model's own definition (built on the meta device).

Names are not guessed: transformers builds the architecture without weights, and every
`nn.Linear` in it is a candidate. Default ignores are found by role, not by name alone:
the output embedding (lm_head), MoE routers (a Linear that outputs one logit per expert),
shared-expert gates; embeddings and norms are not Linear and stay as they are. Layer types
we do not quantize (GPT-2's Conv1D, convolutions) are reported. Fused 3-D MoE experts
(transformers 5's `*Experts` modules) are listed in `Plan.experts`: whether and how they are
quantized depends on how the checkpoint stores them (`moe_layout.find_layout`).
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass, field

import regex
import torch

from ..errors import MpsconvertError, SourceError
from .definition import build_from
from .moe_layout import checkpoint_module_name, experts_modules

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass
class Plan:
    """The decision for every Linear-like module of a model."""

    architecture: str
    quantize: dict[str, tuple[int, int]] = field(default_factory=dict)  # module -> (out, in)
    ignored: dict[str, str] = field(default_factory=dict)  # Linear module -> why it stays
    skipped: dict[str, str] = field(default_factory=dict)  # non-Linear weight modules -> what they are
    prefix: str = ""  # base_model_prefix, for checkpoints saved without/with it
    experts: list[str] = field(default_factory=list)  # fused 3-D experts modules
    expert_layout: dict = field(default_factory=dict)  # "<module>.<param>" -> moe_layout.ExpertParam
    meta_model: object = field(default=None, repr=False)  # the weightless model the plan was read from
    unknown: list[str] = field(default_factory=list)  # stored tensors the model does not define (check_against_model)

    def module_for_tensor(self, tensor_name: str) -> str | None:
        """The quantized module a checkpoint key `<module>.weight` belongs to, or None."""
        if not tensor_name.endswith(".weight"):
            return None
        mod = tensor_name[: -len(".weight")]
        if mod in self.quantize:
            return mod
        if self.prefix:
            if f"{self.prefix}.{mod}" in self.quantize:
                return f"{self.prefix}.{mod}"
            if mod.startswith(self.prefix + ".") and mod[len(self.prefix) + 1 :] in self.quantize:
                return mod[len(self.prefix) + 1 :]
        return None


def _num_experts(config) -> int | None:
    for cfg in (config, getattr(config, "text_config", None)):
        for key in _EXPERT_KEYS:
            v = getattr(cfg, key, None) if cfg is not None else None
            if isinstance(v, int) and v > 1:
                return v
    return None


# A module name is at most a few hundred characters: any sane pattern matches it in microseconds,
# so a match that takes longer is catastrophic backtracking (`re:(a+)+$`), refused in one line.
MATCH_SECONDS = 0.5
MAX_PATTERN = 1024


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str):
    """A `re:` pattern compiled (with `regex`, Python's re syntax, which can bound a match's time)."""
    try:
        return regex.compile(pattern, regex.VERSION0)
    except (regex.error, ValueError, OverflowError, RecursionError) as e:
        raise MpsconvertError(
            f"ignore pattern 're:{pattern[:80]}' is not a valid regular expression ({str(e)[:80]})",
            "fix the pattern (Python regex syntax after 're:'), or use a glob such as '*.mlp.down_proj'",
        ) from None


def check_patterns(patterns) -> list[str]:
    """Ignore patterns (from --ignore, a manifest or a config: any of them may be hostile) as a
    list of strings, every `re:` one compiled: a bad one is one line naming it."""
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise MpsconvertError(
            f"ignore patterns must be a list of strings (got {str(patterns)[:80]!r})", "fix the ignore list"
        )
    for p in patterns:
        if len(p) > MAX_PATTERN:
            raise MpsconvertError(
                f"ignore pattern {p[:40]!r}... is {len(p)} characters long (at most {MAX_PATTERN})", "shorten it"
            )
        if p.startswith("re:"):
            _compiled(p[3:])
    return list(patterns)


def matches(name: str, patterns: list[str]) -> str | None:
    """The first pattern that names this module: glob (`*.mlp.down_proj`), `re:` regex, or a
    bare name matching the module or its last components (`lm_head`, `mlp.gate`). A regex is
    matched with a time bound (MATCH_SECONDS); globs cannot backtrack catastrophically (fnmatch)."""
    for p in check_patterns(patterns):
        if p.startswith("re:"):
            try:
                if _compiled(p[3:]).search(name, timeout=MATCH_SECONDS):
                    return p
            except TimeoutError:
                raise MpsconvertError(
                    f"ignore pattern {p[:80]!r} took more than {MATCH_SECONDS} s to match the module name "
                    f"{name[:80]!r} (catastrophic backtracking)",
                    "simplify the pattern (no nested repeats such as (a+)+)",
                ) from None
        elif fnmatch.fnmatchcase(name, p) or name == p or name.endswith("." + p):
            return p
    return None


def plan_from_model(model, config, ignore: list[str] | None = None) -> Plan:
    """Decide every Linear (and report every other weight-bearing layer) of a meta model."""
    ignore = check_patterns(list(ignore or []))
    plan = Plan(architecture=type(model).__name__, prefix=getattr(model, "base_model_prefix", "") or "")
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    n_experts = _num_experts(config)
    fused_experts = experts_modules(model)
    plan.experts = list(fused_experts)
    plan.meta_model = model
    for name, mod in model.named_modules():
        if not name or name in fused_experts:
            continue
        kind = type(mod).__name__
        if isinstance(mod, torch.nn.Linear):
            leaf = name.rsplit(".", 1)[-1]
            if out_emb is not None and mod is out_emb:
                plan.ignored[name] = "output embedding (lm_head): kept in full precision by default"
            elif n_experts and mod.out_features == n_experts and ("gate" in leaf or "router" in leaf):
                plan.ignored[name] = f"MoE router ({n_experts} experts): kept in full precision"
            elif "shared_expert_gate" in leaf or (n_experts and mod.out_features == 1 and "gate" in leaf):
                plan.ignored[name] = "shared-expert gate: kept in full precision"
            elif (p := matches(name, ignore)) is not None:
                plan.ignored[name] = f"--ignore {p}"
            else:
                plan.quantize[name] = (mod.out_features, mod.in_features)
        elif kind == "Conv1D":
            plan.skipped[name] = (
                "GPT-2 style Conv1D (weight stored [in, out]): compressed-tensors targets nn.Linear only, kept as is"
            )
        elif isinstance(mod, torch.nn.Embedding):
            plan.skipped[name] = "embedding: never quantized (transformers reads it as a dense lookup table)"
        elif isinstance(mod, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
            plan.skipped[name] = f"{kind}: only nn.Linear layers are quantized, kept as is"
        elif n_experts and _is_router(name, mod, n_experts):
            # transformers 5 routers (`*TopKRouter`) are not nn.Linear; list them (under the
            # model's and the checkpoint's name) so every loader keeps them in full precision.
            plan.ignored[name] = f"MoE router ({kind}, {n_experts} experts): kept in full precision"
            disk = checkpoint_module_name(model, name)
            if disk != name:
                plan.ignored[disk] = f"checkpoint name of the MoE router {name}: kept in full precision"
        else:
            fused = [p for p, t in mod.named_parameters(recurse=False) if t.ndim == 3]
            if fused:
                plan.skipped[name] = (
                    f"3-D parameters ({', '.join(fused)}) of {kind}: not an experts layout we know, kept as is"
                )
    return plan


def _is_router(name: str, mod, n_experts: int) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    w = getattr(mod, "weight", None)
    return (
        isinstance(w, torch.nn.Parameter)
        and w.ndim == 2
        and w.shape[0] == n_experts
        and ("gate" in leaf or "router" in leaf)
    )


def plan_for(path, ignore: list[str] | None = None, trust_remote_code: bool = False) -> Plan:
    """The plan of the model in folder `path`, read from its weightless definition."""
    config, model = build_from(path, buffers="meta", trust_remote_code=trust_remote_code)
    return plan_from_model(model, config, ignore)


FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # a float parameter may be stored as any of these
# What FP8 formats store beside a weight (compressed-tensors, FineGrainedFP8, ComfyUI): read by the
# source's format checks, not parameters of the model.
_COMPANIONS = (
    ".weight_scale",
    ".weight_scale_inv",
    ".input_scale",
    ".weight_zero_point",
    ".input_zero_point",
    ".weight_global_scale",
    ".input_global_scale",
    ".comfy_quant",
    ".scale_weight",
    ".scale_input",
)


def check_against_model(plan: Plan, headers: dict, fp8_source: bool = False) -> None:
    """Every stored tensor that is a parameter of the model config.json defines has that
    parameter's shape, and a float dtype where the parameter is float (e4m3 too in an FP8
    source): a checkpoint that does not fit its config is refused here, not discovered by
    `verify` or the forward pass. Stored tensors the model defines nowhere (no parameter, buffer,
    fused experts or FP8 companion of that name) are listed in `plan.unknown`: they are copied
    as they are, and the conversion says so (transformers ignores them at load)."""
    floats = FLOAT_DTYPES + (("F8_E4M3",) if fp8_source else ())
    if plan.meta_model is None:  # the plan came from a child process, which ran this check on its model
        return
    params = dict(plan.meta_model.named_parameters(remove_duplicate=False))
    known = set(params) | {n for n, _ in plan.meta_model.named_buffers(remove_duplicate=False)}
    prefix = plan.prefix
    experts = tuple(e + "." for e in plan.experts)

    def names(key: str) -> list[str]:
        """`key` and, with a prefix, its name with the prefix added or taken off."""
        return [
            cand
            for cand in (
                key,
                f"{prefix}.{key}" if prefix else None,
                key[len(prefix) + 1 :] if prefix and key.startswith(prefix + ".") else None,
            )
            if cand
        ]

    def defined(key: str) -> bool:
        if key.endswith(_COMPANIONS):
            return True
        for cand in names(key):
            if cand in known or (bool(experts) and cand.startswith(experts)):  # per-expert tensors of fused experts
                return True
        return False

    plan.unknown = sorted(name for h in headers.values() for name in h.tensors if not defined(name))

    def param_of(key: str):
        for cand in names(key):
            if cand in params:
                return params[cand]
        return None

    for f, h in headers.items():
        for name, info in h.tensors.items():
            p = param_of(name)
            if p is None:
                continue
            if tuple(p.shape) != tuple(info.shape):
                raise SourceError(
                    f"{name} in {f} has shape {list(info.shape)}, but the model config.json defines "
                    f"has {list(p.shape)} there",
                    "the weights do not match config.json; re-download the model",
                )
            if p.is_floating_point() and info.dtype not in floats:
                raise SourceError(
                    f"{name} in {f} is stored as {info.dtype}, but the model's parameter is a float",
                    "the weights do not match config.json; re-download the model",
                )
