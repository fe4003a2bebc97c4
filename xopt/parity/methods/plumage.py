"""PLUMAGE in the parity harness: the tolerances, and what a trace may inject.

No public implementation exists (the paper's code was not released), so there is no
original to run live and no golden trace; parity is torch vs jax vs the float64 oracle, and
the paper's claims are tested directly (tests/test_plumage.py).
"""

from __future__ import annotations

from typing import Any

from xopt.parity.methods import MethodParity, Tolerance
from xopt.specs import plumage as S

TOLERANCES = {
    "bitwise": Tolerance(0.0, 0.0, "same operations in the same order on the same machine"),
    "teacher_forced": Tolerance(
        1e-6, 0.0,
        "one float32 step: the SVD (LAPACK in both torch and jax, possibly different builds) "
        "and the k × k / k × n matmuls round differently by a few ulps; singular vectors of "
        "well-separated singular values move by ulps / gap"),
    "closed_loop": Tolerance(
        1e-4, 0.0,
        "the per-step rounding compounds through the moments and, at each refresh, through "
        "the realignment B = P₂ᵀP₁; a sampled index set is discrete and identical as long as "
        "no arm lands within rounding of a sector boundary"),
}


def inject(trace: Any, t: int, hp: Any) -> dict[str, dict[str, Any]] | None:
    """The :data:`~xopt.specs.plumage.INJECT_KEYS` a trace records at update ``t``, as
    ``{param: {key: array}}``.

    A trace's aux may hold ``<param>/indices``, ``<param>/svd_u`` and ``<param>/svd_s``
    (the names of ``INJECT_KEYS``); none is bundled (there is no public original), but
    a trace recorded from one, or written by a test, is fed through the harness this way.
    """
    del hp
    aux = trace.aux(t)
    out: dict[str, dict[str, Any]] = {}
    for name in trace.params:
        got = {k: aux[f"{name}/{k}"] for k in S.INJECT_KEYS if f"{name}/{k}" in aux}
        if got:
            out[name] = got
    return out or None


PARITY = MethodParity(method="plumage", originals={}, tolerances=TOLERANCES, inject=inject)
