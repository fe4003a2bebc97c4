"""POET-X (Qiu et al., 2026): orthogonal equivalence training with block rotations.

Every linear weight is trained as ``W = R · W0 · P``: ``W0`` is fixed, ``R`` (output side)
and ``P`` (input side) are orthogonal, each a block-diagonal matrix of ``b × b`` blocks
sandwiched between permutations. Each block is the Cayley–Neumann parameterisation (CNP)
of a skew-symmetric ``Q = S − Sᵀ`` whose strict upper triangle ``S`` is the trainable
vector (``b(b−1)/2`` numbers a block). Every ``merge_interval`` optimizer steps the
rotations are multiplied into ``W0``, reset to the identity, new permutations are drawn
and the rotations' Adam moments restart.

The layer, in the row-vector convention of the authors' code (``poet_torch/core/ops.py``,
``forward_core``; one input row ``x`` of width ``n_in``)::

    x1 = x[perm_in_inv]                     # gather 1 (2 of the 4 permutations live in W0)
    x2[j] = x1[j] · R_in[j]                 # per input block j       (mm1, batched)
    y1    = x2 · W0ᵀ + bias                 #                          (mm2)
    y2[i] = y1[i] · R_out[i]                # per output block i      (mm3, batched)
    y     = y2[perm_out]                    # gather 2

so ``W_eff = Π_outᵀ · blockdiag(R_out)ᵀ · W0 · blockdiag(R_in)ᵀ · Π_inᵀ`` with the gathers
written as permutation matrices. The trainable tensor ``oft_R`` has ``r_out + r_in`` rows
(``r = width / b``): rows ``[0, r_out)`` parameterise ``R_out``, the rest ``R_in`` (the
authors' ``get_weight_poet`` split).

Cayley–Neumann. ``(I + Q)(I − Q)⁻¹ = I + 2 Σ_{j≥1} Qʲ``; the authors' code truncates it two
ways, and both are here (``cayley_formula``), with ``k = neumann_terms``:

* ``"product"`` (default): ``(I + Q)(I + Q + … + Qᵏ) = I + 2Q + … + 2Qᵏ + Qᵏ⁺¹``, what the
  authors' Triton kernel ``poet::cayley`` computes on the GPU (``core/triton_ops.py``,
  ``cayley_forward_kernel``: ``I + 2(Q + Q² + Q²Q) + Q²Q²`` for ``k = 3``);
* ``"taylor"``: ``I + 2Q + … + 2Qᵏ⁺¹``, what their PyTorch fallback
  ``_cayley_transform_pytorch`` computes where triton is absent (and the NeurIPS-era
  ``num_neumann_terms=5`` code): ``I + 2(Q + Q² + Q²Q) + (2Q²)Q²``.

The two differ by ``Q⁴`` (up to 0.15 absolute on the golden traces' larger ``Q``). For
``k = 3`` every power is a product of ``Q`` and ``Q²`` only, which is what lets the fused
kernel (:mod:`xopt.kernels.poet_cayley`) load two matrices.

Optimizer (``poet_torch/optim/adamw.py``, ``POETAdamW``; the rotations' group): Adam
with the step size ``η·s·√(1−β₂ᵗ)/(1−β₁ᵗ)`` (``s = poet_scale``, the rotations'
learning-rate multiplier) applied to ``m/(√v + ε)``, decoupled weight decay applied
*after* the update to the updated parameter, and the moments and ``t`` reset at the start
of every step whose global step counter is a positive multiple of ``merge_interval`` (the
first update after each merge).

Everything below is written once against the array API and runs under NumPy (float64:
the oracle), torch and jax.numpy; the backends (``xopt/torch/poet.py``,
``xopt/jax/poet.py``) call it or kernels tested against it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from xopt.errors import HyperparameterError
from xopt.specs import arrays
from xopt.specs._hyperparams import NONNEGATIVE, UNIT_HALF_OPEN, Hyperparams, Interval, hp
from xopt.specs._method import MethodSpec
from xopt.specs._state import Naming, StateSchema, StateVar, same_as_param, scalar

# -- hyperparameters -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class POET(Hyperparams):
    """POET-X hyperparameters. Defaults are the authors' ``POETConfig``
    (``poet_torch/config.py``) and ``POETAdamW`` (``poet_torch/optim/adamw.py``)."""

    METHOD = "poet"

    block_size: int = hp(256, doc="side b of the square rotation blocks (divides both widths)",
                         interval=Interval(2, None))
    neumann_terms: int = hp(3, doc="k: highest power of Q in the Neumann series of (I−Q)⁻¹",
                            interval=Interval(1, None))
    cayley_formula: str = hp(
        "product", doc="'product' (I+Q)ΣQʲ = the authors' Triton kernel; 'taylor' "
        "I+2ΣQʲ to degree k+1 = their PyTorch fallback", choices=("product", "taylor"))
    merge_interval: int = hp(200, doc="optimizer steps between merge-and-reinitialise",
                             interval=Interval(1, None))
    permutation: str = hp(
        "random", doc="'random': fresh permutations at init and every merge (drawn from "
        "xopt.random, same bits in both backends); 'identity': none",
        choices=("random", "identity"))
    seed: int = hp(0, doc="seed of the permutation draws", interval=Interval(0, 2**64 - 1))
    variant: str = hp("fast", doc="'fast': autograd keeps x and y1; 'mem': recompute y1 in "
                      "backward (keeps only x)", choices=("fast", "mem"))
    normalize_weights: bool = hp(True, doc="from_linear divides each row of W by its norm "
                                 "(replace_linear_with_poet's default)")
    # POET-XQ (the authors' QPOETConfig / QPOETLinear)
    weight_bits: int | None = hp(None, doc="None: W0 in the layer's dtype; 8: W0 stored as "
                                 "uint8 codes with per-group scales and zero points, "
                                 "dequantised on the fly (POET-XQ)", choices=(None, 8))
    weight_group_size: int = hp(256, doc="consecutive elements of the row-major W0 sharing "
                                "one scale and zero point (divides out·in)",
                                interval=Interval(1, None))
    # POETAdamW / get_poet_optimizer
    lr: float = hp(5e-4, doc="rotations' learning rate (POETConfig.poet_lr)", interval=NONNEGATIVE)
    poet_scale: float = hp(0.5, doc="multiplier on the rotations' learning rate",
                           interval=NONNEGATIVE)
    b1: float = hp(0.9, doc="first-moment decay β₁", interval=UNIT_HALF_OPEN)
    b2: float = hp(0.999, doc="second-moment decay β₂", interval=UNIT_HALF_OPEN)
    eps: float = hp(1e-6, doc="ε added to √v", interval=NONNEGATIVE)
    weight_decay: float = hp(0.0, doc="decoupled decay of the rotations (the authors: 0)",
                             interval=NONNEGATIVE)
    correct_bias: bool = hp(True, doc="Adam bias correction folded into the step size")

    def _check_field(self, f: dataclasses.Field, value: Any) -> None:
        if f.name == "block_size" and isinstance(value, (tuple, list)):
            raise self._fail(f.name, value, "POET's rotation blocks are square b×b: give one "
                             "integer b (non-square blocks are not orthogonal matrices)")
        if f.name == "merge_interval" and isinstance(value, int) and value == 0:
            raise self._fail(f.name, value, "must be ≥ 1 (a merge interval of zero would merge "
                             "before every step; to never merge use a very large interval)")
        super()._check_field(f, value)

    def _check_combinations(self) -> None:
        if self.variant not in ("fast", "mem"):  # pragma: no cover - choices catch it
            raise self._fail("variant", self.variant, "must be 'fast' or 'mem'")


PRESETS: dict[str, dict[str, Any]] = {
    # the authors' GPU code path (Triton kernel present)
    "poet-x": dict(cayley_formula="product", neumann_terms=3),
    # the authors' CPU fallback (_cayley_transform_pytorch)
    "poet-x-fallback": dict(cayley_formula="taylor", neumann_terms=3),
}


def check_width(block_size: int, in_features: int, out_features: int, where: str = "POETLinear"):
    """Raise :class:`HyperparameterError` naming the width that ``block_size`` does not divide."""
    if isinstance(block_size, (tuple, list)):
        raise HyperparameterError(
            f"{where}: block_size={tuple(block_size)!r}: POET's rotation blocks are square "
            "b×b; give one integer b")
    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) or \
            block_size < 2:
        raise HyperparameterError(f"{where}: block_size={block_size!r} must be an integer ≥ 2")
    for name, n in (("in_features", in_features), ("out_features", out_features)):
        if n % block_size:
            raise HyperparameterError(
                f"{where}: block_size={block_size} does not divide {name}={n} "
                f"({n} = {n // block_size}·{block_size} + {n % block_size}); choose a block "
                f"size that divides both widths")


# -- index helpers (NumPy; the backends move them to their device) -----------------------


def num_triu(b: int) -> int:
    """Parameters of one block: the strict upper triangle, ``b(b−1)/2``."""
    return b * (b - 1) // 2


@functools.lru_cache(maxsize=32)
def triu_indices(b: int) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, cols)`` of the strict upper triangle in row-major order
    (``torch.triu_indices(b, b, 1)``, the authors' parameter order)."""
    r, c = np.triu_indices(b, 1)
    return r.astype(np.int64), c.astype(np.int64)


@functools.lru_cache(maxsize=32)
def skew_gather(b: int) -> tuple[np.ndarray, np.ndarray]:
    """``(index, sign)``, both ``(b, b)``: ``Q[i, j] = sign[i, j] · x[index[i, j]]`` where
    ``x`` is one block's vector padded with a trailing 0 (``index = b(b−1)/2`` on the
    diagonal). sign is +1 above, −1 below, 0 on the diagonal."""
    rows, cols = triu_indices(b)
    m = num_triu(b)
    index = np.full((b, b), m, dtype=np.int64)
    sign = np.zeros((b, b), dtype=np.float32)
    index[rows, cols] = np.arange(m)
    index[cols, rows] = np.arange(m)
    sign[rows, cols] = 1.0
    sign[cols, rows] = -1.0
    return index, sign


def _xp_of(x: Any):
    from xopt.specs.arrays import namespace

    return namespace(x)


def _take_last(xp, x, index):
    """``x[..., index]`` for an integer index array (numpy/jax.numpy/torch)."""
    if xp.__name__ == "torch":
        return x.index_select(-1, index)
    return xp.take(x, index, axis=-1)


def _asindex(xp, a, like):
    a = np.asarray(a, dtype=np.int64)
    if xp.__name__ == "torch":
        return xp.as_tensor(a, device=like.device)
    return xp.asarray(a)


def skew(x: Any, b: int, *, xp=None) -> Any:
    """Skew-symmetric blocks ``Q`` (``(n, b, b)``) from their upper triangles ``x`` (``(n, m)``).

    ``Q[r, c] = x``, ``Q[c, r] = −x`` exactly (the authors build ``S`` then ``S − Sᵀ``;
    subtracting zero is exact, so both give the same bits)."""
    xp = xp or _xp_of(x)
    index, sign = skew_gather(b)
    n = x.shape[0]
    if xp.__name__ == "torch":
        pad = xp.zeros((n, 1), dtype=x.dtype, device=x.device)
        xpad = xp.cat([x, pad], dim=1)
    else:
        xpad = xp.concatenate([x, xp.zeros((n, 1), dtype=x.dtype)], axis=1)
    q = _take_last(xp, xpad, _asindex(xp, index.reshape(-1), x)).reshape(n, b, b)
    s = sign.astype(np.asarray(0, dtype=_np_dtype(x)).dtype)
    s = xp.as_tensor(s, device=x.device) if xp.__name__ == "torch" else xp.asarray(s)
    return q * s


def _np_dtype(x: Any):
    d = x.dtype
    return str(d).replace("torch.", "") if not isinstance(d, np.dtype) else d


def triu_grad(dq: Any, b: int, *, xp=None) -> Any:
    """The vector-Jacobian product of :func:`skew`: ``g[m] = dQ[r, c] − dQ[c, r]``."""
    xp = xp or _xp_of(dq)
    rows, cols = triu_indices(b)
    n = dq.shape[0]
    flat = dq.reshape(n, b * b)
    up = _take_last(xp, flat, _asindex(xp, rows * b + cols, dq))
    lo = _take_last(xp, flat, _asindex(xp, cols * b + rows, dq))
    return up - lo


def _eye(xp, b, like):
    if xp.__name__ == "torch":
        return xp.eye(b, dtype=like.dtype, device=like.device)
    return xp.eye(b, dtype=like.dtype)


def cayley_coefficients(terms: int, formula: str) -> list[float]:
    """``c_j`` of ``Y = I + Σ_{j=1}^{k+1} c_j Qʲ``: 2 for ``j ≤ k``; ``c_{k+1}`` is 1
    ("product") or 2 ("taylor")."""
    return [2.0] * terms + [1.0 if formula == "product" else 2.0]


def cayley_neumann(q: Any, terms: int = 3, formula: str = "product", *, xp=None) -> Any:
    """The CNP of skew ``q`` (``(..., b, b)``): see the module docstring.

    For ``terms = 3`` the operations are the authors' in their order: ``product`` as the
    Triton kernel accumulates it, ``2·((Q²Q + Q) + Q²) + Q²Q² + I``; ``taylor`` as the
    fallback, ``2·((Q + Q²) + Q²Q) + (2Q²)Q² + I``. Other ``terms`` use powers
    ``Qʲ = Q² Qʲ⁻²`` and sum in increasing degree.
    """
    xp = xp or _xp_of(q)
    b = q.shape[-1]
    eye = _eye(xp, b, q)
    q2 = q @ q
    if terms == 3:
        q3 = q2 @ q
        if formula == "product":
            return 2.0 * ((q3 + q) + q2) + q2 @ q2 + eye
        return 2.0 * ((q + q2) + q3) + (2.0 * q2) @ q2 + eye
    coeffs = cayley_coefficients(terms, formula)
    powers = [None, q, q2]
    for j in range(3, terms + 2):
        powers.append(q2 @ powers[j - 2])
    y = coeffs[0] * q
    for j in range(2, terms + 2):
        y = y + coeffs[j - 1] * powers[j]
    return y + eye


def _mT(a):
    return a.swapaxes(-1, -2) if hasattr(a, "swapaxes") else a.transpose(-1, -2)


def cayley_neumann_vjp(q: Any, g: Any, terms: int = 3, formula: str = "product", *, xp=None):
    """``∂⟨Y, G⟩/∂Q`` for ``Y = cayley_neumann(Q)``: ``Σ_j c_j Σ_{i<j} (Qᵀ)ⁱ G (Qᵀ)ʲ⁻¹⁻ⁱ``.

    For ``terms = 3`` it is arranged as the fused backward kernel computes it, with
    ``D = QᵀG + GQᵀ`` (the cotangent of ``Q²``): ``2(G + D) + (2Qᵀ + c Q²ᵀ) D +
    (2G + c D) Q²ᵀ``, ``c = c₄``."""
    xp = xp or _xp_of(q)
    qt = _mT(q)
    coeffs = cayley_coefficients(terms, formula)
    if terms == 3:
        c = coeffs[-1]
        q2t = _mT(q @ q)
        d = qt @ g + g @ qt
        return 2.0 * (g + d) + (2.0 * qt + c * q2t) @ d + (2.0 * g + c * d) @ q2t
    # general: accumulate Σ_i (Qᵀ)^i G (Qᵀ)^(j-1-i) by powers
    pw = [None] * (terms + 2)
    pw[0] = None
    pw[1] = qt
    for j in range(2, terms + 1):
        pw[j] = pw[j - 1] @ qt
    out = coeffs[0] * g
    for j in range(2, terms + 2):
        acc = g @ pw[j - 1]  # i = 0
        for i in range(1, j - 1):
            acc = acc + pw[i] @ g @ pw[j - 1 - i]
        acc = acc + pw[j - 1] @ g  # i = j - 1
        out = out + coeffs[j - 1] * acc
    return out


def rotations(oft_r: Any, b: int, r_out: int, terms: int = 3, formula: str = "product", *, xp=None):
    """``(R_out, R_in)`` from the trainable vector stack ``oft_R`` (``(r_out + r_in, m)``)."""
    xp = xp or _xp_of(oft_r)
    y = cayley_neumann(skew(oft_r, b, xp=xp), terms, formula, xp=xp)
    return y[:r_out], y[r_out:]


def rotations_vjp(oft_r, g_out, g_in, b, terms=3, formula="product", *, xp=None):
    """Gradient of ``oft_R`` from the cotangents of ``R_out`` and ``R_in``."""
    xp = xp or _xp_of(oft_r)
    q = skew(oft_r, b, xp=xp)
    if xp.__name__ == "torch":
        g = xp.cat([g_out, g_in], dim=0)
    else:
        g = xp.concatenate([g_out, g_in], axis=0)
    return triu_grad(cayley_neumann_vjp(q, g, terms, formula, xp=xp), b, xp=xp)


# -- the layer (row-vector convention) ------------------------------------------------------


def block_rotate(x: Any, r: Any, *, xp=None) -> Any:
    """``x[..., j-th block] · r[j]`` for every block j (``x``: ``(..., nb·b)``, ``r``:
    ``(nb, b, b)``)."""
    xp = xp or _xp_of(x)
    nb, b, _ = r.shape
    xb = x.reshape(*x.shape[:-1], nb, b)
    return xp.einsum("...rk,rkc->...rc", xb, r).reshape(x.shape)


def block_rotate_t(x: Any, r: Any, *, xp=None) -> Any:
    """``x[..., j-th block] · r[j]ᵀ``: the backward of :func:`block_rotate` in ``x``."""
    xp = xp or _xp_of(x)
    nb, b, _ = r.shape
    xb = x.reshape(*x.shape[:-1], nb, b)
    return xp.einsum("...rc,rkc->...rk", xb, r).reshape(x.shape)


def block_outer(a: Any, g: Any, nb: int, *, xp=None) -> Any:
    """``Σ_rows a[..., j]ᵀ g[..., j]`` per block j: the cotangent of ``r`` in
    :func:`block_rotate` given its input ``a`` and output cotangent ``g``."""
    xp = xp or _xp_of(a)
    b = a.shape[-1] // nb
    ab = a.reshape(-1, nb, b)
    gb = g.reshape(-1, nb, b)
    return xp.einsum("nrk,nrc->rkc", ab, gb)


def layer_forward(x, r_out, r_in, weight, bias, perm_in_inv, perm_out, *, xp=None):
    """``(y, y1)``: the layer's output and the pre-rotation activation ``y1 = x2·W0ᵀ + bias``
    (what the fast variant keeps for the backward)."""
    xp = xp or _xp_of(x)
    x1 = _take_last(xp, x, perm_in_inv)
    x2 = block_rotate(x1, r_in, xp=xp)
    y1 = x2 @ _mT(weight)
    if bias is not None:
        y1 = y1 + bias
    y = _take_last(xp, block_rotate(y1, r_out, xp=xp), perm_out)
    return y, y1


def layer_backward(x, g, r_out, r_in, weight, perm_in, perm_in_inv, perm_out_inv, y1=None, *,
                   bias=None, xp=None):
    """Explicit backward: ``(grad_x, grad_R_out, grad_R_in, grad_bias_pre)`` from ``g = ∂L/∂y``.

    ``y1`` is recomputed from ``x`` when not given (the mem variant). ``grad_bias_pre`` is
    the cotangent of ``y1`` summed over rows (the bias's gradient)."""
    xp = xp or _xp_of(x)
    x1 = _take_last(xp, x, perm_in_inv)
    if y1 is None:
        y1 = block_rotate(x1, r_in, xp=xp) @ _mT(weight)
        if bias is not None:
            y1 = y1 + bias
    g2 = _take_last(xp, g, perm_out_inv)
    grad_r_out = block_outer(y1, g2, r_out.shape[0], xp=xp)
    gy1 = block_rotate_t(g2, r_out, xp=xp)
    gx2 = gy1 @ weight
    grad_r_in = block_outer(x1, gx2, r_in.shape[0], xp=xp)
    gx = _take_last(xp, block_rotate_t(gx2, r_in, xp=xp), perm_in)
    return gx, grad_r_out, grad_r_in, gy1.reshape(-1, gy1.shape[-1]).sum(0)


def block_rotate_rows(xp, m, r):
    """``blockdiag(r) · m`` for ``m`` of shape ``(nb·b, k)``."""
    nb, b, _ = r.shape
    mb = m.reshape(nb, b, m.shape[-1])
    return xp.einsum("rkc,rcn->rkn", r, mb).reshape(m.shape)


def effective_weight(weight, r_out, r_in, perm_in, perm_out, *, xp=None):
    """``W_eff`` (``out × in``) such that the layer is ``x · W_effᵀ`` (plus its bias):
    ``W_effᵀ = (blockdiag(R_in) · W0ᵀ · blockdiag(R_out))[perm_in][:, perm_out]``, the
    authors' ``get_effective_weight``."""
    xp = xp or _xp_of(weight)
    m = block_rotate(block_rotate_rows(xp, _mT(weight), r_in), r_out, xp=xp)  # (in, out)
    m = _take_last(xp, m, perm_out)                 # columns by perm_out
    return _take_last(xp, _mT(m), perm_in)          # (out, in), columns by perm_in


def merged_weight(weight, r_out, r_in, perm_in, perm_out, new_perm_in_inv, new_perm_out_inv,
                  *, xp=None):
    """``W0`` after a merge: ``W_eff`` re-laid for the new permutations, so that with
    ``R = I`` the layer is unchanged (``W0' = W_eff[new_perm_out_inv][:, new_perm_in_inv]``).
    """
    xp = xp or _xp_of(weight)
    w = effective_weight(weight, r_out, r_in, perm_in, perm_out, xp=xp)
    w = _take_last(xp, _mT(w), new_perm_out_inv)  # rows of W_eff by new_perm_out_inv
    return _take_last(xp, _mT(w), new_perm_in_inv)


def merged_bias(bias, r_out, perm_out, new_perm_out_inv, *, xp=None):
    """The bias after a merge, so that the layer's output is unchanged.

    The authors' ``merge_then_reinitialize`` leaves the bias alone although it sits
    inside ``R_out`` and ``perm_out``, so a layer *with* a bias changes its output at
    every merge there (their LLaMA models have no biases). xopt folds it: the output bias
    ``c = (bias · blockdiag(R_out))[perm_out]`` becomes ``bias' = c[new_perm_out_inv]``."""
    xp = xp or _xp_of(bias)
    c = _take_last(xp, block_rotate(bias, r_out, xp=xp), perm_out)
    return _take_last(xp, c, new_perm_out_inv)


# -- POET-XQ: W0 in 8 bits --------------------------------------------------------------------
#
# The authors' format (poet_torch/core/ops.py, quantize_tensor_int8; QPOETLinear): the
# row-major W0 is cut into groups of ``group_size`` consecutive elements; each group gets
# an asymmetric min/max uint8 code with one scale and one zero point, both in W0's dtype,
# shaped ``(groups, 1)``:
#
#     scale = max(max(g) − min(g), 1e-5) / 255
#     zero  = clip(−round(min(g) / scale), 0, 255)
#     code  = clip(round(g / scale) + zero, 0, 255)          (round: half to even)
#     W0 ≈ (code − zero) · scale                             (in the compute dtype)
#
# Every operation is one IEEE rounding in W0's dtype, so NumPy, torch and jax.numpy give
# the same bytes. A merge dequantises W0, folds the rotations in (merged_weight) and
# quantises the result afresh (QPOETLinear.merge_then_reinitialize).

QUANT_MAX = 255  # 2**8 − 1: uint8 codes


def quant_groups(out_features: int, in_features: int, group_size: int,
                 where: str = "POETLinear") -> int:
    """The number of quantisation groups of an ``out × in`` W0; names the parameter at
    fault when ``group_size`` does not divide ``out · in``."""
    n = out_features * in_features
    if n % group_size:
        raise HyperparameterError(
            f"{where}.weight_group_size = {group_size}: must divide out_features · "
            f"in_features = {out_features} · {in_features} = {n}")
    return n // group_size


def _amax_amin(xp, g):
    if xp.__name__ == "torch":
        return g.amax(dim=1, keepdim=True), g.amin(dim=1, keepdim=True)
    return xp.max(g, axis=1, keepdims=True), xp.min(g, axis=1, keepdims=True)


def _clip(xp, x, lo, hi):
    return x.clamp(lo, hi) if xp.__name__ == "torch" else xp.clip(x, lo, hi)


def _as_uint8(xp, x):
    return x.to(xp.uint8) if xp.__name__ == "torch" else x.astype(xp.uint8)


def quantize_weight(w: Any, group_size: int = 256, *, xp=None) -> tuple[Any, Any, Any]:
    """``(codes, scales, zeros)`` of a 2-d ``w``: uint8 codes of ``w``'s shape, float
    scales and zero points ``(out·in / group_size, 1)`` in ``w``'s dtype."""
    xp = xp or _xp_of(w)
    shape = tuple(w.shape)
    quant_groups(shape[0], shape[1], group_size, "quantize_weight")
    g = w.reshape(-1, group_size)
    hi, lo = _amax_amin(xp, g)
    spread = hi - lo
    spread = spread.clamp(min=1e-5) if xp.__name__ == "torch" else xp.maximum(spread, 1e-5)
    scales = arrays.divide(xp, spread, QUANT_MAX)
    zeros = _clip(xp, -xp.round(arrays.divide(xp, lo, scales)), 0, QUANT_MAX)
    codes = _clip(xp, xp.round(arrays.divide(xp, g, scales)) + zeros, 0, QUANT_MAX)
    return _as_uint8(xp, codes.reshape(shape)), scales, zeros


def dequantize_weight(codes: Any, scales: Any, zeros: Any, group_size: int, dtype: Any = None,
                      *, xp=None) -> Any:
    """``W0 = (codes − zeros) · scales`` evaluated in ``dtype`` (default: the scales')."""
    xp = xp or _xp_of(scales)
    if xp.__name__ == "torch":
        dtype = dtype or scales.dtype
        w = codes.to(dtype).reshape(-1, group_size)
        w = (w - zeros.to(dtype)) * scales.to(dtype)
    else:
        dtype = dtype or scales.dtype
        w = codes.astype(dtype).reshape(-1, group_size)
        w = (w - zeros.astype(dtype)) * scales.astype(dtype)
    return w.reshape(codes.shape)


def requantized_weight(codes, scales, zeros, group_size, r_out, r_in, perm_in, perm_out,
                       new_perm_in_inv, new_perm_out_inv, *, dtype=None, xp=None):
    """POET-XQ's merge: ``W0`` dequantised (in ``dtype``, default the scales'), the
    rotations folded in for the new permutations (:func:`merged_weight`), quantised
    afresh; returns the new ``(codes, scales, zeros)`` (scales in ``dtype``)."""
    xp = xp or _xp_of(scales)
    w = dequantize_weight(codes, scales, zeros, group_size, dtype, xp=xp)
    w = merged_weight(w, r_out, r_in, perm_in, perm_out, new_perm_in_inv, new_perm_out_inv,
                      xp=xp)
    return quantize_weight(w, group_size, xp=xp)


# -- permutations ---------------------------------------------------------------------------


def random_permutation(seed: int, n: int, counter: int = 0) -> np.ndarray:
    """A permutation of ``range(n)`` from ``xopt.random``: the stable argsort of ``n``
    32-bit words of ``seed``'s stream at ``counter`` (int64; identical in every backend,
    since it is computed in NumPy and only moved to the device)."""
    from xopt import random as xr

    words = np.asarray(xr.bits(seed, (n,), counter=counter)).astype(np.int64)
    return np.argsort(words, kind="stable").astype(np.int64)



def random_permutations(seeds, n: int) -> np.ndarray:
    """``(len(seeds), n)`` int64, row ``j`` equal to ``random_permutation(seeds[j], n)``
    (counter 0), for many seeds at once: the words of ``xopt.random.bits(seed, (n,))`` (word
    ``k`` is word ``k % 2`` of block ``k // 2``) from one Threefry evaluation, and each row's
    stable argsort as the sort of the distinct keys ``word * 2**s + k``."""
    from xopt import random as xr

    seeds = list(seeds)
    for s in seeds:
        xr.key_from_seed(s)  # (checks each seed, as random_permutation's draw does)
    pairs = (n + 1) // 2
    s = np.asarray(seeds, dtype=np.uint64)[:, None]
    y0, y1 = xr.threefry2x32((s >> np.uint64(32)).astype(np.uint32),
                             (s & np.uint64(0xFFFFFFFF)).astype(np.uint32),
                             0, np.arange(pairs, dtype=np.uint32)[None, :])
    words = np.stack([y0, y1], axis=2).reshape(len(seeds), 2 * pairs)[:, :n]
    shift = max(n - 1, 1).bit_length()
    keys = (words.astype(np.int64) << shift) | np.arange(n, dtype=np.int64)
    keys.sort(axis=1)
    return keys & ((1 << shift) - 1)

def layer_permutations(hp: POET, layer_seed: int, merges: int, n_in: int, n_out: int):
    """``(perm_in, perm_out)`` a layer uses after ``merges`` merges (int64 NumPy)."""
    if hp.permutation == "identity":
        return np.arange(n_in), np.arange(n_out)
    from xopt import random as xr

    s = xr.fold_in(layer_seed, merges)
    return random_permutation(xr.fold_in(s, 0), n_in), random_permutation(xr.fold_in(s, 1), n_out)



def random_layer_permutations(layer_seeds, merges, n_ins, n_outs) -> list[tuple]:
    """``layer_permutations(hp, layer_seeds[j], merges[j], n_ins[j], n_outs[j])`` of a
    random-permutation ``hp`` for every ``j``, the draws together: each ``fold_in`` as one
    Threefry evaluation over the layers, the permutations of one width as one
    (:func:`random_permutations`)."""
    from xopt import random as xr

    count = len(layer_seeds)
    s = xr.fold_in_many(layer_seeds, merges)
    seeds = xr.fold_in_many(s + s, [0] * count + [1] * count)  # (the in, then the out)
    widths = list(n_ins) + list(n_outs)
    drawn: list = [None] * len(seeds)
    for n in set(widths):
        at = [k for k, w in enumerate(widths) if w == n]
        for k, row in zip(at, random_permutations([seeds[k] for k in at], n), strict=True):
            drawn[k] = row
    return [(drawn[j], drawn[count + j]) for j in range(count)]

def inverse(perm: np.ndarray) -> np.ndarray:
    return np.argsort(np.asarray(perm), kind="stable").astype(np.int64)


def inverses(perms: np.ndarray) -> np.ndarray:
    """Each row's :func:`inverse` (rows: permutations of one width)."""
    perms = np.asarray(perms)
    inv = np.empty_like(perms)
    np.put_along_axis(inv, perms, np.arange(perms.shape[1], dtype=perms.dtype)[None, :], axis=1)
    return inv


# -- the rotations' optimizer (POETAdamW's arithmetic) ----------------------------------------


def needs_reset(global_step: int, merge_interval: int) -> bool:
    """POETAdamW resets the rotations' moments at the start of a step whose global
    counter (updates already taken) is a positive multiple of the merge interval."""
    return merge_interval > 0 and global_step > 0 and global_step % merge_interval == 0


def adam_update(p, g, m, v, step: int, *, lr, b1, b2, eps, weight_decay, correct_bias, xp=None):
    """One POETAdamW update of one tensor (``step`` counts this update, ≥ 1).

    In the authors' order: ``m ← β₁m + (1−β₁)g``; ``v ← β₂v + (1−β₂)g²``; ``d = √v + ε``;
    ``α = lr·√(1−β₂ᵗ)/(1−β₁ᵗ)`` (Python doubles); ``p ← p − α·m/d``; then
    ``p ← p − lr·λ·p`` (decay of the *updated* parameter). ``lr`` is already multiplied
    by ``poet_scale``. Returns ``(p, m, v)``."""
    from xopt.specs import arrays

    xp = xp or arrays.namespace(p)
    m = m * b1 + g * (1.0 - b1)
    v = arrays.addcmul(xp, v * b2, g, g, 1.0 - b2)
    denom = xp.sqrt(v) + eps
    step_size = lr
    if correct_bias:
        step_size = step_size * (1.0 - b2 ** step) ** 0.5 / (1.0 - b1 ** step)
    p = arrays.addcdiv(xp, p, m, denom, -step_size)
    if weight_decay > 0.0:
        p = p + p * (-lr * weight_decay)
    return p, m, v


# -- the optimizer as a pure function of named arrays (the harness's view) ------------------


def init_state(hp: POET, params: Mapping[str, Any], *, xp=np, dtype=None) -> dict[str, Any]:
    state: dict[str, Any] = {"global_step": np.int64(0)}
    for name, p in params.items():
        dt = dtype or np.promote_types(np.asarray(p).dtype, np.float32)
        state[f"step/{name}"] = np.int64(0)
        state[f"m/{name}"] = xp.zeros(p.shape, dtype=dt)
        state[f"v/{name}"] = xp.zeros(p.shape, dtype=dt)
    return state


def step(hp: POET, params, state, grads, *, xp=np, loss=None):
    """The rotations' update for every tensor in ``params`` (all are rotation vectors),
    with the moment reset at merge boundaries. Merges themselves change the layer, not
    the optimizer, and are driven by :mod:`xopt.parity.layers.poet` and the backends."""
    del loss
    gstep = int(state["global_step"])
    reset = needs_reset(gstep, hp.merge_interval)
    new_p, new_s = {}, {"global_step": np.int64(gstep + 1)}
    for name, p in params.items():
        m, v, t = state[f"m/{name}"], state[f"v/{name}"], int(state[f"step/{name}"])
        if reset:
            m, v, t = m * 0, v * 0, 0
        t += 1
        p, m, v = adam_update(p, grads[name], m, v, t, lr=hp.lr * hp.poet_scale, b1=hp.b1,
                              b2=hp.b2, eps=hp.eps, weight_decay=hp.weight_decay,
                              correct_bias=hp.correct_bias, xp=xp)
        new_p[name] = p
        new_s[f"m/{name}"], new_s[f"v/{name}"], new_s[f"step/{name}"] = m, v, np.int64(t)
    return new_p, new_s


STATE = StateSchema(
    vars=(
        StateVar("global_step", "global", scalar, "int64",
                 "updates taken (POETAdamW.global_step_counter)"),
        StateVar("step", "param", scalar, "int64", "updates since the last moment reset, t"),
        StateVar("m", "param", same_as_param, "state", "first moment of the rotation vector"),
        StateVar("v", "param", same_as_param, "state", "second moment of the rotation vector"),
    ),
    namings={
        # poet_torch.optim.adamw.POETAdamW; also xopt.torch.POETAdamW
        "poet_torch": Naming(
            keys={"global_step": "global_step_counter", "step": "{param}/step",
                  "m": "{param}/exp_avg", "v": "{param}/exp_avg_sq"},
            dtypes={"global_step": "int64", "step": "int64"},
            doc="POETAdamW.state[param][key]; global_step_counter an attribute"),
        "xopt.jax": Naming(
            keys={"global_step": "count", "step": "step/{param}", "m": "mu/{param}",
                  "v": "nu/{param}"},
            dtypes={"global_step": "int32", "step": "int32"},
            doc="xopt.jax.poet_adamw: POETAdamWState(count, step, mu, nu)"),
    },
)


SPEC = MethodSpec(
    name="poet",
    title="POET-X: orthogonal equivalence training layers (Cayley–Neumann block rotations)",
    hyperparams=POET,
    presets=PRESETS,
    state=STATE,
    init_state=init_state,
    step=step,
    naming_of={"torch": "poet_torch", "jax": "xopt.jax"},
    impls=("plain", "triton"),
)
