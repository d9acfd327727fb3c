"""The engine: a transformers causal LM as a decoder with a KV cache made once per generation, a
prefill and a decode step, replayed as one CUDA graph on CUDA and eager elsewhere.

Three decode paths (`decode_path` picks one; `Engine.decode_report` says which ran and what it
cost, and `generate --json` prints it as `decode`):

- "graph" (the default on CUDA: CUDA_DEFAULT; `compile="graph"`, `generate --decode graph`): the
  eager decode step (the model's forward over a preallocated static cache, the FP8 Triton GEMVs
  and our attention as they run eagerly) captured once with `torch.cuda.graph` and replayed per
  token (`CapturedStep`). No Dynamo and no Inductor: the capture costs a few eager steps (0.4 s on
  the H100), where torch.compile costs 30-50 s in every new process (Inductor's on-disk caches
  warm or not: the tracing itself is what costs). The replay is checked against the eager step at
  positions the capture never saw, over a cache with a history (a graph that had frozen a
  position on the host would differ there); a capture or a check that fails warns, names the
  eager path that runs instead, and `decode_report["fallback"]` keeps why.
- "compile" (`compile=True`, `generate --decode compile`): `torch.compile(mode="reduce-overhead")`
  of the same step (Inductor folds the norms into the GEMVs and merges small kernels; see
  INDUCTOR_OPTIONS): 297 against 262 tok/s on the H100 for 2048 tokens of the Llama-3-8B shape
  (0.75 against 0.66 of copy bandwidth), for 34 s of compile in every process, which it saves back
  only past ~75,000 tokens in one generation.
- "eager" (CPU, MPS, `compile=False`, `--no-compile`): the forward per token, over a DynamicCache.

The static cache (`reserve`: rounded up to BUCKET positions) makes a step allocate nothing and
keep its tensors' addresses, so the step is captured once and replayed per token. It is captured
(or compiled) in `reserve`, before the generation's timer starts, on a scratch step of the cache
(reset after), and the seconds it took are reported apart (`compile_seconds`, and
`decode_report["seconds"]`). The prefill runs eager: on the
H200 the eager prefill measured faster than the compiled one (docs/benchmarks.md: 30.2 vs
31.0 ms for 2048 tokens of the Llama-3-8B shape), so no length compiles it. It runs over an
empty DynamicCache, whose keys and values are then written into the static cache (its public
`update`): the eager prefill's direct path (runtime/patches/attention_prefill.py) takes a
DynamicCache only, and attends over the prompt's own keys, not the padded cache.

Eager (CPU, MPS, `compile=False`) the cache is transformers' DynamicCache, made once per
generation: without a graph a static cache saves no host work (its update is one Python call
per layer too) and costs device work, since every step then attends over the whole padded cache
through an explicit mask (SDPA's masked path on CPU: a profile of a 2-layer model spent half of
each step there), where a dynamic cache attends over the tokens so far with no mask. Per token
the eager step is the model's forward and nothing else: the token is written into one
preallocated tensor, and the positions are a view of the model's own position buffer
(runtime/patches/positions.py), so the rotary module reads its tables instead of computing them
and the host never asks the device how long the cache is.
"""

from __future__ import annotations

import time
import warnings

import torch

from ...errors import MpsconvertError
from ...infra import devices, timing
from ...model.hf_compat import accepts, cache_kwarg, rewind_cache, static_cache_compiles, write_at
from ..ops.graph_fusion import FUSION

BUCKET = 256  # cache lengths are multiples of this: a longer generation re-captures the graph only past a bucket
WARM_STEPS = 3  # calls of the compiled step before it replays a captured graph (compile, record, capture)
# Inductor options the decode step is compiled with (those this torch has). combo_kernels: small
# kernels that do not depend on each other run as one launch. A layer's rotary of q and k and its
# writes of k and v into the static cache are four kernels of ~1.2 us each; on an H100 (Llama-3-8B
# shape, 32 layers) they take the step from 424 to 332 launches and 259.0 to 267.3 tok/s
# (benchmarks/results/generate_cuda_h100_llama32_combo.log). They are not Inductor's defaults: where
# compiling with them fails, `reserve` warns and compiles with torch's defaults.
# post_grad_custom_pre_pass: the RMSNorms and residual adds around the decode GEMVs folded into
# them (ops/graph_fusion.py), two kernels per layer fewer.
INDUCTOR_OPTIONS = {"combo_kernels": True, "post_grad_custom_pre_pass": FUSION}


def inductor_options(options: dict):
    """A context in which torch.compile compiles with these Inductor options (those this torch knows)."""
    import torch._inductor.config as config

    return config.patch({k: v for k, v in options.items() if hasattr(config, k)})


def compiles_by_default(device: torch.device) -> bool:
    """The decode step is a CUDA graph by default on CUDA only (no graphs elsewhere)."""
    return device.type == "cuda"


DECODE_PATHS = ("graph", "compile", "eager")
# The path "auto" runs on CUDA. The graph path: a one-shot `generate -m 256` on the H100 (Llama-3-8B
# shape) 26.3 s of process wall time against 45.1 s for the BF16 transformers script, where compile
# costs 34 s before the first token (docs/decisions/2026-12-07-graph-is-the-cuda-decode-default.md).
CUDA_DEFAULT = "graph"


def decode_path(device: torch.device, compile: bool | str | None = None) -> str:
    """The decode path an Engine on `device` runs for `compile`: None or "auto": CUDA_DEFAULT on
    CUDA, "eager" elsewhere; True or "compile": torch.compile (~30 s per process on the H100);
    "graph": the eager step captured as a CUDA graph (seconds; off CUDA its capture fails and the
    eager loop runs, with a warning); False or "eager": the eager loop."""
    if compile is None or compile == "auto":
        return CUDA_DEFAULT if compiles_by_default(device) else "eager"
    if compile is True or compile == "compile":
        return "compile"
    if compile is False or compile == "eager":
        return "eager"
    if compile == "graph":
        return "graph"
    raise MpsconvertError(f"unknown decode path {compile!r}", f"use one of: auto, {', '.join(DECODE_PATHS)}")


# How far the captured step's logits may lie from the eager step's: the RMS of the difference over
# the RMS of the eager logits. The same kernels on the same inputs give the same bits; the margin is
# for a library that picks another algorithm under capture (cuBLAS for the BF16 head: a BF16
# rounding flipped here and there, ~0.1%). A graph that froze a position on the host differs by
# far more in a trained or 32-layer model: its rotary angles or its mask are another position's.
GRAPH_TOLERANCE = 1e-2
CHECK_HISTORY = 3  # eager steps written before the check's position: the attention must read a history


class CapturedStep:
    """`fn()` captured once as a CUDA graph on `dev`; `replay()` runs its kernels again on the same
    buffers and returns its output (the same tensor every time, overwritten by each replay).

    Before the capture `fn` runs `warm` times on a side stream (as torch.cuda.graphs' docs ask):
    Triton compiles and autotunes there, and every lazily made buffer is made outside the graph's
    pool. `capture_error_mode="thread_local"`: another thread's CUDA calls (the load's warm-up) do
    not break the capture. Off CUDA it refuses (MpsconvertError), and the engine runs eagerly."""

    def __init__(self, fn, dev: torch.device, warm: int = WARM_STEPS):
        if dev.type != "cuda":
            raise MpsconvertError(
                f"a CUDA graph needs a CUDA device, not {dev}", "run the eager loop (`compile=False`)"
            )
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(warm):
                fn()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = fn()
        torch.cuda.synchronize(dev)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class Engine:
    """A transformers causal LM (as `runtime.load` returns it) as one conversation at batch 1."""

    backend = "torch"

    def __init__(self, model, *, compile: bool | str | None = None, static: bool | None = None):
        self.model = model
        self.static = static  # None: a static cache where the step is compiled, else a dynamic one (see reset)
        self.dev = next(model.parameters()).device
        self.device = str(self.dev)
        self.path = decode_path(
            self.dev, compile
        )  # what decodes: "graph", "compile" or "eager" (decode_path; a fallback moves it)
        self.asked = self.path  # what was asked (decode_report tells a fallback from a choice)
        self.compiled = self.path != "eager"  # a captured graph replays the step (captured eager, or torch.compile's)
        self.fallback: str | None = None  # why the asked path did not run, where it did not
        self.setup_seconds: float | None = None  # what capturing or compiling the step cost (the last reserve that did)
        self._graph: CapturedStep | None = None
        self.graph_check: dict | None = (
            None  # the last capture's check: its position, the RMS of the difference and of the logits
        )
        self.max_len = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self.keep = {"logits_to_keep": 1} if accepts(model, "logits_to_keep") else {}
        self.capacity, self.cache, self.kw, self._step, self._static = 0, None, {}, None, False
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=self.dev)
        self.pos = 0
        self.writes_at = (
            None  # a static cache's layers write at: "position" (the engine's), "counter" (their own); see reserve
        )
        self.inductor_options = dict(
            INDUCTOR_OPTIONS
        )  # what the step is compiled with ({} once they failed: see reserve)
        self.graph_fusion = None  # what the last compile folded into the decode GEMVs (ops/graph_fusion.py)

    def reserve(self, tokens: int) -> float | None:
        """A static cache for at least `tokens` (rounded up to BUCKET, at most max_len); the
        compiled step captured for it. Returns the seconds compiling took, None when nothing was
        compiled now."""
        held = self.model.__dict__.get("mpsconvert_held")  # runtime/load/held.py: a machine's first run
        if held is not None and held.take_if_ready():
            self.capacity = 0  # the step was captured with torch's kernels: captured again with ours
        if tokens <= self.capacity:
            return None
        from transformers import DynamicCache, StaticCache

        cap = -(-tokens // BUCKET) * BUCKET
        cap = min(cap, self.max_len) if self.max_len else cap
        self._static = self.compiled if self.static is None else self.static
        self.cache = (
            StaticCache(config=self.model.config, max_cache_len=cap)
            if self._static
            else DynamicCache(config=self.model.config)
        )
        # the step's position, 0-d: the static cache's layers write there (hf_compat.write_at), set before each forward
        self.pos_t = torch.zeros((), dtype=torch.long, device=self.dev)
        self.writes_at = (
            "position"
            if self._static and write_at(self.cache, self.pos_t, cap)
            else "counter"
            if self._static
            else None
        )
        self.kw = cache_kwarg(self.model, self.cache)
        self.capacity = cap
        own = getattr(
            getattr(self.model, "base_model", None), "mpsconvert_positions", None
        )  # runtime/patches/positions.py
        self.positions = own if own is not None and own.shape[-1] >= cap else torch.arange(cap, device=self.dev)[None]
        if self.compiled and not static_cache_compiles(self.cache):
            warnings.warn(
                "the decode step runs eagerly: this model's sliding-window cache layers keep their length in a Python "
                f"int, which a captured CUDA graph cannot follow past the window ({cap} positions reserved)",
                stacklevel=2,
            )
            self.compiled, self.path = False, "eager"
            self.fallback = f"{self.asked}: a sliding-window cache layer keeps its length in a Python int"
        if not self.compiled:
            return None
        with torch.no_grad():  # transformers' StaticCache makes its tensors at its first update: made here, eager, they
            self.pos_t.fill_(cap - 1)  # live outside the CUDA graph's pool (made inside it, the next replay overwrites
            self._decode(
                self.tok, self.pos_t
            )  # them under the prefill's writes; seen on the H200: "overwritten by a subsequent run")
        t = time.perf_counter()
        if self.path == "graph":
            self._capture(cap)
        else:
            try:
                self._compile(cap)
            except Exception as e:  # Inductor failed with its non-default options: torch's defaults, and said so
                if not self.inductor_options:
                    raise
                warnings.warn(
                    f"the decode step failed to compile with Inductor's {self.inductor_options} "
                    f"({type(e).__name__}: {str(e)[:200]}); compiled with torch's defaults instead "
                    "(a few more kernel launches per token)",
                    stacklevel=2,
                )
                self.inductor_options = {}
                self._compile(cap)
        self.cache.reset()
        self.setup_seconds = time.perf_counter() - t
        return self.setup_seconds

    def _capture(self, cap: int) -> None:
        """Capture the eager step as a CUDA graph (CapturedStep) and check it against the eager
        step (`_check_graph`); where either fails, warn and decode eagerly over the static cache
        (the path and why are in `decode_report`)."""
        self._graph = None  # an earlier cache's graph holds that cache's addresses
        self._step = None
        try:
            with torch.no_grad():
                self.pos_t.fill_(cap - 1)
                graph = CapturedStep(lambda: self._decode(self.tok, self.pos_t), self.dev)
                why = self._check_graph(graph, cap)
        except Exception as e:  # a capture the eager code does not allow (a host read of a device value, say)
            why = f"capturing it failed ({type(e).__name__}: {str(e)[:200]})"
        if why is None:
            self._graph = graph
            return
        self.compiled, self.path, self.fallback = False, "eager", f"graph: {why}"
        warnings.warn(
            f"the decode step runs eagerly (several times slower per token on CUDA): as a CUDA graph {why}; "
            "`--decode compile` compiles it with torch.compile instead",
            stacklevel=3,
        )

    def _check_graph(self, graph: CapturedStep, cap: int) -> str | None:
        """Why the captured step cannot replace the eager one, or None: at a position the capture did not see (the
        middle of the cache), after CHECK_HISTORY eager steps before it, the replay's logits must equal the eager step's
        there (the RMS of the difference at most GRAPH_TOLERANCE of the logits' RMS). Both write the same keys and
        values at that position; the cache is reset after."""
        if cap < CHECK_HISTORY + 2:
            return None  # no room for a history (a cache this small is never made: BUCKET)
        at = cap // 2
        vocab = int(getattr(self.model.config, "vocab_size", 0) or 0) or 2
        for i in range(CHECK_HISTORY):  # a history of other tokens at the positions before
            self.tok.fill_((7 * i + 1) % vocab)
            self.pos_t.fill_(at - CHECK_HISTORY + i)
            self._decode(self.tok, self.pos_t)
        self.tok.fill_(3 % vocab)
        self.pos_t.fill_(at)
        want = self._decode(self.tok, self.pos_t)[0, -1].float().clone()
        got = graph.replay()[0, -1].float()
        scale = float(want.square().mean().sqrt())
        err = float((got - want).square().mean().sqrt())
        self.tok.zero_()
        self.graph_check = {"position": at, "rms_diff": err, "rms_logits": scale}
        if not (err == err and scale == scale) or err > GRAPH_TOLERANCE * max(scale, 1e-6):
            return (
                f"its replay differs from the eager step at position {at}: RMS {err:.3g} against the logits' RMS "
                f"{scale:.3g}"
            )
        return None

    @property
    def decode_report(self) -> dict:
        """Which decode path runs ("graph", "compile", "eager"), which was asked, what setting it up
        cost in its last reserve (seconds; None: nothing was set up), and why the asked one did not
        run (None where it did)."""
        held = self.model.__dict__.get("mpsconvert_held")
        return {
            "path": self.path,
            "asked": self.asked,
            "seconds": None if self.setup_seconds is None else round(self.setup_seconds, 3),
            "fallback": self.fallback,
            **({"check": self.graph_check} if self.graph_check is not None else {}),
            **({"kernels": held.NOTE} if held is not None else {}),
        }

    def _compile(self, cap: int) -> None:
        """Compile the decode step and capture its graph: a few scratch steps at the last position
        (forgotten by the cache's reset), the first of which compiles under `inductor_options`."""
        torch._dynamo.reset()  # graphs of an earlier cache (or a failed compile) hold their addresses
        self._step = torch.compile(self._decode, mode="reduce-overhead", fullgraph=False, dynamic=False)
        FUSION.reset()
        with torch.no_grad(), inductor_options(self.inductor_options):
            for _ in range(WARM_STEPS):
                self.pos_t.fill_(cap - 1)
                self._step(self.tok, self.pos_t)
        devices.synchronize(self.dev)
        ran = FUSION.counts if self.inductor_options.get("post_grad_custom_pre_pass") is FUSION else {"graphs": 0}
        # what ops/graph_fusion.py folded into the decode GEMVs; None where no graph passed through it (Inductor's cache
        # on disk)
        self.graph_fusion = {k: v for k, v in ran.items() if k != "graphs"} if ran["graphs"] else None

    def _decode(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tok, position_ids=pos.view(1, 1), use_cache=True, **self.kw).logits

    def reset(self) -> None:
        if self._static:
            self.cache.reset()
        elif self.cache is not None:  # a dynamic cache starts empty (one allocation per generation)
            from transformers import DynamicCache

            self.cache = DynamicCache(config=self.model.config)
            self.kw = cache_kwarg(self.model, self.cache)
        self.pos = 0

    def prefill(self, ids: list[int]) -> torch.Tensor:
        n = len(ids)
        if self.pos + n + 1 > self.capacity:
            if self.pos:
                raise MpsconvertError(
                    f"the cache holds {self.capacity} tokens, {self.pos + n + 1} are needed",
                    "call reserve() with the whole conversation's length before its first prefill",
                )
            self.reserve(n + 1)
        x = torch.tensor([ids], dtype=torch.long, device=self.dev)
        pos = self.positions[:, self.pos : self.pos + n]
        with torch.no_grad():
            if self._static:
                self.pos_t.fill_(self.pos)  # where the static cache's layers write (the prompt's first position)
            if self._static and self.pos == 0:  # prefilled over an empty DynamicCache, then written into the static one
                from transformers import DynamicCache

                dyn = DynamicCache(config=self.model.config)
                out = self.model(
                    input_ids=x, position_ids=pos, use_cache=True, **cache_kwarg(self.model, dyn), **self.keep
                ).logits
                for i, layer in enumerate(dyn.layers):
                    self.cache.update(layer.keys, layer.values, i)
            else:
                out = self.model(input_ids=x, position_ids=pos, use_cache=True, **self.kw, **self.keep).logits
        self.pos += n
        return out[0, -1]

    @property
    def pipelined(self) -> bool:
        """Whether the loop may start a step before the host has read the token it takes
        (`step_chosen`), and take back a step it did not need (`rewind`): on CUDA with a static
        cache, where a step's host work (the graph's launch, torch.compile's per-call checks:
        ~1 ms on the H200 host) then overlaps the previous step's device work instead of
        following it. A dynamic cache cannot take a step back."""
        return bool(self._static) and self.dev.type == "cuda"

    def step(self, token: int) -> torch.Tensor:
        """One token in, the next position's logits out: the captured graph on CUDA, the model's
        forward with a view of the position buffer elsewhere."""
        self.tok.fill_(token)
        return self._step_tok()

    def step_chosen(self, chosen: torch.Tensor) -> torch.Tensor:
        """`step` with the token as a 0-d tensor on the device (the last step's choice), which the
        host never waits for."""
        self.tok.copy_(chosen.view(1, 1))
        return self._step_tok()

    def rewind(self, steps: int = 1) -> None:
        """Forget the last `steps` steps (a static cache: their entries lie past the position,
        where the next step or prefill writes over them, and the mask never reads them; the
        cache's own write counters move back with the position: hf_compat.rewind_cache)."""
        if not self._static or steps > self.pos:
            raise MpsconvertError("only a static cache's steps can be taken back", "use the loop without pipelining")
        rewind_cache(self.cache, steps)
        self.pos -= steps

    def _step_tok(self) -> torch.Tensor:
        with torch.no_grad():
            if self._graph is not None:
                self.pos_t.fill_(self.pos)
                logits = self._graph.replay()
            elif self._step is not None:
                self.pos_t.fill_(self.pos)
                with timing.warm_guards(True):  # captured in reserve(): only the guards that tell graphs apart run
                    logits = self._step(self.tok, self.pos_t)
            else:
                if self._static:
                    self.pos_t.fill_(self.pos)
                logits = self._decode(self.tok, self.positions[:, self.pos : self.pos + 1])
        self.pos += 1
        return logits[0, -1]

    def sync(self) -> None:
        devices.synchronize(self.dev)
