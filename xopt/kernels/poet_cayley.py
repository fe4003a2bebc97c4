"""POET-X's Cayley–Neumann series as Triton kernels on a batch of b×b blocks.

For ``k = 3`` Neumann terms every power of a skew ``Q`` that the series needs is a product
of ``Q`` and ``Q²`` (``Q³ = Q²Q``, ``Q⁴ = Q²Q²``), so one kernel reads those two matrices
and writes ``Y = I + 2(Q + Q² + Q²Q) + c·Q²Q²`` (``c = 1``: the product form, the
authors' GPU kernel; ``c = 2``: the Taylor form, their PyTorch fallback), tile by tile,
both products sharing each loaded tile of ``Q²``. The backward is two kernels: first
``D = QᵀG + GQᵀ`` (the cotangent reaching ``Q²``), then
``∂Q = 2(G + D) + (2Qᵀ + c Q²ᵀ) D + (2G + c D) Q²ᵀ``; transposes are strides, nothing
is copied. ``Q²`` itself comes from one batched matmul (cuBLAS) and is kept for the backward.

Two small kernels build ``Q`` from the stored upper triangles (half the parameters, as the
paper stores them) and reduce ``∂Q`` back onto them (``∂x = ∂Q[r, c] − ∂Q[c, r]``).

Precision: ``tl.dot`` on float32 defaults to TF32 on NVIDIA GPUs (10-bit mantissas, about
5e-4 relative per operand); these kernels ask for ``input_precision="ieee"`` by default so
the GPU result is float32-exact up to summation order, like the plain path and the golden
traces. ``tf32=True`` (what POETLinear asks for when the layer computes in bfloat16 or
float16, whose 7- or 10-bit mantissas the rotations are rounded to anyway) uses the tensor
cores instead; the IEEE path runs on the FMA units.
The series costs ``n·b³`` multiply-adds, a few percent of a layer's matmuls at b ≤ 512.

Backends (``backend=`` of :func:`cayley_neumann`, default :data:`BACKEND`): ``"triton"``,
the fused kernels above (float32); ``"bmm"``, the same series written with
``T = Q + (c/2)Q²`` (``Y = 2(Q + Q² + I/2) + 2Q²T``) as cuBLAS batched products with the
additions folded into ``baddbmm``'s α/β, in float32 (TF32 or IEEE products, as asked; set
for the call, restored after) or in bfloat16/float16 (``dtype=``: low-precision operands,
float32 accumulation, one rounding per product; what a bf16/fp16 POETLinear uses). On an
H100, 32 blocks of 256², forward+backward GPU time: 96 µs (bmm, bf16), 151 µs (bmm, TF32),
215 µs (fused kernels, TF32): ``"bmm"`` is the default.

References: :func:`skew_reference`, :func:`triu_grad_reference`,
:func:`cayley_neumann_reference` (plain PyTorch, the spec's math) and
:class:`CayleyNeumann` (the kernels with autograd). Tested on the CPU under
``TRITON_INTERPRET=1`` (tests/test_poet.py) and on a GPU by bench/poet_layer.py --check.
"""

from __future__ import annotations

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
def _dot(a, b, TF32: tl.constexpr):
    if TF32:
        return tl.dot(a, b, input_precision="tf32")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _block_tile(B, BM: tl.constexpr):
    """A program's block ``n`` (grid axis 0) and the rows and columns of its BM × BM output
    tile (grid axis 1, row-major over the block's tiles)."""
    tiles = tl.cdiv(B, BM)
    ti = tl.program_id(1) // tiles
    tj = tl.program_id(1) % tiles
    return (tl.program_id(0), ti * BM + tl.arange(0, BM), tj * BM + tl.arange(0, BM))


@triton.jit
def _tile(ptr, rows, cols, s_row, s_col, B):
    mask = (rows[:, None] < B) & (cols[None, :] < B)
    return tl.load(ptr + rows[:, None] * s_row + cols[None, :] * s_col, mask=mask, other=0.0)


@triton.jit
def _store_tile(ptr, rows, cols, s_row, s_col, B, value):
    mask = (rows[:, None] < B) & (cols[None, :] < B)
    tl.store(ptr + rows[:, None] * s_row + cols[None, :] * s_col, value, mask=mask)


@triton.jit
def _cnp_fwd_kernel(q_ptr, q2_ptr, y_ptr, B, C4, s_b, s_r, s_c,
                    BM: tl.constexpr, BK: tl.constexpr, TF32: tl.constexpr):
    # One program per (block, output tile). Y = 2((Q²Q + Q) + Q²) + C4·Q²Q² + I.
    n, rows, cols = _block_tile(B, BM)
    q = q_ptr + n * s_b
    q2 = q2_ptr + n * s_b
    acc3 = tl.zeros((BM, BM), dtype=tl.float32)
    acc4 = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, B, BK):
        ks = k0 + tl.arange(0, BK)
        a = _tile(q2, rows, ks, s_r, s_c, B)  # Q²[i, k], shared by both products
        acc3 += _dot(a, _tile(q, ks, cols, s_r, s_c, B), TF32)
        acc4 += _dot(a, _tile(q2, ks, cols, s_r, s_c, B), TF32)
    y = 2.0 * ((acc3 + _tile(q, rows, cols, s_r, s_c, B)) + _tile(q2, rows, cols, s_r, s_c, B))
    y = y + C4 * acc4
    y = y + tl.where(rows[:, None] == cols[None, :], 1.0, 0.0)
    _store_tile(y_ptr + n * s_b, rows, cols, s_r, s_c, B, y)


@triton.jit
def _cnp_bwd_d_kernel(q_ptr, g_ptr, d_ptr, B, s_b, s_r, s_c, BM: tl.constexpr, BK: tl.constexpr,
                      TF32: tl.constexpr):
    # D = QᵀG + GQᵀ, the transposes read through swapped strides.
    n, rows, cols = _block_tile(B, BM)
    q = q_ptr + n * s_b
    g = g_ptr + n * s_b
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, B, BK):
        ks = k0 + tl.arange(0, BK)
        acc += _dot(_tile(q, rows, ks, s_c, s_r, B), _tile(g, ks, cols, s_r, s_c, B), TF32)
        acc += _dot(_tile(g, rows, ks, s_r, s_c, B), _tile(q, ks, cols, s_c, s_r, B), TF32)
    _store_tile(d_ptr + n * s_b, rows, cols, s_r, s_c, B, acc)


@triton.jit
def _cnp_bwd_final_kernel(q_ptr, q2_ptr, g_ptr, d_ptr, out_ptr, B, C4, s_b, s_r, s_c,
                          BM: tl.constexpr, BK: tl.constexpr, TF32: tl.constexpr):
    # ∂Q = 2(G + D) + (2Qᵀ + C4·Q²ᵀ) D + (2G + C4·D) Q²ᵀ
    n, rows, cols = _block_tile(B, BM)
    q = q_ptr + n * s_b
    q2 = q2_ptr + n * s_b
    g = g_ptr + n * s_b
    d = d_ptr + n * s_b
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, B, BK):
        ks = k0 + tl.arange(0, BK)
        left = 2.0 * _tile(q, rows, ks, s_c, s_r, B) + C4 * _tile(q2, rows, ks, s_c, s_r, B)
        acc += _dot(left, _tile(d, ks, cols, s_r, s_c, B), TF32)
        left = 2.0 * _tile(g, rows, ks, s_r, s_c, B) + C4 * _tile(d, rows, ks, s_r, s_c, B)
        acc += _dot(left, _tile(q2, ks, cols, s_c, s_r, B), TF32)
    acc = acc + 2.0 * (_tile(g, rows, cols, s_r, s_c, B) + _tile(d, rows, cols, s_r, s_c, B))
    _store_tile(out_ptr + n * s_b, rows, cols, s_r, s_c, B, acc)


@triton.jit
def _square_kernel(q_ptr, out_ptr, B, s_b, s_r, s_c, BM: tl.constexpr, BK: tl.constexpr,
                   TF32: tl.constexpr):
    # Q² (kept for the backward)
    n, rows, cols = _block_tile(B, BM)
    q = q_ptr + n * s_b
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, B, BK):
        ks = k0 + tl.arange(0, BK)
        acc += _dot(_tile(q, rows, ks, s_r, s_c, B), _tile(q, ks, cols, s_r, s_c, B), TF32)
    _store_tile(out_ptr + n * s_b, rows, cols, s_r, s_c, B, acc)


# -- launchers -------------------------------------------------------------------------------


def _tiles(b: int) -> tuple[int, int]:
    bm = max(16, min(64, triton.next_power_of_2(b)))
    return bm, min(bm, 32)


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


def cnp_forward(q: torch.Tensor, formula: str = "product", tf32: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Y, Q²)`` for skew blocks ``q`` (``(n, b, b)`` float32).

    ``tf32=True`` lets the products use TF32 tensor cores (10-bit mantissas): for layers
    computed in bfloat16 (7-bit) the rotations lose nothing they keep; float32 layers
    leave it off (IEEE products, the parity path)."""
    q = _check(q, "q")
    n, b, _ = q.shape
    bm, bk = _tiles(b)
    grid = (n, triton.cdiv(b, bm) ** 2)
    q2 = torch.empty_like(q)
    _square_kernel[grid](q, q2, b, *q.stride(), BM=bm, BK=bk, TF32=tf32)
    y = torch.empty_like(q)
    _cnp_fwd_kernel[grid](q, q2, y, b, _c4(formula), *q.stride(), BM=bm, BK=bk, TF32=tf32)
    return y, q2


def cnp_backward(q: torch.Tensor, q2: torch.Tensor, g: torch.Tensor,
                 formula: str = "product", tf32: bool = False) -> torch.Tensor:
    """``∂⟨Y, G⟩/∂Q`` given ``Q``, ``Q²`` (from :func:`cnp_forward`) and ``G``."""
    q, q2, g = _check(q, "q"), _check(q2, "q2"), _check(g, "grad")
    n, b, _ = q.shape
    d = torch.empty_like(q)
    out = torch.empty_like(q)
    bm, bk = _tiles(b)
    grid = (n, triton.cdiv(b, bm) ** 2)
    _cnp_bwd_d_kernel[grid](q, g, d, b, *q.stride(), BM=bm, BK=bk, TF32=tf32)
    _cnp_bwd_final_kernel[grid](q, q2, g, d, out, b, _c4(formula), *q.stride(), BM=bm, BK=bk,
                                TF32=tf32)
    return out


#: "bmm" (cuBLAS batched products) or "triton" (the fused kernels)
BACKEND = "bmm"


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
        y = torch.baddbmm(base, q2, t, beta=2.0, alpha=2.0)
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
        d = torch.baddbmm(torch.bmm(g, qt), qt, g)  # QᵀG + GQᵀ
        out = torch.baddbmm(g + d, t.transpose(1, 2), d, beta=2.0, alpha=2.0)
        out = torch.baddbmm(out, torch.add(g, d, alpha=c4 / 2), q2.transpose(1, 2), alpha=2.0)
    return out


def blocks_forward(x: torch.Tensor, b: int, formula: str, tf32: bool, backend: str,
                   dtype: torch.dtype) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """CNP blocks ``(n, b, b)`` in ``dtype`` from upper triangles ``x``, and what
    :func:`blocks_backward` needs. No autograd: for use inside a Function (the layer's)."""
    if backend == "bmm":
        q = skew(x, b, dtype)
        y, q2, t = cnp_forward_bmm(q, formula, tf32)
        return y, (q, q2, t)
    q = skew(x, b, torch.float32)
    y, q2 = cnp_forward(q, formula, tf32)
    return y.to(dtype), (q, q2)


def blocks_backward(saved: tuple[torch.Tensor, ...], g: torch.Tensor, b: int, formula: str,
                    tf32: bool, backend: str, x_dtype: torch.dtype) -> torch.Tensor:
    """The upper triangles' gradient (in ``x_dtype``) from the blocks' cotangent ``g``."""
    if backend == "bmm":
        q, q2, t = saved
        dq = cnp_backward_bmm(q, q2, g.contiguous().to(q.dtype), formula, tf32, t)
    else:
        q, q2 = saved
        dq = cnp_backward(q, q2, g.contiguous().to(torch.float32), formula, tf32)
    return triu_grad(dq, b, x_dtype)


class CayleyNeumann(torch.autograd.Function):
    """``oft_R`` rows (upper triangles) → CNP blocks, with the fused kernels (or the
    batched-matmul backend) both ways. ``dtype``: the blocks' dtype; the bmm backend
    computes in it (float32, or bfloat16/float16 products with float32 accumulation), the
    fused kernels compute in float32 and cast. The gradient comes back in ``x``'s dtype."""

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
