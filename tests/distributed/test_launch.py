"""xopt.torch.launch: N ranks as one process group, kept between calls; a failure on one
rank fails the call with that rank's traceback instead of leaving the others waiting."""

from __future__ import annotations

import launch_cases as cases
import pytest

from xopt.torch.launch import Gang, RankError


def test_every_rank_runs_and_results_come_in_rank_order(gang):
    assert gang.run(cases.rank_and_size, 10) == [(10, 2), (11, 2)]
    assert gang.run(cases.all_reduce_sum, 1.5) == [3.0, 3.0]
    calls = [((5.0,), {}), ((-1.0,), {})]
    assert gang.run_per_rank(cases.all_reduce_sum, calls) == [4.0, 4.0]


def test_the_processes_stay_between_calls(gang):
    assert gang.run(cases.pid) == gang.run(cases.pid)


@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_that_raises_fails_the_call_with_its_traceback(gang, failing):
    """The other rank waits in a barrier that will never complete: the call must still
    return, with the failing rank's exception and traceback."""
    with pytest.raises(RankError) as info:
        gang.run(cases.raise_on, failing, "bad input on one rank")
    err = info.value
    assert err.rank == failing and err.exc_type == "ValueError"
    assert err.exc_message == "bad input on one rank"
    assert "raise ValueError(message)" in str(err)  # the rank's traceback
    assert gang.run(cases.rank_and_size) == [(0, 2), (1, 2)]  # a fresh gang next time


def test_a_rank_that_dies_fails_the_call(gang):
    before = gang.run(cases.pid)
    with pytest.raises(RankError, match="rank 1 of 2 died .*exit code 3") as info:
        gang.run(cases.die_on, 1)
    assert info.value.rank == 1 and info.value.exc_type is None
    after = gang.run(cases.pid)
    assert not set(before) & set(after)


def test_arguments_checked_before_anything_runs(gang):
    def nested():
        return 0

    with pytest.raises(ValueError, match="module-level"):
        gang.run(nested)
    with pytest.raises(ValueError, match="2 ranks"):
        gang.run_per_rank(cases.pid, [((), {})])
    with pytest.raises(ValueError, match="at least 1"):
        Gang(0)


def test_workers_get_the_environment_without_a_process_group():
    with Gang(1, None, env={"XOPT_LAUNCH_TEST": "yes"}) as g:
        assert g.run(cases.environment, "XOPT_LAUNCH_TEST") == ["yes"]
        assert g.run(cases.environment, "OMP_NUM_THREADS") == ["1"]
