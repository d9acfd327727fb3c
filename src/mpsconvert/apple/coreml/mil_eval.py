"""A reference evaluation of a saved ML program with numpy: NOT the Core ML runtime.

Core ML runs only on Apple platforms. To know on Linux that a package computes the right thing,
the program is read back from the `.mlpackage` (its protobuf and weight.bin, through coremltools'
milproto loader) and its ops are run in order with coremltools' own Python op definitions: each
MIL op class has a `value_inference` (constexpr ops: `materialized_val_inference`), normally used
for constant folding. They are given concrete input values through a thin view of the op.

Ops whose definition has no Python implementation are implemented here, in `_IMPLEMENTED`. `constexpr_lut_to_dense` with
one shared LUT is a numpy take (coremltools' version repeats the LUT per element: gigabytes for a real model). `linear`
and `matmul` are replaced too: numpy's float16 matmul accumulates slowly in a scalar loop; here fp16 inputs are
multiplied in float32 and rounded once to fp16, as Core ML's GPU and Neural Engine accumulate. `select` is replaced
because coremltools' definition fails when `cond` is a tensor and both branches are scalars, `scatter_along_axis`
because coremltools' writes into its input array. Every other op runs coremltools' code, in the program's dtypes (fp16).

Stateful programs (iOS18): the states are arrays the caller holds (`new_states`), read by
`read_state` and written by `coreml_update_state` / `write_state` as Core ML's runtime does with
an `MLState`; the KV cache of a decoder persists in them from one call to the next.
"""

from __future__ import annotations

import inspect
import math
import types as _pytypes
from collections import Counter
from pathlib import Path

import numpy as np

from ...errors import EvalError


def load_program(package: Path):
    """The MIL program of a saved .mlpackage (weights read from its weight.bin)."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load

    ml = ct.models.MLModel(str(package), skip_model_load=True)
    spec = ml.get_spec()
    return milproto_load(spec, spec.specificationVersion, ml.weights_dir), spec


class _Val:
    """A Var with a concrete value: what value_inference reads (`.val`, `.shape`, `.dtype`)."""

    def __init__(self, var, value):
        self._var = var
        if isinstance(value, np.bool_):  # numpy 2 refuses np.bool_ for keepdims= and friends
            value = bool(value)
        self.val = value
        self.sym_val = value

    @property
    def shape(self):
        return tuple(np.shape(self.val))

    @property
    def rank(self):
        return len(self.shape)

    @property
    def sym_type(self):
        """The type with the concrete shape (the program's may be symbolic: a RangeDim)."""
        from coremltools.converters.mil.mil import types

        dt = self._var.dtype
        return types.tensor(dt, self.shape) if self.shape else dt

    def __getattr__(self, name):
        return getattr(self._var, name)


class _OpView:
    """An op whose inputs are _Val: methods of the op class run with `self` = this view."""

    def __init__(self, op, env: dict):
        self._op = op

        def wrap(v):
            if v is None:
                return None
            if isinstance(v, (list, tuple)):
                return tuple(wrap(x) for x in v)
            return _Val(v, env[v.name] if v.name in env else v.val)

        self._input_vars = {k: wrap(v) for k, v in op._input_vars.items()}

    def __getattr__(self, name):
        if name in self._input_vars:
            return self._input_vars[name]
        attr = inspect.getattr_static(type(self._op), name, None)
        if isinstance(attr, _pytypes.FunctionType):  # a plain method: bound to the view
            return _pytypes.MethodType(attr, self)
        return getattr(self._op, name)  # static/class methods, properties, attributes


def _f32(v: _Val | None):
    return None if v is None else np.asarray(v.val, dtype=np.float32)


def _plus(y, v: _Val | None):
    """`y`, plus the optional operand `v` (a bias, a beta) where the op has one."""
    return y if v is None else y + _f32(v)


def _erf_f32(x):
    from math import erf

    return np.vectorize(erf, otypes=[np.float32])(x)


def _out_dtype(op):
    from coremltools.converters.mil.mil import types

    return types.nptype_from_builtin(op.outputs[0].dtype)


def _linear(op, view):
    return _plus(_f32(view.x) @ _f32(view.weight).T, view.bias).astype(_out_dtype(op))


def _matmul(op, view):
    x, y = _f32(view.x), _f32(view.y)
    if view.transpose_x.val:
        x = np.swapaxes(x, -1, -2)
    if view.transpose_y.val:
        y = np.swapaxes(y, -1, -2)
    return np.matmul(x, y).astype(_out_dtype(op))


def _silu(op, view):
    x = _f32(view.x)
    return (x / (1.0 + np.exp(-x))).astype(_out_dtype(op))


def _gelu(op, view):
    x = _f32(view.x)
    mode = view.mode.val if view.mode is not None else "EXACT"
    if mode == "TANH_APPROXIMATION":
        y = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    elif mode == "SIGMOID_APPROXIMATION":
        y = x / (1 + np.exp(-1.702 * x))
    else:
        y = 0.5 * x * (1 + _erf_f32(x / math.sqrt(2)))
    return y.astype(_out_dtype(op))


def _erf(op, view):
    return _erf_f32(_f32(view.x)).astype(_out_dtype(op))


def _layer_norm(op, view):
    x = _f32(view.x)
    axes = tuple(int(a) for a in np.atleast_1d(view.axes.val)) if view.axes is not None else (-1,)
    eps = float(view.epsilon.val) if view.epsilon is not None else 1e-5
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if view.gamma is not None:
        y = y * _f32(view.gamma)
    return _plus(y, view.beta).astype(_out_dtype(op))


def _gather_nd(op, view):
    x = np.asarray(view.x.val)
    idx = np.asarray(view.indices.val).astype(np.int64)
    bd = int(view.batch_dims.val) if getattr(view, "batch_dims", None) is not None else 0
    if bd:
        raise NotImplementedError("gather_nd with batch_dims > 0")
    k = idx.shape[-1]
    flat = idx.reshape(-1, k)
    dims = np.array(x.shape[:k])
    flat = np.where(flat < 0, flat + dims, flat)
    out = x[tuple(flat.T)]
    return out.reshape(idx.shape[:-1] + x.shape[k:])


def _sdpa(op, view):
    q, k, v = _f32(view.query), _f32(view.key), _f32(view.value)
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if view.attn_mask is not None:
        m = np.asarray(view.attn_mask.val)
        s = np.where(m, s, -np.inf) if m.dtype == bool else s + m.astype(np.float32)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return (p @ v).astype(_out_dtype(op))


def _lut_to_dense(op, view):
    # coremltools' decompress repeats the whole LUT for every element (256 entries per weight:
    # 450 MB for one 1536x576 matrix); a LUT shared by the tensor is a plain take.
    lut = np.asarray(view.lut.val)
    idx = np.asarray(view.indices.val)
    if lut.shape[-1] == 1 and all(d == 1 for d in lut.shape[:-2]):
        return lut.reshape(-1)[idx.astype(np.intp)]
    return type(op).materialized_val_inference(view)


def _select(op, view):
    # coremltools' select.value_inference types its result from `a` and `b` only and so fails
    # when both are scalars and `cond` is a tensor (the attention mask's where(mask, 0, -inf)).
    return np.where(np.asarray(view.cond.val), np.asarray(view.a.val), np.asarray(view.b.val)).astype(_out_dtype(op))


def _scatter_along_axis(op, view):
    # coremltools' value_inference writes into `data` itself (an array other ops may still read)
    data = np.array(view.data.val, copy=True)
    idx = np.asarray(view.indices.val).astype(np.intp)
    axis = int(view.axis.val)
    idx = np.where(idx < 0, idx + data.shape[axis], idx)
    mode = view.mode.val if view.mode is not None else "update"
    upd = np.asarray(view.updates.val).astype(data.dtype)
    if mode != "update":
        raise NotImplementedError(f"scatter_along_axis mode {mode!r}")
    np.put_along_axis(data, idx, upd, axis=axis)
    return data


def _topk(op, view):
    # coremltools' iOS16 topk.value_inference calls super() on the op class, which a view is not
    x = np.asarray(view.x.val)
    k = int(view.k.val) if view.k is not None else 1
    axis = int(view.axis.val) if view.axis is not None else -1
    ascending = bool(view.ascending.val) if view.ascending is not None else False
    order = np.argsort(x if ascending else -x, axis=axis, kind="stable")
    idx = np.take(order, np.arange(k), axis=axis)
    vals = np.take_along_axis(x, idx, axis=axis)
    return vals.astype(_out_dtype(op)), idx.astype(types_np(op.outputs[1]))


def types_np(var):
    from coremltools.converters.mil.mil import types

    return types.nptype_from_builtin(var.dtype)


_IMPLEMENTED = {
    "constexpr_lut_to_dense": _lut_to_dense,
    "select": _select,
    "linear": _linear,
    "matmul": _matmul,
    "silu": _silu,
    "gelu": _gelu,
    "erf": _erf,
    "layer_norm": _layer_norm,
    "gather_nd": _gather_nd,
    "scaled_dot_product_attention": _sdpa,
    "scatter_along_axis": _scatter_along_axis,
    "topk": _topk,
}
# Ops that read or write the program's states (iOS18 stateful models), run by `evaluate` itself.
STATE_OPS = ("read_state", "write_state", "coreml_update_state")


def _has_definition(op) -> bool:
    return any("value_inference" in c.__dict__ for c in type(op).__mro__ if c.__name__ != "Operation")


def state_inputs(prog, function: str = "main") -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The states a function declares: name -> (shape, numpy dtype)."""
    from coremltools.converters.mil.mil import types

    out = {}
    for name, var in prog.functions[function].inputs.items():
        if types.is_state(var.sym_type):
            wrapped = var.sym_type.wrapped_type()
            out[name] = (
                tuple(int(d) for d in wrapped.get_shape()),
                np.dtype(types.nptype_from_builtin(wrapped.get_primitive())),
            )
    return out


def new_states(prog, function: str = "main") -> dict[str, np.ndarray]:
    """Zero-filled states for a new conversation (what Core ML's `make_state()` gives)."""
    return {n: np.zeros(shape, dtype=dt) for n, (shape, dt) in state_inputs(prog, function).items()}


def evaluate(
    prog,
    inputs: dict[str, np.ndarray],
    function: str = "main",
    states: dict[str, np.ndarray] | None = None,
    cache: dict | None = None,
) -> tuple[dict[str, np.ndarray], Counter]:
    """Run `prog` on `inputs` (name -> array). Returns (outputs by name, ops evaluated by how:
    'coremltools:<op>' or 'mpsconvert:<op>').

    states: name -> array for a stateful program (`new_states`); the program's writes land in
        these arrays, so passing the same dict again continues the conversation.
    cache: a dict kept between calls of one program: the constexpr weights it decodes are kept
        there (decoded once, not at every decode step).
    """
    from coremltools.converters.mil.mil import types

    f = prog.functions[function]
    declared = state_inputs(prog, function)
    env: dict[str, np.ndarray] = {}
    state_of: dict[str, str] = {}  # program var -> state name
    for name, var in f.inputs.items():
        if name in declared:
            if states is None or name not in states:
                raise EvalError(f"state {name!r} not given", "pass states=new_states(prog)")
            if states[name].shape != declared[name][0]:
                raise EvalError(
                    f"state {name!r} has shape {states[name].shape}, the program declares {declared[name][0]}"
                )
            state_of[var.name] = name
            continue
        if name not in inputs:
            raise EvalError(f"input {name!r} not given")
        env[var.name] = np.asarray(inputs[name]).astype(types.nptype_from_builtin(var.dtype))
    how: Counter = Counter()
    for op in f.operations:
        if op.blocks:
            raise EvalError(f"op {op.op_type} ({op.name}) has nested blocks: control flow is not evaluated")
        if op.op_type == "const":
            env[op.outputs[0].name] = op.outputs[0].val
            continue
        if op.op_type in STATE_OPS:
            state = states[state_of[(op.input if op.op_type == "read_state" else op.state).name]]
            if op.op_type != "read_state":
                state[...] = np.asarray(env[op.value.name]).astype(state.dtype)
            if op.outputs:
                env[op.outputs[0].name] = np.array(state, copy=True)
            how[f"mpsconvert:{op.op_type}"] += 1
            continue
        if cache is not None and op.op_type.startswith("constexpr_") and op.name in cache:
            env[op.outputs[0].name] = cache[op.name]
            continue
        view = _OpView(op, env)
        try:
            if op.op_type in _IMPLEMENTED:
                val = _IMPLEMENTED[op.op_type](op, view)
                how[f"mpsconvert:{op.op_type}"] += 1
            elif op.op_type.startswith("constexpr_"):
                val = type(op).materialized_val_inference(view)
                how[f"coremltools:{op.op_type}"] += 1
            elif _has_definition(op):
                val = type(op).value_inference(view)
                how[f"coremltools:{op.op_type}"] += 1
            else:
                raise EvalError(
                    f"op {op.op_type} has no Python definition in coremltools or mpsconvert.apple.coreml.mil_eval",
                    "add an implementation of it there",
                )
        except EvalError:
            raise
        except Exception as e:
            given = {
                k: (np.asarray(v.val).dtype.name, np.shape(v.val))
                for k, v in view._input_vars.items()
                if isinstance(v, _Val)
            }
            raise EvalError(
                f"evaluating op {op.op_type} ({op.name}) failed: {type(e).__name__}: {e}; inputs {given}"
            ) from e
        vals = val if len(op.outputs) > 1 else (val,)
        for out, v in zip(op.outputs, vals):
            # Keep the program's declared dtype (numpy promotes: real_div of int32 gives float64).
            env[out.name] = np.asarray(v).astype(types.nptype_from_builtin(out.dtype), copy=False)
        if cache is not None and op.op_type.startswith("constexpr_"):
            cache[op.name] = env[op.outputs[0].name]
    return {v.name: env[v.name] for v in f.outputs}, how
