"""The base of xopt's learned optimizers in PyTorch: everything that is not the method.

:class:`LearnedOptimizer` is a ``torch.optim.Optimizer`` (an :class:`xopt.torch._optim.Optimizer`:
named errors, all-or-nothing steps, ``nonfinite=``, strict state dicts) that does, for any
learned optimizer, what learned_optimization's ``prefab`` wrappers and a good torch
optimizer do around the learned update itself (see :class:`xopt.specs.lopt.LOptOptions`
for the arithmetic, which :func:`xopt.specs.lopt.outer_step` defines as a pure function):

* the loss, from ``step(closure)`` or ``step(loss=...)``;
* coupled weight decay (prefab's ``WeightDecayWrapper``) or decoupled decay;
* gradient accumulation when ``num_training_steps > max_training_steps`` (prefab's
  ``GradientAccumulator``), applied inside the weight decay as prefab nests them;
* per-group ``lr`` (a multiplier of the learned step, driven by LR schedulers) and
  ``weight_decay``;
* bfloat16/float16/float32/float64 parameters with float32 state: the method computes in
  float32 and the new parameter is computed in ``promote(param dtype, float32)`` and
  rounded once into the parameter;
* ``nonfinite=``: the gradients and the loss are checked (``"raise"``) or a non-finite
  step is skipped (``"skip"``) before anything moves (:mod:`xopt.nonfinite`);
* validation that names the parameter, hyperparameter or meta-parameter at fault and leaves
  the optimizer unchanged; meta-parameters whose shapes do not fit the hyperparameters
  name the hyperparameter values they fit;
* meta-parameters: either naming, or a seeded fresh draw, kept as float32 tensors and
  copied once to each device that needs them;
* global state in ``self.state["global"]``, created at the first step (as every other
  state entry, so that DCP's ``get/set_optimizer_state_dict`` see an optimizer without
  state until then and create it with one step of lr 0). ``state_dict()`` keeps every
  entry under a parameter's key, as DCP requires: the global entries ride with the first
  parameter's state as ``"global/<name>"``; ``load_state_dict`` reads that form (and the
  older one with a ``"global"`` key), checks every entry first and restores the float32
  state of low-precision parameters exactly (torch would cast it to the parameter's dtype);
* data parallelism (:mod:`xopt.torch.distributed`): the ranks' agreement is checked at the
  first step, and the loss given to ``step`` is each rank's own: the optimizer reads the
  ranks' mean (the loss of the global batch), one scalar all-reduce.

The Triton path (``impl=``) and the caches that keep a steady step free of per-tensor
Python work are the mixin :class:`xopt.torch._lopt_triton.TritonPath`. The step reads its
iteration counter on the host (time features, the accumulation schedule) and runs the
fused kernels with host-side tables, so it is excluded from torch.compile's dynamo: a
compiled training step breaks once at ``step()`` and runs the optimizer eagerly.

Subclass contract (what small_fc_lopt and VeLO fill in):

``hyperparams_cls`` (class attribute)
    the method's :class:`~xopt.specs.lopt.LOptOptions` dataclass.
``meta_spec`` (class attribute)
    the spec's :class:`~xopt.specs.MetaParams` (``SPEC.meta``): ``coerce(θ, hp)`` (either
    naming, strict) and ``init(hp, seed)`` (used when no θ is given).
``needs_loss`` (class attribute, default False)
    True: ``step`` without a loss is an error (VeLO). False: a missing loss counts as 0.
``_init_param_state(self, p) -> dict[str, Tensor]`` (required)
    the per-parameter state of ``p`` before its first update (float32, on ``p.device``);
    the base adds ``grad_accum`` when accumulating. Called lazily, at the first ``step``
    in which ``p`` has a gradient, after all validation.
``_init_global_state(self) -> dict[str, Tensor]`` (optional)
    the method's global state (e.g. small_fc's ``mom_t``/``rms_t``); the base adds
    ``iteration`` (int32, inner updates taken), ``num_steps`` (int32, the inner horizon)
    and, when accumulating, ``loss_accum`` (float32) and ``accum_iteration`` (int64).
``_inner_update(self, entries, loss, gstate) -> None`` (required)
    one update of the learned optimizer proper. ``entries`` is a list of :class:`Entry`
    (one per parameter to update, in param-group order): ``e.grad`` is the float32
    gradient *after* coupled weight decay and accumulation-averaging (computed on access,
    so that extra memory stays at one tensor at a time: read it once per pass), ``e.p32``
    the parameter as float32, ``e.state`` its state dict (replace or update its tensors),
    ``e.name``, ``e.group``. ``loss`` is a float32 0-d tensor (after coupled decay and
    averaging; 0 when none was given and ``needs_loss`` is False). ``gstate`` is
    ``self.state["global"]``: read ``int(gstate["iteration"])`` (the inner iteration t,
    before this update); advance the method's own counters there; the base advances
    ``iteration`` afterwards. The hook may first pass over all entries (VeLO's per-tensor
    LSTM needs every tensor's features before any step), then must call
    ``self._apply_step(e, step)`` exactly once per entry, with ``step`` the float32 step of
    ``e`` (``p ← p − lr·step``; the base applies lr and decoupled decay), and must not read
    ``e.grad``/``e.p32`` of an entry after applying its step.

Helpers for the hook: ``self.meta_on(device)`` (θ as float32 tensors on a device, xopt's
naming), ``self.hp`` (the hyperparameters), ``self._apply_step(e, step)``.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from xopt.errors import HyperparameterError, MetaParamsError, StateError
from xopt.nonfinite import SKIP_COUNTER
from xopt.specs import MetaParams
from xopt.specs.lopt import LOptOptions
from xopt.torch._lopt_triton import TritonIO, TritonPath
from xopt.torch._optim import Item, Layout, Optimizer, check_layout, param_name
from xopt.torch.distributed import (
    is_dtensor,
    mean_loss,
    place_as,
    plain_as_replicated,
    settle,
    validated,
)

__all__ = ["Entry", "LearnedOptimizer"]


@dataclasses.dataclass
class Entry:
    """One parameter in an inner update (see the module docstring)."""

    param: Tensor
    state: dict[str, Any]
    group: dict[str, Any]
    name: str
    index: tuple[int, int]
    _grad: Callable[[], Tensor]

    @property
    def grad(self) -> Tensor:
        """float32 gradient seen by the learned optimizer (computed on each access; may be
        the parameter's own ``.grad``: do not modify it in place)."""
        return self._grad()

    @property
    def p32(self) -> Tensor:
        """The parameter as float32 (the parameter itself when it is float32)."""
        p = self.param.detach()
        return p if p.dtype == torch.float32 else p.float()


def _meta_to_torch(meta: Mapping[str, Any], where: str) -> dict[str, Tensor]:
    out = {}
    for k, v in meta.items():
        if isinstance(v, Tensor):
            t = v.detach().to(device="cpu", dtype=torch.float32).clone()
        else:
            t = torch.from_numpy(np.array(v, dtype=np.float32, copy=True))
        if not bool(torch.isfinite(t).all()):
            raise MetaParamsError(f"{where}: meta-parameter {k!r} holds NaN or inf")
        out[k] = t
    return out


class LearnedOptimizer(TritonPath, Optimizer):
    """Base class of xopt's learned optimizers (see the module docstring for the hooks).

    Args:
      params: parameters or parameter groups; groups may set ``lr`` and ``weight_decay``.
      meta_params: the learned optimizer's weights, a mapping of arrays (NumPy, torch, ...)
        in xopt's or the original's naming; None draws ``meta_init(hp, seed)``.
      spec: the method's hyperparameter dataclass instead of keywords.
      seed: seed of the fresh meta-parameters when ``meta_params`` is None.
      nonfinite: ``"ignore"`` (default), ``"raise"`` (NonFiniteError naming the gradient or
        the loss before anything moves) or ``"skip"`` (:mod:`xopt.nonfinite`);
        ``check_finite=True`` is the older spelling of ``"raise"``.
      **hyperparameters: fields of ``hyperparams_cls`` (a value None means "not given").
    """

    hyperparams_cls: ClassVar[type[LOptOptions]]
    meta_spec: ClassVar[MetaParams]
    needs_loss: ClassVar[bool] = False
    _transient = Optimizer._transient | {"_meta_cache", "_triton", "_lstm_views", "_fio",
                                         "_gcache", "_zero_loss"}

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]],
                 meta_params: Mapping[str, Any] | None = None, *, spec: LOptOptions | None = None,
                 seed: int = 0, nonfinite: str | None = None, check_finite: bool | None = None,
                 **hyperparameters: Any) -> None:
        cls_name = type(self).__name__
        given = {k: v for k, v in hyperparameters.items() if v is not None}
        if spec is not None:
            if not isinstance(spec, self.hyperparams_cls):
                raise HyperparameterError(
                    f"{cls_name}: spec must be a {self.hyperparams_cls.__module__}."
                    f"{self.hyperparams_cls.__name__}, got {type(spec).__name__}")
            if given:
                raise HyperparameterError(
                    f"{cls_name}: pass either spec= or hyperparameters, not both (got spec and "
                    f"{', '.join(sorted(given))}); use spec.replace(...)")
            hp = spec
        else:
            self.hyperparams_cls._reject_unknown(given)
            hp = self.hyperparams_cls(**given)
        hp.require_num_training_steps(cls_name)
        self.hp = hp
        where = f"{cls_name} meta_params"
        if meta_params is None:
            theta = self.meta_spec.init(hp, seed)
        else:
            try:
                theta = self.meta_spec.coerce(meta_params, hp)
            except MetaParamsError as e:
                hint = _fitting_hint(self.meta_spec, meta_params, hp)
                if hint is None:
                    raise
                raise MetaParamsError(f"{e}; {hint}") from None
        self.meta = _meta_to_torch(theta, where)
        self._meta_cache: dict[torch.device, dict[str, Tensor]] = {}
        self._fio: TritonIO | None = None
        self._gcache = None
        super().__init__(params, {"lr": hp.lr, "weight_decay": hp.weight_decay},
                         nonfinite=nonfinite, check_finite=check_finite)
        first = next(iter(self._all_params()), None)
        self._device = first.device if first is not None else torch.device("cpu")

    # -- checkpoints (xopt.checkpoints.hub) ---------------------------------------------------
    @classmethod
    def from_pretrained(cls, params: Iterable[Tensor] | Iterable[dict[str, Any]],
                        path_or_repo_id: Any = None, **kwargs: Any) -> LearnedOptimizer:
        """The optimizer with θ and hyperparameters from a checkpoint: a local directory in
        any format :mod:`xopt.checkpoints` reads, a Hub repository (``"hf://owner/name"``
        or ``repo_id="owner/name"``), or PyLO VeLO's pair ``(rnn, mlp)``; keywords
        (``num_training_steps=...``, ``decays=`` for a PyLO small_fc_lopt) as
        :func:`xopt.checkpoints.hub.from_pretrained`."""
        from xopt.checkpoints import hub

        return hub.from_pretrained(cls, params, path_or_repo_id, **kwargs)

    def save_pretrained(self, save_directory: Any, *, format: str = "xopt",
                        overwrite: bool = True) -> Any:
        """Write θ and the hyperparameters (format ``"xopt"``, ``"lo"`` or ``"pylo"``)."""
        from xopt.checkpoints import hub

        return hub.save_pretrained(self.hyperparams_cls.METHOD, self.hp, self.meta,
                                   save_directory, format=format, overwrite=overwrite)

    def push_to_hub(self, repo_id: Any, **kwargs: Any) -> list[str]:
        """Upload the checkpoint to the Hugging Face Hub (needs ``xopt-ml[hub]``)."""
        from xopt.checkpoints import hub

        return hub.push_to_hub(self.hyperparams_cls.METHOD, self.hp, self.meta, repo_id,
                               **kwargs)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._meta_cache = {}
        self._triton = None
        self._lstm_views = None
        self._fio = None
        self._gcache = None

    # -- hooks (see the module docstring) -------------------------------------------------
    def _init_param_state(self, p: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    def _init_global_state(self) -> dict[str, Tensor]:
        return {}

    def _inner_update(self, entries: list[Entry], loss: Tensor, gstate: dict[str, Any]) -> None:
        raise NotImplementedError

    # -- helpers for subclasses -------------------------------------------------------------
    def meta_on(self, device: torch.device) -> dict[str, Tensor]:
        """The meta-parameters as float32 tensors on ``device`` (copied once per device)."""
        device = torch.device(device)
        if device not in self._meta_cache:
            self._meta_cache[device] = {k: v.to(device) for k, v in self.meta.items()}
        return self._meta_cache[device]

    def _apply_step(self, e: Entry, step: Tensor) -> None:
        """``p ← p − lr·step`` (decoupled decay: ``p ← p − (lr·step + (lr·λ)·p)``), in
        ``promote(p.dtype, float32)``, rounded once into ``p``."""
        p = e.param
        lr, wd = e.group["lr"], e.group["weight_decay"]
        decay = self.hp.weight_decay_mode == "decoupled" and not _is_zero(wd)
        wide = torch.promote_types(p.dtype, torch.float32)
        pw = p.detach() if p.dtype == wide else p.detach().to(wide)
        u = step if step.dtype == wide else step.to(wide)
        if not _is_one(lr):
            u = lr * u
        if decay:
            u = u + (lr * wd) * pw
        if p.dtype == wide:
            p.detach().sub_(u)
        else:
            p.detach().copy_(pw - u)

    def _decay_only(self, p: Tensor, group: dict[str, Any]) -> None:
        """Decoupled decay on a call without an inner update: ``p ← p − (lr·λ)·p``."""
        lr, wd = group["lr"], group["weight_decay"]
        if self.hp.weight_decay_mode != "decoupled" or _is_zero(wd):
            return
        wide = torch.promote_types(p.dtype, torch.float32)
        pw = p.detach() if p.dtype == wide else p.detach().to(wide)
        p.detach().copy_(pw - (lr * wd) * pw)


    # -- construction and validation --------------------------------------------------------
    def _all_params(self) -> Iterable[Tensor]:
        return itertools.chain.from_iterable(g["params"] for g in self.param_groups)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._gcache = None
        super().add_param_group(param_group)

    def _check_group(self, group: dict[str, Any], gi: int) -> None:
        try:
            self.hp.replace(lr=group["lr"], weight_decay=group["weight_decay"])
        except HyperparameterError as e:
            raise HyperparameterError(f"{type(self).__name__} param_groups[{gi}]: {e}") from None

    def _new_global_state(self) -> dict[str, Tensor]:
        g = {"iteration": torch.zeros((), dtype=torch.int32),
             "num_steps": torch.tensor(self.hp.inner_num_steps, dtype=torch.int32)}
        g.update(self._init_global_state())
        if self.hp.accumulating:
            g["loss_accum"] = torch.zeros((), dtype=torch.float32, device=self._device)
            g["accum_iteration"] = torch.zeros((), dtype=torch.int64)
        return g

    def _new_param_state(self, p: Tensor) -> dict[str, Tensor]:
        st = self._init_param_state(p)
        if self.hp.accumulating:
            st["grad_accum"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if is_dtensor(p):  # FSDP2: state placed as the parameter (DCP saves and reshards it)
            st = {k: place_as(p, v) for k, v in st.items()}
        return st

    def _loss_tensor(self, loss: Any) -> Tensor:
        name = type(self).__name__
        if loss is None:
            if self.needs_loss and not all(_is_zero(g["lr"]) for g in self.param_groups):
                # (a step of lr 0, as DCP's get/set_optimizer_state_dict take to create the
                # state of a fresh optimizer, moves nothing: its loss counts as 0)
                raise ValueError(f"{name}.step needs the loss: call step(closure) with a closure "
                                 "that returns it, or step(loss=loss)")
            # one zero scalar per optimizer and device, not a new one (an allocation and a
            # fill kernel outside the step's CUDA graph) per step; every use is out of place
            z = getattr(self, "_zero_loss", None)
            if z is None or z.device != self._device:
                z = self._zero_loss = torch.zeros((), dtype=torch.float32, device=self._device)
            return z
        if isinstance(loss, Tensor):
            if loss.numel() != 1 or loss.is_complex() or not (
                    loss.is_floating_point() or loss.dtype in (torch.int32, torch.int64)):
                raise ValueError(f"{name}.step: the loss must be a real scalar, got a tensor of "
                                 f"shape {tuple(loss.shape)} and dtype {loss.dtype}")
            return loss.detach().reshape(()).to(dtype=torch.float32)
        arr = np.asarray(loss) if isinstance(loss, (numbers.Real, np.ndarray, np.generic)) \
            else None
        if arr is None or isinstance(loss, bool) or arr.size != 1 or not (
                np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"{name}.step: the loss must be a real scalar, got "
                             f"{type(loss).__name__}")
        return torch.tensor(float(arr.reshape(())), dtype=torch.float32, device=self._device)

    # -- the step ---------------------------------------------------------------------------
    @torch.compiler.disable(reason=(
        "a learned optimizer's step reads its iteration counter on the host and runs fused "
        "kernels with host-side tables"))
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, loss: Any = None) -> Any:
        """One call: ``closure`` re-evaluates the model and returns the loss, or pass
        ``loss=`` (not both). Returns the loss given or computed."""
        if closure is not None:
            if loss is not None:
                raise ValueError(f"{type(self).__name__}.step: pass the loss through the "
                                 "closure or loss=, not both")
            with torch.enable_grad():
                loss = closure()
        self._resolve_pending()

        def check() -> tuple[Any, list, Tensor]:
            steady = self._steady_io()
            if steady is None:
                self._check_groups()
            items = self._gather() if steady is None else steady[0].items
            return steady, items, self._loss_tensor(loss)

        # distributed runs: this validation and the ranks' agreement are one decision
        ranks, (steady, items, loss_t) = validated(self, check)
        if loss is not None:  # data parallel: the loss of the global batch, on every rank
            loss_t = mean_loss(loss_t, ranks)
        if self.nonfinite != "ignore":
            checked = [Item(gi, i, p, p.grad, group) for gi, i, p, group in items]
            params = [it.param for it in checked]
            if self.hp.accumulating:  # an update may write every accumulating parameter
                seen = {id(p) for p in params}
                params += [p for p in self._all_params()
                           if id(p) not in seen and "grad_accum" in self.state.get(p, ())]
            with plain_as_replicated(self._all_params()):
                self._run_step(checked, lambda: self._step(items, loss_t, steady),
                               loss=None if loss is None else loss_t, state_keys=["global"],
                               params=params)
        else:
            with plain_as_replicated(self._all_params()):
                self._step(items, loss_t, steady)
        return loss

    def _step(self, items: list, loss_t: Tensor, steady: Any) -> None:
        """The update (after validation; nothing has changed yet)."""
        if not self.state.get("global"):
            self.state["global"] = self._new_global_state()
        if steady is not None:  # nothing but the gradient tensors or the lrs changed
            io, io.grads = steady
            try:
                self._triton_fast_update(io, loss_t, self.state["global"])
            finally:
                io.grads = []
            self.state["global"]["iteration"] += 1
            return
        if not items:
            return
        # -- from here on the state changes --
        c = self._fio
        same = c is not None and c.items is items and c.states_unchanged(self.state)
        if not same:
            for _, _, p, _ in items:
                st = self.state[p]
                if not st or (len(st) == 1 and SKIP_COUNTER in st):
                    self.state[p] = {**self._new_param_state(p), **st}
        hp = self.hp
        gstate = self.state["global"]
        coupled = hp.weight_decay_mode == "coupled"
        if coupled and any(not _is_zero(g["weight_decay"]) for g in self.param_groups):
            total: Any = 0
            for group in self.param_groups:
                wd = group["weight_decay"]
                if _is_zero(wd):
                    continue
                for p in group["params"]:
                    total = total + (_f32(p) ** 2).sum() * wd
            loss_t = loss_t + total

        def decayed_grad(p: Tensor, group: dict[str, Any]) -> Callable[[], Tensor]:
            wd = group["weight_decay"]
            if coupled and not _is_zero(wd):
                return lambda: _f32(p.grad) + wd * _f32(p)
            return lambda: _f32(p.grad)

        if not hp.accumulating:
            io = None if coupled and any(not _is_zero(g["weight_decay"])
                                         for g in self.param_groups) \
                else self._fast_triton_io(items, same)
            if io is not None:
                try:
                    self._triton_fast_update(io, loss_t, gstate)
                finally:
                    io.grads = []
                gstate["iteration"] += 1
                return
            entries = [Entry(p, self.state[p], group, param_name(group, gi, i), (gi, i),
                             decayed_grad(p, group)) for gi, i, p, group in items]
            self._inner_update(entries, loss_t, gstate)
            self._settle(entries)
            gstate["iteration"] += 1
            return

        n = hp.num_average
        for _, _, p, group in items:
            self.state[p]["grad_accum"].add_(decayed_grad(p, group)())
        gstate["loss_accum"] = gstate["loss_accum"] + loss_t.to(gstate["loss_accum"].device)
        gstate["accum_iteration"] += 1
        if int(gstate["accum_iteration"]) % n != 0:
            for _, _, p, group in items:
                self._decay_only(p, group)
            return
        inv = 1.0 / n  # as XLA evaluates the original's division by the constant n
        entries = []
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                st = self.state.get(p)
                if st and "grad_accum" in st:
                    acc = st["grad_accum"]
                    entries.append(Entry(p, st, group, param_name(group, gi, i), (gi, i),
                                         lambda acc=acc: acc * inv))
        self._inner_update(entries, gstate["loss_accum"] * inv, gstate)
        self._settle(entries)
        gstate["iteration"] += 1
        for e in entries:
            e.state["grad_accum"].zero_()
        gstate["loss_accum"] = torch.zeros_like(gstate["loss_accum"])

    @staticmethod
    def _settle(entries: list[Entry]) -> None:
        """FSDP2: state whose sums over shards DTensor left pending is completed now."""
        for e in entries:
            if is_dtensor(e.param):
                for k, v in e.state.items():
                    e.state[k] = settle(v)

    # -- state dicts --------------------------------------------------------------------------
    def _state_layout(self, p: Tensor, group: Any) -> dict[str, Layout]:
        st = self._new_param_state(torch.empty_like(p, device="meta"))
        self._meta_cache.pop(torch.device("meta"), None)
        return {k: Layout(tuple(v.shape), v.dtype) for k, v in st.items()}

    def state_dict(self) -> dict[str, Any]:
        """torch's, with the global state under the first parameter's key (``"global/<name>"``
        entries beside its own): every key of ``state`` is a parameter's, as DCP requires."""
        sd = super().state_dict()
        glob = sd["state"].pop("global", None)
        ids = [k for g in sd["param_groups"] for k in g["params"]]
        if glob is not None and ids:
            anchor = {k: v for k, v in sd["state"].get(ids[0], {}).items()}
            # on the parameters' device, as the rest of the state: DCP's full-state-dict load
            # refuses a state dict whose tensors (counters of one per decay) sit on two
            # devices; the step keeps its counters on the host and load moves them back
            anchor.update({f"{_GLOBAL}{k}": v.to(self._device) for k, v in glob.items()})
            sd["state"][ids[0]] = anchor
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(_global_apart(state_dict))

    def _check_state_dict(self, state_dict: Any) -> Any:
        state_dict = _global_apart(state_dict)
        st = state_dict.get("state") if isinstance(state_dict, Mapping) else None
        if isinstance(st, Mapping) and any(k != "global" for k in st) and not isinstance(
                st.get("global"), Mapping):
            raise StateError(f"{type(self).__name__}.load_state_dict: missing state['global'] "
                             "(the global state of a learned optimizer; a state dict of "
                             "another optimizer?)")
        return super()._check_state_dict(state_dict)

    def _check_extra_state(self, key: Any, value: Any) -> None:
        if key != "global":
            super()._check_extra_state(key, value)
            return
        where = f"{type(self).__name__}.load_state_dict: state['global']"
        if not isinstance(value, Mapping):
            raise StateError(f"{where}: a {type(value).__name__}, expected a mapping")
        layout = {k: Layout(tuple(v.shape), v.dtype)
                  for k, v in self._new_global_state().items()}
        check_layout(value, [layout], where)

    def _loaded(self, state_dict: Mapping[str, Any]) -> None:
        glob = state_dict["state"].get("global")
        if glob is None:  # saved before any step
            self.state.pop("global", None)
            return
        self.state["global"] = {
            kk: vv.detach().clone().to(self._device if kk == "loss_accum" else "cpu")
            for kk, vv in glob.items()}


_GLOBAL = "global/"


def _global_apart(state_dict: Any) -> Any:
    """``state_dict`` with the ``"global/<name>"`` entries (:meth:`LearnedOptimizer.state_dict`)
    moved back under ``state["global"]``; anything else as it is (the checks name it)."""
    st = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    if not isinstance(st, Mapping) or "global" in st or not isinstance(groups, list):
        return state_dict
    ids = [k for g in groups if isinstance(g, Mapping) for k in g.get("params", ())]
    entry = st.get(ids[0]) if ids else None
    if not isinstance(entry, Mapping) or not any(
            isinstance(k, str) and k.startswith(_GLOBAL) for k in entry):
        return state_dict  # (global entries elsewhere are unexpected keys there)
    new = dict(st)
    own = {k: v for k, v in entry.items() if not str(k).startswith(_GLOBAL)}
    if own:
        new[ids[0]] = own
    else:
        del new[ids[0]]
    new["global"] = {k[len(_GLOBAL):]: v for k, v in entry.items() if str(k).startswith(_GLOBAL)}
    return {**state_dict, "state": new}


def _f32(x: Tensor) -> Tensor:
    x = x.detach()
    return x if x.dtype == torch.float32 else x.float()


def _is_zero(x: Any) -> bool:
    return isinstance(x, (int, float)) and x == 0


def _is_one(x: Any) -> bool:
    return isinstance(x, (int, float)) and x == 1


def _fitting_hint(meta: MetaParams, theta: Any, hp: LOptOptions) -> str | None:
    """Which hyperparameter values θ's shapes fit (``"it fits hidden_size=32: pass
    hidden_size=32 ..."``), trying each integer field alone and in pairs over the sizes
    θ's arrays have; None when no such values are found. Only on the error path."""
    if not isinstance(theta, Mapping):
        return None
    dims = set()
    for v in theta.values():
        dims.update(int(d) for d in np.shape(v))
    fields = [f.name for f in dataclasses.fields(hp)
              if isinstance(getattr(hp, f.name), int) and not isinstance(getattr(hp, f.name), bool)
              and f.name not in ("num_training_steps", "max_training_steps")]

    def fits(h: LOptOptions) -> bool:
        try:
            meta.coerce(theta, h)
        except (MetaParamsError, HyperparameterError):
            return False
        return True

    candidates = [{f: v} for f in fields for v in sorted(dims | {0}) if v != getattr(hp, f)]
    candidates += [{f: v, g: w} for i, f in enumerate(fields) for g in fields[i + 1:]
                   for v in sorted(dims | {0}) for w in sorted(dims | {0})
                   if v != getattr(hp, f) and w != getattr(hp, g)]
    for change in candidates:
        try:
            h = hp.replace(**change)
        except HyperparameterError:
            continue
        if fits(h):
            given = ", ".join(f"{k}={v}" for k, v in change.items())
            return (f"these meta-parameters fit {given} (this optimizer has "
                    f"{', '.join(f'{k}={getattr(hp, k)}' for k in change)}): pass {given}; "
                    "for the θ bundled with xopt, xopt.checkpoints.bundled.bundled_meta_params() "
                    "returns the hyperparameters it needs, scales such as step_mult included")
    return None
