"""COAP in the parity harness: the authors' CoapAdamW/CoapAdafactor, their P, the tolerances.

The golden traces were recorded from coap_torch. At the events that decompose (the first
update and every Eqn-7 one) the harness injects the authors' ``P`` (:func:`inject`): QR/SVD
signs and torch's generator are not portable. Eqn 6 is always computed by xopt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from xopt.errors import HyperparameterError
from xopt.parity.methods import MethodParity, Original, Tolerance
from xopt.specs import Naming, ParamGroups, hp_for
from xopt.specs import coap as S

#: coap_torch: optimizer.state[p] (the projector object's ortho_matrix as recorded)
AUTHORS_NAMING = Naming(
    keys={"step": "{param}/step", "m": "{param}/exp_avg", "v": "{param}/exp_avg_sq",
          "v_row": "{param}/exp_avg_sq_row", "v_col": "{param}/exp_avg_sq_col",
          "rms": "{param}/RMS", "P": "{param}/projector/ortho_matrix",
          "P_in": "{param}/projector/ortho_matrix_in",
          "P_grad": "{param}/projector/ortho_matrix_grad",
          "P_in_grad": "{param}/projector/ortho_matrix_in_grad",
          "m_q": "{param}/exp_avg/codes",
          "m_absmax": "{param}/exp_avg/absmax", "v_q": "{param}/exp_avg_sq/codes",
          "v_absmax": "{param}/exp_avg_sq/absmax"},
    dtypes={"step": "int64"},
    doc="coap_torch.CoapAdamW / CoapAdamW8bit / CoapAdafactor: optimizer.state[param][key]; "
        "P is state['projector'].ortho_matrix (a kernel's TuckerCOAP factors [U0, U1] as "
        "ortho_matrix and ortho_matrix_in, their .grad as ortho_matrix_grad and "
        "ortho_matrix_in_grad, zero where None); bitsandbytes' (codes, QuantState) moments as "
        "<moment>/codes and <moment>/absmax (tools/record_coap_conv.py)",
)

_CLASSES = {"CoapAdamW": "adamw", "CoapAdafactor": "adafactor", "CoapAdamW8bit": "adamw"}
# the original's argument -> xopt field (None: handled separately or ignored)
_ARGS = {
    "lr": "lr", "weight_decay": "weight_decay", "correct_bias": "correct_bias",
    "clip_threshold": "clip_threshold", "decay_rate": "decay_rate", "beta1": "b1",
    "scale_parameter": "scale_parameter", "relative_step": "relative_step",
    "warmup_init": "warmup_init", "rank": "rank", "rank_ratio_matrix": "rank_ratio",
    "update_interval": "update_interval", "reproject_factor": "reproject_factor",
    "restore_state": "restore_state", "scale": "scale",
    "rank_ratio_cnn": "rank_ratio_cnn",
    "betas": None, "eps": None, "proj_method": None, "dim": None,
    "bitsandbytes_kernel": None,
    "no_deprecation_warning": None, "params": None,
}


def _values(variant: str, kw: Mapping[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(kw) - set(_ARGS))
    if unknown:
        raise HyperparameterError(f"{where}: unknown argument(s) {', '.join(map(repr, unknown))}"
                                  f"; known: {', '.join(sorted(_ARGS))}")
    out: dict[str, Any] = {}
    for k, v in kw.items():
        if _ARGS[k] is not None:
            out[_ARGS[k]] = tuple(v) if isinstance(v, list) else v
    if "betas" in kw:
        out["b1"], out["b2"] = (float(b) for b in kw["betas"])
    if "eps" in kw:
        if variant == "adamw":
            out["eps"] = kw["eps"]
        else:
            out["eps_sq"], out["eps_scale"] = (float(e) for e in kw["eps"])
    return out


def from_kwargs(kw: Mapping[str, Any]) -> S.COAP | ParamGroups:
    """The manifest's hyperparameters (``optimizer_class``, ``constructor``, and the groups
    that ``setup_params`` made, ``effective_param_groups``) -> COAP or ParamGroups."""
    cls = kw.get("optimizer_class")
    if cls not in _CLASSES:
        raise HyperparameterError(f"optimizer_class {cls!r}: expected one of {sorted(_CLASSES)}")
    variant = _CLASSES[cls]
    extra = sorted(set(kw) - {"optimizer_class", "constructor", "param_groups",
                              "effective_param_groups", "bitsandbytes_kernel"})
    if extra:
        raise HyperparameterError(f"unknown hyperparameter entries {extra}")
    ctor = dict(kw.get("constructor", {}))
    base = dict(S.PRESETS[variant])
    base.update(_values(variant, ctor, cls))
    if cls == "CoapAdamW8bit":
        # which bitsandbytes kernel quantised the recording (they pick different codes)
        base.update(state_bits=8, quant_rounding=kw.get("bitsandbytes_kernel", "cuda"))
    if ctor.get("proj_method", "coap") not in ("coap", None):
        raise HyperparameterError(f"{cls}: proj_method {ctor['proj_method']!r} is not 'coap'")
    groups = kw.get("effective_param_groups")
    if not groups:
        if ctor.get("proj_method", "coap") is None:
            base["project"] = False
        return S.COAP(**base)
    out = []
    for i, g in enumerate(groups):
        names = list(g.get("params", []))
        if not names:
            continue
        values = dict(base)
        values.update(_values(variant, g, f"{cls} effective_param_groups[{i}]"))
        # setup_params put only kernels above MIN_CNN_PARAMS into the projected 4-D group
        values["project"] = "proj_method" in g and g["proj_method"] is not None
        if values["project"] and g.get("dim") == 4 and values.get("rank_ratio_cnn") is None:
            raise HyperparameterError(
                f"{cls}: effective_param_groups[{i}] projects 4-D parameters {names} with "
                "TuckerCOAP but rank_ratio_cnn is None, where the authors' code fails")
        out.append((names, S.COAP(**values)))
    return ParamGroups.of(out)


def to_kwargs(h: S.COAP | ParamGroups) -> dict[str, Any]:
    if isinstance(h, ParamGroups):
        raise HyperparameterError("coap_torch is driven here with one flat parameter list; "
                                  "per-group settings cannot be handed to it")
    if h.project is True:
        raise HyperparameterError("coap_torch applies its own rule for which matrices are "
                                  "projected; project=True cannot be expressed")
    kw: dict[str, Any] = dict(lr=h.lr, weight_decay=h.weight_decay,
                              proj_method=None if h.project is False else "coap", rank=h.rank,
                              rank_ratio_matrix=h.rank_ratio,
                              update_interval=h.update_interval,
                              reproject_factor=h.reproject_factor,
                              restore_state=h.restore_state, scale=h.scale,
                              rank_ratio_cnn=h.rank_ratio_cnn)
    if h.min_conv_size != S.COAP().min_conv_size:
        raise HyperparameterError("coap_torch hard-codes min_conv_size (MIN_CNN_PARAMS)")
    if h.proj_lr != 0.1 or h.proj_max_norm != 1.0 or h.seed != 3407:
        raise HyperparameterError("coap_torch hard-codes proj_lr 0.1, proj_max_norm 1 and "
                                  "seed 3407")
    if h.optimizer == "adamw":
        kw.update(betas=(h.b1, h.b2), eps=h.eps, correct_bias=h.correct_bias)
    else:
        kw.update(beta1=h.b1, eps=(h.eps_sq, h.eps_scale), clip_threshold=h.clip_threshold,
                  decay_rate=h.decay_rate, scale_parameter=h.scale_parameter,
                  relative_step=h.relative_step, warmup_init=h.warmup_init)
        if h.relative_step:
            kw["lr"] = None
    return kw


def inject(trace: Any, t: int, hp: S.COAP | ParamGroups) -> dict[str, dict[str, Any]] | None:
    """The original's ``P`` at events 1 and 3 (its QR/SVD signs and torch's generator are
    not portable): ``{param: {"ortho_matrix": state/<param>/projector/ortho_matrix}}``."""
    out: dict[str, dict[str, Any]] = {}
    recorded = None
    for name, shape in trace.params.items():
        h = hp_for(hp, name)
        if S.is_projected(tuple(shape), h) and S.event(t, h) in (S.INITIAL, S.EQN7):
            recorded = trace.state_after(t) if recorded is None else recorded
            out[name] = {"ortho_matrix": recorded[f"{name}/projector/ortho_matrix"]}
            if f"{name}/projector/ortho_matrix_in" in recorded:  # a Tucker-2 kernel
                out[name]["ortho_matrix_in"] = recorded[f"{name}/projector/ortho_matrix_in"]
    return out or None


# -- tolerances --------------------------------------------------------------------------------

TOLERANCES = {
    "bitwise": Tolerance(0.0, 0.0, "same operations in the same order on the same machine"),
    "teacher_forced": Tolerance(
        1e-6, 0.0,
        "one float32 update: the projections and the Adam/Adafactor arithmetic round a few "
        "operations differently (matmul summation order, fused vs written-out multiply-adds); "
        "measured ≤ 4.6e-7 over the bundled traces (torch 2.8e-7, jax 4.6e-7, oracle 4.3e-7). "
        "Eqn 6's closed-form gradient lies within 9.8e-7 of the recorded float32 autograd, "
        "which moves P by ≤ 1e-10 (the step is 0.1 × a gradient of norm ≤ 6e-3)",
    ),
    "closed_loop": Tolerance(
        1e-4, 0.0,
        "per-update rounding (~1e-7) carried over 12-25 updates through the moments and P; "
        "measured ≤ 5.9e-7 on the bundled traces. The bound leaves room for AdamW's "
        "restore_state, whose ((√V P_old) P_newᵀ)² can put near-zero entries under "
        "m/(√v + ε) and amplify rounding (tests/test_coap.py)",
    ),
}


PARITY = MethodParity(
    method="coap",
    originals={
        name: Original(
            name=name, backend="torch", factory=f"coap_torch:{name.split('.')[1]}",
            naming=AUTHORS_NAMING, preset=variant, to_kwargs=to_kwargs,
            from_kwargs=from_kwargs, requires=("coap_torch",),
        )
        for name, variant in (("coap_torch.CoapAdamW", "adamw"),
                              ("coap_torch.CoapAdamW8bit", "adamw"),
                              ("coap_torch.CoapAdafactor", "adafactor"))
    },
    tolerances=TOLERANCES,
    inject=inject,
)
