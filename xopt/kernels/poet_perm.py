"""POET-X's permutations as index gathers and scatters (Triton), never as matrices.

A permutation ``π`` of the feature axis is applied to the rows of a ``(N, D)`` activation
as ``out[n, k] = x[n, π[k]]`` (gather) or ``out[n, π[k]] = x[n, k]`` (scatter, the
gather's adjoint and inverse). The paper replaces permutation matrices by such index maps
(no extra memory, ~20× faster than a matmul by a permutation matrix) and keeps only two
of a layer's four permutations in the training loop: the other two live in ``W0``, re-laid
at each merge (:func:`xopt.specs.poet.merged_weight`).

Kernels (``MODE``, a module attribute: ``"auto"``, ``"smem"``, ``"rowloop"``, ``"tiled"``
or ``"torch"`` for ``index_select``):

* ``"smem"``: each program reads whole rows coalesced, permutes them in shared memory
  (``tl.gather`` of a 1-d block, which Triton stages through shared memory; a 2-d
  ``[rows, width]`` block would be lowered to warp shuffles instead) and writes them
  coalesced: within a few percent of a copy's cost at 4096 wide, and the fastest mode at
  every width benchmarked. Rows up to :data:`SMEM_MAX_BYTES` (one row's block in shared
  memory); a launch the device refuses for lack of shared memory takes the rowloop kernel.
* ``"rowloop"``: each program owns a few whole rows and walks along them in column
  chunks; the permuted reads (``.ca``, cached in L1) fetch each 32-byte sector of a row
  from L2 once and serve the other elements of that sector from L1; the writes are
  coalesced. Scatters gather by the inverse permutation (both modes).
* ``"tiled"``: ``BLOCK_N × BLOCK_D`` tiles spread over the GPU; each 2-byte permuted
  element costs a 32-byte sector from L2, since the other elements of the sector are
  read by other programs (several times a copy's cost; kept for comparison).
* ``"auto"`` (default): ``"smem"`` for rows up to :data:`SMEM_MAX_BYTES`, else
  ``"rowloop"``: a fixed rule, not a timing at first use (back-to-back calls time the
  host's launches, not the GPU, and would pick the wrong kernel).

References: :func:`gather_reference` and :func:`scatter_reference` (``index_select`` and
``index_copy``); :class:`Permute` is the differentiable gather (its backward scatters).
Tested under ``TRITON_INTERPRET=1`` on the CPU (tests/test_poet.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from xopt.kernels import FP_FUSION
from xopt.kernels._grid import cdiv, next_pow2
from xopt.kernels.poet_jit import launch

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


MODE = "auto"


@triton.jit
def _perm_rowloop_kernel(x_ptr, idx_ptr, out_ptr, N, D, s_x, s_o, ROWS: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    # out[r, k] = x[r, idx[k]] for ROWS whole rows, chunk by chunk along the row: the
    # rows' sectors come from L2 once and stay in this SM's L1 for the later chunks.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < N
    r64 = rows.to(tl.int64)
    for c0 in range(0, D, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        cmask = cols < D
        mask = rmask[:, None] & cmask[None, :]
        idx = tl.load(idx_ptr + cols, mask=cmask, other=0).to(tl.int64)
        v = tl.load(x_ptr + r64[:, None] * s_x + idx[None, :], mask=mask,
                    cache_modifier=".ca")
        tl.store(out_ptr + r64[:, None] * s_o + cols[None, :], v, mask=mask)


@triton.jit
def _perm_smem_kernel(x_ptr, idx_ptr, out_ptr, N, D, s_x, s_o, ROWS: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    # out[r, k] = x[r, idx[k]] for ROWS whole rows, one after the other: each row read and
    # written coalesced, permuted in shared memory (tl.gather of a 1-d block; Triton
    # stages it through shared memory, BLOCK_D elements); idx loaded once per program.
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    idx = tl.load(idx_ptr + cols, mask=cmask, other=0)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        r64 = row.to(tl.int64)
        mask = cols < tl.where(row < N, D, 0)  # (a row past N: nothing)
        v = tl.load(x_ptr + r64 * s_x + cols, mask=mask, other=0.0)
        tl.store(out_ptr + r64 * s_o + cols, tl.gather(v, idx, 0), mask=mask)


#: smem launch parameters (``None``: the defaults in :func:`_smem_launch`)
SMEM: dict = {"rows": None, "warps": None}
#: the widest row (its power-of-2 block, in bytes) that ``"auto"`` permutes in shared
#: memory: 64 KiB (e.g. 32768 bf16 or 16384 float32 columns), under a third of an H100
#: SM's 228 KiB
SMEM_MAX_BYTES = 64 * 1024


#: (block, dtype, warps, device) of smem launches the device refused for lack of shared
#: memory: those take the rowloop kernel
_SMEM_REFUSED: set = set()


def _smem_launch(x2: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    n, d = x2.shape
    block_d = max(16, next_pow2(d))
    # one row per program (more rows per program are not faster); 4 warps up to 2048
    # columns, 8 for 4096, then one warp per 1024 columns up to 16: the fastest counts on
    # H100 and H200
    rows = SMEM["rows"] or 1
    warps = SMEM["warps"] or max(4, min(16, block_d // 1024 if block_d > 4096
                                        else block_d // 512))
    key = (block_d, x2.dtype, warps, x2.device)
    if key not in _SMEM_REFUSED:
        try:
            launch(_perm_smem_kernel, (cdiv(n, rows),), x2, index, out, n, d, x2.stride(0),
                   out.stride(0), ROWS=rows, BLOCK_D=block_d, num_warps=warps, **FP_FUSION)
            return
        except OutOfResources:  # a GPU with less shared memory per block than the row needs
            _SMEM_REFUSED.add(key)
    _rowloop_launch(x2, index, out)


#: rowloop launch parameters: ``None`` = the defaults below; set for tuning
ROWLOOP: dict = {"rows": None, "block_d": None, "warps": None}


def _rowloop_launch(x2: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    n, d = x2.shape
    row_bytes = d * x2.element_size()
    # one row per program for rows of 8 KB and more, walked in chunks of up to 8192
    # columns, 4 warps for chunks up to 4096 columns, else 8: the fastest of 1-2 rows,
    # 2048-16384-column chunks and 4-16 warps on an H100
    rows = ROWLOOP["rows"] or max(1, min(4, 8192 // row_bytes))
    block_d = ROWLOOP["block_d"] or max(16, min(next_pow2(d), 8192))
    warps = ROWLOOP["warps"] or (4 if block_d <= 4096 else 8)
    launch(_perm_rowloop_kernel, (cdiv(n, rows),), x2, index, out, n, d, x2.stride(0),
           out.stride(0), ROWS=rows, BLOCK_D=block_d, num_warps=warps, **FP_FUSION)


def _tiled_launch(x2: torch.Tensor, index: torch.Tensor, out: torch.Tensor,
                  scatter: bool) -> None:
    n, d = x2.shape
    block_d = min(128, next_pow2(d))
    block_n = 32
    grid = (cdiv(n, block_n), cdiv(d, block_d))
    launch(_perm_kernel, grid, x2, index, out, n, d, x2.stride(0), out.stride(0),
           SCATTER=scatter, BLOCK_N=block_n, BLOCK_D=block_d, **FP_FUSION)


def _inverse(index: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(index)
    inv[index.long()] = torch.arange(index.shape[0], dtype=index.dtype, device=index.device)
    return inv


def _run(mode: str, x2: torch.Tensor, index: torch.Tensor, out: torch.Tensor,
         scatter: bool) -> None:
    if mode == "torch":
        idx = index.to(torch.int64)
        if scatter:
            out.index_copy_(-1, idx, x2)
        else:
            torch.index_select(x2, -1, idx, out=out)
    elif mode == "rowloop":
        _rowloop_launch(x2, _inverse(index) if scatter else index, out)
    elif mode == "smem":
        _smem_launch(x2, _inverse(index) if scatter else index, out)
    else:
        _tiled_launch(x2, index, out, scatter)


def _auto_mode(d: int, element_size: int) -> str:
    return "smem" if max(16, next_pow2(d)) * element_size <= SMEM_MAX_BYTES else "rowloop"


def _launch(x: torch.Tensor, index: torch.Tensor, scatter: bool,
            out: torch.Tensor | None = None) -> torch.Tensor:
    d = x.shape[-1]
    if index.shape != (d,):
        raise ValueError(f"xopt.kernels.poet_perm: index has shape {tuple(index.shape)}, "
                         f"expected ({d},) for an input of width {d}")
    flat = x.dim() == 2  # (no reshape calls for the layer's 2-d activations)
    x2 = x if flat else x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[0]
    given = out is not None
    if out is None:
        out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    elif (out.shape != (n, d) or out.dtype != x.dtype or out.device != x.device
          or not out.is_contiguous()):
        raise ValueError(f"xopt.kernels.poet_perm: out must be a contiguous {(n, d)} "
                         f"{x.dtype} tensor on {x.device}; got {tuple(out.shape)} {out.dtype}")
    if n and d:
        _run(_auto_mode(d, x2.element_size()) if MODE == "auto" else MODE, x2, index, out,
             scatter)
    return out if flat or given else out.reshape(x.shape)


def gather(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None,
           ) -> torch.Tensor:
    """``out[..., k] = x[..., index[k]]`` (``index``: int32/int64 of the last axis's length).
    ``out``: a contiguous ``(rows, width)`` tensor to write into (then returned as it is)."""
    return _launch(x, index, scatter=False, out=out)


def scatter(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[..., index[k]] = x[..., k]``: the inverse of :func:`gather` by a permutation.
    (The rowloop kernel gathers by the inverse, computed here; pass inverses to
    :func:`gather` where they are at hand.)"""
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
