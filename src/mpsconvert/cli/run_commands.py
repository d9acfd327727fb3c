"""The running commands: generate (one prompt, streamed) and chat (a conversation kept in history), on the torch
runtime or an Apple target's backend."""

from __future__ import annotations

from pathlib import Path

import click

from .. import api
from ..errors import PromptError
from . import render, reports
from .app import friendly_errors
from .flags import as_flags
from .options import sampling_options
from .progress_bars import progress_bars


def _decode_arg(decode: str, no_compile: bool):
    """`compile` for api.chat from --decode and --no-compile (which asks the eager loop)."""
    if no_compile and decode not in ("auto", "eager"):
        raise click.UsageError(f"--no-compile asks the eager loop; it contradicts --decode {decode}")
    return "eager" if no_compile else None if decode == "auto" else decode


def _open_chat(artifact, decode, no_compile, **sampling):
    """The loaded chat session that generate and chat drive, from their shared sampling options (`sampling_options`)."""
    with progress_bars() as progress:
        return api.chat(artifact, progress=progress, compile=_decode_arg(decode, no_compile), **sampling)


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("prompt")
@sampling_options
@click.option(
    "--ignore-chat-template", is_flag=True, help="Feed PROMPT as it is, not wrapped in the tokenizer's chat template."
)
@friendly_errors
def generate(artifact, prompt, as_json, ignore_chat_template, **sampling):
    """Generate text from ARTIFACT for PROMPT, streamed as it comes, then tokens/s, peak memory and device.

    \b
    PROMPT is wrapped in the tokenizer's chat template when it has one (as mlx_lm.generate does);
    `-` reads it from standard input (`cat notes.txt | mpsconvert generate DIR -`).
    """
    if prompt == "-":
        prompt = render.read_prompt()
    with _open_chat(artifact, **sampling) as c:
        res = c.complete(prompt, None if as_json else render.stream, use_template=not ignore_chat_template)
        reports.generation(res, as_json)
        render.kernels_note(c)


# chat's commands: a line of one word starting with "/" that is none of these is not sent to the model
CHAT_COMMANDS = {"end": ("/exit", "/quit", "/bye"), "reset": ("/reset", "/clear"), "help": ("/help", "/?")}
CHAT_HELP = (
    "/exit (or /quit, end of input) ends, /reset forgets the history; a message may start with / where it has a space"
)


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@sampling_options
@friendly_errors
def chat(artifact, as_json, **sampling):
    """Chat with ARTIFACT: the tokenizer's chat template, the history kept; `/exit` (or `/quit`, or end
    of input) ends, `/reset` forgets, `/help` lists these."""
    with _open_chat(artifact, **sampling) as c:
        c.require_template()  # before the prompt, not at the first message
        render.note(
            f"chatting with {artifact} ({c.backend} on {c.device}); /exit to end, /reset to forget the history, /help"
        )
        while True:
            try:
                line = render.ask()
            except PromptError as e:  # a message that cannot be sent: said, and the chat goes on
                render.error(as_flags(str(e)))
                continue
            command = line.strip() if line is not None else "/exit"
            if command in CHAT_COMMANDS["end"]:
                break
            if command in CHAT_COMMANDS["reset"]:
                c.reset()
                render.note("history cleared")
                continue
            if not command:
                continue
            if command.startswith("/") and not any(
                ch.isspace() for ch in command
            ):  # one word: meant as a command, not a message
                known = command in CHAT_COMMANDS["help"]
                render.note(("" if known else f"unknown command {command}: ") + CHAT_HELP)
                continue
            try:
                res = c.say(line, None if as_json else render.stream)
            except PromptError as e:  # too long for the model even alone: said, and the chat goes on
                render.error(as_flags(str(e)))
                continue
            if res.dropped:
                render.warn(
                    f"the history outgrew the model's context: the {res.dropped} oldest message(s) were dropped"
                )
            reports.generation(res, as_json, turn=True)
        render.kernels_note(c)
