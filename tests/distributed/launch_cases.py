"""Rank-side functions of tests/distributed/test_launch.py."""

from __future__ import annotations

import faulthandler
import os
import signal

import torch
import torch.distributed as dist


def rank_and_size(offset: int = 0) -> tuple[int, int]:
    return dist.get_rank() + offset, dist.get_world_size()


def all_reduce_sum(x: float) -> float:
    t = torch.tensor([x])
    dist.all_reduce(t)
    return float(t)


def raise_on(rank: int, message: str) -> None:
    """Rank ``rank`` raises; the others wait in a collective that can never complete."""
    if dist.get_rank() == rank:
        raise ValueError(message)
    dist.barrier()


def die_on(rank: int) -> None:
    """Rank ``rank``'s process exits without a word; the others wait in a collective."""
    if dist.get_rank() == rank:
        os._exit(3)
    dist.barrier()


def crash_on(rank: int) -> None:
    """Rank ``rank``'s process is killed by SIGSEGV, as by a crash in native code."""
    if dist.get_rank() == rank:
        faulthandler.disable()  # no stack dump: the signal is the test's own
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def pid() -> int:
    return os.getpid()


def environment(name: str) -> str | None:
    return os.environ.get(name)
