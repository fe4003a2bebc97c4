"""The contract every xopt optax transformation keeps, checked once for every case.

The cases are in ``jax_cases.py`` (one per transformation; a method with several
transformations or Flax modules contributes each). In the spirit of optax's common
optimizer test (optax/contrib/_common_test.py), this file checks:

* the registry: every registered method, public transformation and Flax module has a case;
* ``optax.inject_hyperparams``: every float hyperparameter injectable and used (injected
  values give what building with them gives); integer ones refused unless static;
* ``optax.chain``, ``optax.MultiSteps``, one trace under ``jit`` across steps, ``value=``,
  nested pytrees with a 0-d leaf; hyperparameter validation; the learned optimizers'
  bundled θ.

``test_optax_bad_input.py`` checks bad input and ``nonfinite=``, ``test_optax_flax.py``
training a Flax model. Compiled functions are shared per case through module-scoped
fixtures (tests run grouped by case); everything runs on tiny pytrees for a few steps.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any

import numpy as np
import pytest
from helpers import has_jax

pytestmark = pytest.mark.skipif(not has_jax, reason="jax/optax/flax are not installed")

if has_jax:
    import jax
    import jax.numpy as jnp
    import optax
    from contract import jax_cases as J

    from xopt.errors import HyperparameterError

    CASES = J.cases()
else:  # pragma: no cover
    CASES = ()

STEPS = 3


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def prepared(request) -> Any:
    return J.prepare(request.param, STEPS)


def _numeric_fields(spec_cls) -> list[str]:
    """The spec's numeric hyperparameters (ints and floats; not flags, names or tuples)."""
    out = []
    for f in dataclasses.fields(spec_cls):
        d = f.default
        numeric = (isinstance(d, (int, float)) and not isinstance(d, bool)) or (
            d is None and f.metadata.get("interval") is not None)
        if numeric:
            out.append(f.name)
    return out


def _arg(field: str) -> str:
    return "learning_rate" if field == "lr" else field


# -- the registry ----------------------------------------------------------------------------


def test_every_registered_method_and_public_transformation_has_a_case():
    import flax.linen as nn

    import xopt.jax as xj
    from xopt import specs

    missing = sorted(set(specs.names()) - {c.method for c in CASES})
    assert not missing, f"registered methods without a JAX case in jax_cases.py: {missing}"
    public = {getattr(xj, n) for n in xj.__all__}
    factories = {f for f in public if inspect.isfunction(f)}
    modules = {m.__name__ for m in public if inspect.isclass(m) and issubclass(m, nn.Module)}
    assert factories == {c.factory for c in CASES}, "a public transformation has no case"
    assert modules == {m for c in CASES for m in c.modules}, "a public Flax module has no case"


@pytest.mark.parametrize("factory", sorted({c.factory.__name__ for c in CASES}))
def test_cases_declare_every_numeric_hyperparameter(factory):
    """Every numeric field of the method's spec is, in some case of the factory, injectable,
    static, unread, refused or explained as not an argument; all are passed in kwargs."""
    from xopt import specs

    mine = [c for c in CASES if c.factory.__name__ == factory]
    sig = inspect.signature(mine[0].factory).parameters
    declared = set()
    for c in mine:
        declared |= {*c.injectable, *c.static, *c.not_arguments, *c.unread, *c.refused}
        for name in (*c.injectable, *c.static, *c.unread, *c.refused):
            assert name in sig, f"{c.id}: {name} is not an argument of {factory}"
        for name in (*c.injectable, *c.unread):
            assert name in c.kwargs, f"{c.id}: pass {name} in kwargs so that it is injected"
    for field in _numeric_fields(specs.get(mine[0].method).hyperparams):
        assert _arg(field) in declared, f"{factory}: {field} is neither injectable, static, " \
                                        "unread, refused nor explained in not_arguments"


# -- optax.inject_hyperparams ------------------------------------------------------------------


# A Python hyperparameter enters the arithmetic as a double-precision constant (1 − β is
# computed in double, then rounded), an injected one as a float32 array (1 − β in float32):
# the updates differ by that rounding (~1e-7) times their sensitivity to it, up to 3.3e-5
# for Flora's compressed momentum over three steps. An ignored value moves them by O(1).
INJECTED_RTOL = 1e-4


def _run_injected(update, state, params, c, hyperparams):
    state = state._replace(hyperparams={
        k: jnp.asarray(hyperparams.get(k, v), jnp.asarray(v).dtype)
        for k, v in state.hyperparams.items()})
    out = []
    for t in range(STEPS):
        u, state = update(J.grads_like(params, t), state, params, **J.update_kwargs(c, t))
        out.append(u)
    return out


def test_inject_hyperparams_uses_every_injected_value(prepared):
    """Each float hyperparameter, injected, changes the update; all injected at once give
    what the transformation built with those values gives. Integer ones are refused with
    an error naming ``static_args`` unless they are static."""
    c, params = prepared.c, prepared.params
    kw = c.factory_kwargs(params)
    static = [s for s in c.static if s in kw]
    injected = optax.inject_hyperparams(c.factory, static_args=static)(**kw)
    state = injected.init(params)
    assert set(c.injectable) <= set(state.hyperparams), f"{c.id}: not injected: " \
        f"{sorted(set(c.injectable) - set(state.hyperparams))}"
    update = jax.jit(injected.update)
    base = _run_injected(update, state, params, c, {})
    assert J.max_rel(base, prepared.updates) <= INJECTED_RTOL, f"{c.id}: injected values " \
        "differ from the built ones"
    for name, value in c.injectable.items():
        moved = _run_injected(update, state, params, c, {name: value})
        assert J.max_rel(moved, base) > 10 * INJECTED_RTOL, f"{c.id}: the injected " \
            f"{name}={value} is ignored"
    for name, (value, why) in c.unread.items():
        moved = _run_injected(update, state, params, c, {name: value})
        J.assert_bitwise(moved, base, f"{c.id}: {name} is declared unread ({why})")
    for name in c.refused:
        with pytest.raises(HyperparameterError, match=name):
            optax.inject_hyperparams(c.factory, static_args=static)(
                **{**kw, name: 0.0}).init(params)
    everything = _run_injected(update, state, params, c, c.injectable)
    _, _, want = J.run(c.build(params, **c.injectable), params, STEPS, c=c)
    assert J.max_rel(everything, want) <= INJECTED_RTOL, f"{c.id}: injecting " \
        f"{c.injectable} is not building with them"
    if static:
        refused = optax.inject_hyperparams(c.factory)(**kw)
        with pytest.raises(HyperparameterError, match="static_args"):
            refused.init(params)


# -- wrappers ----------------------------------------------------------------------------------


def test_chain_is_the_transformation_and_forwards_value(prepared):
    """Between identities in ``optax.chain`` the updates and state are bitwise the same;
    the chain forwards ``value=``, which the methods that do not read the loss ignore."""
    c, params = prepared.c, prepared.params
    chained = optax.chain(optax.identity(), prepared.tx, optax.identity())
    update = jax.jit(chained.update)
    state, updates = chained.init(params), []
    for t in range(STEPS):
        u, state = update(J.grads_like(params, t), state, params, value=J.loss_value(t))
        updates.append(u)
    J.assert_bitwise(updates, prepared.updates, f"{c.id} in chain")
    J.assert_bitwise(state[1], prepared.states[-1], f"{c.id} state in chain")


def test_multi_steps_accumulates_then_steps(prepared):
    """``optax.MultiSteps(k=2)``: the first call returns zeros and keeps the inner state; the
    second steps on the mean of the two gradients (both the same here, so the mean is exact)."""
    c, params = prepared.c, prepared.params
    ms = optax.MultiSteps(prepared.tx, every_k_schedule=2)
    update = jax.jit(ms.update)
    state = ms.init(params)
    g, kw = J.grads_like(params, 0), J.update_kwargs(c, 0)
    u1, state1 = update(g, state, params, **kw)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(u1))
    J.assert_bitwise(state1.inner_opt_state, state.inner_opt_state, f"{c.id} inner state")
    u2, state2 = update(g, state1, params, **kw)
    assert J.max_rel(u2, prepared.updates[0]) <= 1e-6
    assert J.max_rel(state2.inner_opt_state, prepared.states[1]) <= 1e-6


def test_jit_traces_once_and_state_keeps_its_avals(prepared):
    assert len(prepared.traces) == 1, f"{prepared.c.id}: {len(prepared.traces)} traces"
    avals = [jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "weak_type", False)), s)
             for s in prepared.states]
    assert all(a == avals[0] for a in avals), "the state's shapes or dtypes change"
    if "count" in prepared.states[-1]._fields:
        assert prepared.states[-1].count.dtype == jnp.int32


def test_value_argument(prepared):
    """``value=`` (the loss): required by the methods that need it; optional for those that
    read it only for the nonfinite policy; accepted and ignored by the others (checked
    bitwise through optax.chain above)."""
    c, params = prepared.c, prepared.params
    g, state = J.grads_like(params, 0), prepared.states[0]
    if c.loss == "required":
        with pytest.raises(ValueError, match="loss"):
            jax.eval_shape(prepared.tx.update, g, state, params)
    else:
        out = jax.eval_shape(prepared.tx.update, g, state, params)
        assert jax.tree.structure(out[0]) == jax.tree.structure(params)
    jax.eval_shape(functools.partial(prepared.tx.update, value=J.loss_value(0)), g, state,
                   params)


def test_matrix_products_are_full_precision(prepared):
    """Every matrix product the jitted update traces is float32 at ``HIGHEST`` precision
    (XLA on a GPU would otherwise multiply in TF32, ~1e-3 relative; a CPU cannot show it,
    so the lowered program is read). Updates without matrix products pass vacuously."""
    import re

    c, params = prepared.c, prepared.params
    lowered = jax.jit(prepared.tx.update).lower(J.grads_like(params, 0), prepared.states[0],
                                                params, **J.update_kwargs(c, 0))
    dots = [line for line in lowered.as_text().splitlines()
            if re.search(r"\bdot_general\b", line)]
    loose = [d.strip()[:160] for d in dots if "HIGHEST, HIGHEST" not in d]
    assert not loose, f"{c.id}: {len(loose)} of {len(dots)} products not at full precision"


def test_nested_pytree_with_a_scalar_leaf(prepared):
    params = prepared.params
    shapes = [jnp.shape(x) for x in jax.tree.leaves(params)]
    assert () in shapes and any(isinstance(x, list) for x in jax.tree.leaves(
        params, is_leaf=lambda x: isinstance(x, list)))
    for u in prepared.updates:
        assert jax.tree.structure(u) == jax.tree.structure(params)
        for x, p in zip(jax.tree.leaves(u), jax.tree.leaves(params), strict=True):
            assert x.shape == p.shape and x.dtype == p.dtype


def test_nonfinite_ignore_is_the_default_and_lets_nan_through(prepared):
    """``nonfinite="ignore"`` (no check, no counter in the state): a NaN gradient reaches the
    updates, the documented trade-off (bad input and the other modes:
    test_optax_bad_input.py), unless the method has a rule of its own for them: then the
    update is the one of a zero gradient."""
    c, params = prepared.c, prepared.params
    assert prepared.states[0]._asdict().get("nonfinite_skips", None) is None
    g = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), J.grads_like(params, 0))
    u, _ = prepared.update(g, prepared.states[0], params, **J.update_kwargs(c, 0))
    if not c.sanitises_nonfinite:
        assert any(not np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(u))
        return
    zero = jax.tree.map(jnp.zeros_like, g)
    u0, _ = prepared.update(zero, prepared.states[0], params, **J.update_kwargs(c, 0))
    for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(u0), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- hyperparameters ----------------------------------------------------------------------------


def test_unknown_keyword_is_named(prepared):
    with pytest.raises(HyperparameterError, match=r"'not_a_field'.*known: "):
        prepared.c.build(prepared.params, not_a_field=1.0)
    with pytest.raises(HyperparameterError, match=r"'lr'.*`learning_rate`"):
        prepared.c.build(prepared.params, lr=1.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_hyperparameters_are_validated_as_the_spec_validates_them(prepared, bad):
    """The transformation refuses, naming the field, exactly the values the method's spec
    dataclass refuses (the backends validate through it)."""
    from xopt import specs

    c = prepared.c
    method = specs.get(c.method)
    fields = set(method.hyperparams.field_names())
    given = {("lr" if k == "learning_rate" else k): v for k, v in c.kwargs.items()}
    valid = method.make(given.pop("preset", None),
                        **{k: v for k, v in given.items() if k in fields})
    for name in c.injectable:
        field = "lr" if name == "learning_rate" else name
        try:
            valid.replace(**{field: bad})
            spec_refuses = False
        except HyperparameterError:
            spec_refuses = True
        if spec_refuses:
            with pytest.raises(HyperparameterError, match=field):
                c.build(prepared.params, **{name: bad})
        else:
            c.build(prepared.params, **{name: bad})


# -- the bundled θ of the learned optimizers ---------------------------------------------------


def _bundled_cases():
    from xopt.checkpoints.bundled import bundled_methods

    return [c for c in CASES if c.method in bundled_methods()]


@pytest.mark.parametrize("c", _bundled_cases() if has_jax else [], ids=repr)
def test_bundled_meta_params_build_and_step(c):
    """``bundled_meta_params(method)`` gives θ and the hyperparameters it needs; with them
    the transformation steps. With an architecture field that θ does not fit, the error
    names the field and the value to set."""
    from xopt import specs
    from xopt.checkpoints.bundled import bundled_meta_params
    from xopt.errors import MetaParamsError

    theta, hyperparameters = bundled_meta_params(c.method)
    params = c.params()
    tx = c.factory(theta, num_training_steps=10, **hyperparameters)
    u, state = jax.jit(tx.update)(J.grads_like(params, 0), tx.init(params), params,
                                  value=J.loss_value(0))
    assert all(np.all(np.isfinite(np.asarray(x))) and np.any(np.asarray(x))
               for x in jax.tree.leaves(u))
    shared = {"num_training_steps", "max_training_steps"}
    cls = specs.get(c.method).hyperparams
    field = next(f.name for f in dataclasses.fields(cls) if f.name not in shared
                 and isinstance(f.default, int) and not isinstance(f.default, bool))
    right = hyperparameters.get(field, getattr(cls(), field))
    wrong = {**hyperparameters, field: right + 1}
    with pytest.raises(MetaParamsError, match=f"{field}={right}"):
        c.factory(theta, num_training_steps=10, **wrong)
