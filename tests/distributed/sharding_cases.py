"""Rank-side code of tests/distributed/test_jax_sharding.py: a process whose JAX sees 4 host
devices (the flag is set before jax is imported there)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

#: the methods whose transformations test_jax_sharding.py places (docs/distributed.md's JAX
#: column; CompAct's and POET's take their layers' inputs: test_jax_layers.py)
JAX_SHARDED = ("adamw", "galore", "flora", "coap", "plumage", "small_fc_lopt", "velo", "mulo")

_CONTRACT = Path(__file__).resolve().parents[1] / "contract" / "jax_cases.py"


def _contract_cases() -> Any:
    """tests/contract/jax_cases.py (the contract suite's cases), loaded by path once."""
    import importlib.util

    mod = sys.modules.get("_contract_jax_cases")
    if mod is None:
        spec = importlib.util.spec_from_file_location("_contract_jax_cases", _CONTRACT)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["_contract_jax_cases"] = mod
        spec.loader.exec_module(mod)
    return mod


def sharded_init(case_id: str) -> dict[str, Any]:
    """``xopt.jax.sharding.init`` of one contract case's transformation on parameters whose
    matrix is split over 4 devices: the placements, the values against ``tx.init`` on one
    device, and one jitted update from each state."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from xopt.jax import sharding

    jc = _contract_cases()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    c = jc.case(case_id)
    params = jc.tiny_params()  # w (4, 3): one row per device; the rest replicated
    placed = jax.tree.map(lambda p: jax.device_put(p, NamedSharding(
        mesh, PartitionSpec("d") if p.shape == (4, 3) else PartitionSpec())), params)
    tx = c.build(params)
    state = sharding.init(tx, placed)
    plain = tx.init(params)
    leaves = jax.tree.leaves(state)
    out: dict[str, Any] = {"devices": len(jax.devices()), "leaves": len(leaves)}
    out["on_every_device"] = all(len(x.sharding.device_set) == 4 for x in leaves)
    split = [x for x in leaves if tuple(x.shape[:2]) == (4, 3)]
    out["moments"] = len(split)
    out["moments_split"] = all(x.sharding.spec[:1] == ("d",) for x in split)
    out["same_values"] = all(np.array_equal(np.asarray(a), np.asarray(b))
                             for a, b in zip(leaves, jax.tree.leaves(plain), strict=True))
    grads = jc.grads_like(params, 0)
    kw = jc.update_kwargs(c, 0)
    u1, _ = jax.jit(tx.update)(jax.tree.map(lambda g, p: jax.device_put(g, p.sharding), grads,
                                            placed), state, placed, **kw)
    u0, _ = jax.jit(tx.update)(grads, plain, params, **kw)
    out["update_max_rel"] = jc.max_rel(u1, u0)
    return out


def cases_without_extra() -> list[str]:
    return [c.id for c in _contract_cases().cases() if c.extra is None]


# -- the collectives of a compiled update --------------------------------------------------------

#: the matrices whose collectives test_jax_sharding.py bounds: split by rows over 4 devices;
#: tall, so that a decomposition's factors are smaller than the matrix they come from
HLO_SHAPES = {"a": (32, 16), "b": (32, 16), "c": (64, 8), "v": (16,)}
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute",
               "reduce-scatter")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def hlo_collectives(text: str) -> list[tuple[str, int]]:
    """``[(op, bytes)]``: every collective of a compiled (SPMD-partitioned) HLO module's
    text and the bytes of its result on one device (a tuple's elements summed; an async
    pair counted once, at its ``-start``)."""
    import re

    ops = "|".join(COLLECTIVES)
    out = []
    for line in text.splitlines():
        m = re.search(r"=\s*(.+?)\s+(" + ops + r")(-start)?\(", line)
        if not m:
            continue
        n = 0
        for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", m.group(1)):
            size = 1
            for d in dims.split(","):
                size *= int(d) if d else 1
            n += _BYTES[dtype] * size
        out.append((m.group(2), n))
    return out


#: how compiled_collectives traces the update: the parameters and gradients placed with
#: NamedSharding and nothing else ("placed": the owner rule finds the mesh on the arrays),
#: inside ``jax.set_mesh`` ("set_mesh"), or placed with the rule turned off ("off")
TRACINGS = ("placed", "set_mesh", "off")


def compiled_collectives(case_id: str, tracing: str = "placed", steps: int = 5
                         ) -> dict[str, Any]:
    """One contract case's transformation on :data:`HLO_SHAPES` (matrices split by rows
    over the 4 devices), jitted with its state from ``xopt.jax.sharding.init``: the
    collectives of its compiled update (:func:`hlo_collectives`; ``tracing``, one of
    :data:`TRACINGS`: how the update is traced), and
    ``teacher``: per update (refreshes among them), the worst relative error of the sharded
    update and new state against the unsharded update from the same state and gradient."""
    import contextlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from xopt.jax import sharding

    jc = _contract_cases()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32)
              for k, s in HLO_SHAPES.items()}
    placed = jax.tree.map(lambda p: jax.device_put(p, NamedSharding(
        mesh, PartitionSpec("d") if p.ndim == 2 else PartitionSpec())), params)
    c = jc.case(case_id)
    tx = c.build(params)
    plain_update = jax.jit(tx.update)
    out: dict[str, Any] = {"devices": len(jax.devices()), "teacher": [],
                           "matrix_bytes": [4 * int(np.prod(s)) for s in HLO_SHAPES.values()
                                            if len(s) == 2]}
    context = {"placed": contextlib.nullcontext, "set_mesh": lambda: jax.set_mesh(mesh),
               "off": lambda: sharding.owner_rule(False)}[tracing]
    with context():
        state = sharding.init(tx, placed)
        update = jax.jit(tx.update)
        out["ops"] = hlo_collectives(update.lower(placed, state, placed,
                                                  **jc.update_kwargs(c, 0)).compile().as_text())
        for t in range(steps):
            g, kw = jc.grads_like(params, t), jc.update_kwargs(c, t)
            whole = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), state)
            u, state = update(jax.tree.map(lambda x, p: jax.device_put(x, p.sharding), g,
                                           placed), state, placed, **kw)
            u0, state0 = plain_update(g, whole, params, **kw)
            # the parameters an update gives, as the torch matrix compares them: an update
            # computed as new − old (Flora's, COAP's) carries the rounding of the old
            # parameter, a relative 1e-5 of the update for a 1-ulp change of the new one
            out["teacher"].append(max(jc.max_rel(optax.apply_updates(placed, u),
                                                 optax.apply_updates(params, u0)),
                                      jc.max_rel(state, state0)))
    return out


def inside_shard_map(case_id: str) -> float:
    """One contract case's update called inside a user's ``shard_map`` over the 4 devices
    (every array replicated into it, so each device updates the whole tensors): the
    owner rule stands aside there (the mesh's axes are manual). The worst relative error
    against the update on one device."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from xopt.jax import sharding

    jc = _contract_cases()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    c = jc.case(case_id)
    params = jc.tiny_params()
    placed = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    tx = c.build(params)
    grads, kw = jc.grads_like(params, 0), jc.update_kwargs(c, 0)
    state = sharding.init(tx, placed)

    def body(g, st, p):
        return tx.update(g, st, p, **kw)[0]

    spec = PartitionSpec()
    u = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec))(
        jax.device_put(grads, NamedSharding(mesh, spec)), state, placed)
    return jc.max_rel(u, jax.jit(tx.update)(grads, tx.init(params), params, **kw)[0])
