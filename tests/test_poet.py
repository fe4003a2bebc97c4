"""POET-X: the spec's math, the torch and JAX layers, merges, the optimizer, the kernels.

Independent references: the paper's definitions (the Cayley transform
(I+Q)(I−Q)⁻¹ and its Neumann truncation (I+Q)(I+Q+Q²+Q³)), finite differences, float64
autograd, and the authors' optimizer arithmetic as their POETAdamW docstring states it.
The kernels run under TRITON_INTERPRET=1 on the CPU (set here before they are imported).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from helpers import has_torch, needs_jax, needs_torch

from xopt.errors import HyperparameterError
from xopt.specs import poet as P

if has_torch:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
#: where the kernel tests run: the GPU where there is one, else the CPU interpreter
DEV = "cuda" if has_torch and torch.cuda.is_available() else "cpu"

has_triton = has_torch and __import__("importlib").util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not has_triton, reason="triton is not installed")
RNG = np.random.default_rng(0)


def _q(n, b, scale):
    return P.skew(scale * RNG.standard_normal((n, P.num_triu(b))), b)


# -- the spec ---------------------------------------------------------------------------------


def test_defaults_are_the_authors():
    h = P.POET()
    # poet_torch/config.py POETConfig and optim/adamw.py POETAdamW
    assert (h.block_size, h.merge_interval, h.lr, h.poet_scale) == (256, 200, 5e-4, 0.5)
    assert (h.b1, h.b2, h.eps, h.weight_decay, h.correct_bias) == (0.9, 0.999, 1e-6, 0.0, True)
    assert (h.cayley_formula, h.neumann_terms, h.variant) == ("product", 3, "fast")
    assert P.POET.from_json(h.to_json()) == h


@pytest.mark.parametrize("kw,pattern", [
    ({"merge_interval": 0}, r"POET\.merge_interval = 0: must be ≥ 1"),
    ({"block_size": (16, 32)}, r"POET\.block_size = \(16, 32\): .*square"),
    ({"block_size": 1}, r"POET\.block_size = 1"),
    ({"cayley_formula": "exact"}, r"POET\.cayley_formula = 'exact'"),
])
def test_bad_hyperparameters_name_the_field(kw, pattern):
    with pytest.raises(HyperparameterError, match=pattern):
        P.POET(**kw)


def test_width_check_names_the_width():
    with pytest.raises(HyperparameterError, match=r"block_size=16 does not divide in_features=40"):
        P.check_width(16, 40, 32)
    with pytest.raises(HyperparameterError, match=r"does not divide out_features=20"):
        P.check_width(8, 32, 20)
    with pytest.raises(HyperparameterError, match=r"square"):
        P.check_width([8, 16], 32, 32)


def test_skew_layout_is_the_authors_row_major_upper_triangle():
    b = 5
    x = np.arange(1, P.num_triu(b) + 1, dtype=np.float64)[None]
    q = P.skew(x, b)[0]
    r, c = np.triu_indices(b, 1)  # torch.triu_indices(b, b, 1) order
    assert np.array_equal(q[r, c], x[0]) and np.array_equal(q, -q.T)
    dq = RNG.standard_normal((1, b, b))
    assert np.allclose(P.triu_grad(dq, b)[0], dq[0][r, c] - dq[0][c, r])


@pytest.mark.parametrize("formula", ["product", "taylor"])
def test_cayley_neumann_is_the_papers_truncation(formula):
    q = _q(4, 12, 0.05)
    eye = np.eye(12)
    neumann = eye + q + q @ q + q @ q @ q
    expected = (eye + q) @ neumann  # (I+Q)(I+Q+Q²+Q³): degree 4, Q⁴ coefficient 1
    if formula == "taylor":
        expected = expected + q @ q @ q @ q  # I + 2(Q+Q²+Q³+Q⁴)
    y = P.cayley_neumann(q, 3, formula)
    assert np.abs(y - expected).max() < 1e-14
    # both approximate the Cayley transform (I+Q)(I−Q)⁻¹ to O(Q⁴)
    cay = (eye + q) @ np.linalg.inv(eye - q)
    assert np.abs(y - cay).max() < 20 * np.linalg.norm(q, 2, axis=(1, 2)).max() ** 4
    # general k, and k = 3 written generally, agree
    q0 = q[0]
    for k in (1, 2, 5):
        series = sum(np.linalg.matrix_power(q0, j) for j in range(k + 2))
        ref = (eye + q0) @ sum(np.linalg.matrix_power(q0, j) for j in range(k + 1))
        if formula == "taylor":  # I + 2(Q + … + Q^(k+1))
            ref = 2 * series - eye
        assert np.abs(P.cayley_neumann(q[:1], k, formula)[0] - ref).max() < 1e-14


@pytest.mark.parametrize("terms", [2, 3, 4])
@pytest.mark.parametrize("formula", ["product", "taylor"])
def test_cnp_vjp_matches_finite_differences(terms, formula):
    b = 6
    x = 0.2 * RNG.standard_normal((2, P.num_triu(b)))
    g = RNG.standard_normal((2, b, b))
    grad = P.triu_grad(P.cayley_neumann_vjp(P.skew(x, b), g, terms, formula), b)

    def f(v):
        return float((P.cayley_neumann(P.skew(v, b), terms, formula) * g).sum())

    h = 1e-6
    fd = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = h
        fd[idx] = (f(x + e) - f(x - e)) / (2 * h)
    assert np.abs(fd - grad).max() < 1e-7


def test_layer_forward_is_x_times_effective_weight_and_backward_is_its_vjp():
    b, n_in, n_out = 4, 12, 8
    oft = 0.1 * RNG.standard_normal((n_out // b + n_in // b, P.num_triu(b)))
    ro, ri = P.rotations(oft, b, n_out // b)
    w = RNG.standard_normal((n_out, n_in))
    bias = RNG.standard_normal(n_out)
    pin, pout = RNG.permutation(n_in), RNG.permutation(n_out)
    x = RNG.standard_normal((3, n_in))
    y, y1 = P.layer_forward(x, ro, ri, w, bias, P.inverse(pin), pout)
    weff = P.effective_weight(w, ro, ri, pin, pout)
    bias_eff = P.block_rotate(bias, ro)[pout]
    assert np.allclose(y, x @ weff.T + bias_eff, atol=1e-12)
    g = RNG.standard_normal(y.shape)
    gx, gro, gri, _ = P.layer_backward(x, g, ro, ri, w, pin, P.inverse(pin), P.inverse(pout),
                                       y1, bias=bias)
    assert np.allclose(gx, g @ weff, atol=1e-12)
    # grad of R_out: <g, y> is linear in R_out; check one direction by finite differences
    d = RNG.standard_normal(ro.shape)
    yp, _ = P.layer_forward(x, ro + 1e-6 * d, ri, w, bias, P.inverse(pin), pout)
    assert abs(((yp - y) * g).sum() / 1e-6 - (gro * d).sum()) < 1e-5


def test_merge_keeps_the_function():
    b, n_in, n_out = 4, 12, 8
    oft = 0.1 * RNG.standard_normal((n_out // b + n_in // b, P.num_triu(b)))
    ro, ri = P.rotations(oft, b, n_out // b)
    w, bias = RNG.standard_normal((n_out, n_in)), RNG.standard_normal(n_out)
    pin, pout = RNG.permutation(n_in), RNG.permutation(n_out)
    npin, npout = RNG.permutation(n_in), RNG.permutation(n_out)
    x = RNG.standard_normal((3, n_in))
    y, _ = P.layer_forward(x, ro, ri, w, bias, P.inverse(pin), pout)
    w2 = P.merged_weight(w, ro, ri, pin, pout, P.inverse(npin), P.inverse(npout))
    b2 = P.merged_bias(bias, ro, pout, P.inverse(npout))
    eye_out, eye_in = P.rotations(0 * oft, b, n_out // b)
    y2, _ = P.layer_forward(x, eye_out, eye_in, w2, b2, P.inverse(npin), npout)
    assert np.allclose(y, y2, atol=1e-12)


def test_permutations_come_from_xopt_random_and_differ_per_merge():
    h = P.POET()
    a = P.layer_permutations(h, 7, 0, 32, 16)
    assert sorted(a[0]) == list(range(32)) and sorted(a[1]) == list(range(16))
    assert np.array_equal(a[0], P.layer_permutations(h, 7, 0, 32, 16)[0])
    assert not np.array_equal(a[0], P.layer_permutations(h, 7, 1, 32, 16)[0])
    ident = P.layer_permutations(h.replace(permutation="identity"), 7, 3, 32, 16)
    assert np.array_equal(ident[0], np.arange(32))


def test_optimizer_resets_moments_at_merge_boundaries():
    h = P.POET(merge_interval=3, lr=1e-2)
    params = {"w": np.ones(4)}
    state = P.init_state(h, params, dtype=np.float64)
    steps = []
    for _ in range(7):
        params, state = P.step(h, params, state, {"w": np.full(4, 0.5)})
        steps.append(int(state["step/w"]))
    # global counter 3 and 6 start a fresh moment (POETAdamW: counter % interval == 0 and > 0)
    assert steps == [1, 2, 3, 1, 2, 3, 1]


# -- torch ---------------------------------------------------------------------------------------


@needs_torch
def test_torch_layer_errors_name_the_parameter():
    from xopt.torch.poet import MergeEvery, POETAdamW, POETLinear

    with pytest.raises(HyperparameterError, match="block_size=16 does not divide in_features=40"):
        POETLinear(40, 32, 16)
    with pytest.raises(HyperparameterError, match="square"):
        POETLinear(32, 32, (8, 16))
    with pytest.raises(HyperparameterError, match="merge_interval = 0"):
        POETAdamW([torch.nn.Parameter(torch.zeros(2))], merge_interval=0)
    with pytest.raises(HyperparameterError, match="interval = 0"):
        MergeEvery(torch.nn.Linear(2, 2), 0)


@needs_torch
@pytest.mark.parametrize("bias", [False, True])
def test_torch_fast_and_mem_agree_and_merge_keeps_the_output(bias):
    from xopt.torch.poet import POETLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 48, bias=bias)
    fast = POETLinear.from_linear(lin, 16, impl="plain", seed=3)
    mem = POETLinear.from_linear(lin, 16, impl="plain", seed=3, variant="mem")
    assert torch.equal(fast.perm_in, mem.perm_in)
    with torch.no_grad():
        fast.oft_R.normal_(0, 0.05)
        mem.oft_R.copy_(fast.oft_R)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    fast, mem = fast.double(), mem.double()
    res = []
    for layer in (fast, mem):
        xx = x.clone().requires_grad_()
        y = layer(xx)
        y.backward(torch.ones_like(y))
        res.append((y.detach(), xx.grad, layer.oft_R.grad))
    for a, b in zip(*res, strict=True):
        assert torch.allclose(a, b, atol=1e-12)
    # the layer equals x·W_effᵀ, and a merge leaves it unchanged
    y_before = fast(x).detach()
    if not bias:
        assert torch.allclose(y_before, x @ fast.effective_weight().double().T, atol=1e-5)
    fast.merge_and_reset()
    assert int(fast.merges) == 1 and torch.count_nonzero(fast.oft_R) == 0
    assert torch.allclose(fast(x), y_before, atol=1e-12)


@needs_torch
def test_torch_convert_and_optimizer_driven_merges():
    from xopt.torch.poet import POETAdamW, POETLinear, convert, poet_param_groups

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("up", torch.nn.Linear(16, 32, bias=False))
    model.add_module("odd", torch.nn.Linear(32, 20))
    model.add_module("lm_head", torch.nn.Linear(20, 16))
    _, n = convert(model, 8, impl="plain")
    assert n == 1 and isinstance(model.up, POETLinear)
    assert type(model.odd) is torch.nn.Linear and type(model.lm_head) is torch.nn.Linear
    opt = POETAdamW(poet_param_groups(model), merge_interval=2, model=model)
    x = torch.randn(4, 16)
    merges = []
    for _ in range(5):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        merges.append(int(model.up.merges))
        assert opt.state[model.up.oft_R]["step"] in (1, 2)
    assert merges == [0, 1, 1, 2, 2]


@needs_torch
def test_a_model_merge_checks_every_permutation_before_changing_a_layer():
    """A model's merge checks the permutations of all its layers before it merges any: a
    bad one for the last layer leaves every layer as it was (the layers' merge counts,
    weights and permutations)."""
    from xopt.torch.distributed import merge_by_owner
    from xopt.torch.poet import POETLinear

    torch.manual_seed(0)
    layers = [POETLinear.from_linear(torch.nn.Linear(16, 8), 4, impl="plain") for _ in range(3)]
    for layer in layers:
        layer.oft_R.data.normal_(std=0.1)
    before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]
    perms = [(None, None), (None, None), (np.arange(16), np.zeros(8, dtype=np.int64))]
    with pytest.raises(HyperparameterError, match="perm_out"):
        merge_by_owner(layers, None, perms=perms)
    for layer, sd in zip(layers, before, strict=True):
        for k, v in layer.state_dict().items():
            assert torch.equal(v, sd[k]), k


@needs_torch
def test_batched_draws_are_xopt_randoms():
    """A model's merge draws every layer's permutations at once (xopt.random.fold_in_many,
    spec.random_permutations, spec.inverses); each is the one-seed draw (xopt.random.fold_in,
    spec.random_permutation, spec.inverse): seeds at
    both ends of the 64-bit range, odd and even widths, width 1."""
    from xopt import random as xr

    seeds = [0, 1, 7, 2 ** 32 - 1, 2 ** 32, 2 ** 63 + 5, 2 ** 64 - 1, 123456789012345]
    data = [1, 0, 2 ** 32 + 3, 5, 2 ** 64 - 1, 1, 0, 77]
    assert xr.fold_in_many(seeds, data) == [xr.fold_in(s, d) for s, d in zip(seeds, data,
                                                                                 strict=True)]
    for n in (1, 2, 31, 64, 256):
        got = P.random_permutations(seeds, n)
        for s, row in zip(seeds, got, strict=True):
            assert np.array_equal(row, P.random_permutation(s, n))
            assert np.array_equal(P.inverses(got)[seeds.index(s)], P.inverse(row))
    h = P.POET()
    pairs = P.random_layer_permutations(seeds, data, [31] * 8, [64, 1] * 4)
    for s, d, (pin, pout) in zip(seeds, data, pairs, strict=True):
        want = P.layer_permutations(h, s, d, 31, 64 if seeds.index(s) % 2 == 0 else 1)
        assert np.array_equal(pin, want[0]) and np.array_equal(pout, want[1])


@needs_torch
@pytest.mark.parametrize("chunk,device", [(None, "cpu"), (1, "cpu"), (None, "cuda")])
def test_model_merge_is_the_merge_of_one_layer_at_a_time(chunk, device, monkeypatch):
    """merge_and_reset of a model merges the layers of one shape, block size, series and
    dtypes together (xopt.torch.poet._merge_alone); the model after three merges is, bit
    for bit, the model merged one layer at a time (merge_by_owner without ranks, which
    calls each layer's merge_and_reset): groups of several layers, the taylor formula,
    float32, bfloat16 and float64 layers, biases, identity permutations, and layers that
    merge alone (POET-XQ, a 4-term series, a group of one, a layer whose ``merged`` is
    replaced on the layer); ``chunk`` 1: each group merged
    one layer at a time through the batched path. On CUDA (where there is a GPU) the
    products are cuBLAS's, one call per layer in both merges."""
    from xopt.torch import poet as xpoet
    from xopt.torch.distributed import merge_by_owner

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    if chunk is not None:
        monkeypatch.setattr(xpoet, "MERGE_CHUNK_BYTES", chunk)
    torch.manual_seed(0)

    def layers():
        out = []
        for k in range(3):
            out.append(xpoet.POETLinear(32, 32, 8, seed=k, impl="plain"))
            out.append(xpoet.POETLinear(32, 16, 8, seed=10 + k, impl="plain", bias=True,
                                        bias_requires_grad=True))
            out.append(xpoet.POETLinear(16, 32, 8, seed=20 + k, impl="plain",
                                        cayley_formula="taylor"))
            out.append(xpoet.POETLinear(16, 16, 8, seed=30 + k, impl="plain",
                                        dtype=torch.bfloat16))
            out.append(xpoet.POETLinear(16, 16, 8, seed=40 + k, impl="plain",
                                        dtype=torch.float64))
        out.append(xpoet.POETLinear(16, 16, 4, seed=50, impl="plain", permutation="identity"))
        out.append(xpoet.POETLinear(16, 16, 4, seed=51, impl="plain", permutation="identity"))
        out.append(xpoet.POETLinear(32, 32, 8, seed=60, impl="plain", weight_bits=8,
                                    weight_group_size=64))
        out.append(xpoet.POETLinear(32, 32, 8, seed=61, impl="plain", neumann_terms=4))
        out.append(xpoet.POETLinear(24, 16, 8, seed=62, impl="plain", bias=True))
        return torch.nn.ModuleList(out).to(device)

    torch.manual_seed(0)
    model = layers()
    torch.manual_seed(0)
    ref = layers()
    calls = []  # a layer whose own merged() is replaced merges alone, through it

    def counted(*args, _f=model[0].merged):
        calls.append(1)
        return _f(*args)

    model[0].merged = counted
    for r in range(3):
        for a, b in zip(model, ref, strict=True):
            with torch.no_grad():
                a.oft_R.normal_(0, 0.05)
                b.oft_R.copy_(a.oft_R)
                if a.bias is not None:
                    a.bias.normal_()
                    b.bias.copy_(a.bias)
        assert xpoet.merge_and_reset(model) == len(model)
        merge_by_owner(list(ref), None)
        for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values(),
                                strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (r, name)
        assert all(int(m.merges) == r + 1 for m in model) and len(calls) == r + 1


@needs_torch
def test_poet_adamw_is_the_authors_arithmetic():
    # POETAdamW's documented update (its step(), in its order), written out here
    from xopt.torch.poet import POETAdamW

    p = torch.nn.Parameter(torch.tensor([0.3, -0.2, 0.0]))
    opt = POETAdamW([p], lr=1e-2, poet_scale=0.5, weight_decay=0.1, merge_interval=100)
    g = torch.tensor([0.5, -1.0, 2.0])
    ref, m, v = p.detach().clone().double(), torch.zeros(3).double(), torch.zeros(3).double()
    for k in (1, 2):
        p.grad = g.clone()
        opt.step()
        m = 0.9 * m + 0.1 * g.double()
        v = 0.999 * v + 0.001 * g.double() ** 2
        lr = 1e-2 * 0.5
        ref = ref - lr * (1 - 0.999 ** k) ** 0.5 / (1 - 0.9 ** k) * m / (v.sqrt() + 1e-6)
        ref = ref - lr * 0.1 * ref
    assert torch.allclose(p.detach().double(), ref, rtol=1e-6)


def test_poet_adamw_buckets_update_as_the_per_parameter_loop():
    """The step runs its arithmetic once per bucket (group, device, dtypes, step count) as
    foreach calls; the result is the per-parameter loop's, bit for bit, over two groups,
    bf16 parameters (float32 moments, casts), weight decay and a parameter that skipped a
    step (its own step count, so its own bucket and bias correction)."""
    from xopt.torch.poet import POETAdamW, _loop_update

    torch.manual_seed(0)
    shapes = [(4, 6), (3,), (5, 2), (7,)]
    ps = [torch.nn.Parameter(torch.randn(s, dtype=torch.bfloat16 if i % 2 else torch.float32))
          for i, s in enumerate(shapes)]
    ref = [p.detach().clone() for p in ps]
    groups = [dict(params=ps[:2], use_poet=True, weight_decay=0.0, lr=1e-2),
              dict(params=ps[2:], use_poet=False, weight_decay=0.1, lr=3e-3)]
    opt = POETAdamW(groups, poet_scale=0.5, merge_interval=100)
    state = [(torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32),
              0) for p in ps]
    for step in range(3):
        grads = [torch.randn(s).to(p.dtype) for s, p in zip(shapes, ps, strict=True)]
        skip = 3 if step == 1 else None  # the last parameter has no gradient in step 2
        for i, (p, g) in enumerate(zip(ps, grads, strict=True)):
            p.grad = None if i == skip else g.clone()
        opt.step()
        for i, (r, g) in enumerate(zip(ref, grads, strict=True)):
            if i == skip:
                continue
            m, v, k = state[i]
            k += 1
            state[i] = (m, v, k)
            grp = groups[0] if i < 2 else groups[1]
            lr = grp["lr"] * (0.5 if grp["use_poet"] else 1.0)
            step_size = lr * math.sqrt(1 - 0.999 ** k) / (1 - 0.9 ** k)
            decay = -lr * grp["weight_decay"] if grp["weight_decay"] > 0 else None
            _loop_update([r], [g], [m], [v], 0.9, 0.999, 1e-6, step_size, decay,
                         r.dtype != torch.float32)
        for p, r in zip(ps, ref, strict=True):
            assert torch.equal(p.detach(), r)
    for p, (m, v, k) in zip(ps, state, strict=True):
        st = opt.state[p]
        assert st["step"] == k and torch.equal(st["exp_avg"], m)
        assert torch.equal(st["exp_avg_sq"], v)


# -- JAX ---------------------------------------------------------------------------------------


@needs_jax
def test_jax_layer_matches_torch_and_mem_vjp_matches_autodiff():
    import jax
    import jax.numpy as jnp

    from xopt.jax.poet import POETDense, merge_and_reset

    with pytest.raises(HyperparameterError, match="does not divide in_features=20"):
        POETDense(16, block_size=8).init(jax.random.PRNGKey(0), jnp.zeros((1, 20)))
    fast = POETDense(24, block_size=8, seed=11)
    mem = POETDense(24, block_size=8, seed=11, variant="mem")
    x = jnp.asarray(RNG.standard_normal((3, 16)), jnp.float32)
    v = fast.init(jax.random.PRNGKey(1), x)
    oft = jnp.asarray(0.05 * RNG.standard_normal(v["params"]["oft_R"].shape), jnp.float32)
    v = {"params": {"oft_R": oft}, "poet": v["poet"]}

    def loss(model, o, xx):
        return (model.apply({"params": {"oft_R": o}, "poet": v["poet"]}, xx) ** 2).sum()

    ga = jax.grad(lambda o, xx: loss(fast, o, xx), argnums=(0, 1))(oft, x)
    gb = jax.grad(lambda o, xx: loss(mem, o, xx), argnums=(0, 1))(oft, x)
    for a, b in zip(ga, gb, strict=True):
        assert np.allclose(a, b, atol=1e-5)
    y = fast.apply(v, x)
    merged = merge_and_reset(v)
    assert int(merged["poet"]["merges"]) == 1
    assert np.allclose(fast.apply(merged, x), y, atol=1e-5)
    if has_torch:  # same seed -> same permutations; same weights -> same output
        from xopt.torch.poet import POETLinear

        t = POETLinear(16, 24, 8, seed=11, impl="plain")
        assert np.array_equal(t.perm_in.numpy(), np.asarray(v["poet"]["perm_in"]))
        with torch.no_grad():
            t.weight.copy_(torch.tensor(np.asarray(v["poet"]["weight"])))
            t.oft_R.copy_(torch.tensor(np.asarray(oft)))
        yt = t(torch.tensor(np.asarray(x))).detach().numpy()
        assert np.abs(yt - np.asarray(y)).max() <= 1e-6 * np.abs(yt).max()


@needs_jax
def test_poet_adamw_restarts_the_moments_every_merge_interval():
    import jax
    import jax.numpy as jnp

    from xopt.jax.poet import poet_adamw

    tx = poet_adamw(merge_interval=2)
    params = {"o": jnp.ones(3)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    seen = []
    for _ in range(5):
        u, state = step({"o": jnp.full(3, 0.1)}, state, params)
        params = jax.tree.map(lambda p, d: p + d, params, u)
        seen.append(int(state.step["o"]))
    assert seen == [1, 2, 1, 2, 1]
    with pytest.raises(HyperparameterError, match="merge_interval = 0"):
        poet_adamw(merge_interval=0)


# -- the kernels (TRITON_INTERPRET=1 on the CPU) ------------------------------------------------


@needs_triton
@pytest.mark.parametrize("b", [12, 136])
def test_skew_kernel_writes_every_row_and_column(b):
    """The skew kernel writes 8 rows a program, 128 columns at a time: b = 12 leaves a
    program with 4 rows, b = 136 a second column chunk of 8. ``Q`` and the identity it
    writes beside it (the product form's ``B = I + Q²`` starts from it) are exact, from
    float32 and from bfloat16 triangles."""
    from xopt.kernels import poet_cayley as K

    torch.manual_seed(b)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, P.num_triu(b), device=DEV).to(dtype)
        q, eye = K._skew(x, b, None, True)
        assert q.dtype == eye.dtype == dtype
        assert torch.equal(q, K.skew_reference(x.float(), b).to(dtype))  # (exact: ±x)
        assert torch.equal(eye, torch.eye(b, device=DEV, dtype=dtype).expand(2, b, b))


@needs_triton
@pytest.mark.parametrize("b", [8, 16, 40, 72])  # 72: the 64-wide tiles, a partial one
def test_cayley_kernels_match_their_references(b):
    from xopt.kernels import poet_cayley as K

    torch.manual_seed(b)
    x = (0.3 / b**0.5) * torch.randn(3, P.num_triu(b), device=DEV)
    q = K.skew(x, b)
    assert torch.equal(q, K.skew_reference(x, b))
    dq = torch.randn(3, b, b, device=DEV)
    assert torch.equal(K.triu_grad(dq, b), K.triu_grad_reference(dq, b))
    for formula in ("product", "taylor"):
        ref = K.cayley_neumann_reference(q.double(), formula)
        g = torch.randn(3, b, b, device=DEV)
        qq = q.double().requires_grad_()
        K.cayley_neumann_reference(qq, formula).backward(g.double())
        # the fused kernels: Y and Q², then the full ∂Q
        y, q2 = K.cnp_forward(q, formula)
        assert (y.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
        assert torch.allclose(q2.double(), q.double() @ q.double(), atol=1e-6)
        got = K.cnp_backward(q, q2, g, formula).double()
        assert (got - qq.grad).abs().max() <= 1e-6 * qq.grad.abs().max()
        # the batched products: Y, then the triangles' gradient (the product form never
        # forms the full ∂Q, only its skew part)
        y, saved = K.cnp_forward_bmm(q, formula)
        assert (y.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
        got = K.cnp_backward_bmm(q, saved, g, formula).double()
        want = K.triu_grad_reference(qq.grad, b)
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    # the product form's two-launch path: Y, then the triangles' gradient
    y, saved = K.cnp_forward_fused(x, b)
    ref = K.cayley_neumann_reference(q.double())
    assert (y.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    qq = q.double().requires_grad_()
    K.cayley_neumann_reference(qq).backward(g.double())
    got = K.cnp_backward_fused(saved, g).double()
    want = K.triu_grad_reference(qq.grad, b)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    # the autograd Function end to end, upper triangles in and out, every backend
    for backend in K.BACKENDS:
        xx = x.clone().requires_grad_()
        K.cayley_neumann(xx, b, backend=backend).backward(g)
        xr = x.double().requires_grad_()
        K.cayley_neumann_reference(K.skew_reference(xr, b)).backward(g.double())
        assert (xx.grad.double() - xr.grad).abs().max() <= 1e-6 * xr.grad.abs().max()


@needs_triton
@pytest.mark.parametrize("backend", ["fused", "bmm", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cayley_kernels_in_low_precision(dtype, backend):
    """Both backends evaluated in bf16/fp16 (what a bf16/fp16 POETLinear uses): skew reads
    the low-precision triangles exactly, each product takes ``dtype`` operands, accumulates
    in float32 and is rounded once to ``dtype``, and the gradient comes back in ``x``'s
    dtype. The bmm backend rounds three results in the forward of the product form (B =
    I + Q², A = B + 2Q, Y = AB; Taylor: four, Q², T, Q + Q², Y) and five in the backward
    (product: GB, AᵀG, Z, N, the triangles; Taylor: D, two sums, two products), the fused
    backend three forward (A, B, Y) and two backward (Z as an operand, the triangles), the
    fused series fewer (Q², Y; T and the products' left operands as
    operands, D not at all): each rounding carries at most half an ulp of ``dtype``
    relative to its own magnitude, all ≤ max|result| here, so the bound is that many
    half-ulps of max|ref| (the float32 evaluation rounded to ``dtype`` alone is within one
    half-ulp)."""
    from xopt.kernels import poet_cayley as K

    b = 32
    half_ulp = torch.finfo(dtype).eps / 2
    torch.manual_seed(7)
    x = ((0.3 / b**0.5) * torch.randn(5, P.num_triu(b), device=DEV)).to(dtype)
    assert torch.equal(K.skew(x, b), K.skew_reference(x.float(), b).to(dtype))
    assert K.skew(x, b, torch.float32).dtype == torch.float32
    g = torch.randn(5, b, b, device=DEV).to(dtype)
    for formula in ("product", "taylor"):
        xx = x.clone().requires_grad_()
        y = K.cayley_neumann(xx, b, formula, backend=backend, dtype=dtype)
        assert y.dtype == dtype
        y.backward(g)
        assert xx.grad.dtype == dtype
        xr = x.double().requires_grad_()
        ref = K.cayley_neumann_reference(K.skew_reference(xr, b), formula)
        ref.backward(g.double())
        err = (y.double() - ref).abs().max()
        assert err <= 4 * half_ulp * ref.abs().max(), (formula, float(err))
        gerr = (xx.grad.double() - xr.grad).abs().max()
        assert gerr <= 6 * half_ulp * xr.grad.abs().max(), (formula, float(gerr))
        # a float32 evaluation from low-precision triangles: float32 out, grad in dtype
        xx = x.clone().requires_grad_()
        y32 = K.cayley_neumann(xx, b, formula, backend=backend)
        y32.backward(g.float())
        assert y32.dtype == torch.float32 and xx.grad.dtype == dtype
        assert (y32.double() - ref).abs().max() <= 1e-6 * ref.abs().max()


@needs_triton
@pytest.mark.parametrize("mode", ["auto", "rowloop", "smem", "tiled", "torch"])
@pytest.mark.parametrize("width", [48, 40, 256])
def test_permutation_kernels_match_their_references(mode, width, monkeypatch):
    from xopt.kernels import poet_perm as PP

    monkeypatch.setattr(PP, "MODE", mode)
    dtypes = [torch.float32, torch.float64] + ([torch.bfloat16, torch.float16]
                                               if DEV == "cuda" else [])
    # smem: also 4 rows per program (111 rows: the last program has 3)
    for dtype, rows in [(d, None) for d in dtypes] + ([(torch.float32, 4)]
                                                       if mode == "smem" else []):
        monkeypatch.setitem(PP.SMEM, "rows", rows)
        x = torch.randn(3, 37, width, device=DEV).to(dtype)
        for p in (torch.randperm(width, device=DEV).to(torch.int32),
                  torch.arange(width, device=DEV).flip(0)):  # int64 too
            assert torch.equal(PP.gather(x, p), PP.gather_reference(x, p))
            assert torch.equal(PP.scatter(x, p), PP.scatter_reference(x, p))
            assert torch.equal(PP.scatter(PP.gather(x, p), p), x)
            # a strided (row-sliced) input
            assert torch.equal(PP.gather(x[:, ::2], p), PP.gather_reference(x[:, ::2], p))
            xx = x.clone().requires_grad_()
            g = torch.randn_like(x)
            PP.permute(xx, p).backward(g)
            assert torch.equal(xx.grad, PP.scatter_reference(g, p))


@needs_triton
def test_auto_permutation_mode_keeps_rows_in_shared_memory_up_to_the_limit():
    from xopt.kernels import poet_perm as PP

    lim = PP.SMEM_MAX_BYTES
    assert PP._auto_mode(lim // 2, 2) == "smem" and PP._auto_mode(lim // 2 + 1, 2) == "rowloop"
    assert PP._auto_mode(lim // 4, 4) == "smem" and PP._auto_mode(lim // 4 + 1, 4) == "rowloop"
    assert PP._auto_mode(14336, 2) == "smem"  # LLaMA-8B's MLP width in bf16: 32 KiB blocks


@needs_triton
def test_smem_gather_falls_back_to_rowloop_when_the_device_refuses(monkeypatch):
    """A device with too little shared memory for a row's block refuses the smem launch
    (Triton raises OutOfResources when it loads the kernel): the rowloop kernel permutes
    instead, and that block is not tried again."""
    from triton.runtime.errors import OutOfResources

    from xopt.kernels import poet_perm as PP

    calls = []

    class Refusing:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append(grid)
                raise OutOfResources(2**20, 2**16, "shared memory")
            return launch

    monkeypatch.setattr(PP, "_perm_smem_kernel", Refusing())
    monkeypatch.setattr(PP, "_SMEM_REFUSED", set())
    monkeypatch.setattr(PP, "MODE", "smem")
    x = torch.randn(5, 48, device=DEV)
    p = torch.randperm(48, device=DEV).to(torch.int32)
    for _ in range(2):
        assert torch.equal(PP.gather(x, p), PP.gather_reference(x, p))
        assert torch.equal(PP.scatter(x, p), PP.scatter_reference(x, p))
    assert len(calls) == 1 and len(PP._SMEM_REFUSED) == 1


@needs_triton
def test_host_grid_helpers_are_tritons():
    import triton

    from xopt.kernels._grid import cdiv, next_pow2

    assert [next_pow2(n) for n in range(1, 5000)] == [triton.next_power_of_2(n)
                                                      for n in range(1, 5000)]
    assert ([cdiv(a, b) for a in range(300) for b in range(1, 40)]
            == [triton.cdiv(a, b) for a in range(300) for b in range(1, 40)])


@needs_torch
def test_block_products_read_row_strided_inputs():
    """The layer's block rotation and block outer product (strided batched matmuls on
    ``as_strided`` views) against einsum, on contiguous inputs and on column slices of a
    wider tensor (their row stride is not the width)."""
    from xopt.torch.poet import _outer, _rotate

    torch.manual_seed(1)
    nb, b, n = 3, 4, 5
    r = torch.randn(nb, b, b, dtype=torch.float64)
    wide = torch.randn(n, 2 * nb * b + 3, dtype=torch.float64)
    wide2 = torch.randn(n, 2 * nb * b + 3, dtype=torch.float64)
    for x, g in ((wide[:, :nb * b].contiguous(), wide2[:, :nb * b].contiguous()),
                 (wide[:, 3:3 + nb * b], wide2[:, 5:5 + nb * b])):
        xb, gb = x.reshape(n, nb, b), g.reshape(n, nb, b)
        for t in (False, True):
            want = torch.einsum("njk,jkl->njl", xb, r.transpose(1, 2) if t else r)
            got = _rotate(x, r, transpose=t)
            assert got.is_contiguous() and torch.allclose(got, want.reshape(n, nb * b),
                                                          rtol=1e-14, atol=0)
        want = torch.einsum("njk,njl->jkl", xb, gb)
        assert torch.allclose(_outer(x, g, nb), want, rtol=1e-14, atol=0)
        out = torch.empty(nb + 1, b, b, dtype=torch.float64)
        _outer(x, g, nb, out=out[1:])
        assert torch.allclose(out[1:], want, rtol=1e-14, atol=0)


@needs_triton
@pytest.mark.parametrize("backend", ["fused", "bmm", "triton"])
@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_triton_layer_matches_plain_layer(variant, backend, monkeypatch):
    from xopt.kernels import poet_cayley as K
    from xopt.torch.poet import POETLinear

    monkeypatch.setattr(K, "BACKEND", backend)
    torch.manual_seed(0)
    a = POETLinear(32, 48, 16, variant=variant, impl="plain").to(DEV)
    with torch.no_grad():
        a.oft_R.normal_(0, 0.05)
    b = POETLinear(32, 48, 16, variant=variant, impl="triton").to(DEV)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 32, device=DEV)
    out = []
    for layer in (a, b):
        xx = x.clone().requires_grad_()
        y = layer(xx)
        y.backward(torch.ones_like(y))
        out.append((y, xx.grad, layer.oft_R.grad))
    for u, v in zip(*out, strict=True):
        assert (u - v).abs().max() <= 1e-6 * v.abs().max()


@needs_triton
@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_triton_layer_bias_3d_and_low_precision(variant):
    """Bias, a 3-d input, and (on the GPU) bfloat16: the triton chain against the plain
    reference (bf16: TF32 rotations and bf16 activations, so a bf16-sized tolerance)."""
    from xopt.torch.poet import POETLinear

    dtypes = [(torch.float32, 1e-6)] + ([(torch.bfloat16, 3e-2)] if DEV == "cuda" else [])
    for dtype, tol in dtypes:
        torch.manual_seed(3)
        a = POETLinear(64, 32, 16, bias=True, bias_requires_grad=True, variant=variant,
                       impl="plain").to(DEV)
        with torch.no_grad():
            a.oft_R.normal_(0, 0.05)
            a.bias.normal_()
        b = POETLinear(64, 32, 16, bias=True, bias_requires_grad=True, variant=variant,
                       impl="triton").to(DEV)
        b.load_state_dict(a.state_dict())
        a, b = a.to(dtype), b.to(dtype)
        x = torch.randn(2, 5, 64, device=DEV).to(dtype)
        gy = torch.randn(2, 5, 32, device=DEV).to(dtype)
        out = []
        for layer in (a, b):
            xx = x.clone().requires_grad_()
            layer(xx).backward(gy)
            out.append((layer(xx), xx.grad, layer.oft_R.grad, layer.bias.grad))
        for u, v in zip(*out, strict=True):
            assert (u.float() - v.float()).abs().max() <= tol * v.float().abs().max()


@needs_triton
@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs need a GPU (run on the device)")
@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_triton_layer_is_cuda_graph_capturable(variant):
    """The triton path does no host↔device copies and no syncs inside forward/backward: a
    forward+backward captured in a CUDA graph and replayed gives the eager results, bit for
    bit (same kernels, same order)."""
    from xopt.torch.poet import POETLinear

    torch.manual_seed(5)
    layer = POETLinear(512, 768, 64, variant=variant, impl="triton", device=DEV,
                       dtype=torch.bfloat16)
    with torch.no_grad():
        layer.oft_R.normal_(0, 0.05)
    x = torch.randn(2, 64, 512, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(2, 64, 768, device=DEV, dtype=torch.bfloat16)
    y = layer(x)
    y.backward(g)
    eager = (y.detach().clone(), x.grad.clone(), layer.oft_R.grad.clone())
    del y  # a live graph keeps the leaves' AccumulateGrad nodes on the default stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            x.grad = layer.oft_R.grad = None
            layer(x).backward(g)
    torch.cuda.current_stream().wait_stream(side)
    x.grad = layer.oft_R.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = layer(x)
        y_static.backward(g)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip((y_static, x.grad, layer.oft_R.grad), eager, strict=True):
        assert torch.equal(got, want)


@needs_triton
@pytest.mark.parametrize("decay", [None, -0.01])
def test_fused_step_kernel_matches_the_foreach_update(decay):
    """xopt.kernels.poet_adam (POETAdamW's one-pass CUDA update) against the foreach update
    it replaces, on a float32 parameter (two steps) and a bf16 one (one step), float32
    moments. The interpreter rounds ``a + α·b`` twice where ATen's CPU kernels may fuse it
    (the CPU model decides): the comparison allows a few float32 ulps of each term's scale;
    and its float32 -> bf16 conversion truncates where a GPU rounds to nearest: one bf16
    ulp. A wrong operation or order moves the float32 parameter's change by orders of
    magnitude more."""
    from xopt.kernels import poet_adam
    from xopt.torch.poet import _foreach_update

    torch.manual_seed(3)
    for pdt, steps in ((torch.float32, 2), (torch.bfloat16, 1)):
        p0 = torch.randn(3000).to(DEV, pdt)
        ref = [p0.clone(), torch.zeros(3000, device=DEV), torch.zeros(3000, device=DEV)]
        got = [p0.clone(), torch.zeros(3000, device=DEV), torch.zeros(3000, device=DEV)]
        for k in range(1, steps + 1):
            g = torch.randn(3000).to(DEV, pdt)
            step = 1e-2 * math.sqrt(1 - 0.999 ** k) / (1 - 0.9 ** k)
            _foreach_update([ref[0]], [g], [ref[1]], [ref[2]], 0.9, 0.999, 1e-3, step, decay,
                            pdt != torch.float32)
            assert poet_adam.supported(got[0], g, got[1], got[2])
            poet_adam.adam_update(got[0], g, got[1], got[2], 0.9, 0.999, 1e-3, step, decay)
        # (m: near-cancellations of β₁m and (1 − β₁)g make relative errors large where m is
        # near 0; a few ulps of the terms' scale, ~0.1, absolutely)
        torch.testing.assert_close(got[1], ref[1], rtol=5e-7, atol=2e-8)
        torch.testing.assert_close(got[2], ref[2], rtol=5e-7, atol=0)
        if pdt == torch.float32:  # the change against the reference's, to a few ulps of p
            torch.testing.assert_close(got[0] - p0, ref[0] - p0, rtol=1e-4, atol=5e-7)
        else:
            r = ref[0].float()
            ulp = torch.exp2(torch.floor(torch.log2(r.abs())) - 7)
            assert ((got[0].float() - r).abs() <= ulp).all()


@needs_triton
def test_fused_step_of_many_parameters_is_one_update_each():
    """poet_adam.adam_update_many (one launch for a list of parameters, their addresses in a
    table on the device) gives the bits of one adam_update per parameter: sizes that do and
    do not fill the last tile, an empty one, bf16 and float32 parameters, each step's fresh
    gradients (their addresses go with each launch: the table of the parameters and moments
    is made once and kept), and a moment replaced by a new tensor (a table made afresh)."""
    from xopt.kernels import poet_adam

    torch.manual_seed(4)
    poet_adam._TABLES.clear()
    for pdt, decay in ((torch.float32, None), (torch.bfloat16, -0.01)):
        sizes = (3000, 1024, 0, 17)
        ref = [[torch.randn(n, device=DEV).to(pdt), torch.rand(n, device=DEV),
                torch.rand(n, device=DEV)] for n in sizes]
        got = [[t.clone() for t in r] for r in ref]
        for k in range(3):
            if k == 2:  # a moment moves (as a reset at a merge boundary moves them)
                got[1][2] = got[1][2].clone()
            gs = [torch.randn(n, device=DEV).to(pdt) for n in sizes]
            for (p, m, v), g in zip(ref, gs, strict=True):
                poet_adam.adam_update(p, g, m, v, 0.9, 0.999, 1e-3, 1e-2 * (k + 1), decay)
            assert poet_adam.adam_update_many([r[0] for r in got], gs, [r[1] for r in got],
                                              [r[2] for r in got], 0.9, 0.999, 1e-3,
                                              1e-2 * (k + 1), decay)
            for r, u in zip(ref, got, strict=True):
                for a, b in zip(r, u, strict=True):
                    assert torch.equal(a, b)
    # per dtype one table for the first two steps' tensors, one after the move
    assert len(poet_adam._TABLES) == 4


@needs_triton
def test_poet_adamw_cuda_step_is_one_kernel_update_per_parameter(monkeypatch):
    """POETAdamW's step on the kernels' path (CUDA; here the interpreter, the path switched
    on for the CPU) gives each parameter the bits of one poet_adam.adam_update with its own
    step count, in one launch per bucket (group and step count) whose tensors share dtypes:
    two groups of one dtype each, a group of two dtypes (one launch per parameter), a
    parameter that skips a step (its own bucket), a moment reset at a merge boundary
    (new moment tensors, so a new table) and fresh gradients every step."""
    from xopt.kernels import poet_adam
    from xopt.kernels.poet_launches import count_launches
    from xopt.torch import poet as xpoet

    monkeypatch.setattr(xpoet, "_fused_ok", lambda p: True)
    torch.manual_seed(6)
    spec = [((4, 6), torch.float32, 0), ((5,), torch.float32, 0), ((5, 2), torch.bfloat16, 1),
            ((7,), torch.bfloat16, 1), ((3,), torch.float32, 2), ((2, 2), torch.bfloat16, 2)]
    ps = [torch.nn.Parameter(torch.randn(s, device=DEV).to(dt)) for s, dt, _ in spec]
    groups = [dict(params=ps[:2], use_poet=True, weight_decay=0.0, lr=1e-2),
              dict(params=ps[2:4], use_poet=False, weight_decay=0.1, lr=3e-3),
              dict(params=ps[4:], use_poet=False, weight_decay=0.0, lr=1e-3)]
    opt = xpoet.POETAdamW(groups, poet_scale=0.5, merge_interval=2)
    ref = [[p.detach().clone(), None, None, 0] for p in ps]
    for step in range(4):
        skip = 3 if step == 1 else None
        grads = [torch.randn(s, device=DEV).to(dt) for s, dt, _ in spec]
        for i, (p, g) in enumerate(zip(ps, grads, strict=True)):
            p.grad = None if i == skip else g.clone()
        count = count_launches(opt.step)
        # one launch for each of groups 0 and 1 (two for group 1 from step 2 on: p3 skipped
        # step 1, so its count stays one behind p2's), one per parameter of group 2
        assert count.triton["_adam_many_kernel"] == (3 if step >= 2 else 2), count
        assert count.triton["_adam_kernel"] == 2, count
        for i, r in enumerate(ref):
            if i == skip:
                continue
            gi = spec[i][2]
            grp = groups[gi]
            if r[1] is None or (gi == 0 and step > 0 and step % 2 == 0):  # new or reset
                r[1], r[2], r[3] = (torch.zeros_like(r[0], dtype=torch.float32),
                                    torch.zeros_like(r[0], dtype=torch.float32), 0)
            r[3] += 1
            k = r[3]
            lr = grp["lr"] * (0.5 if gi == 0 else 1.0)
            step_size = lr * math.sqrt(1 - 0.999 ** k) / (1 - 0.9 ** k)
            decay = -lr * grp["weight_decay"] if grp["weight_decay"] > 0 else None
            poet_adam.adam_update(r[0], grads[i], r[1], r[2], 0.9, 0.999, 1e-6, step_size,
                                  decay)
        for p, r in zip(ps, ref, strict=True):
            st = opt.state[p]
            assert torch.equal(p.detach(), r[0]) and st["step"] == r[3]
            assert torch.equal(st["exp_avg"], r[1]) and torch.equal(st["exp_avg_sq"], r[2])


@needs_triton
def test_fused_step_of_many_parameters_refuses_what_one_launch_cannot_take():
    """adam_update_many returns False and writes nothing where its one launch cannot take
    the tensors: a non-contiguous gradient, gradients of two dtypes, float64 moments, a
    gradient of another shape, parameters of two dtypes."""
    from xopt.kernels import poet_adam

    torch.manual_seed(5)

    def case():
        ps = [torch.randn(6, 4, device=DEV), torch.randn(8, device=DEV)]
        gs = [torch.randn(6, 4, device=DEV), torch.randn(8, device=DEV)]
        ms = [torch.zeros_like(p) for p in ps]
        vs = [torch.zeros_like(p) for p in ps]
        return ps, gs, ms, vs

    bad = []
    ps, gs, ms, vs = case()
    gs[0] = torch.randn(4, 6, device=DEV).t()
    bad.append((ps, gs, ms, vs))
    ps, gs, ms, vs = case()
    gs[1] = gs[1].to(torch.bfloat16)
    bad.append((ps, gs, ms, vs))
    ps, gs, ms, vs = case()
    ms[0] = ms[0].double()
    bad.append((ps, gs, ms, vs))
    ps, gs, ms, vs = case()
    gs[0] = gs[0].reshape(4, 6)
    bad.append((ps, gs, ms, vs))
    ps, gs, ms, vs = case()
    ps[1] = ps[1].to(torch.bfloat16)
    bad.append((ps, gs, ms, vs))
    for ps, gs, ms, vs in bad:
        before = [t.clone() for t in (*ps, *ms, *vs)]
        assert not poet_adam.adam_update_many(ps, gs, ms, vs, 0.9, 0.999, 1e-3, 1e-2, None)
        for a, b in zip(before, (*ps, *ms, *vs), strict=True):
            assert torch.equal(a, b)
