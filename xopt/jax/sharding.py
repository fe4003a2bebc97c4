"""Optimizer state placed with the parameters' sharding.

``tx.init(params)`` run eagerly puts every new array on the default device, however the
parameters are sharded. :func:`init` runs it under ``jax.jit`` with an output sharding per
state leaf: a leaf of a parameter's shape (moments), or of that shape with trailing
dimensions (one per decay), is placed as that parameter (its trailing dimensions not
split); every other leaf (counters, projections, row and column statistics, a learned
optimizer's global state) is replicated over the parameters' mesh. The values are
``tx.init(params)``'s, bit for bit.

>>> state = xopt.jax.sharding.init(tx, params)   # params: jax.Arrays with NamedSharding
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["init", "state_shardings"]


def state_shardings(tx: Any, params: Any) -> Any:
    """The sharding :func:`init` gives each leaf of ``tx.init(params)`` (a pytree of
    ``jax.sharding.Sharding`` of the state's structure). The parameters' shardings must
    be ``NamedSharding`` on one mesh."""
    leaves = [p for p in jax.tree.leaves(params) if isinstance(p, jax.Array)]
    named = [p.sharding for p in leaves if isinstance(p.sharding, NamedSharding)]
    if not named:
        raise ValueError("xopt.jax.sharding: the parameters carry no NamedSharding (place "
                         "them on a mesh with jax.device_put(params, NamedSharding(...)))")
    mesh = named[0].mesh
    if any(s.mesh != mesh for s in named):
        raise ValueError("xopt.jax.sharding: the parameters are on more than one mesh")
    by_shape: dict[tuple[int, ...], PartitionSpec] = {}
    for p in leaves:
        if isinstance(p.sharding, NamedSharding) and p.ndim > 0:
            by_shape.setdefault(tuple(p.shape), p.sharding.spec)
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(leaf: Any) -> Any:
        shape = tuple(leaf.shape)
        for n in range(len(shape), 0, -1):  # the longest parameter shape that leads it
            spec = by_shape.get(shape[:n])
            if spec is not None:
                padded = tuple(spec) + (None,) * (n - len(tuple(spec)))
                return NamedSharding(mesh, PartitionSpec(*padded, *(None,) * (len(shape) - n)))
        return replicated

    return jax.tree.map(place, jax.eval_shape(tx.init, params))


def init(tx: Any, params: Any) -> Any:
    """``tx.init(params)`` with the state placed as :func:`state_shardings` says."""
    return jax.jit(tx.init, out_shardings=state_shardings(tx, params))(params)
