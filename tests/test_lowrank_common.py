"""The pieces every low-rank method shares: unique SVD/QR, rank rules, param groups, and
state variables that exist for some parameters only."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import needs_jax, needs_torch

from xopt.errors import HyperparameterError
from xopt.specs import lowrank
from xopt.specs._groups import ParamGroups, hp_for
from xopt.specs._state import Naming, StateSchema, StateVar, same_as_param, scalar
from xopt.specs.adamw import AdamW

SHAPES = [(7, 5), (5, 7), (6, 6), (12, 3)]


def _matrix(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("shape", SHAPES)
def test_svd_reconstructs_and_follows_the_sign_rule(shape):
    a = _matrix(shape)
    u, s, vh = lowrank.svd(np, a)
    k = min(shape)
    assert u.shape == (shape[0], k) and s.shape == (k,) and vh.shape == (k, shape[1])
    np.testing.assert_allclose(u @ np.diag(s) @ vh, a, atol=1e-12)
    np.testing.assert_allclose(u.T @ u, np.eye(k), atol=1e-12)
    assert np.all(np.diff(s) <= 0)
    # the rule: each column's entry of largest magnitude is positive
    pivots = u[np.argmax(np.abs(u), axis=0), np.arange(k)]
    assert np.all(pivots > 0)
    # and it is a rule, not luck: flipping the input's sign flips U, not the pivots' sign
    u2, _, vh2 = lowrank.svd(np, -a)
    np.testing.assert_allclose(u2, u, atol=1e-12)
    np.testing.assert_allclose(vh2, -vh, atol=1e-12)


@pytest.mark.parametrize("shape", [(7, 5), (6, 6), (12, 3)])
def test_qr_has_nonnegative_diagonal(shape):
    a = _matrix(shape, 1)
    q, r = lowrank.qr(np, a)
    np.testing.assert_allclose(q @ r, a, atol=1e-12)
    assert np.all(np.diag(r) >= 0)
    assert np.allclose(np.tril(r, -1), 0)
    q2, r2 = lowrank.qr(np, a * np.array([-1.0] + [1.0] * (shape[1] - 1)))
    np.testing.assert_allclose(r2[1:, 1:], r[1:, 1:], atol=1e-12)


@needs_torch
@needs_jax
@pytest.mark.parametrize("shape", SHAPES)
def test_decompositions_agree_across_backends(shape):
    """With the convention, numpy (float64), torch and jax (float32) give the same factors
    up to float32 rounding (singular values of a Gaussian matrix are well separated)."""
    import jax.numpy as jnp
    import torch

    a = _matrix(shape, 2)
    ref = lowrank.svd(np, a)
    for xp, arr in ((torch, torch.tensor(a, dtype=torch.float32)),
                    (jnp, jnp.asarray(a, dtype=jnp.float32))):
        for got, want in zip(lowrank.svd(xp, arr), ref, strict=True):
            np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
        for got, want in zip(lowrank.qr(xp, arr), lowrank.qr(np, a), strict=True):
            np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_rank_and_interval_errors_name_the_parameter():
    with pytest.raises(HyperparameterError, match=r"layers/0/w.*rank = 9.*at most 5"):
        lowrank.check_rank(9, (5, 8), "layers/0/w")
    with pytest.raises(HyperparameterError, match="at least 1"):
        lowrank.check_rank(0, (5, 8), "w")
    with pytest.raises(HyperparameterError, match="matrix"):
        lowrank.check_rank(2, (5,), "b")
    with pytest.raises(HyperparameterError, match="update_proj_gap = 0"):
        lowrank.check_interval(0, "update_proj_gap", "w")
    lowrank.check_rank(5, (5, 8), "w")


def test_hf_step_size_matches_the_double_formula_for_arrays():
    """The array path (used under jit) stays within float32 rounding of the double value."""
    for t in (1, 2, 10, 1000):
        want = lowrank.hf_step_size(0.01, 0.9, 0.999, t, True)
        got = lowrank.hf_step_size(0.01, 0.9, 0.999, np.asarray(t, np.int32), True)
        assert abs(float(got) - want) <= 4e-7 * want


def test_param_groups_lookup_and_errors():
    a, b = AdamW(lr=0.1), AdamW(lr=0.2)
    groups = ParamGroups.of([(["x", "y"], a), (["z"], b)])
    assert hp_for(groups, "z") is b and hp_for(groups, "x") is a and hp_for(a, "q") is a
    assert groups.names == ["x", "y", "z"] and groups.first is a
    with pytest.raises(HyperparameterError, match="'x' is in param groups 0 and 1"):
        ParamGroups.of([(["x"], a), (["x"], b)])
    with pytest.raises(HyperparameterError, match="no param group"):
        groups.hp_of("w")


def test_conditional_state_variables():
    """A per-parameter variable with ``applies`` exists for some parameters only, and the
    schema reads, writes and checks state accordingly."""
    schema = StateSchema(
        vars=(StateVar("m", "param", same_as_param, "float32", "moment"),
              StateVar("P", "param", lambda s, hp: (s[0], 2), "float32", "projection",
                       applies=lambda s, hp: len(s) == 2),
              StateVar("step", "global", scalar, "int32", "count")),
        namings={"t": Naming({"m": "{param}/m", "P": "{param}/P", "step": "{param}/step"})})
    hp = AdamW()
    params = {"w": (4, 3), "b": (4,)}
    keys = schema.canonical_keys(params, hp)
    assert keys == {"m/w": (4, 3), "m/b": (4,), "P/w": (4, 2), "step": ()}
    flat = {"w/m": np.zeros((4, 3)), "b/m": np.zeros(4), "w/P": np.ones((4, 2)),
            "w/step": np.int32(1), "b/step": np.int32(1)}
    canon = schema.to_canonical("t", flat, list(params), hp)
    schema.check_canonical(canon, params, hp, "here")
    assert set(schema.from_canonical("t", canon, list(params), hp)) == set(flat)
    del flat["w/P"]
    with pytest.raises(Exception, match="missing state P/w"):
        schema.check_canonical(schema.to_canonical("t", flat, list(params), hp), params, hp,
                               "here")


def test_refresh_decomposes_only_when_due_and_takes_an_injected_value():
    calls = []

    def decompose():
        calls.append(1)
        return np.full(3, 2.0)

    old, given = np.zeros(3), np.ones(3)
    assert lowrank.refresh(False, old, decompose, given) is old
    assert lowrank.refresh(False, old, decompose) is old
    assert lowrank.refresh(True, old, decompose, given) is given
    assert not calls  # nothing decomposed: not due, or the original's value given
    np.testing.assert_array_equal(lowrank.refresh(True, old, decompose), np.full(3, 2.0))
    assert calls == [1]


@needs_jax
def test_refresh_under_jit_selects_with_cond():
    import jax
    import jax.numpy as jnp

    def run(t, injected):
        def decompose():
            return jnp.full(3, 2.0), jnp.asarray(True)

        return lowrank.refresh(t % 2 == 0, (jnp.zeros(3), jnp.asarray(False)), decompose,
                               injected, cond=jax.lax.cond)

    f = jax.jit(run)
    for t, inj, want in ((0, None, 2.0), (1, None, 0.0),
                         (0, (jnp.ones(3), jnp.asarray(True)), 1.0),
                         (1, (jnp.ones(3), jnp.asarray(True)), 0.0)):
        value, flag = f(jnp.int32(t), inj)
        np.testing.assert_array_equal(value, np.full(3, want))
        assert bool(flag) == (t % 2 == 0)
