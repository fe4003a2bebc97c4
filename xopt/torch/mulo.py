"""μLO (μLO's ``MuAdafacMLPLOpt``, PyLO's ``MuLO``) as a ``torch.optim.Optimizer``.

Each tensor's update is :func:`xopt.specs.small_fc_lopt.compute_step` on the gradients
:func:`xopt.specs.mulo.prepare_grad` gives (clipped to global norm 1 with ``clip_grad``,
non-finite entries replaced), times the tensor's μP multiplier; everything around it (loss,
weight decay, accumulation, lr, dtypes, checks, state dicts) is the base class
:class:`xopt.torch._lopt.LearnedOptimizer`.

**μP multipliers: param groups.** A group's ``"mup_lr"`` is the multiplier of its
parameters' steps (default 1, or the ``mup_lr`` of ``spec``). :func:`mup_param_groups`
builds the groups from a model (or from named parameters and their roles) with
:func:`xopt.specs.mulo.mup_lr`'s rule, so that a μP model is one line:

>>> opt = xopt.torch.MuLO(mup_param_groups(model), theta, num_training_steps=10_000)
>>> loss = loss_fn(model(x), y); loss.backward(); opt.step(loss=loss)

State: small_fc_lopt's (naming ``"xopt.torch"`` of :data:`xopt.specs.mulo.STATE`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from xopt.errors import HyperparameterError
from xopt.registry import register
from xopt.specs import ParamGroups
from xopt.specs import mulo as _spec
from xopt.specs import small_fc_lopt as _sf
from xopt.torch._lopt import Entry, LearnedOptimizer
from xopt.torch.small_fc_lopt import global_state, param_state

__all__ = ["MuLO", "mup_param_groups", "mup_roles"]

_PARAM_VARS = _sf.PARAM_VARS
#: layers whose weight is a width-by-width matrix in the hidden role (fan-in: in_features,
#: or in_channels / groups times the kernel's window)
_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def mup_roles(model: nn.Module) -> dict[str, str]:
    """``{parameter name: role}`` read from ``model``: the weights of its ``Linear`` and
    ``Conv`` layers in registration order are ``"input"`` (the first), ``"output"`` (the
    last) and ``"hidden"`` (the others); every other parameter (biases, norms, embeddings'
    companions) is ``"vector"``. A model with fewer than two such layers is an error: its
    roles must be given explicitly (:func:`mup_param_groups`'s ``roles``)."""
    weights = [f"{name}.weight" if name else "weight" for name, m in model.named_modules()
               if isinstance(m, _LAYERS) and getattr(m, "weight", None) is not None]
    if len(weights) < 2:
        raise HyperparameterError(
            f"mup_roles: {type(model).__name__} has {len(weights)} Linear/Conv layer(s); an "
            "input and an output layer are needed to read roles (pass roles= explicitly)")
    roles = {name: "vector" for name, _ in model.named_parameters()}
    for i, name in enumerate(weights):
        roles[name] = "input" if i == 0 else "output" if i == len(weights) - 1 else "hidden"
    return roles


def _fan_in(p: Tensor) -> int:
    """torch's layout: a weight is ``(out, in, *window)``; fan-in is ``in · prod(window)``."""
    if p.dim() < 2:
        raise HyperparameterError(f"a 'hidden' parameter must be a weight of rank >= 2, got "
                                  f"shape {tuple(p.shape)}")
    n = 1
    for s in p.shape[1:]:
        n *= int(s)
    return n


def mup_param_groups(model: nn.Module | Iterable[tuple[str, Tensor]], *,
                     roles: Mapping[str, str] | Callable[[str, Tensor], str] | None = None,
                     hidden_lr_mult: float = 1.0, **group_options: Any) -> list[dict[str, Any]]:
    """Param groups for :class:`MuLO`, one per distinct multiplier, each with its
    ``"mup_lr"`` (:func:`xopt.specs.mulo.mup_lr` of the role and the weight's fan-in) and
    ``"param_names"``.

    Args:
      model: an ``nn.Module`` or ``named_parameters()``-style pairs.
      roles: ``{name: role}`` (every trainable parameter named), a function ``(name,
        param) -> role``, or None: :func:`mup_roles` of the module.
      hidden_lr_mult: μLO's ``hidden_lr_mult`` (hidden weights: ``hidden_lr_mult /
        fan_in``).
      group_options: other group keys (``lr``, ``weight_decay``) for every group.
    """
    if isinstance(model, nn.Module):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if roles is None:
            roles = mup_roles(model)
    else:
        named = list(model)
        if roles is None:
            raise HyperparameterError("mup_param_groups: named parameters need roles= (a "
                                      "mapping or a function (name, param) -> role)")
    groups: dict[float, dict[str, Any]] = {}
    for name, p in named:
        if callable(roles):
            role = roles(name, p)
        elif name in roles:
            role = roles[name]
        else:
            raise HyperparameterError(f"mup_param_groups: roles has no entry for parameter "
                                      f"{name!r}")
        try:
            mult = _spec.mup_lr(role, _fan_in(p) if role == "hidden" else None, hidden_lr_mult)
        except HyperparameterError as e:
            raise HyperparameterError(f"mup_param_groups: parameter {name!r}: {e}") from None
        g = groups.setdefault(mult, {"params": [], "param_names": [], "mup_lr": mult,
                                     **group_options})
        g["params"].append(p)
        g["param_names"].append(name)
    return list(groups.values())


class MuLO(LearnedOptimizer):
    """μLO: small_fc_lopt's learned optimizer with per-parameter μP step multipliers.

    Args:
      params: parameters or parameter groups; a group may set ``lr``, ``weight_decay`` and
        ``"mup_lr"`` (the μP multiplier, see :func:`mup_param_groups`), or carry its own
        ``"spec"`` (a :class:`xopt.specs.mulo.MuLO` that differs from ``spec`` in
        ``mup_lr`` only).
      meta_params: θ in xopt's naming (``mlp/w0``, …, ``decays/momentum``, …) or the
        original's (``nn/~/w0``, …, ``momentum_decays``, …); None: an untrained draw.
      num_training_steps: the training horizon (required).
      lr, weight_decay, weight_decay_mode, max_training_steps: see
        :class:`xopt.specs.lopt.LOptOptions`.
      nonfinite: ``"ignore"`` (default: μLO's own rule, NaN → 0 and ±inf → ±float32 max),
        ``"raise"`` (:class:`xopt.errors.NonFiniteError` naming the gradient, or the loss,
        before anything moves) or ``"skip"`` (:mod:`xopt.nonfinite`);
        ``check_finite=True`` is the older spelling of ``"raise"``.
      spec: a :class:`xopt.specs.mulo.MuLO` instead of the keywords.
      seed: seed of the fresh θ when ``meta_params`` is None.
      **method_hyperparameters: ``clip_grad``, ``mup_lr`` (the default group multiplier),
        ``exp_mult``, ``step_mult``, ``hidden_size``, ``hidden_layers`` and the initial
        decays (:class:`xopt.specs.mulo.MuLO`; ``spec=MuLO.make("mulo")`` is μLO's
        released configuration).

    ``step(closure=None, *, loss=None)`` as :class:`xopt.torch.SmallFCLOpt`.
    """

    hyperparams_cls = _spec.MuLO
    meta_spec = _spec.META
    needs_loss = False

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]],
                 meta_params: Mapping[str, Any] | None = None, *,
                 num_training_steps: int | None = None, lr: float | None = None,
                 weight_decay: float | None = None, weight_decay_mode: str | None = None,
                 max_training_steps: int | None = None, nonfinite: str | None = None,
                 check_finite: bool | None = None,
                 spec: _spec.MuLO | None = None, seed: int = 0,
                 **method_hyperparameters: Any) -> None:
        super().__init__(params, meta_params, spec=spec, seed=seed, nonfinite=nonfinite,
                         check_finite=check_finite,
                         num_training_steps=num_training_steps, lr=lr,
                         weight_decay=weight_decay, weight_decay_mode=weight_decay_mode,
                         max_training_steps=max_training_steps, **method_hyperparameters)
        self._set_impl("plain", "exact")  # μLO has no fused kernel (its clipping is global)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, plus the group's μP multiplier: ``"mup_lr"`` (a positive finite
        number; default the spec's), or ``"spec"`` whose ``mup_lr`` it takes. Checked before
        the group is added."""
        name = type(self).__name__
        gi = len(self.param_groups)
        group = dict(param_group)
        own = group.pop("spec", None)
        if own is not None:
            if not isinstance(own, _spec.MuLO):
                raise HyperparameterError(f"{name} param_groups[{gi}]: 'spec' must be an "
                                          f"xopt.specs.mulo.MuLO, got {type(own).__name__}")
            try:
                _spec.settings(ParamGroups.of([(["a"], self.hp), (["b"], own)]))
            except HyperparameterError as e:
                raise HyperparameterError(f"{name} param_groups[{gi}]: {e}") from None
            if "mup_lr" in group and group["mup_lr"] != own.mup_lr:
                raise HyperparameterError(f"{name} param_groups[{gi}]: 'mup_lr' and "
                                          "spec.mup_lr disagree")
            group["mup_lr"] = own.mup_lr
        mult = group.setdefault("mup_lr", self.hp.mup_lr)
        try:
            self.hp.replace(mup_lr=mult)
        except HyperparameterError as e:
            raise HyperparameterError(f"{name} param_groups[{gi}]: {e}") from None
        super().add_param_group(group)

    def _init_param_state(self, p: Tensor) -> dict[str, Tensor]:
        return param_state(self.hp, p)  # small_fc_lopt's layout, which μLO keeps

    def _init_global_state(self) -> dict[str, Tensor]:
        return global_state(self.hp)

    def _inner_update(self, entries: list[Entry], loss: Tensor, gstate: dict[str, Any]) -> None:
        del loss  # MuAdafacMLPLOpt does not read the loss
        iteration = int(gstate["iteration"])
        norm = None
        if self.hp.clip_grad and entries:  # one pass for the global norm (one gradient at a time)
            dev0 = entries[0].param.device
            norm = _spec.global_norm(torch, (e.grad.to(dev0) for e in entries))
        per_device: dict[torch.device, tuple] = {}
        for e in entries:
            dev = e.param.device
            g = _spec.prepare_grad(torch, e.grad, None if norm is None else norm.to(dev))
            if dev not in per_device:
                meta = self.meta_on(dev)
                decays = _sf.decays(self.hp, meta, xp=torch)
                tf = _sf.time_features(torch, torch.tensor(iteration, dtype=torch.int32),
                                       meta["mlp/b0"])
                per_device[dev] = (meta, decays, tf)
            meta, decays, tf = per_device[dev]
            st = e.state
            step, accs = _sf.compute_step(self.hp, e.p32, g, *(st[v] for v in _PARAM_VARS),
                                          tf, meta, decays, xp=torch)
            for v, a in zip(_PARAM_VARS, accs, strict=True):
                st[v] = a
            self._apply_step(e, _spec.scale_step(step, float(e.group["mup_lr"])))
        gstate["mom_t"] += 1
        gstate["rms_t"] += 1


register("mulo", "torch", MuLO)
