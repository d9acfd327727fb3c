"""The compressed-tensors `quantization_config` that vLLM and transformers read, both ways.

Written by hand from the format's field names so that writing an artifact does not need the
compressed-tensors package; tests check it parses with compressed-tensors' own pydantic models.
"""

from __future__ import annotations

from ..errors import ArtifactError
from .schemes import Scheme

_STRATEGY = {"tensor": "tensor", "row": "channel", "block": "block"}
_GRANULARITY = {"tensor": "tensor", "channel": "row", "block": "block"}


def _args(strategy: str, dynamic: bool, group_size: int | None = None, block: int | None = None) -> dict:
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": group_size,
        "strategy": strategy,
        "block_structure": [block, block] if block else None,
        "dynamic": dynamic,
        "actorder": None,
        "observer": None if dynamic else "minmax",
        "observer_kwargs": {},
    }


def quantization_config(scheme: Scheme, ignore: list[str], targets: list[str] | None = None) -> dict:
    """The `quantization_config` block for config.json."""
    acts = scheme.activations
    input_activations = None
    if acts == "token":
        input_activations = _args("token", dynamic=True)
    elif acts == "group":  # FP8_BLOCK: each token's K features quantized in groups of the block edge
        input_activations = _args("group", dynamic=True, group_size=scheme.block)
    elif acts == "tensor":
        input_activations = _args("tensor", dynamic=False)
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": targets or ["Linear"],
                "weights": _args(_STRATEGY[scheme.weights], dynamic=False, block=scheme.block),
                "input_activations": input_activations,
                "output_activations": None,
                "format": "float-quantized",
            }
        },
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }


def scheme_from_config(qc: dict) -> Scheme:
    """Read our Scheme back from any compressed-tensors FP8 `quantization_config` (untrusted:
    every level is type-checked, so a wrong JSON type is an ArtifactError, never a TypeError)."""
    if not isinstance(qc, dict):
        raise ArtifactError(f"quantization_config is a {type(qc).__name__}, not an object", "re-create the artifact")
    if qc.get("quant_method") != "compressed-tensors":
        raise ArtifactError(
            f"quantization_config has quant_method {qc.get('quant_method')!r}",
            "only compressed-tensors FP8 checkpoints can be loaded",
        )
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise ArtifactError("quantization_config's config_groups is not an object of objects", "re-create the artifact")
    if not isinstance(qc.get("ignore") or [], list) or not all(isinstance(x, str) for x in qc.get("ignore") or []):
        raise ArtifactError("quantization_config's ignore is not a list of names", "re-create the artifact")
    if len(groups) != 1:
        raise ArtifactError(f"quantization_config has {len(groups)} config groups", "expected exactly one FP8 group")
    group = next(iter(groups.values()))
    w = group.get("weights") or {}
    a = group.get("input_activations")
    if not isinstance(w, dict) or not isinstance(a, (dict, type(None))):
        raise ArtifactError(
            "quantization_config's weights / input_activations are not objects", "re-create the artifact"
        )
    if not isinstance(w.get("strategy"), (str, type(None))):
        raise ArtifactError(
            f"quantization_config's weight strategy is a {type(w.get('strategy')).__name__}", "re-create the artifact"
        )
    if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") not in _GRANULARITY:
        raise ArtifactError(
            f"weights are {w.get('type')}/{w.get('num_bits')} bits/{w.get('strategy')}",
            "only FP8 (float, 8 bits) per-tensor, per-channel or per-block weights are supported",
        )
    block = _block_size(w) if w["strategy"] == "block" else None
    if a is None:
        name = "fp8-weight-only"
    elif a.get("dynamic") and a.get("strategy") == "token" and block is None:
        name = "fp8-dynamic"
    elif a.get("dynamic") and a.get("strategy") == "group" and block is not None and a.get("group_size") == block:
        name = "fp8-dynamic"
    elif not a.get("dynamic") and a.get("strategy") == "tensor":
        name = "fp8"
    else:
        raise ArtifactError(
            f"input activations {a.get('strategy')}/dynamic={a.get('dynamic')} are not supported",
            "expected dynamic per-token (per group of the block edge with block weights), static per-tensor, or none",
        )
    return Scheme(name=name, weights=_GRANULARITY[w["strategy"]], **({"block_size": block} if block else {}))


def is_block_pair(bs) -> bool:
    """Whether a config's block shape is a list of two positive whole numbers (not yet that they are equal)."""
    if not isinstance(bs, list) or len(bs) != 2:
        return False
    return all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in bs)


def _block_size(w: dict) -> int:
    """The edge of square weight blocks (`block_structure: [b, b]`), checked."""
    bs = w.get("block_structure")
    if not is_block_pair(bs):
        raise ArtifactError(
            f"block weights have block_structure {bs!r}", "expected two positive whole numbers, e.g. [128, 128]"
        )
    if bs[0] != bs[1]:
        raise ArtifactError(
            f"block weights have non-square blocks {bs}", "only square blocks (e.g. [128, 128]) are supported"
        )
    return bs[0]
