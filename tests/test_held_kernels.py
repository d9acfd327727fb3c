"""runtime/load/held.py through the Triton interpreter: a model loaded on a machine's first run
computes with torch's kernels (no Triton launch) while its warm-up compiles ours, then takes them
at the next generation, as `load` installs them on a warm machine. The device is faked (the
patches' context and the policy's capabilities say CUDA; the tensors stay on CPU)."""

from __future__ import annotations

import contextlib
import threading
import warnings

import pytest
import torch

from mpsconvert.format.fp8 import relative_error
from mpsconvert.infra import devices
from mpsconvert.runtime import engine, patches
from mpsconvert.runtime.load import held, loader, policy, prewarm
from mpsconvert.runtime.load.load_report import LoadInfo
from mpsconvert.runtime.ops import kernels
from mpsconvert.runtime.ops import triton as tritonlib
from mpsconvert.runtime.ops.triton import act_quant
from mpsconvert.runtime.ops.triton import gemv as triton_gemv

from .helpers import prefilled
from .models import fp8_layers, tiny_model

pytestmark = pytest.mark.triton("interpret")

FAKE_GPU = devices.Capabilities("cuda", True, True, "FakeGPU")
CUDA = torch.device("cuda")


@pytest.fixture
def launches(monkeypatch):
    """Every launch of our Triton kernels that a forward makes: activation quantization and GEMVs."""
    seen = []
    for mod, name in ((act_quant, "_launch"), (triton_gemv, "gemv"), (triton_gemv, "dot_gemv")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: seen.append(_n) or _r(*a, **k))
    return seen


@pytest.fixture
def warm(monkeypatch):
    """A load's warm-up thread whose compiles last until `warm.release.set()` (off CUDA: its work faked)."""
    done = threading.Event()
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(prewarm, "_first_use", lambda report: None)
    monkeypatch.setattr(prewarm, "_work", lambda *a: done.wait(30))
    w = prewarm.Prewarm(torch.device("cpu"))
    w.begin(None, {}, torch.bfloat16, 1, True)
    w.release = done
    yield w
    done.set()
    w.join()


def _loaded_held(monkeypatch, warm, cache):
    """A tiny FP8 Llama as `load` leaves it on a machine's first run: the patches applied with
    their Triton ones held, the held policy's kernels, the held state installed with the loader's
    own `_install_held` (measuring faked: the GEMV fastest)."""
    monkeypatch.setattr(devices, "capabilities", lambda dev: FAKE_GPU)
    monkeypatch.setattr(policy.KernelPolicy, "_measure", lambda self, k, layer, m: 1.0 if k == "gemv" else 5.0)
    model = fp8_layers(tiny_model("llama", vocab=256, dtype=torch.bfloat16).requires_grad_(False))
    model.config._attn_implementation = "sdpa"
    ctx = patches.Context(CUDA, torch.bfloat16, held=True)
    info = LoadInfo(path="x", device="cuda", dtype="bfloat16", scheme="fp8-dynamic", weights="row", verify={})
    model.mpsconvert = info
    with warnings.catch_warnings(), tritonlib.holding():
        warnings.simplefilter("ignore")
        reports = patches.apply(model, ctx, "modules")
        pol = policy.KernelPolicy(CUDA, cache=cache, held=True)
        loader._kernels_and_forwards(model, ctx, reports, info, {}, None, pol, None)
    held.HeldKernels(model, warm, lambda: loader._install_held(model, ctx, reports, info, cache, warm))
    return model, reports


def _steps(model, prompt=(5, 6, 7, 8, 9)):
    e = prefilled(engine.Engine(model, static=True), list(prompt))
    return e, [e.step(t) for t in (10, 11, 12)]


def test_a_held_model_launches_no_triton_kernel_until_its_warm_up_is_done(monkeypatch, warm, launches, tmp_path):
    """While the warm-up runs, the model computes with torch's FP8 GEMM and torch's quantization
    (no Triton launch), its Triton patches are listed as held, and the engine says so; the
    generation after the warm-up is done installs them (the fused forwards, the GEMV the policy
    chose, the patches checked), captures again, and launches ours, with the held steps' logits
    and greedy tokens. The policy's cache then records this machine, so the next load holds
    nothing."""
    cache = tmp_path / "kernels.json"
    model, reports = _loaded_held(monkeypatch, warm, cache)
    for name in ("attention", "eager_fusion", "prefill_graphs"):
        assert reports[name].skipped == patches.HELD, reports[name]
    assert [p.name for p in patches.held_back(reports)] == ["attention", "eager_fusion", "prefill_graphs"]
    assert {d["choice"] for d in model.mpsconvert.kernels} == {"scaled_mm_row"}
    assert not cache.exists()  # nothing measured, nothing recorded
    e, before = _steps(model)
    assert launches == [] and e.decode_report["kernels"] == held.HeldKernels.NOTE
    assert held.held(model) is not None and not tritonlib.held()  # held inside the model's forward only

    warm.release.set()
    warm._thread.join(10)
    e.reserve(32)  # the engine's next generation: takes them
    assert held.held(model) is None and e.capacity >= 32
    assert "kernels" not in e.decode_report
    assert model.mpsconvert.patches["eager_fusion"]["installed"] > 0
    assert {d["choice"] for d in model.mpsconvert.kernels if d["bucket"] == "decode"} == {"gemv"}
    assert set(model.mpsconvert.seconds["held"]) >= {"install", "kernels", "patches", "after_load_s", "total"}
    _, after = _steps(model)
    assert "gemv" in launches and "_launch" in launches
    for g, w in zip(after, before):
        assert relative_error(g, w) < 2**-4, relative_error(g, w)  # e4m3 activations vs BF16 into the GEMV
        assert torch.equal(g.argmax(-1), w.argmax(-1))
    linears = {
        n: tuple(m.weight.shape)
        for n, m in tiny_model("llama", vocab=256).named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers." in n
    }
    assert policy.decided_before(FAKE_GPU.name, prewarm.signatures(linears, ("row", "token", None)), cache)


def test_take_if_ready_waits_for_nothing_and_finish_waits_for_the_warm_up(monkeypatch, warm, tmp_path):
    """The engine's check never waits; `finish` (closing a chat) does, once, and is idempotent."""
    model, _ = _loaded_held(monkeypatch, warm, tmp_path / "kernels.json")
    h = held.held(model)
    assert not h.ready() and not h.take_if_ready() and held.held(model) is h
    threading.Timer(0.2, warm.release.set).start()
    assert held.finish(model) and held.held(model) is None and "forward" not in model.__dict__
    assert not held.finish(model)
    assert model.mpsconvert.seconds["held"]["prewarm_wait"] >= 0.1


def test_without_triton_is_an_fp8_gemm_of_torch_or_a_dequantizing_one():
    """The held policy's rule for every scheme: torch's FP8 GEMM where one takes the layer, else
    dequantizing per call; never a Triton kernel, never a second (dense) copy of the weight."""

    def rule(acts, weights, bucket, block=None):
        return kernels.without_triton(kernels.candidates("cuda", acts, weights, bucket, block))

    assert rule("token", "row", "decode") == rule("token", "row", "prefill") == "scaled_mm_row"
    assert rule("tensor", "tensor", "decode") == "scaled_mm_tensor"
    assert rule(None, "row", "decode") == rule(None, "row", "prefill") == "dequant"
    assert rule("group", "block", "decode", 128) == "scaled_mm_block"
    assert rule(None, "block", "decode", 128) == "dequant"


def test_holding_runs_the_torch_ops_of_every_kernel_entry(launches):
    """Inside `holding()` the activation quantization runs torch's ops (bit for bit the same codes),
    outside it our kernel."""
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with tritonlib.holding():
        assert tritonlib.held()
        q, s = act_quant.quantize(x)
    assert launches == [] and not tritonlib.held()
    q2, s2 = act_quant.quantize(x)
    assert launches == ["_launch"]
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.allclose(s, s2)


def test_load_holds_only_on_a_machine_that_has_not_run_these_kernels(monkeypatch, tmp_path):
    """`_holds`: a warm-up, Triton, the default measuring and caching, and no record in the cache."""
    from mpsconvert.format.schemes import Scheme

    monkeypatch.setattr(devices, "capabilities", lambda dev: FAKE_GPU)
    linears = {"model.layers.0.mlp.down_proj": (64, 128)}
    scheme = Scheme.make("fp8-dynamic")
    cache = tmp_path / "kernels.json"
    assert loader._holds(CUDA, object(), cache, None, linears, scheme)
    assert not loader._holds(CUDA, None, cache, None, linears, scheme)  # no warm-up (CPU, MPS, eager_fusion off)
    assert not loader._holds(CUDA, object(), False, None, linears, scheme)  # no cache: every load measures
    assert not loader._holds(CUDA, object(), cache, lambda *a: 1.0, linears, scheme)  # an injected timer
    sig = prewarm.signatures(linears, prewarm.job_of(scheme)[2])[0]
    cache.write_text('{"%s": {"source": "prior"}}' % policy.cache_key(FAKE_GPU.name, sig, "decode", 1))
    assert not loader._holds(CUDA, object(), cache, None, linears, scheme)
