"""AdamW as an optax gradient transformation whose arithmetic is the xopt specification's.

:func:`adamw` returns an :class:`optax.GradientTransformationExtraArgs`; it drops into
``optax.chain``, ``optax.inject_hyperparams``, ``optax.apply_updates`` and ``jax.jit`` like
``optax.adamw``. Each update calls the specification's pure math,
:func:`xopt.specs.adamw.updates_optax` (``formula="optax"``) or
:func:`xopt.specs.adamw.update_torch` (``formula="torch"``), once, on operands that hold
every leaf of the pytree (see ``_Leaves`` below for why not once per leaf); this module
only threads pytrees, the step counter, the mask and the learning-rate schedule through it.

The algorithm (Loshchilov & Hutter, *Decoupled Weight Decay Regularization*, ICLR 2019,
Algorithm 2, with the learning rate η multiplying the decay λ as optax and torch.optim do),
at step t = 1, 2, ... for every parameter θ with gradient g::

    m_t = β₁ m_{t-1} + (1 − β₁) g                      v_t = β₂ v_{t-1} + (1 − β₂) g²
    m̂_t = m_t / (1 − β₁ᵗ)                              v̂_t = v_t / (1 − β₂ᵗ)
    θ_t = θ_{t-1} − η (m̂_t / (√(v̂_t + ε_root) + ε) + λ θ_{t-1})

Under ``formula="optax"`` (the default) the floating-point operations are optax.adamw's,
in optax's order, so that, for the same inputs on the same machine, params and state agree
with ``optax.adamw`` bit for bit, jitted or not (``tests/test_jax_adamw.py`` checks it). See
``xopt/specs/adamw.py`` for both formulas and the state schema (naming ``"xopt.jax"``).
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from xopt.errors import HyperparameterError
from xopt.registry import register
from xopt.specs import adamw as _spec
from xopt.specs.arrays import is_static_zero

__all__ = ["AdamWState", "adamw"]


class AdamWState(NamedTuple):
    """State of :func:`adamw` (the spec's ``"xopt.jax"`` naming of ``STATE``).

    Attributes:
      count: int32 scalar (shape ``()``): the number of updates taken, t. Incremented with
        ``optax.safe_increment`` (it saturates at 2³¹ − 1 instead of wrapping).
      mu: first moment m_t (not bias-corrected); a pytree like the params, each leaf of the
        parameter's shape and dtype (``jnp.zeros_like``), as in ``optax.scale_by_adam``.
      nu: second moment v_t (not bias-corrected); same structure, shapes and dtypes.
      nu_max: with ``amsgrad=True``, the running maximum used in the denominator: of the
        bias-corrected v̂_t under ``formula="optax"`` (as ``optax.scale_by_amsgrad``), of
        the raw v_t under ``formula="torch"`` (as ``torch.optim.AdamW``'s
        ``max_exp_avg_sq``); same structure, shapes and dtypes as ``mu``. ``None`` otherwise.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    nu_max: optax.Updates | None


# Argument name -> field of xopt.specs.adamw.AdamW (the two differ only for the lr).
_FIELD_OF_ARG = {
    "learning_rate": "lr",
    "b1": "b1",
    "b2": "b2",
    "eps": "eps",
    "eps_root": "eps_root",
    "weight_decay": "weight_decay",
    "amsgrad": "amsgrad",
    "maximize": "maximize",
    "nesterov": "nesterov",
    "formula": "formula",
    "bias_correction_dtype": "bias_correction_dtype",
}
_DEFAULTS = {
    "learning_rate": _spec.PRESETS["optax"]["lr"],
    "b1": _spec.PRESETS["optax"]["b1"],
    "b2": _spec.PRESETS["optax"]["b2"],
    "eps": _spec.PRESETS["optax"]["eps"],
    "eps_root": _spec.PRESETS["optax"]["eps_root"],
    "weight_decay": _spec.PRESETS["optax"]["weight_decay"],
    "amsgrad": False,
    "maximize": False,
    "nesterov": False,
    "formula": _spec.PRESETS["optax"]["formula"],
    "bias_correction_dtype": None,  # None: the formula's preset (see adamw's docstring)
}
# A schedule cannot be range-checked when the transformation is built; the spec dataclass
# is validated with this stand-in learning rate instead.
_SCHEDULE_PLACEHOLDER_LR = _DEFAULTS["learning_rate"]

_NO_PARAMS_MSG = (
    "xopt.jax.adamw: update(updates, state, params) needs `params` (got params=None): "
    "{why}. Pass the current parameters as the third argument."
)


def _is_default(name: str, value: Any) -> bool:
    """Whether an argument was left at its default (a concrete value equal to it)."""
    default = _DEFAULTS[name]
    if value is default:
        return True
    if default is None:
        return False
    if isinstance(default, (bool, str)):
        return type(value) is type(default) and value == default
    try:
        return float(value) == default  # Python number or concrete 0-d array
    except Exception:  # a tracer (inject_hyperparams under jit), a schedule, ...
        return False


def _validate(args: dict[str, Any], spec: _spec.AdamW | None) -> _spec.AdamW:
    """The spec dataclass for these arguments; raises HyperparameterError naming the field."""
    if spec is not None:
        if not isinstance(spec, _spec.AdamW):
            raise HyperparameterError(
                f"xopt.jax.adamw: spec must be an xopt.specs.adamw.AdamW, got "
                f"{type(spec).__name__}"
            )
        conflicting = [name for name, value in args.items() if not _is_default(name, value)]
        if conflicting:
            raise HyperparameterError(
                "xopt.jax.adamw: pass either spec= or the hyperparameter arguments, not both; "
                f"got spec= together with {', '.join(map(repr, conflicting))} "
                f"({', '.join(f'{n}={args[n]!r}' for n in conflicting)}). Use "
                "spec.replace(...) to change a field of the spec."
            )
        return spec
    # Fields left to the formula (bias_correction_dtype) come from the formula's preset.
    fields = dict(_spec.PRESETS.get(args["formula"], {}))
    fields.update({_FIELD_OF_ARG[name]: value for name, value in args.items()
                   if value is not None or _DEFAULTS[name] is not None})
    if callable(fields["lr"]):
        fields["lr"] = _SCHEDULE_PLACEHOLDER_LR
    try:
        return _spec.AdamW.from_dict(fields)  # unknown names: HyperparameterError too
    except HyperparameterError as e:
        if str(e).startswith("AdamW.lr "):
            raise HyperparameterError(f"xopt.jax.adamw: learning_rate: {e}") from e
        raise HyperparameterError(f"xopt.jax.adamw: {e}") from e


def _expand_mask(mask_tree: Any, tree: Any) -> list[bool]:
    """One bool per leaf of ``tree`` from a mask that is ``tree``'s structure or a prefix.

    As ``optax.masked``: a mask leaf applies to the whole subtree of ``tree`` under it.
    """
    expanded = jax.tree.map(
        lambda m, sub: jax.tree.map(lambda _: m, sub), mask_tree, tree
    )
    return [bool(m) for m in jax.tree.leaves(expanded)]


# -- evaluating the spec's math on a whole pytree at once ------------------------------------
#
# The spec's functions perform optax's operations in optax's order, but bitwise agreement
# with optax.adamw also depends on how jax and XLA compile them, in three ways that the
# helpers below account for (each was found by comparing intermediate values; each, left
# out, makes some update differ from optax's by an ulp):
#
# 1. XLA's algebraic simplifier (CPU and GPU) rewrites ``x / s``, with ``s`` a scalar that
#    has a single use, into ``x * (1 / s)``, which rounds differently. optax divides every
#    leaf by *one shared* bias-correction scalar (``optax.tree.bias_correction``, one jitted
#    function over the whole tree), so with two or more leaves XLA keeps true divisions.
#    The spec called leaf by leaf would compute a private ``1 - β^t`` per leaf and get
#    reciprocal multiplications, eagerly and under jit alike. So the spec's function is
#    called once per update, on ``_Leaves`` operands that hold all leaves: each of its
#    operations then happens once per tree, as in optax, and a division by a scalar divides
#    all leaves in one jitted computation, as ``optax.tree.bias_correction`` does.
# 2. ``β ** t`` with a *concrete* int32 ``t`` (an update outside jit) takes jnp.power's
#    concrete-integer path (``lax.integer_pow``, repeated squaring); optax evaluates it
#    under jit, where ``t`` is traced (``lax.pow``). ``_Count`` evaluates it under jit.
# 3. Within one computation XLA may keep a value that is cast down (float32 -> bfloat16)
#    in its wider precision (``xla_allow_excess_precision``; the GPU compiler does it).
#    optax casts the bias correction to the moment's dtype inside the same jitted function
#    that divides by it; ``_Scalar`` postpones the spec's cast to that division.
#
# Every arithmetic operation and its order remain the spec's.


class _Skip:
    """A masked-out weight decay: ``_SKIP * p`` is ``_SKIP`` and ``u + _SKIP`` is ``u``.

    This reproduces ``optax.masked(add_decayed_weights)`` exactly (the leaf's update is left
    untouched; ``u + 0 * p`` would differ when ``p`` is not finite).
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "_SKIP"


_SKIP = _Skip()


def _add(a: Any, b: Any) -> Any:
    if a is _SKIP:
        return b
    if b is _SKIP:
        return a
    return a + b


def _mul(a: Any, b: Any) -> Any:
    if a is _SKIP or b is _SKIP:
        return _SKIP
    return a * b


def _no_skip(fn: Callable[..., Any]) -> Callable[..., Any]:
    def checked(*args: Any) -> Any:
        if any(a is _SKIP for a in args):
            raise TypeError(f"xopt.jax.adamw: masked weight decay reached {fn.__name__}; "
                            "the spec uses weight_decay in an unexpected way")
        return fn(*args)

    checked.__name__ = fn.__name__
    return checked


@functools.partial(jax.jit, inline=True, static_argnums=2)
def _divide_leaves_by_scalar(leaves: list[jax.Array], s: jax.Array,
                             dtype: Any = None) -> list[jax.Array]:
    """Every leaf divided by the one scalar ``s``, in one computation (see above).

    ``dtype``: the cast of ``s`` that the spec asked for (a ``_Scalar``'s pending cast); it
    is applied here, inside the same computation as the division, as optax's
    ``t / bias_correction_.astype(t.dtype)``: XLA may then keep ``s`` in its wider
    precision (``xla_allow_excess_precision``, which the GPU compiler uses for bfloat16), and
    a cast done beforehand, in a computation of its own, would round where optax does not.
    """
    if dtype is not None:
        return [x / s.astype(dtype) for x in leaves]
    return [x / s for x in leaves]


class _Leaves:
    """The leaves of a pytree, as one operand of the spec's elementwise array math.

    Supports what the spec's AdamW functions use: ``+ - * /``, unary ``-``, ``.dtype`` (when
    all leaves share one), and, through NumPy's ufunc protocol (the spec picks NumPy as the
    namespace of an unknown array type), ``np.sqrt`` / ``np.maximum`` and other ufuncs,
    evaluated with ``jax.numpy``. Scalars (Python numbers, 0-d arrays) broadcast to every
    leaf; an operand that is itself ``_Leaves`` supplies one value per leaf.
    """

    __slots__ = ("leaves",)
    __array_priority__ = 1000  # NumPy scalars defer to us

    def __init__(self, leaves: Any) -> None:
        self.leaves = tuple(leaves)

    @staticmethod
    def map(fn: Callable[..., Any], *args: Any) -> _Leaves:
        n = next(len(a.leaves) for a in args if isinstance(a, _Leaves))
        cols = [a.leaves if isinstance(a, _Leaves) else (a,) * n for a in args]
        return _Leaves(fn(*xs) for xs in zip(*cols, strict=True))

    @property
    def dtype(self) -> Any:
        dtypes = {jnp.result_type(x) for x in self.leaves}
        if len(dtypes) != 1:
            # No single dtype: the spec then leaves scalars uncast and jax's promotion
            # applies per leaf (a weakly typed scalar takes each leaf's dtype).
            raise AttributeError("leaves of several dtypes")
        return dtypes.pop()

    def __add__(self, o: Any) -> _Leaves:
        return _Leaves.map(_add, self, o)

    def __radd__(self, o: Any) -> _Leaves:
        return _Leaves.map(_add, o, self)

    def __sub__(self, o: Any) -> _Leaves:
        return _Leaves.map(_no_skip(operator.sub), self, o)

    def __rsub__(self, o: Any) -> _Leaves:
        return _Leaves.map(_no_skip(operator.sub), o, self)

    def __mul__(self, o: Any) -> _Leaves:
        return _Leaves.map(_mul, self, o)

    def __rmul__(self, o: Any) -> _Leaves:
        return _Leaves.map(_mul, o, self)

    def __truediv__(self, o: Any) -> _Leaves:
        if isinstance(o, _Leaves) or o is _SKIP or any(x is _SKIP for x in self.leaves):
            return _Leaves.map(_no_skip(operator.truediv), self, o)
        if isinstance(o, _Scalar):
            return _Leaves(_divide_leaves_by_scalar(list(self.leaves), o.value, o.cast))
        return _Leaves(_divide_leaves_by_scalar(list(self.leaves), o))

    def __rtruediv__(self, o: Any) -> _Leaves:
        return _Leaves.map(_no_skip(operator.truediv), o, self)

    def __neg__(self) -> _Leaves:
        return _Leaves.map(_no_skip(operator.neg), self)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        fn = getattr(jnp, ufunc.__name__, None)
        if method != "__call__" or kwargs or fn is None:
            return NotImplemented
        if ufunc.__name__ == "add":
            return _Leaves.map(_add, *inputs)
        if ufunc.__name__ == "multiply":
            return _Leaves.map(_mul, *inputs)
        return _Leaves.map(_no_skip(fn), *inputs)


class _LeavesNamespace:
    """The ``xp`` handed to the spec: ``jax.numpy``, whose functions accept ``_Leaves``.

    ``xp.sqrt(x)``, ``xp.maximum(a, b)``, ``xp.expm1(x)``, ... apply the ``jax.numpy``
    function leaf by leaf when an argument is ``_Leaves`` and directly otherwise; dtypes
    (``xp.float32``) and other attributes are ``jax.numpy``'s.
    """

    __name__ = "xopt.jax._leaves"

    def __getattr__(self, name: str) -> Any:
        attr = getattr(jnp, name)
        if not callable(attr) or isinstance(attr, type):
            return attr

        def fn(*args: Any, **kwargs: Any) -> Any:
            if not any(isinstance(a, _Leaves) for a in args):
                return attr(*args, **kwargs)
            return _Leaves.map(_no_skip(lambda *xs: attr(*xs, **kwargs)), *args)

        fn.__name__ = name
        return fn


_XP = _LeavesNamespace()


@functools.partial(jax.jit, inline=True)
def _power(base: Any, exponent: jax.Array) -> jax.Array:
    return base**exponent


class _Scalar:
    """A scalar from ``β ** t`` (``_Count``) whose cast to a leaf dtype is postponed.

    The spec computes ``1 - β**t`` and then casts it to the moment's dtype before dividing;
    optax does the cast and the division in one jitted computation (see
    ``_divide_leaves_by_scalar``). ``1 - x`` and ``x.astype(dtype)`` therefore stay
    ``_Scalar`` (the cast is recorded, not applied), and dividing ``_Leaves`` by it applies
    the cast together with the division. Any other use gets the plain, cast value.
    """

    __slots__ = ("value", "cast")

    def __init__(self, value: jax.Array, cast: Any = None) -> None:
        self.value, self.cast = value, cast

    def get(self) -> jax.Array:
        return self.value if self.cast is None else self.value.astype(self.cast)

    def __rsub__(self, o: Any) -> _Scalar:
        return _Scalar(o - self.get())

    def astype(self, dtype: Any) -> _Scalar:
        return _Scalar(self.get(), dtype)

    @property
    def dtype(self) -> Any:
        return self.get().dtype

    def __jax_array__(self) -> jax.Array:
        return self.get()

    # Any other arithmetic uses the value, cast as the spec asked.
    def __add__(self, o: Any) -> Any:
        return self.get() + o

    def __radd__(self, o: Any) -> Any:
        return o + self.get()

    def __sub__(self, o: Any) -> Any:
        return self.get() - o

    def __mul__(self, o: Any) -> Any:
        return self.get() * o

    def __rmul__(self, o: Any) -> Any:
        return o * self.get()

    def __truediv__(self, o: Any) -> Any:
        return self.get() / o

    def __rtruediv__(self, o: Any) -> Any:
        return o / self.get()

    def __pow__(self, o: Any) -> Any:
        return self.get() ** o

    def __neg__(self) -> Any:
        return -self.get()


class _Count:
    """The step count t handed to the spec: ``β ** t`` as optax computes it.

    ``optax.tree.bias_correction`` evaluates ``decay ** count`` inside ``jax.jit``, where the
    int32 count is traced and jnp.power lowers to XLA's ``power``. A concrete int32 array
    (an update outside jit) would instead make jnp.power take its concrete-integer path
    (``lax.integer_pow``, repeated squaring), which rounds differently. Here ``β ** t`` is
    always evaluated inside jit; ``t + 1`` (the spec's Nesterov term) stays a ``_Count``.
    """

    __slots__ = ("value",)

    def __init__(self, value: jax.Array) -> None:
        self.value = value

    def __rpow__(self, base: Any) -> _Scalar:
        return _Scalar(_power(base, self.value))

    def __add__(self, k: Any) -> _Count:
        return _Count(self.value + k)

    __radd__ = __add__

    def astype(self, dtype: Any) -> jax.Array:
        return self.value.astype(dtype)


def adamw(
    learning_rate: optax.ScalarOrSchedule = _DEFAULTS["learning_rate"],
    b1: float | jax.Array = _DEFAULTS["b1"],
    b2: float | jax.Array = _DEFAULTS["b2"],
    eps: float | jax.Array = _DEFAULTS["eps"],
    eps_root: float | jax.Array = _DEFAULTS["eps_root"],
    weight_decay: float | jax.Array = _DEFAULTS["weight_decay"],
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    nesterov: bool = False,
    formula: str = "optax",
    bias_correction_dtype: str | None = None,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    spec: _spec.AdamW | None = None,
    **unknown: Any,
) -> optax.GradientTransformationExtraArgs:
    """AdamW (Loshchilov & Hutter 2019, Algorithm 2) as an optax transformation.

    Defaults are the spec's ``"optax"`` preset (:data:`xopt.specs.adamw.PRESETS`), i.e.
    ``optax.adamw``'s, with the learning rate defaulting to 1e-3. Under ``formula="optax"``,
    ``adamw(lr, ...)`` and ``optax.adamw(lr, ...)`` produce bitwise-identical updates,
    params and state (``count``, ``mu``, ``nu``) on the same machine, jitted or not (tested
    on CPU, and with jax 0.11.2 on an H200 GPU), also inside ``optax.chain`` and
    ``optax.inject_hyperparams``; with ``amsgrad=True`` the same holds against
    ``chain(scale_by_amsgrad, add_decayed_weights, scale_by_learning_rate)``.

    Shapes and dtypes: the state (:class:`AdamWState`) holds an int32 scalar count and, per
    parameter, moments of the parameter's shape and dtype (bfloat16 params: bfloat16
    moments, as optax without ``mu_dtype``); the updates have the parameters' structure,
    shapes and dtypes.

    Args:
      learning_rate: η: a float, a 0-d array, or an optax schedule. A schedule is called
        with the step count *before* this update's increment (0 on the first update), as
        ``optax.scale_by_schedule`` does, and its value is cast to the update's dtype.
      b1, b2: decays β₁, β₂ of the first and second moments, in [0, 1).
      eps: ε added to √(v̂ + ε_root).
      eps_root: ε_root added to v̂ inside the square root.
      weight_decay: decoupled weight decay λ, multiplied by η (a number, not a schedule).
      amsgrad: divide by the running maximum of the second moment (see :class:`AdamWState`).
      maximize: ascend: the gradient is negated.
      nesterov: Nesterov momentum (optax's NAdamW); needs ``formula="optax"``.
      formula: ``"optax"``: optax.adamw's floating-point operations and order (additive
        update ``u``, applied by ``optax.apply_updates`` as ``p + u``). ``"torch"``:
        torch.optim.AdamW's operations (:func:`xopt.specs.adamw.update_torch`). The update
        returned is then ``u = p_new − p``, so ``p + u`` can differ from the spec's (and
        torch's) ``p_new`` by an ulp of p, because ``p + (p_new − p)`` rounds; and jax
        (without x64) evaluates the bias corrections 1 − βᵗ in float32 (the spec's
        ``−expm1(t·log1p(β − 1))``, a few ulp from the double value) where torch uses
        double. This formula is therefore within ~1e-7 relative of torch.optim.AdamW per
        step, not bit-identical to it. Under ``optax.inject_hyperparams`` and ``jax.jit`` it
        fails on a traced ``b1`` (the spec's ``lerp`` branches on ``|1 − β₁| < 0.5`` in
        Python); ``formula="optax"`` has no such limit.
      bias_correction_dtype: precision of 1 − βᵗ (a field of the spec): ``"float32"`` as
        optax, ``"float64"`` as torch.optim; ``None`` takes the formula's preset
        (:data:`xopt.specs.adamw.PRESETS`).
      mask: weight decay only, like ``optax.adamw``'s ``mask``: a pytree of bools with the
        structure of the params (or a prefix of it: a bool applies to the whole subtree
        below it), or a callable returning one when given the updates (``optax.masked``
        calls it with the updates too). Leaves whose mask is False get no weight decay: the
        ``+ λθ`` term is skipped for them (under ``formula="torch"``, λ = 0 for them, and
        ``θ·(1 − η·0)`` is exactly θ), which is bitwise what ``optax.masked`` gives. The
        moments of every leaf are updated regardless of the mask.
      spec: an :class:`xopt.specs.adamw.AdamW` to take every hyperparameter from instead of
        the arguments above, which must then be left at their defaults
        (``HyperparameterError`` naming the conflicting argument otherwise). Its ``lr`` is
        the learning rate. Not combinable with ``optax.inject_hyperparams``, which passes
        every numeric argument explicitly.

    Returns:
      An ``optax.GradientTransformationExtraArgs``. ``init(params)`` gives an
      :class:`AdamWState`; ``update(updates, state, params=None, **extra_args)`` gives
      ``(updates, new_state)``, ignoring ``extra_args`` (e.g. ``value=loss``). ``params``
      is required unless the weight decay is a static zero (``formula="optax"``); it is
      always required under ``formula="torch"``. The state's structure, shapes and dtypes
      do not change between steps, so a jitted step traces once.

    Raises:
      HyperparameterError: an unknown keyword, a value outside its range (naming the
        field, via :class:`xopt.specs.adamw.AdamW`'s validation), or ``spec=`` together
        with a non-default hyperparameter argument.
    """
    if unknown:
        known = ", ".join(inspect.signature(adamw).parameters)
        hint = ""
        if "lr" in unknown:
            hint = " (the learning rate is `learning_rate`, as in optax)"
        raise HyperparameterError(
            f"xopt.jax.adamw: unknown argument{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, sorted(unknown)))}{hint}; known: {known}"
        )
    args = dict(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                nesterov=nesterov, formula=formula,
                bias_correction_dtype=bias_correction_dtype)
    hp = _validate(args, spec)
    if spec is not None:
        learning_rate = hp.lr
    lr_schedule = learning_rate if callable(learning_rate) else None

    def init_fn(params: optax.Params) -> AdamWState:
        mu = jax.tree.map(jnp.zeros_like, params)
        nu = jax.tree.map(jnp.zeros_like, params)
        nu_max = jax.tree.map(jnp.zeros_like, params) if hp.amsgrad else None
        return AdamWState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu, nu_max=nu_max)

    def update_fn(updates: optax.Updates, state: AdamWState, params: optax.Params = None,
                  **extra_args: Any) -> tuple[optax.Updates, AdamWState]:
        del extra_args  # e.g. value=loss: part of the protocol, unused by AdamW
        g_leaves, treedef = jax.tree.flatten(updates)
        n = len(g_leaves)
        count_inc = optax.safe_increment(state.count)  # t: the step number after increment
        if n == 0:
            return updates, state._replace(count=count_inc)

        # Weight decay: one scalar, or one per leaf when a mask leaves some out.
        weight_decay: Any = hp.weight_decay
        if mask is not None:
            keep = _expand_mask(mask(updates) if callable(mask) else mask, updates)
            if not any(keep):
                weight_decay = 0.0  # a static zero: the spec skips the term entirely
            elif not all(keep):
                off = _SKIP if hp.formula == "optax" else 0.0  # torch: p * (1 - lr*0) == p
                weight_decay = _Leaves(hp.weight_decay if k else off for k in keep)
        if params is None:
            if hp.formula == "torch":
                raise ValueError(_NO_PARAMS_MSG.format(
                    why="formula='torch' computes the update as p_new - p"))
            if not is_static_zero(weight_decay):
                raise ValueError(_NO_PARAMS_MSG.format(
                    why=f"weight_decay={hp.weight_decay!r} multiplies the parameters"))
            p = None
        else:
            p = _Leaves(treedef.flatten_up_to(params))
        g = _Leaves(g_leaves)
        m_leaves = treedef.flatten_up_to(state.mu)
        v_leaves = treedef.flatten_up_to(state.nu)
        m, v = _Leaves(m_leaves), _Leaves(v_leaves)
        vmax_leaves = treedef.flatten_up_to(state.nu_max) if hp.amsgrad else None
        v_max = _Leaves(vmax_leaves) if hp.amsgrad else None

        if lr_schedule is None:
            lr: Any = hp.lr
        else:
            # optax.scale_by_schedule multiplies by jnp.array(step_size, dtype=u.dtype): the
            # schedule's value at the count before the increment, cast to each leaf's dtype.
            value = lr_schedule(state.count)
            lr = _Leaves(
                jnp.asarray(value, dtype=jnp.result_type(*xs))
                for xs in zip(g_leaves, m_leaves, v_leaves,
                              *(() if p is None else (p.leaves,)), strict=True)
            )

        kw = dict(lr=lr, b1=hp.b1, b2=hp.b2, eps=hp.eps, eps_root=hp.eps_root,
                  weight_decay=weight_decay, amsgrad=hp.amsgrad, maximize=hp.maximize, xp=_XP,
                  bias_correction_dtype=hp.bias_correction_dtype)
        t = _Count(count_inc)
        if hp.formula == "optax":
            u, m, v, v_max = _spec.updates_optax(p, g, m, v, v_max, t,
                                                 nesterov=hp.nesterov, **kw)
        else:
            p_new, m, v, v_max = _spec.update_torch(p, g, m, v, v_max, t, **kw)
            u = p_new - p

        # Keep the state's dtypes fixed, so that a jitted step does not retrace: optax casts
        # nu back to its state dtype the same way; with params and gradients of one dtype
        # every cast here is a no-op.
        def like(new: _Leaves, old: list[jax.Array]) -> Any:
            cast = [x.astype(o.dtype) for x, o in zip(new.leaves, old, strict=True)]
            return treedef.unflatten(cast)

        new_state = AdamWState(
            count=count_inc,
            mu=like(m, m_leaves),
            nu=like(v, v_leaves),
            nu_max=like(v_max, vmax_leaves) if hp.amsgrad else None,
        )
        return treedef.unflatten(list(u.leaves)), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# The public signature, without the catch-all that turns unknown keywords into a
# HyperparameterError: optax.inject_hyperparams binds arguments against this signature.
adamw.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [p for p in inspect.signature(adamw).parameters.values()
     if p.kind is not inspect.Parameter.VAR_KEYWORD],
    return_annotation=optax.GradientTransformationExtraArgs,
)


register("adamw", "jax", adamw)
