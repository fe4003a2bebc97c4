"""`MethodSpec`: a method's hyperparameters, state and math, in one object.

A spec module ``xopt/specs/<method>.py`` defines ``SPEC = MethodSpec(...)``. :mod:`xopt.specs`
finds it by the module's name; the backends, the parity harness and the CLI read it. A spec
names no implementation: the backends register themselves (:mod:`xopt.registry`), and what
the harness needs about the originals (adapters, injection, tolerances) is in
:mod:`xopt.parity.methods`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from xopt.errors import HyperparameterError
from xopt.specs._hyperparams import Hyperparams
from xopt.specs._state import StateSchema


@dataclasses.dataclass(frozen=True)
class MetaParams:
    """A learned optimizer's own weights (θ): their names, shapes and the original's names.

    xopt names θ's arrays canonically (``mlp/w0``, ``lstm/gates/w``); the original's names
    are its pytree paths joined by ``/`` (``nn/~/w0``, ``rnn_params/rnn/linear/w``), as in
    the golden traces' ``meta/`` files.

    Attributes:
      shapes: ``hp -> {canonical name: shape}``.
      from_original: ``(θ in the original's naming, hp) -> θ canonical``; strict.
      to_original: the inverse; strict.
      init: ``(hp, seed) -> θ canonical``: a seeded random init (same bits everywhere).
      coerce: ``(θ in either naming, hp) -> θ canonical``.
    """

    shapes: Callable[[Hyperparams], dict[str, tuple[int, ...]]]
    from_original: Callable[[Mapping[str, Any], Hyperparams], dict[str, Any]]
    to_original: Callable[[Mapping[str, Any], Hyperparams], dict[str, Any]]
    init: Callable[[Hyperparams, int], dict[str, Any]]
    coerce: Callable[[Mapping[str, Any], Hyperparams], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """The framework-neutral specification of one method.

    Attributes:
      name: registry name (the module's name).
      title: one line for listings.
      hyperparams: the frozen hyperparameter dataclass.
      presets: named bundles of field values (``{"torch": {...}, "optax": {...}}``).
      state: the state schema, with the namings of xopt's own backends (the layouts they
        promise; an original's naming belongs to the harness's adapter for it).
      init_state: ``(hp, params: dict[name, array], xp) -> canonical state dict``.
      step: ``(hp, params, state, grads, *, xp, loss=None) -> (params, state)``: the whole
        update as a pure function on dicts of arrays, the oracle's definition.
      naming_of: ``{"torch": naming key, "jax": naming key}``: which of ``state.namings``
        each of xopt's backends uses.
      takes_loss: the optimizer consumes the loss (``step(loss=...)``, ``value=loss``).
      impls: implementations of the torch backend (``"plain"``, ``"triton"``).
      meta: the learned optimizer's weights, for methods that have them (else None): the
        harness hands them to every runner (``meta_params=``) and to ``step(meta=...)``.
    """

    name: str
    title: str
    hyperparams: type[Hyperparams]
    presets: Mapping[str, Mapping[str, Any]]
    state: StateSchema
    init_state: Callable[..., dict[str, Any]]
    step: Callable[..., tuple[dict[str, Any], dict[str, Any]]]
    naming_of: Mapping[str, str]
    takes_loss: bool = False
    impls: tuple[str, ...] = ("plain",)
    meta: MetaParams | None = None

    def make(self, preset: str | None = None, **overrides: Any) -> Hyperparams:
        """Hyperparameters from a preset (or the class defaults) with overrides applied."""
        values: dict[str, Any] = {}
        if preset is not None:
            if preset not in self.presets:
                raise HyperparameterError(
                    f"{self.name}: unknown preset {preset!r}; known: {', '.join(self.presets)}"
                )
            values.update(self.presets[preset])
        self.hyperparams._reject_unknown(overrides)
        values.update(overrides)
        return self.hyperparams(**values)
