"""What the CLI shows, at its base: the two consoles, messages, and the text of generate / chat
(streamed out, prompts read in). No decisions, no work; tables of results are in reports.py,
progress in progress_bars.py.

Output that a script reads (`--json`, tables) goes to stdout (`out`); progress, status and errors
go to stderr (`console`).

Names from an artifact or a source (files, tensors, a folder, a dataset) are text: every one goes
through `shown` (rich markup escaped, control characters such as ANSI / OSC escape sequences
shown as `\\x1b`), and a number from a manifest that is not one shows as "?" (`num`).
"""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape

from ..errors import PromptError
from ..infra.untrusted import LIMITS, printable, prompt_length, shown_text

console = Console(stderr=True)  # progress, status, warnings, errors
out = Console()  # results


def print_json(body) -> None:
    out.print_json(json.dumps(body))


def shown(x) -> str:
    """Untrusted text for a rich console: markup escaped, control characters as escapes."""
    return escape(printable(x))


def warn(message: str) -> None:
    console.print(f"[yellow]warning:[/] {shown(message)}", highlight=False, soft_wrap=True)


def error(message: str) -> None:
    # escaped: "pip install 'mpsconvert[coreai]'" is text, not rich markup; a name in it is shown, never acted on
    console.print(f"[bold red]error:[/] {shown(message)}", highlight=False, soft_wrap=True)


def note(message: str) -> None:
    console.print(printable(message), highlight=False, markup=False)


def kernels_note(chat) -> None:
    """Said as a chat closes on a machine's first run, before it waits for the GPU kernels still
    compiling (api.Chat.close), so that the wait is not taken for a hang."""
    if chat.kernels_held:
        note("compiling this machine's GPU kernels for the next run (first run only)...")


def result(message: str) -> None:
    out.print(printable(message), highlight=False, markup=False)


# --------------------------------------------------------------------------- generate / chat


def stream(piece: str) -> None:
    """Generated text as it comes, on stdout, unbuffered. On a terminal it is shown, never acted
    on: a model's vocabulary can hold escape sequences (`ESC]0;...BEL` retitles the window,
    `ESC[2J` clears it), so every control character but line breaks and tabs is printed as an
    escape (untrusted.shown_text). Piped, it is the model's text as it is (data)."""
    import sys

    sys.stdout.write(shown_text(piece) if _is_terminal(sys.stdout) else piece)
    sys.stdout.flush()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def read_prompt() -> str:
    """All of standard input as the prompt (`generate ART -`): at most the limit on prompt
    characters (untrusted.LIMITS; 4 bytes a character at most), UTF-8; else one PromptError line."""
    import sys

    limit = int(LIMITS["prompt characters"][1])
    raw = _binary(sys.stdin).read(4 * limit + 1)
    text = _decoded(raw, "standard input")
    if len(raw) > 4 * limit or len(text) > limit:
        raise PromptError(
            f"standard input holds more than {limit:,} characters (the limit on prompt characters)",
            "pass a shorter prompt",
        )
    return text


def ask() -> str | None:
    """One line of user input for chat (None at end of input): UTF-8 (else one PromptError
    line), at most the limit on prompt characters (a longer line is read to its end and refused
    without being kept, let alone tokenized)."""
    import sys

    console.print("[bold]>>[/] ", end="")
    limit = int(LIMITS["prompt characters"][1])
    src = _binary(sys.stdin)
    raw = src.readline(4 * limit + 1)
    if raw == b"" or raw == "":
        return None
    if len(raw) > 4 * limit and not raw.endswith(b"\n"):
        while (more := src.readline(1 << 20)) and not more.endswith(
            b"\n"
        ):  # the rest of the line is dropped unread into memory
            pass
        raise PromptError(
            f"the message is longer than {limit:,} characters (the limit on prompt characters)",
            "send a shorter message",
        )
    text = _decoded(raw, "the message").removesuffix("\n")
    prompt_length(text, "the message", "send a shorter message")
    return text


def _binary(stream):
    """The bytes under a text stream (click's test runner and a real stdin both have one)."""
    return getattr(stream, "buffer", stream)


def _decoded(raw, what: str) -> str:
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptError(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})", "pass UTF-8 text") from None
