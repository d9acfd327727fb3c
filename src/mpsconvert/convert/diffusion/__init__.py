"""Diffusion transformers (Flux.1, Wan 2.x, Qwen-Image, SD3.5, Z-Image) to FP8 for the loaders
their users run: ComfyUI (one `.safetensors`, original-repo key names, per-tensor scales) and
diffusers (a folder that `from_pretrained` loads through the SDNQ backend, per-row scales).

families.py is the table (which family, its key names, what stays in high precision), keymap.py
maps diffusers names to the original repos' names, write.py streams the tensors, assemble.py
writes the rest of the artifact. This module imports nothing heavy, so the CLI can list the
choices without torch.
"""

# quantize --format for a diffusion model; LLMs keep their compressed-tensors artifact.
#   comfyui         one .safetensors for ComfyUI's Load Diffusion Model: per-tensor scales,
#                   `X.comfy_quant` markers and the `_quantization_metadata` header
#   comfyui-legacy  the same file in ComfyUI's older layout: a `scaled_fp8` marker, `X.scale_weight`
#   diffusers       a diffusers folder (the pipeline, or the component) loaded by `from_pretrained`
#                   through its SDNQ backend: `X.weight` F8_E4M3 + `X.scale` [N, 1]
from ...manifests.layout import DIFFUSION_FORMATS as FORMATS  # noqa: F401  (re-exported: recorded in manifests, so defined there)

COMFYUI_FORMATS = ("comfyui", "comfyui-legacy")
# The component a pipeline is quantized by default (`--component` picks another).
DEFAULT_COMPONENT = "transformer"
