"""PLUMAGE with Adam as an optax transformation, computing :mod:`xopt.specs.plumage`'s math.

:func:`plumage` returns an ``optax.GradientTransformationExtraArgs``. Each update calls the
spec's functions (the paper's Algorithm 2-5, Eq. 18-29); this module adds what JAX needs:
the refresh (SVD, Algorithm 2) and resample (Algorithm 3-4, realignment Eq. 28-29) branches
as ``lax.cond`` on the step count, so one jitted step serves every step, and the random
stream computed from the traced count.

State (:class:`PlumageState`): ``count`` (int32, updates taken), ``mu``/``nu`` (Adam's M and
V, a pytree like the params: ``(k, n)`` for a left projection, ``(m, k)`` for a right one,
the leaf's shape when not projected), and dicts keyed by leaf path name (``"mlp/0/w"``)
holding, for projected leaves only, ``projector`` (P), ``scale`` (diag D) and, when
``resample_interval`` is not a multiple of ``update_proj_gap``, ``basis`` and ``probs``.
Moments and projections are float32 for float32/bfloat16/float16 leaves (an SVD needs at
least float32), float64 for float64 leaves; a bfloat16/float16 leaf's update is float32
(``optax.apply_updates`` rounds it into the leaf once, as the spec's step does). Under
``proj_dtype="param"`` a projected bfloat16/float16 leaf's two products run in its dtype.

Random stream: leaf number ``i`` (flattening order) draws at step ``t`` from ``xopt.random``
with seed ``fold_in(seed, i, t)``: the same numbers as ``xopt.torch.PLUMAGE``'s
``i``-th parameter, so the two agree when the parameters are in the same order (a dict of
parameters flattens in sorted key order).

Choosing projected leaves: ``param_specs`` (see :mod:`xopt.jax._lowrank`), e.g.
``param_specs=lambda p: jax.tree.map(lambda x: None if x.ndim == 2 else
PLUMAGE(project=False), p)``; non-matrix leaves always take the full-rank Adam update.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from xopt import random as xrandom
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
from xopt.specs import lowrank
from xopt.specs import plumage as _spec

__all__ = ["PlumageState", "plumage"]

_LABEL = "xopt.jax.plumage"
# fold_in's tag (xopt.random.fold_in's docstring): fold_in(s, d) for d < 2**32 is
# threefry2x32(*key_from_seed(s), 0x666F6C64, d); used here with a traced d = t.
_FOLD_TAG = 0x666F6C64


class PlumageState(NamedTuple):
    """State of :func:`plumage` (the spec's ``"xopt.jax"`` naming; see the module docstring;
    ``nonfinite_skips``: int32 ``()`` under ``nonfinite="skip"``, else None)."""

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    projector: dict[str, jax.Array]
    scale: dict[str, jax.Array]
    basis: dict[str, jax.Array]
    probs: dict[str, jax.Array]
    nonfinite_skips: jax.Array | None = None


def _state_dtype(x: Any) -> Any:
    return jnp.float64 if jnp.result_type(x) == jnp.float64 else jnp.float32


def draws(seed: int, index: int, t: jax.Array, d: int) -> tuple[jax.Array, jax.Array]:
    """:func:`xopt.specs.plumage.draw` with a traced step ``t`` (int32): ``(perm, u)``."""
    return _draws_of_key(_leaf_key(seed, index), t, d)


def _leaf_key(seed: int, index: int) -> jax.Array:
    """Leaf ``index``'s two key words (uint32 ``(2,)``): an array, so that the leaves of one
    shape draw under ``jax.vmap`` with their keys as the batch."""
    s = xrandom.fold_in(int(seed), int(index))
    return jnp.asarray([s >> 32, s & 0xFFFFFFFF], jnp.uint32)


def _draws_of_key(leaf_key: jax.Array, t: jax.Array, d: int) -> tuple[jax.Array, jax.Array]:
    y0, y1 = xrandom.threefry2x32(leaf_key[0], leaf_key[1], _FOLD_TAG, t.astype(jnp.uint32),
                                  backend="jax")
    key = jnp.stack([y0, y1])
    words = xrandom.bits(key, (2, d), backend="jax")
    u = xrandom.uniform(key, (), counter=d, dtype="float32", backend="jax")
    return _spec.permutation_from_words(jnp, words), u


def plumage(learning_rate: optax.ScalarOrSchedule | None = None, b1: float | None = None,
            b2: float | None = None, eps: float | None = None,
            weight_decay: float | None = None, *, rank: int | None = None,
            update_proj_gap: int | None = None, resample_interval: int | None = None,
            proj_side: str | None = None, proj_dtype: str | None = None,
            realign_first_moment: bool | None = None,
            realign_second_moment: bool | None = None, prob_eps: float | None = None,
            seed: int | None = None, correct_bias: bool | None = None,
            eps_inside_sqrt: bool | None = None, project: bool | None = None,
            spec: _spec.PLUMAGE | None = None, param_specs: Any = None,
            preset: str | None = None, check_finite: bool = False,
            nonfinite: str | None = None, **unknown: Any,
            ) -> optax.GradientTransformationExtraArgs:
    """PLUMAGE with Adam (Haroush & Soudry, Algorithm 5) as an optax transformation.

    Args:
      learning_rate: η (default 1e-3, Section 4.4): a float, a 0-d array
        (``optax.inject_hyperparams``) or a schedule, called with the count before this
        update; it applies to every leaf.
      b1, b2, eps, weight_decay: Adam's (defaults 0.9, 0.999, 1e-8, 0.0), as in the spec.
      spec: an :class:`xopt.specs.plumage.PLUMAGE` giving every hyperparameter (then pass
        no other hyperparameter).
      param_specs: per-leaf hyperparameters (a pytree of specs or None, a function of the
        params returning one, or ``{leaf name: spec}``); see :mod:`xopt.jax._lowrank`.
      preset: ``"paper"`` or ``"glue"``.
      nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` (:mod:`xopt.nonfinite`).
        ``"raise"`` (outside ``jit`` only) also raises
        :class:`~xopt.errors.DecompositionError` naming the leaf when a refresh's SVD is
        not finite; otherwise such a refresh keeps the previous projection, probabilities
        and moments instead of writing NaN into them.
      check_finite: ``True`` is the older spelling of ``nonfinite="raise"``.
      rank, update_proj_gap, resample_interval, proj_side, proj_dtype, realign_first_moment,
      realign_second_moment, prob_eps, seed, correct_bias, eps_inside_sqrt, project: the
        spec's fields (:class:`xopt.specs.plumage.PLUMAGE`); None takes the preset's or the
        default. The floats may be 0-d arrays (``optax.inject_hyperparams`` injects each);
        the integer fields (``rank``, ``update_proj_gap``, ``resample_interval``,
        ``seed``) fix shapes and the random stream: Python ints (name the ones you pass in
        ``static_args`` under ``optax.inject_hyperparams``).

    Returns:
      ``GradientTransformationExtraArgs``: ``init(params) -> PlumageState``;
      ``update(updates, state, params=None, *, inject=None, **extra)`` where ``params``
      is needed when a weight decay is set and ``inject={leaf name: {key: array}}`` (keys:
      :data:`xopt.specs.plumage.INJECT_KEYS`) replaces a refresh's draw or SVD. Updates
      are additive (``optax.apply_updates``).
    """
    _contract.reject_unknown(_LABEL, unknown, plumage)
    _contract.require_static(_LABEL, rank=rank, update_proj_gap=update_proj_gap,
                             resample_interval=resample_interval, seed=seed)
    mode = _contract.resolve_nonfinite(_LABEL, nonfinite, check_finite)
    check_decomposition = mode == "raise"
    fields = dict(rank=rank, update_proj_gap=update_proj_gap,
                  resample_interval=resample_interval, proj_side=proj_side,
                  proj_dtype=proj_dtype,
                  realign_first_moment=realign_first_moment,
                  realign_second_moment=realign_second_moment, prob_eps=prob_eps, seed=seed,
                  correct_bias=correct_bias, eps_inside_sqrt=eps_inside_sqrt, project=project)
    hp, schedule = resolve_spec(_LABEL, _spec.SPEC, spec, preset,
                                dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                                     **fields), learning_rate)

    def specs_of(tree: Any) -> tuple[list[str], list[_spec.PLUMAGE]]:
        names = path_names(tree)
        specs = leaf_specs(tree, hp, param_specs, _spec.PLUMAGE, _LABEL)
        for name, h, x in zip(names, specs, jax.tree.leaves(tree), strict=True):
            check_float_leaf(x, f"{_LABEL}: {name}", None)
            _spec.check_param(tuple(x.shape), h, f"{_LABEL}: {name}")
        return names, specs

    def init_fn(params: optax.Params) -> PlumageState:
        names, specs = specs_of(params)
        leaves, treedef = jax.tree.flatten(params)
        mu, nu = [], []
        extra: dict[str, dict[str, jax.Array]] = {k: {} for k in
                                                  ("projector", "scale", "basis", "probs")}
        for name, h, x in zip(names, specs, leaves, strict=True):
            st = _spec.init_param_state(jnp, h, tuple(x.shape), _state_dtype(x))
            mu.append(st.pop("m"))
            nu.append(st.pop("v"))
            for k, v in st.items():
                extra[k][name] = v
        return PlumageState(count=jnp.zeros([], jnp.int32), mu=treedef.unflatten(mu),
                            nu=treedef.unflatten(nu), **extra)

    def update_fn(updates: optax.Updates, state: PlumageState, params: optax.Params = None,
                  *, inject: Mapping[str, Mapping[str, Any]] | None = None,
                  **extra_args: Any) -> tuple[optax.Updates, PlumageState]:
        del extra_args
        names, specs = specs_of(updates)
        g_leaves, treedef = jax.tree.flatten(updates)
        if params is None and any(not _is_zero(h.weight_decay) for h in specs):
            raise ValueError(f"{_LABEL}: update(...) needs params when weight_decay > 0")
        p_leaves = treedef.flatten_up_to(params) if params is not None else [None] * len(names)
        injects = inject_for(inject, names, _LABEL)
        mu_leaves = treedef.flatten_up_to(state.mu)
        nu_leaves = treedef.flatten_up_to(state.nu)
        t = state.count
        extra = {k: dict(getattr(state, k)) for k in ("projector", "scale", "basis", "probs")}
        lr = schedule(t) if schedule is not None else None

        # the refresh (SVD, draws, realignment) sits in one lax.switch per group of leaves
        # with one shape and setting, computing each leaf of the group in turn
        # (switch_grouped); the Adam step is per leaf
        states, projected, args = [], [], []
        for index, (name, h, g, m, v, inj) in enumerate(zip(
                names, specs, g_leaves, mu_leaves, nu_leaves, injects, strict=True)):
            st = {"m": m, "v": v}
            st.update({k: extra[k][name] for k in extra if name in extra[k]})
            states.append(st)
            if _spec.is_projected(tuple(g.shape), h):
                projected.append(index)
                args.append((g, st, inj, _leaf_key(h.seed, index)))

        def refresh(j: int, a: tuple, event: int) -> tuple[dict[str, jax.Array], jax.Array]:
            index = projected[j]
            g, st, inj, key = a
            g = g.astype(st["m"].dtype)
            return _refresh(specs[index], index, g, _spec.side_of(tuple(g.shape), specs[index]),
                            dict(st), t, inj, key, event)

        # nonfinite="raise" names the leaf whose SVD failed: one leaf at a time
        keys = [group_key(specs[i], a, batchable=not check_decomposition)
                for i, a in zip(projected, args, strict=True)]
        done = switch_grouped(keys, lambda j: _event(specs[projected[j]], t),
                              lambda j: _branches(specs[projected[j]]), refresh, args,
                              vmapped=lambda event: event > 0, count=t)
        refreshed: list[dict[str, jax.Array] | None] = [None] * len(names)
        for i, (st_r, ok) in zip(projected, done, strict=True):
            decomposition_guard(_LABEL, names[i], ok, check_decomposition)
            refreshed[i] = st_r
        new_u, new_mu, new_nu = [], [], []
        for name, h, g, p, st, st_r in zip(names, specs, g_leaves, p_leaves, states, refreshed,
                                           strict=True):
            u, st = _leaf_update(h, g, p, dict(st) if st_r is None else st_r, t,
                                 h.lr if lr is None else lr)
            new_u.append(u)
            new_mu.append(st.pop("m"))
            new_nu.append(st.pop("v"))
            for k, val in st.items():
                extra[k][name] = val
        return treedef.unflatten(new_u), PlumageState(
            count=optax.safe_increment(t), mu=treedef.unflatten(new_mu),
            nu=treedef.unflatten(new_nu), **extra)

    return _contract.transformation(_LABEL, init_fn, full_precision(update_fn), nonfinite=mode)


_contract.public_signature(plumage)


def _is_zero(x: Any) -> bool:
    return isinstance(x, (int, float)) and x == 0


def _leaf_update(h: _spec.PLUMAGE, g: jax.Array, p: jax.Array | None,
                 st: dict[str, jax.Array], t: jax.Array, lr: Any
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One leaf's Adam step (the spec's :func:`~xopt.specs.plumage.update_param`) on the
    state after this update's refresh (:func:`_maybe_refresh`); returns the additive update
    (in the state's dtype: float32 for a bfloat16/float16 leaf, so that
    ``optax.apply_updates`` rounds its new value once, as the spec's step) and the new
    state."""
    dtype = st["m"].dtype
    shape = tuple(g.shape)
    g_in, g = g, g.astype(dtype)
    low = None
    if _spec.is_projected(shape, h):
        side = _spec.side_of(shape, h)
        low = narrow_dtype(h, g_in.dtype, dtype)
        if low is None:
            r = _spec.project(jnp, g, st["projector"], side)
        else:
            r = _spec.project(NARROW, g_in.astype(low), st["projector"].astype(low),
                              side).astype(dtype)
    else:
        side, r = None, g
    st["m"], st["v"] = lowrank.hf_adam_moments(jnp, st["m"], st["v"], r, h.b1, h.b2)
    n = _spec.adam_direction(jnp, st["m"], st["v"], h)
    alpha = lowrank.hf_step_size(lr, h.b1, h.b2, t + 1, h.correct_bias)
    if low is not None:
        n = _spec.project_back_low(NARROW, n, st["projector"].astype(low), st["scale"], side)
        return narrow_update(p, n, alpha, lr, h.weight_decay), st
    if side is not None:
        n = _spec.project_back(jnp, n, st["projector"], st["scale"], side)
    u = -alpha * n
    if not _is_zero(h.weight_decay):  # hf_apply: p ← p − αN, then p ← p − ηλ p
        u = u - (lr * h.weight_decay) * (p.astype(dtype) + u)
    return u, st  # a narrower leaf's update stays wide: apply_updates rounds it once


def _event(h: _spec.PLUMAGE, t: jax.Array) -> jax.Array:
    """This update's refresh (int32): 0 none; with a stored basis (:func:`_branches` 3),
    1 a resample from it and 2 an SVD and a resample (``t mod τ = 0``); without one
    (every resample is an SVD step), 1 an SVD and a resample."""
    svd_now = t % h.update_proj_gap == 0
    resample = svd_now | (t % h.kappa == 0)
    if not _spec.needs_basis(h):
        return resample.astype(jnp.int32)
    return jnp.where(svd_now, 2, jnp.where(resample, 1, 0)).astype(jnp.int32)


def _branches(h: _spec.PLUMAGE) -> int:
    return 3 if _spec.needs_basis(h) else 2


def _refresh(h: _spec.PLUMAGE, index: int, g: jax.Array, side: str,
             st: dict[str, jax.Array], t: jax.Array, inject: Mapping[str, Any] | None,
             leaf_key: jax.Array, event: int) -> tuple[dict[str, jax.Array], jax.Array]:
    """Algorithm 5's refresh block for the ``event`` (:func:`_event`, known at trace time):
    ``(state, ok)``; a refresh whose SVD is not finite keeps the state (``ok`` false)."""
    if event == 0:
        return st, jnp.array(True)
    old = st
    indices = None if inject is None else inject.get("indices")

    def from_svd() -> tuple[jax.Array, jax.Array, jax.Array]:
        # on one device of the gradient's mesh (the owner rule)
        basis, probs, sigma = on_owner(
            lambda a: _spec.basis_and_probs(jnp, h, a, side, inject), g, index=index)
        ok = jnp.all(jnp.isfinite(sigma)) & jnp.all(jnp.isfinite(basis))
        return basis, probs, ok

    basis, probs, ok = lowrank.refresh(event == 2 or not _spec.needs_basis(h),
                                       (old.get("basis"), old.get("probs"),
                                        jnp.asarray(True)), from_svd)
    if indices is not None:
        idx = jnp.asarray(indices).astype(jnp.int32)
    else:
        perm, u = _draws_of_key(leaf_key, t, probs.shape[0])
        idx = _spec.sample_indices(jnp, probs, h.rank, perm, u)
    P, dvec = _spec.sample_projection(jnp, basis, probs, idx)
    m, v = _spec.realign(jnp, old["m"], old["v"], P, old["projector"], side,
                         first=h.realign_first_moment, second=h.realign_second_moment)
    new = dict(old, m=m, v=v, projector=P, scale=dvec)
    if _spec.needs_basis(h):
        new.update(basis=basis, probs=probs)
    return {k: jnp.where(ok, new[k], old[k]).astype(old[k].dtype) for k in old}, ok


register("plumage", "jax", plumage)
