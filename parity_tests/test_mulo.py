"""μLO against the golden traces of μLO's own code, on both backends and the oracle.

The traces (``xopt/parity/data/mulo``, recorded by ``tools/record_mulo.py``) run μLO's
``MuAdafacMLPLOpt`` on its ``MuMLP``: input, hidden and readout layers with their μP
multipliers (1, ``hidden_lr_mult / fan_in``, 1), one case with gradient clipping that acts
at every step. The bounds are the issue's: one teacher-forced update at most 1e-6 relative
on the parameters and every state array, the closed loop at most 1e-4. When μLO's code is
importable (``xopt/parity/originals/mulo.py``), the live original is compared too.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from helpers import explain_disagreements, has_jax, has_torch

from xopt.parity import bundled_traces, load_trace
from xopt.parity.harness import run_parity

pytestmark = pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")


@pytest.fixture(scope="module")
def golden_report():
    return run_parity("mulo", bundled_traces("mulo"), backends=["torch", "jax", "oracle"],
                      explicit_backends=True)


def test_every_backend_reproduces_every_golden_case(golden_report):
    assert golden_report.verdict == "agree", explain_disagreements(golden_report)
    runs = golden_report.runs
    assert {r.backend for r in runs} == {"xopt.torch", "xopt.jax", "oracle"}
    assert {r.mode for r in runs} == {"teacher_forced", "closed_loop"}
    assert len(golden_report.traces) == 2
    for r in runs:
        bound = 1e-6 if r.mode == "teacher_forced" else 1e-4
        assert r.tolerance.rel == bound and r.tolerance.abs == 0
        names = set(r.per_step[0])
        assert any(n.startswith("state/m/") for n in names)
        assert any(n.startswith("state/v_") for n in names)


def test_the_traces_exercise_what_mulo_adds():
    """The multipliers differ between roles and the clipping acts: otherwise the golden
    cases could not tell μLO from small_fc_lopt."""
    for path in bundled_traces("mulo"):
        t = load_trace(path)
        mults = t.hyperparameters["mup_lrs_to_use"]
        hidden = {n: v for n, v in mults.items() if v != 1.0}
        assert hidden and all(n.endswith("/w") for n in hidden)
        for n, v in hidden.items():  # hidden_lr_mult / fan_in, fan_in = rows of (in, out)
            assert 0 < v < 1 and np.float32(v) == np.float32(
                v * t.params[n][0]) / np.float32(t.params[n][0])
        if t.hyperparameters["clip_grad"]:
            norms = [np.sqrt(sum(float((t.grads(s)[n].astype(np.float64) ** 2).sum())
                                 for n in t.params)) for s in range(t.steps)]
            assert min(norms) > 1.0  # clipped at every update


def test_a_wrong_multiplier_is_caught(tmp_path):
    """The comparison can fail: the same trace with the hidden layer's multiplier doubled
    disagrees at the first update that moves that layer."""
    import json

    from xopt.parity import write_trace

    t = load_trace(bundled_traces("mulo")[0])
    manifest = json.loads(json.dumps(t.manifest))
    name = next(n for n, v in manifest["hyperparameters"]["mup_lrs_to_use"].items() if v != 1)
    manifest["hyperparameters"]["mup_lrs_to_use"][name] *= 2
    manifest["meta_params_file"] = str(t.path.parent / manifest["meta_params_file"])
    path = write_trace(tmp_path / "case.json", manifest, {k: t.array(k) for k in t.keys()})
    report = run_parity("mulo", [path], backends=["jax"], modes=["teacher_forced"],
                        max_steps=4)
    assert report.verdict != "agree"
    (run,) = report.runs
    bad = {k for errs in run.per_step for k, e in errs.items()
           if not e.within(run.tolerance.for_tensor(k))}
    assert bad == {f"param/{name}"}


@pytest.mark.skipif(importlib.util.find_spec("mup_adafac_mlp_lopt") is None
                    or importlib.util.find_spec("learned_optimization") is None,
                    reason="μLO's code is not importable (see xopt/parity/originals/mulo.py)")
def test_xopt_against_the_live_original():
    report = run_parity("mulo", bundled_traces("mulo"), backends=["torch", "jax"],
                        against="original", explicit_backends=True)
    assert report.verdict == "agree", explain_disagreements(report)
