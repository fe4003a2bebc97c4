"""Run μLO's original ``MuAdafacMLPLOpt`` live (``xopt parity mulo --against original``).

μLO is research code, not a package. To make it importable, on top of what
:mod:`xopt.parity.originals.learned_optimization` needs (haiku, gin, and a
learned_optimization checkout; μLO's README installs the fork
``lefameuxbeding/learned_optimization``, branch ``mup_compatible``), put the ``src/``
folder of https://github.com/bentherien/mu_learned_optimization on ``PYTHONPATH`` (the
golden traces were recorded at commit e160d5481c5445f30996f308009ab07ba3d339e7).

The optimizer reads its per-parameter μP multipliers from the model state it is handed,
``model_state['mup_lrs_to_use']`` (μLO's ``MuTask.get_mup_state``); the driver passes the
multipliers of the hyperparameters there. The optimizer state carries the model state
unchanged (its ``state`` field); the driver hands the harness the state without it
(``state=None``) and puts it back before each update.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from xopt.parity.originals import learned_optimization as lo
from xopt.parity.runners import flatten_with_paths


class _MuDriver:
    """``MuAdafacMLPLOpt(**kwargs).opt_fn(θ)`` with its model state: ``init(params)``,
    ``update(state, g, loss)`` (jitted), ``get_params(state)``."""

    def __init__(self, opt: Any, num_steps: int, mults: Any) -> None:
        import jax

        self.opt, self.num_steps, self.mults = opt, num_steps, mults
        self._update = jax.jit(lambda s, g, loss, ms: opt.update(s, g, loss, model_state=ms))
        self.model_state: dict[str, Any] | None = None

    def init(self, params: Mapping[str, Any]) -> Any:
        if isinstance(self.mults, Mapping):
            missing = sorted(set(params) - set(self.mults))
            if missing:
                raise KeyError(f"mup_lrs_to_use has no multiplier for {missing}")
            tree = {k: np.float32(self.mults[k]) for k in params}
        else:
            tree = {k: np.float32(self.mults) for k in params}
        self.model_state = {"mup_lrs_to_use": tree}
        state = self.opt.init(params, model_state=self.model_state, num_steps=self.num_steps)
        return state.replace(state=None)

    def update(self, state: Any, grads: Any, loss: Any) -> Any:
        full = state.replace(state=self.model_state)
        return self._update(full, grads, loss, self.model_state).replace(state=None)

    def get_params(self, state: Any) -> Any:
        return self.opt.get_params(state)


def mu_adafac_mlp_lopt(theta: Mapping[str, np.ndarray], *, num_training_steps: int,
                       mup_lrs_to_use: Any = 1.0, **kwargs: Any) -> Any:
    """The live original, as a :class:`xopt.parity.originals.learned_optimization.
    LearnedOptimizationRunner` driver whose read-back leaves out the model state."""
    import jax

    lo._install_stubs()  # (this package's) the TensorFlow stand-ins learned_optimization needs
    module = importlib.import_module("mup_adafac_mlp_lopt")
    lopt = module.MuAdafacMLPLOpt(**kwargs)
    template = lopt.init(jax.random.PRNGKey(0))
    paths = list(flatten_with_paths(template))
    missing, extra = sorted(set(paths) - set(theta)), sorted(set(theta) - set(paths))
    if missing or extra:
        raise KeyError(f"meta-parameters do not match the original's θ: missing {missing}, "
                       f"unexpected {extra}")
    leaves = [np.asarray(theta[k], dtype=np.float32) for k in paths]
    tree = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves)
    return _MuDriver(lopt.opt_fn(tree), num_training_steps, mup_lrs_to_use)
