"""Bad input never moves a parameter: every xopt optax transformation, every case.

A state made for other parameters (other shapes, other structure, other settings, another
optimizer) is a named :class:`~xopt.errors.StateError` raised while tracing; a gradient of
the wrong shape, structure or dtype and a non-floating parameter are named errors at trace
time; the inputs are left as they were. ``nonfinite=``: ``"skip"`` returns zero updates and
the state bitwise unchanged but for its counter, and the next step is the step of a run
that never saw the bad one; ``"raise"`` names the leaf (and is refused under ``jit``).
(``"ignore"``, the default, is checked in test_optax_transforms.py, where the update is
compiled already.) Cases: ``jax_cases.py``.
"""

from __future__ import annotations

import functools
import inspect
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


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def prepared(request) -> Any:
    return J.prepare(request.param, steps=0)


# -- bad input: named errors at trace time, nothing changed ------------------------------------


def _other_params(params: Any) -> list[tuple[str, Any]]:
    """Parameters of other shapes or structure, each with what differs."""
    leaves, treedef = jax.tree.flatten(params)
    names = J.names(params)
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
    J.assert_bitwise(jax.tree.map(np.array, (params, prepared.states[0])), snapshot, "inputs")


def test_bad_gradients_and_parameters_are_named_at_trace_time(prepared):
    c, tx, params = prepared.c, prepared.tx, prepared.params
    state, kw = prepared.states[0], J.update_kwargs(c, 0)
    update = functools.partial(tx.update, **kw)
    g = J.grads_like(params, 0)
    leaves, treedef = jax.tree.flatten(g)
    name = J.names(g)[-1]
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
        with pytest.raises(HyperparameterError, match=f"{J.names(params)[-1]}.*"
                                                      f"{jnp.dtype(dtype).name}"):
            tx.init(bad)


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
        J.assert_bitwise(s._replace(nonfinite_skips=None), s1._replace(nonfinite_skips=None),
                       f"{c.id} state after a skipped step")
    u_a, s_a = update(J.grads_like(p1, 2), s, p1, **J.update_kwargs(c, 2))
    u_b, s_b = update(J.grads_like(p1, 2), s1, p1, **J.update_kwargs(c, 2))
    J.assert_bitwise(u_a, u_b, f"{c.id} step after the skipped one")
    J.assert_bitwise(s_a._replace(nonfinite_skips=None), s_b._replace(nonfinite_skips=None),
                   f"{c.id} state after the skipped one")
    assert int(s_b.nonfinite_skips) == 0


def test_nonfinite_raise_names_the_leaf_and_is_refused_under_jit(prepared):
    c, params = prepared.c, prepared.params
    tx = c.build(params, nonfinite="raise")
    state, kw = tx.init(params), J.update_kwargs(c, 0)
    g = J.grads_like(params, 0)
    with pytest.raises(NonFiniteError, match=J.names(g)[-1]):
        tx.update(_poison(g), state, params, **kw)
    if c.loss != "ignored":
        with pytest.raises(NonFiniteError, match="loss"):
            tx.update(g, state, params, value=jnp.asarray(jnp.nan, jnp.float32))
    with pytest.raises(HyperparameterError, match="nonfinite='skip'"):
        jax.eval_shape(functools.partial(tx.update, **kw), g, state, params)
    if "check_finite" in inspect.signature(c.factory).parameters:
        old = c.build(params, check_finite=True)
        with pytest.raises(NonFiniteError, match=J.names(g)[-1]):
            old.update(_poison(g), state, params, **kw)


def test_nonfinite_raise_passes_finite_steps_through():
    """Under ``"raise"`` a finite step is the step of ``"ignore"``, bit for bit (eager)."""
    c = J.case("adamw")
    params = c.params()
    raising, plain = c.build(params, nonfinite="raise"), c.build(params)
    u1, s1 = raising.update(J.grads_like(params, 0), raising.init(params), params)
    u2, s2 = plain.update(J.grads_like(params, 0), plain.init(params), params)
    J.assert_bitwise((u1, s1), (u2, s2), "raise vs ignore")
