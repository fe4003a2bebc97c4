"""Every matrix product xopt's JAX layers trace is full float32 (``Precision.HIGHEST``).

XLA on a GPU multiplies float32 matrices in TF32 unless asked otherwise, about 1e-3
relative per product: the GPU run of 2026-11-22 (H100, jax 0.11.2) showed it, with the
POET-X and CompAct layers 2e-4..2e-3 from their golden traces before the layers asked for
full precision. A CPU cannot show TF32, so this test reads the compiled program instead:
every ``dot_general`` in the StableHLO of each public entry point (the optax updates, the
layers' forward and backward) must carry ``precision = [HIGHEST, HIGHEST]``. The optax
updates of every method are checked by tests/contract/test_optax_transforms.py. (POET-X's
``merge_and_reset`` runs eagerly and cannot be lowered; it carries the same wrapper, and
tests/test_poet.py checks on the GPU run that a merge keeps the layer's output.)
"""

from __future__ import annotations

import re

import pytest
from helpers import has_jax

pytestmark = pytest.mark.skipif(not has_jax, reason="jax/optax are not installed")


def _dots(lowered) -> list[str]:
    text = lowered.as_text()
    return [line for line in text.splitlines() if re.search(r"\bdot_general\b", line)]


def _assert_highest(lowered, what: str) -> None:
    dots = _dots(lowered)
    assert dots, f"{what}: no matrix product traced (the check would be vacuous)"
    loose = [d.strip()[:160] for d in dots if "HIGHEST, HIGHEST" not in d]
    assert not loose, f"{what}: {len(loose)} of {len(dots)} products not at full precision: " \
                      f"{loose[:3]}"


def test_compact_layer_is_full_precision():
    import jax
    import jax.numpy as jnp

    from xopt.jax.compact import CompActDense

    m = CompActDense(6, rank=0.5, seed=4)
    x = jnp.ones((2, 3, 8), jnp.float32)
    variables = m.init(jax.random.PRNGKey(1), x)

    def loss(p, xx):
        return jnp.sum(m.apply({"params": p, "compact": variables["compact"]}, xx) ** 2)

    _assert_highest(jax.jit(lambda xx: m.apply(variables, xx)).lower(x), "CompActDense")
    _assert_highest(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(variables["params"], x),
                    "CompActDense backward")


@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_poet_layer_and_merge_are_full_precision(variant):
    import jax
    import jax.numpy as jnp

    from xopt.jax.poet import POETDense

    m = POETDense(24, block_size=8, seed=11, variant=variant)
    x = jnp.ones((3, 16), jnp.float32)
    v = m.init(jax.random.PRNGKey(1), x)

    def loss(o, xx):
        return jnp.sum(m.apply({"params": {"oft_R": o}, "poet": v["poet"]}, xx) ** 2)

    _assert_highest(jax.jit(lambda xx: m.apply(v, xx)).lower(x), f"POETDense {variant}")
    _assert_highest(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(v["params"]["oft_R"], x),
                    f"POETDense {variant} backward")
