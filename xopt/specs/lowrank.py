"""Math the low-rank gradient methods share: unique SVD and QR, projections, rank rules.

GaLore, Flora, COAP and PLUMAGE keep optimizer state in an ``r``-dimensional subspace of
each matrix's gradient ``G`` (``m × n``), described by a projection ``P``:

* *left*:  ``P`` is ``m × r``, the low-rank gradient ``R = Pᵀ G`` is ``r × n``, and an
  update ``N`` returns to full shape as ``P N``;
* *right*: ``P`` is ``n × r`` (or its transpose, ``r × n``, as GaLore and COAP store
  it), ``R = G P`` is ``m × r``, and ``N`` returns as ``N Pᵀ``.

Decompositions are made unique before use, identically under NumPy, torch and jax.numpy,
so that xopt's two backends agree on every projection without injected values:

* :func:`svd`: each left singular vector's entry of largest magnitude (the first such
  entry on a tie) is made positive, and the right singular vector flipped with it;
* :func:`qr`: ``R``'s diagonal is made non-negative (``Q``'s columns flipped with it).

Singular vectors of (nearly) equal singular values are not unique even then; the methods'
parity tests inject the original's projection at refresh steps, as the traces recommend
(:func:`refresh`: one rule for "recompute, or take the injected value, or keep").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from xopt.errors import HyperparameterError
from xopt.specs import arrays


def _arange(xp: ModuleType, n: int, like: Any) -> Any:
    if arrays.is_torch(xp):
        return xp.arange(n, device=like.device)
    return xp.arange(n)


def _one_where_nonneg(xp: ModuleType, x: Any) -> Any:
    one = xp.ones_like(x)
    return xp.where(x < 0, -one, one)


def svd(xp: ModuleType, a: Any) -> tuple[Any, Any, Any]:
    """Reduced SVD ``a = U diag(S) Vh`` with xopt's sign convention.

    Args:
      a: ``(m, n)`` float array (NumPy, torch or jax).
    Returns:
      ``U`` ``(m, k)``, ``S`` ``(k,)`` descending, ``Vh`` ``(k, n)``, ``k = min(m, n)``, in
      ``a``'s dtype; for every ``i`` the entry of ``U[:, i]`` of largest magnitude is
      positive and ``Vh[i]`` is flipped with ``U[:, i]``.
    """
    u, s, vh = xp.linalg.svd(a, full_matrices=False)
    k = s.shape[0]
    rows = xp.argmax(xp.abs(u), axis=0) if not arrays.is_torch(xp) else \
        xp.argmax(u.abs(), dim=0)
    pivot = u[rows, _arange(xp, k, u)]
    sign = _one_where_nonneg(xp, pivot)
    return u * sign[None, :], s, vh * sign[:, None]


def qr(xp: ModuleType, a: Any) -> tuple[Any, Any]:
    """Reduced QR ``a = Q R`` with ``R``'s diagonal non-negative.

    Args:
      a: ``(m, k)`` float array, ``m >= k``.
    Returns:
      ``Q`` ``(m, k)`` with orthonormal columns, ``R`` ``(k, k)`` upper triangular.
    """
    q, r = xp.linalg.qr(a, mode="reduced")
    k = r.shape[0]
    diag = r[_arange(xp, k, r), _arange(xp, k, r)]
    sign = _one_where_nonneg(xp, diag)
    return q * sign[None, :], r * sign[:, None]


def refresh(due: Any, old: Any, decompose: Callable[[], Any] | None,
            injected: Any = None, *, cond: Callable[..., Any] | None = None) -> Any:
    """A periodically refreshed value (a projection, a decomposition) after one update.

    Every low-rank method keeps something it recomputes at refresh updates only: GaLore's
    SVD projection, COAP's Eqn-7 basis, PLUMAGE's singular vectors and probabilities,
    Flora's projection at a momentum transfer. At a refresh (``due``) the value is an
    original's recorded one when ``injected`` is given (the parity harness replays what an
    original drew from its own LAPACK or generator), else ``decompose()``; otherwise ``old``
    is kept. ``old``, ``injected`` and ``decompose()`` have one structure (an array or a
    tuple of them). The spec, the torch backend and the JAX backend all decide here.

    Args:
      due: whether this update refreshes: a Python bool (NumPy, torch: ``decompose`` runs
        only when due), or a traced boolean under ``jit``.
      cond: with a traced ``due``, ``jax.lax.cond``: the decomposition then sits in a
        branch and costs nothing at the other updates. None: ``due`` is concrete.
    """
    if cond is None:
        if not due:
            return old
        return injected if injected is not None else decompose()
    if injected is not None:
        return cond(due, lambda: injected, lambda: old)
    return cond(due, decompose, lambda: old)


def check_rank(rank: int, shape: tuple[int, ...], where: str) -> None:
    """Raise :class:`HyperparameterError` naming ``where`` unless ``1 <= rank <= min(shape)``."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise HyperparameterError(f"{where}: rank = {rank!r} must be an int")
    if rank < 1:
        raise HyperparameterError(f"{where}: rank = {rank} must be at least 1")
    if len(shape) != 2:
        raise HyperparameterError(f"{where}: a projected parameter must be a matrix; "
                                  f"shape {tuple(shape)}")
    if rank > min(shape):
        raise HyperparameterError(
            f"{where}: rank = {rank} is larger than the matrix allows: shape "
            f"{tuple(shape)} has rank at most {min(shape)}")


def check_interval(value: int, field: str, where: str) -> None:
    """Raise :class:`HyperparameterError` unless ``value`` is a positive int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise HyperparameterError(f"{where}: {field} = {value!r} must be a positive int")


# -- the precision of the projections (``proj_dtype`` of GaLore, COAP and PLUMAGE) ------------
#
# ``"state"``: ``G`` and ``P`` are widened to the state's dtype (float32; float64 for float64
# parameters) and both products run there. ``"param"``: as the authors' projectors
# (galore_projector.py, coap_matrix.py), for a parameter narrower than its state (bfloat16,
# float16) the products run in the parameter's dtype and the projected update is added to
# the parameter there::
#
#     P_d = P → d                          (P itself is kept in the state's dtype)
#     R   = G P_dᵀ  or  P_dᵀ G             in d (the gradient as it comes, d)
#     m, v ← hf_adam_moments(R → s)        in s (the authors keep them in d; see the methods)
#     N   = m / (√v + ε) → d
#     U   = (N P_d  or  P_d N) · scale     in d, each product and the scaling rounded to d
#     p   ← p + (−α)·U                     evaluated in float32, rounded once to d
#     p   ← p + (−ηλ)·p                    likewise, when λ > 0
#
# For float32 and float64 parameters the two values are one computation.

#: ``proj_dtype``'s values
PROJ_DTYPES = ("state", "param")


def _itemsize(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)  # torch.dtype and numpy dtypes
    return int(size) if size is not None else np.dtype(dtype).itemsize


def product_dtype(proj_dtype: str, param_dtype: Any, state_dtype: Any) -> Any:
    """The dtype the projections run in when it is not the state's: ``param_dtype`` under
    ``proj_dtype="param"`` for a parameter narrower than its state, else None."""
    if proj_dtype == "param" and _itemsize(param_dtype) < _itemsize(state_dtype):
        return param_dtype
    return None


def astype(x: Any, dtype: Any) -> Any:
    """``x`` in ``dtype`` (torch's ``to``, NumPy's and jax's ``astype``); None stays None."""
    if x is None or x.dtype == dtype:
        return x
    return x.to(dtype) if arrays.is_torch(arrays.namespace(x)) else x.astype(dtype)


def hf_apply_low(p: Any, update: Any, step_size: Any, lr: Any, weight_decay: Any) -> Any:
    """:func:`hf_apply` in ``p``'s own (narrow) dtype, as the authors' ``p.add_(U,
    alpha=−α)`` then ``p.add_(p, alpha=−ηλ)``: each ``p + c·x`` evaluated in float32 and
    rounded once into ``p``'s dtype. Under torch this is torch's ``add`` with ``alpha``
    (whose CPU kernels round ``c`` itself to bfloat16 first, in the authors' code as here)."""
    decay = not _is_real(weight_decay) or weight_decay > 0.0
    torch_ = arrays.is_torch(arrays.namespace(p))
    if torch_ and _is_real(step_size) and _is_real(lr) and _is_real(weight_decay):
        p = p.add(update, alpha=-step_size)
        return p.add(p, alpha=-(lr * weight_decay)) if decay else p
    wide = p.new_empty(()).float().dtype if torch_ else np.float32

    def axpy(x: Any, c: Any, y: Any) -> Any:
        return astype(astype(x, wide) + c * astype(y, wide), x.dtype)

    p = axpy(p, -step_size, update)
    return axpy(p, -(lr * weight_decay), p) if decay else p


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


# -- the authors' AdamW (transformers' ``AdamW``, which GaLore and COAP copy) ------------------
#
# One update of a tensor ``p`` whose (possibly projected) gradient is ``r``, at 1-based step
# ``t``, in the order galore_torch/adamw.py and coap_torch/optimizer/adamw.py perform it:
#
#     m ← β₁ m + (1 − β₁) r              v ← β₂ v + (1 − β₂) r²
#     N ← m / (√v + ε)                   (ε on the *uncorrected* √v)
#     α ← η √(1 − β₂ᵗ) / (1 − β₁ᵗ)       (η without correction when correct_bias=False)
#     p ← p − α · back(N)                then, if λ > 0:  p ← p − ηλ · p   (on the new p)
#
# ``back`` is the method's projection back (identity for tensors that are not projected).


def hf_adam_moments(xp: ModuleType, m: Any, v: Any, r: Any, b1: float, b2: float
                    ) -> tuple[Any, Any]:
    """``(β₁ m + (1 − β₁) r, β₂ v + (1 − β₂) r²)``; shapes of ``r``, state dtype."""
    return m * b1 + r * (1.0 - b1), v * b2 + (r * r) * (1.0 - b2)


def hf_adam_direction(xp: ModuleType, m: Any, v: Any, eps: float) -> Any:
    """``N = m / (√v + ε)``."""
    return m / (xp.sqrt(v) + eps)


def hf_step_size(lr: Any, b1: float, b2: float, t: Any, correct_bias: bool) -> Any:
    """``α = η √(1 − β₂ᵗ) / (1 − β₁ᵗ)`` (or ``η``).

    With a Python int ``t`` this is Python float (double) arithmetic, as the authors' code;
    with an array ``t`` (jax under ``jit``) it is evaluated in the array's float dtype as
    ``−expm1(t·log1p(−(1−β)))``, within a few float32 ulp of the double value.
    """
    if not correct_bias:
        return lr
    if isinstance(t, (int, np.integer)):
        return lr * math.sqrt(1.0 - b2 ** int(t)) / (1.0 - b1 ** int(t))
    xp = arrays.namespace(t)
    tf = t.astype(xp.float32)
    bc1 = -xp.expm1(tf * xp.log1p(-(1.0 - b1)))
    bc2 = -xp.expm1(tf * xp.log1p(-(1.0 - b2)))
    return lr * xp.sqrt(bc2) / bc1


def hf_apply(p: Any, update: Any, step_size: Any, lr: Any, weight_decay: float) -> Any:
    """``p ← p − α·update``, then ``p ← p − ηλ·p`` when ``λ > 0`` (decay after the step)."""
    p = p - step_size * update
    if weight_decay > 0.0:
        p = p - (lr * weight_decay) * p
    return p
