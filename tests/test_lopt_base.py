"""The learned-optimizer base classes (xopt/torch/_lopt.py, xopt/jax/_lopt.py) on a toy method.

The toy learned optimizer has a per-tensor momentum ``m ← m/2 + g`` and a *global* term
(the sum over tensors of ``mean(g)``, computed in a pass over all tensors before any step,
as VeLO's per-tensor LSTM needs), ``step = w₀·m + w₁·c``, and records the loss it was
given. Its pure NumPy form runs under :func:`xopt.specs.lopt.outer_step`, the definition
of prefab's wrappers (weight decay, accumulation, lr) that both backends must follow.
"""

from __future__ import annotations

import copy
import dataclasses
import io

import numpy as np
import pytest
from helpers import needs_jax, needs_torch

from xopt.errors import HyperparameterError, MetaParamsError, StateError
from xopt.specs import MetaParams, lopt
from xopt.specs._hyperparams import hp


@dataclasses.dataclass(frozen=True)
class ToyHP(lopt.LOptOptions):
    METHOD = "toy"
    decay: float = hp(0.5, doc="momentum decay of the toy")


_SHAPES = {"w": (2,)}
_ORIG = {"w": "orig/w"}
TOY_META = MetaParams(
    shapes=lambda h: dict(_SHAPES),
    from_original=lambda th, h: lopt.rename_meta(th, {"orig/w": "w"}, {"orig/w": (2,)}, "toy"),
    to_original=lambda th, h: lopt.rename_meta(th, _ORIG, _SHAPES, "toy"),
    init=lambda h, seed=0: {"w": np.array([0.25, 2.0], np.float32)},
    coerce=lambda th, h: lopt.coerce_meta_namings(th, _SHAPES, _ORIG, "toy"),
)
THETA = {"w": np.array([0.75, -0.5], np.float32)}
SHAPES = [(), (5,), (3, 4), (2, 3, 2)]


def toy_inner(h: ToyHP, theta, xp):
    """The toy's inner update on canonical dicts (for ``lopt.outer_step``)."""

    def inner(grads, loss, st):
        c = 0
        for g in grads.values():
            c = c + (g.mean() if hasattr(g, "mean") else xp.mean(g))
        steps = {}
        for k, g in grads.items():
            m = st[f"m/{k}"] * h.decay + g
            st[f"m/{k}"] = m
            steps[k] = theta["w"][0] * m + theta["w"][1] * c
        st["seen_loss"] = loss
        st["calls"] = st["calls"] + 1
        return steps, st

    return inner


def oracle_run(h, params, grads_seq, losses, lrs=None):
    """NumPy float32 run of the toy under outer_step: params after every call, and state.
    ``lrs``: the lr of each call (default ``h.lr``)."""
    state = {"iteration": np.int32(0), "seen_loss": np.float32(0), "calls": np.int32(0)}
    for k, p in params.items():
        state[f"m/{k}"] = np.zeros_like(p)
        if h.accumulating:
            state[f"grad_accum/{k}"] = np.zeros_like(p)
    if h.accumulating:
        state.update(loss_accum=np.float32(0), accum_iteration=np.int64(0))
    out = []
    for t, (g, loss) in enumerate(zip(grads_seq, losses, strict=True)):
        ht = h if lrs is None else h.replace(lr=lrs[t])
        params, state = lopt.outer_step(ht, params, state, g, xp=np, loss=np.float32(loss),
                                         inner=toy_inner(h, THETA, np))
        out.append(dict(params))
    return out, state


def problem(seed=0, steps=7):
    rng = np.random.default_rng(seed)
    params = {f"p{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(SHAPES)}
    grads = [{k: rng.standard_normal(np.shape(v)).astype(np.float32) for k, v in params.items()}
             for _ in range(steps)]
    losses = [float(np.float32(rng.uniform(0.5, 2.0))) for _ in range(steps)]
    return params, grads, losses


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = np.max(np.abs(a - b)) if a.size else 0.0
    return 0.0 if d == 0 else d / max(np.max(np.abs(b)), 1e-30)


CONFIGS = [
    dict(num_training_steps=10),
    dict(num_training_steps=10, weight_decay=0.1),
    dict(num_training_steps=10, weight_decay=0.1, weight_decay_mode="decoupled", lr=0.5),
    dict(num_training_steps=10, max_training_steps=4),  # accumulate 3 calls
    dict(num_training_steps=10, max_training_steps=4, weight_decay=0.05),
    dict(num_training_steps=9, max_training_steps=4, weight_decay=0.05,
         weight_decay_mode="decoupled", lr=2.0),
]


def test_options_derived_quantities():
    h = ToyHP(num_training_steps=10, max_training_steps=4)
    assert h.accumulating and h.num_average == 3 and h.inner_num_steps == 3
    h = ToyHP(num_training_steps=150_000)
    assert not h.accumulating and h.num_average == 1 and h.inner_num_steps == 150_000
    h = ToyHP(num_training_steps=300_001)  # prefab: ceil(300001 / 150000) = 3
    assert h.num_average == 3 and h.inner_num_steps == 100_000
    with pytest.raises(HyperparameterError, match="num_training_steps is required"):
        _ = ToyHP().inner_num_steps
    with pytest.raises(HyperparameterError, match=r"ToyHP\.num_training_steps = 2\.5"):
        ToyHP(num_training_steps=2.5)
    with pytest.raises(HyperparameterError, match=r"ToyHP\.weight_decay_mode = 'l2'"):
        ToyHP(weight_decay_mode="l2")
    with pytest.raises(HyperparameterError, match=r"ToyHP\.max_training_steps = 0"):
        ToyHP(max_training_steps=0)


def test_outer_step_follows_prefab_by_hand():
    # accumulation of 3, coupled decay: check the pure definition against a hand computation
    h = ToyHP(num_training_steps=10, max_training_steps=4, weight_decay=0.1)
    p = {"a": np.array([1.0, -2.0], np.float32)}
    gs = [{"a": np.array([0.5, 0.25], np.float32)} for _ in range(3)]
    out, state = oracle_run(h, p, gs, [1.0, 2.0, 4.0])
    assert np.array_equal(out[0]["a"], p["a"]) and np.array_equal(out[1]["a"], p["a"])
    g = np.float32(0.5 + 0.1 * 1.0), np.float32(0.25 + 0.1 * -2.0)
    avg = np.array(g, np.float32) * 3 / 3
    c = avg.mean()
    step = THETA["w"][0] * avg + THETA["w"][1] * c
    np.testing.assert_allclose(out[2]["a"], p["a"] - step, rtol=1e-6)
    l2 = 0.1 * (1.0 + 4.0)
    np.testing.assert_allclose(state["seen_loss"], (1 + 2 + 4 + 3 * l2) / 3, rtol=1e-6)
    assert int(state["iteration"]) == 1 and int(state["accum_iteration"]) == 3
    assert not state["grad_accum/a"].any() and state["loss_accum"] == 0


# -- torch ------------------------------------------------------------------------------------


def _torch_toy():
    import torch

    from xopt.torch._lopt import LearnedOptimizer

    class Toy(LearnedOptimizer):
        hyperparams_cls = ToyHP
        meta_spec = TOY_META
        needs_loss = True

        def _init_param_state(self, p):
            return {"m": torch.zeros(p.shape, dtype=torch.float32, device=p.device)}

        def _init_global_state(self):
            return {"seen_loss": torch.zeros((), dtype=torch.float32),
                    "calls": torch.zeros((), dtype=torch.int32)}

        def _inner_update(self, entries, loss, gstate):
            w = self.meta_on(entries[0].param.device)["w"]
            c = 0
            for e in entries:  # the pass over all tensors before any parameter moves
                c = c + e.grad.mean()
            for e in entries:
                m = e.state["m"] * self.hp.decay + e.grad
                e.state["m"] = m
                self._apply_step(e, w[0] * m + w[1] * c)
            gstate["seen_loss"] = loss.detach().clone()
            gstate["calls"] += 1

    return Toy


def torch_run(h, params, grads_seq, losses, dtype=None, theta=THETA):
    import torch

    Toy = _torch_toy()
    ps = [torch.tensor(v, dtype=dtype or torch.float32) for v in params.values()]
    opt = Toy(ps, theta, spec=h)
    out = []
    for g, loss in zip(grads_seq, losses, strict=True):
        for p, gv in zip(ps, g.values(), strict=True):
            p.grad = torch.tensor(gv, dtype=p.dtype)
        opt.step(loss=loss)
        out.append({k: p.detach().double().numpy().copy() for k, p in zip(params, ps,
                                                                           strict=True)})
    return out, opt, ps


@needs_torch
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_torch_base_follows_outer_step(cfg):
    h = ToyHP(**cfg)
    params, grads, losses = problem()
    want, wstate = oracle_run(h, dict(params), grads, losses)
    got, opt, ps = torch_run(h, params, grads, losses)
    for t, (a, b) in enumerate(zip(got, want, strict=True)):
        for k in a:
            assert rel(a[k], b[k]) <= 1e-6, (t, k, rel(a[k], b[k]))
            if h.accumulating and (t + 1) % h.num_average:  # no inner update this call
                prev = params[k] if t == 0 else got[t - 1][k]
                if not h.decoupled_decay:
                    assert np.array_equal(a[k], prev), (t, k)
    g = opt.state["global"]
    assert int(g["iteration"]) == int(wstate["iteration"]) == int(g["calls"])
    assert int(g["num_steps"]) == h.inner_num_steps
    np.testing.assert_allclose(float(g["seen_loss"]), float(wstate["seen_loss"]), rtol=1e-6)
    if h.accumulating:
        assert int(g["accum_iteration"]) == len(grads) and g["accum_iteration"].dtype.is_signed
        for k, p in zip(params, ps, strict=True):
            np.testing.assert_allclose(opt.state[p]["grad_accum"].numpy(),
                                       wstate[f"grad_accum/{k}"], rtol=1e-6)


@needs_torch
def test_torch_lr_one_is_exactly_p_minus_step_and_groups_scale_it():
    import torch

    h = ToyHP(num_training_steps=10)
    params, grads, losses = problem(steps=1)
    Toy = _torch_toy()
    a = [torch.tensor(v) for v in params.values()]
    b = [torch.tensor(v) for v in params.values()]
    opt_a = Toy(a, THETA, spec=h)
    opt_b = Toy([{"params": b[:2], "lr": 0.25}, {"params": b[2:], "lr": 1.0}], THETA, spec=h)
    for opt, ps in ((opt_a, a), (opt_b, b)):
        for p, g in zip(ps, grads[0].values(), strict=True):
            p.grad = torch.tensor(g)
        opt.step(loss=losses[0])
    steps = {}
    for k, p0, pa in zip(params, params.values(), a, strict=True):
        steps[k] = torch.tensor(p0) - pa  # exact: pa = p0 - step rounds like the original
    # a group lr of 0.25 moves by 0.25·step computed from the same step
    for i, (p0, pb) in enumerate(zip(params.values(), b, strict=True)):
        m = opt_a.state[a[i]]["m"]
        w = opt_a.meta["w"]
        c = sum(torch.tensor(g).mean() for g in grads[0].values())
        step = w[0] * m + w[1] * c
        lr = 0.25 if i < 2 else 1.0
        assert torch.equal(pb, torch.tensor(p0) - lr * step), i
        assert torch.equal(a[i], torch.tensor(p0) - step), i


@needs_torch
def test_torch_closure_and_loss_rules():
    import torch

    Toy = _torch_toy()
    p = torch.nn.Parameter(torch.ones(3))
    opt = Toy([p], THETA, num_training_steps=5)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = (p ** 2).sum()
        loss.backward()
        return loss

    out = opt.step(closure)
    assert len(calls) == 1 and out.item() == 3.0
    assert float(opt.state["global"]["seen_loss"]) == 3.0
    with pytest.raises(ValueError, match="not both"):
        opt.step(closure, loss=1.0)
    with pytest.raises(ValueError, match="needs the loss"):
        opt.step()
    with pytest.raises(ValueError, match="real scalar"):
        opt.step(loss=torch.ones(2))
    assert int(opt.state["global"]["iteration"]) == 1


@needs_torch
def test_torch_step_without_a_loss_reuses_one_zero_scalar():
    """An optimizer that does not need the loss, stepped without one: its update sees a
    float32 zero scalar, the same tensor at every step (no allocation, and on a GPU no fill
    kernel, per step), and still 0 after the updates."""
    import torch

    seen = []

    class NoLoss(_torch_toy()):
        needs_loss = False

        def _inner_update(self, entries, loss, gstate):
            seen.append(loss)
            super()._inner_update(entries, loss, gstate)

    p = torch.nn.Parameter(torch.ones(3))
    opt = NoLoss([p], THETA, num_training_steps=5)
    for _ in range(3):
        p.grad = torch.ones(3)
        opt.step()
    assert len(seen) == 3 and all(s is seen[0] for s in seen)
    assert seen[0].dtype == torch.float32 and seen[0].shape == () and float(seen[0]) == 0.0


@needs_torch
def test_torch_float64_param_update_is_taken_in_float64():
    import torch

    h = ToyHP(num_training_steps=10)
    params, grads, losses = problem(steps=1)
    Toy = _torch_toy()
    p64 = [torch.tensor(v, dtype=torch.float64) + 1e-12 for v in params.values()]
    start = [p.clone() for p in p64]
    opt = Toy(p64, THETA, spec=h)
    for p, g in zip(p64, grads[0].values(), strict=True):
        p.grad = torch.tensor(g, dtype=torch.float64)
    opt.step(loss=1.0)
    for p, p0 in zip(p64, start, strict=True):
        assert opt.state[p]["m"].dtype == torch.float32
        step = (p0 - p)
        # the float32 step, subtracted in float64: the 1e-12 offset survives
        assert torch.equal(p, p0 - step.float().double())


@needs_torch
def test_torch_bad_input_is_named_and_changes_nothing():
    import torch

    Toy = _torch_toy()
    with pytest.raises(HyperparameterError, match="num_training_steps is required"):
        Toy([torch.zeros(2)], THETA)
    with pytest.raises(HyperparameterError, match=r"unknown hyperparameter 'decya'"):
        Toy([torch.zeros(2)], THETA, num_training_steps=3, decya=0.1)
    with pytest.raises(HyperparameterError, match=r"spec= or hyperparameters"):
        Toy([torch.zeros(2)], THETA, spec=ToyHP(num_training_steps=3), weight_decay=0.1)
    with pytest.raises(MetaParamsError, match="missing meta-parameter.*w"):
        Toy([torch.zeros(2)], {}, num_training_steps=3)
    with pytest.raises(MetaParamsError, match=r"'w' has shape \(3,\)"):
        Toy([torch.zeros(2)], {"w": np.zeros(3, np.float32)}, num_training_steps=3)
    with pytest.raises(MetaParamsError, match="NaN"):
        Toy([torch.zeros(2)], {"orig/w": np.array([np.nan, 1], np.float32)},
            num_training_steps=3)
    p = torch.nn.Parameter(torch.ones(2))
    opt = Toy([p], {"orig/w": np.ones(2, np.float32)}, num_training_steps=3)  # either naming
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match=r"the loss must be a real scalar, got str"):
        opt.step(loss="1.0")
    with pytest.raises(ValueError, match=r"the loss must be a real scalar.*shape \(2,\)"):
        opt.step(loss=torch.ones(2))
    assert len(opt.state[p]) == 0 and "global" not in opt.state  # created at the first step
    assert torch.equal(p, torch.ones(2))


@needs_torch
@pytest.mark.parametrize("accumulate", [False, True])
def test_torch_state_dict_resumes_bit_exactly_and_keeps_float32_state(accumulate):
    import torch

    h = ToyHP(num_training_steps=10, max_training_steps=4 if accumulate else 10,
              weight_decay=0.01)
    params, grads, losses = problem(steps=20)
    Toy = _torch_toy()

    def make():
        ps = [torch.tensor(v, dtype=torch.bfloat16 if i == 1 else torch.float32)
              for i, v in enumerate(params.values())]
        return ps, Toy(ps, THETA, spec=h)

    def run(ps, opt, ts):
        for t in ts:
            for p, g in zip(ps, grads[t].values(), strict=True):
                p.grad = torch.tensor(g, dtype=p.dtype)
            opt.step(loss=losses[t])

    ps, opt = make()
    run(ps, opt, range(20))
    qs, opt2 = make()
    run(qs, opt2, range(10))
    buf = io.BytesIO()
    torch.save({"opt": opt2.state_dict(), "params": [q.detach() for q in qs]}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    rs, opt3 = make()
    with torch.no_grad():
        for r, v in zip(rs, saved["params"], strict=True):
            r.copy_(v)
    opt3.load_state_dict(saved["opt"])
    assert opt3.state[rs[1]]["m"].dtype == torch.float32  # not cast to the bf16 param's dtype
    run(rs, opt3, range(10, 20))
    for a, b in zip(ps, rs, strict=True):
        assert torch.equal(a, b)
        for k in opt.state[a]:
            assert torch.equal(opt.state[a][k], opt3.state[b][k]), k
    for k, v in opt.state["global"].items():
        assert torch.equal(v, opt3.state["global"][k]), k
    # a damaged state dict is rejected, naming the entry, and changes nothing
    bad = copy.deepcopy(saved["opt"])
    bad["state"][0]["m"] = torch.zeros(7)
    with pytest.raises(StateError, match=r"state of parameter 0 \(.*\): 'm' has shape \(7,\)"):
        opt3.load_state_dict(bad)
    assert all(isinstance(k, int) for k in bad["state"])  # parameters' keys only (DCP)
    for k in [k for k in bad["state"][0] if k.startswith("global/")]:
        del bad["state"][0][k]  # the global state rides with the first parameter's
    with pytest.raises(StateError, match="missing state\\['global'\\]"):
        opt3.load_state_dict(bad)
    assert torch.equal(opt3.state[rs[0]]["m"], opt.state[ps[0]]["m"])


@needs_torch
@pytest.mark.parametrize("name", ["SmallFCLOpt", "VeLO", "MuLO"])
def test_torch_full_state_dict_loads_through_dcp_on_the_gpu(name):
    """DCP's ``set_optimizer_state_dict(full_state_dict=True)`` refuses a state dict whose
    tensors sit on two devices; the global counters (one per decay) are kept on the host
    between steps but ride in the state dict on the parameters' device, and load back bit
    for bit."""
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    import xopt.torch as xt

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: on the CPU every tensor is on one device")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).cuda()
    opt = getattr(xt, name)(model.parameters(), num_training_steps=10)
    loss = model(torch.randn(5, 4, device="cuda")).square().sum()
    loss.backward()
    opt.step(loss=loss)
    options = StateDictOptions(full_state_dict=True)
    sd = get_optimizer_state_dict(model, opt, options=options)
    devices = {v.device for st in sd["state"].values() for v in st.values() if v.dim() > 0}
    assert devices == {torch.device("cuda", 0)}
    before = copy.deepcopy(opt.state_dict())
    set_optimizer_state_dict(model, opt, sd, options=options)
    after = opt.state_dict()
    for k, st in before["state"].items():
        for kk, v in st.items():
            assert torch.equal(v, after["state"][k][kk]), (k, kk)


@needs_torch
def test_torch_deepcopy_keeps_the_optimizer_whole():
    import torch

    h = ToyHP(num_training_steps=10, max_training_steps=4, weight_decay=0.1)
    params, grads, losses = problem(steps=4)
    out, opt, ps = torch_run(h, params, grads[:2], losses[:2])
    twin = copy.deepcopy((ps, opt))
    for xs, o in ((ps, opt), twin):
        for t in (2, 3):
            for p, g in zip(xs, grads[t].values(), strict=True):
                p.grad = torch.tensor(g)
            o.step(loss=losses[t])
    assert twin[1].hp == h and twin[1].meta["w"].tolist() == THETA["w"].tolist()
    assert all(torch.equal(a, b) for a, b in zip(ps, twin[0], strict=True))


# -- jax ----------------------------------------------------------------------------------------


class _JaxToy:
    def __init__(self, h, theta):
        self.h, self.theta = h, {k: np.asarray(v, np.float32) for k, v in theta.items()}

    def init(self, params):
        import jax
        import jax.numpy as jnp

        return {"m": jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
                "seen_loss": jnp.zeros((), jnp.float32), "calls": jnp.zeros((), jnp.int32)}

    def update(self, params, grads, loss, iteration, inner):
        import jax

        leaves, treedef = jax.tree.flatten(grads)
        ms = treedef.flatten_up_to(inner["m"])
        c = 0
        for g in leaves:
            c = c + g.mean()
        new_m = [m * self.h.decay + g for m, g in zip(ms, leaves, strict=True)]
        steps = [self.theta["w"][0] * m + self.theta["w"][1] * c for m in new_m]
        return treedef.unflatten(steps), {"m": treedef.unflatten(new_m), "seen_loss": loss,
                                          "calls": inner["calls"] + 1}


def jax_run(h, params, grads_seq, losses, jit=True, schedule=None):
    import jax
    import jax.numpy as jnp
    import optax

    from xopt.jax._lopt import learned_optimizer

    tx = learned_optimizer(_JaxToy(h, THETA), h, learning_rate=schedule, needs_loss=True)

    def step(p, s, g, loss):
        u, s = tx.update(g, s, p, value=loss)
        return optax.apply_updates(p, u), s

    step = jax.jit(step) if jit else step
    p = {k: jnp.asarray(v) for k, v in params.items()}
    s = tx.init(p)
    out = []
    for g, loss in zip(grads_seq, losses, strict=True):
        p, s = step(p, s, {k: jnp.asarray(v) for k, v in g.items()}, jnp.float32(loss))
        out.append({k: np.asarray(v, np.float64) for k, v in p.items()})
    return out, s


@needs_jax
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_jax_base_follows_outer_step(cfg):
    from xopt.parity.runners import flatten_with_paths

    h = ToyHP(**cfg)
    params, grads, losses = problem()
    want, wstate = oracle_run(h, dict(params), grads, losses)
    got, state = jax_run(h, params, grads, losses)
    for t, (a, b) in enumerate(zip(got, want, strict=True)):
        for k in a:
            assert rel(a[k], b[k]) <= 1e-6, (t, k, rel(a[k], b[k]))
    flat = {k: np.asarray(v) for k, v in flatten_with_paths(state).items()}
    assert int(flat["iteration"]) == int(wstate["iteration"]) == int(flat["inner/calls"])
    assert int(flat["num_steps"]) == h.inner_num_steps
    np.testing.assert_allclose(flat["inner/seen_loss"], wstate["seen_loss"], rtol=1e-6)
    if h.accumulating:
        assert int(flat["accum/iteration"]) == len(grads)
        for k in params:
            np.testing.assert_allclose(flat[f"accum/grad_accum/{k}"], wstate[f"grad_accum/{k}"],
                                       rtol=1e-6)
    else:
        assert not any(k.startswith("accum/") for k in flat)


@needs_jax
@pytest.mark.parametrize("accumulate", [False, True])
def test_jax_schedule_is_read_at_the_call_count(accumulate):
    # the schedule's value at the call count before this call multiplies the step (optax's
    # convention); with accumulation the count is the outer call count
    h = ToyHP(num_training_steps=10, max_training_steps=4 if accumulate else 10,
              weight_decay=0.1, weight_decay_mode="decoupled")
    params, grads, losses = problem(steps=6)
    got, _ = jax_run(h, params, grads, losses, schedule=lambda count: 0.5 ** count)
    want, _ = oracle_run(h, dict(params), grads, losses, lrs=[0.5 ** t for t in range(6)])
    unscheduled, _ = oracle_run(h, dict(params), grads, losses)
    for t in range(6):
        for k in params:
            assert rel(got[t][k], want[t][k]) <= 1e-6, (t, k)
    assert rel(got[5]["p2"], unscheduled[5]["p2"]) > 1e-3


@needs_jax
def test_jax_needs_params_and_a_horizon():
    import jax.numpy as jnp

    from xopt.jax._lopt import learned_optimizer

    h = ToyHP(num_training_steps=10)
    tx = learned_optimizer(_JaxToy(h, THETA), h, needs_loss=True)
    s = tx.init({"a": jnp.ones(2)})
    with pytest.raises(ValueError, match="needs `params`"):
        tx.update({"a": jnp.ones(2)}, s, None, value=1.0)
    with pytest.raises(HyperparameterError, match="num_training_steps is required"):
        learned_optimizer(_JaxToy(h, THETA), ToyHP())
