"""Triton kernels shared by the learned optimizers: tile addressing, the Adafactor statistics
(row and column means of g²) and deterministic segmented sums.

Reductions never use atomics: a program writes its partial sums to its own place in a
scratch buffer and a later program adds them up in a fixed order, so two runs give the same
bits. The layout is :mod:`xopt.kernels.lopt_layout`'s.

Reference: :func:`xopt.specs.lopt.factored_update` (and ``torch.mean`` for the sums).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xopt.kernels import FP_FUSION
from xopt.kernels import lopt_layout as L

F32 = tl.float32


# -- addressing ---------------------------------------------------------------------------------


@triton.jit
def tile_of(meta_row, local):
    """(b, ta, tb) of a program's tile from its index among its tensor's programs."""
    nta = tl.load(meta_row + 9)   # NTA
    ntb = tl.load(meta_row + 10)  # NTB
    per_b = nta * ntb
    b = local // per_b
    r = local - b * per_b
    ta = r // ntb
    tb = r - ta * ntb
    return b, ta, tb


@triton.jit
def batch_offset(b, bs1, s0, s1):
    o0 = b // bs1
    return o0 * s0 + (b - o0 * bs1) * s1


@triton.jit
def ptr_f32(table, t, col, ncols: tl.constexpr):
    """Column ``col`` of an int64 pointer table row ``t``, as a float32 pointer."""
    return tl.load(table + t * ncols + col).to(tl.pointer_type(tl.float32))


@triton.jit
def cat32(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15,
          f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31):
    """32 vectors [BLOCK] → [BLOCK, 2, 2, 2, 2, 2] whose reshape to [BLOCK, 32] holds f_i in
    column i (``tl.join`` adds its axis last, so pairs are taken 16, 8, 4, 2, 1 apart)."""
    p0 = tl.join(f0, f16)
    p1 = tl.join(f1, f17)
    p2 = tl.join(f2, f18)
    p3 = tl.join(f3, f19)
    p4 = tl.join(f4, f20)
    p5 = tl.join(f5, f21)
    p6 = tl.join(f6, f22)
    p7 = tl.join(f7, f23)
    p8 = tl.join(f8, f24)
    p9 = tl.join(f9, f25)
    p10 = tl.join(f10, f26)
    p11 = tl.join(f11, f27)
    p12 = tl.join(f12, f28)
    p13 = tl.join(f13, f29)
    p14 = tl.join(f14, f30)
    p15 = tl.join(f15, f31)
    q0 = tl.join(p0, p8)
    q1 = tl.join(p1, p9)
    q2 = tl.join(p2, p10)
    q3 = tl.join(p3, p11)
    q4 = tl.join(p4, p12)
    q5 = tl.join(p5, p13)
    q6 = tl.join(p6, p14)
    q7 = tl.join(p7, p15)
    r0 = tl.join(q0, q4)
    r1 = tl.join(q1, q5)
    r2 = tl.join(q2, q6)
    r3 = tl.join(q3, q7)
    s0 = tl.join(r0, r2)
    s1 = tl.join(r1, r3)
    return tl.join(s0, s1)


@triton.jit
def cat8(f0, f1, f2, f3, f4, f5, f6, f7):
    """8 vectors → [BLOCK, 2, 2, 2], column i of the [BLOCK, 8] reshape holds f_i."""
    p0 = tl.join(f0, f4)
    p1 = tl.join(f1, f5)
    p2 = tl.join(f2, f6)
    p3 = tl.join(f3, f7)
    return tl.join(tl.join(p0, p2), tl.join(p1, p3))


# -- pass 1: partial sums of g² over each tile's two axes (+ VeLO's old-state sums) --------------


@triton.jit
def _g_sub(gp, boff, ia, ib, sap, sbp, ia_n, ib_n, n):
    """``(g, inside)`` on the sub-tile ``ia × ib`` of a tile (g 0 outside the tensor)."""
    off = boff + ia[:, None].to(tl.int64) * sap + ib[None, :].to(tl.int64) * sbp
    mask = (ia[:, None] < ia_n) & (ib[None, :] < ib_n) & (off < n)
    return tl.load(gp + off, mask=mask, other=0.0), mask


@triton.jit
def _g2_sums(g, inside, ia, ia_n, pa_rows, CLIP_G: tl.constexpr):
    """A sub-tile's g² + 1e-30 (g clipped to ±1000 with ``CLIP_G``; 0 outside the tensor):
    its row sums stored at ``pa_rows + ia``, its column sums returned."""
    if CLIP_G:
        g = tl.minimum(tl.maximum(g, -1000.0), 1000.0)
    g2 = tl.where(inside, g * g + 1e-30, 0.0)
    tl.store(pa_rows + ia, tl.sum(g2, axis=1), mask=ia < ia_n)
    return tl.sum(g2, axis=0)


@triton.jit
def stats1_kernel(meta, prog, ptrs, pa, pb, sums4,
                  CLIP_G: tl.constexpr, MOM_SUMS: tl.constexpr, NPTR: tl.constexpr,
                  NF: tl.constexpr, TA: tl.constexpr, TB: tl.constexpr, SA: tl.constexpr,
                  PREFETCH: tl.constexpr = False):
    """Per tile: Σ_b (g² + 1e-30) per row a and Σ_a per column b (factored tensors), and with
    MOM_SUMS Σ m_k (k < 3) and Σ rms of the accumulators before the update (VeLO's LSTM
    inputs), written to ``sums4[pid, 0:4]`` (float64: each sub-tile's float32 sum added in
    float64). ptrs columns: 0 p, 1 g, 2 m, 3 rms."""
    pid = tl.program_id(0)
    t = tl.load(prog + pid)
    row = meta + t * NF
    n = tl.load(row + 0)
    fact = tl.load(row + 1)
    ia_n = tl.load(row + 2)
    ib_n = tl.load(row + 3)
    sap = tl.load(row + 4)
    sbp = tl.load(row + 5)
    bs1 = tl.load(row + 6)
    nta = tl.load(row + 9)
    ntb = tl.load(row + 10)
    if MOM_SUMS:
        start = tl.load(row + 11)
    else:
        start = tl.load(row + 12)
    b, ta, tb = tile_of(row, pid - start)
    boff = batch_offset(b, bs1, tl.load(row + 7), tl.load(row + 8))
    gp = ptr_f32(ptrs, t, 1, NPTR)
    sa_i = tl.arange(0, SA)
    ib = tb * TB + tl.arange(0, TB)
    a0 = ta * TA
    n_sub = tl.minimum(TA, ia_n - a0)
    acc_b = tl.zeros([TB], F32)
    acc4 = tl.zeros([4], tl.float64)
    lanes4 = tl.arange(0, 4)
    if PREFETCH:  # factored tensors' g only (no MOM_SUMS): the next sub-tile's g loaded
        # before this one's sums, twice the loads in flight (the same sums, in order)
        g_next, m_next = _g_sub(gp, boff, a0 + sa_i, ib, sap, sbp, a0 + n_sub, ib_n, n)
        for s in range(0, n_sub, SA):
            ia = a0 + s + sa_i
            g = g_next
            mask = m_next
            g_next, m_next = _g_sub(gp, boff, ia + SA, ib, sap, sbp, a0 + n_sub, ib_n,
                                    n)
            acc_b += _g2_sums(g, mask, ia, ia_n, pa + tl.load(row + 20) + (b * ntb + tb) * ia_n,
                              CLIP_G)
    else:
        for s in range(0, n_sub, SA):
            ia = a0 + s + sa_i
            off = boff + ia[:, None].to(tl.int64) * sap + ib[None, :].to(tl.int64) * sbp
            mask = (ia[:, None] < ia_n) & (ib[None, :] < ib_n) & (off < n)
            if fact != 0:
                g = tl.load(gp + off, mask=mask, other=0.0)
                acc_b += _g2_sums(g, mask, ia, ia_n,
                                  pa + tl.load(row + 20) + (b * ntb + tb) * ia_n, CLIP_G)
            if MOM_SUMS:
                mp = ptr_f32(ptrs, t, 2, NPTR)
                rp = ptr_f32(ptrs, t, 3, NPTR)
                m0 = tl.sum(tl.sum(tl.load(mp + off * 3, mask=mask, other=0.0), axis=1), axis=0)
                m1 = tl.sum(tl.sum(tl.load(mp + off * 3 + 1, mask=mask, other=0.0), axis=1), axis=0)
                m2 = tl.sum(tl.sum(tl.load(mp + off * 3 + 2, mask=mask, other=0.0), axis=1), axis=0)
                r0 = tl.sum(tl.sum(tl.load(rp + off, mask=mask, other=0.0), axis=1), axis=0)
                acc4 += tl.where(lanes4 == 0, m0.to(tl.float64), tl.where(lanes4 == 1, m1,
                                                           tl.where(lanes4 == 2, m2, r0)))
    if fact != 0:
        tl.store(pb + tl.load(row + 21) + (b * nta + ta) * ib_n + ib, acc_b, mask=ib < ib_n)
    if MOM_SUMS:
        tl.store(sums4 + pid * 4 + lanes4, acc4)


# -- pass 1b: the new v_row / v_col from the partial sums ------------------------------------


@triton.jit
def fac_finalize_kernel(meta, fin, ptrs, pa, pb, decays,
                        NPTR: tl.constexpr, NF: tl.constexpr, FB: tl.constexpr,
                        CH: tl.constexpr):
    """``v ← c·v + (1 − c)·mean(g² + 1e-30)`` for a block of FB entries of one batch of one
    statistic, the partial sums added in order. ptrs columns: 4 v_row, 5 v_col."""
    pid = tl.program_id(0)
    t = tl.load(fin + pid * 3)
    which = tl.load(fin + pid * 3 + 1)
    local = tl.load(fin + pid * 3 + 2)
    row = meta + t * NF
    ia_n = tl.load(row + 2)
    ib_n = tl.load(row + 3)
    bs1 = tl.load(row + 6)
    nta = tl.load(row + 9)
    ntb = tl.load(row + 10)
    a_is_d0 = tl.load(row + 13)
    if which == 0:   # summed over b: entries indexed by a
        n_ent = ia_n
        n_chunks = ntb
        base = pa + tl.load(row + 20)
        div = ib_n
        to_row = a_is_d0 == 0   # b is d0: a row statistic
    else:            # summed over a: entries indexed by b
        n_ent = ib_n
        n_chunks = nta
        base = pb + tl.load(row + 21)
        div = ia_n
        to_row = a_is_d0 != 0
    blocks = (n_ent + FB - 1) // FB
    b = local // blocks
    e = (local - b * blocks) * FB + tl.arange(0, FB)
    emask = e < n_ent
    ch = tl.arange(0, CH)
    acc = tl.zeros([FB], F32)
    for c0 in range(0, n_chunks, CH):
        c = c0 + ch
        x = tl.load(base + (b * n_chunks + c[:, None]) * n_ent + e[None, :],
                    mask=(c[:, None] < n_chunks) & emask[None, :], other=0.0)
        acc += tl.sum(x, axis=0)
    mean = acc / div.to(F32)
    if to_row:
        vp = ptr_f32(ptrs, t, 4, NPTR)
        idx = batch_offset(b, bs1, tl.load(row + 14), tl.load(row + 15)) + e * tl.load(row + 16)
    else:
        vp = ptr_f32(ptrs, t, 5, NPTR)
        idx = batch_offset(b, bs1, tl.load(row + 17), tl.load(row + 18)) + e * tl.load(row + 19)
    for k in tl.static_range(3):
        c = tl.minimum(tl.maximum(tl.load(decays + k), 0.0), 1.0)
        v = tl.load(vp + idx * 3 + k, mask=emask, other=0.0)
        tl.store(vp + idx * 3 + k, c * v + (1.0 - c) * mean, mask=emask)


@triton.jit
def rcm_kernel(meta, rprog, ptrs, rcm, NPTR: tl.constexpr, NF: tl.constexpr,
               BLOCK: tl.constexpr):
    """``mean over the d1 axis of the new v_row`` per batch index and decay (the
    ``row_col_mean`` of :func:`xopt.specs.lopt.factored_update`)."""
    pid = tl.program_id(0)
    t = tl.load(rprog + pid * 2)
    b = tl.load(rprog + pid * 2 + 1)
    row = meta + t * NF
    nd1 = tl.load(row + 25)
    base = batch_offset(b, tl.load(row + 6), tl.load(row + 14), tl.load(row + 15))
    rd1 = tl.load(row + 16)
    vp = ptr_f32(ptrs, t, 4, NPTR)
    i = tl.arange(0, BLOCK)
    k = tl.arange(0, 4)
    acc = tl.zeros([4], F32)
    for i0 in range(0, nd1, BLOCK):
        ii = i0 + i
        x = tl.load(vp + (base + ii[:, None] * rd1) * 3 + k[None, :],
                    mask=(ii[:, None] < nd1) & (k[None, :] < 3), other=0.0)
        acc += tl.sum(x, axis=0)
    tl.store(rcm + tl.load(row + 22) + b * 3 + k, acc / nd1.to(F32), mask=k < 3)


# -- deterministic segmented sums --------------------------------------------------------------


@triton.jit
def seg_sum_kernel(x, out, segs, C: tl.constexpr, RB: tl.constexpr):
    """``out[i] = Σ_{r in segment i} x[r]`` over rows of C floats, in row order (blocks of RB
    rows summed as a tree, blocks one after another): the same bits every run."""
    pid = tl.program_id(0)
    first = tl.load(segs + pid * 2)
    count = tl.load(segs + pid * 2 + 1)
    r = tl.arange(0, RB)
    c = tl.arange(0, C)
    acc = tl.zeros([C], x.dtype.element_ty)
    for r0 in range(0, count, RB):
        rr = r0 + r
        v = tl.load(x + (first + rr[:, None]).to(tl.int64) * C + c[None, :],
                    mask=rr[:, None] < count, other=0.0)
        acc += tl.sum(v, axis=0)
    tl.store(out + pid.to(tl.int64) * C + c, acc)


def seg_sum(rows: torch.Tensor, lay: L.Layout) -> torch.Tensor:
    """Per-tensor sums of per-program rows ``[n_prog_all, C]`` → ``[n_tensors, C]``, in two
    fixed-order levels (chunks of SEG_CHUNK rows, then each tensor's chunks)."""
    c = rows.shape[1]
    mid = torch.empty((lay.seg1.shape[0], c), dtype=rows.dtype, device=rows.device)
    seg_sum_kernel[(lay.seg1.shape[0],)](rows, mid, lay.seg1, C=c, RB=64, **FP_FUSION)
    out = torch.empty((lay.seg2.shape[0], c), dtype=rows.dtype, device=rows.device)
    seg_sum_kernel[(lay.seg2.shape[0],)](mid, out, lay.seg2, C=c, RB=64, **FP_FUSION)
    return out


#: the g² pass (:func:`stats1_kernel` without MOM_SUMS): the next sub-tile's g loaded
#: before this one's sums, on 2 warps per program (the fastest pair for this pass, bound by
#: memory latency; the same sums, tests/test_kernels_velo_fold.py)
G2_PREFETCH = True
G2_WARPS = 2


def factored_pass(lay: L.Layout, ptrs: torch.Tensor, decays: torch.Tensor, *,
                  clip_g: bool, mom_sums: bool, npt: int, sa: int = 4
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Pass 1 (+ finalize): updates every factored tensor's ``v_row``/``v_col`` in place and
    returns ``(rcm [rcm_size], sums4 [n_tensors, 4] or None)``. ``sa``: the sub-tile rows
    of :func:`stats1_kernel` (a power of 2 up to TA)."""
    dev = lay.meta.device
    pa = torch.empty((max(lay.pa_size, 1),), dtype=torch.float32, device=dev)
    pb = torch.empty((max(lay.pb_size, 1),), dtype=torch.float32, device=dev)
    sums4 = None
    if mom_sums:
        part = torch.empty((max(lay.n_prog_all, 1), 4), dtype=torch.float64, device=dev)
        if lay.n_prog_all:
            stats1_kernel[(lay.n_prog_all,)](lay.meta, lay.prog_all, ptrs, pa, pb, part,
                                             CLIP_G=clip_g, MOM_SUMS=True, NPTR=npt,
                                             NF=L.NFIELDS, TA=L.TA, TB=L.TB, SA=sa, **FP_FUSION)
        sums4 = seg_sum(part[:lay.n_prog_all], lay).float()
    elif lay.n_prog_fac:
        stats1_kernel[(lay.n_prog_fac,)](lay.meta, lay.prog_fac, ptrs, pa, pb, pa,
                                         CLIP_G=clip_g, MOM_SUMS=False, NPTR=npt,
                                         NF=L.NFIELDS, TA=L.TA, TB=L.TB, SA=sa,
                                         PREFETCH=G2_PREFETCH, num_warps=G2_WARPS, **FP_FUSION)
    rcm = None
    if lay.any_factored:
        fac_finalize_kernel[(lay.fin_prog.shape[0],)](lay.meta, lay.fin_prog, ptrs, pa, pb,
                                                      decays, NPTR=npt, NF=L.NFIELDS,
                                                      FB=L.FIN_BLOCK, CH=32, **FP_FUSION)
        rcm = torch.empty((lay.rcm_size,), dtype=torch.float32, device=dev)
        rcm_kernel[(lay.rcm_prog.shape[0],)](lay.meta, lay.rcm_prog, ptrs, rcm, NPTR=npt,
                                             NF=L.NFIELDS, BLOCK=128, **FP_FUSION)
    return rcm, sums4


# -- the per-element accumulators and MLP, shared by the fused passes ----------------------


@triton.jit
def load_tile(row, t, b, ia, ib, ptrs, NPTR: tl.constexpr, BLOCK: tl.constexpr):
    """Flat offsets, mask and the factored indices of a sub-tile [SA, TB] as [BLOCK]."""
    n = tl.load(row + 0)
    ia_n = tl.load(row + 2)
    ib_n = tl.load(row + 3)
    bs1 = tl.load(row + 6)
    boff = batch_offset(b, bs1, tl.load(row + 7), tl.load(row + 8))
    off2 = boff + ia[:, None].to(tl.int64) * tl.load(row + 4) \
        + ib[None, :].to(tl.int64) * tl.load(row + 5)
    mask2 = (ia[:, None] < ia_n) & (ib[None, :] < ib_n) & (off2 < n)
    a_is_d0 = tl.load(row + 13)
    iaf = ia[:, None] + 0 * ib[None, :]
    ibf = ib[None, :] + 0 * ia[:, None]
    i_d0 = tl.where(a_is_d0 != 0, iaf, ibf)
    i_d1 = tl.where(a_is_d0 != 0, ibf, iaf)
    ridx = batch_offset(b, bs1, tl.load(row + 14), tl.load(row + 15)) + i_d1 * tl.load(row + 16)
    cidx = batch_offset(b, bs1, tl.load(row + 17), tl.load(row + 18)) + i_d0 * tl.load(row + 19)
    return (tl.reshape(off2, [BLOCK]), tl.reshape(mask2, [BLOCK]), tl.reshape(ridx, [BLOCK]),
            tl.reshape(cidx, [BLOCK]))


@triton.jit
def accumulate(fact, off, mask, ridx, cidx, g, m, rms_p, vr, vc, vd, dec, rcm_b,
               FM_EPS: tl.constexpr):
    """One decay's Adafactor quantities for the elements ``off``: (R, C, FG, FM, V) with R, C
    the row/column statistics (v_diag twice when unfactored), FG the factor that multiplies
    g into fac_g, FM the factor that multiplies m (``row_factor·col_factor``, or
    ``(v_diag + FM_EPS)^-½``), V the new v_diag (unfactored; else unused)."""
    if fact != 0:
        r = tl.load(vr + ridx, mask=mask, other=1.0)
        c = tl.load(vc + cidx, mask=mask, other=1.0)
        rf = tl.math.rsqrt(tl.maximum(r / (rcm_b + 1e-9), 1e-9))
        cf = tl.math.rsqrt(tl.maximum(c, 1e-9))
        v = r
        fg = rf * cf
        fm = rf * cf
    else:
        cd = tl.minimum(tl.maximum(dec, 0.0), 1.0)
        v = cd * tl.load(vd, mask=mask, other=0.0) + (1.0 - cd) * (g * g + 1e-30)
        r = v
        c = v
        fg = tl.math.rsqrt(tl.maximum(v + 1e-9, 1e-9))
        fm = tl.math.rsqrt(v + FM_EPS)
    return r, c, fg, fm, v


@triton.jit
def program_tile(meta, pids, prog, rcm, NF: tl.constexpr):
    """A per-element program's place: ``pids[program_id]`` is its index ``gpid`` among all
    programs (the layout's ``prog_all``; a launch may cover a subset). Returns ``(gpid, t,
    row, fact, ia_n, b, ta, tb, rc0, rc1, rc2)``: its tensor ``t`` and that tensor's layout
    row, whether it is factored, the length of its tile's first axis, the tile ``(b, ta,
    tb)`` and the three row-column means of batch ``b`` (unfactored tensors read 3 unused
    numbers)."""
    gpid = tl.load(pids + tl.program_id(0))
    t = tl.load(prog + gpid)
    row = meta + t * NF
    fact = tl.load(row + 1)
    ia_n = tl.load(row + 2)
    b, ta, tb = tile_of(row, gpid - tl.load(row + 11))
    rcm_b = rcm + tl.load(row + 22) + b * 3
    return (gpid, t, row, fact, ia_n, b, ta, tb, tl.load(rcm_b), tl.load(rcm_b + 1),
            tl.load(rcm_b + 2))


@triton.jit
def tensor_ptrs(ptrs, t, NPTR: tl.constexpr):
    """Tensor ``t``'s float32 pointers ``(p, g, m, rms, v_row, v_col, v_diag)``."""
    return (ptr_f32(ptrs, t, 0, NPTR), ptr_f32(ptrs, t, 1, NPTR), ptr_f32(ptrs, t, 2, NPTR),
            ptr_f32(ptrs, t, 3, NPTR), ptr_f32(ptrs, t, 4, NPTR), ptr_f32(ptrs, t, 5, NPTR),
            ptr_f32(ptrs, t, 6, NPTR))


@triton.jit
def load_decays(decays):
    """``(md0, md1, md2, rd, fd0, fd1, fd2)``: the momentum, rms (clipped to [0, 1]) and
    Adafactor decays of the step, from ``decays`` [7]."""
    return (tl.load(decays + 0), tl.load(decays + 1), tl.load(decays + 2),
            tl.minimum(tl.maximum(tl.load(decays + 3), 0.0), 1.0), tl.load(decays + 4),
            tl.load(decays + 5), tl.load(decays + 6))


@triton.jit
def accumulate3(fact, off, mask, ridx, cidx, g, m0, m1, m2, rp, vr, vc, vd, fd0, fd1, fd2,
                rc0, rc1, rc2, FM_EPS: tl.constexpr):
    """:func:`accumulate` for the three decays: ``(R0, C0, FG0, FM0, V0, R1, …, V2, v3)``
    with ``v3`` the elements' ``v_diag`` pointers (``[..., 3]`` interleaved)."""
    r3 = ridx * 3
    c3 = cidx * 3
    v3 = vd + off * 3
    R0, C0, FG0, FM0, V0 = accumulate(fact, off, mask, r3, c3, g, m0, rp, vr, vc, v3, fd0,
                                      rc0, FM_EPS)
    R1, C1, FG1, FM1, V1 = accumulate(fact, off, mask, r3, c3, g, m1, rp, vr + 1, vc + 1,
                                      v3 + 1, fd1, rc1, FM_EPS)
    R2, C2, FG2, FM2, V2 = accumulate(fact, off, mask, r3, c3, g, m2, rp, vr + 2, vc + 2,
                                      v3 + 2, fd2, rc2, FM_EPS)
    return (R0, C0, FG0, FM0, V0, R1, C1, FG1, FM1, V1, R2, C2, FG2, FM2, V2, v3)


@triton.jit
def rsqrt_features(rms, R0, R1, R2, C0, C1, C2):
    """``(rsqrt(rms + 1e-6), rsqrt(R_k + 1e-8) for k < 3, rsqrt(C_k + 1e-8) for k < 3)``:
    the reciprocal-root features both learned optimizers read."""
    return (tl.math.rsqrt(rms + 1e-6), tl.math.rsqrt(R0 + 1e-8), tl.math.rsqrt(R1 + 1e-8),
            tl.math.rsqrt(R2 + 1e-8), tl.math.rsqrt(C0 + 1e-8), tl.math.rsqrt(C1 + 1e-8),
            tl.math.rsqrt(C2 + 1e-8))


@triton.jit
def axis_layout(row, ptrs, t, b, bs1, NPTR: tl.constexpr):
    """Where a factored tensor's tile finds ``v_row`` and ``v_col`` (the folded kernels):
    ``(b_row, a_row, rbase, rstr, cbase, cstr, vb, va)``: whether the b axis (else the a
    axis) indexes ``v_row``, batch ``b``'s base offset and the position stride of ``v_row``
    and of ``v_col``, and the pointers of the statistic the b axis and the a axis index."""
    b_row = tl.load(row + 13) != 0  # a is d0: the b axis (d1) indexes v_row
    rbase = batch_offset(b, bs1, tl.load(row + 14), tl.load(row + 15))
    cbase = batch_offset(b, bs1, tl.load(row + 17), tl.load(row + 18))
    vr = tl.load(ptrs + t * NPTR + 4)
    vc = tl.load(ptrs + t * NPTR + 5)
    vb = tl.where(b_row, vr, vc).to(tl.pointer_type(tl.float32))
    va = tl.where(b_row, vc, vr).to(tl.pointer_type(tl.float32))
    return (b_row, b_row == 0, rbase, tl.load(row + 16), cbase, tl.load(row + 19), vb, va)


@triton.jit
def axis_stats(vp, idx, msk, is_row, rc0, rc1, rc2):
    """One axis's statistics for a vector of positions ``idx`` (flat indices into ``v_row``
    or ``v_col``, [..., 3] interleaved, at ``vp``): ``(v0, v1, v2, s0, s1, s2, f0, f1,
    f2)`` with ``v_k`` the statistic of decay k, ``s_k = rsqrt(v_k + 1e-8)`` and ``f_k``
    its factor: ``rsqrt(max(v_k / (rc_k + 1e-9), 1e-9))`` for rows (``rc_k`` the
    row-column mean), ``rsqrt(max(v_k, 1e-9))`` for columns."""
    v0 = tl.load(vp + idx * 3, mask=msk, other=1.0)
    v1 = tl.load(vp + idx * 3 + 1, mask=msk, other=1.0)
    v2 = tl.load(vp + idx * 3 + 2, mask=msk, other=1.0)
    d0 = tl.where(is_row, rc0 + 1e-9, 1.0)
    d1 = tl.where(is_row, rc1 + 1e-9, 1.0)
    d2 = tl.where(is_row, rc2 + 1e-9, 1.0)
    return (v0, v1, v2, tl.math.rsqrt(v0 + 1e-8), tl.math.rsqrt(v1 + 1e-8),
            tl.math.rsqrt(v2 + 1e-8), tl.math.rsqrt(tl.maximum(v0 / d0, 1e-9)),
            tl.math.rsqrt(tl.maximum(v1 / d1, 1e-9)), tl.math.rsqrt(tl.maximum(v2 / d2, 1e-9)))


@triton.jit
def round_tf32(x):
    """x rounded to the nearest TF32 number (10 explicit mantissa bits; ties away from
    zero), so that a TF32 matmul, which ignores the low 13 bits, reads it unchanged."""
    return ((x.to(tl.int32, bitcast=True) + 4096) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def dot3(x, w_hi, w_lo, PREC: tl.constexpr, TERMS: tl.constexpr):
    """``x @ w`` [BLOCK, K] × [K, N] on the tensor cores.

    ``PREC="tf32x3"`` (exact mode): split precision. ``x = x_hi + x_lo + r`` with
    ``x_hi = round_tf32(x)``, ``x_lo = round_tf32(x − x_hi)`` (|r| ≤ 2^-22·|x|), and ``w``
    likewise by the host (:func:`split_weights`), then ``x_lo·w_hi + x_hi·w_lo
    (+ x_lo·w_lo if TERMS = 4) + x_hi·w_hi``, small terms first, each a TF32 product that
    is exact, accumulated in float32. ``PREC="tf32"`` (fast mode): one TF32 product."""
    return dot3_acc(x, w_hi, w_lo, tl.zeros([x.shape[0], w_hi.shape[1]], tl.float32), PREC,
                    TERMS, True)


@triton.jit
def dot3_acc(x, w_hi, w_lo, acc, PREC: tl.constexpr, TERMS: tl.constexpr,
             LO_RN: tl.constexpr):
    """``acc + x @ w`` as :func:`dot3` (the products added to ``acc`` [BLOCK, N], small
    first). ``LO_RN=False`` (exact mode): ``x_lo = x − x_hi`` is passed as float32 and the
    tensor cores read its TF32 truncation: for x in [2^e, 2^(e+1)), |x_lo| ≤ 2^-11·2^e, so
    the error is below 2^-22·2^e instead of 2^-23·2^e, for two integer ops less per
    operand."""
    if PREC == "tf32x3":
        x_hi = round_tf32(x)
        if LO_RN:
            x_lo = round_tf32(x - x_hi)
        else:
            x_lo = x - x_hi
        acc = tl.dot(x_lo, w_hi, acc, input_precision="tf32")
        acc = tl.dot(x_hi, w_lo, acc, input_precision="tf32")
        if TERMS == 4:
            acc = tl.dot(x_lo, w_lo, acc, input_precision="tf32")
        return tl.dot(x_hi, w_hi, acc, input_precision="tf32")
    else:
        return tl.dot(x, w_hi, acc, input_precision="tf32")


def _round_tf32_host(w: torch.Tensor) -> torch.Tensor:
    return ((w.contiguous().view(torch.int32) + 4096) & -8192).view(torch.float32)


def split_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Host side of :func:`dot3`: ``(w_hi, w_lo)`` = ``round_tf32(w)``,
    ``round_tf32(w − w_hi)``."""
    w = w.contiguous()
    hi = _round_tf32_host(w)
    return hi.contiguous(), _round_tf32_host(w - hi).contiguous()


@triton.jit
def mlp_dot(x, w0h, w0l, b0, w1h, w1l, b1, wh, bh, wl0, wl1, bl0, bl1, HP: tl.constexpr,
            NHID: tl.constexpr, PREC: tl.constexpr, TERMS: tl.constexpr):
    """small_fc_lopt's MLP on the tensor cores: ``x`` [BLOCK, 32] (the normalized features,
    zero-padded) → ``(direction, magnitude)`` [BLOCK].

    Loaded once per program by the caller: the first layer ``w0h``/``w0l`` [32, HP] (TF32
    hi/lo halves, :func:`split_weights`) and ``b0`` [HP]; the first hidden layer
    ``w1h``/``w1l`` [HP, HP] and ``b1`` [HP] (unused when NHID = 0); the output layer's two
    used columns ``wl0``, ``wl1`` [HP] and biases ``bl0``, ``bl1``. Further hidden layers
    (NHID > 1) are read from ``wh`` (hi halves [NHID, HP, HP], then the lo halves) and ``bh``
    [NHID, HP] inside the call. Hidden layers use :func:`dot3`; the output layer (2
    columns) is float32 FMAs, a sum over HP per output, whatever PREC."""
    hc = tl.arange(0, HP)
    h = tl.maximum(dot3(x, w0h, w0l, PREC, TERMS) + b0[None, :], 0.0)
    if NHID > 0:
        h = tl.maximum(dot3(h, w1h, w1l, PREC, TERMS) + b1[None, :], 0.0)
    for i in tl.static_range(1, NHID):
        wofs = i * HP * HP + hc[:, None] * HP + hc[None, :]
        w_hi = tl.load(wh + wofs)
        w_lo = tl.load(wh + NHID * HP * HP + wofs)
        h = dot3(h, w_hi, w_lo, PREC, TERMS) + tl.load(bh + i * HP + hc)[None, :]
        h = tl.maximum(h, 0.0)
    direction = tl.sum(h * wl0[None, :], axis=1) + bl0
    magnitude = tl.sum(h * wl1[None, :], axis=1) + bl1
    return direction, magnitude


@triton.jit
def store_update(outp, mp, rp, off, mask, p, step, lr, lrwd, write_step, m0, m1, m2, rms):
    """The end of a fused step: ``out = step`` (``write_step``) or the new parameter
    ``p − (lr·step + lr·λ·p)``, and the accumulators ``m`` (three interleaved) and ``rms``
    stored back."""
    newp = p - (lr * step + lrwd * p)
    tl.store(outp + off, tl.where(write_step != 0, step, newp), mask=mask)
    tl.store(mp + off * 3, m0, mask=mask)
    tl.store(mp + off * 3 + 1, m1, mask=mask)
    tl.store(mp + off * 3 + 2, m2, mask=mask)
    tl.store(rp + off, rms, mask=mask)


@triton.jit
def msq(acc, f, mask):
    """``acc + f²`` where ``mask``, ``acc`` elsewhere (a per-thread sum of squares, in
    ``acc``'s dtype: f converted first)."""
    x = f.to(acc.dtype)
    return acc + tl.where(mask, x * x, 0.0)


@triton.jit
def sq(acc, f):
    """``acc + f²`` in ``acc``'s dtype (f converted first)."""
    x = f.to(acc.dtype)
    return acc + x * x


@triton.jit
def rank1(h0, h1, h2, h3, f, k: tl.constexpr, inv, w0):
    """The first layer of a 4-wide MLP, one feature at a time (no feature tile):
    ``h_j += (f · inv[k]) · w0[k, j]`` for j < 4, float32 FMAs. ``f`` [BLOCK]: feature k
    before normalization; ``inv``: the tensor's normalizers; ``w0`` [K, 4] row-major."""
    x = f * tl.load(inv + k)
    w = w0 + k * 4
    return (h0 + x * tl.load(w), h1 + x * tl.load(w + 1), h2 + x * tl.load(w + 2),
            h3 + x * tl.load(w + 3))


@triton.jit
def _dense4(h0, h1, h2, h3, w, b, j: tl.constexpr, N: tl.constexpr):
    """Output j of ``h @ w + b`` for a [4, N] row-major ``w`` (4 FMAs)."""
    return tl.load(b + j) + h0 * tl.load(w + j) + h1 * tl.load(w + N + j) \
        + h2 * tl.load(w + 2 * N + j) + h3 * tl.load(w + 3 * N + j)


@triton.jit
def mlp4_tail(h0, h1, h2, h3, b0, wh, bh, wl, bl, NHID: tl.constexpr):
    """The rest of a 4-wide MLP after :func:`rank1`: ReLU(h + b0), NHID hidden layers
    (``wh`` [NHID, 4, 4], ``bh`` [NHID, 4]), then the two outputs used, ``(direction,
    magnitude)`` = columns 0 and 1 of ``h @ wl + bl`` (``wl`` [4, 16], ``bl`` [16]).
    Float32 FMAs throughout (narrower MLPs are zero-padded to 4)."""
    h0 = tl.maximum(h0 + tl.load(b0), 0.0)
    h1 = tl.maximum(h1 + tl.load(b0 + 1), 0.0)
    h2 = tl.maximum(h2 + tl.load(b0 + 2), 0.0)
    h3 = tl.maximum(h3 + tl.load(b0 + 3), 0.0)
    for i in tl.static_range(NHID):
        w = wh + i * 16
        b = bh + i * 4
        n0 = tl.maximum(_dense4(h0, h1, h2, h3, w, b, 0, 4), 0.0)
        n1 = tl.maximum(_dense4(h0, h1, h2, h3, w, b, 1, 4), 0.0)
        n2 = tl.maximum(_dense4(h0, h1, h2, h3, w, b, 2, 4), 0.0)
        n3 = tl.maximum(_dense4(h0, h1, h2, h3, w, b, 3, 4), 0.0)
        h0, h1, h2, h3 = n0, n1, n2, n3
    return (_dense4(h0, h1, h2, h3, wl, bl, 0, 16), _dense4(h0, h1, h2, h3, wl, bl, 1, 16))
