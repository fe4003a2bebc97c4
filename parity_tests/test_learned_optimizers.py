"""small_fc_lopt and VeLO against learned_optimization's golden traces, on both backends.

The case bundled with the package (one per method) runs in the default suite, for
xopt.torch, xopt.jax and the float64 oracle, teacher-forced and closed loop, through the
same harness as ``xopt parity``; every case in ``../shared/parity/{small_fc_lopt,velo}/``
(when ../shared is beside the checkout) runs the same way in the slow tier (``-m slow``):
the same checks on more recordings, each costing a JAX compilation of the whole update
(30 s of CPU for VeLO's). The bounds are the issue's: one teacher-forced update at most 1e-6
relative (max|a-b| / max|b| per tensor) on the parameters and every state array, the
whole closed loop at most 1e-4. They are the specs' ``tolerances``; nothing here widens
them.

When learned_optimization is importable (see
``xopt/parity/originals/learned_optimization.py``), the original also runs live, and xopt
is compared with it directly.
"""

from __future__ import annotations

import pytest
from helpers import SHARED, explain_disagreements, has_jax, has_torch

from xopt.parity import bundled_traces
from xopt.parity.harness import run_parity

pytestmark = pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")

METHODS = ("small_fc_lopt", "velo")


def shared_traces(method: str) -> list[str]:
    return [str(p) for p in sorted((SHARED / "parity" / method).glob("*.json"))]


def traces(method: str) -> list[str]:
    return shared_traces(method) or [str(p) for p in bundled_traces(method)]


def _table(report) -> str:
    return "\n".join(
        f"{r.trace:45s} {r.backend:11s} {r.mode:15s} max rel {r.max_rel_error:9.3g} "
        f"(step {r.worst[0]}, {r.worst[1]})" for r in report.runs)


def _golden_report(method: str, paths: list[str]):
    report = run_parity(method, paths, backends=["torch", "jax", "oracle"],
                        explicit_backends=True)
    print(f"\n{method}:\n{_table(report)}")
    return report


@pytest.fixture(scope="module", params=METHODS)
def golden_report(request):
    return _golden_report(request.param, [str(p) for p in bundled_traces(request.param)])


def test_every_backend_reproduces_every_golden_case(golden_report):
    """The bundled case of each method (the one ``xopt parity`` runs by default)."""
    _check_golden(golden_report)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_every_backend_reproduces_every_shared_golden_case(method):
    """Every case in ../shared (the bundled one among them): other meta-parameters,
    horizons, weight decay and gradient accumulation."""
    paths = shared_traces(method)
    if not paths:
        pytest.skip("../shared is not beside the checkout")
    _check_golden(_golden_report(method, paths))


def _check_golden(golden_report) -> None:
    assert golden_report.verdict == "agree", explain_disagreements(golden_report)
    runs = golden_report.runs
    assert {r.backend for r in runs} == {"xopt.torch", "xopt.jax", "oracle"}
    assert {r.mode for r in runs} == {"teacher_forced", "closed_loop"}
    assert {r.trace for r in runs} == set(golden_report.traces)
    for r in runs:
        bound = 1e-6 if r.mode == "teacher_forced" else 1e-4
        assert r.tolerance.rel == bound and r.tolerance.abs == 0
        # every state array was compared, not only the parameters
        names = set(r.per_step[0])
        assert any(n.startswith("state/m/") for n in names)
        assert any(n.startswith("state/v_") for n in names)


@pytest.mark.parametrize("method", METHODS)
def test_a_corrupted_recording_is_reported_at_its_step_and_tensor(method, tmp_path):
    # the comparison must be able to fail: move one recorded parameter by 1e-4 relative
    import json

    import numpy as np

    from xopt.parity import load_trace, write_trace

    t = load_trace(traces(method)[0])
    name = max(t.params, key=lambda n: int(np.prod(t.params[n])))
    key = f"step_0003/param/{name}"
    arrays = {k: t.array(k).copy() for k in t.keys()}
    idx = np.unravel_index(np.abs(arrays[key]).argmax(), arrays[key].shape)
    arrays[key][idx] *= 1 + 1e-4
    manifest = json.loads(json.dumps(t.manifest))
    # the copy lives elsewhere: point it at the original's meta-parameter files
    src = t.path.parent
    manifest["meta_params_file"] = str(src / manifest["meta_params_file"])
    if "base_file" in manifest.get("meta_params", {}):
        manifest["meta_params"]["base_file"] = str(src / manifest["meta_params"]["base_file"])
    path = write_trace(tmp_path / "case.json", manifest, arrays)
    report = run_parity(method, [path], backends=["torch"], modes=["teacher_forced"],
                        max_steps=5)
    # the corruption is in the reference: beyond tolerance, with xopt the closer to the
    # float64 oracle, so reported apart from both agreement and divergence
    assert report.verdict == "closer_to_exact"
    (run,) = report.runs
    assert run.against_to_exact > run.backend_to_exact
    tol = run.tolerance
    first = [(t, k) for t, errs in enumerate(run.per_step) for k, e in errs.items()
             if not e.within(tol.for_tensor(k))]
    # step 3's output is wrong; step 4, reset to that wrong recording, inherits it
    assert first[0] == (3, f"param/{name}")
    assert {k for _, k in first} == {f"param/{name}"}


def _lo_available() -> bool:
    from xopt.parity.originals import learned_optimization

    return learned_optimization.available()


needs_lo = pytest.mark.skipif(
    not _lo_available(),
    reason="learned_optimization is not importable (see "
           "xopt/parity/originals/learned_optimization.py to make it so)")


@needs_lo
@pytest.mark.parametrize("method", METHODS)
def test_xopt_against_the_live_original(method):
    report = run_parity(method, traces(method)[:2], backends=["torch", "jax"],
                        against="original", explicit_backends=True)
    print(f"\n{method} against the live original:\n{_table(report)}")
    assert report.verdict == "agree", explain_disagreements(report)
    assert all(r.against.startswith("learned_optimization.") for r in report.runs)


@needs_lo
@pytest.mark.parametrize("method", METHODS)
def test_the_original_on_this_machine_against_its_recording(method):
    # The original itself, rerun here, is held to the same bounds as xopt. On the
    # recorder's machine it reproduces its recording bit for bit (the fixtures README);
    # on another CPU, XLA's code generation moves some results by an ulp.
    report = run_parity(method, traces(method)[:2], backends=["original"],
                        explicit_backends=True)
    print(f"\n{method} original rerun here vs its recording:\n{_table(report)}")
    assert report.verdict == "agree", explain_disagreements(report)


def test_velo_lstm_exception_is_the_originals_own_rounding():
    # The one tensor family held to more than 1e-6 in one update is VeLO's LSTM state
    # (3e-6; xopt/specs/velo.py). Why 1e-6 is out of reach there: recomputed exactly from
    # the inputs the original gave it, the LSTM step lands up to 1.37e-6 (all cases; 7.8e-7
    # on the bundled one) from the original's own float32 result, and a float32
    # implementation summing in another order can sit as far on the other side; and
    # the original moves that state by far more than 3e-6 between two of its own runs
    # (jitted and op by op: the recorder's measurement in the manifests).
    import re
    import sys

    from helpers import REPO

    from xopt.parity import load_trace
    from xopt.parity.methods import velo

    sys.path.insert(0, str(REPO / "tools"))
    try:
        import velo_lstm_rounding
    finally:
        sys.path.pop(0)
    bound = velo.PARITY.tolerance("teacher_forced").for_tensor("state/lstm_hidden/x").rel
    assert bound == 3e-6
    gaps = [max(velo_lstm_rounding.measure(p)) for p in traces("velo")]
    print(f"exact vs original LSTM state, per case: {gaps}")
    assert 2 * max(gaps) > 1e-6  # a correct float32 LSTM step can miss 1e-6
    assert 2 * max(gaps) <= bound * 1.01  # and the bound is no looser than twice the gap
    spreads = []
    for p in traces("velo"):
        hint = load_trace(p).manifest["tolerance_hint"].get("jit_vs_op_by_op")
        if hint:
            spreads.append(float(re.search(r"state max diff ([0-9.e+-]+)", hint).group(1)))
    assert spreads and min(spreads) > 10 * bound


def test_recorded_internals_localize_a_divergence(monkeypatch):
    # `xopt parity velo --aux`: the spec's internals against the trace's aux. With the
    # original's math every stage is at float32 rounding; inject PyLO's square-matrix axes
    # and the first stage that moves is that tensor's per-parameter MLP output, while the
    # LSTM inputs, its outputs and the mixed MLP weights (upstream) stay where they were.
    from xopt.parity.harness import aux_errors
    from xopt.specs import lopt

    (path,) = bundled_traces("velo")
    clean = aux_errors("velo", path, max_steps=3)
    assert {"lstm_features", "controls", "lr_mult", "mlp_weights/w0__0",
            "direction/sq/w", "magnitude/sq/w", "feature_sq_mean"} <= set(clean)
    assert clean["lstm_features"][0] <= 1e-6 and clean["controls"][0] <= 1e-6
    assert clean["direction/sq/w"][0] <= 1e-4  # an MLP output: measured 1.7e-6

    original = lopt.factored_dims

    def pylo(shape):
        f = original(shape)
        return (f[1], f[0]) if f and len(shape) == 2 and shape[0] == shape[1] else f

    monkeypatch.setattr(lopt, "factored_dims", pylo)
    broken = aux_errors("velo", path, max_steps=3)
    for upstream in ("lstm_features", "controls", "lr_mult", "mlp_weights/w1"):
        assert broken[upstream] == clean[upstream]
    assert broken["direction/sq/w"][0] > 1e3 * clean["direction/sq/w"][0]
    assert broken["direction/tall/w"] == clean["direction/tall/w"]
