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
import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...errors import ExportError, MpsconvertError
from ...format import fp8
from ...infra.progress import Progress, or_silent
from ...manifests.manifest import Manifest
from ...model import hf_compat
from .. import stateful
from ..torch_model import TorchModel, build_torch_model, example_inputs, fp8_safetensors_bytes
from . import FRONTENDS, PACKAGE_NAME, WEIGHT_MODES, ExportOptions, SeqLen  # noqa: E402, F401  (light: the CLI and API read them without this module)

DEPLOYMENT_TARGET = "iOS18 / macOS15"
# e4m3fn NaN codes (0x7f, 0xff) never occur in an artifact (values are clamped before the cast);
# their LUT entries are 0 so that the palette holds only finite values.
_NAN_CODES = (0x7F, 0xFF)


# --------------------------------------------------------------------------- conversion


def _op_from_error(e: BaseException) -> tuple[str | None, bool]:
    """(the torch op a coremltools conversion error is about, whether it has no converter at all)."""
    text = str(e)
    for pat, missing in (
        (r"convert function for op '([^']+)' not implemented", True),
        (r"Unsupported fx node [^,]+, kind (\S+)", True),
        (r"op '([^']+)'", False),
    ):
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


@dataclass
class Interface:
    """What is converted: the torch module, how it is traced, and the Core ML interface it gets.

    Stateless causal LMs and encoders: `tm.module` with inputs of `seq` length. The stateful
    decoder (`apple/stateful.py`): input_ids [1, 1..max_len], position [1], one fp16 state per
    layer and K/V (Core ML states are fp16; coremltools casts around them)."""

    module: torch.nn.Module
    example: tuple
    input_names: list[str]
    output_name: str
    dynamic: dict | None
    lengths: SeqLen  # of the sequence inputs
    states: list = None  # StateSpec, stateful only

    @property
    def stateful(self) -> bool:
        return bool(self.states)


def _scaled_batched_mm(self, hidden_states, top_k_index, top_k_weights):
    """transformers' batched_mm experts forward with each expert weight = LUT values x a per-row
    scale applied to the batched matmul's output (as `_fp8_lut_pass` does for Linears): the
    weights stay a shared 256-entry palette over the FP8 codes."""
    k = top_k_index.size(-1)
    tokens, hidden = hidden_states.shape
    ids = top_k_index.reshape(-1)
    x = hidden_states.repeat_interleave(k, dim=0)
    y = torch.bmm(self.gate_up_proj[ids], x.unsqueeze(-1)).squeeze(-1) * self.gate_up_proj_row_scale[ids]
    y = hf_compat.expert_gate(self, y)
    y = torch.bmm(self.down_proj[ids], y.unsqueeze(-1)).squeeze(-1) * self.down_proj_row_scale[ids]
    y = y * top_k_weights.reshape(-1).unsqueeze(-1)
    return y.view(tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)


def lut_experts(tm: TorchModel) -> tuple[dict, dict]:
    """Prepare fused FP8 experts for `fp8-lut`: each parameter holds e4m3 x 2**-k (exact in fp16,
    one shared palette) and a buffer holds the per-row scale x 2**k, applied after the matmul.
    Returns (tensors for the LUT pass: name -> (codes, 2**-k as a tensor scale), record)."""
    weights, record = {}, {}
    for name, (codes, scale, keys) in tm.fp8_experts.items():
        mod_name, _, param = name.rpartition(".")
        mod = tm.model.get_submodule(mod_name)
        s = scale.float().reshape(scale.shape[0], scale.shape[1])
        k = lut_exponent(s.numpy())
        with torch.no_grad():
            getattr(mod, param).copy_(fp8.fp8_to_float(codes) * 2.0**-k)
        mod.register_buffer(f"{param}_row_scale", (s * 2.0**k).to(torch.float16).float())
        weights[name] = (codes, torch.tensor([2.0**-k]))
        record[name] = {
            "lut_exponent": k,
            "row_scale": (s * 2.0**k).to(torch.float16).numpy(),
            "artifact_tensors": len(keys),
        }
    for mod_name in {n.rpartition(".")[0] for n in tm.fp8_experts}:
        mod = tm.model.get_submodule(mod_name)
        mod.__class__ = type(f"LutExperts{type(mod).__name__}", (type(mod),), {"forward": _scaled_batched_mm})
    return weights, record


def stateless_target(tm: TorchModel, seq: SeqLen) -> Interface:
    dynamic = None
    if seq.is_range:
        d = torch.export.Dim("seq_len", min=seq.lo, max=seq.hi)
        dynamic = {n: {1: d} for n in tm.input_names}
    return Interface(tm.module, example_inputs(tm, seq.example), tm.input_names, tm.output_name, dynamic, seq)


def stateful_target(tm: TorchModel, max_len: int) -> Interface:
    # fp32 buffers: coremltools makes every state fp16 itself (reads cast to fp32, writes back to fp16)
    wrapper = stateful.StatefulCausalLM(tm.model, max_len).eval()
    seq = SeqLen(1, max_len)
    ids = example_inputs(tm, seq.example)[0].to(torch.int32)
    d = torch.export.Dim("seq_len", min=1, max=max_len)
    return Interface(
        wrapper,
        (ids, torch.zeros(1, dtype=torch.int32)),
        list(stateful.INPUT_NAMES),
        stateful.OUTPUT_NAME,
        {"input_ids": {1: d}, "position": None},
        seq,
        wrapper.states(),
    )


def _ct_inputs(target: Interface):
    import coremltools as ct

    seq = target.lengths
    dim = ct.RangeDim(seq.lo, seq.hi, default=seq.example) if seq.is_range else seq.lo
    inputs = [ct.TensorType(name=n, shape=(1, dim), dtype=np.int32) for n in target.input_names if n != "position"]
    if target.stateful:
        inputs.append(ct.TensorType(name="position", shape=(1,), dtype=np.int32))
    return inputs


def _ct_states(target: Interface):
    import coremltools as ct

    return [
        ct.StateType(wrapped_type=ct.TensorType(shape=s.shape, dtype=np.float16), name=s.name)
        for s in target.states or []
    ]


def _convert_with(frontend: str, target: Interface):
    import coremltools as ct

    common = dict(
        outputs=[ct.TensorType(name=target.output_name)],
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.transform.FP16ComputePrecision(op_selector=_keep_fp16),
        convert_to="mlprogram",
        skip_model_load=True,
    )
    with torch.no_grad():
        if frontend == "torch.export":
            if target.stateful:
                ep = stateful.export_program(target.module, target.lengths.example)
            else:
                ep = torch.export.export(target.module, target.example, dynamic_shapes=target.dynamic, strict=False)
                ep = ep.run_decompositions({})
            # states come from the program's mutated buffers, named as the buffers are
            return ct.convert(ep, **common)
        if target.stateful:
            target.module.reset()
        traced = torch.jit.trace(target.module, target.example, strict=False, check_trace=False)
        if target.stateful:
            target.module.reset()
            common["states"] = _ct_states(target)
        return ct.convert(traced, inputs=_ct_inputs(target), **common)


def convert(tm: TorchModel, target: Interface, frontend: str = "auto"):
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
                ml = _convert_with(fe, target)
        except Exception as e:  # each failure is recorded; the last one is raised below, naming the op
            attempts[fe] = _short(e)
            last = e
            continue
        return ml, {"frontend": fe, "failed_frontends": attempts, "registered_ops": list(added)}
    op, missing = _op_from_error(last)
    what = (
        "conversion failed"
        if op is None
        else f"torch op {op!r} has no Core ML converter"
        if missing
        else f"converting torch op {op!r} failed"
    )
    detail = "; ".join(f"{fe}: {msg}" for fe, msg in attempts.items())
    raise ExportError(
        f"Core ML export of {type(tm.module.model).__name__} failed: {what} ({detail})",
        "add a converter for it in mpsconvert/apple/coreml/ops.py, or export a different architecture",
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
    """The const ops of a program that hold 2-D float weights (3-D: fused MoE experts)."""
    out = []
    for f in prog.functions.values():
        for op in f.operations:
            if op.op_type == "const":
                v = op.outputs[0].val
                if isinstance(v, np.ndarray) and v.ndim in (2, 3) and v.dtype in (np.float16, np.float32):
                    out.append(op)
    return out


def match_fp8_consts(prog, fp8_weights: dict) -> dict[str, tuple[str, bool]]:
    """FP8 tensor name -> (const op name, transposed), matched by value: the const must equal the
    artifact's dequantized weight in FP16 (or its transpose) bit for bit. Names are not used:
    they differ between torch.export and torch.jit.trace and between coremltools versions."""
    want: dict[tuple, list[tuple[str, bool]]] = {}
    for name, (q, s) in fp8_weights.items():
        w16 = fp8.dequantize_tiles(q, s, torch.float16).numpy()
        want.setdefault((w16.shape, _digest(w16)), []).append((name, False))
        if w16.ndim == 2:
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

    Per-tensor scale: `constexpr_lut_to_dense(codes, fp16(e4m3 x scale))`, the artifact's FP16 dequantized weight
    exactly; per-block scale: the same with one palette per block (the LUT op's per-block palettes; a scale after the
    matmul cannot vary along K). Per-row scale: the LUT is shared (e4m3 x 2**-k, exact) and the row scale (x 2**k, fp16)
    multiplies each consuming `linear`'s output, before its bias, as coremltools' own `reorder_lut_per_channel_scale`
    does for the Neural Engine. The other iOS18 form, LUT -> `constexpr_blockwise_shift_scale`, is rewritten by
    coremltools for iOS18 targets into a LUT repeated once per row (512 bytes per row: +33..90% for these shapes).
    """
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
    from coremltools.converters.mil.mil.passes.helper import block_context_manager

    lut_base = e4m3_lut()

    def in_place(op, indices, lut, encoding: str, blocks: list | None = None) -> dict:
        """The weight const `op` replaced, for every use, by its codes through the palette `lut`; its record."""
        name = op.name + "_fp8_lut"
        new = mb.constexpr_lut_to_dense(indices=indices, lut=lut, before_op=op, name=name)
        op.enclosing_block.replace_uses_of_var_after_op(
            anchor_op=op, old_var=op.outputs[0], new_var=new, no_check_var_types=True
        )
        per_block = {} if blocks is None else {"lut_blocks": blocks}
        return {"lut": name, "row_scale": None, "lut_exponent": None, **per_block, "encoding": encoding}

    class Fp8LutPass(AbstractGraphPass):
        def apply(self, prog):
            matched = match_fp8_consts(prog, fp8_weights)
            missing = sorted(set(fp8_weights) - set(matched))
            if missing:
                raise ExportError(
                    f"{len(missing)} FP8 weight(s) are not a plain constant in the converted program (e.g. "
                    f"{missing[0]})",
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
                    if fp8.is_block_scale(s, q.shape[0]):
                        # Block scales (tiles of the weight, fp8.tile_scale): one 256-entry palette per
                        # block, fp16(e4m3 x block scale): the artifact's FP16 dequantization exactly,
                        # 512 bytes per block (3% of a 128x128 block's 16 KiB of codes).
                        tiles = s.numpy().astype(np.float32)
                        lut = (tiles[:, :, None] * lut_base[None, None, :]).astype(np.float16)
                        if transposed:
                            idx, lut = idx.T.copy(), lut.transpose(1, 0, 2).copy()
                        info = in_place(
                            op, idx, lut[..., None], "lut per block (e4m3 x block scale, fp16)", list(tiles.shape)
                        )
                    elif scale.size == 1:
                        # fp32 product, one fp16 rounding: exactly the artifact's FP16 dequantization.
                        lut = (lut_base * scale[0]).astype(np.float16)
                        info = in_place(
                            op,
                            idx.T.copy() if transposed else idx,
                            lut.reshape((1,) * idx.ndim + (256, 1)),
                            "lut(e4m3 x tensor scale, fp16)",
                        )
                    else:
                        bad = [c.op_type for c in consumers if c.op_type != "linear" or c.weight is not op.outputs[0]]
                        if transposed or bad:
                            raise ExportError(
                                f"FP8 weight {names[0]} (per-row scale) feeds "
                                f"{', '.join(sorted(set(bad))) or 'a transposed matmul'}, not a linear",
                                "use --coreml-weights int8 or fp16 for this model",
                            )
                        k = lut_exponent(scale)
                        lut = (lut_base * np.float32(2.0**-k)).astype(np.float16)  # exact: powers of two
                        dense = mb.constexpr_lut_to_dense(
                            indices=idx, lut=lut.reshape(1, 1, 256, 1), before_op=op, name=base + "_lut"
                        )
                        row = (scale * np.float32(2.0**k)).astype(np.float16)
                        for lin in consumers:
                            y = mb.linear(x=lin.x, weight=dense, before_op=lin, name=lin.name + "_fp8codes")
                            y = mb.mul(
                                x=y,
                                y=mb.const(val=row, name=base + "_row_scale", before_op=lin),
                                before_op=lin,
                                name=lin.name + "_rowscaled",
                            )
                            if lin.bias is not None and lin.bias.val is not None and np.any(lin.bias.val):
                                y = mb.add(x=y, y=lin.bias, before_op=lin, name=lin.name + "_bias")
                            lin.enclosing_block.replace_uses_of_var_after_op(
                                anchor_op=lin, old_var=lin.outputs[0], new_var=y
                            )
                            lin.enclosing_block.remove_ops([lin])
                        info = {
                            "lut": base + "_lut",
                            "row_scale": base + "_row_scale",
                            "lut_exponent": k,
                            "encoding": "lut(e4m3 x 2^-k, fp16) -> linear -> x row scale x 2^k (fp16)",
                        }
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
        cfg = ct.optimize.coreml.OpLinearQuantizerConfig(
            mode="linear_symmetric", dtype="int8", granularity="per_channel", weight_threshold=0
        )
        config = ct.optimize.coreml.OptimizationConfig(op_name_configs={const: cfg for const, _ in matched.values()})
        with _quiet():
            out = ct.optimize.coreml.linear_quantize_weights(mlmodel, config=config)
        for name, (const, tr) in matched.items():
            record[name] = {
                "op": const,
                "transposed": tr,
                "encoding": "int8 per-channel (coremltools linear_quantize_weights)",
            }
        return out, record
    with _quiet():
        out = _apply_graph_pass(
            mlmodel, _fp8_lut_pass(fp8_weights, record), spec_version=spec_version, skip_model_load=True
        )
    return out, record


# --------------------------------------------------------------------------- the package in the artifact


def stable_package_ids(pkg: Path) -> None:
    """Make a saved package byte-identical from run to run. Two things differed between two
    exports of one artifact: coremltools names the items of an .mlpackage's Manifest.json by
    random uuid4s (keys only: they become uuid5s of each item's path), and the spec's protobuf
    maps are serialized in an order that varies between processes (rewritten here with
    protobuf's deterministic serialization: the same message, in a fixed order)."""
    import json
    import uuid

    from coremltools.proto import Model_pb2

    spec_file = Path(pkg) / "Data" / "com.apple.CoreML" / "model.mlmodel"
    spec = Model_pb2.Model()
    spec.ParseFromString(spec_file.read_bytes())
    spec_file.write_bytes(spec.SerializeToString(deterministic=True))

    mf = Path(pkg) / "Manifest.json"
    body = json.loads(mf.read_text(encoding="utf-8"))
    ids = {
        old: str(uuid.uuid5(uuid.NAMESPACE_URL, f"mpsconvert:{item.get('path')}"))
        for old, item in body.get("itemInfoEntries", {}).items()
    }
    body["itemInfoEntries"] = {ids[k]: v for k, v in body["itemInfoEntries"].items()}
    if body.get("rootModelIdentifier") in ids:
        body["rootModelIdentifier"] = ids[body["rootModelIdentifier"]]
    mf.write_text(
        json.dumps(body, indent=4, sort_keys=True) + "\n", encoding="utf-8"
    )  # as libmodelpackage writes it on open


def weight_bytes_of_package(pkg: Path) -> int:
    return sum(p.stat().st_size for p in (pkg / "Data" / "com.apple.CoreML" / "weights").rglob("*") if p.is_file())


def build(folder: Path, manifest: Manifest, opts: ExportOptions, progress: Progress | None = None) -> dict:
    """Write `<folder>/model.mlpackage` from the (verified) artifact in `folder`; returns its
    manifest record and sets the manifest's coremltools version (apple/flow.py publishes both
    with the package, in one swap). coremltools' own temporary packages go to the run's private
    temp folder (the flow's transaction makes it tempfile's default)."""
    import coremltools as ct

    progress = or_silent(progress)
    steps = iter(range(1, 4))

    def status(msg: str) -> None:
        progress("coreml export", next(steps), 3, msg)

    artifact = Path(folder)
    if opts.weights not in WEIGHT_MODES:
        raise MpsconvertError(f"unknown --coreml-weights {opts.weights!r}", f"use one of: {', '.join(WEIGHT_MODES)}")
    status("building the PyTorch model from the artifact's weights")
    tm = build_torch_model(artifact)
    fp8_tensors, experts = dict(tm.fp8_weights), {}
    if tm.fp8_experts and opts.weights == "fp8-lut":
        lut, experts = lut_experts(tm)
        fp8_tensors.update(lut)
    else:  # int8 / fp16: the experts' dequantized weights, encoded like any other
        fp8_tensors.update({n: (c, s) for n, (c, s, _) in tm.fp8_experts.items()})
    max_pos = getattr(tm.config, "max_position_embeddings", None)
    stateful_lm = tm.task == "causal-lm" and opts.kv_cache
    max_len = stateful.resolve_max_len(opts.max_len, tm.config) if stateful_lm else None
    if stateful_lm:
        target = stateful_target(tm, max_len)
    else:
        if max_pos and opts.seq_len.hi > max_pos:
            raise MpsconvertError(
                f"`seq_len={opts.seq_len}` exceeds the model's max_position_embeddings ({max_pos})",
                f"use at most {max_pos}",
            )
        target = stateless_target(tm, opts.seq_len)
    status("converting to a Core ML ML program" + (" (stateful decoder)" if stateful_lm else ""))
    mlmodel, conv = convert(tm, target, opts.frontend)
    status(f"converted with {conv['frontend']}; encoding weights as {opts.weights}")
    mlmodel, weights = apply_weights(mlmodel, opts.weights, fp8_tensors)
    for name, e in experts.items():
        weights[name].update(
            {
                "encoding": "lut(e4m3 x 2^-k, fp16) -> gather -> batched matmul -> x row scale x 2^k (fp16)",
                "experts_lut_exponent": e["lut_exponent"],
                "artifact_tensors": e["artifact_tensors"],
            }
        )
    mlmodel.short_description = (
        f"mpsconvert {manifest.recipe.get('name')} artifact of {manifest.source.get('id')} ({opts.weights} weights)"
    )

    def save(path: Path) -> None:
        with _quiet():
            mlmodel.save(str(path))
        stable_package_ids(path)

    record = {
        "package": PACKAGE_NAME,
        "task": tm.task,
        "kv_cache": stateful_lm,
        "inputs": target.input_names,
        "output": target.output_name,
        "states": [st.as_dict() | {"dtype": "float16"} for st in target.states or []],
        "pooling": ("mean" + (" + l2 normalize" if tm.normalize else "")) if tm.task == "encoder" else None,
        "seq_len": {"min": target.lengths.lo, "max": target.lengths.hi, "flexible": target.lengths.is_range},
        "max_len": max_len,
        "weights": opts.weights,
        "activations": "fp16 (the artifact's FP8 activation quantization has no Core ML equivalent and is not applied)",
        "compute_precision": f"fp16 (fp32 for {', '.join(FP32_OPS)} and their eps add: RMSNorm overflows fp16)",
        "minimum_deployment_target": DEPLOYMENT_TARGET,
        "frontend": conv["frontend"],
        "failed_frontends": conv["failed_frontends"],
        "registered_ops": conv["registered_ops"],
        "coremltools": ct.__version__,
        "fp8_tensors": len(tm.fp8_weights),
        "fp8_expert_parameters": len(tm.fp8_experts),
        "fp8_tensors_not_exported": tm.unused,
        "encoded_tensors": dict(sorted(weights.items())),
        "fp8_safetensors_bytes": fp8_safetensors_bytes(artifact),
    }

    save(artifact / PACKAGE_NAME)
    record["package_weight_bytes"] = weight_bytes_of_package(artifact / PACKAGE_NAME)
    manifest.versions["coremltools"] = ct.__version__
    return record
