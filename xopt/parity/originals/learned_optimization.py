"""Run Google's learned_optimization live: the original small_fc_lopt and VeLO.

learned_optimization is not a dependency of xopt, and it is not on PyPI in a form that
installs today. To make it importable (for ``xopt parity velo --against original``):

1. ``pip install dm-haiku gin-config`` (plus flax, optax, chex, which xopt's jax extra has);
2. put a checkout of https://github.com/google/learned_optimization on ``PYTHONPATH``
   (the golden traces were recorded at commit 32186aa46a96f26ba0625755f93c55659adcd523):
   ``PYTHONPATH=/path/to/learned_optimization xopt parity velo --against original``.

TensorFlow is *not* needed: learned_optimization imports ``tensorflow`` and
``tensorflow_datasets`` at module level in files the optimizers never call into
(``summary.py``, the task/dataset chain behind ``opt_from_checkpoint``). :func:`import_modules`
installs stand-in modules under those names before importing (only when the real ones are
absent); every function they offer raises if it is ever called, so a stub cannot change a
number silently. ``flax.training.checkpoints`` is imported first, because flax probes for
tensorflow at import time and must see the real absence.

The originals are driven through their own API, not optax: ``opt.init(params,
num_steps=...)``, ``opt.update(state, grad, loss=...)`` (jitted, as the golden recorder
did), ``opt.get_params(state)``. :class:`LearnedOptimizationRunner` adapts that to the
harness's runner protocol.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Mapping
from typing import Any

import numpy as np

from xopt.parity.runners import Arrays, Runner, flatten_with_paths, replace_by_paths

#: the distributions needed to run the originals (``Original.requires``)
REQUIRES = ("jax", "haiku", "gin", "flax", "learned_optimization")

_STUBBED = ("tensorflow", "tensorflow.compat", "tensorflow.compat.v2", "tensorflow_datasets")


def _stub_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    module.__doc__ = "xopt stand-in: learned_optimization imports it but never calls it here"

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{name}.{attr} was called, but {name} is an xopt stand-in "
                               "(TensorFlow is not installed)")

        return unavailable

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def _install_stubs() -> None:
    import flax.training.checkpoints  # noqa: F401  (flax probes for tensorflow at import)

    if importlib.util.find_spec("tensorflow") is not None:
        return
    for name in _STUBBED:
        if name not in sys.modules:
            sys.modules[name] = _stub_module(name)
    tf = sys.modules["tensorflow"]
    tf.compat = sys.modules["tensorflow.compat"]  # type: ignore[attr-defined]
    tf.compat.v2 = sys.modules["tensorflow.compat.v2"]  # type: ignore[attr-defined]
    # summary.py calls this at import; it only switches TF1 behaviour off
    tf.compat.v2.enable_v2_behavior = lambda: None  # type: ignore[attr-defined]


def available() -> bool:
    """True when learned_optimization (and haiku, gin) can be imported."""
    return all(importlib.util.find_spec(m) is not None for m in REQUIRES)


def import_modules() -> types.SimpleNamespace:
    """Import the learned_optimization modules xopt drives, behind the TensorFlow stubs."""
    missing = [m for m in REQUIRES if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"running learned_optimization needs {', '.join(missing)}; see "
            "xopt/parity/originals/learned_optimization.py for how to make it importable")
    _install_stubs()
    lo = "learned_optimization"
    return types.SimpleNamespace(
        adafac_mlp_lopt=importlib.import_module(f"{lo}.learned_optimizers.adafac_mlp_lopt"),
        hyper_v2=importlib.import_module(f"{lo}.research.general_lopt.hyper_v2"),
        prefab=importlib.import_module(f"{lo}.research.general_lopt.prefab"),
        opt_from_checkpoint=importlib.import_module(
            f"{lo}.learned_optimizers.opt_from_checkpoint"),
    )


# -- the originals, built from θ in their own naming ----------------------------------------


class _Driver:
    """An original optimizer with θ bound: ``init(params)``, ``update(state, g, loss)``."""

    def __init__(self, opt: Any, num_steps: int | None, *, loss_keyword: bool,
                 prefab: bool = False) -> None:
        import jax

        self.opt, self.num_steps, self.prefab = opt, num_steps, prefab
        if prefab:  # prefab.LearnedOptimizer supplies PRNGKey(0) itself
            self._update = jax.jit(lambda s, g, loss: opt.update(s, g, loss=loss))
        elif loss_keyword:  # HyperV2 splits a key it never draws from; the recorder gave 0
            key = jax.random.PRNGKey(0)
            self._update = jax.jit(lambda s, g, loss: opt.update(s, g, loss=loss, key=key))
        else:  # AdafacMLPLOpt.update(state, grad, loss)
            self._update = jax.jit(lambda s, g, loss: opt.update(s, g, loss))

    def init(self, params: Any) -> Any:
        if self.prefab:
            return self.opt.init(params)
        return self.opt.init(params, num_steps=self.num_steps)

    def update(self, state: Any, grads: Any, loss: Any) -> Any:
        return self._update(state, grads, loss)

    def get_params(self, state: Any) -> Any:
        return self.opt.get_params(state)


def _theta_tree(lopt: Any, theta: Mapping[str, np.ndarray]) -> Any:
    """θ as the original's nested pytree: its own init's structure, leaves replaced by path
    (strict: every leaf must be given, and nothing else)."""
    import jax

    template = lopt.init(jax.random.PRNGKey(0))
    paths = list(flatten_with_paths(template))
    missing, extra = sorted(set(paths) - set(theta)), sorted(set(theta) - set(paths))
    if missing or extra:
        raise KeyError(f"meta-parameters do not match the original's θ: missing {missing}, "
                       f"unexpected {extra}")
    # NumPy leaves, as the golden recorder passed them: jit embeds them as constants, and
    # XLA then folds and fuses exactly as it did for the recording (device arrays are
    # passed as arguments instead, which moves some steps by an ulp)
    leaves = [np.asarray(theta[k], dtype=np.float32) for k in paths]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves)


def adafac_mlp_lopt(theta: Mapping[str, np.ndarray], *, num_training_steps: int,
                    **kwargs: Any) -> _Driver:
    """``AdafacMLPLOpt(**kwargs).opt_fn(θ)``, initialised with ``num_steps``."""
    mods = import_modules()
    lopt = mods.adafac_mlp_lopt.AdafacMLPLOpt(**kwargs)
    return _Driver(lopt.opt_fn(_theta_tree(lopt, theta)), num_training_steps,
                   loss_keyword=False)


def hyper_v2(theta: Mapping[str, np.ndarray], *, num_training_steps: int,
             **kwargs: Any) -> _Driver:
    """``HyperV2(**kwargs).opt_fn(θ)``, initialised with ``num_steps``."""
    mods = import_modules()
    lopt = mods.hyper_v2.HyperV2(**kwargs)
    return _Driver(lopt.opt_fn(_theta_tree(lopt, theta)), num_training_steps,
                   loss_keyword=True)


def prefab(theta: Mapping[str, np.ndarray], *, num_training_steps: int,
           weight_decay: float = 0.0, max_training_steps: int = 150_000,
           HyperV2: Mapping[str, Any] | None = None, base_lopt_fn: str | None = None,  # noqa: N803
           ) -> _Driver:
    """``prefab.LearnedOptimizer`` around ``HyperV2(**HyperV2).opt_fn(θ)``."""
    mods = import_modules()
    lopt = mods.hyper_v2.HyperV2(**dict(HyperV2 or {}))
    inner = lopt.opt_fn(_theta_tree(lopt, theta))
    lo = mods.prefab.LearnedOptimizer(num_training_steps, weight_decay=weight_decay,
                                      max_training_steps=max_training_steps,
                                      base_lopt_fn=lambda: inner)
    return _Driver(lo, None, loss_keyword=True, prefab=True)


# -- the harness runner -------------------------------------------------------------------


class LearnedOptimizationRunner(Runner):
    """Drives an original learned_optimization optimizer on a dict of float32 params.

    State is read and written as the original's pytree flattened by path (the golden
    traces' naming), minus the parameters it carries (``params/...``) and the empty model
    state.
    """

    backend = "jax"

    def __init__(self, spec: Any, hp: Any, param_names: list[str], *, label: str,
                 driver: _Driver, naming: str) -> None:
        super().__init__(spec, hp, param_names)
        self.label, self.driver, self.naming = label, driver, naming

    def reset(self, params: Arrays, state: Arrays | None) -> None:
        import jax.numpy as jnp

        p = {k: jnp.asarray(params[k]) for k in self.param_names}
        self.state = self.driver.init(p)
        if state is not None:
            flat = self.spec.state.from_canonical(self.naming, state, self.param_names, self.hp)
            for path in flatten_with_paths(self.state):
                # the parameters the state carries: "params/<name>" (or nested under the
                # prefab accumulator's "inner_opt_state/")
                head, _, name = path.rpartition("params/")
                if name in params and head in ("", "inner_opt_state/"):
                    flat[path] = params[name]
            self.state = replace_by_paths(self.state, flat)

    def step(self, grads: Arrays, loss: float | None, inject: Any = None) -> None:
        import jax.numpy as jnp

        g = {k: jnp.asarray(grads[k]) for k in self.param_names}
        self.state = self.driver.update(self.state, g, jnp.asarray(np.float32(loss)))

    def read(self) -> tuple[Arrays, Arrays]:
        params = {k: np.asarray(v) for k, v in self.driver.get_params(self.state).items()}
        flat = {}
        for k, v in flatten_with_paths(self.state).items():
            head, _, name = k.rpartition("params/")
            if name in params and head in ("", "inner_opt_state/"):
                continue
            flat[k] = np.asarray(v)
        state = self.spec.state.to_canonical(self.naming, flat, self.param_names, self.hp,
                                             where=self.label)
        return params, state
