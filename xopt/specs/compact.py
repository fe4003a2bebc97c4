"""CompAct (Shamshoum, Hodos, Sieradzki & Schuster, 2024): linear layers that save a random
projection of their input for the backward pass, and the Adam that works in that space.

For a linear layer ``y = x Wᵀ + b`` with ``x`` of shape ``(..., n)`` and ``W`` of shape
``(m, n)`` (torch's layout: out × in), CompAct keeps the forward exact and changes what is
saved and how ``W`` is updated (the paper writes ``W`` as n × m; the equations below are in
torch's layout, which is also the authors' code's):

* forward (Algorithm 1): ``y = x Wᵀ + b``; save ``z = x P`` (shape ``(..., r)``), not ``x``.
  ``P`` (n × r) is drawn from a seed, never stored.
* backward (Algorithm 2, eqs. 8-9): ``∂L/∂x = g W`` (exact), and the *compressed* weight
  gradient ``Ĝ = gᵀ z`` (m × r, summed over all leading dimensions), ``g = ∂L/∂y``. The bias
  gradient is exact.
* update (Algorithm 3, eqs. 10-11), Adam on ``Ĝ`` with moments ``M, V`` of shape m × r::

      M_t = β₁ M_{t-1} + (1 − β₁) Ĝ_t          V_t = β₂ V_{t-1} + (1 − β₂) Ĝ_t²
      N_t = M_t / (√V_t + ε)                   s_t = η √(1 − β₂ᵗ) / (1 − β₁ᵗ)
      W_t = W_{t-1} − s_t · α (N_t Pᵀ)         (then W_t ← W_t − η λ W_t if λ > 0)

  ``α`` is the scale; the step size folds both bias corrections into ``s_t`` and ε is added
  to the uncorrected √V (the authors' ``optimizers/adamw.py``, the transformers AdamW they
  copied, not the paper's Algorithm 3 lines 3-5); weight decay comes *after* the step, on
  the updated weight, as there. Parameters that are not CompAct weights (embeddings,
  norms, the LM head, biases) get the same Adam on their full gradient.

Projections (``proj_type``): ``"gaussian"``, ``P_ij ~ N(0, 1/r)`` (§3.3), and
``"sparse_jl"``, the sparse Johnson-Lindenstrauss matrix of the paper's ablation (§5,
Dasgupta, Kumar & Sarlós 2010): every row of P has ``s = min(jl_nnz, r)`` non-zeros
``±1/√s``, one in each of ``s`` column blocks, so every row has unit norm and
``E[P Pᵀ] = I`` as for the Gaussian. ``"identity"`` (P = I, r = n) is what the authors give
LLaMA's attention output projection (``o_proj``): no compression, its own scale
``scale_o_proj · scale`` (their ``torchrun_main._replace_linear_with_custom``).

Randomness. Layer ``i``'s seed is ``fold_in(seed, i)``; at update ``t`` (0-based, counting
optimizer updates) its projection is drawn from ``fold_in(layer_seed, t // gap)`` with
:mod:`xopt.random` (``gap = 0``: never refreshed), in the forward and again in the
optimizer, so torch and JAX draw the same bits. The authors draw P with torch's generator
from ``Projector.seed``, which starts at ``torch.randint(1, 1e6)`` and is bumped by one at
every iteration divisible by ``gap`` (:func:`original_seed`); their draws are in the golden
traces (``aux/P``) and are injected when xopt is compared with them.

The functions below are written against the array API (NumPy, torch, jax.numpy); under
NumPy float64 they are the oracle. Under torch they perform the authors' operations in
their order (``mul_``/``add_`` with ``alpha``, ``addcmul_``, ``einsum``), so the torch
backend reproduces the recorded traces bit for bit on the CPU where the recorder ran.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from xopt.errors import HyperparameterError
from xopt.specs import arrays
from xopt.specs._hyperparams import NONNEGATIVE, UNIT_HALF_OPEN, Hyperparams, Interval, hp
from xopt.specs._method import MethodSpec
from xopt.specs._state import Naming, StateSchema, StateVar, same_as_param, scalar

RANK_RATIO = Interval(0.0, 1.0, lo_closed=False, hi_closed=True)  # (0, 1]
PROJ_TYPES = ("gaussian", "sparse_jl")
KINDS = ("gaussian", "sparse_jl", "identity")

# -- hyperparameters -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompAct(Hyperparams):
    """CompAct hyperparameters.

    Adam's defaults are the authors' ``optimizers.adamw.AdamW`` (exported as
    ``SmallAdamW``: lr 1e-3, ε 1e-6, no weight decay); the projection's are their
    ``torchrun_main.py`` argparse defaults (``--rank 0.5 --scale 1.0 --scale_o_proj 1.0``,
    ``--update_proj_gap None``, written 0 here: never refresh). The paper's pretraining
    runs use scale 0.25, gap 50 (Appendix B.1) and lr 0.01 with scale_o_proj 0.5 (B.2).
    """

    METHOD = "compact"

    lr: float = hp(1e-3, doc="learning rate η", interval=NONNEGATIVE)
    b1: float = hp(0.9, doc="first-moment decay β₁", interval=UNIT_HALF_OPEN)
    b2: float = hp(0.999, doc="second-moment decay β₂", interval=UNIT_HALF_OPEN)
    eps: float = hp(1e-6, doc="ε added to √V (uncorrected)", interval=NONNEGATIVE)
    weight_decay: float = hp(0.0, doc="decoupled weight decay λ, applied after the step as "
                             "W ← W − ηλW", interval=NONNEGATIVE)
    correct_bias: bool = hp(True, doc="fold 1 − βᵗ into the step size (the authors' flag)")
    rank: float = hp(0.5, doc="r as a fraction of the layer's input width n: r = round(n·rank)",
                     interval=RANK_RATIO)
    proj_type: str = hp("gaussian", doc="random projection P", choices=PROJ_TYPES)
    scale: float = hp(1.0, doc="α, multiplies the projected-back step", interval=NONNEGATIVE)
    scale_o_proj: float = hp(1.0, doc="extra factor on α for identity-projected layers "
                             "(LLaMA's o_proj): their α is scale_o_proj·scale",
                             interval=NONNEGATIVE)
    gap: int = hp(0, doc="T: draw a new projection every T updates (0: never)",
                  interval=NONNEGATIVE)
    seed: int = hp(0, doc="base seed; layer i's seed is fold_in(seed, i)",
                   interval=Interval(0, 2**64 - 1))
    jl_nnz: int = hp(4, doc="non-zeros per row of a sparse JL projection (capped at r)",
                     interval=Interval(1.0, None))


PRESETS: dict[str, dict[str, Any]] = {
    # The authors' code's defaults (see CompAct's docstring).
    "original": {},
    # The paper's LLaMA 60M-350M pretraining (Appendix B.1, B.2).
    "paper_pretraining": dict(lr=0.01, rank=0.25, scale=0.25, scale_o_proj=0.5, gap=50),
}


def check_rank(rank: Any, where: str = "rank") -> float:
    """``rank`` as a float in (0, 1], else :class:`HyperparameterError` naming ``where``."""
    if isinstance(rank, bool) or not isinstance(rank, (int, float, np.integer, np.floating)):
        raise HyperparameterError(f"{where} = {rank!r}: must be a real number in (0, 1]")
    if float(rank) not in RANK_RATIO:
        raise HyperparameterError(
            f"{where} = {rank!r}: the rank ratio must be in {RANK_RATIO} (r = round(n·rank) "
            "columns of the input width n)")
    return float(rank)


def rank_of(in_features: int, rank: float, where: str = "rank") -> int:
    """The projection width r for input width n: ``round(n · rank)`` (Python's round, as
    the authors' ``sample_gaussian_sketch``); an error if that is 0."""
    rank = check_rank(rank, where)
    r = round(in_features * rank)
    if r < 1:
        raise HyperparameterError(
            f"{where} = {rank!r}: gives r = round({in_features}·{rank}) = 0 for input width "
            f"{in_features}; use a larger ratio")
    return r


# -- projections ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Projection:
    """How one CompAct layer projects: everything needed to redraw its P.

    Attributes:
      kind: ``"gaussian"``, ``"sparse_jl"`` or ``"identity"``.
      in_features: n, the layer's input width.
      rank: r, the projection width (n for ``"identity"``).
      scale: α applied to the projected-back step.
      seed: the layer's seed (a 64-bit int).
      gap: T; the projection of update t is number ``t // T`` (0: always number 0).
      jl_nnz: non-zeros per row for ``"sparse_jl"``.
    """

    kind: str
    in_features: int
    rank: int
    scale: float
    seed: int
    gap: int = 0
    jl_nnz: int = 4

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise HyperparameterError(f"Projection.kind = {self.kind!r}: must be one of "
                                      f"{', '.join(map(repr, KINDS))}")
        if self.kind == "identity" and self.rank != self.in_features:
            raise HyperparameterError("Projection: an identity projection has rank = in_features")
        if not 1 <= self.rank <= self.in_features:
            raise HyperparameterError(
                f"Projection.rank = {self.rank}: must be in [1, in_features={self.in_features}]")

    def refresh(self, update: int) -> int:
        return refresh_index(update, self.gap)


def refresh_index(update: int, gap: int) -> int:
    """Which projection update ``t`` (0-based) uses: ``t // gap`` (``gap = 0``: 0)."""
    return update // gap if gap else 0


def layer_seed(seed: int, index: int) -> int:
    """Seed of the ``index``-th CompAct layer (module order) under base ``seed``."""
    from xopt import random

    return random.fold_in(seed, index)


def projection_seed(layer_seed_: int, refresh: int) -> int:
    """The :mod:`xopt.random` seed of refresh number ``refresh`` of a layer."""
    from xopt import random

    return random.fold_in(layer_seed_, refresh)


def original_seed(seed_initial: int, update: int, gap: int | None) -> int:
    """The authors' ``Projector.seed`` at iteration ``update`` (0-based): bumped by one on
    the first forward of every iteration divisible by ``gap``, never without a gap."""
    return seed_initial + (1 + update // gap if gap else 0)


def gaussian(seed: int, in_features: int, rank: int, *, backend: str = "numpy",
             device: Any = None, dtype: str = "float32") -> Any:
    """``P`` (n × r) with ``P_ij ~ N(0, 1/r)``: :func:`xopt.random.normal` times ``1/√r``
    (a Python float, so each backend multiplies by the same ``dtype`` constant, as the
    authors' ``mat *= 1 / math.sqrt(r)``). ``seed`` may be a jax ``uint32[2]`` array."""
    from xopt import random

    p = random.normal(seed, (in_features, rank), dtype=dtype, backend=backend, device=device)
    return p * (1.0 / math.sqrt(rank))


def sparse_jl_parts(seed: Any, in_features: int, rank: int, nnz: int, *,
                    backend: str = "numpy", device: Any = None) -> tuple[Any, Any, float]:
    """The non-zeros of a sparse JL projection: ``(columns, signs, value)``.

    Columns ``0..r-1`` are split into ``s = min(nnz, r)`` blocks, block ``j`` being
    ``[⌊jr/s⌋, ⌊(j+1)r/s⌋)``; row ``i`` has one non-zero in each block, at offset
    ``w % size_j`` (``w`` = word ``(i, j, 0)`` of ``xopt.random.bits(seed, (n, s, 2))``)
    with sign ``−`` where bit 31 of word ``(i, j, 1)`` is set, and magnitude ``1/√s``.
    (``w % size`` is biased by at most ``size / 2³²``.) Returns integer ``columns`` and
    ``±1`` ``signs`` of shape ``(n, s)`` in the backend's integer/float types, and the
    magnitude as a Python float.
    """
    from xopt import random

    s = min(nnz, rank)
    words = random.bits(seed, (in_features, s, 2), backend=backend, device=device)
    starts = [(j * rank) // s for j in range(s + 1)]
    lo = np.asarray(starts[:-1], dtype=np.int64)
    size = np.asarray(starts[1:], dtype=np.int64) - lo
    if backend == "torch":
        import torch

        lo_t = torch.as_tensor(lo, device=words.device)
        size_t = torch.as_tensor(size, device=words.device)
        cols = lo_t + words[..., 0] % size_t
        signs = 1.0 - 2.0 * (words[..., 1] >> 31).to(torch.float32)
    elif backend == "jax":
        import jax.numpy as jnp

        cols = jnp.asarray(lo, jnp.int32) + (words[..., 0] % jnp.asarray(size, jnp.uint32)
                                             ).astype(jnp.int32)
        signs = 1.0 - 2.0 * (words[..., 1] >> 31).astype(jnp.float32)
    else:
        cols = lo + (words[..., 0] % size.astype(np.uint32)).astype(np.int64)
        signs = 1.0 - 2.0 * (words[..., 1] >> 31).astype(np.float32)
    return cols, signs, 1.0 / math.sqrt(s)


def sparse_jl(seed: Any, in_features: int, rank: int, nnz: int = 4, *, backend: str = "numpy",
              device: Any = None, dtype: str = "float32") -> Any:
    """The sparse JL ``P`` (n × r) of :func:`sparse_jl_parts`, as a dense array of ``dtype``."""
    cols, signs, value = sparse_jl_parts(seed, in_features, rank, nnz, backend=backend,
                                         device=device)
    n = in_features
    if backend == "torch":
        import torch

        dt = getattr(torch, dtype)
        p = torch.zeros((n, rank), dtype=dt, device=cols.device)
        return p.scatter_(1, cols, (signs * value).to(dt))
    if backend == "jax":
        import jax.numpy as jnp

        rows = jnp.arange(n)[:, None]
        return jnp.zeros((n, rank), dtype).at[rows, cols].set((signs * value).astype(dtype))
    p = np.zeros((n, rank), dtype=dtype)
    p[np.arange(n)[:, None], cols] = (signs * value).astype(dtype)
    return p


def projection(proj: Projection, refresh: int, *, backend: str = "numpy", device: Any = None,
               dtype: str = "float32") -> Any:
    """P of ``proj`` for refresh number ``refresh`` (None for an identity projection)."""
    if proj.kind == "identity":
        return None
    seed = projection_seed(proj.seed, refresh)
    if proj.kind == "gaussian":
        return gaussian(seed, proj.in_features, proj.rank, backend=backend, device=device,
                        dtype=dtype)
    return sparse_jl(seed, proj.in_features, proj.rank, proj.jl_nnz, backend=backend,
                     device=device, dtype=dtype)


# -- the layer -----------------------------------------------------------------------------


def linear_forward(x: Any, weight: Any, bias: Any, p: Any, *, xp: Any = np) -> tuple[Any, Any]:
    """Algorithm 1: ``(y, z)`` with ``y = x Wᵀ (+ b)`` and ``z = x P`` (``x`` if P is None).

    Shapes: ``x (..., n)``, ``weight (m, n)``, ``bias (m,)`` or None, ``p (n, r)``;
    ``y (..., m)``, ``z (..., r)``. Same dtype throughout. The bias is added after the
    product (``output += bias`` in the authors' code; torch's fused ``addmm`` rounds
    differently).
    """
    y = x @ _xp_t(weight, xp)
    if bias is not None:
        y = y + bias
    z = x if p is None else x @ p
    return y, z


def linear_backward(grad_output: Any, z: Any, weight: Any, has_bias: bool, *,
                    xp: Any = np) -> tuple[Any, Any, Any]:
    """Algorithm 2 (eqs. 8-9): ``(∂L/∂x, Ĝ, ∂L/∂b)``.

    ``grad_output (..., m)``, ``z (..., r)``, ``weight (m, n)`` → ``∂L/∂x = g W`` of shape
    ``(..., n)``; ``Ĝ = Σ gᵀ z`` of shape ``(m, r)`` over all leading dimensions (the
    authors' ``einsum('bij,bik->jk')``); ``∂L/∂b = Σ g`` of shape ``(m,)`` (None without a
    bias), summed one leading dimension at a time, first to last, as theirs.
    """
    grad_x = grad_output @ weight
    lead = grad_output.ndim - 1
    if lead == 2:
        g_hat = _einsum(xp, "bij,bik->jk", grad_output, z)
    elif lead == 1:
        g_hat = _einsum(xp, "bi,bj->ij", grad_output, z)
    else:
        g2 = xp.reshape(grad_output, (-1, grad_output.shape[-1]))
        z2 = xp.reshape(z, (-1, z.shape[-1]))
        g_hat = _einsum(xp, "bi,bj->ij", g2, z2)
    grad_b = None
    if has_bias:
        grad_b = grad_output
        for _ in range(lead):
            grad_b = _sum0(xp, grad_b)
    return grad_x, g_hat, grad_b


def _xp_t(w: Any, xp: Any) -> Any:
    return w.T


def _einsum(xp: Any, eq: str, a: Any, b: Any) -> Any:
    return xp.einsum(eq, a, b)


def _sum0(xp: Any, a: Any) -> Any:
    if arrays.is_torch(xp):
        return a.sum(dim=0)
    return xp.sum(a, axis=0)


# -- the optimizer ---------------------------------------------------------------------------


def step_size(lr: float, b1: float, b2: float, count: int, correct_bias: bool) -> float:
    """``s_t = η √(1 − β₂ᵗ) / (1 − β₁ᵗ)`` in double precision (Python floats), or ``η``."""
    if not correct_bias:
        return lr
    return lr * math.sqrt(1.0 - b2**count) / (1.0 - b1**count)


def moments(g: Any, m: Any, v: Any, *, b1: float, b2: float, xp: Any) -> tuple[Any, Any]:
    """``M = β₁M + (1−β₁)Ĝ``, ``V = β₂V + (1−β₂)Ĝ²`` in the authors' order
    (``mul_(β).add_(Ĝ, alpha=1−β)``, ``mul_(β).addcmul_(Ĝ, Ĝ, value=1−β)``)."""
    if arrays.is_torch(xp):
        m = xp.add(m * b1, g, alpha=1.0 - b1)
        v = xp.addcmul(v * b2, g, g, value=1.0 - b2)
        return m, v
    return m * b1 + (1.0 - b1) * g, v * b2 + (1.0 - b2) * g * g


def normalized(m: Any, v: Any, eps: float, *, xp: Any) -> Any:
    """``N = M / (√V + ε)`` (m × r)."""
    return m / (xp.sqrt(v) + eps)


def project_back(n: Any, p: Any, scale: float) -> Any:
    """``α (N Pᵀ)`` (m × n); ``α N`` for an identity projection (``p`` None)."""
    return n * scale if p is None else (n @ p.T) * scale


def apply_step(param: Any, u: Any, s: float, lr: float, weight_decay: float, *, xp: Any) -> Any:
    """``W ← W − s·u``, then ``W ← W − ηλW`` when λ > 0 (``add_(·, alpha=…)`` in torch)."""
    if arrays.is_torch(xp):
        param = xp.add(param, u, alpha=-s)
        if weight_decay > 0.0:
            param = xp.add(param, param, alpha=-lr * weight_decay)
        return param
    param = param + (-s) * u
    if weight_decay > 0.0:
        param = param + (-lr * weight_decay) * param
    return param


def update(hp: CompAct, param: Any, grad: Any, m: Any, v: Any, count: int, p: Any = None,
           scale: float = 1.0, *, xp: Any = None) -> tuple[Any, Any, Any]:
    """One update of one tensor (Algorithm 3): ``(param, m, v)``.

    ``grad`` is Ĝ (m × r) for a CompAct weight with projection ``p`` (n × r) and scale
    ``α``; for a plain parameter ``grad`` has the parameter's shape, ``p`` is None and
    ``scale`` is 1 (the authors' plain Adam: ``p.add_(N, alpha=-s)``). ``count`` is t ≥ 1.
    """
    xp = xp or arrays.namespace(param)
    m, v = moments(grad, m, v, b1=hp.b1, b2=hp.b2, xp=xp)
    n = normalized(m, v, hp.eps, xp=xp)
    u = n if (p is None and scale == 1.0) else project_back(n, p, scale)
    s = step_size(hp.lr, hp.b1, hp.b2, count, hp.correct_bias)
    return apply_step(param, u, s, hp.lr, hp.weight_decay, xp=xp), m, v


def init_state(hp: CompAct, params: Mapping[str, Any], *, xp: Any = np, dtype: Any = None,
               projections: Mapping[str, Projection] | None = None) -> dict[str, Any]:
    """Canonical state before the first update: ``step = 0`` and zero moments, of shape
    (m, r) for a CompAct weight (``projections[name]``), the parameter's otherwise."""
    projections = projections or {}
    state: dict[str, Any] = {"step": np.int64(0)}
    for name, p in params.items():
        shape = tuple(p.shape)
        if name in projections:
            shape = (shape[0], projections[name].rank)
        dt = dtype or np.promote_types(np.asarray(p).dtype, np.float32)
        state[f"m/{name}"] = xp.zeros(shape, dtype=dt)
        state[f"v/{name}"] = xp.zeros(shape, dtype=dt)
    return state


def step(hp: CompAct, params: Mapping[str, Any], state: Mapping[str, Any],
         grads: Mapping[str, Any], *, xp: Any = np, loss: Any = None,
         projections: Mapping[str, Projection] | None = None,
         inject: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[dict, dict]:
    """Every parameter's update as a pure function: ``(params, state)``.

    ``grads[name]`` is Ĝ (m × r) for the CompAct weights named in ``projections`` and the
    full gradient for the others. Each CompAct weight's P is redrawn from its projection
    at refresh ``state["step"] // gap`` with :mod:`xopt.random` in the dtype of the
    parameter, unless ``inject[name]["P"]`` gives it (a trace's recorded draw).
    """
    del loss
    projections = projections or {}
    inject = inject or {}
    t = int(state["step"])
    count = t + 1
    new_params, new_state = {}, {"step": np.int64(count)}
    for name, param in params.items():
        proj = projections.get(name)
        p, scale = None, 1.0
        if proj is not None:
            scale = proj.scale
            if name in inject and "P" in inject[name]:
                p = xp.asarray(inject[name]["P"], dtype=param.dtype)
            elif proj.kind != "identity":
                p = xp.asarray(projection(proj, proj.refresh(t), dtype=np.dtype(param.dtype).name
                                          if xp is np else "float32"))
        new_params[name], new_state[f"m/{name}"], new_state[f"v/{name}"] = update(
            hp, param, grads[name], state[f"m/{name}"], state[f"v/{name}"], count, p, scale,
            xp=xp)
    return new_params, new_state


# -- state schema ----------------------------------------------------------------------------

STATE = StateSchema(
    vars=(
        StateVar("step", "global", scalar, "int64", "number of updates taken, t"),
        StateVar("m", "param", same_as_param, "state",
                 "first moment M_t (uncorrected); (m, r) for a CompAct weight, the "
                 "parameter's shape otherwise"),
        StateVar("v", "param", same_as_param, "state",
                 "second moment V_t (uncorrected); shaped as m"),
    ),
    namings={
        # The authors' SmallAdamW: optimizer.state[p] = {step, exp_avg, exp_avg_sq}; also
        # xopt.torch.CompActAdamW, whose CompAct weights add a "seed" entry.
        "SmallAdamW": Naming(
            keys={"step": "{param}/step", "m": "{param}/exp_avg", "v": "{param}/exp_avg_sq"},
            dtypes={"step": "int64"},
            doc="optimizer.state[param][key]"),
        # xopt.jax.compact_adamw: CompActAdamState(count, mu, nu).
        "xopt.jax": Naming(
            keys={"step": "count", "m": "mu/{param}", "v": "nu/{param}"},
            dtypes={"step": "int32"},
            doc="xopt.jax.compact_adamw: CompActAdamState(count, mu, nu)"),
    },
)


SPEC = MethodSpec(
    name="compact",
    title="CompAct: compressed-activation linear layers and their Adam (layer method)",
    hyperparams=CompAct,
    presets=PRESETS,
    state=STATE,
    init_state=init_state,
    step=step,
    naming_of={"torch": "SmallAdamW", "jax": "xopt.jax"},
)
