"""The Core AI target (Apple's successor of Core ML, macOS / iOS 27 and later): FP8 weights
stored natively as f8E4M3FN, a stateful decoder for causal LMs, checks on the Linux CPU runtime.

`export.py` converts the artifact's PyTorch model, `weights.py` stores its FP8 Linears natively,
`run.py` is a session over the Core AI runtime, `check.py` checks a saved asset and times it.
This module holds the target (apple/protocol.py's protocol), its options and its manifest records
and is light (no torch, no coreai): the CLI and the API read them without importing the exporter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ...errors import MpsconvertError
from ...manifests import markdown as md
from ...manifests.records import AppleExport, RuntimeResult

ASSET_NAME = "model.aimodel"

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
            raise MpsconvertError(f"unknown `compute={self.compute!r}`", f"use one of: {', '.join(COMPUTE_DTYPES)}")
        if self.max_len is not None and (not isinstance(self.max_len, int) or self.max_len < 2):
            raise MpsconvertError(f"`max_len={self.max_len!r}` is too short", "use at least 2 (default 2048)")


@dataclass
class CheckOptions:
    """How an asset is checked: `prompt_len` tokens of real text in the prefill, `decode_steps`
    teacher-forced steps through the states, `generate` greedy tokens compared with PyTorch's."""

    prompt_len: int = 64
    decode_steps: int = 32
    generate: int = 4


@dataclass(kw_only=True)
class CoreAIExport(AppleExport, key="coreai", name="Core AI", fix="re-export it (`mpsconvert export-coreai --force`)"):
    """The manifest's `coreai` record: the asset, its interface and how it stores and computes."""

    PACKAGE_FIELD: ClassVar[str] = "asset"
    asset: str
    max_len: int
    compute: str = "fp32"
    interface: dict = field(default_factory=dict)
    minimum_os: str | None = None
    versions: dict = field(default_factory=dict)
    storage: dict = field(default_factory=dict)
    asset_bytes: int | None = None

    def card_lines(self, name: str, causal: bool) -> list[str]:
        run = f'mpsconvert generate {md.sh(name)} "Hello" --backend coreai'
        return [
            f"Core AI: {md.code(self.asset)} ({md.text(self.task)}, native f8E4M3FN weights, needs "
            f"{md.text(self.minimum_os)})" + (f"; {md.code(run)} runs it with the Core AI runtime." if causal else "."),
            "",
        ]

    def summary(self) -> str:
        return self.summary_of(
            self.minimum_os, self.asset_bytes or (self.check.more.get("asset_bytes") if self.check else None)
        )


@dataclass(kw_only=True)
class CoreAIRuntime(
    RuntimeResult, key="coreai_runtime", name="Core AI", fix="run `mpsconvert validate` again (it rewrites the record)"
):
    """The manifest's `coreai_runtime` record: the asset's latency beside PyTorch (Linux CPU runtime, or per unit on
    macOS)."""
