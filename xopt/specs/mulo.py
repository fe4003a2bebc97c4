"""μLO: small_fc_lopt under the maximal-update parameterisation (μP).

The learned optimizer of Thérien et al., "μLO: Compute-Efficient Meta-Generalization of
Learned Optimizers" (arXiv 2406.00153), as its original code defines it:
``mu_learned_optimization/src/mup_adafac_mlp_lopt.py`` (``MuAdafacMLPLOpt``), shipped by
PyLO as ``MuLO``. It is :mod:`xopt.specs.small_fc_lopt` (``AdafacMLPLOpt``: the same
accumulators, 39 features, MLP and θ layout) with three differences, in this order within
an update:

1. ``clip_grad``: the gradients are clipped to global norm 1 (``optax.clip_by_global_norm
   (1.0)``): with ``‖g‖ = sqrt(Σ_tensors Σ g²)``, ``g ← g`` if ``‖g‖ < 1`` else
   ``(g / ‖g‖) · 1``;
2. non-finite gradient entries are replaced (``jnp.nan_to_num``): NaN → 0, ±inf → the
   largest finite float32 of that sign. (The original's gradients are float32; the float64
   oracle uses the float32 limits too, so that it describes the original);
3. each tensor's step is multiplied by its **μP multiplier** ``s`` before it is applied:
   ``p ← p − step · s`` (then xopt's ``lr``: ``p − lr·(step · s)``; lr = 1 is the original
   bit for bit).

The multipliers come from the parameter's role in the model (μLO's ``MuMLP``, and its
transformer and ViT, set them per layer; :func:`mup_lr` is the rule):

======================  ===================================
role                    multiplier ``s``
======================  ===================================
``"input"``             1 (the first layer's weights)
``"hidden"``            ``hidden_lr_mult / fan_in`` (weights whose both dimensions grow
                        with the width)
``"output"``            1 (the readout's weights)
``"vector"``            1 (biases, gains: every bias of μLO's models)
======================  ===================================

The rest of μP lives in the model, not in the optimizer: the input layer's output times
``input_mult``, the readout's output times ``output_mult / fan_in``, zero-initialised
readout weights and fan-in-scaled hidden initialisations (``MuMLP``). The backends take the
multipliers per parameter: torch as a param group's ``"mup_lr"`` (helpers read a model's
layers), JAX as a pytree of multipliers or a function of the params (as optax's
``multi_transform`` takes labels); see :mod:`xopt.torch.mulo` and :mod:`xopt.jax.mulo`.

In the spec and the harness, parameters are known by name: ``hp`` is a :class:`MuLO` (one
multiplier, ``mup_lr``, for every parameter) or a :class:`~xopt.specs.ParamGroups` of them
that differ in ``mup_lr`` only (the MLP, its decays and the wrappers are shared by every
parameter).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

import numpy as np

from xopt.errors import HyperparameterError
from xopt.specs import arrays, lopt
from xopt.specs import small_fc_lopt as sf
from xopt.specs._groups import ParamGroups
from xopt.specs._hyperparams import Interval, hp
from xopt.specs._method import MetaParams, MethodSpec
from xopt.specs._state import Naming, StateSchema

# -- hyperparameters -----------------------------------------------------------------------

_POSITIVE = Interval(0.0, None, lo_closed=False)


@dataclasses.dataclass(frozen=True)
class MuLO(sf.SmallFCLOpt):
    """``MuAdafacMLPLOpt``'s hyperparameters, with its constructor's defaults
    (mup_adafac_mlp_lopt.py, ``MuAdafacMLPLOpt.__init__``: AdafacMLPLOpt's, plus
    ``clip_grad``), and the μP multiplier ``mup_lr`` of the parameters it applies to.

    The constructor's ``mup_lrs`` argument is stored and never read by the original (the
    update reads ``model_state['mup_lrs_to_use']``); xopt takes the multipliers per
    parameter instead (module docstring)."""

    METHOD = "mulo"

    clip_grad: bool = hp(False, doc="clip the gradients to global norm 1 before the update")
    mup_lr: float = hp(1.0, doc="μP multiplier of the step (per parameter: mup_lr(role, ...))",
                       interval=_POSITIVE)


PRESETS: dict[str, dict[str, Any]] = {
    # mup_adafac_mlp_lopt.py, MuAdafacMLPLOpt.__init__ defaults.
    "original": dict(sf.PRESETS["original"], clip_grad=False),
    # μLO as meta-trained and released: meta_trainers.py builds MuAdafacMLPLOpt with
    # hidden_layers 2 and the default decays, the README trains with --adafac_step_mult 0.01
    # and hidden size 32 (PyLO's MuLO: hidden_size 32, one hidden layer in its counting).
    "mulo": dict(sf.PRESETS["original"], step_mult=0.01, hidden_size=32, clip_grad=False),
}

#: the parameter roles :func:`mup_lr` knows
ROLES = ("input", "hidden", "output", "vector")


def mup_lr(role: str, fan_in: int | None = None, hidden_lr_mult: float = 1.0) -> float:
    """The μP multiplier of a parameter's step from its role (module docstring's table):
    ``hidden_lr_mult / fan_in`` for ``"hidden"`` weights, 1 for the other roles. ``fan_in``
    is the number of inputs of one output unit (a torch ``Linear``'s ``in_features``, a
    flax ``Dense`` kernel's ``shape[0]``; a convolution's in-channels times its window).
    Bad input names the argument."""
    if role not in ROLES:
        raise HyperparameterError(f"μP role {role!r}: expected one of {', '.join(ROLES)}")
    mult = float(hidden_lr_mult)
    if not (np.isfinite(mult) and mult > 0):
        raise HyperparameterError(f"hidden_lr_mult = {hidden_lr_mult!r}: must be a positive "
                                  "finite number")
    if role != "hidden":
        return 1.0
    if fan_in is None or isinstance(fan_in, bool) or int(fan_in) != fan_in or fan_in < 1:
        raise HyperparameterError(f"μP role 'hidden' needs fan_in, a positive integer; got "
                                  f"{fan_in!r}")
    return mult / int(fan_in)


def settings(hp: MuLO | ParamGroups) -> tuple[MuLO, Callable[[str], float]]:
    """``(shared hyperparameters, name -> mup_lr)`` of ``hp``. A :class:`ParamGroups` whose
    groups differ in anything but ``mup_lr`` is an error naming the field."""
    if not isinstance(hp, ParamGroups):
        return hp, lambda name: hp.mup_lr
    base = hp.first
    for h in hp.distinct():
        for f in dataclasses.fields(base):
            if f.name != "mup_lr" and getattr(h, f.name) != getattr(base, f.name):
                raise HyperparameterError(
                    f"μLO param groups differ in {f.name!r} ({getattr(base, f.name)!r} vs "
                    f"{getattr(h, f.name)!r}): groups may differ in mup_lr only (one learned "
                    "optimizer serves every parameter)")
    return base, lambda name: hp.hp_of(name).mup_lr


# -- meta-parameters: small_fc_lopt's (θ is the same pytree in MuAdafacMLPLOpt) ---------------


META = MetaParams(
    shapes=lambda hp: sf.meta_shapes(settings(hp)[0]),
    from_original=lambda theta, hp: sf.meta_from_original(theta, settings(hp)[0]),
    to_original=lambda theta, hp: sf.meta_to_original(theta, settings(hp)[0]),
    init=lambda hp, seed=0, **kw: sf.meta_init(settings(hp)[0], seed, **kw),
    coerce=lambda theta, hp: sf.coerce_meta(theta, settings(hp)[0]),
)


# -- the math ------------------------------------------------------------------------------

#: the largest finite float32, what ``jnp.nan_to_num`` puts for +inf in the original
F32_MAX = float(np.finfo(np.float32).max)


def global_norm(xp: ModuleType, grads: Iterable[Any]) -> Any:
    """``sqrt(Σ_tensors Σ g²)`` (optax's ``tree.norm``: a sum over the tensors, in order, of
    each tensor's sum of squares)."""
    total: Any = 0
    for g in grads:
        total = total + xp.sum(xp.square(g))
    return xp.sqrt(total)


def nan_to_num(xp: ModuleType, g: Any) -> Any:
    """``jnp.nan_to_num`` of a float32 gradient: NaN → 0, ±inf → ±:data:`F32_MAX` (the
    float32 limits in every dtype; see the module docstring)."""
    g = xp.where(xp.isnan(g), xp.zeros_like(g), g)
    return arrays.clip(xp, g, -F32_MAX, F32_MAX)


def prepare_grad(xp: ModuleType, g: Any, norm: Any = None) -> Any:
    """The gradient the learned optimizer reads: with ``norm`` (the :func:`global_norm` of
    all gradients, given when ``clip_grad``) ``optax.clip_by_global_norm(1.0)``'s ``g`` if
    ``norm < 1`` else ``(g / norm) · 1`` (a NaN norm takes the second branch), then
    :func:`nan_to_num`."""
    if norm is not None:
        g = xp.where(norm < 1.0, g, (g / norm) * 1.0)
    return nan_to_num(xp, g)


def scale_step(step: Any, mult: float) -> Any:
    """``step · s`` (the original's ``step * mup_lr_scale``); ``s = 1`` returns ``step``
    unchanged (a product by 1 is exact)."""
    return step if mult == 1.0 else step * mult


# -- the whole optimizer as a pure function (the oracle's definition) ----------------------


def init_state(hp: MuLO | ParamGroups, params: Mapping[str, Any], *, xp: ModuleType = np,
               dtype: Any = None, meta: Any = None) -> dict[str, Any]:
    """small_fc_lopt's state (:func:`xopt.specs.small_fc_lopt.init_state`)."""
    return sf.init_state(settings(hp)[0], params, xp=xp, dtype=dtype, meta=meta)


def step(hp: MuLO | ParamGroups, params: Mapping[str, Any], state: Mapping[str, Any],
         grads: Mapping[str, Any], *, xp: ModuleType = np, loss: Any = None,
         meta: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """All parameters' update, ``(params, state) -> (params, state)``, pure, on canonical
    dicts (small_fc_lopt's state), with prefab's weight decay and accumulation
    (:func:`xopt.specs.lopt.outer_step`). ``meta``: θ in either naming; None uses
    ``meta_init(hp, 0)``."""
    base, mult_of = settings(hp)
    theta = sf.coerce_meta(meta if meta is not None else sf.meta_init(base, 0), base)
    names = list(params)
    dtype = state[f"m/{names[0]}"].dtype if names else np.float32
    theta = {k: _as_xp(xp, v, dtype) for k, v in theta.items()}
    decays_ = sf.decays(base, theta, xp=xp)

    def inner(g: dict[str, Any], loss_: Any, st: dict[str, Any]):
        del loss_
        tf = sf.time_features(xp, st["iteration"], theta["mlp/b0"])
        norm = global_norm(xp, (g[k] for k in names)) if base.clip_grad and names else None
        steps = {}
        for k in names:
            gk = prepare_grad(xp, g[k], norm)
            p = _as_xp(xp, params[k], dtype)
            s, accs = sf.compute_step(base, p, gk, *(st[f"{v}/{k}"] for v in sf.PARAM_VARS),
                                      tf, theta, decays_, xp=xp)
            for v, a in zip(sf.PARAM_VARS, accs, strict=True):
                st[f"{v}/{k}"] = a
            steps[k] = scale_step(s, mult_of(k))
        st["mom_t"] = st["mom_t"] + 1
        st["rms_t"] = st["rms_t"] + 1
        return steps, st

    return lopt.outer_step(base, params, state, grads, xp=xp, loss=loss, inner=inner)


def _as_xp(xp: ModuleType, x: Any, dtype: Any) -> Any:
    if arrays.is_torch(xp):
        return xp.as_tensor(x).to(dtype)
    return xp.asarray(x, dtype=dtype)


# -- state schema: small_fc_lopt's, under xopt.torch.MuLO / xopt.jax.mulo ---------------------

STATE = StateSchema(
    vars=sf.STATE.vars,
    namings={
        "xopt.torch": Naming(keys=sf.STATE.namings["xopt.torch"].keys,
                             dtypes=sf.STATE.namings["xopt.torch"].dtypes,
                             doc="xopt.torch.MuLO: optimizer.state[param][var] and "
                                 "optimizer.state['global'][var] (small_fc_lopt's layout)"),
        "xopt.jax": Naming(keys=sf.STATE.namings["xopt.jax"].keys,
                           dtypes=sf.STATE.namings["xopt.jax"].dtypes,
                           doc="xopt.jax.mulo's LOptState (small_fc_lopt's layout) flattened "
                               "with xopt.parity.runners.flatten_with_paths"),
    },
)


SPEC = MethodSpec(
    name="mulo",
    title="μLO: small_fc_lopt under the maximal-update parameterisation (μLO's "
          "MuAdafacMLPLOpt; PyLO's MuLO)",
    hyperparams=MuLO,
    presets=PRESETS,
    state=STATE,
    init_state=init_state,
    step=step,
    naming_of={"torch": "xopt.torch", "jax": "xopt.jax"},
    takes_loss=True,
    impls=("plain",),
    meta=META,
)
