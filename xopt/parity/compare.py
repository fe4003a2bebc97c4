"""Error metrics between two sets of named tensors.

For tensors ``a`` (the implementation under test) and ``b`` (the reference)::

    abs error = max |a - b|
    rel error = max |a - b| / max |b|        (0 when both are 0; inf when only b is 0)

computed in float64. NaN anywhere makes both errors NaN, which never agrees.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from xopt.parity.methods import Tolerance


@dataclasses.dataclass(frozen=True)
class TensorError:
    abs: float
    rel: float

    def within(self, tol: Tolerance) -> bool:
        if math.isnan(self.abs) or math.isnan(self.rel):
            return False
        return self.abs <= tol.abs or self.rel <= tol.rel


def tensor_error(a: np.ndarray, b: np.ndarray) -> TensorError:
    a = np.atleast_1d(np.asarray(a, dtype=np.float64))
    b = np.atleast_1d(np.asarray(b, dtype=np.float64))
    if a.shape != b.shape:
        raise ValueError(f"shape {a.shape} vs {b.shape}")
    if a.size == 0:
        return TensorError(0.0, 0.0)
    if np.isnan(a).any() or np.isnan(b).any():
        both_nan_same = np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(
            a[~np.isnan(a)], b[~np.isnan(b)])
        return TensorError(0.0, 0.0) if both_nan_same else TensorError(math.nan, math.nan)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - b)
        diff[a == b] = 0.0  # equal infinities
    err = float(diff.max())
    scale = float(np.abs(b[np.isfinite(b)]).max()) if np.isfinite(b).any() else 0.0
    if err == 0.0:
        return TensorError(0.0, 0.0)
    return TensorError(err, err / scale if scale > 0 else math.inf)


def errors(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray],
           keys: list[str] | None = None) -> dict[str, TensorError]:
    """Per-key errors over ``keys`` (default: the keys of ``b``); a key missing in ``a``
    is reported as NaN (never agrees)."""
    out = {}
    for k in keys if keys is not None else list(b):
        if k not in a:
            out[k] = TensorError(math.nan, math.nan)
        else:
            out[k] = tensor_error(a[k], b[k])
    return out


def closer_to(oracle: np.ndarray, a: np.ndarray, b: np.ndarray) -> str:
    """Which of ``a`` and ``b`` the float64 oracle is closer to: "backend" (a), "against"
    (b) or "tie"."""
    da = tensor_error(a, oracle).abs
    db = tensor_error(b, oracle).abs
    if math.isnan(da) or math.isnan(db) or da == db:
        return "tie"
    return "backend" if da < db else "against"
