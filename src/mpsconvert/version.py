"""The package's version, in a module of its own: the manifest, the hub commit message and the
CLI read it from here, so that none of them imports the package root (which imports the API,
which imports them: a circle)."""

__version__ = "0.1.0"
