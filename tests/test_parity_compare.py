"""`xopt.parity.compare` / `xopt compare`: any two implementations, or one against a trace:
state matching across libraries, teacher forcing, the report, the CLI, and the usage
page's example (docs/parity/record-compare.md) run as written."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, has_jax, has_torch

from xopt.parity import compare, gradient_sequence, record
from xopt.parity.anyopt import StateMatchError, match_state

pytestmark = pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")


def test_torch_and_optax_state_names_are_matched():
    names = ["mlp/0/weight", "b"]
    a = {f"{p}/{v}": np.zeros(s) for p, s in (("mlp/0/weight", (3, 2)), ("b", (3,)))
         for v in ("exp_avg", "exp_avg_sq")}
    a.update({f"{p}/step": np.float32(2) for p in names})
    b = {"0/count": np.int32(2), "1/count": np.int32(2)}
    b.update({f"0/{v}/{p}": np.zeros(s) for p, s in (("mlp/0/weight", (3, 2)), ("b", (3,)))
              for v in ("mu", "nu")})
    m = match_state(a, "torch", b, "optax", set(), names)
    assert m.sources == {"0/count": "mlp/0/weight/step", "1/count": "mlp/0/weight/step",
                         "0/mu/mlp/0/weight": "mlp/0/weight/exp_avg",
                         "0/mu/b": "b/exp_avg", "0/nu/mlp/0/weight": "mlp/0/weight/exp_avg_sq",
                         "0/nu/b": "b/exp_avg_sq"}
    assert m.unmatched == [] and m.unused == []
    # the other way round: every torch tensor's step is fed the one optax count
    back = match_state(b, "optax", a, "torch", set(), names)
    assert back.sources["b/step"] == back.sources["mlp/0/weight/step"] == "0/count"
    assert back.sources["b/exp_avg_sq"] == "0/nu/b"


def test_centered_rmsprop_with_momentum_claims_each_name_once():
    a = {"w/square_avg": np.zeros(2), "w/grad_avg": np.zeros(2),
         "w/momentum_buffer": np.zeros(2), "w/step": np.float32(1)}
    b = {"0/mu/w": np.zeros(2), "0/nu/w": np.zeros(2), "2/trace/w": np.zeros(2)}
    m = match_state(a, "torch", b, "optax", set(), ["w"])
    assert m.sources == {"0/mu/w": "w/grad_avg", "0/nu/w": "w/square_avg",
                         "2/trace/w": "w/momentum_buffer"}


def test_unmatched_state_is_listed_and_a_mapping_resolves_it():
    # torch.optim.NAdam as B keeps mu_product, which optax's nadam has no counterpart for
    a = {"0/count": np.int32(1), "0/mu/w": np.zeros(2), "0/nu/w": np.zeros(2)}
    b = {"w/step": np.float32(1), "w/exp_avg": np.zeros(2), "w/exp_avg_sq": np.zeros(2),
         "w/mu_product": np.float32(0.9)}
    m = match_state(a, "optax", b, "torch", set(), ["w"])
    assert m.unmatched == ["w/mu_product"]
    fixed = match_state(a, "optax", b, "torch", set(), ["w"],
                        {"mu_product": lambda state, param: np.float32(0.45)})
    assert fixed.unmatched == [] and fixed.feed(a, 1)["w/mu_product"] == np.float32(0.45)
    with pytest.raises(StateMatchError, match="A has no state 'nope' for parameter 'w'"):
        match_state(a, "optax", b, "torch", set(), ["w"], {"mu_product": "nope"})


def test_teacher_forcing_needs_every_changing_state_of_b():
    with pytest.raises(StateMatchError) as e:
        compare("optax.nadam(learning_rate=0.01)", "torch.optim.NAdam(lr=0.01)", steps=3)
    msg = str(e.value)
    for key in ("mlp/0/weight/mu_product", "mlp/1/bias/mu_product"):
        assert key in msg
    assert "0/mu/mlp/0/weight" in msg and "mapping=" in msg
    # closed loop runs without it, and says what it could not compare
    report = compare("optax.nadam(learning_rate=0.01)", "torch.optim.NAdam(lr=0.01)", steps=3,
                     modes=["closed"])
    assert report.runs[0].mode == "closed_loop"
    assert any("mu_product" in n for n in report.notes)


def test_a_trace_and_a_live_implementation_of_the_same_code_are_bitwise(tmp_path):
    path = tmp_path / "sgd.json"
    record("torch.optim.SGD(lr=0.1, momentum=0.9, nesterov=True)", "linear", steps=5,
           path=path)
    report = compare(path, "torch.optim.SGD(lr=0.1, momentum=0.9, nesterov=True)")
    assert report.verdict == "agree"
    assert all(r.max_abs_error == 0.0 for r in report.runs)
    assert {r.mode for r in report.runs} == {"teacher_forced", "closed_loop"}
    # the trace names its call: compare rebuilds it for the reference's float64 twin
    assert all(r.exact_estimate == "float64 twins" for r in report.runs)


def test_teacher_forcing_isolates_a_single_bad_step():
    # B is torch.optim.SGD except that it scales one gradient (step 2's) by 1.001:
    # teacher-forced, only step 2 differs; closed loop, every step from 2 on
    import torch

    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal(4).astype(np.float32)}
    grads = [{"w": rng.standard_normal(4).astype(np.float32)} for _ in range(5)]
    rec = record("torch.optim.SGD(lr=0.1, momentum=0.9)", gradient_sequence(params, grads),
                 steps=5)
    bad = torch.from_numpy(grads[2]["w"])

    class Glitch(torch.optim.SGD):
        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                if torch.equal(p.grad, bad):
                    p.grad.mul_(1.001)
            return super().step(closure)

    report = compare(rec, lambda ps: Glitch(ps, lr=0.1, momentum=0.9))
    teacher, closed = report.runs
    assert [t for t, errs in enumerate(teacher.per_step)
            if any(e.abs > 0 for e in errs.values())] == [2]
    assert teacher.localisation.first.step == 2
    assert teacher.localisation.state.tensor == "state/w/momentum_buffer"
    assert [t for t, errs in enumerate(closed.per_step)
            if any(e.abs > 0 for e in errs.values())] == [2, 3, 4]
    assert report.verdict == "diverge"


def test_report_json_and_cli_exit_codes(tmp_path, capsys):
    from xopt.cli import main

    out = subprocess.run(
        [sys.executable, "-m", "xopt", "compare", "torch.optim.RMSprop(lr=0.01)",
         "optax.rmsprop(learning_rate=0.01, decay=0.99)", "--steps", "3", "--json",
         str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"),
         "--record", str(tmp_path / "a.json")], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 1, out.stderr  # ε placement: a divergence
    assert "DIVERGE" in out.stdout and "first above float32 rounding: step 0" in out.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    run = report["runs"][0]
    assert run["verdict"] == "diverge" and run["localisation"]["first"]["step"] == 0
    assert run["localisation"]["cause"] == "formulation"
    assert set(run["exact"]) == {"estimate", "backend", "against", "undecided"}
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    # the recorded reference replays against an aligned optax: agreement, exit 0
    assert main(["compare", str(tmp_path / "a.json"),
                 "optax.rmsprop(learning_rate=0.01, decay=0.99, eps_in_sqrt=False)",
                 "--mode", "teacher"]) == 0
    assert main(["compare", "optax.nadam(learning_rate=0.01)", "torch.optim.NAdam(lr=0.01)",
                 "--steps", "2"]) == 2
    assert "mu_product" in capsys.readouterr().err
    assert main(["compare", "torch.optim.Muon(lr=0.02, weight_decay=0.0)",
                 "optax.contrib.muon(learning_rate=0.02)", "--problem", "mlp-nobias",
                 "--steps", "2", "--map", "count=@count"]) == 1
    assert "formulation" in capsys.readouterr().out
    assert main(["compare", "torch.optim.SGD(lr=0.1)", "--steps", "2"]) == 2
    assert "compare needs A and B" in capsys.readouterr().err


def _usage_example() -> str:
    text = (REPO / "docs" / "parity" / "record-compare.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_the_usage_pages_example_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(_usage_example(), "record-compare.md", "exec"), {})
    out = capsys.readouterr().out
    assert "verdict:" in out and (tmp_path / "adamw_torch.json").is_file()
