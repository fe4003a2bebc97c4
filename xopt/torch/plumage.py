"""PLUMAGE with Adam as a ``torch.optim.Optimizer``, computing :mod:`xopt.specs.plumage`'s math.

Every step calls the spec's per-parameter functions (:func:`xopt.specs.plumage.update_param`:
Algorithm 5's loop body of the paper); this module adds the torch glue of
:class:`~xopt.torch._lowrank.LowRankOptimizer` (param groups, validation naming the
parameter, ``nonfinite=``, SVD failures raised as :class:`~xopt.errors.DecompositionError`
before anything is written, state dicts that load with ``weights_only=True``).

>>> opt = PLUMAGE([{"params": matrices, "rank": 128, "update_proj_gap": 200},
...                     {"params": others, "project": False}], lr=1e-3)

State per parameter (``optimizer.state[p]``): ``step`` (a Python int, the updates taken),
``exp_avg``/``exp_avg_sq`` (Adam's M and V: ``(k, n)`` for a left projection, ``(m, k)``
for a right one, the parameter's shape when not projected), and for projected matrices
``projector`` (P, ``(m, k)`` or ``(n, k)``), ``scale`` (diag D, ``(k,)``) and, when
``resample_interval`` is not a multiple of ``update_proj_gap``, ``basis`` and ``probs``
(the last SVD's singular vectors and inclusion probabilities). float32 for float32,
bfloat16 and float16 parameters; float64 for float64 ones.

Random stream: parameter number ``i`` (counting over all param groups in order) draws its
permutation and offset at step ``t`` from ``xopt.random`` with seed
``fold_in(seed, i, t)``; ``xopt.jax.plumage`` draws the same for the ``i``-th leaf, so the
two backends agree when the parameters are listed in the same order.

``step(closure=None, *, inject=None)``: ``inject={param: {key: tensor}}`` with the keys of
:data:`xopt.specs.plumage.INJECT_KEYS` (a sampled index set, an SVD) makes a refresh use
them instead of drawing or decomposing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from xopt.errors import HyperparameterError
from xopt.registry import register
from xopt.specs import plumage as _spec
from xopt.torch._lowrank import LowRankOptimizer
from xopt.torch._optim import Item
from xopt.torch.distributed import is_dtensor

__all__ = ["PLUMAGE"]

_STATE_KEYS = {"m": "exp_avg", "v": "exp_avg_sq", "projector": "projector", "scale": "scale",
               "basis": "basis", "probs": "probs"}


class PLUMAGE(LowRankOptimizer):
    r"""Adam with PLUMAGE's sampled one-sided projections (Haroush & Soudry, Algorithm 5).

    .. math::
        R = P^\top G,\quad M \leftarrow \beta_1 M + (1-\beta_1) R,\quad
        V \leftarrow \beta_2 V + (1-\beta_2) R^{\circ 2}

        W \leftarrow W - \eta\,\frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\;
        P D^{-1} \frac{M}{\sqrt{V} + \epsilon}

    with ``P = U[:, I]``, ``D = diag(p[I])``, ``I`` a sample of exactly ``k`` singular
    vectors with the min-variance unbiased inclusion probabilities ``p`` (Eq. 18), refreshed
    every ``update_proj_gap`` steps by an SVD (resampled every ``resample_interval``), and
    the moments realigned on every new ``P`` (Eq. 28-29).

    Args:
      params: parameters or param groups; a group may set any field of
        :class:`xopt.specs.plumage.PLUMAGE` (``rank``, ``update_proj_gap``, ``project``, ...)
        or give its own ``"spec"``.
      lr, betas, eps, weight_decay: Adam's (defaults 1e-3, (0.9, 0.999), 1e-8, 0.0: the
        paper's Section 4.4).
      preset: ``"paper"`` or ``"glue"`` (see :data:`xopt.specs.plumage.PRESETS`).
      spec: a :class:`~xopt.specs.plumage.PLUMAGE` giving all hyperparameters at once.
      nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` (:mod:`xopt.nonfinite`);
        ``check_finite=True`` is the older spelling of ``"raise"``.
      svd_driver: how refreshes decompose (:data:`xopt.torch._lowrank.SVD_DRIVERS`; None:
        ``torch.linalg.svd``'s default, as the spec).
      **hyperparameters: any other field of the spec (``rank``, ``update_proj_gap``,
        ``resample_interval``, ``proj_side``, ``realign_first_moment``,
        ``realign_second_moment``, ``prob_eps``, ``seed``, ``correct_bias``,
        ``eps_inside_sqrt``, ``project``).
    """

    hyperparams_cls = _spec.PLUMAGE
    spec = _spec.SPEC
    state_keys = _STATE_KEYS

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]],
                 lr: float | Tensor | None = None, betas: tuple[float, float] | None = None,
                 eps: float | None = None, weight_decay: float | None = None, *,
                 preset: str | None = None, spec: _spec.PLUMAGE | None = None,
                 nonfinite: str | None = None, check_finite: bool | None = None,
                 **hyperparameters: Any) -> None:
        if betas is not None:
            if len(betas) != 2:
                raise HyperparameterError(f"PLUMAGE.betas = {betas!r}: must be a pair")
            hyperparameters.update(b1=betas[0], b2=betas[1])
        self._index: dict[int, int] = {}
        super().__init__(params, spec=spec, preset=preset, nonfinite=nonfinite,
                         check_finite=check_finite, lr=lr, eps=eps, weight_decay=weight_decay,
                         **hyperparameters)

    def _check_param(self, p: Tensor, hp: _spec.PLUMAGE, where: str) -> None:
        _spec.check_param(tuple(p.shape), hp, where)

    @torch.compiler.disable(reason=(
        "PLUMAGE.step reads its step counters and refresh schedule on the host and decomposes "
        "gradients at refresh steps"))
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *,
             inject: Mapping[Tensor, Mapping[str, Tensor]] | None = None) -> Any:
        """One update of every parameter that has a gradient (see the class docstring)."""
        flat = [p for group in self.param_groups for p in group["params"]]
        self._index = {id(p): i for i, p in enumerate(flat)}
        return super().step(closure, inject=inject)

    def _prepare(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: _spec.PLUMAGE,
                 name: str, inject: Mapping[str, Tensor] | None) -> Any:
        """``(U, σ)`` of this update's SVD (an SVD step of a projected matrix), else None."""
        shape = tuple(p.shape)
        t = int(state["step"]) if "step" in state else 0
        if not (_spec.is_projected(shape, hp) and _spec.resample_now(hp, t)[0]):
            return None
        g = self._grad32(g).to(self.state_dtype(p))
        decomposition = _spec.injected_decomposition(torch, inject, g)
        if decomposition is None:
            side = _spec.side_of(shape, hp)
            u, s, _ = self.svd(_spec.oriented(torch, g, side), name)
            decomposition = (u, s)
        return decomposition

    def _svd_input(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: _spec.PLUMAGE,
                   inject: Mapping[str, Tensor] | None) -> Tensor | None:
        """The oriented gradient :meth:`_prepare` decomposes (same-shaped ones in a batch)."""
        shape = tuple(p.shape)
        t = int(state["step"]) if "step" in state else 0
        if not (_spec.is_projected(shape, hp) and _spec.resample_now(hp, t)[0]) or (
                inject and "svd_u" in inject):
            return None
        g = self._grad32(g).to(self.state_dtype(p))
        return _spec.oriented(torch, g, _spec.side_of(shape, hp))

    # -- the batched step: updates that do not resample (Adam on R = Pᵀ G with the kept P
    # and D, xopt.specs.plumage.update_param's arithmetic), same-shaped matrices together
    # (LowRankOptimizer._hf_adam_batch); resampling updates take update_param per parameter
    def _batchable(self, it: Item, hp: _spec.PLUMAGE,
                   inject: Mapping[str, Tensor] | None) -> bool:
        state = self.state[it.param]
        if (inject or "step" not in state or is_dtensor(it.param)
                or not isinstance(hp.lr, (int, float))):
            return False
        shape = tuple(it.param.shape)
        return not _spec.is_projected(shape, hp) or not _spec.resample_now(
            hp, int(state["step"]))[1]

    def _prepare_batch(self, items: list[Item], hps: Mapping[int, _spec.PLUMAGE]) -> None:
        return None  # batched updates keep their projection

    def _update_batch(self, items: list[Item], hps: Mapping[int, _spec.PLUMAGE],
                      prepared: None) -> None:
        self._hf_adam_batch(items, hps, self._side, "exp_avg", "exp_avg_sq", "projector")

    @staticmethod
    def _side(p: Tensor, hp: _spec.PLUMAGE) -> str | None:
        shape = tuple(p.shape)
        return _spec.side_of(shape, hp) if _spec.is_projected(shape, hp) else None

    @staticmethod
    def _batch_project(g: Tensor, proj: Tensor, which: str) -> Tensor:
        """:func:`xopt.specs.plumage.project`: ``Pᵀ G`` (left) or ``G P`` (right)."""
        return torch.bmm(proj.mT, g) if which == "left" else torch.bmm(g, proj)

    @staticmethod
    def _batch_directions(ms: list[Tensor], vs: list[Tensor], hp: Any) -> list[Tensor]:
        """:func:`xopt.specs.plumage.adam_direction` of each pair."""
        if not hp.eps_inside_sqrt:
            return LowRankOptimizer._batch_directions(ms, vs, hp)
        return torch._foreach_div(ms, torch._foreach_sqrt(torch._foreach_add(vs, hp.eps)))

    @staticmethod
    def _batch_back(n: Tensor, proj: Tensor, states: list[dict[str, Any]], which: str,
                    hp: Any) -> Tensor:
        """:func:`xopt.specs.plumage.project_back`: ``P D⁻¹ N`` or ``N D⁻¹ Pᵀ``."""
        d = torch.stack([st["scale"] for st in states])
        if which == "left":
            return torch.bmm(proj, n / d[:, :, None])
        return torch.bmm(n / d[:, None, :], proj.mT)

    def _update(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: _spec.PLUMAGE,
                name: str, inject: Mapping[str, Tensor] | None, prepared: Any) -> None:
        dtype = self.state_dtype(p)
        shape = tuple(p.shape)
        if "step" not in state:
            state["step"] = 0
            for k, v in _spec.init_param_state(torch, hp, shape, dtype, like=p).items():
                state[_STATE_KEYS[k]] = v
        t = int(state["step"])
        st = {k: state[key] for k, key in _STATE_KEYS.items() if key in state}
        g = g.to(dtype)
        new_p, st = _spec.update_param(torch, hp, p.to(dtype), g, st, t, self._index[id(p)],
                                       inject, decomposition=prepared)
        self.write(p, new_p)
        for k, v in st.items():
            state[_STATE_KEYS[k]] = v
        state["step"] = t + 1


register("plumage", "torch", PLUMAGE)
