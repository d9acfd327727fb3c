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
- On a machine's first run (the policy's cache has no record of these kernels here), `load` does
  not wait for that thread's Triton compiles: it returns with the model on torch's kernels, and
  the model takes ours once they are compiled (runtime/load/held.py).

This module is the driver: the order of the checks, the reads and the patches. Where each tensor
goes and what it becomes is tensor_plan.py, the report attached to the model load_report.py, and
the model built from config.json checked against the artifact model_check.py.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from ...errors import ArtifactError
from ...format.ct_config import scheme_from_config
from ...infra import atomic, devices
from ...infra.untrusted import read_json
from ...manifests import layout, loadable
from ...manifests.verify import check_artifact, check_digests, check_sizes, failed, raise_problems, verify_artifact
from ...model import definition
from .. import patches
from ..ops import triton as tritonlib
from ..ops.fp8linear import FP8Linear
from ..ops.fuse import SharedInput
from . import held, prewarm, prewarm_child, stream
from .load_report import LoadInfo, model_bytes, weights_held
from .model_check import linear_layout
from .policy import KernelPolicy, decided_before
from .tensor_plan import TensorPlan


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


def _kernels_and_forwards(model, ctx, reports, info, seconds, warm, policy, progress, registry=patches.REGISTRY):
    """The load's steps after the modules' patches: wait for the warm-up (`warm`, if given), the
    kernel policy, then the patches of phase "forwards" of `registry` and every patch's check;
    into `info` and `seconds`."""
    if warm is not None:
        info.prewarm = warm.join()
        seconds["prewarm_wait"] = info.prewarm["waited_s"]
    t = time.perf_counter()
    info.kernels = [d.as_dict() for d in policy.apply(model, progress)]
    seconds["kernels"] = time.perf_counter() - t
    t = time.perf_counter()
    reports |= patches.apply(model, ctx, "forwards", registry)
    patches.check(model, ctx, reports)
    info.patches = {name: r.as_dict() for name, r in reports.items()}
    seconds["patches"] = time.perf_counter() - t


def _holds(dev: torch.device, warm, kernel_cache, measure, linears: dict, scheme) -> bool:
    """Whether `load` holds our Triton kernels back (held.py): a warm-up runs (CUDA, eager fusion),
    Triton is here, the policy measures and caches as it does by default, and its cache has no
    record of this machine running the decode kernels of these FP8 `linears` ({name: (N, K)})."""
    if warm is None or not tritonlib.available() or kernel_cache is False or measure is not None:
        return False
    sigs = prewarm.signatures(linears, prewarm.job_of(scheme)[2])
    return not decided_before(devices.capabilities(dev).name, sigs, kernel_cache)


def _install_held(model, ctx, reports: dict, info: LoadInfo, kernel_cache, warm) -> dict:
    """What `load` installs on a warm machine after the reading, for a model loaded with it held
    (`ctx.held`): once `warm` is done, the held patches and the kernel policy, each checked as at
    load; the seconds of each step."""
    seconds, todo = {}, patches.held_back(reports)
    ctx = patches.Context(ctx.device, ctx.dtype, ctx.options)
    t = time.perf_counter()
    reports |= patches.apply(model, ctx, "modules", todo)
    seconds["install"] = time.perf_counter() - t
    policy = KernelPolicy(ctx.device, cache=kernel_cache)
    _kernels_and_forwards(model, ctx, reports, info, seconds, warm, policy, None, todo)
    return {k: round(v, 3) for k, v in seconds.items()}


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
    On a machine's first run (CUDA; the kernel cache has no record of running these kernels here)
    the Triton kernels and the patches that need them are held back while they compile: the model
    runs torch's kernels until then, the engine switches at the first generation after they are
    ready, and `model.mpsconvert_held` is not None until it has (runtime/load/held.py).
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
        model = _load(
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
    except BaseException:
        if warm is not None:
            warm.cancel()  # a load that failed: the thread ends
        raise
    if warm is not None and held.held(model) is None:
        warm.cancel()  # joined already: a child it could not wait for is killed
    return model


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
    linears, ignored = linear_layout(model, qc)
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
        plan = TensorPlan(model, report, dtype, dev)
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
    hold = _holds(dev, warm, kernel_cache, measure, {n: s for n, s in linears.items() if n not in ignored}, scheme)
    options = {
        "share_inputs": share_inputs,
        "decode_attention": decode_attention,
        "eager_fusion": eager_fusion,
        "compile": compile,
        "prefill_graphs": prefill_graphs,
    }
    ctx = patches.Context(dev, dtype, options, held=hold)
    with tritonlib.holding() if hold else contextlib.nullcontext():  # the patches' checks run the model too
        reports = patches.apply(model, ctx, "modules")
        seconds["install"] = time.perf_counter() - t2
        policy = KernelPolicy(dev, measure=measure, cache=kernel_cache, held=hold)
        _kernels_and_forwards(model, ctx, reports, info, seconds, None if hold else warm, policy, progress)
    if hold:
        info.prewarm = {"pending": "compiling while the model runs torch's kernels (held.py)"}
        held.HeldKernels(model, warm, lambda: _install_held(model, ctx, reports, info, kernel_cache, warm))
    info.fp8_layers = sum(
        isinstance(m, FP8Linear) and not isinstance(p, SharedInput) for p in model.modules() for m in p.children()
    )
    info.weights_held = weights_held(model, dev, dtype)
    info.weight_bytes = model_bytes(model)
    seconds["total"] = time.perf_counter() - t0
    info.seconds = {k: round(v, 3) for k, v in seconds.items()}
    model.mpsconvert = info
    return model
