"""The JAX low-rank transformations put a group's refreshes in one conditional.

GaLore's and PLUMAGE's refreshes and Flora's momentum transfers sit in one ``lax.switch``
per group of leaves with one shape, dtype and setting (``switch_grouped``); COAP's
projected steps run once per group under ``jax.vmap`` (``map_grouped``). Checked here:
the grouped updates and states are the per-leaf path's bit for bit, and the traced
program's conditionals do not grow with the number of same-shaped leaves.
"""

from __future__ import annotations

import importlib
import textwrap

import pytest
from helpers import fma_free_jax_child, needs_x86
from helpers import jax_block_model as _model

jax = pytest.importorskip("jax")

METHODS = ("galore", "coap", "plumage", "flora")

# small settings that refresh within three steps (GaLore: SVDs at t = 0, 2; COAP: the
# first decomposition, Eqn 6, Eqn 7; PLUMAGE: SVDs at t = 0, 2, resamples at every t)
SETTINGS = {
    "galore": dict(rank=4, update_proj_gap=2, weight_decay=0.01),
    "coap": dict(rank=4, update_interval=1, reproject_factor=2, weight_decay=0.01),
    "plumage": dict(rank=4, update_proj_gap=2, resample_interval=1, weight_decay=0.01),
    # a momentum transfer at t = 2
    "flora": dict(learning_rate=1e-3, rank=4, kappa=2, beta1=0.9, weight_decay=0.01),
}




def _conds(jaxpr: jax.extend.core.Jaxpr) -> int:
    """Conditionals (``lax.cond``/``lax.switch``) in ``jaxpr`` and its sub-jaxprs (cond
    branches, nested jits)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "cond"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _conds(sub)
    return n


def _count(method: str, k: int, per_leaf: bool, monkeypatch: pytest.MonkeyPatch) -> int:
    mod = importlib.import_module(f"xopt.jax.{method}")
    with monkeypatch.context() as m:
        if per_leaf:
            m.setattr(mod, "group_key", lambda *a, **kw: None)
        tx = getattr(mod, method)(**SETTINGS[method])
        params = _model(k)
        state = tx.init(params)
        closed = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(params, state, params)
    return _conds(closed.jaxpr)


@pytest.mark.parametrize("method", METHODS)
def test_traced_conds_do_not_grow_with_same_shaped_leaves(
        method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # (from 2 blocks on: a model with a group of several leaves also traces the one cond
    # that gives the unstacking its runtime positions, _lowrank.runtime_positions)
    two, four = _count(method, 2, False, monkeypatch), _count(method, 4, False, monkeypatch)
    assert two > 0
    assert four == two, f"{method}: {two} conditionals for 2 blocks, {four} for 4"
    # the per-leaf path (what the grouping replaces) grows: the count can tell them apart
    assert _count(method, 4, True, monkeypatch) > four


# Run in a child process with XLA's CPU code generation capped at SSE4.2: with FMA
# available, XLA contracts a*b + c into an FMA or not depending on how it fused the
# program, so two programs of the same operations may differ in the last bit.
_CHILD = textwrap.dedent("""
    import importlib, json, sys
    import jax, numpy as np, optax
    sys.path.insert(0, sys.argv[1])
    from tests.test_jax_lowrank_batched import SETTINGS, _model

    def run(method, per_leaf, extra):
        mod = importlib.import_module(f"xopt.jax.{method}")
        grouped = mod.group_key
        if per_leaf:
            mod.group_key = lambda *a, **kw: None
        try:
            tx = getattr(mod, method)(**dict(SETTINGS[method], **extra))
            params = _model(3)
            state = tx.init(params)
            step = jax.jit(lambda g, s, p: tx.update(g, s, p))
            rng = np.random.default_rng(1)
            out = []
            for _ in range(3):
                g = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype),
                                 params)
                u, state = step(g, state, params)
                params = optax.apply_updates(params, u)
                out.append((u, state))
            return out
        finally:
            mod.group_key = grouped

    from xopt.specs import galore as galore_spec
    h = galore_spec.SPEC.make(None, **SETTINGS["galore"])
    cases = {
        "galore": {},
        # leaves of one shape with settings of their own: groups of their own
        "galore/param_specs": {"param_specs": {"blk0/w1": h.replace(project=False),
                                               "blk1/w2": h.replace(rank=2)}},
        "coap": {},
        "coap/adafactor+schedule": {"optimizer": "adafactor", "b1": 0.9,
                                    "learning_rate": optax.linear_schedule(1e-3, 1e-4, 3)},
        "plumage": {},
        "flora": {},
    }
    report = {}
    for case, extra in cases.items():
        method = case.split("/")[0]
        a, b = run(method, True, extra), run(method, False, extra)
        la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
        assert jax.tree.structure(a) == jax.tree.structure(b), case
        report[case] = {"leaves": len(la), "differing": sum(
            not np.array_equal(np.asarray(x), np.asarray(y)) or x.dtype != y.dtype
            for x, y in zip(la, lb))}
    print(json.dumps(report))
""")


@needs_x86
def test_grouped_updates_and_states_are_the_per_leaf_paths_bit_for_bit() -> None:
    report = fma_free_jax_child(_CHILD)
    assert set(report) >= set(METHODS)
    for case, r in report.items():
        assert r["leaves"] > 0 and r["differing"] == 0, (case, r)
