"""Conversion: a source snapshot -> an FP8 artifact (quantize.py, then assemble.py), and the
artifact -> Apple packages (coreml/, coreai/). This module imports nothing heavy, so the CLI can
list the choices without loading torch."""

# How fused 3-D MoE experts are written: split per expert (loads everywhere) or kept fused.
EXPERTS_LAYOUTS = ("per-expert", "checkpoint")

# quantize --dtype: the tensors that stay unquantized (embeddings, lm_head, norms) -> their safetensors dtype
UNQUANTIZED_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
