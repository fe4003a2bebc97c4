"""Unit tests: make tests/helpers.py importable as ``helpers`` under any import mode.

The suite runs with ``--import-mode=importlib`` (pyproject.toml), so that tests/ and
parity_tests/ may hold test modules of the same name (tests/test_galore.py and
parity_tests/test_galore.py); that mode leaves sys.path alone, hence this insert (as
parity_tests/conftest.py does)."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
