"""``proj_dtype="param"`` in xopt.jax's GaLore, COAP and PLUMAGE: the spec's step.

Under ``"param"`` a projected bfloat16 matrix's two products run in bfloat16 (the exact
products summed in float32, rounded once), its moments and projection stay float32, and
its update is float32 so that ``optax.apply_updates`` rounds the step into the parameter
as the spec's ``hf_apply_low`` does. Checked on bfloat16 parameters:

* the jitted transformation against the spec's pure ``step`` (NumPy, ml_dtypes' bfloat16)
  and against ``xopt.torch`` in the same mode, bit for bit (parameters, moments);
* float32 parameters: ``"param"`` and ``"state"`` are one computation;
* ``"state"`` (the default) on bfloat16 parameters: float32 state and float32 updates,
  the same bits as ``xopt.torch`` (each new value rounded once into the parameter);
* bad values are refused naming ``proj_dtype``.

Every refresh is injected (a Hadamard basis, entries ±1/4: exact in bfloat16) and every
parameter and gradient is an integer times 2⁻⁷, so every product is exact in float32
(asserted): the bfloat16 results then do not depend on the order of summation, and the
comparison is bit for bit on any CPU. ``lr`` = 2⁻⁷ and ``lr·λ`` = 2⁻¹⁰ are exact in
bfloat16, and ``correct_bias=False`` makes the step size ``lr`` itself, so that the checks
do not depend on how a backend rounds the step size (torch's CPU ``add`` rounds ``alpha``
to bfloat16; JAX's bias correction is evaluated in float32, the spec's in double).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import exact_in_float32, needs_torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import optax  # noqa: E402

import xopt.jax as xj  # noqa: E402
from xopt.errors import HyperparameterError  # noqa: E402
from xopt.specs import coap as coap_spec  # noqa: E402
from xopt.specs import galore as galore_spec  # noqa: E402
from xopt.specs import lowrank  # noqa: E402
from xopt.specs import plumage as plumage_spec  # noqa: E402

BF16 = ml_dtypes.bfloat16
SHAPES = {"b": (5,), "w1": (32, 16), "w2": (16, 32)}  # sorted: JAX's flattening order
MATRICES = ("w1", "w2")
STEPS = 5
LR, WD = 2.0**-7, 0.125
# β₁ = β₂ = 1/2 keep the float32 moments exact for these steps (so that a backend's fused
# multiply-add cannot change them)
ADAM = dict(b1=0.5, b2=0.5)

SPECS = {
    "galore": (galore_spec, dict(rank=4, update_proj_gap=2, scale=0.5, correct_bias=False)),
    "coap": (coap_spec, dict(rank=4, update_interval=2, reproject_factor=1, scale=0.5,
                             correct_bias=False)),
    # the moments' realignment at a new P is float32 state math (a sum whose order a
    # backend picks): off, so that the comparison stays bit for bit
    "plumage": (plumage_spec, dict(rank=4, update_proj_gap=2, resample_interval=2,
                                   correct_bias=False, realign_first_moment=False,
                                   realign_second_moment=False)),
}


def _hadamard16() -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    return h / 4.0  # orthonormal, entries ±1/4


def _params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {k: rng.integers(-127, 128, s) / 128.0 for k, s in SHAPES.items()}


def _grads(t: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + t)
    return {k: rng.integers(-15, 16, s) / 16.0 for k, s in SHAPES.items()}


def _inject(method: str, t: int) -> dict[str, dict[str, np.ndarray]]:
    """This update's projections: 4 Hadamard vectors on each matrix's 16-long side (a
    different choice at every update; used at the refreshes only)."""
    rng = np.random.default_rng(500 + t)
    h = _hadamard16()[:, rng.permutation(16)] * rng.choice([-1.0, 1.0], 16)
    cols = h[:, :4].astype(np.float32)
    out = {}
    for name in MATRICES:
        if method == "plumage":  # the SVD (U over the 16-long side, distinct σ) and the draw
            out[name] = {"svd_u": h.astype(np.float32),
                         "svd_s": np.arange(16, 0, -1).astype(np.float32),
                         "indices": np.sort(rng.permutation(16)[:4]).astype(np.int64)}
        else:  # GaLore and COAP both project w1 (32 × 16) on the right, w2 on the left
            out[name] = {"ortho_matrix": cols.T.copy() if name == "w1" else cols}
    return out


def _spec_hp(method: str, wd: float, proj_dtype: str = "param"):
    mod, kw = SPECS[method]
    return mod.SPEC.hyperparams(lr=LR, weight_decay=wd, proj_dtype=proj_dtype, **ADAM, **kw)


def _run_jax(method: str, wd: float, dtype=jnp.bfloat16, proj_dtype: str = "param",
             steps: int = STEPS):
    """Each update's ``(params, state)`` of the jitted transformation."""
    tx = getattr(xj, method)(spec=_spec_hp(method, wd, proj_dtype))
    params = {k: jnp.asarray(v, dtype) for k, v in _params().items()}
    state = tx.init(params)
    update = jax.jit(lambda g, s, p, inj: tx.update(g, s, p, inject=inj))
    out = []
    for t in range(steps):
        grads = {k: jnp.asarray(v, dtype) for k, v in _grads(t).items()}
        u, state = update(grads, state, params, _inject(method, t))
        params = optax.apply_updates(params, u)
        out.append((jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, state)))
    return out


_RUNS: dict = {}


def _jax_history(method: str, wd: float):
    if (method, wd) not in _RUNS:
        _RUNS[method, wd] = _run_jax(method, wd)
    return _RUNS[method, wd]


def _moments_of(state, name: str):
    return state.mu[name], state.nu[name]


def _projection_of(method: str, state, name: str):
    if method == "galore":
        return state.ortho[name]
    if method == "coap":
        return state.proj[name]
    return state.projector[name]




@pytest.mark.parametrize("wd", [0.0, WD], ids=["no-decay", "decay"])
@pytest.mark.parametrize("method", sorted(SPECS))
def test_param_is_the_specs_bf16_step(method: str, wd: float) -> None:
    """The jitted transformation's parameters and moments are the spec's ``step`` (NumPy,
    bfloat16 parameters) bit for bit at every update; the spec's products are exact."""
    mod, _ = SPECS[method]
    hp = _spec_hp(method, wd)
    params = {k: v.astype(BF16) for k, v in _params().items()}
    state = mod.init_state(hp, params)
    history = _jax_history(method, wd)
    for t in range(STEPS):
        grads = {k: v.astype(BF16) for k, v in _grads(t).items()}
        params, state = mod.step(hp, params, state, grads, inject=_inject(method, t))
        got_p, got_s = history[t]
        # the bias (not projected) takes the spec's float32 step: rounded to bf16 here
        params["b"] = params["b"].astype(BF16)
        for name in MATRICES:
            assert params[name].dtype == BF16
            np.testing.assert_array_equal(got_p[name].view(np.uint16),
                                          params[name].view(np.uint16), err_msg=f"{name} {t}")
            m, v = _moments_of(got_s, name)
            np.testing.assert_array_equal(m, state[f"m/{name}"], err_msg=f"m {name} {t}")
            np.testing.assert_array_equal(v, state[f"v/{name}"], err_msg=f"v {name} {t}")
            key = {"galore": "ortho", "coap": "P", "plumage": "projector"}[method]
            proj = state[f"{key}/{name}"]
            np.testing.assert_array_equal(_projection_of(method, got_s, name), proj)
            # the data keep both products exact in float32 (their bf16 results then do not
            # depend on the order of summation): R = G Pᵀ / Pᵀ G, and P times a bf16 N
            g = grads[name].astype(np.float64)
            pb = proj.astype(BF16).astype(np.float64)
            left = SHAPES[name][0] == 16
            if method == "plumage":
                a, b = (pb.T, g) if left else (g, pb)
            else:
                a, b = (pb.T, g) if left else (g, pb.T)
            assert exact_in_float32(a, b), (name, t)
            m, v = state[f"m/{name}"], state[f"v/{name}"]
            if method == "plumage":
                n = plumage_spec.adam_direction(np, m, v, hp)
                n = n / (state[f"scale/{name}"][:, None] if left
                         else state[f"scale/{name}"][None, :])
            else:
                n = lowrank.hf_adam_direction(np, m, v, hp.eps)
            n = n.astype(BF16).astype(np.float64)
            a, b = (pb, n) if left else (n, pb if method != "plumage" else pb.T)
            assert exact_in_float32(a, b), (name, t)


def _assert_torchs_steps(method: str, hp, history, names) -> None:
    """``xopt.torch`` in ``hp``'s mode on the same bfloat16 inputs: the parameters ``names``
    and their moments are ``history``'s (the jitted transformation's) bit for bit at every
    update."""
    import torch

    import xopt.torch as xt

    cls = {"galore": xt.GaLore, "coap": xt.COAP, "plumage": xt.PLUMAGE}[method]
    tensors = {k: torch.nn.Parameter(torch.tensor(v, dtype=torch.bfloat16))
               for k, v in _params().items()}
    opt = cls(list(tensors.values()), spec=hp)
    for t in range(STEPS):
        for k, g in _grads(t).items():
            tensors[k].grad = torch.tensor(g, dtype=torch.bfloat16)
        opt.step(inject={tensors[k]: {key: torch.tensor(v) for key, v in inj.items()}
                         for k, inj in _inject(method, t).items()})
        got_p, got_s = history[t]
        for name in names:
            p = tensors[name]
            np.testing.assert_array_equal(
                got_p[name].view(np.uint16),
                p.detach().view(torch.int16).numpy().view(np.uint16), err_msg=f"{name} {t}")
            st = opt.state[p]
            m, v = _moments_of(got_s, name)
            np.testing.assert_array_equal(m, st["exp_avg"].numpy(), err_msg=f"m {name} {t}")
            np.testing.assert_array_equal(v, st["exp_avg_sq"].numpy(), err_msg=f"v {name} {t}")


@needs_torch
@pytest.mark.parametrize("method", sorted(SPECS))
def test_param_is_torchs_bf16_step(method: str) -> None:
    """``xopt.torch`` in the same mode on the same inputs: the same bits (parameters,
    moments) at every update."""
    _assert_torchs_steps(method, _spec_hp(method, WD), _jax_history(method, WD), MATRICES)


@pytest.mark.parametrize("method", sorted(SPECS))
def test_state_is_unchanged_and_float32_takes_one_path(method: str) -> None:
    """float32 parameters: "param" and "state" give the same updates and state bit for
    bit; bfloat16 parameters: both give float32 updates (``apply_updates`` rounds each new
    value once)."""
    a = _run_jax(method, WD, jnp.float32, "state", steps=3)
    b = _run_jax(method, WD, jnp.float32, "param", steps=3)
    for (pa, sa), (pb, sb) in zip(a, b, strict=True):
        jax.tree.map(np.testing.assert_array_equal, (pa, sa), (pb, sb))
    params = {k: jnp.asarray(v, jnp.bfloat16) for k, v in _params().items()}
    grads = {k: jnp.asarray(v, jnp.bfloat16) for k, v in _grads(0).items()}
    for mode in ("state", "param"):
        tx = getattr(xj, method)(spec=_spec_hp(method, WD, mode))
        u, _ = tx.update(grads, tx.init(params), params, inject=_inject(method, 0))
        assert {k: x.dtype for k, x in u.items()} == dict.fromkeys(SHAPES, jnp.float32), mode


@pytest.mark.parametrize("method", sorted(SPECS))
def test_a_bad_proj_dtype_is_named(method: str) -> None:
    with pytest.raises(HyperparameterError, match=r"proj_dtype.*'state', 'param'"):
        getattr(xj, method)(rank=4, proj_dtype="bfloat16")
    # the keyword is the spec's field: "param" is accepted as a keyword too
    tx = getattr(xj, method)(rank=4, proj_dtype="param")
    params = {"w": jnp.zeros((8, 6), jnp.bfloat16)}
    u, _ = tx.update(params, tx.init(params), params)
    assert u["w"].dtype == jnp.float32


@needs_torch
@pytest.mark.parametrize("method", sorted(SPECS))
def test_state_mode_bf16_is_torchs_step(method: str) -> None:
    """``proj_dtype="state"`` (the default) on bfloat16 parameters: float32 state, the step
    computed in float32 and rounded once into each parameter, as ``xopt.torch`` and the
    spec's ``init_state`` (state promoted to float32) do: the same bits (every parameter,
    moments, projections) at every update."""
    hp = _spec_hp(method, WD, "state")
    history = _run_jax(method, WD, jnp.bfloat16, "state")
    mod, _ = SPECS[method]
    spec_state = mod.init_state(hp, {k: v.astype(BF16) for k, v in _params().items()})
    assert all(np.asarray(v).dtype == np.float32 for k, v in spec_state.items() if k != "step")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(history[0][1])
               if jnp.issubdtype(x.dtype, jnp.floating))
    _assert_torchs_steps(method, hp, history, sorted(SHAPES))
