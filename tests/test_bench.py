"""The maintained GPU benchmarks (bench/) run: each in its ``--tiny`` CPU mode.

Timings on a CPU mean nothing and are not checked; what is checked is that each script
runs to the end and reports what its GPU run reports (its rows, its correctness checks).
Each runs in a child process: ``bench/lopt_step.py --tiny`` and ``bench/poet_layer.py
--tiny`` run the Triton kernels under Triton's interpreter (``TRITON_INTERPRET=1``, set in
the child's environment only).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from helpers import REPO, check_exit, has_jax, has_torch, has_triton

pytestmark = pytest.mark.skipif(not has_torch, reason="needs torch")


def _run(script: str, *args: str, interpret: bool = False) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # --tiny is the CPU mode, even on a GPU machine
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *args],
                          capture_output=True, text=True, env=env, cwd=REPO)
    check_exit(proc)
    return proc.stdout


def test_bench_holds_only_maintained_benchmarks():
    """bench/ keeps benchmarks with a --tiny mode (tested here) and their results."""
    scripts = sorted(p.name for p in (REPO / "bench").iterdir() if p.suffix == ".py")
    assert scripts == ["compact_memory.py", "distributed.py", "lopt_step.py", "lopt_step_jax.py",
                       "poet_layer.py", "train_step.py"]
    assert not [p for p in (REPO / "bench").iterdir() if p.is_dir()]


@pytest.mark.skipif(not has_triton, reason="needs triton")
def test_lopt_step_tiny(tmp_path):
    out = tmp_path / "lopt.json"
    text = _run("lopt_step.py", "--tiny", "--out", str(out))
    report = json.loads(out.read_text())
    rows = report["models"]["tiny"]["timings"]
    for label in ("adamw/fused", "small_fc_lopt/triton/exact", "small_fc_lopt/plain",
                  "velo/triton/exact", "velo/plain"):
        assert rows[label]["median_ms"] > 0, label
    checks = report["models"]["tiny"]["checks"]
    # the same checks the GPU run makes: the Triton step against plain, and determinism
    assert checks["small_fc_lopt/bitwise_two_runs"] and checks["velo/bitwise_two_runs"]
    assert checks["small_fc_lopt/exact"]["param_max_rel"] < 1e-6
    assert checks["velo/exact"]["param_max_rel"] < 1e-6
    assert "two runs identical bits: True" in text


@pytest.mark.skipif(not has_triton, reason="needs triton")
def test_poet_layer_tiny(tmp_path):
    out = tmp_path / "poet.json"
    _run("poet_layer.py", "--tiny", "--out", str(out), interpret=True)
    rows = json.loads(out.read_text())["rows"]
    labels = {(r["layer"], r["in"], r["out"], r["block_size"]) for r in rows}
    for n_in, n_out in ((64, 64), (64, 128)):
        assert ("nn.Linear", n_in, n_out, None) in labels
        for b in (16, 32):
            for variant in ("fast", "mem"):
                for impl in ("plain", "triton"):
                    assert (f"xopt {variant} ({impl})", n_in, n_out, b) in labels
    assert all(r["ms"] > 0 for r in rows)


def test_compact_memory_tiny(tmp_path):
    out = tmp_path / "compact.json"
    _run("compact_memory.py", "--tiny", "--out", str(out))
    result = json.loads(out.read_text())
    text = json.dumps(result)
    for config in ("adamw", "compact r=n/2", "compact r=n/4", "compact r=n/8"):
        assert config in text, config


@pytest.mark.skipif(not has_jax, reason="needs jax")
def test_lopt_step_jax_tiny(tmp_path):
    """The timing and compile-survey machinery of the JAX run, and its JSON (the kernels and
    their checks are tests/test_kernels_lopt_jax.py's)."""
    _run("lopt_step_jax.py", "--tiny", "--skip-checks", "--no-golden", "--only",
         "small_fc_lopt/packed", "--survey", "adamw,galore", "--out-dir", str(tmp_path))
    report = json.loads((tmp_path / "lopt_step_jax.json").read_text())
    timings = report["models"]["tiny"]["timings"]
    assert timings["jax/small_fc_lopt/packed"]["median_ms"] > 0
    assert timings["jax/small_fc_lopt/packed"]["ratio_to_optax_adamw"] > 0
    # the time until each call returned is part of that call's time (a median of parts)
    row = timings["jax/small_fc_lopt/packed"]
    assert 0 < row["dispatch_median_ms"] <= row["median_ms"]
    survey = report["compile"]["tiny"]
    assert {"optax.adamw", "xopt.jax.adamw", "xopt.jax.galore"} <= set(survey)
    assert all(v["total_s"] > 0 for v in survey.values() if "total_s" in v)


def test_train_step_tiny(tmp_path):
    """Every method trains the tiny decoder a few steps (finite losses) and gets its row."""
    out = _run("train_step.py", "--tiny", "--out-dir", str(tmp_path), "--dtype", "fp32")
    rows = json.loads((tmp_path / "train_step_tiny.json").read_text())["rows"]
    assert list(rows) == [
        "torch.optim.AdamW(fused)", "xopt AdamW", "GaLore", "Flora", "Flora momentum", "COAP",
        "COAP 8-bit",
        "PLUMAGE",
        "small_fc_lopt", "VeLO", "CompAct", "POET-X fast", "POET-X mem", "POET-XQ"], out
    for name, r in rows.items():
        assert r["step_ms_max"] >= r["step_ms_median"] > 0 and r["state_bytes"] > 0, name
        assert r["tokens_per_s"] > 0 and len(r["loss_first_last"]) == 2, name
    assert rows["torch.optim.AdamW(fused)"]["ratio_total_to_fused_adamw"] == 1.0


def test_train_step_tiny_amortised_over_a_refresh_interval(tmp_path):
    """--refresh-interval K: ordinary and refresh steps timed apart, the amortised step
    (ordinary·(K−1) + refresh)/K and its total against fused AdamW's."""
    _run("train_step.py", "--tiny", "--out-dir", str(tmp_path), "--dtype", "fp32",
         "--methods", "GaLore", "--refresh-interval", "200")
    report = json.loads((tmp_path / "train_step_tiny.json").read_text())
    assert report["meta"]["amortised_over"] == 200
    rows = report["rows"]
    ordinary, refresh = rows["GaLore"]["step_ms_ordinary"], rows["GaLore"]["step_ms_refresh"]
    assert ordinary > 0 and refresh > 0
    assert rows["GaLore"]["step_ms_amortised_200"] == pytest.approx(
        (199 * ordinary + refresh) / 200)
    adamw = rows["torch.optim.AdamW(fused)"]  # refreshes nothing: its ordinary step
    assert adamw["step_ms_refresh"] is None
    assert adamw["step_ms_amortised_200"] == adamw["step_ms_ordinary"]
    assert report["rows"]["torch.optim.AdamW(fused)"]["ratio_total_to_fused_adamw_200"] == 1.0


def test_train_step_tiny_accumulates_micro_batches(tmp_path):
    """--accum K: each step's gradient accumulated over K micro-batches is the whole batch's
    mean gradient (the same sequences as ``--batch K·b``: the same losses, up to the order of
    the sums), and its tokens are K micro-batches'."""
    losses = []
    for name, flags in (("whole", ("--batch", "2")), ("accum", ("--batch", "1", "--accum", "2"))):
        _run("train_step.py", "--tiny", "--out-dir", str(tmp_path / name), "--dtype", "fp32",
             "--methods", "torch.optim.AdamW(fused)", *flags)
        report = json.loads((tmp_path / name / "train_step_tiny.json").read_text())
        row, meta = report["rows"]["torch.optim.AdamW(fused)"], report["meta"]
        assert (meta["batch"] * meta["accum"], meta["seq"]) == (2, 32), meta
        assert row["tokens_per_s"] == pytest.approx(2 * 32 / (row["total_ms_mean"] / 1e3))
        losses.append(row["loss_first_last"])
    (first, last), (first_acc, last_acc) = losses
    # the first loss is of the same parameters (only the sums' order differs); the last
    # follows 11 AdamW steps on gradients that differ from the batch's by that order
    assert first_acc == pytest.approx(first, rel=1e-6)
    assert last_acc == pytest.approx(last, rel=1e-5)
    assert last < first - 0.5  # the steps trained (not a run that stood still)


def test_train_step_tiny_compile_mode(tmp_path):
    """--compile --compile-mode MODE: the model's forward compiled with torch.compile's
    mode (a CPU-valid one runs, the JSON records it); a mode torch.compile does not know is
    refused by torch.compile's own check, before any method runs, naming the option;
    --compile-mode without --compile is refused."""
    _run("train_step.py", "--tiny", "--out-dir", str(tmp_path), "--dtype", "fp32",
         "--methods", "torch.optim.AdamW(fused)", "--compile", "--compile-mode", "default")
    report = json.loads((tmp_path / "train_step_tiny_compiled_default.json").read_text())
    assert report["meta"]["compile"] is True and report["meta"]["compile_mode"] == "default"
    row = report["rows"]["torch.optim.AdamW(fused)"]
    assert row["total_ms_mean"] > 0 and all(map(math.isfinite, row["loss_first_last"]))
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    bad = ((["--compile", "--compile-mode", "no-such-mode"],
            ["--compile-mode no-such-mode", "Unrecognized mode=no-such-mode"]),
           (["--compile-mode", "default"], ["--compile-mode default: needs --compile"]))
    for args, says in bad:
        proc = subprocess.run([sys.executable, str(REPO / "bench" / "train_step.py"), "--tiny",
                               "--out-dir", str(tmp_path / "bad"), *args],
                              capture_output=True, text=True, env=env, cwd=REPO)
        assert proc.returncode == 2 and all(s in proc.stderr for s in says), proc.stderr
        assert not (tmp_path / "bad").exists()


def test_distributed_tiny(tmp_path):
    """FSDP2 on 2 gloo CPU ranks: every row the GPU run reports; each method's sharded run
    near one process after 3 closed-loop steps of a transformer (its forward and backward
    sum in another order; the bench's small-size check, tests/distributed holds the tight
    bounds); the learned optimizers' step communicating only reduced statistics."""
    text = _run("distributed.py", "--tiny", "--out-dir", str(tmp_path))
    report = json.loads((tmp_path / "distributed.json").read_text())
    rows = report["rows"]
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert set(rows) == {"torch_adamw_fused", "adamw", "small_fc_lopt", "velo", "mulo",
                         "galore", "flora", "coap", "plumage", "compact", "poet"}
    for method, r in rows.items():
        assert r["state_bytes"] > 0 and r["step_ms"] > 0, method
        assert r["max_rel_err"] < 1e-3, (method, r["max_rel_err"])
    for method in ("small_fc_lopt", "velo", "mulo"):
        steady = rows[method]["step_comm_bytes"]["steady"]
        params_bytes = 4 * max(1, rows[method]["params"]) // 2  # one rank's shard, float32
        assert 0 < steady["largest"] < params_bytes // 16, (method, steady)
    assert rows["adamw"]["step_comm_bytes"]["steady"]["bytes"] == 0
    # the refresh steps timed with the owner rule and with every rank decomposing
    for method in ("galore", "coap", "plumage"):
        for mode in ("owner", "every_rank"):
            r = rows[method]["refresh"][mode]
            assert len(r["steps_ms"]) == 5 and r["refresh_ms"] > 0, (method, mode)
    # the one-device column (rank 0 alone; on the CPU every default is the plain path)
    assert set(report["one_device"]) == {"torch_adamw_fused", "small_fc_lopt", "velo", "mulo"}
    assert "owner rule | every rank" in text and "one device (unsharded) | FSDP2" in text
    assert "wrote" in text
