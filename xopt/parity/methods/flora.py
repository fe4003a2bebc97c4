"""Flora in the parity harness: the authors' flora_opt.Flora, its projections, the tolerances.

xopt.torch.Flora keeps flora_opt's state layout (the spec's ``"flora_opt"`` naming). The
original draws its projections from torch's CPU generator, which xopt does not reproduce
(it draws from :mod:`xopt.random`), so the harness injects the recorded ones
(:func:`inject`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from xopt.errors import HyperparameterError
from xopt.parity.methods import MethodParity, Original, Tolerance
from xopt.specs import ParamGroups, all_hps
from xopt.specs import flora as S

_ORIGINAL_FIELDS = ("lr", "rank", "kappa", "eps", "clip_threshold", "decay_rate", "beta1",
                    "weight_decay", "scale_parameter", "relative_step", "warmup_init",
                    "factorize_second_moment", "quantization")


def from_kwargs(kw: Mapping[str, Any]) -> S.Flora | ParamGroups:
    """A trace manifest's ``hyperparameters`` (or plain constructor arguments) -> Flora,
    or ParamGroups built from ``effective_param_groups``."""
    ctor = dict(kw.get("constructor", kw))
    for k in ("optimizer_class", "param_groups", "effective_param_groups"):
        ctor.pop(k, None)
    known = set(_ORIGINAL_FIELDS) | {"seed"}
    unknown = sorted(set(ctor) - known)
    if unknown:
        raise HyperparameterError(f"unknown flora_opt.Flora argument(s) "
                                  f"{', '.join(map(repr, unknown))}; "
                                  f"known: {', '.join(sorted(known))}")

    def make(values: Mapping[str, Any]) -> S.Flora:
        v = {k: (tuple(x) if isinstance(x, list) else x) for k, x in values.items()}
        return S.Flora(**v)

    groups = kw.get("effective_param_groups")
    if not groups:
        return make(ctor)
    out = []
    for g in groups:
        values = dict(ctor)
        extra = sorted(set(g) - set(_ORIGINAL_FIELDS) - {"params"})
        if extra:
            raise HyperparameterError(f"unknown flora_opt.Flora param group key(s) {extra}")
        values.update({k: g[k] for k in _ORIGINAL_FIELDS if k in g})
        out.append((g["params"], make(values)))
    return ParamGroups.of(out)


def to_kwargs(h: S.Flora | ParamGroups) -> dict[str, Any]:
    hs = all_hps(h)
    if len(hs) > 1:
        raise HyperparameterError("flora_opt.Flora run live takes one flat parameter list "
                                  "here; these hyperparameters have several param groups")
    one = hs[0]
    if not one.project:
        raise HyperparameterError("flora_opt.Flora cannot express project=False")
    out = {k: getattr(one, k) for k in _ORIGINAL_FIELDS}
    out["seed"] = one.seed
    return out


def inject(trace: Any, t: int, hp: Any) -> dict[str, dict[str, Any]] | None:
    """The original's projections at update ``t`` from a trace's aux: ``{param:
    {"proj_before": P, "proj_after": P'}}`` for every compressed parameter."""
    aux = trace.aux(t)
    out = {}
    for name in trace.params:
        if f"{name}/proj_before" in aux:
            out[name] = {"proj_before": aux[f"{name}/proj_before"],
                         "proj_after": aux[f"{name}/proj_after"]}
    return out or None


_F32 = ("one float32 update: mean/rsqrt of the factored second moment, the norms in the "
        "parameter and update RMS and the rank-r matmuls round differently across "
        "NumPy/torch/XLA by a few ulp; 1e-6 relative to the tensor's largest element")
TOLERANCES = {
    "bitwise": Tolerance(0.0, 0.0, "same operations in the same order on the same machine"),
    "teacher_forced": Tolerance(1e-6, 0.0, _F32),
    "closed_loop": Tolerance(
        1e-4, 0.0,
        "per-step float32 rounding (~1e-7) compounds over 25 steps through the momentum and "
        "the parameter-RMS learning-rate scale; 1e-4 bounds it with margin"),
}


PARITY = MethodParity(
    method="flora",
    originals={
        "flora_opt.Flora": Original(
            name="flora_opt.Flora", backend="torch", factory="flora_opt:Flora",
            naming=S.STATE.namings["flora_opt"], preset="", to_kwargs=to_kwargs,
            from_kwargs=from_kwargs, requires=("flora_opt", "bitsandbytes", "accelerate"),
        ),
    },
    tolerances=TOLERANCES,
    inject=inject,
)
