"""The command line: a thin layer over `mpsconvert.api`.

`app.py` holds the command group, error and signal handling and the program's exit; each command
in `commands.py` parses its options, makes one API call and hands the result to `render.py`.
This package imports only the API, the error types and its own rendering.
"""

from . import commands  # noqa: F401  (registers the commands on `main`)
from .app import entry, main

__all__ = ["main", "entry"]
