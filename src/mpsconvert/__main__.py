"""`python -m mpsconvert ...`: the `mpsconvert` program, for environments where the console
script is not on PATH (a venv not activated, `pipx run`, an IDE's interpreter)."""

from .cli import entry

if __name__ == "__main__":
    entry()
