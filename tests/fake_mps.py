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

`fake_mps(monkeypatch, ...)` activates it for the rest of a test, with what else a Mac answers:
`devices.mps_available()` is True, `torch.Generator(device="mps")` makes a generator the fake
knows as the device's, torch.mps's synchronize and memory calls are harmless, the chip is named,
and the capabilities cache is empty, so `devices.capabilities` probes this fake device itself.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

MPS, CPU = torch.device("mps"), torch.device("cpu")
CHIP = "Apple M4 Pro"
FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}


class OnMPS(torch.Tensor):
    """A CPU tensor that the fake device holds."""


def _is_mps(x) -> bool:
    return (isinstance(x, torch.device) and x.type == "mps") or (isinstance(x, str) and (x == "mps" or x.startswith("mps:")))


def _is_cpu(x) -> bool:
    return (isinstance(x, torch.device) and x.type == "cpu") or x == "cpu"


class FakeMPS(TorchFunctionMode):
    def __init__(self, fp8: bool = False, scaled_mm: bool = False):
        super().__init__()
        self.fp8, self.scaled_mm = fp8, scaled_mm
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
        to_cpu = func is torch.Tensor.cpu or (func is torch.Tensor.to and any(_is_cpu(a) for a in flat[1:] if not isinstance(a, torch.Tensor)))
        name = getattr(func, "__name__", "")
        if on_device and "scaled_mm" in name and not self.scaled_mm:
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
                    self._refuse(TypeError("Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't support "
                                           "float64. Please use float32 instead."))
                if t.dtype in FLOAT8 and not self.fp8:
                    self._refuse(TypeError(f"Trying to convert {str(t.dtype).replace('torch.float8', 'Float8')} to the MPS backend "
                                           "but it does not have support for that dtype."))

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


@contextlib.contextmanager
def fake_mps(monkeypatch, fp8: bool = False, scaled_mm: bool = False, chip: str | None = CHIP):
    """Within the block, this process looks like a Mac with MPS (the module docstring); yields the mode."""
    from mpsconvert import devices

    mode = FakeMPS(fp8=fp8, scaled_mm=scaled_mm)
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
    for fn, value in (("synchronize", None), ("empty_cache", None), ("current_allocated_memory", 0), ("driver_allocated_memory", 0)):
        monkeypatch.setattr(torch.mps, fn, lambda value=value: value)
    with mode:
        yield mode
