"""Counter-based random numbers that are bit-identical in NumPy, PyTorch and JAX.

The generator is the Threefry-2x32 block cipher with 20 rounds (Salmon, Moraes, Dror and
Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the function JAX uses as
the core of its default PRNG. It maps a 64-bit key and a 64-bit block index (each held as
two 32-bit words) to two 32-bit output words. Everything below is defined in terms of
that function, so the same ``(seed, counter, shape)`` gives the same bits in every backend.

Backends
--------
``backend="numpy"`` (default) returns ``numpy.ndarray``; ``backend="torch"`` returns
``torch.Tensor`` on ``device`` (default CPU); ``backend="jax"`` returns ``jax.Array`` and
may be called inside ``jax.jit`` (shapes are static; ``seed`` and ``counter`` may be
traced integer arrays, see :func:`bits`). Neither torch nor jax is imported until a
function is called with that backend.

Integer dtypes: numpy and jax hold 32-bit words as ``uint32``. torch's ``uint32`` support
is limited, so the torch backend does its 32-bit arithmetic in ``int64`` tensors masked
with ``& 0xFFFFFFFF`` and returns the words of :func:`bits` and :func:`threefry2x32` as
``torch.int64`` tensors holding values in ``[0, 2**32)``.

Stream layout
-------------
``key_from_seed(seed) = (seed >> 32, seed & 0xFFFFFFFF)`` for a seed in ``[0, 2**64)``.
Block ``b`` (a 64-bit index) of a seed's stream is
``threefry2x32(key0, key1, x0=b >> 32, x1=b & 0xFFFFFFFF) = (y0, y1)``; its two words
are, in order, ``y0`` then ``y1``. A draw at ``counter`` reads blocks
``counter, counter + 1, ...``; so word ``k`` of the flat (C-order) word sequence ``W`` of a
draw is word ``k % 2`` of block ``counter + k // 2``. The distributions read ``W`` thus:

* ``bits``:      ``out[k] = W[k]`` (uint32 words).
* ``uniform`` float32: ``out[k] = (W[k] >> 8) * 2**-24``, in ``[0, 1 - 2**-24]``.
* ``uniform`` float64: ``out[k] = ((W[2k] >> 5) * 2**26 + (W[2k+1] >> 6)) * 2**-53``, in
  ``[0, 1 - 2**-53]`` (so value ``k`` is built from block ``counter + k``).
* ``normal``: pairs ``p = 0, 1, ...`` of the uniform stream of the same dtype:
  ``u1 = 1 - U[2p]`` (in ``(0, 1]``), ``u2 = U[2p+1]``, ``r = sqrt(-2 log u1)``,
  ``out[2p] = r cos(2 pi u2)``, ``out[2p+1] = r sin(2 pi u2)`` (Box-Muller); for an odd
  count the last sine is dropped. float32 pair ``p`` uses block ``counter + p``; float64
  pair ``p`` uses blocks ``counter + 2p`` and ``counter + 2p + 1``.

A draw of shape ``s`` reserves ``blocks_used(s, dtype)`` blocks (see there); the next
independent draw from the same seed starts at ``counter + blocks_used(s, dtype)``. Block
indices are 64-bit; a draw that would run past ``2**64`` is an error (for traced
counters it wraps around). :func:`fold_in` derives independent seeds (per layer, per
refresh) from a seed.

Bit-identical normals
---------------------
The frameworks' own ``log``, ``sin`` and ``cos`` differ in the last bits, and even their
``sqrt`` and ``/`` are not correctly rounded everywhere (torch's CPU ``sqrt`` is off by
an ulp in a few percent of cases; XLA on GPU divides and takes square roots of float32
approximately). So :func:`normal` uses only float ``+``, ``-``, ``*``, comparisons,
``where``, ``floor``, ``abs``, exact int/float conversions, reinterpretation of a float's
bits as an integer, and integer arithmetic, applied in one fixed order:

* ``a / b`` and ``sqrt(x)``: correctly rounded, computed on the significands with integer
  long division and a digit-by-digit integer square root (so they equal IEEE's result
  without relying on the framework's).
* ``log x``: split ``x = 2**e * (1 + f)`` with ``1 + f`` in ``[sqrt(2)/2, sqrt(2)]`` from
  the bits; ``s = f / (2 + f)``; ``log(1 + f) = 2 atanh(s) = f - h + s (h + z P(z))`` with
  ``h = f*f/2``, ``z = s*s`` and ``P`` the Taylor polynomial of ``(atanh(s)/s - 1) * 2/z``
  of degree 3 (float32) or 9 (float64); ``e*ln2`` is added as an exact ``e*ln2_hi`` and a
  small ``e*ln2_lo``.
* ``cos/sin(2 pi u)``: ``4u`` splits exactly into a quadrant ``q = floor(4u)`` and a
  remainder ``f``; with ``g = min(f, 1 - f)`` in ``[0, 1/2]`` (exact),
  ``sin(pi g / 2) = g * P_s(g*g)`` and ``cos(pi g / 2) = 1 + g*g * P_c(g*g)`` are Taylor
  polynomials (through ``x**9`` / ``x**10`` for float32, ``x**17`` / ``x**16`` for float64);
  swapping for ``f > 1/2`` and the quadrant rotation are exact.

Accuracy, measured (and pinned by the tests): over every float32 input that a draw can
produce, ``log`` is within 0.86 ulp of the exact value and ``cos``/``sin`` within 1.24
ulp; in float64 (sampled, against an 80-bit reference) ``log`` is within 0.83 ulp and
``cos``/``sin`` within 1.31 ulp. Normals are within 2.9 ulp (float32) and 2.8 ulp
(float64) of a higher-precision evaluation of the same Box-Muller formula.

Guarantees and caveats:

* Bit-identical results, tested: numpy; torch on CPU; jax on CPU, with or without
  ``jax.jit`` (jax 0.10 and 0.11); torch on CUDA (torch 2.11) and jax on GPU (jax 0.11),
  checked on an NVIDIA H200 by the GPU tests, which run only where a GPU is present.
* Fused multiply-add and reassociation. If a compiler contracts a product and the
  addition that consumes it into one FMA, or folds constants across an addition, the
  result can change in the last bit. NumPy and eager torch never do either across
  separate operations. XLA does both inside ``jit`` (seen on CPU and on GPU), so the jax
  backend passes every inexact product that feeds an addition, and every sum that is
  added to another constant, through an opaque identity (``where(p == p, p, 0)``, see
  ``_JaxOps.fence``); XLA's CPU and GPU compilers (jax 0.10 and 0.11) do not see through
  it, and without it jax on GPU differs in the last bit of about 15% of normals. A future
  compiler that learns to see through it could break bit identity in the last bit
  (accuracy would be unaffected); the cross-backend tests would catch that. The torch
  backend runs eagerly even under ``torch.compile`` (``torch.compiler.disable``), because
  generated kernels may contract.
* Subnormals never occur in these computations, so flush-to-zero settings do not matter.
"""

from __future__ import annotations

import functools
import math
import numbers
from fractions import Fraction

import numpy as np

__all__ = [
    "BACKENDS",
    "bits",
    "blocks_used",
    "fold_in",
    "fold_in_many",
    "key_from_seed",
    "normal",
    "normal_many",
    "threefry2x32",
    "uniform",
]

BACKENDS = ("numpy", "torch", "jax")

_MASK32 = 0xFFFFFFFF
_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
_PARITY = 0x1BD11BDA  # Threefish key-schedule parity constant
_FOLD_TAG = 0x666F6C64  # ASCII "fold": separates fold_in's blocks from low counters


# --------------------------------------------------------------------------------------
# Argument checking
# --------------------------------------------------------------------------------------


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _check_backend(backend, fn: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(
            f"xopt.random.{fn}: backend={backend!r} is not supported; use one of {BACKENDS}"
        )
    return backend


def _check_device(device, backend: str, fn: str):
    if device is not None and backend != "torch":
        raise ValueError(
            f"xopt.random.{fn}: device={device!r} is only accepted with backend='torch' "
            f"(got backend={backend!r})"
        )


def _check_shape(shape, fn: str) -> tuple[int, ...]:
    if _is_int(shape):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise ValueError(
            f"xopt.random.{fn}: shape={shape!r} must be an int or a sequence of ints"
        ) from None
    if not all(_is_int(d) and d >= 0 for d in dims):
        raise ValueError(f"xopt.random.{fn}: shape={shape!r} must hold non-negative ints")
    return tuple(int(d) for d in dims)


def _check_dtype(dtype, fn: str, allowed=("float32", "float64")) -> str:
    """Normalise a dtype given as a string, a numpy/jax dtype or a torch dtype."""
    if dtype is None:
        name = None
    elif isinstance(dtype, str):
        name = dtype
    elif str(dtype).startswith("torch."):  # torch dtypes, without importing torch
        name = str(dtype)[len("torch.") :]
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = None
    if name not in allowed:
        wanted = " or ".join(repr(a) for a in allowed)
        raise ValueError(f"xopt.random.{fn}: dtype={dtype!r} is not supported; use {wanted}")
    return name


def _split64(value, name: str, fn: str) -> tuple[int, int]:
    """Check a Python int in [0, 2**64) and split it into (high word, low word)."""
    if not _is_int(value):
        raise ValueError(
            f"xopt.random.{fn}: {name} must be an int in [0, 2**64), "
            f"got {value!r} ({type(value).__name__})"
        )
    value = int(value)
    if not 0 <= value < 2**64:
        raise ValueError(f"xopt.random.{fn}: {name}={value} is outside [0, 2**64)")
    return value >> 32, value & _MASK32


def _num_elements(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


# --------------------------------------------------------------------------------------
# Backend primitives. Each backend provides the same few elementwise operations; the
# algorithms below are written once against them, so every backend applies the same
# IEEE operations in the same order.
# --------------------------------------------------------------------------------------


class _PyOps:
    """Python ints (scalars only): used by fold_in and as a reference."""

    name = "python"

    @staticmethod
    def add(a, b):
        return (a + b) & _MASK32

    @staticmethod
    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & _MASK32


class _NumpyOps:
    """numpy: 32-bit words are uint32 arrays (at least 1-d, so arithmetic wraps silently);
    float bit patterns are uint32 (float32) or uint64 (float64) arrays."""

    name = "numpy"
    where = staticmethod(np.where)
    abs = staticmethod(np.abs)
    floor = staticmethod(np.floor)

    @staticmethod
    def add(a, b):
        return a + b  # uint32 arithmetic wraps modulo 2**32

    @staticmethod
    def rotl(x, r):
        return (x << r) | (x >> (32 - r))

    @staticmethod
    def arange(n):
        return np.arange(n, dtype=np.uint32)

    @staticmethod
    def less_as_word(a, b):
        return (a < b).astype(np.uint32)

    @staticmethod
    def interleave(a, b):
        return np.stack([a, b], axis=1).reshape(-1)

    @staticmethod
    def int_to_float(i, fmt):
        return i.astype(fmt.np_dtype)

    @staticmethod
    def float_to_uint(x, fmt):
        return np.ascontiguousarray(x).view(fmt.np_uint)

    @staticmethod
    def uint_to_float(i, fmt):
        return i.astype(fmt.np_uint).view(fmt.np_dtype)

    @staticmethod
    def bool_to_uint(c, fmt):
        return c.astype(fmt.np_uint)

    @staticmethod
    def fence(p):
        return p


class _TorchOps:
    """torch: 32-bit words live in int64 tensors, masked after additions and shifts;
    float bit patterns are non-negative int64 tensors too."""

    name = "torch"

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = device
        self.where = torch.where
        self.abs = torch.abs
        self.floor = torch.floor

    @staticmethod
    def add(a, b):
        return (a + b) & _MASK32

    @staticmethod
    def rotl(x, r):
        return ((x << r) & _MASK32) | (x >> (32 - r))

    def arange(self, n):
        return self.torch.arange(n, dtype=self.torch.int64, device=self.device)

    def less_as_word(self, a, b):
        return (a < b).to(self.torch.int64)

    def interleave(self, a, b):
        return self.torch.stack([a, b], dim=1).reshape(-1)

    def int_to_float(self, i, fmt):
        return i.to(getattr(self.torch, fmt.name))

    def float_to_uint(self, x, fmt):
        x = x.contiguous()
        if fmt.name == "float32":
            return x.view(self.torch.int32).to(self.torch.int64) & _MASK32
        return x.view(self.torch.int64)  # callers pass non-negative floats only

    def uint_to_float(self, i, fmt):
        if fmt.name == "float32":
            return i.to(self.torch.int32).view(self.torch.float32)  # i < 2**31 here
        return i.contiguous().view(self.torch.float64)

    def bool_to_uint(self, c, fmt):
        return c.to(self.torch.int64)

    @staticmethod
    def fence(p):
        return p


class _JaxOps:
    """jax: 32-bit words are uint32 arrays, float bit patterns uint32/uint64 arrays;
    everything is traceable under jax.jit."""

    name = "jax"

    def __init__(self):
        import jax
        import jax.numpy as jnp

        self.jax = jax
        self.jnp = jnp
        self.where = jnp.where
        self.abs = jnp.abs
        self.floor = jnp.floor

    @staticmethod
    def add(a, b):
        return a + b  # uint32 arithmetic wraps modulo 2**32

    @staticmethod
    def rotl(x, r):
        return (x << r) | (x >> (32 - r))  # >> is a logical shift on uint32

    def arange(self, n):
        return self.jax.lax.iota(self.jnp.uint32, n)

    def less_as_word(self, a, b):
        return (a < b).astype(self.jnp.uint32)

    def interleave(self, a, b):
        return self.jnp.stack([a, b], axis=1).reshape(-1)

    def int_to_float(self, i, fmt):
        return i.astype(fmt.np_dtype)

    def float_to_uint(self, x, fmt):
        return self.jax.lax.bitcast_convert_type(x, fmt.np_uint)

    def uint_to_float(self, i, fmt):
        return self.jax.lax.bitcast_convert_type(i.astype(fmt.np_uint), fmt.np_dtype)

    def bool_to_uint(self, c, fmt):
        return c.astype(fmt.np_uint)

    def fence(self, p):
        # An identity for the non-NaN values met here that XLA cannot simplify away
        # (p == p is false for NaN). It stops XLA from fusing a product p into an FMA
        # with the addition that consumes it, and from reassociating p's constant terms
        # with the next one (c1 + (c2 + x) -> x + (c1 + c2)): both change the rounding.
        return self.jnp.where(p == p, p, 0.0)


# --------------------------------------------------------------------------------------
# Threefry-2x32-20
# --------------------------------------------------------------------------------------


def _threefry_core(ops, k0, k1, x0, x1):
    """Threefry-2x32 with 20 rounds on 32-bit words held as ``ops`` arrays or ints.

    Key schedule: ``ks = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)``. The input words first get
    ``ks[0], ks[1]`` added; each round ``i`` does ``x0 += x1; x1 = rotl(x1, R[i % 8]) ^ x0``;
    after every fourth round (injection ``s = 1..5``) ``x0 += ks[s % 3]`` and
    ``x1 += ks[(s + 1) % 3] + s``. All additions are modulo 2**32.
    """
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    x0 = ops.add(x0, ks[0])
    x1 = ops.add(x1, ks[1])
    for i in range(20):
        x0 = ops.add(x0, x1)
        x1 = ops.rotl(x1, _ROTATIONS[i % 8]) ^ x0
        if i % 4 == 3:
            s = (i + 1) // 4
            x0 = ops.add(x0, ks[s % 3])
            x1 = ops.add(ops.add(x1, ks[(s + 1) % 3]), s)
    return x0, x1


def _words_in(value, name: str, backend: str, device=None):
    """Convert one threefry2x32 argument to the backend's 32-bit word representation."""
    fn = "threefry2x32"
    if _is_int(value):
        if not 0 <= int(value) <= _MASK32:
            raise ValueError(f"xopt.random.{fn}: {name}={value} is outside [0, 2**32)")
        value = int(value)
    if backend == "numpy":
        arr = np.asarray(value)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"xopt.random.{fn}: {name} must hold integers, got dtype {arr.dtype}")
        if arr.size and (arr.min() < 0 or arr.max() > _MASK32):
            raise ValueError(f"xopt.random.{fn}: {name} has values outside [0, 2**32)")
        return arr.astype(np.uint32)
    if backend == "torch":
        import torch

        if isinstance(value, torch.Tensor):
            if value.dtype.is_floating_point or value.dtype.is_complex:
                raise ValueError(f"xopt.random.{fn}: {name} must hold integers, got {value.dtype}")
            return value.to(device=device, dtype=torch.int64) & _MASK32
        arr = _words_in(value, name, "numpy")
        return torch.as_tensor(arr.astype(np.int64), device=device)
    import jax.numpy as jnp

    if isinstance(value, int):
        return jnp.asarray(value, dtype=jnp.uint32)
    arr = jnp.asarray(value)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"xopt.random.{fn}: {name} must hold integers, got {arr.dtype}")
    return arr.astype(jnp.uint32)


def threefry2x32(key0, key1, x0, x1, *, backend: str = "numpy", device=None):
    """The Threefry-2x32-20 block function, elementwise over broadcast arrays.

    Args:
        key0, key1: the two 32-bit key words (ints or integer arrays; broadcast).
        x0, x1: the two 32-bit counter words (ints or integer arrays; broadcast).
            Python ints and numpy arrays must lie in ``[0, 2**32)`` (checked); torch
            tensors are reduced to their low 32 bits and jax arrays converted to
            ``uint32`` (unchecked, so they may be traced).
        backend: ``"numpy"``, ``"torch"`` or ``"jax"``.
        device: torch device for int inputs (torch backend only).

    Returns:
        ``(y0, y1)``, each of the broadcast shape of the inputs: ``uint32`` arrays for numpy
        and jax, ``torch.int64`` tensors with values in ``[0, 2**32)`` for torch.

    Known answers (Random123): ``threefry2x32(0, 0, 0, 0) == (0x6B200159, 0x99BA4EFE)``.
    """
    _check_backend(backend, "threefry2x32")
    _check_device(device, backend, "threefry2x32")
    named = {"key0": key0, "key1": key1, "x0": x0, "x1": x1}
    args = [_words_in(value, name, backend, device) for name, value in named.items()]
    if backend == "numpy":
        shape = np.broadcast_shapes(*(a.shape for a in args))
        flat = [np.broadcast_to(a, shape).reshape(-1) for a in args]  # >= 1-d: no warnings
        y0, y1 = _threefry_core(_NumpyOps, *flat)
        return y0.reshape(shape), y1.reshape(shape)
    if backend == "torch":
        import torch

        args = torch.broadcast_tensors(*args)
        return _eager_torch(_threefry_core)(_TorchOps(device), *args)
    import jax.numpy as jnp

    args = jnp.broadcast_arrays(*args)
    return _threefry_core(_JaxOps(), *args)


def key_from_seed(seed: int) -> tuple[int, int]:
    """Split a 64-bit seed into the Threefry key ``(seed >> 32, seed & 0xFFFFFFFF)``.

    Raises ``ValueError`` (naming ``seed``) unless ``seed`` is an int in ``[0, 2**64)``.
    """
    return _split64(seed, "seed", "key_from_seed")


def fold_in(seed: int, *data: int) -> int:
    """Derive a new 64-bit seed from ``seed`` and integers ``data`` (each in ``[0, 2**64)``).

    For one datum ``d``: ``(y0, y1) = threefry2x32(*key_from_seed(seed), (d >> 32) ^
    0x666F6C64, d & 0xFFFFFFFF)`` and the result is ``(y0 << 32) | y1``. Several data are
    folded in one after another: ``fold_in(s, a, b) == fold_in(fold_in(s, a), b)``;
    ``fold_in(s) == s``. Pure Python, no backend involved. The tag ``0x666F6C64`` means
    the blocks hashed here are those a stream would reach only at counters near
    ``0x666F6C64 * 2**32`` (about 2**60.7), far beyond any real draw.
    """
    k0, k1 = _split64(seed, "seed", "fold_in")
    for index, datum in enumerate(data):
        d_hi, d_lo = _split64(datum, f"data[{index}]", "fold_in")
        y0, y1 = _threefry_core(_PyOps, k0, k1, d_hi ^ _FOLD_TAG, d_lo)
        k0, k1 = y0, y1
    return (k0 << 32) | k1



def fold_in_many(seeds, data) -> list[int]:
    """``[fold_in(s, d) for s, d in zip(seeds, data)]`` (one datum each) as one NumPy
    Threefry evaluation: for many seeds at once, where the loop's Python hashing costs.
    ``seeds`` and ``data`` are equal-length sequences of ints in ``[0, 2**64)`` (checked)."""
    seeds, data = list(seeds), list(data)
    if len(seeds) != len(data):
        raise ValueError(f"xopt.random.fold_in_many: {len(seeds)} seeds and {len(data)} data")
    for name, values in (("seeds", seeds), ("data", data)):
        for i, v in enumerate(values):
            _split64(v, f"{name}[{i}]", "fold_in_many")
    s = np.asarray(seeds, dtype=np.uint64)
    d = np.asarray(data, dtype=np.uint64)
    low = np.uint64(0xFFFFFFFF)
    y0, y1 = threefry2x32((s >> np.uint64(32)).astype(np.uint32), (s & low).astype(np.uint32),
                          ((d >> np.uint64(32)) ^ np.uint64(_FOLD_TAG)).astype(np.uint32),
                          (d & low).astype(np.uint32))
    return ((y0.astype(np.uint64) << np.uint64(32)) | y1.astype(np.uint64)).tolist()

def blocks_used(shape, dtype: str = "uint32") -> int:
    """Number of counter blocks a draw of ``shape`` reserves.

    ``dtype`` is ``"uint32"`` (for :func:`bits`), ``"float32"`` or ``"float64"`` (for
    :func:`uniform` and :func:`normal` of that dtype). With ``n = prod(shape)``:
    ``ceil(n / 2)`` for uint32 and float32 (bits, uniform and normal), and
    ``2 * ceil(n / 2)`` for float64 (a float64 uniform of odd size reads only the first
    ``n`` of these blocks; a float64 normal reads them all). The draw reads only blocks
    ``[counter, counter + blocks_used)``; start the next independent draw after them.
    """
    dims = _check_shape(shape, "blocks_used")
    name = _check_dtype(dtype, "blocks_used", ("uint32", "float32", "float64"))
    pairs = (_num_elements(dims) + 1) // 2
    return 2 * pairs if name == "float64" else pairs


# --------------------------------------------------------------------------------------
# Elementary functions from IEEE basic operations
# --------------------------------------------------------------------------------------

_PI = Fraction("3.14159265358979323846264338327950288419716939937510582097494459")
_LN2 = Fraction("0.69314718055994530941723212145817656807550013436025525412068000")


class _Format:
    """Per-precision constants of the log/sin/cos approximations.

    All constants are exactly representable in the format, so every framework sees the
    same values whatever path it converts Python floats by.
    """

    def __init__(self, name, uint_name, mant_bits, bias, log_degree, sin_terms, cos_terms):
        self.name = name
        self.np_dtype = np.dtype(name)
        self.np_uint = np.dtype(uint_name)
        self.mant_bits = mant_bits
        self.precision = mant_bits + 1  # significand bits, p
        self.bias = bias
        self.mant_mask = (1 << mant_bits) - 1
        self.one_bits = bias << mant_bits  # the bits of 1.0
        self.implicit_bit = 1 << mant_bits
        rnd = self.round
        self.sqrt2 = rnd(Fraction(math.sqrt(2.0)))
        # log(1 + f) = f - h + s*(h + z*P(z)), P(z) = sum_k 2/(2k+3) z**k (atanh series).
        self.log_coeffs = tuple(rnd(Fraction(2, 2 * k + 3)) for k in range(log_degree + 1))
        # ln2 = hi + lo with hi short enough that e*hi is exact for every exponent e.
        hi_bits = mant_bits + 1 - 11
        self.ln2_hi = float(Fraction(round(_LN2 * 2**hi_bits), 2**hi_bits))
        self.ln2_lo = rnd(_LN2 - Fraction(self.ln2_hi))
        # sin(pi g/2) = g * (S0 + S1 z + ...), cos(pi g/2) = 1 + z * (C1 + C2 z + ...),
        # z = g*g; Taylor coefficients of sin, cos at x = pi g / 2.
        half_pi = _PI / 2
        self.sin_hi = rnd(half_pi)
        self.sin_lo = rnd(half_pi - Fraction(self.sin_hi))
        self.sin_tail = tuple(
            rnd((-1) ** k * half_pi ** (2 * k + 1) / math.factorial(2 * k + 1))
            for k in range(1, sin_terms)
        )
        self.cos_tail = tuple(
            rnd((-1) ** k * half_pi ** (2 * k) / math.factorial(2 * k)) for k in range(1, cos_terms)
        )

    def round(self, q: Fraction) -> float:
        """Round to this format, returned as a Python float (exact)."""
        return float(self.np_dtype.type(float(q)))


_FORMATS = {
    "float32": _Format("float32", "uint32", 23, 127, log_degree=3, sin_terms=5, cos_terms=6),
    "float64": _Format("float64", "uint64", 52, 1023, log_degree=9, sin_terms=9, cos_terms=9),
}


def _horner(ops, z, coeffs):
    """``c0 + z*(c1 + z*(c2 + ...))``, innermost first; every product is fenced."""
    acc = coeffs[-1]
    for c in reversed(coeffs[:-1]):
        acc = c + ops.fence(z * acc)
    return acc


def _div(ops, a, b, fmt: _Format):
    """Correctly rounded ``a / b`` (1-d, ``fmt`` dtype) by integer long division.

    ``b`` must be a positive normal float, ``a`` zero or normal, and the quotient normal.
    Built from integer operations only, so it does not depend on the framework's
    division, which is not correctly rounded everywhere (XLA on GPU divides float32
    approximately).
    """
    p, mb = fmt.precision, fmt.mant_bits
    ua = ops.float_to_uint(ops.abs(a), fmt)
    ub = ops.float_to_uint(b, fmt)
    ma = (ua & fmt.mant_mask) | fmt.implicit_bit  # p-bit significands
    mbs = (ub & fmt.mant_mask) | fmt.implicit_bit
    # q = floor(ma / mbs * 2**(p + 1)): p + 2 quotient bits, the first one worth 1.
    rem, q = ma, None
    for _ in range(p + 2):
        ge = rem >= mbs
        bit = ops.bool_to_uint(ge, fmt)
        q = bit if q is None else (q << 1) | bit
        rem = ops.where(ge, rem - mbs, rem) << 1  # rem < 2 * mbs < 2**(p + 1)
    big = q >> (p + 1)  # 1 when ma >= mbs (q has p + 2 bits), else 0 (p + 1 bits)
    wide = big == 1
    quo = ops.where(wide, q >> 2, q >> 1)  # the p-bit truncated significand
    guard = ops.where(wide, q >> 1, q) & 1
    sticky = (big & q) | ops.bool_to_uint(rem != 0, fmt)  # any bit below the guard
    up = guard & (sticky | (quo & 1))  # round to nearest, ties to even
    # a / b = quo * 2**(ea - eb - p + big); as bits: ((exponent field - 1) << mb) + quo,
    # where adding quo (which may have carried to 2**p) supplies the leading 1.
    field = (ua >> mb) + (fmt.bias - 2) + big - (ub >> mb)
    quotient = ops.uint_to_float((field << mb) + (quo + up), fmt)
    quotient = ops.where(a < 0.0, -quotient, quotient)
    return ops.where(a == 0.0, a, quotient)


def _sqrt(ops, x, fmt: _Format):
    """Correctly rounded ``sqrt(x)`` for ``x`` zero or positive normal (1-d, ``fmt`` dtype).

    Digit-by-digit integer square root of the significand (two bits of the radicand per
    step), so it does not depend on the framework's sqrt, which is not correctly rounded
    everywhere (torch on CPU and XLA on GPU).
    """
    p, mb = fmt.precision, fmt.mant_bits
    u = ops.float_to_uint(x, fmt)
    e = u >> mb  # biased exponent
    m = (u & fmt.mant_mask) | fmt.implicit_bit
    # x = m * 2**(e - bias - mb). Radicand n = m * 2**t with t in {p, p - 1} chosen so that
    # the remaining exponent is even; n has 2p - 1 or 2p bits and a p-bit root.
    shift = ops.bool_to_uint(((e + fmt.bias + 1) & 1) == 0, fmt)  # t = mb + shift
    top = m << shift  # n = top * 2**mb: top holds n's bits 2p-1 .. p-1, zeros below
    rem, root = None, None
    for k in range(p):
        lsb = p - 1 - 2 * k  # top's bit under the lower bit of radicand pair k
        if lsb >= 0:
            pair = (top >> lsb) & 3
        elif lsb == -1:
            pair = (top << 1) & 3
        else:
            pair = None
        if rem is None:
            rem = pair
        else:
            rem = rem << 2 if pair is None else (rem << 2) | pair
        trial = 1 if root is None else (root << 2) | 1
        ge = rem >= trial
        rem = ops.where(ge, rem - trial, rem)  # rem <= 2 * root
        bit = ops.bool_to_uint(ge, fmt)
        root = bit if root is None else (root << 1) | bit
    up = ops.bool_to_uint(rem > root, fmt)  # n > (root + 1/2)**2; never a tie
    field = (e + fmt.bias - shift - 2) >> 1  # result exponent field - 1
    result = ops.uint_to_float((field << mb) + (root + up), fmt)
    return ops.where(x == 0.0, x, result)


def _log(ops, x, fmt: _Format):
    """Natural log of positive normal floats ``x`` (1-d, ``fmt`` dtype), same shape/dtype.

    ``x = 2**e * (1 + f)`` with ``1 + f`` in ``[sqrt(2)/2, sqrt(2)]`` (``e``, ``f`` exact);
    ``s = f / (2 + f)``, ``z = s*s``, ``R = z * P(z)``, ``h = f*f / 2``. Since
    ``log(1 + f) = 2 atanh(s) = 2s + s R = f - h + s (h + R)``, the result is
    ``e*ln2_hi + (f - (h - (s*(h + R) + e*ln2_lo)))``: the leading ``f`` and ``e*ln2_hi``
    are exact and the rounding errors sit in the small correction terms.
    """
    i = ops.float_to_uint(x, fmt)
    m = ops.uint_to_float((i & fmt.mant_mask) | fmt.one_bits, fmt)  # in [1, 2)
    ef = ops.int_to_float(i >> fmt.mant_bits, fmt) - float(fmt.bias)  # exact
    big = m > fmt.sqrt2
    m = ops.where(big, m * 0.5, m)  # exact
    ef = ops.where(big, ef + 1.0, ef)  # exact
    f = m - 1.0  # exact (Sterbenz)
    s = _div(ops, f, f + 2.0, fmt)
    z = s * s
    r = ops.fence(z * _horner(ops, z, fmt.log_coeffs))
    h = ops.fence(f * f) * 0.5
    t = ops.fence(s * (h + r)) + ops.fence(ef * fmt.ln2_lo)
    return ef * fmt.ln2_hi + (f - (h - t))  # ef*ln2_hi is exact


def _sin_cos_quarter(ops, g, fmt: _Format):
    """``(sin(pi g / 2), cos(pi g / 2))`` for ``g`` in ``[0, 1/2]`` (1-d, ``fmt`` dtype)."""
    z = g * g
    ps = _horner(ops, z, fmt.sin_tail)  # S1 + S2 z + ...
    ps = fmt.sin_hi + ops.fence(fmt.sin_lo + ops.fence(z * ps))  # no constant folding
    sin = g * ps
    pc = _horner(ops, z, fmt.cos_tail)  # C1 + C2 z + ...
    cos = 1.0 + ops.fence(z * pc)
    return sin, cos


def _cos_sin_turns(ops, u, fmt: _Format):
    """``(cos(2 pi u), sin(2 pi u))`` for ``u`` in ``[0, 1)`` (1-d, ``fmt`` dtype).

    ``t = 4u`` (exact) splits into quadrant ``q = floor(t)`` and ``f = t - q`` (both
    exact); the angle is ``(q + f) * pi/2``. ``g = min(f, 1 - f)`` feeds the quarter-wave
    polynomials, and the swap for ``f > 1/2`` and the rotation by ``q`` quarter turns are
    exact (sign changes and selections).
    """
    t = u * 4.0
    q = ops.floor(t)
    f = t - q
    upper = f > 0.5
    g = ops.where(upper, 1.0 - f, f)
    s, c = _sin_cos_quarter(ops, g, fmt)
    sin_f = ops.where(upper, c, s)  # sin(pi f / 2)
    cos_f = ops.where(upper, s, c)  # cos(pi f / 2)
    w = ops.where
    cos = w(q == 0.0, cos_f, w(q == 1.0, -sin_f, w(q == 2.0, -cos_f, sin_f)))
    sin = w(q == 0.0, sin_f, w(q == 1.0, cos_f, w(q == 2.0, -sin_f, -cos_f)))
    return cos, sin


def _box_muller(ops, u1, u2, fmt: _Format):
    """Two normals per pair: ``(r cos(2 pi u2), r sin(2 pi u2))``, ``r = sqrt(-2 log u1)``.

    ``u1`` in ``(0, 1]``, ``u2`` in ``[0, 1)``; 1-d arrays of ``fmt`` dtype.
    """
    r = _sqrt(ops, ops.abs(_log(ops, u1, fmt) * -2.0), fmt)  # abs: -0.0 (u1 == 1) to +0
    cos, sin = _cos_sin_turns(ops, u2, fmt)
    return r * cos, r * sin


# --------------------------------------------------------------------------------------
# The streams
# --------------------------------------------------------------------------------------


def _blocks(ops, k0, k1, c_hi, c_lo, count):
    """Blocks ``counter .. counter + count - 1`` of key ``(k0, k1)``: ``(y0, y1)``, 1-d."""
    lo = ops.add(ops.arange(count), c_lo)
    hi = ops.add(c_hi, ops.less_as_word(lo, c_lo))  # carry out of the low word
    return _threefry_core(ops, k0, k1, hi, lo)


def _uniform24(ops, w, fmt):
    """``(w >> 8) * 2**-24`` for 32-bit words ``w``: exact in float32 and float64."""
    return ops.int_to_float(w >> 8, fmt) * 2.0**-24


def _uniform53(ops, wa, wb, fmt):
    """``((wa >> 5) * 2**26 + (wb >> 6)) * 2**-53``: exact in float64."""
    return (ops.int_to_float(wa >> 5, fmt) * 2.0**26 + ops.int_to_float(wb >> 6, fmt)) * (2.0**-53)


def _generate(ops, k0, k1, c_hi, c_lo, *, kind: str, n: int, dtype, rows=None):
    """The flat (1-d) output of a draw of ``n`` values; see the module docstring.

    ``rows``: the keys are ``(rows, 1)`` arrays (one stream per row) and the output is
    ``(rows, n)``: the blocks of every row are computed at once, laid end to end and passed
    through the same elementwise operations as a single draw's, so row ``j`` is the draw
    of key ``j`` alone, bit for bit."""
    pairs = (n + 1) // 2

    def blocks(count):
        y0, y1 = _blocks(ops, k0, k1, c_hi, c_lo, count)
        return (y0, y1) if rows is None else (y0.reshape(-1), y1.reshape(-1))

    def first(flat, width):  # the first n of each row's ``width`` values
        return flat[:n] if rows is None else flat.reshape(rows, width)[:, :n]

    if kind == "bits":
        y0, y1 = blocks(pairs)
        return first(ops.interleave(y0, y1), 2 * pairs)
    fmt = _FORMATS[dtype]
    if kind == "uniform":
        if dtype == "float32":
            y0, y1 = blocks(pairs)
            return first(_uniform24(ops, ops.interleave(y0, y1), fmt), 2 * pairs)
        y0, y1 = blocks(n)
        return first(_uniform53(ops, y0, y1, fmt), n)
    # normal
    if dtype == "float32":
        y0, y1 = blocks(pairs)
        u_even, u_odd = _uniform24(ops, y0, fmt), _uniform24(ops, y1, fmt)
    else:
        y0, y1 = blocks(2 * pairs)  # each row's 2·pairs values: even and odd alternate
        u = _uniform53(ops, y0, y1, fmt)
        u_even, u_odd = u[0::2], u[1::2]
    z_cos, z_sin = _box_muller(ops, 1.0 - u_even, u_odd, fmt)
    return first(ops.interleave(z_cos, z_sin), 2 * pairs)


_EAGER_TORCH: dict = {}


def _eager_torch(fn):
    """``fn`` wrapped so that torch.compile runs it eagerly (generated code may use FMA)."""
    wrapped = _EAGER_TORCH.get(fn)
    if wrapped is None:
        import torch

        disable = getattr(getattr(torch, "compiler", None), "disable", None)
        wrapped = _EAGER_TORCH[fn] = disable(fn) if disable is not None else fn
    return wrapped


@functools.cache
def _jax_generate():
    import jax

    ops = _JaxOps()
    return jax.jit(functools.partial(_generate, ops), static_argnames=("kind", "n", "dtype"))


def _jax_x64_enabled() -> bool:
    import jax

    return jax.dtypes.canonicalize_dtype(np.float64) == np.float64


def _jax_words64(value, name: str, fn: str):
    """A seed or counter for the jax backend as two uint32 words ``(hi, lo)``.

    Accepts a Python int in ``[0, 2**64)``, an integer scalar array (64-bit types are
    split; narrower types give ``hi = 0``) or a ``uint32`` array of shape ``(2,)`` holding
    ``(hi, lo)``. Arrays may be traced; their values are not checked.
    """
    import jax.numpy as jnp

    if _is_int(value):
        hi, lo = _split64(value, name, fn)
        return jnp.asarray(hi, dtype=jnp.uint32), jnp.asarray(lo, dtype=jnp.uint32)
    try:
        arr = jnp.asarray(value)
    except TypeError:
        arr = None
    if arr is None or not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(
            f"xopt.random.{fn}: {name} must be an int in [0, 2**64) or an integer jax "
            f"array, got {value!r}"
        )
    if arr.shape == (2,):
        return arr[0].astype(jnp.uint32), arr[1].astype(jnp.uint32)
    if arr.shape != ():
        raise ValueError(
            f"xopt.random.{fn}: {name} array must have shape () or (2,), got {arr.shape}"
        )
    if arr.dtype.itemsize == 8:
        return (arr >> 32).astype(jnp.uint32), (arr & _MASK32).astype(jnp.uint32)
    return jnp.zeros((), jnp.uint32), arr.astype(jnp.uint32)


def _draw(fn: str, kind: str, seed, shape, counter, dtype, backend, device):
    _check_backend(backend, fn)
    _check_device(device, backend, fn)
    dims = _check_shape(shape, fn)
    n = _num_elements(dims)
    if kind != "bits":
        dtype = _check_dtype(dtype, fn)
    reserved = blocks_used(dims, "uint32" if kind == "bits" else dtype)
    if reserved > 2**32:
        raise ValueError(f"xopt.random.{fn}: shape={dims} is too large for one draw")
    if backend == "jax":
        if dtype == "float64" and not _jax_x64_enabled():
            raise ValueError(
                f"xopt.random.{fn}: dtype='float64' with backend='jax' needs 64-bit "
                "types; enable them with jax.config.update('jax_enable_x64', True)"
            )
        k0, k1 = _jax_words64(seed, "seed", fn)
        c_hi, c_lo = _jax_words64(counter, "counter", fn)
        if _is_int(counter) and counter + reserved > 2**64:
            raise ValueError(
                f"xopt.random.{fn}: counter={counter} + {reserved} blocks runs past 2**64"
            )
        flat = _jax_generate()(k0, k1, c_hi, c_lo, kind=kind, n=n, dtype=dtype)
        return flat.reshape(dims)
    k0, k1 = _split64(seed, "seed", fn)
    c_hi, c_lo = _split64(counter, "counter", fn)
    if counter + reserved > 2**64:
        raise ValueError(f"xopt.random.{fn}: counter={counter} + {reserved} blocks runs past 2**64")
    if backend == "numpy":
        return _generate(_NumpyOps, k0, k1, c_hi, c_lo, kind=kind, n=n, dtype=dtype).reshape(dims)
    ops = _TorchOps(device)
    flat = _eager_torch(_generate)(ops, k0, k1, c_hi, c_lo, kind=kind, n=n, dtype=dtype)
    return flat.reshape(dims)


def _normal_many_args(seeds, shape, counter, dtype):
    """:func:`normal_many`'s checks (its messages): ``(dims, [(hi, lo) of each seed],
    counter hi, counter lo, dtype name)``. Also the checks of xopt.kernels.normal's draw."""
    fn = "normal_many"
    dims = _check_shape(shape, fn)
    dtype = _check_dtype(dtype, fn)
    try:
        seeds = list(seeds)
    except TypeError:
        raise ValueError(f"xopt.random.{fn}: seeds must be a sequence of ints, got "
                         f"{seeds!r}") from None
    if not seeds:
        raise ValueError(f"xopt.random.{fn}: seeds is empty")
    words = [_split64(s, f"seeds[{j}]", fn) for j, s in enumerate(seeds)]
    c_hi, c_lo = _split64(counter, "counter", fn)
    reserved = blocks_used(dims, dtype)
    if reserved > 2**32:
        raise ValueError(f"xopt.random.{fn}: shape={dims} is too large for one draw")
    if counter + reserved > 2**64:
        raise ValueError(f"xopt.random.{fn}: counter={counter} + {reserved} blocks runs past 2**64")
    return dims, words, c_hi, c_lo, dtype


def normal_many(seeds, shape, *, counter=0, dtype="float32", backend: str = "numpy",
                device=None):
    """:func:`normal` of every seed of ``seeds``, stacked: ``(len(seeds), *shape)``, row
    ``j`` bit for bit ``normal(seeds[j], shape, counter=counter, ...)``.

    One computation for all seeds (each elementwise operation once over every row's
    values, the Threefry keys broadcast per row) instead of one per seed: the draws of
    many same-shaped tensors (Flora's projections) in a fixed number of operations.

    Args:
        seeds: a non-empty sequence of ints in ``[0, 2**64)`` (checked, each named by its
            index).
        shape, counter, dtype, backend, device: as in :func:`normal` (``counter`` a Python
            int, shared by every seed).
    """
    fn = "normal_many"
    _check_backend(backend, fn)
    _check_device(device, backend, fn)
    dims, words, c_hi, c_lo, dtype = _normal_many_args(seeds, shape, counter, dtype)
    if backend == "jax" and dtype == "float64" and not _jax_x64_enabled():
        raise ValueError(
            f"xopt.random.{fn}: dtype='float64' with backend='jax' needs 64-bit "
            "types; enable them with jax.config.update('jax_enable_x64', True)"
        )
    rows, n = len(seeds), _num_elements(dims)
    hi = np.array([[w[0]] for w in words], dtype=np.uint32)
    lo = np.array([[w[1]] for w in words], dtype=np.uint32)
    if backend == "numpy":
        flat = _generate(_NumpyOps, hi, lo, c_hi, c_lo, kind="normal", n=n, dtype=dtype,
                         rows=rows)
    elif backend == "torch":
        import torch

        k0 = torch.as_tensor(hi.astype(np.int64), device=device)
        k1 = torch.as_tensor(lo.astype(np.int64), device=device)
        flat = _eager_torch(_generate)(_TorchOps(device), k0, k1, c_hi, c_lo, kind="normal",
                                       n=n, dtype=dtype, rows=rows)
    else:
        import jax.numpy as jnp

        flat = _generate(_JaxOps(), jnp.asarray(hi), jnp.asarray(lo),
                         jnp.asarray(c_hi, dtype=jnp.uint32), jnp.asarray(c_lo, dtype=jnp.uint32),
                         kind="normal", n=n, dtype=dtype, rows=rows)
    return flat.reshape((rows, *dims))


def bits(seed, shape, *, counter=0, backend: str = "numpy", device=None):
    """``prod(shape)`` random 32-bit words: word ``k`` (C order) is word ``k % 2`` of
    block ``counter + k // 2`` (``y0`` first, then ``y1``) of ``seed``'s stream.

    Args:
        seed: int in ``[0, 2**64)``. With ``backend="jax"`` also an integer jax array:
            a scalar (64-bit types are split into two words; narrower types are taken as
            ``seed < 2**32``) or a ``uint32`` array ``[hi, lo]`` of shape ``(2,)`` (the
            form to use for traced 64-bit seeds without ``jax_enable_x64``).
        shape: int or tuple of ints (``()`` gives one word, a 0-d array).
        counter: first block index, int in ``[0, 2**64)`` (jax: same forms as ``seed``).
        backend: ``"numpy"``, ``"torch"`` or ``"jax"``.
        device: torch device (torch backend only), e.g. ``"cuda"``.

    Returns:
        Array of ``shape``: ``numpy.uint32``, ``jax.numpy.uint32``, or ``torch.int64``
        holding values in ``[0, 2**32)``. Uses ``blocks_used(shape)`` blocks.
    """
    return _draw("bits", "bits", seed, shape, counter, None, backend, device)


def uniform(seed, shape, *, counter=0, dtype="float32", backend: str = "numpy", device=None):
    """Uniform floats in ``[0, 1)`` of ``shape`` and ``dtype`` (``"float32"``/``"float64"``).

    float32: ``out[k] = (W[k] >> 8) * 2**-24`` with ``W = bits(seed, shape, counter)``
    flattened; 24 random bits, values ``j * 2**-24``.
    float64: ``out[k] = ((W[2k] >> 5) * 2**26 + (W[2k+1] >> 6)) * 2**-53`` with ``W`` the
    word stream of 2 * prod(shape) words; 53 random bits. Both are exact, hence identical
    in every backend. jax float64 needs ``jax_enable_x64``. Arguments as in :func:`bits`;
    uses ``blocks_used(shape, dtype)`` blocks.
    """
    return _draw("uniform", "uniform", seed, shape, counter, dtype, backend, device)


def normal(seed, shape, *, counter=0, dtype="float32", backend: str = "numpy", device=None):
    """Standard normal floats of ``shape`` and ``dtype`` (``"float32"``/``"float64"``).

    Box-Muller on pairs of the uniform stream ``U`` of the same dtype (``U[j]`` is value
    ``j`` of ``uniform(seed, (2 * ceil(n/2),), counter=counter, dtype=dtype)``): pair ``p``
    takes ``u1 = 1 - U[2p]`` in ``(0, 1]`` and ``u2 = U[2p+1]``, and gives
    ``out[2p] = r cos(2 pi u2)`` and ``out[2p+1] = r sin(2 pi u2)`` with
    ``r = sqrt(-2 log u1)`` (C order; an odd count drops the last sine). ``log``, ``cos``
    and ``sin`` are this module's own (see the module docstring), so the values are
    bit-identical across backends. jax float64 needs ``jax_enable_x64``. Arguments as in
    :func:`bits`; uses ``blocks_used(shape, dtype)`` blocks.
    """
    return _draw("normal", "normal", seed, shape, counter, dtype, backend, device)
