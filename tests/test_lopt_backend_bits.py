"""The JAX Pallas path of the learned optimizers against the torch Triton path, bit for bit,
from the same inputs (θ bundled with xopt, parameters, gradients, optimizer state, step).

On a CPU both run in their interpreters (Triton under ``TRITON_INTERPRET=1``, Pallas with
``interpret=True``); on a CUDA device both compiled (the device chosen as
tests/helpers.py ``triton_kernel_target``; the torch step eager there, not replayed from a
CUDA graph, which gives the same bits). Each output (the step, each state variable) and the
stages between them are compared and the verdict printed (``pytest -rA``); where the bits
differ, the test names the op and holds the difference to the behaviour that explains it:

* the same bits: the decays (on the CPU; on a GPU each framework's device log/exp, held to
  their accuracy), the weights' TF32 halves, the accumulators from a fresh state, the
  fused pass's accumulators, VeLO's LSTM inputs but its fraction embedding on a GPU
  (each side's device tanh, reproduced);
* FMA contraction: ``m``, ``rms``, ``v_diag`` (``d·old + (1 − d)·x``) from a carried state:
  XLA on the CPU contracts the first product and the sum into one fused multiply-add (the
  Pallas interpreter and the packed XLA path of vectors and scalars), NumPy (Triton's
  interpreter) never does, torch's kernel compiled for sm_90 contracts the second;
  asserted element by element against the evaluations;
* reduction order, held to the rounding bound of the sums: the Adafactor statistics
  ``v_row``, ``v_col`` and their row-column mean (torch: per tile, then the tiles' partial
  sums in order; XLA: its reduction), the time features folded into the first bias, the
  normalizers (torch: float32 per thread, float64 per tile and across tiles; Pallas:
  float32 per block, the blocks added by XLA);
* the fused pass fed the torch path's own statistics, normalizers, axis terms and bias: on
  the CPU its step differs where the interpreters' hosts round differently (NumPy's
  ``1/sqrt``, ``exp`` and BLAS product against XLA's, asserted op by op on the same
  operands); each path's step within the exact mode's bound of float64;
* VeLO's LSTM: torch's Triton path runs it (and the hypernetwork's mixing) in float64,
  rounded once (xopt.kernels.velo.LSTM_F64); xopt.jax's paths in float32, as the plain
  paths: from the same inputs torch's state is the float64 LSTM rounded once, JAX's within
  the float32 evaluation's rounding bound of it. The steps then differ by that; each is
  held to the float64 step as its own suite holds it.

The Pallas path is also held to the plain JAX path as the torch suite holds the Triton
path to the plain torch path (tests/test_kernels_lopt.py): state within 1e-6, the step
within 1e-6 (exact mode) or 2e-2 (fast mode), two runs the same bits.

Shapes: a 2-D tensor whose rows (5) and columns (70) are multiples of neither path's block,
a vector and a scalar (the Pallas path runs kernels on the 2-D group, its packed XLA path
on the others; the torch path runs kernels on all). small_fc_lopt in both precisions;
VeLO (no precision choice in its 4-wide MLP) once.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from helpers import has_jax, triton_kernel_target, velo_spec_state
from helpers import max_rel_array as max_rel

needs_kernel, DEVICE = triton_kernel_target()
pytestmark = [needs_kernel, pytest.mark.skipif(not has_jax, reason="jax is not installed")]

SHAPES = [(5, 70), (6,), ()]
ITERATION = 7
#: unit roundoff of float32
U = 2.0 ** -24
EXACT = 1e-6
FAST_STEP = 2e-2


def gamma(n: int) -> float:
    """Higham's γ_n = n·u / (1 − n·u): the relative error bound of a float32 sum of n
    terms of one sign in any order (and of a product of n roundings)."""
    return n * U / (1 - n * U)


def ulps(a, b) -> int:
    """The largest distance in float32 units in the last place between two arrays."""
    a = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    b = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    return int(np.abs(a - b).max()) if a.size else 0


def fma32(a, b, c) -> np.ndarray:
    """``a·b + c`` rounded once to float32 (float32 operands): the product is exact in
    float64 and the sum's float64 rounding error (TwoSum) decides the one case where
    rounding float64 to float32 would round twice, a float32 midpoint."""
    a, b, c = (np.asarray(x, np.float32).astype(np.float64) for x in np.broadcast_arrays(a, b, c))
    p = a * b
    s = p + c
    bp = s - c
    e = (p - bp) + (c - (s - bp))
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    toward = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)))
    tie = (r64 != s) & (np.abs(s - r64) == np.abs(toward.astype(np.float64) - s))
    fix = np.nextafter(r, np.where(e > 0, np.float32(np.inf), np.float32(-np.inf)))
    return np.where(tie & (e != 0), fix, r).astype(np.float32)


def unfused32(a, b, c) -> np.ndarray:
    """``a·b + c`` with the product rounded to float32 first (no contraction)."""
    a, b, c = (np.asarray(x, np.float32) for x in (a, b, c))
    return (a * b).astype(np.float32) + c


def _inputs(hp, spec, carried: bool):
    """Parameters, gradients and per-tensor state (the 2-D tensor's state fresh, zeros;
    the others' carried, random, positive where it is a second moment)."""
    rng = np.random.default_rng(0)

    def r(s, pos=False):
        x = rng.standard_normal(s).astype(np.float32)
        return np.abs(x) + np.float32(0.1) if pos else x

    params = [r(s) for s in SHAPES]
    grads = [r(s) for s in SHAPES]
    states = []
    for s in SHAPES:
        shapes = spec.param_state_shapes(hp, s)
        fresh = len(s) == 2 and not carried
        states.append({k: np.zeros(v, np.float32) if fresh else r(v, pos=k != "m")
                       for k, v in shapes.items()})
    return params, grads, states


class _Spy:
    """A Triton kernel whose launches are recorded (their tensor arguments cloned after
    the launch)."""

    def __init__(self, log, name, kern):
        self.log, self.name, self.kern = log, name, kern

    def __getitem__(self, grid):
        import torch

        def launch(*args, **kw):
            self.kern[grid](*args, **kw)
            self.log.setdefault(self.name, []).append(
                [a.detach().clone().cpu() if isinstance(a, torch.Tensor) else a for a in args])
        return launch


def _sfc_run(precision: str, with_plain: bool) -> dict:
    """small_fc_lopt (bundled θ), one step through both paths from the same inputs in
    ``precision``, with the stages' results of each (the torch kernels' launches recorded,
    the Pallas path's stage runner's results), the Pallas step run twice (its bits compared),
    and with ``with_plain`` the plain JAX path and the float64 step (the spec in NumPy)."""
    import jax
    import jax.numpy as jnp
    import torch

    from xopt.checkpoints.bundled import bundled_meta_params
    from xopt.jax import _lopt_fast
    from xopt.kernels import lopt_common as C
    from xopt.kernels import small_fc_lopt as ks
    from xopt.specs import small_fc_lopt as spec

    jmod = importlib.import_module("xopt.jax.small_fc_lopt")
    theta, hyper = bundled_meta_params("small_fc_lopt")
    hp = spec.SmallFCLOpt(num_training_steps=100, **hyper)
    meta = {k: np.asarray(v, np.float32) for k, v in spec.coerce_meta(theta, hp).items()}
    params, grads, states = _inputs(hp, spec, carried=False)

    # torch Triton
    log: dict = {}
    mp = pytest.MonkeyPatch()
    # on a GPU: every launch eager (the same bits), so that the recorded launches ran
    mp.setenv("XOPT_LOPT_CUDA_GRAPHS", "0")
    for mod, name in ((ks, "sfc_norm_kernel"), (ks, "sfc_axis_kernel"), (C, "rcm_kernel"),
                      (ks, "sfc_fold_fused_kernel")):
        mp.setattr(mod, name, _Spy(log, name, getattr(mod, name)))
    try:
        kern = ks.SmallFCTriton(hp, precision)
        dev = DEVICE
        tp = [torch.from_numpy(p.copy()).to(dev) for p in params]
        tg = [torch.from_numpy(g.copy()).to(dev) for g in grads]
        tst = [{k: torch.from_numpy(v.copy()).to(dev) for k, v in st.items()} for st in states]
        outs = [torch.empty_like(p) for p in tp]
        tmeta = {k: torch.from_numpy(v.copy()).to(dev) for k, v in meta.items()}
        n = len(tp)
        kern.step(tp, tg, tst, outs, [True] * n, [1.0] * n, [0.0] * n, tmeta, ITERATION)
    finally:
        mp.undo()
    torch_res = dict(step=[o.cpu().numpy() for o in outs],
                     state=[{k: v.cpu().numpy() for k, v in st.items()} for st in tst],
                     decays=kern._decays[1].cpu().numpy(), log=log,
                     wh=kern._wcache[1]["wh"].cpu().numpy())

    # JAX Pallas, each stage's result recorded (the stage runner's hook)
    jmeta = {k: jnp.asarray(v) for k, v in meta.items()}
    plain = jmod._Method(hp, jmeta)
    inner = jmod.SmallFCState(*([jnp.asarray(st[v]) for st in states] for v in spec.PARAM_VARS),
                              mom_t=jnp.zeros((3,), jnp.int32), rms_t=jnp.zeros((1,), jnp.int32))
    args = ([jnp.asarray(p) for p in params], [jnp.asarray(g) for g in grads], jnp.float32(0),
            jnp.int32(ITERATION), inner)

    def run(method, record, times=1):
        rec: dict = {}

        def stage(name, fn, *a):
            out = fn(*a)
            rec[name] = out
            return out

        if record:
            method.stage = stage

        def f(*a):
            rec.clear()
            out = method.update(*a)
            return out, dict(rec)

        f = jax.jit(f)
        runs = []
        for _ in range(times):
            (steps, new), stages = f(*args)
            runs.append(([np.asarray(s) for s in steps],
                         [{v: np.asarray(getattr(new, v)[i]) for v in spec.PARAM_VARS}
                          for i in range(len(SHAPES))]))
        return runs[0][0], runs[0][1], stages, runs

    pallas = _lopt_fast.PackedSmallFC(plain, "pallas", precision)
    j_step, j_state, stages, runs = run(pallas, True, times=2)
    out = dict(hp=hp, meta=meta, jmeta=jmeta, params=params, grads=grads, states=states,
               precision=precision, torch=torch_res, jax=dict(step=j_step, state=j_state,
                                                              stages=stages, runs=runs))
    if with_plain:
        p_step, p_state, _, _ = run(plain, False)
        out["plain"] = dict(step=p_step, state=p_state)
        m64 = {k: v.astype(np.float64) for k, v in meta.items()}
        decays = spec.decays(hp, m64, xp=np)
        tf = spec.time_features(np, np.int32(ITERATION), m64["mlp/b0"])
        out["f64"] = [spec.compute_step(hp, np.float64(p) if np.ndim(p) == 0 else
                                        p.astype(np.float64), g.astype(np.float64),
                                        *(st[v].astype(np.float64) for v in spec.PARAM_VARS),
                                        tf, m64, decays, xp=np)[0]
                      for p, g, st in zip(params, grads, states, strict=True)]
    return out


@pytest.fixture(scope="module")
def sfc():
    """small_fc_lopt, exact mode (:func:`_sfc_run`)."""
    return _sfc_run("exact", with_plain=True)


@pytest.fixture(scope="module")
def sfc_fast():
    """small_fc_lopt, fast mode (:func:`_sfc_run`)."""
    return _sfc_run("fast", with_plain=False)


def _verdict(name, a, b) -> str:
    line = f"{name}: " + ("same bits" if ulps(a, b) == 0 else
                          f"differ, {ulps(a, b)} ulps, max rel {max_rel(a, b):.2e}")
    print(line)
    return line


def test_decays_and_weight_halves_are_the_same_bits(sfc):
    # the effective decays (the spec's log/exp on the host of each framework) and the
    # hidden layer's TF32 halves (torch's split_weights, Pallas's split_tf32): bit ops
    dec_t = sfc["torch"]["decays"]
    dec_j = np.concatenate([np.asarray(d) for d in sfc["jax"]["stages"]["setup"][0]])
    _verdict("decays", dec_j, dec_t)
    if DEVICE.type == "cpu":
        assert ulps(dec_j, dec_t) == 0
    else:  # each framework's device log and exp (CUDA's: within 2 ulps each): d = 1 − E,
        # E = exp(z), z = 10·(log(1 − d₀)/10 + θ), so |Δd| = |ΔE| ≤ E·(|Δz| + 2·2u) with
        # |Δz| ≤ (|z| + 1)·8u (a log, two scalings and a sum), both sides
        d0 = np.concatenate([np.asarray(v, np.float64) for v in (
            sfc["hp"].initial_momentum_decays, sfc["hp"].initial_rms_decays,
            sfc["hp"].initial_adafactor_decays)])
        theta = np.concatenate([sfc["meta"][k].astype(np.float64) for k in (
            "decays/momentum", "decays/rms", "decays/adafactor")])
        z = 10 * (np.log(1 - d0) / 10 + theta)
        e = np.exp(z)
        assert np.all(np.abs(dec_j.astype(np.float64) - dec_t)
                      <= 2 * e * ((np.abs(z) + 1) * 8 * U + 4 * U))
    wh_j = np.asarray(sfc["jax"]["stages"]["norm@5x70"]["wh"])  # [nhid, 2, HP, HP]
    hp_ = wh_j.shape[-1]
    wh_t = sfc["torch"]["wh"].reshape(2, -1, hp_, hp_)  # hi halves, then lo halves
    _verdict("hidden layer hi/lo halves", np.swapaxes(wh_j, 0, 1), wh_t)
    assert ulps(np.swapaxes(wh_j, 0, 1), wh_t) == 0


@pytest.mark.parametrize("var", ["step", "m", "rms", "v_row", "v_col", "v_diag"])
@pytest.mark.parametrize("k", range(len(SHAPES)), ids=["x".join(map(str, s)) or "scalar"
                                                       for s in SHAPES])
@pytest.mark.parametrize("mode", ["sfc", "sfc_fast"])
def test_per_output_verdicts(request, mode, k, var):
    # every output of the step, tensor by tensor, in both precisions: the verdict printed
    # (pytest -rA), and the differences held to their explanations (the tests below)
    sfc = request.getfixturevalue(mode)
    t = sfc["torch"]["step"][k] if var == "step" else sfc["torch"]["state"][k][var]
    j = sfc["jax"]["step"][k] if var == "step" else sfc["jax"]["state"][k][var]
    assert t.shape == j.shape
    _verdict(f"{sfc['precision']} {SHAPES[k]} {var}", j, t)
    if var in ("m", "rms") and len(SHAPES[k]) == 2:  # fresh state: nothing to contract
        assert ulps(j, t) == 0
    if var == "v_diag" and len(SHAPES[k]) == 2:  # the placeholder, untouched
        assert ulps(j, t) == 0


@pytest.mark.parametrize("k", [1, 2], ids=["6", "scalar"])
def test_carried_accumulators_differ_by_fma_contraction(sfc, k):
    # m = d·m_old + (1 − d)·g, rms = d·rms_old + (1 − d)·g², v_diag = c·v_old + (1 − c)·(g² +
    # 1e-30), d loaded, 1 − d one float32 subtraction, each side from its own decays (on a
    # GPU each framework's device log and exp: test_decays_and_weight_halves_are_the_same_bits).
    # XLA on the CPU contracts the first product into the sum (fma(d, old, (1 − d)·x));
    # Triton's interpreter (NumPy) rounds both products. Compiled for sm_90 with FP_FUSION
    # (sfc_fused_kernel's PTX, these tensors' launch), torch's kernel contracts the *second*
    # product: ``mul.f32 t, d, old`` then ``fma.rn.f32 r, (1 − d), x, t`` for m, rms and
    # v_diag (x = g, rn(g·g), rn(rn(g·g) + 1e-30)): asserted element by element on a GPU.
    # The Pallas path's vectors and scalars are XLA's fusions (LLVM's contraction, not
    # readable here): each element one of the three evaluations (for v_diag, with x rounded
    # twice or fma(g, g, 1e-30)), printed.
    g = sfc["grads"][k]
    old = sfc["states"][k]
    one = np.float32(1)
    gg = (g * g).astype(np.float32)
    xs = {"m": [g], "rms": [gg], "v_diag": [gg + np.float32(1e-30)]}
    if DEVICE.type != "cpu":
        xs["v_diag"].append(fma32(g, g, np.float32(1e-30)))

    def evaluations(dec, var, x):
        d = {"m": dec[:3], "rms": np.clip(dec[3], 0, 1), "v_diag": np.clip(dec[4:], 0, 1)}[var]
        o, x = old[var], x[..., None]
        e = (one - d).astype(np.float32)
        dx = (e * x).astype(np.float32)
        return {"no contraction": unfused32(d, o, dx), "first product fused": fma32(d, o, dx),
                "second product fused": fma32(e, x, (d * o).astype(np.float32))}

    dec_t = sfc["torch"]["decays"]
    dec_j = np.concatenate([np.asarray(d) for d in sfc["jax"]["stages"]["setup"][0]])
    for var in ("m", "rms", "v_diag"):
        t, j = sfc["torch"]["state"][k][var], sfc["jax"]["state"][k][var]
        _verdict(f"{SHAPES[k]} {var}", j, t)
        ev_t = evaluations(dec_t, var, xs[var][0])
        if DEVICE.type == "cpu":
            assert np.array_equal(t, ev_t["no contraction"]), var
            ev_j = evaluations(dec_j, var, xs[var][0])
            assert np.array_equal(j, ev_j["first product fused"]), var
            continue
        assert np.array_equal(t, ev_t["second product fused"]), var
        found = {f"{name}" + (", x = fma(g, g, 1e-30)" if i else ""): j == val
                 for i, x in enumerate(xs[var])
                 for name, val in evaluations(dec_j, var, x).items()}
        print(f"  Pallas (XLA) {var}:", [n for n, v in found.items() if v.all()] or
              {n: int(v.sum()) for n, v in found.items()})
        assert np.all(np.logical_or.reduce(list(found.values()))), var


def test_adafactor_statistics_differ_by_reduction_order(sfc):
    # v = c·v_old + (1 − c)·mean(g² + 1e-30) over one axis (v_old = 0 here): a sum of n
    # positive terms, a division and a product (and the sum with c·v_old): each path within
    # γ_(n+3) of the exact value, so the two within 2γ_(n+3) of each other. The row-column
    # mean, a mean over the N1 entries of v_row, adds N1 + 1 roundings.
    n1, n2 = SHAPES[0]
    pre = sfc["jax"]["stages"]["prep@5x70"]
    st_t = sfc["torch"]["state"][0]
    for var, key, n in (("v_row", "new_row", n2), ("v_col", "new_col", n1)):
        t, j = st_t[var], np.asarray(pre[key][0])
        _verdict(f"{SHAPES[0]} {var}", j, t)
        assert np.all(np.abs(t.astype(np.float64) - j) <= 2 * gamma(n + 3) * np.abs(t)), var
    rcm_t = sfc["torch"]["log"]["rcm_kernel"][0][3].numpy()[:3]
    rcm_j = np.asarray(pre["new_row"][0], np.float32).mean(axis=0, dtype=np.float32)
    bound = 2 * gamma(n2 + 3 + n1 + 1) * np.abs(rcm_t)
    _verdict("row-column mean", rcm_j, rcm_t)
    assert np.all(np.abs(rcm_t.astype(np.float64) - rcm_j) <= bound)


def test_time_feature_bias_differs_by_reduction_order(sfc):
    # b0 + Σ_k tf_k·W0[28 + k] over the 11 time features: torch sums the products over k
    # (torch.sum), Pallas's XLA as a matrix product; each within γ_12 of the exact value
    # (relative to |b0| + Σ|tf_k·W0|), the two within twice that
    from xopt.specs import small_fc_lopt as spec

    b0_t = sfc["torch"]["log"]["sfc_fold_fused_kernel"][0][11].numpy()
    b0_j = np.asarray(sfc["jax"]["stages"]["norm@5x70"]["b0"])[0]
    _verdict("first bias with the time features", b0_j, b0_t)
    meta = sfc["meta"]
    tf = np.tanh(np.float64(ITERATION) / np.asarray(spec.TIMESCALES, np.float64) - 1.0)
    w = np.abs(meta["mlp/w0"][28:].astype(np.float64))
    scale = np.abs(meta["mlp/b0"].astype(np.float64)) + np.abs(tf) @ w
    hp_ = b0_t.shape[0]
    assert np.all(np.abs(b0_t[:scale.size].astype(np.float64) - b0_j[:scale.size])
                  <= 2 * gamma(12) * scale + 4 * U * np.abs(b0_t[:scale.size]))
    assert hp_ == b0_j.shape[0]


def test_normalizers_differ_by_reduction_order(sfc):
    # inv_f = rsqrt(1e-5 + Σ f² / n) per feature f. Σ f²: n = 350 terms of one sign (γ_n
    # each path, whatever the order); each f² from at most 4 roundings and one rsqrt of the
    # same inputs, squared (2·(4 + 2)u; NumPy's 1/sqrt and XLA's rsqrt within 2 ulps), the
    # factors from v_row, v_col that differ by the statistics' bound (squared: 2·2γ_(n+3)
    # per factor, two factors); then /n, +1e-5 (2u) and the rsqrt (½ of the relative change,
    # plus 2 ulps). Each path within that of the exact value, the two within twice it.
    n1, n2 = SHAPES[0]
    n = n1 * n2
    norm_t = sfc["torch"]["log"]["sfc_norm_kernel"][0][3][0].numpy()[:28]
    fsm = sfc["jax"]["stages"]["norm@5x70"]["feature_sq_mean"][0]
    import jax

    norm_j = np.asarray(jax.lax.rsqrt(1e-5 + fsm))
    _verdict("normalizers", norm_j, norm_t)
    term = 2 * 6 * U + 2 * 2 * 2 * gamma(max(n1, n2) + 3)
    bound = 2 * (0.5 * (gamma(n) + term + 2 * U) + 2 * U)
    print(f"  bound {bound:.2e}, max rel {np.max(np.abs(norm_t / norm_j - 1)):.2e}")
    assert np.all(np.abs(norm_t.astype(np.float64) / norm_j - 1) <= bound)


@pytest.mark.skipif(DEVICE is None or DEVICE.type != "cpu",
                    reason="the CPU interpreters' arithmetic (a GPU compiles both to Triton)")
def test_interpreters_round_rsqrt_exp_and_products_differently():
    # the ops of the fused pass whose bits differ between the two interpreters' hosts, on
    # the same operands: Triton's interpreter evaluates rsqrt as NumPy's 1/sqrt (two
    # roundings), exp as NumPy's float32 exp and tl.dot as NumPy's matmul plus the
    # accumulator; Pallas's interpreter runs XLA's rsqrt, exp and dot. (On a GPU both
    # lower to Triton: see test_fused_pass_from_the_same_inputs.)
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    x = (np.abs(rng.standard_normal(4096)) * 10.0 ** rng.uniform(-8, 3, 4096)).astype(np.float32)
    y = rng.uniform(-20, 20, 4096).astype(np.float32)
    a = rng.standard_normal((128, 16)).astype(np.float32)
    b = rng.standard_normal((16, 32)).astype(np.float32)
    c = rng.standard_normal((128, 32)).astype(np.float32)
    pairs = {
        "rsqrt": (1 / np.sqrt(x), jax.jit(jax.lax.rsqrt)(x)),
        "exp": (np.exp(y), jax.jit(jnp.exp)(y)),
        "matmul + acc": (np.matmul(a, b, dtype=np.float32) + c,
                         jax.jit(lambda a, b, c: c + jnp.dot(a, b))(a, b, c)),
    }
    for name, (t, j) in pairs.items():
        j = np.asarray(j)
        _verdict(name, j, t)
        assert ulps(j, t) > 0, name  # they differ ...
        # ... by a few roundings: rsqrt and exp within 2 ulps each side; a K-term product
        # sum within γ_(K+1) Σ|a·b| + |c| each side
        if name == "matmul + acc":
            scale = np.abs(a) @ np.abs(b) + np.abs(c)
            assert np.all(np.abs(t.astype(np.float64) - j) <= 2 * gamma(17) * scale)
        else:
            assert np.all(np.abs(t.astype(np.float64) - j) <= 4 * U * np.abs(t)), name


@pytest.mark.parametrize("mode", ["sfc", "sfc_fast"])
def test_fused_pass_from_the_same_inputs(request, mode):
    # the Pallas fused kernel fed the torch path's statistics (v_row, v_col, their
    # row-column mean), normalized first-layer rows (w16n), axis terms and first bias:
    # what is left is the kernel itself. m and rms: the same bits (fresh state). The step:
    # on the CPU the interpreters' rsqrt, exp and products (the test above); each path's
    # step within EXACT of the float64 step on these inputs (tests/test_kernels_lopt.py,
    # tests/test_kernels_lopt_jax.py), so the two within 2·EXACT; in fast mode on a GPU
    # (TF32 products) each within FAST_STEP of the plain step, the two within twice that.
    # Fast mode under the interpreters: one float32 product each (no split), as exact mode's
    # algebra with the low halves zero.
    import jax
    import jax.numpy as jnp

    from xopt.jax import _lopt_pallas as P
    from xopt.specs import arrays, lopt

    sfc = request.getfixturevalue(mode)
    prec = sfc["precision"]
    shape = SHAPES[0]
    n1, n2, row_on_1 = P.two_d_view(shape)
    log = sfc["torch"]["log"]
    st_t = sfc["torch"]["state"][0]
    stages = sfc["jax"]["stages"]
    vr = jnp.asarray(st_t["v_row"]).reshape(1, -1, 3)
    vc = jnp.asarray(st_t["v_col"]).reshape(1, -1, 3)
    rcm = jnp.asarray(log["rcm_kernel"][0][3].numpy()[:3]).reshape(1, 1, 3)
    rf = lopt.safe_rsqrt(jnp, arrays.divide(jnp, vr, rcm + 1e-9))  # (as _axis_prep)
    cf = lopt.safe_rsqrt(jnp, vc)
    f1, f2 = (rf, cf) if row_on_1 else (cf, rf)
    pre = dict(stages["prep@5x70"], f1=jnp.swapaxes(f1, 1, 2), f2=jnp.swapaxes(f2, 1, 2))
    terms = log["sfc_axis_kernel"][0][4].numpy()
    nr = vr.shape[1]
    t_row, t_col = terms[None, :nr], terms[None, nr:nr + vc.shape[1]]
    t1, t2 = (t_row, t_col) if row_on_1 else (t_col, t_row)
    fz = log["sfc_fold_fused_kernel"][0]
    norm = dict(stages["norm@5x70"], w16=jnp.asarray(log["sfc_norm_kernel"][0][4][:1].numpy()),
                t1=jnp.asarray(t1), t2=jnp.asarray(t2), b0=jnp.asarray(fz[11].numpy())[None])
    fused = jax.jit(lambda pr, no, *a: P.SmallFCKernels(sfc["hp"], sfc["jmeta"], prec).fused(
        shape, pr, no, *a))
    step, m, rms = fused(pre, norm, [jnp.asarray(sfc["grads"][0])],
                         [jnp.asarray(sfc["params"][0])],
                         [jnp.asarray(sfc["states"][0]["m"])],
                         [jnp.asarray(sfc["states"][0]["rms"])])
    for name, j, t in (("m", m[0], st_t["m"]), ("rms", rms[0], st_t["rms"])):
        _verdict(f"{prec} fused pass {name}", j, t)
        assert ulps(j, t) == 0
    _verdict(f"{prec} fused pass step", step[0], sfc["torch"]["step"][0])
    tf32 = prec == "fast" and DEVICE.type != "cpu"
    assert max_rel(step[0], sfc["torch"]["step"][0]) <= 2 * (FAST_STEP if tf32 else EXACT)


@pytest.mark.parametrize("mode", ["sfc", "sfc_fast"])
def test_pallas_runs_give_the_same_bits(request, mode):
    # determinism, as tests/test_kernels_lopt.py asks of the torch kernels: the compiled
    # Pallas update run twice on the same inputs
    (s0, st0), (s1, st1) = request.getfixturevalue(mode)["jax"]["runs"]
    for k in range(len(SHAPES)):
        assert ulps(s0[k], s1[k]) == 0
        assert all(ulps(st0[k][v], st1[k][v]) == 0 for v in st0[k])


def test_fast_mode_is_bounded_against_plain(sfc, sfc_fast):
    # as the torch suite's test_fast_mode_is_bounded: the fast mode's step within FAST_STEP
    # of the plain path's, its state within EXACT (TF32 products move the MLP's outputs, not
    # the accumulators)
    for k in range(len(SHAPES)):
        assert max_rel(sfc_fast["jax"]["step"][k], sfc["plain"]["step"][k]) <= FAST_STEP
        for v in ("m", "rms", "v_row", "v_col", "v_diag"):
            assert max_rel(sfc_fast["jax"]["state"][k][v], sfc["plain"]["state"][k][v]) <= EXACT


def test_steps_held_to_float64_as_their_suites_hold_them(sfc):
    # each path's step against the float64 step from these inputs, as the two suites hold
    # them: within EXACT, or twice the plain path's distance where the step is that
    # ill-conditioned; the paths' difference within the sum
    for k, ref in enumerate(sfc["f64"]):
        plain = max_rel(sfc["plain"]["step"][k], ref)
        errs = {"torch": max_rel(sfc["torch"]["step"][k], ref),
                "pallas": max_rel(sfc["jax"]["step"][k], ref)}
        print(f"{SHAPES[k]} step vs float64: plain {plain:.2e}, "
              + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
        assert all(e <= max(EXACT, 2 * plain) for e in errs.values()), (k, errs)


def test_both_paths_match_their_plain_path(sfc):
    # the Pallas path against xopt.jax's plain path as the torch suite holds the Triton
    # path against the plain torch path: state within EXACT; the step (lr 1, the update)
    # within EXACT of plain's on these inputs
    for k in range(len(SHAPES)):
        for v in ("m", "rms", "v_row", "v_col", "v_diag"):
            assert max_rel(sfc["jax"]["state"][k][v], sfc["plain"]["state"][k][v]) <= EXACT
        assert max_rel(sfc["jax"]["step"][k], sfc["plain"]["step"][k]) <= EXACT


# -- VeLO ------------------------------------------------------------------------------------


def _noncontiguous(x: np.ndarray):
    """``x`` as a torch tensor on DEVICE that is not contiguous (every other column of a
    wider one, made there: ``.to`` would make it contiguous), so that the Triton path writes
    the step into a buffer (applied after, and recorded here) instead of updating the
    parameter in place; a 0-d array as it is."""
    import torch

    if x.ndim == 0:
        return torch.from_numpy(x.copy()).to(DEVICE)
    buf = torch.zeros(x.shape[:-1] + (2 * x.shape[-1],), device=DEVICE)
    buf[..., ::2] = torch.from_numpy(x).to(DEVICE)
    return buf[..., ::2]


@pytest.fixture(scope="module")
def velo():
    """VeLO (bundled θ), one step from a fresh state through xopt.torch.VeLO(impl="triton")
    and xopt.jax.velo(impl="pallas") (and the plain JAX path), the same parameters,
    gradients and loss; the LSTM's inputs and outputs of each (xopt.specs.velo.lstm_step,
    which both call, recorded)."""
    import jax
    import jax.numpy as jnp
    import torch

    import xopt.jax as xj
    import xopt.torch as xt
    from xopt.checkpoints.bundled import bundled_meta_params
    from xopt.kernels import velo as kv
    from xopt.specs import velo as vspec

    theta, hyper = bundled_meta_params("velo")
    rng = np.random.default_rng(1)
    params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    loss = 2.0
    calls: dict = {}
    real = vspec.lstm_step

    def spy(xp, x, hidden, cell, meta):
        out = real(xp, x, hidden, cell, meta)
        calls[xp.__name__] = (x, hidden, cell, out[2], out[3])
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(vspec, "lstm_step", spy)
    # on a GPU: the step eager and its LSTM glue not compiled (the same numbers), so that the
    # recorded LSTM call ran
    mp.setenv("XOPT_LOPT_CUDA_GRAPHS", "0")
    mp.setattr(kv, "COMPILE_GLUE", False)
    try:
        tp = [torch.nn.Parameter(_noncontiguous(p)) for p in params]
        opt = xt.VeLO(tp, theta, num_training_steps=100, impl="triton", **hyper)
        steps: dict = {}
        apply = opt._apply_step

        def record(e, step):
            steps[id(e.param)] = step.detach().cpu().numpy().copy()
            apply(e, step)

        mp.setattr(opt, "_apply_step", record)
        for p, g in zip(tp, grads, strict=True):
            p.grad = _noncontiguous(g)
        opt.step(loss=torch.tensor(loss, device=DEVICE))
        # (every non-contiguous parameter's step went through the buffer, recorded)
        assert {k for k, p in enumerate(tp) if id(p) in steps} == {
            k for k, shape in enumerate(SHAPES) if shape}
        t_calls = [a.detach().cpu().numpy() for a in calls.pop("torch")]
        torch_res = dict(step={k: steps[id(p)] for k, p in enumerate(tp) if id(p) in steps},
                         param=[p.detach().cpu().numpy() for p in tp],
                         state=[{k: v.detach().cpu().numpy() for k, v in opt.state[p].items()}
                                for p in tp], lstm=t_calls)

        def run(impl):
            tx = xj.velo(theta, impl=impl, num_training_steps=100, **hyper)
            jp = [jnp.asarray(p) for p in params]
            state = tx.init(jp)

            def f(p, s, g):
                calls.clear()
                u, s = tx.update(g, s, p, value=jnp.float32(loss))
                return u, s, calls.get("jax.numpy")

            u, new, lstm = jax.jit(f)(jp, state, [jnp.asarray(g) for g in grads])
            return dict(step=[-np.asarray(x) for x in u], state0=state, lstm=lstm,
                        param=[np.asarray(p + x) for p, x in zip(jp, u, strict=True)],
                        state=[{v: np.asarray(getattr(new.inner, v)[k])
                                for v in torch_res["state"][k]} for k in range(len(SHAPES))])

        pallas = run("pallas")
        plain = run("plain")
    finally:
        mp.undo()
    pallas["lstm"] = [np.asarray(a) for a in pallas["lstm"]]
    # the float64 step (the spec in NumPy) from the same inputs
    hp = vspec.VeLO(num_training_steps=100, **hyper)
    meta = {k: np.asarray(v, np.float64) for k, v in vspec.coerce_meta(theta, hp).items()}
    s0 = pallas["state0"]
    names = [f"p{k}" for k in range(len(SHAPES))]
    st = velo_spec_state(s0, range(len(names)), names)
    f64, _ = vspec.hyperv2_steps(hp, {n: np.asarray(p, np.float64) for n, p in zip(
        names, params, strict=True)}, st, {n: np.asarray(g, np.float64) for n, g in zip(
            names, grads, strict=True)}, np.float64(loss), meta, xp=np)
    return dict(torch=torch_res, jax=pallas, plain=plain, f64=[f64[n] for n in names],
                meta=meta, grads=grads)


VELO_VARS = ["step", "param", "m", "rms", "v_row", "v_col", "v_diag", "lstm_hidden",
             "lstm_cell"]


@pytest.mark.parametrize(("k", "var"), [
    pytest.param(k, var, id=f"{'x'.join(map(str, s)) or 'scalar'}-{var}")
    for k, s in enumerate(SHAPES) for var in VELO_VARS
    if s or var != "step"])  # the torch path applies a 0-d step in place: "param" compares it
def test_velo_per_output_verdicts(velo, k, var):
    # every output of VeLO's step, tensor by tensor. From a fresh state the accumulators
    # have nothing to contract: m, rms, v_diag are the same bits. The others: the tests below.
    t = velo["torch"][var][k] if var in ("step", "param") else velo["torch"]["state"][k][var]
    j = velo["jax"][var][k] if var in ("step", "param") else velo["jax"]["state"][k][var]
    j = np.asarray(j).reshape(t.shape)
    _verdict(f"VeLO {SHAPES[k]} {var}", j, t)
    if var in ("m", "rms", "v_diag"):
        assert ulps(j, t) == 0



def test_velo_adafactor_statistics_differ_by_reduction_order(velo):
    # as small_fc_lopt's (test_adafactor_statistics_differ_by_reduction_order): a mean over
    # one axis of g² + 1e-30 in another order; each within γ_(n+3), the two within twice
    n1, n2 = SHAPES[0]
    for var, n in (("v_row", n2), ("v_col", n1)):
        t, j = velo["torch"]["state"][0][var], velo["jax"]["state"][0][var].reshape(-1)
        t = t.reshape(-1)
        _verdict(f"VeLO {SHAPES[0]} {var}", j, t)
        assert np.all(np.abs(t.astype(np.float64) - j) <= 2 * gamma(n + 3) * np.abs(t)), var


def test_velo_lstm_inputs_are_the_same_bits(velo):
    # the LSTM's 30 inputs per tensor (time fraction, loss features, the old accumulators'
    # mean and variances: 0 from a fresh state) and its state: the same bits, but for the
    # fraction embedding tanh(10·(f − τ)) (the first 9) on a GPU, where each side is its own
    # device's tanh of the same float32 arguments: torch's xopt.specs.arrays.tanh (XLA's CPU
    # approximation written out, its fused steps and division in float64 rounded once:
    # NumPy's bits), JAX's jnp.tanh compiled for the device (XLA:GPU's own evaluation),
    # each reproduced element by element and each within E_T of the exact tanh
    import jax
    import jax.numpy as jnp

    from xopt.specs import velo as vspec

    x_t, h_t, c_t = (a.astype(np.float32) for a in velo["torch"]["lstm"][:3])
    x_j, h_j, c_j = velo["jax"]["lstm"][:3]
    nf = len(vspec.FRACTION_TIMESCALES)
    frac = np.float32(0)  # the fixture's step: iteration 0 of a fresh state
    emb_t = vspec.fraction_embedding(np, frac, frac)
    emb_j = np.asarray(jax.jit(lambda f: vspec.fraction_embedding(jnp, f, f))(jnp.float32(frac)))
    assert np.array_equal(x_t[:, :nf], np.broadcast_to(emb_t, x_t[:, :nf].shape))
    assert np.array_equal(x_j[:, :nf], np.broadcast_to(emb_j, x_j[:, :nf].shape))
    arg = (frac - np.asarray(vspec.FRACTION_TIMESCALES, np.float32)) * np.float32(10)
    exact = np.tanh(arg.astype(np.float64))
    for e in (emb_t, emb_j):
        assert np.all(np.abs(e - exact) <= E_T * np.abs(exact))
    _verdict("LSTM inputs: fraction embedding", x_j[:, :nf], x_t[:, :nf])
    if DEVICE.type == "cpu":  # jnp.tanh on the CPU is the approximation written out
        assert ulps(emb_j, emb_t) == 0
    for name, t, j in (("LSTM inputs but the fraction embedding", x_t[:, nf:], x_j[:, nf:]),
                       ("LSTM hidden in", h_t, h_j), ("LSTM cell in", c_t, c_j)):
        _verdict(name, j, t)
        assert ulps(j, t) == 0, name
    # (the torch path hands them to the LSTM in float64: exactly the float32 numbers)
    assert np.array_equal(velo["torch"]["lstm"][0], x_t.astype(np.float64))


#: relative accuracy assumed of a float32 tanh and logistic (XLA's, torch's: a few ulps)
E_T = 8 * U


def _lstm_bound(x, hidden, cell, meta):
    """A first-order bound, per entry of the new ``(hidden, cell)``, of a float32 evaluation
    of :func:`xopt.specs.velo.lstm_step` from exact float32 inputs: each linear layer of K
    inputs within γ_(K+1)·(|x|·|W| + |b|) plus its inputs' error times |W|; max-pooling and
    ReLU 1-Lipschitz; the logistic ¼-Lipschitz and tanh 1-Lipschitz, each within E_T of its
    value; a product or sum one rounding more. Returns ``(ref, bound)`` for hidden and cell,
    the float64 values."""
    def lin(v, ev, w, b):
        y = v @ w + b
        return y, ev @ np.abs(w) + gamma(v.shape[-1] + 1) * (np.abs(v) @ np.abs(w) + np.abs(b))

    def sig(z):
        return 1 / (1 + np.exp(-z))

    zero = np.zeros_like(x)
    mix, e_mix = lin(x, zero, meta["lstm/mix1/w"], meta["lstm/mix1/b"])
    mix, e_mix = np.maximum(mix, 0), e_mix
    pooled, e_pool = mix.max(0, keepdims=True), e_mix.max(0, keepdims=True)
    inp, e_inp = lin(x, zero, meta["lstm/input/w"], meta["lstm/input/b"])
    inp = inp + pooled
    e_inp = e_inp + e_pool + U * np.abs(inp)
    z, e_z = lin(np.concatenate([inp, hidden], -1),
                 np.concatenate([e_inp, np.zeros_like(hidden)], -1),
                 meta["lstm/gates/w"], meta["lstm/gates/b"])
    h = hidden.shape[-1]
    (zi, zg, zf, zo), (ei, eg, ef, eo) = ([a[..., k * h:(k + 1) * h] for k in range(4)]
                                          for a in (z, e_z))
    f, si, tg, so = sig(zf + 1), sig(zi), np.tanh(zg), sig(zo)
    e_f = 0.25 * (ef + U * np.abs(zf + 1)) + E_T * f
    e_si = 0.25 * ei + E_T * si
    e_tg = eg + E_T * np.abs(tg)
    e_so = 0.25 * eo + E_T * so
    c = f * cell + si * tg
    e_c = e_f * np.abs(cell) + e_si * np.abs(tg) + si * e_tg + 3 * U * (np.abs(f * cell)
                                                                         + np.abs(si * tg))
    tc = np.tanh(c)
    new_h = so * tc
    e_h = e_so * np.abs(tc) + so * (e_c + E_T * np.abs(tc)) + U * np.abs(new_h)
    return (new_h, e_h), (c, e_c)


def test_velo_lstm_state_float64_on_torch_float32_on_jax(velo):
    # torch's Triton path runs the LSTM in float64 and rounds its results once
    # (xopt.kernels.velo.LSTM_F64); xopt.jax's paths run the spec's float32 LSTM, as the
    # plain paths. From the same inputs (test above): torch's new state is the float64
    # LSTM's (NumPy's, the same function) rounded once; JAX's within the float32
    # evaluation's first-order rounding bound of it (_lstm_bound, with 1% for the
    # second-order terms).
    from xopt.specs import velo as vspec

    meta = {k: v for k, v in velo["meta"].items() if k.startswith("lstm/")}
    x, hid, cel = (np.asarray(a, np.float64) for a in velo["torch"]["lstm"][:3])
    _, _, _, ref_h, ref_c = *velo["torch"]["lstm"][:3], *vspec.lstm_step(np, x, hid, cel,
                                                                         meta)[2:]
    bounds = _lstm_bound(x, hid, cel, meta)
    for i, name in enumerate(("lstm_hidden", "lstm_cell")):
        t64 = velo["torch"]["lstm"][3 + i]
        ref = (ref_h, ref_c)[i]
        assert np.all(np.abs(t64 - ref) <= 1e-12 * np.abs(ref).max())  # float64 both
        t = np.stack([velo["torch"]["state"][k][name] for k in range(len(SHAPES))])
        j = np.stack([velo["jax"]["state"][k][name] for k in range(len(SHAPES))])
        assert np.array_equal(t, t64.astype(np.float32)), name  # rounded once
        _verdict(f"VeLO {name}", j, t)
        b = bounds[i][1] * 1.01
        print(f"  JAX vs float64: {np.max(np.abs(j - ref) / b):.1e} of the bound")
        assert np.all(np.abs(j.astype(np.float64) - ref) <= b), name


def test_velo_steps_held_to_float64_as_their_suites_hold_them(velo):
    # the steps differ through the LSTM (above) and the statistics' order; each path is held
    # to the float64 step from these inputs as tests/test_kernels_lopt.py and
    # tests/test_kernels_lopt_jax.py hold it: within EXACT, or twice the plain path's own
    # distance where the step is that ill-conditioned; the two within the sum
    for k, ref in enumerate(velo["f64"]):
        plain = max_rel(velo["plain"]["step"][k], ref)
        bound = max(EXACT, 2 * plain)
        errs = {"pallas": max_rel(velo["jax"]["step"][k], ref)}
        if k in velo["torch"]["step"]:
            errs["torch"] = max_rel(velo["torch"]["step"][k], ref)
        print(f"VeLO {SHAPES[k]} step vs float64: plain {plain:.2e}, "
              + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
        assert all(e <= bound for e in errs.values()), (k, errs, bound)
