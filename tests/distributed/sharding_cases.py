"""Rank-side code of tests/distributed/test_jax_sharding.py: a process whose JAX sees 4 host
devices (the flag is set before jax is imported there)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

#: the methods whose transformations test_jax_sharding.py places (docs/distributed.md's JAX
#: column; CompAct's and POET's take their layers' inputs)
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
