"""Observers against hand-computed values, and their bounded memory."""

import weakref

import pytest
import torch

from mpsconvert.calibrate import hooks, observers
from mpsconvert.errors import QuantizationError
from mpsconvert.format import fp8


def test_minmax_is_the_true_running_max_not_an_ema():
    o = observers.Observer()
    o.update(torch.tensor([[1.0, -5.0], [2.0, 0.5]]))
    o.update(torch.tensor([3.0, -0.25]))  # smaller batch after a larger one: an EMA would drop
    o.update(torch.tensor([0.1]))
    assert o.amax == 5.0 and o.clip() == 5.0
    assert o.count == 7


def test_percentile_against_hand_computed_rank():
    x = torch.arange(1, 1001, dtype=torch.float32)  # |x| = 1..1000
    o = observers.Percentile(99.0)
    for part in x.split(300):
        o.update(-part)  # sign must not matter
    # The 99th percentile of 1..1000 is 990; the histogram resolves it to one log bin (1.1%).
    assert o.clip() == pytest.approx(990.0, rel=0.011)
    o100 = observers.Percentile(100.0)
    o100.update(x)
    assert o100.clip() == 1000.0  # never beyond, and exactly at, the true maximum
    # Zeros count as observations: 60% zeros puts the 50th percentile at 0.
    oz = observers.Percentile(50.0)
    oz.update(torch.cat([torch.zeros(600), torch.ones(400)]))
    assert oz.clip() == 0.0


def test_percentile_rejects_bad_q():
    with pytest.raises(QuantizationError):
        observers.make("percentile", 0.0)


def _true_sse(x: torch.Tensor, clip: float) -> float:
    s = fp8.scales_from_amax(torch.tensor(clip))
    return float(((fp8.fake_quantize(x, s) - x).double() ** 2).sum())


def test_mse_constant_input_keeps_the_max_exactly():
    o = observers.MSE()
    o.update(torch.full((1000,), 3.0))
    assert o.clip() == 3.0  # 3.0 maps to 448 exactly: zero error, and ties go to the largest clip


def test_mse_matches_brute_force_on_the_raw_activations():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g)
    x[0] = 1.5 * float(x.abs().max())  # one outlier: clipping it a little lowers the bulk's error more
    amax = float(x.abs().max())
    o = observers.MSE()
    for part in x.split(50_000):
        o.update(part)
    clips = o.candidates()
    brute = torch.tensor([_true_sse(x, float(c)) for c in clips])
    best = float(clips[int(torch.argmin(brute))])
    got = o.clip()
    # The histogram estimate picks (nearly) the brute-force optimum of the real error ...
    assert _true_sse(x, got) <= 1.02 * float(brute.min())
    # ... and that optimum is not minmax here.
    assert best < amax and got < amax
    assert _true_sse(x, got) < _true_sse(x, amax)


def test_mse_without_outliers_does_not_clip_much():
    x = torch.linspace(-1, 1, 10001)
    o = observers.MSE()
    o.update(x)
    assert 0.9 <= o.clip() <= 1.0


def test_nan_activation_is_an_error_not_a_nan_scale():
    o = observers.Observer()
    o.update(torch.tensor([1.0, float("inf")]))
    with pytest.raises(QuantizationError, match="model.x"):
        o.check("model.x")


def test_hooks_keep_no_activation_alive_and_state_stays_fixed_size():
    lin = torch.nn.Linear(16, 16)
    make = observers.make("mse")
    with hooks.observing(torch.nn.Sequential(lin), ["0"], make) as (obs, _):
        sizes = set()
        for i in range(20):
            x = torch.randn(8, 16)
            ref = weakref.ref(x)
            with torch.no_grad():
                lin(x)
            del x  # refcounting frees it at once unless something (a hook) still holds it
            assert ref() is None  # the hook did not keep the input
            sizes.add(obs["0"].counts.numel())
        assert sizes == {observers.NBINS + 1}
        assert obs["0"].count == 20 * 8 * 16
    assert not lin._forward_pre_hooks  # removed on exit
