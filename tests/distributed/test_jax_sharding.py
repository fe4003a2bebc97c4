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
