"""Building blocks shared by the learned optimizers (small_fc_lopt and VeLO).

These are learned_optimization's ``learned_optimizers/common.py`` accumulators and the
feature helpers both ``AdafacMLPLOpt`` and ``HyperV2`` use, as pure functions on one tensor
at a time, written against the array namespace ``xp`` (NumPy, torch or jax.numpy; see
:mod:`xopt.specs._xp`). Every accumulator keeps one slice per decay on a trailing axis of
length ``k`` (the original ``vmap`` s over decays with ``out_axes=-1``).

Shapes, for a parameter ``p`` of shape ``S`` (rank 0 to 4) and ``k`` decays:
  * momentum ``m``: ``S + (k,)``; second moment ``rms``: ``S + (k_rms,)``;
  * factored second moment (Adafactor style, :func:`factored_dims` not None):
    ``v_row``: ``S`` without axis ``d0``, plus ``(k,)``; ``v_col``: ``S`` without axis ``d1``,
    plus ``(k,)``; ``v_diag``: ``(0, k)`` (a placeholder, as the original stores it);
  * unfactored (rank < 2): ``v_diag``: ``S + (k,)``; ``v_row``, ``v_col``: ``(0, k)``.

All arithmetic is float32 in the backends (float64 in the oracle).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from xopt.specs import _xp

#: ``reparam_decay``: decays are learned as ``log(1 - decay) / 10`` (both originals)
REPARAM = 10.0


def factored_dims(shape: Sequence[int]) -> tuple[int, int] | None:
    """``(d1, d0)``: the axes of the second-largest and largest dims (ties: the later axis
    is larger, as ``numpy.argsort`` orders them), or None below rank 2.

    This is learned_optimization's rule in both ``common.py`` and ``hyper_v2.py``. PyLO's
    VeLO swaps the two axes for square matrices; that is one of its departures.
    """
    if len(shape) < 2:
        return None
    order = np.argsort(np.asarray(shape), kind="quicksort")
    return int(order[-2]), int(order[-1])


def factored_shapes(shape: Sequence[int], k: int) -> dict[str, tuple[int, ...]]:
    """Shapes of ``v_row``, ``v_col`` and ``v_diag`` for a parameter of ``shape``."""
    shape = tuple(int(s) for s in shape)
    f = factored_dims(shape)
    if f is None:
        return {"v_row": (0, k), "v_col": (0, k), "v_diag": shape + (k,)}
    d1, d0 = f
    return {
        "v_row": tuple(s for i, s in enumerate(shape) if i != d0) + (k,),
        "v_col": tuple(s for i, s in enumerate(shape) if i != d1) + (k,),
        "v_diag": (0, k),
    }


def decay_to_param(xp: ModuleType, x: Any) -> Any:
    return xp.log(1 - x) / REPARAM


def param_to_decay(xp: ModuleType, x: Any) -> Any:
    return 1 - xp.exp(x * REPARAM)


def effective_decays(xp: ModuleType, initial: Any, offset: Any | None) -> Any:
    """``param_to_decay(decay_to_param(initial) + offset)``; the initial decays when
    ``offset`` is None (VeLO never passes its θ offsets, so its decays are the initial
    values rounded to the working precision)."""
    if offset is None:
        return initial
    return param_to_decay(xp, decay_to_param(xp, initial) + offset)


def momentum_update(m: Any, g: Any, decays: Any) -> Any:
    """``m <- d*m + (1-d)*g`` per decay (``common.rolling_mom``; no clipping of ``d``).

    m: ``S + (k,)``; g: ``S``; decays: ``(k,)``.
    """
    return decays * m + (1 - decays) * g[..., None]


def rms_update(xp: ModuleType, rms: Any, g: Any, decays: Any) -> Any:
    """``v <- c*v + (1-c)*g²`` with ``c = clip(d, 0, 1)`` (``common.rolling_rms``)."""
    c = _xp.clip(xp, decays, 0.0, 1.0)
    return c * rms + (1 - c) * (g * g)[..., None]


def safe_rsqrt(xp: ModuleType, x: Any) -> Any:
    """``rsqrt(max(x, 1e-9))`` (``common.safe_rsqrt``)."""
    return _xp.rsqrt(xp, x.clamp_min(1e-9) if _xp.is_torch(xp) else xp.maximum(x, 1e-9))


def factored_update(xp: ModuleType, v_row: Any, v_col: Any, v_diag: Any, g: Any,
                    decays: Any) -> tuple[Any, Any, Any, Any]:
    """One step of ``common.factored_rolling`` (Adafactor-style accumulators), per decay.

    Returns ``(v_row, v_col, v_diag, fac_g)`` with ``fac_g`` (``S + (k,)``) the gradient
    preconditioned by the updated accumulators. The untouched placeholders come back as
    given.
    """
    c = _xp.clip(xp, decays, 0.0, 1.0)
    mix = 1.0 - c
    grad_sqr = g * g + 1e-30
    f = factored_dims(tuple(g.shape))
    if f is None:
        new_v = c * v_diag + mix * grad_sqr[..., None]
        y = g[..., None] * safe_rsqrt(xp, new_v + 1e-9)
        return v_row, v_col, new_v, y
    d1, d0 = f
    new_row = c * v_row + mix * _xp.mean(xp, grad_sqr, (d0,))[..., None]
    new_col = c * v_col + mix * _xp.mean(xp, grad_sqr, (d1,))[..., None]
    reduced_d1 = d1 - 1 if d1 > d0 else d1
    row_col_mean = _xp.mean(xp, new_row, (reduced_d1,), keepdims=True)
    row_factor = safe_rsqrt(xp, new_row / (row_col_mean + 1e-9))
    col_factor = safe_rsqrt(xp, new_col)
    y = (g[..., None] * _xp.expand_dims(xp, row_factor, d0)
         * _xp.expand_dims(xp, col_factor, d1))
    return new_row, new_col, v_diag, y


def second_moment_normalizer(xp: ModuleType, x: Any, axes: tuple[int, ...],
                             eps: float = 1e-5) -> Any:
    """``x * rsqrt(eps + mean(x², axes))`` (channels on the last axis are kept apart)."""
    return x * _xp.rsqrt(xp, eps + _xp.mean(xp, xp.square(x), axes, keepdims=True))
