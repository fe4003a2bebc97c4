"""Shared test helpers (imported by tests/ and parity_tests/)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

has_torch = importlib.util.find_spec("torch") is not None
has_jax = importlib.util.find_spec("jax") is not None and importlib.util.find_spec("optax") is not None

needs_torch = pytest.mark.skipif(not has_torch, reason="torch is not installed")
needs_jax = pytest.mark.skipif(not has_jax, reason="jax/optax are not installed")
