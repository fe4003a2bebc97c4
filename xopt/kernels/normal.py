"""xopt's portable normal (:func:`xopt.random.normal_many`) in one Triton launch.

:func:`normal_many` returns the bits of ``xopt.random.normal_many(seeds, shape,
counter=counter, dtype=dtype, backend="torch", device=device)``: the same Threefry-2x32-20
blocks, uniforms and Box-Muller transform, computed with the same operations in the same
order (see :mod:`xopt.random`'s docstring), by one program per tile of pairs of one seed's
row, every seed of the call in one launch (up to 65535 seeds). The torch backend spends
about 800 elementwise kernels on it; Flora with compressed momentum redraws its
projections every step.

Bit identity rests on the reference's own choices, kept here:

* Threefry, the uniforms' bit arithmetic, the carry into the counter's high word and the
  float/bit reinterpretations are integer operations (``uint32`` words; ``uint32`` float32
  patterns, ``uint64`` float64 ones), exact on every device.
* The reference's division and square root are IEEE's, correctly rounded (its integer long
  division and digit-by-digit root compute them without trusting a framework's), so the
  kernel uses the GPU's correctly rounded ones: ``tl.div_rn`` and ``tl.sqrt_rn`` in float32
  (PTX ``div.rn.f32``, ``sqrt.rn.f32``), ``/`` and ``tl.sqrt`` in float64 (``div.rn.f64``,
  ``sqrt.rn.f64``; Triton's ``_rn`` functions take float32 only); NumPy's under the
  interpreter. Their operands and results are normal numbers (``|f / (f + 2)| >= 2**-25``
  or 0; the root's radicand 0 or ``>= 2**-23``, float32; far smaller bounds hold in
  float64), where all correct roundings agree and flush-to-zero would have nothing to flush.
* The float steps (``log``'s and the quarter-wave polynomials' products and sums, Box-Muller's
  products) are single IEEE operations rounded to nearest, each rounded apart: the launch
  passes ``enable_fp_fusion=False`` (:data:`xopt.kernels.NO_FP_FUSION`), because a GPU
  compile otherwise contracts ``c + z·a`` into one FMA, which rounds once where the
  reference rounds twice (the jax backend's ``fence`` exists for the same reason). No
  Triton ``log``, ``sin`` or ``cos`` is used, nor float32 ``/`` or ``sqrt``: on GPUs these
  are approximate.
* Constants are the reference's (xopt.random's per-format tables), each exactly
  representable in its format; Triton materialises a Python float operand of arithmetic
  directly in the other operand's type, so float64 constants are not rounded through
  float32 (the one compared with, sqrt 2, is made an FT tensor first).
* Subnormals never arise (see :mod:`xopt.random`), so flush-to-zero cannot change a bit.

Tested bit for bit against the torch backend under ``TRITON_INTERPRET=1``
(tests/test_kernels_normal.py), which also compiles the kernel for an sm_90 GPU without one
and checks what the interpreter cannot: round-to-nearest float operations only, one
``div.rn`` and one ``sqrt.rn`` per pair, no fused multiply-add or approximate instruction
in the machine code but those of ptxas's own correctly rounded division and root, unsigned
shifts and comparisons of the words, every constant at its exact bits. On a GPU the same
tests run the compiled kernel.

:data:`BACKEND` (environment ``XOPT_NORMAL``, read at import): ``"auto"`` (the default:
CUDA tensors), ``"torch"`` (never: ``xopt.random``'s torch ops) or ``"triton"`` (every
tensor: the interpreter on a CPU). :func:`runs_on` says which a device gets.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from xopt import random as xrandom
from xopt.kernels import NO_FP_FUSION
from xopt.kernels._grid import cdiv

__all__ = ["BACKEND", "normal_many", "runs_on"]

#: where :func:`normal_many` replaces ``xopt.random``'s torch ops in xopt's optimizers:
#: "torch" (never), "auto" (CUDA tensors) or "triton" (every tensor)
BACKEND = os.environ.get("XOPT_NORMAL", "auto")

#: pairs of normals per program: 512 over 4 warps, four per thread (a program's set-up
#: shared by four pairs; few registers, no spills)
_PAIRS, _WARPS = 512, 4

#: rows (seeds) per launch: a grid's second dimension holds at most 65535 programs
_GRID_Y = 65535

#: numbers per row from which a tile's offsets are 64-bit (below, 32-bit ones cannot overflow)
_WIDE_FROM = 2**31 - 2 * _PAIRS


def runs_on(device: torch.device) -> bool:
    """Whether :func:`normal_many` is the draw's path for tensors on ``device``."""
    if BACKEND not in ("auto", "triton", "torch"):
        raise ValueError(f"XOPT_NORMAL = {BACKEND!r}; known: 'auto', 'triton', 'torch'")
    return BACKEND == "triton" or (BACKEND == "auto" and torch.device(device).type == "cuda")


# ----------------------------------------------------------------------------------------
# The reference's steps, one helper each (xopt/random.py: _threefry_core, _div, _sqrt, _log,
# _sin_cos_quarter, _cos_sin_turns). FT/UT: the float format and its bit-pattern type.
# ----------------------------------------------------------------------------------------


@triton.jit
def _neg(x):
    """``-x`` with IEEE's sign of zero (``-(+0) = -0``), as the reference negates: Triton
    before 3.9 lowers unary minus to ``0 - x``, which gives ``+0``."""
    return x * -1.0


@triton.jit
def _rotl(x, R: tl.constexpr):
    return (x << R) | (x >> (32 - R))


@triton.jit
def _four_rounds(x0, x1, RA: tl.constexpr, RB: tl.constexpr, RC: tl.constexpr,
                 RD: tl.constexpr):
    x0 = x0 + x1
    x1 = _rotl(x1, RA) ^ x0
    x0 = x0 + x1
    x1 = _rotl(x1, RB) ^ x0
    x0 = x0 + x1
    x1 = _rotl(x1, RC) ^ x0
    x0 = x0 + x1
    x1 = _rotl(x1, RD) ^ x0
    return x0, x1


@triton.jit
def _threefry(k0, k1, x0, x1):
    """Threefry-2x32-20 on uint32 words (xopt.random._threefry_core)."""
    k2 = k0 ^ k1 ^ 0x1BD11BDA
    x0 = x0 + k0
    x1 = x1 + k1
    for s in tl.static_range(1, 6):  # five groups of four rounds, then key injection s
        if s % 2 == 1:
            x0, x1 = _four_rounds(x0, x1, 13, 15, 26, 6)
        else:
            x0, x1 = _four_rounds(x0, x1, 17, 29, 16, 24)
        if s % 3 == 0:
            x0 = x0 + k0
            x1 = x1 + k1 + s
        elif s % 3 == 1:
            x0 = x0 + k1
            x1 = x1 + k2 + s
        else:
            x0 = x0 + k2
            x1 = x1 + k0 + s
    return x0, x1


@triton.jit
def _blocks(k0, k1, c_hi, c_lo, b):
    """Blocks ``counter + b`` (``b`` uint32): the low word wraps, its carry goes high."""
    lo = b + c_lo
    hi = c_hi + (lo < c_lo).to(tl.uint32)
    return _threefry(k0, k1, hi, lo)


@triton.jit
def _horner(z, C: tl.constexpr):
    """``C[0] + z·(C[1] + z·(C[2] + ...))``, innermost first, each step rounded apart."""
    acc = z * C[len(C) - 1]
    for k in tl.static_range(len(C) - 2, 0, -1):
        acc = z * (C[k] + acc)
    return C[0] + acc


@triton.jit
def _div_rn(a, b):
    """Correctly rounded ``a / b``: ``div_rn`` for float32; float64 division lowers to
    PTX's ``div.rn.f64`` (Triton's ``div_rn`` takes float32 only)."""
    if a.dtype == tl.float64:
        return a / b
    else:
        return tl.div_rn(a, b)


@triton.jit
def _sqrt_rn(x):
    """Correctly rounded ``sqrt(x)``: ``sqrt_rn`` for float32, ``sqrt`` (PTX's
    ``sqrt.rn.f64``) for float64."""
    if x.dtype == tl.float64:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


@triton.jit
def _log(x, FT: tl.constexpr, UT: tl.constexpr, MB: tl.constexpr, BIAS: tl.constexpr,
         SQRT2: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr,
         LOG_C: tl.constexpr):
    """Natural log of positive normal ``x`` (xopt.random._log)."""
    i = x.to(UT, bitcast=True)
    m = ((i & ((1 << MB) - 1)) | (BIAS << MB)).to(FT, bitcast=True)
    ef = (i >> MB).to(FT) - BIAS * 1.0
    # the constant as an FT tensor: Triton before 3.9 types a comparison's Python float as
    # float32 (sqrt2 would round); arithmetic operands take the tensor's type in every version
    big = m > tl.full([], SQRT2, FT)
    m = tl.where(big, m * 0.5, m)
    ef = tl.where(big, ef + 1.0, ef)
    f = m - 1.0
    s = _div_rn(f, f + 2.0)
    z = s * s
    r = z * _horner(z, LOG_C)
    h = (f * f) * 0.5
    t = s * (h + r) + ef * LN2_LO
    return ef * LN2_HI + (f - (h - t))


@triton.jit
def _cos_sin_turns(u, SIN_HI: tl.constexpr, SIN_LO: tl.constexpr, SIN_C: tl.constexpr,
                   COS_C: tl.constexpr):
    """``(cos(2πu), sin(2πu))`` for ``u`` in [0, 1) (xopt.random._cos_sin_turns)."""
    t = u * 4.0
    q = tl.floor(t)
    f = t - q
    upper = f > 0.5
    g = tl.where(upper, 1.0 - f, f)
    z = g * g
    ps = SIN_HI + (SIN_LO + z * _horner(z, SIN_C))
    s = g * ps
    c = 1.0 + z * _horner(z, COS_C)
    sin_f = tl.where(upper, c, s)
    cos_f = tl.where(upper, s, c)
    cos = tl.where(q == 0.0, cos_f, tl.where(q == 1.0, _neg(sin_f),
                                             tl.where(q == 2.0, _neg(cos_f), sin_f)))
    sin = tl.where(q == 0.0, sin_f, tl.where(q == 1.0, cos_f,
                                             tl.where(q == 2.0, _neg(sin_f), _neg(cos_f))))
    return cos, sin


@triton.jit
def _normal_kernel(words_ptr, out_ptr, n, row0,
                   F64: tl.constexpr, MB: tl.constexpr, BIAS: tl.constexpr,
                   SQRT2: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr,
                   LOG_C: tl.constexpr, SIN_HI: tl.constexpr, SIN_LO: tl.constexpr,
                   SIN_C: tl.constexpr, COS_C: tl.constexpr, PAIRS: tl.constexpr,
                   WIDE: tl.constexpr):
    """Pairs of tile ``program_id(0)`` of row ``row0 + program_id(1)``: ``out[row, 2p]``
    the cosine, ``out[row, 2p + 1]`` the sine. ``words``: the counter's (hi, lo), then each
    row's key. ``WIDE``: a row's offsets need 64 bits (``n >= _WIDE_FROM``)."""
    FT: tl.constexpr = tl.float64 if F64 else tl.float32
    UT: tl.constexpr = tl.uint64 if F64 else tl.uint32
    tile = tl.program_id(0)
    row = row0 + tl.program_id(1)
    hi = tl.load(words_ptr).to(tl.uint32)
    lo = tl.load(words_ptr + 1).to(tl.uint32)
    k0 = tl.load(words_ptr + 2 + 2 * row).to(tl.uint32)
    k1 = tl.load(words_ptr + 3 + 2 * row).to(tl.uint32)
    pw = tile.to(tl.uint32) * PAIRS + tl.arange(0, PAIRS).to(tl.uint32)  # pair index < 2**32
    if F64:
        # pair p reads blocks 2p and 2p + 1: each gives one 53-bit uniform
        a0, a1 = _blocks(k0, k1, hi, lo, pw * 2)
        b0, b1 = _blocks(k0, k1, hi, lo, pw * 2 + 1)
        u_even = ((a0 >> 5).to(FT) * 67108864.0 + (a1 >> 6).to(FT)) * (2.0 ** -53)
        u_odd = ((b0 >> 5).to(FT) * 67108864.0 + (b1 >> 6).to(FT)) * (2.0 ** -53)
    else:
        y0, y1 = _blocks(k0, k1, hi, lo, pw)  # pair p reads block p: one 24-bit uniform each
        u_even = (y0 >> 8).to(FT) * (2.0 ** -24)
        u_odd = (y1 >> 8).to(FT) * (2.0 ** -24)
    u1 = 1.0 - u_even
    lg = _log(u1, FT, UT, MB, BIAS, SQRT2, LN2_HI, LN2_LO, LOG_C)
    r = _sqrt_rn(tl.abs(lg * -2.0))  # abs: -0.0 (u1 == 1) to +0
    cos, sin = _cos_sin_turns(u_odd, SIN_HI, SIN_LO, SIN_C, COS_C)
    if WIDE:
        base = out_ptr + row.to(tl.int64) * n + tile.to(tl.int64) * (2 * PAIRS)
        left = n - tile.to(tl.int64) * (2 * PAIRS)
    else:
        base = out_ptr + row.to(tl.int64) * n + tile * (2 * PAIRS)
        left = n - tile * (2 * PAIRS)
    even = 2 * tl.arange(0, PAIRS)  # two stores: an interleaving join goes through shared memory
    tl.store(base + even, r * cos, mask=even < left)
    tl.store(base + even + 1, r * sin, mask=even + 1 < left)


_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@functools.cache
def _constants(dtype: str) -> dict:
    """The kernel's compile-time constants: the reference's format table for ``dtype``."""
    fmt = xrandom._FORMATS[dtype]
    return dict(F64=dtype == "float64", MB=fmt.mant_bits, BIAS=fmt.bias, SQRT2=fmt.sqrt2,
                LN2_HI=fmt.ln2_hi, LN2_LO=fmt.ln2_lo, LOG_C=tuple(fmt.log_coeffs),
                SIN_HI=fmt.sin_hi, SIN_LO=fmt.sin_lo, SIN_C=tuple(fmt.sin_tail),
                COS_C=tuple(fmt.cos_tail))


@torch.compiler.disable  # a launch with its own options, not for Inductor to re-generate
def normal_many(seeds, shape, *, counter: int = 0, dtype="float32",
                device: torch.device | str | None = None) -> torch.Tensor:
    """``xopt.random.normal_many(seeds, shape, counter=counter, dtype=dtype,
    backend="torch", device=device)``, bit for bit, in one launch.

    Args and errors as :func:`xopt.random.normal_many` (the same checks and messages);
    ``device`` defaults to the CPU (where Triton runs only under its interpreter).

    Returns:
      ``(len(seeds), *shape)`` tensor of ``dtype`` on ``device``.
    """
    dims, keys, c_hi, c_lo, dtype = xrandom._normal_many_args(seeds, shape, counter, dtype)
    out_dtype = _DTYPES[dtype]
    device = torch.device("cpu" if device is None else device)
    rows, n = len(keys), 1
    for d in dims:
        n *= d
    out = torch.empty((rows, *dims), dtype=out_dtype, device=device)
    if n == 0:
        return out
    words = torch.tensor([c_hi, c_lo, *(w for key in keys for w in key)], dtype=torch.int64)
    if device.type == "cuda":  # a copy from pageable memory would wait for the stream
        words = words.pin_memory()
    words = words.to(device, non_blocking=True)
    tiles = cdiv((n + 1) // 2, _PAIRS)  # < 2**31: a draw has at most 2**32 pairs
    for row0 in range(0, rows, _GRID_Y):
        _normal_kernel[(tiles, min(rows - row0, _GRID_Y))](
            words, out, n, row0, PAIRS=_PAIRS, WIDE=n >= _WIDE_FROM,
            num_warps=_WARPS, **_constants(dtype), **NO_FP_FUSION)
    return out
