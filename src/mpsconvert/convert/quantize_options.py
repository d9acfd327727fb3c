"""The options of an LLM conversion (`Options`), and what the planning learns about the checkpoint
tensors it hands to the writer: an FP8 source's scales (`SourceTensor`) and which tensors hold MoE
experts (`ExpertTensor`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import QuantizationError
from ..format import fp8
from ..format.schemes import Scheme
from ..model.moe_layout import ExpertParam
from . import EXPERTS_LAYOUTS, UNQUANTIZED_DTYPES, shard_size_bytes

DEFAULT_MAX_SHARD_SIZE = 10**9  # "1GB": an 8B model in 9 files, verified on 9 threads at load


@dataclass
class Options:
    scheme: Scheme = field(default_factory=Scheme)
    ignore: list[str] = field(default_factory=list)
    force: bool = False
    delete_unlisted: bool = False  # with force: also delete files the old artifact's manifest does not list
    trust_remote_code: bool = False
    # Static activation scales (module -> dequant scale), required by the "fp8" scheme. MoE
    # experts: "<experts module>.<param>" -> one scale per expert (calibrate.experts).
    input_scales: dict[str, float | list[float]] | None = None
    calibration: dict | None = None  # what produced input_scales, for the manifest
    device: str = "cpu"
    # Fused 3-D experts in the checkpoint: "per-expert" (write them split, loadable everywhere)
    # or "checkpoint" (keep them fused: only mpsconvert's runtime loads that).
    experts_layout: str = "per-expert"
    # The tensors that stay unquantized (embeddings, lm_head, norms): "bfloat16" | "float16" |
    # "float32", or None to copy them bit for bit in the source's dtype (as mlx-lm's --dtype).
    dtype: str | None = None
    # Output shards hold at most this many bytes (one tensor larger than that goes alone): a load
    # with verification hashes each file on its own thread (sha256 cannot be split), ~0.8 GB/s
    # per thread on the H200 host, so the largest shard bounds how fast the artifact loads.
    # Bytes, or a size such as "1GB" (made bytes by shard_size_bytes).
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    # FP8 source tensors (weight key -> SourceTensor), filled by prepare for an FP8 source
    fp8_tensors: dict = field(default_factory=dict)
    source_scheme: Scheme | None = None  # the scheme an FP8 source's codes and scales are in
    repack: bool = False  # an FP8 source whose codes are kept (the scheme asked for is its own)
    # what the conversion says about the source (tensors the model does not define)
    notes: list[str] = field(default_factory=list)
    # The leaf name of a weight's scale: compressed-tensors' `<m>.weight_scale`, or another
    # loader's (diffusers' SDNQ backend reads `<m>.scale`).
    scale_leaf: str = "weight_scale"

    def __post_init__(self):
        if self.experts_layout not in EXPERTS_LAYOUTS:
            raise QuantizationError(
                f"unknown experts layout {self.experts_layout!r}", f"use one of: {', '.join(EXPERTS_LAYOUTS)}"
            )
        self.max_shard_size = shard_size_bytes(self.max_shard_size)
        if self.dtype is not None and self.dtype not in UNQUANTIZED_DTYPES:
            raise QuantizationError(
                f"unknown dtype {self.dtype!r} for the unquantized tensors",
                f"use one of: {', '.join(UNQUANTIZED_DTYPES)}",
            )

    @property
    def dtype_code(self) -> str | None:
        """The safetensors dtype of converted float tensors (None: copied as they are)."""
        return UNQUANTIZED_DTYPES.get(self.dtype) if self.dtype else None

    def expert_input_scale(self, ep: ExpertParam, expert: int, module: str | None = None) -> float | None:
        """A calibrated input scale of one expert: `input_scales[<experts module>.<param>]`
        ([E] values, as `calibrate.experts` writes them) or a per-module float."""
        scales = self.input_scales or {}
        if ep.name in scales:
            return float(scales[ep.name][expert])
        if module is not None and module in scales:
            return float(scales[module])
        return None


@dataclass(frozen=True)
class SourceTensor:
    """One FP8 weight of an FP8 source: its scale (float32, as stored) and static input scale."""

    scale: torch.Tensor
    input_scale: torch.Tensor | None
    scale_key: str

    def decode(self, codes: torch.Tensor, row: int, source: Scheme) -> torch.Tensor:
        """float32 rows [row, row + len(codes)) of the source weight (row on a source block)."""
        s, b = self.scale, source.block
        if s.numel() > 1:
            s = s[row // b : -(-(row + codes.shape[0]) // b)] if b else s.reshape(-1, 1)[row : row + codes.shape[0]]
        return fp8.dequantize(codes, s, torch.float32, b)


@dataclass(frozen=True)
class ExpertTensor:
    """A checkpoint tensor holding MoE expert weights: one expert's rows, or a fused [E, N, K]."""

    param: ExpertParam
    expert: int | None  # None: the fused tensor of all experts
    split: tuple = ()  # fused tensor written as these per-expert slices (moe_layout.Slice)

    @property
    def module(self) -> str:
        return self.param.name
