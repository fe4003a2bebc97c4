"""Flora as a ``torch.optim.Optimizer``, computing :mod:`xopt.specs.flora`'s math.

Each parameter's update is :func:`xopt.specs.flora.update_param` evaluated with torch: the
original's torch operations in its order (``flora_opt/optimizers/torch/flora.py``,
``flora_step_``), so on the CPU this optimizer reproduces ``flora_opt.Flora`` bit for bit
once both use the same projections (the golden trace's, injected). Its state uses the
original's keys (``step``, ``seed``, ``RMS``, ``exp_avg``, ``exp_avg_sq_row``,
``exp_avg_sq_col``, ``exp_avg_sq``; ``step`` and ``seed`` Python ints), so state dicts
interchange with the original's, and load with ``weights_only=True``.

What differs from the original (each documented in :mod:`xopt.specs.flora`):
  * projections come from :mod:`xopt.random` keyed by the seed (same matrices in torch,
    JAX and NumPy, on every device), not from ``torch.randn``; the seed sequence itself
    (``seed + i``, ``next_seed``) is the original's; on CUDA one Triton launch per draw
    (:mod:`xopt.kernels.normal`, ``XOPT_NORMAL``) gives those bits;
  * ``quantization=True`` is refused; ``project=False`` (per group) keeps the momentum
    full; a matrix whose rank would exceed its smaller side raises, naming it;
  * off the CPU the parameter-scale comparison and the weight-decay factor stay on the
    device (the original synchronises twice per parameter); rounding may differ there by
    an ulp;
  * parameters added with ``add_param_group`` later get seeds continuing the count (the
    original gives them none and fails at their first compressed update);
  * bfloat16/float16 parameters keep float32 state; ``nonfinite=``;
    ``step(inject=...)`` (see :class:`~xopt.torch._lowrank.LowRankOptimizer`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from xopt import random as xrandom
from xopt.errors import StateError
from xopt.kernels import triton_available
from xopt.registry import register
from xopt.specs import arrays
from xopt.specs import flora as _spec
from xopt.torch._lowrank import LowRankOptimizer, chunks, stack_as
from xopt.torch._optim import Item, Layout
from xopt.torch.distributed import is_dtensor, local, place_as, state_zeros

__all__ = ["Flora"]

_STATE_KEYS = {"m": "exp_avg", "v_row": "exp_avg_sq_row", "v_col": "exp_avg_sq_col",
               "v": "exp_avg_sq"}


class Flora(LowRankOptimizer):
    r"""Flora: Adafactor with momentum compressed by seeded Gaussian projections.

    Args:
      params: parameters or param groups; a group may override any field below (by key,
        or with its own ``"spec"``), e.g. ``{"params": biases, "project": False}``.
      lr, rank, kappa, eps, clip_threshold, decay_rate, beta1, weight_decay,
        scale_parameter, relative_step, warmup_init, factorize_second_moment, seed,
        quantization: as ``flora_opt.Flora`` (same defaults; see
        :class:`xopt.specs.flora.Flora`). ``beta1=None`` (the default) is Adafactor
        without momentum, as in the original: pass ``beta1=0.9`` and a ``rank`` for
        Flora's compressed momentum.
      project: False keeps the group's momentum uncompressed.
      spec: an :class:`xopt.specs.flora.Flora` instead of the fields.
      nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` (:mod:`xopt.nonfinite`);
        ``check_finite=True`` is the older spelling of ``"raise"``.

    Shapes and dtypes: any floating parameter (float32, float64, bfloat16, float16). State
    (float32, float64 for float64 parameters): ``exp_avg`` ``(r, n)`` (left, ``m < n``) or
    ``(m, r)`` (right) for compressed matrices, else the parameter's shape;
    ``exp_avg_sq_row`` ``(m,)`` and ``exp_avg_sq_col`` ``(n,)`` for matrices, else
    ``exp_avg_sq`` of the parameter's shape; ``RMS`` a 0-d tensor; ``step``, ``seed`` ints.

    ``step(inject={p: {"proj_before": P, "proj_after": P'}})`` uses the given projections
    (shapes ``(r, m)`` left, ``(n, r)`` right, already divided by √r) instead of drawing.
    """

    hyperparams_cls = _spec.Flora
    spec = _spec.SPEC
    state_keys = {"seed": "seed", "rms": "RMS", **_STATE_KEYS}

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]],
                 lr: float | None = None, rank: int | None = None, kappa: int | None = None,
                 eps: tuple[float, float] | None = None, clip_threshold: float | None = None,
                 decay_rate: float | None = None, beta1: float | None = None,
                 weight_decay: float | None = None, scale_parameter: bool | None = None,
                 relative_step: bool | None = None, warmup_init: bool | None = None,
                 factorize_second_moment: bool | None = None, seed: int | None = None,
                 quantization: bool | None = None, *, project: bool | None = None,
                 spec: _spec.Flora | None = None, preset: str | None = None,
                 nonfinite: str | None = None, check_finite: bool | None = None) -> None:
        super().__init__(
            params, spec=spec, preset=preset, nonfinite=nonfinite, check_finite=check_finite,
            lr=lr, rank=rank,
            kappa=kappa, eps=tuple(eps) if eps is not None else None,
            clip_threshold=clip_threshold, decay_rate=decay_rate, beta1=beta1,
            weight_decay=weight_decay, scale_parameter=scale_parameter,
            relative_step=relative_step, warmup_init=warmup_init,
            factorize_second_moment=factorize_second_moment, seed=seed,
            quantization=quantization, project=project)

    def _initial_seed(self, p: Tensor) -> int:
        """The original's seeds: parameter i (1-based over all groups, in order) gets its
        group's seed + i. Drawn at ``p``'s first update, not at construction: an optimizer
        holds no state before its first step (DCP creates a fresh optimizer's state with a
        step, which it skips when any state exists)."""
        i = 0
        for group in self.param_groups:
            for q in group["params"]:
                i += 1
                if q is p:
                    return int(group["seed"]) + i
        raise StateError("Flora: a parameter outside the optimizer's groups")

    def _fresh_layouts(self, p: Tensor, group: Mapping[str, Any]) -> list[dict[str, Layout]]:
        return [{"seed": Layout((), int)}]  # state dicts of versions that seeded at construction

    def _check_param(self, p: Tensor, hp: _spec.Flora, where: str) -> None:
        _spec.check_param(tuple(p.shape), hp, where)

    def _prepare(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: _spec.Flora,
                 name: str, inject: Mapping[str, Tensor] | None) -> Any:
        return None

    # -- the batched step: factored matrices (Adafactor, with full, compressed or no
    # momentum) without weight decay, same-shaped ones stacked: xopt.specs.flora.update_param's
    # operations on (B, m, n) stacks, the projections of a stack drawn by one many-seed
    # normal (each row its parameter's own draw, bit for bit) and applied by one batched
    # product each way; every other parameter (1-D, weight decay, injected projections)
    # per parameter
    def _batchable(self, it: Item, hp: _spec.Flora,
                   inject: Mapping[str, Tensor] | None) -> bool:
        shape = tuple(it.param.shape)
        return (not inject and "step" in self.state[it.param] and not is_dtensor(it.param)
                and _spec.factored(shape, hp) and hp.weight_decay == 0)

    def _prepare_batch(self, items: list[Item], hps: Mapping[int, _spec.Flora]) -> None:
        return None

    def _update_batch(self, items: list[Item], hps: Mapping[int, _spec.Flora],
                      prepared: None) -> None:
        groups: dict[Any, list[Item]] = {}
        for it in items:
            p = it.param
            key = (it.gi, int(self.state[p]["step"]), self.state_dtype(p), p.device,
                   tuple(p.shape))
            groups.setdefault(key, []).append(it)
        for (gi, before, sdt, _, shape), its in groups.items():
            for run in chunks(its, shape):
                self._adafactor_run(run, hps[gi], before + 1, sdt)

    def _adafactor_run(self, its: list[Item], h: _spec.Flora, t: int, sdt: torch.dtype) -> None:
        ps = [it.param for it in its]
        states = [self.state[p] for p in ps]
        x = stack_as(ps, sdt)  # stacked and widened in one copy each
        g = stack_as([it.grad for it in its], sdt)
        bsz, m, n = x.shape
        root_n = (m * n) ** 0.5
        # without momentum, on a GPU (XOPT_ADAFACTOR): three fused passes over the stack
        kernel = None if h.use_momentum or sdt != torch.float32 else _adafactor(x.device)
        if kernel is not None:
            a_rows, a_cols, x_sq = kernel.stats(x, g, float(h.eps[0]))
            rho = arrays.divide(torch, torch.sqrt(x_sq), root_n)
        else:                                                             # rms
            rho = arrays.divide(torch, torch.linalg.vector_norm(x, dim=(-2, -1)), root_n)
        rel = _spec.relative_step_size(h, t)
        lr = rel                                                          # learning_rate
        if h.scale_parameter:
            eps1 = float(h.eps[1])
            lr = torch.where(rho > eps1, rho * rel, eps1 * rel)[:, None, None]
        b2, omb2 = _spec.beta2(t, h.decay_rate)
        if kernel is not None:
            mean_rows, mean_cols = a_rows / n, a_cols / m
        else:
            a = g * g + float(h.eps[0])                                   # second_moment_factored
            mean_rows, mean_cols = a.mean(dim=-1), a.mean(dim=-2)
            del a
        row = torch.add(torch.stack([st["exp_avg_sq_row"] for st in states]) * b2, mean_rows,
                        alpha=omb2)
        col = torch.add(torch.stack([st["exp_avg_sq_col"] for st in states]) * b2, mean_cols,
                        alpha=omb2)
        r = torch.rsqrt(row / row.mean(dim=-1, keepdim=True))
        if kernel is not None:                                            # clip and apply
            c = torch.rsqrt(col)
            u_rms = arrays.divide(torch, torch.sqrt(kernel.update_sumsq(g, r, c)), root_n)
            s = arrays.divide(torch, u_rms, h.clip_threshold).clamp(min=1.0)
            lr = (lr.reshape(bsz) if isinstance(lr, torch.Tensor)
                  else torch.full((bsz,), lr, dtype=torch.float32, device=x.device))
            x = kernel.apply(x, g, r, c, s, lr)
            del g
        else:
            u = (r.unsqueeze(-1) * torch.rsqrt(col.unsqueeze(-2))) * g
            del g
            shape = tuple(x.shape[1:])
            if h.use_momentum and _spec.compressed(shape, h):             # compressed
                u = self._compressed_momentum(states, u, h, t, shape)
            elif h.use_momentum:                                          # mix, uncompressed
                u = u * (1 - h.beta1) + torch.stack([st["exp_avg"] for st in states]) * h.beta1
                torch._foreach_copy_([st["exp_avg"] for st in states], u.unbind(0))
            u_rms = arrays.divide(torch, torch.linalg.vector_norm(u, dim=(-2, -1)),
                                  root_n)                                 # clip
            u = u / arrays.divide(torch, u_rms, h.clip_threshold).clamp(min=1.0)[:, None, None]
            x = x - u * lr                                                # apply (λ = 0)
        for st in states:
            st["step"] = t
        torch._foreach_copy_([st["exp_avg_sq_row"] for st in states], row.unbind(0))
        torch._foreach_copy_([st["exp_avg_sq_col"] for st in states], col.unbind(0))
        torch._foreach_copy_([st["RMS"] for st in states], rho.unbind(0))
        torch._foreach_copy_(ps, x.unbind(0))

    @staticmethod
    def _compressed_momentum(states: list[dict[str, Any]], u: Tensor, h: _spec.Flora, t: int,
                             shape: tuple[int, ...]) -> Tensor:
        """update_param's compressed momentum on a stack ``u`` (B, m, n): the update
        ``(1 − β₁) u + β₁ up(P, C)``, returned; ``C`` (moved to a fresh seed's projection
        at a transfer) and the seeds updated in ``states``."""
        which, b1 = _spec.side(shape), h.beta1
        seeds = [int(st["seed"]) for st in states]
        transfer = t % h.kappa == 0
        after = [_spec.next_seed(s) for s in seeds] if transfer else seeds
        if transfer:  # both seeds' projections in one draw
            both = projections(seeds + after, shape, h.rank, u.dtype, u.device)
            p_before, p_after = both[:len(seeds)], both[len(seeds):]
        else:
            p_before = p_after = projections(seeds, shape, h.rank, u.dtype, u.device)
        c = torch.stack([st["exp_avg"] for st in states])
        c_up = _up(p_before, c, which)
        mixed = _spec.mix(u, c_up, b1)
        if transfer:
            c = _down(p_after, c_up, which)
        c = _spec.accumulate(c, _down(p_after, u, which), b1)
        torch._foreach_copy_([st["exp_avg"] for st in states], c.unbind(0))
        for st, s in zip(states, after, strict=True):
            st["seed"] = s
        return mixed

    def _update(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: _spec.Flora,
                name: str, inject: Mapping[str, Tensor] | None, prepared: Any) -> None:
        sdt = self.state_dtype(p)
        shape = tuple(p.shape)
        if "step" not in state:
            zeros = dict(dtype=sdt, device=local(p).device)
            state.setdefault("seed", self._initial_seed(p))
            state["step"] = 0
            if hp.use_momentum:
                state["exp_avg"] = place_as(p, torch.zeros(_spec.momentum_shape(shape, hp),
                                                           **zeros))
            if _spec.factored(shape, hp):  # (FSDP2: the row statistic split as the rows)
                state["exp_avg_sq_row"] = state_zeros(p, drop=(len(shape) - 1,), dtype=sdt)
                state["exp_avg_sq_col"] = place_as(p, torch.zeros(shape[:-2] + shape[-1:],
                                                                  **zeros))
            else:
                state["exp_avg_sq"] = place_as(p, torch.zeros(shape, **zeros))
            state["RMS"] = place_as(p, torch.zeros((), **zeros))
        t = int(state["step"]) + 1
        p_c = p if p.dtype == sdt else p.to(sdt)
        g_c = g if g.dtype == sdt else g.to(sdt)
        st = {k: state[v] for k, v in _STATE_KEYS.items() if v in state}
        st["seed"] = int(state["seed"])
        inj = None
        if inject:
            inj = {k: v.to(device=p.device, dtype=sdt) for k, v in inject.items()}
        elif _spec.compressed(shape, hp) and _normal(p.device) is not None:
            # the spec's own draws, xopt.random's torch ops, are the kernel's bits: drawn by it
            seed = int(state["seed"])
            seeds = [seed, _spec.next_seed(seed)] if t % hp.kappa == 0 else [seed]
            drawn = projections(seeds, shape, hp.rank, sdt, p.device)
            inj = {"proj_before": drawn[0], "proj_after": drawn[-1]}
        new_p, new = _spec.update_param(torch, hp, p_c, g_c, st, t, inj, device=p.device)
        state["step"] = t
        state["seed"] = int(new["seed"])
        state["RMS"] = new["rms"]
        for k, v in _STATE_KEYS.items():
            if k in new:
                state[v].copy_(new[k])
        self.write(p, new_p)


def _adafactor(device: torch.device) -> Any:
    """:mod:`xopt.kernels.adafactor` where its passes run on ``device`` (its ``BACKEND``,
    ``XOPT_ADAFACTOR``), else None (the torch ops)."""
    if not triton_available():
        return None
    from xopt.kernels import adafactor

    return adafactor if adafactor.runs_on(device) else None


def _normal(device: torch.device) -> Any:
    """:mod:`xopt.kernels.normal` where it draws for ``device`` (its ``BACKEND``,
    ``XOPT_NORMAL``), else None (xopt.random's torch ops)."""
    if not triton_available():
        return None
    from xopt.kernels import normal

    return normal if normal.runs_on(device) else None


def projections(seeds: list[int], shape: tuple[int, ...], rank: int, dtype: torch.dtype,
                device: torch.device) -> Tensor:
    """:func:`xopt.specs.flora.projection` of each seed for a parameter of ``shape``,
    stacked ``(B, *projection_shape)``: one :func:`xopt.random.normal_many` draw (on CUDA
    one launch of :func:`xopt.kernels.normal.normal_many`, the same bits), so row ``j`` is
    ``projection(seeds[j], ...)`` bit for bit."""
    pshape = _spec.projection_shape(shape, rank)
    kernel = _normal(device)
    if kernel is not None:
        z = kernel.normal_many(seeds, pshape, dtype="float32", device=device)
    else:
        z = xrandom.normal_many(seeds, pshape, dtype="float32", backend="torch", device=device)
    return z.to(dtype) / math.sqrt(rank)


def _up(p: Tensor, c: Tensor, which: str) -> Tensor:
    """xopt.specs.flora.up on stacks: ``Pᵀ C`` (left) or ``C Pᵀ`` (right), batched."""
    return torch.matmul(p.mT, c) if which == "left" else torch.matmul(c, p.mT)


def _down(p: Tensor, x: Tensor, which: str) -> Tensor:
    """xopt.specs.flora.down on stacks: ``P X`` (left) or ``X P`` (right), batched."""
    return torch.matmul(p, x) if which == "left" else torch.matmul(x, p)


register("flora", "torch", Flora)
