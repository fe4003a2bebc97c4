"""Rank-side code of tests/distributed/test_torch_fsdp2_nonfinite_coap8.py.

Reuses the support matrix's model, optimizers, wrapping and snapshots (matrix_cases.py):
a tiny MLP, data parallel on 2 gloo ranks under FSDP2, against one process on the same
global batches (computed inside each rank, alone).
"""

from __future__ import annotations

import math
from typing import Any

import matrix_cases as cases
import numpy as np
import torch
import torch.distributed as dist

from xopt.nonfinite import SKIP_COUNTER

CLOSED = 1e-5
POISONED = 1  # the step whose gradient holds a NaN


def _nan_row(n_rows: int) -> int:
    """The global row of rank 1's first row of a ``Shard(0)`` tensor of ``n_rows`` rows
    (``torch.chunk``'s split, as DTensor's)."""
    return math.ceil(n_rows / dist.get_world_size())


def _poison_rank1(model: torch.nn.Module) -> tuple[str, int]:
    """A NaN in the first weight's gradient, on rank 1's shard only (rank 0's stays
    finite); returns the weight's name and the global row."""
    from torch.distributed.tensor import DTensor

    name, p = next((n, p) for n, p in cases.base(model).named_parameters() if p.ndim == 2)
    assert isinstance(p.grad, DTensor)
    if dist.get_rank() == 1:
        p.grad.to_local()[0, 0] = float("nan")
    return name, _nan_row(p.shape[0])


def _optimizer(method: str, model: torch.nn.Module, nonfinite: str, *, alone: bool = False):
    """The matrix's optimizer of ``method`` with the policy ``nonfinite`` (validated as the
    constructor validates it; the optimizers read the attribute at every step)."""
    from xopt.nonfinite import resolve

    opt = cases.make_optimizer(method, model, alone=alone)
    opt.nonfinite = resolve(nonfinite, None, type(opt).__name__)
    return opt


def nonfinite_fsdp2(method: str, nonfinite: str) -> dict[str, Any]:
    """Three steps under FSDP2, the second with a NaN in one rank's gradient shard, and
    the same in one process (the NaN at the same element of the whole gradient). Returns
    what this rank saw at the poisoned step (``error``: the exception's class and message,
    or None), whether its parameters and state changed there (besides the skip counter),
    the skip counters, and the worst closed-loop error against one process."""
    model = cases.wrap("fsdp2", cases.make_model(method))
    opt = _optimizer(method, cases.base(model), nonfinite)
    ref_model = cases.make_model(method)
    ref = _optimizer(method, ref_model, nonfinite, alone=True)
    out: dict[str, Any] = {"error": None, "ref_error": None}
    worst = (0.0, "-")
    for t in range(3):
        loss = cases.forward_backward(method, model, t, distributed=True)
        ref_loss = cases.forward_backward(method, ref_model, t, distributed=False)
        before = cases.snapshot(model, opt)
        ref_before = cases.snapshot(ref_model, ref)
        if t == POISONED:
            name, row = _poison_rank1(model)
            with torch.no_grad():
                dict(ref_model.named_parameters())[name].grad[row, 0] = float("nan")
        try:
            cases.opt_step(method, opt, loss)
        except Exception as e:  # noqa: BLE001 - what each rank raises is the result
            out["error"] = f"{type(e).__name__}: {e}"
            opt.zero_grad(set_to_none=True)
        try:
            cases.opt_step(method, ref, ref_loss)
        except Exception as e:  # noqa: BLE001
            out["ref_error"] = f"{type(e).__name__}: {e}"
            ref.zero_grad(set_to_none=True)
        now, ref_now = cases.snapshot(model, opt), cases.snapshot(ref_model, ref)
        if t == POISONED:
            out["changed"] = sorted(k for k in now if SKIP_COUNTER not in k and not (
                np.array_equal(now[k], before[k], equal_nan=True)))
            out["ref_changed"] = sorted(k for k in ref_now if SKIP_COUNTER not in k and not (
                np.array_equal(ref_now[k], ref_before[k], equal_nan=True)))
        e = cases.worst(now, ref_now, f"step {t}")
        worst = e if e[0] > worst[0] else worst
        out["ranks_agree"] = out.get("ranks_agree", True) and cases.ranks_agree(now)
    final = cases.snapshot(model, opt)
    out["skips"] = sorted({int(v) for k, v in final.items() if k.endswith(SKIP_COUNTER)})
    out["closed"] = worst
    return out


# -- 8-bit COAP ---------------------------------------------------------------------------------


def coap8(model: torch.nn.Module, *, alone: bool = False) -> torch.optim.Optimizer:
    import xopt.torch as xt
    from xopt.torch.distributed import set_process_group

    params = [p for p in model.parameters() if p.requires_grad]
    mats = [p for p in params if p.ndim == 2]
    rest = [p for p in params if p.ndim != 2]
    opt = xt.COAP([{"params": mats}, {"params": rest, "project": False}], lr=1e-2, rank=2,
                  update_interval=2, reproject_factor=2, state_bits=8)
    if alone:
        set_process_group(opt, None)
    return opt


def _step(model, opt, t: int, distributed: bool) -> None:
    cases.forward_backward("coap", model, t, distributed)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state_dicts(model, opt) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _load(model, opt, sd) -> None:
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


def _coap_model(rows: int) -> torch.nn.Module:
    """The matrix's MLP with ``rows`` hidden units: 8 shards evenly on 2 ranks, 9 does not."""
    return cases.make_model("coap", rows)


def coap8_fsdp2_dcp(root: str, rows: int) -> dict[str, Any]:
    """8-bit COAP under FSDP2 (hidden ``rows``, 8 or 9): 2 steps on 2 ranks against one
    process, ``dcp.save``; loaded on 1 rank (bit for bit), a step, saved; loaded on 2 ranks
    (bit for bit), a step. Every tensor, the uint8 codes included, is compared by
    :func:`matrix_cases.worst` (a load: error 0)."""
    import torch.distributed.checkpoint as dcp

    ref_model = _coap_model(rows)
    ref_opt = coap8(ref_model, alone=True)
    ref = []
    for t in range(4):
        _step(ref_model, ref_opt, t, False)
        ref.append(cases.snapshot(ref_model, ref_opt))
    out: dict[str, Any] = {}
    model = cases.wrap("fsdp2", _coap_model(rows))
    opt = coap8(cases.base(model))
    for t in range(2):
        _step(model, opt, t, True)
    saved = cases.snapshot(model, opt)
    out["codes"] = sorted(k for k, v in saved.items() if v.dtype == np.uint8)
    out["before_save"] = cases.worst(saved, ref[1], "2 steps on 2 ranks")
    out["ranks_agree"] = cases.ranks_agree(saved)
    dcp.save(_state_dicts(model, opt), checkpoint_id=f"{root}/at2")
    stepped = None
    if dist.get_rank() == 0:
        m1 = _coap_model(rows)
        o1 = coap8(m1, alone=True)
        sd = _state_dicts(m1, o1)
        dcp.load(sd, checkpoint_id=f"{root}/at2", no_dist=True)
        _load(m1, o1, sd)
        out["load_at_1"] = cases.worst(cases.snapshot(m1, o1), saved, "loaded on 1 rank")
        _step(m1, o1, 2, False)
        stepped = cases.snapshot(m1, o1)
        out["step_at_1"] = cases.worst(stepped, ref[2], "step 2 on 1 rank")
        dcp.save(_state_dicts(m1, o1), checkpoint_id=f"{root}/at1", no_dist=True)
    box = [stepped]
    dist.broadcast_object_list(box, src=0)
    model = cases.wrap("fsdp2", _coap_model(rows))
    opt = coap8(cases.base(model))
    sd = _state_dicts(cases.base(model), opt)
    dcp.load(sd, checkpoint_id=f"{root}/at1")
    _load(cases.base(model), opt, sd)
    out["load_at_2"] = cases.worst(cases.snapshot(model, opt), box[0], "loaded on 2 ranks")
    _step(model, opt, 3, True)
    out["step_at_2"] = cases.worst(cases.snapshot(model, opt), ref[3], "step 3 on 2 ranks")
    return out


# -- a parameter FSDP2 leaves plain beside sharded ones ------------------------------------------


class _ScaledLinear(torch.nn.Module):
    """An 8 × 8 weight (FSDP2 shards it) times a scalar gain (left out of FSDP2, as a user
    leaves a scalar: a plain tensor whose gradient the user averages)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gain = torch.nn.Parameter(torch.tensor(0.7))  # first: the step's first tensor
        self.weight = torch.nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T * self.gain


def _scaled_step(method: str, model, opt, t: int, distributed: bool) -> None:
    x, y = cases.batch("poet", t)  # 8 × 8 inputs and targets
    if distributed:
        x, y = cases.my_rows(x), cases.my_rows(y)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    if distributed:  # FSDP2 reduces only what it manages
        g = model.gain.grad
        dist.all_reduce(g)
        g.div_(dist.get_world_size())
    cases.opt_step(method, opt, loss.detach())


def plain_beside_sharded(method: str) -> dict[str, Any]:
    """3 steps of a learned optimizer over :class:`_ScaledLinear` under FSDP2 (the weight
    a DTensor, the gain plain) against one process: the worst closed-loop error, whether
    the ranks agree, and the classes of the gain's state tensors (plain, as the gain)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ref_model = _ScaledLinear()
    ref = cases.make_optimizer(method, ref_model, alone=True)
    model = _ScaledLinear()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                ignored_params={model.gain})
    opt = cases.make_optimizer(method, model)
    worst, agree = (0.0, "-"), True
    for t in range(3):
        _scaled_step(method, ref_model, ref, t, False)
        _scaled_step(method, model, opt, t, True)
        now = cases.snapshot(model, opt)
        e = cases.worst(now, cases.snapshot(ref_model, ref), f"step {t}")
        worst = e if e[0] > worst[0] else worst
        agree = agree and cases.ranks_agree(now)
    return {"closed": worst, "ranks_agree": agree,
            "weight": type(model.weight).__name__,
            "gain_state": sorted({type(v).__name__ for v in opt.state[model.gain].values()
                                  if isinstance(v, torch.Tensor)})}


def coap8_blocks_across_shards(rounding: str) -> dict[str, Any]:
    """8-bit COAP's AdamW moments of a 9 × 1000 weight (9000 entries: blocks of 4096 at
    entries 0, 4096 and 8192, so the second block spans both ranks' rows, 5 and 4) under
    FSDP2, given the same gradients as one process for 2 steps: the keys whose bytes differ
    from one process's (the moments are elementwise, so none may), and the placements of
    the codes and absmax."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    import xopt.torch as xt
    from xopt.torch.distributed import set_process_group

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(1000, 9, bias=False)

    def coap(m: torch.nn.Module) -> torch.optim.Optimizer:
        return xt.COAP([{"params": [m.weight], "project": False}], lr=1e-2, rank=2,
                       state_bits=8, quant_rounding=rounding)

    ref_model = make()
    ref = coap(ref_model)
    set_process_group(ref, None)
    model = make()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model, mesh=mesh)
    opt = coap(model)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        grad = torch.randn(9, 1000, generator=g) * torch.logspace(-4, 0, 1000)
        ref_model.weight.grad = grad.clone()
        model.weight.grad = distribute_tensor(grad, mesh, [Shard(0)])
        ref.step()
        opt.step()
    now, one = cases.snapshot(model, opt), cases.snapshot(ref_model, ref)
    st = opt.state[model.weight]
    return {"differ": sorted(k for k in one if not np.array_equal(now[k], one[k])),
            "keys": sorted(one),
            "codes": str(st["exp_avg_codes"].placements),
            "absmax": str(st["exp_avg_absmax"].placements),
            "blocks": int(st["exp_avg_absmax"].shape[0])}


def coap_kernel_fsdp2(steps: int = 3) -> dict[str, Any]:
    """COAP with a projected 4-D kernel (Tucker-2, refreshed every other update) under
    FSDP2, against one process on the same global batches, teacher-forced and closed loop;
    ``tucker_inputs``: the types of the tensors each of the spec's Tucker functions (HOOI,
    the projection, the restoration, Eqn 6's gradient) was given."""
    from torch import nn

    import xopt.torch as xt
    from xopt.specs import coap as spec

    tucker_inputs: dict[str, set[str]] = {}
    originals = {f: getattr(spec, f) for f in ("partial_tucker", "tucker_project",
                                                "tucker_restore", "tucker_eqn6_grad")}

    def spy(f: str) -> Any:
        def call(xp: Any, *args: Any, **kw: Any) -> Any:
            seen = tucker_inputs.setdefault(f, set())
            seen.update(type(a).__name__ for a in args if isinstance(a, torch.Tensor))
            return originals[f](xp, *args, **kw)
        return call

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 16, 2))

    def optimizer(m: nn.Module) -> torch.optim.Optimizer:
        kernel = m[0].weight  # the kernel alone projected: the test is about its refresh
        rest = [p for p in m.parameters() if p is not kernel]
        return xt.COAP([{"params": [kernel], "project": True},
                        {"params": rest, "project": False}], lr=1e-2, rank=2,
                       rank_ratio_cnn=4.0, update_interval=2, reproject_factor=2)

    def batch(t: int, distributed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(2000 + t)
        x, y = torch.randn(cases.GLOBAL_BATCH, 3, 4, 4, generator=g), \
            torch.randn(cases.GLOBAL_BATCH, 2, generator=g)
        return (cases.my_rows(x), cases.my_rows(y)) if distributed else (x, y)

    def loss_of(m: nn.Module, t: int, distributed: bool) -> torch.Tensor:
        x, y = batch(t, distributed)
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        return loss

    for f in originals:
        setattr(spec, f, spy(f))
    try:
        sharded = cases.wrap("fsdp2", model())
        opt = optimizer(sharded)
        alone = model()
        alone_opt = optimizer(alone)
        tf_model = model()
        tf_opt = optimizer(tf_model)
        teacher = closed = params = (0.0, "-: -")
        for t in range(steps):
            loss_of(alone, t, False)
            alone_opt.step()
            alone_opt.zero_grad()
            loss_of(sharded, t, True)
            cases.load_snapshot(tf_model, tf_opt, cases.snapshot(sharded, opt))
            cases.set_grads(tf_model, cases.data_parallel_grads(sharded))
            tf_opt.step()
            opt.step()
            opt.zero_grad()
            now = cases.snapshot(sharded, opt)
            teacher = max(teacher, cases.worst(now, cases.snapshot(tf_model, tf_opt),
                                               f"step {t}"), key=lambda e: e[0])
            ref = cases.snapshot(alone, alone_opt)
            closed = max(closed, cases.worst(now, ref, f"step {t}"), key=lambda e: e[0])
            params = max(params, cases.worst(
                {k: v for k, v in now.items() if k.startswith("param/")},
                {k: v for k, v in ref.items() if k.startswith("param/")}, f"step {t}"),
                key=lambda e: e[0])
    finally:
        for f, fn in originals.items():
            setattr(spec, f, fn)
    return {"teacher": teacher, "closed": closed, "closed_params": params,
            "tucker_inputs": {f: sorted(v) for f, v in tucker_inputs.items()}}
