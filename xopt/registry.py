"""Which object implements a method in a backend: the backends register themselves here.

Each backend module ends with one call naming what it implements::

    # xopt/torch/galore.py
    register("galore", "torch", GaLore)
    # xopt/jax/galore.py
    register("galore", "jax", galore)

and a tool that needs it (the parity harness) asks by method and backend::

    implementation("galore", "torch").factory     # the class xopt.torch.galore.GaLore

Why it is built this way:

* The specs are the bottom layer and say nothing about the backends above them. A spec that
  named its backend by a ``"module:attr"`` string, imported on use, was a hidden upward link
  that no import checker sees; now the dependency points down only (backends import the
  spec and this module, nothing imports a backend by name).
* A lookup imports ``xopt.<backend>.<method>`` if nothing is registered for the pair yet:
  that is where every method's backend module is (a method's spec, torch and JAX modules
  sit at the same relative path), so one rule finds them all, and only the module a run
  needs is loaded. Importing ``xopt``, the specs or this module imports no framework, and
  ``xopt methods`` (which reads specs only) needs none.
* Anything registered before the lookup wins, so an implementation outside ``xopt`` (a
  plugin, an experiment) joins by calling :func:`register` itself.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from xopt.errors import UnknownMethodError

__all__ = ["BACKENDS", "Implementation", "implementation", "register", "registered"]

#: xopt's own backends (``xopt.<backend>.<method>`` modules)
BACKENDS = ("torch", "jax")


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One backend's implementation of one method.

    Attributes:
      method: the method's name (its spec's, ``xopt.specs.<method>``).
      backend: ``"torch"`` or ``"jax"`` (or another backend's name).
      factory: what builds it: the ``torch.optim.Optimizer`` subclass (called
        ``factory(params, spec=hp, ...)``) or the function returning the optax
        transformation (called ``factory(spec=hp, ...)``).
    """

    method: str
    backend: str
    factory: Any


_REGISTRY: dict[tuple[str, str], Implementation] = {}


def register(method: str, backend: str, factory: Any = None) -> Any:
    """Register ``factory`` as ``backend``'s implementation of ``method`` and return it.

    Without ``factory`` it returns a decorator. Registering the pair again replaces the
    entry when the new factory has the same qualified name (a module reloaded); a different
    object is an error naming both, so two implementations cannot silently shadow each other.
    """
    if factory is None:
        return lambda f: register(method, backend, f)
    key = (method, backend)
    old = _REGISTRY.get(key)
    if old is not None and _qualname(old.factory) != _qualname(factory):
        raise ValueError(f"{backend} implementation of {method!r} is already registered: "
                         f"{_qualname(old.factory)} (not replaced by {_qualname(factory)})")
    _REGISTRY[key] = Implementation(method, backend, factory)
    return factory


def implementation(method: str, backend: str) -> Implementation:
    """``backend``'s implementation of ``method``, importing ``xopt.<backend>.<method>`` if
    nothing is registered for the pair yet. Raises :class:`UnknownMethodError` when none
    exists (an ``ImportError`` of a missing framework propagates as it is)."""
    key = (method, backend)
    if key not in _REGISTRY and backend in BACKENDS:
        try:
            importlib.import_module(f"xopt.{backend}.{method}")
        except ModuleNotFoundError as e:
            if e.name != f"xopt.{backend}.{method}":
                raise  # the framework itself, or a module the backend needs, is missing
    if key not in _REGISTRY:
        raise UnknownMethodError(f"no {backend} implementation of {method!r} is registered")
    return _REGISTRY[key]


def registered() -> dict[tuple[str, str], Implementation]:
    """What has been registered so far, by ``(method, backend)`` (a copy)."""
    return dict(_REGISTRY)


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
