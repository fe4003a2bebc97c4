"""CompAct in JAX: a Flax (linen) linear layer with a ``jax.custom_vjp`` that saves ``x P``,
and the optax transformation that applies Adam in the compressed space.

* :func:`compact_linear` is the layer's function: ``y = x Wᵀ + b``, saving ``z = x P``. Its
  VJP gives the exact ``∂L/∂x`` and ``∂L/∂b``, and the compressed weight gradient
  ``Ĝ = Σ gᵀ z`` (out × r) as the cotangent of a *carrier* argument of shape (out × r)
  whose value is never used; the weight's own cotangent is zeros (JAX needs one of the
  weight's shape; inside a jitted train step XLA drops it, since the optimizer never reads
  it).
* :class:`CompActDense` (``flax.linen.Module``): parameters ``weight`` (out × in),
  ``bias`` (out) (the names of the torch layer) and the carrier ``compact_grad`` (out × r);
  its projection settings live in the ``"compact"`` variable collection (``seed`` as
  ``uint32[2]``, ``scale``, ``gap``, ``kind``, ``jl_nnz``), so forward and optimizer read
  one source. ``__call__(x, step=t)``: ``t`` is the number of updates taken (the optimizer's
  count), which selects the projection ``t // gap``.
* :func:`compact_adamw`: an ``optax.GradientTransformationExtraArgs``. For every CompAct
  layer it reads Ĝ from the carrier's gradient, keeps Adam moments (out × r) under the
  weight's path, redraws the same P, and returns the weight's update
  ``W_new − W`` with ``W_new = (W − s_t α N Pᵀ)(1 − ηλ)`` (the authors' order: step, then
  decay); the carrier's update is zero. Other parameters get the same Adam on their full
  gradient. The math is :mod:`xopt.specs.compact`'s.

P comes from :mod:`xopt.random` with the seed ``fold_in(layer_seed, t // gap)``; the fold is
computed here on traced step counts, so a jitted step draws the same bits as the torch
backend (``xopt.torch.compact``) and as NumPy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from xopt import random as _random
from xopt.errors import HyperparameterError, StateError
from xopt.jax import _contract
from xopt.jax._precision import full_precision
from xopt.registry import register
from xopt.specs import compact as _spec

__all__ = ["CompActAdamState", "CompActDense", "compact_adamw", "compact_linear",
           "draw_projection", "draw_projections", "projections_from"]

_KIND_CODES = {"gaussian": 0, "sparse_jl": 1, "identity": 2}
_KIND_NAMES = {v: k for k, v in _KIND_CODES.items()}


# -- projections -----------------------------------------------------------------------------


def _fold_in(seed: int, refresh: Any) -> jax.Array:
    """``xopt.random.fold_in(seed, refresh)`` for a traced ``refresh`` < 2³², as the
    ``uint32[2]`` ``[hi, lo]`` that :mod:`xopt.random`'s jax backend takes as a seed."""
    k0, k1 = _random.key_from_seed(int(seed))
    d = jnp.asarray(refresh).astype(jnp.uint32)
    y0, y1 = _random.threefry2x32(k0, k1, _random._FOLD_TAG, d, backend="jax")
    return jnp.stack([y0, y1])


def draw_projection(proj: _spec.Projection, refresh: Any, dtype: Any = jnp.float32
                    ) -> jax.Array | None:
    """P (n × r) of ``proj`` at refresh number ``refresh`` (int or traced int), in
    ``dtype``; None for an identity projection. Bit-identical to the torch backend's and
    to :func:`xopt.specs.compact.projection` under NumPy."""
    if proj.kind == "identity":
        return None
    seed = _fold_in(proj.seed, refresh)
    if proj.kind == "gaussian":
        p = _spec.gaussian(seed, proj.in_features, proj.rank, backend="jax")
    else:
        p = _spec.sparse_jl(seed, proj.in_features, proj.rank, proj.jl_nnz, backend="jax")
    return p.astype(dtype)


def draw_projections(projections: Mapping[str, _spec.Projection], step: Any,
                     dtype: Any = jnp.float32) -> dict[str, jax.Array | None]:
    """Every layer's P at update ``step`` (int or traced): ``{name: P}`` (None for identity).

    Layers of one shape and kind are drawn together (``vmap`` over their seeds), so a
    jitted step compiles the generator once per shape rather than once per layer; the bits
    are :func:`draw_projection`'s."""
    groups: dict[tuple, list[str]] = {}
    out: dict[str, jax.Array | None] = {}
    for name, proj in projections.items():
        if proj.kind == "identity":
            out[name] = None
            continue
        groups.setdefault((proj.kind, proj.in_features, proj.rank, proj.jl_nnz), []).append(name)
    for (kind, n, r, nnz), names in groups.items():
        seeds = jnp.stack([_fold_in(projections[k].seed, _refresh(step, projections[k].gap))
                           for k in names])
        if kind == "gaussian":
            ps = jax.vmap(lambda sd, n=n, r=r: _spec.gaussian(sd, n, r, backend="jax"))(seeds)
        else:
            ps = jax.vmap(lambda sd, n=n, r=r, nnz=nnz: _spec.sparse_jl(
                sd, n, r, nnz, backend="jax"))(seeds)
        for i, k in enumerate(names):
            out[k] = ps[i].astype(dtype)
    return out


def _refresh(step: Any, gap: int) -> Any:
    return step // gap if gap else jnp.zeros((), jnp.int32)


# -- the layer function ----------------------------------------------------------------------


@jax.custom_vjp
@full_precision
def compact_linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None,
                   carrier: jax.Array, p: jax.Array | None) -> jax.Array:
    """``y = x Wᵀ + b`` (paper Algorithm 1), differentiated by Algorithm 2.

    Shapes: ``x (..., n)``, ``weight (m, n)``, ``bias (m,)`` or None, ``carrier (m, r)``
    (value unused), ``p (n, r)`` or None (identity, r = n); ``y (..., m)``. Cotangents:
    ``x``: ``g W``; ``bias``: ``Σ g``; ``carrier``: ``Ĝ = Σ gᵀ (x P)`` (eq. 8); ``weight``
    and ``p``: zeros.
    """
    del carrier
    return _spec.linear_forward(x, weight, bias, p, xp=jnp)[0]


def _fwd(x, weight, bias, carrier, p):
    y, z = _spec.linear_forward(x, weight, bias, p, xp=jnp)
    return y, (z, weight, bias, carrier, p)


def _bwd(res, g):
    z, weight, bias, carrier, p = res
    grad_x, g_hat, grad_b = _spec.linear_backward(g, z, weight, bias is not None, xp=jnp)
    zp = None if p is None else jnp.zeros_like(p)
    return (grad_x, jnp.zeros_like(weight), grad_b,
            g_hat.astype(carrier.dtype).reshape(carrier.shape), zp)


compact_linear.defvjp(full_precision(_fwd), full_precision(_bwd))


class CompActDense(nn.Module):
    """A linear layer whose backward keeps only ``x P`` (CompAct), for Flax linen.

    Attributes:
      features: m, the output width (the input width n is ``x.shape[-1]``).
      use_bias: add a bias.
      rank: r as a fraction of n, in (0, 1] (ignored for ``proj_type="identity"``).
      proj_type: ``"gaussian"``, ``"sparse_jl"`` or ``"identity"``.
      scale: α, applied by :func:`compact_adamw` to this layer's step.
      seed: this layer's seed (int in [0, 2⁶⁴)); stored in the ``"compact"`` collection.
      gap: T: a new P every T updates (0: never).
      jl_nnz: non-zeros per row of a sparse JL projection.
      param_dtype, weight_init, bias_init: as flax's ``Dense`` (weight is out × in).

    ``__call__(x, step=0, projection=None)``: ``x (..., n)`` of a float dtype; ``step``
    the number of optimizer updates taken (an int or a traced int32); ``projection``
    overrides P (n × r), for injecting a recorded draw. Returns ``y (..., m)``.
    """

    features: int
    use_bias: bool = True
    rank: float = 0.5
    proj_type: str = "gaussian"
    scale: float = 1.0
    seed: int = 0
    gap: int = 0
    jl_nnz: int = 4
    param_dtype: Any = jnp.float32
    weight_init: Callable[..., Any] = nn.initializers.lecun_normal()
    bias_init: Callable[..., Any] = nn.initializers.zeros

    def projection_of(self, in_features: int) -> _spec.Projection:
        name = f"CompActDense {'/'.join(self.scope.path) if self.scope else ''}".strip()
        if self.proj_type not in _spec.KINDS:
            raise HyperparameterError(f"{name}.proj_type = {self.proj_type!r}: must be one of "
                                      f"{', '.join(map(repr, _spec.KINDS))}")
        r = in_features if self.proj_type == "identity" else _spec.rank_of(
            in_features, self.rank, where=f"{name}.rank")
        return _spec.Projection(kind=self.proj_type, in_features=in_features, rank=r,
                                scale=float(self.scale), seed=int(self.seed), gap=int(self.gap),
                                jl_nnz=int(self.jl_nnz))

    @nn.compact
    @full_precision
    def __call__(self, x: jax.Array, step: Any = 0, projection: jax.Array | None = None
                 ) -> jax.Array:
        n = x.shape[-1]
        proj = self.projection_of(n)
        weight = self.param("weight", lambda k, s, d: self.weight_init(k, s[::-1], d).T,
                            (self.features, n), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) \
            if self.use_bias else None
        carrier = self.param("compact_grad", nn.initializers.zeros, (self.features, proj.rank),
                             self.param_dtype)
        hi, lo = _random.key_from_seed(proj.seed)
        self.variable("compact", "seed", lambda: jnp.asarray([hi, lo], jnp.uint32))
        self.variable("compact", "kind", lambda: jnp.asarray(_KIND_CODES[proj.kind], jnp.int32))
        self.variable("compact", "scale", lambda: jnp.asarray(proj.scale, jnp.float32))
        self.variable("compact", "gap", lambda: jnp.asarray(proj.gap, jnp.int32))
        self.variable("compact", "jl_nnz", lambda: jnp.asarray(proj.jl_nnz, jnp.int32))
        if projection is None:
            projection = draw_projection(proj, _refresh(jnp.asarray(step), proj.gap), x.dtype)
        elif proj.kind != "identity" and tuple(projection.shape) != (n, proj.rank):
            raise HyperparameterError(f"CompActDense: projection of shape "
                                      f"{tuple(projection.shape)}, expected {(n, proj.rank)}")
        if projection is not None:
            projection = jax.lax.stop_gradient(projection.astype(x.dtype))
        return compact_linear(x, weight.astype(x.dtype),
                              None if bias is None else bias.astype(x.dtype), carrier,
                              projection)


def projections_from(compact: Mapping[str, Any], params: Mapping[str, Any]
                     ) -> dict[str, _spec.Projection]:
    """``{weight path: Projection}`` from a model's ``"compact"`` collection and params.

    Paths are pytree paths joined by ``/`` (``"layers_0/q_proj/weight"``). Raises
    :class:`StateError` naming the layer when its params lack ``weight``/``compact_grad``.
    """
    out: dict[str, _spec.Projection] = {}
    flat_params = _flatten(params)

    def walk(tree: Mapping[str, Any], prefix: str) -> None:
        if "seed" in tree and not isinstance(tree["seed"], Mapping):
            w, c = f"{prefix}weight", f"{prefix}compact_grad"
            if w not in flat_params or c not in flat_params:
                raise StateError(f"compact layer {prefix.rstrip('/')!r}: params have no "
                                 f"{w!r} and {c!r}")
            seed_words = np.asarray(tree["seed"]).astype(np.uint64)
            m, n = flat_params[w].shape
            r = flat_params[c].shape[1]
            out[w] = _spec.Projection(
                kind=_KIND_NAMES[int(np.asarray(tree["kind"]))], in_features=int(n), rank=int(r),
                scale=float(np.asarray(tree["scale"])),
                seed=int(seed_words[0]) << 32 | int(seed_words[1]),
                gap=int(np.asarray(tree["gap"])), jl_nnz=int(np.asarray(tree["jl_nnz"])))
            return
        for k, v in tree.items():
            if isinstance(v, Mapping):
                walk(v, f"{prefix}{k}/")

    walk(compact, "")
    return out


def _flatten(tree: Any) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key_str(k) for k in path): v for path, v in leaves}


def _key_str(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


# -- the optimizer ---------------------------------------------------------------------------


class CompActAdamState(NamedTuple):
    """``count``: int32 number of updates taken. ``mu``, ``nu``: Adam's moments, a dict by
    parameter path (``/``-joined): (out × r) for CompAct weights (keyed by the weight's
    path), the parameter's shape for plain parameters; carriers have none. In the
    parameter's dtype promoted to float32, as the spec's state (a bfloat16/float16 leaf's
    update is float32: ``optax.apply_updates`` rounds its new value once, as xopt.torch).
    ``nonfinite_skips``: int32 ``()`` under ``nonfinite="skip"``, else None."""

    count: jax.Array
    mu: dict[str, jax.Array]
    nu: dict[str, jax.Array]
    nonfinite_skips: jax.Array | None = None


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(_spec.CompAct)}


def _bias_correction(beta: float, t: jax.Array) -> jax.Array:
    # 1 − βᵗ without cancellation: −expm1(t·log1p(−(1−β))), within a few float32 ulps of the
    # double value the authors compute in Python (float32 1 − βᵗ loses 1e-5 relative at t=1).
    return -jnp.expm1(t * jnp.log1p(jnp.float32(-(1.0 - beta))))


def compact_adamw(learning_rate: float = _DEFAULTS["lr"], b1: float = _DEFAULTS["b1"],
                  b2: float = _DEFAULTS["b2"], eps: float = _DEFAULTS["eps"],
                  weight_decay: float = _DEFAULTS["weight_decay"], *,
                  correct_bias: bool = True,
                  projections: Mapping[str, _spec.Projection] | None = None,
                  compact: Mapping[str, Any] | None = None, params: Any = None,
                  spec: _spec.CompAct | None = None, nonfinite: str | None = None,
                  **unknown: Any) -> optax.GradientTransformationExtraArgs:
    """CompAct's Adam (paper Algorithm 3; the authors' ``SmallAdamW``) as optax.

    For a CompAct weight W (m × n) with carrier ``C`` (m × r): with Ĝ the gradient of C,
    ``M, V`` (m × r) updated by Ĝ, ``N = M/(√V + ε)``, ``s_t = η √(1 − β₂ᵗ)/(1 − β₁ᵗ)`` and
    P redrawn at refresh ``(count // gap)``, the update of W is ``W' − W`` with
    ``W' = (W − s_t α N Pᵀ)`` followed by ``W' ← W' − ηλW'``; C's update is zero and W's
    own gradient (zeros) is not read. Every other parameter: the same with P = I, α = 1.
    1 − βᵗ is evaluated in float32 without cancellation (within a few ulps of the double
    value), so ``s_t`` is within ~1e-7 of the authors' double-precision step size.

    Args:
      learning_rate, b1, b2, eps, weight_decay, correct_bias: as
        :class:`xopt.specs.compact.CompAct` (η, β₁, β₂, ε, λ). Numbers or 0-d arrays
        (``optax.inject_hyperparams`` can inject each), not schedules.
      projections: ``{weight path: Projection}``; or give ``compact`` (the model's
        ``"compact"`` collection) and ``params`` and they are read by
        :func:`projections_from`.
      spec: a :class:`xopt.specs.compact.CompAct` to take the Adam fields from.
      nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` (:mod:`xopt.nonfinite`).

    ``update(grads, state, params, *, compact=None, inject=None)``: ``params`` is required.
    ``compact``, when given with concrete values, is checked against the projections the
    transformation was built with (a :class:`StateError` naming the layer when a seed
    differs); ``inject``: ``{weight path: P}`` to use recorded projections.
    """
    label = "xopt.jax.compact_adamw"
    _contract.reject_unknown(label, unknown, compact_adamw)
    mode = _contract.resolve_nonfinite(label, nonfinite)
    if spec is not None:
        hp = spec
    else:
        try:
            hp = _spec.CompAct(lr=learning_rate, b1=b1, b2=b2, eps=eps,
                               weight_decay=weight_decay, correct_bias=correct_bias)
        except HyperparameterError as e:
            raise HyperparameterError(f"{label}: {e}") from None
    if projections is None:
        if compact is None or params is None:
            raise HyperparameterError("xopt.jax.compact_adamw: give projections=, or compact= "
                                      "(the model's 'compact' collection) and params=")
        projections = projections_from(compact, params)
    projections = dict(projections)
    carriers = {w.rsplit("/", 1)[0] + "/compact_grad" if "/" in w else "compact_grad": w
                for w in projections}

    def init_fn(params: Any) -> CompActAdamState:
        flat = _flatten(params)
        for w in projections:
            if w not in flat:
                raise StateError(f"xopt.jax.compact_adamw: projection for {w!r}, which is not "
                                 "a parameter")
        mu, nu = {}, {}
        for k, v in flat.items():
            if k in carriers:
                continue
            shape = (v.shape[0], projections[k].rank) if k in projections else v.shape
            # the spec's state: the parameter's dtype promoted to float32 (as xopt.torch)
            dt = jnp.promote_types(v.dtype, jnp.float32)
            mu[k] = jnp.zeros(shape, dt)
            nu[k] = jnp.zeros(shape, dt)
        return CompActAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

    def update_fn(updates: Any, state: CompActAdamState, params: Any = None, *,
                  compact: Mapping[str, Any] | None = None,
                  inject: Mapping[str, Any] | None = None, **extra: Any) -> tuple[Any, Any]:
        del extra
        if params is None:
            raise ValueError("xopt.jax.compact_adamw needs params (the update is W' − W)")
        if compact is not None:
            _check_seeds(compact, projections)
        inject = inject or {}
        g_leaves, treedef = jax.tree_util.tree_flatten(updates)
        paths = ["/".join(_key_str(k) for k in path)
                 for path, _ in jax.tree_util.tree_flatten_with_path(updates)[0]]
        grads = dict(zip(paths, g_leaves, strict=True))
        flat_p = dict(zip(paths, treedef.flatten_up_to(params), strict=True))
        t = state.count
        count = optax.safe_increment(t)
        tf = count.astype(jnp.float32)
        if hp.correct_bias:
            s = hp.lr * jnp.sqrt(_bias_correction(hp.b2, tf)) / _bias_correction(hp.b1, tf)
        else:
            s = jnp.asarray(hp.lr, jnp.float32)
        todo = {k: pr for k, pr in projections.items() if inject.get(k) is None}
        drawn = draw_projections(todo, t) if todo else {}
        out, mu, nu = {}, {}, {}
        for k in paths:
            if k in carriers:
                out[k] = jnp.zeros_like(grads[k])
                continue
            wide = state.mu[k].dtype  # a narrower leaf is stepped in its state's dtype
            p = flat_p[k].astype(wide)
            proj = projections.get(k)
            if proj is None:
                g, pm, scale = grads[k], None, 1.0
            else:
                g = grads[carriers_of(k)]
                scale = proj.scale
                pm = inject.get(k)
                pm = drawn.get(k) if pm is None else pm
                pm = None if pm is None else jnp.asarray(pm, wide)
            m, v = _spec.moments(g.astype(wide), state.mu[k], state.nu[k], b1=hp.b1, b2=hp.b2,
                                 xp=jnp)
            n = _spec.normalized(m, v, hp.eps, xp=jnp)
            u = n if (pm is None and scale == 1.0) else _spec.project_back(n, pm, scale)
            new = p - s.astype(wide) * u.astype(wide)
            if not (isinstance(hp.weight_decay, (int, float)) and hp.weight_decay == 0):
                new = new + (-hp.lr * hp.weight_decay) * new
            out[k] = new - p  # wide: apply_updates rounds a narrower leaf's new value once
            mu[k], nu[k] = m.astype(state.mu[k].dtype), v.astype(state.nu[k].dtype)
        new_updates = treedef.unflatten([out[k] for k in paths])
        return new_updates, CompActAdamState(count=count, mu=mu, nu=nu)

    def carriers_of(weight_path: str) -> str:
        return weight_path.rsplit("/", 1)[0] + "/compact_grad" if "/" in weight_path \
            else "compact_grad"

    return _contract.transformation(label, init_fn, full_precision(update_fn), nonfinite=mode)


_contract.public_signature(compact_adamw)


def _check_seeds(compact: Mapping[str, Any], projections: Mapping[str, _spec.Projection]) -> None:
    try:
        now = projections_from_seeds(compact)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return  # traced (inside jit): checked where concrete
    for w, proj in projections.items():
        prefix = w.rsplit("/", 1)[0] if "/" in w else ""
        if prefix in now and now[prefix] != proj.seed:
            raise StateError(
                f"compact layer {prefix!r}: the model's seed is {now[prefix]}, but the "
                f"optimizer was built with seed {proj.seed}; forward and update would draw "
                "different projections")


def projections_from_seeds(compact: Mapping[str, Any], prefix: str = "") -> dict[str, int]:
    """``{layer path: seed}`` of a ``"compact"`` collection (concrete values only)."""
    out: dict[str, int] = {}
    for k, v in compact.items():
        if k == "seed" and not isinstance(v, Mapping):
            words = np.asarray(v).astype(np.uint64)
            out[prefix.rstrip("/")] = int(words[0]) << 32 | int(words[1])
        elif isinstance(v, Mapping):
            out.update(projections_from_seeds(v, f"{prefix}{k}/"))
    return out


register("compact", "jax", compact_adamw)
