"""POET-X's merges by owner on 2 gloo ranks (issue 25): each layer's merge is computed
on one rank (layers assigned by ``W0`` size) and its result sent to the others, bit for bit
the one-process merge, under FSDP2 (shards gathered to the owner, blocks scattered back)
and DDP (results broadcast), for POET-X and POET-XQ; the bytes each rank hands to the
collectives (``CommCounter``) are exactly what that exchange needs."""

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
