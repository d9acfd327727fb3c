"""The plan built in a child process, so that a conversion writes while transformers is imported.

Why a process and not a thread: building the plan means importing transformers' modeling code
(3 s on a 2-core VM, 12 s on the 16-core H100 host), and an import holds the GIL for most of
that time. On a thread beside the writing (branch `plan-guess`), the 16-core host converted a
16 GB checkpoint in 27.3 s against 28.3 s without it: the quantizing threads and the writer
waited on the GIL. A child has its own interpreter, so the parent's writing runs on the other
cores undisturbed; the parent itself never imports transformers on this path.

The child runs `plan_for` and `check_against_model` (the two steps that need the weightless
model) and prints the plan as JSON. Anything else it would do, or any way it fails, is left to
the parent, which then builds the plan itself (`PlanChild.result` returns None and says why):
the real error, if there is one, is raised there, as it would be without a child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MARK = "mpsconvert-plan:"  # the result's line on stdout (transformers may print lines of its own)


class PlanChild:
    """`python -m mpsconvert.convert.plan_child` started for the model folder `path` (its weight files `weight_files`)."""

    command = [sys.executable, "-m", __name__]

    def __init__(self, path: Path, ignore: list[str], weight_files: list[str]):
        package_root = str(Path(__file__).resolve().parents[2])  # this mpsconvert, also when not installed
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        request = json.dumps({"path": str(path), "ignore": list(ignore), "weight_files": list(weight_files)})
        self.why_not: str | None = None
        self._proc = subprocess.Popen([*self.command, request], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      stdin=subprocess.DEVNULL, env=env, text=True)

    def result(self):
        """The child's Plan (without its meta model: the shape check already ran there), or None
        with `why_not` set when the child failed or its plan cannot stand in (fused experts)."""
        from ..plan import Plan

        try:
            out, err = self._proc.communicate()
        finally:
            self.kill()
        lines = [line[len(MARK):] for line in out.splitlines() if line.startswith(MARK)]
        if self._proc.returncode != 0 or not lines:
            last = (err.strip().splitlines() or ["no output"])[-1]
            self.why_not = f"the child exited with {self._proc.returncode}: {last[:200]}"
            return None
        body = json.loads(lines[-1])
        if "error" in body:
            self.why_not = f"the child could not build it: {body['error'][:200]}"
            return None
        if body["experts"]:
            self.why_not = "the model has fused experts, whose layout needs the model itself"
            return None
        return Plan(architecture=body["architecture"], quantize={k: tuple(v) for k, v in body["quantize"].items()},
                    ignored=body["ignored"], skipped=body["skipped"], prefix=body["prefix"])

    @property
    def built_by(self) -> str:
        """Who built the plan, for the manifest (after `result`)."""
        return "a child process" if self.why_not is None else f"this process ({self.why_not})"

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def _main(request: dict) -> dict:
    from ..plan import plan_for
    from ..safetensors_io import read_header
    from .quantize import check_against_model

    try:
        path = Path(request["path"])
        plan = plan_for(path, request["ignore"])
        check_against_model(plan, {f: read_header(path / f) for f in request["weight_files"]})
    except Exception as e:  # the parent builds the plan again and raises the error itself
        return {"error": f"{type(e).__name__}: {e}"}
    return {"architecture": plan.architecture, "quantize": plan.quantize, "ignored": plan.ignored, "skipped": plan.skipped,
            "prefix": plan.prefix, "experts": plan.experts}


if __name__ == "__main__":
    print(MARK + json.dumps(_main(json.loads(sys.argv[1]))), flush=True)
