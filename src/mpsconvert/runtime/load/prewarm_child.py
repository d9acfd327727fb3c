"""The load's warm-up run first in a child process, from the artifact's own description.

Why: the warm-up (prewarm.py) compiles and autotunes the Triton kernels a model will run, and
Triton's compile holds the GIL for much of its work (its code generation is Python). On a thread
beside the load, the 37 decode-kernel configurations took 9.4-9.7 s on a fresh 16-core H100
host, against 5.6 s when the main thread was idle, and they could only start once the model was
built (10-12 s into the load): the first load waited 5.7-8.9 s for them
(benchmarks/results/generate_cuda_h100_llama32_run3.log). A child process has its own
interpreter: it starts with the load, does the same work from what the artifact says of itself
(config.json and the shards' headers: no model build, no transformers import) while the parent
verifies the manifest and builds the model, and leaves its results in Triton's on-disk caches
(compiled kernels, autotuner timings). The parent's warm-up then runs and finds them there.
Measured on a fresh H100 host (docs/benchmarks.md): the first layer
shape's decode-kernel warm-up in the parent 10.4 s -> 0.15 s, the cold load 37.5 s -> 27.5-30.2 s.

What is read here is read before the artifact is verified, so it is a hint: it only sizes
scratch tensors (each at most the bytes its file holds) and picks which kernels to compile.
The parent's thread starts the child with nothing left to import (every module this needs is
imported with the loader): an import on that thread beside the main thread's import of
transformers made transformers' lazy module fail ("no attribute 'AutoConfig'").
Nothing the child does is used as a result; the parent still makes every call itself and checks
what it installs. A hint that is wrong, a child that fails or is slow, only costs the time it
would have saved (the parent then compiles what it needs itself); the report says which ran.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from ...errors import MpsconvertError
from ...format.ct_config import scheme_from_config
from ...format.schemes import Activations
from ...infra.child import MIN_CPUS, Child, serve
from ...infra.safetensors_io import read_header
from ...infra.untrusted import inside, read_json
from ..ops import triton as tritonlib
from . import policy, prewarm

# config.json's entries the warm-up reads (prewarm._work, `_heads`), each checked for its type and size
CONFIG_KEYS = {
    "hidden_size": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "head_dim": int,
    "rms_norm_eps": float,
}
MAX_WIDTH = 1 << 20  # no model's width comes near; a larger one in an untrusted config is not believed
# GPU memory the child's CUDA context and scratch tensors may take beside the model's weights
HEADROOM = 2 << 30


def request(path: Path, dtype: torch.dtype, dev: torch.device) -> dict | None:
    """What the child needs to warm up for the artifact at `path`, read from its config.json and
    shard headers (unverified: a hint), or None where they do not say (a model of another layout,
    fused experts only, files outside the folder)."""
    path = Path(path)
    root = path.parent.parent if path.parent.name == "snapshots" else path  # the HF cache keeps blobs beside a snapshot
    try:
        body = read_json(path / "config.json")
        scheme = scheme_from_config(body.get("quantization_config"))
        linears, nbytes = {}, 0
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                shard = inside(path, name, what=str(path), root=root)
                nbytes += shard.stat().st_size
                for t in read_header(shard).tensors.values():
                    if t.dtype == "F8_E4M3" and len(t.shape) == 2 and t.name.endswith(".weight"):
                        linears[t.name.removesuffix(".weight")] = list(t.shape)
    except (MpsconvertError, OSError, ValueError):
        return None
    if not linears:
        return None
    config = {}
    for key, kind in CONFIG_KEYS.items():
        v = body.get(key)
        if isinstance(v, kind) and not isinstance(v, bool) and 0 < v <= MAX_WIDTH:
            config[key] = v
    rows, rowwise, decode = prewarm.job_of(scheme)
    return {
        "device": dev.index if dev.index is not None else torch.cuda.current_device(),
        "dtype": str(dtype).removeprefix("torch."),
        "config": config,
        "linears": linears,
        "rows": rows,
        "rowwise": rowwise,
        "decode": list(decode),
        "bytes": nbytes,
    }


def start(dev: torch.device, path: Path, dtype: torch.dtype, kernel_cache=None) -> Child | None:
    """The child warming up for the artifact at `path` on `dev`, or None where it would not pay:
    not CUDA, no Triton, fewer than MIN_CPUS cores (the child's compiles would take the parent's),
    no hint (`request`), kernels this machine measured before (`kernel_cache`, as `load` takes it:
    their compiles are in Triton's cache, and the child's own start, 4-6 s on the H100 host,
    would make a warm load slower: 7.5 against 3.0 s when it was always started), or too little
    free GPU memory for a second CUDA context beside the model."""
    if dev.type != "cuda" or not tritonlib.available() or (os.cpu_count() or 1) < MIN_CPUS:
        return None
    body = request(path, dtype, dev)
    if body is None:
        return None
    sigs = prewarm.signatures({k: tuple(v) for k, v in body["linears"].items()}, body["decode"])
    if kernel_cache is False or policy.decided_before(torch.cuda.get_device_name(dev), sigs, kernel_cache):
        return None
    if torch.cuda.mem_get_info(dev)[0] < body["bytes"] + HEADROOM:  # the weights and a second context
        return None
    return Child(__name__, body)


def _main(request: dict) -> dict:
    """In the child: the parent's warm-up for these shapes (prewarm._work), its report."""
    t = time.perf_counter()
    dev = torch.device("cuda", request["device"]) if request["device"] != "cpu" else torch.device("cpu")
    report: dict = {"warmed": [], "failed": []}
    weights, activations, block = request["decode"]
    decode = (weights, Activations(activations) if activations is not None else None, block)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        if dev.type == "cuda":  # Triton's first use as a step of its own, so that the report tells it from the compiles
            prewarm._first_use(report)
        prewarm._work(
            SimpleNamespace(**request["config"]),
            {k: tuple(v) for k, v in request["linears"].items()},
            getattr(torch, request["dtype"]),
            dev,
            request["rows"],
            request["rowwise"],
            report,
            decode,
        )
    report["seconds"] = round(time.perf_counter() - t, 3)
    return report


if __name__ == "__main__":
    serve(_main)
