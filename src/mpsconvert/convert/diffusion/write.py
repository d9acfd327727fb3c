"""The diffusion conversion: source -> plan (which tensors become FP8) -> streamed writes -> artifact.

Both formats stream through the LLM pipeline's parts (convert/quantize*.py): the pooled block
reader, `fp8.StreamQuantizer` on the worker threads, the ordered `Shard` queue and the
`ShardWriter` that hashes as it writes, so peak memory stays a few 16 MiB blocks whatever the
model (Flux.1-dev's transformer is 23.8 GB in BF16; benchmarks/convert.py --flux measures it).

- `diffusers`: the LLM shard writer itself (`_write_shards`), with the scale stored where
  diffusers' SDNQ backend reads it (`<m>.scale` [N, 1], per row) and diffusers' file names.
  Why SDNQ: of the backends diffusers 0.42 loads pre-quantized FP8 through, it is the one that
  runs without CUDA on every PyTorch device (its dequantize-then-matmul path is plain PyTorch:
  CPU, MPS), reads safetensors (torchao's safetensors support is a prototype module, and its
  float8 kernels target CUDA), and is maintained (quanto is deprecated in diffusers 0.42).
- `comfyui`: one file in the original repo's names. A fused original tensor (Flux `qkv`) is
  quantized from the row ranges of its diffusers parts read one after the other, with one scale
  for the whole tensor: ComfyUI's FP8 layout is per tensor only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...errors import QuantizationError, SourceError
from ...format import fp8
from ...format.schemes import Scheme
from ...infra.safetensors_io import DTYPES, ShardReader, read_header, torch_dtype
from ...infra.safetensors_writer import FiniteCheck, ShardWriter
from ...model.plan import Plan, check_against_model
from ...source.snapshot import DIFFUSERS_WEIGHTS, Snapshot
from .. import FLOAT_CODES
from ..quantize import QUANT_THREADS, Writing
from ..quantize_plan import check_tensor_layout
from ..quantize_tensors import Rows, Shard, quantize_matrix
from . import COMFYUI_FORMATS
from .families import Family, KeepRule, detect_family, family_of_class, strip_prefix
from .keymap import Original, identity, to_original

# ComfyUI's per-layer config (comfy/ops.py `_load_quantized_module`): e4m3 weights with a 0-d
# scale, and full_precision_matrix_mult so that ComfyUI dequantizes the weight and multiplies in
# 16 bits. Without it ComfyUI quantizes each activation to e4m3 with scale 1.0 (its layout's
# default when no input_scale is stored): clamped at +-448 and with 3 mantissa bits, which is
# not the weight-only model measured here, and on MPS FP8 matmul is slower than BF16 anyway.
COMFY_LAYER = {"format": "float8_e4m3fn", "full_precision_matrix_mult": True}
# The legacy layout's marker: two elements mean full_precision_matrix_mult (comfy/utils.py convert_old_quants).
LEGACY_MARKER = "scaled_fp8"
WEIGHT_ONLY_ROW = Scheme("fp8-weight-only", "row")
WEIGHT_ONLY_TENSOR = Scheme("fp8-weight-only", "tensor")


@dataclass
class DiffusionOptions:
    """How a diffusion model is written; `format` is one of FORMATS (quantize_diffusion checks it)."""

    format: str = "diffusers"
    ignore: list[str] = field(default_factory=list)  # replaces the family's high-precision list
    force: bool = False
    delete_unlisted: bool = False  # with force: also delete files the old artifact's manifest does not list
    max_shard_size: int = 10**9  # diffusers format only; ComfyUI reads one file


@dataclass
class DiffusionPlan:
    """What the writer does with every source tensor, and why, for the manifest."""

    family: Family
    keep: KeepRule
    headers: dict  # source file -> Header
    quantize: dict = field(default_factory=dict)  # output weight key -> module (diffusers) / Original (comfyui)
    originals: list = field(default_factory=list)  # comfyui: the output tensors in order
    ignored: dict = field(default_factory=dict)  # Linear module kept in high precision -> why
    skipped: dict = field(default_factory=dict)  # other weight-bearing modules -> what they are
    linears: dict = field(default_factory=dict)  # module -> (out, in), the candidates

    def as_plan(self) -> Plan:
        return Plan(architecture=self.family.label, ignored=self.ignored, skipped=self.skipped)


def family_of(snap: Snapshot, headers: dict) -> Family:
    d = snap.diffusion
    if d.layout == "single-file":
        return detect_family([k for h in headers.values() for k in h.tensors], str(snap.path / snap.weight_files[0]))
    return family_of_class(d.class_name, f"the {d.component or 'component'} of {snap.repo_id or d.root}")


def meta_model(snap: Snapshot):
    """The diffusers transformer built from its config with weightless parameters (accelerate's
    init_empty_weights, as diffusers itself loads): its Linear modules are what may become FP8."""
    from ...infra.extras import require

    diffusers = require("diffusers", "diffusion", "converting a diffusers model")
    from accelerate import init_empty_weights

    cls = getattr(diffusers, snap.diffusion.class_name)
    config = {k: v for k, v in snap.config.items() if not k.startswith("_")}
    try:
        with init_empty_weights():
            return cls.from_config(config)
    except (TypeError, ValueError, KeyError) as e:
        raise SourceError(
            f"diffusers {diffusers.__version__} cannot build {cls.__name__} from {snap.path}/config.json: {e}",
            "upgrade diffusers, or re-download the model",
        ) from e


def plan(snap: Snapshot, opts: DiffusionOptions) -> DiffusionPlan:
    headers = {f: read_header(snap.path / f) for f in snap.weight_files}
    check_tensor_layout(snap, headers)
    family = family_of(snap, headers)
    p = DiffusionPlan(family=family, keep=KeepRule.of(family, opts.ignore), headers=headers)
    infos = {n: i for h in headers.values() for n, i in h.tensors.items()}
    single = snap.diffusion.layout == "single-file"
    if single:
        if opts.format == "diffusers":
            raise QuantizationError(
                f"{snap.weight_files[0]} is an original-repo single file; `format=diffusers` needs the diffusers model",
                "pass `format=comfyui` for this file, or the diffusers repo / folder for `format=diffusers`",
            )
        # no module types without the model: a 2-D float `.weight` is a Linear's (convolutions are 4-D / 5-D, norms 1-D)
        p.linears = {
            n[: -len(".weight")]: i.shape
            for n, i in infos.items()
            if n.endswith(".weight") and len(i.shape) == 2 and i.dtype in FLOAT_CODES
        }
    else:
        model = meta_model(snap)
        meta = Plan(architecture=snap.diffusion.class_name, meta_model=model)
        check_against_model(meta, headers)
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                p.linears[name] = (mod.out_features, mod.in_features)
            elif isinstance(mod, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)):
                p.skipped[name] = f"{type(mod).__name__}: only Linear weights are FP8 in ComfyUI and SDNQ, kept as is"
    shapes = {n: tuple(i.shape) for n, i in infos.items()}

    def decide(out_key: str, original: str, members: list[str]) -> bool:
        """Quantize `out_key` (a `.weight`) if every module it comes from is a float Linear not kept."""
        if not out_key.endswith(".weight") or not members or not all(m in p.linears for m in members):
            return False
        dtypes = {infos[m + ".weight"].dtype for m in members}
        if len(dtypes) != 1 or not dtypes <= set(FLOAT_CODES):
            return False  # a fused tensor's parts in one float dtype, as every release stores them
        pattern = p.keep.match(strip_prefix(original), *(strip_prefix(m) for m in members))
        if pattern is not None:
            for m in members:
                p.ignored[m] = f"{p.keep.source}: {pattern}"
            return False
        return True

    if opts.format in COMFYUI_FORMATS:
        p.originals = identity(shapes) if single else to_original(family, shapes)
        for o in p.originals:
            members = [k[: -len(".weight")] for k in o.sources if k.endswith(".weight")]
            if decide(o.name, o.name[: -len(".weight")], members):
                p.quantize[o.name] = o
    else:  # the original name too, so that --ignore and the family's list may name either
        original = {pc.key: o.name for o in to_original(family, shapes) for pc in o.pieces}
        for key in shapes:
            if decide(
                key, original[key][: -len(".weight")], [key[: -len(".weight")]] if key.endswith(".weight") else []
            ):
                p.quantize[key] = key[: -len(".weight")]
    if not p.quantize:
        raise QuantizationError(
            f"nothing to quantize in {snap.path}: no float Linear weight outside the high-precision list "
            f"({len(p.ignored)} kept: {p.keep.source})",
            "check the `ignore` patterns",
        )
    return p


def estimate_bytes(p: DiffusionPlan) -> int:
    total = 1 << 20
    for h in p.headers.values():
        total += h.file_size
    return total


def diffusers_shard_names(n: int) -> list[str]:
    """diffusers' own weight file names (`save_pretrained`)."""
    if n == 1:
        return [DIFFUSERS_WEIGHTS]
    stem = DIFFUSERS_WEIGHTS[: -len(".safetensors")]
    return [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def comfy_file_name(out: Path) -> str:
    """The file a ComfyUI user copies into models/diffusion_models/: named after the artifact."""
    return f"{Path(out).name}.safetensors"


def comfy_entries(p: DiffusionPlan, legacy: bool) -> tuple[list, dict]:
    """The ComfyUI file's header entries (codes, 0-d scale, marker per FP8 layer) and metadata."""
    infos = {n: i for h in p.headers.values() for n, i in h.tensors.items()}
    entries = [(LEGACY_MARKER, "F8_E4M3", (2,))] if legacy else []
    layers = {}
    for o in p.originals:
        if o.name in p.quantize:
            mod = o.name[: -len(".weight")]
            entries.append((o.name, "F8_E4M3", o.shape))
            if legacy:
                entries.append((mod + ".scale_weight", "F32", ()))
            else:
                entries += [
                    (mod + ".weight_scale", "F32", ()),
                    (mod + ".comfy_quant", "U8", (len(comfy_quant_bytes()),)),
                ]
            layers[mod] = dict(COMFY_LAYER)
        else:
            entries.append((o.name, infos[o.pieces[0].key].dtype, o.shape))
    meta = {"format": "pt"}
    if not legacy:
        meta["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers}, sort_keys=True)
    meta["mpsconvert"] = json.dumps(
        {
            "format": "comfyui-legacy" if legacy else "comfyui",
            "family": p.family.name,
            "loader": "ComfyUI Load Diffusion Model (models/diffusion_models/); diffusers' from_single_file "
            "would ignore the FP8 scales",
        },
        sort_keys=True,
    )
    return entries, meta


def comfy_quant_bytes() -> bytes:
    return json.dumps(COMFY_LAYER, sort_keys=True).encode()


def write_comfyui(
    snap: Snapshot,
    p: DiffusionPlan,
    opts: DiffusionOptions,
    path: Path,
    w: Writing,
    progress,
):
    """Stream every original-layout tensor into one ComfyUI file."""
    from ..assemble import Shards

    legacy = opts.format == "comfyui-legacy"
    entries, meta = comfy_entries(p, legacy)
    where = {n: (f, i) for f, h in p.headers.items() for n, i in h.tensors.items()}
    readers = {f: ShardReader(h, w.pool) for f, h in p.headers.items()}
    out = Shards()
    total = out.bytes_in = sum(h.file_size for h in p.headers.values())
    done = [0]
    try:
        with ShardWriter(path, entries, metadata=meta) as writer:
            with Shard(None, writer, w.workers, QUANT_THREADS + 1, out.tensors).running() as sh:
                if legacy:
                    sh.then(writer.write, LEGACY_MARKER, torch.zeros(2, dtype=fp8.FP8_DTYPE))
                for o in p.originals:
                    spans = []
                    for pc in o.pieces:
                        f, info = where[pc.key]
                        row = info.nbytes // max(1, info.shape[0]) if info.shape else info.nbytes
                        spans.append(
                            (
                                readers[f],
                                info.start + pc.row0 * row,
                                (pc.row1 - pc.row0) * row if info.shape else info.nbytes,
                            )
                        )
                    if o.name in p.quantize:
                        _quantize_original(sh, o, where[o.pieces[0].key][1], spans, legacy)
                    else:
                        for pc, (reader, start, nbytes) in zip(
                            o.pieces, spans
                        ):  # NaN/inf refused, counted as it is copied
                            check = FiniteCheck(where[pc.key][1].dtype, pc.key, where[pc.key][0])
                            sh.then(writer.copy, o.name, reader.header.path, start, nbytes, (check,))
                    nbytes = sum(s[2] for s in spans)

                    def advance(n=nbytes, name=o.name):
                        done[0] += n
                        progress("quantize", done[0], total, name)

                    sh.then(advance)
        w.syncs.add(writer.sync)
    finally:
        for r in readers.values():
            r.close()
    out.weight_map = {name: path.name for name, *_ in entries}
    out.files[path.name] = {"sha256": writer.digest, "size": writer.size}
    out.write_modes.add(writer.write_mode)
    out.bytes_out = writer.size
    return out


def _quantize_original(sh: Shard, o: Original, info, spans: list, legacy: bool) -> None:
    """One original weight (maybe fused from several) -> e4m3 codes + a 0-d scale + its marker."""
    n, k = o.shape
    mod = o.name[: -len(".weight")]

    def done(scale: torch.Tensor, stats: fp8.QuantStats) -> None:
        scale = scale.reshape(1).contiguous()  # the 4 bytes of the declared 0-d tensor (a 0-d tensor has no byte view)
        if legacy:
            sh.writer.write(mod + ".scale_weight", scale)
        else:
            sh.writer.write(mod + ".weight_scale", scale)
            sh.writer.write(mod + ".comfy_quant", torch.frombuffer(bytearray(comfy_quant_bytes()), dtype=torch.uint8))
        sh.records[o.name] = {
            "module": mod,
            "shape": [n, k],
            "source_dtype": info.dtype,
            "dtype": "F8_E4M3",
            "weight_scale_shape": [],
            **({"fused_from": list(o.sources)} if len(o.sources) > 1 else {"source": o.sources[0]}),
            **stats.as_dict(),
        }

    quantize_matrix(
        sh,
        Rows(o.name, _Stacked(info.dtype, (n, k), math.prod((n, k)) * DTYPES[info.dtype][0]), 0, n, k),
        WEIGHT_ONLY_TENSOR,
        o.name,
        done,
        spans=spans,
    )


@dataclass(frozen=True)
class _Stacked:
    """The TensorInfo a fused tensor would have (dtype, shape, bytes): what quantize_matrix reads."""

    dtype: str
    shape: tuple
    nbytes: int

    @property
    def torch_dtype(self):
        return torch_dtype(self.dtype)
