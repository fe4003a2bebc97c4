"""The parity harness, library side: traces, runners, comparisons, reports.

``xopt parity`` (see :mod:`xopt.cli`) and the pytest suite in ``parity_tests/`` both call
:func:`run_parity`. Small traces ship with the package (:func:`bundled_traces`), so a
check runs on a fresh install with no other data.
"""

from __future__ import annotations

from pathlib import Path

from xopt.parity.trace import Trace, load_trace, write_trace

DATA = Path(__file__).parent / "data"

__all__ = ["DATA", "Trace", "bundled_traces", "load_trace", "run_parity", "write_trace"]


def bundled_traces(method: str) -> list[Path]:
    """Manifest paths of the traces shipped for ``method`` (sorted; empty if none)."""
    return sorted((DATA / method).glob("*.json"))


def run_parity(*args, **kwargs):
    """See :func:`xopt.parity.harness.run_parity` (imported lazily)."""
    from xopt.parity.harness import run_parity as _run

    return _run(*args, **kwargs)
