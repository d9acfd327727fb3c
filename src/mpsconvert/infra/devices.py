"""Device policy shared by calibration and the runtime: mps > cuda > cpu, never a silent fallback.

On MPS the torch.mps API is used for what it is for: `synchronize` before timing or reading
results, `empty_cache` between phases, `current_allocated_memory` / `driver_allocated_memory`
for memory readings, and an out-of-memory message that points at
PYTORCH_MPS_HIGH_WATERMARK_RATIO (unified memory is shared with the OS, and that ratio is what
caps how much of it a process may take).

What the installed torch can do on a device (`capabilities`) is probed once per process, by
running the ops, and what it lacks is said once (one warning), not once per layer.
"""

from __future__ import annotations

import contextlib
import platform
import subprocess
import warnings
from dataclasses import dataclass

import torch

from ..errors import DeviceError

DEVICE_CHOICES = ("auto", "mps", "cuda", "cpu")
# float8_e4m3fn tensors and F.scaled_mm on MPS arrived in torch 2.15 (pytorch PRs 194074, 196916).
MPS_FP8_TORCH = "2.15"
MPS_FP8 = f"FP8 on MPS needs torch >= {MPS_FP8_TORCH}"


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
        why = "this torch build has no MPS support" if not built else "no Apple GPU is visible"
        raise DeviceError(
            f"`device=mps` was asked for but {why} (MPS needs an Apple Silicon Mac; {MPS_FP8}); "
            f"available: {', '.join(available())}",
            "pass `device=auto` or one of those",
        )
    if name.startswith("cuda") and not cuda_available():
        raise DeviceError(
            f"`device={name}` was asked for but CUDA is not available; available: {', '.join(available())}",
            "install a CUDA build of torch, or pass `device=auto`",
        )
    if name.startswith("cuda:") and int(name.split(":", 1)[1]) >= torch.cuda.device_count():
        raise DeviceError(f"`device={name}`: only {torch.cuda.device_count()} CUDA device(s)", "pick an existing index")
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
    if device.type in ("cuda", "mps"):
        getattr(torch, device.type).empty_cache()  # torch.cuda / torch.mps


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
    fp8_tensors: bool  # float8_e4m3fn tensors can be held and cast here
    scaled_mm: bool  # torch._scaled_mm / F.scaled_mm runs here
    name: str  # the device's own name: kernel caches and validation records are keyed by it
    lacks: str = ""  # what this torch lacks here and what runs instead, one sentence ("" where nothing)
    cache_bytes: int = 0  # the last cache level a kernel's weights pass through (CUDA's L2; a guess on MPS; 0 on CPU)

    @property
    def code_dtype(self) -> torch.dtype:
        """How e4m3 codes are held on this device: as float8_e4m3fn, or as their bytes (uint8)
        where this torch has no float8 there (MPS before torch 2.15; fp8.fp8_to_float decodes
        those bit by bit, with no float8 op on the device)."""
        return torch.float8_e4m3fn if self.fp8_tensors else torch.uint8


_CAPS: dict[str, Capabilities] = {}
MPS_NAME = "Apple GPU (MPS)"  # where the Mac's chip cannot be read
# Apple's system-level cache, which the GPU's reads pass through: 8 MB (M1) to 96 MB (M-series Max
# and Ultra); torch does not report it, so the largest is assumed (more copies timed, never fewer).
MPS_CACHE_BYTES = 96 << 20


def mac_chip() -> str | None:
    """The Mac's chip as macOS names it ("Apple M4 Pro": `sysctl -n machdep.cpu.brand_string`),
    or None off macOS or where it cannot be read. An M1 and an M4 differ several-fold in FP8
    and BF16 speed, so kernel decisions and validation records must not share one name."""
    if platform.system() != "Darwin":
        return None
    try:
        r = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    chip = r.stdout.strip() if r.returncode == 0 else ""
    return chip if chip.isprintable() and 0 < len(chip) <= 80 else None


def mps_name() -> str:
    """The MPS device's name: the chip ("Apple M4 Pro (MPS)"), else the constant, said once."""
    chip = mac_chip()
    if chip:
        return f"{chip} (MPS)"
    warnings.warn(
        f"the Mac's chip could not be read (sysctl -n machdep.cpu.brand_string): the device is named {MPS_NAME!r}, "
        "so kernel decisions and validation records cannot tell one Mac from another",
        stacklevel=3,
    )
    return MPS_NAME


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"


def _probe_mps() -> tuple[bool, bool, str]:
    """(float8 tensors, scaled_mm, what is lacking) on MPS, by running each op once."""
    import torch.nn.functional as F

    here = f"torch {torch.__version__}"
    try:
        x = torch.full((16, 16), 0.5, device="mps").to(torch.float8_e4m3fn)
        if not bool((x.float() == 0.5).all()):
            raise RuntimeError("a float8 round trip changed the values")
    except Exception as e:  # any failure means: no float8 on this device
        return (
            False,
            False,
            (
                f"{here} has no float8_e4m3fn tensors on MPS ({_first_line(e)}): e4m3 codes are held as bytes and "
                f"decoded bit by bit, and FP8 layers dequantize their weights; {MPS_FP8}"
            ),
        )
    try:
        one = torch.ones((), device="mps")
        for kind, sa, sb in (
            (F.ScalingType.TensorWise, one, one),
            (F.ScalingType.RowWise, torch.ones(16, 1, device="mps"), torch.ones(1, 16, device="mps")),
        ):
            y = F.scaled_mm(x, x.t(), sa, kind, sb, kind, output_dtype=torch.bfloat16)
            if not bool((y.float() == 4.0).all()):
                raise RuntimeError(f"{kind} scaled_mm gave wrong values")
    except Exception as e:  # absent (AttributeError), not registered for MPS (NotImplementedError), ...
        return (
            True,
            False,
            (
                f"{here} has no FP8 matmul on MPS (F.scaled_mm: {_first_line(e)}): FP8 layers dequantize their "
                f"weights instead; {MPS_FP8}"
            ),
        )
    return True, True, ""


def capabilities(device: torch.device) -> Capabilities:
    """This device's FP8 capabilities, probed once per process; what is lacking is warned once."""
    key = str(device)
    if key not in _CAPS:
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            caps = Capabilities(
                "cuda",
                True,
                (major, minor) >= (8, 9),
                torch.cuda.get_device_name(device),
                cache_bytes=int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0),
            )
        elif device.type == "mps":
            fp8, mm, lacks = _probe_mps()
            caps = Capabilities("mps", fp8, mm, mps_name(), lacks, cache_bytes=MPS_CACHE_BYTES)
        else:
            caps = Capabilities("cpu", True, False, "CPU")
        if caps.lacks:
            warnings.warn(caps.lacks, stacklevel=2)
        _CAPS[key] = caps
    return _CAPS[key]


def is_oom(err: BaseException) -> bool:
    msg = str(err)
    return (
        isinstance(err, getattr(torch, "OutOfMemoryError", ()))
        or "out of memory" in msg.lower()
        or "MPS backend out of memory" in msg
    )


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
                "use the layer-by-layer mode (`sequential`), fewer/shorter samples, or raise the cap with "
                "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 (no limit; may make the system swap)"
            )
        elif device.type == "cuda":
            fix = "use the layer-by-layer mode (`sequential`), fewer/shorter samples, or a larger GPU"
        else:
            fix = "use the layer-by-layer mode (`sequential`) or fewer/shorter samples"
        raise DeviceError(f"{device.type} ran out of memory during {what}", fix) from e
