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

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from xopt.errors import HyperparameterError, TraceError, XoptError
from xopt.parity.harness import BadRequest, available, backend_ready

__all__ = ["LAYER_REQUIRES", "float32_matmuls", "integer", "layer_backends",
           "reading_hyperparameters"]


@contextlib.contextmanager
def reading_hyperparameters(path: Any) -> Iterator[None]:
    """Read a layer trace's recorded hyperparameters: a missing or wrongly typed field
    or a value out of the spec's range becomes a :class:`~xopt.errors.TraceError` naming the
    file."""
    try:
        yield
    except HyperparameterError as e:
        raise TraceError(f"{path}: hyperparameters: {e}") from None
    except XoptError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        what = f"missing field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise TraceError(f"{path}: hyperparameters: {what}") from None


def integer(value: Any, field: str) -> int:
    """``value`` if it is an int (not a bool), else a TypeError naming ``field`` (a float
    such as 8.7 is refused rather than truncated)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} = {value!r} is not an integer")
    return value

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
