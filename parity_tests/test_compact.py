"""CompAct parity: the authors' golden traces (a linear layer, a two-block LLaMA), replayed
through xopt's torch and JAX layers and optimizers, teacher-forced and closed loop, and
torch against JAX with xopt's own generator.

Against golden, every runner uses the projections the authors drew with torch's generator
(the traces' ``aux/P``). Bounds (xopt.parity.methods.compact): one teacher-forced step
within 1e-6 relative, a closed loop within 1e-4. One named exception: the *gradients* of
the LLaMA case (its whole forward and backward) are within 3e-6, because the authors' own
float32 gradients are up to 1.5e-6 from float64 (test_llama_gradients_are_float32_noise
measures it every run); the optimizer's outputs (parameters, moments) stay at 1e-6.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import has_jax, has_torch

from xopt.parity import bundled_traces, load_trace
from xopt.parity.harness import run_parity

pytestmark = pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")

TRACES = bundled_traces("compact")
MODEL_GRADS = ("grad/model/", "grad/lm_head/", "compact_grad/model/")


def _worst(run, keep=lambda k: True):
    return max((e.rel for errs in run.per_step for k, e in errs.items() if keep(k)),
               default=0.0)


def _table(report):
    return "\n".join(f"{r.trace} {r.backend} vs {r.against} {r.mode}: rel "
                     f"{r.max_rel_error:.3g} at {r.worst[:2]}" for r in report.runs)


@pytest.fixture(scope="module")
def golden_report():
    return run_parity("compact", TRACES, backends=["torch", "jax", "oracle"])


def test_every_case_agrees_with_the_golden_traces(golden_report):
    print("\n" + _table(golden_report))
    assert golden_report.verdict == "agree", _table(golden_report)
    got = {(r.trace.split("/")[-1], r.backend, r.mode) for r in golden_report.runs}
    for t in TRACES:
        for b in ("xopt.torch", "xopt.jax"):
            for m in ("teacher_forced", "closed_loop"):
                assert (t.stem, b, m) in got
    assert ("linear_in32_out24_r0.25", "oracle", "teacher_forced") in got


def test_one_step_within_1e_6_and_closed_loop_within_1e_4(golden_report):
    for r in golden_report.runs:
        if r.mode == "teacher_forced":
            # Everything but the LLaMA model's gradients: the layer's outputs, the
            # compressed gradient of the single layer, parameters and Adam's moments.
            assert _worst(r, lambda k: not k.startswith(MODEL_GRADS)) <= 1e-6, r.worst
            assert _worst(r) <= 3e-6, r.worst
        else:
            assert r.max_rel_error <= 1e-4, r.worst
        # every tensor the trace records is compared, at every step
        assert all(len(errs) >= 11 for errs in r.per_step)


def test_llama_gradients_are_float32_noise():
    # The exception's measurement. The op: the LLaMA's backward (RMSNorm weight gradients
    # summed over tokens, the attention softmax backward dS = P∘(dP − ΣP∘dP) feeding the
    # q/k CompAct gradients) rounds in float32 at ~1e-6 of a tensor's largest element.
    # Evaluate the same model and step in float64 (the authors' recorded state and P) and
    # show (1) the authors' own float32 gradients are > 1e-6 from it, and (2) xopt's float32
    # gradients, on both backends, are no farther from it than the authors' are (x1.5).
    import torch

    from xopt.parity.compare import tensor_error
    from xopt.parity.layers.compact import CompActCase, _drive, _fixed_projection, _runner
    from xopt.parity.layers.llama import torch_llama
    from xopt.torch.compact import compact_model

    trace = load_trace([p for p in TRACES if p.stem.startswith("llama")][0])
    case = CompActCase(trace)
    steps = trace.steps
    ours = {b: _drive(_runner(b, case, "cpu"), case, "teacher_forced", steps, True)
            for b in ("torch", "jax")}
    model = torch_llama(case.config).double()
    conv = compact_model(model, rank=0.25, scale=0.25, scale_o_proj=0.5, gap=3)
    named = {n.replace(".", "/"): p for n, p in model.named_parameters()}
    layers = {f"{n.replace('.', '/')}/weight": m for n, m in conv.items()}
    worst = {"golden": 0.0, "torch": 0.0, "jax": 0.0}
    for t in range(steps):
        with torch.no_grad():
            for k, v in case.params(t - 1).items():
                named[k].copy_(torch.as_tensor(v, dtype=torch.float64))
        for k, lay in layers.items():
            lay.__dict__.pop("projection", None)
            if k in case.injected(t):
                lay.projection = _fixed_projection(
                    torch.as_tensor(case.injected(t)[k], dtype=torch.float64))
        model(torch.as_tensor(case.inputs(t)["x"])).backward()
        gold = case.golden(t)
        for k, p in named.items():
            key = f"compact_grad/{k}" if k in layers else f"grad/{k}"
            exact = (p.compact_grad if k in layers else p.grad).numpy()
            p.grad = p.compact_grad = None
            worst["golden"] = max(worst["golden"], tensor_error(gold[key], exact).rel)
            for b in ("torch", "jax"):
                worst[b] = max(worst[b], tensor_error(ours[b][t][key], exact).rel)
    print(f"\nlargest relative distance of float32 gradients from float64: {worst}")
    assert worst["golden"] > 1e-6
    assert worst["golden"] < 1.5e-6 * 1.05  # the measurement quoted in the spec
    for b in ("torch", "jax"):
        assert worst[b] <= 1.5 * worst["golden"], (b, worst)


def test_torch_against_jax_with_xopts_own_projections():
    # No injection: both backends draw P from xopt.random (the same bits), through a
    # projection refresh (gap 3: steps 0-2 and 3).
    report = run_parity("compact", TRACES, backends=["torch"], against="jax", max_steps=4)
    print("\n" + _table(report))
    assert report.verdict == "agree", _table(report)
    assert len(report.runs) == 2 * len(TRACES)
    for r in report.runs:
        assert r.against == "xopt.jax"
        if r.mode == "teacher_forced":
            assert _worst(r, lambda k: not k.startswith(MODEL_GRADS)) <= 1e-6, r.worst
        else:
            assert r.max_rel_error <= 1e-4


def test_harness_detects_a_wrong_projection_and_a_corrupted_output(tmp_path):
    # The comparison must be able to fail: (1) perturb one recorded P entry by 1e-3 (the
    # runners inject it, the recorded outputs were made with the original): z and the
    # compressed gradient of that step diverge; (2) move one parameter after step 4 by 1e-4.
    from xopt.parity import write_trace

    (path,) = [p for p in TRACES if p.stem.startswith("linear")]
    t = load_trace(path)
    clean = {k: t.array(k).copy() for k in t.keys()}
    manifest = json.loads(json.dumps(t.manifest))

    def run_on(arrays):
        out = write_trace(tmp_path / "case.json", manifest, arrays)
        return run_parity("compact", [out], backends=["torch"], modes=["teacher_forced"])

    bad_p = {k: v.copy() for k, v in clean.items()}
    bad_p["step_0002/aux/P"][3, 1] += 1e-3
    (run,) = run_on(bad_p).runs
    assert not run.agrees
    assert run.per_step[2]["z"].rel > 1e-5 and run.per_step[1]["z"].rel < 1e-6
    bad = {k: v.copy() for k, v in clean.items()}
    w = bad["step_0004/param/weight"]
    idx = np.unravel_index(np.abs(w).argmax(), w.shape)
    w[idx] *= 1 + 1e-4
    (run,) = run_on(bad).runs
    # the corrupted values are step 4's output and step 5's teacher-forced input
    assert not run.agrees and run.worst[1] == "param/weight" and run.worst[0] in (4, 5)
    assert run.per_step[4]["param/weight"].rel > 1e-5 and run.per_step[3]["param/weight"].rel < 1e-6


def _record_linear_without_bias(path, *, n_in=16, n_out=12, steps=5, gap=2):
    """A layer trace of a bias-free CompAct linear (LLaMA's case), recorded from xopt's own
    torch layer and optimizer in the authors' layout: per step the input and ∂L/∂y, the
    output, ∂L/∂x, the P used (``aux/P``), the compressed gradient and activation, then the
    parameters and Adam's state after the update."""
    import torch

    from xopt.parity import write_trace
    from xopt.specs import compact as S
    from xopt.torch.compact import CompActAdamW, CompActLinear

    hp = S.CompAct(lr=1e-2, rank=0.25, scale=0.25, gap=gap, weight_decay=0.1)
    layer = CompActLinear(n_in, n_out, bias=False, rank=hp.rank, proj_type="gaussian",
                          scale=hp.scale, seed=S.layer_seed(hp.seed, 0), gap=gap)
    opt = CompActAdamW([layer.weight], spec=hp)
    rng = np.random.default_rng(7)
    arrays = {"init/param/weight": layer.weight.detach().numpy().copy()}
    for t in range(steps):
        pre = f"step_{t:04d}"
        x = torch.as_tensor(rng.standard_normal((2, 3, n_in), np.float32), dtype=torch.float32)
        go = torch.as_tensor(rng.standard_normal((2, 3, n_out), np.float32))
        p = layer.projection().detach()
        x.requires_grad_(True)
        y = layer(x)
        y.backward(go)
        arrays.update({f"{pre}/x": x.detach().numpy(), f"{pre}/grad_output": go.numpy(),
                       f"{pre}/y": y.detach().numpy(), f"{pre}/grad_input": x.grad.numpy(),
                       f"{pre}/aux/P": p.numpy(),
                       f"{pre}/aux/small_grad": layer.weight.compact_grad.numpy().copy(),
                       f"{pre}/aux/xP": (x.detach() @ p).numpy()})
        opt.step()
        opt.zero_grad()
        st = opt.state[layer.weight]
        arrays.update({f"{pre}/param/weight": layer.weight.detach().numpy().copy(),
                       f"{pre}/state/weight/exp_avg": st["exp_avg"].numpy().copy(),
                       f"{pre}/state/weight/exp_avg_sq": st["exp_avg_sq"].numpy().copy(),
                       f"{pre}/state/weight/step": np.int64(int(st["step"]))})
    manifest = {
        "format": "xopt-trace/1", "method": "compact", "case": path.stem, "kind": "layer",
        "source": {"repo": "xopt", "object": "xopt.torch.CompActLinear (bias=False) + "
                   "CompActAdamW, recorded by parity_tests/test_compact.py"},
        "hyperparameters": {
            "SmallLinear.like": {"single_gpu": True},
            "nn.Linear": {"in_features": n_in, "out_features": n_out, "bias": False},
            "Projector": {"rank": hp.rank, "proj_type": "gaussian", "scale": hp.scale,
                          "gap": gap},
            "Projector.seed_initial": 0,
            "SmallAdamW": {"lr": hp.lr, "betas": [hp.b1, hp.b2], "eps": hp.eps,
                           "weight_decay": hp.weight_decay, "correct_bias": True}},
        "dtype": "float32", "params": {"weight": [n_out, n_in]}, "steps": steps,
    }
    return write_trace(path, manifest, arrays)


def test_a_linear_layer_without_bias_replays(tmp_path):
    # issue 29, finding 4: the driver assumed a bias ("parameters ['bias'] do not match the
    # torch model's"); LLaMA's linear layers have none, and the authors' code records them.
    path = _record_linear_without_bias(tmp_path / "linear_in16_out12_nobias.json")
    report = run_parity("compact", [path], backends=["torch", "jax", "oracle"])
    print("\n" + _table(report))
    assert report.verdict == "agree", _table(report)
    assert {(r.backend, r.mode) for r in report.runs} == {
        (b, m) for b in ("xopt.torch", "xopt.jax", "oracle")
        for m in ("teacher_forced", "closed_loop")}
    for r in report.runs:
        keys = set(r.per_step[0])
        assert {"y", "grad_input", "z", "compact_grad/weight", "param/weight",
                "state/m/weight", "state/v/weight"} == keys
        if r.backend == "xopt.torch":  # the recorder's own arithmetic, op for op
            assert r.max_abs_error == 0.0, r.worst
    # torch against jax with xopt's own draws, through a refresh (gap 2)
    report = run_parity("compact", [path], backends=["torch"], against="jax")
    assert report.verdict == "agree", _table(report)
