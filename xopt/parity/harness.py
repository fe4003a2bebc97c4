"""The parity harness: run implementations of a method on traces and compare them.

:func:`run_parity` is what ``xopt parity`` and ``parity_tests/`` call. For every trace and
mode it runs each selected implementation (xopt torch, xopt jax, the float64 oracle, and
the method's original implementations where installed) and compares each with the
reference named by ``against``: the trace itself (``"golden"``), the live original that
recorded it (``"original"``), or another runner (``"torch"``, ``"jax"``, ``"oracle"``).

Modes (FORMAT.md, "How a test should use them"):
  * teacher-forced: before update t every runner is reset to the trace's parameters and
    state after update t-1 (its ``init`` for t = 0), so each step's error is one update's;
  * closed loop: every runner starts from ``init`` and then runs on its own outputs, fed
    the recorded gradients and losses; errors may compound.

Tensors are compared by canonical name (``param/<name>``, ``state/<var>/<name>``) through
the spec's state schema, so implementations that lay state out differently still meet.
What the harness knows about a method beyond its spec (the originals, injection,
tolerances, a layer driver) is its :class:`~xopt.parity.methods.MethodParity`; xopt's own
implementations are found through :mod:`xopt.registry`.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import math
import platform
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from xopt import registry
from xopt.errors import HyperparameterError, TraceError
from xopt.parity.compare import TensorError, closer_to, errors
from xopt.parity.methods import MethodParity, Original, Tolerance, load_object
from xopt.parity.methods import get as get_parity
from xopt.parity.runners import OptaxRunner, OracleRunner, Runner, TorchRunner
from xopt.parity.trace import Trace, load_trace
from xopt.specs import Hyperparams, MethodSpec, Naming, ParamGroups, get

MODES = {"teacher": "teacher_forced", "closed": "closed_loop"}
BACKENDS = ("torch", "jax", "oracle", "original")
AGAINST = ("golden", "original", "torch", "jax", "oracle")

_REQUIRES = {"torch": ("torch",), "jax": ("jax", "optax"), "oracle": ()}


class BadRequest(HyperparameterError):
    """The request itself is invalid (unknown backend, unavailable reference, ...)."""


def available(modules: Sequence[str]) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def backend_ready(b: str, modules: Sequence[str], explicit: bool, notes: list[str],
                  hint: str = "") -> bool:
    """Whether backend ``b`` can run (``modules`` import). If not: :class:`BadRequest` when
    it was asked for by name (``explicit``), else a note that it was not run."""
    if available(modules):
        return True
    msg = f"backend {b!r} needs {', '.join(modules)}{hint}"
    if explicit:
        raise BadRequest(msg)
    notes.append(msg + "; not run")
    return False


def require_reference(against: str, requires: Mapping[str, Sequence[str]]) -> None:
    """A :class:`BadRequest` when the reference backend ``against`` cannot run here."""
    if against in requires and not available(requires[against]):
        raise BadRequest(f"--against {against} needs {', '.join(requires[against])}")


def trace_hyperparameters(trace: Trace) -> dict[str, Any]:
    """The manifest's hyperparameters (the original's names), with the learned optimizers'
    horizon (``num_training_steps``, given at init rather than to the constructor) added
    where the trace records one."""
    kwargs = dict(trace.hyperparameters)
    if trace.num_training_steps is not None:
        kwargs.setdefault("num_training_steps", trace.num_training_steps)
    return kwargs


def hyperparameters_of(origin: Original, trace: Trace) -> Any:
    """The spec's hyperparameters for ``trace``. ``from_kwargs`` reads nothing but the
    manifest's JSON, so any failure there (a mistyped value: ``"betas": "x"``) is bad input,
    a :class:`HyperparameterError` naming the trace."""
    try:
        return origin.from_kwargs(trace_hyperparameters(trace))
    except (HyperparameterError, TypeError, ValueError, KeyError, IndexError, AttributeError,
            ArithmeticError) as e:
        raise HyperparameterError(f"{trace.path}: hyperparameters: {e}") from None


def original_of(spec: MethodSpec, trace: Trace) -> Original:
    """The original implementation that recorded ``trace`` (from ``source.object``)."""
    obj = trace.source_object
    originals = get_parity(spec.name).originals
    for o in originals.values():
        if obj == o.name or obj.startswith(o.name + " "):
            return o
    raise TraceError(
        f"{trace.path}: source.object {obj!r} is not an original implementation of "
        f"{spec.name!r}; known: {', '.join(originals)}"
    )


@dataclasses.dataclass
class Step:
    params: dict[str, np.ndarray]
    state: dict[str, np.ndarray]

    def tensors(self) -> dict[str, np.ndarray]:
        out = {f"param/{k}": v for k, v in self.params.items()}
        out.update({f"state/{k}": v for k, v in self.state.items()})
        return out


@dataclasses.dataclass
class Run:
    """One comparison: ``backend`` against ``against`` on one trace in one mode."""

    trace: str
    backend: str
    impl: str
    against: str
    mode: str
    steps: int
    tolerance: Tolerance
    per_step: list[dict[str, TensorError]]
    oracle_agrees_with: str | None = None
    #: distance of the backend and of the reference from the exact (float64) result,
    #: relative, the largest over the entries beyond tolerance (else at the worst entry);
    #: None where no float64 result exists (see :func:`judge_against_exact`)
    backend_to_exact: float | None = None
    against_to_exact: float | None = None
    #: what "exact" was: "float64 oracle", "float64 twins", ...
    exact_estimate: str | None = None
    #: beyond tolerance, but at every such entry the backend is at least as close to the
    #: exact result as the reference: the excess is the reference's own rounding
    closer_to_exact: bool = False
    #: entries beyond tolerance the float64 result cannot judge ("step: tensor"): the two
    #: sides equally far from it, or the float64 step moving as much under input rounding
    undecided: list[str] = dataclasses.field(default_factory=list)
    #: the first divergence above float32 rounding (teacher-forced runs, where computed)
    localisation: Any = None

    @property
    def worst(self) -> tuple[int, str, TensorError]:
        best = (0, "", TensorError(0.0, 0.0))
        for t, errs in enumerate(self.per_step):
            for k, e in errs.items():
                if _worse(e, best[2]):
                    best = (t, k, e)
        return best

    @property
    def max_abs_error(self) -> float:
        return max((e.abs for errs in self.per_step for e in errs.values()), default=0.0,
                   key=_nan_max_key)

    @property
    def max_rel_error(self) -> float:
        return max((e.rel for errs in self.per_step for e in errs.values()), default=0.0,
                   key=_nan_max_key)

    @property
    def agrees(self) -> bool:
        return all(e.within(self.tolerance.for_tensor(k))
                   for errs in self.per_step for k, e in errs.items())

    @property
    def verdict(self) -> str:
        """``agree`` (within tolerance), ``closer_to_exact`` (beyond it, the backend at
        least as close to the exact result as the reference everywhere it is beyond) or
        ``diverge``."""
        if self.agrees:
            return "agree"
        return "closer_to_exact" if self.closer_to_exact else "diverge"

    def to_json(self) -> dict[str, Any]:
        t, k, _ = self.worst
        tensors = sorted({k for errs in self.per_step for k in errs})
        return {
            "trace": self.trace,
            "backend": self.backend,
            "impl": self.impl,
            "against": self.against,
            "mode": self.mode,
            "steps": self.steps,
            "max_abs_error": self.max_abs_error,
            "max_rel_error": self.max_rel_error,
            "worst": {"step": t, "tensor": k},
            "tolerance": self.tolerance.to_dict(),
            "verdict": self.verdict,
            "bitwise": self.max_abs_error == 0.0,
            "oracle_agrees_with": self.oracle_agrees_with,
            "exact": {"estimate": self.exact_estimate, "backend": self.backend_to_exact,
                      "against": self.against_to_exact, "undecided": self.undecided},
            "localisation": None if self.localisation is None else self.localisation.to_json(),
            "tolerance_reason": self.tolerance.why,
            "errors": {
                name: {"abs": [errs[name].abs for errs in self.per_step],
                       "rel": [errs[name].rel for errs in self.per_step]}
                for name in tensors
            },
        }


def _nan_max_key(x: float) -> float:
    return math.inf if math.isnan(x) else x


def _worse(e: TensorError, than: TensorError) -> bool:
    return _nan_max_key(e.rel) > _nan_max_key(than.rel) or (
        e.rel == than.rel and _nan_max_key(e.abs) > _nan_max_key(than.abs))


@dataclasses.dataclass
class Report:
    method: str
    traces: list[str]
    runs: list[Run]
    notes: list[str]

    @property
    def verdict(self) -> str:
        """``diverge`` if any run diverges, else ``closer_to_exact`` if any run is beyond
        tolerance while closer to exact than its reference, else ``agree``."""
        verdicts = {r.verdict for r in self.runs}
        for v in ("diverge", "closer_to_exact"):
            if v in verdicts:
                return v
        return "agree"

    def __str__(self) -> str:
        from xopt.parity.report import table

        return table(self)

    def to_json(self) -> dict[str, Any]:
        from xopt import __version__

        return {
            "method": self.method,
            "traces": self.traces,
            "verdict": self.verdict,
            "runs": [r.to_json() for r in self.runs],
            "notes": self.notes,
            "xopt_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "platform": f"{platform.system()} {platform.machine()} "
                        f"python {platform.python_version()}",
            "versions": _versions(),
        }


def _versions() -> dict[str, str]:
    import sys

    out = {"numpy": np.__version__}
    for name in ("torch", "jax", "optax"):
        if name in sys.modules:
            out[name] = getattr(sys.modules[name], "__version__", "?")
    return out


# -- building runners ---------------------------------------------------------------------


def make_runner(spec: MethodSpec, hp: Hyperparams, names: list[str], which: str, *,
                impl: str = "plain", device: str = "cpu",
                meta: dict[str, np.ndarray] | None = None) -> Runner:
    """A runner for ``which``: "torch", "jax", "oracle", or an original's name.

    ``meta``: a learned optimizer's weights in the original's naming (a trace's
    ``meta_params_file``), handed to every implementation.
    """
    if spec.meta is not None and meta is None:
        raise BadRequest(f"{spec.name} needs meta-parameters (the trace names none)")
    if which == "oracle":
        return OracleRunner(spec, hp, names, meta=meta)
    parity = get_parity(spec.name)
    extra = {} if spec.meta is None else {"meta_params": meta}
    if which in ("torch", "jax"):
        factory = registry.implementation(spec.name, which).factory
        takes_inject = parity.inject is not None
        if which == "torch":
            kwargs = dict(extra) if impl == "plain" else {"impl": impl, **extra}
            if isinstance(hp, ParamGroups):
                # torch param groups, each carrying its hyperparameters as ``spec``
                def make(ps: list[Any]) -> Any:
                    by_name = dict(zip(names, ps, strict=True))
                    groups = [{"params": [by_name[n] for n in g_names], "spec": g_hp}
                              for g_names, g_hp in hp.groups if g_names]
                    return factory(groups, spec=hp.first, **kwargs)
            else:
                def make(ps: list[Any]) -> Any:
                    return factory(ps, spec=hp, **kwargs)
            r: Runner = TorchRunner(
                spec, hp, names, label="xopt.torch", naming=spec.naming_of["torch"],
                factory=make, device=device, pass_loss=spec.takes_loss,
                takes_inject=takes_inject)
            r.impl = impl
            return r
        if isinstance(hp, ParamGroups):
            # optax: one setting per leaf, by name (the params are a flat dict)
            jax_kwargs = {"spec": hp.first, "param_specs": {n: hp.hp_of(n) for n in names}}
        else:
            jax_kwargs = {"spec": hp}
        return OptaxRunner(spec, hp, names, label="xopt.jax", naming=spec.naming_of["jax"],
                           factory=lambda: factory(**jax_kwargs, **extra),
                           pass_loss=spec.takes_loss, takes_inject=takes_inject)
    o = parity.original(which)
    ctor = load_object(o.factory)
    kwargs = o.to_kwargs(hp)
    naming = o.naming_for(hp)
    if o.backend == "learned_optimization":
        from xopt.parity.originals.learned_optimization import LearnedOptimizationRunner

        return LearnedOptimizationRunner(spec, hp, names, label=o.name, naming=naming,
                                         driver=ctor(meta, **kwargs))
    if o.backend == "torch":
        return TorchRunner(spec, hp, names, label=o.name, naming=naming,
                           factory=lambda ps: ctor(ps, **kwargs), device=device,
                           pass_loss=spec.takes_loss)
    return OptaxRunner(spec, hp, names, label=o.name, naming=naming,
                       factory=lambda: ctor(**kwargs), pass_loss=spec.takes_loss)


def _drive(runner: Runner, trace: Trace, spec: MethodSpec, hp: Hyperparams,
           naming: str | Naming, mode: str, steps: int, tick: Callable[[], None]) -> list[Step]:
    out = []
    inject_of = get_parity(spec.name).inject
    init_state = trace_state(trace, spec, hp, naming, -1)
    if mode == "closed_loop":
        runner.reset(trace.init_params(), init_state)
    for t in range(steps):
        if mode == "teacher_forced":
            if t == 0:
                runner.reset(trace.init_params(), init_state)
            else:
                runner.reset(trace.params_after(t - 1), trace_state(trace, spec, hp, naming,
                                                                    t - 1))
        inject = inject_of(trace, t, hp) if inject_of is not None else None
        runner.step(trace.grads(t), trace.loss(t), inject)
        out.append(Step(*runner.read()))
        tick()
    return out


def trace_state(trace: Trace, spec: MethodSpec, hp: Hyperparams, naming: str | Naming,
                t: int) -> dict[str, np.ndarray]:
    """The canonical state after update ``t`` (``t = -1``: ``init``, or None if unset),
    checked against the schema's shapes."""
    flat = trace.init_state() if t < 0 else trace.state_after(t)
    if t < 0 and not flat:
        return None
    if t < 0 and spec.meta is None:
        # A partial init state (what the original sets at construction, e.g. Flora's
        # seeds): the keys it lacks come from the spec's own initial state.
        full = spec.state.from_canonical(
            naming, spec.init_state(hp, trace.init_params(), xp=np,
                                    dtype=np.dtype(trace.manifest["dtype"])),
            list(trace.params), hp)
        flat = {**full, **flat}
    where = f"{trace.npz_path}: {'init' if t < 0 else f'step_{t:04d}'}/state"
    state = spec.state.to_canonical(naming, flat, list(trace.params), hp, where=where)
    spec.state.check_canonical(state, trace.params, hp, where=where)
    return state


def golden_steps(trace: Trace, spec: MethodSpec, hp: Hyperparams, naming: str | Naming,
                 steps: int) -> list[Step]:
    return [Step(trace.params_after(t), trace_state(trace, spec, hp, naming, t))
            for t in range(steps)]


# -- the harness -------------------------------------------------------------------------------


def plan_backends(spec: MethodSpec, hp: Hyperparams, backends: Sequence[str],
                  notes: list[str], explicit: bool, where: str = "") -> list[str]:
    """Expand "original" and drop what cannot run here (an error if asked for explicitly)."""
    out: list[str] = []
    for b in backends:
        if b not in BACKENDS:
            raise BadRequest(f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
        if b == "original":
            for o in get_parity(spec.name).originals.values():
                if not available(o.requires):
                    notes.append(f"{o.name} not run: needs {', '.join(o.requires)}")
                    continue
                try:
                    o.to_kwargs(hp)
                except HyperparameterError as e:
                    notes.append(f"{o.name} not run on {where}: {e}")
                    continue
                out.append(o.name)
            continue
        if not backend_ready(b, _REQUIRES[b], explicit, notes,
                             f" (pip install 'xopt-ml[{b}]')"):
            continue
        out.append(b)
    return out


def run_parity(method: str, traces: Sequence[str | Trace], *,
               backends: Sequence[str] = BACKENDS, against: str = "golden",
               modes: Sequence[str] = ("teacher_forced", "closed_loop"), impl: str = "plain",
               device: str = "cpu", max_steps: int | None = None, explicit_backends: bool = False,
               progress: Callable[[int], Callable[[], None]] | None = None,
               localise: bool = False) -> Report:
    """Run the parity comparisons and return a :class:`Report`.

    ``localise``: name, for every teacher-forced run, the first step and tensor whose
    error rises above float32 rounding and the side further from the float64 oracle
    (:func:`localise_run`; it reruns the oracle on perturbed inputs at the steps that
    need it).

    Raises :class:`UnknownMethodError`, :class:`TraceError`, :class:`HyperparameterError`
    (and its subclass :class:`BadRequest`) for bad input, before any long computation.
    """
    spec = get(method)
    parity = get_parity(method)
    if against not in AGAINST:
        raise BadRequest(f"unknown reference {against!r}; choose from {', '.join(AGAINST)}")
    for m in modes:
        if m not in MODES.values():
            raise BadRequest(f"unknown mode {m!r}; choose from teacher, closed")
    if impl not in spec.impls:
        raise BadRequest(f"{method} has no {impl!r} implementation; available: "
                         f"{', '.join(spec.impls)}")
    if not traces:
        raise BadRequest(f"no traces given for {method}")
    loaded = [t if isinstance(t, Trace) else load_trace(t) for t in traces]
    notes: list[str] = []
    jobs = []
    layer_runs: list[Run] = []
    for trace in loaded:
        if trace.method != method:
            raise TraceError(f"{trace.path}: trace is for method {trace.method!r}, not {method!r}")
        if trace.kind == "layer":
            if parity.layer is None:
                raise TraceError(f"{trace.path}: a layer trace, and {method} has no layer harness")
            layer_runs += parity.layer(trace, backends=backends, against=against, modes=modes,
                                 impl=impl, device=device, max_steps=max_steps, notes=notes,
                                 explicit_backends=explicit_backends)
            continue
        origin = original_of(spec, trace)
        hp = hyperparameters_of(origin, trace)
        steps = trace.steps if max_steps is None else min(max_steps, trace.steps)
        selected = plan_backends(spec, hp, backends, notes, explicit_backends, trace.name)
        if against in ("golden", "oracle"):
            reference = against
        elif against == "original":
            if not available(origin.requires):
                raise BadRequest(f"--against original needs {origin.name}, which needs "
                                 f"{', '.join(origin.requires)}")
            reference = origin.name
        else:
            require_reference(against, _REQUIRES)
            reference = against
        naming = origin.naming_for(hp)
        for t in range(-1, steps):  # every recorded state, checked before any run starts
            trace_state(trace, spec, hp, naming, t)
        meta = trace.meta_params() if spec.meta is not None else None
        if meta is not None:
            spec.meta.coerce(meta, hp)  # names and shapes checked before any run starts
        jobs.append((trace, origin, hp, steps, selected, reference, meta))

    total = sum(len(set(sel) | ({ref} - {"golden"}) | {"oracle"}) * steps * len(modes)
                for _, _, _, steps, sel, ref, _ in jobs)
    tick = progress(total) if progress else (lambda: None)
    runs: list[Run] = list(layer_runs)
    for trace, origin, hp, steps, selected, reference, meta in jobs:
        names = list(trace.params)
        naming = origin.naming_for(hp)
        needed = list(dict.fromkeys([*selected, "oracle",
                                     *([reference] if reference != "golden" else [])]))
        for mode in modes:
            outputs: dict[str, list[Step]] = {}
            for which in needed:
                runner = make_runner(spec, hp, names, which, impl=impl, device=device,
                                     meta=meta)
                outputs[backend_label(which)] = _drive(runner, trace, spec, hp, naming, mode,
                                                steps, tick)
            outputs["golden"] = golden_steps(trace, spec, hp, naming, steps)
            ref_label = backend_label(reference)
            for which in selected:
                label = backend_label(which)
                if label == ref_label:
                    continue
                runs.append(_compare(parity, hp, trace, label, ref_label, mode, outputs,
                                     impl if which == "torch" else "plain", origin))
                if localise and mode == "teacher_forced" and label != "oracle":
                    localise_run(runs[-1], outputs[label], outputs[ref_label],
                                 outputs["oracle"], spec, hp, names, trace, naming, meta)
    return Report(method=method, traces=[t.name for t in loaded], runs=runs,
                  notes=list(dict.fromkeys(notes)))


def backend_label(which: str) -> str:
    """A backend's name in reports (``xopt.torch``, ``xopt.jax``; others as they are)."""
    return {"torch": "xopt.torch", "jax": "xopt.jax"}.get(which, which)


def _tolerance(parity: MethodParity, hp: Hyperparams, label: str, ref: str,
               mode: str) -> Tolerance:
    pairs = parity.bitwise(hp)
    xopt_backend = {"xopt.torch": "torch", "xopt.jax": "jax"}
    for a, b in ((label, ref), (ref, label)):
        if (xopt_backend.get(a), b) in pairs:
            return parity.tolerance("bitwise")
    if "oracle" in (label, ref) and f"{mode}/oracle" in parity.tolerances:
        return parity.tolerance(f"{mode}/oracle")
    return parity.tolerance(mode)


def _compare(parity: MethodParity, hp: Hyperparams, trace: Trace, label: str, ref: str,
             mode: str, outputs: dict[str, list[Step]], impl: str, origin: Original) -> Run:
    a_steps, b_steps = outputs[label], outputs[ref]
    per_step = []
    for a, b in zip(a_steps, b_steps, strict=True):
        per_step.append(errors(a.tensors(), b.tensors()))
    run = Run(trace=trace.name, backend=label, impl=impl, against=ref, mode=mode,
              steps=len(per_step), tolerance=_tolerance(parity, hp, label, ref, mode),
              per_step=per_step)
    if "oracle" in outputs and "oracle" not in (label, ref):
        t, k, _ = run.worst
        if k:
            run.oracle_agrees_with = closer_to(outputs["oracle"][t].tensors()[k],
                                               a_steps[t].tensors()[k], b_steps[t].tensors()[k])
        sens = None
        if mode == "teacher_forced" and not run.agrees:
            spec = get(parity.method)
            meta = trace.meta_params() if spec.meta is not None else None
            sens = oracle_sensitivity(spec, hp, list(trace.params), trace,
                                      origin.naming_for(hp), meta)
        judge_against_exact(run, [s.tensors() for s in a_steps],
                            [s.tensors() for s in b_steps],
                            [s.tensors() for s in outputs["oracle"]], estimate="float64 oracle",
                            sensitivity_at=sens)
    return run


def oracle_sensitivity(spec: MethodSpec, hp: Hyperparams, names: list[str], trace: Trace,
                       naming: str, meta: dict[str, np.ndarray] | None,
                       ) -> Callable[[int], dict[str, float]]:
    """``at(t)``: per tensor, how far the float64 oracle's teacher-forced step t moves when
    the trace's parameters, state and gradient before it are rounded once more
    (:func:`xopt.parity.localise.sensitivity`); computed on first use per step."""
    from xopt.parity.localise import perturb, sensitivity

    cache: dict[int, dict[str, float]] = {}

    def at(t: int) -> dict[str, float]:
        if t in cache:
            return cache[t]
        params = trace.init_params() if t == 0 else trace.params_after(t - 1)
        state = trace_state(trace, spec, hp, naming, t - 1)
        grads, loss = trace.grads(t), trace.loss(t)
        inject_of = get_parity(spec.name).inject
        inject = inject_of(trace, t, hp) if inject_of is not None else None

        def step(seed: int) -> dict[str, np.ndarray]:
            runner = make_runner(spec, hp, names, "oracle", meta=meta)
            if seed < 0:
                runner.reset(params, state)
                runner.step(grads, loss, inject)
            else:
                rng = np.random.default_rng(seed)
                runner.reset(perturb(params, rng), None if state is None else perturb(state, rng))
                runner.step(perturb(grads, rng), loss, inject)
            return Step(*runner.read()).tensors()

        cache[t] = sensitivity(step)
        return cache[t]

    return at


def localise_run(run: Run, backend: Sequence[Step], against: Sequence[Step],
                 oracle: Sequence[Step], spec: MethodSpec, hp: Hyperparams, names: list[str],
                 trace: Trace, naming: str, meta: dict[str, np.ndarray] | None) -> None:
    """Set ``run.localisation`` (see :mod:`xopt.parity.localise`): the rounding level of
    step t is the float64 oracle's movement when the trace's parameters, state and
    gradient before step t are rounded once more (:func:`oracle_sensitivity`)."""
    from xopt.parity.localise import localise

    run.localisation = localise([s.tensors() for s in backend], [s.tensors() for s in against],
                                exact=[s.tensors() for s in oracle],
                                sensitivity_at=oracle_sensitivity(spec, hp, names, trace, naming,
                                                                  meta),
                                estimate="float64 oracle")


def judge_against_exact(run: Run, backend: Sequence[Mapping[str, np.ndarray]],
                        against: Sequence[Mapping[str, np.ndarray]],
                        exact: Sequence[Mapping[str, np.ndarray]] | None,
                        exact_backend: Sequence[Mapping[str, np.ndarray]] | None = None, *,
                        estimate: str = "float64 twins",
                        sensitivity_at: Callable[[int], Mapping[str, float]] | None = None,
                        ) -> None:
    """Measure both sides of ``run`` against the exact (float64) result, per step.

    ``exact``: the float64 result of the reference's mathematics (a spec's oracle, or the
    reference's float64 twin); ``exact_backend``: the backend's own float64 twin where it
    may compute other mathematics. Sets ``backend_to_exact``/``against_to_exact`` (relative,
    the largest over the entries beyond tolerance, else at the worst entry) and
    ``closer_to_exact``.

    Each entry (step, tensor) beyond tolerance is judged: the side nearer the exact result
    is the closer one, unless the exact result itself moves by at least the two sides'
    distance when its inputs are rounded once more (``sensitivity_at(t)[tensor]``, see
    :func:`xopt.parity.localise.sensitivity`; teacher-forced runs): there the float64 result
    cannot tell them apart, and the entry is undecided; so is one where the two distances
    differ by no more than a few float32 ulps of the tensor. The run is closer to exact when no
    entry has the reference closer and at least one has the backend closer; float64 twins
    that disagree (the pair computes different mathematics) keep it a divergence.
    """
    from xopt.parity.localise import ROUNDING_FACTOR, max_abs, ulp_floor

    if exact is None:
        return
    run.exact_estimate = estimate
    over = [(t, k) for t, errs in enumerate(run.per_step) for k, e in errs.items()
            if not e.within(run.tolerance.for_tensor(k))]
    entries = over or ([run.worst[:2]] if run.worst[1] else [])
    backend_closer, against_closer, formulation = 0, 0, False
    undecided: list[str] = []
    worst_b = worst_a = 0.0
    decided_b = decided_a = None
    for t, k in entries:
        if k not in exact[t] or k not in backend[t] or k not in against[t]:
            against_closer += 1  # nothing to judge by: not in the backend's favour
            continue
        ref, ex = against[t][k], exact[t][k]
        scale = float(np.max(np.abs(np.asarray(ref, dtype=np.float64)))) if np.size(ref) else 0
        scale = scale or 1.0
        db, da = max_abs(backend[t][k], ex) / scale, max_abs(ref, ex) / scale
        worst_b, worst_a = max(worst_b, db, key=_nan_max_key), max(worst_a, da, key=_nan_max_key)
        if exact_backend is not None and k in exact_backend[t] and (
                max_abs(exact_backend[t][k], ex) > ROUNDING_FACTOR * ulp_floor(ref)):
            formulation = True
        if not over:
            continue
        moves = sensitivity_at(t).get(k, 0.0) if sensitivity_at is not None else 0.0
        if moves >= max_abs(backend[t][k], ref) or (
                abs(db - da) * scale <= ROUNDING_FACTOR * ulp_floor(ref)):
            undecided.append(f"{t}: {k}")
            continue
        decided_b = max(decided_b or 0.0, db, key=_nan_max_key)
        decided_a = max(decided_a or 0.0, da, key=_nan_max_key)
        if db <= da:
            backend_closer += 1
        else:
            against_closer += 1
    # the distances where the float64 result decides, where it decides anywhere
    run.backend_to_exact = worst_b if decided_b is None else decided_b
    run.against_to_exact = worst_a if decided_a is None else decided_a
    run.undecided = undecided
    if formulation:
        run.exact_estimate = f"{estimate} (they differ: another formulation)"
    run.closer_to_exact = (backend_closer > 0 and against_closer == 0 and not formulation)


# -- internals: where in the update a divergence starts ----------------------------------------


def aux_errors(method: str, trace: str | Trace, *, max_steps: int | None = None,
               ) -> dict[str, tuple[float, int]]:
    """The spec's internals against the trace's ``aux``, one teacher-forced update at a time.

    The spec runs in NumPy float32 (the original's precision) from the recorded state
    before each update, collecting the internals the trace records (for the learned
    optimizers: LSTM inputs, controls, lr_mult, the mixed MLP weights, the per-element MLP
    outputs, the normaliser statistics). Returns ``{aux key: (max relative error over the
    steps, the step where it peaks)}`` for every key both sides have: the earliest stage
    whose error jumps is where a divergence starts. Steps without recorded aux (prefab's
    accumulation calls) are skipped.
    """
    from xopt.parity.compare import tensor_error

    spec, parity = get(method), get_parity(method)
    t = trace if isinstance(trace, Trace) else load_trace(trace)
    origin = original_of(spec, t)
    hp = hyperparameters_of(origin, t)
    naming = origin.naming_for(hp)
    meta = t.meta_params() if spec.meta is not None else None
    extra = {"meta": meta} if meta is not None else {}
    steps = t.steps if max_steps is None else min(max_steps, t.steps)
    out: dict[str, tuple[float, int]] = {}

    def f32(a: Any) -> Any:
        a = np.asarray(a)
        return a.astype(np.float32) if np.issubdtype(a.dtype, np.floating) else a

    for s in range(steps):
        recorded = t.aux(s)
        if not recorded:
            continue
        params = t.init_params() if s == 0 else t.params_after(s - 1)
        state = trace_state(t, spec, hp, naming, s - 1)
        if state is None:
            state = spec.init_state(hp, params, xp=np, dtype=np.float32, **extra)
        aux: dict[str, Any] = {}
        loss = t.loss(s)
        kw = dict(extra)
        inject = parity.inject(t, s, hp) if parity.inject is not None else None
        if inject:  # the original's own draws, as the runners get them
            kw["inject"] = {p: {k: f32(v) for k, v in d.items()} for p, d in inject.items()}
        spec.step(hp, {k: f32(v) for k, v in params.items()},
                  {k: f32(v) for k, v in state.items()},
                  {k: f32(v) for k, v in t.grads(s).items()}, xp=np,
                  loss=None if loss is None else np.float32(loss), aux=aux, **kw)
        for k in sorted(set(aux) & set(recorded)):
            e = tensor_error(np.asarray(aux[k]), recorded[k]).rel
            if k not in out or _nan_max_key(e) > _nan_max_key(out[k][0]):
                out[k] = (e, s)
    return out
