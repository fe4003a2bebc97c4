"""The base of xopt's learned optimizers in JAX: an optax transformation around a method.

:func:`learned_optimizer` turns an :class:`InnerMethod` (the learned update proper: state
init and one update on a pytree) into an ``optax.GradientTransformationExtraArgs`` that
does what learned_optimization's ``prefab`` wrappers do around it (the arithmetic is
:func:`xopt.specs.lopt.outer_step`'s; see :class:`xopt.specs.lopt.LOptOptions`):

* the loss through ``update(..., value=loss)``;
* coupled weight decay (prefab's ``WeightDecayWrapper``: ``g + λp``, ``loss + Σλ·Σp²``) or
  decoupled decay;
* gradient accumulation (prefab's ``GradientAccumulator``) when
  ``num_training_steps > max_training_steps``, with ``lax.cond`` so that it jits;
* the learning rate (a float or an optax schedule of the call count) multiplying the step;
  ``updates = −(lr·step)`` (decoupled: ``−(lr·step + (lr·λ)·p)``), so that
  ``optax.apply_updates`` gives the original's ``p − step`` bit for bit at lr = 1;
* parameters of any float dtype (float32 math; updates in ``promote(dtype, float32)``);
* the contract of every xopt transformation (:mod:`xopt.jax._contract`): trace-time
  checks of gradients and state, and ``nonfinite=`` over the gradients *and the loss*.

The state is :class:`LOptState`; the method's own state sits in ``inner``. Its flattened
paths (``xopt.parity.runners.flatten_with_paths``) are ``iteration``, ``num_steps``,
``inner/...``, when accumulating ``accum/grad_accum/<param>``, ``accum/loss_accum``,
``accum/iteration``, and under ``nonfinite="skip"`` ``nonfinite_skips``.

Method contract (:class:`InnerMethod`): ``init(params)`` returns the method's state for a
params pytree (its per-parameter arrays as pytrees of the params' structure, float32);
``update(params, grads, loss, iteration, inner)`` receives float32 params and gradients
(after coupled decay and accumulation-averaging), the float32 loss (0-d), the int32 inner
iteration t (before this update) and the method state, and returns ``(steps, inner)``
with ``steps`` a float32 pytree like params (``p ← p − lr·step``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from xopt.errors import HyperparameterError, MetaParamsError
from xopt.jax import _contract
from xopt.specs.lopt import LOptOptions

__all__ = ["AccumState", "InnerMethod", "LOptState", "learned_optimizer"]

SUPPORTED_DTYPES = (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)


class AccumState(NamedTuple):
    """prefab's ``GradientAccumulator`` state.

    Attributes:
      grad_accum: float32 pytree like the params: gradients summed since the last update.
      loss_accum: float32 ``()``: losses summed since the last update.
      iteration: int32 ``()``: calls taken (the original's int64 reads int32 without x64).
    """

    grad_accum: Any
    loss_accum: jax.Array
    iteration: jax.Array


class LOptState(NamedTuple):
    """State of a learned optimizer built by :func:`learned_optimizer`.

    Attributes:
      iteration: int32 ``()``: inner updates taken (the learned optimizer's t).
      num_steps: int32 ``()``: the inner horizon ``n // num_average``.
      inner: the method's state (e.g. :class:`xopt.jax.small_fc_lopt.SmallFCState`).
      accum: :class:`AccumState` when accumulating, else None.
      nonfinite_skips: int32 ``()`` under ``nonfinite="skip"``, else None.
    """

    iteration: jax.Array
    num_steps: jax.Array
    inner: Any
    accum: AccumState | None
    nonfinite_skips: jax.Array | None = None


class InnerMethod(Protocol):
    """A learned optimizer proper (see the module docstring)."""

    def init(self, params: Any) -> Any: ...

    def update(self, params: Any, grads: Any, loss: jax.Array, iteration: jax.Array,
               inner: Any) -> tuple[Any, Any]: ...


def _is_one(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 1


def _wide(dtype: Any) -> Any:
    return jnp.promote_types(dtype, jnp.float32)


def _architecture_fields(cls: type[LOptOptions]) -> list[str]:
    """The method's integer fields (they fix θ's shapes), not the shared options'."""
    shared = {f.name for f in dataclasses.fields(LOptOptions)}
    return [f.name for f in dataclasses.fields(cls) if f.name not in shared
            and isinstance(f.default, int) and not isinstance(f.default, bool)]


def _fitting_hyperparameters(meta: Any, hp: LOptOptions, theta: Mapping[str, Any]
                             ) -> dict[str, int] | None:
    """The fewest changes of ``hp``'s integer fields (one or two) with which ``theta``
    fits, or None; candidates are the sizes that occur in θ's shapes."""
    fields = _architecture_fields(type(hp))
    sizes = sorted({int(d) for v in theta.values() for d in np.shape(v)} | set(range(9)))
    for n in (1, 2):
        for names in itertools.combinations(fields, n):
            for values in itertools.product(sizes, repeat=n):
                change = dict(zip(names, values, strict=True))
                try:
                    meta.coerce(theta, hp.replace(**change))
                except (HyperparameterError, MetaParamsError, ValueError, TypeError):
                    continue
                return change
    return None


def configure(label: str, cls: type[LOptOptions], meta: Any, *, spec: Any,
              given: dict[str, Any], learning_rate: Any, meta_params: Any, seed: int | None,
              ) -> tuple[LOptOptions, Callable[[jax.Array], jax.Array] | None,
                         dict[str, np.ndarray]]:
    """The shared front of ``xopt.jax.small_fc_lopt`` and ``xopt.jax.velo``.

    Resolves the hyperparameters (``spec`` or the keywords in ``given`` that are not None;
    a number ``learning_rate`` becomes ``lr``, a callable one is returned as the schedule)
    and θ (``meta_params`` in either naming through ``meta.coerce``, or ``meta.init(hp,
    seed)``) as float32 NumPy arrays, checked finite: NumPy, so that jit embeds θ as
    constants, as the original's ``opt_fn(θ)`` does. Errors name ``label`` and the field
    or key; a θ whose shapes fit other values of the method's integer fields (e.g. the
    bundled θ of small_fc_lopt, made with ``hidden_size=32``) names the ones to set.
    Integer fields and ``seed`` must be Python ints (:func:`_contract.require_static`).
    """
    given = {k: v for k, v in given.items() if v is not None}
    static = {k: v for k, v in given.items()
              if k in ("num_training_steps", "max_training_steps", *_architecture_fields(cls))}
    _contract.require_static(label, seed=seed, **static)
    schedule = learning_rate if callable(learning_rate) else None
    if spec is not None:
        if not isinstance(spec, cls):
            raise HyperparameterError(f"{label}: spec must be an {cls.__module__}.{cls.__name__}"
                                      f", got {type(spec).__name__}")
        if given or learning_rate is not None:
            names = sorted(given) + (["learning_rate"] if learning_rate is not None else [])
            raise HyperparameterError(
                f"{label}: pass either spec= or hyperparameters, not both (got spec and "
                f"{', '.join(names)}); use spec.replace(...)")
        hp = spec
    else:
        if learning_rate is not None and schedule is None:
            given["lr"] = learning_rate
        try:
            hp = cls(**given)
        except HyperparameterError as e:
            raise HyperparameterError(f"{label}: {e}") from None
    if meta_params is None:
        theta = meta.init(hp, 0 if seed is None else seed)
    else:
        try:
            theta = meta.coerce(meta_params, hp)
        except MetaParamsError as e:
            fit = (_fitting_hyperparameters(meta, hp, meta_params)
                   if isinstance(meta_params, Mapping) else None)
            if fit is None:
                raise
            settings = ", ".join(f"{k}={v}" for k, v in fit.items())
            raise MetaParamsError(
                f"{e}. These meta-parameters fit {settings}: pass {settings} (the bundled θ "
                "comes with its hyperparameters: xopt.checkpoints.bundled.bundled_meta_params"
                "(method) returns them)") from None
    arrays = {}
    for k, v in theta.items():
        arr = np.asarray(v.detach().cpu() if hasattr(v, "detach") else v, dtype=np.float32)
        if not np.isfinite(arr).all():
            raise MetaParamsError(f"{label} meta_params: meta-parameter {k!r} holds NaN or inf")
        arrays[k] = arr
    return hp, schedule, arrays


def learned_optimizer(method: InnerMethod, hp: LOptOptions, *,
                      learning_rate: float | Callable[[jax.Array], jax.Array] | None = None,
                      nonfinite: str = "ignore", needs_loss: bool = False,
                      label: str = "xopt.jax learned optimizer",
                      ) -> optax.GradientTransformationExtraArgs:
    """The optax transformation of ``method`` with prefab's wrappers (module docstring).

    Args:
      method: the learned update (:class:`InnerMethod`).
      hp: the method's hyperparameters (an :class:`~xopt.specs.lopt.LOptOptions`);
        ``num_training_steps`` must be set.
      learning_rate: a number or an optax schedule of the call count (counted before this
        call); default ``hp.lr``.
      nonfinite: ``"ignore"``, ``"raise"`` or ``"skip"`` over the gradients and the loss
        (:mod:`xopt.nonfinite`, :mod:`xopt.jax._contract`).
      needs_loss: ``update`` without ``value=`` is an error (else a missing loss is 0).
      label: how errors name the optimizer.
    """
    hp.require_num_training_steps(label)
    lr_arg = hp.lr if learning_rate is None else learning_rate
    schedule = lr_arg if callable(lr_arg) else None
    n_avg = hp.num_average
    inner_steps = hp.inner_num_steps
    wd = hp.weight_decay
    coupled, decoupled = hp.coupled_decay, hp.decoupled_decay

    def init_fn(params: Any) -> LOptState:
        leaves = jax.tree.leaves(params)
        for name, x in zip(_contract.path_names(params), leaves, strict=True):
            if jnp.result_type(x) not in SUPPORTED_DTYPES:
                raise HyperparameterError(
                    f"{label}: parameter {name} (shape {tuple(jnp.shape(x))}) has dtype "
                    f"{jnp.result_type(x)}; supported: float32, float64, bfloat16, float16")
        inner = method.init(params)
        accum = None
        if hp.accumulating:
            accum = AccumState(
                grad_accum=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params),
                loss_accum=jnp.zeros((), jnp.float32), iteration=jnp.zeros((), jnp.int32))
        return LOptState(iteration=jnp.zeros((), jnp.int32),
                         num_steps=jnp.asarray(inner_steps, jnp.int32), inner=inner,
                         accum=accum)

    def update_fn(updates: Any, state: LOptState, params: Any = None, *, value: Any = None,
                  **extra_args: Any) -> tuple[Any, LOptState]:
        del extra_args
        if params is None:
            raise ValueError(f"{label}: update(updates, state, params) needs `params`: the "
                             "learned optimizer reads the parameters")
        if value is None and needs_loss:
            raise ValueError(f"{label}: update needs the loss: update(grads, state, params, "
                             "value=loss)")
        loss = jnp.zeros((), jnp.float32) if value is None else \
            jnp.asarray(value, jnp.float32).reshape(())
        g_leaves, treedef = jax.tree.flatten(updates)
        p_leaves = treedef.flatten_up_to(params)

        count = state.accum.iteration if hp.accumulating else state.iteration
        lr = schedule(count) if schedule is not None else lr_arg

        p32 = [p.astype(jnp.float32) for p in p_leaves]
        g32 = [g.astype(jnp.float32) for g in g_leaves]
        if coupled:
            g32 = [g + wd * p for g, p in zip(g32, p32, strict=True)]
            total: Any = 0
            for p in p32:
                total = total + jnp.sum(p ** 2) * wd
            loss = loss + total

        def to_updates(steps: list[Any] | None) -> list[Any]:
            out = []
            for i, p in enumerate(p_leaves):
                wide = _wide(p.dtype)
                pw = p.astype(wide)
                if steps is None:
                    out.append(-((lr * wd) * pw) if decoupled else jnp.zeros_like(pw))
                    continue
                u = steps[i].astype(wide)
                if not _is_one(lr):
                    u = lr * u
                if decoupled:
                    u = u + (lr * wd) * pw
                out.append(-u)
            return out

        def inner_update(grads32: list[Any], loss_: Any) -> tuple[list[Any], Any]:
            steps, inner = method.update(treedef.unflatten(p32), treedef.unflatten(grads32),
                                         loss_, state.iteration, state.inner)
            return treedef.flatten_up_to(steps), inner

        if not hp.accumulating:
            steps, inner = inner_update(g32, loss)
            new_state = LOptState(iteration=state.iteration + 1, num_steps=state.num_steps,
                                  inner=inner, accum=None)
            return treedef.unflatten(to_updates(steps)), new_state

        acc = [a + g for a, g in
               zip(treedef.flatten_up_to(state.accum.grad_accum), g32, strict=True)]
        loss_acc = state.accum.loss_accum + loss
        calls = state.accum.iteration + 1

        def do_update(_: Any) -> tuple:
            inv = 1.0 / n_avg  # as XLA evaluates a division by a constant, jitted or not
            steps, inner = inner_update([a * inv for a in acc], loss_acc * inv)
            return (to_updates(steps), inner, state.iteration + 1,
                    [jnp.zeros_like(a) for a in acc], jnp.zeros_like(loss_acc))

        def accumulate_only(_: Any) -> tuple:
            return to_updates(None), state.inner, state.iteration, acc, loss_acc

        u, inner, iteration, acc, loss_acc = jax.lax.cond(calls % n_avg == 0, do_update,
                                                          accumulate_only, None)
        new_state = LOptState(
            iteration=iteration, num_steps=state.num_steps, inner=inner,
            accum=AccumState(grad_accum=treedef.unflatten(acc), loss_accum=loss_acc,
                             iteration=calls))
        return treedef.unflatten(u), new_state

    return _contract.transformation(label, init_fn, update_fn, nonfinite=nonfinite,
                                    takes_loss=True)
