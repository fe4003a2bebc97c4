"""The base of xopt's learned optimizers in PyTorch: everything that is not the method.

:class:`LearnedOptimizer` is a ``torch.optim.Optimizer`` that does, for any learned
optimizer, what learned_optimization's ``prefab`` wrappers and a good torch optimizer do
around the learned update itself (see :class:`xopt.specs.lopt.LOptOptions` for the
arithmetic, which :func:`xopt.specs.lopt.outer_step` defines as a pure function):

* the loss, from ``step(closure)`` or ``step(loss=...)``;
* coupled weight decay (prefab's ``WeightDecayWrapper``) or decoupled decay;
* gradient accumulation when ``num_training_steps > max_training_steps`` (prefab's
  ``GradientAccumulator``), applied inside the weight decay as prefab nests them;
* per-group ``lr`` (a multiplier of the learned step, driven by LR schedulers) and
  ``weight_decay``;
* bfloat16/float16/float32/float64 parameters with float32 state: the method computes in
  float32 and the new parameter is computed in ``promote(param dtype, float32)`` and
  rounded once into the parameter;
* ``check_finite=True``: every gradient and the loss are checked before anything moves;
* validation that names the parameter, hyperparameter or meta-parameter at fault and leaves
  the optimizer unchanged;
* meta-parameters: either naming, or a seeded fresh draw, kept as float32 tensors and
  copied once to each device that needs them;
* global state in ``self.state["global"]`` (a str key: torch's ``state_dict`` and
  ``load_state_dict`` carry it unchanged), and a ``load_state_dict`` that restores the
  float32 state of low-precision parameters exactly (torch would cast it to the
  parameter's dtype).

Subclass contract (what small_fc_lopt fills in and VeLO will):

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

Implementations: ``impl=`` (set by the subclass through :meth:`_set_impl`) chooses between
the plain path (the hook above, the reference) and the method's Triton step
(:mod:`xopt.kernels`): ``_use_triton(entries)`` says which one an update takes and
``_triton_io(entries, vars)`` gathers what the kernels need. The Triton step updates
float32 contiguous parameters in place with the same ``p − (lr·step + (lr·λ)·p)``
arithmetic as :meth:`_apply_step`, and hands other parameters' steps to it.

The Triton fast path (a subclass sets ``_triton_state_vars`` and implements
``_triton_fast_update(io, loss, gstate)``): when every parameter and gradient is float32
and contiguous, nothing is accumulated and no coupled decay changes the gradient, the step
builds no :class:`Entry`; :meth:`_fast_triton_io` keeps a :class:`TritonIO` (pointers,
lrs, state dicts) between steps and re-checks it in C-level passes over the tensors
(identity of the parameters, state dicts and state tensors; the parameters' and gradients'
pointers), as :meth:`_gather` keeps its validated list; what changed is rebuilt, and
``TritonIO.version`` tells the kernels' host tables when.

Helpers for the hook: ``self.meta_on(device)`` (θ as float32 tensors on a device, xopt's
naming), ``self.hp`` (the hyperparameters), ``self._apply_step(e, step)``.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import operator
from collections.abc import Callable, Iterable, Mapping
from itertools import chain, compress, repeat
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from torch import Tensor

from xopt.errors import HyperparameterError, MetaParamsError, NonFiniteError, StateError
from xopt.specs import MetaParams
from xopt.specs.lopt import LOptOptions
from xopt.torch._state_dict import saved_param_map

__all__ = ["Entry", "LearnedOptimizer"]

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
# C-level getters for the per-step checks (no Python frame per tensor)
_GRAD = operator.attrgetter("grad")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")
_DPTR = torch.Tensor.data_ptr
_CONTIG = torch.Tensor.is_contiguous


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


class _GatherCache(NamedTuple):
    """What :meth:`LearnedOptimizer._gather` validated last (compared by identity and by
    value at the next call)."""

    groups: list            # the param_groups dicts
    param_lists: list       # each group's "params" list
    lengths: list[int]      # their lengths
    params: list[Tensor]    # all parameters, flattened
    no_grad: list[bool]     # which of them had no gradient
    has_grad: list[bool]    # the complement (for compress)
    out: list               # the validated (gi, i, p, group) list, returned again
    shapes: list            # the shapes of the gradients (= of their parameters)
    dtypes: list            # the gradients' dtypes


_VERSIONS = itertools.count(1)


class TritonIO:
    """The fused kernels' inputs for one inner update, kept between steps
    (:meth:`LearnedOptimizer._fast_triton_io`): every parameter and gradient float32 and
    contiguous, no coupled decay, so the kernels read the gradients and update the
    parameters and the state in place. Rebuilt in part when something changed; ``version``
    (unique over all instances) changes then, so that tables keyed on it are rebuilt too.

    ``ptrs`` holds one list of ``data_ptr()`` per column: ``"p"``, ``"g"`` and each state
    variable; only ``"g"`` is replaced while the instance lives (``build`` identifies the
    rest). Item access (``io["params"]``, ...) gives the lists of :meth:`_triton_io`.
    """

    __slots__ = ("items", "params", "grads", "states", "shapes", "gidx", "groups_key", "ptrs",
                 "lrs", "lrwds", "version", "state_obj", "state_vals", "flat", "build",
                 "steady")

    def __init__(self, params: list[Tensor]) -> None:
        self.items: list | None = None
        self.state_obj: Any = None
        self.state_vals: list = []
        self.flat: list[Tensor] = []  # every state dict's values, in order
        self.params = params
        self.grads: list[Tensor] = []
        self.states: list[dict[str, Any]] = []
        self.shapes: list[torch.Size] = []
        self.gidx: list[int] = []
        self.groups_key: list = []
        self.ptrs: dict[str, list[int]] = {}
        self.lrs: list[float] = []
        self.lrwds: list[float] = []
        self.version = next(_VERSIONS)
        #: unique per instance, never changes: the tensor lists (params, states, their
        #: pointers but the gradients') are those of this build while it is the same
        self.build = next(_VERSIONS)
        #: every parameter of every group is in ``params`` (each had a gradient), so that a
        #: step may reuse this without :meth:`LearnedOptimizer._gather`
        self.steady = False

    def states_unchanged(self, state: Any) -> bool:
        """Whether ``state`` (the optimizer's) still holds the per-parameter dicts and state
        tensors seen when this was built (identity, C-level loops; each dict's values in
        order)."""
        return (state is self.state_obj and len(state) == len(self.state_vals)
                and all(map(operator.is_, state.values(), self.state_vals))
                and all(map(operator.is_, chain.from_iterable(map(dict.values, self.states)),
                            self.flat)))

    def __getitem__(self, key: str) -> Any:
        n = len(self.params)
        return {"params": self.params, "grads": self.grads, "states": self.states,
                "outs": self.params, "write_step": [False] * n, "lrs": self.lrs,
                "lrwds": self.lrwds, "post": []}[key]


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


class LearnedOptimizer(torch.optim.Optimizer):
    """Base class of xopt's learned optimizers (see the module docstring for the hooks).

    Args:
      params: parameters or parameter groups; groups may set ``lr`` and ``weight_decay``.
      meta_params: the learned optimizer's weights, a mapping of arrays (NumPy, torch, ...)
        in xopt's or the original's naming; None draws ``meta_init(hp, seed)``.
      spec: the method's hyperparameter dataclass instead of keywords.
      seed: seed of the fresh meta-parameters when ``meta_params`` is None.
      check_finite: raise :class:`NonFiniteError` (naming the parameter) before anything
        moves when a gradient or the loss holds NaN or inf (synchronises the device).
      **hyperparameters: fields of ``hyperparams_cls`` (a value None means "not given").
    """

    hyperparams_cls: ClassVar[type[LOptOptions]]
    meta_spec: ClassVar[MetaParams]
    needs_loss: ClassVar[bool] = False
    #: the state variables the Triton step reads and writes in place (None: no fast path;
    #: a subclass that sets it implements :meth:`_triton_fast_update`)
    _triton_state_vars: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]],
                 meta_params: Mapping[str, Any] | None = None, *, spec: LOptOptions | None = None,
                 seed: int = 0, check_finite: bool = False, **hyperparameters: Any) -> None:
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
        self.check_finite = bool(check_finite)
        where = f"{cls_name} meta_params"
        if meta_params is None:
            theta = self.meta_spec.init(hp, seed)
        else:
            theta = self.meta_spec.coerce(meta_params, hp)
        self.meta = _meta_to_torch(theta, where)
        self._meta_cache: dict[torch.device, dict[str, Tensor]] = {}
        self._fio: TritonIO | None = None
        self._gcache: _GatherCache | None = None
        super().__init__(params, {"lr": hp.lr, "weight_decay": hp.weight_decay})
        first = next(iter(self._all_params()), None)
        self._device = first.device if first is not None else torch.device("cpu")
        self.state["global"] = self._new_global_state()

    # -- implementation switch (plain or Triton) -------------------------------------------
    def _set_impl(self, impl: str | None, precision: str) -> None:
        """Validate and keep ``impl`` ("plain", "triton", or None: Triton on CUDA when it is
        importable and supports these hyperparameters, plain otherwise) and ``precision``
        ("exact" or "fast", the Triton path's MLP matmuls)."""
        name = type(self).__name__
        if impl not in (None, "auto", "plain", "triton"):
            raise HyperparameterError(f"{name}: impl must be 'plain', 'triton' or None (auto), "
                                      f"got {impl!r}")
        if precision not in ("exact", "fast"):
            raise HyperparameterError(f"{name}: precision must be 'exact' or 'fast', got "
                                      f"{precision!r}")
        self.impl = "auto" if impl is None else impl
        self.precision = precision
        self._triton = None
        if self.impl == "triton":
            why = self._triton_unavailable(list(self._all_params()))
            if why is not None:
                raise HyperparameterError(f"{name}(impl='triton'): {why}")

    def _triton_unsupported(self) -> str | None:
        """Why the method's Triton step cannot run these hyperparameters (None: it can)."""
        return None

    def _triton_unavailable(self, params: list[Tensor]) -> str | None:
        from xopt.kernels import interpreting, triton_available

        if not triton_available():
            return "triton is not importable (pip install 'xopt-ml[triton]'; Linux)"
        why = self._triton_unsupported()
        if why is not None:
            return why
        devices = {p.device for p in params}
        if len(devices) > 1:
            return f"all parameters must be on one device, got {sorted(map(str, devices))}"
        for d in devices:
            if d.type != "cuda" and not (d.type == "cpu" and interpreting()):
                return (f"parameters are on {d}; the Triton kernels run on CUDA devices (or on "
                        "the CPU under Triton's interpreter, TRITON_INTERPRET=1, set before "
                        "triton is imported)")
        return None

    def _use_triton(self, entries: list[Entry]) -> bool:
        """Whether this inner update takes the Triton path (raises for impl='triton' when it
        cannot)."""
        return self._use_triton_params([e.param for e in entries])

    def _use_triton_params(self, params: list[Tensor]) -> bool:
        """:meth:`_use_triton` for the parameters to update."""
        if self.impl == "plain" or not params:
            return False
        if self.impl == "auto":
            if any(p.device.type != "cuda" for p in params):
                return False
            return self._triton_unavailable(params) is None
        why = self._triton_unavailable(params)
        if why is not None:
            raise HyperparameterError(f"{type(self).__name__}(impl='triton'): {why}")
        return True

    def _triton_io(self, entries: list[Entry], state_vars: tuple[str, ...]) -> dict[str, list]:
        """What the fused kernels need per entry: float32 contiguous parameter, gradient,
        state (made contiguous in place), the output (the parameter itself, updated in place,
        when it is float32 and contiguous; else a float32 buffer that receives the step,
        applied afterwards by :meth:`_apply_step`), lr and lr·λ (decoupled decay)."""
        out: dict[str, list] = {k: [] for k in ("params", "grads", "states", "outs",
                                                "write_step", "lrs", "lrwds", "post")}
        decoupled = self.hp.weight_decay_mode == "decoupled"
        for e in entries:
            p = e.param
            st = e.state
            for v in state_vars:
                if not st[v].is_contiguous():
                    st[v] = st[v].contiguous()
            direct = p.dtype == torch.float32 and p.is_contiguous()
            pin = p.detach() if direct else e.p32.contiguous()
            g = e.grad
            if not g.is_contiguous():
                g = g.contiguous()
            lr, wd = e.group["lr"], e.group["weight_decay"]
            out["params"].append(pin)
            out["grads"].append(g)
            out["states"].append(st)
            if direct:
                out["outs"].append(pin)
                out["write_step"].append(False)
                out["lrs"].append(float(lr))
                out["lrwds"].append(float(lr * wd) if decoupled and not _is_zero(wd) else 0.0)
            else:
                buf = torch.empty_like(pin)
                out["outs"].append(buf)
                out["write_step"].append(True)
                out["lrs"].append(1.0)
                out["lrwds"].append(0.0)
                out["post"].append((e, buf))
        return out

    def _fast_triton_io(self, items: list[tuple[int, int, Tensor, dict[str, Any]]],
                        same: bool | None = None) -> TritonIO | None:
        """The Triton step's inputs for ``items`` (from :meth:`_gather`), kept between steps:
        None when the update does not take the Triton path or needs the general one
        (:meth:`_triton_io`: a parameter or gradient that is not float32 and contiguous, an
        lr or weight decay that is not a Python number). A steady-state step checks, in
        C-level passes over the tensors (no Python call per tensor), that the parameters,
        their state dicts and state tensors are the same objects as in the last step
        (identity), the parameters' pointers and the gradients' pointers and contiguity;
        what changed is re-validated and ``version`` changes."""
        svars = self._triton_state_vars
        if svars is None or self.impl == "plain" or not items:
            return None
        c = self._fio
        groups_key = [(g["lr"], g["weight_decay"]) for g in self.param_groups]
        for lr, wd in groups_key:
            if type(lr) not in (float, int) or type(wd) not in (float, int):
                return None
        if same is None:
            same = c is not None and c.items is items and c.states_unchanged(self.state)
        if same:
            ps = c.params
            grads = list(map(_GRAD, ps))  # (not kept after the step: they may be freed)
            if not all(map(_CONTIG, grads)):
                return None
            pp = list(map(_DPTR, ps))
            gp = list(map(_DPTR, grads))
            if pp == c.ptrs["p"]:
                if gp != c.ptrs["g"]:
                    c.ptrs["g"] = gp
                    c.version = next(_VERSIONS)
                if groups_key != c.groups_key:  # (an lr schedule: every step)
                    c.lrs, c.lrwds = self._lrs(groups_key, c.gidx)
                    c.groups_key = groups_key
                    c.version = next(_VERSIONS)
                c.grads = grads
                return c
        return self._build_triton_io(items, groups_key)

    def _steady_io(self) -> tuple[TritonIO, list[Tensor]] | None:
        """``(io, gradients)``: the kept :class:`TritonIO` for a step that needs nothing else
        rebuilt or re-validated (neither :meth:`_gather` nor :meth:`_fast_triton_io`), in
        C-level passes over the tensors: the same groups, parameter lists and parameters
        (identity, as :meth:`_gather` checks them), every parameter with a dense contiguous
        gradient of its cached shape, the parameters at their cached addresses, and the
        same state dicts and state tensors (:meth:`TritonIO.states_unchanged`). New gradient
        tensors (their pointers) and new lrs / weight decays (a schedule) update the
        instance and its ``version``; anything else: None (the general path, with all its
        checks and errors). The gradients' dtypes need no check: torch's ``.grad`` setter
        keeps them the parameter's, and a parameter's dtype changes only with new data
        (another address). Not re-checked: the parameters' shapes (a new shape comes with
        new data, except through in-place metadata ops such as ``p.unsqueeze_()``)."""
        c = self._fio
        g = self._gcache
        if (c is None or not c.steady or g is None or g.out is not c.items
                or self.impl == "plain" or self.hp.accumulating):
            return None
        groups = self.param_groups
        if not (len(groups) == len(g.groups) and all(map(operator.is_, groups, g.groups))
                and all(map(operator.is_, map(operator.itemgetter("params"), groups),
                            g.param_lists))
                and list(map(len, g.param_lists)) == g.lengths
                and all(map(operator.is_, chain.from_iterable(g.param_lists), c.params))
                and c.states_unchanged(self.state)):
            return None
        ps = c.params
        grads = list(map(_GRAD, ps))
        try:
            gp = list(map(_DPTR, grads))  # (None: TypeError; sparse: RuntimeError)
            if not all(map(_CONTIG, grads)):
                return None
        except (TypeError, RuntimeError):
            return None
        if list(map(_SHAPE, grads)) != c.shapes or list(map(_DPTR, ps)) != c.ptrs["p"]:
            return None
        groups_key = [(gr["lr"], gr["weight_decay"]) for gr in groups]
        if groups_key != c.groups_key:  # (an lr schedule: every step)
            coupled = self.hp.weight_decay_mode == "coupled"
            for lr, wd in groups_key:
                if (type(lr) not in (float, int) or type(wd) not in (float, int)
                        or (coupled and not _is_zero(wd))):
                    return None
            c.lrs, c.lrwds = self._lrs(groups_key, c.gidx)
            c.groups_key = groups_key
            c.version = next(_VERSIONS)
        if gp != c.ptrs["g"]:
            c.ptrs["g"] = gp
            c.version = next(_VERSIONS)
        return c, grads

    def _build_triton_io(self, items: list[tuple[int, int, Tensor, dict[str, Any]]],
                         groups_key: list) -> TritonIO | None:
        """:meth:`_fast_triton_io` when something changed: every check, new tables."""
        svars = self._triton_state_vars
        self._fio = None
        ps = [it[2] for it in items]
        if not self._use_triton_params(ps):
            return None
        f32 = torch.float32
        grads = [p.grad for p in ps]
        if not all([g.dtype == f32 and g.is_contiguous() for g in grads]):
            return None
        if not all([p.dtype == f32 and p.is_contiguous() for p in ps]):
            return None
        st = self.state
        states = [st[p] for p in ps]
        try:
            for v in svars:
                for s in states:
                    if not s[v].is_contiguous():
                        s[v] = s[v].contiguous()
            ptrs = {"p": [p.data_ptr() for p in ps], "g": [g.data_ptr() for g in grads]}
            for v in svars:
                ptrs[v] = [s[v].data_ptr() for s in states]
        except KeyError:
            return None
        c = TritonIO(ps)
        gidx = [it[0] for it in items]
        c.lrs, c.lrwds = self._lrs(groups_key, gidx)
        c.items, c.states, c.shapes, c.gidx, c.groups_key, c.ptrs = items, states, \
            [p.shape for p in ps], gidx, groups_key, ptrs
        c.state_obj, c.state_vals = st, list(st.values())
        c.flat = list(chain.from_iterable(map(dict.values, states)))
        c.grads = grads
        g = self._gcache
        c.steady = (g is not None and g.out is items and not any(g.no_grad)
                    and not self.hp.accumulating)
        self._fio = c
        return c

    def _lrs(self, groups_key: list, gidx: list[int]) -> tuple[list[float], list[float]]:
        """Per tensor: lr and lr·λ (decoupled decay; else 0), from ``(lr, λ)`` per group."""
        decoupled = self.hp.weight_decay_mode == "decoupled"
        per_group = [(float(lr), float(lr * wd) if decoupled and not _is_zero(wd) else 0.0)
                     for lr, wd in groups_key]
        return [per_group[gi][0] for gi in gidx], [per_group[gi][1] for gi in gidx]

    def _triton_fast_update(self, io: TritonIO, loss: Tensor, gstate: dict[str, Any]) -> None:
        """The inner update on the Triton path from :meth:`_fast_triton_io`'s inputs (the
        subclass's, when it sets ``_triton_state_vars``); as :meth:`_inner_update` otherwise
        (the base advances ``iteration`` afterwards)."""
        raise NotImplementedError

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

    # torch.optim.Optimizer pickles (and deep-copies) only defaults, state and param_groups
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(hp=self.hp, meta=self.meta, check_finite=self.check_finite,
                     _device=self._device, impl=getattr(self, "impl", "auto"),
                     precision=getattr(self, "precision", "exact"))
        return state

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

    def _param_name(self, group: dict[str, Any], i: int, gi: int) -> str:
        names = group.get("param_names")
        return names[i] if names else f"param_groups[{gi}]['params'][{i}]"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._gcache = None
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[-1]
        try:
            try:
                self.hp.replace(lr=group["lr"], weight_decay=group["weight_decay"])
            except HyperparameterError as e:
                raise HyperparameterError(f"{type(self).__name__} param_groups[{gi}]: {e}") \
                    from None
            for i, p in enumerate(group["params"]):
                if p.dtype not in SUPPORTED_DTYPES:
                    raise HyperparameterError(
                        f"{type(self).__name__}: parameter {self._param_name(group, i, gi)} "
                        f"(shape {tuple(p.shape)}) has dtype {p.dtype}; supported: "
                        f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
        except HyperparameterError:
            self.param_groups.pop()
            raise

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
        return st

    def _gather(self) -> list[tuple[int, int, Tensor, dict[str, Any]]]:
        """Parameters with a gradient, validated (nothing has changed yet). The list is kept
        and returned again (the same object) while the parameters, which of them have a
        gradient, and the gradients' shapes, dtypes and layouts are those of the last call:
        checked in C-level passes, without a Python call per tensor."""
        c = self._gcache
        groups = self.param_groups
        if (c is not None and len(groups) == len(c.groups)
                and all(map(operator.is_, groups, c.groups))
                and all(map(operator.is_, map(operator.itemgetter("params"), groups),
                            c.param_lists))
                and list(map(len, c.param_lists)) == c.lengths
                and all(map(operator.is_, chain.from_iterable(c.param_lists), c.params))):
            grads = list(map(_GRAD, c.params))
            if list(map(operator.is_, grads, repeat(None))) == c.no_grad:
                gg = list(compress(grads, c.has_grad))
                if (list(map(_SHAPE, gg)) == c.shapes and list(map(_DTYPE, gg)) == c.dtypes
                        and all(map(operator.is_, map(_LAYOUT, gg), repeat(torch.strided)))
                        and list(map(_SHAPE, map(operator.itemgetter(2), c.out))) == c.shapes):
                    return c.out
        out = []
        for gi, group in enumerate(groups):
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse or g.shape != p.shape or g.dtype not in _SUPPORTED:
                    self._bad_grad(gi, i, p, group)
                out.append((gi, i, p, group))
        ps = [p for group in groups for p in group["params"]]
        none = [p.grad is None for p in ps]
        self._gcache = _GatherCache(
            groups=list(groups), param_lists=[g["params"] for g in groups],
            lengths=[len(g["params"]) for g in groups], params=ps, no_grad=none,
            has_grad=[not x for x in none], out=out, shapes=[it[2].shape for it in out],
            dtypes=[p.grad.dtype for p in ps if p.grad is not None])
        return out

    def _bad_grad(self, gi: int, i: int, p: Tensor, group: dict[str, Any]) -> None:
        """Raise the error that names parameter ``i`` of group ``gi`` and what is wrong with
        its gradient (the message is built only here, off the fast path)."""
        g = p.grad
        where = f"{type(self).__name__}: gradient of {self._param_name(group, i, gi)}"
        if g.is_sparse:
            raise RuntimeError(f"{where}: sparse gradients are not supported")
        if tuple(g.shape) != tuple(p.shape):
            raise ValueError(f"{where} has shape {tuple(g.shape)}, expected {tuple(p.shape)}")
        if g.dtype not in _SUPPORTED:
            raise ValueError(f"{where} has dtype {g.dtype}; supported: "
                             f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")

    def _loss_tensor(self, loss: Any) -> Tensor:
        name = type(self).__name__
        if loss is None:
            if self.needs_loss:
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

    def _check_finite(self, items: list, loss: Tensor | None) -> None:
        if not items and loss is None:
            return
        flags = [torch.isfinite(p.grad).all() for _, _, p, _ in items]
        if loss is not None:
            flags.append(torch.isfinite(loss).all().to(flags[0].device if flags else loss.device))
        finite = torch.stack([f.to(flags[0].device) for f in flags])
        if bool(finite.all()):
            return
        k = int((~finite).nonzero()[0, 0])
        if k == len(items):
            raise NonFiniteError(f"{type(self).__name__}: the loss is {float(loss)}; no "
                                 "parameter was updated")
        gi, i, p, group = items[k]
        raise NonFiniteError(
            f"{type(self).__name__}: gradient of {self._param_name(group, i, gi)} "
            f"(shape {tuple(p.shape)}) holds NaN or inf; no parameter was updated")

    # -- the step ---------------------------------------------------------------------------
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
        result = loss
        steady = self._steady_io()
        items = self._gather() if steady is None else steady[0].items
        loss_t = self._loss_tensor(loss)
        if self.check_finite:
            self._check_finite(items, None if loss is None else loss_t)
        if steady is not None:  # nothing but the gradient tensors or the lrs changed
            io, io.grads = steady
            try:
                self._triton_fast_update(io, loss_t, self.state["global"])
            finally:
                io.grads = []
            self.state["global"]["iteration"] += 1
            return result
        if not items:
            return result
        # -- from here on the state changes --
        c = self._fio
        same = c is not None and c.items is items and c.states_unchanged(self.state)
        if not same:
            for _, _, p, _ in items:
                if len(self.state[p]) == 0:
                    self.state[p] = self._new_param_state(p)
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
                return result
            entries = [Entry(p, self.state[p], group, self._param_name(group, i, gi), (gi, i),
                             decayed_grad(p, group)) for gi, i, p, group in items]
            self._inner_update(entries, loss_t, gstate)
            gstate["iteration"] += 1
            return result

        n = hp.num_average
        for _, _, p, group in items:
            self.state[p]["grad_accum"].add_(decayed_grad(p, group)())
        gstate["loss_accum"] = gstate["loss_accum"] + loss_t.to(gstate["loss_accum"].device)
        gstate["accum_iteration"] += 1
        if int(gstate["accum_iteration"]) % n != 0:
            for _, _, p, group in items:
                self._decay_only(p, group)
            return result
        inv = 1.0 / n  # as XLA evaluates the original's division by the constant n
        entries = []
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                st = self.state.get(p)
                if st and "grad_accum" in st:
                    acc = st["grad_accum"]
                    entries.append(Entry(p, st, group, self._param_name(group, i, gi), (gi, i),
                                         lambda acc=acc: acc * inv))
        self._inner_update(entries, gstate["loss_accum"] * inv, gstate)
        gstate["iteration"] += 1
        for e in entries:
            e.state["grad_accum"].zero_()
        gstate["loss_accum"] = torch.zeros_like(gstate["loss_accum"])
        return result

    # -- state dicts --------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but the state keeps its saved dtypes (torch casts floating state to
        the parameter's dtype, which would round the float32 state of bfloat16 parameters)
        and is validated first (a missing, extra or misshaped entry is a
        :class:`StateError` naming it; the optimizer is then left unchanged)."""
        name = type(self).__name__
        saved_state = state_dict.get("state", {})
        id_map = saved_param_map(self, state_dict)
        glob = saved_state.get("global")
        if not isinstance(glob, Mapping):
            raise StateError(f"{name}.load_state_dict: missing state['global'] (the global "
                             "state of a learned optimizer)")
        _check_keys(self._new_global_state(), glob, f"{name}.load_state_dict: state['global']")
        for k, v in saved_state.items():
            if k == "global":
                continue
            if k not in id_map:
                raise StateError(f"{name}.load_state_dict: state for unknown parameter id {k!r}")
            _check_keys(self._new_param_state(id_map[k].detach()), v,
                        f"{name}.load_state_dict: state of parameter {k}")
        super().load_state_dict(state_dict)
        for k, v in saved_state.items():
            if k == "global":
                self.state["global"] = {
                    kk: vv.detach().clone().to(self._device if kk == "loss_accum" else "cpu")
                    for kk, vv in v.items()}
            else:
                p = id_map[k]
                self.state[p] = {kk: vv.detach().clone().to(p.device) for kk, vv in v.items()}


def _check_keys(expected: Mapping[str, Tensor], got: Mapping[str, Any], where: str) -> None:
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing:
        raise StateError(f"{where}: missing {', '.join(missing)}")
    if extra:
        raise StateError(f"{where}: unexpected {', '.join(extra)}")
    for k, ref in expected.items():
        v = got[k]
        if not isinstance(v, Tensor):
            raise StateError(f"{where}: {k!r} is a {type(v).__name__}, expected a tensor")
        if tuple(v.shape) != tuple(ref.shape) or v.dtype != ref.dtype:
            raise StateError(f"{where}: {k!r} has shape {tuple(v.shape)} and dtype {v.dtype}, "
                             f"expected {tuple(ref.shape)} and {ref.dtype}")


def _f32(x: Tensor) -> Tensor:
    x = x.detach()
    return x if x.dtype == torch.float32 else x.float()


def _is_zero(x: Any) -> bool:
    return isinstance(x, (int, float)) and x == 0


def _is_one(x: Any) -> bool:
    return isinstance(x, (int, float)) and x == 1
