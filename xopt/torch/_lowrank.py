"""The base of xopt's low-rank gradient optimizers in PyTorch: everything but the method.

:class:`LowRankOptimizer` is a ``torch.optim.Optimizer`` that gives GaLore, Flora, COAP
and PLUMAGE one behaviour around their updates:

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
* ``check_finite=True``: every gradient is checked before anything moves (one
  synchronisation per step);
* decompositions (:meth:`svd`, :meth:`qr`) that do not converge or return NaN/inf raise
  :class:`~xopt.errors.DecompositionError` naming the parameter, leaving its projection
  as it was (they run only at refresh steps; the check is one synchronisation there);
* ``step(closure=None, *, inject=None)``: ``inject`` maps a parameter tensor to the values
  its update must use instead of drawing or decomposing them itself (the parity harness
  feeds an original's recorded projections; each method documents its keys);
* ``load_state_dict`` keeps the saved dtypes (torch would cast float32 state of bfloat16
  parameters to bfloat16) and checks every saved parameter id first.

Subclass contract: ``hyperparams_cls`` (the spec dataclass), ``spec`` (its
:class:`~xopt.specs.MethodSpec`), and ``_update(p, g, state, hp, name, inject)`` which
updates one parameter (``g`` is float32; ``state`` the parameter's dict, empty at first);
optionally ``_check_param(p, hp, name)`` for method-specific validation at construction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from xopt.errors import DecompositionError, HyperparameterError, NonFiniteError, StateError
from xopt.specs import Hyperparams, lowrank
from xopt.torch._state_dict import saved_param_map

_FLOATING = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class LowRankOptimizer(torch.optim.Optimizer):
    hyperparams_cls: type[Hyperparams]
    spec: Any  # the method's MethodSpec

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], *,
                 spec: Hyperparams | None = None, preset: str | None = None,
                 check_finite: bool = False, **hyperparameters: Any) -> None:
        name = type(self).__name__
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
            hp = self.spec.make(preset, **given)
        self.check_finite = bool(check_finite)
        super().__init__(params, hp.to_dict())

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
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        hp = self.group_hp(group)
        for i, p in enumerate(group["params"]):
            where = f"{type(self).__name__}: {self.param_name(gi, i)}"
            if p.dtype not in _FLOATING:
                raise HyperparameterError(
                    f"{where}: dtype {p.dtype} is not supported (float32, float64, bfloat16, "
                    "float16)")
            self._check_param(p, hp, where)

    def group_hp(self, group: Mapping[str, Any]) -> Hyperparams:
        """The group's hyperparameters as the spec dataclass (validated; names the field)."""
        values = {k: group[k] for k in self.hyperparams_cls.field_names()}
        for k, v in values.items():
            if isinstance(v, list):  # torch.load gives tuples back as lists
                values[k] = tuple(v)
        return self.hyperparams_cls(**values)

    def param_name(self, gi: int, i: int) -> str:
        names = self.param_groups[gi].get("param_names")
        return names[i] if names else f"param_groups[{gi}]['params'][{i}]"

    def _check_param(self, p: Tensor, hp: Hyperparams, where: str) -> None:
        """Method-specific validation of one parameter (raise HyperparameterError)."""

    def _update(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: Hyperparams,
                name: str, inject: Mapping[str, Tensor] | None) -> None:
        raise NotImplementedError

    # -- the step ------------------------------------------------------------------------------
    def _check_finite(self) -> None:
        found = [(gi, i, p) for gi, group in enumerate(self.param_groups)
                 for i, p in enumerate(group["params"]) if p.grad is not None]
        if not found:
            return
        finite = torch.stack([torch.isfinite(p.grad).all().cpu() for _, _, p in found])
        if bool(finite.all()):
            return
        gi, i, p = found[int((~finite).nonzero()[0, 0])]
        raise NonFiniteError(
            f"{type(self).__name__}: gradient of {self.param_name(gi, i)} (shape "
            f"{tuple(p.shape)}) holds NaN or inf; no parameter was updated")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *,
             inject: Mapping[Tensor, Mapping[str, Tensor]] | None = None) -> Any:
        """One update of every parameter that has a gradient.

        Args:
          closure: re-evaluates the model and returns the loss (returned).
          inject: ``{parameter: {key: tensor}}``: values this update uses instead of its
            own draws or decompositions (the parity harness's; see the method's docs).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.check_finite:
            self._check_finite()
        inject = inject or {}
        for gi, group in enumerate(self.param_groups):
            hp = self.group_hp(group)
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse "
                                       f"gradients ({self.param_name(gi, i)})")
                g = p.grad if p.grad.dtype in (torch.float32, torch.float64) else p.grad.float()
                self._update(p, g, self.state[p], hp, self.param_name(gi, i), inject.get(p))
        return loss

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
        try:
            u, s, vh = lowrank.svd(torch, a)
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
            q, r = lowrank.qr(torch, a)
        except RuntimeError as e:
            raise DecompositionError(f"{type(self).__name__}: QR for {name} (shape "
                                     f"{tuple(a.shape)}) failed: {e}") from e
        if not bool(torch.isfinite(r).all()):
            raise DecompositionError(f"{type(self).__name__}: QR for {name} (shape "
                                     f"{tuple(a.shape)}) returned NaN/inf")
        return q, r

    # -- state dicts ---------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but the saved dtypes are kept and every saved id is checked first."""
        name = type(self).__name__
        id_map = saved_param_map(self, state_dict)
        saved_state = state_dict.get("state", {})
        for k, v in saved_state.items():
            if k not in id_map:
                raise StateError(f"{name}.load_state_dict: state for unknown parameter id {k!r}")
            for kk, vv in v.items():
                if not isinstance(vv, (Tensor, int, float, bool)):
                    raise StateError(f"{name}.load_state_dict: state {kk!r} of parameter {k} "
                                     f"is a {type(vv).__name__}")
        fields = self.hyperparams_cls.field_names()
        for sg in state_dict.get("param_groups", []):
            if all(f in sg for f in fields):
                self.group_hp(sg)  # a saved group with invalid values names the field
        super().load_state_dict(state_dict)
        for k, v in saved_state.items():
            p = id_map[k]
            # floating state follows the parameter's device in its saved dtype; counters
            # (integer tensors) stay on the CPU, where they are read without a sync
            self.state[p] = {kk: (vv.detach().clone().to(p.device) if vv.is_floating_point()
                                  else vv.detach().clone())
                             if isinstance(vv, Tensor) else vv for kk, vv in v.items()}
