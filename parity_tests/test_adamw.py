"""AdamW parity: every bundled trace, every backend, teacher-forced and closed loop.

The traces were recorded from torch.optim.AdamW and optax.adamw themselves
(tools/record_adamw.py). Tolerances come from xopt.specs.adamw.TOLERANCES, each with its
reason; the bitwise claims are checked against the live libraries on this machine.
"""

from __future__ import annotations

import pytest
from helpers import has_jax, has_torch

from xopt.parity import bundled_traces
from xopt.parity.harness import run_parity

pytestmark = pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")

TRACES = bundled_traces("adamw")
TORCH_TRACES = [p for p in TRACES if p.stem.startswith("torch")]
OPTAX_TRACES = [p for p in TRACES if p.stem.startswith("optax")]


def _explain(report) -> str:
    return "\n".join(
        f"{r.trace} {r.backend} vs {r.against} {r.mode}: rel {r.max_rel_error:.3g} "
        f"at {r.worst[:2]} (tol {r.tolerance.rel})" for r in report.runs if not r.agrees)


@pytest.fixture(scope="module")
def golden_report():
    return run_parity("adamw", TRACES)


def test_all_backends_agree_with_the_golden_traces(golden_report):
    assert golden_report.verdict == "agree", _explain(golden_report)
    backends = {r.backend for r in golden_report.runs}
    assert {"xopt.torch", "xopt.jax", "oracle", "torch.optim.AdamW", "optax.adamw"} <= backends
    assert {r.mode for r in golden_report.runs} == {"teacher_forced", "closed_loop"}


def test_each_library_reproduces_its_own_recording(golden_report):
    # The traces were recorded on a CPU like this one, so the live library reproduces them
    # exactly; if this fails the machine's arithmetic differs from the recorder's.
    for r in golden_report.runs:
        own = (r.backend == "torch.optim.AdamW" and "torch_" in r.trace) or (
            r.backend == "optax.adamw" and "optax_" in r.trace)
        if own:
            assert r.max_abs_error == 0.0, (r.trace, r.backend, r.mode)


@pytest.mark.parametrize("mode", ["teacher_forced", "closed_loop"])
def test_xopt_torch_is_torch_optim_bit_for_bit(mode):
    report = run_parity("adamw", TORCH_TRACES, backends=["torch"], against="original",
                        modes=[mode])
    assert report.runs and all(r.against == "torch.optim.AdamW" for r in report.runs)
    for r in report.runs:
        assert r.tolerance.rel == 0 and r.tolerance.abs == 0
        assert r.max_abs_error == 0.0, (r.trace, r.worst)


@pytest.mark.parametrize("mode", ["teacher_forced", "closed_loop"])
def test_xopt_jax_is_optax_bit_for_bit(mode):
    report = run_parity("adamw", OPTAX_TRACES, backends=["jax"], against="original",
                        modes=[mode])
    assert report.runs and all(r.against == "optax.adamw" for r in report.runs)
    for r in report.runs:
        assert r.tolerance.rel == 0 and r.tolerance.abs == 0
        assert r.max_abs_error == 0.0, (r.trace, r.worst)


def test_torch_against_jax_one_step_within_1e_6():
    # Both presets: torch traces run both backends in torch's arithmetic, optax traces in
    # optax's. The one-step (teacher-forced) error is float32 rounding.
    report = run_parity("adamw", TRACES, backends=["torch"], against="jax",
                        modes=["teacher_forced"])
    assert len(report.runs) == len(TRACES)
    for r in report.runs:
        print(f"{r.trace}: torch vs jax one-step max rel {r.max_rel_error:.3g}")
        assert r.max_rel_error <= 1e-6, (r.trace, r.worst)
    assert report.verdict == "agree"


def test_oracle_sides_with_the_exact_arithmetic():
    # On an optax trace, xopt.torch (optax preset) and optax differ only by rounding; the
    # oracle must be reported as closer to one of them or tied, never missing.
    report = run_parity("adamw", OPTAX_TRACES[:1], backends=["torch"], modes=["teacher_forced"])
    (run,) = report.runs
    assert run.oracle_agrees_with in {"backend", "against", "tie"}


def test_golden_comparison_detects_a_one_ulp_corruption(tmp_path):
    # The harness must be able to fail: flip one float32 ulp in one recorded output.
    import json

    import numpy as np

    from xopt.parity import load_trace, write_trace

    t = load_trace(TORCH_TRACES[0])
    arrays = {k: t.array(k).copy() for k in t.keys()}
    key = "step_0012/param/mlp/0/weight"
    arrays[key].view(np.uint32)[3, 4] += 1
    path = write_trace(tmp_path / "corrupt.json", json.loads(json.dumps(t.manifest)), arrays)
    report = run_parity("adamw", [path], backends=["torch"], against="golden",
                        modes=["teacher_forced"])
    (run,) = report.runs
    assert run.max_abs_error > 0 and run.worst[:2] == (12, "param/mlp/0/weight")
    # One ulp is within the stated float32 tolerance, so the verdict stays "agree" ...
    assert run.agrees
    # ... but a 1e-4 relative corruption is not.
    arrays[key][3, 4] *= 1 + 1e-4
    path = write_trace(tmp_path / "corrupt.json", json.loads(json.dumps(t.manifest)), arrays)
    report = run_parity("adamw", [path], backends=["torch"], modes=["teacher_forced"])
    assert report.verdict == "diverge" and report.runs[0].worst[:2] == (12, "param/mlp/0/weight")
