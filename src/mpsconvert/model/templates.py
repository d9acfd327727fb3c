"""Chat templates, rendered with a time, output and memory bound.

A chat template is Jinja code that comes with the artifact. transformers renders it in its
sandbox (`ImmutableSandboxedEnvironment`: no attribute escapes, no mutation), which bounds
neither time nor size: nested loops hang `chat`, `{{ 'x' * 10**9 }}` fills memory, a macro that
calls itself ends in RecursionError. A thread cannot stop Python code, so every render runs in a
worker process (one per mpsconvert process, started at the first render or by `warm`, while the
model loads): the same function that `apply_chat_template` calls (hf_compat.CHAT_TEMPLATE_RENDERER),
so the text is transformers' own, with

- a time bound per render (`RENDER_SECONDS`): past it the worker is killed (a new one serves the
  next render);
- an output budget (`MAX_CHARS`): the compiled template renders through Jinja's `generate`,
  stopped once its output passes the budget;
- a memory limit (RLIMIT_AS, where the OS enforces it: Linux).

Every failure (the budget, the time, a template that raises, does not compile, or recurses) is
one line naming the template's file. Cost per chat turn: measured by benchmarks/chat_template.py.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time

from ..errors import ArtifactError
from ..infra.child import stop

RENDER_SECONDS = 10.0
MAX_CHARS = 16 << 20  # characters: a prompt beyond this fits no model's context (1M tokens is ~4M characters)
MEMORY_BYTES = 2 << 30  # address space the worker may add once transformers is imported
START_SECONDS = 120.0  # importing transformers on a loaded 2-core machine

_WORKER = r"""
import importlib, json, os, resource, sys
out = sys.stdout
sys.stdout = sys.stderr  # nothing but answers on the pipe
import jinja2
budget, extra = int(sys.argv[1]), int(sys.argv[2])
render_jinja_template = getattr(importlib.import_module(sys.argv[3]), sys.argv[4])  # hf_compat.CHAT_TEMPLATE_RENDERER

class Budget(Exception):
    pass

def render(self, *args, **kwargs):
    # Template.render, through generate(): stopped as soon as the output passes the budget
    parts, n = [], 0
    for chunk in self.generate(*args, **kwargs):
        n += len(chunk)
        if n > budget:
            raise Budget()
        parts.append(chunk)
    return "".join(parts)

jinja2.Template.render = render
try:
    with open("/proc/self/statm") as f:
        now = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (now + extra, now + extra))
except (OSError, ValueError, AttributeError):
    pass  # no /proc (macOS, which does not enforce RLIMIT_AS anyway): the time and output bounds remain
out.write('{"ready": true}\n')
out.flush()
for line in sys.stdin:
    req = json.loads(line)
    try:
        rendered, _ = render_jinja_template(conversations=[req["messages"]], chat_template=req["template"],
                                            add_generation_prompt=req["add_generation_prompt"], **req["kwargs"])
        ans = {"text": rendered[0]}
    except Budget:
        ans = {"error": f"renders more than {budget} characters"}
    except MemoryError:
        ans = {"error": f"needs more than {extra >> 20} MiB of memory to render"}
    except RecursionError:
        ans = {"error": "recurses without end"}
    except BaseException as e:
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        ans = {"error": f"fails: {type(e).__name__}: {msg}"}
    out.write(json.dumps(ans) + "\n")
    out.flush()
"""


class _Worker:
    """One worker process and the pipe to it; replaced after a timeout or a crash."""

    def __init__(self):
        from . import hf_compat  # lazily: it loads torch, which the tokenizer that asks for a render has loaded

        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONDONTWRITEBYTECODE": "1"}
        args = [sys.executable, "-c", _WORKER, str(MAX_CHARS), str(MEMORY_BYTES), *hf_compat.CHAT_TEMPLATE_RENDERER]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
        )
        self.buf = b""
        self.ready = False

    def line(self, deadline: float) -> bytes | None:
        """The next line from the worker, or None past `deadline` or when it exits."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def close(self) -> None:
        stop(self.proc)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


_lock = threading.Lock()
_worker: _Worker | None = None


def warm() -> None:
    """Start the worker now (its import of transformers overlaps the model's load)."""
    global _worker
    with _lock:
        if _worker is None:
            _worker = _Worker()


@atexit.register
def close() -> None:
    """End the worker (at exit, or after it timed out)."""
    global _worker
    if _worker is not None:
        _worker.close()
        _worker = None


def render(
    template: str,
    messages: list[dict],
    where: str,
    *,
    add_generation_prompt: bool = True,
    seconds: float | None = None,
    **kwargs,
) -> str:
    """`template` rendered for `messages` exactly as transformers' `apply_chat_template` renders
    it (`kwargs`: the tokenizer's special tokens), bounded in time, output and memory.

    Raises:
        ArtifactError: the template fails in any way, named by `where` (its file).
    """
    global _worker
    seconds = seconds or RENDER_SECONDS
    body = json.dumps(
        {"template": template, "messages": messages, "add_generation_prompt": add_generation_prompt, "kwargs": kwargs}
    )
    fix = "fix or remove the chat template (or pass `use_template=False` to `generate`)"
    with _lock:
        if _worker is None:
            _worker = _Worker()
        w = _worker
        if not w.ready:
            if w.line(time.monotonic() + START_SECONDS) is None:
                close()
                raise ArtifactError(
                    f"the chat template renderer could not start (importing transformers and jinja2 in a worker "
                    f"took over {START_SECONDS:.0f} s, or failed)",
                    "check that transformers and jinja2 import",
                )
            w.ready = True
        try:
            w.proc.stdin.write(body.encode() + b"\n")
            w.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            close()
            raise ArtifactError(f"the chat template in {where} ended the renderer", fix) from None
        line = w.line(time.monotonic() + seconds)
        if line is None:
            close()  # past the bound, or the worker died (the memory limit): a fresh one serves the next render
            raise ArtifactError(
                f"the chat template in {where} did not finish rendering within {seconds:g} s "
                "(a loop that does not end, or more memory than it may use)",
                fix,
            )
    ans = json.loads(line)
    if "error" in ans:
        raise ArtifactError(f"the chat template in {where} {ans['error']}", fix)
    return ans["text"]
