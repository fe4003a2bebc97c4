"""A Flax (linen) model trains with every xopt optax transformation (cases:
``jax_cases.py``; CompAct and POET-X train their own layers), under one ``jit`` trace."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import has_jax

pytestmark = pytest.mark.skipif(not has_jax, reason="jax/optax/flax are not installed")

if has_jax:
    import jax
    import jax.numpy as jnp
    import optax
    from contract import jax_cases as J

    CASES = J.cases()
else:  # pragma: no cover
    CASES = ()


@pytest.mark.parametrize("c", CASES, ids=repr)
def test_flax_model_trains(c):
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
    traces = []

    @jax.jit
    def step(p, s):
        traces.append(1)  # runs only while tracing
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, s = tx.update(g, s, p, value=loss)
        return optax.apply_updates(p, u), s, loss

    state = tx.init(params)
    losses = []
    for _ in range(12):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert len(traces) == 1 and all(np.isfinite(losses))
    assert losses[-1] < losses[0], f"{c.id}: loss {losses[0]:.4g} -> {losses[-1]:.4g}"
