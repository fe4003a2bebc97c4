"""The parity harness, library side: traces, runners, comparisons, reports.

``xopt parity`` (see :mod:`xopt.cli`) and the pytest suite in ``parity_tests/`` both call
:func:`run_parity`. Small traces ship with the package (:func:`bundled_traces`), so a
check runs on a fresh install with no other data.
"""

from __future__ import annotations

from pathlib import Path

# The error metrics live in the submodule ``compare``, whose name the function ``compare``
# below takes over: importing the submodule first keeps later ``from xopt.parity.compare
# import ...`` from rebinding the package attribute (a loaded module is not re-set).
import xopt.parity.compare  # noqa: F401  (see above)
from xopt.parity.trace import Trace, load_trace, write_trace

DATA = Path(__file__).parent / "data"

__all__ = ["DATA", "Trace", "bundled_traces", "compare", "gradient_sequence", "jax_problem",
           "load_trace", "record", "run_parity", "torch_problem", "write_trace"]


def bundled_traces(method: str) -> list[Path]:
    """Manifest paths of the traces shipped for ``method`` (sorted; empty if none)."""
    return sorted((DATA / method).glob("*.json"))


def run_parity(*args, **kwargs):
    """See :func:`xopt.parity.harness.run_parity` (imported lazily)."""
    from xopt.parity.harness import run_parity as _run

    return _run(*args, **kwargs)


def record(*args, **kwargs):
    """Record a trace of any torch.optim optimizer or optax transformation; see
    :func:`xopt.parity.recorder.record`."""
    from xopt.parity.recorder import record as _record

    return _record(*args, **kwargs)


def compare(*args, **kwargs):
    """Compare an implementation with a trace or another implementation; see
    :func:`xopt.parity.anyopt.compare`."""
    from xopt.parity.anyopt import compare as _compare

    return _compare(*args, **kwargs)


def torch_problem(*args, **kwargs):
    """The user's torch model as a problem; see :func:`xopt.parity.recorder.torch_problem`."""
    from xopt.parity.recorder import torch_problem as _f

    return _f(*args, **kwargs)


def jax_problem(*args, **kwargs):
    """The user's JAX loss as a problem; see :func:`xopt.parity.recorder.jax_problem`."""
    from xopt.parity.recorder import jax_problem as _f

    return _f(*args, **kwargs)


def gradient_sequence(*args, **kwargs):
    """A fixed gradient stream as a problem; see
    :func:`xopt.parity.recorder.gradient_sequence`."""
    from xopt.parity.recorder import gradient_sequence as _f

    return _f(*args, **kwargs)
