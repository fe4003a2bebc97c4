"""POET-X in PyTorch: the ``POETLinear`` layer, a model converter, merges, ``POETAdamW``.

The layer computes :mod:`xopt.specs.poet`'s forward input-centrically (two gathers, two
batched block products and one matmul with the fixed ``W0``; ``W_eff`` is never formed).

* ``variant="fast"``: keeps the gathered input ``x1 = x[π_in⁻¹]`` and the pre-rotation
  activation ``y1`` for the backward (what autograd would keep; no re-gather in the
  backward); the plain path lets autograd keep what it keeps: it is the reference;
* ``variant="mem"``: keeps only ``x`` and recomputes ``y1 = (x R_in) W0ᵀ`` in the
  backward (one more large matmul, ``N × d_out`` less activation memory).

``impl="plain"`` is PyTorch ops only (CPU and the parity reference); ``impl="triton"``
uses the Cayley–Neumann kernels (or their batched-matmul backend) and the permutation
kernels of
:mod:`xopt.kernels.poet_cayley` and :mod:`xopt.kernels.poet_perm`, with the block products
as strided batched matmuls that read and write the ``(N, width)`` activations in place
(no transposed copies); ``"auto"`` (default) picks triton on CUDA when it is importable.
The rotations are evaluated in float32 and cast to the layer's dtype, except on the triton
path of a bf16/fp16 layer whose ``oft_R`` has that dtype: there the series runs in it
(bf16 operands, float32 accumulation; :mod:`xopt.kernels.poet_cayley`), no casts.

Under ``torch.compile`` of a model the triton path is two custom operators
(``xopt::poet_chain`` and its backward, with fake implementations): one graph for the
model, one opaque call per layer call running the eager kernels (the eager bits, no
recompilation per layer shape; :func:`batch_rotations`' series as ``xopt::poet_blocks``).
The plain path runs eagerly behind a graph break per call (autograd is
its reference backward). Under autocast the layer runs in autocast's dtype with autocast
off, as for an input of that dtype.

Merging: :meth:`POETLinear.merge_and_reset` folds the rotations into ``W0``, draws new
permutations and zeroes ``oft_R``; :func:`merge_and_reset` does every layer of a model;
drive it from the training loop (:class:`MergeEvery`) or let :class:`POETAdamW` do it
(``model=``). POETAdamW resets the rotations' moments at the start of the first update
after each merge boundary, as the authors' optimizer does.
"""

from __future__ import annotations

import itertools
import math
import operator
import os
import sys
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from xopt import random as xrandom
from xopt.errors import HyperparameterError, StateError
from xopt.registry import register
from xopt.specs import poet as spec
from xopt.torch._optim import Item, Layout, Optimizer
from xopt.torch.distributed import Layout as ShardLayout
from xopt.torch.distributed import aligned_locals, data_parallel_ranks, is_dtensor, whole

__all__ = ["DevicePermutation", "MergeEvery", "POETAdamW", "POETLinear", "batch_rotations",
           "convert", "merge_and_reset", "permutations_on_device", "poet_param_groups"]


def _triton_ok(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# -- the chain: gathers and block products --------------------------------------------------


_perm = None  # xopt.kernels.poet_perm once the triton path has run (imported on first use)


def _gather(x: Tensor, idx: Tensor, triton_path: bool, out: Tensor | None = None) -> Tensor:
    global _perm
    if triton_path:
        if _perm is None:
            from xopt.kernels import poet_perm as _perm
        return _perm.gather(x, idx, out)
    if out is not None:
        return torch.index_select(x, -1, idx, out=out)
    return x.index_select(-1, idx)


def _rows(x2d: Tensor, nb: int, b: int, transpose: bool = False) -> Tensor:
    """``x2d`` ``(N, nb·b)`` seen as ``(nb, N, b)`` (``transpose``: ``(nb, b, N)``), block
    ``j``'s columns of every row, with ``x2d``'s row stride: one ``as_strided`` instead of a
    view and a transpose (each a host call of a few µs)."""
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    n, s0 = x2d.shape[0], x2d.stride(0)
    if transpose:
        return x2d.as_strided((nb, b, n), (b, 1, s0))
    return x2d.as_strided((nb, n, b), (b, s0, 1))


def _rotate(x2d: Tensor, r: Tensor, transpose: bool = False, lo: int = 0,
            nb: int | None = None, out: Tensor | None = None) -> Tensor:
    """``x[:, block j] · r[j]`` (or ``· r[j]ᵀ``) for ``x`` of shape ``(N, nb·b)``, with the
    blocks ``r[lo:lo + nb]`` (default: all of ``r``).

    A strided batched matmul over the ``nb`` blocks: the ``(nb, N, b)`` views of input and
    output have row stride ``nb·b``, which cuBLAS takes as the leading dimension, so
    nothing is transposed in memory. Returns a contiguous ``(N, nb·b)`` tensor (``out``,
    a contiguous one to write into, outside autograd)."""
    n, width = x2d.shape
    b = r.shape[1]
    nb = r.shape[0] - lo if nb is None else nb
    if torch.is_grad_enabled() and (x2d.requires_grad or r.requires_grad):
        # autograd (the plain fast path) cannot record out=; the result is the same
        rr = r[lo:lo + nb]
        rr = rr.transpose(1, 2) if transpose else rr
        xv = x2d.view(n, nb, b).transpose(0, 1)
        return torch.bmm(xv, rr).transpose(0, 1).reshape(n, nb * b)
    if not r.is_contiguous():
        r = r.contiguous()
    # the blocks (transposed) as one view: no slice, no transpose
    rr = r.as_strided((nb, b, b), (b * b, 1, b) if transpose else (b * b, b, 1),
                      r.storage_offset() + lo * b * b)
    if out is not None:
        torch.bmm(_rows(x2d, nb, b), rr, out=out.as_strided((nb, n, b), (b, width, 1)))
        return out
    out = torch.empty_strided((nb, n, b), (b, width, 1), dtype=x2d.dtype, device=x2d.device)
    torch.bmm(_rows(x2d, nb, b), rr, out=out)
    return out.as_strided((n, width), (width, 1))


def _outer(a2d: Tensor, g2d: Tensor, nb: int, out: Tensor | None = None) -> Tensor:
    """``Σ_n a[n, block j]ᵀ g[n, block j]`` per block: ``(nb, b, b)`` (into ``out``)."""
    b = a2d.shape[1] // nb
    av, gv = _rows(a2d, nb, b, transpose=True), _rows(g2d, nb, b)
    if out is None:
        return torch.bmm(av, gv)
    return torch.bmm(av, gv, out=out)


class _Chain(torch.autograd.Function):
    """``y = (blockrot(x[π_in⁻¹], R_in) W0ᵀ + bias → blockrot(·, R_out))[π_out]`` with an
    explicit backward; ``keep_y1`` selects fast (keep the gathered input ``x1`` and ``y1``)
    or mem (keep ``x``; re-gather ``x1`` and recompute ``y1``). ``r`` is the stack of the
    ``n_out`` output blocks and then the input blocks (one tensor: one cast, one gradient).

    ``cnp``: ``None`` (``r`` holds the blocks), or ``(b, formula, tf32, dtype, backend)``:
    then ``r`` is ``oft_R`` and the Cayley–Neumann blocks are made here and differentiated
    here (:func:`xopt.kernels.poet_cayley.blocks_forward`/``blocks_backward``): one autograd
    node for the whole layer, fewer launches on the host.

    The differentiable inputs are ``x``, ``r`` and ``bias``; the rest comes as one tuple
    ``k = (n_out, weight, perm_in, perm_in_inv, perm_out, perm_out_inv, keep_y1,
    triton_path, cnp, wq)`` (``weight`` is frozen): ``apply`` handles each argument on the
    host, per call."""

    @staticmethod
    def forward(ctx, x, r, bias, k):
        (n_out, weight, perm_in, perm_in_inv, perm_out, perm_out_inv, keep_y1, triton_path,
         cnp, wq) = k
        shape = x.shape
        # POET-XQ: W0 held as codes; the triton path dequantises inside the products
        # (xopt.kernels.poet_qmm), the plain path into a temporary float W0 per product
        tf32 = bool(cnp is not None and cnp[2])
        ctx.wq = (*wq, triton_path, tf32) if wq is not None else None
        x2d = x.reshape(-1, shape[-1]) if x.dim() != 2 else x
        x1 = _gather(x2d, perm_in_inv, triton_path)
        yr, r, y1, cnp_saved, ctx.cnp = _core_forward(x1, r, bias, n_out, weight, ctx.wq, cnp,
                                                      x.dtype, keep_y1)
        y = _gather(yr, perm_out, triton_path)
        del yr
        if keep_y1:  # fast: the backward needs x1 and y1, keep them (no re-gather)
            ctx.save_for_backward(x1, r, weight, bias, perm_in, perm_in_inv, perm_out_inv, y1,
                                  *cnp_saved)
        else:
            del x1
            ctx.save_for_backward(x2d, r, weight, bias, perm_in, perm_in_inv, perm_out_inv,
                                  None, *cnp_saved)
        ctx.flags = (keep_y1, triton_path, shape, n_out)
        return y if len(shape) == 2 else y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, g):
        dev = g.device.type
        if torch.is_autocast_enabled(dev):  # (a backward called inside autocast)
            with torch.autocast(dev, enabled=False):
                return _Chain.backward(ctx, g)
        xs, r, weight, bias, perm_in, perm_in_inv, perm_out_inv, y1, *cnp_saved = \
            ctx.saved_tensors
        keep_y1, triton_path, shape, n_out = ctx.flags
        if ctx.wq is not None and not ctx.wq[3]:  # plain POET-XQ: one temporary W0
            weight, wq = _dequantize(weight, ctx.wq[:3], g.dtype), None
        else:
            wq = ctx.wq
        g2d = g.reshape(-1, g.shape[-1]) if g.dim() != 2 else g
        # mem: re-gather x1 (the core recomputes y1); the gathered tensors passed inline,
        # so that the core frees them as soon as it is done with them, and the cotangent's
        # gather made after the recomputation (at most two activations at once)
        gx1, grad_r, grad_bias = _core_backward(
            lambda: _gather(g2d, perm_out_inv, triton_path),
            xs if keep_y1 else _gather(xs, perm_in_inv, triton_path), y1, r, weight, bias,
            wq, n_out, ctx.needs_input_grad, ctx.cnp, cnp_saved)
        gx = None
        if gx1 is not None:
            gx = _gather(gx1, perm_in, triton_path)
            if len(shape) != 2:
                gx = gx.reshape(shape)
        return gx, grad_r, grad_bias, None


def _core_forward(x1: Tensor, r: Tensor, bias: Tensor | None, n_out: int, weight: Tensor,
                  wq: tuple | None, cnp: tuple | None, dtype: torch.dtype, keep_y1: bool,
                  bufs: dict | None = None) -> tuple:
    """The layer's forward between its two gathers (no autograd): from the gathered input
    ``x1`` to the rotated output ``yr`` (before ``π_out``). Returns ``(yr, r, y1, cnp_saved,
    cnp_ctx)``: ``r`` the blocks in ``dtype`` (``cnp``: made here from ``oft_R``), ``y1``
    (fast) or None (mem), what :func:`_core_backward` needs of the series. ``bufs``
    (the CUDA-graph path, :mod:`xopt.torch.poet_graphs`): ``"x2"``, ``"yr"`` and (mem)
    ``"y1"`` tensors to write the transients into."""
    bufs = bufs or {}
    cnp_saved, cnp_ctx = (), None
    if cnp is not None:
        from xopt.kernels import poet_cayley

        b, formula, tf32, cd, backend = cnp
        oft_dtype = r.dtype
        r, cnp_saved = poet_cayley.blocks_forward(r, b, formula, tf32, backend, cd)
        if r.dtype != dtype:
            r = r.to(dtype)
        cnp_ctx = (b, formula, tf32, backend, oft_dtype)
    r = r.contiguous()
    x2 = _rotate(x1, r, lo=n_out, out=bufs.get("x2"))  # (the blocks r[n_out:] = R_in)
    # x2 · W0ᵀ (mm; one host call); mem's y1 is a transient
    y1 = _mm_wt(x2, weight, wq, None if keep_y1 or wq is not None else bufs.get("y1"))
    del x2
    if bias is not None:
        y1 += bias
    yr = _rotate(y1, r, nb=n_out, out=bufs.get("yr"))  # (r[:n_out] = R_out)
    return yr, r, (y1 if keep_y1 else None), cnp_saved, cnp_ctx


def _core_backward(g2: Tensor | Callable[[], Tensor], x1: Tensor, y1: Tensor | None,
                   r: Tensor, weight: Tensor, bias: Tensor | None, wq: tuple | None,
                   n_out: int, needs: Sequence[bool], cnp_ctx: tuple | None,
                   cnp_saved: Sequence[Tensor], bufs: dict | None = None) -> tuple:
    """The layer's backward between its two gathers: ``(gx1, grad_r, grad_bias)`` from the
    gathered cotangent ``g2`` (or a function making it, called after the mem variant's
    recomputation; ``needs``: which of x, r, bias need a gradient; ``y1`` None: recomputed
    from ``x1``, the mem variant). ``bufs``: ``"x2"``, ``"y1"`` (mem), ``"gy1"``, ``"gx2"``,
    ``"gx1"`` tensors to write the transients into (as :func:`_core_forward`)."""
    bufs = bufs or {}
    if y1 is None:  # mem: recompute y1, holding at most two activations at once
        x2 = _rotate(x1, r, lo=n_out, out=bufs.get("x2"))
        y1 = _mm_wt(x2, weight, wq, None if wq is not None else bufs.get("y1"))
        del x2
        if bias is not None:
            y1 += bias
    if callable(g2):
        g2 = g2()
    grad_r = torch.empty_like(r) if needs[1] else None
    if grad_r is not None:
        _outer(y1, g2, n_out, out=grad_r[:n_out])
    del y1
    gy1 = _rotate(g2, r, transpose=True, nb=n_out, out=bufs.get("gy1"))
    del g2
    grad_bias = gy1.sum(0) if bias is not None and needs[2] else None
    gx2 = _mm_w(gy1, weight, wq, out=bufs.get("gx2"))
    del gy1
    if grad_r is not None:
        _outer(x1, gx2, r.shape[0] - n_out, out=grad_r[n_out:])
    del x1
    gx1 = None
    if needs[0]:
        gx1 = _rotate(gx2, r, transpose=True, lo=n_out, out=bufs.get("gx1"))
    del gx2
    if grad_r is not None and cnp_ctx is not None:
        from xopt.kernels import poet_cayley

        b, formula, tf32, backend, oft_dtype = cnp_ctx
        grad_r = poet_cayley.blocks_backward(tuple(cnp_saved), grad_r, b, formula, tf32,
                                             backend, oft_dtype)
    return gx1, grad_r, grad_bias


def _dequantize(codes: Tensor, wq: tuple, dtype: torch.dtype) -> Tensor:
    scales, zeros, group_size = wq[:3]
    return _spec_module.dequantize_weight(codes, scales, zeros, group_size, dtype, xp=torch)


def _mm_wt(x2: Tensor, weight: Tensor, wq: tuple | None, out: Tensor | None = None,
           ) -> Tensor:
    """``x2 · W0ᵀ``; ``wq = (scales, zeros, group_size, triton, tf32)`` for POET-XQ codes;
    ``out``: write into it (float ``W0`` only; ``linear`` without a bias is this ``mm``)."""
    if wq is None:
        if out is not None:
            return torch.mm(x2, weight.t(), out=out)
        return nn.functional.linear(x2, weight)
    if wq[3]:
        from xopt.kernels import poet_qmm

        return poet_qmm.matmul_wt(x2, weight, wq[0], wq[1], wq[2], wq[4])
    return nn.functional.linear(x2, _dequantize(weight, wq, x2.dtype))


def _mm_w(gy1: Tensor, weight: Tensor, wq: tuple | None, out: Tensor | None = None,
          ) -> Tensor:
    """``gy1 · W0`` (as :func:`_mm_wt`; ``out``: write into it, float ``W0`` only)."""
    if wq is None:
        return torch.mm(gy1, weight) if out is None else torch.mm(gy1, weight, out=out)
    if wq[3]:
        from xopt.kernels import poet_qmm

        return poet_qmm.matmul_w(gy1, weight, wq[0], wq[1], wq[2], wq[4])
    return torch.mm(gy1, _dequantize(weight, wq, gy1.dtype))


# -- the triton chain as two operators, for torch.compile ------------------------------------
#
# Under torch.compile the triton path runs as the custom operators below (forward and
# backward, with fake implementations and the backward registered as the forward's
# autograd formula): dynamo records one opaque call per layer call instead of tracing
# the kernels' host code, so a model's layers of every shape sit in one graph (no graph
# break, no recompilation per layer shape) and run the eager layer's kernels, bit for bit.
# ``oft`` is the layer's ``oft_R`` (2-d: the operator evaluates the series) or the blocks
# :func:`batch_rotations` made for it (3-d, ``xopt::poet_blocks``).

_CHAIN_ARGS = ("Tensor x, Tensor oft, Tensor? bias, Tensor weight, Tensor perm_in, "
               "Tensor perm_in_inv, Tensor perm_out, Tensor perm_out_inv, Tensor? w_scales, "
               "Tensor? w_zeros, int group_size, int n_out, bool keep_y1, int b, str formula, "
               "bool tf32, ScalarType cdtype, str backend")
#: the forward's results: y, then what the backward needs (the gathered input x1 and
#: y1, fast; the blocks r; the series' saved tensors, padded to three), empty where unused
_SAVED_MAX = 3


def _chain_op_impl(x, oft, bias, weight, perm_in, perm_in_inv, perm_out, perm_out_inv,
                   w_scales, w_zeros, group_size, n_out, keep_y1, b, formula, tf32, cdtype,
                   backend):
    dev = x.device.type
    if torch.is_autocast_enabled(dev):  # (POETLinear.forward enters the op with it off)
        with torch.autocast(dev, enabled=False):
            return _chain_op_impl(x, oft, bias, weight, perm_in, perm_in_inv, perm_out,
                                  perm_out_inv, w_scales, w_zeros, group_size, n_out,
                                  keep_y1, b, formula, tf32, cdtype, backend)
    wq = None if w_scales is None else (w_scales, w_zeros, group_size, True, tf32)
    shape = x.shape
    cnp = (b, formula, tf32, cdtype, backend) if oft.dim() == 2 else None
    x1 = _gather(x.reshape(-1, shape[-1]), perm_in_inv, True)
    yr, r, y1, saved, _ = _core_forward(x1, oft, bias, n_out, weight, wq, cnp, x.dtype,
                                        keep_y1)
    y = _gather(yr, perm_out, True)
    pad = [x.new_empty(0) for _ in range(_SAVED_MAX - len(saved))]
    return (y.reshape(*shape[:-1], y.shape[-1]), x1 if keep_y1 else x.new_empty(0),
            r if cnp is not None else x.new_empty(0),  # (given blocks: the input, saved)
            y1 if keep_y1 else x.new_empty(0), *saved, *pad)


def _chain_op_fake(x, oft, bias, weight, perm_in, perm_in_inv, perm_out, perm_out_inv,
                   w_scales, w_zeros, group_size, n_out, keep_y1, b, formula, tf32, cdtype,
                   backend):
    from xopt.kernels import poet_cayley

    n, d_in, d_out = math.prod(x.shape[:-1]), x.shape[-1], perm_out.shape[0]
    blocks = oft.dim() == 3
    saved = [] if blocks else [
        oft.new_empty(shape, dtype=dt) for shape, dt in poet_cayley.blocks_saved_layout(
            oft.shape[0], b, formula, backend, cdtype)]
    return (x.new_empty((*x.shape[:-1], d_out)),
            x.new_empty((n, d_in)) if keep_y1 else x.new_empty(0),
            x.new_empty(0) if blocks else x.new_empty((oft.shape[0], b, b)),
            x.new_empty((n, d_out)) if keep_y1 else x.new_empty(0),
            *saved, *(x.new_empty(0) for _ in range(_SAVED_MAX - len(saved))))


def _chain_bwd_impl(g, xs, y1, r, weight, bias, perm_in, perm_in_inv, perm_out_inv, w_scales,
                    w_zeros, group_size, n_out, need_x, need_r, need_bias, b, formula, tf32,
                    backend, oft_dtype, s0, s1, s2):
    dev = g.device.type
    if torch.is_autocast_enabled(dev):
        with torch.autocast(dev, enabled=False):
            return _chain_bwd_impl(g, xs, y1, r, weight, bias, perm_in, perm_in_inv,
                                   perm_out_inv, w_scales, w_zeros, group_size, n_out, need_x,
                                   need_r, need_bias, b, formula, tf32, backend, oft_dtype,
                                   s0, s1, s2)
    from xopt.kernels import poet_cayley

    wq = None if w_scales is None else (w_scales, w_zeros, group_size, True, tf32)
    # b = 0: the forward was given blocks (their gradient is returned, no series)
    saved = (s0, s1, s2)[:len(poet_cayley.blocks_saved_layout(0, b, formula, backend,
                                                                r.dtype))] if b else ()
    g2d = g.reshape(-1, g.shape[-1])
    xs2d = xs.reshape(-1, xs.shape[-1])
    gx1, grad_r, grad_bias = _core_backward(
        lambda: _gather(g2d, perm_out_inv, True),
        xs2d if y1 is not None else _gather(xs2d, perm_in_inv, True), y1, r.contiguous(),
        weight, bias, wq, n_out, (need_x, need_r, need_bias),
        (b, formula, tf32, backend, oft_dtype) if b else None, saved)
    return (_gather(gx1, perm_in, True) if gx1 is not None else g.new_empty(0),
            grad_r if grad_r is not None else g.new_empty(0),
            grad_bias if grad_bias is not None else g.new_empty(0))


def _chain_bwd_fake(g, xs, y1, r, weight, bias, perm_in, perm_in_inv, perm_out_inv, w_scales,
                    w_zeros, group_size, n_out, need_x, need_r, need_bias, b, formula, tf32,
                    backend, oft_dtype, s0, s1, s2):
    n = math.prod(g.shape[:-1])
    grad_r = r.new_empty((r.shape[0], _spec_module.num_triu(b)), dtype=oft_dtype) if b else \
        r.new_empty(r.shape)
    return (g.new_empty((n, perm_in.shape[0])) if need_x else g.new_empty(0),
            grad_r if need_r else g.new_empty(0),
            g.new_empty((g.shape[-1],)) if need_bias and bias is not None else g.new_empty(0))


def _chain_setup(ctx, inputs, output):
    (x, oft, bias, weight, perm_in, perm_in_inv, _, perm_out_inv, w_scales, w_zeros,
     group_size, n_out, keep_y1, b, formula, tf32, _, backend) = inputs
    _, x1, r, y1, *saved = output
    blocks = oft.dim() == 3
    ctx.save_for_backward(x1 if keep_y1 else x, y1 if keep_y1 else None,
                          oft if blocks else r, weight, bias, perm_in, perm_in_inv,
                          perm_out_inv, w_scales, w_zeros, *saved)
    ctx.args = (x.shape, group_size, n_out, 0 if blocks else b, formula, tf32, backend,
                oft.dtype)
    ctx.mark_non_differentiable(*output[1:])


def _chain_backward(ctx, g, *_):
    xs, y1, r, weight, bias, perm_in, perm_in_inv, perm_out_inv, w_scales, w_zeros, *saved = \
        ctx.saved_tensors
    shape, group_size, n_out, b, formula, tf32, backend, oft_dtype = ctx.args
    need = ctx.needs_input_grad[:3]
    gx, grad_r, grad_bias = torch.ops.xopt.poet_chain_backward(
        g, xs, y1, r, weight, bias, perm_in, perm_in_inv, perm_out_inv, w_scales, w_zeros,
        group_size, n_out, need[0], need[1], need[2] and bias is not None, b, formula, tf32,
        backend, oft_dtype, *saved)
    return (gx.reshape(shape) if need[0] else None, grad_r if need[1] else None,
            grad_bias if need[2] and bias is not None else None, *(None,) * 15)


_chain_op = torch.library.custom_op(
    "xopt::poet_chain", _chain_op_impl, mutates_args=(),
    schema=f"({_CHAIN_ARGS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_chain_op.register_fake(_chain_op_fake)
_chain_bwd_op = torch.library.custom_op(
    "xopt::poet_chain_backward", _chain_bwd_impl, mutates_args=(),
    schema="(Tensor g, Tensor xs, Tensor? y1, Tensor r, Tensor weight, Tensor? bias, "
           "Tensor perm_in, Tensor perm_in_inv, Tensor perm_out_inv, Tensor? w_scales, "
           "Tensor? w_zeros, int group_size, int n_out, bool need_x, bool need_r, "
           "bool need_bias, int b, str formula, bool tf32, str backend, ScalarType oft_dtype, "
           "Tensor s0, Tensor s1, Tensor s2) -> (Tensor, Tensor, Tensor)")
_chain_bwd_op.register_fake(_chain_bwd_fake)
_chain_op.register_autograd(_chain_backward, setup_context=_chain_setup)


def _blocks_op_impl(x, b, formula, tf32, cdtype, backend):
    from xopt.kernels import poet_cayley

    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        with torch.autocast(dev, enabled=False):
            return _blocks_op_impl(x, b, formula, tf32, cdtype, backend)
    y, saved = poet_cayley.blocks_forward(x, b, formula, tf32, backend, cdtype)
    return (y, *saved, *(x.new_empty(0) for _ in range(_SAVED_MAX - len(saved))))


def _blocks_op_fake(x, b, formula, tf32, cdtype, backend):
    from xopt.kernels import poet_cayley

    saved = [x.new_empty(shape, dtype=dt) for shape, dt in poet_cayley.blocks_saved_layout(
        x.shape[0], b, formula, backend, cdtype)]
    return (x.new_empty((x.shape[0], b, b), dtype=cdtype), *saved,
            *(x.new_empty(0) for _ in range(_SAVED_MAX - len(saved))))


def _blocks_bwd_impl(g, s0, s1, s2, b, formula, tf32, backend, x_dtype):
    from xopt.kernels import poet_cayley

    dev = g.device.type
    if torch.is_autocast_enabled(dev):
        with torch.autocast(dev, enabled=False):
            return _blocks_bwd_impl(g, s0, s1, s2, b, formula, tf32, backend, x_dtype)
    n = len(poet_cayley.blocks_saved_layout(0, b, formula, backend, g.dtype))
    return poet_cayley.blocks_backward((s0, s1, s2)[:n], g, b, formula, tf32, backend, x_dtype)


def _blocks_bwd_fake(g, s0, s1, s2, b, formula, tf32, backend, x_dtype):
    return g.new_empty((g.shape[0], _spec_module.num_triu(b)), dtype=x_dtype)


def _blocks_setup(ctx, inputs, output):
    x, b, formula, tf32, _, backend = inputs
    ctx.save_for_backward(*output[1:])
    ctx.args = (b, formula, tf32, backend, x.dtype)
    ctx.mark_non_differentiable(*output[1:])


def _blocks_backward(ctx, g, *_):
    b, formula, tf32, backend, x_dtype = ctx.args
    return (torch.ops.xopt.poet_blocks_backward(g, *ctx.saved_tensors, b, formula, tf32,
                                                backend, x_dtype), *(None,) * 5)


#: the Cayley–Neumann blocks of stacked ``oft_R`` rows (:func:`batch_rotations` under
#: torch.compile; the series of :class:`_Blocks`)
_blocks_op = torch.library.custom_op(
    "xopt::poet_blocks", _blocks_op_impl, mutates_args=(),
    schema="(Tensor x, int b, str formula, bool tf32, ScalarType cdtype, str backend) -> "
           "(Tensor, Tensor, Tensor, Tensor)")
_blocks_op.register_fake(_blocks_op_fake)
_blocks_bwd_op = torch.library.custom_op(
    "xopt::poet_blocks_backward", _blocks_bwd_impl, mutates_args=(),
    schema="(Tensor g, Tensor s0, Tensor s1, Tensor s2, int b, str formula, bool tf32, "
           "str backend, ScalarType x_dtype) -> Tensor")
_blocks_bwd_op.register_fake(_blocks_bwd_fake)
_blocks_op.register_autograd(_blocks_backward, setup_context=_blocks_setup)


@torch.compiler.disable(reason=(
    "POETLinear's plain path: its reference backward is autograd's, which an opaque "
    "operator cannot run; a graph break per call keeps autograd's bits"))
def _plain_outside_graph(layer: POETLinear, x: Tensor) -> Tensor:
    return layer._plain_forward(x)


# -- the layer -------------------------------------------------------------------------------


class POETLinear(nn.Module):
    r"""A linear layer trained as ``W = R · W0 · P`` (POET-X, see :mod:`xopt.specs.poet`).

    Args:
      in_features, out_features: widths; ``block_size`` must divide both.
      block_size: side ``b`` of the square rotation blocks (default 256, the authors').
      bias: keep a bias (frozen unless ``bias_requires_grad``); it sits before ``R_out`` as
        in the authors' layer, and merges fold it so the layer's output does not jump.
      variant: ``"fast"`` or ``"mem"`` (see the module docstring).
      neumann_terms, cayley_formula: the CNP (default: 3 terms, the authors' GPU kernel).
      permutation: ``"random"`` (default) or ``"identity"``; ``seed``: this layer's seed
        for the permutation draws (``xopt.random``: the same permutations in JAX).
      impl: ``"auto"``, ``"plain"`` or ``"triton"`` (triton needs CUDA and 3 terms).
      weight_bits, weight_group_size: ``weight_bits=8`` is POET-XQ: ``W0`` is stored as
        uint8 codes with a scale and a zero point per ``weight_group_size`` consecutive
        elements (:func:`xopt.specs.poet.quantize_weight`, the authors' ``QPOETLinear``
        format), dequantised into a temporary inside each product of the forward and
        backward; merges quantise the merged ``W0`` afresh.
      spec: an :class:`xopt.specs.poet.POET` giving the defaults of all of the above.
      cuda_graphs: replay the triton path's forward and backward from CUDA graphs captured
        per input signature (:mod:`xopt.torch.poet_graphs`): the eager results, bit for bit,
        without the host's ~20 launches per call. Off by default: it keeps the gathered
        input (and, fast, ``y1``) of each captured signature between calls, its graphs'
        pools and transient buffers shared per shape (memory the eager layer frees after
        each backward), captures at the second call of each signature, and serves a call
        only under the conditions listed in that module (else the call runs eagerly).
        Settable on the layer (``layer.cuda_graphs = True``); :func:`convert` passes it on.

    Parameters and buffers (the authors' names, so state dicts interchange):
    ``weight`` (``W0``, ``out × in``, frozen), ``bias``, ``oft_R`` (``(r_out + r_in,
    b(b−1)/2)``, zero = identity rotations), ``perm_in``, ``perm_out``,
    ``perm_in_inv``, ``perm_out_inv`` (int32), and ``merges`` (how many merges so far).
    With ``weight_bits=8``, ``weight`` is a uint8 buffer of codes and ``weight_scales``,
    ``weight_zeros`` (``(out·in/weight_group_size, 1)``, the layer's dtype) sit beside it.
    """

    def __init__(self, in_features: int, out_features: int, block_size: int | None = None,
                 bias: bool = False, *, bias_requires_grad: bool = False,
                 variant: str | None = None, neumann_terms: int | None = None,
                 cayley_formula: str | None = None, permutation: str | None = None,
                 seed: int = 0, impl: str = "auto", weight_bits: int | None = None,
                 weight_group_size: int | None = None, spec: spec.POET | None = None,
                 cuda_graphs: bool = False, device=None, dtype=None):
        super().__init__()
        hp = spec or _spec_module.POET()
        overrides = {k: v for k, v in dict(block_size=block_size, variant=variant,
                                             neumann_terms=neumann_terms,
                                             cayley_formula=cayley_formula,
                                             permutation=permutation, weight_bits=weight_bits,
                                             weight_group_size=weight_group_size,
                                             ).items() if v is not None}
        if "block_size" in overrides:
            _spec_module.check_width(overrides["block_size"], in_features, out_features)
        hp = hp.replace(**overrides)
        _spec_module.check_width(hp.block_size, in_features, out_features)
        if impl not in ("auto", "plain", "triton"):
            raise HyperparameterError(f"POETLinear.impl = {impl!r}: must be one of 'auto', "
                                      "'plain', 'triton'")
        if impl == "triton" and hp.neumann_terms != 3:
            raise HyperparameterError(
                f"POETLinear: impl='triton' fuses the 3-term series only (neumann_terms="
                f"{hp.neumann_terms}); use impl='plain'")
        if not isinstance(cuda_graphs, bool):
            raise HyperparameterError(f"POETLinear.cuda_graphs = {cuda_graphs!r}: must be a "
                                      "bool")
        self.cuda_graphs = cuda_graphs
        # (blocks, CNP settings) that batch_rotations' hook passes for one compiled forward
        self._poet_batched = None
        self.hp = hp
        self.in_features, self.out_features = in_features, out_features
        self.block_size = b = hp.block_size
        self.variant = hp.variant
        self.impl = impl
        self.seed = int(seed)
        self.num_in_blocks, self.num_out_blocks = in_features // b, out_features // b
        kw = dict(device=device, dtype=dtype)
        self.weight_bits, self.weight_group_size = hp.weight_bits, hp.weight_group_size
        if self.quantized:
            groups = _spec_module.quant_groups(out_features, in_features, hp.weight_group_size)
            # buffers, not parameters: uint8 codes have no gradient and no optimizer
            self.register_buffer("weight", torch.zeros(out_features, in_features,
                                                       dtype=torch.uint8, device=device))
            self.register_buffer("weight_scales", torch.ones(groups, 1, **kw))
            self.register_buffer("weight_zeros", torch.zeros(groups, 1, **kw))
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw),
                                       requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, **kw),
                                     requires_grad=bias_requires_grad)
        else:
            self.register_parameter("bias", None)
        self.oft_R = nn.Parameter(torch.zeros(self.num_out_blocks + self.num_in_blocks,
                                              _spec_module.num_triu(b), **kw))
        for name, n in (("perm_in", in_features), ("perm_out", out_features)):
            self.register_buffer(name, torch.zeros(n, dtype=torch.int32, device=device))
            self.register_buffer(name + "_inv", torch.zeros(n, dtype=torch.int32, device=device))
        self.register_buffer("merges", torch.zeros((), dtype=torch.int64, device=device))
        self.set_permutations(*_spec_module.layer_permutations(hp, self.seed, 0, in_features,
                                                               out_features))
        w0 = torch.empty(out_features, in_features, **kw) if self.quantized else self.weight
        nn.init.kaiming_uniform_(w0, a=math.sqrt(5))
        if self.quantized:
            self.set_w0(w0)

    @property
    def quantized(self) -> bool:
        """Whether ``W0`` is held in ``weight_bits`` (POET-XQ)."""
        return self.weight_bits is not None

    @torch.no_grad()
    def set_w0(self, w: Tensor) -> None:
        """Install ``w`` as ``W0`` (quantised for POET-XQ, in ``w``'s dtype as the authors'
        ``quantize_tensor_int8``; the scales then take the layer's dtype)."""
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"POETLinear.set_w0: shape {tuple(w.shape)}, expected "
                             f"{(self.out_features, self.in_features)}")
        if not self.quantized:
            self.weight.copy_(w)
            return
        codes, scales, zeros = _spec_module.quantize_weight(
            w.to(self.weight_scales.device), self.weight_group_size, xp=torch)
        self.weight.copy_(codes)
        self.weight_scales.copy_(scales)
        self.weight_zeros.copy_(zeros)

    def w0(self, dtype: torch.dtype | None = None) -> Tensor:
        """``W0`` as a float tensor (dequantised for POET-XQ; ``dtype`` default: the
        layer's)."""
        if not self.quantized:
            return self.weight if dtype is None else self.weight.to(dtype)
        return _dequantize(self.weight, self._wq(), dtype or self.weight_scales.dtype)

    def _wq(self) -> tuple[Tensor, Tensor, int] | None:
        if not self.quantized:
            return None
        return (self.weight_scales, self.weight_zeros, self.weight_group_size)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, block_size: int | None = None, *,
                    normalize_weights: bool | None = None, spec: spec.POET | None = None,
                    **kwargs: Any) -> POETLinear:
        """A POETLinear whose ``W0`` is ``linear``'s weight (rows divided by their norms
        when ``normalize_weights``, the authors' default), bias copied, ``oft_R = 0``."""
        hp = spec or _spec_module.POET()
        norm = hp.normalize_weights if normalize_weights is None else normalize_weights
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, block_size,
                    bias=linear.bias is not None, spec=hp, device=w.device, dtype=w.dtype,
                    **kwargs)
        with torch.no_grad():
            wd = w.detach()
            if norm:
                wd = wd / torch.norm(wd, dim=1, keepdim=True)
            layer.set_w0(wd)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.detach())
        return layer

    def check_permutation(self, name: str, p: Any) -> np.ndarray:
        """``p`` (any integer array) as int64 NumPy, checked to be a permutation of the
        length of the layer's ``name`` (``"perm_in"`` or ``"perm_out"``)."""
        p = np.asarray(p.cpu() if isinstance(p, Tensor) else p, dtype=np.int64)
        n = getattr(self, name).shape[0]
        if p.shape != (n,) or not np.array_equal(np.sort(p), np.arange(n)):
            raise HyperparameterError(f"POETLinear.{name}: not a permutation of range({n})")
        return p

    @torch.no_grad()
    def set_permutations(self, perm_in: Any, perm_out: Any) -> None:
        """Install permutations (any integer arrays, or :class:`DevicePermutation` s);
        their inverses are computed here (given, for the latter)."""
        for name, p in (("perm_in", perm_in), ("perm_out", perm_out)):
            if not isinstance(p, DevicePermutation):
                p = self.check_permutation(name, p)
                p = DevicePermutation(torch.as_tensor(p), torch.as_tensor(_spec_module.inverse(p)))
            getattr(self, name).copy_(p.perm)  # int64 -> int32: exact (a layer's width)
            getattr(self, name + "_inv").copy_(p.inverse)

    # -- forward ----------------------------------------------------------------------------
    def _work_dtype(self) -> torch.dtype:
        """float32, or float64 for a float64 layer (rotations and merges run in it)."""
        return torch.float64 if self.oft_R.dtype == torch.float64 else torch.float32

    def _use_triton(self, device: torch.device) -> bool:
        if self.impl == "triton":
            return True
        # (the device before oft_R: a compiled CPU forward then guards on no parameter)
        return (self.impl == "auto" and self.hp.neumann_terms == 3 and _triton_ok(device)
                and self.oft_R.dtype != torch.float64)

    def rotations(self, triton_path: bool | None = None, tf32: bool = False,
                  ) -> tuple[Tensor, Tensor]:
        """``(R_out, R_in)``, float32, differentiable in ``oft_R``. ``tf32``: let the fused
        kernels use TF32 tensor cores (chosen by :meth:`forward` for bf16/fp16 inputs)."""
        if triton_path is None:
            triton_path = self._use_triton(self.oft_R.device)
        x = whole(self.oft_R).to(self._work_dtype())  # FSDP2 outside the forward: gathered
        if triton_path:
            from xopt.kernels import poet_cayley

            return poet_cayley.rotations(x, self.block_size, self.num_out_blocks,
                                         self.hp.cayley_formula, tf32)
        return _spec_module.rotations(x, self.block_size, self.num_out_blocks,
                                      self.hp.neumann_terms, self.hp.cayley_formula, xp=torch)

    def _chain_weight(self, dtype: torch.dtype) -> tuple[Tensor, tuple | None]:
        """``(W0 for a product in dtype, POET-XQ's tuple)``: POET-XQ's codes as they are
        (dequantised inside each product), else ``weight`` cast to ``dtype`` if needed."""
        wq = self._wq()
        if wq is not None:
            return self.weight, wq
        return (self.weight if self.weight.dtype == dtype else self.weight.to(dtype)), None

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() and not self._use_triton(x.device):
            return _plain_outside_graph(self, x)  # (first: no guard on the widths)
        cast = self._autocast_dtype(x)
        if cast is not None:
            with torch.autocast(x.device.type, enabled=False):
                return self.forward(x.to(cast))
        triton_path = self._use_triton(x.device)
        tf32 = x.dtype in (torch.bfloat16, torch.float16)
        bias = self.bias
        if triton_path:
            from xopt.kernels import poet_cayley

            # all blocks in one CNP call and one gradient (the CNP runs once per forward;
            # the backward reuses its saved Q, Q² and T). A bf16/fp16 layer whose oft_R
            # has its dtype evaluates the series in it (products accumulate in float32,
            # one rounding per product: below the rounding of R itself to that dtype),
            # with no casts; otherwise float32 (TF32 products for a bf16/fp16 input).
            cd = x.dtype if tf32 and self.oft_R.dtype == x.dtype else torch.float32
            cnp = (self.block_size, self.hp.cayley_formula, tf32, cd, poet_cayley.BACKEND)
            if self.cuda_graphs and not torch.compiler.is_compiling():
                from xopt.torch import poet_graphs

                y = poet_graphs.forward(self, x, cnp)
                if y is not None:
                    return y
            w, wq = self._chain_weight(x.dtype)
            if torch.compiler.is_compiling():  # one opaque call (the operators above)
                src = self.oft_R
                batched = getattr(self, "_poet_batched", None)  # (batch_rotations' hook)
                if batched is not None and batched[1] == cnp:
                    src = batched[0] if batched[0].dtype == x.dtype else batched[0].to(x.dtype)
                wq = wq or (None, None, 0)
                return _chain_op(x, src, bias, w, self.perm_in, self.perm_in_inv,
                                 self.perm_out, self.perm_out_inv, wq[0], wq[1], wq[2],
                                 self.num_out_blocks, self.variant == "fast", *cnp)[0]
            blocks = _stashed_blocks(self, cnp)
            if blocks is not None and blocks.dtype != x.dtype:
                blocks = blocks.to(x.dtype)  # (float32 series for a bf16/fp16 input)
            return _Chain.apply(x, self.oft_R if blocks is None else blocks, bias,
                                (self.num_out_blocks, w, self.perm_in, self.perm_in_inv,
                                 self.perm_out, self.perm_out_inv, self.variant == "fast",
                                 True, cnp if blocks is None else None, wq))
        return self._plain_forward(x)

    def _autocast_dtype(self, x: Tensor) -> torch.dtype | None:
        """``x``'s features checked; the dtype autocast asks of the layer, or None. The layer
        then runs in that dtype with autocast off, as for an input of that dtype (rotations
        in float32, W0 cast): the chain writes its products into buffers of its own dtype
        (``bmm(out=)``), which autocast cannot recast."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"POETLinear: input has {x.shape[-1]} features, expected "
                             f"{self.in_features}")
        dev = x.device.type
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None

    def _plain_forward(self, x: Tensor) -> Tensor:
        cast = self._autocast_dtype(x)
        if cast is not None:
            with torch.autocast(x.device.type, enabled=False):
                return self._plain_forward(x.to(cast))
        w, wq = self._chain_weight(x.dtype)
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:  # (as W0: the product's dtype)
            bias = bias.to(x.dtype)
        r_out, r_in = self.rotations(False)
        r_out, r_in = r_out.to(x.dtype), r_in.to(x.dtype)
        pin, pin_inv = self.perm_in.long(), self.perm_in_inv.long()
        pout, pout_inv = self.perm_out.long(), self.perm_out_inv.long()
        if self.variant == "fast":
            if wq is not None:  # the reference path: autograd keeps the temporary W0
                w = _dequantize(w, wq, x.dtype)
            y, _ = _spec_module.layer_forward(x, r_out, r_in, w, bias, pin_inv, pout, xp=torch)
            return y
        return _Chain.apply(x, torch.cat((r_out, r_in)), bias,
                            (self.num_out_blocks, w, pin, pin_inv, pout, pout_inv, False,
                             False, None, wq))

    # -- merging ----------------------------------------------------------------------------
    @torch.no_grad()
    def effective_weight(self) -> Tensor:
        """``W_eff = R · W0 · P`` as one ``out × in`` matrix (float32)."""
        r_out, r_in = self.rotations(False)
        return _spec_module.effective_weight(
            (self.w0(self._work_dtype()) if self.quantized
             else whole(self.weight).to(self._work_dtype())), r_out, r_in, self.perm_in.long(),
            self.perm_out.long(), xp=torch)

    @torch.no_grad()
    def merge_and_reset(self, perm_in: Any = None, perm_out: Any = None) -> None:
        """Fold the rotations into ``W0``, install new permutations (drawn from
        ``xopt.random`` unless given), re-lay ``W0`` (and the bias) for them, zero
        ``oft_R``. The layer's function is unchanged up to rounding. Under FSDP2 this
        gathers the layer on this rank; :func:`merge_and_reset` of a model merges each layer
        on one rank instead (:func:`xopt.torch.distributed.merge_by_owner`)."""
        (perm_in, perm_out), = permutations_on_device(  # checked before anything changes
            [self], [self.next_permutations(perm_in, perm_out)])
        new = self.merged(whole(self.oft_R), whole(self.weight), whole(self.bias),
                          perm_in, perm_out)
        self.install_merge({k: _block(getattr(self, k), v) for k, v in new.items()},
                           perm_in, perm_out)

    def next_permutations(self, perm_in: Any = None, perm_out: Any = None, *,
                          merges: int | None = None) -> tuple[Any, Any]:
        """The next merge's permutations: those given, else drawn from ``xopt.random``
        (``merges``: the layer's merge count, when the caller has read it already)."""
        if perm_in is None or perm_out is None:
            count = int(self.merges) if merges is None else merges
            drawn = _spec_module.layer_permutations(self.hp, self.seed, count + 1,
                                                    self.in_features, self.out_features)
            perm_in = drawn[0] if perm_in is None else perm_in
            perm_out = drawn[1] if perm_out is None else perm_out
        return perm_in, perm_out

    @torch.no_grad()
    def merged(self, oft_r: Tensor, weight: Tensor, bias: Tensor | None, perm_in: Any,
               perm_out: Any) -> dict[str, Tensor]:
        """A merge's results from the whole ``oft_R``, ``weight`` and ``bias`` (plain
        tensors): the new ``weight`` (POET-XQ: its codes, ``weight_scales`` and
        ``weight_zeros``) and ``bias``, whole, keyed by the layer's tensor names."""
        work = self._work_dtype()
        r_out, r_in = _spec_module.rotations(oft_r.to(work), self.block_size,
                                             self.num_out_blocks, self.hp.neumann_terms,
                                             self.hp.cayley_formula, xp=torch)
        new_in_inv, new_out_inv = (_inverse_on(p, weight.device) for p in (perm_in, perm_out))
        w0 = self.w0(work) if self.quantized else weight.to(work)
        w = _spec_module.merged_weight(w0, r_out, r_in,
                                       self.perm_in.long(), self.perm_out.long(),
                                       new_in_inv, new_out_inv, xp=torch)
        out = {}
        if bias is not None:
            out["bias"] = _spec_module.merged_bias(bias.to(work), r_out, self.perm_out.long(),
                                                   new_out_inv, xp=torch).to(bias.dtype)
        if self.quantized:  # POET-XQ: the merged W0 quantised afresh, in the work dtype
            codes, scales, zeros = _spec_module.quantize_weight(
                w.to(self.weight_scales.device), self.weight_group_size, xp=torch)
            out.update(weight=codes, weight_scales=scales.to(self.weight_scales.dtype),
                       weight_zeros=zeros.to(self.weight_zeros.dtype))
        else:
            out["weight"] = w.to(weight.dtype)
        return out

    @torch.no_grad()
    def install_merge(self, new: dict[str, Tensor], perm_in: Any, perm_out: Any) -> None:
        """Install :meth:`merged`'s results, each this rank's block of it (the whole tensor
        when not sharded), and the permutations; zero ``oft_R``; count the merge."""
        for k, v in new.items():
            dst = getattr(self, k)
            (dst.to_local() if is_dtensor(dst) else dst).copy_(v)
        self.set_permutations(perm_in, perm_out)
        self.oft_R.zero_()
        self.merges.add_(1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block_size={self.block_size}, bias={self.bias is not None}, "
                f"variant={self.variant!r}, impl={self.impl!r}"
                + (f", weight_bits={self.weight_bits}, weight_group_size="
                   f"{self.weight_group_size}" if self.quantized else "")
                + (", cuda_graphs=True" if self.cuda_graphs else ""))


_spec_module = spec  # the constructor's ``spec=`` argument shadows the module name


class DevicePermutation(NamedTuple):
    """A permutation checked on the host and held on its layer's device with its inverse
    (int64), as :meth:`POETLinear.merged` and :meth:`POETLinear.set_permutations` take it
    without a copy between host and device (:func:`permutations_on_device`)."""

    perm: Tensor
    inverse: Tensor


def _inverse_on(p: Any, device: torch.device) -> Tensor:
    if isinstance(p, DevicePermutation):
        return p.inverse
    return torch.as_tensor(_spec_module.inverse(np.asarray(
        p.cpu() if isinstance(p, Tensor) else p)), device=device)


def permutations_on_device(layers: Sequence[POETLinear], perms: Sequence[tuple[Any, Any]],
                           ) -> list[tuple[DevicePermutation, DevicePermutation]]:
    """Each layer's ``(perm_in, perm_out)`` checked and inverted on the host, every layer's
    sent to its device in one copy (instead of six copies a layer), so that a model's merge
    checks all its permutations before it changes any layer. Raises naming the layer's
    tensor before anything is sent; a pair already of :class:`DevicePermutation` s is
    kept."""
    host = [None if all(isinstance(p, DevicePermutation) for p in pair) else
            [layer.check_permutation(n, p) for n, p in zip(("perm_in", "perm_out"), pair,
                                                           strict=True)]
            for layer, pair in zip(layers, perms, strict=True)]
    arrays: dict[torch.device, list[np.ndarray]] = {}
    for layer, pair in zip(layers, host, strict=True):
        for p in pair or ():
            arrays.setdefault(layer.perm_in.device, []).extend((p, _spec_module.inverse(p)))
    sent = {dev: iter(torch.from_numpy(np.concatenate(a)).to(dev).split([len(x) for x in a]))
            for dev, a in arrays.items()}
    out = []
    for layer, pair, given in zip(layers, host, perms, strict=True):
        if pair is None:
            out.append(tuple(given))
            continue
        it = sent[layer.perm_in.device]
        out.append((DevicePermutation(next(it), next(it)), DevicePermutation(next(it), next(it))))
    return out


# -- the rotations of several layers in one evaluation ------------------------------------------


class _Blocks(torch.autograd.Function):
    """The Cayley–Neumann blocks of several layers' rotations in one evaluation (their
    ``oft_R`` rows stacked: one concatenation and the CNP's launches once for all of
    them, each way); returns one view per layer. The backward stacks the layers' block
    cotangents (zeros for a layer that did not use its blocks) and returns each ``oft_R``
    its rows of the triangles' gradient."""

    @staticmethod
    def forward(ctx, cnp, *oft):
        from xopt.kernels import poet_cayley

        b, formula, tf32, cd, backend = cnp
        sizes = [t.shape[0] for t in oft]
        x = torch.cat(oft) if len(oft) > 1 else oft[0]
        y, saved = poet_cayley.blocks_forward(x, b, formula, tf32, backend, cd)
        ctx.save_for_backward(*saved)
        ctx.args = (b, formula, tf32, backend, x.dtype, sizes)
        ctx.set_materialize_grads(False)
        return tuple(y.split(sizes))

    @staticmethod
    def backward(ctx, *grads):
        from xopt.kernels import poet_cayley

        dev = next((g.device.type for g in grads if g is not None), None)
        if dev is not None and torch.is_autocast_enabled(dev):
            with torch.autocast(dev, enabled=False):
                return _Blocks.backward(ctx, *grads)
        b, formula, tf32, backend, x_dtype, sizes = ctx.args
        if all(g is None for g in grads):
            return (None, *(None for _ in grads))
        ref = next(g for g in grads if g is not None)
        g = torch.cat([ref.new_zeros((n, b, b)) if gi is None else gi
                       for gi, n in zip(grads, sizes, strict=True)]) if len(grads) > 1 else ref
        dx = poet_cayley.blocks_backward(ctx.saved_tensors, g, b, formula, tf32, backend,
                                         x_dtype)
        return (None, *dx.split(sizes))


#: layer -> (its blocks, oft_R's version when they were made, the CNP settings, grad mode):
#: set by :func:`batch_rotations`' hook, read by the layer's forward; weak keys, and not
#: an attribute of the layer (a copied or pickled model carries no autograd graph)
_STASH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stashed_blocks(layer: POETLinear, cnp: tuple) -> Tensor | None:
    """The blocks :func:`batch_rotations` made for ``layer`` if they are still its
    rotations: ``oft_R`` unchanged since (its version counter), the same CNP settings and
    grad mode; else None (the layer evaluates its own)."""
    entry = _STASH.get(layer)
    if entry is None:
        return None
    blocks, version, settings, grad = entry
    if (version != layer.oft_R._version or settings != cnp
            or grad != torch.is_grad_enabled()):
        return None
    return blocks


def batch_rotations(model: nn.Module):
    """Evaluate the rotations of all of ``model``'s :class:`POETLinear` layers together,
    once per forward of ``model``: a forward pre-hook stacks the ``oft_R`` of the layers
    that share a block size, dtype and device and runs the Cayley–Neumann series once for
    each such group (3 launches each way per group instead of 2 per layer each way; the
    same per-block arithmetic), and each layer's forward takes its blocks from there.

    Layers on the triton path only (CUDA; ``impl="plain"`` layers evaluate their own), not
    POET-XQ layers, not ``cuda_graphs`` layers (their graphs evaluate the series), not
    DTensor (FSDP2) parameters, and only while the blocks are current:
    a layer whose ``oft_R`` changed since (an optimizer step, a merge) or that is called
    outside the model's forward with another dtype or grad mode evaluates its own. The
    input of each layer is assumed in the layer's dtype (else it evaluates its own).
    Call it after :func:`convert` (the layers are listed once, here). Under
    ``torch.compile`` each group's series is one ``xopt::poet_blocks`` operator and the
    blocks are handed to the layers for that forward only (a forward hook clears them).
    Returns the hooks' handle (``.remove()`` turns it off)."""
    from xopt.kernels import poet_cayley

    every = poet_layers(model)

    def hook(module, args):
        compiling = torch.compiler.is_compiling()
        groups: dict[tuple, list[POETLinear]] = {}
        for layer in every:
            if not compiling:
                _STASH.pop(layer, None)
            oft = layer.oft_R
            if (layer.quantized or is_dtensor(oft) or not layer._use_triton(oft.device)
                    or layer.cuda_graphs):  # (a graphed layer's graphs make its blocks)
                continue
            dev = oft.device.type
            # the input's dtype as the layer will see it (autocast's, under autocast)
            dt = (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev)
                  else layer.weight.dtype)
            tf32 = dt in (torch.bfloat16, torch.float16)
            cd = dt if tf32 and oft.dtype == dt else torch.float32
            cnp = (layer.block_size, layer.hp.cayley_formula, tf32, cd, poet_cayley.BACKEND)
            groups.setdefault((cnp, oft.device, oft.dtype), []).append(layer)
        grad = torch.is_grad_enabled()
        for (cnp, device, _), layers in groups.items():
            with torch.autocast(device.type, enabled=False):  # (the series' own dtypes)
                if compiling:  # the blocks ride on the layers for this forward only
                    ofts = [layer.oft_R for layer in layers]
                    stacked = torch.cat(ofts) if len(ofts) > 1 else ofts[0]
                    y = _blocks_op(stacked, *cnp)[0]
                    for layer, blk in zip(layers, y.split([t.shape[0] for t in ofts]),
                                          strict=True):
                        layer._poet_batched = (blk, cnp)
                    continue
                blocks = _Blocks.apply(cnp, *(layer.oft_R for layer in layers))
            for layer, y in zip(layers, blocks, strict=True):
                _STASH[layer] = (y, layer.oft_R._version, cnp, grad)

    def done(module, args, output):
        if torch.compiler.is_compiling():
            for layer in every:
                layer._poet_batched = None

    return _Handles(model.register_forward_pre_hook(hook),
                    model.register_forward_hook(done, always_call=True))


class _Handles:
    """The handles of :func:`batch_rotations`' two hooks; ``remove()`` removes both."""

    def __init__(self, *handles: Any):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def layer_seed(seed: int, name: str) -> int:
    """A layer's permutation seed: ``fold_in(seed, crc32(name))`` with ``/`` separators,
    the same rule as the JAX module, so same-named layers draw the same permutations."""
    return xrandom.fold_in(seed, zlib.crc32(name.replace(".", "/").encode()))


def convert(model: nn.Module, block_size: int | None = None, *, spec: spec.POET | None = None,
            target_modules: Sequence[str] | None = None,
            exclude_modules: Sequence[str] = ("lm_head",), seed: int | None = None,
            **kwargs: Any) -> tuple[nn.Module, int]:
    """Replace ``nn.Linear`` children by :class:`POETLinear` (``from_linear``), in place.

    As the authors' ``replace_linear_with_poet``: names containing an ``exclude_modules``
    entry (case-insensitive) are skipped, ``target_modules`` (if given) must match, and a
    layer whose widths ``block_size`` does not divide is left as it is (listed in the
    returned count's complement; ask :func:`poet_layers`). ``kwargs`` go to each
    :class:`POETLinear` (``variant=``, ``impl=``, ``cuda_graphs=``, ...). Returns
    ``(model, replaced)``.
    """
    hp = spec or _spec_module.POET()
    if block_size is not None:
        hp = hp.replace(block_size=block_size)
    base_seed = hp.seed if seed is None else seed
    count = 0

    def wanted(name: str) -> bool:
        if any(e.lower() in name.lower() for e in exclude_modules):
            return False
        return target_modules is None or any(t in name for t in target_modules)

    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and wanted(full):
                b = hp.block_size
                if child.in_features % b or child.out_features % b:
                    continue
                setattr(module, child_name, POETLinear.from_linear(
                    child, spec=hp, seed=layer_seed(base_seed, full), **kwargs))
                count += 1
    return model, count


def _block(p: Tensor, value: Tensor) -> Tensor:
    """This rank's block of ``value`` (a whole tensor) where ``p`` is a DTensor."""
    if not is_dtensor(p):
        return value
    lay = ShardLayout.of(p)
    return value[tuple(slice(o, o + n) for o, n in zip(lay.offsets, lay.local_shape,
                                                        strict=True))]


def poet_layers(model: nn.Module) -> list[POETLinear]:
    return [m for m in model.modules() if isinstance(m, POETLinear)]


@torch.no_grad()
def merge_and_reset(model: nn.Module, ranks: Any = "auto") -> int:
    """Merge every :class:`POETLinear` in ``model``; returns how many. On many ranks each
    layer is merged on one of them and the result sent to the others
    (:func:`xopt.torch.distributed.merge_by_owner`: ``ranks``, default the layers' FSDP2
    mesh; None merges on every rank).

    Where each rank merges alone, the layers that share their shapes, block size, dtypes
    and device are merged together (:func:`_merge_alone`): the permutations of all layers
    drawn at once, every host-side step once per group of layers; the model after it is
    the model after a merge of one layer at a time, bit for bit."""
    from xopt.torch.distributed import _merge_group, merge_by_owner

    named = [(n, m) for n, m in model.named_modules() if isinstance(m, POETLinear)]
    layers = [m for _, m in named]
    group, world = _merge_group(layers, ranks)
    if group is None or world == 1:  # (merge_by_owner's one-process merge)
        _merge_alone(layers)
    else:
        merge_by_owner(layers, ranks, names=[n or "(the model)" for n, _ in named])
    return len(named)


# -- a model's merge on one process, layers of one shape together ------------------------------
#
# A merge is host-bound: per layer, two permutation draws of xopt.random's generator in
# NumPy (~100 array operations each, whatever the width), three fold_in hashes in Python,
# and ~30 small device operations, each a host dispatch (bench/RESULTS.md: 220-300 ms for
# the 350M model's 96 layers, 17.8 ms of it on the GPU). _merge_alone does the same
# arithmetic with the work of layers of one shape batched where batching cannot change a
# bit: the draws (integers: one Threefry evaluation over every layer's blocks, the
# stable argsort as a sort of unique keys), the inverses, the skew-symmetric blocks, the
# series' elementwise terms, the gathers, the casts and the installs. The matrix products
# stay one call per layer with the one-layer merge's operands (a batched GEMM's kernel,
# and so its rounding, may depend on the batch count: cuBLAS picks it per call).

#: the float weights of the layers merged together at most (their stacked copies are the
#: merge's transients: a few times this, where merging alone holds a few layers' worth)
MERGE_CHUNK_BYTES = 64 * 2 ** 20
def _plain_merge(layer: POETLinear) -> bool:
    """Whether ``layer`` merges with POETLinear's own methods (not a subclass's, nor ones
    set on the layer itself)."""
    return all(getattr(getattr(layer, k), "__func__", None) is getattr(POETLinear, k)
               for k in ("next_permutations", "merge_and_reset", "merged", "install_merge",
                         "set_permutations", "check_permutation", "rotations", "w0"))


def _next_permutations_many(layers: Sequence[POETLinear], counts: Sequence[int],
                            plain: Sequence[bool]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each layer's ``next_permutations(merges=count)`` (int64 NumPy), the random ones drawn
    together (``plain``: the layers that draw with POETLinear's own method;
    :func:`xopt.specs.poet.random_layer_permutations`)."""
    out: list[Any] = [None] * len(layers)
    todo = []
    for j, (layer, c) in enumerate(zip(layers, counts, strict=True)):
        if (plain[j] and layer.hp.permutation != "identity"
                and 0 <= layer.seed < 2 ** 64 and 0 <= c + 1 < 2 ** 64):
            todo.append(j)
        else:  # (identity permutations; a seed out of range raises there, as it does alone)
            out[j] = layer.next_permutations(merges=c)
    if todo:
        drawn = _spec_module.random_layer_permutations(
            [layers[j].seed for j in todo], [counts[j] + 1 for j in todo],
            [layers[j].in_features for j in todo], [layers[j].out_features for j in todo])
        for j, pair in zip(todo, drawn, strict=True):
            out[j] = pair
    return out


def _merge_key(layer: POETLinear, plain: bool) -> tuple | None:
    """What layers merged together share (None: the layer merges alone: POET-XQ, a
    series other than the 3-term one, DTensor tensors, a merge not POETLinear's own)."""
    tensors = [layer.oft_R, layer.weight, layer.bias, layer.perm_in, layer.merges]
    if (layer.quantized or layer.hp.neumann_terms != 3 or not plain
            or any(is_dtensor(t) for t in tensors if t is not None)
            or not layer.weight.is_contiguous()):  # (the products' operands as alone)
        return None
    bias = layer.bias
    return (layer.in_features, layer.out_features, layer.block_size, layer.num_out_blocks,
            layer.hp.cayley_formula, layer.oft_R.dtype, layer.weight.dtype, layer.oft_R.device,
            layer.weight.device, layer.perm_in.device, None if bias is None else bias.dtype)


def _merge_alone(layers: Sequence[POETLinear]) -> None:
    """:meth:`POETLinear.merge_and_reset` of every layer, on this process (as
    :func:`xopt.torch.distributed.merge_by_owner` without ranks), the layers of one
    :func:`_merge_key` together, :data:`MERGE_CHUNK_BYTES` of weights at a time: every new
    permutation drawn and checked before any layer changes."""
    from xopt.torch.distributed import _merge_counts

    if not layers:
        return
    plain = [_plain_merge(layer) for layer in layers]
    host = _next_permutations_many(layers, _merge_counts(layers), plain)
    groups: dict[tuple, list[int]] = {}
    alone: list[int] = []
    for j, layer in enumerate(layers):
        key = _merge_key(layer, plain[j])
        if key is None:
            alone.append(j)
        else:
            groups.setdefault(key, []).append(j)
    # every layer's permutations and inverses to its device in one copy per device
    # (drawn ones are permutations by construction; others are checked, naming the layer)
    arrays: list[list[np.ndarray]] = []
    checked = set(alone)
    for j, layer in enumerate(layers):
        pi, po = host[j]
        if j in checked or not all(isinstance(p, np.ndarray) and p.dtype == np.int64
                                   for p in (pi, po)):
            pi, po = (layer.check_permutation(n, p) for n, p in (("perm_in", pi),
                                                                  ("perm_out", po)))
        arrays.append([pi, po])
    perms = [None] * len(layers)
    by_device: dict[torch.device, list[int]] = {}
    for j, layer in enumerate(layers):
        by_device.setdefault(layer.perm_in.device, []).append(j)
    for dev, idx in by_device.items():
        flat = [a for j in idx for a in arrays[j]]
        invs = []
        for n in {a.shape[0] for a in flat}:  # inverses per width, rows at once
            at = [k for k, a in enumerate(flat) if a.shape[0] == n]
            rows = _spec_module.inverses(np.stack([flat[k] for k in at]))
            invs.extend(zip(at, rows, strict=True))
        inv = [None] * len(flat)
        for k, a in invs:
            inv[k] = a
        parts = [x for k in range(len(flat)) for x in (flat[k], inv[k])]
        sent = iter(torch.from_numpy(np.concatenate(parts)).to(dev).split(
            [len(x) for x in parts]))
        for j in idx:
            perms[j] = tuple(DevicePermutation(next(sent), next(sent)) for _ in range(2))
    for j in alone:
        layers[j].merge_and_reset(*perms[j])
    for idx in groups.values():
        first = layers[idx[0]]
        size = first.in_features * first.out_features * torch.finfo(first._work_dtype()).bits // 8
        per = max(1, MERGE_CHUNK_BYTES // size)
        for at in range(0, len(idx), per):
            chunk = idx[at:at + per]
            _install_many(*_merged_many([layers[j] for j in chunk], [perms[j] for j in chunk]))


def _merged_many(layers: list[POETLinear], perms: list[tuple[DevicePermutation, ...]],
                 ) -> tuple[list[POETLinear], list, dict[str, list[Tensor]]]:
    """:meth:`POETLinear.merged` of layers of one :func:`_merge_key` (their new ``weight``
    and ``bias``), nothing installed. The elementwise operations and gathers of all layers
    at once (each element's arithmetic is the one-layer merge's); the matrix products per
    layer, with the one-layer merge's operands (3-term series as
    :func:`xopt.specs.poet.cayley_neumann`)."""
    first = layers[0]
    work = first._work_dtype()
    b, n_out = first.block_size, first.num_out_blocks
    nb = first.oft_R.shape[0]
    count = len(layers)
    q = _spec_module.skew(torch.cat([layer.oft_R for layer in layers]).to(work), b, xp=torch)
    q2, q3, q4 = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)

    def per_layer(t: Tensor) -> tuple[Tensor, ...]:  # each layer's (nb, b, b) blocks, views
        return t.view(count, nb, b, b).unbind(0)

    qs, q2s, q3s, q4s = per_layer(q), per_layer(q2), per_layer(q3), per_layer(q4)
    for a, out in zip(qs, q2s, strict=True):
        torch.matmul(a, a, out=out)
    for a, c, out in zip(q2s, qs, q3s, strict=True):
        torch.matmul(a, c, out=out)
    eye = torch.eye(b, dtype=q.dtype, device=q.device)
    if first.hp.cayley_formula == "product":  # 2·((Q²Q + Q) + Q²) + Q²Q² + I
        for a, out in zip(q2s, q4s, strict=True):
            torch.matmul(a, a, out=out)
        y = 2.0 * ((q3 + q) + q2) + q4 + eye
    else:  # taylor: 2·((Q + Q²) + Q²Q) + (2Q²)Q² + I
        for a, c, out in zip(per_layer(2.0 * q2), q2s, q4s, strict=True):
            torch.matmul(a, c, out=out)
        y = 2.0 * ((q + q2) + q3) + q4 + eye
    del q, q2, q3, q4, qs, q2s, q3s, q4s
    ys = per_layer(y)
    w0 = torch.stack([layer.weight for layer in layers]).to(work)
    rotated = torch.stack([
        _spec_module.block_rotate(_spec_module.block_rotate_rows(
            torch, w.mT, r[n_out:]), r[:n_out], xp=torch)
        for w, r in zip(w0.unbind(0), ys, strict=True)])  # (layers, in, out): W_eff's rows
    del w0
    # W0'[o, i] = rotated[perm_in[new_in_inv[i]], perm_out[new_out_inv[o]]]: the four
    # gathers of spec.merged_weight composed into one (gathers are exact)
    old_in = torch.stack([layer.perm_in for layer in layers]).long()
    old_out = torch.stack([layer.perm_out for layer in layers]).long()
    rows = old_in.gather(1, torch.stack([pi.inverse for pi, _ in perms]))
    cols = old_out.gather(1, torch.stack([po.inverse for _, po in perms]))
    which = torch.arange(count, device=rows.device)[:, None, None]
    new_w = rotated[which, rows[:, :, None], cols[:, None, :]].mT.to(first.weight.dtype)
    out = {"weight": list(new_w.unbind(0))}
    if first.bias is not None:
        out["bias"] = [_spec_module.merged_bias(
            layer.bias.to(work), r[:n_out], layer.perm_out.long(), po.inverse,
            xp=torch).to(layer.bias.dtype)
            for layer, r, (_, po) in zip(layers, ys, perms, strict=True)]
    return layers, perms, out


def _install_many(layers: list[POETLinear], perms: list, new: dict[str, list[Tensor]]) -> None:
    """:meth:`POETLinear.install_merge` of each layer (plain tensors), as a few foreach
    calls."""
    for k, values in new.items():
        torch._foreach_copy_([getattr(layer, k) for layer in layers], values)
    dst, src = [], []
    for layer, (pi, po) in zip(layers, perms, strict=True):
        dst += [layer.perm_in, layer.perm_in_inv, layer.perm_out, layer.perm_out_inv]
        src += [pi.perm, pi.inverse, po.perm, po.inverse]
    torch._foreach_copy_(dst, src)  # int64 -> int32: exact (a layer's width)
    torch._foreach_zero_([layer.oft_R for layer in layers])
    torch._foreach_add_([layer.merges for layer in layers], 1)


class MergeEvery:
    """Training-loop callback: ``cb(step)`` merges ``model`` when ``step`` (1-based count of
    optimizer steps taken) is a positive multiple of ``interval``, as the authors'
    ``merge_and_reinitialize`` does in their training script. Returns True on a merge."""

    def __init__(self, model: nn.Module, interval: int):
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise HyperparameterError(f"MergeEvery.interval = {interval!r}: must be an "
                                      "integer ≥ 1 (the merge interval)")
        self.model, self.interval = model, interval

    def __call__(self, step: int) -> bool:
        if step > 0 and step % self.interval == 0:
            merge_and_reset(self.model)
            return True
        return False


# -- the optimizer ----------------------------------------------------------------------------


def poet_param_groups(model: nn.Module, *, lr: float = 1e-3, poet_lr: float = 5e-4,
                      weight_decay: float = 0.0) -> list[dict[str, Any]]:
    """The authors' ``get_poet_optimizer`` grouping: non-rotation parameters without decay
    (biases, 1-d) and with decay (the rest) at ``lr``, rotation vectors (``oft_R``) at
    ``poet_lr`` with ``use_poet=True`` and no decay."""
    rot = {id(m.oft_R) for m in poet_layers(model)}
    decay, nodecay, poet = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in rot:
            poet.append(p)
        elif p.ndim >= 2 and not name.endswith("bias"):
            decay.append(p)
        else:
            nodecay.append(p)
    return [dict(params=nodecay, use_poet=False, weight_decay=0.0, lr=lr),
            dict(params=decay, use_poet=False, weight_decay=weight_decay, lr=lr),
            dict(params=poet, use_poet=True, weight_decay=0.0, lr=poet_lr)]


class POETAdamW(Optimizer):
    r"""The authors' POETAdamW arithmetic (:func:`xopt.specs.poet.adam_update`).

    Groups with ``use_poet=True`` (the default) are rotation vectors: their learning rate is
    multiplied by ``poet_scale`` and their moments restart at the first update after each
    merge boundary (global step counter a positive multiple of ``merge_interval``). Other
    groups get the same Adam arithmetic without either. With ``model=``, the optimizer also
    merges the model's POET layers after every ``merge_interval``-th update (then no
    training-loop callback is needed).

    ``nonfinite=``: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` (:mod:`xopt.nonfinite`);
    with ``model=`` a step may merge the model's layers, so ``"skip"`` reads its flag on the
    host within the step. The step keeps Python counters (the authors' layout), so it is
    excluded from torch.compile's dynamo (a compiled training step breaks once at
    ``step()``).

    State per parameter: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` (float32 for
    low-precision parameters); ``global_step_counter`` on the optimizer (in its state
    dict with the first parameter's state, where DCP carries it; ``load_state_dict`` also
    reads the older top-level key).
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]],
                 lr: float | None = None, betas: tuple[float, float] | None = None,
                 eps: float | None = None, weight_decay: float | None = None, *,
                 correct_bias: bool | None = None, poet_scale: float | None = None,
                 merge_interval: int | None = None, model: nn.Module | None = None,
                 spec: spec.POET | None = None, nonfinite: str | None = None,
                 check_finite: bool | None = None):
        hp = spec or _spec_module.POET()
        given = dict(lr=lr, eps=eps, weight_decay=weight_decay, correct_bias=correct_bias,
                     poet_scale=poet_scale, merge_interval=merge_interval)
        if betas is not None:
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise HyperparameterError(f"POETAdamW.betas = {betas!r}: must be a pair")
            given.update(b1=betas[0], b2=betas[1])
        hp = hp.replace(**{k: v for k, v in given.items() if v is not None})
        self.hp = hp
        defaults = dict(lr=hp.lr, betas=(hp.b1, hp.b2), eps=hp.eps,
                        weight_decay=hp.weight_decay, correct_bias=hp.correct_bias,
                        poet_scale=hp.poet_scale, poet_merge_interval=hp.merge_interval,
                        use_poet=True)
        self.global_step_counter = 0
        self.model = model
        self._skip_syncs = model is not None
        super().__init__(params, defaults, nonfinite=nonfinite, check_finite=check_finite)

    def _check_group(self, group: dict[str, Any], gi: int) -> None:
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise HyperparameterError(f"POETAdamW param_groups[{gi}].betas = {betas!r}: must "
                                      "be a pair")
        if not isinstance(group["use_poet"], bool):
            raise HyperparameterError(f"POETAdamW param_groups[{gi}].use_poet = "
                                      f"{group['use_poet']!r}: must be a bool")
        self.hp.replace(lr=group["lr"], b1=betas[0], b2=betas[1], eps=group["eps"],
                        weight_decay=group["weight_decay"], correct_bias=group["correct_bias"],
                        poet_scale=group["poet_scale"],
                        merge_interval=group["poet_merge_interval"])

    def _state_layout(self, p: Tensor, group: Any) -> dict[str, Layout]:
        sdt = torch.float64 if p.dtype == torch.float64 else torch.float32
        return {"step": Layout((), int), "exp_avg": Layout(tuple(p.shape), sdt),
                "exp_avg_sq": Layout(tuple(p.shape), sdt)}

    def _host_snapshot(self) -> Any:
        return self.global_step_counter

    def _host_restore(self, snapshot: Any) -> None:
        self.global_step_counter = snapshot

    @torch.compiler.disable(reason=(
        "POETAdamW.step keeps the authors' Python step counters (moment resets, merges)"))
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = self._closure_loss(closure)
        items = self._step_items()
        before = self.global_step_counter
        self._run_step(items, lambda: self._update(items))
        counter = self.global_step_counter  # (unchanged when the step was skipped)
        if self.model is not None and counter != before and counter % self.hp.merge_interval == 0:
            merge_and_reset(self.model, data_parallel_ranks(self))
        return loss

    def _update(self, items: list[Item]) -> None:
        gstep = self.global_step_counter
        state = self.state
        # per parameter: the moment resets and step counts (host work only), the parameter
        # into its group's bucket of its step count; then the arithmetic once per bucket
        # (one launch on CUDA). Per-parameter host work is most of the step's host time, so
        # the loop does only what each parameter needs; what a bucket's tensors share
        # (device, dtypes, layout) is checked once per bucket, by the launch's tables.
        buckets: list[tuple[dict, int, tuple[list, list, list, list]]] = []
        for _, run in itertools.groupby(items, key=_GROUP_INDEX):  # (items are in group order)
            run = list(run)
            group = run[0].group
            interval = group["poet_merge_interval"] if group.get("use_poet", True) else 0
            reset = _spec_module.needs_reset(gstep, interval)
            if not reset:
                bucket = _one_bucket(state, run)
                if bucket is not None:
                    buckets.append((group, *bucket))
                    continue
            by_step: dict[int, tuple[list, list, list, list]] = {}
            for it in run:
                p = it.param
                st = state[p]
                if reset or "step" not in st:
                    sdt = torch.float64 if p.dtype == torch.float64 else torch.float32
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, dtype=sdt)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=sdt)
                k = st["step"] = st["step"] + 1
                b = by_step.get(k)
                if b is None:
                    b = by_step[k] = ([], [], [], [])
                b[0].append(p)
                b[1].append(it.grad)
                b[2].append(st["exp_avg"])
                b[3].append(st["exp_avg_sq"])
            buckets.extend((group, k, b) for k, b in by_step.items())
        for group, k, (ps, gs, ms, vs) in buckets:
            b1, b2 = group["betas"]
            lr = group["lr"]
            if group.get("use_poet", True) and group["poet_scale"] > 0.0:
                lr = lr * group["poet_scale"]
            step_size = lr
            if group["correct_bias"]:
                step_size = step_size * math.sqrt(1.0 - b2 ** k) / (1.0 - b1 ** k)
            decay = -lr * group["weight_decay"] if group["weight_decay"] > 0.0 else None
            eps = group["eps"]
            dtensors = _any_dtensor(ps)
            if dtensors:  # FSDP2: local shards where a parameter's four tensors align
                ps, gs, ms, vs = _local_shards(ps, gs, ms, vs)
                dtensors = _any_dtensor(ps)
            if _MANY[0] and not dtensors and _fused_ok(ps[0]):
                from xopt.kernels import poet_adam

                try:  # the bucket in one launch, where its tensors allow (False: nothing done)
                    # (each gradient's shape is its parameter's: checked by _step_items)
                    if poet_adam.adam_update_many(ps, gs, ms, vs, b1, b2, eps, step_size,
                                                  decay, shapes_checked=True):
                        continue
                except Exception as e:  # (fails before its launch: nothing changed)
                    _MANY[0] = False
                    warnings.warn(f"POETAdamW: the one-launch step failed ({e!r}); "
                                  "one launch per parameter from now on", stacklevel=2)
            _update_split(ps, gs, ms, vs, b1, b2, eps, step_size, decay)
        self.global_step_counter += 1

    def state_dict(self) -> dict[str, Any]:
        """torch's, with ``global_step_counter`` in the first parameter's state (DCP carries
        only state keyed by parameter, and param groups)."""
        sd = super().state_dict()
        ids = [k for g in sd["param_groups"] for k in g["params"]]
        if ids:
            sd["state"][ids[0]] = {**sd["state"].get(ids[0], {}),
                                   "global_step_counter": self.global_step_counter}
        else:
            sd["global_step_counter"] = self.global_step_counter
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        counter = state_dict.pop("global_step_counter", 0)
        ids = [k for g in state_dict.get("param_groups", ()) if isinstance(g, dict)
               for k in g.get("params", ())]
        st = state_dict.get("state")
        if ids and isinstance(st, dict) and isinstance(st.get(ids[0]), dict) and (
                "global_step_counter" in st[ids[0]]):
            st = dict(st)
            first = dict(st[ids[0]])
            counter = first.pop("global_step_counter")
            if first:
                st[ids[0]] = first
            else:
                del st[ids[0]]
            state_dict["state"] = st
        if isinstance(counter, bool) or not isinstance(counter, int) or counter < 0:
            raise StateError(f"POETAdamW.load_state_dict: global_step_counter = {counter!r}: "
                             "must be an int >= 0")
        super().load_state_dict(state_dict)
        self.global_step_counter = counter


#: POETAdamW's CUDA updates in one pass, one launch per bucket (xopt.kernels.poet_adam:
#: the foreach path's operations in its order and precision, one read and one write of
#: each tensor instead of ~10 passes); ``XOPT_POET_FUSED_STEP=0`` keeps the foreach path
FUSED_STEP = os.environ.get("XOPT_POET_FUSED_STEP", "1") not in ("", "0")
#: whether the bucket's one-launch update (poet_adam.adam_update_many) is in use: turned off
#: for the process if its kernel cannot be built here (a Triton without int-to-pointer casts)
_MANY = [True]


_GROUP_INDEX = operator.attrgetter("gi")
_PARAM = operator.attrgetter("param")
_GRAD = operator.attrgetter("grad")
_STEP = operator.itemgetter("step")
_EXP_AVG = operator.itemgetter("exp_avg")
_EXP_AVG_SQ = operator.itemgetter("exp_avg_sq")


def _one_bucket(state: Any, run: list[Item]) -> tuple[int, tuple[list, list, list, list]] | None:
    """An ordinary update of one group's items, whose parameters all have state at one step
    count: ``(their new step count, (ps, gs, ms, vs))``, the counts advanced; None (nothing
    changed) otherwise. The per-parameter loop's work as passes of C-level calls over the
    group (the same buckets, in the same order; ~2x less host time a parameter)."""
    ps = list(map(_PARAM, run))
    sts = list(map(state.__getitem__, ps))  # (a defaultdict: {} for a parameter without)
    try:
        steps = set(map(_STEP, sts))
    except KeyError:  # a parameter's first update: the loop makes its state
        return None
    if len(steps) != 1:
        return None
    k = steps.pop() + 1
    for st in sts:
        st["step"] = k
    return k, (ps, list(map(_GRAD, run)), list(map(_EXP_AVG, sts)),
               list(map(_EXP_AVG_SQ, sts)))


def _fused_ok(p: Tensor) -> bool:
    """Whether POETAdamW's kernels (xopt.kernels.poet_adam) update ``p``'s device."""
    return FUSED_STEP and p.is_cuda and _triton_ok(p.device)


def _any_dtensor(ps: list[Tensor]) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and any(issubclass(t, mod.DTensor) for t in set(map(type, ps)))


def _local_shards(ps, gs, ms, vs) -> tuple[list, list, list, list]:
    """Each parameter's (p, g, m, v) as their local shards where the four share one
    placement (an elementwise update of those is the DTensors', bit for bit, without
    DTensor's dispatch per operation); the others as they are."""
    out: tuple[list, list, list, list] = ([], [], [], [])
    for quad in zip(ps, gs, ms, vs, strict=True):
        shards = aligned_locals(*quad)
        for lst, t in zip(out, shards or quad, strict=True):
            lst.append(t)
    return out


def _update_split(ps, gs, ms, vs, b1, b2, eps, step_size, decay) -> None:
    """One bucket's update where its one launch did not take it: split by device, dtypes and
    DTensor-ness; per parameter with the kernel where every tensor allows it, else as
    foreach calls (DTensors: the loop)."""
    parts: dict[tuple, tuple[list, list, list, list]] = {}
    for p, g, m, v in zip(ps, gs, ms, vs, strict=True):
        part = parts.setdefault((p.device, p.dtype, m.dtype, is_dtensor(p)), ([], [], [], []))
        for lst, t in zip(part, (p, g, m, v), strict=True):
            lst.append(t)
    for (_, pdt, sdt, dtensor), (qs, hs, ns, ws) in parts.items():
        if not dtensor and _fused_ok(qs[0]):
            from xopt.kernels import poet_adam

            if all(map(poet_adam.supported, qs, hs, ns, ws)):
                for p, g, m, v in zip(qs, hs, ns, ws, strict=True):
                    poet_adam.adam_update(p, g, m, v, b1, b2, eps, step_size, decay)
                continue
        (_loop_update if dtensor else _foreach_update)(qs, hs, ns, ws, b1, b2, eps, step_size,
                                                       decay, pdt != sdt)


def _loop_update(ps, gs, ms, vs, b1, b2, eps, step_size, decay, cast) -> None:
    """The authors' arithmetic, in place, one parameter at a time (``cast``: the moments
    are float32 for low-precision parameters)."""
    for p, g, m, v in zip(ps, gs, ms, vs, strict=True):
        g = g.to(m.dtype)
        m.mul_(b1).add_(g, alpha=1.0 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        denom = v.sqrt().add_(eps)
        if not cast:
            p.addcdiv_(m, denom, value=-step_size)
            if decay is not None:
                p.add_(p, alpha=decay)
        else:
            pf = p.to(m.dtype).addcdiv(m, denom, value=-step_size)
            if decay is not None:
                pf = pf.add(pf, alpha=decay)
            p.copy_(pf)


def _foreach_update(ps, gs, ms, vs, b1, b2, eps, step_size, decay, cast) -> None:
    """:func:`_loop_update` as foreach calls over the bucket (same ops, same order; the
    casts as ``_foreach_copy_`` into float32 temporaries)."""
    if cast:
        gs32 = [torch.empty_like(m) for m in ms]
        torch._foreach_copy_(gs32, gs)
        gs = gs32
    torch._foreach_mul_(ms, b1)
    torch._foreach_add_(ms, gs, alpha=1.0 - b1)
    torch._foreach_mul_(vs, b2)
    torch._foreach_addcmul_(vs, gs, gs, value=1.0 - b2)
    denom = torch._foreach_sqrt(vs)
    torch._foreach_add_(denom, eps)
    if cast:
        pfs = [torch.empty_like(m) for m in ms]
        torch._foreach_copy_(pfs, ps)
    else:
        pfs = ps
    torch._foreach_addcdiv_(pfs, ms, denom, value=-step_size)
    if decay is not None:
        torch._foreach_add_(pfs, pfs, alpha=decay)
    if cast:
        torch._foreach_copy_(ps, pfs)


register("poet", "torch", POETAdamW)
