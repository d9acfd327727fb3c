"""Which checkpoint tensors a conversion quantizes, and how: the plan checked against the shard
headers (`prepare`), the quantized Linears actually stored, the MoE expert tensors, an FP8
source's scales read and checked; and the checks and estimates made before any byte is written.

Of an FP8 source (`Snapshot.fp8`), only the modules it stores in FP8 are quantized; what it kept
in full precision stays so.
"""

from __future__ import annotations

import math

import torch
from safetensors import safe_open

from ..errors import QuantizationError, SourceError
from ..format.scales import E4M3_MAX, scale_problem, scale_shape
from ..format.schemes import Scheme
from ..infra.safetensors_io import read_header
from ..manifests.layout import INDEX_NAME
from ..model.moe_layout import find_layout
from ..model.plan import Plan, check_against_model, matches, plan_for
from ..source.snapshot import Snapshot
from . import FLOAT_CODES
from .quantize_options import ExpertTensor, Options, SourceTensor


def _expert_tensors(plan: Plan, headers: dict, experts_layout: str) -> dict[str, ExpertTensor]:
    """checkpoint key -> the expert weight it holds, for every experts module we can quantize;
    the others go to `plan.skipped` with the reason."""
    if not plan.experts:
        return {}
    kinds = FLOAT_CODES + ("F8_E4M3",)
    stored = {
        name: tuple(info.shape) for h in headers.values() for name, info in h.tensors.items() if info.dtype in kinds
    }
    found: dict[str, ExpertTensor] = {}
    plan.expert_layout = find_layout(plan.meta_model, stored)
    for ep in plan.expert_layout.values():
        if ep.layout == "fused" and any(
            h.tensors[ep.key].dtype == "F8_E4M3" for h in headers.values() if ep.key in h.tensors
        ):
            raise SourceError(
                f"the FP8 source stores the experts {ep.key} fused in 3-D",
                "only per-expert FP8 expert weights (the hub's layout) can be kept",
            )
        if ep.layout == "fused":
            found[ep.key] = ExpertTensor(ep, None, tuple(ep.split) if experts_layout == "per-expert" else ())
        elif ep.layout == "per-expert":
            for sl in ep.slices:
                found[sl.key] = ExpertTensor(ep, sl.expert)
        else:
            plan.skipped[ep.name] = f"MoE experts ({ep.layout}): {ep.why}"
    return found


def _finalize_plan(plan: Plan, headers: dict) -> dict[str, str]:
    """tensor name -> module, for the quantized Linears actually present in the checkpoint.

    A planned Linear whose weight is not stored (tied, or saved under another key) is moved to
    the ignore list, so loaders never expect scales that do not exist.
    """
    found: dict[str, str] = {}
    for h in headers.values():
        for name, info in h.tensors.items():
            mod = plan.module_for_tensor(name)
            if mod is not None and len(info.shape) == 2 and info.dtype in FLOAT_CODES:
                found[name] = mod
    present = set(found.values())
    for mod in list(plan.quantize):
        if mod not in present:
            del plan.quantize[mod]
            plan.ignored[mod] = "no float 2-D weight stored under this module's name in the checkpoint: kept as is"
    return found


def _finalize_fp8_plan(plan: Plan, headers: dict, snap: Snapshot, opts: Options) -> dict[str, str]:
    """_finalize_plan for an FP8 source: the modules it stores in FP8 are the quantized ones
    (their codes are the source's), the others stay as the source keeps them; and every FP8
    weight's scale is read (a few floats per 128x128 block) and checked."""
    src = snap.fp8
    found: dict[str, str] = {}
    fp8_keys = {
        name: (f, info) for f, h in headers.items() for name, info in h.tensors.items() if info.dtype == "F8_E4M3"
    }
    all_infos = {name: (f, info) for f, h in headers.items() for name, info in h.tensors.items()}
    for name, (f, info) in fp8_keys.items():
        if not name.endswith(".weight") or len(info.shape) != 2:
            if len(info.shape) == 3 and plan.experts:
                continue  # fused experts: _expert_tensors says why they cannot be kept
            raise SourceError(
                f"the FP8 source stores {name} as F8_E4M3 {list(info.shape)}",
                "only 2-D FP8 weights with a scale can be kept",
            )
        mod = plan.module_for_tensor(name)
        if mod is None:
            key = name[: -len(".weight")]
            mod = next(
                (m for m in plan.ignored if m == key or m == f"{plan.prefix}.{key}" or key == f"{plan.prefix}.{m}"),
                None,
            )
            if mod is not None:
                if matches(mod, opts.ignore):
                    raise SourceError(
                        f"--ignore {matches(mod, opts.ignore)!r} names {mod}, which the FP8 source stores in FP8",
                        "its codes can only be kept as they are: drop that --ignore pattern",
                    )
                plan.quantize[mod] = tuple(info.shape)
                del plan.ignored[mod]
        if mod is not None:
            found[name] = mod
        scale_key = src.scale_key(name)
        if scale_key not in all_infos:
            raise SourceError(
                f"the FP8 source has {name} but no {scale_key}", "the checkpoint is incomplete; re-download it"
            )
        sf, sinfo = all_infos[scale_key]
        want = scale_shape(src.scheme.weights, *info.shape, src.scheme.block_size)
        # the exact shape the format requires (one value per tensor may be stored as [] or [1]): a
        # transposed [2, 4] for [4, 2] blocks, or a flat [8], has the right count and the wrong meaning
        exact = tuple(sinfo.shape) == tuple(want) or (tuple(want) == (1,) and tuple(sinfo.shape) in ((), (1,), (1, 1)))
        if sinfo.dtype not in FLOAT_CODES or not exact:
            raise SourceError(
                f"{scale_key} is {sinfo.dtype}{list(sinfo.shape)}, but the source's {src.scheme.weights} scales of a "
                f"{list(info.shape)} weight are {list(want)} (float)",
                "the checkpoint is corrupt or not the layout its config says",
            )
        ins_key = src.input_scale_key(name)
        with safe_open(str(snap.path / sf), "pt") as fh:
            scale = fh.get_tensor(scale_key).float().reshape(want)
        ins = None
        if ins_key in all_infos:
            if math.prod(all_infos[ins_key][1].shape) != 1 or all_infos[ins_key][1].dtype not in FLOAT_CODES:
                raise SourceError(
                    f"{ins_key} is {all_infos[ins_key][1].dtype}{list(all_infos[ins_key][1].shape)}, not one float",
                    "the checkpoint is corrupt or not the layout its config says",
                )
            with safe_open(str(snap.path / all_infos[ins_key][0]), "pt") as fh:
                ins = fh.get_tensor(ins_key).float().reshape(-1)
            if (why := scale_problem(float(ins[0]))) is not None:
                raise SourceError(
                    f"the static input scale {ins_key} {why}", "the checkpoint is corrupt; re-download it"
                )
        # finite and > 0, and what the largest code dequantizes to (448 x scale) finite: a 3e38 scale passes the first
        bad = ~(torch.isfinite(scale) & (scale > 0) & torch.isfinite(scale * E4M3_MAX))
        if bool(bad.any()):
            raise SourceError(
                f"{scale_key} holds {int(bad.sum())} scale(s) that are not finite positive or dequantize past float32 "
                f"(e.g. {float(scale[bad][0])!r})",
                "the checkpoint is corrupt; re-download it",
            )
        opts.fp8_tensors[name] = SourceTensor(scale, ins, scale_key)
    for mod in list(plan.quantize):
        if mod not in set(found.values()):
            del plan.quantize[mod]
            plan.ignored[mod] = "kept in full precision, as the FP8 source stores it"
    return found


def source_keys(snap: Snapshot, opts: Options) -> set[str]:
    """Keys of an FP8 source that the writer consumes (scales, input scales), not copied."""
    src = snap.fp8
    return {k for name, t in opts.fp8_tensors.items() for k in (t.scale_key, src.input_scale_key(name))}


def check_fp8_source(snap: Snapshot, scheme: Scheme) -> None:
    """Refuse calibrating a re-quantized FP8 source: calibration would run on another model
    (the source's, not the one written); calibrating the re-packed artifact is the way."""
    if snap.fp8 is not None and scheme != snap.fp8.scheme and scheme.needs_calibration:
        raise QuantizationError(
            "--scheme fp8 from an FP8 source would calibrate a model that is not the one written",
            "quantize it with the defaults (its codes kept), then `mpsconvert calibrate` the artifact",
        )


def repacks(snap: Snapshot, opts: Options) -> bool:
    """Whether an FP8 source is re-packed (codes kept): the scheme asked for is its own."""
    return snap.fp8 is not None and opts.scheme == snap.fp8.scheme


def check_tensor_layout(snap: Snapshot, headers: dict) -> None:
    """No tensor stored twice, and the index (if any) agrees with what the shards hold."""
    seen: dict[str, str] = {}
    for f, h in headers.items():
        for name in h.tensors:
            if name in seen:
                raise SourceError(
                    f"tensor {name!r} is stored in both {seen[name]} and {f}",
                    "the checkpoint is corrupt; re-download it",
                )
            seen[name] = f
    if snap.weight_map:
        for name, f in snap.weight_map.items():
            if seen.get(name) != f:
                where = f"in {seen[name]}" if name in seen else "in no shard"
                raise SourceError(
                    f"{INDEX_NAME} puts {name!r} in {f}, but it is {where}", "the checkpoint is corrupt; re-download it"
                )
        extra = sorted(set(seen) - set(snap.weight_map))
        if extra:
            raise SourceError(
                f"{len(extra)} stored tensors are missing from {INDEX_NAME} (e.g. {extra[0]!r})",
                "the checkpoint is corrupt; re-download it",
            )


def estimate_output_bytes(headers: dict, tensor_module: dict, scheme: Scheme) -> int:
    """Bytes the artifact will take: FP8 weights, their scales, copied tensors, plus slack."""
    total = 1 << 20
    for h in headers.values():
        for name, info in h.tensors.items():
            if name in tensor_module:
                total += (
                    math.prod(info.shape) + 4 * math.prod(scheme.scale_shape(*info.shape[-2:])) + 8
                )  # 1-byte codes + F32 scales
            else:
                total += info.nbytes
        total += h.data_start
    return total


def prepare(snap: Snapshot, opts: Options, headers: dict | None = None, plan: Plan | None = None):
    """The plan (`plan` where a child process built it and checked the shapes against its model:
    plan_child.py; built here where None), the checked shard headers, and which checkpoint
    tensors get quantized how."""
    plan = plan if plan is not None else plan_for(snap.path, opts.ignore, opts.trust_remote_code)
    headers = headers or {f: read_header(snap.path / f) for f in snap.weight_files}
    check_tensor_layout(snap, headers)
    check_against_model(plan, headers, fp8_source=snap.fp8 is not None)
    if plan.unknown:
        shown = ", ".join(repr(n[:80]) for n in plan.unknown[:3]) + (
            f" and {len(plan.unknown) - 3} more" if len(plan.unknown) > 3 else ""
        )
        opts.notes.append(
            f"the source stores {len(plan.unknown)} tensor{'s' if len(plan.unknown) > 1 else ''} that the model "
            f"({plan.architecture}) does not define ({shown}): copied into the artifact as "
            f"{'they are' if len(plan.unknown) > 1 else 'it is'}; transformers ignores them when it loads it"
        )
    tensor_module = _finalize_fp8_plan(plan, headers, snap, opts) if snap.fp8 else _finalize_plan(plan, headers)
    expert_tensors = _expert_tensors(plan, headers, opts.experts_layout)
    # an error unless the plan names layers it keeps on purpose (GPT-2's Conv1D, MoE experts it cannot read)
    if (
        not tensor_module
        and not expert_tensors
        and not any(not r.startswith("embedding") for r in plan.skipped.values())
    ):
        raise QuantizationError(
            f"nothing to quantize in {snap.path}: no float 2-D Linear weight stored that the plan would quantize "
            f"({len(plan.ignored)} Linear(s) ignored, architecture {plan.architecture})",
            "check config.json (0 layers?) and the --ignore patterns",
        )
    if snap.fp8:
        opts.source_scheme, opts.repack = snap.fp8.scheme, repacks(snap, opts)
        for name in [n for n in opts.fp8_tensors if n not in tensor_module and n not in expert_tensors]:
            # an FP8 weight of no Linear or expert (llm-compressor's model-free path quantizes embed_tokens)
            if snap.fp8.layout != "compressed-tensors":
                raise SourceError(
                    f"the FP8 source stores {name}, which is no Linear or expert weight, in FP8",
                    "only FP8 Linear and expert weights can be kept",
                )
            del opts.fp8_tensors[
                name
            ]  # codes and scale copied as they are (compressed-tensors' names); loaders dequantize it
    check_fp8_source(snap, opts.scheme)
    if snap.fp8 and repacks(snap, opts) and opts.scheme.needs_calibration:
        missing = sorted(n for n, t in opts.fp8_tensors.items() if t.input_scale is None)
        if missing:
            raise SourceError(
                f"the static FP8 source has no input_scale for {len(missing)} weights (e.g. {missing[0]})",
                "the checkpoint is incomplete; re-download it",
            )
    elif opts.scheme.needs_calibration:
        missing = sorted(set(tensor_module.values()) - set(opts.input_scales or {}))
        missing += sorted({et.module for key, et in expert_tensors.items() if not _has_input_scales(opts, key, et)})
        if missing:
            raise QuantizationError(
                f"scheme fp8 needs a calibrated input scale for every quantized Linear and expert; {len(missing)} "
                f"have none (e.g. {missing[0]})",
                "run calibration (`mpsconvert quantize --scheme fp8 --calib-data ...` or `mpsconvert calibrate`)",
            )
    return plan, headers, tensor_module, expert_tensors


def _has_input_scales(opts: Options, key: str, et: ExpertTensor) -> bool:
    if et.expert is not None:
        return opts.expert_input_scale(et.param, et.expert, key[: -len(".weight")]) is not None
    if et.split:
        return all(
            opts.expert_input_scale(et.param, sl.expert, sl.key[: -len(".weight")]) is not None for sl in et.split
        )
    return all(opts.expert_input_scale(et.param, e) is not None for e in range(et.param.num_experts))
