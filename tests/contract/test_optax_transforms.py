"""The contract every xopt optax transformation keeps, checked once for every case.

The cases are in ``jax_cases.py`` (one per transformation; a method with several
transformations or Flax modules contributes each). Checks, in the spirit of optax's
common optimizer test (optax/contrib/_common_test.py):

* registry: every registered method and every public transformation has a case;
* ``optax.inject_hyperparams``: every float hyperparameter injectable and used (an
  injected value gives what building with it gives); integer ones refused unless static;
* ``optax.chain``, ``optax.MultiSteps``, one trace under ``jit`` across steps, ``value=``;
* nested pytrees with a 0-d leaf; shapes and dtypes checked at trace time; a state made for
  other parameters (or by another optimizer) refused with a named ``StateError``;
* ``nonfinite=``: ``"skip"`` leaves the state bitwise unchanged but for the counter and the
  next step is the step of a run without the bad one; ``"raise"`` names the leaf;
* a Flax (linen) model trains with the transformation.

Compiled functions are shared per case through module-scoped fixtures (tests run grouped by
case); everything runs on tiny pytrees for a few steps.
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

    from xopt.errors import HyperparameterError, NonFiniteError, StateError

    CASES = J.cases()
else:  # pragma: no cover
    CASES = ()

STEPS = 3


# -- helpers -------------------------------------------------------------------------------


def _bits(x: Any) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.kind not in "fc":
        return x
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def assert_bitwise(a: Any, b: Any, what: str) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    for name, x, y in zip(J_names(a), jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what} {name}"
        assert np.array_equal(_bits(x), _bits(y)), f"{what} {name}: {x} vs {y}"


def max_rel(a: Any, b: Any) -> float:
    """The largest ``max|a − b| / max|b|`` over the leaves (float64)."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.size == 0:
            continue
        d = np.max(np.abs(x - y))
        if d:
            worst = max(worst, d / max(np.max(np.abs(y)), 1e-30))
    return worst


def J_names(tree: Any) -> list[str]:
    from xopt.jax._contract import path_names

    return path_names(tree)


def counting(fn):
    """``fn`` that counts how often it runs (under jit: how often it is traced)."""

    def wrapped(*args, **kwargs):
        wrapped.traces += 1
        return fn(*args, **kwargs)

    wrapped.traces = 0
    return wrapped


@dataclasses.dataclass
class Prepared:
    """A case's default transformation on its tiny params, run ``STEPS`` steps under jit."""

    c: Any
    tx: Any
    params: Any
    update: Any  # the jitted, trace-counting update
    counted: Any
    states: list[Any]  # state before each step, and after the last
    updates: list[Any]


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def prepared(request) -> Prepared:
    c = request.param
    params = c.params()
    tx = c.build(params)
    counted = counting(tx.update)
    update = jax.jit(counted)
    state = tx.init(params)
    states, updates = [state], []
    for t in range(STEPS):
        u, state = update(J.grads_like(params, t), state, params, **J.update_kwargs(c, t))
        states.append(state)
        updates.append(u)
    return Prepared(c, tx, params, update, counted, states, updates)


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
    assert max_rel(base, prepared.updates) <= INJECTED_RTOL, f"{c.id}: injected values " \
        "differ from the built ones"
    for name, value in c.injectable.items():
        moved = _run_injected(update, state, params, c, {name: value})
        assert max_rel(moved, base) > 10 * INJECTED_RTOL, f"{c.id}: the injected " \
            f"{name}={value} is ignored"
    for name, (value, why) in c.unread.items():
        moved = _run_injected(update, state, params, c, {name: value})
        assert_bitwise(moved, base, f"{c.id}: {name} is declared unread ({why})")
    for name in c.refused:
        with pytest.raises(HyperparameterError, match=name):
            optax.inject_hyperparams(c.factory, static_args=static)(
                **kw, **{name: 0.0}).init(params)
    everything = _run_injected(update, state, params, c, c.injectable)
    _, _, want = J.run(c.build(params, **c.injectable), params, STEPS, c=c)
    assert max_rel(everything, want) <= INJECTED_RTOL, f"{c.id}: injecting {c.injectable} is not " \
        "building with them"
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
    assert_bitwise(updates, prepared.updates, f"{c.id} in chain")
    assert_bitwise(state[1], prepared.states[-1], f"{c.id} state in chain")


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
    assert_bitwise(state1.inner_opt_state, state.inner_opt_state, f"{c.id} inner state")
    u2, state2 = update(g, state1, params, **kw)
    assert max_rel(u2, prepared.updates[0]) <= 1e-6
    assert max_rel(state2.inner_opt_state, prepared.states[1]) <= 1e-6


def test_jit_traces_once_and_state_keeps_its_avals(prepared):
    assert prepared.counted.traces == 1, f"{prepared.c.id}: {prepared.counted.traces} traces"
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


def test_nested_pytree_with_a_scalar_leaf(prepared):
    params = prepared.params
    shapes = [jnp.shape(x) for x in jax.tree.leaves(params)]
    assert () in shapes and any(isinstance(x, list) for x in jax.tree.leaves(
        params, is_leaf=lambda x: isinstance(x, list)))
    for u in prepared.updates:
        assert jax.tree.structure(u) == jax.tree.structure(params)
        for x, p in zip(jax.tree.leaves(u), jax.tree.leaves(params), strict=True):
            assert x.shape == p.shape and x.dtype == p.dtype


# -- bad input: named errors at trace time, nothing changed ------------------------------------


def _other_params(params: Any) -> list[tuple[str, Any]]:
    """Parameters of other shapes or structure, each with what differs."""
    leaves, treedef = jax.tree.flatten(params)
    names = J_names(params)
    out = []
    for i, (name, x) in enumerate(zip(names, leaves, strict=True)):
        shape = (1,) if x.ndim == 0 else (x.shape[0] + 2, *x.shape[1:])
        other = list(leaves)
        other[i] = jnp.ones(shape, x.dtype)
        out.append((f"{name} {shape}", treedef.unflatten(other)))
    out.append(("an extra leaf", {"params": params, "more": jnp.ones(3)}))
    out.append(("a missing leaf", treedef.unflatten([*leaves[:-1], None])))
    return out


def _avals(tree: Any) -> Any:
    return jax.tree.structure(tree), [(jnp.shape(x), jnp.result_type(x))
                                      for x in jax.tree.leaves(tree)]


def test_state_for_other_parameters_is_refused_at_trace_time(prepared):
    c, tx, params = prepared.c, prepared.tx, prepared.params
    g, kw = J.grads_like(params, 0), J.update_kwargs(c, 0)
    snapshot = jax.tree.map(np.array, (params, prepared.states[0]))
    refused = 0
    for what, other in _other_params(params):
        try:
            state = tx.init(other)
        except (ValueError, TypeError):  # e.g. a projection that does not fit: not a state
            continue
        if _avals(state) == _avals(prepared.states[0]):
            continue  # this method's state does not depend on what differs (it fits)
        try:
            jax.eval_shape(functools.partial(tx.update, **kw), g, state, params)
        except StateError as e:
            assert "state does not fit" in str(e)
        else:
            pytest.fail(f"{c.id}: a state made for parameters with {what} was accepted")
        refused += 1
    assert refused >= 3, f"{c.id}: only {refused} states for other parameters could be made"
    foreign = optax.adam(1e-3).init(params)
    with pytest.raises(StateError, match="state does not fit"):
        jax.jit(functools.partial(tx.update, **kw))(g, foreign, params)
    other_mode = c.build(params, nonfinite="skip").init(params)
    with pytest.raises(StateError, match="nonfinite_skips"):
        jax.eval_shape(functools.partial(tx.update, **kw), g, other_mode, params)
    assert_bitwise(jax.tree.map(np.array, (params, prepared.states[0])), snapshot, "inputs")


def test_bad_gradients_and_parameters_are_named_at_trace_time(prepared):
    c, tx, params = prepared.c, prepared.tx, prepared.params
    state, kw = prepared.states[0], J.update_kwargs(c, 0)
    update = functools.partial(tx.update, **kw)
    g = J.grads_like(params, 0)
    leaves, treedef = jax.tree.flatten(g)
    name = J_names(g)[-1]
    wrong = treedef.unflatten([*leaves[:-1], jnp.ones((5,), jnp.float32)])
    with pytest.raises(ValueError, match=f"gradient of {name}"):
        jax.eval_shape(update, wrong, state, params)
    ints = treedef.unflatten([*leaves[:-1], jnp.ones(leaves[-1].shape, jnp.int32)])
    with pytest.raises(HyperparameterError, match=f"{name}.*int32"):
        jax.eval_shape(update, ints, state, params)
    with pytest.raises(ValueError, match="structure"):
        jax.eval_shape(update, {"other": leaves[0]}, state, params)
    p_leaves, p_def = jax.tree.flatten(params)
    for dtype in (jnp.int32, jnp.complex64):
        bad = p_def.unflatten([*p_leaves[:-1], jnp.ones(p_leaves[-1].shape, dtype)])
        with pytest.raises(HyperparameterError, match=f"{J_names(params)[-1]}.*"
                                                      f"{jnp.dtype(dtype).name}"):
            tx.init(bad)


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


# -- nonfinite= --------------------------------------------------------------------------------


def _poison(tree: Any, index: int = -1) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    x = leaves[index]
    leaves[index] = x.at[(0,) * x.ndim].set(jnp.nan)
    return treedef.unflatten(leaves)


def test_nonfinite_skip_changes_nothing_but_the_counter(prepared):
    """A non-finite gradient (or loss) under ``nonfinite="skip"``: zero updates, the state
    bitwise unchanged but ``nonfinite_skips``, and the next finite step is the step of a
    run that never saw the bad one."""
    c, params = prepared.c, prepared.params
    tx = c.build(params, nonfinite="skip")
    update = jax.jit(tx.update)
    s0 = tx.init(params)
    assert s0.nonfinite_skips.dtype == jnp.int32 and s0.nonfinite_skips.shape == ()
    u0, s1 = update(J.grads_like(params, 0), s0, params, **J.update_kwargs(c, 0))
    p1 = optax.apply_updates(params, u0)
    bad = [(_poison(J.grads_like(p1, 1)), J.update_kwargs(c, 1))]
    if c.loss != "ignored":
        bad.append((J.grads_like(p1, 1), {"value": jnp.asarray(jnp.inf, jnp.float32)}))
    s = s1
    for k, (g, kw) in enumerate(bad, start=1):
        u, s = update(g, s, p1, **kw)
        assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(u)), "update not zero"
        assert int(s.nonfinite_skips) == k
        assert_bitwise(s._replace(nonfinite_skips=None), s1._replace(nonfinite_skips=None),
                       f"{c.id} state after a skipped step")
    u_a, s_a = update(J.grads_like(p1, 2), s, p1, **J.update_kwargs(c, 2))
    u_b, s_b = update(J.grads_like(p1, 2), s1, p1, **J.update_kwargs(c, 2))
    assert_bitwise(u_a, u_b, f"{c.id} step after the skipped one")
    assert_bitwise(s_a._replace(nonfinite_skips=None), s_b._replace(nonfinite_skips=None),
                   f"{c.id} state after the skipped one")
    if "nonfinite_skips" not in c.not_applicable:
        assert int(s_b.nonfinite_skips) == 0


def test_nonfinite_raise_names_the_leaf_and_is_refused_under_jit(prepared):
    c, params = prepared.c, prepared.params
    tx = c.build(params, nonfinite="raise")
    state, kw = tx.init(params), J.update_kwargs(c, 0)
    g = J.grads_like(params, 0)
    with pytest.raises(NonFiniteError, match=J_names(g)[-1]):
        tx.update(_poison(g), state, params, **kw)
    if c.loss != "ignored":
        with pytest.raises(NonFiniteError, match="loss"):
            tx.update(g, state, params, value=jnp.asarray(jnp.nan, jnp.float32))
    with pytest.raises(HyperparameterError, match="nonfinite='skip'"):
        jax.eval_shape(functools.partial(tx.update, **kw), g, state, params)
    if "check_finite" in inspect.signature(c.factory).parameters:
        old = c.build(params, check_finite=True)
        with pytest.raises(NonFiniteError, match=J_names(g)[-1]):
            old.update(_poison(g), state, params, **kw)


def test_nonfinite_ignore_is_the_default_and_lets_nan_through(prepared):
    c, params = prepared.c, prepared.params
    assert prepared.states[0]._asdict().get("nonfinite_skips", None) is None
    g = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), J.grads_like(params, 0))
    u, _ = prepared.update(g, prepared.states[0], params, **J.update_kwargs(c, 0))
    assert any(not np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(u))


# -- a Flax model trains -----------------------------------------------------------------------


def test_flax_model_trains(prepared):
    c = prepared.c
    module, variables, trainable = c.model()
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)
    frozen = {k: v for k, v in variables.items() if k != trainable}
    out = jax.eval_shape(lambda: module.apply(variables, x))
    y = jnp.asarray(np.sin(3 * rng.standard_normal(out.shape)), jnp.float32)

    def loss_fn(p):
        return jnp.mean((module.apply({trainable: p, **frozen}, x) - y) ** 2)

    params = variables[trainable]
    tx = c.build(params, variables)

    @jax.jit
    def step(p, s):
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, s = tx.update(g, s, p, value=loss)
        return optax.apply_updates(p, u), s, loss

    state = tx.init(params)
    losses = []
    for _ in range(12):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0], f"{c.id}: loss {losses[0]:.4g} -> {losses[-1]:.4g}"


def test_nonfinite_raise_passes_finite_steps_through():
    """Under ``"raise"`` a finite step is the step of ``"ignore"``, bit for bit (eager)."""
    c = J.case("adamw")
    params = c.params()
    raising, plain = c.build(params, nonfinite="raise"), c.build(params)
    u1, s1 = raising.update(J.grads_like(params, 0), raising.init(params), params)
    u2, s2 = plain.update(J.grads_like(params, 0), plain.init(params), params)
    assert_bitwise((u1, s1), (u2, s2), "raise vs ignore")


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
