"""The one place that imports Triton, and says whether our Triton kernels run.

Why one module: Triton has no macOS wheels and is absent from every base install (a Mac user's),
so a module-level `import triton` anywhere in the package breaks every command there, and a name
defined only when the import succeeded (a `@triton.jit` helper) breaks whoever imports it. Every
kernel module takes `triton` and `tl` from here (None without Triton), defines its kernels under
`if triton is not None:`, and asks `available()` / `runs_on()` / `eager_on()` before launching;
tests/test_architecture.py checks that no other module imports `triton`. `custom_op` and
`eager_or_op` give a kernel its entry point: the launcher itself in eager mode, an opaque custom op
under torch.compile.

TRITON_INTERPRET=1 (`INTERPRET`) runs the kernels on CPU tensors: the tests' way of checking
them on a machine without a GPU.

`holding()` holds our kernels back for the calls made inside it (`eager_on` False there): the
callers then run the plain torch ops, which need no compile. A model loaded on a machine's first
run computes that way until its Triton kernels are compiled (runtime/load/held.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch

try:  # Triton ships with Linux CUDA builds of torch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    """Whether our kernels can run in this process: Triton installed, and a CUDA device or the
    interpreter."""
    return triton is not None and (INTERPRET or torch.cuda.is_available())


def runs_on(t: torch.Tensor) -> bool:
    """Whether a kernel takes this tensor's device: CUDA, or a CPU tensor under the interpreter
    (never MPS: Triton has no Metal backend)."""
    return triton is not None and (t.is_cuda or (INTERPRET and t.device.type == "cpu"))


_HELD = contextvars.ContextVar("mpsconvert_triton_held", default=False)


def held() -> bool:
    """Whether the calls being made are inside `holding()`: our kernels are held back."""
    return _HELD.get()


@contextlib.contextmanager
def holding():
    """Within: `eager_on` is False, so every kernel's caller runs its torch ops (no Triton compile)."""
    token = _HELD.set(True)
    try:
        yield
    finally:
        _HELD.reset(token)


def eager_on(t: torch.Tensor) -> bool:
    """`runs_on(t)` outside torch.compile and outside `holding()`: the kernel itself runs. Inside a
    compiled region the callers run plain torch ops instead, which Inductor fuses into their
    neighbours; inside `holding()` too."""
    return runs_on(t) and not torch.compiler.is_compiling() and not _HELD.get()


def version() -> str | None:
    """Triton's version (kernel-cache keys), or None without Triton."""
    return getattr(triton, "__version__", None)


def custom_op(name: str, launch, fake):
    """`launch` (a kernel's launcher, every parameter annotated) registered as the custom op `name`
    with the fake implementation `fake` (its output's shape and dtype), so that torch.compile sees an
    opaque op; None without Triton."""
    if triton is None:
        return None
    op = torch.library.custom_op(name, launch, mutates_args=())
    op.register_fake(fake)
    return op


def eager_or_op(launch, op):
    """A kernel's entry point, with `launch`'s signature: `launch` itself in eager mode (a custom op's
    dispatch costs host time on every call), the custom op `op` (`custom_op`) under torch.compile."""

    @functools.wraps(launch)
    def call(*args, **kwargs):
        if op is None:
            raise RuntimeError("triton is not installed")
        if torch.compiler.is_compiling():
            return op(*args, **kwargs)
        return launch(*args, **kwargs)

    return call


def compile_configs(autotuned, *args, **kwargs) -> int:
    """Compile every configuration of an autotuned kernel for these arguments, several at once,
    so that the autotuner's first call (which compiles them one by one, then times them) finds
    them compiled. Returns how many were compiled here.

    Why: a fresh machine's first load compiles each decode kernel's configurations (35 for the
    GEMV candidates, ~0.3 s each) before the kernel policy can time them. Triton's own
    AsyncCompileMode (Triton 3.4+) compiles on a thread pool; its compile releases the GIL for
    most of the work. Where this Triton lacks it, they compile one by one, as the autotuner would."""
    import concurrent.futures

    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # pragma: no cover - older Triton
        AsyncCompileMode = None
    configs = list(getattr(autotuned, "configs", ()))
    fn = getattr(autotuned, "fn", None)
    if fn is None or not configs or INTERPRET:
        return 0
    prune = getattr(autotuned, "early_config_prune", None)
    if prune is not None:  # only what the autotuner will time (one recorded configuration: ops/triton/tuned.py)
        configs = list(prune(configs, dict(zip(autotuned.arg_names, args)), **kwargs))

    def one(cfg):
        fn.warmup(*args, grid=(1,), **kwargs, **cfg.all_kwargs())

    one(configs[0])  # the device's binder is made on the first call, before any thread
    if AsyncCompileMode is None:
        for cfg in configs[1:]:
            one(cfg)
    else:
        with (
            concurrent.futures.ThreadPoolExecutor(max(1, min(8, (os.cpu_count() or 2) - 1))) as pool,
            AsyncCompileMode(pool),
        ):
            for cfg in configs[1:]:
                one(cfg)
    return len(configs)
