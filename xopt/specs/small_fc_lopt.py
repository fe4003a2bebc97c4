"""small_fc_lopt: learned_optimization's ``AdafacMLPLOpt``, a per-parameter MLP learned optimizer.

The optimizer of Metz et al., "Practical tradeoffs between memory, compute, and performance
in learned optimizers" (CoLLAs 2022), as the original code defines it:
``learned_optimization/learned_optimizers/adafac_mlp_lopt.py`` (``AdafacMLPLOpt``) with the
accumulators of ``learned_optimizers/common.py`` (here :mod:`xopt.specs.lopt`), wrapped as
``research/general_lopt/prefab.py`` wraps learned optimizers (weight decay, gradient
accumulation; see :class:`xopt.specs.lopt.LOptOptions`).

One update of a parameter ``p`` (shape ``S``, rank 0 to 4) with gradient ``g``, at inner
iteration ``t`` (0-based), with ``k`` = 3 decays for momentum and the factored accumulators
and 1 for the second moment (the defaults):

1. accumulators, each decay ``d`` learned as ``1 − exp(10·(log(1 − d₀)/10 + θ_d))``::

       m ← d·m + (1 − d)·g                       (S + (3,))
       rms ← c·rms + (1 − c)·g²,  c = clip(d)    (S + (1,))
       v_row, v_col (rank ≥ 2) or v_diag (rank < 2) ← Adafactor-style, giving fac_g (S + (3,))

2. 28 per-parameter features (``concat`` on a trailing axis, in this order): g, p, m (3),
   rms, m·rsqrt(rms + 1e-6) (3), rsqrt(rms + 1e-6), fac_g (3), then for rank ≥ 2
   v_row and v_col broadcast over the reduced axis (3 + 3), rsqrt(v_row + 1e-8) and
   rsqrt(v_col + 1e-8) (3 + 3), m·row_factor·col_factor (3); for rank < 2 v_diag twice,
   rsqrt(v_diag + 1e-8) twice and m·(v_diag + 1e-6)^−½ (the original's "match RMSProp").
   A 0-d parameter is first reshaped to ``(1,)``, as the original does.
3. each feature is divided by ``sqrt(1e-5 + mean over the tensor's elements of its
   square)`` (the second-moment normalizer; for a 0-d parameter the "mean" is over one
   element). PyLO's torch port normalizes a scalar's 28 features jointly; that is one of its
   departures from the original, not followed here.
4. 11 time features ``tanh(t / τ − 1)``, τ ∈ (1, 3, 10, …, 100000), not normalized, are
   appended (39 inputs), and an MLP ``39 → hidden → … → 2`` (ReLU between layers) gives
   ``direction`` and ``magnitude`` per element;
5. ``step = direction · exp(magnitude · exp_mult) · step_mult`` and ``p ← p − lr·step``
   (lr = 1: the original's ``p − step``).

Everything here is a pure function of arrays in one namespace ``xp`` (NumPy, torch or
jax.numpy), one tensor at a time; the backends call :func:`compute_step` per tensor.
Floating-point: the operations are the original's, in its order; the three namespaces
still round reductions (means, the matmuls), ``rsqrt``, ``tanh``, ``log`` and ``exp``
differently by an ulp or so, which is what the harness's tolerances allow for
(:mod:`xopt.parity.methods.small_fc_lopt`).

Meta-parameters (``θ``) are named ``mlp/w{i}``, ``mlp/b{i}`` (``i`` = 0 … hidden_layers;
``w`` is ``(in, out)`` as in the original) and ``decays/momentum``, ``decays/rms``,
``decays/adafactor``; the original's names are ``nn/~/w{i}``, ``nn/~/b{i}``,
``momentum_decays``, ``rms_decays``, ``adafactor_decays`` (see :data:`META`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

from xopt.specs import arrays, lopt
from xopt.specs._hyperparams import Interval, hp
from xopt.specs._method import MetaParams, MethodSpec
from xopt.specs._state import Naming, StateSchema, StateVar, same_as_param, scalar
from xopt.specs.lopt import LOptOptions

# -- hyperparameters -----------------------------------------------------------------------

_DECAY_RANGE = Interval(0.0, 1.0, hi_closed=False)
_DECAY_FIELDS = ("initial_momentum_decays", "initial_rms_decays", "initial_adafactor_decays")


@dataclasses.dataclass(frozen=True)
class SmallFCLOpt(LOptOptions):
    """AdafacMLPLOpt's hyperparameters, with its constructor's defaults
    (adafac_mlp_lopt.py, ``AdafacMLPLOpt.__init__``), plus the shared learned-optimizer
    options of :class:`xopt.specs.lopt.LOptOptions`.

    The original's ``concat_weights`` (True), ``make_separate_weights`` and
    ``split_weights`` (False) choose between two evaluations of the same function (a matmul
    or scalar arithmetic) and, for ``make_separate_weights``, a different meta-parameter
    layout; xopt implements the default (matmul) form only, and
    :func:`_from_original_kwargs` rejects other values naming the field.
    """

    METHOD = "small_fc_lopt"

    exp_mult: float = hp(0.001, doc="scale of the magnitude head inside exp()")
    step_mult: float = hp(0.001, doc="scale of the step")
    hidden_size: int = hp(4, doc="width of each hidden layer", interval=Interval(1, None))
    hidden_layers: int = hp(2, doc="number of hidden layers", interval=Interval(0, None))
    initial_momentum_decays: tuple[float, ...] = hp(
        (0.9, 0.99, 0.999), doc="momentum decays before the learned offsets")
    initial_rms_decays: tuple[float, ...] = hp(
        (0.999,), doc="second-moment decays before the learned offsets")
    initial_adafactor_decays: tuple[float, ...] = hp(
        (0.9, 0.99, 0.999), doc="factored second-moment decays before the learned offsets")

    def __post_init__(self) -> None:
        for name in _DECAY_FIELDS:
            value = getattr(self, name)
            if isinstance(value, (list, tuple)) or (
                    hasattr(value, "shape") and len(getattr(value, "shape", ())) == 1):
                try:
                    value = tuple(float(x) for x in value)
                except (TypeError, ValueError):
                    raise self._fail(name, value, "must be a sequence of numbers") from None
                object.__setattr__(self, name, value)
            else:
                raise self._fail(name, value, "must be a non-empty sequence of decays")
        super().__post_init__()

    def _check_combinations(self) -> None:
        super()._check_combinations()
        for name in _DECAY_FIELDS:
            value = getattr(self, name)
            if not value:
                raise self._fail(name, value, "must hold at least one decay")
            for d in value:
                if d not in _DECAY_RANGE:
                    raise self._fail(name, value, f"every decay must be in {_DECAY_RANGE}")
        km, kr, kf = (len(getattr(self, n)) for n in _DECAY_FIELDS)
        if kr not in (1, km):
            raise self._fail("initial_rms_decays", self.initial_rms_decays,
                             f"needs 1 or {km} decays (len(initial_momentum_decays)): the "
                             "feature m·rsqrt(rms) broadcasts them")
        if not (km == kf or 1 in (km, kf)):
            raise self._fail("initial_adafactor_decays", self.initial_adafactor_decays,
                             f"needs 1 or {km} decays (len(initial_momentum_decays)): the "
                             "feature m·row_factor·col_factor broadcasts them")


PRESETS: dict[str, dict[str, Any]] = {
    # adafac_mlp_lopt.py, AdafacMLPLOpt.__init__ defaults.
    "original": dict(exp_mult=0.001, step_mult=0.001, hidden_size=4, hidden_layers=2,
                     initial_momentum_decays=(0.9, 0.99, 0.999), initial_rms_decays=(0.999,),
                     initial_adafactor_decays=(0.9, 0.99, 0.999)),
}

#: the time-feature timescales (adafac_mlp_lopt.py, ``tanh_embedding``)
TIMESCALES = (1, 3, 10, 30, 100, 300, 1000, 3000, 10000, 30000, 100000)
NUM_TIME_FEATURES = len(TIMESCALES)


def num_decays(hp: SmallFCLOpt) -> tuple[int, int, int]:
    """How many momentum, rms and adafactor decays ``hp`` has: ``(km, kr, kf)``."""
    return (len(hp.initial_momentum_decays), len(hp.initial_rms_decays),
            len(hp.initial_adafactor_decays))


def num_param_features(hp: SmallFCLOpt) -> int:
    """Per-parameter features before the time features (28 with the default decays)."""
    km, kr, kf = num_decays(hp)
    return 2 + km + kr + max(km, kr) + kr + kf + 4 * kf + max(km, kf)


def num_inputs(hp: SmallFCLOpt) -> int:
    """Width of the MLP's input: per-parameter plus time features (39 by default)."""
    return num_param_features(hp) + NUM_TIME_FEATURES


# -- meta-parameters -------------------------------------------------------------------------


def meta_shapes(hp: SmallFCLOpt) -> dict[str, tuple[int, ...]]:
    """``{xopt name: shape}`` of θ: the MLP ``mlp/w{i}`` ``(in, out)`` and ``mlp/b{i}``
    ``(out,)`` for ``i = 0 … hidden_layers`` (outputs ``hidden_size``, …, 2), then the
    decay offsets ``decays/momentum``, ``decays/rms``, ``decays/adafactor``."""
    shapes: dict[str, tuple[int, ...]] = {}
    last = num_inputs(hp)
    for i, width in enumerate([int(hp.hidden_size)] * int(hp.hidden_layers) + [2]):
        shapes[f"mlp/w{i}"] = (last, width)
        shapes[f"mlp/b{i}"] = (width,)
        last = width
    km, kr, kf = num_decays(hp)
    shapes["decays/momentum"] = (km,)
    shapes["decays/rms"] = (kr,)
    shapes["decays/adafactor"] = (kf,)
    return shapes


def original_names(hp: SmallFCLOpt) -> dict[str, str]:
    """``{xopt name: original name}`` (haiku's ``nn/~/w0``; the decay offsets' own keys)."""
    out = {}
    for k in meta_shapes(hp):
        if k.startswith("mlp/"):
            out[k] = "nn/~/" + k[len("mlp/"):]
        else:
            out[k] = k[len("decays/"):] + "_decays"
    return out


def meta_from_original(theta: Mapping[str, Any], hp: SmallFCLOpt) -> dict[str, Any]:
    """θ keyed as the original (``nn/~/w0``, ``momentum_decays``, …) → xopt's names; strict
    (:class:`xopt.errors.MetaParamsError` names a missing, extra or misshaped key)."""
    names = original_names(hp)
    shapes = {names[k]: s for k, s in meta_shapes(hp).items()}
    return lopt.rename_meta(theta, {v: k for k, v in names.items()}, shapes,
                             "small_fc_lopt meta-parameters (original naming)")


def meta_to_original(theta: Mapping[str, Any], hp: SmallFCLOpt) -> dict[str, Any]:
    """θ keyed as xopt → the original's names; strict."""
    return lopt.rename_meta(theta, original_names(hp), meta_shapes(hp),
                             "small_fc_lopt meta-parameters")


def coerce_meta(theta: Mapping[str, Any], hp: SmallFCLOpt) -> dict[str, Any]:
    """θ in either naming (detected from the keys) → xopt's names; strict. Values are
    passed through as given (any array type)."""
    return lopt.coerce_meta_namings(theta, meta_shapes(hp), original_names(hp),
                                     "small_fc_lopt meta-parameters")


def meta_init(hp: SmallFCLOpt, seed: int = 0, *, backend: str = "numpy") -> dict[str, Any]:
    """Fresh θ: weights ``w{i}`` truncated-normal (±2σ) with σ = 1/sqrt(fan_in) drawn from
    ``xopt.random`` with seed ``fold_in(seed, i)`` (as haiku's ``TruncatedNormal`` in
    distribution, not in bits), zero biases, zero decay offsets (the decays start at their
    initial values). float32; the same bits for ``backend`` numpy, torch and jax."""
    from xopt import random as xr

    out: dict[str, Any] = {}
    for k, shape in meta_shapes(hp).items():
        if k.startswith("mlp/w"):
            i = int(k[len("mlp/w"):])
            out[k] = lopt.truncated_normal(xr.fold_in(int(seed), i), shape,
                                            1.0 / np.sqrt(shape[0]), backend=backend)
        else:
            out[k] = lopt.zeros(backend, shape)
    return out


#: θ's names, shapes and conversions, as the harness reads them (``SPEC.meta``)
META = MetaParams(shapes=meta_shapes, from_original=meta_from_original,
                  to_original=meta_to_original, init=meta_init, coerce=coerce_meta)


# -- the math: one tensor -------------------------------------------------------------------


def _const(xp: ModuleType, values: Any, like: Any) -> Any:
    """``values`` as an array of ``like``'s dtype (and device, under torch)."""
    return arrays.constant(xp, values, like)


def decays(hp: SmallFCLOpt, meta: Mapping[str, Any], *, xp: ModuleType) -> tuple[Any, Any, Any]:
    """The effective decays ``(momentum (km,), rms (kr,), adafactor (kf,))``:
    ``1 − exp(10·(log(1 − d₀)/10 + θ))`` (the original's
    ``param_to_decay(decay_to_param(jnp.asarray(initial)) + theta[...])``).

    Always evaluated in float32, as the original does (its initial decays are a float32
    array), and then cast to the dtype of θ's arrays. This matters to the float64 oracle:
    a decay near 1 rounded to float32 moves ``1 − d`` by up to 1e-4 relative (float32
    0.999 is 1 − 0.000999987), so decays taken in float64 would not describe the original.
    """
    out = []
    for field, key in zip(_DECAY_FIELDS, ("decays/momentum", "decays/rms", "decays/adafactor"),
                          strict=True):
        like = meta[key]
        offset = _cast(xp, like, "float32")
        initial = _const(xp, getattr(hp, field), offset)
        # lopt.effective_decays's operations, with arrays' exp/log (see there: NumPy's own
        # float32 exp is an ulp off XLA's and torch's on muLO's decays)
        param = arrays.log(xp, 1 - initial) / lopt.REPARAM + offset
        d = 1 - arrays.exp(xp, param * lopt.REPARAM)
        out.append(_cast(xp, d, like.dtype))
    return out[0], out[1], out[2]


def _cast(xp: ModuleType, x: Any, dtype: Any) -> Any:
    """``x`` in ``dtype`` (a dtype object or the name ``"float32"``), any namespace."""
    if arrays.is_torch(xp):
        return x.to(getattr(xp, dtype) if isinstance(dtype, str) else dtype)
    return xp.asarray(x).astype(dtype)


def time_features(xp: ModuleType, iteration: Any, like: Any) -> Any:
    """``tanh(t/τ − 1)`` for the 11 timescales τ, shape ``(11,)``, ``like``'s dtype.

    ``iteration`` (t, an integer scalar) is converted to the float dtype and divided by
    each τ (the original's ``tanh_embedding``: an int32 divided by a float32 τ)."""
    ts = _const(xp, [float(t) for t in TIMESCALES], like)
    if arrays.is_torch(xp):
        t = xp.as_tensor(iteration).to(dtype=like.dtype, device=like.device)
    else:
        t = xp.asarray(iteration).astype(like.dtype)
    return xp.tanh(t / ts - 1.0)


def accumulate(xp: ModuleType, g: Any, m: Any, rms: Any, v_row: Any, v_col: Any, v_diag: Any,
               decays_: tuple[Any, Any, Any]) -> tuple[Any, Any, Any, Any, Any, Any]:
    """The three accumulators' updates (common.py's ``vec_rolling_mom``, ``vec_rolling_rms``,
    ``vec_factored_rolling``): ``(m, rms, v_row, v_col, v_diag, fac_g)``, all new arrays;
    shapes as :data:`STATE`, ``fac_g`` ``S + (kf,)``."""
    mom_d, rms_d, fac_d = decays_
    m = lopt.momentum_update(m, g, mom_d)
    rms = lopt.rms_update(xp, rms, g, rms_d)
    v_row, v_col, v_diag, fac_g = lopt.factored_update(xp, v_row, v_col, v_diag, g, fac_d)
    return m, rms, v_row, v_col, v_diag, fac_g


def param_features(xp: ModuleType, p: Any, g: Any, m: Any, rms: Any, fac_g: Any, v_row: Any,
                   v_col: Any, v_diag: Any) -> Any:
    """The raw (unnormalized) per-parameter features, ``S' + (F,)`` with F = 28 by default
    and ``S' = S``, or ``(1,)`` for a 0-d parameter (the original reshapes it; all inputs
    are then given a leading axis of 1). Inputs are the *updated* accumulators; order and
    arithmetic are ``AdafacMLPLOpt._mod``'s (see the module docstring)."""
    if len(p.shape) == 0:
        p, g, m, rms, fac_g, v_row, v_col, v_diag = (
            arrays.expand_dims(xp, x, 0) for x in (p, g, m, rms, fac_g, v_row, v_col, v_diag))
    r = arrays.rsqrt(xp, rms + 1e-6)
    parts = [g[..., None], p[..., None], m, rms, m * r, r, fac_g]
    f = lopt.factored_dims(tuple(g.shape))
    if f is not None:
        d1, d0 = f
        full = tuple(g.shape) + (v_row.shape[-1],)
        row = arrays.expand_dims(xp, v_row, d0)
        col = arrays.expand_dims(xp, v_col, d1)
        parts += [xp.broadcast_to(row, full), xp.broadcast_to(col, full),
                  xp.broadcast_to(arrays.rsqrt(xp, row + 1e-8), full),
                  xp.broadcast_to(arrays.rsqrt(xp, col + 1e-8), full)]
        reduced_d1 = d1 - 1 if d1 > d0 else d1
        row_col_mean = arrays.mean(xp, v_row, (reduced_d1,), keepdims=True)
        row_factor = lopt.safe_rsqrt(xp, v_row / (row_col_mean + 1e-9))
        col_factor = lopt.safe_rsqrt(xp, v_col)
        parts.append(m * arrays.expand_dims(xp, row_factor, d0)
                     * arrays.expand_dims(xp, col_factor, d1))
    else:
        rv = arrays.rsqrt(xp, v_diag + 1e-8)
        parts += [v_diag, v_diag, rv, rv, m * (v_diag + 1e-6) ** -0.5]
    full = tuple(g.shape)
    parts = [x if tuple(x.shape[:-1]) == full else xp.broadcast_to(x, full + (x.shape[-1],))
             for x in parts]
    return arrays.concat(xp, parts, axis=-1)


def mlp(xp: ModuleType, x: Any, meta: Mapping[str, Any], hp: SmallFCLOpt) -> tuple[Any, Any]:
    """The MLP on ``x`` (``S' + (39,)``): ``x ← relu(x @ w_i + b_i)``, no ReLU after the last
    layer; returns ``(direction, magnitude)``, each ``S'``."""
    n = int(hp.hidden_layers) + 1
    for i in range(n):
        x = arrays.matmul(xp, x, meta[f"mlp/w{i}"]) + meta[f"mlp/b{i}"]
        if i != n - 1:
            x = arrays.relu(xp, x)
    return x[..., 0], x[..., 1]


def compute_step(hp: SmallFCLOpt, p: Any, g: Any, m: Any, rms: Any, v_row: Any, v_col: Any,
                 v_diag: Any, time_feat: Any, meta: Mapping[str, Any],
                 decays_: tuple[Any, Any, Any], *, xp: ModuleType, return_aux: bool = False):
    """One tensor's learned step and accumulators.

    Args:
      p, g: parameter and gradient, shape ``S`` (rank 0-4), the working float dtype
        (float32 in the backends, float64 in the oracle).
      m, rms, v_row, v_col, v_diag: the accumulators before the update (:data:`STATE`).
      time_feat: :func:`time_features` of the inner iteration, ``(11,)``.
      meta: θ in xopt's naming, arrays of the working dtype; decays_: :func:`decays`.
      xp: the namespace of the arrays.

    Returns:
      ``(step, (m, rms, v_row, v_col, v_diag))`` with ``step`` of shape ``S``, to be applied
      as ``p − lr·step``; with ``return_aux``, a third element ``{"direction", "magnitude"}``
      (shape ``S``) and ``"feature_sq_mean"`` (``(F,)``: the normalizer's statistic).
    """
    m, rms, v_row, v_col, v_diag, fac_g = accumulate(xp, g, m, rms, v_row, v_col, v_diag,
                                                     decays_)
    x = param_features(xp, p, g, m, rms, fac_g, v_row, v_col, v_diag)
    axes = tuple(range(len(x.shape) - 1))
    normed = lopt.second_moment_normalizer(xp, x, axes)
    lead = tuple(x.shape[:-1])
    inputs = arrays.concat(xp, [normed, xp.broadcast_to(time_feat, lead + (time_feat.shape[-1],))],
                        axis=-1)
    direction, magnitude = mlp(xp, inputs, meta, hp)
    step = direction * arrays.exp(xp, magnitude * hp.exp_mult) * hp.step_mult
    step = xp.reshape(step, tuple(p.shape))
    accs = (m, rms, v_row, v_col, v_diag)
    if not return_aux:
        return step, accs
    aux = {"direction": xp.reshape(direction, tuple(p.shape)),
           "magnitude": xp.reshape(magnitude, tuple(p.shape)),
           "feature_sq_mean": arrays.mean(xp, xp.square(x), axes)}
    return step, accs, aux


def update_tensor(hp: SmallFCLOpt, p: Any, g: Any, m: Any, rms: Any, v_row: Any, v_col: Any,
                  v_diag: Any, iteration: Any, meta: Mapping[str, Any], *, xp: ModuleType,
                  lr: Any = 1.0):
    """One tensor's whole update: ``(p − lr·step, m, rms, v_row, v_col, v_diag)``.

    ``iteration``: the inner iteration t before this update; ``meta``: θ (xopt naming) as
    arrays of ``p``'s dtype. lr = 1 gives the original's ``p − step`` bit for bit.
    """
    step, accs = compute_step(hp, p, g, m, rms, v_row, v_col, v_diag,
                              time_features(xp, iteration, p), meta, decays(hp, meta, xp=xp),
                              xp=xp)
    return (p - lr * step, *accs)


# -- the whole optimizer as a pure function (the oracle's definition) ----------------------

#: the per-parameter accumulators, in :func:`compute_step`'s argument order
PARAM_VARS = ("m", "rms", "v_row", "v_col", "v_diag")


def param_state_shapes(hp: SmallFCLOpt, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Shapes of one parameter's accumulators (with the original's ``(0, k)``
    placeholders)."""
    km, kr, kf = num_decays(hp)
    shape = tuple(int(s) for s in shape)
    return {"m": shape + (km,), "rms": shape + (kr,), **lopt.factored_shapes(shape, kf)}


def _float_dtype(p: Any, dtype: Any) -> Any:
    if dtype is not None:
        return dtype
    return np.promote_types(np.asarray(p).dtype, np.float32)


def init_state(hp: SmallFCLOpt, params: Mapping[str, Any], *, xp: ModuleType = np,
               dtype: Any = None, meta: Any = None) -> dict[str, Any]:
    """Canonical state before the first step (NumPy arrays; ``xp`` is accepted for symmetry
    and must be NumPy). Accumulators are zeros of ``dtype`` (default: the parameter's dtype
    promoted to at least float32); ``iteration`` 0, ``num_steps`` the inner horizon,
    ``mom_t``/``rms_t`` zeros; when accumulating also ``grad_accum/<p>``, ``loss_accum``,
    ``accum_iteration``. ``meta`` is not needed (accepted for the harness's symmetry)."""
    del meta
    n = hp.inner_num_steps  # raises, naming num_training_steps, if unset
    km, kr, _ = num_decays(hp)
    state: dict[str, Any] = {
        "iteration": np.int32(0), "num_steps": np.int32(n),
        "mom_t": np.zeros((km,), np.int32), "rms_t": np.zeros((kr,), np.int32),
    }
    for name, p in params.items():
        dt = _float_dtype(p, dtype)
        for var, shape in param_state_shapes(hp, np.shape(p)).items():
            state[f"{var}/{name}"] = np.zeros(shape, dt)
        if hp.accumulating:
            state[f"grad_accum/{name}"] = np.zeros(np.shape(p), dt)
    if hp.accumulating:
        state["loss_accum"] = np.float32(0.0)
        state["accum_iteration"] = np.int64(0)
    return state


def _as_xp(xp: ModuleType, x: Any, dtype: Any) -> Any:
    if arrays.is_torch(xp):
        return xp.as_tensor(x).to(dtype)
    return xp.asarray(x, dtype=dtype)


def step(hp: SmallFCLOpt, params: Mapping[str, Any], state: Mapping[str, Any],
         grads: Mapping[str, Any], *, xp: ModuleType = np, loss: Any = None,
         meta: Mapping[str, Any] | None = None, aux: dict[str, Any] | None = None,
         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """All parameters' update, ``(params, state) -> (params, state)``, pure, on canonical
    dicts (:data:`STATE`), with prefab's weight decay and accumulation
    (:func:`xopt.specs.lopt.outer_step`). ``meta``: θ in either naming; None uses
    ``meta_init(hp, 0)``. The working dtype is the accumulators' (float64 in the oracle).
    A missing ``loss`` counts as 0 (the learned optimizer does not read it). ``aux``, if
    given, receives the golden traces' internals: ``direction/<p>``, ``magnitude/<p>``
    and ``feature_sq_mean`` (n_tensors, 28)."""
    theta = coerce_meta(meta if meta is not None else meta_init(hp, 0), hp)
    names = list(params)
    dtype = state[f"m/{names[0]}"].dtype if names else np.float32
    theta = {k: _as_xp(xp, v, dtype) for k, v in theta.items()}
    decays_ = decays(hp, theta, xp=xp)

    def inner(g: dict[str, Any], loss_: Any, st: dict[str, Any]):
        tf = time_features(xp, st["iteration"], theta["mlp/b0"])
        steps = {}
        sq_means = []
        for k in names:
            p = _as_xp(xp, params[k], dtype)
            s, accs, *t_aux = compute_step(hp, p, g[k], *(st[f"{v}/{k}"] for v in PARAM_VARS),
                                           tf, theta, decays_, xp=xp,
                                           return_aux=aux is not None)
            for v, a in zip(PARAM_VARS, accs, strict=True):
                st[f"{v}/{k}"] = a
            steps[k] = s
            if aux is not None:
                aux[f"direction/{k}"] = t_aux[0]["direction"]
                aux[f"magnitude/{k}"] = t_aux[0]["magnitude"]
                sq_means.append(t_aux[0]["feature_sq_mean"])
        if aux is not None and sq_means:
            aux["feature_sq_mean"] = xp.stack(sq_means)
        st["mom_t"] = st["mom_t"] + 1
        st["rms_t"] = st["rms_t"] + 1
        return steps, st

    return lopt.outer_step(hp, params, state, grads, xp=xp, loss=loss, inner=inner)


# -- state schema --------------------------------------------------------------------------


def _acc_shape(var: str):
    def rule(shape: tuple[int, ...], h: SmallFCLOpt) -> tuple[int, ...]:
        return param_state_shapes(h, shape)[var]

    return rule


def _accumulating(h: SmallFCLOpt) -> bool:
    return h.accumulating


STATE = StateSchema(
    vars=(
        StateVar("m", "param", _acc_shape("m"), "state", "momenta, one per decay: S + (km,)"),
        StateVar("rms", "param", _acc_shape("rms"), "state", "second moments: S + (kr,)"),
        StateVar("v_row", "param", _acc_shape("v_row"), "state",
                 "factored second moment, rows (rank ≥ 2; else a (0, kf) placeholder)"),
        StateVar("v_col", "param", _acc_shape("v_col"), "state",
                 "factored second moment, columns (rank ≥ 2; else a (0, kf) placeholder)"),
        StateVar("v_diag", "param", _acc_shape("v_diag"), "state",
                 "unfactored second moment S + (kf,) (rank < 2; else a (0, kf) placeholder)"),
        StateVar("grad_accum", "param", same_as_param, "float32",
                 "sum of the gradients since the last inner update (accumulating only)",
                 active=_accumulating),
        StateVar("iteration", "global", scalar, "int32", "inner updates taken, t"),
        StateVar("num_steps", "global", scalar, "int32", "inner horizon n // num_average"),
        StateVar("mom_t", "global", lambda s, h: (num_decays(h)[0],), "int32",
                 "momentum accumulator's update count, one per decay"),
        StateVar("rms_t", "global", lambda s, h: (num_decays(h)[1],), "int32",
                 "second-moment accumulator's update count, one per decay"),
        StateVar("loss_accum", "global", scalar, "float32",
                 "sum of the losses since the last inner update (accumulating only)",
                 active=_accumulating),
        StateVar("accum_iteration", "global", scalar, "int64",
                 "calls taken (the accumulator's iteration; accumulating only)",
                 active=_accumulating),
    ),
    namings={
        # xopt.torch.SmallFCLOpt: optimizer.state[p][var], globals in state["global"].
        "xopt.torch": Naming(
            keys={"m": "{param}/m", "rms": "{param}/rms", "v_row": "{param}/v_row",
                  "v_col": "{param}/v_col", "v_diag": "{param}/v_diag",
                  "grad_accum": "{param}/grad_accum",
                  "iteration": "global/iteration", "num_steps": "global/num_steps",
                  "mom_t": "global/mom_t", "rms_t": "global/rms_t",
                  "loss_accum": "global/loss_accum",
                  "accum_iteration": "global/accum_iteration"},
            dtypes={"m": "float32", "rms": "float32", "v_row": "float32", "v_col": "float32",
                    "v_diag": "float32", "grad_accum": "float32", "iteration": "int32",
                    "num_steps": "int32", "mom_t": "int32", "rms_t": "int32",
                    "loss_accum": "float32", "accum_iteration": "int64"},
            doc="xopt.torch.SmallFCLOpt: optimizer.state[param][var] and "
                "optimizer.state['global'][var]",
        ),
        # xopt.jax.small_fc_lopt: LOptState(iteration, num_steps, inner=SmallFCState(...),
        # accum=AccumState(grad_accum, loss_accum, iteration) | None).
        "xopt.jax": Naming(
            keys={"m": "inner/m/{param}", "rms": "inner/rms/{param}",
                  "v_row": "inner/v_row/{param}", "v_col": "inner/v_col/{param}",
                  "v_diag": "inner/v_diag/{param}", "mom_t": "inner/mom_t",
                  "rms_t": "inner/rms_t", "iteration": "iteration", "num_steps": "num_steps",
                  "grad_accum": "accum/grad_accum/{param}", "loss_accum": "accum/loss_accum",
                  "accum_iteration": "accum/iteration"},
            dtypes={"iteration": "int32", "num_steps": "int32", "mom_t": "int32",
                    "rms_t": "int32", "accum_iteration": "int32", "loss_accum": "float32"},
            doc="xopt.jax.small_fc_lopt's LOptState flattened with "
                "xopt.parity.runners.flatten_with_paths",
        ),
    },
)


SPEC = MethodSpec(
    name="small_fc_lopt",
    title="small_fc_lopt: learned_optimization's AdafacMLPLOpt (per-parameter MLP learned "
          "optimizer with Adafactor features)",
    hyperparams=SmallFCLOpt,
    presets=PRESETS,
    state=STATE,
    init_state=init_state,
    step=step,
    naming_of={"torch": "xopt.torch", "jax": "xopt.jax"},
    takes_loss=True,
    impls=("plain", "triton"),
    meta=META,
)
