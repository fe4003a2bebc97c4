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
one launch: a table of their and their moments' addresses on the device (made once per set
of addresses and kept), the gradients' addresses copied with the launch (a step's gradients
need not have the last step's addresses), each program finding its tensor and tile; the same
per-element operations, so the same bits as :func:`adam_update` on each. An optimizer step
of a few hundred parameters is then a few launches rather than one per parameter (their host
time was most of POETAdamW's step in the 350M training step, bench/RESULTS.md).

Reference: :func:`xopt.torch.poet`'s foreach update (tested against it under
``TRITON_INTERPRET=1``; on a GPU ``bench/poet_layer.py --check`` compares them).
"""

from __future__ import annotations

import functools
import operator

import torch
import triton
import triton.language as tl

from xopt.kernels import NO_FP_FUSION
from xopt.kernels._grid import cdiv
from xopt.kernels._tables import at, block_map
from xopt.kernels.poet_jit import launch

__all__ = ["BLOCK", "adam_update", "adam_update_many"]

#: elements per program and its warps: 4 elements per thread (one 16-byte access to each
#: float32 moment), the fastest of the tilings measured on an H200 (8 per thread took 1.6×
#: as long); the tiling changes no element's arithmetic
BLOCK = 1024
NUM_WARPS = 8


@triton.jit
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, b1, omb1, b2, omb2, eps, neg_step, decay,
                 DECAY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _adam_tile(p_ptr + offs, g_ptr + offs, m_ptr + offs, v_ptr + offs, offs < n, b1, omb1,
               b2, omb2, eps, neg_step, decay, DECAY)


@triton.jit
def _adam_many_kernel(table_ptr, grads_ptr, tile_ptr, n_tensors, p0_ptr, g0_ptr, b1, omb1, b2,
                      omb2, eps, neg_step, decay, DECAY: tl.constexpr, ALIGNED: tl.constexpr,
                      BLOCK: tl.constexpr):
    # table: rows p, m, v (addresses) and numel, n_tensors columns each; grads: the
    # gradients' addresses; tiles: two int32 rows, each program's tensor and its tile
    pid = tl.program_id(0)
    t = tl.load(tile_ptr + pid).to(tl.int64)
    j = tl.load(tile_ptr + tl.num_programs(0) + pid).to(tl.int64)
    n = tl.load(table_ptr + 3 * n_tensors + t)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    pp = at(tl.load(table_ptr + t).to(p0_ptr.dtype), offs, ALIGNED, BLOCK)
    gp = at(tl.load(grads_ptr + t).to(g0_ptr.dtype), offs, ALIGNED, BLOCK)
    mp = at(tl.load(table_ptr + n_tensors + t).to(tl.pointer_type(tl.float32)), offs,
             ALIGNED, BLOCK)
    vp = at(tl.load(table_ptr + 2 * n_tensors + t).to(tl.pointer_type(tl.float32)), offs,
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
           num_warps=NUM_WARPS, **NO_FP_FUSION)


#: (device, parameter dtype, the parameters' and moments' addresses and sizes) -> (table,
#: aligned) and (device, sizes, BLOCK) -> tiles: the launch's device-side lists, made once
#: per set of addresses (an optimizer's parameters and moments are the same every step).
#: The gradients' addresses are not in them: the caching allocator need not hand a step's
#: gradients the last step's addresses (in the 350M training step it did not), and a table
#: made again costs host time and a copy that waits for the device; they go to the device
#: with each launch instead (8 bytes a tensor, without waiting).
_TABLES: dict = {}
_TILES: dict = {}
_TABLES_MAX = 64

_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_contiguous = torch.Tensor.is_contiguous
_device_index = torch.Tensor.get_device
_dtype = operator.attrgetter("dtype")
_shape = operator.attrgetter("shape")


def _state_table(ps, ms, vs, sizes) -> tuple[torch.Tensor, bool] | None:
    """The device table of the parameters' and moments' addresses and the sizes (``sizes``:
    the parameters' numels), and whether those addresses are 16-byte aligned; None where a
    tensor is not as :func:`supported` says or not on the first parameter's device (checked
    when the table is made: its key holds every address and size it was checked for)."""
    pp, mp, vp = tuple(map(_ptr, ps)), tuple(map(_ptr, ms)), tuple(map(_ptr, vs))
    key = (ps[0].device, ps[0].dtype, pp, mp, vp, sizes, tuple(map(_numel, ms)),
           tuple(map(_numel, vs)))
    hit = _TABLES.get(key)
    if hit is not None:
        return hit
    dev, pdt = ps[0].device, ps[0].dtype
    if not all(supported(p, p, m, v) and p.dtype == pdt and p.device == m.device == v.device == dev
               for p, m, v in zip(ps, ms, vs, strict=True)):
        return None
    table = torch.tensor([*pp, *mp, *vp, *sizes], dtype=torch.int64)
    hit = (table.to(dev), not functools.reduce(operator.or_, (*pp, *mp, *vp)) % 16)
    if len(_TABLES) >= _TABLES_MAX:
        _TABLES.clear()
    _TABLES[key] = hit
    return hit


def _tiles(device: torch.device, sizes: tuple[int, ...]) -> torch.Tensor:
    """Each program's tensor and tile (block_map's two rows, one int32 tensor on ``device``)."""
    key = (device, sizes, BLOCK)
    hit = _TILES.get(key)
    if hit is None:
        which, within = block_map(list(sizes), BLOCK)
        hit = torch.cat((which, within)).to(device)
        if len(_TILES) >= _TABLES_MAX:
            _TILES.clear()
        _TILES[key] = hit
    return hit


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, copied without waiting for the device
    (from pinned memory, which torch's host allocator keeps until the copy has run)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device,
                                                                        non_blocking=True)


def adam_update_many(ps, gs, ms, vs, b1: float, b2: float, eps: float, step_size: float,
                     decay: float | None, *, shapes_checked: bool = False) -> bool:
    """:func:`adam_update` of each ``(p, g, m, v)`` of the lists in one launch (module
    docstring), the same bits as one :func:`adam_update` each; True. Where the tensors are
    not as :func:`supported` says, or not all on one device, the parameters of one dtype
    and the gradients of one dtype, or while a CUDA graph is captured (the gradients'
    addresses are copied from a buffer a replay would not own): False, and nothing was
    done. ``shapes_checked``: the caller has checked that each gradient has its parameter's
    shape (an optimizer's step validation), so that it is not compared again here."""
    if not ps:
        return True
    dev = ps[0].device
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    grad_dtypes = set(map(_dtype, gs))
    if not (len(grad_dtypes) == 1 and grad_dtypes <= _DTYPES
            and set(map(_device_index, gs)) == {ps[0].get_device()}
            and all(map(_contiguous, gs)) and all(map(_contiguous, ps))
            and (shapes_checked or list(map(_shape, gs)) == list(map(_shape, ps)))):
        return False
    sizes = tuple(map(_numel, ps))
    found = _state_table(ps, ms, vs, sizes)
    if found is None:
        return False
    table, aligned = found
    tiles = _tiles(dev, sizes)  # (none for an empty tensor)
    if not tiles.numel():
        return True
    gp = list(map(_ptr, gs))
    aligned = aligned and not functools.reduce(operator.or_, gp) % 16
    launch(_adam_many_kernel, (tiles.numel() // 2,), table, _on_device(gp, dev), tiles,
           len(ps), ps[0], gs[0], b1, 1.0 - b1, b2, 1.0 - b2, eps, -step_size,
           0.0 if decay is None else decay, DECAY=decay is not None, ALIGNED=aligned,
           BLOCK=BLOCK, num_warps=NUM_WARPS, **NO_FP_FUSION)
    return True
