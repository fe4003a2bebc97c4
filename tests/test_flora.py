"""Flora: the original's seed rule, closed-form updates, validation, and xopt's three
implementations (NumPy oracle, torch, jax) agreeing with each other.

Independent references used here: the golden trace's recorded seeds and generator seeds
(the original's own ``next_seed``/``split_seed``), torch's CPU generator itself, Python
big-integer arithmetic, and updates written out by hand from the paper's/Adafactor's
formulas for cases where they have a closed form.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import needs_jax, needs_torch

from xopt.errors import HyperparameterError
from xopt.parity import bundled_traces, load_trace
from xopt.specs import flora as F
from xopt.specs._groups import ParamGroups

TRACE = bundled_traces("flora")[0]


# -- seeds: the original's next_seed / split_seed in integer arithmetic -----------------------


def test_seed_rule_reproduces_every_recorded_seed_and_generator_seed():
    tr = load_trace(TRACE)
    shapes = tr.params
    transfers = 0
    for t in range(tr.steps):
        aux = tr.aux(t)
        for name, shape in shapes.items():
            if f"{name}/seed_before" not in aux:
                continue
            before, after = int(aux[f"{name}/seed_before"]), int(aux[f"{name}/seed_after"])
            transferred = bool(aux[f"{name}/transferred"])
            assert transferred == ((t + 1) % 4 == 0)  # kappa = 4, 1-based step
            assert after == (F.next_seed(before) if transferred else before)
            which = 0 if F.side(shape) == "left" else 1
            assert F.split_seed(before)[which] == int(aux[f"{name}/gen_seed_before"])
            assert F.split_seed(after)[which] == int(aux[f"{name}/gen_seed_after"])
            transfers += transferred
    assert transfers == 4 * 6


def test_initial_seeds_follow_group_order_as_the_original():
    tr = load_trace(TRACE)
    from xopt.parity.methods.flora import from_kwargs

    hp = from_kwargs(tr.hyperparameters)
    assert isinstance(hp, ParamGroups)
    seeds = F.initial_seeds(hp, list(tr.params))
    init = tr.init_state()
    assert seeds == {n: int(init[f"{n}/seed"]) for n in tr.params}


@needs_torch
@pytest.mark.parametrize("seed", [0, 1, 6, 2**31 - 1, 2**32, 2**32 + 5, 2**40 + 123,
                                  505211975917066638, 2**63 - 2])
def test_randint_matches_torch_generator(seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    expected = torch.randint(0, torch.iinfo(torch.int64).max, (15,), generator=g).tolist()
    assert F.torch_randint63(seed, 15) == expected
    assert F.next_seed(seed) == expected[-1]


@needs_jax
def test_jax_next_seed_is_the_integer_rule_under_jit():
    import jax
    import jax.numpy as jnp

    from xopt.jax.flora import next_seed_words

    seeds = [0, 1, 5, 2**32 - 1, 2**32 + 7, 505211975917066638, 2**63 - 2, 12345678901234]
    words = jnp.asarray(np.stack([F.encode_seed_words(s) for s in seeds]))
    out = np.asarray(jax.jit(jax.vmap(next_seed_words))(words))
    assert [int(F.decode_seed_words(w)) for w in out] == [F.next_seed(s) for s in seeds]


@needs_jax
def test_jax_reduction_mod_int64_max_edge_cases():
    import jax.numpy as jnp

    from xopt.jax.flora import mod_int64_max

    m = 2**63 - 1
    for v in [0, 1, m - 1, m, m + 1, 2**63 + 5, 2**64 - 1, 2**64 - 2, 2**32 - 1, 2**32,
              0x7FFFFFFF_FFFFFFFF, 0xFFFFFFFF_00000000]:
        hi, lo = mod_int64_max(jnp.uint32(v >> 32), jnp.uint32(v & 0xFFFFFFFF))
        assert (int(hi) << 32) | int(lo) == v % m, v


# -- projections --------------------------------------------------------------------------------


def test_projection_shapes_and_scale():
    for shape, pshape, mshape in [((6, 9), (3, 6), (3, 9)), ((9, 6), (6, 3), (9, 3)),
                                  ((8, 8), (8, 3), (8, 3))]:
        h = F.Flora(lr=0.1, rank=3, beta1=0.9)
        assert F.projection_shape(shape, 3) == pshape
        assert F.momentum_shape(shape, h) == mshape
    p = F.projection(17, (4000, 64), 16, xp=np, dtype=np.float64)
    assert p.shape == (64, 16)
    # entries N(0, 1/r): the sample variance of 1024 entries is within 5 sigma of 1/16
    assert abs(p.var() - 1 / 16) < 5 * (1 / 16) * math.sqrt(2 / p.size)


@needs_torch
@needs_jax
def test_projection_draws_are_bitwise_identical_across_backends():
    import jax.numpy as jnp
    import torch

    seed = 505211975917066638
    a = F.projection(seed, (20, 12), 4, xp=np, dtype=np.float32)
    b = F.projection(seed, (20, 12), 4, xp=torch, dtype=torch.float32).numpy()
    c = np.asarray(F.projection(jnp.asarray(F.encode_seed_words(seed)), (20, 12), 4, xp=jnp,
                                dtype=jnp.float32))
    assert np.array_equal(a, b) and np.array_equal(a, c)


# -- the rules for which parameters are compressed ---------------------------------------------


def test_which_parameters_are_compressed():
    h = F.Flora(lr=0.1, rank=4, beta1=0.9)
    assert F.compressed((32, 16), h) and F.side((32, 16)) == "right"
    assert F.compressed((12, 48), h) and F.side((12, 48)) == "left"
    assert not F.compressed((12, 49), h)  # aspect ratio > 4: an embedding, full momentum
    assert not F.compressed((16,), h) and not F.compressed((4, 4, 4), h)
    assert not F.compressed((32, 16), h.replace(project=False))
    assert not F.compressed((32, 16), h.replace(beta1=None))
    assert not F.compressed((32, 16), h.replace(rank=None))
    assert not F.compressed((32, 16), h.replace(factorize_second_moment=False))


@pytest.mark.parametrize("values,field", [
    (dict(lr=0.1, quantization=True), "quantization"),
    (dict(), "lr"),
    (dict(lr=0.1, relative_step=True), "relative_step"),
    (dict(lr=0.1, warmup_init=True), "warmup_init"),
    (dict(lr=0.1, kappa=0), "kappa"),
    (dict(lr=0.1, rank=2.5), "rank"),
    (dict(lr=0.1, rank=-1), "rank"),
    (dict(lr=0.1, eps=(1e-30,)), "eps"),
    (dict(lr=0.1, beta1=1.0), "beta1"),
    (dict(lr=0.1, decay_rate=0.5), "decay_rate"),
    (dict(lr=0.1, seed=-1), "seed"),
])
def test_bad_hyperparameters_name_the_field(values, field):
    with pytest.raises(HyperparameterError, match=rf"Flora\.{field}"):
        F.Flora(**values)


def test_json_round_trip():
    h = F.Flora(lr=0.1 + 0.2, rank=4, beta1=0.9, eps=(1e-30, 1e-3), seed=2**40)
    assert F.Flora.from_json(h.to_json()) == h
    assert F.Flora(relative_step=True, warmup_init=True).lr is None


def test_state_schema_round_trips_between_namings_with_64_bit_seeds():
    h = F.Flora(lr=0.1, rank=2, beta1=0.9)
    params = {"w": np.zeros((6, 8)), "b": np.zeros(8)}
    state = F.init_state(h, params, dtype=np.float32)
    state["seed/w"] = np.int64(505211975917066638)
    for naming in F.STATE.namings:
        flat = F.STATE.from_canonical(naming, state, list(params), h)
        back = F.STATE.to_canonical(naming, flat, list(params), h)
        assert back.keys() == state.keys()
        for k in state:
            assert np.array_equal(back[k], state[k]) and back[k].shape == np.shape(state[k]), k
    flat = F.STATE.from_canonical("xopt.jax", state, list(params), h)
    assert flat["seed/w"].dtype == np.uint32 and flat["seed/w"].shape == (2,)


# -- closed forms --------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,eta", [
    (dict(lr=0.05), lambda t: 0.05),
    (dict(lr=None, relative_step=True), lambda t: min(1e-2, 1 / math.sqrt(t))),
    (dict(lr=None, relative_step=True, warmup_init=True),
     lambda t: min(1e-6 * t, 1 / math.sqrt(t))),
])
def test_first_step_of_a_vector_is_the_sign_times_the_scaled_step(kw, eta):
    # 1-D, beta1=None: V = g² + ε₀ at t = 1 (β₂₁ = 0), u = g/√V = sign(g), rms(u) = 1 (no
    # clipping at threshold 1), η_1 = η·max(ε₁, rms(p)); decay: p(1 − η_1 λ) − η_1 u.
    p = np.array([0.5, -1.0, 2.0, 0.25])
    g = np.array([0.3, -0.2, 0.1, -4.0])
    wd = 0.1
    h = F.Flora(weight_decay=wd, **kw)
    state = F.init_state(h, {"x": p})
    new_p, new_s = F.step(h, {"x": p}, state, {"x": g})
    lr1 = eta(1) * max(1e-3, math.sqrt(np.mean(p * p)))
    np.testing.assert_allclose(new_p["x"], p * (1 - lr1 * wd) - lr1 * np.sign(g), rtol=1e-12)
    assert new_s["step"] == 1 and new_s["seed/x"] == 1
    np.testing.assert_allclose(new_s["rms/x"], math.sqrt(np.mean(p * p)), rtol=1e-12)


def test_factored_second_moment_and_clipping_closed_form():
    # 2-D, t = 1: R_i = mean_j(g²+ε₀), C_j = mean_i(g²+ε₀), u = g / √(R_i C_j / mean(R));
    # then u / max(1, rms(u)/d); no momentum; scale_parameter off.
    rng = np.random.default_rng(0)
    g = rng.standard_normal((5, 7))
    g[0, 0] = 40.0  # makes rms(u) exceed the threshold
    p = rng.standard_normal((5, 7))
    h = F.Flora(lr=0.1, scale_parameter=False, clip_threshold=0.5)
    new_p, s = F.step(h, {"w": p}, F.init_state(h, {"w": p}), {"w": g})
    a = g * g + 1e-30
    r, c = a.mean(axis=1), a.mean(axis=0)
    u = g / np.sqrt(np.outer(r, c) / r.mean())
    rms_u = math.sqrt(np.mean(u * u))
    assert rms_u > 0.5
    np.testing.assert_allclose(new_p["w"], p - 0.1 * u / (rms_u / 0.5), rtol=1e-12)
    np.testing.assert_allclose(s["v_row/w"], r, rtol=1e-12)


def test_compressed_momentum_two_steps_closed_form():
    # Flora's Algorithm 2 written out: t = 1 stores C = (1-β₁) down(P, u₁); t = 2 updates
    # with (1-β₁) u₂ + β₁ up(P, C) and, with kappa = 2, moves C to P' = P(next_seed(s)).
    # (Compression needs the factored second moment, as in the original's _get_options.)
    rng = np.random.default_rng(1)
    shape, r, b1 = (6, 10), 3, 0.9  # left: P is (r, m)
    p = rng.standard_normal(shape)
    g1, g2 = rng.standard_normal(shape), rng.standard_normal(shape)
    h = F.Flora(lr=0.1, rank=r, beta1=b1, kappa=2, scale_parameter=False, clip_threshold=1e9)
    p1, s1 = F.step(h, {"w": p}, F.init_state(h, {"w": p}), {"w": g1})
    p2, s2 = F.step(h, p1, s1, {"w": g2})
    P = F.projection(1, shape, r, xp=np, dtype=np.float64)
    P2 = F.projection(F.next_seed(1), shape, r, xp=np, dtype=np.float64)
    assert P.shape == (r, 6) and s1["m/w"].shape == (r, 10)

    def adafactor(g, row, col, beta2):
        a = g * g + 1e-30
        row = beta2 * row + (1 - beta2) * a.mean(axis=1)
        col = beta2 * col + (1 - beta2) * a.mean(axis=0)
        return row, col, g / np.sqrt(np.outer(row, col) / row.mean())

    row, col, u1 = adafactor(g1, 0.0, 0.0, 0.0)
    C1 = (1 - b1) * (P @ u1)
    np.testing.assert_allclose(s1["m/w"], C1, rtol=1e-12)
    np.testing.assert_allclose(p1["w"], p - 0.1 * (1 - b1) * u1, rtol=1e-12)
    _, _, u2 = adafactor(g2, row, col, 1 - 2**-0.8)
    upd = (1 - b1) * u2 + b1 * (P.T @ C1)
    np.testing.assert_allclose(p2["w"], p1["w"] - 0.1 * upd, rtol=1e-12)
    C2 = b1 * (P2 @ (P.T @ C1)) + (1 - b1) * (P2 @ u2)
    np.testing.assert_allclose(s2["m/w"], C2, rtol=1e-12)
    assert s2["seed/w"] == F.next_seed(1)


# -- torch ---------------------------------------------------------------------------------------


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"a/emb": (4, 40), "b/bias": (12,), "c/tall": (24, 8), "d/wide": (8, 20),
              "e/conv": (3, 4, 2)}
    params = {k: rng.standard_normal(s).astype(np.float32) * 0.3 for k, s in shapes.items()}
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
             for _ in range(5)]
    return params, grads


CONFIGS = {
    "momentum": dict(lr=0.05, rank=3, beta1=0.9, kappa=2, weight_decay=0.01),
    "adam_v": dict(lr=0.05, rank=3, beta1=0.9, kappa=3, factorize_second_moment=False),
    "relative": dict(lr=None, relative_step=True, warmup_init=True, rank=2, beta1=0.5,
                     kappa=2, clip_threshold=0.3),
    "no_momentum": dict(lr=0.05, rank=3),
}


def _run_oracle(h, params, grads):
    state = F.init_state(h, params, dtype=np.float64)
    p = {k: v.astype(np.float64) for k, v in params.items()}
    for g in grads:
        p, state = F.step(h, p, state, {k: v.astype(np.float64) for k, v in g.items()})
    return p, state


def _run_torch(h, params, grads, dtype=None):
    import torch

    from xopt.torch.flora import Flora

    ts = {k: torch.nn.Parameter(torch.from_numpy(v.copy()).to(dtype or torch.float32))
          for k, v in params.items()}
    opt = Flora(list(ts.values()), spec=h)
    for g in grads:
        for k, p in ts.items():
            p.grad = torch.from_numpy(g[k]).to(p.dtype)
        opt.step()
    return ts, opt


def _run_jax(h, params, grads):
    import jax
    import jax.numpy as jnp
    import optax

    from xopt.jax.flora import flora

    tx = flora(spec=h)
    p = {k: jnp.asarray(v) for k, v in params.items()}
    s = tx.init(p)

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for g in grads:
        p, s = step(p, s, {k: jnp.asarray(v) for k, v in g.items()})
    return p, s


@needs_torch
@needs_jax
@pytest.mark.parametrize("config", list(CONFIGS))
def test_torch_jax_and_oracle_agree_over_five_steps(config):
    # params are sorted by name so torch's order is jax's leaf order (the same seeds)
    h = F.Flora(**CONFIGS[config])
    params, grads = _problem()
    ref_p, ref_s = _run_oracle(h, params, grads)
    tp, opt = _run_torch(h, params, grads)
    jp, js = _run_jax(h, params, grads)
    for k in params:
        scale = np.abs(ref_p[k]).max()
        assert np.abs(tp[k].detach().numpy() - ref_p[k]).max() <= 1e-6 * scale, k
        assert np.abs(np.asarray(jp[k]) - ref_p[k]).max() <= 1e-6 * scale, k
        st = opt.state[tp[k]]
        assert st["seed"] == ref_s[f"seed/{k}"] == F.decode_seed_words(js.seed[k])
        if h.use_momentum:
            m = ref_s[f"m/{k}"]
            assert st["exp_avg"].shape == m.shape == js.m[k].shape
            tol = 1e-5 * np.abs(m).max()
            assert np.abs(st["exp_avg"].numpy() - m).max() <= tol, k
            assert np.abs(np.asarray(js.m[k]) - m).max() <= tol, k
    if config == "momentum":  # transfers at steps 2 and 4 moved the matrices' seeds
        assert opt.state[tp["c/tall"]]["seed"] == F.next_seed(F.next_seed(3))
        assert opt.state[tp["b/bias"]]["seed"] == 2  # not compressed: never transferred
        assert opt.state[tp["a/emb"]]["exp_avg"].shape == (4, 40)  # ratio 10: full


@needs_torch
def test_rank_larger_than_the_matrix_names_the_parameter():
    import torch

    from xopt.torch.flora import Flora

    w = torch.nn.Parameter(torch.zeros(3, 8))
    with pytest.raises(HyperparameterError, match=r"param_groups\[0\]\['params'\]\[0\].*rank = 4"):
        Flora([w], lr=0.1, rank=4, beta1=0.9)
    with pytest.raises(HyperparameterError, match=r": w: rank = 4 is larger than the matrix"):
        Flora([{"params": [w], "param_names": ["w"]}], lr=0.1, rank=4, beta1=0.9)
    Flora([{"params": [w], "project": False}], lr=0.1, rank=4, beta1=0.9)  # opted out
    Flora([w], lr=0.1, rank=4)  # no momentum: nothing to compress


@needs_jax
def test_jax_rank_too_large_names_the_leaf():
    import jax.numpy as jnp

    from xopt.jax.flora import flora

    with pytest.raises(HyperparameterError, match=r"xopt.jax.flora: w.*rank = 4"):
        flora(learning_rate=0.1, rank=4, beta1=0.9).init({"w": jnp.zeros((3, 8))})


@needs_torch
def test_unknown_preset_says_flora_has_none():
    import torch

    from xopt.torch.flora import Flora

    with pytest.raises(HyperparameterError, match="unknown preset 'paper'; Flora has no presets"):
        Flora([torch.nn.Parameter(torch.zeros(2))], lr=0.1, preset="paper")


@needs_torch
def test_added_param_groups_continue_the_seed_count():
    import torch

    from xopt.torch.flora import Flora

    def seeds(add: bool) -> list[int]:
        a, b, c = (torch.nn.Parameter(torch.zeros(4, 4)) for _ in range(3))
        opt = Flora([a, b] if add else [a, b, c], lr=0.1, rank=2, beta1=0.9, seed=10)
        if add:
            opt.add_param_group({"params": [c]})
        assert not opt.state  # no state before the first step (DCP relies on it)
        for p in (a, b, c):
            p.grad = torch.ones(4, 4)
        opt.step()
        return [opt.state[p]["seed"] for p in (a, b, c)]

    assert seeds(add=True) == seeds(add=False)


@needs_torch
@needs_jax
def test_rms_and_the_clip_ratio_divide_once_in_every_namespace():
    """ρ = ‖x‖₂ / √numel on data whose sum of squares is exact (integers times 2⁻⁷): torch
    and jitted JAX give NumPy's float32 quotient, rounded once (XLA would multiply by the
    constant's reciprocal: ρ of the first matrix one ulp off; torch on CUDA by the Python
    number's); torch's clip divides by the ratio rms(u) / d rounded once. (JAX's division of
    the whole update by that ratio is XLA's own: a parity case with clipping active is
    not bitwise across backends.)"""
    import jax
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(7)
    mats = [rng.integers(-127, 128, s) / 128.0 for s in ((5,), (32, 16), (16, 32))][1:]
    mats += [rng.integers(-127, 128, s) / 128.0 for s in [(3, 7), (24, 40), (96, 5)] * 20]
    rms_jit = jax.jit(lambda a: F.rms(jnp, a))
    for x in mats:
        x32 = x.astype(np.float32)
        total = np.float32((x * x).sum())
        assert float(total) == (x * x).sum()  # the sum is exact: only the division rounds
        want = np.float32(np.sqrt(total)) / np.float32(math.sqrt(x.size))
        got = (F.rms(torch, torch.tensor(x32)).numpy(), np.asarray(rms_jit(jnp.asarray(x32))))
        assert got[0] == want and got[1] == want, (x.shape, want, got)
        scale = np.float32(want) / np.float32(0.3)  # clip's ratio, then the update's division
        u_t, _ = F.clip(torch, torch.tensor(x32), 0.3)
        assert np.array_equal(u_t.numpy(), x32 / max(scale, np.float32(1.0)))
