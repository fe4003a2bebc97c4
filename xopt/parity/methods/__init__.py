"""The harness's side of each method: adapters to the originals, injection, tolerances.

A spec (:mod:`xopt.specs`) holds a method's hyperparameters, state and math. What the
parity harness needs on top lives here, one module per method, ``xopt/parity/methods/<m>.py``
(the spec's name), which defines ``PARITY`` (a :class:`MethodParity`):

* the **originals** the harness can run live or whose traces it replays (:class:`Original`:
  how to build one, how its constructor arguments map to the spec's hyperparameters and
  back, how it names its state);
* **injection**: the values an original drew from its own generator or decomposition at an
  update (projections, SVD factors), read from a trace, which xopt's implementations then
  use instead of their own;
* **tolerances**, each with the reason it is what it is, and the pairs held bit for bit;
* for layer methods, the **layer driver** that replays a ``kind: "layer"`` trace
  (:mod:`xopt.parity.layers`).

:func:`get` finds a method's ``PARITY`` by the method's name. Nothing here imports torch or
jax: originals are named by ``"module:attr"`` and imported only to run them, so ``xopt
methods`` lists every original without a framework.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any, Literal

from xopt.errors import HyperparameterError, UnknownMethodError
from xopt.specs import Hyperparams, MethodSpec, Naming
from xopt.specs import get as get_spec

__all__ = ["MethodParity", "Original", "Tolerance", "get", "load_object"]


def load_object(ref: str) -> Any:
    """Import ``"package.module:attr.sub"`` and return the attribute (an original's
    factory, imported only when the harness runs it)."""
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
      naming: how it lays its state out (a :class:`~xopt.specs.Naming` of the spec's state
        variables), or a function of the hyperparameters giving it (prefab's layout depends
        on whether it accumulates).
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
    naming: Naming | Callable[[Hyperparams], Naming]
    preset: str
    to_kwargs: Callable[[Hyperparams], dict[str, Any]]
    from_kwargs: Callable[[Mapping[str, Any]], Hyperparams]
    requires: tuple[str, ...] = ()

    def naming_for(self, hp: Hyperparams) -> Naming:
        return self.naming(hp) if callable(self.naming) else self.naming


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
class MethodParity:
    """What the harness needs to check one method, beyond its spec.

    Attributes:
      method: the method's name (its spec's).
      originals: live original implementations by name (empty when none runs or records).
      tolerances: named bounds (see :meth:`tolerance`): ``"teacher_forced"`` and
        ``"closed_loop"`` at least, and ``"bitwise"``; ``"<mode>/oracle"`` where the float64
        oracle is held to a different bound than the float32 backends (with the reason).
      bitwise: ``hp -> {(xopt backend, original name), ...}``: the pairs that must agree bit
        for bit (same arithmetic, same machine) under these hyperparameters.
      inject: ``(trace, t, hp) -> {param name: {key: array}}`` or None: the values an
        original drew from its own random generator or decomposition at update ``t``
        (projections, SVD factors), read from the trace, which every xopt implementation
        uses instead of its own (``step(..., inject=...)``; the keys are the spec's).
        Originals run live ignore it.
      layer: the driver that runs the comparisons of a ``kind: "layer"`` trace (a module's
        forward/backward and its optimizer, driven the method's own way):
        ``fn(trace, *, backends, against, modes, impl, device, max_steps, notes,
        explicit_backends) -> list[Run]``; ``run_parity`` hands such traces to it.
    """

    method: str
    originals: Mapping[str, Original]
    tolerances: Mapping[str, Tolerance]
    bitwise: Callable[[Hyperparams], frozenset[tuple[str, str]]] = lambda hp: frozenset()
    inject: Callable[..., dict[str, dict[str, Any]] | None] | None = None
    layer: Callable[..., list[Any]] | None = None

    @property
    def spec(self) -> MethodSpec:
        return get_spec(self.method)

    def original(self, name: str) -> Original:
        try:
            return self.originals[name]
        except KeyError:
            raise HyperparameterError(
                f"{self.method}: no original implementation {name!r}; "
                f"known: {', '.join(self.originals)}"
            ) from None

    def tolerance(self, name: str) -> Tolerance:
        return self.tolerances[name]


def get(method: str) -> MethodParity:
    """The :class:`MethodParity` of ``method`` (``xopt.parity.methods.<method>.PARITY``);
    an unknown method lists the known ones."""
    get_spec(method)  # an unknown name: UnknownMethodError listing the methods
    module = importlib.import_module(f"{__name__}.{method}")
    parity = getattr(module, "PARITY", None)
    if not isinstance(parity, MethodParity):
        raise UnknownMethodError(f"{__name__}.{method} defines no PARITY")
    return parity
