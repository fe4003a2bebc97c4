"""POET-X in JAX: the ``POETDense`` Flax (linen) layer, merges, and ``poet_adamw``.

The same layer as :class:`xopt.torch.poet.POETLinear`, computing
:mod:`xopt.specs.poet`'s forward input-centrically, with the same names:

* ``params``: ``oft_R`` (``(r_out + r_in, b(b−1)/2)``, zeros = identity rotations), the
  only trainable array;
* ``poet`` collection (frozen between merges): ``weight`` (``W0``, ``out × in``),
  ``bias`` (with ``use_bias``), ``perm_in``, ``perm_out``, ``perm_in_inv``,
  ``perm_out_inv`` (int32), ``merges`` (int32) and ``seed`` (the layer's 64-bit
  permutation seed as two uint32 words). With ``weight_bits=8`` (POET-XQ) ``weight``
  holds uint8 codes and ``weight_scales``, ``weight_zeros`` (float32,
  ``(out·in/weight_group_size, 1)``) sit beside it (:func:`xopt.specs.poet.quantize_weight`);
  ``W0`` is dequantised inside the forward and, for ``mem``, again in the backward.

``variant="fast"`` differentiates the forward with JAX's autodiff (XLA keeps what it
needs); ``variant="mem"`` is a ``jax.custom_vjp`` whose residuals are the input and the
rotations only, recomputing ``y1 = (x R_in) W0ᵀ`` in the backward.

Merges are a function of the variables (:func:`merge_and_reset`), run outside ``jit``
every ``merge_interval`` steps; :func:`poet_adamw` is the authors' POETAdamW as an optax
transformation, restarting its moments at the first update after each merge boundary.
Use it for the ``oft_R`` leaves (the ``params`` collection of a POET model holds only
those and whatever the rest of the model trains; split with ``optax.multi_transform``).
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from xopt import random as xrandom
from xopt.errors import HyperparameterError
from xopt.jax import _contract
from xopt.jax._precision import full_precision
from xopt.registry import register
from xopt.specs import poet as spec_lib

__all__ = ["POETAdamWState", "POETDense", "merge_and_reset", "poet_adamw"]


def _words(seed: int) -> np.ndarray:
    return np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32)


def _seed_of(words: Any) -> int:
    w = np.asarray(words, dtype=np.uint64)
    return int(w[0]) << 32 | int(w[1])


# -- the mem variant's custom VJP ----------------------------------------------------------------


@jax.custom_vjp
@full_precision
def chain_mem(x, r_out, r_in, weight, bias, perm_in, perm_in_inv, perm_out, perm_out_inv):
    """The layer's chain (``bias`` may be an empty array for none) with a recomputing VJP."""
    y, _ = spec_lib.layer_forward(x, r_out, r_in, weight, bias if bias.size else None,
                                  perm_in_inv, perm_out, xp=jnp)
    return y


def _chain_fwd(x, r_out, r_in, weight, bias, perm_in, perm_in_inv, perm_out, perm_out_inv):
    y = chain_mem(x, r_out, r_in, weight, bias, perm_in, perm_in_inv, perm_out, perm_out_inv)
    return y, (x, r_out, r_in, weight, bias, perm_in, perm_in_inv, perm_out_inv)


def _chain_bwd(res, g):
    x, r_out, r_in, weight, bias, perm_in, perm_in_inv, perm_out_inv = res
    b = bias if bias.size else None
    gx, g_out, g_in, g_bias = spec_lib.layer_backward(x, g, r_out, r_in, weight, perm_in,
                                                      perm_in_inv, perm_out_inv, None, bias=b,
                                                      xp=jnp)

    def zero_int(a):
        return np.zeros(a.shape, dtype=jax.dtypes.float0)

    return (gx, g_out, g_in, jnp.zeros_like(weight),
            g_bias.astype(bias.dtype) if bias.size else jnp.zeros_like(bias),
            zero_int(perm_in), zero_int(perm_in_inv), zero_int(perm_out_inv),
            zero_int(perm_out_inv))


chain_mem.defvjp(full_precision(_chain_fwd), full_precision(_chain_bwd))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
@full_precision
def chain_mem_q(x, r_out, r_in, codes, scales, zeros, group_size, bias, perm_in, perm_in_inv,
                perm_out, perm_out_inv):
    """:func:`chain_mem` of POET-XQ: the residuals hold ``W0``'s codes, not ``W0``."""
    w = spec_lib.dequantize_weight(codes, scales, zeros, group_size, x.dtype, xp=jnp)
    return chain_mem(x, r_out, r_in, w, bias, perm_in, perm_in_inv, perm_out, perm_out_inv)


def _chain_q_fwd(x, r_out, r_in, codes, scales, zeros, group_size, bias, perm_in, perm_in_inv,
                 perm_out, perm_out_inv):
    y = chain_mem_q(x, r_out, r_in, codes, scales, zeros, group_size, bias, perm_in,
                    perm_in_inv, perm_out, perm_out_inv)
    return y, (x, r_out, r_in, codes, scales, zeros, bias, perm_in, perm_in_inv, perm_out,
               perm_out_inv)


def _chain_q_bwd(group_size, res, g):
    x, r_out, r_in, codes, scales, zeros, bias, perm_in, perm_in_inv, perm_out, perm_out_inv = res
    w = spec_lib.dequantize_weight(codes, scales, zeros, group_size, x.dtype, xp=jnp)
    gx, g_out, g_in, _, g_bias, *_ = _chain_bwd(
        (x, r_out, r_in, w, bias, perm_in, perm_in_inv, perm_out_inv), g)
    del w

    def zero_int(a):
        return np.zeros(a.shape, dtype=jax.dtypes.float0)

    return (gx, g_out, g_in, zero_int(codes), jnp.zeros_like(scales), jnp.zeros_like(zeros),
            g_bias, zero_int(perm_in), zero_int(perm_in_inv), zero_int(perm_out),
            zero_int(perm_out_inv))


chain_mem_q.defvjp(full_precision(_chain_q_fwd), full_precision(_chain_q_bwd))


# -- the layer -------------------------------------------------------------------------------


def _normalized_init(normalize: bool):
    base = nn.initializers.lecun_normal()

    def init(key, shape, dtype=jnp.float32):
        out_f, in_f = shape
        w = base(key, (in_f, out_f), dtype).T
        if normalize:
            w = w / jnp.linalg.norm(w, axis=1, keepdims=True)
        return w

    return init


class POETDense(nn.Module):
    """``y = x · W_effᵀ (+ bias)`` with ``W_eff = R · W0 · P`` (POET-X).

    Attributes:
      features: output width; the input width is read from the first call.
      block_size, variant, neumann_terms, cayley_formula, permutation: as the spec's
        fields (None: from ``spec``, default :class:`xopt.specs.poet.POET`).
      use_bias: a frozen bias before ``R_out`` (as the authors' layer).
      seed: this layer's permutation seed; None derives it from ``spec.seed`` and the
        module path (``fold_in(seed, crc32("a/b/c"))``, the rule of ``xopt.torch.poet``).
      weight_init: initialiser of ``W0`` (``(out, in)``); default LeCun normal with the
        rows normalised (``spec.normalize_weights``), as the authors normalise W0.
      weight_bits, weight_group_size: ``weight_bits=8`` is POET-XQ (``W0`` as the
        authors' uint8 codes, a scale and a zero point per ``weight_group_size``
        consecutive elements; merges quantise afresh).
      dtype: dtype of the computation (rotations are always evaluated in float32).
    """

    features: int
    block_size: int | None = None
    use_bias: bool = False
    variant: str | None = None
    neumann_terms: int | None = None
    cayley_formula: str | None = None
    permutation: str | None = None
    seed: int | None = None
    spec: spec_lib.POET | None = None
    weight_init: Callable[..., Any] | None = None
    weight_bits: int | None = None
    weight_group_size: int | None = None
    dtype: Any = jnp.float32

    def hyperparams(self) -> spec_lib.POET:
        hp = self.spec or spec_lib.POET()
        over = {k: v for k, v in dict(block_size=self.block_size, variant=self.variant,
                                        neumann_terms=self.neumann_terms,
                                        cayley_formula=self.cayley_formula,
                                        permutation=self.permutation,
                                        weight_bits=self.weight_bits,
                                        weight_group_size=self.weight_group_size,
                                        ).items() if v is not None}
        return hp.replace(**over)

    @nn.compact
    @full_precision
    def __call__(self, x):
        hp = self.hyperparams()
        n_in, n_out = x.shape[-1], self.features
        b = self.block_size if self.block_size is not None else hp.block_size
        spec_lib.check_width(b, n_in, n_out, where="POETDense")
        r_in, r_out = n_in // b, n_out // b
        oft_r = self.param("oft_R", nn.initializers.zeros,
                           (r_out + r_in, spec_lib.num_triu(b)), jnp.float32)
        if self.seed is not None:
            layer_seed = int(self.seed)
        else:
            name = "/".join(map(str, self.path)).encode()
            layer_seed = xrandom.fold_in(hp.seed, zlib.crc32(name))
        pin, pout = spec_lib.layer_permutations(hp, layer_seed, 0, n_in, n_out)
        init = self.weight_init or _normalized_init(hp.normalize_weights)
        quant = None
        if hp.weight_bits is None:
            weight = self.variable("poet", "weight", lambda: init(self.make_rng("params"),
                                                                   (n_out, n_in), jnp.float32))
        else:
            gs = hp.weight_group_size
            spec_lib.quant_groups(n_out, n_in, gs, where="POETDense")
            made = {}

            def make(i):
                if not made:
                    w0 = init(self.make_rng("params"), (n_out, n_in), jnp.float32)
                    made["q"] = spec_lib.quantize_weight(w0, gs, xp=jnp)
                return made["q"][i]

            weight = self.variable("poet", "weight", lambda: make(0))
            quant = (self.variable("poet", "weight_scales", lambda: make(1)).value,
                     self.variable("poet", "weight_zeros", lambda: make(2)).value, gs)
        bias = (self.variable("poet", "bias", lambda: jnp.zeros((n_out,), jnp.float32))
                if self.use_bias else None)
        v = {}
        for name, p in (("perm_in", pin), ("perm_out", pout)):
            v[name] = self.variable("poet", name, lambda p=p: jnp.asarray(p, jnp.int32)).value
            v[name + "_inv"] = self.variable(
                "poet", name + "_inv",
                lambda p=p: jnp.asarray(spec_lib.inverse(p), jnp.int32)).value
        self.variable("poet", "merges", lambda: jnp.zeros((), jnp.int32))
        self.variable("poet", "seed", lambda: jnp.asarray(_words(layer_seed)))

        rot_out, rot_in = spec_lib.rotations(oft_r, b, r_out, hp.neumann_terms,
                                             hp.cayley_formula, xp=jnp)
        x = x.astype(self.dtype)
        rot_out, rot_in = rot_out.astype(self.dtype), rot_in.astype(self.dtype)
        bb = bias.value.astype(self.dtype) if bias is not None else None
        if quant is not None and hp.variant == "mem":
            empty = jnp.zeros((0,), self.dtype)
            scales, zeros, gs = quant
            return chain_mem_q(x, rot_out, rot_in, weight.value, scales, zeros, gs,
                               bb if bb is not None else empty, v["perm_in"],
                               v["perm_in_inv"], v["perm_out"], v["perm_out_inv"])
        if quant is not None:
            w = spec_lib.dequantize_weight(weight.value, quant[0], quant[1], quant[2],
                                           self.dtype, xp=jnp)
        else:
            w = weight.value.astype(self.dtype)
        if hp.variant == "fast":
            y, _ = spec_lib.layer_forward(x, rot_out, rot_in, w, bb, v["perm_in_inv"],
                                          v["perm_out"], xp=jnp)
            return y
        empty = jnp.zeros((0,), self.dtype)
        return chain_mem(x, rot_out, rot_in, w, bb if bb is not None else empty, v["perm_in"],
                         v["perm_in_inv"], v["perm_out"], v["perm_out_inv"])


# -- merging ---------------------------------------------------------------------------------


def _layers(tree: Any, path: tuple[str, ...] = ()):
    if isinstance(tree, Mapping):
        if "oft_R" in tree and not isinstance(tree["oft_R"], Mapping):
            yield path
        for k, sub in tree.items():
            if isinstance(sub, Mapping):
                yield from _layers(sub, (*path, k))


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    if not path:
        return dict(value)
    tree = dict(tree)
    if len(path) == 1:
        tree[path[0]] = value
        return tree
    tree[path[0]] = _set(tree[path[0]], path[1:], value)
    return tree


@full_precision
def merge_layer(params: Mapping[str, Any], buffers: Mapping[str, Any], hp: spec_lib.POET,
                perm_in: Any = None, perm_out: Any = None) -> tuple[dict, dict]:
    """One layer's merge: ``(params, poet)`` dicts after it (``perm_*`` override the draws)."""
    oft = jnp.asarray(params["oft_R"], jnp.float32)
    m = oft.shape[1]
    b = int(round((1 + np.sqrt(1 + 8 * m)) / 2))
    quantized = "weight_scales" in buffers
    if quantized:  # POET-XQ: dequantise, merge, quantise afresh (in float32, as torch)
        codes = jnp.asarray(buffers["weight"])
        gs = codes.size // buffers["weight_scales"].shape[0]
        w = spec_lib.dequantize_weight(codes, jnp.asarray(buffers["weight_scales"]),
                                       jnp.asarray(buffers["weight_zeros"]), gs, jnp.float32,
                                       xp=jnp)
    else:
        w = jnp.asarray(buffers["weight"], jnp.float32)
    n_out, n_in = w.shape
    merges = int(buffers["merges"]) + 1
    if perm_in is None or perm_out is None:
        drawn = spec_lib.layer_permutations(hp, _seed_of(buffers["seed"]), merges, n_in, n_out)
        perm_in = drawn[0] if perm_in is None else perm_in
        perm_out = drawn[1] if perm_out is None else perm_out
    perm_in, perm_out = np.asarray(perm_in, np.int64), np.asarray(perm_out, np.int64)
    r_out, r_in = spec_lib.rotations(oft, b, n_out // b, hp.neumann_terms, hp.cayley_formula,
                                     xp=jnp)
    old_in = jnp.asarray(buffers["perm_in"]).astype(jnp.int32)
    old_out = jnp.asarray(buffers["perm_out"]).astype(jnp.int32)
    new_in_inv = jnp.asarray(spec_lib.inverse(perm_in), jnp.int32)
    new_out_inv = jnp.asarray(spec_lib.inverse(perm_out), jnp.int32)
    new_w = spec_lib.merged_weight(w, r_out, r_in, old_in, old_out, new_in_inv, new_out_inv,
                                   xp=jnp)
    out_buf = dict(buffers)
    if quantized:
        codes, scales, zeros = spec_lib.quantize_weight(new_w, gs, xp=jnp)
        out_buf["weight"] = codes
        out_buf["weight_scales"] = scales.astype(jnp.asarray(buffers["weight_scales"]).dtype)
        out_buf["weight_zeros"] = zeros.astype(jnp.asarray(buffers["weight_zeros"]).dtype)
    else:
        out_buf["weight"] = new_w.astype(jnp.asarray(buffers["weight"]).dtype)
    if "bias" in buffers:
        out_buf["bias"] = spec_lib.merged_bias(jnp.asarray(buffers["bias"], jnp.float32), r_out,
                                               old_out, new_out_inv, xp=jnp)
    out_buf["perm_in"] = jnp.asarray(perm_in, jnp.int32)
    out_buf["perm_out"] = jnp.asarray(perm_out, jnp.int32)
    out_buf["perm_in_inv"] = new_in_inv
    out_buf["perm_out_inv"] = new_out_inv
    out_buf["merges"] = jnp.asarray(merges, jnp.int32)
    out_params = dict(params)
    out_params["oft_R"] = jnp.zeros_like(params["oft_R"])
    return out_params, out_buf


@full_precision
def merge_and_reset(variables: Mapping[str, Any], spec: spec_lib.POET | None = None,
                    ) -> dict[str, Any]:
    """Merge every POET layer of a model's variables (``{"params": ..., "poet": ...}``):
    the rotations go into ``W0``, new permutations are drawn (``xopt.random``, the layer's
    seed and merge count), ``oft_R`` becomes zero. Returns new variables."""
    hp = spec or spec_lib.POET()
    params, poet = variables["params"], variables["poet"]
    for path in list(_layers(params)):
        p, q = merge_layer(_get(params, path), _get(poet, path), hp)
        params, poet = _set(params, path, p), _set(poet, path, q)
    out = dict(variables)
    out["params"], out["poet"] = params, poet
    return out


# -- the optimizer ------------------------------------------------------------------------------


class POETAdamWState(NamedTuple):
    """State of :func:`poet_adamw` (the spec's ``"xopt.jax"`` naming).

    Attributes:
      count: int32 ``()``: updates taken (POETAdamW's ``global_step_counter``).
      step: per leaf, int32 ``()``: updates since the last moment reset, t.
      mu, nu: per leaf, Adam's moments in ``promote(dtype, float32)``.
      nonfinite_skips: int32 ``()`` under ``nonfinite="skip"``, else None.
    """

    count: jax.Array
    step: Any
    mu: Any
    nu: Any
    nonfinite_skips: jax.Array | None = None


def _bias_correction(beta: Any, t: jax.Array) -> jax.Array:
    """1 − βᵗ as −expm1(t·log β): written as 1 − β**t in float32 it cancels (1 − 0.999f is
    off by 1.3e-5 relative). log β is a double constant for a Python β (as the authors'
    double arithmetic), a float32 one for an array β (optax.inject_hyperparams)."""
    if isinstance(beta, (int, float)):
        return -jnp.expm1(t * math.log(beta)) if beta > 0 else jnp.ones_like(t)
    safe = jnp.where(beta > 0, beta, 1.0)
    return jnp.where(beta > 0, -jnp.expm1(t * jnp.log(safe)), jnp.ones_like(t))


def _is_static_zero(x: Any) -> bool:
    return isinstance(x, (int, float)) and x == 0


def poet_adamw(learning_rate: float | None = None, poet_scale: float | None = None,
               b1: float | None = None, b2: float | None = None, eps: float | None = None,
               weight_decay: float | None = None, merge_interval: int | None = None, *,
               correct_bias: bool | None = None, spec: spec_lib.POET | None = None,
               nonfinite: str | None = None, **unknown: Any,
               ) -> optax.GradientTransformationExtraArgs:
    """The authors' POETAdamW for rotation vectors (:func:`xopt.specs.poet.adam_update`).

    Per leaf, with t the updates since the last reset (the moments restart at the first
    update after every ``merge_interval`` updates): ``m ← β₁m + (1−β₁)g``,
    ``v ← β₂v + (1−β₂)g²``, ``p ← p − α·m/(√v + ε)`` with
    ``α = η·s·√(1−β₂ᵗ)/(1−β₁ᵗ)`` (s = ``poet_scale`` when positive), then
    ``p ← p − η·s·λ·p``; the update is additive (``optax.apply_updates``), in the moments'
    dtype (float32 for a bfloat16/float16 leaf, so that its new value is rounded once, as
    xopt.torch rounds it).

    Args:
      learning_rate, poet_scale, b1, b2, eps, weight_decay: floats or 0-d arrays (every one
        can be injected with ``optax.inject_hyperparams``); None: ``spec``'s value.
      merge_interval: a Python int (it decides when the moments restart; name it in
        ``static_args`` under ``optax.inject_hyperparams``).
      correct_bias: bias-corrected step size (the authors' default).
      spec: the :class:`xopt.specs.poet.POET` the defaults come from.
      nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` (:mod:`xopt.nonfinite`).

    ``update(grads, state, params, **extra)`` needs ``params`` (the decay reads them);
    ``value=`` and other extra arguments are accepted and unused.
    """
    label = "xopt.jax.poet_adamw"
    _contract.reject_unknown(label, unknown, poet_adamw)
    _contract.require_static(label, merge_interval=merge_interval)
    if spec is not None and not isinstance(spec, spec_lib.POET):
        raise HyperparameterError(f"{label}: spec must be an xopt.specs.poet.POET, got "
                                  f"{type(spec).__name__}")
    given = dict(lr=learning_rate, poet_scale=poet_scale, b1=b1, b2=b2, eps=eps,
                 weight_decay=weight_decay, merge_interval=merge_interval,
                 correct_bias=correct_bias)
    try:
        hp = (spec or spec_lib.POET()).replace(
            **{k: v for k, v in given.items() if v is not None})
    except HyperparameterError as e:
        raise HyperparameterError(f"{label}: {e}") from None
    mode = _contract.resolve_nonfinite(label, nonfinite)
    interval = hp.merge_interval

    def init_fn(params: Any) -> POETAdamWState:
        zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)),
                             params)
        return POETAdamWState(count=jnp.zeros((), jnp.int32),
                              step=jax.tree.map(lambda p: jnp.zeros((), jnp.int32), params),
                              mu=zeros, nu=jax.tree.map(jnp.copy, zeros))

    def update_fn(grads: Any, state: POETAdamWState, params: Any = None,
                  **extra_args: Any) -> tuple[Any, POETAdamWState]:
        del extra_args  # value=loss and the like: unused
        if params is None:
            raise ValueError(f"{label}: update(grads, state, params) needs params (the "
                             "weight decay reads them)")
        reset = (state.count > 0) & (state.count % interval == 0)
        scale = hp.poet_scale
        if isinstance(scale, (int, float)):
            lr = hp.lr * scale if scale > 0.0 else hp.lr
        else:
            lr = jnp.where(scale > 0.0, hp.lr * scale, hp.lr)

        def one(g, p, m, v, t):
            m = jnp.where(reset, jnp.zeros_like(m), m)
            v = jnp.where(reset, jnp.zeros_like(v), v)
            t = jnp.where(reset, 0, t) + 1
            g = g.astype(m.dtype)
            m = m * hp.b1 + g * (1.0 - hp.b1)
            v = v * hp.b2 + (1.0 - hp.b2) * g * g
            denom = jnp.sqrt(v) + hp.eps
            size = lr
            if hp.correct_bias:
                tf = t.astype(m.dtype)
                size = size * jnp.sqrt(_bias_correction(hp.b2, tf)) / _bias_correction(hp.b1, tf)
            u = -size * (m / denom)
            if not _is_static_zero(hp.weight_decay):  # the spec's order: decay of p − α·m/d
                new = p.astype(m.dtype) + u
                u = (new + new * (-lr * hp.weight_decay)) - p.astype(m.dtype)
            # in the state's dtype: apply_updates rounds a narrower leaf's new value once
            return u, m, v, t

        out = jax.tree.map(one, grads, params, state.mu, state.nu, state.step)
        is_out = lambda x: isinstance(x, tuple) and len(x) == 4  # noqa: E731
        pick = lambda i: jax.tree.map(lambda o: o[i], out, is_leaf=is_out)  # noqa: E731
        return pick(0), POETAdamWState(optax.safe_increment(state.count), pick(3), pick(1),
                                       pick(2))

    return _contract.transformation(label, init_fn, full_precision(update_fn), nonfinite=mode)


_contract.public_signature(poet_adamw)


register("poet", "jax", poet_adamw)
