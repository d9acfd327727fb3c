"""The command line: a thin layer over `mpsconvert.api`.

`app.py` holds the command group, error and signal handling and the program's exit; each command
(`convert_commands.py`, `check_commands.py`, `run_commands.py`, and `apple_commands.py`: those made from the
Apple targets; shared options in `options.py`) parses its options, makes one API call and hands the result to
`reports.py` (tables and summaries; `render.py`: consoles and messages, `progress_bars.py`: progress).
This package imports only the API, the error types and its own rendering.
"""

try:
    from .app import entry, main
    from .apple_commands import generated
    from .check_commands import inspect, upload, validate, verify
    from .convert_commands import calibrate
    from .run_commands import chat, generate

    for _command in (calibrate, inspect, validate, verify, generate, chat, upload):
        main.add_command(_command)
    main.generate = generated  # the group asks it for the commands made from the Apple targets
except KeyboardInterrupt:  # Ctrl-C while the program is still importing: one line, not a traceback
    import sys

    print("interrupted", file=sys.stderr)
    raise SystemExit(130) from None

__all__ = ["main", "entry"]
