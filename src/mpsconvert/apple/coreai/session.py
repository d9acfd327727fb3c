"""Running a Core AI asset: a synchronous session over coreai-core's async runtime API.

On Linux the runtime bundled in the `coreai-core` wheel runs the asset on the CPU (the asset is
lowered to the runtime's own format in a temporary folder each time it is loaded). On macOS 27+
the OS runtime specializes it for a preferred compute unit (`SpecializationOptions`, CPU / GPU /
Neural Engine). The API is used as documented: `AIModelAsset.load(path)`, `async with
asset.executable(options) as model`, `model.load_function("main")`, and
`await function(inputs, state=states)` with `coreai.runtime.NDArray` values; a state NDArray is
updated in place by each call, so one dict of states is one conversation.

`import coreai.authoring` has to come before any other coreai import (a circular import in
coreai-core 1.0.0b3 otherwise); `coreai()` does that, through `extras.require`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

from ...errors import ExportError
from ...infra.extras import require

COMPUTE_UNITS = ("cpu", "gpu", "neural_engine")
_DTYPES = {"Float32": np.float32, "Float16": np.float16, "Int32": np.int32, "Int64": np.int64, "Bool": np.bool_}


def coreai():
    """The `coreai` package, imported in the order it needs (authoring first)."""
    require("coreai.authoring", "coreai", "Core AI")
    return require("coreai.runtime", "coreai", "Core AI")


def coreai_torch():
    """coreai-torch (it warns at import about any torch newer than the one it was validated with,
    2.13.0, comparing local version suffixes too: 2.13.0+cpu; silenced)."""
    coreai()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return require("coreai_torch", "coreai", "Core AI export")


@contextlib.contextmanager
def native_output_captured():
    """Send what native code prints on fd 1 and 2 (the runtime's "ODIE [default]: Loading ...")
    to a temporary file for the duration, so that `--json` output and progress bars stay clean.
    The captured text is yielded as a list that is filled on exit."""
    captured: list[str] = []
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            s.flush()
    saved = []
    try:
        fds = [1, 2]
        saved = [os.dup(fd) for fd in fds]
    except OSError:  # no real file descriptors (embedded interpreters): nothing to capture
        yield captured
        return
    with tempfile.TemporaryFile() as tmp:
        try:
            for fd in fds:
                os.dup2(tmp.fileno(), fd)
            yield captured
        finally:
            for st in (sys.stdout, sys.stderr):  # what Python buffered inside goes to the capture too
                with contextlib.suppress(Exception):
                    st.flush()
            for fd, old in zip(fds, saved):
                os.dup2(old, fd)
                os.close(old)
            tmp.seek(0)
            captured.append(tmp.read().decode("utf-8", "replace"))


@contextlib.contextmanager
def quiet():
    """No warnings and no native or Python prints (coreai-torch's progress bar, its per-constant
    notes, the runtime's loading lines) while converting or loading; the text is yielded as a
    list filled on exit, for error messages."""
    with warnings.catch_warnings(), native_output_captured() as out:
        warnings.simplefilter("ignore")
        yield out


def parse_signature(text: str) -> tuple[str, list[int | None]]:
    """('float16', [1, 2, 64, 16]) from the summary's 'NDArray (Float16, 1 × 2 × 64 × 16)'
    ('?' -> None: a flexible dimension)."""
    m = re.fullmatch(r"\s*NDArray \((\w+)(?:, (.*))?\)\s*", text)
    if not m:
        raise ExportError(f"cannot read the Core AI signature {text!r}", "upgrade mpsconvert for this coreai-core")
    dims = [] if not m.group(2) else [None if d.strip() == "?" else int(d) for d in m.group(2).split("×")]
    return m.group(1).lower(), dims


def signature(asset) -> dict:
    """The function `main` of an asset: inputs, outputs and states as {name: (dtype, shape)}."""
    s = asset.summary(include_statistics=False)
    return {
        kind: {name: parse_signature(sig) for name, sig in getattr(s, f"function_{kind}")("main")}
        for kind in ("inputs", "outputs", "states")
    }


def specialization(unit: str | None, runtime=None, platform: str = sys.platform):
    """Core AI specialization options preferring `unit` (cpu | gpu | neural_engine) on macOS;
    None (the bundled CPU runtime) elsewhere or when `unit` is None. `runtime` is the
    `coreai.runtime` module (a fake in tests)."""
    if unit is None:
        return None
    if unit not in COMPUTE_UNITS:
        raise ExportError(f"unknown Core AI compute unit {unit!r}", f"use one of: {', '.join(COMPUTE_UNITS)}")
    if platform != "darwin":
        raise ExportError(
            f"Core AI compute unit {unit!r} needs macOS 27+", "run without a compute unit (the bundled CPU runtime)"
        )
    runtime = runtime or coreai()
    if not runtime.SpecializationOptions.is_supported():
        raise ExportError(
            "this coreai-core cannot specialize for a compute unit (the OS runtime is not in use)",
            "run on macOS 27+ with USE_OS_COREAI=1, as coreai-core documents",
        )
    kind = getattr(runtime.ComputeUnitKind, unit)()
    return runtime.SpecializationOptions.from_preferred_compute_unit_kind(kind)


class Session:
    """A loaded asset's function `main`, called synchronously.

        with Session(path) as s:
            state = s.new_state()
            out = s.run({"input_ids": ids, "position": pos}, state)   # numpy in, numpy out

    Args:
        path: the .aimodel folder.
        unit: a compute unit to specialize for (macOS only), or None for the default runtime.
        runtime: the `coreai.runtime` module (tests pass a fake).
        authoring: the `coreai.authoring` module (tests pass a fake).
    """

    def __init__(self, path: Path, unit: str | None = None, runtime=None, authoring=None):
        if runtime is None:
            runtime = coreai()
        if authoring is None:
            import coreai.authoring as authoring  # imported (first) by coreai()
        self.path = Path(path)
        self._rt = runtime
        self._options = specialization(unit, runtime) if unit else None
        self._asset = authoring.AIModelAsset.load(self.path)
        self.signature = signature(self._asset)
        self.log: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._cm = None
        self._fn = None

    def __enter__(self) -> "Session":
        self._cm = self._asset.executable(self._options)
        with native_output_captured() as out:
            model = self._loop.run_until_complete(self._cm.__aenter__())
            self._fn = model.load_function("main")
        self.log += out
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._cm is not None:
                self._loop.run_until_complete(self._cm.__aexit__(*exc))
        finally:
            self._loop.close()

    def new_state(self) -> dict:
        """Zero-filled states for a new conversation, as the function declares them."""
        return {
            name: self._rt.NDArray(np.zeros(shape, dtype=_DTYPES[dt.capitalize()]))
            for name, (dt, shape) in self.signature["states"].items()
        }

    def run(self, inputs: dict[str, np.ndarray], state: dict | None = None) -> dict[str, np.ndarray]:
        feeds = {}
        for name, value in inputs.items():
            want = self.signature["inputs"].get(name)
            if want is None:
                raise ExportError(
                    f"the Core AI function has no input {name!r}",
                    f"its inputs are {', '.join(self.signature['inputs'])}",
                )
            feeds[name] = self._rt.NDArray(np.ascontiguousarray(value, dtype=_DTYPES[want[0].capitalize()]))
        out = self._loop.run_until_complete(self._fn(feeds, state=state or {}))
        return {k: np.array(v.numpy(), copy=True) for k, v in out.items()}
