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

DECOMPOSING = ("galore", "plumage", "coap")
#: updates (by index) whose sharded result XLA's partitioning of the method's own math (not
#: a decomposition) leaves beyond 1e-6 of the unsharded one at these shapes: an expected
#: failure below, until it is explained and fixed
DIVERGING = {"flora": (0, 1, 2, 3, 4), "coap": (2,)}


@pytest.fixture(scope="module")
def compiled(jax_worker):
    memo: dict[tuple[str, bool], dict] = {}

    def get(case_id: str, owner_rule: bool = True) -> dict:
        if (case_id, owner_rule) not in memo:
            memo[case_id, owner_rule] = jax_worker.run(cases.compiled_collectives, case_id,
                                                       owner_rule)[0]
        return memo[case_id, owner_rule]

    return get


@pytest.mark.parametrize("case_id", JAX_SHARDED)
def test_the_compiled_update_communicates_within_its_methods_bound(compiled, case_id):
    """The compiled (SPMD-partitioned) HLO of a jitted update on 4 devices, matrices split
    by rows, traced under ``jax.set_mesh``: the collectives it holds and their bytes.

    Every method: no all-gather, all-to-all or reduce-scatter (no device receives a matrix
    it does not decompose). AdamW, the learned optimizers and Flora (statistics only):
    all-reduces only, each smaller than one device's shard of the smallest matrix. GaLore,
    PLUMAGE, COAP (a decomposition per matrix at refresh, on its owner): each matrix
    reaches its owner in collective permutes of its row blocks, one matrix's worth per
    matrix at most, and the factors come back in all-reduces each smaller than a matrix.
    Teacher-forced, each of 5 updates (refreshes among them) and its new state within
    1e-6 of the unsharded update from the same state (see DIVERGING)."""
    r = compiled(case_id)
    assert r["devices"] == 4, r
    d, matrices = r["devices"], r["matrix_bytes"]
    by_op: dict[str, list[int]] = {}
    for op, n in r["ops"]:
        by_op.setdefault(op, []).append(n)
    assert not by_op.get("all-gather") and not by_op.get("all-to-all") \
        and not by_op.get("reduce-scatter"), by_op
    if case_id in DECOMPOSING:
        permuted = by_op.get("collective-permute", [])
        assert len(permuted) == len(matrices) * (d - 1), by_op  # each matrix to its owner
        assert sum(permuted) <= sum(matrices), by_op  # one matrix's worth per matrix
        assert all(n < min(matrices) for n in by_op.get("all-reduce", [])), by_op
    else:
        assert set(by_op) <= {"all-reduce"}, by_op
        assert all(n < min(matrices) // d for n in by_op.get("all-reduce", [])), by_op
    for t, e in enumerate(r["teacher"]):
        if t not in DIVERGING.get(case_id, ()):
            assert e <= 1e-6, (t, r["teacher"])


@pytest.mark.parametrize("case_id", DECOMPOSING)
def test_without_the_owner_rule_xla_gathers_on_every_device(compiled, case_id):
    """What the owner rule replaces (and what the bound above would catch): traced without
    a mesh set, XLA all-gathers what it decomposes on every device: GaLore's and
    PLUMAGE's matrices whole; COAP's rank-r sketch ``G Ω``, whose distributed products
    (``Qᵀ G`` summed over the shards) then round differently from one device's, beyond
    1e-6 at its refreshes, where the owner rule, shipping the matrix, is exact."""
    r = compiled(case_id, False)
    gathered = sorted(n for op, n in r["ops"] if op == "all-gather")
    assert len(gathered) >= len(r["matrix_bytes"]), r["ops"]
    if case_id == "coap":
        assert max(gathered) < min(r["matrix_bytes"]), r["ops"]
        assert r["teacher"][0] > 1e-6 and compiled(case_id)["teacher"][0] == 0.0, r
    else:
        assert gathered[-len(r["matrix_bytes"]):] == sorted(r["matrix_bytes"]), r["ops"]
        assert max(r["teacher"]) <= 1e-6, r


@pytest.mark.parametrize("case_id", sorted(DIVERGING))
@pytest.mark.xfail(strict=True, reason=(
    "XLA's partitioning of Flora's update (its statistics and momentum) and of COAP's "
    "Eqn-6 projection step round beyond 1e-6 of the unsharded update at these shapes "
    "(up to 2e-5); not a decomposition: not explained yet"))
def test_sharded_updates_that_diverge(compiled, case_id):
    r = compiled(case_id)
    assert max(r["teacher"]) <= 1e-6, r["teacher"]
