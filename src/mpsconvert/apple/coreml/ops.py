"""Torch -> MIL converters that coremltools 9.0 lacks for recent transformers, in one place.

transformers 5 builds attention masks and packed-sequence checks with ops that coremltools 9.0's
torch frontend has no converter for (`diff`, `new_ones`, `alias`, integer `__and__`, ...). Each
is registered through coremltools' own registry (`register_torch_op`), so conversion uses them
exactly like the built-in ones. `register()` is idempotent and called by the exporter, which
checks for coremltools first; the module itself imports without it (every module does, on a base
install).
"""

from __future__ import annotations

try:
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch import ops as _ops
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY, register_torch_op
    from coremltools.converters.mil.mil import types
except ImportError:  # pragma: no cover - the `coreml` extra is not installed; nothing here is called then
    mb = _ops = _TORCH_OPS_REGISTRY = register_torch_op = types = None


def _inputs(*args, **kwargs):
    return _ops._get_inputs(*args, **kwargs)


def _kwinputs(*args, **kwargs):
    return _ops._get_kwinputs(*args, **kwargs)


# The ops added here, by canonical (sanitized) name: tests and the export record list them.
ADDED: list[str] = []
_registered = False


def _value(v, default=None):
    return default if v is None else (v.val if hasattr(v, "val") else v)


def diff(context, node):
    """torch.diff(x, n=1, dim=-1, prepend=None, append=None): concat, then x[1:] - x[:-1] along dim, n times."""
    inputs = _inputs(context, node, min_expected=1)
    x = inputs[0]
    n = int(_value(inputs[1] if len(inputs) > 1 else None, 1))
    dim = int(_value(inputs[2] if len(inputs) > 2 else None, -1))
    prepend = inputs[3] if len(inputs) > 3 else None
    append = inputs[4] if len(inputs) > 4 else None
    prepend = _kwinputs(context, node, "prepend", default=[prepend])[0]
    append = _kwinputs(context, node, "append", default=[append])[0]
    if types.is_bool(x.dtype):
        raise NotImplementedError("diff of a bool tensor is not supported")
    rank = x.rank
    dim = dim % rank
    parts = [p for p in (prepend, x, append) if p is not None]
    if len(parts) > 1:
        x = mb.concat(values=parts, axis=dim)
    for _ in range(n):
        begin_hi = [0] * rank
        begin_hi[dim] = 1
        end_lo = [0] * rank
        end_lo[dim] = -1
        mask_end = [True] * rank
        mask_end[dim] = False
        hi = mb.slice_by_index(x=x, begin=begin_hi, end=[0] * rank, end_mask=[True] * rank)
        lo = mb.slice_by_index(x=x, begin=[0] * rank, end=end_lo, end_mask=mask_end)
        x = mb.sub(x=hi, y=lo)
    context.add(mb.identity(x=x, name=node.name))


def new_ones(context, node):
    """x.new_ones(size, dtype=None): ones of `size`, in x's dtype unless one is given."""
    inputs = _inputs(context, node, min_expected=2)
    x, size = inputs[0], inputs[1]
    if isinstance(size, list):
        size = mb.concat(values=size, axis=0)
    if types.is_float(size.dtype):
        size = mb.cast(x=size, dtype="int32")
    dtype = inputs[2] if len(inputs) > 2 else None
    dtype = _kwinputs(context, node, "dtype", default=[dtype])[0]
    res = mb.fill(shape=size, value=1.0)
    target = (
        _ops.NUM_TO_DTYPE_STRING[dtype.val]
        if dtype is not None and dtype.val is not None
        else types.builtin_to_string(x.dtype)
    )
    if target == "bool":
        res = mb.cast(x=res, dtype="bool", name=node.name)
    elif target in ("fp32", "fp16", "int32"):
        res = mb.cast(x=res, dtype=target, name=node.name)
    else:  # int64 and friends are int32 in Core ML
        res = mb.cast(x=res, dtype="int32", name=node.name)
    context.add(res, node.name)


def alias(context, node):
    """aten.alias (a view of the same tensor): identity in a value-semantics program."""
    x = _inputs(context, node, min_expected=1)[0]
    context.add(mb.identity(x=x, name=node.name))


# Overloads that torch.export names apart (sanitized kind keeps the suffix) but whose
# coremltools converter already handles every argument form: aliased to it.
_ALIASES = {
    "where.scalarother": "where",
    "where.scalarself": "where",
    "where.scalar": "where",
}

_CONVERTERS = {
    "diff": (diff, []),
    "new_ones": (new_ones, []),
    "alias": (alias, ["alias_copy"]),
}


def register() -> list[str]:
    """Register the converters coremltools lacks (never replacing one it has). Returns ADDED."""
    global _registered
    if _registered:
        return ADDED
    table = _TORCH_OPS_REGISTRY.name_to_func_mapping
    for name, (fn, aliases) in _CONVERTERS.items():
        names = [n for n in [name, *aliases] if n not in table]
        if not names:
            continue
        fn.__name__ = names[0]
        register_torch_op(fn, torch_alias=names[1:])
        ADDED.extend(names)
    for name, target in _ALIASES.items():
        if name not in table and target in table:
            _TORCH_OPS_REGISTRY.set_func_by_name(table[target], name)
            ADDED.append(name)
    # torch.export names `a & b` `aten::__and__.Tensor`, which the frontend's support check looks
    # up as "__and__" (a key `register_torch_op` refuses: it ends in "_"), while conversion
    # itself looks up "and" (bool `logical_and`, built in). Only the check's key is missing.
    if "__and__" not in table and "and" in table:
        _TORCH_OPS_REGISTRY.set_func_by_name(table["and"], "__and__")
        ADDED.append("__and__")
    _registered = True
    return ADDED
