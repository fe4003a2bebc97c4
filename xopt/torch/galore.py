"""GaLore as a ``torch.optim.Optimizer``, computing :mod:`xopt.specs.galore`'s math.

Under the default ``"authors"`` preset this is galore_torch's ``GaLoreAdamW`` (the authors'
code, jiaweizzhao/GaLore): the same projection sides, refresh rule, Adam arithmetic
(ε on the uncorrected √v, double-precision step size) and weight decay after the step;
``preset="optax"`` follows optax.contrib.galore instead. Param groups choose what is
projected, as in the authors' examples::

    opt = xopt.torch.GaLore(
        [{"params": regular, "project": False},          # the authors' group without "rank"
         {"params": matrices, "rank": 128, "update_proj_gap": 200, "scale": 0.25,
          "proj_type": "std"}],
        lr=0.01)

Groups may also give ``betas`` (split into ``b1``/``b2``). Tensors that are not matrices
always take the plain Adam step. State per parameter: ``step`` (int), ``exp_avg`` and
``exp_avg_sq`` (low-rank shape when projected), ``ortho_matrix`` (and, for
``proj_type="full"``, ``ortho_matrix_right``): tensors and ints only, so ``state_dict()``
loads with ``torch.load(..., weights_only=True)``; the authors keep a ``GaLoreProjector``
object there instead. ``step(inject={param: {"ortho_matrix": P}})`` uses ``P`` instead of
the SVD at a refresh (the parity harness feeds the authors' recorded projections).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from xopt.errors import HyperparameterError
from xopt.registry import register
from xopt.specs import Hyperparams, lowrank
from xopt.specs import galore as galore_spec
from xopt.torch._lowrank import LowRankOptimizer, chunks, stack_as
from xopt.torch._optim import Item
from xopt.torch.distributed import is_dtensor, local, place_as

__all__ = ["GaLore"]


def _split_betas(d: dict[str, Any], where: str) -> dict[str, Any]:
    d = dict(d)
    betas = d.pop("betas", None)
    if betas is not None:
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise HyperparameterError(f"{where}: betas = {betas!r} must be a pair (b1, b2)")
        d.update(b1=betas[0], b2=betas[1])
    return d


class GaLore(LowRankOptimizer):
    r"""GaLore (Zhao et al., 2024, Algorithm 2) with the authors' or optax's arithmetic.

    .. math::
        R_t = P_t^\top G_t \;(\text{or } G_t Q_t^\top),\quad
        m_t = \beta_1 m_{t-1} + (1-\beta_1) R_t,\quad v_t = \beta_2 v_{t-1} + (1-\beta_2) R_t^2

        W_t = W_{t-1} - \eta\,\frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\,
        \alpha\,P_t \frac{m_t}{\sqrt{v_t}+\epsilon}
        \quad(\text{then } W_t \mathrel{-}= \eta\lambda W_t)

    with :math:`P_t` refreshed from the SVD of :math:`G_t` every ``update_proj_gap`` updates.

    Args:
      params: parameters or param groups; a group may set any field below (or ``spec``, a
        :class:`xopt.specs.galore.GaLore`).
      lr, betas, eps, weight_decay, correct_bias: as the authors' ``GaLoreAdamW``.
      rank, update_proj_gap, scale, proj_type: the projection (``proj_type`` one of
        ``"std"``, ``"reverse_std"``, ``"left"``, ``"right"``, ``"full"``).
      project: project this group's matrices (default True); False gives every tensor the
        plain Adam step.
      proj_dtype: ``"state"`` (default) or ``"param"``: the dtype of the projections of
        bfloat16/float16 matrices (see below).
      eps_root, convention: see :class:`xopt.specs.galore.GaLore`.
      preset: ``"authors"`` (the default) or ``"optax"``: defaults for every field not given.
      spec: a :class:`xopt.specs.galore.GaLore` giving every field at once.
      nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` (:mod:`xopt.nonfinite`);
        ``check_finite=True`` is the older spelling of ``"raise"``.
      svd_driver: how refreshes decompose (:data:`xopt.torch._lowrank.SVD_DRIVERS`; None:
        ``torch.linalg.svd``'s default, as the spec; ``"gram"``: the float64 Gram matrix's
        eigenvectors, see :func:`xopt.torch._lowrank.gram_svd`).

    Shapes and dtypes: parameters float32/float64/bfloat16/float16, any shape; projected
    ones are matrices ``(m, n)`` with ``rank <= min(m, n)`` (else
    :class:`HyperparameterError` naming the parameter at construction). State is float32
    (float64 for float64 parameters). With ``proj_dtype="state"`` the step is computed
    there and rounded once into the parameter. With ``proj_dtype="param"`` a bfloat16 or
    float16 matrix is projected as the authors' code projects it: ``P`` (kept in float32)
    rounded to the parameter's dtype, both products in that dtype, the projected-back
    update added to the parameter there (``p.add_(U, alpha=-step_size)``, then the weight
    decay likewise); only the moments stay float32 (:mod:`xopt.specs.galore`). Float32 and
    float64 parameters, and tensors that are not projected, step alike under both. A
    refresh whose SVD fails raises :class:`xopt.errors.DecompositionError` naming the
    parameter, its projection untouched.
    """

    hyperparams_cls = galore_spec.GaLore
    spec = galore_spec.SPEC
    state_keys = {"m": "exp_avg", "v": "exp_avg_sq", "ortho": "ortho_matrix",
                  "ortho_right": "ortho_matrix_right"}

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]],
                 lr: float | None = None, betas: tuple[float, float] | None = None,
                 eps: float | None = None, weight_decay: float | None = None,
                 correct_bias: bool | None = None, *, rank: int | None = None,
                 update_proj_gap: int | None = None, scale: float | None = None,
                 proj_type: str | None = None, project: bool | None = None,
                 proj_dtype: str | None = None, eps_root: float | None = None,
                 convention: str | None = None,
                 preset: str | None = None, spec: galore_spec.GaLore | None = None,
                 nonfinite: str | None = None, check_finite: bool | None = None,
                 svd_driver: str | None = None) -> None:
        given = _split_betas(dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, correct_bias=correct_bias,
            rank=rank, update_proj_gap=update_proj_gap, scale=scale, proj_type=proj_type,
            project=project, proj_dtype=proj_dtype, eps_root=eps_root,
            convention=convention), "GaLore")
        super().__init__(params, spec=spec, preset=preset, nonfinite=nonfinite,
                         check_finite=check_finite, svd_driver=svd_driver,
                         **{k: v for k, v in given.items() if v is not None})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(_split_betas(param_group, "GaLore param group"))

    def _check_param(self, p: Tensor, hp: Hyperparams, where: str) -> None:
        if galore_spec.is_projected(tuple(p.shape), hp):
            lowrank.check_rank(hp.rank, tuple(p.shape), where)

    def _prepare(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: Hyperparams,
                 name: str, inject: Mapping[str, Tensor] | None) -> Any:
        """``(ortho, ortho_right)`` when this update refreshes the projection, else None."""
        shape = tuple(p.shape)
        if not galore_spec.is_projected(shape, hp) or not (
                "ortho_matrix" not in state
                or galore_spec.refresh_due(int(state.get("step", 0)), hp)):
            return None
        sdt = self.state_dtype(p)
        which = galore_spec.side(shape, hp.proj_type)
        old = (state.get("ortho_matrix"), state.get("ortho_matrix_right"))
        g = self._grad32(g)
        g = g if g.dtype == sdt else g.to(sdt)
        return lowrank.refresh(
            True, old,
            lambda: galore_spec.fresh_projection(
                torch, hp, g, svd=lambda a: self.svd(a, name))[:2],
            galore_spec.injected_projection(
                inject, old[1], which, cast=lambda a: a.to(device=p.device, dtype=sdt)))

    def _refreshes(self, shape: tuple[int, ...], state: Mapping[str, Any], hp: Hyperparams
                   ) -> bool:
        return galore_spec.is_projected(shape, hp) and (
            "ortho_matrix" not in state
            or galore_spec.refresh_due(int(state.get("step", 0)), hp))

    def _svd_input(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: Hyperparams,
                   inject: Mapping[str, Tensor] | None) -> Tensor | None:
        if not self._refreshes(tuple(p.shape), state, hp) or (
                inject and "ortho_matrix" in inject):
            return None
        sdt = self.state_dtype(p)
        g = self._grad32(g)
        return g if g.dtype == sdt else g.to(sdt)

    # -- the batched step (the authors' arithmetic: LowRankOptimizer._hf_adam_batch)
    def _batchable(self, it: Item, hp: Hyperparams,
                   inject: Mapping[str, Tensor] | None) -> bool:
        return (hp.convention == "authors" and not inject and not is_dtensor(it.param)
                and (not galore_spec.is_projected(tuple(it.param.shape), hp)
                     or galore_spec.side(tuple(it.param.shape), hp.proj_type) != "full"))

    def _prepare_batch(self, items: list[Item], hps: Mapping[int, Hyperparams]
                       ) -> list[tuple[list[Item], Tensor]]:
        """The new projections of the items whose update refreshes them: one batched SVD
        per run of same-shaped matrices of a group (:meth:`svd_stacked`), the projections
        stacked as the run's."""
        groups: dict[Any, list[Item]] = {}
        for it in items:
            p = it.param
            if self._refreshes(tuple(p.shape), self.state[p], hps[it.gi]):
                key = (it.gi, self.state_dtype(p), p.device, tuple(p.shape))
                groups.setdefault(key, []).append(it)
        out = []
        for (gi, sdt, _, shape), its in groups.items():
            hp = hps[gi]
            which = galore_spec.side(shape, hp.proj_type)
            for run in chunks(its, shape):
                u, _, vh = self.svd_stacked(stack_as([it.grad for it in run], sdt),
                                            [self.param_name(it.gi, it.i) for it in run])
                new = torch.vmap(lambda u, vh, which=which, rank=hp.rank:
                                 galore_spec.projector_from_svd(u, vh, rank, which)[0])(u, vh)
                out.append((run, new))
        return out

    def _update_batch(self, items: list[Item], hps: Mapping[int, Hyperparams],
                      prepared: list[tuple[list[Item], Tensor]]) -> None:
        for run, new in prepared:
            states = [self.state[it.param] for it in run]
            if all("ortho_matrix" in st for st in states):
                torch._foreach_copy_([st["ortho_matrix"] for st in states],
                                     list(new.unbind(0)))
            else:  # the first refresh: copies of their own, not views of the run's stack
                for st, proj in zip(states, new.unbind(0), strict=True):
                    st["ortho_matrix"] = proj.clone(memory_format=torch.contiguous_format)
        for it in items:
            p, hp, state = it.param, hps[it.gi], self.state[it.param]
            if "exp_avg" not in state:
                sdt = self.state_dtype(p)
                low = galore_spec.low_rank_shape(tuple(p.shape), hp)
                state["exp_avg"] = torch.zeros(low, dtype=sdt, device=p.device)
                state["exp_avg_sq"] = torch.zeros(low, dtype=sdt, device=p.device)
        self._hf_adam_batch(items, hps, self._galore_side, "exp_avg", "exp_avg_sq",
                            "ortho_matrix")

    @staticmethod
    def _galore_side(p: Tensor, hp: Hyperparams) -> str | None:
        shape = tuple(p.shape)
        return (galore_spec.side(shape, hp.proj_type)
                if galore_spec.is_projected(shape, hp) else None)

    def _update(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: Hyperparams,
                name: str, inject: Mapping[str, Tensor] | None, prepared: Any) -> None:
        sdt = self.state_dtype(p)
        g = g if g.dtype == sdt else g.to(sdt)
        shape = tuple(p.shape)
        before = int(state.get("step", 0))
        ortho = ortho_right = None
        if galore_spec.is_projected(shape, hp):
            which = galore_spec.side(shape, hp.proj_type)
            if prepared is not None:
                ortho, ortho_right = prepared
                # copies of their own: a row slice of Vᵀ would keep all of Vᵀ's storage
                state["ortho_matrix"] = ortho.clone(memory_format=torch.contiguous_format)
                if which == "full":
                    state["ortho_matrix_right"] = ortho_right.clone(
                        memory_format=torch.contiguous_format)
            ortho = state["ortho_matrix"]
            ortho_right = state.get("ortho_matrix_right") if which == "full" else None
        if "exp_avg" not in state:
            low = galore_spec.low_rank_shape(shape, hp)
            state["exp_avg"] = place_as(p, torch.zeros(low, dtype=sdt, device=local(p).device))
            state["exp_avg_sq"] = place_as(p, torch.zeros(low, dtype=sdt,
                                                          device=local(p).device))
        count = before + 1
        state["step"] = count
        if ortho is not None and lowrank.product_dtype(hp.proj_dtype, p.dtype, sdt) is not None:
            p_c, g = p, g.to(p.dtype)  # exact: g was widened from p's dtype
        else:
            p_c = p if p.dtype == sdt else p.to(sdt)
        new_p, m, v = galore_spec.tensor_update(
            torch, hp, p_c, g, state["exp_avg"], state["exp_avg_sq"], ortho, ortho_right,
            count, hp.lr)
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)
        self.write(p, new_p)


register("galore", "torch", GaLore)
