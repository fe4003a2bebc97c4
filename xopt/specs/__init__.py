"""The specification layer: one framework-neutral module per method.

A method joins the registry by adding a module ``xopt/specs/<name>.py`` that defines
``SPEC`` (a :class:`MethodSpec`). Modules whose name starts with ``_`` are the framework of
this package; :data:`SHARED` names the public modules of math several methods share
(:mod:`xopt.specs.arrays`, :mod:`xopt.specs.lowrank`, :mod:`xopt.specs.lopt`), which the
backends use too.

>>> from xopt import specs
>>> specs.names()
['adamw']
>>> spec = specs.get("adamw")
>>> spec.make("optax", lr=3e-4)
"""

from __future__ import annotations

import importlib
import pkgutil

from xopt.errors import UnknownMethodError
from xopt.specs._groups import ParamGroups, all_hps, hp_for
from xopt.specs._hyperparams import Hyperparams, Interval, hp
from xopt.specs._method import MetaParams, MethodSpec
from xopt.specs._state import Naming, StateSchema, StateVar

__all__ = [
    "Hyperparams",
    "Interval",
    "MetaParams",
    "MethodSpec",
    "Naming",
    "ParamGroups",
    "StateSchema",
    "StateVar",
    "all_hps",
    "get",
    "hp",
    "hp_for",
    "names",
]


#: public modules of shared math, not methods
SHARED = ("arrays", "lopt", "lowrank")


def names() -> list[str]:
    """The registered method names, sorted (found without importing the modules)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__)
                  if not m.name.startswith("_") and m.name not in SHARED)


def get(name: str) -> MethodSpec:
    """The :class:`MethodSpec` of method ``name``; an unknown name lists the known ones."""
    known = names()
    if name not in known:
        raise UnknownMethodError(f"unknown method {name!r}; known methods: {', '.join(known)}")
    module = importlib.import_module(f"{__name__}.{name}")
    spec = getattr(module, "SPEC", None)
    if not isinstance(spec, MethodSpec):
        raise UnknownMethodError(f"xopt.specs.{name} defines no SPEC")
    return spec
