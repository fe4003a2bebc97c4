"""The parity suite: xopt's implementations against golden traces, the live original
libraries, the float64 oracle and each other, through the same harness as `xopt parity`."""

from __future__ import annotations

import sys
from pathlib import Path

# tests/helpers.py: the shared skip markers and paths
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
