"""Shared test helpers (imported by tests/ and parity_tests/)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

has_torch = importlib.util.find_spec("torch") is not None
has_jax = all(importlib.util.find_spec(m) is not None for m in ("jax", "optax"))

needs_torch = pytest.mark.skipif(not has_torch, reason="torch is not installed")
needs_jax = pytest.mark.skipif(not has_jax, reason="jax/optax are not installed")
