"""VeLO (Metz et al., 2022): learned_optimization's ``HyperV2`` in VeLO's configuration.

VeLO is a *learned* optimizer: a per-tensor LSTM reads a 30-number summary of every
parameter tensor (its momenta and second moments, the training progress, the loss
history) and emits, for each tensor, 256 "controls" and a learning-rate multiplier. The
controls mix a bank of 256 tiny MLPs into one MLP per tensor (a hypernetwork), and that MLP
maps 30 features of every parameter element to its step. The original is
``learned_optimization/research/general_lopt/hyper_v2.py`` (class ``HyperV2``, commit
32186aa), with ``learned_optimizers/common.py`` for the accumulators; VeLO is
``HyperV2(lstm_hidden_size=512, param_inits=256, use_bugged_loss_features=False)``
(``research/general_lopt/pretrained_optimizers.py``) wrapped by ``prefab.LearnedOptimizer``
(``research/general_lopt/prefab.py``), which adds weight decay and gradient accumulation.

One update, for parameters θ with gradients g and loss ℓ (the original's order)::

    loss buffer  ← update(loss buffer, ℓ)                   10 EMAs of ℓ, clipped to 2·|max|
    g            ← clip(g, −1000, 1000)
    x_T          ← lstm_features(θ_T, m_T, rms_T, t/N, loss features)    (30,) per tensor T,
                                                             from the *previous* m and rms
    controls, s, (h, c) ← LSTM(stack_T x_T, (h, c))          (n_T, 256), (n_T,)
    m, rms, fac  ← accumulators(g)                           3 momenta, 1 rms, Adafactor ×3
    W_T          ← 100 · mean_k(controls_T[k] · bank[k])     one MLP per tensor
    d, μ         ← MLP_T(normalised features of θ_T, g_T, m_T, rms_T, fac_T)   per element
    θ_T          ← θ_T − s_T · d · (sqrt(mean θ_T² + 1e-9) · exp(0.001·μ)) · 0.001

Everything here is a pure function over the array namespace ``xp`` (NumPy, torch or
jax.numpy), one tensor at a time where the original is per tensor (so a backend can stream
tensors and bound its extra memory by the largest tensor), float32 in the backends and
float64 in the NumPy oracle. Departures of PyLO's VeLO port that xopt does *not* copy:
PyLO's ``factored_dims`` swaps the two axes for square matrices; PyLO normalises rank-0
parameters over all axes of the expanded tensor and its default learning rate is 1e-3
(a multiplier: the original's step is lr = 1).

Floating point. The original runs jitted in float32, and XLA's CPU compiler rounds in its
own ways; where a difference of one ulp is amplified, the functions here follow XLA:
  * ``1 − βᵗ`` in the loss buffer cancels (β = 0.9 … 0.999), so one ulp of ``βᵗ`` is 1e-4
    relative in the bias correction. XLA's float32 ``pow`` is correctly rounded in all but 2
    of 2,000 cases checked, NumPy's float32 ``power`` in 81% of them: NumPy and torch take
    ``βᵗ`` in float64 and round once (:func:`decay_power`), jax uses XLA's ``pow``.
  * the loss features are ratios of small differences of the loss EMAs, whose update
    ``m·β + ℓ·(1 − β)`` XLA evaluates as one fused multiply-add: so does
    :func:`xopt.specs.arrays.fma` under NumPy and torch. Exact (float64) arithmetic moves the
    features by up to 1.9e-4 (absolute) from the original's float32 ones at the first
    update that has them, which moves the oracle's LSTM state by ~5e-5 relative.
  * ``tanh`` (fraction embedding, LSTM) is XLA's rational approximation, reproduced bit for
    bit by :func:`xopt.specs.arrays.tanh` (torch's own differs in half of all inputs).
  * XLA turns a division by a constant into a product with the float32 reciprocal (the
    accumulated gradient's mean, :func:`xopt.specs.lopt.outer_step`); the horizon
    ``num_steps`` is a runtime value in the original, so ``t / N`` stays a division.
  * the loss-buffer decays ``exp(−1/logspace(1, log10 N, 10))``: XLA's float32 evaluation is
    within 1 ulp of the float64 value rounded once, and equal to it for 77% of horizons N
    (N = 2 … 200,000); xopt rounds the float64 value (:func:`loss_buffer_decays`), and
    state restored from the original's carries the original's bits.
  * the per-element MLP's first layer adds the 14 groups' products one after another, as
    the original's unrolled loop does.
What remains is summation order: XLA sums the LSTM's 1024-term products (YNNPACK) and the
means over 256 MLPs in its own order. From the same inputs the exact LSTM state is up to
1.4e-6 (relative to a row's largest element) away from the original's float32 one, torch's
up to 1.1e-6; jax's, compiled by XLA from the same operations, matches it bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from xopt.errors import MetaParamsError
from xopt.specs import arrays, lopt
from xopt.specs._hyperparams import Interval, hp
from xopt.specs._method import MetaParams, MethodSpec
from xopt.specs._state import Naming, StateSchema, StateVar, same_as_param, scalar
from xopt.specs.lopt import LOptOptions

# -- hyperparameters ---------------------------------------------------------------------------

# HyperV2's constructor arguments whose value VeLO fixes: any other value is an ablation
# xopt does not implement (hyper_v2.py, HyperV2.__init__; VeLO's values are the defaults
# except where pretrained_optimizers.py sets them).
VELO_FIXED: dict[str, Any] = {
    "mix_layers": True, "validation_mode": False, "with_validation_feature_dim": False,
    "with_g": True, "with_m": True, "with_m_feat": True, "with_rms": True,
    "with_rms_feat": True, "with_rms_norm_g": True, "with_rsqrt_rms": True, "with_p": True,
    "with_fac_norm_g": True, "with_fac_rms": True, "with_fac_rsqrt": True,
    "with_grad_clip_feat": True, "with_fac_mom_mult": True, "with_rms_only_norm_g": True,
    "adafactor_accumulator": True, "param_scale_mult": True,
    "use_bugged_next_lstm_state": False, "precondition_output": False,
    "rnn_state_decay": 0.0, "constant_loss": False, "clip_param_scale_amount": None,
}

_DECAY_RANGE = Interval(0.0, 1.0, hi_closed=False)
_DECAY_FIELDS = {"initial_momentum_decays": 3, "initial_rms_decays": 1,
                 "initial_adafactor_decays": 3}
_POSITIVE_INT = Interval(1, None)


@dataclasses.dataclass(frozen=True)
class VeLO(LOptOptions):
    """VeLO's hyperparameters: HyperV2's architecture as VeLO configures it, plus the
    options shared by xopt's learned optimizers (:class:`xopt.specs.lopt.LOptOptions`:
    ``num_training_steps``, ``lr``, ``weight_decay``, ``weight_decay_mode``,
    ``max_training_steps``, which reproduce ``prefab.LearnedOptimizer``'s wrappers).

    Defaults are HyperV2's (hyper_v2.py, ``HyperV2.__init__``) except three that VeLO sets
    (pretrained_optimizers.py): ``lstm_hidden_size`` 512 (HyperV2: 128), ``param_inits``
    256 (HyperV2: 64) and ``use_bugged_loss_features`` False (HyperV2: True). The sizes must
    match the meta-parameters. HyperV2's ablation flags are not fields: VeLO's values are
    the only ones implemented (:data:`VELO_FIXED`; the harness's adapter to HyperV2,
    :mod:`xopt.parity.methods.velo`, rejects others, naming the flag). The feature layout
    needs 3 momentum, 1 rms and 3 Adafactor decays; their values may change.
    """

    METHOD = "velo"

    lstm_hidden_size: int = hp(512, doc="per-tensor LSTM width H", interval=_POSITIVE_INT)
    param_inits: int = hp(256, doc="MLPs in the hypernetwork's bank", interval=_POSITIVE_INT)
    ff_hidden_size: int = hp(4, doc="width of the per-element MLP", interval=_POSITIVE_INT)
    ff_hidden_layers: int = hp(2, doc="hidden layers of the per-element MLP",
                               interval=_POSITIVE_INT)
    initial_momentum_decays: tuple[float, ...] = hp((0.9, 0.99, 0.999),
                                                    doc="momentum decays (3)")
    initial_rms_decays: tuple[float, ...] = hp((0.999,), doc="second-moment decay (1)")
    initial_adafactor_decays: tuple[float, ...] = hp((0.9, 0.99, 0.999),
                                                     doc="Adafactor decays (3)")
    exp_mult: float = hp(0.001, doc="scale of the magnitude output inside exp()")
    step_mult: float = hp(0.001, doc="scale of the step")
    use_bugged_loss_features: bool = hp(
        False, doc="size the loss buffer for 10 steps whatever the horizon (HyperV2's "
        "default True reproduces old checkpoints; VeLO: False)")

    def __post_init__(self) -> None:
        for name in _DECAY_FIELDS:
            value = getattr(self, name)
            try:
                value = tuple(float(x) for x in value)
            except (TypeError, ValueError):
                raise self._fail(name, value, "must be a sequence of numbers") from None
            object.__setattr__(self, name, value)
        super().__post_init__()

    def _check_combinations(self) -> None:
        super()._check_combinations()
        for name, n in _DECAY_FIELDS.items():
            value = getattr(self, name)
            if len(value) != n:
                raise self._fail(name, value, f"must hold {n} decay{'s' * (n > 1)}: VeLO's "
                                 "features are laid out for 3 momenta, 1 second moment and 3 "
                                 "Adafactor accumulators")
            for d in value:
                if d not in _DECAY_RANGE:
                    raise self._fail(name, value, f"every decay must be in {_DECAY_RANGE}")

    @property
    def loss_horizon(self) -> int:
        """The horizon of the loss buffer's half-lives: the inner horizon, or 10 with
        ``use_bugged_loss_features`` (``HyperV2.opt_fn.init``)."""
        return 10 if self.use_bugged_loss_features else self.inner_num_steps


PRESETS: dict[str, dict[str, Any]] = {
    # HyperV2(lstm_hidden_size=512, param_inits=256, use_bugged_loss_features=False), the
    # configuration of every released VeLO checkpoint (pretrained_optimizers.py).
    "original": dict(lstm_hidden_size=512, param_inits=256, ff_hidden_size=4,
                     ff_hidden_layers=2, initial_momentum_decays=(0.9, 0.99, 0.999),
                     initial_rms_decays=(0.999,), initial_adafactor_decays=(0.9, 0.99, 0.999),
                     exp_mult=0.001, step_mult=0.001, use_bugged_loss_features=False),
}


# -- constants of the architecture -----------------------------------------------------------

#: timescales of the fraction-of-training embedding tanh(10·(t/N − τ)) (``_fractional_tanh_embed``)
FRACTION_TIMESCALES = (0.03, 0.1, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.1)
#: number of loss-buffer EMAs (``BufferLossAccumulators.init``)
NUM_LOSS_DECAYS = 10
#: gradients are clipped to ±GRAD_CLIP before anything else (``opt_fn.update``)
GRAD_CLIP = 1000.0
#: per-tensor LSTM inputs: fraction_left 9, loss_features 9, mean_rms 1, rank 5, var_m 3,
#: var_rms 3 (the original concatenates its feature dict in sorted key order)
NUM_LSTM_FEATURES = 30
#: per-element MLP input groups, in the original's order (``_ff_mod``):
#: g, clip(g), p, m(3), rms(1), m·rsqrt(rms)(3), rsqrt(rms)(1), fac_g(3), g·rsqrt(rms)(1),
#: row(3), col(3), rsqrt(row)(3), rsqrt(col)(3), m·row_factor·col_factor(3)
MLP_GROUP_SIZES = (1, 1, 1, 3, 1, 3, 1, 3, 1, 3, 3, 3, 3, 3)
NUM_MLP_FEATURES = sum(MLP_GROUP_SIZES)  # 30
#: MLP outputs: direction, magnitude, and a third the step ignores
NUM_MLP_OUTPUTS = 3
#: rank one-hot width: ranks (number of dims > 1) 0..4; 5 or more gives all zeros
NUM_RANKS = 5


# -- meta-parameters θ ---------------------------------------------------------------------------
#
# xopt's names (left) and the original's (right; pytree paths of HyperV2.init's output):
#   lstm/init_hidden, lstm/init_cell  (H,)        lstm_init_state/hidden, /cell  (1, H)
#   lstm/mix0/w|b      (30, H), (H,)              rnn_params/linear/w|b   (computed, unused)
#   lstm/mix1/w|b      (30, H), (H,)              rnn_params/linear_1/w|b (max-pooled)
#   lstm/input/w|b     (30, H), (H,)              rnn_params/linear_2/w|b
#   lstm/gates/w|b     (2H, 4H), (4H,)            rnn_params/rnn/linear/w|b  (haiku LSTM)
#   lstm/to_controls/w|b (H, P), (P,)             rnn_params/rnn_to_controls/w|b
#   lstm/step_size/w|b (H, 1), (1,)               rnn_params/step_size/w|b
#   mlp_bank/w0        (P, 30, F)                 ff_mod_stack/~/w0__0 … w0__13 (P, k_i, F),
#                                                 concatenated on axis 1 in numeric order
#   mlp_bank/b0, w1, b1, …, w_L (P, F, 3), b_L (P, 3)    ff_mod_stack/~/b0, w1, b1, …
# The LSTM's input is the H-wide mixing output, so its gate matrix is (H + H, 4H).

_LSTM_LINEARS = {"mix0": "linear", "mix1": "linear_1", "input": "linear_2",
                 "gates": "rnn/linear", "to_controls": "rnn_to_controls",
                 "step_size": "step_size"}


def meta_shapes(hp: VeLO) -> dict[str, tuple[int, ...]]:
    """``{canonical name: shape}`` of θ for these hyperparameters."""
    h, p, f = hp.lstm_hidden_size, hp.param_inits, hp.ff_hidden_size
    n_in = NUM_LSTM_FEATURES
    out: dict[str, tuple[int, ...]] = {"lstm/init_hidden": (h,), "lstm/init_cell": (h,)}
    for name, (fan_in, fan_out) in {"mix0": (n_in, h), "mix1": (n_in, h), "input": (n_in, h),
                                    "gates": (2 * h, 4 * h), "to_controls": (h, p),
                                    "step_size": (h, 1)}.items():
        out[f"lstm/{name}/w"] = (fan_in, fan_out)
        out[f"lstm/{name}/b"] = (fan_out,)
    sizes = [NUM_MLP_FEATURES] + [f] * hp.ff_hidden_layers + [NUM_MLP_OUTPUTS]
    for i in range(len(sizes) - 1):
        out[f"mlp_bank/w{i}"] = (p, sizes[i], sizes[i + 1])
        out[f"mlp_bank/b{i}"] = (p, sizes[i + 1])
    return out


def original_meta_shapes(hp: VeLO) -> dict[str, tuple[int, ...]]:
    """``{original name: shape}`` of θ (the keys of learned_optimization's θ pytree)."""
    shapes = meta_shapes(hp)
    out: dict[str, tuple[int, ...]] = {}
    for canon, shape in shapes.items():
        for orig, oshape in _to_original_names(canon, shape):
            out[orig] = oshape
    return out


def _to_original_names(canon: str, shape: tuple[int, ...]) -> list[tuple[str, tuple]]:
    if canon in ("lstm/init_hidden", "lstm/init_cell"):
        return [(f"lstm_init_state/{canon.split('_')[-1]}", (1,) + shape)]
    if canon.startswith("lstm/"):
        _, layer, wb = canon.split("/")
        return [(f"rnn_params/{_LSTM_LINEARS[layer]}/{wb}", shape)]
    leaf = canon.split("/")[1]
    if leaf == "w0":
        return [(f"ff_mod_stack/~/w0__{i}", (shape[0], k, shape[2]))
                for i, k in enumerate(MLP_GROUP_SIZES)]
    return [(f"ff_mod_stack/~/{leaf}", shape)]


def meta_from_original(theta: Mapping[str, Any], hp: VeLO) -> dict[str, Any]:
    """θ in learned_optimization's naming → xopt's; strict (:class:`MetaParamsError` naming
    a missing, unexpected or misshaped key). Arrays keep their kind (NumPy, torch or jax):
    reshapes and one concatenation (the 14 first-layer arrays into ``mlp_bank/w0``)."""
    lopt.check_meta(theta, original_meta_shapes(hp), "VeLO meta-parameters (original naming)")
    out: dict[str, Any] = {}
    for canon, shape in meta_shapes(hp).items():
        pieces = [theta[o] for o, _ in _to_original_names(canon, shape)]
        if len(pieces) == 1:
            out[canon] = pieces[0].reshape(shape)
        else:
            out[canon] = arrays.concat(arrays.namespace(pieces[0]), list(pieces), axis=1)
    return out


def meta_to_original(theta: Mapping[str, Any], hp: VeLO) -> dict[str, Any]:
    """θ in xopt's naming → learned_optimization's (the keys of its meta npz files);
    strict."""
    lopt.check_meta(theta, meta_shapes(hp), "VeLO meta-parameters")
    out: dict[str, Any] = {}
    for canon, shape in meta_shapes(hp).items():
        names = _to_original_names(canon, shape)
        if len(names) == 1:
            out[names[0][0]] = theta[canon].reshape(names[0][1])
            continue
        start = 0
        for orig, oshape in names:
            out[orig] = theta[canon][:, start:start + oshape[1]]
            start += oshape[1]
    return out


_ORIGINAL_PREFIXES = ("rnn_params/", "ff_mod_stack/", "lstm_init_state/")


def coerce_meta(theta: Mapping[str, Any], hp: VeLO) -> dict[str, Any]:
    """θ in either naming (told apart by the keys) → xopt's; strict. A mapping mixing both
    namings, or holding neither, is a :class:`MetaParamsError`."""
    where = "VeLO meta-parameters"
    if theta is None:
        raise MetaParamsError(f"{where}: none given (VeLO needs its trained weights θ)")
    if not isinstance(theta, Mapping):
        raise MetaParamsError(f"{where}: must be a mapping of arrays, got "
                              f"{type(theta).__name__}")
    shapes = meta_shapes(hp)
    original = [k for k in theta if k.startswith(_ORIGINAL_PREFIXES)]
    ours = [k for k in theta if k in shapes]
    if original and ours:
        raise MetaParamsError(f"{where}: keys mix xopt names ({', '.join(ours[:3])}, ...) and "
                              f"original names ({', '.join(original[:3])}, ...)")
    if original:
        return meta_from_original(theta, hp)
    lopt.check_meta(theta, shapes, where)
    return {k: theta[k] for k in shapes}


def meta_init(hp: VeLO, seed: int = 0, *, backend: str = "numpy") -> dict[str, Any]:
    """A fresh (untrained) θ, float32, in xopt's naming, with the same bits for ``backend``
    numpy, torch and jax: every weight truncated-normal (±2σ) with σ = 1/sqrt(fan-in)
    (haiku Linear's default init; the bank's first layer has fan-in 30, as in HyperV2.init)
    drawn from :mod:`xopt.random` with seed ``fold_in(seed, i)`` for the i-th name of
    :func:`meta_shapes`; biases and the initial LSTM state zero. As HyperV2.init in
    distribution, not in bits (those are jax.random's). An untrained VeLO takes tiny steps;
    load trained weights for real use."""
    from xopt import random as xr

    out: dict[str, Any] = {}
    for i, (name, shape) in enumerate(meta_shapes(hp).items()):
        leaf = name.rsplit("/", 1)[-1]
        if leaf.startswith("w"):
            out[name] = lopt.truncated_normal(xr.fold_in(int(seed), i), shape,
                                               1.0 / np.sqrt(shape[-2]), backend=backend)
        else:
            out[name] = lopt.zeros(backend, shape)
    return out


#: θ's names, shapes and conversions, as the harness and the backends read them
META = MetaParams(shapes=meta_shapes, from_original=meta_from_original,
                  to_original=meta_to_original, init=meta_init, coerce=coerce_meta)


# -- small helpers over xp --------------------------------------------------------------------


def _is_jax(xp: ModuleType) -> bool:
    return xp.__name__.startswith("jax")


def _square(x: Any) -> Any:
    return x * x


def decay_power(xp: ModuleType, decays: Any, t: Any) -> Any:
    """``decays ** t`` for an integer step ``t`` (a Python int or an integer 0-d array).

    jax: XLA's float32 ``pow`` of the converted step, exactly the original's operation.
    NumPy and torch: the power in float64, rounded once to ``decays``' dtype (XLA's float32
    ``pow`` is correctly rounded nearly everywhere; NumPy's and torch's float32 ``pow`` are
    not, and ``1 − βᵗ`` amplifies an ulp of ``βᵗ`` by 1/(1 − β)).
    """
    if _is_jax(xp):
        return decays ** t
    if arrays.is_torch(xp):
        tt = t if isinstance(t, int) else t.to(xp.float64)
        return xp.pow(decays.to(xp.float64), tt).to(decays.dtype)
    d = np.asarray(decays)
    return np.power(d.astype(np.float64), np.float64(t)).astype(d.dtype)


def _one_hot(xp: ModuleType, index: int, n: int, like: Any) -> Any:
    """``jax.nn.one_hot(index, n)`` for a static index (all zeros when out of range)."""
    row = np.zeros((n,), dtype=np.float64)
    if 0 <= index < n:
        row[index] = 1.0
    return _as_array(xp, row, like)


def _as_array(xp: ModuleType, values: Any, like: Any) -> Any:
    """A constant array in ``like``'s namespace, dtype and device."""
    return arrays.constant(xp, values, like)


# -- loss buffer (``BufferLossAccumulators``) -------------------------------------------------


def loss_buffer_decays(num_steps: int, *, dtype: Any = np.float32) -> np.ndarray:
    """``exp(−1 / logspace(1, log10(num_steps), 10))``, shape (10,), NumPy.

    ``BufferLossAccumulators.init``: half-lives from 10 steps to the horizon. Computed in
    float64 and rounded once to ``dtype`` (see the module docstring for how that relates
    to the original's float32 evaluation). ``use_bugged_loss_features=True`` passes 10.
    """
    halflife = np.logspace(1.0, np.log10(float(num_steps)), NUM_LOSS_DECAYS)
    return np.exp(-1.0 / halflife).astype(dtype)


def loss_buffer_init(num_steps: int, *, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """The loss buffer before the first update (NumPy): ``means`` 0, ``running_min`` 1e12,
    ``decays`` (:func:`loss_buffer_decays`), all (10,) of ``dtype``; ``iteration`` int32 0."""
    decays = loss_buffer_decays(num_steps, dtype=dtype)
    return {"means": np.zeros((NUM_LOSS_DECAYS,), dtype=decays.dtype),
            "running_min": np.full((NUM_LOSS_DECAYS,), 999999999999.0).astype(decays.dtype),
            "decays": decays, "iteration": np.int32(0)}


def loss_buffer_update(xp: ModuleType, means: Any, running_min: Any, decays: Any,
                       iteration: Any, loss: Any) -> tuple[Any, Any]:
    """``BufferLossAccumulators.update``: one loss into the 10 EMAs.

    Shapes: ``means``, ``running_min``, ``decays`` (10,); ``iteration`` the buffer's count
    *before* this loss (int); ``loss`` a 0-d float. The loss is clipped to twice the largest
    bias-corrected mean (to the loss itself at iteration 0). Returns ``(means,
    running_min)``; the caller increments ``iteration``.
    """
    bc = 1 - decay_power(xp, decays, iteration + 1)
    cor_mean = means / bc
    approx_max = arrays.amax(xp, cor_mean, 0)
    approx_max = xp.where(_as_bool(xp, iteration == 0, means), loss, approx_max)
    loss = xp.minimum(xp.abs(approx_max) * 2, loss)
    # XLA fuses this product and sum (see arrays.fma); the ratio features amplify the ulp
    means = arrays.fma(xp, means, decays, loss * (1.0 - decays))
    cor_mean = means / bc
    running_min = xp.minimum(running_min, cor_mean)
    return means, running_min


def _as_bool(xp: ModuleType, cond: Any, like: Any) -> Any:
    if isinstance(cond, (bool, np.bool_)):
        if arrays.is_torch(xp):
            return arrays.constant(xp, bool(cond), like, dtype=xp.bool)
        return xp.asarray(bool(cond))
    return cond


def loss_features(xp: ModuleType, means: Any, running_min: Any, decays: Any,
                  iteration: Any) -> Any:
    """``BufferLossAccumulators.features``: 9 numbers in [−1, 1], shape (9,).

    ``iteration`` is the buffer's count *after* the update. For each pair of neighbouring
    EMAs, the faster one's bias-corrected mean relative to the running minimum, measured in
    units of (slower mean − running minimum), minus one, clipped; zero while iteration ≤ 2
    (the original multiplies by 0, so a NaN stays NaN).
    """
    cor_mean = means / (1 - decay_power(xp, decays, iteration))
    approx_max = cor_mean[1:]
    cor_mean = cor_mean[:-1]
    rmin = running_min[:-1]
    den = xp.maximum(approx_max - rmin, _scalar(xp, 1e-8, means))
    pre_center = (cor_mean - rmin) / den
    f = arrays.clip(xp, pre_center - 1.0, -1.0, 1.0)
    return xp.where(_as_bool(xp, iteration <= 2, means), f * 0, f)


# -- per-tensor LSTM input features (``lstm_features_for_tensor``) -----------------------------


def fraction_embedding(xp: ModuleType, fraction_trained: Any, like: Any) -> Any:
    """``_fractional_tanh_embed``: ``tanh(10·(f − τ))`` for the 9 timescales τ, shape (9,)."""
    ts = _as_array(xp, np.asarray(FRACTION_TIMESCALES, dtype=np.float32), like)
    return arrays.tanh(xp, (fraction_trained - ts) * 10)


def fraction_trained(xp: ModuleType, iteration: Any, num_steps: Any, like: Any) -> Any:
    """``iteration / float32(num_steps)`` in ``like``'s float dtype, 0-d."""
    it = _as_array(xp, iteration, like) if not hasattr(iteration, "dtype") else iteration
    ns = _as_array(xp, num_steps, like) if not hasattr(num_steps, "dtype") else num_steps
    if arrays.is_torch(xp):
        return it.to(like.dtype) / ns.to(like.dtype)
    return it.astype(like.dtype) / ns.astype(like.dtype)


def clip_log_abs(xp: ModuleType, v: Any, scale: float = 10.0) -> Any:
    """``clip(log(1e-8 + |v·scale|), −5, 5) · 0.5`` (``_clip_log_abs``)."""
    mag = xp.log(1e-8 + xp.abs(v * scale))
    return arrays.clip(xp, mag, -5.0, 5.0) * 0.5


def tensor_rank(shape: Sequence[int]) -> int:
    """The original's rank feature: the number of dimensions longer than 1."""
    return int(sum(1 for s in shape if s > 1))


def lstm_features(xp: ModuleType, p: Any, m: Any, rms: Any, fraction: Any,
                  loss_feats: Any) -> Any:
    """The 30 LSTM inputs of one tensor (``lstm_features_for_tensor``).

    Args:
      p: the parameter, shape ``S`` (rank 0 to 4), before this update.
      m: its momenta *before* this update's accumulation, ``S + (3,)``.
      rms: its second moment before this update, ``S + (1,)``.
      fraction: ``iteration / num_steps`` (0-d), :func:`fraction_trained`.
      loss_feats: (9,), :func:`loss_features` of the updated buffer.

    Returns:
      (30,): in sorted key order fraction_left (9), loss_features (9), mean_rms (1), rank
      one-hot (5), var_m (3), var_rms (3). m and rms are first scaled by
      ``rsqrt(max(1e-9, mean p²))``. ``var_rms`` subtracts the mean of *m* (not of rms),
      broadcasting the one rms slice against the three momenta: the original's expression,
      kept. The (clipped) gradient the original also scales is unused and not taken.
    """
    axes = tuple(range(len(p.shape)))
    norm_mult = arrays.rsqrt(xp, xp.maximum(_mean_all(xp, _square(p)), _scalar(xp, 1e-9, p)))
    m = m * norm_mult
    rms = rms * norm_mult
    mean_m = arrays.mean(xp, m, axes, keepdims=True)
    var_m = arrays.mean(xp, _square(m - mean_m), axes)
    mean_rms = arrays.mean(xp, rms, axes, keepdims=True)
    var_rms = arrays.mean(xp, _square(rms - mean_m), axes)
    k_rms = rms.shape[-1]
    return arrays.concat(xp, [
        fraction_embedding(xp, fraction, p),
        loss_feats,
        clip_log_abs(xp, xp.reshape(mean_rms, (k_rms,))),
        _one_hot(xp, tensor_rank(p.shape), NUM_RANKS, p),
        clip_log_abs(xp, var_m),
        clip_log_abs(xp, var_rms),
    ], axis=0)


def _mean_all(xp: ModuleType, x: Any) -> Any:
    """Mean over every element (a 0-d result; a 0-d input comes back as is)."""
    return arrays.mean(xp, x, tuple(range(len(x.shape))))


def _scalar(xp: ModuleType, value: float, like: Any) -> Any:
    return arrays.constant(xp, value, like)


# -- the per-tensor LSTM (``_rnn_forward`` with haiku's LSTM) --------------------------------


def _linear(xp: ModuleType, x: Any, w: Any, b: Any) -> Any:
    """haiku ``Linear``: ``dot(x, w) + b``."""
    return arrays.matmul(xp, x, w) + b


def lstm_step(xp: ModuleType, x: Any, hidden: Any, cell: Any,
              meta: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
    """One step of the per-tensor LSTM over all tensors at once (``HyperV2._rnn_forward``).

    Args:
      x: (n_tensors, 30) stacked :func:`lstm_features` rows.
      hidden, cell: (n_tensors, H) the LSTM state, one row per tensor.
      meta: θ in xopt's naming (``lstm/...``).

    Returns:
      ``(controls, lr_mult, hidden, cell)``: (n_tensors, param_inits), (n_tensors,) the raw
      ``step_size`` output, and the new state.

    The mixing layers: ``relu(linear_1(x))`` is max-pooled over the tensors and added to
    ``linear_2(x)``; the original also evaluates ``relu(linear(x))`` and discards it (the
    result is overwritten before use), so it is not computed here (``lstm/mix0`` is kept
    in θ so that checkpoints round-trip). haiku's LSTM: gates = Linear(4H)([x, h]) split as
    i, g, f, o; f = σ(f + 1); c = f·c + σ(i)·tanh(g); h = σ(o)·tanh(c).
    """
    mix = arrays.relu(xp, _linear(xp, x, meta["lstm/mix1/w"], meta["lstm/mix1/b"]))
    pooled = arrays.amax(xp, mix, 0, keepdims=True)
    inp = _linear(xp, x, meta["lstm/input/w"], meta["lstm/input/b"]) + pooled
    gated = _linear(xp, arrays.concat(xp, [inp, hidden], axis=-1),
                    meta["lstm/gates/w"], meta["lstm/gates/b"])
    h = hidden.shape[-1]
    i, g, f, o = (gated[..., k * h:(k + 1) * h] for k in range(4))
    f = arrays.sigmoid(xp, f + 1)
    cell = f * cell + arrays.sigmoid(xp, i) * arrays.tanh(xp, g)
    hidden = arrays.sigmoid(xp, o) * arrays.tanh(xp, cell)
    controls = _linear(xp, hidden, meta["lstm/to_controls/w"], meta["lstm/to_controls/b"])
    lr_mult = _linear(xp, hidden, meta["lstm/step_size/w"], meta["lstm/step_size/b"])[..., 0]
    return controls, lr_mult, hidden, cell


# -- the hypernetwork: one MLP per tensor ------------------------------------------------------


def mlp_bank_names(hp: Any) -> tuple[str, ...]:
    """``mlp_bank/w0, b0, w1, b1, …`` for ``ff_hidden_layers`` hidden layers."""
    out = []
    for i in range(hp.ff_hidden_layers + 1):
        out += [f"mlp_bank/w{i}", f"mlp_bank/b{i}"]
    return tuple(out)


def mix_mlp_weights(xp: ModuleType, controls: Any, meta: Mapping[str, Any],
                    hp: Any) -> dict[str, Any]:
    """One tensor's MLP weights: ``100 · mean_k(controls[k] · bank[k])`` per bank array.

    ``controls``: (param_inits,) one row of :func:`lstm_step`'s controls. Returns
    ``{"w0": (30, F), "b0": (F,), "w1": (F, F), …}`` (``interpolate_theta`` in the
    original; its 14 first-layer arrays ``w0__i`` are rows of ``w0`` here, and the mean is
    elementwise, so splitting them first or after gives the same numbers).
    """
    out = {}
    for name in mlp_bank_names(hp):
        bank = meta[name]
        c = xp.reshape(controls, (bank.shape[0],) + (1,) * (len(bank.shape) - 1))
        out[name.split("/")[1]] = 100.0 * arrays.mean(xp, bank * c, (0,))
    return out


# -- the per-element MLP (``_ff_mod``) ---------------------------------------------------------


def mlp_inputs(xp: ModuleType, g: Any, p: Any, m: Any, rms: Any, fac_g: Any,
               v_row: Any, v_col: Any, v_diag: Any) -> list[Any]:
    """The 14 feature groups of ``_ff_mod`` (30 channels in all), unnormalised.

    Args (``S`` the parameter's shape, rank ≥ 1; rank-0 parameters are expanded to (1,)
    by the caller, see :func:`tensor_step`):
      g: the clipped gradient, ``S``. p: the parameter before the update, ``S``.
      m: ``S + (3,)`` and rms ``S + (1,)``: *after* this update's accumulation.
      fac_g: ``S + (3,)`` the Adafactor-preconditioned gradient; v_row, v_col, v_diag: the
        updated factored accumulators (:func:`xopt.specs.lopt.factored_update`).

    Returns:
      a list of 14 arrays ``S + (k_i,)`` with k = :data:`MLP_GROUP_SIZES`. Unfactored
      tensors (rank 1) use v_diag for both row and column features (twice), and
      ``m · v_diag^−0.5`` for the momentum feature, as the original does.
    """
    g1 = g[..., None]
    rsqrt = arrays.rsqrt(xp, rms + 1e-6)
    groups = [g1, arrays.clip(xp, g, -0.1, 0.1)[..., None], p[..., None], m, rms, m * rsqrt,
              rsqrt, fac_g, g1 * rsqrt]
    f = lopt.factored_dims(tuple(g.shape))
    if f is not None:
        d1, d0 = f
        full = tuple(g.shape) + (v_row.shape[-1],)
        row = _broadcast_to(xp, arrays.expand_dims(xp, v_row, d0), full)
        col = _broadcast_to(xp, arrays.expand_dims(xp, v_col, d1), full)
        reduced_d1 = d1 - 1 if d1 > d0 else d1
        row_col_mean = arrays.mean(xp, v_row, (reduced_d1,), keepdims=True)
        row_factor = lopt.safe_rsqrt(xp, v_row / (row_col_mean + 1e-9))
        col_factor = lopt.safe_rsqrt(xp, v_col)
        fac_mom = (m * arrays.expand_dims(xp, row_factor, d0)
                   * arrays.expand_dims(xp, col_factor, d1))
        groups += [row, col, arrays.rsqrt(xp, row + 1e-8), arrays.rsqrt(xp, col + 1e-8), fac_mom]
    else:
        r = arrays.rsqrt(xp, v_diag + 1e-8)
        groups += [v_diag, v_diag, r, r, m * _pow_neg_half(xp, v_diag)]
    return groups


def _broadcast_to(xp: ModuleType, x: Any, shape: tuple[int, ...]) -> Any:
    if arrays.is_torch(xp):
        return x.expand(shape)
    return xp.broadcast_to(x, shape)


def _pow_neg_half(xp: ModuleType, x: Any) -> Any:
    """``x ** -0.5`` (the original's spelling for unfactored tensors)."""
    return x ** -0.5


def normalize_inputs(xp: ModuleType, groups: Sequence[Any]) -> list[Any]:
    """``_second_moment_normalizer`` over the parameter's axes, each group on its own:
    ``x · rsqrt(1e-5 + mean(x², axes of S))`` (channels kept apart)."""
    axes = tuple(range(len(groups[0].shape) - 1))
    return [lopt.second_moment_normalizer(xp, x, axes) for x in groups]


def mlp_forward(xp: ModuleType, inputs: Sequence[Any], weights: Mapping[str, Any]) -> Any:
    """The per-element MLP on normalised groups: ``S + (3,)`` outputs.

    The first layer adds the 14 groups' products one after another, starting from zero,
    as the original's unrolled loop does; then bias, relu, and the hidden layers.
    """
    w0 = weights["w0"]
    out = None
    start = 0
    for x in inputs:
        k = x.shape[-1]
        term = arrays.matmul(xp, x, w0[start:start + k])
        out = term if out is None else out + term
        start += k
    out = out + weights["b0"]
    i = 1
    while f"w{i}" in weights:
        out = arrays.relu(xp, out)
        out = arrays.matmul(xp, out, weights[f"w{i}"]) + weights[f"b{i}"]
        i += 1
    return out


def feature_sq_mean(xp: ModuleType, groups: Sequence[Any]) -> Any:
    """The normaliser's statistic per raw channel, (30,): ``mean over S of feature²``
    (the golden traces' ``aux/feature_sq_mean``)."""
    axes = tuple(range(len(groups[0].shape) - 1))
    return arrays.concat(xp, [arrays.mean(xp, _square(x), axes) for x in groups], axis=0)


def tensor_step(xp: ModuleType, hp: Any, weights: Mapping[str, Any], lr_mult: Any, p: Any,
                g: Any, m: Any, rms: Any, fac_g: Any, v_row: Any, v_col: Any, v_diag: Any,
                *, aux: dict[str, Any] | None = None) -> Any:
    """One tensor's step (``_ff_mod`` after its weights are mixed), shape ``S``.

    ``step = lr_mult · (direction · (param_scale · exp(magnitude · exp_mult)) · step_mult)``
    with ``param_scale = sqrt(mean p² + 1e-9)``, in the original's multiplication order;
    the new parameter is ``p − step``. Rank-0 tensors are expanded to (1,) first (their
    statistics are then over that one element), as the original does. ``aux``, if given,
    receives ``direction``, ``magnitude`` and ``feature_sq_mean``.
    """
    scalar = len(p.shape) == 0
    if scalar:
        p, g, m, rms, fac_g, v_diag = (arrays.expand_dims(xp, a, 0)
                                       for a in (p, g, m, rms, fac_g, v_diag))
    groups = mlp_inputs(xp, g, p, m, rms, fac_g, v_row, v_col, v_diag)
    out = mlp_forward(xp, normalize_inputs(xp, groups), weights)
    direction = out[..., 0]
    magnitude = out[..., 1]
    mag_param = xp.exp(magnitude * hp.exp_mult)
    param_scale = xp.sqrt(_mean_all(xp, _square(p)) + 1e-9)
    step = direction * (param_scale * mag_param) * hp.step_mult
    step = lr_mult * step
    if aux is not None:
        aux["direction"] = direction[0] if scalar else direction
        aux["magnitude"] = magnitude[0] if scalar else magnitude
        aux["feature_sq_mean"] = feature_sq_mean(xp, groups)
    return step[0] if scalar else step


# -- state ---------------------------------------------------------------------------------------


def _k_mom(hp: VeLO) -> int:
    return len(hp.initial_momentum_decays)


def _shape_m(shape: tuple[int, ...], hp: VeLO) -> tuple[int, ...]:
    return tuple(shape) + (len(hp.initial_momentum_decays),)


def _shape_rms(shape: tuple[int, ...], hp: VeLO) -> tuple[int, ...]:
    return tuple(shape) + (len(hp.initial_rms_decays),)


def _shape_fac(which: str):
    def rule(shape: tuple[int, ...], hp: VeLO) -> tuple[int, ...]:
        return lopt.factored_shapes(shape, len(hp.initial_adafactor_decays))[which]

    return rule


def _shape_lstm(shape: tuple[int, ...], hp: VeLO) -> tuple[int, ...]:
    return (hp.lstm_hidden_size,)


def _fixed(shape: tuple[int, ...]):
    return lambda param_shape, hp: shape


def _accumulating(hp: VeLO) -> bool:
    return hp.accumulating


STATE = StateSchema(
    vars=(
        StateVar("m", "param", _shape_m, "state", "momenta at the 3 decays, S + (3,)"),
        StateVar("rms", "param", _shape_rms, "state", "second moment, S + (1,)"),
        StateVar("v_row", "param", _shape_fac("v_row"), "state",
                 "Adafactor row statistic (S without the largest axis) + (3,); (0, 3) "
                 "placeholder below rank 2"),
        StateVar("v_col", "param", _shape_fac("v_col"), "state",
                 "Adafactor column statistic (S without the second largest axis) + (3,); "
                 "(0, 3) placeholder below rank 2"),
        StateVar("v_diag", "param", _shape_fac("v_diag"), "state",
                 "unfactored second moment S + (3,) below rank 2; (0, 3) placeholder else"),
        StateVar("lstm_hidden", "param", _shape_lstm, "state", "LSTM hidden state h, (H,)"),
        StateVar("lstm_cell", "param", _shape_lstm, "state", "LSTM cell state c, (H,)"),
        StateVar("grad_accum", "param", same_as_param, "state",
                 "sum of the gradients since the last update (prefab accumulation)",
                 active=_accumulating),
        StateVar("iteration", "global", scalar, "int32", "updates taken, t"),
        StateVar("num_steps", "global", scalar, "int32", "the horizon the LSTM sees"),
        StateVar("mom_t", "global", _fixed((3,)), "int32", "momentum updates per decay"),
        StateVar("rms_t", "global", _fixed((1,)), "int32", "rms updates"),
        StateVar("loss_means", "global", _fixed((NUM_LOSS_DECAYS,)), "state",
                 "loss EMAs (not bias-corrected)"),
        StateVar("loss_running_min", "global", _fixed((NUM_LOSS_DECAYS,)), "state",
                 "running minimum of the bias-corrected loss EMAs"),
        StateVar("loss_decays", "global", _fixed((NUM_LOSS_DECAYS,)), "state",
                 "the loss EMAs' decays (fixed at init)"),
        StateVar("loss_iteration", "global", scalar, "int32", "losses seen by the buffer"),
        StateVar("loss_accum", "global", scalar, "state",
                 "sum of the losses since the last update", active=_accumulating),
        StateVar("accum_iteration", "global", scalar, "int64",
                 "calls since init (updates happen every num_accumulate calls)",
                 active=_accumulating),
    ),
    namings={},  # filled below
)

#: the int32 counters of the state, as the original and both backends store them
COUNTER_DTYPES = {"iteration": "int32", "num_steps": "int32", "mom_t": "int32",
                  "rms_t": "int32", "loss_iteration": "int32"}
_PER_PARAM = ("m", "rms", "v_row", "v_col", "v_diag", "lstm_hidden", "lstm_cell", "grad_accum")
_GLOBALS = ("iteration", "num_steps", "mom_t", "rms_t", "loss_means", "loss_running_min",
            "loss_decays", "loss_iteration", "loss_accum", "accum_iteration")

NAMINGS = {
    "xopt.torch": Naming(
        keys={**{v: "{param}/" + v for v in _PER_PARAM}, **{v: "global/" + v for v in _GLOBALS}},
        dtypes={**{v: "float32" for v in _PER_PARAM}, **COUNTER_DTYPES, "loss_means": "float32",
                "loss_running_min": "float32", "loss_decays": "float32",
                "loss_accum": "float32", "accum_iteration": "int64"},
        doc="xopt.torch.VeLO: optimizer.state[p][var] per parameter, "
            "optimizer.state['global'][var] for the rest",
    ),
    "xopt.jax": Naming(
        keys={**{v: f"inner/{v}/{{param}}" for v in _PER_PARAM if v != "grad_accum"},
              "grad_accum": "accum/grad_accum/{param}",
              **{v: f"inner/{v}" for v in ("mom_t", "rms_t", "loss_means", "loss_running_min",
                                            "loss_decays", "loss_iteration")},
              "iteration": "iteration", "num_steps": "num_steps",
              "loss_accum": "accum/loss_accum", "accum_iteration": "accum/iteration"},
        dtypes={**COUNTER_DTYPES, "accum_iteration": "int32", "loss_accum": "float32"},
        doc="xopt.jax.velo's LOptState(iteration, num_steps, inner=VeLOState(...), "
            "accum=AccumState(...) | None) flattened with "
            "xopt.parity.runners.flatten_with_paths",
    ),
}
STATE = dataclasses.replace(STATE, namings=NAMINGS)


def _state_dtype(dtype: Any, p: Any) -> Any:
    if dtype is not None:
        return dtype
    return np.promote_types(np.asarray(p).dtype, np.float32)


def decay_arrays(hp: VeLO) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The momentum, rms and Adafactor decays as the original holds them: float32
    (``jnp.asarray`` of the Python floats inside jit; the traces' ``effective_decays``).
    HyperV2 never applies its θ decay offsets (``accumulators_for_decays()`` is called
    without them), so these are the decays. The oracle uses the same float32 values."""
    return tuple(np.asarray(d, dtype=np.float32)
                 for d in (hp.initial_momentum_decays, hp.initial_rms_decays,
                           hp.initial_adafactor_decays))


def param_state_shapes(hp: VeLO, shape: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Shapes of one parameter's state: m, rms, v_row, v_col, v_diag, lstm_hidden,
    lstm_cell (the original's, with its ``(0, 3)`` placeholders)."""
    shape = tuple(int(s) for s in shape)
    k_m, k_r, k_f = (len(d) for d in (hp.initial_momentum_decays, hp.initial_rms_decays,
                                      hp.initial_adafactor_decays))
    return {"m": shape + (k_m,), "rms": shape + (k_r,), **lopt.factored_shapes(shape, k_f),
            "lstm_hidden": (hp.lstm_hidden_size,), "lstm_cell": (hp.lstm_hidden_size,)}


def init_state(hp: VeLO, params: Mapping[str, Any], *, xp: ModuleType = np, dtype: Any = None,
               meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Canonical state before the first step (``HyperV2.opt_fn(θ).init`` inside prefab's
    wrappers), NumPy arrays (``xp`` must be NumPy: the oracle's and the harness's).

    Zero accumulators of ``dtype`` (default: the parameter's dtype promoted to float32);
    every tensor's LSTM state is θ's initial state (``lstm/init_hidden``, ``lstm/init_cell``:
    so ``meta`` is required); ``num_steps`` the inner horizon; the loss buffer of
    :func:`loss_buffer_init` for :attr:`VeLO.loss_horizon`; when accumulating also
    ``grad_accum/<p>``, ``loss_accum``, ``accum_iteration``.
    """
    if xp is not np:
        raise TypeError("xopt.specs.velo.init_state builds NumPy state (xp=numpy)")
    theta = coerce_meta(meta, hp)
    n = hp.inner_num_steps  # raises, naming num_training_steps, if unset
    state: dict[str, Any] = {}
    sdt = np.dtype(dtype) if dtype is not None else np.dtype(np.float32)
    for name, p in params.items():
        dt = np.dtype(dtype) if dtype is not None else np.promote_types(np.asarray(p).dtype,
                                                                         np.float32)
        sdt = dt
        for var, shape in param_state_shapes(hp, np.shape(p)).items():
            if var in ("lstm_hidden", "lstm_cell"):
                init = theta["lstm/init_hidden" if var == "lstm_hidden" else "lstm/init_cell"]
                state[f"{var}/{name}"] = np.array(_to_numpy(init), dtype=dt)
            else:
                state[f"{var}/{name}"] = np.zeros(shape, dt)
        if hp.accumulating:
            state[f"grad_accum/{name}"] = np.zeros(np.shape(p), dt)
    buf = loss_buffer_init(hp.loss_horizon, dtype=sdt)
    k_m, k_r = len(hp.initial_momentum_decays), len(hp.initial_rms_decays)
    state.update(iteration=np.int32(0), num_steps=np.int32(n),
                 mom_t=np.zeros((k_m,), np.int32), rms_t=np.zeros((k_r,), np.int32),
                 loss_means=buf["means"], loss_running_min=buf["running_min"],
                 loss_decays=buf["decays"], loss_iteration=np.int32(0))
    if hp.accumulating:
        state["loss_accum"] = np.zeros((), sdt)
        state["accum_iteration"] = np.int64(0)
    return state


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


# -- one tensor's update, and the whole update as a pure function ---------------------------------


def loss_buffer_step(xp: ModuleType, means: Any, running_min: Any, decays: Any, iteration: Any,
                     loss: Any) -> tuple[Any, Any, Any, Any]:
    """One loss into the buffer: ``(means, running_min, iteration + 1, features (9,))``
    (``update`` then ``features`` of ``BufferLossAccumulators``)."""
    means, running_min = loss_buffer_update(xp, means, running_min, decays, iteration, loss)
    iteration = iteration + 1
    return means, running_min, iteration, loss_features(xp, means, running_min, decays,
                                                        iteration)


def update_tensor(xp: ModuleType, hp: VeLO, p: Any, g: Any, m: Any, rms: Any, v_row: Any,
                  v_col: Any, v_diag: Any, controls: Any, lr_mult: Any,
                  meta: Mapping[str, Any], decays: tuple[Any, Any, Any], *,
                  aux: dict[str, Any] | None = None) -> tuple[Any, tuple[Any, ...]]:
    """The second half of the update for one tensor, after the LSTM has run.

    Args:
      p: the parameter (``S``), g its gradient *before* clipping (``S``); m, rms, v_row,
        v_col, v_diag: its accumulators before this update (:func:`param_state_shapes`).
      controls: (param_inits,) and lr_mult (0-d): its rows of :func:`lstm_step`'s output.
      meta: θ in xopt's naming; decays: :func:`decay_arrays` in the working dtype.
      aux: receives ``direction``, ``magnitude``, ``feature_sq_mean`` and ``mlp_weights``.

    Returns:
      ``(step, (m, rms, v_row, v_col, v_diag))``: the step (``p_new = p − lr·step``) and
      the updated accumulators. Extra memory: the tensor's 30 features, one at a time.
    """
    mom_d, rms_d, fac_d = decays
    g = arrays.clip(xp, g, -GRAD_CLIP, GRAD_CLIP)
    m = lopt.momentum_update(m, g, mom_d)
    rms = lopt.rms_update(xp, rms, g, rms_d)
    v_row, v_col, v_diag, fac_g = lopt.factored_update(xp, v_row, v_col, v_diag, g, fac_d)
    weights = mix_mlp_weights(xp, controls, meta, hp)
    if aux is not None:
        aux["mlp_weights"] = weights
    step = tensor_step(xp, hp, weights, lr_mult, p, g, m, rms, fac_g, v_row, v_col, v_diag,
                       aux=aux)
    return step, (m, rms, v_row, v_col, v_diag)


_ACC_VARS = ("m", "rms", "v_row", "v_col", "v_diag")


def hyperv2_steps(hp: VeLO, params: Mapping[str, Any], state: Mapping[str, Any],
                  grads: Mapping[str, Any], loss: Any, meta: Mapping[str, Any], *,
                  xp: ModuleType = np, aux: dict[str, Any] | None = None,
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """HyperV2's ``opt_fn(θ).update`` on canonical dicts: ``(steps, state)``, pure.

    ``steps[p]`` is the step of parameter p (the original's new parameter is
    ``p − steps[p]``); ``state`` comes back with every entry this update changes except
    ``iteration`` (which the caller, :func:`xopt.specs.lopt.outer_step`, advances). The
    LSTM sees the tensors in the order of ``params``, which changes nothing (its only
    interaction between tensors is a max). ``aux``, if given, receives the golden traces'
    internals: ``lstm_features``, ``controls``, ``lr_mult``, ``feature_sq_mean``,
    ``mlp_weights/<w0|b0|…>`` (stacked in parameter order), ``direction/<p>``,
    ``magnitude/<p>``.
    """
    names = list(params)
    state = dict(state)
    like = state["loss_means"]
    means, rmin, it, lfeat = loss_buffer_step(xp, state["loss_means"],
                                              state["loss_running_min"], state["loss_decays"],
                                              state["loss_iteration"], loss)
    state.update(loss_means=means, loss_running_min=rmin, loss_iteration=it)
    frac = fraction_trained(xp, state["iteration"], state["num_steps"], like)
    x = xp.stack([lstm_features(xp, params[k],
                                state[f"m/{k}"], state[f"rms/{k}"], frac, lfeat)
                  for k in names])
    hidden = xp.stack([state[f"lstm_hidden/{k}"] for k in names])
    cell = xp.stack([state[f"lstm_cell/{k}"] for k in names])
    controls, lr_mult, hidden, cell = lstm_step(xp, x, hidden, cell, meta)
    decays = tuple(_as_array(xp, d, like) for d in decay_arrays(hp))
    steps: dict[str, Any] = {}
    per_tensor = []
    for i, k in enumerate(names):
        t_aux = {} if aux is not None else None
        steps[k], accs = update_tensor(
            xp, hp, params[k], grads[k], *(state[f"{v}/{k}"] for v in _ACC_VARS),
            controls[i], lr_mult[i], meta, decays, aux=t_aux)
        state.update({f"{v}/{k}": a for v, a in zip(_ACC_VARS, accs, strict=True)})
        state[f"lstm_hidden/{k}"] = hidden[i]
        state[f"lstm_cell/{k}"] = cell[i]
        per_tensor.append(t_aux)
    state["mom_t"] = state["mom_t"] + 1
    state["rms_t"] = state["rms_t"] + 1
    if aux is not None:
        aux.update(lstm_features=x, controls=controls, lr_mult=lr_mult)
        for k, t_aux in zip(names, per_tensor, strict=True):
            aux[f"direction/{k}"] = t_aux["direction"]
            aux[f"magnitude/{k}"] = t_aux["magnitude"]
        if names:
            aux["feature_sq_mean"] = xp.stack([t["feature_sq_mean"] for t in per_tensor])
            for w in per_tensor[0]["mlp_weights"]:
                aux[f"mlp_weights/{w}"] = xp.stack([t["mlp_weights"][w] for t in per_tensor])
            # and the first layer as the original's 14 input groups (w0__0 ... w0__13)
            start = 0
            for i, k in enumerate(MLP_GROUP_SIZES):
                aux[f"mlp_weights/w0__{i}"] = aux["mlp_weights/w0"][:, start:start + k]
                start += k
    return steps, state


def step(hp: VeLO, params: Mapping[str, Any], state: Mapping[str, Any],
         grads: Mapping[str, Any], *, xp: ModuleType = np, loss: Any = None,
         meta: Mapping[str, Any] | None = None, aux: dict[str, Any] | None = None,
         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One call of VeLO as ``prefab.LearnedOptimizer`` wraps it, ``(params, state) ->
    (params, state)``, pure, on canonical dicts (:data:`STATE`): weight decay,
    accumulation and the lr multiplier of :func:`xopt.specs.lopt.outer_step` around
    :func:`hyperv2_steps`. ``meta``: θ in either naming (required). ``loss``: required
    (VeLO reads it). The working dtype is the state's (float64 in the oracle).
    """
    if loss is None:
        raise ValueError("VeLO needs the loss: step(..., loss=loss)")
    theta = coerce_meta(meta, hp)
    names = list(params)
    dtype = state["loss_means"].dtype
    theta = {k: _as_xp(xp, v, dtype) for k, v in theta.items()}
    loss = _as_xp(xp, loss, dtype)

    def inner(g: dict[str, Any], loss_: Any, st: dict[str, Any]):
        p = {k: _as_xp(xp, params[k], dtype) for k in names}
        return hyperv2_steps(hp, p, st, g, loss_, theta, xp=xp, aux=aux)

    return lopt.outer_step(hp, params, state, grads, xp=xp, loss=loss, inner=inner)


def _as_xp(xp: ModuleType, x: Any, dtype: Any) -> Any:
    """``x`` as an array of ``xp`` in ``dtype`` (a dtype of ``xp``, or a NumPy dtype)."""
    if arrays.is_torch(xp):
        if not isinstance(dtype, xp.dtype):
            dtype = getattr(xp, np.dtype(dtype).name)
        return x.to(dtype) if isinstance(x, xp.Tensor) else xp.as_tensor(np.asarray(x), dtype=dtype)
    return xp.asarray(x, dtype=dtype)


SPEC = MethodSpec(
    name="velo",
    title="VeLO: learned_optimization's HyperV2 (per-tensor LSTM hypernetwork writing a "
          "per-parameter MLP) as VeLO configures it, with prefab's wrappers",
    hyperparams=VeLO,
    presets=PRESETS,
    state=STATE,
    init_state=init_state,
    step=step,
    naming_of={"torch": "xopt.torch", "jax": "xopt.jax"},
    takes_loss=True,
    impls=("plain", "triton"),
    meta=META,
)
