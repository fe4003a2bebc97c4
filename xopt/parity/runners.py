"""Runners: drive one implementation of a method through a trace, step by step.

Every runner speaks NumPy and canonical state names (see :mod:`xopt.specs._state`), so the
harness compares any two of them, and any of them with a golden trace, the same way:

* :class:`OracleRunner`: the spec's pure ``step`` under NumPy float64;
* :class:`TorchRunner`: a ``torch.optim.Optimizer`` (xopt's or an original's);
* :class:`OptaxRunner`: an ``optax.GradientTransformation`` (xopt's or an original's).

``reset(params, state)`` sets parameters and state (``state=None``: a fresh optimizer);
``step(grads, loss, inject)`` takes one update (``inject``: ``{param: {key: array}}``,
the values an original drew from its own generator or decomposition at this update,
which xopt's implementations use instead of their own; see ``MethodParity.inject``);
``read()`` returns ``(params, canonical state)``.
Teacher forcing is ``reset`` from the trace before every ``step``; closed loop is one
``reset`` from the trace's ``init`` and then ``step`` after ``step``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from xopt.specs import Hyperparams, MethodSpec

Arrays = dict[str, np.ndarray]


class Runner:
    """Base: a labelled implementation on one trace's parameter layout."""

    #: how reports name it: "xopt.torch", "xopt.jax", "oracle", or an original's name
    label: str
    #: "torch", "jax" or "oracle"
    backend: str
    #: "plain" or "triton"
    impl: str = "plain"

    def __init__(self, spec: MethodSpec, hp: Hyperparams, param_names: list[str]) -> None:
        self.spec, self.hp, self.param_names = spec, hp, list(param_names)

    def reset(self, params: Arrays, state: Arrays | None) -> None:
        raise NotImplementedError

    def step(self, grads: Arrays, loss: float | None,
             inject: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> None:
        raise NotImplementedError

    def read(self) -> tuple[Arrays, Arrays]:
        raise NotImplementedError


class OracleRunner(Runner):
    """The specification itself, in NumPy float64."""

    label = "oracle"
    backend = "oracle"

    def __init__(self, spec: MethodSpec, hp: Hyperparams, param_names: list[str], *,
                 meta: Mapping[str, np.ndarray] | None = None) -> None:
        super().__init__(spec, hp, param_names)
        # θ in xopt's naming, float64 (the learned optimizers' weights, where the method has)
        self.extra = {}
        if spec.meta is not None:
            if meta is None:
                raise ValueError(f"{spec.name}: the oracle needs meta-parameters")
            theta = spec.meta.coerce(meta, hp)
            self.extra = {"meta": {k: _to_f64(v) for k, v in theta.items()}}

    def reset(self, params: Arrays, state: Arrays | None) -> None:
        self.params = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
        if state is None:
            self.state = self.spec.init_state(self.hp, self.params, xp=np, dtype=np.float64,
                                              **self.extra)
        else:
            self.state = {k: _to_f64(v) for k, v in state.items()}

    def step(self, grads: Arrays, loss: float | None,
             inject: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> None:
        g = {k: np.asarray(grads[k], dtype=np.float64) for k in self.param_names}
        extra = dict(self.extra)
        if inject:
            extra["inject"] = {p: {k: _to_f64(v) for k, v in d.items()}
                               for p, d in inject.items()}
        self.params, self.state = self.spec.step(self.hp, self.params, self.state, g, xp=np,
                                                 loss=loss, **extra)

    def read(self) -> tuple[Arrays, Arrays]:
        return dict(self.params), {k: np.asarray(v) for k, v in self.state.items()}


def _to_f64(v: Any) -> np.ndarray:
    a = np.asarray(v)
    return a.astype(np.float64) if np.issubdtype(a.dtype, np.floating) else a


class TorchRunner(Runner):
    """A ``torch.optim.Optimizer`` made by ``factory(list_of_params)``.

    ``naming`` must lay state out as ``"{param}/<key>"`` (``optimizer.state[p][key]``).
    ``takes_inject``: the optimizer's ``step`` accepts ``inject={tensor: {key: tensor}}``
    (xopt's optimizers of methods with a ``MethodParity.inject``); originals do not, and
    draw their own.
    """

    backend = "torch"

    def __init__(self, spec: MethodSpec, hp: Hyperparams, param_names: list[str], *,
                 label: str, factory: Callable[[list[Any]], Any], naming: str,
                 device: str = "cpu", pass_loss: bool = False,
                 takes_inject: bool = False) -> None:
        super().__init__(spec, hp, param_names)
        import torch

        self.torch = torch
        self.label, self.factory, self.naming = label, factory, naming
        self.device, self.pass_loss, self.takes_inject = device, pass_loss, takes_inject

    def _tensor(self, a: np.ndarray):
        return self.torch.from_numpy(np.array(a, copy=True)).to(self.device)

    def reset(self, params: Arrays, state: Arrays | None) -> None:
        self.params = [self._tensor(params[k]) for k in self.param_names]
        self.opt = self.factory(self.params)
        if state is not None:
            flat = self.spec.state.from_canonical(self.naming, state, self.param_names, self.hp)
            claimed: set[str] = set()
            for name, p in zip(self.param_names, self.params, strict=True):
                prefix = f"{name}/"
                mine = {k: v for k, v in flat.items()
                        if k.startswith(prefix) and "/" not in k[len(prefix):]}
                self.opt.state[p] = {k[len(prefix):]: self._tensor(v) for k, v in mine.items()}
                claimed.update(mine)
            # what no parameter claims is global state: "<key>/<var>" lives in
            # optimizer.state[<key>][<var>] (xopt's learned optimizers keep "global")
            for k, v in flat.items():
                if k not in claimed:
                    top, _, var = k.partition("/")
                    self.opt.state.setdefault(top, {})[var] = self._tensor(v)

    def step(self, grads: Arrays, loss: float | None,
             inject: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> None:
        for name, p in zip(self.param_names, self.params, strict=True):
            p.grad = self._tensor(grads[name])
        kwargs: dict[str, Any] = {"loss": loss} if self.pass_loss else {}
        if inject and self.takes_inject:
            by_name = dict(zip(self.param_names, self.params, strict=True))
            kwargs["inject"] = {by_name[n]: {k: self._tensor(v) for k, v in d.items()}
                                for n, d in inject.items()}
        self.opt.step(**kwargs)

    def read(self) -> tuple[Arrays, Arrays]:
        params = {k: p.detach().cpu().numpy().copy()
                  for k, p in zip(self.param_names, self.params, strict=True)}
        flat = {}
        for name, p in zip(self.param_names, self.params, strict=True):
            for k, v in self.opt.state[p].items():
                flat[f"{name}/{k}"] = _numpy(v)
        for top, entries in self.opt.state.items():
            if isinstance(top, str):
                for k, v in entries.items():
                    flat[f"{top}/{k}"] = _numpy(v)
        state = self.spec.state.to_canonical(self.naming, flat, self.param_names, self.hp,
                                             where=self.label)
        return params, state


def _numpy(v: Any) -> np.ndarray:
    if hasattr(v, "detach"):
        v = v.detach().cpu()
        if str(v.dtype) == "torch.bfloat16":
            v = v.float()
        return v.numpy().copy()
    return np.asarray(v)


def flatten_with_paths(tree: Any) -> dict[str, Any]:
    """A JAX pytree as ``{"a/0/b": leaf}``: attribute names, indices and dict keys joined."""
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out["/".join(_key_str(k) for k in path)] = leaf
    return out


def _key_str(k: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def replace_by_paths(tree: Any, values: Mapping[str, Any]) -> Any:
    """``tree`` with the leaves at the given paths replaced (dtype kept)."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    new = []
    for path, leaf in leaves:
        key = "/".join(_key_str(k) for k in path)
        new.append(jnp.asarray(values[key], dtype=leaf.dtype) if key in values else leaf)
    return jax.tree_util.tree_unflatten(treedef, new)


class OptaxRunner(Runner):
    """An optax transformation made by ``factory()``, jitted once, on a dict of params."""

    backend = "jax"

    def __init__(self, spec: MethodSpec, hp: Hyperparams, param_names: list[str], *,
                 label: str, factory: Callable[[], Any], naming: str,
                 pass_loss: bool = False, takes_inject: bool = False) -> None:
        super().__init__(spec, hp, param_names)
        import jax
        import optax

        self.jax, self.optax = jax, optax
        self.label, self.naming, self.pass_loss = label, naming, pass_loss
        self.takes_inject = takes_inject
        self.tx = factory()

        def _step(params, state, grads, loss, inject):
            extra = {"value": loss} if pass_loss else {}
            if inject is not None:
                extra["inject"] = inject
            updates, state = self.tx.update(grads, state, params, **extra)
            return optax.apply_updates(params, updates), state

        self._step = jax.jit(_step)

    def reset(self, params: Arrays, state: Arrays | None) -> None:
        import jax.numpy as jnp

        self.params = {k: jnp.asarray(params[k]) for k in self.param_names}
        self.state = self.tx.init(self.params)
        if state is not None:
            flat = self.spec.state.from_canonical(self.naming, state, self.param_names, self.hp)
            self.state = replace_by_paths(self.state, flat)

    def step(self, grads: Arrays, loss: float | None,
             inject: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> None:
        import jax.numpy as jnp

        g = {k: jnp.asarray(grads[k]) for k in self.param_names}
        loss_arr = jnp.asarray(np.float32(0.0 if loss is None else loss))
        inj = None
        if inject and self.takes_inject:  # a new structure retraces once
            inj = {n: {k: jnp.asarray(v) for k, v in d.items()} for n, d in inject.items()}
        self.params, self.state = self._step(self.params, self.state, g, loss_arr, inj)

    def read(self) -> tuple[Arrays, Arrays]:
        params = {k: np.asarray(v) for k, v in self.params.items()}
        flat = {k: np.asarray(v) for k, v in flatten_with_paths(self.state).items()}
        state = self.spec.state.to_canonical(self.naming, flat, self.param_names, self.hp,
                                             where=self.label)
        return params, state
