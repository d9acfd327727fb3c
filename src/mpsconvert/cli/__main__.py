"""`python -m mpsconvert.cli`: the same program as the `mpsconvert` script."""

from .app import entry

entry()
