"""Fused Triton step of VeLO (learned_optimization's ``HyperV2`` in VeLO's configuration).

All of a model's tensors in six launches (eight with the fold below: 3 and 5 are two each)
plus a handful of batched torch ops:

1. ``stats1`` (factored tensors): partial sums of the clipped g² over each tile's two axes;
2. ``fac_finalize`` + ``rcm``: the new ``v_row``/``v_col`` and their row-column means;
3. :func:`velo_stats_kernel` (every tensor; one launch folded over the factored tensors'
   tiles, one unfolded over the others', see below): Σ feature² of the 30 MLP inputs
   (float32 per thread over at most TA / SA terms, then float64 per tile and per tensor),
   and Σ (m_k − mean m_k)², Σ (rms − mean m_k)² of the accumulators before the update (float32
   per element and per thread, as the features², then float64: :data:`VAR_F32`), for the
   LSTM inputs' variances (two-pass), all in a fixed order. The means come from per-program
   sums of m_k, rms that the last step's fused pass left (the sums of what it stored;
   :meth:`VeLOTriton._carried`), or, when those may not describe the state, from
   :func:`velo_mom_sums_kernel` before the step (the same bits): per-lane sums, reduced at
   the end of the pass that sums them by a fixed float64 tree (:func:`_mom_store`);
4. torch, batched over tensors: the LSTM inputs (mean_rms, var_m, var_rms from the float64
   sums in float64, rounded once), one LSTM step for all tensors
   (:func:`xopt.specs.velo.lstm_step`, the plain path's function, in float64), the
   hypernetwork's per-tensor MLP weights ``100·mean_k(controls_k·bank_k)`` for every
   tensor in one float64 product, rounded to float32 and gathered into one padded table,
   the first layer's rows then times the tensor's normalizers (:data:`NORM_W`); all of it
   :func:`lstm_glue`, compiled on CUDA (:data:`COMPILE_GLUE`: eager, it is about 90 small
   kernels);
5. :func:`velo_fused_kernel` (folded and unfolded launches, as 3): accumulators, features,
   normalization, the tensor's own MLP, the step and the parameter update; and per-program
   sums of the accumulators it stores (float32 per lane over the program's sub-tiles, then
   :func:`_mom_store`'s float64 tree), for the next step.

On a CUDA device, 1-5 are recorded once into a CUDA graph and replayed
(:class:`VeLOTriton`): the host then spends a few copies and one launch per step.

**Row and column features folded (factored tensors, :data:`FOLD`).** Of the 30 features,
12 depend on one axis only: ``v_row`` (15-17), ``v_col`` (18-20), ``rsqrt(v_row + 1e-8)``
(21-23), ``rsqrt(v_col + 1e-8)`` (24-26). A tile's program owns TB fixed positions ``ib``
of its inner axis and walks SA positions ``ia`` of the outer one at a time; which of the
two indexes ``v_row`` depends on the tensor's strides (``A_IS_D0``). Their statistics, the
rsqrt's and the row and column factors of ``fac_g`` (11-13) and ``m·row_factor·
col_factor`` (27-29) are computed per position (:func:`xopt.kernels.lopt_common.axis_stats`:
the b axis's once per program, the a axis's once per sub-tile), and per element only the
product of the two factors. The fused pass adds the 12 features' first-layer terms as
``a_term[ia] + b_term[ib]`` (4 floats per position, :func:`_axis_terms`: ``Σ_k (inv_k ·
W0[k, :]) · f_k`` over an axis's 6 features, ``inv`` the tensor's normalizers), after the
per-element features 0-14 and before 27-29, instead of 12 per-element rank-1 updates, 12
rsqrt's, 3 divisions and 6 gathers of ``v_row``/``v_col``. In the statistics pass an axis
feature's Σ over a tile's elements is Σ over the tile's positions on that axis of f²
(float32 per position, then float64) times the tile's extent on the other axis
(:func:`_axis_sq`). Unfactored tensors (rank < 2: their "row" and "column" features are the
per-element ``v_diag``) keep the unfolded path (:data:`FOLD` = False runs it for every
tensor). The launches of 3 and 5 take a list of program indices (``pids``, into the
layout's ``prog_all``; the per-program outputs keep those indices). The fold and
:data:`NORM_W` together cut the fused loop's instructions by about a third.

Precision: the per-element MLP (30 → 4 → 4 → 3 at VeLO's size) is float32 FMAs, the first
layer one feature at a time (:func:`_rank1`, no feature tile; 30 per element unfolded,
18 folded): about 150 FMAs per element unfolded, cheaper than any
tensor-core tile of that width, so ``"exact"`` and ``"fast"`` run the same kernel
(``"fast"`` is accepted for symmetry with small_fc_lopt). MLPs up to 4 wide are supported
(:func:`check_supported`).

:func:`reference_step` is the pure-PyTorch reference (the spec's functions, as
:class:`xopt.torch.VeLO`'s plain path calls them).
"""

from __future__ import annotations

import operator
import os
import weakref
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from xopt.kernels import FP_FUSION
from xopt.kernels import lopt_common as C
from xopt.kernels import lopt_graph as G
from xopt.kernels import lopt_layout as L
from xopt.specs import arrays
from xopt.specs import velo as _spec
from xopt.specs.arrays import to_device

__all__ = ["VeLOTriton", "reference_step"]

# Tuning constants (measured on an H100; the benchmark is bench/lopt_step.py). None of them
# changes the step's bits except where its comment says so.

#: sub-tile rows (SA × TB elements per sub-tile) of the statistics and the fused pass,
#: warps and software-pipelining stages of the per-element kernels (shared with
#: small_fc_lopt's unfolded kernels)
SA_STATS = 2
SA = 4
STAGES = 2
WARPS = 4
#: register caps (``maxnreg``; 0: the compiler's choice): 80 gives the statistics kernel,
#: bound by loads in flight, more programs per SM; any cap slows the fused kernel
MAXNREG_STATS = 80
MAXNREG = 0
#: the LSTM inputs' variances two-pass (pass 1 also sums every tensor's m_k and rms, the
#: statistics pass then sums (m_k − mean)² in float32 per element) rather than one-pass
#: from float64 sums of m_k, m_k², which cancel catastrophically
TWO_PASS = True
#: per-thread sums of the features² (but p²) in float32 over at most TA / SA terms, then
#: float64 (as accurate as float64 throughout at these lengths, and much faster)
STATS_F32 = True
#: the statistics pass's per-thread sums of (m_k − mean)², (rms − mean)² (VAR_F32) and of
#: p² (P2_F32) in float32 over at most TA / SA_STATS terms, then float64 per tile, as the
#: other features² (float64 per element costs a conversion per sum and element, for no
#: accuracy the tests can see)
VAR_F32 = True
P2_F32 = True
#: the loss buffer's update and t/N inside the CUDA graph, so a step needs no host sync
GRAPH_LOSS = True
#: fold the 12 row and column features of factored tensors (see the module docstring;
#: False runs the unfolded kernels for every tensor, as tests/test_kernels_velo_fold.py
#: does to compare them)
FOLD = True
#: the fused pass's first-layer rows times the tensor's normalizers, once per tensor
#: (``W0[k, :] · inv_k``, torch before the launch; the kernel's h_j += f_k · that) instead
#: of f_k · inv_k per element
NORM_W = True
#: the LSTM and the hypernetwork's mixing in float64 (inputs and results rounded once to
#: float32), not float32 as the plain path: the step-size head ``lr_mult = hidden · w + b``
#: cancels (Σ|hidden_i·w_i| is 60-90 × |lr_mult| on the golden cases), so a float32 LSTM
#: moves the step by up to ~3e-6 of itself, and two float32 evaluations from inputs a
#: rounding apart differ by as much; float64 holds the step within 1e-6 of the float64
#: oracle (tests/test_kernels_lopt.py) at the cost of plain's own float32 rounding there
#: (tests/test_parity_findings.py pins both sides)
LSTM_F64 = True
_VERSION = operator.attrgetter("_version")
_DPTR = torch.Tensor.data_ptr
_CALL = operator.call
#: per-lane sums of the accumulators in the fused pass (and velo_mom_sums_kernel): float32
#: over at most TA / SA terms, then float64 (float64 lanes slow the fused pass for nothing)
MOM_ACC = tl.float32
NPTR = G.NPTR
NFEAT = 30


@triton.jit
def _mom_acc(a0, a1, a2, a3, m0, m1, m2, rms, mask):
    """Per-lane sums in ``a0``'s dtype (:data:`MOM_ACC`; over a tile's sub-tiles, in loop
    order) of the accumulators ``m_k`` (k < 3) and ``rms`` [BLOCK], 0 where masked: the
    same lanes, values and order in
    :func:`velo_mom_sums_kernel` (the old accumulators, loaded) and the fused pass (the
    new ones, as stored), so that both give the same bits."""
    return (a0 + tl.where(mask, m0, 0.0).to(a0.dtype),
            a1 + tl.where(mask, m1, 0.0).to(a1.dtype),
            a2 + tl.where(mask, m2, 0.0).to(a2.dtype),
            a3 + tl.where(mask, rms, 0.0).to(a3.dtype))


@triton.jit
def _pair_sum(x, N: tl.constexpr):
    """Σ over the first axis of ``x`` [N, 4] (N a power of two, 2 ≤ N ≤ 4096) as a fixed
    binary tree: rows 2i and 2i+1 added, N/2 rows left, and so on. Each addition has two
    operands, so the result does not depend on how the compiler lays ``x`` out over
    threads (a + b = b + a exactly): any two kernels give the same bits. (Each step below
    runs when N ≥ its row count, so that x has exactly that many rows then.)"""
    if N >= 4096:
        x = tl.sum(tl.reshape(x, [2048, 2, 4]), axis=1)
    if N >= 2048:
        x = tl.sum(tl.reshape(x, [1024, 2, 4]), axis=1)
    if N >= 1024:
        x = tl.sum(tl.reshape(x, [512, 2, 4]), axis=1)
    if N >= 512:
        x = tl.sum(tl.reshape(x, [256, 2, 4]), axis=1)
    if N >= 256:
        x = tl.sum(tl.reshape(x, [128, 2, 4]), axis=1)
    if N >= 128:
        x = tl.sum(tl.reshape(x, [64, 2, 4]), axis=1)
    if N >= 64:
        x = tl.sum(tl.reshape(x, [32, 2, 4]), axis=1)
    if N >= 32:
        x = tl.sum(tl.reshape(x, [16, 2, 4]), axis=1)
    if N >= 16:
        x = tl.sum(tl.reshape(x, [8, 2, 4]), axis=1)
    if N >= 8:
        x = tl.sum(tl.reshape(x, [4, 2, 4]), axis=1)
    if N >= 4:
        x = tl.sum(tl.reshape(x, [2, 2, 4]), axis=1)
    return tl.sum(x, axis=0)


@triton.jit
def _mom_store(out, pid, a0, a1, a2, a3, BLOCK: tl.constexpr):
    """``out[pid, 0:4]`` (float64) = Σ over the lanes of :func:`_mom_acc`'s sums
    (:func:`_pair_sum`): Σm_0, Σm_1, Σm_2, Σrms of the program's tile, the carried sums
    (``out``: [n_prog, 4]).

    Reduced here, at the end of the pass that sums them: storing the lanes as they are
    ([n_prog, 4, SA·TB]: 84 MiB on ViT-B/16) for a separate reduction kernel gives the
    same bits and is slower."""
    x = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), [BLOCK, 4]).to(tl.float64)
    tl.store(out + pid.to(tl.int64) * 4 + tl.arange(0, 4), _pair_sum(x, BLOCK))


@triton.jit
def _load_sub(gp, pp, mp, rp, off, mask):
    """A sub-tile's g (unclipped), p, m_0, m_1, m_2, rms [BLOCK] (0 where masked)."""
    return (tl.load(gp + off, mask=mask, other=0.0), tl.load(pp + off, mask=mask, other=0.0),
            tl.load(mp + off * 3, mask=mask, other=0.0),
            tl.load(mp + off * 3 + 1, mask=mask, other=0.0),
            tl.load(mp + off * 3 + 2, mask=mask, other=0.0),
            tl.load(rp + off, mask=mask, other=0.0))


@triton.jit
def _rank1(h0, h1, h2, h3, f, k, inv, w0, WN: tl.constexpr):
    """The first layer of the 4-wide MLP, one feature (no feature tile): ``h_j += x · w0[k,
    j]`` for j < 4, float32 FMAs, ``f`` [...] feature k before normalization, ``w0`` [32, 4]
    row-major. ``WN``: ``w0``'s rows already times the tensor's normalizers (the fused
    launch's table, :meth:`VeLOTriton._body`), ``x = f``; else ``x = f · inv[k]``
    (:func:`xopt.kernels.lopt_common.rank1`). ``k`` may be a run-time index."""
    if WN:
        x = f
    else:
        x = f * tl.load(inv + k)
    w = w0 + k * 4
    return (h0 + x * tl.load(w), h1 + x * tl.load(w + 1), h2 + x * tl.load(w + 2),
            h3 + x * tl.load(w + 3))


@triton.jit
def _axis_terms(v0, v1, v2, s0, s1, s2, fv, inv, w0, WN: tl.constexpr):
    """The first-layer terms of one axis's 6 features per position of that axis (folded
    path): ``h_j = Σ_k v_k · (inv[fv+k] · W0[fv+k, j]) + Σ_k s_k · (inv[fv+6+k] ·
    W0[fv+6+k, j])``, j < 4, float32 FMAs in that order. ``v_k``, ``s_k``
    [positions]: the axis's statistic ``v_row``/``v_col`` of decay k and ``rsqrt(v_k +
    1e-8)`` (:func:`xopt.kernels.lopt_common.axis_stats`); ``fv``: 15 for ``v_row``
    (features 15-17 and 21-23), 18 for ``v_col`` (18-20, 24-26); ``inv``: the tensor's
    normalizers, ``w0`` its first layer [32, 4] (``WN``: as :func:`_rank1`)."""
    z = tl.zeros_like(v0)
    h0, h1, h2, h3 = _rank1(z, z, z, z, v0, fv, inv, w0, WN)
    h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, v1, fv + 1, inv, w0, WN)
    h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, v2, fv + 2, inv, w0, WN)
    h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, s0, fv + 6, inv, w0, WN)
    h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, s1, fv + 7, inv, w0, WN)
    return _rank1(h0, h1, h2, h3, s2, fv + 8, inv, w0, WN)


@triton.jit
def _axis_sq(cols, fv, vp, idx, msk, is_row, rc0, rc1, rc2, n, ACC: tl.constexpr):
    """The statistics pass's folded features of one axis over a tile: [32] float64, 0 but
    at the axis's 6 features (``fv`` as :func:`_axis_terms`), there the tile's Σ over its
    elements of the feature², as Σ over the tile's positions ``idx`` on that axis (``msk``:
    those inside the tensor) of f² (f in float32, f² in ``ACC``) times ``n``, the tile's
    extent on the other axis (float64). The statistics are loaded here
    (:func:`xopt.kernels.lopt_common.axis_stats`)."""
    v0, v1, v2, s0, s1, s2, _, _, _ = C.axis_stats(vp, idx, msk, is_row, rc0, rc1, rc2)
    z = tl.zeros(idx.shape, ACC)
    return (tl.where(cols == fv, tl.sum(C.msq(z, v0, msk).to(tl.float64)) * n, 0.0)
            + tl.where(cols == fv + 1, tl.sum(C.msq(z, v1, msk).to(tl.float64)) * n, 0.0)
            + tl.where(cols == fv + 2, tl.sum(C.msq(z, v2, msk).to(tl.float64)) * n, 0.0)
            + tl.where(cols == fv + 6, tl.sum(C.msq(z, s0, msk).to(tl.float64)) * n, 0.0)
            + tl.where(cols == fv + 7, tl.sum(C.msq(z, s1, msk).to(tl.float64)) * n, 0.0)
            + tl.where(cols == fv + 8, tl.sum(C.msq(z, s2, msk).to(tl.float64)) * n, 0.0))


@triton.jit
def _velo_body(meta, prog, pids, ptrs, rcm, decays, mu, norm, scal, w0, b0, wh, bh, wl, bl,
               part, exp_mult, step_mult, FUSED: tl.constexpr, TWO_PASS: tl.constexpr,
               ACC: tl.constexpr, VACC: tl.constexpr, PACC: tl.constexpr, NHID: tl.constexpr,
               NPTR: tl.constexpr, NF: tl.constexpr, TA: tl.constexpr, TB: tl.constexpr,
               SA: tl.constexpr, FOLD: tl.constexpr, WN: tl.constexpr):
    """One tile [TA, TB] of one tensor, in sub-tiles of SA × TB elements; the program's
    index among all programs is ``gpid = pids[program_id]`` (the launch covers those
    programs), and its outputs go to row ``gpid``.

    ``FUSED=False`` (statistics): Σ over the tile of the 30 features² → ``part[gpid, 0:32]``
    (per thread in float32, at most TA / SA terms, then in float64), and of the old m_k, rms
    and their squares (float64 throughout: the LSTM inputs' variances, taken one-pass)
    → ``part[gpid, 32:40]`` = Σm_0, Σm_1, Σm_2, Σrms, Σm_0², Σm_1², Σm_2², Σrms².
    ``FUSED=True``: (with TWO_PASS) the sums over the tile of the new m_k, rms (the next
    step's old sums) → ``part[gpid, 0:4]`` (float64, :func:`_mom_store`), and the tensor's
    4-wide MLP (weights ``w0`` [n, 32, 4], ``b0`` [n, 4], ``wh``
    [n, NHID, 4, 4], ``bh`` [n, NHID, 4], ``wl`` [n, 4, 16], ``bl`` [n, 16]), its first layer
    one feature at a time (:func:`_rank1`; ``WN``: ``w0``'s rows already times the
    normalizers ``norm``, else multiplied per element), and the update.
    ``FOLD=True`` (factored tensors only): features 15-26 per axis position, see the module
    docstring (the statistics: their Σ f² per position times the other axis's extent,
    :func:`_axis_sq`; the fused pass: their first-layer terms, :func:`_axis_terms`).

    Loads: the fused pass issues the next sub-tile's (g, p, m_k, rms) before computing the
    current one (:func:`velo_fused_kernel` gives the figures); the statistics pass loads each
    sub-tile where it computes it (:func:`velo_stats_kernel`). The same arithmetic either
    way."""
    HP: tl.constexpr = 4
    BLOCK: tl.constexpr = SA * TB
    gpid, t, row, fact, ia_n, b, ta, tb, rc0, rc1, rc2 = C.program_tile(meta, pids, prog,
                                                                        rcm, NF)
    pp, gp, mp, rp, vr, vc, vd = C.tensor_ptrs(ptrs, t, NPTR)
    md0, md1, md2, rd, fd0, fd1, fd2 = C.load_decays(decays)
    cols = tl.arange(0, 32)
    c8 = tl.arange(0, 8)
    if FUSED:
        invp = norm + t * 32
        outp = C.ptr_f32(ptrs, t, 7, NPTR)
        lr = tl.load(scal + t * 8)
        lrwd = tl.load(scal + t * 8 + 1)
        write_step = tl.load(scal + t * 8 + 2)
        lr_mult = tl.load(scal + t * 8 + 3)
        pscale = tl.load(scal + t * 8 + 4)
        w0t = w0 + t * (32 * HP + HP + NHID * (HP * HP + HP) + HP * 16 + 16)  # one table
        b0t = w0t + 32 * HP
        wht = b0t + HP
        bht = wht + NHID * HP * HP
        wlt = bht + NHID * HP
        blt = wlt + HP * 16
        if TWO_PASS:  # per-lane sums of the new m_k, rms (the next step's old ones)
            n0 = tl.zeros([BLOCK], ACC)
            n1 = n0
            n2 = n0
            n3 = n0
    else:
        # per-thread sums of the 30 features² (ACC: float64, or float32 over at most TA / SA
        # terms; p² always float64) and, for the LSTM inputs' variances, of
        # (m_k − mean m_k)², (rms − mean m_k)² (TWO_PASS) or of m_k, rms and their squares
        zf = tl.zeros([BLOCK], ACC)
        zd = tl.zeros([BLOCK], tl.float64)
        if TWO_PASS:
            zv = tl.zeros([BLOCK], VACC)
        else:
            zv = zd
        q0 = zf
        q1 = zf
        q2 = tl.zeros([BLOCK], PACC)
        q3 = zf
        q4 = zf
        q5 = zf
        q6 = zf
        q7 = zf
        q8 = zf
        q9 = zf
        q10 = zf
        q11 = zf
        q12 = zf
        q13 = zf
        q14 = zf
        q15 = zf
        q16 = zf
        q17 = zf
        q18 = zf
        q19 = zf
        q20 = zf
        q21 = zf
        q22 = zf
        q23 = zf
        q24 = zf
        q25 = zf
        q26 = zf
        q27 = zf
        q28 = zf
        q29 = zf
        if TWO_PASS:
            mu0 = tl.load(mu + t * 4)
            mu1 = tl.load(mu + t * 4 + 1)
            mu2 = tl.load(mu + t * 4 + 2)
        u0 = zv
        u1 = zv
        u2 = zv
        u3 = zv
        u4 = zv
        u5 = zv
        u6 = zd
        u7 = zd
    sa_i = tl.arange(0, SA)
    ib = tb * TB + tl.arange(0, TB)
    a0 = ta * TA
    n_sub = tl.minimum(TA, ia_n - a0)
    if FOLD:
        # factored tensor: the b axis (TB positions ib, fixed per program) and the a axis
        # (SA positions per sub-tile) each index v_row or v_col (A_IS_D0); their statistics,
        # rsqrt's and factors per position (C.axis_stats), the b axis's once per program
        ib_n = tl.load(row + 3)
        bs1 = tl.load(row + 6)
        b_row, a_row, rbase, rstr, cbase, cstr, vpb, vpa = C.axis_layout(row, ptrs, t, b, bs1,
                                                                          NPTR)
        fvb = tl.where(b_row, 15, 18)  # the axes' first features (_axis_terms)
        fva = tl.where(a_row, 15, 18)
        mb = ib < ib_n
        bidx = tl.where(b_row, rbase + ib * rstr, cbase + ib * cstr)
        vb0, vb1, vb2, sb0, sb1, sb2, fb0, fb1, fb2 = C.axis_stats(vpb, bidx, mb, b_row, rc0,
                                                                   rc1, rc2)
        if FUSED:  # the b axis's first-layer terms [TB] (4 hidden units)
            tb0, tb1, tb2, tb3 = _axis_terms(vb0, vb1, vb2, sb0, sb1, sb2, fvb, invp, w0t, WN)
    if FUSED:  # the first sub-tile's loads (then each iteration issues the next one's)
        off_n, mask_n, ridx_n, cidx_n = C.load_tile(row, t, b, a0 + sa_i, ib, ptrs, NPTR,
                                                    BLOCK)
        g_n, p_n, om0_n, om1_n, om2_n, orms_n = _load_sub(gp, pp, mp, rp, off_n, mask_n)
    for s in range(0, n_sub, SA):
        if FUSED:
            off, mask, ridx, cidx = off_n, mask_n, ridx_n, cidx_n
            g, p, om0, om1, om2, orms = g_n, p_n, om0_n, om1_n, om2_n, orms_n
            # the next sub-tile's loads, in flight while this one is computed (none past
            # the tile's last sub-tile: its rows then set to ia_n, which load_tile masks)
            ia_x = tl.where(s + SA < n_sub, a0 + s + SA + sa_i, ia_n)
            off_n, mask_n, ridx_n, cidx_n = C.load_tile(row, t, b, ia_x, ib, ptrs, NPTR,
                                                        BLOCK)
            g_n, p_n, om0_n, om1_n, om2_n, orms_n = _load_sub(gp, pp, mp, rp, off_n, mask_n)
        else:
            ia = a0 + s + sa_i
            off, mask, ridx, cidx = C.load_tile(row, t, b, ia, ib, ptrs, NPTR, BLOCK)
            g, p, om0, om1, om2, orms = _load_sub(gp, pp, mp, rp, off, mask)
        g = tl.minimum(tl.maximum(g, -1000.0), 1000.0)
        m0 = md0 * om0 + (1 - md0) * g
        m1 = md1 * om1 + (1 - md1) * g
        m2 = md2 * om2 + (1 - md2) * g
        rms = rd * orms + (1 - rd) * (g * g)
        if FOLD:
            # this sub-tile's a positions; row factor × column factor per element
            ia_c = a0 + s + sa_i
            ma = ia_c < ia_n
            aidx = tl.where(a_row, rbase + ia_c * rstr, cbase + ia_c * cstr)
            va0, va1, va2, sa0, sa1, sa2, fa0, fa1, fa2 = C.axis_stats(vpa, aidx, ma, a_row,
                                                                       rc0, rc1, rc2)
            FG0 = tl.reshape(fa0[:, None] * fb0[None, :], [BLOCK])
            FG1 = tl.reshape(fa1[:, None] * fb1[None, :], [BLOCK])
            FG2 = tl.reshape(fa2[:, None] * fb2[None, :], [BLOCK])
            FM0 = FG0
            FM1 = FG1
            FM2 = FG2
            rr = tl.math.rsqrt(rms + 1e-6)
        else:
            R0, C0, FG0, FM0, V0, R1, C1, FG1, FM1, V1, R2, C2, FG2, FM2, V2, v3 = \
                C.accumulate3(fact, off, mask, ridx, cidx, g, m0, m1, m2, rp, vr, vc, vd, fd0,
                              fd1, fd2, rc0, rc1, rc2, 0.0)
            rr, rsr0, rsr1, rsr2, rsc0, rsc1, rsc2 = C.rsqrt_features(rms, R0, R1, R2, C0, C1,
                                                                      C2)
        gc = tl.minimum(tl.maximum(g, -0.1), 0.1)
        z = tl.zeros([BLOCK], tl.float32)
        if FUSED:
            # the tensor's 4-wide MLP, the first layer feature by feature (spec order)
            h0, h1, h2, h3 = _rank1(z, z, z, z, g, 0, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, gc, 1, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, p, 2, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, m0, 3, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, m1, 4, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, m2, 5, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, rms, 6, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, m0 * rr, 7, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, m1 * rr, 8, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, m2 * rr, 9, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, rr, 10, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, g * FG0, 11, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, g * FG1, 12, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, g * FG2, 13, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, g * rr, 14, invp, w0t, WN)
            if FOLD:  # features 15-26: the a axis's terms [SA] + the b axis's [TB]
                ta0, ta1, ta2, ta3 = _axis_terms(va0, va1, va2, sa0, sa1, sa2, fva, invp, w0t,
                                                  WN)
                h0 += tl.reshape(ta0[:, None] + tb0[None, :], [BLOCK])
                h1 += tl.reshape(ta1[:, None] + tb1[None, :], [BLOCK])
                h2 += tl.reshape(ta2[:, None] + tb2[None, :], [BLOCK])
                h3 += tl.reshape(ta3[:, None] + tb3[None, :], [BLOCK])
            else:
                h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, R0, 15, invp, w0t, WN)
                h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, R1, 16, invp, w0t, WN)
                h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, R2, 17, invp, w0t, WN)
                h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, C0, 18, invp, w0t, WN)
                h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, C1, 19, invp, w0t, WN)
                h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, C2, 20, invp, w0t, WN)
                h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, rsr0, 21, invp, w0t, WN)
                h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, rsr1, 22, invp, w0t, WN)
                h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, rsr2, 23, invp, w0t, WN)
                h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, rsc0, 24, invp, w0t, WN)
                h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, rsc1, 25, invp, w0t, WN)
                h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, rsc2, 26, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, m0 * FM0, 27, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, m1 * FM1, 28, invp, w0t, WN)
            h0, h1, h2, h3 = _rank1(h0, h1, h2, h3, m2 * FM2, 29, invp, w0t, WN)
            direction, magnitude = C.mlp4_tail(h0, h1, h2, h3, b0t, wht, bht, wlt, blt, NHID)
            step = direction * (pscale * tl.exp(magnitude * exp_mult)) * step_mult
            step = lr_mult * step
            C.store_update(outp, mp, rp, off, mask, p, step, lr, lrwd, write_step, m0, m1, m2,
                           rms)
            if TWO_PASS:
                n0, n1, n2, n3 = _mom_acc(n0, n1, n2, n3, m0, m1, m2, rms, mask)
            if not FOLD:
                if fact == 0:
                    tl.store(v3, V0, mask=mask)
                    tl.store(v3 + 1, V1, mask=mask)
                    tl.store(v3 + 2, V2, mask=mask)
        else:
            # masked elements: the loads gave 0, so g, clip(g), p, m_k and rms are 0 there;
            # the other features are masked
            q0 = C.sq(q0, g)
            q1 = C.sq(q1, gc)
            q2 = C.sq(q2, p)  # float64: mean p² sets the LSTM inputs' scale
            q3 = C.sq(q3, m0)
            q4 = C.sq(q4, m1)
            q5 = C.sq(q5, m2)
            q6 = C.sq(q6, rms)
            q7 = C.msq(q7, m0 * rr, mask)
            q8 = C.msq(q8, m1 * rr, mask)
            q9 = C.msq(q9, m2 * rr, mask)
            q10 = C.msq(q10, rr, mask)
            q11 = C.msq(q11, g * FG0, mask)
            q12 = C.msq(q12, g * FG1, mask)
            q13 = C.msq(q13, g * FG2, mask)
            q14 = C.msq(q14, g * rr, mask)
            if not FOLD:  # (folded: features 15-26 per axis position, after the loop)
                q15 = C.msq(q15, R0, mask)
                q16 = C.msq(q16, R1, mask)
                q17 = C.msq(q17, R2, mask)
                q18 = C.msq(q18, C0, mask)
                q19 = C.msq(q19, C1, mask)
                q20 = C.msq(q20, C2, mask)
                q21 = C.msq(q21, rsr0, mask)
                q22 = C.msq(q22, rsr1, mask)
                q23 = C.msq(q23, rsr2, mask)
                q24 = C.msq(q24, rsc0, mask)
                q25 = C.msq(q25, rsc1, mask)
                q26 = C.msq(q26, rsc2, mask)
            q27 = C.msq(q27, m0 * FM0, mask)
            q28 = C.msq(q28, m1 * FM1, mask)
            q29 = C.msq(q29, m2 * FM2, mask)
            if TWO_PASS:
                # (m_k − mean m_k)², (rms − mean m_k)², float32 per element, as before
                d0 = om0 - mu0
                d1 = om1 - mu1
                d2 = om2 - mu2
                e0 = orms - mu0
                e1 = orms - mu1
                e2 = orms - mu2
                u0 += tl.where(mask, d0 * d0, 0.0).to(VACC)
                u1 += tl.where(mask, d1 * d1, 0.0).to(VACC)
                u2 += tl.where(mask, d2 * d2, 0.0).to(VACC)
                u3 += tl.where(mask, e0 * e0, 0.0).to(VACC)
                u4 += tl.where(mask, e1 * e1, 0.0).to(VACC)
                u5 += tl.where(mask, e2 * e2, 0.0).to(VACC)
            else:
                d0 = om0.to(tl.float64)
                d1 = om1.to(tl.float64)
                d2 = om2.to(tl.float64)
                d3 = orms.to(tl.float64)
                u0 += d0
                u1 += d1
                u2 += d2
                u3 += d3
                u4 += d0 * d0
                u5 += d1 * d1
                u6 += d2 * d2
                u7 += d3 * d3
    if not FUSED:
        x = C.cat32(q0.to(tl.float64), q1.to(tl.float64), q2.to(tl.float64), q3.to(tl.float64),
                    q4.to(tl.float64), q5.to(tl.float64), q6.to(tl.float64), q7.to(tl.float64),
                    q8.to(tl.float64), q9.to(tl.float64), q10.to(tl.float64), q11.to(tl.float64),
                    q12.to(tl.float64), q13.to(tl.float64), q14.to(tl.float64),
                    q15.to(tl.float64), q16.to(tl.float64), q17.to(tl.float64),
                    q18.to(tl.float64), q19.to(tl.float64), q20.to(tl.float64),
                    q21.to(tl.float64), q22.to(tl.float64), q23.to(tl.float64),
                    q24.to(tl.float64), q25.to(tl.float64), q26.to(tl.float64),
                    q27.to(tl.float64), q28.to(tl.float64), q29.to(tl.float64), zd, zd)
        x = tl.sum(tl.reshape(x, [BLOCK, 32]), axis=0)
        prow = part + gpid.to(tl.int64) * 64
        if FOLD:
            # features 15-26 (x's columns 15-26 are 0): both axes' positions in the tile,
            # their statistics loaded again here, after x is stored (a store the loads are
            # not moved above: fewer registers at x's reduction)
            axc = (cols >= 15) & (cols < 27)
            tl.store(prow + cols, x, mask=axc == 0)
            ia_t = a0 + tl.arange(0, TA)
            aidx_t = tl.where(a_row, rbase + ia_t * rstr, cbase + ia_t * cstr)
            xab = _axis_sq(cols, fva, vpa, aidx_t, ia_t < ia_n, a_row, rc0, rc1, rc2,
                           tl.minimum(TB, ib_n - tb * TB).to(tl.float64), ACC) \
                + _axis_sq(cols, fvb, vpb, bidx, mb, b_row, rc0, rc1, rc2,
                           n_sub.to(tl.float64), ACC)
            tl.store(prow + cols, xab, mask=axc)
        else:
            tl.store(prow + cols, x)
        y = tl.reshape(C.cat8(u0.to(tl.float64), u1.to(tl.float64), u2.to(tl.float64),
                              u3.to(tl.float64), u4.to(tl.float64), u5.to(tl.float64), u6, u7),
                       [BLOCK, 8])
        tl.store(prow + 32 + c8, tl.sum(y, axis=0))
        # (columns 40-63 are not written and not read)
    elif TWO_PASS:
        _mom_store(part, gpid, n0, n1, n2, n3, BLOCK)


@triton.jit
def velo_stats_kernel(meta, prog, pids, ptrs, rcm, decays, mu, norm, scal, w0, b0, wh, bh, wl,
                      bl, part, exp_mult, step_mult, TWO_PASS: tl.constexpr,
                      ACC: tl.constexpr, VACC: tl.constexpr, PACC: tl.constexpr,
                      NHID: tl.constexpr, NPTR: tl.constexpr, NF: tl.constexpr,
                      TA: tl.constexpr, TB: tl.constexpr, SA: tl.constexpr,
                      FOLD: tl.constexpr):
    """Launch 3 (statistics mode of :func:`_velo_body`), each sub-tile loaded where it is
    computed: issuing the next sub-tile's loads first, as the fused pass does, makes this
    kernel, bound by loads already, slower."""
    _velo_body(meta, prog, pids, ptrs, rcm, decays, mu, norm, scal, w0, b0, wh, bh, wl, bl,
               part, exp_mult, step_mult, False, TWO_PASS, ACC, VACC, PACC, NHID, NPTR, NF, TA,
               TB, SA, FOLD, False)


@triton.jit
def velo_fused_kernel(meta, prog, pids, ptrs, rcm, decays, mu, norm, scal, w0, b0, wh, bh, wl,
                      bl, part, exp_mult, step_mult, MOM_OUT: tl.constexpr,
                      MACC: tl.constexpr, NHID: tl.constexpr, NPTR: tl.constexpr,
                      NF: tl.constexpr, TA: tl.constexpr, TB: tl.constexpr, SA: tl.constexpr,
                      FOLD: tl.constexpr, WN: tl.constexpr):
    """Launch 5 (fused mode of :func:`_velo_body`; MOM_OUT: the new accumulators' sums →
    ``part``, :func:`_mom_store`), the next sub-tile's loads issued before computing the
    current one: it hides their latency in this compute-bound pass (about 5% of the kernel)
    and leaves the results unchanged."""
    _velo_body(meta, prog, pids, ptrs, rcm, decays, mu, norm, scal, w0, b0, wh, bh, wl, bl,
               part, exp_mult, step_mult, True, MOM_OUT, MACC, tl.float64, tl.float64, NHID,
               NPTR, NF, TA, TB, SA, FOLD, WN)


@triton.jit
def velo_mom_sums_kernel(meta, prog, ptrs, part, MACC: tl.constexpr, NPTR: tl.constexpr,
                         NF: tl.constexpr, TA: tl.constexpr, TB: tl.constexpr,
                         SA: tl.constexpr):
    """Sums of m_0, m_1, m_2, rms of the accumulators as they are, per program →
    ``part[pid, 0:4]`` (float64, :func:`_mom_store`): the same tiles, sub-tiles (SA must be
    the fused pass's), lanes and order as the fused pass's sums of what it stores
    (:func:`_mom_acc`), hence the same bits. Run when the fused pass's sums from the last
    step may not describe the state (:meth:`VeLOTriton.step`)."""
    BLOCK: tl.constexpr = SA * TB
    pid = tl.program_id(0)
    t = tl.load(prog + pid)
    row = meta + t * NF
    ia_n = tl.load(row + 2)
    b, ta, tb = C.tile_of(row, pid - tl.load(row + 11))
    mp = C.ptr_f32(ptrs, t, 2, NPTR)
    rp = C.ptr_f32(ptrs, t, 3, NPTR)
    n0 = tl.zeros([BLOCK], MACC)
    n1 = n0
    n2 = n0
    n3 = n0
    sa_i = tl.arange(0, SA)
    ib = tb * TB + tl.arange(0, TB)
    a0 = ta * TA
    n_sub = tl.minimum(TA, ia_n - a0)
    for s in range(0, n_sub, SA):
        ia = a0 + s + sa_i
        off, mask, ridx, cidx = C.load_tile(row, t, b, ia, ib, ptrs, NPTR, BLOCK)
        m0 = tl.load(mp + off * 3, mask=mask, other=0.0)
        m1 = tl.load(mp + off * 3 + 1, mask=mask, other=0.0)
        m2 = tl.load(mp + off * 3 + 2, mask=mask, other=0.0)
        rms = tl.load(rp + off, mask=mask, other=0.0)
        n0, n1, n2, n3 = _mom_acc(n0, n1, n2, n3, m0, m1, m2, rms, mask)
    _mom_store(part, pid, n0, n1, n2, n3, BLOCK)


check_supported = L.supported_velo


class VeLOTriton:
    """The Triton step of one :class:`xopt.torch.VeLO` (caches its layout and tables).

    On a CUDA device the step after the kernels' launches (launches 1-5 and the LSTM glue
    between them, about a hundred small torch ops) is recorded once into a CUDA graph and
    replayed (:class:`xopt.kernels.lopt_graph.StepGraph`): its inputs sit in static device
    buffers (the pointer and per-tensor scalar tables, t/N, the loss features, the LSTM
    state, θ), updated by copies before the replay, and the graph is recorded again
    whenever one of those buffers moves (new shapes, another LSTM state or θ). The first
    step of a graph runs eagerly (on a side stream, as the recording), so its results are
    those of the eager code. Not on the CPU (the interpreter), nor while the caller is
    itself recording a graph, nor with ``XOPT_LOPT_CUDA_GRAPHS=0``: the same code then runs
    eagerly.
    """

    PRECISIONS = ("exact", "fast")

    def __init__(self, hp: _spec.VeLO, precision: str = "exact") -> None:
        why = check_supported(hp)
        if why is not None:
            raise ValueError(f"VeLO(impl='triton'): {why}")
        if precision not in self.PRECISIONS:
            raise ValueError(f"precision must be one of {self.PRECISIONS}, got {precision!r}")
        self.hp = hp
        self.prec = precision
        self._layout: L.Layout | None = None
        self._onehot: torch.Tensor | None = None
        self._pids: dict = {}  # the program sets of the layout (_program_sets)
        self._bank_cache: tuple | None = None
        self._decays: tuple | None = None  # (all 7 decays, the 3 Adafactor ones, timescales)
        self._tab = G.StepTables(3)  # pointers; lr, lr·λ, write_step
        self._frac: torch.Tensor | None = None   # float32 0-d (device): t / N
        self._lfeat: torch.Tensor | None = None  # float32 [9] (device)
        self._graph = G.StepGraph("VeLO")
        self.loss_in_graph: bool | None = None  # None: graphs_loss decides
        # the fused pass's per-program sums of the accumulators it wrote ([n_prog, 4]
        # float64), the next step's sums of the old ones, and what they describe (see
        # _carried)
        self._mpart: torch.Tensor | None = None
        self._carry: tuple | None = None
        self.mom_fallbacks = 0  # steps that summed the old accumulators anew (tests read it)
        self._mr: tuple = (None, None)  # (TritonIO build, its m and rms tensors)

    def _bank(self, meta: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, tuple,
                                                              dict[str, torch.Tensor]]:
        """``(bank [P, T], gidx, key, lstm)``: the MLP banks side by side (each ``[P, ...]``
        flattened, in :func:`xopt.specs.velo.mlp_bank_names` order; float64) and the index of
        each entry of one tensor's kernel table (w0 [32, 4], b0 [4], wh [NHID, 4, 4], bh
        [NHID, 4], wl [4, 16], bl [16], zero-padded) in ``[mixed | 0]`` (T: the zero), and the
        LSTM's weights (``lstm/...``) in float64. Cached per meta tensors (``key``: the
        pointers and versions of all of them)."""
        names = _spec.mlp_bank_names(self.hp)
        vals = meta.values()
        key = (tuple(meta), tuple(map(_DPTR, vals)), tuple(map(_VERSION, vals)))
        if self._bank_cache is not None and self._bank_cache[0] == key:
            return self._bank_cache[1], self._bank_cache[2], key, self._bank_cache[3]
        p = meta[names[0]].shape[0]
        flat = [meta[k].reshape(p, -1) for k in names]
        total = sum(f.shape[1] for f in flat)
        starts, o = {}, 0
        for k, f in zip(names, flat, strict=True):
            starts[k.split("/")[1]] = o
            o += f.shape[1]
        shapes = {k.split("/")[1]: tuple(meta[k].shape[1:]) for k in names}
        nl = int(self.hp.ff_hidden_layers)

        def block(name, rows, cols):
            shp = shapes[name]
            r_n, c_n = (1, shp[0]) if len(shp) == 1 else shp
            out = []
            for r in range(rows):
                for c in range(cols):
                    out.append(starts[name] + r * c_n + c if r < r_n and c < c_n else total)
            return out

        idx = block("w0", 32, 4) + block("b0", 1, 4)
        for i in range(1, nl):
            idx += block(f"w{i}", 4, 4)
        for i in range(1, nl):
            idx += block(f"b{i}", 1, 4)
        idx += block(f"w{nl}", 4, 16) + block(f"b{nl}", 1, 16)
        bank = torch.cat(flat, 1).double().contiguous()
        gidx = to_device(torch.tensor(idx, dtype=torch.int64), bank.device)
        lstm = {k: v.double() for k, v in meta.items() if k.startswith("lstm/")}
        self._bank_cache = (key, bank, gidx, lstm)
        return bank, gidx, key, lstm

    def layout(self, shapes: Sequence[tuple[int, ...]], device: torch.device) -> L.Layout:
        lay = self._layout
        if lay is None or lay.shapes != tuple(shapes) or lay.meta.device != device:
            lay = self._layout = L.build_layout(shapes, device)
            self._pids = self._program_sets(lay, device)
            ranks = [_spec.tensor_rank(s) for s in shapes]
            oh = torch.zeros((len(shapes), _spec.NUM_RANKS), dtype=torch.float32)
            for i, r in enumerate(ranks):
                if r < _spec.NUM_RANKS:
                    oh[i, r] = 1.0
            self._onehot = to_device(oh, device)
        return lay

    @staticmethod
    def _program_sets(lay: L.Layout, device: torch.device) -> dict:
        """Per layout: the indices (into ``prog_all``) of every program, of the factored
        tensors' (the folded kernels') and of the others' (``"all" | "fact" | "unf"``:
        (int32 tensor, count))."""
        sets: dict[str, list[int]] = {"all": [], "fact": [], "unf": []}
        for r in lay.meta_host:
            ids = range(r[L.PSTART], r[L.PSTART] + r[L.NB] * r[L.NTA] * r[L.NTB])
            sets["all"].extend(ids)
            sets["fact" if r[L.FACT] else "unf"].extend(ids)
        return {k: (to_device(torch.tensor(v or [0], dtype=torch.int32), device), len(v))
                for k, v in sets.items()}

    def _tables(self, params, grads, states, outs, write_step, lrs, lrwds, dev, io) -> None:
        """The layout and the static pointer / scalar tables for these tensors
        (:class:`xopt.kernels.lopt_graph.StepTables`)."""
        if self._tab.current(io, dev):
            return
        self.layout([tuple(p.shape) for p in params], dev)
        self._tab.update(params, grads, states, outs, write_step, lrs, lrwds, dev, io)

    def _carried(self, lay: L.Layout, states: Sequence[Mapping[str, torch.Tensor]],
                 dev: torch.device, io=None) -> tuple:
        """Makes ``self._mpart`` hold the per-program sums of m_k, rms of the accumulators as
        they are now (before this step) and returns what the step leaves them describing.

        The fused pass writes the sums of the accumulators it stores (the next step's old
        ones) into ``_mpart``; they are used as they are (no pass over m and rms) when
        nothing can have changed the accumulators since: the same layout and buffer, and
        the same ``m`` / ``rms`` tensor objects (weak references: no state is kept alive)
        at the same addresses with the same version counters (views share their base's
        counter, so an in-place write through any view, ``copy_``, ``load_state_dict``'s
        copies, a plain-path step, all show; the kernels' raw-pointer writes do not bump
        it). Otherwise (the first step, new tensors or shapes, a load_state_dict, a step on
        the plain path, an in-place edit) :func:`velo_mom_sums_kernel` sums them anew, to
        the same bits. Not seen: writes that bypass the version counter (``tensor.data``'s
        in-place ops, other raw-pointer kernels) between two steps. With ``io``, the
        addresses are its lists (those of the pointer table), and while its ``build`` is the
        same, so are the m / rms tensors (it checks their identity each step), so only the
        version counters are read then."""
        build = getattr(io, "build", None)
        mr = self._mr
        if build is not None and mr[0] == build:  # (the io's state tensors stay while its
            ts = mr[1]                            # build does: the same m / rms lists)
        else:
            ts = [s["m"] for s in states]
            ts += [s["rms"] for s in states]
            self._mr = (build, ts if build is not None else None)
        if build is not None:
            key = (io.ptrs["m"], io.ptrs["rms"], list(map(_VERSION, ts)))
        else:
            key = (list(map(_DPTR, ts)), list(map(_VERSION, ts)))
        # (layout, weak references to the tensors, key: their pointers and versions, the io
        # build that the tensors are known to be those of)
        c = self._carry
        self._carry = None
        mp = self._mpart
        if mp is None or mp.shape[0] != max(lay.n_prog_all, 1) or mp.device != dev:
            mp = self._mpart = self._sums_buffer(lay, dev)
            c = None
        if (c is not None and c[0] is lay and c[2] == key
                and ((build is not None and c[3] == build) or (len(c[1]) == len(ts) and all(
                    map(operator.is_, map(_CALL, c[1]), ts))))):
            return c if c[3] == build else c[:3] + (build,)
        self.mom_partials(mp)
        self.mom_fallbacks += 1
        return (lay, [weakref.ref(x) for x in ts], key, build)

    @staticmethod
    def _sums_buffer(lay: L.Layout, dev: torch.device) -> torch.Tensor:
        """A zeroed buffer for the carried sums: per program, [n_prog, 4] float64."""
        return torch.zeros((max(lay.n_prog_all, 1), 4), dtype=torch.float64, device=dev)

    def mom_partials(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sums of m_0, m_1, m_2, rms per program (:meth:`_sums_buffer`' layout) of the
        accumulators that the current tables point at, summed anew
        (:func:`velo_mom_sums_kernel`) into ``out`` (or a new buffer)."""
        lay = self._layout
        if out is None:
            out = self._sums_buffer(lay, lay.meta.device)
        if lay.n_prog_all:
            velo_mom_sums_kernel[(lay.n_prog_all,)](lay.meta, lay.prog_all, self._tab.ptrs, out,
                                                    MOM_ACC, NPTR=NPTR, NF=L.NFIELDS,
                                                    TA=L.TA, TB=L.TB, SA=SA,
                                                    num_warps=WARPS, **FP_FUSION)
        return out

    def step(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             states: Sequence[dict[str, torch.Tensor]], outs: Sequence[torch.Tensor],
             write_step: Sequence[bool], lrs: Sequence[float], lrwds: Sequence[float],
             meta: Mapping[str, torch.Tensor], hidden: torch.Tensor, cell: torch.Tensor,
             frac: torch.Tensor | None, lfeat: torch.Tensor | None, *, io=None,
             loss_state: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One step after the loss buffer: updates ``states``' accumulators in place, writes
        each new parameter (or, where ``write_step``, its step) into ``outs`` and updates the
        LSTM state ``hidden``/``cell`` (the stacked ``[n_tensors, H]``) in place, returning
        them. ``frac``: t / N (0-d, any device); ``lfeat``: the 9 loss features. ``io``: the
        optimizer's :class:`xopt.torch._lopt.TritonIO` for these lists, when it has one (its
        version keys the tables). ``loss_state``: ``(gstate, loss)`` instead of ``frac`` and
        ``lfeat`` when :meth:`graphs_loss` is true: the loss buffer's update
        (:func:`xopt.specs.velo.loss_buffer_step`) and t / N then run inside the graph, on
        static copies of ``gstate``'s buffer and counters (``gstate["loss_means"]`` and
        ``["loss_running_min"]`` become those buffers, updated in place; the caller advances
        the host counters as usual)."""
        dev = hidden.device
        like = meta["lstm/init_hidden"]
        if self._decays is None or self._decays[0].device != dev:
            md, rd, fd = (arrays.constant(torch, d, like) for d in _spec.decay_arrays(self.hp))
            ts = arrays.constant(torch, np.asarray(_spec.FRACTION_TIMESCALES, dtype=np.float32),
                                 like)
            self._decays = (torch.cat([md, rd, fd]).contiguous(), fd, ts)
            self._frac = torch.zeros((), dtype=torch.float32, device=dev)
            self._lfeat = torch.zeros((_spec.NUM_LOSS_DECAYS - 1,), dtype=torch.float32,
                                      device=dev)
        self._tables(params, grads, states, outs, write_step, lrs, lrwds, dev, io)
        carry = self._carried(self._layout, states, dev, io) if TWO_PASS else None
        self._step(meta, hidden, cell, frac, lfeat, loss_state, dev, like)
        self._carry = carry  # (the step done: the sums in _mpart are the new state's)
        return hidden, cell

    def _step(self, meta, hidden, cell, frac, lfeat, loss_state, dev, like) -> None:
        """:meth:`step` after the tables: the step eagerly, or its CUDA graph."""
        bank, gidx, bank_key, lstm64 = self._bank(meta)
        # every host-made input before the first launch (a blocking copy waits for the GPU)
        if loss_state is None:
            G.copy_in(self._frac, frac.reshape(()).to(torch.float32))
            G.copy_in(self._lfeat, lfeat.reshape(-1).to(torch.float32))
            with_loss = False
        else:
            self._sync_loss_buffer(*loss_state, like)
            with_loss = True
        lay = self._layout
        # everything the recording reads, held (so that no address it holds is reused while
        # it lives) and compared by identity; bank_key: θ's pointers and versions
        refs = (lay, self._pids, self._onehot, self._decays, self._tab.ptrs, self._tab.scal,
                self._frac, self._lfeat, self._mpart, bank, gidx, hidden, cell, *meta.values(),
                *lstm64.values())
        if with_loss:
            refs = refs + tuple(self._lb.values())
        key = (bank_key, tuple(hidden.shape), tuple(cell.shape), with_loss)
        self._graph.run(lambda: self._body(lay, lstm64, bank, gidx, hidden, cell, with_loss),
                        refs, dev, key)

    @property
    def graph_recordings(self) -> int:
        """How many times the step was recorded into a CUDA graph (tests read it)."""
        return self._graph.recordings

    def graphs_loss(self, device: torch.device) -> bool:
        """Whether a step on ``device`` records the loss buffer's update into its graph
        (then :meth:`step` takes ``loss_state``)."""
        if self.loss_in_graph is not None:  # (tests: the same path, eagerly, on the CPU)
            return self.loss_in_graph
        return GRAPH_LOSS and self._graph.active(device)

    def _sync_loss_buffer(self, gstate: dict, loss: torch.Tensor, like: torch.Tensor) -> None:
        """The static loss-buffer inputs of the graph (:meth:`step`'s ``loss_state``): the
        loss copied in every step; the buffer and the counters copied from ``gstate`` only
        when they no longer are what the last step left (a load_state_dict, a step on
        another path)."""
        dev = like.device
        lb = getattr(self, "_lb", None)
        if lb is None or lb["means"].device != dev:
            z = torch.zeros((_spec.NUM_LOSS_DECAYS,), dtype=torch.float32, device=dev)
            lb = self._lb = {
                "means": z.clone(), "rmin": z.clone(), "dec": z.clone(),
                "it": torch.zeros((), dtype=torch.int32, device=dev),
                "t": torch.zeros((), dtype=torch.int32, device=dev),
                "n": torch.ones((), dtype=torch.float32, device=dev),
                "loss": torch.zeros((), dtype=torch.float32, device=dev),
                "eps": arrays.constant(torch, 1e-8, like)}
            self._lb_shadow = None
        dec = gstate["loss_decays"]
        shadow = (int(gstate["loss_iteration"]), int(gstate["iteration"]),
                  int(gstate["num_steps"]), id(dec), dec._version)
        if (self._lb_shadow != shadow or gstate["loss_means"] is not lb["means"]
                or gstate["loss_running_min"] is not lb["rmin"]):
            lb["means"].copy_(gstate["loss_means"])
            lb["rmin"].copy_(gstate["loss_running_min"])
            lb["dec"].copy_(dec)
            G.copy_in(lb["it"], torch.tensor(shadow[0], dtype=torch.int32))
            G.copy_in(lb["t"], torch.tensor(shadow[1], dtype=torch.int32))
            G.copy_in(lb["n"], torch.tensor(shadow[2], dtype=torch.float32))
            gstate["loss_means"], gstate["loss_running_min"] = lb["means"], lb["rmin"]
            self._lb_dec_ref = dec  # (held: its id is in the shadow)
        if loss.dtype != torch.float32 or loss.dim() != 0 or loss.requires_grad:
            loss = loss.detach().reshape(()).to(torch.float32)
        G.copy_in(lb["loss"], loss)
        # what gstate's counters will be after this step (the graph advances its copies)
        self._lb_shadow = (shadow[0] + 1, shadow[1] + 1) + shadow[2:]

    def _loss_body(self) -> None:
        """The loss buffer's update (:func:`xopt.specs.velo.loss_buffer_step`, its iteration a
        device counter) and t / N (the host path's float32 division), from and into the
        static buffers; then both counters advance."""
        lb = self._lb
        means, rmin = _spec.loss_buffer_update(torch, lb["means"], lb["rmin"], lb["dec"],
                                               lb["it"], lb["loss"])
        # xopt.specs.velo.loss_features, op for op, its 1e-8 a device constant
        it1 = lb["it"] + 1
        cor_mean = means / (1 - _spec.decay_power(torch, lb["dec"], it1))
        approx_max = cor_mean[1:]
        cor_mean = cor_mean[:-1]
        rmin_ = rmin[:-1]
        den = torch.maximum(approx_max - rmin_, lb["eps"])
        pre_center = (cor_mean - rmin_) / den
        f = arrays.clip(torch, pre_center - 1.0, -1.0, 1.0)
        self._lfeat.copy_(torch.where(it1 <= 2, f * 0, f))
        self._frac.copy_(lb["t"].to(torch.float32) / lb["n"])
        lb["means"].copy_(means)
        lb["rmin"].copy_(rmin)
        lb["it"].add_(1)
        lb["t"].add_(1)

    def _body(self, lay: L.Layout, lstm64: Mapping[str, torch.Tensor], bank: torch.Tensor,
              gidx: torch.Tensor, hidden: torch.Tensor, cell: torch.Tensor,
              with_loss: bool = False) -> None:
        """Launches 1-5 and the glue, from the static tables and inputs only (device ops,
        no host→device copy: this is what a CUDA graph records); ``with_loss``: first the
        loss buffer (:meth:`_loss_body`). ``lstm64``, ``bank``: θ's LSTM weights and MLP
        banks in float64 (:meth:`_bank`)."""
        hp = self.hp
        dev = hidden.device
        if with_loss:
            self._loss_body()
        decays, fd, ts = self._decays
        ptrs, host = self._tab.ptrs, self._tab.scal
        # 1-2: Adafactor statistics (factored tensors: g only); every tensor's Σ m_k, Σ rms
        # when the variances are taken two-pass: from the last fused pass, or summed anew
        # before the step (_carried), per program in _mpart
        rcm, _ = C.factored_pass(lay, ptrs, fd, clip_g=True, mom_sums=False, npt=NPTR)
        if rcm is None:
            rcm = torch.zeros((3,), dtype=torch.float32, device=dev)
        mpart = self._mpart
        if TWO_PASS:  # the means of the old m_k, rms: float64, then rounded once
            mu64 = C.seg_sum(mpart, lay) / lay.numel.double()[:, None]
            mu = mu64.float().contiguous()
        else:
            mu = None
        # 3: feature statistics, and the variances' sums
        nhid = int(hp.ff_hidden_layers) - 1
        common = dict(NHID=nhid, NPTR=NPTR, NF=L.NFIELDS, TA=L.TA, TB=L.TB,
                      num_warps=WARPS, num_stages=STAGES)
        part = torch.empty((lay.n_prog_all, 64), dtype=torch.float64, device=dev)
        # (program indices, count, folded?) of each launch: the factored tensors' programs
        # folded, the others' not (FOLD), or every program unfolded
        sets = self._pids
        launches = ([(*sets["fact"], True), (*sets["unf"], False)] if FOLD
                    else [(*sets["all"], False)])
        for pids, n_p, fold in launches:
            if n_p:
                velo_stats_kernel[(n_p,)](lay.meta, lay.prog_all, pids, ptrs, rcm, decays,
                                          part if mu is None else mu, part, part, part,
                                          part, part, part, part, part, part,
                                          float(hp.exp_mult), float(hp.step_mult),
                                          TWO_PASS=TWO_PASS,
                                          ACC=tl.float32 if STATS_F32 else tl.float64,
                                          VACC=tl.float32 if VAR_F32 else tl.float64,
                                          PACC=tl.float32 if P2_F32 else tl.float64,
                                          SA=SA_STATS, FOLD=fold, **common,
                                          **_cap(MAXNREG_STATS), **FP_FUSION)
        st64 = C.seg_sum(part, lay)
        # 4: the LSTM inputs, the LSTM, the MLPs' weights and the per-tensor scalars
        tab, norm, scal, new_h, new_c = _glue(dev)(
            st64, mu64 if TWO_PASS else None, lay.numel, self._frac, ts, self._lfeat,
            self._onehot, hidden, cell, lstm64, bank, gidx, host)
        # 5: the fused update
        for pids, n_p, fold in launches:
            if n_p:
                velo_fused_kernel[(n_p,)](lay.meta, lay.prog_all, pids, ptrs, rcm, decays,
                                          part, norm, scal, tab, tab, tab, tab, tab, tab,
                                          mpart if TWO_PASS else part,
                                          float(hp.exp_mult), float(hp.step_mult),
                                          MOM_OUT=TWO_PASS, MACC=MOM_ACC, SA=SA, FOLD=fold,
                                          WN=NORM_W, **common, **_cap(MAXNREG), **FP_FUSION)
        hidden.copy_(new_h)
        cell.copy_(new_c)


def _cap(regs: int) -> dict:
    """A launch's ``maxnreg`` option, none for 0."""
    return {"maxnreg": regs} if regs else {}

def lstm_glue(st64: torch.Tensor, mu64: torch.Tensor | None, numel: torch.Tensor,
              frac: torch.Tensor, ts: torch.Tensor, lfeat: torch.Tensor,
              onehot: torch.Tensor, hidden: torch.Tensor, cell: torch.Tensor,
              lstm64: Mapping[str, torch.Tensor], bank: torch.Tensor, gidx: torch.Tensor,
              host: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Step 4 of the module docstring, batched over the ``nt`` tensors: from the statistics
    pass's per-tensor float64 sums ``st64`` [nt, 64] (and, two-pass, the old accumulators'
    means ``mu64`` [nt, 4]) to ``(tab, norm, scal, new_hidden, new_cell)``: the fused pass's
    padded MLP-weight table [nt, W], the features' normalizers ``rsqrt(1e-5 + mean f²)``
    [nt, 32], the per-tensor scalars [nt, 8] (``host``'s 4 columns, the LSTM's learning-rate
    multiplier, the parameter scale ``sqrt(mean p² + 1e-9)``, 3 zeros) and the LSTM state.

    The LSTM inputs (:func:`xopt.specs.velo.lstm_features`, batched: ``frac`` and ``lfeat``
    the 0-d time fraction and the 9 loss features, ``ts`` the fraction timescales) are
    rounded to float32 once; the LSTM (:func:`xopt.specs.velo.lstm_step`, θ's weights
    ``lstm64``) and the hypernetwork's mixing ``100 · mean_k(controls_k · bank_k)`` run in
    float64 (``bank`` [n_bank, W'] float64, ``gidx`` the padded table's columns), each
    result rounded to float32 once (:data:`LSTM_F64`; False: float32, as the plain path).
    Torch ops only: a CUDA step may run it compiled (:data:`COMPILE_GLUE`)."""
    nt = st64.shape[0]
    dev = st64.device
    # xopt.specs.velo.fraction_embedding, with its timescales kept on the device
    frac_emb = arrays.tanh(torch, (frac - ts) * 10).expand(nt, -1)
    st = st64[:, :40].float()
    n = numel[:, None]
    psq = st[:, 2] / numel
    nm = torch.rsqrt(psq.clamp_min(1e-9))
    cla = _spec.clip_log_abs
    if mu64 is not None:  # two-pass: the three features in float64 from the float64 sums
        n64 = numel.double()[:, None]
        nm64 = torch.rsqrt((st64[:, 2] / numel.double()).clamp_min(1e-9))
        sc = (nm64 * nm64)[:, None]
        f_rms = cla(torch, nm64 * mu64[:, 3]).float()
        f_var_m = cla(torch, sc * (st64[:, 32:35] / n64)).float()
        f_var_rms = cla(torch, sc * (st64[:, 35:38] / n64)).float()
    else:  # one-pass in float64: E[x²] − 2·E[x]·mean m_k + (mean m_k)²
        mom = st64[:, 32:40] / numel.double()[:, None]
        mean_m = mom[:, 0:3]
        var_m64 = mom[:, 4:7] - mean_m * mean_m
        var_rms64 = mom[:, 7:8] - 2.0 * mom[:, 3:4] * mean_m + mean_m * mean_m
        f_rms = cla(torch, nm * mom[:, 3].float())
        f_var_m = cla(torch, (nm * nm)[:, None] * var_m64.float())
        f_var_rms = cla(torch, (nm * nm)[:, None] * var_rms64.float())
    x = torch.cat([frac_emb, lfeat.expand(nt, -1), f_rms[:, None], onehot, f_var_m,
                   f_var_rms], dim=1)
    # the LSTM and the hypernetwork's mixing in float64, rounded once (LSTM_F64)
    if LSTM_F64:
        controls, lr_mult, new_h, new_c = _spec.lstm_step(torch, x.double(), hidden.double(),
                                                          cell.double(), lstm64)
        mixed = (controls @ bank) * (100.0 / bank.shape[0])
    else:  # the plain path's float32 ops (xopt.specs.velo.lstm_step, mix_mlp_weights)
        controls, lr_mult, new_h, new_c = _spec.lstm_step(
            torch, x, hidden.float(), cell.float(), {k: v.float() for k, v in lstm64.items()})
        mixed = (controls[:, :, None] * bank.float()[None]).mean(1) * 100.0
    lr_mult = lr_mult.float()
    pscale = torch.sqrt(psq + 1e-9)
    # every tensor's MLP weights at once (xopt.specs.velo.mix_mlp_weights: 100 · mean over
    # the bank of controls · bank), gathered into the kernel's padded table
    mixed = mixed.float()
    tab = torch.cat([mixed, torch.zeros((nt, 1), device=dev)], 1)[:, gidx]
    norm = torch.rsqrt(1e-5 + st[:, :32] / n)
    if NORM_W:  # the first layer's rows (tab[:, :128]: w0 [32, 4]) times the normalizers
        tab = torch.cat([tab[:, :128] * norm.repeat_interleave(4, dim=1), tab[:, 128:]], 1)
    scal = torch.cat([host, lr_mult[:, None], pscale[:, None],
                      torch.zeros((nt, 3), device=dev)], 1)
    return (tab.contiguous(), norm.contiguous(), scal.contiguous(), new_h.to(hidden.dtype),
            new_c.to(cell.dtype))


#: run :func:`lstm_glue` through ``torch.compile`` on CUDA devices (its ~90 small kernels
#: fused into a few, a few percent of a step; the first step compiles it, once per process
#: and set of shapes; ``XOPT_VELO_COMPILE_GLUE=0``: eager, as on the CPU)
COMPILE_GLUE = os.environ.get("XOPT_VELO_COMPILE_GLUE", "1") != "0"
_COMPILED: list = []


def _glue(device: torch.device):
    """:func:`lstm_glue`, compiled once per process for CUDA devices when
    :data:`COMPILE_GLUE` (eager otherwise, and from the first compilation that fails on:
    a warning says why; the step's numbers do not depend on it)."""
    if device.type != "cuda" or not COMPILE_GLUE:
        return lstm_glue
    if not _COMPILED:
        _COMPILED.append(_compiled_or_eager(torch.compile(lstm_glue, fullgraph=True,
                                                          dynamic=False)))
    return _COMPILED[0]


def _compiled_or_eager(compiled):
    """``compiled`` (``torch.compile`` of :func:`lstm_glue`) made safe to call: a call that
    raises warns and runs :func:`lstm_glue` instead, from then on; and until one call of
    ``compiled`` has returned, a call made while the current CUDA stream is being captured
    (a caller recording the optimizer's first step into its own CUDA graph, with no eager
    step before it) runs :func:`lstm_glue`: compiling may synchronize, which would
    invalidate the caller's capture."""
    state = {"fn": compiled, "warm": False}

    def call(*args):
        if not state["warm"] and state["fn"] is not lstm_glue \
                and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return lstm_glue(*args)
        try:
            out = state["fn"](*args)
            state["warm"] = True
            return out
        except Exception as e:  # noqa: BLE001 (a compiler failure: run the same ops eagerly)
            if state["fn"] is lstm_glue:
                raise
            import warnings

            warnings.warn(f"xopt VeLO: torch.compile of the LSTM glue failed ({type(e).__name__}:"
                          f" {e}); running it eagerly", RuntimeWarning, stacklevel=2)
            state["fn"] = lstm_glue
            return lstm_glue(*args)

    return call

def reference_step(hp: _spec.VeLO, params: Sequence[torch.Tensor],
                   grads: Sequence[torch.Tensor], states: Sequence[Mapping[str, torch.Tensor]],
                   meta: Mapping[str, torch.Tensor], hidden: torch.Tensor, cell: torch.Tensor,
                   frac: torch.Tensor, lfeat: torch.Tensor):
    """Pure-PyTorch reference, the plain path's computation: ``(steps, new accumulator
    states, hidden, cell)``."""
    like = meta["lstm/init_hidden"]
    rows = [_spec.lstm_features(torch, p, st["m"], st["rms"], frac, lfeat)
            for p, st in zip(params, states, strict=True)]
    controls, lr_mult, hidden, cell = _spec.lstm_step(torch, torch.stack(rows), hidden, cell,
                                                      meta)
    decays = tuple(arrays.constant(torch, d, like) for d in _spec.decay_arrays(hp))
    steps, new_states = [], []
    for i, (p, g, st) in enumerate(zip(params, grads, states, strict=True)):
        step, accs = _spec.update_tensor(torch, hp, p, g,
                                         *(st[v] for v in ("m", "rms", "v_row", "v_col",
                                                           "v_diag")),
                                         controls[i], lr_mult[i], meta, decays)
        steps.append(step)
        new_states.append(dict(zip(("m", "rms", "v_row", "v_col", "v_diag"), accs,
                                   strict=True)))
    return steps, new_states, hidden, cell
