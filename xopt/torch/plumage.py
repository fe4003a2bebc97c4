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

from xopt import random as xrandom
from xopt.errors import HyperparameterError
from xopt.registry import register
from xopt.specs import lowrank
from xopt.specs import plumage as _spec
from xopt.torch._lowrank import LowRankOptimizer, chunks, stack_as
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
        ``eps_inside_sqrt``, ``project``, ``proj_dtype``).

    Precision: state is float32 (float64 for float64 parameters). ``proj_dtype="state"``
    (default) computes the whole step there and rounds it into the parameter once;
    ``proj_dtype="param"`` multiplies a bfloat16/float16 matrix's projections in its own
    dtype (``P`` and ``D⁻¹ N`` rounded to it) and adds the update to it there, as GaLore's
    code, on which the paper's experiments run (:mod:`xopt.specs.plumage`). Float32 and
    float64 parameters step alike under both.
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

    # -- the batched step: same-shaped matrices at the same step together. At a refresh the
    # SVDs run batched (_prepare_batch, before anything is written), and the refresh block
    # (Algorithm 2's probabilities, Algorithm 3's draws and sampling, Algorithm 4, the
    # realignment of Eq. 28-29) evaluates the spec's functions over the stack
    # (torch.func.vmap: one batched kernel sequence, the per-parameter arithmetic; the
    # random words of every matrix come from one Threefry call keyed per matrix); then one
    # Adam step (LowRankOptimizer._hf_adam_batch, update_param's arithmetic). Injected
    # values, DTensors and a tensor learning rate take update_param per parameter.
    def _batchable(self, it: Item, hp: _spec.PLUMAGE,
                   inject: Mapping[str, Tensor] | None) -> bool:
        return not (inject or is_dtensor(it.param) or not isinstance(hp.lr, (int, float)))

    def _refresh_runs(self, items: list[Item], hps: Mapping[int, _spec.PLUMAGE], which: int
                      ) -> list[tuple[tuple[Any, ...], list[Item]]]:
        """The projected items whose update decomposes (``which=0``) or resamples (1),
        grouped by (group, step, state dtype, device, shape), in runs of BATCH_ELEMENTS."""
        groups: dict[Any, list[Item]] = {}
        for it in items:
            p, hp, state = it.param, hps[it.gi], self.state[it.param]
            shape = tuple(p.shape)
            t = int(state["step"]) if "step" in state else 0
            if _spec.is_projected(shape, hp) and _spec.resample_now(hp, t)[which]:
                groups.setdefault((it.gi, t, self.state_dtype(p), p.device, shape),
                                  []).append(it)
        return [(key, run) for key, its in groups.items() for run in chunks(its, key[-1])]

    def _prepare_batch(self, items: list[Item], hps: Mapping[int, _spec.PLUMAGE]
                       ) -> dict[int, tuple[Tensor, Tensor]]:
        """``(U, σ)`` of the oriented gradient of every item whose update decomposes
        (:func:`xopt.specs.plumage.decompose`), one batched SVD per oriented shape (a
        right-projected ``(n, m)`` matrix decomposes with the left-projected ``(m, n)``), in
        chunks of at most BATCH_ELEMENTS elements: each chunk stacked from the gradients
        when it is decomposed, so that the temporaries stay a chunk's."""
        kinds: dict[Any, list[tuple[Tensor, Item]]] = {}
        for (gi, _, sdt, _, shape), run in self._refresh_runs(items, hps, 0):
            left = _spec.side_of(shape, hps[gi]) == "left"
            for it in run:
                g = it.grad if left else it.grad.mT
                kinds.setdefault((tuple(g.shape), sdt, g.device), []).append((g, it))
        out = {}
        for (shape, sdt, _), entries in kinds.items():
            for chunk in chunks(entries, shape):
                a = stack_as([g for g, _ in chunk], sdt)
                u, s, _ = self.svd_stacked(a, [self.param_name(it.gi, it.i) for _, it in chunk])
                for j, (_, it) in enumerate(chunk):
                    out[id(it.param)] = (u[j], s[j])
        return out

    def _update_batch(self, items: list[Item], hps: Mapping[int, _spec.PLUMAGE],
                      prepared: dict[int, tuple[Tensor, Tensor]]) -> None:
        for it in items:
            state = self.state[it.param]
            if "step" not in state:
                self._init_state(it.param, state, hps[it.gi])
        for (gi, t, _, _, shape), run in self._refresh_runs(items, hps, 1):
            self._refresh_run(run, hps[gi], t, shape, prepared)
        self._hf_adam_batch(items, hps, self._side, "exp_avg", "exp_avg_sq", "projector")

    def _refresh_run(self, run: list[Item], hp: _spec.PLUMAGE, t: int,
                     shape: tuple[int, ...], prepared: dict[int, tuple[Tensor, Tensor]]
                     ) -> None:
        """:func:`xopt.specs.plumage.refresh` of every item of ``run`` (one shape, step
        ``t``), over the stack."""
        side = _spec.side_of(shape, hp)
        states = [self.state[it.param] for it in run]
        svd = _spec.resample_now(hp, t)[0]
        if svd:
            basis = torch.stack([prepared[id(it.param)][0] for it in run])
            sigma = torch.stack([prepared[id(it.param)][1] for it in run])
            probs = torch.vmap(lambda s: _spec.inclusion_probabilities(
                torch, s, hp.rank, hp.prob_eps)[1])(sigma)
            if _spec.needs_basis(hp):
                torch._foreach_copy_([st["basis"] for st in states], list(basis.unbind(0)))
                torch._foreach_copy_([st["probs"] for st in states], list(probs.unbind(0)))
        else:
            basis = torch.stack([st["basis"] for st in states])
            probs = torch.stack([st["probs"] for st in states])
        perm, u = draws(hp.seed, [self._index[id(it.param)] for it in run], t,
                        probs.shape[-1], probs.device)

        def sample(basis: Tensor, probs: Tensor, perm: Tensor, u: Tensor, m: Tensor,
                   v: Tensor, old: Tensor) -> tuple[Tensor, ...]:
            idx = _spec.sample_indices(torch, probs, hp.rank, perm, u)
            proj, dvec = _spec.sample_projection(torch, basis, probs, idx)
            m, v = _spec.realign(torch, m, v, proj, old, side,
                                 first=hp.realign_first_moment,
                                 second=hp.realign_second_moment)
            return proj, dvec, m, v

        stacked = [torch.stack([st[k] for st in states])
                   for k in ("exp_avg", "exp_avg_sq", "projector")]
        new = torch.vmap(sample)(basis, probs, perm, u, *stacked)
        for key, value in zip(("projector", "scale", "exp_avg", "exp_avg_sq"), new,
                              strict=True):
            torch._foreach_copy_([st[key] for st in states], list(value.unbind(0)))

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
    def _eps_inside_sqrt(hp: Any) -> bool:
        return bool(hp.eps_inside_sqrt)

    @staticmethod
    def _batch_back(n: Tensor, proj: Tensor, states: list[dict[str, Any]], which: str,
                    hp: Any) -> Tensor:
        """:func:`xopt.specs.plumage.project_back`: ``P D⁻¹ N`` or ``N D⁻¹ Pᵀ``, in
        ``proj``'s dtype (``N D⁻¹`` rounded to it)."""
        d = torch.stack([st["scale"] for st in states])
        if which == "left":
            return torch.bmm(proj, (n / d[:, :, None]).to(proj.dtype))
        return torch.bmm((n / d[:, None, :]).to(proj.dtype), proj.mT)

    def _init_state(self, p: Tensor, state: dict[str, Any], hp: _spec.PLUMAGE) -> None:
        state["step"] = 0
        for k, v in _spec.init_param_state(torch, hp, tuple(p.shape), self.state_dtype(p),
                                           like=p).items():
            state[_STATE_KEYS[k]] = v

    def _update(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: _spec.PLUMAGE,
                name: str, inject: Mapping[str, Tensor] | None, prepared: Any) -> None:
        dtype = self.state_dtype(p)
        if "step" not in state:
            self._init_state(p, state, hp)
        t = int(state["step"])
        st = {k: state[key] for k, key in _STATE_KEYS.items() if key in state}
        g = g.to(dtype)
        # proj_dtype="param": the spec steps a projected p in its own dtype (g stays wide for
        # the refresh; the spec rounds it for the product, exactly)
        low = _spec.is_projected(tuple(p.shape), hp) and lowrank.product_dtype(
            hp.proj_dtype, p.dtype, dtype) is not None
        new_p, st = _spec.update_param(torch, hp, p if low else p.to(dtype), g, st, t,
                                       self._index[id(p)], inject, decomposition=prepared)
        self.write(p, new_p)
        for k, v in st.items():
            state[_STATE_KEYS[k]] = v
        state["step"] = t + 1


def draws(seed: int, indices: list[int], t: int, d: int, device: torch.device
          ) -> tuple[Tensor, Tensor]:
    """:func:`xopt.specs.plumage.draw` of parameters ``indices`` at step ``t``, stacked:
    ``(perm (B, d), u (B,))``. The words of parameter ``i`` are blocks ``0..d`` of stream
    ``fold_in(seed, i, t)`` (``xopt.random.bits(s, (2d + 1,))``: word ``k`` is word ``k % 2``
    of block ``k // 2``), computed by one Threefry call keyed per parameter."""
    keys = [xrandom.key_from_seed(_spec.draw_seed(seed, i, t)) for i in indices]
    k0 = torch.tensor([k[0] for k in keys], dtype=torch.int64, device=device)[:, None]
    k1 = torch.tensor([k[1] for k in keys], dtype=torch.int64, device=device)[:, None]
    counters = torch.arange(d + 1, dtype=torch.int64, device=device)[None, :]
    y0, y1 = xrandom.threefry2x32(k0, k1, 0, counters, backend="torch", device=device)
    words = torch.stack((y0, y1), dim=-1).reshape(len(indices), 2 * d + 2)
    u = (words[:, 2 * d] >> 8).to(torch.float32) * 2.0**-24
    perm = torch.vmap(lambda w: _spec.permutation_from_words(torch, w))(
        words[:, :2 * d].reshape(-1, 2, d))
    return perm, u


register("plumage", "torch", PLUMAGE)
