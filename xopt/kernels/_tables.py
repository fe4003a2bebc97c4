"""Kernels that reach many tensors through device tables of their addresses.

A launch over a list of tensors (an optimizer's parameters, moments, gradients) passes a
table of their addresses and one program per block of one tensor; :func:`block_map` lays
the programs out, :func:`at` is a program's block of consecutive entries. Shared by
:mod:`xopt.kernels.poet_adam` and :mod:`xopt.kernels.lowrank_adam`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xopt.kernels._grid import cdiv

__all__ = ["at", "block_map"]


@triton.jit
def at(ptr, offs, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """``ptr + offs`` (a block of ``BLOCK`` consecutive entries); ``ALIGNED``: said to start
    16-byte aligned (checked on the host), so that the accesses are vectorised (an address
    read from a table is not known to be)."""
    p = ptr + offs
    if ALIGNED:
        p = tl.max_contiguous(tl.multiple_of(p, [16]), [BLOCK])
    return p


def block_map(sizes: list[int], block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each program, the tensor it steps and its block within that tensor (int32, on
    the host): every tensor's ``ceil(size / block)`` blocks in turn, none for an empty one."""
    counts = torch.tensor([cdiv(n, block) for n in sizes], dtype=torch.int64)
    tensor = torch.repeat_interleave(torch.arange(len(sizes)), counts)
    start = torch.cumsum(counts, 0) - counts
    index = torch.arange(tensor.numel()) - start[tensor]
    return tensor.to(torch.int32), index.to(torch.int32)
