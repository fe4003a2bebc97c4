"""Fused Triton step of small_fc_lopt (learned_optimization's ``AdafacMLPLOpt``).

One optimizer step over all of a model's tensors in a fixed number of launches (plus a few
tiny torch ops for the decays and the time features), whatever the number of tensors, on
a CUDA device recorded once into a CUDA graph and replayed (:class:`SmallFCTriton`):

1. ``stats1`` (factored tensors only): partial sums of g² over each tile's two axes;
2. ``fac_finalize`` + ``rcm``: the new ``v_row``/``v_col`` (written in place) and their
   row-column means, the partial sums added in a fixed order;
3. the statistics pass, per tile: Σ feature² of the 28 features (float32 per thread, the
   tile's sums in float64), :func:`sfc_fold_stats_kernel` on the factored tensors,
   :func:`sfc_stats_kernel` on the others; the tensors' sums
   (:func:`xopt.kernels.lopt_common.seg_sum`, float64, in a fixed order);
4. :func:`sfc_norm_kernel`: the normalizers ``rsqrt(1e-5 + mean feature²)`` per tensor
   and the per-element first-layer rows with them folded in (TF32 halves in exact mode);
5. :func:`sfc_axis_kernel`: the first-layer terms of the row and column features, one row
   of HP numbers per entry of every ``v_row`` and ``v_col``;
6. the fused pass: accumulators, features, the MLP, the step and the parameter update, all
   in registers; writes ``p``, ``m``, ``rms`` (and ``v_diag`` below rank 2).
   :func:`sfc_fold_fused_kernel` on the factored tensors, :func:`sfc_fused_kernel` on the
   others.

The 11 time features are the same for every element: they are folded into the first
bias (``b0 + tf @ W0[28:]``).

**Row and column features folded (factored tensors, tensor-core MLP).** Of the 28 features,
12 depend on one axis only: ``v_row`` (13-15), ``v_col`` (16-18), ``rsqrt(v_row + 1e-8)``
(19-21), ``rsqrt(v_col + 1e-8)`` (22-24). A tile's program owns TB fixed positions ``ib``
of its inner axis and walks SA positions ``ia`` of the outer one at a time; which of the
two indexes ``v_row`` depends on the tensor's strides (``A_IS_D0``). The first layer is
split as ``h = x16 @ W16n + a_term[ia] + b_term[ib] + b0``: ``x16`` [BLOCK, 16] holds the
16 per-element features (0-12, 25-27) unnormalized, ``W16n`` their first-layer rows times
the tensor's normalizers (step 4), on the tensor cores (K = 16 instead of 32); the axis
terms ``Σ_k (inv_k · W0[k, :]) · f_k`` over the 6 features of an axis are float32 FMAs in
step 5, read back as ``b_term`` [TB, HP] once per program and ``a_term`` [SA, HP] once per
sub-tile. The row and column factors of ``fac_g`` and ``m·row_factor·col_factor`` are
likewise computed per axis position (no per-element gathers of ``v_row``/``v_col`` and no
per-element rsqrt of them). In the statistics pass an axis feature's Σ over a tile's
elements is Σ over the tile's positions on that axis of f², times the tile's extent on the
other axis. Unfactored tensors (rank < 2: their "row" and "column" features are the
per-element ``v_diag``) and the 4-wide MLP keep the unfolded kernels.

The MLP: hidden widths up to 4 (the original's 4) run as float32 FMAs, the first layer one
feature at a time (:func:`xopt.kernels.lopt_common.rank1`, no feature tile), in both
precisions. Wider ones (PyLO's 32) run on the tensor cores (the folded first layer above;
the unfolded kernel builds a [BLOCK, 32] feature tile); each hidden layer's input is the
previous MMA's accumulator with its columns relabeled (:func:`_mma_to_operand`, the weight
rows stored in the same order) so that it is already the next MMA's A operand, with no
shuffle between threads; the output layer (2 columns) is float32 FMAs. Precision of the
tensor-core matmuls (``precision=``):

* ``"exact"`` (default): split-precision TF32, both operands split into two TF32 halves,
  three exact products summed in float32 (:func:`xopt.kernels.lopt_common.dot3`):
  operands carried to 22 bits instead of float32's 24. The weights' halves are rounded
  to nearest; the activations' high half too, and in the folded fused kernel their low
  half is read by the tensor cores as its TF32 truncation (:data:`SPLIT_LO`: an error
  below 2^-22 of the operand instead of 2^-23). Measured against float64: see
  tests/test_kernels_lopt.py and tests/test_kernels_small_fc_fold.py.
* ``"fast"``: one TF32 product (10-bit mantissas). The MLP outputs move by about 1e-3
  relative, the step by as much; accumulators are not affected.

Under ``TRITON_INTERPRET=1`` (CPU) ``tl.dot`` multiplies in float32 whatever the precision.

:func:`reference_step` is the pure-PyTorch reference (the spec's per-tensor
:func:`xopt.specs.small_fc_lopt.compute_step`, as the plain path calls it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import triton
import triton.language as tl

from xopt.kernels import FP_FUSION
from xopt.kernels import lopt_common as C
from xopt.kernels import lopt_graph as G
from xopt.kernels import lopt_layout as L
from xopt.specs import arrays
from xopt.specs import small_fc_lopt as _spec
from xopt.specs.arrays import to_device

__all__ = ["SmallFCTriton", "reference_step"]

# Tuning constants (measured on an H100; the benchmark is bench/lopt_step.py). None of them
# changes the step's bits except where its comment says so.

#: sub-tile rows (SA × TB elements per sub-tile) of the per-element kernels: the statistics
#: passes, unfolded and folded, the fused pass with the tensor-core MLP (hidden width >
#: FMA_MAX), folded and unfolded, and with the FMA MLP. The folded statistics kernel has
#: one row of 64 elements per sub-tile on 2 warps: one element per thread, no spills under
#: its register cap, 16 programs per SM for a pass bound by memory.
SA_STATS = 2
SA_STATS_FOLD = 1
SA_FOLD = 2
SA_DOT = 2
SA_FMA = 4
#: sub-tile rows of the g² pass (:func:`xopt.kernels.lopt_common.stats1_kernel`): the
#: fastest of 1-64 for that memory-bound pass
SA_G2 = 4
#: warps per program of the per-element kernels
WARPS = 4
#: warps per program of the folded fused kernel: with SA_FOLD · 64 = 32 · warps, one
#: element per thread
WARPS_FOLD = WARPS
#: software-pipelining stages of the per-element loop; the folded fused kernel's is 1
#: because it prefetches by hand (:data:`PREFETCH`), which Triton's pipeliner would double
STAGES = 2
STAGES_FOLD = 1
#: register caps (``maxnreg``; 0: the compiler's choice) of the folded fused kernel for
#: hidden widths up to 32, and of the folded statistics kernel when it has one element per
#: thread. The fused kernel needs 244 registers (two programs per SM); a cap low enough for
#: three spills in its loop and is slower. The statistics kernel fits 64 without spills.
MAXNREG_FOLD = 0
MAXNREG_STATS = 64
#: products per split-precision matmul in exact mode: 3 (x_hi·w_hi, x_hi·w_lo, x_lo·w_hi);
#: a fourth, x_lo·w_lo, of order 2^-22 of the product, would cost a third more tensor-core
#: work for accuracy the exact mode's bound does not need (and change bits)
TERMS = 3
#: the folded fused kernel loads the next sub-tile's g, p, m and rms while it computes this
#: one, hiding their latency (it is bound by latency at two programs per SM)
PREFETCH = True
#: the folded fused kernel's first matmul starts from the axis terms and bias as its
#: accumulator instead of adding them after it (fewer instructions)
AB_ACC = True
#: exact mode, folded fused kernel: the low TF32 half of the activations passed as float32
#: for the tensor cores to truncate ("hw": error below 2^-22 of |x|, two integer ops less
#: per operand) rather than rounded to nearest first ("rn": 2^-23 of |x|, as the other
#: kernels; changes bits on a GPU, :func:`xopt.kernels.lopt_common.dot3_acc`)
SPLIT_LO = "hw"
#: the statistics kernel does not prefetch: it is bound by memory, and the prefetch's
#: registers cost it programs per SM
PREFETCH_STATS = False
#: tiles along the a axis per program of the folded fused kernel: its per-program set-up
#: (loads of the weights, axis terms and factors of the b axis) done once for RA tiles; the
#: same bits for any RA (tests/test_kernels_small_fc_fold.py)
RA = 2
#: warps per program of the folded statistics kernel (see SA_STATS_FOLD)
WARPS_STATS = 2
#: pipelining stages of the folded statistics kernel
STAGES_STATS = 2
#: fold the row/column features of factored tensors (see the module docstring; False runs
#: the unfolded kernel for every tensor, as tests/test_kernels_small_fc_fold.py does to
#: compare them)
FOLD = True
#: hidden widths up to this run the MLP as float32 FMAs, zero-padded to 4 (exact in both
#: modes), wider ones on the tensor cores
FMA_MAX = 4
#: entries of v_row / v_col per program of :func:`sfc_axis_kernel`
AXIS_BLOCK = 64
NPTR = G.NPTR
NFEAT = 28
#: the per-element features of the folded kernels, in the order of their K = 16 columns
ELEM_FEATURES = tuple(range(13)) + (25, 26, 27)


# -- shared pieces --------------------------------------------------------------------------


@triton.jit
def _program(meta, pids, prog, rcm, NF: tl.constexpr):
    """A per-element program's place: ``pids[program_id]`` is its index ``gpid`` among all
    programs (the layout's ``prog_all``; a launch may cover a subset). Returns ``(gpid, t,
    row, b, ta, tb, rc0, rc1, rc2)``: its tensor ``t`` and that tensor's layout row, its
    tile ``(b, ta, tb)`` and the three row-column means of batch ``b`` (unfactored tensors
    read 3 unused numbers)."""
    gpid = tl.load(pids + tl.program_id(0))
    t = tl.load(prog + gpid)
    row = meta + t * NF
    b, ta, tb = C.tile_of(row, gpid - tl.load(row + 11))
    rcm_b = rcm + tl.load(row + 22) + b * 3
    return (gpid, t, row, b, ta, tb, tl.load(rcm_b), tl.load(rcm_b + 1),
            tl.load(rcm_b + 2))


@triton.jit
def _mma_to_operand(h, HP: tl.constexpr):
    """Columns of ``h`` [BLOCK, HP] permuted, ``c = 8j + 2q + r → 8j + 4r + q`` (q < 4,
    r < 2): in a Hopper MMA accumulator a thread holds columns 8j + 2q + {0, 1}, and as the
    TF32 A operand of the next matmul columns 8j + q + {0, 4}; after this permutation (a
    relabeling, no data movement) the accumulator already is that operand, instead of
    being shuffled between threads. The next layer's weight rows are permuted likewise
    (:func:`_operand_perm`), so that the product is unchanged."""
    h = tl.reshape(h, [h.shape[0], HP // 8, 4, 2])
    return tl.reshape(tl.permute(h, (0, 1, 3, 2)), [h.shape[0], HP])


def _operand_perm(hp: int) -> list[int]:
    """Row ``k`` of a hidden layer's stored weights is row ``perm[k]`` of the layer
    (the permutation of :func:`_mma_to_operand`: k = 8j + 4r + q holds c = 8j + 2q + r)."""
    return [8 * (k // 8) + 2 * (k % 4) + (k % 8) // 4 for k in range(hp)]


@triton.jit
def _load_elems(gp, pp, mp, rp, off, mask):
    """``(g, p, m_0, m_1, m_2, rms)`` of the elements ``off`` (the old accumulators; 0 where
    masked)."""
    return (tl.load(gp + off, mask=mask, other=0.0), tl.load(pp + off, mask=mask, other=0.0),
            tl.load(mp + off * 3, mask=mask, other=0.0),
            tl.load(mp + off * 3 + 1, mask=mask, other=0.0),
            tl.load(mp + off * 3 + 2, mask=mask, other=0.0),
            tl.load(rp + off, mask=mask, other=0.0))


@triton.jit
def _mlp_tail(h, w1h, w1l, b1, wh, bh, wl0, wl1, bl0, bl1, HP: tl.constexpr,
              NHID: tl.constexpr, PREC: tl.constexpr, TERMS: tl.constexpr,
              LO_RN: tl.constexpr = True):
    """The MLP after its first layer: ``h`` [BLOCK, HP] (after the ReLU) → ``(direction,
    magnitude)`` [BLOCK]. The first hidden layer ``w1h``/``w1l`` [HP, HP] (TF32 halves),
    ``b1`` [HP] is loaded once per program by the caller; further ones (NHID > 1) are read
    from ``wh`` (hi halves [NHID, HP, HP], then the lo halves) and ``bh`` [NHID, HP]. The
    output layer's two used columns ``wl0``, ``wl1`` [HP] and biases: float32 FMAs.

    Each hidden layer's input columns are first permuted by :func:`_mma_to_operand`, and
    the hidden layers' rows are stored permuted likewise (:func:`_operand_perm`)."""
    hc = tl.arange(0, HP)
    if NHID > 0:
        h = _mma_to_operand(h, HP)
        h = tl.maximum(C.dot3_acc(h, w1h, w1l, tl.zeros_like(h), PREC, TERMS, LO_RN)
                       + b1[None, :], 0.0)
    for i in tl.static_range(1, NHID):
        wofs = i * HP * HP + hc[:, None] * HP + hc[None, :]
        w_hi = tl.load(wh + wofs)
        w_lo = tl.load(wh + NHID * HP * HP + wofs)
        h = _mma_to_operand(h, HP)
        h = C.dot3_acc(h, w_hi, w_lo, tl.zeros_like(h), PREC, TERMS, LO_RN) \
            + tl.load(bh + i * HP + hc)[None, :]
        h = tl.maximum(h, 0.0)
    direction = tl.sum(h * wl0[None, :], axis=1) + bl0
    magnitude = tl.sum(h * wl1[None, :], axis=1) + bl1
    return direction, magnitude


@triton.jit
def _cat16(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15):
    """16 vectors [BLOCK] → [BLOCK, 2, 2, 2, 2] whose reshape to [BLOCK, 16] holds f_i in
    column i (``tl.join`` adds its axis last, so pairs are taken 8, 4, 2, 1 apart)."""
    p0 = tl.join(f0, f8)
    p1 = tl.join(f1, f9)
    p2 = tl.join(f2, f10)
    p3 = tl.join(f3, f11)
    p4 = tl.join(f4, f12)
    p5 = tl.join(f5, f13)
    p6 = tl.join(f6, f14)
    p7 = tl.join(f7, f15)
    q0 = tl.join(p0, p4)
    q1 = tl.join(p1, p5)
    q2 = tl.join(p2, p6)
    q3 = tl.join(p3, p7)
    return tl.join(tl.join(q0, q2), tl.join(q1, q3))


# -- the folded kernels (factored tensors) --------------------------------------------------


@triton.jit
def _tail_weights(wh, bh, wl, bl, hc, HP: tl.constexpr, NHID: tl.constexpr):
    """The MLP's first hidden layer (its TF32 halves; a zero layer if ``NHID = 0``) and
    output layer, loaded once per program: ``(w1_hi [HP, HP], w1_lo, b1 [HP], wl0 [HP],
    wl1 [HP], bl0, bl1)``."""
    w1_ofs = hc[:, None] * HP + hc[None, :]
    return (tl.load(wh + w1_ofs), tl.load(wh + NHID * HP * HP + w1_ofs), tl.load(bh + hc),
            tl.load(wl + hc * 16), tl.load(wl + hc * 16 + 1), tl.load(bl), tl.load(bl + 1))


@triton.jit
def _axis_weight(invp, w0f, fi, HP: tl.constexpr):
    """``inv[fi] · W0[fi, :]`` [HP]: the normalized first-layer row of feature ``fi``."""
    return tl.load(invp + fi) * tl.load(w0f + fi * HP + tl.arange(0, HP))


@triton.jit
def sfc_axis_kernel(aprog, ptrs, norm, w0f, terms, HP: tl.constexpr, NPTR: tl.constexpr,
                    FB: tl.constexpr):
    """The first-layer terms of the axis features, one row of ``terms`` [E, HP] per entry
    of every factored tensor's ``v_row`` and ``v_col``: ``Σ_k v_k · inv[fv+k]·W0[fv+k] +
    rsqrt(v_k + 1e-8) · inv[fv+6+k]·W0[fv+6+k]`` (``fv`` = 13 for ``v_row``, 16 for
    ``v_col``; ``inv`` the tensor's normalizers ``norm[t]``), float32 FMAs in that order.
    Program ``pid`` covers the FB entries from ``e0`` of ``aprog[pid] = (t, which, e0, n,
    dst)`` (``which`` 0: ``v_row``, 1: ``v_col``; ``n`` the entries in the statistic,
    ``dst`` the row of ``terms`` of its entry 0)."""
    pid = tl.program_id(0)
    t = tl.load(aprog + pid * 5)
    which = tl.load(aprog + pid * 5 + 1)
    e = tl.load(aprog + pid * 5 + 2) + tl.arange(0, FB)
    msk = e < tl.load(aprog + pid * 5 + 3)
    dst = tl.load(aprog + pid * 5 + 4)
    vp = C.ptr_f32(ptrs, t, 4 + which, NPTR)
    invp = norm + t * 32
    fv = 13 + 3 * which
    hc = tl.arange(0, HP)
    h = tl.zeros([FB, HP], tl.float32)
    for k in tl.static_range(3):
        v = tl.load(vp + e * 3 + k, mask=msk, other=1.0)
        h += v[:, None] * _axis_weight(invp, w0f, fv + k, HP)[None, :]
    for k in tl.static_range(3):
        v = tl.load(vp + e * 3 + k, mask=msk, other=1.0)
        h += tl.math.rsqrt(v + 1e-8)[:, None] * _axis_weight(invp, w0f, fv + 6 + k, HP)[None, :]
    tl.store(terms + (dst + e)[:, None].to(tl.int64) * HP + hc[None, :], h, mask=msk[:, None])


@triton.jit
def sfc_norm_kernel(sums, numel, w16, norm, w16n, HP: tl.constexpr, SPLIT: tl.constexpr):
    """Per tensor ``t`` (one program each): the normalizers ``norm[t] = rsqrt(1e-5 +
    float32(sums[t] / numel[t]))`` [32] (``sums`` float64 [n_tensors, 32]: Σ feature²), and
    the folded kernels' per-element first-layer rows with them folded in, ``w16n[t] =
    (inv[ELEM_FEATURES, None] · W16)`` [16, HP], stored as its TF32 halves (hi, then lo:
    [n_tensors, 2, 16, HP]) if ``SPLIT`` (exact mode), else as is (and a zero lo half)."""
    t = tl.program_id(0)
    c = tl.arange(0, 32)
    inv = tl.math.rsqrt(1e-5 + (tl.load(sums + t * 32 + c)
                                / tl.load(numel + t).to(tl.float64)).to(tl.float32))
    tl.store(norm + t * 32 + c, inv)
    kk = tl.arange(0, 16)
    hc = tl.arange(0, HP)
    inv16 = tl.math.rsqrt(1e-5 + (tl.load(sums + t * 32 + tl.where(kk < 13, kk, kk + 12))
                                  / tl.load(numel + t).to(tl.float64)).to(tl.float32))
    w = inv16[:, None] * tl.load(w16 + kk[:, None] * HP + hc[None, :])
    out = w16n + t * 32 * HP + kk[:, None] * HP + hc[None, :]
    if SPLIT:
        hi = C.round_tf32(w)
        tl.store(out, hi)
        tl.store(out + 16 * HP, C.round_tf32(w - hi))
    else:
        tl.store(out, w)
        tl.store(out + 16 * HP, tl.zeros([16, HP], tl.float32))


@triton.jit
def _put(vec, cols, i, x):
    """``vec`` with entry ``i`` (``cols`` its indices) set to the scalar ``x``."""
    return tl.where(cols == i, x, vec)


@triton.jit
def _fold_body(meta, pids, prog, ptrs, rcm, decays, norm, scal, w16n, terms, tofs, b0,
               wh, bh, wl, bl, part, exp_mult, step_mult, FUSED: tl.constexpr,
               PREC: tl.constexpr, TERMS: tl.constexpr, HP: tl.constexpr,
               NHID: tl.constexpr, NPTR: tl.constexpr, NF: tl.constexpr, TA: tl.constexpr,
               TB: tl.constexpr, SA: tl.constexpr, PREFETCH: tl.constexpr = False,
               AB_ACC: tl.constexpr = False, LO_RN: tl.constexpr = True,
               RA: tl.constexpr = 1):
    """One tile [TA, TB] of a factored tensor, walked in sub-tiles [SA, TB] (BLOCK
    elements). The b axis (TB positions ``ib``, fixed per program) and the a axis (SA
    positions ``ia`` per sub-tile) each index ``v_row`` or ``v_col`` (``A_IS_D0``); their
    statistics and factors are computed per position
    (:func:`xopt.kernels.lopt_common.axis_stats`), per element only the 16 features
    :data:`ELEM_FEATURES`.

    ``FUSED=False``: Σ feature² over the tile → ``part[gpid, 0:32]`` (float64): the 16
    per-element ones accumulated per thread in float32; an axis feature's as Σ over the
    tile's positions on that axis (float32 per thread) times the tile's extent on the other
    axis. ``FUSED=True``: ``h = relu(x16 @ W16n + a_term + b_term)`` with ``x16`` [BLOCK,
    16] the raw per-element features, ``W16n`` their first-layer rows with the normalizers
    folded in (``w16n[t]``, :func:`sfc_norm_kernel`) and the axis terms read from ``terms``
    (rows ``tofs[t, 0] + v_row index`` and ``tofs[t, 1] + v_col index``,
    :func:`sfc_axis_kernel`; ``b_term`` [TB, HP] plus the bias once per program, ``a_term``
    [SA, HP] per sub-tile); then :func:`_mlp_tail`; writes the new parameter (or the step),
    ``m`` and ``rms``. ``PREFETCH``: the next sub-tile's g, p, m and rms are loaded before
    this one is computed (their latency hidden behind its MLP); ``AB_ACC``: the axis terms
    and bias are the first matmul's starting accumulator; ``LO_RN``: see
    :func:`_dot3_acc`."""
    BLOCK: tl.constexpr = SA * TB
    gpid, t, row, b, ta, tb, rc0, rc1, rc2 = _program(meta, pids, prog, rcm, NF)
    pp, gp, mp, rp, vr, vc, vd = C.tensor_ptrs(ptrs, t, NPTR)
    md0, md1, md2, rd, fd0, fd1, fd2 = C.load_decays(decays)
    ia_n = tl.load(row + 2)
    ib_n = tl.load(row + 3)
    sap = tl.load(row + 4)
    sbp = tl.load(row + 5)
    bs1 = tl.load(row + 6)
    boff = C.batch_offset(b, bs1, tl.load(row + 7), tl.load(row + 8))
    b_row, a_row, rbase, rstr, cbase, cstr, vb, va = C.axis_layout(row, ptrs, t, b, bs1, NPTR)
    ib = tb * TB + tl.arange(0, TB)
    mb = ib < ib_n
    bidx = tl.where(b_row, rbase + ib * rstr, cbase + ib * cstr)
    vb0, vb1, vb2, sb0, sb1, sb2, fb0, fb1, fb2 = C.axis_stats(vb, bidx, mb, b_row, rc0, rc1,
                                                               rc2)
    hc = tl.arange(0, HP)
    kk = tl.arange(0, 16)
    if FUSED:
        outp = C.ptr_f32(ptrs, t, 7, NPTR)
        lr = tl.load(scal + t * 4)
        lrwd = tl.load(scal + t * 4 + 1)
        write_step = tl.load(scal + t * 4 + 2)
        # the per-element features' first-layer rows, normalizers folded in
        # (sfc_norm_kernel), loaded once per program
        w16_t = w16n + t * 32 * HP + kk[:, None] * HP + hc[None, :]
        w16h_t = tl.load(w16_t)
        w16l_t = tl.load(w16_t + 16 * HP)
        w1h_t, w1l_t, b1_t, wl0_t, wl1_t, bl0_t, bl1_t = _tail_weights(wh, bh, wl, bl, hc, HP,
                                                                      NHID)
        ta_row = tl.load(tofs + t * 2 + tl.where(a_row, 0, 1))
        tb_row = tl.load(tofs + t * 2 + tl.where(b_row, 0, 1))
        b_term = tl.load(b0 + hc)[None, :] + tl.load(
            terms + (tb_row + bidx)[:, None] * HP + hc[None, :], mask=mb[:, None], other=0.0)
    else:
        z = tl.zeros([BLOCK], tl.float32)
        q0, q1, q2, q3, q4, q5, q6, q7 = z, z, z, z, z, z, z, z
        q8, q9, q10, q11, q12, q13, q14, q15 = z, z, z, z, z, z, z, z
        za = tl.zeros([SA], tl.float32)
        qa0, qa1, qa2, qa3, qa4, qa5 = za, za, za, za, za, za
    sa_i = tl.arange(0, SA)
    a0 = ta * TA
    n_sub = tl.minimum(TA * RA, ia_n - a0)
    if PREFETCH:  # the first sub-tile's loads
        off_n = tl.reshape(boff + (a0 + sa_i)[:, None].to(tl.int64) * sap
                           + ib[None, :].to(tl.int64) * sbp, [BLOCK])
        mask_n = tl.reshape((sa_i < n_sub)[:, None] & mb[None, :], [BLOCK])
        g_n, p_n, o0_n, o1_n, o2_n, or_n = _load_elems(gp, pp, mp, rp, off_n, mask_n)
    for s in range(0, n_sub, SA):
        ia = a0 + s + sa_i
        ma = ia < ia_n
        aidx = tl.where(a_row, rbase + ia * rstr, cbase + ia * cstr)
        va0, va1, va2, sa0, sa1, sa2, fa0, fa1, fa2 = C.axis_stats(va, aidx, ma, a_row, rc0,
                                                                   rc1, rc2)
        off = tl.reshape(boff + ia[:, None].to(tl.int64) * sap
                         + ib[None, :].to(tl.int64) * sbp, [BLOCK])
        mask = tl.reshape(ma[:, None] & mb[None, :], [BLOCK])
        ff0 = tl.reshape(fa0[:, None] * fb0[None, :], [BLOCK])
        ff1 = tl.reshape(fa1[:, None] * fb1[None, :], [BLOCK])
        ff2 = tl.reshape(fa2[:, None] * fb2[None, :], [BLOCK])
        if PREFETCH:  # this sub-tile's loads were issued one sub-tile ago; the next one's now
            g, p, o0, o1, o2, orr = g_n, p_n, o0_n, o1_n, o2_n, or_n
            off_n = off + SA * sap
            mask_n = tl.reshape((s + SA + sa_i < n_sub)[:, None] & mb[None, :], [BLOCK])
            g_n, p_n, o0_n, o1_n, o2_n, or_n = _load_elems(gp, pp, mp, rp, off_n, mask_n)
        else:
            g, p, o0, o1, o2, orr = _load_elems(gp, pp, mp, rp, off, mask)
        m0 = md0 * o0 + (1 - md0) * g
        m1 = md1 * o1 + (1 - md1) * g
        m2 = md2 * o2 + (1 - md2) * g
        rms = rd * orr + (1 - rd) * (g * g)
        rr = tl.math.rsqrt(rms + 1e-6)
        if FUSED:
            x = _cat16(g, p, m0, m1, m2, rms, m0 * rr, m1 * rr, m2 * rr, rr,
                       g * ff0, g * ff1, g * ff2, m0 * ff0, m1 * ff1, m2 * ff2)
            x = tl.reshape(x, [BLOCK, 16])
            a_term = tl.load(terms + (ta_row + aidx)[:, None] * HP + hc[None, :],
                             mask=ma[:, None], other=0.0)
            ab = tl.reshape(a_term[:, None, :] + b_term[None, :, :], [BLOCK, HP])
            if AB_ACC:
                h = tl.maximum(C.dot3_acc(x, w16h_t, w16l_t, ab, PREC, TERMS, LO_RN), 0.0)
            else:
                h = tl.maximum(C.dot3_acc(x, w16h_t, w16l_t, tl.zeros_like(ab), PREC, TERMS,
                                         LO_RN) + ab, 0.0)
            direction, magnitude = _mlp_tail(h, w1h_t, w1l_t, b1_t, wh, bh, wl0_t, wl1_t,
                                             bl0_t, bl1_t, HP, NHID, PREC, TERMS, LO_RN)
            step = direction * tl.exp(magnitude * exp_mult) * step_mult
            C.store_update(outp, mp, rp, off, mask, p, step, lr, lrwd, write_step, m0, m1, m2,
                           rms)
        else:
            # masked elements: g, p, m, rms are 0, so every feature but rr is 0
            q0 += g * g
            q1 += p * p
            q2 += m0 * m0
            q3 += m1 * m1
            q4 += m2 * m2
            q5 += rms * rms
            q6 += (m0 * rr) * (m0 * rr)
            q7 += (m1 * rr) * (m1 * rr)
            q8 += (m2 * rr) * (m2 * rr)
            q9 += tl.where(mask, rr * rr, 0.0)
            q10 += (g * ff0) * (g * ff0)
            q11 += (g * ff1) * (g * ff1)
            q12 += (g * ff2) * (g * ff2)
            q13 += (m0 * ff0) * (m0 * ff0)
            q14 += (m1 * ff1) * (m1 * ff1)
            q15 += (m2 * ff2) * (m2 * ff2)
            qa0 += tl.where(ma, va0 * va0, 0.0)
            qa1 += tl.where(ma, va1 * va1, 0.0)
            qa2 += tl.where(ma, va2 * va2, 0.0)
            qa3 += tl.where(ma, sa0 * sa0, 0.0)
            qa4 += tl.where(ma, sa1 * sa1, 0.0)
            qa5 += tl.where(ma, sa2 * sa2, 0.0)
    if not FUSED:
        cols = tl.arange(0, 32)
        acc = tl.zeros([32], tl.float64)
        acc = _put(acc, cols, 0, tl.sum(q0.to(tl.float64)))
        acc = _put(acc, cols, 1, tl.sum(q1.to(tl.float64)))
        acc = _put(acc, cols, 2, tl.sum(q2.to(tl.float64)))
        acc = _put(acc, cols, 3, tl.sum(q3.to(tl.float64)))
        acc = _put(acc, cols, 4, tl.sum(q4.to(tl.float64)))
        acc = _put(acc, cols, 5, tl.sum(q5.to(tl.float64)))
        acc = _put(acc, cols, 6, tl.sum(q6.to(tl.float64)))
        acc = _put(acc, cols, 7, tl.sum(q7.to(tl.float64)))
        acc = _put(acc, cols, 8, tl.sum(q8.to(tl.float64)))
        acc = _put(acc, cols, 9, tl.sum(q9.to(tl.float64)))
        acc = _put(acc, cols, 10, tl.sum(q10.to(tl.float64)))
        acc = _put(acc, cols, 11, tl.sum(q11.to(tl.float64)))
        acc = _put(acc, cols, 12, tl.sum(q12.to(tl.float64)))
        acc = _put(acc, cols, 25, tl.sum(q13.to(tl.float64)))
        acc = _put(acc, cols, 26, tl.sum(q14.to(tl.float64)))
        acc = _put(acc, cols, 27, tl.sum(q15.to(tl.float64)))
        # axis features: a tile's Σ over its elements = Σ over one axis × the other's extent
        n_b = tl.minimum(TB, ib_n - tb * TB).to(tl.float64)
        n_a = n_sub.to(tl.float64)
        fa = tl.where(a_row, 13, 16)
        fb = tl.where(b_row, 13, 16)
        acc = _put(acc, cols, fa, tl.sum(qa0.to(tl.float64)) * n_b)
        acc = _put(acc, cols, fa + 1, tl.sum(qa1.to(tl.float64)) * n_b)
        acc = _put(acc, cols, fa + 2, tl.sum(qa2.to(tl.float64)) * n_b)
        acc = _put(acc, cols, fa + 6, tl.sum(qa3.to(tl.float64)) * n_b)
        acc = _put(acc, cols, fa + 7, tl.sum(qa4.to(tl.float64)) * n_b)
        acc = _put(acc, cols, fa + 8, tl.sum(qa5.to(tl.float64)) * n_b)
        acc = _put(acc, cols, fb, tl.sum(tl.where(mb, vb0 * vb0, 0.0).to(tl.float64)) * n_a)
        acc = _put(acc, cols, fb + 1, tl.sum(tl.where(mb, vb1 * vb1, 0.0).to(tl.float64)) * n_a)
        acc = _put(acc, cols, fb + 2, tl.sum(tl.where(mb, vb2 * vb2, 0.0).to(tl.float64)) * n_a)
        acc = _put(acc, cols, fb + 6, tl.sum(tl.where(mb, sb0 * sb0, 0.0).to(tl.float64)) * n_a)
        acc = _put(acc, cols, fb + 7, tl.sum(tl.where(mb, sb1 * sb1, 0.0).to(tl.float64)) * n_a)
        acc = _put(acc, cols, fb + 8, tl.sum(tl.where(mb, sb2 * sb2, 0.0).to(tl.float64)) * n_a)
        tl.store(part + gpid.to(tl.int64) * 32 + cols, acc)


@triton.jit
def sfc_fold_stats_kernel(meta, pids, prog, ptrs, rcm, decays, norm, scal, w16n, terms,
                          tofs, b0, wh, bh, wl, bl, part, exp_mult, step_mult,
                          PREC: tl.constexpr, TERMS: tl.constexpr, HP: tl.constexpr,
                          NHID: tl.constexpr, NPTR: tl.constexpr, NF: tl.constexpr,
                          TA: tl.constexpr, TB: tl.constexpr, SA: tl.constexpr,
                          PREFETCH: tl.constexpr = False):
    """Statistics pass of the factored tensors (:func:`_fold_body`, ``FUSED=False``)."""
    _fold_body(meta, pids, prog, ptrs, rcm, decays, norm, scal, w16n, terms, tofs, b0,
               wh, bh, wl, bl, part, exp_mult, step_mult, False, PREC, TERMS, HP, NHID, NPTR,
               NF, TA, TB, SA, PREFETCH)


@triton.jit
def sfc_fold_fused_kernel(meta, pids, prog, ptrs, rcm, decays, norm, scal, w16n, terms,
                          tofs, b0, wh, bh, wl, bl, part, exp_mult, step_mult,
                          PREC: tl.constexpr, TERMS: tl.constexpr, HP: tl.constexpr,
                          NHID: tl.constexpr, NPTR: tl.constexpr, NF: tl.constexpr,
                          TA: tl.constexpr, TB: tl.constexpr, SA: tl.constexpr,
                          PREFETCH: tl.constexpr, AB_ACC: tl.constexpr, LO_RN: tl.constexpr,
                          RA: tl.constexpr = 1):
    """Fused pass of the factored tensors (:func:`_fold_body`, ``FUSED=True``)."""
    _fold_body(meta, pids, prog, ptrs, rcm, decays, norm, scal, w16n, terms, tofs, b0,
               wh, bh, wl, bl, part, exp_mult, step_mult, True, PREC, TERMS, HP, NHID, NPTR,
               NF, TA, TB, SA, PREFETCH, AB_ACC, LO_RN, RA)


# -- the unfolded kernels (unfactored tensors; every tensor with the 4-wide MLP) ------------


@triton.jit
def _sfc_body(meta, pids, prog, ptrs, rcm, decays, norm, scal, w0h, w0l, b0, wh, bh, wl, bl,
              part, exp_mult, step_mult, FUSED: tl.constexpr, PREC: tl.constexpr,
              TERMS: tl.constexpr, MLP_DOT: tl.constexpr, HP: tl.constexpr,
              NHID: tl.constexpr, NPTR: tl.constexpr, NF: tl.constexpr, TA: tl.constexpr,
              TB: tl.constexpr, SA: tl.constexpr):
    """One tile [TA, TB] of one tensor (:func:`_program`), unfolded: walked in sub-tiles
    of SA × TB elements (BLOCK; one, two or four per thread). Each sub-tile: the new
    accumulators and the 28 features as [BLOCK] vectors.

    ``FUSED=False`` (statistics): Σ over the tile of each feature² → ``part[gpid, 0:32]``
    (float64; masked elements excluded), accumulated per thread in float32 as a [BLOCK, 32]
    tile (one row per element, :func:`xopt.kernels.lopt_common.cat32`) and reduced once at
    the end. ``FUSED=True``: normalizes by ``norm[t, :]`` (the tensor's
    ``rsqrt(1e-5 + mean feature²)``), runs the MLP — with ``MLP_DOT`` on the tensor cores
    from the [BLOCK, 32] tile (:func:`xopt.kernels.lopt_common.dot3`, :func:`_mlp_tail`,
    weights loaded once per program), else 4 wide in float32 FMAs without a tile
    (:func:`~xopt.kernels.lopt_common.rank1`, :func:`~xopt.kernels.lopt_common.mlp4_tail`)
    — and writes the new parameter (or the step), ``m``, ``rms`` and ``v_diag``."""
    BLOCK: tl.constexpr = SA * TB
    gpid, t, row, b, ta, tb, rc0, rc1, rc2 = _program(meta, pids, prog, rcm, NF)
    fact = tl.load(row + 1)
    ia_n = tl.load(row + 2)
    pp, gp, mp, rp, vr, vc, vd = C.tensor_ptrs(ptrs, t, NPTR)
    md0, md1, md2, rd, fd0, fd1, fd2 = C.load_decays(decays)
    cols = tl.arange(0, 32)
    if FUSED:
        outp = C.ptr_f32(ptrs, t, 7, NPTR)
        lr = tl.load(scal + t * 4)
        lrwd = tl.load(scal + t * 4 + 1)
        write_step = tl.load(scal + t * 4 + 2)
        if MLP_DOT:  # the normalizers and first layer's weights, loaded once per program
            inv = tl.load(norm + t * 32 + cols)
            kk = tl.arange(0, 32)
            hc = tl.arange(0, HP)
            w0h_t = tl.load(w0h + kk[:, None] * HP + hc[None, :])
            w0l_t = tl.load(w0l + kk[:, None] * HP + hc[None, :])
            b0_t = tl.load(b0 + hc)
            w1h_t, w1l_t, b1_t, wl0_t, wl1_t, bl0_t, bl1_t = _tail_weights(wh, bh, wl, bl, hc,
                                                                          HP, NHID)
    else:
        acc = tl.zeros([BLOCK, 32], tl.float32)
    sa_i = tl.arange(0, SA)
    ib = tb * TB + tl.arange(0, TB)
    a0 = ta * TA
    n_sub = tl.minimum(TA, ia_n - a0)
    for s in range(0, n_sub, SA):
        ia = a0 + s + sa_i
        off, mask, ridx, cidx = C.load_tile(row, t, b, ia, ib, ptrs, NPTR, BLOCK)
        g = tl.load(gp + off, mask=mask, other=0.0)
        p = tl.load(pp + off, mask=mask, other=0.0)
        m0 = md0 * tl.load(mp + off * 3, mask=mask, other=0.0) + (1 - md0) * g
        m1 = md1 * tl.load(mp + off * 3 + 1, mask=mask, other=0.0) + (1 - md1) * g
        m2 = md2 * tl.load(mp + off * 3 + 2, mask=mask, other=0.0) + (1 - md2) * g
        rms = rd * tl.load(rp + off, mask=mask, other=0.0) + (1 - rd) * (g * g)
        R0, C0, FG0, FM0, V0, R1, C1, FG1, FM1, V1, R2, C2, FG2, FM2, V2, v3 = \
            C.accumulate3(fact, off, mask, ridx, cidx, g, m0, m1, m2, rp, vr, vc, vd, fd0, fd1,
                          fd2, rc0, rc1, rc2, 1e-6)
        rr, rsr0, rsr1, rsr2, rsc0, rsc1, rsc2 = C.rsqrt_features(rms, R0, R1, R2, C0, C1, C2)
        if FUSED and not MLP_DOT:
            # 4-wide MLP: the first layer feature by feature (spec order), no feature tile
            invp = norm + t * 32
            z = tl.zeros([BLOCK], tl.float32)
            h0, h1, h2, h3 = C.rank1(z, z, z, z, g, 0, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, p, 1, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m0, 2, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m1, 3, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m2, 4, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rms, 5, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m0 * rr, 6, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m1 * rr, 7, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m2 * rr, 8, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rr, 9, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, g * FG0, 10, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, g * FG1, 11, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, g * FG2, 12, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, R0, 13, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, R1, 14, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, R2, 15, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, C0, 16, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, C1, 17, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, C2, 18, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rsr0, 19, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rsr1, 20, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rsr2, 21, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rsc0, 22, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rsc1, 23, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rsc2, 24, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m0 * FM0, 25, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m1 * FM1, 26, invp, w0h)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m2 * FM2, 27, invp, w0h)
            direction, magnitude = C.mlp4_tail(h0, h1, h2, h3, b0, wh, bh, wl, bl, NHID)
        else:
            z = tl.zeros([BLOCK], tl.float32)
            x = C.cat32(g, p, m0, m1, m2, rms, m0 * rr, m1 * rr, m2 * rr, rr,
                        g * FG0, g * FG1, g * FG2, R0, R1, R2, C0, C1, C2,
                        rsr0, rsr1, rsr2, rsc0, rsc1, rsc2,
                        m0 * FM0, m1 * FM1, m2 * FM2, z, z, z, z)
            x = tl.reshape(x, [BLOCK, 32])
            if FUSED:
                h = tl.maximum(C.dot3(x * inv[None, :], w0h_t, w0l_t, PREC, TERMS)
                               + b0_t[None, :], 0.0)
                direction, magnitude = _mlp_tail(h, w1h_t, w1l_t, b1_t, wh, bh, wl0_t, wl1_t,
                                                 bl0_t, bl1_t, HP, NHID, PREC, TERMS)
                direction = tl.reshape(direction, [BLOCK])
                magnitude = tl.reshape(magnitude, [BLOCK])
            else:
                x = tl.where(mask[:, None], x, 0.0)
                acc += x * x
        if FUSED:
            step = direction * tl.exp(magnitude * exp_mult) * step_mult
            C.store_update(outp, mp, rp, off, mask, p, step, lr, lrwd, write_step, m0, m1, m2,
                           rms)
            if fact == 0:
                tl.store(v3, V0, mask=mask)
                tl.store(v3 + 1, V1, mask=mask)
                tl.store(v3 + 2, V2, mask=mask)
    if not FUSED:
        tl.store(part + gpid.to(tl.int64) * 32 + cols, tl.sum(acc.to(tl.float64), axis=0))


@triton.jit
def sfc_stats_kernel(meta, pids, prog, ptrs, rcm, decays, norm, scal, w0h, w0l, b0, wh, bh, wl, bl,
                     part, exp_mult, step_mult, PREC: tl.constexpr, TERMS: tl.constexpr,
                     MLP_DOT: tl.constexpr,
                     HP: tl.constexpr, NHID: tl.constexpr, NPTR: tl.constexpr,
                     NF: tl.constexpr, TA: tl.constexpr, TB: tl.constexpr, SA: tl.constexpr):
    """Statistics pass of the unfolded kernel (:func:`_sfc_body`, ``FUSED=False``)."""
    _sfc_body(meta, pids, prog, ptrs, rcm, decays, norm, scal, w0h, w0l, b0, wh, bh, wl, bl, part,
              exp_mult, step_mult, False, PREC, TERMS, MLP_DOT, HP, NHID, NPTR, NF, TA, TB, SA)


@triton.jit
def sfc_fused_kernel(meta, pids, prog, ptrs, rcm, decays, norm, scal, w0h, w0l, b0, wh, bh, wl, bl,
                     part, exp_mult, step_mult, PREC: tl.constexpr, TERMS: tl.constexpr,
                     MLP_DOT: tl.constexpr,
                     HP: tl.constexpr, NHID: tl.constexpr, NPTR: tl.constexpr,
                     NF: tl.constexpr, TA: tl.constexpr, TB: tl.constexpr, SA: tl.constexpr):
    """Fused pass of the unfolded kernel (:func:`_sfc_body`, ``FUSED=True``)."""
    _sfc_body(meta, pids, prog, ptrs, rcm, decays, norm, scal, w0h, w0l, b0, wh, bh, wl, bl, part,
              exp_mult, step_mult, True, PREC, TERMS, MLP_DOT, HP, NHID, NPTR, NF, TA, TB, SA)


def _pad(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros((rows, cols), dtype=torch.float32, device=w.device)
    out[:w.shape[0], :w.shape[1]] = w
    return out


def _next_pow2(n: int, lo: int = 16) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


check_supported = L.supported_small_fc


class SmallFCTriton:
    """The Triton step of one :class:`xopt.torch.SmallFCLOpt` (caches its layout).

    The step's device work (launches 1-6 and the glue between them) is :meth:`_body`,
    which reads only static buffers: the pointer and per-tensor scalar tables, the
    iteration counter (advanced on the device by the step itself; copied in only when the
    caller's iteration is not the one it holds), the layout's tables, the cached weights
    and decays. On a CUDA device it is recorded once into a CUDA graph and replayed
    (:class:`xopt.kernels.lopt_graph.StepGraph`: recorded again when one of those objects
    is replaced, eager on the CPU, under a caller's capture or with
    ``XOPT_LOPT_CUDA_GRAPHS=0``); the host then spends a few comparisons and one replay per
    step.
    """

    PRECISIONS = {"exact": "tf32x3", "fast": "tf32"}

    def __init__(self, hp: _spec.SmallFCLOpt, precision: str = "exact") -> None:
        why = check_supported(hp)
        if why is not None:
            raise ValueError(f"SmallFCLOpt(impl='triton'): {why}")
        self.hp = hp
        self.prec = self.PRECISIONS[precision]
        self._layout: L.Layout | None = None
        self._pids: dict = {}
        self._wcache: tuple | None = None
        self._decays: tuple | None = None  # (key, all 7 decays, Adafactor's 3), per θ
        self._tab = G.StepTables(4)  # pointers; lr, lr·λ, write_step, 0
        self._it: torch.Tensor | None = None  # int32 0-d (device): the iteration t
        self._it_next: int | None = None  # what _it holds after the last step
        self._ts: torch.Tensor | None = None  # float32 [11] (device): the timescales
        self._graph = G.StepGraph("SmallFCLOpt")

    @property
    def graph_recordings(self) -> int:
        """How many times the step was recorded into a CUDA graph (tests read it)."""
        return self._graph.recordings

    def layout(self, shapes: Sequence[tuple[int, ...]], device: torch.device) -> L.Layout:
        lay = self._layout
        if lay is None or lay.shapes != tuple(shapes) or lay.meta.device != device:
            lay = self._layout = L.build_layout(shapes, device)
            self._pids = self._program_sets(lay, device)
        return lay

    @staticmethod
    def _program_sets(lay: L.Layout, device: torch.device) -> dict:
        """Per layout: the indices (into ``prog_all``) of every program, of the factored
        tensors' and of the others' (``"all" | "fact" | "unf"``: (int32 tensor, count));
        for the axis terms (:func:`sfc_axis_kernel`), ``"tofs"`` (int64 [n_tensors, 2]: the
        first row of ``terms`` of each factored tensor's ``v_row`` and ``v_col``),
        ``"aprog"`` (its programs, int64 [n, 5], and their count) and ``"n_terms"``."""
        sets: dict[str, list[int]] = {"all": [], "fact": [], "unf": [], "fact_ra": []}
        tofs, aprog, e = [], [], 0
        for t, r in enumerate(lay.meta_host):
            n = r[L.NB] * r[L.NTA] * r[L.NTB]
            ids = range(r[L.PSTART], r[L.PSTART] + n)
            sets["all"].extend(ids)
            sets["fact" if r[L.FACT] else "unf"].extend(ids)
            if r[L.FACT]:  # the fused pass's programs: RA tiles along a each
                sets["fact_ra"].extend(i for i in ids if (i - r[L.PSTART]) % (
                    r[L.NTA] * r[L.NTB]) // r[L.NTB] % RA == 0)
            if not r[L.FACT]:
                tofs.append([0, 0])
                continue
            tofs.append([e, e + r[L.NB] * r[L.ND1]])
            for which, count in ((0, r[L.NB] * r[L.ND1]), (1, r[L.NB] * r[L.ND0])):
                aprog.extend([t, which, e0, count, e] for e0 in range(0, count, AXIS_BLOCK))
                e += count
        out = {k: (to_device(torch.tensor(v or [0], dtype=torch.int32), device), len(v))
               for k, v in sets.items()}
        out["tofs"] = to_device(torch.tensor(tofs, dtype=torch.int64), device)
        out["aprog"] = (to_device(torch.tensor(aprog or [[0] * 5], dtype=torch.int64), device),
                        len(aprog))
        out["n_terms"] = e
        out["ra"] = RA
        return out

    def _weights(self, meta: Mapping[str, torch.Tensor]) -> dict:
        """The MLP's weights as the kernels read them (cached per meta-parameter tensor):
        zero-padded to HP columns, the first layer's 28 feature rows (padded to 32) apart
        from its 11 time-feature rows ``wt`` (folded into the bias at each step); for the
        tensor-core MLP in exact mode, split into TF32 hi/lo halves
        (:func:`xopt.kernels.lopt_common.split_weights`). The folded kernels read the 16
        per-element rows (:data:`ELEM_FEATURES`) from ``w16`` [16, HP] (normalized and
        split per tensor by :func:`sfc_norm_kernel`) and the axis rows from the float32
        ``w0f`` [32, HP]."""
        key = (id(meta), meta["mlp/w0"].data_ptr())
        if self._wcache is not None and self._wcache[0] == key:
            return self._wcache[1]
        hp = self.hp
        nl = int(hp.hidden_layers)
        width = int(hp.hidden_size)
        dot = width > FMA_MAX
        hp_ = _next_pow2(width, 16) if dot else 4
        w0 = meta["mlp/w0"]
        dev = w0.device
        w0p = _pad(w0[:NFEAT], 32, hp_)
        w16 = w0p[list(ELEM_FEATURES)].contiguous()
        wh = torch.stack([_pad(meta[f"mlp/w{i}"], hp_, hp_) for i in range(1, nl)]) \
            if nl > 1 else torch.zeros((1, hp_, hp_), device=dev)
        if dot:  # the tensor-core MLP reads its hidden layers' rows permuted (_mma_to_operand)
            wh = wh[:, _operand_perm(hp_)].contiguous()
        bh = torch.stack([_pad(meta[f"mlp/b{i}"][None], 1, hp_)[0] for i in range(1, nl)]) \
            if nl > 1 else torch.zeros((1, hp_), device=dev)
        if dot and self.prec == "tf32x3":
            w0h, w0l = C.split_weights(w0p)
            whh, whl = C.split_weights(wh)
        else:
            w0h, w0l = w0p, torch.zeros_like(w0p)
            whh, whl = wh, torch.zeros_like(wh)
        out = dict(w0h=w0h, w0l=w0l, w16=w16, w0f=w0p.contiguous(),
                   wt=w0[NFEAT:], wh=torch.cat([whh.flatten(), whl.flatten()]),
                   bh=bh.contiguous(), wl=_pad(meta[f"mlp/w{nl}"], hp_, 16),
                   bl=_pad(meta[f"mlp/b{nl}"][None], 1, 16)[0], hp=hp_, nhid=nl - 1, dot=dot)
        self._wcache = (key, out)
        return out

    def _tables(self, params, grads, states, outs, write_step, lrs, lrwds,  # noqa: ANN001
                dev: torch.device, io) -> None:  # noqa: ANN001
        """The layout and the static pointer / scalar tables for these tensors
        (:class:`xopt.kernels.lopt_graph.StepTables`)."""
        if self._tab.current(io, dev):
            return
        self.layout([tuple(p.shape) for p in params], dev)
        self._tab.update(params, grads, states, outs, write_step, lrs, lrwds, dev, io)

    def _counter(self, iteration: int, like: torch.Tensor) -> None:
        """The device iteration counter (and the timescales) for a step at ``iteration``:
        copied in only when the counter does not already hold it (the step advances it)."""
        dev = like.device
        if self._it is None or self._it.device != dev:
            self._it = torch.zeros((), dtype=torch.int32, device=dev)
            self._it_next = None
            self._ts = arrays.constant(torch, [float(t) for t in _spec.TIMESCALES], like)
        if self._it_next != iteration:
            G.copy_in(self._it, torch.tensor(iteration, dtype=torch.int32))
        self._it_next = None  # (until the step has run: a failed step copies in again)

    def step(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             states: Sequence[dict[str, torch.Tensor]], outs: Sequence[torch.Tensor],
             write_step: Sequence[bool], lrs: Sequence[float], lrwds: Sequence[float],
             meta: Mapping[str, torch.Tensor], iteration: int, *, io=None) -> None:
        """One step: updates ``states`` in place and writes each tensor's new parameter
        (or, where ``write_step``, its step) into ``outs``. All tensors float32,
        contiguous, on one device. ``io``: the optimizer's
        :class:`xopt.torch._lopt.TritonIO` for these lists, when it has one: while its
        ``version`` is the one the pointer and scalar tables were made for, nothing is read
        per tensor."""
        dev = params[0].device
        self._tables(params, grads, states, outs, write_step, lrs, lrwds, dev, io)
        w = self._weights(meta)
        dkey = tuple((k, v.data_ptr(), v._version) for k, v in meta.items()
                     if k.startswith("decays/"))
        if self._decays is None or self._decays[0] != dkey:
            md, rd, fd = _spec.decays(self.hp, meta, xp=torch)
            self._decays = (dkey, torch.cat([md, rd, fd]).contiguous(), fd)
        b0 = meta["mlp/b0"]
        self._counter(iteration, b0)
        lay = self._layout
        refs = (lay, self._pids, self._tab.ptrs, self._tab.scal, self._it, self._ts, self._decays,
                self._wcache, b0)
        self._graph.run(lambda: self._body(lay, w, self._decays[1], self._decays[2], b0),
                        refs, dev)
        self._it_next = iteration + 1

    def _body(self, lay: L.Layout, w: dict, decays: torch.Tensor, fd: torch.Tensor,
              b0: torch.Tensor) -> None:
        """Launches 1-6 and the glue, from the static tables only (device work, no
        host→device copy: what a CUDA graph records); then the iteration counter
        advances."""
        hp = self.hp
        dev = decays.device
        ptrs, scal = self._tab.ptrs, self._tab.scal
        hp_ = w["hp"]
        rcm, _ = C.factored_pass(lay, ptrs, fd, clip_g=False, mom_sums=False, npt=NPTR,
                                 sa=SA_G2)
        if rcm is None:
            rcm = torch.zeros((3,), dtype=torch.float32, device=dev)
        part = torch.empty((lay.n_prog_all, 32), dtype=torch.float64, device=dev)
        common = dict(HP=hp_, NHID=w["nhid"], NPTR=NPTR, NF=L.NFIELDS, TA=L.TA, TB=L.TB,
                      num_warps=WARPS, num_stages=STAGES, PREC=self.prec, TERMS=TERMS)
        fold = FOLD and w["dot"]
        # (program indices, count, folded?) of each launch
        if fold:
            launches = [(*self._pids["fact"], True), (*self._pids["unf"], False)]
            fused_launches = [(*self._pids["fact_ra"], True), (*self._pids["unf"], False)]
        else:
            launches = [(*self._pids["all"], False)]
        tail = (w["wh"], w["bh"], w["wl"], w["bl"])
        consts = (float(hp.exp_mult), float(hp.step_mult))

        def run(pids, n, folded, fused, norm, w16n, terms, b0p):  # noqa: ANN001
            if n == 0:
                return
            args = (lay.meta, pids, lay.prog_all, ptrs, rcm, decays, norm, scal)
            if folded:
                kern = sfc_fold_fused_kernel if fused else sfc_fold_stats_kernel
                opts = dict(common)
                # (the fused kernel's cap is for HP ≤ 32; wider MLPs need more registers)
                # (the statistics kernel's, with one element per thread)
                cap = (MAXNREG_FOLD if hp_ <= 32 else 0) if fused else \
                    (MAXNREG_STATS if SA_STATS_FOLD * L.TB <= 32 * WARPS_STATS else 0)
                if fused:
                    opts["num_stages"] = STAGES_FOLD
                    opts["num_warps"] = WARPS_FOLD
                    opts.update(PREFETCH=PREFETCH, AB_ACC=AB_ACC, LO_RN=SPLIT_LO != "hw",
                                RA=self._pids["ra"])
                else:
                    opts["num_stages"] = STAGES_STATS
                    opts["num_warps"] = WARPS_STATS
                    opts.update(PREFETCH=PREFETCH_STATS)
                if cap:
                    opts["maxnreg"] = cap
                kern[(n,)](*args, w16n, terms, self._pids["tofs"], b0p, *tail,
                           part, *consts, SA=SA_FOLD if fused else SA_STATS_FOLD, **opts,
                           **FP_FUSION)
            else:
                kern = sfc_fused_kernel if fused else sfc_stats_kernel
                sa = (SA_DOT if w["dot"] else SA_FMA) if fused else SA_STATS
                kern[(n,)](*args, w["w0h"], w["w0l"], b0p, *tail, part, *consts,
                           MLP_DOT=w["dot"], SA=sa, **common, **FP_FUSION)

        for pids, n, folded in launches:  # (norm, w16n, terms, b0 unused: placeholders)
            run(pids, n, folded, False, part, part, part, part)
        # the time features folded into the first bias: xopt.specs.small_fc_lopt's
        # time_features op for op, t the device counter and the timescales kept there
        tf = torch.tanh(self._it.to(dtype=b0.dtype) / self._ts - 1.0)
        b0p = _pad((b0 + (tf[:, None] * w["wt"]).sum(0))[None], 1, hp_)[0]
        sums = C.seg_sum(part, lay)
        n_t = len(lay.shapes)
        norm = torch.empty((n_t, 32), dtype=torch.float32, device=dev)
        w16n = torch.empty((n_t, 2, 16, hp_), dtype=torch.float32, device=dev)
        sfc_norm_kernel[(n_t,)](sums, lay.numel, w["w16"], norm, w16n, HP=hp_,
                                SPLIT=self.prec == "tf32x3" and w["dot"], num_warps=4, **FP_FUSION)
        terms = part
        if fold and self._pids["aprog"][1]:
            aprog, n_ap = self._pids["aprog"]
            terms = torch.empty((self._pids["n_terms"], hp_), dtype=torch.float32, device=dev)
            sfc_axis_kernel[(n_ap,)](aprog, ptrs, norm, w["w0f"], terms, HP=hp_, NPTR=NPTR,
                                     FB=AXIS_BLOCK, num_warps=4, **FP_FUSION)
        for pids, n, folded in (fused_launches if fold else launches):
            run(pids, n, folded, True, norm, w16n, terms, b0p)
        self._it.add_(1)


def reference_step(hp: _spec.SmallFCLOpt, params: Sequence[torch.Tensor],
                   grads: Sequence[torch.Tensor], states: Sequence[Mapping[str, torch.Tensor]],
                   meta: Mapping[str, torch.Tensor], iteration: int,
                   ) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Pure-PyTorch reference: ``(steps, new states)`` per tensor, as the plain path computes
    them (:func:`xopt.specs.small_fc_lopt.compute_step` one tensor at a time)."""
    decays = _spec.decays(hp, meta, xp=torch)
    tf = _spec.time_features(torch, torch.tensor(iteration, dtype=torch.int32), meta["mlp/b0"])
    steps, new_states = [], []
    for p, g, st in zip(params, grads, states, strict=True):
        step, accs = _spec.compute_step(hp, p, g, *(st[v] for v in _spec.PARAM_VARS), tf,
                                        meta, decays, xp=torch)
        steps.append(step)
        new_states.append(dict(zip(_spec.PARAM_VARS, accs, strict=True)))
    return steps, new_states
