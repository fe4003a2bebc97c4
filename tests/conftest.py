"""Unit tests: make tests/helpers.py importable as ``helpers`` under any import mode, and
put Triton in its CPU interpreter before anything imports it.

The suite runs with ``--import-mode=importlib`` (pyproject.toml), so that tests/ and
parity_tests/ may hold test modules of the same name (tests/test_galore.py and
parity_tests/test_galore.py); that mode leaves sys.path alone, hence this insert (as
parity_tests/conftest.py does).

Without a CUDA GPU the in-process Triton tests (tests/test_poet.py's kernels) run under
``TRITON_INTERPRET=1``, which must be set before triton is first imported: triton decorates
its own ``tl`` helpers then, and an interpreted kernel cannot call helpers decorated for the
GPU. Importing ``torch._dynamo`` (any ``torch.compile``, ``torch.compiler.disable``)
imports triton, so a test module's own setting comes too late once another module has
imported it; hence here, before any test module is collected.

On a GPU, several xdist workers share one device: JAX would otherwise take 75% of its
memory in each worker at its first array, so it allocates as it goes."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

if importlib.util.find_spec("torch") is not None and "triton" not in sys.modules:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Every test may run once more after a native crash of one of its processes, and only
    then (helpers.NATIVE_CRASH says why); without pytest-rerunfailures, never."""
    if not config.pluginmanager.hasplugin("rerunfailures"):
        return
    import pytest
    from helpers import NATIVE_CRASH

    mark = pytest.mark.flaky(reruns=1, only_rerun=list(NATIVE_CRASH))
    for item in items:
        item.add_marker(mark)
