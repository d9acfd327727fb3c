"""timing.warm_guards: the decode timing's guard stance, on for compiled steps only, and undone."""

import torch
from torch._dynamo import eval_frame

from mpsconvert.infra import timing


def test_warm_guards_skips_guards_only_inside_and_only_when_compiled():
    calls = []

    def f(x):
        calls.append(1)  # runs while dynamo traces
        return x * 2 + 1

    step = torch.compile(f, backend="eager")
    x = torch.arange(4.0)
    assert torch.equal(step(x), x * 2 + 1)  # warm-up: traced once
    traced = len(calls)
    with timing.warm_guards(True):
        assert eval_frame._stance.skip_guard_eval_unsafe
        for k in range(3):  # same shapes as the warm-up: the compiled code, correct results
            y = torch.full((4,), float(k))
            assert torch.equal(step(y), y * 2 + 1)
    assert not eval_frame._stance.skip_guard_eval_unsafe
    assert len(calls) == traced  # nothing recompiled
    with timing.warm_guards(False):
        assert not eval_frame._stance.skip_guard_eval_unsafe
