"""POET-X's merges by owner on 2 gloo ranks (issue 25): each layer's merge is computed
on one rank (layers assigned by ``W0`` size) and its result sent to the others, bit for bit
the one-process merge, under FSDP2 (shards gathered to the owner, blocks scattered back)
and DDP (results broadcast), for POET-X and POET-XQ; the bytes each rank hands to the
collectives (``CommCounter``) are exactly what that exchange needs. A merge that raises
on its owner raises the same error on every rank, naming the layer, with nothing
changed."""

from __future__ import annotations

import merge_cases as cases
import pytest


@pytest.mark.parametrize("quantized", [False, True], ids=["poet", "poet_xq"])
@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
def test_each_layer_is_merged_once_and_every_rank_gets_the_one_process_result(
        gang, mode, quantized):
    results = gang.run(cases.merge, mode, quantized)
    for r in results:
        assert r["differ"] == [], r  # every parameter and buffer, bit for bit
        assert r["unmoved"] == [], r  # (the merge changed every W0)
        assert r["bytes"] == r["expect"], r
    # each layer's merge computed on exactly one rank, and not all on the same one
    assert sum(r["computed"] for r in results) == len(cases.SHAPES), results
    assert all(r["computed"] > 0 for r in results), results


@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
def test_a_merge_that_fails_on_its_owner_raises_on_every_rank_and_changes_nothing(gang,
                                                                                  mode):
    """The owner's merge raises; the other rank, which would wait for its result in the
    following collective, gets the same error from the status exchange before it (the
    gang's ranks return, so none hung)."""
    results = gang.run(cases.failed_merge, mode)
    assert results[0]["error"] is not None and results[0]["error"] == results[1]["error"]
    owner = results[0]["owner"]
    assert results[0]["error"].startswith("1: FloatingPointError: oft_R is not finite "
                                          f"[computed on rank {owner} of 2, its owner")
    assert all(r["changed"] == [] for r in results), results
