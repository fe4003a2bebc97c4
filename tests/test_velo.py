"""VeLO (xopt.specs.velo, xopt.torch.VeLO, xopt.jax.velo) against learned_optimization's
golden traces, between backends, and the original's behaviours that ports get wrong.

The golden case is the bundled ``velo/perturbed_seed0`` (the one in ../shared/parity when
present): HyperV2 in VeLO's configuration with a perturbed θ, on a problem whose parameters
include a square matrix (``sq/w``), a 0-d scale, and rank-3 and rank-4 tensors. The full
parity suite (every case, every step, both modes) is parity_tests/; xopt.jax's golden
teacher-forced check is there only (parity_tests/test_learned_optimizers.py: the same
harness runner and per-tensor bounds on every step of this case), its compilation being
the costliest part of such a test.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from helpers import SHARED, has_jax, has_torch

from xopt.errors import HyperparameterError, MetaParamsError
from xopt.parity import bundled_traces, load_trace
from xopt.parity.harness import original_of, trace_hyperparameters, trace_state
from xopt.parity.methods import velo as VP
from xopt.specs import velo as V

CASE = "perturbed_seed0"
STEPS = (0, 1, 2, 3)  # update 2 is the first whose loss features are not zero
BOUND = 1e-6  # the spec's teacher-forced tolerance: max|a-b| / max|b| per tensor


def _trace_path():
    shared = SHARED / "parity" / "velo" / f"{CASE}.json"
    if shared.is_file():
        return shared
    bundled = [p for p in bundled_traces("velo") if p.stem == CASE]
    if not bundled:
        pytest.skip(f"no velo/{CASE} trace (neither ../shared/parity nor bundled)")
    return bundled[0]


@pytest.fixture(scope="module")
def golden():
    trace = load_trace(_trace_path())
    origin = original_of(V.SPEC, trace)
    hp = origin.from_kwargs(trace_hyperparameters(trace))
    naming = origin.naming_for(hp)
    meta = trace.meta_params()
    states = {t: trace_state(trace, V.SPEC, hp, naming, t) for t in (-1, *STEPS)}
    params = {-1: trace.init_params(), **{t: trace.params_after(t) for t in STEPS}}
    return trace, hp, meta, states, params


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    d = np.max(np.abs(a - b), initial=0.0)
    return 0.0 if d == 0 else d / max(np.max(np.abs(b)), 1e-300)


def worst(got_params, got_state, want_params, want_state) -> tuple[float, str]:
    """The largest error relative to each tensor's one-update bound (the spec's
    teacher-forced tolerance, whose named exception for the LSTM state is 3e-6), as
    ``(error / bound, tensor)``: at most 1 passes."""
    errs = {f"param/{k}": rel(got_params[k], want_params[k]) for k in want_params}
    errs.update({f"state/{k}": rel(got_state[k], want_state[k]) for k in want_state})
    assert set(got_state) == set(want_state)
    tol = VP.PARITY.tolerance("teacher_forced")
    ratio = {k: e / tol.for_tensor(k).rel for k, e in errs.items()}
    key = max(ratio, key=ratio.get)
    return ratio[key], key


# -- the spec --------------------------------------------------------------------------------


def test_hyperparameters_from_the_originals_arguments(golden):
    trace, hp, *_ = golden
    assert hp == V.VeLO(num_training_steps=trace.num_training_steps)  # VeLO's defaults
    assert hp.lr == 1.0  # the original's step; PyLO's VeLO defaults to 1e-3
    kw = dict(trace.hyperparameters)
    assert VP.from_hyperv2_kwargs({**kw, "num_training_steps": 10}) == hp.replace(
        num_training_steps=10)
    with pytest.raises(HyperparameterError, match="with_rms_norm_g"):
        VP.from_hyperv2_kwargs({**kw, "with_rms_norm_g": False})
    with pytest.raises(HyperparameterError, match="bogus"):
        VP.from_hyperv2_kwargs({**kw, "bogus": 1})
    pre = VP.from_prefab_kwargs({"num_training_steps": 1000, "max_training_steps": 400,
                                 "weight_decay": 0.01, "base_lopt_fn": "x", "HyperV2": kw})
    assert (pre.accumulating, pre.num_average, pre.inner_num_steps) == (True, 3, 333)
    assert V.VeLO.from_json(pre.to_json()) == pre
    with pytest.raises(HyperparameterError, match="initial_rms_decays"):
        V.VeLO(num_training_steps=10, initial_rms_decays=(0.9, 0.99))
    with pytest.raises(HyperparameterError, match="lr"):
        VP.to_hyperv2_kwargs(hp.replace(lr=0.5))


def test_meta_parameters_both_namings_strict(golden):
    _, hp, meta, *_ = golden
    theta = V.coerce_meta(meta, hp)
    assert set(theta) == set(V.meta_shapes(hp))
    assert theta["lstm/gates/w"].shape == (1024, 2048)  # LSTM input is the H-wide mix
    assert theta["mlp_bank/w0"].shape == (256, 30, 4)
    back = V.meta_to_original(theta, hp)
    assert set(back) == set(meta)
    assert all(np.array_equal(back[k], meta[k]) for k in meta)
    assert V.coerce_meta(theta, hp).keys() == theta.keys()
    for bad, key in [({k: v for k, v in meta.items() if k != "rnn_params/step_size/b"},
                      "rnn_params/step_size/b"),
                     ({**meta, "rnn_params/extra/w": meta["rnn_params/step_size/b"]},
                      "rnn_params/extra/w"),
                     ({**meta, "ff_mod_stack/~/w0__3": meta["ff_mod_stack/~/w0__2"]},
                      "ff_mod_stack/~/w0__3"),
                     ({**theta, "lstm/gates/b": theta["lstm/gates/b"][:7]}, "lstm/gates/b"),
                     ({k: v for k, v in theta.items() if k != "mlp_bank/w2"}, "mlp_bank/w2")]:
        with pytest.raises(MetaParamsError, match=key.replace("~", r"\~")):
            V.coerce_meta(bad, hp)


def test_meta_init_same_bits_everywhere():
    hp = V.VeLO(num_training_steps=10, lstm_hidden_size=8, param_inits=4)
    a = V.meta_init(hp, 3)
    assert set(a) == set(V.meta_shapes(hp))
    assert not np.array_equal(a["lstm/gates/w"], V.meta_init(hp, 4)["lstm/gates/w"])
    assert np.all(np.abs(a["lstm/gates/w"]) <= 2 / np.sqrt(16) + 1e-7)
    for backend, ok in (("torch", has_torch), ("jax", has_jax)):
        if ok:
            b = V.meta_init(hp, 3, backend=backend)
            for k in a:
                assert np.array_equal(np.asarray(b[k]), a[k]), (backend, k)


def _spec_step(golden, t, xp=np):
    trace, hp, meta, states, params = golden
    st = states[t - 1]
    aux: dict = {}
    theta = {k: np.asarray(v, np.float32) for k, v in V.coerce_meta(meta, hp).items()}
    p = {k: np.asarray(v, np.float32) for k, v in params[t - 1].items()}
    steps, new = V.hyperv2_steps(hp, p, st, trace.grads(t), np.float32(trace.loss(t)), theta,
                                 xp=np, aux=aux)
    return p, steps, new, aux


@pytest.mark.parametrize("t", [0, 2])
def test_spec_in_float32_reproduces_the_originals_internals(golden, t):
    trace, hp, meta, states, params = golden
    p, steps, new, aux = _spec_step(golden, t)
    gaux = trace.aux(t)
    # the per-tensor LSTM inputs, the LSTM's outputs and the per-tensor MLP statistics
    assert rel(aux["lstm_features"], gaux["lstm_features"]) < BOUND
    assert rel(aux["controls"], gaux["controls"]) < BOUND
    # hypernetwork weights are means of 256 products with cancellation (x ~3 on controls)
    w0 = aux["mlp_weights/w0"]
    for i, k in enumerate(V.MLP_GROUP_SIZES):
        s = sum(V.MLP_GROUP_SIZES[:i])
        assert rel(w0[:, s:s + k], gaux[f"mlp_weights/w0__{i}"]) < 4e-6
    assert rel(aux["feature_sq_mean"], gaux["feature_sq_mean"]) < 4e-6
    new_p = {k: p[k] - steps[k] for k in p}
    ratio, where = worst(new_p, {k: v for k, v in new.items() if k != "iteration"},
                         params[t], {k: v for k, v in states[t].items() if k != "iteration"})
    assert ratio <= 1, f"{where} at {ratio:.3g} of its bound"


def test_square_matrix_factors_follow_the_original(golden):
    # sq/w is 16x16: the original's factored_dims gives (d1, d0) = (0, 1), so v_row (the
    # mean over axis 1) and v_col (over axis 0) differ. PyLO swaps them for square matrices.
    trace, hp, meta, states, params = golden
    _, _, new, _ = _spec_step(golden, 0)
    assert V.lopt.factored_dims((16, 16)) == (0, 1)
    for v in ("v_row", "v_col"):
        assert rel(new[f"{v}/sq/w"], states[0][f"{v}/sq/w"]) < BOUND
    assert rel(states[0]["v_col/sq/w"], states[0]["v_row/sq/w"]) > 1e-2  # a swap shows


def test_scalar_parameter_is_normalised_over_its_one_element(golden):
    # a 0-d parameter is expanded to (1,): each feature group is normalised over that one
    # element, channel by channel. PyLO normalises over all axes (channels mixed).
    trace, hp, meta, states, params = golden
    if not trace.has("step_0000/aux/direction/scale"):
        pytest.skip("this trace records no per-element direction")
    _, _, _, aux = _spec_step(golden, 0)
    gdir = trace.aux(0)["direction/scale"]
    assert rel(aux["direction/scale"], gdir) < 1e-5  # an MLP output: cancellation
    # PyLO's normalisation of the same inputs gives another direction
    st = golden[3][-1]
    p = np.float32(golden[4][-1]["scale"])
    g = np.clip(trace.grads(0)["scale"], -1000, 1000)
    decays = V.decay_arrays(hp)
    m = V.lopt.momentum_update(st["m/scale"], g, decays[0])
    rms = V.lopt.rms_update(np, st["rms/scale"], g, decays[1])
    vr, vc, vd, fac_g = V.lopt.factored_update(np, st["v_row/scale"], st["v_col/scale"],
                                                st["v_diag/scale"], g, decays[2])
    groups = V.mlp_inputs(np, *(np.expand_dims(a, 0) for a in (g, p, m, rms, fac_g)),
                          vr, vc, np.expand_dims(vd, 0))
    pylo = [x / np.sqrt(1e-5 + np.mean(x * x)) for x in groups]
    weights = {k.split("/")[1]: v[list(trace.params).index("scale")]
               for k, v in aux.items() if k.startswith("mlp_weights/")}
    pylo_dir = V.mlp_forward(np, pylo, weights)[..., 0][0]
    assert rel(pylo_dir, gdir) > 1e-2


# -- the backends: golden, teacher-forced ------------------------------------------------------


def _torch_runner(golden):
    from xopt.parity.harness import make_runner

    trace, hp, meta, *_ = golden
    return make_runner(V.SPEC, hp, list(trace.params), "torch", meta=meta)


@pytest.mark.skipif(not has_torch, reason="needs torch")
def test_torch_reproduces_the_original_teacher_forced(golden):
    trace, hp, meta, states, params = golden
    runner = _torch_runner(golden)
    for t in STEPS:
        runner.reset(params[t - 1], states[t - 1])
        runner.step(trace.grads(t), trace.loss(t))
        got_p, got_s = runner.read()
        ratio, where = worst(got_p, got_s, params[t], states[t])
        assert ratio <= 1, f"step {t}: {where} at {ratio:.3g} of its bound"
        # the loss buffer feeds ratios of small differences: it is reproduced bit for bit
        # (XLA's fused multiply-add and float32 pow, see xopt.specs.velo)
        for k in ("loss_means", "loss_running_min"):
            assert np.array_equal(got_s[k], states[t][k]), (t, k)


@pytest.mark.skipif(not has_jax, reason="needs jax")
def test_xla_tanh_and_fused_multiply_add_written_out():
    import jax
    import jax.numpy as jnp

    # the claim is about XLA's CPU code (the golden traces' machine); a GPU's tanh differs
    cpu = jax.devices("cpu")[0]
    x = np.concatenate([np.linspace(-10, 10, 200_001, dtype=np.float32),
                        np.float32(1e-3) * np.linspace(-1, 1, 1001, dtype=np.float32)])
    want = np.asarray(jax.jit(jnp.tanh)(jax.device_put(x, cpu)))
    assert np.array_equal(V.arrays.tanh(np, x), want)
    assert np.mean(np.tanh(x) != want) > 0.1  # NumPy's own tanh is another function
    if has_torch:
        assert np.array_equal(V.arrays.tanh(torch, torch.from_numpy(x)).numpy(), want)
    a, b, c = (np.float32(v) for v in (1 + 2.0 ** -12, 1 + 2.0 ** -12, -(1 + 2.0 ** -11)))
    fused = np.asarray(jax.jit(lambda a, b, c: a * b + c)(*jax.device_put((a, b, c), cpu)))
    assert fused == np.float32(2.0 ** -24) and a * b + c == 0  # one rounding, not two
    assert V.arrays.fma(np, a, b, c) == fused
    if has_torch:
        ta, tb, tc = (torch.tensor(v) for v in (a, b, c))
        assert float(V.arrays.fma(torch, ta, tb, tc)) == fused and float(ta * tb + tc) == 0


# -- torch -------------------------------------------------------------------------------------

if has_torch:
    import torch


def _torch_opt(golden, t=-1, **kw):
    import xopt.torch

    trace, hp, meta, states, params = golden
    ps = [torch.nn.Parameter(torch.from_numpy(params[t][k].copy())) for k in trace.params]
    opt = xopt.torch.VeLO(ps, meta, num_training_steps=trace.num_training_steps, **kw)
    return ps, opt


def _set_grads(ps, grads):
    for p, g in zip(ps, grads.values(), strict=True):
        p.grad = torch.from_numpy(np.array(g, copy=True)).to(p.dtype)


def _snapshot(ps, opt):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return [p.detach().clone() for p in ps], buf.getvalue()


@pytest.mark.skipif(not has_torch, reason="needs torch")
def test_torch_default_lr_is_the_originals_step(golden):
    # float64 parameters (float32 state) so that p_new - p is the step itself
    import xopt.torch

    trace, hp, meta, states, params = golden
    moved = {}
    for lr in (None, 1e-3):  # xopt's default, and PyLO's VeLO default
        ps = [torch.nn.Parameter(torch.from_numpy(params[-1][k].astype(np.float64)))
              for k in trace.params]
        kw = {} if lr is None else {"lr": lr}
        opt = xopt.torch.VeLO(ps, meta, num_training_steps=trace.num_training_steps, **kw)
        assert opt.param_groups[0]["lr"] == (1.0 if lr is None else lr)
        _set_grads(ps, trace.grads(0))
        opt.step(loss=trace.loss(0))
        moved[lr] = {k: p.detach().numpy() - params[-1][k]
                     for k, p in zip(trace.params, ps, strict=True)}
    for k in trace.params:
        want = params[0][k].astype(np.float64) - params[-1][k]  # the original's, rounded
        floor = np.max(np.spacing(np.abs(params[0][k]))) / np.max(np.abs(want))
        assert rel(moved[None][k], want) < max(1e-5, 2 * floor), k
        assert rel(moved[1e-3][k], 1e-3 * moved[None][k]) < 1e-6, k
        assert rel(moved[1e-3][k], want) > 0.99, k


@pytest.mark.skipif(not has_torch, reason="needs torch")
def test_torch_needs_the_loss_and_changes_nothing_without_it(golden):
    trace = golden[0]
    ps, opt = _torch_opt(golden)
    _set_grads(ps, trace.grads(0))
    opt.step(loss=trace.loss(0))
    before_p, before_s = _snapshot(ps, opt)
    _set_grads(ps, trace.grads(1))
    with pytest.raises(ValueError, match="loss"):
        opt.step()
    after_p, after_s = _snapshot(ps, opt)
    assert all(torch.equal(a, b) for a, b in zip(before_p, after_p, strict=True))
    assert before_s == after_s
    opt.step(lambda: torch.tensor(trace.loss(1)))  # a closure is the other way to give it
    assert int(opt.state["global"]["iteration"]) == 2


@pytest.mark.skipif(not has_torch, reason="needs torch")
def test_torch_bad_meta_parameters_name_the_key(golden):
    import xopt.torch

    trace, hp, meta, *_ = golden
    ps = [torch.zeros(3, requires_grad=True)]
    bad = dict(meta)
    bad["rnn_params/rnn/linear/w"] = bad["rnn_params/rnn/linear/w"][:, :10]
    with pytest.raises(MetaParamsError, match="rnn_params/rnn/linear/w"):
        xopt.torch.VeLO(ps, bad, num_training_steps=10)
    with pytest.raises(HyperparameterError, match="num_training_steps"):
        xopt.torch.VeLO(ps, meta)


# -- jax ---------------------------------------------------------------------------------------


def _random_problem(seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"a0": (), "a1": (7,), "a2": (6, 6), "a3": (2, 3, 5), "a4": (2, 2, 3, 4),
              "b": (1, 9)}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    grads = [{k: (rng.standard_normal(s) * 10.0 ** rng.integers(-4, 1)).astype(np.float32)
              for k, s in shapes.items()} for _ in range(5)]
    losses = [float(3.0 - 0.3 * i + 0.05 * rng.standard_normal()) for i in range(5)]
    return params, grads, losses


@pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")
def test_torch_and_jax_agree_on_a_random_problem():
    import jax
    import jax.numpy as jnp
    import optax

    import xopt.jax
    import xopt.torch

    hp = V.VeLO(num_training_steps=20, lstm_hidden_size=16, param_inits=8)
    theta = V.meta_init(hp, 7)  # untrained, but with H = 16 its steps are not small
    params, grads, losses = _random_problem()
    ps = [torch.nn.Parameter(torch.from_numpy(v.copy())) for v in params.values()]
    opt = xopt.torch.VeLO(ps, theta, spec=hp)
    tx = xopt.jax.velo(theta, spec=hp)
    jp = {k: jnp.asarray(v) for k, v in params.items()}
    state = tx.init(jp)
    update = jax.jit(lambda g, s, p, loss: tx.update(g, s, p, value=loss))
    for g, loss in zip(grads, losses, strict=True):
        _set_grads(ps, g)
        opt.step(loss=loss)
        u, state = update({k: jnp.asarray(v) for k, v in g.items()}, state, jp, loss)
        jp = optax.apply_updates(jp, u)
    # five closed-loop updates (parameters moving by up to 10x: the untrained θ's steps are
    # large); each update agrees to float32 rounding of the matrix products (~1e-6), which
    # feeds forward: well inside the spec's closed-loop 1e-4
    for k, p in zip(params, ps, strict=True):
        got, want = p.detach().numpy(), np.asarray(jp[k])
        assert rel(got, want) < 1e-5, k
        assert rel(got - params[k], want - params[k]) < 1e-4, k  # the steps themselves
        assert rel(want, params[k]) > 1e-3, k  # and they are not negligible
        assert rel(opt.state[p]["lstm_hidden"].numpy(),
                   np.asarray(state.inner.lstm_hidden[k])) < 1e-5, k


@pytest.mark.skipif(not has_jax, reason="needs jax")
def test_jax_steps_exactly_p_minus_step():
    import jax
    import jax.numpy as jnp
    import optax

    import xopt.jax

    hp = V.VeLO(num_training_steps=20, lstm_hidden_size=16, param_inits=8)
    theta = V.meta_init(hp, 1)
    params, grads, losses = _random_problem(1)
    jp = {k: jnp.asarray(v) for k, v in params.items()}
    tx = xopt.jax.velo(theta, spec=hp)
    state = tx.init(jp)
    g = {k: jnp.asarray(v) for k, v in grads[0].items()}
    u, new = jax.jit(lambda g, s, p, v: tx.update(g, s, p, value=v))(g, state, jp, losses[0])
    oracle, _ = V.step(hp, {k: v.astype(np.float64) for k, v in params.items()},
                       V.init_state(hp, params, meta=theta, dtype=np.float64),
                       {k: v.astype(np.float64) for k, v in grads[0].items()},
                       loss=losses[0], meta=theta)
    new_p = optax.apply_updates(jp, u)
    for k in params:  # updates = -(1·step): apply_updates gives p - step
        assert rel(np.asarray(u[k]), oracle[k] - params[k]) < 1e-5, k
        assert rel(np.asarray(new_p[k]), oracle[k]) < 1e-6, k
