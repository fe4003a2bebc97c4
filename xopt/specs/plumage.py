"""PLUMAGE (Haroush & Soudry, 2025): a probabilistic low-rank, unbiased, min-variance gradient
estimator for Adam, with moment realignment when the projection changes.

There is no public code; this module follows the paper (``/work/shared/papers/
004_73f6a8795bc54deb.txt``; equation and algorithm numbers below are the paper's).

For a projected matrix ``W`` (``m × n``) with gradient ``G = Σᵢ σᵢ uᵢ vᵢᵀ`` (``d = min(m, n)``
singular values, descending), PLUMAGE keeps Adam's moments in a rank-``k`` subspace
(``k = rank``) spanned by ``k`` of ``G``'s singular vectors, *sampled* rather than the top
``k`` (GaLore):

1. **Inclusion probabilities** (Eq. 13-18, Algorithm 2): ``p`` minimises the estimator's
   variance ``Σᵢ (1/pᵢ − 1) σᵢ²`` subject to ``Σᵢ pᵢ = k``, ``0 < pᵢ ≤ 1``. The solution
   includes the top ``r*`` modes surely (``pᵢ = 1``) and the rest with probability
   proportional to ``σᵢ``: ``pᵢ = (k − r*) σᵢ / Σ_{j>r*} σⱼ`` (Eq. 18), where ``r*`` is the
   smallest ``r`` with ``(k − r) σ_{r+1} < Σ_{i>r} σᵢ`` (Eq. 17). :func:`inclusion_probabilities`.
2. **Exact-k sampling without replacement** (Section 3.1, Algorithm 3, the "wheel of
   fortune" of [12]): shuffle the indices, lay the ``pᵢ`` end to end on a wheel of
   circumference ``Σ pᵢ = k``, and read it with ``k`` arms one unit apart, rotated by one
   uniform offset. Index ``i`` is picked with probability exactly ``pᵢ`` and never twice
   (``pᵢ ≤ 1`` = the arms' spacing). :func:`sample_indices`.
3. **One-sided projection with D⁻¹ scaling** (Eq. 19-21, Algorithm 4): ``P = U[:, I]``
   (``m × k``, orthonormal columns), ``D = diag(p[I])``; ``Ĝ = P D⁻¹ Pᵀ G`` is an unbiased
   estimator of ``G`` (``E Ĝ = G``), with the variance of Eq. 12. :func:`estimate`.
4. **Adam in the subspace** (Eq. 22-27, Algorithm 5): ``R = Pᵀ G``, Adam's moments of
   ``R``, and the weight update ``W ← W − η P D⁻¹ M/(√V + ε)`` (bias-corrected).
5. **Realignment when P changes** (Section 3.3.3): with ``B = P₂ᵀ P₁`` (new ᵀ old),
   ``M ← B M`` (Eq. 28) and ``V ← B^{∘2} V`` (Eq. 29). :func:`realign`.
6. **Intervals** (Section 3.3.2, Algorithm 5): the SVD and probabilities are recomputed
   every ``update_proj_gap`` (τ) steps; ``P``, ``D`` are resampled from the last SVD every
   ``resample_interval`` (κ) steps and at every SVD. The paper sets κ = τ.

Conventions chosen where the paper leaves a choice (each stated where it is implemented):

* **Which side.** Algorithm 4-5 assume ``m ≤ n`` and project on the left (``P`` is
  ``m × k``, ``R = Pᵀ G`` is ``k × n``); "right-sided projections stack vᵢ" (Section 3.2).
  ``proj_side="std"`` (default) projects the smaller side: left when ``m ≤ n`` (so square
  matrices go left, as in Algorithm 5), right otherwise (``P`` is ``n × k`` built from
  ``G``'s right singular vectors, ``R = G P`` is ``m × k``, the update returns as
  ``N D⁻¹ Pᵀ``). ``"left"``/``"right"`` force a side.
* **Adam.** The paper's Adam is GaLore's (it "reuse[s] the training regime and the best
  hyperparameters reported in [39]", Section 4.4): the authors' AdamW of transformers /
  ``galore_torch/adamw.py``, with ``ε`` added to the uncorrected ``√V`` (Eq. 24; Algorithm 5
  writes ``√(V + ε)``, which ``eps_inside_sqrt=True`` selects), step size
  ``η √(1 − β₂ᵗ)/(1 − β₁ᵗ)`` (Algorithm 5's ``Z``), weight decay ``ηλ`` applied after the
  step (GaLore's AdamW; the paper never uses weight decay, default 0). Defaults: ``η = 1e-3``,
  ``β = (0.9, 0.999)``, ``ε = 1e-8`` (Section 4.4), ``k = 128``, ``τ = 200`` (Section 4.1),
  ``κ = τ`` (Section 3.3.2), ``ε_p = 1e-12`` (Algorithm 5), both realignments on
  (PLUMAGE_S/MP, the variant of Tables 2-4). PLUMAGE has no GaLore-style ``scale`` α
  ("recall that PLUMAGE does not use α", Section 4.3).
* **Step counting.** Steps ``t = 0, 1, ...`` count updates before this one; a refresh
  happens before the moment update of every step with ``t mod τ = 0`` (so at the first
  step) and a resample at ``t mod κ = 0`` (Algorithm 5). Adam's bias correction uses
  ``t + 1`` (Algorithm 5's ``βᵗ`` at ``t = 0`` would divide by zero).
* **Precision of bfloat16/float16 matrices** (``proj_dtype``). The paper runs GaLore's
  training code, whose projector multiplies in the gradient's dtype. ``"param"``: ``R = Pᵀ
  G`` and ``P (D⁻¹ N)`` in the parameter's dtype (``P`` kept in float32 and rounded for
  them; ``D⁻¹ N`` computed in float32 and rounded), the update added to the parameter there,
  the moments, SVD, probabilities and realignment in float32
  (:mod:`xopt.specs.lowrank`, "the precision of the projections"). ``"state"`` (default):
  everything in float32, the step rounded into the parameter once. Float32 and float64
  matrices take one path under both.
* **Random numbers.** The shuffle and the offset come from :mod:`xopt.random` (same bits in
  NumPy, torch and JAX): the stream of parameter number ``index`` at step ``t`` has seed
  ``fold_in(seed, index, t)``; its words ``[0, 2n)`` are two 32-bit sort keys per index
  (the shuffle is the lexicographic stable argsort), and the float32 uniform at counter
  ``n`` gives the offset. ``index`` is the parameter's position in the optimizer
  (torch: over all param groups in order; optax: the leaves' flattening order; here: the
  order of the ``params`` mapping).
* **Degenerate spectra.** Algorithm 2 clips the tail sums at ``ε_p`` "to avoid division
  by 0". When the tail ``Σ_{j≥r*} σⱼ`` itself is below ``ε_p`` (a gradient of rank below
  ``k``, or a vanishing one) Eq. 18 would give ``Σ p < k`` and the wheel would pick an
  index twice; xopt then spreads the remaining ``k − r*`` inclusions uniformly over the
  tail (``pᵢ = (k − r*)/(d − r*)``). Those modes carry (numerically) zero gradient, so
  the variance of Eq. 12 is unchanged and the estimator stays unbiased; in every other
  case the probabilities are Algorithm 2's.
* **Rounding guards in the sampler** (no effect in exact arithmetic): the offset is
  ``β = (1 − U)·δ`` in ``(0, δ]`` rather than ``[0, δ)``, so no arm sits at 0, where it
  would pick a zero-width sector; arm indices are clamped to ``[0, d)`` and made strictly
  increasing, so rounding in the cumulative sum can never pick an index twice.

Everything is written once against the array API and runs under NumPy (float64: the
oracle), torch and jax.numpy; ``xopt/torch/plumage.py`` and ``xopt/jax/plumage.py`` call
these functions and add only control flow (refresh branches under ``jit``, in-place writes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

from xopt import random as xrandom
from xopt.specs import arrays, lowrank
from xopt.specs._groups import ParamGroups, hp_for
from xopt.specs._hyperparams import (
    NONNEGATIVE,
    POSITIVE,
    UNIT_HALF_OPEN,
    Hyperparams,
    Interval,
    hp,
)
from xopt.specs._method import MethodSpec
from xopt.specs._state import Naming, StateSchema, StateVar, scalar

# -- hyperparameters -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PLUMAGE(Hyperparams):
    """PLUMAGE hyperparameters; defaults are the paper's (section cited per field)."""

    METHOD = "plumage"

    lr: float = hp(1e-3, doc="learning rate η (Section 4.4: Adam's, 1e-3)", interval=NONNEGATIVE)
    b1: float = hp(0.9, doc="first-moment decay β₁ (Section 4.4)", interval=UNIT_HALF_OPEN)
    b2: float = hp(0.999, doc="second-moment decay β₂ (Section 4.4)", interval=UNIT_HALF_OPEN)
    eps: float = hp(1e-8, doc="ε added to √V (Eq. 24; Section 4.4)", interval=NONNEGATIVE)
    weight_decay: float = hp(0.0, doc="decoupled weight decay λ, applied as ηλ after the step "
                             "(GaLore's AdamW; unused in the paper)", interval=NONNEGATIVE)
    correct_bias: bool = hp(True, doc="Adam's bias correction √(1−β₂ᵗ)/(1−β₁ᵗ) (Algorithm 5)")
    eps_inside_sqrt: bool = hp(False, doc="Algorithm 5's literal M/√(V+ε) instead of Eq. 24's "
                               "M/(√V+ε)")
    project: bool = hp(True, doc="project this group's matrices (False: full-rank Adam)")
    rank: int = hp(128, doc="k: sampled rank (Section 4.1: 128)", interval=Interval(1, None))
    update_proj_gap: int = hp(200, doc="τ: steps between SVDs (Section 4.1: 200)",
                              interval=Interval(1, None))
    resample_interval: int | None = hp(
        None, doc="κ: steps between resamples of P, D from the last SVD (None: κ = τ, as the "
        "paper's experiments, Section 3.3.2)", interval=Interval(1, None))
    proj_side: str = hp("std", doc="'std': the smaller side (left when m ≤ n, Algorithm 4); "
                        "'left' or 'right'", choices=("std", "left", "right"))
    # "state": what xopt computed before this field existed (checkpoints keep their
    # meaning); float32 and float64 parameters compute the same under both
    proj_dtype: str = hp("state", doc="dtype of the projections of bfloat16/float16 matrices: "
                                      "'state' (float32) or 'param' (the parameter's, as "
                                      "GaLore's projector, which PLUMAGE builds on)",
                         choices=lowrank.PROJ_DTYPES)
    realign_first_moment: bool = hp(True, doc="M ← P₂ᵀP₁ M on a new projection (Eq. 28, 'MP')")
    realign_second_moment: bool = hp(True, doc="V ← (P₂ᵀP₁)^∘2 V on a new projection (Eq. 29, "
                                     "'S')")
    prob_eps: float = hp(1e-12, doc="ε_p: floor of Algorithm 2's tail sums (Algorithm 5: 1e-12)",
                         interval=POSITIVE)
    seed: int = hp(0, doc="seed of the sampling stream (xopt.random), in [0, 2**64)",
                   interval=NONNEGATIVE)

    def _check_combinations(self) -> None:
        k = self.resample_interval
        if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer))):
            raise self._fail("resample_interval", k, "must be a positive int or None")
        if isinstance(self.seed, (int, np.integer)) and not 0 <= int(self.seed) < 2**64:
            raise self._fail("seed", self.seed, "must be in [0, 2**64)")

    @property
    def kappa(self) -> int:
        """κ, the resampling interval (``update_proj_gap`` when ``resample_interval`` is None)."""
        return self.update_proj_gap if self.resample_interval is None else self.resample_interval


PRESETS: dict[str, dict[str, Any]] = {
    # Section 4.1 / 4.4 / Algorithm 5: PLUMAGE_S/MP, the variant of Tables 2-4.
    "paper": dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, rank=128,
                  update_proj_gap=200, resample_interval=None, realign_first_moment=True,
                  realign_second_moment=True, prob_eps=1e-12),
    # Section 4.3: RoBERTa-base on GLUE, r = 8, τ = 100 (learning rates tuned per task).
    "glue": dict(rank=8, update_proj_gap=100),
}


def is_projected(shape: tuple[int, ...], hp: PLUMAGE) -> bool:
    """A parameter is projected when its group says so and it is a matrix."""
    return bool(hp.project) and len(shape) == 2


def side_of(shape: tuple[int, ...], hp: PLUMAGE) -> str:
    """``"left"`` (``P`` is ``m × k``) or ``"right"`` (``P`` is ``n × k``) for an ``(m, n)``."""
    if hp.proj_side != "std":
        return hp.proj_side
    return "left" if shape[0] <= shape[1] else "right"


def needs_basis(hp: PLUMAGE) -> bool:
    """Whether some step resamples without an SVD (κ not a multiple of τ): then the last
    SVD's singular vectors and probabilities are kept in the state."""
    return hp.kappa % hp.update_proj_gap != 0


def check_param(shape: tuple[int, ...], hp: PLUMAGE, where: str) -> None:
    """Validate one parameter against its hyperparameters (names ``where``)."""
    lowrank.check_interval(hp.update_proj_gap, "update_proj_gap", where)
    if hp.resample_interval is not None:
        lowrank.check_interval(hp.resample_interval, "resample_interval", where)
    if is_projected(shape, hp):
        lowrank.check_rank(hp.rank, shape, where)


# -- 1. inclusion probabilities (Eq. 13-18, Algorithm 2) -----------------------------------


def _flip(xp: ModuleType, x: Any) -> Any:
    return xp.flip(x, dims=(0,)) if arrays.is_torch(xp) else xp.flip(x, axis=0)


def _cumsum(xp: ModuleType, x: Any) -> Any:
    return xp.cumsum(x, dim=0) if arrays.is_torch(xp) else xp.cumsum(x, axis=0)


def _arange(xp: ModuleType, n: int, like: Any) -> Any:
    if arrays.is_torch(xp):
        return xp.arange(n, device=like.device)
    return xp.arange(n)


def _as(xp: ModuleType, x: Any, like: Any) -> Any:
    """``x`` cast to ``like``'s dtype."""
    if arrays.is_torch(xp):
        return x.to(like.dtype)
    return x.astype(like.dtype)


def inclusion_probabilities(xp: ModuleType, sigma: Any, k: int, eps: float) -> tuple[Any, Any]:
    """The min-variance unbiased inclusion probabilities (Eq. 13-18), by Algorithm 2.

    Solves ``min_p Σᵢ (1/pᵢ − 1) σᵢ²`` s.t. ``Σᵢ pᵢ = k``, ``0 < pᵢ ≤ 1`` (Eq. 13/14):
    the Lagrangian (Eq. 15-16) gives ``pᵢ = σᵢ/√(μ + λᵢ)``, i.e. ``pᵢ ∝ σᵢ`` capped at 1, and

    * ``t_i = Σ_{j≥i} σⱼ`` floored at ``eps`` (Algorithm 2, lines 3-4);
    * test scores ``q_i = (k − i) σᵢ / tᵢ`` (0-based ``i``; line 7) and
      ``r* = d − |{i : q_i < 1}|`` (lines 8-9): Eq. 17's smallest ``r`` with
      ``(k − r) σ_{r+1} < Σ_{i>r} σᵢ`` (the test is monotone in ``r`` for sorted ``σ``, so
      counting the passes finds the first);
    * ``pᵢ = 1`` for ``i < r*``, ``pᵢ = (k − r*) σᵢ / t_{r*}`` otherwise (Eq. 18, lines 10-11).

    When the tail sum ``Σ_{j≥r*} σⱼ`` is below ``eps`` (before flooring) the tail gets
    ``(k − r*)/(d − r*)`` each instead, so that ``Σ p = k`` still holds (see the module
    docstring, "Degenerate spectra").

    Args:
      xp: array namespace.
      sigma: ``(d,)`` singular values, descending, non-negative, float.
      k: target rank, ``1 <= k <= d`` (a Python int).
      eps: ``ε_p`` of Algorithm 2 (Algorithm 5 uses 1e-12).
    Returns:
      ``(r_star, p)``: ``r_star`` a 0-d integer array (the number of surely included modes),
      ``p`` ``(d,)`` in ``sigma``'s dtype with ``Σ p = k`` and ``0 <= pᵢ <= 1``.
    """
    d = sigma.shape[0]
    tail_raw = _flip(xp, _cumsum(xp, _flip(xp, sigma)))           # t_i = Σ_{j≥i} σ_j
    tail = xp.maximum(tail_raw, xp.full_like(tail_raw, eps))    # Algorithm 2, line 4
    i = _arange(xp, d, sigma)
    s = _as(xp, k - i, sigma)                                    # line 6: k − i
    q = s * sigma / tail                                         # line 7
    c = xp.sum(_as(xp, q < 1, i))                                # line 8
    r_star = d - c                                               # line 9
    at = xp.minimum(r_star, xp.full_like(r_star, d - 1))         # t_{r*} (r* = d: unused)
    tail_at, raw_at = tail[at], tail_raw[at]
    deficit = _as(xp, k - r_star, sigma)
    proportional = deficit * sigma / tail_at                     # Eq. 18 / line 11
    left = _as(xp, xp.maximum(d - r_star, xp.ones_like(r_star)), sigma)
    uniform = xp.zeros_like(sigma) + deficit / left
    tail_p = xp.where(raw_at < eps, uniform, proportional)
    p = xp.where(i < r_star, xp.ones_like(sigma), tail_p)        # line 10
    return r_star, p


# -- 2. exact-k sampling without replacement (Algorithm 3) ---------------------------------


def _argsort_stable(xp: ModuleType, x: Any) -> Any:
    if arrays.is_torch(xp):
        return xp.argsort(x, stable=True)
    if xp is np:
        return np.argsort(x, kind="stable")
    return xp.argsort(x, stable=True)


def permutation_from_words(xp: ModuleType, words: Any) -> Any:
    """Algorithm 3's ``randPerm(n)`` from random words: a lexicographic stable argsort.

    Args:
      words: ``(2, n)`` integer array of 32-bit random words (:func:`xopt.random.bits`);
        row 0 is the primary sort key, row 1 breaks its ties (a tie of both, probability
        about ``n²/2⁶⁵``, keeps index order).
    Returns:
      ``(n,)`` integer array, a permutation of ``0..n-1``.
    """
    by_second = _argsort_stable(xp, words[1])
    by_first = _argsort_stable(xp, words[0][by_second])
    return by_second[by_first]


def _searchsorted(xp: ModuleType, c: Any, u: Any) -> Any:
    if arrays.is_torch(xp):
        return xp.searchsorted(c.contiguous(), u.contiguous())  # right=False: first c_j ≥ u
    return xp.searchsorted(c, u, side="left")


def _cummax(xp: ModuleType, x: Any) -> Any:
    if arrays.is_torch(xp):
        return xp.cummax(x, dim=0).values
    if xp is np:
        return np.maximum.accumulate(x)
    import jax

    return jax.lax.cummax(x, axis=0)


def sample_indices(xp: ModuleType, p: Any, k: int, perm: Any, u: Any) -> Any:
    """Algorithm 3 (SAMPLE_INDICES): exactly ``k`` distinct indices, ``P(i ∈ I) = pᵢ``.

    The "wheel of fortune" with ``k`` equidistant arms (Section 3.1, Fig. 1): the shuffled
    probabilities ``p[τ]`` are laid end to end (cumulative sums ``c``), the arms sit at
    ``β, β + δ, ..., β + (k − 1)δ`` with ``δ = c_{d−1}/k`` (= 1 when ``Σ p = k``) and
    ``β ~ Uniform(0, δ]``, and each arm picks the first index whose cumulative sum reaches it
    (``searchsorted``). An index whose sector has length ``pᵢ ≤ δ`` is met by exactly one
    arm with probability ``pᵢ/δ`` and by none otherwise.

    Args:
      p: ``(d,)`` inclusion probabilities, ``Σ p = k``, ``0 <= pᵢ <= 1``.
      k: number of indices (Python int).
      perm: ``(d,)`` the permutation τ (:func:`permutation_from_words`).
      u: 0-d uniform in ``[0, 1)`` (:func:`xopt.random.uniform`, float32); ``β = (1 − u)δ``.
    Returns:
      ``(k,)`` integer array of distinct indices into ``p``, in the order the arms meet the
      shuffled wheel.
    """
    d = p.shape[0]
    c = _cumsum(xp, p[perm])                                     # line 5
    delta = c[d - 1] / k                                         # line 6
    beta = (1 - _as(xp, u, p)) * delta                           # line 7, in (0, δ]
    a = _arange(xp, k, p)
    arms = _as(xp, a, p) * delta + beta                          # line 8
    j = _searchsorted(xp, c, arms)                               # line 9
    # rounding guards (identity in exact arithmetic): j in [0, d) and strictly increasing
    j = xp.minimum(j, xp.full_like(j, d - 1))
    j = xp.minimum(_cummax(xp, j - a), xp.full_like(j, d - k)) + a
    return perm[j]                                               # line 10


def draw_seed(seed: int, index: int, t: int) -> int:
    """The 64-bit seed of parameter ``index``'s draw at step ``t``: ``fold_in(seed, index, t)``."""
    return xrandom.fold_in(int(seed), int(index), int(t))


def draw(seed: int, index: int, t: int, d: int, *, backend: str = "numpy",
         device: Any = None) -> tuple[Any, Any]:
    """The random numbers of one resample: ``(perm, u)`` (see the module docstring).

    ``perm`` is the ``(d,)`` permutation from the words ``[0, 2d)`` of the stream
    ``fold_in(seed, index, t)``; ``u`` the float32 uniform at counter ``d``. ``t`` is a
    Python int here; the jax backend computes the same stream from a traced ``t``.
    """
    s = draw_seed(seed, index, t)
    # one draw of 2d + 1 words: words [0, 2d) are the sort keys; word 2d is the first word
    # of block d, from which xopt.random.uniform(s, (), counter=d) builds its float32
    # (W >> 8)·2⁻²⁴ (the stream layout of xopt.random's docstring; tested equal)
    words = xrandom.bits(s, (2 * d + 1,), backend=backend, device=device)
    xp = _namespace_of(backend)
    last = words[2 * d] >> 8
    u = (last.to(xp.float32) if backend == "torch" else last.astype(np.float32)) * 2.0**-24
    return permutation_from_words(xp, words[: 2 * d].reshape(2, d)), u


def _namespace_of(backend: str) -> ModuleType:
    if backend == "torch":
        import torch

        return torch
    if backend == "jax":
        import jax.numpy as jnp

        return jnp
    return np


# -- 3. the one-sided projection and the estimator (Eq. 19-21, Algorithm 4) ----------------


def oriented(xp: ModuleType, g: Any, side: str) -> Any:
    """``G`` for a left projection, ``Gᵀ`` for a right one: the matrix whose left singular
    vectors span the projected side."""
    return g if side == "left" else g.T


def decompose(xp: ModuleType, g: Any, side: str) -> tuple[Any, Any]:
    """The singular vectors of the projected side and the singular values.

    Args:
      g: ``(m, n)`` gradient.
      side: ``"left"`` or ``"right"``.
    Returns:
      ``(U, σ)``: left: ``U`` ``(m, d)`` = ``G``'s left singular vectors; right: ``(n, d)`` =
      ``G``'s right singular vectors (the left ones of ``Gᵀ``); ``σ`` ``(d,)`` descending,
      ``d = min(m, n)``. Signs: :func:`xopt.specs.lowrank.svd`'s convention applied to the
      oriented matrix (each column's largest-magnitude entry positive).
    """
    u, s, _ = lowrank.svd(xp, oriented(xp, g, side))
    return u, s


def sample_projection(xp: ModuleType, basis: Any, p: Any, idx: Any) -> tuple[Any, Any]:
    """Algorithm 4 (SAMPLE_PROJECTIONS) given the sampled indices: ``P = U[:, I]``,
    ``D = diag(p[I])`` (Eq. 19).

    Returns ``(P, dvec)``: ``P`` ``(rows, k)``, ``dvec`` ``(k,)`` the diagonal of ``D``. A
    zero probability can be reached only through :func:`sample_indices`'s rounding guard;
    its scale is then 1 rather than a division by zero.
    """
    dvec = p[idx]
    dvec = xp.where(dvec > 0, dvec, xp.ones_like(dvec))
    return basis[:, idx], dvec


def project(xp: ModuleType, g: Any, P: Any, side: str) -> Any:
    """``R = Pᵀ G`` (left, ``(k, n)``) or ``R = G P`` (right, ``(m, k)``) (Eq. 22)."""
    return arrays.matmul(xp, P.T, g) if side == "left" else arrays.matmul(xp, g, P)


def project_back(xp: ModuleType, n: Any, P: Any, dvec: Any, side: str) -> Any:
    """``P D⁻¹ N`` (left) or ``N D⁻¹ Pᵀ`` (right): a low-rank direction in full shape
    (Eq. 24/27)."""
    if side == "left":
        return xp.matmul(P, n / dvec[:, None])
    return xp.matmul(n / dvec[None, :], P.T)


def project_back_low(xp: ModuleType, n: Any, P: Any, dvec: Any, side: str) -> Any:
    """:func:`project_back` in ``P``'s (narrow) dtype: ``N D⁻¹`` in ``n``'s dtype, rounded
    to ``P``'s, then the product there (``proj_dtype="param"``)."""
    if side == "left":
        return arrays.matmul(xp, P, lowrank.astype(n / dvec[:, None], P.dtype))
    return arrays.matmul(xp, lowrank.astype(n / dvec[None, :], P.dtype), P.T)


def estimate(xp: ModuleType, g: Any, P: Any, dvec: Any, side: str) -> Any:
    """The one-sided PLUMAGE estimator ``Ĝ = P D⁻¹ Pᵀ G`` (Eq. 20; right: ``G P D⁻¹ Pᵀ``).

    With ``P``, ``D`` from :func:`sample_projection` of ``G``'s own SVD and probabilities,
    ``Ĝ = Σᵢ (Iᵢ/pᵢ) σᵢ uᵢ vᵢᵀ`` (Eq. 21), so ``E Ĝ = G`` (Eq. 8).
    """
    return project_back(xp, project(xp, g, P, side), P, dvec, side)


# -- 5. realignment (Eq. 28-29) -------------------------------------------------------------


def realign(xp: ModuleType, m: Any, v: Any, p_new: Any, p_old: Any, side: str, *,
            first: bool, second: bool) -> tuple[Any, Any]:
    """Realign the low-rank moments to a new projection (Section 3.3.3).

    ``B = P₂ᵀ P₁`` (``k × k``; ``P₂`` new, ``P₁`` old).

    * left (moments ``k × n``): ``M ← B M`` (Eq. 28), ``V ← B^{∘2} V`` (Eq. 29);
    * right (moments ``m × k``, ``R = G P``): the same equations for ``Rᵀ = Pᵀ Gᵀ``:
      ``M ← M Bᵀ``, ``V ← V (B^{∘2})ᵀ``.

    ``first``/``second`` switch each on (the paper's "MP" and "S" ablations); a moment
    not realigned is kept as it is (GaLore's behaviour).
    """
    b = xp.matmul(p_new.T, p_old)
    if side == "left":
        if first:
            m = xp.matmul(b, m)
        if second:
            v = xp.matmul(b * b, v)
    else:
        if first:
            m = xp.matmul(m, b.T)
        if second:
            v = xp.matmul(v, (b * b).T)
    return m, v


# -- 4. the Adam step of one parameter (Eq. 22-27, Algorithm 5) -----------------------------


def adam_direction(xp: ModuleType, m: Any, v: Any, hp: PLUMAGE) -> Any:
    """``N = M/(√V + ε)`` (Eq. 24), or ``M/√(V + ε)`` with ``eps_inside_sqrt`` (Algorithm 5)."""
    if hp.eps_inside_sqrt:
        return m / xp.sqrt(v + hp.eps)
    return lowrank.hf_adam_direction(xp, m, v, hp.eps)


def resample_now(hp: PLUMAGE, t: int) -> tuple[bool, bool]:
    """``(svd, resample)`` at 0-based step ``t`` (Algorithm 5's two tests)."""
    svd = t % hp.update_proj_gap == 0
    return svd, svd or t % hp.kappa == 0


#: what an update accepts in ``inject`` (per parameter): values used instead of its own
#: draws or decompositions, cast to the state's dtype. ``"indices"``: ``(k,)`` ints, the
#: sampled index set (at a resample step); ``"svd_u"`` and ``"svd_s"`` (together):
#: ``(rows, d)`` singular vectors of the projected side and ``(d,)`` singular values,
#: descending (at an SVD step): the parity tests give every backend the same float64
#: decomposition, because float32 singular vectors from two LAPACK builds differ by
#: ~ε·σ₁/gap (1e-6 to 1e-5 on random matrices), as a recorded original's would.
INJECT_KEYS = ("indices", "svd_u", "svd_s")


def injected_decomposition(xp: ModuleType, inject: Mapping[str, Any] | None,
                           like: Any) -> tuple[Any, Any] | None:
    """``(U, σ)`` from ``inject`` cast to ``like``'s dtype, or None when not injected."""
    if not inject or "svd_u" not in inject:
        return None
    return _as(xp, inject["svd_u"], like), _as(xp, inject["svd_s"], like)


def basis_and_probs(xp: ModuleType, hp: PLUMAGE, g: Any, side: str,
                    inject: Mapping[str, Any] | None,
                    decomposition: tuple[Any, Any] | None = None) -> tuple[Any, Any, Any]:
    """Algorithm 2 at an SVD step: ``(basis, probs, σ)``, the singular vectors of the
    projected side, the inclusion probabilities of their indices and the singular values,
    from ``decomposition`` (``(U, σ)`` computed by the caller), else the injected one
    (:func:`injected_decomposition`), else :func:`decompose`."""
    if decomposition is None:
        decomposition = injected_decomposition(xp, inject, g)
    basis, sigma = decomposition if decomposition is not None else decompose(xp, g, side)
    _, probs = inclusion_probabilities(xp, sigma, hp.rank, hp.prob_eps)
    return basis, probs, sigma


def refresh(xp: ModuleType, hp: PLUMAGE, g: Any, side: str, st: dict[str, Any], t: Any,
            index: int, inject: Mapping[str, Any] | None, *, svd: bool,
            decomposition: tuple[Any, Any] | None = None,
            draws: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """The refresh block of Algorithm 5 for one parameter at step ``t``: (SVD and
    Algorithm 2 when ``svd``, else the stored basis and probabilities), Algorithm 3-4,
    realignment (Eq. 28-29). Returns the updated per-parameter state (new dict).

    ``st`` holds ``m``, ``v``, ``projector`` and ``scale`` (and ``basis``, ``probs`` when
    :func:`needs_basis`). ``inject`` (see :data:`INJECT_KEYS`) may give the sampled index set
    and, at SVD steps, the decomposition, to use instead of drawing or decomposing.
    ``decomposition``: ``(U, σ)`` of :func:`decompose` computed by the caller (the torch
    backend's, which names the parameter when it fails); ``draws``: ``(perm, u)`` of
    :func:`draw` computed by the caller (the jax backend's, from a traced ``t``).
    """
    st = dict(st)
    basis, probs = lowrank.refresh(
        svd, (st.get("basis"), st.get("probs")),
        lambda: basis_and_probs(xp, hp, g, side, inject, decomposition)[:2])
    if svd and needs_basis(hp):
        st["basis"], st["probs"] = basis, probs
    if inject is not None and "indices" in inject:
        idx = inject["indices"]
    else:
        if draws is None:
            backend = "torch" if arrays.is_torch(xp) else "numpy"
            device = g.device if arrays.is_torch(xp) else None
            draws = draw(hp.seed, index, t, probs.shape[0], backend=backend, device=device)
        perm, u = draws
        idx = sample_indices(xp, probs, hp.rank, perm, u)
    P, dvec = sample_projection(xp, basis, probs, idx)
    st["m"], st["v"] = realign(xp, st["m"], st["v"], P, st["projector"], side,
                               first=hp.realign_first_moment, second=hp.realign_second_moment)
    st["projector"], st["scale"] = P, dvec
    return st


def update_param(xp: ModuleType, hp: PLUMAGE, p: Any, g: Any, st: dict[str, Any], t: int,
                 index: int, inject: Mapping[str, Any] | None = None, lr: Any = None, *,
                 decomposition: tuple[Any, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """One update of one parameter at 0-based step ``t`` (Algorithm 5's loop body).

    Args:
      p, g: parameter and gradient, same shape, float.
      st: this parameter's state: ``m``, ``v`` (projected shape when projected, else the
        parameter's), and for projected matrices ``projector`` (``(rows, k)``), ``scale``
        (``(k,)``), and ``basis``/``probs`` when :func:`needs_basis`.
      t: updates taken before this one (Python int).
      index: the parameter's position in the optimizer (selects its random stream).
      lr: overrides ``hp.lr`` (a schedule's value).
      decomposition: ``(U, σ)`` of this step's SVD, computed by the caller (see :func:`refresh`).
    Returns:
      ``(new p, new state)``. Non-projected parameters take the same AdamW full rank.
    """
    lr = hp.lr if lr is None else lr
    st = dict(st)
    low = None
    if is_projected(tuple(p.shape), hp):
        side = side_of(tuple(p.shape), hp)
        svd, resample = resample_now(hp, t)
        low = lowrank.product_dtype(hp.proj_dtype, p.dtype, st["m"].dtype)
        if low is not None:
            g = lowrank.astype(g, st["m"].dtype)  # the refresh runs in the state's dtype
        if resample:
            st = refresh(xp, hp, g, side, st, t, index, inject, svd=svd,
                         decomposition=decomposition)
        if low is None:
            r = project(xp, g, st["projector"], side)                  # R = Pᵀ G (Eq. 22)
        else:
            r = lowrank.astype(project(xp, lowrank.astype(g, low),
                                       lowrank.astype(st["projector"], low), side),
                               st["m"].dtype)
    else:
        side, r = None, g
    st["m"], st["v"] = lowrank.hf_adam_moments(xp, st["m"], st["v"], r, hp.b1, hp.b2)
    n = adam_direction(xp, st["m"], st["v"], hp)
    alpha = lowrank.hf_step_size(lr, hp.b1, hp.b2, t + 1, hp.correct_bias)
    if side is not None and low is not None:
        n = project_back_low(xp, n, lowrank.astype(st["projector"], low), st["scale"], side)
        return lowrank.hf_apply_low(p, n, alpha, lr, hp.weight_decay), st
    if side is not None:
        n = project_back(xp, n, st["projector"], st["scale"], side)   # P D⁻¹ N (Eq. 24)
    return lowrank.hf_apply(p, n, alpha, lr, hp.weight_decay), st


# -- the whole optimizer as a pure function (the oracle's definition) ----------------------


def _moment_shape(shape: tuple[int, ...], hp: PLUMAGE) -> tuple[int, ...]:
    if not is_projected(shape, hp):
        return tuple(shape)
    m, n = shape
    return (hp.rank, n) if side_of(shape, hp) == "left" else (m, hp.rank)


def _rows(shape: tuple[int, ...], hp: PLUMAGE) -> int:
    return shape[0] if side_of(shape, hp) == "left" else shape[1]


def _projector_shape(shape: tuple[int, ...], hp: PLUMAGE) -> tuple[int, ...]:
    return (_rows(shape, hp), hp.rank)


def _scale_shape(shape: tuple[int, ...], hp: PLUMAGE) -> tuple[int, ...]:
    return (hp.rank,)


def _basis_shape(shape: tuple[int, ...], hp: PLUMAGE) -> tuple[int, ...]:
    return (_rows(shape, hp), min(shape))


def _probs_shape(shape: tuple[int, ...], hp: PLUMAGE) -> tuple[int, ...]:
    return (min(shape),)


def init_param_state(xp: ModuleType, hp: PLUMAGE, shape: tuple[int, ...], dtype: Any,
                     like: Any = None) -> dict[str, Any]:
    """A parameter's state before its first update: zero moments, a zero projector (so
    the first refresh's realignment maps the zero moments to zero), unit scales."""
    def zeros(s: tuple[int, ...]) -> Any:
        if arrays.is_torch(xp):
            return xp.zeros(s, dtype=dtype, device=None if like is None else like.device)
        return xp.zeros(s, dtype=dtype)

    st = {"m": zeros(_moment_shape(shape, hp)), "v": zeros(_moment_shape(shape, hp))}
    if is_projected(shape, hp):
        st["projector"] = zeros(_projector_shape(shape, hp))
        st["scale"] = zeros(_scale_shape(shape, hp)) + 1
        if needs_basis(hp):
            st["basis"] = zeros(_basis_shape(shape, hp))
            st["probs"] = zeros(_probs_shape(shape, hp))
    return st


_PER_PARAM = ("m", "v", "projector", "scale", "basis", "probs")


def init_state(hp: PLUMAGE | ParamGroups, params: Mapping[str, Any], *, xp: ModuleType = np,
               dtype: Any = None) -> dict[str, Any]:
    """Canonical state before the first step (``step`` = 0); moments in ``dtype`` or the
    parameter's dtype promoted to at least float32."""
    state: dict[str, Any] = {"step": np.int64(0)}
    for name, p in params.items():
        h = hp_for(hp, name)
        check_param(tuple(p.shape), h, f"PLUMAGE: {name}")
        dt = dtype or np.promote_types(np.asarray(p).dtype, np.float32)
        for k, v in init_param_state(xp, h, tuple(p.shape), dt).items():
            state[f"{k}/{name}"] = v
    return state


def step(hp: PLUMAGE | ParamGroups, params: Mapping[str, Any], state: Mapping[str, Any],
         grads: Mapping[str, Any], *, xp: ModuleType = np, loss: Any = None,
         inject: Mapping[str, Mapping[str, Any]] | None = None):
    """All parameters' PLUMAGE step: ``(params, state) -> (params, state)``, pure.

    Parameter ``i`` of the ``params`` mapping (in its order) draws from stream ``i``.
    ``inject``: ``{param name: {"indices": (k,) ints}}`` at resample steps.
    """
    del loss
    t = int(state["step"])
    new_params: dict[str, Any] = {}
    new_state: dict[str, Any] = {"step": np.int64(t + 1)}
    for index, (name, p) in enumerate(params.items()):
        h = hp_for(hp, name)
        st = {k: state[f"{k}/{name}"] for k in _PER_PARAM if f"{k}/{name}" in state}
        p, st = update_param(xp, h, p, grads[name], st, t, index,
                             (inject or {}).get(name))
        new_params[name] = p
        for k, v in st.items():
            new_state[f"{k}/{name}"] = v
    return new_params, new_state


# -- state schema --------------------------------------------------------------------------

STATE = StateSchema(
    vars=(
        StateVar("step", "global", scalar, "int64", "number of updates taken, t"),
        StateVar("m", "param", _moment_shape, "state",
                 "first moment M (Eq. 22): (k, n) left, (m, k) right, else the param's shape"),
        StateVar("v", "param", _moment_shape, "state", "second moment V (Eq. 23), as m"),
        StateVar("projector", "param", _projector_shape, "state",
                 "P = U[:, I] (Eq. 19): (m, k) left, (n, k) right",
                 applies=is_projected),
        StateVar("scale", "param", _scale_shape, "state", "diag(D) = p[I] (Algorithm 4)",
                 applies=is_projected),
        StateVar("basis", "param", _basis_shape, "state",
                 "the last SVD's singular vectors of the projected side (resampling without "
                 "an SVD, κ not a multiple of τ)",
                 active=needs_basis, applies=is_projected),
        StateVar("probs", "param", _probs_shape, "state",
                 "the last SVD's inclusion probabilities p (Eq. 18)",
                 active=needs_basis, applies=is_projected),
    ),
    namings={
        "xopt.torch": Naming(
            keys={"step": "{param}/step", "m": "{param}/exp_avg", "v": "{param}/exp_avg_sq",
                  "projector": "{param}/projector", "scale": "{param}/scale",
                  "basis": "{param}/basis", "probs": "{param}/probs"},
            dtypes={"step": "int64"},
            doc="xopt.torch.PLUMAGE: optimizer.state[param][key]",
        ),
        "xopt.jax": Naming(
            keys={"step": "count", "m": "mu/{param}", "v": "nu/{param}",
                  "projector": "projector/{param}", "scale": "scale/{param}",
                  "basis": "basis/{param}", "probs": "probs/{param}"},
            dtypes={"step": "int32"},
            doc="xopt.jax.plumage: PlumageState(count, mu, nu, projector, scale, basis, probs)",
        ),
    },
)


SPEC = MethodSpec(
    name="plumage",
    title="PLUMAGE: unbiased min-variance sampled low-rank projections for Adam, with "
          "moment realignment (paper only; no public code)",
    hyperparams=PLUMAGE,
    presets=PRESETS,
    state=STATE,
    init_state=init_state,
    step=step,
    naming_of={"torch": "xopt.torch", "jax": "xopt.jax"},
)
