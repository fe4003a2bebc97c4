"""The tile layout of the learned-optimizer kernels: every tensor of a model in one table.

A kernel launch covers all of a model's tensors. Each tensor is seen as a batch of 2-D
matrices ``[B, Ia, Ib]`` (strided views of the contiguous parameter), cut into tiles of
``TA × TB`` elements; one program owns one tile and walks it in sub-tiles of ``SA × TB``.
A table ``prog → tensor`` (int32) and a per-tensor metadata row (int64, fields below) let
the program find its tensor, its batch index and its tile without any search.

* Factored tensors (rank ≥ 2, :func:`xopt.specs.lopt.factored_dims` gives ``(d1, d0)``):
  the two matrix axes are ``d0`` and ``d1``, ordered so that the inner tile axis ``b`` is
  the one with the smaller stride (coalesced loads); the other axes (at most two) are the
  batch. Summing a tile over ``b`` gives partial sums for one of the Adafactor statistics,
  over ``a`` for the other: they are written to a scratch buffer at fixed places and summed
  later in a fixed order (no atomics: the result is the same bits every run).
* Unfactored tensors (rank 0 or 1) are viewed as ``[1, ceil(n / TB), TB]`` with a mask.

Pure torch and Python; no triton import here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from xopt.specs.lopt import factored_dims

#: tile shape: TA rows (walked SA at a time) × TB columns along the contiguous axis
TA = 64
TB = 64

# metadata fields (int64 columns of Layout.meta)
N, FACT, IA, IB, SAP, SBP, BS1, PB0, PB1, NTA, NTB, PSTART, PSTART_FAC, A_IS_D0 = range(14)
RB0, RB1, RD1, CB0, CB1, CD0, PA_OFF, PB_OFF, RCM_OFF, NB, ND0, ND1 = range(14, 26)
NFIELDS = 26

#: rows summed by one program of the first level of a segmented sum
SEG_CHUNK = 512


def _contig_strides(shape: Sequence[int]) -> list[int]:
    out, s = [], 1
    for d in reversed(shape):
        out.append(s)
        s *= int(d)
    return out[::-1]


@dataclasses.dataclass
class Layout:
    """Static description of a list of parameter shapes, on one device."""

    shapes: tuple[tuple[int, ...], ...]
    meta: torch.Tensor           # int64 [n_tensors, NFIELDS] (device)
    meta_host: list[list[int]]
    numel: torch.Tensor          # float32 [n_tensors] (device): element counts
    prog_all: torch.Tensor       # int32 [n_prog_all]: program -> tensor, every tensor
    prog_fac: torch.Tensor       # int32 [n_prog_fac]: program -> tensor, factored only
    fin_prog: torch.Tensor       # int32 [n_fin, 3]: (tensor, which, local) for the finalize
    rcm_prog: torch.Tensor       # int32 [n_rcm, 2]: (tensor, batch index)
    seg1: torch.Tensor           # int32 [n_chunks, 2]: (first row, rows) over prog_all rows
    seg2: torch.Tensor           # int32 [n_tensors, 2]: (first chunk, chunks)
    n_prog_all: int
    n_prog_fac: int
    pa_size: int
    pb_size: int
    rcm_size: int
    any_factored: bool


def _seg_tables(counts: Sequence[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Chunks of at most SEG_CHUNK rows inside each segment, and each segment's chunks."""
    chunks, segs, row = [], [], 0
    for c in counts:
        first = len(chunks)
        for s in range(0, c, SEG_CHUNK):
            chunks.append((row + s, min(SEG_CHUNK, c - s)))
        segs.append((first, len(chunks) - first))
        row += c
    return chunks, segs


def build_layout(shapes: Sequence[Sequence[int]], device: torch.device) -> Layout:
    shapes = tuple(tuple(int(s) for s in shape) for shape in shapes)
    rows: list[list[int]] = []
    prog_all: list[int] = []
    prog_fac: list[int] = []
    fin: list[tuple[int, int, int]] = []
    rcm: list[tuple[int, int]] = []
    pa = pb = rc = 0
    for t, shape in enumerate(shapes):
        n = int(math.prod(shape))
        r = [0] * NFIELDS
        r[N] = n
        f = factored_dims(shape)
        if f is None:
            r[FACT] = 0
            r[IA], r[IB] = max(1, -(-n // TB)), TB
            r[SAP], r[SBP] = TB, 1
            r[BS1], r[NB] = 1, 1
        else:
            d1, d0 = f
            st = _contig_strides(shape)
            others = [ax for ax in range(len(shape)) if ax not in (d0, d1)]
            a_ax, b_ax = (d0, d1) if st[d1] < st[d0] else (d1, d0)
            r[FACT] = 1
            r[A_IS_D0] = int(a_ax == d0)
            r[IA], r[IB] = shape[a_ax], shape[b_ax]
            r[SAP], r[SBP] = st[a_ax], st[b_ax]
            row_shape = [s for i, s in enumerate(shape) if i != d0]
            col_shape = [s for i, s in enumerate(shape) if i != d1]
            row_axes = [i for i in range(len(shape)) if i != d0]
            col_axes = [i for i in range(len(shape)) if i != d1]
            rst = dict(zip(row_axes, _contig_strides(row_shape), strict=True))
            cst = dict(zip(col_axes, _contig_strides(col_shape), strict=True))
            bo = ([None, None] + others)[-2:]  # (outer, inner) batch axes, None if absent
            r[BS1] = shape[bo[1]] if bo[1] is not None else 1
            r[NB] = math.prod(shape[i] for i in others) if others else 1
            r[PB0] = st[bo[0]] if bo[0] is not None else 0
            r[PB1] = st[bo[1]] if bo[1] is not None else 0
            r[RB0] = rst[bo[0]] if bo[0] is not None else 0
            r[RB1] = rst[bo[1]] if bo[1] is not None else 0
            r[CB0] = cst[bo[0]] if bo[0] is not None else 0
            r[CB1] = cst[bo[1]] if bo[1] is not None else 0
            r[RD1], r[CD0] = rst[d1], cst[d0]
            r[ND0], r[ND1] = shape[d0], shape[d1]
        r[NTA] = -(-r[IA] // TA)
        r[NTB] = -(-r[IB] // TB)
        nprog = r[NB] * r[NTA] * r[NTB]
        r[PSTART] = len(prog_all)
        prog_all.extend([t] * nprog)
        if r[FACT]:
            r[PSTART_FAC] = len(prog_fac)
            prog_fac.extend([t] * nprog)
            r[PA_OFF] = pa
            pa += r[NB] * r[NTB] * r[IA]
            r[PB_OFF] = pb
            pb += r[NB] * r[NTA] * r[IB]
            r[RCM_OFF] = rc
            rc += r[NB] * 3
            for which, count in ((0, r[NB] * -(-r[IA] // FIN_BLOCK)),
                                 (1, r[NB] * -(-r[IB] // FIN_BLOCK))):
                fin.extend((t, which, i) for i in range(count))
            rcm.extend((t, b) for b in range(r[NB]))
        rows.append(r)
    counts = [r[NB] * r[NTA] * r[NTB] for r in rows]
    chunks, segs = _seg_tables(counts)

    def i32(x, shape=None):
        ten = torch.tensor(x, dtype=torch.int32) if x else torch.zeros(shape or (0,),
                                                                        dtype=torch.int32)
        return ten.to(device)

    return Layout(
        shapes=shapes,
        meta=torch.tensor(rows, dtype=torch.int64).reshape(len(rows), NFIELDS).to(device),
        meta_host=rows,
        numel=torch.tensor([float(r[N]) for r in rows], dtype=torch.float32).to(device),
        prog_all=i32(prog_all), prog_fac=i32(prog_fac),
        fin_prog=i32(fin, (0, 3)), rcm_prog=i32(rcm, (0, 2)),
        seg1=i32(chunks, (0, 2)), seg2=i32(segs, (0, 2)),
        n_prog_all=len(prog_all), n_prog_fac=len(prog_fac),
        pa_size=pa, pb_size=pb, rcm_size=rc, any_factored=bool(prog_fac),
    )


#: entries of a factored statistic finalized by one program
FIN_BLOCK = 64


def supported_small_fc(hp) -> str | None:
    """Why the small_fc_lopt kernels cannot run these hyperparameters (None: they can)."""
    k = (len(hp.initial_momentum_decays), len(hp.initial_rms_decays),
         len(hp.initial_adafactor_decays))
    if k != (3, 1, 3):
        return ("the Triton kernels are written for 3 momentum, 1 rms and 3 Adafactor decays "
                f"(got {k})")
    if int(hp.hidden_layers) < 1:
        return "the Triton kernels need hidden_layers >= 1"
    return None


def supported_velo(hp) -> str | None:
    """Why the VeLO kernels cannot run these hyperparameters (None: they can)."""
    k = (len(hp.initial_momentum_decays), len(hp.initial_rms_decays),
         len(hp.initial_adafactor_decays))
    if k != (3, 1, 3):
        return ("the Triton kernels are written for 3 momentum, 1 rms and 3 Adafactor decays "
                f"(got {k})")
    if not 1 <= int(hp.ff_hidden_size) <= 4 or int(hp.ff_hidden_layers) < 1:
        return ("the Triton kernels run per-element MLPs up to 4 wide with at least one hidden "
                f"layer (got ff_hidden_size={hp.ff_hidden_size}, "
                f"ff_hidden_layers={hp.ff_hidden_layers})")
    return None

