"""Run calibration: samples through the model on the chosen device, observers on the targets.

Two modes, same numbers:
- whole model: transformers loads the model onto the device; each sample is one forward pass.
- sequential (`--sequential`): the model is built with its parameters on the meta device; the
  parts outside the decoder blocks (embeddings, final norm, heads) are loaded, the inputs of block
  0 are captured for every sample, then each block in turn is loaded from the safetensors, run on
  every sample's inputs (its outputs become the next block's inputs) and unloaded. Peak device
  memory is about one block plus the stored hidden states. Linears outside the blocks (a BERT
  pooler, a classifier) are observed in a last pass where the blocks replay their outputs.

Samples are run one at a time (batch 1, no padding), so both modes see identical inputs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import QuantizationError, SourceError
from ..format import fp8
from ..infra import devices, filesystem
from ..infra.progress import Progress, or_silent
from ..model import definition, hf_compat, reference
from ..model.plan import Plan, plan_for
from . import data, hooks, observers
from .options import CalibOptions  # noqa: F401  (re-exported, where callers found it)


@dataclass
class Calibration:
    scales: dict[str, float]  # Linear module -> static input dequant scale (clip / 448)
    expert_scales: dict[str, dict[str, list[float]]]  # fused experts module -> projection -> per-expert scale
    record: dict  # what produced them: for the manifest's recipe.calibration
    warnings: list[str] = field(default_factory=list)  # for the caller to show (the CLI prints them)
    seconds: float = 0.0
    peak_memory: dict = field(default_factory=dict)
    short: bool = False  # the text gave fewer windows, or under half the tokens, asked for (data.short)


def _model_dtype(config) -> torch.dtype:
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt, None)
    return dt if isinstance(dt, torch.dtype) else torch.float32


def calibrate(
    model_dir: Path, opts: CalibOptions, progress: Progress | None = None, plan: Plan | None = None
) -> Calibration:
    """Calibrate the model in `model_dir` (a safetensors snapshot) and return its input scales."""
    import transformers

    progress = or_silent(progress)
    make = observers.make(opts.observer, opts.percentile)
    plan = plan or plan_for(model_dir, opts.ignore, opts.trust_remote_code)
    device = devices.choose(opts.device)
    from ..manifests import loadable

    tokenizer = loadable.tokenizer(
        model_dir, error=SourceError, trust_remote_code=opts.trust_remote_code
    )  # bounded, one line on failure
    corpus = data.load(opts.data, revision=opts.data_revision, token=opts.token)
    config = transformers.AutoConfig.from_pretrained(str(model_dir), trust_remote_code=opts.trust_remote_code)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and opts.seq_len > limit:
        raise QuantizationError(
            f"--seq-len {opts.seq_len} is longer than this model's {limit} positions", f"pass --seq-len {limit} or less"
        )
    samples = data.draw(corpus, tokenizer, opts.num_samples, opts.seq_len, opts.seed)
    short = data.short(samples, opts.num_samples, opts.seq_len)
    warnings: list[str] = []
    if short and (warning := data.short_text(samples, opts.num_samples, opts.seq_len, corpus.source)):
        warnings.append(warning)

    devices.reset_peak(device)
    t0 = time.perf_counter()
    with torch.no_grad(), devices.oom_hint(device, "calibration"):
        if opts.sequential:
            obs, experts, how = _run_sequential(model_dir, config, plan, samples, device, make, opts, progress)
        else:
            obs, experts, how = _run_whole(model_dir, config, plan, samples, device, make, opts, progress)
        devices.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = devices.memory(device)
    scales, modules, fallbacks = _finalize(plan, obs)
    expert_scales, expert_record = _finalize_experts(experts)
    if fallbacks:
        warnings.append(
            f"{len(fallbacks)} Linear(s) received no calibration input and got a fallback scale: "
            + ", ".join(sorted(fallbacks))
        )
    for name, rec in expert_record.items():
        if rec["never_routed"]:
            warnings.append(
                f"{name}: experts {rec['never_routed']} were never routed to; they got the max scale of "
                "the layer's routed experts"
            )
    record = {
        "device": device.type,
        **make().describe(),
        "mode": "sequential" if opts.sequential else "whole-model",
        **how,
        "dtype": str(_model_dtype(config)).replace("torch.", ""),
        "data": corpus.source,
        "num_samples_requested": opts.num_samples,
        "num_samples": len(samples.input_ids),
        "seq_len": opts.seq_len,
        "seed": opts.seed,
        "tokens": samples.tokens,
        "drawn": samples.drawn,
        "scale": "clip / 448 (dequant multiplier), floor %g" % fp8.SCALE_FLOOR,
        "modules": modules,
        "fallbacks": fallbacks,
        "fallback_rule": "an expert Linear that saw no token gets the max clip of its sibling experts (same "
        "projection, same layer); any other Linear that saw no input gets the max clip over all "
        "observed Linears",
        "experts": expert_record,
    }
    return Calibration(scales, expert_scales, record, warnings, seconds, peak, short=short)


# --- whole model -----------------------------------------------------------------------------


def _run_whole(model_dir, config, plan, samples, device, make, opts, progress):
    model = reference.load(
        model_dir, dtype=_model_dtype(config), device=device, config=config, trust_remote_code=opts.trust_remote_code
    )
    run = _runner(model, plan)
    with hooks.observing(model, list(plan.quantize), make) as (obs, experts):
        for i, ids in enumerate(samples.input_ids):
            _forward(run, ids, device)
            progress("calibrate", i + 1, len(samples.input_ids), "samples")
    del model
    devices.empty_cache(device)
    return obs, experts, {"weights_loader": "transformers from_pretrained"}


def _runner(model, plan: Plan):
    """The part of the model to run: the base model when no quantized Linear lies outside it, so an
    ignored output head (lm_head: vocab x hidden, ~20% of a small LM's compute) is never run."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    if (
        isinstance(base, torch.nn.Module)
        and base is not model
        and all(m.startswith(prefix + ".") for m in plan.quantize)
    ):
        return base
    return model


def _forward(model, ids: list[int], device):
    x = torch.tensor([ids], dtype=torch.long, device=device)
    kwargs = {"use_cache": False} if getattr(model.config, "use_cache", None) is not None else {}
    return model(input_ids=x, **kwargs)


# --- sequential ------------------------------------------------------------------------------


class _Stop(Exception):
    """Raised by the block-0 catcher once it has the block's inputs."""


class _Replay(torch.nn.Module):
    """Stands in for a block in the last pass: returns the block's recorded output for the sample."""

    def __init__(self, block, outputs):
        super().__init__()
        object.__setattr__(self, "_block", block)
        self.outputs = outputs
        self.sample = 0

    def forward(self, *args, **kwargs):
        return self.outputs[self.sample]

    def __getattr__(self, name):  # attributes the model's forward reads (e.g. attention_type)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_block"), name)


class Weights:
    """Tensors by model parameter name, read from the snapshot's safetensors on demand."""

    def __init__(self, model_dir: Path, prefix: str):
        from safetensors import safe_open

        from ..infra.safetensors_io import read_header

        self.prefix = prefix
        self.files = {}
        self.where: dict[str, str] = {}
        for name in filesystem.files(model_dir, ".safetensors"):  # AppleDouble `._*` companions left out
            f = Path(model_dir) / name
            for key in read_header(f).tensors:
                self.where[key] = name
            self.files[name] = safe_open(str(f), framework="pt")

    def variants(self, name: str) -> list[str]:
        """The names a model tensor may be stored under: as is, with or without base_model_prefix."""
        p = self.prefix
        out = [name]
        if p:
            out.append(f"{p}.{name}")
            if name.startswith(p + "."):
                out.append(name[len(p) + 1 :])
        return out

    def key(self, name: str) -> str | None:
        return next((k for k in self.variants(name) if k in self.where), None)

    def get(self, name: str) -> torch.Tensor | None:
        k = self.key(name)
        return None if k is None else self.files[self.where[k]].get_tensor(k)


def _blocks(model) -> tuple[str, torch.nn.ModuleList]:
    """The decoder/encoder block list: the ModuleList holding the most parameters."""
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 0:
            n = sum(p.numel() for p in mod.parameters())
            if best is None or n > best[2]:
                best = (name, mod, n)
    if best is None:
        raise QuantizationError(
            f"{type(model).__name__} has no list of blocks to run one at a time", "calibrate without --sequential"
        )
    return best[0], best[1]


def _materialize(module, prefix: str, weights: Weights, device, dtype, model=None, model_dir=None) -> str:
    """Load every parameter of `module` (named `prefix.<param>` in the model) onto the device.

    Returns which loader ran: "direct" when the checkpoint stores the model's own names and
    shapes, else "transformers-conversion": the block's checkpoint tensors go through
    transformers' own load-time weight conversion (e.g. per-expert MoE weights fused into 3-D
    parameters), so --sequential sees exactly the weights from_pretrained would build."""
    state = {}
    convert = False
    for name, p in module.named_parameters(recurse=True):
        t = weights.get(f"{prefix}.{name}" if prefix else name)
        if t is None or tuple(t.shape) != tuple(p.shape):
            convert = True
            break
        state[name] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    if convert:
        _convert_into(module, prefix, weights, device, dtype, model, model_dir)
        state = {}
    for name, buf in module.named_buffers(recurse=True):
        if buf.device.type != device.type:
            state[name] = buf.to(device)
    module.load_state_dict(state, strict=False, assign=True)
    return "transformers-conversion" if convert else "direct"


def _convert_into(module, prefix: str, weights: Weights, device, dtype, model, model_dir) -> None:
    fix = "calibrate without --sequential (transformers converts this checkpoint when it loads the whole model)"
    if not hf_compat.can_load_converted():
        raise QuantizationError(
            f"--sequential: {prefix} is not stored under the model's names and this transformers "
            "has no weight-conversion API",
            fix,
        )
    heads = tuple(v + "." for v in weights.variants(prefix))
    keys = [k for k in weights.where if k.startswith(heads)]
    state = {k: weights.files[weights.where[k]].get_slice(k) for k in keys}
    hf_compat.load_converted(model, state, model_dir, device, dtype)
    left = [n for n, p in module.named_parameters() if p.device.type == "meta"]
    if left:
        raise QuantizationError(
            f"--sequential: {len(left)} parameter(s) of {prefix} could not be loaded from the "
            f"checkpoint (e.g. {left[0]})",
            fix,
        )


def _unload(module):
    module.to("meta")


def _load_outside(model, config, blocks_name: str, weights: Weights, device, dtype, under: str = "") -> None:
    """Load every parameter and buffer outside the blocks (embeddings, final norm, heads) once;
    with `under`, only those of that submodule (the part that runs)."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_name = names.get(id(in_emb.weight)) if in_emb is not None else None
    tie = bool(getattr(config, "tie_word_embeddings", False)) and emb_name is not None
    for name, mod in model.named_modules():
        if (
            name == blocks_name
            or name.startswith(blocks_name + ".")
            or (under and not (name + ".").startswith(under + "."))
        ):
            continue
        for bname, b in mod._buffers.items():
            if b is not None:
                mod._buffers[bname] = b.to(device)
        sd = {}
        for pname, param in mod._parameters.items():
            if param is None:
                continue
            full = f"{name}.{pname}" if name else pname
            t = weights.get(full)
            if t is None and tie and mod is model.get_output_embeddings():
                t = weights.get(emb_name)  # tied output embedding: not stored, same tensor as the input's
            if t is None:
                raise QuantizationError(
                    f"--sequential: {full} is not stored under the model's names",
                    "this checkpoint needs transformers' weight conversion: calibrate without --sequential",
                )
            sd[pname] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
        if sd:
            mod.load_state_dict(sd, strict=False, assign=True)


def _run_sequential(model_dir, config, plan, samples, device, make, opts, progress):
    dtype = _model_dtype(config)
    model = definition.build(config, buffers="real", trust_remote_code=opts.trust_remote_code).eval()
    weights = Weights(model_dir, getattr(model, "base_model_prefix", "") or "")
    blocks_name, blocks = _blocks(model)
    run = _runner(model, plan)
    _load_outside(
        model, config, blocks_name, weights, device, dtype, under="" if run is model else model.base_model_prefix
    )
    n = len(samples.input_ids)
    total_steps = n * (len(blocks) + 1)
    loaders: set[str] = set()
    with hooks.observing(model, list(plan.quantize), make) as (obs, experts):
        inputs = []  # per sample: (args, kwargs) of the current block

        def catch(_mod, args, kwargs):
            inputs.append((args, kwargs))
            raise _Stop

        h = blocks[0].register_forward_pre_hook(catch, with_kwargs=True)
        try:
            for i, ids in enumerate(samples.input_ids):
                with contextlib.suppress(_Stop):
                    _forward(run, ids, device)
                progress("calibrate", i + 1, total_steps, "embeddings")
        finally:
            h.remove()
        outputs = [None] * n
        for b, block in enumerate(blocks):
            loaders.add(_materialize(block, f"{blocks_name}.{b}", weights, device, dtype, model, model_dir))
            for s, (args, kwargs) in enumerate(inputs):
                out = block(*args, **kwargs)
                outputs[s] = out
                hidden = out[0] if isinstance(out, (tuple, list)) else out
                inputs[s] = ((hidden, *args[1:]), kwargs) if args else ((), {**kwargs, "hidden_states": hidden})
                progress("calibrate", n * (b + 1) + s + 1, total_steps, f"block {b + 1}/{len(blocks)}")
            _unload(block)
            devices.empty_cache(device)
        outside = [m for m in plan.quantize if not m.startswith(blocks_name + ".")]
        if outside:
            originals = list(blocks)
            replays = [_Replay(blk, outputs) for blk in originals]
            for j, r in enumerate(replays):
                blocks[j] = r
            try:
                for s, ids in enumerate(samples.input_ids):
                    for r in replays:
                        r.sample = s
                    _forward(run, ids, device)
            finally:
                for j, blk in enumerate(originals):
                    blocks[j] = blk
        inputs = outputs = None  # the activations freed (a closure above holds the name)
    del model
    devices.empty_cache(device)
    return obs, experts, {"weights_loader": sorted(loaders)}


# --- from observers to scales ----------------------------------------------------------------


def _expert_sibling_key(name: str) -> str | None:
    """`...experts.7.w1` -> `...experts.*.w1` (the same projection of the other experts)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].isdigit() and "expert" in parts[i - 1]:
            return ".".join(parts[:i] + ["*"] + parts[i + 1 :])
    return None


def _finalize(plan: Plan, obs: dict) -> tuple[dict[str, float], dict, dict]:
    clips: dict[str, float] = {}
    modules: dict[str, dict] = {}
    unseen = []
    for name in plan.quantize:
        o = obs.get(name)
        if o is None or o.count == 0:
            unseen.append(name)
            continue
        o.check(name)
        clips[name] = o.clip()
        modules[name] = {"amax": o.amax, "clip": clips[name], "values": o.count}
    fallbacks = {}
    if unseen:
        if not clips:
            raise QuantizationError(
                "no targeted Linear received any input during calibration",
                "check that the model runs on the calibration data",
            )
        by_sibling: dict[str, list[str]] = {}
        for name in clips:
            key = _expert_sibling_key(name)
            if key:
                by_sibling.setdefault(key, []).append(name)
        overall = max(clips, key=lambda m: clips[m])
        for name in unseen:
            sib = by_sibling.get(_expert_sibling_key(name) or "", [])
            src = max(sib, key=lambda m: clips[m]) if sib else overall
            clips[name] = clips[src]
            fallbacks[name] = (
                "never received input; "
                f"{'max over routed sibling experts' if sib else 'max over all observed Linears'} "
                f"({src})"
            )
            modules[name] = {"amax": None, "clip": clips[name], "values": 0}
    scales = {
        m: float(fp8.scales_from_amax(torch.tensor([c], dtype=torch.float32))[0]) for m, c in sorted(clips.items())
    }
    return scales, dict(sorted(modules.items())), dict(sorted(fallbacks.items()))


def _finalize_experts(experts: dict) -> tuple[dict, dict]:
    scales: dict[str, dict[str, list[float]]] = {}
    record: dict[str, dict] = {}
    for name, eo in sorted(experts.items()):
        projections = {"gate_up_proj": eo.inputs}
        if eo.observes_down:
            projections["down_proj"] = eo.down_inputs
        never = [e for e in range(eo.num_experts) if eo.tokens[e] == 0]
        scales[name] = {}
        for proj, per in projections.items():
            clips = {}
            for e, o in per.items():
                o.check(f"{name}.{proj}[{e}]")
                clips[e] = o.clip()
            fill = max(clips.values()) if clips else None
            if fill is None:
                continue  # the layer saw no tokens at all: nothing to derive a scale from
            vals = [clips.get(e, fill) for e in range(eo.num_experts)]
            scales[name][proj] = [float(fp8.scales_from_amax(torch.tensor([v], dtype=torch.float32))[0]) for v in vals]
        record[name] = {
            "tokens_per_expert": list(eo.tokens),
            "never_routed": never,
            "projections": sorted(scales[name]),
        }
    return scales, record
