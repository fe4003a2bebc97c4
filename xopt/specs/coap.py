"""COAP (Xiao et al., "COAP: Memory-Efficient Training with Correlation-Aware Gradient
Projection", CVPR 2025): low-rank projected AdamW / Adafactor whose projection moves by SGD.

Authors' code: bytedance/coap @ deabc3a (``coap_torch/optimizer/adamw.py``,
``coap_torch/optimizer/adafactor.py``, ``coap_torch/projection/coap_matrix.py``,
``coap_torch/utils/orthogonal.py``, ``coap_torch/utils/params.py``). xopt follows the code,
including what the paper leaves out (Eqn 6's gradient clipping and row-wise cosine, the
event schedule, the rules for projected parameters).

The method, for one projected matrix ``W`` (``m × n``) with gradient ``G`` at update
``t = 0, 1, ...`` (``t`` counts the updates taken before this one):

* **side** (``coap_matrix.py``, ``project``): *right* when ``m ≥ n``: ``P`` is ``r × n``,
  the low-rank gradient is ``R = G Pᵀ`` (``m × r``) and a low-rank ``N`` returns as
  ``N P``; *left* when ``m < n``: ``P`` is ``m × r``, ``R = Pᵀ G`` (``r × n``), back ``P N``.
* **projection events** (aux ``proj_event`` of the golden traces; ``T_u`` =
  ``update_interval``, ``λ`` = ``reproject_factor``), decided *before* the moments move:

  - ``t = 0`` → 1, *initial*: Eqn 7 with a random ``Ω`` (``min(m, n) × r``);
  - ``t % T_u == 0`` and ``t % (λ T_u) == 0`` → 3, *Eqn 7* warm-started with ``Ω = Pᵀ``
    (right) or ``Ω = P`` (left);
  - ``t % T_u == 0`` otherwise → 2, *Eqn 6*: one SGD step on ``P``;
  - otherwise → 0, ``P`` kept.

* **Eqn 7** (occasional low-cost SVD; ``orthogonal.py``): with ``A = G`` (right) or ``Gᵀ``
  (left), ``Q = QR_red(A Ω)``, ``U Σ Z = SVD(Qᵀ A)``, ``P = Z`` (right) or ``Zᵀ`` (left).
* **Eqn 6** (inter-projection correlation-aware update; ``coap_matrix.py`` ``update_proj``):
  ``P ← P − η_P · clip(∂L/∂P)`` with ``η_P = 0.1``, gradient-norm clipping at 1 (torch's
  ``clip_grad_norm_``: scaled by ``min(1, 1/(‖∂L/∂P‖ + 1e-6))``), and ::

      L(P) = MSE(Ĝ, G) · (1 − (1/m) Σ_i cos(X_i, G_i))
      Ĝ = G Pᵀ P,  X = M P  (right)        Ĝ = P Pᵀ G,  X = P M  (left)

  where ``M`` is the low-rank first moment *before* this update and ``cos`` runs over the
  rows of the ``m × n`` matrices (torch's ``cosine_similarity(dim=1)``; ``X`` is compared with
  ``G`` itself, as in the paper's appendix). :func:`eqn6_grad` is the gradient in closed
  form (derived in its docstring), checked against torch autograd's and the traces' aux
  ``eqn6_P_grad`` in ``tests/test_coap.py``.
* **moment restoration** (``restore_state``, at events 2 and 3): the moments are carried to
  the new subspace: ``M ← (M P_old) P_newᵀ`` and, for AdamW, ``V ← ((√V P_old) P_newᵀ)²``
  (right; ``P_newᵀ (P_old M)`` for left). The Adafactor variant restores only ``M``.

**AdamW** (the authors' transformers-style AdamW, :func:`xopt.specs.lowrank.hf_adam_moments`
and friends): ``m, v`` of ``R``; ``N = m/(√v + ε)``; ``W ← W − α·scale·back(N)`` with
``α = η √(1−β₂ᵗ)/(1−β₁ᵗ)``; then ``W ← W − ηλ W`` on the updated ``W``.

**Adafactor** (``adafactor.py``, transformers' Adafactor with ``relative_step=False`` by
default), see :func:`adafactor_direction`: ``lr_t = η · max(ε₂, RMS(W))``, a factored second
moment of ``R`` (rows and columns; unfactored for 1-D tensors) with
``β̂₂ₜ = 1 − t^decay_rate``, ``u = R/√v̂``, ``u ← u / max(1, RMS(u)/d)``, ``u ← lr_t u``,
``M ← β₁ M + (1−β₁) u`` (its first moment is an EMA of *updates*), ``W ← W − λ lr_t W``,
``W ← W − scale·back(M)``.

**Which parameters are projected** (``coap_torch/utils/params.py`` ``setup_params``, and
the per-parameter rank in ``AdamW.step``), in xopt's terms (:func:`is_projected`,
:func:`rank_of`), for a parameter of shape ``s`` whose group has ``project``:

* ``project=False``: never (the authors' groups without ``proj_method``).
* matrices (``len(s) == 2``) by the rules below; 4-D convolution kernels by Tucker-2 (next
  section); vectors, scalars and tensors of other ranks take the base update unprojected.
* ``project="auto"`` (the default; the authors' rule): a matrix is projected unless
  ``rank`` is set and ``rank ≥ min(s)`` (then it takes the base update, the authors' "other"
  group). The rank is ``max(min(s) // rank_ratio, 1)`` when ``rank_ratio`` is set (it
  overrides ``rank``, as the authors' ``rank_ratio_matrix``), else ``rank``.
* ``project=True``: every matrix of the group is projected; a ``rank`` larger than
  ``min(s)`` is an error naming the parameter (xopt's check; the authors clamp it).

**Convolution kernels: Tucker-2** (``coap_torch/projection/coap_high_order_tensor.py``
``TuckerCOAP``, :func:`is_tucker`). A 4-D kernel ``G`` (``O × I × k₁ × k₂``) is projected
when ``rank_ratio_cnn`` (ρ) is set and, under ``project="auto"``, it has more than
``min_conv_size`` elements (the authors' ``MIN_CNN_PARAMS = 32·32·3·3``; smaller kernels
take the base update unprojected, ``project=True`` projects every kernel):

* ranks (:func:`tucker_ranks`): ``r_c = max(1, c // √ρ)`` for ``c = O, I`` (two factors
  ``U₀`` ``O × r₀`` = state ``P``, ``U₁`` ``I × r₁`` = state ``P_in``); a kernel whose last
  dimension is 1 has one factor along ``O`` with ``r₀ = max(1, O // ρ)`` (Tucker-1).
* ``R = G ×₀ U₀ᵀ ×₁ U₁ᵀ`` (``r₀ × r₁ × k₁ × k₂``); a low-rank ``N`` returns as
  ``N ×₀ U₀ ×₁ U₁`` (``transform``/``inverse_transform``).
* events 1 and 3 (:func:`partial_tucker`): tensorly's ``partial_tucker`` of ``G`` along the
  channel modes: HOSVD start, then HOOI sweeps until the change of the relative
  reconstruction error is below 1e-4 (checked from the third sweep on), at most 100. It
  starts afresh each time (no warm start, unlike Eqn 7).
* event 2 (:func:`tucker_eqn6_grad`): Eqn 6 with ``Ĝ = G ×₀ U₀U₀ᵀ ×₁ U₁U₁ᵀ``,
  ``X = M ×₀ U₀ ×₁ U₁`` and the cosine over the input channels (dim 1; its mean runs over
  ``O·k₁·k₂`` fibres); each factor is clipped to norm 1 on its own and moved by ``η_P``.
  The authors' factors keep their ``.grad`` between Eqn-6 events (the matrix path zeroes
  it), so a second Eqn-6 event before the next decomposition (``reproject_factor ≥ 3``)
  adds the previous clipped gradient to the new one, and that sum is clipped and kept.
  xopt does the same (state ``P_grad``, ``P_in_grad``; zero after a decomposition) with
  ``carry_factor_grad=True`` (default); ``False`` steps on the current gradient only, as
  Eqn 6 and the matrix path do.

**8-bit COAP** (``state_bits=8``; the authors' ``CoapAdamW8bit``, ``adamw_8bit.py``): both
AdamW moments of every parameter (projected or not) are held as bitsandbytes'
``quantize_blockwise`` holds them (:func:`quantize`): the tensor, flattened row-major, in
blocks of 4096, each with its absmax (float32) and each entry the index (uint8) of the
nearest value of the signed dynamic code book (:func:`dynamic_code`) to ``x · (1/absmax)``,
chosen as bitsandbytes' CUDA kernel chooses it (a binary search, then the float32 midpoint
between neighbours; :func:`quantize`). A step dequantises (``code[q] · absmax``), updates the
moments in float32, takes ``N`` from those, and stores them quantised again; a projection
event reads and restores the dequantised moments (and re-quantises them). bitsandbytes'
CPU kernel rounds through a 65536-entry lookup table instead, which picks a different code
for many small entries: the authors' 8-bit code gives other bytes on a CPU.

**Precision of bfloat16/float16 matrices** (``proj_dtype``, AdamW variant). The authors'
``CoapAdamW`` projects ``p.grad`` as it comes: ``P`` is kept in the gradient's dtype (Eqn 7
runs on the gradient and ``Ω`` cast to float32, its ``Z`` cast back; Eqn 6 runs in that
dtype under autograd), both products run in it, the moments live in it (``zeros_like``)
and the update is added to the parameter there. ``proj_dtype="param"`` computes that
ordinary step (:mod:`xopt.specs.lowrank`, "the precision of the projections") with ``P``
kept in float32 and rounded for the products, the moments in float32 (a bfloat16 ``v``
cannot decay: ``v·0.999`` rounds back to ``v``), and the events (Eqn 6, Eqn 7, the
moments' restoration) in float32 from the widened gradient; at an Eqn-7 event that is the
authors' arithmetic up to the rounding of ``Ω = P``, at an Eqn-6 event it is more precise
than theirs. ``"state"`` (default): the whole step in float32, rounded into the parameter
once. The authors' ``CoapAdafactor`` casts the gradient to float32 before projecting
(``"state"``; ``"param"`` is refused there); kernels' Tucker products run in the state's
dtype under both. Float32 and float64 parameters take one path under both.

**Where the authors' code crashes, and what xopt does instead**

* Adafactor with its default ``beta1=None`` has no first moment, and the first Eqn-6 event
  reads ``state["exp_avg"]``: ``KeyError`` at update ``T_u``. xopt takes ``M`` in Eqn 6 to be
  the current gradient in the old subspace, ``M = R_old = G P_oldᵀ`` (right; ``P_oldᵀ G``
  left), so the direction term compares ``G`` with its own reconstruction ``G P_oldᵀ P``.
  It needs no extra memory (what ``beta1=None`` is for), and it is the quantity the
  authors' ``M`` averages (past low-rank gradients, preconditioned and scaled, which the
  row cosine compares by direction only), taken at the current update. With no first
  moment there is nothing to restore, so ``restore_state`` has no effect.
* ``rank=None`` and ``rank_ratio=None`` (both authors' defaults) fail in their code at the
  first step (``min(None, ...)``); xopt raises :class:`HyperparameterError` at construction.
* Adafactor with ``lr=None`` and ``relative_step=False`` (the authors' defaults) fails in
  ``_get_lr``; xopt's ``lr`` has a default (1e-3) and ``relative_step=True`` ignores it.
* ``rank_ratio_cnn=None`` (their default) fails on the first large 4-D kernel; xopt steps
  such kernels unprojected.
* ``CoapAdamW8bit`` with ``restore_state=False`` hands the quantised tuple to Eqn 6 of a
  4-D kernel (``AttributeError`` at its first Eqn-6 event); xopt uses the dequantised ``M``.
* ``CoapAdafactor8bit`` stores no moment for unprojected and 4-D parameters and fails
  without ``beta1``; xopt offers 8-bit state for the AdamW variant only.

**Randomness.** The initial ``Ω`` is ``xopt.random.normal(seed, (min(m, n), r),
dtype="float32")`` (then cast to the state dtype): the same bits in NumPy, torch and jax.
Like the authors' code, which re-seeds a ``torch.Generator`` with 3407 for every matrix,
every parameter draws from its own group's ``seed`` (default 3407) at counter 0; give
groups (torch) or leaves (optax ``param_specs``) their own ``seed`` to decorrelate them.
To match a torch-recorded trace, the harness injects ``P`` itself at events 1 and 3
(:mod:`xopt.parity.methods.coap`; key ``"ortho_matrix"``), since QR/SVD signs and torch's
generator are not portable; Eqn 6 is always computed by xopt.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import numpy as np

from xopt.errors import HyperparameterError
from xopt.specs import arrays, lowrank
from xopt.specs._groups import ParamGroups, all_hps, hp_for
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

# projection events (the golden traces' aux ``proj_event`` codes)
KEEP, INITIAL, EQN6, EQN7 = 0, 1, 2, 3
#: torch's ``cosine_similarity`` clamps each row norm from below by this (its ``eps``)
COS_EPS = 1e-8
#: torch's ``clip_grad_norm_`` adds this to the norm before dividing
CLIP_EPS = 1e-6

# -- hyperparameters -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class COAP(Hyperparams):
    """COAP hyperparameters: the base optimizer's, then the projection's.

    Defaults are the authors' ``CoapAdamW`` (coap_torch/optimizer/adamw.py ``__init__``);
    ``preset="adafactor"`` gives ``CoapAdafactor``'s. Fields marked (AdamW) or (Adafactor)
    are read by that variant only.
    """

    METHOD = "coap"

    optimizer: str = hp("adamw", doc="base optimizer: the authors' CoapAdamW or CoapAdafactor",
                        choices=("adamw", "adafactor"))
    lr: float = hp(1e-3, doc="learning rate η (Adafactor: ignored with relative_step)",
                   interval=NONNEGATIVE)
    b1: float | None = hp(0.9, doc="first-moment decay β₁; None (Adafactor only): no first "
                                   "moment", interval=UNIT_HALF_OPEN)
    b2: float = hp(0.999, doc="(AdamW) second-moment decay β₂", interval=UNIT_HALF_OPEN)
    eps: float = hp(1e-6, doc="(AdamW) ε added to the uncorrected √v", interval=NONNEGATIVE)
    weight_decay: float = hp(0.0, doc="decoupled weight decay λ (times η; Adafactor: times "
                                      "lr_t, before the step)", interval=NONNEGATIVE)
    correct_bias: bool = hp(True, doc="(AdamW) bias-correct the step size")
    eps_sq: float = hp(1e-30, doc="(Adafactor) ε₁ added to R² (the authors' eps[0])",
                       interval=NONNEGATIVE)
    eps_scale: float = hp(1e-3, doc="(Adafactor) ε₂, floor of RMS(W) in lr_t (eps[1])",
                          interval=NONNEGATIVE)
    clip_threshold: float = hp(1.0, doc="(Adafactor) update RMS clipping threshold d",
                               interval=POSITIVE)
    decay_rate: float = hp(-0.8, doc="(Adafactor) β̂₂ₜ = 1 − t^decay_rate",
                           interval=Interval(None, 0.0))
    scale_parameter: bool = hp(True, doc="(Adafactor) lr_t scaled by max(ε₂, RMS(W))")
    relative_step: bool = hp(False, doc="(Adafactor) lr_t from min(1e-2, 1/√t) instead of lr")
    warmup_init: bool = hp(False, doc="(Adafactor) relative step min(1e-6 t, 1/√t)")
    project: str | bool = hp("auto", doc="which matrices are projected: 'auto' (the authors' "
                                         "rule), True (all), False (none)",
                             choices=("auto", True, False))
    rank: int | None = hp(None, doc="rank r of the projection", interval=Interval(1, None))
    rank_ratio: float | None = hp(None, doc="r = max(min(m, n) // rank_ratio, 1); overrides "
                                            "rank (rank_ratio_matrix)",
                                  interval=Interval(1.0, None))
    rank_ratio_cnn: float | None = hp(None, doc="ρ of 4-D kernels: Tucker-2 ranks max(1, c // √ρ) "
                                                "for c = O, I (None: kernels unprojected)",
                                      interval=Interval(1.0, None))
    carry_factor_grad: bool = hp(True, doc="(kernels) an Eqn-6 step adds the previous clipped "
                                           "factor gradient since the last decomposition, as "
                                           "TuckerCOAP's factors keep their .grad")
    min_conv_size: int = hp(32 * 32 * 3 * 3, doc="'auto' projects 4-D kernels of more elements "
                                                 "than this (MIN_CNN_PARAMS)",
                            interval=Interval(0, None))
    state_bits: int = hp(32, doc="(AdamW) 8: moments in bitsandbytes' blockwise 8-bit form "
                                 "(CoapAdamW8bit)", choices=(32, 8))
    quant_rounding: str = hp("cuda", doc="(state_bits=8) how bitsandbytes picks a code: its "
                                         "CUDA kernel (the nearest) or its CPU kernel (a "
                                         "65536-entry lookup table)", choices=("cuda", "cpu"))
    update_interval: int = hp(32, doc="T_u: P moves (Eqn 6) every T_u updates",
                              interval=Interval(1, None))
    reproject_factor: int = hp(5, doc="λ: Eqn 7 instead of Eqn 6 every λ·T_u updates",
                               interval=Interval(1, None))
    restore_state: bool = hp(False, doc="carry the moments into the new subspace at events")
    scale: float = hp(1.0, doc="factor on the projected-back update", interval=NONNEGATIVE)
    # "state": what xopt computed before this field existed (checkpoints and golden traces
    # keep their meaning); float32 and float64 parameters compute the same under both
    proj_dtype: str = hp("state", doc="(AdamW) dtype of the projections of bfloat16/float16 "
                                      "matrices: 'state' (float32) or 'param' (the "
                                      "parameter's, as the authors' COAPAdamProjector)",
                         choices=lowrank.PROJ_DTYPES)
    proj_lr: float = hp(0.1, doc="η_P of the Eqn-6 SGD step (update_proj's lr)",
                        interval=NONNEGATIVE)
    proj_max_norm: float = hp(1.0, doc="gradient-norm clipping of the Eqn-6 step",
                              interval=POSITIVE)
    seed: int = hp(3407, doc="seed of the initial Ω (xopt.random)",
                   interval=Interval(0, 2**64 - 1))

    def _check_field(self, f: dataclasses.Field, value: Any) -> None:
        if f.name == "b1" and value is None:
            return
        super()._check_field(f, value)

    def _check_combinations(self) -> None:
        name = type(self).__name__
        if not (isinstance(self.project, bool) or (isinstance(self.project, str)
                                                   and self.project == "auto")):
            raise HyperparameterError(f"{name}.project = {self.project!r}: must be one of "
                                      "'auto', True, False")
        if self.rank is not None and (isinstance(self.rank, bool)
                                      or not isinstance(self.rank, (int, np.integer))):
            raise HyperparameterError(f"{name}.rank = {self.rank!r}: must be an int or None")
        for field in ("update_interval", "reproject_factor"):
            lowrank.check_interval(getattr(self, field), field, name)
        if (self.project is not False and self.rank is None and self.rank_ratio is None
                and self.rank_ratio_cnn is None):
            raise HyperparameterError(
                f"{name}.rank = None and {name}.rank_ratio = None: set one of them (or "
                "rank_ratio_cnn, or project=False); the authors' code has no default and "
                "fails at the first step")
        if self.state_bits == 8 and self.optimizer != "adamw":
            raise HyperparameterError(
                f"{name}.state_bits = 8 with optimizer={self.optimizer!r}: 8-bit state is "
                "offered for the AdamW variant only (the authors' CoapAdafactor8bit keeps no "
                "moment for unprojected parameters)")
        if self.proj_dtype == "param" and self.optimizer != "adamw":
            raise HyperparameterError(
                f"{name}.proj_dtype = 'param' with optimizer={self.optimizer!r}: the authors' "
                "CoapAdafactor casts a bfloat16/float16 gradient to float32 and projects "
                "there, which is proj_dtype='state'")
        if self.b1 is None and self.optimizer == "adamw":
            raise HyperparameterError(f"{name}.b1 = None: only the Adafactor variant runs "
                                      "without a first moment")


PRESETS: dict[str, dict[str, Any]] = {
    # coap_torch/optimizer/adamw.py AdamW.__init__ (rank and rank_ratio have no default).
    "adamw": dict(optimizer="adamw", lr=1e-3, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.0,
                  correct_bias=True, update_interval=32, reproject_factor=5,
                  restore_state=False, scale=1.0),
    # coap_torch/optimizer/adafactor.py Adafactor.__init__. Its lr=None fails with
    # relative_step=False (its default) at the first step; xopt keeps lr = 1e-3 here.
    # beta1=None is kept: xopt runs it (see the module docstring).
    "adafactor": dict(optimizer="adafactor", lr=1e-3, b1=None, eps_sq=1e-30, eps_scale=1e-3,
                      clip_threshold=1.0, decay_rate=-0.8, weight_decay=0.0,
                      scale_parameter=True, relative_step=False, warmup_init=False,
                      update_interval=32, reproject_factor=5, restore_state=False, scale=1.0),
}


# -- which parameters, which rank, which side ---------------------------------------------------


def is_tucker(shape: tuple[int, ...], hp: COAP) -> bool:
    """Whether a 4-D kernel is projected by Tucker-2 (module docstring, "Convolution
    kernels"): ``rank_ratio_cnn`` set, and more than ``min_conv_size`` elements unless
    ``project=True``."""
    if hp.project is False or len(shape) != 4 or hp.rank_ratio_cnn is None:
        return False
    return hp.project is True or math.prod(shape) > hp.min_conv_size


def is_projected(shape: tuple[int, ...], hp: COAP) -> bool:
    """Whether a parameter of ``shape`` is projected under its group's ``hp`` (module
    docstring, "Which parameters are projected")."""
    if len(shape) == 4:
        return is_tucker(shape, hp)
    if hp.project is False or len(shape) != 2:
        return False
    if hp.rank is None and hp.rank_ratio is None:
        return False  # only convolutions are projected (rank_ratio_cnn alone)
    if hp.project is True:
        return True
    return hp.rank is None or hp.rank < min(shape)


def rank_of(shape: tuple[int, ...], hp: COAP) -> int:
    """The projection rank of a projected matrix (``rank_ratio`` first, as the authors)."""
    if hp.rank_ratio is not None:
        return max(int(min(shape) // hp.rank_ratio), 1)
    return int(hp.rank)


def tucker_ranks(shape: tuple[int, ...], hp: COAP) -> tuple[int, ...]:
    """``(r₀, r₁)`` of a Tucker-2 kernel, ``(r₀,)`` of a Tucker-1 one (last dim 1), as
    ``TuckerCOAP.project`` computes them (Python float floor division)."""
    ratio = float(hp.rank_ratio_cnn)
    if shape[-1] == 1:
        return (int(max(1, shape[0] // ratio)),)
    return tuple(int(max(1, c // ratio ** 0.5)) for c in shape[:2])


def check_param(shape: tuple[int, ...], hp: COAP, where: str) -> None:
    """Raise :class:`HyperparameterError` naming ``where`` for a rank the parameter cannot
    hold (a matrix: only reachable with ``project=True``; a kernel: a Tucker rank above
    its channels or above the other modes' product, where tensorly pads with random
    columns)."""
    if not is_projected(shape, hp):
        return
    if len(shape) == 2:
        lowrank.check_rank(rank_of(shape, hp), tuple(shape), where)
        return
    ranks = tucker_ranks(shape, hp)
    for k, r in enumerate(ranks):
        rest = math.prod(shape) // shape[k]
        if len(ranks) == 2:
            rest = rest // shape[1 - k] * ranks[1 - k]
        if r > shape[k] or r > rest:
            raise HyperparameterError(
                f"{where}: Tucker rank {r} of mode {k} does not fit the kernel {tuple(shape)} "
                f"(rank_ratio_cnn={hp.rank_ratio_cnn})")


def side_of(shape: tuple[int, ...]) -> str:
    """``"right"`` when ``m ≥ n`` else ``"left"`` (``COAPAdamProjector.project``);
    ``"tucker"`` for a 4-D kernel."""
    if len(shape) == 4:
        return "tucker"
    return "right" if shape[0] >= shape[1] else "left"


def low_rank_shape(shape: tuple[int, ...], hp: COAP) -> tuple[int, ...]:
    """Shape of the projected gradient and the moments: ``(m, r)`` right, ``(r, n)`` left,
    ``(r₀, r₁, k₁, k₂)`` (``(r₀, I, k₁, k₂)``) Tucker; the parameter's own shape when it is
    not projected."""
    shape = tuple(shape)
    if not is_projected(shape, hp):
        return shape
    if len(shape) == 4:
        ranks = tucker_ranks(shape, hp)
        return ranks + shape[len(ranks):]
    r = rank_of(shape, hp)
    return (shape[0], r) if side_of(shape) == "right" else (r, shape[1])


def proj_shape(shape: tuple[int, ...], hp: COAP) -> tuple[int, ...]:
    """Shape of ``P``: ``(r, n)`` right, ``(m, r)`` left (the authors' ``ortho_matrix``);
    ``U₀`` ``(O, r₀)`` of a kernel."""
    if len(shape) == 4:
        return (shape[0], tucker_ranks(shape, hp)[0])
    r = rank_of(shape, hp)
    return (r, shape[1]) if side_of(shape) == "right" else (shape[0], r)


def proj_in_shape(shape: tuple[int, ...], hp: COAP) -> tuple[int, ...]:
    """Shape of ``P_in``, the Tucker-2 factor ``U₁`` ``(I, r₁)``."""
    return (shape[1], tucker_ranks(shape, hp)[1])


def has_proj_in(shape: tuple[int, ...], hp: COAP) -> bool:
    return is_tucker(shape, hp) and len(tucker_ranks(shape, hp)) == 2


def omega_shape(shape: tuple[int, ...], hp: COAP) -> tuple[int, int]:
    """Shape of Ω: ``(columns of A, r)`` = ``(min(m, n), r)``."""
    return (min(shape), rank_of(shape, hp))


def event(t: int, hp: COAP) -> int:
    """The projection event of update ``t`` (0-based: updates taken before this one)."""
    if t == 0:
        return INITIAL
    if t % hp.update_interval != 0:
        return KEEP
    return EQN7 if t % (hp.update_interval * hp.reproject_factor) == 0 else EQN6


def has_first_moment(hp: COAP) -> bool:
    return hp.b1 is not None


# -- the projection ----------------------------------------------------------------------------


def _mm(xp: ModuleType, a: Any, b: Any) -> Any:
    return arrays.matmul(xp, a, b)


def _sum(xp: ModuleType, x: Any, axis: int | None = None) -> Any:
    if arrays.is_torch(xp):
        return x.sum() if axis is None else x.sum(dim=axis)
    return xp.sum(x, axis=axis)


def project(xp: ModuleType, g: Any, p: Any, side: str) -> Any:
    """``R = G Pᵀ`` (right), ``Pᵀ G`` (left), ``G ×₀ U₀ᵀ ×₁ U₁ᵀ`` (Tucker, ``p`` the tuple of
    factors)."""
    if side == "tucker":
        return tucker_project(xp, g, p)
    return _mm(xp, g, p.T) if side == "right" else _mm(xp, p.T, g)


def restore(xp: ModuleType, n: Any, p: Any, side: str) -> Any:
    """A low-rank ``N`` in full shape: ``N P`` (right), ``P N`` (left), ``N ×₀ U₀ ×₁ U₁``
    (Tucker)."""
    if side == "tucker":
        return tucker_restore(xp, n, p)
    return _mm(xp, n, p) if side == "right" else _mm(xp, p, n)


def project_back(xp: ModuleType, n: Any, p: Any, side: str, scale: float) -> Any:
    """``scale · restore(N)`` (``MatrixCOAP.project_back``)."""
    full = restore(xp, n, p, side)
    return lowrank.astype(full * scale, full.dtype)  # NumPy: bfloat16 · float is float32


# -- Tucker-2 of convolution kernels (TuckerCOAP) ------------------------------------------------


def _mode_dot(xp: ModuleType, t: Any, u: Any, mode: int, transpose: bool) -> Any:
    """``t ×ₖ uᵀ`` (``transpose``: mode ``k`` of size ``u.shape[0]`` becomes ``u.shape[1]``)
    or ``t ×ₖ u`` (size ``u.shape[1]`` becomes ``u.shape[0]``), for 4-D ``t``, ``k`` 0 or 1."""
    spec = {(0, True): "abcd,am->mbcd", (1, True): "abcd,bn->ancd",
            (0, False): "mbcd,am->abcd", (1, False): "ancd,bn->abcd"}[(mode, transpose)]
    return xp.einsum(spec, t, u)


def tucker_project(xp: ModuleType, g: Any, factors: tuple[Any, ...]) -> Any:
    """``G ×₀ U₀ᵀ (×₁ U₁ᵀ)`` (``TuckerCOAP.transform``, its einsum as written there)."""
    if len(factors) == 2:
        return xp.einsum("abcd,am,bn->mncd", g, *factors)
    return xp.einsum("abcd,am->mbcd", g, factors[0])


def tucker_restore(xp: ModuleType, n: Any, factors: tuple[Any, ...]) -> Any:
    """``N ×₀ U₀ (×₁ U₁)`` (``TuckerCOAP.inverse_transform``, its einsum as written there)."""
    if len(factors) == 2:
        return xp.einsum("mncd,am,bn->abcd", n, *factors)
    return xp.einsum("mbcd,am->abcd", n, factors[0])


def _unfold(xp: ModuleType, t: Any, mode: int) -> Any:
    return xp.moveaxis(t, mode, 0).reshape(t.shape[mode], -1)


def _leading(xp: ModuleType, a: Any, r: int, svd: Callable[[Any], Any]) -> Any:
    return svd(a)[0][:, :r]


#: tensorly's partial_tucker defaults, as TuckerCOAP calls it
TUCKER_ITERS, TUCKER_TOL = 100, 1e-4


def tucker_init(xp: ModuleType, g: Any, ranks: tuple[int, ...], *,
                svd: Callable[[Any], Any] | None = None) -> tuple[Any, ...]:
    """HOSVD start (tensorly's ``init="svd"``): the leading left singular vectors of each
    channel mode's unfolding of ``G``."""
    svd = svd or (lambda a: lowrank.svd(xp, a))
    return tuple(_leading(xp, _unfold(xp, g, k), r, svd) for k, r in enumerate(ranks))


def tucker_sweep(xp: ModuleType, g: Any, factors: tuple[Any, ...], ranks: tuple[int, ...],
                 norm_g: Any, *, svd: Callable[[Any], Any] | None = None,
                 ) -> tuple[tuple[Any, ...], Any]:
    """One HOOI sweep (tensorly's ``partial_tucker`` loop body): each factor in turn is the
    leading left singular vectors of ``G`` contracted with the other factors (transposed),
    then the relative reconstruction error ``√|‖G‖² − ‖core‖²| / ‖G‖``."""
    svd = svd or (lambda a: lowrank.svd(xp, a))
    factors = list(factors)
    for k, r in enumerate(ranks):
        approx = g
        for j, u in enumerate(factors):
            if j != k:
                approx = _mode_dot(xp, approx, u, j, True)
        factors[k] = _leading(xp, _unfold(xp, approx, k), r, svd)
    core = tucker_project(xp, g, tuple(factors))
    err = xp.sqrt(xp.abs(norm_g * norm_g - _sum(xp, core * core))) / norm_g
    return tuple(factors), err


def tucker_continue(it: Any, err_prev: Any, err: Any, xp: ModuleType = np) -> Any:
    """Whether HOOI sweeps on after ``it`` sweeps (tensorly: stop when the error moved by
    less than the tolerance, checked from the third sweep on; 100 at most; a NaN error
    never stops it early)."""
    if isinstance(it, int):
        return it < TUCKER_ITERS and (it < 3 or not bool(abs(err_prev - err) < TUCKER_TOL))
    moved = xp.logical_not(xp.abs(err_prev - err) < TUCKER_TOL)
    return xp.logical_and(it < TUCKER_ITERS, xp.logical_or(it < 3, moved))


def partial_tucker(xp: ModuleType, g: Any, ranks: tuple[int, ...], *,
                   svd: Callable[[Any], Any] | None = None,
                   while_loop: Callable[..., Any] | None = None) -> tuple[Any, ...]:
    """The factors of tensorly's ``partial_tucker(G, modes=[0, 1][:len(ranks)], rank=ranks)``
    (events 1 and 3 of a kernel).

    ``while_loop``: ``jax.lax.while_loop`` under jit (the same sweeps and stopping rule);
    None runs a Python loop."""
    norm_g = xp.sqrt(_sum(xp, g * g))
    factors = tucker_init(xp, g, ranks, svd=svd)
    nan = norm_g * float("nan")
    if while_loop is None:
        it, err_prev, err = 0, nan, nan
        while tucker_continue(it, err_prev, err, xp):
            factors, new_err = tucker_sweep(xp, g, factors, ranks, norm_g, svd=svd)
            err_prev, err, it = err, new_err, it + 1
        return factors

    def cond(c: tuple[Any, ...]) -> Any:
        return tucker_continue(c[0], c[2], c[3], xp)

    def body(c: tuple[Any, ...]) -> tuple[Any, ...]:
        f, err = tucker_sweep(xp, g, c[1], ranks, norm_g, svd=svd)
        return (c[0] + 1, f, c[3], err)

    _, factors, _, _ = while_loop(cond, body, (xp.asarray(0), factors, nan, nan))
    return factors


def _cosine_terms(xp: ModuleType, x: Any, g: Any, axis: int) -> tuple[Any, Any, Any]:
    """``(cos, mean cos, ∂ mean cos/∂X)`` for torch's ``cosine_similarity(X, G, dim=axis)``
    (norms clamped at 1e-8, the clamp not differentiated; see :func:`eqn6_grad`)."""
    nx = xp.sqrt(_sum(xp, x * x, axis))
    ng = xp.sqrt(_sum(xp, g * g, axis))
    cx = xp.maximum(nx, xp.full_like(nx, COS_EPS))
    cg = xp.maximum(ng, xp.full_like(ng, COS_EPS))
    s = _sum(xp, x * g, axis)
    cos = s / (cx * cg)
    count = math.prod(cos.shape)
    c = _sum(xp, cos) / count
    inv_nx = xp.where(nx > 0, 1.0 / xp.where(nx > 0, nx, xp.ones_like(nx)), xp.zeros_like(nx))
    a = arrays.expand_dims(xp, 1.0 / (cx * cg), axis)
    b = arrays.expand_dims(xp, s * inv_nx / (cx * cx * cg), axis)
    return cos, c, (g * a - b * x) / count


def tucker_eqn6_grad(xp: ModuleType, factors: tuple[Any, ...], m: Any, g: Any,
                     ) -> tuple[tuple[Any, ...], Any, Any]:
    """``∂L/∂Uₖ`` of Eqn 6 for a kernel (``TuckerCOAP.update_proj``), in closed form.

    Args:
      factors: ``(U₀,)`` or ``(U₀, U₁)``; m: the low-rank moment ``M``; g: ``G`` (4-D).
    Returns:
      ``(gradients, mse, cos)``, the gradients one per factor.

    With ``Aₖ = UₖUₖᵀ``, ``Ĝ = G ×₀ A₀ ×₁ A₁``, ``E = Ĝ − G`` and ``N`` elements:
    ``∂mse/∂Aₖ = (2/N) E₍ₖ₎ Hₖ₍ₖ₎ᵀ =: Sₖ`` with ``Hₖ`` = ``G`` times every other ``Aⱼ``, so
    ``∂mse/∂Uₖ = (Sₖ + Sₖᵀ) Uₖ``. ``X = M ×₀ U₀ ×₁ U₁``: ``X₍ₖ₎ = Uₖ Yₖ₍ₖ₎`` with ``Yₖ`` =
    ``M`` times every other ``Uⱼ``, so ``∂C/∂Uₖ = D₍ₖ₎ Yₖ₍ₖ₎ᵀ`` with ``D = ∂C/∂X`` (the
    cosine along dim 1, as in :func:`eqn6_grad`). ``∂L = (1 − C) ∂mse − mse ∂C``.
    """
    n = math.prod(g.shape)
    ghat = tucker_restore(xp, tucker_project(xp, g, factors), factors)
    e = ghat - g
    mse = _sum(xp, e * e) / n
    x = tucker_restore(xp, m, factors)
    cos, c, d = _cosine_terms(xp, x, g, 1)
    grads = []
    for k, u in enumerate(factors):
        h, y = g, m
        for j, w in enumerate(factors):
            if j != k:
                h = _mode_dot(xp, _mode_dot(xp, h, w, j, True), w, j, False)
                y = _mode_dot(xp, y, w, j, False)
        s_k = _mm(xp, _unfold(xp, e, k), _unfold(xp, h, k).T) * (2.0 / n)
        dmse = _mm(xp, s_k + s_k.T, u)
        dc = _mm(xp, _unfold(xp, d, k), _unfold(xp, y, k).T)
        grads.append(dmse * (1.0 - c) - dc * mse)
    return tuple(grads), mse, cos


def _clipped_step(xp: ModuleType, p: Any, grad: Any, lr: float, max_norm: float,
                  ) -> tuple[Any, Any, Any]:
    norm = xp.sqrt(_sum(xp, grad * grad))
    coef = max_norm / (norm + CLIP_EPS)
    coef = xp.minimum(coef, xp.ones_like(coef))
    clipped = grad * coef
    return p - clipped * lr, norm, clipped


def initial_omega(hp: COAP, shape: tuple[int, ...], *, backend: str = "numpy",
                  device: Any = None) -> Any:
    """Ω of the initial decomposition: ``xopt.random.normal(hp.seed, (min(m, n), r))``,
    float32, identical bits in every backend (cast it to the working dtype)."""
    from xopt import random

    kw = {"device": device} if backend == "torch" else {}
    return random.normal(int(hp.seed), omega_shape(shape, hp), dtype="float32",
                         backend=backend, **kw)


def warm_omega(p: Any, side: str) -> Any:
    """Ω of an Eqn-7 event: the previous ``P`` as columns, ``Pᵀ`` (right) or ``P`` (left)."""
    return p.T if side == "right" else p


def orthogonal_basis(xp: ModuleType, a: Any, omega: Any, *,
                     qr: Callable[[Any], tuple[Any, Any]] | None = None,
                     svd: Callable[[Any], tuple[Any, Any, Any]] | None = None) -> Any:
    """Eqn 7 (``compute_orthogonal``): ``Q = QR_red(A Ω)``, ``U Σ Z = SVD(Qᵀ A)``; returns ``Z``.

    Args:
      a: ``(k, n')`` float (``A = G`` right, ``Gᵀ`` left); omega: ``(n', r)``.
      qr, svd: the decompositions (default: :func:`xopt.specs.lowrank.qr` / ``svd``, with
        xopt's sign convention; backends pass versions that raise naming the parameter).
    Returns:
      ``Z`` ``(r, n')`` with orthonormal rows.
    """
    qr = qr or (lambda x: lowrank.qr(xp, x))
    svd = svd or (lambda x: lowrank.svd(xp, x))
    q, _ = qr(_mm(xp, a, omega))
    _, _, z = svd(_mm(xp, q.T, a))
    return z


def decompose(xp: ModuleType, g: Any, omega: Any, side: str, **kw: Any) -> Any:
    """New ``P`` from Eqn 7: ``Z`` of ``A = G`` (right), ``Zᵀ`` of ``A = Gᵀ`` (left)."""
    if side == "right":
        return orthogonal_basis(xp, g, omega, **kw)
    return orthogonal_basis(xp, g.T, omega, **kw).T


def eqn6_grad(xp: ModuleType, p: Any, m: Any, g: Any, side: str) -> tuple[Any, Any, Any]:
    """``∂L/∂P`` of Eqn 6 in closed form, with ``L``'s two factors.

    Args:
      p: ``P``, ``(r, n)`` right / ``(m, r)`` left; m: the low-rank moment ``M``, ``(m, r)``
        right / ``(r, n)`` left; g: ``G``, ``(m, n)``; all one float dtype.
    Returns:
      ``(∂L/∂P, mse, cos)``: the gradient (shape of ``P``), ``MSE(Ĝ, G)`` (0-d) and the
      row cosines ``cos(X_i, G_i)`` (``(m,)``).

    Derivation (``E = Ĝ − G``, ``C = (1/m) Σ_i cos_i``, ``L = mse · (1 − C)``, so
    ``∂L = (1 − C) ∂mse − mse ∂C``):

    * right, ``Ĝ = G A`` with ``A = PᵀP``: ``∂mse/∂A = (2/mn) GᵀE =: S`` and for
      ``f(PᵀP)``, ``∂f/∂P = P (S + Sᵀ)``, so ``∂mse/∂P = (2/mn)((G Pᵀ)ᵀ E + (E Pᵀ)ᵀ G)``;
      left, ``Ĝ = A G`` with ``A = P Pᵀ``: ``∂mse/∂P = (2/mn)(E (Pᵀ G)ᵀ + G (Pᵀ E)ᵀ)``.
    * ``cos_i = ⟨x_i, g_i⟩ / (c_x c_g)`` with ``c = max(‖·‖, 1e-8)`` (torch clamps the norms
      without recording the clamp), so ``∂cos_i/∂x_i = g_i/(c_x c_g) − ⟨x_i, g_i⟩ x_i /
      (c_x² c_g ‖x_i‖)`` (second term 0 where ``x_i = 0``, as torch's norm backward);
      ``D = ∂C/∂X`` stacks these rows over ``m``; ``X = M P`` gives ``∂C/∂P = Mᵀ D``
      (right) and ``X = P M`` gives ``D Mᵀ`` (left).
    """
    rows, cols = g.shape
    if side == "right":
        gpt = _mm(xp, g, p.T)                     # (m, r)
        e = _mm(xp, gpt, p) - g
        x = _mm(xp, m, p)
    else:
        ptg = _mm(xp, p.T, g)                     # (r, n)
        e = _mm(xp, p, ptg) - g
        x = _mm(xp, p, m)
    mse = _sum(xp, e * e) / (rows * cols)
    nx = xp.sqrt(_sum(xp, x * x, 1))
    ng = xp.sqrt(_sum(xp, g * g, 1))
    cx = xp.maximum(nx, xp.full_like(nx, COS_EPS))
    cg = xp.maximum(ng, xp.full_like(ng, COS_EPS))
    s = _sum(xp, x * g, 1)
    cos = s / (cx * cg)
    c = _sum(xp, cos) / rows
    inv_nx = xp.where(nx > 0, 1.0 / xp.where(nx > 0, nx, xp.ones_like(nx)), xp.zeros_like(nx))
    d = (g / (cx * cg)[:, None] - (s * inv_nx / (cx * cx * cg))[:, None] * x) / rows
    if side == "right":
        dmse = (_mm(xp, gpt.T, e) + _mm(xp, _mm(xp, e, p.T).T, g)) * (2.0 / (rows * cols))
        dc = _mm(xp, m.T, d)
    else:
        dmse = (_mm(xp, e, ptg.T) + _mm(xp, g, _mm(xp, p.T, e).T)) * (2.0 / (rows * cols))
        dc = _mm(xp, d, m.T)
    return dmse * (1.0 - c) - dc * mse, mse, cos


def tucker_eqn6_step(xp: ModuleType, factors: tuple[Any, ...], m: Any, g: Any, lr: float,
                     max_norm: float, carried: tuple[Any, ...] | None = None,
                     aux: dict[str, Any] | None = None) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Eqn 6 on a kernel's factors: each ``Uₖ − lr · clip(∇ₖ + Cₖ)``, clipped on its own.

    ``carried`` (``Cₖ``): the clipped gradients of the previous Eqn-6 step since the last
    decomposition (``carry_factor_grad``: TuckerCOAP's factors keep their ``.grad``), or
    None. Returns ``(new factors, clipped gradients)``; ``aux`` as :func:`eqn6_step` (a
    factor ``k`` > 0 adds ``_in`` to the gradient names).
    """
    grads, mse, cos = tucker_eqn6_grad(xp, factors, m, g)
    out, kept = [], []
    for k, (u, grad) in enumerate(zip(factors, grads, strict=True)):
        if carried is not None:
            grad = grad + carried[k]
        new, norm, clipped = _clipped_step(xp, u, grad, lr, max_norm)
        out.append(new)
        kept.append(clipped)
        if aux is not None:
            tag = "" if k == 0 else "_in"
            aux.update({f"eqn6_P{tag}_grad": grad, f"eqn6_P{tag}_grad_norm": norm,
                        f"eqn6_P{tag}_grad_clipped": clipped})
    if aux is not None:
        aux.update(eqn6_mse=mse, eqn6_cos=cos)
    return tuple(out), tuple(kept)


def eqn6_step(xp: ModuleType, p: Any, m: Any, g: Any, side: str, lr: float, max_norm: float,
              aux: dict[str, Any] | None = None) -> Any:
    """One clipped SGD step on Eqn 6: ``P − lr · min(1, max_norm/(‖∇‖ + 1e-6)) · ∇`` (each
    Tucker factor clipped on its own, nothing carried; ``p`` is then the tuple of factors).

    ``aux`` (a dict, optional) receives ``eqn6_mse``, ``eqn6_cos``, ``eqn6_P_grad``,
    ``eqn6_P_grad_norm`` and ``eqn6_P_grad_clipped``, as the golden traces name them.
    """
    if side == "tucker":
        return tucker_eqn6_step(xp, p, m, g, lr, max_norm, None, aux)[0]
    grad, mse, cos = eqn6_grad(xp, p, m, g, side)
    new, norm, clipped = _clipped_step(xp, p, grad, lr, max_norm)
    if aux is not None:
        aux.update(eqn6_mse=mse, eqn6_cos=cos, eqn6_P_grad=grad, eqn6_P_grad_norm=norm,
                   eqn6_P_grad_clipped=clipped)
    return new


def carries_grad(shape: tuple[int, ...], hp: COAP) -> bool:
    """Whether a parameter keeps its factors' clipped Eqn-6 gradients (a kernel under
    ``carry_factor_grad``)."""
    return is_tucker(shape, hp) and hp.carry_factor_grad


def carried_of(st: Mapping[str, Any], shape: tuple[int, ...], hp: COAP) -> Any:
    """The carried gradients ``(P_grad[, P_in_grad])`` of a kernel, or None."""
    if not carries_grad(shape, hp):
        return None
    return (st["P_grad"], st["P_in_grad"]) if "P_in_grad" in st else (st["P_grad"],)


def store_carried(st: dict[str, Any], carried: Any) -> None:
    if carried is not None:
        st["P_grad"] = carried[0]
        if len(carried) == 2:
            st["P_in_grad"] = carried[1]


def eqn6_moment(xp: ModuleType, hp: COAP, m: Any, g: Any, p_old: Any, side: str) -> Any:
    """The ``M`` of Eqn 6: the first moment, or, without one (Adafactor ``b1=None``, where the
    authors' code raises KeyError), the gradient in the old subspace ``project(G, P_old)``."""
    return m if has_first_moment(hp) else project(xp, g, p_old, side)


def restore_moments(xp: ModuleType, hp: COAP, m: Any, v: Any, p_old: Any, p_new: Any,
                    side: str) -> tuple[Any, Any]:
    """``restore_state``: the moments carried from ``P_old``'s subspace to ``P_new``'s.

    ``M ← project(restore(M, P_old), P_new)``; AdamW also
    ``V ← project(restore(√V, P_old), P_new)²``. ``m``/``v`` may be None (absent).
    """
    if m is not None:
        m = project(xp, restore(xp, m, p_old, side), p_new, side)
    if v is not None and hp.optimizer == "adamw":
        v = project(xp, restore(xp, xp.sqrt(v), p_old, side), p_new, side) ** 2
    return m, v


def injected_projection(inject: Mapping[str, Any] | None, side: str = "right") -> Any:
    """The ``P`` given in ``inject`` (``{"ortho_matrix": P}``; a kernel's factors as
    ``{"ortho_matrix": U₀, "ortho_matrix_in": U₁}``, returned as a tuple), or None."""
    if inject is None or "ortho_matrix" not in inject:
        return None
    if side == "tucker":
        return tuple(inject[k] for k in ("ortho_matrix", "ortho_matrix_in") if k in inject)
    return inject["ortho_matrix"]


def projection_of(st: Mapping[str, Any], shape: tuple[int, ...]) -> Any:
    """``P`` from a parameter's state: the array, or a kernel's tuple ``(P[, P_in])``."""
    if len(shape) == 4:
        return (st["P"], st["P_in"]) if "P_in" in st else (st["P"],)
    return st["P"]


def store_projection(st: dict[str, Any], p: Any, shape: tuple[int, ...]) -> None:
    if len(shape) == 4:
        st["P"] = p[0]
        if len(p) == 2:
            st["P_in"] = p[1]
    else:
        st["P"] = p


def new_projection(xp: ModuleType, hp: COAP, shape: tuple[int, ...], g: Any, p_old: Any,
                   ev: int, *, omega: Callable[[], Any] | None = None,
                   qr: Callable[[Any], tuple[Any, Any]] | None = None,
                   svd: Callable[[Any], tuple[Any, Any, Any]] | None = None,
                   while_loop: Callable[..., Any] | None = None) -> Any:
    """The decomposition of an event that decomposes (1 or 3): Eqn 7 of a matrix (Ω drawn
    at event 1, the old ``P`` at 3), ``partial_tucker`` of a kernel (afresh at both)."""
    side = side_of(shape)
    if side == "tucker":
        return partial_tucker(xp, g, tucker_ranks(shape, hp), svd=svd, while_loop=while_loop)
    if ev == INITIAL:
        om = omega() if omega is not None else xp.asarray(initial_omega(hp, shape),
                                                          dtype=g.dtype)
    else:
        om = warm_omega(p_old, side)
    return decompose(xp, g, om, side, qr=qr, svd=svd)


# -- the base optimizers -------------------------------------------------------------------------


def rms(xp: ModuleType, x: Any) -> Any:
    """``‖x‖₂ / √numel`` (Adafactor's ``_rms``)."""
    numel = math.prod(x.shape) if len(x.shape) else 1
    return xp.sqrt(_sum(xp, x * x)) / math.sqrt(numel)


def adafactor_lr(hp: COAP, t: Any, param_rms: Any, xp: ModuleType = np) -> Any:
    """``lr_t`` at 1-based step ``t`` (``_get_lr``): ``ρ · max(ε₂, RMS(W))`` (or ``ρ``
    without ``scale_parameter``), ``ρ = η``, or ``min(1e-2 or 1e-6 t, 1/√t)`` with
    ``relative_step``."""
    if hp.relative_step:
        tf = t if isinstance(t, (int, np.integer)) else t.astype(param_rms.dtype)
        inv_sqrt = (1.0 / math.sqrt(t)) if isinstance(t, (int, np.integer)) else \
            1.0 / xp.sqrt(tf)
        min_step = 1e-6 * tf if hp.warmup_init else 1e-2
        rho = min(min_step, inv_sqrt) if isinstance(t, (int, np.integer)) else \
            xp.minimum(min_step, inv_sqrt)
    else:
        rho = hp.lr
    if not hp.scale_parameter:
        return rho
    return xp.maximum(param_rms, xp.full_like(param_rms, hp.eps_scale)) * rho


def adafactor_beta2(hp: COAP, t: Any, xp: ModuleType = np, dtype: Any = None) -> Any:
    """``β̂₂ₜ = 1 − t^decay_rate`` (double precision for a Python int ``t``)."""
    if isinstance(t, (int, np.integer)):
        return 1.0 - math.pow(int(t), hp.decay_rate)
    return 1.0 - xp.power(t.astype(dtype), hp.decay_rate)


def adafactor_direction(xp: ModuleType, hp: COAP, r: Any, v: Any, v_row: Any, v_col: Any,
                        beta2t: Any) -> tuple[Any, Any, Any, Any]:
    """Adafactor's normalised, clipped direction of ``R`` and the new second moments.

    Args:
      r: the (projected) gradient; ``v`` (``R``'s shape) for tensors of fewer than 2 dims,
        else ``v_row`` (``R.shape[:-1]``) and ``v_col`` (``R.shape[:-2] + R.shape[-1:]``).
    Returns:
      ``(u, v, v_row, v_col)`` with ``u = (R/√v̂) / max(1, RMS(·)/d)``, where ``v̂`` is
      ``v`` or the factored ``(v_row/mean(v_row)) ⊗ v_col``.
    """
    sq = r * r + hp.eps_sq
    if len(r.shape) >= 2:
        v_row = v_row * beta2t + arrays.mean(xp, sq, (-1,)) * (1.0 - beta2t)
        v_col = v_col * beta2t + arrays.mean(xp, sq, (-2,)) * (1.0 - beta2t)
        r_factor = arrays.rsqrt(xp, v_row / arrays.mean(xp, v_row, (-1,), keepdims=True))
        c_factor = arrays.rsqrt(xp, v_col)
        u = arrays.expand_dims(xp, r_factor, -1) * arrays.expand_dims(xp, c_factor, -2) * r
    else:
        v = v * beta2t + sq * (1.0 - beta2t)
        u = arrays.rsqrt(xp, v) * r
    denom = rms(xp, u) / hp.clip_threshold
    u = u / xp.maximum(denom, xp.ones_like(denom))
    return u, v, v_row, v_col


# -- 8-bit state (bitsandbytes' blockwise dynamic quantisation, as CoapAdamW8bit uses it) --------

#: bitsandbytes' ``quantize_blockwise`` default block
QUANT_BLOCK = 4096
_CODE: np.ndarray | None = None


def _torch_linspace32(start: float, end: float, steps: int) -> np.ndarray:
    """``torch.linspace(start, end, steps, dtype=float32)`` on a CPU, bit for bit: a float32
    step, each half counted from its own end with one rounding per entry."""
    a, b = np.float32(start), np.float32(end)
    step = np.float64((b - a) / np.float32(steps - 1))
    i = np.arange(steps, dtype=np.float64)
    lo = (np.float64(a) + step * i).astype(np.float32)
    hi = (np.float64(b) - step * (steps - 1 - i)).astype(np.float32)
    return np.where(i < steps // 2, lo, hi)


def dynamic_code() -> np.ndarray:
    """bitsandbytes' signed dynamic code book (``create_dynamic_map()``: 7 exponent bits, 8
    in all), 256 ascending float32 values in ``[-1, 1]`` with 0 and 1 among them; the
    traces record bitsandbytes' own to check it."""
    global _CODE
    if _CODE is None:
        data: list[np.ndarray] = []
        for i in range(7):
            bounds = _torch_linspace32(0.1, 1.0, 2 ** i + 1)
            means = (bounds[:-1] + bounds[1:]) / np.float32(2.0)
            scale = np.float32(10.0 ** (-6 + i))
            data += [scale * means, -scale * means]
        data.append(np.array([0.0, 1.0], np.float32))
        _CODE = np.sort(np.concatenate(data).astype(np.float32))
    return _CODE.copy()


def num_blocks(shape: tuple[int, ...]) -> int:
    """How many absmax scales a tensor of ``shape`` has (``ceil(numel / 4096)``)."""
    return -(-math.prod(shape) // QUANT_BLOCK)


#: bitsandbytes' CPU kernel: [-1, 1] in this many bins, each mapped to a code
LUT_SIZE = 65536
_LUT: np.ndarray | None = None


def cpu_lookup_table() -> np.ndarray:
    """bitsandbytes' CPU lookup table (``build_quantize_lut``): bin ``i`` holds the value
    ``-1 + 2i/65535`` (float32) and maps to the number of code-book midpoints below it."""
    global _LUT
    if _LUT is None:
        code = dynamic_code()
        mids = (np.float32(0.5) * (code[:-1] + code[1:])).astype(np.float32)
        i = np.arange(LUT_SIZE).astype(np.float32)
        vals = (np.float32(-1.0) + (np.float32(2.0) * i) / np.float32(LUT_SIZE - 1))
        _LUT = np.searchsorted(mids, vals.astype(np.float32), side="left").astype(np.int32)
    return _LUT.copy()


def quantize(xp: ModuleType, x: Any, rounding: str = "cuda") -> tuple[Any, Any]:
    """``(codes, absmax)`` of float32 ``x``: ``quantize_blockwise(x)`` as bitsandbytes
    computes it on a GPU (``rounding="cuda"``: ``kQuantizeBlockwise`` with ``dQuantize``) or
    on a CPU (``"cpu"``: ``quantize_cpu_impl``).

    ``x`` flattened row-major in blocks of 4096 (the last may be short); per block
    ``absmax = max |x|`` (float32) and ``y = x · (1/absmax)`` in float32. CUDA: each ``y``
    is located in the code book by a 7-step binary search from entry 127, then rounded to
    the nearer neighbour by the float32 midpoint (a tie keeps the search's last entry), so
    the nearest code. CPU: the bin ``⌊((y + 1)·0.5)·65535 + 0.5⌋`` (float32) of
    :func:`cpu_lookup_table`, which for small ``|y|`` (bins 3e-5 wide against codes 1e-6
    apart near 0) is often not the nearest. A block of zeros has absmax 0 and codes 0 (the
    CUDA kernel's NaN path and the CPU kernel agree). Returns uint8 codes of ``x``'s shape
    and float32 absmax of ``(num_blocks,)``.
    """
    shape = tuple(x.shape)
    n, nb = math.prod(shape), num_blocks(shape)
    flat = _astype(xp, x, "float32").reshape(-1)
    if nb * QUANT_BLOCK != n:  # the CUDA kernel loads a short block's missing entries as 0
        pad = arrays.constant(xp, np.zeros(nb * QUANT_BLOCK - n, np.float32), flat)
        flat = arrays.concat(xp, [flat, pad], 0)
    blocks = flat.reshape(nb, QUANT_BLOCK)
    absmax = arrays.amax(xp, xp.abs(blocks), 1)
    nonzero = absmax > 0
    inv = arrays.divide(xp, 1.0, xp.where(nonzero, absmax, xp.ones_like(absmax)))
    y = blocks * arrays.expand_dims(xp, inv, 1)
    q = encode(xp, y, rounding)
    q = xp.where(arrays.expand_dims(xp, nonzero, 1), q, q * 0)
    q = q.reshape(-1)[:n].reshape(shape)
    return _astype(xp, q, "uint8"), absmax


def encode(xp: ModuleType, y: Any, rounding: str = "cuda") -> Any:
    """The code-book index (an integer array of ``y``'s shape) of each float32 ``y = x ·
    (1/absmax of its block)``, as :func:`quantize` picks it (``rounding``): elementwise, so
    a caller that holds part of a tensor and its blocks' absmax encodes that part alone."""
    if rounding == "cpu":
        bins = (arrays.clip(xp, y, -1.0, 1.0) + 1.0) * 0.5 * float(LUT_SIZE - 1) + 0.5
        bins = _astype(xp, bins, "int64" if arrays.is_torch(xp) else "int32")
        lut = arrays.constant(xp, cpu_lookup_table(), bins)
        return xp.take(lut, bins)
    code = arrays.constant(xp, dynamic_code(), y)
    idx = xp.int64 if arrays.is_torch(xp) else xp.int32  # torch.take wants int64
    pivot = xp.full_like(y, 127, dtype=idx)
    lo_p, up_p = pivot * 0, pivot * 0 + 255
    lower, upper = xp.full_like(y, -1.0), xp.full_like(y, 1.0)
    val = xp.take(code, pivot)
    for i in (64, 32, 16, 8, 4, 2, 1):
        gt = y > val
        lo_p, lower = xp.where(gt, pivot, lo_p), xp.where(gt, val, lower)
        up_p, upper = xp.where(gt, up_p, pivot), xp.where(gt, upper, val)
        pivot = xp.where(gt, pivot + i, pivot - i)
        val = xp.take(code, pivot)
    upper = xp.where(up_p == 255, xp.take(code, up_p), upper)
    lower = xp.where(lo_p == 0, xp.take(code, lo_p), lower)
    gt = y > val
    mid_up = (upper + val) * 0.5
    mid_lo = (lower + val) * 0.5
    return xp.where(gt, xp.where(y > mid_up, up_p, pivot), xp.where(y < mid_lo, lo_p, pivot))


def dequantize(xp: ModuleType, codes: Any, absmax: Any) -> Any:
    """``code[q] · absmax`` of its block, float32 (``dequantize_blockwise``)."""
    shape = tuple(codes.shape)
    n = math.prod(shape)
    code = arrays.constant(xp, dynamic_code(), absmax)
    vals = xp.take(code, _astype(xp, codes.reshape(-1), "int64" if arrays.is_torch(xp)
                                 else "int32"))
    scale = xp.repeat(absmax, QUANT_BLOCK) if not arrays.is_torch(xp) else \
        absmax.repeat_interleave(QUANT_BLOCK)
    return (vals * scale[:n]).reshape(shape)


def _astype(xp: ModuleType, x: Any, dtype: str) -> Any:
    if arrays.is_torch(xp):
        return x.to(getattr(xp, dtype))
    return x.astype(getattr(xp, dtype))


# -- one parameter, one update (the oracle; xopt.torch runs it with xp=torch) -------------------


#: ``(quantize, dequantize)`` of the 8-bit moments, each as the functions of that name
#: without ``xp`` (a backend's own, e.g. on tensors split across devices)
Codec = tuple[Callable[[Any, str], tuple[Any, Any]], Callable[[Any, Any], Any]]


def moments_of(xp: ModuleType, hp: COAP, st: Mapping[str, Any],
               codec: Codec | None = None, like: Any = None) -> tuple[Any, Any]:
    """``(M, V)`` (dequantised under ``state_bits=8``: float32, or ``like``'s dtype when
    given, the working dtype of a float64 parameter; a widening, exact); None where
    absent."""
    if hp.state_bits == 8:
        deq = codec[1] if codec else (lambda q, a: dequantize(xp, q, a))
        m, v = deq(st["m_q"], st["m_absmax"]), deq(st["v_q"], st["v_absmax"])
        if like is not None and m.dtype != like.dtype:
            m, v = (x.to(like.dtype) if arrays.is_torch(xp) else x.astype(like.dtype)
                    for x in (m, v))
        return m, v
    return st.get("m"), st.get("v")


def store_moments(xp: ModuleType, hp: COAP, st: dict[str, Any], m: Any, v: Any,
                  codec: Codec | None = None) -> None:
    """Write ``M, V`` into the state (quantised under ``state_bits=8``)."""
    if hp.state_bits == 8:
        qz = codec[0] if codec else (lambda x, r: quantize(xp, x, r))
        st["m_q"], st["m_absmax"] = qz(m, hp.quant_rounding)
        st["v_q"], st["v_absmax"] = qz(v, hp.quant_rounding)
    else:
        st["m"], st["v"] = m, v


def low_dtype(shape: tuple[int, ...], hp: COAP, param_dtype: Any, state_dtype: Any) -> Any:
    """The dtype of a parameter's projections when not the state's: the parameter's, for a
    projected bfloat16/float16 matrix under ``proj_dtype="param"``
    (:func:`xopt.specs.lowrank.product_dtype`); None otherwise (kernels' Tucker products
    always run in the state's dtype)."""
    if not is_projected(shape, hp) or side_of(shape) == "tucker":
        return None
    return lowrank.product_dtype(hp.proj_dtype, param_dtype, state_dtype)


def param_step(xp: ModuleType, hp: COAP, p: Any, g: Any, st: dict[str, Any], t: int, *,
               inject: Mapping[str, Any] | None = None, aux: dict[str, Any] | None = None,
               omega: Callable[[], Any] | None = None,
               qr: Callable[[Any], tuple[Any, Any]] | None = None,
               svd: Callable[[Any], tuple[Any, Any, Any]] | None = None,
               codec: Codec | None = None) -> tuple[Any, dict[str, Any]]:
    """One COAP update of one parameter, in the authors' order of operations.

    Args:
      p, g: parameter and gradient, one shape, the working float dtype; under
        ``proj_dtype="param"`` a projected matrix's ``p`` in its own narrow dtype
        (:func:`low_dtype`; the step's products and its update run there, the events and
        moments in the state's dtype, ``g`` in either).
      st: this parameter's state by canonical variable (``m``, ``v``, ``v_row``, ``v_col``,
        ``rms``, ``P``, ``P_in``, ``m_q``, ``m_absmax``, ``v_q``, ``v_absmax``; those that
        exist for it, see :data:`STATE`).
      t: updates taken before this one (a Python int).
      inject: ``{"ortho_matrix": P}`` (a kernel: and ``"ortho_matrix_in"``): at an event
        that decomposes (1, 3), the new ``P`` to use instead of computing it (an original's
        recorded projection).
      aux: receives internals by the traces' aux names (without the parameter prefix).
      omega: draws the initial Ω (default :func:`initial_omega` under NumPy).
      qr, svd: decompositions for Eqn 7 and Tucker (see :func:`orthogonal_basis`).
      codec: the 8-bit moments' :func:`quantize` and :func:`dequantize` (default: those).
    Returns:
      ``(new p, new st)``.
    """
    shape = tuple(p.shape)
    st = dict(st)
    eight = hp.state_bits == 8
    projected = is_projected(shape, hp)
    sdt = projection_of(st, shape).dtype if projected and side_of(shape) != "tucker" else None
    low = low_dtype(shape, hp, p.dtype, sdt) if sdt is not None else None
    if low is not None:
        g = lowrank.astype(g, sdt)  # the events run in the state's dtype (exact)
    m_cur, v_cur = moments_of(xp, hp, st, codec, like=g)
    r = g
    side = side_of(shape) if projected else None
    if projected:
        p_old = projection_of(st, shape)
        carried = carried_of(st, shape, hp)
        ev = event(t, hp)
        if ev == EQN6:
            sub = {} if aux is not None else None
            m6 = eqn6_moment(xp, hp, m_cur, g, p_old, side)
            if side == "tucker":
                p_new, clipped = tucker_eqn6_step(xp, p_old, m6, g, hp.proj_lr,
                                                  hp.proj_max_norm, carried, sub)
                carried = clipped if carried is not None else None
            else:
                p_new = eqn6_step(xp, p_old, m6, g, side, hp.proj_lr, hp.proj_max_norm, sub)
            if aux is not None:
                aux.update(sub)
        else:  # events 1 and 3 decompose (or take the original's P, injected); else P is kept
            p_new = lowrank.refresh(
                ev in (INITIAL, EQN7), p_old,
                lambda: new_projection(xp, hp, shape, g, p_old, ev, omega=omega, qr=qr,
                                       svd=svd),
                injected_projection(inject, side))
            if carried is not None and ev != KEEP:  # fresh factors carry no gradient
                carried = tuple(c * 0 for c in carried)
        store_carried(st, carried)
        if ev in (EQN6, EQN7) and hp.restore_state:
            m_cur, v = restore_moments(xp, hp, m_cur, v_cur, p_old, p_new, side)
            if hp.optimizer == "adamw":
                v_cur = v
            if eight:  # the authors store the carried moments quantised, then read them back
                store_moments(xp, hp, st, m_cur, v_cur, codec)
                m_cur, v_cur = moments_of(xp, hp, st, codec, like=g)
            if aux is not None:
                if m_cur is not None:
                    aux["restored_exp_avg"] = m_cur
                if hp.optimizer == "adamw":
                    aux["restored_exp_avg_sq"] = v_cur
        store_projection(st, p_new, shape)
        if low is None:
            r = project(xp, g, p_new, side)
        else:
            r = lowrank.astype(project(xp, lowrank.astype(g, low),
                                       lowrank.astype(p_new, low), side), sdt)
        if aux is not None:
            aux["proj_event"] = np.int8(ev)
            aux["low_rank_grad"] = r
    count = t + 1
    if hp.optimizer == "adamw":
        m_cur, v_cur = lowrank.hf_adam_moments(xp, m_cur, v_cur, r, hp.b1, hp.b2)
        n = lowrank.hf_adam_direction(xp, m_cur, v_cur, hp.eps)
        step_size = lowrank.hf_step_size(hp.lr, hp.b1, hp.b2, count, hp.correct_bias)
        if low is not None:
            n = lowrank.astype(n, low)
            full = project_back(xp, n, lowrank.astype(projection_of(st, shape), low), side,
                                hp.scale)
        else:
            full = project_back(xp, n, projection_of(st, shape), side, hp.scale) \
                if projected else n
        store_moments(xp, hp, st, m_cur, v_cur, codec)
        if aux is not None and projected:
            aux["update_full"] = full
        if low is not None:
            return lowrank.hf_apply_low(p, full, step_size, hp.lr, hp.weight_decay), st
        return lowrank.hf_apply(p, full, step_size, hp.lr, hp.weight_decay), st
    st["m"], st["v"] = m_cur, v_cur
    st["rms"] = rms(xp, p)
    lr_t = adafactor_lr(hp, count, st["rms"], xp)
    beta2t = adafactor_beta2(hp, count)
    u, st["v"], st["v_row"], st["v_col"] = adafactor_direction(
        xp, hp, r, st.get("v"), st.get("v_row"), st.get("v_col"), beta2t)
    u = u * lr_t
    if has_first_moment(hp):
        st["m"] = st["m"] * hp.b1 + u * (1.0 - hp.b1)
        u = st["m"]
    full = project_back(xp, u, projection_of(st, shape), side, hp.scale) if projected else u
    if aux is not None and projected:
        aux["update_full"] = full
    if hp.weight_decay != 0:
        p = p + p * (-hp.weight_decay * lr_t)
    return p - full, {k: v for k, v in st.items() if v is not None}


# -- the whole optimizer as a pure function (the oracle's definition) ---------------------------


def _state_of(state: Mapping[str, Any], name: str) -> dict[str, Any]:
    out = {}
    for var in VARS:
        key = f"{var}/{name}"
        if key in state:
            out[var] = state[key]
    return out


def init_state(hp: COAP | ParamGroups, params: Mapping[str, Any], *, xp: ModuleType = np,
               dtype: Any = None) -> dict[str, Any]:
    """Canonical state before the first update: ``step`` 0, zero moments, ``P`` zero (it is
    computed at update 0), ``rms`` 0. ``dtype``: of the float state (default: the
    parameter's, at least float32)."""
    state: dict[str, Any] = {"step": np.int64(0)}
    for name, p in params.items():
        shape = tuple(np.shape(p))
        h = hp_for(hp, name)
        check_param(shape, h, f"COAP: {name}")
        dt = dtype or np.promote_types(np.asarray(p).dtype, np.float32)
        for v in STATE.vars:
            if v.scope == "param" and v.exists_for(shape, h):
                vdt = dt if v.dtype == "state" else getattr(xp, v.dtype)
                state[f"{v.name}/{name}"] = xp.zeros(v.shape(shape, h), dtype=vdt)
    return state


def step(hp: COAP | ParamGroups, params: Mapping[str, Any], state: Mapping[str, Any],
         grads: Mapping[str, Any], *, xp: ModuleType = np, loss: Any = None,
         inject: Mapping[str, Mapping[str, Any]] | None = None,
         aux: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every parameter's COAP update: ``(params, state) -> (params, state)``, pure.

    ``inject``: ``{param name: {"ortho_matrix": P}}`` (see :func:`param_step`); ``aux``
    receives ``"<param>/<internal>"`` entries named as the golden traces' aux; ``loss`` is
    unused.
    """
    del loss
    inject = inject or {}
    t = int(state["step"])
    new_params: dict[str, Any] = {}
    new_state: dict[str, Any] = {"step": np.int64(t + 1)}
    for name, p in params.items():
        h = hp_for(hp, name)
        check_param(tuple(np.shape(p)), h, f"COAP: {name}")
        sub = {} if aux is not None else None
        new_params[name], st = param_step(xp, h, p, grads[name], _state_of(state, name), t,
                                          inject=inject.get(name), aux=sub)
        for var, value in st.items():
            new_state[f"{var}/{name}"] = value
        if aux is not None:
            aux.update({f"{name}/{k}": v for k, v in sub.items()})
    return new_params, new_state


#: a parameter's state variables (canonical names)
VARS = ("m", "v", "v_row", "v_col", "rms", "P", "P_in", "P_grad", "P_in_grad", "m_q",
        "m_absmax", "v_q", "v_absmax")


# -- state schema --------------------------------------------------------------------------------


def _moment_shape(shape: tuple[int, ...], hp: COAP) -> tuple[int, ...]:
    return low_rank_shape(shape, hp)


def _row_shape(shape: tuple[int, ...], hp: COAP) -> tuple[int, ...]:
    return low_rank_shape(shape, hp)[:-1]


def _col_shape(shape: tuple[int, ...], hp: COAP) -> tuple[int, ...]:
    s = low_rank_shape(shape, hp)
    return s[:-2] + s[-1:]


def _any(pred: Callable[[COAP], bool]) -> Callable[[Any], bool]:
    return lambda hp: any(pred(h) for h in all_hps(hp))


def _full_precision(h: COAP) -> bool:
    return h.state_bits == 32


def _eight_bit(h: COAP) -> bool:
    return h.state_bits == 8


def _blocks_shape(shape: tuple[int, ...], hp: COAP) -> tuple[int, ...]:
    return (num_blocks(low_rank_shape(shape, hp)),)



STATE = StateSchema(
    vars=(
        StateVar("step", "global", scalar, "int64", "updates taken, t (the authors keep one "
                 "per parameter; all agree)"),
        StateVar("m", "param", _moment_shape, "state",
                 "first moment M (low-rank shape when projected); Adafactor: an EMA of the "
                 "lr-scaled clipped updates",
                 active=_any(lambda h: has_first_moment(h) and _full_precision(h)),
                 applies=lambda s, hp: has_first_moment(hp) and _full_precision(hp)),
        StateVar("v", "param", _moment_shape, "state",
                 "second moment: AdamW's v (uncorrected); Adafactor's unfactored v of tensors "
                 "of fewer than 2 dims",
                 active=_any(_full_precision),
                 applies=lambda s, hp: _full_precision(hp) and (hp.optimizer == "adamw"
                                                                or len(s) < 2)),
        StateVar("m_q", "param", _moment_shape, "uint8",
                 "(state_bits=8) M as bitsandbytes' blockwise dynamic codes",
                 active=_any(_eight_bit), applies=lambda s, hp: _eight_bit(hp)),
        StateVar("m_absmax", "param", _blocks_shape, "float32",
                 "(state_bits=8) M's absmax per block of 4096",
                 active=_any(_eight_bit), applies=lambda s, hp: _eight_bit(hp)),
        StateVar("v_q", "param", _moment_shape, "uint8",
                 "(state_bits=8) AdamW's v as blockwise dynamic codes",
                 active=_any(_eight_bit), applies=lambda s, hp: _eight_bit(hp)),
        StateVar("v_absmax", "param", _blocks_shape, "float32",
                 "(state_bits=8) v's absmax per block of 4096",
                 active=_any(_eight_bit), applies=lambda s, hp: _eight_bit(hp)),
        StateVar("v_row", "param", _row_shape, "state",
                 "(Adafactor) factored second moment, row statistics of R² + ε₁",
                 active=_any(lambda h: h.optimizer == "adafactor"),
                 applies=lambda s, hp: hp.optimizer == "adafactor" and len(s) >= 2),
        StateVar("v_col", "param", _col_shape, "state",
                 "(Adafactor) factored second moment, column statistics",
                 active=_any(lambda h: h.optimizer == "adafactor"),
                 applies=lambda s, hp: hp.optimizer == "adafactor" and len(s) >= 2),
        StateVar("rms", "param", scalar, "state",
                 "(Adafactor) RMS of the parameter before the last update (lr_t's scale)",
                 active=_any(lambda h: h.optimizer == "adafactor"),
                 applies=lambda s, hp: hp.optimizer == "adafactor"),
        StateVar("P", "param", proj_shape, "state",
                 "projection P: (r, n) right, (m, r) left, a kernel's U₀ (O, r₀); "
                 "orthonormal after a decomposition, not re-orthonormalised after Eqn 6",
                 applies=is_projected),
        StateVar("P_grad", "param", proj_shape, "state",
                 "(kernels, carry_factor_grad) U₀'s clipped Eqn-6 gradient since the last "
                 "decomposition (TuckerCOAP's ortho_matrix[0].grad)",
                 active=_any(lambda h: h.rank_ratio_cnn is not None and h.carry_factor_grad),
                 applies=carries_grad),
        StateVar("P_in_grad", "param", proj_in_shape, "state",
                 "(kernels, carry_factor_grad) U₁'s, likewise",
                 active=_any(lambda h: h.rank_ratio_cnn is not None and h.carry_factor_grad),
                 applies=lambda s, hp: carries_grad(s, hp) and has_proj_in(s, hp)),
        StateVar("P_in", "param", proj_in_shape, "state",
                 "a Tucker-2 kernel's input-channel factor U₁ (I, r₁)",
                 active=_any(lambda h: h.rank_ratio_cnn is not None), applies=has_proj_in),
    ),
    namings={
        "xopt.torch": Naming(
            keys={"step": "{param}/step", "m": "{param}/exp_avg", "v": "{param}/exp_avg_sq",
                  "v_row": "{param}/exp_avg_sq_row", "v_col": "{param}/exp_avg_sq_col",
                  "rms": "{param}/RMS", "P": "{param}/ortho_matrix",
                  "P_in": "{param}/ortho_matrix_in", "P_grad": "{param}/ortho_matrix_grad",
                  "P_in_grad": "{param}/ortho_matrix_in_grad",
                  "m_q": "{param}/exp_avg_codes",
                  "m_absmax": "{param}/exp_avg_absmax", "v_q": "{param}/exp_avg_sq_codes",
                  "v_absmax": "{param}/exp_avg_sq_absmax"},
            dtypes={"step": "int64"},
            doc="xopt.torch.COAP: optimizer.state[param][key] (tensors only)",
        ),
        "xopt.jax": Naming(
            keys={"step": "count", "m": "mu/{param}", "v": "nu/{param}",
                  "v_row": "nu_row/{param}", "v_col": "nu_col/{param}", "rms": "rms/{param}",
                  "P": "proj/{param}", "P_in": "proj_in/{param}",
                  "P_grad": "proj_grad/{param}", "P_in_grad": "proj_in_grad/{param}",
                  "m_q": "mu_codes/{param}",
                  "m_absmax": "mu_absmax/{param}", "v_q": "nu_codes/{param}",
                  "v_absmax": "nu_absmax/{param}"},
            dtypes={"step": "int32"},
            doc="xopt.jax.coap: COAPState(count, mu, nu, nu_row, nu_col, rms, proj, proj_in, "
                "proj_grad, proj_in_grad, mu_codes, mu_absmax, nu_codes, nu_absmax)",
        ),
    },
)


SPEC = MethodSpec(
    name="coap",
    title="COAP: low-rank AdamW/Adafactor with a correlation-aware projection (Eqn 6/7)",
    hyperparams=COAP,
    presets=PRESETS,
    state=STATE,
    init_state=init_state,
    step=step,
    naming_of={"torch": "xopt.torch", "jax": "xopt.jax"},
)
