"""μLO's checkpoints: the folders its original code writes, read and ported, by behaviour.

``tests/fixtures/mulo`` (written by ``tools/record_mulo.py checkpoints`` with the
originals): a learned_optimization folder (``checkpoints.save_state`` of μLO's θ,
``config.gin`` naming ``MuAdafacMLPLOpt``) and PyLO's Hub layout (``MetaMLP.save_pretrained``,
what PyLO's ``MuLO`` loads from ``hf_key``). Both hold the θ of the μLO golden traces, so a
load is checked by running the golden case with what was loaded, on both backends.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import REPO, needs_jax, needs_torch

from xopt import checkpoints as C
from xopt.checkpoints.port import port
from xopt.errors import CheckpointError
from xopt.parity import bundled_traces, load_trace
from xopt.parity.methods import mulo as MP
from xopt.specs import mulo as S

FIX = REPO / "tests" / "fixtures" / "mulo"
LO = FIX / "learned_optimization" / "mulo_h32_perturbed"
PYLO = FIX / "pylo" / "mulo_h32_perturbed"
# what PyLO does not store: μLO's step_mult, and the decay offsets (PyLO's defaults are μLO's)
PYLO_EXTRA = dict(method="mulo", decays="pylo-defaults", step_mult=0.01)
TRACE = load_trace(next(p for p in bundled_traces("mulo") if "w24" in str(p)))  # no clipping
HP = MP.from_original_kwargs({**TRACE.hyperparameters,
                              "num_training_steps": TRACE.num_training_steps})
THETA = S.META.from_original(TRACE.meta_params(), HP)


def _same_theta(theta) -> bool:
    return set(theta) == set(THETA) and all(
        np.array_equal(np.asarray(theta[k]), np.asarray(THETA[k])) for k in THETA)


def test_the_originals_folders_read_as_mulo_with_the_traces_theta():
    method, hp, theta = C.load(LO)
    assert method == "mulo" and isinstance(hp, S.MuLO)
    assert (hp.hidden_size, hp.hidden_layers, hp.step_mult) == (32, 2, 0.01)
    assert _same_theta(theta)
    method, hp2, theta2 = C.load(PYLO, **PYLO_EXTRA)
    assert method == "mulo" and hp2 == hp and _same_theta(theta2)
    # the same PyLO folder serves small_fc_lopt (PyLO's AdafacLO_naive loads it too)
    assert C.load(PYLO, decays="pylo-defaults")[0] == "small_fc_lopt"


def test_a_checkpoint_of_another_method_is_refused_by_name():
    with pytest.raises(CheckpointError, match="holds a mulo checkpoint, not small_fc_lopt"):
        C.load(LO, method="small_fc_lopt")
    with pytest.raises(CheckpointError, match="not velo"):
        C.load(PYLO, decays="pylo-defaults", method="velo")


@pytest.mark.parametrize("fmt", ["pylo", "learned_optimization", "xopt"])
@pytest.mark.parametrize("src", ["lo", "pylo"])
def test_ports_in_both_directions_behave_identically(tmp_path, src, fmt):
    source, extra = (LO, {}) if src == "lo" else (PYLO, PYLO_EXTRA)
    overrides = {"step_mult": 0.01} if src == "pylo" else None
    r = port(source, tmp_path / "out", fmt, verify=True, method="mulo",
             decays=extra.get("decays"), overrides=overrides)
    assert r.method == "mulo" and r.max_abs_diff == 0.0, r.notes
    kw = {"method": "mulo"}
    if fmt == "pylo":
        kw.update(decays="pylo-defaults", step_mult=0.01)
    method, hp, theta = C.load(tmp_path / "out", **kw)
    assert method == "mulo" and _same_theta(theta)


def _mults():
    return {n: float(v) for n, v in TRACE.hyperparameters["mup_lrs_to_use"].items()}


def _check_closed_loop(got_params: list[dict[str, np.ndarray]]) -> None:
    for t, got in enumerate(got_params):  # the closed-loop bound of the golden comparison
        for n, v in got.items():
            ref = TRACE.params_after(t)[n]
            assert np.abs(v - ref).max() <= 1e-4 * np.abs(ref).max(), (t, n)


@needs_torch
@pytest.mark.parametrize("which", ["lo", "pylo"])
def test_torch_from_pretrained_reproduces_the_golden_trace(which):
    import torch

    from xopt.torch import MuLO

    ts = {n: torch.tensor(TRACE.init_params()[n]) for n in TRACE.params}
    groups: dict[float, list] = {}
    for n, t in ts.items():
        groups.setdefault(_mults()[n], []).append(t)
    kw = dict(num_training_steps=TRACE.num_training_steps)
    if which == "pylo":
        kw.update(decays="pylo-defaults", step_mult=0.01)
    opt = MuLO.from_pretrained([{"params": ps, "mup_lr": m} for m, ps in groups.items()],
                               LO if which == "lo" else PYLO, **kw)
    out = []
    for t in range(TRACE.steps):
        for n, p in ts.items():
            p.grad = torch.tensor(TRACE.grads(t)[n])
        opt.step(loss=TRACE.loss(t))
        out.append({n: p.detach().numpy().copy() for n, p in ts.items()})
    _check_closed_loop(out)


@needs_jax
@pytest.mark.parametrize("which", ["lo", "pylo"])
def test_jax_from_pretrained_reproduces_the_golden_trace(which):
    import jax
    import jax.numpy as jnp
    import optax

    from xopt.checkpoints.hub import optax_from_pretrained

    kw = dict(num_training_steps=TRACE.num_training_steps, mup_lrs=_mults())
    if which == "pylo":
        kw.update(decays="pylo-defaults", step_mult=0.01, method="mulo")
    tx = optax_from_pretrained(LO if which == "lo" else PYLO, **kw)
    p = {n: jnp.asarray(v) for n, v in TRACE.init_params().items()}
    state = tx.init(p)
    upd = jax.jit(lambda g, s, p, loss: tx.update(g, s, p, value=loss))
    out = []
    for t in range(TRACE.steps):
        g = {n: jnp.asarray(v) for n, v in TRACE.grads(t).items()}
        u, state = upd(g, state, p, jnp.float32(TRACE.loss(t)))
        p = optax.apply_updates(p, u)
        out.append({n: np.asarray(v) for n, v in p.items()})
    _check_closed_loop(out)
