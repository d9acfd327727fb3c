"""The first-use costs of a fresh process, paid while the shards are still being read (CUDA).

Why: in a new process the first call of each library and kernel costs far more than the call:
Triton loads its driver, launcher and each kernel's binary, cuBLASLt and cuDNN load their
kernels and build plans, and the first prefill-sized call of each is where that lands. At load
that is eager_fusion.install's probe forward and checks: on the H200, 1.4 s in a second process
against 0.3 s in a process that had run them before (Llama-3-8B shape; the load's reading takes
~3 s, docs/runtime-notes.md). Here a thread makes the same kinds of calls (the activation
quantization, fused norm, SiLU*up and rotary kernels, the FP8 GEMMs of each layer shape, SDPA)
on scratch tensors of the model's sizes, and compiles and autotunes the Triton decode kernels the
kernel policy will time (GEMV, W8A8 GEMV, split-K GEMV: 37 configurations, compiled on a thread
pool, then timed per layer shape by their autotuners), while the main thread reads, hashes and copies the
shards (mostly waiting on the disk, hashlib and copies, which release the GIL); `join` waits for
it before the kernel policy and the fusion run. The thread starts with the load, before the model
is known, with Triton's own first use (its driver and the C launcher it builds: 6-8 s on a fresh
H100 host), paid while the manifest is verified and the model built; `begin` then gives it the
model's shapes (on the H100 the warm-up took 20 s of a 38.9 s cold load, 12 s of it waited for,
when it started only once the model was built). Where the machine has cores to spare, a child
process does the same work first, from the artifact's own description, so that this thread finds
the kernels compiled and timed in Triton's caches (prewarm_child.py).

Nothing here is used afterwards but the caches the calls fill (Triton's kernels and our direct
launches of them, the libraries' loaded kernels and plans); the scratch values are never read.
A call that fails is listed in the report and skipped: the install that follows makes the real
calls and checks them itself, so a warm-up can only save time, never change a result.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Callable

import torch
import torch.nn.functional as F

from ...format.scales import Granularity, scale_shape
from ...format.schemes import Activations
from ...infra.child import Child
from ..ops.fp8linear import PROBE_ROWS, signature
from ..ops.fuse import SIBLINGS
from ..ops.triton import tuned

# How long the warm-up waits for its child once the model is known (then it does the work itself)
CHILD_WAIT_S = 120.0
# How long the interpreter's exit waits for a warm-up thread to finish the step it is in
EXIT_WAIT_S = 60.0


def _shapes(linears: dict[str, tuple[int, int]]) -> tuple[set, set]:
    """((N, K) of every FP8 GEMM the loaded model will run, sibling groups summed as fuse.py
    fuses them), and the widths of the gate/up outputs that SiLU*up reads."""
    gemms, gated = set(), set()
    taken = set()
    parents = {n.rpartition(".")[0] for n in linears}
    for parent in parents:
        for names in SIBLINGS:
            keys = [f"{parent}.{n}" if parent else n for n in names]
            if all(k in linears for k in keys) and len({linears[k][1] for k in keys}) == 1:
                n = sum(linears[k][0] for k in keys)
                gemms.add((n, linears[keys[0]][1]))
                taken.update(keys)
                if len(names) == 2:
                    gated.add(n)
    gemms.update(v for k, v in linears.items() if k not in taken)
    return gemms, gated


def signatures(linears: dict[str, tuple[int, int]], decode: tuple) -> list[tuple]:
    """The kernel policy's signatures (fp8linear.signature) of the GEMMs `_shapes` finds, for
    decode kernels `decode` (job_of's third): what `policy.decided_before` is asked about."""
    return [signature(n, k, *decode) for n, k in sorted(_shapes(linears)[0])]


def job_of(scheme) -> tuple[int, bool, tuple]:
    """What `Prewarm.begin` takes besides the model for an artifact of `scheme`: the rows of the
    fusion's probe, whether the prefill GEMMs are row-wise scaled (per-token activations, per-row
    weights), and the decode kernels' (weight granularity, activation scheme, block edge)."""
    rowwise = scheme.activations is Activations.TOKEN and scheme.weights is Granularity.ROW
    return PROBE_ROWS, rowwise, (str(scheme.weights), scheme.activations, scheme.block)


def _heads(config):
    hq = getattr(config, "num_attention_heads", None)
    hk = getattr(config, "num_key_value_heads", None) or hq
    hidden = getattr(config, "hidden_size", None)
    hd = getattr(config, "head_dim", None) or (hidden // hq if hidden and hq else None)
    return (hq, hk, hd) if isinstance(hq, int) and isinstance(hk, int) and isinstance(hd, int) else None


def _decode_kernels(
    n: int,
    k: int,
    weights: str,
    activations,
    block: int | None,
    dtype: torch.dtype,
    dev: torch.device,
    gated: bool = False,
    fused: tuple = (),
    qkv_heads: tuple | None = None,
) -> None:
    """Compile every configuration of the Triton decode kernels for an n x k layer (several at
    once), then call each once, so that its autotuner times them here rather than in the policy;
    with `gated` (a gated MLP's fused gate/up) their gated forms too (kernels.GATED), which the
    fusion's install check calls first. Where the GEMV is a candidate, also its `fused` forms
    (gemv.precompile's keywords) and with `qkv_heads` (hq, hk, d) of a [q; k; v] layer its rotary
    form: what the direct decode runs (runtime/patches/direct_decode.py), compiled here rather
    than in its install check."""
    from ...format.fp8 import FP8_DTYPE
    from ..ops import kernels
    from ..ops.fp8linear import FP8Linear
    from ..ops.triton import gemv, qkv_rotary
    from ..ops.triton import moe_gemv as experts

    scale = (
        torch.ones(scale_shape("block", n, k, block), device=dev)
        if block
        else torch.ones(n if weights == "row" else 1, 1, device=dev)
    )
    layer = FP8Linear.from_tensors(
        torch.zeros(n, k, dtype=FP8_DTYPE, device=dev),
        scale,
        activations=activations,
        dtype=dtype,
        input_scale=torch.ones(1, device=dev) if activations == "tensor" else None,
        block=block,
    )
    x = torch.zeros(1, k, dtype=dtype, device=dev)
    triton_kernels = [
        c for c in kernels.candidates("cuda", activations, weights, "decode", block) if c.startswith("gemv")
    ]  # CUDA's
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None  # (the interpreter's tests: a CPU)
    chosen = gpu and tuned.decode_choice(gpu, signature(n, k, weights, activations, block))
    if chosen is not None:  # the policy takes the recorded choice (ops/triton/tuned.py): only that one is compiled
        triton_kernels = [c for c in triton_kernels if c == chosen]
    precompile = {
        "gemv": lambda **form: (
            gemv.precompile(x, layer.weight, layer.weight_scale, None, block=block)
            if block
            else gemv.precompile(x, layer.weight, layer.scale_flat, None, **form)
        ),  # (also the interpreter's)
        "gemv_w8a8": lambda gated=False: gemv.precompile(
            x, layer.weight, layer.scale_flat, None, dot=True, gated=gated
        ),
        "gemv_splitk": lambda: experts.precompile(x, layer.weight.unsqueeze(0), layer.scale_row),
    }
    gated_kernels = [c for c in triton_kernels if kernels.FNS[c] in kernels.GATED] if gated and not block else []
    for c in triton_kernels:  # only the candidates the policy will time (no W8A8 for a weight-only scheme)
        precompile[c]()
    for c in gated_kernels:
        precompile[c](gated=True)
    for c in triton_kernels:
        kernels.run(c, layer, x)
    for c in gated_kernels:
        kernels.GATED[kernels.FNS[c]](layer, x)
    if "gemv" not in triton_kernels or block:
        return
    for form in fused:
        precompile["gemv"](**form)
        nw = torch.ones(k, dtype=dtype, device=dev) if form.get("norm") else None
        r = torch.zeros(1, n, dtype=dtype, device=dev) if form.get("residual") else None  # (never with `gated`)
        gemv.gemv(
            x, layer.weight, layer.scale_flat, None, gated=form.get("gated", False), norm=nw, eps=1e-6, residual=r
        )
    if qkv_heads is not None:
        qkv_rotary.precompile(x, layer.weight, layer.scale_flat, qkv_heads)


def _step(report: dict, name: str, fn, stop: threading.Event | None = None) -> None:
    if stop is not None and stop.is_set():  # the load failed or the process is ending: no more calls
        report.setdefault("cancelled", []).append(name)
        return
    t = time.perf_counter()
    try:
        fn()
        report["warmed"].append(f"{name} {time.perf_counter() - t:.3f}s")
    except Exception as e:  # the install makes the real call and says what failed
        report["failed"].append(f"{name}: {type(e).__name__}: {str(e)[:120]}")


def _first_use(report: dict) -> None:
    """What needs no model: Triton's driver, its launcher build and how we launch kernels."""
    from ..ops.triton import launch as triton_launch

    _step(report, "triton", triton_launch.mode)


def _work(
    config,
    linears: dict,
    dtype: torch.dtype,
    dev: torch.device,
    rows: int,
    rowwise: bool,
    report: dict,
    decode: tuple | None = None,
    stop: threading.Event | None = None,
) -> None:
    from ...format.fp8 import FP8_DTYPE
    from ..ops import triton as tritonlib
    from ..ops.triton import act_quant
    from ..ops.triton import rotary_kernel as rotary

    def step(name, fn):
        _step(report, name, fn, stop)

    gemms, gated = _shapes(linears)
    hidden = getattr(config, "hidden_size", None)
    eps = getattr(config, "rms_norm_eps", None)
    heads = _heads(config)
    qkv = (heads[0] + 2 * heads[1]) * heads[2] if heads is not None else None

    def direct_decode(n, k) -> dict:  # the fused forms the direct decode runs for an n x k layer
        is_qkv = n == qkv and k == hidden
        fused = []
        if is_qkv:
            fused.append({"norm": True})  # (and its rotary form, `qkv_heads`)
        if n == hidden:  # o_proj, down_proj
            fused.append({"residual": True})
        if n in gated:
            fused.append({"gated": True, "norm": True})
        return {"fused": tuple(fused), "qkv_heads": heads if is_qkv else None}

    if tritonlib.available() and decode is not None and decode[0] in ("row", "tensor", "block"):
        for n, k in sorted(gemms):
            step(
                f"decode kernels {n}x{k}",
                lambda n=n, k=k: _decode_kernels(n, k, *decode, dtype, dev, gated=n in gated, **direct_decode(n, k)),
            )
    if tritonlib.available():
        for k in sorted({k for _, k in gemms}):
            step(f"quantize {k}", lambda k=k: act_quant.quantize(torch.empty(rows, k, dtype=dtype, device=dev)))
        for n in sorted(gated):
            step(
                f"silu_mul_quantize {n}",
                lambda n=n: act_quant.silu_mul_quantize(torch.empty(rows, n, dtype=dtype, device=dev)),
            )
        if isinstance(hidden, int) and isinstance(eps, float):
            x, w = torch.zeros(rows, hidden, dtype=dtype, device=dev), torch.ones(hidden, dtype=dtype, device=dev)
            step(
                "rms_norm",
                lambda: (
                    act_quant.rms_norm_quantize(x, w, eps, True),
                    act_quant.rms_norm_quantize(x, w, eps, False),
                    act_quant.add_rms_norm_quantize(x, x, w, eps, True),
                    act_quant.rms_norm_quantize(x, w, eps, True, store_y=False),
                    act_quant.add_rms_norm_quantize(x, x, w, eps, True, store_y=False),
                ),
            )
    for n, k in sorted(gemms) if rowwise else ():

        def mm(n=n, k=k):
            a = torch.zeros(rows, k, dtype=FP8_DTYPE, device=dev)
            b = torch.zeros(n, k, dtype=FP8_DTYPE, device=dev).t()
            sa, sb = torch.ones(rows, 1, device=dev), torch.ones(1, n, device=dev)
            torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=dtype, use_fast_accum=True)

        step(f"scaled_mm {n}x{k}", mm)
    if heads is not None:
        hq, hk, hd = heads
        qkv = torch.zeros(
            1, rows, (hq + 2 * hk) * hd, dtype=dtype, device=dev
        )  # q/k/v as views of one fused GEMM output
        q, k, v = (t.view(1, rows, -1, hd).transpose(1, 2) for t in qkv.split([hq * hd, hk * hd, hk * hd], dim=-1))
        cos = torch.ones(1, rows, hd, dtype=dtype, device=dev)
        if rotary.fits(q, k, cos, cos):
            step("rotary", lambda: rotary.rotary(q, k, cos, cos))
        step(
            "sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd**-0.5, enable_gqa=hq != hk)
        )
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Prewarm:
    """The warm-up thread of one load. Started with the load, it pays Triton's first use while the
    model is built (first starting the child that `child()` returns, e.g. prewarm_child.start's,
    whose work is awaited before this thread's own); `begin` hands it the model's shapes, `join()`
    returns what it did, and `cancel()` (a failed load) kills a child still running and skips the
    thread's calls not yet begun. The interpreter's exit cancels every warm-up still running and
    waits for it to finish its current call (at most EXIT_WAIT_S): a daemon thread still inside
    CUDA or Triton code while the process tears down is the likely cause of the "terminate called
    without an active exception" seen after a failed load's traceback on an H100."""

    def __init__(self, dev: torch.device, child: Callable[[], Child | None] | None = None):
        self.report: dict = {"warmed": [], "failed": []}
        self._t0 = time.perf_counter()
        self._job: tuple | None = None
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._child = None
        self._stop = threading.Event()  # cancelled: no child, no more calls

        def run():
            try:
                with torch.cuda.device(dev):
                    if child is not None:
                        self._start_child(child)
                    _first_use(self.report)
                    self._ready.wait()
                    if self._job is not None and not self._stop.is_set():
                        config, linears, dtype_, rows, rowwise, decode = self._job
                        if self._child is not None:  # its compiles and timings first, then ours find them cached
                            self.report["child"] = self._child_report(self._child.answer(timeout=CHILD_WAIT_S))
                        _work(config, linears, dtype_, dev, rows, rowwise, self.report, decode, self._stop)
            except Exception as e:  # pragma: no cover - the steps catch their own; this is the thread's last guard
                self.report["failed"].append(f"{type(e).__name__}: {str(e)[:120]}")
            finally:
                self._kill_child()
            self.report["seconds"] = round(time.perf_counter() - self._t0, 3)

        self._thread = threading.Thread(target=run, name="mpsconvert-prewarm", daemon=True)
        _RUNNING.add(self)
        self._thread.start()

    def _start_child(self, start: Callable[[], Child | None]) -> None:
        t = time.perf_counter()
        try:
            child = start()
        except Exception as e:  # a hint that cannot be read: this thread does the work alone
            self.report["child"] = {"started": False, "why": f"{type(e).__name__}: {str(e)[:120]}"}
            return
        with self._lock:
            if self._stop.is_set() and child is not None:
                child.kill()
                child = None
            self._child = child
        if child is None:
            self.report.setdefault("child", {"started": False})
        self.report["child_start_s"] = round(time.perf_counter() - t, 3)

    def _child_report(self, answer: dict) -> dict:
        if "error" in answer:
            return {"started": True, "error": answer["error"]}
        return {
            "started": True,
            "seconds": answer.get("seconds"),
            "warmed": answer.get("warmed", []),  # each step with its seconds
            "failed": answer.get("failed", []),
            "waited_s": round(time.perf_counter() - self._begun, 3),
        }

    def begin(
        self, config, linears: dict, dtype: torch.dtype, rows: int, rowwise: bool, decode: tuple | None = None
    ) -> None:
        """Warm up for a model of `config` whose FP8 Linears are `linears` ({name: (N, K)}),
        probed with `rows` tokens; `rowwise`: their prefill GEMMs are row-wise scaled (per-token
        activations, per-row weights); `decode`: (weight granularity, activation scheme, block
        edge or None) of those layers, whose Triton decode kernels are compiled and autotuned here
        (`job_of` gives the last three for a scheme)."""
        if self._ready.is_set():
            raise RuntimeError("Prewarm.begin called twice or after cancel")
        self._job = (config, linears, dtype, rows, rowwise, decode)
        self._begun = time.perf_counter()
        self._ready.set()

    def cancel(self) -> None:
        self._stop.set()
        self._ready.set()
        self._kill_child()

    def _kill_child(self) -> None:
        with self._lock:
            if self._child is not None:
                self._child.kill()

    def done(self) -> bool:
        """Whether the thread has finished (so that `join` would not wait)."""
        return not self._thread.is_alive()

    def join(self) -> dict:
        t = time.perf_counter()
        self._thread.join()
        self.report["waited_s"] = round(time.perf_counter() - t, 3)  # what the reading did not hide
        return self.report


_RUNNING: weakref.WeakSet[Prewarm] = weakref.WeakSet()


@atexit.register
def _end_all(wait_s: float = EXIT_WAIT_S) -> None:
    """At the interpreter's exit: cancel every warm-up still running and wait for its current call."""
    deadline = time.monotonic() + wait_s
    for warm in list(_RUNNING):
        warm.cancel()
    for warm in list(_RUNNING):
        warm._thread.join(timeout=max(0.0, deadline - time.monotonic()))


def start(dev: torch.device, child: Callable[[], Child | None] | None = None) -> Prewarm | None:
    """Start the warm-up thread of a load on `dev` (Triton's first use at once, after starting the
    child that `child()` returns, if any; the model's own calls once `begin` gives its shapes).
    None where there is nothing to warm (not CUDA)."""
    if dev.type != "cuda":
        return None
    return Prewarm(dev, child)
