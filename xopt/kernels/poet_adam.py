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
Each float32 operation is rounded as ATen's CUDA kernels round it (a fused multiply-add
where they compute ``a + α·b`` in one expression).

Reference: :func:`xopt.torch.poet`'s foreach update (tested against it under
``TRITON_INTERPRET=1``; on a GPU ``bench/poet_layer.py --check`` compares them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xopt.kernels import FP_FUSION
from xopt.kernels._grid import cdiv
from xopt.kernels.poet_jit import launch

__all__ = ["BLOCK", "adam_update"]

#: elements per program (4 warps, 8 per thread: 16-byte float32 accesses)
BLOCK = 1024


@triton.jit
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, b1, omb1, b2, omb2, eps, neg_step, decay,
                 DECAY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    m = m * b1
    m = m + omb1 * g
    v = v * b2
    v = v + (omb2 * g) * g
    d = tl.sqrt_rn(v) + eps
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = p + neg_step * tl.div_rn(m, d)
    if DECAY:
        p = p + decay * p
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)


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
           num_warps=4, **FP_FUSION)
