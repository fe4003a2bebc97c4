"""xopt.specs.arrays.divide: ``a / b`` rounded once (IEEE, ties to even) in every namespace.

JAX's float32 path is integer arithmetic on the bit patterns, so its result cannot depend
on how XLA lowers a float division (PTX ``div.full.f32`` on GPUs is approximate). Two
checks make that trustworthy on a device whose division we do not run here: the values,
bit for bit against NumPy's IEEE division under ``jax.jit`` (on whatever backend jax
runs: the CPU in CI, the GPU on a GPU machine), and the program, which holds no float
division at all (so nothing a compiler does to one can reach the quotient).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xopt.specs import arrays

jax = pytest.importorskip("jax")
jnp = jax.numpy
import jax.extend  # noqa: E402  (jaxprs_in_params)

N = 32  # pairs per hypothesis example: one compiled shape


def _jit_divide():
    return jax.jit(lambda a, b: arrays.divide(jnp, a, b))


_DIVIDE = _jit_divide()


def _assert_same_bits(got, want):
    """Equal bit patterns (the sign of zero included); any NaN matches any NaN (NaN
    payloads differ between CPUs and GPUs and are not part of IEEE's rounding)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[want.dtype.itemsize]
    same = (got.view(uint) == want.view(uint)) | (np.isnan(got) & np.isnan(want))
    if not same.all():
        i = np.flatnonzero(~same.reshape(-1))[:5]
        pytest.fail(f"{(~same).sum()} of {same.size} differ; first: "
                    + ", ".join(f"{got.reshape(-1)[k]!r} != {want.reshape(-1)[k]!r}"
                                for k in i))


def _f32_from_bits(bits) -> np.ndarray:
    return np.asarray(bits, np.uint64).astype(np.uint32).view(np.float32)


# a float32 drawn from its fields: every exponent equally (0: zeros and subnormals, 255:
# inf and NaN), significands at their edges and in between
_EXPONENT = st.one_of(st.integers(0, 255), st.sampled_from([0, 1, 2, 126, 127, 253, 254, 255]))
_MANTISSA = st.one_of(st.integers(0, 2**23 - 1),
                      st.sampled_from([0, 1, 2, 3, 2**22, 2**23 - 1, 2**23 - 2]))
_FIELDS = st.builds(lambda s, e, m: (s << 31) | (e << 23) | m,
                    st.integers(0, 1), _EXPONENT, _MANTISSA)
_FLOATS = st.one_of(_FIELDS, st.floats(width=32, allow_nan=True, allow_subnormal=True).map(
    lambda x: int(np.float32(x).view(np.uint32))))


@settings(max_examples=120, deadline=None)
@given(st.lists(_FLOATS, min_size=2 * N, max_size=2 * N))
def test_jit_equals_numpy_bit_for_bit(bits):
    a, b = _f32_from_bits(bits[:N]), _f32_from_bits(bits[N:])
    with np.errstate(all="ignore"):
        want = a / b
    _assert_same_bits(_DIVIDE(a, b), want)


def test_random_pairs_in_bulk():
    """Many pairs in one call: uniform bit patterns (mostly far-apart exponents),
    normal-range quotients, and quotients in and around the subnormal range."""
    rng = np.random.default_rng(4)
    n = 1 << 16
    x, y = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    a = np.concatenate([_f32_from_bits(rng.integers(0, 2**32, n)), x, x * np.float32(1e-36),
                        x * np.float32(1e-42)])
    b = np.concatenate([_f32_from_bits(rng.integers(0, 2**32, n)), y, y * np.float32(16),
                        y * np.float32(1e-3)])
    with np.errstate(all="ignore"):
        want = a / b
    assert np.count_nonzero((want != 0) & (np.abs(want) < np.finfo(np.float32).tiny)) > n // 2
    _assert_same_bits(_DIVIDE(a, b), want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2**12 - 1), st.integers(1, 2**12 - 1),
                          st.integers(-149, 100)), min_size=N, max_size=N))
def test_exact_quotients_are_exact(triples):
    """(q·b) / b = q: q and b's significand are 12-bit integers, so q·b has ≤ 24 bits and
    with b = m·2^k, k ≥ -149, every b and q·b is a float32 (subnormals included)."""
    q = np.array([t[0] for t in triples], np.float32)
    b = np.array([np.ldexp(t[1], t[2]) for t in triples], np.float64)
    a = q.astype(np.float64) * b
    assert np.array_equal(a.astype(np.float32).astype(np.float64), a)  # exact in float32
    a, b = a.astype(np.float32), b.astype(np.float32)
    _assert_same_bits(_DIVIDE(a, b), q)


def _hand_picked() -> tuple[np.ndarray, np.ndarray]:
    f = np.float32
    tiny = np.finfo(np.float32).smallest_subnormal  # 2^-149
    normal = np.finfo(np.float32).tiny  # 2^-126
    big = np.finfo(np.float32).max
    rng = np.random.default_rng(0)
    many = np.concatenate([rng.standard_normal(200).astype(f),
                           _f32_from_bits(rng.integers(1, 0x7F800000, 200)),
                           np.array([tiny, 3 * tiny, normal, big, 1.0, 255.0, 1e-5], f)])
    pairs = [
        (4.6875, 0.9375),  # = 5, an exact quotient
        (1.0, 3.0), (2.0, 3.0), (1.0, 255.0), (1e-5, 255.0), (0.3, 255.0),
        (tiny, 2.0),  # 2^-150: a tie between 0 and 2^-149, to even: +0
        (3 * tiny, 2.0),  # 1.5·2^-149: a tie, to even: 2^-148
        (5 * tiny, 2.0), (7 * tiny, 4.0), (tiny, 3.0), (2 * tiny, 3.0),
        (normal, 1.0000001), (normal, 2.0), (normal, 0.99999994),  # around the first normal
        (f(normal) * f(1.5), 1.5), (normal - tiny, 1.0), (1.0, big),
        (big, 0.5), (-big, 0.5), (big, 0.99999994), (big, 1.0), (1.0, tiny),  # overflow
        (big, 2.0), (tiny, big), (-tiny, big), (tiny, -4.0),  # underflow, signed zeros
        (0.0, 1.0), (-0.0, 1.0), (0.0, -1.0), (1.0, 0.0), (-1.0, 0.0), (1.0, -0.0),
        (0.0, 0.0), (np.inf, 2.0), (-np.inf, 2.0), (2.0, np.inf), (2.0, -np.inf),
        (np.inf, np.inf), (np.inf, 0.0), (0.0, np.inf), (np.nan, 1.0), (1.0, np.nan),
        (tiny, tiny), (tiny, normal), (normal, tiny),
    ]
    a = np.concatenate([np.array([p[0] for p in pairs], f), many])
    b = np.concatenate([np.array([p[1] for p in pairs], f), many])  # a / a = 1
    return a, b


def test_hand_picked_cases():
    a, b = _hand_picked()
    with np.errstate(all="ignore"):
        want = a / b
    _assert_same_bits(_DIVIDE(a, b), want)
    _assert_same_bits(arrays.divide(jnp, jnp.asarray(a), jnp.asarray(b)), want)  # eager
    got = np.asarray(_DIVIDE(a, b))
    assert got[0] == np.float32(5)
    same = np.isfinite(b) & (b != 0) & (a == b)
    assert same.sum() > 400 and np.all(got[same] == 1)  # a / a
    assert got[6] == 0 and not np.signbit(got[6])  # 2^-150 → +0 (ties to even)
    assert got[7] == np.float32(2 * np.finfo(np.float32).smallest_subnormal)


def test_broadcast_scalars_and_dtypes():
    """Python numbers and broadcast operands divide as jnp's ``/`` promotes them; float16
    and bfloat16 quotients are the float32 quotient rounded once more (correctly rounded,
    since 24 ≥ 2·11 + 2), compared here with NumPy's float16 division."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    col = (rng.random((3, 1)) + 0.5).astype(np.float32)
    _assert_same_bits(jax.jit(lambda x, y: arrays.divide(jnp, x, y))(a, col), a / col)
    _assert_same_bits(jax.jit(lambda x: arrays.divide(jnp, x, 255))(a), a / np.float32(255))
    _assert_same_bits(jax.jit(lambda x: arrays.divide(jnp, 1.0, x))(col), np.float32(1) / col)
    h = _f32_from_bits(rng.integers(0, 2**32, 4096)).astype(np.float16)
    k = _f32_from_bits(rng.integers(0, 2**32, 4096)).astype(np.float16)
    with np.errstate(all="ignore"):
        want = h / k
    _assert_same_bits(_DIVIDE(h, k), want)
    bf = jnp.bfloat16
    x, y = jnp.asarray(a, bf), jnp.asarray(col, bf)
    got = jax.jit(lambda u, v: arrays.divide(jnp, u, v))(x, y)
    assert got.dtype == bf
    ref = (np.asarray(x, np.float64) / np.asarray(y, np.float64)).astype(bf)  # rounded once
    _assert_same_bits(got, np.asarray(ref))


def _float_divides(jaxpr) -> list[str]:
    """The ``div`` equations on floating operands anywhere in a (closed) jaxpr."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "div" and any(
                jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.invars):
            found.append(str(eqn))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _float_divides(sub)
    return found


def _assert_no_float_division(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    assert not _float_divides(closed.jaxpr)
    lowered = jax.jit(fn).lower(*args)
    assert not re.search(r"stablehlo\.divide", lowered.as_text())  # of any type
    assert not re.search(r"\bdivide\(", lowered.compile().as_text())  # nor after XLA's passes


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_program_has_no_float_division(dtype):
    x = jnp.ones((4, 8), dtype)
    _assert_no_float_division(lambda a, b: arrays.divide(jnp, a, b), x, x)
    # the checks see a plain division: they are not vacuous
    assert _float_divides(jax.make_jaxpr(lambda a, b: a / b)(x, x).jaxpr)
    lowered = jax.jit(lambda a, b: a / b).lower(x, x)
    assert re.search(r"stablehlo\.divide", lowered.as_text())
    assert re.search(r"\bdivide\(", lowered.compile().as_text())


def test_quantisers_have_no_float_division():
    """POET-XQ's weight quantisation and 8-bit COAP's state quantisation, as jitted under
    jax.numpy: every division in them is :func:`arrays.divide`."""
    from xopt.specs import coap, poet

    w = jnp.asarray(np.random.default_rng(2).standard_normal((16, 32)), jnp.float32)
    _assert_no_float_division(lambda v: poet.quantize_weight(v, 64, xp=jnp), w)
    _assert_no_float_division(lambda v: coap.quantize(jnp, v), w)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if __import__("torch").cuda.is_available()
                                              else []))
def test_torch_rounds_once_with_python_numbers(device):
    """torch computes ``x / t`` as ``t.reciprocal() * x`` and, on CUDA, ``t / x`` as
    ``t * (1/x)``: two roundings. arrays.divide makes the number a tensor first."""
    import torch

    rng = np.random.default_rng(3)
    t = rng.standard_normal(20000).astype(np.float32)
    tt = torch.as_tensor(t, device=device)
    for got, want in ((arrays.divide(torch, 3.0, tt), np.float32(3) / t),
                      (arrays.divide(torch, tt, 3.0), t / np.float32(3)),
                      (arrays.divide(torch, tt, 255), t / np.float32(255)),
                      (arrays.divide(torch, tt, tt[:1] + 2), t / (t[:1] + np.float32(2)))):
        _assert_same_bits(got.cpu().numpy(), want)
    assert not np.array_equal((3.0 / tt).cpu().numpy(), np.float32(3) / t)  # why
