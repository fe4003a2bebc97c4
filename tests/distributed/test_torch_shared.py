"""The shared pieces of xopt.torch.distributed, on 2 gloo ranks: statistics on shards, state
placed as the parameter, the owner rule, the ranks' agreement check, the data-parallel
loss and PyLO's distributed step."""

from __future__ import annotations

import pytest
import shared_cases as cases
import torch

from xopt.torch.distributed import assign_owners

F64 = 8  # bytes


@pytest.mark.parametrize("shape, split, dims, reduced_sharded", [
    ((9, 5), 0, (1,), False),      # row sums of a row-sharded matrix: no communication
    ((9, 5), 0, (0,), True),       # column sums: one all-reduce of a row
    ((9, 5), 0, (0, 1), True),     # the scalar sum
    ((5, 9), 1, (0,), False),      # column-sharded, summed over rows
    ((9, 5, 3), 0, (0, 1), True),  # a trailing dimension (one per decay) kept
    ((3, 7, 2, 2), 1, (0, 2, 3), False),
    ((3, 7, 2, 2), 1, (1, 2), True),
])
def test_statistics_on_shards_are_completed_by_small_all_reduces(gang, shape, split, dims,
                                                                 reduced_sharded):
    """Uneven shards (9 rows on 2 ranks: 5 and 4). The complete sum and mean on every rank;
    the only collectives are all-reduces of the result's size, never a gather."""
    for r in gang.run(cases.layout_sums, shape, split, dims):
        assert r["sum_err"] < 1e-12 and r["mean_err"] < 1e-12, r
        if reduced_sharded:
            assert r["calls"] == {"allreduce_": 2}, r  # the sum and the mean
            assert r["largest"] == r["result_bytes"], r
        else:
            assert r["calls"] == {}, r


def test_state_is_created_with_the_parameters_placements(gang):
    for r in gang.run(cases.state_placements):
        # (global shape, local shape, placements, dtype, |sum|): 9 rows split 5 + 4
        assert r["trailing"][0] == (9, 5, 3) and r["trailing"][2] == ["S(0)"]
        assert r["drop_rows"][:3] == ((5, 3), (5, 3), ["R"])
        assert r["drop_cols"][0] == (9, 3) and r["drop_cols"][2] == ["S(0)"]
        assert r["scalar"][:3] == ((), (), ["R"])
        assert all(v[3] == "torch.float32" and v[4] == 0.0
                   for k, v in r.items() if k != "plain")
        assert r["plain"] == ((4, 3, 2), False)
    locals_ = [r["trailing"][1] for r in gang.run(cases.state_placements)]
    assert locals_ == [(5, 5, 3), (4, 5, 3)]


@pytest.mark.parametrize("sharded", [True, False], ids=["fsdp2", "ddp"])
def test_the_owner_rule_decomposes_each_matrix_once(gang, sharded):
    results = gang.run(cases.owner_svd, sharded)
    sizes = [9 * 6, 6 * 9, 8 * 8]
    owners = assign_owners([float(n) for n in sizes], 2)
    calls = sorted(i for r in results for i in r["calls"])
    assert calls == [0, 1, 2]  # once each, over both ranks
    for rank, r in enumerate(results):
        assert r["owners"] == owners
        assert r["calls"] == [i for i, o in enumerate(owners) if o == rank]
        assert r["errors"] == [0.0, 0.0, 0.0]  # the SVD of the whole matrix, bit for bit
        assert "allgather_" not in r["ops"] and "_allgather_base_" not in r["ops"]
        assert r["ops"]["broadcast_"] == 2  # the results, one buffer per owner
        if sharded:
            assert r["ops"]["alltoall_base_"] == 1
            # each rank sends each of its shards once (rows 5 + 4 of 9, 3 + 3 of 6, 4 + 4)
            mine = [(5, 4)[rank] * 6, (3, 3)[rank] * 9, (4, 4)[rank] * 8]
            assert r["bytes"]["alltoall_base_"] == 4 * sum(mine)
        else:
            assert "alltoall_base_" not in r["ops"]


def test_elementwise_updates_run_on_aligned_shards_bit_for_bit(gang):
    """xopt's AdamW under FSDP2 steps the local shards of the parameter, gradient and
    moments (one placement: the same elements), the DTensor step's bits; shards of other
    placements, or a plain tensor beside them, are not taken as aligned."""
    for r in gang.run(cases.aligned_shards):
        assert r["wrote"] and r["mixed"] and r["plain"]
        assert r["errs"] == [0.0] * 6


def test_the_owner_rule_can_be_turned_off_with_the_same_result(gang):
    """``owner_rule(False)``: every rank gathers each matrix and decomposes it itself (the
    baseline bench/distributed.py times the rule against); the parameters are the rule's,
    bit for bit (one SVD routine on the same whole matrix)."""
    on, off = gang.run(cases.galore_owner_rule, True), gang.run(cases.galore_owner_rule, False)
    for r_on, r_off in zip(on, off, strict=True):
        for a, b in zip(r_on["params"], r_off["params"], strict=True):
            assert torch.equal(a, b)
        assert r_on["ops"]["alltoall_base_"] == 2  # both matrices in one, 2 refreshes
        assert "alltoall_base_" not in r_off["ops"]
        assert "broadcast_" not in r_off["ops"]
        # a gather of each matrix at each refresh (GaLore's own step gathers nothing else)
        assert r_off["ops"].get("all_gather_into_tensor", 0) + r_off["ops"].get(
            "_allgather_base_", 0) + r_off["ops"].get("allgather_", 0) >= 4


@pytest.mark.parametrize("case, names", [
    ("lr", "param_groups[0]['lr']"),
    ("extra_param", "the number of parameters in param_groups[0]"),
    ("shape", "parameter param_groups[0]['params'][0] (shape, dtype, placements)"),
])
@pytest.mark.parametrize("sharded", [True, False], ids=["fsdp2", "ddp"])
def test_ranks_that_disagree_get_one_error_on_every_rank(gang, case, names, sharded):
    messages = gang.run(cases.disagreement, case, sharded)
    assert messages[0] == messages[1]  # the same error on both ranks, none left waiting
    assert f"the ranks disagree on {names}: rank 0 has" in messages[0]


def test_a_placement_disagreement_is_named(gang):
    messages = gang.run(cases.disagreement, "placement", True)
    assert messages[0] == messages[1]
    assert "(shape, dtype, placements)" in messages[0] and "Replicate" in messages[0]


def test_ranks_that_agree_pass_and_the_check_runs_once(gang):
    assert gang.run(cases.disagreement, "none", True) == ["no error"] * 2
    assert gang.run(cases.disagreement, "none", False) == ["no error"] * 2
    for first, again in gang.run(cases.agreement_is_cached):
        assert first > 0 and again == 0


def test_mean_loss_is_the_ranks_mean(gang):
    assert gang.run(cases.mean_of_losses) == [1.5, 1.5]


@pytest.mark.parametrize("method", ["adamw", "small_fc_lopt", "galore"])
def test_pylo_distributed_step_is_the_replicated_step(gang, method):
    for r in gang.run(cases.sharded_step, method):
        assert r["identical"], r
        assert r["stateful"] == [i for i, o in enumerate(r["owners"]) if o == r["rank"]]
        assert set(r["owners"]) == {0, 1}


def test_a_decomposition_that_fails_on_its_owner_raises_on_every_rank(gang):
    """A NaN in one rank's shard of a gradient: the SVD fails on the matrix's owner, and
    the other rank, which would wait for the factors, raises the same error (naming the
    parameter and the owner) from the status exchange before it; nothing changed."""
    results = gang.run(cases.failed_decomposition)
    assert results[0]["error"] is not None and results[0]["error"] == results[1]["error"]
    msg = results[0]["error"]
    assert "param_groups[0]['params'][0]" in msg and "of 2, its owner" in msg, msg
    assert "raised on every rank" in msg, msg
    assert all(r["unchanged"] and r["state"] == 0 for r in results), results
