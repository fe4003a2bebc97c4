"""What xopt's low-rank optax transformations share: per-leaf settings, names, checks.

* **Per-leaf hyperparameters.** Every transformation takes ``spec`` (one setting for all
  leaves) and optionally ``param_specs``: a pytree shaped like the parameters whose leaves
  are the method's spec dataclass or ``None`` (use ``spec``), or a function of the
  parameters returning one; or a mapping from leaf path names (``"mlp/0/weight"``) to
  specs. This is how optax users pick projected leaves (``project=False`` on the others),
  as torch users do with param groups. Settings are static: they fix state shapes.
* **Names.** Leaves are named by their path, keys joined by ``/``, in errors and in
  ``inject``.
* **inject.** ``update(..., inject={path name: {key: array}})`` (an extra argument, as
  ``value=`` is for the learned optimizers): values an update uses instead of its own
  draws or decompositions; the parity harness feeds an original's recorded projections.
* **Decompositions.** Under ``nonfinite="raise"`` (outside ``jit``; see
  :mod:`xopt.jax._contract`, which also checks the gradients) a refresh whose
  decomposition is not finite raises :class:`~xopt.errors.DecompositionError` naming the
  leaf. Otherwise such a refresh keeps the previous projection rather than writing NaN
  into it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xopt.errors import DecompositionError, HyperparameterError
from xopt.jax._contract import path_names
from xopt.specs import Hyperparams

#: the leaf dtypes GaLore and COAP take (an SVD/QR needs at least float32 state)
FLOATING = (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)


def check_float_leaf(leaf: Any, where: str, dtypes: tuple | None = FLOATING) -> None:
    """Raise :class:`HyperparameterError` naming ``where`` (label and leaf path) unless the
    leaf's dtype is one of ``dtypes`` (``None``: any floating dtype)."""
    dt = jnp.result_type(leaf)
    ok = jnp.issubdtype(dt, jnp.floating) if dtypes is None else dt in dtypes
    if not ok:
        allowed = ("floating dtypes only" if dtypes is None
                   else ", ".join(jnp.dtype(d).name for d in dtypes))
        raise HyperparameterError(f"{where}: dtype {dt} is not supported ({allowed})")


def leaf_specs(params: Any, spec: Hyperparams, param_specs: Any, cls: type[Hyperparams],
               label: str) -> list[Hyperparams]:
    """The hyperparameters of every leaf of ``params`` (flattening order)."""
    names = path_names(params)
    if param_specs is None:
        return [spec] * len(names)
    given = param_specs(params) if callable(param_specs) else param_specs
    if isinstance(given, Mapping) and given and set(given) <= set(names):
        # by leaf name (for a flat dict of parameters this is also the pytree form)
        for n, v in given.items():
            if v is not None and not isinstance(v, cls):
                raise HyperparameterError(f"{label}: param_specs[{n!r}] is a "
                                          f"{type(v).__name__}, expected {cls.__name__} or None")
        return [given.get(n) or spec for n in names]
    leaves = jax.tree.leaves(given, is_leaf=lambda x: x is None or isinstance(x, cls))
    if len(leaves) != len(names):
        raise HyperparameterError(
            f"{label}: param_specs has {len(leaves)} leaves, the parameters {len(names)}")
    out = []
    for n, v in zip(names, leaves, strict=True):
        if v is not None and not isinstance(v, cls):
            raise HyperparameterError(f"{label}: param_specs[{n!r}] is a {type(v).__name__}, "
                                      f"expected {cls.__name__} or None")
        out.append(spec if v is None else v)
    return out


def inject_for(inject: Mapping[str, Mapping[str, Any]] | None, names: list[str],
               label: str) -> list[Mapping[str, Any] | None]:
    """``inject`` per leaf (None where nothing is injected); unknown names are an error."""
    if not inject:
        return [None] * len(names)
    unknown = sorted(set(inject) - set(names))
    if unknown:
        raise ValueError(f"{label}: inject names unknown leaves {unknown}")
    return [inject.get(n) for n in names]


def decomposition_guard(label: str, name: str, ok: jax.Array, check: bool) -> None:
    """With ``check`` (``nonfinite="raise"``, whose values are concrete), raise
    :class:`DecompositionError` naming ``name`` when ``ok`` is false (a refresh whose
    SVD/QR returned NaN/inf)."""
    if check and not isinstance(ok, jax.core.Tracer) and not bool(np.asarray(ok)):
        raise DecompositionError(f"{label}: the SVD/QR refreshing the projection of {name} "
                                 "returned NaN/inf (non-finite gradient?)")


def keep_if_not_finite(new: jax.Array, old: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(new if every entry is finite else old, that flag)``."""
    ok = jnp.all(jnp.isfinite(new))
    return jnp.where(ok, new, old), ok


Schedule = Callable[[jax.Array], jax.Array]


def resolve_spec(label: str, method: Any, spec: Hyperparams | None, preset: str | None,
                 given: Mapping[str, Any], learning_rate: Any = None,
                 ) -> tuple[Hyperparams, Schedule | None]:
    """The front of every low-rank transformation: ``(hyperparameters, schedule)``.

    ``spec`` (the method's dataclass) or the keywords in ``given`` that are not None, on
    top of ``preset`` (``method`` is the :class:`~xopt.specs.MethodSpec`); a number
    ``learning_rate`` becomes ``lr``, a callable one is returned as the schedule (the
    spec's ``lr`` then keeps its default, unused). Errors name ``label`` and the field.
    """
    cls = method.hyperparams
    fields = {k: v for k, v in given.items() if v is not None}
    schedule = learning_rate if callable(learning_rate) else None
    if learning_rate is not None and schedule is None:
        fields["lr"] = learning_rate
    if spec is not None:
        if not isinstance(spec, cls):
            raise HyperparameterError(f"{label}: spec must be an {cls.__module__}.{cls.__name__}"
                                      f", got {type(spec).__name__}")
        if fields or preset is not None:
            raise HyperparameterError(
                f"{label}: pass either spec= or hyperparameters, not both (got spec and "
                f"{', '.join(sorted(fields)) or 'preset'}); use spec.replace(...)")
        return spec, schedule
    try:
        return method.make(preset, **fields), schedule
    except HyperparameterError as e:
        raise HyperparameterError(f"{label}: {e}") from e
