"""Rank-side functions of tests/distributed/test_torch_shared.py (2 gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from xopt.torch import distributed as xd


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _full(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def layout_sums(shape: tuple[int, ...], split: int, dims: tuple[int, ...]) -> dict[str, Any]:
    """The sum and mean over ``dims`` of a tensor sharded on ``split``, from the shards,
    against those of the whole tensor (which every rank can build: the same seed), and
    what the ranks sent for them."""
    full = _full(shape, 0)
    p = distribute_tensor(full, _mesh(), [Shard(split)])
    lay = xd.Layout.of(p)
    with xd.CommCounter() as c:
        s = lay.sum(p.to_local(), dims)
        m = lay.mean(p.to_local(), dims)
    out_lay = lay.drop(dims)
    # the result is this rank's block of the complete sum, as drop(dims) lays it out
    block = full.sum(dim=dims)[tuple(slice(o, o + n) for o, n in zip(
        out_lay.offsets, out_lay.local_shape, strict=True))]
    count = 1
    for d in dims:
        count *= shape[d]
    return {"local_shape": tuple(p.to_local().shape), "result_shape": tuple(s.shape),
            "sum_err": float((s - block).abs().max()) if s.numel() else 0.0,
            "mean_err": float((m - block / count).abs().max()) if m.numel() else 0.0,
            "calls": dict(c.calls_by_op), "largest": c.largest,
            "result_bytes": s.numel() * s.element_size(),
            "out_placements": [str(x) for x in out_lay.placements]}


def state_placements() -> dict[str, Any]:
    """:func:`xopt.torch.distributed.state_zeros` for a parameter sharded on rows."""
    p = distribute_tensor(_full((9, 5), 1).float(), _mesh(), [Shard(0)])
    out = {}
    for label, kw in {"trailing": dict(trailing=(3,)), "drop_rows": dict(drop=(0,), trailing=(3,)),
                      "drop_cols": dict(drop=(1,), trailing=(3,)),
                      "scalar": dict(drop=(0, 1))}.items():
        z = xd.state_zeros(p, **kw)
        out[label] = (tuple(z.shape), tuple(z.to_local().shape), [str(x) for x in z.placements],
                      str(z.dtype), float(z.to_local().abs().sum()))
    q = torch.zeros(4, 3)
    out["plain"] = (tuple(xd.state_zeros(q, (2,)).shape), xd.is_dtensor(xd.state_zeros(q)))
    return out


def aligned_shards() -> dict[str, Any]:
    """:func:`xopt.torch.distributed.aligned_locals` on DTensors of one placement (views
    that write through), of two placements, and beside a plain tensor; and xopt's AdamW
    on FSDP2's shards against the DTensor arithmetic of the same step."""
    from torch.distributed.fsdp import fully_shard

    import xopt.torch as xt
    from xopt.specs import adamw as adamw_spec

    mesh = _mesh()
    a = distribute_tensor(_full((9, 4), 0), mesh, [Shard(0)])
    b = distribute_tensor(_full((9, 4), 1), mesh, [Shard(0)])
    views = xd.aligned_locals(a, b)
    views[0].add_(1.0)  # writes a's shard
    wrote = bool(torch.equal(a.full_tensor(), _full((9, 4), 0) + 1.0))
    mixed = xd.aligned_locals(a, distribute_tensor(_full((9, 4), 1), mesh, [Replicate()]))
    plain = xd.aligned_locals(a, _full((9, 4), 1))
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 9)
    fully_shard(model, mesh=mesh)
    opt = xt.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
    errs = []
    for _ in range(3):
        model(x).square().sum().backward()
        with torch.no_grad():  # the same step in DTensor arithmetic, from the same state
            ref = {}
            for p in model.parameters():
                st = opt.state.get(p) or {"exp_avg": torch.zeros_like(p),
                                          "exp_avg_sq": torch.zeros_like(p),
                                          "step": torch.tensor(0.0)}
                ref[p] = adamw_spec.update_torch(
                    p.detach(), p.grad, st["exp_avg"], st["exp_avg_sq"], None,
                    float(st["step"]) + 1, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8,
                    eps_root=0.0, weight_decay=0.1, amsgrad=False, maximize=False,
                    bias_correction_dtype="float64", xp=torch)[0].full_tensor()
        opt.step()
        opt.zero_grad()
        errs += [float((p.detach().full_tensor() - ref[p]).abs().max())
                 for p in model.parameters()]
    return {"wrote": wrote, "mixed": mixed is None, "plain": plain is None, "errs": errs}


def galore_owner_rule(enabled: bool) -> dict[str, Any]:
    """Two GaLore refresh steps of two row-sharded matrices under FSDP2, with the owner rule
    on or off: the parameters after them (gathered) and the collectives of the steps."""
    from torch.distributed.fsdp import fully_shard

    import xopt.torch as xt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9, bias=False),
                                torch.nn.Linear(9, 7, bias=False))
    fully_shard(model, mesh=_mesh())
    opt = xt.GaLore(model.parameters(), lr=1e-2, rank=2, update_proj_gap=1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    ops: dict[str, int] = {}
    for _ in range(2):
        model(x).square().sum().backward()
        with xd.CommCounter() as c, xd.owner_rule(enabled):  # the step's collectives only
            opt.step()
        opt.zero_grad()
        for k, v in c.calls_by_op.items():
            ops[k] = ops.get(k, 0) + v
    return {"params": [p.detach().full_tensor() for p in model.parameters()],
            "ops": ops}


def owner_svd(sharded: bool) -> dict[str, Any]:
    """Three matrices decomposed by the owner rule: once each, on their owners; every rank
    receives every result, equal to the SVD of the whole matrix."""
    shapes = [(9, 6), (6, 9), (8, 8)]
    mats = [_full(s, 10 + i).float() for i, s in enumerate(shapes)]
    mesh = _mesh()
    items = []
    for m in mats:
        if sharded:
            d = distribute_tensor(m, mesh, [Shard(0)])
            items.append((d.to_local(), xd.Layout.of(d)))
        else:
            items.append((m, xd.Layout.of(m)))
    owners = xd.assign_owners([float(m.numel()) for m in mats], dist.get_world_size())
    calls = []

    def fn(i: int, whole: torch.Tensor) -> list[torch.Tensor]:
        calls.append(i)
        u, s, vh = torch.linalg.svd(whole, full_matrices=False)
        return [u, s, vh]

    def meta(i: int):
        m, n = shapes[i]
        k = min(m, n)
        return [((m, k), torch.float32), ((k,), torch.float32), ((k, n), torch.float32)]

    with xd.CommCounter() as c:
        results = xd.owner_compute(items, owners, fn, meta)
    errs = []
    for m, res in zip(mats, results, strict=True):
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        errs.append(max(float((a - b).abs().max()) for a, b in zip(res, (u, s, vh),
                                                                    strict=True)))
    return {"owners": owners, "calls": calls, "errors": errs, "ops": dict(c.calls_by_op),
            "bytes": dict(c.bytes_by_op)}


def _placed(t: torch.Tensor, mesh, placement) -> torch.Tensor:
    """``t`` as a DTensor of one placement, built from this rank's block alone."""
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    block = t.chunk(world, dim=0)[rank] if isinstance(placement, Shard) else t
    return DTensor.from_local(block.contiguous(), mesh, [placement], run_check=False,
                              shape=t.shape, stride=t.stride())


def _adamw(params, lr=1e-2, **kw):
    from xopt.torch.adamw import AdamW

    return AdamW(params, lr=lr, **kw)


def disagreement(case: str, sharded: bool) -> str:
    """Build an optimizer that differs between the ranks as ``case`` says and run the
    check; return the error message (every rank must raise, with the same text)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    shapes = [(6, 4), (4,)]
    if case == "extra_param" and rank == 1:
        shapes.append((3,))
    if case == "shape" and rank == 1:
        shapes[0] = (6, 5)
    tensors = [torch.randn(s) for s in shapes]
    if sharded:  # (no collective here: the ranks' tensors may differ, as the case says)
        mesh = _mesh()
        params = [torch.nn.Parameter(_placed(t, mesh, Shard(0))) for t in tensors]
        if case == "placement" and rank == 1:
            params[0] = torch.nn.Parameter(_placed(tensors[0], mesh, Replicate()))
    else:
        params = [torch.nn.Parameter(t) for t in tensors]
    lr = 2e-2 if case == "lr" and rank == 1 else 1e-2
    opt = _adamw(params, lr=lr)
    try:
        xd.prepare(opt)
    except xd.RankMismatchError as e:
        return str(e)
    return "no error"


def agreement_is_cached() -> tuple[int, int]:
    """The check communicates at the first step only (and when the groups change)."""
    params = [torch.nn.Parameter(torch.randn(3, 2))]
    opt = _adamw(params)
    with xd.CommCounter() as c1:
        xd.prepare(opt)
    with xd.CommCounter() as c2:
        xd.prepare(opt)
    return sum(c1.calls_by_op.values()), sum(c2.calls_by_op.values())


def mean_of_losses() -> float:
    loss = torch.tensor(1.0 + dist.get_rank())  # 1 and 2
    return float(xd.mean_loss(loss, xd.Ranks([dist.group.WORLD])))


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 4),
                               torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _optimizer(method: str, params) -> torch.optim.Optimizer:
    import xopt.torch as xt

    params = list(params)
    if method == "adamw":
        return xt.AdamW(params, lr=1e-2, weight_decay=0.1)
    if method == "small_fc_lopt":
        return xt.SmallFCLOpt(params, num_training_steps=50, impl="plain")
    if method == "galore":
        mats = [p for p in params if p.ndim == 2]
        rest = [p for p in params if p.ndim != 2]
        return xt.GaLore([{"params": mats, "rank": 2, "update_proj_gap": 2},
                          {"params": rest, "project": False}], lr=1e-2)
    raise ValueError(method)


def sharded_step(method: str, steps: int = 3) -> dict[str, Any]:
    """PyLO's distributed step against the replicated step: the same bits, and each rank
    keeps state for its own tensors only."""
    ref, mine = _model(0), _model(0)
    ref_opt, opt = _optimizer(method, ref.parameters()), _optimizer(method, mine.parameters())
    step = xd.ShardedStep(opt)
    for t in range(steps):
        g = torch.Generator().manual_seed(100 + t)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        for model in (ref, mine):
            ((model(x) - y) ** 2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        step.step()
        opt.zero_grad()
    same = all(torch.equal(a, b) for a, b in zip(ref.parameters(), mine.parameters(),
                                                 strict=True))
    owners = step.owners()
    params = [p for g in opt.param_groups for p in g["params"]]  # the owners' order
    stateful = [i for i, p in enumerate(params) if opt.state.get(p)]
    return {"identical": same, "owners": owners, "stateful": stateful,
            "rank": dist.get_rank()}


def failed_decomposition() -> dict[str, Any]:
    """GaLore on a matrix sharded over the ranks whose gradient holds a NaN in rank 1's
    shard only: its first step's SVD (a refresh), on the matrix's owner, fails. The error
    each rank raised, and whether the parameters or the state changed."""
    from xopt.errors import DecompositionError
    from xopt.torch.galore import GaLore

    mesh = _mesh()
    w = torch.nn.Parameter(_placed(_full((6, 4), 3).float(), mesh, Shard(0)))
    b = torch.nn.Parameter(_placed(_full((4,), 4).float(), mesh, Replicate()))
    g = _full((6, 4), 5).float()
    if dist.get_rank() == 1:
        g[4, 1] = float("nan")  # in rank 1's rows (3 to 5): rank 0 sees a finite shard
    w.grad = _placed(g, mesh, Shard(0))
    b.grad = _placed(torch.ones(4), mesh, Replicate())
    opt = GaLore([{"params": [w], "rank": 2, "update_proj_gap": 2}, {"params": [b]}], lr=1e-2)
    before = [p.to_local().clone() for p in (w, b)]
    try:
        opt.step()
        error = None
    except DecompositionError as e:
        error = str(e)
    return {"error": error, "state": sum(len(s) for s in opt.state.values()),
            "unchanged": all(torch.equal(p.to_local(), q) for p, q in zip((w, b), before,
                                                                           strict=True))}
