"""The load's warm-up thread (runtime/load/prewarm.py): the GEMM shapes it derives are the ones
fuse.py makes, and every call it makes is a valid call of our kernels and torch's (interpreted
on CPU: a call with a wrong signature would be listed as failed)."""

from __future__ import annotations

import pytest
import torch

from mpsconvert.runtime.load import prewarm


def test_shapes_are_the_fused_gemms():
    linears = {}
    for i in range(2):
        p = f"model.layers.{i}.self_attn"
        linears |= {f"{p}.q_proj": (4096, 4096), f"{p}.k_proj": (1024, 4096), f"{p}.v_proj": (1024, 4096), f"{p}.o_proj": (4096, 4096)}
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
    assert recorded[1] == ("work", ("cfg", {"l": (8, 4)}, torch.bfloat16, torch.device("cpu"), 9, True, report, ("row", "token", None)))
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
    from mpsconvert.convert.quantize import Options, quantize_snapshot
    from mpsconvert.errors import ArtifactError
    from mpsconvert.manifests.schemes import Scheme
    from mpsconvert.runtime.load import loader
    from mpsconvert.source import resolve

    from . import models

    started = []
    monkeypatch.setattr(prewarm, "start", lambda dev: started.append(_Recorder()) or started[-1])
    with pytest.raises(ArtifactError):
        loader.load(tmp_path / "nothing", device="cpu")
    assert started[-1].cancelled and started[-1].begun is None
    src = models.tiny("llama", tmp_path / "bf16", dtype=torch.bfloat16, tie=False)
    quantize_snapshot(resolve(str(src)), tmp_path / "art", Options(scheme=Scheme.make("fp8-dynamic", "row"), force=True))
    model = loader.load(tmp_path / "art", device="cpu")
    warm = started[-1]
    linears, rowwise, decode = warm.begun
    assert linears == {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, loader.FP8Linear)}
    assert rowwise and decode == ("row", "token", None) and warm.joined
    assert "prewarm_wait" in model.mpsconvert.seconds
    loader.load(tmp_path / "art", device="cpu", eager_fusion=False)
    assert started[-1] is warm  # no warm-up asked for: none started


@pytest.mark.triton("interpret")
def test_every_warm_up_call_is_valid():
    import torch
    from transformers import LlamaConfig
    from mpsconvert.runtime.load import prewarm
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
    linears = {"l.q_proj": (64, 64), "l.k_proj": (32, 64), "l.v_proj": (32, 64), "l.o_proj": (64, 64),
               "l.gate_proj": (96, 64), "l.up_proj": (96, 64), "l.down_proj": (64, 96)}
    report = {"warmed": [], "failed": []}
    prewarm._work(cfg, linears, torch.bfloat16, torch.device("cpu"), 9, False, report, decode=("row", "token", None))
    assert report["failed"] == [], report["failed"]
    names = [w.rpartition(" ")[0] for w in report["warmed"]]
    assert names == ["decode kernels 64x64", "decode kernels 64x96", "decode kernels 128x64", "decode kernels 192x64",
                     "quantize 64", "quantize 96", "silu_mul_quantize 192", "rms_norm", "rotary", "sdpa"], names
    report = {"warmed": [], "failed": []}  # block-scaled weights: the GEMV's block variant
    prewarm._work(cfg, linears, torch.bfloat16, torch.device("cpu"), 9, False, report, decode=("block", None, 32))
    assert report["failed"] == [], report["failed"]
    assert [w.rpartition(" ")[0] for w in report["warmed"]][:4] == ["decode kernels 64x64", "decode kernels 64x96",
                                                                      "decode kernels 128x64", "decode kernels 192x64"]


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
