"""The pieces every low-rank method shares: unique SVD/QR, rank rules, param groups, and
state variables that exist for some parameters only."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import exact_in_float32, needs_jax, needs_torch

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


# -- proj_dtype: the precision of GaLore's, COAP's and PLUMAGE's projections --------------------
#
# The reference below is the authors' ordinary step for a bfloat16 matrix, written from
# galore_torch/adamw.py + galore_projector.py and coap_torch/optimizer/adamw.py +
# coap_matrix.py (PLUMAGE: GaLore's, with P D⁻¹ and no scale): P in the parameter's dtype,
# R = G P_dᵀ (or P_dᵀ G) there, N = m / (√v + ε), back there, times scale there,
# p.add_(U, alpha=-step_size), p.add_(p, alpha=-lr * weight_decay). Its one departure is
# xopt's: the moments are float32 (updated unfused, m·β₁ + r·(1 − β₁), as xopt's spec), and N
# is rounded to bfloat16 from them. The projection P of each update is read from the
# optimizer's state (refreshes and events run in float32 under both values; their math is
# tested elsewhere). Data are chosen so that every product is exact in float32 (asserted):
# the bfloat16 results then do not depend on the order of summation, so the comparison is bit
# for bit on any CPU.

def _hadamard(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h  # orthogonal columns of norm √n, entries ±1


def _structured_grad(shape, modes, seed):
    """An ``m × n`` gradient ``Σᵢ cᵢ bᵢ aᵢᵀ`` with ``aᵢ`` Hadamard columns of length 16 (its
    singular vectors there: entries ±1/4, exact in bfloat16; the same at every call, so that
    COAP's warm-started sketch ``A Pᵀ`` keeps the rank), ``bᵢ`` orthogonal Hadamard columns
    of length 32, distinct ``cᵢ`` (a permutation of 16, 15, ... over the first ``modes``
    columns: which are the top ``r`` changes with ``seed``); every entry is an integer times
    2⁻⁷, exact in bfloat16."""
    rng = np.random.default_rng(seed)
    fixed = np.random.default_rng(0)
    a = _hadamard(16)[:, fixed.permutation(16)] * fixed.choice([-1.0, 1.0], 16) / 4.0
    b = _hadamard(32)[:, rng.permutation(32)[:16]] / 32.0
    c = np.zeros(16)
    c[:modes] = rng.permutation(16 - np.arange(modes))
    return (b * c) @ a.T if shape[0] == 32 else a @ (b * c).T


def _grads(kind, step):
    """``(W1 (32, 16), W2 (16, 32), b (5,))`` gradients at ``step``: structured at the
    refreshes (steps 0 and 3), small integers times 2⁻⁷ between them."""
    rng = np.random.default_rng(100 + step)
    if step % 3 == 0:
        modes = 4 if kind == "coap" else 16  # COAP's Eqn 7 (rank-4 sketch) is exact on rank 4
        g1 = _structured_grad((32, 16), modes, step)
        g2 = _structured_grad((16, 32), modes, step + 50)
    else:
        g1, g2 = (rng.integers(-127, 128, s) / 128.0 for s in ((32, 16), (16, 32)))
    return g1, g2, rng.integers(-127, 128, 5) / 128.0


_PD = {  # method: (class, hyperparameters, state key of P)
    "galore": ("GaLore", dict(lr=0.01, rank=4, update_proj_gap=3, scale=0.5,
                              weight_decay=0.1), "ortho_matrix"),
    "coap": ("COAP", dict(lr=0.01, rank=4, update_interval=3, reproject_factor=1, scale=0.5,
                          weight_decay=0.1), "ortho_matrix"),
    # PLUMAGE's realignment of the moments at a new P (float32 state math under both
    # values) is off, so that the reference carries them as GaLore does
    "plumage": ("PLUMAGE", dict(lr=0.01, rank=4, update_proj_gap=3, weight_decay=0.1,
                                realign_first_moment=False, realign_second_moment=False),
                "projector"),
}


def _initial_params():
    rng = np.random.default_rng(7)
    return [rng.integers(-127, 128, s) / 128.0 for s in ((32, 16), (16, 32), (5,))]


def _per_param(cls):
    return type(f"PerParam{cls.__name__}", (cls,), {
        "_batchable": lambda self, it, hp, inject: False,
        "_svd_input": lambda self, p, g, state, hp, inject: None})


def _run_proj_dtype(kind, dtype, proj_dtype, steps=6, per_param=False):
    """Each update's ``(params, state of W1 and W2, P of W1 and W2)``."""
    import torch

    import xopt.torch as xt

    name, kw, _ = _PD[kind]
    cls = getattr(xt, name)
    cls = _per_param(cls) if per_param else cls
    params = [torch.nn.Parameter(torch.tensor(x, dtype=dtype)) for x in _initial_params()]
    opt = cls(params, proj_dtype=proj_dtype, **kw)
    history = []
    for t in range(steps):
        for p, g in zip(params, _grads(kind, t), strict=True):
            p.grad = torch.tensor(g, dtype=dtype)
        opt.step()
        history.append(([p.detach().clone() for p in params],
                        [{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                          for k, v in opt.state[p].items()} for p in params[:2]]))
    return history, opt




def _reference_step(kind, p, g, m, v, proj, d, count, hp):
    """The authors' ordinary step of one bfloat16 matrix (see above); ``(p, m, v)``."""
    import torch

    bf = p.dtype
    pd = proj.to(bf)
    tall = p.shape[0] >= p.shape[1]  # W1: right (P on the 16-long side), W2: left
    if kind == "plumage":
        a, b = (g, pd) if tall else (pd.T, g)
    else:
        a, b = (g, pd.T) if tall else (pd.T, g)
    assert exact_in_float32(a.float().numpy(), b.float().numpy())
    r = torch.matmul(a, b).float()
    m = m * hp["b1"] + r * (1.0 - hp["b1"])
    v = v * hp["b2"] + (r * r) * (1.0 - hp["b2"])
    n = m / (torch.sqrt(v) + hp["eps"])
    if kind == "plumage":
        n = n / (d[None, :] if tall else d[:, None])
        a, b = (n.to(bf), pd.T) if tall else (pd, n.to(bf))
    else:
        a, b = (n.to(bf), pd) if tall else (pd, n.to(bf))
    assert exact_in_float32(a.float().numpy(), b.float().numpy())
    u = torch.matmul(a, b)
    if kind != "plumage":
        u = u * hp["scale"]
    step_size = hp["lr"] * math.sqrt(1.0 - hp["b2"] ** count) / (1.0 - hp["b1"] ** count)
    p = p.clone()
    p.add_(u, alpha=-step_size)
    p.add_(p, alpha=-hp["lr"] * hp["weight_decay"])
    return p, m, v


@needs_torch
@pytest.mark.parametrize("per_param", [False, True], ids=["batched", "per-parameter"])
@pytest.mark.parametrize("kind", sorted(_PD))
def test_proj_dtype_param_is_the_authors_bf16_step(kind, per_param):
    """bfloat16 parameters, proj_dtype="param": every update of both projected matrices is
    the reference's, bit for bit (parameters and moments); "state" is not."""
    import torch

    history, opt = _run_proj_dtype(kind, torch.bfloat16, "param", per_param=per_param)
    hp = opt.group_hp(opt.param_groups[0]).to_dict()
    key = _PD[kind][2]
    for j in range(2):
        p = torch.tensor(_initial_params()[j], dtype=torch.bfloat16)
        m = v = 0.0
        for t, (params, states) in enumerate(history):
            st = states[j]
            g = torch.tensor(_grads(kind, t)[j], dtype=torch.bfloat16)
            p, m, v = _reference_step(kind, p, g, m, v, st[key], st.get("scale"), t + 1, hp)
            assert torch.equal(p, params[j]), (j, t)
            assert torch.equal(m, st["exp_avg"]) and torch.equal(v, st["exp_avg_sq"]), (j, t)
    # "state" multiplies in float32: its moments are not the reference's (R not rounded)
    other, _ = _run_proj_dtype(kind, torch.bfloat16, "state", steps=1, per_param=per_param)
    assert not torch.equal(other[0][1][0]["exp_avg"], history[0][1][0]["exp_avg"])


@needs_torch
@pytest.mark.parametrize("kind", sorted(_PD))
def test_proj_dtype_changes_nothing_for_float32_parameters(kind):
    """float32 parameters: "param" and "state" are one computation, bit for bit, batched
    and per parameter (float64 likewise: its state is float64)."""
    import torch

    for per_param in (False, True):
        a, _ = _run_proj_dtype(kind, torch.float32, "state", steps=4, per_param=per_param)
        b, _ = _run_proj_dtype(kind, torch.float32, "param", steps=4, per_param=per_param)
        for (pa, sa), (pb, sb) in zip(a, b, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
            for x, y in zip(sa, sb, strict=True):
                assert x.keys() == y.keys()
                assert all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor)
                           else x[k] == y[k] for k in x)


@needs_torch
@pytest.mark.parametrize("kind", sorted(_PD))
def test_a_bad_proj_dtype_is_named(kind):
    import torch

    import xopt.torch as xt

    name, kw, _ = _PD[kind]
    w = torch.nn.Parameter(torch.zeros(8, 6))
    with pytest.raises(HyperparameterError, match=r"proj_dtype = 'bfloat16'.*'state', 'param'"):
        getattr(xt, name)([w], **{**kw, "proj_dtype": "bfloat16"})
    opt = getattr(xt, name)([w], **kw)
    with pytest.raises(HyperparameterError, match="proj_dtype"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(8, 6))],
                             "proj_dtype": None})


def test_proj_dtype_param_is_refused_where_no_original_computes_it():
    from xopt.specs.coap import COAP
    from xopt.specs.galore import GaLore

    with pytest.raises(HyperparameterError, match=r"proj_dtype = 'param'.*convention='authors'"):
        GaLore(proj_dtype="param", convention="optax", eps_root=0.0)
    with pytest.raises(HyperparameterError, match=r"proj_dtype = 'param'.*'adafactor'"):
        COAP(rank=2, optimizer="adafactor", b1=None, proj_dtype="param")


@needs_torch
@pytest.mark.parametrize("kind", sorted(_PD))
def test_state_dicts_with_and_without_proj_dtype_resume_bit_exactly(kind):
    """A bfloat16 "param" run saved after 2 updates and loaded into a fresh optimizer
    resumes bit for bit; a state dict saved before the field existed (no "proj_dtype" in
    its groups) loads as "state", what the code that saved it computed."""
    import torch

    import xopt.torch as xt

    name, kw, _ = _PD[kind]
    cls = getattr(xt, name)

    def run(proj_dtype, steps, opt=None, params=None):
        if opt is None:
            params = [torch.nn.Parameter(torch.tensor(x, dtype=torch.bfloat16))
                      for x in _initial_params()]
            opt = cls(params, proj_dtype=proj_dtype, **kw)
        for t in steps:
            for p, g in zip(params, _grads(kind, t), strict=True):
                p.grad = torch.tensor(g, dtype=torch.bfloat16)
            opt.step()
        return opt, params

    for proj_dtype in ("param", "state"):
        whole, wp = run(proj_dtype, range(5))
        first, fp = run(proj_dtype, range(2))
        saved = first.state_dict()
        if proj_dtype == "state":  # as the code before proj_dtype wrote it
            for g in saved["param_groups"]:
                del g["proj_dtype"]
        params = [torch.nn.Parameter(p.detach().clone()) for p in fp]
        resumed = cls(params, proj_dtype="param", **kw)  # the saved groups' value wins
        resumed.load_state_dict(saved)
        assert resumed.param_groups[0]["proj_dtype"] == proj_dtype
        run(proj_dtype, range(2, 5), resumed, params)
        for p, q in zip(wp, params, strict=True):
            assert torch.equal(p, q)
            for k, v in whole.state[p].items():
                w = resumed.state[q][k]
                assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
