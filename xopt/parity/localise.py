"""Where a divergence starts: the first step and tensor whose error rises above float32
rounding, and which side lost the accuracy.

In a teacher-forced run every step starts from the reference's own state, so step t's error
is one update's. It is *above float32 rounding* when

    max|impl − ref|  >  ROUNDING_FACTOR · max(ulp(max|ref|), sensitivity)

where ``ulp`` is the float32 spacing at the tensor's largest magnitude and ``sensitivity``
is how far the exact (float64) step moves when every floating-point input (parameters,
state, gradient) is rounded once more: scaled by 1 + 2⁻²⁴·u, u uniform in [−1, 1), a few
independent draws, the largest movement. No float32 implementation can be held closer to
the exact step than its inputs' own rounding carries through it; an ill-conditioned step
(a small denominator, an SVD with close singular values) has a large sensitivity and is
allowed a large error. Where no float64 step exists the float32 step is perturbed instead
(which also carries that step's own rounding). :data:`ROUNDING_FACTOR` absorbs the few
roundings of a handful of operations done in another order.

The cause at the first divergence comes from the float64 results:

* ``formulation``: the two float64 steps (each implementation's float64 twin) differ by
  more than rounding: the implementations compute different mathematics;
* ``implementation`` / ``reference``: one float64 result (a shared oracle, or twins that
  agree) exists, and that side is the further from it: it lost the accuracy;
* None: no float64 result to judge by.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

#: how many times the rounding level an error must exceed to count as a divergence: a step
#: of a handful of operations evaluated in another order rounds a few times differently
ROUNDING_FACTOR = 4.0

#: relative size of the input perturbation: one float32 rounding (2⁻²⁴, half an ulp)
ULP = 2.0 ** -24

Tensors = Mapping[str, np.ndarray]


def max_abs(a: Any, b: Any) -> float:
    a = np.atleast_1d(np.asarray(a, dtype=np.float64))
    b = np.atleast_1d(np.asarray(b, dtype=np.float64))
    if a.size == 0:
        return 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(a - b)
        d[a == b] = 0.0
    return float(np.nanmax(d)) if not np.isnan(d).all() else math.nan


def ulp_floor(ref: Any) -> float:
    """float32 spacing at the tensor's largest finite magnitude (0 for an all-zero one)."""
    a = np.abs(np.asarray(ref, dtype=np.float64))
    a = a[np.isfinite(a)]
    if a.size == 0:
        return 0.0
    return float(np.spacing(np.float32(a.max())))


def perturb(arrays: Mapping[str, Any], rng: np.random.Generator, bits: int = 24,
            ) -> dict[str, np.ndarray]:
    """Every floating-point array scaled elementwise by 1 + 2^-bits·u, u uniform in
    [−1, 1), returned in float64 (a float32 step needs ``bits=23`` for the change to
    survive rounding its inputs back to float32). Integer arrays, and float arrays holding
    only whole numbers (torch's float step counter), are exact and left as they are."""
    out = {}
    for k, v in arrays.items():
        a = np.asarray(v)
        if np.issubdtype(a.dtype, np.floating) and not np.array_equal(a, np.round(a)):
            out[k] = a.astype(np.float64) * (1.0 + 2.0 ** -bits * rng.uniform(-1, 1, a.shape))
        else:
            out[k] = a
    return out


def sensitivity(step: Callable[[int], Mapping[str, np.ndarray]], rounds: int = 3,
                ) -> dict[str, float]:
    """``step(seed)`` runs the step on inputs perturbed with ``default_rng(seed)``
    (``seed = -1``: unperturbed); the largest movement of each output over ``rounds``."""
    base = step(-1)
    worst = {k: 0.0 for k in base}
    for r in range(rounds):
        out = step(r)
        for k in base:
            if k in out:
                worst[k] = max(worst[k], max_abs(out[k], base[k]))
    return worst


@dataclasses.dataclass
class Divergence:
    """One (step, tensor) above rounding."""

    step: int
    tensor: str
    error: float       #: max |impl − ref|
    rel: float         #: error / max|ref|
    rounding: float    #: the rounding level it is measured against (absolute)

    @property
    def ratio(self) -> float:
        return self.error / self.rounding if self.rounding > 0 else math.inf

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "tensor": self.tensor, "abs": self.error, "rel": self.rel,
                "rounding": self.rounding,
                "ratio": self.ratio if math.isfinite(self.ratio) else None}


@dataclasses.dataclass
class Localisation:
    """The first divergence of a teacher-forced run and what caused it."""

    first: Divergence | None
    #: the first state tensor above rounding (may be later than ``first``)
    state: Divergence | None
    #: how the rounding level was estimated
    estimate: str
    #: "formulation", "implementation", "reference" or None (see the module docstring)
    cause: str | None = None
    #: |impl − exact| and |ref − exact| (relative to max|ref|) at ``first``
    impl_to_exact: float | None = None
    ref_to_exact: float | None = None
    #: |exact_impl − exact_ref| (relative), where both twins exist
    formulation_gap: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"first": None if self.first is None else self.first.to_json(),
                "state": None if self.state is None else self.state.to_json(),
                "estimate": self.estimate, "cause": self.cause,
                "impl_to_exact": self.impl_to_exact, "ref_to_exact": self.ref_to_exact,
                "formulation_gap": self.formulation_gap}

    def summary(self) -> str:
        """One line: where, by how much, against what, and the cause."""
        if self.first is None:
            return f"no error above float32 rounding ({self.estimate})"
        f = self.first
        text = (f"first above float32 rounding: step {f.step}, {f.tensor} "
                f"({f.rel:.2e} rel, {f.ratio:.3g}× the rounding level; {self.estimate})")
        if self.state is not None and self.state.tensor != f.tensor:
            text += f"; first state: {self.state.tensor} at step {self.state.step}"
        if self.cause == "formulation":
            text += (f"; cause: formulation (the float64 steps differ by "
                     f"{self.formulation_gap:.2e} rel)")
        elif self.cause in ("implementation", "reference"):
            text += (f"; cause: {self.cause} rounding (from exact: implementation "
                     f"{self.impl_to_exact:.2e}, reference {self.ref_to_exact:.2e})")
        return text


def localise(impl: Sequence[Tensors], ref: Sequence[Tensors], *,
             exact: Sequence[Tensors] | None = None,
             exact_impl: Sequence[Tensors] | None = None,
             sensitivity_at: Callable[[int], Mapping[str, float]] | None = None,
             estimate: str | None = None) -> Localisation:
    """Locate the first divergence of a teacher-forced run.

    ``impl``, ``ref``: per step, the tensors compared (same names). ``exact``: per step the
    float64 result of the reference's mathematics from the same inputs (a spec's oracle, or
    the reference's float64 twin); ``exact_impl``: the implementation's float64 twin where
    it computes other mathematics than ``exact`` (None: ``exact`` is shared).
    ``sensitivity_at(t)``: per tensor, the step's movement under one-ulp input perturbations
    (absolute; see :func:`sensitivity`). ``estimate`` names how that was made.
    """
    if estimate is None:
        estimate = "ulp of each tensor's scale" if sensitivity_at is None else \
            "one-ulp input sensitivity"
    cache: dict[int, Mapping[str, float]] = {}

    def level(t: int, k: str, floor: float) -> float:
        if sensitivity_at is None:
            return floor
        if t not in cache:
            cache[t] = sensitivity_at(t)
        return max(floor, float(cache[t].get(k, 0.0)))

    first = state = None
    for t, (a, b) in enumerate(zip(impl, ref, strict=True)):
        found: list[Divergence] = []
        for k in b:
            if k not in a or (first is not None and not k.startswith("state/")):
                continue
            err = max_abs(a[k], b[k])
            floor = ulp_floor(b[k])
            if not (err > ROUNDING_FACTOR * floor or math.isnan(err)):
                continue
            lv = level(t, k, floor)
            if err > ROUNDING_FACTOR * lv or math.isnan(err):
                scale = float(np.max(np.abs(np.asarray(b[k], dtype=np.float64)))) \
                    if np.size(b[k]) else 0.0
                found.append(Divergence(t, k, err, err / scale if scale > 0 else math.inf, lv))
        if not found:
            continue
        found.sort(key=lambda d: -d.ratio if not math.isnan(d.error) else -math.inf)
        if first is None:
            first = found[0]
        states = [d for d in found if d.tensor.startswith("state/")]
        if state is None and states:
            state = states[0]
        if first is not None and state is not None:
            break
    loc = Localisation(first, state, estimate)
    if first is None or exact is None:
        return loc
    t, k = first.step, first.tensor
    scale = float(np.max(np.abs(np.asarray(ref[t][k], dtype=np.float64)))) or 1.0
    if k not in exact[t]:
        return loc
    ex = exact[t][k]
    if exact_impl is not None and k in exact_impl[t]:
        gap = max_abs(exact_impl[t][k], ex)
        loc.formulation_gap = gap / scale
        if gap > ROUNDING_FACTOR * first.rounding:
            loc.cause = "formulation"
            loc.impl_to_exact = max_abs(impl[t][k], exact_impl[t][k]) / scale
            loc.ref_to_exact = max_abs(ref[t][k], ex) / scale
            return loc
    loc.impl_to_exact = max_abs(impl[t][k], ex) / scale
    loc.ref_to_exact = max_abs(ref[t][k], ex) / scale
    loc.cause = "implementation" if loc.impl_to_exact > loc.ref_to_exact else "reference"
    return loc
