"""Compare any two optimizer implementations, or one against a trace: :func:`compare`.

``A`` is the reference (a trace, or a live implementation recorded on a problem first) and
``B`` the implementation under test (live). Both are fed A's recorded gradients and losses:

* teacher-forced: before update t, B is set to A's parameters and state after update t−1
  (its own fresh state at t = 0, so differing initial values show at the first step),
  so each step's error is one update's;
* closed loop: B starts from A's initial parameters and then runs on its own outputs.

State is matched between the two by name and shape: identical keys, then the pairs in
:data:`STATE_SYNONYMS` (torch's ``exp_avg`` is optax's ``mu``, ...), then ``mapping``.
B's state that changes from step to step and matches nothing stops a teacher-forced run
with a :class:`StateMatchError` listing it. The float64 twin of each live side (the same
code in float64; optax under ``jax.enable_x64``) estimates its exact result: where the two
twins agree the pair computes the same mathematics and the twin is the oracle the verdict
measures both sides against (:mod:`xopt.parity.localise` for the first divergence).

The result is the harness's :class:`~xopt.parity.harness.Report`, so ``xopt compare``
prints, writes and plots it as ``xopt parity`` does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xopt.errors import XoptError
from xopt.parity.compare import errors, tensor_error
from xopt.parity.harness import MODES, Report, Run, judge_against_exact
from xopt.parity.localise import localise, perturb, sensitivity
from xopt.parity.methods import Tolerance
from xopt.parity.recorder import (
    Implementation,
    Problem,
    RecordError,
    Recording,
    implementation,
    record,
)
from xopt.parity.trace import Trace

Arrays = dict[str, np.ndarray]

#: Names one library gives the state another names otherwise, as (torch.optim, optax)
#: pairs, in the order they are tried: the first pair whose names both sides hold, for the
#: same parameter and of the same shape, claims them.
STATE_SYNONYMS: tuple[tuple[str, str], ...] = (
    ("exp_avg", "mu"),             # Adam's m (torch adam.py; optax ScaleByAdamState)
    ("exp_avg_sq", "nu"),          # Adam's v
    ("max_exp_avg_sq", "nu_max"),  # AMSGrad's max v (optax ScaleByAmsgradState)
    ("grad_avg", "mu"),            # centered RMSprop's mean (optax ScaleByRStdDevState)
    ("square_avg", "nu"),          # RMSprop's mean square (optax ScaleByRmsState)
    ("momentum_buffer", "trace"),  # heavy-ball momentum (optax TraceState)
    ("momentum_buffer", "mu"),     # Muon's momentum (optax MuonState)
    ("sum", "sum_of_squares"),     # Adagrad's accumulator (optax ScaleByRssState)
    ("exp_inf", "nu"),             # Adamax's infinity norm (optax scale_by_adamax)
    ("square_avg", "e_g"),         # Adadelta's E[g²] (optax ScaleByAdaDeltaState)
    ("acc_delta", "e_x"),          # Adadelta's E[Δx²]
    ("step", "count"),             # the update count: per tensor in torch, one in optax
)

#: default bounds of :func:`compare` (a named method's own tolerances live in its spec)
TOLERANCES = {
    "teacher_forced": Tolerance(
        1e-6, 0.0, "one float32 update: a handful of operations rounded in another order "
                   "(2⁻²⁴ ≈ 6e-8 each) stay well inside 1e-6 of the tensor's largest value"),
    "closed_loop": Tolerance(
        1e-5, 0.0, "per-update rounding of ~1e-7 accumulating over a run of at most 50 steps "
                   "fed the same gradients"),
}


class StateMatchError(XoptError, ValueError):
    """B's state cannot be set from A's: the message lists what matched nothing."""


Source = str | Callable[[Mapping[str, np.ndarray], str | None], np.ndarray]

#: a :func:`match_state` mapping source: the number of updates taken (for a count that
#: the reference does not keep, such as optax.contrib.muon's against torch.optim.Muon)
COUNT = "@count"


@dataclasses.dataclass
class StateMatch:
    """How B's state keys are fed from A's (``sources``) and what is left over."""

    sources: dict[str, Source]   #: B key -> A key, or f(A's flat state, param) -> array
    params_of: dict[str, str | None]  #: B key -> its parameter (None: global)
    own: list[str]               #: B keys left to B (constant over its own first step)
    unmatched: list[str]         #: B keys that change and match nothing
    unused: list[str]            #: A keys no B key reads

    def feed(self, a_state: Mapping[str, np.ndarray], updates: int) -> Arrays:
        """B's state from A's after ``updates`` updates."""
        out = {}
        for bk, src in self.sources.items():
            if src == COUNT:
                out[bk] = np.asarray(updates)
            elif isinstance(src, str):
                out[bk] = np.asarray(a_state[src])
            else:
                out[bk] = np.asarray(src(a_state, self.params_of[bk]))
        return out

    def compared(self) -> dict[str, str]:
        """Report name -> B key: ``state/<A key>`` (``state/<B key>`` for derived ones)."""
        return {f"state/{src if isinstance(src, str) and src != COUNT else bk}": bk
                for bk, src in self.sources.items() if src != COUNT}


def _parts(key: str, names: Sequence[str], framework: str) -> tuple[str | None, str]:
    """(parameter, variable path) of a flat state key: torch ``<param>/<var>``, optax
    ``<path>/<param>`` (a global leaf has no parameter)."""
    best = None
    for n in names:
        if framework == "torch":
            hit = key.startswith(n + "/")
        else:
            hit = key == n or key.endswith("/" + n)
        if hit and (best is None or len(n) > len(best)):
            best = n
    if best is None:
        return None, key
    if framework == "torch":
        return best, key[len(best) + 1:]
    return best, key[: -len(best)].rstrip("/")


def _leaf(var: str) -> str:
    return var.rsplit("/", 1)[-1]


def match_state(a_state: Mapping[str, np.ndarray], a_framework: str,
                b_state: Mapping[str, np.ndarray], b_framework: str,
                b_constant: set[str], names: Sequence[str],
                mapping: Mapping[str, Source] | None = None) -> StateMatch:
    """Match B's flat state keys to A's (see the module docstring). ``b_constant``: B keys
    whose value its own first step left unchanged (hyperparameters, empty states).

    ``mapping``: ``{B key or B variable: A key or A variable, or f(A state, param)}``; a
    variable (``"mu_product"``, ``"0/mu"``) applies to every parameter that has it."""
    mapping = dict(mapping or {})
    a_parts = {k: _parts(k, names, a_framework) for k in a_state}
    b_parts = {k: _parts(k, names, b_framework) for k in b_state}
    a_by = {(p, v): k for k, (p, v) in a_parts.items()}
    sources: dict[str, Source] = {}
    claimed_a: set[str] = set()

    def a_key(param: str | None, var: str) -> str | None:
        if (param, var) in a_by:
            return a_by[(param, var)]
        if var in a_state:
            return var
        return None

    # 1. the user's mapping, exact keys first, then variables per parameter
    for bk, (bp, bv) in b_parts.items():
        src = mapping.get(bk, mapping.get(bv, mapping.get(_leaf(bv))))
        if src is None:
            continue
        if callable(src) or src == COUNT:
            sources[bk] = src
            continue
        found = src if src in a_state else a_key(bp, src)
        if found is None:
            for (ap, av), k in a_by.items():
                if ap == bp and _leaf(av) == src:
                    found = k
        if found is None:
            raise StateMatchError(f"mapping {bk!r} -> {src!r}: A has no state {src!r}"
                                  + (f" for parameter {bp!r}" if bp else "")
                                  + f"; A's state: {', '.join(sorted(a_state))}")
        sources[bk] = found
        claimed_a.add(found)

    def fits(ak: str, bk: str) -> bool:
        return np.shape(a_state[ak]) == np.shape(b_state[bk])

    # 2. identical keys (the same library on both sides)
    for bk in b_state:
        if bk not in sources and bk in a_state and fits(bk, bk):
            sources[bk] = bk
            claimed_a.add(bk)
    # 3. synonyms, pair by pair, per parameter; a global count feeds every B count
    for t_name, o_name in STATE_SYNONYMS:
        for bk, (bp, bv) in b_parts.items():
            if bk in sources:
                continue
            leaf = _leaf(bv)
            other = o_name if leaf == t_name else t_name if leaf == o_name else None
            if other is None:
                continue
            candidates = [ak for ak, (ap, av) in a_parts.items()
                          if _leaf(av) == other and fits(ak, bk)
                          and (ap == bp or (leaf in ("step", "count") and (
                              ap is None or bp is None or ap == names[0])))
                          and (ak not in claimed_a or leaf in ("step", "count"))]
            if bp is None and leaf in ("step", "count"):
                candidates = [ak for ak in candidates if a_parts[ak][0] in (None, names[0])]
            if candidates:
                sources[bk] = candidates[0]
                claimed_a.add(candidates[0])
    # torch keeps one count per tensor: the copies a global count stands for are read
    counts = {_leaf(v) for src in sources.values() if isinstance(src, str) and src in a_parts
              for v in [a_parts[src][1]] if _leaf(v) in ("step", "count")}
    claimed_a |= {k for k, (_, v) in a_parts.items() if _leaf(v) in counts}
    own = sorted(k for k in b_state if k not in sources and k in b_constant)
    unmatched = sorted(k for k in b_state if k not in sources and k not in b_constant)
    unused = sorted(k for k in a_state if k not in claimed_a)
    return StateMatch(sources, {k: b_parts[k][0] for k in b_state}, own, unmatched, unused)


# -- running one step ------------------------------------------------------------------------


def _run(impl: Implementation, params: Mapping[str, np.ndarray],
         state: Mapping[str, np.ndarray] | None, grads: Mapping[str, np.ndarray],
         loss: float) -> tuple[Arrays, Arrays]:
    impl.start(params)
    if state is not None:
        impl.set_state(state)
    impl.step(grads, loss)
    return impl.read()


@dataclasses.dataclass
class _Side:
    """How to read one side's output as the compared tensors."""

    kind: str                    # "a" (A's naming) or "b" (B's naming)
    match: StateMatch

    def tensors(self, params: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray],
                ) -> Arrays:
        out = {f"param/{k}": np.asarray(v) for k, v in params.items()}
        for name, bk in self.match.compared().items():
            if self.kind == "b":
                if bk in state:
                    out[name] = np.asarray(state[bk])
            else:
                src = self.match.sources[bk]
                try:
                    out[name] = np.asarray(state[src] if isinstance(src, str)
                                           else src(state, self.match.params_of[bk]))
                except KeyError:
                    continue
        return out


def _resolve(x: Any, what: str) -> tuple[Recording | None, Implementation | None]:
    if isinstance(x, Recording):
        return x, x.implementation()
    if isinstance(x, Trace):
        rec = Recording.from_trace(x)
        return rec, rec.implementation()
    if isinstance(x, (str, Path)) and (str(x).endswith((".json", ".npz")) or Path(x).is_file()):
        rec = Recording.from_trace(str(x))
        return rec, rec.implementation()
    try:
        return None, implementation(x)
    except RecordError as e:
        raise RecordError(f"{what}: {e}") from None


def compare(a: Any, b: Any, *, problem: str | Problem = "mlp", steps: int | None = None,
            seed: int = 0, modes: Sequence[str] = ("teacher_forced", "closed_loop"),
            mapping: Mapping[str, Source] | None = None,
            tolerances: Mapping[str, Tolerance] | None = None,
            find_first: bool = True, record_to: str | Path | None = None) -> Report:
    """Compare implementation ``b`` with reference ``a`` (module docstring).

    ``a``: a trace (path, :class:`Trace` or :class:`Recording`) or a live implementation
    (anything :func:`~xopt.parity.recorder.record` takes), which is first recorded on
    ``problem`` for ``steps`` (default 20) with ``seed`` (and written to ``record_to``
    when given). ``b``: a live implementation, or a trace whose manifest names a call
    that can be rebuilt (``source.call``). ``modes``: ``"teacher_forced"``,
    ``"closed_loop"`` (or ``"teacher"``, ``"closed"``). ``mapping``: see
    :func:`match_state`. ``tolerances``: per mode, default :data:`TOLERANCES`.
    ``find_first``: localise the first divergence of teacher-forced runs.
    """
    modes = [MODES.get(m, m) for m in modes]
    for m in modes:
        if m not in MODES.values():
            raise RecordError(f"unknown mode {m!r}; choose from teacher, closed")
    tol = {**TOLERANCES, **(tolerances or {})}
    rec_a, impl_a = _resolve(a, "A")
    _, impl_b = _resolve(b, "B")
    if impl_b is None:
        raise RecordError("B is a trace whose manifest names no call that can be rebuilt "
                          "here (source.call): compare needs B live")
    notes: list[str] = []
    if rec_a is None:
        rec_a = record(impl_a, problem, steps=20 if steps is None else steps, seed=seed,
                       path=record_to)
        notes.append(f"A ({impl_a.label}): {rec_a.manifest['source']['notes'][0]}")
    n = rec_a.steps if steps is None else min(steps, rec_a.steps)
    names = list(rec_a.params)
    a_label = rec_a.manifest["source"].get("object") or rec_a.manifest["method"]
    a_framework = rec_a.manifest["source"].get("framework") or (
        impl_a.framework if impl_a is not None else "torch")
    if impl_a is None:
        notes.append(f"A ({a_label}) has no live implementation here (its manifest names no "
                     f"call): no float64 twin of the reference")

    # B's own first step: its state keys, and which of them its step leaves unchanged
    p0, g0, l0 = rec_a.init_params(), rec_a.grads(0), rec_a.loss(0)
    impl_b.start(p0)
    b_init = impl_b.read()[1]
    impl_b.step(g0, l0)
    b_state0 = impl_b.read()[1]
    constant = {k for k, v in b_state0.items()
                if k in b_init and np.shape(b_init[k]) == np.shape(v)
                and np.array_equal(np.asarray(b_init[k]), np.asarray(v))}
    a_state0 = rec_a.state_after(0)
    match = match_state(a_state0, a_framework, b_state0, impl_b.framework, constant, names,
                        mapping)
    if match.unmatched:
        msg = (f"{impl_b.label}'s state {', '.join(match.unmatched)} matches nothing in "
               f"{a_label}'s ({', '.join(sorted(a_state0)) or 'none'}); pass "
               f"mapping={{B key or variable: A key or variable, or f(A state, param)}}")
        if "teacher_forced" in modes:
            raise StateMatchError(msg + ", or compare closed loop only")
        notes.append(msg + "; closed loop compares parameters and the matched state only")
    if match.unused:
        notes.append(f"A's state not compared (no counterpart in {impl_b.label}): "
                     f"{', '.join(match.unused)}")

    a64 = impl_a.twin(np.float64) if impl_a is not None else None
    b64 = impl_b.twin(np.float64)
    a_side, b_side = _Side("a", match), _Side("b", match)
    if a64 is not None:  # learn the twin's own layout (dtypes of its state) once
        _run(a64, p0, None, g0, l0)
    _run(b64, p0, None, g0, l0)

    runs = []
    trace_name = rec_a.name
    for mode in modes:
        ref, mine, ex_a, ex_b = [], [], [], []
        if mode == "closed_loop":
            impl_b.start(p0)
            if a64 is not None:
                a64.start(p0)
            b64.start(p0)
        for t in range(n):
            grads, loss = rec_a.grads(t), rec_a.loss(t)
            ref.append(a_side.tensors(rec_a.params_after(t), rec_a.state_after(t)))
            if mode == "teacher_forced":
                pa = p0 if t == 0 else rec_a.params_after(t - 1)
                sa = None if t == 0 else rec_a.state_after(t - 1)
                fed = None if sa is None else match.feed(sa, t)
                mine.append(b_side.tensors(*_run(impl_b, pa, fed, grads, loss)))
                if a64 is not None:
                    ex_a.append(a_side.tensors(*_run(a64, pa, sa, grads, loss)))
                ex_b.append(b_side.tensors(*_run(b64, pa, fed, grads, loss)))
            else:
                impl_b.step(grads, loss)
                mine.append(b_side.tensors(*impl_b.read()))
                if a64 is not None:
                    a64.step(grads, loss)
                    ex_a.append(a_side.tensors(*a64.read()))
                b64.step(grads, loss)
                ex_b.append(b_side.tensors(*b64.read()))
        per_step = [errors(m, r, keys=list(r)) for m, r in zip(mine, ref, strict=True)]
        run = Run(trace=trace_name, backend=impl_b.label, impl="plain", against=a_label,
                  mode=mode, steps=n, tolerance=tol[mode], per_step=per_step)
        exact = ex_a if a64 is not None else None
        judge_against_exact(run, mine, ref, exact, ex_b if exact is not None else None)
        t, k, _ = run.worst
        if exact is not None and k and k in exact[t]:
            run.oracle_agrees_with = _closer(exact[t][k], mine[t][k], ref[t][k])
        if exact is None:
            if k and k in ex_b[t]:
                run.exact_estimate = "float64 twin of the implementation only"
                run.oracle_agrees_with = _closer(ex_b[t][k], mine[t][k], ref[t][k])
        if find_first and mode == "teacher_forced":
            run.localisation = _localise(rec_a, match, impl_b, a64, b64, mine, ref,
                                         ex_a if a64 is not None else None, ex_b, names)
        elif find_first and "teacher_forced" not in modes:
            # no one-step run to localise on: the closed loop's first step is one, later
            # ones compound, so only the tensors' own rounding is the yardstick
            run.localisation = localise(
                mine, ref, exact=exact if exact is not None else ex_b,
                exact_impl=ex_b if exact is not None else None,
                estimate="ulp of each tensor's scale, closed loop")
        runs.append(run)
    return Report(method=f"{impl_b.label} vs {a_label}", traces=[trace_name], runs=runs,
                  notes=list(dict.fromkeys(notes)))


def _closer(oracle: np.ndarray, a: np.ndarray, b: np.ndarray) -> str:
    da, db = tensor_error(a, oracle).abs, tensor_error(b, oracle).abs
    if math.isnan(da) or math.isnan(db) or da == db:
        return "tie"
    return "backend" if da < db else "against"


def _localise(rec_a: Recording, match: StateMatch, impl_b: Implementation,
              a64: Implementation | None, b64: Implementation, mine: list[Arrays],
              ref: list[Arrays], ex_a: list[Arrays] | None, ex_b: list[Arrays],
              names: list[str]):
    """Teacher-forced localisation; the rounding level from the reference's float64 twin
    (else the implementation's) under one-ulp perturbations of A's inputs at that step."""
    a_side, b_side = _Side("a", match), _Side("b", match)
    twin, side, estimate = (a64, a_side, "float64 twins") if a64 is not None else \
        (b64, b_side, "float64 twin of the implementation")

    def at(t: int) -> dict[str, float]:
        pa = rec_a.init_params() if t == 0 else rec_a.params_after(t - 1)
        sa = None if t == 0 else rec_a.state_after(t - 1)
        if sa is not None and side.kind == "b":
            sa = match.feed(sa, t)
        grads, loss = rec_a.grads(t), rec_a.loss(t)

        def step(seed: int) -> Arrays:
            if seed < 0:
                return side.tensors(*_run(twin, pa, sa, grads, loss))
            rng = np.random.default_rng(seed)
            p, g = perturb(pa, rng), perturb(grads, rng)
            s = None if sa is None else perturb(sa, rng)
            return side.tensors(*_run(twin, p, s, g, loss))

        return sensitivity(step)

    return localise(mine, ref, exact=ex_a if ex_a is not None else ex_b,
                    exact_impl=ex_b if ex_a is not None else None, sensitivity_at=at,
                    estimate=estimate)
