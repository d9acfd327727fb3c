"""`mpsconvert validate` of a diffusion artifact: one denoising step of its transformer against the
BF16 source, on one device.

Both transformers get the same inputs: random latents and text embeddings of the shapes the
model's config implies, a mid-schedule timestep, fixed seed (`step_inputs`, one builder per
family, since each diffusers transformer takes its own arguments). Accuracy: relative error
(||fp8 - bf16|| / ||bf16||), cosine and max |difference| of the predicted noise / velocity.
Latency: the step timed in rounds that alternate the two models (as runtime/evaluate/validate.py does
for encoders), device synchronised around each call; a speed verdict only beyond the rounds'
spread. The models come from convert/diffusion/load.py's `load_pair`, loaded by the caller
(workflows/validate.py: the runtime does not import the conversion package).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from ...errors import MpsconvertError
from ...format.fp8 import relative_error
from ...infra import devices, timing
from ...infra.progress import Progress, or_silent
from .validate import ValidateOptions, _peak, _record, with_defaults

INPUT_NOTE = "random latents and text embeddings of the config's shapes, timestep 500/1000, seed {seed}"


def _rand(g: torch.Generator, *shape, device, dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)


def step_inputs(
    family: str,
    config: dict,
    *,
    seed: int = 0,
    image_tokens: int = 256,
    text_tokens: int = 64,
    device="cpu",
    dtype=torch.bfloat16,
) -> dict:
    """One denoising step's keyword arguments for a `family` transformer (batch 1): an image of
    `image_tokens` latent patches (a square side, a 2-frame video for Wan) and `text_tokens` text
    embeddings."""
    g = torch.Generator().manual_seed(seed)
    side = max(1, int(round(image_tokens**0.5)))
    r = lambda *s: _rand(g, *s, device=device, dtype=dtype)  # noqa: E731
    t = torch.tensor([500.0], device=device)
    if family == "flux":
        ids = torch.stack(
            torch.meshgrid(torch.zeros(1), torch.arange(side).float(), torch.arange(side).float(), indexing="ij"), -1
        ).reshape(-1, 3)
        kw = dict(
            hidden_states=r(1, side * side, config["in_channels"]),
            encoder_hidden_states=r(1, text_tokens, config["joint_attention_dim"]),
            pooled_projections=r(1, config["pooled_projection_dim"]),
            timestep=t / 1000,
            img_ids=ids.to(device),
            txt_ids=torch.zeros(text_tokens, 3, device=device),
            return_dict=False,
        )
        if config.get("guidance_embeds"):
            kw["guidance"] = torch.tensor([3.5], device=device)
        return kw
    if family == "wan":
        p = config["patch_size"]
        return dict(
            hidden_states=r(1, config["in_channels"], 2, side * p[1], side * p[2]),
            timestep=t.long(),
            encoder_hidden_states=r(1, text_tokens, config["text_dim"]),
            return_dict=False,
        )
    if family == "qwen-image":
        return dict(
            hidden_states=r(1, side * side, config["in_channels"]),
            encoder_hidden_states=r(1, text_tokens, config["joint_attention_dim"]),
            encoder_hidden_states_mask=torch.ones(1, text_tokens, device=device, dtype=torch.long),
            timestep=t / 1000,
            img_shapes=[(1, side, side)],
            return_dict=False,
        )
    if family == "sd3":
        p = config["patch_size"]
        return dict(
            hidden_states=r(1, config["in_channels"], side * p, side * p),
            encoder_hidden_states=r(1, text_tokens, config["joint_attention_dim"]),
            pooled_projections=r(1, config["pooled_projection_dim"]),
            timestep=t,
            return_dict=False,
        )
    if family == "z-image":
        p = config["all_patch_size"][0]
        return dict(
            x=[r(config["in_channels"], 1, side * p, side * p)],
            t=t / 1000,
            cap_feats=[r(text_tokens, config["cap_feat_dim"])],
            return_dict=False,
        )
    raise MpsconvertError(
        f"validate has no inputs for the family {family!r}",
        "report this: every family in convert/diffusion/families.py needs one",
    )


def _output(out) -> torch.Tensor:
    """The prediction: diffusers returns a tuple (return_dict=False); Z-Image a list per sample."""
    x = out[0] if isinstance(out, (tuple, list)) else out
    return torch.stack(list(x)) if isinstance(x, (list, tuple)) else x


def compare(base: torch.Tensor, test: torch.Tensor) -> dict:
    """Relative error, cosine and max |difference| of two predictions (float32)."""
    b, t = base.float().flatten(), test.float().flatten()
    d = t - b
    return {
        "rel_error": relative_error(t, b),
        "cosine": float(torch.nn.functional.cosine_similarity(b, t, dim=0)),
        "max_abs_error": float(d.abs().max()),
        "ref_abs_mean": float(b.abs().mean()),
        "elements": b.numel(),
    }


def _bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def validate(
    artifact: Path,
    manifest,
    opts: ValidateOptions,
    pair,
    dev: torch.device,
    progress: Progress | None = None,
    seed: int = 0,
    *,
    record: bool = True,
) -> dict:
    """One denoising step of the FP8 transformer vs BF16 (`pair`: both loaded on `dev`, by
    convert/diffusion/load.py's `load_pair`): accuracy and (unless --no-latency) latency; recorded
    when `opts.write` and `record` (False: the caller records it, `validate.put_run`)."""
    progress = or_silent(progress)
    opts = with_defaults(
        replace(opts, full=True), dev.type != "cpu"
    )  # one step of each model: CPU's quick defaults would not shorten it
    repeats, warmup = opts.repeats, opts.warmup
    tokens = min(opts.prefill_len, 4096)
    kw = step_inputs(pair.family, pair.config, seed=seed, image_tokens=tokens, device=dev)
    with torch.no_grad():
        base = _output(pair.bf16(**kw))
        test = _output(pair.fp8(**kw))
    accuracy = compare(base, test)
    progress("accuracy", 1, 1, "")
    r = manifest.recipe
    result = {
        "kind": "diffusion-step",
        "device": str(dev),
        "device_name": devices.capabilities(dev).name,
        "torch": torch.__version__,
        "baseline": pair.baseline,
        "eval_data": INPUT_NOTE.format(seed=seed),
        "settings": {
            "image_tokens": tokens,
            "text_tokens": 64,
            "seed": seed,
            "repeats": repeats,
            "warmup": warmup,
            "rounds": opts.rounds,
            "latency": opts.latency,
        },
        "scheme": r.get("name"),
        "weights": r.get("weights"),
        "kernels": [pair.how],
        "dequantized_at_load": []
        if r.get("format") == "diffusers"
        else ["every FP8 layer: dequantized at load by comfy-kitchen, as ComfyUI reads the file, so held as BF16"],
        "accuracy": accuracy,
        "weight_bytes": {"bf16": _bytes(pair.bf16), "fp8": _bytes(pair.fp8)},
    }
    if opts.latency:
        rounds = {"bf16": [], "fp8": []}
        with torch.no_grad():
            for i in range(opts.rounds):
                for name, model in (("bf16", pair.bf16), ("fp8", pair.fp8)):
                    rounds[name].append(
                        timing.wall_samples(lambda m=model: m(**kw), dev, repeats, warmup if i == 0 else 1)
                    )
                progress("latency", i + 1, opts.rounds, "rounds")
        lat = {n: {"step": timing.round_stats(v)} | {"peak_memory_bytes": _peak(dev)} for n, v in rounds.items()}
        result["latency"] = lat
        result["speedup"] = {"step": lat["bf16"]["step"]["median_ms"] / lat["fp8"]["step"]["median_ms"]}
        result["verdict"] = {"step": timing.verdict(lat["bf16"]["step"], lat["fp8"]["step"])}
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if opts.write and record:
        _record(artifact, result)
    else:
        result["recorded"] = None
    return result
