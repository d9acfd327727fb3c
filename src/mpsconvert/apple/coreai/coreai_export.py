"""FP8 artifact -> Core AI asset (`model.aimodel`) inside the artifact, FP8 weights kept native.

The model converted is the source architecture carrying the artifact's weights
(`torch_model.build_torch_model`), with every FP8 Linear replaced by `weights.Fp8Linear`: the
asset stores the artifact's e4m3 bytes as `f8E4M3FN` constants and their scales, and Core AI
dequantizes them (`blockwise_shift_scale`), so the asset is about the size of the FP8
safetensors. Causal LMs are exported as the stateful decoder of `apple/stateful.py` (the
interface Core ML packages have too); encoders keep the embeddings interface of the Core ML
export. The path is coreai-torch's: `torch.export` -> `run_decompositions(get_decomp_table())`
-> `TorchConverter().add_exported_program(...).to_coreai()` -> `save_asset`.

Everything that is not an FP8 weight (embeddings, norms, biases, an unquantized lm_head) keeps
the dtype the artifact stores it in (BF16 for most models) and is cast to the compute dtype
where the program reads it, so nothing is rounded and the asset stays the artifact's size. The
compute dtype is fp32 by default, fp16 on request (see CoreAIOptions for why). Rotary frequency
tables stay fp32 (fp16 would move the positions of long contexts).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ...errors import ExportError, MpsconvertError
from ...infra.progress import Progress, or_silent
from ...manifests.manifest import Manifest, dist_versions
from .. import stateful
from ..torch_model import TorchModel, build_torch_model, fp8_safetensors_bytes
from . import ASSET_NAME, MINIMUM_OS, CoreAIOptions
from .session import coreai_torch, quiet, signature
from .weights import swap_fp8_experts, swap_fp8_linears

TORCH_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}


class _Stored(torch.nn.Module):
    """A parametrization: the tensor is stored in its own dtype and cast to the compute dtype
    where the model reads it (the program holds one constant and a cast)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def keep_stored_dtypes(
    model: torch.nn.Module, stored: dict[str, torch.dtype], dtype: torch.dtype, skip: set[str]
) -> dict:
    """Compute in `dtype` while every dense float parameter (not the FP8 weights in `skip`) stays
    in the dtype the artifact stores it in (`stored`: parameter name -> dtype): the model is cast
    to `dtype`, then each such parameter is put back in its stored dtype behind a cast. Tied
    parameters stay one tensor. Rotary tables (buffers made at init) stay fp32."""
    from torch.nn.utils import parametrize

    keep = {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("inv_freq")}
    originals = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    model.to(dtype)
    for name, b in keep.items():
        mod, _, leaf = name.rpartition(".")
        model.get_submodule(mod)._buffers[leaf] = b
    kept: dict[str, str] = {}
    shared: dict[int, torch.nn.Parameter] = {}
    by_ptr = {originals[n].data_ptr(): d for n, d in stored.items() if n in originals and n not in skip}
    for name, value in originals.items():  # every alias of a tied tensor too (lm_head.weight)
        want = by_ptr.get(value.data_ptr())
        if name in skip or want is None or want == dtype or not value.is_floating_point():
            continue
        mod_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        param = shared.get(value.data_ptr())
        if param is None:
            param = shared[value.data_ptr()] = torch.nn.Parameter(value.to(want), requires_grad=False)
        mod._parameters[leaf] = param
        parametrize.register_parametrization(mod, leaf, _Stored(dtype), unsafe=True)
        kept[name] = str(want).replace("torch.", "")
    return {"compute_dtype": str(dtype).replace("torch.", ""), "stored_as_in_artifact": kept, "rotary_tables": "fp32"}


def _fp8_param_names(model, fp8_weights: dict) -> set[str]:
    own = dict(model.named_parameters())
    prefix = getattr(model, "base_model_prefix", "") or ""
    out = set()
    for k in fp8_weights:
        for cand in (k, f"{prefix}.{k}", k[len(prefix) + 1 :] if prefix and k.startswith(prefix + ".") else None):
            if cand in own:
                out.add(cand)
    return out


def prepare(tm: TorchModel, opts: CoreAIOptions) -> tuple[torch.nn.Module, dict]:
    """The module to convert: the model in the compute dtype with its FP8 Linears native, in the
    stateful decoder (causal LMs) or the embeddings wrapper (encoders). Returns (module, record)."""
    dtype = TORCH_DTYPES[opts.compute]
    model = tm.model
    dense = keep_stored_dtypes(
        model, tm.stored_dtypes, dtype, _fp8_param_names(model, tm.fp8_weights) | set(tm.fp8_experts)
    )
    encoded = swap_fp8_linears(model, tm.fp8_weights, dtype) | swap_fp8_experts(model, tm.fp8_experts, dtype)
    if tm.task == "causal-lm":
        module = stateful.StatefulCausalLM(model, opts.max_len, cache_dtype=dtype).eval()
    else:
        module = tm.module  # EncoderEmbeddings around the same (now converted) model
    return module, {"encoded_tensors": dict(sorted(encoded.items())), "dense_tensors": dense}


def _export(module, tm: TorchModel, opts: CoreAIOptions):
    """torch.export + coreai-torch's decompositions; returns (program, input, output, state names)."""
    table = coreai_torch().get_decomp_table()
    if tm.task == "causal-lm":
        ep = stateful.export_program(module, decompositions=table)
        mutated = set(ep.graph_signature.buffers_to_mutate.values())
        states = [s.target for s in ep.graph_signature.input_specs if s.target in mutated]
        want = stateful.state_names(module.num_layers)
        if sorted(states) != sorted(want):
            raise ExportError(
                f"the exported decoder mutates {sorted(mutated)}, not exactly its KV caches",
                "this architecture writes other state during a forward pass; report the model",
            )
        return ep, list(stateful.INPUT_NAMES), [stateful.OUTPUT_NAME], states
    hi = opts.max_len
    example = max(2, min(hi, 16))
    seq = torch.export.Dim("seq_len", min=1, max=hi)
    ids = torch.zeros(1, example, dtype=torch.int32)
    mask = torch.ones(1, example, dtype=torch.int32)
    with torch.no_grad():
        ep = torch.export.export(
            module, (ids, mask), dynamic_shapes={"input_ids": {1: seq}, "attention_mask": {1: seq}}, strict=False
        )
    return ep.run_decompositions(table), tm.input_names, [tm.output_name], []


def convert(module, tm: TorchModel, opts: CoreAIOptions):
    """The Core AI program of `module` (an AIProgram, not yet saved), and its interface names."""
    ct = coreai_torch()
    try:
        with quiet() as log:
            ep, inputs, outputs, states = _export(module, tm, opts)
            prog = (
                ct.TorchConverter(mode=ct.TorchConverter.Mode.RELEASE)
                .add_exported_program(ep, input_names=inputs, output_names=outputs, state_names=states or None)
                .to_coreai()
            )
    except MpsconvertError:
        raise
    except Exception as e:  # a torch op with no Core AI lowering, an export failure: name it, one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ExportError(
            f"Core AI export of {type(tm.model).__name__} failed: {type(e).__name__}: {first}",
            "this architecture does not convert with coreai-torch yet; report the model",
        ) from e
    return prog, {
        "inputs": inputs,
        "outputs": outputs,
        "states": states,
        "converter_log_lines": len("".join(log).splitlines()),
    }


def asset_bytes(asset_dir: Path) -> int:
    return sum(p.stat().st_size for p in Path(asset_dir).rglob("*") if p.is_file())


def storage_summary(asset_dir: Path) -> dict:
    """What the saved asset says it stores and computes: `AIModelAsset.summary()`."""
    from .session import coreai

    coreai()
    from coreai.authoring import AIModelAsset

    s = AIModelAsset.load(Path(asset_dir)).summary(include_statistics=True)
    return {
        "storage_types": {str(t): int(n) for t, n in s.storage_types},
        "compute_types": sorted(str(t) for t in s.compute_types),
        "operations": {str(t): int(n) for t, n in s.operation_distribution},
    }


def build(folder: Path, manifest: Manifest, opts: CoreAIOptions, progress: Progress | None = None) -> dict:
    """Write `<folder>/model.aimodel` from the (verified) artifact in `folder`; returns its
    manifest record and records coreai-core's and coreai-torch's versions in the manifest
    (apple/flow.py publishes both with the asset, in one swap).

    Raises:
        MissingExtraError: coreai-core / coreai-torch are not installed.
        ExportError: the architecture, an op or a weight cannot be converted.
        MpsconvertError: the settings do not fit the model.
    """
    coreai_torch()
    progress = or_silent(progress)
    artifact = Path(folder)
    progress("coreai export", 0, 4, "building the PyTorch model from the artifact's weights")
    tm = build_torch_model(artifact)
    opts = replace(opts, max_len=stateful.resolve_max_len(opts.max_len, tm.config))
    module, weights = prepare(tm, opts)
    progress("coreai export", 1, 4, "torch.export and coreai-torch conversion")
    prog, names = convert(module, tm, opts)
    progress("coreai export", 2, 4, f"writing {ASSET_NAME}")
    from .session import coreai

    coreai()
    from coreai.authoring import AIModelAsset

    asset = artifact / ASSET_NAME
    prog.save_asset(asset)
    if not asset.is_dir():
        raise ExportError(
            f"writing {ASSET_NAME} produced no folder", "report this: coreai-torch's save_asset wrote nothing"
        )
    progress("coreai export", 3, 4, "reading the asset back")
    record = _record(tm, opts, weights, signature(AIModelAsset.load(asset)), asset, artifact)
    manifest.versions.update(record["versions"])
    progress("coreai export", 4, 4, "done")
    return record


def _record(tm: TorchModel, opts: CoreAIOptions, weights: dict, sig: dict, asset: Path, artifact: Path) -> dict:
    record = {
        "asset": ASSET_NAME,
        "task": tm.task,
        "interface": {
            "function": "main",
            **{
                kind: [{"name": n, "dtype": dt, "shape": shape} for n, (dt, shape) in sig[kind].items()]
                for kind in ("inputs", "outputs", "states")
            },
        },
        "pooling": ("mean" + (" + l2 normalize" if tm.normalize else "")) if tm.task == "encoder" else None,
        "max_len": opts.max_len,
        "compute": opts.compute,
        "weights": "f8E4M3FN (the artifact's e4m3 bytes) x scale, dequantized by Core AI (blockwise_shift_scale)",
        "activations": f"{opts.compute} (the artifact's FP8 activation quantization is not applied)",
        "minimum_os": MINIMUM_OS,
        "converter": "torch.export -> coreai_torch.get_decomp_table() -> TorchConverter (release mode)",
        "versions": dist_versions("coreai-core", "coreai-torch"),
        "fp8_tensors": len(tm.fp8_weights),
        "fp8_expert_parameters": len(tm.fp8_experts),
        "fp8_tensors_not_exported": tm.unused,
        **weights,
        "storage": storage_summary(asset),
        "asset_bytes": asset_bytes(asset),
        "fp8_safetensors_bytes": fp8_safetensors_bytes(artifact),
    }
    record["size_ratio"] = round(record["asset_bytes"] / record["fp8_safetensors_bytes"], 4)
    return record
