"""xopt.jax's fast learned-optimizer paths (``impl="packed"``, ``impl="pallas"``) against the
plain path, the float64 spec and the golden traces, on the CPU (Pallas's interpreter).

The bounds are the torch Triton path's (tests/test_kernels_lopt.py explains them):
parameters and every state array within 1e-6 (``max|a-b| / max|b|`` per tensor) of the
plain path, and the step held to the float64 step: within 1e-6 of it, or within twice the
plain path's own distance to it where the step function is that ill-conditioned (one
float32 rounding of the inputs moves it by more than 1e-6 on these shapes).

Not the torch Triton path's bits: the Pallas kernels are written anew for JAX, so they add
the statistics in another order (XLA's reductions over per-block sums instead of
float64 per tile) and run the MLP's first layer as float32 rank-1 updates instead of
split-precision TF32 products; both paths are held to the plain path and to float64
instead (bench/lopt_step_jax.py also compares them on the GPU, from the same inputs).

Shapes are tiny: the interpreter runs each kernel program through XLA on the CPU.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np
import pytest
from helpers import has_jax

pytestmark = pytest.mark.skipif(not has_jax, reason="jax/optax are not installed")

EXACT = 1e-6
#: ranks 0-3; square, tall, wide; a (1, n, m) matrix; a 3-D factored tensor (packed XLA path);
#: repeated shapes so that the groups hold several tensors
SHAPES = [(), (5,), (7, 3), (3, 9), (6, 6), (40, 36), (1, 5, 8), (2, 3, 5), (7, 3), (40, 36),
          (5,)]
SMALL_FC = dict(num_training_steps=100, hidden_size=32, step_mult=0.01)


def max_rel(a, b) -> float:
    """``max|a − b| / max|b|`` in float64 (0 for empty or equal arrays), as the harness."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size == 0:
        return 0.0
    d = np.abs(a - b).max()
    return 0.0 if d == 0 else float(d / max(np.abs(b).max(), 1e-300))


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
    st = {f"{v}/{k}": np.asarray(getattr(inner, v)[k], np.float64)
          for v in ("m", "rms", "v_row", "v_col", "v_diag", "lstm_hidden", "lstm_cell")
          for k in names}
    st.update(iteration=np.int32(state.iteration), num_steps=np.int32(state.num_steps),
              mom_t=np.asarray(inner.mom_t), rms_t=np.asarray(inner.rms_t),
              loss_means=np.asarray(inner.loss_means, np.float64),
              loss_running_min=np.asarray(inner.loss_running_min, np.float64),
              loss_decays=np.asarray(inner.loss_decays, np.float64),
              loss_iteration=np.int32(inner.loss_iteration))
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


def test_groups_keep_the_program_size_fixed():
    # the packed paths' matrix products and reductions do not grow with the number of
    # tensors of a shape (the plain path's do): what bounds compile time
    import jax
    import jax.numpy as jnp

    def count(impl, copies):
        shapes = [(6, 4), (4,), (4, 6)] * copies
        params = [jnp.zeros(s, jnp.float32) for s in shapes]
        tx = _tx("small_fc_lopt", impl)
        text = jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
        return sum(text.count(op) for op in ("stablehlo.dot_general", "stablehlo.reduce"))

    packed = [count("packed", c) for c in (2, 6)]
    plain = [count("plain", c) for c in (2, 6)]
    assert packed[0] == packed[1] > 0
    assert plain[1] > plain[0]


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
    groups = {s for s in SHAPES if _lopt_pallas.two_d_view(s) is not None}
    assert groups == {(7, 3), (3, 9), (6, 6), (40, 36), (1, 5, 8)}
    assert low.as_text().count("__gpu$xla.gpu.triton") == 2 * len(groups)


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


def test_the_gpu_default_is_a_path_verified_on_a_gpu(monkeypatch):
    # On an H200 the Pallas kernels gave NaN/inf (bench/RESULTS.md): the default there is the
    # plain path and impl="pallas" is refused with the reason; where the default is a fused
    # path, a configuration its kernels do not cover falls back to the packed path.
    import jax

    import xopt.jax as xj
    from xopt.errors import HyperparameterError
    from xopt.jax import _lopt_fast
    from xopt.specs import small_fc_lopt as spec

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    mod = importlib.import_module("xopt.jax.small_fc_lopt")

    def chosen(**kw):
        hp = spec.SmallFCLOpt(num_training_steps=10, **kw)
        plain = mod._Method(hp, spec.meta_init(hp, 0))
        out = _lopt_fast.select("x", "small_fc_lopt", plain, None, "exact")
        return "plain" if out is plain else out.impl

    assert chosen() == "plain"
    with pytest.raises(HyperparameterError, match="impl='pallas' is not available on a GPU"):
        xj.small_fc_lopt(num_training_steps=10, impl="pallas")
    monkeypatch.setitem(_lopt_fast.GPU_DEFAULT, "small_fc_lopt", "pallas")
    assert chosen() == "pallas"
    assert chosen(hidden_layers=0) == "packed"  # no kernel for a linear MLP
