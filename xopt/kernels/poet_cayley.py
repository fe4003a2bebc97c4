"""POET-X's Cayley–Neumann series as Triton kernels on a batch of b×b blocks.

For ``k = 3`` Neumann terms every power of a skew ``Q`` that the series needs is a product
of ``Q`` and ``Q²`` (``Q³ = Q²Q``, ``Q⁴ = Q²Q²``): with ``T = Q + (c/2)Q²``,
``Y = I + 2Q + 2Q² + 2Q²·T`` (``c = 1``: ``I + 2Q + 2Q² + 2Q³ + Q⁴``, the product form of
the authors' GPU kernel; ``c = 2``: the Taylor form of their PyTorch fallback).

Backends (``backend=`` of :func:`cayley_neumann`, default :data:`BACKEND`):

* ``"fused"``, the product form in two launches each way:
  ``_cnp_ab_kernel`` reads the triangles and writes ``Q``, ``A = (I + Q)²`` and
  ``B = I + Q²`` (``Q²`` made in the tile's registers), then one cuBLAS batched product
  ``Y = A·B``; backward ``_cnp_px_kernel`` (``P = G·B``, ``X = P + AᵀG``, float32) and
  ``_cnp_skew_grad_kernel``, which writes the triangles' gradient ``2(P − Pᵀ) −
  (ZQ + QZ)``, ``Z = X + Xᵀ``, tile by tile (the ``"bmm"`` derivation below, with
  ``N − Nᵀ = ZQ + QZ`` so that neither ``Z`` nor ``N`` is stored). The layer's host time
  is mostly launches (:mod:`xopt.torch.poet`), hence the fewest. The Taylor form takes
  ``"triton"``.
* ``"triton"``, four kernels and the triangle kernel, any of float32/bfloat16/float16:
  ``_cnp_square_kernel`` reads ``Q`` straight from the stored upper triangles (both halves
  read along the triangle's rows) and writes ``Q`` and ``Q²``; ``_cnp_series_kernel``
  writes ``Y`` tile by tile (``T`` is made from the loaded tiles, never stored). Backward:
  ``_cnp_d_kernel``, ``D = QᵀG + GQᵀ = −(QG + GQ)`` (kept in float32), then
  ``_cnp_grad_kernel``, ``∂Q = 2(G + D) + (cQ² − 2Q)·D + (2G + cD)·Q²`` (``Qᵀ = −Q`` and
  ``Q²ᵀ = Q²``: no transposed reads), then the triangles' gradient
  (``∂x = ∂Q[r, c] − ∂Q[c, r]``, :func:`triu_grad`).
* ``"bmm"``, cuBLAS batched products. The product form (the default) as
  ``Y = A·B``, ``A = (I + Q)²``, ``B = I + Q²``: two products forward, and three backward
  instead of four, because only the skew part of ``∂Q`` reaches the triangles
  (:func:`cnp_backward_bmm` derives it); four launches forward (:func:`skew` also writes
  the identity that ``B`` is accumulated onto), five backward (three products, the
  symmetrization ``_sym_kernel``, and the triangles' gradient, which also combines the two
  terms). The Taylor form: the kernels' formula with the additions folded into
  ``baddbmm_``'s α/β (in place on temporaries: the out-of-place ``baddbmm`` copies its
  input first), plus :func:`skew` and :func:`triu_grad`.

Precision. Every product takes operands in the blocks' dtype and accumulates in float32;
each stored result is rounded once to that dtype. Float32 operands: ``tf32=False`` (the
parity path) multiplies in IEEE float32 (FMA units), ``tf32=True`` on TF32 tensor cores
(10-bit mantissas; what a float32 evaluation for a bf16/fp16 layer asks for). Under the
Triton interpreter, whose ``tl.dot`` misreads bf16/fp16 operands, low-precision operands
are rounded to their dtype and multiplied in float32: the same products.

Backends (:data:`BACKEND`): ``"bmm"`` is the default, the backend validated on a GPU
(``bench/poet_layer.py --check``); ``"fused"`` (4 launches per forward+backward against
``"bmm"``'s 9 and ``"triton"``'s 5) passes that check on an H200 but takes more GPU time
there than ``"bmm"`` (bench/RESULTS.md), so it stays opt-in.
``"bmm"`` (cuBLAS batched products with the Triton skew, triangle and symmetrization
kernels) tied inside the layer with the
``"triton"`` series at b = 256 and was faster at b = 512 on GPU time; every backend
accepts any float dtype.

References: :func:`skew_reference`, :func:`triu_grad_reference`,
:func:`cayley_neumann_reference` (plain PyTorch, the spec's math) and
:class:`CayleyNeumann` (the kernels with autograd). Tested on the CPU under
``TRITON_INTERPRET=1`` (tests/test_poet.py) and on a GPU by ``bench/poet_layer.py --check``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from xopt.kernels import FP_FUSION
from xopt.kernels._grid import cdiv, next_pow2
from xopt.kernels.poet_jit import launch
from xopt.specs import poet as spec

__all__ = ["BACKEND", "BACKENDS", "CayleyNeumann", "blocks_backward", "blocks_forward",
           "blocks_saved_layout", "cayley_neumann", "cayley_neumann_reference",
           "cnp_backward_bmm", "cnp_backward_fused", "cnp_forward_bmm", "cnp_forward_fused",
           "rotations", "skew", "skew_reference", "triu_grad", "triu_grad_reference"]


# -- references ------------------------------------------------------------------------------


def skew_reference(x: torch.Tensor, b: int) -> torch.Tensor:
    return spec.skew(x, b, xp=torch)


def triu_grad_reference(dq: torch.Tensor, b: int) -> torch.Tensor:
    return spec.triu_grad(dq, b, xp=torch)


def cayley_neumann_reference(q: torch.Tensor, formula: str = "product") -> torch.Tensor:
    return spec.cayley_neumann(q, 3, formula, xp=torch)


# -- kernels -------------------------------------------------------------------------------------


@triton.jit
def _skew_kernel(x_ptr, q_ptr, eye_ptr, B, M, EYE: tl.constexpr, ROWS: tl.constexpr,
                 BC: tl.constexpr):
    """``ROWS`` whole rows of one block, ``BC`` columns at a time: ``Q[r, c] = x[k(r, c)]``
    above the diagonal, ``−x[k(c, r)]`` below it, 0 on it; every store row-wise. The rows'
    upper halves read the triangle along its rows; the lower halves read it down a column
    (strided, but a block's triangle is at most a few hundred KB and stays in cache). With
    ``EYE`` the identity's rows too (for the product form's ``B = I + Q²``, accumulated
    onto it in place). Whole rows rather than square tiles with a transposed mirror: every
    store is then row-wise, several times faster."""
    n = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)[:, None]
    base = n * B * B
    for c0 in range(0, B, BC):
        c = c0 + tl.arange(0, BC)[None, :]
        inside = (r < B) & (c < B)
        lo = tl.minimum(r, c)
        hi = tl.maximum(r, c)
        k = lo * B - (lo * (lo + 1)) // 2 + (hi - lo - 1)  # row-major strict upper index
        v = tl.load(x_ptr + n * M + k, mask=inside & (r != c), other=0.0).to(tl.float32)
        v = tl.where(r < c, v, -v)
        tl.store(q_ptr + base + r * B + c, v.to(q_ptr.dtype.element_ty), mask=inside)
        if EYE:
            tl.store(eye_ptr + base + r * B + c,
                     tl.where(r == c, 1.0, 0.0).to(eye_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _triu_grad_kernel(e1_ptr, e2_ptr, g_ptr, B, M, alpha, beta, TWO: tl.constexpr,
                      T: tl.constexpr):
    """One [T, T] tile on or above the diagonal of one block: ``g[k(r, c)] =
    α(E₁[r, c] − E₁[c, r])`` (``+ β(E₂[r, c] − E₂[c, r])`` with ``TWO``) for ``r < c``, in
    float32, rounded once; the mirror tile is read row-wise and transposed in registers,
    the triangle written along its rows."""
    ti = tl.program_id(1)
    tj = tl.program_id(2)
    if tj >= ti:
        n = tl.program_id(0).to(tl.int64)
        a = tl.arange(0, T)
        r, c = (ti * T + a)[:, None], (tj * T + a)[None, :]
        rm, cm = (tj * T + a)[:, None], (ti * T + a)[None, :]
        inb = (r < B) & (c < B)
        inm = (rm < B) & (cm < B)
        base = n * B * B
        up = tl.load(e1_ptr + base + r * B + c, mask=inb, other=0.0).to(tl.float32)
        dn = tl.load(e1_ptr + base + rm * B + cm, mask=inm, other=0.0).to(tl.float32)
        v = alpha * (up - tl.trans(dn))
        if TWO:
            up2 = tl.load(e2_ptr + base + r * B + c, mask=inb, other=0.0).to(tl.float32)
            dn2 = tl.load(e2_ptr + base + rm * B + cm, mask=inm, other=0.0).to(tl.float32)
            v += beta * (up2 - tl.trans(dn2))
        k = r * B - (r * (r + 1)) // 2 + (c - r - 1)
        tl.store(g_ptr + n * M + k, v.to(g_ptr.dtype.element_ty), mask=inb & (r < c))


@triton.jit
def _sym_kernel(x_ptr, p_ptr, z_ptr, B, T: tl.constexpr):
    """``Z = S + Sᵀ`` with ``S = X + P`` on one [T, T] tile of one block (float32, one
    rounding); the mirrored tile is read row-wise and transposed in registers."""
    n = tl.program_id(0).to(tl.int64)
    i0 = tl.program_id(1) * T
    j0 = tl.program_id(2) * T
    a = tl.arange(0, T)
    base = n * B * B
    ri, cj = (i0 + a)[:, None], (j0 + a)[None, :]
    m = (ri < B) & (cj < B)
    s = (tl.load(x_ptr + base + ri * B + cj, mask=m, other=0.0).to(tl.float32)
         + tl.load(p_ptr + base + ri * B + cj, mask=m, other=0.0).to(tl.float32))
    rj, ci = (j0 + a)[:, None], (i0 + a)[None, :]
    mt = (rj < B) & (ci < B)
    st = (tl.load(x_ptr + base + rj * B + ci, mask=mt, other=0.0).to(tl.float32)
          + tl.load(p_ptr + base + rj * B + ci, mask=mt, other=0.0).to(tl.float32))
    tl.store(z_ptr + base + ri * B + cj, (s + tl.trans(st)).to(z_ptr.dtype.element_ty), mask=m)


@triton.jit
def _dot(a, b, acc, od, PREC: tl.constexpr):
    """``acc + a·b`` accumulated in float32, the float32 operands ``a``, ``b`` rounded to the
    operand dtype ``od`` first. bfloat16/float16 operands: ``PREC`` is ignored. float32: at
    ``PREC`` "tf32" or "ieee". ``PREC = "upcast"`` (the interpreter, whose ``tl.dot`` reads
    low-precision operands as raw bits): round to ``od`` and multiply in float32, the same
    numbers (a product of two bf16/fp16 values is exact in float32)."""
    if PREC == "upcast":
        return tl.dot(a.to(od).to(tl.float32), b.to(od).to(tl.float32), acc,
                      input_precision="ieee")
    return tl.dot(a.to(od), b.to(od), acc, input_precision=PREC)


@triton.jit
def _block_tile(B, BM: tl.constexpr):
    """A program's block ``n`` (grid axis 0), its tile coordinates ``(ti, tj)`` (grid axis 1,
    row-major over the block's BM × BM tiles) and the tile's rows and columns."""
    tiles = tl.cdiv(B, BM)
    ti = tl.program_id(1) // tiles
    tj = tl.program_id(1) % tiles
    return (tl.program_id(0), ti, tj, ti * BM + tl.arange(0, BM), tj * BM + tl.arange(0, BM))


@triton.jit
def _tile(ptr, rows, cols, B):
    """``M[rows, cols]`` of a row-major B × B matrix at ``ptr``, as float32 (0 outside)."""
    mask = (rows[:, None] < B) & (cols[None, :] < B)
    return tl.load(ptr + rows[:, None] * B + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_tile(ptr, rows, cols, B, value):
    mask = (rows[:, None] < B) & (cols[None, :] < B)
    tl.store(ptr + rows[:, None] * B + cols[None, :], value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _triu_index(r, c, B):
    """Row-major index of ``(min(r, c), max(r, c))`` in a strict upper triangle of B × B."""
    lo = tl.minimum(r, c)
    hi = tl.maximum(r, c)
    return lo * B - (lo * (lo + 1)) // 2 + (hi - lo - 1)


@triton.jit
def _skew_tile(x_ptr, rows, cols, B):
    """``Q[rows, cols]`` (float32) of ``Q = U − Uᵀ``, ``U`` the strict upper triangle stored
    row-major at ``x_ptr`` (the layout of ``oft_R``'s rows). Both halves are read along
    the triangle's rows (coalesced): ``U[rows, cols]`` where r < c, and ``U[cols, rows]``
    where c < r, transposed in registers."""
    r = rows[:, None]
    c = cols[None, :]
    inside = (r < B) & (c < B)
    up = tl.load(x_ptr + _triu_index(r, c, B), mask=inside & (r < c), other=0.0)
    rt = rows[None, :]
    ct = cols[:, None]
    lo = tl.load(x_ptr + _triu_index(ct, rt, B), mask=(rt < B) & (ct < rt), other=0.0)
    return up.to(tl.float32) - tl.trans(lo.to(tl.float32))


@triton.jit
def _cnp_square_kernel(src_ptr, q_ptr, q2_ptr, B, M, FROM_TRIU: tl.constexpr,
                       BM: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    # Q² (and, FROM_TRIU, Q itself) of one block tile; Q read from the triangles or from q.
    n, ti, tj, rows, cols = _block_tile(B, BM)
    od = q2_ptr.dtype.element_ty
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, B, BK):
        ks = k0 + tl.arange(0, BK)
        if FROM_TRIU:
            a = _skew_tile(src_ptr + n * M, rows, ks, B)
            b = _skew_tile(src_ptr + n * M, ks, cols, B)
        else:
            a = _tile(src_ptr + n * B * B, rows, ks, B)
            b = _tile(src_ptr + n * B * B, ks, cols, B)
        acc = _dot(a, b, acc, od, PREC)
    _store_tile(q2_ptr + n * B * B, rows, cols, B, acc)
    if FROM_TRIU:
        _store_tile(q_ptr + n * B * B, rows, cols, B, _skew_tile(src_ptr + n * M, rows, cols, B))


@triton.jit
def _cnp_series_kernel(q_ptr, q2_ptr, y_ptr, B, HALF_C, BM: tl.constexpr, BK: tl.constexpr,
                       PREC: tl.constexpr):
    # Y = 2(Q + Q² + I/2) + 2·Q²·T,  T = Q + (c/2)Q² (made tile by tile, never stored)
    n, ti, tj, rows, cols = _block_tile(B, BM)
    q = q_ptr + n * B * B
    q2 = q2_ptr + n * B * B
    od = q_ptr.dtype.element_ty
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, B, BK):
        ks = k0 + tl.arange(0, BK)
        t = _tile(q, ks, cols, B) + HALF_C * _tile(q2, ks, cols, B)
        acc = _dot(_tile(q2, rows, ks, B), t, acc, od, PREC)
    y = 2.0 * acc + 2.0 * (_tile(q, rows, cols, B) + _tile(q2, rows, cols, B))
    y = y + tl.where(rows[:, None] == cols[None, :], 1.0, 0.0)
    _store_tile(y_ptr + n * B * B, rows, cols, B, y)


@triton.jit
def _cnp_d_kernel(q_ptr, g_ptr, d_ptr, B, BM: tl.constexpr, BK: tl.constexpr,
                  PREC: tl.constexpr):
    # D = QᵀG + GQᵀ = −(QG + GQ) (Q skew: no transposed reads), kept in float32
    n, ti, tj, rows, cols = _block_tile(B, BM)
    q = q_ptr + n * B * B
    g = g_ptr + n * B * B
    od = q_ptr.dtype.element_ty
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, B, BK):
        ks = k0 + tl.arange(0, BK)
        acc = _dot(_tile(q, rows, ks, B), _tile(g, ks, cols, B), acc, od, PREC)
        acc = _dot(_tile(g, rows, ks, B), _tile(q, ks, cols, B), acc, od, PREC)
    _store_tile(d_ptr + n * B * B, rows, cols, B, -acc)


@triton.jit
def _dq_tile(q, q2, g, d, rows, cols, B, C, BM: tl.constexpr, BK: tl.constexpr, od,
             PREC: tl.constexpr):
    """``∂Q[rows, cols]`` (float32): ``2(G + D) + (cQ² − 2Q)·D + (2G + cD)·Q²``, i.e.
    ``2(G + D) + 2TᵀD + 2(G + (c/2)D)Q²ᵀ`` with ``Qᵀ = −Q`` and ``Q²ᵀ = Q²``."""
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, B, BK):
        ks = k0 + tl.arange(0, BK)
        left = C * _tile(q2, rows, ks, B) - 2.0 * _tile(q, rows, ks, B)
        acc = _dot(left, _tile(d, ks, cols, B), acc, od, PREC)
        left = 2.0 * _tile(g, rows, ks, B) + C * _tile(d, rows, ks, B)
        acc = _dot(left, _tile(q2, ks, cols, B), acc, od, PREC)
    return acc + 2.0 * (_tile(g, rows, cols, B) + _tile(d, rows, cols, B))


@triton.jit
def _cnp_grad_kernel(q_ptr, q2_ptr, g_ptr, d_ptr, out_ptr, B, C, BM: tl.constexpr,
                     BK: tl.constexpr, PREC: tl.constexpr):
    # ∂Q, one tile per program (the triangles' gradient is then _triu_grad_kernel's)
    n, ti, tj, rows, cols = _block_tile(B, BM)
    _store_tile(out_ptr + n * B * B, rows, cols, B,
                _dq_tile(q_ptr + n * B * B, q2_ptr + n * B * B, g_ptr + n * B * B,
                         d_ptr + n * B * B, rows, cols, B, C, BM, BK,
                         q_ptr.dtype.element_ty, PREC))


@triton.jit
def _cnp_ab_kernel(x_ptr, out_ptr, B, M, NBB, BM: tl.constexpr, BK: tl.constexpr,
                   PREC: tl.constexpr):
    """The product form's factors of one block tile, straight from the triangles, in one
    pass: ``Q``, ``A = I + 2Q + Q²`` and ``B = I + Q²`` (``out`` holds the three stacks,
    ``NBB`` elements apart), each rounded once (``Q²`` accumulated in float32)."""
    n, ti, tj, rows, cols = _block_tile(B, BM)
    src = x_ptr + n.to(tl.int64) * M
    od = out_ptr.dtype.element_ty
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, B, BK):
        ks = k0 + tl.arange(0, BK)
        acc = _dot(_skew_tile(src, rows, ks, B), _skew_tile(src, ks, cols, B), acc, od, PREC)
    q = _skew_tile(src, rows, cols, B)
    eye = tl.where(rows[:, None] == cols[None, :], 1.0, 0.0)
    base = out_ptr + n.to(tl.int64) * B * B
    _store_tile(base, rows, cols, B, q)
    _store_tile(base + NBB, rows, cols, B, eye + 2.0 * q + acc)
    _store_tile(base + 2 * NBB, rows, cols, B, eye + acc)


@triton.jit
def _cnp_px_kernel(g_ptr, ab_ptr, px_ptr, B, NBB, BM: tl.constexpr, BK: tl.constexpr,
                   PREC: tl.constexpr):
    """``P = G·B`` and ``X = P + AᵀG`` of one block tile, both kept in float32 (``px``
    holds the two stacks, ``NBB`` apart; ``ab``: the forward's ``Q, A, B`` stacks). ``Aᵀ``'s
    tiles are read row-wise and transposed in registers."""
    n, ti, tj, rows, cols = _block_tile(B, BM)
    off = n.to(tl.int64) * B * B
    g = g_ptr + off
    a = ab_ptr + NBB + off
    bb = ab_ptr + 2 * NBB + off
    od = ab_ptr.dtype.element_ty
    p = tl.zeros((BM, BM), dtype=tl.float32)
    w = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, B, BK):
        ks = k0 + tl.arange(0, BK)
        gk = _tile(g, ks, cols, B)
        p = _dot(_tile(g, rows, ks, B), _tile(bb, ks, cols, B), p, od, PREC)
        w = _dot(tl.trans(_tile(a, ks, rows, B)), gk, w, od, PREC)
    _store_tile(px_ptr + off, rows, cols, B, p)
    _store_tile(px_ptr + NBB + off, rows, cols, B, p + w)


@triton.jit
def _cnp_skew_grad_kernel(px_ptr, q_ptr, out_ptr, B, M, NBB, BM: tl.constexpr,
                          BK: tl.constexpr, PREC: tl.constexpr):
    """The triangles' gradient of one tile on or above the diagonal:
    ``∂x[k(r, c)] = 2(P[r, c] − P[c, r]) − (ZQ + QZ)[r, c]`` for ``r < c``, with
    ``Z = X + Xᵀ`` made from the loaded tiles (never stored) and the mirror tiles read
    row-wise and transposed in registers; one rounding, at the store."""
    ti = tl.program_id(1)
    tj = tl.program_id(2)
    if tj >= ti:
        n = tl.program_id(0).to(tl.int64)
        rows = ti * BM + tl.arange(0, BM)
        cols = tj * BM + tl.arange(0, BM)
        off = n * B * B
        p = px_ptr + off
        x = px_ptr + NBB + off
        q = q_ptr + off
        od = q_ptr.dtype.element_ty
        acc = tl.zeros((BM, BM), dtype=tl.float32)
        for k0 in range(0, B, BK):
            ks = k0 + tl.arange(0, BK)
            z = _tile(x, rows, ks, B) + tl.trans(_tile(x, ks, rows, B))
            acc = _dot(z, _tile(q, ks, cols, B), acc, od, PREC)
            z = _tile(x, ks, cols, B) + tl.trans(_tile(x, cols, ks, B))
            acc = _dot(_tile(q, rows, ks, B), z, acc, od, PREC)
        v = 2.0 * (_tile(p, rows, cols, B) - tl.trans(_tile(p, cols, rows, B))) - acc
        r = rows[:, None]
        c = cols[None, :]
        k = r * B - (r * (r + 1)) // 2 + (c - r - 1)
        tl.store(out_ptr + n * M + k, v.to(out_ptr.dtype.element_ty),
                 mask=(r < B) & (c < B) & (r < c))


# -- launchers -------------------------------------------------------------------------------


#: CNP tiles (BM × BM outputs per program, BK-wide products, warps) for float32 and for
#: bf16/fp16 operands (the low-precision one the fastest of a sweep on an H100)
CNP_TILES = {"f32": (64, 32, 4), "lowp": (128, 32, 8)}


#: the fused backend's tiles (its kernels read the triangles with per-element index
#: arithmetic, unlike the series kernels the sweep above timed; of the two tiles timed with
#: ``bench/poet_layer.py --fused-tiles`` on an H200, these were the faster at b = 256)
FUSED_TILES = dict(CNP_TILES)


def _tiles(b: int, dtype: torch.dtype, table: dict | None = None) -> tuple[int, int, int]:
    bm, bk, warps = (table or CNP_TILES)["f32" if dtype == torch.float32 else "lowp"]
    bm = max(16, min(bm, next_pow2(b)))
    return bm, max(16, min(bm, bk)), warps


def _prec(dtype: torch.dtype, tf32: bool) -> str:
    # float32 operands: TF32 tensor cores or IEEE FMAs; bf16/fp16 operands ignore it, except
    # under the interpreter (see _dot)
    if dtype != torch.float32:
        return "upcast" if os.environ.get("TRITON_INTERPRET") == "1" else "tf32"
    return "tf32" if tf32 else "ieee"


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check(t: torch.Tensor, name: str, dtypes=(torch.float32,)) -> torch.Tensor:
    if t.dtype not in dtypes:
        raise TypeError(f"xopt.kernels.poet_cayley: {name} must be one of "
                        f"{', '.join(str(d) for d in dtypes)}; got {t.dtype}")
    return t.contiguous()


def skew(x: torch.Tensor, b: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Skew blocks ``(n, b, b)`` from upper triangles ``(n, b(b−1)/2)`` (float32, bfloat16
    or float16), written in ``dtype`` (default: ``x``'s): a cast here is free."""
    return _skew(x, b, dtype, False)[0]


def _skew(x: torch.Tensor, b: int, dtype: torch.dtype | None, eye: bool
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`skew`, and with ``eye`` a stack of identities ``(n, b, b)`` written by the
    same launch."""
    x = _check(x, "x", _FLOATS)
    n, m = x.shape
    q = torch.empty((n, b, b), dtype=dtype or x.dtype, device=x.device)
    i = torch.empty_like(q) if eye else None
    launch(_skew_kernel, (n, cdiv(b, SKEW_ROWS)), x, q, q if i is None else i, b, m, EYE=eye,
           ROWS=SKEW_ROWS, BC=max(16, min(128, next_pow2(b))), num_warps=4, **FP_FUSION)
    return q, i


#: rows per program of the skew kernel (with 128 columns at a time on 4 warps: the fastest
#: of 1-8 rows, 128-512 columns and 2-8 warps on an H100 for 256² and 512² blocks)
SKEW_ROWS = 8


def _edge_tile(b: int) -> int:
    """The tile edge of the triangle and symmetrization kernels."""
    return max(16, min(64, next_pow2(b)))


def triu_grad(dq: torch.Tensor, b: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``∂x[k] = ∂Q[r_k, c_k] − ∂Q[c_k, r_k]``: the adjoint of :func:`skew`, in ``dtype``
    (default: ``dq``'s); the difference is taken in float32."""
    return _triu_combine(dq, None, b, 1.0, 0.0, dtype)


def _triu_combine(e1: torch.Tensor, e2: torch.Tensor | None, b: int, alpha: float,
                  beta: float, dtype: torch.dtype | None) -> torch.Tensor:
    """``α·triu_grad(E₁) + β·triu_grad(E₂)`` in one launch (float32, one rounding)."""
    e1 = _check(e1, "dq", _FLOATS)
    if e2 is not None:
        e2 = _check(e2, "dq", _FLOATS)
    n = e1.shape[0]
    m = spec.num_triu(b)
    g = torch.empty((n, m), dtype=dtype or e1.dtype, device=e1.device)
    t = _edge_tile(b)
    launch(_triu_grad_kernel, (n, cdiv(b, t), cdiv(b, t)), e1, e1 if e2 is None else e2, g, b,
           m, alpha, beta, TWO=e2 is not None, T=t, **FP_FUSION)
    return g


def _sym(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``(X + P) + (X + P)ᵀ`` per block (``(n, b, b)``, ``x``'s dtype, one rounding)."""
    n, b, _ = x.shape
    z = torch.empty_like(x)
    t = _edge_tile(b)
    launch(_sym_kernel, (n, cdiv(b, t), cdiv(b, t)), x, p, z, b, T=t, **FP_FUSION)
    return z


def _c4(formula: str) -> float:
    if formula not in ("product", "taylor"):
        raise ValueError(f"cayley formula {formula!r}: use 'product' or 'taylor'")
    return 1.0 if formula == "product" else 2.0


def _cnp_forward(src: torch.Tensor, b: int, from_triu: bool, formula: str, tf32: bool,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = src.shape[0]
    bm, bk, warps = _tiles(b, dtype)
    grid = (n, cdiv(b, bm) ** 2)
    prec = _prec(dtype, tf32)
    q = torch.empty((n, b, b), dtype=dtype, device=src.device) if from_triu else src
    q2 = torch.empty((n, b, b), dtype=dtype, device=src.device)
    launch(_cnp_square_kernel, grid, src, q, q2, b, spec.num_triu(b), FROM_TRIU=from_triu,
           BM=bm, BK=bk, PREC=prec, num_warps=warps, **FP_FUSION)
    y = torch.empty_like(q2)
    launch(_cnp_series_kernel, grid, q, q2, y, b, _c4(formula) / 2, BM=bm, BK=bk, PREC=prec,
           num_warps=warps, **FP_FUSION)
    return y, q, q2


def _cnp_backward(q: torch.Tensor, q2: torch.Tensor, g: torch.Tensor, formula: str,
                  tf32: bool, triu_dtype: torch.dtype | None) -> torch.Tensor:
    n, b, _ = q.shape
    bm, bk, warps = _tiles(b, q.dtype)
    grid = (n, cdiv(b, bm) ** 2)
    prec = _prec(q.dtype, tf32)
    d = torch.empty((n, b, b), dtype=torch.float32, device=q.device)
    launch(_cnp_d_kernel, grid, q, g, d, b, BM=bm, BK=bk, PREC=prec, num_warps=warps,
           **FP_FUSION)
    # ∂Q in float32 when the triangles' gradient follows (one rounding, at the end)
    dq = torch.empty((n, b, b), dtype=torch.float32 if triu_dtype is not None else q.dtype,
                     device=q.device)
    launch(_cnp_grad_kernel, grid, q, q2, g, d, dq, b, _c4(formula), BM=bm, BK=bk, PREC=prec,
           num_warps=warps, **FP_FUSION)
    return dq if triu_dtype is None else triu_grad(dq, b, triu_dtype)


def cnp_forward(q: torch.Tensor, formula: str = "product", tf32: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Y, Q²)`` for skew blocks ``q`` (``(n, b, b)``, float32, bfloat16 or float16; the
    products take operands in ``q``'s dtype and accumulate in float32, each result rounded
    once to it).

    ``tf32=True`` lets float32 products use TF32 tensor cores (10-bit mantissas): for layers
    computed in bfloat16 (7-bit) the rotations lose nothing they keep; float32 layers
    leave it off (IEEE products, the parity path)."""
    q = _check(q, "q", _FLOATS)
    y, _, q2 = _cnp_forward(q, q.shape[1], False, formula, tf32, q.dtype)
    return y, q2


def cnp_backward(q: torch.Tensor, q2: torch.Tensor, g: torch.Tensor,
                 formula: str = "product", tf32: bool = False) -> torch.Tensor:
    """``∂⟨Y, G⟩/∂Q`` (in ``q``'s dtype) given ``Q``, ``Q²`` (from :func:`cnp_forward`) and
    ``G`` (any float dtype)."""
    q, q2, g = _check(q, "q", _FLOATS), _check(q2, "q2", _FLOATS), _check(g, "grad", _FLOATS)
    return _cnp_backward(q, q2, g, formula, tf32, None)


#: the Cayley–Neumann backend: "bmm" (cuBLAS batched products; the default, validated on
#: a GPU), "fused" (two launches each way) or "triton" (the fused series);
#: ``XOPT_POET_CNP`` sets it (see the module docstring)
BACKEND = os.environ.get("XOPT_POET_CNP", "bmm")
BACKENDS = ("fused", "bmm", "triton")


class _Precision:
    """Float32 matmuls at TF32 (``tf32``) or IEEE for the duration of a block; nothing for
    bf16/fp16 operands, which the setting does not concern (two global writes less per
    call on the layer's host-paced path)."""

    def __init__(self, tf32: bool, dtype: torch.dtype = torch.float32):
        self.tf32, self.on = tf32, dtype == torch.float32

    def __enter__(self):
        if self.on:
            self.old = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = self.tf32

    def __exit__(self, *exc):
        if self.on:
            torch.backends.cuda.matmul.allow_tf32 = self.old


def cnp_forward_bmm(q: torch.Tensor, formula: str = "product", tf32: bool = False,
                    eye: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """:func:`cnp_forward` through batched matmuls: ``(Y, saved)``, ``saved`` what
    :func:`cnp_backward_bmm` takes.

    * ``"product"``: ``Y = (I + Q)²(I + Q²) = A·B`` with ``B = I + Q²`` and
      ``A = B + 2Q = (I + Q)²``: two products (``B`` in place on an identity, ``eye``
      when the caller has one, e.g. from :func:`_skew`; else made here), one addition;
      ``saved = (A, B)``.
    * ``"taylor"``: with ``T = Q + Q²``, ``Y = 2·(Q + Q² + I/2) + 2·Q²·T`` (two products,
      three elementwise kernels); ``saved = (Q², T)``.

    ``q`` may be float32 (``tf32`` picks TF32 or IEEE products) or bfloat16/float16: then
    every product takes low-precision operands and accumulates in float32 (cuBLAS), and
    each result is rounded once to ``q``'s dtype."""
    q = _check(q, "q", _FLOATS)
    c4 = _c4(formula)
    with _Precision(tf32, q.dtype):
        if c4 == 1.0:
            if eye is None:
                eye = torch.zeros_like(q)
                eye.diagonal(0, -2, -1).fill_(1)
            bm = eye.baddbmm_(q, q)  # B = I + Q² (in place on the identity: no copy)
            am = torch.add(bm, q, alpha=2.0)
            return torch.bmm(am, bm), (am, bm)
        q2 = torch.bmm(q, q)
        t = torch.add(q, q2, alpha=c4 / 2)
        base = q + q2
        base.diagonal(0, -2, -1).add_(0.5)
        y = base.baddbmm_(q2, t, beta=2.0, alpha=2.0)  # in place: no copy of base
    return y, (q2, t)


def cnp_backward_bmm(q: torch.Tensor, saved: tuple[torch.Tensor, ...], g: torch.Tensor,
                     formula: str = "product", tf32: bool = False,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """The upper triangles' gradient ``(n, b(b−1)/2)`` (in ``dtype``, default ``q``'s) of
    ``⟨Y, G⟩`` through :func:`skew` and :func:`cnp_forward_bmm` (``saved``: its second
    result). Dtypes as the forward.

    * ``"product"`` (three products instead of four): ``Y = A·B`` gives ``∂A = G·B`` and
      ``∂B = AᵀG``; both enter ``Q²`` (``A = I + 2Q + Q²``, ``B = I + Q²``), so with
      ``X = G·B + AᵀG``, ``∂Q = 2G·B + QᵀX + XQᵀ = 2G·B − (QX + XQ)``. Only the skew part
      ``∂Q − ∂Qᵀ`` reaches the triangles, and there ``QX + XQ`` contributes through
      ``Z = X + Xᵀ`` alone: ``(QX + XQ) − (QX + XQ)ᵀ = ZQ + QZ = N − Nᵀ`` with ``N = ZQ``
      (``Zᵀ = Z``, ``Qᵀ = −Q``). So ``∂x = 2(P − Pᵀ) − (N − Nᵀ)`` at the triangle, with
      ``P = G·B``, ``Z = (P + AᵀG) + (P + AᵀG)ᵀ``, ``N = ZQ``.
    * ``"taylor"``: the kernels' formula, written with ``T = Q + Q²``:
      ``∂Q = 2(G + D) + 2TᵀD + 2(G + D)Q²ᵀ``, ``D = QᵀG + GQᵀ``, then :func:`triu_grad`.
    """
    q, g = _check(q, "q", _FLOATS), _check(g, "grad", _FLOATS)
    c4 = _c4(formula)
    n, b, _ = q.shape
    with _Precision(tf32, q.dtype):
        if c4 == 1.0:
            am, bm = saved
            p = torch.bmm(g, bm)
            z = _sym(torch.bmm(am.transpose(1, 2), g), p)
            return _triu_combine(p, torch.bmm(z, q), b, 2.0, -1.0, dtype or q.dtype)
        q2, t = saved
        qt = q.transpose(1, 2)
        d = torch.bmm(g, qt).baddbmm_(qt, g)  # QᵀG + GQᵀ (in place on temporaries)
        out = (g + d).baddbmm_(t.transpose(1, 2), d, beta=2.0, alpha=2.0)
        out.baddbmm_(torch.add(g, d, alpha=c4 / 2), q2.transpose(1, 2), alpha=2.0)
    return triu_grad(out, b, dtype or q.dtype)


def cnp_forward_fused(x: torch.Tensor, b: int, tf32: bool = False,
                      dtype: torch.dtype | None = None,
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The product form's blocks ``Y = A·B`` (``(n, b, b)`` in ``dtype``, default ``x``'s)
    from upper triangles ``x`` in two launches: ``_cnp_ab_kernel`` writes ``Q``,
    ``A = I + 2Q + Q²`` and ``B = I + Q²`` (one stack, one allocation), then one cuBLAS
    batched product. Returns ``(Y, saved)`` for :func:`cnp_backward_fused`. Dtypes and
    ``tf32`` as :func:`cnp_forward`."""
    x = _check(x, "x", _FLOATS)
    dtype = dtype or x.dtype
    n = x.shape[0]
    bm, bk, warps = _tiles(b, dtype, FUSED_TILES)
    qab = torch.empty((3, n, b, b), dtype=dtype, device=x.device)
    launch(_cnp_ab_kernel, (n, cdiv(b, bm) ** 2), x, qab, b, x.shape[1], n * b * b, BM=bm,
           BK=bk, PREC=_prec(dtype, tf32), num_warps=warps, **FP_FUSION)
    if dtype == torch.float32:
        with _Precision(tf32):
            y = torch.bmm(qab[1], qab[2])
    else:  # (TF32 concerns float32 operands only)
        y = torch.bmm(qab[1], qab[2])
    return y, (qab,)


def cnp_backward_fused(saved: tuple[torch.Tensor, ...], g: torch.Tensor,
                       tf32: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The upper triangles' gradient (in ``dtype``, default the blocks') of ``⟨Y, G⟩``
    through :func:`cnp_forward_fused`, in two launches: ``_cnp_px_kernel`` (``P = G·B``,
    ``X = P + AᵀG``, float32) and ``_cnp_skew_grad_kernel`` (``2(P − Pᵀ) − (ZQ + QZ)`` at
    the triangle, ``Z = X + Xᵀ``): the derivation of :func:`cnp_backward_bmm`, with
    ``N − Nᵀ = ZQ + QZ`` so that ``N`` is never stored."""
    (qab,) = saved
    _, n, b, _ = qab.shape
    g = _check(g, "grad", _FLOATS).to(qab.dtype)
    bm, bk, warps = _tiles(b, qab.dtype, FUSED_TILES)
    prec = _prec(qab.dtype, tf32)
    nbb = n * b * b
    px = torch.empty((2, n, b, b), dtype=torch.float32, device=qab.device)
    launch(_cnp_px_kernel, (n, cdiv(b, bm) ** 2), g, qab, px, b, nbb, BM=bm, BK=bk, PREC=prec,
           num_warps=warps, **FP_FUSION)
    m = spec.num_triu(b)
    out = torch.empty((n, m), dtype=dtype or qab.dtype, device=qab.device)
    tiles = cdiv(b, bm)
    launch(_cnp_skew_grad_kernel, (n, tiles, tiles), px, qab, out, b, m, nbb, BM=bm, BK=bk,
           PREC=prec, num_warps=warps, **FP_FUSION)
    return out


def blocks_forward(x: torch.Tensor, b: int, formula: str, tf32: bool, backend: str,
                   dtype: torch.dtype) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """CNP blocks ``(n, b, b)`` in ``dtype`` from upper triangles ``x``, and what
    :func:`blocks_backward` needs. No autograd: for use inside a Function (the layer's)."""
    backend = _resolve(backend, formula)
    if backend == "fused":
        return cnp_forward_fused(x, b, tf32, dtype)
    if backend == "bmm":
        q, eye = _skew(x, b, dtype, _c4(formula) == 1.0)
        y, saved = cnp_forward_bmm(q, formula, tf32, eye)
        return y, (q, *saved)
    y, q, q2 = _cnp_forward(_check(x, "x", _FLOATS), b, True, formula, tf32, dtype)
    return y, (q, q2)


def blocks_saved_layout(n: int, b: int, formula: str, backend: str, dtype: torch.dtype,
                        ) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The ``(shape, dtype)`` of each tensor :func:`blocks_forward` saves for ``n`` blocks
    (what a fake implementation of an op around it returns, :mod:`xopt.torch.poet`)."""
    backend = _resolve(backend, formula)
    if backend == "fused":
        return [((3, n, b, b), dtype)]
    return [((n, b, b), dtype)] * (3 if backend == "bmm" else 2)


def blocks_backward(saved: tuple[torch.Tensor, ...], g: torch.Tensor, b: int, formula: str,
                    tf32: bool, backend: str, x_dtype: torch.dtype) -> torch.Tensor:
    """The upper triangles' gradient (in ``x_dtype``) from the blocks' cotangent ``g``."""
    backend = _resolve(backend, formula)
    if backend == "fused":
        return cnp_backward_fused(saved, g, tf32, x_dtype)
    if backend == "bmm":
        q, *rest = saved
        return cnp_backward_bmm(q, tuple(rest), g.contiguous().to(q.dtype), formula, tf32,
                                x_dtype)
    q, q2 = saved
    return _cnp_backward(q, q2, g.contiguous(), formula, tf32, x_dtype)


def _resolve(backend: str, formula: str) -> str:
    """``"fused"`` covers the product form; the Taylor form takes the fused series."""
    if backend not in BACKENDS:
        raise ValueError(f"cayley_neumann backend {backend!r}: use one of {BACKENDS}")
    return "triton" if backend == "fused" and _c4(formula) != 1.0 else backend


class CayleyNeumann(torch.autograd.Function):
    """``oft_R`` rows (upper triangles) → CNP blocks, with the fused kernels (or the
    batched-matmul backend) both ways. ``dtype``: the blocks' dtype, in which both backends
    compute (float32, or bfloat16/float16 products with float32 accumulation). The
    gradient comes back in ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, b: int, formula: str, tf32: bool = False,
                backend: str = "triton", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        y, saved = blocks_forward(x, b, formula, tf32, backend, dtype)
        ctx.save_for_backward(*saved)
        ctx.args = (b, formula, tf32, backend, x.dtype)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return (blocks_backward(ctx.saved_tensors, g, *ctx.args),
                None, None, None, None, None)


def cayley_neumann(x: torch.Tensor, b: int, formula: str = "product",
                   tf32: bool = False, backend: str | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """CNP blocks ``(n, b, b)`` in ``dtype`` from upper triangles ``x`` (``(n, m)``, any of
    float32/bfloat16/float16), differentiable; the gradient is returned in ``x``'s dtype.
    ``dtype=float32`` (default) evaluates the series in float32 whatever ``x``'s dtype.
    ``backend``: ``"fused"``, ``"bmm"`` or ``"triton"`` (default :data:`BACKEND`)."""
    backend = backend or BACKEND
    _resolve(backend, formula)
    if dtype not in _FLOATS:
        raise TypeError(f"cayley_neumann: dtype must be one of {_FLOATS}; got {dtype}")
    return CayleyNeumann.apply(x, b, formula, tf32, backend, dtype)


def rotations(oft_r: torch.Tensor, b: int, r_out: int, formula: str = "product",
              tf32: bool = False, backend: str | None = None):
    """``(R_out, R_in)`` from a layer's ``oft_R`` through the kernels (3 Neumann terms),
    float32."""
    y = cayley_neumann(oft_r, b, formula, tf32, backend)
    return y[:r_out], y[r_out:]
