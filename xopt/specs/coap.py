"""COAP (Xiao et al., "COAP: Memory-Efficient Training with Correlation-Aware Gradient
Projection", CVPR 2025): low-rank projected AdamW / Adafactor whose projection moves by SGD.

Authors' code: bytedance/coap @ deabc3a (``coap_torch/optimizer/adamw.py``,
``coap_torch/optimizer/adafactor.py``, ``coap_torch/projection/coap_matrix.py``,
``coap_torch/utils/orthogonal.py``, ``coap_torch/utils/params.py``). xopt follows the code,
including what the paper leaves out (Eqn 6's gradient clipping and row-wise cosine, the
event schedule, the rules for projected parameters).

The method, for one projected matrix ``W`` (``m × n``) with gradient ``G`` at update
``t = 0, 1, ...`` (``t`` counts the updates taken before this one):

* **side** (``coap_matrix.py``, ``project``): *right* when ``m ≥ n``: ``P`` is ``r × n``,
  the low-rank gradient is ``R = G Pᵀ`` (``m × r``) and a low-rank ``N`` returns as
  ``N P``; *left* when ``m < n``: ``P`` is ``m × r``, ``R = Pᵀ G`` (``r × n``), back ``P N``.
* **projection events** (aux ``proj_event`` of the golden traces; ``T_u`` =
  ``update_interval``, ``λ`` = ``reproject_factor``), decided *before* the moments move:

  - ``t = 0`` → 1, *initial*: Eqn 7 with a random ``Ω`` (``min(m, n) × r``);
  - ``t % T_u == 0`` and ``t % (λ T_u) == 0`` → 3, *Eqn 7* warm-started with ``Ω = Pᵀ``
    (right) or ``Ω = P`` (left);
  - ``t % T_u == 0`` otherwise → 2, *Eqn 6*: one SGD step on ``P``;
  - otherwise → 0, ``P`` kept.

* **Eqn 7** (occasional low-cost SVD; ``orthogonal.py``): with ``A = G`` (right) or ``Gᵀ``
  (left), ``Q = QR_red(A Ω)``, ``U Σ Z = SVD(Qᵀ A)``, ``P = Z`` (right) or ``Zᵀ`` (left).
* **Eqn 6** (inter-projection correlation-aware update; ``coap_matrix.py`` ``update_proj``):
  ``P ← P − η_P · clip(∂L/∂P)`` with ``η_P = 0.1``, gradient-norm clipping at 1 (torch's
  ``clip_grad_norm_``: scaled by ``min(1, 1/(‖∂L/∂P‖ + 1e-6))``), and ::

      L(P) = MSE(Ĝ, G) · (1 − (1/m) Σ_i cos(X_i, G_i))
      Ĝ = G Pᵀ P,  X = M P  (right)        Ĝ = P Pᵀ G,  X = P M  (left)

  where ``M`` is the low-rank first moment *before* this update and ``cos`` runs over the
  rows of the ``m × n`` matrices (torch's ``cosine_similarity(dim=1)``; ``X`` is compared with
  ``G`` itself, as in the paper's appendix). :func:`eqn6_grad` is the gradient in closed
  form (derived in its docstring), checked against torch autograd's and the traces' aux
  ``eqn6_P_grad`` in ``tests/test_coap.py``.
* **moment restoration** (``restore_state``, at events 2 and 3): the moments are carried to
  the new subspace: ``M ← (M P_old) P_newᵀ`` and, for AdamW, ``V ← ((√V P_old) P_newᵀ)²``
  (right; ``P_newᵀ (P_old M)`` for left). The Adafactor variant restores only ``M``.

**AdamW** (the authors' transformers-style AdamW, :func:`xopt.specs.lowrank.hf_adam_moments`
and friends): ``m, v`` of ``R``; ``N = m/(√v + ε)``; ``W ← W − α·scale·back(N)`` with
``α = η √(1−β₂ᵗ)/(1−β₁ᵗ)``; then ``W ← W − ηλ W`` on the updated ``W``.

**Adafactor** (``adafactor.py``, transformers' Adafactor with ``relative_step=False`` by
default), see :func:`adafactor_direction`: ``lr_t = η · max(ε₂, RMS(W))``, a factored second
moment of ``R`` (rows and columns; unfactored for 1-D tensors) with
``β̂₂ₜ = 1 − t^decay_rate``, ``u = R/√v̂``, ``u ← u / max(1, RMS(u)/d)``, ``u ← lr_t u``,
``M ← β₁ M + (1−β₁) u`` (its first moment is an EMA of *updates*), ``W ← W − λ lr_t W``,
``W ← W − scale·back(M)``.

**Which parameters are projected** (``coap_torch/utils/params.py`` ``setup_params``, and
the per-parameter rank in ``AdamW.step``), in xopt's terms (:func:`is_projected`,
:func:`rank_of`), for a parameter of shape ``s`` whose group has ``project``:

* ``project=False``: never (the authors' groups without ``proj_method``).
* only matrices (``len(s) == 2``) are ever projected; vectors, scalars and tensors of other
  ranks take the base update unprojected. The authors project large 4-D convolution
  kernels with a Tucker-2 decomposition (``TuckerCOAP``); xopt does not implement it and
  steps them with the base update (a 4-D group in a trace is rejected by name).
* ``project="auto"`` (the default; the authors' rule): a matrix is projected unless
  ``rank`` is set and ``rank ≥ min(s)`` (then it takes the base update, the authors' "other"
  group). The rank is ``max(min(s) // rank_ratio, 1)`` when ``rank_ratio`` is set (it
  overrides ``rank``, as the authors' ``rank_ratio_matrix``), else ``rank``.
* ``project=True``: every matrix of the group is projected; a ``rank`` larger than
  ``min(s)`` is an error naming the parameter (xopt's check; the authors clamp it).

**Where the authors' code crashes, and what xopt does instead**

* Adafactor with its default ``beta1=None`` has no first moment, and the first Eqn-6 event
  reads ``state["exp_avg"]``: ``KeyError`` at update ``T_u``. xopt takes ``M`` in Eqn 6 to be
  the current gradient in the old subspace, ``M = R_old = G P_oldᵀ`` (right; ``P_oldᵀ G``
  left), so the direction term compares ``G`` with its own reconstruction ``G P_oldᵀ P``.
  It needs no extra memory (what ``beta1=None`` is for), and it is the quantity the
  authors' ``M`` averages (past low-rank gradients, preconditioned and scaled, which the
  row cosine compares by direction only), taken at the current update. With no first
  moment there is nothing to restore, so ``restore_state`` has no effect.
* ``rank=None`` and ``rank_ratio=None`` (both authors' defaults) fail in their code at the
  first step (``min(None, ...)``); xopt raises :class:`HyperparameterError` at construction.
* Adafactor with ``lr=None`` and ``relative_step=False`` (the authors' defaults) fails in
  ``_get_lr``; xopt's ``lr`` has a default (1e-3) and ``relative_step=True`` ignores it.

**Randomness.** The initial ``Ω`` is ``xopt.random.normal(seed, (min(m, n), r),
dtype="float32")`` (then cast to the state dtype): the same bits in NumPy, torch and jax.
Like the authors' code, which re-seeds a ``torch.Generator`` with 3407 for every matrix,
every parameter draws from its own group's ``seed`` (default 3407) at counter 0; give
groups (torch) or leaves (optax ``param_specs``) their own ``seed`` to decorrelate them.
To match a torch-recorded trace, the harness injects ``P`` itself at events 1 and 3
(:mod:`xopt.parity.methods.coap`; key ``"ortho_matrix"``), since QR/SVD signs and torch's
generator are not portable; Eqn 6 is always computed by xopt.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import numpy as np

from xopt.errors import HyperparameterError
from xopt.specs import arrays, lowrank
from xopt.specs._groups import ParamGroups, all_hps, hp_for
from xopt.specs._hyperparams import (
    NONNEGATIVE,
    POSITIVE,
    UNIT_HALF_OPEN,
    Hyperparams,
    Interval,
    hp,
)
from xopt.specs._method import MethodSpec
from xopt.specs._state import Naming, StateSchema, StateVar, scalar

# projection events (the golden traces' aux ``proj_event`` codes)
KEEP, INITIAL, EQN6, EQN7 = 0, 1, 2, 3
#: torch's ``cosine_similarity`` clamps each row norm from below by this (its ``eps``)
COS_EPS = 1e-8
#: torch's ``clip_grad_norm_`` adds this to the norm before dividing
CLIP_EPS = 1e-6

# -- hyperparameters -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class COAP(Hyperparams):
    """COAP hyperparameters: the base optimizer's, then the projection's.

    Defaults are the authors' ``CoapAdamW`` (coap_torch/optimizer/adamw.py ``__init__``);
    ``preset="adafactor"`` gives ``CoapAdafactor``'s. Fields marked (AdamW) or (Adafactor)
    are read by that variant only.
    """

    METHOD = "coap"

    optimizer: str = hp("adamw", doc="base optimizer: the authors' CoapAdamW or CoapAdafactor",
                        choices=("adamw", "adafactor"))
    lr: float = hp(1e-3, doc="learning rate η (Adafactor: ignored with relative_step)",
                   interval=NONNEGATIVE)
    b1: float | None = hp(0.9, doc="first-moment decay β₁; None (Adafactor only): no first "
                                   "moment", interval=UNIT_HALF_OPEN)
    b2: float = hp(0.999, doc="(AdamW) second-moment decay β₂", interval=UNIT_HALF_OPEN)
    eps: float = hp(1e-6, doc="(AdamW) ε added to the uncorrected √v", interval=NONNEGATIVE)
    weight_decay: float = hp(0.0, doc="decoupled weight decay λ (times η; Adafactor: times "
                                      "lr_t, before the step)", interval=NONNEGATIVE)
    correct_bias: bool = hp(True, doc="(AdamW) bias-correct the step size")
    eps_sq: float = hp(1e-30, doc="(Adafactor) ε₁ added to R² (the authors' eps[0])",
                       interval=NONNEGATIVE)
    eps_scale: float = hp(1e-3, doc="(Adafactor) ε₂, floor of RMS(W) in lr_t (eps[1])",
                          interval=NONNEGATIVE)
    clip_threshold: float = hp(1.0, doc="(Adafactor) update RMS clipping threshold d",
                               interval=POSITIVE)
    decay_rate: float = hp(-0.8, doc="(Adafactor) β̂₂ₜ = 1 − t^decay_rate",
                           interval=Interval(None, 0.0))
    scale_parameter: bool = hp(True, doc="(Adafactor) lr_t scaled by max(ε₂, RMS(W))")
    relative_step: bool = hp(False, doc="(Adafactor) lr_t from min(1e-2, 1/√t) instead of lr")
    warmup_init: bool = hp(False, doc="(Adafactor) relative step min(1e-6 t, 1/√t)")
    project: str | bool = hp("auto", doc="which matrices are projected: 'auto' (the authors' "
                                         "rule), True (all), False (none)",
                             choices=("auto", True, False))
    rank: int | None = hp(None, doc="rank r of the projection", interval=Interval(1, None))
    rank_ratio: float | None = hp(None, doc="r = max(min(m, n) // rank_ratio, 1); overrides "
                                            "rank (rank_ratio_matrix)",
                                  interval=Interval(1.0, None))
    update_interval: int = hp(32, doc="T_u: P moves (Eqn 6) every T_u updates",
                              interval=Interval(1, None))
    reproject_factor: int = hp(5, doc="λ: Eqn 7 instead of Eqn 6 every λ·T_u updates",
                               interval=Interval(1, None))
    restore_state: bool = hp(False, doc="carry the moments into the new subspace at events")
    scale: float = hp(1.0, doc="factor on the projected-back update", interval=NONNEGATIVE)
    proj_lr: float = hp(0.1, doc="η_P of the Eqn-6 SGD step (update_proj's lr)",
                        interval=NONNEGATIVE)
    proj_max_norm: float = hp(1.0, doc="gradient-norm clipping of the Eqn-6 step",
                              interval=POSITIVE)
    seed: int = hp(3407, doc="seed of the initial Ω (xopt.random)",
                   interval=Interval(0, 2**64 - 1))

    def _check_field(self, f: dataclasses.Field, value: Any) -> None:
        if f.name == "b1" and value is None:
            return
        super()._check_field(f, value)

    def _check_combinations(self) -> None:
        name = type(self).__name__
        if not (isinstance(self.project, bool) or (isinstance(self.project, str)
                                                   and self.project == "auto")):
            raise HyperparameterError(f"{name}.project = {self.project!r}: must be one of "
                                      "'auto', True, False")
        if self.rank is not None and (isinstance(self.rank, bool)
                                      or not isinstance(self.rank, (int, np.integer))):
            raise HyperparameterError(f"{name}.rank = {self.rank!r}: must be an int or None")
        for field in ("update_interval", "reproject_factor"):
            lowrank.check_interval(getattr(self, field), field, name)
        if self.project is not False and self.rank is None and self.rank_ratio is None:
            raise HyperparameterError(
                f"{name}.rank = None and {name}.rank_ratio = None: set one of them (or "
                "project=False); the authors' code has no default and fails at the first step")
        if self.b1 is None and self.optimizer == "adamw":
            raise HyperparameterError(f"{name}.b1 = None: only the Adafactor variant runs "
                                      "without a first moment")


PRESETS: dict[str, dict[str, Any]] = {
    # coap_torch/optimizer/adamw.py AdamW.__init__ (rank and rank_ratio have no default).
    "adamw": dict(optimizer="adamw", lr=1e-3, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.0,
                  correct_bias=True, update_interval=32, reproject_factor=5,
                  restore_state=False, scale=1.0),
    # coap_torch/optimizer/adafactor.py Adafactor.__init__. Its lr=None fails with
    # relative_step=False (its default) at the first step; xopt keeps lr = 1e-3 here.
    # beta1=None is kept: xopt runs it (see the module docstring).
    "adafactor": dict(optimizer="adafactor", lr=1e-3, b1=None, eps_sq=1e-30, eps_scale=1e-3,
                      clip_threshold=1.0, decay_rate=-0.8, weight_decay=0.0,
                      scale_parameter=True, relative_step=False, warmup_init=False,
                      update_interval=32, reproject_factor=5, restore_state=False, scale=1.0),
}


# -- which parameters, which rank, which side ---------------------------------------------------


def is_projected(shape: tuple[int, ...], hp: COAP) -> bool:
    """Whether a parameter of ``shape`` is projected under its group's ``hp`` (module
    docstring, "Which parameters are projected")."""
    if hp.project is False or len(shape) != 2:
        return False
    if hp.project is True:
        return True
    return hp.rank is None or hp.rank < min(shape)


def rank_of(shape: tuple[int, ...], hp: COAP) -> int:
    """The projection rank of a projected matrix (``rank_ratio`` first, as the authors)."""
    if hp.rank_ratio is not None:
        return max(int(min(shape) // hp.rank_ratio), 1)
    return int(hp.rank)


def check_param(shape: tuple[int, ...], hp: COAP, where: str) -> None:
    """Raise :class:`HyperparameterError` naming ``where`` for a rank the matrix cannot hold
    (only reachable with ``project=True``; ``"auto"`` leaves such a matrix unprojected)."""
    if is_projected(shape, hp):
        lowrank.check_rank(rank_of(shape, hp), tuple(shape), where)


def side_of(shape: tuple[int, ...]) -> str:
    """``"right"`` when ``m ≥ n`` else ``"left"`` (``COAPAdamProjector.project``)."""
    return "right" if shape[0] >= shape[1] else "left"


def low_rank_shape(shape: tuple[int, ...], hp: COAP) -> tuple[int, ...]:
    """Shape of the projected gradient and the moments: ``(m, r)`` right, ``(r, n)`` left;
    the parameter's own shape when it is not projected."""
    shape = tuple(shape)
    if not is_projected(shape, hp):
        return shape
    r = rank_of(shape, hp)
    return (shape[0], r) if side_of(shape) == "right" else (r, shape[1])


def proj_shape(shape: tuple[int, ...], hp: COAP) -> tuple[int, ...]:
    """Shape of ``P``: ``(r, n)`` right, ``(m, r)`` left (the authors' ``ortho_matrix``)."""
    r = rank_of(shape, hp)
    return (r, shape[1]) if side_of(shape) == "right" else (shape[0], r)


def omega_shape(shape: tuple[int, ...], hp: COAP) -> tuple[int, int]:
    """Shape of Ω: ``(columns of A, r)`` = ``(min(m, n), r)``."""
    return (min(shape), rank_of(shape, hp))


def event(t: int, hp: COAP) -> int:
    """The projection event of update ``t`` (0-based: updates taken before this one)."""
    if t == 0:
        return INITIAL
    if t % hp.update_interval != 0:
        return KEEP
    return EQN7 if t % (hp.update_interval * hp.reproject_factor) == 0 else EQN6


def has_first_moment(hp: COAP) -> bool:
    return hp.b1 is not None


# -- the projection ----------------------------------------------------------------------------


def _mm(xp: ModuleType, a: Any, b: Any) -> Any:
    return arrays.matmul(xp, a, b)


def _sum(xp: ModuleType, x: Any, axis: int | None = None) -> Any:
    if arrays.is_torch(xp):
        return x.sum() if axis is None else x.sum(dim=axis)
    return xp.sum(x, axis=axis)


def project(xp: ModuleType, g: Any, p: Any, side: str) -> Any:
    """``R = G Pᵀ`` (right) or ``Pᵀ G`` (left)."""
    return _mm(xp, g, p.T) if side == "right" else _mm(xp, p.T, g)


def restore(xp: ModuleType, n: Any, p: Any, side: str) -> Any:
    """A low-rank ``N`` in full shape: ``N P`` (right) or ``P N`` (left)."""
    return _mm(xp, n, p) if side == "right" else _mm(xp, p, n)


def project_back(xp: ModuleType, n: Any, p: Any, side: str, scale: float) -> Any:
    """``scale · restore(N)`` (``MatrixCOAP.project_back``)."""
    return restore(xp, n, p, side) * scale


def initial_omega(hp: COAP, shape: tuple[int, ...], *, backend: str = "numpy",
                  device: Any = None) -> Any:
    """Ω of the initial decomposition: ``xopt.random.normal(hp.seed, (min(m, n), r))``,
    float32, identical bits in every backend (cast it to the working dtype)."""
    from xopt import random

    kw = {"device": device} if backend == "torch" else {}
    return random.normal(int(hp.seed), omega_shape(shape, hp), dtype="float32",
                         backend=backend, **kw)


def warm_omega(p: Any, side: str) -> Any:
    """Ω of an Eqn-7 event: the previous ``P`` as columns, ``Pᵀ`` (right) or ``P`` (left)."""
    return p.T if side == "right" else p


def orthogonal_basis(xp: ModuleType, a: Any, omega: Any, *,
                     qr: Callable[[Any], tuple[Any, Any]] | None = None,
                     svd: Callable[[Any], tuple[Any, Any, Any]] | None = None) -> Any:
    """Eqn 7 (``compute_orthogonal``): ``Q = QR_red(A Ω)``, ``U Σ Z = SVD(Qᵀ A)``; returns ``Z``.

    Args:
      a: ``(k, n')`` float (``A = G`` right, ``Gᵀ`` left); omega: ``(n', r)``.
      qr, svd: the decompositions (default: :func:`xopt.specs.lowrank.qr` / ``svd``, with
        xopt's sign convention; backends pass versions that raise naming the parameter).
    Returns:
      ``Z`` ``(r, n')`` with orthonormal rows.
    """
    qr = qr or (lambda x: lowrank.qr(xp, x))
    svd = svd or (lambda x: lowrank.svd(xp, x))
    q, _ = qr(_mm(xp, a, omega))
    _, _, z = svd(_mm(xp, q.T, a))
    return z


def decompose(xp: ModuleType, g: Any, omega: Any, side: str, **kw: Any) -> Any:
    """New ``P`` from Eqn 7: ``Z`` of ``A = G`` (right), ``Zᵀ`` of ``A = Gᵀ`` (left)."""
    if side == "right":
        return orthogonal_basis(xp, g, omega, **kw)
    return orthogonal_basis(xp, g.T, omega, **kw).T


def eqn6_grad(xp: ModuleType, p: Any, m: Any, g: Any, side: str) -> tuple[Any, Any, Any]:
    """``∂L/∂P`` of Eqn 6 in closed form, with ``L``'s two factors.

    Args:
      p: ``P``, ``(r, n)`` right / ``(m, r)`` left; m: the low-rank moment ``M``, ``(m, r)``
        right / ``(r, n)`` left; g: ``G``, ``(m, n)``; all one float dtype.
    Returns:
      ``(∂L/∂P, mse, cos)``: the gradient (shape of ``P``), ``MSE(Ĝ, G)`` (0-d) and the
      row cosines ``cos(X_i, G_i)`` (``(m,)``).

    Derivation (``E = Ĝ − G``, ``C = (1/m) Σ_i cos_i``, ``L = mse · (1 − C)``, so
    ``∂L = (1 − C) ∂mse − mse ∂C``):

    * right, ``Ĝ = G A`` with ``A = PᵀP``: ``∂mse/∂A = (2/mn) GᵀE =: S`` and for
      ``f(PᵀP)``, ``∂f/∂P = P (S + Sᵀ)``, so ``∂mse/∂P = (2/mn)((G Pᵀ)ᵀ E + (E Pᵀ)ᵀ G)``;
      left, ``Ĝ = A G`` with ``A = P Pᵀ``: ``∂mse/∂P = (2/mn)(E (Pᵀ G)ᵀ + G (Pᵀ E)ᵀ)``.
    * ``cos_i = ⟨x_i, g_i⟩ / (c_x c_g)`` with ``c = max(‖·‖, 1e-8)`` (torch clamps the norms
      without recording the clamp), so ``∂cos_i/∂x_i = g_i/(c_x c_g) − ⟨x_i, g_i⟩ x_i /
      (c_x² c_g ‖x_i‖)`` (second term 0 where ``x_i = 0``, as torch's norm backward);
      ``D = ∂C/∂X`` stacks these rows over ``m``; ``X = M P`` gives ``∂C/∂P = Mᵀ D``
      (right) and ``X = P M`` gives ``D Mᵀ`` (left).
    """
    rows, cols = g.shape
    if side == "right":
        gpt = _mm(xp, g, p.T)                     # (m, r)
        e = _mm(xp, gpt, p) - g
        x = _mm(xp, m, p)
    else:
        ptg = _mm(xp, p.T, g)                     # (r, n)
        e = _mm(xp, p, ptg) - g
        x = _mm(xp, p, m)
    mse = _sum(xp, e * e) / (rows * cols)
    nx = xp.sqrt(_sum(xp, x * x, 1))
    ng = xp.sqrt(_sum(xp, g * g, 1))
    cx = xp.maximum(nx, xp.full_like(nx, COS_EPS))
    cg = xp.maximum(ng, xp.full_like(ng, COS_EPS))
    s = _sum(xp, x * g, 1)
    cos = s / (cx * cg)
    c = _sum(xp, cos) / rows
    inv_nx = xp.where(nx > 0, 1.0 / xp.where(nx > 0, nx, xp.ones_like(nx)), xp.zeros_like(nx))
    d = (g / (cx * cg)[:, None] - (s * inv_nx / (cx * cx * cg))[:, None] * x) / rows
    if side == "right":
        dmse = (_mm(xp, gpt.T, e) + _mm(xp, _mm(xp, e, p.T).T, g)) * (2.0 / (rows * cols))
        dc = _mm(xp, m.T, d)
    else:
        dmse = (_mm(xp, e, ptg.T) + _mm(xp, g, _mm(xp, p.T, e).T)) * (2.0 / (rows * cols))
        dc = _mm(xp, d, m.T)
    return dmse * (1.0 - c) - dc * mse, mse, cos


def eqn6_step(xp: ModuleType, p: Any, m: Any, g: Any, side: str, lr: float, max_norm: float,
              aux: dict[str, Any] | None = None) -> Any:
    """One clipped SGD step on Eqn 6: ``P − lr · min(1, max_norm/(‖∇‖ + 1e-6)) · ∇``.

    ``aux`` (a dict, optional) receives ``eqn6_mse``, ``eqn6_cos``, ``eqn6_P_grad``,
    ``eqn6_P_grad_norm`` and ``eqn6_P_grad_clipped``, as the golden traces name them.
    """
    grad, mse, cos = eqn6_grad(xp, p, m, g, side)
    norm = xp.sqrt(_sum(xp, grad * grad))
    coef = max_norm / (norm + CLIP_EPS)
    coef = xp.minimum(coef, xp.ones_like(coef))
    clipped = grad * coef
    if aux is not None:
        aux.update(eqn6_mse=mse, eqn6_cos=cos, eqn6_P_grad=grad, eqn6_P_grad_norm=norm,
                   eqn6_P_grad_clipped=clipped)
    return p - clipped * lr


def eqn6_moment(xp: ModuleType, hp: COAP, m: Any, g: Any, p_old: Any, side: str) -> Any:
    """The ``M`` of Eqn 6: the first moment, or, without one (Adafactor ``b1=None``, where the
    authors' code raises KeyError), the gradient in the old subspace ``project(G, P_old)``."""
    return m if has_first_moment(hp) else project(xp, g, p_old, side)


def restore_moments(xp: ModuleType, hp: COAP, m: Any, v: Any, p_old: Any, p_new: Any,
                    side: str) -> tuple[Any, Any]:
    """``restore_state``: the moments carried from ``P_old``'s subspace to ``P_new``'s.

    ``M ← project(restore(M, P_old), P_new)``; AdamW also
    ``V ← project(restore(√V, P_old), P_new)²``. ``m``/``v`` may be None (absent).
    """
    if m is not None:
        m = project(xp, restore(xp, m, p_old, side), p_new, side)
    if v is not None and hp.optimizer == "adamw":
        v = project(xp, restore(xp, xp.sqrt(v), p_old, side), p_new, side) ** 2
    return m, v


def injected_projection(inject: Mapping[str, Any] | None) -> Any:
    """The ``P`` given in ``inject`` (``{"ortho_matrix": P}``), or None."""
    return None if inject is None else inject.get("ortho_matrix")


# -- the base optimizers -------------------------------------------------------------------------


def rms(xp: ModuleType, x: Any) -> Any:
    """``‖x‖₂ / √numel`` (Adafactor's ``_rms``)."""
    numel = math.prod(x.shape) if len(x.shape) else 1
    return xp.sqrt(_sum(xp, x * x)) / math.sqrt(numel)


def adafactor_lr(hp: COAP, t: Any, param_rms: Any, xp: ModuleType = np) -> Any:
    """``lr_t`` at 1-based step ``t`` (``_get_lr``): ``ρ · max(ε₂, RMS(W))`` (or ``ρ``
    without ``scale_parameter``), ``ρ = η``, or ``min(1e-2 or 1e-6 t, 1/√t)`` with
    ``relative_step``."""
    if hp.relative_step:
        tf = t if isinstance(t, (int, np.integer)) else t.astype(param_rms.dtype)
        inv_sqrt = (1.0 / math.sqrt(t)) if isinstance(t, (int, np.integer)) else \
            1.0 / xp.sqrt(tf)
        min_step = 1e-6 * tf if hp.warmup_init else 1e-2
        rho = min(min_step, inv_sqrt) if isinstance(t, (int, np.integer)) else \
            xp.minimum(min_step, inv_sqrt)
    else:
        rho = hp.lr
    if not hp.scale_parameter:
        return rho
    return xp.maximum(param_rms, xp.full_like(param_rms, hp.eps_scale)) * rho


def adafactor_beta2(hp: COAP, t: Any, xp: ModuleType = np, dtype: Any = None) -> Any:
    """``β̂₂ₜ = 1 − t^decay_rate`` (double precision for a Python int ``t``)."""
    if isinstance(t, (int, np.integer)):
        return 1.0 - math.pow(int(t), hp.decay_rate)
    return 1.0 - xp.power(t.astype(dtype), hp.decay_rate)


def adafactor_direction(xp: ModuleType, hp: COAP, r: Any, v: Any, v_row: Any, v_col: Any,
                        beta2t: Any) -> tuple[Any, Any, Any, Any]:
    """Adafactor's normalised, clipped direction of ``R`` and the new second moments.

    Args:
      r: the (projected) gradient; ``v`` (``R``'s shape) for tensors of fewer than 2 dims,
        else ``v_row`` (``R.shape[:-1]``) and ``v_col`` (``R.shape[:-2] + R.shape[-1:]``).
    Returns:
      ``(u, v, v_row, v_col)`` with ``u = (R/√v̂) / max(1, RMS(·)/d)``, where ``v̂`` is
      ``v`` or the factored ``(v_row/mean(v_row)) ⊗ v_col``.
    """
    sq = r * r + hp.eps_sq
    if len(r.shape) >= 2:
        v_row = v_row * beta2t + arrays.mean(xp, sq, (-1,)) * (1.0 - beta2t)
        v_col = v_col * beta2t + arrays.mean(xp, sq, (-2,)) * (1.0 - beta2t)
        r_factor = arrays.rsqrt(xp, v_row / arrays.mean(xp, v_row, (-1,), keepdims=True))
        c_factor = arrays.rsqrt(xp, v_col)
        u = arrays.expand_dims(xp, r_factor, -1) * arrays.expand_dims(xp, c_factor, -2) * r
    else:
        v = v * beta2t + sq * (1.0 - beta2t)
        u = arrays.rsqrt(xp, v) * r
    denom = rms(xp, u) / hp.clip_threshold
    u = u / xp.maximum(denom, xp.ones_like(denom))
    return u, v, v_row, v_col


# -- one parameter, one update (the oracle; xopt.torch runs it with xp=torch) -------------------


def param_step(xp: ModuleType, hp: COAP, p: Any, g: Any, st: dict[str, Any], t: int, *,
               inject: Mapping[str, Any] | None = None, aux: dict[str, Any] | None = None,
               omega: Callable[[], Any] | None = None,
               qr: Callable[[Any], tuple[Any, Any]] | None = None,
               svd: Callable[[Any], tuple[Any, Any, Any]] | None = None,
               ) -> tuple[Any, dict[str, Any]]:
    """One COAP update of one parameter, in the authors' order of operations.

    Args:
      p, g: parameter and gradient, one shape, the working float dtype.
      st: this parameter's state by canonical variable (``m``, ``v``, ``v_row``, ``v_col``,
        ``rms``, ``P``; those that exist for it, see :data:`STATE`).
      t: updates taken before this one (a Python int).
      inject: ``{"ortho_matrix": P}``: at an event that decomposes (1, 3), the new ``P``
        to use instead of computing it (an original's recorded projection).
      aux: receives internals by the traces' aux names (without the parameter prefix).
      omega: draws the initial Ω (default :func:`initial_omega` under NumPy).
      qr, svd: decompositions for Eqn 7 (see :func:`orthogonal_basis`).
    Returns:
      ``(new p, new st)``.
    """
    shape = tuple(p.shape)
    st = dict(st)
    projected = is_projected(shape, hp)
    r = g
    if projected:
        side = side_of(shape)
        p_old = st["P"]
        ev = event(t, hp)
        if ev == EQN6:
            sub = {} if aux is not None else None
            m6 = eqn6_moment(xp, hp, st.get("m"), g, p_old, side)
            p_new = eqn6_step(xp, p_old, m6, g, side, hp.proj_lr, hp.proj_max_norm, sub)
            if aux is not None:
                aux.update(sub)
        else:  # Eqn 7 at events 1 and 3 (or the original's P, injected); else P is kept

            def eqn7() -> Any:
                if ev == INITIAL:
                    om = omega() if omega is not None else xp.asarray(
                        initial_omega(hp, shape), dtype=g.dtype)
                else:
                    om = warm_omega(p_old, side)
                return decompose(xp, g, om, side, qr=qr, svd=svd)

            p_new = lowrank.refresh(ev in (INITIAL, EQN7), p_old, eqn7,
                                    injected_projection(inject))
        if ev in (EQN6, EQN7) and hp.restore_state:
            st["m"], v = restore_moments(xp, hp, st.get("m"), st.get("v"), p_old, p_new, side)
            if hp.optimizer == "adamw":
                st["v"] = v
            if aux is not None:
                if st.get("m") is not None:
                    aux["restored_exp_avg"] = st["m"]
                if hp.optimizer == "adamw":
                    aux["restored_exp_avg_sq"] = st["v"]
        st["P"] = p_new
        r = project(xp, g, p_new, side)
        if aux is not None:
            aux["proj_event"] = np.int8(ev)
            aux["low_rank_grad"] = r
    count = t + 1
    if hp.optimizer == "adamw":
        st["m"], st["v"] = lowrank.hf_adam_moments(xp, st["m"], st["v"], r, hp.b1, hp.b2)
        n = lowrank.hf_adam_direction(xp, st["m"], st["v"], hp.eps)
        step_size = lowrank.hf_step_size(hp.lr, hp.b1, hp.b2, count, hp.correct_bias)
        full = project_back(xp, n, st["P"], side, hp.scale) if projected else n
        if aux is not None and projected:
            aux["update_full"] = full
        return lowrank.hf_apply(p, full, step_size, hp.lr, hp.weight_decay), st
    st["rms"] = rms(xp, p)
    lr_t = adafactor_lr(hp, count, st["rms"], xp)
    beta2t = adafactor_beta2(hp, count)
    u, st["v"], st["v_row"], st["v_col"] = adafactor_direction(
        xp, hp, r, st.get("v"), st.get("v_row"), st.get("v_col"), beta2t)
    u = u * lr_t
    if has_first_moment(hp):
        st["m"] = st["m"] * hp.b1 + u * (1.0 - hp.b1)
        u = st["m"]
    full = project_back(xp, u, st["P"], side, hp.scale) if projected else u
    if aux is not None and projected:
        aux["update_full"] = full
    if hp.weight_decay != 0:
        p = p + p * (-hp.weight_decay * lr_t)
    return p - full, {k: v for k, v in st.items() if v is not None}


# -- the whole optimizer as a pure function (the oracle's definition) ---------------------------


def _state_of(state: Mapping[str, Any], name: str) -> dict[str, Any]:
    out = {}
    for var in ("m", "v", "v_row", "v_col", "rms", "P"):
        key = f"{var}/{name}"
        if key in state:
            out[var] = state[key]
    return out


def init_state(hp: COAP | ParamGroups, params: Mapping[str, Any], *, xp: ModuleType = np,
               dtype: Any = None) -> dict[str, Any]:
    """Canonical state before the first update: ``step`` 0, zero moments, ``P`` zero (it is
    computed at update 0), ``rms`` 0. ``dtype``: of the float state (default: the
    parameter's, at least float32)."""
    state: dict[str, Any] = {"step": np.int64(0)}
    for name, p in params.items():
        shape = tuple(np.shape(p))
        h = hp_for(hp, name)
        check_param(shape, h, f"COAP: {name}")
        dt = dtype or np.promote_types(np.asarray(p).dtype, np.float32)
        for v in STATE.vars:
            if v.scope == "param" and v.exists_for(shape, h):
                state[f"{v.name}/{name}"] = xp.zeros(v.shape(shape, h), dtype=dt)
    return state


def step(hp: COAP | ParamGroups, params: Mapping[str, Any], state: Mapping[str, Any],
         grads: Mapping[str, Any], *, xp: ModuleType = np, loss: Any = None,
         inject: Mapping[str, Mapping[str, Any]] | None = None,
         aux: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every parameter's COAP update: ``(params, state) -> (params, state)``, pure.

    ``inject``: ``{param name: {"ortho_matrix": P}}`` (see :func:`param_step`); ``aux``
    receives ``"<param>/<internal>"`` entries named as the golden traces' aux; ``loss`` is
    unused.
    """
    del loss
    inject = inject or {}
    t = int(state["step"])
    new_params: dict[str, Any] = {}
    new_state: dict[str, Any] = {"step": np.int64(t + 1)}
    for name, p in params.items():
        h = hp_for(hp, name)
        check_param(tuple(np.shape(p)), h, f"COAP: {name}")
        sub = {} if aux is not None else None
        new_params[name], st = param_step(xp, h, p, grads[name], _state_of(state, name), t,
                                          inject=inject.get(name), aux=sub)
        for var, value in st.items():
            new_state[f"{var}/{name}"] = value
        if aux is not None:
            aux.update({f"{name}/{k}": v for k, v in sub.items()})
    return new_params, new_state


# -- state schema --------------------------------------------------------------------------------


def _moment_shape(shape: tuple[int, ...], hp: COAP) -> tuple[int, ...]:
    return low_rank_shape(shape, hp)


def _row_shape(shape: tuple[int, ...], hp: COAP) -> tuple[int, ...]:
    return low_rank_shape(shape, hp)[:-1]


def _col_shape(shape: tuple[int, ...], hp: COAP) -> tuple[int, ...]:
    s = low_rank_shape(shape, hp)
    return s[:-2] + s[-1:]


def _any(pred: Callable[[COAP], bool]) -> Callable[[Any], bool]:
    return lambda hp: any(pred(h) for h in all_hps(hp))


STATE = StateSchema(
    vars=(
        StateVar("step", "global", scalar, "int64", "updates taken, t (the authors keep one "
                 "per parameter; all agree)"),
        StateVar("m", "param", _moment_shape, "state",
                 "first moment M (low-rank shape when projected); Adafactor: an EMA of the "
                 "lr-scaled clipped updates",
                 active=_any(has_first_moment), applies=lambda s, hp: has_first_moment(hp)),
        StateVar("v", "param", _moment_shape, "state",
                 "second moment: AdamW's v (uncorrected); Adafactor's unfactored v of tensors "
                 "of fewer than 2 dims",
                 applies=lambda s, hp: hp.optimizer == "adamw" or len(s) < 2),
        StateVar("v_row", "param", _row_shape, "state",
                 "(Adafactor) factored second moment, row statistics of R² + ε₁",
                 active=_any(lambda h: h.optimizer == "adafactor"),
                 applies=lambda s, hp: hp.optimizer == "adafactor" and len(s) >= 2),
        StateVar("v_col", "param", _col_shape, "state",
                 "(Adafactor) factored second moment, column statistics",
                 active=_any(lambda h: h.optimizer == "adafactor"),
                 applies=lambda s, hp: hp.optimizer == "adafactor" and len(s) >= 2),
        StateVar("rms", "param", scalar, "state",
                 "(Adafactor) RMS of the parameter before the last update (lr_t's scale)",
                 active=_any(lambda h: h.optimizer == "adafactor"),
                 applies=lambda s, hp: hp.optimizer == "adafactor"),
        StateVar("P", "param", proj_shape, "state",
                 "projection P: (r, n) right, (m, r) left; orthonormal after Eqn 7, not "
                 "re-orthonormalised after Eqn 6",
                 applies=is_projected),
    ),
    namings={
        "xopt.torch": Naming(
            keys={"step": "{param}/step", "m": "{param}/exp_avg", "v": "{param}/exp_avg_sq",
                  "v_row": "{param}/exp_avg_sq_row", "v_col": "{param}/exp_avg_sq_col",
                  "rms": "{param}/RMS", "P": "{param}/ortho_matrix"},
            dtypes={"step": "int64"},
            doc="xopt.torch.COAP: optimizer.state[param][key] (tensors only)",
        ),
        "xopt.jax": Naming(
            keys={"step": "count", "m": "mu/{param}", "v": "nu/{param}",
                  "v_row": "nu_row/{param}", "v_col": "nu_col/{param}", "rms": "rms/{param}",
                  "P": "proj/{param}"},
            dtypes={"step": "int32"},
            doc="xopt.jax.coap: COAPState(count, mu, nu, nu_row, nu_col, rms, proj)",
        ),
    },
)


SPEC = MethodSpec(
    name="coap",
    title="COAP: low-rank AdamW/Adafactor with a correlation-aware projection (Eqn 6/7)",
    hyperparams=COAP,
    presets=PRESETS,
    state=STATE,
    init_state=init_state,
    step=step,
    naming_of={"torch": "xopt.torch", "jax": "xopt.jax"},
)
