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
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from helpers import xla_cpu_kernels_of_its_own  # noqa: E402 (needs the path above)

xla_cpu_kernels_of_its_own()

if importlib.util.find_spec("torch") is not None and "triton" not in sys.modules:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


#: The files that run longest (the learned optimizers' parity reports, the kernel workers
#: under Triton's interpreter, benchmarks and examples run to the end, the documentation
#: pages' snippets), longest first: each 0.5-10 minutes on a 2-core CPU shared with other
#: work, most of them of few tests. Under ``--dist loadfile`` a file runs on one worker from
#: its first test to its last, and pytest-xdist hands the files out in the order collected;
#: started first, these leave short files for the end of the run (longest processing time
#: first). By their number of tests (pytest-xdist's own order) most came last and ended it.
SLOW_FILES = (
    "tests/test_kernels_lopt.py",
    "tests/test_kernels_velo_fold.py",
    "tests/test_kernels_small_fc_fold.py",
    "tests/test_bench.py",
    "tests/test_bench_refresh_schedule.py",
    "tests/test_doc_snippets.py",
    "tests/test_examples.py",
    "parity_tests/test_learned_optimizers.py",
    "tests/test_jax_lowrank_batched.py",
    "tests/test_jax_lopt_pallas_breakdown.py",
    "tests/distributed/test_examples.py",
    "parity_tests/test_mulo.py",
    "tests/test_mulo_example.py",
    "parity_tests/test_plumage.py",
    "tests/distributed/test_jax_layers.py",
    "tests/test_parity_findings.py",
    "tests/test_jax_flora_compile.py",
    "tests/test_parity_pairs.py",
    "tests/test_docs.py",
)


def _share_the_cores(config) -> None:
    """Under pytest-xdist, each worker's (and its children's) torch, MKL and OpenBLAS use
    their share of the cores, not all of them (``OMP_NUM_THREADS``; a value set outside is
    kept): the tensors here are small, and threads beyond a process's share only wait for
    a core held by another worker (a VeLO golden case's torch steps took 6x the CPU time on
    two cores shared by two workers). Every comparison is between runs under one setting."""
    workers = len(config.getoption("tx", None) or [])
    if workers < 2:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (cores or 1) // workers)))


def _jax_compilation_cache(config) -> None:
    """One JAX compilation cache for the run (a temporary directory, removed at its end),
    shared by the workers and their child processes through the environment: the parity
    harness jits a new step function per trace and mode, and the same program compiled
    again is read back (a VeLO golden case's update compiles for 30 s on a CPU). XLA's
    flags are in the cache's key, so children of other flags compile their own. The size
    limit turns on JAX's file lock, so that a worker never reads an entry another is
    writing."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    path = tempfile.mkdtemp(prefix="xopt-tests-jax-cache-")
    config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
    settings = {"JAX_COMPILATION_CACHE_DIR": path,
                "JAX_COMPILATION_CACHE_MAX_SIZE": str(8 << 30)}
    os.environ.update(settings)
    if "jax" in sys.modules:  # JAX reads its environment when imported
        import jax

        for name, value in settings.items():
            jax.config.update(name.lower(), int(value) if value.isdigit() else value)


def pytest_configure(config):
    """Files go to the workers in collection order (:func:`pytest_collection_modifyitems`),
    not re-sorted by their number of tests (pytest-xdist's default for loadfile, which put
    the slow files, each of few tests, last). In the main process (not an xdist worker,
    which inherits its environment): the cores shared among the workers and one JAX
    compilation cache for the run."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if not hasattr(config, "workerinput"):
        _share_the_cores(config)
        _jax_compilation_cache(config)


def _order_files(items) -> None:
    """:data:`SLOW_FILES` first, in their order; then the other files by their number of
    tests, most first (pytest-xdist's own order); a file's tests keep their order."""
    def path(item) -> str:
        return item.nodeid.split("::")[0]

    count = Counter(map(path, items))

    def key(item):
        if path(item) in SLOW_FILES:
            return (0, SLOW_FILES.index(path(item)))
        return (1, -count[path(item)])

    items.sort(key=key)  # stable: the order within a file and among ties is kept


@pytest.hookimpl(trylast=True)  # after pytest groups a module's tests by fixture parameters
def pytest_collection_modifyitems(config, items):
    """Files ordered for the workers (:func:`_order_files`). Every test may run once more
    after a native crash of one of its processes, and only then (helpers.NATIVE_CRASH says
    why); without pytest-rerunfailures, never."""
    _order_files(items)
    if not config.pluginmanager.hasplugin("rerunfailures"):
        return
    from helpers import NATIVE_CRASH

    mark = pytest.mark.flaky(reruns=1, only_rerun=list(NATIVE_CRASH))
    for item in items:
        item.add_marker(mark)
