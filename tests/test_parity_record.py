"""`xopt.parity.record` / `xopt record`: traces of any torch.optim optimizer or optax
transformation, in the golden-trace layout, on bundled problems, the user's own model or
loss, or a gradient sequence."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, needs_jax, needs_torch

from xopt.parity import gradient_sequence, load_trace, record
from xopt.parity.recorder import PROBLEMS, RecordError, parse_call, problem


def test_bundled_problems_give_the_analytic_gradient():
    # central differences of the float64 loss against the float32 analytic gradient
    for name in PROBLEMS:
        prob = problem(name, seed=3)
        p = {k: v.astype(np.float64) for k, v in prob.init_params().items()}
        _, g = prob.loss_and_grads(p, 5)
        for k, v in p.items():
            i = np.unravel_index(np.argmax(np.abs(g[k])), v.shape)
            h = 1e-3
            hi = {**p, k: v.copy()}
            hi[k][i] += h
            lo = {**p, k: v.copy()}
            lo[k][i] -= h
            fd = (prob.loss_and_grads(hi, 5)[0] - prob.loss_and_grads(lo, 5)[0]) / (2 * h)
            # the losses are rounded to float32: the quotient carries ~3e-5 of that
            assert abs(fd - g[k][i]) <= 1e-3 * abs(g[k][i]) + 1e-4, (name, k)


@needs_torch
def test_torch_trace_loads_and_names_state_as_torch_does(tmp_path):
    rec = record("torch.optim.Adam(lr=0.01, betas=(0.8, 0.99))", "mlp", steps=3, seed=1,
                 path=tmp_path / "adam.json")
    t = load_trace(tmp_path / "adam.json")  # the format's own validation
    assert t.steps == 3 and list(t.params) == list(problem("mlp", 1).init_params())
    m = t.manifest
    assert m["source"]["object"] == "torch.optim.Adam" and m["source"]["framework"] == "torch"
    assert m["source"]["call"] == "torch.optim.Adam(lr=0.01, betas=(0.8, 0.99))"
    assert m["hyperparameters"] == {"lr": 0.01, "betas": [0.8, 0.99]}
    assert {"python", "numpy", "torch", "xopt"} <= set(m["source"]["versions"])
    assert m["source"]["device"].startswith("cpu (")
    assert set(t.state_after(2)) == {f"{p}/{v}" for p in t.params
                                     for v in ("step", "exp_avg", "exp_avg_sq")}
    assert float(t.state_after(2)["mlp/0/weight/step"]) == 3.0
    # the recorded parameters are what torch.optim.Adam does on the recorded gradients
    import torch

    ps = [torch.tensor(t.init_params()[k]) for k in t.params]
    opt = torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99))
    for s in range(3):
        for p, k in zip(ps, t.params, strict=True):
            p.grad = torch.tensor(t.grads(s)[k])
        opt.step()
    for p, k in zip(ps, t.params, strict=True):
        assert np.array_equal(p.numpy(), t.params_after(2)[k])
    assert rec.params_after(2).keys() == t.params_after(2).keys()


@needs_jax
def test_optax_trace_records_init_state_and_pytree_paths(tmp_path):
    import optax

    rec = record(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.01)), "linear",
                 steps=2, path=tmp_path / "o.json")
    t = load_trace(tmp_path / "o.json")
    assert t.manifest["source"]["framework"] == "optax"
    assert "call" not in t.manifest["source"]  # a live object: nothing to rebuild it from
    assert set(t.init_state()) == {"1/0/count", "1/0/mu/weight", "1/0/mu/bias",
                                   "1/0/nu/weight", "1/0/nu/bias"}
    assert int(t.state_after(1)["1/0/count"]) == 2
    assert rec.steps == 2


@needs_torch
def test_lbfgs_history_and_python_scalars_round_trip(tmp_path):
    # LBFGS keeps Python ints/floats and lists of tensors: the manifest says which, and a
    # trace-fed optimizer continues exactly as the recorded one
    from xopt.parity.recorder import Recording

    call = "torch.optim.LBFGS(lr=0.5, max_iter=1, history_size=3)"
    rec = record(call, "linear", steps=6, path=tmp_path / "l.json")
    types = rec.manifest["state_types"]
    assert types["old_dirs"] == "list" and types["n_iter"] == "int"
    again = Recording.from_trace(tmp_path / "l.json").implementation()
    again.start(rec.params_after(3))
    again.set_state(rec.state_after(3))
    again.step(rec.grads(4), rec.loss(4))
    params, state = again.read()
    for k in rec.params:
        assert np.array_equal(params[k], rec.params_after(4)[k]), k
    assert state.keys() == rec.state_after(4).keys()


@needs_torch
def test_a_closure_called_twice_is_refused():
    with pytest.raises(RecordError, match="evaluated the closure twice"):
        record("torch.optim.LBFGS(lr=0.5, max_iter=3)", "linear", steps=2)


@needs_torch
def test_users_torch_model_drives_an_optax_transformation():
    import optax
    import torch

    from xopt.parity import torch_problem

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    data = [(torch.randn(8, 3), torch.randn(8, 1)) for _ in range(2)]
    prob = torch_problem(model, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), data)
    rec = record(optax.sgd(0.1), prob, steps=3)
    assert list(rec.params) == ["0/weight", "0/bias", "2/weight", "2/bias"]
    # each gradient is autograd's at the parameters the optimizer produced
    with torch.no_grad():
        for (k, p) in zip(rec.params, model.parameters(), strict=True):
            p.copy_(torch.tensor(rec.params_after(1)[k]))
    model.zero_grad()
    torch.nn.functional.mse_loss(model(data[0][0]), data[0][1]).backward()
    assert np.array_equal(model[0].weight.grad.numpy(), rec.grads(2)["0/weight"])
    for k in rec.params:  # and the step is plain SGD
        np.testing.assert_allclose(rec.params_after(2)[k],
                                   rec.params_after(1)[k] - 0.1 * rec.grads(2)[k], rtol=1e-6)


@needs_jax
def test_users_jax_loss_drives_a_torch_optimizer():
    pytest.importorskip("torch")
    import jax.numpy as jnp

    from xopt.parity import jax_problem

    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(2)}
    xs = [jnp.arange(3.0) + i for i in range(2)]
    prob = jax_problem(params, lambda p, x: jnp.sum((p["w"] @ x + p["b"]) ** 2), xs)
    rec = record("torch.optim.SGD(lr=0.01)", prob, steps=2)
    assert set(rec.params) == {"w", "b"}
    w, b = rec.params_after(0)["w"], rec.params_after(0)["b"]
    r = w @ np.asarray(xs[1]) + b
    np.testing.assert_allclose(rec.grads(1)["b"], 2 * r, rtol=1e-6)


@needs_torch
def test_gradient_sequence_is_replayed_as_given():
    g = [{"w": np.full((2,), float(t), np.float32)} for t in range(3)]
    rec = record("torch.optim.SGD(lr=0.5)", gradient_sequence({"w": np.ones(2, np.float32)}, g),
                 steps=3)
    assert np.array_equal(rec.params_after(2)["w"], np.float32([-0.5, -0.5]))
    with pytest.raises(RecordError, match="gradient 0 of 'w' has shape"):
        gradient_sequence({"w": np.ones(2)}, [{"w": np.ones(3)}])


@pytest.mark.parametrize("text,pattern", [
    ("torch.optim.Adam(lr=", "not a call"),
    ("torch.optim.Adam(lr=x)", "arguments must be literals"),
    ("nosuchpkg.opt(1)", "no importable module"),
    ("numpy.linalg.nosuch(1)", "has no attribute 'nosuch'"),
    ("numpy.float32(1)", "neither an optax transformation nor a torch optimizer factory"),
])
def test_bad_calls_name_what_is_wrong(text, pattern):
    with pytest.raises(RecordError, match=pattern):
        parse_call(text)


def test_unknown_problem_lists_the_bundled_ones():
    with pytest.raises(RecordError, match="unknown problem 'nope'; bundled: mlp, mlp-nobias"):
        problem("nope")


@needs_torch
def test_cli_record_writes_a_loadable_trace(tmp_path, capsys):
    out = subprocess.run([sys.executable, "-m", "xopt", "record",
                          "torch.optim.SGD(lr=0.1, momentum=0.9)", "--problem", "linear",
                          "--steps", "4", "--seed", "2", "--out", str(tmp_path / "s.json")],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    t = load_trace(tmp_path / "s.json")
    assert t.steps == 4 and t.case == "linear_seed2"
    assert json.loads((tmp_path / "s.json").read_text())["source"]["call"].startswith(
        "torch.optim.SGD(")
    from xopt.cli import main

    assert main(["record", "torch.optim.Nope()", "--out", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()
    assert "has no attribute 'Nope'" in capsys.readouterr().err
