"""The command line: a thin layer over `mpsconvert.api`.

`app.py` holds the command group, error and signal handling and the program's exit; each command
in `commands.py` parses its options, makes one API call and hands the result to `reports.py`
(tables and summaries; `render.py`: consoles and messages, `progress_bars.py`: progress).
This package imports only the API, the error types and its own rendering.
"""

try:
    from . import commands  # noqa: F401  (registers the commands on `main`)
    from .app import entry, main
except KeyboardInterrupt:  # Ctrl-C while the program is still importing: one line, not a traceback
    import sys

    print("interrupted", file=sys.stderr)
    raise SystemExit(130) from None

__all__ = ["main", "entry"]
