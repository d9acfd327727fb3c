"""The load's warm-up thread (runtime/load/prewarm.py): the GEMM shapes it derives are the ones
fuse.py makes, and every call it makes is a valid call of our kernels and torch's (interpreted
on CPU: a call with a wrong signature would be listed as failed)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from mpsconvert.runtime.load import prewarm


def test_shapes_are_the_fused_gemms():
    linears = {}
    for i in range(2):
        p = f"model.layers.{i}.self_attn"
        linears |= {
            f"{p}.q_proj": (4096, 4096),
            f"{p}.k_proj": (1024, 4096),
            f"{p}.v_proj": (1024, 4096),
            f"{p}.o_proj": (4096, 4096),
        }
        m = f"model.layers.{i}.mlp"
        linears |= {f"{m}.gate_proj": (14336, 4096), f"{m}.up_proj": (14336, 4096), f"{m}.down_proj": (4096, 14336)}
    gemms, gated = prewarm._shapes(linears)
    assert gemms == {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}
    assert gated == {28672}
    del linears["model.layers.1.self_attn.v_proj"]  # an ignored member: that layer's q and k are not fused
    gemms, _ = prewarm._shapes(linears)
    assert {(4096, 4096), (1024, 4096), (6144, 4096)} <= gemms and (5120, 4096) not in gemms


def test_not_started_off_cuda():
    assert prewarm.start(torch.device("cpu")) is None


@pytest.fixture
def recorded(monkeypatch):
    """The thread's two phases replaced by recorders (torch.cuda.device made a no-op off CUDA)."""
    import contextlib

    calls = []
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(prewarm, "_first_use", lambda report: calls.append("first use"))
    monkeypatch.setattr(prewarm, "_work", lambda *a: calls.append(("work", a)))
    return calls


def test_first_use_runs_before_the_model_is_known_and_the_rest_after_begin(recorded):
    warm = prewarm.Prewarm(torch.device("cpu"))
    warm.begin("cfg", {"l": (8, 4)}, torch.bfloat16, 9, True, decode=("row", "token", None))
    report = warm.join()
    assert recorded[0] == "first use"
    assert recorded[1] == (
        "work",
        (
            "cfg",
            {"l": (8, 4)},
            torch.bfloat16,
            torch.device("cpu"),
            9,
            True,
            report,
            ("row", "token", None),
            warm._stop,
        ),
    )
    assert report["waited_s"] >= 0 and report["seconds"] >= 0
    warm.cancel()  # after begin: nothing changes
    with pytest.raises(RuntimeError, match="twice"):
        warm.begin("cfg", {}, torch.bfloat16, 9, True)


def test_a_cancelled_warm_up_ends_without_the_model_work(recorded):
    warm = prewarm.Prewarm(torch.device("cpu"))
    warm.cancel()
    warm._thread.join(timeout=10)
    assert not warm._thread.is_alive()
    assert recorded == ["first use"]


def test_a_cancelled_warm_up_makes_no_more_calls():
    """A load that failed after `begin` cancels its warm-up: the steps not yet begun are skipped (and
    listed), so a failed load stops using the GPU at the end of the current call."""
    from .models import tiny_config

    cfg = tiny_config("llama", intermediate_size=96, rms_norm_eps=1e-5)
    linears = {"l.q_proj": (64, 64), "l.down_proj": (64, 96)}
    stop = threading.Event()
    stop.set()
    report = {"warmed": [], "failed": []}
    prewarm._work(cfg, linears, torch.bfloat16, torch.device("cpu"), 9, False, report, None, stop)
    assert report["warmed"] == [] and report["failed"] == [] and "sdpa" in report["cancelled"]
    report = {"warmed": [], "failed": []}  # the same call not cancelled makes them
    prewarm._work(cfg, linears, torch.bfloat16, torch.device("cpu"), 9, False, report, None, threading.Event())
    assert "cancelled" not in report and [w.rpartition(" ")[0] for w in report["warmed"]][-1] == "sdpa"


def test_the_exit_waits_for_a_warm_up_still_running(tmp_path):
    """A script whose load failed exits while the warm-up thread is inside a call (on CUDA: Triton's
    first use, seconds long). The exit cancels it and waits for that call, instead of tearing the
    process down under a daemon thread in C++ code (the "terminate called without an active
    exception" seen on an H100); the model's work, not begun, is skipped."""
    marker = tmp_path / "marker"
    script = f"""
import contextlib, time, torch
from mpsconvert.runtime.load import prewarm
torch.cuda.device = lambda dev: contextlib.nullcontext()
def first_use(report):
    time.sleep(1.5)
    open({str(marker)!r}, "w").write("first use ended")
prewarm._first_use = first_use
prewarm._work = lambda *a: open({str(marker)!r}, "a").write(", model work")
warm = prewarm.Prewarm(torch.device("cpu"))
warm.begin("cfg", {{}}, torch.bfloat16, 9, True)
warm.cancel()
raise RuntimeError("the load failed")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "the load failed" in r.stderr, r.stderr
    assert marker.read_text() == "first use ended"


class _Recorder:
    def __init__(self):
        self.begun, self.cancelled, self.joined = None, False, False

    def begin(self, config, linears, dtype, rows, rowwise, decode=None):
        self.begun = (linears, rowwise, decode)

    def cancel(self):
        self.cancelled = True

    def join(self):
        self.joined = True
        return {"warmed": [], "failed": [], "waited_s": 0.0}


def test_load_starts_the_warm_up_first_gives_it_the_fp8_shapes_and_ends_it_on_failure(tmp_path, monkeypatch):
    """load() starts the thread before anything is read, hands it exactly the FP8 Linears' shapes
    once the model is built, waits for it before the kernel policy, and ends it when a load fails."""
    from mpsconvert.convert.quantize import quantize_snapshot
    from mpsconvert.convert.quantize_options import Options
    from mpsconvert.errors import ArtifactError
    from mpsconvert.format.schemes import Scheme
    from mpsconvert.runtime.load import loader
    from mpsconvert.source.snapshot import resolve

    from . import models

    started = []
    monkeypatch.setattr(prewarm, "start", lambda dev, child=None: started.append(_Recorder()) or started[-1])
    with pytest.raises(ArtifactError):
        loader.load(tmp_path / "nothing", device="cpu")
    assert started[-1].cancelled and started[-1].begun is None
    src = models.tiny("llama", tmp_path / "bf16", dtype=torch.bfloat16, tie=False)
    quantize_snapshot(
        resolve(str(src)), tmp_path / "art", Options(scheme=Scheme.make("fp8-dynamic", "row"), force=True)
    )
    model = loader.load(tmp_path / "art", device="cpu")
    warm = started[-1]
    linears, rowwise, decode = warm.begun
    assert linears == {
        n: (m.out_features, m.in_features)
        for n, m in model.named_modules()
        if isinstance(m, loader.FP8Linear) and not n.endswith(".inner")
    }
    assert rowwise and decode == ("row", "token", None) and warm.joined
    assert "prewarm_wait" in model.mpsconvert.seconds
    loader.load(tmp_path / "art", device="cpu", eager_fusion=False)
    assert started[-1] is warm  # no warm-up asked for: none started


@pytest.mark.triton("interpret")
def test_every_warm_up_call_is_valid():
    import torch

    from mpsconvert.runtime.load import prewarm

    from .models import tiny_config

    cfg = tiny_config("llama", intermediate_size=96, rms_norm_eps=1e-5)
    linears = {
        "l.q_proj": (64, 64),
        "l.k_proj": (32, 64),
        "l.v_proj": (32, 64),
        "l.o_proj": (64, 64),
        "l.gate_proj": (96, 64),
        "l.up_proj": (96, 64),
        "l.down_proj": (64, 96),
    }
    report = {"warmed": [], "failed": []}
    prewarm._work(cfg, linears, torch.bfloat16, torch.device("cpu"), 9, False, report, decode=("row", "token", None))
    assert report["failed"] == [], report["failed"]
    names = [w.rpartition(" ")[0] for w in report["warmed"]]
    assert names == [
        "decode kernels 64x64",
        "decode kernels 64x96",
        "decode kernels 128x64",
        "decode kernels 192x64",
        "quantize 64",
        "quantize 96",
        "silu_mul_quantize 192",
        "rms_norm",
        "rotary",
        "sdpa",
    ], names
    report = {"warmed": [], "failed": []}  # block-scaled weights: the GEMV's block variant
    prewarm._work(cfg, linears, torch.bfloat16, torch.device("cpu"), 9, False, report, decode=("block", None, 32))
    assert report["failed"] == [], report["failed"]
    assert [w.rpartition(" ")[0] for w in report["warmed"]][:4] == [
        "decode kernels 64x64",
        "decode kernels 64x96",
        "decode kernels 128x64",
        "decode kernels 192x64",
    ]


@pytest.mark.triton("interpret")
def test_the_warm_up_compiles_the_direct_decodes_fused_gemv_forms(monkeypatch):
    """Besides each shape's plain (and gated) GEMV, the warm-up compiles the forms the direct decode
    runs (runtime/patches/direct_decode.py): q/k/v with the norm prologue and its rotary form,
    o_proj and down_proj with the residual epilogue, gate/up gated with the norm prologue; for
    block-scaled weights (no direct decode) none of them."""
    import torch

    from mpsconvert.runtime.load import prewarm
    from mpsconvert.runtime.ops.triton import gemv, qkv_rotary

    from .models import tiny_config

    cfg = tiny_config("llama", intermediate_size=96, rms_norm_eps=1e-5)
    hq, hk = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq
    linears = {
        "l.q_proj": (hq * d, 64),
        "l.k_proj": (hk * d, 64),
        "l.v_proj": (hk * d, 64),
        "l.o_proj": (64, hq * d),
        "l.gate_proj": (96, 64),
        "l.up_proj": (96, 64),
        "l.down_proj": (64, 96),
    }
    calls = []
    monkeypatch.setattr(gemv, "precompile", lambda x, w, s, b, **kw: calls.append((tuple(w.shape), kw)) or 0)
    monkeypatch.setattr(qkv_rotary, "precompile", lambda x, w, s, heads: calls.append((tuple(w.shape), heads)) or 0)
    report = {"warmed": [], "failed": []}
    prewarm._work(cfg, linears, torch.bfloat16, torch.device("cpu"), 9, False, report, decode=("row", "tensor", None))
    assert report["failed"] == [], report["failed"]
    qkv = ((hq + 2 * hk) * d, 64)
    got = [(shape, form) for shape, form in calls if not (isinstance(form, dict) and form.get("dot"))]
    assert sorted(map(repr, got)) == sorted(
        map(
            repr,
            [
                (qkv, {}),
                (qkv, {"norm": True}),
                (qkv, (hq, hk, d)),
                ((64, hq * d), {}),
                ((64, hq * d), {"residual": True}),
                ((64, 96), {}),
                ((64, 96), {"residual": True}),
                ((192, 64), {}),
                ((192, 64), {"gated": True}),
                ((192, 64), {"gated": True, "norm": True}),
            ],
        )
    )
    calls.clear()
    prewarm._work(cfg, linears, torch.bfloat16, torch.device("cpu"), 9, False, report, decode=("block", None, 32))
    assert calls and all(form == {"block": 32} for _, form in calls), calls


def test_compile_configs_compiles_each_configuration_once_the_first_before_the_others():
    """What the autotuner's first call would compile one by one: every configuration, with the
    call's own arguments and constants, the first on the calling thread (it makes Triton's
    per-device binder), the rest on a pool (Triton's AsyncCompileMode where it has one)."""
    import threading

    from mpsconvert.runtime.ops import triton as tritonlib

    if tritonlib.triton is None or tritonlib.INTERPRET:
        pytest.skip("needs Triton, not interpreted")
    calls = []

    class Cfg:
        def __init__(self, i):
            self.i = i

        def all_kwargs(self):
            return {"BLOCK": self.i, "num_warps": 4}

    class Fn:
        def warmup(self, *args, grid, **kw):
            calls.append((args, grid, kw, threading.current_thread() is threading.main_thread()))

    class Autotuned:
        configs = [Cfg(i) for i in range(5)]
        fn = Fn()

    assert tritonlib.compile_configs(Autotuned(), "x", 3, FLAG=True) == 5
    assert sorted(c[2]["BLOCK"] for c in calls) == [0, 1, 2, 3, 4]
    assert all(c[0] == ("x", 3) and c[1] == (1,) and c[2]["FLAG"] is True and c[2]["num_warps"] == 4 for c in calls)
    assert calls[0][2]["BLOCK"] == 0 and calls[0][3]


# -- the child that warms up first (runtime/load/prewarm_child.py, child.py) ---------------------------


@pytest.fixture(scope="module")
def artifact(work):
    """A tiny Llama quantized with the defaults, and the same model loaded on CPU."""
    from mpsconvert.convert.quantize import quantize_snapshot
    from mpsconvert.convert.quantize_options import Options
    from mpsconvert.format.schemes import Scheme
    from mpsconvert.source.snapshot import resolve

    from . import models

    src = models.tiny("llama", work / "bf16", dtype=torch.bfloat16, tie=False)
    art = work / "art"
    quantize_snapshot(
        resolve(str(src)),
        art,
        Options(scheme=Scheme.make("fp8-dynamic", "row"), ignore=["model.layers.1.mlp.down_proj"], force=True),
    )
    return art


def test_the_childs_request_is_what_the_load_hands_its_own_warm_up(artifact, monkeypatch):
    """Read from config.json and the shard headers alone (no model built), the request names the
    FP8 Linears the load's `begin` gets (not the ignored one), with the same probe rows, row-wise
    flag and decode kernels, and the config entries the warm-up reads."""
    from mpsconvert.runtime.load import loader, prewarm_child

    begun = []
    monkeypatch.setattr(prewarm, "start", lambda dev, child=None: begun.append(_Recorder()) or begun[-1])
    model = loader.load(artifact, device="cpu")
    linears, rowwise, decode = begun[-1].begun
    req = prewarm_child.request(artifact, torch.bfloat16, torch.device("cuda", 0))
    assert {k: tuple(v) for k, v in req["linears"].items()} == linears
    assert "model.layers.1.mlp.down_proj" not in req["linears"] and len(linears) == 13
    assert (req["rowwise"], tuple(req["decode"])) == (rowwise, decode)
    cfg = model.config
    assert req["config"] == {
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
    }
    assert (req["device"], req["dtype"]) == (0, "bfloat16")


def test_the_request_believes_only_what_fits(artifact, tmp_path):
    """Unverified input: config entries of the wrong type or absurd size are left out, a shard
    linked from outside the folder or a folder with no FP8 weights gives no request at all."""
    import json
    import shutil

    from mpsconvert.runtime.load import prewarm_child

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    body = json.loads((art / "config.json").read_text())
    body |= {"hidden_size": 1 << 40, "num_attention_heads": True, "rms_norm_eps": "1e-5"}
    (art / "config.json").write_text(json.dumps(body))
    req = prewarm_child.request(art, torch.bfloat16, torch.device("cuda", 0))
    assert set(req["config"]) == {"num_key_value_heads", "head_dim"}
    outside = tmp_path / "elsewhere.safetensors"
    shard = next(art.glob("*.safetensors"))
    shard.rename(outside)
    shard.symlink_to(outside)
    assert prewarm_child.request(art, torch.bfloat16, torch.device("cuda", 0)) is None
    shard.unlink()
    assert prewarm_child.request(art, torch.bfloat16, torch.device("cuda", 0)) is None  # no FP8 weights left
    assert prewarm_child.request(tmp_path / "nothing", torch.bfloat16, torch.device("cuda", 0)) is None


def test_no_child_where_it_would_not_pay(artifact, monkeypatch):
    from mpsconvert.runtime.load import prewarm_child

    assert prewarm_child.start(torch.device("cpu"), artifact, torch.bfloat16) is None  # not CUDA
    monkeypatch.setattr(prewarm_child.os, "cpu_count", lambda: 2)
    assert (
        prewarm_child.start(torch.device("cuda", 0), artifact, torch.bfloat16) is None
    )  # too few cores (or no Triton, no GPU here)


def test_the_child_runs_the_warm_up_in_its_own_process_and_answers(artifact):
    """The child's whole path on CPU: booted with this mpsconvert, it runs the warm-up for the
    request's shapes (on CPU the steps that run there; Triton's need a GPU) and answers its report:
    the same steps the load's own warm-up makes for that model."""
    import json

    from transformers import AutoConfig

    from mpsconvert.infra.child import Child
    from mpsconvert.runtime.load import loader, prewarm_child

    req = prewarm_child.request(artifact, torch.bfloat16, torch.device("cuda", 0)) | {"device": "cpu"}
    answer = Child(prewarm_child.__name__, req).answer(timeout=300)
    assert "error" not in answer, answer
    model = loader.load(artifact, device="cpu", eager_fusion=False)
    linears = {
        n: (m.out_features, m.in_features)
        for n, m in model.named_modules()
        if isinstance(m, loader.FP8Linear) and not n.endswith(".inner")
    }
    here = {"warmed": [], "failed": []}
    rows, rowwise, decode = prewarm.job_of(
        loader.scheme_from_config(json.loads((artifact / "config.json").read_text())["quantization_config"])
    )
    prewarm._work(
        AutoConfig.from_pretrained(artifact), linears, torch.bfloat16, torch.device("cpu"), rows, rowwise, here, decode
    )
    names = [w.rpartition(" ")[0] for w in answer["warmed"]]
    assert "sdpa" in names and names == [w.rpartition(" ")[0] for w in here["warmed"]] and answer["seconds"] > 0


def test_a_child_that_fails_or_hangs_is_an_answer_not_an_exception(monkeypatch):
    import sys

    from mpsconvert.infra.child import Child

    monkeypatch.setattr(
        Child, "command", [sys.executable, "-c", "import sys; sys.stderr.write('boom\\n'); sys.exit(3)"]
    )
    assert Child("x", {}).answer() == {"error": "the child exited with 3: boom"}
    monkeypatch.setattr(Child, "command", [sys.executable, "-c", "import time; time.sleep(60)"])
    hung = Child("x", {})
    assert hung.answer(timeout=0.5) == {"error": "no answer within 0.5 s"} and not hung.running()


class _FakeChild:
    def __init__(self, answer):
        self._answer, self.killed, self.asked = answer, False, None

    def answer(self, timeout=None):
        self.asked = timeout
        return self._answer

    def running(self):
        return not self.killed

    def kill(self):
        self.killed = True


def test_the_warm_up_waits_for_its_child_then_does_its_own_work(recorded):
    """The child starts first, before Triton's first use here; once the model is known its answer
    is awaited (bounded) and reported, then this thread's own work runs (finding the caches full)."""
    child = _FakeChild({"warmed": ["decode kernels 8x4 1.0s"], "failed": [], "seconds": 2.5})
    order = []
    warm = prewarm.Prewarm(torch.device("cpu"), child=lambda: order.append("child") or child)
    warm.begin("cfg", {"l": (8, 4)}, torch.bfloat16, 9, True, decode=("row", "token", None))
    report = warm.join()
    assert order == ["child"] and recorded[0] == "first use" and recorded[1][0] == "work"
    assert child.asked == prewarm.CHILD_WAIT_S and child.killed
    assert (
        report["child"]["started"]
        and report["child"]["seconds"] == 2.5
        and report["child"]["warmed"] == ["decode kernels 8x4 1.0s"]
    )
    failed = _FakeChild({"error": "the child exited with 1: CUDA out of memory"})
    warm = prewarm.Prewarm(torch.device("cpu"), child=lambda: failed)
    warm.begin("cfg", {"l": (8, 4)}, torch.bfloat16, 9, True)
    report = warm.join()
    assert report["child"] == {"started": True, "error": "the child exited with 1: CUDA out of memory"}
    assert recorded[-1][0] == "work"  # the work is done here all the same


def test_a_cancelled_load_kills_its_child(recorded):
    child = _FakeChild({})
    warm = prewarm.Prewarm(torch.device("cpu"), child=lambda: child)
    warm.cancel()
    warm._thread.join(timeout=10)
    assert child.killed and child.asked is None and recorded == ["first use"]


def test_the_thread_starts_its_child_without_importing_anything(artifact):
    """The warm-up thread reads the hint while the main thread imports transformers: an import on
    the thread then (eager_fusion's, for its probe rows) broke transformers' lazy module ("no
    attribute 'AutoConfig'", on an H100). With the loader imported, the hint imports nothing."""
    import subprocess
    import sys

    code = f"""
import sys, torch
from mpsconvert.runtime.load import loader, prewarm, prewarm_child
before = set(sys.modules)
req = prewarm_child.request({str(artifact)!r}, torch.bfloat16, torch.device("cuda", 0))
assert req is not None and req["linears"]
new = sorted(set(sys.modules) - before)
assert not new, new
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_no_child_for_kernels_this_machine_measured_before(artifact, tmp_path, monkeypatch):
    """The child pays on a cold machine only: where the kernel cache holds the decode decision of
    every GEMM the model will run (on this device, with this code), their compiles are in Triton's
    cache already and the child's own start would make the load slower, so none is started."""
    import json

    from mpsconvert.runtime.load import policy, prewarm_child

    started = []
    monkeypatch.setattr(prewarm_child.tritonlib, "available", lambda: True)
    monkeypatch.setattr(prewarm_child.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "GPU X")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (1 << 40, 1 << 40))
    monkeypatch.setattr(prewarm_child, "Child", lambda module, body: started.append(body) or "child")
    cache = tmp_path / "kernels.json"
    dev = torch.device("cuda", 0)
    assert prewarm_child.start(dev, artifact, torch.bfloat16, cache) == "child"  # nothing measured yet
    req = started[-1]
    gemms, _ = prewarm._shapes({k: tuple(v) for k, v in req["linears"].items()})
    keys = [policy.cache_key("GPU X", (n, k, "row", "token"), "decode", 1) for n, k in sorted(gemms)]
    cache.write_text(json.dumps({key: {"timings_us": {}} for key in keys[1:]}))
    assert prewarm_child.start(dev, artifact, torch.bfloat16, cache) == "child"  # one shape not measured
    cache.write_text(json.dumps({key: {"timings_us": {}} for key in keys}))
    assert prewarm_child.start(dev, artifact, torch.bfloat16, cache) is None
    assert (
        prewarm_child.start(dev, artifact, torch.bfloat16, False) is None
    )  # no cache: a warm machine cannot be told apart
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "GPU Y")
    assert prewarm_child.start(dev, artifact, torch.bfloat16, cache) == "child"  # another device's measurements
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (1 << 30, 1 << 40))
    assert prewarm_child.start(dev, artifact, torch.bfloat16, cache) is None  # no room for a second context
