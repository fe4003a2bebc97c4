"""Per-parameter hyperparameters: torch's param groups, named, for the spec and the harness.

The low-rank methods are used as their authors use them: some matrices projected with one
rank and interval, the other tensors (biases, norms, embeddings) stepped by the base
optimizer, sometimes with their own weight decay. torch expresses that with param groups,
optax with masks and label functions. The spec and the parity harness, which know
parameters by name, use :class:`ParamGroups`: an ordered tuple of ``(names, hp)`` pairs.

Every function of the spec layer that takes ``hp`` accepts either a plain
:class:`~xopt.specs.Hyperparams` (one setting for every parameter) or a
:class:`ParamGroups`; :func:`hp_for` gives the setting of one parameter.

For example ``ParamGroups.of([(["b"], GaLore(project=False)), (["w"], GaLore(rank=4))])``
steps ``b`` with plain Adam and projects ``w`` at rank 4; ``hp_for(groups, "w").rank == 4``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from xopt.errors import HyperparameterError
from xopt.specs._hyperparams import Hyperparams


@dataclasses.dataclass(frozen=True)
class ParamGroups:
    """Parameter names grouped with the hyperparameters that apply to them.

    Attributes:
      groups: ``((names, hp), ...)`` in the order the optimizer holds them; each name in
        exactly one group, every ``hp`` of the same class.
    """

    groups: tuple[tuple[tuple[str, ...], Hyperparams], ...]

    @classmethod
    def of(cls, groups: Iterable[tuple[Sequence[str], Hyperparams]]) -> ParamGroups:
        out = tuple((tuple(names), hp) for names, hp in groups)
        seen: dict[str, int] = {}
        kinds = {type(hp) for _, hp in out}
        if len(kinds) > 1:
            raise HyperparameterError(
                f"param groups mix hyperparameter classes: {sorted(k.__name__ for k in kinds)}")
        for i, (names, _) in enumerate(out):
            for n in names:
                if n in seen:
                    raise HyperparameterError(
                        f"parameter {n!r} is in param groups {seen[n]} and {i}")
                seen[n] = i
        return cls(out)

    @property
    def names(self) -> list[str]:
        return [n for names, _ in self.groups for n in names]

    @property
    def first(self) -> Hyperparams:
        """The hyperparameters of the first non-empty group (a default for reports)."""
        for names, hp in self.groups:
            if names:
                return hp
        return self.groups[0][1]

    def hp_of(self, name: str) -> Hyperparams:
        for names, hp in self.groups:
            if name in names:
                return hp
        raise HyperparameterError(f"parameter {name!r} is in no param group; groups hold "
                                  f"{self.names}")

    def distinct(self) -> list[Hyperparams]:
        """Each group's hyperparameters once (for predicates over all of them)."""
        out: list[Hyperparams] = []
        for _, hp in self.groups:
            if hp not in out:
                out.append(hp)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"groups": [{"params": list(names), **hp.to_dict()} for names, hp in self.groups]}


def hp_for(hp: Hyperparams | ParamGroups, name: str) -> Hyperparams:
    """The hyperparameters that apply to parameter ``name``."""
    return hp.hp_of(name) if isinstance(hp, ParamGroups) else hp


def all_hps(hp: Hyperparams | ParamGroups) -> list[Hyperparams]:
    return hp.distinct() if isinstance(hp, ParamGroups) else [hp]
