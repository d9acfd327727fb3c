"""A fake MPS device on a machine without one, for tests of what only a Mac runs.

Tensors "on" it are CPU tensors of the subclass `OnMPS`, and a torch-function mode (`FakeMPS`)
sees every torch call made while it is active:
- a call given `device="mps"` (or a tensor on the fake device) computes on the CPU and returns its
  tensors on the fake device; `.cpu()` / `.to("cpu")` return plain CPU tensors; `.device` says mps;
- it refuses what MPS refuses, with the errors MPS raises: a float64 tensor on the device (MPS has
  no float64), a float8 tensor unless `fp8` (torch before 2.15), an FP8 matmul (`_scaled_mm`,
  `F.scaled_mm`) unless `scaled_mm`, and `torch.multinomial` on device probabilities with a
  generator that is not the device's (a CPU generator: what `torch.multinomial` refuses on MPS
  and CUDA).

Two profiles, the torches a Mac user runs (`fake_mps(monkeypatch, profile=...)`):
- "2.13" (and every torch before 2.15): no float8 on MPS, no FP8 matmul, no MPS grouped matmul;
- "2.15": float8_e4m3fn tensors, `F.scaled_mm` with tensor-wise and row-wise scaling only (a
  block-wise scaling type is refused), `F.grouped_mm` on the device; still no float64.
The flags (`fp8`, `scaled_mm`, `grouped_mm`) can also be set one by one.

While the mode is active it records which of src/'s MPS branches ran (`BRANCHES`: every
comparison of a device with "mps" in src/mpsconvert, found by reading the source), under which
profile, into `HIT`: tests/test_runtime_mps.py's last test asserts that each ran under a profile.

`fake_mps(monkeypatch, ...)` activates it for the rest of a test, with what else a Mac answers:
`devices.mps_available()` is True, `torch.Generator(device="mps")` makes a generator the fake
knows as the device's, torch.mps's synchronize and memory calls are harmless, the chip is named,
and the capabilities cache is empty, so `devices.capabilities` probes this fake device itself.
"""

from __future__ import annotations

import ast
import contextlib
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

MPS, CPU = torch.device("mps"), torch.device("cpu")
CHIP = "Apple M4 Pro"
FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}
PROFILES = {  # what MPS offers with each torch a Mac user runs
    "2.13": {"fp8": False, "scaled_mm": False, "grouped_mm": False},
    "2.15": {"fp8": True, "scaled_mm": True, "grouped_mm": True},
}
SRC = Path(__import__("mpsconvert").__file__).resolve().parent  # the package as imported (torch-free)


def _mps_branches() -> dict[str, set[int]]:
    """{file: lines} of every comparison with "mps" in src/ (`x.type == "mps"`, `name in ("cpu", "mps")`)."""
    out: dict[str, set[int]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            elts = [e for s in sides for e in ([s] + list(getattr(s, "elts", [])))]
            if any(isinstance(e, ast.Constant) and e.value == "mps" for e in elts):
                out.setdefault(str(path), set()).add(node.lineno)
    return out


BRANCHES = _mps_branches()
HIT: dict[tuple[str, int], set[str]] = {}  # (file, line) -> the profiles it ran under, in this process


class OnMPS(torch.Tensor):
    """A CPU tensor that the fake device holds."""


def _is_mps(x) -> bool:
    return (isinstance(x, torch.device) and x.type == "mps") or (
        isinstance(x, str) and (x == "mps" or x.startswith("mps:"))
    )


def _is_cpu(x) -> bool:
    return (isinstance(x, torch.device) and x.type == "cpu") or x == "cpu"


def _blockwise(args, kwargs) -> bool:
    """Whether an FP8 matmul call asks for a block-wise scaling: `F.scaled_mm`'s ScalingType
    arguments, or the recipe lists of their values that it hands to `torch._scaled_mm_v2`."""
    import torch.nn.functional as F

    kinds = getattr(getattr(F, "ScalingType", None), "__members__", {})
    block = {int(m) for name, m in kinds.items() if "Block" in name}
    for a in (*args, *kwargs.values()):
        if "ScalingType" in type(a).__name__ and int(a) in block:
            return True
        if isinstance(a, (list, tuple)) and any(type(v) is int and v in block for v in a):
            return True
    return False


class FakeMPS(TorchFunctionMode):
    def __init__(self, fp8: bool = False, scaled_mm: bool = False, grouped_mm: bool = False):
        super().__init__()
        self.fp8, self.scaled_mm, self.grouped_mm = fp8, scaled_mm, grouped_mm
        self.generators: list[torch.Generator] = []  # made with device="mps"
        self.refused: list[str] = []  # what was refused, for tests that expect a refusal to be caught

    def _refuse(self, err: Exception):
        self.refused.append(str(err))
        raise err

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.device:  # naming the device is no call on it
            return func(*args, **kwargs)
        owner = getattr(func, "__self__", None)
        if owner is torch.Tensor.device:
            return MPS if isinstance(args[0], OnMPS) else func(*args)
        if owner is torch.Tensor.is_mps:
            return isinstance(args[0], OnMPS)
        flat, _ = tree_flatten((args, kwargs))
        on_device = any(isinstance(a, OnMPS) for a in flat) or any(_is_mps(a) for a in flat)
        to_cpu = func is torch.Tensor.cpu or (
            func is torch.Tensor.to and any(_is_cpu(a) for a in flat[1:] if not isinstance(a, torch.Tensor))
        )
        name = getattr(func, "__name__", "")
        if on_device and "scaled_mm" in name and not self.scaled_mm:
            self._refuse(NotImplementedError(f"Could not run 'aten::{name}' with arguments from the 'MPS' backend."))
        if on_device and "scaled_mm" in name and _blockwise(args, kwargs):
            self._refuse(NotImplementedError("scaled_mm on MPS supports TensorWise and RowWise scaling only"))
        if on_device and "grouped_mm" in name and not self.grouped_mm:
            self._refuse(NotImplementedError(f"Could not run 'aten::{name}' with arguments from the 'MPS' backend."))
        if on_device and name == "multinomial":
            gen = kwargs.get("generator")
            if gen is not None and not any(gen is g for g in self.generators):
                self._refuse(RuntimeError("Expected a 'mps' device type for generator but found 'cpu'"))
        args, kwargs = tree_map(lambda a: CPU if _is_mps(a) else a, (args, kwargs))
        out = func(*args, **kwargs)
        keep = on_device and not to_cpu
        for t in tree_flatten(out)[0]:
            if keep and isinstance(t, torch.Tensor):
                if t.dtype == torch.float64:
                    self._refuse(
                        TypeError(
                            "Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't support "
                            "float64. Please use float32 instead."
                        )
                    )
                if t.dtype in FLOAT8 and not self.fp8:
                    self._refuse(
                        TypeError(
                            f"Trying to convert {str(t.dtype).replace('torch.float8', 'Float8')} to the MPS backend "
                            "but it does not have support for that dtype."
                        )
                    )

        def place(t):
            if not isinstance(t, torch.Tensor):
                return t
            if keep:
                return t if isinstance(t, OnMPS) else t.as_subclass(OnMPS)
            return t.as_subclass(torch.Tensor) if isinstance(t, OnMPS) else t

        return tree_map(place, out)


def to_mps(t: torch.Tensor) -> OnMPS:
    """A CPU tensor as one on the fake device (a copy)."""
    return t.clone().as_subclass(OnMPS)


def _tracer(profile: str):
    """A sys.settrace function that records the MPS branches of src/ that run (only frames of the
    files that hold one are traced line by line)."""

    def lines(frame, event, arg):
        if event == "line" and frame.f_lineno in BRANCHES[frame.f_code.co_filename]:
            HIT.setdefault((frame.f_code.co_filename, frame.f_lineno), set()).add(profile)
        return lines

    def calls(frame, event, arg):
        return lines if frame.f_code.co_filename in BRANCHES else None

    return calls


@contextlib.contextmanager
def fake_mps(
    monkeypatch,
    fp8: bool | None = None,
    scaled_mm: bool | None = None,
    chip: str | None = CHIP,
    profile: str = "2.13",
    grouped_mm: bool | None = None,
):
    """Within the block, this process looks like a Mac with MPS and the torch of `profile` (the
    module docstring); a flag given overrides the profile's; yields the mode."""
    from mpsconvert.infra import devices

    flags = dict(PROFILES[profile])
    flags.update(
        {k: v for k, v in (("fp8", fp8), ("scaled_mm", scaled_mm), ("grouped_mm", grouped_mm)) if v is not None}
    )
    custom = flags != PROFILES[profile]
    mode = FakeMPS(**flags)
    mode.profile = None if custom else profile  # branches count for a profile only under exactly its flags
    real_generator = torch.Generator

    class Generator(real_generator):
        def __new__(cls, device="cpu"):
            g = real_generator("cpu")
            if _is_mps(device):
                mode.generators.append(g)
            return g

    monkeypatch.setattr(torch, "Generator", Generator)
    monkeypatch.setattr(devices, "mps_available", lambda: True)
    monkeypatch.setattr(devices, "mac_chip", lambda: chip)
    monkeypatch.setattr(devices, "_CAPS", {})
    for fn, value in (
        ("synchronize", None),
        ("empty_cache", None),
        ("current_allocated_memory", 0),
        ("driver_allocated_memory", 0),
    ):
        monkeypatch.setattr(torch.mps, fn, lambda value=value: value)
    old = sys.gettrace()
    if mode.profile is not None:
        sys.settrace(_tracer(mode.profile))
    try:
        with mode:
            yield mode
    finally:
        sys.settrace(old)
