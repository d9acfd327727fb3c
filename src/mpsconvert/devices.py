"""Device policy shared by calibration and the runtime: mps > cuda > cpu, never a silent fallback.

On MPS the torch.mps API is used for what it is for: `synchronize` before timing or reading
results, `empty_cache` between phases, `current_allocated_memory` / `driver_allocated_memory`
for memory readings, and an out-of-memory message that points at
PYTORCH_MPS_HIGH_WATERMARK_RATIO (unified memory is shared with the OS, and that ratio is what
caps how much of it a process may take).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .errors import DeviceError

DEVICE_CHOICES = ("auto", "mps", "cuda", "cpu")


def mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def cuda_available() -> bool:
    return torch.cuda.is_available()


def choose(name: str = "auto") -> torch.device:
    """Resolve --device. 'auto' prefers MPS, then CUDA, then CPU; an explicit device that is not
    there is an error naming what is."""
    if name not in DEVICE_CHOICES and not name.startswith("cuda:"):
        raise DeviceError(f"unknown device {name!r}", f"use one of: {', '.join(DEVICE_CHOICES)}")
    if name == "auto":
        if mps_available():
            return torch.device("mps")
        if cuda_available():
            return torch.device("cuda")
        return torch.device("cpu")
    if name == "mps" and not mps_available():
        built = getattr(torch.backends, "mps", None) and torch.backends.mps.is_built()
        why = "this torch build has no MPS support" if not built else "no Apple GPU is visible (macOS 12.3+ on Apple Silicon needed)"
        raise DeviceError(f"--device mps was asked for but {why}; available: {', '.join(available())}", "pass --device auto or one of those")
    if name.startswith("cuda") and not cuda_available():
        raise DeviceError(
            f"--device {name} was asked for but CUDA is not available; available: {', '.join(available())}",
            "install a CUDA build of torch, or pass --device auto",
        )
    if name.startswith("cuda:") and int(name.split(":", 1)[1]) >= torch.cuda.device_count():
        raise DeviceError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)", "pick an existing index")
    return torch.device(name)


def available() -> list[str]:
    out = []
    if mps_available():
        out.append("mps")
    if cuda_available():
        out.append("cuda")
    out.append("cpu")
    return out


def synchronize(device: torch.device) -> None:
    """Wait for queued work: required before reading a host clock or a result off the device."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def empty_cache(device: torch.device) -> None:
    """Give cached blocks back between phases (calibration -> evaluation, model A -> model B)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory(device: torch.device) -> dict:
    """Memory readings in bytes, with what each reading means on that device."""
    if device.type == "cuda":
        return {
            "allocated": torch.cuda.memory_allocated(device),
            "peak_allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
            "source": "torch.cuda.memory_allocated / max_memory_allocated",
        }
    if device.type == "mps":
        return {
            "allocated": torch.mps.current_allocated_memory(),
            "driver_allocated": torch.mps.driver_allocated_memory(),
            "source": "torch.mps.current_allocated_memory / driver_allocated_memory (no peak counter on MPS)",
        }
    return {"allocated": None, "source": "cpu: see process RSS"}


@dataclass(frozen=True)
class Capabilities:
    """What FP8 paths this device offers (a starting point: the runtime still measures)."""

    device: str
    fp8_tensors: bool
    scaled_mm: bool  # torch._scaled_mm / F.scaled_mm runs here
    name: str


def capabilities(device: torch.device) -> Capabilities:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return Capabilities("cuda", True, (major, minor) >= (8, 9), torch.cuda.get_device_name(device))
    if device.type == "mps":
        fp8 = hasattr(torch, "float8_e4m3fn")
        try:
            torch.zeros(1, dtype=torch.float8_e4m3fn, device="mps")
        except (RuntimeError, TypeError):
            fp8 = False
        return Capabilities("mps", fp8, fp8 and hasattr(torch.nn.functional, "scaled_mm"), "Apple GPU (MPS)")
    return Capabilities("cpu", True, False, "CPU")


def is_oom(err: BaseException) -> bool:
    msg = str(err)
    return isinstance(err, getattr(torch, "OutOfMemoryError", ())) or "out of memory" in msg.lower() or "MPS backend out of memory" in msg


@contextlib.contextmanager
def oom_hint(device: torch.device, what: str):
    """Re-raise device out-of-memory as a DeviceError that says what to do on that device."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if not is_oom(e):
            raise
        if device.type == "mps":
            fix = (
                "use the layer-by-layer mode (--sequential), fewer/shorter samples, or raise the cap with "
                "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 (no limit; may make the system swap)"
            )
        elif device.type == "cuda":
            fix = "use the layer-by-layer mode (--sequential), fewer/shorter samples, or a larger GPU"
        else:
            fix = "use the layer-by-layer mode (--sequential) or fewer/shorter samples"
        raise DeviceError(f"{device.type} ran out of memory during {what}", fix) from e
