"""mpsconvert: FP8 (float8_e4m3fn) artifacts for Apple Silicon, Core ML and Core AI, checked against BF16.

The library API (mpsconvert/api.py, its `__all__`) is re-exported here with the errors it raises:

    from mpsconvert import quantize, calibrate, validate, verify, inspect, export, check, load
"""

from . import api
from .api import *  # noqa: F403  (api.__all__ is the one list of the public operations and their types)
from .errors import (
    ArtifactError,
    DataError,
    DeviceError,
    EvalError,
    ExportError,
    MissingExtraError,
    MpsconvertError,
    QuantizationError,
    SourceError,
    UploadError,
)
from .version import __version__

__all__ = [
    "__version__",
    *api.__all__,
    "MpsconvertError",
    "SourceError",
    "QuantizationError",
    "ArtifactError",
    "DeviceError",
    "DataError",
    "ExportError",
    "EvalError",
    "MissingExtraError",
    "UploadError",
]
