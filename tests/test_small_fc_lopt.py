"""small_fc_lopt (learned_optimization's AdafacMLPLOpt): spec, xopt.torch.SmallFCLOpt and
xopt.jax.small_fc_lopt against the golden traces and each other, and the optimizer's
behaviour (lr, weight decay, accumulation, dtypes, state dicts, checks).

The golden tests read ``../shared/parity/small_fc_lopt`` when it is beside the checkout and
the bundled copy (``xopt/parity/data``) otherwise; the full 30-step comparisons are in
``parity_tests/``.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import SHARED, has_jax, has_torch, needs_jax, needs_torch

from xopt.errors import HyperparameterError, MetaParamsError
from xopt.parity import bundled_traces, load_trace
from xopt.parity.methods import small_fc_lopt as SP
from xopt.specs import lopt
from xopt.specs import small_fc_lopt as S

TOL = SP.TOLERANCES["teacher_forced"].rel
VARS = ("m", "rms", "v_row", "v_col", "v_diag")


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.size == 0:
        return 0.0
    d = np.max(np.abs(a - b))
    return 0.0 if d == 0 else d / max(np.max(np.abs(b)), 1e-300)


# -- golden traces ------------------------------------------------------------------------------


def _golden_paths():
    shared = sorted((SHARED / "parity" / "small_fc_lopt").glob("*.json"))
    return [str(p) for p in (shared or bundled_traces("small_fc_lopt"))]


GOLDEN = _golden_paths()
needs_golden = pytest.mark.skipif(not GOLDEN, reason="no small_fc_lopt golden traces "
                                  "(../shared/parity or xopt/parity/data)")


class Golden:
    def __init__(self, path: str) -> None:
        self.trace = t = load_trace(path, validate=False)
        kw = dict(t.hyperparameters, num_training_steps=t.num_training_steps)
        self.hp = SP.from_original_kwargs(kw)
        self.theta_original = t.meta_params()
        self.theta = S.meta_from_original(self.theta_original, self.hp)
        self.names = list(t.params)

    def params(self, step: int) -> dict[str, np.ndarray]:
        return self.trace.init_params() if step < 0 else self.trace.params_after(step)

    def state(self, step: int) -> dict[str, np.ndarray]:
        flat = self.trace.init_state() if step < 0 else self.trace.state_after(step)
        return S.STATE.to_canonical(SP.NAMING, flat, self.names, self.hp)


_CACHE: dict[str, Golden] = {}


def golden(path: str) -> Golden:
    if path not in _CACHE:
        _CACHE[path] = Golden(path)
    return _CACHE[path]


def _short(path: str) -> str:
    return path.rsplit("/", 1)[-1].removesuffix(".json")


def torch_teacher_forced(gd: Golden, t: int):
    import torch

    from xopt.torch import SmallFCLOpt

    p0 = gd.params(t - 1)
    ps = [torch.tensor(p0[k]) for k in gd.names]
    opt = SmallFCLOpt(ps, gd.theta_original, spec=gd.hp)
    flat = S.STATE.from_canonical("xopt.torch", gd.state(t - 1), gd.names, gd.hp)
    for k, p in zip(gd.names, ps, strict=True):
        opt.state[p] = {v: torch.tensor(flat[f"{k}/{v}"]) for v in VARS}
    opt.state["global"] = {k[len("global/"):]: torch.tensor(v) for k, v in flat.items()
                           if k.startswith("global/")}
    grads = gd.trace.grads(t)
    for k, p in zip(gd.names, ps, strict=True):
        p.grad = torch.tensor(grads[k])
    opt.step(loss=float(gd.trace.loss(t)))
    params = {k: p.numpy() for k, p in zip(gd.names, ps, strict=True)}
    out = {f"{k}/{v}": opt.state[p][v].numpy() for k, p in zip(gd.names, ps, strict=True)
           for v in VARS}
    out.update({f"global/{k}": v.numpy() for k, v in opt.state["global"].items()})
    return params, S.STATE.to_canonical("xopt.torch", out, gd.names, gd.hp)


# the torch backend on every case; xopt.jax's golden teacher-forced check is in
# parity_tests/test_learned_optimizers.py only (the same traces, every step, the same 1e-6,
# through the harness's jitted optax runner), its compilation being this file's costliest part
CASES = [pytest.param(p, id=_short(p), marks=needs_torch) for p in GOLDEN]
# the richest case (learned decay offsets, biases, a live magnitude head)
PERTURBED = next((p for p in GOLDEN if "perturbed" in p), GOLDEN[0] if GOLDEN else None)


@needs_golden
@pytest.mark.parametrize("path", CASES)
def test_golden_teacher_forced(path):
    gd = golden(path)
    for t in (0, 17):
        params, state = torch_teacher_forced(gd, t)
        want_p, want_s = gd.params(t), gd.state(t)
        for k in gd.names:
            assert rel(params[k], want_p[k]) <= TOL, (t, k, rel(params[k], want_p[k]))
        assert state.keys() == want_s.keys()
        for k in want_s:
            assert rel(state[k], want_s[k]) <= TOL, (t, k, rel(state[k], want_s[k]))


def _aux_inputs(gd: Golden, t: int, name: str):
    st, p0, g = gd.state(t - 1), gd.params(t - 1), gd.trace.grads(t)
    return [p0[name], g[name]] + [st[f"{v}/{name}"] for v in VARS], int(st["iteration"])


def _spec_aux(gd: Golden, t: int, name: str):
    args, it = _aux_inputs(gd, t, name)
    theta = {k: np.asarray(v, np.float32) for k, v in gd.theta.items()}
    tf = S.time_features(np, it, theta["mlp/b0"])
    return S.compute_step(gd.hp, *args, tf, theta, S.decays(gd.hp, theta, xp=np), xp=np,
                          return_aux=True)


@needs_golden
@pytest.mark.parametrize("path", GOLDEN, ids=_short)
def test_scalar_parameter_is_normalized_per_feature_like_the_original(path):
    # The 0-d parameter "scale": each of its 28 features is divided by its own magnitude
    # (the original reshapes it to (1,) and normalizes over that one element). PyLO's port
    # normalizes the 28 features jointly; that would not match the recording.
    gd = golden(path)
    for t in (0, 5, 29):
        step, accs, aux = _spec_aux(gd, t, "scale")
        recorded = gd.trace.aux(t)
        assert rel(aux["direction"], recorded["direction/scale"]) < 2e-5
        assert rel(aux["magnitude"], recorded["magnitude/scale"]) < 2e-5
        # the joint normalization (PyLO's departure)
        args, it = _aux_inputs(gd, t, "scale")
        m, rms, vr, vc, vd, fac_g = S.accumulate(np, args[1], *args[2:],
                                                 S.decays(gd.hp, gd.theta, xp=np))
        x = S.param_features(np, args[0], args[1], m, rms, fac_g, vr, vc, vd)
        joint = x / np.sqrt(1e-5 + np.mean(x * x))
        theta = {k: np.asarray(v, np.float32) for k, v in gd.theta.items()}
        tf = S.time_features(np, it, theta["mlp/b0"])
        inp = np.concatenate([joint, np.broadcast_to(tf, (1, tf.shape[0]))], axis=-1)
        direction, _ = S.mlp(np, inp, theta, gd.hp)
        assert rel(direction.reshape(()), recorded["direction/scale"]) > 1e-3


@needs_golden
@pytest.mark.parametrize("name", ["sq/w", "t3/w", "conv/w", "tall/w", "vec/b"])
def test_square_and_high_rank_tensors_match_the_recording(name):
    gd = golden(PERTURBED)
    if name not in gd.names:
        pytest.skip(f"{name} not in this trace")
    for t in (0, 3):
        step, accs, aux = _spec_aux(gd, t, name)
        want = gd.state(t)
        for v, a in zip(VARS, accs, strict=True):
            assert rel(a, want[f"{v}/{name}"]) <= TOL, (t, v)
        recorded = gd.trace.aux(t)
        assert rel(aux["direction"], recorded[f"direction/{name}"]) < 1e-5
        assert rel(aux["magnitude"], recorded[f"magnitude/{name}"]) < 1e-5
        i = gd.names.index(name)
        assert rel(aux["feature_sq_mean"], recorded["feature_sq_mean"][i]) < 1e-5
    if name == "sq/w":
        # a square matrix factors rows over axis 1 (numpy's argsort keeps ties in order);
        # swapping the two axes (PyLO VeLO's departure) would not match the recording
        assert lopt.factored_dims((16, 16)) == (0, 1)
        g = gd.trace.grads(0)[name]
        c = np.float32(1) - S.decays(gd.hp, gd.theta, xp=np)[2]
        swapped = c * np.mean(g * g + 1e-30, axis=0)[:, None]
        assert rel(swapped, gd.state(0)[f"v_row/{name}"]) > 1e-2


# -- torch and jax against each other -------------------------------------------------------------

SHAPES = [(), (1,), (7,), (5, 3), (4, 4), (2, 3, 4), (3, 2, 2, 5)]


SMALL = [(), (7,), (3, 4), (2, 3, 2)]  # for jax tests, whose compile time grows per tensor


def random_problem(seed=0, steps=6, hidden=8, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    hp = S.SmallFCLOpt(num_training_steps=50, hidden_size=hidden, step_mult=0.01)
    theta = S.meta_init(hp, seed)
    theta["decays/momentum"] = np.float32([-0.3, 0.1, 0.05])
    theta["decays/adafactor"] = np.float32([0.2, -0.1, 0.0])
    theta["mlp/b0"] = (0.1 * rng.standard_normal(hidden)).astype(np.float32)
    theta["mlp/w2"] = theta["mlp/w2"] * np.float32([1, 200])
    params = {f"p{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    grads = [{k: (rng.standard_normal(np.shape(v)) * 10.0 ** rng.integers(-4, 1, np.shape(v)))
              .astype(np.float32) for k, v in params.items()} for _ in range(steps)]
    return hp, theta, params, grads


def run_torch(hp, theta, params, grads, losses=None, dtype=None, **kw):
    import torch

    from xopt.torch import SmallFCLOpt

    ps = [torch.tensor(v, dtype=dtype or torch.float32) for v in params.values()]
    opt = SmallFCLOpt(ps, theta, spec=hp, **kw)
    history = []
    for t, g in enumerate(grads):
        for p, gv in zip(ps, g.values(), strict=True):
            p.grad = torch.tensor(gv, dtype=p.dtype)
        opt.step(loss=None if losses is None else losses[t])
        history.append({k: p.detach().clone() for k, p in zip(params, ps, strict=True)})
    return history, opt, ps


def run_jax(hp, theta, params, grads, losses=None, jit=True, **kw):
    import jax
    import jax.numpy as jnp
    import optax

    import xopt.jax

    tx = xopt.jax.small_fc_lopt(theta, spec=hp, **kw)

    def step(p, s, g, loss):
        u, s = tx.update(g, s, p, value=loss)
        return optax.apply_updates(p, u), s, u

    step = jax.jit(step) if jit else step
    p = {k: jnp.asarray(v) for k, v in params.items()}
    s = tx.init(p)
    history = []
    for t, g in enumerate(grads):
        loss = jnp.float32(0.0 if losses is None else losses[t])
        p, s, u = step(p, s, {k: jnp.asarray(v) for k, v in g.items()}, loss)
        history.append(({k: np.asarray(v) for k, v in p.items()}, u))
    return history, s


@pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")
def test_torch_and_jax_agree_on_random_problems():
    from xopt.parity.runners import flatten_with_paths

    hp, theta, params, grads = random_problem(shapes=[(), (1,), (4, 4), (2, 3, 4), (3, 2, 2, 5)])
    th, opt, ps = run_torch(hp, theta, params, grads)
    jh, js = run_jax(hp, theta, params, grads)
    for t in range(len(grads)):
        for k in params:
            a, b = th[t][k].numpy(), jh[t][0][k]
            assert rel(a - params[k], b - params[k]) < 1e-4, (t, k)  # the moves themselves
            assert rel(a, b) < 1e-6, (t, k)
    flat = {k: np.asarray(v) for k, v in flatten_with_paths(js).items()}
    jstate = S.STATE.to_canonical("xopt.jax", flat, list(params), hp)
    for k, p in zip(params, ps, strict=True):
        for v in VARS:
            assert rel(opt.state[p][v].numpy(), jstate[f"{v}/{k}"]) < 1e-5, (k, v)
    assert int(jstate["iteration"]) == int(opt.state["global"]["iteration"]) == len(grads)


def test_spec_step_follows_update_tensor():
    # the dict-level step is the per-tensor update applied to every parameter
    hp, theta, params, grads = random_problem(steps=2)
    state = S.init_state(hp, params, dtype=np.float32)
    p1, s1 = S.step(hp, params, state, grads[0], meta=theta)
    th = {k: np.asarray(v) for k, v in theta.items()}
    for k, p in params.items():
        out = S.update_tensor(hp, p, grads[0][k], *(state[f"{v}/{k}"] for v in VARS), 0, th,
                              xp=np)
        assert np.array_equal(out[0], p1[k])
        for v, a in zip(VARS, out[1:], strict=True):
            assert np.array_equal(a, s1[f"{v}/{k}"])
    assert int(s1["iteration"]) == 1 and list(s1["mom_t"]) == [1, 1, 1]


# -- lr, weight decay, accumulation --------------------------------------------------------------


def _torch_step_of(opt, p, g):
    """The learned step the optimizer computes for ``p`` from its current state."""
    import torch

    hp = opt.hp
    meta = opt.meta_on(p.device)
    tf = S.time_features(torch, opt.state["global"]["iteration"], meta["mlp/b0"])
    st = opt.state[p]
    step, _ = S.compute_step(hp, p.detach().float(), g, *(st[v] for v in VARS), tf, meta,
                             S.decays(hp, meta, xp=torch), xp=torch)
    return step


@needs_torch
def test_torch_lr_one_is_bitwise_p_minus_step_and_a_scheduler_scales_it():
    import torch

    from xopt.torch import SmallFCLOpt

    hp, theta, params, grads = random_problem(steps=3)
    ps = [torch.tensor(v) for v in params.values()]
    opt = SmallFCLOpt(ps, theta, spec=hp)
    factors = [1.0, 1.0, 0.5]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: factors[min(epoch, 2)])
    for t in range(3):
        lr = opt.param_groups[0]["lr"]
        assert lr == factors[t]
        expected = []
        for p, g in zip(ps, grads[t].values(), strict=True):
            p.grad = torch.tensor(g)
            if t:  # the state exists from the first step on
                step = _torch_step_of(opt, p, p.grad)
                expected.append(p.detach() - step if lr == 1.0 else p.detach() - lr * step)
        opt.step()
        sched.step()
        for p, e in zip(ps, expected if t else ps, strict=True):
            assert torch.equal(p, e), t


@needs_jax
def test_jax_updates_are_minus_step_and_a_schedule_scales_them():
    import jax
    import jax.numpy as jnp
    import optax

    import xopt.jax

    hp, theta, params, grads = random_problem(steps=2, shapes=SMALL)
    sched = optax.piecewise_constant_schedule(1.0, {1: 0.5})
    txs = {"1": xopt.jax.small_fc_lopt(theta, spec=hp),
           "0.5": xopt.jax.small_fc_lopt(theta, spec=hp.replace(lr=0.5)),
           "schedule": xopt.jax.small_fc_lopt(theta, num_training_steps=50, hidden_size=8,
                                              step_mult=0.01, learning_rate=sched)}
    th = {k: np.asarray(v, np.float32) for k, v in theta.items()}
    zeros = S.init_state(hp, params, dtype=np.float32)

    @jax.jit
    def run(p, gs):
        out = {}
        for name, tx in txs.items():
            s, us = tx.init(p), []
            for g in gs:
                u, s = tx.update(g, s, p)
                us.append(u)
            out[name] = us
        # the spec's step at the first update, and the parameter optax makes of it
        tf = S.time_features(jnp, jnp.int32(0), th["mlp/b0"])
        decays = S.decays(hp, th, xp=jnp)
        out["step"] = {k: S.compute_step(hp, p[k], gs[0][k], *(zeros[f"{v}/{k}"] for v in VARS),
                                         tf, th, decays, xp=jnp)[0] for k in p}
        return out

    p = {k: jnp.asarray(v) for k, v in params.items()}
    out = jax.tree.map(np.asarray, run(p, [{k: jnp.asarray(v) for k, v in g.items()}
                                           for g in grads]))
    # (applied in its own computation: inside one jit XLA may fuse the step's last product
    # into the subtraction, as it does in the original's jitted update)
    applied = optax.apply_updates(p, {k: jnp.asarray(v) for k, v in out["1"][0].items()})
    for k in p:
        assert np.array_equal(out["1"][0][k], -out["step"][k]), k  # updates = −step
        assert np.array_equal(np.asarray(applied[k]), params[k] - out["step"][k]), k
        for t in range(2):
            u = out["1"][t][k]
            assert np.array_equal(np.float32(0.5) * u, out["0.5"][t][k]), (t, k)
            assert np.array_equal(out["schedule"][t][k], u if t == 0 else np.float32(0.5) * u)


@needs_torch
def test_torch_weight_decay_coupled_and_decoupled():
    import torch

    hp, theta, params, grads = random_problem(steps=1)
    wd = 0.1
    g = grads[0]
    # coupled (prefab): the same as no decay on g + λp
    a, _, _ = run_torch(hp.replace(weight_decay=wd), theta, params, [g])
    gd = {k: (torch.tensor(g[k]) + wd * torch.tensor(params[k])).numpy() for k in g}
    b, _, _ = run_torch(hp, theta, params, [gd])
    for k in params:
        assert torch.equal(a[0][k], b[0][k]), k
    # decoupled: p - (step + λ·p) with the step of the undecayed parameter
    c, opt, ps = run_torch(hp.replace(weight_decay=wd, weight_decay_mode="decoupled"), theta,
                           params, [g])
    g2 = random_problem(seed=1, steps=1)[3][0]
    expected = []
    for p, gv in zip(ps, g2.values(), strict=True):
        p.grad = torch.tensor(gv)
        step = _torch_step_of(opt, p, p.grad)
        p0 = p.detach().clone()
        expected.append(p0 - (step + wd * p0))
    opt.step()
    for k, p, e in zip(params, ps, expected, strict=True):
        assert torch.equal(p, e), k
        assert not torch.equal(c[0][k], a[0][k]), k


@pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")
def test_coupled_decay_adds_to_the_loss_in_the_accumulator():
    import torch

    hp0, theta, params, grads = random_problem(steps=1, shapes=SMALL)
    hp = hp0.replace(num_training_steps=10, max_training_steps=4, weight_decay=0.1)
    _, opt, _ = run_torch(hp, theta, params, grads[:1], losses=[2.5])
    total = 0
    for p in params.values():
        total = total + (torch.tensor(p) ** 2).sum() * 0.1
    assert torch.equal(opt.state["global"]["loss_accum"], torch.tensor(2.5) + total)
    _, js = run_jax(hp, theta, params, grads[:1], losses=[2.5])
    assert rel(np.asarray(js.accum.loss_accum), (torch.tensor(2.5) + total).numpy()) < 1e-6


def _hand_unrolled_accumulation(hp, theta, params, grads, losses):
    """prefab's accumulation written out with the spec's per-tensor functions (NumPy f32)."""
    n = hp.num_average
    th = {k: np.asarray(v, np.float32) for k, v in theta.items()}
    decays = S.decays(hp, th, xp=np)
    state = {k: {v: np.zeros(s, np.float32) for v, s in
                 S.param_state_shapes(hp, np.shape(p)).items()} for k, p in params.items()}
    acc = {k: np.zeros(np.shape(p), np.float32) for k, p in params.items()}
    params = dict(params)
    history, it = [], 0
    for call, g in enumerate(grads, start=1):
        acc = {k: acc[k] + g[k] for k in params}
        if call % n == 0:
            tf = S.time_features(np, it, th["mlp/b0"])
            for k in params:  # the average as XLA compiles the original's acc / n
                step, accs = S.compute_step(hp, params[k], acc[k] * np.float32(1 / n),
                                            *(state[k][v] for v in VARS), tf, th, decays, xp=np)
                state[k] = dict(zip(VARS, accs, strict=True))
                params[k] = params[k] - step
            acc = {k: np.zeros_like(a) for k, a in acc.items()}
            it += 1
        history.append(dict(params))
    return history, state, acc, it


@pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")
def test_accumulation_follows_prefab_by_hand():
    # 10 steps with max 4: num_average = ceil(10/4) = 3 calls per inner update, horizon 3
    _, theta, params, grads = random_problem(steps=7, shapes=SMALL)
    hp = S.SmallFCLOpt(num_training_steps=10, max_training_steps=4, hidden_size=8,
                       step_mult=0.01)
    assert hp.num_average == 3 and hp.inner_num_steps == 3
    losses = [1.0 + t for t in range(7)]
    want, wstate, wacc, wit = _hand_unrolled_accumulation(hp, theta, params, grads, losses)
    # the spec's dict-level step: bit for bit the hand-unrolled sequence (same functions)
    p, s = dict(params), S.init_state(hp, params, dtype=np.float32)
    for t, g in enumerate(grads):
        p, s = S.step(hp, p, s, g, loss=np.float32(losses[t]), meta=theta)
        for k in params:
            assert np.array_equal(p[k], want[t][k]), (t, k)
    assert int(s["accum_iteration"]) == 7 and int(s["iteration"]) == wit == 2
    assert int(s["num_steps"]) == 3 and s["loss_accum"] == np.float32(7.0)
    for k in params:
        assert np.array_equal(s[f"grad_accum/{k}"], wacc[k])
    # both backends: within float rounding of it, and unchanged params between updates
    th, opt, ps = run_torch(hp, theta, params, grads, losses)
    jh, js = run_jax(hp, theta, params, grads, losses)
    for t in range(7):
        for k in params:
            assert rel(th[t][k].numpy(), want[t][k]) < 1e-6, (t, k)
            assert rel(jh[t][0][k], want[t][k]) < 1e-6, (t, k)
            if (t + 1) % 3:  # no update: the parameters stay as they were, bit for bit
                assert np.array_equal(th[t][k].numpy(),
                                      params[k] if t == 0 else th[t - 1][k].numpy()), (t, k)
                assert np.array_equal(jh[t][0][k],
                                      params[k] if t == 0 else jh[t - 1][0][k]), (t, k)
    g = opt.state["global"]
    assert int(g["iteration"]) == 2 and int(g["accum_iteration"]) == 7
    assert g["accum_iteration"].dtype.itemsize == 8 and float(g["loss_accum"]) == 7.0
    assert int(js.iteration) == 2 and int(js.accum.iteration) == 7 and int(js.num_steps) == 3


@needs_torch
def test_decoupled_decay_also_applies_on_accumulation_calls():
    import torch

    _, theta, params, grads = random_problem(steps=2)
    hp = S.SmallFCLOpt(num_training_steps=10, max_training_steps=4, hidden_size=8,
                       weight_decay=0.1, weight_decay_mode="decoupled", lr=0.5)
    hist, _, _ = run_torch(hp, theta, params, grads)
    for k, p0 in params.items():
        p0 = torch.tensor(p0)
        assert torch.equal(hist[0][k], p0 - (0.5 * 0.1) * p0)


# -- dtypes, state dicts, checks, bad input -----------------------------------------------------


@needs_torch
def test_torch_bf16_params_keep_float32_state_and_round_once():
    import torch

    hp, theta, params, grads = random_problem(steps=2)
    ps = [torch.tensor(v, dtype=torch.bfloat16) for v in params.values()]
    from xopt.torch import SmallFCLOpt

    opt = SmallFCLOpt(ps, theta, spec=hp)
    for t in range(2):
        expected = []
        for p, g in zip(ps, grads[t].values(), strict=True):
            p.grad = torch.tensor(g, dtype=torch.bfloat16)
            step = _torch_step_of(opt, p, p.grad.float()) if len(opt.state[p]) else None
            expected.append(step)
        if t == 0:
            opt.step()
            continue
        before = [p.detach().clone() for p in ps]
        opt.step()
        for p, p0, step in zip(ps, before, expected, strict=True):
            assert p.dtype == torch.bfloat16
            assert all(v.dtype == torch.float32 for v in opt.state[p].values())
            assert torch.equal(p, (p0.float() - step).to(torch.bfloat16))


@needs_jax
def test_jax_bf16_params_keep_float32_state():
    import jax
    import jax.numpy as jnp

    import xopt.jax

    hp, theta, params, grads = random_problem(steps=1, shapes=SMALL)
    tx = xopt.jax.small_fc_lopt(theta, spec=hp)
    p16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in params.items()}
    g16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in grads[0].items()}
    s = tx.init(p16)
    assert all(x.dtype in (jnp.float32, jnp.int32) for x in jax.tree.leaves(s))
    u, s2 = jax.jit(tx.update)(g16, s, p16)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(u))
    assert jax.tree.structure(s2) == jax.tree.structure(s)
    # the float32 computation on the bf16 values (the NumPy spec)
    p32 = {k: np.asarray(v, np.float32) for k, v in p16.items()}
    new, _ = S.step(hp, p32, S.init_state(hp, p32, dtype=np.float32),
                    {k: np.asarray(v, np.float32) for k, v in g16.items()}, meta=theta)
    for k in params:
        assert rel(np.asarray(u[k]), new[k] - p32[k]) < 1e-5, k




@needs_torch
def test_torch_bundled_theta_without_its_hyperparameters_names_them():
    import torch

    from xopt.checkpoints.bundled import bundled_meta_params
    from xopt.torch import SmallFCLOpt

    theta, needs = bundled_meta_params("small_fc_lopt")
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(MetaParamsError, match=r"fit hidden_size=32 \(this optimizer has "
                                              r"hidden_size=4\): pass hidden_size=32; .*"
                                              r"bundled_meta_params"):
        SmallFCLOpt([p], theta, num_training_steps=10)
    assert needs["hidden_size"] == 32
    SmallFCLOpt([p], theta, num_training_steps=10, **needs)


@needs_torch
def test_torch_bad_input_is_named_and_changes_nothing():
    import torch

    from xopt.torch import SmallFCLOpt

    hp, theta, params, grads = random_problem(steps=1)
    ps = [torch.tensor(v) for v in params.values()]
    with pytest.raises(HyperparameterError, match="num_training_steps is required"):
        SmallFCLOpt(ps, theta, hidden_size=8)
    with pytest.raises(HyperparameterError, match=r"SmallFCLOpt\.hidden_size = 0"):
        SmallFCLOpt(ps, theta, num_training_steps=5, hidden_size=0)
    with pytest.raises(HyperparameterError, match="unknown hyperparameter 'hidden'"):
        SmallFCLOpt(ps, theta, num_training_steps=5, hidden=8)
    bad = dict(theta)
    del bad["mlp/b1"]
    with pytest.raises(MetaParamsError, match="missing meta-parameter.*mlp/b1"):
        SmallFCLOpt(ps, bad, spec=hp)
    with pytest.raises(MetaParamsError, match=r"'mlp/w0' has shape \(39, 4\), expected "
                                              r"\(39, 8\); these meta-parameters fit "
                                              r"hidden_size=4 .*: pass hidden_size=4"):
        SmallFCLOpt(ps, S.meta_init(S.SmallFCLOpt(num_training_steps=5)), spec=hp)
    with pytest.raises(MetaParamsError, match="unexpected meta-parameter.*mlp/w9"):
        SmallFCLOpt(ps, {**theta, "mlp/w9": np.zeros(2)}, spec=hp)
    with pytest.raises(MetaParamsError, match="mix xopt names"):
        SmallFCLOpt(ps, {**theta, "momentum_decays": np.zeros(3)}, spec=hp)
    with pytest.raises(MetaParamsError, match=r"'decays/rms' has dtype int64"):
        SmallFCLOpt(ps, {**theta, "decays/rms": np.zeros(1, np.int64)}, spec=hp)
    opt = SmallFCLOpt(ps, S.meta_to_original(theta, hp), spec=hp)  # the original's naming
    ps[0].grad = torch.ones(())
    with pytest.raises(ValueError, match="real scalar"):
        opt.step(loss=[1.0])
    assert len(opt.state[ps[0]]) == 0 and "global" not in opt.state  # made at the first step


@needs_jax
def test_jax_bad_input_is_named():
    import xopt.jax

    hp, theta, params, _ = random_problem(steps=1)
    with pytest.raises(HyperparameterError, match="num_training_steps is required"):
        xopt.jax.small_fc_lopt(theta, hidden_size=8)
    with pytest.raises(HyperparameterError, match="either spec= or hyperparameters"):
        xopt.jax.small_fc_lopt(theta, spec=hp, learning_rate=0.1)
    with pytest.raises(MetaParamsError, match="missing meta-parameter.*nn/~/b2"):
        xopt.jax.small_fc_lopt({k: v for k, v in S.meta_to_original(theta, hp).items()
                                if k != "nn/~/b2"}, spec=hp)


# -- meta-parameters, hyperparameters, the original's arguments ---------------------------------


def test_meta_params_naming_and_init():
    hp = S.SmallFCLOpt(hidden_size=32, num_training_steps=5)
    shapes = S.meta_shapes(hp)
    assert shapes["mlp/w0"] == (39, 32) and shapes["mlp/w2"] == (32, 2)
    assert shapes["decays/rms"] == (1,) and len(shapes) == 9
    theta = S.meta_init(hp, 3)
    assert all(v.dtype == np.float32 and v.shape == shapes[k] for k, v in theta.items())
    w0 = theta["mlp/w0"]
    assert np.abs(w0).max() <= 2 / np.sqrt(39) and 0.7 / np.sqrt(39) < w0.std() < 1 / np.sqrt(39)
    assert not theta["mlp/b0"].any() and not theta["decays/momentum"].any()
    assert not np.array_equal(S.meta_init(hp, 4)["mlp/w0"], w0)
    orig = S.meta_to_original(theta, hp)
    assert set(orig) == {"nn/~/w0", "nn/~/b0", "nn/~/w1", "nn/~/b1", "nn/~/w2", "nn/~/b2",
                         "momentum_decays", "rms_decays", "adafactor_decays"}
    back = S.meta_from_original(orig, hp)
    assert all(back[k] is theta[k] for k in theta)
    assert S.coerce_meta(orig, hp).keys() == S.coerce_meta(theta, hp).keys() == theta.keys()
    with pytest.raises(MetaParamsError, match="no known meta-parameter name"):
        S.coerce_meta({"foo": np.zeros(1)}, hp)
    with pytest.raises(MetaParamsError, match=r"'nn/~/b0' has shape \(4,\), expected \(32,\)"):
        S.meta_from_original({**orig, "nn/~/b0": np.zeros(4, np.float32)}, hp)
    assert S.SPEC.meta.coerce is S.coerce_meta and S.SPEC.meta.init is S.meta_init


@pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")
def test_meta_init_is_the_same_bits_in_every_backend():
    hp = S.SmallFCLOpt(num_training_steps=5)
    a = S.meta_init(hp, 11)
    b = S.meta_init(hp, 11, backend="torch")
    c = S.meta_init(hp, 11, backend="jax")
    for k in a:
        assert np.array_equal(a[k].view(np.uint32), b[k].numpy().view(np.uint32)), k
        assert np.array_equal(a[k].view(np.uint32), np.asarray(c[k]).view(np.uint32)), k


@needs_golden
def test_golden_meta_files_match_meta_shapes():
    for path in GOLDEN:
        gd = golden(path)
        assert set(gd.theta) == set(S.meta_shapes(gd.hp))
        assert all(np.shape(v) == S.meta_shapes(gd.hp)[k] for k, v in gd.theta.items())


def test_hyperparameters_validate_and_round_trip():
    h = S.SmallFCLOpt(num_training_steps=1000, initial_rms_decays=[0.99], weight_decay=1e-4)
    assert h.initial_rms_decays == (0.99,)
    assert S.SmallFCLOpt.from_json(h.to_json()) == h
    assert S.num_param_features(h) == 28 and S.num_inputs(h) == 39
    with pytest.raises(HyperparameterError, match=r"initial_momentum_decays.*\[0\.0, 1\.0\)"):
        S.SmallFCLOpt(initial_momentum_decays=(0.9, 1.0))
    with pytest.raises(HyperparameterError, match=r"initial_rms_decays.*needs 1 or 3"):
        S.SmallFCLOpt(initial_rms_decays=(0.9, 0.99))
    with pytest.raises(HyperparameterError, match=r"initial_adafactor_decays.*at least one"):
        S.SmallFCLOpt(initial_adafactor_decays=())
    with pytest.raises(HyperparameterError, match=r"SmallFCLOpt\.lr = -1"):
        S.SmallFCLOpt(lr=-1)
    # the state schema follows the options: accumulation adds its variables
    shapes = S.STATE.canonical_keys({"w": (3, 4), "s": ()}, h.replace(max_training_steps=10))
    assert shapes["v_row/w"] == (3, 3) and shapes["v_col/w"] == (4, 3)
    assert shapes["v_diag/s"] == (3,) and shapes["v_row/s"] == (0, 3)
    assert shapes["grad_accum/w"] == (3, 4) and "accum_iteration" in shapes
    assert "grad_accum/w" not in S.STATE.canonical_keys({"w": (3, 4)}, h)


def test_original_arguments():
    kw = {"exp_mult": 0.001, "step_mult": 0.01, "hidden_size": 32, "hidden_layers": 2,
          "initial_momentum_decays": [0.9, 0.99, 0.999], "initial_rms_decays": [0.999],
          "initial_adafactor_decays": [0.9, 0.99, 0.999], "concat_weights": True,
          "make_separate_weights": False, "split_weights": False, "num_training_steps": 1000}
    h = SP.from_original_kwargs(kw)
    assert h.hidden_size == 32 and h.num_training_steps == 1000
    back = SP.to_original_kwargs(h)
    assert back == {**kw, "initial_momentum_decays": (0.9, 0.99, 0.999),
                    "initial_rms_decays": (0.999,), "initial_adafactor_decays": (0.9, 0.99, 0.999)}
    with pytest.raises(HyperparameterError, match=r"AdafacMLPLOpt\.concat_weights = False"):
        SP.from_original_kwargs({**kw, "concat_weights": False})
    with pytest.raises(HyperparameterError, match=r"make_separate_weights = True"):
        SP.from_original_kwargs({**kw, "make_separate_weights": True})
    with pytest.raises(HyperparameterError, match="unknown AdafacMLPLOpt argument.*'hidden'"):
        SP.from_original_kwargs({**kw, "hidden": 3})
    with pytest.raises(HyperparameterError, match=r"lr = 0\.5"):
        SP.to_original_kwargs(h.replace(lr=0.5))
    with pytest.raises(HyperparameterError, match="weight_decay"):
        SP.to_original_kwargs(h.replace(weight_decay=0.1))
    with pytest.raises(HyperparameterError, match="accumulate"):
        SP.to_original_kwargs(h.replace(max_training_steps=10))
