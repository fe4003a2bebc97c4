"""A learned optimizer's step recorded once into a CUDA graph and replayed.

A step of the fused kernels is a few dozen launches and small torch ops whose host cost
(Python, the launchers, the allocator) is about a millisecond per step: it shows in the
step time whenever the GPU waits for the host. Recorded into a CUDA graph, the step costs
the host one replay. What the recording reads must then stay at fixed addresses: static
device buffers (pointer and scalar tables, counters) updated by copies before the replay
(:func:`copy_in`), and the tensors the body reads (layout tables, weights, θ) held by the
recorder and compared by identity; when one of them is not the one recorded, the step is
recorded again.

:class:`StepGraph` is the recorder; the method's Triton step calls :meth:`StepGraph.run`
with its body (a callable that only queues device work, with no host→device copy) and
the objects the body reads. Eager (the body is called as is) on the CPU (the
interpreter), while the caller is itself recording a graph, after a failed recording, and
with ``XOPT_LOPT_CUDA_GRAPHS=0``.
"""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Callable, Sequence

import torch

__all__ = ["NPTR", "StepGraph", "StepTables", "copy_in", "graphs_enabled"]

#: pointer table columns: p, g, m, rms, v_row, v_col, v_diag, out
NPTR = 8


def graphs_enabled() -> bool:
    """``XOPT_LOPT_CUDA_GRAPHS`` is not ``"0"`` (read at each recorder's creation)."""
    return os.environ.get("XOPT_LOPT_CUDA_GRAPHS", "1") != "0"


def copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` without blocking the host: a host tensor goes to a CUDA ``dst``
    through pinned memory (a fresh pinned block each time: the caching host allocator keeps
    it until the copy has run, so a copy still queued never sees it change)."""
    if src.device.type == "cpu" and dst.device.type == "cuda":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


class StepGraph:
    """Records a step body into a CUDA graph once and replays it while the objects it
    reads are the ones recorded.

    ``name``: the optimizer's name, for the warning when a recording fails (the step then
    runs eagerly from then on). ``recordings`` counts the recordings (tests read it)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.enabled = graphs_enabled()
        self.recordings = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._refs: tuple = ()
        self._key = None
        self._stream: torch.cuda.Stream | None = None

    def active(self, device: torch.device) -> bool:
        """Whether a step on ``device`` is recorded or replayed (else it runs eagerly)."""
        return (self.enabled and device.type == "cuda"
                and not torch.cuda.is_current_stream_capturing())

    def _same(self, refs: Sequence, key) -> bool:
        return (self._graph is not None and key == self._key and len(refs) == len(self._refs)
                and all(map(operator.is_, self._refs, refs)))

    def run(self, body: Callable[[], None], refs: Sequence, device: torch.device,
            key=None) -> None:
        """One step: ``body()`` eagerly when not :meth:`active`; else the replay of its
        recording when every object of ``refs`` is (``is``) the one recorded and ``key``
        equals the recorded one (values the body bakes in, e.g. pointers and versions), else
        ``body`` eagerly on a side stream (this step's result, and the recording's warm-up)
        and then recorded (not run) for the next steps. ``refs`` are held while the graph
        lives, so that no address the graph holds is reused by another tensor."""
        if not self.active(device):
            body()
            return
        refs = tuple(refs)
        if self._same(refs, key):
            self._graph.replay()
            return
        self._graph, self._refs, self._key = None, (), None  # (frees the old graph's memory)
        cur = torch.cuda.current_stream(device)
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        s = self._stream
        s.wait_stream(cur)
        graph: torch.cuda.CUDAGraph | None
        with torch.cuda.stream(s):
            body()  # this step, eagerly (also the warm-up of the recording)
            graph = torch.cuda.CUDAGraph()
            try:
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    body()  # recorded, not run
                finally:
                    graph.capture_end()
            except Exception as e:  # noqa: BLE001  (eager from now on; this step is done)
                self.enabled = False
                warnings.warn(f"{self.name}(impl='triton'): recording the step into a CUDA "
                              f"graph failed ({type(e).__name__}: {e}); running it eagerly",
                              RuntimeWarning, stacklevel=3)
                graph = None
        cur.wait_stream(s)
        if graph is not None:
            self._graph, self._refs, self._key = graph, refs, key
            self.recordings += 1


class StepTables:
    """The static device tables a learned optimizer's Triton step reads (and its recording
    holds): ``ptrs``, int64 ``[n, NPTR]`` (per tensor: p, g, m, rms, v_row, v_col, v_diag
    and the output's addresses), and ``scal``, float32 ``[n, width]`` (lr, lr·λ,
    write_step, then zeros).

    They stay at fixed addresses while the tensor count and the device do; their rows are
    rebuilt on the host and copied in (:func:`copy_in`) only where they changed. With the
    optimizer's :class:`xopt.torch._lopt.TritonIO`, nothing is read per tensor while its
    version is the one the tables hold (:meth:`current`)."""

    def __init__(self, width: int) -> None:
        if width < 3:
            raise ValueError(f"StepTables: width {width} < 3 (lr, lr·λ, write_step)")
        self.width = width
        self.ptrs: torch.Tensor | None = None
        self.scal: torch.Tensor | None = None
        self._ptr_rows: torch.Tensor | None = None  # their host copies (skip equal copies)
        self._scal_rows: torch.Tensor | None = None
        self._key: tuple | None = None  # (TritonIO version, device) the tables hold

    def current(self, io, dev: torch.device) -> bool:  # noqa: ANN001
        """Whether the tables already hold ``io``'s lists on ``dev``."""
        return io is not None and self._key == (io.version, dev) and self.ptrs is not None

    def update(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               states: Sequence[dict], outs: Sequence[torch.Tensor],
               write_step: Sequence[bool], lrs: Sequence[float], lrwds: Sequence[float],
               dev: torch.device, io=None) -> None:  # noqa: ANN001
        """The rows for these tensors (the pointers from ``io``'s columns when given),
        copied in where they changed."""
        nt = len(params)
        if io is not None:  # the pointers by column, as the optimizer keeps them
            c = io.ptrs
            prow = torch.tensor([c["p"], c["g"], c["m"], c["rms"], c["v_row"], c["v_col"],
                                 c["v_diag"], c["p"]], dtype=torch.int64).t().contiguous()
        else:
            prow = torch.tensor([
                [p.data_ptr(), g.data_ptr(), s["m"].data_ptr(), s["rms"].data_ptr(),
                 s["v_row"].data_ptr(), s["v_col"].data_ptr(), s["v_diag"].data_ptr(),
                 o.data_ptr()] for p, g, s, o in zip(params, grads, states, outs, strict=True)],
                dtype=torch.int64).reshape(nt, NPTR)
        pad = [0.0] * (self.width - 3)
        srow = torch.tensor([[float(lr), float(lrwd), float(ws), *pad] for lr, lrwd, ws in
                             zip(lrs, lrwds, write_step, strict=True)],
                            dtype=torch.float32).reshape(nt, self.width)
        if self.ptrs is None or self.ptrs.shape[0] != nt or self.ptrs.device != dev:
            self.ptrs = torch.empty((nt, NPTR), dtype=torch.int64, device=dev)
            self.scal = torch.empty((nt, self.width), dtype=torch.float32, device=dev)
            self._ptr_rows = self._scal_rows = None
        if self._ptr_rows is None or not torch.equal(prow, self._ptr_rows):
            copy_in(self.ptrs, prow)
            self._ptr_rows = prow
        if self._scal_rows is None or not torch.equal(srow, self._scal_rows):
            copy_in(self.scal, srow)
            self._scal_rows = srow
        self._key = (io.version, dev) if io is not None else None
