"""The diffusion families we convert, as data: one row each in `FAMILIES`.

A row says how to recognise the family (its diffusers class, and the keys of an original-repo
single file), what stays in high precision by default (`keep`: patterns matched against the
original-repo name *and* the diffusers name of a module, as the converters in the wild list
them: Kijai's Wan list, the Flux embedders and final layer), and how diffusers names become
the original repo's names (`renames`, `fusions`, `swaps`: read by keymap.py). The facts come
from ComfyUI's own key maps (comfy/utils.py `flux_to_diffusers`, `mmdit_to_diffusers`,
`z_image_to_diffusers`; comfy/model_detection.py) and diffusers' single-file converters
(loaders/single_file_utils.py), checked against diffusers 0.42.1 by tests/test_diffusion.py.

Torch-free: `detect_family` runs on safetensors header keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import SourceError


@dataclass(frozen=True)
class Fusion:
    """Diffusers Linears that the original repo stores as one tensor, rows concatenated in
    `members` order (Flux `img_attn.qkv` = to_q | to_k | to_v). `match` is a regex on the
    diffusers module name whose group `m` names the member; `target` the original module
    (a regex replacement of `match`)."""

    match: str
    target: str
    members: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    name: str  # recorded in the manifest; names validate's step inputs (runtime/evaluate/validate_diffusion.py)
    label: str
    classes: tuple[str, ...]  # diffusers classes of this family's transformer
    detect: tuple[str, ...]  # keys that, all present, mark an original-repo single file
    keep: tuple[str, ...]  # kept in high precision by default (globs on either name)
    renames: tuple[tuple[str, str], ...] = ()  # diffusers key -> original key, regexes applied in order
    fusions: tuple[Fusion, ...] = ()
    swaps: tuple[str, ...] = ()  # original keys whose two row halves are swapped (shift, scale) vs (scale, shift)


_QKV = ("to_q", "to_k", "to_v")
_ADDED_QKV = ("add_q_proj", "add_k_proj", "add_v_proj")  # the context stream's q/k/v in the joint blocks


def _fused(prefix: str, target: str, members: tuple[str, ...] = _QKV) -> Fusion:
    """The Fusion of the Linears `members` right after `prefix` (a regex) into `target`."""
    return Fusion(prefix + rf"(?P<m>{'|'.join(members)})$", target, members)


def _embedder(prefix: str, first: str, second: str) -> tuple[tuple[str, str], ...]:
    """The renames of a diffusers TimestepEmbedding (Linears `linear_1`, `linear_2` after `prefix`)
    to the original repo's two module names."""
    return (prefix + r"linear_1\.", first), (prefix + r"linear_2\.", second)


def _within(block: str, target: str, renames: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """`renames` inside a block: each diffusers pattern follows `block` (a regex whose groups number
    the block) and each original name follows `target` (which refers to those groups)."""
    return tuple((block + d, target + o) for d, o in renames)


_JOINT_BLOCK = r"^transformer_blocks\.(\d+)\."  # diffusers' joint (MMDiT) blocks: Flux's double blocks, SD3's
_FLUX_SINGLE_BLOCK = r"^single_transformer_blocks\.(\d+)\."
_WAN_BLOCK = r"^blocks\.(\d+)\."
_ZIMAGE_BLOCK = r"^(layers|context_refiner|noise_refiner)\.(\d+)\."


def _joint_qkv(image: str, context: str) -> tuple[Fusion, Fusion]:
    """The fused q/k/v of a joint block's two streams: the image stream's (`to_q`...) into `image`,
    the context stream's (`add_q_proj`...) into `context` (targets refer to the block's group)."""
    return _fused(_JOINT_BLOCK + r"attn\.", image), _fused(_JOINT_BLOCK + r"attn\.", context, _ADDED_QKV)


# The final layer of the MMDiT transformers (Flux, SD3): diffusers' AdaLayerNormContinuous and Linear are
# the original `final_layer`, whose modulation stores (shift, scale) where diffusers stores (scale, shift).
_FINAL_LAYER = ((r"^norm_out\.linear\.", "final_layer.adaLN_modulation.1."), (r"^proj_out\.", "final_layer.linear."))
_FINAL_LAYER_SWAPS = ("final_layer.adaLN_modulation.1.weight", "final_layer.adaLN_modulation.1.bias")

FAMILIES: tuple[Family, ...] = (
    Family(
        name="flux",
        label="Flux.1",
        classes=("FluxTransformer2DModel",),
        detect=("double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight"),
        # BFL's embedders and final layer (Comfy-Org's and Kijai's fp8_scaled files keep these)
        keep=("img_in", "txt_in", "time_in.*", "vector_in.*", "guidance_in.*", "final_layer.*"),
        renames=(
            *_embedder(r"^time_text_embed\.timestep_embedder\.", "time_in.in_layer.", "time_in.out_layer."),
            *_embedder(r"^time_text_embed\.text_embedder\.", "vector_in.in_layer.", "vector_in.out_layer."),
            *_embedder(r"^time_text_embed\.guidance_embedder\.", "guidance_in.in_layer.", "guidance_in.out_layer."),
            (r"^context_embedder\.", "txt_in."),
            (r"^x_embedder\.", "img_in."),
            *_FINAL_LAYER,
            *_within(
                _JOINT_BLOCK,
                r"double_blocks.\1.",
                (
                    (r"norm1\.linear\.", "img_mod.lin."),
                    (r"norm1_context\.linear\.", "txt_mod.lin."),
                    (r"attn\.norm_q\.weight$", "img_attn.norm.query_norm.scale"),
                    (r"attn\.norm_k\.weight$", "img_attn.norm.key_norm.scale"),
                    (r"attn\.norm_added_q\.weight$", "txt_attn.norm.query_norm.scale"),
                    (r"attn\.norm_added_k\.weight$", "txt_attn.norm.key_norm.scale"),
                    (r"ff\.net\.0\.proj\.", "img_mlp.0."),
                    (r"ff\.net\.2\.", "img_mlp.2."),
                    (r"ff_context\.net\.0\.proj\.", "txt_mlp.0."),
                    (r"ff_context\.net\.2\.", "txt_mlp.2."),
                    (r"attn\.to_out\.0\.", "img_attn.proj."),
                    (r"attn\.to_add_out\.", "txt_attn.proj."),
                ),
            ),
            *_within(
                _FLUX_SINGLE_BLOCK,
                r"single_blocks.\1.",
                (
                    (r"norm\.linear\.", "modulation.lin."),
                    (r"attn\.norm_q\.weight$", "norm.query_norm.scale"),
                    (r"attn\.norm_k\.weight$", "norm.key_norm.scale"),
                    (r"proj_out\.", "linear2."),
                ),
            ),
        ),
        fusions=(
            *_joint_qkv(r"double_blocks.\1.img_attn.qkv", r"double_blocks.\1.txt_attn.qkv"),
            _fused(_FLUX_SINGLE_BLOCK + r"(?:attn\.)?", r"single_blocks.\1.linear1", (*_QKV, "proj_mlp")),
        ),
        swaps=_FINAL_LAYER_SWAPS,
    ),
    Family(
        name="wan",
        label="Wan 2.x",
        classes=("WanTransformer3DModel",),
        detect=("blocks.0.self_attn.q.weight", "patch_embedding.weight"),
        # Kijai's list: norm, bias, time_in, patch_embedding, img_emb, modulation, text_embedding; plus the head
        keep=(
            "patch_embedding",
            "text_embedding.*",
            "time_embedding.*",
            "time_projection.*",
            "img_emb.*",
            "head.*",
            "*modulation*",
        ),
        renames=(
            *_embedder(r"^condition_embedder\.time_embedder\.", "time_embedding.0.", "time_embedding.2."),
            *_embedder(r"^condition_embedder\.text_embedder\.", "text_embedding.0.", "text_embedding.2."),
            (r"^condition_embedder\.time_proj\.", "time_projection.1."),
            (r"^condition_embedder\.image_embedder\.norm1\.", "img_emb.proj.0."),
            (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "img_emb.proj.1."),
            (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "img_emb.proj.3."),
            (r"^condition_embedder\.image_embedder\.norm2\.", "img_emb.proj.4."),
            (r"^scale_shift_table$", "head.modulation"),
            (r"^proj_out\.", "head.head."),
            *_within(
                _WAN_BLOCK,
                r"blocks.\1.",
                (
                    (r"scale_shift_table$", "modulation"),
                    (r"attn1\.", "self_attn."),
                    (r"attn2\.", "cross_attn."),
                ),
            ),
            (r"\.to_q\.", ".q."),
            (r"\.to_k\.", ".k."),
            (r"\.to_v\.", ".v."),
            (r"\.to_out\.0\.", ".o."),
            (r"\.add_k_proj\.", ".k_img."),
            (r"\.add_v_proj\.", ".v_img."),
            (r"\.norm_added_k\.", ".norm_k_img."),
            *_within(
                _WAN_BLOCK,
                r"blocks.\1.",
                (
                    (r"ffn\.net\.0\.proj\.", "ffn.0."),
                    (r"ffn\.net\.2\.", "ffn.2."),
                    # diffusers' norm2 is the original norm3 and the other way round
                    (r"norm2\.", "norm__3."),
                    (r"norm3\.", "norm2."),
                    (r"norm__3\.", "norm3."),
                ),
            ),
        ),
    ),
    Family(
        # Qwen-Image was released in diffusers layout, and ComfyUI's model uses those names
        # (comfy/model_detection.py: `txt_norm.weight` marks it): no renames.
        name="qwen-image",
        label="Qwen-Image",
        classes=("QwenImageTransformer2DModel",),
        detect=("txt_norm.weight", "img_in.weight", "transformer_blocks.0.attn.add_q_proj.weight"),
        keep=("img_in", "txt_in", "time_text_embed.*", "norm_out.*", "proj_out"),
    ),
    Family(
        name="sd3",
        label="SD3.5",
        classes=("SD3Transformer2DModel",),
        detect=("joint_blocks.0.x_block.attn.qkv.weight", "x_embedder.proj.weight"),
        keep=("x_embedder.*", "context_embedder", "t_embedder.*", "y_embedder.*", "final_layer.*", "pos_embed"),
        renames=(
            (r"^context_embedder\.", "context_embedder."),
            *_embedder(r"^time_text_embed\.timestep_embedder\.", "t_embedder.mlp.0.", "t_embedder.mlp.2."),
            *_embedder(r"^time_text_embed\.text_embedder\.", "y_embedder.mlp.0.", "y_embedder.mlp.2."),
            (r"^pos_embed\.proj\.", "x_embedder.proj."),
            (r"^pos_embed\.pos_embed$", "pos_embed"),
            *_FINAL_LAYER,
            *_within(
                _JOINT_BLOCK,
                r"joint_blocks.\1.context_block.",
                (
                    (r"norm1_context\.linear\.", "adaLN_modulation.1."),
                    (r"attn\.to_add_out\.", "attn.proj."),
                    (r"ff_context\.net\.0\.proj\.", "mlp.fc1."),
                    (r"ff_context\.net\.2\.", "mlp.fc2."),
                    (r"attn\.norm_added_q\.", "attn.ln_q."),
                    (r"attn\.norm_added_k\.", "attn.ln_k."),
                ),
            ),
            *_within(
                _JOINT_BLOCK,
                r"joint_blocks.\1.x_block.",
                (
                    (r"norm1\.linear\.", "adaLN_modulation.1."),
                    (r"attn\.to_out\.0\.", "attn.proj."),
                    (r"attn\.norm_q\.", "attn.ln_q."),
                    (r"attn\.norm_k\.", "attn.ln_k."),
                    (r"attn2\.to_out\.0\.", "attn2.proj."),
                    (r"attn2\.norm_q\.", "attn2.ln_q."),
                    (r"attn2\.norm_k\.", "attn2.ln_k."),
                    (r"ff\.net\.0\.proj\.", "mlp.fc1."),
                    (r"ff\.net\.2\.", "mlp.fc2."),
                ),
            ),
        ),
        fusions=(
            *_joint_qkv(r"joint_blocks.\1.x_block.attn.qkv", r"joint_blocks.\1.context_block.attn.qkv"),
            _fused(_JOINT_BLOCK + r"attn2\.", r"joint_blocks.\1.x_block.attn2.qkv"),
        ),
        # the final norm, and the last block's context norm (AdaLayerNormContinuous in diffusers)
        swaps=(
            *_FINAL_LAYER_SWAPS,
            "@last:context_block.adaLN_modulation.1",
        ),
    ),
    Family(
        name="z-image",
        label="Z-Image",
        classes=("ZImageTransformer2DModel",),
        detect=("layers.0.attention.qkv.weight", "cap_embedder.1.weight"),
        keep=("x_embedder", "cap_embedder.*", "t_embedder.*", "final_layer.*", "*adaLN_modulation*"),
        renames=(
            (r"^all_final_layer\.2-1\.", "final_layer."),
            (r"^all_x_embedder\.2-1\.", "x_embedder."),
            *_within(
                _ZIMAGE_BLOCK + r"attention\.",
                r"\1.\2.attention.",
                (
                    (r"norm_q\.", "q_norm."),
                    (r"norm_k\.", "k_norm."),
                    (r"to_out\.0\.", "out."),
                ),
            ),
        ),
        fusions=(_fused(_ZIMAGE_BLOCK + r"attention\.", r"\1.\2.attention.qkv"),),
    ),
)
BY_NAME = {f.name: f for f in FAMILIES}
_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def supported() -> str:
    return ", ".join(f"{f.label} ({'/'.join(f.classes)})" for f in FAMILIES)


def strip_prefix(key: str) -> str:
    """An original single file's key without ComfyUI's checkpoint prefix (`model.diffusion_model.`)."""
    for p in _PREFIXES:
        if key.startswith(p):
            return key[len(p) :]
    return key


def family_of_class(class_name: str | None, where: str) -> Family:
    """The family of a diffusers component from its config's `_class_name`."""
    for f in FAMILIES:
        if class_name in f.classes:
            return f
    raise SourceError(
        f"{where} is a {class_name or 'component with no _class_name'}, a model family mpsconvert does not convert",
        f"supported: {supported()}",
    )


def detect_family(keys, where: str) -> Family:
    """The family of an original-repo single file, from the tensor names in its header."""
    names = {strip_prefix(k) for k in keys}
    for f in FAMILIES:
        if all(k in names for k in f.detect):
            return f
    sample = ", ".join(sorted(names)[:3]) or "no tensors"
    raise SourceError(
        f"the keys of {where} ({len(names)} tensors, e.g. {sample}) match no diffusion family mpsconvert knows",
        f"supported single files: {', '.join(f'{f.label} ({f.detect[0]})' for f in FAMILIES)}",
    )


@dataclass
class KeepRule:
    """What stays in high precision: the family's list, or `--ignore` patterns that replace it."""

    patterns: tuple[str, ...]
    source: str  # "Flux.1 default" | "--ignore"

    @classmethod
    def of(cls, family: Family, ignore: list[str] | None) -> "KeepRule":
        if ignore:
            return cls(tuple(ignore), "--ignore")
        return cls(family.keep, f"{family.label} default")

    def match(self, *names: str) -> str | None:
        """The first pattern that names any of `names` (modules: original or diffusers)."""
        from ...model.plan import matches

        for n in names:
            p = matches(n, list(self.patterns))
            if p is not None:
                return p
        return None
