"""The parity suite: xopt's implementations against golden traces, the live original
libraries, the float64 oracle and each other, through the same harness as `xopt parity`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# xdist workers sharing one GPU: JAX allocates as it goes (as tests/conftest.py says)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# tests/helpers.py: the shared skip markers and paths
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import xla_cpu_kernels_of_its_own  # noqa: E402 (needs the path above)

xla_cpu_kernels_of_its_own()  # float32 bounds that hold on any x86 CPU (helpers.py)
