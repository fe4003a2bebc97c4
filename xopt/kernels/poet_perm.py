"""POET-X's permutations as index gathers and scatters (Triton), never as matrices.

A permutation ``π`` of the feature axis is applied to the rows of a ``(N, D)`` activation
as ``out[n, k] = x[n, π[k]]`` (gather) or ``out[n, π[k]] = x[n, k]`` (scatter, the
gather's adjoint and inverse). The paper replaces permutation matrices by such index maps
(no extra memory, ~20× faster than a matmul by a permutation matrix) and keeps only two
of a layer's four permutations in the training loop: the other two live in ``W0``, re-laid
at each merge (:func:`xopt.specs.poet.merged_weight`).

Each program moves a ``BLOCK_N × BLOCK_D`` tile; the index slice is loaded once per tile.
Writes (gather) or reads (scatter) are contiguous along the feature axis; the other side
is a permuted read/write within the same row, which stays in L2 for the widths met in
LLMs (a 4096-wide bf16 row is 8 KB).

References: :func:`gather_reference` and :func:`scatter_reference` (``index_select`` and
``index_copy``); :class:`Permute` is the differentiable gather (its backward scatters).
Tested under ``TRITON_INTERPRET=1`` on the CPU (tests/test_poet.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["Permute", "gather", "gather_reference", "permute", "scatter", "scatter_reference"]


def gather_reference(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.index_select(-1, index.to(torch.int64))


def scatter_reference(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x).index_copy_(-1, index.to(torch.int64), x)


@triton.jit
def _perm_kernel(x_ptr, idx_ptr, out_ptr, N, D, s_x, s_o, SCATTER: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < N
    cmask = cols < D
    idx = tl.load(idx_ptr + cols, mask=cmask, other=0).to(tl.int64)
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)
    if SCATTER:
        v = tl.load(x_ptr + r64[:, None] * s_x + cols[None, :], mask=mask)
        tl.store(out_ptr + r64[:, None] * s_o + idx[None, :], v, mask=mask)
    else:
        v = tl.load(x_ptr + r64[:, None] * s_x + idx[None, :], mask=mask)
        tl.store(out_ptr + r64[:, None] * s_o + cols[None, :], v, mask=mask)


def _launch(x: torch.Tensor, index: torch.Tensor, scatter: bool) -> torch.Tensor:
    d = x.shape[-1]
    if index.shape != (d,):
        raise ValueError(f"xopt.kernels.poet_perm: index has shape {tuple(index.shape)}, "
                         f"expected ({d},) for an input of width {d}")
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[0]
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n and d:
        block_d = min(128, triton.next_power_of_2(d))
        block_n = 32
        grid = (triton.cdiv(n, block_n), triton.cdiv(d, block_d))
        _perm_kernel[grid](x2, index, out, n, d, x2.stride(0), out.stride(0), SCATTER=scatter,
                           BLOCK_N=block_n, BLOCK_D=block_d)
    return out.reshape(x.shape)


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[..., k] = x[..., index[k]]`` (``index``: int32/int64 of the last axis's length)."""
    return _launch(x, index, scatter=False)


def scatter(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[..., index[k]] = x[..., k]``: the inverse of :func:`gather` by a permutation."""
    return _launch(x, index, scatter=True)


class Permute(torch.autograd.Function):
    """``x[..., perm]`` whose backward scatters the cotangent back through ``perm``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(perm)
        return gather(x, perm)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (perm,) = ctx.saved_tensors
        return scatter(g, perm), None


def permute(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    return Permute.apply(x, perm)
