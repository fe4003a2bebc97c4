"""State schemas: the named state arrays of a method and how each implementation names them.

A method's state is a set of :class:`StateVar` s, each either per parameter (``scope="param"``,
one array for every optimised tensor, such as Adam's first moment) or global
(``scope="global"``, one array for the whole optimizer, such as optax's ``count``).

*Canonical keys* are how xopt and the parity harness refer to state: ``"<var>/<param>"``
for per-parameter variables (``"m/mlp/0/weight"``) and ``"<var>"`` for global ones
(``"step"``).

A :class:`Naming` says how one implementation lays the same state out as a flat mapping of
keys (pytree paths joined by ``/``): a template per variable in which ``{param}`` stands for
the parameter name, and the dtype that implementation stores. A schema carries the namings
of xopt's own backends (``StateSchema.namings``, by key); an original's naming is a
:class:`Naming` the harness holds (:mod:`xopt.parity.methods`), and the conversions take
either a key or a :class:`Naming`. A global variable whose
template contains ``{param}`` is stored once per parameter (torch.optim keeps a ``step``
per tensor); reading it back checks that all copies agree.

``hp`` may be a :class:`~xopt.specs._groups.ParamGroups`: each parameter's variables then
follow its own group's hyperparameters, and a per-parameter variable may exist for some
parameters only (``StateVar.applies``: GaLore's projector exists for projected matrices,
not for biases).

Everything here works on NumPy arrays; backends convert at their edges.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from xopt.errors import StateError
from xopt.specs._groups import all_hps, hp_for

ShapeRule = Callable[[tuple[int, ...], Any], tuple[int, ...]]


def same_as_param(param_shape: tuple[int, ...], hp: Any) -> tuple[int, ...]:
    return tuple(param_shape)


def scalar(param_shape: tuple[int, ...], hp: Any) -> tuple[int, ...]:
    return ()


@dataclasses.dataclass(frozen=True)
class StateVar:
    """One named state array.

    Attributes:
      name: canonical name (``"m"``).
      scope: ``"param"`` (one per optimised tensor) or ``"global"``.
      shape: rule mapping (parameter shape, hyperparameters) to the array's shape.
      dtype: ``"float32"``, ``"int32"``, ... or ``"state"``: the backend's state dtype for
        that parameter (both backends: float32 for float32/bfloat16/float16 parameters,
        except xopt.jax's AdamW, which keeps the parameter's dtype as optax.adamw does; the
        oracle: float64).
      doc: what it holds, with the paper's symbol.
      active: predicate on the hyperparameters; the variable exists only when it is true
        (AMSGrad's running maximum exists only with ``amsgrad=True``).
    """

    name: str
    scope: Literal["param", "global"]
    shape: ShapeRule
    dtype: str
    doc: str
    active: Callable[[Any], bool] = lambda hp: True
    #: per-parameter variables only: ``(parameter shape, that parameter's hp) -> bool``;
    #: None means every parameter has one. A conditional variable missing from a flat
    #: mapping is read as absent (the schema's shape check names it if it should be there).
    applies: Callable[[tuple[int, ...], Any], bool] | None = None

    def exists_for(self, shape: tuple[int, ...], hp: Any) -> bool:
        if not self.active(hp):
            return False
        return self.applies is None or bool(self.applies(tuple(shape), hp))


@dataclasses.dataclass(frozen=True)
class Naming:
    """How one implementation names the state: ``var -> key template`` and stored dtypes."""

    keys: Mapping[str, str]
    dtypes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    doc: str = ""
    #: per-parameter variables this implementation stores as one array whose rows follow
    #: the parameter order (learned_optimization's stacked LSTM state); their template has
    #: no ``{param}``
    stacked: frozenset[str] = frozenset()
    #: variables this implementation stores in another form than the canonical array:
    #: ``var -> (encode, decode)``, NumPy canonical value -> stored value and back (xopt.jax
    #: keeps Flora's int64 seeds as uint32 ``[hi, lo]`` pairs, needing no jax_enable_x64)
    codecs: Mapping[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = \
        dataclasses.field(default_factory=dict)

    def decode(self, var: str, value: Any) -> np.ndarray:
        codec = self.codecs.get(var)
        return np.asarray(value) if codec is None else np.asarray(codec[1](np.asarray(value)))

    def encode(self, var: str, value: Any) -> np.ndarray:
        codec = self.codecs.get(var)
        return np.asarray(value) if codec is None else np.asarray(codec[0](np.asarray(value)))


@dataclasses.dataclass(frozen=True)
class StateSchema:
    vars: tuple[StateVar, ...]
    namings: Mapping[str, Naming]

    def active(self, hp: Any) -> tuple[StateVar, ...]:
        """Variables active under ``hp`` (under any group's hyperparameters for groups)."""
        hps = all_hps(hp)
        return tuple(v for v in self.vars if any(v.active(h) for h in hps))

    def var(self, name: str) -> StateVar:
        for v in self.vars:
            if v.name == name:
                return v
        raise StateError(f"no state variable {name!r}; known: {[v.name for v in self.vars]}")

    def naming(self, naming: str | Naming) -> Naming:
        """The :class:`Naming` of key ``naming`` (a :class:`Naming` is returned as it is)."""
        if isinstance(naming, Naming):
            return naming
        try:
            return self.namings[naming]
        except KeyError:
            raise StateError(
                f"no state naming {naming!r}; known: {', '.join(self.namings)}"
            ) from None

    # -- canonical layout ----------------------------------------------------------------
    def canonical_keys(self, params: Mapping[str, tuple[int, ...]], hp: Any) -> dict[str, tuple]:
        """``{canonical key: shape}`` for the given ``{param name: shape}``."""
        out: dict[str, tuple] = {}
        for v in self.active(hp):
            if v.scope == "param":
                for p, shape in params.items():
                    hpp = hp_for(hp, p)
                    if v.exists_for(shape, hpp):
                        out[f"{v.name}/{p}"] = v.shape(tuple(shape), hpp)
            else:
                out[v.name] = v.shape((), all_hps(hp)[0])
        return out

    def check_canonical(
        self, state: Mapping[str, Any], params: Mapping[str, tuple[int, ...]], hp: Any, where: str
    ) -> None:
        """Raise :class:`StateError` naming the key on a missing, extra or misshaped array."""
        expected = self.canonical_keys(params, hp)
        missing = sorted(set(expected) - set(state))
        extra = sorted(set(state) - set(expected))
        if missing:
            raise StateError(f"{where}: missing state {', '.join(missing)}")
        if extra:
            raise StateError(f"{where}: unexpected state {', '.join(extra)}")
        for k, shape in expected.items():
            got = tuple(np.shape(state[k]))
            if got != tuple(shape):
                raise StateError(f"{where}: state {k!r} has shape {got}, expected {tuple(shape)}")

    # -- conversion to and from an implementation's naming -----------------------------
    def to_canonical(
        self, naming: str | Naming, flat: Mapping[str, Any], param_names: Sequence[str],
        hp: Any, *, where: str = "state", strict: bool = True,
    ) -> dict[str, np.ndarray]:
        """Read a flat mapping in ``naming``'s keys into canonical keys (NumPy arrays).

        With ``strict`` (the default) a key of the flat mapping that no variable claims is
        an error naming it.
        """
        nm = self.naming(naming)
        out: dict[str, np.ndarray] = {}
        used: set[str] = set()
        for v in self.active(hp):
            template = nm.keys.get(v.name)
            if template is None:
                raise StateError(f"naming {_label(naming)!r} has no key for state variable "
                                 f"{v.name!r}")
            if v.scope == "param" and v.name in nm.stacked:
                if template not in flat:
                    raise StateError(f"{where}: missing {template!r} (state {v.name!r})")
                rows = np.asarray(flat[template])
                if rows.ndim < 1 or rows.shape[0] != len(param_names):
                    raise StateError(
                        f"{where}: {template!r} has shape {rows.shape}; expected one row per "
                        f"parameter ({len(param_names)} rows)")
                for i, p in enumerate(param_names):
                    out[f"{v.name}/{p}"] = rows[i]
                used.add(template)
            elif v.scope == "param":
                for p in param_names:
                    key = template.format(param=p)
                    if key not in flat and (v.applies is not None or not v.active(hp_for(hp, p))):
                        continue  # absent for this parameter; check_canonical judges
                    if key not in flat:
                        raise StateError(f"{where}: missing {key!r} (state {v.name!r} of {p!r})")
                    out[f"{v.name}/{p}"] = nm.decode(v.name, flat[key])
                    used.add(key)
            elif "{param}" in template:
                values = []
                for p in param_names:
                    key = template.format(param=p)
                    if key not in flat:
                        raise StateError(f"{where}: missing {key!r} (state {v.name!r} of {p!r})")
                    values.append(nm.decode(v.name, flat[key]))
                    used.add(key)
                for p, val in zip(param_names, values, strict=True):
                    if not np.array_equal(val, values[0]):
                        raise StateError(
                            f"{where}: {template.format(param=p)!r} = {val} differs from "
                            f"{template.format(param=param_names[0])!r} = {values[0]}; "
                            f"state {v.name!r} is global and must agree across parameters"
                        )
                out[v.name] = values[0]
            else:
                if template not in flat:
                    raise StateError(f"{where}: missing {template!r} (state {v.name!r})")
                out[v.name] = nm.decode(v.name, flat[template])
                used.add(template)
        if strict:
            extra = sorted(set(flat) - used)
            if extra:
                raise StateError(f"{where}: unexpected state key(s) {', '.join(extra)}")
        return out

    def from_canonical(
        self, naming: str | Naming, state: Mapping[str, Any], param_names: Sequence[str],
        hp: Any,
    ) -> dict[str, np.ndarray]:
        """Write canonical state into ``naming``'s flat keys, cast to its stored dtypes."""
        nm = self.naming(naming)
        out: dict[str, np.ndarray] = {}
        for v in self.active(hp):
            template = nm.keys[v.name]
            dtype = nm.dtypes.get(v.name)
            if v.scope == "param" and v.name in nm.stacked:
                arr = np.stack([np.asarray(state[f"{v.name}/{p}"]) for p in param_names])
                out[template] = arr.astype(dtype) if dtype else arr
            elif v.scope == "param":
                for p in param_names:
                    if f"{v.name}/{p}" not in state and (
                            v.applies is not None or not v.active(hp_for(hp, p))):
                        continue
                    arr = nm.encode(v.name, state[f"{v.name}/{p}"])
                    out[template.format(param=p)] = arr.astype(dtype) if dtype else arr
            else:
                arr = nm.encode(v.name, state[v.name])
                arr = arr.astype(dtype) if dtype else arr
                if "{param}" in template:
                    for p in param_names:
                        out[template.format(param=p)] = arr
                else:
                    out[template] = arr
        return out


def _label(naming: str | Naming) -> str:
    return naming.doc or "naming" if isinstance(naming, Naming) else naming
