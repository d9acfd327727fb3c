"""The library's errors name an option by its API name, in backticks (`max_tokens`, or with a
value, `max_tokens=1`); the CLI prints the flag that sets it (--max-tokens, --max-tokens 1). A
name not listed here (a Python name in a message) is printed as it is."""

from __future__ import annotations

import re

from .. import api

_OPTIONS = (
    "max_tokens",
    "temp",
    "top_p",
    "top_k",
    "seed",
    "seq_len",
    "max_samples",
    "prefill_len",
    "decode_tokens",
    "repeats",
    "rounds",
    "warmup",
    "prompt_len",
    "samples",
    "decode_steps",
    "max_len",
    "baseline",
    "eval_data",
    "device",
    "block_size",
    "weights",
    "scheme",
    "dtype",
    "experts_layout",
    "component",
    "revision",
    "token",
    "format",
    "trust_remote_code",
    "ignore",
    "force",
    "private",
    "upload_repo",
    "num_samples",
    "sequential",
    "percentile",
    "manifest_sha256",
    "compute",
    "backend",
)
FLAGS = {name: "--" + name.replace("_", "-") for name in _OPTIONS} | {
    "data": "--calib-data",
    "scales_file": "--scales",
    "delete_unlisted": "--force-delete-unlisted",
}
# A setting turned off by a flag of its own: `--no-<name>`, but for the chat template's.
_SPELLED = {"use_template=False": "--ignore-chat-template"} | {
    f"{name}=False": f"--no-{name.replace('_', '-')}" for name in ("compile", "latency", "kv_cache")
}
_NAMED = re.compile(r"`([a-z][a-z0-9_]*)(?:=([^`]+))?`")


def as_flags(text: str) -> str:
    """`text` (an error's message) with the API's option names written as the CLI's flags."""

    def flag(m: re.Match) -> str:
        name, value = m.group(1), m.group(2)
        if m.group(0)[1:-1] in _SPELLED:
            return _SPELLED[m.group(0)[1:-1]]
        if name == "exports" and value in api.targets():  # quantize's --coreml, --coreai, ...
            return f"--{value}"
        found = FLAGS.get(name)
        if found is None:
            return m.group(0)
        return found if value is None else f"{found} {value}"

    return _NAMED.sub(flag, text)
