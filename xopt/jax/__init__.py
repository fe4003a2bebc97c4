"""The JAX backend: xopt's optimizers as optax gradient transformations.

Importing this package imports jax and optax (``import xopt`` alone imports neither).

>>> import optax, xopt.jax
>>> tx = xopt.jax.adamw(1e-3, weight_decay=1e-4)      # bitwise optax.adamw's arithmetic
>>> state = tx.init(params)
>>> updates, state = tx.update(grads, state, params)
>>> params = optax.apply_updates(params, updates)

Every transformation keeps one contract (:mod:`xopt.jax._contract`, checked by
``tests/contract/``): it works in ``optax.chain``, ``optax.MultiSteps`` and
``optax.inject_hyperparams`` (float hyperparameters injectable; integer ones named in
``static_args``), jits without retracing, takes ``value=`` (the learned optimizers need it,
the others ignore it), checks gradients and state against the parameters at trace time
(a state made for other parameters is an :class:`xopt.errors.StateError`), and takes
``nonfinite="ignore" | "raise" | "skip"`` (:mod:`xopt.nonfinite`).

Note: ``xopt.jax.adamw`` is the *function* (what :mod:`xopt.registry` holds as the
``"jax"`` implementation of ``"adamw"``); the module that defines it is
``sys.modules["xopt.jax.adamw"]``, reached with ``importlib.import_module("xopt.jax.adamw")``.
"""

from __future__ import annotations

# Eager on purpose: once the submodule xopt.jax.adamw is imported, Python sets the package
# attribute `adamw` to the module; binding the function here, after that import, is what
# makes `from xopt.jax import adamw` reliably the function.
from xopt.jax.adamw import AdamWState, adamw
from xopt.jax.coap import COAPState, coap
from xopt.jax.compact import CompActAdamState, CompActDense, compact_adamw
from xopt.jax.flora import FloraState, flora
from xopt.jax.galore import GaLoreState, galore
from xopt.jax.mulo import mulo
from xopt.jax.plumage import PlumageState, plumage
from xopt.jax.poet import POETAdamWState, POETDense, poet_adamw
from xopt.jax.small_fc_lopt import small_fc_lopt
from xopt.jax.velo import VeLOState, velo

__all__ = ["AdamWState", "COAPState", "coap", "GaLoreState", "galore",
           "POETAdamWState", "POETDense", "VeLOState", "adamw", "poet_adamw",
           "small_fc_lopt", "velo"]
__all__ += ["CompActAdamState", "CompActDense", "compact_adamw"]
__all__ += ["FloraState", "flora"]
__all__ += ["PlumageState", "plumage"]
__all__ += ["mulo"]
