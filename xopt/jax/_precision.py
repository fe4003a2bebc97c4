"""Full float32 precision for the matrix products xopt's JAX code traces.

XLA on a GPU multiplies float32 matrices in TF32 by default (10-bit mantissas, about 1e-3
relative per product), where the CPU, torch's CUDA matmuls and the golden traces compute
in full float32. :func:`full_precision` traces a function under
``jax.default_matmul_precision("highest")``, so every ``@``, ``einsum`` and ``dot`` inside it
(the spec's math included) is full float32 on every device; bfloat16/float16 operands are
unaffected. It is applied to the optax ``update`` functions and to the layers' forward and
backward functions; users' own code keeps their global setting.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax

F = TypeVar("F", bound=Callable[..., Any])


def full_precision(fn: F) -> F:
    """``fn`` traced with float32 matrix products in full precision (see the module)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]
