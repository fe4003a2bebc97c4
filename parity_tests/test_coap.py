"""COAP parity: every bundled trace of the authors' CoapAdamW (with and without moment
restoration) and CoapAdafactor (rank 4, Eqn 6 every 3 updates, Eqn 7 every 6; biases in an
unprojected group, as setup_params splits them), every backend, teacher-forced and closed
loop.

At the updates that decompose (events 1 and 3: the first update and every Eqn-7 one) the
original's P is injected (``xopt.specs.coap``'s ``inject``): event 1 draws Ω from torch's
generator, and QR/SVD sign conventions differ between libraries while the moments are kept
across events, so signs matter downstream. Everything else, Eqn 6 included, is computed by
xopt. Below: that the injection is needed only for those reasons (xopt's own Eqn 7 finds
the original's subspace and singular values; with the recorded Ω, event 1 does too), and
that a missing Eqn 6 would be caught.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from helpers import explain_disagreements, has_jax, has_torch

from xopt.parity import bundled_traces, load_trace
from xopt.parity.harness import run_parity
from xopt.parity.methods import coap as CP
from xopt.specs import coap as C
from xopt.specs import hp_for

pytestmark = pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")

# the matrix cases; the convolution cases (conv_*) are checked on their own below
TRACES = [p for p in bundled_traces("coap") if not p.stem.startswith("conv_")]
PROJECTED = ["mlp/0/weight", "mlp/1/weight", "tall/weight", "wide/weight"]




def _hp(trace):
    return CP.PARITY.original("coap_torch.CoapAdamW").from_kwargs(dict(trace.hyperparameters))


@pytest.fixture(scope="module")
def golden_report():
    return run_parity("coap", TRACES, backends=["torch", "jax", "oracle"])


def test_every_variant_is_covered():
    cases = {(load_trace(p).hyperparameters["optimizer_class"],
              load_trace(p).hyperparameters["constructor"]["restore_state"]) for p in TRACES}
    assert cases == {("CoapAdamW", False), ("CoapAdamW", True), ("CoapAdafactor", False)}


def test_all_backends_agree_with_the_golden_traces(golden_report):
    assert golden_report.verdict == "agree", explain_disagreements(golden_report)
    runs = golden_report.runs
    assert len(runs) == len(TRACES) * 3 * 2
    for r in runs:
        bound = 1e-6 if r.mode == "teacher_forced" else 1e-4  # the bounds
        assert r.tolerance.rel == bound
        assert r.max_rel_error <= bound, (r.trace, r.backend, r.mode, r.worst[:2])
        print(f"{r.trace:30s} {r.backend:10s} {r.mode:15s} max rel {r.max_rel_error:.3g}")


def test_torch_against_jax_one_step_within_1e_6():
    report = run_parity("coap", [p for p in TRACES if "adafactor" in p.stem],
                        backends=["torch"], against="jax", modes=["teacher_forced"])
    (r,) = report.runs
    assert r.max_rel_error <= 1e-6, (r.trace, r.worst)


def _projector(p, side):
    return p.T @ p if side == "right" else p @ p.T


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_own_decomposition_finds_the_originals_subspace(path):
    # Teacher-forced, float64: at every Eqn-7 event, xopt's QR + SVD warm-started from the
    # recorded P finds the recorded subspace (the projector PᵀP / PPᵀ) and singular values
    # to float32 rounding, and P itself up to the sign of each row. At event 1 the same
    # holds with the recorded torch.randn Ω; xopt's own Ω (xopt.random) spans another
    # subspace (a rank-r range finder without oversampling depends on Ω).
    trace = load_trace(path)
    hp = _hp(trace)
    checked = {C.INITIAL: 0, C.EQN7: 0}
    for t in range(trace.steps):
        aux = trace.aux(t)
        for name in PROJECTED:
            ev = int(aux[f"{name}/proj_event"])
            if ev not in checked:
                continue
            g = trace.grads(t)[name].astype(np.float64)
            side = C.side_of(g.shape)
            want = trace.state_after(t)[f"{name}/projector/ortho_matrix"].astype(np.float64)
            omega = aux[f"{name}/omega"].astype(np.float64)
            if ev == C.EQN7:
                before = trace.state_after(t - 1)[f"{name}/projector/ortho_matrix"]
                np.testing.assert_array_equal(omega, C.warm_omega(before, side))
            got = C.decompose(np, g, omega, side)
            np.testing.assert_allclose(_projector(got, side), _projector(want, side),
                                       atol=2e-6)
            rows = got if side == "right" else got.T
            ref = want if side == "right" else want.T
            signs = np.sign(np.sum(rows * ref, axis=1))
            np.testing.assert_allclose(rows * signs[:, None], ref, atol=2e-6)
            a = g if side == "right" else g.T
            q, _ = np.linalg.qr(a @ omega)
            s = np.linalg.svd(q.T @ a, compute_uv=False)
            np.testing.assert_allclose(s, aux[f"{name}/svd_S"], rtol=2e-6)
            if ev == C.INITIAL:
                h = hp.hp_of(name)
                own = C.decompose(np, g, C.initial_omega(h, g.shape).astype(np.float64), side)
                assert np.abs(_projector(own, side) - _projector(want, side)).max() > 1e-3
            checked[ev] += 1
    assert checked[C.INITIAL] == 4 and checked[C.EQN7] >= 4


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_a_missing_eqn6_step_is_detected(path):
    # The oracle, teacher-forced at each Eqn-6 event: with Eqn 6 it reproduces P within the
    # 1e-6 bound; with the step switched off (proj_lr = 0) P misses by more than 10x that
    # (source.notes: the step moves P by 2e-5..6e-4 in Frobenius norm).
    trace = load_trace(path)
    hp = _hp(trace)
    off = type(hp).of([(names, h.replace(proj_lr=0.0)) for names, h in hp.groups])
    events = 0
    for t in range(1, trace.steps):
        if not any(C.event(t, hp.hp_of(n)) == C.EQN6 for n in PROJECTED):
            continue
        params = {k: v.astype(np.float64) for k, v in trace.params_after(t - 1).items()}
        state = C.SPEC.state.to_canonical(CP.AUTHORS_NAMING, trace.state_after(t - 1),
                                          list(trace.params), hp)
        state = {k: np.asarray(v, dtype=np.float64) if k != "step" else v
                 for k, v in state.items()}
        grads = {k: v.astype(np.float64) for k, v in trace.grads(t).items()}
        recorded = trace.state_after(t)
        for h, ok in ((hp, True), (off, False)):
            _, new = C.step(h, params, state, grads)
            for n in PROJECTED:
                want = recorded[f"{n}/projector/ortho_matrix"]
                err = np.abs(new[f"P/{n}"] - want).max() / np.abs(want).max()
                assert (err <= 1e-6) if ok else (err > 1e-5), (t, n, ok, err)
        events += 1
    assert events >= 2


CONV_TRACES = [p for p in bundled_traces("coap") if p.stem.startswith("conv_")]


@pytest.fixture(scope="module")
def conv_report():
    return run_parity("coap", CONV_TRACES, backends=["torch", "jax", "oracle"])


def test_conv_traces_cover_tucker2_and_tucker1():
    trace = load_trace(CONV_TRACES[0])
    hp = CP.from_kwargs(dict(trace.hyperparameters))
    shapes = {n: tuple(s) for n, s in trace.params.items()}
    conv0, conv1 = hp_for(hp, "conv0/weight"), hp_for(hp, "conv1/weight")
    assert C.is_tucker(shapes["conv0/weight"], conv0)
    assert C.tucker_ranks(shapes["conv0/weight"], conv0) == (32, 16)
    assert C.tucker_ranks(shapes["conv1/weight"], conv1) == (40,)
    assert C.is_projected(shapes["fc/weight"], hp_for(hp, "fc/weight"))
    events = {C.event(t, conv0) for t in range(trace.steps)}  # the authors' schedule
    assert events == {C.KEEP, C.INITIAL, C.EQN6, C.EQN7}


def test_conv_traces_agree(conv_report):
    """TuckerCOAP's factors injected at the decompositions (events 1, 3); Eqn 6 for the
    kernels, the restoration of the moments and the AdamW arithmetic computed by xopt, on
    every backend, within the issue's bounds."""
    assert conv_report.verdict == "agree", explain_disagreements(conv_report)
    assert len(conv_report.runs) == len(CONV_TRACES) * 3 * 2
    for r in conv_report.runs:
        bound = 1e-6 if r.mode == "teacher_forced" else 1e-4
        assert r.max_rel_error <= bound, (r.trace, r.backend, r.mode, r.worst[:2])


def test_the_carried_factor_gradient_is_tuckercoaps():
    """At the second Eqn-6 update after a decomposition (update 6 of the rf3 trace) the
    authors' factors step on their new gradient plus the previous clipped one (they keep
    .grad): the oracle, teacher-forced, reproduces the recorded gradient and factors with
    carry_factor_grad (default), and misses both without it."""
    trace = load_trace(next(p for p in CONV_TRACES if p.stem.endswith("_rf3")))
    hp = CP.from_kwargs(dict(trace.hyperparameters))
    off = type(hp).of([(names, h.replace(carry_factor_grad=False))
                       for names, h in hp.groups])
    t, name = 6, "conv0/weight"
    assert C.event(t, hp_for(hp, name)) == C.EQN6 == C.event(3, hp_for(hp, name))
    params = {k: v.astype(np.float64) for k, v in trace.params_after(t - 1).items()}
    state = C.SPEC.state.to_canonical(CP.AUTHORS_NAMING, trace.state_after(t - 1),
                                      list(trace.params), hp)
    assert np.abs(state[f"P_grad/{name}"]).max() > 0        # carried from update 3
    state = {k: np.asarray(v, dtype=np.float64) if k != "step" else v
             for k, v in state.items()}
    grads = {k: v.astype(np.float64) for k, v in trace.grads(t).items()}
    recorded = trace.state_after(t)
    want_grad = recorded[f"{name}/projector/ortho_matrix_grad"]
    want_p = recorded[f"{name}/projector/ortho_matrix"]
    for h, ok in ((hp, True), (off, False)):
        aux = {}
        _, new = C.step(h, params, state, grads, aux=aux)
        got = aux[f"{name}/eqn6_P_grad_clipped"]   # the gradient the factor stepped on
        err = np.abs(got - want_grad).max() / np.abs(want_grad).max()
        assert (err <= 1e-6) if ok else (err > 1e-2), (ok, err)
        if ok:
            np.testing.assert_array_equal(new[f"P_grad/{name}"], got)
            assert np.abs(new[f"P/{name}"] - want_p).max() / np.abs(want_p).max() <= 1e-6


# -- 8-bit (CoapAdamW8bit), recorded with bitsandbytes' CPU kernel -------------------------------

EIGHT_BIT_CPU = (Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "parity" / "coap"
                 / "conv_8bit_cpu_r4_cnn4_tu3_rf2_restore.json")


def test_code_book_is_bitsandbytes():
    """The spec builds bitsandbytes' dynamic code book itself; the recording hashed the
    one bitsandbytes used."""
    manifest = load_trace(EIGHT_BIT_CPU).manifest["source"]
    got = hashlib.sha256(C.dynamic_code().astype(np.float32).tobytes()).hexdigest()
    assert got == manifest["quant_code_sha256"]


def test_eight_bit_cpu_trace_is_byte_exact():
    """Every backend reproduces the authors' 8-bit run: the uint8 codes equal (a one-code
    difference is a relative error of at least 1/255, far beyond 1e-6), the absmax scales
    and the parameters within the issue's bounds, teacher-forced and closed loop. The
    trace names bitsandbytes' CPU kernel, which the harness hands to quant_rounding."""
    hp = CP.from_kwargs(dict(load_trace(EIGHT_BIT_CPU).hyperparameters))
    assert hp_for(hp, "conv0/weight").state_bits == 8
    assert hp_for(hp, "conv0/weight").quant_rounding == "cpu"
    report = run_parity("coap", [EIGHT_BIT_CPU], backends=["torch", "jax", "oracle"])
    assert report.verdict == "agree", explain_disagreements(report)
    for r in report.runs:
        bound = 1e-6 if r.mode == "teacher_forced" else 1e-4
        assert r.max_rel_error <= bound, (r.backend, r.mode, r.worst[:2])


# -- 8-bit, recorded with bitsandbytes' CUDA kernel on an H200 (tools/gpu_record_coap8.sh) ------

EIGHT_BIT_CUDA = EIGHT_BIT_CPU.with_name("conv_8bit_cuda_r4_cnn4_tu3_rf2_restore.json")


def _restore_event_steps(trace, hp) -> set[int]:
    """Updates at which an 8-bit kernel's moments are restored and re-quantised."""
    h = hp_for(hp, "conv0/weight")
    return {t for t in range(trace.steps)
            if C.event(t, h) in (C.EQN6, C.EQN7) and h.restore_state}


def test_eight_bit_cuda_trace_codes_are_byte_exact_and_steps_agree_off_the_restore():
    """The authors' 8-bit run on the GPU kernel: every backend's codes equal the recorded
    bytes at every update, and every parameter and scale agrees within the issue's bounds,
    closed loop at every step and teacher-forced at every step but a restore event, where
    a float32 backend may land one code away in the re-quantised carried moments (the next
    test says why)."""
    trace = load_trace(EIGHT_BIT_CUDA)
    hp = CP.from_kwargs(dict(trace.hyperparameters))
    assert hp_for(hp, "conv0/weight").quant_rounding == "cuda"
    restore = _restore_event_steps(trace, hp)
    assert 6 in restore
    report = run_parity("coap", [EIGHT_BIT_CUDA], backends=["torch", "jax", "oracle"])
    for r in report.runs:
        for t, errs in enumerate(r.per_step):
            for k, e in errs.items():
                if "_q/" in k:
                    assert e.abs == 0, (r.backend, r.mode, t, k)
                elif r.mode == "closed_loop" or t not in restore or "/bias" in k:
                    bound = 1e-6 if r.mode == "teacher_forced" else 1e-4
                    assert e.rel <= bound, (r.backend, r.mode, t, k, e.rel)
    torch_and_oracle = [r for r in report.runs if r.backend != "xopt.jax"]
    assert all(r.agrees for r in torch_and_oracle), explain_disagreements(report)


def test_eight_bit_restore_requantisation_tie_is_within_float32_rounding():
    """Why a float32 backend may leave 1e-6 at an 8-bit restore event. The authors store
    the carried moments quantised and read them back before the Adam update; the carried
    ``M`` is a chain of Tucker products whose float32 rounding depends on the summation
    order (torch, NumPy and XLA differ by tens of ulps of an entry), and an entry that lies
    that close to a midpoint of the code book gets the neighbouring code in one order and
    not in another: one code step of M, 1e-5 of the kernel after the update. At update 6 of
    this trace the float64 carried moments have entries within float32 rounding of a
    midpoint, and every entry where two float32 orders pick different codes is such an
    entry. The stored codes after the update agree again (the previous test)."""
    torch = pytest.importorskip("torch")
    trace = load_trace(EIGHT_BIT_CUDA)
    spec_hp = CP.from_kwargs(dict(trace.hyperparameters))
    h = hp_for(spec_hp, "conv0/weight")
    from xopt.parity import harness as H

    spec, par = H.get("coap"), H.get_parity("coap")
    origin = H.original_of(spec, trace)
    state = H.trace_state(trace, spec, spec_hp, origin.naming_for(spec_hp), 5)
    st = {v: state[f"{v}/conv0/weight"] for v in C.VARS if f"{v}/conv0/weight" in state}
    shape = trace.grads(6)["conv0/weight"].shape
    side = C.side_of(shape)
    p_old = C.projection_of(st, shape)
    p_new = C.injected_projection(par.inject(trace, 6, spec_hp)["conv0/weight"], side)
    m, v = C.moments_of(np, h, st)

    def carried(xp, conv):
        out = C.restore_moments(xp, h, conv(m), conv(v), tuple(map(conv, p_old)),
                                tuple(map(conv, p_new)), side)
        return [np.asarray(x, np.float64).reshape(-1) for x in out]

    exact = carried(np, lambda a: np.asarray(a, np.float64))
    orders = {"numpy": carried(np, lambda a: np.asarray(a, np.float32)),
              "torch": carried(torch, lambda a: torch.from_numpy(np.asarray(a, np.float32)))}
    if has_jax:
        import jax
        import jax.numpy as jnp

        fn = jax.jit(lambda a, b, *ps: C.restore_moments(jnp, h, a, b, ps[:len(p_old)],
                                                         ps[len(p_old):], side))
        orders["jax"] = [np.asarray(x, np.float64).reshape(-1) for x in fn(
            *(jnp.asarray(x, jnp.float32) for x in (m, v, *p_old, *p_new)))]
    code = C.dynamic_code().astype(np.float64)
    mids = 0.5 * (code[:-1] + code[1:])
    ties = 0
    for i in range(2):
        n = exact[i].size
        padded = np.concatenate([exact[i], np.zeros(-n % C.QUANT_BLOCK)])
        blocks = np.abs(padded).reshape(-1, C.QUANT_BLOCK).max(1)
        absmax = np.repeat(blocks, C.QUANT_BLOCK)[:n]  # each entry's block scale
        # float32 rounding of the carried moment, measured: the orders' largest deviation
        # from float64 relative to the entry's block scale (a few ulps of it)
        rounding = max((np.abs(o[i] - exact[i]) / absmax).max() for o in orders.values())
        assert rounding <= 32 * np.finfo(np.float32).eps  # tens of ulps of the scale
        dist = np.abs(exact[i][:, None] / absmax[:, None] - mids[None, :]).min(1)
        near = dist <= rounding
        ties += int(near.sum())
        codes = {k: C.quantize(np, o[i].astype(np.float32))[0] for k, o in orders.items()}
        names = sorted(codes)
        for a in names:
            for b in names:
                differ = codes[a] != codes[b]
                assert near[differ].all(), (i, a, b, np.nonzero(differ & ~near))
    assert ties >= 1
