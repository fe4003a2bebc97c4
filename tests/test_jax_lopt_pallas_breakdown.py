"""bench/lopt_step_jax.py ``--breakdown`` on the CPU (Pallas's interpreter), on two tiny shape
groups: the table's structure and its consistency, not its timings (a CPU's mean nothing).

The stages must cover the update: one ``setup``, ``pack`` and ``unpack``, a ``prep``,
``stats``, ``norm`` and ``fused`` stage per shape group the kernels handle and one ``xla``
stage per other group (from the shapes, :func:`xopt.jax._lopt_pallas.two_d_view`), as many
kernel stages as the update lowered for CUDA has ``pallas_call``s; the staged update must
give the one-jit update's result; each stage's bytes are at least what its arrays hold (the
fused stage: g, p, m, rms read and step, m, rms written, from the group's shapes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, has_jax

pytestmark = pytest.mark.skipif(not has_jax, reason="jax/optax are not installed")

PATHS = ("small_fc_lopt/exact", "velo/exact")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("breakdown")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "lopt_step_jax.py"), "--tiny", "--out-dir",
         str(out), "--breakdown", "tiny_pair", "--breakdown-only", "--breakdown-paths",
         ",".join(PATHS), "--reps", "1"],
        capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "lopt_step_jax.json").read_text()), proc.stdout


def _shapes():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import lopt_step_jax as B
    finally:
        sys.path.remove(str(REPO / "bench"))
    return B.tiny_pair()


@pytest.mark.parametrize("path", PATHS)
def test_breakdown_covers_the_update(run, path):
    from xopt.jax._lopt_pallas import two_d_view

    report, stdout = run
    assert not [n for n in report["notes"] if "breakdown" in n and "failed" in n], \
        report["notes"]
    res = report["breakdown"]["tiny_pair"][path]
    shapes = _shapes()
    groups = list(dict.fromkeys(tuple(s) for s in shapes))
    kernel_groups = [s for s in groups if two_d_view(s) is not None]
    tag = {s: "x".join(map(str, s)) or "scalar" for s in groups}
    rows = res["stages"]
    got = sorted((r["stage"], r["group"]) for r in rows)
    want = [("pack", ""), ("setup", ""), ("unpack", "")]
    want += [(st, tag[s]) for s in kernel_groups for st in ("prep", "stats", "norm", "fused")]
    want += [("xla", tag[s]) for s in groups if s not in kernel_groups]
    if path.startswith("velo"):
        want.append(("lstm", ""))
    assert got == sorted(want)
    # the kernel stages are the update's pallas_calls, as lowered for CUDA: one of each
    # kernel per tensor, one kernel compiled per group (VeLO's LSTM inputs from its
    # statistics kernel: no other pass)
    calls = {k["kernel"]: (k["calls"], k["compiled"]) for k in res["kernels"]}
    prefix = "sfc" if path.startswith("small_fc") else "velo"
    n_in = sum(1 for t in shapes if tuple(t) in kernel_groups)
    want_calls = (n_in, len(kernel_groups))
    want = {f"{prefix}_stats": want_calls, f"{prefix}_fused": want_calls}
    # and the copy kernels (a call per state array of each group, both groups of two
    # tensors here): stacking the old v_row (8x3 per tensor), v_col (24x3) of the matrices
    # and m (8x3), rms (8x1), v_diag (8x3) of the vectors, 5 calls of 3 kernels (one per
    # size); handing back the new ones, and VeLO's LSTM hidden and cell of the 4 tensors
    # (one more size)
    velo = path.startswith("velo")
    want.update(stack_rows=(5, 3), split_rows=(5 + 2 * velo, 3 + velo))
    assert calls == want
    assert all(k["ir_bytes"] > 0 and k["grid"] > 0 for k in res["kernels"])
    # the staged update is the update (separate compilations may round a few ulps apart)
    assert res["staged_vs_one_jit"]["step_max_rel"] <= 1e-5
    assert res["staged_vs_one_jit"]["state_max_rel"] <= 1e-5
    for r in rows:
        assert r["ms"] > 0 and r["launches"] >= 1, r
        assert r["gb_s"] == pytest.approx(r["bytes"] / r["ms"] / 1e6)
        if r["stage"] == "fused":
            s = next(s for s in kernel_groups if tag[s] == r["group"])
            n = sum(int(np.prod(t)) for t in shapes if tuple(t) == s)
            assert r["bytes"] >= 4 * n * (6 + 5), r  # g, p, m×3, rms in; step, m×3, rms out
    # the printed sum is the rows' sum
    label = f"tiny_pair {path.replace('/', ' pallas ')}"
    block = stdout.split(label + ":", 1)[1]
    printed = float(re.search(r"sum of stages\s+([\d.]+)", block).group(1))
    assert printed == pytest.approx(sum(r["ms"] for r in rows), abs=1e-3)
    assert res["inner_ms"] > 0 and res["step_ms"] > 0 and res["adamw_ms"] > 0
