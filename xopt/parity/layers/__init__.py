"""Layer drivers: replay a ``kind: "layer"`` trace through a method's own layers.

A layer method (CompAct, POET-X) changes a module's forward and backward, not only the
optimizer, so its traces record inputs, outputs and gradients of a layer or a small model
as well as the updates. ``xopt/parity/layers/<method>.py`` drives xopt's torch and JAX
layers (and the float64 oracle, where the spec covers the whole computation) through such a
trace; the method's :class:`~xopt.parity.methods.MethodParity` names its driver, and
:func:`~xopt.parity.harness.run_parity` hands every layer trace to it. A driver returns
:class:`~xopt.parity.harness.Run` s, judged like any other.

This module holds what the drivers share; :mod:`xopt.parity.layers.llama` is the LLaMA
model of CompAct's recordings, written once for both frameworks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from xopt.parity.harness import BadRequest, available, backend_ready

__all__ = ["LAYER_REQUIRES", "float32_matmuls", "layer_backends"]

#: what the layer drivers' backends import (the JAX layers are Flax modules)
LAYER_REQUIRES = {"torch": ("torch",), "jax": ("jax", "optax", "flax"), "oracle": ()}


def layer_backends(backends: Sequence[str], explicit: bool, notes: list[str],
                   original_note: str, skip: Callable[[str], str | None] | None = None,
                   ) -> list[str]:
    """The backends a layer driver runs (:data:`LAYER_REQUIRES`): ``"original"`` is noted
    (``original_note``: why the authors' code is not run live), an unknown name is a
    :class:`BadRequest`, ``skip(b)`` may return a note that leaves ``b`` out, and a backend
    whose packages are missing is refused or noted (:func:`backend_ready`)."""
    selected = []
    for b in backends:
        if b == "original":
            notes.append(original_note)
            continue
        if b not in LAYER_REQUIRES:
            raise BadRequest(f"unknown backend {b!r}; choose from torch, jax, oracle, original")
        why = skip(b) if skip is not None else None
        if why:
            notes.append(why)
            continue
        if backend_ready(b, LAYER_REQUIRES[b], explicit, notes):
            selected.append(b)
    return selected


def float32_matmuls(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` with JAX's float32 matrix products in full precision, where JAX is
    installed: a layer driver's own JAX model code (XLA on a GPU uses TF32 by default, the
    golden traces are full float32; see ``xopt.jax``'s ``full_precision``)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not available(("jax",)):
            return fn(*args, **kwargs)
        import jax

        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)

    return wrapped
