"""What every xopt optax transformation guarantees, written once (``tests/contract/`` checks it).

:func:`transformation` wraps a method's ``init``/``update`` pair into an
``optax.GradientTransformationExtraArgs`` that adds, in this order, before the method's
update runs:

* **Shapes and dtypes, at trace time.** The gradients must have the parameters' structure
  and shapes and a real floating dtype; the state must have the structure, shapes and
  dtypes that ``init`` gives for these parameters (``jax.eval_shape``, cached per
  parameter signature). A state made for other parameters, or by another optimizer, is a
  :class:`~xopt.errors.StateError` naming the first entry that does not fit, raised while
  tracing: nothing is computed and nothing is returned.
* **The nonfinite policy** (:mod:`xopt.nonfinite`). ``"raise"`` reads the gradients (and
  the loss, for the learned optimizers) and raises :class:`~xopt.errors.NonFiniteError`
  naming the first non-finite one; it needs concrete values, so under ``jax.jit`` (or any
  other trace, e.g. the ``lax.cond`` of ``optax.MultiSteps``) it is refused with a
  :class:`~xopt.errors.HyperparameterError` that says what to use instead. ``"skip"``
  never synchronises: the method's update is computed, then ``jnp.where`` keeps the old
  state and returns zero updates when any gradient (or the loss) is not finite, and the
  state's ``nonfinite_skips`` counter (an int32 0-d array, the field
  :data:`xopt.nonfinite.SKIP_COUNTER` of every xopt state) counts the step. The step count
  is part of the kept state, so it does not advance.

Integer hyperparameters fix state shapes, control flow or random streams, so they must be
Python numbers: :func:`require_static` refuses an array (what ``optax.inject_hyperparams``
passes for every numeric argument) with an error that names the argument and the
``static_args`` to give. Float hyperparameters may be arrays, traced or not, and an array
is never silently left unread (tests/contract/ injects each one and checks it is used).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from xopt import nonfinite as _nonfinite
from xopt.errors import HyperparameterError, NonFiniteError, StateError

__all__ = ["path_names", "public_signature", "require_static", "transformation"]

SKIP_COUNTER = _nonfinite.SKIP_COUNTER


def _key_str(k: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_names(tree: Any) -> list[str]:
    """Leaf names of ``tree``, in flattening order: path keys joined by ``/``."""
    return ["/".join(_key_str(k) for k in path) or "<root>"
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def public_signature(fn: Callable[..., Any]) -> None:
    """Give ``fn`` its signature without the ``**unknown`` catch-all.

    The catch-all turns a misspelt keyword into a :class:`HyperparameterError` listing the
    known ones; ``optax.inject_hyperparams`` binds arguments against ``fn``'s signature,
    where the catch-all would appear as an argument named ``unknown``.
    """
    sig = inspect.signature(fn)
    fn.__signature__ = sig.replace(parameters=[  # type: ignore[attr-defined]
        p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD])


def reject_unknown(label: str, unknown: dict[str, Any], fn: Callable[..., Any]) -> None:
    """A keyword ``fn`` does not take is an error naming it and listing the known ones."""
    if unknown:
        hint = " (the learning rate is `learning_rate`, as in optax)" if "lr" in unknown else ""
        raise HyperparameterError(
            f"{label}: unknown argument{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, sorted(unknown)))}{hint}; known: "
            f"{', '.join(inspect.signature(fn).parameters)}")


def require_static(label: str, **values: Any) -> None:
    """Refuse array values of the hyperparameters that fix the state's shapes, control flow
    or random stream (integers, and COAP's ``rank_ratio``); see the module docstring."""
    arrays = [name for name, v in values.items()
              if isinstance(v, (jax.Array, np.ndarray, jax.core.Tracer))]
    if arrays:
        names = ", ".join(map(repr, arrays))
        one = len(arrays) == 1
        raise HyperparameterError(
            f"{label}: {names} must be {'a Python number' if one else 'Python numbers'}, got "
            f"{'an array' if one else 'arrays'}: {'it fixes' if one else 'they fix'} the "
            "state's shapes, control flow or random stream, which cannot follow a traced "
            "value. optax.inject_hyperparams passes every numeric argument as an array unless "
            f"it is named static: inject_hyperparams(..., static_args=({names}"
            f"{',' if one else ''}))")


def _is_real_floating(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def check_floating(label: str, tree: Any, what: str) -> None:
    """Every leaf of ``tree`` has a real floating dtype (HyperparameterError naming it)."""
    for name, leaf in zip(path_names(tree), jax.tree.leaves(tree), strict=True):
        dt = jnp.result_type(leaf)
        if not _is_real_floating(dt):
            raise HyperparameterError(
                f"{label}: {what} {name} (shape {tuple(jnp.shape(leaf))}) has dtype {dt}; "
                "only real floating dtypes are supported")


def _signature(tree: Any) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(jnp.shape(x)), jnp.result_type(x)) for x in leaves)


def check_updates(label: str, updates: Any, params: Any) -> None:
    """The gradients fit the parameters: structure, shapes, real floating dtypes."""
    check_floating(label, updates, "gradient of")
    if params is None:
        return
    if jax.tree.structure(updates) != jax.tree.structure(params):
        g, p = set(path_names(updates)), set(path_names(params))
        detail = (f"gradients without a parameter: {sorted(g - p)[:3]}" if g - p else
                  f"parameters without a gradient: {sorted(p - g)[:3]}" if p - g else
                  f"{jax.tree.structure(updates)} vs {jax.tree.structure(params)}")
        raise ValueError(f"{label}: the gradients do not have the parameters' structure "
                         f"({detail})")
    for name, g, p in zip(path_names(updates), jax.tree.leaves(updates),
                          jax.tree.leaves(params), strict=True):
        if jnp.shape(g) != jnp.shape(p):
            raise ValueError(f"{label}: gradient of {name} has shape {tuple(jnp.shape(g))}, "
                             f"the parameter {tuple(jnp.shape(p))}")


def _state_mismatch(state: Any, expected: Any) -> str | None:
    """A description of the first way ``state`` does not fit ``expected``, else None."""
    if jax.tree.structure(state) != jax.tree.structure(expected):
        got, want = path_names(state), path_names(expected)
        missing = [n for n in want if n not in got]
        extra = [n for n in got if n not in want]
        if missing:
            return f"it has no entry {missing[0]}" + (
                f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        if extra:
            return f"it has an unexpected entry {extra[0]}" + (
                f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
        return (f"it is a {type(state).__name__}, expected a {type(expected).__name__} "
                f"({jax.tree.structure(state)} vs {jax.tree.structure(expected)})")
    for name, got, want in zip(path_names(state), jax.tree.leaves(state),
                               jax.tree.leaves(expected), strict=True):
        if tuple(jnp.shape(got)) != tuple(want.shape):
            return f"{name} has shape {tuple(jnp.shape(got))}, expected {tuple(want.shape)}"
        if jnp.result_type(got) != want.dtype:
            return f"{name} has dtype {jnp.result_type(got)}, expected {want.dtype}"
    return None


def _all_finite(leaves: list[Any]) -> jax.Array:
    ok = jnp.asarray(True)
    for x in leaves:
        ok = ok & jnp.all(jnp.isfinite(x))
    return ok


def _loss_of(extra: dict[str, Any], takes_loss: bool) -> list[Any]:
    value = extra.get("value") if takes_loss else None
    return [] if value is None else [value]


def _raise_if_nonfinite(label: str, updates: Any, loss: list[Any]) -> None:
    leaves = jax.tree.leaves(updates) + loss
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        raise HyperparameterError(
            f"{label}: nonfinite='raise' reads the gradients' values, and they are traced "
            "here (inside jax.jit, or a wrapper's lax.cond such as optax.MultiSteps'). Use "
            "nonfinite='skip', which needs no values on the host, or call update outside jit")
    names = path_names(updates) + ["<loss>"] * len(loss)
    for name, x in zip(names, leaves, strict=True):
        if not np.isfinite(np.asarray(x)).all():
            what = "the loss" if name == "<loss>" else f"gradient of {name}"
            raise NonFiniteError(f"{label}: {what} holds NaN or inf; nothing was updated")


def transformation(label: str, init_fn: Callable[[Any], Any],
                   update_fn: Callable[..., tuple[Any, Any]], *, nonfinite: str = "ignore",
                   takes_loss: bool = False) -> optax.GradientTransformationExtraArgs:
    """The method's ``init_fn``/``update_fn`` with the checks and the nonfinite policy.

    ``init_fn(params)`` must return a NamedTuple with a ``nonfinite_skips`` field (default
    None); ``update_fn(updates, state, params=None, **extra_args)`` the method's update.
    ``nonfinite`` is an already resolved mode (:func:`xopt.nonfinite.resolve`);
    ``takes_loss``: the loss (``value=``) is checked with the gradients.
    """
    if nonfinite not in _nonfinite.MODES:
        raise HyperparameterError(f"{label}: nonfinite = {nonfinite!r}; expected one of "
                                  f"{', '.join(map(repr, _nonfinite.MODES))}")
    skip = nonfinite == "skip"

    def init(params: Any) -> Any:
        check_floating(label, params, "parameter")
        state = init_fn(params)
        if skip:
            state = state._replace(**{SKIP_COUNTER: jnp.zeros((), jnp.int32)})
        return state

    expected: dict[Any, Any] = {}

    def check_state(state: Any, reference: Any) -> None:
        key = _signature(reference)
        if key not in expected:
            expected[key] = jax.eval_shape(init, reference)
        why = _state_mismatch(state, expected[key])
        if why is not None:
            raise StateError(f"{label}: the state does not fit these parameters: {why} (a "
                             "state made by init() for other parameters, with other settings"
                             ", or by another optimizer)")

    def update(updates: Any, state: Any, params: Any = None,
               **extra_args: Any) -> tuple[Any, Any]:
        check_updates(label, updates, params)
        check_state(state, updates if params is None else params)
        loss = _loss_of(extra_args, takes_loss)
        if nonfinite == "raise":
            _raise_if_nonfinite(label, updates, loss)
        if not skip:
            return update_fn(updates, state, params, **extra_args)
        kept = state._replace(**{SKIP_COUNTER: None})
        new_updates, new_state = update_fn(updates, kept, params, **extra_args)
        ok = _all_finite(jax.tree.leaves(updates) + loss)
        new_updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), new_updates)
        new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o),
                                 new_state._replace(**{SKIP_COUNTER: None}), kept)
        skips = getattr(state, SKIP_COUNTER) + jnp.where(ok, 0, 1).astype(jnp.int32)
        return new_updates, new_state._replace(**{SKIP_COUNTER: skips})

    return optax.GradientTransformationExtraArgs(init, update)


def resolve_nonfinite(label: str, nonfinite: str | None, check_finite: bool | None = None) -> str:
    """:func:`xopt.nonfinite.resolve` with ``label`` naming the transformation."""
    return _nonfinite.resolve(nonfinite, check_finite, label)
