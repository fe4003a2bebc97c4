"""VeLO (learned_optimization's ``HyperV2`` as VeLO configures it) as a ``torch.optim.Optimizer``.

The math is :mod:`xopt.specs.velo`'s, called with torch tensors; everything around the
learned update (the loss, weight decay, gradient accumulation, the lr multiplier, dtypes,
finiteness checks, state dicts) is the base class :class:`xopt.torch._lopt.LearnedOptimizer`.

>>> opt = xopt.torch.VeLO(model.parameters(), theta, num_training_steps=10_000)
>>> loss = loss_fn(model(x), y); loss.backward(); opt.step(loss=loss)

One update runs in two passes over the tensors, so that extra memory stays at one tensor's
worth of features (its 30 MLP inputs) beyond the state:

1. per tensor, the 30 LSTM inputs (:func:`xopt.specs.velo.lstm_features`: old momenta and
   second moment, training progress, loss features);
2. the LSTM once on the stacked ``(n_tensors, 30)`` rows (:func:`~xopt.specs.velo.lstm_step`):
   each tensor's 256 controls and learning-rate multiplier;
3. per tensor, the accumulators, that tensor's mixed MLP and its step
   (:func:`~xopt.specs.velo.update_tensor`), applied at once.

State (naming ``"xopt.torch"`` of :data:`xopt.specs.velo.STATE`): ``optimizer.state[p]``
holds float32 ``m`` ``S+(3,)``, ``rms`` ``S+(1,)``, ``v_row``, ``v_col``, ``v_diag`` (the
original's shapes with its ``(0, 3)`` placeholders), the tensor's LSTM state
``lstm_hidden``, ``lstm_cell`` ``(H,)`` and, when accumulating, ``grad_accum``;
``optimizer.state["global"]`` holds int32 ``iteration``, ``num_steps``, ``mom_t`` ``(3,)``,
``rms_t`` ``(1,)``, ``loss_iteration``, float32 ``loss_means``, ``loss_running_min``,
``loss_decays`` ``(10,)`` and, when accumulating, ``loss_accum`` and int64
``accum_iteration``.

Floating point: the loss buffer's ``βᵗ`` and fused multiply-add, and the LSTM's tanh, follow
the jitted original's float32 arithmetic (see :mod:`xopt.specs.velo`); matrix products
(the LSTM's, and the hypernetwork's means over 256 MLPs) are torch's, which sum in another
order than XLA, so teacher-forced agreement with the original is at float32 rounding of
those products (about 1e-6 of the LSTM state, which is also how far the original's own
float32 result is from the exact one).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from xopt.registry import register
from xopt.specs import arrays
from xopt.specs import velo as _spec
from xopt.torch._lopt import Entry, LearnedOptimizer
from xopt.torch.distributed import is_dtensor

__all__ = ["VeLO"]

_ACC_VARS = ("m", "rms", "v_row", "v_col", "v_diag")
_LOSS_VARS = ("loss_means", "loss_running_min", "loss_decays")


class VeLO(LearnedOptimizer):
    """VeLO: a per-tensor LSTM that writes the weights of a per-parameter MLP.

    Args:
      params: parameters or parameter groups (groups may set ``lr`` and ``weight_decay``);
        any rank (0 to 4 are tested) and dtype float32, float64, bfloat16 or float16 (the
        state is float32).
      meta_params: θ, a mapping of arrays in xopt's naming (``lstm/gates/w``,
        ``mlp_bank/w0``, … see :func:`xopt.specs.velo.meta_shapes`) or the original's
        (``rnn_params/rnn/linear/w``, ``ff_mod_stack/~/w0__3``, …); None:
        ``meta_init(hp, seed)``, an untrained VeLO (only useful for tests).
      num_training_steps: the training horizon (required).
      lr: multiplier of the learned step, per group (1, the default, is the original's step;
        schedulers drive it). PyLO's VeLO defaults to 1e-3; xopt follows the original.
      weight_decay, weight_decay_mode, max_training_steps: see
        :class:`xopt.specs.lopt.LOptOptions` (``prefab.LearnedOptimizer``'s wrappers).
      nonfinite: ``"ignore"`` (default), ``"raise"`` (:class:`xopt.errors.NonFiniteError`
        naming the gradient, or the loss, before anything moves) or ``"skip"``
        (:mod:`xopt.nonfinite`); ``check_finite=True`` is the older spelling of ``"raise"``.
      spec: an :class:`xopt.specs.velo.VeLO` instead of the keywords.
      seed: seed of the fresh θ when ``meta_params`` is None.
      **method_hyperparameters: the other fields of :class:`xopt.specs.velo.VeLO`
        (``lstm_hidden_size``, ``param_inits``, …; they must match θ).

      impl: ``"plain"`` (the spec's torch code, the reference), ``"triton"`` (the fused
        kernels of :mod:`xopt.kernels.velo`; CUDA, or the CPU under ``TRITON_INTERPRET=1``),
        or None (default): Triton when the parameters are on CUDA and Triton is
        importable, plain otherwise.
      precision: ``"exact"`` or ``"fast"``: the same kernel (VeLO's 4-wide per-element MLP
        runs as float32 FMAs; parameters and state within 1e-6 of plain, see
        :mod:`xopt.kernels.velo`).

    ``step(closure=None, *, loss=None)``: VeLO reads the loss, so one of the two is
    required; without it ``step`` raises ``ValueError`` and changes nothing.
    """

    hyperparams_cls = _spec.VeLO
    meta_spec = _spec.META
    needs_loss = True

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]],
                 meta_params: Mapping[str, Any] | None = None, *,
                 num_training_steps: int | None = None, lr: float | None = None,
                 weight_decay: float | None = None, weight_decay_mode: str | None = None,
                 max_training_steps: int | None = None, nonfinite: str | None = None,
                 check_finite: bool | None = None,
                 spec: _spec.VeLO | None = None, seed: int = 0,
                 impl: str | None = None, precision: str = "exact",
                 **method_hyperparameters: Any) -> None:
        super().__init__(params, meta_params, spec=spec, seed=seed, nonfinite=nonfinite,
                         check_finite=check_finite,
                         num_training_steps=num_training_steps, lr=lr,
                         weight_decay=weight_decay, weight_decay_mode=weight_decay_mode,
                         max_training_steps=max_training_steps, **method_hyperparameters)
        self._set_impl(impl, precision)

    def _triton_unsupported(self) -> str | None:
        from xopt.kernels.lopt_layout import supported_velo

        return supported_velo(self.hp)

    # -- state ------------------------------------------------------------------------------
    def _init_param_state(self, p: Tensor) -> dict[str, Tensor]:
        meta = self.meta_on(p.device)
        st: dict[str, Tensor] = {}
        for k, shape in _spec.param_state_shapes(self.hp, tuple(p.shape)).items():
            if k == "lstm_hidden":
                st[k] = meta["lstm/init_hidden"].clone()
            elif k == "lstm_cell":
                st[k] = meta["lstm/init_cell"].clone()
            else:
                st[k] = torch.zeros(shape, dtype=torch.float32, device=p.device)
        return st

    def _init_global_state(self) -> dict[str, Tensor]:
        hp = self.hp
        buf = _spec.loss_buffer_init(hp.loss_horizon, dtype=np.float32)
        out = {"mom_t": torch.zeros((len(hp.initial_momentum_decays),), dtype=torch.int32),
               "rms_t": torch.zeros((len(hp.initial_rms_decays),), dtype=torch.int32),
               "loss_iteration": torch.zeros((), dtype=torch.int32)}
        for k in _LOSS_VARS:
            out[k] = torch.from_numpy(buf[k.removeprefix("loss_")].copy()).to(self._device)
        return out

    # -- the update -------------------------------------------------------------------------
    _triton_state_vars = _ACC_VARS + ("lstm_hidden", "lstm_cell")

    def _loss_step(self, loss: Tensor, gstate: dict[str, Any]) -> tuple[Tensor, ...]:
        """The loss buffer's update: ``(means, running_min, t / N, loss features)``."""
        dev = loss.device
        for k in _LOSS_VARS:  # load_state_dict may have left them elsewhere
            if gstate[k].device != dev:
                gstate[k] = gstate[k].to(dev)
        loss_it = int(gstate["loss_iteration"])
        means, rmin, _, lfeat = _spec.loss_buffer_step(
            torch, gstate["loss_means"], gstate["loss_running_min"], gstate["loss_decays"],
            loss_it, loss)
        frac = (torch.tensor(int(gstate["iteration"]), dtype=torch.float32)
                / torch.tensor(int(gstate["num_steps"]), dtype=torch.float32))
        return means, rmin, frac, lfeat

    @staticmethod
    def _advance(gstate: dict[str, Any], means: Tensor, rmin: Tensor) -> None:
        gstate["loss_means"], gstate["loss_running_min"] = means, rmin
        gstate["loss_iteration"] += 1
        gstate["mom_t"] += 1
        gstate["rms_t"] += 1

    def _inner_update(self, entries: list[Entry], loss: Tensor, gstate: dict[str, Any]) -> None:
        means, rmin, frac, lfeat = self._loss_step(loss, gstate)
        if self._use_triton(entries):
            io = self._triton_io(entries, _ACC_VARS)
            self._triton_update(io, [e.state for e in entries], frac, lfeat)
            for e, step in io["post"]:
                self._apply_step(e, step)
        else:
            self._plain_update(entries, frac, lfeat, loss.device)
        self._advance(gstate, means, rmin)

    def _triton_fast_update(self, io: Any, loss: Tensor, gstate: dict[str, Any]) -> None:
        from xopt.kernels.velo import VeLOTriton

        if self._triton is None:
            self._triton = VeLOTriton(self.hp, self.precision)
        dev = io.params[0].device
        if self._triton.graphs_loss(dev):  # the loss buffer's update inside the CUDA graph
            for k in _LOSS_VARS:
                if gstate[k].device != dev:  # (load_state_dict may have left them elsewhere)
                    gstate[k] = gstate[k].to(dev)
            self._triton_update(io, io.states, None, None, fast=io, loss_state=(gstate, loss))
            self._advance(gstate, gstate["loss_means"], gstate["loss_running_min"])
            return
        means, rmin, frac, lfeat = self._loss_step(loss, gstate)
        self._triton_update(io, io.states, frac, lfeat, fast=io)
        self._advance(gstate, means, rmin)

    def _triton_update(self, io: Any, states: list[dict[str, Any]], frac: Tensor | None,
                       lfeat: Tensor | None, fast: Any = None,
                       loss_state: tuple | None = None) -> None:
        """The fused Triton step (:mod:`xopt.kernels.velo`) over all tensors. The LSTM state
        of the parameters is kept as views of one ``[n_tensors, H]`` tensor (recognized by
        their pointers when ``fast`` is the base's :class:`~xopt.torch._lopt_triton.TritonIO`)."""
        from xopt.kernels.velo import VeLOTriton

        if self._triton is None:
            self._triton = VeLOTriton(self.hp, self.precision)
        dev = io["params"][0].device
        views = getattr(self, "_lstm_views", None)
        if views is not None and (views[0].device != dev or views[0].shape[0] != len(states)):
            views = None
        if views is not None:
            if fast is not None:  # the views' pointers, as the state tensors' (O(1) lists;
                # checked once per TritonIO build: its state tensors stay the same then)
                ok = views[6] == fast.build or (fast.ptrs["lstm_hidden"] == views[4]
                                                and fast.ptrs["lstm_cell"] == views[5])
                if ok:
                    views = self._lstm_views = views[:6] + (fast.build,)
            else:
                ok = (all(a is s["lstm_hidden"] for a, s in zip(views[2], states, strict=True))
                      and all(a is s["lstm_cell"] for a, s in zip(views[3], states,
                                                                   strict=True)))
            if not ok:
                views = None
        if views is not None:
            hidden, cell = views[0], views[1]  # the states are still our views of these
        else:
            hidden = torch.stack([s["lstm_hidden"] for s in states]).to(dev)
            cell = torch.stack([s["lstm_cell"] for s in states]).to(dev)
        self._triton.step(io["params"], io["grads"], io["states"], io["outs"],
                          io["write_step"], io["lrs"], io["lrwds"], self.meta_on(dev), hidden,
                          cell, frac, lfeat, io=fast, loss_state=loss_state)
        if views is None:  # each state's LSTM state: a view of one [n_tensors, H] tensor
            hv, cv = list(hidden.unbind(0)), list(cell.unbind(0))
            for s, h, c in zip(states, hv, cv, strict=True):
                s["lstm_hidden"] = h
                s["lstm_cell"] = c
            self._lstm_views = (hidden, cell, hv, cv, [h.data_ptr() for h in hv],
                                [c.data_ptr() for c in cv], None)

    def _plain_update(self, entries: list[Entry], frac: Tensor, lfeat: Tensor,
                      dev: torch.device) -> None:
        """The spec's torch code, two passes over the tensors (the reference)."""
        hp = self.hp
        per_device: dict[torch.device, dict[str, Any]] = {}

        def on(device: torch.device) -> dict[str, Any]:
            if device not in per_device:
                like = self.meta_on(device)["lstm/init_hidden"]
                per_device[device] = {
                    "meta": self.meta_on(device), "frac": frac.to(device),
                    "lfeat": lfeat.to(device),
                    "decays": tuple(arrays.constant(torch, d, like)
                                    for d in _spec.decay_arrays(hp)),
                }
            return per_device[device]

        # pass 1: one row of LSTM inputs per tensor (from the accumulators before this update)
        rows = []
        for e in entries:
            d = on(e.param.device)
            rows.append(_spec.lstm_features(torch, e.p32, e.state["m"], e.state["rms"],
                                            d["frac"], d["lfeat"]).to(dev))
        hidden = torch.stack([e.state["lstm_hidden"].to(dev) for e in entries])
        cell = torch.stack([e.state["lstm_cell"].to(dev) for e in entries])
        controls, lr_mult, hidden, cell = _spec.lstm_step(torch, torch.stack(rows), hidden,
                                                          cell, self.meta_on(dev))
        # pass 2: accumulators, the tensor's MLP and its step, one tensor at a time
        for i, e in enumerate(entries):
            pdev = e.param.device
            d = on(pdev)
            st = e.state
            p = e.param
            step, accs = _spec.update_tensor(
                torch, hp, e.p32, e.grad, *(st[v] for v in _ACC_VARS),
                _row_for(p, controls[i]).to(pdev), _row_for(p, lr_mult[i]).to(pdev),
                d["meta"], d["decays"])
            for v, a in zip(_ACC_VARS, accs, strict=True):
                st[v] = a
            st["lstm_hidden"] = _row_for(p, hidden[i]).to(pdev, copy=True)
            st["lstm_cell"] = _row_for(p, cell[i]).to(pdev, copy=True)
            self._apply_step(e, step)


def _row_for(p: Tensor, x: Tensor) -> Tensor:
    """``p``'s row ``x`` of the LSTM's outputs. Under FSDP2 the LSTM runs over every tensor
    at once, so its outputs are replicated DTensors as soon as one parameter is a DTensor;
    a parameter FSDP2 leaves plain (a scalar, an ignored parameter) takes its row as a
    plain tensor (the replicated row's local block is the whole row), so that its state
    and its step stay plain like the parameter."""
    return x.full_tensor() if is_dtensor(x) and not is_dtensor(p) else x


register("velo", "torch", VeLO)
