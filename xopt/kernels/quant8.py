"""8-bit COAP's AdamW moment update in one pass (Triton): dequantise, update, requantise.

``state_bits=8`` keeps COAP's moments as bitsandbytes' blockwise dynamic 8-bit codes
(:func:`xopt.specs.coap.quantize`: blocks of 4096 row-major entries, a float32 absmax per
block, the 256-entry signed dynamic code book). An ordinary step reads both moments back,
takes the authors' AdamW moment update with the (projected) gradient ``r`` and the
direction ``n = m / (√v + ε)``, and stores the moments quantised again. :func:`adam_step`
does all of that for a stack of same-shaped moments in one launch: one program per block
of 4096 entries of one matrix, which dequantises its codes (``code[q] · absmax``), updates
both moments, writes ``n``, and requantises the block in registers (absmax, ``1/absmax``,
then the code of each entry) over the codes it read.

Bytes: every float operation is the torch path's (``LowRankOptimizer._hf_adam_run`` with
:func:`xopt.specs.coap.quantize` and :func:`~xopt.specs.coap.dequantize`), one IEEE
operation each, in its order: ``m·β₁ + r·(1 − β₁)``, ``v·β₂ + (r·r)·(1 − β₂)``,
``m / (√v + ε)`` and ``1 / absmax`` with correctly rounded ``sqrt_rn``/``div_rn`` (as
:func:`xopt.specs.arrays.divide`; Triton's default ``/`` and ``sqrt`` are approximate on
GPUs), and the code book search of
:func:`xopt.specs.coap.encode` (CUDA's 7-step binary search from entry 127 and its
midpoint rounding, or the CPU lookup table). The kernel launches with
``enable_fp_fusion=False`` (:data:`xopt.kernels.NO_FP_FUSION`, not ``FP_FUSION``): a
contracted ``a·b + c`` rounds once where the torch path rounds twice, and the codes must
be the same bytes. A block holding NaN gets absmax NaN and codes 0, as torch's ``amax``
propagates NaN.
Tested against the torch path under ``TRITON_INTERPRET=1`` (tests/test_coap_quant8.py).

:data:`BACKEND` (environment ``XOPT_QUANT8``, read at import): ``"auto"`` (the default:
the kernel for CUDA tensors, the torch path elsewhere; tests/test_coap_quant8.py checks its
bytes on an H200), ``"torch"`` (never) or ``"triton"`` (the kernel everywhere: the
interpreter on a CPU).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from xopt.kernels import NO_FP_FUSION
from xopt.kernels._grid import cdiv
from xopt.specs import coap as _spec

__all__ = ["BACKEND", "adam_step", "runs_on"]

#: where :func:`adam_step` replaces the torch path: "torch" (never), "auto" (CUDA tensors)
#: or "triton" (every tensor)
BACKEND = os.environ.get("XOPT_QUANT8", "auto")

_BLOCK = _spec.QUANT_BLOCK
#: one block of 4096 entries per program: 16 per thread at 8 warps
_WARPS = 8
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def runs_on(device: torch.device) -> bool:
    """Whether :func:`adam_step` is the step's path for tensors on ``device``."""
    if BACKEND not in ("auto", "triton", "torch"):
        raise ValueError(f"XOPT_QUANT8 = {BACKEND!r}; known: 'auto', 'triton', 'torch'")
    return BACKEND == "triton" or (BACKEND == "auto" and device.type == "cuda")


def _table(name: str, device: torch.device) -> torch.Tensor:
    """The code book (float32) or the CPU lookup table (int32) on ``device``, cached."""
    key = (name, device)
    if key not in _TABLES:
        src = _spec.dynamic_code() if name == "code" else _spec.cpu_lookup_table()
        _TABLES[key] = torch.as_tensor(src, device=device).contiguous()
    return _TABLES[key]


@triton.jit
def _encode(y, code_ptr, lut_ptr, CPU: tl.constexpr):
    """xopt.specs.coap.encode of float32 ``y`` (int32 code indices)."""
    if CPU:  # bitsandbytes' CPU kernel: the bin of a 65536-entry table
        c = tl.minimum(tl.maximum(y, -1.0), 1.0)
        bins = ((c + 1.0) * 0.5) * 65535.0 + 0.5
        q = tl.load(lut_ptr + bins.to(tl.int32))
    else:  # CUDA's: a 7-step binary search from entry 127, then the nearer neighbour
        pivot = tl.full(y.shape, 127, tl.int32)
        lo_p = tl.zeros(y.shape, tl.int32)
        up_p = lo_p + 255
        lower = tl.full(y.shape, -1.0, tl.float32)
        upper = tl.full(y.shape, 1.0, tl.float32)
        val = tl.load(code_ptr + pivot)
        for i in tl.static_range(7):  # steps 64, 32, ..., 1
            gt = y > val
            lo_p = tl.where(gt, pivot, lo_p)
            lower = tl.where(gt, val, lower)
            up_p = tl.where(gt, up_p, pivot)
            upper = tl.where(gt, upper, val)
            pivot = tl.where(gt, pivot + (64 >> i), pivot - (64 >> i))
            val = tl.load(code_ptr + pivot)
        upper = tl.where(up_p == 255, tl.load(code_ptr + up_p), upper)
        lower = tl.where(lo_p == 0, tl.load(code_ptr + lo_p), lower)
        gt = y > val
        mid_up = (upper + val) * 0.5
        mid_lo = (lower + val) * 0.5
        q = tl.where(gt, tl.where(y > mid_up, up_p, pivot),
                     tl.where(y < mid_lo, lo_p, pivot))
    return q


@triton.jit
def _requantize(x, mask, q_ptrs, a_ptr, code_ptr, lut_ptr, CPU: tl.constexpr):
    """Store xopt.specs.coap.quantize's codes of the block ``x`` (masked lanes are the
    zero padding) at ``q_ptrs`` and its absmax at ``a_ptr``."""
    ax = tl.where(mask, tl.abs(x), 0.0)
    has_nan = tl.max((ax != ax).to(tl.int32), axis=0) > 0
    absmax = tl.max(tl.where(ax != ax, 0.0, ax), axis=0)
    absmax = tl.where(has_nan, float("nan"), absmax)  # torch.amax propagates NaN
    nonzero = absmax > 0.0
    inv = tl.div_rn(1.0, tl.where(nonzero, absmax, 1.0))
    q = _encode(x * inv, code_ptr, lut_ptr, CPU)
    q = tl.where(nonzero, q, 0)
    tl.store(q_ptrs, q.to(tl.uint8), mask=mask)
    tl.store(a_ptr, absmax)


@triton.jit
def _adam8_kernel(mq_ptr, ma_ptr, vq_ptr, va_ptr, r_ptr, n_ptr, code_ptr, lut_ptr, N, NB,
                  b1, omb1, b2, omb2, eps, CPU: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # block pid % NB of matrix pid // NB; absmax is (B, NB)
    offs = (pid % NB) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    idx = (pid // NB).to(tl.int64) * N + offs
    qm = tl.load(mq_ptr + idx, mask=mask, other=0).to(tl.int32)
    qv = tl.load(vq_ptr + idx, mask=mask, other=0).to(tl.int32)
    # (the padding past N: zeros, as the torch path pads)
    m = tl.where(mask, tl.load(code_ptr + qm) * tl.load(ma_ptr + pid), 0.0)
    v = tl.where(mask, tl.load(code_ptr + qv) * tl.load(va_ptr + pid), 0.0)
    r = tl.load(r_ptr + idx, mask=mask, other=0.0)
    m = m * b1 + r * omb1                      # hf_adam_moments
    v = v * b2 + (r * r) * omb2
    n = tl.div_rn(m, tl.sqrt_rn(v) + eps)      # hf_adam_direction
    tl.store(n_ptr + idx, n, mask=mask)
    _requantize(m, mask, mq_ptr + idx, ma_ptr + pid, code_ptr, lut_ptr, CPU)
    _requantize(v, mask, vq_ptr + idx, va_ptr + pid, code_ptr, lut_ptr, CPU)


def adam_step(m_q: torch.Tensor, m_absmax: torch.Tensor, v_q: torch.Tensor,
              v_absmax: torch.Tensor, r: torch.Tensor, b1: float, b2: float, eps: float,
              rounding: str) -> torch.Tensor:
    """The AdamW moment update of a stack of 8-bit moments, in place, and its direction.

    Args:
      m_q, v_q: ``(B, N)`` uint8 codes, each row one tensor's (row-major) codes.
      m_absmax, v_absmax: ``(B, ceil(N / 4096))`` float32.
      r: ``(B, ...)`` float32, ``N`` entries a row: the gradients (projected).
      b1, b2, eps: the AdamW hyperparameters; rounding: ``quant_rounding``.
    Returns:
      ``n = m / (√v + ε)`` of the updated float32 moments, ``r``'s shape; the codes and
      absmax now hold the updated moments quantised.
    """
    if rounding not in ("cuda", "cpu"):
        raise ValueError(f"quant8.adam_step: rounding = {rounding!r}; known: 'cuda', 'cpu'")
    batch, n_el = m_q.shape
    nb = cdiv(n_el, _BLOCK)
    for name, x, dtype, shape in (("m_q", m_q, torch.uint8, (batch, n_el)),
                                  ("v_q", v_q, torch.uint8, (batch, n_el)),
                                  ("m_absmax", m_absmax, torch.float32, (batch, nb)),
                                  ("v_absmax", v_absmax, torch.float32, (batch, nb))):
        if x.dtype != dtype or tuple(x.shape) != shape or not x.is_contiguous():
            raise ValueError(f"quant8.adam_step: {name} must be a contiguous {dtype} tensor "
                             f"of shape {shape}, got {x.dtype} {tuple(x.shape)}")
    if r.dtype != torch.float32 or r.numel() != batch * n_el or r.shape[0] != batch:
        raise ValueError(f"quant8.adam_step: r must be float32 with {n_el} entries in each "
                         f"of {batch} rows, got {r.dtype} {tuple(r.shape)}")
    r = r.contiguous()
    n = torch.empty_like(r)
    device = r.device
    _adam8_kernel[(batch * nb,)](
        m_q, m_absmax, v_q, v_absmax, r, n, _table("code", device), _table("lut", device),
        n_el, nb, float(b1), 1.0 - b1, float(b2), 1.0 - b2, float(eps),
        CPU=rounding == "cpu", BLOCK=_BLOCK, num_warps=_WARPS, **NO_FP_FUSION)
    return n
