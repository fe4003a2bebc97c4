"""AdamW in the parity harness: torch.optim.AdamW and optax.adamw, and the tolerances.

xopt.torch.AdamW keeps torch.optim's state layout (the spec's ``"torch.optim"`` naming), so
the torch original is read with it; optax.adamw's chain has its own (:data:`OPTAX_NAMING`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from xopt.errors import HyperparameterError
from xopt.parity.methods import MethodParity, Original, Tolerance
from xopt.specs import Naming
from xopt.specs import adamw as S

#: optax.adamw = chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate).
OPTAX_NAMING = Naming(
    keys={"step": "0/count", "m": "0/mu/{param}", "v": "0/nu/{param}",
          "v_max": "0/nu_max/{param}"},
    dtypes={"step": "int32"},
    doc="optax.adamw's state: a tuple whose first element is ScaleByAdamState",
)


def torch_kwargs(h: S.AdamW) -> dict[str, Any]:
    if h.eps_root != 0 or h.nesterov or h.bias_correction_dtype != "float64":
        raise HyperparameterError(
            "torch.optim.AdamW cannot express eps_root != 0, nesterov=True or "
            "bias_correction_dtype='float32'"
        )
    return dict(lr=h.lr, betas=(h.b1, h.b2), eps=h.eps, weight_decay=h.weight_decay,
                amsgrad=h.amsgrad, maximize=h.maximize)


def from_torch_kwargs(kw: Mapping[str, Any]) -> S.AdamW:
    known = {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
             "capturable", "differentiable", "fused"}
    unknown = sorted(set(kw) - known)
    if unknown:
        raise HyperparameterError(
            f"unknown torch.optim.AdamW argument(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(known))}"
        )
    values = dict(S.PRESETS["torch"])
    betas = kw.get("betas", (values["b1"], values["b2"]))
    values.update(b1=float(betas[0]), b2=float(betas[1]))
    for src, dst in (("lr", "lr"), ("eps", "eps"), ("weight_decay", "weight_decay"),
                     ("amsgrad", "amsgrad"), ("maximize", "maximize")):
        if src in kw:
            values[dst] = kw[src]
    return S.AdamW(**values)


def optax_kwargs(h: S.AdamW) -> dict[str, Any]:
    if h.amsgrad or h.maximize or h.bias_correction_dtype != "float32":
        raise HyperparameterError(
            "optax.adamw cannot express amsgrad=True, maximize=True or "
            "bias_correction_dtype='float64'"
        )
    return dict(learning_rate=h.lr, b1=h.b1, b2=h.b2, eps=h.eps, eps_root=h.eps_root,
                weight_decay=h.weight_decay, nesterov=h.nesterov)


def from_optax_kwargs(kw: Mapping[str, Any]) -> S.AdamW:
    known = {"learning_rate", "b1", "b2", "eps", "eps_root", "weight_decay", "nesterov",
             "mu_dtype", "mask"}
    unknown = sorted(set(kw) - known)
    if unknown:
        raise HyperparameterError(
            f"unknown optax.adamw argument(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(known))}"
        )
    if "learning_rate" not in kw:
        raise HyperparameterError("optax.adamw: 'learning_rate' is required")
    if kw.get("mu_dtype") is not None or kw.get("mask") is not None:
        raise HyperparameterError("optax.adamw: mu_dtype and mask are not supported by xopt yet")
    values = dict(S.PRESETS["optax"])
    values["lr"] = kw["learning_rate"]
    for name in ("b1", "b2", "eps", "eps_root", "weight_decay", "nesterov"):
        if name in kw:
            values[name] = kw[name]
    return S.AdamW(**values)


# -- tolerances ----------------------------------------------------------------------------

_F32_STEP = (
    "one float32 step: the two arithmetics round a handful of operations differently, "
    "each within half an ulp (6e-8 relative); 1e-6 relative to the tensor's largest "
    "element leaves a factor of ~2 over the worst case of 8 roundings"
)
TOLERANCES = {
    "bitwise": Tolerance(0.0, 0.0, "same operations in the same order on the same machine"),
    "teacher_forced": Tolerance(1e-6, 0.0, _F32_STEP),
    "closed_loop": Tolerance(
        1e-5, 0.0,
        "errors of ~1e-7 per step accumulate over the trace's steps (at most 50); Adam's "
        "normalised step does not amplify them, so 1e-5 bounds 50 steps of the per-step bound",
    ),
}


PARITY = MethodParity(
    method="adamw",
    originals={
        "torch.optim.AdamW": Original(
            name="torch.optim.AdamW", backend="torch", factory="torch.optim:AdamW",
            naming=S.STATE.namings["torch.optim"], preset="torch", to_kwargs=torch_kwargs,
            from_kwargs=from_torch_kwargs, requires=("torch",),
        ),
        "optax.adamw": Original(
            name="optax.adamw", backend="jax", factory="optax:adamw", naming=OPTAX_NAMING,
            preset="optax", to_kwargs=optax_kwargs, from_kwargs=from_optax_kwargs,
            requires=("jax", "optax"),
        ),
    },
    tolerances=TOLERANCES,
    bitwise=lambda hp: frozenset(
        {("torch", "torch.optim.AdamW")} if hp.formula == "torch" else {("jax", "optax.adamw")}
    ),
)
