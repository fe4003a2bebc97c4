"""Localisation and the oracle-aware verdict on injected faults.

Four faults (a changed ε, swapped bias corrections, a dropped weight decay, a transposed
second moment), each switched on at one step for one tensor, in two settings: an optax
transformation compared with torch.optim.AdamW (`xopt.parity.compare`), and xopt.torch's
AdamW against a golden trace recorded from torch.optim.AdamW (`run_parity(localise=True)`).
The localiser must name that step, that tensor, and (for the transposed statistic) that
state variable; a fault-free run must localise nothing.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
from helpers import has_jax, has_torch

from xopt.parity import gradient_sequence, record

pytestmark = pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")

# β exactly representable in float32, so float32 and double bias corrections agree to
# rounding and a fault-free float32 AdamW matches torch.optim.AdamW step for step
LR, B1, B2, EPS, WD = 0.01, 0.875, 1 - 2.0 ** -10, 1e-8, 0.1
TORCH = f"torch.optim.AdamW(lr={LR}, betas=({B1}, {B2}), eps={EPS}, weight_decay={WD})"
FAULTS = [("eps", 3, "w"), ("bias", 2, "b"), ("decay", 4, "b"), ("transpose", 3, "w")]


def _problem():
    rng = np.random.default_rng(7)
    params = {"w": rng.standard_normal((5, 5)).astype(np.float32),
              "b": rng.standard_normal(5).astype(np.float32)}
    grads = [{k: (rng.standard_normal(v.shape) * 0.1).astype(np.float32)
              for k, v in params.items()} for _ in range(6)]
    return gradient_sequence(params, grads)


def _faulty(x, fault, p, g, m, v, t, eps, wd):
    """One AdamW step in torch.optim's order (x: torch or jax.numpy), with ``fault``."""
    if fault != "decay":
        p = p * (1 - LR * wd)
    m = m * B1 + (1 - B1) * g
    v = v * B2 + (1 - B2) * g * g
    if fault == "transpose":
        v = v.T
    bc1, bc2 = 1 - B1 ** t, 1 - B2 ** t
    if fault == "bias":
        bc1, bc2 = bc2, bc1
    e = eps * 1e4 if fault == "eps" else eps
    p = p - (LR / bc1) * m / (x.sqrt(v) / bc2 ** 0.5 + e)
    return p, m, v


def _faulty_optax(fault, at, tensor):
    """AdamW as an optax transformation (state count/mu/nu), faulty at update ``at``."""
    import jax
    import jax.numpy as jnp
    import optax

    class State(types.SimpleNamespace):
        pass

    from typing import NamedTuple

    class AdamState(NamedTuple):
        count: jax.Array
        mu: dict
        nu: dict

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return AdamState(jnp.zeros([], jnp.int32), zeros, dict(zeros))

    def update(grads, state, params):
        t = state.count + 1
        tf = t.astype(jnp.float32)
        new_p, mu, nu = {}, {}, {}
        for k in params:
            outs = []
            for f in (None, fault if k == tensor else None):
                outs.append(_faulty(jnp, f, params[k], grads[k], state.mu[k], state.nu[k], tf,
                                    EPS, WD))
            hit = t == at + 1
            new_p[k], mu[k], nu[k] = (jnp.where(hit, b, a) for a, b in zip(*outs, strict=True))
        updates = {k: new_p[k] - params[k] for k in params}
        return updates, AdamState(t, mu, nu)

    return optax.GradientTransformation(init, update)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("loc") / "adamw.json"
    record(TORCH, _problem(), steps=6, path=path, method="adamw")
    return path


def _check(loc, at, tensor, fault, state_name):
    assert loc.first is not None, fault
    assert loc.first.step == at, (fault, loc.summary())
    if fault == "transpose":
        assert loc.state is not None and loc.state.tensor == state_name and loc.state.step == at
        assert loc.first.tensor in (f"param/{tensor}", state_name)
    else:
        assert loc.first.tensor == f"param/{tensor}", (fault, loc.summary())
        assert loc.state is None, (fault, loc.summary())  # the moments are untouched
    assert loc.first.ratio > 100


@pytest.mark.parametrize("fault,at,tensor", FAULTS)
def test_compare_localises_a_fault_in_an_optax_transformation(reference, fault, at, tensor):
    from xopt.parity import compare
    from xopt.parity.recorder import OptaxImplementation

    b = OptaxImplementation(_faulty_optax(fault, at, tensor), f"adamw with {fault} fault")
    report = compare(reference, b, modes=["teacher"])
    (run,) = report.runs
    loc = run.localisation
    _check(loc, at, tensor, fault, f"state/{tensor}/exp_avg_sq")
    assert loc.cause == "formulation"  # the fault is in B's own float64 twin too
    assert run.verdict == "diverge" and run.worst[0] == at
    # teacher forcing isolates the step: every other step is at rounding level
    assert all(e.rel < 1e-6 for t, errs in enumerate(run.per_step) if t != at
               for e in errs.values())


def test_compare_of_the_fault_free_transformation_finds_nothing(reference):
    from xopt.parity import compare
    from xopt.parity.recorder import OptaxImplementation

    b = OptaxImplementation(_faulty_optax(None, 0, "w"), "adamw")
    report = compare(reference, b)
    assert report.verdict == "agree", str(report)
    teacher = next(r for r in report.runs if r.mode == "teacher_forced")
    assert teacher.localisation.first is None, teacher.localisation.summary()


@pytest.mark.parametrize("fault,at,tensor", FAULTS)
def test_run_parity_localises_a_fault_in_xopt_torch(reference, fault, at, tensor,
                                                     monkeypatch):
    import torch

    import xopt.torch.adamw as xt_adamw
    from xopt.parity.harness import run_parity

    real = xt_adamw.adamw_spec
    shape = (5, 5) if tensor == "w" else (5,)

    def update_torch(p, g, m, v, v_max, count, **kw):
        if count == at + 1 and tuple(p.shape) == shape:
            new_p, new_m, new_v = _faulty(torch, fault, p, g, m, v, count, kw["eps"],
                                          kw["weight_decay"])
            return new_p, new_m, new_v, v_max
        return real.update_torch(p, g, m, v, v_max, count, **kw)

    monkeypatch.setattr(xt_adamw, "adamw_spec",
                        types.SimpleNamespace(**{**vars(real), "update_torch": update_torch}))
    report = run_parity("adamw", [reference], backends=["torch"], modes=["teacher_forced"],
                        localise=True)
    (run,) = report.runs
    loc = run.localisation
    _check(loc, at, tensor, fault, f"state/v/{tensor}")
    # one float64 oracle for both sides: xopt.torch is the one off it
    assert loc.cause == "implementation" and loc.impl_to_exact > 100 * loc.ref_to_exact
    assert run.verdict == "diverge"


def test_run_parity_without_a_fault_localises_nothing(reference):
    from xopt.parity.harness import run_parity

    report = run_parity("adamw", [reference], backends=["torch"], modes=["teacher_forced"],
                        localise=True)
    (run,) = report.runs
    assert run.agrees and run.localisation.first is None, run.localisation.summary()


def _run(errs_by_step, tol=1e-6):
    from xopt.parity.compare import TensorError
    from xopt.parity.harness import Run
    from xopt.parity.methods import Tolerance

    return Run(trace="t/c", backend="b", impl="plain", against="a", mode="teacher_forced",
               steps=len(errs_by_step), tolerance=Tolerance(tol, 0.0, "test"),
               per_step=[{k: TensorError(e, e) for k, e in s.items()} for s in errs_by_step])


def test_verdict_counts_closer_to_exact_apart_and_keeps_divergences():
    from xopt.parity.harness import Report, judge_against_exact

    exact = [{"param/x": np.array([1.0])}]
    ref = [{"param/x": np.array([1.0 + 3e-6])}]        # the reference's own rounding
    closer = [{"param/x": np.array([1.0 + 1e-7])}]     # beyond 1e-6 of ref, nearer exact
    farther = [{"param/x": np.array([1.0 - 4e-6])}]    # beyond, and farther from exact
    r1 = _run([{"param/x": 2.9e-6}])
    judge_against_exact(r1, closer, ref, exact, estimate="float64 oracle")
    assert r1.verdict == "closer_to_exact" and not r1.agrees
    assert math.isclose(r1.backend_to_exact, 1e-7, rel_tol=1e-3)
    assert math.isclose(r1.against_to_exact, 3e-6, rel_tol=1e-3)
    r2 = _run([{"param/x": 7e-6}])
    judge_against_exact(r2, farther, ref, exact, estimate="float64 oracle")
    assert r2.verdict == "diverge"
    # twins that disagree (another formulation) never make a run "closer to exact"
    r3 = _run([{"param/x": 2.9e-6}])
    judge_against_exact(r3, closer, ref, exact, [{"param/x": np.array([1.0 + 1e-3])}])
    assert r3.verdict == "diverge" and "another formulation" in r3.exact_estimate
    agree = _run([{"param/x": 1e-8}])
    judge_against_exact(agree, exact, exact, exact)
    report = Report("m", ["t/c"], [agree, r1], [])
    assert report.verdict == "closer_to_exact"
    assert Report("m", ["t/c"], [agree, r1, r2], []).verdict == "diverge"
    text = str(report)
    assert "CLOSER TO EXACT" in text and "1 beyond tolerance but closer to exact" in text
    assert report.to_json()["runs"][1]["verdict"] == "closer_to_exact"
