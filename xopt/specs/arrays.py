"""Array-namespace helpers that let one pure function run under NumPy, torch and jax.numpy.

The spec's math is written against the operations the three namespaces share (arithmetic,
``sqrt``, ``maximum``, ``where``). A few updates are, in torch.optim, single fused kernels
whose rounding differs from the same formula written out (``lerp`` picks its formula by
the weight; ``addcmul``/``addcdiv`` may be compiled with fused multiply-adds). To reproduce
torch.optim bit for bit, these helpers call torch's own kernel when given torch tensors and
write the formula out, in torch's evaluation order, everywhere else. Under NumPy float64
(the oracle) the difference is far below float32 rounding.

No framework is imported here: the namespace is recognised from the array's type.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import numpy as np


def namespace(x: Any) -> ModuleType:
    """The array namespace of ``x``: ``numpy``, ``torch`` or ``jax.numpy``."""
    module = type(x).__module__
    if module.startswith("torch"):
        import torch

        return torch
    if module.startswith(("jax", "jaxlib")):
        import jax.numpy as jnp

        return jnp
    return np


def is_torch(xp: ModuleType) -> bool:
    return xp.__name__ == "torch"


def constant(xp: ModuleType, values: Any, like: Any, dtype: Any = None) -> Any:
    """Host numbers ``values`` as an array of ``like``'s dtype (or ``dtype``), on ``like``'s
    device under torch. Rounded as NumPy casts (float64 → ``dtype``, to nearest). On a CUDA
    device the copy goes through pinned memory without blocking: a pageable host→device
    copy first waits for everything queued on the stream (in training, the backward)."""
    dt = like.dtype if dtype is None else dtype
    if is_torch(xp):
        return to_device(xp.as_tensor(np.asarray(values), dtype=dt), like.device)
    return xp.asarray(np.asarray(values), dtype=dt)


def to_device(t: Any, device: Any) -> Any:
    """A torch tensor on ``device`` without blocking the host: a host tensor goes to a CUDA
    device from pinned memory, non-blocking (a pageable copy waits for every kernel queued
    before it; in training, the whole backward pass)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def lerp(xp: ModuleType, start: Any, end: Any, weight: float) -> Any:
    """``start + weight * (end - start)``, as ``torch.lerp`` computes it under torch.

    torch.lerp uses ``end - (end - start) * (1 - weight)`` when ``|weight| >= 0.5``; the
    written-out branch mirrors that so both branches round alike in float32.
    """
    if is_torch(xp):
        return xp.lerp(start, end, weight)
    if isinstance(weight, (int, float)):
        if abs(weight) < 0.5:
            return start + weight * (end - start)
        return end - (end - start) * (1 - weight)
    # a traced or array weight (jax under inject_hyperparams): both branches, selected
    return xp.where(abs(weight) < 0.5, start + weight * (end - start),
                    end - (end - start) * (1 - weight))


def addcmul(xp: ModuleType, x: Any, t1: Any, t2: Any, value: float) -> Any:
    """``x + value * t1 * t2`` (torch.addcmul under torch)."""
    if is_torch(xp):
        return xp.addcmul(x, t1, t2, value=value)
    return x + value * t1 * t2


def addcdiv(xp: ModuleType, x: Any, t1: Any, t2: Any, value: float) -> Any:
    """``x + value * t1 / t2`` (torch.addcdiv under torch)."""
    if is_torch(xp):
        return xp.addcdiv(x, t1, t2, value=value)
    return x + value * t1 / t2


def is_static_zero(x: Any) -> bool:
    """True when ``x`` is a Python number equal to zero (never true for a traced value)."""
    return isinstance(x, (int, float)) and x == 0


# -- reductions and elementwise ops under their per-namespace names --------------------------
# torch spells ``axis``/``keepdims`` as ``dim``/``keepdim`` and reduces over *every* axis when
# given ``dim=()``; the helpers below take NumPy's spelling and treat an empty ``axes`` as "no
# reduction", which is what NumPy and jax.numpy do and what the learned optimizers rely on
# for 0-d parameters (PyLO's torch port does not, which is one of its departures).


def mean(xp: ModuleType, x: Any, axes: tuple[int, ...], keepdims: bool = False) -> Any:
    """Mean over ``axes`` (an empty tuple reduces nothing and returns ``x``)."""
    axes = tuple(axes)
    if not axes:
        return x
    if is_torch(xp):
        return x.mean(dim=axes, keepdim=keepdims)
    return xp.mean(x, axis=axes, keepdims=keepdims)


def amax(xp: ModuleType, x: Any, axis: int, keepdims: bool = False) -> Any:
    if is_torch(xp):
        return x.amax(dim=axis, keepdim=keepdims)
    return xp.max(x, axis=axis, keepdims=keepdims)


def rsqrt(xp: ModuleType, x: Any) -> Any:
    """``1/sqrt(x)``: ``torch.rsqrt``, ``jax.lax.rsqrt``, or written out under NumPy."""
    if is_torch(xp):
        return xp.rsqrt(x)
    if xp.__name__.startswith("jax"):
        import jax

        return jax.lax.rsqrt(x)
    return 1.0 / xp.sqrt(x)


def clip(xp: ModuleType, x: Any, lo: Any, hi: Any) -> Any:
    if is_torch(xp):
        return xp.clamp(x, lo, hi)
    return xp.clip(x, lo, hi)


def expand_dims(xp: ModuleType, x: Any, axis: int) -> Any:
    if is_torch(xp):
        return x.unsqueeze(axis)
    return xp.expand_dims(x, axis)


def concat(xp: ModuleType, xs: list[Any], axis: int = -1) -> Any:
    if is_torch(xp):
        return xp.cat(xs, dim=axis)
    return xp.concatenate(xs, axis=axis)


def relu(xp: ModuleType, x: Any) -> Any:
    """``max(x, 0)`` (``jax.nn.relu``'s definition)."""
    if is_torch(xp):
        return xp.relu(x)
    return xp.maximum(x, 0)


def sigmoid(xp: ModuleType, x: Any) -> Any:
    """The logistic function: ``torch.sigmoid``, ``jax.nn.sigmoid``, or ``1/(1+exp(-x))``."""
    if is_torch(xp):
        return xp.sigmoid(x)
    if xp.__name__.startswith("jax"):
        import jax

        return jax.nn.sigmoid(x)
    return 1.0 / (1.0 + xp.exp(-x))


# -- exp and log that agree with XLA's and torch's under NumPy float32 -----------------------
# NumPy's SIMD float32 ``exp`` is not correctly rounded; on the learned optimizers' decays
# (``1 - exp(10 * (log(1 - d) / 10 + θ))``) it lands an ulp away from XLA's and torch's,
# which there agree with the correctly rounded value. Under NumPy, float32 and float16
# arguments are therefore evaluated in float64 and rounded once. Other namespaces and
# dtypes call the namespace's own function.


def _numpy_low_precision(xp: ModuleType, x: Any) -> bool:
    return xp is np and np.asarray(x).dtype in (np.float32, np.float16)


def exp(xp: ModuleType, x: Any) -> Any:
    """``exp(x)``; under NumPy float32/float16 computed in float64 and rounded once."""
    if _numpy_low_precision(xp, x):
        x = np.asarray(x)
        return np.exp(x.astype(np.float64)).astype(x.dtype)
    return xp.exp(x)


def log(xp: ModuleType, x: Any) -> Any:
    """``log(x)``; under NumPy float32/float16 computed in float64 and rounded once."""
    if _numpy_low_precision(xp, x):
        x = np.asarray(x)
        return np.log(x.astype(np.float64)).astype(x.dtype)
    return xp.log(x)


def fma(xp: ModuleType, a: Any, b: Any, c: Any) -> Any:
    """``a * b + c`` rounded once, as XLA's CPU compiler evaluates it inside ``jit``.

    XLA contracts a product that feeds an addition into a fused multiply-add (for
    ``a*b + c*d`` it fuses the *first* product: ``fma(a, b, c*d)``). learned_optimization's
    jitted updates are therefore rounded that way. Under jax.numpy this writes ``a * b + c``
    and lets XLA contract it (under ``jax.disable_jit`` it is not contracted, as in the
    original op by op). Under NumPy and torch, float32 operands are multiplied and added in
    float64 (the product of two float32 values is exact there) and rounded once to float32:
    the fused result except in the rare double-rounding tie. float64 operands (the oracle)
    are computed directly. Meant for small arrays (it allocates float64 temporaries).
    """
    if xp.__name__.startswith("jax"):
        return a * b + c
    if is_torch(xp):
        dt = a.dtype if hasattr(a, "dtype") else c.dtype
        if dt == xp.float64:
            return a * b + c
        f64 = xp.float64

        def up(x: Any) -> Any:
            return x.to(f64) if hasattr(x, "to") else x

        return (up(a) * up(b) + up(c)).to(dt)
    dt = np.result_type(a, b, c)
    if dt == np.float64:
        return a * b + c
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64)
            + np.asarray(c, np.float64)).astype(dt)


# XLA's float32 tanh on the CPU (xla/service/llvm_ir/math_ops.cc, EmitFastTanh with FMA):
# Eigen's rational approximation x·P(x²)/Q(x²), Horner steps fused, x clamped to ±7.99881172,
# and x itself for |x| < 0.0004.
_TANH_CLAMP = 7.99881172180175781
_TANH_NUM = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
             5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
             4.89352455891786e-03)
_TANH_DEN = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
             4.89352518554385e-03)


def tanh(xp: ModuleType, x: Any) -> Any:
    """``tanh`` as learned_optimization's jitted float32 code computes it on the CPU.

    jax.numpy: ``jnp.tanh`` (that *is* XLA's). float64 (the oracle): the exact ``tanh``.
    float32 under NumPy or torch: XLA's CPU approximation written out (its Horner steps
    as single-rounding fused multiply-adds, see :func:`fma`), bit for bit equal to it on
    every one of 3.1 million inputs checked (``jnp.tanh`` under jit, jax 0.10; torch's and
    NumPy's own tanh differ from it in about half of all inputs, by up to 4 ulp). Its
    error against the exact tanh is up to 4.4 ulp, which is XLA's, reproduced.
    """
    if xp.__name__.startswith("jax"):
        return xp.tanh(x)
    if (x.dtype == xp.float64) if is_torch(xp) else (np.asarray(x).dtype == np.float64):
        return xp.tanh(x)
    if is_torch(xp):
        xc = x.clamp(-_TANH_CLAMP, _TANH_CLAMP)
    else:
        xc = np.clip(x, np.float32(-_TANH_CLAMP), np.float32(_TANH_CLAMP))
    x2 = xc * xc
    num = xp.full_like(x2, _TANH_NUM[0])
    for c in _TANH_NUM[1:]:
        num = fma(xp, x2, num, float(np.float32(c)))
    num = xc * num
    den = xp.full_like(x2, _TANH_DEN[0])
    for c in _TANH_DEN[1:]:
        den = fma(xp, x2, den, float(np.float32(c)))
    return xp.where(xp.abs(x) < 0.0004, x, num / den)


def matmul(xp: ModuleType, a: Any, b: Any) -> Any:
    """``a @ b`` in full float32 precision under every namespace.

    XLA on a GPU multiplies float32 matrices in TF32 by default (10-bit mantissas), about
    1e-3 relative per product: enough to move a learned optimizer's LSTM state by 1e-3. Under
    jax this asks for ``Precision.HIGHEST``, which is what the CPU (and the golden traces,
    recorded on the CPU) computes. torch's CUDA matmuls are full float32 unless the user
    turns ``torch.backends.cuda.matmul.allow_tf32`` on.
    """
    if xp.__name__.startswith("jax"):
        import jax

        return xp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
    out = xp.matmul(a, b)
    if xp is np and out.dtype != np.result_type(a, b):
        # ml_dtypes' bfloat16 matmul returns its float32 sum: rounded once here, as a
        # bfloat16 product is in torch and XLA
        out = out.astype(np.result_type(a, b))
    return out


# -- division rounded once, whatever the compiler makes of a float division -----------------


def divide(xp: ModuleType, a: Any, b: Any) -> Any:
    """``a / b`` correctly rounded (IEEE 754 round to nearest, ties to even) in every
    namespace, on every device, so that quantisers built on it write the same bytes.

    NumPy: ``a / b``. torch: ``a / b`` with both operands tensors, since torch rounds twice
    when one is a Python number (``x / t`` is ``t.reciprocal() * x``; on CUDA ``t / x`` is
    ``t * (1/x)``); the number is cast to the other operand's dtype first, as NumPy and JAX
    cast a Python scalar. jax.numpy: float32 (and float16/bfloat16, computed in float32)
    by :func:`_divide_f32`, integer arithmetic on the bit patterns, since XLA's float32
    division is not IEEE on GPUs (PTX ``div.full.f32``, up to 2 ulp) and on CPUs a division
    by a broadcast operand becomes a multiplication by its reciprocal. float64 (x64 on) and
    complex under JAX divide as XLA does (``div.rn.f64`` on GPUs). NaN payloads are not
    specified: a NaN operand's payload is kept (quieted), an invalid operation gives
    ``0x7fc00000``.
    """
    if is_torch(xp):
        if not isinstance(a, xp.Tensor):
            a = xp.full((), a, dtype=b.dtype, device=b.device)
        if not isinstance(b, xp.Tensor):
            b = xp.full((), b, dtype=a.dtype, device=a.device)
        return a / b
    if not xp.__name__.startswith("jax"):
        return a / b
    dt = xp.result_type(a, b)
    if not xp.issubdtype(dt, xp.floating):
        if xp.issubdtype(dt, xp.complexfloating):
            return a / b
        dt = xp.result_type(float)
    if dt not in (xp.float32, xp.float16, xp.bfloat16):
        return xp.asarray(a, dt) / xp.asarray(b, dt)
    a, b = xp.broadcast_arrays(xp.asarray(a, dt), xp.asarray(b, dt))
    # float16/bfloat16: the float32 quotient rounded to the narrow format is the correctly
    # rounded narrow quotient, because 24 ≥ 2·11 + 2 bits (no double-rounding error)
    q = _divide_f32_jit()(a.astype(xp.float32), b.astype(xp.float32))
    return q.astype(dt)


@functools.cache
def _divide_f32_jit() -> Any:
    # jitted so that eager callers compile one fused kernel per shape, not ~150 ops one by
    # one; inside an outer jit it is inlined
    import jax

    return jax.jit(_divide_f32)


def _divide_f32(a: Any, b: Any) -> Any:
    """float32 ``a / b`` (same shapes, jax arrays) correctly rounded, from uint32/int32
    operations on the bit patterns only: integer results are exact on every XLA backend,
    so no compiler choice of float division or contraction can change the quotient.

    Both significands are normalised to 24 bits (subnormals by their leading zeros), the
    dividend doubled when smaller than the divisor, and 26 quotient bits produced by
    restoring long division (one compare-subtract per bit, unrolled: one fused elementwise
    kernel); the remainder gives the sticky bit. The rounding position moves right for a
    subnormal quotient, so gradual underflow is rounded once, ties to even.
    """
    import jax.numpy as jnp
    from jax import lax

    u32, i32 = jnp.uint32, jnp.int32

    def c(v: int) -> Any:
        return np.uint32(v)

    ua = lax.bitcast_convert_type(a, u32)
    ub = lax.bitcast_convert_type(b, u32)
    sign = (ua ^ ub) & c(0x80000000)
    abs_a, abs_b = ua & c(0x7FFFFFFF), ub & c(0x7FFFFFFF)

    def significand(u: Any) -> tuple[Any, Any]:
        """(24-bit significand with bit 23 set, biased exponent, below 1 for subnormals)."""
        e = lax.convert_element_type(u >> c(23), i32)  # the sign bit was masked off
        m = u & c(0x7FFFFF)
        sub = e == 0
        shift = lax.convert_element_type(lax.clz(m), i32) - 8  # zero: 24, harmlessly
        m = jnp.where(sub, m << lax.convert_element_type(jnp.maximum(shift, 0), u32),
                      m | c(0x800000))
        return m, jnp.where(sub, 1 - shift, e)

    ma, ea = significand(abs_a)
    mb, eb = significand(abs_b)
    small = ma < mb
    ma = jnp.where(small, ma << c(1), ma)  # now mb ≤ ma < 2·mb: the quotient is in [1, 2)
    e = ea - eb + 127 - small.astype(i32)  # biased exponent of the quotient
    q = jnp.ones_like(ma)
    r = ma - mb
    for _ in range(25):  # r < mb < 2**24 throughout: no bit is lost to a shift
        r = r << c(1)
        ge = r >= mb
        r = jnp.where(ge, r - mb, r)
        q = (q << c(1)) | ge.astype(u32)
    # q = ⌊2²⁵·quotient⌋ ∈ [2²⁵, 2²⁶); keep 24 bits (fewer below the normal range)
    s = lax.convert_element_type(jnp.clip(1 - e, 0, 25) + 2, u32)
    m = q >> s
    rest = q & ((c(1) << s) - c(1))
    half = c(1) << (s - c(1))
    up = (rest > half) | ((rest == half) & ((r != 0) | ((m & c(1)) == 1)))
    m = m + up.astype(u32)
    # a significand rounded up to 2²⁴ carries into the exponent, 2²³ into the first normal
    body = (lax.convert_element_type(jnp.clip(e, 1, 254) - 1, u32) << c(23)) + m
    body = jnp.where(e > 254, c(0x7F800000), body)

    inf = c(0x7F800000)
    a_nan, b_nan = abs_a > inf, abs_b > inf
    a_inf, b_inf = abs_a == inf, abs_b == inf
    a_zero, b_zero = abs_a == 0, abs_b == 0
    nan = jnp.where(a_nan, ua | c(0x400000),
                    jnp.where(b_nan, ub | c(0x400000), c(0x7FC00000)))
    invalid = a_nan | b_nan | (a_inf & b_inf) | (a_zero & b_zero)
    out = jnp.where(a_inf | b_zero, sign | inf, jnp.where(a_zero | b_inf, sign, sign | body))
    out = jnp.where(invalid, nan, out)
    return lax.bitcast_convert_type(out, jnp.float32)
