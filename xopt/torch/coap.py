"""COAP as a ``torch.optim.Optimizer``: :mod:`xopt.specs.coap`'s update, per parameter.

Each update calls :func:`xopt.specs.coap.param_step` with ``xp=torch``: the same function the
float64 oracle runs, so there is one definition of the arithmetic. This module adds what a
torch optimizer needs around it (see :class:`xopt.torch._lowrank.LowRankOptimizer`): param
groups, validation naming the parameter, the finiteness check, decompositions that raise
:class:`~xopt.errors.DecompositionError` naming the parameter instead of writing NaN into
``P``, low-precision parameters with float32 state, and state dicts of tensors only.

State per parameter (``optimizer.state[p]``, the spec's ``"xopt.torch"`` naming):
``step`` (int64 CPU tensor), ``exp_avg`` (M; absent for Adafactor with ``b1=None``),
``exp_avg_sq`` (AdamW v; Adafactor v of tensors with fewer than 2 dims),
``exp_avg_sq_row``/``exp_avg_sq_col`` (Adafactor, factored), ``RMS`` (Adafactor),
``ortho_matrix`` (P, projected matrices only). The authors keep ``P`` inside a projector
object (``state["projector"].ortho_matrix``); xopt keeps the tensor itself, so
``state_dict()`` loads with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from xopt.registry import register
from xopt.specs import coap as _spec
from xopt.torch._lowrank import LowRankOptimizer
from xopt.torch.distributed import local, place_as

__all__ = ["COAP"]

# canonical state variable -> this optimizer's state key
_KEYS = {"m": "exp_avg", "v": "exp_avg_sq", "v_row": "exp_avg_sq_row",
         "v_col": "exp_avg_sq_col", "rms": "RMS", "P": "ortho_matrix"}


class COAP(LowRankOptimizer):
    r"""COAP (Xiao et al., CVPR 2025): AdamW or Adafactor on low-rank projected gradients,
    the projection moved by one SGD step on Eqn 6 every ``update_interval`` updates and
    recomputed by Eqn 7 every ``update_interval × reproject_factor``.

    Args:
      params: parameters, or param groups (dicts) that override any field of
        :class:`xopt.specs.coap.COAP` by keyword or with their own ``"spec"``. A group with
        ``project=False`` takes the base update unprojected (the authors' groups without
        ``proj_method``); with ``project="auto"`` (default) a matrix is projected unless
        ``rank ≥ min(shape)``; with ``project=True`` every matrix is, and a rank larger than
        a matrix is an error naming it. Only matrices are projected.
      spec: a :class:`xopt.specs.coap.COAP` (instead of keywords).
      preset: ``"adamw"`` (the authors' ``CoapAdamW`` defaults, also the class defaults) or
        ``"adafactor"`` (``CoapAdafactor``'s, with ``b1=None``).
      nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` (:mod:`xopt.nonfinite`);
        ``check_finite=True`` is the older spelling of ``"raise"``.
      **hyperparameters: fields of :class:`xopt.specs.coap.COAP` (``lr``, ``rank``,
        ``rank_ratio``, ``update_interval``, ``reproject_factor``, ...).

    ``step(closure=None, *, inject=None)``: ``inject={param: {"ortho_matrix": P}}`` makes
    an update that decomposes (the first, and every Eqn-7 one) use ``P`` instead; the
    parity harness feeds the original's recorded projections this way.

    Example::

        opt = xopt.torch.COAP([{"params": matrices}, {"params": others, "project": False}],
                              lr=1e-3, rank=128, update_interval=32, reproject_factor=5)
        opt = xopt.torch.COAP(model.parameters(), preset="adafactor", lr=1e-2, b1=0.9,
                              rank_ratio=4)
    """

    hyperparams_cls = _spec.COAP
    spec = _spec.SPEC
    state_keys = _KEYS
    step_kind = torch.int64

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], *,
                 spec: _spec.COAP | None = None, preset: str | None = None,
                 nonfinite: str | None = None, check_finite: bool | None = None,
                 **hyperparameters: Any) -> None:
        super().__init__(params, spec=spec, preset=preset, nonfinite=nonfinite,
                         check_finite=check_finite, **hyperparameters)

    def _check_param(self, p: Tensor, hp: _spec.COAP, where: str) -> None:
        _spec.check_param(tuple(p.shape), hp, where)

    def _prepare(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: _spec.COAP,
                 name: str, inject: Mapping[str, Tensor] | None) -> Any:
        """``{"ortho_matrix": P}``: the new projection when this update decomposes (the
        first update and every Eqn-7 one; :func:`xopt.specs.coap.decompose`), else None."""
        shape = tuple(p.shape)
        if not _spec.is_projected(shape, hp):
            return None
        t = int(state["step"]) if "step" in state else 0
        ev = _spec.event(t, hp)
        if ev not in (_spec.INITIAL, _spec.EQN7):
            return None
        dtype = self.state_dtype(p)
        if inject is not None and "ortho_matrix" in inject:
            return {"ortho_matrix": inject["ortho_matrix"].to(device=p.device, dtype=dtype)}
        side = _spec.side_of(shape)
        if ev == _spec.INITIAL:
            om = _spec.initial_omega(hp, shape, backend="torch", device=p.device).to(dtype)
        else:
            om = _spec.warm_omega(state["ortho_matrix"], side)
        p_new = _spec.decompose(torch, self._grad32(g).to(dtype), om, side,
                                qr=lambda a: self.qr(a, name), svd=lambda a: self.svd(a, name))
        return {"ortho_matrix": p_new}

    def _update(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: _spec.COAP,
                name: str, inject: Mapping[str, Tensor] | None, prepared: Any) -> None:
        shape = tuple(p.shape)
        dtype = self.state_dtype(p)
        if "step" not in state:
            state["step"] = torch.tensor(0, dtype=torch.int64)
            for v in _spec.STATE.vars:
                if v.scope == "param" and v.exists_for(shape, hp):
                    state[_KEYS[v.name]] = place_as(p, torch.zeros(
                        v.shape(shape, hp), dtype=dtype, device=local(p).device))
        t = int(state["step"])
        st = {var: state[key] for var, key in _KEYS.items() if key in state}

        def no_decomposition(a: Tensor) -> Any:  # every decomposition is _prepare's
            raise AssertionError(f"COAP: {name}: a decomposition outside _prepare")

        new_p, st = _spec.param_step(
            torch, hp, p.detach().to(dtype), g.to(dtype), st, t, inject=prepared,
            qr=no_decomposition, svd=no_decomposition)
        for var, value in st.items():
            state[_KEYS[var]] = value
        state["step"] = torch.tensor(t + 1, dtype=torch.int64)
        self.write(p, new_p)


register("coap", "torch", COAP)
