"""Fused Triton step of small_fc_lopt (learned_optimization's ``AdafacMLPLOpt``).

One optimizer step over all of a model's tensors in five launches (plus a few tiny torch
ops for the decays and time features), whatever the number of tensors:

1. ``stats1`` (factored tensors only): partial sums of g² over each tile's two axes;
2. ``fac_finalize`` + ``rcm``: the new ``v_row``/``v_col`` (written in place) and their
   row-column means, the partial sums added in a fixed order;
3. :func:`_sfc_kernel` in statistics mode: per tile, Σ feature² of the 28 features
   (recomputing the accumulators in registers), then a deterministic segmented sum per
   tensor (:func:`xopt.kernels.lopt_common.seg_sum`): the second-moment normalizer;
4. :func:`_sfc_kernel` fused: accumulators, features, normalization, the MLP (tensor-core
   ``tl.dot``), the step and the parameter update, all in registers; writes ``p``, ``m``,
   ``rms`` (and ``v_diag`` below rank 2).

The 11 time features are the same for every element: they are folded into the first
bias (``b0 + tf @ W0[28:]``), so the first layer's K is 28, padded to 32.

Precision (``precision=``):

* ``"exact"`` (default): the matmuls are ``tl.dot(..., input_precision="tf32x3")``
  (split-precision TF32, about float32 accuracy); everything else is float32 as in the
  plain path. Only the summation order differs from :mod:`xopt.torch.small_fc_lopt`.
* ``"fast"``: ``input_precision="tf32"`` (10-bit mantissas in the MLP). The MLP outputs
  (direction, magnitude) move by about 1e-3 relative, the step by as much; accumulators are
  not affected. Measured deviations from the plain path are in bench/RESULTS.md.

Under ``TRITON_INTERPRET=1`` (CPU) ``tl.dot`` is a float32 matmul whatever the precision.

:func:`reference_step` is the pure-PyTorch reference (the spec's per-tensor
:func:`xopt.specs.small_fc_lopt.compute_step`, as the plain path calls it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
import triton
import triton.language as tl

from xopt.kernels import lopt_common as C
from xopt.kernels import lopt_layout as L
from xopt.specs import small_fc_lopt as _spec

__all__ = ["SmallFCTriton", "reference_step"]

#: sub-tile rows and warps of the per-element kernels (XOPT_LOPT_SA / XOPT_LOPT_WARPS
#: override them, for tuning)
SA = int(os.environ.get("XOPT_LOPT_SA", "4"))
WARPS = int(os.environ.get("XOPT_LOPT_WARPS", "4"))
NPTR = 8  # pointer table columns: p, g, m, rms, v_row, v_col, v_diag, out
NFEAT = 28


@triton.jit
def _sfc_kernel(meta, prog, ptrs, rcm, decays, norm, scal, w0, b0, wh, bh, wl, bl, part,
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
    if FUSED:
        inv = tl.load(norm + t * 32 + cols)
        outp = C.ptr_f32(ptrs, t, 7, NPTR)
        lr = tl.load(scal + t * 4)
        lrwd = tl.load(scal + t * 4 + 1)
        write_step = tl.load(scal + t * 4 + 2)
    acc = tl.zeros([32], tl.float32)
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
        r3 = ridx * 3
        c3 = cidx * 3
        v3 = vd + off * 3
        R0, C0, FG0, FM0, V0 = C.accumulate(fact, off, mask, r3, c3, g, m0, rp, vr, vc, v3,
                                            fd0, rc0, 1e-6)
        R1, C1, FG1, FM1, V1 = C.accumulate(fact, off, mask, r3, c3, g, m1, rp, vr + 1,
                                            vc + 1, v3 + 1, fd1, rc1, 1e-6)
        R2, C2, FG2, FM2, V2 = C.accumulate(fact, off, mask, r3, c3, g, m2, rp, vr + 2,
                                            vc + 2, v3 + 2, fd2, rc2, 1e-6)
        rr = tl.math.rsqrt(rms + 1e-6)
        z = tl.zeros([BLOCK], tl.float32)
        x = C.cat32(g, p, m0, m1, m2, rms, m0 * rr, m1 * rr, m2 * rr, rr,
                    g * FG0, g * FG1, g * FG2, R0, R1, R2, C0, C1, C2,
                    tl.math.rsqrt(R0 + 1e-8), tl.math.rsqrt(R1 + 1e-8),
                    tl.math.rsqrt(R2 + 1e-8), tl.math.rsqrt(C0 + 1e-8),
                    tl.math.rsqrt(C1 + 1e-8), tl.math.rsqrt(C2 + 1e-8),
                    m0 * FM0, m1 * FM1, m2 * FM2, z, z, z, z)
        x = tl.reshape(x, [BLOCK, 32])
        x = tl.where(mask[:, None], x, 0.0)
        if FUSED:
            out = C.mlp(x * inv[None, :], w0, b0, wh, bh, wl, bl, 32, HP, NHID, PREC)
            oc = tl.arange(0, 16)
            direction = C.col(out, oc, 0)
            magnitude = C.col(out, oc, 1)
            step = direction * tl.exp(magnitude * exp_mult) * step_mult
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
    if not FUSED:
        tl.store(part + pid.to(tl.int64) * 32 + cols, acc)


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
    """The Triton step of one :class:`xopt.torch.SmallFCLOpt` (caches its layout)."""

    PRECISIONS = {"exact": "tf32x3", "fast": "tf32"}

    def __init__(self, hp: _spec.SmallFCLOpt, precision: str = "exact") -> None:
        why = check_supported(hp)
        if why is not None:
            raise ValueError(f"SmallFCLOpt(impl='triton'): {why}")
        self.hp = hp
        self.prec = self.PRECISIONS[precision]
        self._layout: L.Layout | None = None
        self._wcache: tuple | None = None
        self._tables = L.TableCache()

    def layout(self, shapes: Sequence[tuple[int, ...]], device: torch.device) -> L.Layout:
        lay = self._layout
        if lay is None or lay.shapes != tuple(shapes) or lay.meta.device != device:
            lay = self._layout = L.build_layout(shapes, device)
        return lay

    def _weights(self, meta: Mapping[str, torch.Tensor]) -> tuple:
        key = (id(meta), meta["mlp/w0"].data_ptr())
        if self._wcache is not None and self._wcache[0] == key:
            return self._wcache[1]
        hp = self.hp
        nl = int(hp.hidden_layers)
        hp_ = _next_pow2(int(hp.hidden_size))
        w0 = meta["mlp/w0"]
        w0p = _pad(w0[:NFEAT], 32, hp_)
        wt = w0[NFEAT:]
        wh = torch.stack([_pad(meta[f"mlp/w{i}"], hp_, hp_) for i in range(1, nl)]) \
            if nl > 1 else torch.zeros((1, hp_, hp_), device=w0.device)
        bh = torch.stack([_pad(meta[f"mlp/b{i}"][None], 1, hp_)[0] for i in range(1, nl)]) \
            if nl > 1 else torch.zeros((1, hp_), device=w0.device)
        wl = _pad(meta[f"mlp/w{nl}"], hp_, 16)
        bl = _pad(meta[f"mlp/b{nl}"][None], 1, 16)[0]
        out = (w0p, wt, wh, bh, wl, bl, hp_, nl - 1)
        self._wcache = (key, out)
        return out

    def step(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             states: Sequence[dict[str, torch.Tensor]], outs: Sequence[torch.Tensor],
             write_step: Sequence[bool], lrs: Sequence[float], lrwds: Sequence[float],
             meta: Mapping[str, torch.Tensor], iteration: int) -> None:
        """One step: updates ``states`` in place and writes each tensor's new parameter
        (or, where ``write_step``, its step) into ``outs``. All tensors float32,
        contiguous, on one device."""
        hp = self.hp
        dev = params[0].device
        lay = self.layout([tuple(p.shape) for p in params], dev)
        w0p, wt, wh, bh, wl, bl, hp_, nhid = self._weights(meta)
        md, rd, fd = _spec.decays(hp, meta, xp=torch)
        decays = torch.cat([md, rd, fd]).contiguous()
        tf = _spec.time_features(torch, torch.tensor(iteration, dtype=torch.int32),
                                 meta["mlp/b0"])
        b0p = _pad((meta["mlp/b0"] + (tf[:, None] * wt).sum(0))[None], 1, hp_)[0]
        ptrs = self._tables.get("ptrs", [
            [p.data_ptr(), g.data_ptr(), s["m"].data_ptr(), s["rms"].data_ptr(),
             s["v_row"].data_ptr(), s["v_col"].data_ptr(), s["v_diag"].data_ptr(),
             o.data_ptr()] for p, g, s, o in zip(params, grads, states, outs, strict=True)],
            torch.int64, dev)
        scal = self._tables.get("scal", [[lr, lrwd, float(ws), 0.0] for lr, lrwd, ws in
                                         zip(lrs, lrwds, write_step, strict=True)],
                                torch.float32, dev)
        rcm, _ = C.factored_pass(lay, ptrs, fd, clip_g=False, mom_sums=False, npt=NPTR)
        if rcm is None:
            rcm = torch.zeros((3,), dtype=torch.float32, device=dev)
        part = torch.empty((lay.n_prog_all, 32), dtype=torch.float32, device=dev)
        common = dict(HP=hp_, NHID=nhid, NPTR=NPTR, NF=L.NFIELDS, TA=L.TA, TB=L.TB, SA=SA,
                      num_warps=WARPS, PREC=self.prec)
        args = (lay.meta, lay.prog_all, ptrs, rcm, decays)
        _sfc_kernel[(lay.n_prog_all,)](*args, part, scal, w0p, b0p, wh, bh, wl, bl, part,
                                       float(hp.exp_mult), float(hp.step_mult), FUSED=False,
                                       **common)
        sums = C.seg_sum(part, lay)
        norm = torch.rsqrt(1e-5 + sums / lay.numel[:, None]).contiguous()
        _sfc_kernel[(lay.n_prog_all,)](*args, norm, scal, w0p, b0p, wh, bh, wl, bl, part,
                                       float(hp.exp_mult), float(hp.step_mult), FUSED=True,
                                       **common)


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
        step, accs = _spec.compute_step(hp, p, g, *(st[v] for v in _spec._PARAM_VARS), tf,
                                        meta, decays, xp=torch)
        steps.append(step)
        new_states.append(dict(zip(_spec._PARAM_VARS, accs, strict=True)))
    return steps, new_states
