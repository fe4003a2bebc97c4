"""Fused Triton step of VeLO (learned_optimization's ``HyperV2`` in VeLO's configuration).

All of a model's tensors in six launches plus a handful of batched torch ops:

1. ``stats1`` (every tensor): partial sums of the clipped g² over each tile's two axes
   (factored tensors) and Σ m_k, Σ rms of the accumulators before the update (the LSTM's
   inputs), summed per tensor in a fixed order;
2. ``fac_finalize`` + ``rcm``: the new ``v_row``/``v_col`` and their row-column means;
3. :func:`_velo_kernel` in statistics mode: Σ feature² of the 30 MLP inputs and the
   second pass of the LSTM inputs' variances (Σ (m_k − mean m_k)², Σ (rms − mean m_k)²,
   two-pass as the spec computes them), per tile, then per tensor in a fixed order;
4. torch, batched over tensors: the LSTM inputs, one LSTM step for all tensors
   (:func:`xopt.specs.velo.lstm_step`, as the plain path), the hypernetwork's per-tensor
   MLP weights ``100·mean_k(controls_k·bank_k)``;
5. :func:`_velo_kernel` fused: accumulators, features, normalization, the tensor's own MLP
   (``tl.dot`` on per-tensor weight tables), the step and the parameter update.

Precision: ``"exact"`` (default) runs the MLP's matmuls as 3xTF32 (float32 accuracy),
``"fast"`` as TF32 (see :mod:`xopt.kernels.small_fc_lopt` and bench/RESULTS.md).

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

#: sub-tile rows and warps of the per-element kernels (XOPT_LOPT_SA / XOPT_LOPT_WARPS
#: override them, for tuning)
SA = int(os.environ.get("XOPT_LOPT_SA", "4"))
WARPS = int(os.environ.get("XOPT_LOPT_WARPS", "4"))
NPTR = 8  # pointer table columns: p, g, m, rms, v_row, v_col, v_diag, out
NFEAT = 30


@triton.jit
def _velo_kernel(meta, prog, ptrs, rcm, decays, mu, norm, scal, w0, b0, wh, bh, wl, bl, part,
                 exp_mult, step_mult,
                 FUSED: tl.constexpr, PREC: tl.constexpr, HP: tl.constexpr,
                 NHID: tl.constexpr, NPTR: tl.constexpr, NF: tl.constexpr, TA: tl.constexpr,
                 TB: tl.constexpr, SA: tl.constexpr):
    BLOCK: tl.constexpr = SA * TB
    pid = tl.program_id(0)
    t = tl.load(prog + pid)
    row = meta + t * NF
    fact = tl.load(row + 1)
    ia_n = tl.load(row + 2)
    b, ta, tb = C.tile_of(row, pid - tl.load(row + 11))
    rcm_b = rcm + tl.load(row + 22) + b * 3
    rc0 = tl.load(rcm_b)  # (unfactored tensors read 3 unused numbers)
    rc1 = tl.load(rcm_b + 1)
    rc2 = tl.load(rcm_b + 2)
    pp = C.ptr_f32(ptrs, t, 0, NPTR)
    gp = C.ptr_f32(ptrs, t, 1, NPTR)
    mp = C.ptr_f32(ptrs, t, 2, NPTR)
    rp = C.ptr_f32(ptrs, t, 3, NPTR)
    vr = C.ptr_f32(ptrs, t, 4, NPTR)
    vc = C.ptr_f32(ptrs, t, 5, NPTR)
    vd = C.ptr_f32(ptrs, t, 6, NPTR)
    md0 = tl.load(decays + 0)
    md1 = tl.load(decays + 1)
    md2 = tl.load(decays + 2)
    rd = tl.minimum(tl.maximum(tl.load(decays + 3), 0.0), 1.0)
    fd0 = tl.load(decays + 4)
    fd1 = tl.load(decays + 5)
    fd2 = tl.load(decays + 6)
    cols = tl.arange(0, 32)
    c8 = tl.arange(0, 8)
    if FUSED:
        inv = tl.load(norm + t * 32 + cols)
        outp = C.ptr_f32(ptrs, t, 7, NPTR)
        lr = tl.load(scal + t * 8)
        lrwd = tl.load(scal + t * 8 + 1)
        write_step = tl.load(scal + t * 8 + 2)
        lr_mult = tl.load(scal + t * 8 + 3)
        pscale = tl.load(scal + t * 8 + 4)
        w0t = w0 + t * 32 * HP
        b0t = b0 + t * HP
        wht = wh + t * NHID * HP * HP
        bht = bh + t * NHID * HP
        wlt = wl + t * HP * 16
        blt = bl + t * 16
    else:
        mu0 = tl.load(mu + t * 4)
        mu1 = tl.load(mu + t * 4 + 1)
        mu2 = tl.load(mu + t * 4 + 2)
    acc = tl.zeros([32], tl.float32)
    acc8 = tl.zeros([8], tl.float32)
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
        r3 = ridx * 3
        c3 = cidx * 3
        v3 = vd + off * 3
        R0, C0, FG0, FM0, V0 = C.accumulate(fact, off, mask, r3, c3, g, m0, rp, vr, vc, v3,
                                            fd0, rc0, 0.0)
        R1, C1, FG1, FM1, V1 = C.accumulate(fact, off, mask, r3, c3, g, m1, rp, vr + 1,
                                            vc + 1, v3 + 1, fd1, rc1, 0.0)
        R2, C2, FG2, FM2, V2 = C.accumulate(fact, off, mask, r3, c3, g, m2, rp, vr + 2,
                                            vc + 2, v3 + 2, fd2, rc2, 0.0)
        rr = tl.math.rsqrt(rms + 1e-6)
        z = tl.zeros([BLOCK], tl.float32)
        x = C.cat32(g, tl.minimum(tl.maximum(g, -0.1), 0.1), p, m0, m1, m2, rms,
                    m0 * rr, m1 * rr, m2 * rr, rr, g * FG0, g * FG1, g * FG2, g * rr,
                    R0, R1, R2, C0, C1, C2,
                    tl.math.rsqrt(R0 + 1e-8), tl.math.rsqrt(R1 + 1e-8),
                    tl.math.rsqrt(R2 + 1e-8), tl.math.rsqrt(C0 + 1e-8),
                    tl.math.rsqrt(C1 + 1e-8), tl.math.rsqrt(C2 + 1e-8),
                    m0 * FM0, m1 * FM1, m2 * FM2, z, z)
        x = tl.reshape(x, [BLOCK, 32])
        x = tl.where(mask[:, None], x, 0.0)
        if FUSED:
            out = C.mlp(x * inv[None, :], w0t, b0t, wht, bht, wlt, blt, 32, HP, NHID, PREC)
            oc = tl.arange(0, 16)
            direction = C.col(out, oc, 0)
            magnitude = C.col(out, oc, 1)
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
            acc += tl.sum(x * x, axis=0)
            d0 = om0 - mu0
            d1 = om1 - mu1
            d2 = om2 - mu2
            e0 = orms - mu0
            e1 = orms - mu1
            e2 = orms - mu2
            y = tl.reshape(C.cat8(d0 * d0, d1 * d1, d2 * d2, e0 * e0, e1 * e1, e2 * e2, z, z),
                           [BLOCK, 8])
            acc8 += tl.sum(tl.where(mask[:, None], y, 0.0), axis=0)
    if not FUSED:
        tl.store(part + pid.to(tl.int64) * 64 + cols, acc)
        tl.store(part + pid.to(tl.int64) * 64 + 32 + c8, acc8)
        # (columns 40-63 are not written and not read)


def _next_pow2(n: int, lo: int = 16) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def _pad3(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros((w.shape[0], rows, cols), dtype=torch.float32, device=w.device)
    out[:, :w.shape[1], :w.shape[2]] = w
    return out


class VeLOTriton:
    """The Triton step of one :class:`xopt.torch.VeLO` (caches its layout)."""

    PRECISIONS = {"exact": "tf32x3", "fast": "tf32"}

    def __init__(self, hp: _spec.VeLO, precision: str = "exact") -> None:
        self.hp = hp
        self.prec = self.PRECISIONS[precision]
        self._layout: L.Layout | None = None
        self._onehot: torch.Tensor | None = None
        self._tables = L.TableCache()

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
        md, rd, fd = (_spec._as_array(torch, d, like) for d in _spec.decay_arrays(hp))
        decays = torch.cat([md, rd, fd]).contiguous()
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
        nh = int(hp.ff_hidden_layers)
        hp_ = _next_pow2(int(hp.ff_hidden_size))
        common = dict(HP=hp_, NHID=nh - 1, NPTR=NPTR, NF=L.NFIELDS, TA=L.TA,
                      TB=L.TB, SA=SA, num_warps=WARPS, PREC=self.prec)
        part = torch.empty((lay.n_prog_all, 64), dtype=torch.float32, device=dev)
        dummy = part
        _velo_kernel[(lay.n_prog_all,)](lay.meta, lay.prog_all, ptrs, rcm, decays, mu,
                                        dummy, dummy, dummy, dummy, dummy, dummy, dummy,
                                        dummy, part, float(hp.exp_mult), float(hp.step_mult),
                                        FUSED=False, **common)
        st = C.seg_sum(part, lay)
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
        tabs = {}
        for name in _spec.mlp_bank_names(hp):
            bank = meta[name]
            c = controls.reshape(controls.shape + (1,) * (bank.dim() - 1))
            tabs[name.split("/")[1]] = 100.0 * (bank[None] * c).mean(1)
        w0 = _pad3(tabs["w0"], 32, hp_)
        b0 = _pad3(tabs["b0"][:, None], 1, hp_)[:, 0]
        if nh > 1:
            wh = torch.stack([_pad3(tabs[f"w{i}"], hp_, hp_) for i in range(1, nh)], 1)
            bh = torch.stack([_pad3(tabs[f"b{i}"][:, None], 1, hp_)[:, 0]
                              for i in range(1, nh)], 1)
        else:
            wh = torch.zeros((nt, 1, hp_, hp_), device=dev)
            bh = torch.zeros((nt, 1, hp_), device=dev)
        wl = _pad3(tabs[f"w{nh}"], hp_, 16)
        bl = _pad3(tabs[f"b{nh}"][:, None], 1, 16)[:, 0]
        norm = torch.rsqrt(1e-5 + st[:, :32] / n).contiguous()
        scal = torch.cat([host, lr_mult[:, None], pscale[:, None],
                          torch.zeros((nt, 3), device=dev)], 1).contiguous()
        # 5: the fused update
        _velo_kernel[(lay.n_prog_all,)](lay.meta, lay.prog_all, ptrs, rcm, decays, mu, norm,
                                        scal, w0, b0, wh, bh, wl, bl, part,
                                        float(hp.exp_mult), float(hp.step_mult), FUSED=True,
                                        **common)
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
