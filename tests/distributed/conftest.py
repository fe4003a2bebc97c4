"""Fixtures of the distributed tests: one gang of processes per test module.

A module that runs code on ranks starts its processes once and reuses them for all its
tests: ``gang`` (2 gloo ranks on the CPU) and ``jax_worker`` (one process whose JAX sees 4
host devices: the XLA flag must be set before jax is imported, which this process may have
done already). A test whose rank fails gets a fresh gang at its next call (see
:mod:`xopt.torch.launch`). Rank-side code lives in the ``*_cases.py`` modules beside the
tests, which import nothing from pytest.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # the rank-side modules, under --import-mode=importlib
    sys.path.insert(0, _HERE)


def _gloo() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


collect_ignore_glob = []
if not _gloo():  # torch is optional: without it (or gloo) its tests have nothing to run
    collect_ignore_glob += ["test_torch_*.py", "test_launch.py", "test_parity_world_size.py"]
if importlib.util.find_spec("jax") is None:
    collect_ignore_glob += ["test_jax_*.py"]

WORLD = 2
JAX_DEVICES = 4


@pytest.fixture(scope="module")
def gang():
    from xopt.torch.launch import Gang

    with Gang(WORLD, "gloo") as g:
        yield g


@pytest.fixture(scope="module")
def jax_worker():
    pytest.importorskip("jax")
    from xopt.torch.launch import Gang

    # LLVM's optimisations are most of XLA's compile time on the CPU; both sides of every
    # comparison (and the HLO the collectives are read from) are compiled with the same flags
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={JAX_DEVICES} "
                        "--xla_backend_optimization_level=0",
           "JAX_PLATFORMS": "cpu"}
    with Gang(1, None, env=env) as g:
        yield g
