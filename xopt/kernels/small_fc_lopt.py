"""Fused Triton step of small_fc_lopt (learned_optimization's ``AdafacMLPLOpt``).

One optimizer step over all of a model's tensors in five launches (plus a few tiny torch
ops for the decays and time features), whatever the number of tensors:

1. ``stats1`` (factored tensors only): partial sums of g² over each tile's two axes;
2. ``fac_finalize`` + ``rcm``: the new ``v_row``/``v_col`` (written in place) and their
   row-column means, the partial sums added in a fixed order;
3. :func:`sfc_stats_kernel`: per tile, Σ feature² of the 28 features (recomputing the
   accumulators in registers; float32 per thread, the tile's and the tensor's sums in
   float64, :func:`xopt.kernels.lopt_common.seg_sum`, in a fixed order): the
   second-moment normalizer;
4. :func:`sfc_fused_kernel`: accumulators, features, normalization, the MLP, the step and
   the parameter update, all in registers; writes ``p``, ``m``, ``rms`` (and ``v_diag``
   below rank 2).

The 11 time features are the same for every element: they are folded into the first
bias (``b0 + tf @ W0[28:]``), so the first layer's K is 28.

The MLP: hidden widths up to 4 (the original's 4) run as float32 FMAs, the first layer one
feature at a time (:func:`xopt.kernels.lopt_common.rank1`, no feature tile), in both
precisions. Wider ones (PyLO's 32) build a [BLOCK, 32] feature tile and run on the tensor
cores (:func:`xopt.kernels.lopt_common.mlp_dot`); the output layer (2 columns) is float32
FMAs. Precision of the tensor-core matmuls (``precision=``):

* ``"exact"`` (default): split-precision TF32, both operands split into two TF32 halves
  rounded to nearest, three exact products summed in float32
  (:func:`xopt.kernels.lopt_common.dot3`): operands carried to 22 bits instead of
  float32's 24. Measured against float64: see tests/test_kernels_lopt.py.
* ``"fast"``: one TF32 product (10-bit mantissas). The MLP outputs move by about 1e-3
  relative, the step by as much; accumulators are not affected.

Under ``TRITON_INTERPRET=1`` (CPU) ``tl.dot`` multiplies in float32 whatever the precision.

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
from xopt.specs._xp import to_device

__all__ = ["SmallFCTriton", "reference_step"]

#: sub-tile rows (SA × TB elements per sub-tile) of the per-element kernels: the statistics
#: pass, the fused pass with the tensor-core MLP (hidden width > FMA_MAX) and with the FMA
#: MLP; warps per program (XOPT_LOPT_SA_STATS / _SA_DOT / _SA_FMA / _WARPS, for tuning)
SA_STATS = int(os.environ.get("XOPT_LOPT_SA_STATS", "2"))
SA_DOT = int(os.environ.get("XOPT_LOPT_SA_DOT", "2"))
SA_FMA = int(os.environ.get("XOPT_LOPT_SA_FMA", "4"))
WARPS = int(os.environ.get("XOPT_LOPT_WARPS", "4"))
#: software-pipelining stages of the per-element loop (XOPT_LOPT_STAGES)
STAGES = int(os.environ.get("XOPT_LOPT_STAGES", "2"))
#: products per split-precision matmul in exact mode (3, or 4 with x_lo·w_lo;
#: XOPT_LOPT_DOT_TERMS)
TERMS = int(os.environ.get("XOPT_LOPT_DOT_TERMS", "3"))
#: hidden widths up to this run the MLP as float32 FMAs, zero-padded to 4 (exact in both
#: modes), wider ones on the tensor cores
FMA_MAX = 4
NPTR = 8  # pointer table columns: p, g, m, rms, v_row, v_col, v_diag, out
NFEAT = 28


@triton.jit
def _sfc_body(meta, prog, ptrs, rcm, decays, norm, scal, w0h, w0l, b0, wh, bh, wl, bl, part,
              exp_mult, step_mult, FUSED: tl.constexpr, PREC: tl.constexpr,
              TERMS: tl.constexpr, MLP_DOT: tl.constexpr, HP: tl.constexpr,
              NHID: tl.constexpr, NPTR: tl.constexpr, NF: tl.constexpr, TA: tl.constexpr,
              TB: tl.constexpr, SA: tl.constexpr):
    """One tile [TA, TB] of one tensor (``prog[pid]``), walked in sub-tiles of SA × TB
    elements (BLOCK; one, two or four per thread). Each sub-tile: the new accumulators and
    the 28 features as [BLOCK] vectors.

    ``FUSED=False`` (statistics): Σ over the tile of each feature² → ``part[pid, 0:32]``
    (float64; masked elements excluded), accumulated per thread in float32 as a [BLOCK, 32]
    tile (one row per element, :func:`xopt.kernels.lopt_common.cat32`) and reduced once at
    the end. ``FUSED=True``: normalizes by ``norm[t, :]`` (the tensor's
    ``rsqrt(1e-5 + mean feature²)``), runs the MLP — with ``MLP_DOT`` on the tensor cores
    from the [BLOCK, 32] tile (:func:`~xopt.kernels.lopt_common.mlp_dot`, weights loaded
    once per program), else 4 wide in float32 FMAs without a tile
    (:func:`~xopt.kernels.lopt_common.rank1`, :func:`~xopt.kernels.lopt_common.mlp4_tail`)
    — and writes the new parameter (or the step), ``m``, ``rms`` and ``v_diag``."""
    BLOCK: tl.constexpr = SA * TB
    pid = tl.program_id(0)
    t, row, fact, ia_n, b, ta, tb, rc0, rc1, rc2 = C.program_tile(meta, prog, rcm, NF)
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
            w1_ofs = hc[:, None] * HP + hc[None, :]
            w1h_t = tl.load(wh + w1_ofs)  # the first hidden layer (a zero layer if NHID = 0)
            w1l_t = tl.load(wh + NHID * HP * HP + w1_ofs)
            b1_t = tl.load(bh + hc)
            wl0_t = tl.load(wl + hc * 16)
            wl1_t = tl.load(wl + hc * 16 + 1)
            bl0_t = tl.load(bl)
            bl1_t = tl.load(bl + 1)
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
                direction, magnitude = C.mlp_dot(x * inv[None, :], w0h_t, w0l_t, b0_t, w1h_t,
                                                 w1l_t, b1_t, wh, bh, wl0_t, wl1_t, bl0_t,
                                                 bl1_t, HP, NHID, PREC, TERMS)
                direction = tl.reshape(direction, [BLOCK])
                magnitude = tl.reshape(magnitude, [BLOCK])
            else:
                x = tl.where(mask[:, None], x, 0.0)
                acc += x * x
        if FUSED:
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
    if not FUSED:
        tl.store(part + pid.to(tl.int64) * 32 + cols, tl.sum(acc.to(tl.float64), axis=0))


@triton.jit
def sfc_stats_kernel(meta, prog, ptrs, rcm, decays, norm, scal, w0h, w0l, b0, wh, bh, wl, bl,
                     part, exp_mult, step_mult, PREC: tl.constexpr, TERMS: tl.constexpr,
                     MLP_DOT: tl.constexpr,
                     HP: tl.constexpr, NHID: tl.constexpr, NPTR: tl.constexpr,
                     NF: tl.constexpr, TA: tl.constexpr, TB: tl.constexpr, SA: tl.constexpr):
    """Launch 3 (statistics mode of :func:`_sfc_body`): Σ feature² per tile."""
    _sfc_body(meta, prog, ptrs, rcm, decays, norm, scal, w0h, w0l, b0, wh, bh, wl, bl, part,
              exp_mult, step_mult, False, PREC, TERMS, MLP_DOT, HP, NHID, NPTR, NF, TA, TB, SA)


@triton.jit
def sfc_fused_kernel(meta, prog, ptrs, rcm, decays, norm, scal, w0h, w0l, b0, wh, bh, wl, bl,
                     part, exp_mult, step_mult, PREC: tl.constexpr, TERMS: tl.constexpr,
                     MLP_DOT: tl.constexpr,
                     HP: tl.constexpr, NHID: tl.constexpr, NPTR: tl.constexpr,
                     NF: tl.constexpr, TA: tl.constexpr, TB: tl.constexpr, SA: tl.constexpr):
    """Launch 4 (fused mode of :func:`_sfc_body`): the update."""
    _sfc_body(meta, prog, ptrs, rcm, decays, norm, scal, w0h, w0l, b0, wh, bh, wl, bl, part,
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
        self._decays: tuple | None = None  # (key, all 7 decays, Adafactor's 3), per θ

    def layout(self, shapes: Sequence[tuple[int, ...]], device: torch.device) -> L.Layout:
        lay = self._layout
        if lay is None or lay.shapes != tuple(shapes) or lay.meta.device != device:
            lay = self._layout = L.build_layout(shapes, device)
        return lay

    def _weights(self, meta: Mapping[str, torch.Tensor]) -> dict:
        """The MLP's weights as the kernel reads them (cached per meta-parameter tensor):
        zero-padded to HP columns, the first layer's 28 feature rows (padded to 32) apart
        from its 11 time-feature rows ``wt`` (folded into the bias at each step); for the
        tensor-core MLP in exact mode, split into TF32 hi/lo halves
        (:func:`xopt.kernels.lopt_common.split_weights`)."""
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
        wh = torch.stack([_pad(meta[f"mlp/w{i}"], hp_, hp_) for i in range(1, nl)]) \
            if nl > 1 else torch.zeros((1, hp_, hp_), device=dev)
        bh = torch.stack([_pad(meta[f"mlp/b{i}"][None], 1, hp_)[0] for i in range(1, nl)]) \
            if nl > 1 else torch.zeros((1, hp_), device=dev)
        if dot and self.prec == "tf32x3":
            w0h, w0l = C.split_weights(w0p)
            whh, whl = C.split_weights(wh)
        else:
            w0h, w0l = w0p, torch.zeros_like(w0p)
            whh, whl = wh, torch.zeros_like(wh)
        out = dict(w0h=w0h, w0l=w0l, wt=w0[NFEAT:], wh=torch.cat([whh.flatten(),
                                                                  whl.flatten()]),
                   bh=bh.contiguous(), wl=_pad(meta[f"mlp/w{nl}"], hp_, 16),
                   bl=_pad(meta[f"mlp/b{nl}"][None], 1, 16)[0], hp=hp_, nhid=nl - 1, dot=dot)
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
        w = self._weights(meta)
        hp_ = w["hp"]
        dkey = tuple((k, v.data_ptr(), v._version) for k, v in meta.items()
                     if k.startswith("decays/"))
        if self._decays is None or self._decays[0] != dkey:
            md, rd, fd = _spec.decays(hp, meta, xp=torch)
            self._decays = (dkey, torch.cat([md, rd, fd]).contiguous(), fd)
        _, decays, fd = self._decays
        tf = _spec.time_features(torch, to_device(torch.tensor(iteration, dtype=torch.int32),
                                                    dev), meta["mlp/b0"])
        b0p = _pad((meta["mlp/b0"] + (tf[:, None] * w["wt"]).sum(0))[None], 1, hp_)[0]
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
        part = torch.empty((lay.n_prog_all, 32), dtype=torch.float64, device=dev)
        common = dict(HP=hp_, NHID=w["nhid"], NPTR=NPTR, NF=L.NFIELDS, TA=L.TA, TB=L.TB,
                      num_warps=WARPS, num_stages=STAGES,
                      PREC=self.prec, TERMS=TERMS,
                      MLP_DOT=w["dot"])
        args = (lay.meta, lay.prog_all, ptrs, rcm, decays)
        weights = (w["w0h"], w["w0l"], b0p, w["wh"], w["bh"], w["wl"], w["bl"])
        sfc_stats_kernel[(lay.n_prog_all,)](*args, part, scal, *weights, part,
                                            float(hp.exp_mult), float(hp.step_mult),
                                            SA=SA_STATS, **common)
        sums = C.seg_sum(part, lay)
        norm = torch.rsqrt(1e-5 + (sums / lay.numel[:, None].double()).float()).contiguous()
        sfc_fused_kernel[(lay.n_prog_all,)](*args, norm, scal, *weights, part,
                                            float(hp.exp_mult), float(hp.step_mult),
                                            SA=SA_DOT if w["dot"] else SA_FMA, **common)


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
