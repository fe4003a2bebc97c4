"""`MethodSpec`: everything framework-neutral about one method, in one object.

A spec module ``xopt/specs/<method>.py`` defines ``SPEC = MethodSpec(...)``. The registry
(:mod:`xopt.specs`) finds it by the module's name; the parity harness, the CLI and the
backends read it. Nothing here imports torch or jax: implementations are named by
``"module:attribute"`` strings and imported on use.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any, Literal

from xopt.errors import HyperparameterError
from xopt.specs._hyperparams import Hyperparams
from xopt.specs._state import StateSchema


def load_object(ref: str) -> Any:
    """Import ``"package.module:attr.sub"`` and return the attribute."""
    module_name, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


@dataclasses.dataclass(frozen=True)
class Original:
    """An original implementation the harness can run live, and how to talk to it.

    Attributes:
      name: how reports name it (``"torch.optim.AdamW"``); also the ``source.object`` of
        traces it recorded.
      backend: ``"torch"``, ``"jax"`` (an optax transformation) or ``"learned_optimization"``
        (a learned_optimization ``Optimizer``: ``init``/``update``/``get_params``).
      factory: ``"module:attr"`` of the constructor (``"torch.optim:AdamW"``).
      naming: key of :attr:`StateSchema.namings` for its state layout, or a function of the
        hyperparameters giving it (prefab's layout depends on whether it accumulates).
      preset: the spec preset that reproduces it.
      to_kwargs: spec hyperparameters -> the original's constructor arguments; raises
        :class:`HyperparameterError` for settings the original cannot express.
      from_kwargs: the original's constructor arguments (its own names, as in a trace
        manifest) -> spec hyperparameters; unknown names are an error.
      requires: distributions that must be importable to run it live.
    """

    name: str
    backend: Literal["torch", "jax", "learned_optimization"]
    factory: str
    naming: str | Callable[[Hyperparams], str]
    preset: str
    to_kwargs: Callable[[Hyperparams], dict[str, Any]]
    from_kwargs: Callable[[Mapping[str, Any]], Hyperparams]
    requires: tuple[str, ...] = ()

    def naming_for(self, hp: Hyperparams) -> str:
        return self.naming(hp) if callable(self.naming) else self.naming


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
class Tolerance:
    """An agreement bound with the reason it is what it is.

    A comparison agrees when ``max|a-b| <= abs`` or ``max|a-b| / max|b| <= rel`` for every
    tensor at every step. ``rel=0, abs=0`` means bit for bit.

    ``tensors`` names the exceptions: ``{canonical-name prefix: Tolerance}`` for tensors
    that provably cannot meet the bound in float32 (each with its own ``why``, which must
    name the operation and the measurement behind it). The longest matching prefix wins.
    """

    rel: float
    abs: float
    why: str
    tensors: Mapping[str, Tolerance] = dataclasses.field(default_factory=dict)

    def for_tensor(self, name: str) -> Tolerance:
        best = ""
        for prefix in self.tensors:
            if name.startswith(prefix) and len(prefix) > len(best):
                best = prefix
        return self.tensors[best] if best else self

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rel": self.rel, "abs": self.abs}
        if self.tensors:
            out["tensors"] = {k: {"rel": t.rel, "abs": t.abs, "why": t.why}
                              for k, t in self.tensors.items()}
        return out


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """The framework-neutral description of one method.

    Attributes:
      name: registry name (the module's name).
      title: one line for listings.
      hyperparams: the frozen hyperparameter dataclass.
      presets: named bundles of field values (``{"torch": {...}, "optax": {...}}``).
      state: the state schema with its namings.
      init_state: ``(hp, params: dict[name, array], xp) -> canonical state dict``.
      step: ``(hp, params, state, grads, *, xp, loss=None) -> (params, state)``: the whole
        update as a pure function on dicts of arrays, the oracle's definition.
      implementations: ``{"torch": "module:attr", "jax": "module:attr"}``.
      naming_of: ``{"torch": naming key, "jax": naming key}`` for xopt's own backends.
      originals: live original implementations by name.
      tolerances: named bounds used by the harness (see :meth:`tolerance`):
        ``"teacher_forced"`` and ``"closed_loop"`` at least, and ``"bitwise"``;
        ``"<mode>/oracle"`` where the float64 oracle is held to a different bound than
        the float32 backends (with the reason).
      bitwise: ``hp -> {(xopt backend, original name), ...}``: the pairs that must agree bit
        for bit (same arithmetic, same machine) under these hyperparameters.
      takes_loss: the optimizer consumes the loss (``step(loss=...)``, ``value=loss``).
      impls: implementations of the torch backend (``"plain"``, ``"triton"``).
      meta: the learned optimizer's weights, for methods that have them (else None): the
        harness hands them to every runner (``meta_params=``) and to ``step(meta=...)``.
      inject: ``(trace, t, hp) -> {param name: {key: array}}`` or None: the values an
        original drew from its own random generator or decomposition at update ``t``
        (projections, SVD factors), read from the trace, which every xopt implementation
        uses instead of its own (``step(..., inject=...)``; see each spec for the keys).
        Originals run live ignore it.
      layer_parity: ``"module:function"`` that runs the comparisons of a ``kind: "layer"``
        trace (a module's forward/backward and its optimizer, driven the method's own way):
        ``fn(trace, *, backends, against, modes, impl, device, max_steps, notes) ->
        list[Run]``. ``run_parity`` hands such traces to it.
    """

    name: str
    title: str
    hyperparams: type[Hyperparams]
    presets: Mapping[str, Mapping[str, Any]]
    state: StateSchema
    init_state: Callable[..., dict[str, Any]]
    step: Callable[..., tuple[dict[str, Any], dict[str, Any]]]
    implementations: Mapping[str, str]
    naming_of: Mapping[str, str]
    originals: Mapping[str, Original]
    tolerances: Mapping[str, Tolerance]
    bitwise: Callable[[Hyperparams], frozenset[tuple[str, str]]] = lambda hp: frozenset()
    takes_loss: bool = False
    impls: tuple[str, ...] = ("plain",)
    meta: MetaParams | None = None
    inject: Callable[..., dict[str, dict[str, Any]] | None] | None = None
    layer_parity: str | None = None

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

    def original(self, name: str) -> Original:
        try:
            return self.originals[name]
        except KeyError:
            raise HyperparameterError(
                f"{self.name}: no original implementation {name!r}; "
                f"known: {', '.join(self.originals)}"
            ) from None

    def tolerance(self, name: str) -> Tolerance:
        return self.tolerances[name]
