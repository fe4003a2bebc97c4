"""Shared test helpers (imported by tests/ and parity_tests/)."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

has_torch = importlib.util.find_spec("torch") is not None
has_jax = all(importlib.util.find_spec(m) is not None for m in ("jax", "optax"))
has_triton = importlib.util.find_spec("triton") is not None

needs_torch = pytest.mark.skipif(not has_torch, reason="torch is not installed")
needs_jax = pytest.mark.skipif(not has_jax, reason="jax/optax are not installed")
#: in-process Triton tests: a CUDA GPU's compiled kernels, else the CPU interpreter
#: (conftest.py sets TRITON_INTERPRET=1 before anything imports triton)
needs_triton = pytest.mark.skipif(not (has_torch and has_triton),
                                  reason="triton is not installed")
#: XLA:CPU's code without fused multiply-adds is asked for by an x86 ISA name (SSE4.2)
needs_x86 = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                               reason="the FMA-free code generation is requested by an x86 "
                                      "ISA name")


#: XLA:CPU's matrix-product fusions through YNNPACK choose their kernels from the CPU they
#: run on, whatever ``--xla_cpu_max_isa`` says (on an AMD EPYC, COAP's batched products came
#: out other bits than its per-leaf ones; on the Intel CPU of CI, the same): off in the
#: FMA-free child, where the XLA in use knows the flag
_NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="


def xla_cpu_kernels_of_its_own() -> None:
    """Turn off XLA:CPU's YNNPACK product fusions for this test run (``XLA_FLAGS``, before
    any JAX backend starts; xdist's workers inherit it), where the installed XLA knows the
    flag (asked once, in a child process): their kernels follow the CPU model, and a test's
    float32 bounds must hold on any x86 CPU (on an AMD EPYC, the Pallas VeLO step's error
    against float64 came out 3× the plain path's with them, 1× without)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _NO_YNN in flags or os.environ.get("XOPT_TESTS_YNN") == "unknown":
        return
    if importlib.util.find_spec("jax") is None:
        return
    env = dict(os.environ, XLA_FLAGS=f"{flags} {_NO_YNN}".strip(), JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax.numpy as j; j.zeros(1).sum()"],
                           env=env, capture_output=True, text=True, check=False)
    if probe.returncode == 0:
        os.environ["XLA_FLAGS"] = env["XLA_FLAGS"]
    else:  # an XLA without the flag (or without YNNPACK): nothing to turn off
        os.environ["XOPT_TESTS_YNN"] = "unknown"


def fma_free_jax_child(code: str) -> dict:
    """Run ``code`` (``sys.argv[1]``: the repository root; ``tests`` and its modules'
    ``helpers`` importable) in a child process whose JAX runs on an XLA:CPU that emits no
    fused multiply-add (SSE4.2 code) and whose products are its own code (no YNNPACK), so
    that two programs' bits do not depend on which products each contracts, nor on the CPU
    model; the JSON object it prints last."""
    for flags in (f"--xla_cpu_max_isa=SSE4_2 {_NO_YNN}", "--xla_cpu_max_isa=SSE4_2"):
        env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
                   PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"),
                                               os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run([sys.executable, "-c", code, str(REPO)], env=env,
                              capture_output=True, text=True, check=False)
        if not (done.returncode and "Unknown flag" in done.stderr and _NO_YNN[2:-1] in
                done.stderr):  # an XLA without YNNPACK fusions: the ISA cap alone
            break
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


#: How a test's failure reads when a process of it was killed by a signal in native code
#: rather than failing a check: a gloo rank's rare crash (CI saw a SIGSEGV in a gloo thread
#: during an all-gather, and SIGABRTs in malloc and at exit; none recurred in local runs).
#: Such a test runs once more on fresh processes (tests/conftest.py, pytest-rerunfailures),
#: and the rerun is listed in the summary; a crash that recurs fails the test.
NATIVE_CRASH = (r"^RankError: rank \d+ of \d+ died in .* \(exit code -\d+\)",
                r"^NativeCrash: ")


class NativeCrash(AssertionError):
    """A child process of a test was killed by a signal (see :data:`NATIVE_CRASH`)."""


def check_exit(proc, tail: int = 3000) -> None:
    """Fail unless the finished ``subprocess.run`` result ``proc`` exited with 0: a
    :class:`NativeCrash` where the child, or a rank torchrun ran, was killed by a signal,
    else an AssertionError; both with the end of its output."""
    if proc.returncode == 0:
        return
    out = (proc.stdout or "")[-tail:] + (proc.stderr or "")[-tail:]
    # torchrun exits 1 and names a rank it lost to a signal in its failure summary
    lost = re.search(r"Signal \d+ \((SIG[A-Z]+)\) received by PID", proc.stderr or "")
    if proc.returncode < 0 or lost:
        name = signal.Signals(-proc.returncode).name if proc.returncode < 0 else lost[1]
        raise NativeCrash(f"a process died by {name} (exit code {proc.returncode})\n{out}")
    raise AssertionError(f"exit code {proc.returncode}\n{out}")


def triton_kernel_target():
    """``(mark, device)`` for a test of a Triton kernel against its torch path: the
    interpreter's tensors on a CPU (``TRITON_INTERPRET=1``), the compiled kernel's on a GPU;
    the mark skips where neither runs."""
    if not has_torch:
        return pytest.mark.skip(reason="needs torch"), None
    import torch

    from xopt.kernels import interpreting, triton_available

    mark = pytest.mark.skipif(
        not triton_available() or not (interpreting() or torch.cuda.is_available()),
        reason="needs triton (its interpreter on a CPU)")
    cpu = interpreting() or not torch.cuda.is_available()
    return mark, torch.device("cpu" if cpu else "cuda")


def explain_disagreements(report) -> str:
    """The runs of a parity report that do not agree, one line each (an assertion's
    message): trace, backend, impl, against, mode, the largest relative error, where, and
    the tolerance it broke."""
    return "\n".join(
        f"{r.trace} {r.backend} {r.impl} vs {r.against} {r.mode}: rel {r.max_rel_error:.3g} "
        f"at step {r.worst[0]} {r.worst[1]} (tol {r.tolerance.rel})"
        for r in report.runs if not r.agrees)


def worker_results(test_file: str | Path) -> dict:
    """Run ``test_file --worker`` in a child process and return the JSON object it prints
    last: on a CUDA GPU when the child sees one, else on the CPU under Triton's interpreter
    (``TRITON_INTERPRET=1`` set in the child's environment before anything imports
    triton, so no other test is affected).

    No wall-clock limit: the worker is a fixed, finite computation, and how long it takes
    measures how busy the machine is (a 900 s limit failed 16 tests on two cores shared
    with other work); a worker that never ends is bounded by the CI job's own limit."""
    import json
    import os
    import subprocess
    import sys

    import torch

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    # the child inherits this environment, so it sees the GPUs this process sees
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(test_file), "--worker"], capture_output=True,
                          text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(res, indent=1))
    return res


def velo_sharing_theta(**fixed):
    """``make(params, **kw)``: ``xopt.torch.VeLO(params, θ, **fixed, **kw)`` where θ is the
    one the first optimizer made drew (``meta_init`` takes seconds a call on a CPU; with
    ``fixed``'s seed every optimizer would draw the same bits, tests/test_velo.py checks
    it)."""
    import xopt.torch as xt

    theta: dict = {}

    def make(params, **kw):
        opt = xt.VeLO(params, theta.get("theta"), **fixed, **kw)
        theta.setdefault("theta", opt.meta)
        return opt

    return make


def max_rel(a, b) -> float:
    """``max|a − b| / max|b|`` of two tensors, in float64 (0 for empty or equal tensors)."""
    if a.numel() == 0:
        return 0.0
    d = (a.double() - b.double()).abs().max().item()
    return 0.0 if d == 0 else d / max(b.double().abs().max().item(), 1e-300)


def max_rel_array(a, b) -> float:
    """:func:`max_rel` of two arrays (anything ``np.asarray`` takes), in float64, as the
    parity harness measures it."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size == 0:
        return 0.0
    d = np.abs(a - b).max()
    return 0.0 if d == 0 else float(d / max(np.abs(b).max(), 1e-300))


def velo_spec_state(state, keys, names=None) -> dict:
    """An ``xopt.jax.velo`` state as the float64 state dict of
    :func:`xopt.specs.velo.hyperv2_steps`: each tensor's variables read at ``keys`` (the
    inner state's indices or names) and stored under ``names`` (default: ``keys``)."""
    import numpy as np

    inner = state.inner
    names = keys if names is None else names
    st = {f"{v}/{n}": np.asarray(getattr(inner, v)[k], np.float64)
          for v in ("m", "rms", "v_row", "v_col", "v_diag", "lstm_hidden", "lstm_cell")
          for k, n in zip(keys, names, strict=True)}
    st.update(iteration=np.int32(state.iteration), num_steps=np.int32(state.num_steps),
              mom_t=np.asarray(inner.mom_t), rms_t=np.asarray(inner.rms_t),
              loss_means=np.asarray(inner.loss_means, np.float64),
              loss_running_min=np.asarray(inner.loss_running_min, np.float64),
              loss_decays=np.asarray(inner.loss_decays, np.float64),
              loss_iteration=np.int32(inner.loss_iteration))
    return st


def rounding_sensitivity(ref, p64, g64, states, want, lr, rounds: int = 3, *,
                         weights: dict | None = None, weight_bits: int = 24,
                         per_tensor: bool = False):
    """How far the float64 reference step moves when every float32 input is rounded once
    more: ``ref(params, grads, states)`` (float64 lists, its steps) rerun ``rounds`` times
    on inputs each scaled by ``1 + 2⁻²⁴·u`` (``u`` uniform in [−1, 1), one draw per
    element, seeds 0, 1, …), as :func:`max_rel` of ``lr · step`` against ``want`` (the
    reference's ``lr · step``), the largest. A float32 path cannot be held closer to the
    float64 step than this (tests/test_kernels_lopt.py).

    ``weights``: named tensors also perturbed, by ``1 + 2^-weight_bits·u`` (drawn first in
    each round), and passed to ``ref`` as a fourth argument (e.g. an MLP's weights at a
    kernel's operand precision). ``per_tensor``: the largest movement of each step, a list,
    instead of the largest over all of them."""
    import torch

    worst = [0.0] * len(want)
    for k in range(rounds):
        gen = torch.Generator().manual_seed(k)

        def jig(x, bits=24, gen=gen):
            u = 2 * torch.rand(x.shape, generator=gen, dtype=torch.float64) - 1
            return x * (1 + 2.0 ** -bits * u.to(x.device))

        extra = () if weights is None else ({n: jig(v, weight_bits) for n, v in weights.items()},)
        out = ref([jig(x) for x in p64], [jig(x) for x in g64],
                  [{n: jig(v) for n, v in s_.items()} for s_ in states], *extra)
        worst = [max(w, max_rel(lr * a, b)) for w, a, b in zip(worst, out, want, strict=True)]
    return worst if per_tensor else max(worst, default=0.0)


def exact_in_float32(a, b) -> bool:
    """Whether every partial sum of ``a @ b`` (any order) is exact in float32: its terms
    are multiples of ``2^q`` whose absolute sum stays below ``2^(24 + q)``."""
    import numpy as np

    a, b = (np.asarray(x, np.float64) for x in (a, b))
    assert np.abs(a).max() < 2**20 and np.abs(b).max() < 2**20

    def grain(x):  # the largest power of two dividing x (inf for zero; 2⁻⁴⁰ at the finest)
        k = np.round(np.abs(x) * 2.0**40).astype(np.int64)
        return np.where(x == 0, np.inf, (k & -k) * 2.0**-40)

    terms = np.abs(a[:, :, None] * b[None, :, :])
    q = (grain(a)[:, :, None] * grain(b)[None, :, :]).min(axis=1)
    return bool(np.all(terms.sum(axis=1) < 2.0**24 * q))


def jax_block_model(k: int, seed: int = 0) -> dict:
    """A JAX parameter tree of ``k`` copies of a block (a 16 x 24 and a 24 x 16 matrix,
    whose projections for a low-rank method have the same size, and a bias) and a 12 x 20
    matrix of a shape of its own; float32 normals from ``seed``."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)

    def leaf(*shape: int):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    params = {f"blk{i}": {"w1": leaf(16, 24), "w2": leaf(24, 16), "b": leaf(24)}
              for i in range(k)}
    params["odd"] = leaf(12, 20)
    return params
