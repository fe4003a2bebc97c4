"""What xopt's low-rank optax transformations share: per-leaf settings, names, checks.

* **Per-leaf hyperparameters.** Every transformation takes ``spec`` (one setting for all
  leaves) and optionally ``param_specs``: a pytree shaped like the parameters whose leaves
  are the method's spec dataclass or ``None`` (use ``spec``), or a function of the
  parameters returning one; or a mapping from leaf path names (``"mlp/0/weight"``) to
  specs. This is how optax users pick projected leaves (``project=False`` on the others),
  as torch users do with param groups. Settings are static: they fix state shapes.
* **Names.** Leaves are named by their path, keys joined by ``/``, in errors and in
  ``inject``.
* **inject.** ``update(..., inject={path name: {key: array}})`` (an extra argument, as
  ``value=`` is for the learned optimizers): values an update uses instead of its own
  draws or decompositions; the parity harness feeds an original's recorded projections.
* **One conditional per group.** :func:`switch_grouped` puts the refresh branches of a
  group of leaves that share shape, dtype and hyperparameters (so their refresh schedule)
  in one ``lax.switch``, each branch computing every leaf of the group with its event known
  at trace time, one by one (GaLore's refreshes, Flora's momentum transfers) or once under
  ``vmap`` (PLUMAGE, whose refresh is long to trace per leaf); COAP runs its projection
  events once per group under ``vmap`` (:func:`map_grouped`, one ``lax.switch`` inside).
  XLA compiles the identical kernels of
  same-shaped leaves once, so what grows with the number of tensors is a few instructions
  per leaf, not a conditional per leaf (each with its branch computations) nor a kernel per
  leaf. Results stacked under ``vmap`` are taken back out per leaf at
  :func:`runtime_positions` (a slice at a constant offset would be a kernel per leaf), and
  only what the refresh changes is stacked: the per-step math (projection, Adam, the
  update) stays per leaf. The state stays per leaf.
* **Decompositions.** Under ``nonfinite="raise"`` (outside ``jit``; see
  :mod:`xopt.jax._contract`, which also checks the gradients) a refresh whose
  decomposition is not finite raises :class:`~xopt.errors.DecompositionError` naming the
  leaf. Otherwise such a refresh keeps the previous projection rather than writing NaN
  into it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xopt.errors import DecompositionError, HyperparameterError
from xopt.jax._contract import path_names
from xopt.specs import Hyperparams, arrays, lowrank

#: the leaf dtypes GaLore and COAP take (an SVD/QR needs at least float32 state)
FLOATING = (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)


def check_float_leaf(leaf: Any, where: str, dtypes: tuple | None = FLOATING) -> None:
    """Raise :class:`HyperparameterError` naming ``where`` (label and leaf path) unless the
    leaf's dtype is one of ``dtypes`` (``None``: any floating dtype)."""
    dt = jnp.result_type(leaf)
    ok = jnp.issubdtype(dt, jnp.floating) if dtypes is None else dt in dtypes
    if not ok:
        allowed = ("floating dtypes only" if dtypes is None
                   else ", ".join(jnp.dtype(d).name for d in dtypes))
        raise HyperparameterError(f"{where}: dtype {dt} is not supported ({allowed})")


def narrow_dtype(h: Hyperparams, param_dtype: Any, state_dtype: Any = jnp.float32) -> Any:
    """The dtype a projected leaf's products run in when it is not the state's: the
    parameter's under ``proj_dtype="param"`` for a bfloat16/float16 leaf
    (:func:`xopt.specs.lowrank.product_dtype`), else None."""
    low = lowrank.product_dtype(getattr(h, "proj_dtype", "state"), jnp.dtype(param_dtype),
                                jnp.dtype(jnp.promote_types(param_dtype, state_dtype)))
    return None if low is None else jnp.dtype(low)


def _narrow_matmul(a: Any, b: Any, precision: Any = None) -> jax.Array:
    """``a @ b`` of bfloat16/float16 operands as the spec defines it: the exact products
    summed in float32, the sum rounded once to the operands' dtype (what torch's CPU and
    CUDA kernels and ml_dtypes' NumPy ``dot`` compute). Asked for explicitly because a plain
    bfloat16 ``jnp.matmul`` is left to the backend: XLA:CPU may sum in bfloat16 (a
    matrix-vector product eagerly) or in float32 (the same product under ``jit``)."""
    dt = jnp.result_type(a, b)
    if jnp.dtype(dt).itemsize >= 4:
        return jnp.matmul(a, b, precision=precision)
    return jnp.matmul(a, b, precision=precision,
                      preferred_element_type=jnp.float32).astype(dt)


class _NarrowProducts:
    """``jax.numpy`` whose ``matmul`` is :func:`_narrow_matmul`: the namespace the spec's
    projections are called with under ``proj_dtype="param"`` (the spec's own code, with the
    rounding of a narrow product pinned down on every backend)."""

    __name__ = "jax.numpy"  # the spec's helpers take jax's branches (arrays.matmul etc.)
    matmul = staticmethod(_narrow_matmul)

    def __getattr__(self, name: str) -> Any:
        return getattr(jnp, name)


#: the array namespace of the narrow (``proj_dtype="param"``) projections
NARROW = _NarrowProducts()


def narrow_update(p: jax.Array | None, u: jax.Array, step_size: Any, lr: Any,
                  weight_decay: Any) -> jax.Array:
    """The additive update (float32) whose ``optax.apply_updates`` is the spec's
    parameter-dtype step :func:`xopt.specs.lowrank.hf_apply_low` of ``u`` (in the
    parameter's dtype). Without weight decay ``Δ = −α·U`` in float32: ``p + Δ`` evaluated in
    float32 and rounded once is exactly the spec's step. With it the spec rounds twice, and
    ``Δ = new p − p`` in float32 (exact, so ``p + Δ`` rounds back to the new ``p``, unless
    the step leaves less than 2⁻¹⁶ of ``p``). Kept in float32: rounded to the parameter's
    dtype, ``Δ`` would round once more."""
    wide = jnp.float32
    if arrays.is_static_zero(weight_decay):
        return (-step_size) * u.astype(wide)
    new_p = lowrank.hf_apply_low(p, u, step_size, lr, weight_decay)
    return new_p.astype(wide) - p.astype(wide)


def leaf_specs(params: Any, spec: Hyperparams, param_specs: Any, cls: type[Hyperparams],
               label: str) -> list[Hyperparams]:
    """The hyperparameters of every leaf of ``params`` (flattening order)."""
    names = path_names(params)
    if param_specs is None:
        return [spec] * len(names)
    given = param_specs(params) if callable(param_specs) else param_specs
    if isinstance(given, Mapping) and given and set(given) <= set(names):
        # by leaf name (for a flat dict of parameters this is also the pytree form)
        for n, v in given.items():
            if v is not None and not isinstance(v, cls):
                raise HyperparameterError(f"{label}: param_specs[{n!r}] is a "
                                          f"{type(v).__name__}, expected {cls.__name__} or None")
        return [given.get(n) or spec for n in names]
    leaves = jax.tree.leaves(given, is_leaf=lambda x: x is None or isinstance(x, cls))
    if len(leaves) != len(names):
        raise HyperparameterError(
            f"{label}: param_specs has {len(leaves)} leaves, the parameters {len(names)}")
    out = []
    for n, v in zip(names, leaves, strict=True):
        if v is not None and not isinstance(v, cls):
            raise HyperparameterError(f"{label}: param_specs[{n!r}] is a {type(v).__name__}, "
                                      f"expected {cls.__name__} or None")
        out.append(spec if v is None else v)
    return out


def inject_for(inject: Mapping[str, Mapping[str, Any]] | None, names: list[str],
               label: str) -> list[Mapping[str, Any] | None]:
    """``inject`` per leaf (None where nothing is injected); unknown names are an error."""
    if not inject:
        return [None] * len(names)
    unknown = sorted(set(inject) - set(names))
    if unknown:
        raise ValueError(f"{label}: inject names unknown leaves {unknown}")
    return [inject.get(n) for n in names]


def decomposition_guard(label: str, name: str, ok: jax.Array, check: bool) -> None:
    """With ``check`` (``nonfinite="raise"``, whose values are concrete), raise
    :class:`DecompositionError` naming ``name`` when ``ok`` is false (a refresh whose
    SVD/QR returned NaN/inf)."""
    if check and not isinstance(ok, jax.core.Tracer) and not bool(np.asarray(ok)):
        raise DecompositionError(f"{label}: the SVD/QR refreshing the projection of {name} "
                                 "returned NaN/inf (non-finite gradient?)")


def keep_if_not_finite(new: jax.Array, old: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(new if every entry is finite else old, that flag)``."""
    ok = jnp.all(jnp.isfinite(new))
    return jnp.where(ok, new, old), ok


Schedule = Callable[[jax.Array], jax.Array]


def resolve_spec(label: str, method: Any, spec: Hyperparams | None, preset: str | None,
                 given: Mapping[str, Any], learning_rate: Any = None,
                 ) -> tuple[Hyperparams, Schedule | None]:
    """The front of every low-rank transformation: ``(hyperparameters, schedule)``.

    ``spec`` (the method's dataclass) or the keywords in ``given`` that are not None, on
    top of ``preset`` (``method`` is the :class:`~xopt.specs.MethodSpec`); a number
    ``learning_rate`` becomes ``lr``, a callable one is returned as the schedule (the
    spec's ``lr`` then keeps its default, unused). Errors name ``label`` and the field.
    """
    cls = method.hyperparams
    fields = {k: v for k, v in given.items() if v is not None}
    schedule = learning_rate if callable(learning_rate) else None
    if learning_rate is not None and schedule is None:
        fields["lr"] = learning_rate
    if spec is not None:
        if not isinstance(spec, cls):
            raise HyperparameterError(f"{label}: spec must be an {cls.__module__}.{cls.__name__}"
                                      f", got {type(spec).__name__}")
        if fields or preset is not None:
            raise HyperparameterError(
                f"{label}: pass either spec= or hyperparameters, not both (got spec and "
                f"{', '.join(sorted(fields)) or 'preset'}); use spec.replace(...)")
        return spec, schedule
    try:
        return method.make(preset, **fields), schedule
    except HyperparameterError as e:
        raise HyperparameterError(f"{label}: {e}") from e


def _value_key(v: Any) -> Hashable:
    """A hashable stand-in for a hyperparameter's value: the value itself (with its type),
    an array's identity (``optax.inject_hyperparams``' 0-d arrays are shared by every leaf,
    so leaves holding the same array still group)."""
    if isinstance(v, (jax.Array, np.ndarray)) or isinstance(v, jax.core.Tracer):
        return ("id", id(v))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value_key(x) for x in v))
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return (type(v).__name__, v)


def spec_key(h: Any) -> Hashable:
    """A key equal for two hyperparameter dataclasses that step a leaf identically."""
    return (type(h).__name__,) + tuple((f.name, _value_key(getattr(h, f.name)))
                                       for f in dataclasses.fields(h))


def _mesh_size(mesh: Any) -> int:
    return 0 if mesh is None or getattr(mesh, "empty", True) else int(mesh.size)


def _on_several_devices(x: Any) -> bool:
    """Whether ``x`` (or the mesh set with ``jax.set_mesh``) spans more than one device."""
    if _mesh_size(jax.sharding.get_abstract_mesh()) > 1:
        return True
    try:
        sharding = getattr(jax.typeof(x), "sharding", None)
    except TypeError:  # not an array
        return False
    return _mesh_size(getattr(sharding, "mesh", None)) > 1


def group_key(spec: Any, args: Any, *, batchable: bool = True) -> Hashable | None:
    """The :func:`switch_grouped` and :func:`map_grouped` key of one leaf: its
    hyperparameters (:func:`spec_key`) and the structure, shapes and dtypes of its arrays
    ``args``; None (a group of its own) when not ``batchable`` or when an array is on a
    mesh of several devices (stacking would move sharded matrices, and the owner rule of
    :mod:`xopt.jax.sharding` works per matrix)."""
    if not batchable:
        return None
    leaves, treedef = jax.tree.flatten(args)
    shapes = []
    for x in leaves:
        if _on_several_devices(x):
            return None
        shapes.append((tuple(np.shape(x)), str(jnp.result_type(x))))
    return (spec_key(spec), treedef, tuple(shapes))


def runtime_positions(n: int, count: jax.Array | None) -> tuple[jax.Array, ...]:
    """The int32 scalars ``0, ..., n-1`` as values XLA cannot fold into constants: the
    outputs of one ``lax.cond`` on ``count >= 0`` (``count`` a traced step count, never
    negative: the other branch never runs). Taking entry ``j`` of a stacked array at such
    a position makes the slice of every entry one kernel, compiled once, where a slice at a
    constant offset is a kernel of its own per entry (XLA:CPU and GPU compile each distinct
    kernel; an ``optimization_barrier`` does not survive their pipelines). With ``count``
    None: plain Python ints."""
    if count is None or n < 2:
        return tuple(range(n))
    return jax.lax.cond(jnp.asarray(count) >= 0,
                        lambda: tuple(jnp.int32(j) for j in range(n)),
                        lambda: tuple(jnp.int32(n - 1 - j) for j in range(n)))


def _group_sizes(keys: Sequence[Hashable | None]) -> int:
    sizes: dict[Hashable, int] = {}
    for k in keys:
        if k is not None:
            sizes[k] = sizes.get(k, 0) + 1
    return max(sizes.values(), default=0)


def switch_grouped(keys: Sequence[Hashable | None], branch_of: Callable[[int], Any],
                   branches: int | Callable[[int], int], fn: Callable[[int, Any, int], Any],
                   args: Sequence[Any], *, vmapped: Callable[[int], bool] | None = None,
                   count: jax.Array | None = None) -> list[Any]:
    """``[fn(i, args[i], e_i)]``, ``e_i`` the branch ``branch_of(i)`` picks, as one
    ``lax.switch`` per group of equal ``keys``.

    ``branch_of(i)`` is a traced int32 in ``range(branches)`` (``branches``: an int or a
    function of ``i``), or a Python int (then no switch is traced). Every leaf of a group
    shares it: it may read only what the key fixes (the hyperparameters) and the count.
    Each branch calls ``fn(i, args[i], e)`` for every leaf ``i`` of the group with ``e`` a
    Python int, so that ``fn`` resolves its decisions at trace time; every branch returns
    one structure. ``args[i]`` are the switch's operands (pytrees of arrays and None). A
    key of None is a group of its own (its leaf's own switch).

    With ``vmapped(e)`` true, branch ``e`` stacks the group's operands and runs ``fn`` once
    under ``jax.vmap`` (``fn`` must then not let ``i`` change the math): traced once, its
    operations do not grow with the group. Its results are taken back out per leaf at
    :func:`runtime_positions` of ``count`` (operands of the switch), so that the slices of
    every leaf are one kernel.
    """
    groups: dict[Hashable, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(("leaf", i) if k is None else ("group", k), []).append(i)
    out: list[Any] = [None] * len(args)
    positions = runtime_positions(_group_sizes(keys) if vmapped is not None else 0, count)
    for idx in groups.values():
        def branch(e: int, ops: tuple[list[Any], list[jax.Array]],
                   idx: list[int] = idx) -> list[Any]:
            leaf_args, pos = ops
            if len(idx) < 2 or vmapped is None or not vmapped(e):
                return [fn(i, a, e) for i, a in zip(idx, leaf_args, strict=True)]
            stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *leaf_args)
            res = jax.vmap(lambda a: fn(idx[0], a, e))(stacked)
            return [jax.tree.map(lambda x, p=p: jax.lax.dynamic_index_in_dim(
                x, p, keepdims=False), res) for p in pos]

        which = branch_of(idx[0])
        ops = ([args[i] for i in idx], list(positions[:len(idx)]) if len(idx) > 1 else [])
        if isinstance(which, (bool, int, np.integer)):
            res = branch(int(which), ops)
        else:
            n = branches(idx[0]) if callable(branches) else branches
            res = jax.lax.switch(jnp.asarray(which, jnp.int32),
                                 [functools.partial(branch, e) for e in range(n)], ops)
        for i, r in zip(idx, res, strict=True):
            out[i] = r
    return out


def map_grouped(keys: Sequence[Hashable | None], fn: Callable[[int, Any], Any],
                args: Sequence[Any], *, count: jax.Array | None = None) -> list[Any]:
    """``[fn(i, args[i]) for i]``, tracing ``fn`` once per group of equal ``keys``.

    Leaves whose key is shared by another leaf run together: their ``args`` (pytrees of
    arrays and None, of one structure) are stacked on a new leading axis, ``fn`` runs once
    under ``jax.vmap`` (with the group's first index ``i``: ``fn`` must not make ``i``
    change the math; pass what differs per leaf, such as a seed, in ``args``) and the
    results are unstacked at :func:`runtime_positions` of ``count`` (one kernel for the
    slices of every leaf). A key of None, or a key of one leaf, calls ``fn`` directly.
    ``fn`` must close over only what every leaf of a group shares (the count, the schedule's
    learning rate): a ``lax.cond`` on such a value stays a branch under ``vmap``.
    """
    groups: dict[Hashable, list[int]] = {}
    for i, k in enumerate(keys):
        if k is not None:
            groups.setdefault(k, []).append(i)
    out: list[Any] = [None] * len(args)
    done = set()
    positions = runtime_positions(_group_sizes(keys), count)
    for idx in groups.values():
        if len(idx) < 2:
            continue
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(args[i] for i in idx))
        res = jax.vmap(lambda a, i0=idx[0]: fn(i0, a))(stacked)
        for j, i in enumerate(idx):
            out[i] = jax.tree.map(lambda x, p=positions[j]: jax.lax.dynamic_index_in_dim(
                x, p, keepdims=False), res)
            done.add(i)
    for i, a in enumerate(args):
        if i not in done:
            out[i] = fn(i, a)
    return out
