"""Building blocks shared by the learned optimizers (small_fc_lopt and VeLO).

These are learned_optimization's ``learned_optimizers/common.py`` accumulators and the
feature helpers both ``AdafacMLPLOpt`` and ``HyperV2`` use, as pure functions on one tensor
at a time, written against the array namespace ``xp`` (NumPy, torch or jax.numpy; see
:mod:`xopt.specs.arrays`). Every accumulator keeps one slice per decay on a trailing axis of
length ``k`` (the original ``vmap`` s over decays with ``out_axes=-1``).

Shapes, for a parameter ``p`` of shape ``S`` (rank 0 to 4) and ``k`` decays:
  * momentum ``m``: ``S + (k,)``; second moment ``rms``: ``S + (k_rms,)``;
  * factored second moment (Adafactor style, :func:`factored_dims` not None):
    ``v_row``: ``S`` without axis ``d0``, plus ``(k,)``; ``v_col``: ``S`` without axis ``d1``,
    plus ``(k,)``; ``v_diag``: ``(0, k)`` (a placeholder, as the original stores it);
  * unfactored (rank < 2): ``v_diag``: ``S + (k,)``; ``v_row``, ``v_col``: ``(0, k)``.

All arithmetic is float32 in the backends (float64 in the oracle).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from xopt.specs import arrays

#: ``reparam_decay``: decays are learned as ``log(1 - decay) / 10`` (both originals)
REPARAM = 10.0


def factored_dims(shape: Sequence[int]) -> tuple[int, int] | None:
    """``(d1, d0)``: the axes of the second-largest and largest dims (ties: the later axis
    is larger, as ``numpy.argsort`` orders them), or None below rank 2.

    This is learned_optimization's rule in both ``common.py`` and ``hyper_v2.py``. PyLO's
    VeLO swaps the two axes for square matrices; that is one of its departures.
    """
    if len(shape) < 2:
        return None
    order = np.argsort(np.asarray(shape), kind="quicksort")
    return int(order[-2]), int(order[-1])


def factored_shapes(shape: Sequence[int], k: int) -> dict[str, tuple[int, ...]]:
    """Shapes of ``v_row``, ``v_col`` and ``v_diag`` for a parameter of ``shape``."""
    shape = tuple(int(s) for s in shape)
    f = factored_dims(shape)
    if f is None:
        return {"v_row": (0, k), "v_col": (0, k), "v_diag": shape + (k,)}
    d1, d0 = f
    return {
        "v_row": tuple(s for i, s in enumerate(shape) if i != d0) + (k,),
        "v_col": tuple(s for i, s in enumerate(shape) if i != d1) + (k,),
        "v_diag": (0, k),
    }


def decay_to_param(xp: ModuleType, x: Any) -> Any:
    return xp.log(1 - x) / REPARAM


def param_to_decay(xp: ModuleType, x: Any) -> Any:
    return 1 - xp.exp(x * REPARAM)


def effective_decays(xp: ModuleType, initial: Any, offset: Any | None) -> Any:
    """``param_to_decay(decay_to_param(initial) + offset)``; the initial decays when
    ``offset`` is None (VeLO never passes its θ offsets, so its decays are the initial
    values rounded to the working precision)."""
    if offset is None:
        return initial
    return param_to_decay(xp, decay_to_param(xp, initial) + offset)


def momentum_update(m: Any, g: Any, decays: Any) -> Any:
    """``m <- d*m + (1-d)*g`` per decay (``common.rolling_mom``; no clipping of ``d``).

    m: ``S + (k,)``; g: ``S``; decays: ``(k,)``.
    """
    return decays * m + (1 - decays) * g[..., None]


def rms_update(xp: ModuleType, rms: Any, g: Any, decays: Any) -> Any:
    """``v <- c*v + (1-c)*g²`` with ``c = clip(d, 0, 1)`` (``common.rolling_rms``)."""
    c = arrays.clip(xp, decays, 0.0, 1.0)
    return c * rms + (1 - c) * (g * g)[..., None]


def safe_rsqrt(xp: ModuleType, x: Any) -> Any:
    """``rsqrt(max(x, 1e-9))`` (``common.safe_rsqrt``)."""
    return arrays.rsqrt(xp, x.clamp_min(1e-9) if arrays.is_torch(xp) else xp.maximum(x, 1e-9))


def factored_update(xp: ModuleType, v_row: Any, v_col: Any, v_diag: Any, g: Any,
                    decays: Any) -> tuple[Any, Any, Any, Any]:
    """One step of ``common.factored_rolling`` (Adafactor-style accumulators), per decay.

    Returns ``(v_row, v_col, v_diag, fac_g)`` with ``fac_g`` (``S + (k,)``) the gradient
    preconditioned by the updated accumulators. The untouched placeholders come back as
    given.
    """
    c = arrays.clip(xp, decays, 0.0, 1.0)
    mix = 1.0 - c
    grad_sqr = g * g + 1e-30
    f = factored_dims(tuple(g.shape))
    if f is None:
        new_v = c * v_diag + mix * grad_sqr[..., None]
        y = g[..., None] * safe_rsqrt(xp, new_v + 1e-9)
        return v_row, v_col, new_v, y
    d1, d0 = f
    new_row = c * v_row + mix * arrays.mean(xp, grad_sqr, (d0,))[..., None]
    new_col = c * v_col + mix * arrays.mean(xp, grad_sqr, (d1,))[..., None]
    reduced_d1 = d1 - 1 if d1 > d0 else d1
    row_col_mean = arrays.mean(xp, new_row, (reduced_d1,), keepdims=True)
    row_factor = safe_rsqrt(xp, new_row / (row_col_mean + 1e-9))
    col_factor = safe_rsqrt(xp, new_col)
    y = (g[..., None] * arrays.expand_dims(xp, row_factor, d0)
         * arrays.expand_dims(xp, col_factor, d1))
    return new_row, new_col, v_diag, y


def second_moment_normalizer(xp: ModuleType, x: Any, axes: tuple[int, ...],
                             eps: float = 1e-5) -> Any:
    """``x * rsqrt(eps + mean(x², axes))`` (channels on the last axis are kept apart)."""
    return x * arrays.rsqrt(xp, eps + arrays.mean(xp, xp.square(x), axes, keepdims=True))


# == Shared by every learned optimizer: options, meta-parameter plumbing, the outer step =====
#
# (Appended section. Everything above is the per-tensor accumulator math; everything below
# is the bookkeeping that learned_optimization's ``research/general_lopt/prefab.py`` wraps
# around a learned optimizer, and the handling of meta-parameters, which small_fc_lopt and
# VeLO share.)

import dataclasses  # noqa: E402
from collections.abc import Callable, Mapping  # noqa: E402

from xopt.errors import HyperparameterError, MetaParamsError  # noqa: E402
from xopt.specs._hyperparams import NONNEGATIVE, Hyperparams, Interval, hp  # noqa: E402

_AT_LEAST_ONE = Interval(1, None)


@dataclasses.dataclass(frozen=True)
class LOptOptions(Hyperparams):
    """Options every xopt learned optimizer takes (a base of the methods' dataclasses).

    They reproduce learned_optimization's ``prefab.LearnedOptimizer`` wrappers, which nest as
    ``WeightDecayWrapper(GradientAccumulator(lopt))``:

    * ``num_training_steps`` (n): the horizon the learned optimizer is told. Required by the
      optimizers (a ``None`` here is an error when an optimizer is built, naming the field);
      the dataclass accepts ``None`` so that defaults can be listed.
    * ``max_training_steps`` (M): when n > M, ``num_average = ceil(n / M)`` gradients and
      losses are summed and the learned optimizer runs every ``num_average``-th call on
      their averages (``sum · (1/num_average)``: XLA's rewrite of the division by a
      constant in the jitted original), with inner horizon
      ``n // num_average`` (prefab's ``GradientAccumulator``). Otherwise every call is an
      inner update with horizon n.
    * ``weight_decay`` (λ) with ``weight_decay_mode``:
        - ``"coupled"`` (prefab's ``WeightDecayWrapper``, applied at *every* call, outside
          the accumulator): ``g ← g + λ·p`` and ``loss ← loss + Σ_leaves(Σ(p²)·λ)``, the
          sum taken in parameter order as Python's ``sum`` (starting from 0);
        - ``"decoupled"`` (xopt's): the learned step is computed from the undecayed
          parameter and ``p ← p − (lr·step + (lr·λ)·p)``; on accumulation calls that run no
          inner update ``p ← p − (lr·λ)·p``.
      λ = 0 does nothing in either mode (prefab only wraps when λ > 0).
    * ``lr``: multiplies the learned step: ``p ← p − lr·step``. The originals have no such
      factor; lr = 1 is bit for bit the original (``lr·step`` is then exactly ``step``).
    """

    num_training_steps: int | None = hp(
        None, doc="training horizon n told to the learned optimizer (required)",
        interval=_AT_LEAST_ONE)
    lr: float = hp(1.0, doc="multiplier of the learned step (1: the original)",
                   interval=NONNEGATIVE)
    weight_decay: float = hp(0.0, doc="weight decay λ (see weight_decay_mode)",
                             interval=NONNEGATIVE)
    weight_decay_mode: str = hp(
        "coupled", doc="'coupled': prefab's g+λp and loss+λΣp²; 'decoupled': p -= lr·λ·p",
        choices=("coupled", "decoupled"))
    max_training_steps: int = hp(
        150_000, doc="longest horizon run directly; longer ones accumulate gradients (prefab)",
        interval=_AT_LEAST_ONE)

    def _check_combinations(self) -> None:
        n = self.num_training_steps
        if n is not None and not isinstance(n, bool):
            try:
                integral = float(n) == int(n)
            except Exception:  # a traced value: cannot be checked
                integral = True
            if not integral:
                raise self._fail("num_training_steps", n, "must be an integer")

    # -- derived quantities ---------------------------------------------------------------
    def require_num_training_steps(self, where: str) -> int:
        """``num_training_steps`` as an int; a ``HyperparameterError`` naming it if unset."""
        if self.num_training_steps is None:
            raise HyperparameterError(
                f"{where}: num_training_steps is required (the training horizon the learned "
                f"optimizer is told, e.g. num_training_steps=10_000); got None"
            )
        return int(self.num_training_steps)

    @property
    def accumulating(self) -> bool:
        """Whether gradients are accumulated (n > max_training_steps)."""
        n = self.num_training_steps
        return n is not None and int(n) > int(self.max_training_steps)

    @property
    def num_average(self) -> int:
        """Calls per inner update: ``ceil(n / M)`` when accumulating, else 1."""
        if not self.accumulating:
            return 1
        n, m = int(self.num_training_steps), int(self.max_training_steps)
        return -(-n // m)  # integer ceil (prefab: int(onp.ceil(n / m)); equal for n < 2**52)

    @property
    def inner_num_steps(self) -> int:
        """The horizon the inner learned optimizer sees: ``n // num_average``."""
        return self.require_num_training_steps(type(self).__name__) // self.num_average

    @property
    def decoupled_decay(self) -> bool:
        return (self.weight_decay_mode == "decoupled"
                and not arrays.is_static_zero(self.weight_decay))

    @property
    def coupled_decay(self) -> bool:
        return self.weight_decay_mode == "coupled" and not arrays.is_static_zero(self.weight_decay)


# -- meta-parameters ----------------------------------------------------------------------------


def _shape_of(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in np.shape(x))


def _is_real_floating(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        dtype = np.asarray(x).dtype
    if type(x).__module__.startswith("torch"):
        return bool(x.is_floating_point())
    try:
        return bool(np.issubdtype(np.dtype(dtype), np.floating))
    except TypeError:  # e.g. jax's bfloat16 reads as a NumPy extension dtype
        return "float" in str(dtype)


def check_meta(theta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
               where: str) -> None:
    """Strict check of meta-parameters against ``{key: shape}``.

    Raises :class:`MetaParamsError` naming every missing key, every unexpected key, or the
    first misshaped or non-floating array.
    """
    if not isinstance(theta, Mapping):
        raise MetaParamsError(f"{where}: meta-parameters must be a mapping of arrays, "
                              f"got {type(theta).__name__}")
    missing = [k for k in shapes if k not in theta]
    extra = sorted(k for k in theta if k not in shapes)
    if missing:
        raise MetaParamsError(f"{where}: missing meta-parameter(s) {', '.join(missing)}")
    if extra:
        raise MetaParamsError(f"{where}: unexpected meta-parameter(s) {', '.join(extra)}; "
                              f"expected {', '.join(shapes)}")
    for k, shape in shapes.items():
        got = _shape_of(theta[k])
        if got != tuple(shape):
            raise MetaParamsError(f"{where}: meta-parameter {k!r} has shape {got}, "
                                  f"expected {tuple(shape)}")
        if not _is_real_floating(theta[k]):
            raise MetaParamsError(f"{where}: meta-parameter {k!r} has dtype "
                                  f"{getattr(theta[k], 'dtype', type(theta[k]).__name__)}, "
                                  f"expected a real floating dtype")


def rename_meta(theta: Mapping[str, Any], mapping: Mapping[str, str],
                shapes: Mapping[str, tuple[int, ...]], where: str) -> dict[str, Any]:
    """``{mapping[k]: theta[k]}`` after checking ``theta`` strictly against ``shapes`` (keyed
    in ``theta``'s naming). Values are passed through unchanged."""
    check_meta(theta, shapes, where)
    return {mapping[k]: theta[k] for k in shapes}


def coerce_meta_namings(theta: Mapping[str, Any], xopt_shapes: Mapping[str, tuple[int, ...]],
                        xopt_to_original: Mapping[str, str], where: str) -> dict[str, Any]:
    """Meta-parameters in xopt's naming from either naming, detected from the keys.

    The naming is xopt's if any key is one of xopt's, the original's if any key is one of
    the original's; keys of both, or of neither, are an error. Then the check is strict.
    """
    if not isinstance(theta, Mapping):
        raise MetaParamsError(f"{where}: meta-parameters must be a mapping of arrays, "
                              f"got {type(theta).__name__}")
    original_to_xopt = {v: k for k, v in xopt_to_original.items()}
    is_xopt = any(k in xopt_shapes for k in theta)
    is_original = any(k in original_to_xopt for k in theta)
    if is_xopt and is_original:
        ours = ", ".join(k for k in theta if k in xopt_shapes)
        theirs = ", ".join(k for k in theta if k in original_to_xopt)
        raise MetaParamsError(f"{where}: meta-parameters mix xopt names ({ours}) and original "
                              f"names ({theirs})")
    if is_original:
        orig_shapes = {xopt_to_original[k]: s for k, s in xopt_shapes.items()}
        return rename_meta(theta, original_to_xopt, orig_shapes, where + " (original naming)")
    if not is_xopt and theta:
        raise MetaParamsError(
            f"{where}: no known meta-parameter name among {', '.join(sorted(theta))}; expected "
            f"xopt's ({', '.join(xopt_shapes)}) or the original's "
            f"({', '.join(xopt_to_original.values())})")
    check_meta(theta, xopt_shapes, where)
    return {k: theta[k] for k in xopt_shapes}


def zeros(backend: str, shape: tuple[int, ...]) -> Any:
    """float32 zeros as a NumPy, torch or jax array (``backend``: "numpy", "torch", "jax")."""
    if backend == "torch":
        import torch

        return torch.zeros(shape, dtype=torch.float32)
    if backend == "jax":
        import jax.numpy as jnp

        return jnp.zeros(shape, jnp.float32)
    return np.zeros(shape, np.float32)


def truncated_normal(seed: int, shape: tuple[int, ...], stddev: float, *, backend: str = "numpy",
                     rounds: int = 8) -> Any:
    """``stddev · z`` with ``z`` standard normal truncated to ``[-2, 2]``, float32, the same
    bits under every ``xopt.random`` backend.

    As haiku's ``TruncatedNormal(stddev)`` in distribution (no variance correction): ``z`` is
    the first of ``rounds`` independent draws (``xopt.random.normal`` at successive counters)
    with ``|z| <= 2``, and the last draw clipped to ``[-2, 2]`` if all ``rounds`` fall
    outside (probability 0.0455**rounds). ``stddev`` is rounded to float32 first.
    """
    from xopt import random as xr

    shape = tuple(int(s) for s in shape)
    per = xr.blocks_used(shape, "float32")
    draws = [xr.normal(seed, shape, counter=r * per, dtype="float32", backend=backend)
             for r in range(rounds)]
    xp = arrays.namespace(draws[0])
    z = arrays.clip(xp, draws[-1], -2.0, 2.0)
    for d in reversed(draws[:-1]):
        z = xp.where(abs(d) <= 2.0, d, z)
    return z * float(np.float32(stddev))  # a weak scalar: an exact float32 product everywhere


# -- the whole outer step as a pure function (the oracle's definition) ------------------------

InnerStep = Callable[[dict[str, Any], Any, dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]]


def apply_step(p: Any, step: Any | None, lr: Any, weight_decay: Any, decoupled: bool) -> Any:
    """The parameter after a call: ``p − lr·step`` (``step`` None: no inner update this call),
    with decoupled decay ``p − (lr·step + (lr·λ)·p)`` (resp. ``p − (lr·λ)·p``)."""
    decay = decoupled and not arrays.is_static_zero(weight_decay)
    if step is None:
        return p - (lr * weight_decay) * p if decay else p
    u = lr * step
    if decay:
        u = u + (lr * weight_decay) * p
    return p - u


def coupled_decay(xp: ModuleType, params: Mapping[str, Any], grads: Mapping[str, Any],
                  loss: Any, weight_decay: Any) -> tuple[dict[str, Any], Any]:
    """prefab's ``WeightDecayWrapper``: ``g + λp`` per leaf and ``loss + Σ(Σ(p²)·λ)`` with the
    outer sum in parameter order starting from 0 (Python's ``sum``)."""
    new_grads = {k: grads[k] + weight_decay * params[k] for k in grads}
    total: Any = 0
    for p in params.values():
        total = total + xp.sum(p ** 2) * weight_decay
    return new_grads, loss + total


def outer_step(hp: LOptOptions, params: Mapping[str, Any], state: Mapping[str, Any],
               grads: Mapping[str, Any], *, xp: ModuleType, loss: Any,
               inner: InnerStep) -> tuple[dict[str, Any], dict[str, Any]]:
    """One call of a learned optimizer with prefab's wrappers, on canonical dicts, pure.

    ``inner(grads, loss, state) -> (steps, state)`` is the learned optimizer proper: it sees
    the gradients after coupled weight decay and accumulation, the canonical state (all
    keys), reads ``state["iteration"]`` (inner updates taken so far), and returns the step
    of every parameter (``p ← p − lr·step``) and its updated state; ``iteration`` is
    advanced here. A missing ``loss`` counts as 0. Canonical keys used here:
    ``iteration``, and when accumulating ``grad_accum/<p>``, ``loss_accum``,
    ``accum_iteration``.
    """
    names = list(params)
    state = dict(state)
    if loss is None:
        loss = 0.0
    g = {k: grads[k] for k in names}
    if hp.coupled_decay:
        g, loss = coupled_decay(xp, params, g, loss, hp.weight_decay)
    steps: dict[str, Any] | None
    if hp.accumulating:
        n = hp.num_average
        acc = {k: state[f"grad_accum/{k}"] + g[k] for k in names}
        loss_acc = state["loss_accum"] + loss
        it = state["accum_iteration"] + 1
        state["accum_iteration"] = it
        if int(it) % n == 0:
            # the original runs under jit, where XLA turns the division by the constant n
            # into a product with its float32 reciprocal: the same here
            inv = 1.0 / n
            steps, state = inner({k: acc[k] * inv for k in names}, loss_acc * inv, state)
            state["iteration"] = state["iteration"] + 1
            acc = {k: xp.zeros_like(acc[k]) for k in names}
            loss_acc = xp.zeros_like(loss_acc)
        else:
            steps = None
        for k in names:
            state[f"grad_accum/{k}"] = acc[k]
        state["loss_accum"] = loss_acc
    else:
        steps, state = inner(g, loss, state)
        state["iteration"] = state["iteration"] + 1
    new_params = {k: apply_step(params[k], None if steps is None else steps[k], hp.lr,
                                hp.weight_decay, hp.decoupled_decay) for k in names}
    return new_params, state

