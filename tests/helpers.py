"""Shared test helpers (imported by tests/ and parity_tests/)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

has_torch = importlib.util.find_spec("torch") is not None
has_jax = all(importlib.util.find_spec(m) is not None for m in ("jax", "optax"))
has_triton = importlib.util.find_spec("triton") is not None

needs_torch = pytest.mark.skipif(not has_torch, reason="torch is not installed")
needs_jax = pytest.mark.skipif(not has_jax, reason="jax/optax are not installed")


def explain_disagreements(report) -> str:
    """The runs of a parity report that do not agree, one line each (an assertion's
    message): trace, backend, impl, against, mode, the largest relative error, where, and
    the tolerance it broke."""
    return "\n".join(
        f"{r.trace} {r.backend} {r.impl} vs {r.against} {r.mode}: rel {r.max_rel_error:.3g} "
        f"at step {r.worst[0]} {r.worst[1]} (tol {r.tolerance.rel})"
        for r in report.runs if not r.agrees)


def worker_results(test_file: str | Path, timeout: int) -> dict:
    """Run ``test_file --worker`` in a child process and return the JSON object it prints
    last: on a CUDA GPU when the child sees one, else on the CPU under Triton's interpreter
    (``TRITON_INTERPRET=1`` set in the child's environment before anything imports
    triton, so no other test is affected)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, env=env)
    if probe.stdout.strip() != "True":
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(test_file), "--worker"], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(res, indent=1))
    return res
