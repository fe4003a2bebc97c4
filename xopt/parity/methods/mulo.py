"""μLO in the parity harness: μLO's MuAdafacMLPLOpt, its multipliers, the tolerances.

The golden traces were recorded from μLO's own code (``tools/record_mulo.py``): its
``MuAdafacMLPLOpt`` on its ``MuMLP``, the per-parameter μP multipliers read by the update
from ``model_state['mup_lrs_to_use']``. A manifest keeps them as the hyperparameter
``mup_lrs_to_use`` (``{param: multiplier}``); :func:`from_original_kwargs` turns them into
:class:`~xopt.specs.ParamGroups` of :class:`~xopt.specs.mulo.MuLO` differing in ``mup_lr``.
The state is small_fc_lopt's pytree (:data:`xopt.parity.methods.small_fc_lopt.NAMING`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from xopt.errors import HyperparameterError
from xopt.parity.methods import MethodParity, Original
from xopt.parity.methods import small_fc_lopt as sfp
from xopt.specs import ParamGroups
from xopt.specs import mulo as S
from xopt.specs import small_fc_lopt as SF

_FLAGS = {"concat_weights": True, "make_separate_weights": False, "split_weights": False}
_FIELDS = ("exp_mult", "step_mult", "hidden_size", "hidden_layers", "initial_momentum_decays",
           "initial_rms_decays", "initial_adafactor_decays", "clip_grad")
_PREFAB = ("num_training_steps",)
_MULTS = "mup_lrs_to_use"


def from_original_kwargs(kw: Mapping[str, Any]) -> S.MuLO | ParamGroups:
    """MuAdafacMLPLOpt's constructor arguments, the horizon, and ``mup_lrs_to_use``
    (``{param: multiplier}``, the model state the update reads) → :class:`MuLO` or
    :class:`ParamGroups` (one group per distinct multiplier, in first-seen order)."""
    known = set(_FIELDS) | set(_FLAGS) | set(_PREFAB) | {_MULTS, "mup_lrs"}
    unknown = sorted(set(kw) - known)
    if unknown:
        raise HyperparameterError(
            f"unknown MuAdafacMLPLOpt argument(s) {', '.join(map(repr, unknown))}; known: "
            f"{', '.join(sorted(known))}")
    for flag, supported in _FLAGS.items():
        if flag in kw and bool(kw[flag]) != supported:
            raise HyperparameterError(f"MuAdafacMLPLOpt.{flag} = {kw[flag]!r}: xopt implements "
                                      f"only {flag}={supported} (the concatenated-matmul MLP)")
    values = dict(S.PRESETS["original"])
    for name in _FIELDS + _PREFAB:
        if name in kw and kw[name] is not None:
            v = kw[name]
            values[name] = tuple(v) if isinstance(v, list) else v
    base = S.MuLO(**values)
    mults = kw.get(_MULTS)
    if mults is None:
        return base
    if not isinstance(mults, Mapping) or not mults:
        raise HyperparameterError(f"{_MULTS} must map parameter names to multipliers")
    groups: dict[float, list[str]] = {}
    for name, v in mults.items():
        groups.setdefault(float(v), []).append(str(name))
    return ParamGroups.of([(names, base.replace(mup_lr=m)) for m, names in groups.items()])


def to_original_kwargs(h: S.MuLO | ParamGroups) -> dict[str, Any]:
    """The constructor's arguments plus ``num_training_steps`` and ``mup_lrs_to_use`` (the
    multipliers the live original is handed through its model state)."""
    base, _ = S.settings(h)
    out = sfp.to_original_kwargs(SF.SmallFCLOpt(**{
        f: getattr(base, f) for f in SF.SmallFCLOpt.field_names()}))
    out["clip_grad"] = base.clip_grad
    if isinstance(h, ParamGroups):
        out[_MULTS] = {n: hp.mup_lr for names, hp in h.groups for n in names}
    else:
        out[_MULTS] = base.mup_lr
    return out


PARITY = MethodParity(
    method="mulo",
    originals={
        "mup_adafac_mlp_lopt.MuAdafacMLPLOpt": Original(
            name="mup_adafac_mlp_lopt.MuAdafacMLPLOpt",
            backend="learned_optimization",
            factory="xopt.parity.originals.mulo:mu_adafac_mlp_lopt",
            naming=sfp.NAMING, preset="original",
            to_kwargs=to_original_kwargs, from_kwargs=from_original_kwargs,
            requires=("jax", "haiku", "gin", "flax", "learned_optimization",
                      "mup_adafac_mlp_lopt"),
        ),
    },
    # small_fc_lopt's bounds and reasons: the same float32 arithmetic, plus one product by
    # the multiplier (exact in both, the same float32 operands) and, with clip_grad, a
    # global norm whose summation order may differ by an ulp (≤ 1e-7 of each gradient)
    tolerances=sfp.TOLERANCES,
)
