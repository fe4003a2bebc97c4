"""xopt.jax.sharding.init: every transformation's state placed with the parameters'
sharding on 4 host devices (in a child process: the device count is fixed when jax is
imported), equal to the unsharded init, and a jitted update from it equal to the unsharded
one."""

from __future__ import annotations

import pytest
import sharding_cases as cases

JAX_SHARDED = cases.JAX_SHARDED


@pytest.fixture(scope="module")
def case_ids(jax_worker):
    return jax_worker.run(cases.cases_without_extra)[0]


def test_every_transformation_without_model_inputs_is_covered(case_ids):
    assert set(JAX_SHARDED) <= set(case_ids)


@pytest.mark.parametrize("case_id", JAX_SHARDED)
def test_init_places_state_as_the_parameters(jax_worker, case_id):
    r = jax_worker.run(cases.sharded_init, case_id)[0]
    assert r["devices"] == 4 and r["on_every_device"], r
    assert r["moments_split"], r  # every leaf of the matrix's shape is split as it is
    if case_id in ("adamw", "small_fc_lopt", "velo", "mulo"):  # moments of that shape
        assert r["moments"] >= 2, r
    assert r["same_values"], r
    assert r["update_max_rel"] <= 1e-6, r


# -- the collectives of a compiled update, bounded per method ----------------------------------

#: the methods whose refreshes decompose whole matrices (on their owners)
OWNED = ("galore", "plumage")
RANK = 2  # the contract cases' rank


@pytest.fixture(scope="module")
def compiled(jax_worker):
    memo: dict[tuple[str, bool], dict] = {}

    def get(case_id: str, tracing: str = "placed") -> dict:
        if (case_id, tracing) not in memo:
            memo[case_id, tracing] = jax_worker.run(cases.compiled_collectives, case_id,
                                                    tracing)[0]
        return memo[case_id, tracing]

    return get


def _bounded():
    # the owner rule is the same code whichever way it finds the mesh: the methods it
    # concerns are also traced inside jax.set_mesh; the others are traced once
    return [pytest.param(c, t, id=f"{c}-{t}") for c in JAX_SHARDED
            for t in (("placed", "set_mesh") if c in OWNED else ("placed",))]


@pytest.mark.parametrize("case_id, tracing", _bounded())
def test_the_compiled_update_communicates_within_its_methods_bound(compiled, case_id,
                                                                     tracing):
    """The compiled (SPMD-partitioned) HLO of a jitted update on 4 devices, matrices split
    by rows: the collectives it holds and their bytes. Traced with the parameters and
    gradients placed with ``NamedSharding`` and no context (``placed``: the owner rule
    takes the mesh from the arrays' shardings), and for the methods with decompositions
    also inside ``jax.set_mesh`` (``set_mesh``).

    AdamW, the learned optimizers and Flora (statistics only): all-reduces only, each
    smaller than one device's shard of the smallest matrix. GaLore and PLUMAGE (an SVD per
    matrix at refresh, on its owner): no all-gather; each matrix reaches its owner in
    collective permutes of its row blocks, one matrix's worth per matrix at most, and the
    factors come back in all-reduces each smaller than a matrix. COAP (Eqn 7 on its
    rank-r sketch): every all-gather is of a sketch (at most max(m, n) × r), never a
    matrix; no permutes. Teacher-forced, each of 5 updates (refreshes among them) gives
    parameters and state within 1e-6 of the unsharded update from the same state
    (parameters, not updates: an update computed as new − old, as Flora's and COAP's,
    carries the old parameter's rounding, 1e-5 of the update for one ulp of the new)."""
    r = compiled(case_id, tracing)
    assert r["devices"] == 4, r
    d, matrices = r["devices"], r["matrix_bytes"]
    by_op: dict[str, list[int]] = {}
    for op, n in r["ops"]:
        by_op.setdefault(op, []).append(n)
    assert not by_op.get("all-to-all") and not by_op.get("reduce-scatter"), by_op
    if case_id in OWNED:
        assert not by_op.get("all-gather"), by_op
        permuted = by_op.get("collective-permute", [])
        assert len(permuted) == len(matrices) * (d - 1), by_op  # each matrix to its owner
        assert sum(permuted) <= sum(matrices), by_op  # one matrix's worth per matrix
        assert all(n < min(matrices) for n in by_op.get("all-reduce", [])), by_op
    elif case_id == "coap":
        sketch = 4 * RANK * max(max(s) for s in cases.HLO_SHAPES.values())
        assert by_op.get("all-gather") and max(by_op["all-gather"]) <= sketch, by_op
        assert not by_op.get("collective-permute"), by_op
        assert all(n < min(matrices) for n in by_op.get("all-reduce", [])), by_op
    else:
        assert set(by_op) <= {"all-reduce"}, by_op
        assert all(n < min(matrices) // d for n in by_op.get("all-reduce", [])), by_op
    assert max(r["teacher"]) <= 1e-6, r["teacher"]


@pytest.mark.parametrize("case_id", OWNED)
def test_without_the_owner_rule_xla_gathers_every_matrix_on_every_device(compiled, case_id):
    """What the owner rule replaces (and what the bound above would catch): traced under
    ``xopt.jax.sharding.owner_rule(False)``, XLA all-gathers each matrix GaLore and PLUMAGE
    decompose, whole, on every device (and every device decomposes it); the results are
    the same."""
    r = compiled(case_id, "off")
    gathered = sorted(n for op, n in r["ops"] if op == "all-gather")
    assert gathered[-len(r["matrix_bytes"]):] == sorted(r["matrix_bytes"]), r["ops"]
    assert max(r["teacher"]) <= 1e-6, r


def test_the_owner_rule_stands_aside_inside_a_users_shard_map(jax_worker):
    """Inside ``shard_map`` the arrays' mesh has manual axes: each device holds its own
    blocks, and a decomposition runs on them as the caller asked (no owner exchange,
    which would mistake the blocks for the matrix)."""
    assert jax_worker.run(cases.inside_shard_map, "galore")[0] <= 1e-6
