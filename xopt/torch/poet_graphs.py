"""Eager POETLinear calls replayed from CUDA graphs (``POETLinear(cuda_graphs=True)``).

An eager POET-X forward+backward issues about twenty kernel launches and is paced by the
host, not the GPU (bench/RESULTS.md, "The POET-X layer"). A graphed layer captures, per
input signature, its chain between the two permutation gathers (the Cayley–Neumann
series, the block rotations, the product with ``W0``; forward and backward) in two CUDA
graphs, and then runs each call as

    forward:  gather x → static x1 (eager) · replay the forward graph · gather the rotated
              output → a fresh tensor (eager)
    backward: gather the cotangent → a static buffer (eager) · replay the backward graph ·
              gather the input's gradient → a fresh tensor (eager)

The gathers outside the graphs are the layer's own first and last operations, so nothing
is copied in or out that the eager layer does not move (as
``torch.cuda.make_graphed_callables`` would: a copy into a static input, an output that the
next call overwrites); the outputs and the input's gradient are fresh tensors, and the
graphs compute what :func:`xopt.torch.poet._core_forward`/``_core_backward`` compute
eagerly, kernel for kernel: the results are the eager layer's, bit for bit.

Caching and invalidation, per layer: graphs are keyed by the input's shape, dtype and
device, the CNP settings and the float32 matmul precision flags, and (the backward graph)
by which of ``x``, ``oft_R``, ``bias`` need a gradient. The graphs read the layer's tensors
(``oft_R``, ``weight``, ``bias``, the permutations, POET-XQ's scales) by address: updates
in place (optimizer steps, merges, ``set_w0``, ``set_permutations``, ``load_state_dict``)
are seen by the next replay; a tensor replaced by another (``.to()``, ``p.data = ...``,
``load_state_dict(assign=True)``) drops every graph of the layer, and the signature is
captured afresh. A signature is captured at its second call (the first runs eagerly and
compiles the kernels), after one warm-up on a side stream; at most
:data:`MAX_SIGNATURES` per layer, further ones run eagerly.

A call runs eagerly (the ordinary path, the same results) where a graph cannot honour it:
not on CUDA, on a device other than the current one, or not on the triton path, under
autocast (a layer's own calls come with it off: :class:`~xopt.torch.poet.POETLinear`
runs in autocast's dtype with autocast off, and those calls are served), while
``torch.compile`` traces (the layer is then an operator in the compiled graph) or a CUDA
graph is being captured (the layer
inside a graph of the caller's), DTensor (FSDP2) parameters, an empty input, a
signature's first call, and while the layer's previous graphed call still awaits its
backward (its saved activations live in the graph's buffers: a second call of the same
layer in one forward, activation checkpointing's recomputation, a no_grad call in
between). Grad mode and no_grad share a signature (a no_grad call replays the forward
graph alone); the input's strides do not matter (the first gather reads any). A backward
through a graphed call after a later call of the same layer replayed over its saved
activations (``retain_graph=True`` and another backward after another forward) raises;
the gradients are not differentiable further (``create_graph=True``), as the eager
layer's are not.

Memory: each signature keeps the gathered input ``x1`` and, for ``variant="fast"``, ``y1``
(what the eager layer keeps until its backward) between calls, and the graphs' private
pools (the series' blocks and temporaries, the gradients of ``oft_R`` and the bias); the
transient ``N × width`` buffers (rotated activations, cotangents, the mem variant's
``y1``) are shared by every graphed layer of the same shape and dtype on the device, so
that the calls of graphed layers must run on one stream at a time. The layers do not
share one graph pool: a tensor one graph keeps (``y1``) could then lie in memory another
graph uses for its temporaries, and replays in another order than the captures would
overwrite it.
:func:`clear` frees a layer's graphs; :func:`stats` counts captures, replays and eager
calls.

The capture itself is behind :data:`BACKEND` (:class:`CudaGraphs`): a test substitutes one
that runs on the CPU (tests/test_poet_graphs.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["BACKEND", "MAX_SIGNATURES", "CudaGraphs", "clear", "stats"]

#: signatures captured per layer; calls of further signatures run eagerly
MAX_SIGNATURES = 4


class CudaGraphs:
    """Capture and replay through ``torch.cuda.CUDAGraph``: warm-up and capture on one
    side stream per device (one cuBLAS workspace for all the captures)."""

    def __init__(self):
        self.streams: dict = {}

    def available(self, device: torch.device) -> bool:
        """Whether a call on ``device`` may capture or replay now: a CUDA device, the
        current one (a replay runs on the current device's stream), not capturing."""
        return (device.type == "cuda" and device.index == torch.cuda.current_device()
                and not torch.cuda.is_current_stream_capturing())

    def capture(self, fn: Callable[[], tuple], reads: Sequence[Tensor],
                device: torch.device) -> tuple[tuple, Callable[[], None]]:
        """``fn``'s outputs, captured on ``device`` once after one warm-up call on a side
        stream (which compiles, picks cuBLAS's algorithms and sets up the stream's
        workspace), and the replay. ``reads``: the tensors the graph reads by address
        (unused here; a test's backend checks that they are unchanged at each replay)."""
        with torch.cuda.device(device):
            side = self.streams.get(device)
            if side is None:
                side = self.streams[device] = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                outputs = fn()
        return outputs, graph.replay


#: the capture backend (a test substitutes its own)
BACKEND: Any = CudaGraphs()

class _Token:
    """Owned by one graphed call's autograd context: alive while its backward may run."""

    __slots__ = ("__weakref__",)


class _Entry:
    """One signature's graphs and the buffers they read and write."""

    __slots__ = ("bufs", "bwd", "fwd", "fwd_out", "owner", "pending", "x1")

    def __init__(self):
        self.bwd: dict[tuple, tuple] = {}  # needs -> (outputs, replay)
        self.owner = None  # weakref to the token of the call whose activations x1/y1 hold
        self.pending = False  # that call's backward has not run yet


class _LayerGraphs:
    __slots__ = ("entries", "ids", "seen", "stats")

    def __init__(self):
        self.entries: dict[tuple, _Entry] = {}
        self.seen: dict[tuple, int] = {}
        self.ids: tuple | None = None
        self.stats: dict[str, int] = {"captures": 0, "replays": 0, "eager": 0}


#: layer -> its graphs (weak keys: a deleted layer frees them; a copied or pickled layer
#: carries none)
_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: (device, dtype, rows, width, role) -> a transient buffer shared by the graphed layers
_SCRATCH: dict[tuple, Tensor] = {}


def _scratch(device, dtype, rows: int, width: int, role: str) -> Tensor:
    key = (device, dtype, rows, width, role)
    t = _SCRATCH.get(key)
    if t is None:
        t = _SCRATCH[key] = torch.zeros((rows, width), dtype=dtype, device=device)
    return t


def _layers(module) -> list:
    from xopt.torch.poet import POETLinear

    return [m for m in module.modules() if isinstance(m, POETLinear)]


def stats(module) -> dict[str, int]:
    """``{"captures", "replays", "eager"}`` summed over ``module``'s POET layers: how many
    signatures they captured, how many calls (forward or backward) replayed a graph, how
    many graph-enabled calls ran eagerly."""
    out = {"captures": 0, "replays": 0, "eager": 0}
    for layer in _layers(module):
        st = _GRAPHS.get(layer)
        for k in out:
            out[k] += st.stats[k] if st is not None else 0
    return out


def clear(module) -> None:
    """Free the graphs and buffers of ``module``'s POET layers (their next calls capture
    afresh; buffers shared with other layers' graphs stay while those graphs live)."""
    for layer in _layers(module):
        _GRAPHS.pop(layer, None)
    live = {id(t) for st in _GRAPHS.values() for e in st.entries.values()
            for t in e.bufs.values()}
    for k in [k for k, t in _SCRATCH.items() if id(t) not in live]:
        del _SCRATCH[k]


def _reads(layer) -> list[Tensor]:
    ts = [layer.oft_R, layer.weight, layer.perm_in, layer.perm_in_inv, layer.perm_out,
          layer.perm_out_inv]
    if layer.bias is not None:
        ts.append(layer.bias)
    if layer.quantized:
        ts += [layer.weight_scales, layer.weight_zeros]
    return ts


def forward(layer, x: Tensor, cnp: tuple) -> Tensor | None:
    """``layer(x)`` through its graphs, or None where they cannot serve this call (the
    caller then runs the eager path; module docstring)."""
    from xopt.torch.distributed import is_dtensor

    dev = x.device
    st = _GRAPHS.get(layer)
    if st is None:
        st = _GRAPHS[layer] = _LayerGraphs()
    if (not BACKEND.available(dev) or x.numel() == 0 or torch.compiler.is_compiling()
            or torch.is_autocast_enabled(dev.type) or is_dtensor(layer.oft_R)):
        st.stats["eager"] += 1
        return None
    reads = _reads(layer)
    ids = tuple(t.data_ptr() for t in reads)
    if ids != st.ids:  # a tensor the graphs read was replaced: drop them all
        st.entries.clear()
        st.seen.clear()
        st.ids = ids
    bias = layer.bias
    grad = torch.is_grad_enabled() and (
        x.requires_grad or layer.oft_R.requires_grad or (bias is not None and bias.requires_grad))
    mm = torch.backends.cuda.matmul
    key = (tuple(x.shape), x.dtype, dev, cnp, mm.allow_tf32,
           mm.allow_bf16_reduced_precision_reduction)
    entry = st.entries.get(key)
    if entry is None:
        if len(st.seen) > 64:  # (inputs of ever new shapes: count afresh)
            st.seen.clear()
        seen = st.seen.get(key, 0) + 1
        st.seen[key] = seen
        if seen < 2 or len(st.entries) >= MAX_SIGNATURES:
            st.stats["eager"] += 1
            return None
        entry = st.entries[key] = _capture_forward(layer, x, cnp, reads)
        st.stats["captures"] += 1
    if entry.pending and entry.owner is not None and entry.owner() is not None:
        st.stats["eager"] += 1  # (the last graphed call awaits its backward)
        return None
    needs = (x.requires_grad, layer.oft_R.requires_grad,
             bias is not None and bias.requires_grad) if grad else None
    if grad and needs not in entry.bwd:
        entry.bwd[needs] = _capture_backward(layer, entry, needs, reads)
    st.stats["replays"] += 1
    if not grad:
        # x1/y1 no longer hold an earlier call's activations
        entry.owner, entry.pending = None, False
        return _run_forward(layer, entry, x)
    return _Graphed.apply(x, layer.oft_R, bias, (layer, entry, needs, st))


def _run_forward(layer, entry: _Entry, x: Tensor) -> Tensor:
    from xopt.torch.poet import _gather

    shape = x.shape
    x2d = x.reshape(-1, shape[-1]) if x.dim() != 2 else x
    _gather(x2d, layer.perm_in_inv, True, out=entry.x1)
    entry.fwd()
    y = _gather(entry.fwd_out[0], layer.perm_out, True)
    return y if len(shape) == 2 else y.reshape(*shape[:-1], y.shape[-1])


class _Graphed(torch.autograd.Function):
    """One graphed call: the forward graph between two eager gathers, and the backward
    graph likewise. The differentiable inputs are ``x``, ``oft_R`` and ``bias``."""

    @staticmethod
    def forward(ctx, x, oft, bias, k):
        layer, entry, needs, st = k
        y = _run_forward(layer, entry, x)
        token = _Token()
        entry.owner, entry.pending = weakref.ref(token), True
        ctx.token, ctx.k, ctx.shape = token, k, x.shape
        return y

    @staticmethod
    def backward(ctx, g):
        from xopt.torch.poet import _gather

        dev = g.device.type
        if torch.is_autocast_enabled(dev):  # (a backward inside autocast: as the eager chain)
            with torch.autocast(dev, enabled=False):
                return _Graphed.backward(ctx, g)
        layer, entry, needs, st = ctx.k
        if entry.owner is None or entry.owner() is not ctx.token:
            raise RuntimeError(
                "POETLinear(cuda_graphs=True): this call's saved activations were replaced by "
                "a later call of the same layer (a second backward with retain_graph=True "
                "after another forward); use cuda_graphs=False for such graphs")
        outs, replay = entry.bwd[needs]
        g2d = g.reshape(-1, g.shape[-1]) if g.dim() != 2 else g
        _gather(g2d, layer.perm_out_inv, True, out=entry.bufs["g2"])
        replay()
        st.stats["replays"] += 1
        entry.pending = False
        gx1, grad_r, grad_bias = outs
        gx = None
        if gx1 is not None:
            gx = _gather(gx1, layer.perm_in, True)
            if len(ctx.shape) != 2:
                gx = gx.reshape(ctx.shape)
        return gx, grad_r, grad_bias, None


def _chain_args(layer, dtype: torch.dtype) -> tuple:
    """What the chain reads of the layer: the weight (its cast to ``dtype``, if any, made
    inside the graph as the eager layer makes it per call) and POET-XQ's tuple."""
    wq = layer._wq()
    if wq is not None:
        return layer.weight, (*wq, True, dtype in (torch.bfloat16, torch.float16))
    return layer.weight, None


def _capture_forward(layer, x: Tensor, cnp: tuple, reads: list[Tensor]) -> _Entry:
    from xopt.torch.poet import _core_forward

    entry = _Entry()
    dev, dt = x.device, x.dtype
    rows = x.numel() // x.shape[-1]
    n_in, n_out = layer.in_features, layer.out_features
    entry.x1 = torch.zeros((rows, n_in), dtype=dt, device=dev)
    entry.bufs = {role: _scratch(dev, dt, rows, width, role)
                  for role, width in (("x2", n_in), ("yr", n_out), ("g2", n_out),
                                      ("gy1", n_out), ("gx2", n_in), ("gx1", n_in),
                                      ("y1", n_out))}
    # the tensors as they are now: the graph reads these storages (a later replacement of
    # a parameter's data leaves them alive, so that their addresses are not reused)
    oft, bias = layer.oft_R.detach(), None if layer.bias is None else layer.bias.detach()
    weight, wq = _chain_args(layer, dt)
    weight = weight.detach()
    keep_y1 = layer.variant == "fast"
    nb_out = layer.num_out_blocks

    def fn():
        with torch.no_grad():
            w = weight if wq is not None or weight.dtype == dt else weight.to(dt)
            return _core_forward(entry.x1, oft, bias, nb_out, w, wq, cnp, dt, keep_y1,
                                 {k: entry.bufs[k] for k in ("x2", "yr", "y1")})

    entry.fwd_out, entry.fwd = BACKEND.capture(fn, reads, dev)
    return entry


def _capture_backward(layer, entry: _Entry, needs: tuple, reads: list[Tensor]) -> tuple:
    from xopt.torch.poet import _core_backward

    dt = entry.x1.dtype
    _, r, y1, cnp_saved, cnp_ctx = entry.fwd_out
    bias = None if layer.bias is None else layer.bias.detach()
    weight, wq = _chain_args(layer, dt)
    weight = weight.detach()
    nb_out = layer.num_out_blocks
    bufs = {k: entry.bufs[k] for k in ("x2", "y1", "gy1", "gx2", "gx1")}
    if wq is not None:
        bufs.pop("gx2")  # (the quantised product writes its own result)

    def fn():
        with torch.no_grad():
            w = weight if wq is not None or weight.dtype == dt else weight.to(dt)
            return _core_backward(entry.bufs["g2"], entry.x1, y1, r, w, bias, wq, nb_out,
                                  needs, cnp_ctx, cnp_saved, bufs)

    return BACKEND.capture(fn, reads, entry.x1.device)
