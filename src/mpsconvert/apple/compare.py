"""Comparing an exported package's outputs with PyTorch, whatever runs the package (the Core AI
runtime, the Core ML reference evaluator, Core ML itself on macOS).

Two kinds of check. One-pass outputs (`sample_inputs`, `compare_outputs`, `merge_parts`): a
stateless package or an encoder run on a few samples, cosine and top-1 per position. And the
check every stateful decoder gets (`check_decoder`): prefill, teacher-forced decode through the
states, greedy generation.

A runner is anything with `new_conversation() -> step`, where `step(ids, position)` takes int32
ids `[1, T]` and the position of the first of them and returns the logits `[T, vocab]`, keeping
the KV cache in its states between calls (the Core AI runtime, the Core ML reference evaluator,
Core ML itself on macOS). The reference is PyTorch running the same architecture on the same
(dequantized) weights in fp32 over the whole sequence in one causal pass, no cache: position t's
logits are what a prefill or the decode step at t must give. Generation (the package's and the
reference's) and latency run through the runtime's one generation loop (runtime.engine), the
reference on the engine itself, as `mpsconvert generate` runs a model.

- prefill: one call with the first `prompt_len` tokens at position 0: cosine and top-1 agreement
  per position;
- teacher-forced decode: `steps` calls of one token each at positions prompt_len, prompt_len+1,
  ...: the token fed is the text's own next token (not the model's choice), so every step is
  compared with the reference at the same position (top-1 agreement per step, cosine);
- greedy generation: a new conversation, the prompt, then `generate` tokens each chosen by the
  package's own argmax; the reference generates greedily too, and the tokens are compared.

The prompt is real text through the artifact's tokenizer (the bundled English prose, or texts the
caller gives); an artifact without a tokenizer gets seeded random ids, and the result says so.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import MpsconvertError
from ..infra import timing
from .torch_model import TorchModel, reference_logits

PROMPT_LEN = 64
DECODE_STEPS = 32
GENERATE = 4
# What "agrees" means for an exported decoder against its fp32 PyTorch reference.
MIN_PREFILL_TOP1 = 0.98
MIN_DECODE_TOP1 = 0.95
MIN_COSINE = 0.99
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "spiece.model")
REFERENCE_NAME = "pytorch fp32 (source architecture, the artifact's FP8 weights dequantized; activations not quantized)"
# English sentences for the reference evaluation when no text is given (any real text works).
DEFAULT_TEXTS = (
    "The Eiffel Tower was built for the 1889 World's Fair in Paris and was at first criticised by many artists.",
    "Photosynthesis converts light energy into chemical energy that is stored in glucose and other sugars.",
    "In 1969 the Apollo 11 mission landed two astronauts on the Moon, and millions watched on television.",
)
# Agreement that counts as "the package computes the model" (fp16 compute vs fp32 reference).
MIN_TOP1 = 0.9  # one-pass outputs (stateless packages, encoders)

Step = Callable[[np.ndarray, int], np.ndarray]


def fit_to_cache(prompt_len: int, steps: int, generate: int, max_len: int) -> tuple[int, int]:
    """(prompt_len, steps) shortened so that every call stays inside a cache of `max_len`: the
    prompt gives way first (down to a quarter of the cache), then the decode steps."""
    need = max(steps, generate)
    if prompt_len + need <= max_len:
        return prompt_len, steps
    prompt = max(min(prompt_len, max_len // 4), max_len - need, 1)
    return prompt, min(steps, max_len - prompt)


@dataclass(frozen=True)
class DecodeCheck:
    """What `check_decoder` runs on a stateful package: a prefill of `prompt_len` tokens of real
    text (`texts`, default the bundled prose), `steps` teacher-forced decode steps, `generate`
    greedy tokens."""

    prompt_len: int = PROMPT_LEN
    steps: int = DECODE_STEPS
    generate: int = GENERATE
    texts: list[str] | None = None

    def run(self, new_conversation, artifact: Path, tm: TorchModel, max_len: int, progress=None) -> dict:
        """`check_decoder` of the runner, its prompt and steps fitted to a cache of `max_len`;
        `inputs` says which text the prompt is."""
        prompt_len, steps = fit_to_cache(self.prompt_len, self.steps, self.generate, max_len)
        ids, what = prompt_ids(artifact, tm, prompt_len + steps, self.texts)
        return check_decoder(new_conversation, tm, ids, prompt_len, steps, self.generate, progress) | {"inputs": what}


def builtin_prose() -> list[str]:
    """The English prose documents bundled with mpsconvert (also the default calibration text)."""
    from ..infra.texts import BUILTIN

    docs = [json.loads(line) for line in BUILTIN.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [d["text"] for d in docs if d.get("kind") == "prose"]


def prompt_ids(artifact: Path, tm: TorchModel, length: int, texts: list[str] | None = None) -> tuple[np.ndarray, str]:
    """`length` token ids of real text (documents joined until long enough), and what they are."""
    vocab = int(getattr(tm.config, "vocab_size", 100))
    if not any((Path(artifact) / f).is_file() for f in _TOKENIZER_FILES):
        ids = np.random.default_rng(0).integers(0, vocab, length)
        return ids.astype(np.int32), f"{length} seeded random token ids (the artifact has no tokenizer)"
    from ..manifests import loadable

    tok = loadable.tokenizer(artifact)
    docs = list(texts) if texts else builtin_prose()
    ids: list[int] = []
    used = 0
    for doc in docs:
        ids += tok(doc, add_special_tokens=not ids)["input_ids"]
        used += 1
        if len(ids) >= length:
            break
    if len(ids) < length:
        raise MpsconvertError(
            f"the text gives {len(ids)} tokens, the check needs {length}", "give a longer text, or fewer steps"
        )
    what = "bundled English prose" if not texts else "the given text"
    return np.asarray(
        ids[:length], dtype=np.int32
    ), f"{length} tokens of real text ({what}, {used} document(s)) through the artifact's tokenizer"


def _rows(got: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    got = got.astype(np.float64)
    ref = ref.astype(np.float64)
    cos = (got * ref).sum(-1) / np.maximum(np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1), 1e-30)
    return cos, got.argmax(-1) == ref.argmax(-1)


def _summary(cos: np.ndarray, top1: np.ndarray) -> dict:
    return {
        "positions": int(top1.size),
        "top1_agreement": float(top1.mean()),
        "cosine_min": float(cos.min()),
        "cosine_mean": float(cos.mean()),
    }


def stateful_runner(
    new_state: Callable, run: Callable, max_len: int | None = None, fix: str = "use fewer tokens"
) -> Callable[[], Step]:
    """`new_conversation()` over a stateful program, whatever runs it: `new_state()` once per
    conversation, `run(inputs, state)` -> its outputs once per step. Tokens past a KV cache of
    `max_len` are one error line (a runtime that does not bounds-check a state write would
    corrupt memory past it)."""
    from .stateful import OUTPUT_NAME

    def new_conversation():
        state = new_state()

        def step(ids: np.ndarray, position: int) -> np.ndarray:
            if max_len is not None and (position < 0 or position + ids.shape[1] > max_len):
                raise MpsconvertError(
                    f"tokens {position}..{position + ids.shape[1] - 1} do not fit the KV cache of {max_len}", fix
                )
            out = run(
                {"input_ids": np.asarray(ids, dtype=np.int32), "position": np.array([position], dtype=np.int32)}, state
            )
            return np.asarray(out[OUTPUT_NAME])[0]

        return step

    return new_conversation


def runner(new_conversation: Callable[[], Step], backend: str = "package", device: str = "cpu"):
    """A runner as a decoder of the runtime's one generation loop (runtime.engine.RunnerDecoder)."""
    from ..runtime.engine import RunnerDecoder

    return RunnerDecoder(new_conversation, None, backend, device)


def greedy(decoder, prompt: np.ndarray, n: int, on_token=None) -> list[int]:
    """`n` greedy tokens after `prompt` through the runtime's one generation loop (prefill, then
    one step per token), from any decoder: a package's runner, or the engine over PyTorch."""
    from ..runtime.engine import Sampling, generate_ids

    return generate_ids(decoder, [int(t) for t in prompt], Sampling(max_tokens=n), on_token=on_token).tokens


def greedy_reference(tm: TorchModel, prompt: np.ndarray, n: int) -> list[int]:
    """The reference's greedy continuation of `prompt`: the runtime's engine (eager, its KV cache)
    over the fp32 PyTorch model, as `mpsconvert generate` runs a model."""
    return greedy(torch_decoder(tm), prompt, n)


def check_decoder(
    new_conversation: Callable[[], Step],
    tm: TorchModel,
    ids: np.ndarray,
    prompt_len: int = PROMPT_LEN,
    steps: int = DECODE_STEPS,
    generate: int = GENERATE,
    progress=None,
) -> dict:
    """Prefill + teacher-forced decode + greedy generation of a runner against PyTorch.

    Args:
        new_conversation: returns a fresh `step(ids [1, T] int32, position) -> logits [T, vocab]`.
        tm: the PyTorch model (the reference).
        ids: at least prompt_len + steps token ids.
        progress: `progress(phase, done, total, detail)` or None.

    Returns:
        {"prefill", "decode", "generation", "decode_step_ms", "ok"}; decode has per-step top-1.
    """
    if len(ids) < prompt_len + steps:
        raise MpsconvertError(f"the check needs {prompt_len + steps} tokens, got {len(ids)}", "give a longer text")
    ids = np.asarray(ids[: prompt_len + steps], dtype=np.int32)
    ref = reference_logits(tm, ids)
    report = progress or (lambda *a: None)
    step = new_conversation()
    t0 = time.perf_counter()
    pre = step(ids[None, :prompt_len], 0)
    prefill_s = time.perf_counter() - t0
    cos_p, top_p = _rows(pre, ref[:prompt_len])
    rows, times = [], []
    for i in range(steps):
        p = prompt_len + i
        t0 = time.perf_counter()
        out = step(ids[None, p : p + 1], p)
        times.append(time.perf_counter() - t0)
        rows.append(out[-1])
        report("decode check", i + 1, steps + generate, f"teacher-forced step {i + 1}/{steps}")
    cos_d, top_d = _rows(np.stack(rows), ref[prompt_len:])
    # greedy generation: a new conversation, the prompt, then the package's own choices
    made = []

    def on_token(tok: int) -> None:
        made.append(tok)
        report("decode check", steps + len(made), steps + generate, f"greedy token {len(made)}/{generate}")

    tokens = greedy(runner(new_conversation), ids[:prompt_len], generate, on_token)
    want = greedy_reference(tm, ids[:prompt_len], generate)
    same = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), generate)
    prefill = _summary(cos_p, top_p)
    decode = _summary(cos_d, top_d) | {"per_step_top1": [bool(x) for x in top_d]}
    generation = {"tokens": tokens, "reference_tokens": want, "agree": tokens == want, "agreeing_prefix": same}
    ok = (
        prefill["top1_agreement"] >= MIN_PREFILL_TOP1
        and decode["top1_agreement"] >= MIN_DECODE_TOP1
        and min(prefill["cosine_min"], decode["cosine_min"]) >= MIN_COSINE
    )
    lat = timing.stats(times)
    return {
        "prompt_len": prompt_len,
        "steps": steps,
        "prefill": prefill | {"seconds": round(prefill_s, 4)},
        "decode": decode,
        "generation": generation,
        "decode_step_ms": {"median": round(lat["median_ms"], 3), "p95": round(lat["p95_ms"], 3), "n": lat["n"]},
        "thresholds": {"prefill_top1": MIN_PREFILL_TOP1, "decode_top1": MIN_DECODE_TOP1, "cosine": MIN_COSINE},
        "ok": bool(ok),
    }


# --------------------------------------------------------------------------- latency


def decode_timing(decoder, prompt: np.ndarray, tokens: int, warmup: int, prefill_repeats: int = 3) -> dict:
    """Latency of a decoder (`runner(...)` of a package, or `torch_decoder`) as an app sees it,
    through the runtime's one generation loop and its timer: the prefill of `prompt` (a fresh
    conversation each time: one untimed when `warmup` > 0, then `prefill_repeats` timed; median
    and p95), then in the last conversation `tokens` greedy single-token steps after `warmup`
    untimed ones, each step timed with the device synchronised (median, p95, tokens/s)."""
    from ..runtime.engine import Sampling, generate_ids

    ids = [int(t) for t in prompt]
    if warmup:
        generate_ids(decoder, ids, Sampling(max_tokens=1))
    prefills = [
        generate_ids(decoder, ids, Sampling(max_tokens=1)).prompt_seconds for _ in range(max(1, prefill_repeats) - 1)
    ]
    last = generate_ids(decoder, ids, Sampling(max_tokens=warmup + tokens + 1), time_steps=True)
    prefills.append(last.prompt_seconds)
    if len(last.step_seconds) < warmup + tokens:
        raise MpsconvertError(
            f"the decoder stopped after {last.generated_tokens} tokens ({last.stop}), the timing "
            f"needs {warmup + tokens + 1}",
            "time fewer tokens, or re-export with a larger `max_len`",
        )
    pre, st = timing.stats(prefills), timing.stats(last.step_seconds[warmup:])
    return {
        "prefill_tokens": len(prompt),
        "prefill_ms": round(pre["median_ms"], 3),
        "prefill_p95_ms": round(pre["p95_ms"], 3),
        "prefill_runs": pre["n"],
        "decode_tokens": tokens,
        "decode_median_ms": round(st["median_ms"], 3),
        "decode_p95_ms": round(st["p95_ms"], 3),
        "decode_tokens_per_s": round(1e3 / st["median_ms"], 3),
    }


def torch_decoder(tm: TorchModel, device: str = "cpu", dtype=None):
    """PyTorch's own path beside a package: the runtime's engine, eager (its KV cache, no graph),
    over the artifact's model with its weights dequantized, moved to `device` / `dtype` (fp32 on
    the CPU by default)."""
    import torch

    from ..runtime.engine import Engine

    dev = torch.device(device)
    model = tm.model.to(dev, dtype) if dtype is not None else tm.model.to(dev)
    return Engine(model, compile=False)


# --------------------------------------------------------------------------- one-pass outputs


def sample_inputs(
    artifact: Path, tm, seq: dict, texts=DEFAULT_TEXTS, n: int = 3
) -> tuple[list[tuple[np.ndarray, ...]], str]:
    """Inputs shaped for the package, and what they are. Real text through the artifact's
    tokenizer: fixed length -> cut or padded (padding masked for encoders; LM text repeated to
    fill); a range -> natural lengths clipped to it. An artifact without a tokenizer (tiny test
    models) gets seeded random token ids, and the returned description says so."""
    from ..manifests import loadable

    lo, hi = seq["min"], seq["max"]
    tok = None
    if any((Path(artifact) / f).is_file() for f in _TOKENIZER_FILES):
        tok = loadable.tokenizer(artifact)
    out = []
    rng = np.random.default_rng(0)
    vocab = int(getattr(tm.config, "vocab_size", 100))
    for i in range(n):
        if tok is None:
            length = hi if lo == hi else int(rng.integers(lo, hi + 1))
            ids = rng.integers(0, vocab, length).tolist()
        else:
            ids = tok(texts[i % len(texts)], add_special_tokens=tm.task == "encoder")["input_ids"]
        if tm.task == "causal-lm":
            while len(ids) < lo:
                ids = ids + ids
            out.append((np.array([ids[:hi]], dtype=np.int32),))
        else:
            ids = ids[:hi]
            mask = [1] * len(ids)
            pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
            while len(ids) < lo:
                ids.append(pad)
                mask.append(0)
            if tok is None and len(ids) > 2 and i % 2 == 1:  # exercise masking: pad the tail
                mask[-(len(ids) // 3) :] = [0] * (len(ids) // 3)
            out.append((np.array([ids], dtype=np.int32), np.array([mask], dtype=np.int32)))
    what = (
        f"{n} real text sample(s) through the artifact's tokenizer"
        if tok is not None
        else f"{n} seeded random token id sample(s) (the artifact has no tokenizer)"
    )
    return out, what


def compare_outputs(task: str, got: np.ndarray, ref: np.ndarray) -> dict:
    got = got.astype(np.float64).reshape(-1, got.shape[-1])
    ref = ref.astype(np.float64).reshape(-1, ref.shape[-1])
    cos = (got * ref).sum(-1) / np.maximum(np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1), 1e-30)
    out = {
        "cosine_min": float(cos.min()),
        "cosine_mean": float(cos.mean()),
        "max_abs_diff": float(np.abs(got - ref).max()),
        "ref_max_abs": float(np.abs(ref).max()),
    }
    if task == "causal-lm":
        out["top1_agreement"] = float(np.mean(got.argmax(-1) == ref.argmax(-1)))
        out["positions"] = int(got.shape[0])
    return out


def merge_parts(task: str, parts: list[dict]) -> dict:
    out = {
        "cosine_min": min(p["cosine_min"] for p in parts),
        "cosine_mean": float(np.mean([p["cosine_mean"] for p in parts])),
        "max_abs_diff": max(p["max_abs_diff"] for p in parts),
        "samples": len(parts),
    }
    if task == "causal-lm":
        n = sum(p["positions"] for p in parts)
        out["top1_agreement"] = sum(p["top1_agreement"] * p["positions"] for p in parts) / n
        out["positions"] = n
    out["ok"] = out["cosine_min"] >= MIN_COSINE and out.get("top1_agreement", 1.0) >= MIN_TOP1
    return out
