"""Optional dependencies, imported on demand with a one-line error naming the extra to install.

The core package needs only torch, transformers, safetensors, huggingface_hub, click and rich;
Core ML export, Core AI export and loading through compressed-tensors are extras, so a user who
never exports does not install coremltools. `require` is the one place that says which extra
brings which module.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import MissingExtraError

# extra -> what it enables (the README's table of extras says the same)
EXTRAS = {
    "coreml": "Core ML export and checks (coremltools)",
    "coreai": "Core AI export and checks (coreai-core, coreai-torch)",
    "ct": "loading artifacts back through transformers' compressed-tensors integration",
    "cuda": "the Triton FP8 kernels on NVIDIA GPUs",
    "data": "parquet calibration and evaluation files (pyarrow)",
    "diffusion": "diffusion models (diffusers, accelerate; sdnq and comfy-kitchen to load and validate the FP8 files)",
    "gguf": "quantizing a GGUF file (gguf; accelerate, which transformers >= 5.24 needs to load one)",
}


def require(module: str, extra: str, what: str | None = None) -> ModuleType:
    """Import `module`, or raise MissingExtraError naming `pip install 'mpsconvert[<extra>]'`.

    Args:
        module: the import name (e.g. "coremltools").
        extra: the mpsconvert extra that installs it (a key of EXTRAS).
        what: what needs it, for the message [default: the extra's description].

    Raises:
        MissingExtraError: the module (or one it imports) is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = getattr(e, "name", None) or module
        raise MissingExtraError(
            f"{what or EXTRAS.get(extra, extra)} needs {missing}, which is not installed",
            f"pip install 'mpsconvert[{extra}]'",
        ) from e
