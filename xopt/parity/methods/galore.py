"""GaLore in the parity harness: the authors' GaLoreAdamW, its projections, the tolerances.

The golden traces were recorded from galore_torch (jiaweizzhao/GaLore). At every refresh
the harness injects the authors' projection (:func:`inject`): the SVD's singular-vector
signs are their LAPACK's, which no other SVD reproduces reliably, and the moments carry
across refreshes unrotated, so a sign flip would show in every later update.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from xopt.errors import HyperparameterError
from xopt.parity.methods import MethodParity, Original, Tolerance
from xopt.specs import Naming, ParamGroups, hp_for
from xopt.specs import galore as S

#: galore_torch.GaLoreAdamW's optimizer.state[p] as the golden traces record it: an int
#: step, exp_avg/exp_avg_sq, and the GaLoreProjector object's ortho_matrix (for 'full' the
#: authors keep a list [U_r, Vh_r]; no trace records one, and its second element is read
#: here as ortho_matrix_right).
AUTHORS_NAMING = Naming(
    keys={"step": "{param}/step", "m": "{param}/exp_avg", "v": "{param}/exp_avg_sq",
          "ortho": "{param}/projector/ortho_matrix",
          "ortho_right": "{param}/projector/ortho_matrix_right"},
    dtypes={"step": "int64"},
    doc="galore_torch.GaLoreAdamW: optimizer.state[param] (projector flattened)")

_CTOR_KEYS = {"lr", "betas", "eps", "weight_decay", "correct_bias", "no_deprecation_warning"}
_GROUP_KEYS = {"params", "lr", "betas", "eps", "weight_decay", "correct_bias", "dim", "rank",
               "update_proj_gap", "scale", "proj_type"}


def _authors_values(kw: Mapping[str, Any], where: str) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if "betas" in kw:
        b = kw["betas"]
        if not isinstance(b, (list, tuple)) or len(b) != 2:
            raise HyperparameterError(f"{where}: betas = {b!r} must be a pair")
        values.update(b1=float(b[0]), b2=float(b[1]))
    for k in ("lr", "eps", "weight_decay", "correct_bias", "rank", "update_proj_gap", "scale",
              "proj_type"):
        if k in kw:
            values[k] = kw[k]
    if kw.get("dim", 2) != 2:
        raise HyperparameterError(
            f"{where}: dim = {kw['dim']!r}: the authors' tensor projector (GaLoreProjectorTensor, "
            "dim > 2) is not implemented by xopt")
    return values


def from_authors_kwargs(kw: Mapping[str, Any]) -> S.GaLore | ParamGroups:
    """GaLoreAdamW's arguments (a trace manifest's ``hyperparameters``, or the constructor's
    keywords) -> a GaLore or, with param groups, a ParamGroups. A group without ``"rank"``
    is not projected (``project=False``), as in the authors' ``step``."""
    kw = dict(kw)
    cls = kw.pop("optimizer_class", "GaLoreAdamW")
    if cls != "GaLoreAdamW":
        raise HyperparameterError(f"galore: optimizer_class {cls!r}: only GaLoreAdamW is "
                                  "implemented (not the Adafactor or 8-bit variants)")
    effective = kw.pop("effective_param_groups", None)
    groups = kw.pop("param_groups", None)
    ctor = dict(kw.pop("constructor", {}))
    ctor.update({k: kw.pop(k) for k in list(kw) if k in _CTOR_KEYS})
    if kw:
        raise HyperparameterError(
            f"unknown GaLoreAdamW argument(s) {', '.join(map(repr, sorted(kw)))}")
    bad = sorted(set(ctor) - _CTOR_KEYS)
    if bad:
        raise HyperparameterError(f"unknown GaLoreAdamW argument(s) {', '.join(map(repr, bad))}; "
                                  f"known: {', '.join(sorted(_CTOR_KEYS))}")
    base = dict(S.PRESETS["authors"])
    base.update(_authors_values(ctor, "GaLoreAdamW"))
    if effective is None and groups is None:
        return S.GaLore(**{**base, "project": False})
    out = []
    for i, g in enumerate(effective if effective is not None else groups):
        where = f"GaLoreAdamW param_groups[{i}]"
        bad = sorted(set(g) - _GROUP_KEYS)
        if bad:
            raise HyperparameterError(f"{where}: unknown key(s) {', '.join(map(repr, bad))}")
        values = {**base, **_authors_values(g, where), "project": "rank" in g}
        out.append((list(g["params"]), S.GaLore(**values)))
    return ParamGroups.of(out)


def to_authors_kwargs(h: Any) -> dict[str, Any]:
    raise HyperparameterError(
        "galore_torch.GaLoreAdamW projects only param groups that carry 'rank', and the "
        "harness's torch runner hands an original one flat parameter list; compare against "
        "the golden traces recorded from it instead")


def inject(trace: Any, t: int, hp: S.GaLore | ParamGroups) -> dict[str, dict[str, Any]] | None:
    """The authors' projection at update ``t``, for the parameters it refreshed there.

    Refreshes are read from the trace's aux ``<param>/proj_refreshed`` (else from the rule
    :func:`xopt.specs.galore.refresh_due` with the recorded step); the value injected is
    the recorded ``state/<param>/projector/ortho_matrix`` after update ``t``: the SVD's
    factor as the original's LAPACK signed it, which no other SVD reproduces reliably.
    """
    aux = trace.aux(t)
    after = trace.state_after(t)
    before = trace.state_after(t - 1) if t > 0 else {}
    out: dict[str, dict[str, Any]] = {}
    for name, shape in trace.params.items():
        h = hp_for(hp, name)
        key = f"{name}/projector/ortho_matrix"
        if not S.is_projected(tuple(shape), h) or key not in after:
            continue
        flag = aux.get(f"{name}/proj_refreshed")
        if flag is None:
            prev = int(before.get(f"{name}/step", 0)) if t > 0 else 0
            refreshed = S.refresh_due(prev, h)
        else:
            refreshed = bool(np.asarray(flag))
        if refreshed:
            out[name] = {"ortho_matrix": np.asarray(after[key])}
            right = f"{name}/projector/ortho_matrix_right"
            if right in after:
                out[name]["ortho_matrix_right"] = np.asarray(after[right])
    return out or None


# -- tolerances ----------------------------------------------------------------------------

TOLERANCES = {
    "bitwise": Tolerance(0.0, 0.0, "same operations in the same order on the same machine"),
    "teacher_forced": Tolerance(
        1e-6, 0.0,
        "one float32 update: two matmuls of length <= max(m, n) (projection and back) and a "
        "handful of elementwise Adam operations, each rounded within half an ulp; summation "
        "order differs between BLAS/XLA kernels. The projection at refresh steps is the "
        "original's, injected (singular-vector signs are not portable)"),
    "closed_loop": Tolerance(
        1e-4, 0.0,
        "the per-update rounding (~1e-7) compounds over the trace's 12-25 updates through "
        "the moments and the parameters; the projection at each refresh is the original's, "
        "injected, so no sign flip can enter"),
}


PARITY = MethodParity(
    method="galore",
    originals={
        "galore_torch.GaLoreAdamW": Original(
            name="galore_torch.GaLoreAdamW", backend="torch",
            factory="galore_torch:GaLoreAdamW", naming=AUTHORS_NAMING, preset="authors",
            to_kwargs=to_authors_kwargs, from_kwargs=from_authors_kwargs,
            requires=("galore_torch", "transformers", "torch")),
    },
    tolerances=TOLERANCES,
    inject=inject,
)
