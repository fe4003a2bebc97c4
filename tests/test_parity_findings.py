"""Issue 29's findings on cases outside the bundled traces, each reproduced on a trace of
the original code (tests/fixtures/parity/, recorded by tools/record_coap_resumed.py and
tools/record_velo_cases.py) and explained.

1. COAP resumed mid-run, rank 6, interval 4, factor 3: at step 12 (QR and SVD refresh P,
   the moments are carried to the new subspace) xopt.jax's update leaves float32 rounding
   while xopt.torch reproduces the authors' code. Not an accuracy loss of xopt.jax: the
   carried moments are as accurate in both backends; the Adam direction M/(√V + ε) then
   amplifies their (different) roundings where the carried V is small, and the float64
   oracle sides with the authors on one tensor and with xopt.jax on the other. xopt.torch
   matches the authors because it rounds in the same BLAS order.
2. VeLO, Triton path (exact mode), zero-initialised bias, horizon 200, seed 1: the first
   step's bias is 2.1e-6 from the original and 1.3e-6 from plain, while plain is within
   1e-6 of the original; the float64 oracle is nearer the Triton path (1.7e-7) than plain
   (1.3e-6) or the original (2.1e-6). The op: the LSTM's step-size head ``lr_mult = hidden
   · w + b`` (512 terms), which multiplies the tensor's whole step, cancels: Σ|hidden_i·w_i|
   is 87 × |lr_mult| on the bias, so the float32 rounding of that dot and of the hidden
   state it reads (the 542-wide gate product) moves lr_mult by 1.5e-6 of itself. The
   kernel glue (``xopt.kernels.velo.lstm_glue``) runs the LSTM in float64 from the same
   LSTM inputs (the same bits on a first step), plain and the original in float32. With
   the glue's LSTM in float32 (``LSTM_F64 = False``) the Triton path is within 2e-7 of
   plain here, but a float32 LSTM fed the statistics pass's correctly rounded inputs, which
   differ from plain's float32 means by a rounding, is then 1.5e-6 from float64 on
   tests/test_kernels_lopt.py's case (bound 1e-6; float64: 2.4e-7): only plain's own
   float32 bits, not reproducible in the kernels' sums, would track plain after the first
   step. Kept in float64: nearer exact, and reported as such.
3. VeLO, plain torch, zero-initialised bias, horizon 10,000, seed 3: the first step's bias
   is 1.15e-6 from the original (beyond 1e-6), and the float64 oracle is nearer xopt: the
   original's own float32 rounding. The verdict says "closer to exact", apart from
   agreement and divergence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, has_jax, has_torch

FIX = REPO / "tests" / "fixtures" / "parity"
COAP = FIX / "coap" / "adamw_r6_tu4_rf3_resumed8_seed1.json"
VELO_N200 = FIX / "velo" / "linear_zero_bias_n200_seed1.json"
VELO_N10000 = FIX / "velo" / "linear_zero_bias_n10000_seed3.json"

pytestmark = pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")


def test_coap_refresh_step_is_ill_conditioned_not_a_jax_accuracy_loss():
    import torch

    from xopt.parity.harness import run_parity

    # torch with every core's thread, as when this finding was measured: at this
    # ill-conditioned refresh step torch's own float32 result moves with its thread count
    # (one thread: 4.5e-6 from the recording at step 12; tests/conftest.py gives each xdist
    # worker its share of the cores)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        report = run_parity("coap", [COAP], backends=["torch", "jax"],
                            modes=["teacher_forced"], max_steps=13)
    finally:
        torch.set_num_threads(threads)
    torch_run, jax_run = report.runs
    assert torch_run.agrees, torch_run.worst
    # xopt.jax: every entry beyond tolerance at step 12, none of them a formulation
    over = [(t, k) for t, errs in enumerate(jax_run.per_step) for k, e in errs.items()
            if not e.within(jax_run.tolerance.for_tensor(k))]
    assert over and {t for t, _ in over} == {12}, over
    # the float64 oracle sides with the authors on one tensor, with xopt.jax on the other
    from xopt.parity import load_trace
    from xopt.parity.harness import make_runner, original_of, trace_hyperparameters, trace_state
    from xopt.parity.methods import get as get_parity
    from xopt.specs import get

    t = load_trace(COAP)
    spec = get("coap")
    origin = original_of(spec, t)
    hp = origin.from_kwargs(trace_hyperparameters(t))
    out = {}
    for w in ("jax", "oracle"):
        r = make_runner(spec, hp, list(t.params), w)
        r.reset(t.params_after(11), trace_state(t, spec, hp, origin.naming_for(hp), 11))
        r.step(t.grads(12), t.loss(12), get_parity("coap").inject(t, 12, hp))
        out[w] = r.read()[0]
    sides = {}
    for k in ("mlp/0/weight", "mlp/1/weight"):
        ex = out["oracle"][k]
        sides[k] = ("jax" if np.abs(out["jax"][k] - ex).max()
                    < np.abs(t.params_after(12)[k] - ex).max() else "authors")
    # which tensor XLA's float32 evaluation lands nearer depends on the CPU's code (CI's
    # Intel: one each; an AMD EPYC: both): on no CPU are the authors nearer on both
    assert "jax" in sides.values(), sides
    # the harness's verdict says the same: nearer the exact result on every tensor beyond
    # tolerance is "closer_to_exact", else the divergence stands
    want = "closer_to_exact" if set(sides.values()) == {"jax"} else "diverge"
    assert jax_run.verdict == want, (jax_run.verdict, sides)


def test_coap_carried_moments_are_as_accurate_in_jax_as_in_torch():
    # step 12's restore and moment update, from the authors' state after step 11, in float32
    # torch, float32 jax (jitted) and float64: the moments' errors agree; the direction's
    # do not (amplified where the carried V is small: measured 1.75e-6 / 6.1e-6 in jax,
    # 4.9e-7 / 1.2e-5 in torch, against moments within 2e-7)
    import jax
    import jax.numpy as jnp
    import torch

    from xopt.parity import load_trace
    from xopt.parity.harness import original_of, trace_hyperparameters
    from xopt.specs import coap as S
    from xopt.specs import get, hp_for
    from xopt.specs.lowrank import hf_adam_direction, hf_adam_moments

    t = load_trace(COAP)
    spec = get("coap")
    hp = original_of(spec, t).from_kwargs(trace_hyperparameters(t))
    before, after, grads = t.state_after(11), t.state_after(12), t.grads(12)
    for name in ("mlp/0/weight", "mlp/1/weight"):
        h, side = hp_for(hp, name), S.side_of(t.params[name])
        args = (before[f"{name}/exp_avg"], before[f"{name}/exp_avg_sq"],
                before[f"{name}/projector/ortho_matrix"],
                after[f"{name}/projector/ortho_matrix"], grads[name])

        def step(xp, m, v, p0, p1, g, h=h, side=side):
            m, v = S.restore_moments(xp, h, m, v, p0, p1, side)
            m, v = hf_adam_moments(xp, m, v, S.project(xp, g, p1, side), h.b1, h.b2)
            return m, v, hf_adam_direction(xp, m, v, h.eps)

        exact = step(np, *(a.astype(np.float64) for a in args))
        ours = {"torch": [x.numpy() for x in step(torch, *map(torch.tensor, args))],
                "jax": [np.asarray(x) for x in jax.jit(lambda *a: step(jnp, *a))(
                    *map(jnp.asarray, args))]}
        err = {w: [np.abs(o - e).max() / np.abs(e).max() for o, e in zip(r, exact, strict=True)]
               for w, r in ours.items()}
        for i in (0, 1):  # M and V: the same accuracy (float32 rounding of the products)
            assert err["jax"][i] <= 2 * err["torch"][i] + 1e-7, (name, err)
            assert err["jax"][i] < 5e-7, (name, err)
        # the direction M/(√V + ε) amplifies those roundings in one backend or both: its
        # largest entries, and its largest errors, sit where the carried V is smallest
        # (√V of the order of ε), where a rounding of V is the largest relative to V
        worst_moment = max(max(e[0], e[1]) for e in err.values())
        assert max(err["jax"][2], err["torch"][2]) > 2 * worst_moment, (name, err)
        v = exact[1]
        for w, r in ours.items():
            worst = np.unravel_index(np.abs(r[2] - exact[2]).argmax(), v.shape)
            assert (v < v[worst]).mean() < 0.05, (name, w)


def _velo_worker() -> dict:
    """Child process (TRITON_INTERPRET=1): VeLO's first update on VELO_N200, teacher-forced:
    the Triton exact mode against the original (the harness) and against plain, with the
    glue's LSTM in float64 (the default) and in float32; and the LSTM's own inputs and
    outputs on that step, in float32 and float64."""
    import torch

    from xopt.kernels import velo as kv
    from xopt.parity import load_trace
    from xopt.parity.harness import (
        _drive,
        make_runner,
        original_of,
        run_parity,
        trace_hyperparameters,
    )
    from xopt.specs import get
    from xopt.specs import velo as sv

    t = load_trace(VELO_N200)
    spec = get("velo")
    origin = original_of(spec, t)
    hp = origin.from_kwargs(trace_hyperparameters(t))
    gold = t.params_after(0)["bias"].astype(np.float64)
    scale = np.abs(gold).max()
    calls: list = []  # every lstm_step call: (caller's module, x, hidden, cell, weights)
    lstm_step = sv.lstm_step

    def spy(xp, x, hidden, cell, meta):
        calls.append((sys._getframe(1).f_globals["__name__"], x, hidden, cell, dict(meta)))
        return lstm_step(xp, x, hidden, cell, meta)

    def first(impl):
        r = make_runner(spec, hp, list(t.params), "torch", impl=impl, meta=t.meta_params())
        return _drive(r, t, spec, hp, origin.naming_for(hp), "teacher_forced", 1,
                      lambda: None)[0].params["bias"].astype(np.float64)

    sv.lstm_step = spy
    try:
        plain = first("plain")
        (prun,) = run_parity("velo", [VELO_N200], backends=["torch"], impl="plain",
                             modes=["teacher_forced"], max_steps=1).runs
        out: dict = {"plain": {"rel": prun.per_step[0]["param/bias"].rel,
                               "backend_to_exact": prun.backend_to_exact}}
        for f64 in (True, False):  # the default (float64), then float32
            if not f64:
                kv.LSTM_F64 = False
            report = run_parity("velo", [VELO_N200], backends=["torch"], impl="triton",
                                modes=["teacher_forced"], max_steps=1)
            (run,) = report.runs
            out["f64" if f64 else "f32"] = {
                "verdict": run.verdict, "rel": run.per_step[0]["param/bias"].rel,
                "backend_to_exact": run.backend_to_exact,
                "against_to_exact": run.against_to_exact,
                "triton-plain": float(np.abs(first("triton") - plain).max() / scale)}
    finally:
        sv.lstm_step = lstm_step
        kv.LSTM_F64 = True
    out["plain-golden"] = float(np.abs(plain - gold).max() / scale)
    # the LSTM inputs of plain's call and the glue's first (the default's): the same bits
    xp_ = calls[0][1]
    _, xg, h, c, w64 = next(k for k in calls if k[0] == "xopt.kernels.velo")
    out["glue_lstm_dtype"] = str(xg.dtype)
    out["inputs_equal"] = bool(torch.equal(xp_, xg.float()))
    xg, h, c, w64 = xg.double(), h.double(), c.double(), {k: v.double() for k, v in w64.items()}
    # the LSTM on them, float32 (the plain path's) and float64: lr_mult and the controls
    # per tensor (row 0: the bias), and the step-size head's cancellation
    w32 = {k: v.float() for k, v in w64.items()}
    o32 = lstm_step(torch, xg.float(), h.float(), c.float(), w32)
    o64 = lstm_step(torch, xg, h, c, w64)
    ctrl32, lr32, h32 = o32[0].double(), o32[1].double(), o32[2].double()
    ctrl64, lr64, h64 = o64[0], o64[1], o64[2]
    names = list(t.params)
    ws, bs = w64["lstm/step_size/w"][:, 0], w64["lstm/step_size/b"]
    wc, bc = w64["lstm/to_controls/w"], w64["lstm/to_controls/b"]
    out["lstm"] = {n: {
        "lr_mult": float((lr32[i] - lr64[i]).abs() / lr64[i].abs()),
        "controls": float((ctrl32[i] - ctrl64[i]).abs().max() / ctrl64[i].abs().max()),
        # how much a relative error of the hidden state is amplified in each head's
        # output (Σ|terms| / |result|; the controls' relative to their row's largest)
        "cancellation": float(((h64[i] * ws).abs().sum() + bs.abs().sum()) / lr64[i].abs()),
        "controls_cancellation": float(((h64[i][:, None] * wc).abs().sum(0) + bc.abs()).max()
                                       / ctrl64[i].abs().max()),
        # lr_mult in float64 from the float32 LSTM's hidden state: the head's dot alone
        # rounded exactly, the gate product's rounding kept
        "lr_mult_from_h32": float(((h32[i] @ ws + bs[0]) - lr64[i]).abs() / lr64[i].abs())}
        for i, n in enumerate(names)}
    return out


def test_velo_triton_exact_mode_runs_the_lstm_step_size_head_in_float64():
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = ("import json, sys; sys.path.insert(0, 'tests'); import test_parity_findings as f; "
            "print(json.dumps(f._velo_worker()))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(r)
    f64, f32, plain, lstm = r["f64"], r["f32"], r["plain"], r["lstm"]["bias"]
    # (the float32 figures depend on the machine's BLAS order; measured here: plain 8.0e-7
    # from the original and 1.3e-6 from float64, lr_mult 1.5e-6 from float64, 7.9e-7 of it
    # from the hidden state's rounding; the assertions hold what does not depend on it)
    # the Triton path (float64 LSTM) sits at the float64 result, 2.1e-6 from the original
    assert r["glue_lstm_dtype"] == "torch.float64", r
    assert f64["backend_to_exact"] < 3e-7 and f64["against_to_exact"] > 1.5e-6, r
    assert f64["rel"] > 1.5e-6 and f64["verdict"] == "closer_to_exact", r
    assert r["plain-golden"] < f64["rel"], r
    # from the same LSTM inputs (a first step: both paths' inputs are the same bits), its
    # distance to plain is plain's own distance to float64 ...
    assert r["inputs_equal"], r
    assert abs(f64["triton-plain"] - plain["backend_to_exact"]) < 3e-7, r
    # ... which is the float32 LSTM's: with the glue's LSTM in float32 (the plain path's
    # ops, the same bits) the Triton path tracks plain, as far from float64 as plain is
    assert f32["triton-plain"] < 2e-7, r
    assert abs(f32["backend_to_exact"] - plain["backend_to_exact"]) < 3e-7, r
    # the op: the step-size head lr_mult = hidden · w + b, which scales the tensor's whole
    # step, amplifies a relative error of the hidden state by Σ|hidden_i·w_i| / |lr_mult|,
    # over 50 here and over 10 times the controls' amplification (the MLP weights)
    assert lstm["cancellation"] > 50, lstm
    assert lstm["cancellation"] > 10 * lstm["controls_cancellation"], lstm


def test_velo_plain_closer_to_exact_than_the_original_is_reported_as_such():
    from xopt.parity.harness import run_parity
    from xopt.parity.report import table

    report = run_parity("velo", [VELO_N10000], backends=["torch"], modes=["teacher_forced"])
    (run,) = report.runs
    print(table(report))
    assert not run.agrees
    e0 = run.per_step[0]["param/bias"]
    assert e0.rel > 1e-6 and not e0.within(run.tolerance.for_tensor("param/bias"))
    # decided where the float64 oracle can tell: xopt nearer it than the original
    assert run.verdict == report.verdict == "closer_to_exact"
    assert run.backend_to_exact < run.against_to_exact
    # where xopt and the original are equally far from float64 (step 2), or the float64
    # step moves by as much under one rounding of its inputs (step 6), the run says so
    assert "6: param/bias" in run.undecided
    assert "closer to exact" in table(report)
