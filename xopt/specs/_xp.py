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
