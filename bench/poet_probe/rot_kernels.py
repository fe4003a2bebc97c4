"""Prototypes (fifth session, not used by xopt): a Triton block rotation that gathers its input
columns or scatters its output columns itself (instead of a separate gather kernel), and a
split-K Triton outer product. On an H100 both lost to a rowloop gather + cuBLAS bmm and to
cuBLAS's outer product (bench/RESULTS.md, fifth session; ``rotations.py`` times them)."""

import torch
import triton
import triton.language as tl


@triton.jit
def rot_kernel(
    x_ptr,
    gidx_ptr,
    r_ptr,
    sidx_ptr,
    out_ptr,
    T,
    sx,
    so,
    NB,
    B: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GATHER: tl.constexpr,
    SCATTER: tl.constexpr,
    TRANS: tl.constexpr,
):
    pid = tl.program_id(0)
    per_blk: tl.constexpr = B // BN
    n_tiles_n = NB * per_blk
    pid_m = pid // n_tiles_n
    pid_n = pid % n_tiles_n
    j = pid_n // per_blk
    c0 = (pid_n % per_blk) * BN
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < T
    r64 = rows.to(tl.int64)
    cols = c0 + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    rbase = r_ptr + j.to(tl.int64) * B * B
    for k0 in range(0, B, BK):
        ks = k0 + tl.arange(0, BK)
        if GATHER:
            src = tl.load(gidx_ptr + j * B + ks).to(tl.int64)
        else:
            src = (j * B + ks).to(tl.int64)
        a = tl.load(x_ptr + r64[:, None] * sx + src[None, :], mask=rmask[:, None], other=0.0)
        if TRANS:
            w = tl.load(rbase + cols[None, :] * B + ks[:, None])
        else:
            w = tl.load(rbase + ks[:, None] * B + cols[None, :])
        acc = tl.dot(a, w, acc)
    if SCATTER:
        dst = tl.load(sidx_ptr + j * B + cols).to(tl.int64)
    else:
        dst = (j * B + cols).to(tl.int64)
    tl.store(
        out_ptr + r64[:, None] * so + dst[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=rmask[:, None],
    )


def rot(
    x, r, gidx=None, sidx=None, trans=False, bm=128, bn=None, bk=64, warps=8, stages=3, out=None
):
    T, n = x.shape
    nb, b, _ = r.shape
    bn = bn or b
    out = torch.empty_like(x) if out is None else out
    grid = (triton.cdiv(T, bm) * nb * (b // bn),)
    rot_kernel[grid](
        x,
        gidx if gidx is not None else x,
        r,
        sidx if sidx is not None else x,
        out,
        T,
        x.stride(0),
        out.stride(0),
        nb,
        B=b,
        BM=bm,
        BN=bn,
        BK=bk,
        GATHER=gidx is not None,
        SCATTER=sidx is not None,
        TRANS=trans,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@triton.jit
def outer_kernel(
    a_ptr,
    g_ptr,
    part_ptr,
    T,
    sa,
    sg,
    NB,
    TSPLIT,
    B: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    # part[s, j, r, c] = sum_{t in split s} a[t, jB + r] g[t, jB + c]
    pid = tl.program_id(0)
    s = tl.program_id(1)
    tm: tl.constexpr = B // BM
    tn: tl.constexpr = B // BN
    j = pid // (tm * tn)
    rem = pid % (tm * tn)
    rr = (rem // tn) * BM + tl.arange(0, BM)
    cc = (rem % tn) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    t0 = s * TSPLIT
    for k0 in range(0, TSPLIT, BK):
        ts = (t0 + k0 + tl.arange(0, BK)).to(tl.int64)
        at = tl.load(a_ptr + ts[None, :] * sa + (j * B + rr)[:, None])  # [BM, BK]
        gt = tl.load(g_ptr + ts[:, None] * sg + (j * B + cc)[None, :])  # [BK, BN]
        acc = tl.dot(at, gt, acc)
    base = part_ptr + ((s * NB + j).to(tl.int64) * B) * B
    tl.store(base + rr[:, None] * B + cc[None, :], acc)


def outer(a, g, nb, split=2, bm=128, bn=128, bk=64, warps=8, stages=3):
    T, n = a.shape
    b = n // nb
    part = torch.empty((split, nb, b, b), device=a.device, dtype=torch.float32)
    grid = (nb * (b // bm) * (b // bn), split)
    outer_kernel[grid](
        a,
        g,
        part,
        T,
        a.stride(0),
        g.stride(0),
        nb,
        T // split,
        B=b,
        BM=bm,
        BN=bn,
        BK=bk,
        num_warps=warps,
        num_stages=stages,
    )
    return part.sum(0) if split > 1 else part[0]
