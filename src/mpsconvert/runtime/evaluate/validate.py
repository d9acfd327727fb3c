"""`mpsconvert validate`: an FP8 artifact against its BF16 baseline, on one device, in one run.

Accuracy: both models see the same eval text. Causal LMs: perplexity of each, its delta, mean
KL(bf16 || fp8) and top-1 agreement of next-token distributions (runtime/evaluate/metrics.py). Encoders:
cosine of mean-pooled sentence embeddings. Latency, on one sequence of `prefill_len` tokens at
batch 1 for every model kind: prefill (`logits_to_keep=1`, what `generate` asks) and, for causal
LMs, `decode_tokens` decode steps after it (static KV cache), the device synchronised around
every timed step; on CUDA decode runs through torch.compile(mode="reduce-overhead") (CUDA
graphs), the way transformers documents fast decoding, and once warm its steps are timed with
only the differentiating guards evaluated (timing.warm_guards), for both models. Timing runs in
rounds that alternate the two models where nothing is compiled; a speed verdict is given only
beyond the run-to-run spread of the rounds (timing.verdict), so that noise reads as "no clear
difference". Peak device memory
and each model's weight bytes. Results go into the artifact's manifest (`validation`, written
atomically) with device and settings.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ...errors import DataError, MpsconvertError, SourceError
from ...infra import devices, timing
from ...infra.progress import Progress, or_silent
from ...model import definition, reference
from ..engine import Engine, Sampling, generate_ids
from . import metrics

PEAK_NOTE = (
    "device peak allocated while this model was timed (both models resident); see weight_bytes for each model's own"
)


@dataclass
class ValidateOptions:
    baseline: str | None = None
    eval_data: str | None = None
    device: str = "auto"
    # None: the device's default (DEFAULTS; `full` takes the GPU's on any device)
    seq_len: int | None = None
    max_samples: int | None = None
    prefill_len: int | None = None
    decode_tokens: int | None = None
    repeats: int | None = None  # timed runs per round
    warmup: int | None = None  # untimed runs first
    rounds: int | None = None  # the spread between rounds decides whether a speed difference is clear
    latency: bool = True
    compile: str = "auto"  # auto (CUDA only) | on | off
    write: bool = True
    kernel_cache: object = None  # KernelPolicy cache file, or False
    full: bool = False  # on CPU too: the GPU's sample counts and lengths (the long run)

    def __post_init__(self):
        """Every count within untrusted.LIMITS (one line each, before anything loads): a length of
        0 or -5 was a traceback deep in the run, 10^9 repeats a run that never ends."""
        from ...infra.untrusted import bounded

        for key in ("seq_len", "max_samples", "prefill_len", "decode_tokens", "repeats", "rounds", "warmup"):
            v = getattr(self, key)
            if v is not None:
                bounded(v, key)


# What validate measures when an option is not given. A GPU runs the full set in seconds. On CPU
# it took ten minutes for SmolLM2-135M on a 2-core machine (BF16 matmul is emulated on most
# CPUs, and both models run every sample), so CPU runs fewer and shorter samples by default,
# which the table states; `full` (--full) runs the full lengths there too, with CPU's repeats.
DEFAULTS = {
    "gpu": dict(seq_len=512, max_samples=8, prefill_len=512, decode_tokens=32, repeats=10, warmup=3, rounds=3),
    "cpu": dict(seq_len=256, max_samples=4, prefill_len=128, decode_tokens=16, repeats=2, warmup=1, rounds=2),
    "cpu-full": dict(seq_len=512, max_samples=8, prefill_len=512, decode_tokens=32, repeats=3, warmup=1, rounds=3),
}


def defaults_name(opts: ValidateOptions, gpu: bool) -> str:
    """Which DEFAULTS fill the options left unset: "gpu", "cpu" (the quick CPU run) or "cpu-full"."""
    return "gpu" if gpu else "cpu-full" if opts.full else "cpu"


def with_defaults(opts: ValidateOptions, gpu: bool) -> ValidateOptions:
    """`opts` with every unset option filled from DEFAULTS for the device."""
    fill = DEFAULTS[defaults_name(opts, gpu)]
    return replace(opts, **{k: v for k, v in fill.items() if getattr(opts, k) is None})


def resolve_baseline(artifact: Path, baseline: str | None) -> str:
    """--baseline, else the manifest's source: a hub id via source.resolve, or a recorded local path."""
    from ...manifests.layout import MANIFEST_NAME
    from ...manifests.manifest import Manifest
    from ...source.snapshot import resolve

    if baseline:
        return str(resolve(baseline).path)
    if not (artifact / MANIFEST_NAME).is_file():
        raise SourceError(
            f"{artifact} has no {MANIFEST_NAME}, so its BF16 source is unknown", "pass `baseline=<hub id or folder>`"
        )
    src = Manifest.read(artifact).source
    if src.get("kind") == "hub":
        return str(resolve(src["id"], revision=src.get("commit") or src.get("revision")).path)
    for cand in (src.get("path"), src.get("id")):
        if cand and Path(cand).is_dir():
            return str(resolve(cand).path)
    raise SourceError(
        f"the manifest names a local source ({src.get('id')!r}) that is not here",
        "pass `baseline=<folder of the BF16 model>`",
    )


# what must agree between an artifact and its baseline for a comparison to mean anything
_SAME = (
    "model_type",
    "architectures",
    "num_hidden_layers",
    "hidden_size",
    "vocab_size",
    "intermediate_size",
    "num_attention_heads",
)


def check_baseline(artifact: Path, base_path: str) -> None:
    """The baseline is a model mpsconvert may build (its config read the way every config is:
    bounded and typed; code in it never run: remote code is refused) and the same model as the
    artifact (architecture and sizes), before either is loaded.

    Raises:
        SourceError: remote code, an unreadable config, or another model, in one line.
    """
    from ...infra.untrusted import read_json
    from ...manifests.layout import CONFIG_NAME

    fix = "pass `baseline=<the model this artifact was made from>`"
    try:
        base = definition.load_config(base_path, trust_remote_code=False).to_dict()
    except SourceError as e:
        raise SourceError(f"the baseline {base_path}: {e.problem}", fix) from None
    mine = read_json(artifact / CONFIG_NAME, what=CONFIG_NAME)
    for key in _SAME:
        a, b = mine.get(key), base.get(key)
        if a is not None and b is not None and a != b:
            raise SourceError(
                f"the baseline {base_path} is another model: its {key} is {str(b)[:60]}, the artifact's {str(a)[:60]}",
                fix,
            )


def read_texts(path: str | None) -> tuple[list[str], str]:
    """The eval documents (texts.read_documents; None: the bundled set) and where they came from."""
    from ...infra.texts import BUILTIN, read_documents

    p = Path(path) if path is not None else BUILTIN
    if not p.is_file():
        raise DataError(
            f"eval data {path} does not exist",
            "pass a .jsonl (one {'text': ...} per line), .json, .parquet or .txt file",
        )
    texts = [t for t in read_documents(p) if t.strip()]
    if not texts:
        raise DataError(f"{p} holds no text", "pass a file with some text in it")
    return texts, str(p)


def eval_ids(tok, texts: list[str], tokens: int) -> list[int]:
    """The eval texts' token ids, each text followed by EOS (0 where the tokenizer has none), until
    at least `tokens` are read: what the perplexity is scored on, cut into chunks by the caller."""
    sep = tok.eos_token_id if tok.eos_token_id is not None else 0
    ids: list[int] = []
    for t in texts:
        ids += tok(t, add_special_tokens=False)["input_ids"] + [sep]
        if len(ids) >= tokens:
            break
    return ids


def _peak(dev) -> int | None:
    m = devices.memory(dev)
    return m.get("peak_allocated", m.get("driver_allocated"))


class _CausalTimer:
    """Prefill of the prompt and decode steps after it (batch 1), in rounds, through the engine
    `generate` runs (runtime/engine: static KV cache; on CUDA the decode step a CUDA graph,
    captured before the first round and timed apart). Every sample is one run of the engine's
    loop: the prefill alone (a one-token generation), then a generation whose steps are timed one
    by one, greedy."""

    def __init__(self, model, ids: torch.Tensor, opts: ValidateOptions, dev, use_compile: bool):
        self.opts, self.dev, self.compiled = opts, dev, use_compile
        self.engine = Engine(model, compile=use_compile)
        room = (
            opts.warmup + opts.decode_tokens + 2
        )  # a model of fewer positions gets a shorter prompt (the result's "tokens" says it)
        cap = self.engine.max_len - room if self.engine.max_len else opts.prefill_len
        self.prompt = ids[0, : max(1, min(opts.prefill_len, cap))].tolist()
        self.compile_seconds = self.engine.reserve(len(self.prompt) + opts.warmup + opts.decode_tokens + 2)
        self.prefill_rounds: list[list[float]] = []
        self.decode_rounds: list[list[float]] = []

    def round(self) -> None:
        opts = self.opts
        warm = opts.warmup if not self.prefill_rounds else 1
        runs = [
            generate_ids(self.engine, self.prompt, Sampling(max_tokens=1)).prompt_seconds
            for _ in range(warm + opts.repeats)
        ]
        self.prefill_rounds.append(runs[warm:])
        skip = opts.warmup if not self.decode_rounds else 0  # the first steps of a run warm up its caches
        with timing.warm_guards(self.compiled):  # the step is warm: only its differentiating guards run
            st = generate_ids(
                self.engine, self.prompt, Sampling(max_tokens=skip + opts.decode_tokens + 1), time_steps=True
            )
        self.decode_rounds.append(st.step_seconds[skip:])

    def result(self) -> dict:
        dec = timing.round_stats(self.decode_rounds)
        return {
            "prefill": timing.round_stats(self.prefill_rounds) | {"tokens": len(self.prompt)},
            "decode": dec
            | {
                "tokens": sum(map(len, self.decode_rounds)),
                "compile_seconds": self.compile_seconds,
                "tokens_per_s": 1e3 / dec["median_ms"] if dec["median_ms"] else None,
            },
        }


class _EncoderTimer:
    """One sequence of `prefill_len` tokens (batch 1) through the encoder, in rounds."""

    def __init__(self, model, batch: dict, opts: ValidateOptions, dev):
        self.model, self.batch, self.opts, self.dev = model, batch, opts, dev
        self.rounds: list[list[float]] = []

    def round(self) -> None:
        warm = self.opts.warmup if not self.rounds else 1
        with torch.no_grad():
            self.rounds.append(timing.wall_samples(lambda: self.model(**self.batch), self.dev, self.opts.repeats, warm))

    def result(self) -> dict:
        return {"prefill": timing.round_stats(self.rounds) | {"tokens": int(self.batch["input_ids"].shape[1])}}


def _latency(models: dict, make_timer, opts: ValidateOptions, dev, use_compile: bool, progress) -> dict:
    """Time every model in `opts.rounds` rounds. Without compilation the rounds alternate
    between the models (BF16, FP8, BF16, ...), so that a machine that speeds up or slows down
    during the run moves both, and the rounds' spread shows it. Compiled models are timed one
    after the other (each has its own CUDA graphs, and dynamo is reset between them)."""
    out = {}
    if not use_compile:
        timers = {name: make_timer(model) for name, model in models.items()}
        steps = opts.rounds * len(timers)
        progress("latency", 0, steps, f"round 1 of {opts.rounds}")
        for r in range(opts.rounds):
            for i, (name, timer) in enumerate(timers.items()):
                timer.round()
                progress("latency", r * len(timers) + i + 1, steps, f"round {r + 1} of {opts.rounds}, {name}")
        for name, timer in timers.items():
            out[name] = timer.result() | {"peak_memory_bytes": _peak(dev), "peak_memory_note": PEAK_NOTE}
        return out
    progress("latency", 0, len(models), "")
    for i, (name, model) in enumerate(models.items()):
        devices.empty_cache(dev)
        devices.reset_peak(dev)
        with devices.oom_hint(dev, f"timing the {name} model"):
            timer = make_timer(model)
            for _ in range(opts.rounds):
                timer.round()
        out[name] = timer.result() | {"peak_memory_bytes": _peak(dev), "peak_memory_note": PEAK_NOTE}
        del timer
        torch._dynamo.reset()
        progress("latency", i + 1, len(models), name)
    return out


def activations_rounded(decisions: list[dict], rows: int) -> dict | None:
    """For a scheme that quantizes activations: of the FP8 layers a forward of `rows` tokens runs,
    how many round the activations as the scheme says, and the kernels that ran the others with
    BF16 activations (weight-only arithmetic there, e.g. `dequant` on a device without FP8
    matmul: the accuracy measured is then better than the scheme's own rounding gives, as vLLM
    computes it). None for a weight-only scheme."""
    from ..ops.fp8linear import DECODE_MAX_M, PREFILL_BUCKETS, bucket_index
    from ..ops.kernels import ROUNDING

    if rows <= DECODE_MAX_M:
        hits = [d for d in decisions if d["activations"] and d["bucket"] == "decode"]
    else:  # the bucket a call of `rows` rows runs (CPU decides once for every length: M 0)
        hits = [
            d
            for d in decisions
            if d["activations"] and d["bucket"] == "prefill" and d["m"] in (0, PREFILL_BUCKETS[bucket_index(rows)])
        ]
    if not hits:
        return None
    return {
        "rows": rows,
        "layers": sum(d["layers"] for d in hits),
        "rounded": sum(d["layers"] for d in hits if d["choice"] in ROUNDING),
        "bf16_activation_kernels": sorted({d["choice"] for d in hits if d["choice"] not in ROUNDING}),
    }


def validate(artifact, opts: ValidateOptions, progress: Progress | None = None, *, record: bool = True) -> dict:
    """The artifact against its baseline (see the module's docstring); the run is recorded in the
    manifest when `opts.write` and `record` (False: the caller records it, with other records, in
    its own transaction: `put_run`)."""

    from ...manifests import loadable
    from ..load import held
    from ..load.load_report import model_bytes
    from ..load.loader import load

    artifact = Path(artifact)
    progress = or_silent(progress)
    dev = devices.choose(opts.device)
    gpu = dev.type != "cpu"  # CPU runs are slow (BF16 matmul is emulated on most CPUs): fewer, shorter samples
    opts = with_defaults(opts, gpu)
    use_compile = opts.compile == "on" or (opts.compile == "auto" and dev.type == "cuda")
    base_path = resolve_baseline(artifact, opts.baseline)
    check_baseline(artifact, base_path)
    texts, data_path = read_texts(opts.eval_data)
    progress("load fp8", 0, 1, str(artifact.name))
    # load verifies every file first (the tokenizer's included), so the tokenizer is read after it
    fp8_model = load(artifact, device=opts.device, kernel_cache=opts.kernel_cache)
    held.finish(fp8_model)  # a machine's first run: what is measured is the kernels the model keeps, once compiled
    tok = loadable.tokenizer(artifact)
    causal = definition.is_causal_lm(fp8_model.config)
    progress("load fp8", 1, 1, "")
    progress("load bf16", 0, 1, "")
    with devices.oom_hint(dev, "loading the BF16 baseline"):
        try:
            base_model = reference.load(
                base_path, dtype=torch.bfloat16, device=dev, task="causal-lm" if causal else "encoder"
            )
        except (
            OSError,
            ValueError,
            KeyError,
            TypeError,
            RuntimeError,
        ) as e:  # weights transformers cannot read: the baseline's problem
            raise SourceError(
                f"transformers cannot load the baseline {base_path}: "
                f"{str(e).splitlines()[0][:160] if str(e) else type(e).__name__}",
                "pass `baseline=<the model this artifact was made from>`",
            ) from e
    progress("load bf16", 1, 1, "")
    models = {"bf16": base_model, "fp8": fp8_model}
    result = {
        "kind": "causal-lm" if causal else "encoder",
        "device": str(dev),
        "device_name": devices.capabilities(dev).name,
        "torch": torch.__version__,
        "baseline": base_path,
        "eval_data": data_path,
        "settings": {
            k: v for k, v in asdict(opts).items() if k not in ("baseline", "eval_data", "kernel_cache", "full")
        }
        | {"compile": use_compile, "defaults": defaults_name(opts, gpu)},
        "scheme": fp8_model.mpsconvert.scheme,
        "weights": fp8_model.mpsconvert.weights,
        "kernels": fp8_model.mpsconvert.kernels,
        "dequantized_at_load": fp8_model.mpsconvert.dequantized,
        "weights_held": fp8_model.mpsconvert.weights_held,  # why "weights in memory" reads 1.0x on CPU
        "weight_bytes": {"bf16": model_bytes(base_model), "fp8": model_bytes(fp8_model)},
    }
    if causal:
        ids = eval_ids(tok, texts, opts.seq_len * opts.max_samples)
        n = min(opts.max_samples, len(ids) // opts.seq_len)
        if n == 0:
            raise MpsconvertError(
                f"the eval text has {len(ids)} tokens, fewer than `seq_len={opts.seq_len}`",
                "use more text or a smaller `seq_len`",
            )
        chunks = torch.tensor(ids[: n * opts.seq_len]).reshape(n, opts.seq_len)
        scores = metrics.CausalLMScores()
        progress("accuracy", 0, n, f"samples of {opts.seq_len} tokens")
        with torch.no_grad():
            for i in range(n):
                x = chunks[i : i + 1].to(dev)
                scores.update(base_model(x).logits, fp8_model(x).logits, x)
                progress("accuracy", i + 1, n, f"samples of {opts.seq_len} tokens")
        result["accuracy"] = scores.result()
        if (rounded := activations_rounded(result["kernels"], opts.seq_len)) is not None:
            result["accuracy"]["activations_rounded"] = rounded
        sample = chunks[:1].to(dev)
        if opts.latency and opts.prefill_len > opts.seq_len:
            sample = torch.tensor(ids[: opts.prefill_len])[None].to(dev)
    else:
        sents = [s.strip() for t in texts for s in t.split(". ") if len(s.strip()) > 20][: opts.max_samples * 8]
        order = sorted(range(len(sents)), key=lambda i: len(sents[i]))  # batches of similar length: little padding
        eb, ef = [None] * len(sents), [None] * len(sents)
        with torch.no_grad():
            for start in range(0, len(order), 8):
                idx = order[start : start + 8]
                batch = tok(
                    [sents[i] for i in idx],
                    padding=True,
                    truncation=True,
                    max_length=min(opts.seq_len, 256),
                    return_tensors="pt",
                ).to(dev)
                for out, model in ((eb, base_model), (ef, fp8_model)):
                    for i, e in zip(idx, metrics.mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])):
                        out[i] = e
        eb, ef = torch.stack(eb), torch.stack(ef)
        cos = metrics.cosine(eb, ef)
        result["accuracy"] = {"sentences": len(sents), "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min())}
        progress("accuracy", 1, 1, "")
    if opts.latency:
        if causal:
            make = lambda model: _CausalTimer(model, sample, opts, dev, use_compile)  # noqa: E731
        else:  # one sequence of --prefill-len tokens, batch 1, as a causal prefill is timed
            limit = getattr(fp8_model.config, "max_position_embeddings", None) or opts.prefill_len
            one = tok(
                " ".join(texts), truncation=True, max_length=min(opts.prefill_len, limit), return_tensors="pt"
            ).to(dev)
            make = lambda model: _EncoderTimer(model, dict(one), opts, dev)  # noqa: E731
        result["latency"] = _latency(models, make, opts, dev, use_compile, progress)
        lb, lf = result["latency"]["bf16"], result["latency"]["fp8"]
        phases = ("prefill", "decode") if causal else ("prefill",)
        result["speedup"] = {ph: lb[ph]["median_ms"] / lf[ph]["median_ms"] for ph in phases}
        result["verdict"] = {ph: timing.verdict(lb[ph], lf[ph]) for ph in phases}
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if opts.write and record:
        _record(artifact, result)
    return result


def _record(artifact: Path, result: dict) -> None:
    """Add the run to the manifest's `validation` record, keyed by device (one transaction: the
    card is re-rendered with it)."""
    from ...manifests.layout import MANIFEST_NAME
    from ...manifests.transaction import transaction

    if not (artifact / MANIFEST_NAME).is_file():
        result["recorded"] = None  # a checkpoint from another tool: nothing to write into
        return
    with transaction(artifact) as t:
        put_run(t, result)
    result["recorded"] = str(artifact / MANIFEST_NAME)


def put_run(t, result: dict) -> None:
    """Add the run `result` to the `validation` record of the open transaction `t`, keyed by device."""
    from ...manifests.records import Validation, ValidationRun

    rec = t.get(Validation) or Validation()
    rec.runs[f"{result['device_name']} ({result['device']})"] = ValidationRun.from_dict(result, "this validation")
    t.put(rec)
