"""The `mpsconvert` program: the command group, error and signal handling, and the exit path.

Every user-fixable problem is an MpsconvertError, printed as one line (`error: ...`) with a
non-zero exit; anything else is a bug and keeps its traceback. Ctrl-C (SIGINT) and SIGTERM are
one line and exit 130 / 143 from the moment `entry` runs: also while click parses, and while a
command imports torch or transformers, where the KeyboardInterrupt can surface as some other
error of a half-imported module (an ImportError, "cannot read config.json"): once a stop was
asked for, whatever ends the command is the stop.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import sys
import threading
from typing import Callable

import click

from .. import api
from ..errors import MpsconvertError
from ..infra.untrusted import is_panic
from . import render
from .flags import as_flags


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that cleanup (temporary outputs) runs as for Ctrl-C."""


_caught: list[int] = []  # signals received during the current command


def _on_signal(signum, frame):
    _caught.append(signum)
    api.stop_requested.set()
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _handle_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)


def _interrupted(terminated: bool) -> None:
    render.console.print("[bold red]interrupted[/]: partial output removed")
    sys.exit(143 if terminated else 130)


def friendly_errors(fn):
    """Turn MpsconvertError into `error: <problem>; <fix>` and exit code 2; Ctrl-C into exit 130,
    SIGTERM into 143, after the partial output is removed (whatever error the interruption
    surfaced as)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            if _caught:  # a Ctrl-C while click parsed the command line: stop before any work
                _interrupted(signal.SIGTERM in _caught)
            api.stop_requested.clear()
            _handle_signals()
            return _run(fn, args, kwargs)
        finally:
            _caught.clear()  # the next command of this process (tests run many) starts afresh

    return wrapper


def _run(fn, args, kwargs):
    try:
        result = fn(*args, **kwargs)
    except KeyboardInterrupt as e:
        _interrupted(isinstance(e, Terminated))
    except MpsconvertError as e:
        if api.stop_requested.is_set():  # e.g. a config "unreadable" because the import of its class was cut short
            _interrupted(signal.SIGTERM in _caught)
        render.error(as_flags(str(e)))
        sys.exit(e.exit_code)
    except Exception:
        if api.stop_requested.is_set():  # an ImportError of a module whose import the signal cut short: no traceback
            _interrupted(signal.SIGTERM in _caught)
        raise
    except (
        BaseException
    ) as e:  # a Rust panic (pyo3's PanicException) raised by what a file or the input made a library do
        if not is_panic(e):
            raise
        render.error(
            "a library's Rust code panicked on this input "
            f"({str(e).splitlines()[0][:160] if str(e) else 'no message'}); the input (a tokenizer file, "
            "the text) is what it could not handle"
        )
        sys.exit(2)
    if api.stop_requested.is_set():  # the signal came after the output was complete (or its exception was lost)
        render.console.print("[bold red]interrupted[/] after the output was complete")
        sys.exit(143 if signal.SIGTERM in _caught else 130)
    return result


class Commands(click.Group):
    """The command group: the commands defined on it, and those `generate()` makes from the
    registry of Apple targets (quantize with its --<target> options, export-<target>), made when
    they are asked for, so that a target registered after this module was imported has them too."""

    generate: Callable[[], dict[str, click.Command]] = staticmethod(dict)

    def list_commands(self, ctx) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.generate()))

    def get_command(self, ctx, name: str):
        return self.generate().get(name) or super().get_command(ctx, name)


# Every command's --help shows each option's default (one that is None or a flag's off is left out).
@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(api.__version__, prog_name="mpsconvert")
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Also show third-party progress bars, warnings and log lines (transformers, coremltools, ...).",
)
def main(verbose):
    """Convert Hugging Face models to FP8 (float8_e4m3fn) for Apple Silicon, Core ML and Core AI, and check them.

    \b
    Typical use:
      mpsconvert quantize Qwen/Qwen2.5-0.5B -o qwen-fp8      # data-free, dynamic activations
      mpsconvert validate qwen-fp8                           # accuracy and latency vs BF16
      mpsconvert generate qwen-fp8 "Why is the sky blue?"
      mpsconvert upload qwen-fp8 me/Qwen2.5-0.5B-FP8
    """
    from . import quiet

    quiet.apply(verbose)


def entry() -> None:
    """The `mpsconvert` program: run the command, then exit without unloading the interpreter.

    Tearing down torch and transformers module by module at exit takes about a second on 2
    cores (a third of a small conversion, and the delay between Ctrl-C and the prompt coming
    back). Nothing needs it: every output is written, synced and closed before a command
    returns; atexit handlers still run and the streams are flushed.
    """
    _handle_signals()  # from here on Ctrl-C is one line and exit 130 (click would say "Aborted!" and exit 1)
    try:
        main()  # click's standalone mode: always ends in SystemExit
        code = 0
    except SystemExit as e:
        code = e.code
    if _caught and code not in (
        130,
        143,
    ):  # stopped outside a command (while click parsed): click printed nothing useful
        code = 143 if signal.SIGTERM in _caught else 130
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say
            pass
    os._exit(code)
