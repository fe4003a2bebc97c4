"""Flora as an optax gradient transformation, computing :mod:`xopt.specs.flora`'s math.

:func:`flora` returns an :class:`optax.GradientTransformationExtraArgs` (``jit``-able,
``optax.chain``-able). Every leaf's update calls the spec's pure functions
(:func:`~xopt.specs.flora.second_moment_factored`, :func:`~xopt.specs.flora.mix`,
:func:`~xopt.specs.flora.up`/:func:`~xopt.specs.flora.down`, ...); this module adds what a
traced step needs: the transfer every ``kappa`` steps under ``lax.cond``, and the
original's seed rule (``next_seed``, torch's MT19937 generator) in uint32 arithmetic.

Seeds are kept as uint32 ``[hi, lo]`` pairs (the spec's ``"xopt.jax"`` naming decodes
them to the original's int64), so no ``jax_enable_x64`` is needed; the projections are
``xopt.random.normal`` keyed by the pair, the same matrices as xopt.torch's and the
oracle's. Leaf ``i`` (1-based, in ``jax.tree.leaves`` order) starts from seed
``seed + i``, the original's rule for parameters in that order.

``update(updates, state, params, inject={leaf name: {"proj_before": P, "proj_after":
P'}})`` uses the given projections instead of drawing (the parity harness's recorded
ones). Per-leaf settings (``param_specs``) as in :mod:`xopt.jax._lowrank`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from xopt.errors import HyperparameterError
from xopt.jax import _contract
from xopt.jax._lowrank import (
    check_float_leaf,
    group_key,
    inject_for,
    leaf_specs,
    path_names,
    switch_grouped,
)
from xopt.jax._precision import full_precision
from xopt.registry import register
from xopt.specs import flora as _spec
from xopt.specs import lowrank

__all__ = ["FloraState", "flora", "next_seed_words"]

_LABEL = "xopt.jax.flora"


class FloraState(NamedTuple):
    """State of :func:`flora` (the spec's ``"xopt.jax"`` naming).

    Attributes:
      count: int32 ``()``: updates taken, t.
      seed: per leaf, uint32 ``(2,)``: the projection seed ``[hi, lo]``.
      rms: per leaf, ``()``: RMS of the parameter before the last update.
      m: per leaf, the momentum (``(r, n)`` left / ``(m, r)`` right when compressed, else
        the leaf's shape), or None without momentum.
      v_row, v_col: per 2-D leaf with a factored second moment, ``(m,)`` and ``(n,)``;
        None for the others.
      v: per other leaf, the unfactored second moment (leaf's shape); None for factored.

    Each per-leaf field is a pytree of the parameters' structure; floating leaves are
    float32 (float64 for float64 parameters). ``nonfinite_skips``: int32 ``()`` under
    ``nonfinite="skip"``, else None.
    """

    count: jax.Array
    seed: Any
    rms: Any
    m: Any
    v_row: Any
    v_col: Any
    v: Any
    nonfinite_skips: jax.Array | None = None


_PER_LEAF = ("seed", "rms", "m", "v_row", "v_col", "v")

# -- torch's CPU generator (MT19937) in uint32 arithmetic, traceable -------------------------


def _u32(x: int) -> jax.Array:
    return jnp.asarray(x, dtype=jnp.uint32)


def _mt19937_outputs(seed_lo: jax.Array, indices: tuple[int, ...]) -> list[jax.Array]:
    """Outputs ``indices`` (each < 227) of MT19937 seeded with the uint32 ``seed_lo``, as
    :func:`xopt.specs.flora._mt19937` (the words up to ``max(indices) + 397`` of the
    initialisation, by ``lax.scan``; one twist; tempering)."""
    need = max(indices) + 397 + 1

    def body(x: jax.Array, i: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = _u32(1812433253) * (x ^ (x >> 30)) + i
        return x, x

    _, rest = jax.lax.scan(body, seed_lo, jnp.arange(1, need, dtype=jnp.uint32))
    mt = jnp.concatenate([seed_lo[None], rest])
    out = []
    for k in indices:
        y = (mt[k] & _u32(0x80000000)) | (mt[k + 1] & _u32(0x7FFFFFFF))
        y = mt[k + 397] ^ (y >> 1) ^ jnp.where((y & 1) == 1, _u32(0x9908B0DF), _u32(0))
        y = y ^ (y >> 11)
        y = y ^ ((y << 7) & _u32(0x9D2C5680))
        y = y ^ ((y << 15) & _u32(0xEFC60000))
        y = y ^ (y >> 18)
        out.append(y)
    return out


def mod_int64_max(hi: jax.Array, lo: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``((hi << 32) | lo) mod (2**63 − 1)`` on uint32 words: with ``V = a·2**63 + b``,
    ``V ≡ a + b``, and ``a + b ≤ 2**63`` needs at most one subtraction."""
    a = hi >> 31
    b_hi = hi & _u32(0x7FFFFFFF)
    r_lo = lo + a
    r_hi = b_hi + (r_lo < lo).astype(jnp.uint32)
    is_m = (r_hi == _u32(0x7FFFFFFF)) & (r_lo == _u32(0xFFFFFFFF))  # = 2**63 - 1 -> 0
    is_big = r_hi == _u32(0x80000000)  # = 2**63 -> 1
    r_hi = jnp.where(is_m | is_big, _u32(0), r_hi)
    r_lo = jnp.where(is_m, _u32(0), jnp.where(is_big, _u32(1), r_lo))
    return r_hi, r_lo


def next_seed_words(words: jax.Array, adv: int = 0xF) -> jax.Array:
    """:func:`xopt.specs.flora.next_seed` on a uint32 ``[hi, lo]`` seed (only ``lo``
    matters: torch seeds MT19937 with the seed mod 2**32); returns ``[hi, lo]``."""
    hi, lo = _mt19937_outputs(words[1].astype(jnp.uint32), (2 * adv - 2, 2 * adv - 1))
    return jnp.stack(mod_int64_max(hi, lo))


def _seed_words(seed: int) -> jax.Array:
    return jnp.asarray(_spec.encode_seed_words(seed))


# -- the transformation --------------------------------------------------------------------


def _resolve(spec: _spec.Flora | None, given: dict[str, Any]) -> _spec.Flora:
    if spec is not None:
        if not isinstance(spec, _spec.Flora):
            raise HyperparameterError(f"{_LABEL}: spec must be an xopt.specs.flora.Flora, got "
                                      f"{type(spec).__name__}")
        if given:
            raise HyperparameterError(f"{_LABEL}: pass either spec= or hyperparameters, not "
                                      f"both (got spec and {', '.join(sorted(given))})")
        return spec
    fields = {("lr" if k == "learning_rate" else k): v for k, v in given.items()}
    if "eps" in fields:
        fields["eps"] = tuple(fields["eps"])
    try:
        return _spec.SPEC.make(None, **fields)
    except HyperparameterError as e:
        raise HyperparameterError(f"{_LABEL}: {e}") from e


def _structure(h: _spec.Flora) -> _spec.Flora:
    """``h`` for the decisions that fix the state's layout. Whether there is a momentum is
    one (``beta1 > 0``); an array ``beta1`` (``optax.inject_hyperparams``) keeps it, as a
    positive Python stand-in here, while the update uses the array's value."""
    if isinstance(h.beta1, (jax.Array, np.ndarray)):
        return h.replace(beta1=0.5)
    return h


def _state_dtype(p: Any) -> Any:
    return jnp.promote_types(jnp.result_type(p), jnp.float32)


def flora(learning_rate: float | None = None, rank: int | None = None,
          kappa: int | None = None, eps: tuple[float, float] | None = None,
          clip_threshold: float | None = None, decay_rate: float | None = None,
          beta1: float | None = None, weight_decay: float | None = None,
          scale_parameter: bool | None = None, relative_step: bool | None = None,
          warmup_init: bool | None = None, factorize_second_moment: bool | None = None,
          seed: int | None = None, quantization: bool | None = None,
          project: bool | None = None, *, spec: _spec.Flora | None = None,
          param_specs: Any = None, check_finite: bool = False, nonfinite: str | None = None,
          **unknown: Any) -> optax.GradientTransformationExtraArgs:
    """Flora (see :mod:`xopt.specs.flora` for the update, Algorithm 2 of the paper).

    Args:
      learning_rate: η (the spec's ``lr``).
      rank, kappa, eps, clip_threshold, decay_rate, beta1, weight_decay, scale_parameter,
        relative_step, warmup_init, factorize_second_moment, seed, quantization, project:
        as :class:`xopt.specs.flora.Flora` (the original's defaults; ``beta1=None`` means
        no momentum). The floats may be 0-d arrays (``optax.inject_hyperparams`` injects
        each); ``rank``, ``kappa`` and ``seed`` fix shapes, the transfer schedule and the
        projections: Python ints (``static_args`` under ``optax.inject_hyperparams``).
      spec: an :class:`xopt.specs.flora.Flora` instead of the arguments.
      param_specs: per-leaf settings (a pytree / mapping of leaf names / function to
        ``Flora`` or None), e.g. ``project=False`` for the leaves to keep uncompressed.
      nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` (:mod:`xopt.nonfinite`).
      check_finite: ``True`` is the older spelling of ``nonfinite="raise"``.

    ``update`` needs ``params`` (the RMS learning-rate scale and the weight decay read
    them). Returns updates in each parameter's dtype, ``new − old``, so that
    ``optax.apply_updates`` gives the original's ``p − η λ p − η u``.
    """
    _contract.reject_unknown(_LABEL, unknown, flora)
    _contract.require_static(_LABEL, rank=rank, kappa=kappa, seed=seed)
    mode = _contract.resolve_nonfinite(_LABEL, nonfinite, check_finite)
    given = {k: v for k, v in dict(
        learning_rate=learning_rate, rank=rank, kappa=kappa, eps=eps,
        clip_threshold=clip_threshold, decay_rate=decay_rate, beta1=beta1,
        weight_decay=weight_decay, scale_parameter=scale_parameter,
        relative_step=relative_step, warmup_init=warmup_init,
        factorize_second_moment=factorize_second_moment, seed=seed,
        quantization=quantization, project=project).items() if v is not None}
    hp = _resolve(spec, given)

    def specs_of(params: Any) -> tuple[list[str], list[_spec.Flora]]:
        names = path_names(params)
        specs = leaf_specs(params, hp, param_specs, _spec.Flora, _LABEL)
        for n, h, p in zip(names, specs, jax.tree.leaves(params), strict=True):
            check_float_leaf(p, f"{_LABEL}: {n}", None)
            _spec.check_param(tuple(np.shape(p)), _structure(h), f"{_LABEL}: {n}")
        return names, specs

    def init_fn(params: Any) -> FloraState:
        leaves, treedef = jax.tree.flatten(params)
        _, specs = specs_of(params)
        fields: dict[str, list[Any]] = {f: [] for f in _PER_LEAF}
        for i, (p, h) in enumerate(zip(leaves, specs, strict=True), start=1):
            shape, sdt = tuple(np.shape(p)), _state_dtype(p)
            h = _structure(h)
            fields["seed"].append(_seed_words(int(h.seed) + i))
            fields["rms"].append(jnp.zeros((), sdt))
            fields["m"].append(jnp.zeros(_spec.momentum_shape(shape, h), sdt)
                               if h.use_momentum else None)
            fac = _spec.factored(shape, h)
            fields["v_row"].append(jnp.zeros(shape[:-1], sdt) if fac else None)
            fields["v_col"].append(jnp.zeros(shape[:-2] + shape[-1:], sdt) if fac else None)
            fields["v"].append(None if fac else jnp.zeros(shape, sdt))
        return FloraState(count=jnp.zeros((), jnp.int32),
                          **{f: jax.tree.unflatten(treedef, v) for f, v in fields.items()})

    def update_fn(updates: Any, state: FloraState, params: Any = None, *,
                  inject: Any = None, **extra: Any) -> tuple[Any, FloraState]:
        del extra
        if params is None:
            raise ValueError(f"{_LABEL}: update(updates, state, params) needs params (the "
                             "learning rate scales with their RMS; weight decay reads them)")
        grads, treedef = jax.tree.flatten(updates)
        leaves_p = treedef.flatten_up_to(params)
        names, specs = specs_of(params)
        injected = inject_for(inject, names, _LABEL)
        old = {f: treedef.flatten_up_to(getattr(state, f)) for f in _PER_LEAF}
        count = optax.safe_increment(state.count)
        new = {f: list(v) for f, v in old.items()}
        drawn = _draw_projections(leaves_p, specs, old["seed"], count, injected)
        kept = _transferred_momenta(leaves_p, specs, old["m"], count, injected, drawn)
        outs = []
        for i, (g, p, h) in enumerate(zip(grads, leaves_p, specs, strict=True)):
            st = {f: old[f][i] for f in _PER_LEAF}
            step = _update_leaf_shared if injected[i] is None and _hashable(h) else _update_leaf
            out, upd = step(h, p, g, st, count, injected[i], drawn.get(i), kept.get(i))
            outs.append(out)
            for f, v in upd.items():
                new[f][i] = v
        state = FloraState(count=count,
                           **{f: jax.tree.unflatten(treedef, v) for f, v in new.items()})
        return jax.tree.unflatten(treedef, outs), state

    return _contract.transformation(_LABEL, init_fn, full_precision(update_fn), nonfinite=mode)


_contract.public_signature(flora)


def _draw_projections(leaves: list, specs: list, seeds: list, t: jax.Array,
                      injected: list) -> dict[int, tuple[jax.Array, jax.Array, jax.Array]]:
    """``{leaf index: (seed after, P before, P after)}`` of every compressed leaf that draws
    its projections, drawn once per group of leaves whose projections have one size, rank,
    dtype and transfer interval (one seed advance and one draw per group, under
    ``jax.vmap``; the same integer and float32 operations per leaf). A draw of ``k`` values
    reshaped is the draw of any shape of ``k`` values, so ``(r, m)`` and ``(n, r)``
    projections share a group."""
    groups: dict[tuple, list[int]] = {}
    for i, (p, h) in enumerate(zip(leaves, specs, strict=True)):
        hs = _structure(h)
        shape = tuple(p.shape)
        if (hs.use_momentum and _spec.compressed(shape, hs)
                and not (injected[i] is not None and "proj_before" in injected[i])):
            size = math.prod(_spec.projection_shape(shape, h.rank))
            groups.setdefault((size, h.rank, str(_state_dtype(p)), h.kappa), []).append(i)
    out: dict[int, tuple[jax.Array, jax.Array, jax.Array]] = {}
    for (_, rank, sdt, kappa), idx in groups.items():
        draw = _group_draw(tuple(leaves[idx[0]].shape), rank, sdt)
        seed = jnp.stack([seeds[i] for i in idx])
        transfer = (t % kappa) == 0
        seed_after = jax.lax.cond(transfer, jax.vmap(next_seed_words), lambda w: w, seed)
        p_before = draw(seed)
        p_after = lowrank.refresh(transfer, p_before, lambda d=draw, s=seed_after: d(s),
                                  cond=jax.lax.cond)
        for i in idx:
            # The leaf's row is found from its seed at run time, not from its position: XLA
            # compiles a slice kernel per constant offset, and one for a runtime index that
            # every leaf of the group shares. Equal seeds draw equal rows, so the first
            # match is always right.
            row = jnp.argmax(jnp.all(seed == seeds[i], axis=1))
            pshape = _spec.projection_shape(tuple(leaves[i].shape), rank)
            pick = functools.partial(jax.lax.dynamic_index_in_dim, index=row, keepdims=False)
            out[i] = (pick(seed_after), pick(p_before).reshape(pshape),
                      pick(p_after).reshape(pshape))
    return out


def _projections_of(p: jax.Array, inject: Any, drawn: tuple | None
                    ) -> tuple[jax.Array, jax.Array]:
    """A compressed leaf's ``(P before, P after)`` this update: drawn
    (:func:`_draw_projections`) or given (``inject``)."""
    if drawn is not None:
        return drawn[1], drawn[2]
    sdt = _state_dtype(p)
    return jnp.asarray(inject["proj_before"], sdt), jnp.asarray(inject["proj_after"], sdt)


def _transferred_momenta(leaves: list, specs: list, momenta: list, t: jax.Array,
                         injected: list, drawn: dict) -> dict[int, jax.Array]:
    """``{leaf index: C}`` of every compressed leaf with momentum: its momentum carried into
    this update's projection at a transfer (``t mod κ = 0``: ``C ← down(P', up(P, C))``),
    else as it was. One conditional per group of leaves with one shape and setting (so one
    transfer schedule; :func:`~xopt.jax._lowrank.switch_grouped`), each branch computing
    its leaves in turn, where a conditional per leaf made XLA compile one per leaf. The
    branch takes the small operands (the projections and the compressed momentum) and
    decompresses again, the same product on the same operands as the step's own ``up``:
    passing that full-size product in instead would keep every leaf's alive at once."""
    idx, args = [], []
    for i, (p, h) in enumerate(zip(leaves, specs, strict=True)):
        hs = _structure(h)
        if hs.use_momentum and _spec.compressed(tuple(p.shape), hs):
            idx.append(i)
            args.append((*_projections_of(p, injected[i], drawn.get(i)), momenta[i]))

    def carry(j: int, a: tuple, event: int) -> jax.Array:
        p_before, p_after, m = a
        if event == 0:
            return m
        which = _spec.side(tuple(leaves[idx[j]].shape))
        return _spec.down(jnp, p_after, _spec.up(jnp, p_before, m, which), which)

    keys = [group_key(specs[i], a) for i, a in zip(idx, args, strict=True)]
    out = switch_grouped(keys, lambda j: ((t % specs[idx[j]].kappa) == 0).astype(jnp.int32),
                         2, carry, args)
    return dict(zip(idx, out, strict=True))


@functools.cache
def _group_draw(shape: tuple[int, ...], rank: int, sdt: str) -> Any:
    """The projections of a leaf of ``shape`` for a stack of seeds, flattened: ``(k, size)``
    (jitted, so that the draw before and the one after a transfer are traced once)."""
    def draw(s: jax.Array) -> jax.Array:
        return _spec.projection(s, shape, rank, xp=jnp, dtype=jnp.dtype(sdt)).reshape(-1)

    return jax.jit(jax.vmap(draw))


def _update_leaf(h: _spec.Flora, p: jax.Array, g: jax.Array, st: dict[str, Any],
                 t: jax.Array, inject: Any, drawn: tuple | None = None,
                 kept: jax.Array | None = None) -> tuple[jax.Array, dict[str, Any]]:
    """One leaf's update at the traced 1-based step ``t``: ``(p_new − p, new state)``
    (``drawn``: the leaf's seed after this step and projections,
    :func:`_draw_projections`; ``kept``: a compressed leaf's momentum after this update's
    transfer, :func:`_transferred_momenta`)."""
    xp = jnp
    hs = _structure(h)
    shape, sdt = tuple(p.shape), _state_dtype(p)
    p_c, g_c = p.astype(sdt), g.astype(sdt)
    new: dict[str, Any] = {}
    rho = _spec.rms(xp, p_c)
    new["rms"] = rho
    lr = _spec.learning_rate(xp, h, rho, t)
    b2, omb2 = _spec.beta2(t, h.decay_rate)
    eps0 = float(h.eps[0])
    if _spec.factored(shape, hs):
        new["v_row"], new["v_col"], u = _spec.second_moment_factored(
            xp, st["v_row"], st["v_col"], g_c, b2, omb2, eps0)
    else:
        new["v"], u = _spec.second_moment_full(xp, st["v"], g_c, b2, omb2, eps0)
    if hs.use_momentum:
        b1 = h.beta1
        if not _spec.compressed(shape, hs):
            u = _spec.mix(u, st["m"], b1)
            new["m"] = u
        else:
            which = _spec.side(shape)
            seed = st["seed"]
            transfer = (t % h.kappa) == 0
            if drawn is not None:  # (every leaf but those given recorded projections)
                seed_after = drawn[0]
            else:
                seed_after = jax.lax.cond(transfer, next_seed_words, lambda w: w, seed)
            p_before, p_after = _projections_of(p, inject, drawn)
            c_up = _spec.up(xp, p_before, st["m"], which)
            raw = u
            u = _spec.mix(u, c_up, b1)
            new["m"] = _spec.accumulate(kept, _spec.down(xp, p_after, raw, which), b1)
            new["seed"] = seed_after
    u, _ = _spec.clip(xp, u, h.clip_threshold)
    if isinstance(h.weight_decay, (int, float)):
        p_new = _spec.apply(xp, p_c, u, lr, h.weight_decay)
    else:  # an array λ: _spec.apply's operations, the decay unconditional (p + p·(−0) = p)
        p_new = (p_c + p_c * (-h.weight_decay * lr)) - u * lr
    # in the state's dtype: apply_updates rounds a narrower leaf's new value once, as the spec
    return p_new - p_c, new


#: :func:`_update_leaf` traced once per setting, shape and dtype: the leaves of one shape
#: share one traced function (XLA inlines it), so lowering does not repeat it per leaf
_update_leaf_shared = jax.jit(_update_leaf, static_argnums=(0,))


def _hashable(h: _spec.Flora) -> bool:
    """Whether ``h`` can be a static argument (not when it holds arrays, as under
    ``optax.inject_hyperparams``; such leaves are traced one by one)."""
    try:
        hash(h)
    except TypeError:
        return False
    return True


register("flora", "jax", flora)
