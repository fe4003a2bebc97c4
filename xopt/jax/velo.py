"""VeLO (learned_optimization's ``HyperV2`` as VeLO configures it) as an optax transformation.

:func:`velo` returns an ``optax.GradientTransformationExtraArgs`` whose update is
:mod:`xopt.specs.velo`'s math evaluated with ``jax.numpy``; the wrapping (the loss, weight
decay, gradient accumulation, the learning rate, dtypes, the finiteness check) is
:func:`xopt.jax._lopt.learned_optimizer`. It jits, needs ``params`` and the loss:

>>> tx = xopt.jax.velo(theta, num_training_steps=10_000)
>>> state = tx.init(params)
>>> updates, state = tx.update(grads, state, params, value=loss)
>>> params = optax.apply_updates(params, updates)      # p − step at learning_rate=1

θ is closed over (a constant of the jitted update), as the original's ``opt_fn(theta)``
closes over it. Under ``jit`` on the CPU the operations are the original's, in its order,
so XLA compiles them alike: the LSTM, the loss buffer and the accumulators reproduce the
original bit for bit from the same inputs, and the rest within a few float32 ulps (XLA
fuses a few reductions differently in a differently shaped program).

State: :class:`xopt.jax._lopt.LOptState` with ``inner`` a :class:`VeLOState`; flattened
paths (naming ``"xopt.jax"`` of :data:`xopt.specs.velo.STATE`): ``iteration``,
``num_steps``, ``inner/m/<param>``, ``inner/rms/<param>``, ``inner/v_row/<param>``,
``inner/v_col/<param>``, ``inner/v_diag/<param>``, ``inner/lstm_hidden/<param>``,
``inner/lstm_cell/<param>``, ``inner/mom_t``, ``inner/rms_t``, ``inner/loss_means``,
``inner/loss_running_min``, ``inner/loss_decays``, ``inner/loss_iteration`` and, when
accumulating, ``accum/grad_accum/<param>``, ``accum/loss_accum``, ``accum/iteration``.
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
from xopt.specs import velo as _spec

__all__ = ["AccumState", "LOptState", "VeLOState", "velo"]

_ACC_VARS = ("m", "rms", "v_row", "v_col", "v_diag")


class VeLOState(NamedTuple):
    """HyperV2's state (float32 unless said; per-parameter fields are pytrees like the
    params, with the shapes of :func:`xopt.specs.velo.param_state_shapes`).

    Attributes:
      m: momenta ``S + (3,)``.  rms: second moment ``S + (1,)``.
      v_row, v_col: Adafactor statistics (``(0, 3)`` placeholders below rank 2).
      v_diag: unfactored second moment ``S + (3,)`` (a ``(0, 3)`` placeholder from rank 2).
      lstm_hidden, lstm_cell: each tensor's LSTM state ``(H,)``.
      mom_t: int32 ``(3,)``, rms_t: int32 ``(1,)``: the accumulators' update counts.
      loss_means, loss_running_min, loss_decays: the loss buffer ``(10,)``.
      loss_iteration: int32 ``()``: losses the buffer has seen.
    """

    m: Any
    rms: Any
    v_row: Any
    v_col: Any
    v_diag: Any
    lstm_hidden: Any
    lstm_cell: Any
    mom_t: jax.Array
    rms_t: jax.Array
    loss_means: jax.Array
    loss_running_min: jax.Array
    loss_decays: jax.Array
    loss_iteration: jax.Array


class _Method:
    """The learned update proper (:class:`xopt.jax._lopt.InnerMethod`)."""

    def __init__(self, hp: _spec.VeLO, meta: Mapping[str, np.ndarray]) -> None:
        self.hp, self.meta = hp, meta

    def init(self, params: Any) -> VeLOState:
        hp = self.hp

        def per_param(var: str) -> Any:
            def one(p: Any) -> jax.Array:
                if var == "lstm_hidden":
                    return jnp.asarray(self.meta["lstm/init_hidden"], jnp.float32)
                if var == "lstm_cell":
                    return jnp.asarray(self.meta["lstm/init_cell"], jnp.float32)
                shape = _spec.param_state_shapes(hp, jnp.shape(p))[var]
                return jnp.zeros(shape, jnp.float32)

            return jax.tree.map(one, params)

        buf = _spec.loss_buffer_init(hp.loss_horizon, dtype=np.float32)
        return VeLOState(
            *(per_param(v) for v in (*_ACC_VARS, "lstm_hidden", "lstm_cell")),
            mom_t=jnp.zeros((len(hp.initial_momentum_decays),), jnp.int32),
            rms_t=jnp.zeros((len(hp.initial_rms_decays),), jnp.int32),
            loss_means=jnp.asarray(buf["means"]),
            loss_running_min=jnp.asarray(buf["running_min"]),
            loss_decays=jnp.asarray(buf["decays"]),
            loss_iteration=jnp.zeros((), jnp.int32))

    def update(self, params: Any, grads: Any, loss: jax.Array, iteration: jax.Array,
               inner: VeLOState) -> tuple[Any, VeLOState]:
        hp, meta = self.hp, self.meta
        p_leaves, treedef = jax.tree.flatten(params)
        g_leaves = treedef.flatten_up_to(grads)
        accs_in = [treedef.flatten_up_to(getattr(inner, v)) for v in _ACC_VARS]
        like = inner.loss_means
        means, rmin, loss_it, lfeat = _spec.loss_buffer_step(
            jnp, inner.loss_means, inner.loss_running_min, inner.loss_decays,
            inner.loss_iteration, loss)
        # The original divides by its state's num_steps, a runtime value: XLA would turn a
        # division by a compile-time constant into a product with its reciprocal, which
        # rounds differently; the barrier keeps the horizon opaque.
        num_steps = jax.lax.optimization_barrier(jnp.asarray(hp.inner_num_steps, jnp.int32))
        frac = _spec.fraction_trained(jnp, iteration, num_steps, like)
        x = jnp.stack([_spec.lstm_features(jnp, p, m, r, frac, lfeat)
                       for p, m, r in zip(p_leaves, accs_in[0], accs_in[1], strict=True)])
        hidden = jnp.stack(treedef.flatten_up_to(inner.lstm_hidden))
        cell = jnp.stack(treedef.flatten_up_to(inner.lstm_cell))
        controls, lr_mult, hidden, cell = _spec.lstm_step(jnp, x, hidden, cell, meta)
        decays = tuple(jnp.asarray(d) for d in _spec.decay_arrays(hp))
        steps, accs_out = [], [[] for _ in _ACC_VARS]
        for i, (p, g) in enumerate(zip(p_leaves, g_leaves, strict=True)):
            step, accs = _spec.update_tensor(jnp, hp, p, g, *(a[i] for a in accs_in),
                                             controls[i], lr_mult[i], meta, decays)
            steps.append(step)
            for out, a in zip(accs_out, accs, strict=True):
                out.append(a)
        n = len(p_leaves)
        new = VeLOState(*(treedef.unflatten(a) for a in accs_out),
                        lstm_hidden=treedef.unflatten([hidden[i] for i in range(n)]),
                        lstm_cell=treedef.unflatten([cell[i] for i in range(n)]),
                        mom_t=inner.mom_t + 1, rms_t=inner.rms_t + 1, loss_means=means,
                        loss_running_min=rmin, loss_decays=inner.loss_decays,
                        loss_iteration=loss_it)
        return treedef.unflatten(steps), new


def velo(
    meta_params: Mapping[str, Any] | None = None,
    *,
    num_training_steps: int | None = None,
    learning_rate: float | Callable[[jax.Array], jax.Array] | None = None,
    weight_decay: float | None = None,
    weight_decay_mode: str | None = None,
    max_training_steps: int | None = None,
    spec: _spec.VeLO | None = None,
    seed: int | None = None,
    check_finite: bool = False,
    nonfinite: str | None = None,
    impl: str | None = None,
    precision: str = "exact",
    lstm_hidden_size: int | None = None,
    param_inits: int | None = None,
    ff_hidden_size: int | None = None,
    ff_hidden_layers: int | None = None,
    initial_momentum_decays: tuple[float, ...] | None = None,
    initial_rms_decays: tuple[float, ...] | None = None,
    initial_adafactor_decays: tuple[float, ...] | None = None,
    exp_mult: float | None = None,
    step_mult: float | None = None,
    use_bugged_loss_features: bool | None = None,
    **unknown: Any,
) -> optax.GradientTransformationExtraArgs:
    """VeLO as an ``optax.GradientTransformationExtraArgs``.

    Args:
      meta_params: θ in xopt's or the original's naming (arrays of any kind); None:
        ``meta_init(hp, seed)``, an untrained VeLO (only useful for tests).
      num_training_steps: the training horizon (required, here or in ``spec``).
      learning_rate: multiplier of the learned step, a number or an optax schedule of the
        call count; default 1 (the original's step). ``updates = −(lr·step)``.
      weight_decay, weight_decay_mode, max_training_steps: see
        :class:`xopt.specs.lopt.LOptOptions` (``prefab.LearnedOptimizer``'s wrappers).
      spec: an :class:`xopt.specs.velo.VeLO` instead of the keywords (its ``lr`` is the
        learning rate).
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
      lstm_hidden_size, …, use_bugged_loss_features: the method's fields
        (:class:`xopt.specs.velo.VeLO`; None: VeLO's value).
      Any other keyword is a :class:`HyperparameterError` naming it.

    Returns:
      ``init(params) -> LOptState``; ``update(grads, state, params, value=loss)`` →
      ``(updates, state)``; the loss is required.
    """
    label = "xopt.jax.velo"
    _contract.reject_unknown(label, unknown, velo)
    mode = _contract.resolve_nonfinite(label, nonfinite, check_finite)
    given = dict(num_training_steps=num_training_steps, weight_decay=weight_decay,
                 weight_decay_mode=weight_decay_mode, max_training_steps=max_training_steps,
                 lstm_hidden_size=lstm_hidden_size, param_inits=param_inits,
                 ff_hidden_size=ff_hidden_size, ff_hidden_layers=ff_hidden_layers,
                 initial_momentum_decays=initial_momentum_decays,
                 initial_rms_decays=initial_rms_decays,
                 initial_adafactor_decays=initial_adafactor_decays, exp_mult=exp_mult,
                 step_mult=step_mult, use_bugged_loss_features=use_bugged_loss_features)
    hp, schedule, meta = configure(label, _spec.VeLO, _spec.META, spec=spec, given=given,
                                   learning_rate=learning_rate, meta_params=meta_params,
                                   seed=seed)
    method = _lopt_fast.select(label, "velo", _Method(hp, meta), impl, precision)
    return learned_optimizer(method, hp, learning_rate=schedule,
                             nonfinite=mode, needs_loss=True, label=label)


_contract.public_signature(velo)


register("velo", "jax", velo)
