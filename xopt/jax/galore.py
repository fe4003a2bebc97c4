"""GaLore as an optax gradient transformation, computing :mod:`xopt.specs.galore`'s math.

:func:`galore` returns an ``optax.GradientTransformationExtraArgs`` (jit-able, works in
``optax.chain``; ``update(..., inject=...)`` and ``value=`` are extra arguments). Each leaf
calls the spec's pure functions (:func:`xopt.specs.galore.tensor_update` and the
projection helpers); this module threads the pytree, the count, the periodic SVD refresh
(``lax.cond``, so the SVD runs only at refresh updates) and the checks.

Projected leaves are chosen per leaf, as optax users choose masks: ``param_specs`` gives a
:class:`xopt.specs.galore.GaLore` per leaf (a pytree of specs/None, a function of the
params returning one, or ``{leaf path: spec}``), ``project=False`` on the leaves to step
with plain Adam; leaves that are not matrices always are. ``mask`` restricts the weight
decay like optax's.

``preset="optax"`` is optax.contrib.galore's arithmetic (left projection when m ≥ n,
``scale_by_adam``, ``add_decayed_weights``, ``scale_by_learning_rate``), tested against the
live ``optax.contrib.galore`` (``tests/test_galore.py``). The stored right projection is
``Vᵀ[:r, :]`` (``r × n``) as the authors store it; optax stores its transpose.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from xopt.errors import HyperparameterError
from xopt.jax import _contract
from xopt.jax._lowrank import (
    NARROW,
    check_float_leaf,
    decomposition_guard,
    group_key,
    inject_for,
    leaf_specs,
    narrow_dtype,
    narrow_update,
    path_names,
    resolve_spec,
    switch_grouped,
)
from xopt.jax._precision import full_precision
from xopt.jax.sharding import on_owner
from xopt.registry import register
from xopt.specs import galore as _spec
from xopt.specs import lowrank

__all__ = ["GaLoreState", "galore"]

_LABEL = "xopt.jax.galore"


class GaLoreState(NamedTuple):
    """State of :func:`galore` (the spec's ``"xopt.jax"`` naming).

    Attributes:
      count: int32 scalar: updates taken, t (``optax.safe_increment``).
      mu, nu: Adam's moments, uncorrected; the params' structure, each leaf of
        :func:`xopt.specs.galore.low_rank_shape` (``(r, n)``, ``(m, r)`` or ``(r, r)`` for
        projected matrices, the parameter's shape otherwise) in the parameter's dtype
        promoted to float32, as the spec's state (a bfloat16/float16 leaf's update is
        float32: ``optax.apply_updates`` rounds its new value once, as the spec's step).
      ortho: the params' structure with the projection of each projected leaf
        (:func:`xopt.specs.galore.ortho_shape`) and None elsewhere, in the moments' dtype.
      ortho_right: ``Vᵀ[:r, :]`` (``r × n``) of ``proj_type="full"`` leaves, None elsewhere.
      nonfinite_skips: int32 ``()`` under ``nonfinite="skip"``, else None.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    ortho: optax.Updates
    ortho_right: optax.Updates
    nonfinite_skips: jax.Array | None = None


def galore(
    learning_rate: optax.ScalarOrSchedule | None = None,
    rank: int | None = None,
    update_proj_gap: int | None = None,
    scale: float | None = None,
    *,
    b1: float | None = None,
    b2: float | None = None,
    eps: float | None = None,
    eps_root: float | None = None,
    weight_decay: float | None = None,
    correct_bias: bool | None = None,
    proj_type: str | None = None,
    proj_dtype: str | None = None,
    project: bool | None = None,
    convention: str | None = None,
    preset: str | None = None,
    spec: _spec.GaLore | None = None,
    param_specs: Any = None,
    mask: Any = None,
    check_finite: bool = False,
    nonfinite: str | None = None,
    **unknown: Any,
) -> optax.GradientTransformationExtraArgs:
    """GaLore (Zhao et al., 2024, Algorithm 2) as an optax transformation.

    Every field left ``None`` comes from ``preset`` (``"authors"``, the default: the authors'
    GaLoreAdamW; ``"optax"``: optax.contrib.galore), or all of them from ``spec``.

    Args:
      learning_rate: η, a number or an optax schedule (called with the count before this
        update's increment, as ``scale_by_learning_rate``; a schedule sets η for every
        leaf, overriding the per-leaf specs' ``lr``).
      rank, update_proj_gap, scale, b1, b2, eps, eps_root, weight_decay, correct_bias,
        proj_type, proj_dtype, project, convention: fields of
        :class:`xopt.specs.galore.GaLore`. ``proj_dtype="param"``: a projected
        bfloat16/float16 leaf's products run in its dtype (its state and updates are
        float32 under either setting, :class:`GaLoreState`).
        The floats may be 0-d arrays (``optax.inject_hyperparams`` injects each);
        ``rank`` and ``update_proj_gap`` fix shapes and control flow: Python ints (name
        them in ``static_args`` under ``optax.inject_hyperparams``).
      spec: one :class:`xopt.specs.galore.GaLore` for every leaf not in ``param_specs``.
      param_specs: per-leaf specs (see the module docstring).
      mask: weight decay only, as optax's ``mask``: a pytree of bools like the params (or
        a function of the params returning one); False leaves get no decay.
      nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` (:mod:`xopt.nonfinite`).
        ``"raise"`` (outside ``jit`` only) also raises
        :class:`xopt.errors.DecompositionError` naming the leaf when a refresh's SVD is not
        finite; otherwise such a refresh keeps the previous projection.
      check_finite: ``True`` is the older spelling of ``nonfinite="raise"``.

    Returns:
      ``init(params) -> GaLoreState``; ``update(grads, state, params=None, *, inject=None,
      **extra) -> (updates, state)``. ``params`` is needed when weight decay is on.
      ``inject={leaf path: {"ortho_matrix": P}}`` replaces the SVD's projection at a
      refresh (ignored at other updates).

    Raises:
      HyperparameterError: an unknown or invalid field, a rank larger than a projected
        leaf allows, a non-floating leaf (naming the leaf, at ``init``).
    """
    _contract.reject_unknown(_LABEL, unknown, galore)
    _contract.require_static(_LABEL, rank=rank, update_proj_gap=update_proj_gap)
    mode = _contract.resolve_nonfinite(_LABEL, nonfinite, check_finite)
    check = mode == "raise"
    fields = dict(rank=rank, update_proj_gap=update_proj_gap, scale=scale, b1=b1, b2=b2,
                  eps=eps, eps_root=eps_root, weight_decay=weight_decay,
                  correct_bias=correct_bias, proj_type=proj_type, proj_dtype=proj_dtype,
                  project=project,
                  convention=convention)
    base, schedule = resolve_spec(_LABEL, _spec.SPEC, spec, preset, fields,
                                  learning_rate)
    if base.convention == "authors" and eps_root is not None and \
            not isinstance(eps_root, (int, float)):
        # the spec refuses ε_root ≠ 0 here; an array (optax.inject_hyperparams) cannot be
        # checked, and would be silently unread
        raise HyperparameterError(
            f"{_LABEL}: eps_root is an array, but convention='authors' does not read it (the "
            "authors' AdamW has no ε_root; convention='optax' does): leave eps_root out")

    def specs_of(tree: Any) -> list[_spec.GaLore]:
        return leaf_specs(tree, base, param_specs, _spec.GaLore, _LABEL)

    def check_leaves(tree: Any) -> tuple[list[str], list[_spec.GaLore]]:
        names, specs = path_names(tree), specs_of(tree)
        for n, leaf, h in zip(names, jax.tree.leaves(tree), specs, strict=True):
            check_float_leaf(leaf, f"{_LABEL}: {n}")
            if _spec.is_projected(tuple(leaf.shape), h):
                lowrank.check_rank(h.rank, tuple(leaf.shape), f"{_LABEL}: {n}")
        return names, specs

    def init_fn(params: optax.Params) -> GaLoreState:
        _, specs = check_leaves(params)
        leaves, treedef = jax.tree.flatten(params)
        mu, ortho, ortho_r = [], [], []
        for p, h in zip(leaves, specs, strict=True):
            shape = tuple(p.shape)
            projected = _spec.is_projected(shape, h)
            # the spec's state: the parameter's dtype promoted to float32 (as xopt.torch)
            dt = jnp.promote_types(p.dtype, jnp.float32)
            mu.append(jnp.zeros(_spec.low_rank_shape(shape, h), dt))
            ortho.append(jnp.zeros(_spec.ortho_shape(shape, h), dt) if projected else None)
            ortho_r.append(jnp.zeros((h.rank, shape[1]), dt)
                           if projected and h.proj_type == "full" else None)
        return GaLoreState(count=jnp.zeros([], jnp.int32), mu=treedef.unflatten(mu),
                           nu=treedef.unflatten([jnp.zeros_like(m) for m in mu]),
                           ortho=treedef.unflatten(ortho), ortho_right=treedef.unflatten(ortho_r))

    def update_fn(updates: optax.Updates, state: GaLoreState, params: optax.Params = None,
                  *, inject: Mapping[str, Mapping[str, Any]] | None = None,
                  **extra_args: Any) -> tuple[optax.Updates, GaLoreState]:
        del extra_args  # value=loss and the like: unused
        names, specs = check_leaves(updates)
        g_leaves, treedef = jax.tree.flatten(updates)
        p_leaves = treedef.flatten_up_to(params) if params is not None else [None] * len(names)
        m_leaves = treedef.flatten_up_to(state.mu)
        v_leaves = treedef.flatten_up_to(state.nu)
        o_leaves = treedef.flatten_up_to(state.ortho)
        or_leaves = treedef.flatten_up_to(state.ortho_right)
        injected = inject_for(inject, names, _LABEL)
        if mask is None:
            decay = [True] * len(names)
        else:
            given = mask(params if params is not None else updates) if callable(mask) else mask
            decay = [bool(x) for x in treedef.flatten_up_to(given)]
        count_inc = optax.safe_increment(state.count)
        lr_now = schedule(state.count) if schedule is not None else None

        hs = []
        for i, (name, h) in enumerate(zip(names, specs, strict=True)):
            h = h if decay[i] else h.replace(weight_decay=0.0)
            wd_on = not (isinstance(h.weight_decay, (int, float)) and h.weight_decay == 0)
            if wd_on and p_leaves[i] is None:
                raise ValueError(f"{_LABEL}: update(grads, state, params) needs params: "
                                 f"weight_decay = {h.weight_decay!r} multiplies {name}")
            hs.append(h)

        # the refresh (the SVD) sits in one lax.switch per group of leaves with one shape
        # and setting, computing each leaf of the group in turn (switch_grouped)
        projected = [i for i, (g, h) in enumerate(zip(g_leaves, hs, strict=True))
                     if _spec.is_projected(tuple(g.shape), h)]
        args = [(g_leaves[i], o_leaves[i], or_leaves[i], injected[i]) for i in projected]
        # nonfinite="raise" names the leaf whose SVD failed: one leaf at a time
        keys = [group_key(hs[i], a, batchable=not check)
                for i, a in zip(projected, args, strict=True)]
        done = switch_grouped(
            keys, lambda j: _spec.refresh_due(state.count, hs[projected[j]]).astype(jnp.int32),
            2, lambda j, a, due: _refresh(hs[projected[j]], *a, bool(due), projected[j]),
            args)
        refreshed: list[tuple[Any, Any]] = [(None, None)] * len(names)
        for i, (ortho, ortho_r, ok) in zip(projected, done, strict=True):
            decomposition_guard(_LABEL, names[i], ok, check)
            refreshed[i] = (ortho, ortho_r)

        out_u, out_m, out_v, out_o, out_or = [], [], [], [], []
        for i, h in enumerate(hs):
            g, p = g_leaves[i], p_leaves[i]
            ortho, ortho_r = refreshed[i]
            low = narrow_dtype(h, g.dtype, m_leaves[i].dtype) if ortho is not None else None
            if low is None:  # in the state's dtype; a narrower leaf's update stays wide
                # (optax.apply_updates then rounds the new parameter once, as the spec does)
                wide = m_leaves[i].dtype
                lr = h.lr if lr_now is None else jnp.asarray(lr_now, wide)
                u, m, v = _spec.direction(jnp, h, g.astype(wide), m_leaves[i], v_leaves[i],
                                          ortho, ortho_r, count_inc)
                out_u.append(_spec.additive_update(
                    h, None if p is None else p.astype(wide), u, count_inc, lr))
            else:  # the spec's tensor_update with p in its own dtype, as optax updates
                lr = h.lr if lr_now is None else jnp.asarray(lr_now, jnp.float32)
                u, m, v = _spec.direction(NARROW, h, g, m_leaves[i], v_leaves[i], ortho,
                                          ortho_r, count_inc, low=low)
                step = lowrank.hf_step_size(lr, h.b1, h.b2, count_inc, h.correct_bias)
                out_u.append(narrow_update(p, u, step, lr, h.weight_decay))
            out_m.append(m.astype(m_leaves[i].dtype))
            out_v.append(v.astype(v_leaves[i].dtype))
            out_o.append(ortho)
            out_or.append(ortho_r)
        new_state = GaLoreState(count=count_inc, mu=treedef.unflatten(out_m),
                                nu=treedef.unflatten(out_v), ortho=treedef.unflatten(out_o),
                                ortho_right=treedef.unflatten(out_or))
        return treedef.unflatten(out_u), new_state

    return _contract.transformation(_LABEL, init_fn, full_precision(update_fn), nonfinite=mode)


def _refresh(h: _spec.GaLore, g: jax.Array, old: jax.Array, old_r: Any,
             inj: Mapping[str, Any] | None, due: bool, index: int
             ) -> tuple[jax.Array, Any, jax.Array]:
    """``(projection, right projection, ok)`` after this update's refresh rule (``due``
    known at trace time): the SVD's (or the injected) at a refresh, ``old`` otherwise; a
    refresh whose SVD is not finite keeps ``old`` (``ok`` false). The SVD runs on one
    device of the gradient's mesh (:func:`xopt.jax.sharding.on_owner`, the ``index``-th
    matrix)."""
    which = _spec.side(tuple(g.shape), h.proj_type)
    full = which == "full"
    injected = _spec.injected_projection(inj, old_r, which,
                                         cast=lambda a: jnp.asarray(a, old.dtype))
    if not due or injected is not None:
        o, o_r = lowrank.refresh(due, (old, old_r), None, injected)
        return o, o_r, jnp.array(True)

    def fresh() -> tuple[jax.Array, jax.Array, jax.Array]:
        o, o_r, sv = on_owner(lambda a: _spec.fresh_projection(jnp, h, a),
                              g.astype(jnp.promote_types(g.dtype, jnp.float32)), index=index)
        o_r = o_r if full else o
        ok = jnp.all(jnp.isfinite(sv)) & jnp.all(jnp.isfinite(o)) & jnp.all(jnp.isfinite(o_r))
        return o.astype(old.dtype), o_r.astype(old.dtype) if full else old, ok

    cand, cand_r, ok = lowrank.refresh(due, None, fresh)
    new = jnp.where(ok, cand, old)
    new_r = jnp.where(ok, cand_r, old_r) if full else None
    return new, new_r, ok


_contract.public_signature(galore)


register("galore", "jax", galore)
