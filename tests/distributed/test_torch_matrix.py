"""The distributed support matrix in PyTorch: every optimizer and layer under DDP, FSDP2
(DTensor parameters) and DCP (with resharding 2 -> 1 -> 2), on 2 gloo ranks, against one
process on the same global batch.

Bounds (issue 25): teacher-forced, one step's max relative error at most 1e-6; closed loop
at most 1e-5; a DCP load bit for bit. A cell that does not work yet is an expected failure
for a stated reason (known.py) and turns into a failure once it works, so that its entry is
removed. docs/distributed.md's support table names these tests.
"""

from __future__ import annotations

from pathlib import Path

import matrix_cases as cases
import pytest
from known import KNOWN, expect, marks
from sharding_cases import JAX_SHARDED

from xopt.parity.distributed_layers import LAYER_METHODS

TEACHER, CLOSED = 1e-6, 1e-5


def _cells(cell: str) -> list:
    return [pytest.param(m, marks=marks(cell, m), id=m) for m in cases.METHODS]


def _check_training(r: dict) -> None:
    assert r["ranks_agree"], f"the ranks disagree (their parameters or state differ): {r}"
    assert r["teacher"][0] <= TEACHER, f"teacher-forced {r['teacher']}"
    assert r["closed"][0] <= CLOSED, f"closed loop {r['closed']}"


@pytest.mark.parametrize("method", _cells("ddp"))
def test_ddp(gang, method):
    with expect("ddp", method):
        for r in gang.run(cases.train, method, "ddp"):
            _check_training(r)


@pytest.mark.parametrize("method", _cells("fsdp2"))
def test_fsdp2(gang, method):
    with expect("fsdp2", method):
        for r in gang.run(cases.train, method, "fsdp2"):
            _check_training(r)


def _check_round_trip(results: list[dict]) -> None:
    for r in results:
        assert r["before_save"][0] <= CLOSED, f"before saving: {r['before_save']}"
    at1 = results[0]  # rank 0 alone loaded the 2-rank checkpoint
    assert at1["load_at_1"][0] == 0.0, f"not bit-exact: {at1['load_at_1']}"
    assert at1["step_at_1"][0] <= CLOSED, f"after loading on 1 rank: {at1['step_at_1']}"
    for r in results:
        assert r["load_at_2"][0] == 0.0, f"not bit-exact: {r['load_at_2']}"
        assert r["step_at_2"][0] <= CLOSED, f"after the round trip: {r['step_at_2']}"


@pytest.mark.parametrize("method", _cells("dcp_fsdp2"))
def test_dcp_resharding_fsdp2(gang, method, tmp_path):
    """State sharded as the parameters: saved on 2 ranks, loaded on 1, back on 2."""
    with expect("dcp_fsdp2", method):
        _check_round_trip(gang.run(cases.dcp_round_trip, method, "fsdp2", str(tmp_path)))


@pytest.mark.parametrize("method", _cells("dcp_ddp"))
def test_dcp_resharding_ddp(gang, method, tmp_path):
    """Replicated state (DDP): saved on 2 ranks, loaded on 1, back on 2."""
    with expect("dcp_ddp", method):
        _check_round_trip(gang.run(cases.dcp_round_trip, method, "ddp", str(tmp_path)))


# -- bad input: one clear error on every rank, no rank left waiting ----------------------------
# (a rank that waits in a collective forever exits after matrix_cases.HANG_AFTER seconds,
# which fails the test: a hang detector, not a bound on speed)


@pytest.mark.parametrize("saved, loaded, names", [
    ("sgd", "adamw", "Missing key in checkpoint state_dict: optim.state.0.weight.step"),
    ("galore", "adamw", "Size mismatch between saved torch.Size([9, 2]) and current: "
                        "torch.Size([9, 6]) for optim.state.0.weight.exp_avg"),
    ("adamw", "small_fc_lopt", "Missing key in checkpoint state_dict: optim.state.0.weight.m"),
    ("coap", "plumage", "Invalid checkpoint metadata for optim.state.0.weight.step"),
])
def test_dcp_checkpoint_of_another_optimizer_is_refused_on_every_rank(gang, tmp_path, saved,
                                                                      loaded, names):
    messages = gang.run(cases.dcp_from_another_optimizer, str(tmp_path), saved, loaded)
    for m in messages:  # every rank raises, naming the key at fault
        assert m.startswith("CheckpointException") and names in m, m


@pytest.mark.parametrize("case, names", [
    ("lr", "param_groups[0]['lr']"),
    ("params", "the number of parameters in param_groups[0]"),
])
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("method", ["adamw", "small_fc_lopt"])
def test_ranks_that_disagree_fail_on_every_rank(gang, method, mode, case, names):
    messages = gang.run(cases.disagreeing_ranks, mode, case, method)
    assert messages[0] == messages[1], messages
    name = {"adamw": "AdamW", "small_fc_lopt": "SmallFCLOpt"}[method]
    assert messages[0].startswith(f"RankMismatchError: {name}: the ranks disagree on "
                                  f"{names}"), messages[0]


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("method", cases.METHODS)
def test_a_hyperparameter_invalid_on_one_rank_fails_on_every_rank(gang, method, mode):
    """The step's validation and the ranks' agreement check are one decision: rank 1's
    invalid learning rate raises its own error, naming the rank, on both ranks."""
    messages = gang.run(cases.disagreeing_ranks, mode, "invalid", method)
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("HyperparameterError: "), messages[0]
    assert ".lr = nan: must be finite [on rank 1 of 2; raised on every rank]" in messages[0]


@pytest.mark.parametrize("policy", ["skip", "raise"])
@pytest.mark.parametrize("method", [m for m in cases.METHODS if ("fsdp2", m) not in KNOWN])
def test_a_nan_in_one_ranks_shard_skips_or_raises_on_every_rank(gang, method, policy):
    """FSDP2 leaves a NaN where it was: in one rank's shard. The flags of DTensor gradients
    are completed over the mesh, so as on one process every rank skips the step or raises,
    naming the tensor; no rank updates alone, none waits."""
    results = gang.run(cases.nonfinite_on_one_rank, "fsdp2", policy, method)
    for r in results:
        assert not r["changed"] and r["ranks_agree"], r
    if policy == "skip":
        for r in results:
            assert r["error"] == "no error" and r["skips"] and set(r["skips"]) == {1}, r
    else:
        assert results[0]["error"] == results[1]["error"], results
        assert results[0]["error"].startswith("NonFiniteError: "), results[0]
        assert "holds NaN or inf" in results[0]["error"], results[0]


def test_the_docs_table_is_this_matrix():
    """docs/distributed.md's support table: a row per method, and a cell marked working
    exactly when its test here is not an expected failure."""
    page = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
    rows = {}
    for line in page.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] in cases.METHODS:
            rows[cells[0]] = cells[1:]
    assert sorted(rows) == sorted(cases.METHODS)
    # the JAX column: test_jax_sharding.py's transformations, test_jax_layers.py's layers
    jax_cells = {m: "✓" for m in (*JAX_SHARDED, *LAYER_METHODS)}
    for method, cells in rows.items():
        for cell, mark in zip(("ddp", "fsdp2", "dcp_ddp", "dcp_fsdp2"), cells, strict=False):
            assert mark == ("✗" if (cell, method) in KNOWN else "✓"), (method, cell, mark)
        assert cells[4] == jax_cells.get(method, "—"), (method, "jax", cells[4])
