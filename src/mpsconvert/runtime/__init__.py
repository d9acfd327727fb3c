"""The FP8 runtime: load artifacts as transformers models with FP8 layers, pick kernels per device
and shape by measurement, and validate accuracy and speed against BF16.

    from mpsconvert.runtime import load
    model = load("qwen-fp8", device="auto")     # model.mpsconvert says what was verified and chosen
"""

from .load.load_report import LoadInfo
from .load.loader import load

__all__ = ["LoadInfo", "load"]
