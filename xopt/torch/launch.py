"""Running a function on N local processes that form a ``torch.distributed`` group.

Tests, the parity harness (``xopt parity --world-size N``), ``bench/distributed.py`` and
the distributed examples run distributed code on one machine. :class:`Gang` keeps N worker
processes (one process group among them: gloo on the CPU, or NCCL with one GPU per rank)
alive across many calls, so that a test module pays for process start-up and
``init_process_group`` once::

    with Gang(2) as gang:                   # 2 ranks, gloo
        results = gang.run(fn, x, y)        # fn(x, y) on every rank; [result of rank 0, ...]

``fn`` must be a module-level function; its arguments and results are pickled. A worker
imports ``fn``'s module by name when that name imports the same file there, else loads the
file by path (a test module collected by pytest under ``--import-mode=importlib``). Workers
are forked from multiprocessing's fork server, which imports torch once, so a gang starts
in a fraction of a second after the first. As in any multiprocessing program, a script that
starts a gang guards its entry point (``if __name__ == "__main__":``).

Failure handling, the reason this is not ``torch.multiprocessing.spawn`` per call: no
wall-clock timeout decides anything (a loaded machine cannot make a correct run fail).
When a rank raises, or its process dies, the others may be blocked in a collective that
will never complete; the parent, which waits on every rank's result pipe and process at
once, then kills the remaining workers and raises :class:`RankError` carrying the failing
rank's traceback. The gang starts afresh at its next call. A rank that blocks forever
without failing (a real deadlock in the code under test) is not detected; set
``XOPT_GANG_DEBUG_STACKS`` (seconds) to have every worker print its Python stacks after
that long, for debugging only.

A gang with ``backend=None`` starts processes without a process group: the JAX tests use
one worker whose environment holds ``XLA_FLAGS=--xla_force_host_platform_device_count=4``,
which must be set before jax is imported and so cannot be set in a process (pytest's) that
may have imported jax already.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import inspect
import multiprocessing as mp
import os
import re
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import wait
from typing import Any

__all__ = ["Gang", "RankError", "launch"]


class RankError(RuntimeError):
    """A rank raised or died. ``rank``; ``exc_type`` (the name of the exception's class, None
    when the process died) and ``exc_message`` (its ``str``); the message holds the rank's
    traceback (or exit code)."""

    def __init__(self, rank: int, message: str, exc_type: str | None = None,
                 exc_message: str = "") -> None:
        super().__init__(message)
        self.rank, self.exc_type, self.exc_message = rank, exc_type, exc_message


# -- the worker side ----------------------------------------------------------------------------

_MODULES: dict[tuple[str, str], Any] = {}


def _resolve(module: str, path: str, qualname: str) -> Callable[..., Any]:
    """``qualname`` in module ``module`` (imported by name when that name is the file
    ``path`` here, else loaded from ``path``; once per worker)."""
    mod = _MODULES.get((module, path))
    if mod is None:
        spec = None
        if module != "__main__":
            try:
                spec = importlib.util.find_spec(module)
            except (ImportError, ValueError):
                spec = None
        if spec is not None and spec.origin and os.path.samefile(spec.origin, path):
            mod = importlib.import_module(module)
        else:
            name = f"_xopt_gang_{abs(hash(path))}"
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod  # dataclasses and pickling look modules up by name
            spec.loader.exec_module(mod)
        _MODULES[(module, path)] = mod
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker(rank: int, world_size: int, backend: str | None, store_path: str, conn: Any,
            env: Mapping[str, str]) -> None:
    """A worker's main loop: join the process group, then run what the parent sends until
    it sends None (or goes away)."""
    import faulthandler

    os.environ.update(env)
    # A rank killed by a signal (a crash in native code) prints every thread's Python stack.
    faulthandler.enable(all_threads=True)
    stacks = os.environ.get("XOPT_GANG_DEBUG_STACKS")
    if stacks:
        faulthandler.dump_traceback_later(float(stacks), repeat=True)
    try:
        if backend is not None:
            import datetime

            import torch
            import torch.distributed as dist

            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            store = dist.FileStore(store_path, world_size)
            # A failed peer is handled by the parent (it kills the gang), never by this
            # timeout; it is here only because a process group needs one.
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(days=7))
        conn.send(("ready", None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc(), type(e).__name__, str(e)))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        module, path, qualname, args, kwargs = msg
        try:
            result = _resolve(module, path, qualname)(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            conn.send(("error", traceback.format_exc(), type(e).__name__, str(e)))
    if backend is not None:
        import gc

        import torch.distributed as dist

        # FSDP2 modules and hooks form reference cycles that hold tensors and collective
        # work: free them while the interpreter is whole, not during its finalization,
        # where a gloo rank can abort (pytorch/pytorch#179291)
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


# -- the parent side ----------------------------------------------------------------------------

#: how a rank's collective fails when a peer's process went away
_PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Socket closed")
#: how long a peer's lost connection waits for the process behind it to end (bounded only
#: so that a peer that closed its end and lives on cannot stall the caller; the wait is
#: over as soon as that process ends)
_DEATH_GRACE_S = 60.0

_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor",
            "torch.distributed.fsdp", "torch.distributed.checkpoint", "numpy"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (once per process)
    return ctx


class Gang:
    """N worker processes, rank 0 … N−1, in one process group (see the module docstring).

    Args:
      world_size: number of ranks.
      backend: ``"gloo"`` (default), ``"nccl"`` (rank r on GPU r), or None (no process
        group: plain worker processes, e.g. for JAX with forced host devices).
      env: environment variables set in every worker before anything is imported there
        (``OMP_NUM_THREADS`` defaults to 1: the ranks share the machine's cores).
    """

    def __init__(self, world_size: int, backend: str | None = "gloo",
                 env: Mapping[str, str] | None = None) -> None:
        if int(world_size) < 1:
            raise ValueError(f"Gang: world_size must be at least 1, got {world_size}")
        self.world_size = int(world_size)
        self.backend = backend
        self.env = {"OMP_NUM_THREADS": "1", **(env or {})}
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._dir: str | None = None
        atexit.register(self.close)

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the workers (a no-op when they run); :meth:`run` calls it."""
        if self._procs:
            return
        ctx = _context()
        self._dir = tempfile.mkdtemp(prefix="xopt-gang-")
        store = os.path.join(self._dir, "store")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, daemon=True,
                               args=(rank, self.world_size, self.backend, store, child,
                                     self.env))
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect("start-up")

    def close(self) -> None:
        """Stop the workers (they are idle between calls and leave when told to)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=120)  # an idle worker leaves at once; this only bounds a bug
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._reset()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join()
        self._reset()

    def _reset(self) -> None:
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Gang:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- calls -----------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the ranks' results in rank order.

        Raises :class:`RankError` (with the rank's traceback) as soon as a rank raises or
        dies; the other ranks are then killed and the gang starts afresh at its next call."""
        return self.run_per_rank(fn, [(args, kwargs)] * self.world_size)

    def run_per_rank(self, fn: Callable[..., Any],
                     calls: Sequence[tuple[tuple, dict]]) -> list[Any]:
        """As :meth:`run`, with rank r's own ``(args, kwargs)`` in ``calls[r]``."""
        if len(calls) != self.world_size:
            raise ValueError(f"Gang.run_per_rank: {len(calls)} calls for "
                             f"{self.world_size} ranks")
        path = inspect.getsourcefile(fn)
        if path is None or "<locals>" in fn.__qualname__:
            raise ValueError(f"Gang.run: {fn!r} must be a module-level function")
        self.start()
        msg = (fn.__module__, os.path.abspath(path), fn.__qualname__)
        for conn, (args, kwargs) in zip(self._conns, calls, strict=True):
            conn.send((*msg, args, kwargs))
        return self._collect(fn.__qualname__)

    def _await_death(self, pending: set[int]) -> set[int]:
        """The ranks of ``pending`` whose processes end within :data:`_DEATH_GRACE_S`: a
        peer reports a lost connection a moment before the process that closed it is
        reaped (it closes its sockets and pipe one by one as it exits, and a dying process
        may first write a core dump), and that process, not the peer, is the cause."""
        sentinels = {self._procs[r].sentinel: r for r in pending}
        ended = wait(list(sentinels), timeout=_DEATH_GRACE_S)
        return {sentinels[s] for s in ended}

    def _collect(self, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        by_conn = {c: r for r, c in enumerate(self._conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        pending = set(range(self.world_size))
        n = self.world_size
        while pending:
            ready = wait([self._conns[r] for r in pending]
                         + [self._procs[r].sentinel for r in pending])
            errors, dead = [], set()
            ranks = {by_conn.get(o, by_sentinel.get(o)) for o in ready} & pending
            if ranks:
                # A rank that died is the cause of its peers' errors (their collectives then
                # fail with a connection error): by the time a peer has reported one, the
                # dead rank's end of its pipe is usually closed, so every pending pipe is
                # read now, not only those ready above (and _await_death covers the rest).
                ranks = set(pending)
            for rank in sorted(ranks):
                conn = self._conns[rank]
                if not conn.poll():
                    if self._procs[rank].sentinel in ready:
                        dead.add(rank)
                    continue
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    dead.add(rank)
                    continue
                if msg[0] == "error":
                    errors.append((rank, msg))
                else:
                    results[rank] = msg[1]
                pending.discard(rank)
            if not dead and not errors:
                continue
            if errors and not dead and any(_PEER_LOST.search(m[3]) for _, m in errors):
                dead = self._await_death(pending)
            dead = sorted(dead)
            for r in dead:
                self._procs[r].join()
            codes = {r: self._procs[r].exitcode for r in dead}
            self._kill()
            also = "".join(f"\n(rank {r} then failed: {m[2]}: {m[3]})" for r, m in errors)
            if dead:
                r = dead[0]
                raise RankError(r, f"rank {r} of {n} died in {what} (exit code {codes[r]}) "
                                   f"without a result{also}")
            (r, msg), rest = errors[0], errors[1:]
            also = "".join(f"\n(rank {r2} also failed: {m[2]}: {m[3]})" for r2, m in rest)
            raise RankError(r, f"rank {r} of {n} failed in {what}:\n{msg[1]}{also}", msg[2],
                            msg[3])
        return [results[r] for r in range(self.world_size)]


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = "gloo",
           env: Mapping[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """``fn(*args, **kwargs)`` once on ``world_size`` fresh ranks (a :class:`Gang` of one
    call); the ranks' results in rank order."""
    with Gang(world_size, backend, env) as gang:
        return gang.run(fn, *args, **kwargs)
