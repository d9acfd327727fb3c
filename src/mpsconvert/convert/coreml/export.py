"""FP8 artifact -> Core ML ML program (`model.mlpackage`) inside the artifact, FP8 weights kept at one byte.

The PyTorch model that is converted is the source architecture carrying the artifact's own
weights (FP8 codes x scale, dequantized once in fp32), so what Core ML computes is what the
artifact holds. Conversion tries torch.export first and torch.jit.trace where export or its
conversion fails; which one ran (and why the other did not) is returned and recorded.

Core ML has no FP8 type. With `fp8-lut` (default) every FP8 weight becomes an 8-bit palette,
`constexpr_lut_to_dense` with indices = the FP8 bit patterns and one LUT of the 256 e4m3 values
(see `_fp8_lut_pass` for how the scale is applied). `int8` is coremltools' linear quantization of
the same weights; `fp16` stores them dense. Activations run in FP16: the artifact's FP8 activation
scheme (dynamic or static) has no Core ML equivalent and is not applied.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...atomic import TMP_PREFIX
from ...errors import ExportError, MpsconvertError
from ...manifests.hashing import sha256_file
from ...manifests.layout import COREML_PACKAGE as PACKAGE_NAME
from ...manifests.layout import CONFIG_NAME, update_manifest
from ...manifests.manifest import Manifest
from ... import fp8
from ...progress import Progress, or_silent

from . import FRONTENDS, WEIGHT_MODES, ExportOptions, SeqLen  # noqa: E402,F401  (light: the CLI and API read them without this module)
DEPLOYMENT_TARGET = "iOS18 / macOS15"
# e4m3fn NaN codes (0x7f, 0xff) never occur in an artifact (values are clamped before the cast);
# their LUT entries are 0 so that the palette holds only finite values.
_NAN_CODES = (0x7F, 0xFF)


# --------------------------------------------------------------------------- the PyTorch model


def _is_causal_lm(config) -> bool:
    return any(a.endswith("ForCausalLM") for a in (config.architectures or []))


# Encoder-only families whose AutoModel returns last_hidden_state from (input_ids, attention_mask).
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "distilbert", "mpnet", "electra", "albert", "deberta", "deberta-v2", "modernbert")


def _is_encoder(config) -> bool:
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "is_decoder", False):
        return False
    archs = config.architectures or []
    return config.model_type in ENCODER_TYPES and all(a.endswith(("Model", "ForMaskedLM")) for a in archs)


def task_of(config) -> str:
    """'causal-lm' (input_ids -> logits) or 'encoder' (input_ids, attention_mask -> embeddings)."""
    if _is_causal_lm(config):
        return "causal-lm"
    if _is_encoder(config):
        return "encoder"
    archs = ", ".join(config.architectures or [config.model_type])
    raise ExportError(
        f"architecture {archs} is not supported for Core ML export",
        "export works for causal LMs (*ForCausalLM: input_ids -> logits) and BERT-style encoders (input_ids, attention_mask -> embeddings)",
    )


def read_artifact_weights(artifact: Path) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """All tensors of the artifact as the model uses them (FP8 weights dequantized in fp32),
    plus the FP8 weights themselves: name -> (codes float8_e4m3fn, scale fp32)."""
    from safetensors import safe_open

    files = sorted(artifact.glob("*.safetensors"))
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
                raise MpsconvertError(f"FP8 tensor {k} has no {k}_scale", "the artifact is incomplete: re-run `mpsconvert quantize`")
            quant[k] = (t, scale.float())
            dense[k] = fp8.dequantize(t, scale, torch.float32)
        elif t.is_floating_point():
            dense[k] = t.float()
        else:
            dense[k] = t
    return dense, quant


def _load_into(model, tensors: dict[str, torch.Tensor]) -> set[str]:
    """Load checkpoint tensors into `model`, matching names with or without base_model_prefix.
    Returns the checkpoint names that were used (e.g. not BERT's pooler when it is left out)."""
    own = model.state_dict()
    prefix = getattr(model, "base_model_prefix", "") or ""
    mapped = {}
    used = set()
    for k, v in tensors.items():
        for cand in (k, f"{prefix}.{k}", k[len(prefix) + 1 :] if prefix and k.startswith(prefix + ".") else None):
            if cand and cand in own:
                mapped[cand] = v
                used.add(k)
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
        mods = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return any("Normalize" in str(m.get("type", "")) for m in mods if isinstance(m, dict))


class CausalLMForCoreML(torch.nn.Module):
    """input_ids [1, T] -> logits [1, T, vocab]: no cache, every token attends causally."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


class EncoderForCoreML(torch.nn.Module):
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
    cfg_dict = json.loads((artifact / CONFIG_NAME).read_text())
    cfg_dict.pop("quantization_config", None)  # the weights are given dense: no compressed-tensors loader
    model_type = cfg_dict.get("model_type")
    try:
        config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in cfg_dict.items() if k != "model_type"})
    except (ValueError, KeyError) as e:
        raise ExportError(f"transformers does not know model_type {model_type!r}", "upgrade transformers") from e
    task = task_of(config)
    dense, quant = read_artifact_weights(artifact)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if task == "causal-lm":
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
        else:
            # The pooler (BERT's [CLS] dense+tanh) is not part of the embeddings output.
            extra = {"add_pooling_layer": False} if config.model_type in ("bert", "roberta", "xlm-roberta", "camembert") else {}
            model = transformers.AutoModel.from_config(config, dtype=torch.float32, attn_implementation="eager", **extra)
    used = _load_into(model, dense)
    model.eval()
    normalize = task == "encoder" and _uses_normalize(artifact)
    wrapper = CausalLMForCoreML(model) if task == "causal-lm" else EncoderForCoreML(model, normalize)
    return TorchModel(
        task=task, module=wrapper.eval(), config=config, normalize=normalize,
        fp8_weights={k: v for k, v in quant.items() if k in used},
        unused=sorted(k for k in quant if k not in used),
    )


def example_inputs(tm: TorchModel, length: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    vocab = int(getattr(tm.config, "vocab_size", 100))
    ids = torch.randint(0, vocab, (1, length), generator=g)
    if tm.task == "causal-lm":
        return (ids,)
    return (ids, torch.ones(1, length, dtype=torch.long))


# --------------------------------------------------------------------------- conversion


def _op_from_error(e: BaseException) -> tuple[str | None, bool]:
    """(the torch op a coremltools conversion error is about, whether it has no converter at all)."""
    text = str(e)
    for pat, missing in ((r"convert function for op '([^']+)' not implemented", True), (r"Unsupported fx node [^,]+, kind (\S+)", True),
                         (r"op '([^']+)'", False)):
        m = re.search(pat, text)
        if m:
            return m.group(1), missing
    return None, False


def _short(e: BaseException) -> str:
    line = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {line[:300]}"


@contextlib.contextmanager
def _quiet():
    """coremltools and torch.export print progress bars and warnings per op: keep them out."""
    loggers = [logging.getLogger(n) for n in ("coremltools", "torch._export", "torch.export", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    buf = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(buf):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


# Ops kept in fp32 inside the FP16 program: RMSNorm's mean of squares overflows fp16 (x**2 >
# 65504 once |x| > 256, which real LLM activations reach: SmolLM2-135M's logits lose all
# agreement). They are few and small (one value per token), so this costs little.
FP32_OPS = ("pow", "reduce_mean", "rsqrt", "sqrt", "reduce_sum_square", "reduce_l2_norm")


def _keep_fp16(op) -> bool:
    """op_selector for coremltools' FP16ComputePrecision: False keeps `op` in fp32."""
    if op.op_type in FP32_OPS:
        return False
    if op.op_type in ("add", "sub", "mul", "real_div", "maximum"):
        # the `+ eps` (and friends) between a mean of squares and its rsqrt
        for v in op.inputs.values():
            src = getattr(v, "op", None)
            if src is not None and src.op_type in FP32_OPS and src.op_type != "rsqrt" and src.op_type != "sqrt":
                return False
    return True


def _ct_inputs(tm: TorchModel, seq: SeqLen):
    import coremltools as ct

    dim = ct.RangeDim(seq.lo, seq.hi, default=seq.example) if seq.is_range else seq.lo
    return [ct.TensorType(name=n, shape=(1, dim), dtype=np.int32) for n in tm.input_names]


def _convert_with(frontend: str, tm: TorchModel, seq: SeqLen):
    import coremltools as ct

    example = example_inputs(tm, seq.example)
    common = dict(
        outputs=[ct.TensorType(name=tm.output_name)],
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.transform.FP16ComputePrecision(op_selector=_keep_fp16),
        convert_to="mlprogram",
        skip_model_load=True,
    )
    with torch.no_grad():
        if frontend == "torch.export":
            dynamic = None
            if seq.is_range:
                d = torch.export.Dim("seq_len", min=seq.lo, max=seq.hi)
                dynamic = {n: {1: d} for n in tm.input_names}
            ep = torch.export.export(tm.module, example, dynamic_shapes=dynamic, strict=False)
            ep = ep.run_decompositions({})
            return ct.convert(ep, **common)
        traced = torch.jit.trace(tm.module, example, strict=False, check_trace=False)
        return ct.convert(traced, inputs=_ct_inputs(tm, seq), **common)


def convert(tm: TorchModel, seq: SeqLen, frontend: str = "auto"):
    """Convert with torch.export, falling back to torch.jit.trace. Returns (mlmodel, record)."""
    from . import ops as coreml_ops

    added = coreml_ops.register()
    order = list(FRONTENDS) if frontend == "auto" else [frontend]
    if frontend not in ("auto", *FRONTENDS):
        raise MpsconvertError(f"unknown frontend {frontend!r}", f"use auto or one of {', '.join(FRONTENDS)}")
    attempts: dict[str, str] = {}
    for fe in order:
        try:
            with _quiet():
                ml = _convert_with(fe, tm, seq)
        except Exception as e:  # each failure is recorded; the last one is raised below, naming the op
            attempts[fe] = _short(e)
            last = e
            continue
        return ml, {"frontend": fe, "failed_frontends": attempts, "registered_ops": list(added)}
    op, missing = _op_from_error(last)
    what = "conversion failed" if op is None else f"torch op {op!r} has no Core ML converter" if missing else f"converting torch op {op!r} failed"
    detail = "; ".join(f"{fe}: {msg}" for fe, msg in attempts.items())
    raise ExportError(
        f"Core ML export of {type(tm.module.model).__name__} failed: {what} ({detail})",
        "add a converter for it in mpsconvert/convert/coreml/ops.py, or export a different architecture",
    ) from last


# --------------------------------------------------------------------------- FP8 weights in the program


def e4m3_lut() -> np.ndarray:
    """The 256 e4m3fn values indexed by bit pattern, as float32 (NaN codes -> 0)."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8.FP8_DTYPE)
    vals = fp8.fp8_to_float(codes).numpy().astype(np.float32)
    vals[list(_NAN_CODES)] = 0.0
    return vals


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _weight_consts(prog) -> list:
    """The const ops of a program that hold 2-D float weights."""
    out = []
    for f in prog.functions.values():
        for op in f.operations:
            if op.op_type == "const":
                v = op.outputs[0].val
                if isinstance(v, np.ndarray) and v.ndim == 2 and v.dtype in (np.float16, np.float32):
                    out.append(op)
    return out


def match_fp8_consts(prog, fp8_weights: dict) -> dict[str, tuple[str, bool]]:
    """FP8 tensor name -> (const op name, transposed), matched by value: the const must equal the
    artifact's dequantized weight in FP16 (or its transpose) bit for bit. Names are not used:
    they differ between torch.export and torch.jit.trace and between coremltools versions."""
    want: dict[tuple, list[tuple[str, bool]]] = {}
    for name, (q, s) in fp8_weights.items():
        w16 = fp8.dequantize(q, s, torch.float16).numpy()
        want.setdefault((w16.shape, _digest(w16)), []).append((name, False))
        want.setdefault((w16.T.shape, _digest(w16.T)), []).append((name, True))
    found: dict[str, tuple[str, bool]] = {}
    for op in _weight_consts(prog):
        v = op.outputs[0].val
        v16 = v.astype(np.float16) if v.dtype != np.float16 else v
        for name, transposed in want.get((v16.shape, _digest(v16)), []):
            found.setdefault(name, (op.name, transposed))
    return found


def lut_exponent(scale: np.ndarray) -> int:
    """k such that e4m3 x 2**-k is near the weights' size (so x @ W' stays in fp16 range) while
    every e4m3 value x 2**-k is still exact in fp16 (e4m3's finest step 2**-9 needs k <= 15)."""
    med = float(np.median(scale))
    return int(np.clip(np.round(-np.log2(med)), -7, 15)) if med > 0 else 0


def _fp8_lut_pass(fp8_weights: dict, record: dict):
    """A MIL graph pass: each matched weight const -> an 8-bit palette of the FP8 codes.

    Per-tensor scale: `constexpr_lut_to_dense(codes, fp16(e4m3 x scale))`, the artifact's FP16
    dequantized weight exactly. Per-row scale: the LUT is shared (e4m3 x 2**-k, exact) and the row
    scale (x 2**k, fp16) multiplies each consuming `linear`'s output, before its bias, as
    coremltools' own `reorder_lut_per_channel_scale` does for the Neural Engine. The other iOS18
    form, LUT -> `constexpr_blockwise_shift_scale`, is rewritten by coremltools for iOS18 targets
    into a LUT repeated once per row (512 bytes per row: +33..90% for these shapes).
    """
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
    from coremltools.converters.mil.mil.passes.helper import block_context_manager

    lut_base = e4m3_lut()

    class Fp8LutPass(AbstractGraphPass):
        def apply(self, prog):
            matched = match_fp8_consts(prog, fp8_weights)
            missing = sorted(set(fp8_weights) - set(matched))
            if missing:
                raise ExportError(
                    f"{len(missing)} FP8 weight(s) are not a plain constant in the converted program (e.g. {missing[0]})",
                    "use --coreml-weights int8 or fp16 for this model",
                )
            by_const: dict[str, list[str]] = {}
            for name, (const, _) in matched.items():
                by_const.setdefault(const, []).append(name)

            @block_context_manager
            def apply_block(block):
                for op in list(block.operations):
                    if op.op_type != "const" or op.name not in by_const:
                        continue
                    names = by_const[op.name]
                    _, transposed = matched[names[0]]
                    q, s = fp8_weights[names[0]]
                    idx = np.ascontiguousarray(q.view(torch.uint8).numpy())
                    scale = s.numpy().astype(np.float32).reshape(-1)
                    base = op.name + "_fp8"
                    consumers = list(op.outputs[0].child_ops)
                    if scale.size == 1:
                        # fp32 product, one fp16 rounding: exactly the artifact's FP16 dequantization.
                        lut = (lut_base * scale[0]).astype(np.float16)
                        new = mb.constexpr_lut_to_dense(indices=idx.T.copy() if transposed else idx, lut=lut.reshape(1, 1, 256, 1), before_op=op, name=base + "_lut")
                        op.enclosing_block.replace_uses_of_var_after_op(anchor_op=op, old_var=op.outputs[0], new_var=new, no_check_var_types=True)
                        info = {"lut": base + "_lut", "row_scale": None, "lut_exponent": None, "encoding": "lut(e4m3 x tensor scale, fp16)"}
                    else:
                        bad = [c.op_type for c in consumers if c.op_type != "linear" or c.weight is not op.outputs[0]]
                        if transposed or bad:
                            raise ExportError(
                                f"FP8 weight {names[0]} (per-row scale) feeds {', '.join(sorted(set(bad))) or 'a transposed matmul'}, not a linear",
                                "use --coreml-weights int8 or fp16 for this model",
                            )
                        k = lut_exponent(scale)
                        lut = (lut_base * np.float32(2.0**-k)).astype(np.float16)  # exact: powers of two
                        dense = mb.constexpr_lut_to_dense(indices=idx, lut=lut.reshape(1, 1, 256, 1), before_op=op, name=base + "_lut")
                        row = (scale * np.float32(2.0**k)).astype(np.float16)
                        for lin in consumers:
                            y = mb.linear(x=lin.x, weight=dense, before_op=lin, name=lin.name + "_fp8codes")
                            y = mb.mul(x=y, y=mb.const(val=row, name=base + "_row_scale", before_op=lin), before_op=lin, name=lin.name + "_rowscaled")
                            if lin.bias is not None and lin.bias.val is not None and np.any(lin.bias.val):
                                y = mb.add(x=y, y=lin.bias, before_op=lin, name=lin.name + "_bias")
                            lin.enclosing_block.replace_uses_of_var_after_op(anchor_op=lin, old_var=lin.outputs[0], new_var=y)
                            lin.enclosing_block.remove_ops([lin])
                        info = {"lut": base + "_lut", "row_scale": base + "_row_scale", "lut_exponent": k,
                                "encoding": "lut(e4m3 x 2^-k, fp16) -> linear -> x row scale x 2^k (fp16)"}
                    block.remove_ops([op])
                    for n in names:
                        record[n] = {"op": op.name, "transposed": transposed, **info}

            for f in prog.functions.values():
                apply_block(f)

    return Fp8LutPass()


def apply_weights(mlmodel, mode: str, fp8_weights: dict) -> tuple[object, dict]:
    """Re-encode the FP8 weights of a converted model. Returns (mlmodel, tensor -> how stored)."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load
    from coremltools.models.utils import _apply_graph_pass

    if mode not in WEIGHT_MODES:
        raise MpsconvertError(f"unknown --coreml-weights {mode!r}", f"use one of: {', '.join(WEIGHT_MODES)}")
    spec_version = mlmodel.get_spec().specificationVersion
    record: dict = {}
    if mode == "fp16":
        prog = milproto_load(mlmodel.get_spec(), spec_version, mlmodel.weights_dir)
        for name, (const, tr) in match_fp8_consts(prog, fp8_weights).items():
            record[name] = {"op": const, "transposed": tr, "encoding": "dense fp16"}
        return mlmodel, record
    if mode == "int8":
        prog = milproto_load(mlmodel.get_spec(), spec_version, mlmodel.weights_dir)
        matched = match_fp8_consts(prog, fp8_weights)
        cfg = ct.optimize.coreml.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", granularity="per_channel", weight_threshold=0)
        config = ct.optimize.coreml.OptimizationConfig(op_name_configs={const: cfg for const, _ in matched.values()})
        with _quiet():
            out = ct.optimize.coreml.linear_quantize_weights(mlmodel, config=config)
        for name, (const, tr) in matched.items():
            record[name] = {"op": const, "transposed": tr, "encoding": "int8 per-channel (coremltools linear_quantize_weights)"}
        return out, record
    with _quiet():
        out = _apply_graph_pass(mlmodel, _fp8_lut_pass(fp8_weights, record), spec_version=spec_version, skip_model_load=True)
    return out, record


# --------------------------------------------------------------------------- the package in the artifact


def _package_files(pkg: Path, artifact: Path) -> dict[str, dict]:
    out = {}
    for p in sorted(pkg.rglob("*")):
        if p.is_file():
            out[p.relative_to(artifact).as_posix()] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return out


def _save_package(mlmodel, artifact: Path, force: bool) -> Path:
    """Save under a temporary name inside the artifact, then rename to model.mlpackage."""
    target = artifact / PACKAGE_NAME
    if target.exists() and not force:
        raise MpsconvertError(f"{target} already exists", "pass --force to replace it")
    tmp_root = Path(tempfile.mkdtemp(prefix=TMP_PREFIX + "coreml-", dir=artifact))
    try:
        tmp_pkg = tmp_root / PACKAGE_NAME
        with _quiet():
            mlmodel.save(str(tmp_pkg))
        if target.exists():
            old = tmp_root / "old.mlpackage"
            os.replace(target, old)
        os.replace(tmp_pkg, target)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return target


def weight_bytes_of_package(pkg: Path) -> int:
    return sum(p.stat().st_size for p in (pkg / "Data" / "com.apple.CoreML" / "weights").rglob("*") if p.is_file())


def fp8_safetensors_bytes(artifact: Path) -> int:
    return sum(p.stat().st_size for p in Path(artifact).glob("*.safetensors"))


def export_coreml(artifact: Path, opts: ExportOptions, progress: Progress | None = None) -> dict:
    """Export `artifact` to `<artifact>/model.mlpackage`; returns manifest.extra["coreml"].

    Nothing in the artifact changes unless the whole export succeeds: the package is built under a
    temporary name and renamed, then the manifest is rewritten atomically.
    """
    import coremltools as ct

    progress = or_silent(progress)
    steps = iter(range(1, 4))

    def status(msg: str) -> None:
        progress("coreml export", next(steps), 3, msg)

    artifact = Path(artifact)
    manifest = Manifest.read(artifact)
    if (artifact / PACKAGE_NAME).exists() and not opts.force:
        raise MpsconvertError(f"{artifact / PACKAGE_NAME} already exists", "pass --force to replace it")
    if opts.weights not in WEIGHT_MODES:
        raise MpsconvertError(f"unknown --coreml-weights {opts.weights!r}", f"use one of: {', '.join(WEIGHT_MODES)}")
    status("building the PyTorch model from the artifact's weights")
    tm = build_torch_model(artifact)
    max_pos = getattr(tm.config, "max_position_embeddings", None)
    if max_pos and opts.seq_len.hi > max_pos:
        raise MpsconvertError(f"--seq-len {opts.seq_len} exceeds the model's max_position_embeddings ({max_pos})", f"use at most {max_pos}")
    status("converting to a Core ML ML program")
    mlmodel, conv = convert(tm, opts.seq_len, opts.frontend)
    status(f"converted with {conv['frontend']}; encoding weights as {opts.weights}")
    mlmodel, weights = apply_weights(mlmodel, opts.weights, tm.fp8_weights)
    mlmodel.short_description = f"mpsconvert {manifest.recipe.get('name')} artifact of {manifest.source.get('id')} ({opts.weights} weights)"
    pkg = _save_package(mlmodel, artifact, opts.force)
    record = {
        "package": PACKAGE_NAME,
        "task": tm.task,
        "inputs": tm.input_names,
        "output": tm.output_name,
        "pooling": ("mean" + (" + l2 normalize" if tm.normalize else "")) if tm.task == "encoder" else None,
        "seq_len": {"min": opts.seq_len.lo, "max": opts.seq_len.hi, "flexible": opts.seq_len.is_range},
        "weights": opts.weights,
        "activations": "fp16 (the artifact's FP8 activation quantization has no Core ML equivalent and is not applied)",
        "compute_precision": f"fp16 (fp32 for {', '.join(FP32_OPS)} and their eps add: RMSNorm overflows fp16)",
        "minimum_deployment_target": DEPLOYMENT_TARGET,
        "frontend": conv["frontend"],
        "failed_frontends": conv["failed_frontends"],
        "registered_ops": conv["registered_ops"],
        "coremltools": ct.__version__,
        "fp8_tensors": len(tm.fp8_weights),
        "fp8_tensors_not_exported": tm.unused,
        "encoded_tensors": dict(sorted(weights.items())),
        "package_weight_bytes": weight_bytes_of_package(pkg),
        "fp8_safetensors_bytes": fp8_safetensors_bytes(artifact),
    }
    with update_manifest(artifact) as manifest:
        files = {k: v for k, v in manifest.files.items() if not k.startswith(PACKAGE_NAME + "/")}
        files.update(_package_files(pkg, artifact))
        manifest.files = dict(sorted(files.items()))
        manifest.extra["coreml"] = record
        manifest.versions["coremltools"] = ct.__version__
    return record
