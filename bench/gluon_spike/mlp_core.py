"""Measurement spike: can Gluon's asynchronous wgmma hide the tensor-core waits of
small_fc_lopt's per-element MLP? (Not product code; nothing in xopt/ uses it.)

The MLP core of ``xopt/kernels/small_fc_lopt.py``'s fused kernel, isolated, on N rows
(one row = one parameter element), sub-tiles of BLOCK = 128 rows on 4 warps:

* inputs per row ``g``, ``p``, ``t`` (float32 [N]); per-row features (16 columns, one row
  per thread, as the product kernel builds its feature tile)
  ``x[:, c] = g·ca[c] + p·cb[c] + (g·rsqrt(p² + 1e-3))·cc[c]``;
* first layer, accumulator started from a per-element bias tile (the product's ``ab``)
  ``h1 = relu(x @ W1 + (b0 + t·wt))``, W1 [16, 32];
* hidden layer ``h2 = relu(h1 @ W2 + b1)``, W2 [32, 32], its A operand the first layer's
  accumulator with columns relabeled (small_fc_lopt's ``_mma_to_operand``; W2's rows
  stored permuted, ``_operand_perm``);
* output layer (float32 FMAs and row sums) ``d = h2 · wo[:, 0] + bo[0]``,
  ``m = h2 · wo[:, 1] + bo[1]``; stores ``d`` and ``m`` (float32 [N] each).

Both matmuls in split-precision TF32 (the product's exact mode, ``SPLIT_LO = "hw"``):
``x_hi = round_tf32(x)``, ``x_lo = x − x_hi`` (read by the tensor cores as its TF32
truncation), weights split on the host, and ``acc += x_lo·w_hi; acc += x_hi·w_lo;
acc += x_hi·w_hi`` in float32, in that order.

Kernel A (:func:`mlp_a_kernel`): plain Triton, ``tl.dot`` (each product followed by its
wait, as Triton places it), the next sub-tile's inputs prefetched by hand. Kernel B
(:func:`mlp_b_kernel`): Gluon, the products issued with ``warpgroup_mma(is_async=True)``,
two sub-tiles in flight (layer 1 of sub-tile i+1 issued before the output layer of sub-tile
i; layer 2 of sub-tile i before the features of sub-tile i+1), one wait per layer.

``python bench/gluon_spike/mlp_core.py`` (CUDA, Hopper): times both on N = 86,567,656
(ViT-B/16) and 354,823,168 (GPT-2 medium), checks them against a float64 torch reference.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BLOCK = 128
K1 = 16
HP = 32
#: gl.thread_barrier (triton 3.6) was renamed gl.barrier later
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


# -- plain Triton (kernel A) -----------------------------------------------------------------


@triton.jit
def _round_tf32(x):
    """x rounded to the nearest TF32 number (as xopt.kernels.lopt_common.round_tf32)."""
    return ((x.to(tl.int32, bitcast=True) + 4096) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _dot3_acc(x, w_hi, w_lo, acc, PRODUCTS: tl.constexpr):
    """``acc + x @ w``, split precision: x_lo·w_hi, x_hi·w_lo, x_hi·w_hi (x_lo unrounded);
    ``PRODUCTS = 1``: one TF32 product x·w_hi (the product's fast mode)."""
    if PRODUCTS == 1:
        return tl.dot(x, w_hi, acc, input_precision="tf32")
    x_hi = _round_tf32(x)
    x_lo = x - x_hi
    acc = tl.dot(x_lo, w_hi, acc, input_precision="tf32")
    acc = tl.dot(x_hi, w_lo, acc, input_precision="tf32")
    return tl.dot(x_hi, w_hi, acc, input_precision="tf32")


@triton.jit
def _split16(w):
    """``(w_hi, w_lo)`` float16: ``w_hi = fp16(w)``, ``w_lo = fp16(w − w_hi)`` (11-bit
    significands, as TF32's; no scaling: the spike's values sit in float16's range)."""
    w_hi = w.to(tl.float16)
    return w_hi, (w - w_hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _dot3_acc16(x, w_hi, w_lo, acc):
    """``acc + x @ w`` with float16 halves (``w_hi``, ``w_lo`` from :func:`_split16`):
    x_lo·w_hi, x_hi·w_lo, x_hi·w_hi, float32 accumulation; float16 products are exact in
    float32 and the tensor cores take K = 16 per instruction, twice TF32's."""
    x_hi, x_lo = _split16(x)
    acc = tl.dot(x_lo, w_hi, acc)
    acc = tl.dot(x_hi, w_lo, acc)
    return tl.dot(x_hi, w_hi, acc)


@triton.jit
def _mma_to_operand(h, HP: tl.constexpr):
    """Columns ``c = 8j + 2q + r → 8j + 4r + q`` (small_fc_lopt's relabeling)."""
    h = tl.reshape(h, [h.shape[0], HP // 8, 4, 2])
    return tl.reshape(tl.permute(h, (0, 1, 3, 2)), [h.shape[0], HP])


def coefs(c):
    """The feature coefficients ``(ca, cb, cc)`` of column ``c`` (exact binary fractions,
    none zero; compile-time constants in both kernels)."""
    return (c + 1) * 0.0625, ((c % 5) - 2.5) * 0.25, ((c % 3) + 1) * 0.125


@triton.jit
def _feat(g, p, gr, cf_ptr, c: tl.constexpr, K1: tl.constexpr):
    """Feature column ``c`` [BLOCK]: ``g·ca[c] + p·cb[c] + gr·cc[c]`` (:func:`coefs`)."""
    return tl.fma(gr, ((c % 3) + 1) * 0.125,
                  tl.fma(p, ((c % 5) - 2.5) * 0.25, g * ((c + 1) * 0.0625)))


@triton.jit
def _features16(g, p, gr, cf_ptr, K1: tl.constexpr):
    """``x`` [BLOCK, 16]: 16 per-row vectors joined into a tile, column c = feature c (as the
    product kernel's ``_cat16``: ``tl.join`` adds its axis last, so pairs 8, 4, 2, 1 apart),
    which Triton transposes to the MMA operand layout through shared memory."""
    q0 = tl.join(tl.join(_feat(g, p, gr, cf_ptr, 0, K1), _feat(g, p, gr, cf_ptr, 8, K1)),
                 tl.join(_feat(g, p, gr, cf_ptr, 4, K1), _feat(g, p, gr, cf_ptr, 12, K1)))
    q1 = tl.join(tl.join(_feat(g, p, gr, cf_ptr, 2, K1), _feat(g, p, gr, cf_ptr, 10, K1)),
                 tl.join(_feat(g, p, gr, cf_ptr, 6, K1), _feat(g, p, gr, cf_ptr, 14, K1)))
    q2 = tl.join(tl.join(_feat(g, p, gr, cf_ptr, 1, K1), _feat(g, p, gr, cf_ptr, 9, K1)),
                 tl.join(_feat(g, p, gr, cf_ptr, 5, K1), _feat(g, p, gr, cf_ptr, 13, K1)))
    q3 = tl.join(tl.join(_feat(g, p, gr, cf_ptr, 3, K1), _feat(g, p, gr, cf_ptr, 11, K1)),
                 tl.join(_feat(g, p, gr, cf_ptr, 7, K1), _feat(g, p, gr, cf_ptr, 15, K1)))
    return tl.reshape(tl.join(tl.join(q0, q1), tl.join(q2, q3)), [g.shape[0], 16])


@triton.jit
def mlp_a_kernel(g_ptr, p_ptr, t_ptr, cf_ptr, w1_ptr, w2_ptr, vec_ptr, d_ptr, m_ptr, N,
                 BLOCK: tl.constexpr, K1: tl.constexpr, HP: tl.constexpr,
                 PRODUCTS: tl.constexpr = 3, F16: tl.constexpr = False):
    """Kernel A. ``cf`` [3, K1] (ca, cb, cc); ``w1`` [2, K1, HP] (hi, lo); ``w2`` [2, HP, HP]
    (hi, lo; rows permuted); ``vec`` [6, HP]: b0, wt, b1, wo0, wo1, (bo0, bo1, 0...).
    ``F16``: the three products with float16 halves instead of TF32 (``w`` = hi + lo split
    again in the kernel; ``w2`` not permuted: a float16 operand's register layout is the
    accumulator's, so the hidden layer needs no relabeling)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_sub = tl.cdiv(N, BLOCK)
    r = tl.arange(0, BLOCK)
    kc = tl.arange(0, K1)
    hc = tl.arange(0, HP)
    w1h = tl.load(w1_ptr + kc[:, None] * HP + hc[None, :])
    w1l = tl.load(w1_ptr + K1 * HP + kc[:, None] * HP + hc[None, :])
    w2h = tl.load(w2_ptr + hc[:, None] * HP + hc[None, :])
    w2l = tl.load(w2_ptr + HP * HP + hc[:, None] * HP + hc[None, :])
    b0 = tl.load(vec_ptr + hc)
    wt = tl.load(vec_ptr + HP + hc)
    b1 = tl.load(vec_ptr + 2 * HP + hc)
    wo0 = tl.load(vec_ptr + 3 * HP + hc)
    wo1 = tl.load(vec_ptr + 4 * HP + hc)
    bo0 = tl.load(vec_ptr + 5 * HP)
    bo1 = tl.load(vec_ptr + 5 * HP + 1)
    if F16:
        w1h, w1l = _split16(w1h + w1l)
        w2h, w2l = _split16(w2h + w2l)
    # the first sub-tile's inputs
    off_n = pid.to(tl.int64) * BLOCK + r
    msk_n = off_n < N
    g_n = tl.load(g_ptr + off_n, mask=msk_n, other=0.0)
    p_n = tl.load(p_ptr + off_n, mask=msk_n, other=0.0)
    t_n = tl.load(t_ptr + off_n, mask=msk_n, other=0.0)
    for _ in range(pid, n_sub, nprog):
        off = off_n
        msk = msk_n
        g, p, t = g_n, p_n, t_n
        off_n = off + nprog * BLOCK
        msk_n = off_n < N
        g_n = tl.load(g_ptr + off_n, mask=msk_n, other=0.0)
        p_n = tl.load(p_ptr + off_n, mask=msk_n, other=0.0)
        t_n = tl.load(t_ptr + off_n, mask=msk_n, other=0.0)
        gr = g * tl.math.rsqrt(p * p + 1e-3)
        x = _features16(g, p, gr, cf_ptr, K1)
        ab = tl.fma(tl.broadcast_to(t[:, None], [BLOCK, HP]),
                    tl.broadcast_to(wt[None, :], [BLOCK, HP]),
                    tl.broadcast_to(b0[None, :], [BLOCK, HP]))
        if F16:
            h = tl.maximum(_dot3_acc16(x, w1h, w1l, ab), 0.0)
            h = tl.maximum(_dot3_acc16(h, w2h, w2l, tl.zeros_like(h)) + b1[None, :], 0.0)
        else:
            h = tl.maximum(_dot3_acc(x, w1h, w1l, ab, PRODUCTS), 0.0)
            h = _mma_to_operand(h, HP)
            h = tl.maximum(_dot3_acc(h, w2h, w2l, tl.zeros_like(h), PRODUCTS) + b1[None, :],
                           0.0)
        d = tl.sum(h * wo0[None, :], axis=1) + bo0
        m = tl.sum(h * wo1[None, :], axis=1) + bo1
        tl.store(d_ptr + off, d, mask=msk)
        tl.store(m_ptr + off, m, mask=msk)


# -- Gluon (kernel B) ------------------------------------------------------------------------


@gluon.jit
def _g_round_tf32(x):
    return ((x.to(gl.int32, bitcast=True) + 4096) & -8192).to(gl.float32, bitcast=True)


@gluon.jit
def _g_relabel(h, HP: gl.constexpr, A_LAYOUT: gl.constexpr):
    """The MMA accumulator ``h`` [BLOCK, HP] with columns relabeled (as
    :func:`_mma_to_operand`), as the next wgmma's register A operand (no data movement:
    ``assert_trivial``)."""
    h = gl.reshape(h, [h.shape[0], HP // 8, 4, 2])
    h = gl.reshape(gl.permute(h, (0, 1, 3, 2)), [h.shape[0], HP])
    return gl.convert_layout(h, A_LAYOUT, assert_trivial=True)


@gluon.jit
def _g_load(g_ptr, p_ptr, t_ptr, base, rx, rm, N):
    """A sub-tile's inputs: ``g``, ``p`` (one row per thread), ``t`` (MMA row layout)."""
    g = gl.load(g_ptr + base + rx, mask=base + rx < N, other=0.0)
    p = gl.load(p_ptr + base + rx, mask=base + rx < N, other=0.0)
    t = gl.load(t_ptr + base + rm, mask=base + rm < N, other=0.0)
    return g, p, t


@gluon.jit
def _g_features(g, p, ca, cb, cc):
    """``x`` [BLOCK, K1] (one row per thread)."""
    gr = g * gl.rsqrt(p * p + 1e-3)
    gb, cab = gl.broadcast(g[:, None], ca[None, :])
    pb, cbb = gl.broadcast(p[:, None], cb[None, :])
    grb, ccb = gl.broadcast(gr[:, None], cc[None, :])
    return gl.fma(grb, ccb, gl.fma(pb, cbb, gb * cab))


@gluon.jit
def _g_layer1(x, t, b0, wt, w1h_s, w1l_s, xs_hi, xs_lo, A1_SMEM: gl.constexpr,
              A_LAYOUT: gl.constexpr, PRODUCTS: gl.constexpr):
    """Issues layer 1's three products (async), accumulator started at ``b0 + t·wt``.
    Returns ``(acc token, a_hi, a_lo)`` (the A operands to keep alive until the wait)."""
    if PRODUCTS == 1:  # one TF32 product of x itself (hi and lo both stand for x)
        x_hi = x
        x_lo = x
    else:
        x_hi = _g_round_tf32(x)
        x_lo = x - x_hi
    if A1_SMEM:
        xs_hi.store(x_hi)
        xs_lo.store(x_lo)
        fence_async_shared()
        _barrier()
        a_hi = xs_hi
        a_lo = xs_lo
    else:
        a_hi = gl.convert_layout(x_hi, A_LAYOUT)
        a_lo = gl.convert_layout(x_lo, A_LAYOUT)
    tb, wtb = gl.broadcast(t[:, None], wt[None, :])
    tb, b0b = gl.broadcast(tb, b0[None, :])
    ab = gl.fma(tb, wtb, b0b)
    return _g_products(a_hi, a_lo, w1h_s, w1l_s, ab, PRODUCTS), a_hi, a_lo


@gluon.jit
def _g_layer2(acc1, w2h_s, w2l_s, hs_hi, hs_lo, HP: gl.constexpr, A_LAYOUT: gl.constexpr,
              MMA: gl.constexpr, A2_SMEM: gl.constexpr, HBUF: gl.constexpr,
              PRODUCTS: gl.constexpr):
    """``relu`` of layer 1's (finished) accumulator, split; issues layer 2's three products
    (async, from zero). Returns ``(acc token, a_hi, a_lo)``. The A operand: the
    accumulator relabeled in registers (W2's rows stored permuted), or with ``A2_SMEM``
    written to shared memory ``hs_hi``/``hs_lo`` (W2 unpermuted; ``HBUF = 1``: a barrier
    first, so that every warp is past the wait of the products that read it last)."""
    if A2_SMEM:
        h = gl.maximum(acc1, 0.0)
        if PRODUCTS == 1:
            h_hi = h
            h_lo = h
        else:
            h_hi = _g_round_tf32(h)
            h_lo = h - h_hi
        if HBUF == 1:
            _barrier()
        hs_hi.store(h_hi)
        hs_lo.store(h_lo)
        fence_async_shared()
        _barrier()
        a_hi = hs_hi
        a_lo = hs_lo
    else:
        h = _g_relabel(gl.maximum(acc1, 0.0), HP, A_LAYOUT)
        if PRODUCTS == 1:
            a_hi = h
            a_lo = h
        else:
            a_hi = _g_round_tf32(h)
            a_lo = h - a_hi
    z = gl.zeros([acc1.shape[0], HP], gl.float32, MMA)
    return _g_products(a_hi, a_lo, w2h_s, w2l_s, z, PRODUCTS), a_hi, a_lo


@gluon.jit
def _g_products(a_hi, a_lo, wh_s, wl_s, acc, PRODUCTS: gl.constexpr):
    """``acc + a·w`` issued asynchronously on one accumulator: ``a_lo·w_hi, a_hi·w_lo,
    a_hi·w_hi`` (exact mode), or ``a_hi·w_hi`` alone (``PRODUCTS = 1``). Returns the
    accumulator's token (wait with ``warpgroup_mma_wait``)."""
    if PRODUCTS == 1:
        return warpgroup_mma(a_hi, wh_s, acc, is_async=True)
    acc = warpgroup_mma(a_lo, wh_s, acc, is_async=True)
    acc = warpgroup_mma(a_hi, wl_s, acc, is_async=True)
    return warpgroup_mma(a_hi, wh_s, acc, is_async=True)


@gluon.jit
def _g_out(acc2, b1, wo0, wo1, bo0, bo1, d_ptr, m_ptr, off, msk):
    h = gl.maximum(acc2 + b1[None, :], 0.0)
    d = gl.sum(h * wo0[None, :], axis=1) + bo0
    m = gl.sum(h * wo1[None, :], axis=1) + bo1
    gl.store(d_ptr + off, d, mask=msk)
    gl.store(m_ptr + off, m, mask=msk)


@gluon.jit
def mlp_b_kernel(g_ptr, p_ptr, t_ptr, cf_ptr, w1_ptr, w2_ptr, vec_ptr, d_ptr, m_ptr, N,
                 BLOCK: gl.constexpr, K1: gl.constexpr, HP: gl.constexpr,
                 PIPE: gl.constexpr, A1_SMEM: gl.constexpr, A2_SMEM: gl.constexpr = False,
                 HBUF: gl.constexpr = 2, PRODUCTS: gl.constexpr = 3):
    """Kernel B (same arguments and math as :func:`mlp_a_kernel`), 4 warps.

    ``PIPE=False``: one sub-tile at a time, each layer's three products issued back to back
    and waited once (2 waits per sub-tile instead of 6). ``PIPE=True``: two sub-tiles in
    flight: per iteration, wait layer 1 of sub-tile i, issue its layer 2; compute the
    features of sub-tile i+1 and issue its layer 1; wait layer 2 of sub-tile i (layer 1 of
    i+1 stays outstanding) and run its output layer and stores.

    ``A1_SMEM``: layer 1's A operand (x_hi, x_lo) written to shared memory (NVMMA layout,
    double-buffered) and read from there by wgmma, instead of converted to registers.
    ``A2_SMEM``: layer 2's A operand likewise (``HBUF`` buffers; ``w2`` unpermuted)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HP, 8])
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=1)
    XL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, K1], threads_per_warp=[32, 1],
                                        warps_per_cta=[4, 1], order=[1, 0])
    WL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8],
                                        warps_per_cta=[4, 1], order=[1, 0])
    XROW: gl.constexpr = gl.SliceLayout(1, XL)
    XCOL: gl.constexpr = gl.SliceLayout(0, XL)
    MROW: gl.constexpr = gl.SliceLayout(1, MMA)
    MCOL: gl.constexpr = gl.SliceLayout(0, MMA)
    # wgmma's B operand for 32-bit types: K-major ("transposed" NVMMA layout)
    W1_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32,
                                               rank=2, transposed=True)
    W2_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32,
                                               rank=2, transposed=True)
    X_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32,
                                              rank=2, transposed=False)
    H_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32,
                                              rank=2, transposed=False)
    XBUF: gl.constexpr = (1 if A2_SMEM else 2) if A1_SMEM else 1
    HB: gl.constexpr = HBUF if A2_SMEM else 1

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_sub = gl.cdiv(N, BLOCK)
    # :func:`coefs` as [K1] vectors of constants (each thread holds all K1 columns)
    kc = gl.arange(0, K1, layout=XCOL)
    ca = (kc + 1).to(gl.float32) * 0.0625
    cb = ((kc % 5).to(gl.float32) - 2.5) * 0.25
    cc = ((kc % 3) + 1).to(gl.float32) * 0.125
    wk1 = gl.arange(0, K1, layout=gl.SliceLayout(1, WL))
    wk2 = gl.arange(0, HP, layout=gl.SliceLayout(1, WL))
    wn = gl.arange(0, HP, layout=gl.SliceLayout(0, WL))
    w1_ofs = wk1[:, None] * HP + wn[None, :]
    w2_ofs = wk2[:, None] * HP + wn[None, :]
    w1h_s = gl.allocate_shared_memory(gl.float32, [K1, HP], W1_SL, gl.load(w1_ptr + w1_ofs))
    w1l_s = gl.allocate_shared_memory(gl.float32, [K1, HP], W1_SL,
                                      gl.load(w1_ptr + K1 * HP + w1_ofs))
    w2h_s = gl.allocate_shared_memory(gl.float32, [HP, HP], W2_SL, gl.load(w2_ptr + w2_ofs))
    w2l_s = gl.allocate_shared_memory(gl.float32, [HP, HP], W2_SL,
                                      gl.load(w2_ptr + HP * HP + w2_ofs))
    xs_hi = gl.allocate_shared_memory(gl.float32, [XBUF, BLOCK, K1], X_SL)
    xs_lo = gl.allocate_shared_memory(gl.float32, [XBUF, BLOCK, K1], X_SL)
    hs_hi = gl.allocate_shared_memory(gl.float32, [HB, BLOCK, HP], H_SL)
    hs_lo = gl.allocate_shared_memory(gl.float32, [HB, BLOCK, HP], H_SL)
    fence_async_shared()
    _barrier()
    hc = gl.arange(0, HP, layout=MCOL)
    b0 = gl.load(vec_ptr + hc)
    wt = gl.load(vec_ptr + HP + hc)
    b1 = gl.load(vec_ptr + 2 * HP + hc)
    wo0 = gl.load(vec_ptr + 3 * HP + hc)
    wo1 = gl.load(vec_ptr + 4 * HP + hc)
    bo0 = gl.load(vec_ptr + 5 * HP)
    bo1 = gl.load(vec_ptr + 5 * HP + 1)
    rx = gl.arange(0, BLOCK, layout=XROW)
    rm = gl.arange(0, BLOCK, layout=MROW)

    if PIPE:
        # prologue: layer 1 of this program's first sub-tile; the second one's inputs
        base = pid.to(gl.int64) * BLOCK
        g, p, t = _g_load(g_ptr, p_ptr, t_ptr, base, rx, rm, N)
        g_n, p_n, t_n = _g_load(g_ptr, p_ptr, t_ptr, base + nprog * BLOCK, rx, rm, N)
        acc1, a_hi, a_lo = _g_layer1(_g_features(g, p, ca, cb, cc), t, b0, wt, w1h_s, w1l_s,
                                     xs_hi.index(0), xs_lo.index(0), A1_SMEM, A_LAYOUT,
                                     PRODUCTS)
        k = 0
        for s in range(pid, n_sub, nprog):
            base = s.to(gl.int64) * BLOCK
            acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, a_hi, a_lo))[0]
            acc2, h_hi, h_lo = _g_layer2(acc1, w2h_s, w2l_s, hs_hi.index(k % HB),
                                         hs_lo.index(k % HB), HP, A_LAYOUT, MMA, A2_SMEM, HB,
                                         PRODUCTS)
            # sub-tile i+1 (past the end: masked, computed, not stored); i+2's loads
            g, p, t = g_n, p_n, t_n
            g_n, p_n, t_n = _g_load(g_ptr, p_ptr, t_ptr, base + 2 * nprog * BLOCK, rx, rm, N)
            k = k + 1
            acc1, a_hi, a_lo = _g_layer1(_g_features(g, p, ca, cb, cc), t, b0, wt, w1h_s,
                                         w1l_s, xs_hi.index(k % XBUF), xs_lo.index(k % XBUF),
                                         A1_SMEM, A_LAYOUT, PRODUCTS)
            acc2 = warpgroup_mma_wait(num_outstanding=PRODUCTS, deps=(acc2, h_hi, h_lo))[0]
            _g_out(acc2, b1, wo0, wo1, bo0, bo1, d_ptr, m_ptr, base + rm, base + rm < N)
        warpgroup_mma_wait(num_outstanding=0, deps=(acc1, a_hi, a_lo))
    else:
        g_n, p_n, t_n = _g_load(g_ptr, p_ptr, t_ptr, pid.to(gl.int64) * BLOCK, rx, rm, N)
        k = 0
        for s in range(pid, n_sub, nprog):
            base = s.to(gl.int64) * BLOCK
            g, p, t = g_n, p_n, t_n
            g_n, p_n, t_n = _g_load(g_ptr, p_ptr, t_ptr, base + nprog * BLOCK, rx, rm, N)
            acc1, a_hi, a_lo = _g_layer1(_g_features(g, p, ca, cb, cc), t, b0, wt, w1h_s,
                                         w1l_s, xs_hi.index(k % XBUF), xs_lo.index(k % XBUF),
                                         A1_SMEM, A_LAYOUT, PRODUCTS)
            k = k + 1
            acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, a_hi, a_lo))[0]
            acc2, h_hi, h_lo = _g_layer2(acc1, w2h_s, w2l_s, hs_hi.index(k % HB),
                                         hs_lo.index(k % HB), HP, A_LAYOUT, MMA, A2_SMEM, HB,
                                         PRODUCTS)
            acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc2, h_hi, h_lo))[0]
            _g_out(acc2, b1, wo0, wo1, bo0, bo1, d_ptr, m_ptr, base + rm, base + rm < N)


# -- host ------------------------------------------------------------------------------------

#: kernel variants: name → (kernel, constexprs and launch options). B variants' names: 0/1 =
#: PIPE; "s" = layer 1's A operand from shared memory; "h<n>" = layer 2's A operand from
#: shared memory with n buffers (else relabeled registers); "_r<n>": register cap n; "_f":
#: fast mode (one TF32 product per layer instead of three); "A_h": kernel A with float16
#: halves instead of TF32 ones (eighth session, for the products' cost)
VARIANTS = {
    "A": ("A", {}),
    "B0": ("B", dict(PIPE=False, A1_SMEM=False)),
    "B0s": ("B", dict(PIPE=False, A1_SMEM=True)),
    "B0sh1": ("B", dict(PIPE=False, A1_SMEM=True, A2_SMEM=True, HBUF=1)),
    "B1": ("B", dict(PIPE=True, A1_SMEM=False)),
    "B1s": ("B", dict(PIPE=True, A1_SMEM=True)),
    "B1sh1": ("B", dict(PIPE=True, A1_SMEM=True, A2_SMEM=True, HBUF=1)),
    "B1sh2": ("B", dict(PIPE=True, A1_SMEM=True, A2_SMEM=True, HBUF=2)),
    "B1s_r168": ("B", dict(PIPE=True, A1_SMEM=True, maxnreg=168)),
    "A_f": ("A", dict(PRODUCTS=1)),
    "A_h": ("A", dict(F16=True)),
    "B0_f": ("B", dict(PIPE=False, A1_SMEM=False, PRODUCTS=1)),
    "B0s_f": ("B", dict(PIPE=False, A1_SMEM=True, PRODUCTS=1)),
    "B1s_f": ("B", dict(PIPE=True, A1_SMEM=True, PRODUCTS=1)),
}


def round_tf32_host(w: torch.Tensor) -> torch.Tensor:
    """Nearest TF32 number (ties away), as the kernels' ``_round_tf32``."""
    return ((w.contiguous().view(torch.int32) + 4096) & -8192).view(torch.float32)


def split(w: torch.Tensor) -> torch.Tensor:
    """``[w_hi, w_lo]`` stacked: ``w_hi = round_tf32(w)``, ``w_lo = round_tf32(w − w_hi)``."""
    hi = round_tf32_host(w)
    return torch.stack([hi, round_tf32_host(w - hi)]).contiguous()


def operand_perm(hp: int) -> list[int]:
    """Row k of the relabeled hidden layer holds row perm[k] (small_fc_lopt._operand_perm)."""
    return [8 * (k // 8) + 2 * (k % 4) + (k % 8) // 4 for k in range(hp)]


def make_params(device, seed=0):
    """Random MLP weights (float32): W1 [16, 32], b0, wt, b1 [32], W2 [32, 32], wo [32, 2],
    bo [2]."""
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float32)

    prm = dict(W1=r(K1, HP) * 0.25, b0=r(HP) * 0.1, wt=r(HP) * 0.1, W2=r(HP, HP) * 0.25,
               b1=r(HP) * 0.1, wo=r(HP, 2) * 0.25, bo=r(2) * 0.1)
    return {k: v.to(device) for k, v in prm.items()}


def kernel_args(prm, relabel: bool):
    """The kernels' weight arguments ``(cf, w1, w2, vec)``."""
    dev = prm["W1"].device
    w2 = prm["W2"][operand_perm(HP)] if relabel else prm["W2"]
    vec = torch.zeros(6, HP, dtype=torch.float32, device=dev)
    vec[0], vec[1], vec[2] = prm["b0"], prm["wt"], prm["b1"]
    vec[3], vec[4] = prm["wo"][:, 0], prm["wo"][:, 1]
    vec[5, :2] = prm["bo"]
    cf = torch.zeros(3, K1, dtype=torch.float32, device=dev)  # unused (constants in-kernel)
    return cf, split(prm["W1"]), split(w2), vec


def reference(g, p, t, prm, lo, hi):
    """float64 ``(d, m)`` of rows lo:hi (features from the float32 inputs)."""
    def d64(x):
        return x.double()

    g, p, t = d64(g[lo:hi]), d64(p[lo:hi]), d64(t[lo:hi])
    gr = g * torch.rsqrt(p * p + 1e-3)
    c = torch.arange(K1, device=g.device, dtype=torch.float64)
    ca, cb, cc = (c + 1) * 0.0625, ((c % 5) - 2.5) * 0.25, ((c % 3) + 1) * 0.125
    x = g[:, None] * ca + p[:, None] * cb + gr[:, None] * cc
    h = torch.relu(x @ d64(prm["W1"]) + d64(prm["b0"]) + t[:, None] * d64(prm["wt"]))
    h = torch.relu(h @ d64(prm["W2"]) + d64(prm["b1"]))
    o = h @ d64(prm["wo"]) + d64(prm["bo"])
    return o[:, 0], o[:, 1]


def launch(name, grid, g, p, t, args, d, m):
    which, cons = VARIANTS[name]
    cf, w1, w2, vec = args
    n = g.numel()
    if which == "A":
        return mlp_a_kernel[(grid,)](g, p, t, cf, w1, w2, vec, d, m, n, BLOCK=BLOCK, K1=K1,
                                     HP=HP, num_warps=4, num_stages=1, **cons)
    return mlp_b_kernel[(grid,)](g, p, t, cf, w1, w2, vec, d, m, n, BLOCK=BLOCK, K1=K1, HP=HP,
                                 num_warps=4, **cons)


def occupancy(k) -> int:
    """Programs of 4 warps per SM the registers and shared memory allow (H100)."""
    regs = -(-max(k.n_regs, 1) // 8) * 8
    by_regs = 65536 // (regs * 128)
    by_smem = (228 * 1024) // (k.metadata.shared + 1024)
    return max(1, min(by_regs, by_smem, 16))


def errors(out, ref, step=1 << 23):
    """max |out − ref| / max |ref| (float64, in chunks of ``step`` rows)."""
    n = out.numel()
    err = max((out[i:i + step].double() - ref[i:i + step]).abs().max().item()
              for i in range(0, n, step))
    return err / max(ref[i:i + step].abs().max().item() for i in range(0, n, step))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[86_567_656, 354_823_168])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--per-sm", type=int, nargs="+", default=[1, 2, 3, 0],
                    help="persistent programs per SM to time (0: occupancy limit)")
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="timing rounds (each times every variant once, in turn)")
    ap.add_argument("--ncu", action="store_true",
                    help="no checks or timings: each variant launched twice (for ncu)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    n_sm = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"device {torch.cuda.get_device_name(dev)} ({n_sm} SMs), torch {torch.__version__}, "
          f"triton {triton.__version__}, python {sys.version.split()[0]}, "
          f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
          flush=True)
    prm = make_params(dev)
    args_rel = kernel_args(prm, relabel=True)
    args_plain = kernel_args(prm, relabel=False)

    def wargs(name):
        cons = VARIANTS[name][1]
        return args_plain if cons.get("A2_SMEM") or cons.get("F16") else args_rel

    for n in a.n:
        gen = torch.Generator(device=dev).manual_seed(n)
        g = torch.randn(n, device=dev, generator=gen)
        p = torch.randn(n, device=dev, generator=gen)
        t = torch.randn(n, device=dev, generator=gen)
        d = torch.empty(n, device=dev)
        m = torch.empty(n, device=dev)
        print(f"\n== N = {n:,} ({-(-n // BLOCK):,} sub-tiles of {BLOCK})", flush=True)
        if a.ncu:
            for name in a.variants:
                for ps in a.per_sm:
                    for _ in range(2):
                        launch(name, ps * n_sm, g, p, t, wargs(name), d, m)
                    torch.cuda.synchronize()
                    print(f"{name} {ps}/SM launched", flush=True)
            continue
        ref_d = torch.empty(n, device=dev, dtype=torch.float64)
        ref_m = torch.empty(n, device=dev, dtype=torch.float64)
        step = 1 << 23
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            ref_d[lo:hi], ref_m[lo:hi] = reference(g, p, t, prm, lo, hi)
        outs = {}  # A's and A_f's outputs, for the bitwise comparison
        occ = {}
        for name in a.variants:
            try:
                d.fill_(float("nan"))
                m.fill_(float("nan"))
                k = launch(name, 4 * n_sm, g, p, t, wargs(name), d, m)
                torch.cuda.synchronize()
            except Exception as e:  # a variant that does not build or run: say so, go on
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:800]}", flush=True)
                continue
            occ[name] = occupancy(k)
            ed = errors(d, ref_d)
            em = errors(m, ref_m)
            nan = int(torch.isnan(d).sum() + torch.isnan(m).sum())
            base = "A_f" if VARIANTS[name][1].get("PRODUCTS") == 1 else "A"
            cmp = ""
            if name == base:
                outs[base] = (d.clone(), m.clone())
            elif base in outs:
                d_a, m_a = outs[base]
                nd = int((d.view(torch.int32) != d_a.view(torch.int32)).sum()
                         + (m.view(torch.int32) != m_a.view(torch.int32)).sum())
                dd = max(errors(d, d_a), errors(m, m_a))
                cmp = (f" | vs {base}: {nd} of {2 * n} outputs differ in bits, "
                       f"max|B-A|/max|A| {dd:.3g}")
            print(f"{name}: regs {k.n_regs} spills {k.n_spills} shared {k.metadata.shared} B "
                  f"occupancy {occ[name]}/SM | err/max|ref| d {ed:.3g} m {em:.3g} nan {nan}"
                  + cmp, flush=True)
        del outs
        times = {}
        for _ in range(a.rounds):
            for name in occ:
                for ps in dict.fromkeys(occ[name] if x == 0 else x for x in a.per_sm):
                    if ps > occ[name]:
                        continue
                    def fn(name=name, ps=ps, g=g, p=p, t=t, d=d, m=m):
                        launch(name, ps * n_sm, g, p, t, wargs(name), d, m)

                    ms = triton.testing.do_bench(fn, rep=a.rep, return_mode="median")
                    times.setdefault((name, ps), []).append(ms)
        for name in occ:
            row = [f"{ps}/SM " + " ".join(f"{x:.3f}" for x in v) + " ms"
                   for (nm, ps), v in times.items() if nm == name]
            print(f"{name} (median of each do_bench; rounds): " + ", ".join(row), flush=True)
        del g, p, t, d, m, ref_d, ref_m
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
