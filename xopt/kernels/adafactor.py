"""Flora's factored Adafactor step on a stack of same-shaped matrices in three passes
(Triton), for Flora without momentum (the authors' default, ``beta1=None``).

The torch path (``xopt.torch.flora.Flora._adafactor_run``) moves every matrix through
about a dozen elementwise kernels and reductions (``g²``, ``+ ε₀``, two means, the
outer product of the row and column factors, its product with ``g``, the update's norm,
the clip division, the learning rate, the subtraction). Here:

1. :func:`stats`: per matrix, the row sums and (per tile of rows) the column sums of
   ``g² + ε₀``, and the sum of ``x²``; the means, the moving averages and their rsqrt
   stay in torch (vectors);
2. :func:`update_sumsq`: ``Σ u²`` of ``u = (r_i · c_j) · g``, recomputed, not stored;
3. :func:`apply`: ``x − (u / s) · η`` with ``u`` recomputed, per matrix ``s`` (the clip
   divisor) and ``η`` (the learning rate).

Every elementwise value is the torch path's operation in its order (``g·g + ε₀``,
``(r·c)·g``, a correctly rounded division ``div_rn``, then ``· η`` and ``x −``; launched
with :data:`xopt.kernels.NO_FP_FUSION`, no contraction); the sums add in another order
than torch's reductions, so the results agree with the torch path to float32 rounding,
as its batched and per-parameter steps do. Tested under ``TRITON_INTERPRET=1``
(tests/test_flora_adafactor.py).

:data:`BACKEND` (environment ``XOPT_ADAFACTOR``, read at import): ``"auto"`` (the
default: CUDA tensors; checked on an H200 against the torch path by
tests/test_flora_adafactor.py), ``"torch"`` (never) or ``"triton"`` (every tensor: the
interpreter on a CPU).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from xopt.kernels import NO_FP_FUSION
from xopt.kernels._grid import cdiv

__all__ = ["BACKEND", "apply", "runs_on", "stats", "update_sumsq"]

#: where these passes replace the torch path: "torch" (never), "auto" (CUDA tensors) or
#: "triton" (every tensor)
BACKEND = os.environ.get("XOPT_ADAFACTOR", "auto")

#: rows per program, columns per inner step: 32 × 128 floats per tile at 4 warps
_BM, _BN, _WARPS = 32, 128, 4


def runs_on(device: torch.device) -> bool:
    """Whether these passes are the step's path for tensors on ``device``."""
    if BACKEND not in ("auto", "triton", "torch"):
        raise ValueError(f"XOPT_ADAFACTOR = {BACKEND!r}; known: 'auto', 'triton', 'torch'")
    return BACKEND == "triton" or (BACKEND == "auto" and device.type == "cuda")


@triton.jit
def _row_tile(M, BM: tl.constexpr):
    """This program's matrix ``b`` (grid axis 0), row tile ``t`` (axis 1), its rows and
    their mask."""
    b = tl.program_id(0)
    t = tl.program_id(1)
    rows = t * BM + tl.arange(0, BM)
    return b, t, rows, rows < M


@triton.jit
def _stats_kernel(x_ptr, g_ptr, rows_ptr, cols_ptr, xsq_ptr, M, N, T, eps0,
                  BM: tl.constexpr, BN: tl.constexpr):
    b, t, rows, rmask = _row_tile(M, BM)
    base = b.to(tl.int64) * M * N
    row_acc = tl.zeros((BM,), tl.float32)
    x_acc = tl.zeros((BM,), tl.float32)
    for j0 in range(0, N, BN):
        cols = j0 + tl.arange(0, BN)
        mask = rmask[:, None] & (cols < N)[None, :]
        off = base + rows[:, None].to(tl.int64) * N + cols[None, :]
        g = tl.load(g_ptr + off, mask=mask, other=0.0)
        a = tl.where(mask, g * g + eps0, 0.0)
        row_acc += tl.sum(a, axis=1)
        tl.store(cols_ptr + (b.to(tl.int64) * T + t) * N + cols, tl.sum(a, axis=0),
                 mask=cols < N)
        x = tl.load(x_ptr + off, mask=mask, other=0.0)
        x_acc += tl.sum(x * x, axis=1)
    tl.store(rows_ptr + b.to(tl.int64) * M + rows, row_acc, mask=rmask)
    tl.store(xsq_ptr + b * T + t, tl.sum(x_acc, axis=0))


@triton.jit
def _update(g_ptr, r_ptr, c_ptr, b, rows, rmask, cols, M, N):
    """``u = (r_i · c_j) · g`` of a tile, 0 outside the matrix."""
    mask = rmask[:, None] & (cols < N)[None, :]
    off = b.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
    g = tl.load(g_ptr + off, mask=mask, other=0.0)
    r = tl.load(r_ptr + b.to(tl.int64) * M + rows, mask=rmask, other=0.0)
    c = tl.load(c_ptr + b.to(tl.int64) * N + cols, mask=cols < N, other=0.0)
    return (r[:, None] * c[None, :]) * g, off, mask


@triton.jit
def _sumsq_kernel(g_ptr, r_ptr, c_ptr, out_ptr, M, N, T, BM: tl.constexpr, BN: tl.constexpr):
    b, t, rows, rmask = _row_tile(M, BM)
    acc = tl.zeros((BM,), tl.float32)
    for j0 in range(0, N, BN):
        u, off, mask = _update(g_ptr, r_ptr, c_ptr, b, rows, rmask, j0 + tl.arange(0, BN),
                               M, N)
        acc += tl.sum(u * u, axis=1)
    tl.store(out_ptr + b * T + t, tl.sum(acc, axis=0))


@triton.jit
def _apply_kernel(x_ptr, g_ptr, r_ptr, c_ptr, s_ptr, lr_ptr, out_ptr, M, N,
                  BM: tl.constexpr, BN: tl.constexpr):
    b, t, rows, rmask = _row_tile(M, BM)
    s = tl.load(s_ptr + b)
    lr = tl.load(lr_ptr + b)
    for j0 in range(0, N, BN):
        u, off, mask = _update(g_ptr, r_ptr, c_ptr, b, rows, rmask, j0 + tl.arange(0, BN),
                               M, N)
        x = tl.load(x_ptr + off, mask=mask, other=0.0)
        tl.store(out_ptr + off, x - tl.div_rn(u, s) * lr, mask=mask)


def _check(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if x.dtype != torch.float32 or tuple(x.shape) != shape or not x.is_contiguous():
        raise ValueError(f"adafactor: {name} must be a contiguous float32 tensor of shape "
                         f"{shape}, got {x.dtype} {tuple(x.shape)}")


def stats(x: torch.Tensor, g: torch.Tensor, eps0: float
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Σ_j (g² + ε₀), Σ_i (g² + ε₀), Σ x²)`` of each matrix of the ``(B, m, n)`` float32
    stacks ``x`` and ``g``: ``(B, m)``, ``(B, n)``, ``(B,)``."""
    bsz, m, n = x.shape
    _check("x", x, (bsz, m, n))
    _check("g", g, (bsz, m, n))
    tiles = cdiv(m, _BM)
    rows = torch.empty((bsz, m), dtype=torch.float32, device=x.device)
    cols = torch.empty((bsz, tiles, n), dtype=torch.float32, device=x.device)
    xsq = torch.empty((bsz, tiles), dtype=torch.float32, device=x.device)
    _stats_kernel[(bsz, tiles)](x, g, rows, cols, xsq, m, n, tiles, float(eps0), BM=_BM,
                                BN=_BN, num_warps=_WARPS, **NO_FP_FUSION)
    return rows, cols.sum(dim=1), xsq.sum(dim=1)


def update_sumsq(g: torch.Tensor, r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``Σ u²`` of each matrix's ``u = (r_i · c_j) · g`` (``r`` ``(B, m)``, ``c`` ``(B, n)``)."""
    bsz, m, n = g.shape
    _check("g", g, (bsz, m, n))
    _check("r", r, (bsz, m))
    _check("c", c, (bsz, n))
    tiles = cdiv(m, _BM)
    out = torch.empty((bsz, tiles), dtype=torch.float32, device=g.device)
    _sumsq_kernel[(bsz, tiles)](g, r, c, out, m, n, tiles, BM=_BM, BN=_BN, num_warps=_WARPS,
                                **NO_FP_FUSION)
    return out.sum(dim=1)


def apply(x: torch.Tensor, g: torch.Tensor, r: torch.Tensor, c: torch.Tensor,
          s: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
    """``x − ((r_i · c_j) · g / s) · η`` of each matrix (``s``, ``η``: ``(B,)``), new."""
    bsz, m, n = x.shape
    for name, t, shape in (("x", x, (bsz, m, n)), ("g", g, (bsz, m, n)), ("r", r, (bsz, m)),
                           ("c", c, (bsz, n)), ("s", s, (bsz,)), ("lr", lr, (bsz,))):
        _check(name, t, shape)
    out = torch.empty_like(x)
    _apply_kernel[(bsz, cdiv(m, _BM))](x, g, r, c, s, lr, out, m, n, BM=_BM, BN=_BN,
                                       num_warps=_WARPS, **NO_FP_FUSION)
    return out
