"""xopt.jax.flora draws a group's projections once and its leaves share compiled kernels.

The compressed leaves whose projections have one size (``(r, m)`` and ``(n, r)`` alike)
draw them in one ``jax.vmap`` of ``xopt.random``'s normal, and each leaf takes its row at
an index found at run time from its seed. Checked here: the projections a step uses are
``xopt.random.normal_many``'s rows (the recorded-projection path given those rows gives the
drawn path's updates and states bit for bit, over a momentum transfer), and the compiled
program's distinct kernels do not grow with the number of same-shaped leaves (a constant
row offset per leaf compiled a kernel per leaf).
"""

from __future__ import annotations

import re
import textwrap

import pytest
from helpers import fma_free_jax_child, needs_x86
from helpers import jax_block_model as _model

jax = pytest.importorskip("jax")


def _distinct_kernels(k: int) -> int:
    """Distinct fused computations of the compiled update of :func:`_model` ``(k)`` (names
    and metadata stripped: XLA compiles identical ones once)."""
    import xopt.jax as xj

    tx = xj.flora(1e-3, rank=4, kappa=2, beta1=0.9)
    params = _model(k)
    state = tx.init(params)
    text = jax.jit(lambda g, s, p: tx.update(g, s, p)).lower(
        params, state, params).compile().as_text()
    bodies = dict(re.findall(r"^(%\S+) [^\n]*\{\n(.*?)\n\}", text, re.M | re.S))
    entry = text[text.index("ENTRY"):]
    return len({re.sub(r", metadata=\{[^}]*\}", "", re.sub(r"%[\w.\-]+", "%", bodies[c]))
                for c in re.findall(r" fusion\([^\n]*calls=(%[\w.\-]+)", entry)})


def test_compiled_kernels_do_not_grow_with_same_shaped_leaves() -> None:
    two, four = _distinct_kernels(2), _distinct_kernels(4)
    assert two > 0, "no fused computations found in the compiled program's text"
    # two more blocks add four compressed leaves: a kernel per leaf would add at least
    # four (the path of a row offset per leaf added ten); XLA's operand order may split
    # a kernel or two
    assert four - two < 4, f"{two} distinct kernels for 2 blocks, {four} for 4"


# Run in a child process with XLA's CPU code generation capped at SSE4.2: with FMA
# available, XLA contracts a*b + c into an FMA or not depending on how it fused the
# program, so two programs of the same operations may differ in the last bit.
_CHILD = textwrap.dedent("""
    import json, math, sys
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, sys.argv[1])
    from tests.test_jax_flora_compile import _model
    import xopt.jax as xj
    from xopt import random as xrandom
    from xopt.specs import flora as spec

    rank, kappa = 4, 2
    tx = xj.flora(1e-3, rank=rank, kappa=kappa, beta1=0.9)
    params = _model(1)
    names = ["/".join(str(getattr(k, "key", k)) for k in path)
             for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    flat = jax.tree.leaves(params)
    compressed = [i for i, p in enumerate(flat) if p.ndim == 2]

    def projections(seeds, i):
        # normal_many of the leaf's seed, shaped and scaled as the spec's projection
        pshape = spec.projection_shape(flat[i].shape, rank)
        z = xrandom.normal_many([int(seeds[i])], pshape)[0]
        return z / np.float32(math.sqrt(rank))

    drawn_step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    given_step = jax.jit(lambda g, s, p, inj: tx.update(g, s, p, inject=inj))
    s_drawn = s_given = tx.init(params)
    rng = np.random.default_rng(1)
    report = {"steps": 0, "differing": [], "transfers": 0}
    for t in range(1, 4):  # a transfer at t = 2
        g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
        seeds = [spec.decode_seed_words(w) for w in jax.tree.leaves(s_given.seed)]
        after = [spec.next_seed(int(s)) if t % kappa == 0 else int(s) for s in seeds]
        inj = {names[i]: {"proj_before": projections(seeds, i),
                          "proj_after": projections(after, i)} for i in compressed}
        u_d, s_drawn = drawn_step(g, s_drawn, params)
        u_g, s_given = given_step(g, s_given, params, inj)
        report["transfers"] += int(any(a != int(b) for a, b in zip(after, seeds)))
        for what, a, b in (("update", u_d, u_g), ("state", s_drawn, s_given)):
            for n, (x, y) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(b))):
                if x.dtype != y.dtype or not np.array_equal(np.asarray(x), np.asarray(y)):
                    report["differing"].append(f"t={t} {what} leaf {n}")
        report["steps"] += 1
        params = jax.tree.map(lambda p, u: p + u, params, u_d)
    print(json.dumps(report))
""")


@needs_x86
def test_drawn_projections_are_normal_many_rows_bit_for_bit() -> None:
    report = fma_free_jax_child(_CHILD)
    assert report["steps"] == 3 and report["transfers"] == 1, report
    assert report["differing"] == [], report
