"""Installing a fused forward on one module instance of a loaded model, and reaching its own.

Why a subclass and not an instance attribute: the fused forwards (eager_fusion.py, rotary.py)
replace a module's forward for that instance only. Set as `module.forward = MethodType(...)`,
each is an entry of the instance's `__dict__` that torch.compile's frame has to treat as
instance state; as a class whose forward is ours, made once per (class, forward) and with the
class's own name and module, the instance looks to dynamo, transformers and printing like any
module of its class. The module's own forward stays reachable (`own_forward`; from the
installed forward, `self.mpsconvert_base.forward`).
"""

from __future__ import annotations

import inspect

from torch import nn

_SUBCLASSES: dict = {}


def _base(mod: nn.Module) -> type:
    """mod's own class, under an installed subclass or not."""
    return type(mod).__dict__.get("mpsconvert_base") or type(mod)


def install(mod: nn.Module, forward) -> None:
    """Run `forward(mod, ...)` as mod's forward from now on (this instance only)."""
    base = _base(mod)
    sub = _SUBCLASSES.get((base, forward))
    if sub is None:
        sub = type(
            base.__name__,
            (base,),
            {
                "forward": forward,
                "mpsconvert_base": base,
                "__module__": base.__module__,
                "__qualname__": base.__qualname__,
                "__doc__": base.__doc__,
            },
        )
        _SUBCLASSES[(base, forward)] = sub
    mod.__class__ = sub


def installed(mod: nn.Module, forward=None) -> bool:
    """Whether mod runs an installed forward (`forward`, if given; transformers wraps the forward
    of some classes' subclasses, e.g. decoder layers, so the installed one is unwrapped first)."""
    cls = type(mod)
    return "mpsconvert_base" in cls.__dict__ and (forward is None or inspect.unwrap(cls.__dict__["forward"]) is forward)


def own_forward(mod: nn.Module):
    """The forward of mod's own class (unbound), installed or not (at load, for the checks). An
    installed forward reaches it as `self.mpsconvert_base.forward` instead: under torch.compile
    each `type(module)` of modules of one class becomes a Python identity guard between them,
    evaluated on every call (two per decoder layer)."""
    return _base(mod).forward


def uninstall(mod: nn.Module) -> None:
    if installed(mod):
        mod.__class__ = type(mod).mpsconvert_base
