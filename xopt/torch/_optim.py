"""What every xopt torch optimizer does around its update: the contract tests/contract/ checks.

:class:`Optimizer` is the base of every ``torch.optim.Optimizer`` in :mod:`xopt.torch`. It
adds to torch's base class, the same way for every method:

* **Parameters**: real floating dtypes only (float32, float64, bfloat16, float16), dense. An
  integer, complex or sparse parameter, or a group whose hyperparameters do not validate,
  is refused by ``add_param_group`` (and so by the constructor) with a
  :class:`~xopt.errors.HyperparameterError` naming it; the group is then not added.
* **Steps are all-or-nothing**: :meth:`Optimizer._step_items` validates every gradient
  (sparse, complex, dtype, shape: :class:`~xopt.errors.GradientError` naming the parameter)
  and every group's hyperparameters before the update writes anything; methods that
  decompose gradients compute every decomposition of a step before writing any parameter.
* **NaN and inf** (:mod:`xopt.nonfinite`), chosen with ``nonfinite=``: ``"ignore"`` (default),
  ``"raise"`` (one host read of a flag per step, then :class:`~xopt.errors.NonFiniteError`
  naming the tensor, nothing changed) or ``"skip"`` (see below).
* **State dicts**: ``load_state_dict`` is strict: the whole state dict is checked against
  this optimizer (groups, each group's hyperparameters, every parameter's state keys, shapes
  and dtypes) before anything is loaded; a missing, extra or misshaped entry, or another
  optimizer's state, raises :class:`~xopt.errors.StateError` naming it and changes nothing.
  Loaded state keeps its saved dtypes (torch would cast the float32 state of bfloat16
  parameters to bfloat16). State holds tensors and numbers only, so state dicts load with
  ``torch.load(..., weights_only=True)``.
* **torch.compile**: every xopt method's step reads step counters or schedules on the host
  (bias corrections, refreshes, seeds, merges, a learned optimizer's time features), so each
  subclass wraps ``step`` in ``torch.compiler.disable`` with that reason: a compiled
  training step breaks its graph once, at ``step()``, which runs eagerly, instead of
  breaking per parameter and recompiling at every step on the changing counters.

``nonfinite="skip"`` without host synchronisation: the step computes a finiteness flag on
the device, runs the update, and then keeps every written tensor on the flag's device with
``torch.where(flag, new, old)`` against a copy taken before the update (so it holds one copy
of the parameters and state it may write for the duration of the step). What lives on the
host (Python counters, CPU step tensors, which state entries exist) cannot be selected on
the device: when the flag is on an accelerator it is copied to pinned memory without
waiting, and read when the optimizer is next used (the next ``step``, ``state_dict``,
``load_state_dict``, ``add_param_group`` or a copy), when the host values of a skipped step
are put back, before anything else reads them. On the CPU the flag is read at once.
A method whose step drives host-side schedules of other objects (CompAct's layer
projections, POET's model merges) reads the flag at once (it says so), and so does a step
whose decomposition fails (at a refresh, where the check reads the device anyway): a
failure on non-finite gradients is a skip, one on finite gradients an error. Until the flag
is read, ``optimizer.state`` read directly may show a skipped step's host counters. Each
parameter that takes part in a step gets the counter ``state[p][xopt.nonfinite.SKIP_COUNTER]``
(an int32 0-d tensor on its device), incremented on the device when the step is skipped.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from xopt.errors import (
    DecompositionError,
    GradientError,
    HyperparameterError,
    NonFiniteError,
    StateError,
)
from xopt.nonfinite import SKIP_COUNTER, resolve
from xopt.torch.distributed import is_dtensor, prepare

__all__ = ["FLOATING", "Item", "Layout", "Optimizer"]

#: the parameter dtypes every xopt torch optimizer supports
FLOATING = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_FLOATING = frozenset(FLOATING)
_FLOATING_NAMES = ", ".join(str(d).removeprefix("torch.") for d in FLOATING)

#: read the skip flag lazily even on the CPU (tests exercise the accelerator path with it)
_DEFER_ON_CPU = False


class Item(NamedTuple):
    """A parameter with a gradient in the current step."""

    gi: int          # its group's index
    i: int           # its index in the group
    param: Tensor
    grad: Tensor
    group: dict


class Layout(NamedTuple):
    """One state entry a parameter has after its first update: ``kind`` is a torch dtype
    (a tensor of that dtype and ``shape``) or ``int`` (a Python int); ``device`` is
    ``"param"`` (the parameter's device) or ``"cpu"`` (a host counter)."""

    shape: tuple[int, ...]
    kind: Any
    device: str = "param"


def param_name(group: Mapping[str, Any], gi: int, i: int) -> str:
    """How messages name parameter ``i`` of group ``gi`` (its ``param_names`` entry if any)."""
    names = group.get("param_names")
    return names[i] if names else f"param_groups[{gi}]['params'][{i}]"


def check_params(where: str, group: Mapping[str, Any], gi: int) -> None:
    """Refuse a group's integer, complex or sparse parameters (naming the first)."""
    for i, p in enumerate(group["params"]):
        if p.layout != torch.strided:
            raise HyperparameterError(
                f"{where}: parameter {param_name(group, gi, i)} is {p.layout}; only dense "
                "(strided) parameters are supported")
        if p.dtype not in _FLOATING:
            raise HyperparameterError(
                f"{where}: parameter {param_name(group, gi, i)} (shape {tuple(p.shape)}) has "
                f"dtype {p.dtype}; supported: {_FLOATING_NAMES}")


def grad_problem(p: Tensor, g: Tensor) -> str | None:
    """Why gradient ``g`` cannot update ``p`` (None: it can)."""
    if g.layout != torch.strided:
        return f"is {g.layout}; sparse gradients are not supported"
    if g.dtype not in _FLOATING:
        return f"has dtype {g.dtype}; supported: {_FLOATING_NAMES}"
    if g.shape != p.shape:
        return f"has shape {tuple(g.shape)}, expected {tuple(p.shape)} (the parameter's)"
    return None


def finite_flags(tensors: Iterable[Tensor]) -> list[Tensor]:
    """Per tensor, a plain 0-d bool tensor: its elements are all finite. A DTensor's (FSDP2)
    is a reduction over its mesh that DTensor leaves pending: those are completed together,
    one collective per mesh, so that every rank sees a NaN that one rank's shard holds."""
    flags = [torch.isfinite(t).all() for t in tensors]
    by_mesh: dict[Any, list[int]] = {}
    for i, f in enumerate(flags):
        if is_dtensor(f):
            by_mesh.setdefault(f.device_mesh, []).append(i)
    for at in by_mesh.values():
        done = torch.stack([flags[i] for i in at]).full_tensor()
        for j, i in enumerate(at):
            flags[i] = done[j]
    return flags


def finite_flag(tensors: Iterable[Tensor], loss: Tensor | None = None) -> Tensor | None:
    """A 0-d bool tensor: every tensor (and the loss) is finite; computed without reading it
    on the host (on the first tensor's device). None when there is nothing to check."""
    flags = finite_flags([*tensors, *([] if loss is None else [loss])])
    if not flags:
        return None
    dev = flags[0].device
    if len(flags) == 1:
        return flags[0]
    return torch.stack([f if f.device == dev else f.to(dev) for f in flags]).all()


def _clone(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, Tensor) else copy.deepcopy(v)


def _compatible(a: Any, b: Any) -> bool:
    return (isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device)


class _Transaction:
    """The parameters and state one step under ``nonfinite="skip"`` may write, as they were
    before it (see the module docstring)."""

    def __init__(self, opt: Optimizer, params: list[Tensor], keys: list[Any]) -> None:
        self.opt = opt
        self.params = [(p, p.detach().clone()) for p in params]
        self.states: dict[Any, dict[str, Any] | None] = {}
        for k in keys:
            st = dict.get(opt.state, k)
            self.states[k] = None if st is None else {
                kk: _clone(v) for kk, v in st.items() if kk != SKIP_COUNTER}
        self.host = opt._host_snapshot()

    def select(self, flag: Tensor) -> None:
        """Keep the new values where ``flag`` is true, the old ones elsewhere, for every
        tensor on ``flag``'s device (no host read); the rest waits for :meth:`restore`."""
        dev = flag.device
        flags = {dev: flag}

        def on(d: torch.device) -> Tensor:
            if d not in flags:
                flags[d] = flag.to(d)
            return flags[d]

        host_params = []
        for p, old in self.params:
            if p.device.type != "cpu" or dev.type == "cpu":
                p.detach().copy_(torch.where(on(p.device), p.detach(), old))
            else:
                host_params.append((p, old))
        self.params = host_params  # restore() puts back only what was not selected here
        for k, before in self.states.items():
            st = dict.get(self.opt.state, k)
            if not st or before is None:
                continue
            for kk, cur in st.items():
                old = before.get(kk)
                if _compatible(cur, old) and (cur.device.type != "cpu" or dev.type == "cpu"):
                    cur.copy_(torch.where(on(cur.device), cur, old))
                    before[kk] = cur  # selected: restore() needs no copy of it any more

    def restore(self) -> None:
        """Put everything back as it was before the step (the skip counters stay)."""
        for p, old in self.params:
            p.detach().copy_(old)
        state = self.opt.state
        for k, before in self.states.items():
            st = dict.get(state, k) or {}
            counter = st.get(SKIP_COUNTER)
            new: dict[str, Any] = {}
            for kk, old in (before or {}).items():
                cur = st.get(kk)
                if cur is old:
                    new[kk] = cur
                elif _compatible(cur, old):
                    cur.copy_(old)
                    new[kk] = cur
                else:
                    new[kk] = old
            if counter is not None:
                new[SKIP_COUNTER] = counter
            if new or before is not None:
                state[k] = new
            else:
                state.pop(k, None)
        self.opt._host_restore(self.host)


class _Pending(NamedTuple):
    """A step under ``nonfinite="skip"`` whose flag has not been read on the host yet."""

    flag: Tensor                # on the host (pinned memory on CUDA)
    event: Any                  # recorded after the flag's copy (None on the CPU)
    transaction: _Transaction


class Optimizer(torch.optim.Optimizer):
    """The base of xopt's torch optimizers (see the module docstring).

    Subclasses call ``super().__init__(params, defaults, nonfinite=..., check_finite=...)``
    and implement, besides ``step``:

    ``_check_group(group, gi)``
        validate a group's hyperparameters (raise :class:`HyperparameterError` naming the
        field); called for every group added, and for every group before each step.
    ``_state_layout(p, group) -> {key: Layout}``
        the state of parameter ``p`` after its first update under ``group``'s (saved)
        hyperparameters; ``load_state_dict`` holds saved state to it. ``_fresh_layouts``
        (optional) lists the other layouts a parameter's state may have (before any update).
    ``_check_saved_group(saved, gi)``
        validate a saved param group (default: :meth:`_check_group` on it, errors as
        :class:`StateError`).
    ``_host_snapshot() / _host_restore(snapshot)`` (optional)
        host-side values outside ``self.state`` a step changes (put back when it is skipped).
    """

    #: whether ``nonfinite="skip"`` reads its flag within the step (see the module docstring)
    _skip_syncs: bool = False

    def __init__(self, params: Any, defaults: dict[str, Any], *, nonfinite: str | None = None,
                 check_finite: bool | None = None) -> None:
        self.nonfinite = resolve(nonfinite, check_finite, type(self).__name__)
        self._pending: _Pending | None = None
        super().__init__(params, defaults)

    @property
    def check_finite(self) -> bool:
        """``nonfinite == "raise"`` (the older spelling)."""
        return self.nonfinite == "raise"

    # -- groups ------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, then every parameter and the group's hyperparameters are validated; on
        an error the group is not added."""
        self._resolve_pending()
        n = len(self.param_groups)
        super().add_param_group(param_group)
        try:
            group = self.param_groups[n]
            check_params(type(self).__name__, group, n)
            self._check_group(group, n)
            self._added_group(group, n)
        except Exception:
            del self.param_groups[n:]
            raise

    def _check_group(self, group: dict[str, Any], gi: int) -> None:
        """Validate group ``gi``'s hyperparameters (raise HyperparameterError)."""

    def _added_group(self, group: dict[str, Any], gi: int) -> None:
        """Called after group ``gi`` was added and validated."""

    def param_name(self, gi: int, i: int) -> str:
        return param_name(self.param_groups[gi], gi, i)

    # -- the step ------------------------------------------------------------------------------
    def _grad_of(self, p: Tensor) -> Tensor | None:
        """The gradient the step uses for ``p`` (``p.grad``)."""
        return p.grad

    def _check_groups(self) -> None:
        """:meth:`_check_group` on every group whose values changed since it was checked
        (another object: a scheduler's new lr; a tensor lr that a schedule updates in place
        is not read again, which would synchronise the device)."""
        checked = self.__dict__.setdefault("_checked_groups", {})
        if len(checked) > 4 * len(self.param_groups) + 8:  # groups replaced (a load)
            checked.clear()
        for gi, group in enumerate(self.param_groups):
            values = [v for k, v in group.items() if k != "params"]
            last = checked.get(id(group))
            if last is None or last[0] is not group or len(last[1]) != len(values) or not all(
                    a is b for a, b in zip(last[1], values, strict=True)):
                self._check_group(group, gi)
                checked[id(group)] = (group, values)

    def _grad_problem(self, p: Tensor, g: Tensor) -> str | None:
        """Why ``g`` cannot update ``p`` (None: it can); see :func:`grad_problem`."""
        return grad_problem(p, g)

    def _step_items(self) -> list[Item]:
        """Every parameter with a gradient, after validating every gradient and every
        group's hyperparameters (nothing has changed yet; errors name what is at fault)."""
        self._resolve_pending()
        self._check_groups()
        prepare(self)  # distributed runs: every rank holds the same optimizer (else one error)
        items = []
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                g = self._grad_of(p)
                if g is None:
                    continue
                why = self._grad_problem(p, g)
                if why is not None:
                    raise GradientError(f"{type(self).__name__}: the gradient of "
                                        f"{param_name(group, gi, i)} {why}; nothing was updated")
                items.append(Item(gi, i, p, g, group))
        return items

    def _raise_if_nonfinite(self, items: list[Item], loss: Tensor | None = None) -> None:
        """``nonfinite="raise"``: one host read; NonFiniteError naming the first tensor."""
        tensors = [it.grad for it in items]
        if loss is not None:
            tensors.append(loss)
        if not tensors:
            return
        flags = finite_flags(tensors)
        dev = flags[0].device
        finite = torch.stack([f.to(dev) for f in flags])
        if bool(finite.all()):
            return
        k = int((~finite).nonzero()[0, 0])
        name = type(self).__name__
        if k == len(items):
            raise NonFiniteError(f"{name}: the loss is {float(loss)}; no parameter was updated")
        it = items[k]
        raise NonFiniteError(
            f"{name}: the gradient of {param_name(it.group, it.gi, it.i)} (shape "
            f"{tuple(it.param.shape)}) holds NaN or inf; no parameter was updated")

    def _run_step(self, items: list[Item], update: Callable[[], Any], *,
                  loss: Tensor | None = None, state_keys: Iterable[Any] = (),
                  params: list[Tensor] | None = None) -> Any:
        """Run ``update()`` (which writes the parameters and state of ``items``) under the
        NaN/inf policy. ``loss``: a learned optimizer's loss, checked with the gradients;
        ``state_keys``: entries of ``self.state`` other than the parameters that the update
        writes (a learned optimizer's ``"global"``); ``params``: the parameters it writes,
        if more than those of ``items``."""
        if self.nonfinite == "ignore":
            return update()
        if self.nonfinite == "raise":
            self._raise_if_nonfinite(items, loss)
            return update()
        flag = finite_flag([it.grad for it in items], loss)
        if flag is None:
            return update()
        if params is None:
            params = [it.param for it in items]
        tx = _Transaction(self, params, [*params, *state_keys])
        try:
            out = update()
        except DecompositionError:
            tx.restore()
            if bool(flag):  # a decomposition of finite gradients failed: a real error
                raise
            self._count_skip(params, flag)
            return None
        except BaseException:
            tx.restore()
            raise
        self._count_skip(params, flag)
        if flag.device.type == "cpu" and not _DEFER_ON_CPU or self._skip_syncs:
            if not bool(flag):
                tx.restore()
            return out
        tx.select(flag)
        if flag.device.type == "cuda":
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = flag.detach().cpu(), None
        self._pending = _Pending(host, event, tx)
        return out

    def _count_skip(self, params: list[Tensor], flag: Tensor) -> None:
        skipped = (~flag).to(torch.int32)
        on: dict[torch.device, Tensor] = {flag.device: skipped}
        for p in params:
            st = self.state[p]
            c = st.get(SKIP_COUNTER)
            if c is None:
                c = st[SKIP_COUNTER] = torch.zeros((), dtype=torch.int32, device=p.device)
            if c.device not in on:
                on[c.device] = skipped.to(c.device)
            c.add_(on[c.device])

    def _resolve_pending(self) -> None:
        """Read the flag of the last step under ``nonfinite="skip"`` if it has not been read;
        put its host values back if it was skipped."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        if pending.event is not None:
            pending.event.synchronize()
        if not bool(pending.flag):
            pending.transaction.restore()

    def _host_snapshot(self) -> Any:
        """Host-side values outside ``self.state`` that a step changes."""
        return None

    def _host_restore(self, snapshot: Any) -> None:
        """Put back what :meth:`_host_snapshot` returned (a skipped step)."""

    @staticmethod
    def _closure_loss(closure: Callable[[], Any] | None) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    # -- state dicts ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self._resolve_pending()
        return super().state_dict()

    def _state_layout(self, p: Tensor, group: Mapping[str, Any]) -> dict[str, Layout]:
        raise NotImplementedError

    def _fresh_layouts(self, p: Tensor, group: Mapping[str, Any]) -> list[dict[str, Layout]]:
        """Layouts a parameter's state may have besides :meth:`_state_layout`'s (default:
        none; a parameter without state is absent from a state dict)."""
        return []

    def _check_saved_group(self, saved: Mapping[str, Any], gi: int) -> None:
        try:
            self._check_group({**saved, "params": self.param_groups[gi]["params"]}, gi)
        except HyperparameterError as e:
            raise StateError(f"{type(self).__name__}.load_state_dict: param_groups[{gi}]: "
                             f"{e}") from None
        except KeyError as e:
            raise StateError(f"{type(self).__name__}.load_state_dict: param_groups[{gi}] "
                             f"has no {e}: not a state dict of this optimizer") from None

    def _check_extra_state(self, key: Any, value: Any) -> None:
        """A state entry that is not a parameter's (none by default)."""
        raise StateError(f"{type(self).__name__}.load_state_dict: state for unknown parameter "
                         f"id {key!r}")

    def _saved_groups(self, state_dict: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The saved groups as they will be after loading (torch keeps the saved values)."""
        return [dict(g) for g in state_dict["param_groups"]]

    def _check_state_dict(self, state_dict: Any) -> dict[Any, tuple[Tensor, dict[str, Any]]]:
        """Check a whole state dict against this optimizer; ``{saved id: (parameter, the
        group it will have)}``. Raises StateError naming the entry at fault."""
        name = type(self).__name__
        if not isinstance(state_dict, Mapping) or not isinstance(
                state_dict.get("state"), Mapping) or not isinstance(
                state_dict.get("param_groups"), list):
            raise StateError(f"{name}.load_state_dict: expected a mapping with 'state' and "
                             "'param_groups' (an optimizer's state_dict())")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise StateError(f"{name}.load_state_dict: {len(saved_groups)} param groups saved, "
                             f"{len(self.param_groups)} in this optimizer")
        groups = self._saved_groups(state_dict)
        ids: dict[Any, tuple[Tensor, dict[str, Any]]] = {}
        where_of: dict[int, str] = {}
        for gi, (sg, g, new) in enumerate(zip(saved_groups, self.param_groups, groups,
                                              strict=True)):
            if not isinstance(sg, Mapping) or "params" not in sg:
                raise StateError(f"{name}.load_state_dict: param_groups[{gi}] is not a param "
                                 "group")
            if len(sg["params"]) != len(g["params"]):
                raise StateError(f"{name}.load_state_dict: param_groups[{gi}] holds "
                                 f"{len(sg['params'])} parameters saved, {len(g['params'])} "
                                 "here")
            self._check_saved_group(new, gi)
            for i, (k, p) in enumerate(zip(sg["params"], g["params"], strict=True)):
                ids[k] = (p, new)
                where_of[k] = param_name(g, gi, i)
        for k, st in state_dict["state"].items():
            if k not in ids:
                self._check_extra_state(k, st)
                continue
            p, group = ids[k]
            where = (f"{name}.load_state_dict: state of parameter {k} ({where_of[k]}, shape "
                     f"{tuple(p.shape)})")
            if not isinstance(st, Mapping):
                raise StateError(f"{where}: a {type(st).__name__}, expected a mapping")
            check_layout(st, [self._state_layout(p, group), *self._fresh_layouts(p, group)],
                         where)
        return ids

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, after checking the whole state dict (StateError naming the entry at
        fault; then nothing has changed); the state keeps its saved dtypes."""
        self._resolve_pending()
        ids = self._check_state_dict(state_dict)
        super().load_state_dict(state_dict)
        for k, st in state_dict["state"].items():
            if k not in ids:
                continue
            p, group = ids[k]
            layout = self._state_layout(p, group)
            self.state[p] = {kk: _placed(v, p, layout.get(kk)) for kk, v in st.items()}
        self._loaded(state_dict)

    def _loaded(self, state_dict: Mapping[str, Any]) -> None:
        """Called after a successful load (non-parameter state; caches)."""

    # -- copies --------------------------------------------------------------------------------
    #: attributes not pickled or deep-copied (caches); ``__setstate__`` leaves them unset
    _transient: frozenset[str] = frozenset({"_checked_groups", "_xopt_ranks"})
    _torch_attrs = frozenset(torch.optim.SGD([torch.zeros(1, requires_grad=True)]).__dict__)

    def __getstate__(self) -> dict[str, Any]:
        self._resolve_pending()
        state = super().__getstate__()
        for k, v in self.__dict__.items():
            if k not in self._torch_attrs and k not in self._transient and k != "_pending":
                state[k] = v
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._pending = None


def check_layout(st: Mapping[str, Any], layouts: list[dict[str, Layout]], where: str) -> None:
    """Raise StateError unless ``st`` matches one of ``layouts`` (the first is named)."""
    keys = set(st) - {SKIP_COUNTER}
    for layout in layouts:
        if keys == set(layout):
            break
    else:
        layout = layouts[0]
        missing, extra = sorted(set(layout) - keys), sorted(keys - set(layout))
        if missing:
            raise StateError(f"{where}: missing {', '.join(map(repr, missing))}"
                             + (f"; unexpected {', '.join(map(repr, extra))}" if extra else "")
                             + " (a state dict of another optimizer or configuration?)")
        raise StateError(f"{where}: unexpected {', '.join(map(repr, extra))} (a state dict of "
                         "another optimizer or configuration?)")
    for k, want in layout.items():
        v = st[k]
        if want.kind is int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise StateError(f"{where}: {k!r} is a {type(v).__name__}, expected an int")
            continue
        if not isinstance(v, Tensor):
            raise StateError(f"{where}: {k!r} is a {type(v).__name__}, expected a tensor")
        if tuple(v.shape) != tuple(want.shape) or v.dtype != want.kind:
            raise StateError(f"{where}: {k!r} has shape {tuple(v.shape)} and dtype {v.dtype}, "
                             f"expected {tuple(want.shape)} and {want.kind}")
    if SKIP_COUNTER in st:
        c = st[SKIP_COUNTER]
        if not isinstance(c, Tensor) or c.shape != () or c.dtype != torch.int32:
            raise StateError(f"{where}: {SKIP_COUNTER!r} must be an int32 0-d tensor")


def _placed(v: Any, p: Tensor, layout: Layout | None) -> Any:
    """A loaded state value as the optimizer keeps it: its own copy, in the saved dtype, on
    the parameter's device (host counters on the CPU)."""
    if not isinstance(v, Tensor):
        return v
    device = "cpu" if layout is not None and layout.device == "cpu" else p.device
    return v.detach().to(device=device, copy=True)
