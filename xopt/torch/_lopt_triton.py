"""The learned optimizers' fast path: the Triton step's inputs and the caches between steps.

:class:`TritonPath` is a mixin of :class:`xopt.torch._lopt.LearnedOptimizer` that holds
everything about running a learned optimizer's update on the fused Triton kernels
(:mod:`xopt.kernels`) rather than the plain reference path, and about keeping a steady
training loop's step free of per-tensor Python work:

* ``impl=`` (set by a subclass through :meth:`TritonPath._set_impl`): ``"plain"``,
  ``"triton"`` or None/``"auto"`` (Triton on CUDA when it is importable and supports the
  hyperparameters); :meth:`TritonPath._use_triton` says which path an update takes;
* :meth:`TritonPath._triton_io`: what the kernels need per parameter (float32 contiguous
  parameter, gradient and state; the parameter itself as the output when it is float32
  and contiguous, else a buffer whose step :meth:`~xopt.torch._lopt.LearnedOptimizer._apply_step`
  applies afterwards; lr and lr·λ). The Triton step updates float32 contiguous parameters
  in place with the same ``p − (lr·step + (lr·λ)·p)`` arithmetic as ``_apply_step``;
* the fast path (a subclass sets ``_triton_state_vars`` and implements
  ``_triton_fast_update(io, loss, gstate)``): when every parameter and gradient is float32
  and contiguous, nothing is accumulated and no coupled decay changes the gradient, the step
  builds no ``Entry``: :meth:`TritonPath._fast_triton_io` keeps a :class:`TritonIO`
  (pointers, lrs, state dicts) between steps and re-checks it in C-level passes over the
  tensors (identity of the parameters, state dicts and state tensors; the parameters' and
  gradients' pointers), as :meth:`TritonPath._gather` keeps its validated list; what
  changed is rebuilt, and ``TritonIO.version`` tells the kernels' host tables when.
"""

from __future__ import annotations

import itertools
import operator
from itertools import chain, compress, repeat
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from xopt.errors import GradientError, HyperparameterError
from xopt.torch._optim import grad_problem, param_name
from xopt.torch.distributed import is_dtensor

if TYPE_CHECKING:
    from xopt.torch._lopt import Entry

__all__ = ["TritonIO", "TritonPath"]

_SUPPORTED = frozenset((torch.float32, torch.float64, torch.bfloat16, torch.float16))
# C-level getters for the per-step checks (no Python frame per tensor)
_GRAD = operator.attrgetter("grad")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")
_DPTR = torch.Tensor.data_ptr
_CONTIG = torch.Tensor.is_contiguous


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

class TritonPath:
    """The fast path of :class:`~xopt.torch._lopt.LearnedOptimizer` (see the module
    docstring). It reads the optimizer's ``hp``, ``param_groups``, ``state``, ``impl`` and
    ``precision``, and keeps ``_fio`` (the last :class:`TritonIO`) and ``_gcache`` (the last
    :meth:`_gather`)."""

    #: the state variables the Triton step reads and writes in place (None: no fast path;
    #: a subclass that sets it implements :meth:`_triton_fast_update`)
    _triton_state_vars: ClassVar[tuple[str, ...] | None] = None
    _fio: TritonIO | None
    _gcache: _GatherCache | None

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
            why = self._triton_unavailable(
                [p for group in self.param_groups for p in group["params"]])
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
        if any(is_dtensor(p) for p in params):
            return ("the parameters are DTensors (FSDP2): the fused kernels read whole "
                    "tensors, the plain path runs on the shards")
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
            self._check_groups()  # the new values, before anything changes
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
                if (g.layout != torch.strided or g.shape != p.shape
                        or g.dtype not in _SUPPORTED):
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
        why = grad_problem(p, p.grad)
        if why is not None:
            raise GradientError(f"{type(self).__name__}: the gradient of "
                                f"{param_name(group, gi, i)} {why}; nothing was updated")

def _is_zero(x: Any) -> bool:
    return isinstance(x, (int, float)) and x == 0
