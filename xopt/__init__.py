"""xopt: optimizers specified once and implemented twice, in PyTorch and in JAX.

Importing ``xopt`` is cheap: it imports neither torch, jax, flax, optax nor triton.
The framework packages load on first use:

>>> import xopt
>>> xopt.specs.names()                     # framework-neutral specifications
>>> from xopt.torch import AdamW           # imports torch
>>> from xopt.jax import adamw             # imports jax and optax
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0.dev0"

from xopt.errors import (  # noqa: E402  (light module, no third-party imports)
    HyperparameterError,
    NonFiniteError,
    StateError,
    TraceError,
    UnknownMethodError,
    XoptError,
)

_LAZY_SUBMODULES = ("specs", "registry", "random", "parity", "torch", "jax", "cli")

__all__ = [
    "HyperparameterError",
    "NonFiniteError",
    "StateError",
    "TraceError",
    "UnknownMethodError",
    "XoptError",
    "__version__",
    *_LAZY_SUBMODULES,
]


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        module = importlib.import_module(f"xopt.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'xopt' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
