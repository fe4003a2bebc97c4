"""GaLore parity: every bundled trace of the authors' GaLoreAdamW (std, reverse_std, left,
right; rank 4, refresh every 5 updates; biases in an unprojected group), every backend,
teacher-forced and closed loop.

At refresh updates the authors' projection is injected (``xopt.parity.methods.galore.inject``):
the traces' ``tolerance_hint`` explains that another SVD may sign (or, for close singular
values, rotate) the singular vectors differently, and the moments carry across refreshes
unrotated. That xopt's own SVD finds the same subspace is checked below, without injection.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import explain_disagreements, has_jax, has_torch

from xopt.parity import bundled_traces, load_trace
from xopt.parity.harness import run_parity
from xopt.parity.methods import galore as GP
from xopt.specs import galore as G

pytestmark = pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")

TRACES = bundled_traces("galore")




@pytest.fixture(scope="module")
def golden_report():
    return run_parity("galore", TRACES, backends=["torch", "jax", "oracle"])


def test_every_trace_is_covered():
    cases = {load_trace(p).hyperparameters["param_groups"][1]["proj_type"] for p in TRACES}
    assert cases == {"std", "reverse_std", "left", "right"}


def test_all_backends_agree_with_the_golden_traces(golden_report):
    assert golden_report.verdict == "agree", explain_disagreements(golden_report)
    runs = golden_report.runs
    assert len(runs) == len(TRACES) * 3 * 2
    for r in runs:
        bound = 1e-6 if r.mode == "teacher_forced" else 1e-4  # the bounds
        assert r.max_rel_error <= bound, (r.trace, r.backend, r.mode, r.worst[:2])
        print(f"{r.trace:28s} {r.backend:10s} {r.mode:15s} max rel {r.max_rel_error:.3g}")


# torch against jax: `python -m xopt parity galore --backends torch --against jax` (all
# within 4.8e-7); tests/test_galore.py compares the two (and the oracle) without injection.


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_own_svd_finds_the_authors_subspace(path):
    """Without injection, the projection xopt computes at each refresh (torch, float32)
    spans the subspace the authors' recorded: P_xoptᵀ P_authors is diagonal with entries
    ±1 (the same singular vectors, each up to its sign)."""
    import torch

    import xopt.torch

    t = load_trace(path)
    hp = GP.PARITY.originals["galore_torch.GaLoreAdamW"].from_kwargs(t.hyperparameters)
    checked = 0
    for s in range(t.steps):
        aux = t.aux(s)
        for name, shape in t.params.items():
            if not bool(aux.get(f"{name}/proj_refreshed", False)):
                continue
            h = hp.hp_of(name)
            w = torch.nn.Parameter(torch.tensor(t.params_after(s - 1)[name] if s else
                                                t.init_params()[name]))
            opt = xopt.torch.GaLore([w], spec=h)
            w.grad = torch.tensor(t.grads(s)[name])
            opt.step()
            mine = opt.state[w]["ortho_matrix"].double().numpy()
            theirs = t.state_after(s)[f"{name}/projector/ortho_matrix"].astype(np.float64)
            if G.side(shape, h.proj_type) == "right":
                mine, theirs = mine.T, theirs.T
            c = mine.T @ theirs
            assert np.allclose(np.abs(c), np.eye(c.shape[0]), atol=1e-4), (s, name, c)
            checked += 1
    assert checked >= 12
