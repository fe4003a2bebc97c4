"""small_fc_lopt (learned_optimization's ``AdafacMLPLOpt``) as an optax transformation.

:func:`small_fc_lopt` returns an ``optax.GradientTransformationExtraArgs``: each leaf's
update is :func:`xopt.specs.small_fc_lopt.compute_step` evaluated with ``jax.numpy``;
the wrapping (loss, weight decay, accumulation, learning rate, dtypes, finiteness check)
is :func:`xopt.jax._lopt.learned_optimizer`. It jits, and needs ``params``:

>>> tx = xopt.jax.small_fc_lopt(theta, num_training_steps=10_000)
>>> state = tx.init(params)
>>> updates, state = tx.update(grads, state, params, value=loss)
>>> params = optax.apply_updates(params, updates)      # p − step at learning_rate=1

θ is closed over (a constant of the jitted update), as the original's ``opt_fn(theta)``
closes over it.

State: :class:`xopt.jax._lopt.LOptState` with ``inner`` a :class:`SmallFCState`; flattened
paths (naming ``"xopt.jax"`` of :data:`xopt.specs.small_fc_lopt.STATE`): ``iteration``,
``num_steps``, ``inner/m/<param>``, ``inner/rms/<param>``, ``inner/v_row/<param>``,
``inner/v_col/<param>``, ``inner/v_diag/<param>``, ``inner/mom_t``, ``inner/rms_t``, and
when accumulating ``accum/grad_accum/<param>``, ``accum/loss_accum``, ``accum/iteration``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from xopt.jax import _contract, _lopt_fast
from xopt.jax._lopt import AccumState, LOptState, configure, learned_optimizer
from xopt.registry import register
from xopt.specs import small_fc_lopt as _spec

__all__ = ["AccumState", "LOptState", "SmallFCState", "init_state", "small_fc_lopt"]

_PARAM_VARS = ("m", "rms", "v_row", "v_col", "v_diag")


class SmallFCState(NamedTuple):
    """AdafacMLPLOpt's accumulators (float32; each field but the counts a pytree like the
    params, with the shapes of :func:`xopt.specs.small_fc_lopt.param_state_shapes`).

    Attributes:
      m: momenta ``S + (km,)``.  rms: second moments ``S + (kr,)``.
      v_row, v_col: factored second moments (``(0, kf)`` placeholders below rank 2).
      v_diag: unfactored second moment ``S + (kf,)`` (a ``(0, kf)`` placeholder from rank 2).
      mom_t: int32 ``(km,)``, rms_t: int32 ``(kr,)``: the accumulators' update counts.
    """

    m: Any
    rms: Any
    v_row: Any
    v_col: Any
    v_diag: Any
    mom_t: jax.Array
    rms_t: jax.Array


def init_state(hp: _spec.SmallFCLOpt, params: Any) -> SmallFCState:
    """The zero state of ``params`` (small_fc_lopt's layout; μLO keeps the same)."""
    def zeros(var: str) -> Any:
        return jax.tree.map(
            lambda p: jnp.zeros(_spec.param_state_shapes(hp, jnp.shape(p))[var], jnp.float32),
            params)

    km, kr, _ = _spec.num_decays(hp)
    return SmallFCState(*(zeros(v) for v in _PARAM_VARS),
                        mom_t=jnp.zeros((km,), jnp.int32), rms_t=jnp.zeros((kr,), jnp.int32))


class _Method:
    """The learned update proper (:class:`xopt.jax._lopt.InnerMethod`)."""

    def __init__(self, hp: _spec.SmallFCLOpt, meta: Mapping[str, np.ndarray]) -> None:
        self.hp, self.meta = hp, meta

    def init(self, params: Any) -> SmallFCState:
        return init_state(self.hp, params)

    def update(self, params: Any, grads: Any, loss: jax.Array, iteration: jax.Array,
               inner: SmallFCState) -> tuple[Any, SmallFCState]:
        del loss  # AdafacMLPLOpt does not read the loss
        p_leaves, treedef = jax.tree.flatten(params)
        g_leaves = treedef.flatten_up_to(grads)
        accs_in = [treedef.flatten_up_to(getattr(inner, v)) for v in _PARAM_VARS]
        decays = _spec.decays(self.hp, self.meta, xp=jnp)
        tf = _spec.time_features(jnp, iteration, self.meta["mlp/b0"])
        steps, accs_out = [], [[] for _ in _PARAM_VARS]
        for i, (p, g) in enumerate(zip(p_leaves, g_leaves, strict=True)):
            step, accs = _spec.compute_step(self.hp, p, g, *(a[i] for a in accs_in), tf,
                                            self.meta, decays, xp=jnp)
            steps.append(step)
            for out, a in zip(accs_out, accs, strict=True):
                out.append(a)
        new = SmallFCState(*(treedef.unflatten(a) for a in accs_out),
                           mom_t=inner.mom_t + 1, rms_t=inner.rms_t + 1)
        return treedef.unflatten(steps), new


def small_fc_lopt(
    meta_params: Mapping[str, Any] | None = None,
    *,
    num_training_steps: int | None = None,
    learning_rate: float | Callable[[jax.Array], jax.Array] | None = None,
    weight_decay: float | None = None,
    weight_decay_mode: str | None = None,
    max_training_steps: int | None = None,
    spec: _spec.SmallFCLOpt | None = None,
    seed: int | None = None,
    check_finite: bool = False,
    nonfinite: str | None = None,
    impl: str | None = None,
    precision: str = "exact",
    exp_mult: float | None = None,
    step_mult: float | None = None,
    hidden_size: int | None = None,
    hidden_layers: int | None = None,
    initial_momentum_decays: tuple[float, ...] | None = None,
    initial_rms_decays: tuple[float, ...] | None = None,
    initial_adafactor_decays: tuple[float, ...] | None = None,
    **unknown: Any,
) -> optax.GradientTransformationExtraArgs:
    """small_fc_lopt as an ``optax.GradientTransformationExtraArgs``.

    Args:
      meta_params: θ in xopt's or the original's naming (arrays of any kind); None:
        ``meta_init(hp, seed)``.
      num_training_steps: the training horizon (required, here or in ``spec``).
      learning_rate: multiplier of the step, a number or an optax schedule of the call
        count; default 1 (the original). ``updates = −(lr·step)``.
      weight_decay, weight_decay_mode, max_training_steps: see
        :class:`xopt.specs.lopt.LOptOptions`.
      spec: an :class:`xopt.specs.small_fc_lopt.SmallFCLOpt` instead of the keywords (its
        ``lr`` is the learning rate).
      seed: seed of the fresh θ when ``meta_params`` is None (None: 0).
      nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` over the gradients and
        the loss (:mod:`xopt.nonfinite`; ``"raise"`` needs concrete values, outside ``jit``).
      check_finite: ``True`` is the older spelling of ``nonfinite="raise"``.
      impl: the inner update's implementation: "plain" (per tensor, the reference),
        "packed" (the tensors grouped by shape, see :mod:`xopt.jax._lopt_fast`),
        "pallas" (packed, with fused Pallas kernels), or None: "pallas" on a GPU (where
        its kernels cover the configuration, :data:`xopt.jax._lopt_fast.GPU_DEFAULT`),
        "plain" elsewhere.
        The state is the same for all.
      precision: the fused kernels' matrix products, "exact" or "fast" (TF32).
      exp_mult, step_mult, hidden_size, hidden_layers, initial_momentum_decays,
        initial_rms_decays, initial_adafactor_decays: the method's hyperparameters
        (:class:`xopt.specs.small_fc_lopt.SmallFCLOpt`; None: the original's default).
      Any other keyword is a :class:`HyperparameterError` naming it.

    Returns:
      ``init(params) -> LOptState``; ``update(grads, state, params, value=loss)`` →
      ``(updates, state)``, ``updates`` in ``promote(param dtype, float32)``.
    """
    label = "xopt.jax.small_fc_lopt"
    _contract.reject_unknown(label, unknown, small_fc_lopt)
    mode = _contract.resolve_nonfinite(label, nonfinite, check_finite)
    given = dict(num_training_steps=num_training_steps, weight_decay=weight_decay,
                 weight_decay_mode=weight_decay_mode, max_training_steps=max_training_steps,
                 exp_mult=exp_mult, step_mult=step_mult, hidden_size=hidden_size,
                 hidden_layers=hidden_layers, initial_momentum_decays=initial_momentum_decays,
                 initial_rms_decays=initial_rms_decays,
                 initial_adafactor_decays=initial_adafactor_decays)
    hp, schedule, meta = configure(label, _spec.SmallFCLOpt, _spec.META, spec=spec, given=given,
                                   learning_rate=learning_rate, meta_params=meta_params,
                                   seed=seed)
    method = _lopt_fast.select(label, "small_fc_lopt", _Method(hp, meta), impl, precision)
    return learned_optimizer(method, hp, learning_rate=schedule,
                             nonfinite=mode, needs_loss=False, label=label)


_contract.public_signature(small_fc_lopt)


register("small_fc_lopt", "jax", small_fc_lopt)
