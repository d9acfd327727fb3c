"""mpsconvert: FP8 (float8_e4m3fn) artifacts for Apple Silicon and Core ML, checked against BF16."""

__version__ = "0.1.0"

from .errors import MpsconvertError  # noqa: E402

__all__ = ["MpsconvertError", "__version__"]
