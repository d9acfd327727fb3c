"""Sources that are already FP8: what their `quantization_config` says, in our terms.

Two layouts are accepted, because they are what FP8 models on the hub use:
- transformers' FineGrainedFP8 (`quant_method: "fp8"`, DeepSeek-V3/R1, the Qwen3 `-FP8`
  releases): `<m>.weight` F8_E4M3 and `<m>.weight_scale_inv` [ceil(N/b), ceil(K/b)] for
  `weight_block_size: [b, b]` (a dequant multiplier despite its name), dynamic activations;
- compressed-tensors `float-quantized` FP8 (llm-compressor's, or ours), any strategy:
  `<m>.weight_scale` in the shape `scales.scale_shape` gives, `<m>.input_scale` when static.

Only the layout is read here (torch-free); the writer copies the codes and renames the scales.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SourceError
from .ct_config import is_block_pair, scheme_from_config
from .scales import Granularity
from .schemes import Scheme

FINE_GRAINED = "fine-grained-fp8"
COMPRESSED_TENSORS = "compressed-tensors"


@dataclass(frozen=True)
class SourceFP8:
    """An FP8 source: its layout, the scheme its codes and scales are in, and the key suffix of
    a weight's scale (`weight_scale_inv` or `weight_scale`)."""

    layout: str
    scheme: Scheme
    scale_suffix: str
    ignore: list = field(default_factory=list)  # modules the source kept in full precision, by name
    config: dict = field(default_factory=dict)  # the source's quantization_config, as it was

    def scale_key(self, weight_key: str) -> str:
        return weight_key[: -len("weight")] + self.scale_suffix

    def input_scale_key(self, weight_key: str) -> str:
        return weight_key[: -len("weight")] + "input_scale"

    def as_dict(self) -> dict:
        return {
            "layout": self.layout,
            "scheme": self.scheme.as_dict(),
            "scale": self.scale_suffix,
            "quantization_config": self.config,
        }


def _refuse(problem: str) -> SourceError:
    return SourceError(problem, "convert the original BF16/FP16/FP32 checkpoint instead")


def source_fp8(qc, where: str) -> SourceFP8:
    """The FP8 layout of a source whose config.json has `quantization_config` `qc`; any other
    quantized source is refused with one line saying why."""
    if not isinstance(qc, dict):
        raise _refuse(f"{where} has a quantization_config that is not a JSON object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fine_grained(qc, where)
    if method == "compressed-tensors":
        if qc.get("format") != "float-quantized":
            raise _refuse(
                f"{where} is already quantized (compressed-tensors {qc.get('format')!r}): only float-quantized FP8 "
                "sources can be used as they are"
            )
        try:
            scheme = scheme_from_config(qc)
        except Exception as e:  # ArtifactError: which field and why
            raise _refuse(
                f"{where} is already quantized (compressed-tensors), not in an FP8 layout mpsconvert reads "
                f"({getattr(e, 'problem', e)})"
            ) from None
        return SourceFP8(COMPRESSED_TENSORS, scheme, "weight_scale", list(qc.get("ignore") or []), qc)
    raise _refuse(
        f"{where} is already quantized ({method or '?'}); only FP8 sources (FineGrainedFP8, compressed-tensors "
        "float-quantized) can be used as they are"
    )


def _fine_grained(qc: dict, where: str) -> SourceFP8:
    if str(qc.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise _refuse(
            f"{where} is FineGrainedFP8 with {qc.get('activation_scheme')!r} activations: only dynamic "
            "ones are supported"
        )
    if qc.get("scale_fmt", "float") != "float" or qc.get("expert_dtype", "fp8") != "fp8":
        raise _refuse(
            f"{where} is FineGrainedFP8 with scale_fmt {qc.get('scale_fmt')!r} / expert_dtype "
            f"{qc.get('expert_dtype')!r}: only float scales and FP8 experts are supported"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(f"{where} stores FP8 as {qc.get('fmt')!r}: only e4m3 is supported")
    bs = qc.get("weight_block_size")
    if bs is None:
        scheme = Scheme(name="fp8-dynamic", weights=Granularity.TENSOR)
    else:
        if not is_block_pair(bs):
            raise _refuse(f"{where} has weight_block_size {bs!r}: expected two positive whole numbers")
        if bs[0] != bs[1]:
            raise _refuse(
                f"{where} has non-square weight blocks {bs}: only square blocks (e.g. [128, 128]) are supported"
            )
        scheme = Scheme(name="fp8-dynamic", weights=Granularity.BLOCK, block_size=bs[0])
    ignore = list(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or [])
    return SourceFP8(FINE_GRAINED, scheme, "weight_scale_inv", ignore, qc)
