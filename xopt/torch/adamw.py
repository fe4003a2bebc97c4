"""AdamW as a ``torch.optim.Optimizer``, computing :mod:`xopt.specs.adamw`'s math.

Under the ``"torch"`` preset (the default) this optimizer is torch.optim.AdamW bit for bit
on the CPU: the step calls :func:`xopt.specs.adamw.update_torch`, which performs
torch.optim's operations (``lerp``, ``addcmul``, ``addcdiv`` and the double-precision bias
corrections) in torch.optim's order. Its state uses torch.optim.AdamW's keys (``step``,
``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), so state dicts load in either. Under
``preset="optax"`` it computes optax.adamw's arithmetic instead.

Beyond torch.optim.AdamW:
  * bfloat16/float16 parameters keep float32 moments (``state_dtype``), and the update is
    computed in float32 and rounded once into the parameter;
  * ``nonfinite=`` (:mod:`xopt.nonfinite`): ``"raise"`` names the parameter whose gradient
    holds NaN or inf, ``"skip"`` skips such a step on the device;
  * ``eps_root`` and ``nesterov`` (with ``formula="optax"``);
  * the contract of every xopt optimizer (:mod:`xopt.torch._optim`): all-or-nothing steps,
    strict ``load_state_dict``.

torch.compile: the step reads its step counter on the host (``.item()``, as
torch.optim's non-capturable path, whose double-precision bias corrections it reproduces
bit for bit), so it is excluded from dynamo: a compiled training step breaks once at
``step()`` and runs the step eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from xopt.errors import HyperparameterError
from xopt.registry import register
from xopt.specs import adamw as adamw_spec
from xopt.torch._optim import FLOATING, Item, Layout, Optimizer
from xopt.torch.distributed import aligned_locals

__all__ = ["AdamW"]

_FIELDS = ("lr", "eps", "eps_root", "weight_decay", "amsgrad", "maximize", "nesterov", "formula",
           "bias_correction_dtype")


def _state_dtype(p: Tensor, state_dtype: torch.dtype | None) -> torch.dtype:
    if state_dtype is not None:
        return state_dtype
    return torch.float64 if p.dtype == torch.float64 else torch.float32


class AdamW(Optimizer):
    r"""AdamW with torch.optim's or optax's arithmetic (see :mod:`xopt.specs.adamw`).

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2

        \theta_t = \theta_{t-1} - \eta\Big(\frac{m_t/(1-\beta_1^t)}
        {\sqrt{v_t/(1-\beta_2^t) + \epsilon_{root}} + \epsilon} + \lambda\theta_{t-1}\Big)

    Args:
      params: parameters or parameter groups, as for any torch optimizer. Groups may
        override any hyperparameter below.
      lr, betas, eps, weight_decay, amsgrad, maximize: as torch.optim.AdamW. ``lr`` may be
        a 0-d tensor.
      eps_root: ε added inside the square root (optax's), default 0.
      nesterov: Nesterov momentum (needs ``formula="optax"``).
      formula: ``"torch"`` or ``"optax"``: whose floating-point arithmetic to follow.
      bias_correction_dtype: ``"float64"`` (torch.optim) or ``"float32"`` (optax): the
        precision of 1 − βᵗ; see :func:`xopt.specs.adamw.bias_correction`.
      preset: ``"torch"`` (default) or ``"optax"``: the defaults for every field not given.
      spec: an :class:`xopt.specs.adamw.AdamW` giving all hyperparameters at once (then
        pass no other hyperparameter).
      state_dtype: dtype of the moments, a floating torch dtype; default float32 (float64
        for float64 params).
      nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` (:mod:`xopt.nonfinite`);
        ``check_finite=True`` is the older spelling of ``"raise"``.

    Shapes and dtypes: each parameter any shape, floating dtype (float32, float64, bfloat16,
    float16); its state ``exp_avg``/``exp_avg_sq`` the parameter's shape in
    ``state_dtype``; ``step`` a float32 0-d tensor on the CPU, as in torch.optim.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        amsgrad: bool | None = None,
        *,
        maximize: bool | None = None,
        eps_root: float | None = None,
        nesterov: bool | None = None,
        formula: str | None = None,
        bias_correction_dtype: str | None = None,
        preset: str = "torch",
        spec: adamw_spec.AdamW | None = None,
        state_dtype: torch.dtype | None = None,
        nonfinite: str | None = None,
        check_finite: bool | None = None,
    ) -> None:
        given = {k: v for k, v in dict(lr=lr, eps=eps, weight_decay=weight_decay,
                                       amsgrad=amsgrad, maximize=maximize, eps_root=eps_root,
                                       nesterov=nesterov, formula=formula,
                                       bias_correction_dtype=bias_correction_dtype).items()
                 if v is not None}
        if betas is not None:
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise HyperparameterError(f"AdamW.betas = {betas!r}: must be a pair (b1, b2)")
            given.update(b1=betas[0], b2=betas[1])
        if spec is not None:
            if given:
                raise HyperparameterError(
                    f"AdamW: pass either spec= or hyperparameters, not both (got spec and "
                    f"{', '.join(sorted(given))})"
                )
            hp = spec
        else:
            hp = adamw_spec.SPEC.make(preset, **given)
        if state_dtype is not None and state_dtype not in FLOATING:
            raise HyperparameterError(
                f"AdamW.state_dtype = {state_dtype!r}: must be None or a floating torch dtype "
                f"({', '.join(map(str, FLOATING))})")
        self.state_dtype = state_dtype
        super().__init__(params, _group_from_spec(hp), nonfinite=nonfinite,
                         check_finite=check_finite)

    def _check_group(self, group: dict[str, Any], gi: int) -> None:
        _spec_from_group(group)  # validates, naming the field at fault

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for k, v in _group_from_spec(adamw_spec.AdamW()).items():
                group.setdefault(k, v)

    # -- state dicts (torch.optim.AdamW's layout) ---------------------------------------------
    def _saved_groups(self, state_dict: Mapping[str, Any]) -> list[dict[str, Any]]:
        # torch.optim.AdamW's groups lack xopt's own fields: they take their defaults
        xopt_only = {k: v for k, v in _group_from_spec(adamw_spec.AdamW()).items()
                     if k in ("eps_root", "nesterov", "formula", "bias_correction_dtype")}
        return [{**xopt_only, **g} for g in state_dict["param_groups"]]

    def _state_layout(self, p: Tensor, group: Mapping[str, Any]) -> dict[str, Layout]:
        shape, sdt = tuple(p.shape), _state_dtype(p, self.state_dtype)
        out = {"step": Layout((), torch.float32, "cpu"), "exp_avg": Layout(shape, sdt),
               "exp_avg_sq": Layout(shape, sdt)}
        if group["amsgrad"]:
            out["max_exp_avg_sq"] = Layout(shape, sdt)
        return out

    # -- the step -----------------------------------------------------------------------------
    @torch.compiler.disable(reason=(
        "AdamW.step reads its step counter on the host (.item(), as torch.optim's non-"
        "capturable AdamW, whose arithmetic it reproduces)"))
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Take one step; ``closure`` re-evaluates the model and returns the loss."""
        loss = self._closure_loss(closure)
        items = self._step_items()
        self._run_step(items, lambda: self._update(items))
        return loss

    def _update(self, items: list[Item]) -> None:
        kws: dict[int, dict[str, Any]] = {}
        for it in items:
            group = it.group
            kw = kws.get(it.gi)
            if kw is None:
                kw = kws[it.gi] = dict(
                    lr=group["lr"], b1=group["betas"][0], b2=group["betas"][1],
                    eps=group["eps"], eps_root=group["eps_root"],
                    weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
                    maximize=group["maximize"],
                    bias_correction_dtype=group["bias_correction_dtype"])
            self._update_one(it.param, it.grad, self.state[it.param], group["formula"],
                             group["nesterov"], kw)

    def _update_one(self, p: Tensor, g: Tensor, state: dict[str, Any], formula: str,
                    nesterov: bool, kw: dict[str, Any]) -> None:
        sdt = _state_dtype(p, self.state_dtype)
        if "step" not in state:
            # As torch.optim: a float32 0-d step on the CPU, zero moments.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=sdt, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=sdt,
                                                   memory_format=torch.preserve_format)
        if kw["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=sdt,
                                                       memory_format=torch.preserve_format)
        step_t = state["step"]
        step_t += 1
        count = step_t.item()  # torch.optim's non-capturable path uses the Python float
        names = [k for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if k in state]
        shards = aligned_locals(p, g, *(state[k] for k in names))
        if shards is not None:  # FSDP2: the elementwise update on the local shards
            p, g = shards[:2]
            state = {**state, **dict(zip(names, shards[2:], strict=True))}
        exact = p.dtype == sdt
        p_c = p if exact else p.to(sdt)
        g_c = g if g.dtype == sdt else g.to(sdt)
        v_max = state.get("max_exp_avg_sq") if kw["amsgrad"] else None
        if formula == "torch":
            new_p, m, v, v_max = adamw_spec.update_torch(
                p_c, g_c, state["exp_avg"], state["exp_avg_sq"], v_max, count, xp=torch, **kw)
        else:
            new_p, m, v, v_max = adamw_spec.update_optax(
                p_c, g_c, state["exp_avg"], state["exp_avg_sq"], v_max, int(count),
                nesterov=nesterov, xp=torch, **kw)
        p.copy_(new_p)
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)
        if v_max is not None:
            state["max_exp_avg_sq"].copy_(v_max)


def _group_from_spec(hp: adamw_spec.AdamW) -> dict[str, Any]:
    """torch.optim-style group defaults: ``betas`` as a pair, the other spec fields as is."""
    group = {k: getattr(hp, k) for k in _FIELDS}
    group["betas"] = (hp.b1, hp.b2)
    return group


def _spec_from_group(group: dict[str, Any]) -> adamw_spec.AdamW:
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise HyperparameterError(f"AdamW.betas = {betas!r}: must be a pair (b1, b2)")
    return adamw_spec.AdamW(b1=betas[0], b2=betas[1], **{k: group[k] for k in _FIELDS})


register("adamw", "torch", AdamW)
