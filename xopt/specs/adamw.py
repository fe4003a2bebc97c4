"""AdamW (Loshchilov & Hutter, 2019): the baseline every xopt method is measured against.

Two libraries implement the same mathematics with different floating-point arithmetic and
defaults; xopt expresses both, as the ``formula`` option and two presets:

=====================  ===================================  ====================================
                       ``"torch"`` (torch.optim.AdamW)      ``"optax"`` (optax.adamw)
=====================  ===================================  ====================================
defaults               lr 1e-3, weight_decay 1e-2           learning_rate required, wd 1e-4
1 − βᵗ                 in double precision                  in float32 (``bias_correction_dtype``)
eps                    added to √v̂ (no ``eps_root``)        added to √(v̂ + eps_root)
weight decay meets lr  θ ← θ·(1 − ηλ) *before* the step     u ← (m̂/(√v̂+ε) + λθ);  θ ← θ − η·u
bias correction        step size η/(1−β₁ᵗ), √v/√(1−β₂ᵗ)     m/(1−β₁ᵗ), v/(1−β₂ᵗ)
first moment           lerp(m, g, 1−β₁)                     (1−β₁)·g + β₁·m
step counter           float32 tensor per parameter         one int32 ``count``
extras                 amsgrad, maximize                    nesterov (NAdamW), eps_root
=====================  ===================================  ====================================

In exact arithmetic both compute, at step t (1-based), for every parameter θ with gradient g
(paper Algorithm 2, with the learning rate η multiplying the decay as both libraries do)::

    m_t = β₁ m_{t-1} + (1 − β₁) g                      v_t = β₂ v_{t-1} + (1 − β₂) g²
    m̂_t = m_t / (1 − β₁ᵗ)                              v̂_t = v_t / (1 − β₂ᵗ)
    θ_t = θ_{t-1} − η (m̂_t / (√(v̂_t + ε_root) + ε) + λ θ_{t-1})

They round differently, by a few float32 ulps a step. Under ``formula="torch"`` the
functions below perform torch.optim's operations in torch.optim's order (torch/optim/adam.py,
``_single_tensor_adam``, the non-capturable branch), and under ``formula="optax"`` optax's
(optax/_src/transform.py ``scale_by_adam``, optax/transforms/_adding.py
``add_decayed_weights``, ``scale_by_learning_rate``, ``apply_updates``). Under NumPy float64
they are the oracle. Under torch they reproduce torch.optim.AdamW bit for bit on the CPU
(``xopt.torch.AdamW`` calls them per tensor). Under jax.numpy the same operations reproduce
optax.adamw bit for bit only when evaluated as optax evaluates them: inside ``jit``, with
one bias-correction scalar shared by all leaves (XLA rewrites a division by a scalar used
once into a multiplication by its reciprocal); ``xopt.jax.adamw`` arranges that. Both
claims are tested against the live libraries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from xopt.errors import HyperparameterError
from xopt.specs import arrays
from xopt.specs._hyperparams import NONNEGATIVE, UNIT_HALF_OPEN, Hyperparams, hp
from xopt.specs._method import MethodSpec
from xopt.specs._state import Naming, StateSchema, StateVar, same_as_param, scalar

# -- hyperparameters -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AdamW(Hyperparams):
    """AdamW hyperparameters. Defaults are torch.optim.AdamW's (torch/optim/adamw.py)."""

    METHOD = "adamw"

    lr: float = hp(1e-3, doc="learning rate η", interval=NONNEGATIVE)
    b1: float = hp(0.9, doc="first-moment decay β₁", interval=UNIT_HALF_OPEN)
    b2: float = hp(0.999, doc="second-moment decay β₂", interval=UNIT_HALF_OPEN)
    eps: float = hp(1e-8, doc="ε added to √v̂", interval=NONNEGATIVE)
    eps_root: float = hp(0.0, doc="ε_root added to v̂ inside the square root", interval=NONNEGATIVE)
    weight_decay: float = hp(1e-2, doc="decoupled weight decay λ (multiplied by η)",
                             interval=NONNEGATIVE)
    amsgrad: bool = hp(False, doc="normalise by the running maximum of the second moment")
    maximize: bool = hp(False, doc="ascend instead of descend (negate the gradient)")
    nesterov: bool = hp(False, doc="Nesterov momentum (optax's NAdamW); formula 'optax' only")
    formula: str = hp("torch", doc="floating-point evaluation order", choices=("torch", "optax"))
    bias_correction_dtype: str = hp(
        "float64", doc="precision of 1 − βᵗ: torch.optim's double or optax's float32",
        choices=("float64", "float32"))

    def _check_combinations(self) -> None:
        if self.nesterov and self.formula != "optax":
            raise HyperparameterError(
                f"AdamW.nesterov = True needs formula='optax' (got formula={self.formula!r}): "
                "torch.optim.AdamW has no Nesterov variant, so there is no torch arithmetic "
                "to follow"
            )


PRESETS: dict[str, dict[str, Any]] = {
    # torch/optim/adamw.py: AdamW.__init__ defaults.
    "torch": dict(formula="torch", bias_correction_dtype="float64", lr=1e-3, b1=0.9, b2=0.999,
                  eps=1e-8, eps_root=0.0, weight_decay=1e-2),
    # optax/_src/alias.py: adamw's defaults. optax has no default learning rate; xopt uses
    # torch's 1e-3 so that the preset alone is a complete specification.
    "optax": dict(formula="optax", bias_correction_dtype="float32", lr=1e-3, b1=0.9, b2=0.999,
                  eps=1e-8, eps_root=0.0, weight_decay=1e-4),
}


# -- the math: one tensor ------------------------------------------------------------------


def _sqrt(x: Any) -> Any:
    return arrays.namespace(x).sqrt(x)


def _maximum(a: Any, b: Any) -> Any:
    return arrays.namespace(a).maximum(a, b)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating))


def bias_correction(beta: Any, count: Any, dtype: str, xp: Any) -> Any:
    """``1 − βᵗ`` in the precision the convention prescribes.

    ``dtype="float64"`` (torch.optim): the double-precision value. With Python numbers this
    is Python's float arithmetic, as in torch.optim's non-capturable step. With an array
    count (jax under ``jit``) it is evaluated as ``−expm1(t·log1p(−(1−β)))`` in the array's
    float dtype, which avoids the cancellation of ``1 − βᵗ`` and stays within a few ulp of
    the double value.

    ``dtype="float32"`` (optax): β rounded to float32, βᵗ in float32, ``1 − βᵗ`` in
    float32, as optax's ``tree_bias_correction`` computes it. For β close to 1 and small t
    this loses digits (against the double value: 2.0e-5 relative for β = 0.999, 2.2e-4 for
    β = 0.9999, at t = 2; ``tools/bias_correction_error.py``): that is optax's arithmetic,
    reproduced, not an error of xopt's. NumPy (the oracle) rounds the exact
    power to float32; torch and XLA use their float32 ``pow``, within an ulp of it.
    """
    if dtype == "float64":
        if _is_number(beta) and _is_number(count):
            return 1 - beta**count
        t = count.astype(xp.float32) if hasattr(count, "astype") else count
        return -xp.expm1(t * xp.log1p(-(1 - beta)))
    if _is_number(count) and xp is np:
        power = np.float32(np.float64(np.float32(beta)) ** count)
        return np.float32(1) - power
    if _is_number(count) and arrays.is_torch(xp):
        b = xp.as_tensor(beta, dtype=xp.float32)
        return 1 - b ** xp.tensor(float(count), dtype=xp.float32)
    return 1 - beta**count  # optax's own expression (jax: float32 pow of an int32 count)


def _as_dtype_of(x: Any, like: Any) -> Any:
    """Cast an array scalar to ``like``'s dtype (optax divides in the moment's precision)."""
    return x.astype(like.dtype) if hasattr(x, "astype") and hasattr(like, "dtype") else x


def update_torch(p, g, m, v, v_max, count, *, lr, b1, b2, eps, eps_root, weight_decay,
                 amsgrad, maximize, xp, bias_correction_dtype="float64"):
    """One AdamW step of one tensor in torch.optim.AdamW's arithmetic.

    Args:
      p, g, m, v: parameter, gradient, first and second moment; one shape, float dtype.
      v_max: running maximum of ``v`` (``amsgrad``), else ``None``.
      count: the step number t ≥ 1 *after* this update's increment. A Python number gives
        torch's double-precision scalar arithmetic for the bias corrections.
      lr, b1, b2, eps, eps_root, weight_decay: floats (or 0-d arrays).
      xp: the array namespace of the arrays.
      bias_correction_dtype: see :func:`bias_correction`.

    Returns:
      ``(p, m, v, v_max)`` after the step; new arrays, inputs untouched.
    """
    if maximize:
        g = -g
    if not arrays.is_static_zero(weight_decay):
        p = p * (1 - lr * weight_decay)
    m = arrays.lerp(xp, m, g, 1 - b1)
    v = arrays.addcmul(xp, v * b2, g, g, 1 - b2)
    bc1 = bias_correction(b1, count, bias_correction_dtype, xp)
    bc2 = bias_correction(b2, count, bias_correction_dtype, xp)
    step_size = lr / bc1
    if amsgrad:
        v_max = xp.maximum(v_max, v)
    v_den = v_max if amsgrad else v
    if arrays.is_static_zero(eps_root):
        denom = xp.sqrt(v_den) / bc2**0.5 + eps
    else:
        denom = xp.sqrt(v_den / bc2 + eps_root) + eps
    p = arrays.addcdiv(xp, p, m, denom, -step_size)
    return p, m, v, v_max


def updates_optax(p, g, m, v, v_max, count, *, lr, b1, b2, eps, eps_root, weight_decay,
                  amsgrad, maximize, nesterov, xp, bias_correction_dtype="float32"):
    """One AdamW step of one tensor in optax.adamw's arithmetic, as an additive update.

    Same arguments as :func:`update_torch`, plus ``nesterov``. Returns ``(u, m, v, v_max)``
    where the new parameter is ``p + u`` (optax's ``apply_updates``). With ``amsgrad`` the
    running maximum is taken of the bias-corrected v̂, as ``optax.scale_by_amsgrad`` does.
    """
    def bc(beta, t):
        return _as_dtype_of(bias_correction(beta, t, bias_correction_dtype, xp), m)

    if maximize:
        g = -g
    m = (1 - b1) * g + b1 * m
    v = (1 - b2) * (g * g) + b2 * v
    if nesterov:
        m_hat = b1 * (m / bc(b1, count + 1)) + (1 - b1) * (g / bc(b1, count))
    else:
        m_hat = m / bc(b1, count)
    v_hat = v / bc(b2, count)
    if amsgrad:
        v_max = _maximum(v_max, v_hat)
        v_hat = v_max
    u = m_hat / (_sqrt(v_hat + eps_root) + eps)
    if not arrays.is_static_zero(weight_decay):
        u = u + weight_decay * p
    u = -lr * u
    return u, m, v, v_max


def update_optax(p, g, m, v, v_max, count, **kw):
    """:func:`updates_optax` applied: ``(p + u, m, v, v_max)``."""
    u, m, v, v_max = updates_optax(p, g, m, v, v_max, count, **kw)
    return p + u, m, v, v_max


def update(hp: AdamW, p, g, m, v, v_max, count, *, lr=None, xp=None):
    """One AdamW step of one tensor under ``hp.formula``; ``lr`` overrides ``hp.lr``."""
    xp = xp or arrays.namespace(p)
    kw = dict(lr=hp.lr if lr is None else lr, b1=hp.b1, b2=hp.b2, eps=hp.eps,
              eps_root=hp.eps_root, weight_decay=hp.weight_decay, amsgrad=hp.amsgrad,
              maximize=hp.maximize, xp=xp, bias_correction_dtype=hp.bias_correction_dtype)
    if hp.formula == "torch":
        return update_torch(p, g, m, v, v_max, count, **kw)
    return update_optax(p, g, m, v, v_max, count, nesterov=hp.nesterov, **kw)


# -- the whole optimizer as a pure function (the oracle's definition) ----------------------


def init_state(hp: AdamW, params: Mapping[str, Any], *, xp=np, dtype=None) -> dict[str, Any]:
    """Canonical state before the first step: ``step`` = 0, zero moments.

    Moments take ``dtype`` if given, else the parameter's dtype promoted to at least float32.
    """
    state: dict[str, Any] = {"step": np.int64(0)}
    for name, p in params.items():
        dt = dtype or np.promote_types(np.asarray(p).dtype, np.float32)
        state[f"m/{name}"] = xp.zeros(p.shape, dtype=dt)
        state[f"v/{name}"] = xp.zeros(p.shape, dtype=dt)
        if hp.amsgrad:
            state[f"v_max/{name}"] = xp.zeros(p.shape, dtype=dt)
    return state


def step(hp: AdamW, params: Mapping[str, Any], state: Mapping[str, Any],
         grads: Mapping[str, Any], *, xp=np, loss=None):
    """All parameters' AdamW step: ``(params, state) -> (params, state)``, pure.

    ``state`` is canonical (see :data:`STATE`); ``loss`` is accepted and unused.
    """
    del loss
    count = int(state["step"]) + 1
    new_params, new_state = {}, {"step": np.int64(count)}
    for name, p in params.items():
        v_max = state.get(f"v_max/{name}")
        p, m, v, v_max = update(hp, p, grads[name], state[f"m/{name}"], state[f"v/{name}"],
                                v_max, count, xp=xp)
        new_params[name] = p
        new_state[f"m/{name}"], new_state[f"v/{name}"] = m, v
        if hp.amsgrad:
            new_state[f"v_max/{name}"] = v_max
    return new_params, new_state


# -- state schema --------------------------------------------------------------------------

STATE = StateSchema(
    vars=(
        StateVar("step", "global", scalar, "int64", "number of updates taken, t"),
        StateVar("m", "param", same_as_param, "state", "first moment m_t (uncorrected)"),
        StateVar("v", "param", same_as_param, "state", "second moment v_t (uncorrected)"),
        StateVar("v_max", "param", same_as_param, "state",
                 "AMSGrad running maximum: of v_t under formula 'torch', of v̂_t under 'optax'",
                 active=lambda hp: hp.amsgrad),
    ),
    namings={
        # torch.optim.AdamW.state[p]; also xopt.torch.AdamW, so state dicts interchange.
        "torch.optim": Naming(
            keys={"step": "{param}/step", "m": "{param}/exp_avg", "v": "{param}/exp_avg_sq",
                  "v_max": "{param}/max_exp_avg_sq"},
            dtypes={"step": "float32"},
            doc="torch.optim.AdamW / xopt.torch.AdamW: optimizer.state[param][key]",
        ),
        # xopt.jax.adamw: one transformation whose state is AdamWState(count, mu, nu, nu_max).
        "xopt.jax": Naming(
            keys={"step": "count", "m": "mu/{param}", "v": "nu/{param}",
                  "v_max": "nu_max/{param}"},
            dtypes={"step": "int32"},
            doc="xopt.jax.adamw: AdamWState(count, mu, nu, nu_max)",
        ),
    },
)


SPEC = MethodSpec(
    name="adamw",
    title="AdamW (decoupled weight decay), torch.optim and optax conventions",
    hyperparams=AdamW,
    presets=PRESETS,
    state=STATE,
    init_state=init_state,
    step=step,
    naming_of={"torch": "torch.optim", "jax": "xopt.jax"},
)
