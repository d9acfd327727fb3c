"""Load an FP8 compressed-tensors checkpoint (ours or llm-compressor's) as a ready transformers model.

How, and why this way:
- The architecture is built from config.json with its parameters on the meta device (no memory,
  no random init) but its buffers real (rotary tables and position ids are computed in
  `__init__` and are not in checkpoints).
- The artifact's structure is checked first (manifests/verify.py: headers, scales and shapes
  against config.json) and, with `verify=True`, every file's size against the manifest. Then
  every destination tensor is allocated on the device and the shards are read once each, in
  parallel (runtime/load/stream.py): each block is hashed as it passes and its tensor bytes are
  copied straight to their place. Before the model is returned every file's sha256 is compared
  with the manifest; a tampered or truncated file is refused with an ArtifactError.
  `verify=False` skips the hashing (the structural checks still run).
- Every Linear whose weight is stored as F8_E4M3 becomes an FP8Linear holding the e4m3 codes and
  scales on the device (no BF16 copy): as float8_e4m3fn, or as their bytes on a device where this
  torch has no float8 (MPS before torch 2.15; devices.capabilities says, probed once). On CPU each
  is dequantized once to `dtype` instead, since FP8 matmul on CPU is orders of magnitude slower:
  no memory is saved there, and `model.mpsconvert.weights_held` says so. An FP8 tensor that
  belongs to a module we have no FP8 kernel for (llm-compressor's model-free path also quantizes
  `embed_tokens`) is dequantized once at load, and listed in `model.mpsconvert.dequantized`.
- MoE experts (transformers 5 fuses a layer's experts into one module of 3-D parameters) become
  `FP8Experts`, whichever way the artifact stores them: per-expert 2-D tensors (the default, the
  hub's layout; each streamed into its rows of the layer's [E, N, K] codes) or fused 3-D tensors
  (`--experts-layout checkpoint`). Which key holds which rows is transformers' own mapping
  (moe_layout.py); so are the other names it changes on save (Mixtral's router).
- On GPUs, sibling layers that read one input (q/k/v, gate/up) share one activation quantization
  and one GEMM (runtime/ops/fuse.py). Kernels are then chosen per layer shape by runtime/load/policy.py
  (measured once per machine, cached). On CUDA, RMSNorms and gated MLPs then run fused kernels
  in eager mode, fewer launches per layer and a prefill without the modules' Python between
  them (runtime/patches/eager_fusion.py, attention_prefill.py), MoE routers one kernel at
  decode (runtime/patches/routing.py), and a thread started before the shards are read pays the
  process's first-use costs of those kernels and libraries meanwhile (runtime/load/prewarm.py).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ...errors import ArtifactError, MpsconvertError
from ...format.ct_config import scheme_from_config
from ...format.fp8 import CODE_DTYPES, dequantize
from ...infra import atomic, devices
from ...infra.safetensors_io import torch_dtype
from ...infra.untrusted import read_json
from ...manifests import layout, loadable
from ...manifests.verify import check_artifact, check_digests, check_sizes, failed, raise_problems, verify_artifact
from ...model import definition
from .. import patches
from ..ops.fp8linear import FP8Linear
from ..ops.fuse import SharedInput
from . import prewarm, prewarm_child, stream
from .policy import KernelPolicy

_FP8_PARTS = ("weight", "weight_scale", "input_scale", "bias")


@dataclass
class LoadInfo:
    """What `load` did, attached to the model as `model.mpsconvert`."""

    path: str
    device: str
    dtype: str
    scheme: str
    weights: str
    verify: dict
    fp8_layers: int = 0
    dequantized: list = field(default_factory=list)  # FP8 tensors of non-Linear modules, made dense
    kernels: list = field(default_factory=list)  # policy decisions
    weight_bytes: int = 0
    experts: dict = field(default_factory=dict)  # experts module -> how it is stored and which paths it runs
    patches: dict = field(
        default_factory=dict
    )  # patch name -> its report (runtime/patches: what each changed, left, or skipped)
    prewarm: dict = field(default_factory=dict)  # first-use calls made while the shards were read (CUDA)
    weights_held: dict = field(
        default_factory=dict
    )  # how the FP8 weights are held once loaded: e4m3 codes, or dequantized, and why
    seconds: dict = field(default_factory=dict)  # where the load's time went

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _resolver(model: nn.Module, renamed: dict[str, str] | None = None):
    """checkpoint key -> model key, allowing for a saved-with/without base_model_prefix and for
    the names transformers changes on save (`renamed`: stored key -> model key; a renamed
    `<m>.weight` renames its module's FP8 parts too)."""
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    modules = {n for n, _ in model.named_modules()}
    prefix = getattr(model, "base_model_prefix", "") or ""
    renamed = renamed or {}
    mod_renames = {k.rpartition(".")[0]: v.rpartition(".")[0] for k, v in renamed.items() if k.endswith(".weight")}

    def resolve(key: str) -> str | None:
        mod, _, leaf = key.rpartition(".")
        if key in renamed:
            key = renamed[key]
        elif mod in mod_renames and leaf in _FP8_PARTS:
            key = f"{mod_renames[mod]}.{leaf}"
        mod = key.rpartition(".")[0]
        for cand in (key, f"{prefix}.{key}", key[len(prefix) + 1 :] if key.startswith(prefix + ".") else None):
            if cand and (cand in names or (leaf in _FP8_PARTS and cand.rpartition(".")[0] in modules)):
                return cand
        return None

    return resolve


def _set_tensor(model: nn.Module, key: str, value: torch.Tensor) -> None:
    mod_name, _, leaf = key.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if leaf in mod._parameters:
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    elif leaf in mod._buffers:
        mod._buffers[leaf] = value
    else:
        raise ArtifactError(
            f"checkpoint tensor {key} has no place in {type(model).__name__}",
            "is config.json the one this checkpoint was made with?",
        )


def _verify_before_use(path: Path, manifest_sha256: str | None, progress):
    """Before any of the artifact is used: the manifest (pinned hash if given), the files it
    lists present with their sizes, nothing unlisted that is code, the scales sound, and the
    files that are neither weight shards nor read by loaders hashed now. config.json, the
    tokenizer and any code are hashed as `load` copies them (loadable.verified) before the model
    is built from that copy, so nothing read before the model exists, code above all, is
    unverified. The shards are hashed as they stream in (stream.read_shards) and checked before
    the model is returned."""
    from ...manifests.hashing import sha256_file

    report = verify_artifact(path, check_hashes=False, manifest_sha256=manifest_sha256, check_codes=False)
    raise_problems(path, report)
    manifest = report.manifest  # parsed from the bytes the pin was checked on, never read again
    present = check_sizes(path, manifest, report)
    later = set(layout.weight_files(path)) | set(
        loadable.loader_files(path, manifest)
    )  # hashed as they are read, below
    check_digests(manifest, report, {n: sha256_file(path / n) for n in present if n not in later})
    report.hashes_checked = False  # the shards are still to come
    raise_problems(path, report)
    return manifest


def load(
    path,
    device: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
    verify: bool = True,
    *,
    kernel_cache=None,
    measure=None,
    trust_remote_code: bool = False,
    progress=None,
    share_inputs: bool = True,
    manifest_sha256: str | None = None,
    decode_attention: bool = True,
    eager_fusion: bool = True,
    compile: bool = True,
    prefill_graphs: bool = True,
):
    """Load an FP8 artifact as a transformers model in eval mode; `model.mpsconvert` says how.

    device: 'auto' | 'cuda' | 'cuda:N' | 'mps' | 'cpu' (devices.choose: an unavailable device is an
    error, never a fallback). verify: check every file's sha256 against the manifest (while the
    files are read, before the model is returned). kernel_cache / measure: passed to
    KernelPolicy (cache file or False; injected timer). share_inputs: fuse q/k/v and gate/up
    into one GEMM each (on CPU where the scheme rounds activations: one rounding; fuse.py).
    decode_attention: on CUDA, a model that uses SDPA runs decode steps through the split-KV kernel
    of runtime/patches/attention.py (prefill stays SDPA).
    eager_fusion: on CUDA, RMSNorms run as one kernel that also quantizes the input of the
    layers they feed, gated MLPs fuse SiLU * up with down_proj's quantization, attention
    modules rotate q and k in one kernel, and pre-norm decoder layers make each residual add in
    the kernel of the norm that reads it, in eager mode, and a prefill runs each such layer as
    direct calls of those kernels, SDPA and the GEMMs (runtime/patches/eager_fusion.py, rotary.py,
    attention_prefill.py; each checked against the module's own forward or function at load); a thread makes those
    kernels' and libraries' first calls while the shards are read (runtime/load/prewarm.py). On any
    device it also gives a call without positions (no cache, or a DynamicCache) the model's own
    as a view of a buffer made at load, so that the rotary tables are read, not recomputed, and
    transformers' packed-sequence check needs no synchronisation (runtime/patches/positions.py; checked
    bit for bit), and the output head runs the kept tokens as one matrix product, never a
    batched one over a copy of its weight (runtime/patches/lm_head.py).
    On CUDA an MoE model's softmax top-k routers run as one kernel at decode (runtime/patches/routing.py).
    compile: on CUDA, the model's transformers `generate()` at batch 1 runs mpsconvert's engine
    (the loop `mpsconvert generate` runs: a static KV cache, the decode step one CUDA graph), or,
    for settings the engine lacks, transformers' loop with a static cache, which transformers
    compiles (runtime/patches/generate.py; `model.mpsconvert_generate_path` says which ran);
    False keeps transformers' default. prefill_graphs: on CUDA, a batch-1 prefill of up to 1024
    tokens replays each decoder layer's direct calls as one CUDA graph per padded length, captured
    on that length's first prompt (runtime/patches/prefill_graphs.py; the 128-row ones at load);
    False launches the direct calls one by one (a 512-token prefill takes 2x as long on an H100:
    docs/benchmarks.md).
    Every change to the model is a patch of runtime/patches, reported in
    `model.mpsconvert.patches`; what a patch left is warned once.
    progress(phase, done, total, detail).
    manifest_sha256: the manifest file must have this sha256 (a pinned artifact). With
    `trust_remote_code`, the artifact's code is imported only after it matched its hash.
    """
    t0 = time.perf_counter()
    path = Path(path)
    dev = devices.choose(device)
    # first-use costs paid while the manifest is verified, the model built and the shards streamed
    # (a child process first, where one pays, from the artifact's own description)
    warm = prewarm.start(dev, lambda: prewarm_child.start(dev, path, dtype, kernel_cache)) if eager_fusion else None
    try:
        return _load(
            path,
            dev,
            dtype,
            verify,
            warm,
            t0,
            kernel_cache=kernel_cache,
            measure=measure,
            trust_remote_code=trust_remote_code,
            progress=progress,
            share_inputs=share_inputs,
            manifest_sha256=manifest_sha256,
            decode_attention=decode_attention,
            eager_fusion=eager_fusion,
            compile=compile,
            prefill_graphs=prefill_graphs,
        )
    finally:
        if warm is not None:
            warm.cancel()  # a load that failed before the model was known: the thread ends


def _load(
    path: Path,
    dev: torch.device,
    dtype: torch.dtype,
    verify: bool,
    warm,
    t0: float,
    *,
    kernel_cache,
    measure,
    trust_remote_code: bool,
    progress,
    share_inputs: bool,
    manifest_sha256: str | None,
    decode_attention: bool,
    eager_fusion: bool,
    compile: bool,
    prefill_graphs: bool,
):
    atomic.recover(path)
    config_path = path / layout.CONFIG_NAME
    if not config_path.is_file():
        raise ArtifactError(f"{path} has no config.json", "pass the folder that `mpsconvert quantize` wrote")
    manifest = None
    if verify and (path / layout.MANIFEST_NAME).is_file():
        manifest = _verify_before_use(path, manifest_sha256, progress)
    elif verify:
        if manifest_sha256 is not None:
            raise ArtifactError(
                f"{path} has no {layout.MANIFEST_NAME}, so the pinned manifest sha256 cannot be checked",
                "load the artifact that manifest belongs to",
            )
        import warnings

        warnings.warn(
            f"{path} has no {layout.MANIFEST_NAME}: its files cannot be verified (made by another tool?)", stacklevel=3
        )
    # config.json (and any code it names) read from a copy verified as it was made, not from the
    # folder, where it could change after it was checked
    with contextlib.ExitStack() as stack:
        try:
            defs = stack.enter_context(loadable.verified(path, manifest)) if manifest is not None else path
        except ArtifactError as e:
            raise failed(path, e.problem) from None
        try:
            config_body = read_json(defs / layout.CONFIG_NAME, what=str(config_path), fix="re-create the artifact")
        except ArtifactError:
            if verify:  # a damaged config.json: say what the manifest says about it
                check_artifact(path, check_hashes=True, progress=progress)
            raise
        qc = config_body.get("quantization_config")
        if not qc:
            raise ArtifactError(
                f"{path}/config.json has no quantization_config", "this is not an FP8 compressed-tensors checkpoint"
            )
        scheme = scheme_from_config(qc)
        config, model = definition.build_from(defs, buffers="real", trust_remote_code=trust_remote_code)
    linears, ignored = _linear_layout(model, qc)
    report = verify_artifact(
        path,
        check_hashes=False,
        shapes=linears,
        ignored=ignored,
        check_codes=False,
        manifest=manifest,
        config=config_body,
    )
    if manifest is None:  # a checkpoint of another tool, loaded unverified as asked (or warned above)
        report.problems = [p for p in report.problems if not p.startswith("cannot verify")]
    raise_problems(path, report)
    seconds = {"build_and_check": time.perf_counter() - t0}

    if warm is not None:  # the fusion's probe and the decode kernels, for this model's shapes
        rows, rowwise, decode = prewarm.job_of(scheme)
        warm.begin(config, {n: s for n, s in linears.items() if n not in ignored}, dtype, rows, rowwise, decode)
    t1 = time.perf_counter()
    with devices.oom_hint(dev, "loading the model"):
        plan = _Plan(model, report, dtype, dev)
        digests = stream.read_shards(
            list(report.headers.values()),
            plan.dests,
            dev,
            hash_files=manifest is not None,
            extra_files={},
            progress=progress,
        )
        if dev.type != "cpu":
            devices.synchronize(dev)
        seconds["read_hash_copy"] = time.perf_counter() - t1
        if manifest is not None:
            check_digests(manifest, report, {n: d for n, d in digests.items() if n in manifest.files})
            raise_problems(path, report)
        for key in plan.codes:  # on the device, where the codes now are: one compare each
            t = plan.dests[key]
            if t.numel() and bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):
                raise ArtifactError(
                    f"{key} holds NaN codes (0x7F/0xFF), which no quantizer writes", "re-create the artifact"
                )
        info = LoadInfo(
            path=str(path),
            device=str(dev),
            dtype=str(dtype).replace("torch.", ""),
            scheme=scheme.name,
            weights=scheme.weights,
            verify=report.as_dict(),
        )
        t2 = time.perf_counter()
        plan.install(model, scheme.activations, info, scheme.block)
        del plan
    model.tie_weights()
    for mod in model.modules():  # buffers made at __init__ on CPU (rotary tables, position ids)
        for name, buf in mod._buffers.items():
            if buf is not None and buf.device != dev and buf.device.type != "meta":
                mod._buffers[name] = buf.to(dev)
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if missing:
        raise ArtifactError(
            f"{len(missing)} tensors of {type(model).__name__} are not in the checkpoint (e.g. {missing[0]})",
            "the checkpoint is incomplete; re-create it",
        )
    model.eval().requires_grad_(False)
    ctx = patches.Context(
        dev,
        dtype,
        {
            "share_inputs": share_inputs,
            "decode_attention": decode_attention,
            "eager_fusion": eager_fusion,
            "compile": compile,
            "prefill_graphs": prefill_graphs,
        },
    )
    reports = patches.apply(model, ctx, "modules")
    seconds["install"] = time.perf_counter() - t2
    if warm is not None:
        info.prewarm = warm.join()
        seconds["prewarm_wait"] = info.prewarm["waited_s"]
    t3 = time.perf_counter()
    policy = KernelPolicy(dev, measure=measure, cache=kernel_cache)
    info.kernels = [d.as_dict() for d in policy.apply(model, progress)]
    seconds["kernels"] = time.perf_counter() - t3
    t4 = time.perf_counter()
    reports |= patches.apply(model, ctx, "forwards")
    patches.check(model, ctx, reports)
    info.patches = {name: r.as_dict() for name, r in reports.items()}
    seconds["patches"] = time.perf_counter() - t4
    info.fp8_layers = sum(
        isinstance(m, FP8Linear) and not isinstance(p, SharedInput) for p in model.modules() for m in p.children()
    )
    info.weights_held = weights_held(model, dev, dtype)
    info.weight_bytes = model_bytes(model)
    seconds["total"] = time.perf_counter() - t0
    info.seconds = {k: round(v, 3) for k, v in seconds.items()}
    model.mpsconvert = info
    return model


class _Plan:
    """Where every checkpoint tensor goes: a destination on the device for its bytes, and what
    becomes of it once filled (a parameter, an FP8Linear part, rows of an FP8Experts)."""

    def __init__(self, model: nn.Module, report, dtype: torch.dtype, dev: torch.device):
        from ...model.moe_layout import experts_modules, find_layout, saved_names
        from ..ops.fp8_experts import scale_keys

        self.dtype, self.dev = dtype, dev
        self.code_dtype = devices.capabilities(dev).code_dtype  # float8_e4m3fn, or uint8 where the device has no float8
        stored = {k: info for h in report.headers.values() for k, info in h.tensors.items()}
        self.codes = [
            k for k, info in stored.items() if info.dtype == "F8_E4M3"
        ]  # e4m3 codes: checked for NaN codes once read
        self.dests: dict[str, torch.Tensor] = {}
        self.params: dict[str, str] = {}  # model key -> checkpoint key
        self.fp8: dict[str, dict[str, str]] = {}  # Linear module -> {part: checkpoint key}
        self.experts: dict[str, dict] = {}  # experts module -> {param: (ExpertParam, codes)}
        self.dense_experts: list = []  # (ExpertParam, 3-D parameter, pieces) of experts stored unquantized
        claimed: set[str] = set()
        expert_params = set()
        if experts_modules(model):
            for ep in find_layout(model, {k: i.shape for k, i in stored.items()}).values():
                expert_params.add(ep.name)
                if ep.layout not in ("fused", "per-expert"):
                    raise ArtifactError(
                        f"the experts {ep.name} cannot be loaded: {ep.why or ep.layout}",
                        "re-create the artifact with mpsconvert quantize",
                    )
                pieces = [(ep.key, None)] if ep.layout == "fused" else [(sl.key, sl) for sl in ep.slices]
                if all(stored[k].dtype == "F8_E4M3" for k, _ in pieces):
                    codes = torch.empty(ep.shape, dtype=self.code_dtype, device=dev)
                    for k, sl in pieces:
                        self.dests[k] = codes if sl is None else codes[sl.expert, sl.start : sl.stop]
                    for k in scale_keys(ep):
                        if k in stored:
                            self.dests[k] = self._alloc(stored[k])
                            claimed.add(k)
                    self.experts.setdefault(ep.module, {})[ep.param] = (ep, codes)
                else:  # experts kept in full precision: assembled into the model's own 3-D parameter
                    param = torch.empty(ep.shape, dtype=dtype, device=dev)
                    for k, sl in pieces:
                        dst = param if sl is None else param[sl.expert, sl.start : sl.stop]
                        self.dests[k] = dst if stored[k].torch_dtype == dtype else self._alloc(stored[k])
                    self.dense_experts.append((ep, param, pieces))
                claimed.update(k for k, _ in pieces)
        names = [n for n, _ in model.named_parameters() if n not in expert_params]
        resolve = _resolver(model, saved_names(model, names))
        fp8_modules = {t.rpartition(".")[0] for m in report.quantized if (t := resolve(m + ".weight"))}
        unexpected = []
        for key, info in stored.items():
            if key in claimed:
                continue
            target = resolve(key)
            if target is None:
                unexpected.append(key)
                continue
            mod, _, leaf = target.rpartition(".")
            self.dests[key] = self._alloc(info)
            if mod in fp8_modules and leaf in _FP8_PARTS:
                self.fp8.setdefault(mod, {})[leaf] = key
            else:
                self.params[target] = key
        self.codes = [k for k in self.codes if k in self.dests]
        if unexpected:
            raise ArtifactError(
                f"{len(unexpected)} checkpoint tensors have no place in {type(model).__name__} (e.g. {unexpected[0]})",
                "is config.json the one this checkpoint was made with?",
            )

    def _alloc(self, info) -> torch.Tensor:
        dtype = self.code_dtype if info.dtype == "F8_E4M3" else torch_dtype(info.dtype)
        return torch.empty(info.shape, dtype=dtype, device=self.dev)

    def install(self, model: nn.Module, activations, info: LoadInfo, block: int | None = None) -> None:
        from ..ops.fp8_experts import FP8Experts, _fp8_param

        for target, key in self.params.items():
            t = self.dests[key]
            _set_tensor(model, target, t.to(self.dtype) if t.is_floating_point() and t.dtype != self.dtype else t)
        for mod_name, parts in self.fp8.items():
            _install(
                model,
                mod_name,
                {leaf: self.dests[k] for leaf, k in parts.items()},
                activations,
                self.dev,
                self.dtype,
                info,
                block,
            )
        for ep, param, pieces in self.dense_experts:
            for k, sl in pieces:
                dst = param if sl is None else param[sl.expert, sl.start : sl.stop]
                if self.dests[k].data_ptr() != dst.data_ptr():  # stored in another dtype: converted here
                    dst.copy_(self.dests[k])
            _set_tensor(model, ep.name, param)
        for mod_name, params in self.experts.items():
            if set(params) != {"gate_up_proj", "down_proj"}:
                raise ArtifactError(
                    f"{mod_name} has FP8 {sorted(params)} only", "re-create the artifact with mpsconvert quantize"
                )
            (ep13, c13), (ep2, c2) = params["gate_up_proj"], params["down_proj"]
            w13, s13, i13 = _fp8_param(ep13, self.dests, self.dev, codes=c13, block=block)
            w2, s2, i2 = _fp8_param(ep2, self.dests, self.dev, codes=c2, block=block)
            old = model.get_submodule(mod_name)
            new = FP8Experts(w13, s13, w2, s2, old.act_fn, activations, i13, i2, dtype=self.dtype, block=block)
            parent, _, leaf = mod_name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, new)
            info.experts[mod_name] = {"layout": ep13.layout, **new.paths, "experts": new.num_experts}
        self.dests.clear()


def _install(model, mod_name: str, p: dict, activations, dev, dtype, info: LoadInfo, block: int | None = None) -> None:
    mod = model.get_submodule(mod_name)
    w, scale = p.get("weight"), p.get("weight_scale")
    if w is None or scale is None or w.dtype not in CODE_DTYPES:
        raise ArtifactError(
            f"{mod_name} has an incomplete FP8 weight (weight and weight_scale needed)", "re-create the checkpoint"
        )
    if not isinstance(mod, nn.Linear):  # no FP8 kernel for this module type: dense once, and say so
        _set_tensor(model, mod_name + ".weight", dequantize(w, scale.float(), dtype, block).to(dev))
        if "bias" in p:
            _set_tensor(model, mod_name + ".bias", p["bias"].to(dev, dtype))
        info.dequantized.append(
            f"{mod_name} ({type(mod).__name__}: no FP8 kernel, dequantized to {info.dtype} at load)"
        )
        return
    layer = FP8Linear.from_tensors(
        w.to(dev),
        scale.float().to(dev),
        activations=activations,
        input_scale=p["input_scale"].float() if "input_scale" in p else None,
        bias=p["bias"] if "bias" in p else None,
        dtype=dtype,
        block=block,
    )
    parent_name, _, leaf = mod_name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, layer)


def weights_held(model: nn.Module, dev: torch.device, dtype: torch.dtype) -> dict:
    """How the loaded FP8 weights are held: as e4m3 codes (1 byte per weight) or dequantized
    (2 bytes, as BF16), counted over Linears and MoE experts, and in words where the device
    saves no memory over BF16 (the user must not think otherwise)."""
    from ..ops.fp8_experts import FP8Experts

    linears = [
        m for m in model.modules() if isinstance(m, FP8Linear) and m.group is None
    ]  # a fused group's members are views of its layer
    experts = [m for m in model.modules() if isinstance(m, FP8Experts)]
    out = {
        "e4m3": sum(m.weight is not None for m in linears) + sum(m.gate_up_codes is not None for m in experts),
        "dequantized": sum(m.dense_weight is not None for m in linears)
        + sum(m.gate_up_dense is not None for m in experts),
        "code_dtype": str(devices.capabilities(dev).code_dtype).replace("torch.", ""),
    }
    name = str(dtype).replace("torch.", "")
    if out["dequantized"] and not out["e4m3"] and dev.type == "cpu":
        out["note"] = (
            f"CPU: every FP8 weight is dequantized to {name} once at load (FP8 matmul on CPU is orders of magnitude "
            f"slower), so the model takes as much memory as {name} (more while loading: the codes are read first) and "
            f"runs no faster than it (slower where the scheme rounds activations through e4m3); docs/runtime.md"
        )
    elif out["dequantized"] and not out["e4m3"]:
        out["note"] = (
            f"every FP8 weight is held dequantized in {name} (measured faster here): no memory is saved over {name}"
        )
    elif out["dequantized"]:
        out["note"] = (
            f"{out['dequantized']} of {out['e4m3'] + out['dequantized']} weight groups are held dequantized in {name}"
        )
    return out


def model_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers, each storage counted once (tied tensors, and the
    views fused layers keep of one weight)."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [m.dense_weight for m in model.modules() if isinstance(m, FP8Linear) and m.dense_weight is not None]
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _linear_layout(model, qc: dict) -> tuple[dict, set]:
    """The Linear shapes of the model built from config, and which of them the config ignores."""
    from ...model.plan import matches

    linears = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return linears, {n for n in linears if matches(n, list(qc.get("ignore") or []))}


def check_built_model(path, report, trust_remote_code: bool = False) -> None:
    """The part of `mpsconvert verify` that needs the model: build it from config.json (weightless)
    and check every FP8 weight against its Linear's shape and the config's ignore list, adding
    what disagrees to `report` (manifests/verify.py's, run first). verify asks for it only where
    the manifest does not vouch for config.json (`report.needs_model`): a checkpoint of another
    tool, a config.json changed since the conversion. With `trust_remote_code` the model's code
    runs only once every file (that code included) matched its hash."""
    from ...manifests.verify import check_model_shapes, check_model_structure

    path = Path(path)
    if trust_remote_code and not (report.ok and report.hashes_checked):
        report.warnings.append(
            "the model was not built from config.json: with --trust-remote-code, code runs only "
            "from an artifact that verified"
        )
        return
    try:
        qc = read_json(path / layout.CONFIG_NAME, what=layout.CONFIG_NAME).get("quantization_config") or {}
        _, model = definition.build_from(path, buffers="real", trust_remote_code=trust_remote_code)
        linears, ignored = _linear_layout(model, qc if isinstance(qc, dict) else {})
    except (OSError, ValueError, MpsconvertError):  # config missing or unreadable: verify_artifact said which
        return
    check_model_shapes(report, linears, ignored)
    report.linears = set(linears)
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out = (
        model.get_output_embeddings()
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "get_output_embeddings")
        else None
    )
    for n, m in model.named_modules():  # a tied output embedding is the input embedding: not stored under its own name
        if out is not None and m is out:
            params.pop(f"{n}.weight", None)
    check_model_structure(report, params, {n for n, _ in model.named_modules()})
