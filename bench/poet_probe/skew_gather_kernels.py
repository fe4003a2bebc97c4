"""Kernels of the fifth session's sweeps: the skew blocks as square tiles with the mirror
stored transposed (xopt's kernel until df9c86a), launchers of the whole-row kernel that
replaced it (poet_cayley._skew_kernel) at given settings, and a persistent gather holding
the index vector in registers (slower than the rowloop gather; not used)."""

import torch
import triton
import triton.language as tl


@triton.jit
def skew_tiles_kernel(x_ptr, q_ptr, eye_ptr, B, M, EYE: tl.constexpr, T: tl.constexpr):
    """One [T, T] tile on or above the diagonal of one block: ``Q[r, c] = x[k(r, c)]``
    (``r < c``, the triangle read along its rows), its mirror ``Q[c, r] = −x[k(r, c)]``
    stored as the transposed tile (both stores row-wise); with ``EYE`` the identity's two
    tiles too (for the product form's ``B = I + Q²``, accumulated onto it in place)."""
    ti = tl.program_id(1)
    tj = tl.program_id(2)
    if tj >= ti:
        n = tl.program_id(0).to(tl.int64)
        a = tl.arange(0, T)
        r, c = (ti * T + a)[:, None], (tj * T + a)[None, :]
        rm, cm = (tj * T + a)[:, None], (ti * T + a)[None, :]  # the mirror tile's rows, cols
        inb = (r < B) & (c < B)
        inm = (rm < B) & (cm < B) & (rm > cm)
        k = r * B - (r * (r + 1)) // 2 + (c - r - 1)  # row-major strict upper index
        v = tl.load(x_ptr + n * M + k, mask=inb & (r < c), other=0.0).to(tl.float32)
        base = n * B * B
        tl.store(q_ptr + base + r * B + c, v.to(q_ptr.dtype.element_ty), mask=inb & (r <= c))
        tl.store(q_ptr + base + rm * B + cm, tl.trans(-v).to(q_ptr.dtype.element_ty), mask=inm)
        if EYE:
            one = tl.where(r == c, 1.0, 0.0)
            tl.store(
                eye_ptr + base + r * B + c, one.to(eye_ptr.dtype.element_ty), mask=inb & (r <= c)
            )
            tl.store(
                eye_ptr + base + rm * B + cm,
                tl.zeros([T, T], tl.float32).to(eye_ptr.dtype.element_ty),
                mask=inm,
            )


@triton.jit
def gather_persist_kernel(
    x_ptr, idx_ptr, out_ptr, N, D, s_x, s_o, ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    # D == BLOCK_D: the index vector held in registers across this program's rows
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    idx = tl.load(idx_ptr + cols, mask=cmask, other=0).to(tl.int64)
    step = tl.num_programs(0) * ROWS
    for r0 in range(tl.program_id(0) * ROWS, N, step):
        rows = r0 + tl.arange(0, ROWS)
        rmask = rows < N
        r64 = rows.to(tl.int64)
        mask = rmask[:, None] & cmask[None, :]
        v = tl.load(x_ptr + r64[:, None] * s_x + idx[None, :], mask=mask, cache_modifier=".ca")
        tl.store(out_ptr + r64[:, None] * s_o + cols[None, :], v, mask=mask)


def gather_persist(x, idx, grid, rows=1, warps=8):
    n, d = x.shape
    out = torch.empty_like(x)
    gather_persist_kernel[(grid,)](
        x,
        idx,
        out,
        n,
        d,
        x.stride(0),
        out.stride(0),
        ROWS=rows,
        BLOCK_D=triton.next_power_of_2(d),
        num_warps=warps,
    )
    return out


def skew_rows(x, b, rows, bc, warps):
    """xopt's whole-row skew kernel with the identity, ``rows`` rows per program, ``bc``
    columns at a time, on ``warps`` warps: ``(Q, I)``."""
    from xopt.kernels import poet_cayley as K

    n, m = x.shape
    q = torch.empty((n, b, b), dtype=x.dtype, device=x.device)
    i = torch.empty_like(q)
    K._skew_kernel[(n, triton.cdiv(b, rows))](x, q, i, b, m, EYE=True, ROWS=rows,
                                              BC=min(bc, b), num_warps=warps)
    return q, i
