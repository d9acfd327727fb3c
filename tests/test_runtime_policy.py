"""The kernel policy's choices from injected measurements, its cache, and the kernels' arithmetic."""

from __future__ import annotations

import json

import pytest
import torch

from mpsconvert.errors import DeviceError
from mpsconvert.format import fp8
from mpsconvert.infra.devices import Capabilities
from mpsconvert.runtime.load import policy as policy_mod
from mpsconvert.runtime.load.policy import KernelPolicy
from mpsconvert.runtime.ops import kernels
from mpsconvert.runtime.ops import triton as tritonlib
from mpsconvert.runtime.ops.fp8linear import DECODE_MAX_M, PREFILL_BUCKETS, FP8Linear, bucket_index
from mpsconvert.runtime.ops.fuse import FusedFP8

CUDA = torch.device("cuda")  # never touched: measurements are injected, capabilities given
FAKE_GPU = Capabilities("cuda", True, True, "FakeGPU")


def layer(n=64, k=32, gran="row", act="token", seed=0, input_scale=None):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, s, _ = fp8.quantize(w, gran)
    isc = torch.tensor([input_scale]) if input_scale is not None else None
    return FP8Linear.from_tensors(q, s, activations=act, input_scale=isc)


class Model(torch.nn.Module):
    def __init__(self, *layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)


def fake(table):
    """measure(kernel, layer, m) from a table {(m, kernel): us}; a prefill bucket without its own
    entries takes the 2048 row's; missing -> the kernel cannot run."""
    calls = []

    def measure(kernel, lay, m):
        calls.append((kernel, lay.signature, m))
        key = (m, kernel) if (m, kernel) in table or m == 1 or any(k[0] == m for k in table) else (2048, kernel)
        if key not in table:
            raise RuntimeError(f"{kernel} unsupported")
        return table[key]

    measure.calls = calls
    return measure


@pytest.fixture
def with_triton(monkeypatch):
    monkeypatch.setattr(tritonlib, "available", lambda: True)


def policy(measure, tmp_path, **kw):
    return KernelPolicy(CUDA, decode_m=1, measure=measure, cache=tmp_path / "k.json", capabilities=FAKE_GPU, **kw)


def test_fastest_kernel_per_bucket(tmp_path, with_triton):
    m = fake(
        {
            (1, "scaled_mm_row"): 41.0,
            (1, "gemv"): 19.0,
            (1, "gemv_splitk"): 22.0,
            (1, "gemv_w8a8"): 23.0,
            (1, "bf16"): 34.0,
            (2048, "scaled_mm_row"): 240.0,
            (2048, "dequant"): 740.0,
            (2048, "bf16"): 300.0,
        }
    )
    model = Model(layer(), layer(seed=1))
    decisions = policy(m, tmp_path).apply(model)
    assert [(d.bucket, d.m, d.choice, d.layers) for d in decisions] == [("decode", 1, "gemv", 2)] + [
        ("prefill", m, "scaled_mm_row", 2) for m in PREFILL_BUCKETS
    ]
    assert all(l.kernels == {"decode": "gemv", "prefill": "scaled_mm_row"} for l in model.layers)
    assert all(l.weight.dtype == torch.float8_e4m3fn and l.dense_weight is None for l in model.layers)  # FP8 kept
    assert {c[0] for c in m.calls if c[2] == 1} == {
        "scaled_mm_row",
        "gemv",
        "gemv_splitk",
        "gemv_w8a8",
        "bf16",
    }  # one signature measured once


def test_bf16_fallback_only_when_faster_in_both_buckets_and_recorded(tmp_path, with_triton):
    both = fake(
        {
            (1, "scaled_mm_row"): 50.0,
            (1, "gemv"): 40.0,
            (1, "gemv_splitk"): 45.0,
            (1, "gemv_w8a8"): 46.0,
            (1, "bf16"): 30.0,
            (2048, "scaled_mm_row"): 400.0,
            (2048, "dequant"): 900.0,
            (2048, "bf16"): 300.0,
        }
    )
    lay = layer()
    dec, pre, *_ = policy(both, tmp_path).apply(Model(lay))
    assert dec.choice == pre.choice == "bf16" and "fallback" in dec.note
    assert lay.weight is None and lay.dense_weight.dtype == torch.bfloat16  # the FP8 copy is not kept beside it
    one = fake(
        {
            (1, "scaled_mm_row"): 50.0,
            (1, "gemv"): 20.0,
            (1, "gemv_splitk"): 21.0,
            (1, "gemv_w8a8"): 22.0,
            (1, "bf16"): 30.0,
            (2048, "scaled_mm_row"): 400.0,
            (2048, "dequant"): 900.0,
            (2048, "bf16"): 300.0,
        }
    )
    lay = layer()
    dec, pre, *_ = policy(one, tmp_path / "b").apply(Model(lay))
    assert (dec.choice, pre.choice) == ("gemv", "scaled_mm_row") and "FP8 kept" in pre.note
    assert lay.weight is not None and lay.dense_weight is None


@pytest.mark.filterwarnings("ignore:mpsconvert kernel")
def test_kernel_that_cannot_run_is_recorded_and_skipped(tmp_path, with_triton):
    m = fake(
        {
            (1, "bf16"): 30.0,
            (1, "gemv"): 25.0,
            (1, "gemv_splitk"): 26.0,
            (1, "gemv_w8a8"): 27.0,
            (2048, "dequant"): 500.0,
            (2048, "bf16"): 300.0,
        }
    )
    with pytest.warns(UserWarning, match="scaled_mm_row cannot run a 64x32 layer on FakeGPU"):
        dec, pre, *_ = policy(m, tmp_path).apply(Model(layer()))
    assert dec.timings_us["scaled_mm_row"].startswith("error: RuntimeError: scaled_mm_row unsupported")
    assert (dec.choice, pre.choice) == ("gemv", "dequant")
    with pytest.raises(DeviceError, match="no FP8 kernel runs"):
        policy(fake({}), tmp_path / "c").apply(Model(layer()))


def test_a_triton_kernel_that_computes_something_else_is_never_timed(monkeypatch):
    """Our Triton decode kernels are checked against the dequantized product before they are
    timed: a wrong one raises (the policy records it as an error, above, and chooses another); a
    close one (the W8A8 GEMV's rounding of the activations) is timed."""
    lay = layer(64, 32)
    pol = KernelPolicy(torch.device("cpu"), cache=False, capabilities=FAKE_GPU)
    monkeypatch.setitem(
        kernels.FNS, "gemv_splitk", lambda mod, x: torch.zeros(x.shape[0], mod.out_features, dtype=x.dtype)
    )
    with pytest.raises(RuntimeError, match="gemv_splitk disagrees with the dequantized product"):
        pol._measure("gemv_splitk", lay, 1)
    monkeypatch.setitem(kernels.FNS, "gemv_splitk", lambda mod, x: kernels.dequant(mod, x) * 1.03)
    assert pol._measure("gemv_splitk", lay, 1) > 0
    monkeypatch.setitem(kernels.FNS, "gemv_splitk", lambda mod, x: kernels.dequant(mod, x) * float("nan"))
    with pytest.raises(RuntimeError, match="relative error nan"):
        pol._measure("gemv_splitk", lay, 1)
    static = layer(
        64, 32, gran="tensor", act="tensor", input_scale=1e-3
    )  # random inputs clip at 448 * 1e-3: the scheme's rounding
    monkeypatch.setitem(kernels.FNS, "gemv_w8a8", lambda mod, x: kernels.dequant(mod, kernels.scheme_rounded(mod, x)))
    assert pol._measure("gemv_w8a8", static, 1) > 0  # checked against the clipped product, as the kernel computes it
    from mpsconvert.runtime.load.policy import CHECK_BOUND

    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(2))
    clipped, plain = kernels.dequant(static, kernels.scheme_rounded(static, x)), kernels.dequant(static, x)
    assert (
        float((clipped - plain).norm() / plain.norm()) > CHECK_BOUND
    )  # against the unrounded product it would have failed


def test_candidates_follow_scheme_and_device(with_triton):
    assert kernels.candidates("cuda", "tensor", "tensor", "prefill") == ["scaled_mm_tensor", "dequant", "bf16"]
    assert kernels.candidates("cuda", "tensor", "row", "decode") == [
        "scaled_mm_row",
        "gemv",
        "gemv_splitk",
        "gemv_w8a8",
        "bf16",
    ]
    assert kernels.candidates("cuda", None, "row", "decode") == [
        "gemv",
        "gemv_splitk",
        "bf16",
    ]  # weight-only never quantizes x
    assert kernels.candidates("mps", "token", "row", "decode") == [
        "scaled_mm_row",
        "dequant",
        "bf16",
    ]  # no Triton on MPS
    assert kernels.candidates("cpu", "token", "row", "decode") == ["dense_qact"]
    assert kernels.candidates("cpu", None, "row", "prefill") == ["bf16"]
    # block scales: the blockwise scaled_mm (group activations, 128-blocks), the GEMV at decode where it reads the block
    # edge
    assert kernels.candidates("cuda", "group", "block", "decode", 128) == ["scaled_mm_block", "gemv", "dequant", "bf16"]
    assert kernels.candidates("cuda", None, "block", "decode", 64) == ["gemv", "dequant", "bf16"]
    assert kernels.candidates("cuda", None, "block", "decode", 16) == [
        "dequant",
        "bf16",
    ]  # a tile's rows would span two
    assert kernels.candidates("cuda", "group", "block", "prefill", 128) == ["scaled_mm_block", "dequant", "bf16"]
    assert kernels.candidates("mps", None, "block", "decode", 128) == ["dequant", "bf16"]


def test_decisions_are_cached_per_device_torch_shape_and_scheme(tmp_path, with_triton, monkeypatch):
    table = {
        (1, "scaled_mm_row"): 41.0,
        (1, "gemv"): 19.0,
        (1, "gemv_splitk"): 22.0,
        (1, "gemv_w8a8"): 23.0,
        (1, "bf16"): 34.0,
        (2048, "scaled_mm_row"): 240.0,
        (2048, "dequant"): 740.0,
        (2048, "bf16"): 300.0,
    }
    first = fake(table)
    policy(first, tmp_path).apply(Model(layer()))
    body = json.loads((tmp_path / "k.json").read_text())
    key = next(k for k in body if k.endswith("decode M=1"))
    assert key.startswith("FakeGPU|torch ") and "64x32|weights=row|acts=token" in key
    again = fake(table)
    dec, pre, *_ = policy(again, tmp_path).apply(Model(layer()))
    assert again.calls == [] and dec.source == pre.source == "cache" and dec.choice == "gemv"
    from mpsconvert.runtime.load import policy as policy_mod

    assert f"|kernels {policy_mod.kernels_digest()}|" in key and len(policy_mod.kernels_digest()) == 12
    with monkeypatch.context() as mp:
        mp.setattr(
            policy_mod, "kernels_digest", lambda: "0123456789ab"
        )  # other kernels (another mpsconvert): measured again
        changed = fake(table)
        policy(changed, tmp_path).apply(Model(layer()))
        assert changed.calls
    other = fake(table | {(1, "scaled_mm_tensor"): 1.0, (2048, "scaled_mm_tensor"): 1.0})
    policy(other, tmp_path).apply(
        Model(layer(gran="tensor", act="tensor", input_scale=0.05))
    )  # another scheme: measured
    assert other.calls
    (tmp_path / "k.json").write_text("{not json")  # a broken cache is re-measured, never trusted
    fresh = fake(table)
    policy(fresh, tmp_path).apply(Model(layer()))
    assert fresh.calls


def test_cpu_is_decided_by_rule_without_measuring(tmp_path):
    m = fake({})
    lay = layer()
    dec, pre = KernelPolicy(torch.device("cpu"), measure=m, cache=False).apply(
        Model(lay)
    )  # one prefill rule for every length
    assert m.calls == [] and dec.source == "rule" and pre.choice == "dense_qact"
    assert lay.weight is None and lay.dense_weight is not None


@pytest.mark.parametrize("gran,act,iscale", [("row", "token", None), ("tensor", "tensor", 0.05), ("row", None, None)])
def test_kernels_compute_the_same_thing(gran, act, iscale):
    """dequant, scaled_mm (torch._scaled_mm runs on CPU for tiny shapes) and the CPU dense path agree with
    the direct computation: x rounded through e4m3 as the scheme says, times the dequantized weight."""
    lay = layer(48, 32, gran, act, input_scale=iscale)
    x = (torch.randn(6, 32) * 0.1).to(torch.bfloat16)
    w = fp8.dequantize(lay.weight, lay.weight_scale, torch.float32)
    xf = x.float()
    if act == "token":
        xf = fp8.fake_quantize(xf, fp8.per_token_scale(xf))
    elif act == "tensor":
        xf = fp8.fake_quantize(xf, torch.tensor(iscale))
    want = xf @ w.T
    names = ["dense_qact" if act else "bf16"] + (
        [{"row": "scaled_mm_row", "tensor": "scaled_mm_tensor"}[gran]] if act else []
    )
    for name in names:
        probe = layer(48, 32, gran, act, input_scale=iscale)
        probe.set_kernels(name, name)
        got = probe(x).float()
        assert torch.allclose(got, want, rtol=1e-2, atol=1e-2), (name, (got - want).abs().max())
    lay.set_kernels("dequant", "dequant")
    assert torch.allclose(lay(x).float(), x.float() @ w.T, rtol=1e-2, atol=1e-2)  # weight-only arithmetic
    with pytest.raises(ValueError, match="two copies"):
        layer().set_kernels("bf16", "scaled_mm_row")


def test_fused_projection_matches_separate_layers():
    q, k, v = layer(64, 32, seed=1), layer(32, 32, seed=2), layer(32, 32, seed=3)
    fused = FusedFP8([q, k, v])
    assert fused.inner.weight.shape == (128, 32) and fused.inner.weights == "row"
    x = torch.randn(5, 32).to(torch.bfloat16)
    for lay in (q, k, v, fused.inner):
        lay.set_kernels("scaled_mm_row", "scaled_mm_row")
    for a, b in zip(fused(x), (q(x), k(x), v(x))):
        assert torch.equal(a, b)
    t1, t2 = (
        layer(16, 32, "tensor", "tensor", seed=4, input_scale=0.1),
        layer(16, 32, "tensor", "tensor", seed=5, input_scale=0.2),
    )
    with pytest.raises(ValueError, match="static input scales differ"):
        FusedFP8([t1, t2])


@pytest.mark.parametrize("gran,act,iscale,rowwise", [("row", "token", None, True), ("tensor", "tensor", 0.05, False)])
def test_mps_call_form_matches_cuda_call_form(gran, act, iscale, rowwise):
    """The F.scaled_mm (ScalingType) call used on MPS gives what torch._scaled_mm gives, on CPU where both run."""
    lay = layer(48, 32, gran, act, input_scale=iscale)
    x = (torch.randn(6, 32) * 0.1).to(torch.bfloat16)
    xq, xs = kernels.quantize_acts(x, lay.input_scale if act == "tensor" else None)
    sa, sb = (xs, lay.scale_row) if rowwise else (lay.input_scale_0d, lay.scale_0d)
    a = kernels._mm(xq, sa, lay.weight, sb, torch.bfloat16, functional=False)
    b = kernels._mm(xq, sa, lay.weight, sb, torch.bfloat16, functional=True)
    assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3)


def test_unwritable_cache_warns_and_still_decides(tmp_path, with_triton):
    blocker = tmp_path / "file"
    blocker.write_text("")
    m = fake(
        {
            (1, "gemv"): 1.0,
            (1, "gemv_splitk"): 1.5,
            (1, "gemv_w8a8"): 1.6,
            (1, "bf16"): 2.0,
            (1, "scaled_mm_row"): 3.0,
            (2048, "scaled_mm_row"): 1.0,
            (2048, "dequant"): 3.0,
            (2048, "bf16"): 2.0,
        }
    )
    pol = KernelPolicy(CUDA, measure=m, cache=blocker / "sub" / "k.json", capabilities=FAKE_GPU)
    with pytest.warns(UserWarning, match="kernel cache .* not written"):
        dec, pre, *_ = pol.apply(Model(layer()))
    assert (dec.choice, pre.choice) == ("gemv", "scaled_mm_row")


def test_buckets_cover_every_length_and_each_runs_its_own_kernel(tmp_path, with_triton, monkeypatch):
    """No caller names a prompt length: every row count above the decode bucket falls in exactly
    one prefill bucket (the smallest bound at or above it; the last beyond), each bucket is
    measured at its bound, and a layer runs the kernel chosen for the bucket of its call."""
    assert [bucket_index(r) for r in (DECODE_MAX_M + 1, 16, 17, 128, 129, 512, 513, 2048, 2049, 8192, 100_000)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
        4,
        4,
        4,
    ]
    for rows in range(DECODE_MAX_M + 1, 9000, 7):
        i = bucket_index(rows)
        assert rows <= PREFILL_BUCKETS[i] or i == len(PREFILL_BUCKETS) - 1
        assert i == 0 or rows > PREFILL_BUCKETS[i - 1]
    # dequant wins the short prompts, scaled_mm_row the long ones (as on the H200: launch-bound vs GEMM-bound)
    table = {
        (1, "gemv"): 10.0,
        (1, "gemv_splitk"): 11.0,
        (1, "gemv_w8a8"): 12.0,
        (1, "scaled_mm_row"): 20.0,
        (1, "bf16"): 30.0,
    }
    for m in PREFILL_BUCKETS:
        table |= {(m, "scaled_mm_row"): 5.0 * m / 128 + 9, (m, "dequant"): 10.0 * m / 128 + 5, (m, "bf16"): 100.0 * m}
    meas = fake(table)
    lay = layer()
    decisions = policy(meas, tmp_path).apply(Model(lay))
    assert sorted({c[2] for c in meas.calls}) == [1, *PREFILL_BUCKETS]
    want = {16: "dequant", 128: "scaled_mm_row", 512: "scaled_mm_row", 2048: "scaled_mm_row", 8192: "scaled_mm_row"}
    assert {d.m: d.choice for d in decisions if d.bucket == "prefill"} == want and lay.kernels["prefill"] == want
    ran = []
    for name in ("dequant", "scaled_mm_row", "gemv"):
        monkeypatch.setitem(
            kernels.FNS,
            name,
            (lambda n: lambda mod, x, *a: ran.append(n) or torch.zeros(x.shape[0], mod.out_features))(name),
        )
    lay.set_kernels("gemv", want)  # re-install: the layer took the functions when it was set
    for rows in (1, 5, 16, 17, 600, 10000):
        lay(torch.zeros(rows, 32, dtype=torch.bfloat16))
    assert ran == ["gemv", "dequant", "dequant", "scaled_mm_row", "scaled_mm_row", "scaled_mm_row"]


def test_a_kernel_is_timed_over_weights_that_outgrow_the_cache(monkeypatch):
    """A decode step reads each layer's weight once from memory, so a kernel is timed calling the
    layers of its signature in turn, as many as twice the device's last cache holds (one weight
    called again and again would be timed from L2); the BF16 candidate likewise over as many
    dense twins. A signature with one layer, or a layer decided alone, is timed on itself."""
    layers = [layer(n=64, k=32, seed=i) for i in range(5)]
    code_bytes = 64 * 32  # one e4m3 code per weight
    caps = Capabilities("cpu", True, False, "FakeDevice", cache_bytes=code_bytes)  # two layers' codes outgrow it twice
    pol = KernelPolicy(torch.device("cpu"), cache=False, capabilities=caps)
    called, dense = [], []
    monkeypatch.setitem(
        kernels.FNS, "dequant", lambda mod, x: called.append(mod) or torch.zeros(x.shape[0], mod.out_features)
    )
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(
        torch.nn.functional, "linear", lambda x, w, b=None: dense.append(w.data_ptr()) or real_linear(x, w, b)
    )

    pol._peers = {layers[0].signature: layers}  # as `apply` sets them while it decides
    assert pol.streamed(layers[0], code_bytes) == 2 and pol.streamed(layers[0], 2 * code_bytes) == 1
    pol._measure("dequant", layers[3], 1)
    assert {id(m) for m in called} == {id(layers[3]), id(layers[0])}  # the layer decided, then its peers in turn
    pol._measure("bf16", layers[3], 1)  # BF16 twins hold two bytes a weight: one of them outgrows the cache twice
    assert len(set(dense)) == 1

    caps_big = Capabilities("cpu", True, False, "FakeDevice", cache_bytes=100 * code_bytes)
    pol = KernelPolicy(torch.device("cpu"), cache=False, capabilities=caps_big)
    pol._peers = {layers[0].signature: layers}
    called.clear(), dense.clear()
    pol._measure("dequant", layers[1], 1)
    assert {id(m) for m in called} == {id(m) for m in layers}  # all five, and no more than there are
    pol._measure("bf16", layers[1], 1)
    assert len(set(dense)) == 5
    pol._peers = {}  # outside `apply`: the layer alone
    called.clear()
    pol._measure("dequant", layers[1], 1)
    assert {id(m) for m in called} == {id(layers[1])}


def _prior_table(monkeypatch, device, sig, decode, prefill=None):
    from mpsconvert.runtime.ops.triton import tuned

    rows = {tuned.policy_key(sig, "decode", 1): decode}
    rows.update({tuned.policy_key(sig, "prefill", m): prefill for m in PREFILL_BUCKETS} if prefill else {})
    monkeypatch.setattr(tuned, "_table", lambda: {device: {"policy": rows}})


def test_recorded_timings_stand_in_for_measuring_on_the_gpu_they_were_taken_on(tmp_path, with_triton, monkeypatch):
    """ops/triton/tuned.json: on a GPU of the recorded name, a signature's recorded timings decide without
    measuring (source "prior"; the user's cache records only that they were used, so that the next load starts
    no warm-up child); another GPU, a signature not
    recorded, or MPSCONVERT_TUNED=0 measures."""
    lay = layer(64, 32)
    decode = {"scaled_mm_row": 5.0, "gemv": 9.0, "gemv_splitk": 9.5, "gemv_w8a8": 9.9, "bf16": 12.0}
    prefill = {"scaled_mm_row": 20.0, "dequant": 90.0, "bf16": 30.0}
    _prior_table(monkeypatch, "FakeGPU", lay.signature, decode, prefill)
    m = fake({(1, "scaled_mm_row"): 20.0, (1, "gemv"): 1.0, (1, "gemv_splitk"): 3.0, (1, "gemv_w8a8"): 2.0,
              (1, "bf16"): 4.0, (2048, "scaled_mm_row"): 9.0, (2048, "dequant"): 8.0, (2048, "bf16"): 7.0})  # fmt: skip
    pol = policy(m, tmp_path)
    assert pol.priors is False  # an injected measurement is never replaced
    pol.priors = True
    dec, *pre = pol.decide(lay)
    assert (dec.source, dec.choice, dec.timings_us) == ("prior", "scaled_mm_row", decode)
    assert all(d.source == "prior" and d.choice == "scaled_mm_row" for d in pre) and m.calls == []
    pol.apply(Model(layer(64, 32)))
    cached = json.loads((tmp_path / "k.json").read_text())  # priors are not the user's measurements: no timings,
    assert cached and all(set(v) == {"source", "used"} and v["source"] == "prior" for v in cached.values())
    assert policy_mod.decided_before("FakeGPU", [lay.signature], tmp_path / "k.json")  # but their kernels ran here
    assert pol.decide(lay)[0].source == "prior"  # and the table is read again, not the cache

    monkeypatch.setenv("MPSCONVERT_TUNED", "0")
    dec, *_ = pol.decide(lay)
    assert (dec.source, dec.choice) == ("measured", "gemv") and m.calls
    monkeypatch.delenv("MPSCONVERT_TUNED")
    other = KernelPolicy(CUDA, measure=fake({(1, "gemv"): 1.0, (2048, "bf16"): 7.0}), cache=False,
                         capabilities=Capabilities("cuda", True, True, "OtherGPU"))  # fmt: skip
    other.priors = True
    assert other.decide(lay)[0].source == "measured"


def test_a_recorded_choice_that_computes_something_else_here_is_measured_instead(monkeypatch):
    """The recorded fastest kernel, when it is one of our Triton kernels, is checked against the
    dequantized product on this machine before the prior is taken."""
    lay = layer(64, 32)
    pol = KernelPolicy(torch.device("cpu"), cache=False, capabilities=FAKE_GPU)
    prior = {"gemv": 1.0, "bf16": 2.0}
    monkeypatch.setitem(kernels.FNS, "gemv", lambda mod, x: kernels.dequant(mod, x))
    assert pol._prior_holds(lay, prior, 1)
    monkeypatch.setitem(kernels.FNS, "gemv", lambda mod, x: torch.zeros(x.shape[0], mod.out_features, dtype=x.dtype))
    with pytest.warns(UserWarning, match="recorded kernel choice does not hold here"):
        assert not pol._prior_holds(lay, prior, 1)
    assert pol._prior_holds(lay, {"scaled_mm_row": 1.0, "gemv": 2.0}, 1)  # torch's own kernel: not ours to check


def test_the_autotuners_compile_only_the_recorded_configuration(monkeypatch):
    """ops/triton/tuned.prune: on the recorded GPU and key, the one recorded configuration (a fused norm or
    residual form not recorded: its plain form's); otherwise all."""
    from types import SimpleNamespace

    from mpsconvert.runtime.ops.triton import tuned

    cfg = lambda bn, bk, w, s: SimpleNamespace(kwargs={"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)  # noqa: E731
    configs = [cfg(4, 1024, 4, 2), cfg(8, 512, 4, 2), cfg(2, 2048, 4, 3)]
    rec = {"N=64,K=32,M=1,GATED=False": {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "num_stages": 2}}
    monkeypatch.setattr(tuned, "_table", lambda: {"FakeGPU": {"autotune": {"gemv": rec}}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tuned, "_device_name", lambda i: "FakeGPU")
    prune = tuned.prune("gemv", ["N", "K", "M", "GATED"])
    assert prune(configs, {"N": 64, "K": 32}, M=1, GATED=False) == [configs[1]]
    assert prune(configs, {"N": 64, "K": 64}, M=1, GATED=False) == configs  # a key not recorded
    monkeypatch.setattr(tuned, "_device_name", lambda i: "OtherGPU")
    assert prune(configs, {"N": 64, "K": 32}, M=1, GATED=False) == configs
    monkeypatch.setattr(tuned, "_device_name", lambda i: "FakeGPU")
    fused = tuned.prune("gemv", ["N", "K", "M", "GATED", "NORM", "RESIDUAL"])
    rec["N=64,K=32,M=1,GATED=False,NORM=False,RESIDUAL=False"] = rec["N=64,K=32,M=1,GATED=False"]
    rec["N=64,K=32,M=1,GATED=False,NORM=True,RESIDUAL=False"] = {**rec["N=64,K=32,M=1,GATED=False"], "BLOCK_N": 2}
    plain = {"N": 64, "K": 32, "M": 1, "GATED": False}
    assert fused(configs, plain, NORM=True, RESIDUAL=False) == configs  # its own record: not among the configs
    assert fused(configs, plain, NORM=False, RESIDUAL=True) == [configs[1]]  # not recorded: the plain form's tile
    assert fused(configs, {**plain, "K": 64}, NORM=False, RESIDUAL=True) == configs  # neither recorded
    monkeypatch.setenv("MPSCONVERT_TUNED", "0")
    assert prune(configs, {"N": 64, "K": 32}, M=1, GATED=False) == configs


def test_the_shipped_table_names_real_candidates_and_configurations(with_triton):
    """ops/triton/tuned.json: every recorded policy entry times exactly the candidates the policy offers a
    CUDA machine for that bucket (else it would never be taken), and every recorded autotune
    configuration is one of that kernel's own."""
    from mpsconvert.runtime.ops.triton import gemv, moe_gemv, tuned

    table = json.loads(tuned.FILE.read_text())
    assert table, "ops/triton/tuned.json is empty"
    own = {"gemv": gemv._CONFIGS, "gemv_w8a8": gemv._DOT_CONFIGS, "gemv_splitk": moe_gemv._CONFIGS}
    fields = {"gemv_splitk": ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps")}
    for device, body in table.items():
        for key, timings in body["policy"].items():
            _, weights, acts, bucket = key.split("|")
            acts = None if acts == "acts=bf16" else acts.removeprefix("acts=")
            want = kernels.candidates("cuda", acts, weights.removeprefix("weights="), bucket.split()[0], None, True)
            assert set(timings) == set(want), (device, key)
        for name, rows in body["autotune"].items():
            names = fields.get(name, ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))
            assert all(tuple(cfg[f] for f in names) in own[name] for cfg in rows.values()), (device, name)
