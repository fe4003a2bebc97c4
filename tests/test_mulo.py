"""μLO (xopt.specs.mulo, xopt.torch.MuLO, xopt.jax.mulo): what it adds to small_fc_lopt.

The golden comparisons are in ``parity_tests/test_mulo.py``; the checkpoints in
``tests/test_checkpoints_mulo.py``. Here: the role rule and the helpers that read roles in
each framework's layout, that μLO with unit multipliers is small_fc_lopt bit for bit, that a
multiplier scales exactly the step, μLO's treatment of non-finite gradients and of
clipping (both backends against the float64 oracle), param groups and state dicts, and
errors that name what is wrong.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from helpers import needs_jax, needs_torch

from xopt.errors import HyperparameterError
from xopt.specs import ParamGroups
from xopt.specs import mulo as S
from xopt.specs import small_fc_lopt as SF

N_STEPS = 100
SHAPES = {"in/w": (6, 8), "in/b": (8,), "hid/w": (8, 8), "hid/b": (8,), "out/w": (8, 3),
          "scale": ()}
ROLES = {"in/w": "input", "in/b": "vector", "hid/w": "hidden", "hid/b": "vector",
         "out/w": "output", "scale": "vector"}


def _params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _grads(k: int, scale: float = 1e-2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + k)
    return {n: (scale * rng.standard_normal(s)).astype(np.float32) for n, s in SHAPES.items()}


def _mults(hidden_lr_mult: float = 2.0) -> dict[str, float]:
    # fan-in in the (in, out) layout of these arrays: rows
    return {n: S.mup_lr(r, SHAPES[n][0] if r == "hidden" else None, hidden_lr_mult)
            for n, r in ROLES.items()}


def _groups(hp: S.MuLO, mults: dict[str, float]) -> ParamGroups:
    by: dict[float, list[str]] = {}
    for n, m in mults.items():
        by.setdefault(m, []).append(n)
    return ParamGroups.of([(ns, hp.replace(mup_lr=m)) for m, ns in by.items()])


# -- the role rule ------------------------------------------------------------------------------


def test_role_rule_is_mulo_mumlp_table():
    # MuMLP: input and readout weights 1, hidden weights hidden_lr_mult / fan_in, biases 1
    assert S.mup_lr("input", 128) == 1.0 and S.mup_lr("output", 128) == 1.0
    assert S.mup_lr("vector") == 1.0
    assert S.mup_lr("hidden", 128) == 1 / 128
    assert S.mup_lr("hidden", 24, hidden_lr_mult=3.0) == 3.0 / 24
    with pytest.raises(HyperparameterError, match="'embedding'"):
        S.mup_lr("embedding", 4)
    with pytest.raises(HyperparameterError, match="fan_in"):
        S.mup_lr("hidden")
    with pytest.raises(HyperparameterError, match="hidden_lr_mult"):
        S.mup_lr("hidden", 4, hidden_lr_mult=0.0)


def test_param_groups_may_differ_in_mup_lr_only():
    hp = S.MuLO(num_training_steps=N_STEPS)
    S.settings(ParamGroups.of([(["a"], hp), (["b"], hp.replace(mup_lr=0.5))]))
    with pytest.raises(HyperparameterError, match="'step_mult'"):
        S.settings(ParamGroups.of([(["a"], hp), (["b"], hp.replace(step_mult=0.5))]))
    with pytest.raises(HyperparameterError, match="mup_lr"):
        S.MuLO(mup_lr=0.0)


@needs_torch
def test_torch_roles_read_from_a_model_with_torch_fan_in():
    from torch import nn

    from xopt.torch.mulo import mup_param_groups, mup_roles

    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Conv1d(8, 8, 3), nn.Linear(8, 3))
    roles = mup_roles(model)
    assert roles == {"0.weight": "input", "0.bias": "vector", "2.weight": "hidden",
                     "2.bias": "vector", "4.weight": "hidden", "4.bias": "vector",
                     "5.weight": "output", "5.bias": "vector"}
    groups = mup_param_groups(model, hidden_lr_mult=2.0, lr=0.5)
    by_name = {n: g["mup_lr"] for g in groups for n in g["param_names"]}
    # torch weights are (out, in, *window): fan-in in * window
    assert by_name["2.weight"] == 2.0 / 8 and by_name["4.weight"] == 2.0 / 24
    assert {by_name[n] for n in roles if roles[n] != "hidden"} == {1.0}
    assert all(g["lr"] == 0.5 for g in groups)
    with pytest.raises(HyperparameterError, match="'2.bias'.*rank >= 2"):
        mup_param_groups(model, roles={**roles, "2.bias": "hidden"})
    with pytest.raises(HyperparameterError, match="no entry for parameter '0.bias'"):
        mup_param_groups(model, roles={k: v for k, v in roles.items() if k != "0.bias"})
    with pytest.raises(HyperparameterError, match="Linear/Conv"):
        mup_roles(nn.Linear(3, 3))


@needs_jax
def test_jax_roles_from_a_pytree_or_a_label_function_with_flax_fan_in():
    import jax.numpy as jnp

    from xopt.jax.mulo import mup_lrs

    params = {"in": {"kernel": jnp.zeros((6, 8)), "bias": jnp.zeros(8)},
              "hid": {"kernel": jnp.zeros((3, 8, 8)), "bias": jnp.zeros(8)},  # a conv (k, in, out)
              "out": {"kernel": jnp.zeros((8, 3)), "bias": jnp.zeros(3)}}
    roles = {"in": {"kernel": "input", "bias": "vector"},
             "hid": {"kernel": "hidden", "bias": "vector"},
             "out": {"kernel": "output", "bias": "vector"}}
    got = mup_lrs(params, roles, hidden_lr_mult=2.0)
    assert got["hid"]["kernel"] == 2.0 / 24 and got["in"]["kernel"] == 1.0
    assert got["out"]["bias"] == 1.0

    def label(p):  # as optax.multi_transform's label functions
        return {k: {"kernel": {"in": "input", "out": "output"}.get(k, "hidden"),
                    "bias": "vector"} for k in p}

    assert mup_lrs(params, label, 2.0) == got
    with pytest.raises(HyperparameterError, match=r"\['hid'\]\['bias'\].*rank >= 2"):
        mup_lrs(params, {**roles, "hid": {"kernel": "hidden", "bias": "hidden"}})


@needs_torch
@needs_jax
def test_the_same_layer_gets_the_same_multiplier_in_both_layouts():
    import jax.numpy as jnp
    from torch import nn

    from xopt.jax.mulo import mup_lrs
    from xopt.torch.mulo import mup_param_groups

    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 9), nn.Linear(9, 2))
    torch_m = {n: g["mup_lr"] for g in mup_param_groups(model) for n in g["param_names"]}
    flax = {f"l{i}": jnp.zeros(tuple(m.weight.shape[::-1])) for i, m in enumerate(model)}
    jax_m = mup_lrs(flax, {"l0": "input", "l1": "hidden", "l2": "output"})
    assert [jax_m[f"l{i}"] for i in range(3)] == [torch_m[f"{i}.weight"] for i in range(3)]


# -- the update -------------------------------------------------------------------------------


def _run_torch(cls, hp, mults, params, grads_seq, **kw):
    import torch

    ts = {k: torch.tensor(v) for k, v in params.items()}
    if mults is None:
        opt = cls(list(ts.values()), spec=hp, **kw)
    else:
        groups: dict[float, list] = {}
        for n, t in ts.items():
            groups.setdefault(mults[n], []).append(t)
        opt = cls([{"params": ps, "mup_lr": m} for m, ps in groups.items()], spec=hp, **kw)
    for g in grads_seq:
        for n, t in ts.items():
            t.grad = torch.tensor(g[n])
        opt.step(loss=1.0)
    return {k: t.detach().numpy() for k, t in ts.items()}, opt


def _run_jax(factory, hp, mults, params, grads_seq, **kw):
    import jax
    import jax.numpy as jnp
    import optax

    tx = factory(spec=hp, **({} if mults is None else {"mup_lrs": mults}), **kw)
    p = {k: jnp.asarray(v) for k, v in params.items()}
    state = tx.init(p)
    upd = jax.jit(lambda g, s, p: tx.update(g, s, p, value=jnp.float32(1.0)))
    for g in grads_seq:
        u, state = upd({k: jnp.asarray(v) for k, v in g.items()}, state, p)
        p = optax.apply_updates(p, u)
    return {k: np.asarray(v) for k, v in p.items()}


def _run_oracle(hp, params, grads_seq):
    st = S.init_state(hp, params, dtype=np.float64)
    p = {k: v.astype(np.float64) for k, v in params.items()}
    for g in grads_seq:
        p, st = S.step(hp, p, st, {k: v.astype(np.float64) for k, v in g.items()}, loss=1.0)
    return p


@needs_torch
@needs_jax
def test_unit_multipliers_are_small_fc_lopt_bit_for_bit():
    from xopt.jax import mulo, small_fc_lopt
    from xopt.torch import MuLO, SmallFCLOpt

    params, seq = _params(), [_grads(k) for k in range(3)]
    hp = S.SPEC.make("mulo", num_training_steps=N_STEPS)
    sf = SF.SmallFCLOpt(**{f: getattr(hp, f) for f in SF.SmallFCLOpt.field_names()})
    a, _ = _run_torch(MuLO, hp, None, params, seq)
    b, _ = _run_torch(SmallFCLOpt, sf, None, params, seq, impl="plain")
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert all(np.array_equal(x, y) for x, y in zip(
        _run_jax(mulo, hp, None, params, seq).values(),
        _run_jax(small_fc_lopt, sf, None, params, seq, impl="plain").values(), strict=True))


@needs_torch
@needs_jax
def test_a_multiplier_scales_the_step_exactly_and_both_backends_follow_the_oracle():
    import torch

    from xopt.jax import mulo
    from xopt.torch import MuLO

    params, seq = _params(), [_grads(0)]
    hp = S.SPEC.make("mulo", num_training_steps=N_STEPS)
    mults = _mults()
    unit, _ = _run_torch(MuLO, hp, None, params, seq)
    scaled, _ = _run_torch(MuLO, hp, mults, params, seq)
    for n in params:  # p − step·s, the step's float32 bits times s, once rounded
        step = torch.tensor(params[n]) - torch.tensor(unit[n])
        want = torch.tensor(params[n]) - step * mults[n] if mults[n] != 1 else unit[n]
        if mults[n] == 1:
            assert np.array_equal(scaled[n], unit[n])
        else:
            assert np.allclose(scaled[n], want.numpy(), rtol=0, atol=2e-7), n
            assert not np.array_equal(scaled[n], unit[n])
    seq = [_grads(k) for k in range(4)]
    ref = _run_oracle(_groups(hp, mults), params, seq)
    t, _ = _run_torch(MuLO, hp, mults, params, seq)
    j = _run_jax(mulo, hp, {k: mults[k] for k in params}, params, seq)
    for n in params:  # the harness's measure, max|a − b| / max|b|, at its closed-loop bound
        for got in (t[n], j[n]):
            assert np.abs(got - ref[n]).max() / np.abs(ref[n]).max() < 1e-6, n


@needs_torch
@needs_jax
def test_nonfinite_gradients_are_mulo_s_nan_to_num():
    """NaN → 0 (the step equals the step of a zero entry); the oracle agrees with both."""
    from xopt.jax import mulo
    from xopt.torch import MuLO

    params = _params()
    hp = S.SPEC.make("mulo", num_training_steps=N_STEPS)
    g = _grads(0)
    nan = {k: v.copy() for k, v in g.items()}
    nan["hid/w"][2, 3] = np.nan
    zero = {k: v.copy() for k, v in g.items()}
    zero["hid/w"][2, 3] = 0.0
    a, _ = _run_torch(MuLO, hp, None, params, [nan])
    b, _ = _run_torch(MuLO, hp, None, params, [zero])
    assert all(np.array_equal(a[k], b[k]) for k in a) and np.isfinite(a["hid/w"]).all()
    c = _run_jax(mulo, hp, None, params, [nan])
    d = _run_jax(mulo, hp, None, params, [zero])
    assert all(np.array_equal(c[k], d[k]) for k in c)
    ref = _run_oracle(hp, params, [nan])
    assert all(np.isfinite(v).all() for v in ref.values())


@needs_torch
@needs_jax
@pytest.mark.parametrize("scale", [1e-2, 10.0])  # below and above global norm 1
def test_clipping_on_both_backends_against_the_oracle(scale):
    from xopt.jax import mulo
    from xopt.torch import MuLO

    params, seq = _params(), [_grads(k, scale) for k in range(3)]
    hp = S.SPEC.make("mulo", num_training_steps=N_STEPS, clip_grad=True)
    ref = _run_oracle(hp, params, seq)
    t, _ = _run_torch(MuLO, hp, None, params, seq)
    j = _run_jax(mulo, hp, None, params, seq)
    plain = _run_oracle(hp.replace(clip_grad=False), params, seq)
    moved = any(not np.allclose(ref[k], plain[k]) for k in params)
    assert moved == (scale > 1)  # clipping acts only above norm 1
    for n in params:
        for got in (t[n], j[n]):
            assert np.abs(got - ref[n]).max() / np.abs(ref[n]).max() < 1e-6, n


# -- torch: param groups, state dicts, errors --------------------------------------------------


@needs_torch
def test_torch_state_dict_round_trip_keeps_the_multipliers_and_resumes_bit_exactly():
    import torch

    from xopt.torch import MuLO

    params, seq = _params(), [_grads(k) for k in range(4)]
    hp = S.SPEC.make("mulo", num_training_steps=N_STEPS)
    full, _ = _run_torch(MuLO, hp, _mults(), params, seq)
    half, opt = _run_torch(MuLO, hp, _mults(), params, seq[:2])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert sorted(g["mup_lr"] for g in sd["param_groups"]) == sorted(set(_mults().values()))
    ts = {k: torch.tensor(v) for k, v in half.items()}
    groups: dict[float, list] = {}
    for n, t in ts.items():
        groups.setdefault(_mults()[n], []).append(t)
    fresh = MuLO([{"params": ps} for ps in groups.values()], spec=hp)  # mup_lr from the dict
    fresh.load_state_dict(sd)
    assert sorted(g["mup_lr"] for g in fresh.param_groups) == sorted(set(_mults().values()))
    for g in seq[2:]:
        for n, t in ts.items():
            t.grad = torch.tensor(g[n])
        fresh.step(loss=1.0)
    assert all(np.array_equal(ts[k].numpy(), full[k]) for k in full)


@needs_torch
def test_torch_bad_groups_are_named_and_change_nothing():
    import torch

    from xopt.torch import MuLO

    p = torch.zeros(3, requires_grad=True)
    hp = S.MuLO(num_training_steps=N_STEPS)
    with pytest.raises(HyperparameterError, match=r"param_groups\[0\].*mup_lr"):
        MuLO([{"params": [p], "mup_lr": -1.0}], spec=hp)
    with pytest.raises(HyperparameterError, match=r"param_groups\[1\].*'step_mult'"):
        MuLO([{"params": [p]}, {"params": [torch.zeros(2)],
                                "spec": hp.replace(step_mult=0.1)}], spec=hp)
    opt = MuLO([p], spec=hp)
    with pytest.raises(HyperparameterError):
        opt.add_param_group({"params": [torch.zeros(2)], "mup_lr": float("nan")})
    assert len(opt.param_groups) == 1
    ok = MuLO([{"params": [p], "spec": hp.replace(mup_lr=0.25)}], spec=hp)
    assert ok.param_groups[0]["mup_lr"] == 0.25


@needs_jax
def test_jax_bad_multipliers_are_named():
    import jax.numpy as jnp

    from xopt.jax import mulo

    p = {"a": jnp.zeros(3), "b": jnp.zeros((2, 2))}
    with pytest.raises(HyperparameterError, match="structure"):
        mulo(num_training_steps=N_STEPS, mup_lrs={"a": 1.0}).init(p)
    with pytest.raises(HyperparameterError, match=r"mup_lrs\[\['b'\]\]"):
        mulo(num_training_steps=N_STEPS, mup_lrs={"a": 1.0, "b": 0.0}).init(p)
    with pytest.raises(HyperparameterError, match="not both"):
        mulo(num_training_steps=N_STEPS, mup_lrs={"a": 1.0, "b": 1.0}, param_specs={})
