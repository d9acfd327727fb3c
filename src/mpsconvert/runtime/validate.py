"""`mpsconvert validate`: an FP8 artifact against its BF16 baseline, on one device, in one run.

Accuracy: both models see the same eval text. Causal LMs: perplexity of each, its delta, mean
KL(bf16 || fp8) and top-1 agreement of next-token distributions (runtime/metrics.py). Encoders:
cosine of mean-pooled sentence embeddings. Latency: prefill of `prefill_len` tokens and decode
of `decode_tokens` tokens after it (batch 1, static KV cache), warm-up first, the device
synchronised around every timed step, median and p95; on CUDA decode runs through
torch.compile(mode="reduce-overhead") (CUDA graphs), the way transformers documents fast
decoding. Peak device memory of each model's phase and its weight bytes. Results go into the
artifact's manifest (`validation`, written atomically) with device and settings.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import devices, timing
from ..errors import DataError, MpsconvertError, SourceError
from ..progress import Progress, or_silent
from . import metrics

PEAK_NOTE = "device peak allocated while this model was timed (both models resident); see weight_bytes for each model's own"


@dataclass
class ValidateOptions:
    baseline: str | None = None
    eval_data: str | None = None
    device: str = "auto"
    seq_len: int = 512
    max_samples: int = 8
    prefill_len: int = 512
    decode_tokens: int = 32
    repeats: int = 10
    warmup: int = 3
    latency: bool = True
    compile: str = "auto"  # auto (CUDA only) | on | off
    write: bool = True
    kernel_cache: object = None  # KernelPolicy cache file, or False


def _is_causal(config) -> bool:
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in (getattr(config, "architectures", None) or []))


def resolve_baseline(artifact: Path, baseline: str | None) -> str:
    """--baseline, else the manifest's source: a hub id via source.resolve, or a recorded local path."""
    from ..manifests.layout import MANIFEST_NAME
    from ..manifests.manifest import Manifest
    from ..source import resolve

    if baseline:
        return str(resolve(baseline).path)
    if not (artifact / MANIFEST_NAME).is_file():
        raise SourceError(f"{artifact} has no {MANIFEST_NAME}, so its BF16 source is unknown", "pass --baseline <hub id or folder>")
    src = Manifest.read(artifact).source
    if src.get("kind") == "hub":
        return str(resolve(src["id"], revision=src.get("commit") or src.get("revision")).path)
    for cand in (src.get("path"), src.get("id")):
        if cand and Path(cand).is_dir():
            return str(resolve(cand).path)
    raise SourceError(f"the manifest names a local source ({src.get('id')!r}) that is not here", "pass --baseline <folder of the BF16 model>")


def read_texts(path: str | None) -> tuple[list[str], str]:
    """The eval documents (texts.read_documents; None: the bundled set) and where they came from."""
    from ..texts import BUILTIN, read_documents

    p = Path(path) if path is not None else BUILTIN
    if not p.is_file():
        raise DataError(f"eval data {path} does not exist", "pass a .jsonl (one {'text': ...} per line), .json, .parquet or .txt file")
    texts = [t for t in read_documents(p) if t.strip()]
    if not texts:
        raise DataError(f"{p} holds no text", "pass a file with some text in it")
    return texts, str(p)


def _peak(dev) -> int | None:
    m = devices.memory(dev)
    return m.get("peak_allocated", m.get("driver_allocated"))


def _latency_causal(model, ids: torch.Tensor, opts: ValidateOptions, dev, use_compile: bool) -> dict:
    from transformers import StaticCache

    ids = ids[:, : opts.prefill_len]
    t = ids.shape[1]
    devices.reset_peak(dev)
    cache = StaticCache(config=model.config, max_cache_len=t + opts.decode_tokens + opts.warmup + 2)

    def prefill():
        cache.reset()
        return model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(t, device=dev)).logits

    with torch.no_grad():
        pre = timing.wall_samples(prefill, dev, opts.repeats, opts.warmup)
        step = torch.compile(model.forward, mode="reduce-overhead") if use_compile else model.forward
        logits = prefill()
        tok = logits[:, -1:].argmax(-1)
        per_token = []
        for i in range(opts.warmup + opts.decode_tokens):
            pos = torch.tensor([t + i], device=dev)
            devices.synchronize(dev)
            t0 = time.perf_counter()
            out = step(tok, past_key_values=cache, use_cache=True, cache_position=pos).logits
            tok = out[:, -1:].argmax(-1).clone()
            devices.synchronize(dev)
            if i >= opts.warmup:  # the first calls compile / capture the graph
                per_token.append(time.perf_counter() - t0)
    dec = timing.stats(per_token)
    return {
        "prefill": timing.stats(pre) | {"tokens": t},
        "decode": dec | {"tokens": len(per_token), "tokens_per_s": 1e3 / dec["median_ms"] if dec["median_ms"] else None},
        "peak_memory_bytes": _peak(dev),
        "peak_memory_note": PEAK_NOTE,
    }


def _latency_encoder(model, batch: dict, opts: ValidateOptions, dev) -> dict:
    devices.reset_peak(dev)
    with torch.no_grad():
        pre = timing.wall_samples(lambda: model(**batch), dev, opts.repeats, opts.warmup)
    return {"prefill": timing.stats(pre) | {"tokens": int(batch["input_ids"].numel())}, "peak_memory_bytes": _peak(dev),
            "peak_memory_note": PEAK_NOTE}


def validate(artifact, opts: ValidateOptions, progress: Progress | None = None) -> dict:
    import transformers

    from .loader import load, model_bytes

    artifact = Path(artifact)
    progress = or_silent(progress)
    dev = devices.choose(opts.device)
    use_compile = opts.compile == "on" or (opts.compile == "auto" and dev.type == "cuda")
    base_path = resolve_baseline(artifact, opts.baseline)
    texts, data_path = read_texts(opts.eval_data)
    tok = transformers.AutoTokenizer.from_pretrained(str(artifact))
    progress("load fp8", 0, 1, "")
    fp8_model = load(artifact, device=opts.device, prefill_m=opts.prefill_len, kernel_cache=opts.kernel_cache)
    causal = _is_causal(fp8_model.config)
    cls = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    progress("load bf16", 0, 1, "")
    with devices.oom_hint(dev, "loading the BF16 baseline"):
        base_model = cls.from_pretrained(base_path, dtype=torch.bfloat16).to(dev).eval()
    models = {"bf16": base_model, "fp8": fp8_model}
    result = {
        "kind": "causal-lm" if causal else "encoder",
        "device": str(dev),
        "device_name": devices.capabilities(dev).name,
        "torch": torch.__version__,
        "baseline": base_path,
        "eval_data": data_path,
        "settings": {k: v for k, v in asdict(opts).items() if k not in ("baseline", "eval_data", "kernel_cache")} | {"compile": use_compile},
        "scheme": fp8_model.mpsconvert.scheme,
        "weights": fp8_model.mpsconvert.weights,
        "kernels": fp8_model.mpsconvert.kernels,
        "dequantized_at_load": fp8_model.mpsconvert.dequantized,
        "weight_bytes": {"bf16": model_bytes(base_model), "fp8": model_bytes(fp8_model)},
    }
    if causal:
        sep = tok.eos_token_id if tok.eos_token_id is not None else 0
        ids: list[int] = []
        for t in texts:
            ids += tok(t, add_special_tokens=False)["input_ids"] + [sep]
            if len(ids) >= opts.seq_len * opts.max_samples:
                break
        n = min(opts.max_samples, len(ids) // opts.seq_len)
        if n == 0:
            raise MpsconvertError(f"the eval text has {len(ids)} tokens, fewer than --seq-len {opts.seq_len}", "use more text or a smaller --seq-len")
        chunks = torch.tensor(ids[: n * opts.seq_len]).reshape(n, opts.seq_len)
        scores = metrics.CausalLMScores()
        with torch.no_grad():
            for i in range(n):
                x = chunks[i : i + 1].to(dev)
                scores.update(base_model(x).logits, fp8_model(x).logits, x)
                progress("accuracy", i + 1, n, "")
        result["accuracy"] = scores.result()
        sample = chunks[:1].to(dev)
        if opts.latency and opts.prefill_len > opts.seq_len:
            sample = torch.tensor(ids[: opts.prefill_len])[None].to(dev)
    else:
        sents = [s.strip() for t in texts for s in t.split(". ") if len(s.strip()) > 20][: opts.max_samples * 8]
        batch = tok(sents, padding=True, truncation=True, max_length=min(opts.seq_len, 256), return_tensors="pt").to(dev)
        with torch.no_grad():
            eb = metrics.mean_pool(base_model(**batch).last_hidden_state, batch["attention_mask"])
            ef = metrics.mean_pool(fp8_model(**batch).last_hidden_state, batch["attention_mask"])
        cos = metrics.cosine(eb, ef)
        result["accuracy"] = {"sentences": len(sents), "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min())}
        progress("accuracy", 1, 1, "")
    if opts.latency:
        result["latency"] = {}
        if not use_compile:  # warm both models first: on CPU the first model timed otherwise pays one-off costs
            short = ValidateOptions(**{**asdict(opts), "repeats": 1, "warmup": 1, "decode_tokens": 2})
            for model in models.values():
                _latency_causal(model, sample, short, dev, False) if causal else _latency_encoder(model, batch, short, dev)
        for i, (name, model) in enumerate(models.items()):
            devices.empty_cache(dev)
            with devices.oom_hint(dev, f"timing the {name} model"):
                result["latency"][name] = (_latency_causal(model, sample, opts, dev, use_compile) if causal
                                           else _latency_encoder(model, batch, opts, dev))
            progress("latency", i + 1, len(models), name)
            torch._dynamo.reset() if use_compile else None
        lb, lf = result["latency"]["bf16"], result["latency"]["fp8"]
        result["speedup"] = {"prefill": lb["prefill"]["median_ms"] / lf["prefill"]["median_ms"]}
        if causal:
            result["speedup"]["decode"] = lb["decode"]["median_ms"] / lf["decode"]["median_ms"]
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if opts.write:
        _record(artifact, result)
    return result


def _record(artifact: Path, result: dict) -> None:
    """Add the run to the manifest's `validation` block, keyed by device and scheme (atomic write)."""
    from ..manifests.layout import MANIFEST_NAME, update_manifest

    if not (artifact / MANIFEST_NAME).is_file():
        result["recorded"] = None  # a checkpoint from another tool: nothing to write into
        return
    with update_manifest(artifact) as m:
        runs = m.extra.get("validation") or {}
        runs[f"{result['device_name']} ({result['device']})"] = result
        m.extra["validation"] = runs
    result["recorded"] = str(artifact / MANIFEST_NAME)
