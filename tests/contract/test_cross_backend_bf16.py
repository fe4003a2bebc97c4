"""The bfloat16 contract: a bfloat16 parameter keeps float32 state, and its new value is the
float32 one rounded once, in both backends and to the same bits.

Every spec takes a bfloat16/float16 parameter's state in float32 (``init_state`` promotes
it) and rounds ``p ← new`` once into the parameter, as xopt.torch does; xopt.jax returns a
float32 update for such a leaf, so that ``optax.apply_updates`` does the one rounding. An
update rounded to the leaf's dtype first rounds twice and moves bits; bfloat16 moments
drift from float32 ones. Checked here for every registered method with a torch optimizer
and an optax transformation:

* every JAX case (``jax_cases.py``): on bfloat16 leaves, the state and the updates are the
  float32 run's bits from the same values and gradients, and the new parameters its new
  values rounded once (:func:`bf16_cases.jax_rounds_once`, on an XLA:CPU without fused
  multiply-adds; the torch twin is ``test_torch_optimizers.py``'s low-precision check); a
  case that keeps the leaf's dtype by design (``optax.adamw``'s arithmetic) declares it
  (``JaxCase.narrow_leaves``) and the check asserts the declared behaviour instead;
* every method across the backends (``bf16_cases.py``): the same bfloat16 tree stepped
  five times from the same data by xopt.torch and xopt.jax gives the same parameters and
  the same float32 state, bit for bit, at every update, with and without weight decay; a
  method whose float32 steps are not the same bits in both backends says why there
  (``Bf16Case.not_bitwise``: the learned optimizers) and keeps the first check.
"""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import pytest
from helpers import fma_free_jax_child, has_jax, has_torch, needs_x86

pytestmark = pytest.mark.skipif(not (has_jax and has_torch), reason="needs torch and jax")

if has_jax and has_torch:
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import optax
    import torch
    from contract import bf16_cases as B
    from contract import jax_cases as J
    from contract import torch_cases as T

    from xopt import registry
    from xopt.parity.runners import flatten_with_paths
    from xopt.specs import get as get_spec

    JAX_CASES = J.cases()
    CROSS = [c for c in B.CASES if not c.not_bitwise]
else:  # pragma: no cover
    JAX_CASES, CROSS = (), []


def test_every_method_of_both_backends_has_a_bf16_case():
    both = {c.method for c in T.CASES} & {c.method for c in JAX_CASES}
    narrow = {c.method for c in JAX_CASES if c.narrow_leaves}
    have = [c.method for c in B.CASES]
    assert len(have) == len(set(have)), "one bf16 case per method"
    missing = sorted(both - narrow - set(have))
    assert not missing, f"methods without a case in bf16_cases.py: {missing}"
    declared = sorted(narrow & set(have))
    assert not declared, f"{declared}: a narrow_leaves reason and a bf16 case"
    assert set(have) <= both


# -- each JAX transformation: its bfloat16 step is its float32 step rounded once -------------


def _floating(tree: Any) -> list[Any]:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


_CHILD = textwrap.dedent("""
    import json, sys
    from contract import bf16_cases, jax_cases
    report = {}
    for c in jax_cases.cases():
        if c.id in IDS:
            try:
                bf16_cases.jax_rounds_once(c)
                report[c.id] = ""
            except AssertionError as e:
                report[c.id] = str(e) or repr(e)
    print(json.dumps(report))
""")


@pytest.fixture(scope="module")
def jax_report(request) -> dict[str, str]:
    """The child's verdict on each case this run selected (a case deselected, e.g. in the
    slow tier, is not run: each costs two XLA compilations on that CPU, seconds)."""
    ids = sorted({item.callspec.params["c"].id for item in request.session.items
                  if getattr(item, "module", None) is request.module
                  and item.originalname == "test_jax_bf16_leaves_keep_float32_state_and_round_once"
                  and not item.callspec.params["c"].narrow_leaves})
    return fma_free_jax_child(f"IDS = {ids!r}\n" + _CHILD)


@pytest.mark.parametrize("c", [  # the bits on an FMA-free XLA:CPU (_CHILD)
    c if c.narrow_leaves else pytest.param(c, marks=needs_x86) for c in JAX_CASES],
    ids=lambda c: c.id)
def test_jax_bf16_leaves_keep_float32_state_and_round_once(c, request):
    if c.narrow_leaves:  # the declared behaviour: state and updates in the leaf's dtype
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), c.params())
        tx = c.build(params)
        u, state = tx.update(J.grads_like(params, 0), tx.init(params), params,
                             **J.update_kwargs(c, 0))
        assert any(x.dtype == jnp.bfloat16 for x in _floating(state)), c.narrow_leaves
        assert all(x.dtype == jnp.bfloat16 for x in _floating(u)), c.narrow_leaves
        return
    msg = request.getfixturevalue("jax_report")[c.id]
    assert not msg, msg


# -- across the backends: the same bits from the same data ---------------------------------------


def _torch_state(opt: Any, tensors: dict[str, Any]) -> dict[str, np.ndarray]:
    """xopt.torch's state in its naming's flat keys (``{param}/{key}``), as NumPy."""
    flat: dict[str, np.ndarray] = {}
    for name, p in tensors.items():
        for k, v in opt.state[p].items():
            flat[f"{name}/{k}"] = v.detach().numpy() if torch.is_tensor(v) else np.asarray(v)
    if hasattr(opt, "global_step_counter"):  # POETAdamW keeps it on the optimizer
        flat["global_step_counter"] = np.asarray(opt.global_step_counter)
    return flat


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize]) \
        if a.dtype.kind == "f" else a


def _differ(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.sum(_bits(a) != _bits(b)))


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    """The largest distance in float32 ulps (finite values of one sign)."""
    d = _bits(a).astype(np.int64) - _bits(b).astype(np.int64)
    return int(np.abs(d).max()) if d.size else 0


@pytest.mark.parametrize("wd", [0.0, B.WD] if CROSS else [],
                         ids=lambda wd: "decay" if wd else "no-decay")
@pytest.mark.parametrize("case", CROSS, ids=str)
def test_bf16_steps_are_the_same_bits_on_both_backends(case, wd):
    spec = get_spec(case.method)
    hp = case.spec(wd)
    names = sorted(B.SHAPES)
    data = B.params()
    # the spec's rule the backends follow: float32 state for bfloat16 parameters
    init = spec.init_state(hp, {k: data[k].astype(ml_dtypes.bfloat16) for k in names})
    assert all(np.asarray(v).dtype == np.float32 for v in init.values()
               if np.asarray(v).dtype.kind == "f"), case

    tensors = {k: torch.nn.Parameter(torch.tensor(data[k], dtype=torch.bfloat16))
               for k in names}
    opt = registry.implementation(case.method, "torch").factory(list(tensors.values()),
                                                                spec=hp)
    tx = registry.implementation(case.method, "jax").factory(spec=hp, **case.jax_kwargs)
    params = {k: jnp.asarray(data[k], jnp.bfloat16) for k in names}
    state = tx.init(params)
    update = jax.jit(lambda g, s, p, inj: tx.update(g, s, p, **(
        {} if inj is None else {"inject": inj})))
    for t in range(B.STEPS):
        grads = B.grads(t)
        inject = case.inject(t) if case.inject is not None else None
        for k in names:
            tensors[k].grad = torch.tensor(grads[k], dtype=torch.bfloat16)
        opt.step(**({} if inject is None else {"inject": {
            tensors[k]: {key: torch.tensor(v) for key, v in d.items()}
            for k, d in inject.items()}}))
        u, state = update({k: jnp.asarray(grads[k], jnp.bfloat16) for k in names}, state,
                          params, inject)
        dtypes = {str(x.dtype) for x in jax.tree.leaves(u)}
        assert dtypes == {"float32"}, f"{case}: xopt.jax's updates at update {t}: {dtypes}"
        params = optax.apply_updates(params, u)
        for k in names:
            a = tensors[k].detach().view(torch.int16).numpy()
            b = np.asarray(params[k]).view(np.int16)
            assert params[k].dtype == jnp.bfloat16
            assert np.array_equal(a, b), \
                f"{case} {k}, update {t}: {int(np.sum(a != b))} of {a.size} elements differ"
        # the state: float32 in both, and the same bits by the spec's names
        flat_t = _torch_state(opt, tensors)
        flat_j = {k: np.asarray(v) for k, v in flatten_with_paths(state).items()}
        for where, flat in (("xopt.torch", flat_t), ("xopt.jax", flat_j)):
            wide = {k: v.dtype for k, v in flat.items() if v.dtype.kind == "f"}
            assert wide and set(wide.values()) == {np.dtype(np.float32)}, (case, where, wide)
        st_t = spec.state.to_canonical(spec.naming_of["torch"], flat_t, names, hp,
                                       where="xopt.torch")
        st_j = spec.state.to_canonical(spec.naming_of["jax"], flat_j, names, hp,
                                       where="xopt.jax")
        assert set(st_t) == set(st_j), (case, sorted(set(st_t) ^ set(st_j)))
        for k in st_t:
            a, b = np.asarray(st_t[k]), np.asarray(st_j[k])
            if a.dtype.kind == "f" or b.dtype.kind == "f":
                assert a.dtype == b.dtype == np.float32, (case, k, a.dtype, b.dtype)
                if k.split("/")[0] in case.ulp_state:  # declared, with the op
                    assert _ulps(a, b) <= 1, (case, k, t, case.ulp_state[k.split("/")[0]])
                    continue
                assert _differ(a, b) == 0, \
                    f"{case} state {k}, update {t}: {_differ(a, b)} of {a.size} differ"
            else:
                assert np.array_equal(a, b), (case, k, t, a, b)
    for k in names:
        assert not np.array_equal(np.asarray(params[k], np.float32), data[k]), (case, k)
