"""Record a trace from any optimizer: a ``torch.optim.Optimizer`` or an optax transformation.

:func:`record` runs an implementation on a problem for a number of steps and writes what it
did in the golden-trace layout (``xopt-trace/1``, FORMAT.md): the parameters before the
first update, each step's gradient and loss, the parameters and the whole optimizer state
after each update, the library versions and the machine. State is flattened with the names
the library itself uses:

* torch: ``<param>/<key>`` for ``optimizer.state[p][key]`` (``fc/weight/exp_avg``); a list
  in the state (LBFGS's history) as ``<param>/<key>/<i>``;
* optax: the state pytree's path (``0/mu/fc/weight``, ``0/count``), as
  ``jax.tree_util.tree_flatten_with_path`` spells it.

A problem supplies the gradients on the recorded optimizer's own trajectory:

* a bundled one by name (:data:`PROBLEMS`: small NumPy problems with analytic gradients, so
  a torch and an optax recording on the same problem and seed start from the same bits);
* the user's own model: :func:`torch_problem` (an ``nn.Module`` and a loss) or
  :func:`jax_problem` (a parameter pytree and a loss function);
* a fixed gradient sequence: :func:`gradient_sequence`.

Any problem drives any implementation: the optimizer steps on its own copy of the
parameters and the problem reads them back to compute the next gradient, so a torch model
can be trained by an optax transformation and the other way round.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import platform
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xopt.errors import XoptError
from xopt.parity.trace import TRACE_FORMAT, Trace, load_trace, step_prefix, write_trace

Arrays = dict[str, np.ndarray]


class RecordError(XoptError, ValueError):
    """An implementation, problem or state that cannot be recorded or replayed; the
    message names the optimizer, parameter or state key at fault."""


# -- problems ---------------------------------------------------------------------------------


class Problem:
    """Gradients on demand: ``init_params()`` and ``loss_and_grads(params, t)``."""

    name: str = "problem"
    description: str = ""

    def init_params(self) -> Arrays:
        raise NotImplementedError

    def loss_and_grads(self, params: Mapping[str, np.ndarray], t: int) -> tuple[float, Arrays]:
        raise NotImplementedError


class _Regression(Problem):
    """Least squares through an optional tanh layer, in NumPy float64, rounded to float32.

    Inputs are scaled per feature by ``geomspace(1, 0.1)`` (an ill-conditioned problem, so
    adaptive and plain methods move differently); targets come from a random teacher plus
    N(0, 0.05²) noise; 128 fixed rows, batch 16, step t uses rows [16k, 16k+16), k = t mod 8.
    """

    def __init__(self, name: str, seed: int, *, hidden: int | None, bias: bool,
                 d_in: int = 8, d_out: int = 4) -> None:
        self.name, self.seed, self.hidden, self.bias = name, seed, hidden, bias
        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((128, d_in)) * np.geomspace(1, 0.1, d_in)
        if hidden is None:
            teacher = rng.standard_normal((d_out, d_in))
            self.y = self.x @ teacher.T
        else:
            t0 = rng.standard_normal((hidden, d_in)) / np.sqrt(d_in)
            t1 = rng.standard_normal((d_out, hidden)) / np.sqrt(hidden)
            self.y = np.tanh(self.x @ t0.T) @ t1.T
        self.y = self.y + 0.05 * rng.standard_normal(self.y.shape)
        shapes = ({"weight": (d_out, d_in)} if hidden is None else
                  {"mlp/0/weight": (hidden, d_in), "mlp/1/weight": (d_out, hidden)})
        init: Arrays = {}
        for k, shape in shapes.items():
            init[k] = rng.standard_normal(shape) / np.sqrt(shape[1])
            if bias:
                init[k.replace("weight", "bias")] = 0.1 * rng.standard_normal(shape[0])
        order = sorted(init, key=lambda k: (k.rpartition("/")[0], k.endswith("bias")))
        self._init = {k: init[k].astype(np.float32) for k in order}
        kind = "linear" if hidden is None else f"tanh MLP (hidden {hidden})"
        self.description = (
            f"bundled problem {name!r} (seed {seed}): least squares mean_b 0.5||f(x_b) - y_b||² "
            f"with f a {kind}{' with biases' if bias else ', no biases'}; x (128, {d_in}) "
            f"scaled per feature by geomspace(1, 0.1), y from a random teacher + N(0, 0.05²); "
            f"batch 16, step t uses rows [16k, 16k+16), k = t mod 8; gradients analytic in "
            f"NumPy float64, rounded to float32")

    def init_params(self) -> Arrays:
        return {k: v.copy() for k, v in self._init.items()}

    def loss_and_grads(self, params: Mapping[str, np.ndarray], t: int) -> tuple[float, Arrays]:
        k = t % 8
        x, y = self.x[16 * k:16 * k + 16], self.y[16 * k:16 * k + 16]
        p = {n: np.asarray(v, dtype=np.float64) for n, v in params.items()}
        n = x.shape[0]
        g: dict[str, np.ndarray] = {}
        if self.hidden is None:
            out = x @ p["weight"].T + (p["bias"] if self.bias else 0.0)
            r = (out - y) / n
            g["weight"] = r.T @ x
            if self.bias:
                g["bias"] = r.sum(0)
        else:
            w0, w1 = p["mlp/0/weight"], p["mlp/1/weight"]
            h = np.tanh(x @ w0.T + (p["mlp/0/bias"] if self.bias else 0.0))
            out = h @ w1.T + (p["mlp/1/bias"] if self.bias else 0.0)
            r = (out - y) / n
            g["mlp/1/weight"] = r.T @ h
            dh = (r @ w1) * (1 - h * h)
            g["mlp/0/weight"] = dh.T @ x
            if self.bias:
                g["mlp/1/bias"] = r.sum(0)
                g["mlp/0/bias"] = dh.sum(0)
        loss = 0.5 * float(((out - y) ** 2).sum(-1).mean())
        return float(np.float32(loss)), {k: g[k].astype(np.float32) for k in self._init}


#: The bundled problems: ``name -> (seed -> Problem)``.
PROBLEMS: dict[str, Callable[[int], Problem]] = {
    "mlp": lambda seed: _Regression("mlp", seed, hidden=16, bias=True),
    "mlp-nobias": lambda seed: _Regression("mlp-nobias", seed, hidden=16, bias=False),
    "linear": lambda seed: _Regression("linear", seed, hidden=None, bias=True),
}


def problem(name: str, seed: int = 0) -> Problem:
    """A bundled problem by name (:data:`PROBLEMS`) or a ``"module:attr"`` that is a
    :class:`Problem` or a function ``seed -> Problem``."""
    if name in PROBLEMS:
        return PROBLEMS[name](seed)
    if ":" in name:
        obj = _import(name)
        obj = obj(seed) if callable(obj) and not isinstance(obj, Problem) else obj
        if isinstance(obj, Problem):
            return obj
        raise RecordError(f"problem {name!r} is not an xopt.parity.Problem")
    raise RecordError(f"unknown problem {name!r}; bundled: {', '.join(PROBLEMS)} "
                      f"(or module:attr of a Problem)")


class _TorchModelProblem(Problem):
    def __init__(self, model: Any, loss_fn: Callable[..., Any], data: Any, name: str) -> None:
        self.model, self.loss_fn, self.data, self.name = model, loss_fn, data, name
        self.named = [(k.replace(".", "/"), p) for k, p in model.named_parameters()
                      if p.requires_grad]
        if not self.named:
            raise RecordError(f"{name}: the model has no trainable parameters")
        self.description = (f"the user's torch model {type(model).__name__} with loss "
                            f"{getattr(loss_fn, '__name__', 'loss_fn')}; gradients by torch "
                            f"autograd")

    def init_params(self) -> Arrays:
        return {k: _numpy(p) for k, p in self.named}

    def loss_and_grads(self, params: Mapping[str, np.ndarray], t: int) -> tuple[float, Arrays]:
        import torch

        with torch.no_grad():
            for k, p in self.named:
                p.copy_(torch.from_numpy(np.array(params[k])).to(p.dtype))
        for _, p in self.named:
            p.grad = None
        loss = self.loss_fn(self.model, _batch(self.data, t, self.name))
        loss.backward()
        grads = {}
        for k, p in self.named:
            grads[k] = np.zeros(tuple(p.shape), np.float32) if p.grad is None else _numpy(p.grad)
        return float(loss.detach()), grads


class _JaxLossProblem(Problem):
    def __init__(self, params: Any, loss_fn: Callable[..., Any], data: Any, name: str) -> None:
        import jax

        from xopt.parity.runners import flatten_with_paths

        self.name = name
        self.tree = params
        flat = flatten_with_paths(params)
        self.keys = list(flat)
        self._init = {k: np.asarray(v) for k, v in flat.items()}
        self.data = data
        self._vg = jax.jit(jax.value_and_grad(loss_fn))
        self.description = (f"the user's JAX loss {getattr(loss_fn, '__name__', 'loss_fn')}; "
                            f"gradients by jax.value_and_grad under jit")

    def init_params(self) -> Arrays:
        return {k: v.copy() for k, v in self._init.items()}

    def loss_and_grads(self, params: Mapping[str, np.ndarray], t: int) -> tuple[float, Arrays]:
        from xopt.parity.runners import flatten_with_paths, replace_by_paths

        tree = replace_by_paths(self.tree, dict(params))
        loss, g = self._vg(tree, _batch(self.data, t, self.name))
        return float(loss), {k: np.asarray(v) for k, v in flatten_with_paths(g).items()}


class _GradientSequence(Problem):
    def __init__(self, params: Mapping[str, Any], grads: Sequence[Mapping[str, Any]],
                 losses: Sequence[float] | None, name: str) -> None:
        self.name = name
        self._init = {k: np.array(v) for k, v in params.items()}
        self.grads = [{k: np.asarray(g[k]) for k in self._init} for g in grads]
        self.losses = None if losses is None else [float(x) for x in losses]
        for t, g in enumerate(grads):
            missing = sorted(set(self._init) - set(g))
            if missing:
                raise RecordError(f"{name}: gradient {t} lacks {', '.join(missing)}")
            for k in self._init:
                if np.shape(g[k]) != self._init[k].shape:
                    raise RecordError(f"{name}: gradient {t} of {k!r} has shape "
                                      f"{np.shape(g[k])}, the parameter {self._init[k].shape}")
        self.description = f"a fixed sequence of {len(grads)} gradients given by the user"

    def init_params(self) -> Arrays:
        return {k: v.copy() for k, v in self._init.items()}

    def loss_and_grads(self, params: Mapping[str, np.ndarray], t: int) -> tuple[float, Arrays]:
        if t >= len(self.grads):
            raise RecordError(f"{self.name}: only {len(self.grads)} gradients, step {t} asked")
        loss = 0.0 if self.losses is None else self.losses[t]
        return loss, {k: v.copy() for k, v in self.grads[t].items()}


def torch_problem(model: Any, loss_fn: Callable[[Any, Any], Any], data: Any, *,
                  name: str = "model") -> Problem:
    """The user's torch model: ``loss_fn(model, batch)`` returns a scalar loss tensor;
    ``data`` is a sequence of batches (step t uses ``data[t % len(data)]``) or a function
    ``t -> batch``. Parameters are named as ``model.named_parameters()`` with ``/`` for
    ``.``."""
    return _TorchModelProblem(model, loss_fn, data, name)


def jax_problem(params: Any, loss_fn: Callable[[Any, Any], Any], data: Any, *,
                name: str = "model") -> Problem:
    """The user's JAX model: a parameter pytree and ``loss_fn(params, batch)``; ``data`` as
    in :func:`torch_problem`. Parameters are named by their pytree paths
    (``params/Dense_0/kernel``)."""
    return _JaxLossProblem(params, loss_fn, data, name)


def gradient_sequence(params: Mapping[str, Any], grads: Sequence[Mapping[str, Any]],
                      losses: Sequence[float] | None = None, *, name: str = "grads") -> Problem:
    """A fixed stream: the initial parameters and one ``{name: gradient}`` per step (the
    gradients do not depend on the parameters)."""
    return _GradientSequence(params, grads, losses, name)


def _batch(data: Any, t: int, where: str) -> Any:
    if callable(data):
        return data(t)
    try:
        return data[t % len(data)]
    except TypeError:
        raise RecordError(f"{where}: data must be a sequence of batches or a function "
                          f"t -> batch") from None


def _numpy(v: Any) -> np.ndarray:
    if hasattr(v, "detach"):
        v = v.detach().cpu()
        if str(v.dtype) in ("torch.bfloat16", "torch.float16"):
            v = v.float()
        return v.numpy().copy()
    return np.asarray(v)


# -- implementations --------------------------------------------------------------------------


class Implementation:
    """One live optimizer on NumPy parameters: ``start``, ``set_state``, ``step``, ``read``.

    ``twin(dtype)`` is the same optimizer in another precision (float64: the float64 twin
    that estimates the exact result of the same code).
    """

    framework: str
    label: str
    call: str | None
    hyperparameters: dict[str, Any]

    def twin(self, dtype: Any) -> Implementation:
        raise NotImplementedError

    def start(self, params: Mapping[str, np.ndarray]) -> None:
        raise NotImplementedError

    def set_state(self, flat: Mapping[str, np.ndarray]) -> None:
        raise NotImplementedError

    def step(self, grads: Mapping[str, np.ndarray], loss: float) -> None:
        raise NotImplementedError

    def read(self) -> tuple[Arrays, Arrays]:
        raise NotImplementedError

    def state_types(self) -> dict[str, str]:
        """Non-array state values by key (``int``, ``float``, ``bool``, ``list``)."""
        return {}


class TorchImplementation(Implementation):
    """``factory(list of tensors) -> torch.optim.Optimizer``; the list follows the trace's
    parameter order. ``step`` always passes a closure returning the recorded loss (LBFGS
    needs one); an optimizer that calls it more than once per step (a line search, or
    LBFGS with ``max_iter > 1``) cannot be replayed from recorded gradients and is refused."""

    framework = "torch"

    def __init__(self, factory: Callable[[list[Any]], Any], label: str, *,
                 call: str | None = None, dtype: Any = None,
                 hyperparameters: Mapping[str, Any] | None = None) -> None:
        self.factory, self.label, self.call = factory, label, call
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.hyperparameters = dict(hyperparameters or {})
        self._types: dict[str, str] = {}
        self._like: dict[str, Any] = {}

    def twin(self, dtype: Any) -> TorchImplementation:
        return TorchImplementation(self.factory, self.label, call=self.call, dtype=dtype,
                                   hyperparameters=self.hyperparameters)

    def start(self, params: Mapping[str, np.ndarray]) -> None:
        import torch

        self.names = list(params)
        self.tensors = []
        for k in self.names:
            a = np.array(params[k], dtype=self.dtype or np.asarray(params[k]).dtype, copy=True)
            # as model parameters are: some optimizers skip tensors that need no gradient
            self.tensors.append(torch.from_numpy(a).requires_grad_(True))
        opt = self.factory(self.tensors)
        if not isinstance(opt, torch.optim.Optimizer):
            raise RecordError(f"{self.label}: the factory returned {type(opt).__name__}, "
                              f"not a torch.optim.Optimizer")
        self.opt = opt
        if not self.hyperparameters:
            self.hyperparameters = _jsonable(opt.defaults)

    def set_state(self, flat: Mapping[str, np.ndarray]) -> None:
        import torch

        by_param: dict[int, dict[str, Any]] = {}
        lists: dict[tuple[int, str], dict[int, Any]] = {}
        for key, value in flat.items():
            i, var = _split_param(key, self.names)
            if i is None:
                raise RecordError(f"{self.label}: state key {key!r} names no parameter "
                                  f"({', '.join(self.names)})")
            head, _, idx = var.rpartition("/")
            if self._types.get(head) == "object":
                raise RecordError(f"{self.label}: state {head!r} of {self.names[i]!r} is an "
                                  f"object ({key!r}); it cannot be set from a trace, so "
                                  f"compare this optimizer closed loop only")
            if head and idx.isdigit() and self._types.get(head, "").startswith("list"):
                lists.setdefault((i, head), {})[int(idx)] = value
                continue
            by_param.setdefault(i, {})[var] = self._value(var, value, torch)
        for (i, var), items in lists.items():
            kind = self._types[var]
            n = int(kind[5:-1]) if kind.startswith("list[") else max(items) + 1
            seq = [None] * max(n, max(items) + 1)
            for j, v in items.items():
                seq[j] = self._value(var, v, torch)
            by_param.setdefault(i, {})[var] = seq
        self.opt.state.clear()
        for i, entries in by_param.items():
            self.opt.state[self.tensors[i]] = entries

    def _value(self, var: str, value: Any, torch: Any) -> Any:
        kind = self._types.get(var)
        a = np.asarray(value)
        if kind == "int":
            return int(a)
        if kind == "float":
            return float(a)
        if kind == "bool":
            return bool(a)
        like = self._like.get(var)
        t = torch.from_numpy(np.array(a, copy=True))
        if like is not None:
            t = t.to(like)
        elif self.dtype is not None and np.issubdtype(a.dtype, np.floating) and a.ndim > 0:
            t = t.to(_torch_dtype(self.dtype))
        return t

    def step(self, grads: Mapping[str, np.ndarray], loss: float) -> None:
        import torch

        for k, p in zip(self.names, self.tensors, strict=True):
            g = np.array(grads[k], dtype=self.dtype or np.asarray(grads[k]).dtype, copy=True)
            p.grad = torch.from_numpy(g)
        calls = [0]

        def closure():
            calls[0] += 1
            if calls[0] > 1:
                raise RecordError(
                    f"{self.label} evaluated the closure twice in one step (a line search, "
                    f"or LBFGS with max_iter > 1): recorded gradients cannot replay it; "
                    f"use max_iter=1 and no line search")
            return torch.tensor(loss, dtype=p.dtype)

        with torch.no_grad():
            self.opt.step(closure)

    def read(self) -> tuple[Arrays, Arrays]:
        params = {k: _numpy(p) for k, p in zip(self.names, self.tensors, strict=True)}
        flat: Arrays = {}
        for k, p in zip(self.names, self.tensors, strict=True):
            for var, v in self.opt.state.get(p, {}).items():
                self._flatten(f"{k}/{var}", var, v, flat)
        return params, flat

    def _flatten(self, key: str, var: str, v: Any, out: Arrays) -> None:
        if hasattr(v, "detach"):
            self._like.setdefault(var, v.dtype)
            if not self._types.get(var, "").startswith("list"):
                self._types.pop(var, None)  # LBFGS's H_diag: an int at first, then a tensor
            out[key] = _numpy(v)
        elif isinstance(v, (list, tuple)):
            # a list holding None (LBFGS's ``al``) keeps its length: "list[n]"
            if any(x is None for x in v) or self._types.get(var, "").startswith("list["):
                self._types[var] = f"list[{len(v)}]"
            else:
                self._types[var] = "list"
            for j, item in enumerate(v):
                if item is not None:
                    self._flatten(f"{key}/{j}", var, item, out)
        elif isinstance(v, bool):
            self._types[var] = "bool"
            out[key] = np.asarray(v)
        elif isinstance(v, int):
            self._types[var] = "int"
            out[key] = np.asarray(v, dtype=np.int64)
        elif isinstance(v, float):
            self._types[var] = "float"
            out[key] = np.asarray(v, dtype=np.float64)
        elif v is None:
            return
        elif hasattr(v, "__dict__"):
            # an object in the state (GaLore's and COAP's projectors): its tensors, read
            # only (``<key>/<attribute>``); such a state cannot be set from a trace
            self._types[var] = "object"
            for attr, item in vars(v).items():
                if hasattr(item, "detach"):
                    out[f"{key}/{attr}"] = _numpy(item)
        else:
            raise RecordError(f"{self.label}: state {key!r} holds a {type(v).__name__}, "
                              f"which a trace cannot store")

    def state_types(self) -> dict[str, str]:
        return dict(self._types)

    def learn_types(self, types: Mapping[str, str]) -> None:
        """Non-tensor state kinds recorded in a trace (``state_types``), for ``set_state``
        before this optimizer has run a step of its own."""
        for k, v in types.items():
            self._types.setdefault(k, v)


def _torch_dtype(dtype: np.dtype) -> Any:
    import torch

    return {np.dtype(np.float64): torch.float64, np.dtype(np.float32): torch.float32}[dtype]


def _split_param(key: str, names: Sequence[str]) -> tuple[int | None, str]:
    """``"<param>/<var>"`` -> (index of the longest matching parameter name, var)."""
    best, var = None, key
    for i, n in enumerate(names):
        if key.startswith(n + "/") and (best is None or len(n) > len(names[best])):
            best, var = i, key[len(n) + 1:]
    return best, var


class OptaxImplementation(Implementation):
    """An optax ``GradientTransformation`` on a flat dict of parameters, jitted once per
    precision; ``value=loss`` is passed to transformations that take extra arguments. The
    float64 twin runs under ``jax.enable_x64``."""

    framework = "optax"

    def __init__(self, tx: Any, label: str, *, call: str | None = None, dtype: Any = None,
                 hyperparameters: Mapping[str, Any] | None = None) -> None:
        import jax
        import optax

        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise RecordError(f"{label}: not an optax GradientTransformation")
        self.tx, self.label, self.call = tx, label, call
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.hyperparameters = dict(hyperparameters or {})
        extra = isinstance(tx, optax.GradientTransformationExtraArgs)

        def _step(params, state, grads, loss):
            kwargs = {"value": loss} if extra else {}
            updates, state = tx.update(grads, state, params, **kwargs)
            return optax.apply_updates(params, updates), state

        self._step = jax.jit(_step)

    def twin(self, dtype: Any) -> OptaxImplementation:
        return OptaxImplementation(self.tx, self.label, call=self.call, dtype=dtype,
                                   hyperparameters=self.hyperparameters)

    def _x64(self):
        import contextlib

        import jax

        return jax.enable_x64(True) if self.dtype == np.float64 else contextlib.nullcontext()

    def _array(self, a: Any, dtype: Any = None) -> Any:
        import jax.numpy as jnp

        a = np.asarray(a)
        if dtype is None and self.dtype is not None and np.issubdtype(a.dtype, np.floating):
            dtype = self.dtype
        return jnp.asarray(a if dtype is None else a.astype(dtype))

    def start(self, params: Mapping[str, np.ndarray]) -> None:
        self.names = list(params)
        with self._x64():
            self.params = {k: self._array(params[k]) for k in self.names}
            self.state = self.tx.init(self.params)

    def set_state(self, flat: Mapping[str, np.ndarray]) -> None:
        from xopt.parity.runners import flatten_with_paths, replace_by_paths

        with self._x64():
            current = flatten_with_paths(self.state)
            unknown = sorted(set(flat) - set(current))
            if unknown:
                raise RecordError(f"{self.label}: no state leaf {', '.join(unknown)}; its "
                                  f"state has {', '.join(current)}")
            for k, v in flat.items():
                if np.shape(v) != np.shape(current[k]):
                    raise RecordError(f"{self.label}: state {k!r} has shape {np.shape(v)}, "
                                      f"the transformation's {np.shape(current[k])}")
            self.state = replace_by_paths(self.state, dict(flat))

    def step(self, grads: Mapping[str, np.ndarray], loss: float) -> None:
        with self._x64():
            g = {k: self._array(grads[k]) for k in self.names}
            dtype = self.dtype or np.asarray(grads[self.names[0]]).dtype
            self.params, self.state = self._step(self.params, self.state, g,
                                                 self._array(np.asarray(loss, dtype=dtype)))

    def read(self) -> tuple[Arrays, Arrays]:
        from xopt.parity.runners import flatten_with_paths

        params = {k: np.asarray(v) for k, v in self.params.items()}
        return params, {k: np.asarray(v) for k, v in flatten_with_paths(self.state).items()}


def implementation(obj: Any, label: str | None = None) -> Implementation:
    """An :class:`Implementation` from a torch optimizer class or factory
    (``params -> Optimizer``), an optax ``GradientTransformation``, a call string
    (:func:`parse_call`), or an :class:`Implementation` (returned as it is)."""
    if isinstance(obj, Implementation):
        return obj
    if isinstance(obj, str):
        return parse_call(obj)
    if hasattr(obj, "init") and hasattr(obj, "update") and not isinstance(obj, type):
        return OptaxImplementation(obj, label or _optax_label(obj))
    if isinstance(obj, type) and _is_torch_optimizer_class(obj):
        return TorchImplementation(obj, label or _qualname(obj))
    if callable(obj):
        return TorchImplementation(obj, label or getattr(obj, "__name__", "torch optimizer"))
    raise RecordError(f"{obj!r} is neither a torch.optim.Optimizer factory nor an optax "
                      f"GradientTransformation")


def _is_torch_optimizer_class(cls: type) -> bool:
    return any(f"{c.__module__}.{c.__qualname__}" == "torch.optim.optimizer.Optimizer"
               for c in cls.__mro__)


def _qualname(obj: Any) -> str:
    module = obj.__module__ or ""
    # torch.optim.adam.Adam -> torch.optim.Adam, as users write it
    if module.startswith("torch.optim.") and obj.__name__ in dir(importlib.import_module(
            "torch.optim")):
        module = "torch.optim"
    return f"{module}.{obj.__qualname__}"


def _optax_label(tx: Any) -> str:
    fn = getattr(tx.init, "__qualname__", "")
    return f"optax transformation ({fn.split('.<locals>')[0]})" if fn else "optax transformation"


def parse_call(text: str) -> Implementation:
    """``"torch.optim.Adam(lr=1e-3, betas=(0.9, 0.99))"``, ``"optax.adam(1e-3)"``,
    ``"optax.contrib.muon(learning_rate=0.02)"`` or ``"package.module:attr(...)"``.

    Arguments must be Python literals. A torch optimizer class gets the parameters first;
    anything else is called with the arguments and must return an optax transformation, or
    a function ``params -> torch.optim.Optimizer``.
    """
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise RecordError(f"{text!r}: not a call such as torch.optim.Adam(lr=1e-3) "
                          f"({e.msg})") from None
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    if isinstance(node, ast.Call):
        target = ast.unparse(node.func)
        try:
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        except ValueError:
            raise RecordError(f"{text!r}: arguments must be literals (numbers, strings, "
                              f"tuples, lists, dicts, True/False/None)") from None
        if any(k.arg is None for k in node.keywords):
            raise RecordError(f"{text!r}: **kwargs are not supported")
    else:
        target = text.strip()
    obj = _import(target)
    call = _canonical_call(target, args, kwargs)
    if isinstance(obj, type) and _is_torch_optimizer_class(obj):
        def factory(params: list[Any]) -> Any:
            return obj(params, *args, **kwargs)

        hp = dict(kwargs)
        if args:
            hp["args"] = list(args)
        return TorchImplementation(factory, _qualname(obj), call=call,
                                   hyperparameters=_jsonable(hp))
    if not callable(obj) and hasattr(obj, "init"):
        return OptaxImplementation(obj, target, call=call)
    if not callable(obj):
        raise RecordError(f"{target}: not callable, not an optax transformation")
    result = obj(*args, **kwargs)
    hp = _jsonable({**({"args": list(args)} if args else {}), **kwargs})
    if hasattr(result, "init") and hasattr(result, "update"):
        return OptaxImplementation(result, target, call=call, hyperparameters=hp)
    if callable(result):
        return TorchImplementation(result, target, call=call, hyperparameters=hp)
    raise RecordError(f"{text}: returned {type(result).__name__}, neither an optax "
                      f"transformation nor a torch optimizer factory")


def _canonical_call(target: str, args: list[Any], kwargs: dict[str, Any]) -> str:
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{target}({', '.join(parts)})"


def _import(target: str) -> Any:
    """``"a.b:c.d"`` or ``"a.b.c"`` (the longest importable module prefix)."""
    if ":" in target:
        module_name, _, attr = target.partition(":")
        parts = [p for p in attr.split(".") if p]
    else:
        pieces = target.split(".")
        module_name, parts = "", pieces
        for i in range(len(pieces), 0, -1):
            try:
                importlib.import_module(".".join(pieces[:i]))
            except ImportError:
                continue
            module_name, parts = ".".join(pieces[:i]), pieces[i:]
            break
        if not module_name:
            raise RecordError(f"{target!r}: no importable module in the name")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise RecordError(f"{target!r}: cannot import {module_name!r} ({e})") from None
    for p in parts:
        if not hasattr(obj, p):
            raise RecordError(f"{target!r}: {module_name} has no attribute "
                              f"{'.'.join(parts)!r}")
        obj = getattr(obj, p)
    return obj


def _jsonable(d: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, (bool, int, float, str)) or v is None:
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str))
                                                  for x in v):
            out[k] = list(v)
        elif hasattr(v, "item") and np.ndim(v) == 0:
            out[k] = np.asarray(v).item()
        elif callable(v):
            out[k] = getattr(v, "__name__", "callable")
        else:
            out[k] = repr(v)
    return out


# -- recording --------------------------------------------------------------------------------


@dataclasses.dataclass
class Recording:
    """A trace in memory: the manifest and the arrays, as :func:`write_trace` takes them."""

    manifest: dict[str, Any]
    arrays: Arrays

    @property
    def name(self) -> str:
        return f"{self.manifest['method']}/{self.manifest['case']}"

    @property
    def params(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v) for k, v in self.manifest["params"].items()}

    @property
    def steps(self) -> int:
        return int(self.manifest["steps"])

    def write(self, path: str | Path) -> Path:
        return write_trace(path, self.manifest, self.arrays)

    @classmethod
    def from_trace(cls, trace: Trace | str | Path) -> Recording:
        t = trace if isinstance(trace, Trace) else load_trace(trace)
        if t.kind != "optimizer":
            raise RecordError(f"{t.path}: a {t.kind!r} trace; compare replays optimizer traces")
        return cls(dict(t.manifest), {k: t.array(k) for k in t.keys()})

    # the accessors the comparison needs (FORMAT.md's layout)
    def init_params(self) -> Arrays:
        return {k: self.arrays[f"init/param/{k}"] for k in self.params}

    def init_state(self) -> Arrays:
        return _group(self.arrays, "init/state/")

    def grads(self, t: int) -> Arrays:
        return {k: self.arrays[f"{step_prefix(t)}/grad/{k}"] for k in self.params}

    def loss(self, t: int) -> float:
        key = f"{step_prefix(t)}/loss"
        return float(self.arrays[key]) if key in self.arrays else 0.0

    def params_after(self, t: int) -> Arrays:
        return {k: self.arrays[f"{step_prefix(t)}/param/{k}"] for k in self.params}

    def state_after(self, t: int) -> Arrays:
        return _group(self.arrays, f"{step_prefix(t)}/state/")

    def implementation(self) -> Implementation | None:
        """The live implementation that recorded this trace, where its manifest names a
        call that can be rebuilt here (``source.call``); else None."""
        call = self.manifest.get("source", {}).get("call")
        if not call:
            return None
        try:
            impl = parse_call(call)
        except (RecordError, ImportError, TypeError, ValueError):
            return None
        if isinstance(impl, TorchImplementation):
            impl.learn_types(self.manifest.get("state_types", {}))
        return impl


def _group(arrays: Mapping[str, np.ndarray], prefix: str) -> Arrays:
    n = len(prefix)
    return {k[n:]: v for k, v in arrays.items() if k.startswith(prefix)}


def versions() -> dict[str, str]:
    """Python, NumPy, xopt and whichever of torch, jax, jaxlib, optax are imported."""
    import sys

    from xopt import __version__

    out = {"python": platform.python_version(), "numpy": np.__version__, "xopt": __version__}
    for name in ("torch", "jax", "jaxlib", "optax"):
        if name in sys.modules:
            out[name] = getattr(sys.modules[name], "__version__", "?")
    return out


def machine() -> str:
    """The CPU (and torch's thread count and any CUDA device), as traces record it."""
    import sys

    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"cpu ({platform.machine()}, {model}"
    if "torch" in sys.modules:
        desc += f", torch.get_num_threads()={sys.modules['torch'].get_num_threads()}"
    return desc + ")"


def record(optimizer: Any, problem: str | Problem = "mlp", *, steps: int = 20, seed: int = 0,
           path: str | Path | None = None, case: str | None = None,
           label: str | None = None, method: str | None = None,
           hyperparameters: Mapping[str, Any] | None = None) -> Recording:
    """Run ``optimizer`` on ``problem`` for ``steps`` updates and return the trace
    (written to ``path``, ``<case>.json`` + ``<case>.npz``, when given).

    ``optimizer``: a torch optimizer class or factory ``params -> Optimizer``, an optax
    ``GradientTransformation``, or a call string such as ``"torch.optim.Adam(lr=1e-3)"``.
    ``problem``: a bundled name (:data:`PROBLEMS`), :func:`torch_problem`,
    :func:`jax_problem` or :func:`gradient_sequence`. ``seed`` seeds the bundled problems.
    ``method``: the manifest's method (default: the implementation's name); name a
    registered method (``"adamw"``) when recording one of its originals, and
    ``xopt parity <method> --trace`` replays the trace; ``hyperparameters`` then gives the
    manifest's in the form that method's harness reads (default: the call's arguments, or
    the torch optimizer's ``defaults``).
    """
    if not isinstance(steps, int) or steps < 1:
        raise RecordError(f"steps = {steps!r} must be a positive integer")
    impl = implementation(optimizer, label)
    prob = problem_of(problem, seed)
    params = prob.init_params()
    dtype = _common_dtype(params, prob.name)
    impl.start(params)
    arrays: Arrays = {f"init/param/{k}": v for k, v in params.items()}
    if impl.framework == "optax":
        for k, v in impl.read()[1].items():
            arrays[f"init/state/{k}"] = v
    current = params
    for t in range(steps):
        loss, grads = prob.loss_and_grads(current, t)
        pre = step_prefix(t)
        arrays[f"{pre}/loss"] = np.asarray(loss, dtype=dtype)
        for k in params:
            if k not in grads:
                raise RecordError(f"{prob.name}: no gradient for parameter {k!r} at step {t}")
            arrays[f"{pre}/grad/{k}"] = np.asarray(grads[k], dtype=dtype)
        impl.step(grads, loss)
        current, state = impl.read()
        for k, v in current.items():
            arrays[f"{pre}/param/{k}"] = v
        for k, v in state.items():
            arrays[f"{pre}/state/{k}"] = v
    case = case or f"{prob.name}_seed{seed}"
    source: dict[str, Any] = {
        "object": impl.label,
        "framework": impl.framework,
        "versions": versions(),
        "device": machine(),
        "notes": [f"recorded by xopt.parity.record on {prob.description}",
                  "one update per gradient; the gradient at the parameters before the update"],
    }
    if impl.call:
        source["call"] = impl.call
    manifest = {
        "format": TRACE_FORMAT,
        "method": method or impl.label,
        "case": case,
        "kind": "optimizer",
        "source": source,
        "hyperparameters": dict(hyperparameters) if hyperparameters is not None
        else impl.hyperparameters,
        "dtype": str(dtype),
        "params": {k: list(np.shape(v)) for k, v in params.items()},
        "steps": steps,
        "inputs": {"grad": "grad/<param>: gradient at the parameters before update t",
                   "loss": "loss: the loss at the parameters before update t"},
        "outputs": {"param": "param/<param>: parameters after update t",
                    "state": ("state/<param>/<key>: optimizer.state[p][key] after update t"
                              if impl.framework == "torch" else
                              "state/<path>: the optax state pytree's leaves after update t")},
        "aux": {},
    }
    types = impl.state_types()
    if types:
        manifest["state_types"] = types
    rec = Recording(manifest, arrays)
    if path is not None:
        rec.write(path)
    return rec


def problem_of(problem_: str | Problem, seed: int) -> Problem:
    if isinstance(problem_, Problem):
        return problem_
    if isinstance(problem_, str):
        return problem(problem_, seed)
    raise RecordError(f"problem {problem_!r}: a bundled name ({', '.join(PROBLEMS)}) or a "
                      f"Problem (torch_problem, jax_problem, gradient_sequence)")


def _common_dtype(params: Mapping[str, np.ndarray], where: str) -> np.dtype:
    dtypes = {np.asarray(v).dtype for v in params.values()}
    if len(dtypes) != 1:
        raise RecordError(f"{where}: parameters of several dtypes ({sorted(map(str, dtypes))}); "
                          f"a trace has one")
    return dtypes.pop()
