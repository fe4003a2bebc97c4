"""Fused Pallas kernels for the learned optimizers' per-element pass over 2-D tensors.

Used by ``xopt.jax.small_fc_lopt(impl="pallas")`` and ``xopt.jax.velo(impl="pallas")``
(:mod:`xopt.jax._lopt_fast`) for each shape group whose tensors are factored matrices: rank
2, or a higher rank whose axes other than the two factored ones have length 1 (ViT's
``(1, 197, 768)``), each seen as ``[N1, N2]`` (``N2`` the contiguous axis). The other groups
(vectors, scalars, convolution kernels) keep the packed XLA path.

The kernels are called once per tensor on its own arrays (``g``, ``p``, ``m``, ``rms`` in,
the step out, ``m`` and ``rms`` updated in place): nothing per element is copied into a
stacked group and back.
What a tensor shares with its group's computation (factors, axis terms, normalized weights,
VeLO's per-tensor scalars: small) is computed by XLA for the group at once, stacked
``[L, ...]``, and read by each call at the tensor's index ``idx``, an input rather than a
constant of the kernel, so that the calls of a group are one kernel, which XLA compiles
once (its kernel cache is keyed by the call's backend config). The group's small state
arrays (``v_row``, ``v_col``; the vectors' on XLA's path, VeLO's LSTM state) are stacked
from and handed back to the tensors' own arrays by copy kernels (:func:`stack_rows`,
:func:`split_rows`, up to :data:`SPLIT_K` tensors a call): a slice or a transposed copy
per tensor would each be an XLA:GPU kernel, and XLA's compile time grows with their number.

Per group, with the math of :func:`xopt.specs.small_fc_lopt.compute_step`:

1. XLA: the Adafactor statistics ``v_row``, ``v_col`` (the spec's ``factored_update``, per
   tensor on its own gradient), their row-column means and factors, and the 12 row/column
   features' sums of squares (a feature of one axis summed over a tensor is the other
   axis's length times its sum over positions);
2. :func:`_stats_kernel`: per block, Σ feature² of the 16 per-element features
   (g, p, m, rms, m·rsqrt(rms), rsqrt(rms), fac_g, m·row_factor·col_factor), with the
   updated accumulators recomputed in registers; XLA adds the blocks and forms the
   normalizers ``rsqrt(1e-5 + mean feature²)``;
3. XLA: the first layer's row/column terms, ``Σ f·(inv·W0[f])`` over the 6 features of each
   axis, one row of ``hidden`` numbers per position, and the time features folded into
   the first bias;
4. :func:`_fused_kernel`: per block, the accumulators, the 16 per-element features, and
   the MLP as torch's folded kernel (xopt.kernels.small_fc_lopt) evaluates it: the first
   layer one [n, 16] × [16, HP] product of the raw features and the first-layer rows with
   the tensor's normalizers folded in (XLA, stage 3), accumulated onto the axis terms and
   bias; the hidden layers' inputs relabeled so that a product's accumulator is the next
   one's operand (:func:`_mma_to_operand`); every product on the tensor cores
   (``precision``: "exact" three TF32 products of operands split into TF32 halves, the
   weights' halves split once by XLA, "fast" one; under the CPU interpreter the same
   split with float32 products, as torch's interpreted kernels, :func:`_dot3`); the output
   layer as float32 sums, the step; writes the step, ``m`` and ``rms``.

The fused pass's expressions are torch's folded kernels' (the same operands, order and
association; tests/test_lopt_backend_bits.py compares the two paths stage by stage). What
differs: the statistics (float32 per block and XLA's reductions here, float64 per tile
there), the axis factors and features computed by XLA rather than inside the kernel, and on
the CPU the hosts of the two interpreters (XLA contracts products into sums and has its own
rsqrt, exp and matrix products; NumPy has its own).

Nothing is materialized per element but the kernels' inputs and outputs: no [n, 39]
feature matrix, no [n, hidden] activations. A program owns a block of RP rows of BC
columns and walks it in NSUB sub-tiles of BR rows (a loop, not unrolled); what depends
only on its columns or its tensor is loaded once per block. Grids are one-dimensional (a
tensor's blocks one after another), so no grid axis meets CUDA's 65535 limit. VeLO's
kernels (:class:`VeLOKernels`) follow the same stages with its 4-wide MLP as float32 FMAs,
and take the LSTM's inputs from the statistics pass (its momenta's variances by Welford's
and Chan's updates, no second pass over the momenta). Each stage (1-4) runs through a
stage runner (``stage=``, :func:`run_stage` by default) so that bench/lopt_step_jax.py
``--breakdown`` can time them apart.

Boundary blocks (a tensor's last rows or columns when RP or BC does not divide them): every
load of a block that can reach past its array is masked with ``other=0`` and every such
store is masked (:func:`_load`, :func:`_store`). Pallas's Triton lowering does not mask a
plain ``ref[...]`` against the array's bounds: an unmasked boundary block reads and writes
the next row's, the next tensor's or another buffer's memory on the GPU, while the CPU
interpreter pads every block with NaN and drops what lands outside, so it cannot show the
difference (tests/test_kernels_lopt_jax.py checks the masks in the kernels' programs).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from xopt.specs import arrays, lopt
from xopt.specs import small_fc_lopt as spec

__all__ = ["SmallFCKernels", "two_d_view", "unsupported_small_fc"]

#: a sub-tile: BR rows of BC contiguous elements, what a program computes at a time
BR = 2
BC = 64
#: sub-tiles per program: a program owns NSUB·BR rows of BC columns and walks them in a
#: loop (``fori_loop``, not unrolled: the kernel body is one sub-tile's, so its compile cost
#: does not grow), so that what depends only on its columns or on the tensor (the MLP's
#: weights, the column terms and factors, the index math) is loaded once per NSUB sub-tiles
#: and the grid is NSUB times smaller, as the torch Triton kernels walk their tiles
NSUB = 8
#: rows of a program's block
RP = BR * NSUB
NUM_WARPS = 4
#: a squeezed block dimension (``None`` in older Pallas)
SQ = getattr(pl, "squeezed", None)
#: the per-element features (spec indices) the kernels compute, in this order
ELEM = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 25, 26, 27)


def unsupported_small_fc(hp: spec.SmallFCLOpt) -> str | None:
    """Why the kernels cannot run these hyperparameters (None: they can)."""
    k = (len(hp.initial_momentum_decays), len(hp.initial_rms_decays),
         len(hp.initial_adafactor_decays))
    if k != (3, 1, 3):
        return f"the kernels are written for 3 momentum, 1 rms and 3 Adafactor decays (got {k})"
    if int(hp.hidden_layers) < 1:
        return "the kernels need hidden_layers >= 1"
    return None


def two_d_view(shape: tuple[int, ...]) -> tuple[int, int, bool] | None:
    """``(N1, N2, row_on_1)`` for a shape the kernels handle (None otherwise): the lengths
    of the two factored axes in storage order and whether ``v_row`` (the mean over the
    largest axis d0) is indexed by the first of them (d0 is the second)."""
    f = lopt.factored_dims(shape)
    if f is None:
        return None
    d1, d0 = f
    if any(s != 1 for i, s in enumerate(shape) if i not in (d0, d1)):
        return None
    a, b = sorted((d0, d1))
    return int(shape[a]), int(shape[b]), d0 == b


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def _dot_mode(precision: str) -> str:
    """How the fused kernel multiplies: "tf32x3" (exact: three TF32 products of split
    operands, :func:`_dot3`) or "tf32" (fast: one). On the CPU (the interpreter) the same
    split runs with float32 products, as torch's Triton kernels under ``TRITON_INTERPRET=1``
    run theirs: the two interpreters then evaluate the same algebra
    (tests/test_lopt_backend_bits.py)."""
    return "tf32x3" if precision == "exact" else "tf32"


def _round_tf32(x: Any) -> Any:
    """``x`` rounded to the nearest TF32 number (10 mantissa bits, ties away from zero), so
    that a TF32 product reads it unchanged (xopt.kernels.lopt_common.round_tf32's bits)."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jax.lax.bitcast_convert_type((b + 4096) & -8192, jnp.float32)


def split_tf32(w: Any) -> Any:
    """``w`` as its TF32 halves stacked on a new axis -3: ``(hi, lo)`` with ``hi =
    round_tf32(w)``, ``lo = round_tf32(w − hi)`` (the weights' side of :func:`_dot3`)."""
    hi = _round_tf32(w)
    return jnp.stack([hi, _round_tf32(w - hi)], axis=-3)


def _dot3(x: Any, w: tuple[Any, Any], acc: Any, mode: str) -> Any:
    """``acc + x @ w`` [n, K] × [K, N], ``w`` a pair [K, N] (:func:`split_tf32`'s halves in
    "tf32x3" mode; else the weights and zeros). "tf32x3": the exact mode of the torch
    kernels (xopt.kernels.lopt_common.dot3_acc, ``LO_RN=False``): ``x_hi = round_tf32(x)``,
    ``x_lo = x − x_hi`` read by the tensor cores as its TF32 truncation, and ``x_lo·w_hi``,
    ``x_hi·w_lo``, ``x_hi·w_hi`` added to ``acc`` in that order, small first. Split here
    rather than by Triton's own TF32x3, which splits the weights again in every sub-tile
    and guards each product's NaNs with a compare and a select per element."""
    tf32 = jax.lax.Precision.DEFAULT  # (on the CPU: float32 products)
    if mode == "tf32":
        return acc + jnp.dot(x, w[0], precision=tf32)
    x_hi = _round_tf32(x)
    x_lo = x - x_hi
    acc = acc + jnp.dot(x_lo, w[0], precision=tf32)
    acc = acc + jnp.dot(x_hi, w[1], precision=tf32)
    return acc + jnp.dot(x_hi, w[0], precision=tf32)


def _mma_to_operand(h: Any, hp: int) -> Any:
    """Columns of ``h`` [n, HP] permuted, ``c = 8j + 2q + r → 8j + 4r + q`` (q < 4, r < 2),
    as xopt.kernels.small_fc_lopt's: on Hopper a thread holds columns 8j + 2q + {0, 1} of a
    matmul's accumulator and 8j + q + {0, 4} of the next matmul's TF32 operand, so after
    this relabeling the one already is the other (no shuffle between threads). The next
    layer's rows are stored permuted alike (:func:`_operand_perm`): the product is the
    same."""
    n = h.shape[0]
    return jnp.swapaxes(h.reshape(n, hp // 8, 4, 2), 2, 3).reshape(n, hp)


def _operand_perm(hp: int) -> np.ndarray:
    """Row ``k`` of a hidden layer as the kernel stores it is row ``perm[k]`` of the layer
    (:func:`_mma_to_operand`'s relabeling: k = 8j + 4r + q holds c = 8j + 2q + r)."""
    return np.array([8 * (k // 8) + 2 * (k % 4) + (k % 8) // 4 for k in range(hp)])


def _compiler_params() -> Any:
    if _on_cpu():
        return None
    from jax.experimental.pallas import triton as plt

    return plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1)


def _blocks(n1: int, n2: int) -> tuple[int, int]:
    return -(-n1 // RP), -(-n2 // BC)


def _index_maps(n1: int, n2: int):  # noqa: ANN202
    """``(nb1, nb2, per, elem)``: a tensor's row and column blocks, its programs and the
    (row block, column block) of program ``t``."""
    nb1, nb2 = _blocks(n1, n2)
    per = nb1 * nb2

    def elem(t):  # noqa: ANN001, ANN202
        return t // nb2, t % nb2

    return nb1, nb2, per, elem


def _element_specs(elem):  # noqa: ANN001, ANN202
    """The block specs both methods' kernels share: the whole of a small vector, a (row
    block, column block) tile of one tensor's element array and of its momenta (with their
    3 decays), and the whole of a group's per-tensor array (read at the tensor's index)."""
    def whole(t):  # noqa: ANN001, ANN202
        return (0,)

    return (whole, pl.BlockSpec((RP, BC), lambda t: elem(t)),
            pl.BlockSpec((RP, BC, 3), lambda t: (*elem(t), 0)), pl.no_block_spec)


def _load(ref, mask):  # noqa: ANN001, ANN202
    """``ref``'s block where ``mask`` (inside the array), 0 elsewhere (module docstring)."""
    return plt.load(ref, mask=jnp.broadcast_to(mask, ref.shape), other=0.0)


def _store(ref, value, mask) -> None:  # noqa: ANN001
    """``ref[...] = value`` where ``mask`` (inside the array) only."""
    plt.store(ref, value, mask=jnp.broadcast_to(mask, ref.shape))


def _i(k: int) -> jax.Array:
    """A static index into a ref's view (the interpreter's masked loads take no bare int)."""
    return jnp.int32(k)


def _col_mask(n1: int, n2: int) -> jax.Array:
    """Which of this program's BC columns are inside the tensor."""
    t = pl.program_id(0)
    nb2 = _blocks(n1, n2)[1]
    return (t % nb2) * BC + jax.lax.broadcasted_iota(jnp.int32, (BC,), 0) < n2


def _row_base(n1: int, n2: int) -> jax.Array:
    """This program's first row (read outside the sub-tile loop: the interpreter gives
    ``program_id`` only there)."""
    return (pl.program_id(0) // _blocks(n1, n2)[1]) * RP


def _col_base(n1: int, n2: int) -> jax.Array:
    """This program's first column."""
    return (pl.program_id(0) % _blocks(n1, n2)[1]) * BC


def _row_mask(base: jax.Array, n1: int, s: jax.Array, br: int = BR) -> jax.Array:
    """Which of the ``br`` rows of sub-tile ``s`` of the block from row ``base`` are inside
    the tensor."""
    return base + s * br + jax.lax.broadcasted_iota(jnp.int32, (br,), 0) < n1


def _rows(s: jax.Array, br: int = BR) -> Any:
    """The rows of sub-tile ``s`` in a program's block (a dynamic slice of ``br``)."""
    return pl.ds(pl.multiple_of(s * br, br), br)


def _accumulate(g, p, m_ref, r_ref, dec_ref, valid, rows):  # noqa: ANN001, ANN202
    """The updated momenta and second moment of a sub-tile, ``rsqrt(rms + 1e-6)``, and the
    old momenta and second moment (0 outside the tensor)."""
    old = [_load(m_ref.at[rows, :, _i(k)], valid) for k in range(3)]
    ms = [dec_ref[k] * old[k] + (1 - dec_ref[k]) * g for k in range(3)]
    c = jnp.clip(dec_ref[3], 0.0, 1.0)
    old.append(_load(r_ref.at[rows], valid))
    rms = c * old[3] + (1 - c) * (g * g)
    return ms, rms, jax.lax.rsqrt(rms + 1e-6), old


def _col_factors(f2_ref, at, c_ok):  # noqa: ANN001, ANN202
    """Per decay k, the factor along axis 2 of this program's columns ``[1, BC]`` (loaded
    once per program; ``at``: :func:`_place`)."""
    return [_load(f2_ref.at[at.l, _i(k), at.cols], c_ok)[None, :] for k in range(3)]


def _factors(f1_ref, at, col, r_ok, s, row_on_1):  # noqa: ANN001, ANN202
    """Per decay k, the row factor and the column factor of sub-tile ``s``, broadcastable
    to it (``col``: :func:`_col_factors`)."""
    out = []
    for k in range(3):
        # factor of decay k along axis 1
        a = _load(f1_ref.at[at.l, _i(k), at.rows(s)], r_ok)[:, None]
        b = col[k]  # along axis 2
        out.append((a, b) if row_on_1 else (b, a))
    return out


class _Place:
    """Where a program is in the group's per-tensor arrays: its tensor's index ``l`` in the
    group (read from the kernel's ``idx`` input), the slice of its columns ``cols`` and
    ``rows(s)``, the rows of its sub-tile ``s``, both in the tensor's coordinates; ``br``
    the rows of a sub-tile (RP // br sub-tiles per block)."""

    def __init__(self, idx_ref, n1: int, n2: int, br: int = BR) -> None:  # noqa: ANN001
        assert RP % br == 0
        self.l, self.br = idx_ref[0], br
        self.base = _row_base(n1, n2)
        self.cols = pl.ds(pl.multiple_of(_col_base(n1, n2), BC), BC)

    def rows(self, s: jax.Array) -> Any:
        return pl.ds(pl.multiple_of(self.base + s * self.br, self.br), self.br)


def _sub_tiles(body: Any, init: Any, br: int = BR) -> Any:
    """``body(s, carry)`` over the program's RP // ``br`` sub-tiles (a loop, not
    unrolled)."""
    return jax.lax.fori_loop(0, RP // br, body, init)


def _elem_features(g, p, ms, rms, r, factors):  # noqa: ANN001, ANN202
    """The 16 per-element features (:data:`ELEM`) of a [BR, BC] block, unnormalized."""
    feats = [g, p, *ms, rms, *(m * r for m in ms), r]
    # g·(rf·cf), m·(rf·cf): the factors' product first, as torch's kernels
    ff = [rf * cf for rf, cf in factors]
    fg = [g * f for f in ff]
    fm = [m * f for m, f in zip(ms, ff, strict=True)]
    return feats + fg + fm


def _tile_reader(at, dec_ref, g_ref, p_ref, m_ref, r_ref, f1_ref, f2_ref, *, n1, n2,
                 row_on_1, features, clip=None):  # noqa: ANN001, ANN202
    """What every kernel reads per sub-tile: ``(c_ok, read)``, ``c_ok`` the program's column
    mask and ``read(s)`` -> ``(rows, r_ok, valid, ms, rms, feats, p, old)`` for sub-tile
    ``s``: its rows (in the program's block) and masks, the updated accumulators,
    ``features`` (unnormalized) of the gradient (clipped to ±``clip`` when given), the
    parameter, and the old accumulators
    (``at``: :class:`_Place`)."""
    c_ok = _col_mask(n1, n2)
    base = at.base
    col = _col_factors(f2_ref, at, c_ok)

    def read(s):  # noqa: ANN001, ANN202
        rows = _rows(s, at.br)
        r_ok = _row_mask(base, n1, s, at.br)
        valid = r_ok[:, None] & c_ok[None, :]
        g = _load(g_ref.at[rows], valid)
        if clip is not None:
            g = jnp.clip(g, -clip, clip)
        p = _load(p_ref.at[rows], valid)
        ms, rms, r, old = _accumulate(g, p, m_ref, r_ref, dec_ref, valid, rows)
        feats = features(g, p, ms, rms, r, _factors(f1_ref, at, col, r_ok, s, row_on_1))
        return rows, r_ok, valid, ms, rms, feats, p, old

    return c_ok, read


def _stats_kernel(idx_ref, dec_ref, g_ref, p_ref, m_ref, r_ref, f1_ref, f2_ref, o_ref, *, n1,
                  n2, row_on_1):  # noqa: ANN001
    _, read = _tile_reader(_Place(idx_ref, n1, n2), dec_ref, g_ref, p_ref, m_ref, r_ref,
                           f1_ref, f2_ref, n1=n1, n2=n2, row_on_1=row_on_1,
                           features=_elem_features)

    def sub_tile(s, acc):  # noqa: ANN001, ANN202
        _, _, valid, _, _, feats, _, _ = read(s)
        return tuple(a + jnp.where(valid, f * f, 0.0) for a, f in zip(acc, feats, strict=True))

    acc = _sub_tiles(sub_tile, tuple(jnp.zeros((BR, BC), jnp.float32) for _ in ELEM))
    lanes = jax.lax.broadcasted_iota(jnp.int32, (16,), 0)
    out = jnp.zeros((16,), jnp.float32)
    for k, a in enumerate(acc):
        out = jnp.where(lanes == k, jnp.sum(a), out)
    o_ref[...] = out


def _cat(fs):  # noqa: ANN001, ANN202
    """A power-of-two number of equal-shape arrays ``[..]`` → ``[.., 2, .., 2]`` whose last
    axes flattened hold ``fs[i]`` at ``i``: pairs ``len/2`` apart joined on a new last axis
    (Triton's ``join``, the one concatenation its Pallas lowering has), then pairs of those."""
    while len(fs) > 1:
        half = len(fs) // 2
        fs = [jnp.stack([fs[i], fs[i + half]], axis=-1) for i in range(half)]
    return fs[0]


def _fused_kernel(idx_ref, dec_ref, w16_ref, b0_ref, wh_ref, bh_ref, wl_ref, bl_ref, g_ref,
                  p_ref, m_ref, r_ref, f1_ref, f2_ref, t1_ref, t2_ref, s_ref, mo_ref, ro_ref,
                  *, n1, n2, row_on_1, nhid, hp, exp_mult, step_mult, mode):  # noqa: ANN001
    at = _Place(idx_ref, n1, n2)
    c_ok, read = _tile_reader(at, dec_ref, g_ref, p_ref, m_ref, r_ref, f1_ref, f2_ref, n1=n1,
                              n2=n2, row_on_1=row_on_1, features=_elem_features)
    # loaded once per program: this program's columns' first-layer terms plus the bias
    # [BC, HP], the tensor's per-element first-layer rows with its normalizers folded in
    # [2, 16, HP] and the hidden and output layers
    t2 = _load(t2_ref.at[at.l, at.cols], c_ok[:, None]) + b0_ref[...]
    w16 = (w16_ref[at.l, 0], w16_ref[at.l, 1])
    wh = [(wh_ref[i, 0], wh_ref[i, 1]) for i in range(nhid)]
    bh = [bh_ref[i, :][None, :] for i in range(nhid)]
    wl0, wl1 = wl_ref[0, :][None, :], wl_ref[1, :][None, :]
    bl0, bl1 = bl_ref[0], bl_ref[1]
    n = BR * BC

    def sub_tile(s, carry):  # noqa: ANN001, ANN202
        rows, r_ok, valid, ms, rms, feats, _, _ = read(s)
        t1 = _load(t1_ref.at[at.l, at.rows(s)], r_ok[:, None])
        # the first layer as the torch kernel's: the 16 raw features as one [n, 16] operand
        # times the normalized rows on the tensor cores, the axis terms and the bias as the
        # accumulator they are added to
        x = _cat(feats).reshape(n, len(ELEM))
        ab = (t1[:, None, :] + t2[None, :, :]).reshape(n, hp)
        h = jnp.maximum(_dot3(x, w16, ab, mode), 0.0)
        for i in range(nhid):
            # the products from zero, then the bias (torch's _mlp_tail: not the bias as the
            # first accumulator, which would add it before the products)
            h = _dot3(_mma_to_operand(h, hp), wh[i], jnp.zeros((n, hp), jnp.float32), mode) \
                + bh[i]
            h = jnp.maximum(h, 0.0)
        direction = jnp.sum(h * wl0, axis=1) + bl0
        magnitude = jnp.sum(h * wl1, axis=1) + bl1
        step = direction * jnp.exp(magnitude * exp_mult) * step_mult
        _store(s_ref.at[rows], step.reshape(BR, BC), valid)
        for k in range(3):
            _store(mo_ref.at[rows, :, _i(k)], ms[k], valid)
        _store(ro_ref.at[rows], rms, valid)
        return carry

    _sub_tiles(sub_tile, jnp.int32(0))


def _pad_cols(w: Any, n: int) -> Any:
    return jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, n - w.shape[-1])])


class SmallFCKernels:
    """The Pallas per-element pass of small_fc_lopt for 2-D factored shape groups."""

    def __init__(self, hp: spec.SmallFCLOpt, meta: Mapping[str, Any], precision: str) -> None:
        self.hp, self.meta, self.precision = hp, meta, precision
        width = int(hp.hidden_size)
        self.hp_ = max(16, 1 << (width - 1).bit_length())
        self.nl = int(hp.hidden_layers)

    def handles(self, shape: tuple[int, ...]) -> bool:
        return two_d_view(shape) is not None

    def _pair(self, w: Any) -> Any:
        """``w`` as :func:`_dot3` reads it: its TF32 halves in exact mode (on every device, as
        torch's kernels), else ``w`` and zeros (stacked on axis -3)."""
        if _dot_mode(self.precision) == "tf32x3":
            return split_tf32(w)
        return jnp.stack([w, jnp.zeros_like(w)], axis=-3)

    def _weights(self, tf: Any) -> dict[str, Any]:
        meta, hp_, nl = self.meta, self.hp_, self.nl
        nf = spec.num_param_features(self.hp)
        w0 = jnp.asarray(meta["mlp/w0"], jnp.float32)
        b0 = jnp.asarray(meta["mlp/b0"], jnp.float32)
        # the time features are the same for every element: folded into the first bias
        b0t = b0 + jnp.sum(tf[:, None] * w0[nf:], axis=0)  # (torch's SmallFCTriton._body)
        wh = [_pad_cols(jnp.pad(jnp.asarray(meta[f"mlp/w{i}"], jnp.float32),
                                [(0, hp_ - int(meta[f"mlp/w{i}"].shape[0])), (0, 0)]), hp_)
              for i in range(1, nl)]
        bh = [_pad_cols(jnp.asarray(meta[f"mlp/b{i}"], jnp.float32), hp_)
              for i in range(1, nl)]
        wl = jnp.asarray(meta[f"mlp/w{nl}"], jnp.float32)[:, :2]
        wl = jnp.pad(wl, [(0, hp_ - wl.shape[0]), (0, 0)]).T  # [2, HP]
        return dict(
            w0=_pad_cols(w0[:nf], hp_), b0=_pad_cols(b0t, hp_)[None, :],
            # rows relabeled as the kernel's activations (_mma_to_operand)
            wh=self._pair(jnp.stack(wh)[:, _operand_perm(hp_)]) if wh
            else jnp.zeros((1, 2, hp_, hp_), jnp.float32),
            bh=jnp.stack(bh) if bh else jnp.zeros((1, hp_), jnp.float32),
            wl=wl, bl=jnp.asarray(meta[f"mlp/b{nl}"], jnp.float32)[:2])

    def __call__(self, shape: tuple[int, ...], p: Any, g: Any, m: Any, rms: Any, v_row: Any,
                 v_col: Any, v_diag: Any, *, tf: Any, decays: tuple[Any, Any, Any],
                 aux: dict | None = None, stage: Any = None) -> tuple[list[Any], ...]:
        """One shape group, each argument the group's tensors (a sequence, or an array
        stacked on axis 0): ``(step, m, rms, v_row, v_col, v_diag)``, each a list of the
        tensors', as :func:`xopt.specs.small_fc_lopt.compute_step` per tensor. The kernels
        read and write each tensor's own arrays (no copy into a stacked group and back);
        the per-tensor statistics, normalizers and axis terms are computed for the group at
        once. ``aux``, if given, receives the statistics kernels' output as it came
        (``"stats"``: per block, the tensors' in order) and the normalizers' statistic
        (``"feature_sq_mean"`` [L, F], the spec's order). ``stage(name, fn, *args)`` runs
        each of the four stages (module docstring; default: ``fn(*args)``), so that a
        benchmark can time them apart on their real inputs."""
        stage = stage or run_stage
        p, g, m, rms, v_row, v_col, v_diag = (list(x) for x in (p, g, m, rms, v_row, v_col,
                                                                v_diag))
        pre = stage("prep", functools.partial(self.prep, shape), v_row, v_col, v_diag, g,
                    *decays)
        part = stage("stats", functools.partial(self.stats, shape), pre, g, p, m, rms)
        norm = stage("norm", functools.partial(self.normalize, shape), pre, part, tf)
        if aux is not None:
            aux.update(stats=part, feature_sq_mean=norm["feature_sq_mean"])
        step, m_new, rms_new = stage("fused", functools.partial(self.fused, shape), pre, norm,
                                     g, p, m, rms)
        return step, m_new, rms_new, pre["new_row"], pre["new_col"], v_diag

    def prep(self, shape: tuple[int, ...], v_row: Any, v_col: Any, v_diag: Any, g: Any,
             mom_d: Any, rms_d: Any, fac_d: Any) -> dict[str, Any]:
        """Stage 1 (XLA): the new Adafactor statistics, the row and column factors and
        features, the axis features' sums of squares and the decays the kernels read."""
        return _axis_prep(shape, v_row, v_col, v_diag, g, mom_d, rms_d, fac_d)

    def stats(self, shape: tuple[int, ...], pre: dict, g: Any, p: Any, m: Any,
              rms: Any) -> Any:
        """Stage 2 (:func:`_stats_kernel`, one call per tensor): Σ feature² of the
        per-element features, per block ``[L · blocks, 16]``."""
        return _stats_call(_stats_kernel, 16, "sfc_stats", shape, pre, g, p, m, rms)

    def normalize(self, shape: tuple[int, ...], pre: dict, part: Any, tf: Any) -> dict:
        """Stage 3 (XLA): the normalizers, the axis features' first-layer terms and the
        weights as the fused kernel reads them."""
        n1, n2, row_on_1 = two_d_view(shape)
        L = part.shape[0] // _index_maps(n1, n2)[2]
        elem_sq = jnp.sum(part.reshape(L, -1, 16), axis=1)  # [L, 16]
        row_sq, col_sq = pre["row_sq"], pre["col_sq"]
        sq = jnp.concatenate([elem_sq[:, :13], row_sq[:, :3], col_sq[:, :3], row_sq[:, 3:],
                              col_sq[:, 3:], elem_sq[:, 13:]], axis=1)  # [L, 28] spec order
        inv = jax.lax.rsqrt(1e-5 + sq / float(n1 * n2))
        w = self._weights(tf)
        w0 = w["w0"]
        row_rows = np.array([13, 14, 15, 19, 20, 21])
        col_rows = np.array([16, 17, 18, 22, 23, 24])
        t_row = _axis_terms(pre["row_feats"], inv[:, row_rows, None] * w0[row_rows][None])
        t_col = _axis_terms(pre["col_feats"], inv[:, col_rows, None] * w0[col_rows][None])
        t1, t2 = (t_row, t_col) if row_on_1 else (t_col, t_row)
        # the per-element features' first-layer rows times the tensor's normalizers [L, 16,
        # HP], as torch's sfc_norm_kernel folds them
        w16 = self._pair(inv[:, np.array(ELEM), None] * w0[np.array(ELEM)][None])
        return dict(w16=w16, b0=w["b0"],
                    wh=w["wh"], bh=w["bh"], wl=w["wl"], bl=w["bl"], t1=t1, t2=t2,
                    feature_sq_mean=sq / float(n1 * n2))

    def fused(self, shape: tuple[int, ...], pre: dict, norm: dict, g: Any, p: Any, m: Any,
              rms: Any) -> tuple[list[Any], list[Any], list[Any]]:
        """Stage 4 (:func:`_fused_kernel`, one call per tensor): ``(step, m, rms)``, each a
        list of the tensors' (their shapes)."""
        n1, n2, row_on_1 = two_d_view(shape)
        hp_ = self.hp_
        _, _, per, elem = _index_maps(n1, n2)
        whole, blk, blk_m, group = _element_specs(elem)
        kern = functools.partial(
            _fused_kernel, n1=n1, n2=n2, row_on_1=row_on_1, nhid=self.nl - 1, hp=hp_,
            exp_mult=float(self.hp.exp_mult), step_mult=float(self.hp.step_mult),
            mode=_dot_mode(self.precision))
        full = lambda *shape: pl.BlockSpec(shape, lambda t: (0,) * len(shape))  # noqa: E731
        call = pl.pallas_call(
            kern,
            out_shape=(jax.ShapeDtypeStruct((n1, n2), jnp.float32),
                       jax.ShapeDtypeStruct((n1, n2, 3), jnp.float32),
                       jax.ShapeDtypeStruct((n1, n2), jnp.float32)),
            grid=(per,),
            in_specs=[pl.BlockSpec((1,), whole), pl.BlockSpec((8,), whole), group,
                      full(1, hp_), full(*norm["wh"].shape), full(*norm["bh"].shape),
                      full(2, hp_), pl.BlockSpec((2,), whole),
                      blk, blk, blk_m, blk, group, group, group, group],
            out_specs=[blk, blk_m, blk],
            # m and rms updated in place: as results of their own they would be copied
            # into the donated state's buffers after the call (two copies per tensor)
            input_output_aliases={10: 1, 11: 2},
            interpret=_on_cpu(), compiler_params=_compiler_params(), name="sfc_fused",
        )
        outs = [call(_index(i), pre["decs"], norm["w16"], norm["b0"], norm["wh"], norm["bh"],
                     norm["wl"], norm["bl"], *_element_views(shape, *a), pre["f1"],
                     pre["f2"], norm["t1"], norm["t2"])
                for i, a in enumerate(zip(g, p, m, rms, strict=True))]
        return _per_tensor_outputs(outs, p, m, rms)


def run_stage(name: str, fn: Any, *args: Any) -> Any:
    """The default stage runner: ``fn(*args)`` (a benchmark passes one that times it)."""
    del name
    return fn(*args)


def _index(i: int) -> Any:
    """A tensor's index in its group, the kernels' ``idx`` input (data, not a constant of
    the kernel, so that a group's calls are one kernel, compiled once)."""
    return jnp.full((1,), i, jnp.int32)


def _element_views(shape: tuple[int, ...], g: Any, p: Any, m: Any, rms: Any) -> list[Any]:
    """One tensor's ``g``, ``p``, ``m``, ``rms`` as ``[N1, N2(, 3)]`` (reshapes)."""
    n1, n2, _ = two_d_view(shape)
    return [g.reshape(n1, n2), p.reshape(n1, n2), m.reshape(n1, n2, 3), rms.reshape(n1, n2)]


def _per_tensor_outputs(outs: list[Any], p: list[Any], m: list[Any],
                        rms: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """The fused kernels' ``(step, m, rms)`` per tensor → three lists, each array in its
    tensor's shape (reshapes)."""
    return ([o[0].reshape(x.shape) for o, x in zip(outs, p, strict=True)],
            [o[1].reshape(x.shape) for o, x in zip(outs, m, strict=True)],
            [o[2].reshape(x.shape) for o, x in zip(outs, rms, strict=True)])


#: tensors per call of :func:`split_rows`'s copy kernel: each is one of the kernel's pointer
#: arguments, and every call has this many (a group's last call padded with outputs it does
#: not write), so that the calls on one stacked array are one Triton kernel, compiled once
#: (the IR holds the arrays' sizes, so arrays of other sizes are other kernels)
SPLIT_K = 32
#: programs per tensor of the copy kernel, and the elements one moves at a time
SPLIT_G = 4
SPLIT_BLOCK = 512


def _copy_row(tab_ref, k: int, g: Any, src: Any, dst: Any, src_at_off: bool) -> None:  # noqa: ANN001
    """Blocks ``g, g + SPLIT_G, …`` of table row ``k``'s ``n`` elements (``(off, n)`` its
    row; a placeholder has ``n = 0``): ``dst[j] = src[off + j]`` (``src_at_off``), else
    ``dst[off + j] = src[j]``, for ``j < n``."""
    lanes = jax.lax.broadcasted_iota(jnp.int32, (SPLIT_BLOCK,), 0)
    span = SPLIT_G * SPLIT_BLOCK
    off, n = tab_ref[2 * k], tab_ref[2 * k + 1]
    s_off, d_off = (off, 0) if src_at_off else (0, off)

    def block(s, carry):  # noqa: ANN001, ANN202
        j = g * SPLIT_BLOCK + s * span
        ok = j + lanes < n
        v = plt.load(src.at[pl.ds(s_off + j, SPLIT_BLOCK)], mask=ok, other=0.0)
        plt.store(dst.at[pl.ds(d_off + j, SPLIT_BLOCK)], v, mask=ok)
        return carry

    jax.lax.fori_loop(0, (n - g * SPLIT_BLOCK + span - 1) // span, block, 0)


def _split_kernel(tab_ref, src_ref, *out_refs):  # noqa: ANN001
    """Program ``t`` copies blocks ``g, g + SPLIT_G, …`` (``g = t % SPLIT_G``) of output
    ``t // SPLIT_G``: ``out[j] = src[off + j]`` for ``j < n``, ``(off, n)`` its row of the
    table (data: a placeholder output has ``n = 0``)."""
    t = pl.program_id(0)
    r, g = t // SPLIT_G, t % SPLIT_G
    for k, o_ref in enumerate(out_refs):
        pl.when(r == k)(functools.partial(_copy_row, tab_ref, k, g, src_ref, o_ref, True))


def _join_kernel(tab_ref, *refs):  # noqa: ANN001
    """:func:`_split_kernel`'s converse: ``dst[off + j] = in[j]`` for ``j < n`` of input
    ``t // SPLIT_G`` (``refs``: the inputs, then ``dst``)."""
    *in_refs, dst_ref = refs
    t = pl.program_id(0)
    r, g = t // SPLIT_G, t % SPLIT_G
    for k, i_ref in enumerate(in_refs):
        pl.when(r == k)(functools.partial(_copy_row, tab_ref, k, g, i_ref, dst_ref, False))


def _copy_table(rows: range, e: int, base: int = 0) -> Any:
    """The copy kernels' table for a call on ``rows``: each row's offset in the stacked
    array (from row ``base``) and its length (a placeholder: 0, 0)."""
    tab = np.zeros((2 * SPLIT_K,), np.int32)
    tab[0:2 * len(rows):2] = [(i - base) * e for i in rows]
    tab[1:2 * len(rows):2] = e
    return jnp.asarray(tab)


# One call of each copy kernel per array size, as a jitted function: identical calls (the
# chunks of every group of one tensor size) are traced and lowered once, not once each (a
# call's kernel has SPLIT_K branches: tracing and lowering it is ~0.5 s of host time).
@functools.partial(jax.jit, static_argnames=("interpret",))
def _stack_chunk(tab: Any, *ins: Any, interpret: bool) -> Any:
    e = ins[0].shape[0]
    return pl.pallas_call(
        _join_kernel,
        out_shape=jax.ShapeDtypeStruct((SPLIT_K * e,), jnp.float32),
        grid=(SPLIT_K * SPLIT_G,),
        in_specs=[pl.no_block_spec] * (1 + SPLIT_K), out_specs=pl.no_block_spec,
        interpret=interpret, compiler_params=_compiler_params(), name="stack_rows",
    )(tab, *ins)


@functools.partial(jax.jit, static_argnames=("e", "interpret"))
def _split_chunk(tab: Any, src: Any, *, e: int, interpret: bool) -> list[Any]:
    return pl.pallas_call(
        _split_kernel,
        out_shape=[jax.ShapeDtypeStruct((e,), jnp.float32)] * SPLIT_K,
        grid=(SPLIT_K * SPLIT_G,),
        in_specs=[pl.no_block_spec, pl.no_block_spec],
        out_specs=[pl.no_block_spec] * SPLIT_K,
        interpret=interpret, compiler_params=_compiler_params(), name="split_rows",
    )(tab, src)


def stack_rows(xs: Sequence[Any]) -> Any:
    """``jnp.stack(xs)`` (float32 arrays of one shape) written by a Pallas copy kernel,
    :data:`SPLIT_K` tensors a call: XLA lays a stacked array out as its consumers prefer,
    and where that is not the tensors' own layout (a state array's channels first) it
    transposes each tensor in a kernel of its own; a kernel's output is in the tensors'
    layout, transposed (if at all) once for the group. Exact copies."""
    xs = list(xs)
    shape = tuple(xs[0].shape)
    e = int(np.prod(shape, dtype=np.int64))
    if len(xs) == 1 or e == 0:
        return jnp.stack(xs)
    assert all(x.dtype == jnp.float32 and x.shape == shape for x in xs), shape
    assert SPLIT_K * e < 2**31, shape
    parts = []
    for c in range(0, len(xs), SPLIT_K):
        rows = range(c, min(c + SPLIT_K, len(xs)))
        # placeholders: the first input again (not read: length 0)
        ins = [xs[i].reshape(e) for i in rows] + [xs[c].reshape(e)] * (SPLIT_K - len(rows))
        parts.append(_stack_chunk(_copy_table(rows, e, c), *ins,
                                  interpret=_on_cpu())[:len(rows) * e])
    return jnp.concatenate(parts).reshape(len(xs), *shape)


def split_rows(x: Any, shape: tuple[int, ...]) -> list[Any]:
    """``[x[i].reshape(shape) for i in range(len(x))]`` (float32 ``x`` stacked on axis 0)
    written by a Pallas copy kernel, :data:`SPLIT_K` tensors a call, rather than by XLA:
    XLA:GPU copies each slice of a stacked array that is a result of the program in a
    kernel of its own, one per tensor and array, each compiled apart. Exact copies. Each
    call reads the whole array, padded to a multiple of :data:`SPLIT_K` rows, so that the
    calls on arrays of one size and as many chunks are the same call."""
    L = int(x.shape[0])
    e = int(np.prod(shape, dtype=np.int64))
    if L == 1 or e == 0:  # a reshape, or nothing to copy
        return [x[i].reshape(shape) for i in range(L)]
    assert x.dtype == jnp.float32 and SPLIT_K * e < 2**31, (x.dtype, x.shape)
    chunks = -(-L // SPLIT_K)
    flat = x.reshape(L * e)
    if chunks * SPLIT_K != L:  # (rows past L: never read, no table row names them)
        flat = jnp.pad(flat, (0, (chunks * SPLIT_K - L) * e))
    out = []
    for c in range(0, L, SPLIT_K):
        rows = range(c, min(c + SPLIT_K, L))
        got = _split_chunk(_copy_table(rows, e), flat, e=e, interpret=_on_cpu())
        out += [o.reshape(shape) for o in got[:len(rows)]]
    return out


def _axis_prep(shape: tuple[int, ...], v_row: list[Any], v_col: list[Any],
               v_diag: list[Any], g: list[Any], mom_d: Any, rms_d: Any,
               fac_d: Any) -> dict[str, Any]:
    """Both methods' first stage: the new ``v_row``/``v_col`` (the spec's
    ``factored_update``, as the method feeds it: lists), their factors per axis ``f1``
    [L, 3, N1], ``f2`` [L, 3, N2], the row and column features [L, n, 6] and their sums of
    squares over the tensor [L, 6], and the kernels' decays [8].

    ``factored_update``'s expressions, split where the group can share them: the means of
    ``g² + 1e-30`` over each axis per tensor (a reduction of its own gradient), then the
    accumulators' update on the group's means stacked (one op for the group, not one per
    tensor; the old statistics stacked by :func:`stack_rows`, each tensor's new ones written
    by :func:`split_rows`): the same operations on the same operands."""
    del v_diag  # (a placeholder for a factored tensor)
    L = len(g)
    _, _, row_on_1 = two_d_view(shape)
    d1, d0 = lopt.factored_dims(shape)
    c = arrays.clip(jnp, fac_d, 0.0, 1.0)
    mix = 1.0 - c
    sq = [x * x + 1e-30 for x in g]
    mean_row = jnp.stack([arrays.mean(jnp, x, (d0,)) for x in sq])
    mean_col = jnp.stack([arrays.mean(jnp, x, (d1,)) for x in sq])
    new_row = c * stack_rows(v_row) + mix * mean_row[..., None]
    new_col = c * stack_rows(v_col) + mix * mean_col[..., None]
    vr2 = new_row.reshape(L, -1, 3)  # [L, positions of the v_row axis, 3]
    vc2 = new_col.reshape(L, -1, 3)
    rcm = jnp.mean(vr2, axis=1, keepdims=True)
    # v_row / (rcm + 1e-9) correctly rounded, as torch's kernels divide (XLA multiplies by
    # the reciprocal of a broadcast divisor on the CPU, and its GPU division is not IEEE)
    rf = lopt.safe_rsqrt(jnp, arrays.divide(jnp, vr2, rcm + 1e-9))
    cf = lopt.safe_rsqrt(jnp, vc2)
    f1, f2 = (rf, cf) if row_on_1 else (cf, rf)
    # the row/column features: v_row, v_col, rsqrt(v + 1e-8) of each
    row_feats = jnp.concatenate([vr2, jax.lax.rsqrt(vr2 + 1e-8)], axis=-1)  # [L, n, 6]
    col_feats = jnp.concatenate([vc2, jax.lax.rsqrt(vc2 + 1e-8)], axis=-1)
    # a feature of one axis summed over a tensor: the other axis's length times its sum
    row_sq = jnp.sum(row_feats * row_feats, axis=1) * vc2.shape[1]
    col_sq = jnp.sum(col_feats * col_feats, axis=1) * vr2.shape[1]
    decs = jnp.concatenate([mom_d, rms_d, jnp.zeros((4,), jnp.float32)])  # [8]
    return dict(new_row=split_rows(new_row, new_row.shape[1:]),
                new_col=split_rows(new_col, new_col.shape[1:]), f1=jnp.swapaxes(f1, 1, 2),
                f2=jnp.swapaxes(f2, 1, 2), row_feats=row_feats, col_feats=col_feats,
                row_sq=row_sq, col_sq=col_sq, decs=decs)


def _axis_terms(feats: Any, wn: Any) -> Any:
    """The first-layer terms of one axis's 6 features, ``Σ_k f_k · wn_k`` [L, n, HP] from
    ``feats`` [L, n, 6] and ``wn`` [L, 6, HP] (each feature's first-layer row times the
    tensor's normalizer), added from zero in the features' order, as torch's kernels
    (xopt.kernels.small_fc_lopt.sfc_axis_kernel, xopt.kernels.velo._axis_terms)."""
    h = jnp.zeros(feats.shape[:2] + wn.shape[-1:], jnp.float32)
    for k in range(feats.shape[-1]):
        h = h + feats[:, :, k, None] * wn[:, None, k, :]
    return h


def _stats_call(kernel: Any, width: int, name: str, shape: tuple[int, ...], pre: dict,
                g: list[Any], p: list[Any], m: list[Any], rms: list[Any]) -> Any:
    """A statistics kernel over a group, one call per tensor: ``[L · blocks, width]``
    per-block sums, the tensors' blocks in order."""
    n1, n2, row_on_1 = two_d_view(shape)
    _, _, per, elem = _index_maps(n1, n2)
    whole, blk, blk_m, group = _element_specs(elem)
    call = pl.pallas_call(
        functools.partial(kernel, n1=n1, n2=n2, row_on_1=row_on_1),
        out_shape=jax.ShapeDtypeStruct((per, width), jnp.float32), grid=(per,),
        in_specs=[pl.BlockSpec((1,), whole), pl.BlockSpec((8,), whole), blk, blk, blk_m, blk,
                  group, group],
        out_specs=pl.BlockSpec((SQ, width), lambda t: (t, 0)),
        interpret=_on_cpu(), compiler_params=_compiler_params(), name=name,
    )
    return jnp.concatenate([call(_index(i), pre["decs"], *_element_views(shape, *a),
                                 pre["f1"], pre["f2"])
                            for i, a in enumerate(zip(g, p, m, rms, strict=True))])


# -- VeLO --------------------------------------------------------------------------------------

#: VeLO's per-element MLP input channels the kernels compute (the others are the 12 row and
#: column features), in this order: g, clip(g, ±0.1), p, m (3), rms, m·rsqrt(rms) (3),
#: rsqrt(rms), fac_g (3), g·rsqrt(rms), m·row_factor·col_factor (3)
VELO_ELEM = tuple(range(15)) + (27, 28, 29)
VELO_ROW = (15, 16, 17, 21, 22, 23)
VELO_COL = (18, 19, 20, 24, 25, 26)
#: per-tensor scalars: the first layer's element rows times their normalizers (18 × 4), then
#: the biases, hidden and output layers (offsets in :class:`VeLOKernels`), lr_mult, param_scale
VELO_SCAL = 256
#: the statistics kernel's per-block columns after the 18 channels' Σ feature² (VELO_ELEM):
#: Σ p², Σ of the old m (3) and rms, their sums of squared deviations from the block's means
#: (m (3), rms) and the block's element count
VELO_P2, VELO_OLD, VELO_DEV, VELO_N = 18, slice(19, 23), slice(23, 27), 27
#: rows of the VeLO fused kernel's sub-tile: 4 (two elements per thread, loaded as pairs)
#: rather than BR's 2, since its registers allow it (sm_90: 72 per thread against 56, all
#: 128-thread programs; small_fc_lopt's tensor-core MLP would spill at 4)
VELO_FUSED_BR = 4


def unsupported_velo(hp: Any) -> str | None:
    """Why the VeLO kernels cannot run these hyperparameters (None: they can)."""
    if not 1 <= int(hp.ff_hidden_size) <= 4 or int(hp.ff_hidden_layers) < 1 \
            or int(hp.ff_hidden_layers) > 4:
        return ("the kernels run per-element MLPs up to 4 wide with 1 to 4 hidden layers "
                f"(got ff_hidden_size={hp.ff_hidden_size}, "
                f"ff_hidden_layers={hp.ff_hidden_layers})")
    return None


def _velo_elem_features(g, p, ms, rms, r, factors):  # noqa: ANN001, ANN202
    """VeLO's 18 per-element channels (:data:`VELO_ELEM`) of a block, unnormalized; ``g``
    already clipped to ±1000."""
    ff = [rf * cf for rf, cf in factors]  # the factors' product first, as torch's kernel
    fg = [g * f for f in ff]
    fm = [m * f for m, f in zip(ms, ff, strict=True)]
    return [g, jnp.clip(g, -0.1, 0.1), p, *ms, rms, *(m * r for m in ms), r, *fg, g * r, *fm]


def _velo_stats_kernel(idx_ref, dec_ref, g_ref, p_ref, m_ref, r_ref, f1_ref, f2_ref, o_ref, *,
                       n1, n2, row_on_1):  # noqa: ANN001
    """Per block: Σ feature² of the 18 channels (:data:`VELO_ELEM`), Σ p², Σ of the old
    momenta and second moment, and for the LSTM's variances the old momenta's and second
    moment's sums of squared deviations from the block's means (:data:`VELO_DEV`) and the
    block's element count: each lane's by Welford's update over its sub-tiles (a lane's
    elements inside the tensor are its first ones, so its count at sub-tile ``s`` is
    ``s + 1``), the lanes' combined by Chan's (Σ of theirs plus each lane's count times its
    mean's squared distance to the block's), so that the variances need no second pass over
    the momenta (:meth:`VeLOKernels.lstm_inputs` combines the blocks the same way)."""
    at = _Place(idx_ref, n1, n2)
    c_ok, read = _tile_reader(at, dec_ref, g_ref, p_ref, m_ref, r_ref, f1_ref, f2_ref, n1=n1,
                              n2=n2, row_on_1=row_on_1, features=_velo_elem_features,
                              clip=1000.0)
    z = jnp.zeros((BR, BC), jnp.float32)

    def sub_tile(s, carry):  # noqa: ANN001, ANN202
        acc, mean, dev = carry
        _, _, valid, _, _, feats, p, old = read(s)
        # and the LSTM's first pass: Σ p², Σ of the old momenta and second moment (0 outside)
        sums = [jnp.where(valid, f * f, 0.0) for f in feats] + [p * p, *old]
        inv = 1.0 / (s + 1).astype(jnp.float32)
        mean_new, dev_new = [], []
        for x, mu, q in zip(old, mean, dev, strict=True):
            d = x - mu
            mu = jnp.where(valid, mu + d * inv, mu)
            mean_new.append(mu)
            dev_new.append(q + jnp.where(valid, d * (x - mu), 0.0))
        return (tuple(a + x for a, x in zip(acc, sums, strict=True)), tuple(mean_new),
                tuple(dev_new))

    acc, mean, dev = _sub_tiles(sub_tile, (tuple(z for _ in range(len(VELO_ELEM) + 5)),
                                           (z,) * 4, (z,) * 4))
    # each lane's count: its rows inside the tensor (of RP // BR), 0 in a column outside
    lane = at.base + jax.lax.broadcasted_iota(jnp.int32, (BR, 1), 0)
    rows_in = jnp.clip((jnp.maximum(n1 - lane, 0) + BR - 1) // BR, 0, RP // BR)
    cnt = jnp.where(c_ok[None, :], rows_in.astype(jnp.float32), 0.0)
    n_b = (jnp.clip(n1 - at.base, 0, RP) * jnp.clip(n2 - _col_base(n1, n2), 0, BC)).astype(
        jnp.float32)
    cols = [jnp.sum(a) for a in acc]
    for k, (mu, q) in enumerate(zip(mean, dev, strict=True)):
        mean_b = cols[VELO_OLD.start + k] / n_b
        cols.append(jnp.sum(q + cnt * (mu - mean_b) * (mu - mean_b)))
    cols.append(n_b)
    lanes = jax.lax.broadcasted_iota(jnp.int32, (32,), 0)
    out = jnp.zeros((32,), jnp.float32)
    for k, a in enumerate(cols):
        out = jnp.where(lanes == k, a, out)
    o_ref[...] = out


def _velo_fused_kernel(idx_ref, dec_ref, sc_ref, g_ref, p_ref, m_ref, r_ref, f1_ref, f2_ref,
                       t1_ref, t2_ref, s_ref, mo_ref, ro_ref, *, n1, n2, row_on_1, width, nhid,
                       off, exp_mult, step_mult):  # noqa: ANN001
    at = _Place(idx_ref, n1, n2, VELO_FUSED_BR)
    c_ok, read = _tile_reader(at, dec_ref, g_ref, p_ref, m_ref, r_ref, f1_ref, f2_ref, n1=n1,
                              n2=n2, row_on_1=row_on_1, features=_velo_elem_features,
                              clip=1000.0)
    l = at.l

    def w_ref(k):  # noqa: ANN001, ANN202
        return sc_ref[l, k]  # this tensor's scalar k

    t2 = [_load(t2_ref.at[at.l, at.cols, _i(j)], c_ok)[None, :] for j in range(width)]
    ne = len(VELO_ELEM)

    def sub_tile(s, carry):  # noqa: ANN001, ANN202
        rows, r_ok, valid, ms, rms, feats, _, _ = read(s)
        # the first layer in torch's order (xopt.kernels.velo): channel by channel times
        # its row with the normalizer folded in, the axis terms after the channels before
        # them in the spec's order (0-14), then the last three (27-29); float32 FMAs
        h = [feats[0] * w_ref(j) for j in range(width)]
        for k in range(1, ne):
            if k == ne - 3:
                h = [h[j] + (_load(t1_ref.at[at.l, at.rows(s), _i(j)], r_ok)[:, None] + t2[j])
                     for j in range(width)]
            h = [h[j] + feats[k] * w_ref(k * width + j) for j in range(width)]
        h = [jnp.maximum(h[j] + w_ref(off["b0"] + j), 0.0) for j in range(width)]
        for i in range(nhid):  # the bias first, then the products (torch's _dense4)
            w0, b0 = off["wh"] + i * width * width, off["bh"] + i * width
            new = []
            for j in range(width):
                acc = w_ref(b0 + j) + h[0] * w_ref(w0 + j)
                for q in range(1, width):
                    acc = acc + h[q] * w_ref(w0 + q * width + j)
                new.append(jnp.maximum(acc, 0.0))
            h = new
        outs = []
        for c in range(2):
            acc = w_ref(off["bl"] + c) + h[0] * w_ref(off["wl"] + c)
            for q in range(1, width):
                acc = acc + h[q] * w_ref(off["wl"] + q * 2 + c)
            outs.append(acc)
        direction, magnitude = outs
        step = direction * (w_ref(off["scale"]) * jnp.exp(magnitude * exp_mult)) * step_mult
        _store(s_ref.at[rows], w_ref(off["lr"]) * step, valid)
        for k in range(3):
            _store(mo_ref.at[rows, :, _i(k)], ms[k], valid)
        _store(ro_ref.at[rows], rms, valid)
        return carry

    _sub_tiles(sub_tile, jnp.int32(0), at.br)


class VeLOKernels:
    """The Pallas per-element pass of VeLO for 2-D factored shape groups (the per-tensor
    MLP weights mixed by XLA from the LSTM's controls)."""

    def __init__(self, hp: Any, meta: Mapping[str, Any]) -> None:
        self.hp, self.meta = hp, meta
        self.width = int(hp.ff_hidden_size)
        self.nhid = int(hp.ff_hidden_layers) - 1
        ne, w = len(VELO_ELEM), self.width
        off = {"b0": ne * w}
        off["wh"] = off["b0"] + w
        off["bh"] = off["wh"] + self.nhid * w * w
        off["wl"] = off["bh"] + self.nhid * w
        off["bl"] = off["wl"] + 2 * w
        off["lr"] = off["bl"] + 2
        off["scale"] = off["lr"] + 1
        assert off["scale"] < VELO_SCAL
        self.off = off

    def handles(self, shape: tuple[int, ...]) -> bool:
        return two_d_view(shape) is not None

    def __call__(self, shape: tuple[int, ...], p: Any, g: Any, m: Any, rms: Any, v_row: Any,
                 v_col: Any, v_diag: Any, controls: Any, lr_mult: Any, *,
                 decays: tuple[Any, Any, Any], aux: dict | None = None,
                 stage: Any = None) -> tuple[list[Any], ...]:
        """One shape group, the per-element arguments as :meth:`SmallFCKernels.__call__`'s
        (each a sequence of the group's tensors or an array stacked on axis 0), ``controls``
        and ``lr_mult`` stacked: ``(step, m, rms, v_row, v_col, v_diag)``, lists of the
        tensors', as :func:`xopt.specs.velo.update_tensor` per tensor (``aux``, ``stage``:
        as :meth:`SmallFCKernels.__call__`'s). The update is :meth:`first` (before the
        LSTM, whose inputs :meth:`lstm_inputs` takes from its statistics) then
        :meth:`second`."""
        p, g, m, rms, v_row, v_col, v_diag = (list(x) for x in (p, g, m, rms, v_row, v_col,
                                                                v_diag))
        pre, part = self.first(shape, p, g, m, rms, v_row, v_col, v_diag, decays=decays,
                               stage=stage)
        return self.second(shape, pre, part, controls, lr_mult, p, g, m, rms, v_diag, aux=aux,
                           stage=stage)

    def first(self, shape: tuple[int, ...], p: list[Any], g: list[Any], m: list[Any],
              rms: list[Any], v_row: list[Any], v_col: list[Any], v_diag: list[Any], *,
              decays: tuple[Any, Any, Any], stage: Any = None) -> tuple[dict, Any]:
        """Stages 1-2 of a group (lists of its tensors' arrays): ``(pre, part)``, the axis
        statistics and the statistics kernel's per-block sums (the normalizers' and the
        LSTM inputs' first pass)."""
        from xopt.specs import velo as vspec

        stage = stage or run_stage

        def prep(v_row, v_col, v_diag, g, *decays):  # noqa: ANN001, ANN202
            gc = [jnp.clip(x, -vspec.GRAD_CLIP, vspec.GRAD_CLIP) for x in g]
            return _axis_prep(shape, v_row, v_col, v_diag, gc, *decays)

        pre = stage("prep", prep, v_row, v_col, v_diag, g, *decays)
        part = stage("stats", functools.partial(_stats_call, _velo_stats_kernel, 32,
                                                "velo_stats", shape), pre, g, p, m, rms)
        return pre, part

    def second(self, shape: tuple[int, ...], pre: dict, part: Any, controls: Any,
               lr_mult: Any, p: list[Any], g: list[Any], m: list[Any], rms: list[Any],
               v_diag: list[Any], *, aux: dict | None = None,
               stage: Any = None) -> tuple[list[Any], ...]:
        """Stages 3-4 of a group, given the LSTM's ``controls`` and ``lr_mult`` (stacked):
        ``(step, m, rms, v_row, v_col, v_diag)``, lists of the tensors'."""
        stage = stage or run_stage
        norm = stage("norm", functools.partial(self.normalize, shape), pre, part, controls,
                     lr_mult)
        if aux is not None:
            aux.update(stats=part, feature_sq_mean=norm["feature_sq_mean"])
        step, m_new, rms_new = stage("fused", functools.partial(self.fused, shape), pre, norm,
                                     g, p, m, rms)
        return step, m_new, rms_new, pre["new_row"], pre["new_col"], v_diag

    def lstm_inputs(self, shape: tuple[int, ...], part: Any, m: list[Any], rms: list[Any],
                    fraction: Any, loss_feats: Any) -> Any:
        """The group's LSTM inputs [L, 30], :func:`xopt.specs.velo.lstm_features` per tensor
        from the statistics kernel's per-block sums (Σ p², Σ of the old m and rms, their
        sums of squared deviations from each block's means, :func:`_velo_stats_kernel`):
        the spec's means and variances (its two-pass variances as Chan's combination of the
        blocks', as accurate), the scaling by ``rsqrt(max(1e-9, mean p²))`` applied to the
        means and variances instead of to every element."""
        from xopt.specs import velo as vspec

        n1, n2, _ = two_d_view(shape)
        n, L = float(n1 * n2), len(m)
        blocks = part.reshape(L, -1, 32)
        sums = jnp.sum(blocks, axis=1)  # [L, 32]
        mean4 = sums[:, VELO_OLD] / n  # the old momenta's and rms's means [L, 4]
        mu = mean4[:, :3]
        # Chan's combination of the blocks: Σ of their deviations from their own means plus
        # each block's count times its mean's squared distance to the tensor's
        nb = blocks[:, :, VELO_N]
        gap = blocks[:, :, VELO_OLD] / jnp.maximum(nb, 1.0)[..., None] - mean4[:, None, :]
        dev = jnp.sum(blocks[:, :, VELO_DEV], axis=1) + jnp.sum(nb[..., None] * gap * gap,
                                                                axis=1)
        # Σ (rms − μ_k)² = Σ (rms − mean rms)² + n·(mean rms − μ_k)² (the spec's var_rms)
        d_rms = mean4[:, 3:4] - mu
        dev_rms = dev[:, 3:4] + n * d_rms * d_rms
        scale = jax.lax.rsqrt(jnp.maximum(sums[:, VELO_P2] / n, 1e-9))[:, None]
        mean_rms = scale * sums[:, VELO_OLD][:, 3:4] / n
        var_m = scale * scale * (dev[:, 0:3] / n)
        var_rms = scale * scale * (dev_rms / n)
        like = jnp.zeros((), jnp.float32)
        one_hot = np.eye(vspec.NUM_RANKS, dtype=np.float32)[vspec.tensor_rank(shape)]
        fixed = jnp.concatenate([vspec.fraction_embedding(jnp, fraction, like), loss_feats])
        return jnp.concatenate([
            jnp.broadcast_to(fixed, (L, fixed.shape[0])),
            vspec.clip_log_abs(jnp, mean_rms),
            jnp.broadcast_to(jnp.asarray(one_hot), (L, vspec.NUM_RANKS)),
            vspec.clip_log_abs(jnp, var_m), vspec.clip_log_abs(jnp, var_rms)], axis=1)

    def normalize(self, shape: tuple[int, ...], pre: dict, part: Any, controls: Any,
                  lr_mult: Any) -> dict:
        """Stage 3 (XLA): the normalizers, the per-tensor MLPs (100 · mean_k controls_k ·
        bank_k), the axis terms and the per-tensor scalars the fused kernel reads."""
        from xopt.specs import velo as vspec

        n1, n2, row_on_1 = two_d_view(shape)
        L = part.shape[0] // _index_maps(n1, n2)[2]
        elem_sq = jnp.sum(part.reshape(L, -1, 32), axis=1)
        sq = jnp.zeros((L, 30), jnp.float32)
        sq = sq.at[:, np.array(VELO_ELEM)].set(elem_sq[:, :len(VELO_ELEM)])
        sq = sq.at[:, np.array(VELO_ROW)].set(pre["row_sq"])
        sq = sq.at[:, np.array(VELO_COL)].set(pre["col_sq"])
        n = float(n1 * n2)
        inv = jax.lax.rsqrt(1e-5 + sq / n)  # [L, 30]
        param_scale = jnp.sqrt(sq[:, 2] / n + 1e-9)
        weights = jax.vmap(lambda c: vspec.mix_mlp_weights(jnp, c, self.meta, self.hp))(controls)
        w0 = weights["w0"]  # [L, 30, F]
        rows, cols = np.array(VELO_ROW), np.array(VELO_COL)
        t_row = _axis_terms(pre["row_feats"], inv[:, rows, None] * w0[:, rows])
        t_col = _axis_terms(pre["col_feats"], inv[:, cols, None] * w0[:, cols])
        t1, t2 = (t_row, t_col) if row_on_1 else (t_col, t_row)
        nl = self.nhid + 1
        # the first layer's rows times the normalizers (torch's NORM_W)
        elem = np.array(VELO_ELEM)
        pieces = [(inv[:, elem, None] * w0[:, elem]).reshape(L, -1), weights["b0"]]
        pieces += [weights[f"w{i}"].reshape(L, -1) for i in range(1, nl)]
        pieces += [weights[f"b{i}"] for i in range(1, nl)]
        pieces += [weights[f"w{nl}"][:, :, :2].reshape(L, -1), weights[f"b{nl}"][:, :2],
                   lr_mult[:, None], param_scale[:, None]]
        scal = jnp.concatenate(pieces, axis=1)
        scal = jnp.pad(scal, [(0, 0), (0, VELO_SCAL - scal.shape[1])])
        return dict(scal=scal, t1=t1, t2=t2, feature_sq_mean=sq / n)

    def fused(self, shape: tuple[int, ...], pre: dict, norm: dict, g: Any, p: Any, m: Any,
              rms: Any) -> tuple[list[Any], list[Any], list[Any]]:
        """Stage 4 (:func:`_velo_fused_kernel`, one call per tensor): ``(step, m, rms)``,
        each a list of the tensors' (their shapes)."""
        n1, n2, row_on_1 = two_d_view(shape)
        _, _, per, elem = _index_maps(n1, n2)
        whole, blk, blk_m, group = _element_specs(elem)
        kern = functools.partial(
            _velo_fused_kernel, n1=n1, n2=n2, row_on_1=row_on_1, width=self.width,
            nhid=self.nhid, off=self.off, exp_mult=float(self.hp.exp_mult),
            step_mult=float(self.hp.step_mult))
        call = pl.pallas_call(
            kern,
            out_shape=(jax.ShapeDtypeStruct((n1, n2), jnp.float32),
                       jax.ShapeDtypeStruct((n1, n2, 3), jnp.float32),
                       jax.ShapeDtypeStruct((n1, n2), jnp.float32)),
            grid=(per,),
            in_specs=[pl.BlockSpec((1,), whole), pl.BlockSpec((8,), whole), group,
                      blk, blk, blk_m, blk, group, group, group, group],
            out_specs=[blk, blk_m, blk],
            input_output_aliases={5: 1, 6: 2},  # m and rms in place (as small_fc_lopt's)
            interpret=_on_cpu(), compiler_params=_compiler_params(), name="velo_fused",
        )
        outs = [call(_index(i), pre["decs"], norm["scal"], *_element_views(shape, *a),
                     pre["f1"], pre["f2"], norm["t1"], norm["t2"])
                for i, a in enumerate(zip(g, p, m, rms, strict=True))]
        return _per_tensor_outputs(outs, p, m, rms)
