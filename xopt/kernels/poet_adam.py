"""POETAdamW's update of one parameter in one pass (Triton).

:class:`xopt.torch.poet.POETAdamW` applies the authors' arithmetic as foreach calls, about
ten passes over each tensor for a bf16 parameter with float32 moments (the gradient's and
the parameter's float32 copies, each moment's two operations, the denominator's two, the
update, the copy back), ~84 bytes of traffic per element against the ~22 that reading and
writing each tensor once needs. This kernel does the same operations, in the same order and
precision, on one tile at a time: ``m = m·β₁``, ``m = m + (1 − β₁)·g``, ``v = v·β₂``,
``v = v + ((1 − β₂)·g)·g``, ``d = √v + ε`` (correctly rounded), ``p = p + (−step)·(m / d)``
(correctly rounded division), then ``p = p + decay·p`` where the group decays; the
parameter rounded to its dtype once, at the end, as the foreach path's copy back does.
Each float32 operation is rounded as ATen's CUDA kernels round it: a fused multiply-add
where they compute ``a + α·b`` in one expression, written as ``tl.fma``, every other
operation rounded apart (launched with ``NO_FP_FUSION``, so that no kernel's compilation
contracts differently from another's).

:func:`adam_update_many` updates a list of parameters (one dtype, one set of scalars) in
one launch: a table of their addresses on the device (made once per set of addresses and
kept), each program finding its tensor and tile in it; the same per-element operations,
so the same bits as :func:`adam_update` on each. An optimizer step of a few hundred
parameters is then a few launches rather than one per parameter (their host time was most
of POETAdamW's step in the 350M training step, bench/RESULTS.md).

Reference: :func:`xopt.torch.poet`'s foreach update (tested against it under
``TRITON_INTERPRET=1``; on a GPU ``bench/poet_layer.py --check`` compares them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xopt.kernels import NO_FP_FUSION
from xopt.kernels._grid import cdiv
from xopt.kernels._tables import at, block_map
from xopt.kernels.poet_jit import launch

__all__ = ["BLOCK", "adam_update", "adam_update_many"]

#: elements per program (4 warps, 8 per thread: 16-byte float32 accesses)
BLOCK = 1024


@triton.jit
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, b1, omb1, b2, omb2, eps, neg_step, decay,
                 DECAY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _adam_tile(p_ptr + offs, g_ptr + offs, m_ptr + offs, v_ptr + offs, offs < n, b1, omb1,
               b2, omb2, eps, neg_step, decay, DECAY)


@triton.jit
def _adam_many_kernel(table_ptr, tile_ptr, n_tensors, p0_ptr, g0_ptr, b1, omb1, b2, omb2, eps,
                      neg_step, decay, DECAY: tl.constexpr, ALIGNED: tl.constexpr,
                      BLOCK: tl.constexpr):
    # table: rows p, g, m, v (addresses) and numel, n_tensors columns each; tiles: two
    # int32 rows, each program's tensor and its tile within that tensor
    pid = tl.program_id(0)
    t = tl.load(tile_ptr + pid).to(tl.int64)
    j = tl.load(tile_ptr + tl.num_programs(0) + pid).to(tl.int64)
    n = tl.load(table_ptr + 4 * n_tensors + t)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    pp = at(tl.load(table_ptr + t).to(p0_ptr.dtype), offs, ALIGNED, BLOCK)
    gp = at(tl.load(table_ptr + n_tensors + t).to(g0_ptr.dtype), offs, ALIGNED, BLOCK)
    mp = at(tl.load(table_ptr + 2 * n_tensors + t).to(tl.pointer_type(tl.float32)), offs,
             ALIGNED, BLOCK)
    vp = at(tl.load(table_ptr + 3 * n_tensors + t).to(tl.pointer_type(tl.float32)), offs,
             ALIGNED, BLOCK)
    _adam_tile(pp, gp, mp, vp, offs < n, b1, omb1, b2, omb2, eps, neg_step, decay, DECAY)


@triton.jit
def _adam_tile(pp, gp, mp, vp, mask, b1, omb1, b2, omb2, eps, neg_step, decay,
               DECAY: tl.constexpr):
    # one tile: pp, gp, mp, vp the pointers of its elements
    g = tl.load(gp, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(mp, mask=mask, other=0.0)
    v = tl.load(vp, mask=mask, other=0.0)
    # ATen's CUDA kernels compute a + α·b (add with alpha, addcmul, addcdiv) as one fused
    # multiply-add: written out as fma here, every other operation rounded apart
    # (NO_FP_FUSION: a contraction left to the compiler can differ from kernel to kernel)
    m = m * b1
    m = tl.fma(omb1, g, m)
    v = v * b2
    v = tl.fma(omb2 * g, g, v)
    d = tl.sqrt_rn(v) + eps
    p = tl.load(pp, mask=mask, other=0.0).to(tl.float32)
    p = tl.fma(neg_step, tl.div_rn(m, d), p)
    if DECAY:
        p = tl.fma(decay, p, p)
    tl.store(mp, m, mask=mask)
    tl.store(vp, v, mask=mask)
    tl.store(pp, p.to(pp.dtype.element_ty), mask=mask)


def supported(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`adam_update` takes these tensors: float32 moments, contiguous, one
    shape, a float32/bfloat16/float16 parameter and gradient."""
    return (m.dtype == torch.float32 and v.dtype == torch.float32
            and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and g.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and p.shape == g.shape == m.shape == v.shape
            and p.is_contiguous() and g.is_contiguous() and m.is_contiguous()
            and v.is_contiguous())


def adam_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                b1: float, b2: float, eps: float, step_size: float,
                decay: float | None) -> None:
    """One update of ``p``, ``m``, ``v`` in place (module docstring; ``decay``: the
    decoupled decay's factor ``−lr·wd`` or None). The tensors as :func:`supported` says."""
    n = p.numel()
    if n == 0:
        return
    launch(_adam_kernel, (cdiv(n, BLOCK),), p, g, m, v, n, b1, 1.0 - b1, b2, 1.0 - b2, eps,
           -step_size, 0.0 if decay is None else decay, DECAY=decay is not None, BLOCK=BLOCK,
           num_warps=4, **NO_FP_FUSION)


#: (device, dtypes, the tensors' addresses and sizes) -> (table, tiles): the launch's
#: device-side lists, made once per set of addresses (an optimizer's parameters, moments
#: and, as the caching allocator hands them out again, gradients, are the same every step)
_TABLES: dict = {}
_TABLES_MAX = 64


def _tables(ps, gs, ms, vs) -> tuple[torch.Tensor, torch.Tensor, bool]:
    key = (ps[0].device, ps[0].dtype, gs[0].dtype,
           *(t.data_ptr() for ts in (ps, gs, ms, vs) for t in ts),
           *(p.numel() for p in ps))
    hit = _TABLES.get(key)
    if hit is not None:
        return hit
    sizes = [p.numel() for p in ps]
    rows = [[t.data_ptr() for t in ts] for ts in (ps, gs, ms, vs)]
    table = torch.tensor([*rows[0], *rows[1], *rows[2], *rows[3], *sizes], dtype=torch.int64)
    which, within = block_map(sizes, BLOCK)
    dev = ps[0].device
    aligned = all(a % 16 == 0 for row in rows for a in row)
    hit = (table.to(dev), torch.cat((which, within)).to(dev), aligned)
    if len(_TABLES) >= _TABLES_MAX:
        _TABLES.clear()
    _TABLES[key] = hit
    return hit


def adam_update_many(ps, gs, ms, vs, b1: float, b2: float, eps: float, step_size: float,
                     decay: float | None) -> None:
    """:func:`adam_update` of each ``(p, g, m, v)`` of the lists, in one launch (module
    docstring): every tensor as :func:`supported` says, the parameters of one dtype and the
    gradients of one dtype, on one device; the same bits as one :func:`adam_update` each."""
    if not all(p.numel() for p in ps):
        keep = [i for i, p in enumerate(ps) if p.numel()]
        ps, gs, ms, vs = ([ts[i] for i in keep] for ts in (ps, gs, ms, vs))
    if not ps:
        return
    table, tiles, aligned = _tables(ps, gs, ms, vs)
    launch(_adam_many_kernel, (tiles.numel() // 2,), table, tiles, len(ps), ps[0], gs[0], b1,
           1.0 - b1, b2, 1.0 - b2, eps, -step_size, 0.0 if decay is None else decay,
           DECAY=decay is not None, ALIGNED=aligned, BLOCK=BLOCK, num_warps=4, **NO_FP_FUSION)
