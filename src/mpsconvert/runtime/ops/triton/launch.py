"""Launching our eager Triton kernels for less host time than `kernel[grid](...)` costs.

Why: every `kernel[grid](...)` call binds the arguments, computes each one's specialization,
hashes the options, looks the kernel up and builds launch metadata before it reaches the
launcher: about 40 us of host time per launch on the H200 host, and an eager decoder layer
launches five of our kernels (two norms, rotary, two quantizations), while the GPU work of each
is a few microseconds. Here the compiled kernel Triton returns for a call is kept under a key
that holds everything Triton specializes on (each tensor's dtype and 16-byte alignment, each
scalar's value, the launch options, the device), and a later call with that key goes straight to
the kernel's launcher (`CompiledKernel.run`, what `kernel[grid]` itself calls last, and what
Inductor's generated code calls). The first call of each key takes `kernel[grid]`, so Triton
compiles with its own rules.

The launcher's calling convention is Triton's internal API, so it is checked once per process:
a probe kernel launched directly must write what its `kernel[grid]` launch wrote. If that
fails, or under the interpreter, or while a launch hook is set (a profiler), every launch takes
`kernel[grid]`; `mode()` says which path runs and why.
"""

from __future__ import annotations

import torch

from . import INTERPRET, tl, triton

TL_DTYPES = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
}  # torch dtype -> triton.language name
_CACHE: dict = {}
_MODE: list = []  # [mode string] once decided: "direct", or "kernel[grid] (why)"


def _specs(args: tuple) -> tuple:
    """What Triton specializes the kernel arguments on (a superset: scalars by value), one entry
    per argument; written out in one comprehension, not a function per argument: with ~18
    arguments per launch that was a third of the launch's Python time."""
    return tuple([(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else (a.__class__, a) for a in args])


_RUNTIME = getattr(getattr(triton, "knobs", None), "runtime", None)


def _hooks_set() -> bool:
    """Whether a launch hook is set (newer Triton keeps them in a HookChain, empty by default)."""
    hooks = (getattr(_RUNTIME, "launch_enter_hook", None), getattr(_RUNTIME, "launch_exit_hook", None))
    return any(h is not None and (not hasattr(h, "calls") or bool(h.calls)) for h in hooks)


_STREAM: list = []  # the active driver's get_current_stream, looked up once


def _stream(device: int):
    if not _STREAM:
        _STREAM.append(triton.runtime.driver.active.get_current_stream)
    return _STREAM[0](device)


def next_pow2(n: int) -> int:
    """triton.next_power_of_2(n) for n >= 1, as plain integer arithmetic (Triton's is a
    ConstexprFunction: ~2 us of host time per call, three calls per launch in places)."""
    return 1 << (n - 1).bit_length()


def _direct(compiled, grid, args, device: int) -> None:
    """What `kernel[grid]` does last: the launcher, with no launch metadata and no hooks."""
    g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
    compiled.run(g0, g1, g2, _stream(device), compiled.function, compiled.packed_metadata, None, None, None, *args)


if triton is not None:

    @triton.jit
    def _probe_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale + 1.0, mask=mask)


def _decide() -> str:
    if triton is None:
        return "kernel[grid] (no Triton)"
    if INTERPRET:
        return "kernel[grid] (the Triton interpreter)"
    if not torch.cuda.is_available():
        return "kernel[grid] (no CUDA device)"
    try:
        x = torch.arange(300, dtype=torch.float32, device="cuda")
        want, got = torch.full_like(x, -1.0), torch.full_like(x, -2.0)
        compiled = _probe_kernel[(3,)](x, want, x.numel(), 0.5, 128)
        _direct(compiled, (3,), (x, got, x.numel(), 0.5, 128), x.device.index)  # the same call, into `got`
        torch.cuda.synchronize()
        if not torch.equal(want, got):
            return "kernel[grid] (a direct launch of the probe kernel wrote other values)"
    except Exception as e:  # the launcher's convention differs in this Triton
        return f"kernel[grid] (a direct launch failed: {type(e).__name__}: {str(e)[:120]})"
    return "direct"


def mode() -> str:
    """How our eager kernels are launched in this process: "direct", or "kernel[grid] (why)"."""
    if not _MODE:
        _MODE.append(_decide())
    return _MODE[0]


def launch(kernel, grid: tuple, args: tuple, **options) -> None:
    """kernel[grid](*args, **options), with every argument positional (constexprs included, in
    the kernel's order), through the compiled kernel's launcher when this key was seen before."""
    if (_MODE[0] if _MODE else mode()) != "direct" or _hooks_set():
        kernel[grid](*args, **options)
        return
    device = args[0].device.index
    key = (
        id(kernel),
        device,
        _specs(args),
        tuple(options.items()),
    )  # id: a JITFunction hashes its source key (~2 us); kernels live for the process
    compiled = _CACHE.get(key)
    if compiled is None:
        _CACHE[key] = kernel[grid](*args, **options)
        return
    _direct(compiled, grid, args, device)
