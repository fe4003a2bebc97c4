"""Where PyLO's PyTorch port departs from learned_optimization, xopt follows the original.

Each departure (paper 002, PyLO; measured against the golden traces in the fixtures
README, "PyLO vs the original") is pinned twice, on the bundled golden cases, one
teacher-forced update at a time through xopt.torch:

* xopt reproduces the original on the tensors the departure affects, within the 1e-6
  one-update bound;
* the departure itself, injected into xopt's own math (``monkeypatch``), makes exactly
  those tensors miss the recording by far more than the bound, while the others stay
  within it. So the golden comparison is able to see each departure, and xopt is not
  making it.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import has_torch

from xopt.parity import bundled_traces
from xopt.parity.harness import run_parity
from xopt.specs import lopt

pytestmark = pytest.mark.skipif(not has_torch, reason="needs torch")

BOUND = 1e-6  # the issue's one-update bound (the specs' teacher_forced tolerance)
STEPS = 4


def worst_per_tensor(method: str) -> dict[str, float]:
    """Max relative error per tensor over the first STEPS teacher-forced updates."""
    (trace,) = bundled_traces(method)
    report = run_parity(method, [trace], backends=["torch"], modes=["teacher_forced"],
                        max_steps=STEPS, explicit_backends=True)
    (run,) = report.runs
    out: dict[str, float] = {}
    for errs in run.per_step:
        for k, e in errs.items():
            out[k] = max(out.get(k, 0.0), e.rel)
    return out


def _others_within(errs: dict[str, float], affected: str) -> None:
    for k, e in errs.items():
        if not k.endswith(f"/{affected}"):
            assert e <= BOUND, (k, e)


# -- 1. square matrices in VeLO ---------------------------------------------------------------


_ORIGINAL_FACTORED_DIMS = lopt.factored_dims


def pylo_velo_factored_dims(shape):
    """PyLO VeLO's rule: on a tie between the two largest dims it picks (last, second
    last), so a square matrix is factored along the swapped axes."""
    f = _ORIGINAL_FACTORED_DIMS(shape)
    if f is not None and len(shape) == 2 and shape[0] == shape[1]:
        return f[1], f[0]
    return f


def test_velo_square_matrix_uses_the_originals_axes(monkeypatch):
    assert lopt.factored_dims((16, 16)) == (0, 1)  # numpy.argsort order, as the original
    errs = worst_per_tensor("velo")
    for k in ("param/sq/w", "state/v_row/sq/w", "state/v_col/sq/w", "state/m/sq/w"):
        assert errs[k] <= BOUND, (k, errs[k])

    monkeypatch.setattr(lopt, "factored_dims", pylo_velo_factored_dims)
    pylo = worst_per_tensor("velo")
    print(f"PyLO's square-matrix axes: sq/w param rel error {pylo['param/sq/w']:.3g}, "
          f"v_row {pylo['state/v_row/sq/w']:.3g}")
    assert pylo["param/sq/w"] > 100 * BOUND
    assert pylo["state/v_row/sq/w"] > 100 * BOUND
    _others_within(pylo, "sq/w")


# -- 2. 0-d parameters --------------------------------------------------------------------


def test_torch_mean_over_no_dims_reduces_everything():
    # the root of PyLO's 0-d departure: it normalises with mean(dim=list(range(p.ndim))),
    # and for a 0-d parameter that list is empty, which torch reads as "every dim"
    import torch

    x = torch.tensor([[1.0, 3.0]])
    assert x.mean(dim=[]).shape == ()
    from xopt.specs import arrays

    assert arrays.mean(torch, x, ()) is x  # xopt: an empty axis list reduces nothing


def _pylo_joint_normalizer(real):
    def normalizer(xp, x, axes, eps=1e-5):
        if tuple(x.shape[:-1]) == (1,):  # the 0-d parameter, expanded to (1,)
            return x / xp.sqrt(eps + xp.mean(x * x))  # every channel at once
        return real(xp, x, axes, eps)

    return normalizer


@pytest.mark.parametrize("method", ["small_fc_lopt", "velo"])
def test_zero_d_parameter_normalises_each_feature_on_its_own(method, monkeypatch):
    errs = worst_per_tensor(method)
    assert errs["param/scale"] <= BOUND and errs["state/m/scale"] <= BOUND

    monkeypatch.setattr(lopt, "second_moment_normalizer",
                        _pylo_joint_normalizer(lopt.second_moment_normalizer))
    pylo = worst_per_tensor(method)
    print(f"{method}, PyLO's joint normalisation of a scalar: param/scale rel error "
          f"{pylo['param/scale']:.3g}")
    assert pylo["param/scale"] > 100 * BOUND
    _others_within(pylo, "scale")


# -- 3. the Adafactor row axis; 4. rank > 2 -----------------------------------------------------


@pytest.mark.parametrize("method", ["small_fc_lopt", "velo"])
@pytest.mark.parametrize("name", ["tall/w", "wide/w", "vec/w", "conv/w", "t3/w"])
def test_factored_accumulators_and_high_rank_tensors_follow_the_original(method, name):
    # v_row averages over the largest axis d0 and v_col over the second largest d1, for
    # tall (33,8), wide (8,16) and near-square (32,33) matrices, a rank-3 (4,4,6) tensor
    # and a rank-4 conv kernel (3,3,4,8), whose factored axes are not the last two
    errs = worst_per_tensor(method)
    for k in (f"param/{name}", f"state/v_row/{name}", f"state/v_col/{name}",
              f"state/m/{name}", f"state/rms/{name}"):
        assert errs[k] <= BOUND, (k, errs[k])


def test_velo_rank4_row_accumulator_shape_is_the_originals():
    # (3,3,4,8): d0 = 3 (size 8), d1 = 2 (size 4); v_row drops d0, v_col drops d1
    assert lopt.factored_dims((3, 3, 4, 8)) == (2, 3)
    shapes = lopt.factored_shapes((3, 3, 4, 8), 3)
    assert shapes["v_row"] == (3, 3, 4, 3) and shapes["v_col"] == (3, 3, 8, 3)


# -- 5. the learning-rate default -------------------------------------------------------------


def test_velo_default_lr_is_the_originals_step():
    # PyLO's VeLO_naive defaults to lr=1e-3 (a thousandth of the original's step); xopt's
    # default multiplier is 1.0, so the default optimizer takes the original's step
    import torch

    from xopt.parity import load_trace
    from xopt.torch import VeLO

    (path,) = bundled_traces("velo")
    t = load_trace(path)
    params = [torch.from_numpy(v.copy()) for v in t.init_params().values()]
    opt = VeLO(params, t.meta_params(), num_training_steps=t.num_training_steps)
    assert all(g["lr"] == 1.0 for g in opt.param_groups)
    for p, g in zip(params, t.grads(0).values(), strict=True):
        p.grad = torch.from_numpy(g.copy())
    opt.step(loss=torch.tensor(t.loss(0)))
    init, after = t.init_params(), t.params_after(0)
    for (name, p) in zip(t.params, params, strict=True):
        want = after[name].astype(np.float64) - init[name]
        got = p.numpy().astype(np.float64) - init[name]
        if np.abs(want).max() > 0:
            # the update itself, not only the parameter: within float32 rounding of p
            ulp = np.spacing(np.abs(after[name]).max().astype(np.float32))
            assert np.abs(got - want).max() <= 4 * ulp, name
            assert 0.5 < np.abs(got).max() / np.abs(want).max() < 2.0, name
