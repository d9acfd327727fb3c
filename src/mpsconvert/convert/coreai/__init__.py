"""Core AI export (Apple's successor of Core ML, macOS / iOS 27 and later): FP8 weights stored
natively as f8E4M3FN, a stateful decoder for causal LMs, checks on the Linux CPU runtime.

This module is light (no torch, no coreai): the CLI and the API read the names and options
from it without importing the exporter.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import MpsconvertError

COMPUTE_DTYPES = ("fp16", "fp32")
MINIMUM_OS = "macOS 27 / iOS 27 (Core AI)"
RUNTIME_LABEL = "Core AI runtime, Linux CPU"


@dataclass
class CoreAIOptions:
    """Settings of a Core AI export.

    max_len: causal LMs: the KV cache length (input_ids T from 1 to max_len, position + T <=
        max_len); encoders: the longest input. None: 2048, or the model's
        max_position_embeddings when that is smaller.
    compute: "fp32" (default) or "fp16". Dense tensors are stored in the artifact's dtype either
        way and FP8 weights as f8E4M3FN, so the asset's size does not depend on it. fp32 is the
        default because it is what the one Core AI runtime we can run (the Linux CPU runtime of
        coreai-core 1.0.0b3) runs right and fast: on SmolLM2-135M fp16 gave 93.8% top-1 vs
        PyTorch fp32 and was ~10x slower per decode step. fp16 is what Apple GPUs and the Neural
        Engine run natively; it has not been run on Apple hardware here.
    force: replace an existing model.aimodel.
    """

    max_len: int | None = None
    compute: str = "fp32"
    force: bool = False

    def __post_init__(self):
        if self.compute not in COMPUTE_DTYPES:
            raise MpsconvertError(f"unknown --compute {self.compute!r}", f"use one of: {', '.join(COMPUTE_DTYPES)}")
        if self.max_len is not None and (not isinstance(self.max_len, int) or self.max_len < 2):
            raise MpsconvertError(f"--max-len {self.max_len!r} is too short", "use at least 2 (default 2048)")
