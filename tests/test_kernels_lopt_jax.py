"""xopt.jax's fast learned-optimizer paths (``impl="packed"``, ``impl="pallas"``) against the
plain path, the float64 spec and the golden traces, on the CPU (Pallas's interpreter).

The bounds are the torch Triton path's (tests/test_kernels_lopt.py explains them):
parameters and every state array within 1e-6 (``max|a-b| / max|b|`` per tensor) of the
plain path, and the step held to the float64 step: within 1e-6 of it, or within twice the
plain path's own distance to it where the step function is that ill-conditioned (one
float32 rounding of the inputs moves it by more than 1e-6 on these shapes).

Not the torch Triton path's bits: the Pallas kernels add the statistics in another order
(XLA's reductions over per-block sums instead of float64 per tile) and XLA contracts
products into sums where NumPy (Triton's interpreter) does not; both paths are held to the
plain path and to float64 here, and to each other op by op in
tests/test_lopt_backend_bits.py.

Shapes are tiny: the interpreter runs each kernel program through XLA on the CPU.
"""

from __future__ import annotations

import functools
import importlib
import re

import numpy as np
import pytest
from helpers import has_jax, velo_spec_state
from helpers import max_rel_array as max_rel

pytestmark = pytest.mark.skipif(not has_jax, reason="jax/optax are not installed")

EXACT = 1e-6
#: ranks 0-3; square, tall, wide; a (1, n, m) matrix; a 3-D factored tensor (packed XLA path);
#: repeated shapes so that the groups hold several tensors
SHAPES = [(), (5,), (7, 3), (3, 9), (6, 6), (40, 36), (1, 5, 8), (2, 3, 5), (7, 3), (40, 36),
          (5,)]
SMALL_FC = dict(num_training_steps=100, hidden_size=32, step_mult=0.01)
#: μLO through small_fc_lopt's fast paths: its global clipping active (gradients of norm > 1)
#: and a μP multiplier per leaf, so that both sit between the kernels and the update
MULO = dict(SMALL_FC, clip_grad=True)


def _mults(names):
    return {k: 0.5 + 0.25 * (i % 3) for i, k in enumerate(names)}


@pytest.fixture(scope="module")
def velo_theta():
    from xopt.specs import velo as spec

    return spec.meta_init(spec.VeLO(num_training_steps=100), 3)


def _params(seed: int, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    return {f"p{i}": (scale * rng.standard_normal(s)).astype(np.float32)
            for i, s in enumerate(SHAPES)}


def _tx(method: str, impl: str, theta=None, **kw):
    import xopt.jax as xj

    if method == "small_fc_lopt":
        return xj.small_fc_lopt(impl=impl, **SMALL_FC, **kw)
    if method == "mulo":
        return xj.mulo(impl=impl, mup_lrs=lambda p: _mults(list(p)), **MULO, **kw)
    return xj.velo(theta, impl=impl, num_training_steps=100, **kw)


def _run(method: str, impl: str, theta=None, steps: int = 2, state=None, params=None):
    """``steps`` jitted updates; per step the state before it, the gradients, the loss and
    the updates; then the final parameters and state."""
    import jax
    import jax.numpy as jnp
    import optax

    tx = _tx(method, impl, theta)
    params = {k: jnp.asarray(v) for k, v in (params or _params(0)).items()}
    state = tx.init(params) if state is None else state

    @jax.jit
    def one(p, s, g, loss):
        u, s = tx.update(g, s, p, value=loss)
        return u, optax.apply_updates(p, u), s

    history = []
    for t in range(steps):
        grads = {k: jnp.asarray(v) for k, v in _params(100 + t).items()}
        loss = jnp.float32(2.0 - 0.1 * t)
        u, new_params, new_state = one(params, state, grads, loss)
        history.append((params, state, grads, loss, u))
        params, state = new_params, new_state
    return history, params, state


def _oracle_steps(method: str, params, state, grads, loss, theta):
    """The float64 step of every tensor (the spec's math in NumPy) from the given inputs."""
    names = list(params)
    f64 = {k: np.asarray(v, np.float64) for k, v in params.items()}
    g64 = {k: np.asarray(v, np.float64) for k, v in grads.items()}
    inner = state.inner
    if method == "small_fc_lopt":
        from xopt.specs import small_fc_lopt as spec

        hp = spec.SmallFCLOpt(**SMALL_FC)
        meta = {k: np.asarray(v, np.float64) for k, v in spec.meta_init(hp, 0).items()}
        decays = spec.decays(hp, meta, xp=np)
        tf = spec.time_features(np, np.asarray(state.iteration), meta["mlp/b0"])
        out = {}
        for k in names:
            accs = [np.asarray(getattr(inner, v)[k], np.float64) for v in spec.PARAM_VARS]
            out[k], _ = spec.compute_step(hp, f64[k], g64[k], *accs, tf, meta, decays, xp=np)
        return out
    from xopt.specs import velo as spec

    hp = spec.VeLO(num_training_steps=100)
    meta = {k: np.asarray(v, np.float64) for k, v in spec.coerce_meta(theta, hp).items()}
    st = velo_spec_state(state, names)
    steps, _ = spec.hyperv2_steps(hp, f64, st, g64, np.float64(loss), meta, xp=np)
    return steps


CASES = [("small_fc_lopt", "packed"), ("small_fc_lopt", "pallas"), ("velo", "packed"),
         ("velo", "pallas")]


@pytest.fixture(scope="module")
def plain_runs(velo_theta):
    return {m: _run(m, "plain", velo_theta) for m in ("small_fc_lopt", "velo")}


@pytest.mark.parametrize("method,impl", CASES)
def test_fast_path_matches_plain_and_float64(method, impl, plain_runs, velo_theta):
    import jax

    hist_a, pa, sa = plain_runs[method]
    hist_b, pb, sb = _run(method, impl, velo_theta)
    assert jax.tree.structure(sa) == jax.tree.structure(sb)  # the same state, by name
    param_err = max(max_rel(np.asarray(pb[k]), np.asarray(pa[k])) for k in pa)
    state_err = max(max_rel(np.asarray(b), np.asarray(a))
                    for a, b in zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True))
    print(f"{method}/{impl} vs plain: params {param_err:.2e}, state {state_err:.2e}")
    assert param_err <= EXACT and state_err <= EXACT
    for t, ((p_a, s_a, g, loss, u_a), (p_b, s_b, _, _, u_b)) in enumerate(
            zip(hist_a, hist_b, strict=True)):
        ref_a = _oracle_steps(method, p_a, s_a, g, loss, velo_theta)
        ref_b = _oracle_steps(method, p_b, s_b, g, loss, velo_theta)
        for k in ref_a:  # updates = -step at learning rate 1
            err_a = max_rel(-np.asarray(u_a[k], np.float64), ref_a[k])
            err_b = max_rel(-np.asarray(u_b[k], np.float64), ref_b[k])
            assert err_b <= max(EXACT, 2 * err_a), (t, k, err_b, err_a)


def test_mulo_through_small_fc_lopts_kernels_matches_plain():
    # μLO's fast path is small_fc_lopt's on the clipped gradients, its steps scaled by the
    # multipliers (0.5-1.0 here): a wrong multiplier or clipping moves the parameters by
    # about |step| (1e-4 of them), far above the bound
    import jax

    _, pa, sa = _run("mulo", "plain")
    _, pb, sb = _run("mulo", "pallas")
    assert jax.tree.structure(sa) == jax.tree.structure(sb)
    assert max(max_rel(np.asarray(pb[k]), np.asarray(pa[k])) for k in pa) <= EXACT
    assert max(max_rel(np.asarray(b), np.asarray(a)) for a, b in
               zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True)) <= EXACT


#: StableHLO ops that only move data (stacking a group, handing each tensor its rows back)
MOVES = ("slice", "concatenate", "reshape", "broadcast_in_dim", "convert", "constant", "iota",
         "transpose", "gather", "dynamic_slice", "dynamic_update_slice")


def _ops_per_tensor(method: str, impl: str, theta, n: int = 4, more: int = 12):
    """The jitted update + apply_updates on ``n`` and on ``n + more`` copies of a block of
    shapes, lowered: (compute ops, all ops, state arrays) added per added tensor."""
    import re
    from collections import Counter

    import jax
    import jax.numpy as jnp
    import optax

    tx = _tx(method, impl, theta)

    def counts(copies):
        params = [jnp.zeros(s, jnp.float32) for s in [(6, 4), (4,), (4, 6)] * copies]

        def step(p, s, g):
            u, s = tx.update(g, s, p, value=jnp.float32(1.0))
            return optax.apply_updates(p, u), s

        state = tx.init(params)
        text = jax.jit(step).lower(params, state, params).as_text()
        ops = Counter(re.findall(r"= \"?stablehlo\.([a-z_]+)", text))
        return (sum(v for k, v in ops.items() if k not in MOVES), sum(ops.values()),
                len(jax.tree.leaves(state)))

    (c0, t0, s0), (c1, t1, s1) = counts(n), counts(n + more)
    added = 3 * more
    return (c1 - c0) / added, (t1 - t0) / added, (s1 - s0) / added


@pytest.mark.parametrize("method", ["small_fc_lopt", "velo"])
def test_packed_program_size_does_not_grow_with_the_tensor_count(method, velo_theta):
    # what bounds compile time: on the packed path a tensor of a shape already present adds
    # no computation of the method, only the two per-leaf ops every optax update has (the
    # update's sign, apply_updates' add) and the moves that hand it its rows of the group's
    # results (a slice, a reshape and a broadcast per array it reads or writes: its state
    # arrays, the parameter and the gradient); the plain path adds its whole math
    packed_compute, packed_all, arrays = _ops_per_tensor(method, "packed", velo_theta)
    plain_compute, _, _ = _ops_per_tensor(method, "plain", velo_theta)
    print(f"{method}: per added tensor, packed {packed_compute} compute / {packed_all} ops "
          f"({arrays} state arrays), plain {plain_compute} compute")
    assert packed_compute <= 2, packed_compute
    assert packed_all <= 2 + 3 * (arrays + 2), (packed_all, arrays)
    assert plain_compute > 20 * max(packed_compute, 1)  # (the measure sees the per-tensor math)


@pytest.mark.parametrize("method,precision", [("small_fc_lopt", "fast"), ("velo", "exact")])
def test_pallas_kernels_lower_to_triton_for_cuda(monkeypatch, method, precision, velo_theta):
    # what the GPU compiles, from this CPU: the kernels' Triton lowering (no interpreter);
    # exact and fast differ in one dot's precision flag (exact: the bench's GPU run)
    import jax
    import jax.numpy as jnp

    from xopt.jax import _lopt_pallas

    monkeypatch.setattr(_lopt_pallas, "_on_cpu", lambda: False)
    params = [jnp.zeros(s, jnp.float32) for s in SHAPES]
    tx = _tx(method, "pallas", velo_theta, precision=precision)
    low = jax.jit(lambda g, s, p: tx.update(g, s, p, value=jnp.float32(1.0))).trace(
        params, tx.init(params), params).lower(lowering_platforms=("cuda",))
    in_kernels = [s for s in SHAPES if _lopt_pallas.two_d_view(s) is not None]
    groups = set(in_kernels)
    assert groups == {(7, 3), (3, 9), (6, 6), (40, 36), (1, 5, 8)}
    # a statistics and a fused call per tensor (VeLO's LSTM inputs from its statistics),
    # reading and writing its own arrays; the calls of a group are one kernel (the tensor's
    # index is an input), which XLA compiles once (its kernel cache is keyed by the call's
    # backend config, the kernel's IR)
    per = 2
    text = low.as_text()
    calls = re.findall(r'custom_call @__gpu\$xla\.gpu\.triton\(.*?name = "(\w+)"', text)
    assert len(calls) == text.count("__gpu$xla.gpu.triton")
    copies = ("split_rows", "stack_rows")
    assert len([c for c in calls if c not in copies]) == per * len(in_kernels)
    # and per state array of a group of several tensors a copy call that stacks the old
    # (stack_rows) and one that hands each tensor its rows of the new (split_rows; none
    # for a group of one, whose row is a reshape): v_row and v_col of the kernels' groups
    # (7, 3) and (40, 36); m, rms and v_diag of the vectors (5,) (their v_row, v_col are
    # empty); VeLO's LSTM state (hidden, cell) of all 11 tensors, split only (the LSTM
    # gathers its input)
    velo = method == "velo"
    assert len(re.findall(r"call @_stack_chunk\w*\(", text)) == 2 + 2 + 3, text
    assert len(re.findall(r"call @_split_chunk\w*\(", text)) == 2 + 2 + 3 + 2 * velo, text
    # each copy call a jitted function lowered once per array size: (7, 3)'s v_row and
    # v_col are 3x3 and 7x3 per tensor, (40, 36)'s 36x3 and 40x3, the vectors' m and v_diag
    # both 5x3 (one function), rms 5x1; VeLO's hidden and cell one size
    assert calls.count("stack_rows") == 6, calls
    assert calls.count("split_rows") == 6 + velo, calls
    kernels = set(re.findall(r'ir = "((?:[^"\\]|\\.)*)"', text))
    assert len(kernels) == per * len(groups) + 2 * 6 + velo, len(kernels)
    # the fused calls update m and rms in place: their results are the buffers of the m and
    # rms they read (else XLA copies each into the donated state after the call)
    fused = [ln for ln in text.splitlines() if "custom_call" in ln and '_fused"' in ln]
    assert len(fused) == len(in_kernels)
    for ln in fused:
        aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", ln)
        ins, outs = (re.findall(r"tensor<[0-9x]*xf32>|tensor<1xi32>", part) for part in
                     ln[ln.rfind(" : ("):].split(" -> "))
        n1, n2 = (int(d) for d in outs[0][7:-5].split("x"))
        assert [(outs[int(o)], ins[int(i)]) for o, i in aliases] == [
            (f"tensor<{n1}x{n2}x3xf32>",) * 2, (f"tensor<{n1}x{n2}xf32>",) * 2], ln
        assert [int(o) for o, _ in aliases] == [1, 2], ln
        assert int(aliases[1][1]) == int(aliases[0][1]) + 1, ln  # rms: the operand after m
    # and no per-element array of theirs is stacked or sliced: no concatenation, slice or
    # gather yields one of (40, 36), a kernels' group of two tensors (their statistics
    # along an axis, (40, 3) and (36, 3), are)
    moved = re.findall(r"stablehlo\.(?:concatenate|slice|gather|dynamic_slice)[^\n]*-> "
                       r"tensor<([0-9x]*)xf32>", text)
    assert moved and not [t for t in moved if "40x36" in t], sorted(set(moved))


def _cuda_program(method: str, theta, copies: int) -> str:
    """The Pallas path's jitted update + apply_updates on ``copies`` copies of a block of a
    matrix and a vector, lowered for CUDA (the kernels as Triton calls)."""
    import jax
    import jax.numpy as jnp
    import optax

    from xopt.jax import _lopt_pallas

    tx = _tx(method, "pallas", theta)
    params = [jnp.zeros(s, jnp.float32) for s in [(6, 4), (4,)] * copies]

    def step(p, s, g):
        u, s = tx.update(g, s, p, value=jnp.float32(1.0))
        return optax.apply_updates(p, u), s

    on_cpu = _lopt_pallas._on_cpu
    _lopt_pallas._on_cpu = lambda: False
    try:
        return jax.jit(step).trace(params, tx.init(params), params).lower(
            lowering_platforms=("cuda",)).as_text()
    finally:
        _lopt_pallas._on_cpu = on_cpu


@pytest.mark.parametrize("method", ["small_fc_lopt", "velo"])
def test_pallas_path_hands_out_state_rows_by_copy_kernels(method, velo_theta):
    # what XLA:GPU would compile per tensor beyond the kernels: a state array of a group of
    # several tensors is written by split_rows' copy kernel, one call for up to SPLIT_K
    # tensors, not sliced per tensor (each slice a kernel XLA compiles apart); the one
    # slice a tensor keeps is its step's, a vector's (its group's step is stacked), which
    # apply_updates reads and XLA fuses into its add. Zero-size slices (the vectors'
    # v_row and v_col placeholders) are no kernel.
    from xopt.jax import _lopt_pallas

    def counts(copies):
        text = _cuda_program(method, velo_theta, copies)
        shapes = re.findall(r"stablehlo\.slice[^\n]*-> tensor<([0-9x]*)xf32>", text)
        # the copy calls (each a call of a jitted function, its kernel in that function's
        # body once), and the other kernels' calls
        split, stack = (len(re.findall(rf"call @{n}(_[0-9]+)?\(", text))
                        for n in ("_split_chunk", "_stack_chunk"))
        copies = sum(text.count(f'name = "{n}"') for n in ("split_rows", "stack_rows"))
        return (len([t for t in shapes if "0" not in t.split("x")]), split, stack,
                text.count("__gpu$xla.gpu.triton") - copies)

    (s0, c0, j0, k0), (s1, c1, j1, k1) = counts(4), counts(4 + _lopt_pallas.SPLIT_K)
    added = _lopt_pallas.SPLIT_K  # matrices, and as many vectors
    assert (s1 - s0) == added, (s0, s1)  # the vectors' steps
    assert (k1 - k0) == 2 * added  # a statistics and a fused call per matrix
    # the copy calls: one more per stacked state array (v_row, v_col of the matrices; m,
    # rms, v_diag of the vectors; VeLO's hidden and cell, of twice as many tensors)
    assert c1 - c0 == 5 + (2 * 2 if method == "velo" else 0), (c0, c1)
    assert j1 - j0 == 5, (j0, j1)


def test_axis_statistics_are_the_specs_factored_update():
    # _axis_prep evaluates the spec's factored_update split where the group can share it:
    # each tensor's means of g² + 1e-30 over its axes (an XLA reduction of its own
    # gradient), then the accumulators' update on the group's means stacked. The update is
    # the spec's expression on the same operands; the means are XLA's sums, whose order XLA
    # picks per fusion (here, in a program of another shape than the plain path's, a sum
    # can come out an ulp apart: the whole-update tests hold v_row, v_col to 1e-6 of the
    # plain path). So: every entry within the bound of a float32 sum of n positive terms
    # in any order (n·2⁻²⁴ relative, n the reduced axis's length, plus the update's two
    # roundings) of the float64 spec, as the plain path's factored_update is
    import jax
    import jax.numpy as jnp

    from xopt.jax import _lopt_pallas
    from xopt.specs import lopt

    rng = np.random.default_rng(5)
    decays = np.asarray([0.5, 0.9, 0.999], np.float32)
    d = jnp.asarray(decays)
    for shape in [(40, 36), (7, 3), (3, 9), (1, 5, 8)]:
        sh = lopt.factored_shapes(shape, 3)
        g = [rng.standard_normal(shape).astype(np.float32) * 1e-2 for _ in range(3)]
        vr = [rng.random(sh["v_row"]).astype(np.float32) * 1e-4 for _ in range(3)]
        vc = [rng.random(sh["v_col"]).astype(np.float32) * 1e-4 for _ in range(3)]
        vd = [np.zeros(sh["v_diag"], np.float32)] * 3
        got = jax.jit(lambda vr, vc, vd, g, shape=shape: _lopt_pallas._axis_prep(
            shape, vr, vc, vd, g, d, d[:1], d))(vr, vc, vd, g)
        plain = jax.jit(lambda vr, vc, vd, g: [
            lopt.factored_update(jnp, *a, d)[:2] for a in zip(vr, vc, vd, g, strict=True)])(
                vr, vc, vd, g)
        d1, d0 = lopt.factored_dims(shape)
        bound = (max(shape[d0], shape[d1]) + 2) * 2.0**-24
        for i, a in enumerate(zip(vr, vc, vd, g, strict=True)):
            want = lopt.factored_update(np, *(np.asarray(x, np.float64) for x in a),
                                        decays.astype(np.float64))[:2]
            for k, w in enumerate(want):
                key = ("new_row", "new_col")[k]
                err = np.abs(np.asarray(got[key][i], np.float64) - w) / w
                assert err.max() <= bound, (shape, key, err.max())
                ref = np.abs(np.asarray(plain[i][k], np.float64) - w) / w
                assert ref.max() <= bound  # (the bound is the plain path's too)


def test_copy_kernels_copy_every_row():
    # split_rows and stack_rows: more tensors than a call takes (a placeholder-padded last
    # call), rows longer than a program's span (SPLIT_G blocks), and the sizes a group of
    # one or empty rows take
    import jax
    import jax.numpy as jnp

    from xopt.jax import _lopt_pallas as lp

    span = lp.SPLIT_G * lp.SPLIT_BLOCK
    for n, shape in [(lp.SPLIT_K + 3, (7,)), (3, (span // 3 + 5, 3)), (1, (4, 3)),
                     (2, (0, 3))]:
        x = jnp.asarray(np.random.default_rng(n).standard_normal((n, *shape)), jnp.float32)
        out = jax.jit(lambda x, shape=shape: lp.split_rows(x, shape))(x)
        assert len(out) == n
        for i, o in enumerate(out):
            assert o.shape == shape and np.array_equal(np.asarray(o), np.asarray(x[i]))
        back = jax.jit(lp.stack_rows)([x[i] for i in range(n)])
        assert back.shape == x.shape and np.array_equal(np.asarray(back), np.asarray(x))


def test_impl_and_precision_are_checked():
    import jax
    import jax.numpy as jnp

    import xopt.jax as xj
    from xopt.errors import HyperparameterError

    with pytest.raises(HyperparameterError, match="impl"):
        xj.small_fc_lopt(num_training_steps=10, impl="triton2")
    with pytest.raises(HyperparameterError, match="precision"):
        xj.small_fc_lopt(num_training_steps=10, impl="pallas", precision="tf32")
    with pytest.raises(HyperparameterError, match="ff_hidden_size"):
        xj.velo(num_training_steps=10, impl="pallas", ff_hidden_size=8)
    with pytest.raises(HyperparameterError, match="hidden_layers"):
        xj.small_fc_lopt(num_training_steps=10, impl="pallas", hidden_layers=0)
    # μLO on small_fc_lopt's kernels: the errors name μLO
    with pytest.raises(HyperparameterError, match=r"xopt\.jax\.mulo.*impl"):
        xj.mulo(num_training_steps=10, impl="triton2")
    with pytest.raises(HyperparameterError,
                       match=r"xopt\.jax\.mulo\(impl='pallas'\).*hidden_layers"):
        xj.mulo(num_training_steps=10, impl="pallas", hidden_layers=0)
    # the default is the plain path on a CPU, and the state is the same for every impl
    params = {"w": jnp.ones((3, 4)), "b": jnp.ones((4,))}
    structures = {str(jax.tree.structure(_tx("small_fc_lopt", impl).init(params)))
                  for impl in ("plain", "packed", "pallas")}
    assert len(structures) == 1
    from xopt.jax import _lopt_fast

    assert _lopt_fast.resolve_impl("x", None, "exact") == "plain"


def test_a_plain_state_resumes_on_the_packed_path(plain_runs):
    # the state is the plain path's: one more step from plain's state gives plain's result
    import jax

    hist, params, state = plain_runs["small_fc_lopt"]
    p0 = {k: np.asarray(v) for k, v in params.items()}
    _, pa, sa = _run("small_fc_lopt", "plain", steps=1, state=state, params=p0)
    _, pb, sb = _run("small_fc_lopt", "packed", steps=1, state=state, params=p0)
    assert max(max_rel(np.asarray(pb[k]), np.asarray(pa[k])) for k in pa) <= EXACT
    assert max(max_rel(np.asarray(b), np.asarray(a)) for a, b in
               zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True)) <= EXACT
    del hist


@pytest.mark.parametrize("method,impl", [c for c in CASES if c[1] == "pallas"])
def test_fast_path_reproduces_the_golden_case(method, impl, monkeypatch):
    # the bundled golden case through xopt.parity's harness, xopt.jax on the fast path
    # (pallas: its kernels on the 2-D tensors, the packed path on the others)
    from helpers import explain_disagreements

    from xopt.parity import bundled_traces
    from xopt.parity.harness import run_parity

    mod = importlib.import_module(f"xopt.jax.{method}")  # (xopt.jax.<method> is the function)
    monkeypatch.setattr(mod, method, functools.partial(getattr(mod, method), impl=impl))
    report = run_parity(method, bundled_traces(method), backends=["jax"],
                        explicit_backends=True, max_steps=6)
    assert report.verdict == "agree", explain_disagreements(report)
    assert {r.mode for r in report.runs} == {"teacher_forced", "closed_loop"}


def test_the_gpu_default_is_the_pallas_path_and_falls_back_to_plain(monkeypatch):
    # On a GPU the default is the path timed fastest beside the others (bench/RESULTS.md:
    # Pallas); a configuration its kernels do not cover falls back to plain (faster than
    # packed); an explicit impl is taken as asked; the CPU's default is plain.
    import jax

    from xopt.jax import _lopt_fast
    from xopt.specs import small_fc_lopt as spec

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    mod = importlib.import_module("xopt.jax.small_fc_lopt")

    def chosen(**kw):
        hp = spec.SmallFCLOpt(num_training_steps=10, **kw)
        plain = mod._Method(hp, spec.meta_init(hp, 0))
        out = _lopt_fast.select("x", "small_fc_lopt", plain, None, "exact")
        return "plain" if out is plain else out.impl

    assert _lopt_fast.GPU_DEFAULT == {"small_fc_lopt": "pallas", "velo": "pallas"}
    assert chosen() == "pallas"
    assert chosen(hidden_layers=0) == "plain"  # no kernel for a linear MLP
    hp = spec.SmallFCLOpt(num_training_steps=10)
    asked = _lopt_fast.select("x", "small_fc_lopt", mod._Method(hp, spec.meta_init(hp, 0)),
                              "packed", "exact")
    assert asked.impl == "packed"
    # μLO takes the same default: its update holds small_fc_lopt's kernels on a GPU only
    import jax.numpy as jnp

    import xopt.jax as xj

    def mulo_program():
        tx = xj.mulo(num_training_steps=10)
        params = {"w": jnp.ones((3, 4)), "b": jnp.ones((4,))}
        return str(jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(
            params, tx.init(params), params))

    assert "sfc_fused" in mulo_program()
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert chosen() == "plain"
    assert "pallas_call" not in mulo_program()


def _unmasked_boundary_accesses(closed) -> list[str]:
    """Every access, in the Pallas kernels of a program (``jax.make_jaxpr``'s result), to a
    block that can reach past its array (a block dimension that does not divide the
    array's) without a mask, or a masked load without ``other``. Pallas's Triton lowering
    bounds no plain ``ref[...]``: on a GPU such an access reads or writes memory outside the
    block's array, which the CPU interpreter (NaN-padded blocks, out-of-range lanes dropped)
    never shows."""
    from jax.extend.core import jaxprs_in_params

    bad: list[str] = []

    def kernel(eqn) -> None:
        gm = eqn.params["grid_mapping"]
        kj = eqn.params["jaxpr"]
        over = {}
        for bm, ref in zip(gm.block_mappings, kj.invars, strict=False):
            sizes = [getattr(b, "block_size", None) for b in bm.block_shape]
            if any(s is not None and d % s for s, d in zip(sizes, bm.array_aval.shape,
                                                            strict=True)):
                over[id(ref)] = f"{eqn.params.get('name')}: block {tuple(sizes)} of " \
                            f"{bm.array_aval.shape}"
        accesses(kj, over)

    def accesses(body, over) -> None:
        for q in body.eqns:
            refs = [id(v) for v in q.invars if id(v) in over]
            if not refs:
                continue
            name = q.primitive.name
            if name == "scan":  # a loop over sub-tiles: its body's accesses are checked
                inner = q.params["jaxpr"].jaxpr
                accesses(inner, {id(w): over[id(v)] for v, w in zip(q.invars, inner.invars,
                                                                    strict=True)
                                 if id(v) in over})
                continue
            if name == "masked_load":
                _, _, mask, other = q.params["args_tree"].unflatten(q.invars)
                ok = mask is not None and other is not None
            elif name == "masked_swap":
                ok = q.params["args_tree"].unflatten(q.invars)[3] is not None
            else:  # get, swap (unmasked), or the ref handed to anything else
                ok = False
            if not ok:
                bad.append(f"{over[refs[0]]}: {name}")

    def walk(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                kernel(eqn)
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    return bad


@pytest.mark.parametrize("method", ["small_fc_lopt", "velo"])
def test_pallas_boundary_blocks_are_masked(method, velo_theta):
    # shapes whose rows (odd) and columns (not a multiple of the block's 64) end inside a
    # block: every kernel access to them is masked, loads with other=0
    import jax
    import jax.numpy as jnp

    from xopt.jax import _lopt_pallas

    shapes = [(5, 70), (3, 9), (5, 70)]
    params = [jnp.zeros(s, jnp.float32) for s in shapes]
    tx = _tx(method, "pallas", velo_theta)
    closed = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p, value=jnp.float32(1.0)))(
        params, tx.init(params), params)
    text = str(closed)
    # statistics and fused pass of each tensor; and the copies that stack the (5, 70)
    # group's v_row and v_col and hand the new ones back (VeLO: and every tensor its LSTM
    # state), calls of jitted functions whose kernel the jaxpr prints once per function
    copies = sum(text.count(f"name={n}") for n in ("split_rows", "stack_rows"))
    splits, stacks = (text.count(f"name={n}") for n in ("_split_chunk", "_stack_chunk"))
    assert text.count("pallas_call[") - copies == 6, (text.count("pallas_call["), copies)
    assert (splits, stacks) == (2 + 2 * (method == "velo"), 2)
    assert _unmasked_boundary_accesses(closed) == []
    assert _lopt_pallas.BR == 2 and _lopt_pallas.BC == 64  # (what makes the shapes ragged)
