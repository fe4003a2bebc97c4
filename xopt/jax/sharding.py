"""Optimizer state placed with the parameters' sharding, and decompositions on one device.

``tx.init(params)`` run eagerly puts every new array on the default device, however the
parameters are sharded. :func:`init` runs it under ``jax.jit`` with an output sharding per
state leaf: a leaf of a parameter's shape (moments), or of that shape with trailing
dimensions (one per decay), is placed as that parameter (its trailing dimensions not
split); every other leaf (counters, projections, row and column statistics, a learned
optimizer's global state) is replicated over the parameters' mesh. The values are
``tx.init(params)``'s, bit for bit.

>>> state = xopt.jax.sharding.init(tx, params)   # params: jax.Arrays with NamedSharding

**The owner rule.** Under ``jit``, XLA partitions a whole-matrix decomposition (an SVD, a
QR) of a sharded matrix by gathering the matrix on every device and decomposing it
everywhere. GaLore's and PLUMAGE's SVDs call :func:`on_owner` instead (COAP decomposes
its rank-r sketch, which is all XLA gathers). Each matrix goes to one device, its owner
(owners rotate over the devices with the leaves), in ``D − 1`` collective permutes of its
row blocks (one matrix's worth, once); the owner alone decomposes it (the other devices
skip the branch); the factors reach every device in one all-reduce of their bits (exact).
The results are bit for bit the unsharded ones. The mesh is found when the update is
traced (:func:`owner_mesh`): the one set with ``jax.set_mesh``, else the mesh of the
matrix's own sharding, which a gradient or parameter placed with ``NamedSharding`` carries
through ``jit`` (on its ``jax.typeof(x).sharding``); so parameters and gradients placed on a
mesh need no context. A matrix with no mesh (arrays on one device, uncommitted, or placed
with another kind of sharding) is decomposed by ``fn`` itself, as XLA partitions it.
``with xopt.jax.sharding.owner_rule(False):`` around the first call turns the rule off
(every device then gathers and decomposes every matrix).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["init", "on_owner", "owner_mesh", "owner_rule", "state_shardings"]


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


_OWNER_RULE = contextvars.ContextVar("xopt_jax_owner_rule", default=True)


@contextlib.contextmanager
def owner_rule(enabled: bool = True) -> Iterator[None]:
    """Turn the owner rule on or off for the updates traced inside the block (default:
    on); off, :func:`on_owner` is ``fn`` itself and XLA gathers each matrix on every
    device. Read when ``jit`` traces, so it applies to the first call of a jitted update
    (a compiled one keeps what it was traced with)."""
    token = _OWNER_RULE.set(bool(enabled))
    try:
        yield
    finally:
        _OWNER_RULE.reset(token)


def owner_mesh(like: Any = None) -> Any:
    """The mesh :func:`on_owner` distributes over, when it spans more than one device: the
    one set with ``jax.set_mesh``; else that of ``like``'s sharding (an array or a traced
    value whose inputs were placed with ``NamedSharding``: its abstract mesh, which ``jit``
    carries through the trace); else None. None too under ``owner_rule(False)`` and
    inside ``shard_map`` (a mesh with manual axes: ``fn`` then runs on what each device
    holds, as the caller's ``shard_map`` asks)."""
    if not _OWNER_RULE.get():
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if (mesh is None or getattr(mesh, "empty", True)) and like is not None:
        try:
            sharding = getattr(jax.typeof(like), "sharding", None)
        except TypeError:  # not an array (a Python scalar): no mesh of its own
            sharding = None
        mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or mesh.size <= 1:
        return None
    if jax.sharding.AxisType.Manual in tuple(getattr(mesh, "axis_types", ())):
        return None  # inside shard_map: each device holds its own blocks, fn runs on them
    return mesh


_INT_OF = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def _broadcast_bits(x: jax.Array, mine: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """The owner's ``x`` on every device: an all-reduce of its bits (zeros elsewhere), so
    that the values (signed zeros and NaNs included) arrive exactly."""
    if x.dtype == jnp.bool_:
        return jax.lax.psum(jnp.where(mine, x, False).astype(jnp.int32), axes) > 0
    if jnp.issubdtype(x.dtype, jnp.floating):
        ints = jax.lax.bitcast_convert_type(x, _INT_OF[x.dtype.itemsize])
        ints = jax.lax.psum(jnp.where(mine, ints, jnp.zeros_like(ints)), axes)
        return jax.lax.bitcast_convert_type(ints, x.dtype)
    return jax.lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axes)


def on_owner(fn: Callable[..., Any], a: jax.Array, *replicated: Any, index: int = 0) -> Any:
    """``fn(a, *replicated)`` computed on one device of ``a``'s mesh (:func:`owner_mesh`:
    the one set with ``jax.set_mesh``, else the mesh ``a``'s sharding carries), device
    ``index mod D``, and broadcast; ``fn`` itself without one.

    ``a`` (a matrix, sharded or not) reaches the owner in row blocks, as FSDP shards it
    (``D − 1`` collective permutes, each of one block; rows padded to a multiple of ``D``
    and the padding dropped on the owner), and ``replicated`` (small arrays every device
    holds, e.g. a previous projection) as they are. Only the owner runs ``fn``; its
    results (a pytree of arrays) are sent to every device bit for bit. Call it under
    ``jit``, one call per matrix with ``index`` counting the matrices, so that owners
    rotate over the devices."""
    mesh = owner_mesh(a)
    if mesh is None:
        return fn(a, *replicated)
    axes = tuple(mesh.axis_names)
    d = mesh.size
    owner = index % d
    m = a.shape[0]
    rows = -(-m // d)
    padded = jnp.pad(a, ((0, rows * d - m),) + ((0, 0),) * (a.ndim - 1)) if rows * d != m \
        else a
    out_shape = jax.eval_shape(fn, a, *replicated)

    def body(block: jax.Array, *rep: Any) -> Any:
        me = jax.lax.axis_index(axes)
        mine = me == owner
        blocks = []
        for src in range(d):
            if src == owner:
                blocks.append(block)
            else:  # src's rows to the owner (every other device receives zeros)
                blocks.append(jax.lax.ppermute(block, axes, perm=[(src, owner)]))
        whole = jnp.concatenate(blocks, axis=0)[:m]
        out = jax.lax.cond(mine, lambda: fn(whole, *rep),
                           lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                                out_shape))
        return jax.tree.map(lambda x: _broadcast_bits(x, mine, axes), out)

    # check_vma off: the branches' outputs vary by device until the broadcast makes them
    # the same everywhere, which is what out_specs=P() states
    return jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec(axes),) + (
        PartitionSpec(),) * len(replicated), out_specs=PartitionSpec(),
        check_vma=False)(padded, *replicated)
