"""The Core ML target: an FP8 artifact as a Core ML ML program (`model.mlpackage`), and its checks.

`export.py` converts the artifact's PyTorch model (`apple/torch_model.py`; causal LMs as the
stateful decoder of `apple/stateful.py`), keeping FP8 codes as an 8-bit palette; `ops.py` adds
the torch converters coremltools lacks; `check.py` checks a saved package anywhere (spec, weights
read back, reference evaluation) and with Core ML on macOS; `mil_eval.py` is the numpy reference
evaluator. This module holds the target (apple/protocol.py's protocol), its options and its
manifest records, and imports nothing heavy, so the CLI and the API read them without loading
coremltools or torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ...errors import MpsconvertError
from ...manifests import markdown as md
from ...manifests.records import AppleExport, RuntimeResult

PACKAGE_NAME = "model.mlpackage"

WEIGHT_MODES = ("fp8-lut", "int8", "fp16")
FRONTENDS = ("torch.export", "torch.jit.trace")


@dataclass(frozen=True)
class SeqLen:
    """A fixed sequence length (lo == hi) or a range lo..hi (a Core ML RangeDim)."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str | int) -> "SeqLen":
        s = str(text).strip()
        m = re.fullmatch(r"(\d+)(?::(\d+))?", s)
        if not m:
            raise MpsconvertError(
                f"`seq_len={s!r}` is not a length or a range", "use e.g. `seq_len=128` or `seq_len=1:512`"
            )
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if lo < 1 or hi < lo:
            raise MpsconvertError(
                f"`seq_len={s!r}` is empty or starts below 1", "use 1 <= LO <= HI, e.g. `seq_len=1:512`"
            )
        return cls(lo, hi)

    @property
    def is_range(self) -> bool:
        return self.hi > self.lo

    @property
    def example(self) -> int:
        """The length traced with: inside the range and not 1 (a dim of 1 gets specialized)."""
        return self.lo if not self.is_range else max(self.lo, 2, min(self.hi, 16))

    def __str__(self) -> str:
        return f"{self.lo}:{self.hi}" if self.is_range else str(self.lo)


@dataclass
class ExportOptions:
    """How to export: the interface, how FP8 weights are stored, replace, which frontend.

    kv_cache: causal LMs as the stateful decoder (apple/stateful.py) with a KV cache of
    max_len tokens (None: 2048, or the model's max_position_embeddings when smaller); False
    keeps the stateless input_ids -> logits form. seq_len: encoders and stateless packages
    (fixed, or a range)."""

    seq_len: SeqLen = SeqLen(128, 128)
    weights: str = "fp8-lut"  # one of WEIGHT_MODES
    force: bool = False
    frontend: str = "auto"  # "auto" (torch.export, then torch.jit.trace), or one of FRONTENDS
    kv_cache: bool = True
    max_len: int | None = None


@dataclass
class CheckOptions:
    """How a package is checked: `samples` one-pass text samples (encoders, stateless packages) or,
    for stateful decoders, `decode_steps` teacher-forced steps through the states."""

    samples: int = 3
    decode_steps: int = 16


@dataclass(kw_only=True)
class CoreMLExport(AppleExport, key="coreml", name="Core ML", fix="re-export it (`mpsconvert export-coreml --force`)"):
    """The manifest's `coreml` record: the package, its interface and how its weights are stored."""

    package: str
    weights: str = "fp8-lut"
    kv_cache: bool = False
    seq_len: dict | None = None
    minimum_deployment_target: str | None = None
    frontend: str | None = None
    failed_frontends: dict = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    output: str | None = None
    coremltools: str | None = None
    compute_precision: str | None = None
    package_weight_bytes: int | None = None

    def card_lines(self, name: str, causal: bool) -> list[str]:
        return [
            f"Core ML: {md.code(self.package)} ({md.text(self.task)}, target "
            f"{md.text(self.minimum_deployment_target)}, weights {md.text(self.weights)}); in Swift, "
            "`MLModel(contentsOf:)` after `MLModel.compileModel(at:)`.",
            "",
        ]

    def summary(self) -> str:
        size = self.package_weight_bytes or (self.check.more.get("weight_bytes") if self.check else None)
        return self.summary_of(self.minimum_deployment_target, size, self.weights)


@dataclass(kw_only=True)
class CoreMLRuntime(
    RuntimeResult,
    key="coreml_runtime",
    name="Core ML",
    fix="run `mpsconvert validate` again on macOS (it rewrites the record)",
):
    """The manifest's `coreml_runtime` record: Core ML itself per compute unit beside PyTorch on MPS (macOS)."""
