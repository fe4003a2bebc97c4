"""POET-X's Cayley–Neumann series as Triton kernels on a batch of b×b blocks.

For ``k = 3`` Neumann terms every power of a skew ``Q`` that the series needs is a product
of ``Q`` and ``Q²`` (``Q³ = Q²Q``, ``Q⁴ = Q²Q²``): with ``T = Q + (c/2)Q²``,
``Y = I + 2Q + 2Q² + 2Q²·T`` (``c = 1``: ``I + 2Q + 2Q² + 2Q³ + Q⁴``, the product form of
the authors' GPU kernel; ``c = 2``: the Taylor form of their PyTorch fallback).

Backends (``backend=`` of :func:`cayley_neumann`, default :data:`BACKEND`):

* ``"triton"``, four kernels and the triangle kernel, any of float32/bfloat16/float16:
  ``_cnp_square_kernel`` reads ``Q`` straight from the stored upper triangles (both halves
  read along the triangle's rows) and writes ``Q`` and ``Q²``; ``_cnp_series_kernel``
  writes ``Y`` tile by tile (``T`` is made from the loaded tiles, never stored). Backward:
  ``_cnp_d_kernel``, ``D = QᵀG + GQᵀ = −(QG + GQ)`` (kept in float32), then
  ``_cnp_grad_kernel``, ``∂Q = 2(G + D) + (cQ² − 2Q)·D + (2G + cD)·Q²`` (``Qᵀ = −Q`` and
  ``Q²ᵀ = Q²``: no transposed reads), then the triangles' gradient
  (``∂x = ∂Q[r, c] − ∂Q[c, r]``, :func:`triu_grad`).
* ``"bmm"``, the same series as cuBLAS batched products with the additions folded into
  ``baddbmm_``'s α/β (in place on temporaries: the out-of-place ``baddbmm`` copies its
  input first), plus :func:`skew` and :func:`triu_grad`.

Precision. Every product takes operands in the blocks' dtype and accumulates in float32;
each stored result is rounded once to that dtype. Float32 operands: ``tf32=False`` (the
parity path) multiplies in IEEE float32 (FMA units), ``tf32=True`` on TF32 tensor cores
(10-bit mantissas; what a float32 evaluation for a bf16/fp16 layer asks for). Under the
Triton interpreter, whose ``tl.dot`` misreads bf16/fp16 operands, low-precision operands
are rounded to their dtype and multiplied in float32: the same products.

GPU time, H100, 2026-11-22, forward+backward, bf16 (``bench/poet_layer.py --micro``,
RESULTS.md): 32 blocks of 256², bmm 96-235 µs, triton 87 µs; 16 blocks of 512², bmm
164 µs, triton 256 µs. Inside the whole layer the bmm backend is faster at both sizes
(0.715 vs 0.774 ms and 0.810 vs 1.075 ms at 4096², b = 256 / 512), so ``"bmm"`` is the
default.

References: :func:`skew_reference`, :func:`triu_grad_reference`,
:func:`cayley_neumann_reference` (plain PyTorch, the spec's math) and
:class:`CayleyNeumann` (the kernels with autograd). Tested on the CPU under
``TRITON_INTERPRET=1`` (tests/test_poet.py) and on a GPU by bench/poet_layer.py --check.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from xopt.specs import poet as spec

__all__ = ["BACKEND", "CayleyNeumann", "blocks_backward", "blocks_forward", "cayley_neumann",
           "cayley_neumann_reference", "cnp_backward_bmm", "cnp_forward_bmm", "rotations", "skew",
           "skew_reference", "triu_grad", "triu_grad_reference"]


# -- references ------------------------------------------------------------------------------


def skew_reference(x: torch.Tensor, b: int) -> torch.Tensor:
    return spec.skew(x, b, xp=torch)


def triu_grad_reference(dq: torch.Tensor, b: int) -> torch.Tensor:
    return spec.triu_grad(dq, b, xp=torch)


def cayley_neumann_reference(q: torch.Tensor, formula: str = "product") -> torch.Tensor:
    return spec.cayley_neumann(q, 3, formula, xp=torch)


# -- kernels -------------------------------------------------------------------------------------


@triton.jit
def _skew_kernel(x_ptr, q_ptr, B, M, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = e < B * B
    i = e // B
    j = e % B
    lo = tl.minimum(i, j)
    hi = tl.maximum(i, j)
    k = lo * B - (lo * (lo + 1)) // 2 + (hi - lo - 1)  # row-major strict upper index
    off = i != j
    v = tl.load(x_ptr + n * M + k, mask=inside & off, other=0.0).to(tl.float32)
    v = tl.where(i < j, v, -v)
    v = tl.where(off, v, 0.0)
    tl.store(q_ptr + n * B * B + e, v.to(q_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _triu_grad_kernel(dq_ptr, g_ptr, rows_ptr, cols_ptr, B, M, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = k < M
    r = tl.load(rows_ptr + k, mask=inside, other=0)
    c = tl.load(cols_ptr + k, mask=inside, other=0)
    up = tl.load(dq_ptr + n * B * B + r * B + c, mask=inside, other=0.0).to(tl.float32)
    dn = tl.load(dq_ptr + n * B * B + c * B + r, mask=inside, other=0.0).to(tl.float32)
    tl.store(g_ptr + n * M + k, (up - dn).to(g_ptr.dtype.element_ty), mask=inside)


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


# -- launchers -------------------------------------------------------------------------------


#: CNP tiles (BM × BM outputs per program, BK-wide products, warps) for float32 and for
#: bf16/fp16 operands; the low-precision one is the fastest of bench/poet_layer.py --micro's
#: sweep on an H100 (RESULTS.md), the float32 one the earlier default
CNP_TILES = {"f32": (64, 32, 4), "lowp": (128, 32, 8)}


def _tiles(b: int, dtype: torch.dtype) -> tuple[int, int, int]:
    bm, bk, warps = CNP_TILES["f32" if dtype == torch.float32 else "lowp"]
    bm = max(16, min(bm, triton.next_power_of_2(b)))
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
    x = _check(x, "x", _FLOATS)
    n, m = x.shape
    q = torch.empty((n, b, b), dtype=dtype or x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(b * b))
    _skew_kernel[(n, triton.cdiv(b * b, block))](x, q, b, m, BLOCK=block)
    return q


_TRIU: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _triu_tensors(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The strict upper triangle's (rows, cols) as int32 on ``device``, made once: a
    host→device copy per backward would block the host (and break CUDA-graph capture)."""
    key = (b, device)
    if key not in _TRIU:
        rows, cols = spec.triu_indices(b)
        _TRIU[key] = (torch.as_tensor(rows, dtype=torch.int32, device=device),
                      torch.as_tensor(cols, dtype=torch.int32, device=device))
    return _TRIU[key]


def triu_grad(dq: torch.Tensor, b: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``∂x[k] = ∂Q[r_k, c_k] − ∂Q[c_k, r_k]``: the adjoint of :func:`skew`, in ``dtype``
    (default: ``dq``'s); the difference is taken in float32."""
    dq = _check(dq, "dq", _FLOATS)
    n = dq.shape[0]
    m = spec.num_triu(b)
    rows_t, cols_t = _triu_tensors(b, dq.device)
    g = torch.empty((n, m), dtype=dtype or dq.dtype, device=dq.device)
    block = min(1024, triton.next_power_of_2(m))
    _triu_grad_kernel[(n, triton.cdiv(m, block))](dq, g, rows_t, cols_t, b, m, BLOCK=block)
    return g


def _c4(formula: str) -> float:
    if formula not in ("product", "taylor"):
        raise ValueError(f"cayley formula {formula!r}: use 'product' or 'taylor'")
    return 1.0 if formula == "product" else 2.0


def _cnp_forward(src: torch.Tensor, b: int, from_triu: bool, formula: str, tf32: bool,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = src.shape[0]
    bm, bk, warps = _tiles(b, dtype)
    grid = (n, triton.cdiv(b, bm) ** 2)
    prec = _prec(dtype, tf32)
    q = torch.empty((n, b, b), dtype=dtype, device=src.device) if from_triu else src
    q2 = torch.empty((n, b, b), dtype=dtype, device=src.device)
    _cnp_square_kernel[grid](src, q, q2, b, spec.num_triu(b), FROM_TRIU=from_triu, BM=bm,
                             BK=bk, PREC=prec, num_warps=warps)
    y = torch.empty_like(q2)
    _cnp_series_kernel[grid](q, q2, y, b, _c4(formula) / 2, BM=bm, BK=bk, PREC=prec,
                             num_warps=warps)
    return y, q, q2


def _cnp_backward(q: torch.Tensor, q2: torch.Tensor, g: torch.Tensor, formula: str,
                  tf32: bool, triu_dtype: torch.dtype | None) -> torch.Tensor:
    n, b, _ = q.shape
    bm, bk, warps = _tiles(b, q.dtype)
    grid = (n, triton.cdiv(b, bm) ** 2)
    prec = _prec(q.dtype, tf32)
    d = torch.empty((n, b, b), dtype=torch.float32, device=q.device)
    _cnp_d_kernel[grid](q, g, d, b, BM=bm, BK=bk, PREC=prec, num_warps=warps)
    # ∂Q in float32 when the triangles' gradient follows (one rounding, at the end)
    dq = torch.empty((n, b, b), dtype=torch.float32 if triu_dtype is not None else q.dtype,
                     device=q.device)
    _cnp_grad_kernel[grid](q, q2, g, d, dq, b, _c4(formula), BM=bm, BK=bk, PREC=prec,
                           num_warps=warps)
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


#: "bmm" (cuBLAS batched products) or "triton" (the fused kernels); XOPT_POET_CNP
#: overrides the default (for benchmarks)
BACKEND = os.environ.get("XOPT_POET_CNP", "bmm")


class _Precision:
    """Float32 matmuls at TF32 (``tf32``) or IEEE for the duration of a block."""

    def __init__(self, tf32: bool):
        self.tf32 = tf32

    def __enter__(self):
        self.old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.tf32

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.old


def cnp_forward_bmm(q: torch.Tensor, formula: str = "product", tf32: bool = False,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cnp_forward` through batched matmuls: ``(Y, Q², T)`` with
    ``T = Q + (c/2)·Q²``, so that ``Y = 2·(Q + Q² + I/2) + 2·Q²·T`` (two products, three
    elementwise kernels) and the backward reuses ``T``.

    ``q`` may be float32 (``tf32`` picks TF32 or IEEE products) or bfloat16/float16: then
    every product takes low-precision operands and accumulates in float32 (cuBLAS), and
    each result is rounded once to ``q``'s dtype."""
    q = _check(q, "q", _FLOATS)
    c4 = _c4(formula)
    with _Precision(tf32):
        q2 = torch.bmm(q, q)
        t = torch.add(q, q2, alpha=c4 / 2)
        base = q + q2
        base.diagonal(0, -2, -1).add_(0.5)
        y = base.baddbmm_(q2, t, beta=2.0, alpha=2.0)  # in place: no copy of base
    return y, q2, t


def cnp_backward_bmm(q: torch.Tensor, q2: torch.Tensor, g: torch.Tensor,
                     formula: str = "product", tf32: bool = False,
                     t: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`cnp_backward` through batched matmuls (the kernels' formula, written with
    ``T = Q + (c/2)Q²``: ``∂Q = 2(G + D) + 2TᵀD + 2(G + (c/2)D)Q²ᵀ``, ``D = QᵀG + GQᵀ``).
    ``t``: the forward's ``T`` (recomputed when not given). Dtypes as the forward."""
    q, q2, g = _check(q, "q", _FLOATS), _check(q2, "q2", _FLOATS), _check(g, "grad", _FLOATS)
    c4 = _c4(formula)
    if t is None:
        t = torch.add(q, q2, alpha=c4 / 2)
    qt = q.transpose(1, 2)
    with _Precision(tf32):
        d = torch.bmm(g, qt).baddbmm_(qt, g)  # QᵀG + GQᵀ (in place on temporaries)
        out = (g + d).baddbmm_(t.transpose(1, 2), d, beta=2.0, alpha=2.0)
        out.baddbmm_(torch.add(g, d, alpha=c4 / 2), q2.transpose(1, 2), alpha=2.0)
    return out


def blocks_forward(x: torch.Tensor, b: int, formula: str, tf32: bool, backend: str,
                   dtype: torch.dtype) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """CNP blocks ``(n, b, b)`` in ``dtype`` from upper triangles ``x``, and what
    :func:`blocks_backward` needs. No autograd: for use inside a Function (the layer's)."""
    if backend == "bmm":
        q = skew(x, b, dtype)
        y, q2, t = cnp_forward_bmm(q, formula, tf32)
        return y, (q, q2, t)
    y, q, q2 = _cnp_forward(_check(x, "x", _FLOATS), b, True, formula, tf32, dtype)
    return y, (q, q2)


def blocks_backward(saved: tuple[torch.Tensor, ...], g: torch.Tensor, b: int, formula: str,
                    tf32: bool, backend: str, x_dtype: torch.dtype) -> torch.Tensor:
    """The upper triangles' gradient (in ``x_dtype``) from the blocks' cotangent ``g``."""
    if backend == "bmm":
        q, q2, t = saved
        dq = cnp_backward_bmm(q, q2, g.contiguous().to(q.dtype), formula, tf32, t)
        return triu_grad(dq, b, x_dtype)
    q, q2 = saved
    return _cnp_backward(q, q2, g.contiguous(), formula, tf32, x_dtype)


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
    ``backend``: ``"bmm"`` or ``"triton"`` (default :data:`BACKEND`)."""
    backend = backend or BACKEND
    if backend not in ("bmm", "triton"):
        raise ValueError(f"cayley_neumann backend {backend!r}: use 'bmm' or 'triton'")
    if dtype not in _FLOATS:
        raise TypeError(f"cayley_neumann: dtype must be one of {_FLOATS}; got {dtype}")
    return CayleyNeumann.apply(x, b, formula, tf32, backend, dtype)


def rotations(oft_r: torch.Tensor, b: int, r_out: int, formula: str = "product",
              tf32: bool = False, backend: str | None = None):
    """``(R_out, R_in)`` from a layer's ``oft_R`` through the kernels (3 Neumann terms),
    float32."""
    y = cayley_neumann(oft_r, b, formula, tf32, backend)
    return y[:r_out], y[r_out:]
