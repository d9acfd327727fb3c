# Probe: MPSC_INDUCTOR="combo_kernels=1,..." sets torch._inductor.config options in every process
import os
_opts = os.environ.get("MPSC_INDUCTOR")
if _opts:
    import torch._inductor.config as _c
    for kv in _opts.split(","):
        k, v = kv.split("=")
        setattr(_c, k, type(getattr(_c, k))(int(v)) if isinstance(getattr(_c, k), (bool, int)) else v)
if os.environ.get("MPSC_NO_GATED"):  # probe: main's decode MLP (no gated gate/up kernel)
    try:
        from mpsconvert.runtime.ops import kernels as _k
        _k.GATED.clear()
    except ImportError:
        pass
