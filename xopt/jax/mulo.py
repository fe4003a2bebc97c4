"""μLO (μLO's ``MuAdafacMLPLOpt``, PyLO's ``MuLO``) as an optax transformation.

:func:`mulo` returns an ``optax.GradientTransformationExtraArgs``: each leaf's update is
:func:`xopt.specs.small_fc_lopt.compute_step` on the gradient
:func:`xopt.specs.mulo.prepare_grad` gives (clipped to global norm 1 with ``clip_grad``,
non-finite entries replaced), times the leaf's μP multiplier; the wrapping (loss, weight
decay, accumulation, learning rate, dtypes, finiteness check) is
:func:`xopt.jax._lopt.learned_optimizer`.

**μP multipliers: a pytree or a function of the params**, as optax's ``multi_transform``
takes its labels. ``mup_lrs`` is a pytree of numbers shaped like the params, or a function
``params -> such a pytree``; :func:`mup_lrs` makes one from the parameters' roles (a pytree
of role names, or a function of the params giving one) with
:func:`xopt.specs.mulo.mup_lr`'s rule, reading fan-in in flax's layout (a ``Dense`` kernel
``(in, out)``, a ``Conv`` kernel ``(*window, in, out)``: every axis but the last):

>>> roles = {"in": {"kernel": "input", "bias": "vector"},
...          "hidden": {"kernel": "hidden", "bias": "vector"},
...          "out": {"kernel": "output", "bias": "vector"}}
>>> tx = xopt.jax.mulo(theta, num_training_steps=10_000,
...                    mup_lrs=lambda p: xopt.jax.mulo.mup_lrs(p, roles))

State: :class:`xopt.jax._lopt.LOptState` with ``inner`` a
:class:`xopt.jax.small_fc_lopt.SmallFCState` (small_fc_lopt's layout).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from xopt.errors import HyperparameterError
from xopt.jax import _contract, _lopt_fast
from xopt.jax._lopt import configure, learned_optimizer
from xopt.jax.small_fc_lopt import SmallFCState
from xopt.jax.small_fc_lopt import _Method as small_fc_lopt_method
from xopt.registry import register
from xopt.specs import ParamGroups
from xopt.specs import mulo as _spec

__all__ = ["mulo", "mup_lrs"]


def _leaf_names(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(path) or "<root>"
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def mup_lrs(params: Any, roles: Any, hidden_lr_mult: float = 1.0) -> Any:
    """A pytree like ``params`` of μP multipliers (Python floats) from their roles.

    Args:
      params: the parameters (arrays or shape-carrying leaves).
      roles: a pytree of role names (``"input"``, ``"hidden"``, ``"output"``,
        ``"vector"``) with the params' structure, or a function ``params -> such a pytree``.
      hidden_lr_mult: μLO's ``hidden_lr_mult`` (hidden weights: ``hidden_lr_mult /
        fan_in``, fan-in the product of every axis but the last).
    """
    labels = roles(params) if callable(roles) else roles
    p_leaves, treedef = jax.tree.flatten(params)
    try:
        r_leaves = treedef.flatten_up_to(labels)
    except (ValueError, TypeError) as e:
        raise HyperparameterError(f"mup_lrs: roles do not have the params' structure ({e})"
                                  ) from None
    out = []
    for name, p, role in zip(_leaf_names(params), p_leaves, r_leaves, strict=True):
        shape = tuple(np.shape(p))
        fan_in = None
        if role == "hidden":
            if len(shape) < 2:
                raise HyperparameterError(f"mup_lrs: parameter {name} (shape {shape}) has role "
                                          "'hidden', which needs a weight of rank >= 2")
            fan_in = int(np.prod(shape[:-1]))
        try:
            out.append(_spec.mup_lr(role, fan_in, hidden_lr_mult))
        except HyperparameterError as e:
            raise HyperparameterError(f"mup_lrs: parameter {name}: {e}") from None
    return treedef.unflatten(out)


class _Method:
    """The learned update proper (:class:`xopt.jax._lopt.InnerMethod`): small_fc_lopt's inner
    update (``inner``: its per-tensor reference, or its packed or Pallas path as
    :func:`xopt.jax._lopt_fast.select` gives it) on the gradients μLO prepares, its steps
    scaled by the μP multipliers."""

    def __init__(self, hp: _spec.MuLO, meta: Mapping[str, np.ndarray],
                 mults: Callable[[Any], list[float]]) -> None:
        self.hp, self.meta, self.mults = hp, meta, mults
        self.inner: Any = small_fc_lopt_method(hp, meta)

    def init(self, params: Any) -> SmallFCState:
        self.mults(params)  # the multipliers are checked against the params once, here
        return self.inner.init(params)

    def update(self, params: Any, grads: Any, loss: jax.Array, iteration: jax.Array,
               inner: SmallFCState) -> tuple[Any, SmallFCState]:
        p_leaves, treedef = jax.tree.flatten(params)
        g_leaves = treedef.flatten_up_to(grads)
        mults = self.mults(params)
        norm = _spec.global_norm(jnp, g_leaves) if self.hp.clip_grad and g_leaves else None
        g_leaves = [_spec.prepare_grad(jnp, g, norm) for g in g_leaves]
        steps, new = self.inner.update(params, treedef.unflatten(g_leaves), loss, iteration,
                                       inner)
        steps = [_spec.scale_step(s, m)
                 for s, m in zip(treedef.flatten_up_to(steps), mults, strict=True)]
        return treedef.unflatten(steps), new


def _multipliers(label: str, hp: _spec.MuLO, given: Any, param_specs: Any
                 ) -> Callable[[Any], list[float]]:
    """``params -> [multiplier per leaf]`` from ``mup_lrs`` or ``param_specs`` (checked,
    naming the leaf)."""
    if given is not None and param_specs is not None:
        raise HyperparameterError(f"{label}: pass mup_lrs= or param_specs=, not both")

    def resolve(params: Any) -> list[float]:
        names = _leaf_names(params)
        leaves, treedef = jax.tree.flatten(params)
        if given is None and param_specs is None:
            return [float(hp.mup_lr)] * len(leaves)
        if param_specs is not None:
            tree = param_specs(params) if callable(param_specs) else param_specs
            try:
                specs = treedef.flatten_up_to(tree)
            except (ValueError, TypeError) as e:
                raise HyperparameterError(f"{label}: param_specs does not have the params' "
                                          f"structure ({e})") from None
            out = []
            for n, s in zip(names, specs, strict=True):
                if not isinstance(s, _spec.MuLO):
                    raise HyperparameterError(f"{label}: param_specs[{n}] is a "
                                              f"{type(s).__name__}, expected a MuLO")
                try:
                    _spec.settings(ParamGroups.of([(["spec"], hp), ([n], s)]))
                except HyperparameterError as e:
                    raise HyperparameterError(f"{label}: param_specs[{n}]: {e}") from None
                out.append(float(s.mup_lr))
            return out
        tree = given(params) if callable(given) else given
        try:
            values = treedef.flatten_up_to(tree)
        except (ValueError, TypeError) as e:
            raise HyperparameterError(f"{label}: mup_lrs does not have the params' structure "
                                      f"({e})") from None
        out = []
        for n, v in zip(names, values, strict=True):
            try:
                out.append(float(hp.replace(mup_lr=float(v)).mup_lr))
            except (HyperparameterError, TypeError, ValueError) as e:
                raise HyperparameterError(f"{label}: mup_lrs[{n}]: {e}") from None
        return out

    return resolve


def mulo(
    meta_params: Mapping[str, Any] | None = None,
    *,
    num_training_steps: int | None = None,
    learning_rate: float | Callable[[jax.Array], jax.Array] | None = None,
    mup_lrs: Any = None,
    param_specs: Any = None,
    weight_decay: float | None = None,
    weight_decay_mode: str | None = None,
    max_training_steps: int | None = None,
    spec: _spec.MuLO | None = None,
    seed: int | None = None,
    check_finite: bool = False,
    nonfinite: str | None = None,
    impl: str | None = None,
    precision: str = "exact",
    clip_grad: bool | None = None,
    mup_lr: float | None = None,
    exp_mult: float | None = None,
    step_mult: float | None = None,
    hidden_size: int | None = None,
    hidden_layers: int | None = None,
    initial_momentum_decays: tuple[float, ...] | None = None,
    initial_rms_decays: tuple[float, ...] | None = None,
    initial_adafactor_decays: tuple[float, ...] | None = None,
    **unknown: Any,
) -> optax.GradientTransformationExtraArgs:
    """μLO as an ``optax.GradientTransformationExtraArgs``.

    Args:
      meta_params: θ in xopt's or the original's naming; None: ``meta_init(hp, seed)``.
      num_training_steps: the training horizon (required, here or in ``spec``).
      learning_rate: multiplier of the step, a number or an optax schedule; default 1.
      mup_lrs: the μP multipliers, a pytree of numbers like the params or a function
        ``params -> pytree`` (see :func:`mup_lrs`); None: ``mup_lr`` for every leaf.
      param_specs: instead of ``mup_lrs``, per-leaf :class:`xopt.specs.mulo.MuLO` (a
        pytree like the params, or a function of the params giving one), differing from
        ``spec`` in ``mup_lr`` only (the per-parameter settings of the other xopt.jax
        methods, which the parity harness uses).
      weight_decay, weight_decay_mode, max_training_steps: see
        :class:`xopt.specs.lopt.LOptOptions`.
      spec: a :class:`xopt.specs.mulo.MuLO` instead of the keywords.
      seed: seed of the fresh θ when ``meta_params`` is None (None: 0).
      nonfinite: ``"ignore"`` (default: μLO's own rule, NaN → 0 and ±inf → ±float32 max),
        ``"raise"`` or ``"skip"`` over the gradients and the loss (:mod:`xopt.nonfinite`;
        ``"raise"`` needs concrete values, outside ``jit``).
      check_finite: ``True`` is the older spelling of ``nonfinite="raise"``.
      impl: the inner update's implementation, as :func:`xopt.jax.small_fc_lopt`'s (the
        same kernels: the μP multipliers scale their steps): "plain", "packed", "pallas",
        or None ("pallas" on a GPU where the kernels cover the configuration, else "plain").
      precision: the fused kernels' matrix products, "exact" or "fast" (TF32).
      clip_grad, mup_lr, exp_mult, step_mult, hidden_size, hidden_layers,
        initial_momentum_decays, initial_rms_decays, initial_adafactor_decays: the
        method's hyperparameters (:class:`xopt.specs.mulo.MuLO`).
      Any other keyword is a :class:`HyperparameterError` naming it.
    """
    label = "xopt.jax.mulo"
    _contract.reject_unknown(label, unknown, mulo)
    mode = _contract.resolve_nonfinite(label, nonfinite, check_finite)
    given = dict(num_training_steps=num_training_steps, weight_decay=weight_decay,
                 weight_decay_mode=weight_decay_mode, max_training_steps=max_training_steps,
                 clip_grad=clip_grad, mup_lr=mup_lr, exp_mult=exp_mult, step_mult=step_mult,
                 hidden_size=hidden_size, hidden_layers=hidden_layers,
                 initial_momentum_decays=initial_momentum_decays,
                 initial_rms_decays=initial_rms_decays,
                 initial_adafactor_decays=initial_adafactor_decays)
    hp, schedule, meta = configure(label, _spec.MuLO, _spec.META, spec=spec, given=given,
                                   learning_rate=learning_rate, meta_params=meta_params,
                                   seed=seed)
    method = _Method(hp, meta, _multipliers(label, hp, mup_lrs, param_specs))
    # small_fc_lopt's inner update, fast path included, on the gradients μLO prepares (its
    # clipping is global, so it runs before them, as one XLA reduction)
    method.inner = _lopt_fast.select(label, "small_fc_lopt", method.inner, impl, precision)
    return learned_optimizer(method, hp, learning_rate=schedule,
                             nonfinite=mode, needs_loss=False, label=label)


_contract.public_signature(mulo)
# xopt.jax.mulo.mup_lrs: the role helper, reachable from the transformation as from the module
mulo.mup_lrs = mup_lrs  # type: ignore[attr-defined]


register("mulo", "jax", mulo)
