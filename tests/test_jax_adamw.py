"""xopt.jax.adamw: bitwise against optax, against the float64 oracle, against torch.optim.

The bitwise tests compare params, updates and state at every step, with state read
through the namings (the spec's ``"xopt.jax"`` for ours, the harness's
``xopt.parity.methods.adamw.OPTAX_NAMING`` for optax's), so they also check the state
layout the spec promises.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import xopt.jax  # noqa: E402
from xopt.errors import HyperparameterError  # noqa: E402
from xopt.parity.methods.adamw import OPTAX_NAMING, TOLERANCES, torch_kwargs  # noqa: E402
from xopt.parity.runners import flatten_with_paths  # noqa: E402
from xopt.specs import adamw as spec  # noqa: E402

STEPS = 20
SEED = 20240613

# -- fixtures and helpers --------------------------------------------------------------------

# Ranks 0, 1, 2, 3, with nested names.
SHAPES = {
    "scale": (),
    "mlp/bias": (5,),
    "mlp/kernel": (6, 4),
    "conv/w": (2, 3, 4),
}


def _nest(flat: dict) -> dict:
    out: dict = {}
    for name, value in flat.items():
        *outer, last = name.split("/")
        d = out
        for k in outer:
            d = d.setdefault(k, {})
        d[last] = value
    return out


def _flatten(tree) -> dict:
    """A pytree as ``{"a/b/0/c": leaf}`` (the harness's naming of pytree paths)."""
    return flatten_with_paths(tree)


def make_params(rng: np.random.Generator, dtype=jnp.float32) -> dict:
    return _nest({n: jnp.asarray(rng.standard_normal(s), dtype) for n, s in SHAPES.items()})


def make_grads(rng: np.random.Generator, params, dtype=None):
    """Gradients whose magnitudes span 1e-6 .. 1e3, about a fifth of them exactly zero."""

    def one(p):
        g = rng.standard_normal(p.shape) * 10.0 ** rng.integers(-6, 4, p.shape)
        g = g * (rng.random(p.shape) > 0.2)
        if g.size > 1:
            g.flat[0] = 0.0  # at least one exact zero in every non-scalar tensor
        return jnp.asarray(g, dtype or p.dtype)

    return jax.tree.map(one, params)


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def assert_bitwise(a, b, what: str) -> None:
    fa, fb = _flatten(a), _flatten(b)
    assert fa.keys() == fb.keys(), what
    for k in fa:
        x, y = np.asarray(fa[k]), np.asarray(fb[k])
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what} {k}: {x.dtype}{x.shape} " \
            f"vs {y.dtype}{y.shape}"
        if not np.array_equal(_bits(x), _bits(y)):
            diff = np.flatnonzero(_bits(x) != _bits(y))
            raise AssertionError(
                f"{what} {k!r}: {diff.size} of {x.size} elements differ, first at flat index "
                f"{diff[0]}: {x.flat[diff[0]]!r} vs {y.flat[diff[0]]!r}"
            )


def canonical(state, naming, hp: spec.AdamW, *, strict: bool) -> dict:
    return spec.STATE.to_canonical(naming, _flatten(state), list(SHAPES), hp, strict=strict)


def assert_state_bitwise(ours, theirs, their_naming, hp: spec.AdamW, what: str) -> None:
    a = canonical(ours, "xopt.jax", hp, strict=True)  # exactly the promised layout
    b = canonical(theirs, their_naming, hp, strict=False)  # optax's chain holds more
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, f"{what} state {k}: {a[k].dtype} vs {b[k].dtype}"
        if not np.array_equal(_bits(a[k]), _bits(b[k])):
            raise AssertionError(f"{what}: state {k!r} differs: {a[k]!r} vs {b[k]!r}")


def run_pair(ours, theirs, *, jit: bool, hp: spec.AdamW, their_naming=OPTAX_NAMING,
             state_of=lambda s: s, their_state_of=lambda s: s, dtype=jnp.float32,
             steps: int = STEPS, between=None):
    """Step both transformations on the same gradients; compare everything every step."""
    rng = np.random.default_rng(SEED)
    params = make_params(rng, dtype)
    s_a, s_b = ours.init(params), theirs.init(params)
    up_a, up_b = (jax.jit(ours.update), jax.jit(theirs.update)) if jit else (ours.update,
                                                                               theirs.update)
    p_a = p_b = params
    for step in range(steps):
        if between is not None:
            s_a, s_b = between(step, s_a, s_b)
        g = make_grads(rng, params)
        u_a, s_a = up_a(g, s_a, p_a)
        u_b, s_b = up_b(g, s_b, p_b)
        what = f"step {step + 1} (jit={jit})"
        assert_bitwise(u_a, u_b, f"{what} updates")
        assert_state_bitwise(state_of(s_a), their_state_of(s_b), their_naming, hp, what)
        p_a, p_b = optax.apply_updates(p_a, u_a), optax.apply_updates(p_b, u_b)
        assert_bitwise(p_a, p_b, f"{what} params")
    return p_a, s_a


def optax_hp(**kw) -> spec.AdamW:
    return spec.AdamW(**{**spec.PRESETS["optax"], **kw})


# -- bitwise against optax.adamw ---------------------------------------------------------------

SCHEDULE = optax.linear_schedule(1e-2, 1e-4, transition_steps=15)

OPTAX_CASES = {
    "defaults": dict(learning_rate=1e-3),
    "lr1e-2_wd0.1": dict(learning_rate=1e-2, weight_decay=0.1),
    "wd0": dict(learning_rate=1e-3, weight_decay=0.0),
    "eps_root": dict(learning_rate=1e-3, eps_root=1e-8),
    "nesterov": dict(learning_rate=1e-3, nesterov=True),
    "schedule": dict(learning_rate=SCHEDULE),
    "b1_0": dict(learning_rate=1e-3, b1=0.0),
    "b2_0.95_eps1e-6": dict(learning_rate=3e-3, b2=0.95, eps=1e-6, weight_decay=1e-2),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", list(OPTAX_CASES))
def test_bitwise_vs_optax_adamw(case, jit):
    kw = OPTAX_CASES[case]
    hp = optax_hp(nesterov=kw.get("nesterov", False))  # only the state layout depends on hp
    run_pair(xopt.jax.adamw(**kw), optax.adamw(**kw), jit=jit, hp=hp)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_bitwise_vs_optax_single_leaf_and_bf16(jit):
    """bf16 params and gradients: state dtypes follow the params (as optax), bits agree."""
    hp = optax_hp()
    p_a, s_a = run_pair(xopt.jax.adamw(1e-2, weight_decay=0.1), optax.adamw(1e-2,
                        weight_decay=0.1), jit=jit, hp=hp, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves((p_a, s_a.mu, s_a.nu)))
    assert s_a.count.dtype == jnp.int32

    # A single parameter: XLA treats a division by a scalar with one use differently
    # (reciprocal multiply); both must still agree.
    rng = np.random.default_rng(SEED)
    p = {"w": jnp.asarray(rng.standard_normal((7, 3)), jnp.float32)}
    a, b = xopt.jax.adamw(1e-3), optax.adamw(1e-3)
    sa, sb = a.init(p), b.init(p)
    ua_f, ub_f = (jax.jit(a.update), jax.jit(b.update)) if jit else (a.update, b.update)
    for _ in range(10):
        g = make_grads(rng, p)
        ua, sa = ua_f(g, sa, p)
        ub, sb = ub_f(g, sb, p)
        assert_bitwise(ua, ub, "single-leaf updates")
        assert_bitwise((sa.mu, sa.nu), (sb[0].mu, sb[0].nu), "single-leaf state")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_bitwise_spec_argument(jit):
    """``spec=`` gives the same transformation as the equivalent field arguments."""
    h = optax_hp(lr=1e-2, weight_decay=0.05, eps_root=1e-9)
    run_pair(xopt.jax.adamw(spec=h), optax.adamw(1e-2, weight_decay=0.05, eps_root=1e-9),
             jit=jit, hp=h, steps=8)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_bitwise_amsgrad_vs_optax_chain(jit):
    lr, wd = 3e-3, 1e-2
    ours = xopt.jax.adamw(lr, weight_decay=wd, amsgrad=True)
    theirs = optax.chain(optax.scale_by_amsgrad(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0),
                         optax.add_decayed_weights(wd), optax.scale_by_learning_rate(lr))
    _, state = run_pair(ours, theirs, jit=jit, hp=optax_hp(amsgrad=True))
    assert state.nu_max is not None


@pytest.mark.parametrize("mask_kind", ["tree", "prefix", "callable"])
def test_bitwise_weight_decay_mask_vs_optax(mask_kind):
    if mask_kind == "tree":
        mask = _nest({n: len(s) >= 2 for n, s in SHAPES.items()})
    elif mask_kind == "prefix":
        mask = {"scale": False, "mlp": True, "conv": False}
    else:
        def mask(tree):
            return jax.tree.map(lambda x: x.ndim >= 2, tree)
    kw = dict(learning_rate=1e-2, weight_decay=0.5, mask=mask)
    for jit in (False, True):
        run_pair(xopt.jax.adamw(**kw), optax.adamw(**kw), jit=jit, hp=optax_hp(), steps=8)


def test_maximize_is_descent_on_negated_gradients():
    rng = np.random.default_rng(SEED)
    params = make_params(rng)
    up, down = xopt.jax.adamw(1e-2, maximize=True), optax.adamw(1e-2)
    s_up, s_down = up.init(params), down.init(params)
    for _ in range(5):
        g = make_grads(rng, params)
        u1, s_up = up.update(g, s_up, params)
        u2, s_down = down.update(jax.tree.map(jnp.negative, g), s_down, params)
        assert_bitwise(u1, u2, "maximize")


# -- optax compatibility -----------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_inside_chain_with_clipping(jit):
    ours = optax.chain(optax.clip_by_global_norm(1.0), xopt.jax.adamw(1e-2, weight_decay=0.1))
    theirs = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
    run_pair(ours, theirs, jit=jit, hp=optax_hp(), state_of=lambda s: s[1],
             their_state_of=lambda s: s[1])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_inject_hyperparams_bitwise_vs_optax(jit):
    """Under optax.inject_hyperparams, with the learning rate changed between steps, the
    updates and state stay bitwise optax's (that values are injected and used for every
    transformation: tests/contract/)."""
    ours = optax.inject_hyperparams(xopt.jax.adamw)(learning_rate=0.1)
    theirs = optax.inject_hyperparams(optax.adamw)(learning_rate=0.1)
    schedule = {3: 0.01, 6: 0.0, 9: 0.5, 12: 1e-3}
    lrs = []

    def between(step, s_a, s_b):
        if step in schedule:
            s_a.hyperparams["learning_rate"] = jnp.asarray(schedule[step], jnp.float32)
            s_b.hyperparams["learning_rate"] = jnp.asarray(schedule[step], jnp.float32)
        lrs.append(float(s_a.hyperparams["learning_rate"]))
        return s_a, s_b

    run_pair(ours, theirs, jit=jit, hp=optax_hp(), state_of=lambda s: s.inner_state,
             their_state_of=lambda s: s.inner_state, between=between, steps=14)
    assert lrs[:4] == [pytest.approx(0.1)] * 3 + [pytest.approx(0.01)]


def test_weight_decay_zero_needs_no_params():
    tx = xopt.jax.adamw(1e-3, weight_decay=0.0)
    rng = np.random.default_rng(SEED)
    params = make_params(rng)
    grads = make_grads(rng, params)
    u1, _ = tx.update(grads, tx.init(params))
    u2, _ = optax.adamw(1e-3, weight_decay=0.0).update(grads, optax.adamw(
        1e-3, weight_decay=0.0).init(params), params)
    assert_bitwise(u1, u2, "no params")


def test_state_layout():
    rng = np.random.default_rng(SEED)
    params = make_params(rng)
    s = xopt.jax.adamw().init(params)
    assert isinstance(s, xopt.jax.AdamWState)
    assert s.count.shape == () and s.count.dtype == jnp.int32
    assert s.nu_max is None
    assert jax.tree.structure(s.mu) == jax.tree.structure(params)
    s = xopt.jax.adamw(amsgrad=True).init(params)
    flat = canonical(s, "xopt.jax", optax_hp(amsgrad=True), strict=True)
    assert set(flat) == {"step"} | {f"{v}/{n}" for v in ("m", "v", "v_max") for n in SHAPES}


# -- against the float64 oracle ----------------------------------------------------------------


def _start(hp: spec.AdamW):
    """A jitted update of ``xopt.jax.adamw(spec=hp)``, the seeded generator, params, state."""
    tx = xopt.jax.adamw(spec=hp)
    rng = np.random.default_rng(SEED)
    params = make_params(rng)
    return jax.jit(tx.update), rng, params, tx.init(params)


def _rel_err(a, b, floor: float = 0.0) -> float:
    """``max|a-b| / max(max|b|, floor)``: the spec's relative error of one tensor."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.max(np.abs(b)) if b.size else 0.0, floor)
    err = np.max(np.abs(a - b)) if b.size else 0.0
    return 0.0 if err == 0 else (np.inf if scale == 0 else err / scale)


ORACLE_CASES = {
    "optax_defaults": dict(),
    "wd0.1_nesterov": dict(lr=1e-2, weight_decay=0.1, nesterov=True),
    "amsgrad_maximize_eps_root": dict(amsgrad=True, maximize=True, eps_root=1e-8),
    "torch_formula": dict(formula="torch", weight_decay=1e-2),
    "torch_formula_amsgrad": dict(formula="torch", amsgrad=True, lr=1e-2),
}


@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_teacher_forced_vs_float64_oracle(case):
    """One step from our float32 state, cast to float64, through ``spec.step`` under NumPy."""
    hp = optax_hp(**ORACLE_CASES[case])
    update, rng, params, state = _start(hp)
    tol = TOLERANCES["teacher_forced"].rel
    worst = 0.0
    for step in range(STEPS):
        grads = make_grads(rng, params)
        # The oracle, from the same state (float32 values, float64 arithmetic).
        p64 = {n: np.asarray(v, np.float64) for n, v in _flatten(params).items()}
        g64 = {n: np.asarray(v, np.float64) for n, v in _flatten(grads).items()}
        s64 = {k: (np.asarray(v, np.float64) if k != "step" else np.int64(v))
               for k, v in canonical(state, "xopt.jax", hp, strict=True).items()}
        want_p, want_s = spec.step(hp, p64, s64, g64, xp=np)

        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        got_p, got_u = _flatten(params), _flatten(updates)
        got_s = canonical(state, "xopt.jax", hp, strict=True)
        assert int(got_s["step"]) == int(want_s["step"]) == step + 1
        for n in SHAPES:
            errs = {
                "param": _rel_err(got_p[n], want_p[n]),
                **{k: _rel_err(got_s[f"{k}/{n}"], want_s[f"{k}/{n}"])
                   for k in ("m", "v", "v_max") if f"{k}/{n}" in want_s},
            }
            if hp.formula == "optax":
                # The update itself (the params check alone hides its errors under p's
                # magnitude). Adam's normalised step is of order η; where its terms cancel
                # (Nesterov's two momentum terms, the decay λθ) |u| can be far below the
                # terms whose rounding it carries, so the scale is at least η. (Under
                # formula "torch" the update is p_new - p and carries p_new's rounding, an
                # ulp of p: there the params are the quantity to check.)
                errs["update"] = _rel_err(got_u[n], want_p[n] - p64[n], floor=hp.lr)
            for what, e in errs.items():
                assert e <= tol, f"step {step + 1} {what} {n}: relative error {e:.3g} > {tol}"
                worst = max(worst, e)
    assert worst > 0  # float32 against float64: some rounding must show


# -- formula="torch" against torch.optim.AdamW ---------------------------------------------------


@pytest.mark.parametrize("opts", [dict(), dict(amsgrad=True, maximize=True),
                                  dict(lr=1e-2, weight_decay=0.0)],
                         ids=["defaults", "amsgrad_maximize", "wd0"])
def test_torch_formula_vs_torch_optim(opts):
    """Teacher-forced: each step starts torch from our params and state.

    Not bitwise, and not expected to be: (1) we return the update p_new - p and optax's
    apply_updates computes p + (p_new - p), which rounds (by up to an ulp of p); (2) torch
    computes the bias corrections 1 - β^t, the step size lr / (1 - β₁^t) and √(1 - β₂^t) in
    double precision from a Python float step, we in float32 from the int32 count (XLA has
    no float64 here without jax_enable_x64), as −expm1(t·log1p(β − 1)), a few ulp from it.
    """
    torch = pytest.importorskip("torch")
    hp = spec.AdamW(**{**spec.PRESETS["torch"], **opts})
    update, rng, params, state = _start(hp)
    tol = TOLERANCES["teacher_forced"].rel
    for step in range(STEPS):
        grads = make_grads(rng, params)
        flat_p, flat_g = _flatten(params), _flatten(grads)
        cs = canonical(state, "xopt.jax", hp, strict=True)
        tparams = {n: torch.tensor(np.asarray(flat_p[n]), requires_grad=True) for n in SHAPES}
        opt = torch.optim.AdamW(list(tparams.values()), **torch_kwargs(hp))
        for n, tp in tparams.items():
            tp.grad = torch.tensor(np.asarray(flat_g[n]))
            if step:
                st = {"step": torch.tensor(float(step), dtype=torch.float32),
                      "exp_avg": torch.tensor(cs[f"m/{n}"]),
                      "exp_avg_sq": torch.tensor(cs[f"v/{n}"])}
                if hp.amsgrad:
                    st["max_exp_avg_sq"] = torch.tensor(cs[f"v_max/{n}"])
                opt.state[tp] = st
        opt.step()

        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        got_p, cs = _flatten(params), canonical(state, "xopt.jax", hp, strict=True)
        for n, tp in tparams.items():
            ts = opt.state[tp]
            pairs = {"param": (got_p[n], tp.detach().numpy()),
                     "m": (cs[f"m/{n}"], ts["exp_avg"].numpy()),
                     "v": (cs[f"v/{n}"], ts["exp_avg_sq"].numpy())}
            if hp.amsgrad:
                pairs["v_max"] = (cs[f"v_max/{n}"], ts["max_exp_avg_sq"].numpy())
            for what, (a, b) in pairs.items():
                e = _rel_err(a, b)
                assert e <= tol, f"step {step + 1} {what} {n}: relative error {e:.3g} > {tol}"
            assert float(ts["step"]) == int(cs["step"]) == step + 1


# -- bad input ---------------------------------------------------------------------------------


def test_out_of_range_values_name_the_field():
    with pytest.raises(HyperparameterError, match=r"b1 = 1\.5"):
        xopt.jax.adamw(b1=1.5)
    with pytest.raises(HyperparameterError, match="learning_rate.*lr = -0.1"):
        xopt.jax.adamw(learning_rate=-0.1)
    with pytest.raises(HyperparameterError, match="eps"):
        xopt.jax.adamw(eps=-1.0)
    with pytest.raises(HyperparameterError, match="formula"):
        xopt.jax.adamw(formula="keras")
    with pytest.raises(HyperparameterError, match="nesterov"):
        xopt.jax.adamw(nesterov=True, formula="torch")


def test_spec_plus_conflicting_field():
    h = optax_hp(lr=1e-2)
    with pytest.raises(HyperparameterError, match="weight_decay"):
        xopt.jax.adamw(spec=h, weight_decay=0.5)
    with pytest.raises(HyperparameterError, match="learning_rate"):
        xopt.jax.adamw(3e-4, spec=h)
    with pytest.raises(HyperparameterError, match="spec"):
        xopt.jax.adamw(spec={"lr": 1e-2})
    xopt.jax.adamw(spec=h, b1=0.9)  # equal to the default: not a conflict


def test_missing_params_with_weight_decay():
    tx = xopt.jax.adamw(1e-3, weight_decay=1e-4)
    rng = np.random.default_rng(SEED)
    params = make_params(rng)
    with pytest.raises(ValueError, match="params"):
        tx.update(make_grads(rng, params), tx.init(params))
    tx = xopt.jax.adamw(1e-3, weight_decay=0.0, formula="torch")
    with pytest.raises(ValueError, match="params"):
        tx.update(make_grads(rng, params), tx.init(params))
