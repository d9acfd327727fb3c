"""Untrusted names in the model card: text, never Markdown, HTML or shell.

A card is built from the source and the manifest (a folder name, tensor names, a dataset id, an
export record): each name goes in through one of these, and a number that is not one shows as
"?". The card (card.py) and each Apple target's paragraph (apple/*: `card_lines`) use them.
"""

from __future__ import annotations

import html
import json
import re
import shlex

from ..infra.units import num  # noqa: F401  (a number from the manifest, or '?': the card's too)
from ..infra.untrusted import printable

# Markdown's active characters; `_` only where it could open or close emphasis (CommonMark never
# reads an underscore between two letters or digits as emphasis: `Q4_1`, `down_proj` stay as written)
_MARKDOWN = re.compile(r"[\\`*\[\]|~#!]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def text(x) -> str:
    """Untrusted text in prose or a table cell: shown as it is, never as Markdown or HTML."""
    return _MARKDOWN.sub(lambda m: "\\" + m.group(), html.escape(printable(str(x)), quote=False))


def code(x) -> str:
    """Untrusted text as inline code: a backtick fence longer than any run inside it, `|` escaped
    (a table cell), control characters escaped."""
    s = printable(str(x)).replace("|", "\\|")
    fence = "`" * (max((len(r) for r in re.findall(r"`+", s)), default=0) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def sh(x) -> str:
    """A shell argument (quoted where it needs it)."""
    return shlex.quote(printable(str(x)))


def py(x) -> str:
    """A Python string literal."""
    return json.dumps(printable(str(x)), ensure_ascii=False)


def block(lang: str, lines: list[str]) -> list[str]:
    """A fenced code block whose fence no line inside can close."""
    fence = "`" * max(3, max((len(r) for line in lines for r in re.findall(r"`+", line)), default=0) + 1)
    return [fence + lang, *lines, fence]
