"""GaLore (Zhao et al., 2024, arXiv 2403.03507): Adam on a low-rank projection of each gradient.

For a matrix parameter ``W`` (``m × n``) with gradient ``G``, every ``T`` updates
(``update_proj_gap``) the projection is refreshed from the SVD of the current gradient,
``G = U S Vᵀ`` (paper, Algorithm 2 "Adam with GaLore"), and in between it is kept::

    R = Pᵀ G  (left, P = U[:, :r], m × r)        R = G Qᵀ  (right, Q = Vᵀ[:r, :], r × n)
    R = Pᵀ G Qᵀ  (full: both)
    m ← β₁ m + (1 − β₁) R                         v ← β₂ v + (1 − β₂) R²
    N = Adam's direction from (m, v)              (the moments live in R's shape)
    W ← W − η_t · α · back(N)                     back: P N, N Q, or P N Q;  α = ``scale``

``proj_type`` picks the side, as the authors' ``GaLoreProjector`` does (galore_torch/
galore_projector.py): ``"std"`` right when ``m ≥ n`` (the low-rank gradient is
``m × r``), left otherwise; ``"reverse_std"`` the opposite (left when ``m ≥ n``: ``r × n``,
the smaller state); ``"left"``, ``"right"`` and ``"full"`` as named. The
moments are carried across refreshes unrotated, as in the paper and both codes.

Two conventions for everything around the projection (``convention``, and the presets of
the same names):

==================  ====================================  =================================
                    ``"authors"`` (galore_torch)          ``"optax"`` (optax.contrib)
==================  ====================================  =================================
side                ``proj_type`` (default ``"std"``)     left when m ≥ n (``reverse_std``)
right projection    stored as Vᵀ[:r, :] (r × n)           n × r (xopt keeps r × n in both)
ε                   on the *uncorrected* √v, 1e-6          on √(v̂ + ε_root), 1e-8
bias correction     step size η√(1−β₂ᵗ)/(1−β₁ᵗ), double   m/(1−β₁ᵗ), v/(1−β₂ᵗ), float32
weight decay        W ← W − ηλW *after* the step          u ← α·back(N) + λW; W ← W − η u
==================  ====================================  =================================

(optax's ``scale_by_adam`` base with ``add_decayed_weights`` and ``scale_by_learning_rate``,
optax/contrib/_galore.py; the authors' AdamW is transformers' old ``AdamW``, see
:mod:`xopt.specs.lowrank`.) Tensors that are not matrices, and every tensor of a group with
``project=False`` (the authors' groups without ``"rank"``), take the same Adam step
without projection and without ``scale``.

**Where the authors' code crashes.** ``GaLoreProjector.project_back`` under
``"reverse_std"`` picks the side from the *low-rank* tensor's shape (``rows <= cols``:
left). For a wide matrix (``m < n``) with ``rank == m`` the low-rank gradient is ``m × m``,
so it multiplies from the left by the ``m × n`` projection meant for the right, and the
matmul fails on the first step. xopt decides the side once from the parameter's shape and
``proj_type`` (:func:`side`) for both directions; wherever the authors' code runs the two
rules agree, so nothing else changes. (``"std"`` cannot hit this: its low-rank shape always
names the side it came from.)

**Precision of bfloat16/float16 matrices** (``proj_dtype``). The authors' projector keeps
``P`` in the gradient's dtype (the SVD runs on the gradient cast to float32, its vectors
cast back) and multiplies there, both ways; their AdamW then keeps ``m``, ``v`` in that
dtype too (``zeros_like`` of the low-rank gradient) and adds the update to the parameter
there. ``proj_dtype="param"`` computes their sequence (:mod:`xopt.specs.lowrank`, "the
precision of the projections") with the moments in float32: a bfloat16 ``v`` cannot decay
(``v·0.999`` rounds back to ``v``: bfloat16 keeps 8 significant bits), so it is not
reproduced. ``"state"`` (the default) widens ``G`` and ``P`` to float32, multiplies there
and rounds the whole step into the parameter once. Float32 and float64 matrices take one
path under both.

**Departures, all outside what the authors' code does for float32 matrices:** the SVD runs
in the state's precision (the authors and optax cast a non-float32 gradient to float32 for
it and the projection back to the gradient's dtype); ``rank`` larger than the matrix
allows is an error naming the parameter (optax silently uses ``min(rank, m, n)``); tensors
that are not matrices are never projected (the authors' code fails on them in a projected
group); and
singular vectors get xopt's sign convention (:func:`xopt.specs.lowrank.svd`), where each
library keeps its LAPACK's signs. Since the moments carry across refreshes unrotated, signs
matter after the first refresh: the parity harness injects the original's projection at
each refresh (:mod:`xopt.parity.methods.galore`), as the traces' ``tolerance_hint``
recommends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from xopt.errors import HyperparameterError
from xopt.specs import arrays, lowrank
from xopt.specs._groups import ParamGroups, hp_for
from xopt.specs._hyperparams import NONNEGATIVE, UNIT_HALF_OPEN, Hyperparams, Interval, hp
from xopt.specs._method import MethodSpec
from xopt.specs._state import Naming, StateSchema, StateVar, scalar
from xopt.specs.adamw import bias_correction

PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")
_AT_LEAST_ONE = Interval(1, None)

# -- hyperparameters -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GaLore(Hyperparams):
    """GaLore hyperparameters. Defaults are the authors' (galore_torch/adamw.py ``AdamW``,
    galore_projector.py ``GaLoreProjector``; ``rank`` from torchrun_main.py's ``--rank``)."""

    METHOD = "galore"

    lr: float = hp(1e-3, doc="learning rate η", interval=NONNEGATIVE)
    b1: float = hp(0.9, doc="first-moment decay β₁", interval=UNIT_HALF_OPEN)
    b2: float = hp(0.999, doc="second-moment decay β₂", interval=UNIT_HALF_OPEN)
    eps: float = hp(1e-6, doc="ε: added to √v (authors) or √(v̂ + ε_root) (optax)",
                    interval=NONNEGATIVE)
    eps_root: float = hp(0.0, doc="ε_root inside the square root (convention 'optax' only)",
                         interval=NONNEGATIVE)
    weight_decay: float = hp(0.0, doc="decoupled weight decay λ (multiplied by η)",
                             interval=NONNEGATIVE)
    correct_bias: bool = hp(True, doc="Adam's bias correction (convention 'authors' may "
                                      "turn it off, as transformers' AdamW)")
    rank: int = hp(128, doc="rank r of the projection", interval=_AT_LEAST_ONE)
    update_proj_gap: int = hp(200, doc="refresh the projection by SVD every T updates",
                              interval=_AT_LEAST_ONE)
    scale: float = hp(1.0, doc="α: multiplies the projected-back update", interval=NONNEGATIVE)
    proj_type: str = hp("std", doc="which side to project", choices=PROJ_TYPES)
    # "state": what xopt computed before this field existed (checkpoints and golden traces
    # keep their meaning); float32 and float64 parameters compute the same under both
    proj_dtype: str = hp("state", doc="dtype of the projections of bfloat16/float16 matrices: "
                                      "'state' (float32) or 'param' (the parameter's, as "
                                      "the authors' GaLoreProjector)",
                         choices=lowrank.PROJ_DTYPES)
    project: bool = hp(True, doc="project this group's matrices (False: the base Adam step "
                                 "for every tensor, the authors' groups without 'rank')")
    convention: str = hp("authors", doc="Adam arithmetic, eps and weight decay: the authors' "
                                        "GaLoreAdamW or optax.contrib.galore",
                         choices=("authors", "optax"))

    def _check_combinations(self) -> None:
        for field in ("rank", "update_proj_gap"):
            lowrank.check_interval(getattr(self, field), field, "GaLore")
        if self.convention == "authors" and _is_number(self.eps_root) and self.eps_root != 0:
            raise HyperparameterError(
                f"GaLore.eps_root = {self.eps_root!r}: needs convention='optax' (the authors' "
                "AdamW has no eps_root)")
        if self.convention == "optax" and self.proj_dtype == "param":
            raise HyperparameterError(
                "GaLore.proj_dtype = 'param': needs convention='authors' (the parameter-dtype "
                "step is the authors' GaLoreAdamW's)")
        if self.convention == "optax" and not self.correct_bias:
            raise HyperparameterError(
                "GaLore.correct_bias = False: needs convention='authors' (optax's scale_by_adam "
                "always corrects the bias)")


PRESETS: dict[str, dict[str, Any]] = {
    # galore_torch/adamw.py AdamW.__init__ (lr 1e-3, eps 1e-6, weight_decay 0,
    # correct_bias); GaLoreProjector(update_proj_gap=200, scale=1.0, proj_type='std'); the
    # projector has no default rank: 128 is torchrun_main.py's and the README's.
    "authors": dict(convention="authors", lr=1e-3, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0,
                    weight_decay=0.0, correct_bias=True, rank=128, update_proj_gap=200,
                    scale=1.0, proj_type="std"),
    # optax.contrib.galore(learning_rate, rank=128, update_proj_gap=200, scale=1.0,
    # base_optimizer=scale_by_adam() [b1 0.9, b2 0.999, eps 1e-8, eps_root 0],
    # weight_decay=0.0): left when m >= n is the authors' "reverse_std". optax has no
    # default learning rate; xopt uses 1e-3 so that the preset is complete.
    "optax": dict(convention="optax", lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                  weight_decay=0.0, correct_bias=True, rank=128, update_proj_gap=200,
                  scale=1.0, proj_type="reverse_std"),
}


# -- which tensors, which side, which shapes -----------------------------------------------


def is_projected(shape: tuple[int, ...], h: GaLore) -> bool:
    """Whether a parameter of ``shape`` is projected under ``h``: matrices of groups with
    ``project=True``; every other tensor takes the plain Adam step."""
    return bool(h.project) and len(shape) == 2


def side(shape: tuple[int, ...], proj_type: str) -> str:
    """``"left"``, ``"right"`` or ``"full"`` for an ``(m, n)`` matrix, from ``proj_type``.

    ``std``: right when ``m >= n``, else left; ``reverse_std``: left when ``m >= n``, else
    right (galore_projector.py ``project``). The same side is used to project back (the
    authors' ``project_back`` re-derives it from the low-rank shape, which breaks for
    ``reverse_std`` with ``rank == m < n``; see the module docstring).
    """
    m, n = shape
    if proj_type == "std":
        return "right" if m >= n else "left"
    if proj_type == "reverse_std":
        return "left" if m >= n else "right"
    return proj_type


def low_rank_shape(shape: tuple[int, ...], h: GaLore) -> tuple[int, ...]:
    """Shape of the projected gradient R (and of the moments): ``(r, n)`` left, ``(m, r)``
    right, ``(r, r)`` full; ``shape`` itself when not projected."""
    if not is_projected(shape, h):
        return tuple(shape)
    m, n = shape
    s, r = side(shape, h.proj_type), h.rank
    return {"left": (r, n), "right": (m, r), "full": (r, r)}[s]


def ortho_shape(shape: tuple[int, ...], h: GaLore) -> tuple[int, ...]:
    """The stored projection (the authors' ``ortho_matrix``): ``U[:, :r]`` ``(m, r)`` for
    left and full, ``Vᵀ[:r, :]`` ``(r, n)`` for right."""
    m, n = shape
    return (h.rank, n) if side(shape, h.proj_type) == "right" else (m, h.rank)


def _has_ortho(shape: tuple[int, ...], h: GaLore) -> bool:
    return is_projected(shape, h)


def _has_ortho_right(shape: tuple[int, ...], h: GaLore) -> bool:
    return is_projected(shape, h) and h.proj_type == "full"


# -- the math: pure functions under NumPy, torch and jax.numpy -------------------------------


def projector_from_svd(u: Any, vh: Any, rank: int, which: str) -> tuple[Any, Any]:
    """``(ortho, ortho_right)`` from a (sign-normalised) SVD ``U``, ``Vᵀ``.

    left: ``(U[:, :r], None)``; right: ``(Vᵀ[:r, :], None)``; full: ``(U[:, :r], Vᵀ[:r, :])``
    (galore_projector.py ``get_orthogonal_matrix``).
    """
    if which == "left":
        return u[:, :rank], None
    if which == "right":
        return vh[:rank, :], None
    return u[:, :rank], vh[:rank, :]


def fresh_projection(xp: Any, h: GaLore, g: Any, *,
                     svd: Callable[[Any], tuple[Any, Any, Any]] | None = None,
                     ) -> tuple[Any, Any, Any]:
    """``(ortho, ortho_right, S)``: the projection of the SVD of ``g`` (an ``m × n``
    gradient) and its singular values. ``svd`` replaces :func:`xopt.specs.lowrank.svd`
    (the torch backend's names the parameter when it fails)."""
    u, s, vh = svd(g) if svd is not None else lowrank.svd(xp, g)
    return (*projector_from_svd(u, vh, h.rank, side(tuple(g.shape), h.proj_type)), s)


def injected_projection(inject: Mapping[str, Any] | None, ortho_right: Any, which: str,
                        cast: Callable[[Any], Any] = lambda a: a) -> tuple[Any, Any] | None:
    """``(ortho, ortho_right)`` given in ``inject`` (``{"ortho_matrix": P,
    "ortho_matrix_right": Q}``, each passed through ``cast``), or None when no ``P`` is;
    ``ortho_right`` stays as it is unless the side is ``"full"`` and ``Q`` is given."""
    if not inject or "ortho_matrix" not in inject:
        return None
    if which == "full" and "ortho_matrix_right" in inject:
        ortho_right = cast(inject["ortho_matrix_right"])
    return cast(inject["ortho_matrix"]), ortho_right


def project(xp: Any, g: Any, ortho: Any, ortho_right: Any, which: str) -> Any:
    """The low-rank gradient R: ``Pᵀ G`` (left), ``G Qᵀ`` (right), ``(Pᵀ G) Qᵀ`` (full)."""
    if which == "left":
        return arrays.matmul(xp, ortho.T, g)
    if which == "right":
        return arrays.matmul(xp, g, ortho.T)
    return arrays.matmul(xp, arrays.matmul(xp, ortho.T, g), ortho_right.T)


def project_back(xp: Any, n: Any, ortho: Any, ortho_right: Any, which: str, scale: Any) -> Any:
    """``α · back(N)``: ``P N`` (left), ``N Q`` (right), ``(P N) Q`` (full), times ``scale``
    (galore_projector.py ``project_back``; the side from :func:`side`, not from N's shape)."""
    if which == "left":
        full = arrays.matmul(xp, ortho, n)
    elif which == "right":
        full = arrays.matmul(xp, n, ortho)
    else:
        full = arrays.matmul(xp, arrays.matmul(xp, ortho, n), ortho_right)
    return lowrank.astype(full * scale, full.dtype)  # NumPy: bfloat16 · float is float32


def optax_moments(xp: Any, m: Any, v: Any, r: Any, b1: Any, b2: Any) -> tuple[Any, Any]:
    """optax's ``scale_by_adam`` moments: ``((1 − β₁) r + β₁ m, (1 − β₂) r² + β₂ v)``."""
    return (1 - b1) * r + b1 * m, (1 - b2) * (r * r) + b2 * v


def optax_direction(xp: Any, m: Any, v: Any, count: Any, b1: Any, b2: Any, eps: Any,
                    eps_root: Any) -> Any:
    """optax's ``scale_by_adam`` output ``m̂ / (√(v̂ + ε_root) + ε)``, with ``1 − βᵗ`` in
    float32 as optax computes it (:func:`xopt.specs.adamw.bias_correction`)."""
    bc1 = bias_correction(b1, count, "float32", xp)
    bc2 = bias_correction(b2, count, "float32", xp)
    if hasattr(bc1, "astype") and hasattr(m, "dtype"):
        bc1, bc2 = bc1.astype(m.dtype), bc2.astype(m.dtype)
    return (m / bc1) / (xp.sqrt(v / bc2 + eps_root) + eps)


def optax_updates(u: Any, p: Any, lr: Any, weight_decay: Any) -> Any:
    """``−η (u + λ p)``: ``add_decayed_weights`` then ``scale_by_learning_rate``; the new
    parameter is ``p + result`` (``optax.apply_updates``)."""
    if not arrays.is_static_zero(weight_decay):
        u = u + weight_decay * p
    return -lr * u


def direction(xp: Any, h: GaLore, g: Any, m: Any, v: Any, ortho: Any, ortho_right: Any,
              count: Any, *, aux: dict | None = None, name: str = "", low: Any = None
              ) -> tuple[Any, Any, Any]:
    """Adam's direction of one tensor, projected and brought back: ``(u, m, v)``.

    Args:
      g: gradient, shape ``(m, n)`` (or any shape when not projected), float dtype.
      m, v: moments, :func:`low_rank_shape`, same dtype.
      ortho, ortho_right: the current projection (:func:`ortho_shape`; ``ortho_right``
        ``(r, n)`` for ``proj_type="full"`` only), or None when not projected.
      count: t ≥ 1 after this update's increment (a Python int, or an int32 array under
        ``jit``); used by the ``"optax"`` convention's bias correction.
      low: the dtype both products run in when not the moments' (``proj_dtype="param"``,
        :func:`xopt.specs.lowrank.product_dtype`); ``u`` is then in it.
    Returns:
      ``u = α · back(N)`` in ``g``'s shape (``N`` itself, unscaled, when not projected) and
      the new moments, where ``N = m / (√v + ε)`` (authors) or
      ``m̂ / (√(v̂ + ε_root) + ε)`` (optax).
    """
    projected = ortho is not None
    which = side(tuple(g.shape), h.proj_type) if projected else None
    if projected and low is not None:
        g, ortho, ortho_right = (lowrank.astype(a, low) for a in (g, ortho, ortho_right))
    r = project(xp, g, ortho, ortho_right, which) if projected else g
    if projected and low is not None:
        r = lowrank.astype(r, m.dtype)  # exact
    if h.convention == "authors":
        m, v = lowrank.hf_adam_moments(xp, m, v, r, h.b1, h.b2)
        n = lowrank.hf_adam_direction(xp, m, v, h.eps)
    else:
        m, v = optax_moments(xp, m, v, r, h.b1, h.b2)
        n = optax_direction(xp, m, v, count, h.b1, h.b2, h.eps, h.eps_root)
    if projected and low is not None:
        n = lowrank.astype(n, low)
    u = project_back(xp, n, ortho, ortho_right, which, h.scale) if projected else n
    if aux is not None and projected:
        aux[f"{name}/low_rank_grad"] = r
        aux[f"{name}/update_full"] = u
    return u, m, v


def apply_update(h: GaLore, p: Any, u: Any, count: Any, lr: Any, *, low: bool = False
                 ) -> Any:
    """The new parameter from ``u`` (:func:`direction`).

    authors: ``p ← p − η√(1 − β₂ᵗ)/(1 − β₁ᵗ) · u``, then ``p ← p − ηλ p``;
    optax: ``p ← p + (−η (u + λ p))``. ``low``: ``p`` and ``u`` are in the parameter's
    narrow dtype, and so is the result (:func:`xopt.specs.lowrank.hf_apply_low`).
    """
    if h.convention == "authors":
        step_size = lowrank.hf_step_size(lr, h.b1, h.b2, count, h.correct_bias)
        if low:
            return lowrank.hf_apply_low(p, u, step_size, lr, h.weight_decay)
        if _is_number(h.weight_decay):
            return lowrank.hf_apply(p, u, step_size, lr, h.weight_decay)
        p = p - step_size * u  # a traced λ (optax.inject_hyperparams): decay unconditionally,
        return p - (lr * h.weight_decay) * p  # exact for λ = 0 (p − 0·p = p)
    return p + optax_updates(u, p, lr, h.weight_decay)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating))


def additive_update(h: GaLore, p: Any, u: Any, count: Any, lr: Any) -> Any:
    """``Δ`` with ``p + Δ`` the new parameter, for optax's ``apply_updates``.

    optax: ``−η (u + λ p)`` exactly as optax computes it. authors without weight decay:
    ``−(α_t u)``, so ``p + Δ`` rounds exactly as :func:`apply_update`'s ``p − α_t u``; with
    weight decay ``apply_update(...) − p`` (``p + Δ`` may then differ from it by an ulp of
    ``p``). ``p`` may be None when the weight decay is a static zero.
    """
    if h.convention == "optax":
        return optax_updates(u, p, lr, h.weight_decay)
    if arrays.is_static_zero(h.weight_decay):
        return -(lowrank.hf_step_size(lr, h.b1, h.b2, count, h.correct_bias) * u)
    return apply_update(h, p, u, count, lr) - p


def tensor_update(xp: Any, h: GaLore, p: Any, g: Any, m: Any, v: Any, ortho: Any,
                  ortho_right: Any, count: Any, lr: Any, *, aux: dict | None = None,
                  name: str = "") -> tuple[Any, Any, Any]:
    """One GaLore step of one tensor whose projection (if any) is current:
    :func:`direction` then :func:`apply_update`; returns ``(p, m, v)``. With
    ``proj_dtype="param"`` a projected ``p`` narrower than ``m`` is stepped in its own dtype
    (:func:`xopt.specs.lowrank.product_dtype`); a ``p`` already widened takes the state's
    path."""
    low = (lowrank.product_dtype(h.proj_dtype, p.dtype, m.dtype)
           if ortho is not None else None)
    u, m, v = direction(xp, h, g, m, v, ortho, ortho_right, count, aux=aux, name=name,
                        low=low)
    return apply_update(h, p, u, count, lr, low=low is not None), m, v


# -- the whole optimizer as a pure function (the oracle's definition) ----------------------


def check_params(hp: GaLore | ParamGroups, shapes: Mapping[str, tuple[int, ...]],
                 where: str = "GaLore") -> None:
    """Raise :class:`HyperparameterError` naming the parameter whose rank is impossible."""
    for name, shape in shapes.items():
        h = hp_for(hp, name)
        if is_projected(tuple(shape), h):
            lowrank.check_rank(h.rank, tuple(shape), f"{where}: {name}")


def init_state(hp: GaLore | ParamGroups, params: Mapping[str, Any], *, xp=np,
               dtype=None) -> dict[str, Any]:
    """Canonical state before the first step: ``step`` 0, zero moments (low-rank shape for
    projected matrices), zero projections (refreshed by the first update, since 0 is a
    multiple of every ``update_proj_gap``)."""
    check_params(hp, {k: tuple(np.shape(v)) for k, v in params.items()})
    state: dict[str, Any] = {"step": np.int64(0)}
    for name, p in params.items():
        h, shape = hp_for(hp, name), tuple(p.shape)
        dt = dtype or np.promote_types(np.asarray(p).dtype, np.float32)
        state[f"m/{name}"] = xp.zeros(low_rank_shape(shape, h), dtype=dt)
        state[f"v/{name}"] = xp.zeros(low_rank_shape(shape, h), dtype=dt)
        if _has_ortho(shape, h):
            state[f"ortho/{name}"] = xp.zeros(ortho_shape(shape, h), dtype=dt)
        if _has_ortho_right(shape, h):
            state[f"ortho_right/{name}"] = xp.zeros((h.rank, shape[1]), dtype=dt)
    return state


def refresh_due(step_before: int, h: GaLore) -> bool:
    """The authors' rule: refresh when the step count *before* this update's increment is a
    multiple of ``update_proj_gap`` (so at the first update)."""
    return step_before % h.update_proj_gap == 0


def step(hp: GaLore | ParamGroups, params: Mapping[str, Any], state: Mapping[str, Any],
         grads: Mapping[str, Any], *, xp=np, loss=None,
         inject: Mapping[str, Mapping[str, Any]] | None = None,
         aux: dict | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """All parameters' GaLore step: ``(params, state) -> (params, state)``, pure.

    ``inject``: ``{param: {"ortho_matrix": P, "ortho_matrix_right": Q}}``: at a refresh,
    these replace the SVD's projection (ignored at updates that do not refresh).
    ``aux``, if a dict, receives per projected parameter ``<param>/low_rank_grad``,
    ``<param>/update_full`` (α · back(N)), ``<param>/proj_refreshed`` and, at refreshes,
    ``<param>/svd_S``: the trace's aux names. ``loss`` is unused.
    """
    del loss
    before = int(state["step"])
    count = before + 1
    new_params, new_state = {}, {"step": np.int64(count)}
    for name, p in params.items():
        h, g, shape = hp_for(hp, name), grads[name], tuple(p.shape)
        ortho = ortho_right = None
        if _has_ortho(shape, h):
            ortho = state[f"ortho/{name}"]
            ortho_right = state.get(f"ortho_right/{name}")
            due = refresh_due(before, h)

            def decompose(h=h, g=g, name=name) -> tuple[Any, Any]:
                o, o_right, s = fresh_projection(xp, h, g)
                if aux is not None:
                    aux[f"{name}/svd_S"] = s
                return o, o_right

            ortho, ortho_right = lowrank.refresh(
                due, (ortho, ortho_right), decompose,
                injected_projection((inject or {}).get(name), ortho_right,
                                    side(shape, h.proj_type)))
            if aux is not None:
                aux[f"{name}/proj_refreshed"] = np.bool_(due)
            new_state[f"ortho/{name}"] = ortho
            if ortho_right is not None:
                new_state[f"ortho_right/{name}"] = ortho_right
        p, m, v = tensor_update(xp, h, p, g, state[f"m/{name}"], state[f"v/{name}"], ortho,
                                ortho_right, count, h.lr, aux=aux, name=name)
        new_params[name] = p
        new_state[f"m/{name}"], new_state[f"v/{name}"] = m, v
    return new_params, new_state


# -- state schema --------------------------------------------------------------------------

STATE = StateSchema(
    vars=(
        StateVar("step", "global", scalar, "int64", "number of updates taken, t"),
        StateVar("m", "param", low_rank_shape, "state",
                 "first moment (uncorrected); the low-rank shape for projected matrices"),
        StateVar("v", "param", low_rank_shape, "state",
                 "second moment (uncorrected); same shape as m"),
        StateVar("ortho", "param", ortho_shape, "state",
                 "the projection: U[:, :r] (left, full) or Vᵀ[:r, :] (right) of the gradient "
                 "at the last refresh", applies=_has_ortho),
        StateVar("ortho_right", "param", lambda s, h: (h.rank, s[1]), "state",
                 "proj_type 'full' only: Vᵀ[:r, :] of the gradient at the last refresh",
                 applies=_has_ortho_right),
    ),
    namings={
        # xopt.torch.GaLore: tensors and ints only (loads with weights_only=True).
        "xopt.torch": Naming(
            keys={"step": "{param}/step", "m": "{param}/exp_avg", "v": "{param}/exp_avg_sq",
                  "ortho": "{param}/ortho_matrix", "ortho_right": "{param}/ortho_matrix_right"},
            dtypes={"step": "int64"},
            doc="xopt.torch.GaLore: optimizer.state[param][key]"),
        # xopt.jax.galore: GaLoreState(count, mu, nu, ortho, ortho_right).
        "xopt.jax": Naming(
            keys={"step": "count", "m": "mu/{param}", "v": "nu/{param}",
                  "ortho": "ortho/{param}", "ortho_right": "ortho_right/{param}"},
            dtypes={"step": "int32"},
            doc="xopt.jax.galore: GaLoreState(count, mu, nu, ortho, ortho_right)"),
    },
)


SPEC = MethodSpec(
    name="galore",
    title="GaLore: Adam on SVD-refreshed low-rank gradient projections (authors' and optax's "
          "conventions)",
    hyperparams=GaLore,
    presets=PRESETS,
    state=STATE,
    init_state=init_state,
    step=step,
    naming_of={"torch": "xopt.torch", "jax": "xopt.jax"},
)
