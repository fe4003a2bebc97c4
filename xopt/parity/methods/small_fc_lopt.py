"""small_fc_lopt in the parity harness: learned_optimization's AdafacMLPLOpt, the tolerances.

The original runs live through :mod:`xopt.parity.originals.learned_optimization` when
learned_optimization is importable; its golden traces name their state by jax paths
(:data:`NAMING`, or :data:`ACCUMULATED_NAMING` under prefab's gradient accumulation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from xopt.errors import HyperparameterError
from xopt.parity.methods import MethodParity, Original, Tolerance
from xopt.specs import Naming, arrays
from xopt.specs import small_fc_lopt as S

#: AdafacMLPLOptState flattened with jax paths (params/ and the model state left out).
NAMING = Naming(
    keys={"m": "mom_rolling/m/{param}", "mom_t": "mom_rolling/t",
          "rms": "rms_rolling/rms/{param}", "rms_t": "rms_rolling/t",
          "v_row": "fac_rolling_features/v_row/{param}",
          "v_col": "fac_rolling_features/v_col/{param}",
          "v_diag": "fac_rolling_features/v_diag/{param}",
          "num_steps": "num_steps", "iteration": "iteration"},
    dtypes={"iteration": "int32", "num_steps": "int32", "mom_t": "int32",
            "rms_t": "int32"},
    doc="AdafacMLPLOpt().opt_fn(θ).init(params, num_steps=n) (no accumulation)",
)

#: prefab with accumulation: GradientAccumulatorState(grad_accum, loss_accum,
#: inner_opt_state=AdafacMLPLOptState, iteration) (jax_enable_x64 off: int32).
ACCUMULATED_NAMING = Naming(
    keys={"m": "inner_opt_state/mom_rolling/m/{param}",
          "mom_t": "inner_opt_state/mom_rolling/t",
          "rms": "inner_opt_state/rms_rolling/rms/{param}",
          "rms_t": "inner_opt_state/rms_rolling/t",
          "v_row": "inner_opt_state/fac_rolling_features/v_row/{param}",
          "v_col": "inner_opt_state/fac_rolling_features/v_col/{param}",
          "v_diag": "inner_opt_state/fac_rolling_features/v_diag/{param}",
          "num_steps": "inner_opt_state/num_steps",
          "iteration": "inner_opt_state/iteration",
          "grad_accum": "grad_accum/{param}", "loss_accum": "loss_accum",
          "accum_iteration": "iteration"},
    dtypes={"iteration": "int32", "num_steps": "int32", "mom_t": "int32",
            "rms_t": "int32", "accum_iteration": "int32", "loss_accum": "float32"},
    doc="prefab.LearnedOptimizer with num_training_steps > max_training_steps",
)

_ORIGINAL_FLAGS = {"concat_weights": True, "make_separate_weights": False, "split_weights": False}
_METHOD_FIELDS = ("exp_mult", "step_mult", "hidden_size", "hidden_layers",
                  "initial_momentum_decays", "initial_rms_decays", "initial_adafactor_decays")
_PREFAB_FIELDS = ("num_training_steps", "weight_decay", "max_training_steps")


def from_original_kwargs(kw: Mapping[str, Any]) -> S.SmallFCLOpt:
    """AdafacMLPLOpt's constructor arguments (plus prefab's ``num_training_steps``,
    ``weight_decay``, ``max_training_steps``) → :class:`~xopt.specs.small_fc_lopt.SmallFCLOpt`."""
    known = set(_METHOD_FIELDS) | set(_ORIGINAL_FLAGS) | set(_PREFAB_FIELDS)
    unknown = sorted(set(kw) - known)
    if unknown:
        raise HyperparameterError(
            f"unknown AdafacMLPLOpt argument(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(known))}")
    for flag, supported in _ORIGINAL_FLAGS.items():
        if flag in kw and bool(kw[flag]) != supported:
            raise HyperparameterError(
                f"AdafacMLPLOpt.{flag} = {kw[flag]!r}: xopt implements only {flag}="
                f"{supported} (the concatenated-matmul form of the MLP; the other forms "
                "compute the same function with another evaluation order or meta-parameter "
                "layout)")
    values = dict(S.PRESETS["original"])
    for name in _METHOD_FIELDS + _PREFAB_FIELDS:
        if name in kw and kw[name] is not None:
            v = kw[name]
            values[name] = tuple(v) if isinstance(v, list) else v
    return S.SmallFCLOpt(**values)


def to_original_kwargs(h: S.SmallFCLOpt) -> dict[str, Any]:
    """:class:`~xopt.specs.small_fc_lopt.SmallFCLOpt` → AdafacMLPLOpt's arguments plus
    ``num_training_steps`` (the horizon given to its ``init``). The bare AdafacMLPLOpt has
    no step multiplier, no weight decay and no accumulation: settings that need them raise,
    naming the field."""
    if float(h.lr) != 1.0:
        raise HyperparameterError(
            f"SmallFCLOpt.lr = {h.lr!r}: AdafacMLPLOpt has no step multiplier (lr must be 1)")
    if not arrays.is_static_zero(h.weight_decay):
        raise HyperparameterError(
            f"SmallFCLOpt.weight_decay = {h.weight_decay!r}: the bare AdafacMLPLOpt has no "
            "weight decay (prefab's WeightDecayWrapper adds it)")
    if h.accumulating:
        raise HyperparameterError(
            f"SmallFCLOpt.num_training_steps = {h.num_training_steps!r} > max_training_steps "
            f"= {h.max_training_steps!r}: the bare AdafacMLPLOpt does not accumulate "
            "gradients (prefab's GradientAccumulator does)")
    out = {name: getattr(h, name) for name in _METHOD_FIELDS}
    out.update(_ORIGINAL_FLAGS)
    out["num_training_steps"] = h.require_num_training_steps("AdafacMLPLOpt")
    return out


# -- tolerances ----------------------------------------------------------------------------

TOLERANCES = {
    "bitwise": Tolerance(0.0, 0.0, "same operations in the same order on the same machine"),
    "teacher_forced": Tolerance(
        1e-6, 0.0,
        "one float32 update: accumulators are a few roundings each (the decays' log/exp may "
        "differ by an ulp between XLA, NumPy and torch); the step goes through means, "
        "matmuls, rsqrt, tanh and exp that the frameworks round differently, but it is "
        "1e-3..1e-2 of the parameter, so params and state stay within a few ulp of their "
        "largest element",
    ),
    "closed_loop": Tolerance(
        1e-4, 0.0,
        "30 steps: the per-step rounding of the step (~1e-6 of the step) and an ulp of a "
        "decay (~2e-6 of a momentum after 30 steps, see the traces' effective_decays) "
        "accumulate; the gradients are the recorded ones, so nothing feeds back through the "
        "model",
    ),
}


PARITY = MethodParity(
    method="small_fc_lopt",
    originals={
        "learned_optimization.learned_optimizers.adafac_mlp_lopt.AdafacMLPLOpt": Original(
            name="learned_optimization.learned_optimizers.adafac_mlp_lopt.AdafacMLPLOpt",
            backend="learned_optimization",
            factory="xopt.parity.originals.learned_optimization:adafac_mlp_lopt",
            naming=NAMING, preset="original",
            to_kwargs=to_original_kwargs, from_kwargs=from_original_kwargs,
            requires=("jax", "haiku", "gin", "flax", "learned_optimization"),
        ),
    },
    tolerances=TOLERANCES,
)
