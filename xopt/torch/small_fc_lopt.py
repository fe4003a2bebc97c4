"""small_fc_lopt (learned_optimization's ``AdafacMLPLOpt``) as a ``torch.optim.Optimizer``.

The update of each tensor is :func:`xopt.specs.small_fc_lopt.compute_step`, called with
torch tensors, one tensor at a time (extra memory: one tensor × 39 features); everything
around it (loss, weight decay, accumulation, lr, dtypes, checks, state dicts) is the base
class :class:`xopt.torch._lopt.LearnedOptimizer`.

>>> opt = xopt.torch.SmallFCLOpt(model.parameters(), theta, num_training_steps=10_000)
>>> loss = loss_fn(model(x), y); loss.backward(); opt.step(loss=loss)

State (naming ``"xopt.torch"`` of :data:`xopt.specs.small_fc_lopt.STATE`):
``optimizer.state[p]`` holds float32 ``m`` (``S+(3,)``), ``rms`` (``S+(1,)``), ``v_row``,
``v_col``, ``v_diag`` (the original's shapes, with ``(0, 3)`` placeholders) and, when
accumulating, ``grad_accum`` (``S``); ``optimizer.state["global"]`` holds int32
``iteration``, ``num_steps``, ``mom_t`` ``(3,)``, ``rms_t`` ``(1,)`` and, when
accumulating, float32 ``loss_accum`` and int64 ``accum_iteration``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from xopt.registry import register
from xopt.specs import small_fc_lopt as _spec
from xopt.torch._lopt import Entry, LearnedOptimizer
from xopt.torch._lopt_triton import TritonIO

__all__ = ["SmallFCLOpt", "global_state", "param_state"]

_PARAM_VARS = ("m", "rms", "v_row", "v_col", "v_diag")


def param_state(hp: _spec.SmallFCLOpt, p: Tensor) -> dict[str, Tensor]:
    """A parameter's zero state (float32 accumulators on its device)."""
    return {k: torch.zeros(shape, dtype=torch.float32, device=p.device)
            for k, shape in _spec.param_state_shapes(hp, tuple(p.shape)).items()}


def global_state(hp: _spec.SmallFCLOpt) -> dict[str, Tensor]:
    """The zero global state: the decays' step counters."""
    km, kr, _ = _spec.num_decays(hp)
    return {"mom_t": torch.zeros((km,), dtype=torch.int32),
            "rms_t": torch.zeros((kr,), dtype=torch.int32)}


class SmallFCLOpt(LearnedOptimizer):
    """small_fc_lopt: a per-parameter MLP learned optimizer with Adafactor features.

    Args:
      params: parameters or parameter groups (groups may set ``lr`` and ``weight_decay``);
        each of rank 0-4 (any rank works) and dtype float32, float64, bfloat16 or float16.
      meta_params: θ, a mapping of arrays in xopt's naming (``mlp/w0``, …,
        ``decays/momentum``, …) or the original's (``nn/~/w0``, …, ``momentum_decays``, …);
        None: ``meta_init(hp, seed)`` (an untrained optimizer).
      num_training_steps: the training horizon (required).
      lr: multiplier of the learned step, per group (1: the original; schedulers drive it).
      weight_decay, weight_decay_mode, max_training_steps: see
        :class:`xopt.specs.lopt.LOptOptions` (prefab's wrappers).
      nonfinite: ``"ignore"`` (default), ``"raise"`` (:class:`xopt.errors.NonFiniteError`
        naming the gradient, or the loss, before anything moves) or ``"skip"``
        (:mod:`xopt.nonfinite`); ``check_finite=True`` is the older spelling of ``"raise"``.
      spec: an :class:`xopt.specs.small_fc_lopt.SmallFCLOpt` instead of the keywords.
      seed: seed of the fresh θ when ``meta_params`` is None.
      **method_hyperparameters: ``exp_mult``, ``step_mult``, ``hidden_size``,
        ``hidden_layers``, ``initial_momentum_decays``, ``initial_rms_decays``,
        ``initial_adafactor_decays``.

      impl: ``"plain"`` (the spec's per-tensor torch code, the reference), ``"triton"``
        (the fused kernels of :mod:`xopt.kernels.small_fc_lopt`: all tensors in a few
        launches; CUDA, or the CPU under ``TRITON_INTERPRET=1``), or None (default):
        Triton when the parameters are on CUDA and Triton is importable, plain otherwise.
      precision: the Triton path's tensor-core MLP (hidden widths above 4; narrower MLPs are
        float32 FMAs in both modes): ``"exact"`` (split-precision TF32, parameters and
        state within 1e-6 of plain, the step within 1e-6 of float64 where the function's
        conditioning allows, see tests/test_kernels_lopt.py) or ``"fast"`` (one TF32
        product; the step moves by ~5e-3 relative, see bench/RESULTS.md).

    ``step(closure=None, *, loss=None)``: the loss is not read by the update itself; it
    feeds coupled weight decay's and the accumulator's bookkeeping (missing: 0).
    """

    hyperparams_cls = _spec.SmallFCLOpt
    meta_spec = _spec.META
    needs_loss = False

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]],
                 meta_params: Mapping[str, Any] | None = None, *,
                 num_training_steps: int | None = None, lr: float | None = None,
                 weight_decay: float | None = None, weight_decay_mode: str | None = None,
                 max_training_steps: int | None = None, nonfinite: str | None = None,
                 check_finite: bool | None = None,
                 spec: _spec.SmallFCLOpt | None = None, seed: int = 0,
                 impl: str | None = None, precision: str = "exact",
                 **method_hyperparameters: Any) -> None:
        super().__init__(params, meta_params, spec=spec, seed=seed, nonfinite=nonfinite,
                         check_finite=check_finite,
                         num_training_steps=num_training_steps, lr=lr,
                         weight_decay=weight_decay, weight_decay_mode=weight_decay_mode,
                         max_training_steps=max_training_steps, **method_hyperparameters)
        self._set_impl(impl, precision)

    def _triton_unsupported(self) -> str | None:
        from xopt.kernels.lopt_layout import supported_small_fc

        return supported_small_fc(self.hp)

    def _init_param_state(self, p: Tensor) -> dict[str, Tensor]:
        return param_state(self.hp, p)

    def _init_global_state(self) -> dict[str, Tensor]:
        return global_state(self.hp)

    def _inner_update(self, entries: list[Entry], loss: Tensor, gstate: dict[str, Any]) -> None:
        del loss  # AdafacMLPLOpt does not read the loss
        iteration = int(gstate["iteration"])
        if self._use_triton(entries):
            self._triton_update(entries, iteration)
            gstate["mom_t"] += 1
            gstate["rms_t"] += 1
            return
        per_device: dict[torch.device, tuple] = {}
        for e in entries:
            dev = e.param.device
            if dev not in per_device:
                meta = self.meta_on(dev)
                decays = _spec.decays(self.hp, meta, xp=torch)
                tf = _spec.time_features(torch, torch.tensor(iteration, dtype=torch.int32),
                                         meta["mlp/b0"])
                per_device[dev] = (meta, decays, tf)
            meta, decays, tf = per_device[dev]
            st = e.state
            step, accs = _spec.compute_step(self.hp, e.p32, e.grad,
                                            *(st[v] for v in _PARAM_VARS), tf, meta, decays,
                                            xp=torch)
            for v, a in zip(_PARAM_VARS, accs, strict=True):
                st[v] = a
            self._apply_step(e, step)
        gstate["mom_t"] += 1
        gstate["rms_t"] += 1

    _triton_state_vars = _PARAM_VARS

    def _triton_fast_update(self, io: Any, loss: Tensor, gstate: dict[str, Any]) -> None:
        del loss
        self._triton_run(io, int(gstate["iteration"]))
        gstate["mom_t"] += 1
        gstate["rms_t"] += 1

    def _triton_update(self, entries: list[Entry], iteration: int) -> None:
        """The fused Triton step (:mod:`xopt.kernels.small_fc_lopt`) over all entries."""
        io = self._triton_io(entries, _PARAM_VARS)
        self._triton_run(io, iteration)
        for e, step in io["post"]:
            self._apply_step(e, step)

    def _triton_run(self, io: Any, iteration: int) -> None:
        from xopt.kernels.small_fc_lopt import SmallFCTriton

        if self._triton is None:
            self._triton = SmallFCTriton(self.hp, self.precision)
        params = io["params"]
        self._triton.step(params, io["grads"], io["states"], io["outs"], io["write_step"],
                          io["lrs"], io["lrwds"], self.meta_on(params[0].device), iteration,
                          io=io if isinstance(io, TritonIO) else None)


register("small_fc_lopt", "torch", SmallFCLOpt)
