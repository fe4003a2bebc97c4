"""The cross-backend bfloat16 cases: how each method's torch optimizer and optax
transformation step one bfloat16 parameter tree from the same data to the same bits.

Every spec keeps a bfloat16/float16 parameter's state in float32, computes the step there
and rounds the new value once into the parameter (``init_state`` promotes the state;
xopt.torch rounds ``p ← new`` once; xopt.jax returns a float32 update, which
``optax.apply_updates`` rounds once). Rounding twice (the update rounded to the leaf's dtype
first) or keeping bfloat16 state moves bits, and ``test_cross_backend_bf16.py`` compares
the two backends bit for bit to catch it. A comparison of bits needs the same float32
arithmetic on both sides, which a backend's choices can change: fused multiply-adds (XLA
contracts some, ATen's CPU kernels others) and the order of a sum. The data here make both
irrelevant:

* parameters are integers times 2⁻⁷ (exact in bfloat16), gradients integers times 2⁻⁴, so
  squares and every sum of them are exact in float32;
* β₁ = β₂ = 1/2 keep the moments exact for the steps taken; ``lr`` = 2⁻⁷ and
  ``lr·λ`` = 2⁻¹⁰ make every product with them exact, and ``correct_bias=False`` makes
  the step size ``lr`` itself (a backend's bias correction in float32 or in double is then
  the same number);
* decompositions are injected (GaLore, COAP, PLUMAGE): Hadamard vectors, entries ±1/4,
  so that the projections' products are exact too (LAPACK's SVD is not the same bits in
  torch and JAX).

What remains is IEEE arithmetic rounded once per operation (division, square root, a sum
of two terms), which every CPU and both frameworks compute alike, except where a backend
rewrites an operation: XLA:CPU divides by a constant as a multiplication by its float32
reciprocal (a case's ``ulp_state`` names the variables that takes). A method joins by adding
a :class:`Bf16Case` to :data:`CASES`; a method whose float32 steps differ between the
backends by design says why in ``not_bitwise`` (each backend's own bfloat16 step is then
still held to its float32 step rounded once); a method whose JAX transformation does not
keep float32 state declares it on its JAX case (``JaxCase.narrow_leaves``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from xopt.specs import get as get_spec

SHAPES = {"b": (5,), "w1": (32, 16), "w2": (16, 32)}  # sorted: JAX's flattening order
MATRICES = ("w1", "w2")
STEPS = 5
LR, WD = 2.0**-7, 0.125
ADAM = dict(b1=0.5, b2=0.5, correct_bias=False)


def params() -> dict[str, np.ndarray]:
    """Integers times 2⁻⁷ in [−1, 1): exact in bfloat16 (float64 arrays)."""
    rng = np.random.default_rng(7)
    return {k: rng.integers(-127, 128, s) / 128.0 for k, s in SHAPES.items()}


def grads(t: int) -> dict[str, np.ndarray]:
    """Update ``t``'s gradients: integers times 2⁻⁴ in [−1, 1) (float64 arrays)."""
    rng = np.random.default_rng(100 + t)
    return {k: rng.integers(-15, 16, s) / 16.0 for k, s in SHAPES.items()}


def _hadamard16() -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    return h / 4.0  # orthonormal, entries ±1/4


def lowrank_inject(method: str, t: int) -> dict[str, dict[str, np.ndarray]]:
    """Update ``t``'s decompositions for GaLore, COAP and PLUMAGE: 4 Hadamard vectors on
    each matrix's 16-long side (a different choice at every update; read at refreshes)."""
    rng = np.random.default_rng(500 + t)
    h = _hadamard16()[:, rng.permutation(16)] * rng.choice([-1.0, 1.0], 16)
    cols = h[:, :4].astype(np.float32)
    out = {}
    for name in MATRICES:
        if method == "plumage":  # the SVD (U over the 16-long side, distinct σ) and the draw
            out[name] = {"svd_u": h.astype(np.float32),
                         "svd_s": np.arange(16, 0, -1).astype(np.float32),
                         "indices": np.sort(rng.permutation(16)[:4]).astype(np.int64)}
        else:  # GaLore and COAP both project w1 (32 × 16) on the right, w2 on the left
            out[name] = {"ortho_matrix": cols.T.copy() if name == "w1" else cols}
    return out


#: the low-rank methods' settings on these shapes (rank 4, a refresh every other update)
LOWRANK = {
    "galore": dict(rank=4, update_proj_gap=2, scale=0.5),
    "coap": dict(rank=4, update_interval=2, reproject_factor=1, scale=0.5),
    # the moments' realignment at a new P is a float32 product of two inexact matrices
    # (a sum whose order each backend picks): off
    "plumage": dict(rank=4, update_proj_gap=2, resample_interval=2,
                    realign_first_moment=False, realign_second_moment=False),
}


def lowrank_spec(method: str, weight_decay: float, **overrides: Any) -> Any:
    return get_spec(method).make(lr=LR, weight_decay=weight_decay, **ADAM,
                                 **LOWRANK[method], **overrides)


@dataclasses.dataclass(frozen=True)
class Bf16Case:
    """One method on both backends.

    Attributes:
      method: the registered method.
      spec: ``weight_decay -> hyperparameters`` under which both backends' float32 steps
        are the same bits on this module's data (both built with ``spec=``).
      inject: ``t -> {param: {key: array}}``: update ``t``'s decompositions, given to both
        (``step(inject=...)``, ``update(..., inject=...)``).
      jax_kwargs: what the JAX factory needs besides ``spec`` (CompAct: its projections).
      not_bitwise: why the backends' float32 steps are not the same bits; "" (default):
        they are, and so are the bfloat16 parameters and the float32 state.
      ulp_state: state variables (canonical names) that the backends round differently,
        within one float32 ulp, with the op that does it; none of them feeds the step
        under ``spec``'s settings.
    """

    method: str
    spec: Callable[[float], Any] | None = None
    inject: Callable[[int], dict[str, dict[str, np.ndarray]]] | None = None
    jax_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    not_bitwise: str = ""
    ulp_state: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        return self.method


_LOPT = ("the learned step's MLP products, feature normalisers and Adafactor statistics "
         "are float32 sums whose order each backend picks, and XLA contracts some of its "
         "products into fused multiply-adds (tests/test_lopt_backend_bits.py names each "
         "op): the backends' float32 steps agree to float32 rounding, not bit for bit, so "
         "their bfloat16 roundings need not; each backend's bfloat16 step is held to its "
         "own float32 step rounded once instead")

CASES: list[Bf16Case] = [
    Bf16Case("coap", lambda wd: lowrank_spec("coap", wd),
             inject=lambda t: lowrank_inject("coap", t)),
    # a plain tree: a CompAct weight's N Pᵀ multiplies two inexact float32 matrices (P is
    # Gaussian), a sum whose order each backend picks
    Bf16Case("compact", lambda wd: get_spec("compact").make(lr=LR, weight_decay=wd, **ADAM),
             jax_kwargs=dict(projections={})),
    # no momentum (its compression multiplies by a Gaussian projection: inexact sums);
    # decay_rate 0: β₂ₜ = 1 − t⁰ = 0, an exact second moment at every update (another
    # rate's β₂ₜ multiplies inexactly); the step size lr itself (scale_parameter multiplies
    # it by the parameter's RMS, inexact); the clipping threshold far above the update's
    # RMS, whose inexact sum then decides nothing
    Bf16Case("flora", lambda wd: get_spec("flora").make(
        lr=LR, weight_decay=wd, rank=4, decay_rate=0.0, scale_parameter=False,
        clip_threshold=1e3),
        ulp_state={"rms": "ρ = ‖p‖₂ / √numel sums the squares of the updated parameter, "
                          "inexact after the first update, in each backend's order (the "
                          "division itself rounds once in both: tests/test_flora.py); ρ "
                          "scales the step only under scale_parameter, off here"}),
    Bf16Case("galore", lambda wd: lowrank_spec("galore", wd),
             inject=lambda t: lowrank_inject("galore", t)),
    Bf16Case("mulo", not_bitwise=_LOPT),
    Bf16Case("plumage", lambda wd: lowrank_spec("plumage", wd),
             inject=lambda t: lowrank_inject("plumage", t)),
    # the rotations' optimizer on a plain tree (merges are the layer's); lr·s = 2⁻⁸, and a
    # moment restart inside the run
    Bf16Case("poet", lambda wd: get_spec("poet").make(lr=LR, weight_decay=wd, poet_scale=0.5,
                                                      merge_interval=3, **ADAM)),
    Bf16Case("small_fc_lopt", not_bitwise=_LOPT),
    Bf16Case("velo", not_bitwise=_LOPT),
]


# -- each JAX transformation against itself --------------------------------------------------


def jax_rounds_once(c: Any, steps: int = 3) -> None:
    """JAX case ``c`` (``jax_cases.JaxCase``) on its tiny parameters in bfloat16 and, from
    the same values and gradients, in float32: after every update the bfloat16 run's state
    and update are the float32 run's (float32, the same bits), and its new parameters are
    the float32 run's rounded once. Raises AssertionError naming the update and leaf that
    differ.

    Two XLA programs of the same operations may contract different products into fused
    multiply-adds (how each fused), so the bits are compared on an XLA:CPU that emits none
    (``helpers.fma_free_jax_child``)."""
    import jax
    import jax.numpy as jnp
    import optax
    from contract import jax_cases as J

    def cast(tree: Any, dtype: Any) -> Any:
        return jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    p16 = cast(c.params(), jnp.bfloat16)
    p32 = cast(p16, jnp.float32)  # the same values
    start = p16
    tx = c.build(p16)
    s16, s32 = tx.init(p16), tx.init(p32)
    update = jax.jit(tx.update)
    for t in range(steps):
        kw = J.update_kwargs(c, t)
        g16 = J.grads_like(p16, t)
        u16, s16 = update(g16, s16, p16, **kw)
        u32, s32 = update(cast(g16, jnp.float32), s32, p32, **kw)
        J.assert_bitwise(s16, s32, f"{c.id}: the state after update {t}")
        # the float32 run's update, not rounded to the leaf's dtype (a zero one may be:
        # CompAct's carriers)
        for name, a, b in zip(J.names(u16), jax.tree.leaves(u16), jax.tree.leaves(u32),
                              strict=True):
            a, b = np.asarray(a), np.asarray(b)
            where = f"{c.id}: the update of {name} at update {t}"
            if a.dtype != np.float32:
                assert not np.any(a), f"{where} is {a.dtype}"
            else:
                assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), where
        p16 = optax.apply_updates(p16, u16)
        J.assert_bitwise(p16, cast(optax.apply_updates(p32, u32), jnp.bfloat16),
                         f"{c.id}: the float32 parameters of update {t} rounded once")
        p32 = cast(p16, jnp.float32)
    moved = [not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(p16), strict=True)]
    assert any(moved), f"{c.id}: no parameter moved"
