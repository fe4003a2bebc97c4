"""AdamW as an optax gradient transformation, with the xopt specification's two arithmetics.

:func:`scale_by_adamw` is the update rule, written as optax writes ``scale_by_adam``: tree
maps over the gradients and an :class:`AdamWState` with an int32 ``count``.
:func:`adamw` validates the hyperparameters against :class:`xopt.specs.adamw.AdamW` and
adds the contract every xopt transformation keeps (:mod:`xopt.jax._contract`: trace-time
shape, dtype and state checks, the ``nonfinite`` policy).

The algorithm (Loshchilov & Hutter, *Decoupled Weight Decay Regularization*, ICLR 2019,
Algorithm 2, with the learning rate η multiplying the decay λ as optax and torch.optim do),
at step t = 1, 2, ... for every parameter θ with gradient g::

    m_t = β₁ m_{t-1} + (1 − β₁) g                      v_t = β₂ v_{t-1} + (1 − β₂) g²
    m̂_t = m_t / (1 − β₁ᵗ)                              v̂_t = v_t / (1 − β₂ᵗ)
    θ_t = θ_{t-1} − η (m̂_t / (√(v̂_t + ε_root) + ε) + λ θ_{t-1})

``formula="optax"`` evaluates it with the operations of ``optax.adamw`` (the spec's
:func:`xopt.specs.adamw.updates_optax`), dispatched as optax dispatches them, so that
params, updates and state agree with ``optax.adamw`` bit for bit, eagerly and under
``jit``: the moments are tree maps, and each bias correction is *one* jitted function over
the whole tree (:func:`_bias_corrected`), which matters to XLA, which turns a division by
a scalar used once into a multiplication by its reciprocal, and evaluates ``β ** t`` with
a concrete integer ``t`` by repeated squaring (see the spec's docstring).
``formula="torch"`` calls :func:`xopt.specs.adamw.update_torch` per leaf.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from xopt.errors import HyperparameterError
from xopt.jax import _contract
from xopt.registry import register
from xopt.specs import adamw as _spec
from xopt.specs.arrays import is_static_zero

__all__ = ["AdamWState", "adamw", "scale_by_adamw"]

_LABEL = "xopt.jax.adamw"


class AdamWState(NamedTuple):
    """State of :func:`adamw` (the spec's ``"xopt.jax"`` naming of ``STATE``).

    Attributes:
      count: int32 ``()``: updates taken, t (``optax.safe_increment``: it saturates).
      mu: first moment m_t, uncorrected; like the params (shapes and dtypes).
      nu: second moment v_t, uncorrected; like the params.
      nu_max: with ``amsgrad``, the running maximum in the denominator: of v̂_t under
        ``formula="optax"`` (as ``optax.scale_by_amsgrad``), of v_t under ``"torch"`` (as
        torch.optim's ``max_exp_avg_sq``); like the params. None otherwise.
      nonfinite_skips: int32 ``()`` under ``nonfinite="skip"`` (steps skipped), else None.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    nu_max: optax.Updates | None = None
    nonfinite_skips: jax.Array | None = None


@functools.partial(jax.jit, inline=True, static_argnums=3)
def _bias_corrected(tree: Any, beta: Any, count: jax.Array, dtype: str) -> Any:
    """``tree / (1 − βᵗ)``: one scalar shared by every leaf, cast to each leaf's dtype where
    it divides (optax's ``tree.bias_correction``; the scalar is the spec's)."""
    correction = _spec.bias_correction(beta, count, dtype, jnp)
    return jax.tree.map(lambda x: x / correction.astype(x.dtype), tree)


def _decay_mask(mask: Any, updates: Any) -> Any:
    """A bool per leaf of ``updates`` from ``mask`` (a tree, a prefix of it, or a callable
    of the updates, as ``optax.masked``), or None for no mask."""
    if mask is None:
        return None
    tree = mask(updates) if callable(mask) else mask
    return jax.tree.map(lambda m, sub: jax.tree.map(lambda _: bool(m), sub), tree, updates)


def scale_by_adamw(
    learning_rate: optax.ScalarOrSchedule = 1e-3,
    b1: float | jax.Array = 0.9,
    b2: float | jax.Array = 0.999,
    eps: float | jax.Array = 1e-8,
    eps_root: float | jax.Array = 0.0,
    weight_decay: float | jax.Array = 1e-4,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    nesterov: bool = False,
    formula: str = "optax",
    bias_correction_dtype: str = "float32",
    mask: Any = None,
) -> optax.GradientTransformation:
    """The AdamW update rule alone (no validation, checks or nonfinite policy).

    Arguments as :func:`adamw` (``bias_correction_dtype`` resolved). The update returned is
    additive (``optax.apply_updates``): the learning rate and the decay are inside it.
    """

    def init_fn(params: optax.Params) -> AdamWState:
        return AdamWState(count=jnp.zeros([], jnp.int32),
                          mu=jax.tree.map(jnp.zeros_like, params),
                          nu=jax.tree.map(jnp.zeros_like, params),
                          nu_max=jax.tree.map(jnp.zeros_like, params) if amsgrad else None)

    def update_fn(updates: optax.Updates, state: AdamWState, params: optax.Params = None,
                  **extra_args: Any) -> tuple[optax.Updates, AdamWState]:
        del extra_args  # e.g. value=loss: part of the protocol, unused by AdamW
        count_inc = optax.safe_increment(state.count)
        decay = _decay_mask(mask, updates)
        decayed = not is_static_zero(weight_decay) and (
            decay is None or any(jax.tree.leaves(decay)))
        if params is None and (formula == "torch" or decayed):
            why = ("formula='torch' computes the update as p_new − p" if formula == "torch"
                   else f"weight_decay={weight_decay!r} multiplies the parameters")
            raise ValueError(f"{_LABEL}: update(updates, state, params) needs `params` (got "
                             f"params=None): {why}. Pass the current parameters.")
        if decay is None:
            decay = jax.tree.map(lambda _: True, updates)

        def lr_like(u: jax.Array) -> Any:
            # optax's scale_by_learning_rate: −lr, or a schedule's value at the count
            # before the increment, cast to the update's dtype.
            if callable(learning_rate):
                return jnp.array(-1 * learning_rate(state.count), dtype=u.dtype)
            return -1 * learning_rate

        if formula == "torch":
            return _torch_update(updates, state, params, count_inc, decay, lr_like,
                                 b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                                 weight_decay=weight_decay, amsgrad=amsgrad,
                                 maximize=maximize, bias_correction_dtype=bias_correction_dtype)

        g = jax.tree.map(jnp.negative, updates) if maximize else updates
        mu = jax.tree.map(lambda g, m: (1 - b1) * g + b1 * m, g, state.mu)
        nu = jax.tree.map(lambda g, v: (1 - b2) * (g * g) + b2 * v, g, state.nu)
        if nesterov:
            mu_hat = jax.tree.map(
                lambda m, g: b1 * m + (1 - b1) * g,
                _bias_corrected(mu, b1, optax.safe_increment(count_inc), bias_correction_dtype),
                _bias_corrected(g, b1, count_inc, bias_correction_dtype))
        else:
            mu_hat = _bias_corrected(mu, b1, count_inc, bias_correction_dtype)
        nu_hat = _bias_corrected(nu, b2, count_inc, bias_correction_dtype)
        nu_max = None
        if amsgrad:
            nu_max = jax.tree.map(jnp.maximum, state.nu_max, nu_hat)
            nu_hat = nu_max
        u = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
        if decayed:  # optax.masked(add_decayed_weights): masked-out leaves are left as they are
            u = jax.tree.map(lambda u, p, d: u + weight_decay * p if d else u, u, params, decay)
        u = jax.tree.map(lambda u: lr_like(u) * u, u)
        return u, AdamWState(count=count_inc, mu=_cast_like(mu, state.mu),
                             nu=_cast_like(nu, state.nu), nu_max=nu_max)

    return optax.GradientTransformation(init_fn, update_fn)


def _cast_like(tree: Any, like: Any) -> Any:
    # State dtypes never change, so a jitted step traces once (optax casts nu the same way).
    return jax.tree.map(lambda x, o: x.astype(o.dtype), tree, like)


def _torch_update(updates: Any, state: AdamWState, params: Any, count_inc: jax.Array,
                  decay: Any, lr_like: Callable[[jax.Array], Any], *, amsgrad: bool,
                  weight_decay: Any, **kw: Any) -> tuple[Any, AdamWState]:
    """:func:`xopt.specs.adamw.update_torch` on every leaf; the update is ``p_new − p``."""
    nu_max = state.nu_max if amsgrad else jax.tree.map(lambda _: None, updates)

    def leaf(g, p, m, v, vmax, d):
        p_new, m_new, v_new, vmax_new = _spec.update_torch(
            p, g, m, v, vmax, count_inc, lr=-lr_like(g), weight_decay=weight_decay if d else 0.0,
            amsgrad=amsgrad, xp=jnp, **kw)
        return (p_new - p, m_new.astype(m.dtype), v_new.astype(v.dtype),
                None if vmax is None else vmax_new.astype(vmax.dtype))

    out = jax.tree.map(leaf, updates, params, state.mu, state.nu, nu_max, decay,
                       is_leaf=lambda x: x is None)
    parts = [jax.tree.map(lambda o, i=i: o[i], out, is_leaf=lambda x: isinstance(x, tuple))
             for i in range(4)]
    return parts[0], AdamWState(count=count_inc, mu=parts[1], nu=parts[2],
                                nu_max=parts[3] if amsgrad else None)


# Argument name -> field of xopt.specs.adamw.AdamW (the two differ only for the lr).
_FIELD_OF_ARG = {"learning_rate": "lr", "b1": "b1", "b2": "b2", "eps": "eps",
                 "eps_root": "eps_root", "weight_decay": "weight_decay", "amsgrad": "amsgrad",
                 "maximize": "maximize", "nesterov": "nesterov", "formula": "formula",
                 "bias_correction_dtype": "bias_correction_dtype"}
_OPTAX = _spec.PRESETS["optax"]
_DEFAULTS = {arg: _OPTAX.get(field) for arg, field in _FIELD_OF_ARG.items()}
_DEFAULTS.update(amsgrad=False, maximize=False, nesterov=False, bias_correction_dtype=None)


def _is_default(name: str, value: Any) -> bool:
    """Whether an argument was left at its default (a concrete value equal to it)."""
    default = _DEFAULTS[name]
    if value is default:
        return True
    if default is None or isinstance(default, (bool, str)):
        return type(value) is type(default) and value == default
    try:
        return float(value) == default  # Python number or concrete 0-d array
    except Exception:  # a tracer (inject_hyperparams under jit), a schedule, ...
        return False


def _validate(args: dict[str, Any], spec: _spec.AdamW | None) -> _spec.AdamW:
    """The spec dataclass for these arguments; raises HyperparameterError naming the field."""
    if spec is not None:
        if not isinstance(spec, _spec.AdamW):
            raise HyperparameterError(f"{_LABEL}: spec must be an xopt.specs.adamw.AdamW, got "
                                      f"{type(spec).__name__}")
        conflicting = [name for name, value in args.items() if not _is_default(name, value)]
        if conflicting:
            raise HyperparameterError(
                f"{_LABEL}: pass either spec= or the hyperparameter arguments, not both; got "
                f"spec= together with {', '.join(f'{n}={args[n]!r}' for n in conflicting)}. "
                "Use spec.replace(...) to change a field of the spec.")
        return spec
    # Fields left to the formula (bias_correction_dtype) come from the formula's preset.
    fields = dict(_spec.PRESETS.get(args["formula"], {}))
    fields.update({_FIELD_OF_ARG[name]: value for name, value in args.items()
                   if value is not None})
    if callable(fields["lr"]):  # a schedule cannot be range-checked; validate a stand-in
        fields["lr"] = _OPTAX["lr"]
    try:
        return _spec.AdamW.from_dict(fields)
    except HyperparameterError as e:
        prefix = "learning_rate: " if str(e).startswith("AdamW.lr ") else ""
        raise HyperparameterError(f"{_LABEL}: {prefix}{e}") from e


def adamw(
    learning_rate: optax.ScalarOrSchedule = _DEFAULTS["learning_rate"],
    b1: float | jax.Array = _DEFAULTS["b1"],
    b2: float | jax.Array = _DEFAULTS["b2"],
    eps: float | jax.Array = _DEFAULTS["eps"],
    eps_root: float | jax.Array = _DEFAULTS["eps_root"],
    weight_decay: float | jax.Array = _DEFAULTS["weight_decay"],
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    nesterov: bool = False,
    formula: str = "optax",
    bias_correction_dtype: str | None = None,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    spec: _spec.AdamW | None = None,
    nonfinite: str | None = None,
    **unknown: Any,
) -> optax.GradientTransformationExtraArgs:
    """AdamW (Loshchilov & Hutter 2019, Algorithm 2) as an optax transformation.

    Defaults are the spec's ``"optax"`` preset (:data:`xopt.specs.adamw.PRESETS`), i.e.
    ``optax.adamw``'s, with the learning rate defaulting to 1e-3. Under ``formula="optax"``,
    ``adamw(lr, ...)`` and ``optax.adamw(lr, ...)`` produce bitwise-identical updates,
    params and state (``count``, ``mu``, ``nu``) on the same machine, jitted or not, also
    inside ``optax.chain`` and ``optax.inject_hyperparams``; with ``amsgrad=True`` the same
    holds against ``chain(scale_by_amsgrad, add_decayed_weights, scale_by_learning_rate)``.

    The state (:class:`AdamWState`) holds an int32 count and, per parameter, moments of
    the parameter's shape and dtype (bfloat16 params: bfloat16 moments, as optax without
    ``mu_dtype``); the updates have the parameters' structure, shapes and dtypes.

    Args:
      learning_rate: η: a float, a 0-d array, or an optax schedule, called with the count
        before this update's increment (0 first), as ``optax.scale_by_schedule``.
      b1, b2: decays β₁, β₂ of the first and second moments, in [0, 1).
      eps: ε added to √(v̂ + ε_root).
      eps_root: ε_root added to v̂ inside the square root.
      weight_decay: decoupled weight decay λ, multiplied by η (a number, not a schedule).
      amsgrad: divide by the running maximum of the second moment (see :class:`AdamWState`).
      maximize: ascend: the gradient is negated.
      nesterov: Nesterov momentum (optax's NAdamW); needs ``formula="optax"``.
      formula: ``"optax"``: optax.adamw's floating-point operations and order.
        ``"torch"``: torch.optim.AdamW's (:func:`xopt.specs.adamw.update_torch`); the
        update is ``p_new − p``, so ``p + u`` can differ from torch's ``p_new`` by an ulp
        of p, and 1 − βᵗ is evaluated in float32 as ``−expm1(t·log1p(β − 1))`` (jax has no
        float64 without x64) where torch uses double: within ~1e-7 relative of
        torch.optim.AdamW per step, not bit-identical to it.
      bias_correction_dtype: precision of 1 − βᵗ: ``"float32"`` as optax, ``"float64"`` as
        torch.optim; None takes the formula's preset.
      mask: weight decay only, as ``optax.adamw``'s ``mask``: a pytree of bools like the
        params (or a prefix of it), or a callable returning one when given the updates.
        False leaves get no ``+ λθ`` term (bitwise ``optax.masked``); every leaf's moments
        are updated.
      spec: an :class:`xopt.specs.adamw.AdamW` giving every hyperparameter instead of the
        arguments above, which must then be left at their defaults (its ``lr`` is the
        learning rate).
      nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` (:mod:`xopt.nonfinite`;
        ``"raise"`` needs concrete gradients: it is refused under ``jit``).

    Returns:
      An ``optax.GradientTransformationExtraArgs``: ``init(params)`` gives an
      :class:`AdamWState`; ``update(updates, state, params=None, **extra_args)`` gives
      ``(updates, new_state)``, ignoring ``extra_args`` (e.g. ``value=loss``). ``params``
      is required unless the weight decay is a static zero (``formula="optax"``).

    Raises:
      HyperparameterError: an unknown keyword, a value outside its range (naming the
        field), or ``spec=`` together with a non-default hyperparameter argument.
      StateError: (at trace time) a state that does not fit the parameters.
    """
    _contract.reject_unknown(_LABEL, unknown, adamw)
    args = dict(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                nesterov=nesterov, formula=formula,
                bias_correction_dtype=bias_correction_dtype)
    hp = _validate(args, spec)
    mode = _contract.resolve_nonfinite(_LABEL, nonfinite)
    lr = hp.lr if spec is not None else learning_rate
    inner = scale_by_adamw(lr, hp.b1, hp.b2, hp.eps, hp.eps_root, hp.weight_decay,
                           amsgrad=hp.amsgrad, maximize=hp.maximize, nesterov=hp.nesterov,
                           formula=hp.formula, bias_correction_dtype=hp.bias_correction_dtype,
                           mask=mask)
    return _contract.transformation(_LABEL, inner.init, inner.update, nonfinite=mode)


_contract.public_signature(adamw)


register("adamw", "jax", adamw)
