"""xopt.torch.launch: N ranks as one process group, kept between calls; a failure on one
rank fails the call with that rank's traceback instead of leaving the others waiting."""

from __future__ import annotations

import re
import subprocess
import sys

import launch_cases as cases
import pytest
from helpers import NATIVE_CRASH, NativeCrash, check_exit

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


def _reruns(exc: BaseException) -> bool:
    """Whether pytest-rerunfailures' ``only_rerun`` (tests/conftest.py) reruns after
    ``exc``: it searches these patterns in ``"<type name>: <message>"``."""
    return any(re.search(p, f"{type(exc).__name__}: {exc}") for p in NATIVE_CRASH)


def test_only_a_rank_killed_by_a_signal_counts_as_a_native_crash(gang):
    with pytest.raises(RankError, match="rank 0 of 2 died .*exit code -11") as crashed:
        gang.run(cases.crash_on, 0)
    with pytest.raises(RankError) as exited:
        gang.run(cases.die_on, 0)
    with pytest.raises(RankError) as raised:
        gang.run(cases.raise_on, 0, "a failed check")
    assert _reruns(crashed.value)
    assert not _reruns(exited.value) and not _reruns(raised.value)


def test_a_child_killed_by_a_signal_is_a_native_crash_and_a_failing_one_is_not():
    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)

    check_exit(run("pass"))
    with pytest.raises(NativeCrash, match="SIGABRT") as aborted:
        check_exit(run("import os; os.abort()"))
    with pytest.raises(AssertionError, match="exit code 1") as failed:
        check_exit(run("raise SystemExit('a failed check')"))
    # torchrun: exit code 1, and the rank it lost to a signal in its summary
    lost = run("import sys; sys.stderr.write('traceback : Signal 6 (SIGABRT) received by "
               "PID 42'); sys.exit(1)")
    with pytest.raises(NativeCrash, match="SIGABRT") as torchrun:
        check_exit(lost)
    assert _reruns(aborted.value) and _reruns(torchrun.value)
    assert type(failed.value) is AssertionError and not _reruns(failed.value)


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
