"""Flora (Hao, Cao and Mou, ICML 2024): Adafactor with momentum compressed by random projections.

Flora keeps Adafactor's second moment (factored into row and column statistics for
matrices) and adds momentum that, for a matrix ``G`` (``m × n``), lives in an
``r``-dimensional random subspace: ``C = P G`` (left, ``P`` is ``r × m``, for ``m < n``)
or ``C = G P`` (right, ``P`` is ``n × r``), ``P`` Gaussian with entries ``N(0, 1/r)``
regenerated from a seed instead of stored. Every ``kappa`` steps the momentum moves to a
fresh seed (``C ← down(P_new, up(P_old, C))``: decompress with the old projection,
compress with the new one). The paper's Algorithm 2 ("Flora with momentum"); the code is
``flora_opt/optimizers/torch/flora.py`` (``flora_step_``) of BorealisAI/flora-opt at
f329bbc, which this module follows operation for operation.

One update of parameter ``p`` with gradient ``g`` at 1-based step ``t`` (the order of
``flora_step_``; ``ε₀, ε₁ = eps``, ``β₁ = beta1``, ``d = decay_rate``, ``η = lr``)::

    ρ = rms(p)                                   (state "RMS"; rms(x) = ‖x‖₂ / √numel)
    η_t = η · max(ε₁, ρ)                         (scale_parameter; else η)
    β₂ₜ = 1 − t^d
    a = g² + ε₀
    factored (2-D, factorize_second_moment):
        R ← β₂ₜ R + (1 − β₂ₜ) mean_cols(a)      C ← β₂ₜ C + (1 − β₂ₜ) mean_rows(a)
        u = g · rsqrt(R / mean(R))[:, None] · rsqrt(C)[None, :]
    else:
        V ← β₂ₜ V + (1 − β₂ₜ) a                  u = g · rsqrt(V)
    momentum, full (1-D, ≥3-D, rank None, embeddings):
        u ← (1 − β₁) u + β₁ M;   M ← u
    momentum, compressed (matrices; left if m < n else right):
        ũ = (1 − β₁) u + β₁ up(P, Mc)
        if t mod kappa = 0:  seed ← next_seed(seed), P' from the new seed,
                             Mc ← down(P', up(P, Mc)),  P ← P'
        Mc ← β₁ Mc + (1 − β₁) down(P, u);  u ← ũ
    u ← u / max(1, rms(u) / clip_threshold)
    p ← p − η_t λ p   (λ = weight_decay, when λ ≠ 0)
    p ← p − η_t u

with ``up(P, X) = Pᵀ X``, ``down(P, X) = P X`` (left) and ``up(P, X) = X Pᵀ``,
``down(P, X) = X P`` (right). There is no bias correction. Which parameters get a
compressed momentum is the authors' rule (``Flora._get_options``): a 2-D parameter with a
factored second moment, ``beta1 > 0``, ``rank > 0``, ``rank ≤ min(m, n)`` and
``max(m, n) / min(m, n) ≤ 4`` (embeddings excluded); xopt adds the group switch
``project`` (False: full momentum) and raises, naming the parameter, where the original
would silently fall back because the rank exceeds the matrix.

Seeds and projections
---------------------
The seed state and its evolution are the original's, in exact integer arithmetic:
parameter ``i`` (1-based, over every parameter of every group in order) starts with seed
``seed + i``; a transfer replaces ``s`` by ``next_seed(s)``, the 15th value of
``torch.randint(0, 2**63 - 1, (15,), generator=torch.Generator().manual_seed(s))``.
:func:`next_seed` computes it without torch: torch's CPU generator is MT19937 seeded with
``s mod 2**32``; a 64-bit draw is two 32-bit outputs ``(hi << 32) | lo``, reduced
``mod (2**63 − 1)``. The original then draws ``P`` with ``torch.randn`` from a generator
seeded with ``split_seed(s)[0]`` (left) or ``[1]`` (right); those normals depend on
torch's CPU kernels and devices (the original's own CUDA draws differ from its CPU ones),
so xopt draws its own from :mod:`xopt.random`, the same bits in NumPy, torch and JAX::

    P = float(xopt.random.normal(s, shape, counter=0, dtype="float32")) / sqrt(rank)

keyed by the 64-bit state seed ``s`` itself (shape ``(rank, m)`` left, ``(n, rank)``
right; drawn in float32 and cast to the state's dtype, so the oracle, torch and jax use the
same matrix). To reproduce a recorded run, ``inject`` replaces ``P`` before and after the
update with the original's (``proj_before``, ``proj_after`` in a trace's aux; see
:mod:`xopt.parity.methods.flora`).

Everything here is written against the array API (NumPy float64: the oracle; torch;
jax.numpy). Under torch the operations are the original's torch calls in its order, so
the torch backend reproduces the original on the CPU bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

from xopt import random as xrandom
from xopt.errors import HyperparameterError
from xopt.specs import arrays, lowrank
from xopt.specs._groups import ParamGroups, hp_for
from xopt.specs._hyperparams import NONNEGATIVE, POSITIVE, UNIT_HALF_OPEN, Hyperparams, Interval, hp
from xopt.specs._method import MethodSpec
from xopt.specs._state import Naming, StateSchema, StateVar, same_as_param, scalar

# -- hyperparameters -----------------------------------------------------------------------

#: largest base seed: ``seed + i`` must stay an int64 for every parameter ``i``
MAX_SEED = 2**62


@dataclasses.dataclass(frozen=True)
class Flora(Hyperparams):
    """Flora's hyperparameters, in the original's names with its defaults
    (``flora_opt/optimizers/torch/flora.py``, ``Flora.__init__``)."""

    METHOD = "flora"

    lr: float | None = hp(None, doc="learning rate η (required unless relative_step)",
                          interval=NONNEGATIVE)
    rank: int | None = hp(None, doc="rank r of the compressed momentum (None or 0: full)",
                          interval=NONNEGATIVE)
    kappa: int = hp(1000, doc="steps between momentum transfers to a new projection",
                    interval=Interval(1, None))
    eps: tuple = hp((1e-30, 1e-3), doc="(ε₀ added to g², ε₁ floor of the parameter RMS)")
    clip_threshold: float = hp(1.0, doc="update RMS clipping threshold", interval=POSITIVE)
    decay_rate: float = hp(-0.8, doc="d in β₂ₜ = 1 − t^d", interval=Interval(None, 0.0))
    beta1: float | None = hp(None, doc="momentum β₁ (None or 0: no momentum)",
                             interval=UNIT_HALF_OPEN)
    weight_decay: float = hp(0.0, doc="decoupled weight decay λ (times η_t)",
                             interval=NONNEGATIVE)
    scale_parameter: bool = hp(True, doc="scale η by max(ε₁, RMS(p))")
    relative_step: bool = hp(False, doc="η_t = min(1e-2, 1/√t) (Adafactor's relative step)")
    warmup_init: bool = hp(False, doc="with relative_step: η_t = min(1e-6 t, 1/√t)")
    factorize_second_moment: bool = hp(True, doc="Adafactor's factored v for matrices "
                                                 "(False: Adam's full v)")
    seed: int = hp(0, doc="parameter i (1-based, in group order) starts from seed + i",
                   interval=Interval(0, MAX_SEED))
    quantization: bool = hp(False, doc="8-bit blockwise state (bitsandbytes): not supported")
    project: bool = hp(True, doc="xopt: False keeps this group's momentum uncompressed")

    def _check_combinations(self) -> None:
        name = type(self).__name__
        if self.rank is not None and (isinstance(self.rank, bool)
                                      or not isinstance(self.rank, (int, np.integer))):
            raise HyperparameterError(f"{name}.rank = {self.rank!r}: must be an int or None")
        if isinstance(self.kappa, bool) or not isinstance(self.kappa, (int, np.integer)):
            raise HyperparameterError(f"{name}.kappa = {self.kappa!r}: must be a positive int")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise HyperparameterError(f"{name}.seed = {self.seed!r}: must be an int")
        eps = self.eps
        if not isinstance(eps, (tuple, list)) or len(eps) != 2 or not all(
                isinstance(e, (int, float, np.floating, np.integer)) and not isinstance(e, bool)
                and e >= 0 for e in eps):
            raise HyperparameterError(
                f"{name}.eps = {eps!r}: must be a pair (ε₀, ε₁) of non-negative reals")
        if self.quantization:
            raise HyperparameterError(
                f"{name}.quantization = True: not supported (the original stores 8-bit "
                "blockwise-quantized state through bitsandbytes; xopt keeps float state)")
        if self.lr is None and not self.relative_step:
            raise HyperparameterError(
                f"{name}.lr = None: a learning rate is required unless relative_step=True "
                "(the original would fail multiplying None by the parameter scale)")
        if self.lr is not None and self.relative_step:
            raise HyperparameterError(
                f"{name}.relative_step = True: cannot be combined with lr = {self.lr!r} "
                "(pass lr=None; as the original)")
        if self.warmup_init and not self.relative_step:
            raise HyperparameterError(
                f"{name}.warmup_init = True: requires relative_step=True (as the original)")

    @property
    def use_momentum(self) -> bool:
        return self.beta1 is not None and self.beta1 > 0


PRESETS: dict[str, dict[str, Any]] = {}


# -- which parameters get what ----------------------------------------------------------------


def factored(shape: tuple[int, ...], h: Flora) -> bool:
    """Adafactor's factored second moment: exactly 2-D parameters (``_get_options``)."""
    return len(shape) == 2 and h.factorize_second_moment


def compressed(shape: tuple[int, ...], h: Flora) -> bool:
    """Whether the momentum of a parameter of ``shape`` is compressed (the authors' rule,
    ``Flora._get_options``, and xopt's ``project`` switch)."""
    if not (h.project and h.use_momentum and h.rank and factored(shape, h)):
        return False
    lo, hi = min(shape), max(shape)
    return lo >= h.rank and hi / lo <= 4


def rank_too_large(shape: tuple[int, ...], h: Flora) -> bool:
    """A matrix that would be compressed but for a rank larger than its smaller side (the
    original silently keeps its momentum full; xopt raises)."""
    if not (h.project and h.use_momentum and h.rank and factored(shape, h)):
        return False
    lo, hi = min(shape), max(shape)
    return lo < h.rank and (lo == 0 or hi / lo <= 4)


def check_param(shape: tuple[int, ...], h: Flora, where: str) -> None:
    """Raise :class:`HyperparameterError` naming ``where`` for a rank larger than the matrix."""
    if rank_too_large(tuple(shape), h):
        raise HyperparameterError(
            f"{where}: rank = {h.rank} is larger than the matrix allows: shape "
            f"{tuple(shape)} has rank at most {min(shape)} (give it a param group with "
            "project=False, or a smaller rank; the original silently keeps its momentum full)")


def side(shape: tuple[int, ...]) -> str:
    """``"left"`` for ``m < n`` (compress the rows), else ``"right"`` (as ``_down_proj``)."""
    return "left" if shape[0] < shape[-1] else "right"


def projection_shape(shape: tuple[int, ...], rank: int) -> tuple[int, int]:
    """``P``'s shape: ``(r, m)`` left, ``(n, r)`` right (the original's orientation)."""
    return (rank, shape[0]) if side(shape) == "left" else (shape[-1], rank)


def momentum_shape(shape: tuple[int, ...], h: Flora) -> tuple[int, ...]:
    """The momentum's shape: ``(r, n)`` left, ``(m, r)`` right when compressed, else the
    parameter's."""
    if not compressed(shape, h):
        return tuple(shape)
    return (h.rank, shape[-1]) if side(shape) == "left" else (shape[0], h.rank)


# -- seeds: torch's CPU generator in integer arithmetic ------------------------------------

_MT_N, _MT_M = 624, 397
_MT_MATRIX_A, _MT_UPPER, _MT_LOWER = 0x9908B0DF, 0x80000000, 0x7FFFFFFF
_INT64_MAX = 2**63 - 1


def _mt19937(seed: int, count: int) -> list[int]:
    """The first ``count`` (≤ 227) outputs of MT19937 initialised as torch's CPU generator
    (``at::mt19937(seed)``: Matsumoto–Nishimura ``init_genrand`` of ``seed mod 2**32``)."""
    if count > _MT_N - _MT_M:
        raise ValueError("_mt19937: at most 227 outputs (one twist of the first words)")
    mt = [int(seed) & 0xFFFFFFFF]
    for i in range(1, count + _MT_M + 1):
        mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + i) & 0xFFFFFFFF)
    out = []
    for k in range(count):
        y = (mt[k] & _MT_UPPER) | (mt[k + 1] & _MT_LOWER)
        y = mt[k + _MT_M] ^ (y >> 1) ^ (_MT_MATRIX_A if y & 1 else 0)
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        y ^= y >> 18
        out.append(y)
    return out


def torch_randint63(seed: int, count: int) -> list[int]:
    """``torch.randint(0, 2**63 - 1, (count,), generator=Generator().manual_seed(seed))``
    on the CPU, as Python ints: each value is two generator outputs ``(hi << 32) | lo``
    (``CPUGeneratorImpl::random64``) reduced modulo ``2**63 − 1``."""
    w = _mt19937(seed, 2 * count)
    return [((w[2 * i] << 32) | w[2 * i + 1]) % _INT64_MAX for i in range(count)]


def next_seed(seed: int, adv: int = 0xF) -> int:
    """The original's ``next_seed``: the ``adv``-th value of :func:`torch_randint63`."""
    return torch_randint63(seed, adv)[-1]


def split_seed(seed: int) -> tuple[int, int]:
    """The original's ``split_seed``: the generator seeds of its left and right
    projections (recorded as ``gen_seed_*`` in a trace; xopt does not use them)."""
    a, b = torch_randint63(seed, 2)
    return a, b


def initial_seeds(hp: Flora | ParamGroups, names: list[str]) -> dict[str, int]:
    """``{name: seed + i}``, ``i`` 1-based over the parameters in group order (the order
    of ``names`` for a plain Flora), each with its own group's ``seed``."""
    order = hp.names if isinstance(hp, ParamGroups) else list(names)
    return {n: int(hp_for(hp, n).seed) + i for i, n in enumerate(order, start=1)}


# -- the math (array API) ----------------------------------------------------------------


def projection(seed: Any, shape: tuple[int, ...], rank: int, *, xp: ModuleType,
               dtype: Any, device: Any = None) -> Any:
    """``P = normal(seed, projection_shape)/√r`` from :mod:`xopt.random` (see the module
    docstring). ``seed``: int (NumPy, torch) or a jax uint32 ``[hi, lo]`` array."""
    pshape = projection_shape(tuple(shape), rank)
    if arrays.is_torch(xp):
        z = xrandom.normal(int(seed), pshape, dtype="float32", backend="torch", device=device)
        return z.to(dtype) / math.sqrt(rank)
    if xp is np:
        return xrandom.normal(int(seed), pshape, dtype="float32").astype(dtype) / math.sqrt(rank)
    z = xrandom.normal(seed, pshape, dtype="float32", backend="jax")
    return z.astype(dtype) / math.sqrt(rank)


def _t(x: Any) -> Any:
    return x.t() if hasattr(x, "t") and callable(x.t) else x.T


def up(xp: ModuleType, p: Any, c: Any, which: str) -> Any:
    """Decompress: ``Pᵀ C`` (left, ``(r, m)ᵀ (r, n)``) or ``C Pᵀ`` (right, ``(m, r) (n, r)ᵀ``)."""
    return arrays.matmul(xp, _t(p), c) if which == "left" else arrays.matmul(xp, c, _t(p))


def down(xp: ModuleType, p: Any, x: Any, which: str) -> Any:
    """Compress: ``P X`` (left, ``(r, m) (m, n)``) or ``X P`` (right, ``(m, n) (n, r)``)."""
    return arrays.matmul(xp, p, x) if which == "left" else arrays.matmul(xp, x, p)


def rms(xp: ModuleType, x: Any) -> Any:
    """``‖x‖₂ / √numel`` (``Flora._rms``); a 0-d array."""
    n = math.prod(x.shape)
    if arrays.is_torch(xp):
        norm = x.norm(2)
    else:
        flat = xp.reshape(x, (-1,))  # XLA reduces a flat vector more accurately than a matrix
        norm = xp.sqrt(xp.sum(flat * flat))
    # correctly rounded in every namespace: XLA multiplies by the constant's reciprocal, and
    # torch on CUDA by the Python number's (the original's CPU division is the definition)
    return arrays.divide(xp, norm, n ** 0.5)


def _axpy(xp: ModuleType, x: Any, y: Any, alpha: Any) -> Any:
    """``x + alpha·y`` (torch: ``torch.add(x, y, alpha=alpha)``, as ``add_(y, alpha=)``)."""
    if arrays.is_torch(xp):
        return xp.add(x, y, alpha=alpha)
    return x + alpha * y


def beta2(t: Any, decay_rate: float) -> tuple[Any, Any]:
    """``(β₂ₜ, 1 − β₂ₜ)`` with ``β₂ₜ = 1 − t^d``: in double precision for a Python int
    ``t`` (as the original); for an array ``t`` (jax under jit) ``t^d`` in float32 and
    ``β₂ₜ = 1 − t^d``, within an ulp of the double values."""
    if isinstance(t, (int, np.integer)):
        b = 1.0 - math.pow(int(t), decay_rate)
        return b, 1.0 - b
    c = t.astype("float32") ** decay_rate
    return 1.0 - c, c


def relative_step_size(h: Flora, t: Any) -> Any:
    """η before the parameter scale: ``lr``, or Adafactor's relative step
    ``min(1e-6 t if warmup_init else 1e-2, 1/√t)`` (``Flora._get_lr``)."""
    if not h.relative_step:
        return h.lr
    if isinstance(t, (int, np.integer)):
        min_step = 1e-6 * int(t) if h.warmup_init else 1e-2
        return min(min_step, 1.0 / math.sqrt(int(t)))
    xp = arrays.namespace(t)
    tf = t.astype(xp.float32)
    min_step = 1e-6 * tf if h.warmup_init else 1e-2
    return xp.minimum(min_step, 1.0 / xp.sqrt(tf))


def learning_rate(xp: ModuleType, h: Flora, rho: Any, t: Any) -> Any:
    """``η_t = η · max(ε₁, ρ)`` (or ``η`` without scale_parameter).

    Under torch on the CPU this is the original's Python ``max`` of a float and the 0-d
    tensor ``ρ`` (a host comparison, free there): a float32 tensor when ``ρ > ε₁``, else
    the double ``ε₁ η``. Elsewhere it is a ``where`` on the device (no synchronisation).
    """
    rel = relative_step_size(h, t)
    if not h.scale_parameter:
        return rel
    eps1 = float(h.eps[1])
    if arrays.is_torch(xp) and rho.device.type == "cpu" and isinstance(rel, (int, float)):
        return rho * rel if bool(rho > eps1) else eps1 * rel
    return xp.where(rho > eps1, rho * rel, eps1 * rel)


def second_moment_factored(xp: ModuleType, row: Any, col: Any, g: Any, b2: Any, one_minus_b2: Any,
                           eps0: float) -> tuple[Any, Any, Any]:
    """Adafactor's factored second moment and the normalised gradient.

    ``row`` ``(m,)``, ``col`` ``(n,)``, ``g`` ``(m, n)``; returns the new ``row``, ``col`` and
    ``u = g · rsqrt(row/mean(row))[:, None] · rsqrt(col)[None, :]`` (``_approx_sq_grad``).
    """
    a = g * g + eps0
    row = _axpy(xp, row * b2, arrays.mean(xp, a, (-1,)), one_minus_b2)
    col = _axpy(xp, col * b2, arrays.mean(xp, a, (-2,)), one_minus_b2)
    r = arrays.expand_dims(
        xp, arrays.rsqrt(xp, row / arrays.mean(xp, row, (-1,), keepdims=True)), -1)
    c = arrays.rsqrt(xp, arrays.expand_dims(xp, col, -2))
    return row, col, (r * c) * g


def second_moment_full(xp: ModuleType, v: Any, g: Any, b2: Any, one_minus_b2: Any,
                       eps0: float) -> tuple[Any, Any]:
    """Unfactored second moment (1-D, ≥3-D, or factorize_second_moment=False): the new
    ``v`` and ``u = rsqrt(v) · g``; shapes of ``g``."""
    v = _axpy(xp, v * b2, g * g + eps0, one_minus_b2)
    return v, arrays.rsqrt(xp, v) * g


def mix(u: Any, m: Any, b1: float) -> Any:
    """``(1 − β₁) u + β₁ m``: the momentum step (full) or the update (compressed)."""
    return u * (1 - b1) + m * b1


def accumulate(c: Any, d: Any, b1: float) -> Any:
    """``β₁ C + (1 − β₁) D``: the compressed momentum's update."""
    return c * b1 + d * (1 - b1)


def clip(xp: ModuleType, u: Any, clip_threshold: float) -> tuple[Any, Any]:
    """``(u / max(1, rms(u)/clip_threshold), rms(u))``."""
    r = rms(xp, u)
    s = arrays.divide(xp, r, clip_threshold)  # a scalar: correctly rounded, as rms
    if arrays.is_torch(xp):
        return u / s.clamp(min=1.0), r
    return u / xp.maximum(s, 1.0), r


def apply(xp: ModuleType, p: Any, u: Any, lr: Any, weight_decay: float) -> Any:
    """``p − η_t λ p − η_t u``, as the original: ``u ← u η_t``; ``p ← p + (−λ η_t) p`` (one
    fused ``add`` with ``alpha`` under torch on the CPU); ``p ← p − u``."""
    u = u * lr
    if weight_decay != 0:
        a = -weight_decay * lr
        if arrays.is_torch(xp) and (not hasattr(a, "device") or a.device.type == "cpu"):
            p = xp.add(p, p, alpha=a)
        else:
            p = p + p * a
    return p - u


# -- the whole optimizer as a pure function (the oracle's definition) ----------------------


def init_state(hp: Flora | ParamGroups, params: Mapping[str, Any], *, xp: ModuleType = np,
               dtype: Any = None) -> dict[str, Any]:
    """Canonical state before the first update: ``step`` 0, seeds ``seed + i``, zeros.

    Floating state takes ``dtype`` if given, else the parameter's promoted to float32.
    """
    names = list(params)
    seeds = initial_seeds(hp, names)
    state: dict[str, Any] = {"step": np.int64(0)}
    for name, p in params.items():
        h = hp_for(hp, name)
        shape = tuple(p.shape)
        dt = dtype or np.promote_types(np.asarray(p).dtype, np.float32)
        state[f"seed/{name}"] = np.int64(seeds[name])
        state[f"rms/{name}"] = xp.zeros((), dtype=dt)
        if h.use_momentum:
            state[f"m/{name}"] = xp.zeros(momentum_shape(shape, h), dtype=dt)
        if factored(shape, h):
            state[f"v_row/{name}"] = xp.zeros(shape[:-1], dtype=dt)
            state[f"v_col/{name}"] = xp.zeros(shape[:-2] + shape[-1:], dtype=dt)
        else:
            state[f"v/{name}"] = xp.zeros(shape, dtype=dt)
    return state


def update_param(xp: ModuleType, h: Flora, p: Any, g: Any, st: Mapping[str, Any], t: int,
                 inject: Mapping[str, Any] | None = None, aux: dict[str, Any] | None = None,
                 device: Any = None) -> tuple[Any, dict[str, Any]]:
    """One parameter's update at 1-based step ``t`` (concrete: NumPy or torch).

    Args:
      p, g: parameter and gradient, same shape, the state's float dtype.
      st: this parameter's state ``{"seed": int, "m": ..., "v_row"/"v_col" or "v": ...}``.
      inject: ``{"proj_before": P, "proj_after": P'}`` replacing xopt's own draws.
      aux: filled with ``update_rms``, and for compressed momentum ``seed_before``,
        ``seed_after``, ``transferred``, ``proj_before``, ``proj_after``.
    Returns:
      ``(p, new state entries)``.
    """
    shape = tuple(p.shape)
    new: dict[str, Any] = {"seed": int(st["seed"])}
    rho = rms(xp, p)
    new["rms"] = rho
    lr = learning_rate(xp, h, rho, t)
    b2, omb2 = beta2(t, h.decay_rate)
    eps0 = float(h.eps[0])
    if factored(shape, h):
        new["v_row"], new["v_col"], u = second_moment_factored(
            xp, st["v_row"], st["v_col"], g, b2, omb2, eps0)
    else:
        new["v"], u = second_moment_full(xp, st["v"], g, b2, omb2, eps0)
    if h.use_momentum:
        b1 = h.beta1
        if not compressed(shape, h):
            u = mix(u, st["m"], b1)
            new["m"] = u
        else:
            which = side(shape)
            seed = new["seed"]
            transfer = t % h.kappa == 0
            seed_after = next_seed(seed) if transfer else seed
            if inject is not None and "proj_before" in inject:
                p_before, p_after = inject["proj_before"], inject["proj_after"]
            else:
                p_before = projection(seed, shape, h.rank, xp=xp, dtype=g.dtype, device=device)
                p_after = lowrank.refresh(transfer, p_before, lambda: projection(
                    seed_after, shape, h.rank, xp=xp, dtype=g.dtype, device=device))
            c = st["m"]
            c_up = up(xp, p_before, c, which)
            raw = u
            u = mix(u, c_up, b1)
            if transfer:
                c = down(xp, p_after, c_up, which)
            new["m"] = accumulate(c, down(xp, p_after, raw, which), b1)
            new["seed"] = seed_after
            if aux is not None:
                aux.update(seed_before=np.int64(seed), seed_after=np.int64(seed_after),
                           transferred=np.bool_(transfer), proj_before=p_before,
                           proj_after=p_after)
    u, u_rms = clip(xp, u, h.clip_threshold)
    if aux is not None:
        aux["update_rms"] = u_rms
    return apply(xp, p, u, lr, h.weight_decay), new


_PER_PARAM = ("seed", "rms", "m", "v_row", "v_col", "v")


def step(hp: Flora | ParamGroups, params: Mapping[str, Any], state: Mapping[str, Any],
         grads: Mapping[str, Any], *, xp: ModuleType = np, loss: Any = None,
         inject: Mapping[str, Mapping[str, Any]] | None = None,
         aux: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every parameter's update: ``(params, state) -> (params, state)``, pure.

    ``state`` is canonical (:data:`STATE`); ``inject`` maps a parameter name to its
    ``proj_before``/``proj_after``; ``aux`` (optional) receives ``"<param>/<key>"`` for the
    keys :func:`update_param` records; ``loss`` is unused.
    """
    del loss
    t = int(state["step"]) + 1
    new_params: dict[str, Any] = {}
    new_state: dict[str, Any] = {"step": np.int64(t)}
    for name, p in params.items():
        h = hp_for(hp, name)
        st = {k: state[f"{k}/{name}"] for k in _PER_PARAM if f"{k}/{name}" in state}
        a: dict[str, Any] | None = {} if aux is not None else None
        new_params[name], new = update_param(xp, h, p, grads[name], st, t,
                                             (inject or {}).get(name), a)
        for k, v in new.items():
            new_state[f"{k}/{name}"] = np.int64(v) if k == "seed" else v
        if aux is not None:
            aux.update({f"{name}/{k}": v for k, v in a.items()})
    return new_params, new_state


# -- state schema --------------------------------------------------------------------------


def _momentum_shape(shape: tuple[int, ...], h: Flora) -> tuple[int, ...]:
    return momentum_shape(shape, h)


def encode_seed_words(seed: Any) -> np.ndarray:
    """An int64 seed as xopt.jax stores it: uint32 ``[hi, lo]``."""
    s = int(np.asarray(seed))
    return np.array([s >> 32, s & 0xFFFFFFFF], dtype=np.uint32)


def decode_seed_words(words: Any) -> np.ndarray:
    """uint32 ``[hi, lo]`` back to the int64 seed."""
    w = np.asarray(words).astype(np.uint64)
    return np.int64((int(w[0]) << 32) | int(w[1]))


STATE = StateSchema(
    vars=(
        StateVar("step", "global", scalar, "int64", "number of updates taken, t"),
        StateVar("seed", "param", scalar, "int64",
                 "projection seed s (seed + i at first; next_seed(s) at every transfer)"),
        StateVar("rms", "param", scalar, "state", "RMS of the parameter before the last update"),
        StateVar("m", "param", _momentum_shape, "state",
                 "momentum: compressed (r, n) left / (m, r) right, else the parameter's shape",
                 active=lambda h: h.use_momentum,
                 applies=lambda shape, h: h.use_momentum),
        StateVar("v_row", "param", lambda s, h: tuple(s[:-1]), "state",
                 "factored second moment, row statistics R (m,)",
                 applies=lambda shape, h: factored(shape, h)),
        StateVar("v_col", "param", lambda s, h: tuple(s[:-2]) + tuple(s[-1:]), "state",
                 "factored second moment, column statistics C (n,)",
                 applies=lambda shape, h: factored(shape, h)),
        StateVar("v", "param", same_as_param, "state", "unfactored second moment V",
                 applies=lambda shape, h: not factored(shape, h)),
    ),
    namings={
        # flora_opt.Flora.state[p] (and xopt.torch.Flora's, so state dicts interchange).
        "flora_opt": Naming(
            keys={"step": "{param}/step", "seed": "{param}/seed", "rms": "{param}/RMS",
                  "m": "{param}/exp_avg", "v_row": "{param}/exp_avg_sq_row",
                  "v_col": "{param}/exp_avg_sq_col", "v": "{param}/exp_avg_sq"},
            dtypes={"step": "int64", "seed": "int64"},
            doc="flora_opt.Flora / xopt.torch.Flora: optimizer.state[param][key]",
        ),
        # xopt.jax.flora: FloraState(count, seed, rms, m, v_row, v_col, v).
        "xopt.jax": Naming(
            keys={"step": "count", "seed": "seed/{param}", "rms": "rms/{param}",
                  "m": "m/{param}", "v_row": "v_row/{param}", "v_col": "v_col/{param}",
                  "v": "v/{param}"},
            dtypes={"step": "int32", "seed": "uint32"},
            codecs={"seed": (encode_seed_words, decode_seed_words)},
            doc="xopt.jax.flora: FloraState; seeds as uint32 [hi, lo] (no x64 needed)",
        ),
    },
)


SPEC = MethodSpec(
    name="flora",
    title="Flora: Adafactor with momentum compressed by seeded random projections",
    hyperparams=Flora,
    presets=PRESETS,
    state=STATE,
    init_state=init_state,
    step=step,
    naming_of={"torch": "flora_opt", "jax": "xopt.jax"},
)
