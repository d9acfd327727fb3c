"""mpsconvert: FP8 (float8_e4m3fn) artifacts for Apple Silicon, Core ML and Core AI, checked against BF16.

The library API (mpsconvert/api.py) is re-exported here:

    from mpsconvert import quantize, calibrate, validate, verify, inspect, export, check, load
"""

from .version import __version__

from .errors import (  # noqa: E402
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
from .api import (  # noqa: E402
    CalibrateResult,
    Chat,
    GenerateResult,
    UploadResult,
    CoreAIResult,
    CoreMLResult,
    ExportResult,
    QuantizeResult,
    ValidationResult,
    calibrate,
    calibration_options,
    chat,
    check,
    check_coreai,
    check_coreml,
    coreai_latency,
    export,
    export_coreai,
    export_coreml,
    generate,
    inspect,
    load,
    quantize,
    targets,
    upload,
    validate,
    validate_options,
    verify,
)

__all__ = [
    "__version__",
    "quantize", "calibrate", "validate", "verify", "inspect", "export", "check", "targets", "export_coreml", "check_coreml",
    "export_coreai", "check_coreai", "coreai_latency", "load", "generate", "chat", "upload", "calibration_options", "validate_options",
    "QuantizeResult", "CalibrateResult", "ValidationResult", "ExportResult", "CoreMLResult", "CoreAIResult",
    "GenerateResult", "Chat", "UploadResult",
    "MpsconvertError", "SourceError", "QuantizationError", "ArtifactError", "DeviceError", "DataError",
    "ExportError", "EvalError", "MissingExtraError", "UploadError",
]
