"""Conversion: a source snapshot -> an FP8 artifact. quantize.py streams the shards (which tensors
are quantized how: quantize_plan.py; the per-tensor work: quantize_tensors.py; the options:
quantize_options.py), assemble.py completes the artifact; GGUF sources go through gguf.py,
diffusion transformers through diffusion/. This module holds the choices the CLI lists (experts
layouts, unquantized dtypes, shard sizes) and imports nothing heavy, so that listing them loads
no torch."""

from ..errors import QuantizationError

# How fused 3-D MoE experts are written: split per expert (loads everywhere) or kept fused.
EXPERTS_LAYOUTS = ("per-expert", "checkpoint")

# What is quantized, cast by --dtype, or read as a scale (safetensors dtype codes)
FLOAT_CODES = ("F32", "F16", "BF16")

# quantize --dtype: the tensors that stay unquantized (embeddings, lm_head, norms) -> their safetensors dtype
UNQUANTIZED_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


_SIZE_UNITS = (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))


def shard_size_bytes(size: int | str) -> int:
    """ "1GB" / "500MB" / "2GiB" / bytes -> bytes, as transformers' `save_pretrained(max_shard_size=)`
    reads it (`convert_file_size_to_int`: a lower-case final "b" means bits; the same table is
    checked against it in tests/test_plan_child.py). Written here because importing transformers
    for it costs 3 s on the H100 host, which a conversion whose plan is built by a child process
    never pays otherwise."""
    n = None
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    elif isinstance(size, str):
        for unit, factor in _SIZE_UNITS:
            if size.upper().endswith(unit):
                digits = size[: -len(unit)]
                if digits.isascii() and digits.isdigit():
                    n = int(digits) * factor
                    n = n // 8 if unit[1] == "B" and size.endswith("b") else n
                break
    if not isinstance(n, int) or n <= 0:
        raise QuantizationError(f"cannot read {size!r} as a shard size", "pass a size such as 1GB, 500MB or 2GiB")
    return n
