"""PLUMAGE (Haroush & Soudry): the paper's claims, checked against independent references.

There is no public code and no golden trace, so every reference here is derived from the
paper's definitions, not from xopt's implementation:

* Eq. 13: the probabilities minimise the variance under the constraints: against
  ``scipy.optimize.minimize`` (SLSQP on Eq. 13's objective and constraints) and against the
  KKT water-filling of Eq. 16 (``pᵢ = min(1, c·σᵢ)``, ``c`` found by bisection), and Eq. 17's
  ``r*`` by a direct loop;
* Algorithm 3: the sampler returns exactly k distinct indices every time and includes
  index i with probability pᵢ (Monte Carlo, binomial CLT bound);
* Eq. 8/20: the one-sided estimator ``P D⁻¹ Pᵀ G`` is unbiased (Monte Carlo mean within a
  CLT bound from the sample standard deviation), and its variance is Eq. 12's;
* Eq. 28/29: the optimizers' moments after a new projection equal the equations evaluated
  in NumPy float64 from their index definitions;
* Algorithm 5: the intervals (SVD every τ steps, resample every κ), the first update;
* bad input: errors that name the parameter or field.

Monte Carlo bounds: with N draws, a sample mean deviates from its expectation by more than
z standard errors with probability ≈ 2Φ(−z); z = 5 (≈ 5.7e-7 per entry, ≈ 1e-4 over every
entry of every test here) keeps a false failure unlikely, while the seeds are fixed so the
outcome is deterministic. Each test's power is shown on a wrong variant (D⁻¹ left out; a
biased sampler) that the same bound rejects.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from helpers import needs_jax, needs_torch

from xopt.errors import DecompositionError, HyperparameterError
from xopt.parity.methods import get as get_parity
from xopt.specs import get, lowrank
from xopt.specs import plumage as P

Z = 5.0


# -- references derived from the paper ------------------------------------------------------


def variance_objective(p: np.ndarray, sigma: np.ndarray) -> float:
    """Eq. 13's objective Σ (1/pᵢ − 1) σᵢ² (the estimator's variance, Eq. 12)."""
    return float(np.sum((1.0 / p - 1.0) * sigma**2))


def waterfill(sigma: np.ndarray, k: int) -> np.ndarray:
    """Eq. 16's stationarity pᵢ = σᵢ/√(μ + λᵢ) with λᵢ > 0 only where pᵢ = 1, i.e.
    pᵢ = min(1, c σᵢ) with c = 1/√μ chosen so that Σ pᵢ = k (bisection on c)."""
    lo, hi = 0.0, 1.0
    while np.minimum(1.0, hi * sigma).sum() < k:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if np.minimum(1.0, mid * sigma).sum() < k:
            lo = mid
        else:
            hi = mid
    return np.minimum(1.0, hi * sigma)


def r_star_direct(sigma: np.ndarray, k: int) -> int:
    """Eq. 17 by a loop: the smallest r with (k − r) σ_{r+1} < Σ_{i>r} σᵢ (1-based σ)."""
    d = len(sigma)
    for r in range(d + 1):
        if r == d:
            return d
        if (k - r) * sigma[r] < sigma[r:].sum():
            return r
    raise AssertionError


def spectra():
    rng = np.random.default_rng(0)
    out = [
        (np.sort(rng.lognormal(0.0, 1.5, 8))[::-1], 3),   # heavy-tailed: r* > 0
        (np.sort(rng.uniform(0.5, 1.0, 10))[::-1], 4),    # flat: r* = 0
        (np.array([10.0, 9.0, 1.0, 0.5, 0.4, 0.1]), 3),   # two dominant modes
        (np.ones(6), 2),                                  # all equal: p = k/d
        (np.array([5.0, 1.0, 1.0, 1.0, 1.0]), 4),         # q = 1 exactly at r = 1
        (np.sort(rng.exponential(1.0, 12))[::-1], 11),    # k close to d
        (np.sort(rng.exponential(1.0, 7))[::-1], 7),      # k = d: every p = 1
        (np.sort(rng.uniform(0.0, 1.0, 9))[::-1], 1),     # k = 1
    ]
    return out


# -- Eq. 13-18 -------------------------------------------------------------------------------


@pytest.mark.parametrize("sigma,k", spectra())
def test_probabilities_match_the_kkt_waterfilling_and_eq17(sigma, k):
    r_star, p = P.inclusion_probabilities(np, sigma, k, 1e-12)
    np.testing.assert_allclose(p, waterfill(sigma, k), rtol=1e-12, atol=1e-12)
    assert int(r_star) == r_star_direct(sigma, k)
    assert math.isclose(p.sum(), k, rel_tol=1e-12)
    assert np.all(p > 0) and np.all(p <= 1)
    # Eq. 18's closed form, written out
    rs = int(r_star)
    expected = np.ones_like(sigma)
    expected[rs:] = (k - rs) * sigma[rs:] / max(sigma[rs:].sum(), 1e-300) if rs < k else 0.0
    if rs < len(sigma):
        np.testing.assert_allclose(p, expected, rtol=1e-12)


@pytest.mark.parametrize("sigma,k", spectra()[:6])
def test_probabilities_minimise_eq13_against_scipy(sigma, k):
    optimize = pytest.importorskip("scipy.optimize", reason="scipy is not installed")
    d = len(sigma)
    res = optimize.minimize(
        lambda q: variance_objective(q, sigma), np.full(d, k / d),
        jac=lambda q: -(sigma**2) / q**2, method="SLSQP",
        bounds=[(1e-9, 1.0)] * d,
        constraints=[{"type": "eq", "fun": lambda q: q.sum() - k,
                      "jac": lambda q: np.ones_like(q)}],
        options={"ftol": 1e-12, "maxiter": 1000})
    assert res.success, res.message
    _, p = P.inclusion_probabilities(np, sigma, k, 1e-12)
    ours, theirs = variance_objective(p, sigma), variance_objective(res.x, sigma)
    # ours is the optimum: never worse than the numerical solver's, and the same point
    assert ours <= theirs + 1e-9 * max(1.0, abs(theirs))
    np.testing.assert_allclose(p, res.x, atol=1e-6)  # SLSQP converges to ~3e-7 here
    # and it beats the other obvious feasible point, the uniform k/d
    assert ours <= variance_objective(np.full(d, k / d), sigma) + 1e-12


def test_degenerate_spectrum_keeps_sum_k_with_a_uniform_tail():
    # rank 2 < k = 3: Eq. 18 would give the zero modes p = 0 and Σ p = 2; the remaining
    # inclusion is spread over the zero modes (variance unchanged: σ = 0 there)
    r_star, p = P.inclusion_probabilities(np, np.array([3.0, 1.0, 0.0, 0.0]), 3, 1e-12)
    assert int(r_star) == 2
    np.testing.assert_array_equal(p, [1.0, 1.0, 0.5, 0.5])
    # a zero gradient: every mode equally likely
    _, p = P.inclusion_probabilities(np, np.zeros(5), 2, 1e-12)
    np.testing.assert_allclose(p, 0.4)
    # zeros in the tail but enough mass: Eq. 18 as is (p = 0 for σ = 0, never sampled)
    _, p = P.inclusion_probabilities(np, np.array([3.0, 1.0, 1.0, 0.0]), 2, 1e-12)
    np.testing.assert_allclose(p, [1.0, 0.5, 0.5, 0.0])


# -- Algorithm 3 ---------------------------------------------------------------------------


N_DRAWS = 4000


@functools.cache
def _draws(d: int) -> list:
    """xopt.random's draws ``(perm, u)`` for steps ``t = 0..N_DRAWS-1`` of stream 0 (seed 0),
    shared by the Monte Carlo tests of the same dimension."""
    return [P.draw(0, 0, t, d) for t in range(N_DRAWS)]


def _inclusion_counts(p, k):
    counts = np.zeros(len(p))
    for perm, u in _draws(len(p)):
        idx = P.sample_indices(np, p, k, perm, u)
        assert len(idx) == k and len(set(idx.tolist())) == k, idx  # exactly k, distinct
        counts[idx] += 1
    return counts


@pytest.mark.parametrize("sigma,k", [spectra()[0], spectra()[2],
                                     (np.array([3.0, 1.0, 1.0, 0.5, 0.0, 0.0]), 3)])
def test_sampler_includes_each_index_with_probability_p(sigma, k):
    _, p = P.inclusion_probabilities(np, sigma, k, 1e-12)
    n = N_DRAWS
    freq = _inclusion_counts(p, k) / n
    se = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(freq - p) <= Z * se + 1e-12), (freq, p)
    assert np.all(freq[p == 1.0] == 1.0) and np.all(freq[p == 0.0] == 0.0)


def test_sampler_bound_has_power():
    # the same bound rejects a sampler whose probabilities are off by 0.05
    p = np.array([0.9, 0.6, 0.5, 0.5, 0.3, 0.2])
    wrong = p + np.array([0.05, -0.05, 0.0, 0.0, 0.0, 0.0])
    n = N_DRAWS
    freq = _inclusion_counts(wrong, 3) / n
    assert np.any(np.abs(freq - p) > Z * np.sqrt(p * (1 - p) / n))


def test_sampler_is_identical_in_every_backend():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    _, p = P.inclusion_probabilities(np, spectra()[0][0], 3, 1e-12)
    p32 = p.astype(np.float32)
    import jax

    from xopt.jax.plumage import draws as jax_draws

    @jax.jit
    def jax_sample(t):
        jperm, ju = jax_draws(7, 3, t, len(p))
        return P.sample_indices(jnp, jnp.asarray(p32), 3, jperm, ju)

    for t in range(40):
        perm, u = P.draw(7, 3, t, len(p))
        ref = P.sample_indices(np, p32, 3, perm, u)
        tperm, tu = P.draw(7, 3, t, len(p), backend="torch")
        got_t = P.sample_indices(torch, torch.tensor(p32), 3, tperm, tu).numpy()
        got_j = np.asarray(jax_sample(jnp.asarray(t, jnp.int32)))
        np.testing.assert_array_equal(got_t, ref)
        np.testing.assert_array_equal(got_j, ref)


# -- Eq. 8, 12, 20: the one-sided estimator --------------------------------------------------


def _monte_carlo_estimates(g, k, side, n, scale=True):
    basis, sigma = P.decompose(np, g, side)
    _, p = P.inclusion_probabilities(np, sigma, k, 1e-12)
    out = np.empty((n, *g.shape))
    for t, (perm, u) in enumerate(_draws(len(p))[:n]):
        proj, dvec = P.sample_projection(np, basis, p, P.sample_indices(np, p, k, perm, u))
        out[t] = P.estimate(np, g, proj, dvec if scale else np.ones_like(dvec), side)
    return out, sigma, p


def _spectrum_matrix(m, n, sigma, rng):
    u, _ = np.linalg.qr(rng.standard_normal((m, m)))
    v, _ = np.linalg.qr(rng.standard_normal((n, n)))
    d = min(m, n)
    return (u[:, :d] * sigma) @ v[:, :d].T


@pytest.mark.parametrize("shape,side", [((5, 8), "left"), ((9, 4), "right")])
def test_estimator_is_unbiased_with_eq12_variance(shape, side):
    rng = np.random.default_rng(3)
    d = min(shape)
    g = _spectrum_matrix(*shape, np.array([4.0, 1.5, 1.0, 0.7, 0.4][:d]), rng)
    n = N_DRAWS
    est, sigma, p = _monte_carlo_estimates(g, 2, side, n)
    assert 0 < np.sum(p == 1.0) < 2  # one sure mode, the other sampled from the tail
    mean, std = est.mean(0), est.std(0, ddof=1)
    assert np.all(np.abs(mean - g) <= Z * std / math.sqrt(n) + 1e-12)
    # Eq. 12: E‖Ĝ − G‖² = Σ (1/pᵢ − 1) σᵢ²
    sq = ((est - g) ** 2).sum(axis=(1, 2))
    assert abs(sq.mean() - variance_objective(p, sigma)) <= Z * sq.std(ddof=1) / math.sqrt(n)
    # every single estimate has rank k
    assert np.linalg.matrix_rank(est[0]) == 2


def test_estimator_bound_rejects_the_unscaled_estimator():
    # power: without D⁻¹ the mean is Σ pᵢ σᵢ uᵢ vᵢᵀ ≠ G, and the same bound rejects it
    rng = np.random.default_rng(3)
    g = _spectrum_matrix(5, 8, np.array([4.0, 1.5, 1.0, 0.7, 0.4]), rng)
    n = N_DRAWS
    est, _, _ = _monte_carlo_estimates(g, 2, "left", n, scale=False)
    mean, std = est.mean(0), est.std(0, ddof=1)
    assert np.any(np.abs(mean - g) > Z * std / math.sqrt(n))


# -- Eq. 28-29: realignment, through the optimizers -----------------------------------------


def _eq28_29_by_definition(m_old, v_old, p_old, p_new, g, b1, b2, side, first, second):
    """The moments after a refresh, from the definitions, with explicit index sums:
    B_ik = Σ_l P₂_li P₁_lk; M'_ij = Σ_k B_ik M_kj (Eq. 28); V'_ij = Σ_k B_ik² V_kj (Eq. 29);
    then Eq. 22-23 with R = P₂ᵀ G. A right projection is the same on the transposes."""
    m_old, v_old, p_old, p_new, g = (np.asarray(x, np.float64) for x in
                                     (m_old, v_old, p_old, p_new, g))
    if side == "right":
        m_old, v_old, g = m_old.T, v_old.T, g.T
    rows, k = p_new.shape
    b = np.zeros((k, k))
    for i in range(k):
        for kk in range(k):
            b[i, kk] = sum(p_new[l, i] * p_old[l, kk] for l in range(rows))
    m_re, v_re = m_old.copy(), v_old.copy()
    if first:
        m_re = np.array([[sum(b[i, kk] * m_old[kk, j] for kk in range(k))
                          for j in range(m_old.shape[1])] for i in range(k)])
    if second:
        v_re = np.array([[sum(b[i, kk] ** 2 * v_old[kk, j] for kk in range(k))
                          for j in range(v_old.shape[1])] for i in range(k)])
    r = np.array([[sum(p_new[l, i] * g[l, j] for l in range(rows))
                   for j in range(g.shape[1])] for i in range(k)])
    m_new = b1 * m_re + (1 - b1) * r
    v_new = b2 * v_re + (1 - b2) * r * r
    if side == "right":
        m_new, v_new = m_new.T, v_new.T
    return m_new, v_new


def _two_steps(backend, shape, hp, grads):
    """Run two updates; return [(state before, state after)] of the second, canonical."""
    names = ["w"]
    from xopt.parity.harness import make_runner

    runner = make_runner(get("plumage"), hp, names, backend)
    rng = np.random.default_rng(0)
    runner.reset({"w": rng.standard_normal(shape).astype(np.float32)}, None)
    runner.step({"w": grads[0]}, None, None)
    before = runner.read()[1]
    runner.step({"w": grads[1]}, None, None)
    return before, runner.read()[1]


_REALIGN_CASES = [
    ((6, 9), True, True, None), ((10, 4), True, True, None),
    ((6, 9), True, True, 1),  # τ = 2, κ = 1: step 1 resamples from the stored SVD
    ((6, 9), True, False, None), ((6, 9), False, True, None), ((6, 9), False, False, None),
]


@pytest.mark.parametrize("backend,shape,first,second,kappa", [
    *[("oracle", *c) for c in _REALIGN_CASES],
    *[pytest.param("torch", *c, marks=needs_torch) for c in _REALIGN_CASES],
    # jax compiles each setting (~2 s): the sides and the κ path; the switches are the
    # spec's code, which it shares with the oracle and torch
    *[pytest.param("jax", *c, marks=needs_jax) for c in _REALIGN_CASES[:3]],
])
def test_moments_are_realigned_by_eq28_and_eq29(backend, shape, first, second, kappa):
    tau = 1 if kappa is None else 2
    hp = P.PLUMAGE(rank=3, update_proj_gap=tau, resample_interval=kappa, b1=0.8, b2=0.9,
                   realign_first_moment=first, realign_second_moment=second)
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    before, after = _two_steps(backend, shape, hp, grads)
    side = P.side_of(shape, hp)
    assert not np.allclose(before["projector/w"], after["projector/w"])  # a new P
    m_exp, v_exp = _eq28_29_by_definition(before["m/w"], before["v/w"], before["projector/w"],
                                          after["projector/w"], grads[1], hp.b1, hp.b2, side,
                                          first, second)
    # float32 backends: a handful of roundings of k-term sums, relative to the largest entry
    tol = 1e-12 if backend == "oracle" else 1e-6
    for got, exp in ((after["m/w"], m_exp), (after["v/w"], v_exp)):
        assert np.abs(got - exp).max() <= tol * np.abs(exp).max()


# -- Algorithm 5: intervals, the first update -------------------------------------------------


@pytest.mark.parametrize("backend", [pytest.param("torch", marks=needs_torch),
                                     pytest.param("jax", marks=needs_jax), "oracle"])
def test_svd_every_tau_and_resample_every_kappa(backend):
    from xopt.parity.harness import make_runner

    hp = P.PLUMAGE(rank=2, update_proj_gap=4, resample_interval=3)
    runner = make_runner(get("plumage"), hp, ["w"], backend)
    rng = np.random.default_rng(2)
    runner.reset({"w": rng.standard_normal((5, 7)).astype(np.float32)}, None)
    zeros = {"basis/w": np.zeros((5, 5)), "projector/w": np.zeros((5, 2))}
    prev = zeros  # the state before the first update (torch creates it lazily)
    svd_steps, resample_steps = [], []
    for t in range(13):
        runner.step({"w": rng.standard_normal((5, 7)).astype(np.float32)}, None, None)
        now = runner.read()[1]
        if not np.array_equal(now["basis/w"], prev["basis/w"]):
            svd_steps.append(t)
        if not np.array_equal(now["projector/w"], prev["projector/w"]):
            resample_steps.append(t)
        prev = now
    assert svd_steps == [0, 4, 8, 12]
    # a resample may redraw the same index set in the same order; with 5 modes and k = 2
    # that is rare, and never at every step of the schedule
    assert set(resample_steps) <= {0, 3, 4, 6, 8, 9, 12} and {0, 4, 8, 12} <= set(resample_steps)
    assert len(resample_steps) >= 6


def test_no_basis_kept_when_kappa_is_a_multiple_of_tau():
    spec = get("plumage")
    keys = spec.state.canonical_keys({"w": (4, 6), "b": (4,)},
                                     P.PLUMAGE(rank=2, update_proj_gap=5, resample_interval=10))
    assert set(keys) == {"step", "m/w", "v/w", "projector/w", "scale/w", "m/b", "v/b"}
    assert keys["m/w"] == (2, 6) and keys["projector/w"] == (4, 2)


@needs_torch
def test_first_update_is_eq24_with_g_singular_vectors_and_eq18_scales():
    import torch

    from xopt.torch.plumage import PLUMAGE

    rng = np.random.default_rng(4)
    g = _spectrum_matrix(6, 9, np.array([5.0, 2.0, 1.5, 1.0, 0.5, 0.2]), rng)
    w0 = rng.standard_normal((6, 9))
    w = torch.tensor(w0, dtype=torch.float64, requires_grad=True)
    lr, b1, b2, eps, k = 0.01, 0.9, 0.999, 1e-8, 3
    opt = PLUMAGE([w], lr=lr, betas=(b1, b2), eps=eps, rank=k)
    w.grad = torch.tensor(g)
    opt.step()
    st = opt.state[w]
    proj, scale = st["projector"].numpy(), st["scale"].numpy()
    # the columns are left singular vectors of G: G Gᵀ P = P diag(σ_I²), orthonormal
    np.testing.assert_allclose(proj.T @ proj, np.eye(k), atol=1e-12)
    lam = np.diag(proj.T @ g @ g.T @ proj)
    np.testing.assert_allclose(g @ g.T @ proj, proj * lam, atol=1e-10)
    # their scales are the water-filling probabilities of their singular values
    sigma = np.linalg.svd(g, compute_uv=False)
    p_ref = waterfill(sigma, k)
    for j in range(k):
        i = int(np.argmin(np.abs(sigma - math.sqrt(lam[j]))))
        assert math.isclose(scale[j], p_ref[i], rel_tol=1e-10)
    # Eq. 24 at t = 1 with M = (1 − β₁)R, V = (1 − β₂)R² and Algorithm 5's bias correction
    r = proj.T @ g
    m, v = (1 - b1) * r, (1 - b2) * r * r
    step = lr * math.sqrt(1 - b2) / (1 - b1)
    expected = w0 - step * proj @ ((m / (np.sqrt(v) + eps)) / scale[:, None])
    np.testing.assert_allclose(w.detach().numpy(), expected, rtol=1e-12, atol=1e-14)


@needs_torch
def test_rank_deficient_gradient_still_samples_k_distinct_orthonormal_columns():
    import torch

    from xopt.torch.plumage import PLUMAGE

    rng = np.random.default_rng(8)
    g = np.outer(rng.standard_normal(6), rng.standard_normal(8))  # rank 1, k = 3
    w = torch.zeros(6, 8, requires_grad=True)
    opt = PLUMAGE([w], rank=3)
    w.grad = torch.tensor(g, dtype=torch.float32)
    opt.step()
    proj = opt.state[w]["projector"].numpy()
    np.testing.assert_allclose(proj.T @ proj, np.eye(3), atol=1e-5)
    assert np.all(np.isfinite(w.detach().numpy()))
    assert np.all(opt.state[w]["scale"].numpy() > 0)


# -- the torch optimizer ----------------------------------------------------------------------


# -- bad input ----------------------------------------------------------------------------------


@needs_torch
def test_torch_errors_name_the_parameter():
    import torch

    from xopt.torch.plumage import PLUMAGE

    with pytest.raises(HyperparameterError, match=r"param_groups\[0\]\['params'\]\[0\].*rank = 5"):
        PLUMAGE([torch.zeros(4, 6)], rank=5)
    with pytest.raises(HyperparameterError, match=r"PLUMAGE.update_proj_gap = 0"):
        PLUMAGE([torch.zeros(4, 6)], update_proj_gap=0)
    with pytest.raises(HyperparameterError, match=r"resample_interval = 0"):
        PLUMAGE([torch.zeros(4, 6)], rank=2, resample_interval=0)
    with pytest.raises(HyperparameterError, match=r"resample_interval = 1.5"):
        PLUMAGE([torch.zeros(4, 6)], rank=2, resample_interval=1.5)
    with pytest.raises(HyperparameterError, match=r"unknown hyperparameter 'scale'"):
        PLUMAGE([torch.zeros(4, 6)], rank=2, scale=0.25)
    # a vector in a projected group is fine (not a matrix: the full-rank update)
    PLUMAGE([torch.zeros(6)], rank=2)


@needs_torch
def test_torch_failed_svd_names_the_parameter_and_the_reason(monkeypatch):
    import torch

    from xopt.torch.plumage import PLUMAGE

    # a refresh whose SVD is not finite (a NaN gradient, nonfinite="ignore"), or fails in
    # LAPACK, names the parameter (nothing moves: tests/contract/)
    w = torch.ones(4, 6, requires_grad=True)
    w.grad = torch.full((4, 6), float("nan"))
    opt = PLUMAGE([{"params": [w], "param_names": ["layer.weight"]}], rank=2)
    with pytest.raises(DecompositionError, match="layer.weight"):
        opt.step()
    w.grad = torch.ones(4, 6)

    def broken(*args, **kwargs):
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(torch.linalg, "svd", broken)
    with pytest.raises(DecompositionError, match=r"layer.weight.*did not converge"):
        opt.step()


@needs_jax
def test_jax_errors_and_a_nonfinite_refresh_keeps_the_projection():
    import jax
    import jax.numpy as jnp

    from xopt.jax.plumage import plumage

    with pytest.raises(HyperparameterError, match=r"xopt.jax.plumage: w: rank = 9"):
        plumage(rank=9).init({"w": jnp.zeros((4, 6))})
    with pytest.raises(HyperparameterError, match=r"update_proj_gap = -1"):
        plumage(update_proj_gap=-1)
    tx = plumage(rank=2, update_proj_gap=2)
    params = {"w": jnp.ones((4, 6))}
    state = tx.init(params)
    step = jax.jit(tx.update)
    g = jnp.asarray(np.random.default_rng(0).standard_normal((4, 6)), jnp.float32)
    _, state = step({"w": g}, state, params)
    _, state = step({"w": g}, state, params)
    _, bad = step({"w": jnp.full((4, 6), jnp.nan)}, state, params)  # t = 2: a refresh
    np.testing.assert_array_equal(bad.projector["w"], state.projector["w"])
    np.testing.assert_array_equal(bad.scale["w"], state.scale["w"])


@needs_jax
def test_jax_param_specs_and_schedules():
    import jax
    import jax.numpy as jnp
    import optax

    from xopt.jax.plumage import plumage

    params = {"dense": {"kernel": jnp.ones((4, 6)), "bias": jnp.zeros(6)},
              "head": jnp.ones((6, 3))}
    tx = plumage(optax.linear_schedule(1e-2, 0.0, 10), rank=2,
                 param_specs=lambda p: {"dense": {"kernel": None, "bias": None},
                                        "head": P.PLUMAGE(project=False)})
    state = tx.init(params)
    inner = state
    assert inner.mu["head"].shape == (6, 3) and inner.mu["dense"]["kernel"].shape == (2, 6)
    g = jax.tree.map(jnp.ones_like, params)
    updates, state = jax.jit(tx.update)(g, state, params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


# -- the spec ----------------------------------------------------------------------------------


def test_spec_defaults_presets_and_json():
    h = P.PLUMAGE()
    # Section 4.4 (lr, betas, eps), Section 4.1 (rank 128, τ = 200), Algorithm 5 (ε_p)
    assert (h.lr, h.b1, h.b2, h.eps) == (1e-3, 0.9, 0.999, 1e-8)
    assert (h.rank, h.update_proj_gap, h.kappa, h.prob_eps) == (128, 200, 200, 1e-12)
    assert h.realign_first_moment and h.realign_second_moment
    spec = get("plumage")
    assert spec.make("paper") == h
    assert spec.make("glue").rank == 8 and spec.make("glue").update_proj_gap == 100
    assert get_parity("plumage").originals == {}  # no public code: nothing to replay
    g = P.PLUMAGE(rank=4, resample_interval=7, seed=2**64 - 1, proj_side="right")
    assert P.PLUMAGE.from_json(g.to_json()) == g
    with pytest.raises(HyperparameterError, match="seed"):
        P.PLUMAGE(seed=2**64)
    with pytest.raises(HyperparameterError, match="proj_side"):
        P.PLUMAGE(proj_side="both")
    with pytest.raises(HyperparameterError, match=r"w: rank = 6"):
        P.init_state(P.PLUMAGE(rank=6), {"w": np.zeros((5, 8))})


def test_sides_follow_algorithm4():
    h = P.PLUMAGE(rank=2)
    assert P.side_of((4, 6), h) == "left" and P.side_of((6, 6), h) == "left"
    assert P.side_of((6, 4), h) == "right"
    assert P.side_of((4, 6), h.replace(proj_side="right")) == "right"


def test_jax_stream_is_fold_in():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from xopt import random as xrandom
    from xopt.jax.plumage import draws as jax_draws

    perm, u = jax_draws(5, 2, jnp.asarray(17, jnp.int32), 9)
    words = xrandom.bits(xrandom.fold_in(5, 2, 17), (2, 9))
    np.testing.assert_array_equal(np.asarray(perm), np.lexsort((words[1], words[0])))
    assert float(u) == float(xrandom.uniform(xrandom.fold_in(5, 2, 17), (), counter=9))


def test_decompose_uses_the_sign_convention_on_the_projected_side():
    rng = np.random.default_rng(0)
    g = rng.standard_normal((7, 4))
    u, s = P.decompose(np, g, "right")
    ref_u, ref_s, ref_vh = np.linalg.svd(g, full_matrices=False)
    np.testing.assert_allclose(s, ref_s)
    np.testing.assert_allclose(np.abs(u), np.abs(ref_vh.T), atol=1e-12)
    rows = np.argmax(np.abs(u), axis=0)
    assert np.all(u[rows, np.arange(4)] > 0)
    u2, _, _ = lowrank.svd(np, g.T)
    np.testing.assert_array_equal(u, u2)
