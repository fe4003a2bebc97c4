"""POET-XQ: ``W0`` stored as the authors' 8-bit codes (xopt/specs/poet.py, quantize_weight).

The format's arithmetic is checked against its definition in float64 and across backends
(the same bytes from NumPy, torch and jax.numpy, eager and jitted); the layer is checked
against the full-precision layer holding the dequantised ``W0`` and against the float64
oracle of the spec's equations; the authors' recorded run is replayed in
parity_tests/test_poet.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xopt.errors import HyperparameterError
from xopt.specs import poet as P
from xopt.torch.poet import POETLinear, convert, merge_and_reset

SHAPES = [((48, 64), 256), ((16, 32), 64), ((64, 64), 512), ((8, 24), 8)]


def _weight(shape, seed=0, scale=0.3):
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale
    w[0, :3] = 0.0  # a flat stretch inside a group
    return w


def _oracle_codes(w: np.ndarray, gs: int):
    """The format's definition evaluated element by element with Python floats rounded
    to float32 after every operation (round half to even), independent of the array code."""
    f = np.float32
    g = w.reshape(-1, gs)
    codes, scales, zeros = np.zeros(g.shape, np.uint8), [], []
    for i, row in enumerate(g):
        hi, lo = f(max(row.tolist())), f(min(row.tolist()))
        s = f(f(max(f(hi - lo), f(1e-5))) / f(255))
        z = f(min(max(-round(f(lo / s)), 0), 255))
        for j, v in enumerate(row.tolist()):
            codes[i, j] = int(min(max(f(round(f(f(v) / s)) + z), 0), 255))
        scales.append(s)
        zeros.append(z)
    return codes.reshape(w.shape), np.array(scales, np.float32)[:, None], \
        np.array(zeros, np.float32)[:, None]


@pytest.mark.parametrize("shape,gs", SHAPES)
def test_quantize_matches_definition(shape, gs):
    w = _weight(shape)
    codes, scales, zeros = P.quantize_weight(w, gs)
    oc, os_, oz = _oracle_codes(w, gs)
    assert codes.dtype == np.uint8 and scales.dtype == np.float32
    assert scales.shape == (w.size // gs, 1)
    np.testing.assert_array_equal(codes, oc)
    np.testing.assert_array_equal(scales, os_)
    np.testing.assert_array_equal(zeros, oz)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([8, 16, 64]),
       st.floats(1e-4, 1e3))
def test_dequantised_error_within_half_a_step(seed, gs, scale):
    w = _weight((8, 16), seed, scale)
    codes, scales, zeros = P.quantize_weight(w, gs)
    back = P.dequantize_weight(codes, scales, zeros, gs, np.float64)
    step = np.repeat(scales.astype(np.float64), gs, axis=1).reshape(w.shape)
    # the zero point is clipped to [0, 255]: only a group that straddles zero is held to
    # half a step (a one-signed group far from zero saturates in the authors' format too)
    g = w.reshape(-1, gs)
    straddles = np.repeat((g.min(1) <= 0) & (g.max(1) >= 0), gs).reshape(w.shape)
    # half a step from rounding w/scale, plus the float32 rounding of the division
    # (relative 2^-24 of |w|/scale ≤ 255 steps)
    err = np.abs(back - w.astype(np.float64))
    assert np.all((err <= step * (0.5 + 255 * 2.0**-23)) | ~straddles)


@pytest.mark.parametrize("shape,gs", SHAPES)
def test_same_bytes_in_every_backend(shape, gs):
    import jax
    import jax.numpy as jnp

    w = _weight(shape, seed=3)
    ref = P.quantize_weight(w, gs)
    got_t = P.quantize_weight(torch.as_tensor(w), gs, xp=torch)
    got_j = P.quantize_weight(jnp.asarray(w), gs)
    got_jit = jax.jit(lambda a: P.quantize_weight(a, gs))(jnp.asarray(w))
    for got in (got_t, got_j, got_jit):
        for a, b in zip(ref, got, strict=True):
            b = b.numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    deq = P.dequantize_weight(*ref, gs)
    np.testing.assert_array_equal(
        deq, P.dequantize_weight(*(torch.as_tensor(a) for a in ref), gs, xp=torch).numpy())
    np.testing.assert_array_equal(
        deq, np.asarray(jax.jit(lambda c, s, z: P.dequantize_weight(c, s, z, gs))(*ref)))


def test_bad_group_size_and_bits_are_named():
    with pytest.raises(HyperparameterError, match="weight_group_size"):
        POETLinear(32, 16, 8, weight_bits=8, weight_group_size=96)
    with pytest.raises(HyperparameterError, match="weight_bits"):
        POETLinear(32, 16, 8, weight_bits=4)
    with pytest.raises(HyperparameterError, match="weight_group_size"):
        P.quantize_weight(np.zeros((3, 5), np.float32), 4)


def _pair(variant, bias=True, seed=0):
    """A POET-XQ layer and a full-precision layer holding its dequantised W0."""
    torch.manual_seed(seed)
    lin = torch.nn.Linear(32, 16, bias=bias)
    q = POETLinear.from_linear(lin, 8, variant=variant, weight_bits=8, weight_group_size=64,
                               impl="plain", seed=5)
    f = POETLinear.from_linear(lin, 8, variant=variant, impl="plain", seed=5)
    with torch.no_grad():
        f.weight.copy_(q.w0())
        r = torch.randn(q.oft_R.shape, generator=torch.Generator().manual_seed(seed)) * 0.05
        q.oft_R.copy_(r)
        f.oft_R.copy_(r)
    return q, f


@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_layer_is_the_full_precision_layer_on_dequantised_w0(variant):
    q, f = _pair(variant)
    assert q.weight.dtype == torch.uint8 and not isinstance(q.weight, torch.nn.Parameter)
    assert all(p.dtype.is_floating_point for p in q.parameters())
    x = torch.randn(3, 5, 32)
    outs = []
    for layer in (q, f):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad, layer.oft_R.grad, layer.bias.grad))
    for a, b in zip(*outs, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)  # same operations on the same float W0


def test_layer_against_float64_oracle():
    q, _ = _pair("mem")
    x = torch.randn(6, 32, dtype=torch.float32)
    g = torch.randn(6, 16)
    xi = x.clone().requires_grad_(True)
    y = q(xi)
    y.backward(g)
    w0 = P.dequantize_weight(q.weight.numpy(), q.weight_scales.numpy().astype(np.float64),
                             q.weight_zeros.numpy().astype(np.float64), 64)
    oft = q.oft_R.detach().double().numpy()
    ro, ri = P.rotations(oft, 8, q.num_out_blocks)
    pin, pout = q.perm_in.long().numpy(), q.perm_out.long().numpy()
    w_eff = P.effective_weight(w0, ro, ri, pin, pout)
    ref = x.double().numpy() @ w_eff.T + (q.bias.detach().double().numpy() @ _blockdiag(ro)
                                         )[pout]
    rel = np.abs(y.detach().numpy() - ref).max() / np.abs(ref).max()
    assert rel <= 1e-6
    gx = g.double().numpy() @ w_eff
    assert np.abs(xi.grad.numpy() - gx).max() / np.abs(gx).max() <= 1e-6


def _blockdiag(r):
    n, b, _ = r.shape
    out = np.zeros((n * b, n * b))
    for i in range(n):
        out[i * b:(i + 1) * b, i * b:(i + 1) * b] = r[i]
    return out


def test_state_dict_round_trip_is_bit_exact():
    q, _ = _pair("mem")
    sd = q.state_dict()
    assert {"weight", "weight_scales", "weight_zeros"} <= set(sd)
    assert sd["weight"].dtype == torch.uint8 and sd["weight_scales"].shape == (8, 1)
    fresh = POETLinear(32, 16, 8, bias=True, variant="mem", weight_bits=8,
                       weight_group_size=64, impl="plain")
    fresh.load_state_dict(sd)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd[k]), k
    x = torch.randn(4, 32)
    assert torch.equal(fresh(x), q(x))


def test_merge_requantises_the_merged_weight():
    q, f = _pair("mem")
    codes, scales, zeros = q.weight.clone(), q.weight_scales.clone(), q.weight_zeros.clone()
    ro, ri = q.rotations(False)
    pin, pout = q.perm_in.long(), q.perm_out.long()
    w0_64 = P.dequantize_weight(codes.numpy(), scales.numpy().astype(np.float64),
                                zeros.numpy().astype(np.float64), 64)
    ro64, ri64 = P.rotations(q.oft_R.detach().double().numpy(), 8, q.num_out_blocks)
    q.merge_and_reset()
    assert int(q.merges) == 1 and not q.oft_R.detach().any()
    new_in_inv = torch.as_tensor(P.inverse(q.perm_in.long().numpy()))
    new_out_inv = torch.as_tensor(P.inverse(q.perm_out.long().numpy()))
    want = P.requantized_weight(codes, scales, zeros, 64, ro, ri, pin, pout, new_in_inv,
                                new_out_inv, xp=torch)
    for a, b in zip((q.weight, q.weight_scales, q.weight_zeros), want, strict=True):
        assert torch.equal(a, b)
    # the new codes hold the float64 merge of the old W0 to half a quantisation step
    w0_new64 = P.merged_weight(w0_64, ro64, ri64, pin.numpy(), pout.numpy(),
                               new_in_inv.numpy(), new_out_inv.numpy())
    got = q.w0(torch.float64).numpy()
    step = np.repeat(q.weight_scales.double().numpy(), 64, axis=1).reshape(16, 32)
    assert np.all(np.abs(got - w0_new64) <= step * 0.5 + 1e-6 * np.abs(w0_new64).max())
    assert not np.array_equal(q.weight.numpy(), codes.numpy())


def test_convert_and_model_merge():
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    ref = [lin.weight.detach().clone() for lin in (m[0], m[2])]
    m, n = convert(m, 8, weight_bits=8, weight_group_size=32, variant="mem")
    assert n == 2
    for layer, w in zip((m[0], m[2]), ref, strict=True):
        assert layer.quantized and layer.weight.dtype == torch.uint8
        want = P.quantize_weight(w / torch.norm(w, dim=1, keepdim=True), 32, xp=torch)
        assert torch.equal(layer.weight, want[0]) and torch.equal(layer.weight_scales, want[1])
    assert merge_and_reset(m) == 2


@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_jax_layer_matches_torch(variant):
    import jax
    import jax.numpy as jnp

    from xopt.jax.poet import POETDense
    from xopt.jax.poet import merge_and_reset as jax_merge

    q, _ = _pair(variant)
    w_norm = np.asarray(q.w0().detach())  # any float W0: both quantise the one handed over
    q.set_w0(torch.as_tensor(w_norm))
    layer = POETDense(16, block_size=8, use_bias=True, variant=variant, seed=5, weight_bits=8,
                      weight_group_size=64, weight_init=lambda k, s, d: jnp.asarray(w_norm))
    x = np.random.default_rng(2).standard_normal((4, 32)).astype(np.float32)
    vs = layer.init(jax.random.PRNGKey(0), jnp.asarray(x))
    poet = dict(vs["poet"])
    for name in ("weight", "weight_scales", "weight_zeros", "perm_in", "perm_out"):
        np.testing.assert_array_equal(np.asarray(poet[name]), getattr(q, name).numpy())
    assert poet["weight"].dtype == jnp.uint8
    poet["bias"] = jnp.asarray(q.bias.detach().numpy())
    oft = jnp.asarray(q.oft_R.detach().numpy())

    def loss(o, xx):
        y = layer.apply({"params": {"oft_R": o}, "poet": poet}, xx)
        return jnp.sum(y * y), y

    (_, y), (g_oft, g_x) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        oft, jnp.asarray(x))
    xt = torch.as_tensor(x).requires_grad_(True)
    yt = q(xt)
    yt.square().sum().backward()
    for a, b in ((y, yt.detach()), (g_oft, q.oft_R.grad), (g_x, xt.grad)):
        b = b.numpy()
        assert np.abs(np.asarray(a) - b).max() <= 1e-6 * np.abs(b).max()
    # the merge: same permutations (xopt.random), rotations evaluated by each backend
    merged = jax_merge({"params": {"oft_R": oft}, "poet": poet})
    q.merge_and_reset()
    np.testing.assert_array_equal(np.asarray(merged["poet"]["perm_in"]), q.perm_in.numpy())
    got = np.asarray(merged["poet"]["weight"]).astype(np.int32)
    want = q.weight.numpy().astype(np.int32)
    # the merged float W0 differ by float32 rounding of the rotations' products; a code
    # may then sit on the other side of a rounding boundary: at most one step apart, rarely
    assert np.abs(got - want).max() <= 1 and np.mean(got != want) < 0.01
    np.testing.assert_allclose(np.asarray(merged["poet"]["weight_scales"]),
                               q.weight_scales.numpy(), rtol=1e-5)


# -- the Triton path (TRITON_INTERPRET=1 on the CPU, set by tests/conftest.py) -------------------

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,gs,n", [((48, 64), 256, 37), ((40, 24), 8, 70)])
def test_dequantising_matmul_kernel(shape, gs, n, dtype):
    from xopt.kernels import poet_qmm

    gen = torch.Generator().manual_seed(n)
    w = torch.randn(*shape, generator=gen) * 0.3
    codes, scales, zeros = (t.to(DEV) for t in P.quantize_weight(w, gs, xp=torch))
    out_f, in_f = shape
    # the tile the kernel dequantises is the spec's W0 bit for bit: read it back through
    # products with the identity
    eye_in = torch.eye(in_f, device=DEV, dtype=dtype)
    w0 = P.dequantize_weight(codes, scales, zeros, gs, dtype, xp=torch)
    assert torch.equal(poet_qmm.matmul_wt(eye_in, codes, scales, zeros, gs), w0.T)
    eye_out = torch.eye(out_f, device=DEV, dtype=dtype)
    assert torch.equal(poet_qmm.matmul_w(eye_out, codes, scales, zeros, gs), w0)
    # products: float32 accumulation in another order than the plain path's matmul
    w64 = w0.double()
    for fn, width, ref in ((poet_qmm.matmul_wt, in_f, lambda a: a @ w64.T),
                           (poet_qmm.matmul_w, out_f, lambda a: a @ w64)):
        a = torch.randn(n, width, generator=gen).to(device=DEV, dtype=dtype)
        got = fn(a, codes, scales, zeros, gs).double()
        want = ref(a.double())
        # float32: accumulation rounding only; bf16/fp16: one rounding of the result
        tol = 1e-6 if dtype == torch.float32 else float(torch.finfo(dtype).eps)
        assert (got - want).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_triton_layer_matches_plain(variant, monkeypatch):
    from xopt.kernels import poet_qmm

    calls = []
    for name in ("matmul_wt", "matmul_w"):
        fn = getattr(poet_qmm, name)
        monkeypatch.setattr(poet_qmm, name, lambda *a, _f=fn, _n=name: (calls.append(_n),
                                                                        _f(*a))[1])
    q, _ = _pair(variant)
    t = POETLinear(32, 16, 8, bias=True, variant=variant, weight_bits=8, weight_group_size=64,
                   impl="triton")
    t.load_state_dict(q.state_dict())
    q, t = q.to(DEV), t.to(DEV)
    x = torch.randn(3, 5, 32, device=DEV)
    outs = []
    for layer in (q, t):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad, layer.oft_R.grad))
    # the triton layer's products with W0 are the kernel's (mem recomputes y1 with it)
    assert sorted(calls) == sorted(["matmul_wt", "matmul_w"]
                                   + (["matmul_wt"] if variant == "mem" else []))
    for a, b in zip(*outs, strict=True):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()
