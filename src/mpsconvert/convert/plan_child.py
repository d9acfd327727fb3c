"""The plan built in a child process, so that a conversion writes while transformers is imported.

Why a process and not a thread: building the plan means importing transformers' modeling code
(3 s on a 2-core VM, 12 s on the 16-core H100 host), and an import holds the GIL for most of
that time. On a thread beside the writing (branch `plan-guess`), the 16-core host converted a
16 GB checkpoint in 27.3 s against 28.3 s without it: the quantizing threads and the writer
waited on the GIL. A child has its own interpreter, so the parent's writing runs on the other
cores undisturbed; the parent itself never imports transformers on this path.

The child (the mechanics: child.py) runs `plan_for` and `check_against_model` (the two steps
that need the weightless model) and answers the plan as JSON. Anything else it would do, or any
way it fails, is left to the parent, which then builds the plan itself (`PlanChild.result`
returns None and says why): the real error, if there is one, is raised there, as it would be
without a child.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..infra.child import MIN_CPUS, Child, serve

# From this size of checkpoint on, the plan is built by a child process while the shards are
# written with a plan guessed from the tensor names: below it the writing is shorter than the
# child's own start (torch's import, 1-4 s), which would be paid on top of the parent's.
MIN_BYTES = 1 << 30
# ... and from child.MIN_CPUS cores on: the child's gain is its imports running beside the
# writing; on the 2-core VM its own torch import made a 2.5 GB conversion 6% slower (8.57 vs
# 8.05 s, median of 5).


def start_early(snap, scheme, ignore: list[str], trust_remote_code: bool) -> "PlanChild | None":
    """The child for `snap`, started before this process imports torch, where the conversion will
    want one (`wanted`); else None. On the 16-core host the child started after torch's import
    finished 5 s after the writing did (its own imports take 17 s there), so it starts here, at
    the top of the conversion."""
    return PlanChild(snap.path, ignore, snap.weight_files) if wanted(snap, scheme, trust_remote_code) else None


def wanted(snap, scheme, trust_remote_code: bool) -> bool:
    """Whether `snap`'s plan is built by a child while the shards are written with a guessed one:
    an architecture `guess` knows, no FP8 source, calibration or remote code, and `worth_it`."""
    from .guess import RULES

    if snap.fp8 is not None or snap.diffusion is not None or scheme.needs_calibration or trust_remote_code:
        return False
    return snap.config.get("model_type") in RULES and worth_it(
        sum((snap.path / f).stat().st_size for f in snap.weight_files)
    )


def worth_it(nbytes: int) -> bool:
    """Whether a checkpoint of `nbytes` is planned by a child on this machine (MIN_BYTES, MIN_CPUS)."""
    return nbytes >= MIN_BYTES and (os.cpu_count() or 1) >= MIN_CPUS


class PlanChild(Child):
    """This module run in a child process for the model folder `path` (its weight files `weight_files`)."""

    def __init__(self, path: Path, ignore: list[str], weight_files: list[str]):
        super().__init__(__name__, {"path": str(path), "ignore": list(ignore), "weight_files": list(weight_files)})
        self.why_not: str | None = None

    def result(self):
        """The child's Plan (without its meta model: the shape check already ran there), or None
        with `why_not` set when the child failed or its plan cannot stand in (fused experts)."""
        from ..model.plan import Plan

        body = self.answer()
        if "error" in body:
            self.why_not = body["error"][:240]
            return None
        if body["experts"]:
            self.why_not = "the model has fused experts, whose layout needs the model itself"
            return None
        return Plan(
            architecture=body["architecture"],
            quantize={k: tuple(v) for k, v in body["quantize"].items()},
            ignored=body["ignored"],
            skipped=body["skipped"],
            prefix=body["prefix"],
            unknown=body.get("unknown", []),
        )

    @property
    def built_by(self) -> str:
        """Who built the plan, for the manifest (after `result`)."""
        return "a child process" if self.why_not is None else f"this process ({self.why_not})"


def _main(request: dict) -> dict:
    """In the child: the plan and its shape check (an error is answered; the parent builds the plan
    again and raises it itself)."""
    from ..infra.safetensors_io import read_header
    from ..model.plan import check_against_model, plan_for

    path = Path(request["path"])
    plan = plan_for(path, request["ignore"])
    check_against_model(plan, {f: read_header(path / f) for f in request["weight_files"]})
    return {
        "architecture": plan.architecture,
        "quantize": plan.quantize,
        "ignored": plan.ignored,
        "skipped": plan.skipped,
        "prefix": plan.prefix,
        "experts": plan.experts,
        "unknown": plan.unknown,
    }


if __name__ == "__main__":
    serve(_main)
