"""Tests of xopt.random: Threefry known answers, cross-backend bit identity, accuracy of
the module's own log/sin/cos, distribution statistics, counter arithmetic and errors."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

import xopt.random as R

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (key0, key1, x0, x1) -> (y0, y1): Threefry-2x32-20 known answers (Random123 kat_vectors).
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344, 0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]

SEEDS = [0, 1, 2**63 + 5]
COUNTERS = [0, 7, 2**40]
SHAPES = [(), (0,), (1,), (7,), (2, 3, 5), (3, 0, 2), (4, 1, 1, 3)]


# ------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------


def _torch():
    return pytest.importorskip("torch")


def _jax():
    return pytest.importorskip("jax")


def _x64():
    """Context manager turning on jax's 64-bit types (jax.enable_x64 or the old name)."""
    jax = _jax()
    cm = getattr(jax, "enable_x64", None)
    if cm is None:
        from jax.experimental import enable_x64 as cm
    return cm(True)


def _np(x):
    """Any backend's array as numpy (words as uint64, floats unchanged)."""
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    return x.astype(np.uint64) if x.dtype.kind in "iu" else x


def _assert_same_bits(a, b):
    a, b = _np(a), _np(b)
    assert a.shape == b.shape
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    if a.dtype.kind == "f":
        a = a.view(np.uint32 if a.dtype == np.float32 else np.uint64)
        b = b.view(np.uint32 if b.dtype == np.float32 else np.uint64)
    np.testing.assert_array_equal(a, b)


def _jax_threefry_reference():
    """JAX's own threefry_2x32(keypair, count), wherever this jax version keeps it."""
    _jax()
    import importlib

    for module, name in [
        ("jax.extend.random", "threefry_2x32"),
        ("jax.random", "threefry_2x32"),
        ("jax.prng", "threefry_2x32"),
        ("jax._src.prng", "threefry_2x32"),
        ("jax._src.random.threefry2x32", "threefry_2x32"),
    ]:
        try:
            fn = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if fn is not None:
            return fn
    pytest.skip("this jax has no threefry_2x32")


def _py_block(seed: int, block: int) -> tuple[int, int]:
    """Block ``block`` of ``seed``'s stream, in pure Python ints."""
    k0, k1 = R.key_from_seed(seed)
    block %= 2**64
    return R._threefry_core(R._PyOps, k0, k1, block >> 32, block & 0xFFFFFFFF)


def _ulps32(x, ref):
    """|x - ref| in units of the float32 spacing at ref (ref in float64)."""
    spacing = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    return np.abs(x.astype(np.float64) - ref) / spacing


def _ulps64(x, ref):
    """|x - ref| in units of the float64 spacing at ref (ref in long double)."""
    spacing = np.spacing(np.abs(ref).astype(np.float64)).astype(np.longdouble)
    return np.asarray(np.abs(x.astype(np.longdouble) - ref) / spacing, dtype=np.float64)


def _quarter_reference(q, f, sin, cos, pi):
    """cos/sin of (q + f) * pi/2 with the same exact reduction as the module, so the
    reference is accurate near the zeros too (q quadrant, f in [0, 1))."""
    upper = f > 0.5
    g = np.where(upper, 1 - f, f)
    s, c = sin(pi / 2 * g), cos(pi / 2 * g)
    sf, cf = np.where(upper, c, s), np.where(upper, s, c)
    ref_cos = np.select([q == 0, q == 1, q == 2], [cf, -sf, -cf], sf)
    ref_sin = np.select([q == 0, q == 1, q == 2], [sf, cf, -sf], -cf)
    return ref_cos, ref_sin


needs_long_double = pytest.mark.skipif(
    np.finfo(np.longdouble).nmant < 63, reason="needs an 80-bit long double reference"
)


# ------------------------------------------------------------------------------------
# Threefry-2x32-20
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["python", "numpy", "torch", "jax", "jax-jit"])
def test_known_answer_vectors(backend):
    for (k0, k1, x0, x1), expected in KAT:
        if backend == "python":
            got = R._threefry_core(R._PyOps, k0, k1, x0, x1)
        elif backend == "jax-jit":
            jax = _jax()
            got = jax.jit(lambda a, b, c, d: R.threefry2x32(a, b, c, d, backend="jax"))(
                *(np.uint32(v) for v in (k0, k1, x0, x1))
            )
        else:
            if backend == "torch":
                _torch()
            if backend == "jax":
                _jax()
            got = R.threefry2x32(k0, k1, x0, x1, backend=backend)
        assert tuple(int(v) for v in got) == expected


def test_known_answers_vectorised():
    keys0, keys1, xs0, xs1 = np.array([k for k, _ in KAT], dtype=np.uint32).T
    y0, y1 = R.threefry2x32(keys0, keys1, xs0, xs1)
    assert y0.dtype == np.uint32 and y0.shape == (3,)
    assert [(int(a), int(b)) for a, b in zip(y0, y1, strict=True)] == [e for _, e in KAT]
    # scalar inputs give 0-d arrays; broadcasting a scalar key over counters works
    s0, s1 = R.threefry2x32(0, 0, 0, 0)
    assert s0.shape == () and int(s0) == 0x6B200159 and int(s1) == 0x99BA4EFE
    b0, b1 = R.threefry2x32(0, 0, np.zeros((2, 3), np.uint32), 0)
    assert b0.shape == (2, 3) and np.all(b0 == 0x6B200159) and np.all(b1 == 0x99BA4EFE)


def test_matches_jax_threefry_on_random_inputs():
    jax = _jax()
    torch = _torch()
    ref = _jax_threefry_reference()
    rng = np.random.default_rng(1234)
    k0, k1, x0, x1 = rng.integers(0, 2**32, size=(4, 4096), dtype=np.uint64).astype(np.uint32)

    def one(key, count):
        return ref((key[0], key[1]), count)

    out = np.asarray(jax.vmap(one)(np.stack([k0, k1], 1), np.stack([x0, x1], 1)))
    y0, y1 = R.threefry2x32(k0, k1, x0, x1)
    np.testing.assert_array_equal(y0, out[:, 0])
    np.testing.assert_array_equal(y1, out[:, 1])
    t0, t1 = R.threefry2x32(
        *(torch.from_numpy(a.astype(np.int64)) for a in (k0, k1, x0, x1)), backend="torch"
    )
    assert t0.dtype == torch.int64
    np.testing.assert_array_equal(t0.numpy(), y0.astype(np.int64))
    np.testing.assert_array_equal(t1.numpy(), y1.astype(np.int64))
    j0, j1 = R.threefry2x32(k0, k1, x0, x1, backend="jax")
    np.testing.assert_array_equal(np.asarray(j0), y0)
    np.testing.assert_array_equal(np.asarray(j1), y1)
    for i in range(0, 4096, 512):  # and the pure-Python version
        assert _py_block_words(k0[i], k1[i], x0[i], x1[i]) == (int(y0[i]), int(y1[i]))


def _py_block_words(k0, k1, x0, x1):
    return R._threefry_core(R._PyOps, int(k0), int(k1), int(x0), int(x1))


# ------------------------------------------------------------------------------------
# Stream definition
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seed, counter", [(0, 0), (2**63 + 5, 2**40 + 3), (9, 2**32 - 2), (12345, 2**64 - 6)]
)
def test_bits_follow_the_documented_layout(seed, counter):
    n = 11  # odd: the last block's second word is dropped
    words = R.bits(seed, (n,), counter=counter)
    assert words.dtype == np.uint32
    expected = [_py_block(seed, counter + k // 2)[k % 2] for k in range(n)]
    assert [int(w) for w in words] == expected
    assert R.blocks_used((n,)) == 6


def test_uniform_and_normal_follow_the_documented_layout():
    seed, counter, n = 77, 5, 2001
    words = R.bits(seed, (2 * n,), counter=counter).astype(np.uint64)
    u32 = R.uniform(seed, (n,), counter=counter)
    assert u32.dtype == np.float32
    np.testing.assert_array_equal(u32, (words[:n] >> np.uint64(8)).astype(np.float64) * 2.0**-24)
    u64 = R.uniform(seed, (n,), counter=counter, dtype="float64")
    assert u64.dtype == np.float64
    hi, lo = words[0::2] >> np.uint64(5), words[1::2] >> np.uint64(6)
    np.testing.assert_array_equal(u64, (hi * np.uint64(2**26) + lo).astype(np.float64) * 2.0**-53)

    # normal pair p: u1 = 1 - U[2p], u2 = U[2p+1]; out = r cos, r sin (within a few ulp of
    # a float64 evaluation of the formula; the exact bits are pinned by other tests)
    for dtype in ("float32", "float64"):
        z = R.normal(seed, (n,), counter=counter, dtype=dtype)
        assert z.dtype == np.dtype(dtype)
        u = R.uniform(seed, (n + 1,), counter=counter, dtype=dtype).astype(np.float64)
        r = np.sqrt(-2.0 * np.log(1.0 - u[0::2]))
        ref = np.empty(n + 1)
        ref[0::2], ref[1::2] = r * np.cos(2 * np.pi * u[1::2]), r * np.sin(2 * np.pi * u[1::2])
        if dtype == "float32":
            assert _ulps32(z, ref[:n]).max() <= 4
        else:
            np.testing.assert_allclose(z, ref[:n], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kind, dtype",
    [
        ("bits", "uint32"),
        ("uniform", "float32"),
        ("normal", "float32"),
        ("uniform", "float64"),
        ("normal", "float64"),
    ],
)
def test_consecutive_draws_are_halves_of_one_draw(kind, dtype):
    def draw(seed, shape, counter):
        if kind == "bits":
            return R.bits(seed, shape, counter=counter)
        return getattr(R, kind)(seed, shape, counter=counter, dtype=dtype)

    shape = (3, 4)
    step = R.blocks_used(shape, dtype)
    for seed, counter in [(5, 0), (2**63 + 5, 2**32 - 3), (1, 2**40)]:
        first, second = draw(seed, shape, counter), draw(seed, shape, counter + step)
        _assert_same_bits(np.concatenate([first, second]), draw(seed, (6, 4), counter))
        # an odd-sized draw is a prefix of a longer one
        _assert_same_bits(draw(seed, (5,), counter), draw(seed, (12,), counter)[:5])


def test_blocks_used():
    assert R.blocks_used(()) == 1
    assert R.blocks_used((0,)) == 0
    assert R.blocks_used(7) == 4
    assert R.blocks_used((2, 3)) == 3
    assert R.blocks_used((7,), "float32") == 4
    assert R.blocks_used((7,), "float64") == 8
    assert R.blocks_used((6,), "float64") == 6
    assert R.blocks_used((2, 3), np.float64) == 6


def test_seeds_counters_and_fold_in_give_different_streams():
    draws = [R.bits(s, (64,)) for s in (0, 1, 2**32, 2**63 + 5)]
    draws += [R.bits(0, (64,), counter=c) for c in (32, 2**32)]
    for i in range(len(draws)):
        for j in range(i):
            assert not np.array_equal(draws[i], draws[j])

    seed = 2**63 + 5
    layer_seeds = [R.fold_in(seed, layer, refresh) for layer in range(40) for refresh in range(25)]
    assert len(set(layer_seeds)) == len(layer_seeds)
    assert all(0 <= s < 2**64 for s in layer_seeds)
    assert seed not in layer_seeds
    assert R.fold_in(seed) == seed
    assert R.fold_in(seed, 3, 4) == R.fold_in(R.fold_in(seed, 3), 4)
    assert R.fold_in(seed, 3, 4) != R.fold_in(seed, 4, 3)
    assert R.fold_in(seed, 3) != R.fold_in(seed + 1, 3)
    # the documented definition
    d = 2**40 + 17
    y0, y1 = R.threefry2x32(*R.key_from_seed(seed), (d >> 32) ^ 0x666F6C64, d & 0xFFFFFFFF)
    assert R.fold_in(seed, d) == (int(y0) << 32) | int(y1)
    assert R.fold_in(0, 0) == _fold_py(0, 0)
    a = R.normal(R.fold_in(seed, 0), (16,))
    b = R.normal(R.fold_in(seed, 1), (16,))
    assert not np.array_equal(a, b)


def _fold_py(seed, d):
    y0, y1 = R._threefry_core(
        R._PyOps, seed >> 32, seed & 0xFFFFFFFF, (d >> 32) ^ 0x666F6C64, d & 0xFFFFFFFF
    )
    return (y0 << 32) | y1


def test_key_from_seed():
    assert R.key_from_seed(0) == (0, 0)
    assert R.key_from_seed(2**64 - 1) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert R.key_from_seed(0x0123456789ABCDEF) == (0x01234567, 0x89ABCDEF)
    assert R.key_from_seed(np.uint64(5)) == (0, 5)


# ------------------------------------------------------------------------------------
# Cross-backend bit identity
# ------------------------------------------------------------------------------------


def _all_draws(seed, shape, counter, backend, device=None):
    kw = dict(counter=counter, backend=backend)
    if device is not None:
        kw["device"] = device
    return (R.bits(seed, shape, **kw), R.uniform(seed, shape, **kw), R.normal(seed, shape, **kw))


def _traced_words(value):
    return np.array([value >> 32, value & 0xFFFFFFFF], dtype=np.uint32)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cross_backend_float32_bit_identical(shape):
    torch = _torch()
    jax = _jax()

    @jax.jit
    def jitted(seed_words, counter_words):
        return _all_draws(seed_words, shape, counter_words, "jax")

    for seed in SEEDS:
        for counter in COUNTERS:
            ref = _all_draws(seed, shape, counter, "numpy")
            assert ref[0].dtype == np.uint32 and ref[0].shape == shape
            assert ref[1].dtype == np.float32 and ref[2].dtype == np.float32
            assert ref[1].shape == shape and ref[2].shape == shape
            tor = _all_draws(seed, shape, counter, "torch")
            assert tor[0].dtype == torch.int64 and tuple(tor[0].shape) == shape
            jx = _all_draws(seed, shape, counter, "jax")
            jj = jitted(_traced_words(seed), _traced_words(counter))
            for r, t, j, k in zip(ref, tor, jx, jj, strict=True):
                _assert_same_bits(r, t)
                _assert_same_bits(r, j)
                _assert_same_bits(r, k)
    # python-int seeds and counters closed over inside jit
    closed = jax.jit(lambda: _all_draws(2**63 + 5, shape, 2**40, "jax"))()
    for r, k in zip(_all_draws(2**63 + 5, shape, 2**40, "numpy"), closed, strict=True):
        _assert_same_bits(r, k)


@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 7), (1001,)], ids=str)
def test_cross_backend_float64_bit_identical(shape):
    _torch()
    jax = _jax()
    with _x64():
        import jax.numpy as jnp

        @jax.jit
        def jitted(seed, counter):
            return (
                R.uniform(seed, shape, counter=counter, dtype="float64", backend="jax"),
                R.normal(seed, shape, counter=counter, dtype="float64", backend="jax"),
            )

        for seed in SEEDS:
            for counter in COUNTERS:
                kw = dict(counter=counter, dtype="float64")
                ref = (R.uniform(seed, shape, **kw), R.normal(seed, shape, **kw))
                assert ref[0].dtype == np.float64 and ref[1].dtype == np.float64
                tor = (
                    R.uniform(seed, shape, backend="torch", **kw),
                    R.normal(seed, shape, backend="torch", **kw),
                )
                jx = (
                    R.uniform(seed, shape, backend="jax", **kw),
                    R.normal(seed, shape, backend="jax", **kw),
                )
                jj = jitted(jnp.uint64(seed), jnp.uint64(counter))  # traced 64-bit scalars
                for r, t, j, k in zip(ref, tor, jx, jj, strict=True):
                    _assert_same_bits(r, t)
                    _assert_same_bits(r, j)
                    _assert_same_bits(r, k)


def test_large_draw_bit_identical():
    """A draw big enough to exercise vectorised kernels in every backend."""
    _torch()
    _jax()
    n = 300_001
    for fn in (R.uniform, R.normal):
        ref = fn(2024, (n,), counter=2**33)
        _assert_same_bits(ref, fn(2024, (n,), counter=2**33, backend="torch"))
        _assert_same_bits(ref, fn(2024, (n,), counter=2**33, backend="jax"))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_normal_many_rows_are_each_seeds_draw(dtype):
    """normal_many's row j is normal(seeds[j], ...) bit for bit, in every backend (odd and
    even counts, a counter crossing the low word, 64-bit seeds)."""
    torch = _torch()
    seeds = [0, 7, 2**63 + 5, 2**64 - 1]
    for shape, counter in (((3, 5), 0), ((4,), 2**32 - 1)):
        got = R.normal_many(seeds, shape, counter=counter, dtype=dtype)
        tor = R.normal_many(seeds, shape, counter=counter, dtype=dtype, backend="torch")
        assert got.shape == tor.shape == (len(seeds), *shape)
        for j, s in enumerate(seeds):
            ref = R.normal(s, shape, counter=counter, dtype=dtype)
            _assert_same_bits(ref, got[j])
            _assert_same_bits(ref, tor[j])
    assert tor.dtype == getattr(torch, dtype)
    if dtype == "float32":
        _jax()
        jx = R.normal_many(seeds, (3, 5), backend="jax")
        for j, s in enumerate(seeds):
            _assert_same_bits(R.normal(s, (3, 5)), jx[j])
    with pytest.raises(ValueError, match=r"seeds\[1\]"):
        R.normal_many([1, -2], (3,), dtype=dtype)
    with pytest.raises(ValueError, match="seeds is empty"):
        R.normal_many([], (3,), dtype=dtype)


def test_torch_compile_keeps_bits():
    """Under torch.compile the generator still runs eagerly and gives the same bits."""
    torch = _torch()
    try:
        compiled = torch.compile(lambda: R.normal(3, (257,), backend="torch"), backend="eager")
        out = compiled()
    except Exception as exc:  # pragma: no cover - torch.compile unavailable here
        pytest.skip(f"torch.compile unavailable: {exc}")
    _assert_same_bits(R.normal(3, (257,)), out)


# ------------------------------------------------------------------------------------
# Distributions
# ------------------------------------------------------------------------------------


def test_uniform_range():
    u = R.uniform(99, (1_000_000,))
    assert u.min() >= 0.0 and u.max() < 1.0
    assert np.all(u * 2.0**24 == np.floor(u * 2.0**24))  # multiples of 2**-24
    assert abs(u.mean() - 0.5) < 0.002
    v = R.uniform(99, (200_000,), dtype="float64")
    assert v.min() >= 0.0 and v.max() < 1.0
    assert abs(v.mean() - 0.5) < 0.004


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_normal_statistics(dtype):
    n = 1_000_000
    z = R.normal(20240601, (n,), dtype=dtype).astype(np.float64)
    assert np.all(np.isfinite(z))
    assert abs(z.mean()) < 0.005
    assert abs(z.var() - 1.0) < 0.01
    # Kolmogorov-Smirnov statistic against the normal CDF, computed with math.erf
    z.sort()
    erf = np.frompyfunc(math.erf, 1, 1)
    cdf = 0.5 * (1.0 + erf(z / math.sqrt(2.0)).astype(np.float64))
    i = np.arange(1, n + 1)
    ks = max(np.max(i / n - cdf), np.max(cdf - (i - 1) / n))
    assert ks < 0.002
    # both halves of each pair are normal: check the sines alone too
    zs = R.normal(20240601, (n,), dtype=dtype)[1::2].astype(np.float64)
    assert abs(zs.mean()) < 0.007 and abs(zs.var() - 1.0) < 0.014


# ------------------------------------------------------------------------------------
# Accuracy of the module's own log, cos and sin (numpy backend; the other backends are
# bit-identical to it by the tests above)
# ------------------------------------------------------------------------------------

F32 = R._FORMATS["float32"]
F64 = R._FORMATS["float64"]

LOG32_MAX_ULP = 1.0  # measured 0.86 over every float32 u1
COS_SIN32_MAX_ULP = 1.5  # measured 1.24 over every float32 u2
LOG64_MAX_ULP = 1.0  # measured 0.83
COS_SIN64_MAX_ULP = 1.5  # measured 1.31
NORMAL_MAX_ULP = 3.5  # measured 2.9 (float32) and 2.8 (float64)


def _div_sqrt_inputs(dtype, n, seed=0):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    edges = np.array([0.0, 1.0, 2.0, 4.0, 0.25, 3.0, 2.0**-24, 1 - 2.0**-24, 33.27], dt)
    x = np.concatenate([np.exp(rng.uniform(-60, 60, n)).astype(dt), edges])
    # the quotients log() forms: f / (f + 2) for f = m - 1, m in [sqrt(2)/2, sqrt(2)]
    f = np.concatenate(
        [
            rng.uniform(-0.3, 0.42, n).astype(dt),
            np.array([0.0, 2.0**-24, -(2.0**-24), 0.25, -0.29, 2**0.5 - 1], dt),
        ]
    )
    a = np.concatenate([f, (np.exp(rng.uniform(-20, 20, n)) * rng.choice([-1, 1], n)).astype(dt)])
    b = np.concatenate([(f + dt.type(2)).astype(dt), np.exp(rng.uniform(-20, 20, n)).astype(dt)])
    return x, a, b


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_div_and_sqrt_are_correctly_rounded(dtype):
    """The module's own integer division and square root equal IEEE's (numpy's)."""
    fmt = R._FORMATS[dtype]
    x, a, b = _div_sqrt_inputs(dtype, 300_000)
    _assert_same_bits(R._sqrt(R._NumpyOps, x, fmt), np.sqrt(x))
    _assert_same_bits(R._div(R._NumpyOps, a, b, fmt), a / b)
    # exhaustive over every float32 significand, at both exponent parities, for sqrt
    if dtype == "float32":
        x = np.arange(2**23, 2**24, dtype=np.uint32)
        x = np.concatenate([x, x + np.uint32(2**23)]).view(np.float32)  # [1, 4)
        _assert_same_bits(R._sqrt(R._NumpyOps, x, fmt), np.sqrt(x))


def test_div_and_sqrt_match_in_torch_and_jax():
    torch = _torch()
    jax = _jax()
    for dtype in ("float32", "float64"):
        fmt = R._FORMATS[dtype]
        x, a, b = _div_sqrt_inputs(dtype, 50_000, seed=1)
        tops = R._TorchOps(None)
        _assert_same_bits(np.sqrt(x), R._sqrt(tops, torch.from_numpy(x), fmt))
        _assert_same_bits(a / b, R._div(tops, torch.from_numpy(a), torch.from_numpy(b), fmt))
        ctx = _x64() if dtype == "float64" else _nullcontext()
        with ctx:
            jops = R._JaxOps()
            sqrt = jax.jit(lambda v, ops=jops, fmt=fmt: R._sqrt(ops, v, fmt))
            div = jax.jit(lambda u, v, ops=jops, fmt=fmt: R._div(ops, u, v, fmt))
            _assert_same_bits(np.sqrt(x), sqrt(x))
            _assert_same_bits(a / b, div(a, b))


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


def test_log_float32_every_input():
    """Every u1 = k * 2**-24, k = 1 .. 2**24, the whole domain normal() uses."""
    worst = 0.0
    for start in range(1, 2**24 + 1, 2**22):
        k = np.arange(start, min(start + 2**22, 2**24 + 1), dtype=np.float64)
        u = (k * 2.0**-24).astype(np.float32)
        worst = max(worst, _ulps32(R._log(R._NumpyOps, u, F32), np.log(k * 2.0**-24)).max())
    assert worst <= LOG32_MAX_ULP, worst
    edges = np.array(
        [2.0**-24, 2.0**-23, 0.5, 0.5 + 2.0**-24, 2**-0.5, 1 - 2.0**-24, 1.0], dtype=np.float32
    )
    got = R._log(R._NumpyOps, edges, F32)
    assert got[-1] == 0.0 and not np.signbit(got[-1])
    assert _ulps32(got, np.log(edges.astype(np.float64))).max() <= LOG32_MAX_ULP


def test_log_float32_wide_range():
    rng = np.random.default_rng(5)
    x = np.exp(rng.uniform(-87, 88, size=200_000)).astype(np.float32)
    x = x[np.isfinite(x) & (x >= np.finfo(np.float32).tiny)]
    assert _ulps32(R._log(R._NumpyOps, x, F32), np.log(x.astype(np.float64))).max() <= 1.0


def test_cos_sin_float32_every_input():
    """Every u2 = j * 2**-24, j = 0 .. 2**24 - 1, the whole domain normal() uses."""
    worst = 0.0
    for start in range(0, 2**24, 2**22):
        j = np.arange(start, start + 2**22, dtype=np.int64)
        u = (j * 2.0**-24).astype(np.float32)
        c, s = R._cos_sin_turns(R._NumpyOps, u, F32)
        ref_c, ref_s = _quarter_reference(
            j >> 22, (j & (2**22 - 1)) * 2.0**-22, np.sin, np.cos, np.pi
        )
        worst = max(worst, _ulps32(c, ref_c).max(), _ulps32(s, ref_s).max())
    assert worst <= COS_SIN32_MAX_ULP, worst
    # quadrant boundaries are exact
    u = np.array([0.0, 0.25, 0.5, 0.75], dtype=np.float32)
    c, s = R._cos_sin_turns(R._NumpyOps, u, F32)
    np.testing.assert_array_equal(c, [1, 0, -1, 0])
    np.testing.assert_array_equal(s, [0, 1, 0, -1])


@needs_long_double
def test_log_cos_sin_float64():
    ld = np.longdouble
    pi = ld("3.14159265358979323846264338327950288")
    rng = np.random.default_rng(6)
    j = rng.integers(1, 2**53, size=400_000, dtype=np.int64)
    j = np.concatenate([j, [1, 2, 2**52, 2**52 + 1, 2**53 - 1]])
    u1 = 1.0 - (j - 1).astype(ld) * ld(2) ** -53  # (0, 1] like normal()'s u1
    got = R._log(R._NumpyOps, u1.astype(np.float64), F64)
    assert _ulps64(got, np.log(u1)).max() <= LOG64_MAX_ULP
    assert R._log(R._NumpyOps, np.array([1.0]), F64)[0] == 0.0
    x = np.exp(rng.uniform(-700, 700, size=100_000))
    assert _ulps64(R._log(R._NumpyOps, x, F64), np.log(x.astype(ld))).max() <= LOG64_MAX_ULP

    j = rng.integers(0, 2**53, size=400_000, dtype=np.int64)
    j = np.concatenate([j, [0, 1, 2**51 - 1, 2**51, 2**51 + 1, 2**52, 3 * 2**50, 2**53 - 1]])
    u2 = (j.astype(ld) * ld(2) ** -53).astype(np.float64)
    c, s = R._cos_sin_turns(R._NumpyOps, u2, F64)
    ref_c, ref_s = _quarter_reference(
        j >> 51, (j & (2**51 - 1)).astype(ld) * ld(2) ** -51, np.sin, np.cos, pi
    )
    assert max(_ulps64(c, ref_c).max(), _ulps64(s, ref_s).max()) <= COS_SIN64_MAX_ULP


def test_normal_float32_against_float64_formula():
    w = R.bits(11, (2_000_000,))
    u1 = 1.0 - (w[0::2] >> 8).astype(np.float64) * 2.0**-24
    j = (w[1::2] >> 8).astype(np.int64)
    # add the extreme pairs: u1 in {2**-24, 1 - 2**-24, 1} x quadrant edges for u2
    e1 = np.array([2.0**-24, 2.0**-23, 0.5, 1 - 2.0**-24, 1.0])
    e2 = np.array([0, 1, 2**22 - 1, 2**22, 2**22 + 1, 2**23, 3 * 2**22, 2**24 - 1], np.int64)
    u1 = np.concatenate([u1, np.repeat(e1, e2.size)])
    j = np.concatenate([j, np.tile(e2, e1.size)])
    r = np.sqrt(-2.0 * np.log(u1))
    ref_c, ref_s = _quarter_reference(j >> 22, (j & (2**22 - 1)) * 2.0**-22, np.sin, np.cos, np.pi)
    zc, zs = R._box_muller(
        R._NumpyOps, u1.astype(np.float32), (j * 2.0**-24).astype(np.float32), F32
    )
    assert zc.dtype == np.float32
    worst = max(_ulps32(zc, r * ref_c).max(), _ulps32(zs, r * ref_s).max())
    assert worst <= NORMAL_MAX_ULP, worst
    assert np.all(zc[-e2.size :] == 0) and np.all(zs[-e2.size :] == 0)  # u1 == 1: r == 0


@needs_long_double
def test_normal_float64_against_long_double_formula():
    ld = np.longdouble
    pi = ld("3.14159265358979323846264338327950288")
    n = 400_000
    w = R.bits(3, (2 * n,)).astype(np.uint64)
    u = (
        (w[0::2] >> np.uint64(5)).astype(ld) * ld(2) ** 26 + (w[1::2] >> np.uint64(6)).astype(ld)
    ) * ld(2) ** -53
    z = R.normal(3, (n,), dtype="float64")
    r = np.sqrt(-2 * np.log(1 - u[0::2]))
    j = (u[1::2] * ld(2) ** 53).astype(np.int64)
    ref_c, ref_s = _quarter_reference(
        j >> 51, (j & (2**51 - 1)).astype(ld) * ld(2) ** -51, np.sin, np.cos, pi
    )
    worst = max(_ulps64(z[0::2], r * ref_c).max(), _ulps64(z[1::2], r * ref_s).max())
    assert worst <= NORMAL_MAX_ULP, worst


# ------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, 2.0, "3", None, True])
def test_bad_seed(seed):
    for call in (
        lambda: R.key_from_seed(seed),
        lambda: R.bits(seed, (2,)),
        lambda: R.uniform(seed, (2,)),
        lambda: R.normal(seed, 3),
        lambda: R.fold_in(seed, 1),
    ):
        with pytest.raises(ValueError, match="seed"):
            call()


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        R.bits(0, (2,), backend="cupy")
    with pytest.raises(ValueError, match="backend"):
        R.normal(0, (2,), backend="Torch")
    with pytest.raises(ValueError, match="backend"):
        R.threefry2x32(0, 0, 0, 0, backend="tensorflow")
    for dtype in ("int8", "float16", "bfloat16", None, np.int32):
        with pytest.raises(ValueError, match="dtype"):
            R.normal(0, (2,), dtype=dtype)
        with pytest.raises(ValueError, match="dtype"):
            R.uniform(0, (2,), dtype=dtype)
    with pytest.raises(ValueError, match="dtype"):
        R.blocks_used((2,), "int64")
    for counter in (-1, 2**64, 0.5):
        with pytest.raises(ValueError, match="counter"):
            R.bits(0, (2,), counter=counter)
    with pytest.raises(ValueError, match="counter"):  # the draw would run past 2**64
        R.bits(0, (3,), counter=2**64 - 1)
    for shape in ((-1,), (2, 1.5), "ab", 2.0):
        with pytest.raises(ValueError, match="shape"):
            R.bits(0, shape)
    with pytest.raises(ValueError, match="device"):
        R.bits(0, (2,), device="cuda")
    with pytest.raises(ValueError, match="data"):
        R.fold_in(0, -1)
    with pytest.raises(ValueError, match="data"):
        R.fold_in(0, 1, 2.5)
    with pytest.raises(ValueError, match="x0"):
        R.threefry2x32(0, 0, 2**32, 0)
    with pytest.raises(ValueError, match="key1"):
        R.threefry2x32(0, -1, 0, 0)
    # accepted spellings of dtype
    assert R.uniform(0, 2, dtype=np.float64).dtype == np.float64
    assert R.uniform(0, 2, dtype=np.dtype("float32")).dtype == np.float32


def test_jax_float64_needs_x64():
    jax = _jax()
    if jax.dtypes.canonicalize_dtype(np.float64) == np.float64:
        pytest.skip("jax_enable_x64 is on in this process")
    for fn in (R.uniform, R.normal):
        with pytest.raises(ValueError, match="jax_enable_x64"):
            fn(0, (2,), dtype="float64", backend="jax")


# ------------------------------------------------------------------------------------
# Import hygiene
# ------------------------------------------------------------------------------------


def test_import_does_not_load_torch_or_jax():
    code = (
        "import sys, xopt.random; "
        "assert 'torch' not in sys.modules and 'jax' not in sys.modules, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jax'))"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, env=env)


# ------------------------------------------------------------------------------------
# GPU (run on a GPU machine; skipped elsewhere)
# ------------------------------------------------------------------------------------


def _torch_cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _jax_on_gpu() -> bool:
    try:
        import jax

        return jax.devices()[0].platform == "gpu"
    except Exception:
        return False


@pytest.mark.cuda
@pytest.mark.skipif(not _torch_cuda_available(), reason="needs torch with a CUDA GPU")
def test_torch_cuda_bit_identical_to_numpy():
    import torch

    for k, expected in KAT:
        y = R.threefry2x32(*k, backend="torch", device="cuda")
        assert y[0].device.type == "cuda"
        assert (int(y[0]), int(y[1])) == expected
    for shape in [(), (7,), (2, 3, 5), (1_000_003,)]:
        for seed, counter in [(0, 0), (2**63 + 5, 2**40), (1, 2**32 - 1)]:
            for fn, dtype in [
                (R.uniform, "float32"),
                (R.normal, "float32"),
                (R.uniform, "float64"),
                (R.normal, "float64"),
            ]:
                ref = fn(seed, shape, counter=counter, dtype=dtype)
                got = fn(seed, shape, counter=counter, dtype=dtype, backend="torch", device="cuda")
                assert got.device.type == "cuda"
                _assert_same_bits(ref, got)
            words = R.bits(seed, shape, counter=counter, backend="torch", device="cuda")
            assert words.dtype == torch.int64
            _assert_same_bits(R.bits(seed, shape, counter=counter), words)


@pytest.mark.cuda
@pytest.mark.skipif(not _jax_on_gpu(), reason="needs jax with a GPU")
def test_jax_gpu_bit_identical_to_numpy():
    import jax

    assert R.normal(0, (3,), backend="jax").devices().pop().platform == "gpu"
    for shape in [(), (7,), (2, 3, 5), (1_000_003,)]:
        jitted = jax.jit(lambda s, c, shape=shape: _all_draws(s, shape, c, "jax"))
        with _x64():
            import jax.numpy as jnp

            jitted64 = jax.jit(
                lambda s, c, shape=shape: tuple(
                    fn(s, shape, counter=c, dtype="float64", backend="jax")
                    for fn in (R.uniform, R.normal)
                )
            )
        for seed, counter in [(0, 0), (2**63 + 5, 2**40), (1, 2**32 - 1)]:
            ref = _all_draws(seed, shape, counter, "numpy")
            got = _all_draws(seed, shape, counter, "jax")
            traced = jitted(_traced_words(seed), _traced_words(counter))
            for r, g, k in zip(ref, got, traced, strict=True):
                _assert_same_bits(r, g)
                _assert_same_bits(r, k)
            with _x64():
                traced64 = jitted64(jnp.uint64(seed), jnp.uint64(counter))
                for fn, k in zip((R.uniform, R.normal), traced64, strict=True):
                    ref64 = fn(seed, shape, counter=counter, dtype="float64")
                    _assert_same_bits(
                        ref64, fn(seed, shape, counter=counter, dtype="float64", backend="jax")
                    )
                    _assert_same_bits(ref64, k)
