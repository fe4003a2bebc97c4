"""The distributed examples run as their docstrings say and lower the loss:
examples/fsdp_lm.py under torchrun (2 gloo processes, FSDP2) and examples/sharded_lm_jax.py
on 2 host devices (a child process: the device count is set before JAX starts)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, check_exit


def _run(args: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True)
    check_exit(proc)
    return proc.stdout


def _losses(out: str, method: str) -> list[float]:
    return [float(x) for x in re.findall(rf"^{method} step +\d+  loss ([0-9.]+)$", out, re.M)]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_fsdp_lm_under_torchrun_lowers_the_loss():
    """A learned optimizer, whose loss features must be the ranks' mean: two processes
    started by torchrun, the parameters sharded by FSDP2."""
    out = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "examples/fsdp_lm.py", "--method", "small_fc_lopt", "--steps", "16"])
    losses = _losses(out, "small_fc_lopt")
    assert len(losses) == 4, out  # rank 0 alone prints: steps 0, 5, 10 and 15
    assert losses[-1] < losses[0], out
    assert "small_fc_lopt: loss" in out and out.rstrip().endswith("lowered"), out


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")
def test_sharded_lm_jax_lowers_the_loss_on_two_host_devices():
    out = _run(["examples/sharded_lm_jax.py", "--method", "galore", "--steps", "16"])
    losses = _losses(out, "galore")
    assert len(losses) == 4 and losses[-1] < losses[0], out
    assert out.rstrip().endswith("on 2 devices: lowered"), out
