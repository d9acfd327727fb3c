"""Every change `load()` makes to a transformers model, behind one protocol (patches/base.py) and
in one registry, applied in this order:

  phase "modules" (before the kernel policy measures the layers):
    shared_inputs   sibling FP8 layers that read one input share its quantization and GEMM
    attention       decode attention through the split-KV kernel, SDPA otherwise (CUDA, Triton)
    routing         MoE softmax top-k routers as one kernel at decode (CUDA, Triton)
  phase "forwards" (after it: they read the kernels it chose):
    eager_fusion    fused RMSNorm / MLP / decoder-layer forwards and the rotary kernel in eager
                    mode, direct prefill calls (CUDA, Triton)
    prefill_graphs  a prefill of up to 1024 tokens replays each layer's direct calls as one CUDA
                    graph per padded length (CUDA, Triton; load(prefill_graphs=False) turns
                    it off)
    positions       a call without positions gets the model's own, known on the host (any device)
    lm_head         the output head reads the kept tokens as one matrix, never a batched product
                    over a copy of its weight (any device)
    generate        model.generate() at batch 1 through mpsconvert's engine (the loop `mpsconvert
                    generate` runs), or transformers' own with a static cache (CUDA)

A patch that works around a limitation of torch itself (`lm_head`) also has `not_needed`, a
probe of the installed torch: where torch no longer has the limitation the patch is left out and
its report says so (`skipped`), so a fixed torch runs the model's own code.

Only model/hf_compat.py touches transformers' private names. Each patch installs per module,
only where a probe showed it computes what transformers computes; what it leaves is warned once
(`base.PatchFallback`) and listed in its report, and an install that fails leaves the model with
transformers' own code and a report that says so.
"""

from __future__ import annotations

from torch import nn

from ..ops import triton as tritonlib
from . import forwards
from .base import Context, Patch, PatchFallback, Report, warn_left

__all__ = ["Context", "HELD", "Patch", "PatchFallback", "Report", "REGISTRY", "apply", "check", "held_back"]


def _installed(model: nn.Module, *fns) -> int:
    """Modules of `model` that run one of the installed forwards `fns`."""
    return sum(any(forwards.installed(m, f) for f in fns) for m in model.modules())


def _lost(report: Report, n: int, what: str) -> list[str]:
    """A check's problems: none where `n` modules still run what the install counted, else how many `what`."""
    return [] if n == report.installed else [f"{report.installed - n} {what}"]


def _model_report(name: str, r: dict, installed: int) -> Report:
    """The report of a patch installed on the model as a whole, from its install's result `r`
    ({"installed": ..., "left": why not, ...its own figures}): its figures, or why it left the model."""
    if not r["installed"]:
        return Report(name, left=[f"the model: {r['left']}"])
    return Report(name, installed=installed, details={k: v for k, v in r.items() if k != "installed"})


# Why a Triton patch waits (Context.held): installed by runtime/load/held.py once the kernels are compiled
HELD = "held back until this machine's first compile of its Triton kernels is done (installed then)"


def _needs_cuda_triton(ctx: Context) -> str | None:
    if ctx.device.type != "cuda":
        return f"runs on CUDA only (this model is on {ctx.device.type})"
    if not tritonlib.available():
        return "needs Triton, which is not installed here"
    return HELD if ctx.held else None


class SharedInputs:
    name, phase, option = "shared_inputs", "modules", "share_inputs"

    def match(self, model, ctx):
        from ..ops.fp8linear import FP8Linear

        if ctx.device.type == "cpu" and not any(isinstance(m, FP8Linear) and m.activations for m in model.modules()):
            return (
                "CPU, weights only: every layer holds a dense weight and no input is rounded, so there is "
                "nothing to share"
            )
        return None

    def install(self, model, ctx):
        from ..ops.fuse import share_inputs

        groups = share_inputs(model)
        names = {m: n for n, m in model.named_modules()}
        return Report(
            self.name, installed=len(groups), details={"groups": [f"{names[g]}: {'+'.join(g.names)}" for g in groups]}
        )

    def check(self, model, ctx, report):
        return []  # the kernel policy may split a group again where it measured faster apart: not a fault


class Attention:
    name, phase, option = "attention", "modules", "decode_attention"

    def match(self, model, ctx):
        from ...model import hf_compat

        why = _needs_cuda_triton(ctx)
        if why is None and hf_compat.attn_implementation(model.config) != "sdpa":
            why = f"the model runs {hf_compat.attn_implementation(model.config)!r} attention, not SDPA"
        return why

    def install(self, model, ctx):
        from . import attention

        if attention.install(model) is None:
            return Report(
                self.name, left=[f"the model: transformers did not accept attention {attention.NAME!r} (hf_compat)"]
            )
        return Report(self.name, installed=1, details={"implementation": attention.NAME})

    def check(self, model, ctx, report):
        from ...model import hf_compat
        from . import attention

        now = hf_compat.attn_implementation(model.config)
        return [] if not report.installed or now == attention.NAME else [f"the model now runs {now!r} attention"]


class Routing:
    name, phase, option = "routing", "modules", None

    def match(self, model, ctx):
        from . import routing

        if not any(routing._candidate(m) for m in model.modules()):
            return "no softmax top-k router (not an MoE model, or a router of another kind)"
        return _needs_cuda_triton(ctx)

    def install(self, model, ctx):
        from . import routing

        r = routing.install(model)
        return Report(self.name, installed=r["routers"], left=r["left"])

    def check(self, model, ctx, report):
        from . import routing

        n = _installed(model, routing._router_forward)
        return _lost(report, n, "routers lost their installed forward")


class EagerFusion:
    name, phase, option = "eager_fusion", "forwards", "eager_fusion"

    def match(self, model, ctx):
        return _needs_cuda_triton(ctx)

    def install(self, model, ctx):
        from . import eager_fusion

        r = eager_fusion.install(model)
        details = {k: v for k, v in r.items() if k != "left"}
        return Report(self.name, installed=r["norms"] + r["mlps"] + r["layers"], left=r["left"], details=details)

    def check(self, model, ctx, report):
        from . import eager_fusion as f

        n = _installed(model, f._norm_forward, f._mlp_forward, f._layer_forward)
        return _lost(report, n, "modules lost their fused forward")


class PrefillGraphs:
    name, phase, option = "prefill_graphs", "forwards", "prefill_graphs"

    def match(self, model, ctx):
        if not ctx.on("eager_fusion"):
            return "eager_fusion is off: no direct prefill calls to record"
        why = _needs_cuda_triton(ctx)
        if why is None and not any(p.device.type == "cuda" for p in model.parameters()):
            why = "the model's weights are not on a CUDA device (CUDA graphs)"
        return why

    def install(self, model, ctx):
        from . import prefill_graphs

        r = prefill_graphs.install(model)
        return _model_report(self.name, r, r["installed"])

    def check(self, model, ctx, report):
        n = sum(getattr(m, "mpsconvert_graphs", None) is not None for m in model.modules())
        return _lost(report, n, "layers lost their prefill graphs")


class Positions:
    name, phase, option = "positions", "forwards", "eager_fusion"

    def match(self, model, ctx):
        from . import positions

        return positions._base_model(model)[1]  # a model without a model-level rotary module makes no positions to give

    def install(self, model, ctx):
        from . import positions

        return _model_report(self.name, positions.install(model), 1)

    def check(self, model, ctx, report):
        from . import positions

        n = _installed(model, positions._model_forward)
        return [] if n == report.installed else ["the base model lost its installed forward"]


class LmHead:
    name, phase, option = "lm_head", "forwards", "eager_fusion"

    def match(self, model, ctx):
        from . import lm_head

        return None if lm_head.head(model) is not None else "the model has no plain nn.Linear output head"

    def not_needed(self, model, ctx):
        from . import lm_head

        return lm_head.not_needed(model)

    def install(self, model, ctx):
        from . import lm_head

        r = lm_head.install(model)
        return (
            Report(self.name, installed=1)
            if r["installed"]
            else Report(self.name, left=[f"the output head: {r['left']}"])
        )

    def check(self, model, ctx, report):
        from . import lm_head

        return (
            [] if not report.installed or lm_head.installed(model) else ["the output head lost its installed forward"]
        )


class Generate:
    name, phase, option = "generate", "forwards", "compile"

    def match(self, model, ctx):
        if ctx.device.type != "cuda":
            return (
                f"mpsconvert's engine takes generate() on CUDA only (this model is on {ctx.device.type}): "
                "transformers' default runs"
            )
        return None if callable(getattr(model, "generate", None)) else "the model has no generate()"

    def install(self, model, ctx):
        from . import generate

        generate.install(model, ctx.device.type)
        return Report(
            self.name,
            installed=1,
            details={
                "batch_1": "mpsconvert's engine (static cache, the decode step one CUDA graph, "
                "pipelined); settings it lacks: transformers' loop with a static cache"
            },
        )

    def check(self, model, ctx, report):
        from . import generate

        return [] if generate.installed(model) else ["model.generate was replaced after the patch"]


REGISTRY: tuple[Patch, ...] = (
    SharedInputs(),
    Attention(),
    Routing(),
    EagerFusion(),
    PrefillGraphs(),
    Positions(),
    LmHead(),
    Generate(),
)


def apply(model: nn.Module, ctx: Context, phase: str, registry=REGISTRY) -> dict[str, Report]:
    """Apply the patches of `phase` in registry order; {name: Report}. Never raises for a patch:
    a patch that fails to install is reported (the modules it had installed passed their checks,
    so the model stays correct), and what any patch left is warned once."""
    out = {}
    for patch in (p for p in registry if p.phase == phase):
        option = getattr(patch, "option", None)
        why = f"turned off ({option}=False)" if option and not ctx.on(option) else patch.match(model, ctx)
        if why is None and hasattr(patch, "not_needed"):
            why = patch.not_needed(model, ctx)
        if why is not None:
            out[patch.name] = Report(patch.name, skipped=why)
            continue
        try:
            report = patch.install(model, ctx)
        except Exception as e:  # noqa: BLE001 - any failure: transformers' own code runs, and the report says so
            report = Report(
                patch.name, skipped=f"install failed ({type(e).__name__}: {str(e)[:160]}); transformers' own code runs"
            )
            report.left.append(f"the model: install failed ({type(e).__name__})")
        out[patch.name] = report
        warn_left(report)
    return out


def held_back(reports: dict[str, Report]) -> tuple[Patch, ...]:
    """The patches of REGISTRY that `reports` says were held back (HELD), in registry order."""
    return tuple(p for p in REGISTRY if reports.get(p.name) is not None and reports[p.name].skipped == HELD)


def check(model: nn.Module, ctx: Context, reports: dict[str, Report], registry=REGISTRY) -> None:
    """After every phase: each patch confirms what it installed is still in place; a problem is
    added to its report's `left` and warned."""
    for patch in registry:
        report = reports.get(patch.name)
        if report is None or report.skipped is not None:
            continue
        problems = patch.check(model, ctx, report)
        if problems:
            report.left += [f"the model: {p}" for p in problems]
            warn_left(report)
