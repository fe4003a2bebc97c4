"""COAP as an optax gradient transformation, computing :mod:`xopt.specs.coap`'s math.

:func:`coap` returns an ``optax.GradientTransformationExtraArgs`` (jit-able, works in
``optax.chain``; ``update(..., inject=...)`` and ``value=`` are extra arguments). Each leaf
calls the spec's pure functions (projection, Eqn 6 in closed form, Eqn 7, the authors'
AdamW or Adafactor arithmetic); this module threads the pytree and the count, and picks the
projection event with ``lax.switch`` so that a decomposition or an Eqn-6 step runs only at
the updates that need it.

Projected leaves are chosen per leaf, as optax users choose masks: ``param_specs`` gives a
:class:`xopt.specs.coap.COAP` per leaf (a pytree of specs/None, a function of the params
returning one, or ``{leaf path: spec}``); ``project=False`` on a leaf steps it with the base
optimizer unprojected, ``"auto"`` (default) projects a matrix unless ``rank ≥ min(shape)``,
``True`` projects every matrix (a rank too large is an error naming the leaf). 4-D
convolution kernels are projected by Tucker-2 when ``rank_ratio_cnn`` is set, read in the
spec's ``O × I × k₁ × k₂`` (torch's layout) or, with ``kernel_layout="HWIO"``, in Flax's
``k₁ × k₂ × I × O`` (transposed to the spec's layout for the step and back, so that the two
layouts of one kernel take the same update; the state keeps the spec's shapes);
``state_bits=8`` keeps the AdamW moments as bitsandbytes' blockwise 8-bit codes and scales
(:mod:`xopt.specs.coap`).

State (:class:`COAPState`, the spec's ``"xopt.jax"`` naming) is held in the parameter's
dtype promoted to at least float32 (bfloat16/float16 leaves keep float32 state, and their
updates are float32: ``optax.apply_updates`` rounds the new value once into the leaf's
dtype, as the spec's step). Under ``proj_dtype="param"`` a projected bfloat16/float16
matrix's two products run in its dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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
    map_grouped,
    narrow_update,
    path_names,
    resolve_spec,
)
from xopt.jax._precision import full_precision
from xopt.registry import register
from xopt.specs import coap as _spec
from xopt.specs import lowrank
from xopt.specs.arrays import is_static_zero

__all__ = ["COAPState", "coap"]

_LABEL = "xopt.jax.coap"


class COAPState(NamedTuple):
    """State of :func:`coap`; every field but ``count`` has the params' structure, with
    None where a leaf has no such variable.

    Attributes:
      count: int32 scalar: updates taken, t (``optax.safe_increment``).
      mu: first moment M, :func:`xopt.specs.coap.low_rank_shape` (``(m, r)`` right,
        ``(r, n)`` left, the leaf's shape unprojected); None for Adafactor with ``b1=None``.
      nu: AdamW's second moment (shape of ``mu``); Adafactor's unfactored one for leaves
        of fewer than 2 dims.
      nu_row, nu_col: Adafactor's factored second moment (``shape[:-1]``,
        ``shape[:-2] + shape[-1:]`` of the low-rank shape).
      rms: Adafactor: RMS of the leaf before the last update (0-d).
      proj: P of projected leaves (:func:`xopt.specs.coap.proj_shape`; a kernel's U₀).
      proj_in: a Tucker-2 kernel's U₁ (``(I, r₁)``).
      proj_grad, proj_in_grad: a kernel's carried clipped Eqn-6 gradients
        (``carry_factor_grad``).
      mu_codes, mu_absmax, nu_codes, nu_absmax: under ``state_bits=8``, the moments as
        uint8 codes (the moment's shape) and float32 absmax per block of 4096, in place of
        ``mu``/``nu`` (plain arrays: they checkpoint and shard as any other state).
      nonfinite_skips: int32 ``()`` under ``nonfinite="skip"``, else None.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    nu_row: optax.Updates
    nu_col: optax.Updates
    rms: optax.Updates
    proj: optax.Updates
    proj_in: optax.Updates = None
    proj_grad: optax.Updates = None
    proj_in_grad: optax.Updates = None
    mu_codes: optax.Updates = None
    mu_absmax: optax.Updates = None
    nu_codes: optax.Updates = None
    nu_absmax: optax.Updates = None
    nonfinite_skips: jax.Array | None = None


# kernel_layout -> (axes that put a 4-D leaf in the spec's O×I×k₁×k₂, axes that undo it)
_LAYOUTS = {"OIHW": ((0, 1, 2, 3), (0, 1, 2, 3)), "HWIO": ((3, 2, 0, 1), (2, 3, 1, 0))}

# canonical state variable -> COAPState field
_FIELDS = {"m": "mu", "v": "nu", "v_row": "nu_row", "v_col": "nu_col", "rms": "rms",
           "P": "proj", "P_in": "proj_in", "P_grad": "proj_grad",
           "P_in_grad": "proj_in_grad", "m_q": "mu_codes", "m_absmax": "mu_absmax",
           "v_q": "nu_codes", "v_absmax": "nu_absmax"}


def coap(
    learning_rate: optax.ScalarOrSchedule | None = None,
    rank: int | None = None,
    update_interval: int | None = None,
    reproject_factor: int | None = None,
    *,
    optimizer: str | None = None,
    rank_ratio: float | None = None,
    rank_ratio_cnn: float | None = None,
    min_conv_size: int | None = None,
    carry_factor_grad: bool | None = None,
    state_bits: int | None = None,
    quant_rounding: str | None = None,
    kernel_layout: str = "OIHW",
    project: str | bool | None = None,
    restore_state: bool | None = None,
    scale: float | None = None,
    proj_dtype: str | None = None,
    b1: float | None = None,
    b2: float | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    correct_bias: bool | None = None,
    eps_sq: float | None = None,
    eps_scale: float | None = None,
    clip_threshold: float | None = None,
    decay_rate: float | None = None,
    scale_parameter: bool | None = None,
    relative_step: bool | None = None,
    warmup_init: bool | None = None,
    proj_lr: float | None = None,
    proj_max_norm: float | None = None,
    seed: int | None = None,
    preset: str | None = None,
    spec: _spec.COAP | None = None,
    param_specs: Any = None,
    check_finite: bool = False,
    nonfinite: str | None = None,
    **unknown: Any,
) -> optax.GradientTransformationExtraArgs:
    """COAP (Xiao et al., CVPR 2025; Algorithm 1 with Eqns 6 and 7) as an optax transformation.

    Every field left ``None`` comes from ``preset`` (``"adamw"``, the default: the authors'
    CoapAdamW; ``"adafactor"``: CoapAdafactor, with ``b1=None``), or all from ``spec``.
    Adafactor's ``b1=None`` is the authors' default; ``b1`` cannot be set to None through
    this keyword (None means "not given"): use the preset or ``spec``.

    Args:
      learning_rate: η, a number or an optax schedule of the count before this update (a
        schedule sets η for every leaf, overriding the per-leaf specs' ``lr``).
      rank, update_interval, reproject_factor, ...: fields of
        :class:`xopt.specs.coap.COAP`. The floats may be 0-d arrays
        (``optax.inject_hyperparams`` injects each); ``rank``, ``rank_ratio``, the
        intervals and ``seed`` fix shapes, control flow and the first projection: Python
        numbers (``static_args`` under ``optax.inject_hyperparams``).
      kernel_layout: how a 4-D leaf's axes are laid out: ``"OIHW"`` (default; torch, and
        ``jax.lax.conv``'s default) or ``"HWIO"`` (``flax.linen.Conv``'s kernels). Not a
        spec field: it says how the pytree stores a kernel, not how COAP steps it.
      spec: one :class:`xopt.specs.coap.COAP` for every leaf not in ``param_specs``.
      param_specs: per-leaf specs (see the module docstring).
      nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` (:mod:`xopt.nonfinite`).
        ``"raise"`` (outside ``jit`` only) also raises
        :class:`xopt.errors.DecompositionError` naming the leaf when a projection update is
        not finite; otherwise such an update keeps the previous projection.
      check_finite: ``True`` is the older spelling of ``nonfinite="raise"``.

    Returns:
      ``init(params) -> COAPState``; ``update(grads, state, params, *, inject=None,
      **extra) -> (updates, state)``. ``params`` is needed by Adafactor (its step scales
      with RMS(W)) and by weight decay. ``inject={leaf path: {"ortho_matrix": P}}``
      replaces the decomposition's ``P`` at the updates that decompose (the first, and the
      Eqn-7 ones; ignored at others).

    Raises:
      HyperparameterError: an unknown or invalid field, a rank larger than a projected leaf
        allows, a non-floating leaf (naming the leaf, at ``init`` and ``update``).
    """
    _contract.reject_unknown(_LABEL, unknown, coap)
    _contract.require_static(_LABEL, rank=rank, rank_ratio=rank_ratio,
                             rank_ratio_cnn=rank_ratio_cnn, min_conv_size=min_conv_size,
                             state_bits=state_bits,
                             update_interval=update_interval,
                             reproject_factor=reproject_factor, seed=seed)
    if kernel_layout not in _LAYOUTS:
        raise HyperparameterError(f"{_LABEL}: kernel_layout {kernel_layout!r}: expected one "
                                  f"of {', '.join(map(repr, _LAYOUTS))}")
    to_spec, from_spec = _LAYOUTS[kernel_layout]

    def spec_shape(leaf: Any) -> tuple[int, ...]:
        shape = tuple(leaf.shape)
        return tuple(shape[a] for a in to_spec) if len(shape) == 4 else shape

    def to_spec_layout(x: Any) -> Any:
        return x.transpose(to_spec) if x.ndim == 4 and to_spec != (0, 1, 2, 3) else x

    def from_spec_layout(x: Any) -> Any:
        return x.transpose(from_spec) if x.ndim == 4 and from_spec != (0, 1, 2, 3) else x

    mode = _contract.resolve_nonfinite(_LABEL, nonfinite, check_finite)
    check_decomposition = mode == "raise"
    fields = dict(rank=rank, update_interval=update_interval, reproject_factor=reproject_factor,
                  optimizer=optimizer, rank_ratio=rank_ratio, rank_ratio_cnn=rank_ratio_cnn,
                  min_conv_size=min_conv_size, carry_factor_grad=carry_factor_grad,
                  state_bits=state_bits,
                  quant_rounding=quant_rounding, project=project,
                  restore_state=restore_state, scale=scale, proj_dtype=proj_dtype,
                  b1=b1, b2=b2, eps=eps,
                  weight_decay=weight_decay, correct_bias=correct_bias, eps_sq=eps_sq,
                  eps_scale=eps_scale, clip_threshold=clip_threshold, decay_rate=decay_rate,
                  scale_parameter=scale_parameter, relative_step=relative_step,
                  warmup_init=warmup_init, proj_lr=proj_lr, proj_max_norm=proj_max_norm,
                  seed=seed)
    base, schedule = resolve_spec(_LABEL, _spec.SPEC, spec, preset, fields,
                                  learning_rate)

    def check_leaves(tree: Any) -> tuple[list[str], list[_spec.COAP]]:
        names = path_names(tree)
        specs = leaf_specs(tree, base, param_specs, _spec.COAP, _LABEL)
        for n, leaf, h in zip(names, jax.tree.leaves(tree), specs, strict=True):
            check_float_leaf(leaf, f"{_LABEL}: {n}")
            _spec.check_param(spec_shape(leaf), h, f"{_LABEL}: {n}")
        return names, specs

    def init_fn(params: optax.Params) -> COAPState:
        _, specs = check_leaves(params)
        leaves, treedef = jax.tree.flatten(params)
        fields: dict[str, list[Any]] = {k: [] for k in _FIELDS}
        for p, h in zip(leaves, specs, strict=True):
            shape = spec_shape(p)
            dt = jnp.promote_types(p.dtype, jnp.float32)
            for var in fields:
                v = _spec.STATE.var(var)
                vdt = dt if v.dtype == "state" else jnp.dtype(v.dtype)
                fields[var].append(jnp.zeros(v.shape(shape, h), vdt)
                                   if v.exists_for(shape, h) else None)
        return COAPState(count=jnp.zeros([], jnp.int32),
                         **{_FIELDS[k]: treedef.unflatten(v) for k, v in fields.items()})

    def update_fn(updates: optax.Updates, state: COAPState, params: optax.Params = None,
                  *, inject: Mapping[str, Mapping[str, Any]] | None = None,
                  **extra_args: Any) -> tuple[optax.Updates, COAPState]:
        del extra_args  # value=loss and the like: unused
        names, specs = check_leaves(updates)
        g_leaves, treedef = jax.tree.flatten(updates)
        p_leaves = treedef.flatten_up_to(params) if params is not None else [None] * len(names)
        old = {var: treedef.flatten_up_to(getattr(state, f)) for var, f in _FIELDS.items()}
        injected = inject_for(inject, names, _LABEL)
        t = state.count
        count_inc = optax.safe_increment(state.count)
        lr_now = schedule(state.count) if schedule is not None else None

        # one array for every leaf's η, so that leaves of one setting still group
        lr_arr = None if lr_now is None else jnp.asarray(lr_now, jnp.float32)
        hs = []
        for i, (name, h) in enumerate(zip(names, specs, strict=True)):
            if p_leaves[i] is None and (h.optimizer == "adafactor"
                                        or not is_static_zero(h.weight_decay)):
                raise ValueError(f"{_LABEL}: update(grads, state, params) needs params "
                                 f"({name}: Adafactor scales its step by RMS(W); weight decay "
                                 "multiplies W)")
            hs.append(h if lr_arr is None else h.replace(lr=lr_arr))

        def widen(i: int) -> tuple[jax.Array, Any]:
            g = g_leaves[i]
            dt = jnp.promote_types(g.dtype, jnp.float32)
            return to_spec_layout(g.astype(dt)), dt

        states = [{var: old[var][i] for var in old if old[var][i] is not None}
                  for i in range(len(names))]
        # the projection events (Eqn 6/7, the decompositions, the moments' restoration) run
        # once per group of projected leaves of one shape and setting, under vmap, and
        # return only the new projections (and restored moments); the step itself is per
        # leaf, where XLA compiles the identical kernels of same-shaped leaves once (a
        # group's stacked results are unstacked by slices, each a kernel of its own).
        # nonfinite="raise" names the leaf whose decomposition failed: one leaf at a time.
        projected = [i for i in range(len(names))
                     if _spec.is_projected(spec_shape(g_leaves[i]), hs[i])]
        ev_args = [(widen(i)[0], _event_inputs(hs[i], states[i]), injected[i])
                   for i in projected]
        keys = [group_key(hs[i], a, batchable=not check_decomposition)
                for i, a in zip(projected, ev_args, strict=True)]
        events = map_grouped(keys, lambda j, a: _refresh(hs[projected[j]], *a, t), ev_args,
                             count=t)
        refreshed: list[Any] = [None] * len(names)
        for i, (upd, ok) in zip(projected, events, strict=True):
            decomposition_guard(_LABEL, names[i], ok, check_decomposition)
            refreshed[i] = upd

        out_u: list[Any] = []
        new: dict[str, list[Any]] = {var: [] for var in old}
        for i in range(len(names)):
            g, p = g_leaves[i], p_leaves[i]
            g32, dt = widen(i)
            p32 = jnp.zeros(g32.shape, dt) if p is None else to_spec_layout(p.astype(dt))
            low = _spec.low_dtype(tuple(g32.shape), hs[i], g.dtype, dt)
            new_p, st = _leaf_step(hs[i], p32, g32, dict(states[i]), refreshed[i], count_inc,
                                   low=low, p_low=p)
            # with low: already the additive update (a matrix: no layout); else in the
            # state's dtype, so that apply_updates rounds a narrower leaf's new value once
            out_u.append(new_p if low is not None else from_spec_layout(new_p - p32))
            for var in old:
                new[var].append(st.get(var))
        u = treedef.unflatten(out_u)
        return u, COAPState(count=count_inc,
                            **{_FIELDS[var]: treedef.unflatten(v) for var, v in new.items()})

    return _contract.transformation(_LABEL, init_fn, full_precision(update_fn), nonfinite=mode)


_contract.public_signature(coap)


def _event(t: jax.Array, h: _spec.COAP) -> jax.Array:
    """:func:`xopt.specs.coap.event` of a traced count."""
    due = (t % h.update_interval) == 0
    svd = (t % (h.update_interval * h.reproject_factor)) == 0
    ev = jnp.where(due, jnp.where(svd, _spec.EQN7, _spec.EQN6), _spec.KEEP)
    return jnp.where(t == 0, _spec.INITIAL, ev).astype(jnp.int32)


def _event_inputs(h: _spec.COAP, st: Mapping[str, Any]) -> dict[str, Any]:
    """What a projection event reads of a leaf's state: the projection (and a kernel's
    carried gradients), Eqn 6's ``M`` and, to restore them, both moments (every array the
    group's events stack is a copy at every update)."""
    moments = {"m_q", "m_absmax", "v_q", "v_absmax"} if h.state_bits == 8 else \
        ({"m", "v"} if h.restore_state else {"m"})
    return {k: v for k, v in st.items() if k in moments or k.startswith("P")}


@functools.lru_cache(maxsize=32)
def _omega_of(seed: int, shape: tuple[int, int], rank: int) -> np.ndarray:
    omega = np.asarray(_spec.initial_omega(_spec.SPEC.hyperparams(rank=rank, seed=seed),
                                           shape))
    omega.flags.writeable = False
    return omega


def _initial_omega(h: _spec.COAP, shape: tuple[int, ...]) -> np.ndarray:
    """:func:`xopt.specs.coap.initial_omega` drawn once per seed and shape, in NumPy (the
    same bits as the JAX draw, :mod:`xopt.random`): a constant of the program rather than a
    draw compiled into every group's event branch."""
    o_shape = _spec.omega_shape(shape, h)
    return _omega_of(int(h.seed), (shape[0], shape[1]), o_shape[1])


def _refresh(h: _spec.COAP, g: jax.Array, st: dict[str, Any], inj: Mapping[str, Any] | None,
             t: jax.Array) -> tuple[dict[str, Any], jax.Array]:
    """This update's projection event (:func:`xopt.specs.coap.param_step`'s first half, the
    event chosen under ``jit``): ``(new, ok)`` with ``new`` the projection (``P``,
    ``P_in``), a kernel's carried gradients and, under ``restore_state``, the moments
    (``"m"``, ``"v"``, dequantised); an event whose result is not finite keeps the old
    projection (``ok`` false)."""
    shape = tuple(g.shape)
    m_cur, v_cur = _spec.moments_of(jnp, h, st)
    side = _spec.side_of(shape)
    p_old = _spec.projection_of(st, shape)
    carried = _spec.carried_of(st, shape, h)
    ev = _event(t, h)
    given = _spec.injected_projection(inj, side)
    if given is not None:
        given = jax.tree.map(lambda a, o: jnp.asarray(a, o.dtype), given, p_old)

    def eqn6() -> tuple[Any, Any]:
        m6 = _spec.eqn6_moment(jnp, h, m_cur, g, p_old, side)
        if side == "tucker":
            f, clipped = _spec.tucker_eqn6_step(jnp, p_old, m6, g, h.proj_lr,
                                                h.proj_max_norm, carried)
            return f, (clipped if carried is not None else None)
        return _spec.eqn6_step(jnp, p_old, m6, g, side, h.proj_lr, h.proj_max_norm), None

    def eqn7() -> tuple[Any, Any]:
        # fresh factors carry no gradient
        zeros = None if carried is None else tuple(jnp.zeros_like(c) for c in carried)
        if given is not None:
            return given, zeros
        if side == "tucker":  # afresh at events 1 and 3
            return _spec.new_projection(jnp, h, shape, g, p_old, _spec.INITIAL,
                                        while_loop=jax.lax.while_loop), zeros
        # events 1 and 3 share one decomposition; only Ω differs: the seeded draw at the
        # first update (a constant: a function of the seed and shape), the old P after
        omega = jnp.where(ev == _spec.INITIAL, _initial_omega(h, shape).astype(g.dtype),
                          _spec.warm_omega(p_old, side))
        return _spec.decompose(jnp, g, omega, side), zeros

    def keep() -> tuple[Any, Any]:
        return p_old, carried

    # one switch over the events: keep, Eqn 6, Eqn 7 (or the first decomposition)
    branch = jnp.where(ev == _spec.KEEP, 0, jnp.where(ev == _spec.EQN6, 1, 2))
    cand, carry_new = jax.lax.switch(branch, [keep, eqn6, eqn7])
    ok = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(c)) for c in jax.tree.leaves(cand)]))
    p_new = jax.tree.map(lambda c, o: jnp.where(ok, c, o), cand, p_old)
    new: dict[str, Any] = {}
    if carried is not None:
        _spec.store_carried(new, tuple(jnp.where(ok, c, o)
                                       for c, o in zip(carry_new, carried, strict=True)))
    if h.restore_state and m_cur is not None:
        m_old, v_old = m_cur, v_cur

        def restored() -> tuple[Any, Any]:
            m, v = _spec.restore_moments(jnp, h, m_old, v_old, p_old, p_new, side)
            v = v_old if h.optimizer != "adamw" else v
            if h.state_bits == 8:  # stored quantised, read back
                q: dict[str, Any] = {}
                _spec.store_moments(jnp, h, q, m, v)
                m, v = _spec.moments_of(jnp, h, q)
            return m, v

        def kept() -> tuple[Any, Any]:
            return m_old, v_old

        new["m"], new["v"] = jax.lax.cond(ev >= _spec.EQN6, restored, kept)
        if new["v"] is None:
            del new["v"]
    _spec.store_projection(new, p_new, shape)
    return new, ok


def _leaf_step(h: _spec.COAP, p: jax.Array, g: jax.Array, st: dict[str, Any],
               refreshed: dict[str, Any] | None, count_inc: jax.Array, *, low: Any = None,
               p_low: jax.Array | None = None) -> tuple[jax.Array, dict[str, Any]]:
    """:func:`xopt.specs.coap.param_step`'s step after this update's event (``refreshed``,
    :func:`_refresh`; None for a leaf not projected): the new ``p``, or with ``low``
    (``proj_dtype="param"``, :func:`xopt.specs.coap.low_dtype`; ``p_low`` the parameter in
    that dtype) the float32 additive update of the spec's parameter-dtype step."""
    shape = tuple(p.shape)
    projected = refreshed is not None
    m_cur, v_cur = _spec.moments_of(jnp, h, st)
    r = g
    side = None
    if projected:
        side = _spec.side_of(shape)
        refreshed = dict(refreshed)
        if "m" in refreshed:  # restore_state: the moments carried into the new subspace
            m_cur, v_cur = refreshed.pop("m"), refreshed.pop("v", v_cur)
        st.update(refreshed)
        p_new = _spec.projection_of(st, shape)
        if low is None:
            r = _spec.project(jnp, g, p_new, side)
        else:  # g (float32 here) is the parameter-dtype gradient widened: exact
            r = _spec.project(NARROW, g.astype(low), p_new.astype(low), side).astype(g.dtype)
    proj = _spec.projection_of(st, shape) if projected else None
    if h.optimizer == "adamw":
        m_cur, v_cur = lowrank.hf_adam_moments(jnp, m_cur, v_cur, r, h.b1, h.b2)
        n = lowrank.hf_adam_direction(jnp, m_cur, v_cur, h.eps)
        step_size = lowrank.hf_step_size(h.lr, h.b1, h.b2, count_inc, h.correct_bias)
        if low is not None:
            full = _spec.project_back(NARROW, n.astype(low), proj.astype(low), side, h.scale)
            _spec.store_moments(jnp, h, st, m_cur, v_cur)
            return narrow_update(p_low, full, step_size, h.lr, h.weight_decay), st
        full = _spec.project_back(jnp, n, proj, side, h.scale) if projected else n
        _spec.store_moments(jnp, h, st, m_cur, v_cur)
        if isinstance(h.weight_decay, (int, float)):
            return lowrank.hf_apply(p, full, step_size, h.lr, h.weight_decay), st
        p = p - step_size * full  # a traced λ (optax.inject_hyperparams): decay unconditionally,
        return p - (h.lr * h.weight_decay) * p, st  # exact for λ = 0 (p − 0·p = p)
    if m_cur is not None:
        st["m"] = m_cur
    if v_cur is not None:
        st["v"] = v_cur
    st["rms"] = _spec.rms(jnp, p)
    lr_t = _spec.adafactor_lr(h, count_inc, st["rms"], jnp)
    beta2t = _spec.adafactor_beta2(h, count_inc, jnp, g.dtype)
    u, v, v_row, v_col = _spec.adafactor_direction(jnp, h, r, st.get("v"), st.get("v_row"),
                                                   st.get("v_col"), beta2t)
    for var, val in (("v", v), ("v_row", v_row), ("v_col", v_col)):
        if val is not None:
            st[var] = val
    u = u * lr_t
    if _spec.has_first_moment(h):
        st["m"] = st["m"] * h.b1 + u * (1.0 - h.b1)
        u = st["m"]
    full = _spec.project_back(jnp, u, proj, side, h.scale) if projected else u
    if not is_static_zero(h.weight_decay):
        p = p + p * (-h.weight_decay * lr_t)
    return p - full, st


register("coap", "jax", coap)
