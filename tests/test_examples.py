"""The examples run and do what their docstrings say."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest
from helpers import REPO, has_jax, has_torch, needs_jax, needs_torch

needs_sklearn = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                                   reason="scikit-learn is not installed")


@needs_sklearn
@pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")
def test_velo_digits_lowers_the_loss_on_both_backends(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import velo_digits
    finally:
        sys.path.pop(0)
    out = tmp_path / "velo.png"
    assert velo_digits.main(["--steps", "300", "--out", str(out)]) == 0  # 1 = not lowered
    text = capsys.readouterr().out
    assert "torch: mean loss" in text and "jax: mean loss" in text
    assert text.count(": lowered") == 2
    gap = float(text.split("loss difference over 300 steps: ")[1].split()[0])
    # the same optimizer on both backends from the same start: held to the closed-loop
    # parity bound (1e-4 relative) on a loss of about 2 (measured: 7.2e-7)
    assert gap < 2e-4
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.stat().st_size > 0


@needs_torch
@needs_jax
def test_lowrank_lm_trains_every_method_on_both_backends(tmp_path, capsys):
    """The shared low-rank example: every method, both backends, from the same weights and
    batches; each must lower the training loss (the script's own exit code) and write its
    curves. GaLore's two backends follow one another closely (their projections agree, as
    the parity tests show), so their curves are held together too."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import lowrank_lm
    finally:
        sys.path.pop(0)
    out, js = tmp_path / "lm.png", tmp_path / "lm.json"
    assert lowrank_lm.main(["--steps", "24", "--out", str(out), "--json", str(js)]) == 0
    curves = json.loads(js.read_text())
    for backend in ("torch", "jax"):
        assert sorted(curves[backend]) == sorted(lowrank_lm.METHODS)
        for method, c in curves[backend].items():
            assert len(c["loss"]) == 24 and c["lowered"], (backend, method)
    # the first loss is the model's at the shared initial weights: equal on both backends
    first = {b: curves[b]["adamw"]["loss"][0] for b in ("torch", "jax")}
    assert abs(first["torch"] - first["jax"]) < 1e-5
    g_t, g_j = (np.array(curves[b]["galore"]["loss"]) for b in ("torch", "jax"))
    assert np.max(np.abs(g_t - g_j)) < 1e-3


@pytest.mark.parametrize("backend", [
    pytest.param("torch", marks=needs_torch), pytest.param("jax", marks=needs_jax)])
def test_poet_llama_pretrains_with_merges(backend, capsys):
    """The POET-X example lowers the loss across merges (interval 10 in 30 steps)."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import poet_llama
    finally:
        sys.path.pop(0)
    assert poet_llama.main(["--backend", backend, "--steps", "30",
                            "--merge-interval", "10"]) == 0
