"""Which kernel each FP8 layer runs, decided by measuring on this machine and cached.

Why measure: the fastest way to run an FP8 layer depends on device, shape and token count
(on the H200 `_scaled_mm` row-wise is ~1.7x BF16 at 2048 tokens but slower than BF16 at one
token; on MPS `scaled_mm` is reported slow for big matmuls and fast for GEMVs). So for every
distinct layer signature (N, K, weight granularity, activation scheme) and each token bucket
(decode: `M = decode_m` tokens; prefill: `M` = each bound of `fp8linear.PREFILL_BUCKETS`, 16 to
8192, so every prompt length runs the kernel measured nearest it and no caller names one),
every candidate kernel of kernels.py is timed and the fastest wins. A kernel is timed as the
model runs it: the layers of one signature take turns (`streamed`), enough of them that their
weights outgrow the device's last cache, since a decode step reads each weight once from memory;
one weight called again and again would be read from L2 (50 MB on a Hopper GPU holds a whole
4096 x 4096 layer), which speeds kernels up unequally (on an H100 the GEMV of such a layer took
5.9 us from L2 and 9.0 us streamed, the W8A8 GEMV 9.4 and 11.3 us). A BF16 weight is kept only
when BF16 beats every FP8 kernel in every bucket (a BF16 copy for some buckets would double that
layer's memory); such a fallback is recorded.

Decisions are cached in `$MPSCONVERT_CACHE_DIR/kernels.json` (default
`~/.cache/mpsconvert/kernels.json`), keyed by device name, torch and triton versions, shape,
scheme and token count, so a second load measures nothing. CPU is decided by rule, not
measured: dequantize once and run BF16 (FP8 matmul on CPU takes minutes per call). What the
device and torch lack (no FP8 matmul on MPS before torch 2.15) is probed once per process by
devices.capabilities and said once; such kernels are then not candidates at all.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ...errors import MpsconvertError
from ...format.fp8 import relative_error
from ...infra import atomic, devices, timing
from ...infra.filesystem import cache_dir
from ...infra.progress import Progress, or_silent
from ...infra.untrusted import read_json
from ..ops import kernels
from ..ops import triton as tritonlib
from ..ops.fp8linear import PREFILL_BUCKETS, FP8Linear
from ..ops.triton import tuned

# measure(kernel, layer, m) -> microseconds per call; raises if the kernel cannot run.
Measure = Callable[[str, FP8Linear, int], float]
# Our own Triton kernels, checked against the dequantized product on the measuring input before
# they are timed: one that computes something else (a GPU this project never ran them on) is
# recorded as an error and never chosen. Bound: the relative error of the whole output, loose
# enough for the summation orders of the kernels (W8A8: against x rounded to e4m3 with the layer's own
# scales, so a static scale that clips random inputs clips the reference alike), far below a wrong
# kernel's (~100%).
CHECKED = kernels.TRITON  # our own kernels
TIMING = "streamed"  # how a kernel is timed (in the cache key: timings taken otherwise are taken again)
CHECK_BOUND = 0.1


def _check(kernel: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = relative_error(got, want)
    if not err <= CHECK_BOUND:  # NaN fails too
        raise RuntimeError(
            f"{kernel} disagrees with the dequantized product (relative error {err:.3g} > {CHECK_BOUND})"
        )


@functools.cache
def kernels_digest() -> str:
    """A digest of our kernels' source (runtime/ops: the candidates and their Triton kernels), in
    the cache key: timings measured for other kernels (an earlier mpsconvert) are measured again."""
    ops = Path(kernels.__file__).parent
    h = hashlib.sha256()
    for f in sorted([*ops.glob("*.py"), *ops.glob("triton/*.py")]):
        h.update(f.relative_to(ops).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def cache_path() -> Path:
    return cache_dir() / "kernels.json"


def cache_key(device_name: str, sig: tuple, bucket: str, m: int) -> str:
    """The cache's key for a layer signature (N, K, weights, activations) in one bucket."""
    n, k, w, a = sig
    return (
        f"{device_name}|torch {torch.__version__}|triton {tritonlib.version()}|kernels "
        f"{kernels_digest()}|{TIMING}|{n}x{k}|weights={w}|acts={a or 'bf16'}|{bucket} M={m}"
    )


def _cache_file(cache: Path | None | bool) -> Path | None:
    """The cache file KernelPolicy's `cache` argument names: the default (None, True), a path, or none (False)."""
    return cache_path() if cache is None or cache is True else (None if cache is False else Path(cache))


def _read_cache_file(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        return read_json(path, what=str(path))
    except MpsconvertError:
        return {}  # a broken cache is re-measured and rewritten, never trusted


def decided_before(device_name: str, sigs, cache=None, decode_m: int = 1) -> bool:
    """Whether the cache (`cache` as KernelPolicy takes it) holds the decode decision of every
    signature: these kernels were measured on this machine by this code, or chosen by its recorded
    timings (ops/triton/tuned.py) and run, so their first use (Triton's compiles and autotuning,
    which fill its own on-disk cache then) was paid before."""
    body = _read_cache_file(_cache_file(cache))
    return bool(body) and all(cache_key(device_name, sig, "decode", decode_m) in body for sig in sigs)


def _settle(parent: torch.nn.Module, group) -> None:
    """The members of a fused group, once its layer's kernels are chosen: sharing one dense
    weight (`dense_qact`, CPU), unfused and dense (BF16 won for the fused shape), or given the
    group's kernels for a call with an input the others do not share."""
    from ..ops.fuse import unshare

    members = [parent._modules[n] for n in group.names]
    if group.inner.kernels["decode"] == "dense_qact":
        group.hold_dense(members)
    elif group.inner.dense_weight is not None:
        unshare(parent, group)
        for m in members:
            m.set_kernels("bf16", "bf16")
    else:
        for m in members:
            m.set_kernels(**group.inner.kernels)


def _joined(*notes: str) -> str:
    """A decision's notes in one line: why these candidates, then why this choice."""
    return "; ".join(n for n in notes if n)


@dataclass
class Decision:
    """The choice for one layer signature and bucket, with the evidence."""

    shape: tuple[int, int]  # (N, K)
    weights: str
    activations: str | None
    bucket: str
    m: int
    timings_us: dict = field(default_factory=dict)  # kernel -> us, or "error: ..." when it cannot run
    choice: str = ""
    source: str = "measured"  # measured | cache | prior (ops/triton/tuned.json) | rule
    note: str = ""
    layers: int = 0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


class KernelPolicy:
    def __init__(
        self,
        device: torch.device,
        *,
        decode_m: int = 1,
        measure: Measure | None = None,
        cache: Path | None | bool = None,
        capabilities: devices.Capabilities | None = None,
        held: bool = False,
    ):
        """capabilities: what the device offers (default devices.capabilities, probed once per
        process); its name keys the cache, and without scaled_mm no FP8 x FP8 kernel is a candidate.
        held: our Triton kernels are held back (runtime/load/held.py): each layer runs what
        `kernels.without_triton` picks, by rule, nothing measured and nothing cached."""
        self.device = device
        self.held = held
        self.decode_m = decode_m
        self.measure = measure or self._measure
        self.priors = measure is None  # recorded timings (ops/triton/tuned.py) stand in for our own measurement only
        self.cache_file = _cache_file(cache)
        self.caps = capabilities or devices.capabilities(device)
        self.device_name = self.caps.name
        self.decisions: list[Decision] = []
        self._cache = self._read_cache()
        self._peers: dict[tuple, list[FP8Linear]] = {}  # signature -> its layers, while `apply` decides

    # -- cache -------------------------------------------------------------------------------
    def key(self, sig: tuple, bucket: str, m: int) -> str:
        return cache_key(self.device_name, sig, bucket, m)

    def _read_cache(self) -> dict:
        return _read_cache_file(self.cache_file)

    def _write_cache(self) -> None:
        if self.cache_file is None:
            return
        fresh = self._read_cache() | self._cache  # keep entries another process wrote meanwhile
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_text(self.cache_file, json.dumps(fresh, indent=1, sort_keys=True) + "\n")
        except OSError as e:  # a read-only home must not stop a load; the next load measures again
            warnings.warn(
                f"mpsconvert kernel cache {self.cache_file} not written ({e.strerror}); set MPSCONVERT_CACHE_DIR",
                stacklevel=2,
            )

    # -- deciding ----------------------------------------------------------------------------
    def buckets(self) -> list[tuple[str, int]]:
        """(bucket, M) measured per layer signature: decode, then every prefill bucket. CPU and a
        held policy decide by rule, the same for every length: one prefill decision (M 0: any)."""
        prefill = [0] if self.device.type == "cpu" or self.held else list(PREFILL_BUCKETS)
        return [("decode", self.decode_m)] + [("prefill", m) for m in prefill]

    def _bucket(self, layer: FP8Linear, bucket: str, m: int) -> Decision:
        sig = layer.signature
        d = Decision(shape=sig[:2], weights=sig[2], activations=sig[3], bucket=bucket, m=m)
        cands = kernels.candidates(
            self.device.type, layer.activations, layer.weights, bucket, layer.block, self.caps.scaled_mm
        )
        if self.device.type == "cpu":
            d.timings_us, d.choice, d.source = {}, cands[0], "rule"
            d.note = "CPU: weights dequantized once at load (FP8 matmul on CPU is orders of magnitude slower)" + (
                "; activations rounded through e4m3 as the scheme says" if cands[0] == "dense_qact" else ""
            )
            return d
        if self.held:
            d.choice, d.source = kernels.without_triton(cands), "rule"
            d.note = "held: torch's kernels until this machine's first compile of ours is done (runtime/load/held.py)"
            return d
        key = self.key(sig, bucket, m)
        hit = self._cache.get(key)
        prior = tuned.timings(self.device_name, sig, bucket, m) if self.priors else None
        if hit and hit.get("source") != "prior" and set(hit.get("timings_us", {})) == set(cands):
            d.timings_us, d.source = hit["timings_us"], "cache"
        elif prior is not None and set(prior) == set(cands) and self._prior_holds(layer, prior, m):
            d.timings_us, d.source = prior, "prior"
            d.note = (
                f"timings recorded on a {self.device_name} (runtime/ops/triton/tuned.json; MPSCONVERT_TUNED=0 measures)"
            )
            # no timings of ours, only that this machine has run these kernels (`decided_before`): the next
            # load reads the table again and starts no warm-up child
            self._cache[key] = {"source": "prior", "used": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        else:
            for c in cands:
                try:
                    d.timings_us[c] = round(float(self.measure(c, layer, m)), 3)
                except Exception as e:  # a kernel that cannot run this shape is recorded and reported, not hidden
                    d.timings_us[c] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                    warnings.warn(
                        f"mpsconvert kernel {c} cannot run a {sig[0]}x{sig[1]} layer on {self.device_name} "
                        f"({d.timings_us[c][7:]}); the policy chooses among the others (see validate --explain)",
                        stacklevel=2,
                    )
            self._cache[key] = {
                "timings_us": d.timings_us,
                "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        if self.caps.lacks:  # why only dequantizing kernels were candidates (warned once, by devices.capabilities)
            d.note = self.caps.lacks
        elif layer.weights == "block" and not any(c.startswith("scaled_mm") or c.startswith("gemv") for c in cands):
            d.note = (
                f"no block-scaled FP8 kernel on {self.device.type} (F.scaled_mm there takes tensor- and "
                "row-wise scales only): this layer dequantizes its weight per call, or keeps a BF16 copy "
                "where that measured faster"
            )
        return d

    def _prior_holds(self, layer: FP8Linear, prior: dict, m: int) -> bool:
        """Whether the kernel a prior (ops/triton/tuned.py) makes fastest computes this layer's product here: our
        own Triton kernels are checked against the dequantized product as before timing (CHECKED); one that
        fails is measured with the others instead (the check's warning says so)."""
        best = self._best(prior)
        if best not in CHECKED:
            return True
        x = torch.randn(m, layer.in_features, device=self.device, dtype=layer.dtype)
        want = kernels.run("dequant", layer, kernels.scheme_rounded(layer, x) if best == "gemv_w8a8" else x)
        try:
            _check(best, kernels.run(best, layer, x), want)
        except Exception as e:
            warnings.warn(f"mpsconvert: the recorded kernel choice does not hold here ({e}); measuring", stacklevel=3)
            return False
        return True

    @staticmethod
    def _best(timings: dict, exclude: tuple = ()) -> str | None:
        ok = {k: v for k, v in timings.items() if isinstance(v, (int, float)) and k not in exclude}
        return min(ok, key=ok.get) if ok else None

    def decide(self, layer: FP8Linear) -> list[Decision]:
        """One decision per bucket of `buckets()`: decode first."""
        ds = [self._bucket(layer, b, m) for b, m in self.buckets()]
        if self.device.type == "cpu" or self.held:
            return ds
        best = [self._best(d.timings_us) for d in ds]
        if None in best:
            from ...errors import DeviceError

            raise DeviceError(
                f"no FP8 kernel runs a {layer.out_features}x{layer.in_features} layer on {self.device_name}: "
                f"{[d.timings_us for d in ds]}",
                "pass `device=cpu`, or report this with the message above",
            )
        if all(b == "bf16" for b in best):
            for d in ds:
                d.choice = "bf16"
                d.note = _joined(
                    d.note,
                    "fallback: BF16 measured faster than every FP8 kernel in every bucket; "
                    "this layer keeps a BF16 weight",
                )
        else:
            for d, b in zip(ds, best):
                d.choice = b if b != "bf16" else self._best(d.timings_us, exclude=("bf16",))
                if b == "bf16":
                    d.note = _joined(
                        d.note,
                        "BF16 was faster here but not in every bucket; FP8 kept "
                        "(a second, BF16 copy would double this layer's memory)",
                    )
        return ds

    def apply(self, model: torch.nn.Module, progress: Progress | None = None) -> list[Decision]:
        """Decide once per distinct layer signature, install the kernels on every FP8Linear."""
        from ..ops.fuse import SharedInput

        groups: dict[tuple, list[FP8Linear]] = {}
        for mod in model.modules():
            if isinstance(mod, FP8Linear) and mod.group is None:  # members of a fused group run its inner layer
                groups.setdefault(mod.signature, []).append(mod)
        fused = {
            id(g.inner): (parent, g)
            for parent in model.modules()
            for g in parent.children()
            if isinstance(g, SharedInput)
        }
        self.decisions, self._peers = [], groups
        progress = or_silent(progress)
        for i, (sig, layers) in enumerate(groups.items()):
            progress("kernels", i, len(groups), f"{sig[0]}x{sig[1]}")
            dec, *pre = self.decide(layers[0])
            prefill = pre[0].choice if len(pre) == 1 else {d.m: d.choice for d in pre}
            for layer in layers:
                layer.set_kernels(dec.choice, prefill)
                if (
                    id(layer) in fused
                ):  # its members at once: a dense kernel frees the group's codes before the next is made
                    _settle(*fused[id(layer)])
            for d in (dec, *pre):
                d.layers = len(layers)
            self.decisions += [dec, *pre]
        self._peers = {}
        if self.device.type != "cpu" and not self.held:
            self._write_cache()
        return self.decisions

    # -- timing ------------------------------------------------------------------------------
    def streamed(self, layer: FP8Linear, weight_bytes: int) -> int:
        """How many weights of `weight_bytes` each to time in turn: enough to outgrow twice the
        device's last cache (so none is still cached when its turn comes again), at most the
        layers of this signature there are."""
        peers = len(self._peers.get(layer.signature, ())) or 1
        return max(1, min(peers, -(-2 * self.caps.cache_bytes // max(1, weight_bytes))))

    def _measure(self, kernel: str, layer: FP8Linear, m: int) -> float:
        x = torch.randn(m, layer.in_features, device=self.device, dtype=layer.dtype)
        if kernel == "bf16":  # dense twins of the same shape; the layers themselves are untouched
            n = self.streamed(layer, layer.out_features * layer.in_features * x.element_size())
            dense = [
                torch.randn(layer.out_features, layer.in_features, device=self.device, dtype=layer.dtype)
                for _ in range(n)
            ]
            fns = [lambda d=d: torch.nn.functional.linear(x, d, layer.bias) for d in dense]
        else:
            peers = self._peers.get(layer.signature, [layer])
            n = self.streamed(layer, layer.weight.numel() * layer.weight.element_size())
            fns = [lambda p=p: kernels.run(kernel, p, x) for p in [layer, *(p for p in peers if p is not layer)][:n]]
            if kernel in CHECKED:  # against the scheme's arithmetic: x rounded as the kernel's scheme rounds it
                _check(
                    kernel,
                    fns[0](),
                    kernels.run("dequant", layer, kernels.scheme_rounded(layer, x) if kernel == "gemv_w8a8" else x),
                )
        turn = itertools.cycle(fns)
        return timing.per_call_us(lambda: next(turn)(), self.device)

    def explain(self) -> list[dict]:
        return [d.as_dict() for d in self.decisions]
