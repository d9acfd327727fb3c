"""Kernel tuning measured on the GPUs named in tuned.json, shipped so that a fresh machine of the
same GPU starts with it instead of measuring it again.

Why: with nothing cached, a load compiles every candidate decode kernel in every configuration
(37 configurations per layer shape), lets the autotuners time them, and has the kernel policy time
each FP8 kernel per decode and prefill bucket, all before the first token. On an H100 (Llama-3-8B
shape) the first load waited 14 s for those compiles and spent 4 s timing, nearly half of a one-shot
`generate` (benchmarks/results/first_run_tuning_h100.json: its "fresh load" is where the H100
entry was taken from). Where this GPU's name and a layer signature are
in tuned.json, the kernel policy takes the timings recorded there (its decision then reads
`source: "prior"`; the chosen kernel is still checked against the dequantized product before it is
used), the warm-up compiles only the chosen decode kernel, and each autotuned kernel compiles only
the configuration recorded for its key (Triton's `early_config_prune`). A GPU, shape or scheme not
listed is measured as before. What is recorded is what the measurement chose on that GPU model, so
a prior changes which kernel is picked only where two machines of one model would measure apart.

`MPSCONVERT_TUNED=0` ignores the table (every choice measured); benchmarks/first_run.py prints what
a fresh load measured and chose, which is how an entry is made: `tuned.json` holds, per device name,
"policy" (the policy's cache entries without the version fields of its key) and "autotune" (per
kernel, the autotuning key's values -> the chosen configuration).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

FILE = Path(__file__).with_name("tuned.json")


def enabled() -> bool:
    return os.environ.get("MPSCONVERT_TUNED", "1") != "0"


@functools.cache
def _table() -> dict:
    """The shipped table (a file of this package, not user input); {} where it is absent or unreadable."""
    try:
        body = json.loads(FILE.read_text())
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def policy_key(sig: tuple, bucket: str, m: int) -> str:
    """A layer signature's entry in a device's "policy" table (policy.cache_key without the versions)."""
    n, k, w, a = sig
    return f"{n}x{k}|weights={w}|acts={a or 'bf16'}|{bucket} M={m}"


def timings(device_name: str, sig: tuple, bucket: str, m: int) -> dict | None:
    """{kernel: microseconds} recorded for this signature and bucket on a GPU named `device_name`, or None."""
    if not enabled():
        return None
    hit = _table().get(device_name, {}).get("policy", {}).get(policy_key(sig, bucket, m))
    return dict(hit) if isinstance(hit, dict) and hit else None


def decode_choice(device_name: str, sig: tuple, m: int = 1) -> str | None:
    """The decode kernel recorded as fastest for this signature (M `m` tokens), or None."""
    t = timings(device_name, sig, "decode", m)
    ok = {k: v for k, v in (t or {}).items() if isinstance(v, (int, float))}
    return min(ok, key=ok.get) if ok else None


def autotune_key(keys: list[str], args: dict) -> str:
    """An autotuning key's values as tuned.json spells them: "N=4096,K=4096,M=1,GATED=False"."""
    return ",".join(f"{k}={args.get(k)}" for k in keys)


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


# Key flags of a GEMV's fused forms (ops/triton/gemv.py: an RMSNorm before it, a residual add after it),
# a few loads more than its plain form, whose recorded configuration they take where none of their own is
FUSED_FORMS = ("NORM", "RESIDUAL")


def prune(kernel: str, keys: list[str]):
    """Triton's `early_config_prune` for the autotuned `kernel`: on a GPU whose recorded
    configuration for these key values is among `configs` (or, for a fused form, its plain form's:
    FUSED_FORMS), that one alone (one compile, no timing); else every configuration."""

    def early_config_prune(configs, named_args, **kwargs):
        if not enabled() or not torch.cuda.is_available():
            return configs
        rows = _table().get(_device_name(torch.cuda.current_device()), {}).get("autotune", {}).get(kernel, {})
        args = {**named_args, **kwargs}
        want = rows.get(autotune_key(keys, args))
        if want is None:  # a fused norm prologue or residual epilogue not recorded: its plain form's tile
            want = rows.get(autotune_key(keys, {**args, **{k: False for k in FUSED_FORMS if k in keys}}))
        if not isinstance(want, dict):
            return configs
        same = [c for c in configs if {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} == want]
        return same or configs

    return early_config_prune
