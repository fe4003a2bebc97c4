"""Rank-side code of tests/distributed/test_torch_poet_merge.py: POET-X's merges on many
ranks, each layer merged once, by its owner rank (``xopt.torch.distributed.merge_by_owner``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

#: (in, out, bias) of the layers: uneven shards on 2 ranks (oft_R of 5 and 3 rows)
SHAPES = ((8, 8, True), (8, 12, False), (12, 4, True))
#: the c10d ops behind dist.all_to_all_single, dist.broadcast and dist.all_reduce, as
#: CommCounter names them
A2A, BCAST, ALLREDUCE = "alltoall_base_", "broadcast_", "allreduce_"


def make_model(quantized: bool) -> nn.Module:
    """Three POET layers with rotations and biases drawn away from zero (a merge of zero
    rotations would move nothing)."""
    from xopt.torch.poet import POETLinear

    torch.manual_seed(0)
    kw = dict(weight_bits=8, weight_group_size=16) if quantized else {}
    layers = [POETLinear(i, o, 4, bias=b, seed=k, impl="plain", **kw)
              for k, (i, o, b) in enumerate(SHAPES)]
    with torch.no_grad():
        for layer in layers:
            layer.oft_R.normal_(0, 0.1)
            if layer.bias is not None:
                layer.bias.normal_()
    return nn.Sequential(*layers)


def wrap(mode: str, model: nn.Module) -> nn.Module:
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in model:
        fully_shard(m, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _whole(model: nn.Module) -> dict[str, np.ndarray]:
    from xopt.torch.distributed import is_dtensor

    out = {}
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        t = t.full_tensor() if is_dtensor(t) else t
        out[n] = t.detach().cpu().numpy().copy()
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def merge(mode: str, quantized: bool) -> dict[str, Any]:
    """The model's layers merged on 2 ranks (``mode``: "fsdp2", or "ddp" with the default
    group named as POETAdamW names it) against one process: which tensors differ (bit
    for bit), how many merges each rank computed, and the bytes each collective was handed
    against what the owner rule needs (every input shard once to its owner, every owned
    result's blocks once to their ranks, replicated results broadcast from their owner,
    and the owners' status)."""
    import xopt.torch.distributed as xd
    from xopt.torch.poet import merge_and_reset, poet_layers

    ref = make_model(quantized)
    merge_and_reset(ref)  # one process (plain parameters, the default: merges alone)
    model = wrap(mode, make_model(quantized))
    base = getattr(model, "module", model)
    layers = poet_layers(base)
    computed = [0]
    for layer in layers:
        def counted(*args: Any, _f: Any = layer.merged) -> Any:
            computed[0] += 1
            return _f(*args)
        layer.merged = counted

    me, world = dist.get_rank(), dist.get_world_size()
    owners = xd.assign_owners([float(layer.weight.numel()) for layer in layers], world)
    expect: dict[str, int] = {}
    for layer, owner in zip(layers, owners, strict=True):
        for n in ("oft_R", "weight", "bias"):
            t = getattr(layer, n)
            if t is not None and xd.is_dtensor(t):  # its shard, to the owner
                expect[A2A] = expect.get(A2A, 0) + _nbytes(
                    xd.local(t))
        for n in ("weight", "weight_scales", "weight_zeros", "bias"):
            t = getattr(layer, n, None)
            if t is None:
                continue
            if xd.is_dtensor(t):  # the owner sends every rank its block
                if owner == me:
                    expect[A2A] = expect.get(A2A, 0) + \
                        _nbytes(t)
            else:  # broadcast whole (counted on every rank)
                expect[BCAST] = expect.get(BCAST, 0) + _nbytes(t)
    expect[ALLREDUCE] = 8 * world  # the owners' status (an int64 per rank), before results
    ranks = xd.Ranks([dist.group.WORLD]) if mode == "ddp" else "auto"
    with xd.CommCounter() as c:
        assert merge_and_reset(base, ranks) == len(SHAPES)
    got, want = _whole(base), _whole(ref)
    differ = sorted(k for k in want if not np.array_equal(got[k], want[k]))
    moved = sorted(k for k in want if k.endswith(".weight")
                   and np.array_equal(want[k], _whole(make_model(quantized))[k]))
    return {"differ": differ, "unmoved": moved, "computed": computed[0],
            "bytes": dict(c.bytes_by_op), "expect": expect}


def failed_merge(mode: str) -> dict[str, Any]:
    """The second layer's rotations made NaN on every rank, and its merge made to raise on
    a NaN (a merge that checks its input): the error each rank raised and whether any
    parameter, buffer or permutation changed on this rank."""
    import xopt.torch.distributed as xd
    from xopt.torch.poet import merge_and_reset, poet_layers

    model = wrap(mode, make_model(False))
    base = getattr(model, "module", model)
    layers = poet_layers(base)
    for layer in layers:
        def checked(oft_r: torch.Tensor, *args: Any, _f: Any = layer.merged) -> Any:
            if not bool(torch.isfinite(oft_r).all()):
                raise FloatingPointError("oft_R is not finite")
            return _f(oft_r, *args)
        layer.merged = checked
    with torch.no_grad():
        xd.local(layers[1].oft_R).fill_(float("nan"))
    before = _whole(base)
    ranks = xd.Ranks([dist.group.WORLD]) if mode == "ddp" else "auto"
    try:
        merge_and_reset(base, ranks)
        error = None
    except xd.OwnerError as e:
        error = str(e)
    after = _whole(base)
    changed = sorted(k for k in before if not np.array_equal(before[k], after[k],
                                                             equal_nan=True))
    owners = xd.assign_owners([float(layer.weight.numel()) for layer in layers],
                              dist.get_world_size())
    return {"error": error, "changed": changed, "owner": owners[1]}
