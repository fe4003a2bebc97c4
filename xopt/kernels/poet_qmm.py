"""POET-XQ's products with the 8-bit ``W0``, dequantised inside the matmul (Triton).

``W0`` (``out × in``) is held as uint8 codes with a scale and a zero point per group of
``group_size`` consecutive row-major elements (:func:`xopt.specs.poet.quantize_weight`,
the authors' format). The layer needs two products with it:

* forward (and mem's recomputation): ``y1 = x2 · W0ᵀ`` (:func:`matmul_wt`);
* backward: ``gx2 = gy1 · W0`` (:func:`matmul_w`).

The kernel loads a tile of codes with the scales and zero points of its elements'
groups, dequantises it in registers exactly as :func:`xopt.specs.poet.dequantize_weight`
(``(code − zero) · scale`` in the activation's dtype: an integer ≤ 255 times the scale
rounded to that dtype is one rounding, so the tile holds the plain path's values bit for
bit) and accumulates ``tl.dot`` in float32: no float ``W0`` is ever written to memory.
The products differ from the plain path (dequantise, then ``torch.mm``) by the order of
the float32 accumulation only. Tested under ``TRITON_INTERPRET=1`` (tests/test_poet_xq.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xopt.kernels import FP_FUSION, interpreting
from xopt.kernels._grid import cdiv
from xopt.kernels.poet_jit import launch

__all__ = ["matmul_w", "matmul_wt", "reference"]

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _rounded(x, DT: tl.constexpr, PREC: tl.constexpr):
    """float32 ``x`` rounded to ``DT`` (round half to even). The interpreter's float32 →
    bfloat16 conversion does not round to nearest, so there (``PREC == "upcast"``) bf16
    rounding is done on the bits and the value stays in float32."""
    if PREC == "upcast":
        if DT == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        return x.to(DT).to(tl.float32)
    return x.to(DT)


@triton.jit
def _qmm_kernel(a_ptr, q_ptr, s_ptr, z_ptr, out_ptr, N, M, K, IN, s_a, s_o, GS: tl.constexpr,
                TRANS_W: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[n, m] = Σ_k a[n, k] · B[k, m], B = W0ᵀ (TRANS_W: W0 is m × k) or W0 (k × m)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    cmask = cols < M
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        k64 = ks.to(tl.int64)
        a = tl.load(a_ptr + r64[:, None] * s_a + k64[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        if TRANS_W:  # B[k, m] = W0[m, k]
            flat = c64[None, :] * IN + k64[:, None]
        else:  # B[k, m] = W0[k, m]
            flat = k64[:, None] * IN + c64[None, :]
        wmask = kmask[:, None] & cmask[None, :]
        code = tl.load(q_ptr + flat, mask=wmask, other=0)
        group = flat // GS
        scale = _rounded(tl.load(s_ptr + group, mask=wmask, other=0.0).to(tl.float32), DT,
                         PREC).to(tl.float32)
        zero = _rounded(tl.load(z_ptr + group, mask=wmask, other=0.0).to(tl.float32), DT,
                        PREC).to(tl.float32)
        # dequantize_weight in the activation's dtype: code − zero is an exact integer and
        # its product with the rounded scale exact in float32, so one rounding to DT gives
        # the value the dtype's own arithmetic gives
        w = _rounded((code.to(tl.float32) - zero) * scale, DT, PREC)
        if PREC == "upcast":  # the interpreter's tl.dot misreads bf16/fp16: exact upcast
            acc = tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a.to(DT), w.to(DT), acc, input_precision=PREC)
    if PREC == "upcast":
        acc = _rounded(acc, DT, PREC)
    tl.store(out_ptr + r64[:, None] * s_o + c64[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


def _launch(a: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            group_size: int, trans_w: bool, tf32: bool = False) -> torch.Tensor:
    if a.dim() != 2 or a.stride(1) != 1:
        a = a.reshape(-1, a.shape[-1]).contiguous()
    out_f, in_f = codes.shape
    n, k = a.shape
    m = out_f if trans_w else in_f
    if k != (in_f if trans_w else out_f):
        raise ValueError(f"poet_qmm: activation width {k} does not match W0 {tuple(codes.shape)}")
    codes = codes.contiguous()
    scales = scales.reshape(-1).contiguous()
    zeros = zeros.reshape(-1).contiguous()
    out = torch.empty(n, m, device=a.device, dtype=a.dtype)
    # GPU tiles of Triton's matmul tutorial (the dequantisation rides in the K loop), K halved
    # for float32 to stay inside the shared memory; small tiles keep the interpreter quick
    if interpreting():
        bn, bm, bk, warps, stages = 32, 32, 32, 4, 1
    else:
        bn, bm, bk, warps, stages = 128, 128, 64 if a.element_size() <= 2 else 32, 8, 3
    if interpreting() and a.dtype != torch.float32:
        prec = "upcast"
    else:
        prec = "tf32" if tf32 and a.dtype == torch.float32 else "ieee"
    grid = (cdiv(n, bn), cdiv(m, bm))
    launch(_qmm_kernel, grid, a, codes, scales, zeros, out, n, m, k, in_f, a.stride(0),
           out.stride(0), GS=group_size, TRANS_W=trans_w, DT=_TL_DTYPE[a.dtype], PREC=prec,
           BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, num_warps=warps, num_stages=stages,
           **FP_FUSION)
    return out


def matmul_wt(a, codes, scales, zeros, group_size: int, tf32: bool = False) -> torch.Tensor:
    """``a · W0ᵀ`` for ``a`` of width ``in`` (the forward's product)."""
    return _launch(a, codes, scales, zeros, group_size, True, tf32)


def matmul_w(a, codes, scales, zeros, group_size: int, tf32: bool = False) -> torch.Tensor:
    """``a · W0`` for ``a`` of width ``out`` (the backward's product)."""
    return _launch(a, codes, scales, zeros, group_size, False, tf32)


def reference(a, codes, scales, zeros, group_size: int, transpose: bool) -> torch.Tensor:
    """The plain path: dequantise into a temporary, then one matmul."""
    from xopt.specs.poet import dequantize_weight

    w = dequantize_weight(codes, scales, zeros, group_size, a.dtype, xp=torch)
    return a @ w.T if transpose else a @ w
