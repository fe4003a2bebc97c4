"""The low-rank optimizers' AdamW moments and direction in one pass (Triton).

GaLore, COAP and PLUMAGE take the authors' AdamW step on their projected gradients
(:func:`xopt.specs.lowrank.hf_adam_moments` and ``hf_adam_direction``):
``m ← m·β₁ + r·(1 − β₁)``, ``v ← v·β₂ + (r·r)·(1 − β₂)``, ``n = m / (√v + ε)`` (PLUMAGE's
``eps_inside_sqrt``: ``m / √(v + ε)``). As torch ``foreach`` calls that is about ten passes
over the moments, two stacking copies and a cast; :func:`adam_moments` is one pass: each
program reads one block of one tensor's ``r``, ``m`` and ``v``, writes ``m`` and ``v`` back
in place and ``n`` out. The tensors are reached through a table of their addresses (one
launch per call whatever their number and sizes; the state's own tensors, never stacked),
the programs through a cached map of every tensor's blocks.

Bits: each float operation is the foreach path's, one IEEE float32 operation each, in its
order; the scalars are rounded to float32 as torch's foreach kernels round them; the square
root and the division are the correctly rounded ``sqrt_rn``/``div_rn`` (Triton's default
``/`` and ``sqrt`` are approximate on GPUs; CUDA's, which torch uses, are correctly
rounded). Launched with ``enable_fp_fusion=False`` (:data:`xopt.kernels.NO_FP_FUSION`): a
contracted ``a·b + c`` would round once where the foreach path rounds twice.
Tested against the foreach path under ``TRITON_INTERPRET=1``
(tests/test_kernels_lowrank_adam.py).

:data:`BACKEND` (environment ``XOPT_LOWRANK_ADAM``, read at import): ``"auto"`` (the
default: the kernel for CUDA tensors, the foreach path elsewhere), ``"torch"`` (never) or
``"triton"`` (the kernel everywhere: the interpreter on a CPU).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from xopt.kernels import NO_FP_FUSION
from xopt.kernels._tables import at, block_map

__all__ = ["BACKEND", "adam_moments", "runs_on"]

#: where :func:`adam_moments` replaces the foreach path: "torch" (never), "auto" (CUDA
#: tensors) or "triton" (every tensor)
BACKEND = os.environ.get("XOPT_LOWRANK_ADAM", "auto")

#: entries per program: 8 per thread at 4 warps (a memory-bound pass)
_BLOCK = 1024
_WARPS = 4
#: tensors per launch (address tables of at most this many entries)
_MAX_TENSORS = 65535
#: address tables of the state's moments, which keep their storage from step to step
_TABLES: dict[tuple[object, ...], torch.Tensor] = {}
_TABLES_MAX = 256


def runs_on(device: torch.device) -> bool:
    """Whether :func:`adam_moments` is the step's path for tensors on ``device``."""
    if BACKEND not in ("auto", "triton", "torch"):
        raise ValueError(f"XOPT_LOWRANK_ADAM = {BACKEND!r}; known: 'auto', 'triton', 'torch'")
    return BACKEND == "triton" or (BACKEND == "auto" and device.type == "cuda")


@triton.jit
def _adam_block(m_ptr, v_ptr, r_ptr, n_ptr, offs, size, b1, omb1, b2, omb2, eps,
                EPS_INSIDE: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr,
                BLOCK: tl.constexpr):
    mp = at(m_ptr, offs, ALIGNED, BLOCK)
    vp = at(v_ptr, offs, ALIGNED, BLOCK)
    rp = at(r_ptr, offs, ALIGNED, BLOCK)
    np_ = at(n_ptr, offs, ALIGNED, BLOCK)
    if MASKED:
        mask = offs < size
        r = tl.load(rp, mask=mask).to(tl.float32)  # bf16: widened exactly
        m = tl.load(mp, mask=mask)
        v = tl.load(vp, mask=mask)
    else:
        r = tl.load(rp).to(tl.float32)
        m = tl.load(mp)
        v = tl.load(vp)
    m = m * b1 + r * omb1
    v = v * b2 + (r * r) * omb2
    if EPS_INSIDE:
        n = tl.div_rn(m, tl.sqrt_rn(v + eps))
    else:
        n = tl.div_rn(m, tl.sqrt_rn(v) + eps)
    if MASKED:
        tl.store(mp, m, mask=mask)
        tl.store(vp, v, mask=mask)
        tl.store(np_, n, mask=mask)
    else:
        tl.store(mp, m)
        tl.store(vp, v)
        tl.store(np_, n)


@triton.jit
def _adam_kernel(m_tab, v_tab, r_tab, n_tab, sizes, block_tensor, block_index, b1, omb1, b2,
                 omb2, eps, EPS_INSIDE: tl.constexpr, R_BF16: tl.constexpr,
                 ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    # one program per block of one tensor (the cached block map: no idle programs when the
    # tensors' sizes differ); a whole block unmasked, a tensor's last partial one masked
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    size = tl.load(sizes + t)
    start = tl.load(block_index + pid).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    m_ptr = tl.load(m_tab + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_tab + t).to(tl.pointer_type(tl.float32))
    n_ptr = tl.load(n_tab + t).to(tl.pointer_type(tl.float32))
    if R_BF16:
        r_ptr = tl.load(r_tab + t).to(tl.pointer_type(tl.bfloat16))
    else:
        r_ptr = tl.load(r_tab + t).to(tl.pointer_type(tl.float32))
    if start + BLOCK <= size:
        _adam_block(m_ptr, v_ptr, r_ptr, n_ptr, offs, size, b1, omb1, b2, omb2, eps,
                    EPS_INSIDE, False, ALIGNED, BLOCK)
    else:
        _adam_block(m_ptr, v_ptr, r_ptr, n_ptr, offs, size, b1, omb1, b2, omb2, eps,
                    EPS_INSIDE, True, ALIGNED, BLOCK)


def _addresses(xs: list[torch.Tensor], device: torch.device, cache: bool) -> torch.Tensor:
    """The int64 table of ``xs``' addresses on ``device`` (cached by address for the
    state's moments; copied without a host synchronisation otherwise)."""
    key = (str(device), *(x.data_ptr() for x in xs))
    if cache and key in _TABLES:
        return _TABLES[key]
    host = torch.tensor(key[1:], dtype=torch.int64)
    if device.type == "cuda":
        table = host.pin_memory().to(device, non_blocking=True)
    else:
        table = host
    if cache:
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
        _TABLES[key] = table
    return table


def _rows(r: torch.Tensor) -> list[torch.Tensor]:
    return list(r.reshape(r.shape[0], -1).unbind(0))


def adam_moments(ms: list[torch.Tensor], vs: list[torch.Tensor],
                 r: torch.Tensor | list[torch.Tensor], b1: float, b2: float, eps: float,
                 eps_inside: bool = False) -> torch.Tensor | list[torch.Tensor]:
    """The AdamW moment update of ``ms`` and ``vs`` (in place) and the directions.

    Args:
      ms, vs: the moments, contiguous float32 tensors (the state's own), pairwise of the
        same number of entries.
      r: the gradients (projected): a ``(B, ...)`` stack whose row ``i`` goes with ``ms[i]``,
        or a list like ``ms``; float32, or bfloat16 (widened exactly).
      b1, b2, eps: the AdamW hyperparameters; eps_inside: ``m / √(v + ε)``.
    Returns:
      ``n``, float32: a stack like ``r`` or a list like ``ms``.
    """
    rs = _rows(r) if isinstance(r, torch.Tensor) else list(r)
    if not (len(ms) == len(vs) == len(rs)) or not ms:
        raise ValueError(f"lowrank_adam.adam_moments: {len(ms)} m, {len(vs)} v and "
                         f"{len(rs)} r tensors; they must be as many, and at least one")
    r_dtype = rs[0].dtype
    if r_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"lowrank_adam.adam_moments: r must be float32 or bfloat16, got "
                         f"{r_dtype}")
    device = rs[0].device
    for i, (m, v, x) in enumerate(zip(ms, vs, rs, strict=True)):
        for name, t in (("m", m), ("v", v)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device != device:
                raise ValueError(f"lowrank_adam.adam_moments: {name}[{i}] must be a "
                                 f"contiguous float32 tensor on {device}, got {t.dtype} "
                                 f"on {t.device}")
            if t.numel() != x.numel():
                raise ValueError(f"lowrank_adam.adam_moments: {name}[{i}] has {t.numel()} "
                                 f"entries, r[{i}] {x.numel()}")
        if x.dtype != r_dtype or not x.is_contiguous() or x.device != device:
            raise ValueError(f"lowrank_adam.adam_moments: r[{i}] must be contiguous, "
                             f"{r_dtype}, on {device}")
    if isinstance(r, torch.Tensor):
        n = torch.empty(r.shape, dtype=torch.float32, device=device)
        ns = _rows(n)
        out: torch.Tensor | list[torch.Tensor] = n
    else:
        ns = [torch.empty(x.shape, dtype=torch.float32, device=device) for x in rs]
        out = ns
    sizes = [m.numel() for m in ms]
    aligned = all(x.data_ptr() % 16 == 0 for xs in (ms, vs, rs, ns) for x in xs)
    for lo in range(0, len(ms), _MAX_TENSORS):
        hi = lo + _MAX_TENSORS
        blocks = _block_map(sizes[lo:hi], device)
        if blocks is None:
            continue
        tables = [_addresses(ms[lo:hi], device, True), _addresses(vs[lo:hi], device, True),
                  _addresses(rs[lo:hi], device, False), _addresses(ns[lo:hi], device, False)]
        size_t, block_tensor, block_index = blocks
        _adam_kernel[(block_tensor.numel(),)](
            *tables, size_t, block_tensor, block_index, float(b1), 1.0 - b1, float(b2),
            1.0 - b2, float(eps), EPS_INSIDE=bool(eps_inside),
            R_BF16=r_dtype == torch.bfloat16, ALIGNED=aligned, BLOCK=_BLOCK,
            num_warps=_WARPS, **NO_FP_FUSION)
    return out


_BLOCKS: dict[tuple[tuple[int, ...], str], tuple[torch.Tensor, ...] | None] = {}


def _block_map(sizes: list[int], device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """``(sizes, block_tensor, block_index)`` on ``device``: each tensor's size, and for
    each program the tensor and the block of it that it steps (cached by the sizes: a
    model's are the same at every step); None when there is nothing to step."""
    key = (tuple(sizes), str(device))
    if key not in _BLOCKS:
        if len(_BLOCKS) >= _TABLES_MAX:
            _BLOCKS.clear()
        tensor, index = block_map(sizes, _BLOCK)
        _BLOCKS[key] = None if tensor.numel() == 0 else tuple(x.to(device) for x in (
            torch.tensor(sizes, dtype=torch.int64), tensor, index))
    return _BLOCKS[key]
