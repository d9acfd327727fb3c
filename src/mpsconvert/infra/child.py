"""A module of this mpsconvert run in a child process, its answer one JSON line.

Why a process: work that holds the GIL for seconds runs beside the parent's only in another
interpreter (transformers' modeling import while a conversion writes its shards,
convert/plan_child.py; Triton's kernel compiles while a load builds the model,
runtime/load/prewarm_child.py). Both need the same mechanics, kept here once:

- the child runs this very mpsconvert: its folder is appended to `sys.path`, not put in
  PYTHONPATH, where it would come before the standard library (a site-packages folder there would
  let any package shadow a stdlib module), and the child refuses to work when it imported another;
- the request goes as one JSON argument, the answer comes back as one marked line on stdout
  (libraries print lines of their own);
- any failure is an answer `{"error": ...}`, never an exception in the parent: what a child does
  is always something the parent can do itself;
- no child outlives its use (`kill`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

MARK = "mpsconvert-child:"
# Cores from which a child's work beside the parent's pays: on the 2-core VM the cores are busy
# either way, and a child's own imports (torch: 1-4 s) came on top (a conversion with the plan's
# child 6% slower, convert/plan_child.py).
MIN_CPUS = 4
_BOOT = "import runpy, sys; sys.path.append(sys.argv.pop(1)); runpy.run_module(sys.argv[1], run_name='__main__')"


def package_root() -> Path:
    """The folder holding this mpsconvert package (also when it is not installed)."""
    return Path(__file__).resolve().parents[2]


class Child:
    """`module` (dotted, in this package) run in a new interpreter with `request` (a JSON object)."""

    # (runpy warns when the package already imported the module it runs: harmless here, kept off stderr)
    command = [sys.executable, "-W", "ignore::RuntimeWarning:runpy", "-c", _BOOT]

    def __init__(self, module: str, request: dict):
        root = str(package_root())
        self._proc = subprocess.Popen(
            [*self.command, root, module, json.dumps({**request, "package": root})],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )

    def answer(self, timeout: float | None = None) -> dict:
        """The child's answer once it exits, or `{"error": why}`: it failed, printed none, or gave
        none within `timeout` seconds (then it is killed)."""
        try:
            out, err = self._proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return {"error": f"no answer within {timeout:g} s"}
        finally:
            self.kill()
        lines = [line[len(MARK) :] for line in out.splitlines() if line.startswith(MARK)]
        if self._proc.returncode != 0 or not lines:
            last = (err.strip().splitlines() or ["no output"])[-1]
            return {"error": f"the child exited with {self._proc.returncode}: {last[:200]}"}
        return json.loads(lines[-1])

    def running(self) -> bool:
        return self._proc.poll() is None

    def kill(self) -> None:
        stop(self._proc)


def stop(proc: subprocess.Popen) -> None:
    """End `proc` if it still runs, and reap it (no zombie is left behind)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def answer_for(main: Callable[[dict], dict], request: dict) -> dict:
    """In the child: `main(request)`, once the child is known to run the parent's mpsconvert."""
    if str(package_root()) != request.get("package"):  # another mpsconvert came first on the child's path
        return {
            "error": f"the child imported the mpsconvert in {package_root()}, not the one in {request.get('package')}"
        }
    try:
        return main(request)
    except Exception as e:  # the parent does the work itself, and raises a real error there
        return {"error": f"{type(e).__name__}: {e}"}


def serve(main: Callable[[dict], dict]) -> None:
    """A child module's `__main__`: read the request, print the answer."""
    print(MARK + json.dumps(answer_for(main, json.loads(sys.argv[-1]))), flush=True)
