"""Array-namespace helpers that let one pure function run under NumPy, torch and jax.numpy.

The spec's math is written against the operations the three namespaces share (arithmetic,
``sqrt``, ``maximum``, ``where``). A few updates are, in torch.optim, single fused kernels
whose rounding differs from the same formula written out (``lerp`` picks its formula by
the weight; ``addcmul``/``addcdiv`` may be compiled with fused multiply-adds). To reproduce
torch.optim bit for bit, these helpers call torch's own kernel when given torch tensors and
write the formula out, in torch's evaluation order, everywhere else. Under NumPy float64
(the oracle) the difference is far below float32 rounding.

No framework is imported here: the namespace is recognised from the array's type.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np


def namespace(x: Any) -> ModuleType:
    """The array namespace of ``x``: ``numpy``, ``torch`` or ``jax.numpy``."""
    module = type(x).__module__
    if module.startswith("torch"):
        import torch

        return torch
    if module.startswith(("jax", "jaxlib")):
        import jax.numpy as jnp

        return jnp
    return np


def is_torch(xp: ModuleType) -> bool:
    return xp.__name__ == "torch"


def lerp(xp: ModuleType, start: Any, end: Any, weight: float) -> Any:
    """``start + weight * (end - start)``, as ``torch.lerp`` computes it under torch.

    torch.lerp uses ``end - (end - start) * (1 - weight)`` when ``|weight| >= 0.5``; the
    written-out branch mirrors that so both branches round alike in float32.
    """
    if is_torch(xp):
        return xp.lerp(start, end, weight)
    if isinstance(weight, (int, float)):
        if abs(weight) < 0.5:
            return start + weight * (end - start)
        return end - (end - start) * (1 - weight)
    # a traced or array weight (jax under inject_hyperparams): both branches, selected
    return xp.where(abs(weight) < 0.5, start + weight * (end - start),
                    end - (end - start) * (1 - weight))


def addcmul(xp: ModuleType, x: Any, t1: Any, t2: Any, value: float) -> Any:
    """``x + value * t1 * t2`` (torch.addcmul under torch)."""
    if is_torch(xp):
        return xp.addcmul(x, t1, t2, value=value)
    return x + value * t1 * t2


def addcdiv(xp: ModuleType, x: Any, t1: Any, t2: Any, value: float) -> Any:
    """``x + value * t1 / t2`` (torch.addcdiv under torch)."""
    if is_torch(xp):
        return xp.addcdiv(x, t1, t2, value=value)
    return x + value * t1 / t2


def is_static_zero(x: Any) -> bool:
    """True when ``x`` is a Python number equal to zero (never true for a traced value)."""
    return isinstance(x, (int, float)) and x == 0


# -- reductions and elementwise ops under their per-namespace names --------------------------
# torch spells ``axis``/``keepdims`` as ``dim``/``keepdim`` and reduces over *every* axis when
# given ``dim=()``; the helpers below take NumPy's spelling and treat an empty ``axes`` as "no
# reduction", which is what NumPy and jax.numpy do and what the learned optimizers rely on
# for 0-d parameters (PyLO's torch port does not, which is one of its departures).


def mean(xp: ModuleType, x: Any, axes: tuple[int, ...], keepdims: bool = False) -> Any:
    """Mean over ``axes`` (an empty tuple reduces nothing and returns ``x``)."""
    axes = tuple(axes)
    if not axes:
        return x
    if is_torch(xp):
        return x.mean(dim=axes, keepdim=keepdims)
    return xp.mean(x, axis=axes, keepdims=keepdims)


def amax(xp: ModuleType, x: Any, axis: int, keepdims: bool = False) -> Any:
    if is_torch(xp):
        return x.amax(dim=axis, keepdim=keepdims)
    return xp.max(x, axis=axis, keepdims=keepdims)


def rsqrt(xp: ModuleType, x: Any) -> Any:
    """``1/sqrt(x)``: ``torch.rsqrt``, ``jax.lax.rsqrt``, or written out under NumPy."""
    if is_torch(xp):
        return xp.rsqrt(x)
    if xp.__name__.startswith("jax"):
        import jax

        return jax.lax.rsqrt(x)
    return 1.0 / xp.sqrt(x)


def clip(xp: ModuleType, x: Any, lo: Any, hi: Any) -> Any:
    if is_torch(xp):
        return xp.clamp(x, lo, hi)
    return xp.clip(x, lo, hi)


def expand_dims(xp: ModuleType, x: Any, axis: int) -> Any:
    if is_torch(xp):
        return x.unsqueeze(axis)
    return xp.expand_dims(x, axis)


def concat(xp: ModuleType, xs: list[Any], axis: int = -1) -> Any:
    if is_torch(xp):
        return xp.cat(xs, dim=axis)
    return xp.concatenate(xs, axis=axis)


def relu(xp: ModuleType, x: Any) -> Any:
    """``max(x, 0)`` (``jax.nn.relu``'s definition)."""
    if is_torch(xp):
        return xp.relu(x)
    return xp.maximum(x, 0)


def sigmoid(xp: ModuleType, x: Any) -> Any:
    """The logistic function: ``torch.sigmoid``, ``jax.nn.sigmoid``, or ``1/(1+exp(-x))``."""
    if is_torch(xp):
        return xp.sigmoid(x)
    if xp.__name__.startswith("jax"):
        import jax

        return jax.nn.sigmoid(x)
    return 1.0 / (1.0 + xp.exp(-x))
