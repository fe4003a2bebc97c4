"""Fused Triton step of VeLO (learned_optimization's ``HyperV2`` in VeLO's configuration).

All of a model's tensors in six launches plus a handful of batched torch ops:

1. ``stats1`` (every tensor): partial sums of the clipped g² over each tile's two axes
   (factored tensors) and Σ m_k, Σ rms of the accumulators before the update (the LSTM's
   inputs), summed per tensor in a fixed order;
2. ``fac_finalize`` + ``rcm``: the new ``v_row``/``v_col`` and their row-column means;
3. :func:`velo_stats_kernel`: Σ feature² of the 30 MLP inputs and the second pass of the
   LSTM inputs' variances (Σ (m_k − mean m_k)², Σ (rms − mean m_k)², two-pass as the spec
   computes them), float32 per thread, per tile and per tensor in float64, in a fixed order
   (as are pass 1's Σ m_k, Σ rms: float32 statistics moved the step by 3e-6);
4. torch, batched over tensors: the LSTM inputs, one LSTM step for all tensors
   (:func:`xopt.specs.velo.lstm_step`, as the plain path), the hypernetwork's per-tensor
   MLP weights ``100·mean_k(controls_k·bank_k)`` for every tensor in one product, gathered
   into one padded table;
5. :func:`velo_fused_kernel`: accumulators, features, normalization, the tensor's own MLP,
   the step and the parameter update.

Precision: the per-element MLP (30 → 4 → 4 → 3 at VeLO's size) is float32 FMAs, the first
layer one feature at a time (:func:`xopt.kernels.lopt_common.rank1`, no feature tile):
about 150 FMAs per element, cheaper than any tensor-core tile of that width, so ``"exact"``
and ``"fast"`` run the same kernel (``"fast"`` is accepted for symmetry with
small_fc_lopt). MLPs up to 4 wide are supported (:func:`check_supported`).

:func:`reference_step` is the pure-PyTorch reference (the spec's functions, as
:class:`xopt.torch.VeLO`'s plain path calls them).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
import triton
import triton.language as tl

from xopt.kernels import lopt_common as C
from xopt.kernels import lopt_layout as L
from xopt.specs import velo as _spec

__all__ = ["VeLOTriton", "reference_step"]

#: sub-tile rows (SA × TB elements per sub-tile) of the statistics and the fused pass,
#: warps and software-pipelining stages of the per-element kernels (XOPT_LOPT_SA_STATS /
#: _SA_FMA / _WARPS / _STAGES override them, for tuning)
SA_STATS = int(os.environ.get("XOPT_LOPT_SA_STATS", "2"))
SA = int(os.environ.get("XOPT_LOPT_SA_FMA", "4"))
STAGES = int(os.environ.get("XOPT_LOPT_STAGES", "2"))
WARPS = int(os.environ.get("XOPT_LOPT_WARPS", "4"))
NPTR = 8  # pointer table columns: p, g, m, rms, v_row, v_col, v_diag, out
NFEAT = 30


@triton.jit
def _velo_body(meta, prog, ptrs, rcm, decays, mu, norm, scal, w0, b0, wh, bh, wl, bl, part,
               exp_mult, step_mult, FUSED: tl.constexpr, NHID: tl.constexpr,
               NPTR: tl.constexpr, NF: tl.constexpr, TA: tl.constexpr, TB: tl.constexpr,
               SA: tl.constexpr):
    """One tile [TA, TB] of one tensor, in sub-tiles of SA × TB elements.

    ``FUSED=False`` (statistics): Σ over the tile of the 30 features² (a [BLOCK, 32] tile
    accumulated, reduced once) → ``part[pid, 0:32]``, and of (m_k − mean m_k)² and
    (rms − mean m_k)² (the LSTM inputs' variances, two-pass) → ``part[pid, 32:38]``.
    ``FUSED=True``: the tensor's 4-wide MLP (weights ``w0`` [n, 32, 4], ``b0`` [n, 4], ``wh``
    [n, NHID, 4, 4], ``bh`` [n, NHID, 4], ``wl`` [n, 4, 16], ``bl`` [n, 16]), its first layer
    one feature at a time (:func:`xopt.kernels.lopt_common.rank1`), and the update."""
    HP: tl.constexpr = 4
    BLOCK: tl.constexpr = SA * TB
    pid = tl.program_id(0)
    t, row, fact, ia_n, b, ta, tb, rc0, rc1, rc2 = C.program_tile(meta, prog, rcm, NF)
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
    else:
        acc = tl.zeros([BLOCK, 32], tl.float64)
        acc8 = tl.zeros([BLOCK, 8], tl.float64)
        mu0 = tl.load(mu + t * 4)
        mu1 = tl.load(mu + t * 4 + 1)
        mu2 = tl.load(mu + t * 4 + 2)
    sa_i = tl.arange(0, SA)
    ib = tb * TB + tl.arange(0, TB)
    a0 = ta * TA
    n_sub = tl.minimum(TA, ia_n - a0)
    for s in range(0, n_sub, SA):
        ia = a0 + s + sa_i
        off, mask, ridx, cidx = C.load_tile(row, t, b, ia, ib, ptrs, NPTR, BLOCK)
        g = tl.load(gp + off, mask=mask, other=0.0)
        g = tl.minimum(tl.maximum(g, -1000.0), 1000.0)
        p = tl.load(pp + off, mask=mask, other=0.0)
        om0 = tl.load(mp + off * 3, mask=mask, other=0.0)
        om1 = tl.load(mp + off * 3 + 1, mask=mask, other=0.0)
        om2 = tl.load(mp + off * 3 + 2, mask=mask, other=0.0)
        orms = tl.load(rp + off, mask=mask, other=0.0)
        m0 = md0 * om0 + (1 - md0) * g
        m1 = md1 * om1 + (1 - md1) * g
        m2 = md2 * om2 + (1 - md2) * g
        rms = rd * orms + (1 - rd) * (g * g)
        R0, C0, FG0, FM0, V0, R1, C1, FG1, FM1, V1, R2, C2, FG2, FM2, V2, v3 = \
            C.accumulate3(fact, off, mask, ridx, cidx, g, m0, m1, m2, rp, vr, vc, vd, fd0, fd1,
                          fd2, rc0, rc1, rc2, 0.0)
        rr, rsr0, rsr1, rsr2, rsc0, rsc1, rsc2 = C.rsqrt_features(rms, R0, R1, R2, C0, C1, C2)
        gc = tl.minimum(tl.maximum(g, -0.1), 0.1)
        z = tl.zeros([BLOCK], tl.float32)
        if FUSED:
            # the tensor's 4-wide MLP, the first layer feature by feature (spec order)
            h0, h1, h2, h3 = C.rank1(z, z, z, z, g, 0, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, gc, 1, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, p, 2, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m0, 3, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m1, 4, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m2, 5, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rms, 6, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m0 * rr, 7, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m1 * rr, 8, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m2 * rr, 9, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rr, 10, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, g * FG0, 11, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, g * FG1, 12, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, g * FG2, 13, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, g * rr, 14, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, R0, 15, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, R1, 16, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, R2, 17, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, C0, 18, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, C1, 19, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, C2, 20, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rsr0, 21, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rsr1, 22, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rsr2, 23, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rsc0, 24, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rsc1, 25, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, rsc2, 26, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m0 * FM0, 27, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m1 * FM1, 28, invp, w0t)
            h0, h1, h2, h3 = C.rank1(h0, h1, h2, h3, m2 * FM2, 29, invp, w0t)
            direction, magnitude = C.mlp4_tail(h0, h1, h2, h3, b0t, wht, bht, wlt, blt, NHID)
            step = direction * (pscale * tl.exp(magnitude * exp_mult)) * step_mult
            step = lr_mult * step
            newp = p - (lr * step + lrwd * p)
            tl.store(outp + off, tl.where(write_step != 0, step, newp), mask=mask)
            tl.store(mp + off * 3, m0, mask=mask)
            tl.store(mp + off * 3 + 1, m1, mask=mask)
            tl.store(mp + off * 3 + 2, m2, mask=mask)
            tl.store(rp + off, rms, mask=mask)
            if fact == 0:
                tl.store(v3, V0, mask=mask)
                tl.store(v3 + 1, V1, mask=mask)
                tl.store(v3 + 2, V2, mask=mask)
        else:
            x = C.cat32(g, gc, p, m0, m1, m2, rms, m0 * rr, m1 * rr, m2 * rr, rr,
                        g * FG0, g * FG1, g * FG2, g * rr, R0, R1, R2, C0, C1, C2,
                        rsr0, rsr1, rsr2, rsc0, rsc1, rsc2, m0 * FM0, m1 * FM1, m2 * FM2,
                        z, z)
            x = tl.where(mask[:, None], tl.reshape(x, [BLOCK, 32]), 0.0)
            acc += x.to(tl.float64) * x.to(tl.float64)
            d0 = om0 - mu0
            d1 = om1 - mu1
            d2 = om2 - mu2
            e0 = orms - mu0
            e1 = orms - mu1
            e2 = orms - mu2
            y = tl.reshape(C.cat8(d0 * d0, d1 * d1, d2 * d2, e0 * e0, e1 * e1, e2 * e2, z, z),
                           [BLOCK, 8])
            acc8 += tl.where(mask[:, None], y, 0.0).to(tl.float64)
    if not FUSED:
        tl.store(part + pid.to(tl.int64) * 64 + cols, tl.sum(acc, axis=0))
        tl.store(part + pid.to(tl.int64) * 64 + 32 + c8, tl.sum(acc8, axis=0))
        # (columns 40-63 are not written and not read)


@triton.jit
def velo_stats_kernel(meta, prog, ptrs, rcm, decays, mu, norm, scal, w0, b0, wh, bh, wl, bl,
                      part, exp_mult, step_mult, NHID: tl.constexpr, NPTR: tl.constexpr,
                      NF: tl.constexpr, TA: tl.constexpr, TB: tl.constexpr, SA: tl.constexpr):
    """Launch 3 (statistics mode of :func:`_velo_body`)."""
    _velo_body(meta, prog, ptrs, rcm, decays, mu, norm, scal, w0, b0, wh, bh, wl, bl, part,
               exp_mult, step_mult, False, NHID, NPTR, NF, TA, TB, SA)


@triton.jit
def velo_fused_kernel(meta, prog, ptrs, rcm, decays, mu, norm, scal, w0, b0, wh, bh, wl, bl,
                      part, exp_mult, step_mult, NHID: tl.constexpr, NPTR: tl.constexpr,
                      NF: tl.constexpr, TA: tl.constexpr, TB: tl.constexpr, SA: tl.constexpr):
    """Launch 5 (fused mode of :func:`_velo_body`)."""
    _velo_body(meta, prog, ptrs, rcm, decays, mu, norm, scal, w0, b0, wh, bh, wl, bl, part,
               exp_mult, step_mult, True, NHID, NPTR, NF, TA, TB, SA)


check_supported = L.supported_velo


class VeLOTriton:
    """The Triton step of one :class:`xopt.torch.VeLO` (caches its layout)."""

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
        self._tables = L.TableCache()
        self._bank_cache: tuple | None = None
        self._decays: tuple | None = None  # (all 7 decays, the 3 Adafactor ones): constants

    def _bank(self, meta: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bank [P, T], gidx)``: the MLP banks side by side (each ``[P, ...]`` flattened,
        in :func:`xopt.specs.velo.mlp_bank_names` order) and the index of each entry of one
        tensor's kernel table (w0 [32, 4], b0 [4], wh [NHID, 4, 4], bh [NHID, 4], wl [4, 16],
        bl [16], zero-padded) in ``[mixed | 0]`` (T: the zero). Cached per meta tensors."""
        names = _spec.mlp_bank_names(self.hp)
        key = tuple((meta[k].data_ptr(), meta[k]._version) for k in names)
        if self._bank_cache is not None and self._bank_cache[0] == key:
            return self._bank_cache[1], self._bank_cache[2]
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
        bank = torch.cat(flat, 1).contiguous()
        gidx = torch.tensor(idx, dtype=torch.int64, device=bank.device)
        self._bank_cache = (key, bank, gidx)
        return bank, gidx

    def layout(self, shapes: Sequence[tuple[int, ...]], device: torch.device) -> L.Layout:
        lay = self._layout
        if lay is None or lay.shapes != tuple(shapes) or lay.meta.device != device:
            lay = self._layout = L.build_layout(shapes, device)
            ranks = [_spec.tensor_rank(s) for s in shapes]
            oh = torch.zeros((len(shapes), _spec.NUM_RANKS), dtype=torch.float32)
            for i, r in enumerate(ranks):
                if r < _spec.NUM_RANKS:
                    oh[i, r] = 1.0
            self._onehot = oh.to(device)
        return lay

    def step(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             states: Sequence[dict[str, torch.Tensor]], outs: Sequence[torch.Tensor],
             write_step: Sequence[bool], lrs: Sequence[float], lrwds: Sequence[float],
             meta: Mapping[str, torch.Tensor], hidden: torch.Tensor, cell: torch.Tensor,
             frac: torch.Tensor, lfeat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step after the loss buffer: updates ``states``' accumulators in place, writes
        each new parameter (or, where ``write_step``, its step) into ``outs`` and returns the
        LSTM's new ``(hidden, cell)`` ``[n_tensors, H]``. ``hidden``/``cell``: the stacked
        LSTM state; ``frac``: t / N (0-d); ``lfeat``: the 9 loss features."""
        hp = self.hp
        dev = params[0].device
        lay = self.layout([tuple(p.shape) for p in params], dev)
        like = meta["lstm/init_hidden"]
        if self._decays is None or self._decays[0].device != dev:
            md, rd, fd = (_spec._as_array(torch, d, like) for d in _spec.decay_arrays(hp))
            self._decays = (torch.cat([md, rd, fd]).contiguous(), fd)
        decays, fd = self._decays
        ptrs = self._tables.get("ptrs", [
            [p.data_ptr(), g.data_ptr(), s["m"].data_ptr(), s["rms"].data_ptr(),
             s["v_row"].data_ptr(), s["v_col"].data_ptr(), s["v_diag"].data_ptr(),
             o.data_ptr()] for p, g, s, o in zip(params, grads, states, outs, strict=True)],
            torch.int64, dev)
        host = self._tables.get("scal", [[lr, lrwd, float(ws)] for lr, lrwd, ws in
                                         zip(lrs, lrwds, write_step, strict=True)],
                                torch.float32, dev)
        nt = len(params)
        # every host-made input before the first launch (a blocking copy waits for the GPU)
        frac_emb = _spec.fraction_embedding(torch, frac, like).expand(nt, -1)
        lfeat = lfeat.to(dev).expand(nt, -1)
        # 1-2: Adafactor statistics, and the old accumulators' means
        rcm, sums4 = C.factored_pass(lay, ptrs, fd, clip_g=True, mom_sums=True, npt=NPTR)
        if rcm is None:
            rcm = torch.zeros((3,), dtype=torch.float32, device=dev)
        n = lay.numel[:, None]
        mu = (sums4 / n).contiguous()
        # 3: feature statistics and the variances' second pass
        nhid = int(hp.ff_hidden_layers) - 1
        common = dict(NHID=nhid, NPTR=NPTR, NF=L.NFIELDS, TA=L.TA, TB=L.TB,
                      num_warps=WARPS, num_stages=STAGES)
        part = torch.empty((lay.n_prog_all, 64), dtype=torch.float64, device=dev)
        velo_stats_kernel[(lay.n_prog_all,)](lay.meta, lay.prog_all, ptrs, rcm, decays, mu,
                                             part, part, part, part, part, part, part, part,
                                             part, float(hp.exp_mult), float(hp.step_mult),
                                             SA=SA_STATS, **common)
        st = C.seg_sum(part, lay).float()
        # 4: the LSTM inputs (xopt.specs.velo.lstm_features, batched), the LSTM, the MLPs
        psq = st[:, 2] / lay.numel
        nm = torch.rsqrt(psq.clamp_min(1e-9))
        mean_rms = nm * mu[:, 3]
        var_m = (nm * nm)[:, None] * (st[:, 32:35] / n)
        var_rms = (nm * nm)[:, None] * (st[:, 35:38] / n)
        x = torch.cat([
            frac_emb,
            lfeat,
            _spec._clip_log_abs(torch, mean_rms)[:, None],
            self._onehot,
            _spec._clip_log_abs(torch, var_m),
            _spec._clip_log_abs(torch, var_rms),
        ], dim=1)
        controls, lr_mult, hidden, cell = _spec.lstm_step(torch, x, hidden, cell, meta)
        pscale = torch.sqrt(psq + 1e-9)
        # every tensor's MLP weights at once (xopt.specs.velo.mix_mlp_weights: 100 · mean over
        # the bank of controls · bank), gathered into the kernel's padded table
        bank, gidx = self._bank(meta)
        mixed = 100.0 * (bank[None] * controls[:, :, None]).mean(1)
        tab = torch.cat([mixed, torch.zeros((nt, 1), device=dev)], 1)[:, gidx].contiguous()
        norm = torch.rsqrt(1e-5 + st[:, :32] / n).contiguous()
        scal = torch.cat([host, lr_mult[:, None], pscale[:, None],
                          torch.zeros((nt, 3), device=dev)], 1).contiguous()
        # 5: the fused update
        velo_fused_kernel[(lay.n_prog_all,)](lay.meta, lay.prog_all, ptrs, rcm, decays, mu,
                                             norm, scal, tab, tab, tab, tab, tab, tab, part,
                                             float(hp.exp_mult), float(hp.step_mult),
                                             SA=SA, **common)
        return hidden, cell


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
    decays = tuple(_spec._as_array(torch, d, like) for d in _spec.decay_arrays(hp))
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
