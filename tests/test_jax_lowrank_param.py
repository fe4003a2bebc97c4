"""``proj_dtype="param"`` in xopt.jax's GaLore, COAP and PLUMAGE: the spec's step.

Under ``"param"`` a projected bfloat16 matrix's two products run in bfloat16 (the exact
products summed in float32, rounded once), its moments and projection stay float32, and
its update is float32 so that ``optax.apply_updates`` rounds the step into the parameter
as the spec's ``hf_apply_low`` does. Checked on bfloat16 parameters:

* the jitted transformation against the spec's pure ``step`` (NumPy, ml_dtypes' bfloat16)
  and against ``xopt.torch`` in the same mode, bit for bit (parameters, moments);
* float32 parameters: ``"param"`` and ``"state"`` are one computation;
* bad values are refused naming ``proj_dtype``.

``"state"`` (the default) on bfloat16 parameters, float32 state and each new value rounded
once, the same bits in both backends, is the contract every method keeps
(``tests/contract/test_cross_backend_bf16.py``). The data are that contract's
(``contract/bf16_cases.py``): every refresh is injected (a Hadamard basis, entries ±1/4:
exact in bfloat16), parameters are integers times 2⁻⁷ and gradients integers times 2⁻⁴,
so every product is exact in float32 (asserted): the bfloat16 results then do not depend
on the order of summation, and the comparison is bit for bit on any CPU. ``lr`` = 2⁻⁷ and
``lr·λ`` = 2⁻¹⁰ are exact in bfloat16, and ``correct_bias=False`` makes the step size
``lr`` itself, so that the checks do not depend on how a backend rounds the step size
(torch's CPU ``add`` rounds ``alpha`` to bfloat16; JAX's bias correction is evaluated in
float32, the spec's in double).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import exact_in_float32, needs_torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import optax  # noqa: E402
from contract import bf16_cases as B  # noqa: E402

import xopt.jax as xj  # noqa: E402
from xopt.errors import HyperparameterError  # noqa: E402
from xopt.specs import coap as coap_spec  # noqa: E402
from xopt.specs import galore as galore_spec  # noqa: E402
from xopt.specs import lowrank  # noqa: E402
from xopt.specs import plumage as plumage_spec  # noqa: E402

BF16 = ml_dtypes.bfloat16
SHAPES, MATRICES, STEPS, WD = B.SHAPES, B.MATRICES, B.STEPS, B.WD
SPECS = {"galore": galore_spec, "coap": coap_spec, "plumage": plumage_spec}
_params, _grads, _inject = B.params, B.grads, B.lowrank_inject


def _spec_hp(method: str, wd: float, proj_dtype: str = "param"):
    return B.lowrank_spec(method, wd, proj_dtype=proj_dtype)


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
    mod = SPECS[method]
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
