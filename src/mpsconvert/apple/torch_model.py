"""The artifact's model in PyTorch, for the Apple exports and their checks.

The source architecture (transformers' own class for config.json) carrying the artifact's
weights: every FP8 tensor dequantized once in fp32 (codes x scale), everything else as stored.
Core ML and Core AI convert it (with the FP8 weights re-encoded natively by each exporter), and
their checks compare the packages with it, so both start from one definition of "the model".
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ExportError, MpsconvertError
from ..format import fp8
from ..infra.untrusted import parse_json, read_json
from ..manifests import layout
from ..model import hf_compat, reference
from ..model.definition import is_causal_lm

# Encoder-only families whose AutoModel returns last_hidden_state from (input_ids, attention_mask).
ENCODER_TYPES = (
    "bert",
    "roberta",
    "xlm-roberta",
    "camembert",
    "distilbert",
    "mpnet",
    "electra",
    "albert",
    "deberta",
    "deberta-v2",
    "modernbert",
)


def _is_encoder(config) -> bool:
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "is_decoder", False):
        return False
    archs = config.architectures or []
    return config.model_type in ENCODER_TYPES and all(a.endswith(("Model", "ForMaskedLM")) for a in archs)


def task_of(config) -> str:
    """'causal-lm' (input_ids -> logits) or 'encoder' (input_ids, attention_mask -> embeddings)."""
    if is_causal_lm(config):
        return "causal-lm"
    if _is_encoder(config):
        return "encoder"
    archs = ", ".join(config.architectures or [config.model_type])
    raise ExportError(
        f"architecture {archs} is not supported for Core ML or Core AI export",
        "export works for causal LMs (*ForCausalLM, *LMHeadModel: input_ids -> logits) and BERT-style encoders "
        "(input_ids, attention_mask -> embeddings)",
    )


def read_artifact_weights(
    artifact: Path,
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """All tensors of the artifact as the model uses them (FP8 weights dequantized in fp32),
    plus the FP8 weights themselves: name -> (codes float8_e4m3fn, scale fp32). Block scales
    come as tiles that divide the weight exactly (`fp8.tile_scale`), so that every consumer
    reads a scale the same way (`fp8.dequantize_tiles`) without the block size."""
    from safetensors import safe_open

    from ..format.ct_config import scheme_from_config

    qc = read_json(artifact / layout.CONFIG_NAME, what=layout.CONFIG_NAME).get("quantization_config")
    block = scheme_from_config(qc).block if qc else None

    files = [artifact / f for f in layout.weight_files(artifact)]
    if not files:
        raise MpsconvertError(f"{artifact} has no .safetensors files", "is this an mpsconvert artifact?")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                raw[k] = st.get_tensor(k)
    dense: dict[str, torch.Tensor] = {}
    quant: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for k, t in raw.items():
        if k.endswith((".weight_scale", ".input_scale")):
            continue
        if t.dtype == fp8.FP8_DTYPE:
            scale = raw.get(k + "_scale")
            if scale is None:
                raise MpsconvertError(
                    f"FP8 tensor {k} has no {k}_scale", "the artifact is incomplete: re-run `mpsconvert quantize`"
                )
            if block and t.ndim == 3:
                raise ExportError(
                    f"{k} holds fused MoE experts with block scales",
                    "Apple exports of block-scaled experts are not supported yet; quantize the source "
                    "with --weights row",
                )
            scale = fp8.tile_scale(scale, *t.shape, block) if block and t.ndim == 2 else scale.float()
            quant[k] = (t, scale)
            dense[k] = fp8.dequantize_tiles(t, scale, torch.float32)
        elif t.is_floating_point():
            dense[k] = t.float()
        else:
            dense[k] = t
    return dense, quant


def _fuse_experts(model, dense: dict, quant: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor, list[str]]]:
    """transformers 5 holds MoE experts fused (`experts.gate_up_proj [E, 2I, H]`, `down_proj
    [E, H, I]`), checkpoints mostly one 2-D tensor per expert and projection. Which tensor holds
    which rows comes from transformers' own mapping (`moe_layout.find_layout`). The dense fused
    tensors replace the per-expert ones in `dense` (under the model's names); returns the FP8
    form of each fused parameter: name -> (codes [E, N, K], per-row scale [E, N, 1], source
    tensors). A layout transformers cannot map is an ExportError, never a silent dense copy."""
    from ..model import moe_layout

    if not moe_layout.experts_modules(model):
        return {}
    stored = {k: tuple(v.shape) for k, v in dense.items()}
    out = {}
    for name, ep in moe_layout.find_layout(model, stored).items():
        e, n, k = ep.shape
        if ep.layout == "per-expert":
            w = torch.empty(e, n, k)
            codes = torch.empty(e, n, k, dtype=fp8.FP8_DTYPE)
            scale = torch.empty(e, n, 1)
            is_fp8 = all(sl.key in quant for sl in ep.slices)
            for sl in ep.slices:
                w[sl.expert, sl.start : sl.stop] = dense.pop(sl.key)
                if is_fp8:
                    c, sc = quant.pop(sl.key)
                    if fp8.is_block_scale(sc, sl.stop - sl.start):
                        raise ExportError(
                            f"MoE experts {ep.name} have block scales",
                            "Apple exports of block-scaled experts are not supported yet; quantize "
                            "the source with --weights row",
                        )
                    codes[sl.expert, sl.start : sl.stop] = c
                    scale[sl.expert, sl.start : sl.stop] = sc.reshape(-1, 1).expand(sl.stop - sl.start, 1)
            dense[ep.name] = w
            if is_fp8:
                out[ep.name] = (codes, scale, [sl.key for sl in ep.slices])
        elif ep.layout == "fused":
            if ep.key in quant:
                c, sc = quant.pop(ep.key)
                out[ep.name] = (c, sc.reshape(e, -1, 1).expand(e, n, 1).contiguous(), [ep.key])
            dense[ep.name] = dense.pop(ep.key)
        else:
            raise ExportError(
                f"MoE experts {ep.name}: {ep.why}", "this MoE layout cannot be exported yet; report the model"
            )
    return out


def _has_experts(config) -> bool:
    return any(getattr(config, a, None) for a in ("num_local_experts", "num_experts", "n_routed_experts"))


def _stored_dtypes(artifact: Path) -> dict[str, torch.dtype]:
    """tensor -> dtype as the artifact stores it (from the safetensors headers)."""
    from safetensors import safe_open

    names = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
    out = {}
    for f in layout.weight_files(artifact):
        with safe_open(str(Path(artifact) / f), framework="pt") as st:
            for k in st.keys():
                dt = names.get(st.get_slice(k).get_dtype())
                if dt is not None:
                    out[k] = dt
    return out


def _load_into(model, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Load checkpoint tensors into `model`, matching names with or without base_model_prefix.
    Returns checkpoint name -> model name for the tensors used (e.g. not BERT's pooler when it
    is left out)."""
    own = model.state_dict()
    prefix = getattr(model, "base_model_prefix", "") or ""
    mapped = {}
    used: dict[str, str] = {}
    for k, v in tensors.items():
        for cand in (k, f"{prefix}.{k}", k[len(prefix) + 1 :] if prefix and k.startswith(prefix + ".") else None):
            if cand and cand in own:
                mapped[cand] = v
                used[k] = cand
                break
    for key in [
        k for k in own if k not in mapped
    ]:  # modules the checkpoint names differently (Mixtral's block_sparse_moe.gate)
        mod, _, leaf = key.rpartition(".")
        if mod:
            from ..model.moe_layout import checkpoint_module_name

            stored = checkpoint_module_name(model, mod)
            for cand in (f"{stored}.{leaf}", f"{prefix}.{stored}.{leaf}"):
                if stored != mod and cand in tensors:
                    mapped[key] = tensors[cand]
                    used[cand] = key
                    break
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    missing = [k for k in own if k not in mapped]
    model.load_state_dict(mapped, strict=False)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    # A tied output embedding (lm_head.weight) is the input embedding, not stored: fine.
    own_after = model.state_dict()
    really_missing = []
    for k in missing:
        ptr = own_after[k].data_ptr()
        if not any(own_after[m].data_ptr() == ptr for m in mapped):
            if not k.endswith(("position_ids", "token_type_ids", "inv_freq")):
                really_missing.append(k)
    if really_missing:
        raise MpsconvertError(
            f"the artifact has no tensor for {len(really_missing)} model parameter(s), e.g. {really_missing[0]}",
            "the artifact does not match its config.json: re-run `mpsconvert quantize`",
        )
    return used


def _uses_normalize(artifact: Path) -> bool:
    """sentence-transformers models list their pipeline in modules.json (Pooling, Normalize)."""
    p = artifact / "modules.json"
    if not p.is_file():
        return False
    try:
        mods = parse_json(p.read_bytes(), what=p.name, expect=list)
    except (MpsconvertError, OSError):
        return False
    return any("Normalize" in str(m.get("type", "")) for m in mods if isinstance(m, dict))


class StatelessCausalLM(torch.nn.Module):
    """input_ids [1, T] -> logits [1, T, vocab]: no cache, every token attends causally (Core ML's
    `--no-kv-cache` form, and the PyTorch reference the checks compare with)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


class EncoderEmbeddings(torch.nn.Module):
    """input_ids, attention_mask [1, T] -> embeddings [1, hidden]: the masked mean of the last
    hidden state (sentence-transformers' mean pooling), L2-normalized when the model's
    modules.json has a Normalize step."""

    def __init__(self, model, normalize: bool):
        super().__init__()
        self.model = model
        self.normalize = normalize

    def forward(self, input_ids, attention_mask):
        h = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        emb = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
        if self.normalize:
            emb = emb / emb.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        return emb


@dataclass
class TorchModel:
    task: str
    module: torch.nn.Module  # the wrapper above, fp32, eval
    config: object
    fp8_weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (codes, scale), those the model uses
    normalize: bool = False
    unused: list[str] = field(default_factory=list)  # FP8 tensors the exported graph does not use
    stored_dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # model tensor -> dtype in the artifact
    # fused MoE expert parameters: name -> (codes [E, N, K], per-row scale [E, N, 1], artifact tensors)
    fp8_experts: dict[str, tuple[torch.Tensor, torch.Tensor, list[str]]] = field(default_factory=dict)

    @property
    def model(self):
        """The transformers model inside the wrapper."""
        return self.module.model

    @property
    def input_names(self) -> list[str]:
        return ["input_ids"] if self.task == "causal-lm" else ["input_ids", "attention_mask"]

    @property
    def output_name(self) -> str:
        return "logits" if self.task == "causal-lm" else "embeddings"


def build_torch_model(artifact: Path) -> TorchModel:
    """The source architecture with the artifact's dequantized weights, fp32, eval mode."""
    import transformers

    artifact = Path(artifact)
    cfg_dict = read_json(artifact / layout.CONFIG_NAME, what=layout.CONFIG_NAME)
    cfg_dict.pop("quantization_config", None)  # the weights are given dense: no compressed-tensors loader
    model_type = cfg_dict.get("model_type")
    try:
        config = transformers.AutoConfig.for_model(
            model_type, **{k: v for k, v in cfg_dict.items() if k != "model_type"}
        )
    except (ValueError, KeyError) as e:
        raise ExportError(f"transformers does not know model_type {model_type!r}", "upgrade transformers") from e
    task = task_of(config)
    dense, quant = read_artifact_weights(artifact)
    dtypes = _stored_dtypes(artifact)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if task == "causal-lm":
            # batched_mm experts: every token's experts gathered and multiplied at once, no
            # data-dependent loop (which torch.export cannot trace)
            moe = hf_compat.experts_kwargs("batched_mm") if _has_experts(config) else {}
            model = reference.build(config, task=task, dtype=torch.float32, attn_implementation="eager", **moe)
        else:
            # The pooler (BERT's [CLS] dense+tanh) is not part of the embeddings output.
            extra = (
                {"add_pooling_layer": False}
                if config.model_type in ("bert", "roberta", "xlm-roberta", "camembert")
                else {}
            )
            model = reference.build(config, task=task, dtype=torch.float32, attn_implementation="eager", **extra)
    experts = _fuse_experts(model, dense, quant)
    used = _load_into(model, dense)
    model.eval()
    normalize = task == "encoder" and _uses_normalize(artifact)
    wrapper = StatelessCausalLM(model) if task == "causal-lm" else EncoderEmbeddings(model, normalize)
    return TorchModel(
        task=task,
        module=wrapper.eval(),
        config=config,
        normalize=normalize,
        fp8_weights={k: v for k, v in quant.items() if k in used},
        unused=sorted(k for k in quant if k not in used),
        stored_dtypes={m: dtypes[k] for k, m in used.items() if k in dtypes},
        fp8_experts=experts,
    )


def example_inputs(tm: TorchModel, length: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    vocab = int(getattr(tm.config, "vocab_size", 100))
    ids = torch.randint(0, vocab, (1, length), generator=g)
    if tm.task == "causal-lm":
        return (ids,)
    return (ids, torch.ones(1, length, dtype=torch.long))


def reference_logits(tm: TorchModel, ids):
    """fp32 logits [T, vocab] of the whole sequence `ids` in one causal forward pass, no cache:
    what every position of a prefill or a teacher-forced decode must reproduce."""
    import numpy as np

    x = torch.as_tensor(np.asarray(ids), dtype=torch.long).reshape(1, -1)
    with torch.no_grad():
        return tm.model(input_ids=x, use_cache=False).logits[0].float().numpy()


def fp8_safetensors_bytes(artifact: Path) -> int:
    """Bytes of the artifact's weight files: what an Apple package's size is compared with."""
    return sum((Path(artifact) / f).stat().st_size for f in layout.weight_files(artifact))
