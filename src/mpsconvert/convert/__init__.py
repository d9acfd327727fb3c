"""Conversion: a source snapshot -> an FP8 artifact (quantize.py, then assemble.py), and the
artifact -> Apple packages (coreml/, coreai/). This module imports nothing heavy, so the CLI can
list the choices without loading torch."""

# How fused 3-D MoE experts are written: split per expert (loads everywhere) or kept fused.
EXPERTS_LAYOUTS = ("per-expert", "checkpoint")
