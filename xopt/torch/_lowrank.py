"""The base of xopt's low-rank gradient optimizers in PyTorch: everything but the method.

:class:`LowRankOptimizer` is an :class:`xopt.torch._optim.Optimizer` (the contract every
xopt optimizer keeps: validation naming what is at fault, all-or-nothing steps,
``nonfinite=``, strict state dicts) that gives GaLore, Flora, COAP and PLUMAGE one
behaviour around their updates:

* hyperparameters from ``spec=`` (the method's spec dataclass), a ``preset=``, or
  keywords; every param group may override any field, by keyword (torch's convention:
  ``{"params": ..., "rank": 128}``) or with its own ``"spec"``; groups hold plain values
  only, so ``state_dict()`` loads with ``torch.load(..., weights_only=True)``;
* projected parameters are chosen per group (``project=False`` steps a group with the
  method's full-rank base update, as the authors' "regular" group); tensors that are not
  matrices always take the base update;
* validation naming the parameter: a rank larger than the matrix, a non-positive
  interval, an unsupported dtype (floating only: float32, float64, bfloat16, float16;
  low-precision parameters keep float32 state and are written back rounded once);
* decompositions (:meth:`svd`, :meth:`qr`) that do not converge or return NaN/inf raise
  :class:`~xopt.errors.DecompositionError` naming the parameter. A step computes every
  decomposition it needs (:meth:`_prepare`, for all parameters) before it writes any
  parameter or state, so a failed one leaves everything as it was; they run only at
  refresh steps, and the check is one synchronisation there;
* ``step(closure=None, *, inject=None)``: ``inject`` maps a parameter tensor to the values
  its update must use instead of drawing or decomposing them itself (the parity harness
  feeds an original's recorded projections; each method documents its keys);
* ``load_state_dict`` checks every saved parameter's state against the method's state
  schema (``spec.state``, through the subclass's ``state_keys``) and keeps the saved dtypes.

The step reads its counters and refresh schedule on the host, so it is excluded from
torch.compile's dynamo (see :mod:`xopt.torch._optim`).

Subclass contract: ``hyperparams_cls`` (the spec dataclass), ``spec`` (its
:class:`~xopt.specs.MethodSpec`), ``state_keys`` (canonical state variable -> this
optimizer's key), ``step_kind`` (how ``state["step"]`` is kept: ``int`` or a torch dtype of
a CPU tensor), ``_update(p, g, state, hp, name, inject, prepared)`` which updates one
parameter (``g`` is float32/float64; ``state`` the parameter's dict, empty at first;
``prepared`` what ``_prepare`` returned for it); optionally
``_prepare(p, g, state, hp, name, inject)`` (the decompositions this step needs, computed
before any parameter is written; default None) and ``_check_param(p, hp, name)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from xopt.errors import DecompositionError, HyperparameterError
from xopt.kernels import triton_available
from xopt.specs import Hyperparams, lowrank
from xopt.torch._optim import Item, Layout, Optimizer
from xopt.torch.distributed import (
    decompose_many,
    decompose_once,
    is_dtensor,
    plain_as_replicated,
    settle,
)


class LowRankOptimizer(Optimizer):
    hyperparams_cls: type[Hyperparams]
    spec: Any  # the method's MethodSpec
    #: canonical state variable (``spec.state``) -> this optimizer's state key
    state_keys: dict[str, str]
    #: ``state["step"]``: a Python ``int``, or a CPU tensor of this dtype
    step_kind: Any = int
    #: the instance's ``svd_driver=`` (this default for optimizers pickled without one)
    svd_driver: str | None = None

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], *,
                 spec: Hyperparams | None = None, preset: str | None = None,
                 nonfinite: str | None = None, check_finite: bool | None = None,
                 svd_driver: str | None = None, **hyperparameters: Any) -> None:
        name = type(self).__name__
        if svd_driver not in SVD_DRIVERS:
            raise HyperparameterError(
                f"{name}: svd_driver = {svd_driver!r}; known: "
                f"{', '.join(map(repr, SVD_DRIVERS))}")
        #: how the SVDs of refreshes are computed (:data:`SVD_DRIVERS`); not state
        self.svd_driver = svd_driver
        given = {k: v for k, v in hyperparameters.items() if v is not None}
        if spec is not None:
            if not isinstance(spec, self.hyperparams_cls):
                raise HyperparameterError(
                    f"{name}: spec must be a {self.hyperparams_cls.__name__}, got "
                    f"{type(spec).__name__}")
            if given:
                raise HyperparameterError(f"{name}: pass either spec= or hyperparameters, not "
                                          f"both (got spec and {', '.join(sorted(given))})")
            hp = spec
        else:
            self.hyperparams_cls._reject_unknown(given)
            if preset is not None and preset not in self.spec.presets:
                known = (f"known: {', '.join(map(repr, self.spec.presets))}" if self.spec.presets
                         else f"{name} has no presets (pass hyperparameters by keyword, or "
                         "spec=)")
                raise HyperparameterError(f"{name}: unknown preset {preset!r}; {known}")
            hp = self.spec.make(preset, **given)
        super().__init__(params, hp.to_dict(), nonfinite=nonfinite, check_finite=check_finite)

    #: hyperparameters added after state dicts were saved, with the value the code that
    #: saved them computed: a saved group without one loads (and unpickles) with it
    added_fields: dict[str, Any] = {"proj_dtype": "state"}

    def _added(self) -> dict[str, Any]:
        fields = set(self.hyperparams_cls.field_names())
        return {k: v for k, v in self.added_fields.items() if k in fields}

    def _saved_groups(self, state_dict: Mapping[str, Any]) -> list[dict[str, Any]]:
        return [{**self._added(), **g} for g in state_dict["param_groups"]]

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # torch's load_state_dict ends here too
        for group in self.param_groups:
            for k, v in self._added().items():
                group.setdefault(k, v)

    # -- groups ------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        own = group.pop("spec", None)
        if own is not None:
            if not isinstance(own, self.hyperparams_cls):
                raise HyperparameterError(
                    f"{type(self).__name__}: a param group's spec must be a "
                    f"{self.hyperparams_cls.__name__}, got {type(own).__name__}")
            group.update(own.to_dict())
        fields = set(self.hyperparams_cls.field_names())
        unknown = sorted(k for k in group if k not in fields | {"params", "param_names"})
        if unknown:
            raise HyperparameterError(
                f"{type(self).__name__}: unknown param group key(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(fields))}")
        super().add_param_group(group)

    def _check_group(self, group: dict[str, Any], gi: int) -> None:
        hp = self.group_hp(group)
        for i, p in enumerate(group["params"]):
            self._check_param(p, hp, f"{type(self).__name__}: {self.param_name(gi, i)}")

    def group_hp(self, group: Mapping[str, Any]) -> Hyperparams:
        """The group's hyperparameters as the spec dataclass (validated; names the field)."""
        values = {k: group[k] for k in self.hyperparams_cls.field_names()}
        for k, v in values.items():
            if isinstance(v, list):  # torch.load gives tuples back as lists
                values[k] = tuple(v)
        return self.hyperparams_cls(**values)

    def _check_param(self, p: Tensor, hp: Hyperparams, where: str) -> None:
        """Method-specific validation of one parameter (raise HyperparameterError)."""

    def _prepare(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: Hyperparams,
                 name: str, inject: Mapping[str, Tensor] | None) -> Any:
        """The decompositions the update of ``p`` needs in this step (None: none), computed
        before any parameter or state is written (``g`` as the parameter holds it: convert
        with :meth:`_grad32` when it is needed)."""
        return None

    def _update(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: Hyperparams,
                name: str, inject: Mapping[str, Tensor] | None, prepared: Any) -> None:
        raise NotImplementedError

    # -- the step ------------------------------------------------------------------------------
    @torch.compiler.disable(reason=(
        "the step reads its step counters and refresh schedule on the host and decomposes "
        "gradients at refresh steps"))
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *,
             inject: Mapping[Tensor, Mapping[str, Tensor]] | None = None) -> Any:
        """One update of every parameter that has a gradient.

        Args:
          closure: re-evaluates the model and returns the loss (returned).
          inject: ``{parameter: {key: tensor}}``: values this update uses instead of its
            own draws or decompositions (the parity harness's; see the method's docs).
        """
        loss = self._closure_loss(closure)
        items = self._step_items()
        with plain_as_replicated(it.param for it in items):
            self._run_step(items, lambda: self._update_all(items, inject or {}))
        return loss

    def _update_all(self, items: list[Item],
                    inject: Mapping[Tensor, Mapping[str, Tensor]]) -> None:
        hps: dict[int, Hyperparams] = {}
        for it in items:
            if it.gi not in hps:
                hps[it.gi] = self.group_hp(it.group)
        batched = [it for it in items
                   if self._batchable(it, hps[it.gi], inject.get(it.param))]
        if batched:
            ids = {id(it.param) for it in batched}
            items = [it for it in items if id(it.param) not in ids]
        # every decomposition of the step first: a failed one leaves everything unchanged
        self._svd_ready = self._batched_svds(items, hps, inject)
        try:
            prepared = [self._prepare(it.param, it.grad, self.state[it.param], hps[it.gi],
                                      self.param_name(it.gi, it.i), inject.get(it.param))
                        for it in items]
        finally:
            self._svd_ready = {}
        batch_prepared = self._prepare_batch(batched, hps) if batched else None
        if batched:
            self._update_batch(batched, hps, batch_prepared)
        for it, prep in zip(items, prepared, strict=True):
            state = self.state[it.param]
            self._update(it.param, self._grad32(it.grad), state, hps[it.gi],
                         self.param_name(it.gi, it.i), inject.get(it.param), prep)
            if is_dtensor(it.param):  # FSDP2: sums over shards DTensor left pending, done
                for k, v in state.items():
                    state[k] = settle(v)

    # -- batched steps ---------------------------------------------------------------------
    # A subclass may step some parameters together (one batched matmul per group of
    # same-shaped matrices instead of a kernel sequence per matrix): ``_batchable`` picks
    # them, ``_prepare_batch`` computes their decompositions (before anything is written,
    # like ``_prepare``) and ``_update_batch`` updates them. Every other parameter takes
    # ``_prepare``/``_update``; ``_svd_input`` lets those parameters' SVDs run batched too.

    def _batchable(self, it: Item, hp: Hyperparams,
                   inject: Mapping[str, Tensor] | None) -> bool:
        """Whether ``it`` takes :meth:`_update_batch` in this step (default: never)."""
        return False

    def _prepare_batch(self, items: list[Item], hps: Mapping[int, Hyperparams]) -> Any:
        raise NotImplementedError

    def _update_batch(self, items: list[Item], hps: Mapping[int, Hyperparams],
                      prepared: Any) -> None:
        raise NotImplementedError

    def _hf_adam_batch(self, items: list[Item], hps: Mapping[int, Hyperparams],
                       side: Callable[[Tensor, Hyperparams], str | None], m_key: str,
                       v_key: str, proj_key: str) -> None:
        """The authors' AdamW step (:mod:`xopt.specs.lowrank`'s ``hf_*``: GaLore's, COAP's
        and, with its own projection pieces, PLUMAGE's) of every item, whose moments exist:
        one kernel sequence per group of same-shaped matrices with the same hyperparameters
        and step count (one ``bmm`` to project, one back), one foreach sequence for the
        unprojected tensors. The same
        elementwise operations in the same order as the per-parameter step; ``side(p, hp)``
        is ``"left"``, ``"right"`` or None (not projected); ``state[proj_key]`` the
        projection (:meth:`_batch_project`, :meth:`_batch_back`). Increments
        ``state["step"]``."""
        groups: dict[Any, list[Item]] = {}
        for it in items:
            p, hp, state = it.param, hps[it.gi], self.state[it.param]
            which = side(p, hp)
            before = int(state.get("step", 0))
            state["step"] = (before + 1 if self.step_kind is int
                             else torch.tensor(before + 1, dtype=self.step_kind))
            key = (it.gi, before, self.state_dtype(p), p.dtype, p.device, which,
                   tuple(p.shape) if which is not None else None)
            groups.setdefault(key, []).append(it)
        for (gi, before, sdt, pdt, _, which, shape), its in groups.items():
            for run in (chunks(its, shape) if which is not None else [its]):
                self._hf_adam_run([it.param for it in run], [it.grad for it in run],
                                  hps[gi], before + 1, sdt, pdt, which, m_key, v_key,
                                  proj_key)

    def _hf_adam_run(self, ps: list[Tensor], grads: list[Tensor], hp: Any, count: int,
                     sdt: torch.dtype, pdt: torch.dtype, which: str | None, m_key: str,
                     v_key: str, proj_key: str) -> None:
        states = [self.state[p] for p in ps]
        r = None
        # proj_dtype="param": both products in the parameter's dtype (the authors')
        low = (lowrank.product_dtype(getattr(hp, "proj_dtype", "state"), pdt, sdt)
               if which is not None else None)
        if which is not None:
            g = stack_as(grads, low or sdt)
            proj = stack_as([st[proj_key] for st in states], low or sdt)
            r = self._batch_project(g, proj, which)
            del g
            rs = list(r.unbind(0))
        else:
            rs = list(grads)
        # r and rs as computed (a fused pass widens them itself), else in sdt: widening is
        # exact, the moments stay in sdt
        fused = self._batch_adam_fused(states, hp, r, rs, sdt, (m_key, v_key))
        if fused is None:
            if r is not None:
                r = r.to(sdt)
                rs = list(r.unbind(0))
            else:
                rs = converted(rs, sdt)
            ms, vs = self._batch_moments(states, hp, m_key, v_key, sdt)
            # hf_adam_moments: m·β₁ + r·(1 − β₁), v·β₂ + r²·(1 − β₂)
            torch._foreach_mul_(ms, hp.b1)
            torch._foreach_add_(ms, torch._foreach_mul(rs, 1.0 - hp.b1))
            rr = torch._foreach_mul(rs, rs)
            torch._foreach_mul_(rr, 1.0 - hp.b2)
            torch._foreach_mul_(vs, hp.b2)
            torch._foreach_add_(vs, rr)
            del rr
        del rs, r
        step_size = lowrank.hf_step_size(hp.lr, hp.b1, hp.b2, count, hp.correct_bias)
        if which is not None:
            if fused is None:
                n = self._batch_directions([torch.stack(ms)], [torch.stack(vs)], hp)[0]
                self._batch_store(states, hp, ms, vs)
            else:
                n = fused
            u = self._batch_back(n, proj, states, which, hp)
            del n
            if low is not None:
                # lowrank.hf_apply_low: p.add_(U, alpha=−α), then p.add_(p, alpha=−ηλ)
                torch._foreach_add_(ps, list(u.unbind(0)), alpha=-step_size)
                if hp.weight_decay > 0.0:
                    torch._foreach_add_(ps, ps, alpha=-(hp.lr * hp.weight_decay))
                return
            u.mul_(step_size)
            if pdt != sdt:
                # hf_apply on the stack: p − α·u with p widened exactly (a mixed-dtype
                # subtraction computes in sdt), then p − ηλ·p; rounded once into p below
                torch.sub(torch.stack(ps), u, out=u)
                if hp.weight_decay > 0.0:
                    u.sub_(u * (hp.lr * hp.weight_decay))
                torch._foreach_copy_(ps, list(u.unbind(0)))
                return
            us = list(u.unbind(0))
        else:
            if fused is None:
                us = self._batch_directions(ms, vs, hp)
                self._batch_store(states, hp, ms, vs)
            else:
                us = fused
            torch._foreach_mul_(us, step_size)
        # hf_apply: p − α·u, then p − ηλ·p; rounded once into the parameter
        ws = ps if pdt == sdt else converted(ps, sdt)
        torch._foreach_sub_(ws, us)
        if hp.weight_decay > 0.0:
            torch._foreach_sub_(ws, torch._foreach_mul(ws, hp.lr * hp.weight_decay))
        if ws is not ps:
            torch._foreach_copy_(ps, ws)

    # the method's pieces of _hf_adam_run (these: GaLore's and COAP's)
    def _batch_adam_fused(self, states: list[dict[str, Any]], hp: Any, r: Tensor | None,
                          rs: list[Tensor], sdt: torch.dtype, keys: tuple[str, str]
                          ) -> Tensor | list[Tensor] | None:
        """The moments' update (stored) and the directions ``m / (√v + ε)`` of a run in one
        fused pass: stacked like ``r`` (the stacked projected gradients) when it is given,
        else a list like ``rs`` (the gradients); ``r``/``rs`` in the dtype they were
        computed in (``sdt``, or a lower one to widen exactly). None: the foreach sequence
        (:meth:`_batch_moments`, :meth:`_batch_directions`, :meth:`_batch_store`). This
        default runs :func:`xopt.kernels.lowrank_adam.adam_moments` (the same bits) on the
        state's own float32 moments ``keys`` where its ``BACKEND`` says
        (``XOPT_LOWRANK_ADAM``), for float32 or bfloat16 gradients."""
        if sdt != torch.float32 or not triton_available():
            return None
        if len({x.dtype for x in rs}) != 1 or rs[0].dtype not in (torch.float32,
                                                                   torch.bfloat16):
            return None
        from xopt.kernels import lowrank_adam

        if not lowrank_adam.runs_on(rs[0].device):
            return None
        ms, vs = ([st[k] for st in states] for k in keys)
        if not all(type(x) is Tensor and x.is_contiguous() and x.dtype == torch.float32
                   for x in (*ms, *vs)):
            return None
        return lowrank_adam.adam_moments(ms, vs, r if r is not None else rs, hp.b1, hp.b2,
                                         hp.eps, eps_inside=self._eps_inside_sqrt(hp))

    @staticmethod
    def _eps_inside_sqrt(hp: Any) -> bool:
        """Whether :meth:`_batch_directions` is ``m / √(v + ε)`` (else ``m / (√v + ε)``)."""
        return False

    @staticmethod
    def _batch_moments(states: list[dict[str, Any]], hp: Any, m_key: str, v_key: str,
                       dtype: torch.dtype) -> tuple[list[Tensor], list[Tensor]]:
        """The moments the step updates in place (the state's own tensors, of ``dtype``)."""
        return [st[m_key] for st in states], [st[v_key] for st in states]

    @staticmethod
    def _batch_store(states: list[dict[str, Any]], hp: Any, ms: list[Tensor],
                     vs: list[Tensor]) -> None:
        """Write the updated moments into the state (they are the state's own tensors)."""

    @staticmethod
    def _batch_project(g: Tensor, proj: Tensor, which: str) -> Tensor:
        """``R``: ``G Qᵀ`` (right, ``Q`` ``(r, n)``) or ``Pᵀ G`` (left), stacked."""
        return torch.bmm(g, proj.mT) if which == "right" else torch.bmm(proj.mT, g)

    @staticmethod
    def _batch_directions(ms: list[Tensor], vs: list[Tensor], hp: Any) -> list[Tensor]:
        """hf_adam_direction ``m / (√v + ε)`` of each pair."""
        den = torch._foreach_sqrt(vs)
        torch._foreach_add_(den, hp.eps)
        return torch._foreach_div(ms, den)

    @staticmethod
    def _batch_back(n: Tensor, proj: Tensor, states: list[dict[str, Any]], which: str,
                    hp: Any) -> Tensor:
        """``scale · N Q`` (right) or ``scale · P N`` (left), stacked, in ``proj``'s dtype
        (``N`` rounded to it)."""
        n = n.to(proj.dtype)
        u = torch.bmm(n, proj) if which == "right" else torch.bmm(proj, n)
        return u.mul_(hp.scale) if hp.scale != 1.0 else u  # ×1 is exact: a pass saved

    def _svd_input(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: Hyperparams,
                   inject: Mapping[str, Tensor] | None) -> Tensor | None:
        """The matrix :meth:`_prepare` of ``p`` will pass to :meth:`svd` in this step (None:
        none). Those of same-shaped parameters are then decomposed in one batched call, and
        :meth:`svd` returns the batch's result for the parameter's name."""
        return None

    def _batched_svds(self, items: list[Item], hps: Mapping[int, Hyperparams],
                      inject: Mapping[Tensor, Mapping[str, Tensor]]
                      ) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        names, mats = [], []
        for it in items:
            a = self._svd_input(it.param, it.grad, self.state[it.param], hps[it.gi],
                                inject.get(it.param))
            if a is not None:
                names.append(self.param_name(it.gi, it.i))
                mats.append(a)
        return self._stacked_svds(mats, names)

    def svd_batch(self, mats: list[Tensor], names: list[str]
                  ) -> list[tuple[Tensor, Tensor, Tensor]]:
        """:meth:`svd` of every matrix of ``mats`` (``names[i]`` names ``mats[i]``'s
        parameter), computed by one batched ``torch.linalg.svd`` per group of the same
        shape, dtype and device (at most :data:`BATCH_ELEMENTS` elements a call). Each result
        still passes through :meth:`svd`, which decomposes a matrix whose batch failed or
        returned NaN/inf again on its own, so that the error names its parameter."""
        saved = self._svd_ready
        self._svd_ready = {**saved, **self._stacked_svds(mats, names)}
        try:
            return [self.svd(a, n) for a, n in zip(mats, names, strict=True)]
        finally:
            self._svd_ready = saved

    def _stacked_svds(self, mats: list[Tensor], names: list[str]
                      ) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        """The finite batched SVDs of ``mats`` by name (a failed batch or matrix is left
        out: :meth:`svd` then decomposes it alone and raises naming it)."""
        out, driver = {}, self.svd_driver
        sharded = [i for i, a in enumerate(mats) if is_dtensor(a)]
        if sharded:
            out.update(self._owned_svds([mats[i] for i in sharded], [names[i] for i in sharded]))
        for idx in _same_kind([(i, a) for i, a in enumerate(mats) if not is_dtensor(a)]):
            try:
                u, s, vh = svd_stacked(torch.stack([mats[i] for i in idx]), driver)
                ok = torch.isfinite(s).all(dim=-1).tolist()  # one host read per batch
            except RuntimeError:
                continue
            for j, i in enumerate(idx):
                if ok[j]:  # ``clone``: each result owns its storage, not the whole batch's
                    out[names[i]] = (u[j].clone(), s[j].clone(), vh[j].clone())
        return out

    def _owned_svds(self, mats: list[Tensor], names: list[str]
                    ) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        """FSDP2: the finite SVDs of the step's DTensor matrices by name, all at once, each on
        its owner rank (:func:`xopt.torch.distributed.decompose_many`; :meth:`svd`'s own
        routine on the whole matrix, so the same bits). A failure on an owner (raised on
        every rank alike) leaves them all to :meth:`svd`, which raises naming the matrix."""
        def meta(i: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
            m, n = mats[i].shape
            k = min(m, n)
            return [((m, k), mats[i].dtype), ((k,), mats[i].dtype), ((k, n), mats[i].dtype)]

        try:
            res = decompose_many(mats, lambda w: lowrank.svd(torch, w), meta, names)
        except RuntimeError:  # OwnerError: on every rank
            return {}
        ok = torch.stack([torch.isfinite(s).all() for _, s, _ in res]).tolist()
        return {n: tuple(r) for n, r, good in zip(names, res, ok, strict=True) if good}

    def svd_stacked(self, a: Tensor, names: list[str]) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`svd` of each matrix of ``a`` (``(B, m, n)``; ``names[j]`` names ``a[j]``'s
        parameter), stacked: one batched call (:func:`svd_stacked`, ``svd_driver=``) and one
        host read of its finiteness. Every matrix still passes through :meth:`svd` (which
        returns the batch's finite result without computing anything), so a matrix whose
        result is not finite (or every one, when the batched call fails) is decomposed
        again alone there, which raises naming it."""
        ready: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
        try:
            u, s, vh = svd_stacked(a, self.svd_driver)
            bad = set(_not_finite(s))
            ready = {n: (u[j], s[j], vh[j]) for j, n in enumerate(names) if j not in bad}
        except RuntimeError:
            m, n = a.shape[-2:]
            k = min(m, n)
            u, s, vh = (a.new_empty((a.shape[0], *shape))
                        for shape in ((m, k), (k,), (k, n)))
        saved = self._svd_ready
        self._svd_ready = {**saved, **ready}
        try:
            for j, name in enumerate(names):
                got = self.svd(a[j], name)
                if name not in ready or got[0] is not ready[name][0]:  # decomposed alone
                    u[j], s[j], vh[j] = got
        finally:
            self._svd_ready = saved
        return u, s, vh

    def qr_stacked(self, a: Tensor, names: list[str]) -> Tensor:
        """``Q`` of :meth:`qr` of each matrix of ``a`` (``(B, m, k)``), stacked, as
        :meth:`svd_stacked` (a failed matrix is decomposed alone by :meth:`qr`, which raises
        naming it)."""
        try:
            q, r = qr_stacked(a)
            bad = _not_finite(r)
        except RuntimeError:
            q = a.new_empty(a.shape[:-1] + (min(a.shape[-2:]),))
            bad = list(range(a.shape[0]))
        for j in bad:
            q[j] = self.qr(a[j], names[j])[0]
        return q

    @staticmethod
    def _grad32(g: Tensor) -> Tensor:
        return g if g.dtype in (torch.float32, torch.float64) else g.float()

    # -- helpers for subclasses ------------------------------------------------------------------
    @staticmethod
    def state_dtype(p: Tensor) -> torch.dtype:
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    @staticmethod
    def write(p: Tensor, new: Tensor) -> None:
        """``p ← new``, rounded once into ``p``'s dtype."""
        p.copy_(new)

    def svd(self, a: Tensor, name: str) -> tuple[Tensor, Tensor, Tensor]:
        """:func:`xopt.specs.lowrank.svd` of ``a``; raises naming ``name`` on failure."""
        ready = self._svd_ready.get(name)  # decomposed in a batch (svd_batch): finite
        if ready is not None and (ready[0].shape[0], ready[2].shape[1]) == tuple(a.shape):
            return ready
        try:
            if is_dtensor(a):  # FSDP2: decomposed once, on an owner rank, and broadcast
                m, n = a.shape
                k = min(m, n)
                u, s, vh = decompose_once(
                    self, a, lambda w: lowrank.svd(torch, w),
                    [((m, k), a.dtype), ((k,), a.dtype), ((k, n), a.dtype)])
            elif self.svd_driver is None:
                u, s, vh = lowrank.svd(torch, a)
            else:
                u, s, vh = (x[0] for x in svd_stacked(a[None], self.svd_driver))
        except RuntimeError as e:  # torch.linalg.LinAlgError derives from RuntimeError
            raise DecompositionError(f"{type(self).__name__}: SVD of the gradient of {name} "
                                     f"(shape {tuple(a.shape)}) failed: {e}") from e
        if not bool(torch.isfinite(s).all()):
            raise DecompositionError(
                f"{type(self).__name__}: SVD of the gradient of {name} (shape "
                f"{tuple(a.shape)}) returned NaN/inf (non-finite gradient?); the projection "
                "was not refreshed")
        return u, s, vh

    def qr(self, a: Tensor, name: str) -> tuple[Tensor, Tensor]:
        """:func:`xopt.specs.lowrank.qr` of ``a``; raises naming ``name`` on failure."""
        try:
            if is_dtensor(a):
                m, n = a.shape
                k = min(m, n)
                q, r = decompose_once(self, a, lambda w: lowrank.qr(torch, w),
                                      [((m, k), a.dtype), ((k, n), a.dtype)])
            else:
                q, r = lowrank.qr(torch, a)
        except RuntimeError as e:
            raise DecompositionError(f"{type(self).__name__}: QR for {name} (shape "
                                     f"{tuple(a.shape)}) failed: {e}") from e
        if not bool(torch.isfinite(r).all()):
            raise DecompositionError(f"{type(self).__name__}: QR for {name} (shape "
                                     f"{tuple(a.shape)}) returned NaN/inf")
        return q, r

    _svd_ready: dict[str, tuple[Tensor, Tensor, Tensor]] = {}

    # -- state dicts ---------------------------------------------------------------------------
    def _state_layout(self, p: Tensor, group: Mapping[str, Any]) -> dict[str, Layout]:
        """The state of ``p`` after an update, from the method's state schema."""
        hp = self.group_hp(group)
        shape, sdt = tuple(p.shape), self.state_dtype(p)
        out = {"step": Layout((), int) if self.step_kind is int
               else Layout((), self.step_kind, "cpu")}
        for v in self.spec.state.vars:
            if v.scope == "param" and v.exists_for(shape, hp):
                kind = (sdt if v.dtype == "state" else int if v.dtype.startswith("int")
                        else getattr(torch, v.dtype))  # a fixed dtype: COAP's 8-bit codes
                out[self.state_keys[v.name]] = Layout(tuple(v.shape(shape, hp)), kind)
        return out


def stack_as(xs: list[Tensor], dtype: torch.dtype) -> Tensor:
    """``torch.stack(xs)`` in ``dtype``: one copy that converts (exact when widening)."""
    if xs[0].dtype == dtype:
        return torch.stack(xs)
    out = torch.empty((len(xs), *xs[0].shape), dtype=dtype, device=xs[0].device)
    torch._foreach_copy_(list(out.unbind(0)), xs)
    return out


def converted(xs: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """``[x.to(dtype) for x in xs]`` by one foreach copy (``xs`` itself when already so)."""
    if all(x.dtype == dtype for x in xs):
        return list(xs)
    out = [torch.empty_like(x, dtype=dtype) for x in xs]
    torch._foreach_copy_(out, xs)
    return out


def qr_stacked(a: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`xopt.specs.lowrank.qr` of each matrix of ``a`` (``(B, m, k)``), batched: the
    same LAPACK call per matrix on the CPU and the same sign rule (``R``'s diagonal
    non-negative, ``Q``'s columns flipped with it)."""
    q, r = torch.linalg.qr(a, mode="reduced")
    diag = r.diagonal(dim1=-2, dim2=-1)
    sign = torch.where(diag < 0, -torch.ones_like(diag), torch.ones_like(diag))
    return q * sign[..., None, :], r * sign[..., :, None]


#: the most elements one batched call stacks (a group of same-shaped matrices is split into
#: chunks of at most this many elements, which bounds the temporaries a batched step holds)
BATCH_ELEMENTS = 1 << 27


def _same_kind(indexed: list[tuple[int, Tensor]]) -> list[list[int]]:
    """Indices grouped by (shape, dtype, device), in first-seen order, each group split
    into chunks of at most :data:`BATCH_ELEMENTS` elements."""
    groups: dict[Any, list[int]] = {}
    for i, a in indexed:
        groups.setdefault((tuple(a.shape), a.dtype, a.device), []).append(i)
    out = []
    for (shape, _, _), idx in groups.items():
        n = max(1, BATCH_ELEMENTS // max(1, _numel(shape)))
        out.extend(idx[k:k + n] for k in range(0, len(idx), n))
    return out


def _not_finite(x: Tensor) -> list[int]:
    """The indices ``j`` whose ``x[j]`` holds NaN/inf (one host read)."""
    ok = torch.isfinite(x).flatten(1).all(dim=1)
    if bool(ok.all()):
        return []
    return [j for j, v in enumerate(ok.tolist()) if not v]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def chunks(items: list[Any], shape: tuple[int, ...]) -> list[list[Any]]:
    """``items`` (each standing for a tensor of ``shape``) split into runs whose stacked size
    stays within :data:`BATCH_ELEMENTS` elements."""
    n = max(1, BATCH_ELEMENTS // max(1, _numel(shape)))
    return [items[k:k + n] for k in range(0, len(items), n)]


#: ``svd_driver=`` of the low-rank optimizers: None (``torch.linalg.svd``'s default: LAPACK
#: on the CPU, cuSOLVER's ``gesvdj`` on CUDA), a cuSOLVER driver (``"gesvd"``, ``"gesvdj"``,
#: ``"gesvda"``; on CUDA tensors only, LAPACK's default elsewhere), or ``"gram"``:
#: :func:`gram_svd`
SVD_DRIVERS = (None, "gesvd", "gesvdj", "gesvda", "gram")


def svd_stacked(a: Tensor, driver: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`xopt.specs.lowrank.svd` of each matrix of ``a`` (``(B, m, n)``), batched: the
    same decomposition and sign convention (each left singular vector's entry of largest
    magnitude positive, the first on a tie; the right one flipped with it). ``driver``: see
    :data:`SVD_DRIVERS` (None: the same LAPACK call per matrix as the spec's)."""
    if driver == "gram":
        u, s, vh = gram_svd(a)
    else:
        u, s, vh = torch.linalg.svd(a, full_matrices=False,
                                    driver=driver if a.is_cuda else None)
    rows = u.abs().argmax(dim=-2, keepdim=True)             # (B, 1, k)
    pivot = torch.gather(u, -2, rows)                         # (B, 1, k)
    sign = torch.where(pivot < 0, -torch.ones_like(pivot), torch.ones_like(pivot))
    return u * sign, s, vh * sign.mT


def gram_svd(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Reduced SVD of each matrix of ``a`` (``(B, m, n)``) from the symmetric eigenproblem
    of its smaller float64 Gram matrix, returned in ``a``'s dtype (unsigned: callers apply
    the sign rule).

    For ``m ≤ n`` the eigenvectors of ``A Aᵀ`` (``m × m``) are ``U`` and ``Vᵀ = Σ⁻¹ Uᵀ A``;
    for ``m > n`` those of ``Aᵀ A`` are ``V`` and ``U = A V Σ⁻¹``. One float64 product and
    one ``eigh`` of the smaller side instead of an iterative SVD of the whole matrix (on
    CUDA ``gesvdj`` iterates over every column pair of the full matrix). Precision: the
    Gram's side is computed with float64 error ``≈ 1e-16·σ₁²/(σᵢ² − σⱼ²)``, below a float32
    SVD's ``≈ 6e-8·σ₁/|σᵢ − σⱼ|`` wherever ``σᵢ ≥ 1e-8·σ₁``, so it is at least as close to
    the exact singular vectors as the float32 SVD it replaces; the other side divides by
    ``σᵢ`` and is as accurate only where ``σᵢ`` is not small (GaLore's ``"std"`` and
    PLUMAGE's default project on the smaller side: the Gram's). Singular values below
    ``1e-8·σ₁`` come out as ``√max(λ, 0)`` (their float64 eigenvalues are rounding noise)
    and their vectors on the other side as zero.
    """
    m, n = a.shape[-2:]
    x = a.to(torch.float64)
    wide = m <= n
    gram = x @ x.mT if wide else x.mT @ x
    lam, w = torch.linalg.eigh(gram)              # ascending
    lam, w = lam.flip(-1), w.flip(-1)             # descending, as an SVD's
    s = lam.clamp(min=0).sqrt()
    inv = torch.where(s > s[..., :1] * 1e-8, 1.0 / s, torch.zeros_like(s))
    if wide:
        u, vh = w, (w.mT @ x) * inv[..., :, None]
    else:
        u, vh = (x @ w) * inv[..., None, :], w.mT
    return u.to(a.dtype), s.to(a.dtype), vh.to(a.dtype)
