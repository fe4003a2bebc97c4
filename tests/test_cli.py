"""`xopt parity`: exit codes, the JSON report's shape, the plot, and bad-input messages."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, has_torch

from xopt.parity import bundled_traces, load_trace, write_trace

TRACE = str([p for p in bundled_traces("adamw") if p.stem.startswith("torch")][0])


def xopt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xopt", *args], cwd=REPO, capture_output=True,
                          text=True)


def test_oracle_only_run_writes_a_report_of_the_documented_shape(tmp_path):
    out = xopt("parity", "adamw", "--trace", TRACE, "--backends", "oracle", "--json",
               str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"), "--quiet")
    assert out.returncode == 0, out.stderr
    assert "verdict: agree" in out.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report) >= {"method", "traces", "verdict", "runs"}
    assert report["method"] == "adamw" and report["verdict"] == "agree"
    assert report["traces"] == [f"adamw/{load_trace(TRACE).case}"]
    types = {"trace": str, "backend": str, "impl": str, "against": str, "mode": str,
             "steps": int, "max_abs_error": float, "max_rel_error": float, "worst": dict,
             "tolerance": dict, "verdict": str}
    assert len(report["runs"]) == 2
    for run in report["runs"]:
        for key, typ in types.items():
            assert isinstance(run[key], typ), key
        assert run["mode"] in ("teacher_forced", "closed_loop")
        assert run["verdict"] in ("agree", "diverge")
        assert set(run["worst"]) == {"step", "tensor"} and set(run["tolerance"]) == {"rel", "abs"}
        assert run["backend"] == "oracle" and run["against"] == "golden" and run["steps"] == 30
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_divergence_exits_1(tmp_path):
    t = load_trace(TRACE)
    arrays = {k: t.array(k).copy() for k in t.keys()}
    # the last step, so that teacher forcing carries the corruption into no later step
    arrays["step_0029/param/scale"] = arrays["step_0029/param/scale"] * np.float32(1.01)
    path = write_trace(tmp_path / "bad.json", json.loads(json.dumps(t.manifest)), arrays)
    out = xopt("parity", "adamw", "--trace", str(path), "--backends", "oracle", "--mode",
               "teacher", "--quiet")
    assert out.returncode == 1
    assert "DIVERGE" in out.stdout and "29: param/scale" in out.stdout


@pytest.mark.parametrize("args,pattern", [
    (("parity", "nosuch"), "unknown method 'nosuch'; known methods: adamw"),
    (("parity", "adamw", "--trace", "missing.json"), "missing.json: no such trace manifest"),
    (("parity", "adamw", "--backends", "torch,tensorflow"), "choose from torch, jax"),
    (("parity", "adamw", "--mode", "open"), "choose from teacher, closed"),
    (("parity", "adamw", "--impl", "triton"), "adamw has no 'triton' implementation"),
])
def test_bad_input_exits_2_with_the_reason(args, pattern):
    out = xopt(*args)
    assert out.returncode == 2
    assert pattern in out.stderr


def test_bad_trace_exits_2_naming_the_array(tmp_path):
    t = load_trace(TRACE)
    arrays = {k: t.array(k) for k in t.keys() if k != "step_0004/grad/tensor3"}
    path = write_trace(tmp_path / "t.json", json.loads(json.dumps(t.manifest)), arrays)
    out = xopt("parity", "adamw", "--trace", str(path))
    assert out.returncode == 2 and "missing array 'step_0004/grad/tensor3'" in out.stderr
    manifest = json.loads(json.dumps(t.manifest))
    manifest["hyperparameters"]["nesterov_momentum"] = True
    path = write_trace(tmp_path / "h.json", manifest, {k: t.array(k) for k in t.keys()})
    out = xopt("parity", "adamw", "--trace", str(path))
    assert out.returncode == 2 and "'nesterov_momentum'" in out.stderr


@pytest.mark.skipif(not has_torch, reason="needs torch")
def test_default_run_prints_the_table():
    out = xopt("parity", "adamw", "--backends", "torch,oracle,original", "--mode", "teacher",
               "--steps", "3", "--quiet")
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("xopt.torch", "oracle", "torch.optim.AdamW", "verdict: agree"):
        assert name in out.stdout


@pytest.mark.skipif(not has_torch, reason="needs torch")
def test_against_the_live_original_is_bitwise():
    out = xopt("parity", "adamw", "--trace", TRACE, "--backends", "torch", "--against",
               "original", "--quiet")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if "xopt.torch" in line]
    assert len(rows) == 2 and all("torch.optim.AdamW" in r and "bitwise" in r for r in rows)


def test_a_method_without_traces_exits_0_with_a_note():
    # a loop over `xopt methods` running `xopt parity` on each must not stop at one
    out = xopt("parity", "plumage")
    assert out.returncode == 0, out.stderr
    assert "plumage: no traces to replay (it has no original implementation" in out.stdout


def test_one_run_on_one_trace_is_singular():
    out = xopt("parity", "adamw", "--trace", TRACE, "--backends", "oracle", "--mode",
               "teacher", "--steps", "2", "--quiet")
    assert out.returncode == 0, out.stderr
    assert "adamw: 1 run on 1 trace; verdict: agree" in out.stdout


def test_methods_lists_every_method_with_integer_ranges_as_integers():
    out = xopt("methods")
    assert out.returncode == 0 and "adamw:" in out.stdout and "weight_decay" in out.stdout
    from xopt import specs
    for name in specs.names():
        assert f"\n{name}: " in "\n" + out.stdout
    seed = next(line for line in out.stdout.splitlines() if line.split()[:2] == ["seed", "0"])
    assert "[0, 18446744073709551615]" in seed
    gap = next(line for line in out.stdout.splitlines() if line.split()[:1] == ["gap"])
    assert "[0, inf)" in gap and "e+" not in out.stdout
